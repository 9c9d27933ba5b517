"""Kernels of the KV offload path (Triton): exact scores, top-k selection,
hot-buffer swap-in from pinned host memory, sparse attention.

A decode step of a sparse layer (``sglang_elastic.offload``), per request:

1. :func:`scores_run` — ``s = q . K * scale`` over **all** of the request's K
   rows (the KV pool holds K of every token), written to a flat score buffer
   ``[q_heads, total]``, plus the per-head log-sum-exp over all positions
   (split-KV partials merged by :func:`lse_merge`). Grid ``(batch, kv_heads,
   max_splits)``, as :func:`sglang_elastic.kernels.decode_attention.split_kv_run`.
2. :func:`select_run` — each middle position's summed softmax
   ``p = sum_h exp(s_h - lse_h)`` and the top ``k[b]`` of them by an exact
   radix select on ``p``'s bits (four 8-bit passes, MSB first, then a count
   and an order-keeping compaction; ties to the lower position). A fixed
   number of programs per request, each over a slice of it: cost linear in
   the request's own length (no padding to the longest context).
3. :func:`swap_in_run` — the request's hot buffer (``HN`` V rows per layer on
   the GPU): hits are found through ``loc_slot[token id]`` verified against
   ``slot_pos[slot]``; misses take the least recently used slots
   (``slot_time``, the request's length when last used: a threshold found by
   binary search, ties by slot); the miss list (host row -> device row) goes
   to :func:`copy_rows_run`, which copies the V rows from pinned host memory
   on the GPU (UVA loads, never a CPU gather). Writes the attended lists'
   selected part: K ids (the pool's token ids) and V rows (hot-buffer rows).
4. :func:`attend_run` — split-KV attention over the attended lists with
   separate K and V rows (the decode kernel's partials with ``SEP_V``), the
   merge dividing by the exact full-context ``lse`` (``FULL_LSE``) or by the
   attended set's own sum.
5. :func:`estimate_run` (``--kv-offload-denominator estimate``) — the
   unattended positions' softmax mass per chunk of ``C`` positions times the
   chunk's mean V (kept on the GPU), added to the exact-denominator output.

Every step is a fixed-grid launch over device tensors (no host read), so a
batch size's step can be captured in a CUDA graph and replayed with other
lengths. Under ``TRITON_INTERPRET=1`` the same kernels run on the CPU (tests).

Ideas: InfiniGen (arXiv 2406.19707: attend to the rows that matter, fetch only
those); SGLang 0.5.17's HiSparse swap-in (``sglang/kernels/jit/csrc/hisparse.cuh``,
``load_cache_to_device_buffer_kernel``: a per-request hot buffer with LRU and
GPU-initiated copies of the misses from pinned host memory); radix select
(as in PyTorch's ``topk``); Flash-Decoding for the split-KV passes.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from sglang_elastic.config import LFU_MAX_LEN  # noqa: F401  (the swap-in kernel's bound; offload/pool.py reads it here)
from sglang_elastic.kernels.decode_attention import (
    MERGE_BLOCK_S, _chunk_span, _dot_f32, _launch_opts, _merge_kernel, _partial_attn, _pdl_opts, _shape_args,
)


# ---------------------------------------------------------------------------
# 1. scores over all K
# ---------------------------------------------------------------------------


@triton.jit
def _scores_kernel(
    q_ptr, k_ptr, indptr_ptr, idx_ptr, chunk_ptr, scores_ptr, mid_lse_ptr,
    sm_scale,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_sh, stride_ml_s,
    max_splits,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
    CARRY_IDS: tl.constexpr = True,
):
    """Program ``(b, h, s)``: the scores of KV head ``h``'s G query heads over
    chunk ``s`` of request ``b``, stored at ``scores[qh, t]`` (``t``: the flat
    index into ``idx``), and the chunk's per-head log-sum-exp (``-inf`` for an
    empty chunk) at ``mid_lse[b * max_splits + s, qh]``. ``CARRY_IDS``: the token
    ids of tile i + 1 are loaded while tile i is scored (``decode_attention._partial_attn``'s
    loop-carried ids, which let Triton's sm_90 pipeliner keep more than one K tile in
    flight); off: loaded in the iteration that uses them (the kernel before, kept for the A/B)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    lo, hi, chunk, start, end = _chunk_span(indptr_ptr, chunk_ptr, b, sp)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < G
    mask_d = offs_d < D
    qh = h * G + offs_g
    q = tl.load(q_ptr + b * stride_qb + qh[:, None] * stride_qh + offs_d[None, :], mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    offs_b = tl.arange(0, BLOCK_N)
    nxt = tl.load(idx_ptr + start + offs_b, mask=start + offs_b < end, other=0)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_b
        mask_n = offs_n < end
        if CARRY_IDS:
            tok = nxt.to(tl.int64)
            nxt = tl.load(idx_ptr + offs_n + BLOCK_N, mask=offs_n + BLOCK_N < end, other=0)
        else:
            tok = tl.load(idx_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(k_ptr + tok[:, None] * stride_kt + h * stride_kh + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * sm_scale
        s = tl.where(mask_n[None, :], s, float("-inf"))
        tl.store(scores_ptr + qh[:, None].to(tl.int64) * stride_sh + offs_n[None, :], s, mask=mask_g[:, None] & mask_n[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m_i = m_new
    lse = tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf"))
    tl.store(mid_lse_ptr + (b * max_splits + sp) * stride_ml_s + qh, lse, mask=mask_g)


def scores_run(
    q: torch.Tensor, k_buffer: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, chunk: torch.Tensor,
    max_splits: int, scores: torch.Tensor, mid_lse: torch.Tensor, sm_scale: Optional[float] = None, block_n: int = 64,
    num_warps: Optional[int] = None, num_stages: Optional[int] = None, carry_ids: bool = True,
) -> None:
    """Scores of every position and per-chunk log-sum-exps of one layer.

    Args:
        q: ``[batch, q_heads, head_dim]`` bf16/fp16.
        k_buffer: ``[slots, kv_heads, head_dim]`` (the pool's K of this layer).
        kv_indptr: ``[batch + 1]`` int32 offsets into ``kv_indices``; ``kv_indices``:
            ``[total]`` int32/int64 token ids (all positions of each request, in order).
        chunk: ``[batch]`` int32 tokens per chunk (:func:`~sglang_elastic.kernels.decode_attention.split_kv_plan`
            with ``max_splits``).
        scores: ``[q_heads, >= total]`` float32 output: ``scores[h, kv_indptr[b] + i]``
            is ``q[b, h] . K[pos i] * sm_scale``.
        mid_lse: ``[>= batch * max_splits, q_heads]`` float32 output (merge with :func:`lse_merge`).
        sm_scale: default ``head_dim ** -0.5``.
        carry_ids: load each tile's token ids one tile ahead (``_scores_kernel``'s ``CARRY_IDS``; the
            same scores bit for bit either way; off only for ``scripts/gpu/check_offload.py``'s A/B).
    """
    B, Hq, Hkv, D, G, BLOCK_G, BLOCK_D = _shape_args(q, k_buffer)
    if B == 0:
        return
    sm_scale = sm_scale if sm_scale is not None else D ** -0.5
    _scores_kernel[(B, Hkv, max_splits)](
        q, k_buffer, kv_indptr, kv_indices, chunk, scores, mid_lse, sm_scale,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), scores.stride(0), mid_lse.stride(0),
        max_splits, G=G, BLOCK_G=BLOCK_G, D=D, BLOCK_D=BLOCK_D, BLOCK_N=block_n, DOT_F32=_dot_f32(q), CARRY_IDS=bool(carry_ids),
        **_launch_opts(num_warps, num_stages),
    )


@triton.jit
def _lse_merge_kernel(mid_lse_ptr, out_ptr, stride_ml_s, stride_ob, max_splits, HQ: tl.constexpr, BLOCK_HQ: tl.constexpr,
                      BLOCK_S: tl.constexpr, stamp_ptr=None, BUMP: tl.constexpr = False):
    b = tl.program_id(0)
    if BUMP:  # a new stamp for this layer's attended marks (one writer; the kernels after this one read it)
        if b == 0:  # never 0, the value of a position never marked (the int32 wraps after 2**32 layer steps)
            new = tl.load(stamp_ptr) + 1
            tl.store(stamp_ptr, tl.where(new == 0, 1, new))
    offs_h = tl.arange(0, BLOCK_HQ)
    offs_s = tl.arange(0, BLOCK_S)
    mh = offs_h < HQ
    m = tl.full([BLOCK_HQ], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK_HQ], tl.float32)
    for s0 in range(0, max_splits, BLOCK_S):
        ms = (s0 + offs_s) < max_splits
        x = tl.load(mid_lse_ptr + (b * max_splits + s0 + offs_s)[:, None] * stride_ml_s + offs_h[None, :],
                    mask=ms[:, None] & mh[None, :], other=float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        acc = acc * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[None, :]), 0)
        m = m_new
    lse = tl.where(acc > 0, tl.where(m == float("-inf"), 0.0, m) + tl.log(acc), float("-inf"))
    tl.store(out_ptr + b * stride_ob + offs_h, lse, mask=mh)


def lse_merge(mid_lse: torch.Tensor, batch: int, max_splits: int, out: Optional[torch.Tensor] = None,
              stamp: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[batch, q_heads]`` float32 log-sum-exp over each request's chunks
    (``mid_lse`` rows ``b * max_splits + s``; empty chunks hold ``-inf``).
    One launch (``torch.logsumexp`` cost 0.12 ms at 44 requests x 32 heads x
    32 chunks on the H200, per layer). ``stamp`` (``[1]`` int32, ``estimate``'s
    exact pass): incremented by one in the same launch, the value this
    layer's attended marks carry (:func:`select_run`, :func:`estimate_run`)."""
    Hq = mid_lse.shape[1]
    if out is None:
        out = torch.empty((batch, Hq), dtype=torch.float32, device=mid_lse.device)
    if batch:
        _lse_merge_kernel[(batch,)](mid_lse, out, mid_lse.stride(0), out.stride(0), max_splits, HQ=Hq,
                                    BLOCK_HQ=triton.next_power_of_2(Hq), BLOCK_S=min(32, triton.next_power_of_2(max(max_splits, 1))),
                                    stamp_ptr=stamp, BUMP=stamp is not None)
    return out[:batch]


# ---------------------------------------------------------------------------
# 2. top-k selection (radix select on the summed softmax)
# ---------------------------------------------------------------------------


@triton.jit
def _bucket(hist, k_rem):
    """The 8-bit digit holding the ``k_rem``-th largest element of a 256-bin
    histogram, and the count of elements in higher digits."""
    bins = tl.arange(0, 256)
    c_ge = tl.cumsum(hist, 0, reverse=True)  # elements with digit >= d
    d = tl.max(tl.where(c_ge >= k_rem, bins, -1), 0)
    above = tl.sum(tl.where(bins > d, hist, 0), 0)
    return d, above


@triton.jit
def _select_range(indptr_ptr, s_eff_ptr, w_eff_ptr, k_ptr, b, part, PARTS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Request ``b``'s middle ``[s0, e0)``, its ``k``, and part ``part``'s slice ``[lo_p, hi_p)`` of it."""
    lo = tl.load(indptr_ptr + b)
    L = tl.load(indptr_ptr + b + 1) - lo
    s0 = tl.load(s_eff_ptr + b)
    e0 = L - tl.load(w_eff_ptr + b)
    k = tl.load(k_ptr + b)
    span = tl.cdiv(tl.cdiv(tl.maximum(e0 - s0, 0), PARTS), BLOCK_N) * BLOCK_N
    lo_p = s0 + part * span
    hi_p = tl.minimum(lo_p + span, e0)
    return lo, s0, e0, k, lo_p, hi_p


@triton.jit
def _prefix_of(hist_ptr, b, k, PASSES: tl.constexpr):
    """The bits chosen by the first ``PASSES`` histograms of request ``b`` and how many of the k are still to take."""
    bins = tl.arange(0, 256)
    k_rem = k
    prefix = k * 0
    for j in tl.static_range(PASSES):
        hist = tl.load(hist_ptr + (b * 4 + j) * 256 + bins)
        d, above = _bucket(hist, k_rem)
        k_rem -= above
        prefix = (prefix << 8) | d
    return prefix, k_rem


@triton.jit
def _summed_p(scores_ptr, lse, offs_h, mask_h, stride_sh, p_ptr, lo, pos, m):
    """The summed softmax ``p`` of a block of positions over the heads, stored at ``p_ptr + lo + pos``; returns its
    bits (``p >= 0``: the bits order like the values)."""
    sc = tl.load(scores_ptr + offs_h[:, None].to(tl.int64) * stride_sh + (lo + pos)[None, :],
                 mask=mask_h[:, None] & m[None, :], other=float("-inf"))
    p = tl.sum(tl.exp(sc - lse[:, None]), 0)
    tl.store(p_ptr + lo + pos, p, mask=m)
    return p.to(tl.int32, bitcast=True)


@triton.jit
def _write_selected(sel, p_ptr, lo, pos, m, tau, gt_base, eq_base, k, mark_ptr, stamp, MARK: tl.constexpr):
    """A block's positions above ``tau`` written after ``gt_base``, and those at it after ``eq_base`` while below
    ``k``, in position order (``MARK``: their attended marks stamped); returns how many of each the block holds."""
    bits = tl.load(p_ptr + lo + pos, mask=m, other=0.0).to(tl.int32, bitcast=True)
    gt = m & (bits > tau)
    eq = m & (bits == tau)
    i_gt = gt_base + tl.cumsum(gt.to(tl.int32), 0) - 1
    i_eq = eq_base + tl.cumsum(eq.to(tl.int32), 0) - 1
    tl.store(sel + i_gt, pos, mask=gt)
    tl.store(sel + i_eq, pos, mask=eq & (i_eq < k))
    if MARK:
        tl.store(mark_ptr + lo + pos, stamp, mask=gt | (eq & (i_eq < k)))
    return tl.sum(gt.to(tl.int32), 0), tl.sum(eq.to(tl.int32), 0)


@triton.jit
def _take_all(sel, lo, s0, start, end, offs, mark_ptr, stamp, MARK: tl.constexpr, BLOCK_N: tl.constexpr):
    """The budget covers every middle position: positions ``[start, end)`` written at ``pos - s0`` (dense), with
    ``MARK``'s stamps."""
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs
        tl.store(sel + (pos - s0), pos, mask=pos < end)
        if MARK:
            tl.store(mark_ptr + lo + pos, stamp, mask=pos < end)


@triton.jit
def _select_hist_kernel(
    scores_ptr, lse_ptr, indptr_ptr, s_eff_ptr, w_eff_ptr, k_ptr, p_ptr, hist_ptr,
    stride_sh, stride_lb,
    PASS: tl.constexpr, HQ: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_N: tl.constexpr, PARTS: tl.constexpr,
):
    """Radix pass ``PASS`` (8 bits, MSB first) over part ``program_id(1)`` of
    request ``b``'s middle: pass 0 also computes and stores ``p``."""
    b = tl.program_id(0)
    part = tl.program_id(1)
    lo, s0, e0, k, lo_p, hi_p = _select_range(indptr_ptr, s_eff_ptr, w_eff_ptr, k_ptr, b, part, PARTS, BLOCK_N)
    if (k > 0) & (k < e0 - s0):
        offs = tl.arange(0, BLOCK_N)
        hist = tl.zeros([256], tl.int32)
        if PASS == 0:
            offs_h = tl.arange(0, BLOCK_HQ)
            mask_h = offs_h < HQ
            lse = tl.load(lse_ptr + b * stride_lb + offs_h, mask=mask_h, other=0.0)
            for n0 in range(lo_p, hi_p, BLOCK_N):
                pos = n0 + offs
                m = pos < hi_p
                bits = _summed_p(scores_ptr, lse, offs_h, mask_h, stride_sh, p_ptr, lo, pos, m)
                hist += tl.histogram((bits >> 24) & 0xFF, 256, mask=m)
        else:
            prefix, k_rem = _prefix_of(hist_ptr, b, k, PASS)
            shift: tl.constexpr = 24 - 8 * PASS
            for n0 in range(lo_p, hi_p, BLOCK_N):
                pos = n0 + offs
                m = pos < hi_p
                bits = tl.load(p_ptr + lo + pos, mask=m, other=0.0).to(tl.int32, bitcast=True)
                match = m & ((bits >> (shift + 8)) == prefix)
                hist += tl.histogram((bits >> shift) & 0xFF, 256, mask=match)
        tl.atomic_add(hist_ptr + (b * 4 + PASS) * 256 + tl.arange(0, 256), hist)


@triton.jit
def _select_write_kernel(
    indptr_ptr, s_eff_ptr, w_eff_ptr, k_ptr, p_ptr, hist_ptr, cnt_ptr, sel_ptr, stride_selb,
    COUNT: tl.constexpr, BLOCK_N: tl.constexpr, PARTS: tl.constexpr, mark_ptr=None, stamp_ptr=None, MARK: tl.constexpr = False,
):
    """``COUNT``: part ``program_id(1)``'s counts above and at the threshold;
    else its selected positions, written after those of the parts before it
    (the compaction keeps position order: the same list every run), and,
    ``MARK``, ``mark[lo + pos] = stamp`` for each (``estimate``'s attended marks)."""
    b = tl.program_id(0)
    part = tl.program_id(1)
    lo, s0, e0, k, lo_p, hi_p = _select_range(indptr_ptr, s_eff_ptr, w_eff_ptr, k_ptr, b, part, PARTS, BLOCK_N)
    offs = tl.arange(0, BLOCK_N)
    sel = sel_ptr + b * stride_selb
    stamp = 0
    if MARK:
        stamp = tl.load(stamp_ptr)
    if k >= e0 - s0:
        if not COUNT:  # the budget covers every middle position: take them all (dense)
            _take_all(sel, lo, s0, lo_p, hi_p, offs, mark_ptr, stamp, MARK, BLOCK_N)
    elif k > 0:
        tau, k_rem = _prefix_of(hist_ptr, b, k, 4)  # the bits of the k-th largest p; k - k_rem lie above it
        if COUNT:
            n_gt = k * 0
            n_eq = k * 0
            for n0 in range(lo_p, hi_p, BLOCK_N):
                pos = n0 + offs
                m = pos < hi_p
                bits = tl.load(p_ptr + lo + pos, mask=m, other=0.0).to(tl.int32, bitcast=True)
                n_gt += tl.sum((m & (bits > tau)).to(tl.int32), 0)
                n_eq += tl.sum((m & (bits == tau)).to(tl.int32), 0)
            tl.store(cnt_ptr + (b * PARTS + part) * 2, n_gt)
            tl.store(cnt_ptr + (b * PARTS + part) * 2 + 1, n_eq)
        else:
            offs_p = tl.arange(0, PARTS)
            before = offs_p < part
            cnt_gt = tl.sum(tl.load(cnt_ptr + (b * PARTS + offs_p) * 2, mask=before, other=0), 0)
            cnt_eq = tl.sum(tl.load(cnt_ptr + (b * PARTS + offs_p) * 2 + 1, mask=before, other=0), 0)
            n_gt_all = k - k_rem
            for n0 in range(lo_p, hi_p, BLOCK_N):
                pos = n0 + offs
                n_gt, n_eq = _write_selected(sel, p_ptr, lo, pos, pos < hi_p, tau, cnt_gt, n_gt_all + cnt_eq, k, mark_ptr, stamp, MARK)
                cnt_gt += n_gt
                cnt_eq += n_eq


def select_run(
    scores: torch.Tensor, lse: torch.Tensor, kv_indptr: torch.Tensor, s_eff: torch.Tensor, w_eff: torch.Tensor, k: torch.Tensor,
    p_buf: torch.Tensor, sel_pos: torch.Tensor, q_heads: int, block_n: int = 512, parts: int = 16,
    hist: Optional[torch.Tensor] = None, counts: Optional[torch.Tensor] = None, num_warps: Optional[int] = None,
    marks: Optional[torch.Tensor] = None, stamp: Optional[torch.Tensor] = None,
) -> None:
    """The top ``k[b]`` middle positions of each request by summed softmax.

    An exact radix select on the bits of ``p`` (four 8-bit passes, MSB first,
    ``parts`` programs per request adding into one histogram per pass), then a
    count and an order-keeping compaction: seven launches, no host read.

    Args:
        scores: ``[q_heads, >= total]`` float32 (:func:`scores_run`).
        lse: ``[batch, q_heads]`` float32 (:func:`lse_merge`).
        kv_indptr: ``[batch + 1]`` int32 (the scores' flat offsets; lengths are its differences).
        s_eff, w_eff, k: ``[batch]`` int32: sink and window sizes (positions ``[s_eff, L - w_eff)``
            are the middle) and how many to select (:meth:`~sglang_elastic.offload.policy.OffloadPolicy.counts_tensor`).
        p_buf: ``[>= total]`` float32 scratch (the summed softmax of the middle positions).
        sel_pos: ``[batch, >= max k]`` int32 output: row ``b``'s first ``k[b]`` entries are
            its selected positions (those above the k-th largest in position order, then
            ties at it by position); the rest is left as it was.
        q_heads: heads in ``scores`` (summed over).
        parts: programs per request (a power of two).
        hist, counts: optional workspaces ``[>= batch * 4 * 256]`` / ``[>= batch * parts * 2]``
            int32 (address-stable under CUDA graphs); ``hist`` is zeroed here.
        marks, stamp: ``estimate``'s attended marks, ``[>= total]`` int32 (flat, as ``scores``), and
            ``[1]`` int32 (:func:`lse_merge` bumps it): ``marks[kv_indptr[b] + pos] = stamp`` for every
            selected position (a mark never needs clearing: an older one carries an older stamp).
    """
    B = kv_indptr.shape[0] - 1
    if B == 0:
        return
    if parts < 1 or parts & (parts - 1):
        raise ValueError(f"select_run: parts must be a power of two, not {parts}")
    dev = scores.device
    hist = torch.zeros(B * 4 * 256, dtype=torch.int32, device=dev) if hist is None else hist
    hist[: B * 4 * 256].zero_()
    counts = torch.zeros(B * parts * 2, dtype=torch.int32, device=dev) if counts is None else counts
    opts = _launch_opts(num_warps, None)
    common = dict(BLOCK_N=block_n, PARTS=parts)
    for ps in range(4):
        _select_hist_kernel[(B, parts)](
            scores, lse, kv_indptr, s_eff, w_eff, k, p_buf, hist, scores.stride(0), lse.stride(0),
            PASS=ps, HQ=q_heads, BLOCK_HQ=triton.next_power_of_2(q_heads), **common, **opts,
        )
    for count in (True, False):
        _select_write_kernel[(B, parts)](kv_indptr, s_eff, w_eff, k, p_buf, hist, counts, sel_pos, sel_pos.stride(0), COUNT=count,
                                         mark_ptr=marks, stamp_ptr=stamp, MARK=marks is not None and not count, **common, **opts)


# ---------------------------------------------------------------------------
# 3. hot-buffer swap-in
# ---------------------------------------------------------------------------


# ``lfu`` eviction: ``slot_time`` packs (uses << 21) | last use (the kernel's literals); lengths must stay below
# ``LFU_MAX_LEN`` = 2**21, the torch-free config's value, which checks it at start-up (imported above: one value for both).


@triton.jit
def _swap_in_kernel(
    sel_ptr, k_ptr, s_eff_ptr, w_eff_ptr, att_indptr_ptr, seq_lens_ptr, req_pool_ptr, req_to_token_ptr,
    loc_slot_ptr, slot_pos_ptr, slot_time_ptr, scratch_ptr, table_ptr, count_ptr,
    att_kidx_ptr, att_vidx_ptr, miss_src_ptr, miss_dst_ptr, miss_cnt_ptr, stats_ptr,
    stride_selb, stride_r2t, stride_slot_r, stride_scratch_b, stride_miss_b, stride_table, hot_base, spare_row, stride_hint_r,
    HN: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr,
    SPEC: tl.constexpr = False, LFU: tl.constexpr = False, HINT_ROW: tl.constexpr = False,
):
    b = tl.program_id(0)
    r = tl.load(req_pool_ptr + b).to(tl.int64)
    # the slots this request holds pages for (page_grant_run gave it >= k of them this step)
    cap = tl.minimum(tl.load(count_ptr + r) * PAGE, HN)
    # the LRU clock: the request's length; a speculative pass (a prefetch for the next layer, run
    # before its exact pass in the same step) stamps one less, so the exact pass may still evict
    # what it loaded in vain, and it never evicts what the previous step used
    now = tl.load(seq_lens_ptr + b).to(tl.int32) - SPEC
    k = tl.load(k_ptr + b)
    base = tl.load(att_indptr_ptr + b) + tl.load(s_eff_ptr + b) + tl.load(w_eff_ptr + b)
    slot_pos = slot_pos_ptr + r * stride_slot_r
    slot_time = slot_time_ptr + r * stride_slot_r
    table = table_ptr + r * stride_table  # slot s is device row hot_base + table[s // PAGE] * PAGE + s % PAGE

    if k == 0:  # a kept request (keep-v's general step) or one with no middle: nothing to find, load or count
        tl.store(miss_cnt_ptr + b, 0)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        valid = offs_k < k
        pos = tl.load(sel_ptr + b * stride_selb + offs_k, mask=valid, other=0)
        loc = tl.load(req_to_token_ptr + r * stride_r2t + pos, mask=valid, other=0)
        if HINT_ROW:  # the hint of the request's own position (token ids shared by requests: the radix cache)
            hint = loc_slot_ptr + r * stride_hint_r + pos
        else:  # the hint of the token id
            hint = loc_slot_ptr + loc
        s = tl.load(hint, mask=valid, other=-1).to(tl.int32)
        s_ok = valid & (s >= 0) & (s < cap)
        held = tl.load(slot_pos + s, mask=s_ok, other=-1)
        hit = s_ok & (held == pos)
        if LFU:  # slot_time holds (uses << 21) | last use: a hit counts one more use (at most 1023)
            old = tl.load(slot_time + s, mask=hit, other=-1)
            uses = tl.minimum(tl.maximum(old >> 21, 0) + 1, 1023)
            tl.store(slot_time + s, (uses << 21) + now, mask=hit)
        else:
            tl.store(slot_time + s, now, mask=hit)
        tl.debug_barrier()

        # victims: the m slots of the smallest key not used now (LRU: key = last use; LFU: uses, then last use)
        offs_h = tl.arange(0, BLOCK_H)
        hmask = offs_h < cap
        t = tl.load(slot_time + offs_h, mask=hmask, other=2147483647)
        if LFU:
            last = tl.where(t < 0, -1, t & 2097151)
            avail = hmask & (last < now)
        else:
            avail = hmask & (t < now)
        # the exact pass always has a victim per miss (cap >= k); a speculative one loads only what fits
        miss = valid & (~hit)
        miss = miss & (tl.cumsum(miss.to(tl.int32), 0) <= tl.sum(avail.to(tl.int32), 0))
        m = tl.sum(miss.to(tl.int32), 0)
        if m > 0:  # (all hits, the steady state: no search)
            # the smallest tau with count(avail & t <= tau) >= m: one of the available keys, so a binary search between
            # the smallest and the largest of them (as many rounds as their spread has bits, at most 32); the midpoint
            # floor((lo + hi) / 2) without the sum, which overflows int32 for LFU keys past 2**30 (uses above 511)
            lo_t = tl.min(tl.where(avail, t, 2147483647), 0)
            hi_t = tl.max(tl.where(avail, t, -2), 0)
            while lo_t < hi_t:
                mid = (lo_t >> 1) + (hi_t >> 1) + (lo_t & hi_t & 1)
                left = tl.sum((avail & (t <= mid)).to(tl.int32), 0) >= m
                hi_t = tl.where(left, mid, hi_t)
                lo_t = tl.where(left, lo_t, mid + 1)
            tau = hi_t
            older = avail & (t < tau)
            eq = avail & (t == tau)
            need_eq = m - tl.sum(older.to(tl.int32), 0)
            victim = older | (eq & (tl.cumsum(eq.to(tl.int32), 0) - 1 < need_eq))
            v_rank = tl.cumsum(victim.to(tl.int32), 0) - 1
            tl.store(scratch_ptr + b * stride_scratch_b + v_rank, offs_h, mask=victim)
            tl.debug_barrier()

        m_rank = tl.cumsum(miss.to(tl.int32), 0) - 1
        vslot = tl.load(scratch_ptr + b * stride_scratch_b + m_rank, mask=miss, other=0)
        slot = tl.where(hit, s, vslot)
        tl.store(slot_pos + vslot, pos, mask=miss)
        if LFU:  # a row loaded for this step's selection has one use; a speculative load none yet (a wrong guess goes first)
            tl.store(slot_time + vslot, ((1 - SPEC) << 21) + now, mask=miss)
        else:
            tl.store(slot_time + vslot, now, mask=miss)
        tl.store(hint, vslot.to(loc_slot_ptr.dtype.element_ty), mask=miss)
        tl.store(att_kidx_ptr + base + offs_k, loc, mask=valid)
        # a selected row with no slot (only if a grant found the pool short, which the sizing rules out: counted in
        # the grant's overflow) reads the spare row, never another request's row or memory outside the buffer
        placed = hit | miss
        page = tl.load(table + slot // PAGE, mask=valid & placed, other=-1).to(tl.int64)
        dev_row = tl.where(placed & (page >= 0), hot_base + page * PAGE + slot % PAGE, spare_row)
        tl.store(att_vidx_ptr + base + offs_k, dev_row.to(att_vidx_ptr.dtype.element_ty), mask=valid)
        tl.store(miss_src_ptr + b * stride_miss_b + m_rank, loc.to(miss_src_ptr.dtype.element_ty), mask=miss)
        tl.store(miss_dst_ptr + b * stride_miss_b + m_rank, dev_row.to(miss_dst_ptr.dtype.element_ty), mask=miss)
        tl.store(miss_cnt_ptr + b, m)
        tl.atomic_add(stats_ptr + 0, tl.sum(hit.to(tl.int32), 0).to(tl.int64))  # hits
        tl.atomic_add(stats_ptr + 1, m.to(tl.int64))  # misses (rows copied)


def swap_in_run(
    sel_pos: torch.Tensor, k: torch.Tensor, s_eff: torch.Tensor, w_eff: torch.Tensor, att_indptr: torch.Tensor,
    seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
    loc_slot: torch.Tensor, slot_pos: torch.Tensor, slot_time: torch.Tensor, scratch: torch.Tensor,
    att_kidx: torch.Tensor, att_vidx: torch.Tensor, miss_src: torch.Tensor, miss_dst: torch.Tensor, miss_cnt: torch.Tensor,
    stats: torch.Tensor, max_k: int, table: torch.Tensor, count: torch.Tensor, hot_base: int, page: int,
    spec: bool = False, num_warps: Optional[int] = None, eviction: str = "lru", spare_row: int = -1,
) -> None:
    """Hot-buffer bookkeeping of one layer: hits, victims (LRU or LFU), the miss list.

    Request ``b`` (pool row ``r = req_pool_indices[b]``) has up to ``HN =
    slot_pos.shape[1]`` LRU slots, those its pages cover: ``count[r]`` pages
    of ``page`` rows (:func:`page_grant_run`), slot ``s`` at device V row
    ``hot_base + table[r, s // page] * page + s % page``.

    Args:
        sel_pos: ``[batch, >= max_k]`` int32 selected positions (:func:`select_run`); ``k``: ``[batch]`` int32 counts.
        s_eff, w_eff: ``[batch]`` int32 sink and window sizes (the selected part of request ``b``'s
            attended list starts at ``att_indptr[b] + s_eff[b] + w_eff[b]``).
        att_indptr: ``[batch + 1]`` int32 offsets of the attended lists.
        seq_lens: ``[batch]`` lengths (the LRU clock: a slot used now gets ``seq_lens[b]``).
        req_pool_indices: ``[batch]``; req_to_token: ``[rows, context]`` int32 token ids.
        loc_slot: ``[slots]`` int16/int32, this layer's slot of a token id, or ``[rows, context]``: of a request
            row's position (token ids that several requests share: SGLang's radix cache); -1 or stale: verified
            against ``slot_pos``.
        slot_pos, slot_time: ``[rows, HN]`` int32, this layer's position held by and last use of each slot (-1: empty).
        scratch: ``[batch, >= HN]`` int32 workspace.
        att_kidx, att_vidx: ``[>= att_indptr[batch]]`` int32 outputs: K token ids and device V rows.
        miss_src, miss_dst: ``[batch, >= max_k]`` outputs: host rows (token ids) and device rows to copy;
            miss_cnt: ``[batch]`` int32 output counts.
        stats: ``[>= 2]`` int64, accumulated: hits, misses.
        max_k: the largest ``k`` (a compile-time block).
        table, count, hot_base, page: the page table ``[rows, >= HN / page]`` int32, pages held ``[rows]``
            int32, the first page's device row, rows per page (the layout above). The grant gives
            each request at least ``k[b]`` slots before its exact pass.
        spare_row: the device row an entry with no slot reads (a grant short of pages; default
            the row before ``hot_base``, the last fixed row: never out of bounds).
        spec: a speculative pass (the prefetch of the next layer's rows): it stamps
            ``seq_lens - 1``, evicts only slots older than the previous step, and
            loads only the misses that have a victim; its ``att_kidx`` / ``att_vidx``
            are its own scratch.
        eviction: ``"lru"`` (the least recently used slots go) or ``"lfu"``
            (InfiniGen's rule, arXiv 2406.19707 §5: the least often selected go,
            the least recently used among equals; a slot's uses count from its
            load, saturating at 1023; ``slot_time`` then packs
            ``uses << 21 | last use``, so lengths must stay below 2**21).

    Raises:
        ValueError: ``HN < max_k`` (a step could not hold its selection), an unknown ``eviction``.
    """
    B = k.shape[0]
    hn = slot_pos.shape[1]
    if hn < max_k:
        raise ValueError(f"hot buffer of {hn} rows cannot hold {max_k} selected rows: raise --kv-offload-hot-tokens")
    if eviction not in EVICTIONS:
        raise ValueError(f"eviction must be one of {', '.join(EVICTIONS)}, not {eviction!r}")
    if B == 0:
        return
    _swap_in_kernel[(B,)](
        sel_pos, k, s_eff, w_eff, att_indptr, seq_lens, req_pool_indices, req_to_token,
        loc_slot, slot_pos, slot_time, scratch, table, count, att_kidx, att_vidx, miss_src, miss_dst, miss_cnt, stats,
        sel_pos.stride(0), req_to_token.stride(0), slot_pos.stride(0), scratch.stride(0), miss_src.stride(0), table.stride(0), hot_base,
        spare_row if spare_row >= 0 else max(hot_base - 1, 0), loc_slot.stride(0) if loc_slot.dim() == 2 else 0,
        HN=hn, BLOCK_K=triton.next_power_of_2(max(max_k, 1)), BLOCK_H=triton.next_power_of_2(hn),
        PAGE=page, SPEC=spec, LFU=eviction == "lfu", HINT_ROW=loc_slot.dim() == 2, **_launch_opts(num_warps, None),
    )


#: hot-buffer victim rules of :func:`swap_in_run` (``--kv-offload-eviction``).
EVICTIONS = ("lru", "lfu")


@triton.jit
def _pages_for(k, slack64, HN: tl.constexpr, PAGE: tl.constexpr):
    """Pages of ``PAGE`` slots for ``min(HN, ceil(k * slack64 / 64))`` hot slots (a grant's need)."""
    return (tl.minimum((k * slack64 + 63) // 64, HN) + PAGE - 1) // PAGE


@triton.jit
def _page_grant_kernel(rows_ptr, k_ptr, table_ptr, count_ptr, stack_ptr, top_ptr, overflow_ptr, slack_ptr, floor, stride_t,
                       HN: tl.constexpr, PAGE: tl.constexpr, SLACK64: tl.constexpr, BLOCK: tl.constexpr,
                       PER_ROW: tl.constexpr):
    """Request ``b``: raise its row's pages to ``ceil(min(HN, ceil(k * slack64 / 64)) / PAGE)``
    (``slack64``: ``SLACK64``, or the row's own ``slack_ptr[row]`` when ``PER_ROW``),
    popping the missing ones off the free stack with a compare-and-swap on its height
    while at least ``floor`` pages stay on it (all or none: a short stack leaves the row
    as it was and, when ``floor`` is 0, counts one overflow; the height never goes below
    what is really there, so a failed pop takes nothing from a concurrent one: an
    add-then-restore did, and could hand a page to two rows)."""
    b = tl.program_id(0)
    r = tl.load(rows_ptr + b).to(tl.int64)
    k = tl.load(k_ptr + b).to(tl.int32)
    if PER_ROW:
        slack = tl.load(slack_ptr + r)
    else:
        slack = SLACK64
    need = _pages_for(k, slack, HN, PAGE)
    have = tl.load(count_ptr + r)
    n = need - have
    if n > 0:
        t = tl.atomic_add(top_ptr, 0)  # the stack's height now
        got = t * 0
        while (t - n >= floor) & (got == 0):
            old = tl.atomic_cas(top_ptr, t, t - n)
            got = (old == t).to(tl.int32)
            t = tl.where(old == t, t, old)  # lost the race: try again from the height another pop left
        if got == 1:  # pages stack[t - n .. t) are this row's
            offs = tl.arange(0, BLOCK)
            m = offs < n
            pages = tl.load(stack_ptr + t - n + offs, mask=m, other=-1)
            tl.store(table_ptr + r * stride_t + have + offs, pages, mask=m)
            tl.store(count_ptr + r, need)
        elif floor == 0:
            tl.atomic_add(overflow_ptr, 1)


def page_grant_run(rows: torch.Tensor, k: torch.Tensor, table: torch.Tensor, count: torch.Tensor, stack: torch.Tensor,
                   top: torch.Tensor, overflow: torch.Tensor, hot_tokens: int, page: int, slack64: int,
                   row_slack64: Optional[torch.Tensor] = None, floor: int = 0) -> None:
    """Hot-buffer pages for a decode step (no host read; CUDA-graph safe).

    Request ``b`` (row ``rows[b]``, ``k[b]`` selected rows this step) holds
    ``count[row]`` pages of ``page`` rows, listed in ``table[row]``; it gets
    enough for ``min(hot_tokens, ceil(k * slack64 / 64))`` slots (the slack in
    64ths: :func:`~sglang_elastic.offload.sizing.slack_64ths`), never
    fewer than it has (a request's ``k`` grows with its length; its pages
    go back with its row, :func:`slot_release_run` with ``zero=-1``, or when
    :func:`page_shrink_run` takes back what it grew). The
    pool is sized so that the stack never runs short at the base slack
    (:func:`~sglang_elastic.offload.sizing.hot_pages`); if it did, the row
    keeps what it had and ``overflow`` counts it.

    Args:
        rows: ``[batch]`` request rows; k: ``[batch]`` int32 selected rows.
        table: ``[rows, >= ceil(hot_tokens / page)]`` int32; count: ``[rows]`` int32.
        stack, top: ``[pages]`` int32 free pages and ``[1]`` int32 their count.
        overflow: ``[1]`` int32.
        hot_tokens, page, slack64: the layout's (``OffloadLayout``; ``slack64 >= 64``).
        row_slack64: ``[rows]`` int32, each row's own slack in 64ths (the adaptive
            growth, :func:`page_adapt_run`), used instead of ``slack64``; None: ``slack64``.
        floor: pages the grants must leave on the stack (growth above the base slack keeps
            a reserve; a grant that would cut into it is skipped and not counted as an overflow).

    Raises:
        ValueError: the table has fewer columns than ``hot_tokens`` needs, ``slack64 < 64``, ``floor < 0``.
    """
    B = rows.shape[0]
    max_pages = -(-hot_tokens // page)
    if table.shape[1] < max_pages:
        raise ValueError(f"page_grant_run: a table of {table.shape[1]} pages per row cannot list {max_pages}")
    if slack64 < 64:
        raise ValueError(f"page_grant_run: slack64 {slack64} gives fewer slots than selected rows (at least 64)")
    if floor < 0:
        raise ValueError(f"page_grant_run: floor {floor} must be >= 0")
    if B:
        _page_grant_kernel[(B,)](rows, k, table, count, stack, top, overflow, row_slack64, floor, table.stride(0), HN=hot_tokens,
                                 PAGE=page, SLACK64=slack64, BLOCK=triton.next_power_of_2(max_pages), PER_ROW=row_slack64 is not None)


@triton.jit
def _page_adapt_kernel(rows_ptr, k_ptr, count_ptr, slack_ptr, steps_ptr, miss_ptr, sel_ptr, demand_ptr,
                       HN: tl.constexpr, PAGE: tl.constexpr, BASE64: tl.constexpr, MAX64: tl.constexpr,
                       GROW64: tl.constexpr):
    """Request ``b``: after two steps, a row whose last step missed at least ``GROW64 / 64`` of its
    selection grows its slack by one (64ths) up to ``MAX64``; adds the pages its base grant
    still needs to ``demand``."""
    b = tl.program_id(0)
    r = tl.load(rows_ptr + b).to(tl.int64)
    k = tl.load(k_ptr + b).to(tl.int32)
    st = tl.load(steps_ptr + r)
    sel = tl.load(sel_ptr + r)
    miss = tl.load(miss_ptr + r)
    slack = tl.load(slack_ptr + r)
    grow = (st >= 2) & (sel > 0) & (miss * 64 >= GROW64 * sel)
    tl.store(slack_ptr + r, tl.where(grow, tl.minimum(slack + 64, MAX64), slack))
    tl.store(steps_ptr + r, tl.minimum(st + (k > 0).to(tl.int32), 1 << 30))  # sparse steps only: a demoted keep-v request starts cold
    need = _pages_for(k, BASE64, HN, PAGE)
    short = need - tl.load(count_ptr + r)
    if short > 0:
        tl.atomic_add(demand_ptr, short)


@triton.jit
def _page_shrink_kernel(rows_ptr, k_ptr, table_ptr, count_ptr, stack_ptr, top_ptr, demand_ptr, slack_ptr, taken_ptr,
                        slot_pos_ptr, slot_time_ptr, layers, stride_t, stride_sl, stride_sr, reserve,
                        HN: tl.constexpr, PAGE: tl.constexpr, BASE64: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr):
    """Request ``b``: when the free stack holds fewer pages than this step's base grants need plus
    ``reserve``, give back the pages the row holds beyond its base grant (pushed on the stack; their
    slots forgotten in every layer, so no later hit can read a page another row now owns) and
    return its slack to the base."""
    b = tl.program_id(0)
    r = tl.load(rows_ptr + b).to(tl.int64)
    k = tl.load(k_ptr + b).to(tl.int32)
    top = tl.atomic_add(top_ptr, 0)
    demand = tl.load(demand_ptr)
    need = _pages_for(k, BASE64, HN, PAGE)
    have = tl.load(count_ptr + r)
    extra = have - need
    if (top < demand + reserve) & (extra > 0):
        t = tl.atomic_add(top_ptr, extra)  # stack[t .. t + extra) are this row's to fill (no pop runs in this launch)
        offs = tl.arange(0, BLOCK)
        m = offs < extra
        pages = tl.load(table_ptr + r * stride_t + need + offs, mask=m, other=-1)
        tl.store(stack_ptr + t + offs, pages, mask=m)
        tl.store(table_ptr + r * stride_t + need + offs, tl.full([BLOCK], -1, tl.int32), mask=m)
        tl.store(count_ptr + r, need)
        tl.store(slack_ptr + r, BASE64)
        tl.atomic_add(taken_ptr, extra)
        lo = need * PAGE
        hi = tl.minimum(have * PAGE, HN)
        for l in range(0, layers):
            row = (r * 0 + l) * stride_sl + r * stride_sr  # int64 (r is): layers x rows x hot_tokens may pass 2**31
            for s0 in range(lo, hi, BLOCK_S):
                so = s0 + tl.arange(0, BLOCK_S)
                sm = so < hi
                tl.store(slot_pos_ptr + row + so, tl.full([BLOCK_S], -1, tl.int32), mask=sm)
                tl.store(slot_time_ptr + row + so, tl.full([BLOCK_S], -1, tl.int32), mask=sm)


def page_adapt_run(rows: torch.Tensor, k: torch.Tensor, table: torch.Tensor, count: torch.Tensor, stack: torch.Tensor,
                   top: torch.Tensor, overflow: torch.Tensor, hot_tokens: int, page: int, slack64: int, max_slack64: int,
                   row_slack64: torch.Tensor, row_steps: torch.Tensor, row_miss: torch.Tensor, row_sel: torch.Tensor,
                   demand: torch.Tensor, taken: torch.Tensor, slot_pos: torch.Tensor, slot_time: torch.Tensor,
                   reserve: int, grow_at64: int = 4) -> None:
    """A decode step's hot-buffer pages with per-request adaptive slack (no host read; CUDA-graph safe).

    InfiniGen (OSDI'24) sizes the KV it keeps by how much of the selection repeats;
    here each request's hot buffer grows while its selection keeps missing, into pages
    nobody needs now, and gives them back as soon as the pool runs short. In four launches:

    1. adapt: a request whose previous step missed at least ``grow_at64 / 64`` of its
       selected rows (``row_miss[row] / row_sel[row]``, recorded by the first sparse
       layer's swap-in; with the prefetch, its loads and the exact pass's misses), after
       two sparse steps (``row_steps`` counts steps with ``k > 0``: a request that kept V
       and was demoted starts cold), raises its slack by one row per selected row, up to
       ``max_slack64 / 64``; ``demand`` sums the pages the batch's base grants
       (``slack64``) still need;
    2. shrink: if fewer than ``demand + reserve // 2`` pages are free, every request of the
       batch holding more than its base grant gives the rest back (its hot slots past the
       base are forgotten in every layer: ``slot_pos`` / ``slot_time`` set to -1) and
       returns to the base slack; ``taken`` counts the pages;
    3. the base grant (:func:`page_grant_run` at ``slack64``: the sizing guarantees it);
    4. growth: :func:`page_grant_run` at each row's own slack, never leaving fewer than
       ``reserve`` pages free.

    Args:
        rows, k, table, count, stack, top, overflow, hot_tokens, page, slack64: as :func:`page_grant_run`;
            ``rows`` must hold every request that holds pages (SGLang's decode batch holds every
            running request): only they can give pages back before the base grants.
        max_slack64: the most slack (64ths) a request grows to (``>= slack64``).
        row_slack64, row_steps, row_miss, row_sel: ``[rows]`` int32 per request row: its slack,
            decode steps planned, last step's misses and selected rows (reset when the row is freed).
        demand, taken: ``[1]`` int32 scratch and the running count of pages taken back.
        slot_pos, slot_time: ``[sparse layers, rows, hot_tokens]`` int32, the swap-in's slot state.
        reserve: free pages growth leaves for admissions (and under which grown rows give back).
        grow_at64: the miss fraction (64ths) that makes a request grow.

    Raises:
        ValueError: ``max_slack64 < slack64``, ``reserve < 0``, or :func:`page_grant_run`'s.
    """
    if max_slack64 < slack64:
        raise ValueError(f"page_adapt_run: max_slack64 {max_slack64} is below the base slack {slack64}")
    if reserve < 0:
        raise ValueError(f"page_adapt_run: reserve {reserve} must be >= 0")
    B = rows.shape[0]
    if B == 0:
        return
    max_pages = -(-hot_tokens // page)
    demand.zero_()
    _page_adapt_kernel[(B,)](rows, k, count, row_slack64, row_steps, row_miss, row_sel, demand, HN=hot_tokens, PAGE=page,
                             BASE64=slack64, MAX64=max_slack64, GROW64=grow_at64)
    # shrink under half the reserve, grow above all of it: a request does not give back and take again step after step
    _page_shrink_kernel[(B,)](rows, k, table, count, stack, top, demand, row_slack64, taken, slot_pos, slot_time,
                              slot_pos.shape[0], table.stride(0), slot_pos.stride(0), slot_pos.stride(1), reserve // 2,
                              HN=hot_tokens, PAGE=page, BASE64=slack64, BLOCK=triton.next_power_of_2(max_pages),
                              BLOCK_S=min(1024, triton.next_power_of_2(hot_tokens)))
    page_grant_run(rows, k, table, count, stack, top, overflow, hot_tokens, page, slack64)
    if max_slack64 > slack64:
        page_grant_run(rows, k, table, count, stack, top, overflow, hot_tokens, page, slack64, row_slack64=row_slack64,
                       floor=max(reserve, 1))


# ---------------------------------------------------------------------------
# the attended lists' fixed part (sink, window) and the resident reference
# ---------------------------------------------------------------------------


@triton.jit
def _fixed_entries_kernel(
    seq_lens_ptr, req_pool_ptr, req_to_token_ptr, s_eff_ptr, w_eff_ptr, att_indptr_ptr, att_kidx_ptr, att_vidx_ptr,
    v_rows_ptr, stride_r2t,
    SINK: tl.constexpr, WINDOW: tl.constexpr, REGION: tl.constexpr, BLOCK: tl.constexpr, RESIDENT: tl.constexpr,
):
    """Request ``b``'s sink and window entries of its attended list, and the
    device V row of its newest token (``v_rows[b]``)."""
    b = tl.program_id(0)
    r = tl.load(req_pool_ptr + b).to(tl.int64)
    L = tl.load(seq_lens_ptr + b).to(tl.int32)
    s = tl.load(s_eff_ptr + b)
    w = tl.load(w_eff_ptr + b)
    base = tl.load(att_indptr_ptr + b)
    j = tl.arange(0, BLOCK)
    is_sink = j < s
    m = j < s + w
    pos = tl.where(is_sink, j, L - w + (j - s))
    loc = tl.load(req_to_token_ptr + r * stride_r2t + pos, mask=m, other=0)
    if RESIDENT:
        vrow = loc.to(tl.int64)
    else:
        vrow = r * REGION + tl.where(pos < SINK, pos, SINK + pos % WINDOW)
    tl.store(att_kidx_ptr + base + j, loc, mask=m)
    tl.store(att_vidx_ptr + base + j, vrow.to(att_vidx_ptr.dtype.element_ty), mask=m)
    p = L - 1
    if RESIDENT:
        newest = tl.load(req_to_token_ptr + r * stride_r2t + tl.maximum(p, 0)).to(tl.int64)
    else:
        newest = r * REGION + tl.where(p < SINK, p, SINK + p % WINDOW)
    tl.store(v_rows_ptr + b, newest.to(v_rows_ptr.dtype.element_ty))


@triton.jit
def _row_plan_kernel(lens_ptr, rp_ptr, vrow_ptr, stride_vrow, table_ptr, stride_table, s_ptr, w_ptr, k_ptr, dl_ptr, keep_rows_ptr,
                     sum_src_ptr, sum_chunk_ptr, sum_valid_ptr, C: tl.constexpr, DENSE: tl.constexpr, SUMMARY: tl.constexpr,
                     RING: tl.constexpr = False, SINK: tl.constexpr = 0, WINDOW: tl.constexpr = 1, REGION: tl.constexpr = 1):
    """Request ``b``'s per-row entries of a decode plan (see :func:`row_plan_run`)."""
    b = tl.program_id(0)
    L = tl.load(lens_ptr + b).to(tl.int64)
    r = tl.load(rp_ptr + b).to(tl.int64)
    if DENSE:
        tl.store(s_ptr + b, 0)
        tl.store(w_ptr + b, 0)
        tl.store(k_ptr + b, 0)
        tl.store(dl_ptr + b, L.to(tl.int32))
        tl.store(keep_rows_ptr + b, tl.load(vrow_ptr + r * stride_vrow + tl.maximum(L - 1, 0)).to(tl.int64))
    if SUMMARY:
        offs = tl.arange(0, C)
        pos = tl.maximum(L - C + offs, 0)
        if RING:  # the request's sink or ring row of each position (fixed_entries_run's rows)
            tl.store(sum_src_ptr + b * C + offs, r * REGION + tl.where(pos < SINK, pos, SINK + pos % WINDOW))
        else:
            tl.store(sum_src_ptr + b * C + offs, tl.load(table_ptr + r * stride_table + pos).to(tl.int64))
        tl.store(sum_chunk_ptr + b, tl.maximum(L // C - 1, 0))
        tl.store(sum_valid_ptr + b, ((L % C == 0) & (L >= C)).to(tl.int32))


def row_plan_run(lens: torch.Tensor, rp: torch.Tensor, dense: Optional[tuple] = None, summary: Optional[tuple] = None,
                 ring: Optional[tuple] = None) -> None:
    """The per-request entries of a decode step's plan in one launch (what about twenty small
    PyTorch ops did: indexing, clamps, casts), GPU ops only (CUDA-graph safe).

    Args:
        lens: ``[bs]`` int32 lengths with the new token; rp: ``[bs]`` request rows.
        dense: an all-dense step (``--kv-offload-keep-v``): ``(req_to_vrow, s_eff, w_eff, k, dense_lens,
            keep_rows)``: ``s_eff = w_eff = k = 0``, ``dense_lens = lens`` (int32 ``[bs]`` each) and
            ``keep_rows[b] = req_to_vrow[rp[b], max(lens[b] - 1, 0)]`` (int64 ``[bs]``), or None.
        summary: ``estimate``'s chunk each new token completes: ``(table, sum_src, sum_chunk, sum_valid)``:
            ``sum_src[b, j] = table[rp[b], max(lens[b] - C + j, 0)]`` (int64 ``[bs, C]``, contiguous rows),
            ``sum_chunk[b] = max(lens[b] // C - 1, 0)`` (int64), ``sum_valid[b] = lens[b] % C == 0 and
            lens[b] >= C`` (int32), or None.
        ring: ``(sink, window, region_rows)``: ``sum_src`` gets each position's device sink / ring row
            (``rp[b] * region_rows + (p if p < sink else sink + p % window)``, as
            :func:`fixed_entries_run` places V) in place of ``table``'s entry (``table`` unused; the
            chunk lies in the window when ``chunk <= window``, which ``estimate`` requires).
    """
    B = lens.shape[0]
    if B == 0 or (dense is None and summary is None):
        return
    vrow, s_eff, w_eff, k, dl, keep_rows = dense if dense is not None else (None,) * 6
    table, src, chunk, valid = summary if summary is not None else (None,) * 4
    C = src.shape[1] if summary is not None else 16
    if summary is not None and (C & (C - 1) or src.stride(1) != 1 or src.stride(0) != C):
        raise ValueError(f"row_plan: sum_src must be contiguous [bs, C] rows with C a power of two, not {tuple(src.shape)}")
    sink, window, region = ring if ring is not None else (0, 1, 1)
    if ring is not None:
        table = None
        if window < 1:
            raise ValueError("row_plan: a ring needs a window of at least one position")
    _row_plan_kernel[(B,)](lens, rp, vrow, vrow.stride(0) if vrow is not None else 0, table, table.stride(0) if table is not None else 0,
                           s_eff, w_eff, k, dl, keep_rows, src, chunk, valid, C=C, DENSE=dense is not None, SUMMARY=summary is not None,
                           RING=ring is not None, SINK=int(sink), WINDOW=int(window), REGION=int(region))


def fixed_entries_run(
    seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, s_eff: torch.Tensor,
    w_eff: torch.Tensor, att_indptr: torch.Tensor, att_kidx: torch.Tensor, att_vidx: torch.Tensor, v_rows: torch.Tensor,
    sink: int, window: int, region_rows: int, resident: bool = False,
) -> None:
    """Sink and window entries of every attended list, once per step.

    Entry ``j < s_eff[b]`` is position ``j``, the next ``w_eff[b]`` the last
    positions; K ids from ``req_to_token``; V rows: the request's sink row
    (``r * region_rows + pos``) or ring row (``r * region_rows + sink + pos %
    window``), or, ``resident``, the token id (V in the pool). ``v_rows[b]``
    gets the row where this step's new token's V goes.
    """
    B = seq_lens.shape[0]
    if B == 0:
        return
    _fixed_entries_kernel[(B,)](
        seq_lens, req_pool_indices, req_to_token, s_eff, w_eff, att_indptr, att_kidx, att_vidx, v_rows, req_to_token.stride(0),
        SINK=sink, WINDOW=max(window, 1), REGION=region_rows, BLOCK=triton.next_power_of_2(max(sink + window, 1)), RESIDENT=resident,
    )


@triton.jit
def _gather_selected_kernel(
    sel_ptr, k_ptr, s_eff_ptr, w_eff_ptr, att_indptr_ptr, req_pool_ptr, req_to_token_ptr, att_kidx_ptr, att_vidx_ptr,
    stride_selb, stride_r2t, BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    r = tl.load(req_pool_ptr + b).to(tl.int64)
    k = tl.load(k_ptr + b)
    base = tl.load(att_indptr_ptr + b) + tl.load(s_eff_ptr + b) + tl.load(w_eff_ptr + b)
    offs = tl.arange(0, BLOCK_K)
    m = offs < k
    pos = tl.load(sel_ptr + b * stride_selb + offs, mask=m, other=0)
    loc = tl.load(req_to_token_ptr + r * stride_r2t + pos, mask=m, other=0)
    tl.store(att_kidx_ptr + base + offs, loc, mask=m)
    tl.store(att_vidx_ptr + base + offs, loc.to(att_vidx_ptr.dtype.element_ty), mask=m)


def gather_selected_run(
    sel_pos: torch.Tensor, k: torch.Tensor, s_eff: torch.Tensor, w_eff: torch.Tensor, att_indptr: torch.Tensor,
    req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, att_kidx: torch.Tensor, att_vidx: torch.Tensor, max_k: int,
) -> None:
    """The resident reference's selected entries: K id = V row = the token id
    of each selected position (no hot buffer)."""
    B = k.shape[0]
    if B == 0:
        return
    _gather_selected_kernel[(B,)](
        sel_pos, k, s_eff, w_eff, att_indptr, req_pool_indices, req_to_token, att_kidx, att_vidx,
        sel_pos.stride(0), req_to_token.stride(0), BLOCK_K=triton.next_power_of_2(max(max_k, 1)),
    )


# ---------------------------------------------------------------------------
# row copies (host <-> device, device <-> device)
# ---------------------------------------------------------------------------


@triton.jit
def _copy_rows_kernel(
    src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, n_ptr, n_static,
    stride_src, stride_dst, stride_idx_b, idx_batch,
    ROW: tl.constexpr, BLOCK_ROW: tl.constexpr, BLOCK_R: tl.constexpr,
    SRC_IDX: tl.constexpr, DST_IDX: tl.constexpr, N_PER_B: tl.constexpr,
):
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for ``i < n`` (an identity where an
    index list is absent); a negative index skips the row. ``N_PER_B``: row
    lists per batch entry (program axis 1), counts in ``n_ptr[b]``."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    P = tl.num_programs(0)
    if N_PER_B:
        n = tl.load(n_ptr + b)
    else:
        n = n_static
    offs_c = tl.arange(0, BLOCK_ROW)
    mask_c = offs_c < ROW
    for i0 in range(pid * BLOCK_R, n, P * BLOCK_R):
        rows = i0 + tl.arange(0, BLOCK_R)
        m = rows < n
        if SRC_IDX:
            si = tl.load(src_idx_ptr + b * stride_idx_b + rows, mask=m, other=-1).to(tl.int64)
        else:
            si = rows.to(tl.int64)
        if DST_IDX:
            di = tl.load(dst_idx_ptr + b * stride_idx_b + rows, mask=m, other=-1).to(tl.int64)
        else:
            di = rows.to(tl.int64)
        ok = m & (si >= 0) & (di >= 0)
        x = tl.load(src_ptr + si[:, None] * stride_src + offs_c[None, :], mask=ok[:, None] & mask_c[None, :])
        tl.store(dst_ptr + di[:, None] * stride_dst + offs_c[None, :], x, mask=ok[:, None] & mask_c[None, :])


def copy_rows_run(
    src: torch.Tensor, dst: torch.Tensor, src_idx: Optional[torch.Tensor] = None, dst_idx: Optional[torch.Tensor] = None,
    n: Optional[int] = None, counts: Optional[torch.Tensor] = None, programs: int = 0, block_r: int = 4,
    num_warps: Optional[int] = None,
) -> None:
    """Copy rows between two buffers of the same row size, on the GPU.

    ``src`` or ``dst`` may be a pinned host buffer seen through
    :func:`sglang_elastic.offload.host_pool.device_view` (UVA): the copy is
    then GPU-initiated PCIe traffic (SGLang's ``transfer_hicache_one_layer``
    pattern), never a CPU gather.

    Args:
        src, dst: ``[rows, ...]`` buffers whose trailing dims are contiguous and equal in size
            (a row: e.g. ``[kv_heads, head_dim]``); same dtype.
        src_idx, dst_idx: row indices (int32/int64; a negative one skips the row); absent: ``0..n-1``.
            With ``counts``: ``[batch, cap]`` lists, row ``b`` using its first ``counts[b]`` entries.
        n: rows to copy (flat form); ``counts``: ``[batch]`` int32 (batched form, device counts,
            no host read: CUDA-graph safe).
        programs: programs per list along the rows (0: one per ``block_r`` rows up to 1024, or 8 per list when batched).
        block_r: rows per program step.

    Raises:
        ValueError: row sizes or dtypes differ, or neither / both of ``n`` and ``counts``.
    """
    row = int(torch.Size(src.shape[1:]).numel())
    if int(torch.Size(dst.shape[1:]).numel()) != row or src.dtype != dst.dtype:
        raise ValueError(f"copy_rows: rows differ: src {tuple(src.shape)} {src.dtype}, dst {tuple(dst.shape)} {dst.dtype}")
    if (n is None) == (counts is None):
        raise ValueError("copy_rows: give exactly one of n (rows) or counts (per-list device counts)")
    if n is not None and n <= 0:
        return
    batched = counts is not None
    lists = counts.shape[0] if batched else 1
    if lists == 0:
        return
    if not programs:
        # the kernel strides over the rows: a bounded grid (a small one under the interpreter, where each program costs)
        programs = 8 if batched else min(triton.cdiv(n, block_r), 4 if triton.knobs.runtime.interpret else 1024)
    idx = src_idx if src_idx is not None else dst_idx
    _copy_rows_kernel[(programs, lists)](
        src, dst, src_idx, dst_idx, counts, 0 if batched else n,
        src.stride(0), dst.stride(0), idx.stride(0) if (batched and idx is not None) else 0, lists,
        ROW=row, BLOCK_ROW=triton.next_power_of_2(row), BLOCK_R=block_r,
        SRC_IDX=src_idx is not None, DST_IDX=dst_idx is not None, N_PER_B=batched, **_launch_opts(num_warps, None),
    )


@triton.jit
def _store_sparse_kernel(
    k_ptr, v_ptr, kdst_ptr, host_ptr, vdst_ptr, loc_ptr, vrow_ptr, keep_ptr, n,
    stride_k, stride_v, stride_kdst, stride_host, stride_vdst,
    ssrc_ptr, sdst_ptr, vsum_ptr, stride_ssrc, stride_vsum, skip,
    KROW: tl.constexpr, VROW: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    VROWS: tl.constexpr, KEEP: tl.constexpr, SUM: tl.constexpr = False, C: tl.constexpr = 16,
    HOST: tl.constexpr = True,
):
    """Row ``i < n``: ``kdst[loc[i]] = k[i]``, ``host[loc[i]] = v[i]`` and, where the
    index is ``>= 0``, ``vdst[vrow[i]] = v[i]`` and ``vdst[keep[i]] = v[i]``; ``SUM``:
    ``vsum[sdst[i]] = mean(rows ssrc[i, :C - 1] of vdst, and v[i])``
    where ``sdst[i] != skip`` (the chunk row ``i``'s token completes). ``HOST`` off: no host write."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    ok_k = tl.arange(0, BLOCK_K)
    ok_v = tl.arange(0, BLOCK_V)
    mk = ok_k < KROW
    mv = ok_v < VROW
    for i0 in range(pid * BLOCK_R, n, P * BLOCK_R):
        rows = i0 + tl.arange(0, BLOCK_R)
        m = rows < n
        loc = tl.load(loc_ptr + rows, mask=m, other=-1).to(tl.int64)
        ok = m & (loc >= 0)
        r64 = rows.to(tl.int64)
        x = tl.load(k_ptr + r64[:, None] * stride_k + ok_k[None, :], mask=ok[:, None] & mk[None, :])
        tl.store(kdst_ptr + loc[:, None] * stride_kdst + ok_k[None, :], x, mask=ok[:, None] & mk[None, :])
        y = tl.load(v_ptr + r64[:, None] * stride_v + ok_v[None, :], mask=m[:, None] & mv[None, :])
        if HOST:
            tl.store(host_ptr + loc[:, None] * stride_host + ok_v[None, :], y, mask=ok[:, None] & mv[None, :])
        if VROWS:
            vr = tl.load(vrow_ptr + rows, mask=m, other=-1).to(tl.int64)
            tl.store(vdst_ptr + vr[:, None] * stride_vdst + ok_v[None, :], y, mask=(m & (vr >= 0))[:, None] & mv[None, :])
        if KEEP:
            kr = tl.load(keep_ptr + rows, mask=m, other=-1).to(tl.int64)
            tl.store(vdst_ptr + kr[:, None] * stride_vdst + ok_v[None, :], y, mask=(m & (kr >= 0))[:, None] & mv[None, :])
    if SUM:  # the completed chunks' means: the first C - 1 rows from where they are stored, the new token's from v
        for i in range(pid, n, P):
            d = tl.load(sdst_ptr + i).to(tl.int64)
            if d != skip:  # row by row in position order, in float32, as _chunk_mean_kernel sums
                acc = tl.zeros([BLOCK_V], tl.float32)
                for c in tl.static_range(C - 1):
                    r = tl.load(ssrc_ptr + i * stride_ssrc + c).to(tl.int64)
                    acc += tl.load(vdst_ptr + r * stride_vdst + ok_v, mask=mv, other=0.0).to(tl.float32)
                acc += tl.load(v_ptr + i * stride_v + ok_v, mask=mv, other=0.0).to(tl.float32)
                tl.store(vsum_ptr + d * stride_vsum + ok_v, (acc / C).to(vsum_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mv)


def store_sparse_run(
    cache_k: torch.Tensor, cache_v: torch.Tensor, k_dst: torch.Tensor, host_v: torch.Tensor, v_dst: torch.Tensor,
    loc: torch.Tensor, v_rows: Optional[torch.Tensor] = None, keep_rows: Optional[torch.Tensor] = None,
    block_r: int = 4, num_warps: Optional[int] = None, summary: Optional[tuple] = None, host: bool = True,
) -> None:
    """A sparse layer's KV write in one launch (what four :func:`copy_rows_run` did):
    K to the pool, V to the host pool and to up to two device rows, and (``summary``)
    the V means of the chunks this decode step completes (what :func:`chunk_mean_run`
    did in a launch of its own, with the same sums: bit-equal).

    For each new token ``i``: ``k_dst[loc[i]] = cache_k[i]`` and ``host_v[loc[i]] =
    cache_v[i]`` (a negative ``loc`` skips both); ``v_dst[v_rows[i]] = cache_v[i]``
    (the request's sink or ring row) and ``v_dst[keep_rows[i]] = cache_v[i]`` (its
    kept V, ``--kv-offload-keep-v``) where those are ``>= 0``. The host writes are
    GPU-initiated PCIe stores through UVA, as SGLang's
    ``transfer_hicache_one_layer`` does (sgl-kernel); on the GPU and CUDA-graph safe.

    Args:
        cache_k: ``[n, kv_heads, head_dim]``; cache_v: ``[n, kv_heads, v_head_dim]`` (each row's
            trailing dims contiguous; any row stride, e.g. a view of the fused QKV output).
        k_dst: ``[slots, kv_heads, head_dim]`` the layer's K buffer.
        host_v: ``[slots, kv_heads, v_head_dim]`` the layer's host V (a UVA view on the GPU).
        v_dst: ``[rows, kv_heads, v_head_dim]`` the layer's device V rows (hot rows, kept rows).
        loc: ``[n]`` int32/int64 token ids (SGLang's ``out_cache_loc``).
        v_rows, keep_rows: ``[n]`` int32/int64 device rows (``-1``: none), or None.
        summary: a decode step's ``(src, dst, out, skip)``: ``src`` ``[n, C]`` int64 rows of ``v_dst``,
            token ``i``'s chunk (its sink / ring rows, or an all-dense step's kept rows; never host
            rows, a read over PCIe; its last entry is token ``i`` itself, read from ``cache_v``, not
            from where it is being written); ``dst`` ``[n]`` rows of ``out`` (``[slots, kv_heads,
            v_head_dim]``), ``skip`` the row that takes nothing (a chunk not completed: no row read).
            Or None.
        host: write V to ``host_v`` (off: the caller copies it there itself, e.g. from the ring rows
            on a side stream, :meth:`~sglang_elastic.offload.pool.OffloadKVPool.join_host_writes`).

    Raises:
        ValueError: row sizes or dtypes of a source and its destinations differ, an index list
            is shorter than ``n``, or ``summary``'s chunk is not a power of two.
    """
    n = cache_k.shape[0]
    krow = int(torch.Size(cache_k.shape[1:]).numel())
    vrow = int(torch.Size(cache_v.shape[1:]).numel())
    for name, t, row, src in (("k_dst", k_dst, krow, cache_k), ("host_v", host_v, vrow, cache_v), ("v_dst", v_dst, vrow, cache_v)):
        if int(torch.Size(t.shape[1:]).numel()) != row or t.dtype != src.dtype:
            raise ValueError(f"store_sparse: {name} {tuple(t.shape)} {t.dtype} does not take rows of {tuple(src.shape)} {src.dtype}")
    for name, t in (("cache_v", cache_v), ("loc", loc), ("v_rows", v_rows), ("keep_rows", keep_rows)):
        if t is not None and t.shape[0] < n:
            raise ValueError(f"store_sparse: {name} has {t.shape[0]} rows for {n} tokens")
    sargs, C = (None, None, None, 0, 0, -1), 16
    if summary is not None:
        src, dst, out, skip = summary
        C = src.shape[1]
        if C & (C - 1) or C < 2:
            raise ValueError(f"store_sparse: chunk {C} is not a power of two")
        if src.shape[0] < n or dst.shape[0] < n or int(torch.Size(out.shape[1:]).numel()) != vrow:
            raise ValueError(f"store_sparse: summary {tuple(src.shape)} / {tuple(dst.shape)} / {tuple(out.shape)} for {n} tokens")
        sargs = (src, dst, out, src.stride(0), out.stride(0), int(skip))
    if n == 0:
        return
    programs = min(triton.cdiv(n, block_r), 4 if triton.knobs.runtime.interpret else 1024)
    _store_sparse_kernel[(programs,)](
        cache_k, cache_v, k_dst, host_v, v_dst, loc, v_rows, keep_rows, n,
        cache_k.stride(0), cache_v.stride(0), k_dst.stride(0), host_v.stride(0), v_dst.stride(0), *sargs,
        KROW=krow, VROW=vrow, BLOCK_K=triton.next_power_of_2(krow), BLOCK_V=triton.next_power_of_2(vrow), BLOCK_R=block_r,
        VROWS=v_rows is not None, KEEP=keep_rows is not None, SUM=summary is not None, C=C,
        HOST=bool(host), **_launch_opts(num_warps, None),
    )


# ---------------------------------------------------------------------------
# 4. attention over the attended lists
# ---------------------------------------------------------------------------


@triton.jit
def _attend_kernel(
    q_ptr, k_ptr, v_ptr, indptr_ptr, kidx_ptr, vidx_ptr, chunk_ptr, mid_o_ptr, mid_lse_ptr,
    sm_scale,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_mo_s, stride_mo_h, stride_ml_s,
    max_splits,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: wait for the kernel before (q, the new K/V), let the merge launch
        gdc_wait()
        gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    lo, hi, chunk, start, end = _chunk_span(indptr_ptr, chunk_ptr, b, s)
    if start < end:
        _partial_attn(q_ptr, k_ptr, v_ptr, kidx_ptr, mid_o_ptr, mid_lse_ptr, b, h, start, end, b * max_splits + s, sm_scale,
                      stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_mo_s, stride_mo_h, stride_ml_s,
                      G, BLOCK_G, D, BLOCK_D, BLOCK_N, DOT_F32, vidx_ptr, True)


def attend_run(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, att_indptr: torch.Tensor, att_kidx: torch.Tensor,
    att_vidx: torch.Tensor, chunk: torch.Tensor, nsplit: torch.Tensor, max_splits: int, mid_o: torch.Tensor,
    mid_lse: torch.Tensor, out: torch.Tensor, lse_full: Optional[torch.Tensor] = None, sm_scale: Optional[float] = None,
    block_n: int = 32, num_warps: Optional[int] = None, num_stages: Optional[int] = None,
    extra: Optional[torch.Tensor] = None, extra_splits: int = 0, extra_count: Optional[torch.Tensor] = None,
    pdl: bool = False, skip_empty: bool = False,
) -> torch.Tensor:
    """Attention of one layer over each request's attended list.

    Args:
        q: ``[batch, q_heads, head_dim]``.
        k_buffer: ``[slots, kv_heads, head_dim]`` (K of every token); v_buffer: ``[rows, kv_heads, head_dim]``
            (the hot buffers, or the pool's full V for the resident reference).
        att_indptr: ``[batch + 1]`` int32; att_kidx / att_vidx: K token ids and V rows of the attended entries.
        chunk, nsplit, max_splits: a split plan of ``att_indptr``
            (:func:`~sglang_elastic.kernels.decode_attention.split_kv_plan`).
        mid_o, mid_lse: ``[>= batch * max_splits, q_heads, (head_dim)]`` float32 workspaces.
        out: ``[batch, q_heads, head_dim]`` output.
        lse_full: ``[batch, q_heads]`` float32 log-sum-exp over all positions: the output is
            ``sum_i exp(s_i - lse_full) v_i`` over the attended entries (exact denominator); a request
            whose row is ``-inf`` (scored over no position: a dense request, whose list holds every
            position) is normalised over its attended entries; ``None``: every request is.
        extra, extra_splits: float32 partials ``[>= batch * extra_splits, q_heads, head_dim]`` added
            to each output in the merge (rows ``b * extra_splits ..``, in order; ``estimate``'s
            unattended share, :func:`estimate_run` with ``reduce=False``), before the cast to ``out``'s dtype;
            ``extra_count`` (``[batch]`` int32, optional): only the first ``extra_count[b]`` of
            request ``b``'s rows (the scores' split count: the estimate writes no other).
        pdl: both launches with programmatic dependent launch where supported
            (:func:`~sglang_elastic.kernels.decode_attention.split_kv_run`'s ``pdl``).
        skip_empty: a request with an empty list keeps its row of ``out`` as it was (else it gets zeros): the
            keep-v step's kept requests, whose rows an all-positions launch wrote before.

    Returns:
        ``out``.
    """
    B, Hq, Hkv, D, G, BLOCK_G, BLOCK_D = _shape_args(q, k_buffer)
    if B == 0:
        return out
    sm_scale = sm_scale if sm_scale is not None else D ** -0.5
    pdl_opts = _pdl_opts(pdl, q.device)
    _attend_kernel[(B, Hkv, max_splits)](
        q, k_buffer, v_buffer, att_indptr, att_kidx, att_vidx, chunk, mid_o, mid_lse, sm_scale,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_lse.stride(0), max_splits,
        G=G, BLOCK_G=BLOCK_G, D=D, BLOCK_D=BLOCK_D, BLOCK_N=block_n, DOT_F32=_dot_f32(q), **_launch_opts(num_warps, num_stages),
        **pdl_opts,
    )
    full = lse_full is not None
    _merge_kernel[(B, Hq)](
        mid_o, mid_lse, nsplit, nsplit, out,
        mid_o.stride(0), mid_o.stride(1), mid_lse.stride(0), out.stride(0), out.stride(1), max_splits,
        D=D, BLOCK_D=BLOCK_D, SEGMENTED=False, BLOCK_S=MERGE_BLOCK_S, **pdl_opts,
        lse_full_ptr=lse_full, stride_lf_b=lse_full.stride(0) if full else 0, FULL_LSE=full,
        extra_ptr=extra, stride_ex_s=extra.stride(0) if extra is not None else 0, stride_ex_h=extra.stride(1) if extra is not None else 0,
        extra_n=extra_splits, extra_cnt_ptr=extra_count, EXTRA=extra is not None, EXTRA_CNT=extra_count is not None,
        SKIP_EMPTY=skip_empty,
    )
    return out


# ---------------------------------------------------------------------------
# 5. the unattended rows' share (``--kv-offload-denominator estimate``)
# ---------------------------------------------------------------------------


@triton.jit
def _estimate_kernel(
    scores_ptr, lse_ptr, indptr_ptr, chunk_ptr, s_eff_ptr, w_eff_ptr, k_ptr, att_ptr, stamp_ptr, vsum_ptr, rows_ptr, table_ptr, out_ptr,
    stride_sh, stride_lb, stride_vt, stride_vh, stride_os, stride_oh, stride_t,
    max_splits,
    C: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_CH: tl.constexpr,
):
    """Program ``(b, h, s)``: ``sum_c m_c * vsum[table[row_b, c], h]`` over
    the complete chunks of split ``s`` of request ``b`` (the scores' split
    plan: a split starts at a multiple of ``C``), for KV head ``h``'s ``G``
    query heads, with ``m_c`` the softmax mass (over all positions) of the
    chunk's unattended middle positions; written (zeros when nothing) at
    ``out[b * max_splits + s, h * G + g]``. ``BLOCK_CH`` chunks per step
    (``BLOCK_CH * C`` scores per head and ``BLOCK_CH`` mean rows in flight:
    one chunk per step left the loads latency-bound, 0.56 ms at 44 x 32K on
    the H200)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    lo = tl.load(indptr_ptr + b)
    L = tl.load(indptr_ptr + b + 1) - lo
    chunk = tl.load(chunk_ptr + b)
    s0 = tl.load(s_eff_ptr + b)
    e0 = L - tl.load(w_eff_ptr + b)
    k = tl.load(k_ptr + b)
    row = tl.load(rows_ptr + b).to(tl.int64)
    stamp = tl.load(stamp_ptr)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, C)
    offs_ch = tl.arange(0, BLOCK_CH)
    mask_g = offs_g < G
    mask_d = offs_d < D
    qh = h * G + offs_g
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if k < e0 - s0:  # else the budget covers the whole middle: nothing is unattended
        lse = tl.load(lse_ptr + b * stride_lb + qh, mask=mask_g, other=0.0)
        c_lo = sp * chunk // C
        c_hi = tl.minimum((sp * chunk + chunk) // C, L // C)
        for c0 in range(c_lo, c_hi, BLOCK_CH):
            cs = c0 + offs_ch
            ok_c = cs < c_hi
            pos = cs[:, None] * C + offs_c[None, :]  # [BLOCK_CH, C]
            att = tl.load(att_ptr + lo + pos, mask=ok_c[:, None], other=0)
            keep = (pos >= s0) & (pos < e0) & (att != stamp) & ok_c[:, None]
            sc = tl.load(scores_ptr + qh[:, None, None].to(tl.int64) * stride_sh + (lo + pos)[None, :, :],
                         mask=mask_g[:, None, None] & keep[None, :, :], other=float("-inf"))
            m = tl.sum(tl.exp(sc - lse[:, None, None]), 2)  # [BLOCK_G, BLOCK_CH]
            slot = tl.load(table_ptr + row * stride_t + cs, mask=ok_c, other=0).to(tl.int64)
            v = tl.load(vsum_ptr + slot[:, None] * stride_vt + h * stride_vh + offs_d[None, :],
                        mask=ok_c[:, None] & mask_d[None, :], other=0.0).to(tl.float32)  # [BLOCK_CH, BLOCK_D]
            acc += tl.sum(m[:, :, None] * v[None, :, :], 1)
    active = sp * chunk < L  # a split past the request's length writes nothing (the merge reads nsplit rows)
    tl.store(out_ptr + (b * max_splits + sp) * stride_os + qh[:, None] * stride_oh + offs_d[None, :], acc,
             mask=mask_g[:, None] & mask_d[None, :] & active)


@triton.jit
def _chunk_mean_kernel(src_ptr, ids_ptr, dst_ptr, out_ptr, stride_src, stride_ids, stride_out, skip,
                       C: tl.constexpr, ROW: tl.constexpr, BLOCK_ROW: tl.constexpr):
    """Item ``i``: ``out[dst[i]] = mean(src[ids[i, :C]])`` over whole rows, summed in float32, one cast;
    an item with ``dst[i] == skip`` reads and writes nothing."""
    i = tl.program_id(0)
    d = tl.load(dst_ptr + i).to(tl.int64)
    if d != skip:
        offs_r = tl.arange(0, BLOCK_ROW)
        mr = offs_r < ROW
        # row by row in position order, in float32: the sum store_sparse_run's fused means make (bit-equal
        # whatever either kernel's layout; a tile reduction's order may differ between two kernels)
        acc = tl.zeros([BLOCK_ROW], tl.float32)
        for c in tl.static_range(C):
            r = tl.load(ids_ptr + i * stride_ids + c).to(tl.int64)
            acc += tl.load(src_ptr + r * stride_src + offs_r, mask=mr, other=0.0).to(tl.float32)
        tl.store(out_ptr + d * stride_out + offs_r, (acc / C).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mr)


def chunk_mean_run(src: torch.Tensor, ids: torch.Tensor, dst: torch.Tensor, out: torch.Tensor, skip: Optional[int] = None) -> torch.Tensor:
    """The V summaries a decode step completes, in one launch: ``out[dst[i]] =
    mean over j of src[ids[i, j]]`` (whole rows, float32 sum, one cast to
    ``out``'s dtype; what ``src[ids].float().mean(1)`` gives up to the sum's order).

    Args:
        src: ``[rows, ...]`` V rows (the host pool's device view, or the pool's V); ids: ``[n, C]``
            int32/int64 rows of ``src`` (C a power of two); dst: ``[n]`` rows of ``out``; out:
            ``[slots, ...]``, rows as wide as ``src``'s.
        skip: a row of ``out`` that takes nothing (the pool's spare summary slot, given to every
            request whose new token completes no chunk): those items read no row of ``src``.
            A decode step completes a chunk for about one request in ``C``, and ``src`` is
            host memory read over PCIe on a sparse step, so the others must not read
            (before 2026-12-05 each read its ``C`` rows and wrote the spare slot).

    Returns:
        ``out``.

    Raises:
        ValueError: rows of different widths, or C not a power of two.
    """
    n, C = ids.shape
    row = src[0].numel() if src.shape[0] else out[0].numel()
    if out[0].numel() != row:
        raise ValueError(f"chunk_mean_run: rows of {row} elements into rows of {out[0].numel()}")
    if C & (C - 1):
        raise ValueError(f"chunk_mean_run: chunk {C} is not a power of two")
    if n:
        _chunk_mean_kernel[(n,)](src, ids, dst, out, src.stride(0), ids.stride(0), out.stride(0), -1 if skip is None else int(skip),
                                 C=C, ROW=row, BLOCK_ROW=triton.next_power_of_2(row))
    return out


#: scores per head one step of the estimate kernel reads (``BLOCK_CH * C``).
ESTIMATE_POSITIONS = 256


def estimate_run(
    scores: torch.Tensor, lse: torch.Tensor, kv_indptr: torch.Tensor, chunk: torch.Tensor, max_splits: int,
    s_eff: torch.Tensor, w_eff: torch.Tensor, k: torch.Tensor, attended: torch.Tensor, v_summary: torch.Tensor,
    rows: torch.Tensor, table: torch.Tensor, summary_chunk: int, out_partial: torch.Tensor, kv_heads: int,
    stamp: Optional[torch.Tensor] = None, reduce: bool = True, block_positions: int = ESTIMATE_POSITIONS,
    num_warps: Optional[int] = None,
) -> torch.Tensor:
    """The unattended positions' share of the V sum, through chunk-mean V.

    For request ``b`` and query head ``qh``: ``sum_c m_c * vbar_c`` over its
    complete chunks ``c`` (positions ``[c * C, (c + 1) * C)``, ``c < L // C``),
    ``m_c = sum exp(s_i - lse)`` over the chunk's middle positions (``[s_eff,
    L - w_eff)``) not selected, ``vbar_c`` the chunk's mean V
    (``v_summary[table[rows[b], c]]``): the float64 rule is
    :func:`sglang_elastic.offload.policy.estimate_reference`. One program per
    request, KV head and split of the scores' plan; the splits' partials are
    summed in order (deterministic).

    Args:
        scores: ``[q_heads, >= total]`` float32 (:func:`scores_run`); lse: ``[batch, q_heads]`` over all positions.
        kv_indptr, chunk, max_splits: the scores' offsets and split plan (chunks multiples of ``summary_chunk``).
        s_eff, w_eff, k: ``[batch]`` int32 (the policy's counts).
        attended: ``[>= total]`` marks (flat, as ``scores``): a selected position holds ``stamp``
            (:func:`select_run` writes them); with ``stamp`` None, a 0/1 mask (1: selected).
        v_summary: ``[slots, kv_heads, head_dim]`` chunk means; rows: ``[batch]`` request rows;
            table: ``[request_rows, max_chunks]`` int32, the slot of each row's chunk (:func:`slot_assign_run`).
        summary_chunk: ``C``, positions per chunk (a power of two).
        out_partial: ``[>= batch * max_splits, q_heads, head_dim]`` float32 workspace.
        kv_heads: KV heads of ``v_summary`` (and of the scores' GQA groups).
        stamp: ``[1]`` int32, this layer's mark value (:func:`lse_merge`), or None.
        reduce: sum the splits' partials here; False: return them, ``[batch * max_splits, q_heads, head_dim]``
            (:func:`attend_run` adds them in its merge: no extra launch). Rows of the splits past a
            request's length (``s * chunk[b] >= L``) are not written: add ``nsplit[b]`` rows only.
        block_positions, num_warps: scores per head one step of a program reads (a power of two, at least
            ``summary_chunk``; the chunks a step takes) and its Triton warps (None: 4), timed by
            ``scripts/gpu/check_offload.py --only select_sweep`` (another ``block_positions`` sums the chunks in
            another order: the same value to float32 rounding, not bit for bit).

    Returns:
        ``[batch, q_heads, head_dim]`` float32 (``reduce``), else the partials.

    Raises:
        ValueError: ``summary_chunk`` or ``block_positions`` not a power of two, ``block_positions`` below
            ``summary_chunk``, or q heads not a multiple of ``kv_heads``.
    """
    B = kv_indptr.shape[0] - 1
    Hq, D = out_partial.shape[1], out_partial.shape[2]
    if summary_chunk < 1 or summary_chunk & (summary_chunk - 1):
        raise ValueError(f"estimate_run: summary_chunk must be a power of two, not {summary_chunk}")
    if block_positions < summary_chunk or block_positions & (block_positions - 1):
        raise ValueError(f"estimate_run: block_positions must be a power of two of at least summary_chunk {summary_chunk}, not {block_positions}")
    if Hq % kv_heads:
        raise ValueError(f"estimate_run: q heads {Hq} not a multiple of kv heads {kv_heads}")
    if B == 0:
        return out_partial[:0, :, :].view(0, Hq, D)
    G = Hq // kv_heads
    if stamp is None:
        stamp = torch.ones(1, dtype=torch.int32, device=scores.device)
    _estimate_kernel[(B, kv_heads, max_splits)](
        scores, lse, kv_indptr, chunk, s_eff, w_eff, k, attended, stamp, v_summary, rows, table, out_partial,
        scores.stride(0), lse.stride(0), v_summary.stride(0), v_summary.stride(1), out_partial.stride(0), out_partial.stride(1),
        table.stride(0), max_splits, C=summary_chunk, G=G, BLOCK_G=triton.next_power_of_2(G), D=D, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_CH=block_positions // summary_chunk, **_launch_opts(num_warps, None),
    )
    if not reduce:
        return out_partial[: B * max_splits]
    lens = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
    written = torch.arange(max_splits, device=lens.device)[None, :] * chunk[:B, None].to(torch.int64) < lens[:, None]
    part = out_partial[: B * max_splits].view(B, max_splits, Hq, D)
    return torch.where(written[:, :, None, None], part, 0.0).sum(1)


@triton.jit
def _slot_assign_kernel(rows_ptr, chunks_ptr, valid_ptr, table_ptr, count_ptr, stack_ptr, top_ptr, overflow_ptr, dst_ptr,
                        stride_t, SPARE: tl.constexpr, ZERO: tl.constexpr):
    """Item ``i``: when valid, pop a free slot for chunk ``chunks[i]`` of row
    ``rows[i]`` (``ZERO`` and one overflow count when none is left), record
    it in ``table[row, chunk]``, raise ``count[row]`` to ``chunk + 1``; write
    ``dst[i]``: the slot to fill (``SPARE`` for an invalid item or an overflow)."""
    i = tl.program_id(0)
    ok = tl.load(valid_ptr + i) != 0
    dst = tl.full([], SPARE, tl.int64)
    if ok:
        r = tl.load(rows_ptr + i).to(tl.int64)
        c = tl.load(chunks_ptr + i).to(tl.int64)
        t = tl.atomic_add(top_ptr, -1)
        if t > 0:
            slot = tl.load(stack_ptr + t - 1)
            dst = slot.to(tl.int64)
        else:
            tl.atomic_add(top_ptr, 1)
            tl.atomic_add(overflow_ptr, 1)
            slot = tl.full([], ZERO, tl.int32)
        tl.store(table_ptr + r * stride_t + c, slot)
        tl.atomic_max(count_ptr + r, (c + 1).to(tl.int32))
    tl.store(dst_ptr + i, dst)


@triton.jit
def _slot_release_kernel(rows_ptr, table_ptr, count_ptr, stack_ptr, top_ptr, stride_t, ZERO: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``rows[program]``: push its ``count`` recorded slots (not ``ZERO``) back on the free stack; ``count = 0``."""
    r = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    n = tl.load(count_ptr + r)
    offs = tl.arange(0, BLOCK)
    for j in range(0, n, BLOCK):
        m = (j + offs) < n
        slot = tl.load(table_ptr + r * stride_t + j + offs, mask=m, other=ZERO)
        keep = m & (slot != ZERO)
        k = tl.sum(keep.to(tl.int32), 0)
        base = tl.atomic_add(top_ptr, k)
        at = base + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(stack_ptr + at, slot, mask=keep)
        tl.store(table_ptr + r * stride_t + j + offs, tl.full([BLOCK], ZERO, tl.int32), mask=m)
    tl.store(count_ptr + r, 0)


def slot_assign_run(rows: torch.Tensor, chunks: torch.Tensor, valid: torch.Tensor, table: torch.Tensor, count: torch.Tensor,
                    stack: torch.Tensor, top: torch.Tensor, overflow: torch.Tensor, dst: torch.Tensor, spare: int, zero: int) -> torch.Tensor:
    """Give chunks their summary slots from a free stack on the GPU (no host read; CUDA-graph safe).

    Args:
        rows, chunks: ``[n]`` int32/int64 request rows and chunk indices; valid: ``[n]`` bool/int (0: no chunk).
        table: ``[request_rows, max_chunks]`` int32, the slot of each row's chunk (``zero`` when none).
        count: ``[request_rows]`` int32, chunks recorded per row (raised to ``chunk + 1``).
        stack, top: ``[slots]`` int32 free slots and ``[1]`` int32 their count.
        overflow: ``[1]`` int32, counts chunks that found no free slot (they read as ``zero``).
        dst: ``[n]`` int64 output, the slot each item fills (``spare``: nothing to keep).

    Returns:
        ``dst``.
    """
    n = rows.shape[0]
    if n:
        _slot_assign_kernel[(n,)](rows, chunks, valid, table, count, stack, top, overflow, dst, table.stride(0), SPARE=spare, ZERO=zero)
    return dst


def slot_release_run(rows: torch.Tensor, table: torch.Tensor, count: torch.Tensor, stack: torch.Tensor, top: torch.Tensor,
                     zero: int, block: int = 256) -> None:
    """Return the summary slots of request rows ``rows`` (``[n]`` int32/int64) to the free stack (see :func:`slot_assign_run`)."""
    n = rows.shape[0]
    if n:
        _slot_release_kernel[(n,)](rows, table, count, stack, top, table.stride(0), ZERO=zero, BLOCK=block)


__all__ = ["attend_run", "chunk_mean_run", "copy_rows_run", "estimate_run", "page_adapt_run", "page_grant_run", "slot_assign_run", "slot_release_run", "store_sparse_run", "fixed_entries_run", "gather_selected_run", "lse_merge", "scores_run", "select_run", "swap_in_run"]
