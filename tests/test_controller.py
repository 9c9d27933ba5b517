"""The scheduler-side controller: lend, reclaim (evict, migrate, retract,
remap), on SGLang's real RadixCache, ReqToTokenPool, Req, release paths
(``cache_unfinished_req``, ``release_kv_cache``, ``ScheduleBatch.release_req``)
and our pool on the host VMM backend.

SGLang's ``Scheduler`` itself needs a GPU model runner, so the controller gets
a shell holding the real components it reads (the attributes the scheduler
has: SGLang's pool-stats observer, invariant checker, session controller and,
with ``streaming=True``, the ``StreamingSession`` tree wrapper that
``--enable-streaming-session`` installs). ``ScheduleBatch``'s tensor fields
belong to the forward pass, which does not run here: :class:`Batch` keeps only
its ``reqs`` when filtering.
"""

from __future__ import annotations

import os
import types
from array import array

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, ReqKvInfo, ScheduleBatch
from sglang.srt.model_executor.cuda_graph_config import Backend, CudaGraphConfig, PhaseConfig
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.io_struct import OpenSessionReqInput
from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
from sglang.srt.managers.scheduler_components.pool_stats_observer import SchedulerPoolStatsObserver
from sglang.srt.session.session_controller import SessionController
from sglang.srt.session.streaming_session import StreamingSession
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.common import evict_from_tree_cache, release_kv_cache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

from sglang_elastic import config
from sglang_elastic.config import ElasticKVConfig
from sglang_elastic.sched import hooks
from sglang_elastic.sched.controller import lend_max_batch

from test_pool import LAYERS, layer, make_pool

BASE, ELASTIC = 256, 128  # tokens (page size 1); the quantum is 16 tokens


@pytest.fixture(scope="module", autouse=True)
def sglang_runtime_context():
    """SGLang's request code reads its runtime config bags (published by each
    scheduler process from its ServerArgs): publish real ones, CPU device."""
    import os

    import sglang_elastic
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    publish(ServerArgs(model_path=os.path.join(os.path.dirname(sglang_elastic.__file__), "models", "llama-3.1-8b"), device="cpu"), role="scheduler")


class Batch(ScheduleBatch):
    def filter_batch(self, chunked_req_to_exclude=None, keep_indices=None):
        self.reqs = [self.reqs[i] for i in keep_indices] if keep_indices is not None else [r for r in self.reqs if not r.finished()]


class Bed:
    """A scheduler shell with SGLang's components, and bookkeeping of the K
    rows every live request must still read."""

    tp = None  # (rank, torch.distributed group) for TP tests

    def __init__(self, fail_on=None, chunk_cache=False, stock_pool=False, graph_bs=32, margin_mb=1024, streaming=False, lend_bytes=None,
                 free_bytes=None, tree=None, server_args=None, mode="dynamic", encoder_decoder=False, built=None):
        """``free_bytes``: the host backend then reports this much free device
        memory at the controller's start (a capacity beyond what the pool
        holds); ``tree``: a tree-cache class in place of SGLang's RadixCache."""
        # ``built``: (backend, pool, allocator) made elsewhere (SGLang's post-capture sizing); it lends what is free then
        self.be, self.pool, self.alloc = built or make_pool(1, base=BASE, elastic=ELASTIC, step=64)
        if fail_on:
            self.be.fail_on = fail_on
        if free_bytes is not None:
            self.be.capacity = sum(self.be._handle_bytes.values()) + free_bytes
        self.r2t = ReqToTokenPool(16, 1024, "cpu", False)
        params = CacheInitParams(disable=chunk_cache, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc, page_size=1)
        if tree is not None:
            inner = tree(params)
        else:
            inner = ChunkCache(params) if chunk_cache else RadixCache(params)  # ChunkCache: --disable-radix-cache
        self.tree = StreamingSession(inner) if streaming else inner  # as SGLang's create_tree_cache wraps it
        self.sessions = SessionController(self.tree)
        self.batch = Batch(reqs=[], req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc, tree_cache=self.tree)
        server_args = server_args or types.SimpleNamespace(disaggregation_mode="null", speculative_num_draft_tokens=None,
                                                           cuda_graph_config=CudaGraphConfig(decode=PhaseConfig(backend=Backend.FULL, max_bs=graph_bs)))
        self.sched = types.SimpleNamespace(
            token_to_kv_pool_allocator=self.alloc, tree_cache=self.tree, req_to_token_pool=self.r2t, waiting_queue=[], chunked_req=None,
            running_batch=self.batch, last_batch=None, session_controller=self.sessions,
            model_config=types.SimpleNamespace(is_encoder_decoder=encoder_decoder),
            tp_group=types.SimpleNamespace(world_size=2 if self.tp else 1, rank_in_group=self.tp[0] if self.tp else 0),
            tp_cpu_group=self.tp[1] if self.tp else None, metrics_reporter=types.SimpleNamespace(enable_metrics=False),
            server_args=server_args, new_token_ratio_tracker=types.SimpleNamespace(current=0.7),
        )
        # SGLang's own observer and checker, as Scheduler.init_pool_stats_observer / init_invariant_checker build them
        self.sched.pool_stats_observer = SchedulerPoolStatsObserver(
            tree_cache=self.tree, token_to_kv_pool_allocator=self.alloc, req_to_token_pool=self.r2t, session_controller=self.sessions,
            hisparse_coordinator=None, is_hybrid_swa=False, is_hybrid_ssm=False, enable_hisparse=False, full_tokens_per_layer=None,
            swa_tokens_per_layer=None, max_total_num_tokens=BASE - 1, get_last_batch=lambda: self.batch, get_running_batch=lambda: self.batch)
        self.sched.invariant_checker = SchedulerInvariantChecker(
            is_hybrid_swa=False, is_hybrid_ssm=False, disaggregation_mode=DisaggregationMode.NULL, page_size=1, full_tokens_per_layer=None,
            swa_tokens_per_layer=None, max_total_num_tokens=BASE - 1, server_args=server_args, tree_cache=self.tree,
            token_to_kv_pool_allocator=self.alloc, req_to_token_pool=self.r2t, pool_stats_observer=self.sched.pool_stats_observer,
            get_last_batch=lambda: self.batch, get_running_batch=lambda: self.batch)
        self.sched._add_request_to_queue = lambda req, is_retracted=False: self.sched.waiting_queue.append(req)
        if lend_bytes is None and built is None:
            lend_bytes = ELASTIC * sum(self.pool.arena.row_bytes)
        cfg = ElasticKVConfig(enabled=True, mode=mode, lend_bytes=lend_bytes, margin_mb=margin_mb)
        if stock_pool:  # this rank's elastic pool failed to build: SGLang's allocator instead
            self.sched.token_to_kv_pool_allocator = TokenToKVPoolAllocator(BASE - 1, torch.bfloat16, "cpu", self.pool, False)
        saved = os.environ.get(config.ENV)
        os.environ[config.ENV] = cfg.to_env()  # what the launcher publishes to its scheduler processes
        try:
            hooks._after_scheduler_init(None, self.sched)  # the AFTER hook of Scheduler.__init__
        finally:
            if saved is None:
                os.environ.pop(config.ENV)
            else:
                os.environ[config.ENV] = saved
        self.ctl = getattr(self.sched, "_sglang_elastic", None)
        self.gen = torch.Generator().manual_seed(0)
        self.n = 0

    # -- SGLang's request life cycle, as the scheduler drives it ------------
    def _write(self, ids):
        for l in range(LAYERS):
            k, v = torch.randn(2, len(ids), self.pool.head_num, self.pool.head_dim, generator=self.gen).bfloat16()
            self.pool.set_kv_buffer(layer(l), ids, k, v)

    def open_session(self, sid: str):
        """A streaming session (``/open_session`` with ``streaming=True``)."""
        assert self.sessions.open(OpenSessionReqInput(capacity_of_str_len=1 << 16, session_id=sid, streaming=True)).success
        return self.sessions.get(sid)

    def request(self, tokens, session=None):
        req = Req(f"r{self.n}", "", array("q", tokens), SamplingParams(max_new_tokens=1 << 20), session=session)
        self.n += 1
        return req

    def admit(self, tokens, session=None, req=None):
        """Admit a request as SGLang's prefill does (match, allocate, write
        ``req_to_token``, K/V, ``cache_unfinished_req``); returns it, or None
        when the pool has no room. A streaming turn (``session``) restores its
        session's slot in the match, as SGLang does."""
        req = req or self.request(tokens, session)
        req.init_next_round_input(self.tree)  # SGLang's prefix match: prefix_indices, last_node, extend_range, cache_protected_len
        prefix = req.prefix_indices
        self.tree.inc_lock_ref(req.last_node)
        evict_from_tree_cache(self.tree, len(tokens) - len(prefix))  # as SGLang's alloc_token_slots does
        new = self.alloc.alloc(len(tokens) - len(prefix))
        if new is None or (req.req_pool_idx is None and self.r2t.available_size() == 0):
            if new is not None:
                self.alloc.free(new)
            self.tree.dec_lock_ref(req.last_node)
            return None
        req.set_extend_range(len(prefix), len(tokens))  # as PrefillAdder does
        self.r2t.alloc([req])  # a restored streaming turn keeps its slot's row
        self.r2t.write((req.req_pool_idx, slice(0, len(tokens))), torch.cat((prefix, new)).to(torch.int32))
        self._write(new)
        if req.kv is None:
            req.kv = ReqKvInfo(kv_allocated_len=len(tokens), swa_evicted_seqlen=0)
        req.kv.kv_allocated_len = len(tokens)
        req.kv_committed_len = len(tokens)
        self.tree.cache_unfinished_req(req)
        self.batch.reqs.append(req)
        return req

    def decode(self, only=None) -> bool:
        """One decode step of the running batch (or of the requests ``only``)."""
        reqs = [r for r in self.batch.reqs if only is None or r in only]
        evict_from_tree_cache(self.tree, len(reqs))  # as SGLang's alloc_for_decode does
        locs = self.alloc.alloc(len(reqs))
        if locs is None:
            return False
        for req, loc in zip(reqs, locs.tolist()):
            self.r2t.req_to_token[req.req_pool_idx, req.kv.kv_allocated_len] = loc
            req.kv.kv_allocated_len += 1
            req.kv_committed_len += 1
            req.output_ids.append(int(torch.randint(0, 1000, (1,), generator=self.gen)))
        self._write(locs)
        return True

    def finish(self, i) -> None:
        """SGLang's finish path (``release_kv_cache``): into the tree, or into
        its session's slot for a streaming turn. ``i``: index or request."""
        req = self.batch.reqs.pop(i if isinstance(i, int) else self.batch.reqs.index(i))
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))  # as the scheduler sets it before releasing
        release_kv_cache(req, self.tree)

    # -- what must hold ------------------------------------------------------
    def rows(self):
        return {r.rid: self.r2t.req_to_token[r.req_pool_idx, : r.kv.kv_allocated_len].to(torch.int64).clone() for r in self.batch.reqs}

    def slot_row(self, sid):
        slot = self.tree.slots[sid]
        return self.r2t.req_to_token[slot.req_pool_idx, : slot.kv.kv_allocated_len].to(torch.int64).clone()

    def kv_of(self, ids):
        """K and V of ``ids`` in every layer, ``[LAYERS, 2, len(ids), heads, head_dim]`` (V apart from K: a move that
        loses V alone shows; the first version compared K only, and a relocation that zeroed V passed)."""
        return torch.stack([torch.stack((self.pool.get_key_buffer(l)[ids], self.pool.get_value_buffer(l)[ids])) for l in range(LAYERS)])

    def check_ownership_and_accounting(self):
        a = self.alloc
        free = torch.cat((a.free_pages, a.release_pages)).tolist()
        tree_ids = [t for n in _nodes(self.tree) for t in n.value.tolist()]
        req_ids = [t for r in self.batch.reqs for t in self.r2t.req_to_token[r.req_pool_idx, r.cache_protected_len : r.kv.kv_allocated_len].tolist()]
        running_rows = {r.req_pool_idx for r in self.batch.reqs}
        slot_ids = [t for slot in getattr(self.tree, "slots", {}).values() if slot.is_holding_kv and slot.req_pool_idx not in running_rows
                    for t in self.r2t.req_to_token[slot.req_pool_idx, slot.cache_protected_len : slot.kv.kv_allocated_len].tolist()]
        owned = free + tree_ids + req_ids + slot_ids
        assert len(owned) == len(set(owned)), "an id is owned twice"
        usable = set(range(1, a.usable_base_tokens)) | set(range(a.base_tokens, a.base_tokens + a.lent_tokens))
        assert set(owned) == usable, "owned and free ids must partition the backed ids"
        # SGLang's own invariant (available + evictable + protected + session_held + uncached == total) and its
        # KV page check (no owner, request or session slot, references a free page; no page is free twice)
        checker = self.sched.invariant_checker
        leak, msg = checker._check_full_pool(self.sched.pool_stats_observer.get_pool_stats(), uncached=len(req_ids))
        assert not leak, msg
        warnings = checker.count_memory_leak_warnings
        checker._check_kv_page_invariants()
        assert checker.count_memory_leak_warnings == warnings, "SGLang's KV page check found a use-after-free or a double free"
        assert checker.max_total_num_tokens == a.size == self.sched.pool_stats_observer.max_total_num_tokens


def _nodes(tree):
    if tree.is_chunk_cache():
        return
    stack = list(tree.root_node.children.values())  # StreamingSession forwards root_node to its tree
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        if n.value is not None:
            yield n


@pytest.mark.parametrize("chunk_cache", [False, True], ids=["radix", "chunk-cache"])
def test_lend_grows_capacity_and_a_reclaim_migrates_every_running_request_bit_exactly(chunk_cache):
    bed = Bed(chunk_cache=chunk_cache)
    assert bed.ctl.lendable_tokens == ELASTIC
    row = bed.pool.arena.row_bytes[0]
    assert bed.pool.get_kv_size_bytes() == (LAYERS * row * BASE, LAYERS * row * BASE)  # backed base rows, not the reservation
    assert bed.admit(list(range(100, 300)))  # 200 of the 255 base tokens
    bed.ctl.lend()
    assert bed.alloc.size == BASE - 1 + ELASTIC and bed.sched.invariant_checker.max_total_num_tokens == bed.alloc.size
    assert bed.ctl.state() == {"mode": "dynamic", "base_tokens": BASE - 1, "lendable_tokens": ELASTIC, "lent_tokens": ELASTIC,
                               "lent_bytes": ELASTIC * sum(bed.pool.arena.row_bytes), "cycles": 0, "lending_disabled": False,
                               "reclaims_skipped": 0, "prefills_deferred": 0}
    assert bed.admit(list(range(100, 180)) + list(range(5000, 5090)))  # shares 80 tokens (radix), needs 90+ more: spills into the lent range
    for _ in range(5 if chunk_cache else 20):  # no shared prefix in a chunk cache: less room left
        assert bed.decode()
    rows = bed.rows()
    assert max(int(r.max()) for r in rows.values()) >= bed.alloc.base_tokens  # something really is lent
    k = {rid: bed.kv_of(r) for rid, r in rows.items()}
    bed.finish(0)  # the first request finishes: its tokens go to the tree; base room appears
    bed.check_ownership_and_accounting()
    bed.ctl.reclaim(bed.batch)
    assert bed.alloc.lent_tokens == 0 and bed.pool.arena.lent_steps == 0
    assert bed.sched.waiting_queue == []  # nothing retracted: the base had room
    for rid, r in bed.rows().items():
        assert int(r.max()) < bed.alloc.base_tokens
        assert torch.equal(bed.kv_of(r), k[rid]), "K or V bytes changed across the migration"
    bed.check_ownership_and_accounting()


def test_without_base_room_a_reclaim_retracts_the_largest_request_and_requeues_it():
    bed = Bed()
    bed.ctl.lend()
    assert bed.admit(list(range(1000, 1200)))
    assert bed.admit(list(range(2000, 2150)))  # 350 tokens: 95+ of them lent
    while bed.decode() and bed.alloc.available_size() > 0:
        pass
    survivors_before = {r.rid for r in bed.batch.reqs}
    bed.ctl.reclaim(bed.batch)
    assert [r.rid for r in bed.sched.waiting_queue] == ["r0"]  # the largest
    assert {r.rid for r in bed.batch.reqs} == survivors_before - {"r0"}
    assert bed.sched.waiting_queue[0].kv is None  # its KV was released by SGLang's release path
    bed.check_ownership_and_accounting()


def test_the_start_up_warm_up_runs_one_cycle_and_the_vacate_ops_without_changing_a_base_row(monkeypatch, caplog):
    """The first reclaim of a server paid first-call costs (67-114 ms at TP 2
    against 14-21 ms later): the controller runs one cycle at start-up."""
    import sglang.srt.mem_cache.memory_pool as mp

    from sglang_elastic.sched import controller

    _be, _pool, _alloc = make_pool(1, base=BASE, elastic=ELASTIC, step=64)
    pool_maps = _be.calls.get("map", 0)  # what building the pool maps by itself
    with caplog.at_level("INFO", logger=controller.__name__):
        bed = Bed()
    warm_maps = bed.be.calls.get("map", 0) - pool_maps
    assert warm_maps > 0 and bed.be.calls.get("unmap", 0) == warm_maps  # lent and unmapped again
    assert bed.alloc.lent_tokens == 0 and bed.ctl.cycles == 0 and not bed.ctl.disabled and not bed.pool.arena.lending_disabled
    assert torch.equal(bed.alloc.free_pages, torch.arange(1, bed.alloc.usable_base_tokens))  # every base id free, in order
    bed.check_ownership_and_accounting()
    msgs = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    [line] = [m for m in msgs if "warm-up lend/reclaim cycle" in m]
    assert "failed" not in line and "vacate" in line
    assert not any(m.startswith(("sglang-elastic: lent", "sglang-elastic: reclaimed")) for m in msgs)

    # again, with random K/V in every base row: the copy goes base -> lent, no base row changes
    ids = torch.arange(1, bed.alloc.usable_base_tokens)
    bed._write(ids)
    before = [(bed.pool.k_buffer[l][ids].clone(), bed.pool.v_buffer[l][ids].clone()) for l in range(LAYERS)]
    copies, real = [], mp.move_kv_cache_native
    monkeypatch.setattr(mp, "move_kv_cache_native", lambda k, v, tgt, src, *a: (copies.append((tgt.tolist(), src.tolist())), real(k, v, tgt, src, *a)))
    bed.ctl.warm_up()
    assert copies == [([bed.alloc.base_tokens], [1])]
    assert all(torch.equal(bed.pool.k_buffer[l][ids], k) and torch.equal(bed.pool.v_buffer[l][ids], v) for l, (k, v) in enumerate(before))
    assert bed.be.calls["unmap"] == 2 * warm_maps and bed.alloc.lent_tokens == 0 and bed.ctl.cycles == 0
    assert bed.ctl.lend() == ELASTIC  # and lending works as before


def test_an_exception_in_the_warm_up_restores_the_base_pool_and_turns_lending_off(monkeypatch, caplog):
    from sglang_elastic.sched import controller

    def broken(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(controller, "remap_many", broken)
    with caplog.at_level("INFO", logger=controller.__name__):
        bed = Bed()  # the server still starts
    assert bed.ctl.disabled and bed.alloc.lent_tokens == 0 and bed.pool.arena.lent_steps == 0
    assert any(r.levelname == "ERROR" and "warm-up cycle failed" in r.getMessage() for r in caplog.records)
    bed.check_ownership_and_accounting()
    assert bed.admit(list(range(50)))
    for _ in range(2 * bed.ctl.cfg.lend_after_steps):  # decode-only steps: no lend any more
        bed.ctl.after_prefill(None, bed.batch)
    assert bed.alloc.lent_tokens == 0
    bed.check_ownership_and_accounting()


@pytest.mark.parametrize("when", ["start-up", "run time"])  # in the warm-up cycle, or in a later lend
def test_a_failing_map_leaves_the_base_pool_serving_and_disables_lending(when):
    bed = Bed(fail_on={"map": lambda n: True} if when == "start-up" else None)
    if when == "run time":
        assert not bed.pool.arena.lending_disabled
        bed.be.fail_on = {"map": lambda n: True}
    assert bed.ctl.lend() == 0
    assert bed.pool.arena.lending_disabled and bed.alloc.lent_tokens == 0
    bed.check_ownership_and_accounting()
    assert bed.admit(list(range(50)))
    bed.ctl.after_prefill(None, bed.batch)
    for _ in range(40):  # decode-only steps: no lend is attempted any more
        bed.ctl.after_prefill(None, bed.batch)
    assert bed.alloc.lent_tokens == 0
    bed.check_ownership_and_accounting()


def test_a_failing_unmap_still_completes_the_reclaim_and_disables_lending():
    bed = Bed()
    assert bed.admit(list(range(230)))
    bed.ctl.lend()
    assert bed.admit(list(range(1000, 1060)))  # 25 base + 35 lent tokens
    assert int(bed.rows()["r1"].max()) >= bed.alloc.base_tokens
    bed.finish(0)  # its 230 tokens become evictable: room to migrate into
    bed.be.fail_on = {"unmap": lambda n: True}
    bed.ctl.reclaim(bed.batch)
    bed.ctl.after_prefill(None, bed.batch)  # the next pass: the unmap on the helper thread is done and its failure counted
    bed.be.fail_on = {}
    assert bed.alloc.lent_tokens == 0 and bed.pool.arena.lending_disabled
    assert int(bed.rows()["r1"].max()) < bed.alloc.base_tokens
    assert bed.sched.waiting_queue == []
    bed.check_ownership_and_accounting()


def test_hysteresis_lends_after_the_configured_decode_only_steps_and_reclaims_before_a_prefill():
    bed = Bed()
    assert bed.admit(list(range(10)))
    for _ in range(bed.ctl.cfg.lend_after_steps - 1):
        bed.ctl.after_prefill(None, bed.batch)
    assert bed.alloc.lent_tokens == 0
    bed.ctl.after_prefill(None, bed.batch)
    assert bed.alloc.lent_tokens == ELASTIC
    bed.ctl.before_prefill(bed.batch)  # nothing waiting: stays lent
    assert bed.alloc.lent_tokens == ELASTIC
    bed.sched.waiting_queue.append(object())
    bed.ctl.before_prefill(bed.batch)
    assert bed.alloc.lent_tokens == 0
    for _ in range(2 * bed.ctl.cfg.lend_after_steps):  # a request waits and could be admitted: lending would be undone at once
        bed.ctl.after_prefill(None, bed.batch)
    assert bed.alloc.lent_tokens == 0
    bed.batch.batch_is_full = True  # it cannot be admitted: the decodes may use the reserve
    bed.ctl.after_prefill(None, bed.batch)
    assert bed.alloc.lent_tokens == ELASTIC
    bed.ctl.before_prefill(bed.batch)
    assert bed.alloc.lent_tokens == ELASTIC


def test_no_lend_while_the_decode_batch_would_run_eagerly_above_the_graphs():
    """A decode batch above the decode graphs' max_bs runs eagerly and takes
    its activations from the memory lending would use: no lend then (here
    graphs up to 2 requests, a margin too small for any eager decode)."""
    bed = Bed(graph_bs=2, margin_mb=0)
    assert bed.ctl.lend_max_bs == 2
    for tokens in (range(10), range(20, 30), range(40, 50)):
        assert bed.admit(list(tokens))
    for _ in range(3 * bed.ctl.cfg.lend_after_steps):
        bed.ctl.after_prefill(None, bed.batch)
    assert bed.alloc.lent_tokens == 0, "lent under a batch of 3 that runs without a graph"
    bed.finish(0)  # the batch fits the graphs again
    for _ in range(bed.ctl.cfg.lend_after_steps):
        bed.ctl.after_prefill(None, bed.batch)
    assert bed.alloc.lent_tokens == ELASTIC
    # it grows only through a prefill, and a waiting request makes one: reclaimed first
    bed.sched.waiting_queue.append(object())
    bed.ctl.before_prefill(bed.batch)
    assert bed.alloc.lent_tokens == 0
    bed.check_ownership_and_accounting()


@pytest.mark.parametrize("backend, max_bs, margin_mb, draft, want", [
    (Backend.FULL, 256, 1024, None, 256),      # by SGLang's estimate no eager decode fits in the default 1 GiB: the graphs' bound
    (Backend.FULL, 256, 8192, None, 5034),     # a margin that holds 5,034 eager requests
    (Backend.DISABLED, 256, 1024, None, 0),    # no decode graphs, no room for an eager decode: never lend
    (Backend.DISABLED, 256, 4096, None, 2304),
    (Backend.BREAKABLE, 160, 8192, 4, 1258),   # speculative decoding: 4 tokens per request
    (Backend.BREAKABLE, 160, 3583, 4, 160),    # just under SGLang's 2,048-token floor: the graphs' bound
])
def test_lend_max_batch_follows_the_decode_graphs_and_sglangs_own_activation_estimate(backend, max_bs, margin_mb, draft, want):
    import sglang_elastic
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=os.path.join(os.path.dirname(sglang_elastic.__file__), "models", "llama-3.1-8b"), device="cuda",
                      cuda_graph_backend_decode=backend, cuda_graph_max_bs_decode=max_bs)  # as `launch_server` flags (resolves without a GPU)
    assert (args.cuda_graph_config.decode.backend, args.cuda_graph_config.decode.max_bs) == (backend, max_bs)
    if draft:  # speculative flags need a draft model to resolve: the one field read, beside the real config
        args = types.SimpleNamespace(cuda_graph_config=args.cuda_graph_config, speculative_num_draft_tokens=draft)
    got = lend_max_batch(args, margin_mb)
    assert got == want

    def est(tokens):  # SGLang's own activation estimate, MiB, for `tokens` in flight at TP 1
        shape = types.SimpleNamespace(disaggregation_mode="null", chunked_prefill_size=tokens, max_prefill_tokens=tokens, tp_size=1, pp_size=1)
        return ServerArgs.pre_capture_activation_reserve_mb(shape, None)

    per_req = draft or 1
    if got > (max_bs if backend != Backend.DISABLED else 0):  # the eager bound: `got` requests fit, one more does not
        assert est(got * per_req) <= margin_mb < est((got + 1) * per_req)
    else:  # the graphs' bound: no eager batch above it fits
        assert est((got + 1) * per_req) > margin_mb


def test_lend_max_batch_without_graph_padding_stops_at_the_first_uncaptured_size():
    """--disable-cuda-graph-padding: a batch replays a graph only at a
    captured size, so a gap in --cuda-graph-bs ends the safe range; the TP
    term of SGLang's estimate counts too (TP 8: 1 GiB)."""
    import sglang_elastic
    from sglang.srt.server_args import ServerArgs

    model = os.path.join(os.path.dirname(sglang_elastic.__file__), "models", "llama-3.1-8b")
    gappy = ServerArgs(model_path=model, device="cuda", disable_cuda_graph_padding=True, cuda_graph_bs_decode=[1, 2, 3, 4, 8, 16])
    assert gappy.cuda_graph_config.decode.max_bs == 16 and lend_max_batch(gappy, 1024) == 4
    whole = ServerArgs(model_path=model, device="cuda", disable_cuda_graph_padding=True, cuda_graph_max_bs_decode=64)  # SGLang captures 1..64
    assert lend_max_batch(whole, 1024) == 64
    tp8 = types.SimpleNamespace(cuda_graph_config=whole.cuda_graph_config, tp_size=8, pp_size=1)
    assert lend_max_batch(tp8, 4096) == 64 < lend_max_batch(types.SimpleNamespace(cuda_graph_config=whole.cuda_graph_config, tp_size=1, pp_size=1), 4096)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["admit", "admit_shared", "decode", "finish", "lend", "reclaim"]), st.integers(0, 1 << 16)), min_size=5, max_size=40))
def test_random_serving_with_lend_and_reclaim_keeps_ownership_accounting_and_kv_bytes(ops):
    bed = Bed()
    prompts = []
    for op, x in ops:
        if op == "admit":
            toks = [10_000 + (x * 7 + i) % 50_000 for i in range(16 + x % 120)]
            if bed.admit(toks):
                prompts.append(toks)
        elif op == "admit_shared" and prompts:
            base = prompts[x % len(prompts)]
            toks = base[: 1 + x % len(base)] + [60_000 + x % 1000 + i for i in range(1 + x % 40)]
            if bed.admit(toks):
                prompts.append(toks)
        elif op == "decode" and bed.batch.reqs:
            bed.decode()
        elif op == "finish" and bed.batch.reqs:
            bed.finish(x % len(bed.batch.reqs))
        elif op == "lend" and not bed.ctl.lent:
            bed.ctl.lend()
        elif op == "reclaim" and bed.ctl.lent:
            rows = bed.rows()
            k = {rid: bed.kv_of(r) for rid, r in rows.items()}
            bed.ctl.reclaim(bed.batch)
            retracted = {r.rid for r in bed.sched.waiting_queue}
            for rid, r in bed.rows().items():
                assert rid not in retracted
                assert int(r.max()) < bed.alloc.base_tokens
                assert torch.equal(bed.kv_of(r), k[rid])
            bed.sched.waiting_queue.clear()
        bed.check_ownership_and_accounting()


def _raise_injected(*a, **k):
    raise RuntimeError("injected")


def _raise_oom(*a, **k):
    raise torch.OutOfMemoryError("CUDA out of memory (injected)")


def _tp_rank(rank: int, world: int, port: int, out):
    """One TP rank over a real gloo group of ``world`` ranks, through four
    scenarios: the last rank's VMM map fails in the start-up warm-up, the
    last rank's warm-up raises, the last rank's map fails in a later lend,
    and the last rank's pool fell back to SGLang's stock pool. Each rank
    reports what it ended with."""
    import torch.distributed as dist

    odd = world - 1
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        import sglang_elastic
        from sglang.srt.runtime_context import publish
        from sglang.srt.server_args import ServerArgs

        publish(ServerArgs(model_path=os.path.join(os.path.dirname(sglang_elastic.__file__), "models", "llama-3.1-8b"), device="cpu"), role="scheduler")
        Bed.tp = (rank, dist.group.WORLD)
        at_start = Bed(fail_on={"map": lambda n: True} if rank == odd else None).ctl  # the warm-up's lend fails on one rank
        warm_up_failed = (at_start.disabled, at_start.alloc.lent_tokens)
        from sglang_elastic.sched import controller

        real_remap = controller.remap_many
        if rank == odd:  # an exception in the warm-up's vacate ops on one rank
            controller.remap_many = _raise_injected
        try:
            raised = Bed().ctl
        finally:
            controller.remap_many = real_remap
        warm_up_raised = (raised.disabled, raised.alloc.lent_tokens)
        bed = Bed()
        if rank == odd:
            bed.be.fail_on = {"map": lambda n: True}
        first = bed.ctl.lend()  # at run time, the last rank cannot back anything
        assert bed.admit(list(range(20)))
        for _ in range(2 * bed.ctl.cfg.lend_after_steps):  # decode-only steps: no rank may try alone
            bed.ctl.after_prefill(None, bed.batch)
        cannot_map = (first, bed.ctl.disabled, bed.alloc.lent_tokens, bed.pool.arena.lent_steps)
        fell_back = Bed(stock_pool=rank == odd).ctl  # no rank may run a controller then
        # at run time, the last rank's reclaim raises in its remap: every rank stops (still lent alike), and the retry goes through
        live = Bed()
        assert live.ctl.lend() == ELASTIC and live.admit(list(range(BASE - 20))) and live.admit(list(range(1000, 1060)))
        if rank == odd:
            controller.remap_many = _raise_injected
        try:
            first_try = live.ctl.reclaim(live.batch)
        finally:
            controller.remap_many = real_remap
        stopped = (first_try, live.alloc.lent_tokens, live.ctl._stop is not None)
        retried = (live.ctl.reclaim(live.batch), live.alloc.lent_tokens)
        live.check_ownership_and_accounting()
        # the one lend step no longer fits on the last rank (something took a quarter of it for good): every rank cuts it alike
        short = Bed(free_bytes=ELASTIC * sum(make_pool(1)[1].arena.row_bytes) + 2**20, margin_mb=1)
        if rank == odd:
            short.be.create(short.pool.arena.step_bytes() // 4 // 4096 * 4096)
        recut = (short.ctl.lend(), short.pool.arena.lent_steps, short.ctl.disabled)
        # the last rank has no device memory for the lend's free list (made before the agreement): every rank lends
        # nothing, with the same free list; the next lend, with memory, lends on every rank
        nolist = Bed()
        real_prepare = nolist.alloc.prepare_lend
        if rank == odd:
            nolist.alloc.prepare_lend = _raise_oom
        first_lend = nolist.ctl.lend()
        no_list = (first_lend, nolist.alloc.lent_tokens, nolist.pool.arena.lent_steps, nolist.alloc.free_pages.tolist() == list(range(1, BASE)))
        nolist.alloc.prepare_lend = real_prepare
        no_list += (nolist.ctl.lend(), nolist.alloc.lent_tokens)
        nolist.check_ownership_and_accounting()
        # an eager prefill's reclaim whose unmap is done on rank 0 and held on the last rank: every rank defers the
        # prefill (runs its decode batch) until the last rank's memory is back, then every rank forms it
        import threading

        eager = Bed(server_args=_graph_args(cuda_graph_backend_prefill=Backend.DISABLED), margin_mb=0,
                    free_bytes=ELASTIC * sum(make_pool(1)[1].arena.row_bytes))
        go, held = threading.Event(), threading.Event()

        def hold_release(call):
            if rank == odd and call == "release" and threading.current_thread().name.startswith("sglang-elastic-vmm") and not go.is_set():
                held.set()
                go.wait(120)

        eager.be.on_call = hold_release
        assert eager.ctl.lend() == ELASTIC and eager.admit(list(range(30)))
        eager.sched.waiting_queue.append(eager.request(list(range(500, 600))))
        eager.ctl.before_prefill(eager.batch)  # the reclaim (collectives)
        if rank == odd:
            assert held.wait(120)
        else:
            assert eager.pool.arena.wait_freed(1 << 62)  # this rank's unmap ended
        deferred = [eager.ctl.defer_prefill(eager.batch)]
        go.set()
        assert eager.pool.arena.wait_freed(1 << 62)
        deferred.append(eager.ctl.defer_prefill(eager.batch))
        eager.ctl.after_prefill(None, eager.batch)
        eager.ctl._settle()
        eager.check_ownership_and_accounting()
        out.put((rank, warm_up_failed, warm_up_raised, cannot_map, fell_back, recut, stopped, retried, no_list, tuple(deferred)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])  # TP 2 as measured on the H200s; TP 4 (issue 5) on the CPU only
def test_tp_ranks_agree_when_one_rank_cannot_lend_or_fell_back_to_the_stock_pool(world):
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fresh processes, as spawn gives, forked by a server that imported torch
    # and SGLang's scheduler modules once for every rank of both tests, instead
    # of once per rank (this module itself is not on the server's sys.path: each rank imports it, cheaply then)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "sglang.srt.managers.schedule_batch", "sglang.srt.mem_cache.radix_cache",
                                "sglang.srt.mem_cache.memory_pool", "sglang.srt.server_args", "hypothesis"])
    out = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        res = sorted(out.get(timeout=240) for _ in procs)  # a rank stuck alone in a collective never answers
    finally:
        for p in procs:
            p.join(30)
            p.kill()
    # the other ranks could map, the last could not: all lend nothing, roll back and stop lending;
    # the last rank on SGLang's stock pool: no rank runs a controller
    assert [x[:5] for x in res] == [(r, (True, 0), (True, 0), (0, True, 0, 0), None) for r in range(world)]
    # the cut is the last rank's (what its free memory holds less the margin), the same token range on every rank
    recuts = {x[5] for x in res}
    assert len(recuts) == 1 and [(t, n, off) for t, n, off in recuts][0][1:] == (1, False)
    lent = recuts.pop()[0]
    assert lent == ELASTIC * 3 // 4  # a quarter of the step taken on the last rank (whole token quanta here)
    # a reclaim that stops on one rank stops on all of them (before: the others unmapped, and the next collective hung)
    assert [x[6:8] for x in res] == [((False, ELASTIC, True), (True, 0))] * world
    # the last rank could not make the lend's free list: no rank lent, every free list as before; then all lend
    assert [x[8] for x in res] == [(0, 0, 0, True, ELASTIC, ELASTIC)] * world
    # a prefill is deferred on every rank while any rank's reclaim is still giving back its memory, and on none after
    assert [x[9] for x in res] == [(True, False)] * world


def test_a_reclaim_also_moves_the_chunked_request_held_out_of_the_running_batch():
    bed = Bed()
    assert bed.admit(list(range(230)))
    bed.ctl.lend()
    assert bed.admit(list(range(1000, 1060)))  # 25 base + 35 lent tokens
    chunked = bed.batch.reqs.pop()  # SGLang keeps the chunked request out of the batch between chunks
    bed.sched.chunked_req = chunked
    before = bed.r2t.req_to_token[chunked.req_pool_idx, :60].to(torch.int64).clone()
    k = bed.kv_of(before)
    bed.finish(0)
    bed.ctl.reclaim(bed.batch)
    after = bed.r2t.req_to_token[chunked.req_pool_idx, :60].to(torch.int64)
    assert int(before.max()) >= bed.alloc.base_tokens > int(after.max())
    assert torch.equal(bed.kv_of(after), k)
    assert int(chunked.prefix_indices.max()) < bed.alloc.base_tokens


@pytest.mark.parametrize("lend", [True, False], ids=["lent", "never lent"])
def test_a_reclaim_keeps_the_recently_used_prefix_and_evicts_the_least_recently_used(lend):
    """Issue 22, defect 2: a turn decoded while lent, then its follow-up
    arrives. The reclaim moves the cached answer into the base and evicts the
    180 older cached tokens (SGLang's LRU), so the follow-up reuses what it
    would without lending: 100 of its 110 prompt tokens (before: the answer,
    whose pages were lent, was evicted by address; 50 reused)."""
    bed = Bed()
    old = list(range(50000, 50180))
    bed.finish(bed.admit(old))  # 180 cached tokens, used long ago
    if lend:
        bed.ctl.lend()
    turn = bed.admit(list(range(100, 150)))  # 50 base tokens: 25 left
    for _ in range(50):
        assert bed.decode()  # lent: 25 base and 25 lent tokens; not lent: SGLang evicts the old prefix at the 26th
    bed.finish(turn)  # prompt and answer cached
    cached = list(range(100, 150)) + list(turn.output_ids)
    bed.sched.waiting_queue.append(bed.request(cached + list(range(8000, 8010))))
    bed.ctl.before_prefill(bed.batch)  # a prefill may form: reclaim
    assert bed.alloc.lent_tokens == 0
    follow_up = bed.sched.waiting_queue.pop()
    follow_up.init_next_round_input(bed.tree)  # SGLang's match at admission
    assert follow_up.prefix_indices.numel() == 100
    assert int(follow_up.prefix_indices.max()) < bed.alloc.base_tokens
    probe = bed.request(old)
    probe.init_next_round_input(bed.tree)
    assert probe.prefix_indices.numel() == 0  # the old prefix went instead
    bed.check_ownership_and_accounting()


def test_lend_bytes_above_the_free_memory_are_capped_at_what_was_measured(caplog):
    """Issue 22, defect 3: --elastic-kv-lend-bytes 100000GiB was accepted as
    is. It is capped at the free memory measured after capture, less the
    margin, with one warning; the pool's VA reservation too."""
    from sglang_elastic.sched import controller
    from sglang_elastic.sched.build import _ElasticPoolFactory
    from sglang_elastic.vmm import HostBackend

    row = 2 * LAYERS * 2 * 64 * 2  # K and V of every layer, bf16: test_pool's shape
    with caplog.at_level("WARNING", logger=controller.__name__):
        bed = Bed(lend_bytes=100000 << 30, free_bytes=64 * row, margin_mb=0)
    assert bed.ctl.lendable_tokens == 64  # not the 128 the pool reserved
    [line] = [r.getMessage() for r in caplog.records if "--elastic-kv-lend-bytes" in r.getMessage()]
    assert "lending at most" in line
    assert bed.ctl.lend() == 64 and bed.be.free_bytes() == 0
    # the pool's reservation, when SGLang builds it: what is free, not 100000 GiB
    be = HostBackend(granularity=4096, capacity=(256 + 512) * row)
    pool = _ElasticPoolFactory(be, ElasticKVConfig(enabled=True, lend_bytes=100000 << 30))(
        256, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=64, layer_num=LAYERS, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    assert pool.arena.max_elastic_tokens * row <= (256 + 512) * row


def test_lend_bytes_below_one_tokens_kv_says_nothing_is_lent(caplog):
    """``--elastic-kv-lend-bytes 1`` started a pool that lent 0 tokens with no word of why (new-user finding)."""
    from sglang_elastic.sched import controller

    row = 2 * LAYERS * 2 * 64 * 2
    quantum = Bed(free_bytes=64 * row, margin_mb=0).pool.arena.quantum  # the smallest lend step, in tokens
    assert quantum > 1
    with caplog.at_level("WARNING", logger=controller.__name__):
        bed = Bed(lend_bytes=quantum * row - 1, free_bytes=64 * row, margin_mb=0)
    assert bed.ctl.lendable_tokens == 0
    [line] = [r.getMessage() for r in caplog.records if "smallest lend step" in r.getMessage()]
    assert f"--elastic-kv-lend-bytes {quantum * row - 1} is less than the smallest lend step ({quantum} tokens, {quantum * row} bytes" in line
    assert "nothing is lent" in line
    caplog.clear()
    with caplog.at_level("WARNING", logger=controller.__name__):
        assert Bed(lend_bytes=quantum * row, free_bytes=64 * row, margin_mb=0).ctl.lendable_tokens == quantum  # one step: lent, no warning
    assert not [r for r in caplog.records if "smallest lend step" in r.getMessage()]


def test_a_lend_without_device_memory_for_its_free_list_rolls_back_instead_of_stopping_the_scheduler(monkeypatch, caplog):
    """Seen on an H100 (2026-12-06): with ``--elastic-kv-margin-mb 0`` the
    start-up lend mapped the last free memory, then the allocator's new free
    list (a 20 MiB ``torch.cat``) raised ``torch.OutOfMemoryError`` out of the
    scheduler's ``__init__`` and the server died. The device's allocator is
    modelled here: a ``torch.cat`` whose result does not fit in the host
    backend's free bytes raises as CUDA's would. The scheduler now starts, the
    mapped step is rolled back (nothing mapped, the free list as before, one
    warning naming the margin), and after three such lends lending is off."""
    import test_pool
    from sglang_elastic.sched import controller
    from sglang_elastic.vmm import HostBackend

    backends = []
    monkeypatch.setattr(test_pool, "HostBackend", lambda **kw: backends.append(HostBackend(**kw)) or backends[-1])
    real_cat = torch.cat

    def device_cat(tensors, *a, **kw):
        need = sum(t.numel() * t.element_size() for t in tensors)
        if any((b.free_bytes() or 0) < need for b in backends if b.capacity is not None):
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {need} bytes")
        return real_cat(tensors, *a, **kw)

    monkeypatch.setattr(torch, "cat", device_cat)
    row = 2 * LAYERS * 2 * 64 * 2
    with caplog.at_level("WARNING", logger=controller.__name__):
        bed = Bed(free_bytes=ELASTIC * row, margin_mb=0)  # before: torch.OutOfMemoryError from the warm-up lend
        assert bed.ctl is not None and bed.ctl.lendable_tokens == ELASTIC
        assert bed.alloc.lent_tokens == 0 and bed.pool.arena.lent_steps == 0 and bed.be.free_bytes() == ELASTIC * row
        assert bed.alloc.available_size() == BASE - 1  # the base's free ids, none twice, none lent
        assert sorted(bed.alloc.free_pages.tolist()) == list(range(1, BASE))
        warned = [r.getMessage() for r in caplog.records if "free list" in r.getMessage()]
        assert len(warned) == 1 and "rolled them back (--elastic-kv-margin-mb 0" in warned[0]
        assert bed.admit(list(range(20)))
        for _ in range(200):  # decode-only steps: a lend after every 32 (the base holds the request's 220 tokens)
            bed.ctl.after_prefill(None, bed.batch)
            assert bed.decode()
    assert bed.ctl.disabled and bed.alloc.lent_tokens == 0 and bed.pool.arena.lent_steps == 0
    assert sum("free list" in r.getMessage() for r in caplog.records) == 3  # the warm-up's and two more: then lending is off
    assert any(r.levelname == "ERROR" and "lending is off" in r.getMessage() for r in caplog.records)
    bed.check_ownership_and_accounting()
    # with room for the list the same lend goes through, from the list made before the agreement
    monkeypatch.setattr(torch, "cat", real_cat)
    roomy = Bed(free_bytes=ELASTIC * row + 2**20, margin_mb=1)
    made = []
    real_prepare = roomy.alloc.prepare_lend
    roomy.alloc.prepare_lend = lambda n: made.append(real_prepare(n)) or made[-1]
    assert roomy.ctl.lend() == ELASTIC and sorted(roomy.alloc.free_pages.tolist()) == list(range(1, BASE + ELASTIC))
    assert len(made) == 1 and roomy.alloc.free_pages.data_ptr() == made[0].data_ptr()  # the list made before the agreement


def test_repeated_out_of_memory_lends_stop_lending(caplog):
    """Issue 22, defect 3: with a device that runs out at half the step the
    pool tried again every 32 decode-only steps (10 times in 320), each time
    taking all free memory before rolling back, with warnings only. It stops
    after three lends in a row found no memory, with one error. (Since the
    one-step re-cut, half the step free is lent as a smaller step; here
    less than one token quantum is free.)"""
    from sglang_elastic.sched import controller

    row = 2 * LAYERS * 2 * 64 * 2
    bed = Bed(free_bytes=ELASTIC * row, margin_mb=0)
    assert bed.ctl.lendable_tokens == ELASTIC
    # something else took all of it but half a token quantum (with half of it free, the lend cuts its step to that
    # half since the H200 run of 2026-12-04: test_fast_lend's one-step re-cut)
    bed.be.capacity = sum(bed.be._handle_bytes.values()) + bed.pool.arena.quantum * row // 2
    assert bed.admit(list(range(20)))
    creates = bed.be.calls["create"]
    with caplog.at_level("WARNING", logger=controller.__name__):
        for _ in range(320):
            bed.ctl.after_prefill(None, bed.batch)
    # since issue 22's build 2 a lend measures the free memory and tries no handle it cannot back
    # (before: one create per lend until the driver refused; before defect 3's fix, 10 of them)
    assert bed.be.calls["create"] - creates == 0
    assert bed.ctl.disabled and bed.alloc.lent_tokens == 0
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [f"sglang-elastic: 3 lends in a row found no device memory for {ELASTIC * row / 2**30:.2f} GiB; lending is off"]
    bed.check_ownership_and_accounting()


def _decode_runner(**kw):
    """The fields SGLang's DecodeCudaGraphRunner.can_run_graph reads, as a
    runner with 256 captured sizes and no LoRA, spec or DP attention has them."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    fields = dict(ragged_verify_mode=False, captured_req_width=1, require_mlp_tp_gather=False, disable_padding=False, max_bs=256,
                  require_mlp_sync=False, is_encoder_decoder=False, enable_two_batch_overlap=False, enable_pdmux=False,
                  model_runner=types.SimpleNamespace(spec_algorithm=SpeculativeAlgorithm.NONE),
                  _make_graph_key=lambda *a, **k: None, _resolve_lora_variant=lambda fb: None)
    fields.update(kw)
    return types.SimpleNamespace(**fields)


def test_sglangs_decode_graphs_refuse_batches_below_max_bs_with_embedding_overrides_tbo_or_an_encoder_without_input():
    """Issue 22, defect 5, confirmed from SGLang's own can_run_graph: these
    decode batches of 8 requests (max_bs 256) run eagerly, so their
    activations come from memory the pool lends."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    def fb(**kw):
        f = dict(replace_embeds=None, spec_info=None, batch_size=8, forward_mode=ForwardMode.DECODE, encoder_lens=None, can_run_tbo=True,
                 input_ids=torch.zeros(8))
        f.update(kw)
        return types.SimpleNamespace(**f)

    can_run = DecodeCudaGraphRunner.can_run_graph
    assert can_run(_decode_runner(), fb())
    assert not can_run(_decode_runner(), fb(replace_embeds=torch.zeros(1, 16)))
    assert not can_run(_decode_runner(enable_two_batch_overlap=True), fb(can_run_tbo=False))
    assert not can_run(_decode_runner(is_encoder_decoder=True), fb(encoder_lens=torch.tensor([5, 0, 5, 5, 5, 5, 5, 5])))
    # SGLang keeps the prefill's replace_embeds on the batch into its decodes (0.5.17 clears input_embeds only)
    import inspect

    src = inspect.getsource(ScheduleBatch.prepare_for_decode)
    assert "self.input_embeds = None" in src and "replace_embeds" not in src


def test_no_lend_while_the_decode_batch_carries_token_embedding_overrides():
    bed = Bed()
    assert bed.admit(list(range(10)))
    bed.batch.replace_embeds = torch.zeros(2, 16)  # left on the batch by the prefill that built it
    for _ in range(3 * bed.ctl.cfg.lend_after_steps):
        bed.ctl.after_prefill(None, bed.batch)
    assert bed.alloc.lent_tokens == 0, "lent under a decode batch that runs without a graph"
    bed.batch.replace_embeds = None
    for _ in range(bed.ctl.cfg.lend_after_steps):
        bed.ctl.after_prefill(None, bed.batch)
    assert bed.alloc.lent_tokens == ELASTIC


def test_with_two_batch_overlap_or_an_encoder_decoder_model_only_the_margin_bounds_the_lent_batch():
    import sglang_elastic
    from sglang.srt.server_args import ServerArgs

    model = os.path.join(os.path.dirname(sglang_elastic.__file__), "models", "llama-3.1-8b")
    tbo = ServerArgs(model_path=model, device="cuda", enable_two_batch_overlap=True)
    assert tbo.cuda_graph_config.decode.max_bs == 160  # the graphs SGLang captures for it
    assert lend_max_batch(tbo, 1024) == 0 and lend_max_batch(tbo, 8192) == 5034  # the eager estimate's bound only
    plain = ServerArgs(model_path=model, device="cuda", cuda_graph_max_bs_decode=256)
    assert lend_max_batch(plain, 1024) == 256 and lend_max_batch(plain, 1024, encoder_decoder=True) == 0
    bed = Bed(encoder_decoder=True)  # the controller reads the model config
    assert bed.ctl.lend_max_bs == 0
    assert bed.admit(list(range(10)))
    for _ in range(3 * bed.ctl.cfg.lend_after_steps):
        bed.ctl.after_prefill(None, bed.batch)
    assert bed.alloc.lent_tokens == 0


def test_v1_loads_and_the_kv_events_report_the_capacity_their_token_usage_divides_by():
    """Issue 22, defect 5: /v1/loads (SchedulerLoadInquirer.get_loads) and
    the KV-events publisher kept the base max_total_num_tokens while the pool
    stats' token_usage divides by the lent size; kv_active_blocks
    (token_usage x max_total_num_tokens) was wrong by that ratio."""
    import zmq
    from sglang.srt.managers.io_struct import sock_recv
    from sglang.srt.managers.scheduler_components.kv_events_publisher import SchedulerKvEventsPublisher
    from sglang.srt.managers.scheduler_components.load_inquirer import SchedulerLoadInquirer
    from sglang.srt.observability.metrics_collector import SchedulerStats
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    bed = Bed()
    stats = SchedulerStats()
    none = lambda: None  # noqa: E731
    bed.sched.load_inquirer = SchedulerLoadInquirer(
        disaggregation_mode=DisaggregationMode.NULL, ps=types.SimpleNamespace(dp_rank=None), server_args=bed.sched.server_args,
        max_total_num_tokens=BASE - 1, max_running_requests=16, pool_stats_observer=bed.sched.pool_stats_observer,
        tp_worker=types.SimpleNamespace(), token_to_kv_pool_allocator=bed.alloc, spec_algorithm=SpeculativeAlgorithm.NONE,
        get_running_batch=lambda: bed.batch, get_waiting_queue=lambda: bed.sched.waiting_queue, get_stats=lambda: stats,
        get_chunked_req=none, get_disagg_prefill_bootstrap_queue=none, get_disagg_prefill_inflight_queue=none,
        get_disagg_decode_prealloc_queue=none, get_disagg_decode_transfer_queue=none, get_spec_total_num_accept_tokens=lambda: 0,
        get_spec_total_num_forward_ct=lambda: 0, get_total_prefill_uncached_tokens=lambda: 0, get_total_prefill_busy_us=lambda: 0,
        get_decode_moment_totals=lambda: [0.0] * 6)
    ctx = zmq.Context.instance()
    rx, tx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    rx.bind("inproc://kv-metrics")
    tx.connect("inproc://kv-metrics")
    ps = types.SimpleNamespace(pp_rank=0, attn_tp_rank=0, attn_cp_rank=0, attn_dp_size=1, attn_dp_rank=0, dp_rank=None)
    bed.sched.kv_events_publisher = SchedulerKvEventsPublisher(
        kv_events_config=None, ps=ps, attn_tp_rank=0, attn_cp_rank=0, attn_dp_rank=0, dp_rank=None,
        tree_cache=bed.tree, send_metrics_from_scheduler=tx, max_running_requests=16, max_total_num_tokens=BASE - 1, get_stats=lambda: stats)
    # on, as --kv-events-config turns it on (SGLang 0.5.17's "null" publisher cannot be built from a config: it takes no arguments)
    bed.sched.kv_events_publisher.enable_kv_cache_events = True
    try:
        bed.ctl.lend()
        assert bed.admit(list(range(300)))  # 300 used tokens: more than the base holds
        snap = bed.sched.load_inquirer.get_loads()
        assert snap.num_used_tokens == 300 and snap.max_total_num_tokens == bed.alloc.size == BASE - 1 + ELASTIC
        assert round(snap.token_usage * snap.max_total_num_tokens) == snap.num_used_tokens
        bed.sched.pool_stats_observer.get_pool_stats().update_scheduler_stats(stats)  # as SGLang's metrics reporter does
        bed.sched.kv_events_publisher.emit_kv_metrics()
        kv = sock_recv(rx)
        assert kv.kv_total_blocks == bed.alloc.size
        assert abs(kv.kv_active_blocks - 300) <= 0.005 * bed.alloc.size + 1  # token_usage is rounded to 2 digits
        bed.finish(0)
        bed.ctl.reclaim(bed.batch)
        assert bed.sched.load_inquirer.get_loads().max_total_num_tokens == BASE - 1  # back to the base
    finally:
        rx.close()
        tx.close()


@pytest.mark.parametrize("mode", ["dynamic", "always-lent"])
def test_a_tree_cache_the_reclaim_cannot_vacate_turns_lending_off_with_one_line(mode, caplog):
    """Issue 22, defect 5, confirmed: SGLang's unified radix tree
    (SGLANG_ENABLE_UNIFIED_RADIX_TREE; the C++ tree likewise) has no
    evictable_leaves and keeps its ids in components, so the start-up warm-up
    reclaim failed with an AttributeError (and always-lent lent without a
    way back). The flag is refused at start-up (test_config.py); if such a
    tree is built anyway, the controller lends nothing and says why."""
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from sglang_elastic.sched import controller

    assert not hasattr(UnifiedRadixCache, "evictable_leaves")

    def unified(params):
        params.tree_components = (ComponentType.FULL,)  # as SGLang's _create_unified_radix_cache sets them
        return UnifiedRadixCache(params)

    with caplog.at_level("INFO", logger=controller.__name__):
        bed = Bed(tree=unified, mode=mode)
    assert bed.ctl.disabled and bed.alloc.lent_tokens == 0 and bed.be.calls.get("unmap", 0) == 0  # nothing was lent
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].exc_info is None
    assert "UnifiedRadixCache" in errors[0].getMessage() and "lending is off" in errors[0].getMessage()


def _graph_args(**kw):
    """SGLang's resolved ServerArgs for the embedded Llama-3.1-8B shape on a
    GPU: decode graphs up to 32 requests, 8,192-token chunks, SGLang's
    default breakable prefill graphs on CUDA captured up to the chunk (named:
    without a GPU SGLang would pick tc_piecewise)."""
    import sglang_elastic
    from sglang.srt.server_args import ServerArgs

    kw = {"cuda_graph_max_bs_decode": 32, "chunked_prefill_size": 8192, "cuda_graph_backend_prefill": Backend.BREAKABLE, **kw}
    return ServerArgs(model_path=os.path.join(os.path.dirname(sglang_elastic.__file__), "models", "llama-3.1-8b"), device="cuda", **kw)


def test_prefill_graphs_hold_is_sglangs_own_rule_for_dropping_the_prefill_reserve(monkeypatch):
    """Issue 22, build 1: a prefill reclaims nothing when SGLang's prefill
    graphs capture the largest prefill buffer: the condition under which
    SGLang's post-capture KV sizing keeps no prefill activation reserve."""
    from sglang_elastic.sched.controller import prefill_graphs_hold

    monkeypatch.setenv("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING", "1")  # only to ask SGLang's own rule below
    held = _graph_args()
    assert held.cuda_graph_config.prefill.backend == Backend.BREAKABLE and max(held.cuda_graph_config.prefill.bs) == 8192
    eager = _graph_args(cuda_graph_backend_prefill=Backend.DISABLED)
    short = _graph_args(chunked_prefill_size=16384, cuda_graph_max_bs_prefill=8192)  # chunks above the largest captured size
    assert max(short.cuda_graph_config.prefill.bs) == 8192 < short.max_prefill_buffer_tokens()
    for args, want in ((held, True), (eager, False), (short, False)):
        assert prefill_graphs_hold(args) is want
        assert args.post_capture_kv_sizing_planned() is want  # SGLang agrees
    lora = types.SimpleNamespace(cuda_graph_config=held.cuda_graph_config, chunked_prefill_size=8192, enable_lora=True,
                                 max_prefill_buffer_tokens=held.max_prefill_buffer_tokens)
    assert not prefill_graphs_hold(lora)  # LoRA prefills replay eagerly


def test_with_prefill_graphs_a_prefill_reclaims_nothing_and_one_the_graphs_refuse_reclaims():
    bed = Bed(server_args=_graph_args())
    assert bed.ctl.prefill_in_graphs
    assert bed.admit(list(range(10)))
    bed.ctl.lend()
    bed.sched.waiting_queue.append(bed.request(list(range(500, 600))))
    bed.ctl.before_prefill(bed.batch)  # the graphs hold this prefill's activations
    assert bed.alloc.lent_tokens == ELASTIC and bed.ctl.cycles == 0
    bed.ctl.after_prefill(None, bed.batch)  # no prefill formed this pass: not counted
    bed.ctl.before_prefill(bed.batch)
    bed.ctl.after_prefill(bed.batch, bed.batch)  # SGLang formed the prefill batch: one reclaim skipped
    assert bed.alloc.lent_tokens == ELASTIC and bed.ctl.reclaims_skipped == 1 and bed.ctl.state()["reclaims_skipped"] == 1
    for _ in range(bed.ctl.cfg.lend_after_steps):  # and a lend is not held back by a waiting request then
        bed.ctl.after_prefill(None, bed.batch)
    assert bed.alloc.lent_tokens == ELASTIC
    embeds = bed.request(list(range(700, 720)))
    embeds.input_embeds = [[0.0] * 16] * 20  # SGLang's prefill graphs refuse input embeddings (can_replay_locally)
    bed.sched.waiting_queue.append(embeds)
    bed.ctl.before_prefill(bed.batch)
    assert bed.alloc.lent_tokens == 0 and bed.ctl.cycles == 1 and bed.ctl.reclaims_skipped == 1
    bed.sched.waiting_queue.clear()
    bed.ctl.lend()
    logprobs = bed.request(list(range(800, 820)))
    logprobs.return_logprob = True  # its logits tail runs eagerly: up to the chunk's tokens x the vocabulary
    bed.sched.waiting_queue.append(logprobs)
    bed.ctl.before_prefill(bed.batch)
    assert bed.alloc.lent_tokens == 0 and bed.ctl.cycles == 2
    bed.check_ownership_and_accounting()


def test_a_decode_batch_that_outgrows_the_graphs_after_a_prefill_without_reclaim_is_reclaimed_for():
    bed = Bed(server_args=_graph_args(cuda_graph_max_bs_decode=2), margin_mb=0)
    assert bed.ctl.lend_max_bs == 2
    assert bed.admit(list(range(10)))
    bed.ctl.lend()
    bed.sched.waiting_queue.append(bed.request(list(range(100, 110))))
    bed.ctl.before_prefill(bed.batch)  # 1 running + 1 waiting: the decode graphs hold the next batch
    assert bed.alloc.lent_tokens == ELASTIC
    assert bed.admit(list(range(100, 110)), req=bed.sched.waiting_queue.pop())  # SGLang's prefill, on lent memory
    bed.sched.waiting_queue.append(bed.request(list(range(200, 210))))
    bed.ctl.before_prefill(bed.batch)  # 2 running + 1 waiting: the batch after it would run eagerly
    assert bed.alloc.lent_tokens == 0
    bed.ctl.lend()
    assert bed.admit(list(range(200, 210)), req=bed.sched.waiting_queue.pop())  # a batch of 3 (as after a skipped reclaim)
    bed.ctl.before_prefill(bed.batch)  # nothing waits, but the next decode runs eagerly
    assert bed.alloc.lent_tokens == 0
    bed.check_ownership_and_accounting()


def test_an_eager_prefill_reclaims_only_the_steps_sglangs_estimate_needs():
    """Issue 22, build 1: with eager prefill the reclaim frees what SGLang's
    activation estimate for a chunk needs beyond the memory free now, in
    whole steps from the top; the lower steps stay lent and untouched."""
    from sglang_elastic.sched.controller import eager_activation_bytes

    row = 2 * LAYERS * 2 * 64 * 2
    bed = Bed(server_args=_graph_args(cuda_graph_backend_prefill=Backend.DISABLED), free_bytes=ELASTIC * row, margin_mb=0)
    bed.ctl.lendable_tokens = bed.pool.arena.set_steps(ELASTIC, 64)  # two steps of 64 tokens
    assert bed.ctl.lend() == ELASTIC and bed.pool.arena.lent_steps == 2
    bed.finish(bed.admit(list(range(20000, 20200))))  # 200 base tokens cached, evictable
    b = bed.admit(list(range(1000, 1150)))  # 55 base and 95 lent tokens: both steps
    row_b = bed.rows()[b.rid]
    top = bed.alloc.base_tokens + 64
    assert int(row_b.max()) >= top
    kept = row_b[(row_b >= bed.alloc.base_tokens) & (row_b < top)]
    k = bed.kv_of(row_b)
    # the device has all but half a step of what an 8,192-token eager prefill needs
    need = eager_activation_bytes(8192)
    bed.be.capacity = sum(bed.be._handle_bytes.values()) + need - bed.pool.arena.step_bytes() // 2
    assert bed.sched.server_args.chunked_prefill_size == 8192
    bed.sched.waiting_queue.append(bed.request(list(range(5000, 5000 + 9000))))  # a prompt longer than a chunk
    bed.ctl.before_prefill(bed.batch)
    assert bed.alloc.lent_tokens == 64 and bed.pool.arena.lent_steps == 1  # one step back, one still lent
    after = bed.rows()[b.rid]
    assert int(after.max()) < top and torch.equal(bed.kv_of(after), k)
    assert torch.equal(after[(after >= bed.alloc.base_tokens)], kept)  # ids in the kept step did not move
    bed.check_ownership_and_accounting()
