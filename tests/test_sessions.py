"""KV held outside the running batch and the radix tree, through a reclaim:
SGLang's streaming sessions (``--enable-streaming-session``), the chunked
request, and a reclaim that cannot finish (issue 22, defect 1).

Real SGLang throughout: ``StreamingSession`` over ``RadixCache`` (as
``create_tree_cache`` wraps it), ``SessionController``, ``Req`` with its
session, the finish path ``release_kv_cache`` that saves a turn's KV into
the session's slot, ``release_session``, the pool-stats observer and the
invariant checker (its pool invariant and its KV page check for
use-after-free and double free); our pool on the host VMM backend.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.mem_cache.common import release_kv_cache

from sglang_elastic.sched import controller
from test_controller import BASE, ELASTIC, Bed, sglang_runtime_context  # noqa: F401 (the fixture)


def _lent(ids, bed) -> int:
    return int((ids >= bed.alloc.base_tokens).sum())


def test_a_reclaim_remaps_a_streaming_sessions_slot_and_its_next_turn_reads_the_same_kv():
    """The issue's case, page size 1: a 220-token turn with 17 lent tokens is
    kept in its session's slot; the reclaim moves them into the base and
    rewrites the slot's row (before: the row kept 17 ids above the base top,
    unmapped, and the 17 copies belonged to nobody)."""
    bed = Bed(streaming=True)
    s = bed.open_session("s1")
    bed.ctl.lend()
    other = bed.admit(list(range(5000, 5052)))  # 52 base tokens, cached in the tree when it finishes
    turn = bed.admit(list(range(100, 300)), session=s)  # 200 base tokens: 3 left
    bed.finish(other)
    for _ in range(20):
        assert bed.decode(only=[turn])
    bed.finish(turn)  # SGLang saves the turn's KV into the session's slot
    row = bed.slot_row("s1")
    assert row.numel() == 220 and _lent(row, bed) == 17
    k = bed.kv_of(row)
    bed.check_ownership_and_accounting()

    bed.ctl.reclaim(bed.batch)
    assert bed.alloc.lent_tokens == 0
    row_after = bed.slot_row("s1")
    assert _lent(row_after, bed) == 0, "the slot's row still points into the unmapped range"
    assert torch.equal(bed.kv_of(row_after), k)
    assert torch.equal(row_after[:200], row[:200])  # the prompt stayed in the base: only the lent tail moved
    bed.check_ownership_and_accounting()  # SGLang's session-held accounting and its page check agree

    bed.ctl.lend()  # fresh lent memory where the old ids pointed
    nxt = bed.admit(list(range(100, 300)) + list(turn.output_ids) + list(range(7000, 7010)), session=s)
    assert nxt.req_pool_idx == bed.tree.slots["s1"].req_pool_idx and nxt.prefix_indices.numel() == 220  # restored from the slot
    assert torch.equal(bed.kv_of(nxt.prefix_indices), k), "the next turn reads other bytes than its own KV"
    bed.finish(nxt)
    bed.sessions.close(close_request("s1"))  # SGLang's release_session: every id back on the free list once
    assert "s1" not in bed.tree.slots
    bed.check_ownership_and_accounting()


def close_request(sid):
    from sglang.srt.managers.io_struct import CloseSessionReqInput

    return CloseSessionReqInput(session_id=sid)


def test_without_base_room_an_idle_sessions_kv_is_dropped_before_a_running_request_is_retracted():
    """The slot's lent KV and a running request do not both fit in the base.
    Before: a RuntimeError ('no base room ... after retracting every
    request') stopped the scheduler, and the retracted request was lost.
    Now the idle slot goes (SGLang's release_session, as for an aborted
    turn: the session's next turn prefills again) and nothing is retracted."""
    bed = Bed(streaming=True)
    s = bed.open_session("s1")
    bed.ctl.lend()
    filler = bed.admit(list(range(20000, 20050)))  # 50 base tokens, running
    turn = bed.admit(list(range(100, 250)), session=s)  # 150 base tokens
    for _ in range(80):
        assert bed.decode(only=[turn])  # 55 base, 25 lent
    bed.finish(turn)
    assert _lent(bed.slot_row("s1"), bed) == 25
    running = bed.admit(list(range(9000, 9060)))  # the base is full: 60 lent tokens
    rows = bed.rows()
    assert _lent(rows[running.rid], bed) == 60
    k = bed.kv_of(rows[running.rid])

    bed.ctl.reclaim(bed.batch)
    assert bed.alloc.lent_tokens == 0 and bed.sched.waiting_queue == []  # nothing retracted
    assert {r.rid for r in bed.batch.reqs} == {filler.rid, running.rid}
    assert "s1" not in bed.tree.slots  # the idle session's KV was dropped
    after = bed.rows()[running.rid]
    assert _lent(after, bed) == 0 and torch.equal(bed.kv_of(after), k)
    bed.check_ownership_and_accounting()
    # the session still works: its next turn matches the radix tree and prefills the rest
    bed.finish(running)
    bed.finish(filler)
    nxt = bed.admit(list(range(100, 250)) + list(turn.output_ids) + [7000], session=s)
    assert nxt is not None and nxt.kv.kv_allocated_len == 231
    bed.finish(nxt)  # a first turn again: a new slot
    assert bed.slot_row("s1").numel() == 231
    bed.check_ownership_and_accounting()


def _stuck_reclaim_bed():
    """A reclaim that cannot finish: the lent KV of a session slot that a
    waiting request restored (SGLang matched its next turn, then had no room
    to admit it) and of the chunked request (kept out of the running batch
    between chunks) does not fit in the base even after evicting the tree
    and retracting the running request."""
    bed = Bed(streaming=True)
    s = bed.open_session("s1")
    bed.ctl.lend()
    turn = bed.admit(list(range(100, 300)), session=s)  # 200 base tokens
    filler = bed.admit(list(range(20000, 20055)))  # the rest of the base
    for _ in range(20):
        assert bed.decode(only=[turn])  # 20 lent tokens
    bed.finish(turn)  # slot: 200 base tokens (the prompt, in the tree, locked by the slot) and 20 lent
    nxt = bed.request(list(range(100, 300)) + list(turn.output_ids) + list(range(7000, 7010)), session=s)
    nxt.init_next_round_input(bed.tree)  # restores the slot's row ...
    bed.sched.waiting_queue.append(nxt)  # ... and waits for room
    bed.finish(filler)  # 55 cached tokens, evictable
    chunked = bed.admit(list(range(30000, 30110)))  # evicts the filler: 55 base and 55 lent tokens
    bed.batch.reqs.remove(chunked)
    bed.sched.chunked_req = chunked
    victim = bed.admit(list(range(40000, 40010)))  # a running request, 10 lent tokens
    assert _lent(bed.slot_row("s1"), bed) == 20 and _lent(bed.rows()[victim.rid], bed) == 10
    bed.check_ownership_and_accounting()
    return bed, nxt, chunked, victim


def test_a_reclaim_that_cannot_finish_stops_keeps_the_pool_lent_and_loses_no_request(caplog):
    bed, nxt, chunked, victim = _stuck_reclaim_bed()
    rows = {"slot": bed.slot_row("s1"), "chunked": bed.r2t.req_to_token[chunked.req_pool_idx, :110].to(torch.int64).clone()}
    k = {n: bed.kv_of(r) for n, r in rows.items()}
    with caplog.at_level(logging.INFO, logger=controller.__name__):
        done = bed.ctl.reclaim(bed.batch)  # before: RuntimeError, and the retracted request was never re-queued
    assert done is False
    assert bed.alloc.lent_tokens == bed.pool.arena.lent_tokens == ELASTIC  # still lent, still mapped
    assert victim in bed.sched.waiting_queue and victim.kv is None and victim not in bed.batch.reqs  # retracted, re-queued
    assert nxt in bed.sched.waiting_queue
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "reclaim stopped" in errors[0] and "lending is off" in errors[0]
    for n, r in rows.items():
        assert torch.equal(bed.kv_of(r), k[n])  # nothing moved, nothing unmapped
    assert torch.equal(bed.slot_row("s1"), rows["slot"])
    bed.check_ownership_and_accounting()

    # tried again before the next prefill, without retracting: still stuck while the chunked request holds its KV
    bed.ctl.before_prefill(bed.batch)
    assert bed.alloc.lent_tokens == ELASTIC and bed.sched.waiting_queue.count(victim) == 1
    # the chunked request finishes (SGLang's release path): the next attempt goes through
    bed.sched.chunked_req = None
    release_kv_cache(chunked, bed.tree)
    bed.ctl.before_prefill(bed.batch)
    assert bed.alloc.lent_tokens == 0 and bed.pool.arena.lent_steps == 0
    slot = bed.slot_row("s1")
    assert _lent(slot, bed) == 0 and torch.equal(bed.kv_of(slot), k["slot"])
    bed.check_ownership_and_accounting()
    assert bed.ctl.lend() == 0 and bed.ctl.disabled  # lending stays off
    bed.check_ownership_and_accounting()


def test_an_exception_inside_a_reclaim_does_not_escape_and_leaves_the_pool_lent_and_consistent(monkeypatch, caplog):
    """A bug in the vacate (here: the id rewrite raises) must not stop the
    scheduler: nothing was rewritten yet, so the withdraw is undone, the
    retracted requests are re-queued, lending stops."""
    bed = Bed()
    bed.ctl.lend()
    big = bed.admit(list(range(1000, 1200)))
    small = bed.admit(list(range(2000, 2150)))  # 95 lent tokens
    while bed.decode() and bed.alloc.available_size() > 0:
        pass
    rows = bed.rows()
    k = {rid: bed.kv_of(r) for rid, r in rows.items()}
    monkeypatch.setattr(controller, "remap_many", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("injected")))
    with caplog.at_level(logging.INFO, logger=controller.__name__):
        assert bed.ctl.reclaim(bed.batch) is False
    assert any(r.levelname == "ERROR" and "RuntimeError: injected" in r.getMessage() for r in caplog.records)
    assert bed.alloc.lent_tokens == ELASTIC
    assert [r.rid for r in bed.sched.waiting_queue] == [big.rid]  # retracted to make room, then re-queued
    assert torch.equal(bed.kv_of(bed.rows()[small.rid]), k[small.rid])
    bed.check_ownership_and_accounting()
    monkeypatch.undo()
    bed.ctl.before_prefill(bed.batch)  # a request waits: tried again, goes through
    assert bed.alloc.lent_tokens == 0
    after = bed.rows()[small.rid]
    assert _lent(after, bed) == 0 and torch.equal(bed.kv_of(after), k[small.rid])
    bed.check_ownership_and_accounting()
