#!/usr/bin/env bash
# One device call of the offload work on a fresh H200 host: install the bundle and
# this package, then run the given steps; every step's output goes to $OUT (the
# device tool's folder), with the tails of the server logs.
#   bash scripts/gpu/offload_call.sh STEP...   (STEP: check | smoke | capacity | throughput:WORKLOAD[:SERVERS])
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/offload_out}
mkdir -p "$out"
if [ ! -f /tmp/site/.part3 ]; then
  bash .gpu/install_bundle.sh .gpu/bundle >/dev/null || exit 1
fi
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-index --no-build-isolation --target /tmp/site --upgrade . || exit 1
if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-deps --no-index --target /tmp/site --upgrade .whl/*.whl; fi
export PYTHONUNBUFFERED=1
for step in "$@"; do
  IFS=: read -r kind arg1 arg2 <<< "$step"
  t0=$(date +%s)
  case $kind in
    check) python3 scripts/gpu/check_offload.py --out "$out/check.json" > "$out/check.log" 2>&1 ;;
    smoke) python3 scripts/gpu/bench_offload.py smoke --out "$out/smoke.json" > "$out/smoke.log" 2>&1 ;;
    capacity) python3 scripts/gpu/bench_offload.py capacity --servers "${arg1:-stock,offload}" --out "$out/capacity.json" > "$out/capacity.log" 2>&1 ;;
    throughput) python3 scripts/gpu/bench_offload.py throughput --workload "$arg1" --servers "${arg2:-stock,offload}" --extra="${EXTRA:-}" --out "$out/throughput_${arg1}_${arg2//,/-}.json" > "$out/throughput_$arg1.log" 2>&1 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  echo "step $step: status $? in $(( $(date +%s) - t0 )) s"
  tail -5 "$out/${kind}"*.log 2>/dev/null | cut -c1-400
done
for f in /tmp/bench_offload/server_*.log; do
  [ -f "$f" ] && { echo "== $f"; grep -E "max_total_num_tokens|KV offload pool|Error|error|Traceback|sglang-elastic" "$f" | tail -15 | cut -c1-600; tail -25 "$f" | cut -c1-400; } >> "$out/servers_tail.txt"
done
true
