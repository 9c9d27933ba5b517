"""Dense while V fits: a request keeps its V in idle KV-pool slots (``--kv-offload-keep-v``).

The offload pool holds K of every token on the GPU and V of the sparse layers
on the host, so it admits ~1.6x stock's tokens; but on a load that fits in
HBM most of its K slots sit idle, and every sparse decode step costs a chain
of selection kernels (+31 % median ITL against stock at 64 x 4K on the H200,
docs/offload.md). A K slot has exactly a V row's shape (``head_dim ==
v_head_dim``), and the pool lays each sparse layer's hot V rows and K out in
one buffer (:class:`~sglang_elastic.offload.pool.OffloadKVPool`,
``keep_base``), so slot ``j`` lent by SGLang's own allocator holds a V row at
``keep_base + j``. While the allocator has slots to spare:

- a new request takes one extra slot per prompt token at its first prefill
  chunk (and per token of its later chunks, one per decode step) and keeps
  V there as well as on the host (the host copy, the sink and ring rows and
  ``estimate``'s chunk means are written as for every request); one whose
  prefix SGLang's radix cache matched takes slots for the prefix too, and
  its prefill copies the prefix's V there from the staging buffer;
- such a request is dense: its decode step reads every position, K at its
  token ids and V at its kept rows, normalised by its own sum, in a launch
  of the kept requests with the all-dense step's settings, beside the sparse
  requests' own (:meth:`~sglang_elastic.offload.decode.OffloadDecoder.plan`
  with ``keep``); it runs no scores, no top-k, no copy over PCIe;
- when SGLang's allocator would run short (an admission, a prefill chunk, a
  decode step), the largest kept requests are demoted: their slots go back
  to the allocator at once and they continue sparse from their complete host
  V (their first sparse step copies its top-k). A kept request whose next
  slot would leave less than the reserve free (``--kv-offload-keep-reserve``, default :data:`RESERVE_FRAC` of the pool) is demoted too. No
  request is promoted back: that would copy its whole V over PCIe.

With SGLang's radix cache, a grant that finds too few free slots, where the
cache's evictable prefixes would make up the difference, first evicts the
cache's least recently used prefixes (SGLang's own ``evict``, as
for any allocation of a running request), a reserve more than it needs so
that the next steps do not walk the tree again; an allocation SGLang makes
demotes kept requests before SGLang evicts anything (SGLang counts kept
slots as free, below). So the cache keeps what it would keep beside stock's
pool, less what grants took; the pool being ~1.6x stock's, that is at least
stock's cache while the running requests hold under ~0.6x stock's pool.

SGLang sees the kept slots as free (``available_size`` counts them: the
admission, the decode retraction check and ``token_usage`` reason about the
tokens requests hold), and ``alloc`` demotes before it could fail. The slots
of a request's kept positions are read back from the pool's own table
(``req_to_vrow``) when it is demoted or SGLang frees its row: no second list.

Hooks (SGLang's ``HookRegistry``, registered by
:func:`sglang_elastic.offload.hooks.register` when the flag is on):
``ScheduleBatch.prepare_for_extend`` / ``prepare_for_decode`` (AFTER: the
grants, next to SGLang's own ``req_to_token`` writes, on the same stream),
``TokenToKVPoolAllocator.alloc`` (AROUND: demote first when short),
``TokenToKVPoolAllocator.available_size`` (AROUND: plus the kept slots), and
``ReqToTokenPool.free`` (the pool's existing hook: the row's kept slots go
back), and SGLang's decode graph runner (``DecodeCudaGraphRunner.capture``,
BEFORE; ``_resolve_lora_variant``, AROUND): a batch whose every request keeps
V replays a graph variant captured without any selection kernel
(:data:`DENSE_VARIANT`), the others the general one.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from sglang_elastic.config import KEEP_RESERVE

logger = logging.getLogger(__name__)

#: The default share of the pool a grant leaves free (``--kv-offload-keep-reserve``, :data:`sglang_elastic.config.KEEP_RESERVE`):
#: a kept request's next slot is refused (and it is demoted) when fewer than that many slots would remain.
RESERVE_FRAC = KEEP_RESERVE

#: The keys of :meth:`KeepV.stats` (``/server_info`` and the benchmark's keep-v metrics; zeros before the first prefill).
STATS = ("kept_tokens", "kept_requests", "keep_granted_tokens", "keep_demotions")


class KeepV:
    """The CPU side of ``--kv-offload-keep-v`` for one pool and its allocator.

    Args:
        pool: an :class:`~sglang_elastic.offload.pool.OffloadKVPool` built with ``layout.keep_v``
            (``pool.keep_v``).
        allocator: SGLang's ``TokenToKVPoolAllocator`` (page size 1) of that pool.
        reserve_frac: the share of the pool a grant leaves free (:data:`RESERVE_FRAC`; the server's:
            ``--kv-offload-keep-reserve``, :attr:`sglang_elastic.config.OffloadConfig.reserve_share`).

    Raises:
        ValueError: a pool without kept V, or a paged allocator.
    """

    def __init__(self, pool, allocator, reserve_frac: float = RESERVE_FRAC):
        if not getattr(pool, "keep_v", False):
            raise ValueError("KeepV needs an OffloadKVPool built with keep_v (--kv-offload-keep-v, head_dim == v_head_dim)")
        if getattr(allocator, "page_size", 1) != 1:
            raise ValueError(f"--kv-offload-keep-v lends single slots: the allocator's page size is {allocator.page_size}, not 1")
        self.pool, self.allocator = pool, allocator
        self.reserve = int(pool.size * reserve_frac)
        #: slots lent now, and counters since start: positions granted, requests demoted
        self.held = 0
        self.granted = 0
        self.demoted = 0
        #: the decode batch just prepared keeps V for every request (``all_kept_bs`` of them): its step
        #: runs the all-dense plan (no selection; a CUDA-graph variant of its own, :func:`around_resolve_variant`)
        self.all_kept = False
        self.all_kept_bs = 0
        self._inner = False  # our own alloc / free calls: the allocator hooks pass them through
        #: SGLang's tree cache (the scheduler's batch names it): a grant may evict its least recently used
        #: cached prefixes (:meth:`_evict`), never a demotion's room
        self.tree = None
        self._started = set()  # request rows whose request has had a prefill (a later chunk is no first prefill)

    # ------------------------------------------------------------- accounting

    def real_free(self) -> int:
        """Slots SGLang's allocator can hand out now (its own count, without the kept slots)."""
        a = self.allocator
        return len(a.free_pages) + len(a.release_pages)

    def kept(self, row: int) -> int:
        """Leading positions of request row ``row`` whose V is kept (0: sparse)."""
        return self.pool.keep_len_cpu[row]

    # ----------------------------------------------------------------- grants

    def _alloc(self, n: int) -> Optional[torch.Tensor]:
        if self.real_free() - n < self.reserve:
            if self.real_free() + self._evictable() - n < self.reserve:  # eviction could not make the grant: keep the cache
                return None
            self._evict(n + 2 * self.reserve - self.real_free())
            if self.real_free() - n < self.reserve:
                return None
        self._inner = True
        try:
            ids = self.allocator.alloc(n)
        finally:
            self._inner = False
        return ids

    def _evictable(self) -> int:
        """Slots :meth:`_evict` could free now (0 without a radix cache or inside a free group)."""
        from sglang_elastic.offload.hooks import _shares_ids

        if not _shares_ids(self.tree) or not self.allocator.is_not_in_free_group:
            return 0
        return int(self.tree.evictable_size())

    def _evict(self, n: int) -> None:
        """Free up to ``n`` slots that SGLang's radix cache holds for no running request (its least
        recently used leaves, SGLang's own ``evict``), as SGLang evicts for any allocation a running
        request needs. A grant asks for a reserve more than it needs, so that the decode steps after
        it find spare slots without walking the tree each step. Nothing without a radix cache (its
        ``ChunkCache``), or while SGLang's frees are grouped (they would return only at the group's end)."""
        if n <= 0 or not self._evictable():
            return
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.tree.evict(EvictParams(num_tokens=n))

    def on_extend(self, rows, prefix_lens, extend_lens) -> None:
        """A prefill batch was allocated (SGLang's ``prepare_for_extend``): a kept request
        extends its kept positions by the chunk, or is demoted; a request's first prefill
        keeps V of its whole length so far if the slots are spare: its chunk, and a prefix
        SGLang's radix cache matched too, whose V the prefill copies from the staging buffer
        it fills anyway (:meth:`~sglang_elastic.offload.pool.OffloadKVPool.plan_prefix`: no
        PCIe read of its own). A later chunk of a request without kept V (refused or demoted
        at an earlier one) stays sparse: no request is promoted back."""
        for r, p, e in zip(rows, prefix_lens, extend_lens):
            r, p, e = int(r), int(p), int(e)
            have = self.kept(r)
            first = p == 0 or r not in self._started  # the row's request has had no prefill (SGLang's free hook clears it)
            self._started.add(r)
            if have and have != p:  # a stale grant of a row's last request (freed without the hook), or not this prefix
                self.demote(r)
                have = 0
            if e <= 0 or (not have and not first):
                continue
            n = p + e - have
            ids = self._alloc(n)
            if ids is None:
                if have:
                    self.demote(r)
                continue
            self.pool.set_keep(r, have, ids)
            self.held += n
            self.granted += n

    def on_decode(self, rows, seq_lens) -> None:
        """A decode batch was allocated (SGLang's ``prepare_for_decode``; ``seq_lens`` with the
        new token): every kept request whose kept positions reach its new token's position gets
        one slot (one allocation for the batch); a request the reserve refuses is demoted."""
        self.all_kept = False
        rows, seq_lens = list(rows), list(seq_lens)
        want = [(int(r), int(n) - 1) for r, n in zip(rows, seq_lens) if self.kept(int(r)) == int(n) - 1 and int(n) > 1]
        stale = [int(r) for r, n in zip(rows, seq_lens) if 0 < self.kept(int(r)) != int(n) - 1 and self.kept(int(r)) < int(n)]
        for r in stale:
            self.demote(r)
        if not want:
            return
        ids = self._alloc(len(want))
        if ids is None:  # too few spare slots for all: the largest requests go sparse until the rest fit
            want.sort(key=lambda x: x[1])
            while want and self.real_free() - len(want) < self.reserve:
                self.demote(want.pop()[0])  # the largest first: its slots go back, the rest may fit now
            if not want:
                return
            ids = self._alloc(len(want))
            if ids is None:
                for r, _ in want:
                    self.demote(r)
                return
        pool = self.pool
        dev = pool.req_to_vrow.device
        r_t = torch.tensor([r for r, _ in want], dtype=torch.int64).to(dev, non_blocking=True)
        p_t = torch.tensor([p for _, p in want], dtype=torch.int64).to(dev, non_blocking=True)
        pool.req_to_vrow[r_t, p_t] = (ids.to(dev) + pool.keep_base).to(torch.int32)
        pool.keep_len[r_t] = (p_t + 1).to(torch.int32)
        for r, p in want:
            pool.keep_len_cpu[r] = p + 1
        self.held += len(want)
        self.granted += len(want)
        self.all_kept = len(want) == len(rows)
        self.all_kept_bs = len(rows)

    # -------------------------------------------------------------- demotions

    def demote(self, row: int, finished: bool = False) -> int:
        """Request row ``row`` gives its kept slots back and attends sparsely from its next step;
        returns the slots freed. ``finished``: SGLang freed the row (``ReqToTokenPool.free``: the
        request finished or was retracted), which is not counted as a demotion; the row's next
        request starts afresh."""
        if finished:
            self._started.discard(row)
        n = self.kept(row)
        if not n:
            return 0
        pool = self.pool
        ids = pool.req_to_vrow[row, :n].to(torch.int64) - pool.keep_base
        pool.set_keep(row, 0, None)
        self._give_back(ids)
        self.held -= n
        if not finished:
            self.demoted += 1
        return n

    def _give_back(self, ids: torch.Tensor) -> None:
        """Slots back to the allocator's free list now, also inside one of SGLang's free groups
        (whose frees wait for ``free_group_end``: a demotion must make room at once)."""
        a = self.allocator
        ids = ids.to(a.free_pages.device)
        if a.need_sort:
            a.release_pages = torch.cat((a.release_pages, ids))
        else:
            a.free_pages = torch.cat((a.free_pages, ids))

    def make_room(self, need: int) -> None:
        """Demote the largest kept requests until the allocator has ``need`` free slots (or none is kept)."""
        if self.real_free() >= need or not self.held:
            return
        rows = sorted((r for r, n in enumerate(self.pool.keep_len_cpu) if n), key=lambda r: -self.pool.keep_len_cpu[r])
        for r in rows:
            self.demote(r)
            if self.real_free() >= need:
                break

    def stats(self) -> dict:
        """``kept_tokens`` (slots lent now), ``kept_requests``, ``keep_granted_tokens`` and ``keep_demotions`` since start."""
        return dict(zip(STATS, (self.held, sum(1 for n in self.pool.keep_len_cpu if n), self.granted, self.demoted)))


# ----------------------------------------------------------------------- hooks

_SCHED_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
_ALLOCATOR = "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator"
#: this process's manager (one target worker per scheduler process), made at the first prefill
_STATE: dict = {}


_GRAPH_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
#: SGLang 0.5.17's decode graph runner captures two variants per batch size when ``record_nolora_graph``
#: is set (for LoRA: labels "lora" and "nolora", picked per replay by ``_resolve_lora_variant``). Without
#: LoRA, --kv-offload-keep-v borrows the mechanism: the general step (mixed dense / sparse) under the
#: first label, the all-dense step (no selection kernels at all) under the second.
GENERAL_VARIANT, DENSE_VARIANT = "lora", "nolora"


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{_SCHED_BATCH}.prepare_for_extend", after_prepare_for_extend, HookType.AFTER)
    HookRegistry.register(f"{_SCHED_BATCH}.prepare_for_decode", after_prepare_for_decode, HookType.AFTER)
    HookRegistry.register(f"{_ALLOCATOR}.alloc", around_alloc, HookType.AROUND)
    HookRegistry.register(f"{_ALLOCATOR}.available_size", around_available_size, HookType.AROUND)
    HookRegistry.register(f"{_GRAPH_RUNNER}.capture", before_capture, HookType.BEFORE)
    HookRegistry.register(f"{_GRAPH_RUNNER}.capture", after_capture, HookType.AFTER)
    HookRegistry.register(f"{_GRAPH_RUNNER}._resolve_lora_variant", around_resolve_variant, HookType.AROUND)


def _offload_backend(runner):
    from sglang_elastic.offload.backend import OffloadAttnBackend

    ab = getattr(getattr(runner, "model_runner", None), "attn_backend", None)
    return ab if isinstance(ab, OffloadAttnBackend) and ab.pool.keep_v else None


def before_capture(runner, *args, **kwargs):
    """BEFORE ``DecodeCudaGraphRunner.capture``: capture the all-dense variant beside the general one
    (not when LoRA already uses the two variants: then every step runs the general plan)."""
    be = _offload_backend(runner)
    mr = getattr(runner, "model_runner", None)
    lora = (getattr(runner, "record_nolora_graph", False) or getattr(getattr(mr, "server_args", None), "enable_lora", False)
            or getattr(mr, "lora_manager", None) is not None)
    if be is not None and not lora and not getattr(runner, "_sglang_elastic_keep", False):
        runner.record_nolora_graph = True
        runner._sglang_elastic_keep = True
        be.graph_variants = True
    return None


def after_capture(result, runner, *args, **kwargs):
    """AFTER ``DecodeCudaGraphRunner.capture``: SGLang leaves the last variant label set; clear it, so
    that no later capture records the all-dense plan by mistake."""
    if getattr(runner, "_sglang_elastic_keep", False):
        from sglang.srt.model_executor.runner_utils.capture_mode import _set_capture_lora_variant

        _set_capture_lora_variant(None)
    return result


def capturing_dense_variant() -> bool:
    """The graph being captured now is the all-dense variant."""
    from sglang.srt.model_executor.runner_utils.capture_mode import get_capture_lora_variant

    return get_capture_lora_variant() == DENSE_VARIANT


def dense_step(batch_size: int) -> bool:
    """The decode batch of ``batch_size`` requests (unpadded) is the one the scheduler just granted kept
    slots for every request of (:attr:`KeepV.all_kept`): its step is the all-dense one."""
    m = current()
    return bool(m is not None and m.all_kept and m.all_kept_bs == batch_size)


def around_resolve_variant(orig, runner, forward_batch, *args, **kwargs):
    """AROUND ``DecodeCudaGraphRunner._resolve_lora_variant``: the all-dense graph for a batch whose
    every request the scheduler just granted a kept slot (:attr:`KeepV.all_kept`), else the general one."""
    if not getattr(runner, "_sglang_elastic_keep", False):
        return orig(runner, forward_batch, *args, **kwargs)
    return DENSE_VARIANT if dense_step(forward_batch.batch_size) else GENERAL_VARIANT


def manager_for(allocator) -> Optional[KeepV]:
    """The :class:`KeepV` of ``allocator`` (made on first use when it allocates for a pool with kept V), else None."""
    m = _STATE.get("keep")
    if m is not None:
        return m if m.allocator is allocator else None
    from sglang_elastic.offload.hooks import _offload_pool

    pool = _offload_pool(allocator)
    if pool is None or not pool.keep_v:
        return None
    from sglang_elastic import config

    m = _STATE["keep"] = KeepV(pool, allocator, reserve_frac=config.current().offload.reserve_share)
    return m


def current() -> Optional[KeepV]:
    return _STATE.get("keep")


def after_prepare_for_extend(result, batch, *args, **kwargs):
    m = manager_for(batch.token_to_kv_pool_allocator)
    if m is not None and batch.reqs:
        m.tree = getattr(batch, "tree_cache", None)
        m.on_extend([req.req_pool_idx for req in batch.reqs], batch.prefix_lens, batch.extend_lens)
    return result


def after_prepare_for_decode(result, batch, *args, **kwargs):
    m = manager_for(batch.token_to_kv_pool_allocator)
    if m is not None and batch.reqs and batch.seq_lens_cpu is not None:
        m.tree = getattr(batch, "tree_cache", None)
        m.on_decode([req.req_pool_idx for req in batch.reqs], batch.seq_lens_cpu.tolist())
    return result


def around_alloc(orig, allocator, need_size, *args, **kwargs):
    m = manager_for(allocator)
    if m is not None and not m._inner:
        m.make_room(int(need_size))
    return orig(allocator, need_size, *args, **kwargs)


def around_available_size(orig, allocator, *args, **kwargs):
    n = orig(allocator, *args, **kwargs)
    m = _STATE.get("keep")
    return n + m.held if m is not None and m.allocator is allocator and not m._inner else n


def release_row(row: int) -> None:
    """SGLang freed request row ``row`` (``ReqToTokenPool.free``): its kept slots go back."""
    m = _STATE.get("keep")
    if m is not None:
        m.demote(row, finished=True)


__all__ = ["DENSE_VARIANT", "GENERAL_VARIANT", "KeepV", "RESERVE_FRAC", "capturing_dense_variant", "current", "dense_step", "manager_for", "register",
           "release_row"]
