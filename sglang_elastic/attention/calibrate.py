"""Fit the decode policy's cost constants to measured timings.

``scripts/gpu/bench_decode.py`` times every path on its cases (CUDA-graph
replay, L2 flushed) and calls :func:`fit_calibration`; the result is the
calibration JSON the ``persistentkv`` backend reads
(:mod:`sglang_elastic.attention.policy`). Pure Python: unit-tested on the CPU.

``python -m sglang_elastic.attention.calibrate --provisional OUT`` writes the
provisional H200 file shipped until the benchmark's own (see
:func:`provisional_h200_cases`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from sglang_elastic.attention.policy import (
    PATHS, Calibration, CompactConfig, PathCost, SplitConfig, calibration_from_dict, path_stats, path_time_us,
)

#: (lengths, measured us) pairs of one path.
Cases = Sequence[Tuple[Sequence[int], float]]


def _loss(cost: PathCost, path: str, cases: Cases, calib: Calibration, shape: dict) -> float:
    err = 0.0
    for lens, us in cases:
        pred = path_time_us(cost, path_stats(path, lens, calib, shape["kv_heads"]), batch=len(lens), sm_count=calib.sm_count,
                            merge_tbps=calib.merge_tbps, **shape)
        err += math.log(pred / us) ** 2
    return err / max(1, len(cases))


def fit_path(path: str, cases: Cases, calib: Calibration, shape: dict, rounds: int = 60) -> Tuple[PathCost, float]:
    """Coordinate descent in log space over ``launch_us``, ``bw_tbps``, ``cta_gbps``
    (``ctas_per_sm`` kept) minimising the mean squared log error.

    Returns:
        ``(cost, rms relative error)``.

    Raises:
        ValueError: with no cases or a non-positive measured time.
    """
    if not cases:
        raise ValueError(f"no timings to fit path {path!r}")
    if any(not (us > 0 and math.isfinite(us)) for _, us in cases):
        raise ValueError(f"path {path!r}: measured times must be positive and finite")
    bounds = {"launch_us": (0.5, 500.0), "bw_tbps": (0.05, 20.0), "cta_gbps": (0.5, 5000.0)}
    cost = calib.paths[path]
    best = _loss(cost, path, cases, calib, shape)
    for _ in range(rounds):
        improved = False
        for field, (lo, hi) in bounds.items():
            for f in (0.5, 0.8, 0.95, 1.05, 1.25, 2.0):
                v = min(hi, max(lo, getattr(cost, field) * f))
                cand = dataclasses.replace(cost, **{field: v})
                loss = _loss(cand, path, cases, calib, shape)
                if loss < best - 1e-12:
                    cost, best, improved = cand, loss, True
        if not improved:
            break
    return cost, math.sqrt(best)


def fit_calibration(
    timings: Dict[str, Cases], *, gpu: str, sm_count: int, q_heads: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2,
    start: Optional[Calibration] = None, source: str = "", provisional: bool = False, stream_read_tbps: Optional[float] = None,
    split: Optional[SplitConfig] = None, compact: Optional[CompactConfig] = None, shape: Optional[dict] = None,
    keep_unmeasured: bool = False,
) -> Tuple[Calibration, Dict[str, float]]:
    """Fit every path's constants to its timings.

    Args:
        timings: ``{path: [(lengths, us), ...]}`` for each of ``flashinfer``, ``split``, ``compact``.
        start: starting constants (default: a neutral start); its kernel configs are kept unless
            ``split`` / ``compact`` are given (the configs the timings were taken with).
        shape: the calibration's ``shape`` (what the timings were measured on; default ``start``'s).
        keep_unmeasured: a path without timings keeps ``start``'s constants (a path this
            server cannot run) instead of raising.

    Returns:
        ``(calibration, {path: rms relative error of the fit})``.

    Raises:
        ValueError: a path without timings.
    """
    neutral = {p: PathCost(launch_us=10.0, bw_tbps=3.0, cta_gbps=50.0, ctas_per_sm=2) for p in PATHS}
    calib = start or Calibration(gpu=gpu, sm_count=sm_count, paths=neutral)
    calib = dataclasses.replace(calib, gpu=gpu, sm_count=sm_count, source=source, provisional=provisional,
                                stream_read_tbps=stream_read_tbps, split=split or calib.split, compact=compact or calib.compact,
                                shape=shape if shape is not None else calib.shape)
    layer = dict(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes)
    paths, errs = dict(calib.paths), {}
    for p in PATHS:
        if p not in timings or (keep_unmeasured and not timings[p]):
            if keep_unmeasured:
                continue
            raise ValueError(f"no timings for path {p!r}")
        paths[p], errs[p] = fit_path(p, timings[p], calib, layer)
    calib = dataclasses.replace(calib, paths=paths, fit_rms_rel_err={**calib.fit_rms_rel_err, **{p: min(1.0, round(e, 4)) for p, e in errs.items()}})
    calibration_from_dict(calib.to_json())  # the fitted values must pass the loader's checks
    return calib, errs


# ---------------------------------------------------------------------------
# the startup measurement (server start, during CUDA-graph capture)
# ---------------------------------------------------------------------------

#: Margin of a calibration measured on its own shape (ours >= 3 % faster than FlashInfer).
MEASURED_MARGIN = 0.03
#: One timed launch: ``timer(fn) -> us`` (the GPU one: :func:`graph_timer`; tests inject theirs).
Timer = Callable[[Callable[[], None]], float]


def probe_cases(max_batch: int, max_len: int, max_tokens: int) -> List[List[int]]:
    """The batches the startup measurement times: one long request at four
    lengths, small and large even batches, a Zipf batch and mixed ones
    (stragglers past FlashInfer's split limit): the regimes the cost model
    separates. Clamped to the server's limits (lengths to ``max_len``,
    batches to ``max_batch``, each batch's tokens scaled down to
    ``max_tokens``); duplicates dropped.
    """
    K = 1024
    zipf = [int(1024 + 60 * 1024 / (r + 1) ** 1.1) for r in range(32)]
    want = [[2 * K], [8 * K], [32 * K], [128 * K], [32 * K] * 4, [64 * K] * 2 + [4 * K] * 6, [8 * K] * 16, zipf,
            [32 * K] * 8 + [2 * K] * 56, [8 * K] * 64, [2 * K] * 256, [512] * 256]
    out: List[List[int]] = []
    for lens in want:
        lens = [max(1, min(int(n), max_len)) for n in lens][: max(1, max_batch)]
        total = sum(lens)
        if total > max_tokens:
            f = max_tokens / total
            lens = [max(1, int(n * f)) for n in lens]
        if lens not in out:
            out.append(lens)
    return out


def measure(paths: Sequence[str], cases: Sequence[Sequence[int]], make_launch: Callable[[str, Sequence[int]], Callable[[], None]],
            timer: Timer) -> Dict[str, list]:
    """``{path: [(lens, us), ...]}``: ``timer(make_launch(path, lens))`` for every path and case."""
    return {p: [(list(lens), float(timer(make_launch(p, lens)))) for lens in cases] for p in paths}


def calibrate_shape(key, prior: Calibration, paths: Sequence[str], make_launch, timer: Timer, cases: Sequence[Sequence[int]],
                    dtype_bytes: int = 2) -> Tuple[Calibration, Dict[str, float], Dict[str, list]]:
    """The startup measurement: time ``paths`` on ``cases`` and fit a calibration
    for ``key`` (:class:`sglang_elastic.attention.calibration_cache.ShapeKey`)
    starting from ``prior`` (its kernel configs are kept: the workspaces were
    sized for them; paths not in ``paths`` keep the prior's constants).

    Returns:
        ``(calibration, fit rms relative error per path, the timings)``.
    """
    t = measure(paths, cases, make_launch, timer)
    calib, errs = fit_calibration(
        t, gpu=key.gpu, sm_count=key.sm_count, q_heads=key.q_heads, kv_heads=key.kv_heads, head_dim=key.head_dim,
        dtype_bytes=dtype_bytes, start=prior, provisional=False, shape=key.shape(), keep_unmeasured=True,
        source=f"startup measurement (sglang_elastic.attention.calibrate.calibrate_shape): {len(cases)} batches x {', '.join(paths)}",
        stream_read_tbps=prior.stream_read_tbps)
    # measured constants need only the usual margin (the prior's wider one hedged its guess)
    return dataclasses.replace(calib, margin=min(prior.margin, MEASURED_MARGIN)), errs, t


def graph_timer(reps: int = 20) -> Timer:
    """The GPU timer of the startup measurement: ``fn`` captured once in a CUDA
    graph (as the server replays it), replayed ``reps`` times between CUDA
    events after two warm replays; the median in us. Runs at server start,
    before serving, so its synchronisations cost nothing per step."""

    def timer(fn) -> float:
        import torch

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        g.replay()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for a, b in ev:
            a.record()
            g.replay()
            b.record()
        torch.cuda.synchronize()
        ts = sorted(a.elapsed_time(b) * 1e3 for a, b in ev)
        del g
        return ts[len(ts) // 2]

    return timer


def _check_decode_zipf() -> List[int]:
    return [int(1024 + 60 * 1024 / (r + 1) ** 1.1) for r in range(32)]


def provisional_h200_cases() -> Dict[str, Cases]:
    """Timings behind the provisional H200 calibration (Hq=32, Hkv=8, d=128, bf16, page 16).

    ``split`` / ``compact``: graph-replay medians of ``docs/results/decode_check_h200.json``
    (commit 14cac14, ``split: max_splits=64, min_chunk=512``; ``queue: chunk=512,
    programs=132``: the fixed-chunk queue, modelled here by ``target_items`` large
    enough that the 512 floor applies). ``flashinfer``: the tensor-core column of
    ``shared/design/decode-attention-anchors.md`` section 2 (FlashInfer 0.5.3, another
    run on an H200: context, not a same-run comparison).
    """
    B8 = [65536] * 2 + [4096] * 6
    B64 = [32768] * 8 + [2048] * 56
    one_long = [131072] + [1] * 15
    return {
        "split": [([32768], 83.58), ([131072], 181.09), (B8, 216.96), (_check_decode_zipf(), 309.65), (B64, 426.4), (one_long, 200.3)],
        "compact": [([32768], 65.34), ([131072], 198.08), (B8, 234.88), (_check_decode_zipf(), 316.06), (B64, 448.9), (one_long, 198.4)],
        "flashinfer": [
            ([4096], 19.0), ([8192], 24.4), ([16384], 35.0), ([32768], 52.8), ([65536], 83.1), ([131072], 143.9),
            ([32768] * 4, 140.4), ([65536] + [4096] * 3, 94.0), ([32768] * 8, 256.8), (B8, 164.8),
            ([131072] + [2048] * 7, 159.9), ([16384] * 8, 140.7), ([8192] * 16, 141.2), ([32768] * 4 + [4096] * 12, 190.4),
            ([4096] * 64, 259.1), ([8192] * 64, 491.3), (B64, 572.3),
        ],
    }


def provisional_h200() -> Tuple[Calibration, Dict[str, float]]:
    # the measured run's plans: no batch-dependent minimum chunk then
    split = SplitConfig(max_splits=64, min_chunk=512, block_n=32, partial_budget=4096, min_chunk_large=0)
    compact = CompactConfig(target_items=1 << 20, min_chunk=512, programs=132, block_n=32)
    calib, errs = fit_calibration(
        provisional_h200_cases(), gpu="NVIDIA H200", sm_count=132, q_heads=32, kv_heads=8, head_dim=128,
        source="PROVISIONAL: fitted by sglang_elastic.attention.calibrate.provisional_h200 to "
               "docs/results/decode_check_h200.json (ours, commit 14cac14, graph replay) and the FlashInfer 0.5.3 "
               "tensor-core numbers of shared/design/decode-attention-anchors.md (another run); replace with the "
               "file scripts/gpu/bench_decode.py writes",
        provisional=True, stream_read_tbps=4.27, split=split, compact=compact,
        shape={"q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16", "page_sizes": [16]},
    )
    # the fixed-chunk queue of the measured run; the backend's default plan is target_items-driven
    calib = dataclasses.replace(calib, compact=CompactConfig(target_items=1024, min_chunk=512, programs=132, block_n=32))
    # and the batch-dependent minimum chunk the backend plans with now (SplitConfig's default)
    calib = dataclasses.replace(calib, split=dataclasses.replace(calib.split, min_chunk_large=SplitConfig.min_chunk_large))
    return calib, errs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provisional", metavar="OUT", required=True, help="write the provisional H200 calibration to OUT")
    a = ap.parse_args(argv)
    calib, errs = provisional_h200()
    d = calib.to_json()  # fit_rms_rel_err included (rounded to 4 digits by the fit)
    with open(a.provisional, "w") as f:
        json.dump(d, f, indent=2)
        f.write("\n")
    print(json.dumps(d["fit_rms_rel_err"]))


if __name__ == "__main__":
    main()
