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
