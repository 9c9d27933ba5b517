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

Off the scheduler's critical path (issue 22, build 2), on one helper thread
(:meth:`ElasticArena.prepare_async`, ``release_async`` in
:meth:`ElasticArena.reclaim`): the next lend's handles can be created ahead
of time and mapped at the rows they will back (nothing refers to those rows
until the lend puts them on SGLang's free list), so that the lend maps
nothing, and a reclaim's handles are released after their unmap while the
scheduler goes on; :meth:`settle` waits for that work. ``cuMemCreate`` was
8.5 ms and ``cuMemRelease`` 5.6 ms of an 8 GiB cycle on the H200 (64
handles); mapping them took 4.6 ms at p99 of an 8 GiB lend on the H200 and
15.6 ms of six 1.5 GiB steps on an H100 (``docs/elastic.md``).

Idea: the Elastic KV Cache paper (arXiv 2608.23658) and kvcached's
reserve-then-map pool; in-tree starting point SGLang's grow-only
``sglang/srt/mem_cache/kv_vmm_backing.py``.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, List, Optional, Sequence, Tuple

from sglang_elastic.vmm.base import VmmBackend, VmmError, align_up

logger = logging.getLogger(__name__)
# Errors met on the helper thread are logged with their message, not their
# traceback: CPython 3.11 formats a traceback's carets with ast.parse, whose
# recursion counter is not per thread (gh-106905), so a traceback formatted
# there while the main thread parses (pytest's assertion rewriting; any
# import) can raise SystemError in the other thread.


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
        # Steps made ahead of the next lend by prepare()/prepare_async(): (the
        # step's handles, as in _steps; the first token they are mapped at),
        # in token order right above the lent range; lend() takes them in order.
        self._ready: List[tuple] = []
        # Guards _ready, _stale_handles and _helper_errors, which the helper
        # thread writes too; the lent steps (_steps) are the owner's alone.
        self._lock = threading.Lock()
        self._helper: Optional[ThreadPoolExecutor] = None
        self._pending: List[Future] = []
        self._helper_errors: List[BaseException] = []
        # An unmap on the helper thread (reclaim(unmap_async=True)): the bytes
        # it has given back to the driver so far, and whether it still runs;
        # wait_freed() waits on the condition for enough of them.
        self._freed = 0
        self._freeing = False
        self._freeing_total = 0
        self._preparing = 0  # prepare_async jobs not finished
        self._freed_cv = threading.Condition(self._lock)
        self.last_unmap: dict = {}  # that unmap's timings (ms): wait_ms, unmap_ms (unmaps and releases), when it ends
        # The base's mapped segments (tok0, ntok, handles): one at start, one
        # more if grow_base() backs SGLang's post-capture size.
        self._base_segments: List[tuple] = []
        try:
            self._base = self._map_range(self.base_tokens, 0)
            self._base_segments.append((0, self.base_tokens, self._base))
        except BaseException:
            self._retry_stale()
            self.backend.free_va(self.va, self.total_va)
            raise

    def grow_base(self, base_tokens: int) -> int:
        """Back the base up to ``base_tokens`` (rounded up to the token
        quantum), once the final size is known: SGLang's post-capture KV
        sizing starts the pool as a VA reservation with one page backed and
        sizes it after CUDA-graph capture (``finalize_backing``). The rows
        added come off the lendable tail (the VA of every buffer is fixed).
        Returns the base tokens now.

        Raises:
            RuntimeError: while anything is lent or made ahead.
            ValueError: above the reservation.
            VmmError: when backing fails (nothing new is mapped then).
        """
        self._wait_helper()  # an unmap or a prepare still running there works on the current geometry
        if self._steps or self.prepared_steps:
            raise RuntimeError("grow_base while lent: reclaim first")
        new = align_up(base_tokens, self.quantum)
        total = self.base_tokens + self.max_elastic_tokens
        if new > total:
            raise ValueError(f"grow_base({base_tokens}): the reservation holds {total} tokens")
        if new > self.base_tokens:
            handles = self._map_range(new - self.base_tokens, self.base_tokens)
            self._base_segments.append((self.base_tokens, new - self.base_tokens, handles))
            self._base = self._base + handles
            self.base_tokens = new
            self.max_elastic_tokens = total - new
            self.set_steps(self.max_elastic_tokens)
        return self.base_tokens

    def set_steps(self, lendable_tokens: int, step_tokens: Optional[int] = None) -> int:
        """Re-cut what can be lent: at most ``lendable_tokens`` (capped by the
        reserved ``max_elastic_tokens``), in steps of ``step_tokens`` (default:
        one step). The server calls this once it has measured the free memory
        after CUDA-graph capture, before lending anything. Returns the
        lendable tokens (whole steps).

        Raises:
            RuntimeError: while anything is lent or made ahead.
        """
        self._wait_helper()  # an unmap or a prepare still running there works on the current step size
        if self._steps:
            raise RuntimeError("set_steps while lent: reclaim first")
        if self.prepared_steps:
            raise RuntimeError("set_steps with steps made ahead: drop_prepared first")
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

    def _handle_sizes(self, ntok: int) -> List[int]:
        """Bytes of each handle backing ``ntok`` tokens: one handle for every
        buffer with offset mapping, else one per buffer."""
        sizes = [ntok * r for r in self.row_bytes]
        return [sum(sizes)] if self.backend.supports_offset_mapping else sizes

    def _create_handles(self, ntok: int) -> List[Any]:
        """Handles for ``ntok`` tokens of every buffer, all or nothing (the
        ones created before a failure are released, or kept for close())."""
        created: List[Any] = []
        try:
            for sz in self._handle_sizes(ntok):
                created.append(self.backend.create(sz))
        except BaseException:
            self._release_handles(created, "release during rollback")
            raise
        return created

    def _release_handles(self, handles: Sequence[Any], what: str) -> Optional[BaseException]:
        """Release every handle, going on past failures: what fails is kept
        for close() (``_stale_handles``); returns the first error."""
        first: Optional[BaseException] = None
        for h in handles:
            try:
                self.backend.release(h)
            except VmmError as e:
                logger.error("%s failed: %s", what, e)  # no traceback: this may run on the helper thread (the note at the top)
                with self._lock:
                    self._stale_handles.append(h)
                first = first or e
        return first

    def _map_range(self, ntok: int, tok0: int) -> List[Any]:
        """Back tokens ``[tok0, tok0+ntok)`` of every buffer with new handles
        (:meth:`_create_handles`), all or nothing; returns the handles. On
        failure every handle made is released."""
        be = self.backend
        sizes = [ntok * r for r in self.row_bytes]
        mapped: List[int] = []
        created: List[Any] = []
        try:
            created = self._create_handles(ntok)
            if be.supports_offset_mapping:
                h = created[0]
                off = 0
                for i, sz in enumerate(sizes):
                    be.map(self.token_va(i, tok0), sz, h, off)
                    mapped.append(i)
                    off += sz
            else:
                for i, sz in enumerate(sizes):
                    be.map(self.token_va(i, tok0), sz, created[i], 0)
                    mapped.append(i)
        except BaseException:
            for i in mapped:
                try:
                    be.unmap(self.token_va(i, tok0), sizes[i])
                except VmmError:
                    # Still mapped: a later lend would map over it. Kept for
                    # close(), and lending stops (whatever the first error was).
                    logger.error("unmap during rollback failed: %s", sys.exc_info()[1])
                    self._stale.append((self.token_va(i, tok0), sizes[i]))
                    self.lending_disabled = True
            self._release_handles(created, "release during rollback")
            raise
        return created

    def _unmap_range(self, ntok: int, tok0: int, handles: Sequence[Any], release: bool = True) -> None:
        """Unmap tokens ``[tok0, tok0+ntok)`` of every buffer and release the
        handles (unless ``release`` is False: the caller releases them); goes
        on past failures and raises the first at the end."""
        first: Optional[BaseException] = None
        for i, r in enumerate(self.row_bytes):
            try:
                self.backend.unmap(self.token_va(i, tok0), ntok * r)
            except VmmError as e:
                self._stale.append((self.token_va(i, tok0), ntok * r))
                first = first or e
        if release:
            first = self._release_handles(handles, "release after unmap") or first
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
        with self._lock:
            handles, self._stale_handles = self._stale_handles, []
        for h in handles:
            try:
                self.backend.release(h)
            except VmmError:
                logger.exception("release of a handle that failed to release before failed again")
                with self._lock:
                    self._stale_handles.append(h)

    # -- the helper thread ---------------------------------------------------

    def _submit(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the helper thread (one, started on first use), in
        submission order; its exception is kept for :meth:`settle`."""
        if self._helper is None:
            bind = getattr(self.backend, "bind_thread", None)  # the CUDA context must be current there
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="sglang-elastic-vmm", initializer=bind)
        fut = self._helper.submit(fn)
        self._pending.append(fut)
        return fut

    def settle(self) -> List[BaseException]:
        """Wait for the helper thread's work (prepares, releases) submitted so
        far. Returns the errors it met since the last call (a failed release:
        its handle is kept for :meth:`close`, which retries it, and lending is
        disabled; a failed prepare only leaves fewer handles ready: the lend
        creates the rest itself and meets any persisting failure there)."""
        pending, self._pending = self._pending, []
        for fut in pending:
            fut.exception()  # waits; the job records its own errors
        with self._lock:
            errors, self._helper_errors = self._helper_errors, []
        return errors

    @property
    def unsettled(self) -> bool:
        """Whether helper-thread work was submitted since the last :meth:`settle`."""
        return bool(self._pending)

    @property
    def busy(self) -> bool:
        """Whether the helper thread still has work queued or running."""
        return any(not f.done() for f in self._pending)

    # -- handles ahead of the lend -------------------------------------------

    @property
    def prepared_steps(self) -> int:
        """Steps made ahead for the next lend: handles created and mapped
        above the lent range, not yet lent."""
        with self._lock:
            return len(self._ready)

    def prepared_bytes(self) -> int:
        return self.prepared_steps * self.step_bytes()

    def prepare(self, steps: Optional[int] = None) -> int:
        """Create the handles of the next ``steps`` lend steps (default: every
        step not lent) and map them at the rows they will back, right above
        the lent range and the steps made before; :meth:`lend` then maps
        nothing. The rows are not on any free list until the lend, so nothing
        reads or writes them. The steps hold device memory until lent or
        :meth:`drop_prepared` (a reclaim drops them too). Stops at the first
        failure (out of memory: the memory is in use elsewhere) and returns
        the steps prepared by this call; a failure is logged, not raised (the
        lend will create and map the handles itself; a failed rollback unmap
        disables lending, as in :meth:`lend`)."""
        if self.lending_disabled:
            return 0
        with self._lock:
            have = len(self._ready)
        want = self.max_steps - self.lent_steps - have if steps is None else steps
        done = 0
        for _ in range(max(min(want, self.max_steps - self.lent_steps - have), 0)):
            tok0 = self.base_tokens + self.lent_tokens + (have + done) * self.step_tokens
            try:
                handles = self._map_range(self.step_tokens, tok0)
            except VmmError as e:
                logger.log(logging.DEBUG if e.out_of_memory else logging.WARNING, "making a step ahead of the lend failed: %s", e)
                break
            with self._lock:
                self._ready.append((handles, tok0))
            done += 1
        return done

    def prepare_async(self, steps: Optional[int] = None, first: Optional[Callable[[], int]] = None) -> Future:
        """:meth:`prepare` on the helper thread; the future's result is the
        steps prepared. :meth:`lend` waits for it; :attr:`preparing` says it
        has not finished. ``first``: called there before, its result the
        steps to make (0: none) in place of ``steps`` (the controller empties
        torch's cache there and measures what then fits); an exception it
        raises is logged, disables lending and is reported by :meth:`settle`,
        and no step is made."""
        with self._lock:
            self._preparing += 1

        def job():
            try:
                if first is None:
                    want = steps
                else:
                    try:
                        want = first()
                    except Exception as e:  # not lost on the helper: settle() reports it
                        logger.exception("the work before making a step ahead of the lend failed")
                        self._job_failed(e)
                        return 0
                return self.prepare(want) if want is None or want > 0 else 0
            finally:
                with self._lock:
                    self._preparing -= 1

        return self._submit(job)

    @property
    def preparing(self) -> bool:
        """A :meth:`prepare_async` has not finished (its steps may not be in :attr:`prepared_steps` yet)."""
        with self._lock:
            return self._preparing > 0

    def drop_prepared(self, release_async: bool = False) -> int:
        """Unmap and release the steps made ahead of a lend that is not coming
        (an eager forward needs their memory); on the helper thread with
        ``release_async`` (:meth:`settle` waits for it). No device work can
        use their rows (never on a free list), so nothing is waited for.
        Returns the steps dropped. A failed unmap or release: as in
        :meth:`reclaim` (kept for :meth:`close`, lending disabled)."""
        self._wait_helper()
        with self._lock:
            ready, self._ready = self._ready, []
        if ready:
            self._unmap_ready(ready, release_async)
        return len(ready)

    def _unmap_ready(self, ready: List[tuple], release_async: bool) -> None:
        """Unmap the steps made ahead (top first) and release their handles,
        here or on the helper thread."""
        step = self.step_tokens  # as when they were made (set_steps waits for this job)

        def job():
            first: Optional[BaseException] = None
            for handles, tok0 in reversed(ready):
                try:
                    self._unmap_range(step, tok0, handles)
                except VmmError as e:  # _unmap_range kept what failed for close()
                    logger.error("unmapping a step made ahead failed: %s", e)
                    first = first or e
            if first is not None:
                self._job_failed(first)

        self._run_job(job, release_async)

    def _job_failed(self, err: BaseException) -> None:
        """A failure in handle work that may run on the helper thread: the
        memory did not all go back, lending stops, :meth:`settle` reports it."""
        self.lending_disabled = True
        with self._lock:
            self._helper_errors.append(err)

    def _run_job(self, job: Callable[[], None], on_helper: bool) -> None:
        """``job`` on the helper thread (:meth:`settle` waits for it), or here."""
        if on_helper:
            self._submit(job)
        else:
            job()

    def _wait_helper(self) -> None:
        """Wait for the helper's work so that the handles made ahead are final
        and released memory is back (the errors stay for :meth:`settle`)."""
        for fut in list(self._pending):
            fut.exception()

    def _release(self, handles: List[Any], release_async: bool) -> None:
        def job():
            err = self._release_handles(handles, "release on the helper thread" if release_async else "release")
            if err is not None:
                self._job_failed(err)  # as a failed release in reclaim()

        self._run_job(job, release_async)

    # -- lend and reclaim ----------------------------------------------------

    def lend(self, steps: Optional[int] = None) -> int:
        """Back ``steps`` more elastic steps (default: all that remain): the
        steps made ahead (:meth:`prepare`: created and mapped already) first,
        new handles created and mapped here for the rest. Waits for the helper
        thread's work first.

        A step whose mapping fails is rolled back; the steps lent before it
        stay. Out of memory (the memory is in use elsewhere: temporary) just
        ends the call; any other failure disables lending
        (``lending_disabled``): later calls lend nothing, so the owner can
        reclaim what is lent and serve on the base. Returns the steps lent by
        this call.

        Raises:
            VmmError: from the failing call (the arena is consistent).
        """
        self._wait_helper()
        if self.lending_disabled:
            return 0
        want = self.max_steps - self.lent_steps if steps is None else min(steps, self.max_steps - self.lent_steps)
        done = 0
        for _ in range(max(want, 0)):
            tok0 = self.base_tokens + self.lent_tokens
            with self._lock:
                ready = self._ready.pop(0) if self._ready else None
            if ready is not None and ready[1] == tok0:
                self._steps.append(ready[0])  # made ahead: created and mapped already
                done += 1
                continue
            if ready is not None:  # not where this step goes (cannot happen through prepare): dropped, the step made here
                with self._lock:
                    rest, self._ready = [ready] + self._ready, []
                self._unmap_ready(rest, False)
            try:
                self._steps.append(self._map_range(self.step_tokens, tok0))
            except VmmError as e:
                if not e.out_of_memory:
                    self.lending_disabled = True
                raise
            done += 1
        return done

    def reclaim(self, steps: Optional[int] = None, wait: Optional[Callable[[], None]] = None, release_async: bool = False,
                unmap_async: bool = False) -> int:
        """Unmap and release the top ``steps`` lent steps (default: all).

        The caller must have vacated the tokens first. Before anything is
        unmapped the device work that may still read or write the range must
        be complete (``cuMemUnmap`` does not wait for queued kernels):
        ``wait`` waits for exactly that work (the controller's fence after the
        last forward and the vacate's copies); without it the device is
        synchronized. With ``release_async`` the handles are released on the
        helper thread after the unmap (:meth:`settle` waits for it). With
        ``unmap_async`` the steps leave the lent range at once and the rest,
        ``wait`` included, runs on the helper thread: buffer by buffer, each
        range unmapped and its handle released, so the driver gets the memory
        back piece by piece (:meth:`wait_freed` waits for as much as a
        forward needs; :meth:`settle` for all of it; timings in
        :attr:`last_unmap`). The caller must not hand the rows out again
        before then (the vacated rows are off every free list).

        A step whose unmap fails is still dropped from the lent range (its
        tokens were vacated), lending is disabled (the range may still be
        mapped: CUDA cannot map over it again), and the error is raised after
        the remaining steps are reclaimed. A failed release (here or on the
        helper) keeps the handle for :meth:`close` and disables lending.
        Returns the steps reclaimed.
        """
        n = self.lent_steps if steps is None else min(steps, self.lent_steps)
        if n:
            self._wait_helper()  # a prepare or an unmap still running: done first (one geometry change at a time)
        if n and self.prepared_steps:  # made ahead above the lent range: they would sit above a gap
            self.drop_prepared(release_async or unmap_async)
        if n and unmap_async:
            return self._reclaim_async(n, wait)
        if n:
            if wait is not None:
                wait()
            else:
                self.backend.synchronize()
        first: Optional[BaseException] = None
        released: List[Any] = []
        for _ in range(n):
            handles = self._steps.pop()
            try:
                self._unmap_range(self.step_tokens, self.base_tokens + self.lent_tokens, handles, release=False)
            except VmmError as e:
                first = first or e
            released.extend(handles)
        if released:
            if release_async:
                self._release(released, True)
            else:
                first = self._release_handles(released, "release after unmap") or first
        if first is not None:
            self.lending_disabled = True
            raise first
        return n

    def _reclaim_async(self, n: int, wait: Optional[Callable[[], None]]) -> int:
        """:meth:`reclaim` with ``unmap_async``: pop the top ``n`` steps now,
        wait, unmap and release them on the helper thread."""
        step = self.step_tokens
        popped = []
        for _ in range(n):
            tok0 = self.base_tokens + self.lent_tokens - step
            popped.append((self._steps.pop(), tok0))
        with self._freed_cv:
            self._freed, self._freeing, self._freeing_total = 0, True, n * step * sum(self.row_bytes)
        be = self.backend
        offset = be.supports_offset_mapping

        def job():
            t0 = time.perf_counter()
            first: Optional[BaseException] = None
            timings = {}
            # what is still to do, for close() if something unexpected stops the loop: (step, buffer) pairs
            # not yet unmapped, and handles not yet released (one per buffer, or one per step with offsets)
            to_unmap = [(k, i) for k in range(len(popped)) for i in range(len(self.row_bytes))]
            to_release = [(k, i) for k in range(len(popped)) for i in (range(1) if offset else range(len(self.row_bytes)))]

            def freed(nbytes: int) -> None:
                with self._freed_cv:
                    self._freed += nbytes
                    self._freed_cv.notify_all()

            try:
                try:
                    wait() if wait is not None else be.synchronize()
                except BaseException as e:  # the device work on the rows may still run: never unmap under it
                    logger.error("waiting before an unmap on the helper thread failed (%s: %s); synchronizing the device", type(e).__name__, e)
                    first = e
                    be.synchronize()
                t1 = time.perf_counter()
                timings["wait_ms"] = (t1 - t0) * 1e3
                for k, (handles, tok0) in enumerate(popped):  # top step first
                    step_ok = True
                    for i, r in enumerate(self.row_bytes):
                        size = step * r
                        try:
                            be.unmap(self.token_va(i, tok0), size)
                            ok = True
                        except VmmError as e:  # the range is kept for close(), the loop goes on
                            logger.error("unmap on the helper thread failed: %s", e)
                            self._stale.append((self.token_va(i, tok0), size))
                            first, ok, step_ok = first or e, False, False
                        to_unmap.remove((k, i))
                        if not offset:  # this buffer's handle: its memory goes back now (counted only when it did)
                            err = self._release_handles([handles[i]], "release on the helper thread")
                            to_release.remove((k, i))
                            first = first or err
                            if ok and err is None:
                                freed(size)
                    if offset:
                        err = self._release_handles(handles, "release on the helper thread")
                        to_release.remove((k, 0))
                        first = first or err
                        if step_ok and err is None:
                            freed(step * sum(self.row_bytes))
                timings["unmap_ms"] = (time.perf_counter() - t1) * 1e3
            except BaseException as e:  # the device could not be synchronized (nothing unmapped), or a bug: the rest kept for close()
                first = first or e
                self._stale.extend((self.token_va(i, popped[k][1]), step * self.row_bytes[i]) for k, i in to_unmap)
                with self._lock:
                    self._stale_handles.extend(popped[k][0][i] for k, i in to_release)
            finally:
                if first is not None:
                    self._job_failed(first)
                with self._freed_cv:
                    self._freeing = False
                    self.last_unmap = dict(timings, t_end=time.perf_counter())
                    self._freed_cv.notify_all()

        try:
            self._submit(job)
        except BaseException:  # no helper thread (shutting down): done here, nothing left in between
            job()
        return n

    def freeing_bytes(self) -> int:
        """Bytes of the unmap running on the helper thread not yet back at
        the driver (0 with none): memory that is coming free, for a decision
        made while it runs (the controller's ``steps_needed``)."""
        freed, total = self.unmap_progress()
        return max(total - freed, 0)

    def unmap_progress(self) -> Tuple[int, int]:
        """``(freed, total)``: bytes the unmap running on the helper thread
        has given back to the driver so far, and will in all (``(0, 0)``
        with none running)."""
        with self._freed_cv:
            return (self._freed, self._freeing_total) if self._freeing else (0, 0)

    def wait_freed(self, nbytes: int, timeout: Optional[float] = None) -> bool:
        """Wait until the unmap running on the helper thread
        (``reclaim(unmap_async=True)``) has given ``nbytes`` back to the
        driver, or has ended (failed included: :meth:`settle` reports it).
        Returns at once with no such unmap or ``nbytes`` <= 0. ``timeout``:
        seconds at most (0: only look). Returns whether that memory is back
        (or the unmap ended)."""
        with self._freed_cv:
            return self._freed_cv.wait_for(lambda: not self._freeing or self._freed >= nbytes, timeout)

    def close(self) -> None:
        """Wait for the helper thread, reclaim everything, release the handles
        made ahead, unmap the base, retry the unmaps and releases that failed
        before, and free the reservation; idempotent."""
        if self.va is None:
            return
        try:
            self.settle()
            if self._helper is not None:
                self._helper.shutdown(wait=True)
                self._helper = None
            self.reclaim()
        finally:
            self.backend.synchronize()
            with self._lock:
                ready, self._ready = self._ready, []
            if ready:
                self._unmap_ready(ready, False)
            try:
                first: Optional[BaseException] = None
                for tok0, ntok, handles in reversed(self._base_segments):
                    try:
                        self._unmap_range(ntok, tok0, handles)
                    except VmmError as e:
                        first = first or e
                if first is not None:
                    raise first
            finally:
                self._base, self._base_segments = [], []
                self._retry_stale()
                va, self.va = self.va, None
                self.backend.free_va(va, self.total_va)
