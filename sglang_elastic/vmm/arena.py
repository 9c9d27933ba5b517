"""Fixed virtual ranges for per-layer KV buffers, with a base part always
backed and an elastic part lent and reclaimed in steps.

Every per-layer K and V buffer ``i`` (``row_bytes[i]`` bytes per token, e.g.
``kv_heads * head_dim * dtype_bytes`` for SGLang's NHD layout
``[tokens, kv_heads, head_dim]``) gets one virtual range sized for
``base_tokens + max_elastic_tokens`` tokens, inside a single reservation. The
ranges never move, so CUDA graphs that captured them stay valid. Tokens
``[0, base_tokens)`` (including SGLang's padding slot 0) are backed at start and
never unmapped. The elastic tokens above are backed in *steps*: one physical
handle per step, mapped at offsets into every buffer (few, large handles: one
``cuMemCreate`` per step instead of one per buffer), unmapped and released as a
whole on reclaim, last step first (LIFO), so the lent tokens are always the
contiguous range ``[base_tokens, base_tokens + lent_tokens)``.

Idea: the Elastic KV Cache paper (arXiv 2608.23658) and kvcached's
reserve-then-map pool; in-tree starting point SGLang's grow-only
``sglang/srt/mem_cache/kv_vmm_backing.py``.
"""

from __future__ import annotations

import logging
import math
from typing import Any, List, Optional, Sequence

from sglang_elastic.vmm.base import VmmBackend, VmmError, align_up

logger = logging.getLogger(__name__)


def token_quantum(row_bytes: Sequence[int], granularity: int, page_size: int = 1) -> int:
    """Smallest token count whose bytes are a whole number of granules in every
    buffer and that is a whole number of pages: lend steps and the base
    boundary are multiples of it."""
    q = page_size
    for r in row_bytes:
        q = math.lcm(q, granularity // math.gcd(granularity, r))
    return q


class ElasticArena:
    """VA-stable per-layer buffers with a lendable tail.

    Args:
        backend: a :class:`VmmBackend` (CUDA or host).
        row_bytes: bytes per token of each buffer (2 x layers entries for MHA).
        base_tokens: tokens always backed, rounded down to the token quantum
            (up with ``round_base_up``: the server's pool keeps SGLang's exact
            token count and backs up to one quantum more).
        max_elastic_tokens: the most tokens that can be lent, rounded down to
            whole steps.
        step_tokens: tokens per lend/reclaim step (default: all of them, one
            step). Rounded up to the token quantum.
        page_size: KV page size in tokens (steps hold whole pages).

    Raises:
        VmmError: when reserving or backing the base fails (nothing is left
            reserved or mapped then).
        ValueError: on sizes that leave no base or no buffers.
    """

    def __init__(self, backend: VmmBackend, row_bytes: Sequence[int], base_tokens: int, max_elastic_tokens: int, step_tokens: Optional[int] = None, page_size: int = 1, round_base_up: bool = False):
        if not row_bytes or min(row_bytes) <= 0:
            raise ValueError("row_bytes must list at least one positive size")
        self.backend = backend
        self.row_bytes = [int(r) for r in row_bytes]
        g = backend.granularity()
        self.quantum = token_quantum(self.row_bytes, g, page_size)
        self.base_tokens = align_up(base_tokens, self.quantum) if round_base_up else base_tokens // self.quantum * self.quantum
        if self.base_tokens <= 0:
            raise ValueError(f"base_tokens {base_tokens} is below one token quantum ({self.quantum})")
        whole = max_elastic_tokens // self.quantum * self.quantum
        step = align_up(step_tokens or max(whole, self.quantum), self.quantum)
        self.step_tokens = step
        self.max_steps = max_elastic_tokens // step
        self.max_elastic_tokens = self.max_steps * step
        self.spans = [align_up((self.base_tokens + self.max_elastic_tokens) * r, g) for r in self.row_bytes]
        self.total_va = sum(self.spans)
        self.va = backend.reserve(self.total_va)
        self.buffer_va: List[int] = []
        off = 0
        for s in self.spans:
            self.buffer_va.append(self.va + off)
            off += s
        # Each lent step is the list of handles backing it: one mapped at
        # offsets into every buffer, or one per buffer without offset mapping.
        self._steps: List[List[Any]] = []
        # Left over by failed driver calls, retried by close(): ranges whose
        # unmap failed (still mapped: nothing may be mapped over them, the
        # reservation cannot be freed with them) and handles whose release failed.
        self._stale: List[tuple] = []  # (va, size)
        self._stale_handles: List[Any] = []
        self.lending_disabled = False
        try:
            self._base = self._map_range(self.base_tokens, 0)
        except BaseException:
            self._retry_stale()
            self.backend.free_va(self.va, self.total_va)
            raise

    def set_steps(self, lendable_tokens: int, step_tokens: Optional[int] = None) -> int:
        """Re-cut what can be lent: at most ``lendable_tokens`` (capped by the
        reserved ``max_elastic_tokens``), in steps of ``step_tokens`` (default:
        one step). The server calls this once it has measured the free memory
        after CUDA-graph capture, before lending anything. Returns the
        lendable tokens (whole steps).

        Raises:
            RuntimeError: while anything is lent.
        """
        if self._steps:
            raise RuntimeError("set_steps while lent: reclaim first")
        whole = max(min(lendable_tokens, self.max_elastic_tokens), 0) // self.quantum * self.quantum
        step = min(align_up(step_tokens or max(whole, self.quantum), self.quantum), max(whole, self.quantum))
        self.step_tokens = step
        self.max_steps = whole // step
        return self.max_steps * step

    @property
    def lendable_tokens(self) -> int:
        return self.max_steps * self.step_tokens

    # -- geometry ---------------------------------------------------------

    @property
    def lent_steps(self) -> int:
        return len(self._steps)

    @property
    def lent_tokens(self) -> int:
        return len(self._steps) * self.step_tokens

    @property
    def capacity_tokens(self) -> int:
        """Tokens backed now: base plus lent."""
        return self.base_tokens + self.lent_tokens

    def step_bytes(self) -> int:
        return sum(self.step_tokens * r for r in self.row_bytes)

    @property
    def lent_bytes(self) -> int:
        return self.lent_steps * self.step_bytes()

    def token_va(self, buffer: int, token: int) -> int:
        return self.buffer_va[buffer] + token * self.row_bytes[buffer]

    # -- mapping ----------------------------------------------------------

    def _map_range(self, ntok: int, tok0: int) -> List[Any]:
        """Back tokens ``[tok0, tok0+ntok)`` of every buffer, all or nothing;
        returns the handles created for it."""
        be = self.backend
        sizes = [ntok * r for r in self.row_bytes]
        mapped: List[int] = []
        created: List[Any] = []
        try:
            if be.supports_offset_mapping:
                h = be.create(sum(sizes))
                created.append(h)
                off = 0
                for i, sz in enumerate(sizes):
                    be.map(self.token_va(i, tok0), sz, h, off)
                    mapped.append(i)
                    off += sz
            else:
                for i, sz in enumerate(sizes):
                    h = be.create(sz)
                    created.append(h)
                    be.map(self.token_va(i, tok0), sz, h, 0)
                    mapped.append(i)
        except BaseException:
            for i in mapped:
                try:
                    be.unmap(self.token_va(i, tok0), sizes[i])
                except VmmError:
                    # Still mapped: a later lend would map over it. Kept for
                    # close(), and lending stops (whatever the first error was).
                    logger.exception("unmap during rollback failed")
                    self._stale.append((self.token_va(i, tok0), sizes[i]))
                    self.lending_disabled = True
            for h in created:
                try:
                    be.release(h)
                except VmmError:
                    logger.exception("release during rollback failed")
                    self._stale_handles.append(h)
            raise
        return created

    def _unmap_range(self, ntok: int, tok0: int, handles: Sequence[Any]) -> None:
        """Unmap tokens ``[tok0, tok0+ntok)`` of every buffer and release the
        handles; goes on past failures and raises the first at the end."""
        first: Optional[BaseException] = None
        for i, r in enumerate(self.row_bytes):
            try:
                self.backend.unmap(self.token_va(i, tok0), ntok * r)
            except VmmError as e:
                self._stale.append((self.token_va(i, tok0), ntok * r))
                first = first or e
        for h in handles:
            try:
                self.backend.release(h)
            except VmmError as e:
                self._stale_handles.append(h)
                first = first or e
        if first is not None:
            raise first

    def _retry_stale(self) -> None:
        """Unmap the ranges and release the handles whose first attempt failed;
        what fails again is logged and kept."""
        stale, self._stale = self._stale, []
        for rng in stale:
            try:
                self.backend.unmap(*rng)
            except VmmError:
                logger.exception("unmap of a range that failed to unmap before failed again")
                self._stale.append(rng)
        handles, self._stale_handles = self._stale_handles, []
        for h in handles:
            try:
                self.backend.release(h)
            except VmmError:
                logger.exception("release of a handle that failed to release before failed again")
                self._stale_handles.append(h)

    def lend(self, steps: Optional[int] = None) -> int:
        """Back ``steps`` more elastic steps (default: all that remain).

        A step whose mapping fails is rolled back; the steps lent before it
        stay. Out of memory (the memory is in use elsewhere: temporary) just
        ends the call; any other failure disables lending
        (``lending_disabled``): later calls lend nothing, so the owner can
        reclaim what is lent and serve on the base. Returns the steps lent by
        this call.

        Raises:
            VmmError: from the failing call (the arena is consistent).
        """
        if self.lending_disabled:
            return 0
        want = self.max_steps - self.lent_steps if steps is None else min(steps, self.max_steps - self.lent_steps)
        done = 0
        for _ in range(max(want, 0)):
            try:
                self._steps.append(self._map_range(self.step_tokens, self.base_tokens + self.lent_tokens))
            except VmmError as e:
                if not e.out_of_memory:
                    self.lending_disabled = True
                raise
            done += 1
        return done

    def reclaim(self, steps: Optional[int] = None) -> int:
        """Unmap and release the top ``steps`` lent steps (default: all).

        The caller must have vacated the tokens first. The device is
        synchronized before anything is unmapped (``cuMemUnmap`` does not wait
        for queued kernels that still read or write the range). A step whose unmap
        fails is still dropped from the lent range (its tokens were vacated),
        lending is disabled (the range may still be mapped: CUDA cannot map
        over it again), and the error is raised after the remaining steps are
        reclaimed. Returns the steps reclaimed.
        """
        n = self.lent_steps if steps is None else min(steps, self.lent_steps)
        if n:
            self.backend.synchronize()
        first: Optional[BaseException] = None
        for _ in range(n):
            handles = self._steps.pop()
            try:
                self._unmap_range(self.step_tokens, self.base_tokens + self.lent_tokens, handles)
            except VmmError as e:
                first = first or e
        if first is not None:
            self.lending_disabled = True
            raise first
        return n

    def close(self) -> None:
        """Reclaim everything, unmap the base, retry the unmaps and releases
        that failed before, and free the reservation; idempotent."""
        if self.va is None:
            return
        try:
            self.reclaim()
        finally:
            self.backend.synchronize()
            try:
                self._unmap_range(self.base_tokens, 0, self._base)
            finally:
                self._base = []
                self._retry_stale()
                va, self.va = self.va, None
                self.backend.free_va(va, self.total_va)
