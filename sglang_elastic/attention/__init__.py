"""Decode attention for SGLang: the ``persistentkv`` backend and its adaptive policy.

- :mod:`sglang_elastic.attention.backend`: the SGLang ``AttentionBackend``
  (decode only; FlashInfer, split-KV or the compact work queue per batch).
- :mod:`sglang_elastic.attention.policy`: the cost model and calibration schema.
- :mod:`sglang_elastic.attention.calibrate`: fitting the calibration to timings.
- ``calibration/``: calibration files shipped per GPU.

The plugin calls :func:`register` in every SGLang process; the backend module
(torch, Triton) is imported only when SGLang builds the backend.
"""

from __future__ import annotations

NAME = "persistentkv"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_state_hook_registered = False


def create_persistentkv_backend(model_runner):
    """SGLang attention-registry factory for ``persistentkv`` (``ATTENTION_BACKENDS[NAME](model_runner)``)."""
    from sglang_elastic.attention.backend import PersistentKVAttnBackend

    return PersistentKVAttnBackend(model_runner)


def register() -> None:
    """Register ``persistentkv`` in SGLang's attention registry and its
    ``--attention-backend`` / ``--decode-attention-backend`` choices (idempotent)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if NAME not in ATTENTION_BACKENDS:
        register_attention_backend(NAME)(create_persistentkv_backend)
    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])
    global _state_hook_registered
    if not _state_hook_registered:  # applied by SGLang's HookRegistry.apply_hooks after the plugins load
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(f"{_SCHEDULER}.get_internal_state", after_internal_state, HookType.AFTER)
        _state_hook_registered = True


def after_internal_state(result, sched, *args, **kwargs):
    """AFTER hook on ``Scheduler.get_internal_state``: the decode backend's
    :meth:`~sglang_elastic.attention.backend.PersistentKVAttnBackend.state`
    under ``persistentkv`` in ``/server_info``'s ``internal_states`` (nothing
    when the server runs another decode backend)."""
    runner = getattr(getattr(sched, "tp_worker", None), "model_runner", None)
    state = getattr(result, "internal_state", None)
    if runner is None or not isinstance(state, dict):
        return result
    from sglang_elastic.attention.backend import find_backend

    be = find_backend(runner)
    if be is not None:
        state[NAME] = be.state()
    return result
