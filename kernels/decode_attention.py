"""Block-table decode attention: split-KV and compact work-queue (Triton).

Both read SGLang's KV layout directly: per-layer ``k_buffer`` / ``v_buffer``
of shape ``[slots, kv_heads, head_dim]`` addressed through ``kv_indptr`` /
``kv_indices`` (CSR token ids, as SGLang's Triton and FlashInfer backends
build them from ``req_to_token``; with page size 16 the ids of a page are
consecutive, the kernels do not care). All ``G = q_heads / kv_heads`` query
heads of a KV head are computed in one program, so each K/V row is read once
per step (GQA), with a tensor-core ``tl.dot`` over the padded group.

- :func:`split_kv_decode`: flash-decoding. Request ``b``'s KV is cut into
  ``num_splits[b]`` chunks (computed on the GPU from the lengths), program
  ``(b, h, s)`` reduces chunk ``s``; a merge kernel combines the partial
  outputs by their log-sum-exp. Grid ``(batch, kv_heads, max_splits)``.
- :func:`work_queue_decode`: one dense list of ``(request, chunk)`` items for
  all requests (no padding for short ones), built on the GPU with a prefix sum,
  consumed by a persistent grid of ``programs x kv_heads`` programs that stride
  over it; the same merge, segmented by ``chunk_offsets``.

Each comes as ``*_plan`` (once per decode step: chunk counts or the item
list from the lengths, GPU ops only) and ``*_run`` (once per layer, into
caller-owned workspaces), as FlashInfer splits ``plan`` / ``run``; the
SGLang backend (``sglang_elastic.attention``) uses those. ``split_kv_decode``
/ ``work_queue_decode`` do both in one call.

Neither needs a host sync: chunk counts and the item list live on the GPU, so
one batch size's launch can be captured in a CUDA graph and replayed with
other lengths (grids depend only on the batch size and the maxima passed in).

Ideas: Flash-Decoding (Dao et al., 2023), FlashInfer's split-KV planner
(``flashinfer/data/include/flashinfer/attention/scheduler.cuh``), SGLang's
Triton decode (``sglang/kernels/ops/attention/decode_attention.py``), and the
PersistentKV paper's compact work queue (arXiv 2606.26666).
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _partial_attn(
    q_ptr, k_ptr, v_ptr, idx_ptr, mid_o_ptr, mid_lse_ptr,
    b, h, start, end, out_slot,
    sm_scale,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_mo_s, stride_mo_h, stride_ml_s,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
    vidx_ptr=None, SEP_V: tl.constexpr = False,
    o_ptr=None, stride_ob=0, stride_oh=0, DIRECT=False,
):
    """Attention of the G query heads of KV head ``h`` of request ``b`` over
    KV positions ``[start, end)`` of its index list; writes the partial output
    (unnormalised by nothing: already divided by its own sum) and its LSE into
    slot ``out_slot`` of the mid buffers. ``SEP_V``: V row ``i`` is
    ``vidx[i]`` instead of ``idx[i]`` (the KV offload path: K in the pool, V
    in a hot buffer). ``DIRECT`` (runtime): write the normalised output to
    ``o[b]`` instead (a single-chunk request of the fused kernel)."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < G
    mask_d = offs_d < D
    qh = h * G + offs_g
    q = tl.load(q_ptr + b * stride_qb + qh[:, None] * stride_qh + offs_d[None, :], mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if DOT_F32:  # Triton's interpreter computes bf16 tl.dot wrongly: do it in fp32 there
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    offs_b = tl.arange(0, BLOCK_N)
    # The token ids of tile i + 1 are loaded while tile i is computed (a
    # loop-carried register tile), so a K/V tile's address never waits on a
    # global load issued in its own iteration. With the ids loaded in the
    # iteration that uses them, Triton 3.6's pipeliner (sm_90) kept one K and
    # one V buffer whatever ``num_stages``: at 2 stages each tile waited on
    # the ids, then on K/V; at 3 the ids came ahead but the K/V copies still
    # had to land before the tile's math. With the ids carried, ``num_stages``
    # >= 3 gives K and V two or more buffers each (FlashInfer's paged decode
    # likewise computes the next tiles' KV offsets ahead of their loads, its
    # ``kv_offset_smem``).
    nxt = tl.load(idx_ptr + start + offs_b, mask=start + offs_b < end, other=0)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_b
        mask_n = offs_n < end
        tok = nxt.to(tl.int64)
        nxt = tl.load(idx_ptr + offs_n + BLOCK_N, mask=offs_n + BLOCK_N < end, other=0)
        if SEP_V:
            vtok = tl.load(vidx_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
        else:
            vtok = tok
        k = tl.load(k_ptr + tok[:, None] * stride_kt + h * stride_kh + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * sm_scale
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + vtok[:, None] * stride_vt + h * stride_vh + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    out = acc / l_i[:, None]
    lse = m_i + tl.log(l_i)
    if DIRECT:  # the request's only chunk: its partial is the output (no mid round trip, no merge)
        tl.store(o_ptr + b * stride_ob + qh[:, None] * stride_oh + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=mask_g[:, None] & mask_d[None, :])
    else:
        tl.store(mid_o_ptr + out_slot * stride_mo_s + qh[:, None] * stride_mo_h + offs_d[None, :], out, mask=mask_g[:, None] & mask_d[None, :])
        tl.store(mid_lse_ptr + out_slot * stride_ml_s + qh, lse, mask=mask_g)


@triton.jit
def _chunk_span(indptr_ptr, chunk_ptr, b, s):
    """Split ``s`` of request ``b`` under a :func:`split_kv_plan` plan:
    ``(lo, hi, chunk, start, end)``, the request's list ``[lo, hi)`` and the
    split's ``[start, end)`` (empty past the request's last chunk)."""
    lo = tl.load(indptr_ptr + b)
    hi = tl.load(indptr_ptr + b + 1)
    chunk = tl.load(chunk_ptr + b)
    start = lo + s * chunk
    end = tl.minimum(start + chunk, hi)
    return lo, hi, chunk, start, end


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, indptr_ptr, idx_ptr, chunk_ptr, mid_o_ptr, mid_lse_ptr,
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
        _partial_attn(q_ptr, k_ptr, v_ptr, idx_ptr, mid_o_ptr, mid_lse_ptr, b, h, start, end, b * max_splits + s, sm_scale,
                      stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_mo_s, stride_mo_h, stride_ml_s,
                      G, BLOCK_G, D, BLOCK_D, BLOCK_N, DOT_F32)


@triton.jit
def _split_fused_kernel(
    q_ptr, k_ptr, v_ptr, indptr_ptr, idx_ptr, chunk_ptr, mid_o_ptr, mid_lse_ptr, o_ptr, count_ptr,
    sm_scale,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_mo_s, stride_mo_h, stride_ml_s, stride_ob, stride_oh,
    max_splits, num_kv_heads, order_ptr,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_GM: tl.constexpr, ORDERED: tl.constexpr, vidx_ptr=None, SEP_V: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Split-KV in one launch. Program ``(b, h, s)`` computes chunk ``s`` of
    request ``b`` for KV head ``h``'s query heads; a request of one chunk
    writes its output directly; otherwise the program that finishes last
    (a per-(request, head) arrival counter, acquire-release at GPU scope)
    merges all the partials by log-sum-exp, in slot order (deterministic:
    the same sums whichever program is last), and resets the counter for
    the next launch (CUDA-graph replays). The serial split-K fix-up of
    CUTLASS's semaphore / Stream-K, applied to decode attention.
    ``ORDERED``: program row ``i`` takes request ``order[i]`` (longest
    requests first, so their chunks do not start last and set the tail).
    ``SEP_V``: V row ``i`` is ``vidx[i]`` (two id lists, as ``_partial_attn``).
    ``BLOCK_S`` x ``BLOCK_GM``: the merge's tile, partials x query heads (``BLOCK_GM`` >= G,
    not the attention's ``BLOCK_G``, which ``tl.dot`` pads to 16): :func:`fused_merge_tile`.
    ``PDL``: launched while the kernel before it (the layer's KV store) still runs; waits
    for it before any load, triggers nothing (the next kernel is not ours)."""
    if PDL:
        gdc_wait()
    if ORDERED:
        b = tl.load(order_ptr + tl.program_id(0))
    else:
        b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    lo, hi, chunk, start, end = _chunk_span(indptr_ptr, chunk_ptr, b, s)
    n = tl.where(hi > lo, (hi - lo + chunk - 1) // chunk, 0)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < G
    mask_d = offs_d < D
    qh = h * G + offs_g
    if n == 0 or n > max_splits:
        # an empty request: zeros, as the merge kernel writes; a plan of more chunks than the grid has (a caller's
        # max_splits below its plan's): NaN, visibly wrong, and no counter touched (a counter left above zero
        # would merge every later launch early)
        if s == 0:
            fill = tl.zeros([BLOCK_G, BLOCK_D], tl.float32) + tl.where(n == 0, 0.0, float("nan"))
            tl.store(o_ptr + b * stride_ob + qh[:, None] * stride_oh + offs_d[None, :], fill.to(o_ptr.dtype.element_ty),
                     mask=mask_g[:, None] & mask_d[None, :])
    elif start < end:
        _partial_attn(q_ptr, k_ptr, v_ptr, idx_ptr, mid_o_ptr, mid_lse_ptr, b, h, start, end, b * max_splits + s, sm_scale,
                      stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_mo_s, stride_mo_h, stride_ml_s,
                      G, BLOCK_G, D, BLOCK_D, BLOCK_N, DOT_F32, vidx_ptr, SEP_V, o_ptr=o_ptr, stride_ob=stride_ob, stride_oh=stride_oh,
                      DIRECT=n == 1)
        if n > 1:
            tl.debug_barrier()  # every thread's partial stores precede the release below
            arrived = tl.atomic_add(count_ptr + b * num_kv_heads + h, 1, sem="acq_rel", scope="gpu")
            if arrived == n - 1:  # the last chunk of (b, h) to finish: merge
                offs_s = tl.arange(0, BLOCK_S)
                offs_gm = tl.arange(0, BLOCK_GM)
                mask_gm = offs_gm < G
                qh_m = h * G + offs_gm
                m = tl.full([BLOCK_GM], float("-inf"), tl.float32)
                l = tl.zeros([BLOCK_GM], tl.float32)
                acc = tl.zeros([BLOCK_GM, BLOCK_D], tl.float32)
                for i0 in range(0, n, BLOCK_S):
                    mask_s = (i0 + offs_s) < n
                    slot = b * max_splits + i0 + offs_s
                    lse = tl.load(mid_lse_ptr + slot[:, None] * stride_ml_s + qh_m[None, :], mask=mask_s[:, None] & mask_gm[None, :],
                                  other=float("-inf"), cache_modifier=".cg")  # [S, G], from L2: other SMs wrote them
                    o = tl.load(mid_o_ptr + slot[:, None, None] * stride_mo_s + qh_m[None, :, None] * stride_mo_h + offs_d[None, None, :],
                                mask=mask_s[:, None, None] & mask_gm[None, :, None] & mask_d[None, None, :], other=0.0, cache_modifier=".cg")
                    m_new = tl.maximum(m, tl.max(lse, 0))
                    scale_old = tl.exp(m - m_new)
                    w = tl.exp(lse - m_new[None, :])  # masked rows: exp(-inf) = 0
                    acc = acc * scale_old[:, None] + tl.sum(o * w[:, :, None], 0)
                    l = l * scale_old + tl.sum(w, 0)
                    m = m_new
                out = acc / tl.maximum(l, 1e-30)[:, None]
                tl.store(o_ptr + b * stride_ob + qh_m[:, None] * stride_oh + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                         mask=mask_gm[:, None] & mask_d[None, :])
                tl.atomic_xchg(count_ptr + b * num_kv_heads + h, 0, sem="relaxed", scope="gpu")


@triton.jit
def _queue_kernel(
    q_ptr, k_ptr, v_ptr, indptr_ptr, idx_ptr, item_offsets_ptr, num_items_ptr, chunk_ptr, mid_o_ptr, mid_lse_ptr,
    sm_scale, batch, max_items,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_mo_s, stride_mo_h, stride_ml_s,
    LOG2_BATCH: tl.constexpr,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Persistent: program (p, h) takes items p, p + P, ... of the dense list."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    p = tl.program_id(0)
    h = tl.program_id(1)
    P = tl.num_programs(0)
    total = tl.minimum(tl.load(num_items_ptr), max_items)  # the plan keeps total <= capacity; this only guards memory
    chunk = tl.load(chunk_ptr)
    for item in range(p, total, P):
        # request of this item: largest b with item_offsets[b] <= item (binary search)
        b = item * 0
        for bit in tl.static_range(LOG2_BATCH + 1):
            cand = b + (1 << (LOG2_BATCH - bit))
            ok = cand < batch
            off = tl.load(item_offsets_ptr + cand, mask=ok, other=0)
            b = tl.where(ok & (off <= item), cand, b)
        c = item - tl.load(item_offsets_ptr + b)
        kv_lo = tl.load(indptr_ptr + b)
        kv_hi = tl.load(indptr_ptr + b + 1)
        start = kv_lo + c * chunk
        end = tl.minimum(start + chunk, kv_hi)
        _partial_attn(q_ptr, k_ptr, v_ptr, idx_ptr, mid_o_ptr, mid_lse_ptr, b, h, start, end, item, sm_scale,
                      stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_mo_s, stride_mo_h, stride_ml_s,
                      G, BLOCK_G, D, BLOCK_D, BLOCK_N, DOT_F32)


@triton.jit
def _merge_kernel(
    mid_o_ptr, mid_lse_ptr, seg_start_ptr, seg_count_ptr, o_ptr,
    stride_mo_s, stride_mo_h, stride_ml_s, stride_ob, stride_oh, seg_stride,
    D: tl.constexpr, BLOCK_D: tl.constexpr, SEGMENTED: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False,
    lse_full_ptr=None, stride_lf_b=0, FULL_LSE: tl.constexpr = False,
    max_rows=0, GUARD_ROWS: tl.constexpr = False,
    extra_ptr=None, stride_ex_s=0, stride_ex_h=0, extra_n=0, extra_cnt_ptr=None, EXTRA: tl.constexpr = False,
    EXTRA_CNT: tl.constexpr = False, SKIP_EMPTY: tl.constexpr = False,
):
    """Combine request b's partials of query head qh (segment of the mid
    buffers) by log-sum-exp; an empty request (length 0) gets zeros.
    ``SEGMENTED``: the segment starts at ``seg_start[b]`` (work queue), else
    at ``b * seg_stride`` (split; a runtime value, so batch sizes with other
    split caps share one compiled kernel). ``BLOCK_S`` partials are loaded per step
    (one memory round trip for up to ``BLOCK_S`` splits, instead of one per
    split), folded into the running max / sum / accumulator. ``PDL``: launched
    while the partials kernel still runs; waits for it before any load.
    ``FULL_LSE``: divide by ``exp(lse_full[b, qh])`` (a log-sum-exp over more
    positions than the partials cover) instead of by the partials' own sum:
    the KV offload path's exact softmax denominator with a sparse V sum; a
    request whose ``lse_full`` is ``-inf`` (scored over no position: a dense
    request of the offload path) is normalised by its own sum.
    ``GUARD_ROWS``: a segment running past ``max_rows`` (a work-queue list
    longer than its workspace, whose tail was never computed) reads no row
    past it and writes NaN: visibly wrong, never silently partial.
    ``EXTRA``: adds ``sum_j extra[b * extra_n + j, qh]`` (``j < extra_n``, or
    ``j < extra_cnt[b]`` with ``EXTRA_CNT``; float32 partials summed in order)
    to the result before the cast: the offload path's ``estimate`` share,
    with no launch of its own. ``SKIP_EMPTY``: a request with no partials
    writes nothing (its row of ``o`` is another launch's: the offload path's
    kept requests beside the sparse ones)."""
    if PDL:
        gdc_wait()
    b = tl.program_id(0)
    qh = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_S)
    mask_d = offs_d < D
    if SEGMENTED:
        first = tl.load(seg_start_ptr + b)
    else:
        first = b * seg_stride
    n = tl.load(seg_count_ptr + b)
    store_mask = mask_d
    if SKIP_EMPTY:
        store_mask = store_mask & (n > 0)
    if GUARD_ROWS:
        overflow = first + n > max_rows
        n = tl.minimum(n, tl.maximum(max_rows - first, 0))
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for i0 in range(0, n, BLOCK_S):
        mask_s = (i0 + offs_s) < n
        slot = first + i0 + offs_s
        lse = tl.load(mid_lse_ptr + slot * stride_ml_s + qh, mask=mask_s, other=float("-inf"))
        o = tl.load(mid_o_ptr + slot[:, None] * stride_mo_s + qh * stride_mo_h + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        scale_old = tl.exp(m - m_new)
        w = tl.exp(lse - m_new)  # masked rows: exp(-inf) = 0
        acc = acc * scale_old + tl.sum(o * w[:, None], 0)
        l = l * scale_old + tl.sum(w, 0)
        m = m_new
    if FULL_LSE:
        # acc = sum_s o_s exp(lse_s - m); o_s is normalised by its own sum, so
        # acc * exp(m - lse_full) = sum_i exp(s_i - lse_full) v_i over the partials' positions
        lf = tl.load(lse_full_ptr + b * stride_lf_b + qh)
        # a request scored over no position (lse_full -inf: the offload path's dense requests,
        # whose partials cover every position) is normalised by its partials' own sum
        own = lf == float("-inf")
        out = tl.where(l > 0, tl.where(own, acc / tl.maximum(l, 1e-30), acc * tl.exp(m - tl.where(own, m, lf))), 0.0)
    else:
        out = tl.where(l > 0, acc / tl.maximum(l, 1e-30), 0.0)
    if EXTRA:
        n_ex = extra_n
        if EXTRA_CNT:
            n_ex = tl.load(extra_cnt_ptr + b)
        for j0 in range(0, n_ex, BLOCK_S):
            mask_j = (j0 + offs_s) < n_ex
            row = b * extra_n + j0 + offs_s
            ex = tl.load(extra_ptr + row[:, None] * stride_ex_s + qh * stride_ex_h + offs_d[None, :],
                         mask=mask_j[:, None] & mask_d[None, :], other=0.0)
            out += tl.sum(ex, 0)
    if GUARD_ROWS:
        out = tl.where(overflow, float("nan"), out)
    tl.store(o_ptr + b * stride_ob + qh * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=store_mask)


#: Partials the merge kernel loads per step.
MERGE_BLOCK_S = 32


def _dot_f32(q: torch.Tensor) -> bool:
    """fp32 dots under ``TRITON_INTERPRET=1`` for bf16 (the interpreter's bf16
    ``tl.dot`` is wrong; on a GPU the dots stay bf16 tensor-core ones)."""
    return bool(triton.knobs.runtime.interpret) and q.dtype == torch.bfloat16


def _unit_last_dim(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit-stride last dimension (stride {t.stride(-1)}, shape {tuple(t.shape)}): pass {name}.contiguous()")


def _shape_args(q: torch.Tensor, k_buffer: torch.Tensor):
    """Launch shape from ``q`` and ``k_buffer``; refuses what the kernels would
    read wrongly (they index the last dimension with stride 1 and take
    ``head_dim`` from ``q``).

    Raises:
        ValueError: naming the tensor: not 3-D, ``k_buffer``'s head_dim other
        than ``q``'s, q heads not a multiple of KV heads, a last dimension
        that is not unit-stride.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim], not shape {tuple(q.shape)}")
    if k_buffer.dim() != 3:
        raise ValueError(f"k_buffer must be [slots, kv_heads, head_dim], not shape {tuple(k_buffer.shape)}")
    B, Hq, D = q.shape
    Hkv = k_buffer.shape[1]
    if k_buffer.shape[2] != D:
        raise ValueError(f"k_buffer head_dim {k_buffer.shape[2]} differs from q's {D}")
    if Hq % Hkv:
        raise ValueError(f"q heads {Hq} not a multiple of kv heads {Hkv}")
    _unit_last_dim("q", q)
    _unit_last_dim("k_buffer", k_buffer)
    G = Hq // Hkv
    return B, Hq, Hkv, D, G, max(16, triton.next_power_of_2(G)), triton.next_power_of_2(D)


def _check_run_args(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, out: torch.Tensor,
                    mid_o: torch.Tensor, mid_lse: torch.Tensor, rows: int) -> int:
    """The checks of :func:`_shape_args` plus V, the output and the workspaces
    (host-side shapes and strides only: no device read, CUDA-graph safe).

    Returns:
        The workspace rows usable by both ``mid_o`` and ``mid_lse``.

    Raises:
        ValueError: naming the tensor: ``v_buffer`` with another head count,
        head_dim or dtype than ``k_buffer``, K/V of another dtype than ``q``,
        ``out`` not shaped like ``q``, ``mid_o`` / ``mid_lse`` not
        ``[rows, q_heads(, head_dim)]`` float32 with at least ``rows`` rows,
        any last dimension that is not unit-stride.
    """
    B, Hq, D = q.shape
    if v_buffer.dim() != 3 or v_buffer.shape[1:] != k_buffer.shape[1:]:
        raise ValueError(f"v_buffer must be [slots, kv_heads, head_dim] like k_buffer {tuple(k_buffer.shape)}, not {tuple(v_buffer.shape)}")
    if v_buffer.shape[0] < k_buffer.shape[0]:
        raise ValueError(f"v_buffer holds {v_buffer.shape[0]} slots, fewer than k_buffer's {k_buffer.shape[0]}")
    if k_buffer.dtype != q.dtype or v_buffer.dtype != q.dtype:
        raise ValueError(f"k_buffer / v_buffer dtype ({k_buffer.dtype} / {v_buffer.dtype}) must be q's {q.dtype}")
    _unit_last_dim("v_buffer", v_buffer)
    if tuple(out.shape) != (B, Hq, D):
        raise ValueError(f"out must be shaped like q {tuple(q.shape)}, not {tuple(out.shape)}")
    _unit_last_dim("out", out)
    if mid_o.dim() != 3 or tuple(mid_o.shape[1:]) != (Hq, D) or mid_o.dtype != torch.float32:
        raise ValueError(f"mid_o must be [rows, {Hq}, {D}] float32, not {tuple(mid_o.shape)} {mid_o.dtype}")
    if mid_lse.dim() != 2 or mid_lse.shape[1] != Hq or mid_lse.dtype != torch.float32:
        raise ValueError(f"mid_lse must be [rows, {Hq}] float32, not {tuple(mid_lse.shape)} {mid_lse.dtype}")
    _unit_last_dim("mid_o", mid_o)
    _unit_last_dim("mid_lse", mid_lse)
    have = min(mid_o.shape[0], mid_lse.shape[0])
    if have < rows:
        name = "mid_o" if mid_o.shape[0] < rows else "mid_lse"
        raise ValueError(f"{name} holds {have} rows, this launch needs {rows}")
    return have


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch (``griddepcontrol``): Hopper (sm_90) and
    later, compiled code only (not under Triton's interpreter)."""
    if triton.knobs.runtime.interpret or device.type != "cuda":
        return False
    return _sm_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.lru_cache(maxsize=None)
def _sm_major(index: int) -> int:  # once per device: this runs on every per-layer call
    return torch.cuda.get_device_capability(index)[0]


def _pdl_opts(pdl: bool, device: torch.device) -> dict:
    """Launch options and kernel flag for PDL (CUDA's programmatic dependent
    launch: a kernel launches while the one before it finishes and waits in
    ``griddepcontrol.wait``; inside CUDA graphs, programmatic edges). Off
    where :func:`pdl_supported` says no. Always both or neither: a PDL
    launch of a kernel compiled without its ``gdc_wait`` would race."""
    return {"PDL": True, "launch_pdl": True} if pdl and pdl_supported(device) else {}


def _launch_opts(num_warps: Optional[int], num_stages: Optional[int]) -> dict:
    """Triton launch options; ``None`` keeps Triton's default (4 warps, 3 stages)."""
    opts = {}
    if num_warps is not None:
        opts["num_warps"] = int(num_warps)
    if num_stages is not None:
        opts["num_stages"] = int(num_stages)
    return opts


# ---------------------------------------------------------------------------
# plan / run (FlashInfer's split: ``plan`` once per decode step from the
# lengths, on the GPU and CUDA-graph recordable; ``run`` once per layer,
# allocation-free when the caller passes the workspaces)
# ---------------------------------------------------------------------------


def split_kv_plan(
    kv_indptr: torch.Tensor, max_splits: int, min_chunk: int, block_n: int = 32,
    chunk_out: Optional[torch.Tensor] = None, nsplit_out: Optional[torch.Tensor] = None,
):
    """Per-request chunk length and chunk count for :func:`split_kv_run` (GPU ops only, no host read).

    Request ``b`` of length ``L`` gets ``min(max_splits, ceil(L / min_chunk))``
    chunks, each rounded up to a multiple of ``block_n`` tokens.

    Args:
        kv_indptr: ``[batch + 1]`` int32/int64 offsets (as SGLang builds them).
        max_splits: the most chunks per request (the grid's third dimension).
        min_chunk: tokens, the split length: a request longer than it splits into ``ceil(L / min_chunk)`` equal
            chunks (at most ``max_splits``), so no chunk is longer than ``min_chunk`` (rounded up to ``block_n``)
            unless ``max_splits`` caps the count (8,448 tokens at 8,192: two chunks of 4,224).
        chunk_out, nsplit_out: optional ``[>= batch]`` int32 buffers (address-stable under CUDA graphs).

    Returns:
        ``(chunk, nsplit)``: ``[batch]`` int32 tokens per chunk, ``[batch]`` int32
        chunks (0 for an empty request).
    """
    B = kv_indptr.shape[0] - 1
    lens = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int32)
    splits = torch.clamp((lens + min_chunk - 1) // min_chunk, 1, max_splits)
    chunk = (lens + splits - 1) // splits
    chunk = torch.clamp((chunk + block_n - 1) // block_n * block_n, min=block_n).to(torch.int32)
    nsplit = torch.where(lens > 0, (lens + chunk - 1) // chunk, 0).to(torch.int32)
    if chunk_out is not None:
        chunk_out[:B].copy_(chunk)
        chunk = chunk_out[:B]
    if nsplit_out is not None:
        nsplit_out[:B].copy_(nsplit)
        nsplit = nsplit_out[:B]
    return chunk, nsplit


def split_kv_run(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
    chunk: torch.Tensor, nsplit: torch.Tensor, max_splits: int, mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor,
    sm_scale: Optional[float] = None, block_n: int = 32, num_warps: Optional[int] = None, num_stages: Optional[int] = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Split-KV decode of one layer from a :func:`split_kv_plan` (two launches: partials, merge;
    ``pdl``: both with programmatic dependent launch where supported, :func:`pdl_supported`).

    Args:
        q: ``[batch, q_heads, head_dim]`` bf16/fp16.
        k_buffer, v_buffer: ``[slots, kv_heads, head_dim]`` (SGLang's per-layer buffers).
        chunk, nsplit: the plan's ``[batch]`` int32 tensors; ``max_splits`` as planned.
        mid_o: ``[>= batch * max_splits, q_heads, head_dim]`` float32 workspace.
        mid_lse: ``[>= batch * max_splits, q_heads]`` float32 workspace.
        out: ``[batch, q_heads, head_dim]`` output (any strides with unit last dim).

    Returns:
        ``out``.

    Raises:
        ValueError: naming the tensor (:func:`_shape_args`, :func:`_check_run_args`): K/V or ``q``
        of mismatched head_dim, head count or dtype, a last dimension that is not unit-stride,
        workspaces with fewer than ``batch * max_splits`` rows.
    """
    B, Hq, Hkv, D, G, BLOCK_G, BLOCK_D = _shape_args(q, k_buffer)
    _check_run_args(q, k_buffer, v_buffer, out, mid_o, mid_lse, B * max_splits)
    if B == 0:
        return out
    sm_scale = sm_scale if sm_scale is not None else D ** -0.5
    opts = _launch_opts(num_warps, num_stages)
    pdl_opts = _pdl_opts(pdl, q.device)
    _split_kernel[(B, Hkv, max_splits)](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, chunk, mid_o, mid_lse, sm_scale,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_lse.stride(0),
        max_splits, G=G, BLOCK_G=BLOCK_G, D=D, BLOCK_D=BLOCK_D, BLOCK_N=block_n, DOT_F32=_dot_f32(q), **opts, **pdl_opts,
    )
    _merge_kernel[(B, Hq)](
        mid_o, mid_lse, nsplit, nsplit, out,
        mid_o.stride(0), mid_o.stride(1), mid_lse.stride(0), out.stride(0), out.stride(1), max_splits,
        D=D, BLOCK_D=BLOCK_D, SEGMENTED=False, BLOCK_S=MERGE_BLOCK_S, **pdl_opts,
    )
    return out


#: Partial rows x query heads the fused kernel's last program loads per merge step.
FUSED_MERGE_ROWS = 16


def fused_merge_tile(group: int):
    """``(BLOCK_GM, BLOCK_S)`` of :func:`split_kv_fused_run`'s merge for a GQA group of ``group`` query heads:
    the group rounded up to a power of two, and as many partials per step as keep ``BLOCK_S * BLOCK_GM`` at
    :data:`FUSED_MERGE_ROWS` (a ``[BLOCK_S, BLOCK_GM, D]`` float32 tile). The merge once loaded ``[8, 16, D]``
    (the attention's ``tl.dot``-padded group): compiled for sm_90 at 4 warps that raised the kernel to 206-255
    registers a thread (two CTAs an SM), against 126-168 with this tile for groups 1 to 16 (ptxas's count at the
    shipped launches: the all-dense one at 3 stages, the decode engine's at 2; ``tests/test_decode_kernels.py``
    checks 1, 4, 7 and 16), so three CTAs an SM, which their shared memory (~74 KB a CTA at ``block_n`` 128) also
    allows. At the edge: several groups take 167-168, and ``num_stages=2`` in the all-dense launch puts G = 7 at 174
    (two CTAs again)."""
    gm = triton.next_power_of_2(int(group))
    return gm, max(1, FUSED_MERGE_ROWS // gm)


def longest_first(kv_indptr: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[batch]`` int32: the requests by length, longest first (ties: lower
    index first); GPU ops only, so a decode graph can record it with the plan.
    ``out``: an optional address-stable ``[>= batch]`` int32 buffer."""
    lens = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
    B = lens.shape[0]
    idx = torch.arange(B, device=lens.device, dtype=torch.int64)
    order = torch.argsort(-lens * (B + 1) + idx).to(torch.int32)  # a unique key: a stable order without a stable sort
    if out is not None:
        out[:B].copy_(order)
        return out[:B]
    return order


def split_kv_fused_counters(batch: int, kv_heads: int, device) -> torch.Tensor:
    """The arrival counters of :func:`split_kv_fused_run`: ``[batch * kv_heads]``
    int32 zeros (each launch leaves them at zero again; allocate once, keep
    the address under CUDA graphs)."""
    return torch.zeros(batch * kv_heads, dtype=torch.int32, device=device)


def split_kv_fused_run(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
    chunk: torch.Tensor, max_splits: int, mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, counters: torch.Tensor,
    sm_scale: Optional[float] = None, block_n: int = 32, num_warps: Optional[int] = None, num_stages: Optional[int] = None,
    order: Optional[torch.Tensor] = None, v_indices: Optional[torch.Tensor] = None, pdl: bool = False,
    merge_tile: Optional[Tuple[int, int]] = None,
) -> torch.Tensor:
    """Split-KV decode of one layer in **one launch** (issue 23's "kernel at
    the floor"): :func:`split_kv_run`'s partials, with the merge done by the
    last chunk of each (request, KV head) to finish, and single-chunk
    requests written straight to ``out``. Same plan (:func:`split_kv_plan`'s
    ``chunk``), same workspaces, plus ``counters``
    (:func:`split_kv_fused_counters`, zero before and after every launch).

    Args: as :func:`split_kv_run` (no ``nsplit``: the kernel derives it from
        ``chunk``), and ``counters``: ``[>= batch * kv_heads]`` int32;
        ``order``: optional ``[batch]`` int32 permutation of the requests in
        launch order (:func:`longest_first`); the output does not depend on it.
        ``v_indices``: optional, as ``kv_indices``: V of entry ``i`` at row ``v_indices[i]`` of
        ``v_buffer`` (K at ``kv_indices[i]``; the KV offload's all-dense step, whose kept V rows
        are not its K slots: ``sglang_elastic.offload.keep``). ``pdl``: programmatic dependent
        launch where supported (:func:`pdl_supported`): the launch overlaps the kernel before it.
        ``merge_tile``: ``(BLOCK_GM, BLOCK_S)`` instead of :func:`fused_merge_tile`'s (benchmarks' A/B:
        ``scripts/gpu/bench_decode.py`` times the old ``(16, 8)`` beside it); int powers of two, ``BLOCK_GM`` >= the
        group, at most 256 rows a step.

    Returns:
        ``out``; requests of length 0 get zeros.

    Raises:
        ValueError: as :func:`split_kv_run`, or ``counters`` too small or not int32, or ``v_indices``
            of another dtype or device than ``kv_indices``, or a ``merge_tile`` that is not two int powers of
            two with ``BLOCK_GM`` >= the group and at most 256 rows a step.
    """
    B, Hq, Hkv, D, G, BLOCK_G, BLOCK_D = _shape_args(q, k_buffer)
    _check_run_args(q, k_buffer, v_buffer, out, mid_o, mid_lse, B * max_splits)
    block_gm, block_s = fused_merge_tile(G) if merge_tile is None else merge_tile
    if not (all(isinstance(x, int) and x >= 1 and x & (x - 1) == 0 for x in (block_gm, block_s)) and block_gm >= G
            and block_gm * block_s <= 256):
        raise ValueError(f"merge_tile must be two powers of two (BLOCK_GM, BLOCK_S) with BLOCK_GM >= the group {G} and "
                         f"BLOCK_GM * BLOCK_S <= 256, not {merge_tile}")
    if counters.dtype != torch.int32 or counters.numel() < B * Hkv or counters.device != q.device:
        raise ValueError(f"counters must be int32 with >= batch * kv_heads = {B * Hkv} entries on {q.device}, "
                         f"not {counters.dtype} with {counters.numel()} on {counters.device}")
    if v_indices is not None and (v_indices.dtype != kv_indices.dtype or v_indices.device != kv_indices.device):
        raise ValueError(f"v_indices must match kv_indices ({kv_indices.dtype} on {kv_indices.device}), "
                         f"not {v_indices.dtype} on {v_indices.device}")
    if B == 0:
        return out
    sm_scale = sm_scale if sm_scale is not None else D ** -0.5
    _split_fused_kernel[(B, Hkv, max_splits)](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, chunk, mid_o, mid_lse, out, counters, sm_scale,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_lse.stride(0), out.stride(0), out.stride(1), max_splits, Hkv,
        order if order is not None else chunk,
        G=G, BLOCK_G=BLOCK_G, D=D, BLOCK_D=BLOCK_D, BLOCK_N=block_n, DOT_F32=_dot_f32(q), BLOCK_S=block_s, BLOCK_GM=block_gm,
        ORDERED=order is not None,
        vidx_ptr=v_indices, SEP_V=v_indices is not None, **_launch_opts(num_warps, num_stages), **_pdl_opts(pdl, q.device),
    )
    return out


def work_queue_plan(
    kv_indptr: torch.Tensor, chunk: Optional[int] = None, target_items: Optional[int] = None, min_chunk: int = 256,
    block_n: int = 32, chunk_out: Optional[torch.Tensor] = None, item_offsets_out: Optional[torch.Tensor] = None,
    n_items_out: Optional[torch.Tensor] = None, capacity: Optional[int] = None,
):
    """The dense ``(request, chunk)`` item list of :func:`work_queue_run` (GPU ops only, no host read).

    Either a fixed ``chunk`` (tokens, a multiple of ``block_n``) or a
    ``target_items`` count: then the chunk is chosen on the GPU as
    ``max(min_chunk, round_up(ceil(sum(lens) / target_items), block_n))``
    (equal work per item, LeanAttention / FlashInfer's holistic plan), so
    the list never holds more than ``target_items + batch`` items: size the
    workspaces with :func:`work_queue_capacity`.

    ``capacity`` (rows of the workspaces :func:`work_queue_run` will get): the
    chunk is raised on the GPU, where needed, to at least
    ``round_up(ceil(sum(lens) / (capacity - batch)), block_n)``, so the list
    fits (``sum(ceil(len / c)) <= sum(lens) / c + batch <= capacity``) whatever
    the lengths; no op is added when ``target_items + batch <= capacity``
    already guarantees it.

    Returns:
        ``(chunk, item_offsets, n_items)``: ``[1]`` int32 tokens per item,
        ``[batch + 1]`` int32 exclusive prefix sum of the per-request item
        counts (its last entry is the total), ``[batch]`` int32 items per request.

    Raises:
        ValueError: when neither or both of ``chunk`` / ``target_items`` are given,
        ``chunk`` is not a multiple of ``block_n``, or ``capacity`` is not above
        the batch size (no chunk fits such a workspace).
    """
    if (chunk is None) == (target_items is None):
        raise ValueError("give exactly one of chunk (fixed tokens per item) or target_items (chunk chosen on the GPU)")
    B = kv_indptr.shape[0] - 1
    dev = kv_indptr.device
    lens = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int32)
    if capacity is not None and capacity <= B:
        raise ValueError(f"capacity {capacity} rows cannot hold a work-queue list for {B} requests (need more than {B})")
    if chunk is not None:
        if chunk % block_n:
            raise ValueError(f"chunk {chunk} must be a multiple of block_n {block_n}")
        c = torch.full((1,), chunk, dtype=torch.int32, device=dev)
    else:
        total = lens.sum().reshape(1).to(torch.int32)
        c = (total + target_items - 1) // target_items
        c = torch.clamp((c + block_n - 1) // block_n * block_n, min=max(min_chunk, block_n)).to(torch.int32)
    if capacity is not None and (target_items is None or target_items + B > capacity):
        free = capacity - B
        fit = (lens.sum().reshape(1).to(torch.int32) + free - 1) // free
        c = torch.maximum(c, (fit + block_n - 1) // block_n * block_n).to(torch.int32)
    if chunk_out is not None:
        chunk_out[:1].copy_(c)
        c = chunk_out[:1]
    n_items = ((lens + c - 1) // c).to(torch.int32)
    if n_items_out is not None:
        n_items_out[:B].copy_(n_items)
        n_items = n_items_out[:B]
    if item_offsets_out is None:
        item_offsets = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    else:
        item_offsets = item_offsets_out[: B + 1]
        item_offsets[:1].zero_()
    torch.cumsum(n_items, 0, out=item_offsets[1:])
    return c, item_offsets, n_items


def work_queue_capacity(batch: int, target_items: int) -> int:
    """Workspace rows :func:`work_queue_plan` with ``target_items`` can fill for ``batch`` requests."""
    return target_items + batch


def work_queue_run(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
    chunk: torch.Tensor, item_offsets: torch.Tensor, n_items: torch.Tensor, mid_o: torch.Tensor, mid_lse: torch.Tensor,
    out: torch.Tensor, programs: int = 132, sm_scale: Optional[float] = None, block_n: int = 32,
    num_warps: Optional[int] = None, num_stages: Optional[int] = None, pdl: bool = False,
) -> torch.Tensor:
    """Compact work-queue decode of one layer from a :func:`work_queue_plan`
    (``pdl`` as in :func:`split_kv_run`).

    Args:
        chunk, item_offsets, n_items: the plan's tensors (``item_offsets[batch]`` is the item count).
        mid_o: ``[capacity, q_heads, head_dim]`` float32 workspace; ``mid_lse``: ``[capacity, q_heads]``.
            Plan within it (:func:`work_queue_plan` with ``capacity``): the item
            count lives on the GPU, so a list longer than the workspace cannot be
            refused here; its items past ``capacity`` are not computed and the
            requests they belong to get NaN rows (never a read past the
            workspace, never a silently partial sum).
        programs: persistent programs per KV head (e.g. the SM count).

    Returns:
        ``out`` (``[batch, q_heads, head_dim]``).

    Raises:
        ValueError: as :func:`split_kv_run`; workspaces with fewer rows than
        ``batch`` (one item per request does not fit).
    """
    B, Hq, Hkv, D, G, BLOCK_G, BLOCK_D = _shape_args(q, k_buffer)
    capacity = _check_run_args(q, k_buffer, v_buffer, out, mid_o, mid_lse, B)
    if B == 0:
        return out
    sm_scale = sm_scale if sm_scale is not None else D ** -0.5
    opts = _launch_opts(num_warps, num_stages)
    pdl_opts = _pdl_opts(pdl, q.device)
    num_items = item_offsets[B:]
    _queue_kernel[(programs, Hkv)](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, item_offsets, num_items, chunk, mid_o, mid_lse, sm_scale, B, capacity,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_lse.stride(0),
        LOG2_BATCH=max(0, math.ceil(math.log2(max(B, 1)))),
        G=G, BLOCK_G=BLOCK_G, D=D, BLOCK_D=BLOCK_D, BLOCK_N=block_n, DOT_F32=_dot_f32(q), **opts, **pdl_opts,
    )
    _merge_kernel[(B, Hq)](
        mid_o, mid_lse, item_offsets, n_items, out,
        mid_o.stride(0), mid_o.stride(1), mid_lse.stride(0), out.stride(0), out.stride(1), 1,
        D=D, BLOCK_D=BLOCK_D, SEGMENTED=True, BLOCK_S=MERGE_BLOCK_S, **pdl_opts, max_rows=capacity, GUARD_ROWS=True,
    )
    return out


# ---------------------------------------------------------------------------
# one-call forms (allocate their workspaces; tests, scripts)
# ---------------------------------------------------------------------------


def split_kv_decode(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
    sm_scale: Optional[float] = None, max_splits: int = 32, min_chunk: int = 256, block_n: int = 32, out: Optional[torch.Tensor] = None,
    num_warps: Optional[int] = None, num_stages: Optional[int] = None, pdl: bool = False,
) -> torch.Tensor:
    """Split-KV decode attention over SGLang's paged KV layout (plan + run in one call).

    Args:
        q: ``[batch, q_heads, head_dim]`` bf16/fp16, one query token per request.
        k_buffer, v_buffer: ``[slots, kv_heads, head_dim]``, same dtype (one layer).
        kv_indptr: ``[batch + 1]`` int32/int64 offsets into ``kv_indices``.
        kv_indices: ``[total]`` int32/int64 slot ids (token ids, any page size).
        sm_scale: softmax scale (default ``head_dim ** -0.5``).
        max_splits: the most chunks per request (the grid's third dimension).
        min_chunk: the smallest chunk in tokens; a request gets
            ``min(max_splits, ceil(len / min_chunk))`` chunks.
        out: optional ``[batch, q_heads, head_dim]`` output buffer.
        pdl: programmatic dependent launch where supported (:func:`split_kv_run`).

    Returns:
        ``[batch, q_heads, head_dim]`` in ``q``'s dtype; requests of length 0 get zeros.

    Raises:
        ValueError: when ``q_heads`` is not a multiple of ``kv_heads``.
    """
    B, Hq, Hkv, D, G, BLOCK_G, BLOCK_D = _shape_args(q, k_buffer)
    chunk, nsplit = split_kv_plan(kv_indptr, max_splits, min_chunk, block_n)
    mid_o = torch.empty((B * max_splits, Hq, D), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((B * max_splits, Hq), dtype=torch.float32, device=q.device)
    o = out if out is not None else torch.empty_like(q)
    return split_kv_run(q, k_buffer, v_buffer, kv_indptr, kv_indices, chunk, nsplit, max_splits, mid_o, mid_lse, o,
                        sm_scale, block_n, num_warps, num_stages, pdl)


def work_queue_decode(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
    sm_scale: Optional[float] = None, chunk: int = 512, max_items: Optional[int] = None, programs: int = 132, block_n: int = 32,
    out: Optional[torch.Tensor] = None, num_warps: Optional[int] = None, num_stages: Optional[int] = None, pdl: bool = False,
) -> torch.Tensor:
    """Compact work-queue decode attention (arguments as :func:`split_kv_decode`).

    Args:
        chunk: tokens per work item (a multiple of ``block_n``).
        max_items: capacity of the item list; default ``sum(ceil(len / chunk))``
            computed from the lengths (a host read: pass it to keep the call
            sync-free and CUDA-graph safe). When the lengths need more items,
            the chunk grows on the GPU until they fit (:func:`work_queue_plan`'s
            ``capacity``); it must exceed the batch size.
        programs: persistent programs per KV head (e.g. the SM count).

    Returns:
        ``[batch, q_heads, head_dim]`` in ``q``'s dtype.

    Raises:
        ValueError: when ``chunk`` is not a multiple of ``block_n``, ``max_items``
        is not above the batch size, or an input check of :func:`work_queue_run` fails.
    """
    B, Hq, Hkv, D, G, BLOCK_G, BLOCK_D = _shape_args(q, k_buffer)
    if max_items is None:
        c, item_offsets, n_items = work_queue_plan(kv_indptr, chunk=chunk, block_n=block_n)
        max_items = max(1, B, int(n_items.sum()))
    else:
        c, item_offsets, n_items = work_queue_plan(kv_indptr, chunk=chunk, block_n=block_n, capacity=max_items)
    mid_o = torch.empty((max_items, Hq, D), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((max_items, Hq), dtype=torch.float32, device=q.device)
    o = out if out is not None else torch.empty_like(q)
    return work_queue_run(q, k_buffer, v_buffer, kv_indptr, kv_indices, c, item_offsets, n_items, mid_o, mid_lse, o,
                          programs, sm_scale, block_n, num_warps, num_stages, pdl)
