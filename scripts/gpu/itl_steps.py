"""Server steps from a load's client timeline (``bench_offload.py --itl-trace``): which steps were slow, and when.

A decode step streams one chunk to every request in its batch at nearly the same moment, so the
gaps of a load (every request's ``[end_s, token_index, gap_ms]``) whose ends fall within ``join_ms``
of each other are one server step. This groups them and reports, per load, the steps after the last
first token (the decode phase: no prefill in it), their median time, and each run of consecutive
slow steps (above ``factor`` x that median): where it starts (s from the load's start, and the step's
index in the decode phase), how many steps, their median, and the batch (requests streaming in the
step). A run that lasts to the load's end points at a state the batch kept (the 64 x 4K keep-v load
of 2026-12-06 ran its last 55 steps at 24 ms against 18.3 once one request was demoted to sparse),
a run of one step at a fixed stride at a periodic cost.

    python scripts/gpu/itl_steps.py OUT/itl_trace_offload-keep.json.xz [...] --part OUT/throughput_....json --out docs/results/....json

``--part``: the throughput part the traces came with; its ``date, gpu, commit, command`` go into ``measured``.
``offload_call.sh`` runs it after a throughput step with
``ITL_TRACE=1`` (``$OUT/itl_steps_<workload>.json``).

Writes nothing when no trace holds a decode step, or on a machine without a GPU (the result must come from the
GPU host that made the traces).
"""

from __future__ import annotations

import argparse
import json
import lzma
import statistics
import sys
from typing import List


def steps_of(requests: List[dict], join_ms: float = 4.0) -> List[dict]:
    """One load's steps: ``[{at_s, batch, ms}]`` in time order (``ms``: the median gap of the step's requests)."""
    ev = sorted((g[0], g[2], ri) for ri, r in enumerate(requests) for g in r["gaps"])
    out: List[dict] = []
    last = None
    for end, gap, ri in ev:
        if out and end - last <= join_ms / 1e3:
            out[-1]["_g"].append(gap)
            out[-1]["_r"].add(ri)
        else:
            out.append({"at_s": end, "_g": [gap], "_r": {ri}})
        last = end
    return [{"at_s": round(s["at_s"], 4), "batch": len(s["_r"]), "ms": round(statistics.median(s["_g"]), 3)} for s in out]


def summarize(requests: List[dict], factor: float = 1.2, join_ms: float = 4.0) -> dict:
    """A load's decode-phase steps and their slow runs (see the module docstring); ``None`` without any."""
    if not requests:
        return None
    start = max(r["first_s"] for r in requests)
    # a step of the decode phase began after the last first token (the one ending just after it held a prefill)
    steps = [s for s in steps_of(requests, join_ms) if s["at_s"] - s["ms"] / 1e3 >= start - 1e-3]
    if not steps:
        return None
    med = statistics.median(s["ms"] for s in steps)
    runs, cur = [], None
    for i, s in enumerate(steps):
        if s["ms"] > factor * med:
            if cur is None:
                cur = {"from_s": s["at_s"], "step": i, "_ms": [], "_b": []}
                runs.append(cur)
            cur["_ms"].append(s["ms"])
            cur["_b"].append(s["batch"])
        else:
            cur = None
    return {"decode_steps": len(steps), "median_ms": med, "slow_factor": factor,
            "slow_steps": sum(len(r["_ms"]) for r in runs),
            "runs": [{"from_s": r["from_s"], "step": r["step"], "steps": len(r["_ms"]), "median_ms": statistics.median(r["_ms"]),
                      "batch": statistics.median(r["_b"]), "to_end": r["step"] + len(r["_ms"]) == len(steps)} for r in runs]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", help="itl_trace_<server>.json.xz files (bench_offload.py --itl-trace)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--part", help="the bench_offload.py throughput part of the same run (its header goes into 'measured')")
    ap.add_argument("--factor", type=float, default=1.2, help="a step is slow above this many times the decode phase's median")
    a = ap.parse_args(argv)
    if a.factor <= 1.0:
        ap.error(f"--factor {a.factor}: give more than 1")
    servers = {}
    for path in a.traces:
        try:
            with lzma.open(path, "rt") as f:
                t = json.load(f)
        except (OSError, ValueError, lzma.LZMAError) as e:
            sys.exit(f"itl_steps: {path}: {e}")
        servers[t["server"]] = [summarize(load["requests"], a.factor) for load in t["loads"]]
    if not any(x for loads in servers.values() for x in loads):
        sys.exit("itl_steps: no trace holds a decode step; nothing written")
    from sglang_elastic import results

    if results.gpu_name() == "unknown":  # a result file comes from the GPU host that measured (offload_call.sh runs this there)
        sys.exit("itl_steps: no GPU on this machine: run it on the GPU host that made the traces (offload_call.sh with ITL_TRACE=1); "
                 "nothing written")
    measured = None
    if a.part:
        try:
            with open(a.part) as f:
                part = json.load(f)
        except (OSError, ValueError) as e:
            sys.exit(f"itl_steps: --part {a.part}: {e}")
        measured = {k: part.get(k) for k in ("date", "gpu", "commit", "command")}

    results.write(a.out, {**results.header(), "measured": measured, "traces": a.traces, "servers": servers})
    print(json.dumps(servers, indent=1)[:3000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
