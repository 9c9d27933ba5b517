"""Lost against gained answers of every offload server of an accuracy run through SGLang, from its
per-sample file: for each server (the shipped rule and each variant), the dense-solved samples it
does not solve (lost), the dense-unsolved ones it does (gained), and the exact two-sided sign test
(McNemar's) of "it loses more than it gains" (:func:`sglang_elastic.offload.oracle.score.two_way`),
overall and per task and length.

A selection that drops what an answer needs loses far more answers than it gains; greedy decoding
that differs from dense only by rounding loses and gains alike. This reads a finished run's files
(``scripts/gpu/offload_accuracy.py`` writes ``two_way`` itself since 2026-12-05); no GPU.

    python scripts/offload/accuracy_two_way.py --result docs/results/offload_h200_parts/accuracy.json \\
        --out docs/results/offload_accuracy_two_way.json

Writes ``--out`` (``date, gpu, commit, command`` of this analysis, ``source`` with the run's own,
``servers: {name: {offload_args, two_way, cells: [{task, context, lost, gained}]}}``, the cells with a
lost or gained sample, by sample index);
a run file without per-sample records gives one line and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import sys

from sglang_elastic import results
from sglang_elastic.offload.oracle import score


def _records(rows, dense):
    """``score.Record`` per graded sample of one server (``dense``: (task, context, index) -> solved)."""
    out = []
    for r in rows:
        key = (r["task"], r["context"], r["index"])
        solved = r["offload"]["solved"] if isinstance(r.get("offload"), dict) else r.get("solved")
        if key in dense and dense[key] is not None and solved is not None:
            out.append((key, score.Record(r["task"], r["context"], dense[key], solved, None, None)))
    return out


def analyse(result: dict, per_sample: dict) -> dict:
    """``servers`` of the output from a run's result JSON and its per-sample records."""
    main_rows = per_sample["per_sample"]
    dense = {(r["task"], r["context"], r["index"]): r["dense"]["solved"] for r in main_rows}
    sets = {"offload": main_rows, **per_sample.get("variants", {})}
    servers = {}
    for name, rows in sets.items():
        recs = _records(rows, dense)
        cells = {}
        for key, rec in recs:
            cells.setdefault((rec.task, rec.context), []).append((key, rec))
        cmd = result.get("servers", {}).get(name, "")
        servers[name] = {
            "offload_args": cmd.split("--host 127.0.0.1")[-1].strip(),  # the flags after the ones every server shares
            "two_way": score.two_way(r for _, r in recs),
            # the cells with a sample one server solves and the other not (indices of the samples)
            "cells": [{"task": t, "context": c, "lost": lost, "gained": gained}
                      for (t, c), v in cells.items()
                      for lost, gained in [([k[2] for k, r in v if r.dense_solved and not r.offload_solved],
                                            [k[2] for k, r in v if r.offload_solved and not r.dense_solved])]
                      if lost or gained],
        }
    return servers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--result", required=True, help="the run's accuracy JSON (it names its per-sample file, beside it)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        with open(a.result) as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        print(f"accuracy_two_way: cannot read {a.result}: {e}", file=sys.stderr)
        return 1
    name = result.get("per_sample_file")
    try:
        if name:
            with lzma.open(os.path.join(os.path.dirname(a.result), name), "rt") as f:
                per_sample = json.load(f)
        else:
            per_sample = {"per_sample": result["per_sample"]}
    except (OSError, KeyError, lzma.LZMAError, json.JSONDecodeError) as e:
        print(f"accuracy_two_way: {a.result} has no per-sample records ({type(e).__name__}: {e}); {a.out} not written", file=sys.stderr)
        return 1
    servers = analyse(result, per_sample)
    if not any(s["two_way"]["both"] + s["two_way"]["lost"] + s["two_way"]["gained"] for s in servers.values()):
        print(f"accuracy_two_way: no graded sample in {a.result}; {a.out} not written", file=sys.stderr)
        return 1
    out = dict(results.header())
    out["gpu"] = "none (a re-analysis of the source run's per-sample records)"
    out["source"] = {k: result.get(k) for k in ("date", "gpu", "commit", "command")} | {"file": os.path.relpath(a.result)}
    out["servers"] = servers
    results.write(a.out, out)
    for n, s in servers.items():
        t = s["two_way"]
        print(f"{n}: {t['both']} both solved, {t['lost']} dense-solved lost, {t['gained']} gained, sign test p {t['sign_test_p']:.2f}"
              f"  ({s['offload_args']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
