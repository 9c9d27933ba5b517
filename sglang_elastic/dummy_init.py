"""Random weights under which attention changes the output (opt-in: ``SGLANG_ELASTIC_DUMMY_INIT=unit``).

Why: SGLang 0.5.17's ``--load-format dummy`` fills every floating-point parameter, norm weights
included, with U(-1e-3, 1e-3) (``initialize_dummy_weights``, ``sglang/srt/model_loader/weight_utils.py``).
Every RMSNorm then scales its output down to ~6e-4 an element, so q, k and v are ~2e-5, the
attention output averages V over the context, and what a layer adds to the residual stream is
below bf16's resolution of it: the logits depend on the current token's embedding alone. A
server whose attention reads wrong V rows, zeros or another request's KV gives the same greedy
tokens and logprobs as a correct one (``tests/test_dummy_init.py`` zeroes half of every layer's
V: max |delta logprob| 0.0 under SGLang's init). So "identical outputs" between two servers on
dummy weights says nothing about their attention, and a sparse selection over near-equal scores
says little about a real model's hit rates.

:func:`unit_init_` keeps the shapes and the determinism (a fixed seed per parameter name, so two
servers, and every TP rank, get the same values) and gives the activations unit scale: norm
weights 1 (0 for Gemma's ``1 + weight`` norms), biases 0, every other weight U(-a, a) with
``a = sqrt(3 / fan_in)`` (unit variance out for unit variance in; ``fan_in`` is a linear layer's
whole ``input_size``, so a row-parallel shard at TP > 1 scales as the unsharded layer, an
embedding's or a packed expert weight's last dimension otherwise). Attention scores then have
a standard deviation of about 1, and an attention error moves the logits by tenths.

Not for speed comparisons with earlier runs: the values change what a sparse selection picks
(the offload path's hit rate, its PCIe bytes), not the kernels' cost.

With the variable set to ``unit``, :func:`register` (run by the plugin's entry point in every
process) wraps SGLang's ``initialize_dummy_weights`` (an AROUND hook, so SGLang's own fill runs
first and low-precision parameters it handles keep its values); unset, nothing is registered.
Another value stops the start-up with one line (:func:`mode`).
"""

from __future__ import annotations

import math
import os
import zlib
from typing import Optional

import torch

ENV = "SGLANG_ELASTIC_DUMMY_INIT"
MODES = ("unit",)
SEED = 1234  # SGLang's dummy seed
_registered = False


def mode() -> Optional[str]:
    """The mode ``SGLANG_ELASTIC_DUMMY_INIT`` asks for: None (unset or empty) or ``"unit"``.

    Raises:
        ValueError: another value (one line naming it and the accepted ones).
    """
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    if raw not in MODES:
        raise ValueError(f"{ENV}={raw!r}: give one of {', '.join(MODES)} (or leave it unset for SGLang's own dummy weights)")
    return raw


def _fan_in(module: torch.nn.Module, weight: torch.Tensor) -> int:
    """The inputs one output of ``module`` sums over: SGLang's ``LinearBase.input_size`` (the whole
    layer's, a row-parallel shard's included), ``nn.Linear.in_features``, else the last dimension."""
    for attr in ("input_size", "in_features"):
        v = getattr(module, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    return max(int(weight.shape[-1]), 1)


@torch.no_grad()
def unit_init_(model: torch.nn.Module, seed: int = SEED) -> int:
    """Refill ``model``'s floating-point parameters of 16 bits or more in place (see the module docstring).

    Args:
        model: any module; SGLang's models, Hugging Face's and plain ``torch.nn`` layers alike.
        seed: the base seed; each parameter's generator is seeded with ``seed + crc32(name)``.

    Returns:
        The number of parameters refilled (low-precision ones, e.g. FP8, keep what they had).
    """
    done = 0
    for mod_name, module in model.named_modules():
        norm = "norm" in type(module).__name__.lower()
        gemma = "gemma" in type(module).__name__.lower()
        for p_name, p in module.named_parameters(recurse=False):
            if not torch.is_floating_point(p) or torch.finfo(p.dtype).bits < 16:
                continue
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if p.dim() <= 1:
                p.fill_(0.0 if (gemma or not norm or p_name != "weight") else 1.0)
            else:
                g = torch.Generator(device=p.device)
                g.manual_seed(seed + zlib.crc32(name.encode()))
                a = math.sqrt(3.0 / _fan_in(module, p))
                p.uniform_(-a, a, generator=g)
            done += 1
    return done


def around_initialize_dummy_weights(original_fn, model, *args, **kwargs):
    """AROUND hook on SGLang's ``initialize_dummy_weights``: SGLang's fill, then :func:`unit_init_`."""
    out = original_fn(model, *args, **kwargs)
    unit_init_(model)
    return out


def register() -> None:
    """With ``SGLANG_ELASTIC_DUMMY_INIT=unit``, hook SGLang's dummy fill (applied by
    ``HookRegistry.apply_hooks`` after the plugins load; the hook registry also rebinds
    ``sglang.srt.model_loader.loader``'s imported name). Idempotent.

    Raises:
        ValueError: the variable holds another value (:func:`mode`).
    """
    global _registered
    if mode() is None or _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.model_loader.weight_utils.initialize_dummy_weights", around_initialize_dummy_weights,
                          HookType.AROUND)
    _registered = True
