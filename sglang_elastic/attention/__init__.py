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
