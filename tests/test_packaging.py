"""pyproject.toml ships every subpackage (a missing one imports fine from a
source checkout and breaks only in an installed wheel)."""

from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "sglang_elastic").rglob("__init__.py")}
    found |= {"sglang_elastic." + k.split(".")[-1] for k in cfg.get("package-dir", {})}
    assert found <= listed, f"not in pyproject packages: {sorted(found - listed)}"
    assert "kernels" not in listed  # never a top-level `kernels` (SGLang depends on a PyPI package of that name)


def test_the_tree_leaves_room_for_the_gpu_bundle_in_one_device_transfer():
    """A device call carries the tracked tree plus the carried GPU bundle
    (`.gpu/bundle`, 63,392,517 and 63,399,246 B in two builds: SGLang 0.5.17 and
    its dependencies, and `.gpu/install_bundle.sh`) within 64 MiB, which leaves the
    tree 3.54 MiB; results must stay small (raw e2e outputs are kept xz-compressed)
    or the bundle no longer travels. The cap, 3.4 MiB, keeps 0.14 MiB of that for
    the bundle's variation between builds (3.2 MiB until issue 23's serving results
    of 2026-12-04, 3.3 MiB until 2026-12-05's step profiler and one-launch all-dense
    kernel: the tree is mostly code now); where the bundle is built (`.gpu/`,
    git-ignored), the sum itself is checked."""
    import shutil
    import subprocess

    import pytest

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    sizes = {f: (ROOT / f).stat().st_size for f in files if f and (ROOT / f).is_file()}
    total = sum(sizes.values())
    biggest = sorted(sizes, key=sizes.get)[-3:]
    assert 100_000 < total < int(3.4 * 2**20), f"tracked files: {total:,} B; biggest: {[(f, sizes[f]) for f in biggest]}"
    carried = [p for p in (ROOT / ".gpu" / "bundle").glob("*") if p.is_file()] + [ROOT / ".gpu" / "install_bundle.sh"]
    if all(p.is_file() for p in carried[-1:]) and len(carried) > 1:
        assert total + sum(p.stat().st_size for p in carried) < 64 << 20, "the tree and the GPU bundle no longer fit one device call"
