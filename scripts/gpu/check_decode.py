"""GPU correctness (large shapes) and first timings of the decode kernels.

For each case: random bf16 Q/K/V (Hq=32, Hkv=8, d=128, pages of 16 scattered
over a 1M-token pool), ``split_kv_decode`` and ``work_queue_decode`` against a
float32-accumulated torch reference (float64 for B1), then kernel time with
``triton.testing.do_bench`` (median, L2 flushed by do_bench between runs) and
the KV read bandwidth it implies. Not the issue's benchmark
(``scripts/gpu/bench_decode.py``: FlashInfer baselines, CUDA graphs, policy):
a first look at where the kernels stand.

    python scripts/gpu/check_decode.py --out docs/results/decode_check_h200.json
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton

from sglang_elastic import results
from sglang_elastic.kernels.decode_attention import split_kv_decode, work_queue_decode

HQ, HKV, D, PAGE, POOL = 32, 8, 128, 16, 1 << 20


def make(lens, g):
    k = torch.randn(POOL, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(POOL, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(len(lens), HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    pages = torch.randperm(POOL // PAGE - 1, device="cuda", generator=g) + 1
    idx, used = [], 0
    for n in lens:
        need = -(-n // PAGE)
        p = pages[used : used + need]
        used += need
        idx.append((p[:, None] * PAGE + torch.arange(PAGE, device="cuda")).flatten()[:n])
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device="cuda")
    indptr[1:] = torch.cumsum(torch.tensor(lens, device="cuda"), 0)
    return q, k, v, indptr, torch.cat(idx).to(torch.int32)


def reference(q, k, v, indptr, idx):
    out = torch.empty(q.shape, dtype=torch.float64, device="cuda")
    G = HQ // HKV
    for b in range(q.shape[0]):
        ids = idx[indptr[b] : indptr[b + 1]].long()
        K = k[ids].double().repeat_interleave(G, 1)  # [n, Hq, D]
        V = v[ids].double().repeat_interleave(G, 1)
        s = torch.einsum("hd,nhd->hn", q[b].double(), K) * D**-0.5
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), V)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    zipf = [int(1024 + 60 * 1024 / (r + 1) ** 1.1) for r in range(32)]
    cases = [
        ("B1_32K", [32768]),
        ("B1_128K", [131072]),
        ("B8_2x64K_6x4K", [65536] * 2 + [4096] * 6),
        ("B32_zipf_1K-61K", zipf),
        ("B64_8x32K_56x2K", [32768] * 8 + [2048] * 56),
        ("B1_128K_among_1token", [131072] + [1] * 15),
    ]
    rows = []
    for name, lens in cases:
        q, k, v, indptr, idx = make(lens, g)
        ref = reference(q, k, v, indptr, idx)
        kv_bytes = sum(lens) * HKV * D * 2 * 2
        max_items = len(lens) * -(-max(lens) // 512)
        row = {"name": name, "batch": len(lens), "tokens": sum(lens), "kv_mb": kv_bytes / 1e6}
        for label, fn_out in (
            ("split", lambda o: split_kv_decode(q, k, v, indptr, idx, max_splits=64, min_chunk=512, out=o)),
            ("work_queue", lambda o: work_queue_decode(q, k, v, indptr, idx, chunk=512, max_items=max_items, programs=132, out=o)),
        ):
            fn = lambda: fn_out(None)  # noqa: E731
            out = fn()
            err = ((out.double() - ref).norm() / ref.norm()).item()
            us = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
            # The same call captured in a CUDA graph (as SGLang decodes): no
            # host launch gaps, so this is the kernels' own time.
            graph_out = torch.empty_like(out)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn_out(graph_out)  # warm-up outside capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn_out(graph_out)
            graph.replay()
            torch.cuda.synchronize()
            graph_err = ((graph_out.double() - ref).norm() / ref.norm()).item()
            graph_us = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3
            row[f"{label}_rel_err"] = max(err, graph_err)
            row[f"{label}_us"] = us
            row[f"{label}_tbps"] = kv_bytes / (us * 1e-6) / 1e12
            row[f"{label}_graph_us"] = graph_us
            row[f"{label}_graph_tbps"] = kv_bytes / (graph_us * 1e-6) / 1e12
        rows.append(row)
        print(f"{name:24s} split eager {row['split_us']:7.1f} graph {row['split_graph_us']:7.1f} us ({row['split_graph_tbps']:.2f} TB/s, err {row['split_rel_err']:.1e}) | queue eager {row['work_queue_us']:7.1f} graph {row['work_queue_graph_us']:7.1f} us ({row['work_queue_graph_tbps']:.2f} TB/s, err {row['work_queue_rel_err']:.1e})", flush=True)
    res = {
        **results.header(),
        "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "page_size": PAGE, "dtype": "bfloat16"},
        "note": "do_bench median (L2 flushed between runs); *_us eager launches, *_graph_us the same call replayed from a CUDA graph; both include the merge kernel and the GPU-side chunk/item computation",
        "cases": rows,
    }
    results.write(a.out, res)
    if any(r[f"{l}_rel_err"] > 1e-2 for r in rows for l in ("split", "work_queue")):
        sys.exit(1)


if __name__ == "__main__":
    main()
