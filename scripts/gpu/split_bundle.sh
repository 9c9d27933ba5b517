#!/usr/bin/env bash
# Split the GPU bundle (.gpu/bundle, built by .gpu/build_bundle.sh) into two carries for two device calls in a row
# on one host: the device refused the tree plus the whole bundle (63.4 MB) on 2026-12-05 as over its 64 MiB, although
# their bytes sum to 66.9 MB; each half travels with the tree.
#   bash scripts/gpu/split_bundle.sh [.gpu/bundle]   -> .gpu/b1 (parts 1 and 3, 37.1 MB), .gpu/b2 (part 2, 26.3 MB)
# Then: call 1 carries .gpu/b1 and .gpu/install_bundle.sh and runs `bash .gpu/install_bundle.sh .gpu/b1` (it unpacks both
# parts and says part 2 is missing); call 2, within the 30 s the host stays warm, carries .gpu/b2 and begins with
# `bash .gpu/install_bundle.sh .gpu/b2 &&` (offload_call.sh then finds the bundle installed).
set -euo pipefail
src=${1:-.gpu/bundle}
dir=$(dirname "$src")
for p in 1 2 3; do [ -f "$src/part$p.tar.xz" ] || { echo "split_bundle: no $src/part$p.tar.xz (run .gpu/build_bundle.sh $src)" >&2; exit 1; }; done
rm -rf "$dir/b1" "$dir/b2" && mkdir -p "$dir/b1" "$dir/b2"
ln -f "$src/part1.tar.xz" "$src/part3.tar.xz" "$dir/b1/" && ln -f "$src/part2.tar.xz" "$dir/b2/"
grep -E " part[13]\.tar\.xz$" "$src/SHA256SUMS" > "$dir/b1/SHA256SUMS"
grep -E " part2\.tar\.xz$" "$src/SHA256SUMS" > "$dir/b2/SHA256SUMS"
du -b "$dir/b1" "$dir/b2"
