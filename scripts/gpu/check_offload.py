"""GPU correctness and per-kernel timings of the KV offload path (one H200).

1. Pinned host memory through ``device_view``: rows copied host -> device and
   device -> host by ``copy_rows_run`` are bit-exact; the bandwidth of a
   gather of 2 KiB rows from pinned memory.
2. The decode step (``OffloadDecoder``) on the Llama-3.1-8B head shape
   (32 q / 8 kv heads, d 128, bf16; the three softmax denominators) and
   SmolLM2-135M's (9 q / 3 kv, d 64; selected and estimate) over SGLang's ``MHATokenToKVPool``
   subclass: the host tier against the all-resident reference bit for bit,
   and both against the policy's float64 reference.
3. Per-kernel times of one sparse layer at a batch of 44 requests x 32K
   tokens (the issue's long-context workload): scores over all K, the radix
   top-k, the swap-in bookkeeping, the miss copy (cold: every row a miss;
   warm: the same selection again, every row a hit), the sparse attention,
   the prefetch of one layer (``OffloadDecoder.prefetch``, warm), the
   ``estimate`` pass (attended marks and chunk means, chunk 16); against
   split-KV over every position of the same layer (what a dense layer
   costs). CUDA-event timing, median of repeats, L2 not flushed (the
   per-layer working set is many times the L2). With each shape,
   ``--kv-offload-copy-timing``'s events inside a CUDA graph: the prefetch's
   copy beside a dense layer, the wait, the residual copy; the hidden share.

    python scripts/gpu/check_offload.py --out docs/results/offload_check_h200.json

Writes the result only when every check ran.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types

import torch

from sglang_elastic import results
from sglang_elastic.kernels import offload as ko
from sglang_elastic.kernels.decode_attention import split_kv_decode
from sglang_elastic.offload.decode import OffloadDecoder
from sglang_elastic.offload.host_pool import device_view
from sglang_elastic.offload.policy import OffloadPolicy, attend_reference
from sglang_elastic.offload.pool import HotState, OffloadKVPool, OffloadLayout

HQ, HKV, D = 32, 8, 128


def time_ms(fn, reps=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def check_pinned(out):
    g = torch.Generator(device="cuda").manual_seed(0)
    n_rows = 1 << 18
    host = torch.empty((n_rows, HKV, D), dtype=torch.bfloat16, pin_memory=True)
    host.copy_(torch.randn((n_rows, HKV, D), dtype=torch.bfloat16))
    view = device_view(host)
    assert view.is_cuda and view.data_ptr() != 0
    dev = torch.full((8192, HKV, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    src = torch.randperm(n_rows, device="cuda", generator=g)[:8192]
    ko.copy_rows_run(view, dev, src, None, n=8192)
    torch.cuda.synchronize()
    ok_h2d = torch.equal(dev.cpu(), host[src.cpu()])
    back = torch.zeros((n_rows, HKV, D), dtype=torch.bfloat16, pin_memory=True)
    ko.copy_rows_run(dev, device_view(back), None, src, n=8192)
    torch.cuda.synchronize()
    ok_d2h = torch.equal(back[src.cpu()], dev.cpu())
    ms = time_ms(lambda: ko.copy_rows_run(view, dev, src, None, n=8192))
    out["pinned"] = {"h2d_exact": ok_h2d, "d2h_exact": ok_d2h, "gather_rows": 8192, "row_bytes": HKV * D * 2,
                     "gather_ms": ms, "gather_gb_s": 8192 * HKV * D * 2 / ms / 1e6}
    assert ok_h2d and ok_d2h, out["pinned"]


def make_pool(policy, resident, size, rows, hot, ctx, layers, hkv=HKV, d=D):
    lay = OffloadLayout(policy, hot_tokens=hot, request_rows=rows, stage_tokens=ctx, resident_v=resident)
    return OffloadKVPool(size, 1, torch.bfloat16, hkv, d, layers, "cuda", False, enable_alt_stream=False, layout=lay, pin_memory=True)


EXACT_CASES = (  # (name, q heads, kv heads, head_dim, denominator)
    ("llama-3.1-8b", 32, 8, 128, "selected"),
    ("llama-3.1-8b", 32, 8, 128, "full"),
    ("llama-3.1-8b", 32, 8, 128, "estimate"),
    ("smollm2-135m", 9, 3, 64, "selected"),
    ("smollm2-135m", 9, 3, 64, "estimate"),
)


def check_exact(out):
    """Each of ``EXACT_CASES``: two layers (one dense, one sparse), 4 requests,
    prompts up to 5K, 6 decode steps, host tier against all-V-resident."""
    cases = [check_exact_case(*c) for c in EXACT_CASES]
    out["exactness"] = {"compared": sum(c["compared"] for c in cases), "identical": all(c["identical"] for c in cases),
                        "max_rel_err_vs_float64": max(c["max_rel_err_vs_float64"] for c in cases), "cases": cases}
    out["exact_stats"] = cases[0].pop("stats")
    for c in cases:
        c.pop("stats", None)
    assert out["exactness"]["identical"] and out["exactness"]["max_rel_err_vs_float64"] < 2e-2, out["exactness"]


def check_exact_case(name, HQ, HKV, D, denominator):
    pol = OffloadPolicy(sink=4, window=32, budget_frac=0.05, max_topk=256, dense_layers=1, denominator=denominator)
    lens0 = [700, 5000, 36, 2100]
    ctx, rows, size, layers = 6000, 5, 40000, 2
    outs, sums = {}, {}
    worst = 0.0
    for resident in (False, True):
        gen = torch.Generator(device="cuda").manual_seed(1)
        pool = make_pool(pol, resident, size, rows, 512, ctx, layers, HKV, D)
        r2t = (torch.randperm(size, device="cuda", generator=gen)[: rows * ctx].view(rows, ctx) + 1).to(torch.int32)
        reqs = torch.tensor([1, 2, 3, 4], dtype=torch.int32, device="cuda")
        hk = torch.zeros(layers, rows, ctx, HKV, D, dtype=torch.bfloat16, device="cuda")
        hv = torch.zeros_like(hk)
        pool.reset_requests(reqs)
        own = torch.cat([torch.full((n,), int(r)) for r, n in zip(reqs.tolist(), lens0)]).cuda()
        pos = torch.cat([torch.arange(n) for n in lens0]).cuda()
        pool.set_host_writes_async(False)
        vrows = pool.extend_v_rows(reqs, [0] * 4, lens0)
        pool.set_summary_plan(pool.plan_extend_summaries(reqs, [0] * 4, lens0, r2t))
        for l in range(layers):
            k = torch.randn(len(pos), HKV, D, device="cuda", generator=gen).bfloat16()
            v = torch.randn(len(pos), HKV, D, device="cuda", generator=gen).bfloat16()
            pool.set_v_rows(vrows)
            pool.set_kv_buffer(types.SimpleNamespace(layer_id=l, k_scale=None, v_scale=None), r2t[own, pos].long(), k, v)
            hk[l, own, pos], hv[l, own, pos] = k, v
        dec = OffloadDecoder(pool.layout, HQ, HKV, D, max_bs=4, token_capacity=size, device="cuda")
        lens = list(lens0)
        res = []
        for step in range(6):
            lens = [x + 1 for x in lens]
            seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
            dec.plan(r2t, reqs, seq, 4)
            dec.grant_pages(pool)
            pool.set_summary_plan(dec.summary_plan(pool))
            pool.set_host_writes_async(True)  # as the backend: host V from the ring rows on a side stream, joined after the last layer
            for l in range(layers):
                k = torch.randn(4, HKV, D, device="cuda", generator=gen).bfloat16()
                v = torch.randn(4, HKV, D, device="cuda", generator=gen).bfloat16()
                pool.set_v_rows(dec.new_token_rows())
                pool.set_kv_buffer(types.SimpleNamespace(layer_id=l, k_scale=None, v_scale=None), r2t[reqs.long(), seq.long() - 1].long(), k, v)
                hk[l, reqs.long(), seq.long() - 1], hv[l, reqs.long(), seq.long() - 1] = k, v
                q = (2 * torch.randn(4, HQ, D, device="cuda", generator=gen)).bfloat16()
                o = torch.full_like(q, float("nan"))
                kb, vb = pool.get_key_buffer(l), pool.get_value_buffer(l)
                if pol.is_dense_layer(l):
                    dec.dense(q, kb, vb, o, D ** -0.5)
                elif resident:
                    dec.sparse(q, kb, vb, o, D ** -0.5, r2t, reqs, seq, v_summary=pool.summaries(l))
                else:
                    dec.sparse(q, kb, vb, o, D ** -0.5, r2t, reqs, seq, pool.hot_state(l), pool.host.view(l), v_summary=pool.summaries(l))
                if l == layers - 1:
                    pool.join_host_writes()
                res.append(o.clone())
                for b in range(4):
                    ref = attend_reference(q[b].cpu(), hk[l, int(reqs[b]), : lens[b]].cpu(), hv[l, int(reqs[b]), : lens[b]].cpu(), pol, l)
                    worst = max(worst, float((o[b].double().cpu() - ref).abs().max() / ref.abs().max()))
        outs[resident] = res
        torch.cuda.synchronize()
        # estimate's chunk means the requests own: the host run's (made in the store from the ring rows) against the resident run's
        sums[resident] = {l: pool.vsum[l][pool.chunk_slot[reqs.long()].flatten().long()].clone() for l in pool.summary_layer_ids}
        if not resident:
            stats = dec.stats.tolist()
            # the host tier holds every position's V of every sparse layer (decode steps: copied from the ring rows on the side stream)
            host_ok = all(torch.equal(pool.host.view(l)[r2t[int(r), :n].long()], hv[l, int(r), :n])
                          for l in pool.sparse_layer_ids for r, n in zip(reqs.tolist(), lens))
        pool._clear_buffers()
    identical = all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))
    sums_ok = all(torch.equal(sums[False][l], sums[True][l]) for l in sums[False])
    return {"model": name, "q_heads": HQ, "kv_heads": HKV, "head_dim": D, "denominator": denominator, "compared": len(outs[False]),
            "identical": identical and host_ok and sums_ok, "outputs_identical": identical, "host_tier_exact": host_ok,
            "summaries_identical": sums_ok, "max_rel_err_vs_float64": worst, "stats": stats}


def capture(fn, warm=3, before=None):
    """``fn`` run ``warm`` times on a side stream (``before()`` ahead of each run), then captured in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warm):
            if before is not None:
                before()
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def kernel_us(fn, reps=10, warm=3):
    """Per-kernel device time of one eager call of ``fn``, microseconds, by kernel name (torch's profiler over
    ``reps`` calls after ``warm``; names cut to 80 characters), largest first: where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per = {}
    for e in prof.key_averages():
        if str(getattr(e, "device_type", "CUDA")).split(".")[-1] != "CUDA":  # the kernels only (not the runtime calls that launched them)
            continue
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = getattr(e, "cuda_time_total", 0)
        if us and e.count:
            name = e.key[:80]
            per[name] = per.get(name, 0.0) + us / reps
    return dict(sorted(((k, round(v, 2)) for k, v in per.items()), key=lambda kv: -kv[1]))


def graph_ms(fn, reps=50):
    """Median CUDA-event time of one replay of ``fn`` captured in a CUDA graph
    (what a serving step pays: no launch gaps from Python)."""
    return time_ms(capture(fn).replay, reps=reps)


def time_layer(out, bs=44, ctx=32768, key="layer_timing"):
    """One sparse layer of a ``bs`` x ``ctx`` batch: each kernel, the whole
    warm layer captured in a CUDA graph, and a dense split-KV layer for comparison."""
    pol = OffloadPolicy()
    hot = 4096
    size = bs * ctx + 8
    lay = OffloadLayout(pol, hot_tokens=hot, request_rows=bs + 1, stage_tokens=8, resident_v=False)
    gen = torch.Generator(device="cuda").manual_seed(2)
    kb = torch.randn(size, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    vfull = torch.randn(size, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    host = torch.empty((size, HKV, D), dtype=torch.bfloat16, pin_memory=True)
    host.copy_(vfull.cpu())
    hview = device_view(host)
    # every request holds its whole hot buffer (the most pages), the pages scattered over the pool
    P, per = lay.hot_page, lay.max_pages
    base = (bs + 1) * lay.region_rows
    table = torch.full((bs + 1, per), -1, dtype=torch.int32, device="cuda")
    table[1:] = torch.randperm(bs * per, device="cuda", generator=gen).view(bs, per).to(torch.int32)
    count = torch.full((bs + 1,), per, dtype=torch.int32, device="cuda")
    count[0] = 0
    vhot = torch.zeros((base + bs * per * P + 1, HKV, D), device="cuda", dtype=torch.bfloat16)
    loc_slot = torch.full((size,), -1, dtype=torch.int16, device="cuda")
    slot_pos = torch.full((bs + 1, hot), -1, dtype=torch.int32, device="cuda")
    slot_time = torch.full_like(slot_pos, -1)
    r2t = (torch.randperm(size - 1, device="cuda", generator=gen)[: bs * ctx] + 1).view(bs, ctx).to(torch.int32)
    r2t = torch.cat([torch.zeros(1, ctx, dtype=torch.int32, device="cuda"), r2t])
    reqs = torch.arange(1, bs + 1, dtype=torch.int32, device="cuda")
    seq = torch.full((bs,), ctx, dtype=torch.int32, device="cuda")
    dec = OffloadDecoder(lay, HQ, HKV, D, max_bs=bs, token_capacity=size, device="cuda", prefetch=True)
    q = (2 * torch.randn(bs, HQ, D, device="cuda", generator=gen)).bfloat16()
    o = torch.empty_like(q)
    dec.plan(r2t, reqs, seq, bs)
    sp, ws = dec.split, dec.sel
    t = {}
    t["plan"] = time_ms(lambda: dec.plan(r2t, reqs, seq, bs))
    t["scores"] = time_ms(lambda: ko.scores_run(q, kb, dec.kv_indptr[: bs + 1], dec.kv_indices, dec.chunk[:bs], sp.scores_max_splits,
                                                ws.scores, ws.score_lse, D ** -0.5, sp.scores_block_n,
                                                num_warps=sp.scores_num_warps, num_stages=sp.scores_num_stages))
    # the A/B of the ids loaded a tile ahead: the kernel before (ids loaded where used), same scores bit for bit
    carried = ws.scores.clone(), ws.score_lse.clone()
    t["scores_ids_uncarried"] = time_ms(lambda: ko.scores_run(q, kb, dec.kv_indptr[: bs + 1], dec.kv_indices, dec.chunk[:bs],
                                                              sp.scores_max_splits, ws.scores, ws.score_lse, D ** -0.5, sp.scores_block_n,
                                                              num_warps=sp.scores_num_warps, num_stages=sp.scores_num_stages, carry_ids=False))
    bit_equal = bool(torch.equal(carried[0], ws.scores) and torch.equal(carried[1], ws.score_lse))
    del carried  # ~184 MB at 44 x 32K
    lse = ko.lse_merge(ws.score_lse, bs, sp.scores_max_splits, ws.lse_full)
    t["lse_merge"] = time_ms(lambda: ko.lse_merge(ws.score_lse, bs, sp.scores_max_splits, ws.lse_full))
    t["select"] = time_ms(lambda: ko.select_run(ws.scores, lse, dec.kv_indptr[: bs + 1], dec.s_eff[:bs], dec.w_eff[:bs], dec.k[:bs],
                                                ws.p_buf, ws.sel_pos, HQ, sp.select_block_n, sp.select_parts, ws.sel_hist, ws.sel_counts))

    def swap(eviction="lru"):
        ko.swap_in_run(ws.sel_pos, dec.k[:bs], dec.s_eff[:bs], dec.w_eff[:bs], dec.att_indptr, seq, reqs, r2t, loc_slot, slot_pos,
                       slot_time, ws.scratch, dec.att_kidx, dec.att_vidx, ws.miss_src, ws.miss_dst, ws.miss_cnt, ws.stats,
                       pol.max_topk, table, count, base, P, eviction=eviction)

    def copy():
        ko.copy_rows_run(hview, vhot, ws.miss_src[:bs], ws.miss_dst[:bs], counts=ws.miss_cnt[:bs])

    # cold: every selected row a miss (fresh hot buffers before each run)
    cold_swap, cold_copy = [], []
    for _ in range(8):
        slot_pos.fill_(-1)
        slot_time.fill_(-1)
        torch.cuda.synchronize()
        cold_swap.append(time_ms(swap, reps=1, warm=0))
        cold_copy.append(time_ms(copy, reps=1, warm=0))
        slot_pos.fill_(-1)
        slot_time.fill_(-1)
    misses_cold = int(ws.miss_cnt[:bs].sum())
    t["swap_in_cold"] = statistics.median(cold_swap)
    t["copy_cold"] = statistics.median(cold_copy)
    swap()
    copy()
    t["swap_in_warm"] = time_ms(swap)  # the same selection: all hits
    t["swap_in_warm_lfu"] = time_ms(lambda: swap("lfu"))  # --kv-offload-eviction lfu: the same bookkeeping with use counts
    misses_warm = int(ws.miss_cnt[:bs].sum())
    t["attend"] = time_ms(lambda: ko.attend_run(q, kb, vhot, dec.att_indptr[: bs + 1], dec.att_kidx, dec.att_vidx, dec.att_chunk[:bs],
                                                dec.att_nsplit[:bs], sp.attend_max_splits, dec.mid_o, dec.mid_lse, o, lse, D ** -0.5,
                                                sp.attend_block_n))
    t["dense_split_kv"] = time_ms(lambda: split_kv_decode(q, kb, vfull, dec.kv_indptr[: bs + 1], dec.kv_indices, D ** -0.5))
    # the prefetch of a layer (a second scoring and top-k with a guessed query, speculative swap-in): same query, so all hits
    t["prefetch_warm"] = time_ms(lambda: dec.prefetch(q, kb, vhot, D ** -0.5, r2t, reqs, seq, HotState(loc_slot, slot_pos, slot_time, table,
                                                                                                      count, base, P), hview))
    # estimate: the attended marks and the chunk-mean pass over every chunk of 16 positions
    C = 16
    est = OffloadDecoder(OffloadLayout(OffloadPolicy(denominator="estimate", chunk=C), hot_tokens=hot, request_rows=bs + 1,
                                       stage_tokens=ctx, resident_v=False), HQ, HKV, D, max_bs=bs, token_capacity=size, device="cuda")
    est.plan(r2t, reqs, seq, bs)
    est.sel = dec.sel
    # the summary slots' table (named apart: reusing `table` gave the hot state below the summary table as its page table)
    sum_table = (torch.arange(bs + 1, device="cuda")[:, None] * (ctx // C) + torch.arange(ctx // C, device="cuda")[None, :]).to(torch.int32)
    vsum = torch.randn(((bs + 1) * (ctx // C) + 2, HKV, D), device="cuda", dtype=torch.bfloat16, generator=gen)
    # the marks come with the top-k's last pass now (no pass of their own): time that select against the plain one
    t["estimate_mark"] = time_ms(lambda: ko.select_run(ws.scores, lse, dec.kv_indptr[: bs + 1], dec.s_eff[:bs], dec.w_eff[:bs], dec.k[:bs],
                                                       ws.p_buf, ws.sel_pos, HQ, sp.select_block_n, sp.select_parts, ws.sel_hist,
                                                       ws.sel_counts, marks=est.marks, stamp=est.stamp)) - t["select"]
    t["estimate"] = time_ms(lambda: ko.estimate_run(ws.scores, lse, est.kv_indptr[: bs + 1], est.chunk[:bs], sp.scores_max_splits,
                                                    est.s_eff[:bs], est.w_eff[:bs], est.k[:bs], est.marks, vsum, reqs, sum_table, C,
                                                    est.est_o, HKV, stamp=est.stamp, reduce=False))
    # the whole warm sparse layer (OffloadDecoder.sparse: scores, merge, top-k, swap-in, copy, attention) as one graph
    # replay, and the dense split-KV layer the same way: the per-kernel sums above leave out the launch gaps a graph removes
    hot_state = HotState(loc_slot, slot_pos, slot_time, table, count, base, P)
    t["sparse_layer_graph"] = graph_ms(lambda: dec.sparse(q, kb, vhot, o, D ** -0.5, r2t, reqs, seq, hot_state, hview))
    t["sparse_layer_graph_estimate"] = graph_ms(lambda: est.sparse(q, kb, vhot, o, D ** -0.5, r2t, reqs, seq, hot_state, hview,
                                                                   v_summary=(vsum, sum_table)))
    t["dense_split_kv_graph"] = graph_ms(lambda: dec.dense(q, kb, vfull, o, D ** -0.5))
    # the warm estimate layer per kernel, eagerly (torch's profiler; where its graph replay's time goes)
    kernels = kernel_us(lambda: est.sparse(q, kb, vhot, o, D ** -0.5, r2t, reqs, seq, hot_state, hview, v_summary=(vsum, sum_table)))
    warm_layer = t["scores"] + t["lse_merge"] + t["select"] + t["swap_in_warm"] + t["attend"]
    copy_timing = time_copy_overlap(dec, q, o, kb, vfull, vhot, r2t, reqs, seq, hot_state, hview)
    out[key] = {
        "batch": bs, "context": ctx, "topk": pol.max_topk, "hot_tokens": hot, "ms": t, "sparse_estimate_kernels_us": kernels,
        "misses_cold": misses_cold, "misses_warm": misses_warm,
        "cold_copy_gb_s": misses_cold * HKV * D * 2 / t["copy_cold"] / 1e6 if t["copy_cold"] else None,
        "sparse_layer_warm_ms": warm_layer, "sparse_layer_warm_estimate_ms": warm_layer + t["estimate_mark"] + t["estimate"],
        "sparse_layer_cold_ms": warm_layer - t["swap_in_warm"] + t["swap_in_cold"] + t["copy_cold"],
        "k_bytes_gb": bs * ctx * HKV * D * 2 / 1e9,
        "scores_gb_s": bs * ctx * HKV * D * 2 / t["scores"] / 1e6,
        "scores_ids_uncarried_gb_s": bs * ctx * HKV * D * 2 / t["scores_ids_uncarried"] / 1e6,
        "scores_carry_ids_bit_equal": bit_equal,
        "copy_timing": copy_timing,
    }


def time_scores_sweep(out, bs=44, ctx=32768, key="scores_sweep"):
    """The scores kernel (``ko.scores_run``, about 70 % of a sparse layer at 44 x 32K on an H100) over its launch
    settings: ``scores_max_splits`` 16 / 32 / 64 (the plan's chunks) x ``num_warps`` 2 / 4 / 8 x ``num_stages``
    2 to 5, each timed as :func:`time_layer` times it (K rows scattered over the pool, page 1) and compared with the
    shipped setting's output: the scores bit for bit and the merged log-sum-exp (bit for bit, and its max |diff|:
    another chunking sums the log-sum-exp in another order, and the selection reads it, so a setting whose
    ``lse_bit_equal`` is false is not output-neutral). Writes ``out[key] = {batch, context, k_bytes_gb, shipped:
    {...}, configs: [{max_splits, num_warps, num_stages, ms, gb_s, scores_bit_equal, lse_bit_equal,
    lse_max_abs_diff} | {..., error}], best: {...}, best_vs_shipped}`` (``best``: the fastest with the scores
    bit-equal); a setting Triton cannot compile is recorded with its error, never fatal."""
    from sglang_elastic.kernels.decode_attention import split_kv_plan
    from sglang_elastic.offload.decode import SplitConfig
    sp = SplitConfig()
    size = bs * ctx + 8
    gen = torch.Generator(device="cuda").manual_seed(5)
    kb = torch.randn(size, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    idx = (torch.randperm(size - 1, device="cuda", generator=gen)[: bs * ctx] + 1).to(torch.int32)
    indptr = torch.arange(0, bs * ctx + 1, ctx, device="cuda", dtype=torch.int32)
    q = (2 * torch.randn(bs, HQ, D, device="cuda", generator=gen)).bfloat16()
    scores = torch.empty((HQ, bs * ctx), device="cuda", dtype=torch.float32)
    k_gb = bs * ctx * HKV * D * 2 / 1e9

    def run(max_splits, num_warps, num_stages):
        chunk, _ = split_kv_plan(indptr, max_splits, sp.scores_min_chunk, sp.scores_block_n)
        lse_mid = torch.full((bs * max_splits, HQ), float("nan"), device="cuda", dtype=torch.float32)  # a stale block cannot pass
        fn = lambda: ko.scores_run(q, kb, indptr, idx, chunk, max_splits, scores, lse_mid, D ** -0.5, sp.scores_block_n,
                                   num_warps=num_warps, num_stages=num_stages)
        ms = time_ms(fn)
        return ms, ko.lse_merge(lse_mid, bs, max_splits)

    shipped = dict(max_splits=sp.scores_max_splits, num_warps=sp.scores_num_warps, num_stages=sp.scores_num_stages)
    ms0, lse0 = run(**shipped)
    ref = scores.clone()
    rows = []
    for ms_, nw, ns in [(m, w, st) for m in (16, 32, 64) for w in (2, 4, 8) for st in (2, 3, 4, 5)]:
        row = dict(max_splits=ms_, num_warps=nw, num_stages=ns)
        try:
            scores.fill_(float("nan"))
            ms, lse = run(**row)
        except Exception as e:  # shared memory or registers out of range for this setting: recorded
            rows.append({**row, "error": f"{type(e).__name__}: {str(e)[:160]}"})
            continue
        rows.append({**row, "ms": ms, "gb_s": k_gb / ms * 1e3, "scores_bit_equal": bool(torch.equal(scores, ref)),
                     "lse_bit_equal": bool(torch.equal(lse, lse0)), "lse_max_abs_diff": (lse - lse0).abs().max().item()})
    ok = [r for r in rows if "ms" in r and r["scores_bit_equal"]]
    best = min(ok, key=lambda r: r["ms"]) if ok else None
    out[key] = {"batch": bs, "context": ctx, "k_bytes_gb": k_gb, "shipped": {**shipped, "ms": ms0, "gb_s": k_gb / ms0 * 1e3},
                "configs": rows, "best": best, "best_vs_shipped": (best["ms"] / ms0) if best else None}
    del kb, scores, ref


#: ``select_sweep``'s settings: the top-k's (``parts``, ``block_n``, ``num_warps``) and the estimate's (``block_positions``, ``num_warps``)
SELECT_GRID = [dict(parts=p, block_n=b, num_warps=w) for p in (16, 32, 64, 128) for b in (128, 256, 512) for w in (4, 8)]
ESTIMATE_GRID = [dict(block_positions=b, num_warps=w) for b in (64, 128, 256, 512) for w in (2, 4, 8)]


def time_select_sweep(out, bs=44, ctx=32768, key="select_sweep", device="cuda", timed=time_ms, select_grid=SELECT_GRID,
                      estimate_grid=ESTIMATE_GRID, hq=HQ, hkv=HKV, d=D):
    """The passes beside the scores kernel over their launch settings: the top-k (``ko.select_run``: four radix
    histogram passes, a count and a compaction; 2.2 + 0.5 ms of a 29.6 ms step at 19 x 33K on an H100, 2026-12-07
    #31, where ~1 ms would read its bytes at the scores kernel's rate) over :data:`SELECT_GRID`, each checked
    against the shipped setting's positions and attended marks bit for bit (an exact select: every setting must
    give the same list); and the ``estimate`` pass (2.4 ms there) over :data:`ESTIMATE_GRID`, against the shipped
    partials (another block sums the chunks in another order: ``max_rel_diff``, and the same unwritten splits).
    Inputs as :func:`time_layer` builds them (K rows scattered, chunk 16). Writes ``out[key] = {batch, context,
    chunk, topk, marked, select: {shipped, configs, best, best_vs_shipped}, estimate: {...}}`` (``best``: the fastest
    equal to the shipped output: bit for bit for the top-k, within 1e-5 relative for the estimate); a setting
    Triton cannot compile is recorded with its error, never fatal. ``device``, ``timed`` and the grids: the
    CPU test's small run (Triton's interpreter, wall-clock timer)."""
    from sglang_elastic.offload.decode import SplitConfig
    sp0 = SplitConfig()
    C = 16
    pol = OffloadPolicy(denominator="estimate", chunk=C)
    size = bs * ctx + 8
    gen = torch.Generator(device=device).manual_seed(7)
    kb = torch.randn(size, hkv, d, device=device, generator=gen).bfloat16()
    r2t = (torch.randperm(size - 1, device=device, generator=gen)[: bs * ctx] + 1).view(bs, ctx).to(torch.int32)
    r2t = torch.cat([torch.zeros(1, ctx, dtype=torch.int32, device=device), r2t])
    reqs = torch.arange(1, bs + 1, dtype=torch.int32, device=device)
    seq = torch.full((bs,), ctx, dtype=torch.int32, device=device)
    est = OffloadDecoder(OffloadLayout(pol, hot_tokens=4096, request_rows=bs + 1, stage_tokens=ctx, resident_v=False), hq, hkv, d,
                         max_bs=bs, token_capacity=size, device=device)
    est.plan(r2t, reqs, seq, bs)
    sp, ws = est.split, est.sel
    q = (2 * torch.randn(bs, hq, d, device=device, generator=gen)).bfloat16()
    indptr = est.kv_indptr[: bs + 1]
    ko.scores_run(q, kb, indptr, est.kv_indices, est.chunk[:bs], sp.scores_max_splits, ws.scores, ws.score_lse, d ** -0.5,
                  sp.scores_block_n, num_warps=sp.scores_num_warps, num_stages=sp.scores_num_stages)
    lse = ko.lse_merge(ws.score_lse, bs, sp.scores_max_splits, ws.lse_full, stamp=est.stamp)
    sum_table = (torch.arange(bs + 1, device=device)[:, None] * (ctx // C) + torch.arange(ctx // C, device=device)[None, :]).to(torch.int32)
    vsum = torch.randn(((bs + 1) * (ctx // C) + 2, hkv, d), device=device, generator=gen).bfloat16()
    del kb

    def select(parts, block_n, num_warps):
        counts = torch.zeros(bs * parts * 2, dtype=torch.int32, device=device)
        ws.sel_pos.fill_(-1)
        est.marks.zero_()
        fn = lambda: ko.select_run(ws.scores, lse, indptr, est.s_eff[:bs], est.w_eff[:bs], est.k[:bs], ws.p_buf, ws.sel_pos, hq,
                                   block_n, parts, ws.sel_hist, counts, num_warps=num_warps, marks=est.marks, stamp=est.stamp)
        return timed(fn), (ws.sel_pos.clone(), est.marks.clone())

    def estimate(block_positions, num_warps):
        est.est_o.fill_(float("nan"))  # the splits past a request's length stay NaN: the same ones in every setting
        fn = lambda: ko.estimate_run(ws.scores, lse, indptr, est.chunk[:bs], sp.scores_max_splits, est.s_eff[:bs], est.w_eff[:bs],
                                     est.k[:bs], est.marks, vsum, reqs, sum_table, C, est.est_o, hkv, stamp=est.stamp, reduce=False,
                                     block_positions=block_positions, num_warps=num_warps)
        return timed(fn), est.est_o.clone()

    def same_select(got, ref):
        return {"equal": bool(torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]))}

    def same_estimate(got, ref):
        nan = torch.isnan(ref)
        if not torch.equal(torch.isnan(got), nan):
            return {"equal": False, "max_rel_diff": None}
        rel = float(((got - ref)[~nan].abs().max() / ref[~nan].abs().max().clamp_min(1e-30)).item())
        return {"max_rel_diff": rel, "equal": rel <= 1e-5}

    def sweep(run, shipped, grid, same):
        ms0, ref = run(**shipped)
        rows = []
        for row in grid:
            try:
                ms, got = run(**row)
            except Exception as e:  # registers or shared memory out of range for this setting: recorded
                rows.append({**row, "error": f"{type(e).__name__}: {str(e)[:160]}"})
                continue
            rows.append({**row, "ms": ms, **same(got, ref)})
        ms1, again = run(**shipped)  # the shipped setting again, last: its spread, and its output left for the next pass
        ok = [r for r in rows if "ms" in r and r["equal"]]
        best = min(ok, key=lambda r: r["ms"]) if ok else None
        return {"shipped": {**shipped, "ms": ms0, "ms_again": ms1, **same(again, ref)}, "configs": rows, "best": best,
                "best_vs_shipped": best["ms"] / ms0 if best else None}

    res = {"batch": bs, "context": ctx, "chunk": C, "topk": pol.max_topk}
    res["select"] = sweep(select, dict(parts=sp0.select_parts, block_n=sp0.select_block_n, num_warps=None), select_grid, same_select)
    res["marked"] = int((est.marks == est.stamp).sum())  # positions the shipped select took (k of each middle: a real select)
    res["estimate"] = sweep(estimate, dict(block_positions=ko.ESTIMATE_POSITIONS, num_warps=None), estimate_grid, same_estimate)
    out[key] = res


def time_copy_overlap(dec, q, o, kb, vfull, vhot, r2t, reqs, seq, hot_state, hview, replays=12):
    """``--kv-offload-copy-timing``'s events inside a CUDA graph (external event-record nodes), as the
    backend records them: the next sparse layer's prefetch (its own query as the guess, so it copies
    every selected row) on a side stream while layer ``l`` (a dense split-KV layer here) runs on the
    compute stream; then the sparse layer waits for the side stream and copies its residual misses.
    Cold hot buffers before every replay. Returns the timer's totals per replay.

    Raises:
        RuntimeError: no replay gave a sample (the events did not time inside the graph).
    """
    from sglang_elastic.offload.copytime import CRIT, PREFETCH, STALL, CopyTimer

    timer = CopyTimer(every=1)
    side = torch.cuda.Stream()
    o2 = torch.empty_like(o)

    def step():
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            dec.prefetch(q, kb, vhot, D ** -0.5, r2t, reqs, seq, hot_state, hview, clock=timer.clock(1, PREFETCH, main=False))
            ev = torch.cuda.Event()
            ev.record(side)
        dec.dense(q, kb, vfull, o2, D ** -0.5)  # layer l, overlapping the copy
        timer.mark(1, STALL[0])
        cur.wait_event(ev)
        timer.mark(1, STALL[1])
        dec.sparse(q, kb, vhot, o, D ** -0.5, r2t, reqs, seq, hot_state, hview, clock=timer.clock(1, CRIT))

    def cold():
        hot_state.slot_pos.fill_(-1)
        hot_state.slot_time.fill_(-1)
        hot_state.loc_slot.fill_(-1)

    timer.begin("graph", capture=True)
    g = capture(step, warm=2, before=cold)
    for _ in range(replays):
        cold()
        timer.begin("graph")
        g.replay()
        torch.cuda.synchronize()
        timer.poll()
    st = timer.stats()
    n = st["copy_timed_steps"]
    if not n:
        raise RuntimeError(f"copy timing: no replay gave a sample ({timer.dropped} dropped)")
    return {"replays": replays, "timed": n, "dropped": timer.dropped, "copy_hidden_share": st["copy_hidden_share"],
            **{k + "_per_step": st[k] / n for k in ("copy_ms", "copy_exposed_ms", "copy_prefetch_ms", "copy_stall_ms")}}


def time_keep_v_step(out, bs=64, ctx=4608, layers=32, hq=HQ, hkv=HKV, d=D, device="cuda", timed=None, graphed=None,
                      key="keep_v_step", mixed=(0, 1, 8, 64), kernels=None):
    """Where the fitting workload's median ITL goes with ``--kv-offload-keep-v`` (every request keeps V,
    so every step replays the all-dense variant): each per-layer piece of that step at ``bs``
    requests of about ``ctx`` tokens (lengths ``ctx - 0..15``: about one request in 16 completes a
    chunk, as in serving), against stock SGLang's decode layer at the same shape:

    - ``plan``: the all-dense step's plan and summary-slot grant (once per step);
    - ``store``: a sparse layer's KV write (``OffloadKVPool.set_kv_buffer``: K, V to the host, to its
      ring row and kept row, the completed chunks' means), and the same ``store_no_summary``
      (no chunk means) and ``store_no_host`` (V to a device tensor in place of the pinned host pool:
      the price of the PCIe stores);
    - ``chunk_mean``: the chunk-mean launch alone;
    - ``dense_kept``: a sparse layer's attention (K at the token ids, V at the kept rows);
    - ``dense_split_kv``: a dense layer's (one id list for K and V);
    - ``layer`` / ``layer_host_async``: a sparse layer as the backend runs it (store, attention), its
      host V written by the store, or copied from the ring rows on a side stream beside the attention
      and joined after it (the default since 2026-12-05; a step joins once, after its last layer, so
      this single layer's join is an upper bound);
    - ``mixed``: for each ``m`` of ``mixed``, the same batch's general step with its first ``m`` requests demoted
      (sparse from their host V, the rest still kept): what one demotion costs every request of the batch (a 64 x 4K
      load whose last 55 steps had one demoted request ran them at 24 ms against 18.3, an H100, 2026-12-06); ``m = 0``:
      the general step with every request kept (what the selection launches cost with nothing to select); with
      ``kernels`` (``fn -> {kernel: us}``, :func:`kernel_us` on a GPU) each mixed step's sparse layer per kernel too;
      on a GPU each mixed step again with the kept launch on a side stream (``--kv-offload-dense-launch kept_stream=1``):
      ``kept_stream_identical`` / ``kept_stream_graph_identical`` (its output equal bit for bit, eagerly and as a CUDA-graph
      replay), ``sparse_kept_stream``, ``layer_kept_stream``,
      ``step_ms_kept_stream``;
    - stock: ``store_stock`` (SGLang 0.5.17's ``MHATokenToKVPool.set_kv_buffer``) and FlashInfer's
      paged decode (``BatchDecodeWithPagedKVCacheWrapper`` with tensor cores, as SGLang plans it for
      this GQA group; planned once, replayed from a graph and eagerly).

    ``step_ms`` adds them up for a ``layers``-layer model (the policy's dense layers, the rest sparse);
    weights, MLPs and sampling are the same on both sides and left out. Times of CUDA-graph replays
    (``graphed``; the attention also eagerly, ``timed``). ``timed``/``graphed``: ``fn -> ms`` (a CPU
    test passes wall-clock ones; FlashInfer is then skipped).
    """
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    timed = timed or time_ms
    graphed = graphed or graph_ms
    from sglang_elastic.config import OffloadConfig

    pol = OffloadConfig(enabled=True).policy()  # the shipped defaults (estimate, two dense layers)
    dl = pol.dense_layers
    nl = dl + 1  # the dense layers and one sparse layer
    sl = dl
    g = torch.Generator(device=device).manual_seed(5)
    lens = ctx - torch.randint(0, 16, (bs,), device=device, generator=g)
    size = 2 * bs * ctx + 64  # every token's K slot, and one lent slot per token for its kept V
    # the server's hot-buffer cap per request (--kv-offload-hot-tokens' default); the pool's hot pages cover every request
    # of the mixed steps. (Until 2026-12-06 (#23) this cap was the pool's rows, 22,528 at 64 x 4.6K: a swap-in over 32K slots a
    # request, 0.29 ms a layer on an H100, which the server never runs; it made the selection look four times its cost.)
    hot = OffloadConfig().hot_tokens
    lay = OffloadLayout(pol, hot_tokens=hot, request_rows=bs + 1, stage_tokens=ctx, resident_v=False, keep_v=True)
    pool = OffloadKVPool(size, 1, torch.bfloat16, hkv, d, nl, device, False, enable_alt_stream=False, layout=lay,
                         pin_memory=device == "cuda")
    assert pool.keep_v, "keep_v did not take (shared K/V buffers)"
    for l in range(nl):
        pool.k_buffer[l].normal_(generator=g)
        pool.v_buffer[l].normal_(generator=g)
    pool.host.view(sl).copy_(torch.randn(pool.host.view(sl).shape, generator=g, device=device).bfloat16())
    ids = (torch.randperm(size - 1, device=device, generator=g) + 1).to(torch.int32)  # 0: SGLang's padding slot
    r2t = torch.zeros(bs + 1, ctx, dtype=torch.int32, device=device)
    r2t[1:] = ids[: bs * ctx].view(bs, ctx)
    lent = ids[bs * ctx: 2 * bs * ctx].view(bs, ctx).to(torch.int64)
    for r in range(1, bs + 1):
        pool.set_keep(r, 0, lent[r - 1])
    rp = torch.arange(1, bs + 1, dtype=torch.int32, device=device)
    seq = lens.to(torch.int32)
    dec = OffloadDecoder(lay, hq, hkv, d, max_bs=bs, token_capacity=int(lens.sum()) + 64, device=device)
    dec.plan(r2t, rp, seq, bs, keep=pool.keep_tables(), all_dense=True)
    summary = dec.summary_plan(pool)
    pool.set_summary_plan(summary)
    pool.set_v_rows(dec.new_token_rows(), dec.new_token_keep_rows())
    loc = r2t[rp.long(), seq.long() - 1].long()
    k = torch.randn(bs, hkv, d, device=device, generator=g).bfloat16()
    v = torch.randn(bs, hkv, d, device=device, generator=g).bfloat16()
    q = (2 * torch.randn(bs, hq, d, device=device, generator=g)).bfloat16()
    o = torch.empty_like(q)
    lay_s = types.SimpleNamespace(layer_id=sl, k_scale=None, v_scale=None)
    scale = d ** -0.5
    kb, vb = pool.get_key_buffer(sl), pool.get_value_buffer(sl)
    t = {}

    def plan():
        dec.plan(r2t, rp, seq, bs, keep=pool.keep_tables(), all_dense=True)
        dec.summary_plan(pool)

    t["plan"] = graphed(plan)
    pool.set_summary_plan(summary)  # the plan's slots as the timed step's own (the replays above granted more)
    t["store"] = graphed(lambda: pool.set_kv_buffer(lay_s, loc, k, v))
    pool.set_summary_plan(None)
    t["store_no_summary"] = graphed(lambda: pool.set_kv_buffer(lay_s, loc, k, v))
    pool.set_summary_plan(summary)
    dev_v = torch.empty_like(pool.host.view(sl), device=device)
    t["store_no_host"] = graphed(lambda: ko.store_sparse_run(k, v, kb, dev_v, vb, loc, dec.new_token_rows(), dec.new_token_keep_rows()))
    del dev_v
    src, dst = summary[0], summary[1]
    t["chunk_mean"] = graphed(lambda: ko.chunk_mean_run(vb, src, dst, pool.vsum[sl], skip=pool.SPARE))
    t["chunk_mean_every_item"] = graphed(lambda: ko.chunk_mean_run(vb, src, dst, pool.vsum[sl]))  # before 2026-12-05
    t["dense_kept"] = graphed(lambda: dec.dense_kept(q, kb, vb, o, scale))
    dense_kernels = kernels(lambda: dec.dense_kept(q, kb, vb, o, scale)) if kernels is not None else None

    def layer_step(async_host):  # a sparse layer as the backend runs it: store, attention, and (async) the join
        pool.set_host_writes_async(async_host)
        pool.set_kv_buffer(lay_s, loc, k, v)
        dec.dense_kept(q, kb, vb, o, scale)
        pool.join_host_writes()

    t["layer"] = graphed(lambda: layer_step(False))  # the host V written by the store
    t["layer_host_async"] = graphed(lambda: layer_step(True))  # copied from the ring rows beside the attention (the default)
    pool.set_host_writes_async(False)
    t["dense_kept_eager"] = timed(lambda: dec.dense_kept(q, kb, vb, o, scale))
    t["dense_split_kv"] = graphed(lambda: dec.dense(q, pool.get_key_buffer(0), pool.get_value_buffer(0), o, scale))
    t["dense_split_kv_eager"] = timed(lambda: dec.dense(q, pool.get_key_buffer(0), pool.get_value_buffer(0), o, scale))
    mixed_ms = {}
    hs, hv, vsum = pool.hot_state(sl), pool.host.view(sl), pool.summaries(sl)

    def gplan():
        dec.plan(r2t, rp, seq, bs, keep=pool.keep_tables())
        dec.grant_pages(pool)
        return dec.summary_plan(pool)

    def sparse():  # a sparse layer's attention of the general step
        return dec.sparse(q, kb, vb, o, scale, r2t, rp, seq, hs, hv, v_summary=vsum)

    def layer():  # and with its KV store
        pool.set_kv_buffer(lay_s, loc, k, v)
        return sparse()

    for m in mixed:  # the general step of the same batch with its first m requests demoted (sparse from their host V)
        for r in range(1, bs + 1):
            pool.set_keep(r, 0, lent[r - 1])
        for r in range(1, m + 1):
            pool.set_keep(r, 0, None)
        tm = {"plan": graphed(gplan)}
        pool.set_summary_plan(gplan())
        pool.set_v_rows(dec.new_token_rows(), dec.new_token_keep_rows())
        sparse()  # the hot buffer warm, as a step after the first
        tm["sparse"] = graphed(sparse)
        if kernels is not None:
            tm["sparse_kernels_us"] = kernels(sparse)
        tm["layer"] = graphed(layer)
        tm["dense_split_kv"] = graphed(lambda: dec.dense(q, pool.get_key_buffer(0), pool.get_value_buffer(0), o, scale))
        tm["step_ms"] = tm["plan"] + (layers - dl) * tm["layer"] + dl * tm["dense_split_kv"]  # + the dense layers' stock stores below
        if device == "cuda":  # the kept launch on a side stream beside the selection (kept_stream=1): same bits, its time
            sparse()
            ref = o.clone()
            o.zero_()
            dec._kept_stream = torch.cuda.Stream()  # (what SplitConfig(dense_kept_stream=True) makes at construction)
            sparse()
            torch.cuda.synchronize()
            tm["kept_stream_identical"] = bool(torch.equal(o, ref))
            tm["sparse_kept_stream"] = graphed(sparse)
            torch.cuda.synchronize()
            tm["kept_stream_graph_identical"] = bool(torch.equal(o, ref))  # the last replay's output (the server replays graphs)
            tm["layer_kept_stream"] = graphed(layer)
            tm["step_ms_kept_stream"] = tm["plan"] + (layers - dl) * tm["layer_kept_stream"] + dl * tm["dense_split_kv"]
            dec._kept_stream = None
        mixed_ms[m] = tm
    stock = MHATokenToKVPool(size, 1, torch.bfloat16, hkv, d, 1, device, False, enable_alt_stream=False)
    lay_0 = types.SimpleNamespace(layer_id=0, k_scale=None, v_scale=None)
    t["store_stock"] = graphed(lambda: stock.set_kv_buffer(lay_0, loc, k, v))
    notes = {}
    if device == "cuda":
        try:
            import flashinfer

            total = int(lens.sum())
            ks, vs = stock.get_key_buffer(0), stock.get_value_buffer(0)
            ks.normal_(generator=g)
            vs.normal_(generator=g)
            kv1 = (ks.view(-1, 1, hkv, d), vs.view(-1, 1, hkv, d))
            fo = torch.empty_like(q)
            ind = dec.kv_indices[:total]
            for tc in (True,):  # as SGLang's FlashInfer backend plans a decode graph (bench_decode.py's column): tensor
                # cores, which flashinfer_backend.should_use_tensor_core picks for a bf16 GQA group of 4 or more
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    torch.empty(256 << 20, dtype=torch.uint8, device=device), "NHD", use_cuda_graph=True, use_tensor_cores=tc,
                    paged_kv_indptr_buffer=torch.empty_like(dec.kv_indptr[: bs + 1]), paged_kv_indices_buffer=torch.empty_like(ind),
                    paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device=device))
                w.plan(dec.kv_indptr[: bs + 1], ind, torch.ones(bs, dtype=torch.int32, device=device), hq, hkv, d, 1,
                       q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=scale)
                name = "flashinfer_tc" if tc else "flashinfer_cuda_cores"
                t[name] = graphed(lambda: w.run(q, kv1, out=fo))
                t[name + "_eager"] = timed(lambda: w.run(q, kv1, out=fo))
        except Exception as e:  # a column, never fatal
            notes["flashinfer_failed"] = f"{type(e).__name__}: {e}"[:400]
    fi, fi_eager = t.get("flashinfer_tc"), t.get("flashinfer_tc_eager")
    ns = layers - dl
    ours = t["plan"] + ns * t["layer_host_async"] + dl * (t["store_stock"] + t["dense_split_kv"])
    ours_attn = ns * t["dense_kept"] + dl * t["dense_split_kv"]
    out[key] = {
        "batch": bs, "context": ctx, "layers": layers, "dense_layers": dl, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "hot_tokens": hot,
        "completing_chunk": int(((lens % pol.chunk) == 0).sum()), "ms": t, **notes,
        "step_ms": {
            "offload_keep_v": ours,
            "offload_keep_v_host_in_store": ours + ns * (t["layer"] - t["layer_host_async"]),
            "stock": None if fi is None else layers * (t["store_stock"] + fi),
            "attention": {"offload_keep_v": ours_attn, "stock_flashinfer": None if fi is None else layers * fi},
            "attention_eager": {"offload_keep_v": ns * t["dense_kept_eager"] + dl * t["dense_split_kv_eager"],
                                "stock_flashinfer": None if fi_eager is None else layers * fi_eager},
            "writes": {"offload_keep_v": ns * t["store"] + dl * t["store_stock"], "stock": layers * t["store_stock"],
                       "of_which_host_stores": ns * (t["store_no_summary"] - t["store_no_host"]),
                       "of_which_chunk_means": ns * (t["store"] - t["store_no_summary"])},
            "plan": t["plan"],
        },
        # the general step with m requests demoted (m of ``mixed``): its plan, a sparse layer (store and attention), a
        # dense layer, and the step as step_ms adds it up (with the dense layers' stores)
        "mixed": {str(m): {**tm, "step_ms": tm["step_ms"] + dl * t["store_stock"],
                           **({"step_ms_kept_stream": tm["step_ms_kept_stream"] + dl * t["store_stock"]} if "step_ms_kept_stream" in tm else {})}
                  for m, tm in mixed_ms.items()},
        # the all-dense step's sparse-layer attention per kernel (with ``kernels``), beside the mixed steps'
        **({"dense_kept_kernels_us": dense_kernels} if dense_kernels is not None else {}),
    }
    del pool, stock


#: ``--only NAME``: the timings NAME runs alone (each writes its keys of the result).
ONLY = {
    "keep_v_step": lambda out: time_keep_v_step(out, kernels=kernel_us),
    "layer_timing": lambda out: (time_layer(out), time_layer(out, bs=64, ctx=4608, key="layer_timing_fits")),
    "scores_sweep": lambda out: (time_scores_sweep(out), time_scores_sweep(out, bs=64, ctx=4608, key="scores_sweep_fits")),
    "select_sweep": lambda out: (time_select_sweep(out), time_select_sweep(out, bs=19, ctx=33280, key="select_sweep_h100_batch")),
}


def run_only(name, out, t0, path):
    """``--only name``: that timing alone, written to ``path`` with the seconds it took; prints each key it added
    (a sweep's shipped and best settings only)."""
    before = set(out)
    ONLY[name](out)
    out["seconds"] = round(time.time() - t0, 1)
    results.write(path, out)
    for k in [k for k in out if k not in before and k != "seconds"]:
        v = out[k]
        print(k, {x: v[x] for x in ("shipped", "best")} if isinstance(v, dict) and "best" in v else v, flush=True)
    print("wrote", path, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", choices=tuple(ONLY), default=None,
                    help="run only this timing and write it (keep_v_step: the all-dense and mixed keep-v steps; layer_timing: a "
                         "sparse layer per kernel at 44 x 32K and at 64 x 4.6K, as the full check times them; scores_sweep: the "
                         "scores kernel's launch settings at those two shapes; select_sweep: the top-k's and the estimate's at "
                         "44 x 32K and at the 19 x 33K batch an H100 holds)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("check_offload: needs a CUDA GPU")
    out = results.header()
    t0 = time.time()
    if a.only:
        run_only(a.only, out, t0, a.out)
        return
    check_pinned(out)
    print("pinned", out["pinned"], flush=True)
    check_exact(out)
    print("exactness", out["exactness"], out.get("exact_stats"), flush=True)
    time_layer(out)
    print("layer", out["layer_timing"], flush=True)
    # the fitting workload's shape (64 x 4,096 + 512: offload costs +12.3 % median ITL there): where a sparse layer's time goes
    time_layer(out, bs=64, ctx=4608, key="layer_timing_fits")
    print("layer fits", out["layer_timing_fits"], flush=True)
    try:  # informational timings: a failure here is recorded, the checks above stand
        time_keep_v_step(out)
        print("keep-v step", out["keep_v_step"], flush=True)
    except Exception as e:
        out["keep_v_step_failed"] = f"{type(e).__name__}: {e}"[:600]
        print("keep-v step failed:", out["keep_v_step_failed"], flush=True)
    out["seconds"] = round(time.time() - t0, 1)
    results.write(a.out, out)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
