#!/usr/bin/env bash
# End-to-end serving numbers for the decode engine: the same Llama-3.1-8B-shape
# server (dummy weights, FlashInfer prefill, SGLang defaults otherwise) with
# FlashInfer decode and with `--decode-attention-backend persistentkv
# --decode-policy auto`, each under sglang.bench_serving's long-context,
# decode-heavy random-ids workloads; ITL, TTFT and output throughput go to
# docs/results/decode_serving_2servers_h200.json and into docs/results/decode_h200.json's
# "serving" key.
#
#   bash .gpu/install_bundle.sh .gpu/bundle && export PYTHONPATH=/tmp/site
#   bash scripts/gpu/bench_decode_serving.sh [RESULT_JSON]
#
# Two GPUs: the servers run side by side (FlashInfer on GPU 0, ours on GPU 1);
# one GPU: one after the other. The servers load the stand-in word-level
# tokenizer of scripts/gpu/make_tokenizer.py (not --skip-tokenizer-init), so
# the stream carries text and bench_serving times TTFT and ITL.
# Needs the wheels of scripts/gpu/fetch_wheels.sh in .whl/ (datasets).
set -euo pipefail
cd "$(dirname "$0")/../.."
result=${1:-docs/results/decode_serving_2servers_h200.json}
work=${WORK:-/tmp/decode_serving}
site=${SITE:-/tmp/site}
rm -rf "$work"; mkdir -p "$work"   # nothing of an earlier run may reach the result
python3 -m pip install -q --no-deps --no-index --no-build-isolation --target "$site" --upgrade .
if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-deps --no-index --target "$site" --upgrade .whl/*.whl; fi
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
model=sglang_elastic/models/llama-3.1-8b
python3 scripts/gpu/make_tokenizer.py "$model" "$work/tokenizer"

# name|input_len|range_ratio|output_len|num_prompts|max_concurrency
WORKLOADS=${WORKLOADS:-"long-mixed|24576|0.05|2048|48|48 mid-uniform|4096|1.0|1024|128|128"}
base=(python3 -m sglang.launch_server --model-path "$model" --load-format dummy --tokenizer-path "$work/tokenizer"
      --attention-backend flashinfer --sampling-backend pytorch --grammar-backend none --host 127.0.0.1)
declare -A extra=([flashinfer]="" [persistentkv]="--decode-attention-backend persistentkv --decode-policy auto")

start() {  # name gpu port: the server leads its own process group (setsid), so stopping it stops only it
  local extra_env=(SGLANG_ELASTIC_DECODE_TRACE_EVERY_S=1)
  [ "$1" = persistentkv ] && extra_env+=(SGLANG_ELASTIC_DECODE_TRACE="$work/trace")
  env CUDA_VISIBLE_DEVICES=$2 "${extra_env[@]}" setsid "${base[@]}" --port "$3" ${extra[$1]} > "$work/server_$1.log" 2>&1 &
  echo $!
}
stop() {  # pid...
  for p in "$@"; do kill -- "-$p" 2>/dev/null || true; done
  sleep 5
  for p in "$@"; do kill -9 -- "-$p" 2>/dev/null || true; done
}
wait_up() {  # name pid port
  for i in $(seq 1 900); do
    if curl -sf "http://127.0.0.1:$3/health" >/dev/null 2>&1; then
      echo "$1 up after ${i}s"; echo "$i" > "$work/startup_$1.txt"
      curl -sf "http://127.0.0.1:$3/server_info" > "$work/server_info_$1.json"; return 0
    fi
    kill -0 "$2" 2>/dev/null || { tail -40 "$work/server_$1.log"; echo "$1 server died" >&2; return 1; }
    sleep 1
  done
  return 1
}
bench() {  # name port
  for w in $WORKLOADS; do
    IFS='|' read -r wname ilen ratio olen n conc <<< "$w"
    python3 -m sglang.bench_serving --backend sglang --host 127.0.0.1 --port "$2" --dataset-name random-ids --tokenize-prompt \
      --tokenizer "$work/tokenizer" --random-input-len "$ilen" --random-range-ratio "$ratio" --random-output-len "$olen" \
      --num-prompts "$n" --max-concurrency "$conc" --seed 1 --output-file "$work/bench_$1_$wname.jsonl" > "$work/bench_$1_$wname.log" 2>&1 \
      || { tail -20 "$work/bench_$1_$wname.log"; return 1; }
    grep -E "Median ITL|P99 ITL|Output token throughput" "$work/bench_$1_$wname.log" | sed "s/^/$1 $wname: /"
  done
}
pids=()
trap 'stop ${pids[@]+"${pids[@]}"}' EXIT
ngpu=$(nvidia-smi -L | wc -l)
rc=0
if [ "$ngpu" -ge 2 ]; then
  p0=$(start flashinfer 0 31000); p1=$(start persistentkv 1 31010); pids=($p0 $p1)
  wait_up flashinfer $p0 31000 & w0=$!; wait_up persistentkv $p1 31010 & w1=$!
  wait $w0 && wait $w1 || rc=1
  if [ $rc = 0 ]; then bench flashinfer 31000 & b0=$!; bench persistentkv 31010 & b1=$!; wait $b0 || rc=1; wait $b1 || rc=1; fi
else
  for name in flashinfer persistentkv; do
    p=$(start $name 0 31000); pids=($p)
    wait_up $name $p 31000 && bench $name 31000 || rc=1
    stop "$p"; pids=()
  done
fi
python3 scripts/gpu/write_decode_serving.py --work "$work" --workloads "$WORKLOADS" --gpus "$ngpu" --out "$result" \
  --merge-into docs/results/decode_h200.json --command "bash scripts/gpu/bench_decode_serving.sh" || rc=1
exit $rc
