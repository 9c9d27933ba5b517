"""The project's scripts (``scripts/gpu/*.py``, ``scripts/offload/*.py``) as modules, for the tests of their CPU halves."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str, folder: str = "scripts/gpu"):
    """``<folder>/<name>.py`` executed afresh as module ``name`` (registered in ``sys.modules``:
    dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
