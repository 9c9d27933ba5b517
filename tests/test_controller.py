"""The scheduler-side controller: lend, reclaim (evict, migrate, retract,
remap), on SGLang's real RadixCache, ReqToTokenPool, Req, release paths
(``cache_unfinished_req``, ``release_kv_cache``, ``ScheduleBatch.release_req``)
and our pool on the host VMM backend.

SGLang's ``Scheduler`` itself needs a GPU model runner, so the controller gets
a shell holding the real components it reads (the attributes the scheduler
has). ``ScheduleBatch``'s tensor fields belong to the forward pass, which does
not run here: :class:`Batch` keeps only its ``reqs`` when filtering.
"""

from __future__ import annotations

import os
import types
from array import array

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang.srt.managers.schedule_batch import Req, ReqKvInfo, ScheduleBatch
from sglang.srt.model_executor.cuda_graph_config import Backend, CudaGraphConfig, PhaseConfig
from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.common import release_kv_cache
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

    def __init__(self, fail_on=None, chunk_cache=False, stock_pool=False, graph_bs=32, margin_mb=1024):
        self.be, self.pool, self.alloc = make_pool(1, base=BASE, elastic=ELASTIC, step=64)
        if fail_on:
            self.be.fail_on = fail_on
        self.r2t = ReqToTokenPool(16, 1024, "cpu", False)
        params = CacheInitParams(disable=chunk_cache, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc, page_size=1)
        self.tree = ChunkCache(params) if chunk_cache else RadixCache(params)  # ChunkCache: --disable-radix-cache
        self.batch = Batch(reqs=[], req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc, tree_cache=self.tree)
        self.sched = types.SimpleNamespace(
            token_to_kv_pool_allocator=self.alloc, tree_cache=self.tree, req_to_token_pool=self.r2t, waiting_queue=[], chunked_req=None,
            running_batch=self.batch,
            tp_group=types.SimpleNamespace(world_size=2 if self.tp else 1, rank_in_group=self.tp[0] if self.tp else 0),
            tp_cpu_group=self.tp[1] if self.tp else None, metrics_reporter=types.SimpleNamespace(enable_metrics=False),
            invariant_checker=types.SimpleNamespace(max_total_num_tokens=BASE - 1), pool_stats_observer=types.SimpleNamespace(max_total_num_tokens=BASE - 1),
            server_args=types.SimpleNamespace(disaggregation_mode="null", speculative_num_draft_tokens=None,
                                              cuda_graph_config=CudaGraphConfig(decode=PhaseConfig(backend=Backend.FULL, max_bs=graph_bs))),
            new_token_ratio_tracker=types.SimpleNamespace(current=0.7),
        )
        self.sched._add_request_to_queue = lambda req, is_retracted=False: self.sched.waiting_queue.append(req)
        cfg = ElasticKVConfig(enabled=True, lend_bytes=ELASTIC * sum(self.pool.arena.row_bytes), margin_mb=margin_mb)
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
            k = torch.randn(len(ids), self.pool.head_num, self.pool.head_dim, generator=self.gen).bfloat16()
            self.pool.set_kv_buffer(layer(l), ids, k, -k)

    def admit(self, tokens) -> bool:
        req = Req(f"r{self.n}", "", array("q", tokens), SamplingParams(max_new_tokens=1 << 20))
        self.n += 1
        req.init_next_round_input(self.tree)  # SGLang's prefix match: prefix_indices, last_node, extend_range
        prefix = req.prefix_indices
        new = self.alloc.alloc(len(tokens) - len(prefix))
        if new is None or self.r2t.available_size() == 0:
            if new is not None:
                self.alloc.free(new)
            return False
        self.tree.inc_lock_ref(req.last_node)
        req.cache_protected_len = len(prefix)
        req.set_extend_range(len(prefix), len(tokens))  # as PrefillAdder does
        self.r2t.alloc([req])
        self.r2t.write((req.req_pool_idx, slice(0, len(tokens))), torch.cat((prefix, new)).to(torch.int32))
        self._write(new)
        req.kv = ReqKvInfo(kv_allocated_len=len(tokens), swa_evicted_seqlen=0)
        req.kv_committed_len = len(tokens)
        self.tree.cache_unfinished_req(req)
        self.batch.reqs.append(req)
        return True

    def decode(self) -> bool:
        locs = self.alloc.alloc(len(self.batch.reqs))
        if locs is None:
            return False
        for req, loc in zip(self.batch.reqs, locs.tolist()):
            self.r2t.req_to_token[req.req_pool_idx, req.kv.kv_allocated_len] = loc
            req.kv.kv_allocated_len += 1
            req.kv_committed_len += 1
            req.output_ids.append(int(torch.randint(0, 1000, (1,), generator=self.gen)))
        self._write(locs)
        return True

    def finish(self, i: int) -> None:
        req = self.batch.reqs.pop(i)
        release_kv_cache(req, self.tree)

    # -- what must hold ------------------------------------------------------
    def rows(self):
        return {r.rid: self.r2t.req_to_token[r.req_pool_idx, : r.kv.kv_allocated_len].to(torch.int64).clone() for r in self.batch.reqs}

    def k_of(self, ids):
        return torch.stack([self.pool.get_key_buffer(l)[ids] for l in range(LAYERS)])

    def check_ownership_and_accounting(self):
        a = self.alloc
        free = torch.cat((a.free_pages, a.release_pages)).tolist()
        tree_ids = [t for n in _nodes(self.tree) for t in n.value.tolist()]
        req_ids = [t for r in self.batch.reqs for t in self.r2t.req_to_token[r.req_pool_idx, r.cache_protected_len : r.kv.kv_allocated_len].tolist()]
        owned = free + tree_ids + req_ids
        assert len(owned) == len(set(owned)), "an id is owned twice"
        usable = set(range(1, a.usable_base_tokens)) | set(range(a.base_tokens, a.base_tokens + a.lent_tokens))
        assert set(owned) == usable, "owned and free ids must partition the backed ids"
        # SGLang's own invariant: available + evictable + protected + uncached == total
        leak, msg = SchedulerInvariantChecker._check_pool_invariant(
            "full", a.available_size(), self.tree.evictable_size(), self.tree.protected_size(), 0,
            self.sched.invariant_checker.max_total_num_tokens, len(req_ids))
        assert not leak, msg
        assert self.sched.invariant_checker.max_total_num_tokens == a.size == self.sched.pool_stats_observer.max_total_num_tokens


def _nodes(tree):
    if tree.is_chunk_cache():
        return
    stack = list(tree.root_node.children.values())
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
                               "lent_bytes": ELASTIC * sum(bed.pool.arena.row_bytes), "cycles": 0, "lending_disabled": False}
    assert bed.admit(list(range(100, 180)) + list(range(5000, 5090)))  # shares 80 tokens (radix), needs 90+ more: spills into the lent range
    for _ in range(5 if chunk_cache else 20):  # no shared prefix in a chunk cache: less room left
        assert bed.decode()
    rows = bed.rows()
    assert max(int(r.max()) for r in rows.values()) >= bed.alloc.base_tokens  # something really is lent
    k = {rid: bed.k_of(r) for rid, r in rows.items()}
    bed.finish(0)  # the first request finishes: its tokens go to the tree; base room appears
    bed.check_ownership_and_accounting()
    bed.ctl.reclaim(bed.batch)
    assert bed.alloc.lent_tokens == 0 and bed.pool.arena.lent_steps == 0
    assert bed.sched.waiting_queue == []  # nothing retracted: the base had room
    for rid, r in bed.rows().items():
        assert int(r.max()) < bed.alloc.base_tokens
        assert torch.equal(bed.k_of(r), k[rid]), "K bytes changed across the migration"
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
            k = {rid: bed.k_of(r) for rid, r in rows.items()}
            bed.ctl.reclaim(bed.batch)
            retracted = {r.rid for r in bed.sched.waiting_queue}
            for rid, r in bed.rows().items():
                assert rid not in retracted
                assert int(r.max()) < bed.alloc.base_tokens
                assert torch.equal(bed.k_of(r), k[rid])
            bed.sched.waiting_queue.clear()
        bed.check_ownership_and_accounting()


def _raise_injected(*a, **k):
    raise RuntimeError("injected")


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
        out.put((rank, warm_up_failed, warm_up_raised, cannot_map, fell_back))
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
    assert res == [(r, (True, 0), (True, 0), (0, True, 0, 0), None) for r in range(world)]


def test_a_reclaim_also_moves_the_chunked_request_held_out_of_the_running_batch():
    bed = Bed()
    assert bed.admit(list(range(230)))
    bed.ctl.lend()
    assert bed.admit(list(range(1000, 1060)))  # 25 base + 35 lent tokens
    chunked = bed.batch.reqs.pop()  # SGLang keeps the chunked request out of the batch between chunks
    bed.sched.chunked_req = chunked
    before = bed.r2t.req_to_token[chunked.req_pool_idx, :60].to(torch.int64).clone()
    k = bed.k_of(before)
    bed.finish(0)
    bed.ctl.reclaim(bed.batch)
    after = bed.r2t.req_to_token[chunked.req_pool_idx, :60].to(torch.int64)
    assert int(before.max()) >= bed.alloc.base_tokens > int(after.max())
    assert torch.equal(bed.k_of(after), k)
    assert int(chunked.prefix_indices.max()) < bed.alloc.base_tokens
