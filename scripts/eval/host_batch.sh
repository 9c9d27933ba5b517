#!/usr/bin/env bash
# One device call's worth of evaluation on a GPU host: run several experiment
# configs at once on one shared Ray cluster, each with --resume (or --only)
# and a start deadline, so a call with a time limit never starts a server it cannot
# finish and the next call picks up where this one stopped.
#
#   bash .gpu/install_bundle.sh .gpu/bundle && export PYTHONPATH=/tmp/site   # earlier call, same host
#   bash .gpu/install_bundle.sh .gpu/ray                                     # this call (Ray part)
#   SGLANG_ELASTIC_COMMIT=<git rev-parse HEAD> bash scripts/eval/host_batch.sh \
#       [--budget S] [--row-s R] [--jit-cache FILE.tgz] [--warm-first] [--standin] CONFIG.yaml[:LABEL,...]...
#
# CONFIG.yaml runs the rows its result file lacks or failed (run.py --resume);
# CONFIG.yaml:LABEL,... runs those rows again, measured or not (run.py --only),
# e.g. a row a cold host's first requests spoiled; rows with `reuse` are
# copied from their source file, never run. Name each config once.
#
# It stops servers an earlier, cut-off call left running, restores the JIT
# caches from --jit-cache (scripts/eval/jit_cache.sh), installs this package
# into SITE (/tmp/site), applies the patch series to the SGLang there unless
# it already is (the elastic rows need it), starts a Ray head on the local
# GPUs unless one runs, copies docs/results/eval/*.json into OUT_DIR
# (/tmp/eval) without overwriting what an earlier call of this checkout
# (SGLANG_ELASTIC_COMMIT) wrote there (another checkout's files, from a host
# lent again, are moved aside first), runs every CONFIG with `run.py
# --address --resume --no-report` (--only for CONFIG:LABEL,...), and prints
# each result's summary line. Rows of configs that need each other's
# results (E2 reuses E1's rows) belong in separate calls; configs of one TP
# size share the GPUs best (a TP 2 row waits for both GPUs of a TP 1 pair).
#
# --budget S (default 560): seconds the call may take from CALL_START (epoch
# seconds; export CALL_START=$(date +%s) first thing in the device command,
# so the Ray part's install counts too; default: this script's start),
# packing included; keep it under the device call's limit. Each run.py is cut
# 20 s before the budget ends and starts no server later than R seconds
# (--row-s, default 300: a start, E1's workload and the stop on a warm host;
# give ~450 for the first server on a host without JIT caches and for E4's
# rows) before that, so no row starts that cannot finish; the next call
# runs it (a row left waiting or cut keeps the file's earlier result).
#
# --jit-cache FILE.tgz: JIT caches an earlier host saved (FILE.tgz.00, ... or
# one FILE.tgz; scripts/eval/jit_cache.sh), unpacked before anything starts;
# a damaged one is skipped with a warning. Name it in the device call's carry.
#
# With $OUT set (the device call's output folder) it leaves there, also when
# a step fails: eval.tgz (OUT_DIR, the run logs, the servers' logs) and
# jit-cache.tgz.00, .01, ... (this host's JIT caches in parts of 15 MiB, to
# carry into the next host's call as --jit-cache). Back here: copy OUT_DIR's
# JSON to docs/results/eval/, then scripts/eval/report.py and
# scripts/eval/advisor_points.py.
#
# --warm-first: let each run start one server alone first (FlashInfer's JIT
# on a host that has not compiled it yet, ~4 min); by default every server
# starts at once (the host is warm from an earlier call).
# --standin: a dry run anywhere (CPU): run.py's stand-in servers, a Ray head
# advertising NUM_GPUS (default 8) GPUs, nothing installed or patched.
# RAY_PORT (default 6379): the head's port. OUT_DIR (/tmp/eval): result
# files; LOG_DIR (/tmp/eval-logs): run.py's logs; SERVER_LOG_DIR
# (/tmp/sglang-eval/logs): the servers' logs, a folder per experiment.
set -euo pipefail
cd "$(dirname "$0")/../.."
t0=${CALL_START:-$(date +%s)} budget=560 row_s=300 jit_cache="" warm=--no-warm-first standin="" configs=() onlys=()
value() { [ $# -ge 2 ] && [ -n "$2" ] || { echo "host_batch.sh: $1 needs a value (see --help)" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case $1 in
    --budget) value "$@"; budget=$2; shift 2 ;;
    --row-s) value "$@"; row_s=$2; shift 2 ;;
    --jit-cache) value "$@"; jit_cache=$2; shift 2 ;;
    --warm-first) warm=""; shift ;;
    --standin) standin=--standin; shift ;;
    -h|--help) sed -n '2,58p' "$0"; exit 0 ;;
    -*) echo "host_batch.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) file=$1 labels=""
       if [ ! -f "$1" ] && [ "${1%:*}" != "$1" ]; then file=${1%:*} labels=${1##*:}  # CONFIG.yaml:LABEL,...
         [[ $labels =~ [^,] ]] || { echo "host_batch.sh: $1 names no rows after the colon" >&2; exit 2; }
       fi
       [ -f "$file" ] || { echo "host_batch.sh: no config $file" >&2; exit 2; }
       for f in "${configs[@]}"; do  # two run.py on one result file would overwrite each other's rows
         [ "$(realpath "$f")" != "$(realpath "$file")" ] || { echo "host_batch.sh: $file is named twice: name it once (CONFIG.yaml:LABEL,... for some rows)" >&2; exit 2; }
       done
       configs+=("$file"); onlys+=("$labels"); shift ;;
  esac
done
[ ${#configs[@]} -gt 0 ] || { echo "host_batch.sh: name at least one config (scripts/eval/configs/*.yaml)" >&2; exit 2; }
[ -n "${SGLANG_ELASTIC_COMMIT:-}" ] || { echo "host_batch.sh: set SGLANG_ELASTIC_COMMIT to git rev-parse HEAD of your checkout (the copy on the host has no .git)" >&2; exit 2; }
for n in "$budget" "$row_s" "$t0"; do [[ $n =~ ^[1-9][0-9]*$ ]] || { echo "host_batch.sh: --budget, --row-s and CALL_START take whole seconds, not '$n'" >&2; exit 2; }; done
[ $((row_s + 20)) -lt "$budget" ] || { echo "host_batch.sh: --budget $budget leaves no time for one row (--row-s $row_s) and packing (20 s)" >&2; exit 2; }
if [ -n "$jit_cache" ] && [ ! -f "$jit_cache" ] && [ ! -f "$jit_cache.00" ]; then
  echo "host_batch.sh: no JIT cache $jit_cache or $jit_cache.00 (name it in the device call's carry, or leave --jit-cache out on a cold host)" >&2; exit 2
fi
site=${SITE:-/tmp/site}
out_dir=${OUT_DIR:-/tmp/eval}; out_dir=${out_dir%/}
logs=${LOG_DIR:-/tmp/eval-logs}
server_logs=${SERVER_LOG_DIR:-/tmp/sglang-eval/logs}   # run.py --log-dir: one folder per experiment below it
port=${RAY_PORT:-6379}
export SGLANG_ELASTIC_COMMIT
mkdir -p "$out_dir" "$logs"
pack() {  # what this call measured goes back, whatever failed
  [ -n "${OUT:-}" ] || return 0
  tar czf "$OUT/eval.tgz" "$out_dir" "$logs" "$server_logs" 2>/dev/null || true
  [ -n "$standin" ] || timeout 60 bash scripts/eval/jit_cache.sh save "$OUT/jit-cache.tgz" || true
}
trap pack EXIT
if [ -z "$standin" ]; then
  # servers of an earlier call that its time limit cut off (their launcher
  # died with it) would hold GPUs this call's placement groups wait for
  bash scripts/eval/stop_servers.sh
  # their scheduler actors (Ray workers) hold the GPU memory and die after them:
  # a server sized against a half-freed GPU would measure another KV pool
  gpu_apps() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null | tr '\n' ';'; }
  for _ in $(seq 60); do [ -z "$(gpu_apps)" ] && break; sleep 1; done
  [ -z "$(gpu_apps)" ] || echo "host_batch.sh: warning: GPU memory still held by $(gpu_apps)" >&2
  [ -z "$jit_cache" ] || bash scripts/eval/jit_cache.sh restore "$jit_cache" || echo "host_batch.sh: warning: JIT cache not restored; the first server compiles (~4 min)" >&2
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  # NVLink multicast off (the device kit's KINDS.md): NCCL NVLS, torch symmetric memory, NVSHMEM
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  python3 -c "import ray, sglang" 2>/dev/null || { echo "host_batch.sh: ray or sglang not importable from $site: install the bundle and the Ray part first" >&2; exit 2; }
  python3 -m pip install -q --no-deps --no-index --no-build-isolation --target "$site" --upgrade . > "$logs/pip.log" 2>&1
  if ! python3 -m sglang_elastic.cli patch status --sglang-dir "$site" | head -1 | grep -q ': applied$'; then
    python3 -m sglang_elastic.cli patch apply --sglang-dir "$site"
  fi
  gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
else
  python3 -c "import ray" 2>/dev/null || { echo "host_batch.sh: ray not importable" >&2; exit 2; }
  gpus=${NUM_GPUS:-8}
fi
# Ray's token authentication for the head and every client of it, a token
# generated if none exists (Ray 2.60 enables it only when a token file is
# present, and clients of an existing cluster then fail without this)
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ] && [ ! -s "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]; then
  python3 -m ray.scripts.scripts get-auth-token --generate > /dev/null
fi
# a head already up answers `ray status` at once; with nothing on the port, ray
# status retries for ~40 s before it fails, so look at the port first
if ! { (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && python3 -m ray.scripts.scripts status --address "127.0.0.1:$port" > /dev/null 2>&1; }; then
  python3 -m ray.scripts.scripts start --head --port "$port" --num-gpus "$gpus" --disable-usage-stats > "$logs/ray-start.log" 2>&1
fi
# OUT_DIR holds what earlier calls of this checkout measured on this host; a
# host lent again in a later session can still have an older checkout's files
# there, which would shadow the committed results: moved aside
if compgen -G "$out_dir/*.json" > /dev/null && [ "$(cat "$out_dir/.commit" 2>/dev/null)" != "$SGLANG_ELASTIC_COMMIT" ]; then
  old="$out_dir.$(date +%s)"; mv "$out_dir" "$old"; echo "host_batch.sh: $out_dir is from another checkout: moved to $old" >&2
fi
mkdir -p "$out_dir" && echo "$SGLANG_ELASTIC_COMMIT" > "$out_dir/.commit"
[ -n "$standin" ] || cp -n docs/results/eval/*.json "$out_dir"/ 2>/dev/null || true  # a dry run starts from nothing
limit=$((budget - ($(date +%s) - t0) - 20))   # each run.py's time, 20 s kept for packing
deadline=$((limit - row_s))                   # its last server start, relative to its own start
if [ "$deadline" -le 0 ]; then
  echo "host_batch.sh: --budget $budget leaves ${limit} s after set-up, less than one row (--row-s $row_s): nothing started" >&2
  exit 2
fi
pids=()
for i in "${!configs[@]}"; do
  file=${configs[$i]}
  name=$(basename "$file" .yaml)
  rows=(--resume)                                       # CONFIG: the rows not measured yet
  [ -z "${onlys[$i]}" ] || rows=(--only "${onlys[$i]}")  # CONFIG:LABEL,...: these rows, measured again
  # shellcheck disable=SC2086  # $warm and $standin are one flag or none
  timeout "$limit" python3 scripts/eval/run.py "$file" --address "127.0.0.1:$port" --out-dir "$out_dir" --log-dir "$server_logs" --no-report "${rows[@]}" \
    --start-deadline-s "$deadline" $warm $standin > "$logs/$name.log" 2>&1 &
  pids+=($!)
done
rc=0
for i in "${!pids[@]}"; do
  st=0; wait "${pids[$i]}" || st=$?
  log=$logs/$(basename "${configs[$i]}" .yaml).log
  if [ "$st" = 124 ]; then rc=1; echo "${configs[$i]}: run.py cut at ${limit} s (--budget); rows in flight are lost (their earlier results stay), the next call runs them (log: $log)" >&2
  elif [ "$st" != 0 ]; then rc=1; echo "${configs[$i]}: run.py exited with status $st (log: $log)" >&2; fi
done
for c in "${configs[@]}"; do grep -hE "row\(s\)|is measured|nothing measured" "$logs/$(basename "$c" .yaml).log" | tail -1 || echo "$c: no summary (see its log)"; done
exit $rc
