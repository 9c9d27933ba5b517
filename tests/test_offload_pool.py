"""The offload pool and decode step on real SGLang classes (CPU).

``OffloadKVPool`` is SGLang's ``MHATokenToKVPool`` with a host V tier; K/V
are written through SGLang's own ``set_kv_buffer``. A request lifecycle is
simulated as SGLang's scheduler drives it (chunked prefill, decode steps,
finish, a new request in the same row) and every decode output is checked
against the policy's float64 reference over the full history, and the host
tier against the all-resident reference bit for bit.
"""

from __future__ import annotations

import dataclasses
import types

import torch.utils._python_dispatch

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_elastic.offload import copytime
from sglang_elastic.offload.decode import OffloadDecoder, SplitConfig
from sglang_elastic.offload.policy import OffloadPolicy, attend_reference
from sglang_elastic.offload.pool import OffloadKVPool, OffloadLayout

L, HQ, HKV, D = 3, 4, 2, 32
# dense_chunk_mean=0: the all-dense cases below name their fixed minimum chunks (chunk_mean has its own case)
SPLIT = SplitConfig(scores_max_splits=4, scores_min_chunk=128, attend_max_splits=2, attend_min_chunk=32, select_block_n=128, select_parts=2,
                    dense_chunk_mean=0)


def bf16_close(got, want):
    """Equal up to one bf16 rounding step: a decode step's chunk mean is summed
    in another order than torch's ``mean`` (``chunk_mean_run``), a prefill's is torch's."""
    g, w = got.float(), want.float()
    return bool(((g - w).abs() <= w.abs() * 2 ** -7 + 1e-30).all()) and not torch.isnan(g).any()


def layer(i):
    return types.SimpleNamespace(layer_id=i, k_scale=None, v_scale=None)


def make_pool(policy, resident=False, size=7000, rows=5, hot=32, ctx=1200, eviction="lru", hot_page=8, slack=2.0, keep_v=False,
              slack_max=0.0, hint_by_row=False):
    lay = OffloadLayout(policy, hot_tokens=hot, request_rows=rows, stage_tokens=ctx, resident_v=resident, eviction=eviction,
                        hot_page=hot_page, hot_slack=slack, keep_v=keep_v, hot_slack_max=slack_max, hint_by_row=hint_by_row)
    return OffloadKVPool(size, 1, torch.bfloat16, HKV, D, L, "cpu", False, enable_alt_stream=False, layout=lay, pin_memory=False)


class Sim:
    """A scheduler's view: request rows, their token ids (req_to_token), and
    every K/V ever written (the reference's history)."""

    def __init__(self, pool, seed, ctx=1200, split=SPLIT):
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.pool = pool
        rows = pool.layout.request_rows
        perm = (torch.randperm(pool.size, generator=g) + 1).to(torch.int32)  # ids 1..size (0: SGLang's padding slot)
        self.r2t = perm[: rows * ctx].view(rows, ctx).clone()
        self.free = perm[rows * ctx:].tolist()  # ids no row holds
        self.ctx = ctx
        self.k = torch.zeros(L, rows, ctx, HKV, D, dtype=torch.bfloat16)  # history by (layer, row, position)
        self.v = torch.zeros(L, rows, ctx, HKV, D, dtype=torch.bfloat16)
        self.dec = OffloadDecoder(pool.layout, HQ, HKV, D, max_bs=4, token_capacity=4 * ctx, device="cpu", split=split, prefetch=True)
        self.guess = None  # prefetch: f(q of the next layer) -> the guessed query, or None: no prefetch
        self.keep = set()  # keep_v: rows whose V goes to pool slots too (taken from the free ids, as SGLang's allocator lends them)
        self.async_host = True  # decode steps write host V from the ring rows after the store (the backend's way); False: in the store
        self.stage = True  # a prefill with a prefix stages it per layer (the backend's way); False: the rebuild left out

    def _keep(self, r, start, n):
        """As :meth:`KeepV.on_extend` and ``on_decode`` grant: positions ``[have, start + n)`` of a row in
        ``keep`` (``have``: its kept positions, 0 for a new row, also one whose prefix another row computed)."""
        if r in self.keep:
            have = self.pool.keep_len_cpu[r]
            if have != start:
                self.pool.set_keep(r, 0, None)
                have = 0
            ids, self.free = self.free[: start + n - have], self.free[start + n - have:]
            self.pool.set_keep(r, have, torch.tensor(ids, dtype=torch.int64))

    def kept(self, r, length):
        return self.pool.keep_v and self.pool.keep_len_cpu[r] >= length

    def new_request(self, r, prefix_of=None, prefix=0):
        """Row ``r`` gets a new request: its old ids go back to the free list (those no other row
        holds), fresh ones come (as SGLang's allocator does). ``prefix_of``: its first ``prefix``
        positions are row ``prefix_of``'s token ids, K and V (a prefix SGLang's radix cache matched)."""
        others = set(self.r2t[[i for i in range(self.r2t.shape[0]) if i != r]].flatten().tolist())
        self.free += [i for i in self.r2t[r].tolist() if i not in others]
        ids, self.free = self.free[: self.ctx - prefix], self.free[self.ctx - prefix:]
        self.r2t[r, prefix:] = torch.tensor(ids, dtype=torch.int32)
        if prefix:
            self.r2t[r, :prefix] = self.r2t[prefix_of, :prefix]
            self.k[:, r, :prefix], self.v[:, r, :prefix] = self.k[:, prefix_of, :prefix], self.v[:, prefix_of, :prefix]

    def extend(self, reqs, spans):
        """One prefill batch: request rows ``reqs``, positions ``[a, b)`` each."""
        pool = self.pool
        pool.flush_releases()
        rows = torch.tensor(reqs, dtype=torch.int32)
        pre = [a for a, _ in spans]
        ext = [b - a for a, b in spans]
        new = [r for r, p in zip(reqs, pre) if p == 0]
        if new:
            pool.reset_requests(torch.tensor(new))
        for r, (a, b) in zip(reqs, spans):
            self._keep(r, a, b - a)
        pool.set_host_writes_async(False)
        vrows = pool.extend_v_rows(rows, pre, ext)
        keep_rows = pool.extend_keep_rows(rows, pre, ext)
        pool.set_summary_plan(pool.plan_extend_summaries(rows, pre, ext, self.r2t))
        locs = pool.plan_prefix(rows, pre, ext, self.r2t)  # as the backend: the prefixes staged per layer
        own = torch.cat([torch.full((b - a,), r) for r, (a, b) in zip(reqs, spans)])
        pos = torch.cat([torch.arange(a, b) for a, b in spans])
        for l in range(L):
            k, v = torch.randn(len(pos), HKV, D, generator=self.g).bfloat16(), torch.randn(len(pos), HKV, D, generator=self.g).bfloat16()
            if locs is not None and self.stage:
                pool.stage_layer(l, locs)
            pool.set_v_rows(vrows, keep_rows)
            pool.set_kv_buffer(layer(l), self.r2t[own, pos].long(), k, v)
            self.k[l, own, pos], self.v[l, own, pos] = k, v

    def run(self, reqs, lens, steps, **kw):
        """``steps`` decode steps in a row from lengths ``lens`` (before the first new token):
        ``(lens after, every step's outputs, the worst relative error)``."""
        outs, worst = [], 0.0
        for _ in range(steps):
            lens = [x + 1 for x in lens]
            o, w = self.decode(reqs, lens, **kw)
            outs += o
            worst = max(worst, w)
        return lens, outs, worst

    def decode(self, reqs, lens, check=True, all_dense=False):
        """One decode step of requests ``reqs`` now ``lens`` long (the new token included);
        ``all_dense``: the all-dense plan (keep_v, every request kept; a padding entry may ride along)."""
        pool, dec = self.pool, self.dec
        pool.flush_releases()
        rp, seq = torch.tensor(reqs, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
        for r, n in zip(reqs, lens):
            if r and self.kept(r, n - 1):
                self._keep(r, n - 1, 1)
        dec.plan(self.r2t, rp, seq, len(reqs), keep=pool.keep_tables(), all_dense=all_dense)
        dec.grant_pages(pool)
        pool.set_summary_plan(dec.summary_plan(pool))
        pool.set_host_writes_async(self.async_host)  # as the backend: a decode step's host V copied from the ring rows
        outs, worst = [], 0.0
        timer = getattr(self, "timer", None)  # --kv-offload-copy-timing's events, as the backend records them
        if timer is not None:
            timer.poll()
            timer.begin("eager")
        step = [(torch.randn(len(reqs), HKV, D, generator=self.g).bfloat16(), torch.randn(len(reqs), HKV, D, generator=self.g).bfloat16(),
                 (2 * torch.randn(len(reqs), HQ, D, generator=self.g)).bfloat16()) for _ in range(L)]
        for l in range(L):
            k, v, q = step[l]
            nxt = l + 1
            if self.guess is not None and nxt < L and nxt in pool.sparse_layer_ids:  # before layer l runs: layer l+1's guessed rows
                dec.prefetch(self.guess(step[nxt][2]), pool.get_key_buffer(nxt), pool.get_value_buffer(nxt), D ** -0.5, self.r2t, rp, seq,
                             pool.hot_state(nxt), pool.host.view(nxt), record=pool.miss_record(nxt),
                             clock=timer and timer.clock(nxt, copytime.PREFETCH, main=False))
            pool.set_v_rows(dec.new_token_rows(), dec.new_token_keep_rows())
            pool.set_kv_buffer(layer(l), self.r2t[rp.long(), seq.long() - 1].long(), k, v)
            self.k[l, rp.long(), seq.long() - 1], self.v[l, rp.long(), seq.long() - 1] = k, v
            o = torch.full_like(q, float("nan"))
            kb, vb = pool.get_key_buffer(l), pool.get_value_buffer(l)
            if pool.layout.policy.is_dense_layer(l):
                dec.dense(q, kb, vb, o, D ** -0.5)
            elif all_dense:
                dec.dense_kept(q, kb, vb, o, D ** -0.5)
            elif pool.layout.resident_v:
                dec.sparse(q, kb, vb, o, D ** -0.5, self.r2t, rp, seq, v_summary=pool.summaries(l))
            else:  # as the backend: the first sparse layer records the step's misses for the adaptive hot pages
                dec.sparse(q, kb, vb, o, D ** -0.5, self.r2t, rp, seq, pool.hot_state(l), pool.host.view(l), v_summary=pool.summaries(l),
                           record=pool.miss_record(l, add=self.guess is not None), clock=timer and timer.clock(l, copytime.CRIT))
            outs.append(o.clone())
            if check:
                for b, r in enumerate(reqs):
                    if r == 0:  # SGLang's padding row (a CUDA-graph padding entry): its output is dropped
                        continue
                    pol = pool.layout.policy  # a request that keeps V attends to every position
                    pol = dataclasses.replace(pol, dense_layers=L) if self.kept(r, lens[b]) else pol
                    ref = attend_reference(q[b], self.k[l, r, : lens[b]], self.v[l, r, : lens[b]], pol, l)
                    err = float((o[b].double() - ref).abs().max() / ref.abs().max())
                    assert err == err, f"request row {r}, layer {l}: NaN in the output"  # max(worst, nan) would drop it
                    worst = max(worst, err)
        return outs, worst


def lifecycle(resident, seed=1, guess=None, hot=32, short=False, denominator="selected", eviction="lru", slack_max=0.0, timer=None,
              async_host=True):
    """Three requests, one prefilled in two chunks; four decode steps; request
    row 4 finishes and a new request takes it (its hot buffer must start empty).
    ``guess``: prefetch each sparse layer before the layer ahead of it runs.
    ``short``: three decode steps, no second request in row 4."""
    pol = OffloadPolicy(sink=2, window=8, budget_frac=0.05, max_topk=24, dense_layers=1, denominator=denominator, chunk=8)
    sim = Sim(make_pool(pol, resident, hot=hot, eviction=eviction, slack_max=slack_max), seed)
    sim.guess = guess
    sim.timer = timer
    sim.async_host = async_host
    sim.extend([1, 2, 4], [(0, 30), (0, 300), (0, 5)])
    sim.extend([2], [(300, 500)])
    lens, outs, worst = sim.run([1, 2, 4], [30, 500, 5], 3 if short else 4)
    if short:
        return outs, worst, sim
    # row 4 finishes; a new 400-token request takes row 4 (new token ids in its req_to_token row)
    sim.new_request(4)
    sim.extend([4], [(0, 400)])
    _, o, w = sim.run([1, 2, 4], [lens[0], lens[1], 400], 2)
    return outs + o, max(worst, w), sim


def test_a_decode_steps_host_v_copied_from_the_ring_rows_equals_the_store_writing_it_bit_for_bit():
    """The decode step's host V writes taken off the store (``set_host_writes_async``: copied from
    the new tokens' ring rows after the store, on a side stream on a GPU, inline here): the host
    tier ends holding every token's V of every sparse layer, bit-equal to the run whose store wrote
    the host itself, and the outputs and chunk means are the same bits."""
    outs_a, _, sim_a = lifecycle(resident=False, denominator="estimate", async_host=True)
    outs_s, _, sim_s = lifecycle(resident=False, denominator="estimate", async_host=False)
    assert all(torch.equal(a, b) for a, b in zip(outs_a, outs_s))
    pa, ps = sim_a.pool, sim_s.pool
    checked = 0
    for l in pa.sparse_layer_ids:
        for r, n in ((1, 36), (2, 506), (4, 402)):  # every position each request holds now, prompt and decoded
            ids = sim_a.r2t[r, :n].long()
            assert torch.equal(pa.host.view(l)[ids], sim_a.v[l, r, :n]) and torch.equal(ps.host.view(l)[ids], sim_s.v[l, r, :n])
            checked += n
        slots = pa.chunk_slot[[1, 2, 4]].flatten().long()  # the summaries the live requests own
        assert torch.equal(pa.vsum[l][slots], ps.vsum[l][slots])
    assert checked == 2 * (36 + 506 + 402)


def test_a_decode_step_forks_one_host_copy_per_sparse_layer_on_the_side_stream_and_joins_once(monkeypatch):
    """The GPU path of ``set_host_writes_async`` with recording stand-ins for CUDA streams: each
    sparse layer's store forks its host copy onto the pool's side stream (the side stream waits for
    the step's stream, the copy runs inside ``torch.cuda.stream(side)``, an eager ``loc`` is kept
    alive for it), the step's stream waits for the side stream once in ``join_host_writes`` and a
    second join does nothing; inside a capture no ``record_stream``; a prefill forks nothing."""
    import contextlib

    log = []

    class Stream:
        def __init__(self, name):
            self.name, self.device = name, "cpu"

        def wait_stream(self, other):
            log.append((self.name, "waits", other.name))

    cur, side = Stream("step"), Stream("side")
    active = [cur]

    @contextlib.contextmanager
    def on(stream):
        active.append(stream)
        try:
            yield
        finally:
            active.pop()

    capturing = [False]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: cur)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, st: log.append(("record", st.name)))
    import sglang_elastic.kernels.offload as kmod

    real_copy = kmod.copy_rows_run

    def copy(*a, **kw):
        if active[-1] is side:  # (the sparse layers' miss copies run on the step's stream)
            log.append(("copy on", "side"))
        return real_copy(*a, **kw)

    monkeypatch.setattr(kmod, "copy_rows_run", copy)
    pol = OffloadPolicy(sink=2, window=8, budget_frac=0.05, max_topk=24, dense_layers=1, denominator="estimate", chunk=8)
    sim = Sim(make_pool(pol), 3)
    sim.pool._host_stream = side
    sim.extend([1, 2], [(0, 40), (0, 90)])
    assert not [e for e in log if e[0] == "copy on"] and not sim.pool._host_pending  # a prefill writes the host in its store
    sim.decode([1, 2], [41, 91])
    fork = [("side", "waits", "step"), ("copy on", "side"), ("record", "side")]
    assert log == fork * len(sim.pool.sparse_layer_ids) and sim.pool._host_pending
    log.clear()
    sim.pool.join_host_writes()
    sim.pool.join_host_writes()
    assert log == [("step", "waits", "side")] and not sim.pool._host_pending
    log.clear()
    capturing[0] = True
    sim.decode([1, 2], [42, 92])
    assert ("record", "side") not in log and log.count(("copy on", "side")) == len(sim.pool.sparse_layer_ids)
    sim.pool.join_host_writes()
    for l in sim.pool.sparse_layer_ids:  # and the host holds the decoded tokens' V
        for r, n in ((1, 42), (2, 92)):
            assert torch.equal(sim.pool.host.view(l)[sim.r2t[r, :n].long()], sim.v[l, r, :n])


@pytest.mark.parametrize("denominator", ["selected", "estimate"])
def test_decode_through_the_host_tier_equals_the_resident_reference_bit_for_bit_and_the_policy(denominator):
    outs_off, worst_off, sim = lifecycle(resident=False, denominator=denominator)
    outs_res, worst_res, sim_res = lifecycle(resident=True, denominator=denominator)
    if denominator == "estimate":  # every complete chunk's summary is the mean of its V rows, in both pools
        pool, C = sim.pool, 8
        checked, live = 0, []
        for r, L in ((1, 36), (2, 506), (4, 402)):
            assert int(pool.slot_count[r]) == L // C
            live += pool.chunk_slot[r, : L // C].tolist()
            for l in pool.summary_layer_ids:
                for c in range(L // C):
                    want = sim.v[l, r, c * C:(c + 1) * C].float().mean(0).bfloat16()
                    got = pool.vsum[l][int(pool.chunk_slot[r, c])]
                    assert bf16_close(got, want), (r, l, c)
                    assert torch.equal(sim_res.pool.vsum[l][int(sim_res.pool.chunk_slot[r, c])], got)  # host tier = resident, bit for bit
                    checked += 1
        assert checked > 100
        # every live chunk owns one slot; the free stack holds the others (row 4's first request gave its chunk back)
        free = pool.slot_stack[: int(pool.slot_top)].tolist()
        assert len(set(live)) == len(live) == 4 + 63 + 50 and not set(live) & set(free)
        assert sorted(live + free) == list(range(pool.summary_slots)) and int(pool.slot_overflow) == 0
        # estimate moves the output away from the plain exact-denominator sum (the long request)
        full, _, _ = lifecycle(resident=False, denominator="full")
        assert not all(torch.equal(a, b) for a, b in zip(outs_off, full))
    assert worst_off < 1e-2 and worst_res < 1e-2  # bf16 kernels against the float64 policy reference
    assert all(torch.equal(a, b) for a, b in zip(outs_off, outs_res))
    hits, misses = sim.dec.stats.tolist()
    assert misses > 0  # the hot buffers were filled from the host rows


def test_least_selected_eviction_changes_copies_never_outputs():
    """``--kv-offload-eviction lfu`` (InfiniGen's rule) against LRU through the
    whole lifecycle (chunked prefill, a new request in a reused row): the
    same selections, so bit-identical outputs; only which rows hit may differ."""
    base, _, sim0 = lifecycle(resident=False, hot=24, short=True)
    outs, worst, sim = lifecycle(resident=False, hot=24, short=True, eviction="lfu")
    assert all(torch.equal(a, b) for a, b in zip(base, outs)) and worst < 1e-2
    assert sum(sim0.dec.stats.tolist()) == sum(sim.dec.stats.tolist()) > 0
    # the rule reached the swap-in kernel: lfu's slot_time packs (uses << 21) | last use, lru's is the last use alone
    # (equal outputs and equal hit + miss totals held with lru hard-wired in the decoder; new-user finding)
    assert int(sim.pool.slot_time.max()) >= 1 << 21 > int(sim0.pool.slot_time.max()) >= 0
    with pytest.raises(ValueError, match="lru or lfu"):
        make_pool(OffloadPolicy(), eviction="lifo")
    with pytest.raises(ValueError, match="21 bits"):
        OffloadLayout(OffloadPolicy(), hot_tokens=4096, request_rows=2, stage_tokens=1 << 21, eviction="lfu")


@pytest.mark.parametrize("prefetch", [False, True])
def test_adaptive_hot_pages_change_copies_never_outputs_and_go_back_with_the_row(prefetch):
    """``--kv-offload-hot-slack-max 4``: requests whose selection keeps missing (random queries
    here) grow their hot buffers past the base slack of 2; the outputs stay bit-identical to
    the fixed slack's through the whole lifecycle (chunked prefill, a finished request's row
    reused), fewer rows are copied, and a freed row's pages, slots and history go back. With
    the prefetch (a random guess), the record counts its loads too, so the buffers still grow."""
    g = torch.Generator().manual_seed(9)
    guess = (lambda q: (2 * torch.randn(q.shape, generator=g)).bfloat16()) if prefetch else None
    base, _, sim0 = lifecycle(resident=False, hot=96, short=False, guess=guess)
    g.manual_seed(9)
    outs, worst, sim = lifecycle(resident=False, hot=96, short=False, slack_max=4.0, guess=guess)
    assert all(torch.equal(a, b) for a, b in zip(base, outs)) and worst < 1e-2
    h0, m0 = sim0.dec.stats.tolist()
    h, m = sim.dec.stats.tolist()
    assert h0 + m0 == h + m and m < m0  # the same selections, fewer misses
    pool = sim.pool
    assert pool.adaptive and not sim0.pool.adaptive and sim0.pool.miss_record(1) is None
    assert int(pool.row_slack64[2]) > 128 and int(pool.hot_count[2]) > int(sim0.pool.hot_count[2])  # the long request grew
    assert int(pool.page_overflow) == 0 and int(pool.page_taken) == 0  # the pool never ran short here
    held = pool.hot_table[pool.hot_table >= 0].tolist()
    free = pool.page_stack[: int(pool.page_top)].tolist()
    assert sorted(held + free) == list(range(pool.hot_pages))
    assert (pool.slot_pos[:, 2] >= 0).any()
    pool.release_rows(torch.tensor([2]))
    assert int(pool.hot_count[2]) == 0 and int(pool.row_slack64[2]) == 128 and int(pool.row_steps[2]) == 0
    assert (pool.slot_pos[:, 2] == -1).all() and (pool.slot_time[:, 2] == -1).all()  # no stale slot for the row's next request
    assert int(pool.row_miss[2]) == int(pool.row_sel[2]) == 0
    with pytest.raises(ValueError, match="hot-slack-max must be 0"):
        make_pool(OffloadPolicy(max_topk=24), slack=2.0, slack_max=1.5)


@pytest.mark.parametrize("guess,hot", [("next-q", 32), ("random", 24)])
def test_prefetch_changes_copies_never_outputs(guess, hot):
    """InfiniGen's prefetch (a guessed query of the next layer, scored and
    copied ahead) leaves every output bit-identical to no prefetch, whether
    the guess is right (the next layer's own query: the exact pass then
    misses less) or wrong (random), also with a hot buffer no larger than
    the top-k (the prefetch loads only what has a victim)."""
    g = torch.Generator().manual_seed(9)
    fn = (lambda q: q) if guess == "next-q" else (lambda q: (2 * torch.randn(q.shape, generator=g)).bfloat16())
    base, _, sim0 = lifecycle(resident=False, hot=hot, short=True)
    outs, worst, sim = lifecycle(resident=False, guess=fn, hot=hot, short=True)
    assert all(torch.equal(a, b) for a, b in zip(base, outs)) and worst < 1e-2
    (h0, m0), (h1, m1) = sim0.dec.stats.tolist(), sim.dec.stats.tolist()
    assert h0 + m0 == h1 + m1  # the same selections
    spec_hits, spec_rows = sim.dec.spec.stats.tolist()
    assert spec_rows > 0
    if guess == "next-q" and hot == 32:
        assert m1 < m0 / 2  # the right guess leaves the exact pass few misses


def test_pool_shapes_keep_k_and_dense_v_for_every_token_and_only_hot_rows_of_sparse_v():
    pol = OffloadPolicy(sink=2, window=8, max_topk=24, dense_layers=1)
    pool = make_pool(pol)
    rows = pool.size + pool.page_size
    region = pool.layout.region_rows
    assert region == 2 + 8  # sink and window rows per request row; the LRU slots are pages
    # pages: the fewer of what 7,000 tokens' selections need (ceil((2 * 0.05 * 7000 + 5) / 8) + 5 = 94) and 5 rows x 4 pages
    assert pool.hot_pages == 20 and pool.hot_base == 5 * region and int(pool.page_top) == 20
    assert [tuple(b.shape) for b in pool.k_buffer] == [(rows, HKV, D)] * L
    assert tuple(pool.v_buffer[0].shape) == (rows, HKV, D)  # dense layer
    hot_rows = 5 * region + 20 * 8 + 1
    assert [tuple(b.shape) for b in pool.v_buffer[1:]] == [(hot_rows, HKV, D)] * 2
    assert tuple(pool.host.v_buffer.shape) == (2, rows, HKV, D)  # V of every token id of the sparse layers
    k, v = pool.get_kv_size_bytes()
    assert k == L * rows * HKV * D * 2 and v == (rows + 2 * hot_rows) * HKV * D * 2
    big = make_pool(pol, size=7000, rows=5, hot=4096, hot_page=64)  # long buffers allowed: the tokens bound the pages
    assert big.hot_pages == -(-(700 + 5) // 64) + 5 == 17 < 5 * 64
    resident = make_pool(pol, resident=True)
    assert resident.host is None and all(b.shape[0] == rows for b in resident.v_buffer)


def test_prefill_writes_sink_and_each_chunks_last_window_to_the_hot_buffer():
    pol = OffloadPolicy(sink=2, window=4, max_topk=8, dense_layers=0)
    pool = make_pool(pol, hot=8)
    R = pool.layout.region_rows
    rows = pool.extend_v_rows(torch.tensor([3, 1]), [0, 10], [9, 3]).tolist()
    # request row 3, positions 0..8: sink 0,1; ring for the last 4 (5..8) at 2 + p % 4; nothing for 2..4
    want3 = [3 * R + 0, 3 * R + 1, -1, -1, -1] + [3 * R + 2 + p % 4 for p in (5, 6, 7, 8)]
    # request row 1, positions 10..12 (a later chunk): all among its last 4
    want1 = [1 * R + 2 + p % 4 for p in (10, 11, 12)]
    assert rows == want3 + want1


def radix_hits(resident, denominator, stage=True, keep=(), seed=11, hint_by_row=False):
    """Rows 1 and 2 prefilled and decoding; then two new requests whose prefixes SGLang's radix cache
    matched in row 1 (its token ids, K and V): row 3 shares 250 positions and adds 5 (fewer than the
    window: its ring holds prefix positions), row 4 shares 203 (inside a chunk, which its 12 new tokens
    complete); four decode steps of all four, rows 1, 3 and 4 reading the same token ids.
    ``stage=False``: the prefill leaves the staging (and so the rebuild) out; ``keep``: rows that keep V;
    ``hint_by_row``: the hot buffers' hint per request row and position (the server's with the radix cache)."""
    pol = OffloadPolicy(sink=2, window=8, budget_frac=0.05, max_topk=24, dense_layers=1, denominator=denominator, chunk=8)
    sim = Sim(make_pool(pol, resident, keep_v=bool(keep), hint_by_row=hint_by_row), seed)
    sim.keep = set(keep)
    sim.extend([1, 2], [(0, 300), (0, 40)])
    lens, outs, worst = sim.run([1, 2], [300, 40], 2)
    sim.new_request(3, prefix_of=1, prefix=250)
    sim.new_request(4, prefix_of=1, prefix=203)
    sim.stage = stage
    sim.extend([3, 4], [(250, 255), (203, 215)])
    _, o, w = sim.run([1, 2, 3, 4], lens + [255, 215], 4)
    return outs + o, max(worst, w), sim


@pytest.mark.parametrize("denominator", ["selected", "estimate"])
def test_a_prefix_the_radix_cache_matched_is_rebuilt_in_the_new_row_and_decodes_as_the_policy_and_the_resident_reference(denominator):
    """A request whose prefix another request computed (SGLang's radix cache writes the cached token ids
    into its ``req_to_token`` row and prefills only the rest) gets the prefix's sink and ring rows and
    (``estimate``) V summaries in its own row from the staged prefix: every decode output matches the
    policy's float64 reference over the full history, and the host tier the all-resident reference bit
    for bit. Left out (no staging), the new rows read sink and ring rows and chunk means nobody wrote."""
    outs, worst, sim = radix_hits(False, denominator, hint_by_row=denominator == "estimate")  # the hint: either is exact
    outs_res, worst_res, _ = radix_hits(True, denominator)
    assert worst < 1e-2 and worst_res < 1e-2, (worst, worst_res)
    assert all(torch.equal(a, b) for a, b in zip(outs, outs_res))
    pool = sim.pool
    if denominator == "estimate":  # every complete chunk of the new rows: the mean of its V, one slot each
        C = 8
        for r, n in ((3, 259), (4, 219)):
            assert int(pool.slot_count[r]) == n // C
            for l in pool.summary_layer_ids:
                for c in range(n // C):
                    want = sim.v[l, r, c * C:(c + 1) * C].float().mean(0).bfloat16()
                    assert bf16_close(pool.vsum[l][int(pool.chunk_slot[r, c])], want), (r, l, c)
        live = pool.chunk_slot[[1, 2, 3, 4]][pool.chunk_slot[[1, 2, 3, 4]] != pool.ZERO].tolist()
        assert len(set(live)) == len(live) == sum(n // C for n in (304, 44, 259, 219)) and int(pool.slot_overflow) == 0
    _, worst_bare, _ = radix_hits(False, denominator, stage=False)
    assert worst_bare > 0.05, worst_bare


def test_a_kept_request_with_a_matched_prefix_keeps_the_prefix_v_copied_from_the_staging_buffer():
    """keep-v: a request whose prefix the radix cache matched takes kept slots for the prefix too; its
    prefill copies the staged prefix V there, so it attends densely (the float64 dense reference)
    from its first step, and each kept slot holds its position's V."""
    outs, worst, sim = radix_hits(False, "estimate", keep=(3,))
    pool = sim.pool
    assert sim.kept(3, 259) and pool.keep_len_cpu[3] == 259 and not sim.kept(4, 1)
    assert worst < 2e-2, worst
    for l in pool.sparse_layer_ids:
        assert torch.equal(pool.v_buffer[l][pool.req_to_vrow[3, :259].long()], sim.v[l, 3, :259])
    assert int(pool.hot_count[3]) == 0 and int(pool.hot_count[1]) > 0  # the kept row selects nothing
    _, worst_bare, _ = radix_hits(False, "estimate", stage=False, keep=(3,))
    assert worst_bare > 0.05, worst_bare


def test_staging_gathers_a_prefix_from_the_pool_and_the_host_rows():
    pol = OffloadPolicy(sink=2, window=4, max_topk=8, dense_layers=1)
    sim = Sim(make_pool(pol, hot=8), seed=4)
    sim.extend([1], [(0, 50)])
    locs = sim.r2t[1, :50].long()
    for l in range(L):
        sim.pool.stage_layer(l, locs)
        sim.pool.stage_active = True
        kst, vst = sim.pool.get_kv_buffer(l)
        sim.pool.stage_active = False
        assert torch.equal(kst[:50], sim.k[l, 1, :50])
        assert torch.equal(vst[:50], sim.v[l, 1, :50])
    assert sim.pool.get_kv_buffer(1)[1] is sim.pool.v_buffer[1]
    with pytest.raises(RuntimeError, match="staging"):
        sim.pool.stage_layer(1, torch.arange(1, 1202))


def recorded_hooks(register):
    """What ``register()`` hands SGLang's ``HookRegistry.register``: ``{target: [(hook, kind), ...]}``
    in registration order (a target may take several hooks), without applying any."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    seen = {}
    orig = HookRegistry.register
    try:
        HookRegistry.register = classmethod(lambda cls, target, fn, kind: seen.setdefault(target, []).append((fn, kind)))
        register()
    finally:
        HookRegistry.register = orig
    return seen


def hooked_req_free():
    """SGLang's ``ReqToTokenPool.free`` as the plugin's hook wraps it: the hook
    ``hooks.register`` gives, applied by SGLang's own ``HookRegistry`` wrapper."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.plugins.hook_registry import _wrap_fn

    from sglang_elastic.offload import hooks

    [(fn, kind)] = recorded_hooks(hooks.register)["sglang.srt.mem_cache.memory_pool.ReqToTokenPool.free"]
    return _wrap_fn(ReqToTokenPool.free, fn, kind)


def test_sglang_freeing_a_row_returns_its_summary_slots_through_the_hook():
    """A request SGLang frees (``release_kv_cache`` -> ``ReqToTokenPool.free``, which
    clears ``req.req_pool_idx``) gives its chunks' summary slots back at the next
    forward, before its row is ever reused: otherwise every idle row keeps its last
    request's slots, and a full pool's new chunks find none (``slot_overflow``: their
    estimate reads zeros)."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from sglang_elastic.offload import hooks

    free = hooked_req_free()
    pol = OffloadPolicy(sink=2, window=8, budget_frac=0.2, max_topk=10, dense_layers=1, denominator="estimate", chunk=8)
    pool = make_pool(pol, size=3000, rows=5, hot=12, ctx=200)
    sim = Sim(pool, seed=int(torch.randint(0, 2**16, ())), ctx=200)
    r2t_pool = ReqToTokenPool(size=4, max_context_len=200, device="cpu", enable_memory_saver=False)
    reqs = [types.SimpleNamespace(req_pool_idx=None) for _ in range(2)]
    rows = r2t_pool.alloc(reqs)
    hooks._BUILT["pool"] = pool
    try:
        sim.extend(rows, [(0, 123), (0, 77)])
        sim.decode(rows, [124, 78], check=False)
        assert int(pool.slot_top) == pool.summary_slots - 15 - 9
        free(r2t_pool, reqs[0])
        assert reqs[0].req_pool_idx is None and rows[0] in r2t_pool.free_slots  # SGLang's own free ran
        pool.flush_releases()  # what the next forward does first
        assert int(pool.slot_top) == pool.summary_slots - 9 and int(pool.slot_count[rows[0]]) == 0
        assert bool((pool.chunk_slot[rows[0]] == pool.ZERO).all())
        free(r2t_pool, reqs[1])
        pool.flush_releases()
        assert sorted(pool.slot_stack.tolist()) == list(range(pool.summary_slots)) and int(pool.slot_overflow) == 0
    finally:
        hooks._BUILT.pop("pool", None)


@pytest.mark.parametrize("denominator", ["estimate", "selected"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["admit", "decode", "finish", "retract"]), st.integers(0, 3), st.integers(20, 160)),
                min_size=4, max_size=14), st.integers(0, 2**16))
def test_random_admit_decode_finish_retract_keeps_slots_single_owned_and_hot_rows_equal_to_host(denominator, ops, seed):
    """Under any order of admissions (prefill), decode steps, finishes and
    retractions (SGLang frees the ids; the request is re-prefilled later from
    position 0): no LRU slot holds two positions of its request, and every
    held slot's device V row equals the host's V row of that position's token;
    (``estimate``) every complete chunk of a live request owns one summary
    slot holding its mean V, and every other slot is free again once SGLang
    freed the rows (``ReqToTokenPool.free``'s hook, flushed at the next forward);
    with every denominator, hot-buffer pages only on live rows (a review found
    a finished row keeping its pages under ``selected``)."""
    from sglang_elastic.offload import hooks

    pol = OffloadPolicy(sink=2, window=8, budget_frac=0.2, max_topk=10, dense_layers=1, denominator=denominator, chunk=8)
    # 5 rows x 200 ids, 2000 free for new requests; pages of 4 rows, 1.5 slots per selected row: up to 3 pages a request
    pool = make_pool(pol, size=3000, rows=5, hot=12, ctx=200, hot_page=4, slack=1.5)
    sim = Sim(pool, seed, ctx=200)
    hooks._BUILT["pool"] = pool
    live = {}  # request row -> length
    try:
        _run_ops(ops, sim, pool, live, hooked_req_free())
    finally:
        hooks._BUILT.pop("pool", None)


def _run_ops(ops, sim, pool, live, req_free):
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    r2t_pool = ReqToTokenPool(size=pool.layout.request_rows - 1, max_context_len=sim.ctx, device="cpu", enable_memory_saver=False)
    decoded = set()  # live rows that ran a decode step since their prefill
    for op, slot, n in ops:
        r = slot + 1
        if op == "admit" and r not in live:
            sim.new_request(r)
            sim.extend([r], [(0, n)])
            live[r] = n
        elif op == "decode" and live:
            reqs = sorted(live)
            lens = [min(live[q] + 1, 199) for q in reqs]
            sim.decode(reqs, lens, check=False)
            live.update(zip(reqs, lens))
            decoded |= set(reqs)
        elif op in ("finish", "retract") and r in live:
            del live[r]  # SGLang frees its ids; a retracted one re-prefills from position 0 when admitted again
            decoded.discard(r)
            req_free(r2t_pool, types.SimpleNamespace(req_pool_idx=r))  # SGLang's free, hooked
        pool.flush_releases()  # what the next forward does first
        owned = []
        for q, n_q in (live.items() if pool.summary_layer_ids else ()):
            assert int(pool.slot_count[q]) == n_q // 8
            owned += pool.chunk_slot[q, : n_q // 8].tolist()
            for c in range(n_q // 8):
                ids = sim.r2t[q, c * 8:(c + 1) * 8].long()
                for lid in pool.summary_layer_ids:
                    want = pool.host.view(lid)[ids].float().mean(0).bfloat16()
                    assert bf16_close(pool.vsum[lid][int(pool.chunk_slot[q, c])], want)
        free = pool.slot_stack[: int(pool.slot_top)].tolist()
        assert sorted(owned + free) == list(range(pool.summary_slots)) and int(pool.slot_overflow) == 0
        assert pool.summary_slots > 0 or pool.layout.policy.denominator != "estimate"
        # hot-buffer pages: each owned by one live row, the rest on the free stack; a decoded request holds what its k needs
        pages = [p for q in live for p in pool.hot_table[q, : int(pool.hot_count[q])].tolist()]
        free_pages = pool.page_stack[: int(pool.page_top)].tolist()
        assert sorted(pages + free_pages) == list(range(pool.hot_pages)) and int(pool.page_overflow) == 0
        assert all(int(pool.hot_count[q]) == 0 for q in range(pool.layout.request_rows) if q not in live)
        for q in decoded & set(live):
            k = pool.layout.policy.counts(live[q])[2]
            assert int(pool.hot_count[q]) * 4 >= min(12, -(-k * 3 // 2))
        for i, lid in enumerate(pool.sparse_layer_ids):
            h = pool.hot_state(lid)
            for q in live:
                held = [(j, p) for j, p in enumerate(h.slot_pos[q].tolist()) if p >= 0]
                assert len({p for _, p in held}) == len(held)
                for j, p in held:
                    assert p < live[q] and j < int(h.count[q]) * h.page  # only slots its pages cover
                    tok = int(sim.r2t[q, p])
                    dev_row = h.base + int(h.table[q, j // h.page]) * h.page + j % h.page
                    assert torch.equal(pool.v_buffer[lid][dev_row], pool.host.view(lid)[tok])
                    assert int(h.loc_slot[tok]) == j


#: aten ops a CUDA graph cannot capture: a Python value made a tensor (a
#: host-to-device copy on a GPU), a read of a device value by the host (a sync).
GRAPH_UNSAFE = ("aten.lift_fresh", "aten._local_scalar_dense", "aten.nonzero.", "aten.masked_select", "aten.item", "aten.repeat_interleave.Tensor",
                "aten._unique", "aten.unique", "aten.equal")


class _OpRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops run under it, plus what the dispatcher does not show: a
    boolean-mask index (a hidden ``nonzero``) and the host reads of a tensor
    (``tolist``, ``cpu``, ``numpy``, ``bool``/``int``/``float``), counted by
    patching ``torch.Tensor`` while it is active."""

    HOST_READS = ("tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self):
        super().__init__()
        self.ops = []
        self._saved = {}

    def __enter__(self):
        for name in self.HOST_READS:
            orig = getattr(torch.Tensor, name)
            self._saved[name] = orig

            def counted(t, *a, _orig=orig, _name=name, **k):
                self.ops.append(f"host-read.{_name}")
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, orig in self._saved.items():
            setattr(torch.Tensor, name, orig)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default):
            if any(t is not None and t.dtype == torch.bool for t in (args[1] or [])):
                self.ops.append("aten.nonzero.bool-mask-index")
        return func(*args, **(kwargs or {}))


def test_the_op_recorder_sees_what_a_graph_cannot_capture():
    """The recorder is not blind to the usual ways of breaking a capture."""
    t, i = torch.randn(8), torch.tensor([1, 2])
    orig_tolist = torch.Tensor.tolist
    for bad, want in ((lambda: t.__setitem__(i, 1), "aten.lift_fresh"), (lambda: t[t > 0], "aten.nonzero.bool-mask-index"),
                      (lambda: t.sum().item(), "aten._local_scalar_dense"), (lambda: t.tolist(), "host-read.tolist"),
                      (lambda: int(i[0]), "host-read.__int__"), (lambda: bool((t > 0).any()), "host-read.__bool__"),
                      (lambda: torch.repeat_interleave(i, i), "aten.repeat_interleave.Tensor")):
        with _OpRecorder() as rec:
            bad()
        assert any(op.startswith(want) for op in rec.ops), (want, rec.ops)
        assert {op for op in rec.ops if op.startswith(GRAPH_UNSAFE) or op.startswith("host-read")}, rec.ops
    with _OpRecorder() as rec:
        t.index_fill_(0, i, 1)
        torch.where(i < 2, i, 5)
    assert not [op for op in rec.ops if op.startswith(GRAPH_UNSAFE) or op.startswith("host-read")], rec.ops
    assert torch.Tensor.tolist is orig_tolist and t.tolist() == orig_tolist(t)  # the patches are gone after the block


@pytest.mark.parametrize("denominator,resident,prefetch,keep_v,all_dense,slack_max,tuned", [
    ("selected", False, False, False, False, 0.0, False), ("estimate", False, True, False, False, 4.0, False),
    ("full", True, False, False, False, 0.0, False), ("estimate", False, True, True, False, 0.0, False),
    ("estimate", False, False, True, True, 0.0, False),
    # the all-dense step's own plan as shipped (one launch, PDL, chunk_mean's mean on the GPU), from 2 programs a chunk
    ("estimate", False, False, True, True, 0.0, True),
    # a general step's kept request in the all-dense launch, its chunk the mean's lowered by the fill rule (tensors only)
    ("estimate", False, True, True, False, 0.0, "kept")])
def test_the_decode_step_has_no_op_a_cuda_graph_cannot_capture(denominator, resident, prefetch, keep_v, all_dense, slack_max, tuned):
    """What the backend runs inside SGLang's decode CUDA graph (the plan, then
    per layer: the prefetch, the KV write, the attention) makes no tensor from
    a Python value and reads no device value on the host. On the H200, with
    ``estimate`` ``attended[idx] = 1`` (a Python 1 made a CPU tensor) failed
    the graph capture at start-up; a CPU run shows it as ``aten.lift_fresh``."""
    pol = OffloadPolicy(sink=2, window=8, budget_frac=0.05, max_topk=24, dense_layers=1, denominator=denominator, chunk=8)
    split = dataclasses.replace(SPLIT, dense_min_ctas=0 if tuned is True else 2, dense_chunk_mean=SplitConfig().dense_chunk_mean,
                                dense_min_chunk=64) if tuned else SPLIT
    sim = Sim(make_pool(pol, resident, keep_v=keep_v, slack_max=slack_max), seed=3, split=split)
    sim.keep = ({1, 2} if all_dense else {2}) if keep_v else set()  # keep_v: one dense and one sparse request (or both dense)
    sim.extend([1, 2], [(0, 40), (0, 300)])
    sim.decode([1, 2], [41, 301], check=False)
    pool, dec = sim.pool, sim.dec
    if keep_v:
        sim._keep(2, 301, 1)  # the step's slot, lent by the scheduler before the graph replays
        if all_dense:
            sim._keep(1, 41, 1)
    pool.flush_releases()  # out of the graph (init_forward_metadata_out_graph)
    rp, seq = torch.tensor([1, 2], dtype=torch.int32), torch.tensor([42, 302], dtype=torch.int32)
    loc = sim.r2t[rp.long(), seq.long() - 1].long()
    ins = [(torch.randn(2, HKV, D).bfloat16(), torch.randn(2, HKV, D).bfloat16(), torch.randn(2, HQ, D).bfloat16()) for _ in range(L)]
    outs = [torch.empty(2, HQ, D, dtype=torch.bfloat16) for _ in range(L)]
    with _OpRecorder() as rec:
        dec.plan(sim.r2t, rp, seq, 2, keep=pool.keep_tables(), all_dense=all_dense)
        dec.grant_pages(pool)
        pool.set_v_rows(dec.new_token_rows(), dec.new_token_keep_rows())
        pool.set_summary_plan(dec.summary_plan(pool))
        for l in range(L):
            k, v, q = ins[l]
            if prefetch and l + 1 < L and l + 1 in pool.sparse_layer_ids:
                dec.prefetch(ins[l + 1][2], pool.get_key_buffer(l + 1), pool.get_value_buffer(l + 1), D ** -0.5, sim.r2t, rp, seq,
                             pool.hot_state(l + 1), pool.host.view(l + 1))
            pool.set_kv_buffer(layer(l), loc, k, v)
            kb, vb = pool.get_key_buffer(l), pool.get_value_buffer(l)
            if pol.is_dense_layer(l):
                dec.dense(q, kb, vb, outs[l], D ** -0.5)
            elif all_dense:
                dec.dense_kept(q, kb, vb, outs[l], D ** -0.5)
            elif resident:
                dec.sparse(q, kb, vb, outs[l], D ** -0.5, sim.r2t, rp, seq, v_summary=pool.summaries(l))
            else:
                dec.sparse(q, kb, vb, outs[l], D ** -0.5, sim.r2t, rp, seq, pool.hot_state(l), pool.host.view(l), v_summary=pool.summaries(l),
                           record=pool.miss_record(l))
    bad = sorted({op for op in rec.ops if op.startswith(GRAPH_UNSAFE) or op.startswith("host-read")})
    assert len(rec.ops) > 50 and not bad, bad
    assert all(torch.isfinite(o.float()).all() for o in outs)
    assert dec.dense_tuned == (tuned is True)
    if tuned is True:  # the mean of 42 and 302 (172) x 1.25 = 215 > 64: the short request one chunk, the long one two
        assert dec.nsplit[:2].tolist() == [1, 2]
    if tuned == "kept":  # row 2 alone kept: the mean's 378 lowered to 302 x 2 KV heads / 2 programs = 302, one chunk
        assert dec.kd_tuned and dec.kd_nsplit[:2].tolist() == [0, 1] and dec.kd_chunk[1] == 384
    if keep_v:
        assert dec.dense_lens[:2].tolist() == ([42, 302] if all_dense else [0, 302])  # row 2 (and 1) dense in the recorded step
    if slack_max:
        assert pool.adaptive and int(pool.row_sel[2]) > 0  # the adaptive plan and the miss record ran in the recorded step


@pytest.mark.parametrize("denominator", ["selected", "full", "estimate"])
def test_a_finished_request_gives_its_hot_pages_back_with_every_denominator(denominator):
    """SGLang frees a finished request's row (FIFO: the row may stay idle for
    long): its pages must go back at the next forward, not when the row is
    reused, or the pool sized for the live tokens runs short (review finding,
    HIGH, ``selected``/``full``)."""
    from sglang_elastic.offload import hooks

    pol = OffloadPolicy(sink=2, window=8, budget_frac=0.2, max_topk=10, dense_layers=1, denominator=denominator, chunk=8)
    pool = make_pool(pol, size=3000, rows=5, hot=12, ctx=200, hot_page=4, slack=1.5)
    sim = Sim(pool, 5, ctx=200)
    hooks._BUILT["pool"] = pool
    try:
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        r2t_pool = ReqToTokenPool(size=4, max_context_len=200, device="cpu", enable_memory_saver=False)
        sim.new_request(2)
        sim.extend([2], [(0, 150)])
        sim.decode([2], [151], check=False)
        assert int(pool.hot_count[2]) == 3 and int(pool.page_top) == pool.hot_pages - 3
        hooked_req_free()(r2t_pool, types.SimpleNamespace(req_pool_idx=2))
        pool.flush_releases()
        assert int(pool.hot_count[2]) == 0 and int(pool.page_top) == pool.hot_pages
        assert sorted(pool.page_stack.tolist()) == list(range(pool.hot_pages))
    finally:
        hooks._BUILT.pop("pool", None)


def test_the_metrics_line_reports_rates_over_the_interval_and_the_hot_pages_in_use():
    """``OffloadMetrics.update`` (no Prometheus here: the log line): hit rate and
    PCIe rates of the interval, not since start; hot pages in use; an overflow
    of pages or summary slots named, never silent."""
    from sglang_elastic.offload.metrics import OffloadMetrics

    m = OffloadMetrics(None)
    clock = iter([100.0, 102.0, 103.0, 104.0, 105.0, 106.0])
    m._clock = lambda: next(clock)
    base = {"hits": 10, "misses": 10, "pcie_read_bytes": 0, "pcie_write_bytes": 0, "decode_steps": 5, "hot_pages": 40, "hot_pages_free": 40,
            "hot_page_overflow": 0, "summary_overflow": 0}
    assert m.update(base, used_tokens=0, host_token_bytes=2048) == ""  # the first call only starts the interval
    st = dict(base, hits=40, misses=20, pcie_read_bytes=4 * 10**9, pcie_write_bytes=10**9, decode_steps=15, hot_pages_free=28)
    line = m.update(st, used_tokens=1000, host_token_bytes=2048)
    assert line.startswith("hit rate 0.750, PCIe read 2.00 GB/s write 0.50 GB/s, 500.0 MB/step") and "hot pages 12/40" in line
    assert "found" not in line
    line = m.update(dict(st, hot_page_overflow=2, summary_overflow=1), used_tokens=1000, host_token_bytes=2048)
    assert "2 hot-page grants found the pool short" in line and "1 chunks found no V-summary slot" in line and "hit rate n/a" in line
    assert "kept V" not in line  # without --kv-offload-keep-v
    kept = dict(st, kept_tokens=5000, kept_requests=3, keep_granted_tokens=9000, keep_demotions=4)
    m.update(kept, used_tokens=1000, host_token_bytes=2048)
    line = m.update(dict(kept, keep_demotions=6, kept_requests=2, kept_tokens=4100), used_tokens=1000, host_token_bytes=2048)
    assert "kept V 2 requests / 4100 tokens (2 demoted)" in line and "staged" not in line
    line = m.update(dict(kept, prefix_stage_bytes=3 * 10**9), used_tokens=1000, host_token_bytes=2048)  # the interval's prefix reads
    assert "prefixes staged 3.00 GB" in line


class _Ev:
    """A fake CUDA event: ``done`` says whether the GPU has passed it."""

    def __init__(self):
        self.done, self.recorded = False, 0

    def record(self):
        self.recorded += 1

    def query(self):
        return self.done


def test_the_async_snapshot_returns_each_copy_once_the_gpu_finished_it_with_its_host_state_and_time():
    """The decode-log interval's counters come from the snapshot an earlier take queued, once its event says
    the GPU copied it (queried, never waited for), with the host state and the time taken beside it, each
    snapshot once; while a copy is in flight nothing is returned and nothing more queued (a review found the
    same old snapshot counted again, and one interval's bytes divided by the next interval's time)."""
    from sglang_elastic.offload.metrics import AsyncSnapshot

    events = []

    def make():
        events.append(_Ev())
        return events[-1]

    clock = iter(float(t) for t in range(10, 100))
    snap = AsyncSnapshot(event_factory=make, force_async=True, clock=lambda: next(clock))
    hits = torch.tensor([7, 3], dtype=torch.int64)
    top = torch.tensor([40], dtype=torch.int32)
    assert snap.take([hits, top], {"decode_steps": 1}) is None and len(events) == 1 and events[0].recorded == 1
    hits += 5  # the GPU goes on counting
    assert snap.take([hits, top], {"decode_steps": 2}) is None and len(events) == 1  # the first copy in flight: nothing queued
    events[0].done = True
    assert snap.take([hits, top], {"decode_steps": 3}) == ([7, 3, 40], {"decode_steps": 1}, 10.0) and len(events) == 2
    hits += 1
    assert snap.take([hits, top], {"decode_steps": 4}) is None  # the second copy in flight
    events[1].done = True
    assert snap.take([hits, top], {"decode_steps": 5}) == ([12, 8, 40], {"decode_steps": 3}, 11.0)
    assert AsyncSnapshot(clock=lambda: 5.0).take([hits, top], {"x": 1}) == ([13, 9, 40], {"x": 1}, 5.0)  # CPU: read at once


def test_the_metrics_take_an_intervals_bytes_over_its_own_time():
    """``update(now=...)``: the snapshot's time, so a snapshot read an interval late still gives its rates."""
    from sglang_elastic.offload.metrics import OffloadMetrics

    m = OffloadMetrics(None)
    m._clock = lambda: 1000.0  # the hook's own clock is not used when the snapshot's time is given
    base = {"hits": 0, "misses": 0, "pcie_read_bytes": 0, "pcie_write_bytes": 0, "decode_steps": 0}
    assert m.update(base, used_tokens=0, host_token_bytes=0, now=10.0) == ""
    line = m.update(dict(base, pcie_read_bytes=2 * 10**9, decode_steps=10), used_tokens=0, host_token_bytes=0, now=11.0)
    assert "PCIe read 2.00 GB/s" in line


def test_the_backends_counters_are_read_now_for_server_info_and_from_the_snapshot_at_the_decode_log_interval(monkeypatch):
    """``stats()`` (``/server_info``, the benchmarks) reads the device counters now; the decode-log hook asks for
    ``stats(sync=False)`` (no host sync in the serving loop) and skips the interval until a snapshot is there."""
    from sglang_elastic.offload import hooks
    from sglang_elastic.offload.backend import OffloadAttnBackend
    from sglang_elastic.offload.metrics import AsyncSnapshot

    pol = OffloadPolicy(sink=2, window=8, budget_frac=0.05, max_topk=24, dense_layers=1, denominator="estimate", chunk=8)
    pool = make_pool(pol)
    be = object.__new__(OffloadAttnBackend)
    be.pool, be.copy_timer, be._snapshot, be.snapshot_time = pool, None, None, None
    be.decoder = types.SimpleNamespace(stats=torch.tensor([30, 10], dtype=torch.int64), spec=None)
    be.decode_steps, be.decode_tokens, be.prefill_tokens, be.prefix_tokens = 4, 40, 100, 250
    st = be.stats()
    row = pool.head_num * pool.v_head_dim * pool.store_dtype.itemsize
    assert (st["hits"], st["misses"], st["hit_rate"], st["pcie_read_bytes"]) == (30, 10, 0.75, 10 * row)
    assert st["prefix_stage_bytes"] == 250 * len(pool.sparse_layer_ids) * row and "prefix_tokens" not in st
    assert st["hot_pages_free"] == int(pool.page_top) == st["hot_pages"] and st["summary_slots_free"] == int(pool.slot_top)
    assert st["pcie_write_bytes"] == 140 * len(pool.sparse_layer_ids) * row and st["decode_steps"] == 4
    events = []
    be._snapshot = AsyncSnapshot(event_factory=lambda: events.append(_Ev()) or events[-1], force_async=True)
    assert be.stats(sync=False) is None
    events[0].done = True
    be.decoder.stats += 1
    be.decode_steps = 5
    late = be.stats(sync=False)
    assert (late["hits"], late["decode_steps"]) == (30, 4) and be.snapshot_time is not None  # the snapshot's own host state
    assert be.stats(sync=False) is None  # the next copy in flight: nothing new
    late.pop("decode_steps"), st.pop("decode_steps")
    assert late == st  # the same keys and values as a read at once, for the same counters
    asked = []
    monkeypatch.setattr(be, "stats", lambda sync=True: asked.append(sync))  # returns None: the interval is skipped
    sched = types.SimpleNamespace(tp_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(attn_backend=be)))
    reporter = types.SimpleNamespace(forward_ct_decode=80, decode_log_interval=40, scheduler=sched)
    assert hooks._after_decode_stats("r", reporter) == "r" and asked == [False] and not hasattr(be, "_metrics")


# ---- keep_v: dense while V fits in idle pool slots ------------------------------------------


@pytest.mark.parametrize("denominator,prefetch,split,kept_splits", [
    ("selected", False, SPLIT, None),  # below dense_min_ctas: the kept requests in two launches on the scores plan
    ("estimate", True, SPLIT, None),
    # the all-dense step's one launch for the kept requests: chunks of at least 64 rounded to the 128 block (row 1,
    # 423 positions, in four, merged by the last to finish; row 4, 123, in one)
    ("estimate", False, dataclasses.replace(SPLIT, dense_min_ctas=0, dense_min_chunk=64), [4, None, 1]),
    # its settings from 3 requests x 2 KV heads = 6 programs on; the floor (1,024) lowered so that the kept
    # requests alone launch 6: sum(423 + 123) x 2 / 6 = 182 -> row 1 in 3 splits of 141, rounded to the 128 block: 2 of 256
    ("selected", False, dataclasses.replace(SPLIT, dense_min_ctas=6, dense_min_chunk=1024), [2, None, 1]),
], ids=["selected", "estimate_prefetch", "kept_one_launch", "kept_one_launch_fill"])
def test_requests_that_keep_v_attend_densely_beside_sparse_ones_and_continue_sparse_after_a_demotion(denominator, prefetch, split,
                                                                                                       kept_splits):
    """Rows 1 and 4 keep V in pool slots (taken from the free ids, as SGLang's allocator lends them),
    row 2 does not: in one batch the first two attend to every position (the float64 dense
    reference), row 2 to the policy's set. Row 1 is then demoted mid-stream: from the next step its
    output is the policy's again, from its complete host V, its sink and ring rows and (estimate)
    the chunk means written while it was dense; row 4 finishes and a new request in its row starts
    sparse. Each kept slot holds exactly the V written for its position (the K rows beside it untouched).
    The kept requests attend in a launch of their own, before the sparse one, which leaves their rows
    (``kept_splits``: their chunks in the all-dense step's launch, the sparse row's none)."""
    pol = OffloadPolicy(sink=2, window=8, budget_frac=0.05, max_topk=24, dense_layers=1, denominator=denominator, chunk=8)
    pool = make_pool(pol, keep_v=True)
    assert pool.keep_v and pool.keep_base == pool.v_buffer[1].shape[0] - pool.k_buffer[1].shape[0]
    assert pool.k_buffer[1].data_ptr() == pool.v_buffer[1][pool.keep_base:].data_ptr()  # K and kept V share the buffer
    sim = Sim(pool, 7, split=split)
    if prefetch:  # InfiniGen's prefetch (the next layer's own query as the guess): a dense request has nothing to fetch
        sim.guess = lambda q: q
    sim.keep = {1, 4}
    sim.extend([1, 2, 4], [(0, 300), (0, 260), (0, 120)])
    sim.extend([1], [(300, 420)])  # a later chunk of a dense request: its prefix from the host staging, its V kept
    lens, _, worst = sim.run([1, 2, 4], [420, 260, 120], 3)
    assert sim.kept(1, lens[0]) and sim.kept(4, lens[2]) and not sim.kept(2, 1)
    assert worst < 2e-2, worst  # rows 1 and 4 against the dense reference, row 2 against the policy's
    dec = sim.dec
    assert dec.kd_tuned == (kept_splits is not None) and dec.kd_indptr[:4].tolist() == [0, lens[0], lens[0], lens[0] + lens[2]]
    assert int(dec.att_indptr[1]) == 0 and int(dec.att_indptr[3] - dec.att_indptr[2]) == 0  # the kept rows: no sparse entries
    if kept_splits is not None:
        assert [int(dec.kd_nsplit[i]) or None for i in range(3)] == kept_splits and not dec.counters.any()
    # the kept rows hold exactly the history's V, at the slots the table names
    for l in pool.sparse_layer_ids:
        for r, n in ((1, lens[0]), (4, lens[2])):
            rows = pool.req_to_vrow[r, :n].long()
            assert torch.equal(pool.v_buffer[l][rows], sim.v[l, r, :n])
            assert torch.equal(pool.k_buffer[l][sim.r2t[r, :n].long()], sim.k[l, r, :n])
    # dense rows took no hot pages and copied nothing: only row 2's misses were counted
    assert int(pool.hot_count[1]) == int(pool.hot_count[4]) == 0 and int(pool.hot_count[2]) > 0
    # at these lengths the policy's set differs from every position: the dense reference tells them apart
    q = torch.randn(HQ, D, generator=sim.g).bfloat16()
    n = lens[0]
    dense_ref = attend_reference(q, sim.k[1, 1, :n], sim.v[1, 1, :n], dataclasses.replace(pol, dense_layers=L), 1)
    sparse_ref = attend_reference(q, sim.k[1, 1, :n], sim.v[1, 1, :n], pol, 1)
    assert float((dense_ref - sparse_ref).abs().max() / dense_ref.abs().max()) > 0.05
    sim.keep.discard(1)
    pool.set_keep(1, 0, None)  # demoted (SGLang's allocator ran short): row 1 continues sparse
    lens, _, w = sim.run([1, 2, 4], lens, 3)
    worst = max(worst, w)
    assert not sim.kept(1, lens[0]) and int(pool.hot_count[1]) > 0
    sim.keep.discard(4)
    pool.set_keep(4, 0, None)
    pool.release_rows([4])
    sim.new_request(4)
    sim.extend([4], [(0, 90)])
    _, _, w = sim.run([1, 2, 4], [lens[0], lens[1], 90], 2)
    assert max(worst, w) < 2e-2, (worst, w)


@pytest.mark.parametrize("seed,denominator,split", [
    (0, "full", dataclasses.replace(SPLIT, dense_min_ctas=4, dense_min_chunk=1024, dense_block_n=32)),
    (1, "estimate", dataclasses.replace(SPLIT, dense_min_ctas=4, dense_fused=False, dense_min_chunk=64, dense_chunk_mean=125)),
    (2, "estimate", dataclasses.replace(SPLIT, dense_min_ctas=4, dense_min_chunk=1024))],
    ids=["one_launch_fill", "two_launch_mean", "estimate_fill"])
def test_random_kept_sets_in_padded_general_steps_match_the_references_through_a_demotion_and_with_none_kept(seed, denominator, split):
    """Three requests of random lengths, a random subset keeping V, in padded general steps (row 0, length 1):
    every output against its float64 reference (dense for a kept request, the policy's for the others), one
    request demoted midway, and then steps where no request keeps V (the kept launch's lists empty)."""
    import random

    rnd = random.Random(seed)
    pol = OffloadPolicy(sink=2, window=8, budget_frac=0.05, max_topk=24, dense_layers=1, denominator=denominator, chunk=8)
    pool = make_pool(pol, keep_v=True)
    sim = Sim(pool, seed, split=split)
    rows = [1, 2, 3]
    sim.keep = {1, 3} | {r for r in rows if rnd.random() < 0.5}
    lens = [rnd.randint(3, 300) for _ in rows]
    sim.extend(rows, [(0, n) for n in lens])
    worst = 0.0
    for step in range(6):
        if step in (2, 4):  # one demotion, then every kept request goes
            for r in sorted(sim.keep)[: 1 if step == 2 else None]:
                sim.keep.discard(r)
                pool.set_keep(r, 0, None)
        lens = [x + 1 for x in lens]
        _, w = sim.decode(rows + [0], lens + [1])
        worst = max(worst, w)
        kept = sum(n for r, n in zip(rows, lens) if sim.kept(r, n))
        assert int(sim.dec.kd_indptr[3]) == kept and (kept == 0) == (step >= 4)
    assert worst < 2e-2, worst


def test_a_kept_request_is_dense_only_while_its_kept_positions_cover_its_length():
    """A row whose kept positions stop short of its length (a decode step whose slot was not lent)
    is scored sparsely: ``keep_len >= seq_len`` decides, on the GPU, per step."""
    pol = OffloadPolicy(sink=2, window=8, budget_frac=0.05, max_topk=24, dense_layers=1, denominator="selected", chunk=8)
    pool = make_pool(pol, keep_v=True)
    sim = Sim(pool, 9)
    sim.keep = {1}
    sim.extend([1], [(0, 200)])
    sim.keep = set()  # the next decode step's slot is not lent
    _, w = sim.decode([1], [201])
    assert not sim.kept(1, 201) and pool.keep_len_cpu[1] == 200 and w < 2e-2
    assert int(sim.dec.dense_lens[0]) == 0 and int(sim.dec.sc_indptr[1]) == 201


@pytest.mark.parametrize("split,chunks", [(SPLIT, [2, 4]),  # the shipped dense_* settings, below dense_min_ctas: the scores plan
                                          (dataclasses.replace(SPLIT, dense_min_ctas=0, dense_fused=False, dense_pdl=False, dense_block_n=0,
                                                               dense_num_stages=None, dense_min_chunk=0), [2, 4]),
                                          (dataclasses.replace(SPLIT, dense_min_ctas=0, dense_fused=True, dense_min_chunk=1024), [1, 1]),
                                          (dataclasses.replace(SPLIT, dense_min_ctas=0, dense_fused=True, dense_min_chunk=64, dense_pdl=True,
                                                               dense_block_n=32, dense_num_warps=2, dense_num_stages=None), [4, 4]),
                                          (dataclasses.replace(SPLIT, dense_min_ctas=0, dense_fused=False, dense_pdl=True, dense_min_chunk=256,
                                                               dense_block_n=0, dense_num_stages=None), [1, 3]),
                                          # the minimum chunk raised to 150 % of the real requests' mean context (231 and 601: 624,
                                          # which holds both; the padding row left out, else 417): one chunk each
                                          (dataclasses.replace(SPLIT, dense_min_ctas=0, dense_fused=True, dense_min_chunk=64,
                                                               dense_chunk_mean=150), [1, 1]),
                                          # at 100 % (416, the padding row left out; with it 278, and 601 past twice that): the
                                          # shorter request one chunk, the longer two (301 -> block 128: 384)
                                          (dataclasses.replace(SPLIT, dense_min_ctas=0, dense_fused=True, dense_min_chunk=64,
                                                               dense_chunk_mean=100), [1, 2]),
                                          # at 50 % (208) the longer request is past twice the chunk: the floor, 64, at most 4
                                          # splits, chunks rounded up to the 128 block: 231 -> 2 of 128, 601 -> 151 -> 256: 3
                                          (dataclasses.replace(SPLIT, dense_min_ctas=0, dense_fused=True, dense_min_chunk=64,
                                                               dense_chunk_mean=50), [2, 3])],
                         ids=["below_min_ctas", "two_launch", "fused_one_chunk", "fused_split_pdl", "two_launch_pdl", "fused_chunk_mean",
                              "fused_chunk_mean_split_two", "fused_chunk_mean_past_twice"])
def test_an_all_dense_step_runs_no_selection_and_matches_the_dense_reference_with_a_padding_entry(split, chunks):
    """The all-dense plan (every request keeps V; the CUDA-graph variant of such batches): the sparse
    layers run one split-KV pass over K and the kept V, no scores, top-k or copy (no hot page granted,
    no hit or miss counted); SGLang's padding row 0 (length 1) rides along and writes nothing a
    request reads; the next general step and a demotion continue from the same state. Also with the
    one-launch kernel (``dense_fused``) on the all-dense step's own plan: one chunk a request
    (written directly) and several (merged by the last chunk)."""
    pol = OffloadPolicy(sink=2, window=8, budget_frac=0.05, max_topk=24, dense_layers=1, denominator="estimate", chunk=8)
    pool = make_pool(pol, keep_v=True)
    sim = Sim(pool, 11, split=split)
    sim.keep = {1, 2}
    sim.extend([1, 2], [(0, 230), (0, 600)])
    lens = [230, 600]
    sink_rows = [pool.v_buffer[l][1 * pool.layout.region_rows].clone() for l in pool.sparse_layer_ids]
    worst = 0.0
    for _ in range(2):
        lens = [x + 1 for x in lens]
        _, w = sim.decode([1, 2, 0], lens + [1], all_dense=True)  # a padded graph batch: row 0, length 1
        worst = max(worst, w)
        assert sim.dec.dense_tuned == (split.dense_min_ctas == 0)  # 3 graph rows x the pool's KV heads are below 256 programs
        assert sim.dec.nsplit[:2].tolist() == chunks and (not sim.dec.dense_tuned or not split.dense_fused or not sim.dec.counters.any())
    assert worst < 2e-2, worst
    assert sim.dec.stats.tolist() == [0, 0] and int(pool.hot_count[1]) == int(pool.hot_count[2]) == 0
    # row 1 reached 232 = 29 chunks of 8 in an all-dense step: that chunk's mean was read from the kept rows
    for l in pool.sparse_layer_ids:
        slot = int(pool.chunk_slot[1, 28])
        assert slot < pool.summary_slots and bf16_close(pool.vsum[l][slot], sim.v[l, 1, 224:232].float().mean(0).bfloat16())
    assert all(torch.equal(pool.v_buffer[l][1 * pool.layout.region_rows], s_) for l, s_ in zip(pool.sparse_layer_ids, sink_rows))
    lens = [x + 1 for x in lens]
    _, w = sim.decode([1, 2], lens)  # the general plan: both still dense there
    assert w < 2e-2 and sim.dec.stats.tolist() == [0, 0]
    sim.keep.discard(2)
    pool.set_keep(2, 0, None)
    lens, _, w = sim.run([1, 2], lens, 2)  # row 2 demoted: sparse from its host V, ring and chunk means
    assert w < 2e-2, w
    assert sum(sim.dec.stats.tolist()) > 0
    with pytest.raises(RuntimeError, match="all_dense=True"):
        sim.dec.dense_kept(torch.zeros(2, HQ, D).bfloat16(), pool.get_key_buffer(1), pool.get_value_buffer(1), torch.empty(2, HQ, D).bfloat16(), 1.0)


def test_the_keep_v_step_breakdown_of_check_offload_runs_its_pieces_on_a_small_shape():
    """``scripts/gpu/check_offload.py``'s all-dense step breakdown (the fitting workload's ITL
    question) on the CPU at a small shape, with wall-clock timers in place of CUDA events and
    graphs: every piece runs (pool, plan, stores, chunk means, both attentions, SGLang's own pool
    as the stock store) and the step adds up from its pieces: the first GPU call of it must not be
    its first run."""
    import time

    from gpu_scripts import load_script

    mod = load_script("check_offload")
    calls = []

    def wall(fn):
        t0 = time.perf_counter()
        fn()
        calls.append(fn)
        return (time.perf_counter() - t0) * 1e3

    out = {}
    profiled = []

    def kernels(fn):  # (kernel_us needs CUDA's profiler; this runs the step once and names it)
        fn()
        profiled.append(fn)
        return {"step": 1.0}

    mod.time_keep_v_step(out, bs=3, ctx=80, layers=6, hq=4, hkv=2, d=32, device="cpu", timed=wall, graphed=wall, mixed=(0, 1, 3),
                         kernels=kernels)
    r = out["keep_v_step"]
    ms, step = r["ms"], r["step_ms"]
    for name in ("plan", "store", "store_no_summary", "store_no_host", "chunk_mean", "dense_kept", "dense_split_kv", "store_stock",
                 "layer", "layer_host_async"):
        assert ms[name] > 0, name
    assert "flashinfer_tc" not in ms and step["stock"] is None  # FlashInfer only on a GPU
    want = ms["plan"] + 4 * ms["layer_host_async"] + 2 * (ms["store_stock"] + ms["dense_split_kv"])
    assert step["offload_keep_v"] == pytest.approx(want) and r["dense_layers"] == 2 and r["layers"] == 6
    lens = 80 - torch.randint(0, 16, (3,), generator=torch.Generator().manual_seed(5))  # the function's own draw
    assert r["completing_chunk"] == int((lens % 16 == 0).sum()) and len(calls) == 13 + 3 * 4 and len(profiled) == 4
    assert r["dense_kept_kernels_us"] == {"step": 1.0}
    for m in ("0", "1", "3"):  # the general step with none, 1 and all 3 requests demoted: every piece ran, the step adds up
        assert r["mixed"][m]["sparse_kernels_us"] == {"step": 1.0}
        mx = r["mixed"][m]
        assert all(mx[x] > 0 for x in ("plan", "sparse", "layer", "dense_split_kv"))
        assert mx["step_ms"] == pytest.approx(mx["plan"] + 4 * mx["layer"] + 2 * (mx["dense_split_kv"] + ms["store_stock"]))


def test_an_all_dense_plan_without_kept_v_is_refused_before_the_step_changes():
    """``plan(all_dense=True)`` on a pool without ``--kv-offload-keep-v``: a ValueError, and the decoder's step state
    (the last plan's all-dense flag, launch choice and block) stays the previous step's."""
    pol = OffloadPolicy(sink=2, window=8, budget_frac=0.05, max_topk=24, dense_layers=1, denominator="estimate", chunk=8)
    sim = Sim(make_pool(pol), 5)
    sim.extend([1, 2], [(0, 40), (0, 90)])
    dec = sim.dec
    rp, seq = torch.tensor([1, 2], dtype=torch.int32), torch.tensor([41, 91], dtype=torch.int32)
    dec.plan(sim.r2t, rp, seq, 2)
    before = (dec.all_dense, dec.dense_tuned, dec.plan_block_n, dec.bs, torch.cat([dec.nsplit[:2], dec.kv_indptr[:3]]).clone())
    with pytest.raises(ValueError, match="all_dense needs layout.keep_v"):
        dec.plan(sim.r2t, rp, seq + 700, 2, all_dense=True)  # (longer: a plan that ran would change the chunks and offsets)
    assert (dec.all_dense, dec.dense_tuned, dec.plan_block_n, dec.bs) == before[:4] and torch.equal(torch.cat([dec.nsplit[:2], dec.kv_indptr[:3]]), before[4])


def test_the_default_all_dense_plan_runs_similar_long_contexts_as_one_chunk_and_keeps_the_floor_past_twice_the_share():
    """The shipped ``chunk_mean=125`` (measured -2.3 % median ITL at 32 x 8,448 on an H100), as
    ``OffloadDecoder.plan`` chains ``dense_mean_chunk`` and ``split_kv_plan`` (the decoder itself runs it in the
    all-dense step test's ``fused_chunk_mean`` cases): at that shape every request is one chunk, where
    ``chunk_mean=0`` splits each in two (the merge the measurement paid); at 64 x 4K nothing changes (8,192 already
    holds each request); 24 x 10,000 + 8 x 3,000 (every request within 125 % of the mean) runs one chunk a request
    (0.280 against 0.297 ms on the H200); one somewhat longer request (31 x 8,448 + 10,700) splits in two and the
    others stay one chunk; a batch with a request past twice 125 % of the mean (31 x 9,000 + 65,536, or the H200's
    28 x 8,448 + 4 x 32,768: 0.459 ms with the floor against 0.501 with chunks near the mean) keeps the floor's plan,
    the one ``chunk_mean=0`` gives."""
    from sglang_elastic.kernels.decode_attention import split_kv_plan
    from sglang_elastic.offload.decode import dense_mean_chunk

    sp = SplitConfig()
    assert sp.dense_chunk_mean == 125 and sp.dense_min_chunk == 8192 and sp.dense_block_n == 128

    def plan(lens, percent):
        lens = torch.tensor(lens, dtype=torch.int32)
        indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(lens, 0)
        mc = dense_mean_chunk(lens, len(lens), sp.dense_min_chunk, percent) if percent else sp.dense_min_chunk
        chunk, nsplit = split_kv_plan(indptr, sp.scores_max_splits, mc, sp.dense_block_n)
        return chunk.tolist(), nsplit.tolist()

    for ctx in ([8448] * 32, [8959] * 32, [8448] * 16 + [8959] * 16):  # over8k's decode: 8,448 to 8,959 positions
        assert plan(ctx, sp.dense_chunk_mean)[1] == [1] * 32 and plan(ctx, 0)[1] == [2] * 32
    for short in ([4096] * 64, [4607] * 64):  # the fitting load: the mean's 1.25x stays under the 8,192 floor
        assert plan(short, sp.dense_chunk_mean) == plan(short, 0) and plan(short, 0)[1] == [1] * 64
    # 125 % of the mean (8,250) is 10,313 >= 10,000: one chunk each; the floor splits the 10,000s in two
    mix = [10000] * 24 + [3000] * 8
    assert plan(mix, sp.dense_chunk_mean)[1] == [1] * 32 and plan(mix, 0)[1] == [2] * 24 + [1] * 8
    # 125 % of the mean (8,518.4) is 10,648: 10,700 is within twice that, so it splits in two and the rest stay whole
    # (the floor would split all 32 in two)
    near = [8448] * 31 + [10700]
    assert plan(near, sp.dense_chunk_mean)[1] == [1] * 31 + [2] and plan(near, 0)[1] == [2] * 32
    for outlier, want in (([9000] * 31 + [65536], [2] * 31 + [8]), ([8448] * 28 + [32768] * 4, [2] * 28 + [4] * 4)):
        assert plan(outlier, sp.dense_chunk_mean) == plan(outlier, 0) and plan(outlier, 0)[1] == want


def test_dense_mean_chunk_is_the_share_of_the_mean_context_rounded_up_and_never_below_the_floor():
    from sglang_elastic.offload.decode import dense_mean_chunk

    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    lens = torch.randint(2, 70000, (9,), generator=g, dtype=torch.int32)
    # the last row far past the others: 100 % of the mean (at most ~111,000) is under half of it
    outlier = torch.cat([torch.randint(2, 100, (8,), generator=g, dtype=torch.int32), torch.tensor([1_000_000], dtype=torch.int32)])
    branches = set()
    # twice 1000 % of the mean of 9 rows holds the longest (sum >= longest), and of 1 row always; 1 << 20 is a floor
    # above every share
    for t, bs, floor, pct in ((lens, 9, 8192, 100), (lens, 5, 512, 125), (lens, 9, 1 << 20, 100), (lens, 1, 16, 37), (lens, 9, 512, 1000),
                              (lens, 9, 1 << 20, 1000), (lens, 1, 16, 100), (outlier, 9, 16, 100), (outlier, 9, 16, 1000)):
        share = -(-int(t[:bs].to(torch.int64).sum()) * pct // (100 * bs))  # exact integer ceil (no length-1 row)
        holds = int(t[:bs].max()) <= 2 * share
        branches.add(holds)
        want = max(floor, share) if holds else floor
        got = dense_mean_chunk(t, bs, floor, pct)
        assert got.dim() == 0 and got.dtype == torch.int64 and int(got) == want, (bs, floor, pct)
    assert branches == {True, False}
    # a CUDA-graph batch: padding rows (length 1) are left out of the mean, so 3 real requests of 9,000 in a 5-row graph
    # get 9,000 (not 5,401, which they would be past: the floor), and a batch of padding alone the floor
    assert int(dense_mean_chunk(torch.tensor([9000, 9000, 9000, 1, 1], dtype=torch.int32), 5, 16, 100)) == 9000
    assert int(dense_mean_chunk(torch.tensor([1, 1, 1], dtype=torch.int32), 3, 16, 100)) == 16
    # 100 % of the mean of (9,000, 9,000, 18,002) is 12,001: the longest within twice it; (9,000, 9,000, 36,008): 18,003,
    # the longest past twice it: the floor, however long the mean
    assert int(dense_mean_chunk(torch.tensor([9000, 9000, 18002], dtype=torch.int32), 3, 16, 100)) == 12001
    assert int(dense_mean_chunk(torch.tensor([9000, 9000, 36008], dtype=torch.int32), 3, 16, 100)) == 16
    assert int(dense_mean_chunk(torch.tensor([9000, 1, 9001], dtype=torch.int32), 3, 16, 125)) == 11251
    assert int(dense_mean_chunk(torch.ones(4, dtype=torch.int32), 4, 16, 100)) == 16


@pytest.mark.parametrize("failure", ["pin", "allocate", "injected"])
def test_a_host_pool_that_cannot_be_pinned_or_allocated_stops_the_build_with_one_line(monkeypatch, failure):
    """Issue 24, no loss: a pinned-allocation failure gives a one-line error at start-up. SGLang's
    ``cudaHostRegister`` check (``pool_host/common.py``) raises with the pointer and a warning about stale data;
    the pool build now says what failed, how much, and what to change, in one line."""
    from sglang.srt.mem_cache.pool_host import common

    def register(buffer):  # as SGLang's own check raises it when the driver refuses
        raise RuntimeError(f"cudaHostRegister failed (rc=2, out of memory) for ptr={buffer.data_ptr():#x} size={buffer.numel()}; "
                           "host buffer is not pinned and device transfers\nmay silently return stale data.")

    def no_room(dims, dtype, device, pin_memory, allocator):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes")

    lay = OffloadLayout(OffloadPolicy(sink=2, window=8, max_topk=24, dense_layers=1), hot_tokens=32, request_rows=5, stage_tokens=1200, hot_page=8)
    if failure == "injected":  # SGLANG_ELASTIC_TEST_PIN_FAULT: the GPU check's fault, reported as a failed pin
        from sglang_elastic.offload import host_pool

        monkeypatch.setenv(host_pool.PIN_FAULT_ENV, "1")
        monkeypatch.setattr(common, "_cuda_host_register", lambda b: pytest.fail("the injected fault registers nothing"))
        with pytest.raises(RuntimeError) as err:
            OffloadKVPool(7000, 1, torch.bfloat16, HKV, D, L, "cpu", False, enable_alt_stream=False, layout=lay, pin_memory=True)
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith("sglang-elastic: could not pin ") and f"{host_pool.PIN_FAULT_ENV}=1: injected" in msg
        monkeypatch.delenv(host_pool.PIN_FAULT_ENV)
        return
    monkeypatch.setattr(common, "_cuda_host_register", register)
    if failure == "allocate":
        from sglang_elastic.offload import host_pool

        monkeypatch.setitem(host_pool.ALLOC_MEMORY_FUNCS, "cpu", no_room)
    with pytest.raises(RuntimeError) as err:
        OffloadKVPool(7000, 1, torch.bfloat16, HKV, D, L, "cpu", False, enable_alt_stream=False, layout=lay, pin_memory=True)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"sglang-elastic: could not {failure} ") and "GB of host memory for the offload V tier" in msg
    assert "--kv-offload-host-gb" in msg and ("cudaHostRegister failed" in msg) == (failure == "pin")
    gb = float(msg.split(f"could not {failure} ")[1].split(" GB")[0])
    assert gb > 0


def test_an_error_that_is_not_a_host_memory_shortage_is_not_reported_as_one(monkeypatch):
    """A review found every RuntimeError of the host allocation (a CUDA error, a bad shape) turned into "lower
    --kv-offload-host-gb": only SGLang's cudaHostRegister failure and out-of-memory errors are; others pass unchanged."""
    from sglang_elastic.offload import host_pool

    def broken(dims, dtype, device, pin_memory, allocator):
        raise RuntimeError("Cannot re-initialize CUDA in forked subprocess")

    monkeypatch.setitem(host_pool.ALLOC_MEMORY_FUNCS, "cpu", broken)
    lay = OffloadLayout(OffloadPolicy(sink=2, window=8, max_topk=24, dense_layers=1), hot_tokens=32, request_rows=5, stage_tokens=1200, hot_page=8)
    with pytest.raises(RuntimeError, match="^Cannot re-initialize CUDA in forked subprocess$"):
        OffloadKVPool(7000, 1, torch.bfloat16, HKV, D, L, "cpu", False, enable_alt_stream=False, layout=lay, pin_memory=True)

    def oom(dims, dtype, device, pin_memory, allocator):
        raise MemoryError()

    monkeypatch.setitem(host_pool.ALLOC_MEMORY_FUNCS, "cpu", oom)
    with pytest.raises(RuntimeError, match="^sglang-elastic: could not allocate .* GB of host memory for the offload V tier") as err:
        OffloadKVPool(7000, 1, torch.bfloat16, HKV, D, L, "cpu", False, enable_alt_stream=False, layout=lay, pin_memory=True)
    assert isinstance(err.value.__cause__, MemoryError)  # the original error stays attached


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the snapshot's copy must not synchronize (runs on a GPU host)")
def test_on_a_gpu_the_snapshot_queues_a_pinned_copy_without_any_host_sync():
    from sglang_elastic.offload.metrics import AsyncSnapshot

    counters = [torch.arange(2, dtype=torch.int64, device="cuda"), torch.ones(1, dtype=torch.int32, device="cuda")]
    snap = AsyncSnapshot()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        assert snap.take(counters, {}) is None
        assert snap._pending[1].is_pinned()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    values, host, _ = snap.take(counters, {})
    assert values == [0, 1, 1] and host == {}


class _FakeStream:
    """A CUDA stream stand-in that logs the waits made on it (``kept_stream`` on a CPU)."""

    def __init__(self, name, log):
        self.name, self.log, self.device = name, log, torch.device("cpu")

    def wait_stream(self, other):
        self.log.append(("wait", self.name, other.name))


def test_kept_stream_forks_the_kept_launch_beside_the_selection_and_joins_before_the_attention(monkeypatch):
    """``--kv-offload-dense-launch kept_stream=1``: in every sparse layer of a general step the kept requests'
    launch runs on the side stream after it waited for the step's stream, the selection and the estimate on the
    step's stream, and the step's stream waits for the side one before the sparse requests' attention (which
    reuses the partials' workspace and ``out``); outputs still match the references. Fake streams stand in for
    CUDA's (the decoder makes none without a GPU), so the order is what is checked here."""
    import contextlib

    from sglang_elastic.kernels import offload as ko
    from sglang_elastic.offload import decode as dmod

    log = []
    cur, side = _FakeStream("cur", log), _FakeStream("side", log)
    state = {"s": cur}

    @contextlib.contextmanager
    def stream(s):
        prev, state["s"] = state["s"], s
        log.append(("enter", s.name))
        try:
            yield
        finally:
            state["s"] = prev
            log.append(("exit", s.name))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: state["s"])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    every, select, attend, estimate = dmod.OffloadDecoder._every_position, dmod.OffloadDecoder._select, ko.attend_run, ko.estimate_run

    def every_w(self, *a, kept=False, **k):
        log.append(("kept" if kept else "every", state["s"].name))
        return every(self, *a, kept=kept, **k)

    def select_w(self, *a, **k):
        log.append(("select", state["s"].name))
        return select(self, *a, **k)

    def attend_w(*a, **k):
        log.append(("attend", state["s"].name))
        return attend(*a, **k)

    def estimate_w(*a, **k):
        log.append(("estimate", state["s"].name))
        return estimate(*a, **k)

    monkeypatch.setattr(dmod.OffloadDecoder, "_every_position", every_w)
    monkeypatch.setattr(dmod.OffloadDecoder, "_select", select_w)
    monkeypatch.setattr(ko, "attend_run", attend_w)
    monkeypatch.setattr(ko, "estimate_run", estimate_w)
    pol = OffloadPolicy(sink=2, window=8, budget_frac=0.05, max_topk=24, dense_layers=1, denominator="estimate", chunk=8)
    split = dataclasses.replace(SPLIT, dense_min_ctas=4, dense_min_chunk=1024, dense_block_n=32, dense_kept_stream=True)
    sim = Sim(make_pool(pol, keep_v=True), 7, split=split)
    assert sim.dec._kept_stream is None  # no GPU: no stream is made
    sim.dec._kept_stream = side
    sim.keep = {1, 4}
    sim.extend([1, 2, 4], [(0, 300), (0, 260), (0, 120)])
    _, _, worst = sim.run([1, 2, 4], [300, 260, 120], 2)
    assert worst < 2e-2, worst
    forks = [i for i, e in enumerate(log) if e == ("wait", "side", "cur")]
    assert len(forks) >= 2
    for i in forks:
        seg = log[i: log.index(("attend", "cur"), i) + 1]
        assert seg[:4] == [("wait", "side", "cur"), ("enter", "side"), ("kept", "side"), ("exit", "side")], seg
        assert ("select", "cur") in seg and ("estimate", "cur") in seg and seg[-2] == ("wait", "cur", "side"), seg
        assert seg.index(("wait", "cur", "side")) > max(seg.index(("select", "cur")), seg.index(("estimate", "cur")))


def test_the_gpu_pin_fault_check_reads_the_one_line_from_sglangs_log():
    """``scripts/gpu/check_pin_fault.py`` reads the server log SGLang writes when a scheduler fails at start-up: the
    line inside SGLang's traceback, once however often it is logged; a line cut short (the advice wrapped onto the
    next line) is not complete; a log without it has no lines."""
    from gpu_scripts import load_script

    from sglang_elastic.offload import host_pool

    mod = load_script("check_pin_fault")
    line = ("sglang-elastic: could not pin 12.3 GB of host memory for the offload V tier (cudaHostRegister failed (rc=2, out of memory) "
            f"for ptr=0x7f00 size=42 ({host_pool.PIN_FAULT_ENV}=1: injected)): lower --kv-offload-host-gb, or raise the locked-memory limit (ulimit -l)")
    log = ("[2026-12-07 11:00:00] Load weight end.\n[2026-12-07 11:00:01] Scheduler hit an exception: Traceback (most recent call last):\n"
           '  File "scheduler.py", line 1, in run_scheduler_process\n'
           f"RuntimeError: {line}\n\n[2026-12-07 11:00:01] Received sigquit from a child process. It usually means the child failed.\n"
           f"RuntimeError: {line}\n")
    seen = mod.parse_log(log)
    assert seen == {"lines": [line], "injected": True, "complete_on_one_line": True, "traceback": True}
    cut = mod.parse_log(log.replace(", or raise the locked-memory limit", ",\nor raise the locked-memory limit"))
    assert cut["lines"] and not cut["complete_on_one_line"]
    assert mod.parse_log("[x] The server is fired up and ready to roll!\n") == {"lines": [], "injected": False, "complete_on_one_line": False,
                                                                              "traceback": False}


def test_the_select_sweep_of_check_offload_finds_every_setting_equal_on_a_small_shape():
    """``scripts/gpu/check_offload.py --only select_sweep`` on the CPU at a small shape (wall-clock timer): the top-k
    at other ``parts`` / ``block_n`` gives the shipped setting's positions and marks bit for bit (an exact select
    whatever its launch), the estimate at other blocks the shipped partials to float32 rounding; a setting that
    cannot run is recorded, not fatal; a real selection ran (k below the middle)."""
    import time

    from gpu_scripts import load_script

    mod = load_script("check_offload")

    def wall(fn):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    out = {}
    bad = dict(parts=3, block_n=64, num_warps=None)  # parts not a power of two: select_run refuses it
    mod.time_select_sweep(out, bs=2, ctx=1280, key="s", device="cpu", timed=wall, hq=4, hkv=2, d=32,
                          select_grid=[dict(parts=4, block_n=64, num_warps=None), dict(parts=2, block_n=256, num_warps=None), bad],
                          estimate_grid=[dict(block_positions=16, num_warps=None), dict(block_positions=64, num_warps=None)])
    r = out["s"]
    k = OffloadPolicy().counts(1280)[2]  # 5 % of the 1,280 positions less sink and window: 28 of a 1,244-position middle
    assert r["marked"] == 2 * k and 0 < k < 1280 - 4 - 32  # a real select, not all of the middle
    sel, es = r["select"], r["estimate"]
    assert sel["shipped"]["equal"] and es["shipped"]["equal"]
    assert [c["equal"] for c in sel["configs"][:2]] == [True, True] and "power of two" in sel["configs"][2]["error"]
    assert all(c["equal"] and 0 <= c["max_rel_diff"] <= 1e-5 for c in es["configs"])
    assert sel["best"] in sel["configs"][:2] and es["best"] in es["configs"]
    assert sel["best_vs_shipped"] == sel["best"]["ms"] / sel["shipped"]["ms"]
