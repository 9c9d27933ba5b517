#!/usr/bin/env bash
# The elastic KV pool's GPU results: docs/results/elastic_h200.json.
#
#   bash .gpu/install_bundle.sh .gpu/bundle && export PYTHONPATH=/tmp/site
#   bash scripts/gpu/bench_elastic.sh [OUTDIR] [GROUP ...]
#
# A GROUP is a space-separated list of phases run at the same time, each on its
# own GPUs: MODE[-id][-tpN]@GPU[,GPU...] with MODE stock | elastic | always-lent;
# -id: the identity servers and workload (bench_elastic.py --identity);
# -eager: prefill without CUDA graphs (bench_elastic.py --eager; elastic-eager
#   runs burst and cycles, the others burst only).
# -pc: SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1 (bench_elastic.py --post-capture;
#   issue 22, build 3: stock-pc is SGLang's sizing alone, elastic-pc lends on top).
# Default (2 H200s, ~20 min): "elastic@0 stock@1" "elastic-id@0 stock-id@1"
# "always-lent@0" "always-lent-eager@0 elastic-eager@1" "elastic-pc@0 stock-pc@1" "elastic-tp2@0,1".
# Each phase writes OUTDIR/<mode>_tp<N>.json (scripts/gpu/bench_elastic.py);
# then every part in OUTDIR is assembled into $RESULT
# (default docs/results/elastic_h200.json). Parts from an earlier run in OUTDIR
# are kept, so groups can run in separate calls and be assembled at the end.
# Env: WORKLOADS, SHORT_REQUESTS, RESULT, and ELASTIC_EXTRA (more flags for the
# elastic servers, e.g. "--elastic-kv-activation-rule measured").
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-/tmp/bench_elastic/parts}; shift || true
groups=("$@")
[ ${#groups[@]} -gt 0 ] || groups=("elastic@0 stock@1" "elastic-id@0 stock-id@1" "always-lent@0" "always-lent-eager@0 elastic-eager@1" "elastic-pc@0 stock-pc@1" "elastic-tp2@0,1")
site=${SITE:-/tmp/site}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-index --no-build-isolation --target "$site" --upgrade .
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
port=30000
for group in "${groups[@]}"; do
  pids=()
  for spec in $group; do
    name=${spec%@*}; gpus=${spec#*@}
    mode=${name%-tp*}; tp=1; [[ $name == *-tp* ]] && tp=${name##*-tp}
    pc=(); if [[ $mode == *-pc ]]; then mode=${mode%-pc}; pc=(--post-capture); fi
    wl=${WORKLOADS:-burst,cycles,itl}; [ "$mode" = always-lent ] && wl=burst
    id=(); if [[ $mode == *-id ]]; then mode=${mode%-id}; id=(--identity); wl=none; fi
    # the eager elastic phase also runs the cycles (issue 22: reclaim_needed_ms over 100+ reclaims that unmap)
    if [[ $mode == *-eager ]]; then mode=${mode%-eager}; id+=(--eager); wl=burst; [ "$mode" = elastic ] && wl=burst,cycles; fi
    port=$((port + 10))
    CUDA_VISIBLE_DEVICES=$gpus python3 scripts/gpu/bench_elastic.py phase --mode "$mode" --tp "$tp" --port $port \
      --workloads $wl --short-requests ${SHORT_REQUESTS:-110} --elastic-extra "${ELASTIC_EXTRA:-}" "${id[@]}" "${pc[@]}" --workdir "$out/work_${name}" --out "$out/${name%-tp*}_tp${tp}.json" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || echo "a phase of group '$group' failed (see $out/work_*)" >&2; done
done
# the command as run: the environment that changed the phases, then the script
env_used=""
for v in ELASTIC_EXTRA WORKLOADS SHORT_REQUESTS; do [ -z "${!v:-}" ] || env_used+="$v=${!v@Q} "; done
# gzipped parts (kept so in the repo) first: a fresh plain part of the same phase, listed later, wins
shopt -s nullglob
parts=("$out"/*_tp*.json.gz "$out"/*_tp*.json)
python3 scripts/gpu/bench_elastic.py assemble "${parts[@]}" --out "${RESULT:-docs/results/elastic_h200.json}" \
  --command "${env_used}bash scripts/gpu/bench_elastic.sh $out ${groups[*]@Q}"
