"""How much of the V copy time a decode step hides behind compute
(``--kv-offload-copy-timing``).

A sparse layer's misses are copied host -> GPU on the compute stream, on the
step's critical path. With ``--kv-offload-prefetch speculative`` most copies
run earlier, on a side stream, while the layer before computes; the layer then
waits for that stream, and copies only the residual misses itself. Per timed
step and sparse layer ``l``, CUDA events give:

- ``crit_l``: the residual copy on the compute stream (``copy_rows_run`` in
  :meth:`~sglang_elastic.offload.decode.OffloadDecoder.sparse`);
- ``pf_l``: the prefetch's copy on the side stream (the same kernel in
  :meth:`~sglang_elastic.offload.decode.OffloadDecoder.prefetch`);
- ``stall_l``: how long the compute stream waited for the side stream before
  the layer's own pass (a recorded event, the wait, a recorded event).

    copy time    = sum_l (pf_l + crit_l)
    exposed time = sum_l (crit_l + min(stall_l, pf_l))
    hidden share = 1 - exposed / copy

(a stall longer than the copy is the guess's selection, not copy time).
Without prefetch every copy is exposed: the share is 0 and the copy time per
step is still measured.

The events are CUDA "external" events (``torch.cuda.Event(enable_timing=True,
external=True)``), so they become event-record nodes of the decode CUDA
graphs: one set per captured graph (per batch size), re-recorded by every
replay, plus one set for eager steps. Every ``every``-th decode step, the
set of the graph replayed last is read once the last event it recorded on
the compute stream has completed (``query()``, no wait); when the next step
is launched before that (below), the host waits for it once; a read that
races a newer replay (an event not ready, a negative duration) is dropped.
Pattern: SGLang's ``LayerDoneCounter`` events for the wait, this package's
:class:`sglang_elastic.attention.online.ReplayTimer` for the read-back.

With SGLang's overlap scheduler the CPU forms the next step while the GPU
runs this one, so at a steady batch size the same graph is launched again
before the GPU has passed the step due for a read, and its replay would
re-record the events first: that lost all but 2 steps per run of 64 x 32K on
the H200. So when a step is due (``every`` steps since the last read) and
the next step is about to be launched (the same graph would record the events
again; another one would leave them behind), :meth:`CopyTimer.begin` waits on the
host for that step's last event, reads it, then lets the replay go
(``wait_due``, the default): one host wait per ``every`` steps, counted in
``copy_waits`` and ``copy_wait_ms`` (the GPU idles for the rest of the next
step's host preparation, once per ``every`` steps). With ``wait_due=False``
such a step is lost instead (``copy_unread_steps``). A layer's copy kernel
runs even when nothing misses, and its span counts as copy time (a few
microseconds a layer).

Cost: 4 event records per sparse layer and step (6 with prefetch), inside the
graphs, and the wait above once per ``every`` steps; off by default.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Hashable, List, Optional, Tuple

#: Event names: the residual copy (compute stream), the prefetch's copy (side stream), the wait on the side stream.
CRIT, PREFETCH, STALL = ("c0", "c1"), ("p0", "p1"), ("w0", "w1")
#: Keys of :meth:`CopyTimer.stats`.
STATS = ("copy_timed_steps", "copy_unread_steps", "copy_ms", "copy_exposed_ms", "copy_prefetch_ms", "copy_stall_ms",
         "copy_waits", "copy_wait_ms")


class _Set:
    """The events of one captured graph (or of the eager steps)."""

    __slots__ = ("events", "used", "last_main", "fresh", "captured")

    def __init__(self, captured: bool):
        self.events: Dict[Tuple[int, str], object] = {}  # made once, re-recorded
        self.used: set = set()  # the events this set's step records (a graph's: fixed at capture; eager: per step)
        self.last_main: Optional[object] = None  # the last event recorded on the compute stream
        self.fresh = False  # recorded since it was last read
        self.captured = captured


class CopyTimer:
    """CUDA events around a decode step's V copies; the hidden share read back without a host sync,
    but for one wait per ``every`` steps when the next step is launched before the due one finished.

    Args:
        every: read one step's events every ``every`` decode steps (at least 1).
        event_factory: makes one event (default ``torch.cuda.Event(enable_timing=True, external=True)``;
            tests inject fakes with ``record()``, ``query()``, ``synchronize()``, ``elapsed_time(other)`` in ms).
        wait_due: a step due for a read whose graph is launched again before the GPU passed it is
            waited for on the host and read (one wait per ``every`` steps), not lost.

    Raises:
        ValueError: ``every`` < 1.
    """

    def __init__(self, every: int = 16, event_factory: Optional[Callable[[], object]] = None, wait_due: bool = True):
        if every < 1:
            raise ValueError(f"CopyTimer: every must be >= 1, not {every}")
        if event_factory is None:
            import torch

            def event_factory():
                return torch.cuda.Event(enable_timing=True, external=True)

        self._make = event_factory
        self.every = every
        self.wait_due = wait_due
        self._sets: Dict[Hashable, _Set] = {}
        self._cur: Optional[_Set] = None
        self._last: Optional[_Set] = None
        self._since = 0
        self.totals = dict.fromkeys(STATS, 0.0)
        self.totals["copy_timed_steps"] = self.totals["copy_unread_steps"] = self.totals["copy_waits"] = 0
        self.dropped = 0

    def begin(self, key: Hashable, capture: bool = False) -> None:
        """A decode forward starts: ``key`` names its graph (e.g. ``(batch size, variant)``; ``"eager"``
        for a step outside the graphs). ``capture``: SGLang is about to warm up and capture that graph,
        whose event-record nodes take this set's events (made fresh)."""
        if capture or key not in self._sets:
            self._sets[key] = _Set(captured=capture)
        self._cur = s = self._sets[key]
        if not capture:
            if self._due():  # not read: this launch would record it again (the same graph) or leave it behind (another one)
                if self.wait_due:  # wait for the GPU to pass it, read it, then let the launch go
                    t0 = time.perf_counter()
                    self._last.last_main.synchronize()
                    self.totals["copy_waits"] += 1
                    self.totals["copy_wait_ms"] += (time.perf_counter() - t0) * 1e3
                    self.poll()
                else:
                    self.totals["copy_unread_steps"] += 1
            if not s.captured:  # an eager step records its own events now (the batch decides which layers copy)
                s.used.clear()
                s.last_main = None
            s.fresh = True
            self._last = self._cur
            self._since += 1

    def end(self) -> None:
        """No decode forward is being recorded (a prefill, an idle batch)."""
        self._cur = None

    def mark(self, layer: int, name: str, main: bool = True) -> None:
        """Record event ``name`` of ``layer`` on the current stream (``main``: the compute stream)."""
        s = self._cur
        if s is None:
            return
        ev = s.events.get((layer, name))
        if ev is None:
            ev = s.events[(layer, name)] = self._make()
        ev.record()
        s.used.add((layer, name))
        if main:
            s.last_main = ev

    def clock(self, layer: int, names: Tuple[str, str], main: bool = True) -> Optional[Callable[[int], None]]:
        """``f(i)`` recording ``names[i]`` of ``layer`` (the copy's start and end), or None outside a decode forward."""
        if self._cur is None:
            return None
        return lambda i: self.mark(layer, names[i], main)

    def _due(self) -> bool:
        """The last replayed step is due for a read (``every`` steps since the last read) and not read yet."""
        s = self._last
        return s is not None and s.fresh and s.last_main is not None and self._since >= self.every

    def poll(self) -> bool:
        """Read the last replayed step's events if ``every`` steps passed and they completed; True when a sample was taken."""
        s = self._last
        if not self._due():
            return False
        try:
            if not s.last_main.query():
                return False
            sample = self._read(s)
        except RuntimeError:  # an event a newer replay re-recorded and the GPU has not passed yet
            sample = None
        s.fresh = False
        self._since = 0
        if sample is None:
            self.dropped += 1
            return False
        copy, exposed, pf, stall = sample
        t = self.totals
        t["copy_timed_steps"] += 1
        t["copy_ms"] += copy
        t["copy_exposed_ms"] += exposed
        t["copy_prefetch_ms"] += pf
        t["copy_stall_ms"] += stall
        return True

    @staticmethod
    def _read(s: _Set) -> Optional[Tuple[float, float, float, float]]:
        ev, used = s.events, s.used

        def span(layer, names):
            if (layer, names[0]) not in used or (layer, names[1]) not in used:
                return 0.0
            a, b = ev[(layer, names[0])], ev[(layer, names[1])]
            d = a.elapsed_time(b)
            if d < 0:
                raise RuntimeError("events of two replays")
            return d

        copy = exposed = pf_all = stall_all = 0.0
        for layer in sorted({k[0] for k in used}):
            crit, pf, stall = span(layer, CRIT), span(layer, PREFETCH), span(layer, STALL)
            copy += pf + crit
            exposed += crit + min(stall, pf)
            pf_all += pf
            stall_all += stall
        return copy, exposed, pf_all, stall_all

    def stats(self) -> dict:
        """Since start: ``copy_unread_steps`` (steps due for a read that the next launch came before the GPU
        had passed them; 0 with ``wait_due``), ``copy_waits`` and ``copy_wait_ms`` (the host's waits for such a
        step, and their time), over the timed steps: ``copy_timed_steps``,
        ``copy_ms`` (all V copy time; a layer's copy kernel runs, and counts, even when nothing misses), ``copy_exposed_ms``
        (on the critical path), ``copy_prefetch_ms`` (on the side stream), ``copy_stall_ms`` (the compute stream's waits
        for it), and ``copy_hidden_share`` (1 - exposed / copy; None before a timed step copied anything)."""
        t = dict(self.totals)
        t["copy_hidden_share"] = hidden_share(t["copy_ms"], t["copy_exposed_ms"])
        return t


def hidden_share(copy_ms: float, exposed_ms: float) -> Optional[float]:
    """``1 - exposed / copy`` (clipped to [0, 1]), None when nothing was copied."""
    if not copy_ms > 0:
        return None
    return min(1.0, max(0.0, 1.0 - exposed_ms / copy_ms))


def interval(prev: Optional[dict], now: dict) -> Dict[str, Optional[float]]:
    """Between two :meth:`CopyTimer.stats`: ``copy_hidden_share`` and ``copy_ms_per_step`` (None: no timed step)."""
    keys = ("copy_timed_steps", "copy_ms", "copy_exposed_ms")
    d = {k: now.get(k, 0) - (prev or {}).get(k, 0) for k in keys}
    steps = d["copy_timed_steps"]
    return {"copy_hidden_share": hidden_share(d["copy_ms"], d["copy_exposed_ms"]) if steps else None,
            "copy_ms_per_step": d["copy_ms"] / steps if steps else None}


__all__: List[str] = ["CopyTimer", "CRIT", "PREFETCH", "STALL", "STATS", "hidden_share", "interval"]
