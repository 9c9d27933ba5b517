"""The decode policy through SGLang: ``auto`` against every forced path on one live server.

Issue 23's serving acceptance: on each workload, ``auto``'s median ITL within
2 % of the best forced path and never more than 1 % behind FlashInfer, on the
Llama-3.1-8B and Qwen2.5-7B shapes (dummy weights).

    python scripts/gpu/bench_decode_serving.py run --model llama-3.1-8b --out PART.json
    python scripts/gpu/bench_decode_serving.py assemble --parts DIR --out docs/results/decode_serving_h200.json

``run`` starts ONE server (``--attention-backend flashinfer
--decode-attention-backend persistentkv --decode-policy auto``, SGLang's
defaults otherwise: radix cache, decode CUDA graphs, prefill graphs), so
every path runs on the same pool, graphs and host. Per workload:

1. **cold** passes (``--cold``, default ``auto,flashinfer``, on
   ``--cold-workloads``, default ``loguniform``; ``auto`` alone elsewhere):
   the radix cache flushed (``/flush_cache``), the prompts sent at once:
   prefill included, so their TTFT is the serving TTFT; they fill the cache;
2. **warm** passes, one per path (``--paths``; the order rotates with the
   workload, ``--rounds`` times): the path forced through
   ``SGLANG_ELASTIC_DECODE_PATH_FILE`` (``auto``: the policy with its online
   correction), the same prompts again. Every prompt is in the radix cache, so
   a pass is one short extend and ``output_len`` decode steps of the whole
   batch: the decode path is all that differs. ``auto``'s online buckets
   are not reset between passes: its warm pass starts from what the cold
   pass (run with ``auto``) and its earlier passes measured, as a live server
   would; a pass that ran more than ``output_len`` + 8 steps (its requests
   did not all decode together) is irregular: a path with no regular pass
   runs again (``--retry-irregular``, default once), a path's figures come
   from its regular passes, and a path left with none is named under
   ``irregular``.

Each pass: every prompt sent at once, streamed (``bench_offload.load``: TTFT,
ITL and output throughput as ``sglang.bench_serving`` computes them) and the
steps each path replayed (``/server_info``'s ``persistentkv`` state). The part
is rewritten after every pass, so a call cut off by the device's time limit
keeps what it measured; ``--budget-s`` stops starting passes after that many
seconds. A part that measured nothing writes nothing and exits 1. A workload
whose prompts and outputs exceed 90 % of the server's KV pool runs only its
first requests that fit, so that its warm passes stay decode-only (the row's
``fit_to_pool`` says how many; ``--no-fit-pool`` sends them all).

Workloads (random ids, greedy, ``ignore_eos``; lengths from ``--seed``):
``loguniform`` (24 requests, prompts log-uniform in 1K-100K, 256 out: the
workload where ``auto`` ran FlashInfer in 491 of 500 replays),
``zipf`` (32 requests, 1024 + 61440 / rank^1.1: the kernel bench's Zipf case, 256 out),
``bimodal`` (8 x 32K + 56 x 2K, 256 out), ``uniform8k`` (64 x 8K, 256 out),
``short`` (128 x 2K, 256 out).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import sys
import time
import urllib.request
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sglang_elastic import results  # noqa: E402

PATHS = ("auto", "flashinfer", "split", "compact")
#: the module docstring's paragraphs that say how a run measures (the result's ``method``)
METHOD_PARAGRAPHS = slice(3, 6)
MODELS = {"llama-3.1-8b": [], "qwen2.5-7b": []}  # extra server flags per model shape
K = 1024
#: name: (requests, output tokens, description)
WORKLOADS = {
    "loguniform": (24, 256, "24 requests, prompts log-uniform in 1K-100K"),
    "zipf": (32, 256, "32 requests, 1024 + 61440 / rank^1.1 (2.4K-61K)"),
    "bimodal": (64, 256, "8 x 32K + 56 x 2K"),
    "uniform8k": (64, 256, "64 x 8K"),
    "short": (128, 256, "128 x 2K"),
}
#: the share of the server's KV pool a workload's prompts and outputs may take (:func:`fit_to_pool`)
FIT_POOL_SHARE = 0.9
#: acceptance: auto within this of the best forced path's median ITL, and of FlashInfer's
WITHIN_BEST, WITHIN_FLASHINFER = 0.02, 0.01


def workload_lengths(name: str, seed: int = 1) -> List[int]:
    """Prompt lengths (tokens) of a workload.

    Raises:
        ValueError: an unknown workload.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}")
    n = WORKLOADS[name][0]
    if name == "loguniform":
        rnd = random.Random(seed)
        return [int(round(math.exp(rnd.uniform(math.log(1 * K), math.log(100 * K))))) for _ in range(n)]
    if name == "zipf":
        from sglang_elastic.attention.bench import zipf_lengths

        return list(zipf_lengths())
    if name == "bimodal":
        return [32 * K] * 8 + [2 * K] * 56
    return [8 * K] * n if name == "uniform8k" else [2 * K] * n


def fit_to_pool(lens: List[int], output_len: int, pool_tokens: Optional[int], share: float = FIT_POOL_SHARE) -> List[int]:
    """The workload's prompts, the last ones left out until every request's prompt and output fit in ``share`` of
    the server's KV pool (``max_total_num_tokens``): a warm pass is then one short extend and ``output_len``
    decode steps of the whole batch from the radix cache, as the method asks. Without it a workload larger than
    the pool (64 x 8K on an H100's 410,620 tokens) prefills again in every warm pass and decodes in waves.

    Args:
        lens: prompt lengths in tokens.
        output_len: tokens generated per request.
        pool_tokens: the server's KV tokens; None or 0: no limit known, ``lens`` as given.
        share: the part of the pool the batch may take (SGLang keeps some free for the decode's growth).

    Returns:
        A prefix of ``lens`` (at least one request).
    """
    if not pool_tokens:
        return list(lens)
    out, used = [], 0
    for n in lens:
        if out and used + n + output_len > share * pool_tokens:
            break
        out.append(n)
        used += n + output_len
    return out


def path_order(paths: List[str], index: int) -> List[str]:
    """``paths`` rotated by ``index`` (workload i starts at path i: no path always runs first)."""
    i = index % len(paths)
    return paths[i:] + paths[:i]


def verdict(paths: Dict[str, dict], required: Sequence[str] = PATHS) -> Optional[dict]:
    """The acceptance figures of one workload from its warm passes
    (``{path: {median_itl_ms, ...}}``): the best forced path, ``auto`` against
    it and against FlashInfer (ratios of median ITL, >1 slower), and whether
    both bounds hold. ``None`` unless every path of ``required`` was measured
    (a best of some forced paths is no best)."""
    itl = {p: r.get("median_itl_ms") for p, r in paths.items() if r and r.get("median_itl_ms")}
    forced = {p: v for p, v in itl.items() if p != "auto"}
    if any(p not in itl for p in required) or "auto" not in itl or not forced:
        return None
    best = min(forced, key=forced.get)
    out = {"best_forced": best, "auto_over_best": itl["auto"] / forced[best],
           "auto_over_flashinfer": itl["auto"] / forced["flashinfer"] if "flashinfer" in forced else None}
    out["within_2pct_of_best"] = out["auto_over_best"] <= 1 + WITHIN_BEST
    out["within_1pct_of_flashinfer"] = None if out["auto_over_flashinfer"] is None else out["auto_over_flashinfer"] <= 1 + WITHIN_FLASHINFER
    return out


def is_regular(r: dict, output_len: int, slack: int = 8) -> bool:
    """A warm pass that ran at most ``output_len`` (+ ``slack``) decode steps: its requests decoded together, every
    step on the whole batch. One that ran more did not (part of its steps ran on a partial batch: a lower ITL per
    step, a lower throughput), so its ITL is not comparable with the other paths'."""
    return sum((r.get("steps") or {}).values()) <= output_len + slack


def irregular(rounds: List[dict], output_len: int, slack: int = 8) -> List[str]:
    """Paths without a regular warm pass (:func:`is_regular`): their figures come from a pass whose requests did not
    all decode together. (With one pass a path, as every committed part: the paths with an irregular pass.)"""
    paths = {r["path"] for r in rounds}
    return sorted(p for p in paths if not any(is_regular(r, output_len, slack) for r in rounds if r["path"] == p))


def path_figures(rounds: List[dict], paths: Sequence[str], output_len: Optional[int] = None) -> Dict[str, dict]:
    """Per path, the figures of its warm pass with the median ITL (the lower
    middle of an even count): every figure from the same pass. With
    ``output_len``, among the path's regular passes (:func:`is_regular`) when
    it has any: an irregular pass's lower ITL must not stand for the path."""
    out = {}
    for p in paths:
        rs = [x for x in rounds if x["path"] == p]
        if output_len is not None and any(is_regular(x, output_len) for x in rs):
            rs = [x for x in rs if is_regular(x, output_len)]
        rs = sorted(rs, key=lambda x: x["median_itl_ms"])
        if rs:
            r = rs[(len(rs) - 1) // 2]
            out[p] = {k: r[k] for k in ("median_itl_ms", "output_tok_s", "median_ttft_ms")}
    return out


def decode_state(info: dict) -> Optional[dict]:
    """The ``persistentkv`` state of rank 0 in ``/server_info``, or ``None``."""
    for st in info.get("internal_states") or []:
        if isinstance(st, dict) and "persistentkv" in st:
            return st["persistentkv"]
    return None


def steps_between(before: Optional[dict], after: Optional[dict]) -> Dict[str, int]:
    """Decode steps per ``kind:path`` a pass ran (``state()["steps"]`` after minus before)."""
    a, b = (after or {}).get("steps") or {}, (before or {}).get("steps") or {}
    return {k: v - b.get(k, 0) for k, v in sorted(a.items()) if v - b.get(k, 0)}


def force(path_file: str, server, path: str, timeout: float = 30) -> None:
    """Write ``path`` to the path file and wait until the server reports it
    (the backend reads the file at most every 0.5 s, at a decode step: one
    1-token request makes a step)."""
    with open(path_file + ".tmp", "w") as f:
        f.write(path)
    os.replace(path_file + ".tmp", path_file)
    want = None if path == "auto" else path
    t0 = time.time()
    while time.time() - t0 < timeout:
        time.sleep(0.6)
        server.generate({"input_ids": [1000, 1001], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}})
        if (decode_state(server.info()) or {}).get("forced", "?") == want:
            return
    raise RuntimeError(f"the server did not take path {path} within {timeout:.0f} s")


def flush(server) -> None:
    req = urllib.request.Request(server.url("/flush_cache"), data=b"", method="POST")
    urllib.request.urlopen(req, timeout=60).read()


def part_run(a) -> dict:
    import bench_offload as bo

    paths = a.paths.split(",")
    cold = [p for p in a.cold.split(",") if p] or ["auto"]
    cold_workloads = set(a.cold_workloads.split(","))
    for p in paths + cold:
        if p not in PATHS:
            raise RuntimeError(f"unknown path {p!r}; one of {', '.join(PATHS)}")
    names = a.workloads.split(",")
    for w in names:
        workload_lengths(w)  # refuses an unknown name before the server starts
    model = os.path.join(ROOT, "sglang_elastic", "models", a.model)
    path_file = os.path.join(a.work, "decode_path")
    if os.path.exists(path_file):
        os.remove(path_file)
    # after bench_offload's COMMON flags: the last --model-path wins in SGLang's parser
    args = ["--model-path", model, "--attention-backend", "flashinfer", "--decode-attention-backend", "persistentkv",
            "--decode-policy", "auto", "--skip-tokenizer-init", *MODELS[a.model], *a.extra.split()]
    t_start = time.time()
    s = bo.Server(a.model, args, a.port, a.work, env={"SGLANG_ELASTIC_DECODE_PATH_FILE": path_file})
    out = {"part": "run", "model": a.model, "server_flags": " ".join(args[2:]), "workloads": [], "budget_s": a.budget_s}
    measured = 0
    try:
        up = s.wait()
        info = s.info()
        out["server"] = {"startup_s": round(up, 1), "max_total_num_tokens": info.get("max_total_num_tokens"),
                         "decode": decode_state(info)}
        # warm-up: a short prompt and a chunked one (a later chunk's prefill over the cached first runs another
        # FlashInfer kernel; its first use JIT-compiled for ~9 s inside the first cold pass on a fresh host)
        for p in bo.prompts([256, 12000], seed=a.seed + 1000):
            s.generate({"input_ids": p, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}})
        for wi, w in enumerate(names):
            _, olen, desc = WORKLOADS[w]
            named, pool = workload_lengths(w, a.seed), out["server"]["max_total_num_tokens"]
            lens = named if a.no_fit_pool else fit_to_pool(named, olen, pool)
            ps = bo.prompts(lens, seed=a.seed + 7 * wi)  # a prefix of the named workload's prompts (one generator, in order)
            n = len(lens)
            row = {"name": w, "model": a.model, "requests": n, "output_len": olen, "desc": desc, "prompt_tokens": sum(lens),
                   "cold": {}, "paths": {}, "rounds": []}
            if n < len(named):  # the named workload exceeds the pool: its first n requests, so that the warm passes stay decode-only
                row["fit_to_pool"] = {"named_requests": len(named), "requests": n, "pool_tokens": pool}
            out["workloads"].append(row)

            def one(path: str) -> Optional[dict]:
                if time.time() - t_start > a.budget_s:
                    return None
                force(path_file, s, path)
                before = decode_state(s.info())
                rec = bo.load(s.url(""), ps, olen, a.timeout)
                if rec["completed"] < n:
                    raise RuntimeError(f"{w} {path}: {rec['completed']} of {n} requests completed: " + bo.tail(s.log))
                after = decode_state(s.info())
                return {**{k: rec[k] for k in ("median_itl_ms", "p99_itl_ms", "output_tok_s", "median_ttft_ms", "duration_s")},
                        "steps": steps_between(before, after), "online": (after or {}).get("online")}

            for p in (cold if w in cold_workloads else ["auto"]):
                flush(s)
                r = one(p)
                if r is None:
                    break
                row["cold"][p] = r
                measured += 1
                results.write(a.out, {**results.header(), "incomplete": True, **out})
            for rnd in range(a.rounds):
                got = {}
                for p in path_order(paths, wi + rnd):
                    r = one(p)
                    if r is None:
                        break
                    got[p] = r
                    measured += 1
                    row["rounds"].append({"round": rnd, "path": p, **r})
                    results.write(a.out, {**results.header(), "incomplete": True, **out})
            # a path whose every pass was irregular runs again (--retry-irregular times at most, within the budget):
            # both H200 runs of Qwen 128 x 2K had one such pass, and its ITL stood for the path
            for attempt in range(a.retry_irregular):
                again = irregular(row["rounds"], olen)
                if not again:
                    break
                for p in again:
                    r = one(p)
                    if r is None:
                        break
                    measured += 1
                    row["rounds"].append({"round": f"retry{attempt + 1}", "path": p, **r})
                    results.write(a.out, {**results.header(), "incomplete": True, **out})
            row["paths"] = path_figures(row["rounds"], paths, olen)
            row["verdict"] = verdict(row["paths"], paths)
            row["irregular"] = irregular(row["rounds"], olen)
            if measured:
                results.write(a.out, {**results.header(), "incomplete": True, **out})
        out["server"]["decode_end"] = decode_state(s.info())
    finally:
        s.stop()
    if not measured:
        raise RuntimeError("no pass measured")
    return out


def read_part(path: str) -> dict:
    """A part file, ``.json`` or ``.json.xz``."""
    return results.read_json(path)


def part_assemble(a) -> dict:
    """Join ``run`` parts (``.json`` or ``.json.xz``; several per model allowed)
    into ``{date, gpu, commit, command, method, servers, workloads, summary}``.

    Per (model, workload) the row is the newest part's with a verdict (else the
    newest with any path measured, ``verdict: null``); the other parts' figures
    of the same row are kept under ``repeats``. Rows are ordered by model, then
    workload as first run.

    Raises:
        RuntimeError: no ``run`` part in the folder.
    """
    files = sorted(glob.glob(os.path.join(a.parts, "*.json")) + glob.glob(os.path.join(a.parts, "*.json.xz")))
    parts = []
    for f in files:
        p = read_part(f)
        if p.get("part") == "run":
            parts.append((f, p))
    if not parts:
        raise RuntimeError(f"no run parts in {a.parts}")
    parts.sort(key=lambda fp: fp[1]["date"])
    rows: Dict[tuple, List[tuple]] = {}
    for f, p in parts:
        for w in p["workloads"]:
            if w.get("paths"):
                rows.setdefault((p["model"], w["name"]), []).append((f, p, w))
    wl = []
    for key in sorted(rows, key=lambda k: (k[0], list(WORKLOADS).index(k[1]) if k[1] in WORKLOADS else 99)):
        cands = rows[key]
        with_v = [c for c in cands if verdict(c[2]["paths"])]
        f, p, w = (with_v or cands)[-1]
        row = {k: v for k, v in w.items() if k != "rounds"}  # every pass stays in the part
        row["verdict"] = verdict(w["paths"])  # every forced path required, whatever the part's run asked
        row["irregular"] = irregular(w.get("rounds") or [], w["output_len"])
        row["cold"] = {c: {k: v for k, v in r.items() if k != "online"} for c, r in w["cold"].items()}
        row.update(commit=p["commit"], date=p["date"], part=os.path.relpath(f, ROOT))
        row["repeats"] = [{"part": os.path.relpath(g, ROOT), "median_itl_ms": {c: r["median_itl_ms"] for c, r in x["paths"].items()},
                           "auto_over_best": (verdict(x["paths"]) or {}).get("auto_over_best")} for g, q, x in cands if x is not w]
        wl.append(row)
    verdicts = [w["verdict"] for w in wl if w.get("verdict")]
    summary = {"workloads": len(wl), "with_verdict": len(verdicts),
               "auto_within_2pct_of_best": sum(bool(v["within_2pct_of_best"]) for v in verdicts),
               "auto_within_1pct_of_flashinfer": sum(bool(v["within_1pct_of_flashinfer"]) for v in verdicts),
               "worst_auto_over_best": max((v["auto_over_best"] for v in verdicts), default=None),
               "worst_auto_over_flashinfer": max((v["auto_over_flashinfer"] for v in verdicts if v["auto_over_flashinfer"]), default=None),
               "rows_with_irregular_passes": [f"{w['model']}/{w['name']}: {','.join(w['irregular'])}" for w in wl if w.get("irregular")]}
    servers = {}
    for f, p in parts:
        end = p["server"].get("decode_end") or {}
        servers.setdefault(p["model"], []).append({"startup_s": p["server"].get("startup_s"), "max_total_num_tokens": p["server"].get("max_total_num_tokens"),
                                                   "calibration_source": end.get("calibration_source"), "steps": end.get("steps"),
                                                   "online": {k: v for k, v in (end.get("online") or {}).items() if k != "top"} or None, "flags": p["server_flags"], "part": os.path.relpath(f, ROOT)})
    return _rounded({"date": parts[-1][1]["date"], "gpu": " / ".join(sorted({p["gpu"] for _, p in parts})),
            "commit": " / ".join(dict.fromkeys(p["commit"] for _, p in parts)),
            "command": a.command or " ; ".join(dict.fromkeys(p["command"] for _, p in parts)),
            "method": " ".join(" ".join(__doc__.split("\n\n")[METHOD_PARAGRAPHS]).split()), "servers": servers, "workloads": wl, "summary": summary})


def _rounded(obj, nd: int = 4):
    """``obj`` with every float rounded to ``nd`` decimals (the parts keep full precision)."""
    if isinstance(obj, float):
        return round(obj, nd)
    if isinstance(obj, dict):
        return {k: _rounded(v, nd) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v, nd) for v in obj]
    return obj


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("part", choices=("run", "assemble"), help="run: one server on this GPU, every path forced in turn; "
                                                              "assemble: the parts in --parts into one result (CPU)")
    ap.add_argument("--out", required=True, help="result JSON")
    ap.add_argument("--model", choices=sorted(MODELS), default="llama-3.1-8b", help="run: the embedded shape (dummy weights)")
    ap.add_argument("--workloads", default="loguniform,zipf,bimodal,uniform8k", help=f"run: from {', '.join(sorted(WORKLOADS))}")
    ap.add_argument("--paths", default=",".join(PATHS), help="run: the paths forced in turn")
    ap.add_argument("--cold", default="auto,flashinfer", help="paths run cold (cache flushed, prefill included) on --cold-workloads")
    ap.add_argument("--cold-workloads", default="loguniform", help="workloads with a cold pass of every --cold path (others: auto only)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--retry-irregular", type=int, default=1,
                    help="run: passes again a path whose every warm pass ran more decode steps than the output length (+8), "
                         "up to this many times (0: never); its figures then come from its regular passes")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no pass after this many seconds (a device call's limit)")
    ap.add_argument("--no-fit-pool", action="store_true",
                    help=f"run: send every request of a workload even when prompts and outputs exceed {FIT_POOL_SHARE * 100:.0f} %% of the KV pool "
                         "(by default its last requests are left out, so a warm pass stays decode-only; the row's fit_to_pool says so)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--port", type=int, default=30400)
    ap.add_argument("--extra", default="", help="extra SGLang flags for the server (one string)")
    ap.add_argument("--work", default="/tmp/bench_decode_serving")
    ap.add_argument("--parts", default=None, help="assemble: the folder of part files (*.json, *.json.xz)")
    ap.add_argument("--command", default=None, help="assemble: the command recorded in the result (default: this one)")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error(f"--rounds {a.rounds}: give 1 or more")
    if a.retry_irregular < 0:
        ap.error(f"--retry-irregular {a.retry_irregular}: give 0 or more")
    if a.part == "run":
        import torch

        if not torch.cuda.is_available():  # before SGLang starts (its own failure is a 20-line traceback)
            sys.exit("bench_decode_serving run: no CUDA GPU here (it starts an SGLang server on one); 'assemble' runs on a CPU")
    os.makedirs(a.work, exist_ok=True)
    t0 = time.time()
    try:
        if a.part == "assemble" and not a.parts:
            ap.error("assemble needs --parts DIR")
        res = part_run(a) if a.part == "run" else part_assemble(a)
    except (RuntimeError, ValueError, OSError) as e:  # OSError: the server's HTTP endpoints (flush, server_info, generate)
        sys.exit(f"bench_decode_serving {a.part}: {type(e).__name__}: {e}" if isinstance(e, OSError) else f"bench_decode_serving {a.part}: {e}")
    if a.part == "run":
        res = {**results.header(), "seconds": round(time.time() - t0, 1), **res}
    results.write(a.out, res)
    if a.part == "assemble":
        print(f"{a.out}: {len(res.get('workloads', []))} workloads; summary {json.dumps(res.get('summary'))}")
    else:
        print(json.dumps(res, indent=1)[:3000])


if __name__ == "__main__":
    main()
