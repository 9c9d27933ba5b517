"""Assemble docs/results/decode_serving_2servers_h200.json from bench_decode_serving.sh's
work directory (bench_serving JSONL per server and workload, /server_info,
the persistentkv server's decode trace) and copy its summary into
docs/results/decode_h200.json under ``serving``."""

import argparse
import glob
import json
import os

from sglang_elastic import results

SERVERS = ("flashinfer", "persistentkv")
KEYS = ("completed", "duration", "output_throughput", "request_throughput", "total_input_tokens", "total_output_tokens",
        "mean_itl_ms", "median_itl_ms", "p95_itl_ms", "p99_itl_ms", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "median_tpot_ms")


def trace_counts(work: str):
    counts = {}
    for f in glob.glob(os.path.join(work, "trace.*")):
        with open(f) as fh:
            for k, v in json.load(fh)["counts"].items():
                counts[k] = counts.get(k, 0) + v
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--workloads", required=True)
    ap.add_argument("--gpus", type=int, default=2, help="GPUs the servers ran on (2: side by side, 1: one after the other)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--merge-into", default=None)
    ap.add_argument("--command", required=True)
    a = ap.parse_args()
    servers = {}
    for s in SERVERS:
        p = os.path.join(a.work, f"server_info_{s}.json")
        info = json.load(open(p)) if os.path.exists(p) else {}
        up = os.path.join(a.work, f"startup_{s}.txt")
        servers[s] = {"max_total_num_tokens": info.get("max_total_num_tokens"), "attention_backend": info.get("attention_backend"),
                      "decode_attention_backend": info.get("decode_attention_backend"), "chunked_prefill_size": info.get("chunked_prefill_size"),
                      "cuda_graph_max_bs_decode": info.get("cuda_graph_max_bs_decode"),
                      "memory_usage_gib": results.scheduler_state(info).get("memory_usage"),
                      "startup_s": int(open(up).read()) if os.path.exists(up) else None}
    servers["persistentkv"]["decode_steps"] = trace_counts(a.work)
    servers["persistentkv"]["decode_steps_note"] = ("SGLANG_ELASTIC_DECODE_TRACE counts, written at most once a second: graphs captured per "
                                                    "path and batch size, replays per path (the last second may be missing)")
    rows = []
    for w in a.workloads.split():
        name, ilen, ratio, olen, n, conc = w.split("|")
        row = {"name": name, "random_input_len": int(ilen), "random_range_ratio": float(ratio), "random_output_len": int(olen),
               "num_prompts": int(n), "max_concurrency": int(conc)}
        for s in SERVERS:
            p = os.path.join(a.work, f"bench_{s}_{name}.jsonl")
            if not os.path.exists(p):
                row[s] = None
                continue
            b = [json.loads(line) for line in open(p) if line.strip()][-1]
            row[s] = {k: b.get(k) for k in KEYS}
        f, o = row.get("flashinfer"), row.get("persistentkv")
        if f and o and o.get("median_itl_ms") and f.get("output_throughput"):
            row["median_itl_speedup"] = f["median_itl_ms"] / o["median_itl_ms"]
            row["output_throughput_ratio"] = o["output_throughput"] / f["output_throughput"]
        rows.append(row)
    res = {**results.header(a.command), "model": "llama-3.1-8b shape, --load-format dummy, stand-in word-level tokenizer",
           "servers": servers, "placement": ("two GPUs of one host: FlashInfer on GPU 0, persistentkv on GPU 1, side by side, the same bench_serving commands at the same time"
                         if a.gpus >= 2 else "one GPU: the FlashInfer server, then the persistentkv server"),
           "workloads": rows}
    results.write(a.out, res)
    print(json.dumps(rows, indent=1))
    if a.merge_into and os.path.exists(a.merge_into):
        d = json.load(open(a.merge_into))
        d["serving"] = {"source": "docs/results/" + os.path.basename(a.out), "date": res["date"], "commit": res["commit"], "command": res["command"], "workloads": [
            {k: r.get(k) for k in ("name", "random_input_len", "random_range_ratio", "random_output_len", "num_prompts", "max_concurrency",
                                   "median_itl_speedup", "output_throughput_ratio")}
            | {f"{s}_{k}": (r.get(s) or {}).get(k) for s in SERVERS for k in ("median_itl_ms", "p99_itl_ms", "output_throughput", "median_ttft_ms")}
            for r in rows]}
        results.write(a.merge_into, d)


if __name__ == "__main__":
    main()
