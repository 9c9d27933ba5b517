"""Same-host A/B of two versions of our decode kernels on the H200: a
baseline ``decode_attention.py`` (a file, e.g. an earlier commit's) against
the installed ``sglang_elastic.kernels.decode_attention``, on the issue's
cases, with the same kernel configs, timed alternately (three rounds,
medians of ``bench_decode.graph_us``: CUDA-graph replay, L2 flushed), and
their outputs compared bit for bit.

    git show 65ef667:kernels/decode_attention.py > .gpu/ab/base_decode_attention.py
    python scripts/gpu/bench_decode_ab.py --baseline .gpu/ab/base_decode_attention.py \\
        --baseline-label 65ef667 --out docs/results/decode_ab_h200.json

Configs: the shipped calibration's split and compact configs, plus
``--extra-split`` ones (``block_n:num_warps:num_stages``, the shipped
``min_chunk`` and ``max_splits``; chunks round up to a multiple of
``block_n``, so another ``block_n`` may cut a request differently).
Shape and KV pool as ``scripts/gpu/bench_decode.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib.util
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as bd  # noqa: E402  (Ours, graph_us, make_indices, the shape)

from sglang_elastic import results  # noqa: E402
from sglang_elastic.attention import bench  # noqa: E402
from sglang_elastic.attention.policy import load_calibration  # noqa: E402
from sglang_elastic.kernels import decode_attention as current  # noqa: E402

ROUNDS = 3


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("baseline_decode_attention", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="the baseline decode_attention.py")
    ap.add_argument("--baseline-label", required=True, help="what the baseline is (e.g. the commit it came from)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--extra-split", default="64:4:3,64:4:4,128:4:3", help="more split configs, block_n:num_warps:num_stages, comma-separated")
    ap.add_argument("--page-sizes", default="16", help="comma-separated")
    a = ap.parse_args()
    t0 = time.time()
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(bd.POOL, bd.HKV, bd.D, device="cuda", dtype=bd.DT, generator=g)
    v = torch.randn(bd.POOL, bd.HKV, bd.D, device="cuda", dtype=bd.DT, generator=g)
    base_mod = load_module(a.baseline)
    shipped = load_calibration()
    configs = [("split", shipped), ("compact", shipped)]
    for spec in filter(None, a.extra_split.split(",")):
        bn, nw, ns = (int(x) for x in spec.split(":"))
        configs.append(("split", dataclasses.replace(shipped, split=dataclasses.replace(shipped.split, block_n=bn, num_warps=nw, num_stages=ns,
                                                                                         min_chunk=max(bn, shipped.split.min_chunk)))))
    rows = []
    for page_size in map(int, a.page_sizes.split(",")):
        for case in bench.bench_cases():
            lens, B = case["lens"], len(case["lens"])
            indptr, idx, _, _ = bd.make_indices(lens, page_size, g)
            q = torch.randn(B, bd.HQ, bd.D, device="cuda", dtype=bd.DT, generator=g)
            for path, cal in configs:
                cfg = getattr(cal, path)
                outs, fns, times = {}, {}, {"baseline": [], "current": []}
                for name, mod in (("baseline", base_mod), ("current", current)):
                    outs[name] = torch.full_like(q, float("nan"))
                    ours = bd.Ours(cal, kernels=mod)
                    ours.plan(path, indptr)
                    fns[name] = functools.partial(ours.run, path, q, k, v, indptr, idx, outs[name])
                for r in range(ROUNDS):  # alternate the order (ABBA...), so drift and warm-up hit both alike
                    for name in (("baseline", "current") if r % 2 == 0 else ("current", "baseline")):
                        times[name].append(bd.graph_us(fns[name]))
                b, c = statistics.median(times["baseline"]), statistics.median(times["current"])
                row = {"case": case["name"], "page_size": page_size, "path": path, "config": dataclasses.asdict(cfg),
                       "baseline_us": b, "current_us": c, "speedup": b / c, "bit_equal": bool(torch.equal(outs["baseline"], outs["current"])),
                       "current_read_tbps": bench.kv_bytes(lens) / (c * 1e-6) / 1e12, "rounds_us": times}
                rows.append(row)
                print(f"p{page_size:<2d} {case['name']:18s} {path:7s} bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}: "
                      f"{b:7.1f} -> {c:7.1f} us ({b / c:.3f}x) bit-equal {row['bit_equal']}", flush=True)
    with open(a.baseline, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    res = {**results.header(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "baseline": {"label": a.baseline_label, "sha256": sha},
           "shape": {**bench.SHAPE, "dtype": "bfloat16"}, "rounds": ROUNDS,
           "timing": "us per layer, CUDA-graph replay, do_bench median with L2 flush; baseline and current alternate (ABBA), median of the rounds",
           "rows": rows, "gpu_seconds": round(time.time() - t0, 1)}
    results.write(a.out, res)
    bad = [r for r in rows if not r["bit_equal"]]
    if bad:
        print(f"outputs differ in {len(bad)} row(s)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
