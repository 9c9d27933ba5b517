"""scripts/eval/jit_cache.sh: a ninja build cached on one "host" stays up to
date on a fresh one whose package install is newer than the cached objects
(FlashInfer's JIT layout: build.ninja with gcc-style depfiles under
~/.cache/flashinfer, sources and headers under the bundle's site dir)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts/eval/jit_cache.sh"

pytestmark = pytest.mark.skipif(not (shutil.which("ninja") and shutil.which("cc")), reason="needs ninja and a C compiler")


def _install(site: Path) -> None:
    """The bundle's install: sources and headers written now."""
    (site / "pkg/data/csrc").mkdir(parents=True, exist_ok=True)
    (site / "pkg/data/include/cuda/std").mkdir(parents=True, exist_ok=True)
    (site / "pkg/data/include/op.h").write_text("#include <cuda/std/limits>\n#define OP_SCALE 3\n")
    (site / "pkg/data/include/cuda/std/limits").write_text("#define OP_BIAS 1\n")  # an extensionless header, as in libcu++
    (site / "pkg/data/csrc/op.c").write_text('#include "op.h"\nint op(int x) { return OP_SCALE * x + OP_BIAS; }\n')
    (site / "pkg/__init__.py").write_text("")


def _write_build(build: Path, site: Path) -> None:
    build.mkdir(parents=True, exist_ok=True)
    inc = site / "pkg/data/include"
    (build / "build.ninja").write_text(
        f"rule cc\n  command = cc -fPIC -I{inc} -MD -MF $out.d -c $in -o $out\n  depfile = $out.d\n  deps = gcc\n"
        "rule link\n  command = cc -shared $in -o $out\n"
        f"build op.o: cc {site}/pkg/data/csrc/op.c\n"
        "build op.so: link op.o\n")


def _ninja(build: Path, *args: str) -> str:
    return subprocess.run(["ninja", "-C", str(build), *args], capture_output=True, text=True, check=True).stdout


def test_restored_cache_is_up_to_date_on_a_fresher_install(tmp_path):
    home, site = tmp_path / "home", tmp_path / "site"
    env = {**os.environ, "HOME": str(home)}
    env.pop("FLASHINFER_WORKSPACE_BASE", None)
    env.pop("TRITON_CACHE_DIR", None)
    build = home / ".cache/flashinfer/0.6.15.post1/90a/cached_ops/op"
    triton = home / ".triton/cache/abc123/kernel.cubin"
    _install(site)
    _write_build(build, site)
    assert "op.so" in _ninja(build)  # the first host compiles
    assert "no work to do" in _ninja(build)
    triton.parent.mkdir(parents=True)
    triton.write_bytes(os.urandom(64))
    blob = triton.read_bytes()
    saved = tmp_path / "jit.tgz"
    r = subprocess.run(["bash", str(SCRIPT), "save", str(saved)], env=env, capture_output=True, text=True, check=True)
    assert "saved" in r.stdout and saved.stat().st_size > 0

    # a fresh host: no caches, the package installed after the objects were built
    shutil.rmtree(home)
    shutil.rmtree(site)
    time.sleep(0.05)
    _install(site)
    # without restore's aging the cached objects are stale: ninja would rebuild
    with tarfile.open(saved) as t:
        t.extractall("/", filter="fully_trusted")
    assert "op.o" in _ninja(build, "-n")
    shutil.rmtree(home)

    r = subprocess.run(["bash", str(SCRIPT), "restore", str(saved), str(site)], env=env, capture_output=True, text=True, check=True)
    assert "restored" in r.stdout
    assert "no work to do" in _ninja(build)
    assert triton.read_bytes() == blob
    # Python files keep their mtimes (their .pyc caches are keyed on them)
    assert (site / "pkg/__init__.py").stat().st_mtime > 946684800 + 86400


def test_restore_without_a_file_is_a_fresh_host(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "restore", str(tmp_path / "none.tgz"), str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0 and "a fresh host compiles its kernels" in r.stderr
    bad = subprocess.run(["bash", str(SCRIPT), "unpack", "x"], capture_output=True, text=True)
    assert bad.returncode == 2 and "jit_cache.sh save FILE.tgz" in bad.stderr
