"""Orderings of the helper thread against the scheduler found by a review of 8516aa6 (map-ahead, async unmap): host backend, real threads, Events."""
from __future__ import annotations

import threading

import pytest

from sglang_elastic.vmm import ElasticArena, HostBackend

from test_fast_lend import GRAN, JOIN, ROWS, Gate, _arena  # noqa: F401
from test_controller import sglang_runtime_context  # noqa: F401


def _blocked_wait():
    ev = threading.Event()
    reached = threading.Event()

    def wait():
        reached.set()
        assert ev.wait(JOIN)

    return wait, ev, reached


def test_a_second_async_reclaim_waits_for_the_first_and_wait_freed_counts_only_its_own_bytes():
    be = HostBackend(granularity=GRAN, offset_mapping=False, capacity=1 << 30)
    a = ElasticArena(be, ROWS, base_tokens=128, max_elastic_tokens=128, step_tokens=64)
    assert a.lend() == 2
    w1, e1, r1 = _blocked_wait()
    w2, e2, r2 = _blocked_wait()
    a.reclaim(1, wait=w1, unmap_async=True)  # job 1 (top step), held in its fence wait
    assert r1.wait(JOIN)
    t, box = _on_thread(lambda: a.reclaim(1, wait=w2, unmap_async=True))
    t.join(0.2)
    assert t.is_alive() and a.lent_steps == 1  # the second waits for the first before it pops anything
    e1.set()
    t.join(JOIN)
    assert box == {"result": 1} and r2.wait(JOIN)  # job 2 submitted, held in its own wait
    free0 = be.free_bytes()
    w, wbox = _on_thread(lambda: a.wait_freed(a.step_bytes()))
    w.join(0.2)
    assert w.is_alive() and a.freeing_bytes() == a.step_bytes()  # job 1's bytes do not count for job 2
    e2.set()
    w.join(JOIN)
    assert wbox == {"result": True} and be.free_bytes() - free0 == a.step_bytes()
    assert a.settle() == []
    a.close()
    assert be.live_handles == 0


def _on_thread(fn):
    box = {}

    def body():
        try:
            box["result"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=body)
    t.start()
    return t, box


def _set_steps_waits_for_the_helper(a, let_go):
    """set_steps(128) on another thread stays blocked while the helper's job is held, and finishes
    once ``let_go()`` releases it, with nothing failed or left stale."""
    t, box = _on_thread(lambda: a.set_steps(128))
    t.join(0.2)
    assert t.is_alive()
    let_go()
    t.join(JOIN)
    assert box == {"result": 128} and a.step_tokens == 128
    assert a.settle() == [] and not a.lending_disabled and a._stale == []


def test_set_steps_waits_for_an_async_unmap_in_flight_which_unmaps_the_sizes_it_was_lent_with():
    be, a = _arena(offset_mapping=False)
    assert a.lend() == 2
    w, e, reached = _blocked_wait()
    a.reclaim(wait=w, unmap_async=True)
    assert reached.wait(JOIN) and a.busy
    _set_steps_waits_for_the_helper(a, e.set)  # step 64 -> 128: held until the unmap of the 64-token steps is done
    assert a.lend() == 1
    a.close()
    assert be.live_handles == 0 and be._maps == {}


def test_set_steps_waits_for_an_async_drop_prepared_which_unmaps_the_sizes_they_were_made_with():
    be, a = _arena(offset_mapping=False)
    assert a.prepare(2) == 2
    gate = Gate(be, name="unmap")
    a.drop_prepared(release_async=True)
    assert gate.reached.wait(JOIN)
    _set_steps_waits_for_the_helper(a, gate.open)
    a.close()
    assert be.live_handles == 0 and be._maps == {}


def test_a_reclaim_waits_for_a_prepare_in_flight_and_drops_it_instead_of_leaving_it_above_a_gap():
    be, a = _arena(offset_mapping=False)
    assert a.lend(1) == 1
    gate = Gate(be, name="create")
    a.prepare_async(1)  # will map at base+64 (computed before its first create)
    assert gate.reached.wait(JOIN)
    assert a.prepared_steps == 0  # not yet in _ready
    t, box = _on_thread(lambda: a.reclaim(unmap_async=True))
    t.join(0.2)
    assert t.is_alive()  # held until the prepare is done
    gate.open()
    t.join(JOIN)
    assert box == {"result": 1} and a.settle() == []
    assert a._ready == [] and set(be._maps) == {a.token_va(i, 0) for i in range(len(ROWS))}  # dropped, nothing above the base
    assert be.live_handles == len(ROWS)
    a.close()
    assert be.live_handles == 0


def test_steps_needed_after_wait_room_counts_the_unmap_still_running_as_missing_and_reclaims_a_step_more(monkeypatch):
    from sglang_elastic.sched import controller as ctlmod
    from test_controller import ELASTIC, Bed
    from test_fast_lend import ROW
    from test_pool import make_pool

    built = make_pool(1, base=256, elastic=ELASTIC, step=64, offset_mapping=False)
    bed = Bed(built=built, free_bytes=ELASTIC * ROW, margin_mb=0, lend_bytes=ELASTIC * ROW)
    a, ctl = bed.pool.arena, bed.ctl
    a.set_steps(ELASTIC, 64)  # two steps (as --elastic-kv-handle-mb gives)
    assert ctl.lend() == ELASTIC and a.lent_steps == 2
    step = a.step_bytes()
    buf = a.step_tokens * a.row_bytes[0]
    ctl._pass_need, ctl._pass_free, ctl._pass_room = bed.be.free_bytes() + buf, (bed.be.free_bytes(), 0), buf  # this pass needs one buffer's worth
    go, released = threading.Event(), []

    def on_call(call):
        if call == "release" and threading.current_thread().name.startswith("sglang-elastic-vmm"):
            released.append(1)
            if len(released) == 2:
                assert go.wait(JOIN)

    bed.be.on_call = on_call
    assert ctl.reclaim(bed.batch, steps=1, why="test")
    ctl.after_prefill(bed.batch, bed.batch)  # _wait_room: one buffer back, the rest still on the helper
    assert a.busy
    # the next pass's before_prefill: its forward needs exactly the step the helper is still giving back
    monkeypatch.setattr(ctlmod, "eager_activation_bytes", lambda tokens, ranks=1: step)
    n_inflight = ctl.steps_needed(1)
    go.set()
    ctl._settle()
    n_settled = ctl.steps_needed(1)
    assert n_inflight == n_settled, f"steps_needed: {n_inflight} while the unmap runs, {n_settled} once it is done"


@pytest.mark.parametrize("call,nth", [("unmap", 3), ("release", 2)])
def test_an_unexpected_error_midway_through_the_helpers_unmap_leaves_exactly_the_rest_for_close(call, nth):
    """Not a VmmError (a bug) in the helper's unmap loop: the job stops, settle() reports it, lending
    stops, and close() unmaps and releases exactly what was not done (nothing twice: CI's exit once
    released a handle a second time and tried to unmap ranges already unmapped)."""
    be, a = _arena(offset_mapping=False)
    assert a.lend() == 2
    seen = []

    def on_call(name):
        if name == call and threading.current_thread().name.startswith("sglang-elastic-vmm"):
            seen.append(1)
            if len(seen) == nth:
                raise KeyError("a bug")

    be.on_call = on_call
    assert a.reclaim(1, unmap_async=True) == 1
    a.wait_freed(10**12)  # returns: the job ended
    [err] = a.settle()
    assert isinstance(err, KeyError) and a.lending_disabled
    n = len(ROWS)
    assert len(a._stale) == n - 2  # the buffers not unmapped: from the third on (for "release": the second was unmapped)
    assert len(a._stale_handles) == (n - 2 if call == "unmap" else n - 1)  # the handles not released
    be.on_call = None
    a.close()
    assert be.live_handles == 0 and be._maps == {} and a._stale == [] and a._stale_handles == []


def test_before_a_prefill_with_nothing_lent_the_scheduler_does_not_wait_for_a_reclaims_unmap_still_running():
    """Only a prepare in flight is waited for there (its memory is the forward's); the rest of a
    reclaim's unmap goes on behind the batch's formation, as after_prefill settles it."""
    from test_controller import Bed
    from test_fast_lend import ELASTIC, ROW

    bed = Bed(free_bytes=ELASTIC * ROW, margin_mb=0)
    assert bed.ctl.lend() == ELASTIC and bed.admit(list(range(30)))
    gate = Gate(bed.be, name="release")
    assert bed.ctl.reclaim(bed.batch, why="test")
    assert gate.reached.wait(JOIN) and bed.pool.arena.busy and not bed.pool.arena.preparing
    bed.sched.waiting_queue.append(bed.request(list(range(500, 600))))
    t, box = _on_thread(lambda: bed.ctl.before_prefill(bed.batch))
    t.join(JOIN)
    assert not t.is_alive() and box == {"result": None}  # returned with the release still held
    assert bed.pool.arena.busy and not bed.ctl._dropped_prepared
    gate.open()
    bed.ctl.after_prefill(bed.batch, bed.batch)  # the forward's turn: the release is waited for here
    assert not bed.pool.arena.busy
    # a prepare in flight is reported, and waited for by drop_prepared
    a = bed.pool.arena
    g2 = Gate(bed.be, name="create")
    a.prepare_async(1)
    assert g2.reached.wait(JOIN) and a.preparing
    g2.open()
    assert a.settle() == [] and not a.preparing
    bed.check_ownership_and_accounting()
