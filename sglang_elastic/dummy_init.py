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

:func:`unit_init_` keeps the shapes and the determinism (a fixed seed per parameter name and TP shard,
so two servers at the same TP get the same values, and the shards of one tensor-parallel weight
differ as an unsharded weight's parts do) and gives the activations unit scale: norm weights 1 (0
for Gemma's ``1 + weight`` norms), biases 0, every other weight U(-a, a) with
``a = sqrt(3 / fan_in)`` (unit variance out for unit variance in; ``fan_in`` is a linear layer's
whole ``input_size``, so the TP ranks' row-parallel partial sums add up to unit variance, an
embedding's or a packed expert weight's last dimension otherwise: at TP > 1 a fused MoE's
``w2`` is then scaled by its shard, sqrt(TP) too large). Modules with a quantized method keep
SGLang's values (their scales would not survive a refill). Attention scores then have a standard
deviation of about 1: the logits move when attention does, by whole units for gross errors (half
of V wrong) and by about as much as a kernel change for a few rows of thousands, so a bit-exact
comparison sees both and a tolerance comparison only the first.

Dense kernels cost the same on any values; what a sparse selection picks does not (the offload
path's hit rate, its PCIe bytes), so loads under it are not comparable with loads under SGLang's.

With the variable set, :func:`register` (run by the plugin's entry point in every process) wraps
SGLang's ``initialize_dummy_weights`` (an AROUND hook, so SGLang's own fill runs first and
low-precision parameters it handles keep its values); unset or empty, nothing is registered. A
value other than ``unit`` stops ``launch_server`` with one line before any process starts
(``plugin._from_cli_args``) and fails the model load with the same line where no command line is
parsed (``sgl.Engine``).
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


def _shard(module: torch.nn.Module) -> int:
    """0 for a weight every TP rank holds whole; for SGLang's tensor-parallel layers at TP > 1 a number
    that differs between the ranks' shards (``tp_rank + 1``, or a vocabulary shard's first row + 1)."""
    tp = getattr(module, "tp_size", 1)
    if not isinstance(tp, int) or tp <= 1:
        return 0
    rank = getattr(module, "tp_rank", None)
    if isinstance(rank, int):
        return rank + 1
    start = getattr(getattr(module, "shard_indices", None), "org_vocab_start_index", None)
    return start + 1 if isinstance(start, int) else 0


def _quantized(module: torch.nn.Module) -> bool:
    """SGLang's layer with a quantized method (its weights and scales are SGLang's to fill)."""
    qm = getattr(module, "quant_method", None)
    return qm is not None and not type(qm).__name__.startswith("Unquantized")


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
        seed: the base seed; each parameter's generator is seeded with ``seed + crc32(name)``, plus
            ``1_000_003 * shard`` for a tensor-parallel shard (:func:`_shard`).

    Returns:
        The number of parameters refilled (low-precision ones, e.g. FP8, keep what they had).
    """
    done = 0
    for mod_name, module in model.named_modules():
        if _quantized(module):
            continue
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
                g.manual_seed(seed + zlib.crc32(name.encode()) + 1_000_003 * _shard(module))
                a = math.sqrt(3.0 / _fan_in(module, p))
                p.uniform_(-a, a, generator=g)
            done += 1
    return done


def around_initialize_dummy_weights(original_fn, model, *args, **kwargs):
    """AROUND hook on SGLang's ``initialize_dummy_weights``: SGLang's fill, then :func:`unit_init_`.

    Raises:
        ValueError: ``SGLANG_ELASTIC_DUMMY_INIT`` holds a value other than ``unit`` (:func:`mode`).
    """
    out = original_fn(model, *args, **kwargs)
    if mode() == "unit":
        unit_init_(model)
    return out


def register() -> None:
    """With ``SGLANG_ELASTIC_DUMMY_INIT`` set, hook SGLang's dummy fill (applied by
    ``HookRegistry.apply_hooks`` after the plugins load; the hook registry also rebinds
    ``sglang.srt.model_loader.loader``'s imported name); a bad value is refused when the hook runs
    (:func:`around_initialize_dummy_weights`). Idempotent."""
    global _registered
    if not os.environ.get(ENV, "").strip() or _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.model_loader.weight_utils.initialize_dummy_weights", around_initialize_dummy_weights,
                          HookType.AROUND)
    _registered = True
