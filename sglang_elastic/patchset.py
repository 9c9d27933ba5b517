"""The patch series against SGLang 0.5.17 and the operations on it.

The series lives in ``patches/`` (shipped as ``sglang_elastic.patches``): a
``series`` file naming ``NNNN-topic.patch`` files in order, each a unified diff
whose paths are relative to ``site-packages`` (``a/sglang/srt/...``), i.e. the
same paths as the SGLang wheel's ``RECORD``. ``manifest.json`` holds, for every
file the series touches, its sha256 in the 0.5.17 wheel and after each patch
that touches it; that is what lets ``status`` and ``revert`` work on an install
whose ``RECORD`` no longer describes the pristine wheel (a patched wheel built
with ``build-wheel``).

Every operation computes all new file contents in memory first and writes only
when every patch applies exactly; a failed write is rolled back, so a refusal
or an error changes nothing.

Idea and format: GNU ``patch``'s unified diffs and hunk search (offset, then
fuzz by dropping outer context lines); wheel ``RECORD`` hashes per PEP 376/427.
"""

from __future__ import annotations

import base64
import csv
import dataclasses
import enum
import hashlib
import io
import json
import os
import re
import tempfile
from importlib import resources
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

SGLANG_VERSION = "0.5.17"
PACKAGE = "sglang"


class PatchError(RuntimeError):
    """A refusal or failure of a patch operation; its message is one line."""


# ----------------------------------------------------------------------------
# Unified diff parsing and hunk application


@dataclasses.dataclass(frozen=True)
class Hunk:
    """One ``@@ -a,b +c,d @@`` hunk; ``lines`` keep their ' ', '-', '+' tag."""

    src_start: int  # 1-based line number in the old file
    dst_start: int  # 1-based line number in the new file
    lines: Tuple[Tuple[str, str], ...]  # (tag, text with its newline)

    def old(self, reverse: bool = False) -> List[str]:
        keep = " +" if reverse else " -"
        return [t for tag, t in self.lines if tag in keep]

    def new(self, reverse: bool = False) -> List[str]:
        return self.old(not reverse)

    def context_edges(self) -> Tuple[int, int]:
        """Number of leading and trailing context lines (for fuzz)."""
        tags = [tag for tag, _ in self.lines]
        lead = next((i for i, t in enumerate(tags) if t != " "), len(tags))
        trail = next((i for i, t in enumerate(reversed(tags)) if t != " "), len(tags))
        return lead, trail


@dataclasses.dataclass(frozen=True)
class FilePatch:
    path: str  # relative to site-packages, e.g. "sglang/srt/entrypoints/http_server.py"
    hunks: Tuple[Hunk, ...]


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str  # file name, e.g. "0001-server-info.patch"
    header: str  # the comment above the first diff: what it wires and why
    files: Tuple[FilePatch, ...]


_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _strip_prefix(p: str) -> str:
    p = p.split("\t", 1)[0].strip()
    return p[2:] if p.startswith(("a/", "b/")) else p


def parse_patch(name: str, text: str) -> Patch:
    """Parse one unified diff (``diff -u`` / ``git diff`` output).

    Raises:
        PatchError: on a malformed hunk (counts that do not match its lines).
    """
    lines = text.splitlines(keepends=True)
    header: List[str] = []
    files: List[FilePatch] = []
    i = 0
    while i < len(lines) and not lines[i].startswith("--- "):
        header.append(lines[i])
        i += 1
    while i < len(lines):
        if not lines[i].startswith("--- "):
            i += 1
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise PatchError(f"{name}: '---' line {i + 1} is not followed by '+++'")
        path = _strip_prefix(lines[i + 1][4:])
        if _strip_prefix(lines[i][4:]) == "/dev/null" or path == "/dev/null":
            raise PatchError(f"{name}: creating or deleting files is not supported; patch existing SGLang files only")
        if not path.startswith(PACKAGE + "/") or ".." in Path(path).parts:
            raise PatchError(f"{name}: {path} is not a path inside the {PACKAGE}/ package")
        i += 2
        hunks: List[Hunk] = []
        while i < len(lines) and lines[i].startswith("@@"):
            m = _HUNK_RE.match(lines[i])
            if not m:
                raise PatchError(f"{name}: bad hunk header at line {i + 1}: {lines[i].strip()}")
            n_old = int(m.group(2) or 1)
            n_new = int(m.group(4) or 1)
            i += 1
            body: List[Tuple[str, str]] = []
            o = n = 0
            while i < len(lines) and (o < n_old or n < n_new):
                raw = lines[i]
                tag, textl = (raw[0], raw[1:]) if raw not in ("\n", "\r\n") else (" ", raw)
                if tag == "\\":  # "\ No newline at end of file": strip it from the previous line
                    ptag, ptext = body[-1]
                    body[-1] = (ptag, ptext.rstrip("\r\n"))
                    i += 1
                    continue
                if tag not in " +-":
                    raise PatchError(f"{name}: unexpected line {i + 1} in hunk: {raw.rstrip()}")
                body.append((tag, textl))
                o += tag in " -"
                n += tag in " +"
                i += 1
            if i < len(lines) and lines[i].startswith("\\"):
                ptag, ptext = body[-1]
                body[-1] = (ptag, ptext.rstrip("\r\n"))
                i += 1
            if o != n_old or n != n_new:
                raise PatchError(f"{name}: hunk at {path}:{m.group(1)} has {o}/{n} lines, header says {n_old}/{n_new}")
            hunks.append(Hunk(int(m.group(1)), int(m.group(3)), tuple(body)))
        files.append(FilePatch(path, tuple(hunks)))
    if not files:
        raise PatchError(f"{name}: no file diffs found")
    return Patch(name, "".join(header), tuple(files))


class HunkState(str, enum.Enum):
    EXACT = "applies"
    OFFSET = "offset"
    FUZZ = "fuzz"
    APPLIED = "already applied"
    CONFLICT = "conflicts"


@dataclasses.dataclass(frozen=True)
class HunkResult:
    index: int  # 1-based hunk number within its file
    state: HunkState
    offset: int = 0  # lines between the expected and the found position
    fuzz: int = 0  # context lines dropped at each end to find a match


def _find(lines: Sequence[str], needle: Sequence[str], expected: int, lo: int) -> Optional[int]:
    """Position of ``needle`` in ``lines`` at or after ``lo``, nearest ``expected``."""
    n = len(needle)
    last = len(lines) - n
    if last < lo:
        return None
    expected = min(max(expected, lo), last)
    for d in range(0, max(expected - lo, last - expected) + 1):
        for pos in (expected - d, expected + d) if d else (expected,):
            if lo <= pos <= last and list(lines[pos : pos + n]) == list(needle):
                return pos
    return None


def apply_to_text(fp: FilePatch, text: str, reverse: bool = False, max_fuzz: int = 0) -> Tuple[Optional[str], List[HunkResult]]:
    """Apply one file's hunks to ``text`` (or take them out, with ``reverse``).

    Each hunk is looked for at its header's line, shifted by the offset the
    previous hunk was found at, then at growing distances (GNU patch's search);
    with ``max_fuzz`` > 0, up to that many outer context lines may be dropped.

    Returns:
        the new text (None when any hunk conflicts) and one result per hunk.
    """
    lines = text.splitlines(keepends=True)
    out: List[str] = []
    results: List[HunkResult] = []
    cursor = 0  # first line of ``lines`` not yet copied to ``out``
    shift = 0  # offset the previous hunk was found at
    ok = True
    for idx, h in enumerate(fp.hunks, 1):
        old, new = h.old(reverse), h.new(reverse)
        start = h.dst_start if reverse else h.src_start
        if not old:  # pure insertion: "@@ -N,0" inserts after line N
            pos, fuzz, a, b = max(min(start + shift, len(lines)), cursor), 0, 0, 0
            expected = start
        else:
            expected = start - 1
            pos = None
            lead, trail = h.context_edges()
            for fuzz in range(max_fuzz + 1):
                a, b = min(fuzz, lead), min(fuzz, trail)
                p = _find(lines, old[a : len(old) - b], expected + shift + a, cursor)
                if p is not None:
                    pos = p - a
                    break
            if pos is None:
                results.append(HunkResult(idx, HunkState.CONFLICT))
                ok = False
                continue
        # Outer context dropped for fuzz stays as the file has it.
        out.extend(lines[cursor : pos + a])
        out.extend(new[a : len(new) - b])
        cursor = pos + len(old) - b
        shift = pos - expected
        state = HunkState.FUZZ if a or b else (HunkState.OFFSET if shift else HunkState.EXACT)
        results.append(HunkResult(idx, state, shift, max(a, b)))
    out.extend(lines[cursor:])
    return ("".join(out) if ok else None), results


# ----------------------------------------------------------------------------
# The series shipped with this package


def _patch_dir() -> Path:
    """``patches/``: installed as ``sglang_elastic.patches`` (pyproject's
    package-dir), or beside the package in a source checkout that is on
    ``sys.path`` as is (``python -m sglang_elastic.cli`` from the repo root)."""
    try:
        return Path(str(resources.files("sglang_elastic.patches")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "patches"


def load_series(patch_dir: Optional[Path] = None) -> List[Patch]:
    """Read ``series`` and parse every patch it names, in order."""
    d = patch_dir or _patch_dir()
    names = [ln.split("#", 1)[0].strip() for ln in (d / "series").read_text().splitlines()]
    return [parse_patch(n, (d / n).read_text()) for n in names if n]


def load_manifest(patch_dir: Optional[Path] = None) -> dict:
    d = patch_dir or _patch_dir()
    return json.loads((d / "manifest.json").read_text())


def _read_record(text: str) -> Dict[str, str]:
    """A wheel RECORD (CSV: path, hash, size) as path -> hash."""
    return {row[0]: row[1] for row in csv.reader(io.StringIO(text)) if len(row) >= 2}


def sha256_b64(data: bytes) -> str:
    """Hash in a wheel RECORD's form: urlsafe base64 without padding."""
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def touched_files(series: Sequence[Patch]) -> List[str]:
    seen: Dict[str, None] = {}
    for p in series:
        for f in p.files:
            seen.setdefault(f.path, None)
    return list(seen)


def apply_series_to_contents(series: Sequence[Patch], contents: Dict[str, bytes], reverse: bool = False) -> Dict[str, bytes]:
    """Apply (or reverse) the whole series to in-memory files.

    Args:
        contents: path (relative to site-packages) -> bytes, for every touched file.

    Raises:
        PatchError: naming the first patch, file and hunk that does not apply exactly.
    """
    out = dict(contents)
    for p in reversed(series) if reverse else series:
        for fp in p.files:
            text = out[fp.path].decode("utf-8")
            new, results = apply_to_text(fp, text, reverse=reverse)
            bad = [r for r in results if r.state is not HunkState.EXACT]
            if new is None or bad:
                r = bad[0]
                raise PatchError(f"{p.name}: {fp.path} hunk #{r.index} {r.state.value}" + (f" (offset {r.offset})" if r.offset else ""))
            out[fp.path] = new.encode("utf-8")
    return out


def build_manifest(series: Sequence[Patch], pristine: Dict[str, bytes]) -> dict:
    """Hashes of every touched file in the wheel and after each patch touching it."""
    files: Dict[str, dict] = {}
    cur = dict(pristine)
    for path in touched_files(series):
        files[path] = {"pristine": sha256_b64(pristine[path]), "after": {}}
    for p in series:
        cur = apply_series_to_contents([p], cur)
        for fp in p.files:
            files[fp.path]["after"][p.name] = sha256_b64(cur[fp.path])
    return {"sglang_version": SGLANG_VERSION, "series": [p.name for p in series], "files": files}


# ----------------------------------------------------------------------------
# An SGLang install (site-packages or a source tree)


@dataclasses.dataclass
class Install:
    """Where an SGLang package lives and what its metadata says."""

    root: Path  # the directory holding the ``sglang`` package (site-packages or ``python/``)
    version: str
    record: Dict[str, str]  # path -> RECORD hash ("" when there is no RECORD)
    source_version: Optional[str] = None  # what sglang/_version.py (or version.py) says, if anything

    @property
    def package_dir(self) -> Path:
        return self.root / PACKAGE

    def read(self, rel: str) -> bytes:
        p = self.root / rel
        if not p.is_file():
            raise PatchError(f"{rel} is missing from {self.root}")
        return p.read_bytes()

    @property
    def base_version(self) -> str:
        return self.version.split("+", 1)[0]


def _version_from_source(pkg: Path) -> Optional[str]:
    for name in ("_version.py", "version.py"):
        f = pkg / name
        if f.is_file():
            m = re.search(r"""^__version__\s*=\s*(?:\w+\s*=\s*)?["']([^"']+)["']""", f.read_text(), re.M)
            if m:
                return m.group(1)
    return None


def locate(sglang_dir: Optional[os.PathLike] = None, need_version: bool = True) -> Install:
    """Find the SGLang package to work on.

    Args:
        sglang_dir: the ``sglang`` package directory, or a directory holding it
            (site-packages, a repo's ``python/``, or a repo root). Default: the
            installed ``sglang`` found on ``sys.path`` (not imported).
        need_version: when False (``check`` on a git checkout, whose version
            is only known to setuptools-scm), an unknown version is "unknown".

    Raises:
        PatchError: when no SGLang package is found there, when several
            ``sglang-*.dist-info`` sit beside it, or (``need_version``) when
            its version cannot be read.
    """
    if sglang_dir is None:
        import importlib.util

        spec = importlib.util.find_spec(PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise PatchError("no installed sglang found; pass --sglang-dir")
        pkg = Path(list(spec.submodule_search_locations)[0])
    else:
        if not str(sglang_dir).strip():
            raise PatchError("--sglang-dir is empty")
        d = Path(sglang_dir).resolve()
        if not d.exists():
            raise PatchError(f"{d} does not exist; pass the sglang package directory or the site-packages holding it")
        for cand in (d, d / PACKAGE, d / "python" / PACKAGE):
            if (cand / "srt").is_dir() and cand.name == PACKAGE:
                pkg = cand
                break
        else:
            raise PatchError(f"{d} holds no sglang package (looked for sglang/srt there, in sglang/ and in python/sglang/); "
                             "pass the sglang package directory or the site-packages holding it")
    root = pkg.parent
    dist = sorted(root.glob(f"{PACKAGE}-*.dist-info"))
    if len(dist) > 1:
        raise PatchError(f"several SGLang dist-infos in {root} ({', '.join(d.name for d in dist)}): remove the stale ones")
    record: Dict[str, str] = {}
    version = None
    if dist:
        meta = dist[0] / "METADATA"
        if not meta.is_file():
            raise PatchError(f"{dist[0]} has no METADATA: a broken install")
        m = re.search(r"^Version:\s*(\S+)", meta.read_text(errors="replace"), re.M)
        version = m.group(1) if m else None
        rec = dist[0] / "RECORD"
        if rec.is_file():
            record = {path: h[len("sha256=") :] for path, h in _read_record(rec.read_text()).items() if h.startswith("sha256=")}
    source_version = _version_from_source(pkg)
    version = version or source_version
    if version is None:
        if need_version:
            raise PatchError(f"cannot tell the SGLang version of {pkg}: no dist-info beside it and no version string in sglang/_version.py or sglang/version.py")
        version = "unknown"
    return Install(root, version, record, source_version)


# ----------------------------------------------------------------------------
# status / apply / revert


class State(str, enum.Enum):
    PRISTINE = "pristine"
    APPLIED = "applied"
    PARTIAL = "partially applied"
    FOREIGN = "foreign changes"


@dataclasses.dataclass
class PatchStatus:
    name: str
    state: State
    detail: str = ""


def _file_step(manifest: dict, path: str, digest: str, series: Sequence[Patch]) -> Optional[int]:
    """How far along the series a file is: 0 = pristine, k = after the k-th patch
    (index into ``series``) that touches it; None = neither (foreign change)."""
    entry = manifest["files"][path]
    if digest == entry["pristine"]:
        return 0
    for k, p in enumerate(series, 1):
        if entry["after"].get(p.name) == digest:
            return k
    return None


def status(inst: Install, series: Optional[Sequence[Patch]] = None, manifest: Optional[dict] = None) -> List[PatchStatus]:
    """Per-patch state of ``inst``: pristine, applied, or foreign changes.

    Raises:
        PatchError: ``inst`` is not SGLang 0.5.17 (checked first: another
            release's files would read as foreign changes, or as pristine
            where they happen to match), or the manifest lacks a file.
    """
    _check_version(inst)
    series = list(series if series is not None else load_series())
    manifest = manifest or load_manifest()
    unknown = [p for p in touched_files(series) if p not in manifest.get("files", {})]
    if unknown:
        raise PatchError(f"manifest.json does not describe {', '.join(unknown)}: run 'sglang-elastic patch manifest'")
    steps: Dict[str, Optional[int]] = {}
    missing = set()
    for path in touched_files(series):
        if not (inst.root / path).is_file():
            steps[path] = None
            missing.add(path)
            continue
        steps[path] = _file_step(manifest, path, sha256_b64(inst.read(path)), series)
    out = []
    for k, p in enumerate(series, 1):
        per = [steps[f.path] for f in p.files]
        foreign = [f.path for f, s in zip(p.files, per) if s is None]
        if foreign:
            what = [f"{f} (missing)" if f in missing else f for f in foreign]
            out.append(PatchStatus(p.name, State.FOREIGN, "changed by something else: " + ", ".join(what)))
        elif all(s >= k for s in per):
            out.append(PatchStatus(p.name, State.APPLIED))
        elif all(s < k for s in per):
            out.append(PatchStatus(p.name, State.PRISTINE))
        else:
            out.append(PatchStatus(p.name, State.PARTIAL))
    return out


def overall(statuses: Iterable[PatchStatus]) -> State:
    states = {s.state for s in statuses}
    if State.FOREIGN in states:
        return State.FOREIGN
    if states == {State.APPLIED}:
        return State.APPLIED
    if states == {State.PRISTINE}:
        return State.PRISTINE
    return State.PARTIAL


def _is(state: State) -> str:
    return "has foreign changes" if state is State.FOREIGN else f"is {state.value}"


def version_mismatch(inst: Install) -> Optional[str]:
    """Why the series cannot be judged on ``inst`` (another SGLang release), or None."""
    src = inst.source_version
    if inst.base_version == SGLANG_VERSION and (src is None or src.split("+", 1)[0] == SGLANG_VERSION):
        return None
    shown = inst.version if inst.base_version != SGLANG_VERSION else f"{src} (its version file; its dist-info says {inst.version})"
    return (f"SGLang {shown} at {inst.package_dir}: this series is for {SGLANG_VERSION} only; "
            f"install sglang=={SGLANG_VERSION}, or dry-run the series on this tree: sglang-elastic patch check --sglang-src {inst.root}")


def _check_version(inst: Install) -> None:
    why = version_mismatch(inst)
    if why:
        raise PatchError(why)


def _write_atomically(root: Path, contents: Dict[str, bytes]) -> None:
    """Replace every file or none: each goes through a temp file and os.replace;
    on any failure the files already replaced get their old bytes back (a
    file that was missing, restored from a wheel, is removed again)."""
    old = {rel: (root / rel).read_bytes() if (root / rel).is_file() else None for rel in contents}
    done: List[str] = []
    try:
        for rel, data in contents.items():
            target = root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".sglang-elastic-")
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                st = target.stat() if old[rel] is not None else target.parent.stat()
                os.chmod(tmp, (st.st_mode & 0o7777) if old[rel] is not None else 0o644)
                if hasattr(os, "chown") and os.geteuid() == 0:
                    os.chown(tmp, st.st_uid, st.st_gid)  # keep the owner when root patches a user's tree
                os.replace(tmp, target)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
            done.append(rel)
    except BaseException as e:
        for rel in done:
            if old[rel] is None:
                (root / rel).unlink()
            else:
                (root / rel).write_bytes(old[rel])
        raise PatchError(f"write failed, nothing changed: {e}") from e


def apply(inst: Install, series: Optional[Sequence[Patch]] = None, manifest: Optional[dict] = None) -> List[str]:
    """Apply the whole series to ``inst``, or change nothing.

    Refuses (``PatchError``, one line) when the version is not 0.5.17, when a
    touched file differs from the 0.5.17 wheel (its RECORD and our manifest),
    or when any patch is already (partly) applied.

    Returns:
        the files written, relative to ``inst.root``.
    """
    series = list(series if series is not None else load_series())
    manifest = manifest or load_manifest()
    _check_version(inst)
    st = status(inst, series, manifest)
    if any(s.state is not State.PRISTINE for s in st):
        s = next(s for s in st if s.state is not State.PRISTINE)
        fix = (f"'sglang-elastic patch restore --from-wheel [WHEEL] --sglang-dir {inst.root}' puts the wheel's files back"
               if s.state is State.FOREIGN else f"run 'sglang-elastic patch status --sglang-dir {inst.root}'")
        raise PatchError(f"refusing: {s.name} {_is(s.state)}" + (f" ({s.detail})" if s.detail else "") + f"; {fix}")
    contents = {p: inst.read(p) for p in touched_files(series)}
    # The stock wheel's RECORD must vouch for the bytes too. (A wheel built by
    # build-wheel, version 0.5.17+elastic<N>, records the patched hashes: there
    # the manifest's pristine hashes, checked by status() above, decide.)
    if inst.version == SGLANG_VERSION and inst.record:
        for path, data in contents.items():
            if inst.record.get(path) not in (None, sha256_b64(data)):
                raise PatchError(f"refusing: {path} differs from the SGLang {inst.version} wheel (RECORD hash mismatch)")
    new = apply_series_to_contents(series, contents)
    _write_atomically(inst.root, new)
    return list(new)


def revert(inst: Install, series: Optional[Sequence[Patch]] = None, manifest: Optional[dict] = None) -> List[str]:
    """Restore every touched file byte-identical to the 0.5.17 wheel.

    Refuses when the series is not fully applied or a file has foreign changes
    (it would not come back identical). Returns the files written.
    """
    series = list(series if series is not None else load_series())
    manifest = manifest or load_manifest()
    st = status(inst, series, manifest)
    if overall(st) is State.PRISTINE:
        return []
    if overall(st) is not State.APPLIED:
        s = next(s for s in st if s.state is not State.APPLIED)
        edited = [p for p in touched_files(series)
                  if _file_state(manifest, p, (inst.root / p).read_bytes() if (inst.root / p).is_file() else None, series) in ("foreign changes", "missing")]
        raise PatchError(f"refusing: {s.name} {_is(s.state)}" + (f" ({s.detail})" if s.detail else "")
                         + "; revert takes out only the series' own changes. To overwrite "
                         + (", ".join(edited) if edited else "the series' files")
                         + f" with the SGLang {SGLANG_VERSION} wheel's: sglang-elastic patch restore --from-wheel [WHEEL] --sglang-dir {inst.root}")
    contents = {p: inst.read(p) for p in touched_files(series)}
    old = apply_series_to_contents(series, contents, reverse=True)
    for path, data in old.items():
        if sha256_b64(data) != manifest["files"][path]["pristine"]:
            raise PatchError(f"refusing: reversing the series does not give the wheel's {path} back")
    _write_atomically(inst.root, old)
    return list(old)


def _file_state(manifest: dict, path: str, data: Optional[bytes], series: Sequence[Patch]) -> str:
    """A touched file's state in words: as in the wheel, after which patch, edited, missing."""
    if data is None:
        return "missing"
    k = _file_step(manifest, path, sha256_b64(data), series)
    return "foreign changes" if k is None else ("as in the wheel" if k == 0 else f"patched by {series[k - 1].name}")


def restore_from_wheel(inst: Install, wheel: Path, series: Optional[Sequence[Patch]] = None, manifest: Optional[dict] = None) -> List[Tuple[str, str]]:
    """Overwrite every file the series touches with the SGLang 0.5.17 wheel's
    bytes, whatever the tree holds (the way out where :func:`revert` refuses:
    a file edited by hand, a partly applied series). Each file is checked
    against the wheel's ``RECORD`` and the manifest's pristine hash first;
    only files that differ are written, all or none.

    Returns:
        ``(path, what it held before)`` for every file written
        ("patched by NNNN-...", "foreign changes", "missing").

    Raises:
        PatchError: ``inst`` is not SGLang 0.5.17, or ``wheel`` is not its
            wheel or does not match its RECORD or the manifest.
    """
    import zipfile

    series = list(series if series is not None else load_series())
    manifest = manifest or load_manifest()
    _check_version(inst)
    wheel = Path(wheel)
    m = re.match(rf"^{PACKAGE}-([^-]+)-.+\.whl$", wheel.name)
    if not wheel.is_file():
        raise PatchError(f"{wheel}: no such file; pass the sglang-{SGLANG_VERSION} wheel, or --from-wheel alone to download it")
    if not m or m.group(1) != SGLANG_VERSION:
        raise PatchError(f"{wheel.name} is not the sglang {SGLANG_VERSION} wheel (sglang-{SGLANG_VERSION}-<tags>.whl)")
    if not zipfile.is_zipfile(wheel):
        raise PatchError(f"{wheel}: not a wheel (not a zip archive)")
    di = f"{PACKAGE}-{SGLANG_VERSION}.dist-info/RECORD"
    with zipfile.ZipFile(wheel) as z:
        if di not in z.namelist():
            raise PatchError(f"{wheel.name}: no {di} inside")
        rec = _read_record(z.read(di).decode())
        pristine = {}
        for path in touched_files(series):
            if path not in z.namelist():
                raise PatchError(f"{wheel.name}: {path} is missing")
            data = z.read(path)
            if rec.get(path) != "sha256=" + sha256_b64(data) or manifest["files"][path]["pristine"] != sha256_b64(data):
                raise PatchError(f"{wheel.name}: {path} does not match its RECORD hash and the manifest's")
            pristine[path] = data
    before = {p: ((inst.root / p).read_bytes() if (inst.root / p).is_file() else None) for p in pristine}
    changed = {p: data for p, data in pristine.items() if before[p] != data}
    out = [(p, _file_state(manifest, p, before[p], series)) for p in changed]
    _write_atomically(inst.root, changed)
    return out


# ----------------------------------------------------------------------------
# check against another SGLang tree


@dataclasses.dataclass
class CheckRow:
    patch: str
    path: str
    hunk: int
    state: HunkState
    offset: int
    fuzz: int


def check(src: Install, series: Optional[Sequence[Patch]] = None, max_fuzz: int = 2) -> List[CheckRow]:
    """Dry-run the series against another SGLang tree (e.g. a newer release).

    Each patch is tried on the files as the previous patches left them (with
    fuzz up to ``max_fuzz``, like ``patch -F2``); nothing is written. A file
    the patch does not apply to but comes out of cleanly (reversed, exact)
    already has it: ``already applied``, not a conflict.
    """
    series = list(series if series is not None else load_series())
    cur: Dict[str, Optional[str]] = {}
    rows: List[CheckRow] = []
    for p in series:
        for fp in p.files:
            if fp.path not in cur:
                f = src.root / fp.path
                cur[fp.path] = f.read_bytes().decode("utf-8", errors="surrogateescape") if f.is_file() else None
            text = cur[fp.path]
            if text is None:
                rows.extend(CheckRow(p.name, fp.path, i, HunkState.CONFLICT, 0, 0) for i in range(1, len(fp.hunks) + 1))
                continue
            if apply_to_text(fp, text)[0] is None and apply_to_text(fp, text, reverse=True)[0] is not None:
                # the tree already has this file's patch (a patched install): it does not go in exactly, but comes out
                # exactly (tried before fuzz, which could find trimmed context of an applied hunk elsewhere)
                rows.extend(CheckRow(p.name, fp.path, i, HunkState.APPLIED, 0, 0) for i in range(1, len(fp.hunks) + 1))
                continue
            new, results = apply_to_text(fp, text, max_fuzz=max_fuzz)
            rows.extend(CheckRow(p.name, fp.path, r.index, r.state, r.offset, r.fuzz) for r in results)
            if new is not None:
                cur[fp.path] = new
    return rows


def verdicts(rows: Sequence[CheckRow]) -> Dict[str, str]:
    """Per patch: its worst hunk's state, or ``partly applied`` when some of
    its hunks are in the tree and others are not (a half-patched install)."""
    order = list(HunkState)
    out: Dict[str, str] = {}
    for name in dict.fromkeys(r.patch for r in rows):
        states = {r.state for r in rows if r.patch == name}
        if HunkState.APPLIED in states and states != {HunkState.APPLIED}:
            out[name] = PARTLY_APPLIED
        else:
            out[name] = max(states, key=order.index).value
    return out


#: ``verdicts``' word for a patch some of whose hunks the tree has and others not.
PARTLY_APPLIED = "partly applied"


def check_report(src: Install, rows: Sequence[CheckRow]) -> str:
    """A Markdown report of ``check`` rows, per patch and per hunk."""
    out = [
        f"# Rebase check: sglang-elastic series against SGLang {src.version}",
        "",
        f"Produced by `sglang-elastic patch check --sglang-src <SGLang {src.version} tree>`; each patch is",
        "dry-run on the files as the earlier patches left them, with fuzz up to 2.",
        "",
        "| patch | file | hunk | result |",
        "|---|---|---|---|",
    ]
    for r in rows:
        res = r.state.value
        if r.state is HunkState.OFFSET:
            res += f" ({r.offset:+d} lines)"
        elif r.state is HunkState.FUZZ:
            res += f" {r.fuzz} (offset {r.offset:+d})"
        out.append(f"| {r.patch} | `{r.path}` | #{r.hunk} | {res} |")
    out += ["", "| patch | verdict |", "|---|---|"]
    out += [f"| {p} | {v} |" for p, v in verdicts(rows).items()]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------
# build-wheel

LOCAL_VERSION = "elastic"


def series_number(series: Sequence[Patch]) -> int:
    """N in ``+elastic<N>``: the number of the last patch in the series."""
    m = re.match(r"(\d+)", series[-1].name)
    return int(m.group(1)) if m else len(series)


def download_wheel(dest: Path, python_version: Optional[str] = None) -> Path:
    """Fetch the PyPI ``sglang==0.5.17`` wheel with pip: for this interpreter,
    or for ``python_version`` (e.g. "3.12", for another host; SGLang's wheels
    are CPython-version specific)."""
    import subprocess
    import sys

    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"{PACKAGE}=={SGLANG_VERSION}", "-d", str(dest)]
    if python_version:
        cmd += ["--python-version", python_version, "--platform", "manylinux_2_34_x86_64"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob(f"{PACKAGE}-{SGLANG_VERSION}-*.whl"))
    if r.returncode != 0 or not found:
        last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        raise PatchError(f"could not download the sglang {SGLANG_VERSION} wheel ({' '.join(cmd)}): {last}")
    return found[-1]


def build_wheel(src_wheel: Path, out_dir: Path, series: Optional[Sequence[Patch]] = None) -> Path:
    """Write ``sglang-0.5.17+elastic<N>-<tags>.whl``: the wheel with the series
    applied, dist-info renamed, METADATA's version bumped and a fresh RECORD.

    Raises:
        PatchError: when the input is not the 0.5.17 wheel or its files differ
            from their RECORD hashes.
    """
    import zipfile

    series = list(series if series is not None else load_series())
    m = re.match(rf"^{PACKAGE}-([^-]+)-(.+)\.whl$", src_wheel.name)
    if not m:
        raise PatchError(f"{src_wheel.name} is not an sglang wheel")
    if m.group(1) != SGLANG_VERSION:
        raise PatchError(f"{src_wheel.name} is SGLang {m.group(1)}: this patch set targets {SGLANG_VERSION} only")
    new_version = f"{SGLANG_VERSION}+{LOCAL_VERSION}{series_number(series)}"
    old_di, new_di = f"{PACKAGE}-{SGLANG_VERSION}.dist-info", f"{PACKAGE}-{new_version}.dist-info"
    if not src_wheel.is_file():
        raise PatchError(f"{src_wheel}: no such file")
    if not zipfile.is_zipfile(src_wheel):
        raise PatchError(f"{src_wheel}: not a wheel (not a zip archive)")
    if out_dir.exists() and not out_dir.is_dir():
        raise PatchError(f"--out {out_dir} exists and is not a directory")
    with zipfile.ZipFile(src_wheel) as zin:
        infos = zin.infolist()
        if f"{old_di}/RECORD" not in zin.namelist():
            raise PatchError(f"{src_wheel.name}: no {old_di}/RECORD inside")
        rec = _read_record(zin.read(f"{old_di}/RECORD").decode())
        contents = {}
        for path in touched_files(series):
            if path not in zin.namelist():
                raise PatchError(f"{src_wheel.name}: {path} is missing")
            data = zin.read(path)
            if rec.get(path) != "sha256=" + sha256_b64(data):
                raise PatchError(f"{src_wheel.name}: {path} does not match its RECORD hash")
            contents[path] = data
        patched = apply_series_to_contents(series, contents)
        out_dir.mkdir(parents=True, exist_ok=True)
        out = out_dir / f"{PACKAGE}-{new_version}-{m.group(2)}.whl"
        rows = []
        tmp = out.with_suffix(".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
            for info in infos:
                name = info.filename
                if name == f"{old_di}/RECORD":
                    continue
                data = patched.get(name)
                if data is None:
                    data = zin.read(info)
                if name == f"{old_di}/METADATA":
                    data = re.sub(rb"^Version: .*$", f"Version: {new_version}".encode(), data, count=1, flags=re.M)
                if name.startswith(old_di + "/"):
                    name = new_di + name[len(old_di) :]
                ninfo = zipfile.ZipInfo(name, info.date_time)
                ninfo.external_attr = info.external_attr
                ninfo.compress_type = zipfile.ZIP_DEFLATED
                zout.writestr(ninfo, data)
                if not name.endswith("/"):
                    rows.append((name, f"sha256={sha256_b64(data)}", len(data)))
            rows.append((f"{new_di}/RECORD", "", ""))
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows(rows)
            zout.writestr(zipfile.ZipInfo(f"{new_di}/RECORD", infos[0].date_time), buf.getvalue())
        os.replace(tmp, out)
    return out
