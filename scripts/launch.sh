#!/usr/bin/env bash
# The main job: SGLang 0.5.17's own server, patched by sglang-elastic, on the
# embedded Llama-3.1-8B shape (random weights, --skip-tokenizer-init).
#   bash scripts/launch.sh [SGLANG FLAGS...]      e.g. --port 30000 --tp 2
# Installs this package if it is not importable, applies the series if the
# installed SGLang is pristine, then runs `sglang-elastic serve`.
# On a machine without an NVIDIA GPU it exits at once and names the test command.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if ! nvidia-smi -L 2>/dev/null | grep -q GPU; then
  echo "scripts/launch.sh: no NVIDIA GPU on this machine, so no server is started. To check the project here, run the CPU test suite: bash ci/test.sh" >&2
  exit 2
fi
# Installed (not merely importable from this directory): SGLang finds the
# plugin through the distribution's entry point.
"$py" -c "import importlib.metadata as m; m.distribution('sglang-elastic')" 2>/dev/null \
  || "$py" -m pip install -q --no-deps --no-build-isolation ${SGLANG_ELASTIC_PIP_ARGS:-} .
if "$py" -m sglang_elastic.cli patch status | head -1 | grep -q ': pristine$'; then
  "$py" -m sglang_elastic.cli patch apply
fi
exec "$py" -m sglang_elastic.cli serve "$@"
