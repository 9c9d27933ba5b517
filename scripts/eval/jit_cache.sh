#!/usr/bin/env bash
# Carry a GPU host's JIT caches from one device call to the next host: a fresh
# host otherwise compiles FlashInfer's prefill kernels during its first server
# start (the Llama-3.1-8B shape: prefill graph capture 190 s instead of 21 s).
#
#   bash scripts/eval/jit_cache.sh save FILE.tgz              # pack the caches, mtimes kept
#   bash scripts/eval/jit_cache.sh restore FILE.tgz [SITE]    # unpack them on a fresh host
#
# Caches: FlashInfer's ninja builds (${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer,
# flashinfer/jit/env.py) and Triton's kernels (${TRITON_CACHE_DIR:-$HOME/.triton/cache}).
# Triton keys its cache on source hashes, so unpacking is enough. FlashInfer
# runs ninja before every load (JitSpec.build_and_load), and ninja rebuilds an
# object whose inputs are newer than the mtime its build log recorded. The
# bundle's install writes FlashInfer's sources and headers with the install
# time, newer than any object built on an earlier host. So restore also sets
# the C, C++ and CUDA files under SITE (default /tmp/site, where the bundle
# installs) to 2000-01-01; Python files keep theirs (their .pyc caches are
# keyed on them). The build commands name SITE's paths, so the caches fit a
# host that installs the bundle at the same place.
set -euo pipefail
fi_dir=${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer
triton_dir=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
usage() { sed -n '2,18p' "$0" >&2; exit 2; }
[ $# -ge 2 ] || usage
cmd=$1 file=$2
case $cmd in
  save)
    dirs=()
    for d in "$fi_dir" "$triton_dir"; do [ -d "$d" ] && dirs+=("${d#/}"); done
    [ ${#dirs[@]} -gt 0 ] || { echo "jit_cache.sh: no JIT cache on this host ($fi_dir, $triton_dir)"; exit 0; }
    tar czf "$file" -C / --exclude='*.lock' "${dirs[@]}"
    mb=$(( $(stat -c %s "$file") >> 20 ))
    echo "jit_cache.sh: saved ${dirs[*]/#//} to $file ($mb MiB)"
    # a device call carries 64 MiB: the Ray part (30 MiB) and the repo travel with it
    [ "$mb" -le 28 ] || echo "jit_cache.sh: warning: $file is $mb MiB; with the Ray part (30 MiB) it may not fit one 64 MiB transfer" >&2
    ;;
  restore)
    site=${3:-/tmp/site}
    [ -f "$file" ] || { echo "jit_cache.sh: no cache file $file (a fresh host compiles its kernels)" >&2; exit 0; }
    tar xzf "$file" -C /   # keeps the archive's mtimes, which the ninja logs recorded
    if [ -d "$site" ]; then
      find "$site" -type f \( -name '*.h' -o -name '*.hh' -o -name '*.hpp' -o -name '*.cuh' -o -name '*.inl' -o -name '*.inc' \
        -o -name '*.tcc' -o -name '*.c' -o -name '*.cc' -o -name '*.cpp' -o -name '*.cu' \) -exec touch -h -d @946684800 {} +
      # headers without an extension (libcu++ / CCCL's <cuda/std/...>) inside the include trees
      while IFS= read -r -d '' inc; do
        find "$inc" -type f ! -name '*.py' ! -name '*.pyc' -exec touch -h -d @946684800 {} +
      done < <(find "$site" -type d -name include -prune -print0)
    fi
    echo "jit_cache.sh: restored $file"
    ;;
  *) usage ;;
esac
