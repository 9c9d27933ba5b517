"""build-wheel: a patched sglang-0.5.17+elastic<N> wheel that installs offline."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sglang_elastic import patchset

HTTP = "sglang/srt/entrypoints/http_server.py"


def test_build_wheel_rewrites_version_record_and_patched_files(test_wheel, tmp_path):
    out = patchset.build_wheel(test_wheel, tmp_path / "dist")
    tags = test_wheel.name.split("-", 2)[2]
    assert out.name == f"sglang-0.5.17+elastic1-{tags}"
    with zipfile.ZipFile(out) as z, zipfile.ZipFile(test_wheel) as orig:
        names = set(z.namelist())
        assert "sglang-0.5.17+elastic1.dist-info/RECORD" in names
        assert not any(n.startswith("sglang-0.5.17.dist-info/") for n in names)
        assert "Version: 0.5.17+elastic1" in z.read("sglang-0.5.17+elastic1.dist-info/METADATA").decode()
        # Every RECORD line names a file of the wheel with its true hash and size.
        record = csv.reader(io.StringIO(z.read("sglang-0.5.17+elastic1.dist-info/RECORD").decode()))
        listed = set()
        for path, digest, size in record:
            listed.add(path)
            if path.endswith("/RECORD"):
                continue
            data = z.read(path)
            assert digest == "sha256=" + patchset.sha256_b64(data) and int(size) == len(data), path
        assert listed == {n for n in names if not n.endswith("/")}
        # Only the series' files differ from the input wheel.
        changed = {n for n in orig.namelist() if not n.startswith("sglang-0.5.17.dist-info/") and orig.read(n) != z.read(n)}
        assert changed == set(patchset.touched_files(patchset.load_series()))
        manifest = patchset.load_manifest()
        assert patchset.sha256_b64(z.read(HTTP)) == manifest["files"][HTTP]["after"]["0001-server-info.patch"]


def test_build_wheel_refuses_another_version(tmp_path):
    fake = tmp_path / "sglang-0.5.16-cp311-cp311-manylinux_2_34_x86_64.whl"
    with zipfile.ZipFile(fake, "w") as z:
        z.writestr("sglang/__init__.py", "")
    with pytest.raises(patchset.PatchError, match="0.5.16.*targets 0.5.17 only"):
        patchset.build_wheel(fake, tmp_path / "dist")
    assert not (tmp_path / "dist").exists()


def test_built_wheel_installs_offline_into_a_fresh_venv_and_reports_applied(test_wheel, tmp_path):
    whl = patchset.build_wheel(test_wheel, tmp_path / "dist")
    venv = tmp_path / "venv"
    # a fresh venv without its own pip (ensurepip took ~10 s): this environment's pip installs into it
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-index", "--no-deps", str(whl)], check=True)
    site = Path(subprocess.check_output([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    assert (site / "sglang-0.5.17+elastic1.dist-info").is_dir()

    def status():
        return subprocess.run([sys.executable, "-m", "sglang_elastic.cli", "patch", "status", "--sglang-dir", str(site)], capture_output=True, text=True)

    r = status()
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].endswith(": applied") and "0.5.17+elastic1" in r.stdout
    # The RECORD of a patched install describes the patched files; revert
    # still restores the 0.5.17 wheel's bytes (the manifest knows them) ...
    r = subprocess.run([sys.executable, "-m", "sglang_elastic.cli", "patch", "revert", "--sglang-dir", str(site)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with zipfile.ZipFile(test_wheel) as z:
        assert (site / HTTP).read_bytes() == z.read(HTTP)
    assert status().stdout.splitlines()[0].endswith(": pristine")
    # ... and apply works again there.
    r = subprocess.run([sys.executable, "-m", "sglang_elastic.cli", "patch", "apply", "--sglang-dir", str(site)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert status().stdout.splitlines()[0].endswith(": applied")
