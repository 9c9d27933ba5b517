#!/usr/bin/env bash
# The FA3 column of the decode bench (issue 23, build 3: SGLang's default decode backend on the H200) needs PyPI's
# tokenspeed-fa3 wheel (62.8 MB): with the tree it is at the device's 64 MiB limit for one carry, so it travels in two
# halves, each beside something else (e.g. the bundle's .gpu/b2, 26 MB), and is joined on the host.
#   bash scripts/gpu/fetch_fa3.sh [DIR]   (default .gpu/fa3; on a machine with PyPI)
#   -> DIR/tokenspeed_fa3-*.whl.part-00, .part-01 and .sha256 (the whole wheel's; it travels with the second half)
# On the host, in calls in a row: `bash scripts/gpu/offload_call.sh fa3_stash` with the first half carried, then
# `... fa3_stash fa3_install decode_bench` with the second half and the .sha256 (scripts/gpu/offload_call.sh;
# bench_decode.py then has fa3_us).
set -euo pipefail
dir=${1:-.gpu/fa3}
mkdir -p "$dir"
whl=$(ls "$dir"/tokenspeed_fa3-*.whl 2>/dev/null | head -1 || true)
if [ -z "$whl" ]; then
  python3 -m pip download -q tokenspeed-fa3 --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 -d "$dir"
  whl=$(ls "$dir"/tokenspeed_fa3-*.whl | head -1)
fi
name=$(basename "$whl")
rm -f "$dir/$name".part-*
(cd "$dir" && sha256sum "$name" > "$name.sha256" && split -n 2 -d -a 2 "$name" "$name.part-")
ls -l "$dir"
