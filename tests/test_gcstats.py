"""The opt-in garbage-collection timer (SGLANG_ELASTIC_GC_STATS=1) and its place in /server_info."""

from __future__ import annotations

import gc
import time

import pytest

from sglang_elastic import gcstats


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(gcstats, "_STATS", None)
    callbacks = list(gc.callbacks)
    yield
    gc.callbacks[:] = callbacks  # whatever a test installed goes


def test_nothing_is_installed_or_reported_without_the_variable(fresh, monkeypatch):
    monkeypatch.delenv(gcstats.ENV, raising=False)
    n = len(gc.callbacks)
    assert gcstats.install() is False and gcstats.snapshot() is None and len(gc.callbacks) == n


def test_full_collections_are_counted_timed_and_windowed(fresh, monkeypatch):
    monkeypatch.setenv(gcstats.ENV, "1")
    assert gcstats.install() is True and gcstats.install() is True  # once
    assert sum(cb is gcstats._STATS for cb in gc.callbacks) == 1
    monkeypatch.setattr(gcstats, "RECENT_MS", 0.0)  # keep every pause, however short, in `recent`
    before = gcstats.snapshot()
    t0 = time.time()
    gc.disable()  # only the two collections asked for below (building the list would trigger its own)
    try:
        junk = [[i, str(i)] for i in range(200_000)]  # objects a full collection must traverse
        gc.collect(2)
        gc.collect(2)
        del junk
    finally:
        gc.enable()
    t1 = time.time()
    after = gcstats.snapshot()
    w = gcstats.window(before, after, t0, t1)
    assert w["collections"][2] == 2 and w["ms"][2] > 0 and after["max_ms"][2] >= w["ms"][2] / 2
    gen2 = [p for p in w["pauses"] if p[1] == 2]
    assert len(gen2) == 2 and all(0 <= p[0] <= t1 - t0 and p[2] > 0 for p in gen2)
    assert sum(p[2] for p in gen2) == pytest.approx(w["ms"][2], abs=2e-3)  # each pause rounded to the µs
    assert gcstats.window(None, after, t0, t1) is None


def test_the_scheduler_state_hook_is_registered_with_the_variable_and_reports_the_collections(fresh, monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry

    seen = []
    monkeypatch.setattr(HookRegistry, "register", classmethod(lambda cls, target, fn, kind: seen.append((target, fn))))
    monkeypatch.setattr(gcstats, "_registered", False)
    monkeypatch.delenv(gcstats.ENV, raising=False)
    gcstats.register()
    assert seen == []  # unset: nothing installed, nothing hooked
    monkeypatch.setenv(gcstats.ENV, "1")
    gcstats.register()
    gcstats.register()
    assert seen == [("sglang.srt.managers.scheduler.Scheduler.get_internal_state", gcstats.after_internal_state)]
    gc.collect(1)
    result = type("R", (), {"internal_state": {}})()
    out = gcstats.after_internal_state(result, type("S", (), {})())
    assert out.internal_state["gc"]["collections"][1] >= 1 and set(out.internal_state["gc"]) == {"collections", "ms", "max_ms", "recent"}
    monkeypatch.setattr(gcstats, "_STATS", None)
    assert "gc" not in gcstats.after_internal_state(type("R", (), {"internal_state": {}})(), type("S", (), {})()).internal_state
