"""``--kv-offload-copy-timing`` (CPU): the share of V copy time hidden behind compute
(:mod:`sglang_elastic.offload.copytime`), read from events without a host sync.

Events are fakes on a simulated GPU clock: ``record()`` stamps the clock of the
stream it is recorded on (set by the test); ``query()`` says whether the GPU has
passed that stamp. The decode step's events are recorded by the real decoder
(``OffloadDecoder.sparse`` / ``prefetch``) in ``test_offload_pool``'s lifecycle.
"""

from __future__ import annotations

import random

import pytest
import torch

from sglang_elastic.offload import copytime
from sglang_elastic.offload.copytime import CRIT, PREFETCH, STALL, CopyTimer, hidden_share, interval


class Gpu:
    """A simulated GPU: ``now`` is the stamp the next recorded event gets; ``done`` how far the GPU has run."""

    def __init__(self, tick=0.0):
        self.tick = tick  # added to the clock at every record (the decoder test: spans follow the order of records)
        self.now = 0.0
        self.done = float("inf")
        self.recorded = []
        self.waits = []  # the stamps the host waited for

    def event(self):
        gpu = self

        class Event:
            def __init__(self):
                self.t = None

            def record(self):
                gpu.now += gpu.tick
                self.t = gpu.now
                gpu.recorded.append(self)

            def query(self):
                return self.t is not None and self.t <= gpu.done

            def synchronize(self):  # the host waits until the GPU has passed this event
                gpu.waits.append(self.t)
                if self.t is not None:
                    gpu.done = max(gpu.done, self.t)

            def elapsed_time(self, other):
                if self.t is None or other.t is None or not (self.query() and other.query()):
                    raise RuntimeError("cudaErrorNotReady")
                return other.t - self.t

        return Event()


def record(timer, gpu, layer, name, t, main=True):
    gpu.now = t
    timer.mark(layer, name, main)


def step(timer, gpu, layers, key=("bs", 8)):
    """One replayed step: per layer (prefetch copy start/end, stall start/end, residual copy start/end) in ms."""
    timer.begin(key)
    for layer, (p, w, c) in layers.items():
        if p is not None:
            record(timer, gpu, layer, PREFETCH[0], p[0], main=False)
            record(timer, gpu, layer, PREFETCH[1], p[1], main=False)
        if w is not None:
            record(timer, gpu, layer, STALL[0], w[0])
            record(timer, gpu, layer, STALL[1], w[1])
        record(timer, gpu, layer, CRIT[0], c[0])
        record(timer, gpu, layer, CRIT[1], c[1])


def test_hidden_share_counts_the_stall_up_to_the_prefetch_copy_and_every_residual_copy():
    gpu = Gpu()
    t = CopyTimer(every=1, event_factory=gpu.event)
    # layer 2: prefetch copy 3 ms, the compute stream waited 2 ms of it, residual copy 1 ms
    # layer 3: prefetch copy 4 ms, no wait, residual copy 0.5 ms
    # layer 4: prefetch copy 1 ms, waited 5 ms (the guess's selection ran long: only 1 ms of it is copy), residual 2 ms
    step(t, gpu, {2: ((0, 3), (1, 3), (5, 6)), 3: ((10, 14), (20, 20), (21, 21.5)), 4: ((30, 31), (30, 35), (40, 42))})
    assert t.poll()  # before the next step (the backend reads, then begins the step)
    assert t.totals["copy_timed_steps"] == 1
    copy = 3 + 1 + 4 + 0.5 + 1 + 2
    exposed = (2 + 1) + (0 + 0.5) + (1 + 2)
    st = t.stats()
    assert st["copy_ms"] == pytest.approx(copy) and st["copy_exposed_ms"] == pytest.approx(exposed)
    assert st["copy_prefetch_ms"] == pytest.approx(8) and st["copy_stall_ms"] == pytest.approx(7)
    assert st["copy_hidden_share"] == pytest.approx(1 - exposed / copy)


def test_without_prefetch_nothing_is_hidden_and_random_steps_match_a_float64_sum():
    rng = random.Random(7)
    gpu = Gpu()
    t = CopyTimer(every=1, event_factory=gpu.event)
    want_copy = want_exposed = 0.0
    for _ in range(20):
        layers, at = {}, 0.0
        for layer in range(2, 2 + rng.randint(1, 6)):
            crit = rng.uniform(0.01, 2.0)
            if rng.random() < 0.5:
                pf, stall = rng.uniform(0.01, 3.0), rng.uniform(0.0, 4.0)
                layers[layer] = ((at, at + pf), (at + pf, at + pf + stall), (at + 10, at + 10 + crit))
                want_copy += pf + crit
                want_exposed += min(pf, stall) + crit
            else:
                layers[layer] = (None, None, (at, at + crit))
                want_copy += crit
                want_exposed += crit
            at += 20
        step(t, gpu, layers)
        t.poll()
    st = t.stats()
    assert st["copy_timed_steps"] == 20 and t.dropped == 0
    assert st["copy_ms"] == pytest.approx(want_copy, rel=1e-12) and st["copy_exposed_ms"] == pytest.approx(want_exposed, rel=1e-12)
    # a step without prefetch hides nothing
    g2 = Gpu()
    t2 = CopyTimer(every=1, event_factory=g2.event)
    step(t2, g2, {2: (None, None, (0, 1.5)), 3: (None, None, (2, 2.25))})
    assert t2.poll() and t2.stats()["copy_hidden_share"] == 0.0


def test_reading_waits_for_the_gpu_and_every_nth_step_and_drops_a_read_that_races_a_replay():
    gpu = Gpu()
    t = CopyTimer(every=3, event_factory=gpu.event)
    lay = {2: ((0, 1), (0.5, 1), (2, 3))}
    step(t, gpu, lay)
    assert not t.poll()  # 1 step of 3
    step(t, gpu, lay)
    step(t, gpu, lay)
    gpu.done = 2.5  # the GPU has not passed the step's last event (c1 at 3)
    assert not t.poll() and t.totals["copy_timed_steps"] == 0
    gpu.done = float("inf")
    assert t.poll() and t.totals["copy_timed_steps"] == 1
    assert not t.poll()  # read already, no newer replay
    # a newer replay re-recorded the first events after the end event was queried: negative span -> dropped
    for _ in range(3):
        step(t, gpu, lay)
    ev = t._last.events
    ev[(2, CRIT[0])].t = 10.0  # c0 from a newer replay, c1 from the older one
    assert not t.poll() and t.dropped == 1 and t.totals["copy_timed_steps"] == 1
    # due and not yet passed by the GPU when the same graph replays again (the overlap scheduler), wait_due off: counted as unread
    t.wait_due = False
    unread = t.totals["copy_unread_steps"]
    for _ in range(3):
        step(t, gpu, lay)
    gpu.done = 0.5
    assert not t.poll()
    step(t, gpu, lay)  # re-recorded before a read
    step(t, gpu, lay)
    assert t.totals["copy_unread_steps"] == unread + 2 and t.stats()["copy_unread_steps"] == unread + 2
    assert t.totals["copy_waits"] == 0 and gpu.waits == []


def test_under_the_overlap_scheduler_a_due_step_is_waited_for_and_read_before_its_graph_replays_again():
    """The overlap scheduler launches the next replay of the same graph before the GPU passed the step due
    for a read (poll() finds it unfinished): begin() waits for that step's last event on the host once,
    reads it and only then lets the replay re-record the events; every due step is read, none lost."""
    gpu = Gpu()
    t = CopyTimer(every=4, event_factory=gpu.event)
    steps = 40
    for i in range(steps):
        at = 10.0 * i
        step(t, gpu, {2: ((at, at + 2), (at + 1, at + 1.5), (at + 4, at + 5)), 3: (None, None, (at + 6, at + 8))})
        gpu.done = at - 10  # the GPU runs one step behind the host: the step just launched is never finished here
        t.poll()
    st = t.stats()
    assert st["copy_unread_steps"] == 0 and t.dropped == 0
    assert st["copy_waits"] == steps // 4 - 1 and len(gpu.waits) == st["copy_waits"]  # the last due step is not replayed again
    assert st["copy_timed_steps"] == st["copy_waits"]
    n = st["copy_timed_steps"]  # per step: prefetch 2 + residual 1 (layer 2) + residual 2 (layer 3); exposed: 1 + stall 0.5 + 2
    assert st["copy_ms"] == pytest.approx(5.0 * n) and st["copy_exposed_ms"] == pytest.approx(3.5 * n)
    assert st["copy_hidden_share"] == pytest.approx(0.3)
    assert all(w == 10.0 * k + 8 for w, k in zip(gpu.waits, range(3, steps, 4)))  # each wait: the due step's last event (c1 of layer 3)
    # the batch size changes every step (two graphs in turn): a due step is read before the other graph's launch too
    g2 = Gpu()
    t2 = CopyTimer(every=2, event_factory=g2.event)
    for i in range(20):
        at = 10.0 * i
        step(t2, g2, {2: (None, None, (at, at + 1))}, key=("bs", 8 + i % 2))
        g2.done = at - 10
        t2.poll()
    st2 = t2.stats()
    assert st2["copy_unread_steps"] == 0 and st2["copy_waits"] == 9 and st2["copy_timed_steps"] == 9
    assert st2["copy_ms"] == pytest.approx(9.0)


def test_a_capture_is_not_read_and_a_graph_whose_variant_copies_nothing_gives_no_sample():
    gpu = Gpu()
    t = CopyTimer(every=1, event_factory=gpu.event)
    t.begin((8, False), capture=True)  # warm-up and capture record the set's events; no replay yet
    record(t, gpu, 2, CRIT[0], 0)
    record(t, gpu, 2, CRIT[1], 1)
    assert not t.poll() and t.totals["copy_timed_steps"] == 0
    t.begin((8, True), capture=True)  # the all-dense variant: no copy, no event
    t.begin((8, True))  # it replays
    assert not t.poll()
    t.end()  # a prefill
    t.mark(2, CRIT[0])  # outside a decode forward: not recorded
    assert all(e.t in (0, 1) for e in gpu.recorded) and len(gpu.recorded) == 2
    with pytest.raises(ValueError, match="every"):
        CopyTimer(every=0, event_factory=gpu.event)


def test_interval_and_share_helpers():
    assert hidden_share(0.0, 0.0) is None and hidden_share(2.0, 3.0) == 0.0 and hidden_share(4.0, 1.0) == 0.75
    a = {"copy_timed_steps": 2, "copy_ms": 4.0, "copy_exposed_ms": 2.0}
    b = {"copy_timed_steps": 6, "copy_ms": 12.0, "copy_exposed_ms": 4.0}
    assert interval(a, b) == {"copy_hidden_share": 0.75, "copy_ms_per_step": 2.0}
    assert interval(b, b) == {"copy_hidden_share": None, "copy_ms_per_step": None}
    assert interval(None, a)["copy_ms_per_step"] == 2.0


@pytest.mark.parametrize("guess", [None, "next-q"])
def test_the_decoder_records_each_sparse_layers_copy_and_prefetch_events_and_outputs_do_not_change(guess):
    """Through the real decode step (``test_offload_pool.lifecycle``): timing adds events around each
    sparse layer's miss copy (and, with prefetch, around the next layer's prefetch copy) and leaves
    every output bit-identical."""
    from test_offload_pool import lifecycle

    gpu = Gpu(tick=1.0)
    t = CopyTimer(every=1, event_factory=gpu.event)
    fn = None if guess is None else (lambda q: q)
    base, _, sim = lifecycle(resident=False, guess=fn, short=True)
    outs, _, _ = lifecycle(resident=False, guess=fn, short=True, timer=t)
    assert all(torch.equal(a, b) for a, b in zip(base, outs))
    names = {}
    for (layer, name) in t._sets["eager"].events:
        names.setdefault(layer, set()).add(name)
    sparse = set(sim.pool.sparse_layer_ids)
    assert set(names) == sparse
    for layer in sparse:  # no stall events on a CPU: no side stream to wait for
        assert set(CRIT) <= names[layer] <= set(CRIT) | set(PREFETCH), (layer, names[layer])
    # with prefetch, every sparse layer is prefetched while the layer before it runs
    assert all((set(PREFETCH) <= names[layer]) == bool(guess) for layer in sparse)
    st = t.stats()
    # The simulated clock moves 1 ms at each record, and each copy's two events are recorded back to back: a span
    # is 1 ms per sparse layer and step, so the totals count the spans the decoder recorded, sorted by kind
    # (the first version asserted > 0, which the ticking clock guaranteed whatever was recorded).
    n = st["copy_timed_steps"] * len(sparse)
    assert st["copy_timed_steps"] == 2 and st["copy_unread_steps"] == 0  # 3 steps: the last is not read
    assert (st["copy_exposed_ms"], st["copy_prefetch_ms"], st["copy_ms"]) == (n, n if guess else 0.0, 2 * n if guess else n)
    assert st["copy_hidden_share"] == (0.5 if guess else 0.0) and st["copy_stall_ms"] == 0.0 and st["copy_waits"] == 0
    assert copytime.STATS == tuple(k for k in t.stats() if k != "copy_hidden_share")


def test_the_backend_times_each_graph_apart_reads_before_the_next_step_and_skips_the_all_dense_variant():
    """``OffloadAttnBackend._time_step`` as SGLang's decode graph runner drives it: capture per batch size
    (and variant), then replays; a prefill forward records nothing; the all-dense variant's replay is
    not taken for the general graph's (whose events it does not record)."""
    import types

    from sglang_elastic.offload.backend import OffloadAttnBackend

    gpu = Gpu(tick=1.0)
    be = object.__new__(OffloadAttnBackend)
    be.copy_timer = CopyTimer(every=1, event_factory=gpu.event)
    be._mode = "decode"
    be.graph_variants = True
    t = be.copy_timer
    be._time_step((4, False), capture=True)
    t.mark(2, CRIT[0])
    t.mark(2, CRIT[1])
    be._time_step((4, True), capture=True)  # the all-dense variant: no copies
    be._time_step((4, False))  # a replay of the general graph (its nodes re-record the events on the GPU)
    for e in t._sets[(4, False)].events.values():
        e.record()
    be._time_step(None)  # a prefill: reads the replay, records nothing
    assert t.totals["copy_timed_steps"] == 1 and t._cur is None
    be._time_step((4, True))  # the dense variant replays: nothing to read afterwards
    be._time_step(None)
    assert t.totals["copy_timed_steps"] == 1
    from sglang_elastic.offload import keep

    keep._STATE.clear()
    view = types.SimpleNamespace(batch_size=4, num_padding=1)  # SGLang's replay view: 3 requests padded to the graph's 4
    assert be._replays_dense(view) is False  # no keep-v manager: the general graph
    keep._STATE["keep"] = types.SimpleNamespace(all_kept=True, all_kept_bs=3)
    try:
        assert be._replays_dense(view) is True  # as keep.around_resolve_variant picks it, on the raw batch
        assert be._replays_dense(types.SimpleNamespace(batch_size=4, num_padding=0)) is False  # another batch than the one granted
        be.graph_variants = False
        assert be._replays_dense(view) is False  # one graph per batch size (keep-v off, or LoRA)
    finally:
        keep._STATE.clear()
    be.copy_timer = None
    be._time_step((4, False))  # off: nothing happens


def test_the_metrics_line_and_gauges_report_the_intervals_copy_time_and_hidden_share():
    from sglang_elastic.offload.metrics import OffloadMetrics

    m = OffloadMetrics(None)
    clock = iter([100.0, 102.0, 104.0])
    m._clock = lambda: next(clock)
    base = {"hits": 10, "misses": 10, "pcie_read_bytes": 0, "pcie_write_bytes": 0, "decode_steps": 5,
            "copy_timed_steps": 1, "copy_ms": 2.0, "copy_exposed_ms": 2.0}
    m.update(base, used_tokens=0, host_token_bytes=2048)
    line = m.update(dict(base, copy_timed_steps=5, copy_ms=10.0, copy_exposed_ms=4.0), used_tokens=0, host_token_bytes=2048)
    assert "copies 2.00 ms/step, 75% hidden" in line
    line = m.update(dict(base, copy_timed_steps=5, copy_ms=10.0, copy_exposed_ms=4.0), used_tokens=0, host_token_bytes=2048)
    assert "copies" not in line  # no timed step in the interval


def test_the_backends_prefetch_records_its_copy_on_the_side_stream_and_not_as_the_steps_last_event():
    """``OffloadAttnBackend.prefetch`` hands the decoder a clock that records the prefetch's copy events as
    side-stream events: the step's last compute-stream event (what a read waits for) stays the layer's own."""
    import types

    from sglang_elastic.offload.backend import OffloadAttnBackend

    gpu = Gpu(tick=1.0)
    t = CopyTimer(every=1, event_factory=gpu.event)
    seen = {}

    def fake_prefetch(q, kb, vb, scale, r2t, rows, lens, hot, host, record=None, clock=None):
        seen["clock"] = clock
        clock(0)
        clock(1)

    be = object.__new__(OffloadAttnBackend)
    be.copy_timer, be._spec_stream, be._spec_done, be._spec_pending = t, None, {}, {}
    be.q_heads, be.req_to_token = 2, None
    be.decoder = types.SimpleNamespace(prefetch=fake_prefetch)
    be.pool = types.SimpleNamespace(start_layer=0, head_dim=4, get_key_buffer=lambda l: None, get_value_buffer=lambda l: None,
                                    hot_state=lambda l: None, host=types.SimpleNamespace(view=lambda l: None), miss_record=lambda l: None)
    t.begin((8, False))
    t.mark(2, CRIT[1])  # layer 2's own copy ended on the compute stream
    last = t._cur.last_main
    be.prefetch(3, torch.zeros(8, 8), types.SimpleNamespace(req_pool_indices=None, seq_lens=None), 0.5)
    assert seen["clock"] is not None and {(3, PREFETCH[0]), (3, PREFETCH[1])} <= t._cur.used
    assert t._cur.last_main is last and be._spec_done == {3: True}


def test_a_replay_sets_the_variant_it_runs_instead_of_keeping_the_last_captured_one():
    """Review finding: ``_all_dense`` was set only while capturing, so after capture it stayed at the last
    variant captured (the all-dense one); a replay that reruns the step's Python (SGLang's debug graphs)
    would then attend only to kept V for requests that keep none."""
    import types

    from sglang_elastic.offload import keep
    from sglang_elastic.offload.backend import OffloadAttnBackend

    be = object.__new__(OffloadAttnBackend)
    be.pool = types.SimpleNamespace(flush_releases=lambda: None, join_host_writes=lambda: None)
    be._count = lambda fb: None
    be._require = lambda fb: "decode"
    be.copy_timer, be.graph_variants, be._all_dense = None, True, True  # as capture leaves it
    view = types.SimpleNamespace(batch_size=4, num_padding=1)
    keep._STATE.clear()
    try:
        be.init_forward_metadata_out_graph(view)
        assert be._all_dense is False  # no request keeps V: the general variant
        keep._STATE["keep"] = types.SimpleNamespace(all_kept=True, all_kept_bs=3)
        be.init_forward_metadata_out_graph(view)
        assert be._all_dense is True
    finally:
        keep._STATE.clear()
