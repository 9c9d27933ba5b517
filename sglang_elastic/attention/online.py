"""Online correction of the decode policy: timed CUDA-graph replays per bucket.

The cost model (with the shape's calibration) is the prior; what the server
measures overrides it. Every ``sample_every``-th decode graph replay is timed
with a pair of CUDA events recorded around ``DecodeCudaGraphRunner.execute``
(the whole step as the user sees it: metadata, plan, the graph). Events are
read back with ``Event.query()`` on later steps, only once the GPU has passed
them, so no step ever waits for the GPU (no host sync; ``elapsed_time`` of
completed events does not block). Samples land in the step's bucket:

    (batch size rounded up to a power of two,
     mean KV length in 1/8-octave steps (9 % wide: a batch stays in one for
     hundreds of steps at long lengths),
     longest / mean in octaves, capped at 3 (even, 2x, 4x, 8x+ stragglers))

Per bucket and path an exponentially weighted mean of the step time
(``alpha``). On timed steps of a bucket where a path has fewer than
``min_samples`` samples, that path is replayed instead (round robin: every
path of ``auto`` is captured for every batch size, and all compute the same
attention, so exploring costs time only, never correctness); afterwards one
timed step in ``refresh_every`` re-times another path, so drift is seen (a
re-timed path that beats the choice is timed again on the next timed steps
until its mean crosses or it stops winning). With every path measured, the
bucket's choice is the fastest; it moves from the current one only when
another is ``margin`` faster and, over the paths' last :data:`WINDOW`
samples, by ``z`` standard errors of the difference of the means too
(hysteresis: no flapping on noise; a step's time varies with
the rest of the step, and on a near-tie a few noisy samples moved a bucket of
a 128 x 2K batch to a path 0.9 % slower on the H200, 2026-12-04).
Consecutive samples of a bucket are a few steps apart, so the paths are
compared at nearly the same lengths.

Ideas: online autotuning of kernel choices in FlashInfer's and PyTorch's
tuners (``torch._inductor`` benchmarking) done here on live replays instead of
offline, as the PersistentKV paper's route selection suggests (arXiv 2606.26666).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

BucketKey = Tuple[int, int, int]
#: Mean-length buckets per octave.
STEPS_PER_OCTAVE = 8


def bucket_key(batch: int, mean: int, longest: int) -> BucketKey:
    """The online bucket of a batch (module docstring)."""
    bs = 1 << max(0, int(batch) - 1).bit_length()
    m = max(1, int(mean))
    return bs, int(STEPS_PER_OCTAVE * math.log2(m)), min(3, int(math.log2(max(1, int(longest)) / m)) if longest > m else 0)


#: Samples per path kept for the switch test (the last ``WINDOW``): its standard
#: error shrinks with them, and follows drift after ``WINDOW`` samples.
WINDOW = 32


@dataclasses.dataclass
class PathStat:
    """A path's step time in one bucket: the exponentially weighted mean
    (:attr:`ewma_us`, what the choice ranks by) and the last :data:`WINDOW`
    samples (:attr:`recent`, what the switch test reads)."""

    ewma_us: float = 0.0
    n: int = 0
    recent: Deque[float] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=WINDOW))

    def add(self, us: float, alpha: float) -> None:
        self.ewma_us = us if self.n == 0 else (1 - alpha) * self.ewma_us + alpha * us
        self.n += 1
        self.recent.append(us)

    def window(self) -> Tuple[int, float, float]:
        """``(samples, mean, sum of squared deviations)`` of :attr:`recent`."""
        k = len(self.recent)
        if not k:
            return 0, 0.0, 0.0
        m = sum(self.recent) / k
        return k, m, sum((x - m) ** 2 for x in self.recent)


@dataclasses.dataclass
class _Bucket:
    stats: Dict[str, PathStat]
    choice: Optional[str] = None  # the measured decision (None: not all paths measured yet)
    prior: Optional[str] = None  # the cost model's last pick here
    visits: int = 0  # timed steps
    recheck: Optional[str] = None  # a path whose last sample beat the choice: timed again next


class OnlineCorrector:
    """Per-bucket path choice from measured step times (module docstring). Pure Python.

    Args:
        paths: the paths the policy can replay (two or more).
        sample_every: one step in this many is timed.
        min_samples: samples per path before a bucket's choice is measured.
        refresh_every: a bucket's timed steps between re-timings of another path.
        alpha: weight of a new sample in the running mean.
        margin: how much faster (fraction) another path must measure to replace the choice.
        z: how many standard errors of the difference of the windowed means the gap must exceed as well.

    Raises:
        ValueError: fewer than two paths, or a parameter out of range.
    """

    def __init__(self, paths: Sequence[str], sample_every: int = 16, min_samples: int = 3, refresh_every: int = 32,
                 alpha: float = 0.25, margin: float = 0.01, max_buckets: int = 4096, z: float = 3.0):
        if len(paths) < 2:
            raise ValueError(f"online correction needs two or more paths, not {tuple(paths)}")
        if sample_every < 1 or min_samples < 1 or refresh_every < 1 or not 0 < alpha <= 1 or not 0 <= margin < 1 or not z >= 0:
            raise ValueError("online correction: sample_every, min_samples, refresh_every >= 1, 0 < alpha <= 1, 0 <= margin < 1, z >= 0")
        self.paths = tuple(paths)
        self.sample_every, self.min_samples, self.refresh_every = sample_every, min_samples, refresh_every
        self.alpha, self.margin, self.max_buckets, self.z = alpha, margin, max_buckets, z
        self.buckets: Dict[BucketKey, _Bucket] = {}
        #: set for the step being timed (by :meth:`begin_step`); ``choose`` explores only then
        self.sampling = False
        self._pending: Optional[Tuple[BucketKey, str]] = None
        #: the path the last :meth:`choose` returned when it was not the bucket's choice (exploring or re-timing), else None
        self.explored: Optional[str] = None
        self._step = 0
        self.switches = 0  # measured choices that overrode the previous one (for logs and tests)

    def begin_step(self) -> bool:
        """Called before a replay's metadata: whether this step is timed."""
        self._step += 1
        self.sampling = self._step % self.sample_every == 0
        self._pending = None
        return self.sampling

    def end_step(self) -> Optional[Tuple[BucketKey, str]]:
        """After the replay: ``(bucket, path)`` the timed step ran, or ``None``."""
        out, self._pending, self.sampling = self._pending, None, False
        return out

    def _bucket(self, key: BucketKey) -> _Bucket:
        b = self.buckets.get(key)
        if b is None:
            if len(self.buckets) >= self.max_buckets:
                self.buckets.clear()
            b = self.buckets[key] = _Bucket(stats={p: PathStat() for p in self.paths})
        return b

    def choose(self, key: BucketKey, prior: str) -> str:
        """The path for a batch of ``key`` whose cost-model pick is ``prior``."""
        b = self._bucket(key)
        b.prior = prior
        choice = b.choice or prior
        self.explored = None
        if not self.sampling:
            return choice
        b.visits += 1
        missing = [p for p in self.paths if b.stats[p].n < self.min_samples]
        if missing:
            path = choice if choice in missing else missing[b.visits % len(missing)]
        elif b.recheck is not None:
            path = b.recheck
        elif b.visits % self.refresh_every == 0:
            others = [p for p in self.paths if p != choice]
            path = others[(b.visits // self.refresh_every) % len(others)]
        else:
            path = choice
        self._pending = (key, path)
        self.explored = path if path != choice else None
        return path

    def record(self, key: BucketKey, path: str, us: float) -> None:
        """A measured step time (us) of ``path`` in bucket ``key``; updates the bucket's choice."""
        if not (us > 0 and math.isfinite(us)) or path not in self.paths:
            return
        b = self._bucket(key)
        b.stats[path].add(us, self.alpha)
        if any(b.stats[p].n < self.min_samples for p in self.paths):
            return
        inc = b.choice or b.prior or path
        # a re-timed path that beats the choice is timed again on the next timed
        # steps (not refresh_every later) until its mean crosses, or a sample does not beat it
        b.recheck = path if path != inc and us < (1 - self.margin) * b.stats[inc].ewma_us else None
        best = min(self.paths, key=lambda p: b.stats[p].ewma_us)
        new = best if self._beats(b, best, inc) else inc
        if b.choice is not None and new != b.choice:
            self.switches += 1
        b.choice = new

    def _beats(self, b: _Bucket, cand: str, inc: str) -> bool:
        """``cand`` beats ``inc``: faster by the margin in the running means,
        and over the two paths' last :data:`WINDOW` samples faster by ``z``
        standard errors of the difference of the means (a two-sample t
        statistic; the variance pooled over all the bucket's paths: a step's
        noise comes mostly from the rest of the step, the same for every path,
        and one path's few samples can look quiet by chance)."""
        c, i = b.stats[cand], b.stats[inc]
        if not c.ewma_us < (1 - self.margin) * i.ewma_us:
            return False
        wins = {p: s.window() for p, s in b.stats.items()}
        dof = sum(k - 1 for k, _, _ in wins.values() if k > 1)
        if dof < 1:
            return False
        var = sum(ss for _, _, ss in wins.values()) / dof
        (kc, mc, _), (ki, mi, _) = wins[cand], wins[inc]
        return mi - mc > self.z * math.sqrt(var * (1 / kc + 1 / ki))

    def summary(self, top: Optional[int] = None) -> dict:
        """``{bucket: {choice, prior, visits, paths: {path: [ewma_us, n, sd_us]}}}`` (logs, ``/server_info``);
        ``top``: only the most visited buckets."""
        items = sorted(self.buckets.items(), key=lambda kb: -kb[1].visits)[:top] if top else self.buckets.items()
        return {str(k): {"choice": b.choice, "prior": b.prior, "visits": b.visits,
                         "paths": {p: [round(s.ewma_us, 2), s.n, _sd(s)] for p, s in b.stats.items()}}
                for k, b in items}


def _sd(s: PathStat) -> float:
    k, _, ss = s.window()
    return round(math.sqrt(ss / (k - 1)), 2) if k > 1 else 0.0


class ReplayTimer:
    """CUDA-event pairs around timed replays, read back without a host sync.

    ``start()`` records the first event of a free pair (``None`` when all
    ``max_pending`` pairs are in flight: that step is not timed);
    ``stop(pair, key, path)`` records the second; ``poll()`` (every step)
    hands each pair whose second event has completed (``query()``) to the
    corrector, oldest first, and frees it. Events complete in stream order, so
    the first pending pair not done ends the poll.

    Args:
        corrector: the :class:`OnlineCorrector` fed.
        event_factory: makes one event (default ``torch.cuda.Event(enable_timing=True)``; tests inject fakes).
    """

    def __init__(self, corrector: OnlineCorrector, event_factory: Optional[Callable[[], object]] = None, max_pending: int = 16):
        if event_factory is None:
            import torch

            def event_factory():
                return torch.cuda.Event(enable_timing=True)

        self.corrector = corrector
        self._make = event_factory
        self._free: List[tuple] = []
        self._made = 0
        self.max_pending = max_pending
        self._pending: Deque[tuple] = collections.deque()

    def start(self):
        if self._free:
            pair = self._free.pop()
        elif self._made < self.max_pending:
            pair = (self._make(), self._make())
            self._made += 1
        else:
            return None
        pair[0].record()
        return pair

    def stop(self, pair, key: Optional[BucketKey] = None, path: Optional[str] = None) -> None:
        """Close a timed step; without ``key`` / ``path`` (the step chose nothing) the pair is freed."""
        if key is None or path is None:
            self._free.append(pair)
            return
        pair[1].record()
        self._pending.append((pair, key, path))

    def poll(self) -> int:
        """Feed completed samples to the corrector; returns how many."""
        done = 0
        while self._pending and self._pending[0][0][1].query():
            pair, key, path = self._pending.popleft()
            self.corrector.record(key, path, pair[0].elapsed_time(pair[1]) * 1e3)
            self._free.append(pair)
            done += 1
        return done

    @property
    def in_flight(self) -> int:
        return len(self._pending)
