"""scripts/eval/jit_cache.sh: a ninja build cached on one "host" is used as is
on a fresh one whose install carries the bundle's (older) mtimes, rebuilt when
the install is newer, split into parts a device call can return, and never
half restored (FlashInfer's JIT layout: build.ninja with gcc-style depfiles
under ~/.cache/flashinfer, sources and headers under the bundle's site dir)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts/eval/jit_cache.sh"
BUNDLE_MTIME = time.time() - 86400  # install_bundle.sh unpacks with tar: the bundle's own, older mtimes

pytestmark = pytest.mark.skipif(not (shutil.which("ninja") and shutil.which("cc")), reason="needs ninja and a C compiler")


def _install(site: Path, mtime: float) -> None:
    files = {
        "pkg/data/include/op.h": "#include <cuda/std/limits>\n#define OP_SCALE 3\n",
        "pkg/data/include/cuda/std/limits": "#define OP_BIAS 1\n",  # an extensionless header, as in libcu++
        "pkg/data/csrc/op.c": '#include "op.h"\nint op(int x) { return OP_SCALE * x + OP_BIAS; }\n',
    }
    for rel, text in files.items():
        f = site / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
        os.utime(f, (mtime, mtime))


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


def _script(env, *args, check=True):
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, check=check)


@pytest.fixture
def host(tmp_path):
    """A built FlashInfer-like module and a Triton kernel under a fake HOME."""
    home, site = tmp_path / "home", tmp_path / "site"
    env = {**os.environ, "HOME": str(home)}
    for k in ("FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR", "TVM_FFI_CACHE_DIR"):
        env.pop(k, None)
    build = home / ".cache/flashinfer/0.6.15.post1/90a/cached_ops/op"
    triton = home / ".triton/cache/abc123/kernel.cubin"
    _install(site, BUNDLE_MTIME)
    _write_build(build, site)
    assert "op.so" in _ninja(build)  # the first host compiles
    assert "no work to do" in _ninja(build)
    triton.parent.mkdir(parents=True)
    triton.write_bytes(os.urandom(200_000))  # incompressible: several parts at a small part size
    # SGLang's own JIT module (sglang/kernels/jit/utils/compile.py: TVM-FFI's cache, reused when its .so exists)
    tvm = home / ".cache/tvm-ffi/sgl_kernel_jit_norm_0123abcd/sgl_kernel_jit_norm.so"
    tvm.parent.mkdir(parents=True)
    tvm.write_bytes(os.urandom(5000))
    return env, home, site, build, triton


def test_a_restored_cache_is_used_as_is_and_a_newer_install_rebuilds(host, tmp_path):
    env, home, site, build, triton = host
    blob = triton.read_bytes()
    tvm = next((home / ".cache/tvm-ffi").rglob("*.so"))
    tvm_blob = tvm.read_bytes()
    saved = tmp_path / "out" / "jit-cache.tgz"
    saved.parent.mkdir()
    r = _script({**env, "JIT_CACHE_PART_BYTES": "65536"}, "save", str(saved))
    parts = sorted(p.name for p in saved.parent.iterdir())
    assert len(parts) >= 3 and parts[0] == "jit-cache.tgz.00" and all(p.startswith("jit-cache.tgz.") for p in parts), parts
    assert all((saved.parent / p).stat().st_size <= 65536 for p in parts) and "part(s)" in r.stdout

    # a fresh host: no caches, the bundle unpacked again with its own mtimes
    shutil.rmtree(home)
    shutil.rmtree(site)
    _install(site, BUNDLE_MTIME)
    assert "restored" in _script(env, "restore", str(saved)).stdout
    assert "no work to do" in _ninja(build)
    assert triton.read_bytes() == blob and tvm.read_bytes() == tvm_blob

    # a bundle rebuilt after the cache: ninja's own check rebuilds, nothing hides it
    shutil.rmtree(home)
    _install(site, time.time())
    _script(env, "restore", str(saved))
    assert "op.o" in _ninja(build, "-n")


def test_a_damaged_archive_restores_nothing(host, tmp_path):
    env, home, site, build, triton = host
    saved = tmp_path / "out" / "jit-cache.tgz"
    saved.parent.mkdir()
    _script({**env, "JIT_CACHE_PART_BYTES": "65536"}, "save", str(saved))
    whole = tmp_path / "whole.tgz"  # one archive, not split, as an older call left it
    subprocess.run(["tar", "czf", str(whole), "-C", "/", str(triton)[1:]], check=True)
    last = sorted(saved.parent.iterdir())[-1]
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # a call cut off while its last part was written
    shutil.rmtree(home)
    r = _script(env, "restore", str(saved), check=False)
    assert r.returncode == 1 and "is damaged" in r.stderr
    assert not home.exists()  # not one file unpacked: FlashInfer would load a half-written .so
    # one whole file (not split) restores too
    assert "restored" in _script(env, "restore", str(whole)).stdout and triton.exists()


def test_nothing_to_save_or_restore_is_a_warning_and_bad_usage_an_error(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path / "empty")}
    for k in ("FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR", "TVM_FFI_CACHE_DIR"):
        env.pop(k, None)
    r = _script(env, "restore", str(tmp_path / "none.tgz"), check=False)
    assert r.returncode == 0 and "a fresh host compiles its kernels" in r.stderr
    r = _script(env, "save", str(tmp_path / "x.tgz"), check=False)
    assert r.returncode == 0 and "no JIT cache on this host" in r.stderr and not list(tmp_path.glob("x.tgz*"))
    bad = _script(env, "unpack", "x", check=False)
    assert bad.returncode == 2 and "jit_cache.sh save FILE.tgz" in bad.stderr
