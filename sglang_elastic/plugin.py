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
    """Entry point run by SGLang's plugin loader; idempotent.

    Registers (applied by SGLang's ``HookRegistry.apply_hooks`` right after):
    - AFTER ``ServerArgs.add_cli_args``: our flags join SGLang's parser;
    - BEFORE ``ServerArgs.from_cli_args``: parse and check them, publish the
      config to the scheduler processes (:mod:`sglang_elastic.config`).

    And the ``persistentkv`` attention backend in SGLang's registry and
    backend choices (:func:`sglang_elastic.attention.register`; its CUDA-graph
    hooks are installed when a scheduler builds the backend).
    """
    global _loaded
    if _loaded:
        return
    _loaded = True
    from sglang_elastic import config

    try:  # SGLang's loader reports a plugin's exception with a traceback and starts without it: a bad value stops here instead
        config.current()
    except config.ConfigError as e:
        raise SystemExit(f"sglang-elastic: {e} (the launcher sets it for its server processes: unset it)") from None
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.server_args.ServerArgs.add_cli_args", _add_cli_args, HookType.AFTER)
    HookRegistry.register("sglang.srt.server_args.ServerArgs.from_cli_args", _from_cli_args, HookType.BEFORE)
    from sglang_elastic import attention

    attention.register()
    _features.append("decode-attention:" + attention.NAME)
    from sglang_elastic import gcstats

    gcstats.register()  # SGLANG_ELASTIC_GC_STATS=1 only: this process's garbage collections timed, the scheduler's reported
    from sglang_elastic import dummy_init

    dummy_init.register()  # SGLANG_ELASTIC_DUMMY_INIT=unit only: --load-format dummy weights under which attention shows in the outputs
    from sglang_elastic import offload

    offload.register()
    # Scheduler processes inherit the launcher's parsed config (SGLANG_ELASTIC_CONFIG).
    if config.current().enabled:
        from sglang_elastic.sched import hooks

        hooks.register()
        _features.append("elastic-kv")
    if config.current().offload.enabled:
        from sglang_elastic.offload import hooks as offload_hooks

        offload_hooks.register()
        _features.append("kv-offload")
    logger.info("sglang-elastic %s plugin loaded (features: %s)", __version__, ", ".join(_features) or "none")


def _add_cli_args(result, parser, *args, **kwargs):
    from sglang_elastic import config

    config.add_cli_args(parser)
    return result


def _from_cli_args(cls, ns, *args, **kwargs):
    from sglang_elastic import config, dummy_init

    try:
        dummy_init.mode()
    except ValueError as e:
        raise SystemExit(f"sglang-elastic: {e}") from None
    try:
        cfg = config.from_namespace(ns)
        config.check_server_args(cfg, ns)
    except config.ConfigError as e:
        raise SystemExit(f"sglang-elastic: {e}") from None
    config.apply_offload_defaults(cfg, ns)
    config.publish(cfg)
    return None


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
        "features": list(_features) + (["elastic-kv"] if _elastic_enabled() and "elastic-kv" not in _features else []),
    }


def _elastic_enabled() -> bool:
    from sglang_elastic import config

    return config.current().enabled
