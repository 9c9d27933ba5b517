"""Assemble docs/results/serve_smoke_h200.json from /server_info and bench_serving's JSONL."""

import argparse
import json

from sglang_elastic import results


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
        **results.header(a.command),
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
    results.write(a.out, result)


if __name__ == "__main__":
    main()
