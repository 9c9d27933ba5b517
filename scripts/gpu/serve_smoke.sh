#!/usr/bin/env bash
# GPU proof of the foundation: patch the offline bundle's SGLang 0.5.17 with the
# CLI, start the main job, send 200 requests with sglang.bench_serving, and write
# docs/results/serve_smoke_h200.json.
#
#   bash .gpu/install_bundle.sh .gpu/bundle && export PYTHONPATH=/tmp/site
#   bash scripts/gpu/serve_smoke.sh [RESULT_JSON]
#
# Needs: the bundle installed in /tmp/site (../shared/gpu-host), the wheels of
# scripts/gpu/fetch_wheels.sh in .whl/, one GPU.
# The prompts are token ids (random-ids + --tokenize-prompt) because the server
# runs with --skip-tokenizer-init; bench_serving gets a stand-in tokenizer with
# the model's vocabulary (scripts/gpu/make_tokenizer.py) to sample them.
set -euo pipefail
cd "$(dirname "$0")/../.."
result=${1:-docs/results/serve_smoke_h200.json}
site=${SITE:-/tmp/site}
port=${PORT:-30000}
work=${WORK:-/tmp/serve_smoke}
mkdir -p "$work" "$(dirname "$result")"
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}

python3 -m pip install -q --no-deps --no-index --no-build-isolation --target "$site" --upgrade .
# bench_serving imports `datasets`, which the bundle lacks (scripts/gpu/fetch_wheels.sh).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --target "$site" --upgrade .whl/*.whl
fi
python3 -m sglang_elastic.cli patch apply --sglang-dir "$site" || true   # refuses if already applied
python3 -m sglang_elastic.cli patch status --sglang-dir "$site" | tee "$work/patch_status.txt"
grep -q ': applied$' <(head -1 "$work/patch_status.txt")

PYTHON=python3 bash scripts/launch.sh --host 127.0.0.1 --port "$port" > "$work/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; sleep 5; pkill -P $server 2>/dev/null || true' EXIT
for i in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  kill -0 $server 2>/dev/null || { tail -50 "$work/server.log"; echo "server died" >&2; exit 1; }
  sleep 1
done
echo "server up after ${i}s"
curl -sf "http://127.0.0.1:$port/server_info" > "$work/server_info.json"

python3 scripts/gpu/make_tokenizer.py sglang_elastic/models/llama-3.1-8b "$work/tokenizer"
bench=(python3 -m sglang.bench_serving --backend sglang --host 127.0.0.1 --port "$port"
       --dataset-name random-ids --tokenize-prompt --tokenizer "$work/tokenizer"
       --random-input-len 1024 --random-output-len 256 --num-prompts 200
       --output-file "$work/bench.jsonl")
"${bench[@]}" 2>&1 | tee "$work/bench.log" | tail -40

python3 scripts/gpu/write_smoke_result.py --server-info "$work/server_info.json" \
  --bench "$work/bench.jsonl" --num-prompts 200 --out "$result" \
  --command "bash scripts/gpu/serve_smoke.sh  # runs: ${bench[*]}"
cat "$result"
