"""SGLang 0.5.17's own decode retraction over the offload pool (CPU).

The plugin's hooks (``hooks.register``, keep-v on as by default) are applied to SGLang's classes by SGLang's own
``HookRegistry.apply_hooks``, as in a scheduler process, and taken off again after the test. The scheduler's steps
then run SGLang's real code: ``ScheduleBatch.init_new`` / ``prepare_for_extend`` / ``merge_batch`` /
``prepare_for_decode``, ``RadixCache``, ``ScheduleBatch.check_decode_mem`` and ``retract_decode`` -> ``release_req``
-> ``release_kv_cache`` -> ``ReqToTokenPool.free``. Only the forward is the tests' own: the offload backend's pool
calls (``Sim.extend`` / ``Sim.decode`` of ``test_offload_pool.py``, K/V random) over the ``req_to_token`` rows and
token ids SGLang allocated.
"""

from __future__ import annotations

import pkgutil
import types
from array import array
from collections import defaultdict

import pytest
import torch

from sglang_elastic import config
from sglang_elastic.offload import hooks, keep
from sglang_elastic.offload.policy import OffloadPolicy
from test_controller import sglang_runtime_context  # noqa: F401 (the autouse fixture: SGLang's runtime config)
from test_offload_keep import tree_ids
from test_offload_pool import D, HKV, HQ, L, SPLIT, Sim, bf16_close, make_pool

SIZE, CTX, ROWS = 600, 300, 4  # pool tokens, context, SGLang's request rows (plus its padding row 0)
MAX_NEW = 16  # each request's max_new_tokens


@pytest.fixture
def sglang_hooked(monkeypatch):
    """Every hook ``hooks.register`` registers (with ``--kv-offload-keep-v``'s, as the flag is on by default) applied
    to SGLang's classes by SGLang's ``HookRegistry.apply_hooks`` (a registry of their own for the test), then undone."""
    from sglang.srt.plugins import hook_registry as hr

    monkeypatch.setenv(config.ENV, config.ElasticKVConfig(offload=config.OffloadConfig(enabled=True)).to_env())
    assert config.current().offload.keep_v_wanted
    monkeypatch.setattr(hr.HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(hr.HookRegistry, "_patched", set())
    hooks.register()
    saved = []
    for target in hr.HookRegistry._hooks:
        owner, attr = target.rsplit(".", 1)
        obj = pkgutil.resolve_name(owner)
        saved.append((obj, attr, obj.__dict__.get(attr), attr in obj.__dict__))
    spread = []
    propagate = hr._propagate_patch
    monkeypatch.setattr(hr, "_propagate_patch", lambda *a: spread.append(propagate(*a)) or spread[-1])
    keep._STATE.clear()
    hooks._BUILT.clear()
    try:
        hr.HookRegistry.apply_hooks()
        assert hr.HookRegistry._patched == set(hr.HookRegistry._hooks)  # every target applied
        assert not any(spread)  # no module held a method by name: restoring the classes undoes everything
        yield
    finally:
        for obj, attr, val, own in saved:
            if own:
                setattr(obj, attr, val)
            elif attr in obj.__dict__:
                delattr(obj, attr)
        keep._STATE.clear()
        hooks._BUILT.clear()


def sim_over(pool, req_to_token, seed):
    """A :class:`Sim` (the backend's pool calls, and the history the decode reference reads) over SGLang's own
    ``req_to_token`` (``ReqToTokenPool``): token ids are the ones SGLang's allocator handed out."""
    from sglang_elastic.offload.decode import OffloadDecoder

    sim = Sim.__new__(Sim)
    rows, ctx = req_to_token.shape
    sim.g, sim.pool, sim.r2t, sim.ctx, sim.free = torch.Generator().manual_seed(seed), pool, req_to_token, ctx, []
    sim.k = torch.zeros(L, rows, ctx, HKV, D, dtype=torch.bfloat16)
    sim.v = torch.zeros(L, rows, ctx, HKV, D, dtype=torch.bfloat16)
    sim.dec = OffloadDecoder(pool.layout, HQ, HKV, D, max_bs=ROWS, token_capacity=ROWS * ctx, device="cpu", split=SPLIT, prefetch=True)
    sim.guess, sim.keep, sim.async_host, sim.stage = None, set(), True, True  # keep: none of its own (KeepV grants)
    return sim


class Sched:
    """SGLang's scheduler steps on real components: an offload pool with kept V (``estimate``: V summaries), SGLang's
    allocator over it, ``ReqToTokenPool`` and ``RadixCache`` (so the hot buffers' hint goes by row, as the server lays the
    pool out with the radix cache on); the pool the build hook would have made (``_BUILT``)."""

    def __init__(self):
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.runtime_context import get_server_args

        pol = OffloadPolicy(sink=2, window=8, budget_frac=0.05, max_topk=24, dense_layers=1, denominator="estimate", chunk=8)
        self.pool = make_pool(pol, size=SIZE, rows=ROWS + 1, ctx=CTX, keep_v=True, hint_by_row=True)
        hooks._BUILT["pool"] = self.pool
        self.alloc = TokenToKVPoolAllocator(SIZE, torch.bfloat16, "cpu", self.pool, need_sort=False)
        self.r2t = ReqToTokenPool(ROWS, CTX, "cpu", False)
        self.tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc, page_size=1))
        self.sim = sim_over(self.pool, self.r2t.req_to_token, seed=3)
        self.model_config = types.SimpleNamespace(vocab_size=32000, is_encoder_decoder=False)
        # the scheduler's new_token_ratio once decayed (it starts at 0.7 and decays each decode step without retraction)
        self.new_token_ratio = NewTokenRatioTracker.from_server_args(get_server_args()).min

    @property
    def keep(self):
        return keep.current()

    def req(self, rid, prompt):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        return Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=MAX_NEW))

    def history_of_prefix(self, row, n):
        """The reference's history of a prefix the radix cache matched: K and V at its token ids."""
        ids = self.r2t.req_to_token[row, :n].long()
        for l in range(L):
            v = self.pool.host.view(l) if self.pool.is_sparse_layer(l) else self.pool.v_buffer[l]
            self.sim.k[l, row, :n], self.sim.v[l, row, :n] = self.pool.k_buffer[l][ids], v[ids]

    def prefill(self, waiting, running):
        """One prefill batch as ``Scheduler.get_new_batch_prefill`` makes it: SGLang's ``PrefillAdder`` (hooked) takes
        waiting requests in order until one is refused; SGLang's ``prepare_for_extend`` (rows, ids, ``req_to_token``;
        the keep hook's grants); the forward; the result (one output token each, ``cache_unfinished_req``); the batch
        merged into the running one. Returns the running batch and the requests admitted (taken off ``waiting``)."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        adder = PrefillAdder(1, self.tree, self.alloc, running, self.new_token_ratio, rem_input_tokens=10_000, rem_chunk_tokens=None)
        for r in list(waiting):
            r.init_next_round_input(self.tree)
            if adder.add_one_req(r, has_chunked_req=False, truncation_align_size=None) != AddReqResult.CONTINUE:
                break
            waiting.remove(r)
        reqs = list(adder.can_run_list)
        assert reqs, "nothing admitted"
        b = ScheduleBatch.init_new(reqs, self.r2t, self.alloc, self.tree, self.model_config, False, SpeculativeAlgorithm.NONE)
        b.prepare_for_extend()
        rows = b.req_pool_indices_cpu.tolist()
        for row, p in zip(rows, b.prefix_lens):
            self.history_of_prefix(row, p)
        self.sim.extend(rows, [(p, p + e) for p, e in zip(b.prefix_lens, b.extend_lens)])
        for r in reqs:
            r.output_ids.append(7)
            self.tree.cache_unfinished_req(r)
        self.last = b
        if running is None or running.is_empty():
            return b, reqs
        running.merge_batch(b)
        return running, reqs

    def update_running_batch(self, batch):
        """``Scheduler.update_running_batch`` up to the decode: drop finished requests, then SGLang's
        ``check_decode_mem`` (hooked) and, if it says no, SGLang's ``retract_decode``. Returns the retracted requests."""
        from sglang.srt.runtime_context import get_server_args

        batch.filter_batch()
        if batch.check_decode_mem():
            return []
        retracted, _, aborted = batch.retract_decode(get_server_args())
        assert not aborted
        return retracted

    def decode(self, batch):
        """SGLang's ``prepare_for_decode`` (one id each; the keep hook's grants), then the decode forward, every output
        checked against the policy's float64 reference (dense for a request that keeps V), and the result."""
        batch.prepare_for_decode()
        _, worst = self.sim.decode(batch.req_pool_indices_cpu.tolist(), batch.seq_lens_cpu.tolist())
        assert worst < 2e-2, worst
        for r in batch.reqs:
            r.output_ids.append(7)

    def row_state(self, row):
        """What the pool and KeepV keep per request row."""
        p = self.pool
        return dict(keep_len=p.keep_len_cpu[row], keep_len_dev=int(p.keep_len[row]), vrows=p.req_to_vrow[row].clone(),
                    chunk_slot=p.chunk_slot[row].clone(), slot_count=int(p.slot_count[row]), hot_count=int(p.hot_count[row]),
                    hot_table=p.hot_table[row].clone(), started=row in self.keep._started)

    def check_slots(self, running):
        """Every pool slot has one owner: the radix cache (whose ids include each running request's whole sequence
        after ``cache_unfinished_req``), a running request's ids past its cached length, a kept V row, or the free list."""
        p, a = self.pool, self.alloc
        own = [self.r2t.req_to_token[r.req_pool_idx, r.cache_protected_len: r.kv.kv_allocated_len].long() for r in running]
        kept = [p.req_to_vrow[r, :n].long() - p.keep_base for r, n in enumerate(p.keep_len_cpu) if n]
        ids = torch.cat(tree_ids(self.tree) + own + kept + [a.free_pages, a.release_pages]).tolist()
        assert sorted(ids) == list(range(1, SIZE + 1)), "a slot owned twice or lost"
        return sum(len(t) for t in tree_ids(self.tree)) + sum(len(t) for t in own)


def test_sglangs_retract_decode_frees_the_retracted_rows_offload_state_and_a_readmitted_request_starts_afresh(sglang_hooked):
    """Four requests, three over a 180-token document SGLang's radix cache shares, admitted by SGLang's (hooked)
    ``PrefillAdder`` up to the 600-token pool's bound on positions, then decoded. Two steps on the positions pass the
    bound: SGLang's own ``check_decode_mem`` still fits (233 ids held of 600), the hooked one says no, and SGLang's
    ``retract_decode`` retracts ``a``, the longest prompt and the one that keeps V. Its ``req_to_token`` row is free
    again and, through ``ReqToTokenPool.free``'s hook, KeepV gave its kept slots back to SGLang's allocator at once
    and forgot the row (``_started``), and the pool returns its V-summary slots at the next forward; the other rows'
    state is as it was. Re-admitted once ``c`` finished (its prompt matched by the radix cache, in the same row),
    ``a`` starts afresh: it keeps V of its whole length again, its sink and ring rows, kept rows and V summaries are
    rebuilt from the staging buffer (its freed device rows were poisoned), and it decodes as the dense reference."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, ScheduleBatch
    from sglang.srt.mem_cache.common import release_kv_cache

    s = Sched()
    pool, alloc, r2t = s.pool, s.alloc, s.r2t
    doc = list(range(1000, 1180))
    a, d, b, c = s.req("a", doc + [1] * 20), s.req("d", list(range(5000, 5015))), s.req("b", doc + [2] * 5), s.req("c", doc + [3] * 5)
    waiting = [a, d]
    running, got = s.prefill(waiting, None)
    waiting += [b, c]  # they arrive once a's prompt is cached
    running, got2 = s.prefill(waiting, running)  # c waits: b's and its cached prefixes together pass the staging buffers
    running, got3 = s.prefill(waiting, running)
    assert [[r.rid for r in g] for g in (got, got2, got3)] == [["a", "d"], ["b"], ["c"]] and [len(r.prefix_indices) for r in (b, c)] == [185, 185]
    m, row = s.keep, {r.rid: r.req_pool_idx for r in (a, b, c, d)}
    assert [m.kept(row[x]) for x in "adbc"] == [200, 15, 0, 0]  # a and d keep V; b's and c's grants found too few slots
    assert [int(pool.slot_count[row[x]]) for x in "adbc"] == [25, 1, 23, 23]  # a V-summary slot per complete 8-token chunk
    assert s.check_slots(running.reqs) == 225 and m.held == 215

    assert s.update_running_batch(running) == []
    s.decode(running)
    assert s.update_running_batch(running) == []
    s.decode(running)
    # the positions after the next token, 204 + 19 + 189 + 189, pass the pool's 600; SGLang alone would decode on
    # (4 new ids, 367 free as SGLang counts them: 233 ids held, kept slots counted free)
    held_ids, kept_d = s.check_slots(running.reqs), m.kept(row["d"])
    assert (held_ids, m.held, m.kept(row["a"]), alloc.available_size()) == (233, 219, 202, SIZE - 233)
    assert hooks._lengths(running.reqs) == 601
    assert ScheduleBatch.check_decode_mem.__wrapped__(running) and not running.check_decode_mem()
    before = {x: s.row_state(row[x]) for x in "dbc"}
    retracted = s.update_running_batch(running)
    assert [r.rid for r in retracted] == ["a"] and [r.rid for r in running.reqs] == ["d", "b", "c"] and running.check_decode_mem()
    # SGLang's side: a's row is free; its prompt's ids stay cached (unlocked), its decode ids are free
    assert a.req_pool_idx is None and a.kv is None and r2t.free_slots == [row["a"]]
    # KeepV: a's 202 kept slots back to the allocator at once, its row forgotten; a release, not a demotion
    assert m.kept(row["a"]) == 0 and int(pool.keep_len[row["a"]]) == 0 and row["a"] not in m._started
    assert m.held == kept_d == 17 and m.demoted == 0 and m._started == {row["d"], row["b"], row["c"]}
    # the allocator: what was free before the requests came (SIZE), less the ids the cache and running requests hold
    # (a's 2 decode ids are free again) and, for SGLang's own free list, d's kept slots
    assert s.check_slots(running.reqs) == held_ids - 2
    assert alloc.available_size() == SIZE - (held_ids - 2) and m.real_free() == SIZE - (held_ids - 2) - 17
    # the pool: a's row queued, its summary slots back at the next forward (the backend flushes first)
    assert pool._release_pending == [row["a"]]
    pool.flush_releases()
    assert int(pool.slot_count[row["a"]]) == 0 and bool((pool.chunk_slot[row["a"]] == pool.ZERO).all())
    owned = [i for x in "dbc" for i in pool.chunk_slot[row[x], : int(pool.slot_count[row[x]])].tolist()]
    free = pool.slot_stack[: int(pool.slot_top)].tolist()
    assert sorted(owned + free) == list(range(pool.summary_slots)) and int(pool.slot_overflow) == 0
    for x in "dbc":  # the remaining requests' rows: as they were
        now = s.row_state(row[x])
        assert all(torch.equal(now[k], v) if isinstance(v, torch.Tensor) else now[k] == v for k, v in before[x].items()), x

    s.decode(running)  # the scheduler goes on with the rest
    # a's freed fixed rows and the pool slots now free belong to no request: poison their V
    R = pool.layout.region_rows
    for l in pool.sparse_layer_ids:
        pool.v_buffer[l][row["a"] * R:(row["a"] + 1) * R] = float("nan")
        pool.v_buffer[l][pool.keep_base + alloc.free_pages.long()] = float("nan")
    # c finishes (SGLang's finish path: into the cache, its row freed through the same hook); a waits no more
    c.finished_reason = FINISH_LENGTH(length=len(c.output_ids))
    release_kv_cache(c, s.tree)
    running.filter_batch()
    waiting.append(a)
    running, got = s.prefill(waiting, running)
    n = len(a.origin_input_ids) + 3  # its prompt and 3 outputs: the cache matched its prompt, the outputs are the extend
    assert got == [a] and a.req_pool_idx == row["a"] and s.last.prefix_lens == [200] and s.last.extend_lens == [3]
    assert m.kept(row["a"]) == n and row["a"] in m._started  # a first prefill again: kept V of its whole length
    ids = r2t.req_to_token[row["a"], :n].long()
    for l in pool.sparse_layer_ids:
        host, v = pool.host.view(l), pool.v_buffer[l]
        assert torch.equal(v[pool.req_to_vrow[row["a"], :n].long()], host[ids])  # kept rows: every position
        assert torch.equal(v[row["a"] * R + torch.arange(2)], host[ids[:2]])  # sink
        assert torch.equal(v[row["a"] * R + 2 + torch.arange(n - 8, n) % 8], host[ids[n - 8:]])  # ring: its last 8
        assert int(pool.slot_count[row["a"]]) == n // 8
        for ch in range(n // 8):  # its chunks' V means
            assert bf16_close(pool.vsum[l][int(pool.chunk_slot[row["a"], ch])], host[ids[ch * 8:(ch + 1) * 8]].float().mean(0).bfloat16())
    s.decode(running)  # a dense over its rebuilt rows, against the reference
    assert m.kept(row["a"]) == n + 1
    s.check_slots(running.reqs)
