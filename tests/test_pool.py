"""SGLang's MHA pool and allocators over an elastic arena (host VMM backend).

Real SGLang classes throughout: ``MHATokenToKVPool`` (subclassed only to place
its buffers), ``TokenToKVPoolAllocator`` and ``PagedTokenToKVPoolAllocator``,
SGLang's ``set_kv_buffer`` to write K/V and ``move_kv_cache_native`` to move it.
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_elastic.pool import (
    ElasticMHATokenToKVPool,
    ElasticPagedTokenToKVPoolAllocator,
    ElasticTokenToKVPoolAllocator,
    relocate_kv,
    tensor_at,
    unit_tokens,
)
from sglang_elastic.vmm import HostBackend

HEADS, DIM, LAYERS = 2, 64, 3  # 256 B per row in bf16: the quantum is 16 tokens at 4 KiB granules


def make_pool(page_size: int, base=64, elastic=128, step=32, offset_mapping=True, need_sort=False):
    """A small pool, so that random allocations spill into the lent range and
    reclaims must migrate or retract. ``offset_mapping=False`` is the H200's
    case: one handle per buffer per step."""
    be = HostBackend(granularity=4096, offset_mapping=offset_mapping)
    pool = ElasticMHATokenToKVPool(
        backend=be, base_tokens=base, max_elastic_tokens=elastic, step_tokens=step,
        page_size=page_size, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM, layer_num=LAYERS,
        device="cpu", enable_memory_saver=False, enable_alt_stream=False,
    )
    cls = ElasticTokenToKVPoolAllocator if page_size == 1 else ElasticPagedTokenToKVPoolAllocator
    return be, pool, cls(pool, torch.bfloat16, "cpu", need_sort=need_sort)


def layer(i):
    return types.SimpleNamespace(layer_id=i, k_scale=None, v_scale=None)


def test_tensor_at_aliases_the_memory_it_is_given():
    buf = torch.zeros(4096, dtype=torch.uint8)
    t = tensor_at(buf.data_ptr(), (8, 2, 64), torch.bfloat16, "cpu")
    x = torch.randn(8, 2, 64).bfloat16()
    t.copy_(x)
    assert torch.equal(buf[: 8 * 2 * 64 * 2].view(torch.bfloat16).view(8, 2, 64), x)
    with pytest.raises(TypeError):
        tensor_at(buf.data_ptr(), (4,), torch.complex64, "cpu")


def test_pool_buffers_sit_at_the_arena_addresses_and_span_every_lendable_row():
    be, pool, alloc = make_pool(16)
    try:
        a = pool.arena
        rows = a.base_tokens + a.max_elastic_tokens
        for i in range(LAYERS):
            assert pool.get_key_buffer(i).data_ptr() == a.buffer_va[i]
            assert pool.get_value_buffer(i).data_ptr() == a.buffer_va[LAYERS + i]
            assert tuple(pool.get_key_buffer(i).shape) == (rows, HEADS, DIM)
        assert pool.size == rows - 16
        assert alloc.size == a.base_tokens - 16 and alloc.available_size() == a.base_tokens - 16
        # the base starts zeroed, as SGLang's torch.zeros pools do
        assert int(pool.get_key_buffer(0)[: a.base_tokens].abs().sum()) == 0
    finally:
        pool._clear_buffers()
    assert be.live_handles == 0

@pytest.mark.parametrize("page_size", [1, 16])
def test_lend_grows_admission_capacity_and_withdraw_returns_in_use_ids(page_size):
    be, pool, alloc = make_pool(page_size)
    try:
        a = pool.arena
        base_free = alloc.available_size()
        a.lend(2)
        new = alloc.lend(a.lent_tokens)
        assert alloc.available_size() == base_free + a.lent_tokens
        assert int(new.min()) == a.base_tokens // page_size and int(new.max()) == (a.base_tokens + a.lent_tokens) // page_size - 1
        everything = alloc.alloc(alloc.available_size())
        assert int(everything.max()) == a.base_tokens + a.lent_tokens - 1
        assert alloc.alloc(page_size) is None
        # free one step's worth back below and above the watermark, then withdraw one step
        top = (a.base_tokens + a.step_tokens) // page_size
        unit_ids = everything if page_size == 1 else everything[::page_size] // page_size
        alloc.free(everything[:page_size])  # one low unit
        alloc.free(everything[-page_size:])  # the highest unit
        in_use = alloc.withdraw(a.step_tokens)
        expect = sorted(int(u) for u in unit_ids if int(u) >= top and int(u) != int(unit_ids[-1]))
        assert in_use.tolist() == expect
        assert alloc.size == a.base_tokens + a.step_tokens - page_size
        assert alloc.available_size() == page_size  # only the low unit is free
        with pytest.raises(RuntimeError, match="lend during a vacate"):
            alloc.lend(a.step_tokens)
        a.reclaim(1)
        alloc.end_vacate()
        with pytest.raises(ValueError):
            alloc.lend(10 * a.max_elastic_tokens)
        with pytest.raises(ValueError, match="non-negative multiple of the page size"):
            alloc.withdraw(-page_size)
        if page_size > 1:
            with pytest.raises(ValueError, match="non-negative multiple of the page size"):
                alloc.lend(a.step_tokens + page_size // 2)
    finally:
        pool._clear_buffers()


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_lend_from_a_prepared_free_list_installs_its_prefix_and_equals_a_plain_lend(page_size):
    """The controller makes the lend's free list before the TP ranks agree
    (``prepare_lend`` for every step this rank mapped), then lends what they
    agreed, possibly fewer steps: the list's prefix, with nothing allocated."""
    be, pool, alloc = make_pool(page_size)
    be2, pool2, alloc2 = make_pool(page_size)
    try:
        for al in (alloc, alloc2):  # the same holes in both free lists (random ones with pages of one token)
            g = torch.Generator().manual_seed(7)
            taken = al.alloc(8 if page_size == 1 else 2 * page_size)
            al.free(taken[torch.randperm(8, generator=g)[:4]] if page_size == 1 else taken[page_size:])
        pool.arena.lend(3)
        pool2.arena.lend(2)
        before = alloc.free_pages.clone()
        full = alloc.prepare_lend(pool.arena.lent_tokens)
        assert torch.equal(alloc.free_pages, before) and alloc.available_size() == alloc2.available_size()  # preparing changes nothing
        pool.arena.reclaim(1)  # the agreement lent one step fewer than this rank mapped
        new = alloc.lend(pool.arena.lent_tokens, prepared=full)
        plain = alloc2.lend(pool2.arena.lent_tokens)
        assert torch.equal(alloc.free_pages, alloc2.free_pages) and torch.equal(new, plain)
        assert alloc.free_pages.data_ptr() == full.data_ptr()  # a view of the prepared list: nothing allocated
        assert alloc.available_size() == alloc2.available_size() and alloc.size == alloc2.size
        short = alloc.prepare_lend(pool.arena.lent_tokens)  # made for the tokens lent now, then one more step mapped
        pool.arena.lend(1)
        with pytest.raises(ValueError, match="prepared free list has"):
            alloc.lend(pool.arena.lent_tokens, prepared=short)
        assert torch.equal(alloc.free_pages, alloc2.free_pages)  # refused before anything changed
        # a list made before the free list changed: its ids would be free twice (the taken ids are in it)
        stale = alloc.prepare_lend(pool.arena.lent_tokens)
        taken = alloc.alloc(page_size)
        with pytest.raises(ValueError, match="not made by this pool's last prepare_lend"):
            alloc.lend(pool.arena.lent_tokens, prepared=stale)
        alloc.free(taken)
        fresh = alloc.prepare_lend(pool.arena.lent_tokens)
        with pytest.raises(ValueError, match="not made by this pool's last prepare_lend"):  # nor one made before another
            alloc.lend(pool.arena.lent_tokens, prepared=stale)
        assert len(alloc.lend(pool.arena.lent_tokens, prepared=fresh)) == pool.arena.step_tokens // page_size
    finally:
        pool._clear_buffers()
        pool2._clear_buffers()


@pytest.mark.parametrize(
    "page_size,offset_mapping,need_sort",
    [(1, True, False), (16, True, False), (16, False, False), (1, False, True), (16, True, True)],
    ids=["p1", "p16", "p16-handle-per-buffer", "p1-need-sort", "p16-need-sort"],
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_alloc_free_lend_reclaim_keeps_ownership_and_kv_bytes(page_size, offset_mapping, need_sort, data):
    """Property: across any sequence of alloc / free / lend / reclaim (with
    migration into the base, or retraction when the base is full), no id is
    owned twice, owned and free ids partition the backed ids, the allocator's
    accounting matches, and every live token keeps its K/V bytes."""
    # need_sort: SGLang's PD-disaggregation mode, frees go to release_pages
    be, pool, alloc = make_pool(page_size, offset_mapping=offset_mapping, need_sort=need_sort)
    a = pool.arena
    owners = {}  # request id -> int64 token ids it owns
    kv = {}  # token id -> (k rows per layer, v rows per layer)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    next_req = 0
    try:
        for _ in range(data.draw(st.integers(1, 30))):
            op = data.draw(st.sampled_from(["alloc", "alloc", "free", "lend", "reclaim"]))
            if op == "alloc":
                n = data.draw(st.integers(1, 4)) * 16  # tokens, whole pages for both page sizes
                ids = alloc.alloc(n)
                if ids is None:
                    assert alloc.available_size() < n
                    continue
                for l in range(LAYERS):
                    k = torch.randn(n, HEADS, DIM, generator=gen).bfloat16()
                    v = torch.randn(n, HEADS, DIM, generator=gen).bfloat16()
                    pool.set_kv_buffer(layer(l), ids, k, v)
                    for j, t in enumerate(ids.tolist()):
                        kv.setdefault(t, ([None] * LAYERS, [None] * LAYERS))
                        kv[t][0][l], kv[t][1][l] = k[j].clone(), v[j].clone()
                owners[next_req] = ids
                next_req += 1
            elif op == "free" and owners:
                r = data.draw(st.sampled_from(sorted(owners)))
                ids = owners.pop(r)
                alloc.free(ids)
                for t in ids.tolist():
                    kv.pop(t)
            elif op == "lend":
                a.lend(data.draw(st.integers(1, 2)))
                alloc.lend(a.lent_tokens)
            elif op == "reclaim" and a.lent_steps:
                steps = data.draw(st.integers(1, a.lent_steps))
                new_lent = a.lent_tokens - steps * a.step_tokens
                in_use = alloc.withdraw(new_lent)
                top_tok = a.base_tokens + new_lent
                # Vacate: migrate each owner's ids above the top into the base,
                # or retract the owner (free everything it has below) if no room.
                for r in sorted(owners):
                    ids = owners[r]
                    hi = ids >= top_tok
                    if not bool(hi.any()):
                        continue
                    units = ids[hi] if page_size == 1 else torch.unique(ids[hi] // page_size)
                    assert set(units.tolist()) <= set(in_use.tolist())
                    dst = relocate_kv(pool, alloc, units)
                    if dst is None:
                        # Retract: SGLang frees the request's whole row, ids
                        # above the top included; those frees must be dropped.
                        alloc.free(ids)
                        for t in ids.tolist():
                            kv.pop(t)
                        del owners[r]
                        continue
                    if page_size == 1:
                        mapping = dict(zip(units.tolist(), dst.tolist()))
                        new_ids = torch.tensor([mapping.get(t, t) for t in ids.tolist()], dtype=torch.int64)
                    else:
                        mapping = dict(zip(units.tolist(), dst.tolist()))
                        new_ids = torch.tensor([mapping[t // page_size] * page_size + t % page_size if t >= top_tok else t for t in ids.tolist()], dtype=torch.int64)
                    for old, new in zip(ids.tolist(), new_ids.tolist()):
                        if old != new:
                            kv[new] = kv.pop(old)
                    owners[r] = new_ids
                a.reclaim(steps)
                alloc.end_vacate()

            # -- invariants ----------------------------------------------------
            top_tok = a.base_tokens + a.lent_tokens
            owned = torch.cat(list(owners.values())) if owners else torch.empty(0, dtype=torch.int64)
            assert owned.unique().numel() == owned.numel(), "a token is owned twice"
            assert owned.numel() == 0 or (int(owned.min()) >= page_size and int(owned.max()) < top_tok)
            free_units = torch.cat((alloc.free_pages, alloc.release_pages))
            assert free_units.unique().numel() == free_units.numel(), "a free id is listed twice"
            free_tok = unit_tokens(free_units, page_size)
            assert not (set(free_tok.tolist()) & set(owned.tolist())), "an owned token is on the free list"
            assert set(free_tok.tolist()) | set(owned.tolist()) == set(range(page_size, top_tok)), "ids leaked"
            assert alloc.available_size() + owned.numel() == alloc.size == top_tok - page_size
            per_step = 1 if offset_mapping else len(a.row_bytes)
            assert be.live_handles == per_step * (1 + a.lent_steps)  # the base and each lent step
            for t in owned.tolist():
                for l in range(LAYERS):
                    assert torch.equal(pool.get_key_buffer(l)[t], kv[t][0][l])
                    assert torch.equal(pool.get_value_buffer(l)[t], kv[t][1][l])
    finally:
        pool._clear_buffers()
    assert be.live_handles == 0



@pytest.mark.parametrize("page_size", [1, 16])
def test_reclaim_migrates_into_free_base_ids_and_says_when_there_are_none(page_size):
    be, pool, alloc = make_pool(page_size)
    a = pool.arena
    try:
        a.lend()
        alloc.lend(a.lent_tokens)
        base = alloc.alloc(a.base_tokens - page_size)  # the whole base
        lent = alloc.alloc(2 * page_size)  # two pages in the lent range
        assert int(lent.min()) >= a.base_tokens
        k = torch.randn(lent.numel(), HEADS, DIM).bfloat16()
        v = torch.randn(lent.numel(), HEADS, DIM).bfloat16()
        for l in range(LAYERS):
            pool.set_kv_buffer(layer(l), lent, k * (l + 1), v * (l + 1))
        alloc.free(base[: 2 * page_size])  # room for exactly the two pages
        units = alloc.withdraw(0)
        want_units = lent if page_size == 1 else torch.unique(lent // page_size)
        assert units.tolist() == want_units.tolist()
        dst = relocate_kv(pool, alloc, units)
        assert dst is not None and int(dst.max()) < a.base_tokens // page_size
        dst_tok = unit_tokens(dst, page_size)
        for l in range(LAYERS):
            assert torch.equal(pool.get_key_buffer(l)[dst_tok], k * (l + 1))
            assert torch.equal(pool.get_value_buffer(l)[dst_tok], v * (l + 1))
        a.reclaim()
        alloc.end_vacate()
        # With the base full, a second vacate has nowhere to go: None, nothing allocated.
        a.lend()
        alloc.lend(a.lent_tokens)
        assert alloc.alloc(page_size) is not None  # one lent page in use
        free_before = alloc.available_size()
        units = alloc.withdraw(0)
        assert relocate_kv(pool, alloc, units) is None
        assert alloc.available_size() == free_before - a.lent_tokens + page_size
    finally:
        pool._clear_buffers()


@pytest.mark.parametrize("page_size", [1, 16])
def test_frees_above_the_top_during_a_vacate_are_dropped(page_size):
    """A request that finishes (or is retracted) after withdraw and before
    the reclaim frees ids that are about to be unmapped: they must never come
    back as allocatable."""
    be, pool, alloc = make_pool(page_size)
    a = pool.arena
    try:
        a.lend()
        alloc.lend(a.lent_tokens)
        alloc.alloc(alloc.available_size() - a.lent_tokens)  # base busy
        lent = alloc.alloc(2 * 16)
        alloc.withdraw(0)
        alloc.free(lent)  # its owner finished meanwhile
        if page_size > 1:
            alloc.free_segment(lent[:16], start_pos=0)  # the fixed-shape path too
        a.reclaim()
        alloc.end_vacate()
        assert alloc.available_size() == 0
        assert alloc.alloc(page_size) is None
    finally:
        pool._clear_buffers()


def test_page_size_1_hands_out_freed_base_ids_before_lent_ids():
    be, pool, alloc = make_pool(1)
    a = pool.arena
    try:
        held = alloc.alloc(alloc.available_size())
        a.lend()
        alloc.lend(a.lent_tokens)
        alloc.free(held[:8])
        got = alloc.alloc(8)
        assert int(got.max()) < a.base_tokens
    finally:
        pool._clear_buffers()


def test_a_dropped_pool_gives_its_memory_back():
    import gc

    be, pool, alloc = make_pool(16)
    pool.arena.lend()
    del pool, alloc
    gc.collect()
    assert be.live_handles == 0 and not be._maps


def test_a_pool_dropped_on_another_thread_closes_its_arena_later_on_a_safe_one():
    """The CPU suite once hung: the collector dropped a pool inside a new
    thread's start (holding Python's shutdown-locks lock), and the arena's
    close joined its helper thread there. A pool dropped on a thread other
    than its builder's defers the close; the next pool built closes it."""
    import gc
    import threading

    from sglang_elastic.pool import kv_pool

    be, pool, alloc = make_pool(16)
    pool.arena.lend()
    box = [pool]
    del pool, alloc
    t = threading.Thread(target=lambda: (box.clear(), gc.collect()))
    t.start()
    t.join()
    assert len(kv_pool._DEFERRED) == 1 and be.live_handles > 0  # not closed on the foreign thread
    be2, pool2, alloc2 = make_pool(16)  # a new pool closes it, on this thread
    assert not kv_pool._DEFERRED and be.live_handles == 0 and not be._maps
    pool2._clear_buffers()
