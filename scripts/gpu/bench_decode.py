"""Decode attention on the H200: ours (split-KV, compact work queue) against
FlashInfer (tensor-core decode as SGLang runs it, and the persistent
``BatchAttention``) and SGLang's Triton decode; fits the policy's calibration.

One command (about 1-2 minutes of GPU time when FlashInfer's kernels are in
its JIT cache; its first compile can add a minute or two):

    python scripts/gpu/bench_decode.py --out docs/results/decode_h200.json \\
        --calibration-out sglang_elastic/attention/calibration/h200.json [--sweep]

Shape: Hq=32, Hkv=8, d=128, bf16, a 1M-token pool (2 GiB each of K and V),
requests' KV scattered over it at page 16 (random pages) and page 1 (random
tokens). Every timing is one layer's decode attention replayed from a CUDA
graph, the median of ``triton.testing.do_bench``'s loop
(:func:`sglang_elastic.attention.bench.bench_us`) under two 256 MB L2 flushes
between replays (the H200's L2 is 60 MB): ``write`` (do_bench's zeroing, the
``*_us`` columns) and ``read`` (a streaming read: ``read_flush_us``), each
with its own size-matched read floor; plans (ours: ``*_plan``; FlashInfer:
``plan()``) run outside the timed graph, as SGLang runs them once per step
for all layers (ours also timed alone: ``ours_*_plan_us``).

- FlashInfer tensor-core: ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True,
  use_cuda_graph=True)`` with page_size 1 and token ids, as SGLang's FlashInfer
  backend plans it (``flashinfer_backend.py``, ``call_begin_forward``).
- FlashInfer persistent: ``flashinfer.BatchAttention`` with the real page
  size (the anchors doc's "persistent" column); timed eager if its run cannot
  be captured (``notes``).
- SGLang Triton: ``decode_attention_fwd`` with ``max_kv_splits=8`` (SGLang's
  default) and ``get_num_kv_splits_triton`` as the Triton backend runs them.
- Streaming-read reference (``stream_read_tbps``, as the anchors doc
  measures it): the best of 18 Triton grid-stride read configs over 4 GiB,
  and ``torch.sum``; the faster counts (both in ``notes.stream_read``). Per
  case, ``read_floor_us``: a contiguous read of the case's K and V bytes
  with that config, timed like the cases: no decode step can beat it.
- Correctness: each output against FlashInfer tensor-core's (relative
  Frobenius error ``rel_err_vs_flashinfer``, and ``max_abs_err_vs_flashinfer``);
  exits 1 if ours exceed 1e-2 relative.
- ``--sweep``: first times a grid of kernel configs around the shipped ones
  (split: half, same and double the ``min_chunk``, ``max_splits`` and
  ``block_n``, ``num_warps`` 4/8, ``num_stages`` 2/3/4: up to 162; compact:
  half/same/double ``target_items``, ``min_chunk`` and ``block_n``,
  ``programs`` 1-2 per SM, ``num_warps`` 4/8: up to 108) on four cases at
  page 16 (about 2-5 min with Triton's compiles; configs Triton cannot
  compile are recorded and skipped), keeps the best geometric mean, then
  times each best config beside its twin with programmatic dependent launch
  flipped (``pdl``; Hopper and later), three rounds back to back, and keeps
  the twin only if its median is 1 % faster and its outputs bit-equal;
  writes the result into the calibration (the backend launches with it).
  Each run starts where the last ended: repeated sweeps climb to a local
  optimum.

The calibration is fitted to this run's timings (all rows) by
:func:`sglang_elastic.attention.calibrate.fit_calibration`; ``policy_*``
columns use it (in-sample), ``policy_shipped_*`` the calibration the package
shipped before the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import sys
import time

import torch
import triton

from sglang_elastic import results
from sglang_elastic.attention import bench
from sglang_elastic.attention.calibrate import fit_calibration
from sglang_elastic.attention.policy import DecodePolicy, load_calibration, split_max_splits, split_min_chunk, work_queue_rows
from sglang_elastic.kernels import decode_attention
from sglang_elastic.kernels.decode_attention import pdl_supported

HQ, HKV, D = bench.SHAPE["q_heads"], bench.SHAPE["kv_heads"], bench.SHAPE["head_dim"]
POOL = 1 << 20
DT = torch.bfloat16
SCALE = D**-0.5


_FLUSH = {}


def flushers():
    """``{flush: fn}`` of :data:`bench.FLUSHES` over one 256 MB buffer: ``write``
    zeroes it (``triton.testing.do_bench``'s ``clear_cache``), ``read`` streams
    it through the read-floor kernel (clean L2 lines)."""
    if not _FLUSH:
        buf = torch.empty(256 << 20 >> 2, dtype=torch.int32, device="cuda").fill_(1)
        sm = torch.cuda.get_device_properties(0).multi_processor_count
        out = torch.empty(4 * sm, dtype=torch.float32, device="cuda")
        _FLUSH["write"] = buf.zero_
        _FLUSH["read"] = lambda: bench.stream_read(buf, out, 4 * sm, 4096, 4)
    return _FLUSH


def timed(fn, flush: str) -> float:
    return bench.bench_us(fn, flushers()[flush], warmup_ms=10, rep_ms=60)


def graph_us_both(fn) -> dict:
    """``{flush: median us}`` of ``fn`` replayed from one CUDA graph, L2 flushed
    between replays by each of :data:`bench.FLUSHES`."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return {f: timed(g.replay, f) for f in bench.FLUSHES}


def graph_us(fn) -> float:
    """Median us of ``fn`` replayed from a CUDA graph, write flush (the sweep's timing)."""
    return graph_us_both(fn)["write"]


def eager_us_both(fn) -> dict:
    return {f: timed(fn, f) for f in bench.FLUSHES}


def eager_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def stream_read_tbps():
    """The streaming-read reference, as the anchors doc measures it: the best
    of :data:`bench.STREAM_CONFIGS` for a Triton read of 4 GiB of bf16, and
    ``torch.sum`` over the same (the buffer is freed on return).

    Returns:
        ``(tbps, info)``: the faster of the two in TB/s, and ``{torch_sum_tbps,
        triton_tbps, triton_config: {block, num_warps, programs}}``.
    """
    n = 2 << 30  # elements: 4 GiB
    x = torch.empty(n, dtype=DT, device="cuda").normal_()
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(8 * sm, dtype=torch.float32, device="cuda")
    tb = lambda us: 2 * n / (us * 1e-6) / 1e12  # noqa: E731
    torch_sum = tb(eager_us(lambda: x.sum()))
    best, cfg = 0.0, None
    for block, warps, per_sm in bench.STREAM_CONFIGS:
        r = tb(eager_us(lambda: bench.stream_read(x, out, per_sm * sm, block, warps)))
        if r > best:
            best, cfg = r, {"block": block, "num_warps": warps, "programs": per_sm * sm}
    del x
    torch.cuda.empty_cache()
    return max(best, torch_sum), {"torch_sum_tbps": torch_sum, "triton_tbps": best, "triton_config": cfg}


def read_floor_us(nbytes: int, buf: torch.Tensor, out: torch.Tensor, cfg: dict) -> dict:
    """Size-matched read floor per flush: a contiguous streaming read of
    ``nbytes`` (the case's K and V bytes) with the best streaming config,
    timed as the cases are (CUDA-graph replay, each flush). A decode step
    cannot beat it."""
    x = buf[: nbytes // buf.element_size()]
    return graph_us_both(lambda: bench.stream_read(x, out, cfg["programs"], cfg["block"], cfg["num_warps"]))


_XQA_WS = []


def _xqa_workspace():
    """XQA's workspace: zeroed once before its first use (FlashInfer's requirement), then reused."""
    if not _XQA_WS:
        _XQA_WS.append(torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda"))
    return _XQA_WS[0]


def fa3_fn(fa3, q, k, v, lens, page_size, page_idx, page_indptr):
    """FA3's paged decode (``flash_attn_with_kvcache``, ``num_splits=0``: its own split heuristic) over the same pages."""
    B = len(lens)
    n_pages = [-(-n // page_size) for n in lens]
    table = torch.zeros(B, max(n_pages), dtype=torch.int32, device="cuda")
    for b in range(B):
        table[b, : n_pages[b]] = page_idx[page_indptr[b]: page_indptr[b + 1]]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kp, vp = k.view(-1, page_size, HKV, D), v.view(-1, page_size, HKV, D)
    q4 = q.view(B, 1, HQ, D)
    return lambda: fa3(q4, kp, vp, cache_seqlens=seqlens, page_table=table, softmax_scale=SCALE, causal=True, num_splits=0)


def make_indices(lens, page_size, g):
    """CSR token ids scattered at page granularity, and the page ids (page_size > 1)."""
    n_units = POOL // page_size
    units = torch.randperm(n_units - 1, device="cuda", generator=g) + 1  # unit 0 stays unused (SGLang's padding slot)
    tok, pages, used = [], [], 0
    for n in lens:
        need = -(-n // page_size)
        u = units[used: used + need]
        used += need
        pages.append(u)
        tok.append((u[:, None] * page_size + torch.arange(page_size, device="cuda")).flatten()[:n])
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device="cuda")
    indptr[1:] = torch.cumsum(torch.tensor(lens, device="cuda"), 0)
    page_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device="cuda")
    page_indptr[1:] = torch.cumsum(torch.tensor([-(-n // page_size) for n in lens], device="cuda"), 0)
    return indptr, torch.cat(tok).to(torch.int32), page_indptr, torch.cat(pages).to(torch.int32)


class Ours:
    """Our two paths with the backend's workspaces and configs (``kernels``: the
    kernel module, default the installed one; ``bench_decode_ab.py`` passes an
    earlier version's)."""

    def __init__(self, calib, max_bs=256, kernels=decode_attention):
        self.calib, self.k = calib, kernels
        rows = max(calib.split.partial_budget, max_bs, work_queue_rows(calib.compact, max_bs))
        self.mid_o = torch.empty((rows, HQ, D), dtype=torch.float32, device="cuda")
        self.mid_lse = torch.empty((rows, HQ), dtype=torch.float32, device="cuda")
        self.sc = torch.zeros(max_bs, dtype=torch.int32, device="cuda")
        self.sn = torch.zeros(max_bs, dtype=torch.int32, device="cuda")
        self.qc = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.qo = torch.zeros(max_bs + 1, dtype=torch.int32, device="cuda")
        self.qn = torch.zeros(max_bs, dtype=torch.int32, device="cuda")
        self.counters = kernels.split_kv_fused_counters(max_bs, HKV, "cuda") if hasattr(kernels, "split_kv_fused_counters") else None
        self.order = torch.zeros(max_bs, dtype=torch.int32, device="cuda")

    def plan(self, path, indptr, min_chunk=None):
        """``min_chunk`` (split): the plan's minimum chunk instead of the calibration's rule (the A/B of its large-batch one)."""
        B = indptr.shape[0] - 1
        if path == "split":
            c = self.calib.split
            mc = split_min_chunk(c, B) if min_chunk is None else min_chunk
            self.k.split_kv_plan(indptr, split_max_splits(c, B), mc, c.block_n, self.sc, self.sn)
        else:
            c = self.calib.compact
            self.k.work_queue_plan(indptr, target_items=c.target_items, min_chunk=c.min_chunk, block_n=c.block_n,
                                   chunk_out=self.qc, item_offsets_out=self.qo, n_items_out=self.qn)

    def run(self, path, q, k, v, indptr, idx, out):
        B = q.shape[0]
        if path == "split":
            c = self.calib.split
            return self.k.split_kv_run(q, k, v, indptr, idx, self.sc[:B], self.sn[:B], split_max_splits(c, B), self.mid_o, self.mid_lse,
                                       out, SCALE, c.block_n, c.num_warps, c.num_stages, c.pdl)
        c = self.calib.compact
        return self.k.work_queue_run(q, k, v, indptr, idx, self.qc, self.qo[: B + 1], self.qn[:B], self.mid_o, self.mid_lse, out,
                                     c.programs or torch.cuda.get_device_properties(0).multi_processor_count, SCALE, c.block_n,
                                     c.num_warps, c.num_stages, c.pdl)


    def plan_fused(self, indptr):
        """The split plan and the launch order (longest requests first), once per step."""
        self.plan("split", indptr)
        self.k.longest_first(indptr, out=self.order)

    def run_fused(self, q, k, v, indptr, idx, out, merge_tile=None):
        """The split path in one launch (``split_kv_fused_run``: the last chunk merges), on :meth:`plan_fused`'s plan;
        ``merge_tile``: the merge's ``(BLOCK_GM, BLOCK_S)`` instead of the shipped one (the A/B of the old tile)."""
        B = q.shape[0]
        c = self.calib.split
        order = self.order[:B]
        extra = {} if merge_tile is None else {"merge_tile": merge_tile}
        return self.k.split_kv_fused_run(q, k, v, indptr, idx, self.sc[:B], split_max_splits(c, B), self.mid_o, self.mid_lse, out,
                                         self.counters, SCALE, c.block_n, c.num_warps, c.num_stages, order=order, **extra)


def rel_err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def run_case(case, page_size, k, v, ours, fi_ws, g, notes):
    """One case at one page size: ``(row, read-flush timings, FA3 timings or None)``."""
    import flashinfer
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton

    lens = case["lens"]
    B = len(lens)
    indptr, idx, page_indptr, page_idx = make_indices(lens, page_size, g)
    q = torch.randn(B, HQ, D, device="cuda", dtype=DT, generator=g)
    t, outs, tr = {}, {}, {}  # write flush, outputs, read flush

    def both(col, fn, eager=False):
        r = (eager_us_both if eager else graph_us_both)(fn)
        t[col], tr[col] = r["write"], r["read"]

    # FlashInfer tensor-core decode, planned as SGLang plans it (page_size 1, token ids)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        fi_ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=torch.empty_like(indptr),
        paged_kv_indices_buffer=torch.empty_like(idx), paged_kv_last_page_len_buffer=torch.ones(B, dtype=torch.int32, device="cuda"))
    w.plan(indptr, idx, torch.ones(B, dtype=torch.int32, device="cuda"), HQ, HKV, D, 1, q_data_type=DT, kv_data_type=DT, sm_scale=SCALE)
    kv1 = (k.view(-1, 1, HKV, D), v.view(-1, 1, HKV, D))
    outs["flashinfer"] = torch.empty_like(q)
    both("flashinfer_us", lambda: w.run(q, kv1, out=outs["flashinfer"]))
    ref = outs["flashinfer"]

    # FlashInfer persistent (holistic) BatchAttention at the real page size
    try:
        ba = flashinfer.BatchAttention(kv_layout="NHD")
        ba.plan(torch.arange(B + 1, dtype=torch.int32, device="cuda"), page_indptr, page_idx, torch.tensor(lens, dtype=torch.int32, device="cuda"),
                HQ, HKV, D, D, page_size, causal=False, sm_scale=SCALE, q_data_type=DT, kv_data_type=DT)
        kvp = (k.view(-1, page_size, HKV, D), v.view(-1, page_size, HKV, D))
        po = torch.empty_like(q)
        plse = torch.empty(B, HQ, dtype=torch.float32, device="cuda")
        fn = lambda: ba.run(q, kvp, out=po, lse=plse)  # noqa: E731
        try:
            both("flashinfer_persistent_us", fn)
        except Exception as e:  # noqa: BLE001
            torch.cuda.synchronize()
            notes.setdefault("persistent_eager", []).append(f"{case['name']} p{page_size}: {type(e).__name__}")
            both("flashinfer_persistent_us", fn, eager=True)
        outs["flashinfer_persistent"] = po
    except Exception as e:  # noqa: BLE001
        notes.setdefault("persistent_failed", []).append(f"{case['name']} p{page_size}: {type(e).__name__}: {str(e)[:200]}")
        t["flashinfer_persistent_us"] = None

    # FlashInfer's XQA decode (issue 23 build 3: plan-free, one kernel; a policy-path candidate): block tables of the case's pages
    try:
        from flashinfer.decode import xqa_batch_decode_with_kv_cache

        n_pages = [int(page_indptr[i + 1] - page_indptr[i]) for i in range(B)]
        table = torch.zeros(B, max(n_pages), dtype=torch.int32, device="cuda")
        for i in range(B):
            table[i, : n_pages[i]] = page_idx[int(page_indptr[i]): int(page_indptr[i + 1])]
        xo = torch.empty_like(q)
        xlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        kvx = (k.view(-1, page_size, HKV, D), v.view(-1, page_size, HKV, D))
        xws = _xqa_workspace()
        fn = lambda: xqa_batch_decode_with_kv_cache(q, kvx, xws, table, xlens, max(lens), bmm1_scale=SCALE, bmm2_scale=1.0, out=xo)  # noqa: E731
        fn()
        both("flashinfer_xqa_us", fn)
        outs["flashinfer_xqa"] = xo
    except Exception as e:  # noqa: BLE001 - a page size / group it has no kernel for: recorded, no column
        torch.cuda.synchronize()
        notes.setdefault("xqa_failed", []).append(f"{case['name']} p{page_size}: {type(e).__name__}: {str(e)[:200]}")

    # SGLang's Triton decode (max_kv_splits 8, splits from get_num_kv_splits_triton as the backend computes them)
    max_kv_splits = 8
    logits = torch.empty(B, HQ, max_kv_splits, D, dtype=torch.float32, device="cuda")
    lse = torch.empty(B, HQ, max_kv_splits, dtype=torch.float32, device="cuda")
    nsplits = torch.empty(B, dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int64, device="cuda")
    get_num_kv_splits_triton[(1,)](nsplits, seq_lens, B, 1, HQ, HKV, max_kv_splits, torch.cuda.get_device_properties(0).multi_processor_count,
                                   MAX_NUM_SEQ=max(256, triton.next_power_of_2(B)))
    idx64 = idx.long()
    to = torch.empty_like(q)
    both("sglang_triton_us", lambda: decode_attention_fwd(q, k, v, to, indptr, idx64, logits, lse, nsplits, max_kv_splits, SCALE, 1.0, 1.0))

    # FA3 (PyPI tokenspeed-fa3) where it imports: SGLang's default decode backend on the H200
    fa3 = bench.fa3_decode()
    fa3_t = None
    if fa3 is not None:
        try:
            fn = fa3_fn(fa3, q, k, v, lens, page_size, page_idx, page_indptr)
            o = fn()
            outs["fa3"] = (o[0] if isinstance(o, (tuple, list)) else o).reshape(B, HQ, D)
            fa3_t = graph_us_both(fn)
        except Exception as e:  # noqa: BLE001 - a build without this page size / head_dim: recorded, no column
            torch.cuda.synchronize()
            notes.setdefault("fa3_failed", []).append(f"{case['name']} p{page_size}: {type(e).__name__}: {str(e)[:160]}")
    outs["sglang_triton"] = to

    # ours: plan once (outside the timed graph, as per step), run per layer
    for path in ("split", "compact"):
        ours.plan(path, indptr)
        o = torch.empty_like(q)
        both(f"ours_{path}_us", lambda: ours.run(path, q, k, v, indptr, idx, o))
        outs[f"ours_{path}"] = o
        t[f"ours_{path}_plan_us"] = graph_us(lambda: ours.plan(path, indptr))
    sc = ours.calib.split
    if sc.min_chunk_large and B >= sc.large_batch and split_min_chunk(sc, B) != sc.min_chunk:
        # the same-host A/B of the large-batch minimum chunk: split planned with the small-batch one (min_chunk_large off)
        ours.plan("split", indptr, min_chunk=sc.min_chunk)
        o = torch.empty_like(q)
        both("ours_split_small_chunk_us", lambda: ours.run("split", q, k, v, indptr, idx, o))
        outs["ours_split_small_chunk"] = o
    if ours.counters is not None:  # issue 23 Build 2: one launch per layer, beside the two-launch split (not a policy path yet)
        ours.plan_fused(indptr)  # outside the timed graph, as the plan is
        o = torch.empty_like(q)
        both("ours_split_fused_us", lambda: ours.run_fused(q, k, v, indptr, idx, o))
        outs["ours_split_fused"] = o
        if hasattr(ours.k, "fused_merge_tile"):  # the merge's old tile, [8, 16, D] (two CTAs an SM on Hopper), same host and case
            o2 = torch.empty_like(q)
            both("ours_split_fused_wide_merge_us", lambda: ours.run_fused(q, k, v, indptr, idx, o2, merge_tile=(16, 8)))
            outs["ours_split_fused_wide_merge"] = o2
    errs = {name: rel_err(o, ref) for name, o in outs.items() if name != "flashinfer"}
    row = bench.make_row(case, page_size, {c: t.get(c) for c in bench.METHODS}, errs)
    if "ours_split_fused_us" in t:
        row["ours_split_fused_us"], row["ours_split_fused_read_us"] = t["ours_split_fused_us"], tr["ours_split_fused_us"]
    if "ours_split_fused_wide_merge_us" in t:
        row["ours_split_fused_wide_merge_us"] = t["ours_split_fused_wide_merge_us"]
        row["ours_split_fused_wide_merge_read_us"] = tr["ours_split_fused_wide_merge_us"]
    if "flashinfer_xqa_us" in t:  # build 3: FlashInfer's XQA decode beside the policy's paths (not one of them yet)
        row["flashinfer_xqa_us"], row["flashinfer_xqa_read_us"] = t["flashinfer_xqa_us"], tr["flashinfer_xqa_us"]
    if "ours_split_small_chunk_us" in t:  # min_chunk_large off, same host and case: settles whether the large-batch chunk pays
        row["ours_split_small_chunk_us"], row["ours_split_small_chunk_read_us"] = t["ours_split_small_chunk_us"], tr["ours_split_small_chunk_us"]
    row["max_abs_err_vs_flashinfer"] = {name: (o.float() - ref.float()).abs().max().item() for name, o in outs.items() if name != "flashinfer"}
    row["ours_split_plan_us"], row["ours_compact_plan_us"] = t["ours_split_plan_us"], t["ours_compact_plan_us"]
    return row, {c: tr.get(c) for c in bench.METHODS}, fa3_t


def around(x: int, lo: int, hi: int) -> tuple:
    """``x / 2, x, 2 x`` (powers of two stay powers of two) within ``[lo, hi]``."""
    return tuple(sorted({min(hi, max(lo, int(y))) for y in (x // 2, x, x * 2)}))


def sweep(calib, k, v, g, notes):
    """Best split / compact kernel configs (geometric mean over four page-16 cases)."""
    cases = [c for c in bench.bench_cases() if c["name"] in ("B1_32K", "B8_2x64K_6x4K", "B32_zipf_1K-61K", "B64_8x32K_56x2K")]
    data = []
    for c in cases:
        indptr, idx, _, _ = make_indices(c["lens"], 16, g)
        data.append((indptr, idx, torch.randn(len(c["lens"]), HQ, D, device="cuda", dtype=DT, generator=g)))
    sm = torch.cuda.get_device_properties(0).multi_processor_count

    def score(cal, path, outs=None):
        ours = Ours(cal)
        ts = []
        for indptr, idx, q in data:
            ours.plan(path, indptr)
            o = torch.full_like(q, float("nan"))
            ts.append(graph_us(lambda: ours.run(path, q, k, v, indptr, idx, o)))
            if outs is not None:  # what the graph's last replay wrote
                outs.append(o.clone())
        return math.exp(sum(map(math.log, ts)) / len(ts))

    tried = {"split": [], "compact": []}
    sp, cp = calib.split, calib.compact
    best_split, best_s = sp, score(calib, "split")
    # a grid around the shipped configs (half, same, double): each run's sweep
    # starts where the last one ended, so repeated runs climb to a local optimum
    for mc, ms, bn, nw, ns in itertools.product(around(sp.min_chunk, 64, 8192), around(sp.max_splits, 4, 256), around(sp.block_n, 16, 256), (4, 8), (2, 3, 4)):
        if ms > calib.split.partial_budget:
            continue
        cfg = dataclasses.replace(calib.split, min_chunk=mc, max_splits=ms, block_n=bn, num_warps=nw, num_stages=ns)
        try:
            s = score(dataclasses.replace(calib, split=cfg), "split")
        except Exception as e:  # a config Triton cannot compile (shared memory): skipped, recorded
            tried["split"].append({**dataclasses.asdict(cfg), "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        tried["split"].append({**dataclasses.asdict(cfg), "geomean_us": s})
        if s < best_s:
            best_split, best_s = cfg, s
    best_compact, best_c = cp, score(calib, "compact")
    for ti, mc, pr, bn, nw in itertools.product(around(cp.target_items, 128, 16384), around(cp.min_chunk, 64, 8192), (sm, 2 * sm), around(cp.block_n, 16, 256), (4, 8)):
        cfg = dataclasses.replace(calib.compact, target_items=ti, min_chunk=mc, programs=pr, block_n=bn, num_warps=nw)
        try:
            s = score(dataclasses.replace(calib, compact=cfg), "compact")
        except Exception as e:
            tried["compact"].append({**dataclasses.asdict(cfg), "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        tried["compact"].append({**dataclasses.asdict(cfg), "geomean_us": s})
        if s < best_c:
            best_compact, best_c = cfg, s
    # then each best config against its twin with programmatic dependent launch
    # flipped (Hopper and later; the merge launches while the partials finish):
    # timed back to back over three rounds (the grid's best is a minimum of
    # noisy medians: re-timed here beside its twin), the twin kept only if its
    # median is 1 % faster and its outputs are bit-equal
    if pdl_supported(torch.device("cuda")):
        for path in ("split", "compact"):
            best = best_split if path == "split" else best_compact
            twin = dataclasses.replace(best, pdl=not best.pdl)
            try:
                t_best, t_twin, o_best, o_twin = [], [], [], []
                for r in range(3):
                    t_best.append(score(dataclasses.replace(calib, **{path: best}), path, o_best if r == 0 else None))
                    t_twin.append(score(dataclasses.replace(calib, **{path: twin}), path, o_twin if r == 0 else None))
            except Exception as e:  # a failed PDL compile or capture must not lose the sweep
                tried[path].append({**dataclasses.asdict(twin), "error": f"{type(e).__name__}: {str(e)[:120]}"})
                continue
            same = all(torch.equal(a, b) for a, b in zip(o_best, o_twin))
            mb, mt = statistics.median(t_best), statistics.median(t_twin)
            tried[path].append({**dataclasses.asdict(twin), "geomean_us": mt, "twin_of_best_geomean_us": mb, "outputs_bit_equal": same})
            if same and mt < 0.99 * mb:
                if path == "split":
                    best_split, best_s = twin, mt
                else:
                    best_compact, best_c = twin, mt
    notes["sweep"] = {"cases": [c["name"] for c in cases], "best_split_geomean_us": best_s, "best_compact_geomean_us": best_c,
                      "tried": {p: sweep_table(rows) for p, rows in tried.items()}}
    return dataclasses.replace(calib, split=best_split, compact=best_compact)


def sweep_table(rows):
    """The tried configs as one table, ``{"columns": [...], "rows": [[...], ...]}`` (a missing field: null):
    a dict per config took two thirds of the result file, which must stay small (one device transfer)."""
    cols = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    return {"columns": cols, "rows": [[r.get(c) for c in cols] for r in rows]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="result JSON (docs/results/decode_h200.json)")
    ap.add_argument("--calibration-out", required=True, help="fitted calibration JSON (sglang_elastic/attention/calibration/h200.json)")
    ap.add_argument("--sweep", action="store_true", help="sweep kernel configs first and record the best in the calibration")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    a = ap.parse_args()
    t0 = time.time()
    torch.manual_seed(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    notes = {"timing": "us per layer, CUDA-graph replay, do_bench's loop (bench.bench_us) median, 256 MB L2 flush between replays (write: *_us; read: read_flush_us); plans outside the graph",
             "flashinfer_us": "BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True, use_cuda_graph=True), page_size 1 token ids as SGLang plans it",
             "flashinfer_persistent_us": "flashinfer.BatchAttention at the case's page size",
             "flashinfer_xqa_us": ("flashinfer.decode.xqa_batch_decode_with_kv_cache (plan-free XQA) at the case's page size, block "
                                   "tables of its pages; a row without it: notes.xqa_failed says why"),
             "sglang_triton_us": "sglang.kernels.ops.attention.decode_attention.decode_attention_fwd, max_kv_splits 8",
             "policy": "policy_* from the calibration fitted to this run (in-sample); policy_shipped_* from the calibration shipped before it"}
    read, read_info = stream_read_tbps()
    notes["ours_split_small_chunk_us"] = ("batches of split.large_batch or more: split planned with split.min_chunk instead of "
                                          "split.min_chunk_large (the same-host A/B of the large-batch minimum chunk)")
    notes["stream_read"] = {**read_info, "how": "4 GiB bf16; the best Triton grid-stride read of bench.STREAM_CONFIGS and torch.sum; stream_read_tbps is the faster"}
    notes["read_floor_us"] = ("a contiguous read of the case's K and V bytes with the best streaming config, CUDA-graph replay, L2 flushed: the floor of a decode step; "
                              "read_floor_us under the write flush, read_floor_read_flush_us under the read flush")
    notes["flushes"] = ("every *_us column: write flush (do_bench's: zeroing 256 MB between replays, dirty L2 lines); read_flush_us: the same columns "
                        "with a streaming read of the 256 MB instead (clean lines); both timed by sglang_elastic.attention.bench.bench_us")
    notes["fa3_us"] = ("flash_attn_with_kvcache of PyPI tokenspeed-fa3, page table of the case's pages, num_splits=0" if bench.fa3_decode() is not None
                       else "FA3 (PyPI tokenspeed-fa3) did not import: no fa3_us column")
    print(f"stream read {read:.2f} TB/s ({json.dumps(read_info)})", flush=True)
    shipped = load_calibration()
    calib = shipped
    k = torch.randn(POOL, HKV, D, device="cuda", dtype=DT, generator=g)
    v = torch.randn(POOL, HKV, D, device="cuda", dtype=DT, generator=g)
    if a.sweep:
        calib = sweep(calib, k, v, g, notes)
        print(f"sweep: split {calib.split} compact {calib.compact} ({time.time() - t0:.0f} s)", flush=True)
    ours = Ours(calib)
    fi_ws = torch.empty(384 << 20, dtype=torch.uint8, device="cuda")  # SGLang's FlashInfer workspace size
    cases = bench.bench_cases()
    if a.cases:
        keep = set(a.cases.split(","))
        cases = [c for c in cases if c["name"] in keep]
    by_name = {c["name"]: c for c in cases}
    floor_buf = torch.empty(max(bench.kv_bytes(c["lens"]) for c in cases) // 2, dtype=DT, device="cuda").normal_()
    floor_out = torch.empty(read_info["triton_config"]["programs"], dtype=torch.float32, device="cuda")
    floors = {c["name"]: read_floor_us(bench.kv_bytes(c["lens"]), floor_buf, floor_out, read_info["triton_config"]) for c in cases}
    del floor_buf
    rows = []
    for page_size in bench.PAGE_SIZES:
        for c in cases:
            r, read_flush, fa3_t = run_case(c, page_size, k, v, ours, fi_ws, g, notes)
            bench.add_flush_columns(r, read_flush, floors[c["name"]], fa3_t)
            rows.append(r)
            e = r["rel_err_vs_flashinfer"]
            print(f"p{page_size:<2d} {c['name']:18s} split {r['ours_split_us']:7.1f} compact {r['ours_compact_us']:7.1f} | FI tc {r['flashinfer_us']:7.1f} "
                  f"persistent {r['flashinfer_persistent_us'] or float('nan'):7.1f} triton {r['sglang_triton_us']:7.1f} us | err split {e['ours_split']:.1e} "
                  f"compact {e['ours_compact']:.1e}", flush=True)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    fitted, fit_errs = fit_calibration(
        bench.calibration_timings(rows, by_name), gpu=torch.cuda.get_device_name(0), sm_count=sm, start=calib,
        source=f"scripts/gpu/bench_decode.py at commit {results.commit()}: every case, page 16 and 1, CUDA-graph replay",
        provisional=False, stream_read_tbps=read, shape=bench.calibration_shape(), **bench.SHAPE)
    results.write(a.calibration_out, fitted.to_json())  # with the fit's errors, capped and rounded as the loader takes them
    bench.fill_policy(rows, by_name, DecodePolicy(fitted, **bench.SHAPE))
    bench.fill_policy(rows, by_name, DecodePolicy(shipped, **bench.SHAPE), key="policy_shipped")
    notes["gpu_seconds"] = round(time.time() - t0, 1)
    res = bench.assemble(results.header(), read, rows, notes, {"path": a.calibration_out, "fit_rms_rel_err": fit_errs, "split": dataclasses.asdict(fitted.split), "compact": dataclasses.asdict(fitted.compact)})
    try:  # the live-server numbers (bench_decode_serving.sh) come from another run: keep them
        with open(a.out) as f:
            if "serving" in (prev := json.load(f)):
                res["serving"] = prev["serving"]
    except (OSError, ValueError):
        pass
    results.write(a.out, res)
    for r in rows:
        print(f"p{r['page_size']:<2d} {r['name']:18s} policy {r['policy_pick']:10s} {r['policy_us']:7.1f} us ({r['policy_read_tbps']:.2f} TB/s) vs FI tc {r['flashinfer_us']:7.1f}, read floor {r['read_floor_us']:7.1f}")
    print(f"fit rms rel err {json.dumps({p: round(x, 3) for p, x in fit_errs.items()})}; {time.time() - t0:.0f} s")
    bad = [(r["name"], r["page_size"], p) for r in rows for p in ("ours_split", "ours_compact") if not r["rel_err_vs_flashinfer"][p] <= 1e-2]
    if bad:
        print(f"relative error above 1e-2: {bad}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
