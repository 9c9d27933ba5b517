"""Python garbage-collection pauses of an SGLang process, to tell a slow decode step that is a
collection from one that is not (opt-in: ``SGLANG_ELASTIC_GC_STATS=1``).

A full (generation 2) collection of a scheduler process holding many objects can take
milliseconds, on the scheduler's thread, between two decode steps. CPython runs one only
when the objects that survived since the last one exceed a quarter of the long-lived ones,
so such pauses cluster in a server's first long load and fade later: the pattern seen on
an H100 on 2026-12-06 (slow steps every ~64 tokens of a first 8 x 4K load, on stock and
offload alike, none in later loads; ``docs/offload.md``). SGLang 0.5.17 logs collections only
in its tokenizer manager (``--gc-warning-threshold-secs``), not in the scheduler.

With the variable set, :func:`register` (run by the plugin's entry point) adds a
``gc.callbacks`` entry (two ``perf_counter`` reads a collection) in every process the plugin
loads in, and an AFTER hook on ``Scheduler.get_internal_state`` through which the scheduler
reports :func:`snapshot` in ``/server_info``'s ``internal_states[i]["gc"]``. Unset: nothing
is installed, registered or reported.
"""

from __future__ import annotations

import collections
import gc
import os
import time
from typing import Deque, Dict, List, Optional, Tuple

ENV = "SGLANG_ELASTIC_GC_STATS"
#: collections at least this long are kept with their wall time (``recent``)
RECENT_MS = 1.0
RECENT_MAX = 256


class GcStats:
    """Counts, total and longest pause per generation, and the last :data:`RECENT_MAX` pauses of
    :data:`RECENT_MS` or more as ``(time.time() at the end, generation, ms)``."""

    def __init__(self):
        self.count = [0, 0, 0]
        self.ms = [0.0, 0.0, 0.0]
        self.max_ms = [0.0, 0.0, 0.0]
        self.recent: Deque[Tuple[float, int, float]] = collections.deque(maxlen=RECENT_MAX)
        self._t0: Optional[float] = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        if phase != "stop" or self._t0 is None:
            return
        ms = (time.perf_counter() - self._t0) * 1e3
        self._t0 = None
        g = min(max(int(info.get("generation", 0)), 0), 2)
        self.count[g] += 1
        self.ms[g] += ms
        self.max_ms[g] = max(self.max_ms[g], ms)
        if ms >= RECENT_MS:
            self.recent.append((time.time(), g, round(ms, 3)))

    def snapshot(self) -> Dict[str, List]:
        return {"collections": list(self.count), "ms": [round(x, 3) for x in self.ms], "max_ms": [round(x, 3) for x in self.max_ms],
                "recent": [list(r) for r in self.recent]}


_STATS: Optional[GcStats] = None
_registered = False


def install() -> bool:
    """Add the callback once in this process when ``SGLANG_ELASTIC_GC_STATS`` is ``1``; returns whether it is in."""
    global _STATS
    if _STATS is None and os.environ.get(ENV) == "1":
        _STATS = GcStats()
        gc.callbacks.append(_STATS)
    return _STATS is not None


def register() -> None:
    """:func:`install`, and when it is in, the ``Scheduler.get_internal_state`` hook (:func:`after_internal_state`;
    applied by SGLang's ``HookRegistry.apply_hooks`` after the plugins load). Idempotent."""
    global _registered
    if install() and not _registered:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.get_internal_state", after_internal_state, HookType.AFTER)
        _registered = True


def after_internal_state(result, sched, *args, **kwargs):
    """AFTER hook on ``Scheduler.get_internal_state``: this scheduler's collections under ``gc`` (when installed)."""
    state = getattr(result, "internal_state", None)
    gc_state = snapshot()
    if isinstance(state, dict) and gc_state is not None:
        state["gc"] = gc_state
    return result


def snapshot() -> Optional[dict]:
    """This process's collections so far (:meth:`GcStats.snapshot`), or None when not installed."""
    return _STATS.snapshot() if _STATS is not None else None


def window(before: Optional[dict], after: Optional[dict], t0: float, t1: float) -> Optional[dict]:
    """What happened between two snapshots of one process, for a load that ran from ``t0`` to ``t1``
    (``time.time()``): per generation the collections and their total ms (differences), and the pauses of
    :data:`RECENT_MS` or more that ended inside the window (``pauses``: ``[[seconds after t0, generation,
    ms]]``; a window with more than :data:`RECENT_MAX` of them keeps the last). None without both."""
    if not before or not after:
        return None
    return {"collections": [a - b for a, b in zip(after["collections"], before["collections"])],
            "ms": [round(a - b, 3) for a, b in zip(after["ms"], before["ms"])],
            "pauses": [[round(t - t0, 3), g, ms] for t, g, ms in after["recent"] if t0 <= t <= t1]}
