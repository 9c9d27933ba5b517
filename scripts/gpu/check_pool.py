"""GPU check of the elastic pool layer: SGLang's MHA pool on CUDA VMM buffers.

Builds ``ElasticMHATokenToKVPool`` (Llama-3.1-8B per-layer shape: 32 layers,
8 KV heads, head_dim 128, bf16, page size 16) on ``CudaBackend``, lends the
elastic tail, writes random K/V into lent pages with SGLang's
``set_kv_buffer``, withdraws the lent range, migrates the pages into the base
with ``relocate_kv`` (SGLang's ``move_kv_cache_native``), reclaims (unmaps)
the tail, and checks every migrated row bit for bit against a copy kept on
the host; repeats for several cycles, timing withdraw + migrate + reclaim.

    python scripts/gpu/check_pool.py --out docs/results/pool_check_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types

import torch

from sglang_elastic import results
from sglang_elastic.pool import ElasticMHATokenToKVPool, ElasticPagedTokenToKVPoolAllocator, relocate_kv, unit_tokens
from sglang_elastic.vmm.cuda import CudaBackend


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--base-tokens", type=int, default=200_000)
    ap.add_argument("--elastic-tokens", type=int, default=65_536)
    ap.add_argument("--migrate-tokens", type=int, default=4096)
    ap.add_argument("--cycles", type=int, default=10)
    a = ap.parse_args()
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    be = CudaBackend(0)
    L, H, D, P = 32, 8, 128, 16
    pool = ElasticMHATokenToKVPool(
        backend=be, base_tokens=a.base_tokens, max_elastic_tokens=a.elastic_tokens, page_size=P,
        dtype=torch.bfloat16, head_num=H, head_dim=D, layer_num=L, device="cuda",
        enable_memory_saver=False, enable_alt_stream=False,
    )
    alloc = ElasticPagedTokenToKVPoolAllocator(pool, torch.bfloat16, "cuda")
    arena = pool.arena
    ok_all, vacate_ms, cycles = True, [], []
    g = torch.Generator(device="cuda").manual_seed(0)
    for c in range(a.cycles):
        arena.lend()
        alloc.lend(arena.lent_tokens)
        # occupy the base except room for the pages to migrate, then fill lent pages
        hold = alloc.alloc(alloc.available_size() - arena.lent_tokens - a.migrate_tokens)
        room = alloc.alloc(a.migrate_tokens)
        lent = alloc.alloc(a.migrate_tokens)
        assert lent is not None and int(lent.min()) >= arena.base_tokens, "expected lent ids"
        alloc.free(room)
        ref = []
        for l in range(L):
            k = torch.randn(lent.numel(), H, D, device="cuda", generator=g).bfloat16()
            v = torch.randn(lent.numel(), H, D, device="cuda", generator=g).bfloat16()
            pool.set_kv_buffer(types.SimpleNamespace(layer_id=l, k_scale=None, v_scale=None), lent, k, v)
            ref.append((k.cpu(), v.cpu()))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        units = alloc.withdraw(0)
        dst = relocate_kv(pool, alloc, units)
        arena.reclaim()  # synchronizes the device before unmapping
        alloc.end_vacate()
        t1 = time.perf_counter()
        vacate_ms.append((t1 - t0) * 1e3)
        dst_tok = unit_tokens(dst, P)
        ok = all(torch.equal(pool.get_key_buffer(l)[dst_tok].cpu(), ref[l][0]) and torch.equal(pool.get_value_buffer(l)[dst_tok].cpu(), ref[l][1]) for l in range(L))
        ok_all &= ok
        cycles.append({"migrated_tokens": int(dst_tok.numel()), "ok": ok, "vacate_ms": vacate_ms[-1]})
        alloc.free(hold)
        alloc.free(dst_tok)
        print(f"cycle {c}: migrated {dst_tok.numel()} tokens x {L} layers, K/V identical: {ok}, withdraw+migrate+reclaim {vacate_ms[-1]:.2f} ms", flush=True)
    res = {
        **results.header(),
        "shape": {"layers": L, "kv_heads": H, "head_dim": D, "page_size": P, "dtype": "bfloat16"},
        "base_tokens": arena.base_tokens,
        "elastic_tokens": arena.max_elastic_tokens,
        "supports_offset_mapping": be.supports_offset_mapping,
        "kv_identical_after_migration": ok_all,
        "vacate_ms": {"p50": statistics.median(vacate_ms), "max": max(vacate_ms)},
        "cycles": cycles,
    }
    pool._clear_buffers()
    results.write(a.out, res)
    if not ok_all:
        sys.exit(1)


if __name__ == "__main__":
    main()
