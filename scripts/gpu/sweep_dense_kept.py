"""The all-dense (keep-v) attention's launch shape on the H200: every position (K at token ids, V at
kept rows, two id lists) at the fitting workload's batch, for each split plan (1 to 18 chunks a
request) and launch configuration, in two launches (``attend_run``: partials, merge) or one
(``split_kv_fused_run`` with the V ids), against FlashInfer's tensor-core decode (SGLang's pick for
this GQA group) and our one-list split-KV on the same bytes. CUDA-graph replays, median of 50
(``check_offload.graph_ms``). Then the fastest configurations again behind the layer's KV store
kernel, in one graph, with and without programmatic dependent launch (PDL only shows with a kernel
before it; FlashInfer behind the same store for reference). The winner goes into ``SplitConfig``
(``dense_min_chunk``, ``dense_fused``, ``dense_pdl``, ``dense_block_n``, ``dense_num_warps``,
``dense_num_stages``: the all-dense step's own settings; ``dense_min_ctas`` is not swept and the pick carries its default;
the pick carries ``chunk_mean=0``, the fixed minimum chunk that was timed, so ``DENSE_LAUNCH=sweep`` turns the default's
``chunk_mean`` off) of
``sglang_elastic/offload/decode.py``, or a server
runs it first as ``--kv-offload-dense-launch`` (the result's ``dense_launch``: the fastest exact row behind the store);
``max_splits`` stays ``scores_max_splits``, as the decoder plans.

    python scripts/gpu/sweep_dense_kept.py --out docs/results/offload_dense_kept_sweep_h200.json [--batch 64 --context 4608]
    python scripts/gpu/sweep_dense_kept.py --out ... --contexts 31x4608,1x65536   # a mix: one long request among short ones

``--contexts`` (``COUNTxLENGTH`` groups) gives each group's requests that context instead of ``--batch`` x ``--context``:
past ``dense_min_chunk`` a request splits and the one launch merges its chunks (+3.5 % median ITL against stock at
32 x 8,448 on an H100, fc8598c), while one long unsplit request leaves every other program waiting for it; the grid's
minimum chunks reach 131,072 (one chunk a request up to that) so both sides of that trade are timed. Before the grid,
the shipped all-dense launch runs behind the store with its ``chunk_mean`` and without it (``baselines``'
``dense_default_behind_store``: each plan's minimum chunk, chunks, time and output check; ``same_plan`` where the mean
context leaves the minimum chunk as it is, or where a request is longer than twice the mean's chunk): on a mix this is the on/off comparison the fixed chunks of the grid do not give.

Issue 24: the fitting load's step differs from stock's mostly in this kernel (``check_offload.py``'s
``keep_v_step``: 0.311 against 0.294 ms a layer at 64 x 4.6K, 2026-12-05). The baselines run first;
the grid stops at ``--budget-s`` (said under ``failed``); writes nothing when no configuration ran.
Each output is checked against the shipped configuration's (``max_abs_diff_vs_shipped``; the best is
taken among those under 2e-2).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time

import torch

from sglang_elastic import results

#: how many of the fastest configurations are timed again behind the KV store, PDL off and on
BEHIND_STORE = 6


def dense_pick(behind: list, shipped_row: "dict | None") -> "dict | None":
    """The fastest behind-the-store row whose output matched (PDL on or off, whichever was faster and exact), as
    ``--kv-offload-dense-launch`` text (``text``), its time (``ms``) and that of ``shipped_row``'s configuration behind
    the store (``shipped_ms``; None when it was not timed there); None when no row qualifies."""
    from sglang_elastic.offload.decode import SplitConfig

    cands = []
    for r in behind:
        for pdl, ms_key, err_key in ((False, "ms", "max_abs_diff"), (True, "ms_pdl", "max_abs_diff_pdl")):
            if ms_key in r and r.get(err_key, 1.0) < 2e-2:
                cands.append((r[ms_key], pdl, r))
    if not cands:
        return None
    ms, pdl, r = min(cands, key=lambda c: c[0])
    # chunk_mean=0: the row's fixed minimum chunk is the plan that was timed (the default's chunk_mean would raise it)
    cfg = SplitConfig(dense_min_chunk=r["min_chunk"], dense_fused=r["fused"], dense_pdl=pdl, dense_block_n=r["block_n"],
                      dense_num_warps=r["num_warps"], dense_num_stages=r["num_stages"], dense_chunk_mean=0)
    keys = ("max_splits", "min_chunk", "block_n", "num_warps", "num_stages", "fused")
    shipped = None if shipped_row is None else next((x for x in behind if all(x[k] == shipped_row[k] for k in keys)), None)
    return {"text": cfg.dense_launch(), "ms": ms, "pdl": pdl, "shipped_ms": shipped.get("ms") if shipped else None}


def default_dense_configs(lens, sp) -> dict:
    """The all-dense step as a server with ``sp`` launches it (``OffloadDecoder.plan``'s ``dense_tuned`` branch), with its
    ``dense_chunk_mean`` (``chunk_mean``) and without it (``chunk_mean0``): the direct on/off comparison that the grid's
    fixed minimum chunks do not give on a batch of mixed lengths (issue 24: ``chunk_mean=125`` was made the default on one
    uniform shape).

    Args:
        lens: ``[bs]`` int32 context lengths (positions), on any device.
        sp: a :class:`~sglang_elastic.offload.decode.SplitConfig`.

    Returns:
        ``{"chunk_mean": cfg, "chunk_mean0": cfg}``, each a grid row's keys (``max_splits``, ``min_chunk``, ``block_n``,
        ``num_warps``, ``num_stages``, ``fused``) plus ``pdl``; ``chunk_mean`` is ``chunk_mean0`` with the minimum chunk
        raised to ``dense_mean_chunk``'s (equal where the mean context is at most ``dense_min_chunk`` / 1.25, where a
        request is longer than twice the mean's chunk, or where ``dense_chunk_mean`` is 0)."""
    def cfg(split) -> dict:
        min_chunk, block_n = split.dense_plan(lens, len(lens))  # as the decoder plans the all-dense step
        return dict(max_splits=split.scores_max_splits, min_chunk=int(min_chunk), block_n=block_n, num_warps=split.dense_num_warps,
                    num_stages=split.dense_num_stages, fused=bool(split.dense_fused), pdl=bool(split.dense_pdl))

    return {"chunk_mean": cfg(sp), "chunk_mean0": cfg(dataclasses.replace(sp, dense_chunk_mean=0))}


def plan_key(fused: bool, block_n: int, num_warps, num_stages, chunk: list, nsplit: list) -> tuple:
    """What a configuration launches (the kernel, its launch shape and its split plan: ``chunk`` / ``nsplit`` per request,
    as ``split_kv_plan`` gives them), so that configurations giving the same launch are timed once; two minimum chunks
    at or above every context give the same one-chunk plan (``split_kv_plan`` rounds a one-chunk request's chunk to its
    length)."""
    return (bool(fused), int(block_n), num_warps, num_stages, tuple(int(c) for c in chunk), tuple(int(n) for n in nsplit))


def parse_contexts(text: str) -> list:
    """``--contexts`` text (``COUNTxLENGTH`` groups, comma-separated, e.g. ``31x4608,1x65536``) as one context a request.

    Raises:
        ValueError: a group not ``COUNTxLENGTH`` with COUNT >= 1 and LENGTH >= 16 (the one-line reason)."""
    lens = []
    for group in text.split(","):
        count, sep, length = group.strip().partition("x")
        if not sep or not count.isdigit() or not length.isdigit() or int(count) < 1 or int(length) < 16:
            raise ValueError(f"--contexts {text!r}: group {group!r} is not COUNTxLENGTH with COUNT >= 1 and LENGTH >= 16")
        lens += [int(length)] * int(count)
    return lens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the result JSON (written only when a configuration ran)")
    ap.add_argument("--batch", type=int, default=None, help="requests (default 64)")
    ap.add_argument("--context", type=int, default=None, help="positions a request (default 4608)")
    ap.add_argument("--contexts", default=None, help="COUNTxLENGTH groups, comma-separated (e.g. 31x4608,1x65536): "
                    "each group's requests get that context, in place of --batch x --context")
    ap.add_argument("--pick-file", default=None, help="also write the pick's --kv-offload-dense-launch text here")
    ap.add_argument("--budget-s", type=float, default=300.0, help="seconds for the grid (the baselines and the PDL pass come on top)")
    a = ap.parse_args(argv)
    if a.contexts is not None and (a.batch is not None or a.context is not None):
        ap.error("--contexts gives every request's context: leave out --batch and --context")
    a.batch, a.context = 64 if a.batch is None else a.batch, 4608 if a.context is None else a.context
    if a.batch < 1 or a.context < 16 or a.budget_s <= 0:
        ap.error(f"--batch {a.batch} / --context {a.context} / --budget-s {a.budget_s}: give >= 1 / >= 16 / > 0")
    try:
        contexts = parse_contexts(a.contexts) if a.contexts is not None else [a.context] * a.batch
    except ValueError as e:
        ap.error(str(e))
    if sum(contexts) > 1 << 22:  # K and V buffers of twice the positions at 8 x 128 bf16: 8 KiB a position, 32 GiB at this cap
        ap.error(f"{len(contexts)} requests of {sum(contexts):,} positions in all: at most {1 << 22:,} (8 KiB of buffers a position)")
    if not torch.cuda.is_available():
        print("sweep_dense_kept: needs a CUDA GPU", file=sys.stderr)
        return 1
    sys.path.insert(0, "scripts/gpu")
    from check_offload import graph_ms

    from sglang_elastic.kernels.decode_attention import split_kv_fused_counters, split_kv_fused_run, split_kv_plan, split_kv_run
    from sglang_elastic.kernels.offload import attend_run, store_sparse_run
    from sglang_elastic.offload.decode import SplitConfig

    HQ, HKV, D, bs, ctx = 32, 8, 128, len(contexts), max(contexts)
    t0 = time.time()
    g = torch.Generator(device="cuda").manual_seed(7)
    lens = torch.tensor(contexts, device="cuda") - torch.randint(0, 16, (bs,), device="cuda", generator=g)
    total = int(lens.sum())
    size = 2 * total + 64
    kb = torch.randn(size, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vb = torch.randn(size, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(size - 1, device="cuda", generator=g) + 1
    kidx, vidx = perm[:total].to(torch.int32), perm[total: 2 * total].to(torch.int32)
    indptr = torch.zeros(bs + 1, dtype=torch.int32, device="cuda")
    indptr[1:] = torch.cumsum(lens, 0)
    # the store before the attention (PDL pass), as a decode step's: each request's newest K / V row, which its attention reads
    last = (indptr[1:] - 1).to(torch.int64)
    loc, keep_rows = kidx[last].to(torch.int64), vidx[last].to(torch.int64)
    new_k, new_v = (torch.randn(bs, HKV, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    q = (2 * torch.randn(bs, HQ, D, device="cuda", generator=g)).bfloat16()
    scale = D ** -0.5
    mid_o = torch.empty(bs * 64, HQ, D, device="cuda", dtype=torch.float32)
    mid_lse = torch.empty(bs * 64, HQ, device="cuda", dtype=torch.float32)
    chunk, nsplit = torch.zeros(bs, dtype=torch.int32, device="cuda"), torch.zeros(bs, dtype=torch.int32, device="cuda")
    counters = split_kv_fused_counters(bs, HKV, "cuda")
    sp = SplitConfig()

    def store():
        store_sparse_run(new_k, new_v, kb, vb, vb, loc, None, keep_rows, host=False)

    old_k, old_v = kb[loc].clone(), vb[keep_rows].clone()

    def stale():  # the rows as they were before the store: an attention that did not wait for the store reads these
        kb.index_copy_(0, loc, old_k)
        vb.index_copy_(0, keep_rows, old_v)

    store()  # the step's newest rows in place (every later store writes the same): ref is the step's true output
    # baselines first (FlashInfer's first use compiles: it must not be what the budget cuts)
    base = {}
    # a server takes the all-dense launch settings only at bs x kv_heads >= dense_min_ctas (OffloadDecoder.plan); below,
    # the sweep still times them, but the pick does not apply to this shape
    head = dict(batch=bs, context=ctx, contexts=a.contexts, q_heads=HQ, kv_heads=HKV, head_dim=D,
                dense_launch_applies=bs * HKV >= sp.dense_min_ctas)
    if not head["dense_launch_applies"]:
        print(f"sweep_dense_kept: {bs} x {HKV} KV heads < dense_min_ctas {sp.dense_min_ctas}: a server plans this batch the "
              "earlier way, so the pick does not apply to it", file=sys.stderr)
    split_kv_plan(indptr, sp.scores_max_splits, sp.scores_min_chunk, sp.scores_block_n, chunk, nsplit)
    ref = torch.empty_like(q)
    attend_run(q, kb, vb, indptr, kidx, vidx, chunk, nsplit, sp.scores_max_splits, mid_o, mid_lse, ref, None, scale, sp.scores_block_n)
    o2 = torch.empty_like(q)
    base["split_kv_one_list_shipped_ms"] = graph_ms(lambda: split_kv_run(q, kb, vb, indptr, kidx, chunk, nsplit, sp.scores_max_splits,
                                                                         mid_o, mid_lse, o2, scale, sp.scores_block_n))
    fi_run = None
    try:
        import flashinfer

        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=torch.empty_like(indptr), paged_kv_indices_buffer=torch.empty_like(kidx),
            paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device="cuda"))
        w.plan(indptr, kidx, torch.ones(bs, dtype=torch.int32, device="cuda"), HQ, HKV, D, 1, q_data_type=torch.bfloat16,
               kv_data_type=torch.bfloat16, sm_scale=scale)
        fo = torch.empty_like(q)

        def fi_run():
            w.run(q, (kb.view(-1, 1, HKV, D), vb.view(-1, 1, HKV, D)), out=fo)

        base["flashinfer_tc_ms"] = graph_ms(fi_run)
    except Exception as e:
        base["flashinfer_failed"] = f"{type(e).__name__}: {e}"[:300]
        fi_run = None
    base["store_ms"] = graph_ms(store)

    def attention(cfg, o, pdl=False):
        """The launch of configuration ``cfg`` (its plan must be in ``chunk`` / ``nsplit``)."""
        ms, bn, nw, ns = cfg["max_splits"], cfg["block_n"], cfg["num_warps"], cfg["num_stages"]
        if cfg["fused"]:
            return lambda: split_kv_fused_run(q, kb, vb, indptr, kidx, chunk, ms, mid_o, mid_lse, o, counters, scale, bn, num_warps=nw,
                                              num_stages=ns, v_indices=vidx, pdl=pdl)
        return lambda: attend_run(q, kb, vb, indptr, kidx, vidx, chunk, nsplit, ms, mid_o, mid_lse, o, None, scale, bn, num_warps=nw,
                                  num_stages=ns, pdl=pdl)

    def behind_store(fn, o) -> tuple:
        """``fn``'s time behind the layer's KV store in one graph, ms, and its output's largest difference from ``ref``,
        checked in a graph that first puts the stale rows back: the store must land before the reads (each replay
        writes the same rows again: the output must equal ref whichever way the launches overlap)."""
        o.fill_(float("nan"))
        ms = graph_ms(lambda: (store(), fn()))
        o.fill_(float("nan"))
        graph_ms(lambda: (stale(), store(), fn()), reps=3)
        return ms, float((o.float() - ref.float()).abs().max())

    # the shipped all-dense launch with and without its chunk_mean, behind the store (before the grid: no budget cuts it)
    defaults = {}
    for name, cfg in default_dense_configs(lens.to(torch.int32), sp).items():
        split_kv_plan(indptr, cfg["max_splits"], cfg["min_chunk"], cfg["block_n"], chunk, nsplit)
        o = torch.empty_like(q)
        d = {**cfg, "chunks": int(nsplit.max())}
        try:
            d["ms"], d["max_abs_diff"] = behind_store(attention(cfg, o, pdl=cfg["pdl"]), o)
        except Exception as e:
            d["error"] = f"{type(e).__name__}: {e}"[:200]
        defaults[name] = d
    same = defaults["chunk_mean"]["min_chunk"] == defaults["chunk_mean0"]["min_chunk"]
    base["dense_default_behind_store"] = {**defaults, "same_plan": same}
    rows, failed, timed = [], [], {}  # timed: plan_key -> its row (None: it failed)
    t_grid = time.time()

    def partial():  # what a call cut off by its time limit still leaves
        results.write(a.out, {**results.header(), **head, "incomplete": True, "baselines": base, "rows": rows, "failed": failed})
    # only what SplitConfig can set for the all-dense step: dense_min_chunk up to 131072 (1 to 18 chunks a request at 4.6K;
    # a larger one that gives a plan already timed is skipped, so 8192 keeps its row where it already means one chunk),
    # dense_fused (the one-launch kernel with the V ids: no merge launch, a one-chunk request written directly), dense_block_n,
    # dense_num_warps / dense_num_stages; max_splits is scores_max_splits, as the decoder plans. Plans that give the same chunks
    # as one already timed are skipped.
    ms = sp.scores_max_splits
    # Triton's default warps and stages first over every plan, block and launch count, so a budget that runs out
    # leaves the launch-shape variations out rather than the one-launch kernel
    grid = itertools.product(((None, None), (4, None), (8, None), (None, 2), (None, 3), (4, 2), (4, 3), (8, 2), (8, 3)),
                             (64, 32, 128), (8192, 16384, 131072, 4096, 2048, 1024, 512, 256), (True, False))
    for (nw, ns), bn, mc, fused in grid:
        if time.time() - t_grid > a.budget_s:
            failed.append({"stopped": f"time budget ({a.budget_s:.0f} s) reached; later configurations not run"})
            break
        cfg = dict(max_splits=ms, min_chunk=mc, block_n=bn, num_warps=nw, num_stages=ns, fused=fused)
        split_kv_plan(indptr, ms, mc, bn, chunk, nsplit)
        key = plan_key(fused, bn, nw, ns, chunk.tolist(), nsplit.tolist())
        if key in timed:
            continue
        timed[key] = None
        cfg["chunks"] = int(nsplit.max())
        o = torch.empty_like(q)
        try:
            fn = attention(cfg, o)
            fn()
            err = float((o.float() - ref.float()).abs().max())
            t = graph_ms(fn)
            err = max(err, float((o.float() - ref.float()).abs().max()))  # also after the graph's replays (the fused counters)
            rows.append({**cfg, "ms": t, "max_abs_diff_vs_shipped": err})
            timed[key] = rows[-1]
        except Exception as e:  # a configuration the compiler or the shared memory refuses
            failed.append({**cfg, "error": f"{type(e).__name__}: {e}"[:200]})
        else:
            if len(rows) % 20 == 0:
                partial()
    if not rows:
        print("sweep_dense_kept: no configuration ran; nothing written", file=sys.stderr)
        return 1
    ok = [r for r in rows if r["max_abs_diff_vs_shipped"] < 2e-2]
    # the shipped configuration's row: the row of the same launch (another minimum chunk may have given its plan first)
    split_kv_plan(indptr, sp.scores_max_splits, sp.scores_min_chunk, sp.scores_block_n, chunk, nsplit)
    shipped_row = timed.get(plan_key(False, sp.scores_block_n, None, None, chunk.tolist(), nsplit.tolist()))
    # behind the store: the fastest configurations and the shipped one, PDL off and on, in one graph with the store; the
    # store writes each request's newest row, so an attention that did not wait for it reads stale rows (checked)
    behind = []
    picks = sorted(ok, key=lambda r: r["ms"])[:BEHIND_STORE] + ([shipped_row] if shipped_row is not None else [])
    for r in {id(r): r for r in picks}.values():
        split_kv_plan(indptr, r["max_splits"], r["min_chunk"], r["block_n"], chunk, nsplit)
        o = torch.empty_like(q)
        row = {k: r[k] for k in ("max_splits", "min_chunk", "block_n", "num_warps", "num_stages", "fused", "chunks")}
        for pdl in (False, True):
            try:
                row["ms_pdl" if pdl else "ms"], row["max_abs_diff_pdl" if pdl else "max_abs_diff"] = behind_store(attention(r, o, pdl=pdl), o)
            except Exception as e:
                row["error_pdl" if pdl else "error"] = f"{type(e).__name__}: {e}"[:200]
        behind.append(row)
    if fi_run is not None:
        base["flashinfer_tc_behind_store_ms"] = graph_ms(lambda: (store(), fi_run()))
    best = min(ok, key=lambda r: r["ms"]) if ok else None
    pick = dense_pick(behind, shipped_row)
    out = results.header()
    out.update(**head, seconds=round(time.time() - t0, 1), shipped=shipped_row,
               best=best, dense_launch=pick, baselines=base, behind_store=sorted(behind, key=lambda r: min(r.get("ms", 9e9), r.get("ms_pdl", 9e9))),
               rows=sorted(rows, key=lambda r: r["ms"]), failed=failed)
    results.write(a.out, out)
    print("shipped", shipped_row, "\nbest", best, "\nbaselines", base, "\nfailed", len(failed))
    if pick is not None:
        print(f"dense_launch {pick['text']}  ({pick['ms']:.4f} ms behind the store; shipped {pick['shipped_ms']} ms)")
        if a.pick_file:
            with open(a.pick_file, "w") as f:
                f.write(pick["text"] + "\n")
    for r in out["behind_store"]:
        print("behind store", r)
    for r in sorted(rows, key=lambda r: r["ms"])[:12]:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
