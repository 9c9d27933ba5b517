"""What a decode step of the KV offload path attends to: the budget rule, and
a float64 PyTorch reference of the selection and of the sparse attention.

This module is the specification the kernels (``sglang_elastic.kernels.offload``)
and the accuracy oracle (:mod:`sglang_elastic.offload.oracle`) are checked
against; it needs only PyTorch.

The rule, per request of ``L`` KV positions (the current token included), per
layer at or above ``dense_layers`` (layers below attend densely):

- **sink**: positions ``[0, S_eff)``, ``S_eff = min(sink, L)``;
- **window**: the last ``W_eff = min(window, L - S_eff)`` positions;
- **top-k** of the middle positions by the sum, over the query heads of the
  rank, of each head's softmax over all ``L`` positions (the group's summed
  softmax, summed over this rank's KV-head groups: one set of token rows per
  request and layer, so a fetch is one contiguous V row of all KV heads);
  ``k = clamp(A - S_eff - W_eff, 0, min(L - S_eff - W_eff, max_topk))`` with the
  attended target ``A = max(sink + window, floor(budget_frac * L))``. Ties go to
  the lower position.

The output over the attended set ``T``: ``o_h = sum_{i in T} exp(s_hi - lse_h) v_i``
with ``lse_h`` the log-sum-exp over ``T`` (``denominator="selected"``, this
class's default: renormalised, what the selectors of the anchors' accuracy study
computed) or over **all** ``L`` positions (``"full"``: exact scores, only the
V sum is sparse, as issue 24's Build 3 words it). The server's default
(``--kv-offload-denominator``, :class:`sglang_elastic.config.OffloadConfig`) is
``"estimate"``, below. ``selected`` measured better than ``full``: on SmolLM2-135M at a 5 % budget
``full`` has 3-9x the next-token KL of ``selected`` in every task and length
(natural text at 2K: 0.177 against 0.037) and keeps fewer dense-solved
answers (4-value NIAH at 20 %: 2 of 5 against 5 of 5):
``docs/offload-oracle.md``. ``full`` drops the unattended tokens' share of
the V sum (the output shrinks by the attended mass), ``selected`` spreads it
over the attended rows. ``"estimate"`` keeps the exact denominator and adds
the unattended share with each ``chunk``-position chunk's mean V standing in
for its unattended rows (:func:`estimate_reference`; the pool keeps the means
on the GPU): on the CPU oracle it had a fifth to a tenth of ``selected``'s
KL and kept the 4-value NIAH answers ``selected`` lost.

Ideas: InfiniGen (Lee et al., OSDI'24, arXiv 2406.19707: attend to the tokens
that matter, sink and layers 0-1 dense); the exact top-k token rows of
``shared/design/offload-anchors.md`` §5.3 (``oracle_tok``: lossless at 2.4 % of
KV on SmolLM2-135M); Quest / ShadowKV budgets (1.5-7 % of the context).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # torch is imported where a tensor is made: flag checks (``sglang-elastic serve --dry-run``) run without it
    import torch

DENOMINATORS = ("selected", "full", "estimate")

#: selection granularities (``OffloadPolicy.granularity``): ``token`` is what the kernels run
GRANULARITIES = ("token", "kv_head")


#: ``--kv-offload-chunk`` values: powers of two that divide the split-KV plans' block (64 positions)
CHUNKS = (8, 16, 32, 64)


class PolicyError(ValueError):
    """A policy field out of range; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """The attended set of a decode step.

    Fields (flag): ``sink`` (``--kv-offload-sink``, tokens), ``window``
    (``--kv-offload-window``, tokens), ``budget_frac`` (``--kv-offload-budget``,
    attended fraction of the context), ``max_topk`` (``--kv-offload-topk``,
    the most selected rows per request and layer besides sink and window),
    ``dense_layers`` (``--kv-offload-dense-layers``: layers ``0 .. n-1``
    attend to everything), ``denominator`` (``--kv-offload-denominator``:
    ``selected``, ``full`` or ``estimate``, see the module docstring),
    ``chunk`` (``--kv-offload-chunk``, positions per V summary of
    ``estimate``), ``granularity`` (``token``: one set of token rows per
    request and layer, ranked by the summed softmax of every head, what the
    kernels run; ``kv_head``: each KV head's own top-k by its query group's
    summed softmax, as issue 24's Build 3 words it: same KV bytes attended,
    float64 reference and CPU oracle only).

    Raises:
        PolicyError: a negative size, a budget outside (0, 1] or with more than
            6 decimals, an unknown denominator or granularity, a chunk not in
            :data:`CHUNKS` or (``estimate``) above the window.
    """

    sink: int = 4
    window: int = 32
    budget_frac: float = 0.05
    max_topk: int = 2048
    dense_layers: int = 2
    denominator: str = "selected"
    chunk: int = 16
    granularity: str = "token"

    def __post_init__(self):
        for name, flag in (("sink", "sink"), ("window", "window"), ("max_topk", "topk"), ("dense_layers", "dense-layers")):
            if getattr(self, name) < 0:
                raise PolicyError(f"--kv-offload-{flag} must be >= 0, not {getattr(self, name)}")
        if not 0.0 < self.budget_frac <= 1.0:
            raise PolicyError(f"--kv-offload-budget must be in (0, 1], not {self.budget_frac}")
        # counts() and counts_tensor() compute floor(frac * L) in integers of 1e-6
        if abs(round(self.budget_frac * 1_000_000) / 1_000_000 - self.budget_frac) > 1e-12:
            raise PolicyError(f"--kv-offload-budget {self.budget_frac}: give at most 6 decimals")
        if self.denominator not in DENOMINATORS:
            raise PolicyError(f"--kv-offload-denominator must be one of {', '.join(DENOMINATORS)}, not {self.denominator!r}")
        if self.chunk not in CHUNKS:
            raise PolicyError(f"--kv-offload-chunk must be one of {', '.join(map(str, CHUNKS))}, not {self.chunk}")
        if self.granularity not in GRANULARITIES:
            raise PolicyError(f"selection granularity must be one of {', '.join(GRANULARITIES)}, not {self.granularity!r}")
        if self.denominator == "estimate" and self.chunk > self.window:
            # the last, incomplete chunk (fewer than `chunk` positions) must lie inside the window
            raise PolicyError(f"--kv-offload-chunk {self.chunk} must be at most --kv-offload-window {self.window} with --kv-offload-denominator estimate")

    @property
    def max_attended(self) -> int:
        """The most positions one request attends to in a sparse layer."""
        return self.sink + self.window + self.max_topk

    def counts(self, length: int):
        """``(S_eff, W_eff, k)`` for a request of ``length`` positions (Python ints)."""
        s = min(self.sink, length)
        w = min(self.window, length - s)
        rest = length - s - w
        target = max(self.sink + self.window, length * round(self.budget_frac * 1_000_000) // 1_000_000)
        k = max(0, min(target - s - w, rest, self.max_topk))
        return s, w, k

    def counts_tensor(self, lengths: torch.Tensor):
        """:meth:`counts` for a tensor of lengths (int32/int64, any device); the
        same integers. ``floor(frac * L)`` is computed in integers (the budget has at most 6 decimals), as
        :meth:`counts` does, so host and device agree."""
        import torch

        L = lengths.to(torch.int64)
        s = torch.clamp(L, max=self.sink)
        w = torch.minimum(torch.full_like(L, self.window), L - s)
        rest = L - s - w
        num = round(self.budget_frac * 1_000_000)
        target = torch.clamp(L * num // 1_000_000, min=self.sink + self.window)
        k = torch.clamp(torch.minimum(torch.minimum(target - s - w, rest), torch.full_like(L, self.max_topk)), min=0)
        return s, w, k

    def is_dense_layer(self, layer_id: int) -> bool:
        return layer_id < self.dense_layers


def token_scores(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Each position's summed softmax over the heads.

    Args:
        scores: ``[heads, L]`` ``q . k * scale`` of one request (any float dtype).
        lse: ``[heads]`` log-sum-exp of each head's scores over all ``L``.

    Returns:
        ``[L]`` float64: ``sum_h exp(scores[h] - lse[h])`` (in [0, heads]).
    """
    import torch

    return torch.exp(scores.double() - lse.double()[:, None]).sum(0)


def select_reference(p: torch.Tensor, policy: OffloadPolicy) -> torch.Tensor:
    """The attended positions of one request (float64 reference).

    Args:
        p: ``[L]`` per-position score (:func:`token_scores`).
        policy: the budget rule.

    Returns:
        ``[S_eff + W_eff + k]`` int64 positions: sink ascending, then window
        ascending, then the top-k middle positions by ``p`` (ties to the lower
        position), in descending ``p``.
    """
    import torch

    L = p.shape[0]
    s, w, k = policy.counts(L)
    sink = torch.arange(s, dtype=torch.int64)
    window = torch.arange(L - w, L, dtype=torch.int64)
    mid = p[s: L - w].double()
    if k == 0:
        top = torch.empty(0, dtype=torch.int64)
    else:
        # stable sort of -p keeps the lower position first among equals
        order = torch.sort(-mid, stable=True).indices[:k]
        top = order.to(torch.int64) + s
    return torch.cat([sink, window, top])


def attend_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: OffloadPolicy, layer_id: int, sm_scale: Optional[float] = None,
    return_selected: bool = False,
):
    """One request's decode attention under the policy (float64).

    Args:
        q: ``[q_heads, D]`` the current token's queries.
        k, v: ``[L, kv_heads, D]`` all positions' keys and values (the current one included).
        policy: the budget rule; ``layer_id`` below ``policy.dense_layers`` attends to everything.
        sm_scale: softmax scale (default ``D ** -0.5``).
        return_selected: also return the attended positions.

    Returns:
        ``[q_heads, D]`` float64 (and the ``[n]`` int64 positions if asked;
        ``[kv_heads, n]`` with ``granularity="kv_head"``).

    Raises:
        ValueError: q heads not a multiple of kv heads.
    """
    import torch

    Hq, D = q.shape
    L, Hkv, _ = k.shape
    if Hq % Hkv:
        raise ValueError(f"q heads {Hq} not a multiple of kv heads {Hkv}")
    G = Hq // Hkv
    scale = sm_scale if sm_scale is not None else D ** -0.5
    kk = k.double().repeat_interleave(G, dim=1)  # [L, Hq, D]
    vv = v.double().repeat_interleave(G, dim=1)
    s = torch.einsum("hd,lhd->hl", q.double(), kk) * scale  # [Hq, L]
    lse = torch.logsumexp(s, dim=1)
    if policy.is_dense_layer(layer_id):
        sel = torch.arange(L, dtype=torch.int64)
    elif policy.granularity == "kv_head":  # each KV head's own attended set, from its query group's scores
        out = torch.empty(Hq, vv.shape[-1], dtype=torch.float64)
        sels = []
        for g in range(Hkv):
            h = slice(g * G, (g + 1) * G)
            sel_g = select_reference(token_scores(s[h], lse[h]), policy)
            ss = s[h][:, sel_g]
            denom = torch.logsumexp(ss, dim=1) if policy.denominator == "selected" else lse[h]
            out[h] = torch.einsum("hn,nhd->hd", torch.exp(ss - denom[:, None]), vv[sel_g][:, h])
            if policy.denominator == "estimate":
                out[h] += estimate_reference(s[h], lse[h], v[:, g: g + 1].double(), sel_g, policy.chunk, G)
            sels.append(sel_g)
        return (out, torch.stack(sels)) if return_selected else out
    else:
        sel = select_reference(token_scores(s, lse), policy)
    ss = s[:, sel]
    denom = torch.logsumexp(ss, dim=1) if policy.denominator == "selected" else lse
    w = torch.exp(ss - denom[:, None])  # [Hq, n]
    out = torch.einsum("hn,nhd->hd", w, vv[sel])
    if policy.denominator == "estimate" and not policy.is_dense_layer(layer_id):
        out = out + estimate_reference(s, lse, v.double(), sel, policy.chunk, G)
    return (out, sel) if return_selected else out


def estimate_reference(s: torch.Tensor, lse: torch.Tensor, v: torch.Tensor, attended: torch.Tensor, chunk: int, group: int) -> torch.Tensor:
    """The unattended positions' share of the V sum, estimated by chunk means (float64).

    ``sum_c m_hc * vbar_c`` over the request's complete chunks ``c`` (positions
    ``[c * chunk, (c + 1) * chunk)``, ``c < L // chunk``), with ``vbar_c`` the
    mean V of the chunk (all its positions) and ``m_hc = sum exp(s_hi -
    lse_h)`` over the chunk's positions that are not attended. The last,
    incomplete chunk lies inside the window (``chunk <= window``), so every
    unattended position is counted once. The idea: RetroInfer's estimation
    zone (microsoft/RetrievalAttention, ``shared/design/offload-anchors.md``
    §2: cluster centroids stand in for the tokens not retrieved) on exact scores: the softmax weights are exact,
    only the unattended values are approximated, where ``full`` drops them
    and ``selected`` spreads their weight over the attended rows.

    Args:
        s: ``[q_heads, L]`` scaled scores; lse: ``[q_heads]`` over all ``L``.
        v: ``[L, kv_heads, D]`` float64 values.
        attended: ``[n]`` int64 attended positions.
        chunk: positions per chunk; group: query heads per KV head.

    Returns:
        ``[q_heads, D]`` float64.
    """
    import torch

    Hq, L = s.shape
    nc = L // chunk
    out = torch.zeros(Hq, v.shape[-1], dtype=torch.float64)
    if nc == 0:
        return out
    keep = torch.ones(L, dtype=torch.bool)
    keep[attended] = False
    p = torch.exp(s.double() - lse.double()[:, None]) * keep.double()[None, :]
    mass = p[:, : nc * chunk].reshape(Hq, nc, chunk).sum(2)  # [Hq, nc]
    vbar = v[: nc * chunk].reshape(nc, chunk, v.shape[1], v.shape[2]).mean(1).repeat_interleave(group, dim=1)  # [nc, Hq, D]
    return torch.einsum("hc,chd->hd", mass, vbar)


__all__ = ["CHUNKS", "DENOMINATORS", "GRANULARITIES", "OffloadPolicy", "PolicyError", "attend_reference", "estimate_reference", "select_reference", "token_scores"]
