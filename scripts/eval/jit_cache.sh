#!/usr/bin/env bash
# Carry a GPU host's JIT caches from one device call to the next host: a fresh
# host otherwise compiles FlashInfer's prefill kernels during its first server
# start (the Llama-3.1-8B shape: prefill graph capture 190 s instead of 21 s).
#
#   bash scripts/eval/jit_cache.sh save FILE.tgz              # pack the caches into FILE.tgz.00, .01, ...
#   bash scripts/eval/jit_cache.sh restore FILE.tgz           # unpack them on a fresh host
#
# Caches: FlashInfer's ninja builds (${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer,
# flashinfer/jit/env.py), Triton's kernels (${TRITON_CACHE_DIR:-$HOME/.triton/cache}) and SGLang's
# own JIT kernels (${TVM_FFI_CACHE_DIR:-$HOME/.cache/tvm-ffi}: sglang/kernels/jit/utils/compile.py
# loads a module's .so from there when present; the directory names the module, GPU arch and TVM-FFI
# version, and the module name carries a hash of its sources).
# With the first two alone a restored host's first offload server still started in 147 s,
# its next start (another flag) in 84 s (H100, 2026-12-05).
# The archive keeps the files' mtimes. FlashInfer runs ninja before every load
# (JitSpec.build_and_load), and ninja keeps an object only while its inputs
# are older than the mtime its build log recorded: the bundle's install
# unpacks FlashInfer's sources with the bundle's own mtimes, older than the
# objects, so a restored cache is used as is; a bundle rebuilt later has newer
# sources and ninja rebuilds, as it should. Triton keys its cache on source
# hashes.
#
# A device call returns files of at most 16 MiB, so save writes parts of
# 15 MiB (FILE.00, FILE.01, ...; restore also takes one whole FILE). Both are
# all or nothing: save renames the parts into place only once complete, and
# restore checks the whole archive before it unpacks a file (a truncated one
# is refused and the host compiles afresh). Status 0 with a warning when
# there is nothing to save or restore; 1 when the archive is damaged.
set -euo pipefail
fi_dir=${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer
triton_dir=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
tvm_dir=${TVM_FFI_CACHE_DIR:-$HOME/.cache/tvm-ffi}
part_bytes=${JIT_CACHE_PART_BYTES:-15728640}
usage() { sed -n '2,7p' "$0" >&2; exit 2; }
[ $# -eq 2 ] || usage
cmd=$1 file=$2
parts() { compgen -G "$file.[0-9][0-9]" | sort || true; }
case $cmd in
  save)
    dirs=()
    for d in "$fi_dir" "$triton_dir" "$tvm_dir"; do [ -d "$d" ] && dirs+=("${d#/}"); done
    [ ${#dirs[@]} -gt 0 ] || { echo "jit_cache.sh: no JIT cache on this host ($fi_dir, $triton_dir, $tvm_dir)" >&2; exit 0; }
    tmp=$(mktemp -d "$(dirname "$file")/.jit-cache.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    tar czf "$tmp/all" -C / --exclude='*.lock' "${dirs[@]}"
    split -b "$part_bytes" -d -a 2 "$tmp/all" "$tmp/part."
    rm -f "$file" $(parts)
    for p in "$tmp"/part.*; do mv "$p" "$file.${p##*.}"; done
    n=$(parts | wc -l) mb=$(( $(stat -c %s "$tmp/all") >> 20 ))
    echo "jit_cache.sh: saved ${dirs[*]/#//} to $file.00..$(printf %02d $((n - 1))) ($mb MiB in $n part(s))"
    ;;
  restore)
    mapfile -t ps < <(parts)
    [ ${#ps[@]} -gt 0 ] || { [ -f "$file" ] && ps=("$file"); }
    [ ${#ps[@]} -gt 0 ] || { echo "jit_cache.sh: no cache $file or $file.00 (a fresh host compiles its kernels)" >&2; exit 0; }
    if ! cat "${ps[@]}" | tar tzf - > /dev/null 2>&1; then
      echo "jit_cache.sh: $file is damaged (${#ps[@]} part(s) read); nothing restored, the host compiles afresh" >&2
      exit 1
    fi
    cat "${ps[@]}" | tar xzf - -C /
    echo "jit_cache.sh: restored $file (${#ps[@]} part(s))"
    ;;
  *) usage ;;
esac
