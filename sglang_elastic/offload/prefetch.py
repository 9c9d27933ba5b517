"""InfiniGen's prefetch for the offload path: while layer ``l`` runs, guess
layer ``l + 1``'s selection and copy its V misses ahead
(``--kv-offload-prefetch speculative``).

InfiniGen (Lee et al., OSDI'24, arXiv 2406.19707) observes that consecutive
layers' attention inputs are nearly parallel: layer ``l``'s normed attention
input times layer ``l + 1``'s query weights, rotated by layer ``l + 1``'s
RoPE, ranks layer ``l + 1``'s tokens almost as its own query will. Here K is
resident in full, so the guess is scored against the whole K of layer
``l + 1`` exactly (InfiniGen's partial weights and skewing matrices are not
needed: an orthogonal skew leaves full-dimension scores unchanged; the
anchors' study kept 19-20/20 NIAH samples with the full-dimension guess and
10/19 with InfiniGen's 25 % of dimensions, ``shared/design/offload-anchors.md`` §5.3).

Wiring: an AROUND hook on the attention modules' ``forward`` (SGLang's
``LlamaAttention`` and ``Qwen2Attention``, ``sglang/srt/models/llama.py`` /
``qwen2.py``: ``qkv_proj``, ``rotary_emb``, ``attn.layer_id``) computes the
guessed query of the next layer from the ``hidden_states`` the module
receives and hands it to the backend (:meth:`OffloadAttnBackend.prefetch`),
which runs the selection and the copies on a side stream; the next layer's
attention waits on that stream's event before it touches its hot buffer
(SGLang's ``LayerDoneCounter`` pattern). Recorded in the decode CUDA graphs
like the rest of the step (a fork and a join of the capture stream).
"""

from __future__ import annotations

import logging
from typing import Dict, Optional

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

#: Attention classes whose forward gets the hook (SGLang 0.5.17).
TARGETS = ("sglang.srt.models.llama.LlamaAttention.forward", "sglang.srt.models.qwen2.Qwen2Attention.forward")
_active = None  # the backend whose prefetch is on (one per scheduler process)
_installed = False


def attention_modules(model) -> Dict[int, torch.nn.Module]:
    """The model's attention modules by layer id: those with ``qkv_proj``
    (unquantized bf16/fp16 weight), ``rotary_emb``, ``q_size``, ``kv_size``
    and an ``attn`` with a ``layer_id``."""
    out = {}
    for m in model.modules():
        attn = getattr(m, "attn", None)
        w = getattr(getattr(m, "qkv_proj", None), "weight", None)
        if (attn is not None and hasattr(attn, "layer_id") and hasattr(m, "rotary_emb") and hasattr(m, "q_size")
                and hasattr(m, "kv_size") and isinstance(w, torch.Tensor) and w.dtype in (torch.bfloat16, torch.float16)):
            out[attn.layer_id] = m
    return out


def guessed_query(module, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    """``RoPE(W_q(module) . hidden_states)``: ``[tokens, q_size]`` in the weights' dtype.

    Args:
        module: the next layer's attention module.
        positions: ``[tokens]`` positions (the current layer's).
        hidden_states: ``[tokens, hidden]`` the current layer's normed attention input.
    """
    lin = module.qkv_proj
    bias = getattr(lin, "bias", None)
    q = F.linear(hidden_states, lin.weight[: module.q_size], None if bias is None else bias[: module.q_size])
    k = torch.zeros((q.shape[0], module.kv_size), dtype=q.dtype, device=q.device)
    q, _ = module.rotary_emb(positions, q, k)
    return q


def install(backend, model) -> bool:
    """Hook the model's attention modules for ``backend``'s prefetch; False
    (and one warning) when the model has none of the supported form."""
    global _active, _installed
    mods = attention_modules(model)
    if not mods:
        logger.warning("sglang-elastic: --kv-offload-prefetch speculative needs Llama/Qwen2-style attention with bf16/fp16 "
                       "query weights; prefetch is off for this model")
        return False
    backend.spec_modules = mods
    _active = backend
    if not _installed:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        for t in TARGETS:
            HookRegistry.register(t, _around_forward, HookType.AROUND)
        HookRegistry.apply_hooks()
        _installed = True
    return True


def _around_forward(orig, module, positions, hidden_states, forward_batch, *args, **kwargs):
    be = _active
    if be is not None and forward_batch.forward_mode.is_decode():
        nxt: Optional[torch.nn.Module] = be.spec_modules.get(module.attn.layer_id + 1)
        if nxt is not None and be.wants_prefetch(nxt.attn.layer_id):
            be.prefetch(nxt.attn.layer_id, guessed_query(nxt, positions, hidden_states), forward_batch, nxt.attn.scaling)
    return orig(module, positions, hidden_states, forward_batch, *args, **kwargs)


__all__ = ["TARGETS", "attention_modules", "guessed_query", "install"]
