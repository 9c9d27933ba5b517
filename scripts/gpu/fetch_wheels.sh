#!/usr/bin/env bash
# Download (here, with PyPI) the wheels the GPU host lacks beside the SGLang
# bundle: `datasets` (imported by sglang.bench_serving) and its `multiprocess`.
# They go to .whl/ (git-ignored); carry .whl with the device call.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl datasets==5.2.0 multiprocess==0.70.19
ls -la .whl
