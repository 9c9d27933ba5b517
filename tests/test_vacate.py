"""Vacating the lent range on SGLang's real RadixCache and ReqToTokenPool."""

from __future__ import annotations

from array import array

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from sglang_elastic.pool import evict_above, iter_nodes, relocate_kv, remap_ids, remap_tree

from test_pool import DIM, HEADS, LAYERS, layer, make_pool


def test_remap_ids_moves_only_ids_above_the_top_and_keeps_dtype():
    src = torch.tensor([10, 12])  # pages, page size 4, top 40
    dst = torch.tensor([3, 5])
    ids = torch.tensor([[1, 2, 41, 42], [49, 50, 51, 39]], dtype=torch.int32)
    out = remap_ids(ids, 40, src, dst, 4)
    assert out.dtype == torch.int32
    assert out.tolist() == [[1, 2, 13, 14], [21, 22, 23, 39]]
    with pytest.raises(ValueError, match="not relocated"):
        remap_ids(torch.tensor([44]), 40, src, dst, 4)  # page 11 was not relocated
    with pytest.raises(ValueError, match="not relocated"):
        remap_ids(torch.tensor([99]), 40, src, dst, 4)


@pytest.mark.parametrize("page_size", [1, 16])
def test_vacate_with_a_radix_tree_and_running_requests(page_size):
    be, pool, alloc = make_pool(page_size, base=128, elastic=128, step=128)
    a = pool.arena
    tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=page_size))
    req_to_token = ReqToTokenPool(4, 256, "cpu", False).req_to_token
    gen = torch.Generator().manual_seed(page_size)
    try:
        a.lend()
        alloc.lend(a.lent_tokens)
        alloc.alloc(alloc.available_size() - a.lent_tokens)  # the base is busy ...
        seqs, kv = {}, {}
        for name in ("locked", "cached", "shared"):
            tokens = array("q", torch.randint(0, 1000, (32,), generator=gen).tolist())
            if name == "shared":  # shares its first 16 tokens (one page) with "locked"
                tokens[:16] = seqs["locked"][0][:16]
                ids = torch.cat((seqs["locked"][1][:16], alloc.alloc(16)))
            else:
                ids = alloc.alloc(32)
            assert int(ids.min()) >= a.base_tokens  # the base is busy: all in the lent range
            for l in range(LAYERS):
                k = torch.randn(32, HEADS, DIM, generator=gen).bfloat16()
                pool.set_kv_buffer(layer(l), ids, k, -k)
            for t in ids.tolist():
                kv[t] = [pool.get_key_buffer(l)[t].clone() for l in range(LAYERS)]
            tree.insert(InsertParams(key=RadixKey(tokens), value=ids))
            seqs[name] = (tokens, ids)
        # "locked" is a running request: it holds its tree path and a req_to_token row.
        m = tree.match_prefix(MatchPrefixParams(key=RadixKey(seqs["locked"][0])))
        tree.inc_lock_ref(m.last_device_node)
        req_to_token[1, :32] = seqs["locked"][1].to(torch.int32)
        prefix_indices = m.device_indices.clone()
        # Free enough base slots for what must move (the locked path: 32 tokens).
        alloc.free(torch.arange(page_size, page_size + 32))

        top = a.base_tokens  # reclaim the whole lent range
        evicted = evict_above(tree, top)
        # "cached" (32 tokens) and "shared"'s own second page (16) are unlocked
        # leaves; the page "shared" has in common with "locked" is locked.
        assert evicted == 48
        in_use = alloc.withdraw(0)
        locked_units = seqs["locked"][1] if page_size == 1 else torch.unique(seqs["locked"][1] // page_size)
        assert in_use.tolist() == locked_units.tolist()
        dst = relocate_kv(pool, alloc, in_use)
        assert dst is not None
        remap_tree(tree, top, in_use, dst, page_size)
        req_to_token[1, :32] = remap_ids(req_to_token[1, :32], top, in_use, dst, page_size)
        prefix_indices = remap_ids(prefix_indices, top, in_use, dst, page_size)
        a.reclaim()
        alloc.end_vacate()

        assert all(int(n.value.max()) < top for n in iter_nodes(tree))
        assert int(req_to_token[1, :32].max()) < top
        m2 = tree.match_prefix(MatchPrefixParams(key=RadixKey(seqs["locked"][0])))
        assert torch.equal(m2.device_indices, prefix_indices)
        assert torch.equal(req_to_token[1, :32].to(torch.int64), prefix_indices)
        for new, old in zip(prefix_indices.tolist(), seqs["locked"][1].tolist()):
            for l in range(LAYERS):
                assert torch.equal(pool.get_key_buffer(l)[new], kv[old][l])
                assert torch.equal(pool.get_value_buffer(l)[new], -kv[old][l])
        # the evicted sequence is gone from the tree, and nothing of it was kept
        assert len(tree.match_prefix(MatchPrefixParams(key=RadixKey(seqs["cached"][0]))).device_indices) == 0
    finally:
        pool._clear_buffers()
