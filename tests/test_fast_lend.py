"""Issue 22, build 2 (fast lend and reclaim), on the host VMM backend with
real threads: handles made ahead on the arena's helper thread and mapped by
the next lend, releases after a reclaim's unmap on that thread (a failure
there recorded, retried by ``close``: defect 4's guarantees), no
``torch.cuda.empty_cache`` unless the driver's free memory falls short, a
reclaim that waits for the last forward's fence only, before its unmap.

Ordering is forced with ``threading.Event`` s (a backend call or a wait
blocks until the test lets it go), never with sleeps; the joins' timeouts
only keep a broken build from hanging the suite.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from sglang_elastic.vmm import ElasticArena, HostBackend, VmmError

from test_controller import ELASTIC, LAYERS, Bed, sglang_runtime_context  # noqa: F401 (the autouse fixture: SGLang's runtime config)

GRAN = 64 * 1024
ROWS = [2048] * 4 + [1024] * 2
JOIN = 60  # s: a guard against a hang, not a timing


def _arena(**kw):
    be = HostBackend(granularity=GRAN, **kw)
    return be, ElasticArena(be, ROWS, base_tokens=128, max_elastic_tokens=128, step_tokens=64)


class Gate:
    """Blocks the backend call ``name`` made on a thread named ``thread``
    (prefix) until :meth:`open`; ``reached`` is set when one is blocked."""

    def __init__(self, be: HostBackend, name: str, thread: str = "sglang-elastic-vmm"):
        self.reached, self.go, self.name, self.thread = threading.Event(), threading.Event(), name, thread
        self.log = []  # (thread name, call) in call order
        be.on_call = self

    def __call__(self, call: str) -> None:
        me = threading.current_thread().name
        self.log.append((me, call))
        if call == self.name and me.startswith(self.thread) and not self.go.is_set():
            self.reached.set()
            assert self.go.wait(JOIN)

    def open(self) -> None:
        self.go.set()


class HoldRelease:
    """The helper thread's ``n``-th handle release (``cuMemRelease``, buffer by buffer) waits until
    ``go`` is set; ``held`` is set when it waits; ``released`` counts the releases seen."""

    def __init__(self, be: HostBackend, n: int):
        self.n, self.released, self.go, self.held = n, [], threading.Event(), threading.Event()
        be.on_call = self

    def __call__(self, call: str) -> None:
        if call == "release" and threading.current_thread().name.startswith("sglang-elastic-vmm"):
            self.released.append(1)
            if len(self.released) == self.n:
                self.held.set()
                assert self.go.wait(JOIN)

    def reset(self) -> None:
        self.released.clear()
        self.go.clear()
        self.held.clear()


def _run(fn):
    """``fn`` on a plain thread; returns (thread, box of its result or error)."""
    box = {}

    def body():
        try:
            box["result"] = fn()
        except BaseException as e:  # re-raised by the test
            box["error"] = e

    t = threading.Thread(target=body, name="scheduler")
    t.start()
    return t, box


def _fill(be, a, tok0, ntok, seed):
    """Random bytes into tokens [tok0, tok0+ntok) of every buffer; returns them."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for i, r in enumerate(a.row_bytes):
        d = torch.randint(0, 256, (ntok * r,), generator=g, dtype=torch.uint8).numpy().tobytes()
        be.write(a.token_va(i, tok0), d)
        data.append(d)
    return data


# -- the arena's helper thread -------------------------------------------------


@pytest.mark.parametrize("offset_mapping", [True, False], ids=["one-handle-per-step", "handle-per-buffer (H200)"])
def test_handles_made_ahead_on_the_helper_thread_are_the_ones_the_next_lend_maps(offset_mapping):
    be, a = _arena(offset_mapping=offset_mapping)
    gate = Gate(be, name="none")
    assert a.prepare_async().result(JOIN) == 2 and a.prepared_steps == 2
    made = [c for c in gate.log if c[1] in ("create", "map")]
    assert made and {t for t, _ in made} == {"sglang-elastic-vmm_0"}  # created and mapped on the helper, not here
    assert a.prepared_bytes() == 2 * a.step_bytes() and be.live_handles == (1 if offset_mapping else len(ROWS)) * 3
    assert all(a.token_va(i, a.base_tokens + k * 64) in be._maps for i in range(len(ROWS)) for k in (0, 1))  # at the rows they back
    assert a.lent_steps == 0 and a.capacity_tokens == a.base_tokens  # mapped, not lent
    creates, maps = be.calls["create"], be.calls["map"]
    assert a.lend() == 2 and a.prepared_steps == 0
    assert (be.calls["create"], be.calls["map"]) == (creates, maps)  # the lend created and mapped nothing
    data = _fill(be, a, a.base_tokens, 128, seed=1)
    assert [be.read(a.token_va(i, a.base_tokens), 128 * r) for i, r in enumerate(a.row_bytes)] == data
    assert a.reclaim() == 2 and a.settle() == []
    a.close()
    assert be.live_handles == 0 and be._maps == {}


def test_a_lend_waits_for_a_prepare_still_running_and_creates_no_second_set_of_handles():
    be, a = _arena(offset_mapping=False)
    gate = Gate(be, name="create")
    a.prepare_async()
    assert gate.reached.wait(JOIN)  # the helper is inside its first create
    waiting = threading.Event()
    orig = a._wait_helper

    def wait_helper():
        waiting.set()
        orig()

    a._wait_helper = wait_helper
    t, box = _run(a.lend)
    assert waiting.wait(JOIN)  # the lend reached its wait for the helper
    maps = be.calls.get("map", 0)
    assert be.calls.get("map", 0) == maps and t.is_alive()  # nothing mapped while the prepare runs
    gate.open()
    t.join(JOIN)
    assert box == {"result": 2}
    lend_calls = [c for th, c in gate.log if th == "scheduler"]
    assert "create" not in lend_calls and "map" not in lend_calls  # the prepared steps, created and mapped on the helper only
    assert [c for th, c in gate.log if th.startswith("sglang-elastic-vmm")].count("map") == 2 * len(ROWS)
    assert be.live_handles == 3 * len(ROWS)
    a.close()
    assert be.live_handles == 0


def test_a_reclaim_unmaps_at_once_and_releases_on_the_helper_thread_which_settle_and_close_wait_for():
    be, a = _arena()
    a.lend()
    lent_va = a.token_va(0, a.base_tokens)
    gate = Gate(be, name="release")
    assert a.reclaim(release_async=True) == 2
    assert lent_va not in be._maps and a.lent_steps == 0  # unmapped before reclaim returned
    assert gate.reached.wait(JOIN) and a.busy  # the release is on the helper thread, held there
    assert be.live_handles == 3  # the base's handle and two not yet released
    t, box = _run(a.close)  # close must wait for the helper, not free the reservation under it
    gate.open()
    t.join(JOIN)
    assert box == {"result": None} and be.live_handles == 0 and be.calls["free_va"] == 1
    assert [th for th, c in gate.log if c == "release"][:2] == ["sglang-elastic-vmm_0"] * 2


def test_a_release_that_fails_on_the_helper_thread_is_reported_by_settle_and_retried_by_close():
    """Defect 4's guarantee with releases off the critical path: the handle
    is kept, lending stops, close() releases it."""
    be, a = _arena()
    a.lend()
    releases = be.calls.get("release", 0)
    be.fail_on["release"] = lambda n: n == releases + 1
    a.reclaim(release_async=True)
    [err] = a.settle()
    assert isinstance(err, VmmError) and "release failed" in str(err)
    assert a.lending_disabled and a.lend() == 0 and be.live_handles == 2  # the base's handle and the failed one
    assert a.settle() == []  # reported once
    be.fail_on.clear()
    a.close()
    assert be.live_handles == 0


def test_handles_made_ahead_and_dropped_go_back_and_a_failed_prepare_leaves_the_lend_to_create():
    be, a = _arena(offset_mapping=False)
    creates = be.calls["create"]
    be.fail_on["create"] = lambda n: "oom" if n == creates + len(ROWS) + 2 else False  # in the second step's handles
    assert a.prepare_async().result(JOIN) == 1 and a.prepared_steps == 1
    assert be.live_handles == 2 * len(ROWS)  # the base's and one step's: the second's partial handles released
    assert a.settle() == [] and not a.lending_disabled
    be.fail_on.clear()
    assert a.drop_prepared(release_async=True) == 1 and a.settle() == [] and be.live_handles == len(ROWS)
    assert a.prepare(1) == 1
    creates = be.calls["create"]
    assert a.lend() == 2 and be.calls["create"] - creates == len(ROWS)  # one step made ahead, one created by the lend
    a.close()
    assert be.live_handles == 0


# -- the controller ------------------------------------------------------------

ROW = 2 * LAYERS * 2 * 64 * 2  # bytes per token, every layer's K and V: test_pool's shape
MIB = 2**20


class HeldCache:
    """PyTorch's caching allocator holding ``unused`` bytes of the host
    backend's device memory (a real handle), as freed prefill blocks do."""

    def __init__(self, be: HostBackend, unused: int):
        self.be, self.handle, self.held = be, be.create(unused) if unused else None, unused
        self.emptied = 0

    def unused(self) -> int:
        return self.held

    def reusable(self) -> int:  # whole blocks: a large allocation can take them all
        return self.held

    def returnable(self) -> int:  # what empty_cache hands back, as TorchCache says it without expandable segments
        return self.reusable()

    def empty(self) -> None:
        self.emptied += 1
        self.emptied_on = threading.current_thread().name
        if self.handle is not None:
            self.be.release(self.handle)
            self.handle, self.held = None, 0


@pytest.mark.parametrize(
    "free_steps, cached_steps, emptied, lent_steps",
    [
        (2.5, 1, False, 2),  # the driver has both steps and the margin: the cache keeps its blocks
        (1.5, 1, True, 2),  # the driver falls short; the cache's unused blocks make up for it: emptied once
        (1.2, 0.5, False, 1),  # emptying would leave 1.7 steps, still one: not emptied for nothing, the other not tried
        (1.2, 0.9, True, 2),  # 2.1 steps once emptied: emptied once
        (0.5, 0, False, 0),  # nothing cached, no room: no handle is tried
    ],
)
def test_the_lend_empties_torchs_cache_only_when_the_driver_falls_short_and_never_takes_what_the_cache_holds(
        free_steps, cached_steps, emptied, lent_steps, caplog):
    step = 64 * ROW
    margin = 16 * step // MIB + 1  # MiB: whole, and a few steps' worth
    bed = Bed(free_bytes=margin * MIB + 2 * step, margin_mb=margin)
    bed.ctl.lendable_tokens = bed.pool.arena.set_steps(ELASTIC, 64)  # two steps
    cache_bytes = int(cached_steps * step) // 4096 * 4096
    # the device now: the margin, ``free_steps`` steps free at the driver, ``cached_steps`` held by torch's cache
    bed.be.capacity = sum(bed.be._handle_bytes.values()) + margin * MIB + int(free_steps * step) // 4096 * 4096 + cache_bytes
    bed.ctl.torch_cache = cache = HeldCache(bed.be, cache_bytes)
    creates = bed.be.calls["create"]
    with caplog.at_level("WARNING"):
        got = bed.ctl.lend()
    assert got == lent_steps * 64 and bed.pool.arena.lent_steps == lent_steps
    assert cache.emptied == int(emptied)
    assert bed.be.calls["create"] - creates == lent_steps  # one handle per step here: none tried and refused
    assert not [r for r in caplog.records if "out of device memory" in r.getMessage()]
    assert bed.be.free_bytes() >= margin * MIB  # the margin is left free at the driver
    if cache.handle is not None:
        assert cache.handle in bed.be._handle_bytes  # what the cache holds was never released under it
    bed.check_ownership_and_accounting()


def test_the_next_lends_handles_are_made_during_the_decode_run_and_the_lend_only_maps_them():
    bed = Bed(free_bytes=ELASTIC * ROW, margin_mb=0)
    assert bed.admit(list(range(30)))
    gate = Gate(bed.be, name="none")
    ahead = bed.ctl.prepare_after_steps
    for _ in range(ahead - 1):
        bed.ctl.after_prefill(None, bed.batch)
    assert bed.pool.arena.prepared_steps == 0 and not bed.pool.arena.busy
    bed.ctl.after_prefill(None, bed.batch)  # the prepare starts here
    bed.pool.arena.settle()
    assert bed.pool.arena.prepared_steps == 1
    assert {t for t, c in gate.log if c == "create"} == {"sglang-elastic-vmm_0"}
    creates = bed.be.calls["create"]
    for _ in range(bed.ctl.cfg.lend_after_steps - ahead):
        bed.ctl.after_prefill(None, bed.batch)
    assert bed.alloc.lent_tokens == ELASTIC and bed.ctl.lends_prepared == 1
    assert bed.be.calls["create"] == creates  # the lend created nothing
    bed.check_ownership_and_accounting()


def test_the_cut_steps_handles_are_made_ahead_when_the_margin_sits_in_torchs_cache():
    """Seen on the H200 (eager prefill, one 8.6 GiB step): the re-cut counts
    torch's unused cached blocks as margin, the prepare ahead did not, so 110
    of 113 lends created their handles on the lend path (map p50 5.8 ms
    against 3.3 ms for handles made ahead). Now both count it the same way:
    the driver's free memory covers the step, the cache the margin."""
    margin = 1  # MiB
    bed = Bed(free_bytes=ELASTIC * ROW + margin * MIB, margin_mb=margin)
    a = bed.pool.arena
    bed.ctl.torch_cache = cache = HeldCache(bed.be, margin * MIB // 2)  # half the margin now in torch's cache
    assert ELASTIC * ROW <= bed.be.free_bytes() < ELASTIC * ROW + margin * MIB
    assert bed.admit(list(range(30)))
    for _ in range(bed.ctl.prepare_after_steps):
        bed.ctl.after_prefill(None, bed.batch)
    a.settle()
    assert a.prepared_steps == 1 and a.prepared_bytes() == ELASTIC * ROW
    creates = bed.be.calls["create"]
    for _ in range(bed.ctl.cfg.lend_after_steps - bed.ctl.prepare_after_steps):
        bed.ctl.after_prefill(None, bed.batch)
    assert bed.alloc.lent_tokens == ELASTIC and bed.ctl.lends_prepared == 1
    assert bed.be.calls["create"] == creates and cache.emptied == 0  # mapped as made, the cache kept
    assert bed.be.free_bytes() + cache.unused() >= margin * MIB
    # with less than the margin between the driver and the cache, nothing is made ahead
    assert bed.ctl.reclaim(bed.batch)
    a.settle()
    cache.empty()
    bed.ctl.torch_cache = cache = HeldCache(bed.be, margin * MIB // 4)
    hog = bed.be.create(margin * MIB // 2)
    bed.ctl.decode_only_steps = 0
    for _ in range(bed.ctl.prepare_after_steps):
        bed.ctl.after_prefill(None, bed.batch)
    a.settle()
    assert a.prepared_steps == 0
    bed.be.release(hog)
    bed.check_ownership_and_accounting()


def test_after_an_eager_prefill_torchs_cache_is_emptied_and_the_step_made_on_the_helper_so_the_lend_only_maps():
    """Issue 22, ``lend_ms`` p99: the 3 slow lends of 114 on the H100s (13.7-19.1 ms) were each
    the first after a long eager prefill whose blocks torch's cache still held, so the step did
    not fit at the driver, nothing was made ahead, and the lend emptied the cache (8.5-9.4 ms) and
    created the handles (4-6 ms) on the scheduler. Now the prepare ahead empties the cache on
    the helper thread and makes the step there: the lend maps what was made."""
    margin = 1  # MiB
    bed = Bed(free_bytes=ELASTIC * ROW + margin * MIB, margin_mb=margin)
    a = bed.pool.arena
    held = (margin * MIB + ELASTIC * ROW // 2) // 4096 * 4096  # the margin and half the step sit in the prefill's freed blocks
    bed.ctl.torch_cache = cache = HeldCache(bed.be, held)
    assert bed.be.free_bytes() < ELASTIC * ROW  # the step does not fit at the driver without them
    assert bed.admit(list(range(30)))
    gate = Gate(bed.be, name="none")
    margin_on, lend_margin = [], bed.ctl._lend_margin  # it reads the activations' peaks, which the scheduler thread updates

    def recorded_margin():
        margin_on.append(threading.current_thread().name)
        return lend_margin()

    bed.ctl._lend_margin = recorded_margin
    for _ in range(bed.ctl.prepare_after_steps):
        bed.ctl.after_prefill(None, bed.batch)
    a.settle()
    assert cache.emptied == 1 and cache.emptied_on.startswith("sglang-elastic-vmm")  # on the helper thread
    assert margin_on and not [t for t in margin_on if t.startswith("sglang-elastic-vmm")]  # taken before, on this thread
    assert a.prepared_steps == 1 and a.prepared_bytes() == ELASTIC * ROW
    assert {t for t, c in gate.log if c == "create"} == {"sglang-elastic-vmm_0"}
    creates, maps = bed.be.calls["create"], bed.be.calls["map"]
    events = []
    bed.ctl._event = lambda **rec: events.append(rec)
    for _ in range(bed.ctl.cfg.lend_after_steps - bed.ctl.prepare_after_steps):
        bed.ctl.after_prefill(None, bed.batch)
    assert bed.alloc.lent_tokens == ELASTIC and bed.ctl.lends_prepared == 1
    assert (bed.be.calls["create"], bed.be.calls["map"]) == (creates, maps) and cache.emptied == 1  # the lend made and emptied nothing
    lend = [e for e in events if e["op"] == "lend"]
    assert len(lend) == 1 and lend[0]["empty_cache_ms"] == 0 and lend[0]["ahead_empty_cache_ms"] > 0 and lend[0]["prepared_steps"] == 1
    assert bed.be.free_bytes() >= margin * MIB
    bed.check_ownership_and_accounting()
    # with nothing in torch's cache and no room, the prepare ahead tries nothing and empties nothing
    assert bed.ctl.reclaim(bed.batch)
    a.settle()
    bed.ctl.torch_cache = cache = HeldCache(bed.be, 0)
    hog = bed.be.create(ELASTIC * ROW // 2 // 4096 * 4096)
    bed.ctl.decode_only_steps = 0
    creates = bed.be.calls["create"]
    for _ in range(bed.ctl.prepare_after_steps):
        bed.ctl.after_prefill(None, bed.batch)
    a.settle()
    assert a.prepared_steps == 0 and cache.emptied == 0 and bed.be.calls["create"] == creates
    bed.be.release(hog)
    bed.check_ownership_and_accounting()


class SplitCache(HeldCache):
    """torch's cache whose unused bytes are split remainders of live segments: ``empty_cache`` returns none."""

    def __init__(self, be: HostBackend, unused: int):
        super().__init__(be, 0)
        self.held = unused

    def reusable(self) -> int:
        return 0

    def empty(self) -> None:
        self.emptied += 1


@pytest.mark.parametrize("kind", ["split remainders", "whole blocks short of the step", "split remainders, two steps"])
def test_the_prepare_ahead_never_empties_torchs_cache_when_that_cannot_back_the_step(kind):
    """Emptying costs a device-wide wait and the next eager prefill's allocations: only where the cache's whole
    blocks, back at the driver, would back the step (once a run), never on every pass of the run, nor at the
    lend (one step or several: ``--elastic-kv-handle-mb``)."""
    margin = 1  # MiB
    bed = Bed(free_bytes=ELASTIC * ROW + margin * MIB, margin_mb=margin)
    a = bed.pool.arena
    if kind.endswith("two steps"):
        bed.ctl.lendable_tokens = a.set_steps(ELASTIC, 64)
    hog = bed.be.create((margin * MIB + ELASTIC * ROW // 2) // 4096 * 4096)  # the driver is half a step short
    if kind.startswith("split remainders"):
        bed.ctl.torch_cache = cache = SplitCache(bed.be, 4 * MIB)
    else:  # a quarter step of whole blocks: half a step short once emptied
        bed.be.release(hog)
        hog = bed.be.create((margin * MIB + ELASTIC * ROW // 2) // 4096 * 4096 - ELASTIC * ROW // 4 // 4096 * 4096)
        bed.ctl.torch_cache = cache = HeldCache(bed.be, ELASTIC * ROW // 4 // 4096 * 4096)
    assert bed.admit(list(range(30)))
    for _ in range(bed.ctl.cfg.lend_after_steps):  # the whole run, and its lend (which re-cuts the step to what fits)
        bed.ctl.after_prefill(None, bed.batch)
        a.settle()
    assert cache.emptied == 0 and bed.ctl.lends_prepared == 0
    assert bed.alloc.lent_tokens < ELASTIC  # a smaller step, if any: the cache's blocks could not back the whole one
    assert bed.ctl.reclaim(bed.batch) or bed.alloc.lent_tokens == 0
    a.settle()
    bed.be.release(hog)
    bed.check_ownership_and_accounting()


def test_torch_cache_says_what_empty_cache_returns_by_the_allocator_settings(monkeypatch):
    from sglang_elastic.sched.controller import TorchCache

    for conf, expandable in [("expandable_segments:True", True), ("max_split_size_mb:128, expandable_segments : true", True),
                             ("expandable_segments:False", False), ("", False)]:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
        c = TorchCache()
        c.unused, c.reusable = (lambda: 7 << 20), (lambda: 3 << 20)  # 4 MiB of split remainders
        assert c.expandable is expandable and c.returnable() == (7 << 20 if expandable else 3 << 20), conf


class ExpandableCache(HeldCache):
    """``expandable_segments:True``: the freed blocks sit beside live ones (counted as split remainders),
    and ``empty_cache`` unmaps them all the same."""

    def reusable(self) -> int:
        return 0

    def returnable(self) -> int:
        return self.held


@pytest.mark.parametrize("steps", [1, 2], ids=["one step", "two steps"])
def test_with_expandable_segments_the_lend_still_empties_the_cache_that_holds_the_step(steps):
    """A review of 13c2d6e: its prediction from split-free blocks alone said emptying could not help under
    expandable segments, so the lend lent nothing where the code before it emptied and lent."""
    margin = 1  # MiB
    bed = Bed(free_bytes=ELASTIC * ROW + margin * MIB, margin_mb=margin)
    if steps == 2:
        bed.ctl.lendable_tokens = bed.pool.arena.set_steps(ELASTIC, 64)
    bed.ctl.torch_cache = cache = ExpandableCache(bed.be, (margin * MIB + ELASTIC * ROW // 2) // 4096 * 4096)
    assert bed.be.free_bytes() < ELASTIC * ROW
    assert bed.ctl.lend() == ELASTIC and cache.emptied == 1
    bed.check_ownership_and_accounting()


def test_an_emptying_that_gives_back_less_than_said_is_not_repeated_and_its_time_stays_with_its_run():
    """A CUDA graph's private pool: its free blocks count as unused and whole, and ``empty_cache`` keeps
    them. The first emptying ahead finds that out (no step made); neither the lend nor the next run
    empties again, and a later lend reports no emptying of its own (a review of 13c2d6e: two emptyings a
    run, and the stale time reported by the next run's lend)."""
    margin = 1  # MiB
    bed = Bed(free_bytes=ELASTIC * ROW + margin * MIB, margin_mb=margin)

    class GraphPoolCache(HeldCache):
        def empty(self):
            self.emptied += 1  # nothing comes back

    pool_bytes = (margin * MIB + ELASTIC * ROW // 2) // 4096 * 4096
    bed.ctl.torch_cache = cache = GraphPoolCache(bed.be, pool_bytes)
    assert bed.admit(list(range(30)))
    events = []
    bed.ctl._event = lambda **rec: events.append(rec)
    for _ in range(bed.ctl.prepare_after_steps):
        bed.ctl.after_prefill(None, bed.batch)
    bed.pool.arena.settle()
    assert cache.emptied == 1 and bed.pool.arena.prepared_steps == 0 and bed.ctl._empty_overstated == pool_bytes
    bed.ctl.after_prefill(bed.batch, bed.batch)  # a prompt: the run ends without its lend
    for _ in range(bed.ctl.cfg.lend_after_steps):  # the next run and its lend: nothing emptied again
        bed.ctl.after_prefill(None, bed.batch)
    bed.pool.arena.settle()
    assert cache.emptied == 1
    lends = [e for e in events if e["op"] == "lend"]
    assert lends and all(e["ahead_empty_cache_ms"] == 0 and e["empty_cache_ms"] == 0 for e in lends)  # a smaller cut lent
    bed.check_ownership_and_accounting()


def test_an_eager_prefill_during_the_emptying_ahead_gets_the_memory_and_no_step_is_made_for_the_lend(caplog):
    """The job empties torch's cache, then an eager forward comes: it waits for the emptying only (the step it
    would drop at once is not made), and the next lend's event carries no emptying of its own. A failure in the
    emptying is not lost on the helper: logged, reported by settle, lending off."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    from test_controller import _graph_args

    margin = 1  # MiB
    bed = Bed(server_args=_graph_args(cuda_graph_backend_prefill=Backend.DISABLED), free_bytes=ELASTIC * ROW + margin * MIB,
              margin_mb=margin)
    a = bed.pool.arena

    class BlockingCache(HeldCache):  # its emptying on the helper thread waits for the test
        def __init__(self, be, unused):
            super().__init__(be, unused)
            self.reached, self.go = threading.Event(), threading.Event()

        def empty(self):
            if threading.current_thread().name.startswith("sglang-elastic-vmm"):
                self.reached.set()
                assert self.go.wait(JOIN)
            super().empty()

    bed.ctl.torch_cache = cache = BlockingCache(bed.be, (margin * MIB + ELASTIC * ROW // 2) // 4096 * 4096)
    assert bed.admit(list(range(30)))
    for _ in range(bed.ctl.prepare_after_steps):
        bed.ctl.after_prefill(None, bed.batch)
    assert cache.reached.wait(JOIN)  # the job is emptying the cache
    gate = Gate(bed.be, name="none")
    bed.sched.waiting_queue.append(bed.request(list(range(500, 600))))  # an eager prefill: it needs that memory
    t, box = _run(lambda: bed.ctl.before_prefill(bed.batch))
    assert bed.ctl._ahead_cancel.wait(JOIN)  # before it waits for the job
    cache.go.set()
    t.join(JOIN)
    assert not t.is_alive() and "error" not in box
    bed.ctl.after_prefill(bed.batch, bed.batch)
    assert cache.emptied == 1 and not [c for c in gate.log if c[1] == "create"]  # emptied, no step made for the lend
    assert a.prepared_steps == 0 and bed.be.free_bytes() >= ELASTIC * ROW + margin * MIB  # all of it free for the forward
    # the next run (the prompt served): nothing in the cache, the step fits; its lend carries no emptying
    bed.sched.waiting_queue.clear()
    events = []
    bed.ctl._event = lambda **rec: events.append(rec)
    for _ in range(bed.ctl.cfg.lend_after_steps):
        bed.ctl.after_prefill(None, bed.batch)
    lend = [e for e in events if e["op"] == "lend"]
    assert bed.alloc.lent_tokens == ELASTIC and len(lend) == 1 and lend[0]["ahead_empty_cache_ms"] == 0 and lend[0]["empty_cache_ms"] == 0
    # a failure in the emptying: reported, lending off, no step
    assert bed.ctl.reclaim(bed.batch)
    a.settle()

    class FailingCache(HeldCache):
        def empty(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    bed.ctl.torch_cache = FailingCache(bed.be, (margin * MIB + ELASTIC * ROW // 2) // 4096 * 4096)
    bed.ctl.decode_only_steps = 0
    creates = bed.be.calls["create"]
    with caplog.at_level("ERROR"):
        for _ in range(bed.ctl.prepare_after_steps):
            bed.ctl.after_prefill(None, bed.batch)
        errors = a.settle()
    assert [str(e) for e in errors] == ["CUDA error: an illegal memory access was encountered"]
    assert a.lending_disabled and bed.be.calls["create"] == creates and not a.preparing
    assert any("making a step ahead" in r.getMessage() for r in caplog.records)
    bed.check_ownership_and_accounting()


def test_handles_made_ahead_are_released_when_an_eager_forward_comes_instead_of_the_lend():
    from sglang.srt.model_executor.cuda_graph_config import Backend

    from test_controller import _graph_args

    bed = Bed(server_args=_graph_args(cuda_graph_backend_prefill=Backend.DISABLED), free_bytes=ELASTIC * ROW, margin_mb=0)
    assert bed.admit(list(range(30)))
    for _ in range(bed.ctl.prepare_after_steps):
        bed.ctl.after_prefill(None, bed.batch)
    bed.pool.arena.settle()
    assert bed.pool.arena.prepared_steps == 1
    held = bed.be.free_bytes()
    bed.sched.waiting_queue.append(bed.request(list(range(500, 600))))  # an eager prefill: it needs that memory
    bed.ctl.before_prefill(bed.batch)
    bed.ctl.after_prefill(bed.batch, bed.batch)  # the forward's turn: the release is done by then
    assert bed.pool.arena.prepared_steps == 0 and not bed.pool.arena.busy and bed.be.free_bytes() == held + ELASTIC * ROW


class Fences:
    """The device's fences as a test drives them: the first ``record`` (the
    forward's) is a fence the test completes (``set``), later ones (the
    vacate's device work, synchronous on the host) are complete; ``wait``
    blocks on a fence (``waiting`` set)."""

    def __init__(self):
        self.made, self.waiting, self.order = [], threading.Event(), []

    def record(self):
        f = threading.Event()
        if self.made:
            f.set()
        self.made.append(f)
        return f

    def order_after(self, fence) -> None:
        self.order.append(fence)

    def wait(self, fence) -> None:
        if fence is not None and not fence.is_set():
            self.waiting.set()
            assert fence.wait(JOIN)


def test_a_reclaim_vacates_while_the_last_forward_runs_and_its_unmap_waits_for_that_fence_on_the_helper_thread(monkeypatch):
    bed = Bed(free_bytes=ELASTIC * ROW, margin_mb=0)
    bed.ctl.fences = fences = Fences()
    syncs = []
    monkeypatch.setattr(bed.be, "synchronize", lambda: syncs.append(1))
    assert bed.ctl.lend() == ELASTIC
    bed.finish(bed.admit(list(range(20000, 20200))))  # base tokens cached: the lent KV must move
    req = bed.admit(list(range(1000, 1100)))
    row = bed.rows()[req.rid]
    assert int(row.max()) >= bed.alloc.base_tokens  # in lent rows
    k = bed.kv_of(row)
    bed.ctl.after_forward()  # SGLang launched a forward reading these rows
    [fwd] = fences.made
    assert not fwd.is_set()
    lent_va = bed.pool.arena.token_va(0, bed.alloc.base_tokens)
    assert bed.ctl.reclaim(bed.batch, why="test")  # returns while the forward still runs: the scheduler does not wait for it
    moved = bed.rows()[req.rid]
    assert int(moved.max()) < bed.alloc.base_tokens and torch.equal(bed.kv_of(moved), k)  # vacated
    assert fences.waiting.wait(JOIN)  # the helper thread waits on the forward's fence ...
    assert lent_va in bed.be._maps and syncs == [] and bed.pool.arena.busy  # ... before it unmaps; no device-wide synchronize
    assert fences.order[0] is fwd  # the vacate's device work was queued after the forward
    assert bed.alloc.lent_tokens == 0 and bed.pool.arena.lent_steps == 0  # out of the lent range already
    fwd.set()
    bed.ctl.after_prefill(None, bed.batch)  # the next forward's turn: the unmap and the release are done by then
    assert lent_va not in bed.be._maps and syncs == [] and not bed.pool.arena.busy
    bed.check_ownership_and_accounting()


def test_with_nothing_to_move_no_stream_work_is_ordered_after_the_forward_and_the_reclaim_waits_only_before_the_unmap(monkeypatch):
    """The H200 (2026-12-04): with 40 decodes in flight and nothing to move,
    the reclaim's host work took ~8 ms at p99: it had ordered its stream after
    the forward first, so the free-list reads (``withdraw``) waited for it.
    The stream is ordered only before copies now; the wait for the forward
    is the one before the unmap."""
    bed = Bed(free_bytes=ELASTIC * ROW, margin_mb=0)
    bed.ctl.fences = fences = Fences()
    assert bed.admit(list(range(50)))  # in the base (nothing lent yet)
    assert bed.ctl.lend() == ELASTIC
    bed.ctl.after_forward()
    [fwd] = fences.made
    assert bed.ctl.reclaim(bed.batch, why="test")  # the scheduler's part: no wait for the forward
    assert fences.waiting.wait(JOIN)  # the helper is blocked on the forward's fence, the unmap's wait only
    assert fences.order == [] and bed.alloc.lent_tokens == 0  # nothing queued after the forward; withdrawn already
    fwd.set()
    bed.ctl.after_prefill(None, bed.batch)
    assert bed.pool.arena.lent_steps == 0 and not bed.pool.arena.busy
    bed.check_ownership_and_accounting()


def test_a_reclaims_handles_are_released_on_the_helper_and_the_forward_after_it_waits_for_them(tmp_path, monkeypatch):
    from sglang_elastic import config

    events = tmp_path / "events.jsonl"
    monkeypatch.setenv(config.EVENTS_ENV, str(events))
    bed = Bed(free_bytes=ELASTIC * ROW, margin_mb=0)
    assert bed.ctl.lend() == ELASTIC
    assert bed.admit(list(range(30)))
    gate = Gate(bed.be, name="release")
    assert bed.ctl.reclaim(bed.batch, why="test")
    assert gate.reached.wait(JOIN) and bed.pool.arena.busy  # released there, after reclaim() returned
    free_then = bed.be.free_bytes()
    settled = threading.Event()
    orig = bed.pool.arena.settle

    def settle():
        settled.set()
        return orig()

    bed.pool.arena.settle = settle
    t, box = _run(lambda: bed.ctl.after_prefill(bed.batch, bed.batch))  # a batch formed: its forward needs the memory
    assert settled.wait(JOIN) and t.is_alive()  # held until the release is done
    gate.open()
    t.join(JOIN)
    assert "error" not in box and bed.be.free_bytes() == free_then + ELASTIC * ROW
    import json

    [rec] = [json.loads(line) for line in events.read_text().splitlines() if '"reclaim"' in line]
    assert rec["release_wait_ms"] >= 0 and rec["release_failed"] == 0 and rec["steps"] == 1
    # the vacate's parts (withdraw: reads the free list on the device; make_room: eviction, retraction) lie within it
    assert 0 < rec["withdraw_ms"] and 0 < rec["make_room_ms"] and rec["withdraw_ms"] + rec["make_room_ms"] <= rec["vacate_ms"]
    bed.check_ownership_and_accounting()


def test_a_failed_release_on_the_helper_is_counted_turns_lending_off_and_close_releases_it(caplog):
    bed = Bed(free_bytes=ELASTIC * ROW, margin_mb=0)
    assert bed.ctl.lend() == ELASTIC
    releases = bed.be.calls.get("release", 0)
    bed.be.fail_on["release"] = lambda n: n == releases + 1
    assert bed.ctl.reclaim(bed.batch, why="test")
    with caplog.at_level("ERROR"):
        bed.ctl.after_prefill(bed.batch, bed.batch)
    assert [r for r in caplog.records if "helper thread" in r.getMessage() and "lending disabled" in r.getMessage()]
    for _ in range(bed.ctl.cfg.lend_after_steps + 1):
        bed.ctl.after_prefill(None, bed.batch)
    assert bed.alloc.lent_tokens == 0  # no lend after it
    bed.be.fail_on.clear()
    live = bed.be.live_handles
    bed.pool.arena.close()
    assert live == 2 and bed.be.live_handles == 0  # the base's handle and the failed one, both gone


def test_a_one_step_lend_that_no_longer_fits_is_cut_to_what_is_free_and_grows_back_when_it_is(caplog):
    """Seen on the H200 with SGLang's default prefill graphs: the start-up
    measure (free after capture less the margin) left no slack, the server
    took a little more memory for good, and the one 8 GiB step never fit
    again: three lends lent nothing and lending went off for the whole run.
    The step is now cut to what is free, lent and reclaimed as often as
    before, and grows back once the memory is free again."""
    from sglang_elastic.sched.controller import MAX_OOM_LENDS

    margin = 1  # MiB
    bed = Bed(free_bytes=ELASTIC * ROW + margin * MIB, margin_mb=margin)
    a = bed.pool.arena
    assert bed.ctl.lendable_tokens == ELASTIC and a.max_steps == 1
    other = bed.be.create(ELASTIC * ROW // 4 // 4096 * 4096)  # taken for good after start-up by someone else
    want = (bed.be.free_bytes() - margin * MIB) // ROW // a.quantum * a.quantum
    assert 0 < want < ELASTIC
    for cycle in range(MAX_OOM_LENDS + 2):
        with caplog.at_level("INFO"):
            assert bed.ctl.lend() == want, cycle
        assert a.lent_steps == 1 and a.lent_tokens == want and bed.alloc.lent_tokens == want
        assert bed.be.free_bytes() >= margin * MIB  # the margin stays free at the driver
        assert bed.admit(list(range(40)))  # spills into the cut step
        assert bed.ctl.reclaim(bed.batch)
        bed.check_ownership_and_accounting()
    assert not bed.ctl.disabled and bed.ctl.state()["lendable_tokens"] == want
    # torch's cache holding less than a token quantum cannot grow the cut: it is not emptied at every lend (review finding)
    bed.be.release(other)
    other = bed.be.create(ELASTIC * ROW // 4 - 4096)
    bed.ctl.torch_cache = cache = HeldCache(bed.be, 4096)  # 4 KiB of what the other user held is in torch's cache now
    assert bed.ctl.lend() == want and cache.emptied == 0 and bed.ctl.reclaim(bed.batch)
    # holding a quantum more, the cut grows by it without emptying: the driver backs the step, the margin now
    # sits in the cache's blocks (they serve the next eager forward, which is what the margin is for)
    cache.empty()
    bed.be.release(other)
    other = bed.be.create(ELASTIC * ROW // 4 - a.quantum * ROW)
    bed.ctl.torch_cache = cache = HeldCache(bed.be, a.quantum * ROW)
    assert bed.ctl.lend() == want + a.quantum and cache.emptied == 0
    assert bed.be.free_bytes() + cache.unused() >= margin * MIB
    assert bed.ctl.reclaim(bed.batch)
    cache.empty()
    assert sum("the lend step is now" in r.getMessage() for r in caplog.records) == 1  # cut once, not at every lend
    bed.be.release(other)
    assert bed.ctl.lend() == ELASTIC and a.lent_tokens == ELASTIC  # the memory is back: the step grows to the start-up measure
    # less than a quarter of the start-up measure free (MIN_CUT_FRAC): a lend without memory, as before
    # (lending stops after MAX_OOM_LENDS of them)
    assert bed.ctl.reclaim(bed.batch)
    bed.pool.arena.settle()  # the reclaim's handles are released on the helper thread
    hog = bed.be.create((bed.be.free_bytes() - margin * MIB - ELASTIC * ROW // 5) // 4096 * 4096)
    for _ in range(MAX_OOM_LENDS):
        assert bed.ctl.lend() == 0 and a.lent_steps == 0
    assert bed.ctl.disabled
    bed.be.release(hog)
    bed.check_ownership_and_accounting()


def test_a_cut_lend_step_grows_back_only_by_a_share_of_the_start_up_measure_so_handles_are_not_remade_at_every_lend(monkeypatch):
    from sglang_elastic.sched import controller

    monkeypatch.setattr(controller, "RECUT_GROW_DIV", 4)  # grows by 32 tokens (two quanta) or more at once, here
    margin = 1  # MiB
    bed = Bed(free_bytes=ELASTIC * ROW + margin * MIB, margin_mb=margin)
    a = bed.pool.arena
    other = bed.be.create(ELASTIC * ROW // 4 // 4096 * 4096)
    assert bed.ctl.lend() == 96 and bed.ctl.reclaim(bed.batch)
    a.settle()
    bed.be.release(other)
    other = bed.be.create(ELASTIC * ROW // 4 - a.quantum * ROW)  # one quantum back: 112 would fit, but 16 < 32
    bed.ctl.torch_cache = cache = HeldCache(bed.be, 0)
    assert bed.ctl.lend() == 96 and a.prepared_steps == 0 and bed.ctl.reclaim(bed.batch)
    a.settle()
    # made ahead during the next decode run at the cut that stays, then mapped by the lend as they are
    assert bed.admit(list(range(30)))
    for _ in range(bed.ctl.prepare_after_steps):
        bed.ctl.after_prefill(None, bed.batch)
    a.settle()
    assert a.prepared_steps == 1
    creates = bed.be.calls["create"]
    for _ in range(bed.ctl.cfg.lend_after_steps - bed.ctl.prepare_after_steps):
        bed.ctl.after_prefill(None, bed.batch)
    assert bed.alloc.lent_tokens == 96 and bed.be.calls["create"] == creates and cache.emptied == 0
    assert bed.ctl.reclaim(bed.batch)
    a.settle()
    bed.be.release(other)  # all of it back: 32 more, it grows
    assert bed.ctl.lend() == ELASTIC and bed.ctl.state()["lendable_tokens"] == ELASTIC
    assert bed.ctl.reclaim(bed.batch)
    a.settle()
    # cut by less than the growth step (one quantum), it still grows back to the whole measure (review finding)
    other = bed.be.create(a.quantum * ROW)
    assert bed.ctl.lend() == ELASTIC - a.quantum and bed.ctl.reclaim(bed.batch)
    a.settle()
    bed.be.release(other)
    assert bed.ctl.lend() == ELASTIC and bed.ctl.reclaim(bed.batch)
    bed.check_ownership_and_accounting()


def test_emptying_a_cache_that_gives_back_little_never_shrinks_the_cut(monkeypatch):
    """Review finding: the cache's unused bytes promised growth, emptying gave back only what
    whole segments held, and the re-measure shrank the cut below the one that fitted before,
    dropping the handles made ahead for it."""
    from sglang_elastic.sched import controller

    monkeypatch.setattr(controller, "RECUT_GROW_DIV", 4)

    class PartialCache(HeldCache):  # unused bytes of which only part can be handed back (blocks inside live segments)
        def __init__(self, be, unused, releasable):
            super().__init__(be, 0)
            self.held, self.handle, self.rest = unused, be.create(releasable), unused - releasable

        def empty(self):
            self.emptied += 1
            if self.handle is not None:
                self.be.release(self.handle)
                self.handle, self.held = None, self.rest

    bed = Bed(free_bytes=ELASTIC * ROW + MIB, margin_mb=1)
    a = bed.pool.arena
    other = bed.be.create(2 * a.quantum * ROW)
    assert bed.ctl.lend() == 96 and bed.ctl.reclaim(bed.batch)
    a.settle()
    bed.be.release(other)
    assert a.prepare(1) == 1 and a.prepared_steps == 1  # handles made ahead for the cut of 96
    bed.ctl.torch_cache = cache = PartialCache(bed.be, 40 * ROW, 4096)
    hold = bed.be.create(40 * ROW - 4096)  # the rest of the cache's unused bytes, held in live segments
    creates = bed.be.calls["create"]
    got = bed.ctl.lend()
    assert got >= 96 and a.lendable_tokens == got
    if got == 96:
        assert bed.be.calls["create"] == creates  # the handles made ahead were mapped, not dropped and remade
    assert bed.ctl.reclaim(bed.batch)
    a.settle()
    cache.empty()
    bed.be.release(hold)
    bed.check_ownership_and_accounting()


def test_a_lend_of_handles_made_ahead_does_not_empty_torchs_cache_when_its_blocks_hold_part_of_the_margin():
    """Eager prefill on the H200: every lend had its handles made ahead, yet the
    cache was emptied in half of them (p99 9.8 ms of a 16 ms lend): the prefill's
    freed activations sat in torch's cache, the driver's free memory was below
    the margin, and the re-cut emptied the cache to keep the step. Cached blocks
    serve the next eager forward, which is what the margin is for: the cut stays."""
    margin = 1  # MiB
    bed = Bed(free_bytes=ELASTIC * ROW + margin * MIB, margin_mb=margin)
    a = bed.pool.arena
    assert bed.admit(list(range(30)))
    for _ in range(bed.ctl.prepare_after_steps):
        bed.ctl.after_prefill(None, bed.batch)
    a.settle()
    assert a.prepared_steps == 1
    bed.ctl.torch_cache = cache = HeldCache(bed.be, margin * MIB // 2)  # half the margin now in torch's cache
    creates = bed.be.calls["create"]
    for _ in range(bed.ctl.cfg.lend_after_steps - bed.ctl.prepare_after_steps):
        bed.ctl.after_prefill(None, bed.batch)
    assert bed.alloc.lent_tokens == ELASTIC and bed.ctl.lends_prepared == 1 and bed.be.calls["create"] == creates
    assert cache.emptied == 0 and cache.handle in bed.be._handle_bytes
    assert bed.ctl.reclaim(bed.batch)
    cache.empty()
    bed.check_ownership_and_accounting()


class Peaks:
    """The caching allocator's peak counter as a test drives it (``PeakMemory``'s stand-in)."""

    available = True

    def __init__(self):
        self.allocated = self.top = 7 * MIB

    def reset(self) -> int:
        self.top = self.allocated
        return self.allocated

    def peak(self) -> int:
        return self.top


def _extend_batch(reqs, tokens, **kw):
    """SGLang's ``ScheduleBatch`` as ``run_batch`` gets it, the fields the measurement reads."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return SimpleNamespace(**{"forward_mode": ForwardMode.EXTEND, "extend_num_tokens": tokens, "reqs": list(reqs), "return_logprob": False,
                              "return_hidden_states": False, "input_embeds": None, **kw})


def eager_prefill(bed, peaks, took, n=1, tokens=None, **attrs):
    """One eager prefill pass on ``bed`` as SGLang runs it: ``n`` waiting requests (``attrs`` set on each) form a
    prefill of ``tokens`` (default: the chunk) that takes ``took`` bytes at its peak; returns the need
    ``before_prefill`` gave the pass (None: not asked)."""
    from sglang_elastic.sched import hooks

    ctl = bed.ctl
    tokens = tokens or bed.sched.server_args.chunked_prefill_size
    reqs = [bed.request(list(range(1000 + 100 * j, 1100 + 100 * j))) for j in range(n)]
    for r in reqs:
        for k, v in attrs.items():
            setattr(r, k, v)
    bed.sched.waiting_queue.extend(reqs)
    ctl.before_prefill(bed.batch)  # reads the last pass's peak, starts this one's
    need = ctl._pass_need
    if need is not None:  # steps_needed asked: a reclaim's room is the need beyond the driver's free bytes and torch's cache
        assert ctl._pass_room == max(need - sum(ctl._pass_free), 0)
    bed.sched.waiting_queue.clear()
    ctl.after_prefill(_extend_batch(reqs, tokens), bed.batch)
    peaks.top = peaks.allocated + took
    hooks._after_run_batch(None, bed.sched, _extend_batch(reqs, tokens))  # SGLang's run_batch(batch) AFTER hook
    return need


def measured_eager_bed(monkeypatch, free_bytes):
    """A bed whose prefills run eagerly (no prefill graphs) under ``--elastic-kv-activation-rule measured``, no
    margin, 30 tokens admitted, a :class:`Peaks` as its peak-memory probe; the rule's 256 MiB slack off (the
    bed's step is 128 KiB). Returns ``(bed, peaks)``."""
    import dataclasses

    from sglang.srt.model_executor.cuda_graph_config import Backend

    from sglang_elastic.sched import controller
    from test_controller import _graph_args

    monkeypatch.setattr(controller, "MEASURED_SLACK_MB", 0)
    bed = Bed(server_args=_graph_args(cuda_graph_backend_prefill=Backend.DISABLED), free_bytes=free_bytes, margin_mb=0)
    bed.ctl.peak_memory = peaks = Peaks()
    bed.ctl.cfg = dataclasses.replace(bed.ctl.cfg, activation_rule="measured")
    assert bed.admit(list(range(30)))
    return bed, peaks


def test_an_eager_prefill_reclaims_by_what_eager_prefill_passes_took_with_the_measured_rule(caplog):
    """Seen on the H200: SGLang's estimate for a chunk of 8,192 tokens (12.9 GiB)
    is more than the 8.6 GiB lent, so every eager prefill reclaimed the whole
    step (8.6 / 15.0 ms). Every eager prefill pass is measured (its peak read
    when the next pass begins, so the sampling that the overlap scheduler runs
    after run_batch counts); with --elastic-kv-activation-rule measured the next
    plain prefill is taken to need 1.25x that plus 256 MiB, scaled by the
    requests it may hold; memory free for that skips the reclaim. A request
    that is not plain, or the default rule, keeps SGLang's estimate."""
    import dataclasses

    from sglang.srt.model_executor.cuda_graph_config import Backend

    from sglang_elastic.sched.controller import MEASURED_SAFETY, MEASURED_SLACK_MB, eager_activation_bytes
    from test_controller import _graph_args

    room = 400 * MIB  # free at the driver while lent
    bed = Bed(server_args=_graph_args(cuda_graph_backend_prefill=Backend.DISABLED), free_bytes=ELASTIC * ROW + room, margin_mb=0)
    ctl, peaks = bed.ctl, Peaks()
    ctl.peak_memory = peaks
    assert not ctl.prefill_in_graphs and ctl.cfg.activation_rule == "sglang"  # the default, until a GPU run shows the rule safe
    ctl.cfg = dataclasses.replace(ctl.cfg, activation_rule="measured")
    budget = bed.sched.server_args.chunked_prefill_size  # what reserve_needed gives an eager prefill
    estimate = eager_activation_bytes(budget)
    assert estimate > room
    assert bed.admit(list(range(30)))

    def prefill(took, n=1, tokens=budget, **kw):  # one pass: SGLang forms an eager prefill of n requests and runs it
        return eager_prefill(bed, peaks, took, n, tokens, **kw)

    # measured while nothing is lent too; a pass's peak is read when the next pass begins
    prefill(took=60 * MIB)  # nothing lent: nothing to reclaim, but measured
    assert ctl.activations.measured == 0 and ctl._measuring["requests"] == 1 and ctl._measuring["plain"]
    assert ctl.lend() == ELASTIC and bed.be.free_bytes() == room
    want = int(60 * MIB * MEASURED_SAFETY) + MEASURED_SLACK_MB * MIB
    skipped = ctl.reclaims_skipped
    assert prefill(took=64 * MIB) == want and bed.alloc.lent_tokens == ELASTIC and ctl.reclaims_skipped == skipped + 1
    assert ctl.activations.measured == 1 and ctl.activations.peaks == {(budget, 1): 60 * MIB}
    # four requests may share the next prefill: the one-request passes bound it by 4x (the logits and sampling
    # grow with the requests), more than is free: the whole step comes back
    assert prefill(took=70 * MIB, n=4) == int(4 * 64 * MIB * MEASURED_SAFETY) + MEASURED_SLACK_MB * MIB and bed.alloc.lent_tokens == 0
    assert ctl.lend() == ELASTIC
    # a waiting request that is not plain takes SGLang's estimate for a whole chunk, and its pass is not measured
    # into the bound
    for field, value in (("return_logprob", True), ("return_hidden_states", True), ("input_embeds", [[0.0]]),
                         ("multimodal_inputs", object()), ("grammar", object())):
        assert prefill(took=900 * MIB, **{field: value}) == estimate and bed.alloc.lent_tokens == 0, field
        assert ctl.lend() == ELASTIC
    assert max(ctl.activations.peaks.values()) == 70 * MIB and ctl.activations.measured == 7
    assert ctl.activations.peaks[(budget, 4)] == 70 * MIB
    # the largest peak a smaller pass took bounds the need from below (the model was wrong there)
    ctl.activations.add(budget // 2, 1, 200 * MIB, plain=True)
    assert ctl.activations.need(budget, 1, estimate) == int(200 * MIB * MEASURED_SAFETY) + MEASURED_SLACK_MB * MIB
    # without chunked prefill a first request is admitted whole: SGLang's estimate
    from types import SimpleNamespace

    bed.sched.waiting_queue.append(bed.request(list(range(5000, 5100))))
    assert ctl._requests_bound(bed.batch) == 1
    sa = bed.sched.server_args
    try:
        bed.sched.server_args = SimpleNamespace(chunked_prefill_size=-1, pp_size=1, enable_mixed_chunk=False)
        assert ctl._requests_bound(bed.batch) == 0
        bed.sched.server_args = SimpleNamespace(chunked_prefill_size=budget, pp_size=2, enable_mixed_chunk=False)
        assert ctl._requests_bound(bed.batch) == 0  # pipeline stages may grow their chunks
        bed.sched.server_args = SimpleNamespace(chunked_prefill_size=budget, pp_size=1, enable_mixed_chunk=True)
        assert ctl._requests_bound(bed.batch) == 1 + len(bed.batch.reqs) > 1  # the running decodes join a mixed prefill
    finally:
        bed.sched.server_args = sa
    bed.sched.waiting_queue.clear()
    # SGLang's estimate alone, by flag
    ctl.cfg = dataclasses.replace(ctl.cfg, activation_rule="sglang")
    # for the 100 tokens waiting: SGLang's floor of 2,048, still more than is free
    assert room < eager_activation_bytes(100) == eager_activation_bytes(2048) < estimate
    assert prefill(took=64 * MIB) == eager_activation_bytes(100) and bed.alloc.lent_tokens == 0
    # checked: a pass above SGLang's estimate is counted and logged once
    with caplog.at_level("WARNING"):
        ctl.activations.add(budget, 1, estimate + 1, plain=True)
        ctl.activations.add(budget, 1, estimate + 2, plain=True)
    assert ctl.activations.over_estimate == 2 and sum("more than SGLang's estimate" in r.getMessage() for r in caplog.records) == 1
    assert ctl.activations.need(budget, 1, estimate) == estimate  # never more than the estimate
    bed.check_ownership_and_accounting()


def test_with_the_measured_rule_a_one_step_lend_leaves_the_eager_prefills_need_free_and_the_prefill_skips_the_reclaim(monkeypatch):
    """Seen on the H200 (2085840): the measured rule gave an 8,192-token eager prefill 1.39 GiB (SGLang's
    estimate: 12.6 GiB), above the 1 GiB margin, so each of 113 prefills still unmapped the whole one-handle
    8.6 GiB step and waited for its release (9.3 / 15.8 ms) to take back 0.4 GiB. Now a one-step lend leaves
    that need free (the step that much smaller) and the next plain eager prefill runs lent; a prefill of more
    requests than were measured still reclaims; a need above half the lendable bytes keeps the plain margin;
    SGLang's rule lends the whole step again."""
    import dataclasses

    from sglang_elastic.sched import controller

    kib = 1024
    bed, peaks = measured_eager_bed(monkeypatch, ELASTIC * ROW + 8 * kib)
    ctl, budget = bed.ctl, bed.sched.server_args.chunked_prefill_size

    def prefill(took, n=1):  # as the measured rule's test: SGLang forms an eager prefill of n requests and runs it
        eager_prefill(bed, peaks, took, n)

    assert ctl._lend_margin() == 0  # nothing measured: --elastic-kv-margin-mb
    prefill(took=20 * kib)  # nothing lent: measured, read when the next pass begins
    ctl.before_prefill(bed.batch)
    need = int(20 * kib * controller.MEASURED_SAFETY)
    assert ctl.activations.peaks == {(budget, 1): 20 * kib} and ctl._lend_margin() == need
    # the one step is cut (in quanta of 16 tokens) to leave the need free, where the plain margin lent all 128 tokens
    lent = ctl.lend()
    assert 0 < lent < ELASTIC and lent % 16 == 0 and lent == bed.alloc.lent_tokens
    assert bed.be.free_bytes() >= need > bed.be.free_bytes() - 16 * sum(ctl.arena.row_bytes)  # the largest cut that leaves it
    skipped, reclaims = ctl.reclaims_skipped, bed.be.calls.get("unmap", 0)
    prefill(took=20 * kib)
    assert ctl.reclaims_skipped == skipped + 1 and bed.alloc.lent_tokens == lent and bed.be.calls.get("unmap", 0) == reclaims
    # four requests may share the next prefill: 4x the measured pass, more than is free: the step comes back
    prefill(took=30 * kib, n=4)
    assert bed.alloc.lent_tokens == 0
    # SGLang's rule: the plain margin, the whole step
    ctl.cfg = dataclasses.replace(ctl.cfg, activation_rule="sglang")
    assert ctl._lend_margin() == 0 and ctl.lend() == ELASTIC
    ctl.reclaim(bed.batch, 1, "test")
    ctl.cfg = dataclasses.replace(ctl.cfg, activation_rule="measured")
    ctl.before_prefill(bed.batch)  # reads the 4-request pass: the margin takes the most requests a pass held
    assert ctl.activations.peaks[(budget, 4)] == 30 * kib and ctl._lend_margin() == int(30 * kib * controller.MEASURED_SAFETY)
    # a need above half the lendable bytes: lending that little would not pay, the plain margin stays
    ctl.activations.peaks = {(budget, 1): ELASTIC * sum(ctl.arena.row_bytes)}  # need: 1.25x all the lendable bytes
    assert ctl._lend_margin() == 0 and ctl.lend() == ELASTIC
    bed.check_ownership_and_accounting()


def test_with_the_measured_rule_split_remainders_in_torchs_cache_do_not_count_towards_the_need_the_lend_leaves(monkeypatch):
    """Seen on the H200 (1a4cb5f): the measured need was 1.38 GiB and the lend left it, counting 0.23 GiB of
    torch's unused cached blocks; those were split remainders of live segments, which the next eager prefill
    counts out (a large allocation cannot take them), so each of 112 prefills found 1.17 GiB and reclaimed
    the whole step. The cut now counts the cache as the prefill will: the need stays free at the driver."""
    import dataclasses

    from sglang_elastic.sched import controller

    class SplitCache(HeldCache):  # unused bytes inside live segments: not handed back, not reusable by a large allocation
        def reusable(self) -> int:
            return 0

        def empty(self) -> None:
            self.emptied += 1

    kib = 1024
    bed, peaks = measured_eager_bed(monkeypatch, ELASTIC * ROW + 8 * kib)
    ctl = bed.ctl

    def prefill(took):
        eager_prefill(bed, peaks, took)

    prefill(took=20 * kib)
    ctl.before_prefill(bed.batch)
    need = ctl._lend_margin()
    assert need == int(20 * kib * controller.MEASURED_SAFETY)
    ctl.torch_cache = cache = SplitCache(bed.be, need // 2 // 4096 * 4096)  # half the need sits in split remainders
    assert cache.unused() > 0 and cache.reusable() == 0
    lent = ctl.lend()
    assert 0 < lent < ELASTIC and bed.be.free_bytes() >= need  # the need is left at the driver, the remainders not counted
    assert cache.emptied == 0  # emptying cannot give split remainders back: no empty_cache for nothing
    skipped, unmaps = ctl.reclaims_skipped, bed.be.calls.get("unmap", 0)
    prefill(took=20 * kib)
    assert ctl.reclaims_skipped == skipped + 1 and bed.alloc.lent_tokens == lent and bed.be.calls.get("unmap", 0) == unmaps
    # SGLang's rule counts every unused block (as its reclaim test does): the cache's bytes count towards the margin again
    ctl.cfg = dataclasses.replace(ctl.cfg, activation_rule="sglang")
    assert ctl._margin_cache() == cache.unused()
    bed.check_ownership_and_accounting()


def test_the_measured_bounds_keep_the_newest_shapes_and_scale_by_tokens_and_requests():
    from sglang_elastic.sched.controller import MEASURED_KEEP, MEASURED_SAFETY, MEASURED_SLACK_MB, EagerActivations

    a = EagerActivations()
    est = 10 << 30
    assert a.need(8192, 1, est) == est  # nothing measured
    a.add(4096, 2, 100 * MIB, plain=True)
    slack = MEASURED_SLACK_MB * MIB
    assert a.need(8192, 2, est) == int(200 * MIB * MEASURED_SAFETY) + slack  # twice the tokens
    assert a.need(4096, 8, est) == int(400 * MIB * MEASURED_SAFETY) + slack  # four times the requests
    assert a.need(2048, 1, est) == int(100 * MIB * MEASURED_SAFETY) + slack  # a smaller pass: no less than the measured one
    a.add(4096, 2, 90 * MIB, plain=True)
    assert a.peaks[(4096, 2)] == 100 * MIB  # the most a shape took
    a.add(4096, 2, 50 * MIB, plain=False)
    assert a.peaks == {(4096, 2): 100 * MIB}  # a pass that is not plain does not enter the bound
    for t in range(1, MEASURED_KEEP + 1):
        a.add(10000 + t, 1, t * MIB, plain=True)
    assert len(a.peaks) == MEASURED_KEEP and (4096, 2) not in a.peaks and (10001, 1) in a.peaks  # the oldest shape went
    assert a.need(0, 1, est) == est and a.need(8192, 0, est) == est


@pytest.mark.parametrize("release_async", [False, True], ids=["here", "on the helper"])
def test_steps_made_ahead_are_unmapped_when_dropped_by_a_reclaim_or_by_close(release_async):
    """Steps made ahead are mapped above the lent range: a reclaim of a lent
    step drops them first (they would sit above a gap), the next lend maps
    fresh ones at the right rows, and close() unmaps what is still made ahead."""
    be, a = _arena(offset_mapping=False)
    assert a.lend(1) == 1
    assert a.prepare(1) == 1
    ahead = a.token_va(0, a.base_tokens + 64)
    assert ahead in be._maps and be.live_handles == 3 * len(ROWS)
    data = _fill(be, a, a.base_tokens, 64, seed=2)  # the lent step's bytes
    assert a.reclaim(release_async=release_async) == 1 and a.settle() == []
    assert a.prepared_steps == 0 and ahead not in be._maps and be.live_handles == len(ROWS)  # base only
    assert a.lend() == 2 and a.lent_tokens == 128
    data = _fill(be, a, a.base_tokens, 128, seed=3)
    assert [be.read(a.token_va(i, a.base_tokens), 128 * r) for i, r in enumerate(a.row_bytes)] == data
    a.reclaim(1)
    assert a.prepare() == 1 and a.token_va(0, a.base_tokens + 64) in be._maps
    a.close()
    assert be.live_handles == 0 and be._maps == {}


def test_a_lend_of_fewer_steps_than_made_ahead_keeps_the_rest_mapped_in_place_and_set_steps_refuses_them():
    be, a = _arena(offset_mapping=True)
    assert a.prepare() == 2
    assert a.lend(1) == 1 and a.prepared_steps == 1 and a.token_va(0, a.base_tokens + 64) in be._maps
    with pytest.raises(RuntimeError, match="set_steps while lent"):
        a.set_steps(128)
    a.reclaim()
    assert a.prepare(1) == 1
    with pytest.raises(RuntimeError, match="made ahead: drop_prepared first"):
        a.set_steps(64)
    assert a.drop_prepared() == 1 and set(be._maps) == {a.token_va(i, 0) for i in range(len(ROWS))} and a.set_steps(64) == 64
    a.close()
    assert be.live_handles == 0


def test_a_prepare_whose_map_fails_leaves_nothing_mapped_or_held_and_the_lend_makes_the_step():
    be, a = _arena(offset_mapping=False)
    maps = be.calls.get("map", 0)
    be.fail_on["map"] = lambda n: n == maps + 3  # the third buffer of the first step made ahead
    assert a.prepare_async().result(JOIN) == 0 and a.prepared_steps == 0 and a.settle() == []
    assert be.live_handles == len(ROWS) and set(be._maps) == {a.token_va(i, 0) for i in range(len(ROWS))}
    assert not a.lending_disabled  # the rollback unmapped what it had mapped
    be.fail_on.clear()
    assert a.lend() == 2 and a.lent_tokens == 128
    data = _fill(be, a, a.base_tokens, 128, seed=4)
    assert [be.read(a.token_va(i, a.base_tokens), 128 * r) for i, r in enumerate(a.row_bytes)] == data
    a.close()
    assert be.live_handles == 0 and be._maps == {}


def test_the_forward_after_a_reclaim_waits_for_the_memory_it_needs_not_for_the_whole_step(tmp_path, monkeypatch):
    """Handle per buffer (the H200's driver): the helper unmaps and releases
    buffer by buffer; the forward the reclaim was for goes on once what it
    needs beyond the free memory (``room_bytes``) is back, the rest behind
    it. Without a known need it waits for every release, as before."""
    import json

    from sglang_elastic import config
    from test_pool import make_pool

    events = tmp_path / "events.jsonl"
    monkeypatch.setenv(config.EVENTS_ENV, str(events))
    built = make_pool(1, base=256, elastic=ELASTIC, step=64, offset_mapping=False)
    bed = Bed(built=built, free_bytes=ELASTIC * ROW, margin_mb=0, lend_bytes=ELASTIC * ROW)
    a = bed.pool.arena
    assert bed.ctl.lend() == ELASTIC and a.lent_steps == 1 and len(a.row_bytes) == 2 * LAYERS
    assert bed.admit(list(range(30)))
    step = a.step_tokens * sum(a.row_bytes)
    buf = a.step_tokens * a.row_bytes[0]  # one buffer of the step
    free0 = bed.be.free_bytes()
    # as steps_needed leaves them: 2 buffers and a byte short
    bed.ctl._pass_need, bed.ctl._pass_free, bed.ctl._pass_room = free0 + 2 * buf + 1, (free0, 0), 2 * buf + 1
    hold = HoldRelease(bed.be, 4)  # the fourth release waits for the test

    class Hist(list):
        def observe(self, v):
            self.append(v)

    class Metrics:  # SGLang's /metrics objects, as ElasticMetrics makes them (counters and histograms)
        def __init__(self):
            self.needed = Hist()

        def __getattr__(self, name):
            return types.SimpleNamespace(inc=lambda *a: None, observe=lambda *a: None, set=lambda *a: None)

    import types

    bed.ctl.metrics = metrics = Metrics()
    metrics.reclaim_needed_ms = metrics.needed
    assert bed.ctl.reclaim(bed.batch, why="test")
    bed.ctl.after_prefill(bed.batch, bed.batch)  # returns once three buffers are back (two and a byte needed) ...
    assert bed.be.free_bytes() >= free0 + 3 * buf
    assert hold.held.wait(JOIN)  # ... while the helper goes on to the fourth release, held there
    assert len(hold.released) == 4 and a.busy and bed.be.free_bytes() == free0 + 3 * buf
    hold.go.set()
    bed.ctl._settle()
    assert bed.be.free_bytes() == free0 + step and not a.busy
    [rec] = [json.loads(line) for line in events.read_text().splitlines() if '"reclaim"' in line]
    assert rec["room_bytes"] == 2 * buf + 1 and rec["release_wait_ms"] >= 0 and rec["settle_wait_ms"] >= 0
    assert metrics.needed == [pytest.approx(rec["ms"] + rec["release_wait_ms"])]  # /metrics: what the forward waited, not the whole unmap
    assert rec["wait_ms"] >= 0 and rec["unmap_ms"] >= 0 and rec["unmap_end_ms"] >= rec["unmap_ms"] and rec["steps"] == 1
    # lent again, its need unknown: the forward waits for all of it
    assert bed.ctl.lend() == ELASTIC
    free0 = bed.be.free_bytes()
    bed.ctl._pass_need = bed.ctl._pass_room = None
    hold.reset()
    assert bed.ctl.reclaim(bed.batch, why="test")
    t, box = _run(lambda: bed.ctl.after_prefill(bed.batch, bed.batch))
    assert hold.held.wait(JOIN)
    assert t.is_alive()  # the forward still waits, with the fourth release held
    hold.go.set()
    t.join(JOIN)
    assert "error" not in box and bed.be.free_bytes() == free0 + step and not a.busy
    bed.check_ownership_and_accounting()


def _deferring_bed(tmp_path, monkeypatch, reclaim_wait="decode"):
    """A lent bed whose prefills run eagerly (so a waiting request reclaims), the events in a file, 30 tokens
    admitted, each K/V buffer of the step its own handle (the helper unmaps and releases buffer by buffer);
    returns ``(bed, events path, orig)``: ``orig`` stands in for SGLang's ``_get_new_batch_prefill_raw`` (it
    forms a batch of the waiting requests and records its calls)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    from sglang_elastic import config
    from test_controller import _graph_args
    from test_pool import make_pool

    events = tmp_path / "events.jsonl"
    monkeypatch.setenv(config.EVENTS_ENV, str(events))
    built = make_pool(1, base=256, elastic=ELASTIC, step=64, offset_mapping=False)
    bed = Bed(built=built, server_args=_graph_args(cuda_graph_backend_prefill=Backend.DISABLED), free_bytes=ELASTIC * ROW, margin_mb=0,
              lend_bytes=ELASTIC * ROW)
    bed.ctl.cfg = dataclasses.replace(bed.ctl.cfg, reclaim_wait=reclaim_wait)
    assert bed.ctl.lend() == ELASTIC and bed.admit(list(range(30)))
    calls = []

    def orig(sched, prefill_delayer_single_pass=None, running_batch=None):
        calls.append(list(sched.waiting_queue))
        reqs, sched.waiting_queue[:] = list(sched.waiting_queue), []
        return (_extend_batch(reqs, 64) if reqs else None), running_batch

    orig.calls = calls
    return bed, events, orig


def _pass(bed, orig):
    """One scheduler pass through the AROUND hook of ``_get_new_batch_prefill_raw``: ``(new batch, running batch)``."""
    from sglang_elastic.sched import hooks

    return hooks._around_prefill_raw(orig, bed.sched, prefill_delayer_single_pass=None, running_batch=bed.batch)


def _events(path, op):
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if f'"op": "{op}"' in line]


def test_while_a_reclaims_unmap_gives_the_memory_back_the_decode_batch_runs_and_the_prefill_forms_once_it_is_back(tmp_path, monkeypatch):
    """Issue 22, build 2 (the H100, 2026-12-06: the scheduler waited 13.5 / 19.0 ms p50 / p99 for an eager
    prefill's reclaim, the in-flight forward's ~6 ms and the driver's unmaps of a 9.5 GiB step, and every
    running request with it): with ``--elastic-kv-reclaim-wait decode`` (the default) no prefill forms
    until the memory its forward needs is back; SGLang runs the decode batch meanwhile, and a pass that
    defers decides nothing again (no second reclaim, no skip counted). The reclaim's event and
    ``/metrics`` tell what the scheduler waited from how long the prefill was delayed."""
    from sglang_elastic.sched import controller

    bed, events, orig = _deferring_bed(tmp_path, monkeypatch)
    ctl, a = bed.ctl, bed.pool.arena
    gate = Gate(bed.be, name="release")  # the helper's first release waits for the test
    bed.sched.waiting_queue.append(bed.request(list(range(500, 600))))
    assert _pass(bed, orig) == (None, bed.batch)  # reclaimed, then no prefill: SGLang runs the decode batch
    assert orig.calls == [] and a.lent_steps == 0 and ctl.cycles == 1 and ctl.prefills_deferred == 1
    assert gate.reached.wait(JOIN) and a.busy
    assert bed.decode()  # the running requests take their step, in base rows
    assert _pass(bed, orig) == (None, bed.batch)  # still not back: deferred again, nothing decided again
    assert orig.calls == [] and ctl.cycles == 1 and ctl.prefills_deferred == 2 and ctl.reclaims_skipped == 0
    gate.open()
    assert a.wait_freed(1 << 62)  # the unmap ended
    new, running = _pass(bed, orig)  # the memory is back: the prefill forms
    assert new is not None and len(orig.calls) == 1 and len(orig.calls[0]) == 1 and ctl.prefills_deferred == 2
    ctl._settle()
    [rec] = _events(events, "reclaim")
    assert rec["deferred"] == 2 and rec["steps"] == 1 and rec["release_wait_ms"] >= 0
    assert rec["defer_end"] == "memory back" and rec["decodes"] == len(bed.batch.reqs) > 0
    assert rec["delay_ms"] >= rec["ms"] + rec["release_wait_ms"]  # the delay counts the decode passes, the scheduler's wait does not
    assert _events(events, "reclaim_skipped") == [] and ctl.state()["prefills_deferred"] == 2
    assert controller.MAX_DEFERRED_PASSES > 2
    bed.check_ownership_and_accounting()


@pytest.mark.parametrize("case", ["block", "chunked request", "no decode batch", "most passes"])
def test_a_prefill_is_not_deferred_with_block_between_chunks_without_a_decode_batch_or_after_the_most_passes(tmp_path, monkeypatch, case):
    """Where deferring is not done, the pass forms its prefill and ``after_prefill`` waits for the memory
    (SGLang's own delayers never hold a chunked request's next chunk either)."""
    from sglang_elastic.sched import controller

    bed, events, orig = _deferring_bed(tmp_path, monkeypatch, reclaim_wait="block" if case == "block" else "decode")
    ctl, a = bed.ctl, bed.pool.arena
    if case == "most passes":
        monkeypatch.setattr(controller, "MAX_DEFERRED_PASSES", 1)
    gate = Gate(bed.be, name="release")
    bed.sched.waiting_queue.append(bed.request(list(range(500, 600))))
    if case == "most passes":
        assert _pass(bed, orig) == (None, bed.batch) and ctl.prefills_deferred == 1
    else:
        ctl.before_prefill(bed.batch)  # the reclaim (for a chunked request: for its first chunk)
    if case == "chunked request":  # the next pass continues the chunked request
        bed.sched.chunked_req = bed.sched.waiting_queue[0]
    if case == "no decode batch":
        for r in list(bed.batch.reqs):
            bed.finish(r)
    assert gate.reached.wait(JOIN)
    t, box = _run(lambda: _pass(bed, orig))  # the prefill forms; the hook returns once the memory is back
    assert orig.calls == [] or t.is_alive()
    gate.open()
    t.join(JOIN)
    assert "error" not in box and box["result"][0] is not None and len(orig.calls) == 1
    assert not a.busy or a.wait_freed(1 << 62)
    assert ctl.prefills_deferred == (1 if case == "most passes" else 0)
    bed.sched.chunked_req = None
    ctl._settle()
    [rec] = _events(events, "reclaim")
    assert rec.get("deferred", 0) == ctl.prefills_deferred
    assert rec["defer_end"] == {"block": "block", "chunked request": "chunked request", "no decode batch": "no decode batch",
                                "most passes": "most passes"}[case]


def test_a_deferred_pass_that_needs_more_than_the_reclaim_was_for_waits_for_more_of_its_unmap(tmp_path, monkeypatch):
    """More requests may wait at the pass the prefill finally forms than at the pass that reclaimed (the
    measured rule scales the need by them): the deferred pass measures again and waits for that much of
    the unmap, not for what the first pass needed."""
    from sglang_elastic.sched import controller

    bed, events, orig = _deferring_bed(tmp_path, monkeypatch)
    ctl, a = bed.ctl, bed.pool.arena
    step = a.step_tokens * sum(a.row_bytes)
    buf = a.step_tokens * a.row_bytes[0]
    assert len(a.row_bytes) >= 6 and all(r == a.row_bytes[0] for r in a.row_bytes)
    free0 = bed.be.free_bytes()
    need = {"bytes": free0 + 2 * buf + 1}  # two buffers and a byte more than is free
    monkeypatch.setattr(controller, "eager_activation_bytes", lambda tokens, ranks=1: need["bytes"])
    hold = HoldRelease(bed.be, 4)  # the fourth release waits for the test
    bed.sched.waiting_queue.append(bed.request(list(range(500, 600))))
    ctl.before_prefill(bed.batch)
    assert ctl._releasing["room_bytes"] == 2 * buf + 1 and hold.held.wait(JOIN)  # three buffers back, the fourth held
    assert not ctl.defer_prefill(bed.batch)  # enough for the first pass's need
    need["bytes"] = free0 + 5 * buf  # more waiting now: five buffers' worth
    assert _pass(bed, orig) == (None, bed.batch)  # measured again: not back yet, deferred
    assert ctl._releasing["room_bytes"] == step + (free0 + 5 * buf) - (free0 + step) == 5 * buf and ctl.cycles == 1
    hold.go.set()
    assert a.wait_freed(5 * buf)
    new, _ = _pass(bed, orig)
    assert new is not None and ctl.prefills_deferred == 1 and ctl.cycles == 1
    ctl._settle()
    [rec] = _events(events, "reclaim")
    assert rec["room_bytes"] == 5 * buf and rec["deferred"] == 1
    bed.check_ownership_and_accounting()


def test_an_idle_scheduler_reclaims_for_the_next_eager_prefill_and_a_prompt_arriving_meanwhile_waits_only_for_the_rest(tmp_path, monkeypatch):
    """Seen on an H100 (2026-12-06): after the long decodes ended, each short prompt found the pool lent and the
    GPU idle, and waited 6-13 ms for a whole-step reclaim with no decode batch to run meanwhile. Before SGLang's
    idle sleep (``Scheduler.maybe_sleep_on_idle``, BEFORE hook: with ``--sleep-on-idle`` it blocks until the next
    request) the controller now reclaims what the next eager prefill needs; the idle passes after it leave the
    unmap running (a review found them waiting for all of it, booked as a prompt's wait); a prompt that arrives
    while the unmap still runs waits only for the rest, and the event says what it waited."""
    from sglang_elastic.sched import controller, hooks

    bed, events, orig = _deferring_bed(tmp_path, monkeypatch)
    ctl, a = bed.ctl, bed.pool.arena
    idle = {"v": False}
    bed.sched.is_fully_idle = lambda for_health_check=False: idle["v"]
    hooks._before_idle_sleep(bed.sched)  # decodes running: nothing
    assert a.lent_steps == 1 and ctl.cycles == 0
    for r in list(bed.batch.reqs):
        bed.finish(r)
    idle["v"] = True
    gate = Gate(bed.be, name="release")
    hooks._before_idle_sleep(bed.sched)
    assert a.lent_steps == 0 and ctl.cycles == 1 and gate.reached.wait(JOIN)  # reclaimed; the unmap held on the helper
    hooks._before_idle_sleep(bed.sched)  # idle again: nothing more (nothing lent)
    assert ctl.cycles == 1
    t, box = _run(lambda: _pass(bed, orig))  # an idle pass (nothing waits): it must not wait for the unmap
    t.join(JOIN)
    assert not t.is_alive() and box["result"] == (None, bed.batch) and orig.calls == [[]] and ctl.prefills_deferred == 0
    ctl.after_prefill(None, bed.batch)  # SGLang's own pass end, as the hook runs it
    assert "release_wait_ms" not in ctl._releasing and a.busy
    idle["v"] = False
    bed.sched.waiting_queue.append(bed.request(list(range(500, 600))))
    t, box = _run(lambda: _pass(bed, orig))  # no decode batch to run: the prefill forms and waits for the rest
    assert t.is_alive() or "error" in box
    gate.open()
    t.join(JOIN)
    assert "error" not in box and box["result"][0] is not None and ctl.prefills_deferred == 0
    ctl._settle()
    [rec] = _events(events, "reclaim")
    assert rec["why"] == controller.IDLE and rec["defer_end"] == "no decode batch" and rec["decodes"] == 0
    assert rec["delay_ms"] == rec["release_wait_ms"]  # what the arriving prompt waited; the reclaim itself ran while idle
    bed.check_ownership_and_accounting()


def test_a_short_prompt_arriving_after_an_idle_reclaim_waits_only_for_what_its_own_prefill_needs(tmp_path, monkeypatch):
    """Seen on an H100 (2026-12-06, a1bf25b and f232728): short prompts (64 to 512 tokens) that arrived as the GPU
    went idle waited 6-13 ms (p50 6.4-9.2) for the unmap of the whole 9.5 GiB step, because the idle reclaim and
    the prompt's pass both took a prefill to need SGLang's estimate for a whole chunk of 8,192 tokens (12.6 GiB).
    The prompt's pass now sizes its need by the tokens waiting (SGLang's estimate, floored at 2,048 tokens by
    SGLang's own rule) and waits for that much of the unmap only; the rest goes on behind its forward."""
    from sglang_elastic.sched import controller, hooks

    bed, events, orig = _deferring_bed(tmp_path, monkeypatch)
    ctl, a = bed.ctl, bed.pool.arena
    buf = a.step_tokens * a.row_bytes[0]
    step = a.step_tokens * sum(a.row_bytes)
    assert len(a.row_bytes) >= 6 and all(r == a.row_bytes[0] for r in a.row_bytes)
    free0 = bed.be.free_bytes()
    asked = []

    def estimate(tokens, ranks=1):  # a chunk needs more than the whole step; 2,048 tokens two buffers and a byte beyond what is free
        asked.append(tokens)
        return free0 + (10 * step if max(tokens, 2048) > 2048 else 2 * buf + 1)

    monkeypatch.setattr(controller, "eager_activation_bytes", estimate)
    for r in list(bed.batch.reqs):
        bed.finish(r)
    bed.sched.is_fully_idle = lambda for_health_check=False: True
    hold = HoldRelease(bed.be, 4)  # the helper's fourth release waits for the test
    hooks._before_idle_sleep(bed.sched)
    assert asked == [bed.sched.server_args.chunked_prefill_size] and ctl.cycles == 1 and a.lent_steps == 0
    assert ctl._releasing["room_bytes"] > step and hold.held.wait(JOIN)  # the idle reclaim: all of the step; three buffers back
    bed.sched.is_fully_idle = lambda for_health_check=False: False
    bed.sched.waiting_queue.append(bed.request(list(range(500, 600))))  # a 100-token prompt
    t, box = _run(lambda: _pass(bed, orig))
    t.join(JOIN / 4)  # before: it waited for the held release (the whole step) until the hold gave up (JOIN)
    alive = t.is_alive()
    hold.go.set()
    t.join(JOIN)
    assert not alive and "error" not in box and box["result"][0] is not None and asked[1:] == [100]
    ctl._settle()
    [rec] = _events(events, "reclaim")
    assert rec["why"] == controller.IDLE and rec["room_bytes"] == 2 * buf + 1 and rec["defer_end"] == "no decode batch"
    assert rec["steps"] == 1  # the reclaim gave back the whole step; the prompt waited for its part
    bed.check_ownership_and_accounting()


def test_a_prefill_is_sized_by_the_tokens_waiting_up_to_the_chunk_and_without_chunks_by_the_longest_request(tmp_path, monkeypatch):
    """``reserve_needed``'s tokens for an eager prefill (:meth:`ElasticController._prefill_tokens`): what waits
    (prompt and output so far, ``Req.seqlen``; the chunked request; with mixed chunks a token per running
    request), never more than a chunk; with ``--chunked-prefill-size -1`` SGLang admits a first request whole,
    so at least the longest request even past ``max_prefill_tokens``."""
    from types import SimpleNamespace

    from sglang_elastic.sched.controller import EAGER_PREFILL

    bed, events, orig = _deferring_bed(tmp_path, monkeypatch)
    ctl, sched = bed.ctl, bed.sched
    chunk = sched.server_args.chunked_prefill_size
    running = len(bed.batch.reqs)
    assert running > 0
    sched.waiting_queue.extend([bed.request(list(range(100))), bed.request(list(range(300)))])
    assert ctl.reserve_needed(bed.batch) == (EAGER_PREFILL, 400)
    retracted = bed.request(list(range(50)))
    retracted.output_ids = list(range(7))  # a retracted request recomputes its output too
    sched.waiting_queue.append(retracted)
    assert ctl.reserve_needed(bed.batch) == (EAGER_PREFILL, 457)
    sched.waiting_queue.append(bed.request(list(range(chunk))))
    assert ctl.reserve_needed(bed.batch) == (EAGER_PREFILL, chunk)
    sched.waiting_queue[:] = sched.waiting_queue[:2]
    embeds = bed.request([])  # a prompt given as embeddings: seqlen does not count it, so the whole chunk
    embeds.input_embeds = [[0.0] * 8] * 300
    sched.waiting_queue.append(embeds)
    assert ctl.reserve_needed(bed.batch) == (EAGER_PREFILL, chunk)
    sched.waiting_queue.pop()
    mm = bed.request(list(range(50)))  # a multimodal prompt (its prefill may run the vision encoder): the chunk
    mm.multimodal_inputs = object()
    sched.waiting_queue.append(mm)
    assert ctl.reserve_needed(bed.batch) == (EAGER_PREFILL, chunk)
    sched.waiting_queue.pop()
    sched.waiting_queue.append(bed.request(list(range(chunk))))
    sa = sched.server_args
    try:
        sched.server_args = SimpleNamespace(chunked_prefill_size=-1, max_prefill_tokens=chunk // 2, enable_mixed_chunk=False)
        assert ctl._prefill_tokens(bed.batch) == chunk  # the longest request, admitted whole
        sched.waiting_queue[:] = sched.waiting_queue[:2]
        assert ctl._prefill_tokens(bed.batch) == 400
        sched.server_args = SimpleNamespace(chunked_prefill_size=chunk, enable_mixed_chunk=True)
        assert ctl._prefill_tokens(bed.batch) == 400 + running  # the running decodes join a mixed prefill
        # SGLang's scheduler decides (init_chunked_prefill): multimodal models on the Transformers backend run unchunked
        # although their server args keep the chunk; a 20,000-token prompt is then admitted whole (a review found 8,192)
        sched.server_args = SimpleNamespace(chunked_prefill_size=chunk, max_prefill_tokens=chunk * 2, enable_mixed_chunk=True)
        sched.chunked_prefill_size, sched.is_mixed_chunk = None, False
        sched.waiting_queue.append(bed.request(list(range(20000))))
        assert ctl._prefill_tokens(bed.batch) == 20000 and ctl._prefill_budget() == chunk * 2 and ctl._requests_bound(bed.batch) == 0
        sched.waiting_queue.pop()
        sched.chunked_prefill_size, sched.is_mixed_chunk = chunk, True
        assert ctl._prefill_tokens(bed.batch) == 400 + running
        del sched.chunked_prefill_size, sched.is_mixed_chunk
        sched.waiting_queue.clear()
        sched.chunked_req = bed.request(list(range(chunk * 3)))  # a long prompt between chunks: its next chunk
        assert ctl._prefill_tokens(bed.batch) == chunk
    finally:
        sched.server_args = sa
        sched.chunked_req = None
        sched.waiting_queue.clear()


@pytest.mark.parametrize("case", ["prefill graphs", "measured rule"])
def test_an_idle_scheduler_reclaims_nothing_with_prefill_graphs_or_the_measured_rule(tmp_path, monkeypatch, case):
    from sglang_elastic.sched import hooks
    from test_controller import _graph_args

    bed, events, orig = _deferring_bed(tmp_path, monkeypatch)
    ctl, a = bed.ctl, bed.pool.arena
    for r in list(bed.batch.reqs):
        bed.finish(r)
    bed.sched.is_fully_idle = lambda for_health_check=False: True
    if case == "prefill graphs":
        ctl.prefill_in_graphs = True
        bed.sched.server_args = _graph_args()
    if case == "measured rule":
        ctl.cfg = dataclasses.replace(ctl.cfg, activation_rule="measured")
    hooks._before_idle_sleep(bed.sched)
    assert ctl.cycles == 0 and a.lent_steps == 1


def test_an_idle_period_decides_once_and_a_prefill_without_a_chunk_is_sized_by_max_prefill_tokens(tmp_path, monkeypatch):
    """SGLang's idle loop spins: the idle reclaim decides once per idle period (a memory query and a TP collective
    each time otherwise), again after the next forward; its need is a prefill pass's largest, the chunk or, with
    ``--chunked-prefill-size -1``, ``max_prefill_tokens`` (as reserve_needed sizes it)."""
    from sglang_elastic.sched import controller, hooks

    bed, events, orig = _deferring_bed(tmp_path, monkeypatch)
    ctl = bed.ctl
    for r in list(bed.batch.reqs):
        bed.finish(r)
    bed.sched.is_fully_idle = lambda for_health_check=False: True
    asked = []
    monkeypatch.setattr(controller, "eager_activation_bytes", lambda tokens, ranks=1: asked.append(tokens) or -1)  # fits: no reclaim
    for _ in range(50):
        hooks._before_idle_sleep(bed.sched)
    assert asked == [bed.sched.server_args.chunked_prefill_size] and ctl.cycles == 0
    ctl.after_forward(None)  # a forward ran
    object.__setattr__(bed.sched.server_args, "chunked_prefill_size", -1)
    hooks._before_idle_sleep(bed.sched)
    assert asked[1:] == [bed.sched.server_args.max_prefill_tokens] and asked[1] > 2048 and ctl.cycles == 0


def test_a_deferred_pass_that_must_reclaim_more_says_so_in_the_first_reclaims_event_with_its_whole_delay(tmp_path, monkeypatch):
    """With the measured rule more waiting requests may need more than a pending reclaim gives; that pass reclaims
    again, and reclaim() first waits for the pending unmap: the first reclaim's event says why it ended
    (``more needed``) and its delay counts the decode passes and that wait."""
    bed, events, orig = _deferring_bed(tmp_path, monkeypatch)
    ctl, a = bed.ctl, bed.pool.arena
    gate = Gate(bed.be, name="release")
    bed.sched.waiting_queue.append(bed.request(list(range(500, 600))))
    assert _pass(bed, orig) == (None, bed.batch) and gate.reached.wait(JOIN) and ctl.prefills_deferred == 1
    again = []
    monkeypatch.setattr(ctl, "steps_needed", lambda tokens, requests=0: 1)
    monkeypatch.setattr(ctl, "reclaim", lambda batch, steps=None, why="": again.append(steps) or ctl._settle() > 0)
    monkeypatch.setattr(type(ctl), "lent", property(lambda self: True))
    t, box = _run(lambda: ctl.before_prefill(bed.batch))
    assert gate.reached.wait(JOIN)
    gate.open()
    t.join(JOIN)
    assert "error" not in box and again == [1]
    [rec] = _events(events, "reclaim")
    assert rec["defer_end"] == "more needed" and rec["deferred"] == 1 and rec["decodes"] == len(bed.batch.reqs)
    assert rec["delay_ms"] >= rec["ms"] + rec["release_wait_ms"] and rec["release_wait_ms"] >= 0


def test_every_elastic_hook_names_a_method_of_sglang_0_5_17(monkeypatch):
    """The hooks' targets resolve in the installed SGLang (a renamed method would silently never be called)."""
    from sglang_elastic.sched import hooks
    from test_offload_config import hook_targets

    seen = hook_targets(hooks.register, monkeypatch)
    assert "sglang.srt.managers.scheduler.Scheduler.maybe_sleep_on_idle" in seen and len(seen) == 7


def test_an_unmap_on_the_helper_thread_that_fails_is_reported_kept_for_close_and_wait_freed_does_not_hang():
    """Defect 4's guarantees when the reclaim's unmap runs on the helper
    thread: the failed range and the rest are accounted, lending stops,
    close() retries the unmap; a failing fence wait falls back to a device
    synchronize before anything is unmapped."""
    be, a = _arena(offset_mapping=False)
    assert a.lend() == 2
    unmaps = be.calls.get("unmap", 0)
    be.fail_on["unmap"] = lambda n: n == unmaps + 2  # the top step's second buffer
    syncs = []
    be.synchronize = lambda: syncs.append(1)

    def broken_wait():
        raise RuntimeError("event wait failed")

    assert a.reclaim(1, wait=broken_wait, unmap_async=True) == 1 and a.lent_steps == 1
    a.wait_freed(10**12)  # returns once the job ended, although it freed less
    errors = a.settle()
    assert syncs == [1]  # the failed wait was replaced by a device synchronize, before the unmaps
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError) and a.lending_disabled and a.lend() == 0
    top = a.token_va(1, a.base_tokens + 64)
    assert top in be._maps and a._stale == [(top, 64 * ROWS[1])]  # the failed range, kept
    assert a.last_unmap["wait_ms"] >= 0 and a.last_unmap["unmap_ms"] >= 0
    be.fail_on.clear()
    a.close()
    assert be.live_handles == 0 and be._maps == {}
