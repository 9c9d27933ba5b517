"""Assemble docs/results/serve_smoke_h200.json from /server_info and bench_serving's JSONL."""

import argparse
import datetime
import json
import os
import subprocess


def gpu_name() -> str:
    try:
        out = subprocess.check_output(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"], text=True)
        return "; ".join(line.strip() for line in out.strip().splitlines())
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def commit() -> str:
    env = os.environ.get("SGLANG_ELASTIC_COMMIT")
    if env:
        return env
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server-info", required=True)
    ap.add_argument("--bench", required=True)
    ap.add_argument("--num-prompts", type=int, required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    info = json.load(open(a.server_info))
    bench = [json.loads(line) for line in open(a.bench) if line.strip()][-1]
    elastic = info.get("sglang_elastic") or {}
    ok = int(bench["completed"])
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu_name(),
        "commit": commit(),
        "command": a.command,
        "sglang_version": info.get("version"),
        "patched": bool(elastic.get("patched")),
        "sglang_elastic": elastic,
        "requests_ok": ok,
        "requests_failed": a.num_prompts - ok,
        "output_throughput_tok_s": bench["output_throughput"],
        "request_throughput_req_s": bench.get("request_throughput"),
        "total_input_tokens": bench.get("total_input_tokens"),
        "total_output_tokens": bench.get("total_output_tokens"),
        "duration_s": bench.get("duration"),
        "max_total_num_tokens": info.get("max_total_num_tokens"),
        "chunked_prefill_size": info.get("chunked_prefill_size"),
        "attention_backend": info.get("attention_backend"),
        "note": "TTFT/ITL are not measured: with --skip-tokenizer-init the stream carries output_ids, not text, which bench_serving times by.",
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
