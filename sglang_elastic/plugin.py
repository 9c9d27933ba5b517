"""SGLang general plugin (entry-point group ``sglang.srt.plugins``).

SGLang calls :func:`load` in every process before it parses arguments
(``sglang/srt/plugins/__init__.py: load_plugins``; called from
``sglang/launch_server.py``, the Engine and each scheduler process), then
applies the hooks registered with ``HookRegistry``. Set
``SGLANG_PLUGINS=sglang_elastic`` to load only this plugin.

Features register themselves here as they land (the elastic KV pool's hooks,
the decode attention backend); what cannot be reached from a plugin is wired
by the patch series (``patches/``).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List

from sglang_elastic import SGLANG_VERSION, __version__

logger = logging.getLogger(__name__)

_loaded = False
#: Names of the features this process activated, in activation order.
_features: List[str] = []


def load() -> None:
    """Entry point run by SGLang's plugin loader; idempotent."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    logger.info("sglang-elastic %s plugin loaded (features: %s)", __version__, ", ".join(_features) or "none")


def is_loaded() -> bool:
    return _loaded


def server_info(server_args: Any = None) -> Dict[str, Any]:
    """The ``sglang_elastic`` entry of ``GET /server_info`` (patch 0001).

    Returns:
        ``{"version", "sglang_version", "patched", "series", "plugin_loaded",
        "features"}``: ``series`` maps each patch to its state in the SGLang
        this process runs (read from the files, not assumed), ``patched`` is
        True when every patch is applied.

    Raises:
        PatchError: when the installed SGLang cannot be inspected (patch 0001
        turns any error into an ``"error"`` field).
    """
    from sglang_elastic import patchset

    st = patchset.status(patchset.locate())
    return {
        "version": __version__,
        "sglang_version": SGLANG_VERSION,
        "patched": patchset.overall(st) is patchset.State.APPLIED,
        "series": {s.name: s.state.value for s in st},
        "plugin_loaded": _loaded,
        "features": list(_features),
    }
