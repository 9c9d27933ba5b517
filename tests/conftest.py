"""Fixtures that build real SGLang 0.5.17 installs to patch.

``sglang_site`` is a throwaway site-packages holding the installed SGLang's
files that the series touches plus its real dist-info (METADATA, RECORD), so
patch operations run against the wheel's own bytes and hashes without touching
the test environment's SGLang.
"""

from __future__ import annotations

import os

# CPU machines run the Triton kernels in Triton's interpreter; it must be on
# before any kernel module is imported (triton.jit reads it at decoration).
os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread for torch here and in every process the tests start: the
# tensors are small, and on a busy 2-core machine OpenMP's spinning threads made
# the pool's property tests 2.5x slower (54 s against 20 s for tests/test_pool.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import importlib.util
import shutil
from pathlib import Path

import pytest

from sglang_elastic import patchset


def installed_sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None, "the test bed must have SGLang 0.5.17 installed (bash ci/test.sh)"
    return Path(list(spec.submodule_search_locations)[0]).parent


def make_site(dst: Path, extra_files=()) -> Path:
    """Copy the touched files (and ``extra_files``) of the installed SGLang and
    its dist-info into ``dst``; return ``dst``."""
    src = installed_sglang_root()
    files = set(patchset.touched_files(patchset.load_series())) | set(extra_files) | {"sglang/version.py", "sglang/_version.py"}
    for rel in files:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, dst / rel)
    (dst / "sglang" / "srt").mkdir(parents=True, exist_ok=True)
    (di,) = src.glob("sglang-*.dist-info")
    (dst / di.name).mkdir()
    for name in ("METADATA", "RECORD"):
        shutil.copy2(di / name, dst / di.name / name)
    return dst


def snapshot(root: Path) -> dict:
    """Every file under ``root`` with its bytes (to prove nothing changed)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def sglang_site(tmp_path: Path) -> Path:
    return make_site(tmp_path / "site")


@pytest.fixture
def test_wheel() -> Path:
    """The PyPI sglang-0.5.17 wheel that ci/test.sh downloads."""
    p = os.environ.get("SGLANG_ELASTIC_TEST_WHEEL")
    if not p or not Path(p).is_file():
        pytest.fail("SGLANG_ELASTIC_TEST_WHEEL is not set to the sglang-0.5.17 wheel; run the tests with: bash ci/test.sh")
    return Path(p)


@pytest.fixture(scope="session")
def sglang_python():
    """``run(code, argv, env)``: ``python -c`` in a process that has imported
    SGLang's server args and plugin loader already, and nothing else of the
    test (tests/forkrun.py): one SGLang import for the session, not one per call."""
    from forkrun import Forker

    f = Forker(["sglang.srt.server_args", "sglang.srt.plugins", "sglang.srt.plugins.hook_registry", "sglang.srt.configs.model_config"])
    yield f
    f.close()
