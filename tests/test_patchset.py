"""The patch series tooling, specified against real SGLang 0.5.17 files."""

from __future__ import annotations

import difflib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_elastic import patchset
from sglang_elastic.patchset import HunkState, PatchError, State

from conftest import installed_sglang_root, make_site, snapshot

HTTP = "sglang/srt/entrypoints/http_server.py"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_elastic.cli", *args], capture_output=True, text=True)


def synthetic_patch(site: Path, rel: str, name: str, old: str, new: str) -> patchset.Patch:
    """A one-hunk patch replacing the first ``old`` line of ``rel`` by ``new``."""
    a = (site / rel).read_text().splitlines(keepends=True)
    b = list(a)
    i = next(k for k, ln in enumerate(b) if old in ln)
    b[i] = b[i].replace(old, new)
    diff = "".join(difflib.unified_diff(a, b, f"a/{rel}", f"b/{rel}"))
    return patchset.parse_patch(name, f"# {name}: test patch\n" + diff)


# --- the committed series ---------------------------------------------------


def test_every_patch_is_headed_by_a_comment_and_named_in_series():
    series = patchset.load_series()
    assert [p.name for p in series] == patchset.load_manifest()["series"]
    for p in series:
        assert p.name[:4].isdigit() and p.name.endswith(".patch")
        lines = [ln for ln in p.header.splitlines() if ln.strip()]
        assert len(lines) >= 3 and all(ln.startswith("#") for ln in lines), p.name


def test_manifest_matches_the_series_on_the_installed_wheel_files():
    root = installed_sglang_root()
    series = patchset.load_series()
    pristine = {rel: (root / rel).read_bytes() for rel in patchset.touched_files(series)}
    assert patchset.build_manifest(series, pristine) == patchset.load_manifest()


# --- apply / status / revert ------------------------------------------------


def test_apply_status_revert_round_trip_is_byte_identical(sglang_site):
    before = snapshot(sglang_site)
    inst = patchset.locate(sglang_site)
    assert inst.version == "0.5.17"
    assert patchset.overall(patchset.status(inst)) is State.PRISTINE
    # The wheel's RECORD vouches for the starting bytes.
    assert inst.record[HTTP] == patchset.sha256_b64(before[HTTP])

    written = patchset.apply(inst)
    assert written == [HTTP]
    text = (sglang_site / HTTP).read_text()
    assert '"sglang_elastic": _sglang_elastic_server_info(server_args)' in text
    assert [s.state for s in patchset.status(inst)] == [State.APPLIED]

    assert patchset.revert(inst) == [HTTP]
    assert snapshot(sglang_site) == before
    assert patchset.overall(patchset.status(inst)) is State.PRISTINE


def test_refuses_a_fake_0_5_16_tree_and_changes_nothing(sglang_site):
    (meta,) = sglang_site.glob("sglang-*.dist-info/METADATA")
    meta.write_text(meta.read_text().replace("Version: 0.5.17", "Version: 0.5.16", 1))
    before = snapshot(sglang_site)
    for op in (patchset.apply, patchset.revert, patchset.status):
        with pytest.raises(PatchError, match=r"SGLang 0\.5\.16 at .*: this series is for 0\.5\.17 only"):
            op(patchset.locate(sglang_site))
    assert snapshot(sglang_site) == before


def test_refuses_a_hand_edited_file_and_changes_nothing(sglang_site):
    f = sglang_site / HTTP
    f.write_text(f.read_text().replace("async def server_info():", "async def server_info():  # local tweak", 1))
    before = snapshot(sglang_site)
    inst = patchset.locate(sglang_site)
    assert patchset.status(inst)[0].state is State.FOREIGN
    with pytest.raises(PatchError, match="foreign changes.*sglang-elastic patch restore --from-wheel"):  # what to run, not only status
        patchset.apply(inst)
    with pytest.raises(PatchError, match="foreign changes"):
        patchset.revert(inst)
    assert snapshot(sglang_site) == before


def test_refuses_a_file_that_differs_from_the_record_even_if_the_manifest_knows_it(sglang_site):
    # A RECORD that does not vouch for the bytes (e.g. another build of 0.5.17).
    (rec,) = sglang_site.glob("sglang-*.dist-info/RECORD")
    rec.write_text(rec.read_text().replace(f"{HTTP},sha256=", f"{HTTP},sha256=x", 1))
    before = snapshot(sglang_site)
    with pytest.raises(PatchError, match="RECORD hash mismatch"):
        patchset.apply(patchset.locate(sglang_site))
    assert snapshot(sglang_site) == before


def test_refuses_an_already_applied_series(sglang_site):
    inst = patchset.locate(sglang_site)
    patchset.apply(inst)
    after = snapshot(sglang_site)
    with pytest.raises(PatchError, match="is applied"):
        patchset.apply(inst)
    assert snapshot(sglang_site) == after


def test_partly_applied_series_is_reported_and_refused(tmp_path):
    site = make_site(tmp_path / "site")
    p1 = patchset.load_series()[0]
    p2 = synthetic_patch(site, "sglang/_version.py", "0002-test.patch", "= (0, 5, 17)", "= (0, 5, 17)  # test")
    series = [p1, p2]
    pristine = {rel: (site / rel).read_bytes() for rel in patchset.touched_files(series)}
    manifest = patchset.build_manifest(series, pristine)
    inst = patchset.locate(site)
    patchset.apply(inst, [p1], manifest)  # only the first one
    st = patchset.status(inst, series, manifest)
    assert [s.state for s in st] == [State.APPLIED, State.PRISTINE]
    assert patchset.overall(st) is State.PARTIAL
    before = snapshot(site)
    with pytest.raises(PatchError, match="0001-server-info.patch is applied"):
        patchset.apply(inst, series, manifest)
    with pytest.raises(PatchError, match="0002-test.patch is pristine"):
        patchset.revert(inst, series, manifest)
    assert snapshot(site) == before


def test_a_failed_write_rolls_back_the_files_already_written(tmp_path, monkeypatch):
    site = make_site(tmp_path / "site")
    p1 = patchset.load_series()[0]
    p2 = synthetic_patch(site, "sglang/_version.py", "0002-test.patch", "= (0, 5, 17)", "= (0, 5, 17)  # test")
    series = [p1, p2]
    pristine = {rel: (site / rel).read_bytes() for rel in patchset.touched_files(series)}
    manifest = patchset.build_manifest(series, pristine)
    before = snapshot(site)
    real_replace = os.replace
    calls = []

    def flaky_replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("disk full")
        return real_replace(src, dst)

    monkeypatch.setattr(patchset.os, "replace", flaky_replace)
    with pytest.raises(PatchError, match="nothing changed: disk full"):
        patchset.apply(patchset.locate(site), series, manifest)
    assert len(calls) == 2  # the first file had been replaced, then restored
    assert snapshot(site) == before


# --- hunk search (check) ----------------------------------------------------


def _src_tree(tmp_path: Path, edit) -> patchset.Install:
    site = make_site(tmp_path / "src")
    f = site / HTTP
    f.write_text(edit(f.read_text()))
    return patchset.locate(site)


def test_check_reports_exact_offset_fuzz_and_conflict(tmp_path):
    exact = patchset.check(_src_tree(tmp_path / "a", lambda t: t))
    assert [(r.state, r.offset) for r in exact] == [(HunkState.EXACT, 0)]

    shifted = patchset.check(_src_tree(tmp_path / "b", lambda t: "# one\n# two\n# three\n" + t))
    assert [(r.state, r.offset) for r in shifted] == [(HunkState.OFFSET, 3)]

    # The outermost context line of hunk 1 changed: only fuzz 1 finds it.
    fuzzy = patchset.check(_src_tree(tmp_path / "c", lambda t: t.replace("            # `None` when publishing is disabled", "            # None when publishing is disabled", 1)))
    assert [(r.state, r.fuzz, r.offset) for r in fuzzy] == [(HunkState.FUZZ, 1, 0)]

    gone = patchset.check(_src_tree(tmp_path / "d", lambda t: t.replace('"kv_events": server_args.describe_kv_events_publisher(),', "")))
    assert [r.state for r in gone] == [HunkState.CONFLICT]


def test_fuzzy_apply_keeps_the_files_own_context_lines():
    fp = patchset.parse_patch(
        "x.patch",
        "--- a/sglang/f.py\n+++ b/sglang/f.py\n@@ -1,5 +1,6 @@\n a\n b\n c\n+NEW\n d\n e\n",
    ).files[0]
    new, res = patchset.apply_to_text(fp, "z\nA\nb\nc\nd\ne\n", max_fuzz=2)
    assert new == "z\nA\nb\nc\nNEW\nd\ne\n"
    assert (res[0].state, res[0].fuzz, res[0].offset) == (HunkState.FUZZ, 1, 1)
    back, res = patchset.apply_to_text(fp, new, reverse=True, max_fuzz=2)
    assert back == "z\nA\nb\nc\nd\ne\n"


def test_malformed_hunk_is_a_clear_error():
    with pytest.raises(PatchError, match="header says"):
        patchset.parse_patch("bad.patch", "--- a/sglang/f\n+++ b/sglang/f\n@@ -1,3 +1,3 @@\n a\n-b\n+c\n")


@pytest.mark.parametrize(
    "old,new,msg",
    [("a/sglang/../etc/x", "b/sglang/../etc/x", "not a path inside"), ("a/vllm/x.py", "b/vllm/x.py", "not a path inside"), ("/dev/null", "b/sglang/new.py", "creating or deleting")],
)
def test_patches_may_only_edit_existing_files_inside_sglang(old, new, msg):
    with pytest.raises(PatchError, match=msg):
        patchset.parse_patch("evil.patch", f"--- {old}\n+++ {new}\n@@ -1 +1 @@\n-a\n+b\n")


# --- command line -----------------------------------------------------------


def test_cli_status_apply_revert_and_one_line_refusal(sglang_site):
    r = cli("patch", "status", "--sglang-dir", str(sglang_site))
    assert r.returncode == 0 and ": pristine" in r.stdout.splitlines()[0], r.stdout + r.stderr
    assert cli("patch", "apply", "--sglang-dir", str(sglang_site)).returncode == 0
    r = cli("patch", "apply", "--sglang-dir", str(sglang_site))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "refusing" in r.stderr
    assert f"patch status --sglang-dir {sglang_site}" in r.stderr  # names the tree it refused, not the installed one
    r = cli("patch", "status", "--sglang-dir", str(sglang_site / "sglang"))
    assert ": applied" in r.stdout.splitlines()[0]
    assert cli("patch", "revert", "--sglang-dir", str(sglang_site)).returncode == 0
    r = cli("patch", "status", "--sglang-dir", str(sglang_site / "nowhere"))
    assert r.returncode == 2 and r.stderr == f"sglang-elastic: {sglang_site / 'nowhere'} does not exist; pass the sglang package directory or the site-packages holding it\n"
    r = cli("patch", "status", "--sglang-dir", str(sglang_site / "sglang" / "srt"))
    assert r.returncode == 2 and "holds no sglang package (looked for sglang/srt there" in r.stderr and len(r.stderr.splitlines()) == 1


def test_cli_check_writes_a_report(tmp_path):
    src = _src_tree(tmp_path, lambda t: "\n" + t)
    report = tmp_path / "rebase.md"
    r = cli("patch", "check", "--sglang-src", str(src.root), "--report", str(report))
    assert r.returncode == 0, r.stderr
    text = report.read_text()
    assert "| 0001-server-info.patch | `sglang/srt/entrypoints/http_server.py` | #1 | offset (+1 lines) |" in text
    r = cli("patch", "check", "--sglang-src", str(src.root), "--report", str(tmp_path / "no" / "rebase.md"))
    assert r.returncode == 2 and r.stderr == f"sglang-elastic: {tmp_path / 'no' / 'rebase.md'}: No such file or directory\n"  # not 'FileNotFoundError: [Errno 2] ...'


def test_cli_check_exits_1_when_a_hunk_conflicts(tmp_path):
    """A script can tell: conflicts exit 1 with the report on stdout and one line on stderr; offsets and fuzz exit 0."""
    src = _src_tree(tmp_path / "a", lambda t: t.replace('"kv_events": server_args.describe_kv_events_publisher(),', ""))
    r = cli("patch", "check", "--sglang-src", str(src.root))
    assert r.returncode == 1 and "| #1 | conflicts |" in r.stdout
    assert r.stderr == "sglang-elastic: 1 of 1 hunk(s) conflict with SGLang 0.5.17 (0001-server-info.patch): the series does not apply there; rebase those patches\n"
    fuzzy = _src_tree(tmp_path / "b", lambda t: t.replace("            # `None` when publishing is disabled", "            # None when publishing is disabled", 1))
    r = cli("patch", "check", "--sglang-src", str(fuzzy.root))
    assert r.returncode == 0 and "| #1 | fuzz 1" in r.stdout and r.stderr == ""


def _set_version(site: Path, version: str) -> None:
    """A cheap other release: the dist-info and the version file say ``version``."""
    (meta,) = site.glob("sglang-*.dist-info/METADATA")
    meta.write_text(meta.read_text().replace("Version: 0.5.17", f"Version: {version}", 1))
    v = site / "sglang/_version.py"
    v.write_text(v.read_text().replace("'0.5.17'", f"'{version}'"))


@pytest.mark.parametrize("version, edit", [("0.5.16", False), ("0.5.23", True)])
def test_status_of_another_release_names_the_version_before_any_hash(sglang_site, version, edit):
    """A 0.5.16 tree whose files match read 'pristine', a 0.5.23 tree whose
    files differ 'foreign changes': both are another release, said first."""
    _set_version(sglang_site, version)
    if edit:  # a newer release's own change to the file the series touches
        f = sglang_site / HTTP
        f.write_text(f.read_text() + "\n# 0.5.23\n")
    before = snapshot(sglang_site)
    for op in ("status", "apply", "revert"):
        r = cli("patch", op, "--sglang-dir", str(sglang_site))
        assert r.returncode == 2 and r.stdout == "", (op, r.stdout)
        assert r.stderr.startswith(f"sglang-elastic: SGLang {version} at {sglang_site / 'sglang'}: this series is for 0.5.17 only; ") and len(r.stderr.splitlines()) == 1, r.stderr
        assert "pristine" not in r.stderr and "foreign" not in r.stderr
    assert "patch check --sglang-src" in r.stderr
    assert snapshot(sglang_site) == before


def test_a_version_file_of_another_release_is_refused_though_the_dist_info_says_0_5_17(sglang_site):
    v = sglang_site / "sglang/_version.py"
    v.write_text(v.read_text().replace("'0.5.17'", "'0.5.16'"))
    r = cli("patch", "status", "--sglang-dir", str(sglang_site))
    assert r.returncode == 2 and "SGLang 0.5.16 (its version file; its dist-info says 0.5.17) at " in r.stderr and "this series is for 0.5.17 only" in r.stderr


def test_revert_of_an_edited_tree_names_the_file_and_restore_overwrites_it_from_the_wheel(sglang_site, test_wheel):
    """revert refuses a hand-edited file (its result would not be the wheel's)
    and names the explicit way out; restore --from-wheel writes the wheel's
    bytes, says which file it overwrote and what it held, and a second
    restore writes nothing."""
    import zipfile

    inst = patchset.locate(sglang_site)
    patchset.apply(inst)
    f = sglang_site / HTTP
    f.write_text(f.read_text().replace("async def server_info():", "async def server_info():  # local tweak", 1))
    edited = snapshot(sglang_site)
    r = cli("patch", "revert", "--sglang-dir", str(sglang_site))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and snapshot(sglang_site) == edited
    assert f"has foreign changes (changed by something else: {HTTP}); revert takes out only the series' own changes. " in r.stderr
    assert f"To overwrite {HTTP} with the SGLang 0.5.17 wheel's: sglang-elastic patch restore --from-wheel [WHEEL] --sglang-dir {sglang_site}\n" in r.stderr
    r = cli("patch", "restore", "--sglang-dir", str(sglang_site))  # explicit: never without --from-wheel
    assert r.returncode == 2 and "--from-wheel" in r.stderr and snapshot(sglang_site) == edited
    r = cli("patch", "restore", "--from-wheel", str(test_wheel), "--sglang-dir", str(sglang_site))
    assert r.returncode == 0, r.stderr
    assert r.stdout == (f"restored 1 file(s) of SGLang 0.5.17 at {sglang_site / 'sglang'} from {test_wheel.name}:\n"
                        f"  overwrote {HTTP} (it was: foreign changes)\n")
    with zipfile.ZipFile(test_wheel) as z:
        assert f.read_bytes() == z.read(HTTP)
    assert patchset.overall(patchset.status(inst)) is State.PRISTINE
    restored = snapshot(sglang_site)
    r = cli("patch", "restore", "--from-wheel", str(test_wheel), "--sglang-dir", str(sglang_site))
    assert r.returncode == 0 and "already as in" in r.stdout and "nothing overwritten" in r.stdout and snapshot(sglang_site) == restored
    # a missing file comes back too, and a patched one says so
    patchset.apply(inst)
    assert [w for _, w in patchset.restore_from_wheel(inst, test_wheel)] == ["patched by 0001-server-info.patch"]
    f.unlink()
    assert patchset.restore_from_wheel(inst, test_wheel) == [(HTTP, "missing")] and snapshot(sglang_site) == restored


def test_restore_refuses_another_release_and_a_wrong_wheel_changing_nothing(sglang_site, test_wheel, tmp_path):
    f = sglang_site / HTTP
    f.write_text(f.read_text() + "# edit\n")
    before = snapshot(sglang_site)
    fake = tmp_path / "sglang-0.5.16-py3-none-any.whl"
    fake.write_bytes(test_wheel.read_bytes())
    for args, says in ((["--from-wheel", str(fake)], "sglang-0.5.16-py3-none-any.whl is not the sglang 0.5.17 wheel"),
                       (["--from-wheel", str(tmp_path / "none.whl")], "no such file")):
        r = cli("patch", "restore", *args, "--sglang-dir", str(sglang_site))
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    _set_version(sglang_site, "0.5.23")
    before = snapshot(sglang_site)
    r = cli("patch", "restore", "--from-wheel", str(test_wheel), "--sglang-dir", str(sglang_site))
    assert r.returncode == 2 and "SGLang 0.5.23" in r.stderr and "this series is for 0.5.17 only" in r.stderr
    assert snapshot(sglang_site) == before


# --- odd installs -----------------------------------------------------------


def test_missing_file_is_named_as_missing(sglang_site):
    (sglang_site / HTTP).unlink()
    (st,) = patchset.status(patchset.locate(sglang_site))
    assert st.state is State.FOREIGN and f"{HTTP} (missing)" in st.detail


def test_two_dist_infos_are_refused_rather_than_guessed(sglang_site):
    (sglang_site / "sglang-0.5.9.dist-info").mkdir()
    with pytest.raises(PatchError, match="several SGLang dist-infos"):
        patchset.locate(sglang_site)


def test_check_on_a_patched_tree_says_already_applied_not_conflicts(sglang_site):
    """A new user ran ``patch check`` on the install they had patched: every hunk read "conflicts"."""
    assert cli("patch", "apply", "--sglang-dir", str(sglang_site)).returncode == 0
    rows = patchset.check(patchset.locate(sglang_site))
    assert rows and {r.state for r in rows} == {HunkState.APPLIED}
    r = cli("patch", "check", "--sglang-src", str(sglang_site))
    assert r.returncode == 0 and "| already applied |" in r.stdout and "conflicts" not in r.stdout, r.stdout + r.stderr
    assert cli("patch", "revert", "--sglang-dir", str(sglang_site)).returncode == 0
    assert {r.state for r in patchset.check(patchset.locate(sglang_site))} == {HunkState.EXACT}


def test_a_half_patched_tree_reads_partly_applied(tmp_path):
    """One patch over two files, only the first already in the tree: not 'already applied' (which exits 0)."""
    other = "sglang/srt/server_args.py"
    site = make_site(tmp_path / "src", extra_files=[other])
    a = synthetic_patch(site, HTTP, "0009-two.patch", "import", "import  ")
    b = synthetic_patch(site, other, "0009-two.patch", "import", "import  ")
    two = patchset.Patch("0009-two.patch", a.header, a.files + b.files)
    f = site / HTTP
    f.write_text(patchset.apply_to_text(a.files[0], f.read_text())[0])  # the first file's hunk is in, the second's not
    rows = patchset.check(patchset.locate(site), series=[two])
    assert [(r.path, r.state) for r in rows] == [(HTTP, HunkState.APPLIED), (other, HunkState.EXACT)]
    assert patchset.verdicts(rows) == {"0009-two.patch": patchset.PARTLY_APPLIED}
    assert "| 0009-two.patch | partly applied |" in patchset.check_report(patchset.locate(site), rows)


def test_crlf_file_conflicts_in_check_as_it_would_in_apply(tmp_path):
    src = _src_tree(tmp_path, lambda t: t.replace("\n", "\r\n"))
    assert [r.state for r in patchset.check(src)] == [HunkState.CONFLICT]


def test_check_accepts_a_git_checkout_without_a_version(tmp_path):
    # A checkout: python/sglang/..., no dist-info, version from setuptools-scm only.
    repo = tmp_path / "repo"
    (repo / "python" / "sglang" / "srt" / "entrypoints").mkdir(parents=True)
    (repo / HTTP.replace("sglang/", "python/sglang/", 1)).write_bytes((installed_sglang_root() / HTTP).read_bytes())
    r = cli("patch", "check", "--sglang-src", str(repo))
    assert r.returncode == 0, r.stderr
    assert "against SGLang unknown" in r.stdout and "| #1 | applies |" in r.stdout
    r = cli("patch", "status", "--sglang-dir", str(repo))
    assert r.returncode == 2 and "cannot tell the SGLang version" in r.stderr


@pytest.mark.parametrize("kind", ["missing", "not-zip", "no-record"])
def test_build_wheel_bad_inputs_are_one_line_errors(tmp_path, kind):
    whl = tmp_path / "sglang-0.5.17-cp311-cp311-manylinux_2_34_x86_64.whl"
    if kind == "not-zip":
        whl.write_text("hello")
    elif kind == "no-record":
        import zipfile

        with zipfile.ZipFile(whl, "w") as z:
            z.writestr("sglang/__init__.py", "")
    r = cli("patch", "build-wheel", "--wheel", str(whl), "--out", str(tmp_path / "dist"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert {"missing": "no such file", "not-zip": "not a zip archive", "no-record": "RECORD"}[kind] in r.stderr


def test_a_reader_that_stops_early_is_not_an_error(sglang_site):
    """host_batch.sh reads `patch status | head -1` under pipefail: a closed
    pipe (here closed before anything is written) must not turn into
    'sglang-elastic: BrokenPipeError' and status 2."""
    r_fd, w_fd = os.pipe()
    os.close(r_fd)
    try:
        r = subprocess.run([sys.executable, "-m", "sglang_elastic.cli", "patch", "status", "--sglang-dir", str(sglang_site)],
                           stdout=w_fd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    finally:
        os.close(w_fd)
    assert (r.returncode, r.stderr) == (0, "")
