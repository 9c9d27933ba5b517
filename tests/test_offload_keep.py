"""``--kv-offload-keep-v`` on SGLang's own allocator (CPU): lending idle pool slots to
requests that keep their V, and demoting them when SGLang's allocator would run short.

The allocator is SGLang 0.5.17's ``TokenToKVPoolAllocator`` with the plugin's hooks
applied by SGLang's own ``HookRegistry`` wrapper; the scheduler's batch calls are
driven as ``prepare_for_extend`` / ``prepare_for_decode`` and ``ReqToTokenPool.free``
make them. Decode outputs of kept and demoted requests: ``test_offload_pool.py``.
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_elastic.offload import keep
from sglang_elastic.offload.policy import OffloadPolicy
from test_controller import sglang_runtime_context  # noqa: F401 (the autouse fixture: SGLang's runtime config, which PrefillAdder reads)
from test_offload_pool import make_pool, recorded_hooks

SIZE, ROWS, CTX = 600, 5, 200


def hooked_allocator_class():
    """SGLang's allocator with the hooks ``keep.register`` gives, wrapped by SGLang's ``_wrap_fn``."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.plugins.hook_registry import _wrap_fn

    seen = recorded_hooks(keep.register)
    # every target names a real SGLang 0.5.17 attribute
    for target in seen:
        mod, cls, attr = target.rsplit(".", 2)
        assert callable(getattr(getattr(importlib.import_module(mod), cls), attr)), target
    name = "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator"
    ns = {a: _wrap_fn(getattr(TokenToKVPoolAllocator, a), *seen[f"{name}.{a}"][0]) for a in ("alloc", "available_size")}
    cls = type("HookedAllocator", (TokenToKVPoolAllocator,), ns)
    batch_hooks = {a: seen[f"sglang.srt.managers.schedule_batch.ScheduleBatch.{a}"][0][0] for a in ("prepare_for_extend", "prepare_for_decode")}
    return cls, batch_hooks


class Server:
    """A scheduler's use of the allocator: admit (a prompt's slots, then ``prepare_for_extend``'s hook),
    decode (one slot per running request, then ``prepare_for_decode``'s), finish / retract (the
    request's slots freed, then ``ReqToTokenPool.free``'s hook), admission by ``available_size``."""

    def __init__(self, reserve_frac=keep.RESERVE_FRAC, need_sort=False):
        pol = OffloadPolicy(sink=2, window=8, budget_frac=0.05, max_topk=24, dense_layers=1, denominator="selected", chunk=8)
        self.pool = make_pool(pol, size=SIZE, rows=ROWS, ctx=CTX, keep_v=True)
        cls, self.hooks = hooked_allocator_class()
        self.alloc = cls(SIZE, torch.bfloat16, "cpu", self.pool, need_sort=need_sort)  # need_sort: PD's sorted free lists
        keep._STATE.clear()
        self.m = keep.manager_for(self.alloc)
        self.m.reserve = int(SIZE * reserve_frac)
        self.reqs = {}  # row -> its token ids (the req_to_token row SGLang keeps), in position order

    def batch(self, rows, **kw):
        reqs = [types.SimpleNamespace(req_pool_idx=r) for r in rows]
        return types.SimpleNamespace(reqs=reqs, token_to_kv_pool_allocator=self.alloc, **kw)

    def admit(self, row, n):
        """A new request of ``n`` tokens in ``row`` if SGLang's admission (available_size) lets it in."""
        if row in self.reqs or self.alloc.available_size() < n:
            return False
        ids = self.alloc.alloc(n)
        assert ids is not None, "SGLang admitted by available_size, and alloc failed"
        self.reqs[row] = ids.clone()
        self.hooks["prepare_for_extend"](None, self.batch([row], prefix_lens=[0], extend_lens=[n]))
        return True

    def chunk(self, row, n):
        """A later prefill chunk of ``n`` tokens of the request in ``row``."""
        if row not in self.reqs or self.alloc.available_size() < n or len(self.reqs[row]) + n > CTX:
            return False
        ids = self.alloc.alloc(n)
        assert ids is not None
        pre = len(self.reqs[row])
        self.reqs[row] = torch.cat([self.reqs[row], ids])
        self.hooks["prepare_for_extend"](None, self.batch([row], prefix_lens=[pre], extend_lens=[n]))
        return True

    def decode(self):
        for r in [r for r, ids in self.reqs.items() if len(ids) >= CTX]:  # at the context length: finished
            self.finish(r)
        rows = sorted(self.reqs)
        if not rows or self.alloc.available_size() < len(rows):
            return False
        ids = self.alloc.alloc(len(rows))
        assert ids is not None
        for r, i in zip(rows, ids):
            self.reqs[r] = torch.cat([self.reqs[r], i.view(1)])
        lens = torch.tensor([len(self.reqs[r]) for r in rows], dtype=torch.int64)
        self.hooks["prepare_for_decode"](None, self.batch(rows, seq_lens_cpu=lens))
        return True

    def finish(self, row):
        if row not in self.reqs:
            return False
        self.alloc.free(self.reqs.pop(row))
        keep.release_row(row)  # ReqToTokenPool.free's hook
        return True

    def check(self):
        """Every slot has one owner (a request's token, a kept V row, or the free list); the
        accounting SGLang reads adds the kept slots to what is free; tables agree with the mirror."""
        pool, m = self.pool, self.m
        owned = [ids for ids in self.reqs.values()]
        kept = [pool.req_to_vrow[r, :n].long() - pool.keep_base for r, n in enumerate(pool.keep_len_cpu) if n]
        free = [self.alloc.free_pages, self.alloc.release_pages]
        allids = torch.cat(owned + kept + free).tolist()
        assert sorted(allids) == list(range(1, SIZE + 1)), "a slot owned twice or lost"
        assert m.held == sum(pool.keep_len_cpu) == sum(len(k) for k in kept)
        assert self.alloc.available_size() == m.real_free() + m.held
        assert pool.keep_len.tolist() == pool.keep_len_cpu
        for r, n in enumerate(pool.keep_len_cpu):
            assert n == 0 or (r in self.reqs and n == len(self.reqs[r])), (r, n)  # kept: every position, or none


def test_new_requests_keep_v_while_slots_are_spare_and_the_largest_is_demoted_when_the_allocator_runs_short():
    s = Server(reserve_frac=0.1)
    assert s.admit(1, 150) and s.admit(2, 100)
    assert s.pool.keep_len_cpu[1] == 150 and s.pool.keep_len_cpu[2] == 100
    s.check()
    assert s.decode() and s.pool.keep_len_cpu[1] == 151 and s.pool.keep_len_cpu[2] == 101
    s.check()
    # 600 slots: 252 tokens + 252 kept; a 150-token request is admitted on SGLang's count (kept slots count as free),
    # and its allocation demotes the largest kept request (row 1), not the smaller one
    free_before = s.m.real_free()
    assert free_before < 150 <= s.alloc.available_size()
    assert s.admit(3, 150)
    assert s.pool.keep_len_cpu[1] == 0 and s.pool.keep_len_cpu[2] == 101 and s.m.demoted == 1
    assert s.pool.keep_len_cpu[3] == 0  # no spare slots for its V after the demotion: it runs sparse
    s.check()
    # finishing a kept request returns its kept slots with its tokens
    held = s.m.held
    assert s.finish(2) and s.m.held == held - 101 and s.m.real_free() == s.alloc.available_size()
    s.check()


def test_a_kept_request_is_demoted_when_its_next_slot_would_cut_into_the_reserve():
    s = Server(reserve_frac=0.5)
    assert s.admit(1, 100)  # 600 - 100 - 100 kept = 400 >= 300 reserve
    assert s.pool.keep_len_cpu[1] == 100
    assert s.admit(2, 120)  # 380 free - 120 < 300: row 2 sparse, row 1 stays kept
    assert s.pool.keep_len_cpu[2] == 0 and s.pool.keep_len_cpu[1] == 100
    for _ in range(30):
        s.decode()
        s.check()
    # each step takes 2 slots and row 1's kept one more, until a kept slot would leave < 300 free
    assert s.pool.keep_len_cpu[1] == 0 and s.m.demoted == 1
    assert s.m.real_free() == s.alloc.available_size()


def test_the_reserve_is_the_share_of_the_pool_that_keep_reserve_names(monkeypatch):
    """``--kv-offload-keep-reserve`` reaches the scheduler's manager through the published config
    (SGLANG_ELASTIC_CONFIG); unset, the manager keeps the documented default, 0.02 of the pool (a literal: the constant could drift from the help text)."""
    from sglang_elastic import config

    for share, want in ((0.03, int(SIZE * 0.03)), (None, int(SIZE * 0.02))):
        if share is None:
            monkeypatch.delenv(config.ENV, raising=False)
        else:
            cfg = config.ElasticKVConfig(offload=config.OffloadConfig(enabled=True, keep_reserve=share))
            monkeypatch.setenv(config.ENV, cfg.to_env())
        s = Server.__new__(Server)
        pol = OffloadPolicy(sink=2, window=8, budget_frac=0.05, max_topk=24, dense_layers=1, denominator="selected", chunk=8)
        s.pool = make_pool(pol, size=SIZE, rows=ROWS, ctx=CTX, keep_v=True)
        cls, _ = hooked_allocator_class()
        keep._STATE.clear()
        m = keep.manager_for(cls(SIZE, torch.bfloat16, "cpu", s.pool, need_sort=False))
        assert m.reserve == want and want > 0
    keep._STATE.clear()


def test_a_later_chunk_extends_a_kept_request_and_a_stale_grant_is_returned():
    s = Server(reserve_frac=0.0)
    assert s.admit(1, 60) and s.chunk(1, 40)
    assert s.pool.keep_len_cpu[1] == 100
    s.check()
    # a row freed without the hook (never in SGLang, but the manager must not leak): a new request returns it
    s.alloc.free(s.reqs.pop(1))
    assert s.admit(1, 30) and s.pool.keep_len_cpu[1] == 30
    s.check()


def test_demotion_inside_a_free_group_makes_room_at_once():
    """SGLang batches frees between ``free_group_begin`` and ``free_group_end``; a demotion there
    must still free its slots for the allocation that asked for them."""
    s = Server(reserve_frac=0.0)
    assert s.admit(1, 180) and s.pool.keep_len_cpu[1] == 180
    s.alloc.free_group_begin()
    try:
        ids = s.alloc.alloc(300)  # 240 free + 180 kept: only with row 1's kept slots back
        assert ids is not None and s.pool.keep_len_cpu[1] == 0
    finally:
        s.alloc.free_group_end()
    s.reqs[2] = ids
    s.check()


def test_keep_v_is_refused_without_shared_buffers_and_with_resident_v():
    from sglang_elastic.config import ConfigError, OffloadConfig

    pol = OffloadPolicy(sink=2, window=8, budget_frac=0.05, max_topk=24, dense_layers=1)
    with pytest.raises(ValueError, match="keep_v"):
        keep.KeepV(make_pool(pol, size=SIZE, rows=ROWS, ctx=CTX), object())
    with pytest.raises(ConfigError, match="--kv-offload-keep-v has nothing to keep with --kv-offload-resident-v"):
        OffloadConfig(enabled=True, resident_v=True, keep_v=True)
    with pytest.raises(ConfigError, match="needs --enable-kv-offload"):
        OffloadConfig(keep_v=True)


OPS = st.lists(st.tuples(st.sampled_from(["admit", "chunk", "decode", "decode", "finish"]), st.integers(1, ROWS - 1),
                         st.integers(1, 90)), min_size=5, max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, reserve=st.sampled_from([0.0, 0.1, 0.3]), need_sort=st.booleans())
def test_random_admit_chunk_decode_finish_never_owns_a_slot_twice_and_admission_never_fails(ops, reserve, need_sort):
    s = Server(reserve_frac=reserve, need_sort=need_sort)
    for op, row, n in ops:
        if op == "admit":
            s.admit(row, n)
        elif op == "chunk":
            s.chunk(row, n)
        elif op == "decode":
            s.decode()
        else:
            s.finish(row)
        s.check()
    for row in list(s.reqs):
        s.finish(row)
    s.check()
    assert s.m.held == 0 and s.alloc.available_size() == SIZE  # SGLang's idle check: every slot free again


def test_the_all_dense_graph_variant_is_replayed_only_when_every_request_of_the_prepared_batch_keeps_v():
    """SGLang's decode graph runner captures two variants per batch size when ``record_nolora_graph``
    is set; ``keep.register``'s hooks set it for the offload backend (not under LoRA) and pick the
    all-dense variant for a batch whose every request the scheduler just granted a kept slot."""
    from sglang.srt.model_executor.runner_utils.capture_mode import _set_capture_lora_variant

    from sglang_elastic.offload.backend import OffloadAttnBackend

    s = Server(reserve_frac=0.0)
    assert s.admit(1, 50) and s.admit(2, 40) and s.decode()
    assert s.m.all_kept and s.m.all_kept_bs == 2
    runner = types.SimpleNamespace(_sglang_elastic_keep=True)
    pick = lambda fb, r=runner: keep.around_resolve_variant(lambda *a: "orig", r, fb)  # noqa: E731
    assert pick(types.SimpleNamespace(batch_size=2)) == keep.DENSE_VARIANT
    assert pick(types.SimpleNamespace(batch_size=3)) == keep.GENERAL_VARIANT  # not the batch that was prepared
    assert pick(types.SimpleNamespace(batch_size=2), types.SimpleNamespace()) == "orig"  # a runner the hook did not set up
    s.m.reserve = SIZE  # no spare slot any more: the next step's grants fail, both go sparse
    assert s.decode() and not s.m.all_kept and s.m.held == 0
    assert pick(types.SimpleNamespace(batch_size=2)) == keep.GENERAL_VARIANT
    # the capture hook: our backend with kept V gets both variants; a LoRA runner (both labels taken) does not
    be = object.__new__(OffloadAttnBackend)
    be.pool, be.graph_variants = s.pool, False
    r = types.SimpleNamespace(model_runner=types.SimpleNamespace(attn_backend=be))
    keep.before_capture(r)
    assert r.record_nolora_graph and r._sglang_elastic_keep and be.graph_variants
    be2 = object.__new__(OffloadAttnBackend)
    be2.pool, be2.graph_variants = s.pool, False
    lora = types.SimpleNamespace(model_runner=types.SimpleNamespace(attn_backend=be2), record_nolora_graph=True)
    keep.before_capture(lora)
    assert not getattr(lora, "_sglang_elastic_keep", False) and not be2.graph_variants
    try:
        _set_capture_lora_variant(keep.DENSE_VARIANT)
        assert keep.capturing_dense_variant()
        _set_capture_lora_variant(keep.GENERAL_VARIANT)
        assert not keep.capturing_dense_variant()
    finally:
        _set_capture_lora_variant(None)


def test_a_short_decode_step_demotes_the_largest_kept_requests_first_and_finishing_is_no_demotion():
    """(Found by review.) With slots for only some of the step's kept requests, the largest go sparse
    until the rest fit, never a smaller one while a larger stays kept; a request that finishes
    returns its kept slots without counting as a demotion."""
    s = Server(reserve_frac=0.0)
    assert s.admit(1, 10) and s.admit(2, 20) and s.admit(3, 150)
    assert [s.pool.keep_len_cpu[r] for r in (1, 2, 3)] == [10, 20, 150]
    s.m.reserve = s.m.real_free() - 3 - 1  # after the step's own 3 token slots, room for 1 kept slot less than needed
    assert s.decode()
    kl = {r: s.pool.keep_len_cpu[r] for r in (1, 2, 3)}
    assert kl == {1: 11, 2: 21, 3: 0} and s.m.demoted == 1, kl
    s.check()
    assert s.finish(1) and s.finish(2) and s.m.demoted == 1 and s.m.held == 0
    assert s.m.stats() == {"kept_tokens": 0, "kept_requests": 0, "keep_granted_tokens": 10 + 20 + 150 + 2, "keep_demotions": 1}


def test_the_capture_hooks_leave_lora_alone_and_clear_the_variant_label():
    from sglang.srt.model_executor.runner_utils.capture_mode import _set_capture_lora_variant, get_capture_lora_variant

    from sglang_elastic.offload.backend import OffloadAttnBackend

    s = Server()
    be = object.__new__(OffloadAttnBackend)
    be.pool, be.graph_variants = s.pool, False
    r = types.SimpleNamespace(model_runner=types.SimpleNamespace(attn_backend=be, server_args=types.SimpleNamespace(enable_lora=True)))
    keep.before_capture(r)
    assert not getattr(r, "_sglang_elastic_keep", False) and not be.graph_variants  # --enable-lora: SGLang's variants stay LoRA's
    r.model_runner.server_args.enable_lora = False
    keep.before_capture(r)
    assert r._sglang_elastic_keep and be.graph_variants
    _set_capture_lora_variant(keep.DENSE_VARIANT)  # what SGLang's capture loop leaves after its last variant
    assert keep.after_capture("done", r) == "done" and get_capture_lora_variant() is None


def tree_beside(s, named=True):
    """SGLang's own ``RadixCache`` over a :class:`Server`'s hooked allocator; the server's batches name it as
    SGLang's scheduler batches do (``tree_cache``), or (``named=False``) name none."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache

    tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=ReqToTokenPool(ROWS, CTX, "cpu", False),
                                      token_to_kv_pool_allocator=s.alloc, page_size=1))
    base = s.batch
    s.batch = lambda rows, **kw: (lambda b: (setattr(b, "tree_cache", tree if named else None), b)[1])(base(rows, **kw))
    return tree


def radix_server(with_tree=True):
    """A :class:`Server` beside SGLang's own ``RadixCache`` over the same hooked allocator: three finished
    requests of 150 tokens cached in the tree (the ids SGLang's ``insert`` keeps), then a request whose first 100 tokens the tree matches (``match_prefix``, locked as SGLang
    locks a running request's prefix) and 40 new ones, prepared as SGLang prepares it (prefix 100,
    extend 40). ``with_tree=False``: the same, the batch naming no tree (what KeepV saw before)."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    s = Server()
    tree = tree_beside(s, named=with_tree)
    for first in (1000, 2000, 3000):  # finished requests' tokens, as cache_finished_req inserts them (their kept V gone back)
        tree.insert(InsertParams(key=RadixKey(array("l", range(first, first + 150))), value=s.alloc.alloc(150)))
    assert tree.evictable_size() == 450 and s.m.real_free() == SIZE - 450
    match = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("l", list(range(1000, 1100)) + [7] * 40))))
    assert len(match.device_indices) == 100
    tree.inc_lock_ref(match.last_device_node)
    new = s.alloc.alloc(40)
    s.reqs[4] = torch.cat([match.device_indices.to(torch.int64), new])
    s.hooks["prepare_for_extend"](None, s.batch([4], prefix_lens=[100], extend_lens=[40]))
    return s, tree


def tree_ids(tree):
    out, todo = [], [tree.root_node]
    while todo:
        node = todo.pop()
        todo += list(node.children.values())
        if node is not tree.root_node and node.value is not None:
            out.append(node.value.to(torch.int64))
    return out


def test_a_grant_evicts_the_radix_caches_least_recently_used_prefixes_to_keep_a_matched_request_dense():
    """With SGLang's radix cache holding most of the pool, a request whose prefix the cache matched takes
    kept slots for its whole length (prefix included): the grant evicts the cache's least recently used
    unlocked prefixes (SGLang's ``evict``) for the slots and a reserve more, never the locked prefix, and
    every slot keeps one owner. Without the tree named, the same grant finds too few free slots."""
    s, tree = radix_server()
    m, pool = s.m, s.pool
    assert m.kept(4) == 140 and pool.keep_len_cpu[4] == 140
    evicted = 450 - tree.evictable_size() - tree.protected_size()
    assert evicted >= 140 + 2 * m.reserve - (SIZE - 450 - 40)  # the grant, a reserve more, less what was free: whole leaves
    assert tree.protected_size() == 100 and m.real_free() >= m.reserve  # the matched prefix stayed (locked)
    held = torch.cat(tree_ids(tree) + [s.reqs[4], pool.req_to_vrow[4, :140].long() - pool.keep_base, s.alloc.free_pages,
                                       s.alloc.release_pages]).tolist()
    assert sorted(set(held)) == list(range(1, SIZE + 1))
    assert len(held) == SIZE + 100  # the prefix's 100 ids are the tree's and the request's; no other slot has two owners
    bare, _ = radix_server(with_tree=False)
    assert bare.m.kept(4) == 0


def test_a_prefill_batch_takes_requests_while_their_cached_prefixes_fit_the_staging_buffers():
    """SGLang's own ``PrefillAdder`` and ``RadixCache`` over an offload pool whose staging holds 200 tokens (one
    layer's prefixes of a prefill batch): a request whose cached prefix of 150 tokens would take the batch to 300
    stops the batch (``OTHER``: it waits for the next one, as for SGLang's own limits); one whose prefix of 40
    fits joins. A batch's first request always joins. Without the hook (SGLang alone) all three join, and the
    staging would refuse the forward."""
    from array import array

    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    bed = _radix_bed(size=2000, ctx=200)
    doc = list(range(1000, 1150))
    bed.tree.insert(InsertParams(key=RadixKey(array("q", doc)), value=bed.alloc.alloc(150)))

    def batch(add):
        adder = PrefillAdder(1, bed.tree, bed.alloc, None, 0.7, rem_input_tokens=10_000, rem_chunk_tokens=None)
        got = []
        for i, prompt in enumerate((doc + [7] * 20, doc + [8] * 20, doc[:40] + [9] * 20)):
            req = _sched_req(f"r{i}", prompt, max_new=16)
            req.init_next_round_input(bed.tree)  # SGLang's match: prefix_indices
            got.append((len(req.prefix_indices), add(adder, req, has_chunked_req=False, truncation_align_size=None)))
        return got, sum(len(r.prefix_indices) for r in adder.can_run_list)

    got, staged = batch(bed.add)
    assert got == [(150, AddReqResult.CONTINUE), (150, AddReqResult.OTHER), (40, AddReqResult.CONTINUE)] and staged == 190
    got, staged = batch(PrefillAdder.add_one_req)
    assert [r for _, r in got] == [AddReqResult.CONTINUE] * 3 and staged == 340 > bed.pool.k_stage.shape[0]


def test_with_the_radix_cache_the_running_requests_lengths_stay_within_the_pools_token_count():
    """Requests that share a cached prefix hold more positions than token ids; the decode step's lists, the hot pages
    and the V-summary slots are sized for the pool's token count of positions (a review of 6261cd9 overflowed all
    three with 4 requests of 600 positions over 630 ids of an 800-token pool). With SGLang's radix cache,
    ``ScheduleBatch.check_decode_mem`` (SGLang's own, hooked) then says the step does not fit, so SGLang's
    ``retract_decode`` takes requests back until the rest do, and ``PrefillAdder.add_one_req`` admits no request
    that would pass it. With ``ChunkCache`` (``--disable-radix-cache``) both are SGLang's alone."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    def req(i):
        return _sched_req(f"r{i}", list(range(1000, 1290)) + [i] * 10, max_new=16)

    for caps in (True, False):
        bed = _radix_bed(chunk_cache=not caps)
        tree, check, add = bed.tree, bed.check, bed.add
        batch = _sched_batch(bed, [req(i) for i in range(3)])
        assert ScheduleBatch.check_decode_mem(batch)  # SGLang alone: 3 new tokens, 800 ids free
        assert check(batch) == (not caps)  # 3 x 301 positions > 800: the step does not fit
        assert check(batch, selected_indices=[0, 1]) and check(batch, selected_indices=[2])  # one retracted: 602 fit
        adder = PrefillAdder(1, tree, bed.alloc, _sched_batch(bed, [req(i) for i in range(2)]), 0.7, rem_input_tokens=10_000,
                             rem_chunk_tokens=None)
        new = req(9)
        new.init_next_round_input(tree)
        assert (add(adder, new, has_chunked_req=False, truncation_align_size=None) == AddReqResult.OTHER) == caps
        alone = req(8)
        alone.init_next_round_input(tree)
        assert add(PrefillAdder(1, tree, bed.alloc, None, 0.7, rem_input_tokens=10_000, rem_chunk_tokens=None), alone,
                   has_chunked_req=False, truncation_align_size=None) == AddReqResult.CONTINUE  # nothing running: it joins


def test_a_keep_grant_that_cannot_be_made_does_not_evict_the_radix_cache():
    """(A review of 6261cd9.) A grant the cache's evictable prefixes could not make anyway (60 evictable, 190 asked,
    50 free) is refused without evicting them: a later request that would have hit them does not prefill them again."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    s = Server()
    tree = tree_beside(s)
    tree.insert(InsertParams(key=RadixKey(array("l", range(1000, 1150))), value=s.alloc.alloc(150)))  # the document
    tree.insert(InsertParams(key=RadixKey(array("l", range(5000, 5060))), value=s.alloc.alloc(60)))  # another prefix
    s.reqs[1] = s.alloc.alloc(300)  # a running request's tokens (sparse)
    match = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("l", list(range(1000, 1150)) + [7] * 40))))
    tree.inc_lock_ref(match.last_device_node)  # as PrefillAdder locks it
    s.reqs[4] = torch.cat([match.device_indices.to(torch.int64), s.alloc.alloc(40)])
    assert tree.evictable_size() == 60 and s.m.real_free() == 50
    s.hooks["prepare_for_extend"](None, s.batch([4], prefix_lens=[150], extend_lens=[40]))
    assert s.m.kept(4) == 0 and tree.evictable_size() == 60  # sparse, and the cache as it was


def test_a_chunked_prompt_demoted_at_an_earlier_chunk_is_not_promoted_back():
    """(A review of 6261cd9.) Only a request's first prefill takes kept slots for a prefix (one the radix cache
    matched): a chunked prompt that SGLang's allocation demoted stays sparse at its next chunk."""
    s = Server(reserve_frac=0.0)
    assert s.admit(1, 60) and s.m.kept(1) == 60  # a chunked prompt's first chunk, kept
    assert s.admit(2, 500) and s.m.kept(1) == 0 and s.m.demoted == 1  # SGLang's allocation demotes it
    assert s.finish(2)
    assert s.chunk(1, 20)
    s.check()
    assert s.m.kept(1) == 0
    assert s.admit(3, 50) and s.m.kept(3) == 50  # a new request in a row freed through the hook: kept again


def _radix_bed(size=800, ctx=700, chunk_cache=False):
    """An offload pool of ``size`` tokens and a ``ctx``-token context (estimate: V summaries), SGLang's allocator
    and ``RadixCache`` (``chunk_cache``: its ``ChunkCache``, ``--disable-radix-cache``) over it, and SGLang's
    ``ScheduleBatch.check_decode_mem`` / ``PrefillAdder.add_one_req`` with the plugin's hooks applied."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.chunk_cache import ChunkCache
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    from sglang_elastic.offload import hooks

    pol = OffloadPolicy(sink=2, window=8, budget_frac=0.05, max_topk=24, dense_layers=1, denominator="estimate", chunk=8)
    pool = make_pool(pol, size=size, rows=5, ctx=ctx)
    alloc = TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", pool, need_sort=False)
    r2t = ReqToTokenPool(5, ctx, "cpu", False)
    params = CacheInitParams(disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, page_size=1)
    tree = ChunkCache(params) if chunk_cache else RadixCache(params)
    seen = recorded_hooks(hooks.register)
    assert {seen[f"sglang.srt.managers.{t}"][0][1] for t in ("schedule_batch.ScheduleBatch.check_decode_mem",
                                                               "schedule_policy.PrefillAdder.add_one_req")} == {HookType.AROUND}
    check = _wrap_fn(ScheduleBatch.check_decode_mem, *seen["sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem"][0])
    add = _wrap_fn(PrefillAdder.add_one_req, *seen["sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"][0])
    return types.SimpleNamespace(pool=pool, alloc=alloc, r2t=r2t, tree=tree, check=check, add=add)


def _sched_req(rid, prompt, outputs=0, max_new=64):
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    r = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=max_new))
    r.output_ids = array("q", [5] * outputs)
    r.kv_committed_len = len(prompt) + outputs
    return r


def _sched_batch(bed, reqs):
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return ScheduleBatch(reqs=reqs, req_to_token_pool=bed.r2t, token_to_kv_pool_allocator=bed.alloc, tree_cache=bed.tree,
                         spec_algorithm=SpeculativeAlgorithm.NONE)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
def test_a_request_admitted_at_the_bound_is_not_retracted_by_the_next_decode_check(overlap):
    """(A second review of the radix mends.) Two running requests over a cached 290-token document (305 positions, 5
    outputs, 64 new tokens each): the admission counts each request two tokens on plus the growth SGLang reserves
    (59 left x 0.7: 41), so it takes a new request of 58 tokens (696 + 58 + 46 = 800) and not one of 59. Then, with
    no decode step between, the steps in flight add a token (overlap: each running request's last decode; without
    it: the new request's prefill token): SGLang's next ``check_decode_mem`` still fits, where counting the lengths
    as they stood (``seqlen + 1``) retracted the new request at once, before its first token."""
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    bed = _radix_bed()
    doc = list(range(1000, 1290))
    running = [_sched_req(f"r{i}", doc + [i] * 10, outputs=5) for i in range(2)]
    got = {}
    for n in (58, 59):
        w = _sched_req(f"w{n}", list(range(5000, 5000 + n)))
        w.init_next_round_input(bed.tree)
        adder = PrefillAdder(1, bed.tree, bed.alloc, _sched_batch(bed, running), 0.7, rem_input_tokens=10_000, rem_chunk_tokens=None)
        got[n] = (w, bed.add(adder, w, has_chunked_req=False, truncation_align_size=None))
    assert got[58][1] == AddReqResult.CONTINUE and got[59][1] == AddReqResult.OTHER
    w = got[58][0]
    w.kv_committed_len = 58
    if overlap:
        for r in running:
            r.output_ids.append(7)
            r.kv_committed_len += 1
    else:
        w.output_ids.append(9)
    assert bed.check(_sched_batch(bed, running + [w]))


def test_the_decode_check_bounds_the_positions_exactly_and_an_empty_batch_is_bounded_too():
    """(A second review.) ``check_decode_mem`` with the hook: two requests of 399 positions plus their next token fit
    an 800-token pool exactly, one token more does not; with nothing running, a prefill batch of requests over one
    cached document stops at the request that would pass the bound (the prefill's summary slots are sized by it)."""
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    bed = _radix_bed()
    doc = list(range(1000, 1290))
    two = [_sched_req(f"r{i}", doc + [i] * 10, outputs=99) for i in range(2)]
    assert bed.check(_sched_batch(bed, two))
    two[0].output_ids.append(1)
    two[0].kv_committed_len += 1
    assert not bed.check(_sched_batch(bed, two)) and bed.check(_sched_batch(bed, two[1:]))
    adder = PrefillAdder(1, bed.tree, bed.alloc, _sched_batch(bed, []), 0.7, rem_input_tokens=10_000, rem_chunk_tokens=None)
    got = []
    for i in range(3):  # 346 counted each: 692 fit, 1038 do not
        r = _sched_req(f"n{i}", doc + [i] * 10)
        r.init_next_round_input(bed.tree)
        got.append(bed.add(adder, r, has_chunked_req=False, truncation_align_size=None))
    assert got == [AddReqResult.CONTINUE, AddReqResult.CONTINUE, AddReqResult.OTHER]


def test_a_row_freed_through_the_hook_starts_afresh_for_a_radix_hit():
    """(A second review.) A request whose prefix the cache matched, in a row a finished request used, takes kept slots
    for its whole length: SGLang's free hook ends the row's last request."""
    s = Server()
    assert s.admit(4, 50) and s.m.kept(4) == 50
    assert s.finish(4)
    pre = s.alloc.alloc(100)  # a cached prefix's ids (the tree's), then the new request's own 40
    s.reqs[4] = torch.cat([pre, s.alloc.alloc(40)])
    s.hooks["prepare_for_extend"](None, s.batch([4], prefix_lens=[100], extend_lens=[40]))
    assert s.m.kept(4) == 140


def test_a_grant_that_evicts_small_prefixes_leaves_two_reserves_free_for_the_decode_steps_after_it():
    """The grant asks the radix cache for its slots and a reserve more than the reserve it must keep, so the decode
    steps after it find spare slots without walking the tree each step. With 40 cached prefixes of 10 tokens
    (eviction in small steps) a 100-token request's kept grant leaves at least two reserves free; asking for one
    reserve more would leave 12-21 of the 24."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    s = Server()
    tree = tree_beside(s)
    for i in range(40):
        tree.insert(InsertParams(key=RadixKey(array("l", range(10_000 + 100 * i, 10_000 + 100 * i + 10))), value=s.alloc.alloc(10)))
    assert tree.evictable_size() == 400 and s.m.real_free() == SIZE - 400 and s.m.reserve == 12
    assert s.admit(1, 100)  # 100 free after its tokens: the kept grant of 100 needs the cache's slots
    assert s.m.kept(1) == 100 and tree.evictable_size() < 400
    assert s.m.real_free() >= 2 * s.m.reserve
    pool = s.pool
    held = torch.cat(tree_ids(tree) + [s.reqs[1], pool.req_to_vrow[1, :100].long() - pool.keep_base, s.alloc.free_pages,
                                       s.alloc.release_pages]).tolist()
    assert sorted(held) == list(range(1, SIZE + 1))  # every slot one owner: the cache, the request, its kept V, the free list


def test_inside_sglangs_free_group_a_grant_keeps_the_radix_cache_and_runs_sparse():
    """Inside a free group SGLang's frees only queue until the group ends, so evicting the cache could not make the
    grant: the grant leaves the cache as it was and the request runs sparse (it keeps V once the group has ended and
    the next grant finds the slots)."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    s = Server()
    tree = tree_beside(s)
    for i in range(3):
        tree.insert(InsertParams(key=RadixKey(array("l", range(1000 * (i + 1), 1000 * (i + 1) + 150))), value=s.alloc.alloc(150)))
    s.alloc.free_group_begin()
    try:
        assert s.admit(1, 100)  # 50 free after its tokens: the kept grant would need the cache
        assert tree.evictable_size() == 450 and s.m.kept(1) == 0
    finally:
        s.alloc.free_group_end()
    assert s.admit(2, 40) and s.m.kept(2) == 40 and tree.evictable_size() < 450  # outside the group the cache gives way
