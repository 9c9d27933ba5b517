"""Vacating the lent range before a reclaim: address-targeted radix eviction
and rewriting every reference to migrated KV slots.

A reclaim shrinks the backed token range to ``[0, top)``. Before the arena
unmaps ``[top, old_top)``, every slot there must be unused:

1. :func:`evict_above`: radix-cache-only leaves (no request holds them) whose
   slots reach above ``top`` are evicted, SGLang-style (free the value,
   ``_delete_leaf``). SGLang's own ``RadixCache.evict`` picks LRU leaves
   wherever their slots are; this picks by address.
2. ``allocator.withdraw(new_lent)`` drops the free slots above ``top`` and
   returns the in-use ones; :func:`~sglang_elastic.pool.relocate_kv` copies
   their K/V into free base slots.
3. :func:`remap_ids` / :func:`remap_tree` rewrite the slot ids the scheduler
   still holds: ``req_to_token`` rows of live requests, radix-tree
   ``TreeNode.value`` tensors, ``req.prefix_indices``.

Token ids are what SGLang stores everywhere (``req_to_token``, tree values),
also with ``page_size > 1``; the allocator's units are pages then, and a
token id ``t`` lives in page ``t // page_size`` at slot ``t % page_size``.

The in-tree precedent is SGLang's unified memory pool compaction
(``sglang/srt/mem_cache/multi_ended_allocator.py``), which moves survivors out
of a band and rewrites its v2p tables instead.
"""

from __future__ import annotations

from typing import Iterator

import torch


def _lut(top_units: int, src_units: torch.Tensor, dst_units: torch.Tensor, old_top_units: int) -> torch.Tensor:
    lut = torch.full((max(old_top_units - top_units, 0),), -1, dtype=torch.int64, device=src_units.device)
    lut[src_units - top_units] = dst_units.to(torch.int64)
    return lut


def remap_ids(ids: torch.Tensor, top_tok: int, src_units: torch.Tensor, dst_units: torch.Tensor, page_size: int) -> torch.Tensor:
    """``ids`` (token ids, any int dtype and shape) with every id ``>= top_tok``
    moved to its relocated slot; ids below ``top_tok`` are unchanged.

    Args:
        src_units / dst_units: what ``withdraw`` returned and ``relocate_kv``
            gave for it (token ids for page size 1, page ids otherwise).

    Raises:
        ValueError: when an id at or above ``top_tok`` is not among ``src_units``
            (it would point into unmapped memory).
    """
    if ids.numel() == 0 or src_units.numel() == 0:
        if ids.numel() and int(ids.max()) >= top_tok:
            raise ValueError(f"id {int(ids.max())} >= top {top_tok} was not relocated")
        return ids
    top_units = top_tok // page_size
    old_top_units = int(src_units.max()) + 1
    lut = _lut(top_units, src_units, dst_units, old_top_units)
    flat = ids.reshape(-1).to(torch.int64)
    hi = flat >= top_tok
    if not bool(hi.any()):
        return ids
    units = flat[hi] // page_size - top_units
    if bool((units >= lut.numel()).any()) or bool((lut[units.clamp(max=lut.numel() - 1)] < 0).any()):
        raise ValueError("an id at or above the reclaim top was not relocated")
    out = flat.clone()
    out[hi] = lut[units] * page_size + flat[hi] % page_size
    return out.reshape(ids.shape).to(ids.dtype)


def iter_nodes(tree) -> Iterator:
    """Every node of an SGLang ``RadixCache`` below its root (depth first)."""
    stack = list(tree.root_node.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _reaching(values, top_tok: int):
    """Indices of the tensors in ``values`` holding an id ``>= top_tok``,
    found with one device-to-host read for all of them."""
    if not values:
        return []
    lens = torch.tensor([v.numel() for v in values])
    flat = torch.cat([v.reshape(-1).to(torch.int64) for v in values])
    owner = torch.repeat_interleave(torch.arange(len(values)), lens).to(flat.device)
    hits = torch.zeros(len(values), dtype=torch.int64, device=flat.device).index_add_(0, owner, (flat >= top_tok).to(torch.int64))
    return torch.nonzero(hits).flatten().tolist()


def remap_many(values, top_tok: int, src_units: torch.Tensor, dst_units: torch.Tensor, page_size: int):
    """:func:`remap_ids` over a list of id tensors, with one device-to-host
    read to find the ones holding an id ``>= top_tok``. Returns the new list
    (untouched tensors are the same objects) and the indices rewritten."""
    out = list(values)
    hit = _reaching(out, top_tok)
    for i in hit:
        out[i] = remap_ids(out[i], top_tok, src_units, dst_units, page_size)
    return out, hit


def plan_tree_remap(tree, top_tok: int, src_units: torch.Tensor, dst_units: torch.Tensor, page_size: int):
    """The new ``TreeNode.value`` of every node holding ids ``>= top_tok``,
    computed without writing anything: ``(nodes, values)``.

    Raises:
        ValueError: from :func:`remap_ids` (nothing is changed then).
    """
    nodes = [n for n in iter_nodes(tree) if n.value is not None and n.value.numel()]
    values, hit = remap_many([n.value for n in nodes], top_tok, src_units, dst_units, page_size)
    return [nodes[i] for i in hit], [values[i] for i in hit]


def remap_tree(tree, top_tok: int, src_units: torch.Tensor, dst_units: torch.Tensor, page_size: int) -> int:
    """Rewrite ``TreeNode.value`` of every node holding ids ``>= top_tok``.
    Returns the number of nodes rewritten."""
    nodes, values = plan_tree_remap(tree, top_tok, src_units, dst_units, page_size)
    for node, value in zip(nodes, values):
        node.value = value
    return len(nodes)


def evict_above(tree, top_tok: int) -> int:
    """Evict unlocked radix-cache leaves whose slots reach ``top_tok`` or above,
    repeating as parents become such leaves. Returns the tokens evicted.

    Uses SGLang's own eviction steps (``free_segment`` of the value,
    ``_delete_leaf``; ``RadixCache.evict``, radix_cache.py). Frees of ids above
    the top during a vacate are dropped by the allocator (they are being
    unmapped), so this may run before or after ``allocator.withdraw``.
    """
    evicted = 0
    while True:
        leaves = [n for n in tree.evictable_leaves if n.lock_ref == 0 and n.value is not None and n.value.numel()]
        hit = _reaching([n.value for n in leaves], top_tok)
        if not hit:
            return evicted
        for i in hit:
            node = leaves[i]
            tree.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
            evicted += len(node.value)
            tree._delete_leaf(node)
            tree._record_remove_event(node)
