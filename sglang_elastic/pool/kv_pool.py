"""SGLang's MHA KV pool and token allocators over an elastic arena.

- :class:`ElasticMHATokenToKVPool` is SGLang's ``MHATokenToKVPool``
  (``sglang/srt/mem_cache/memory_pool.py``) whose per-layer K and V tensors sit
  at the fixed addresses of an :class:`~sglang_elastic.vmm.ElasticArena`,
  sized for every token that can ever be lent. Everything else (``set_kv_buffer``,
  ``get_key_buffer``, the copy kernels, CUDA-graph capture) is SGLang's.
- :class:`ElasticTokenToKVPoolAllocator` (page size 1) and
  :class:`ElasticPagedTokenToKVPoolAllocator` (page size > 1) are SGLang's
  allocators (``allocator/token.py``, ``allocator/paged.py``) that can grow
  their free list when the arena lends (:meth:`lend`) and withdraw it again
  (:meth:`withdraw`), handing back the in-use ids above the new top so the
  caller can migrate or release their owners before the arena unmaps them.

Token ids: ``[0, page_size)`` is SGLang's padding page; ids below
``arena.base_tokens`` are always backed; ``[base, base + lent)`` are lent.
The allocator's ``size`` is the number of usable ids now
(``base + lent - page_size``), so ``available_size()`` and every check built on
``allocator.size`` follow the lent capacity.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import List, Optional

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from sglang_elastic.pool.tensor import tensor_at
from sglang_elastic.vmm import ElasticArena, VmmBackend

#: arenas of pools the garbage collector dropped on a thread where closing could deadlock (see :func:`_close_dropped`)
_DEFERRED: List[ElasticArena] = []


def _close_dropped(arena: ElasticArena, owner: int) -> None:
    """A dropped pool's arena: closed now on the thread that built it, else
    kept for :func:`close_deferred`. ``close`` joins the arena's helper
    thread, and a collection can run inside Python's own thread bookkeeping
    (a new thread's start, holding ``threading._shutdown_locks_lock``): a
    join there never returns (the CPU suite hung in a thread's start so)."""
    held = getattr(threading, "_shutdown_locks_lock", None)
    if threading.get_ident() == owner and not (held is not None and held.locked()):
        arena.close()
    else:
        _DEFERRED.append(arena)


def close_deferred() -> None:
    """Close the arenas :func:`_close_dropped` kept (a new pool's construction and interpreter exit call it)."""
    while _DEFERRED:
        _DEFERRED.pop().close()


atexit.register(close_deferred)

logger = logging.getLogger(__name__)


class ElasticMHATokenToKVPool(MHATokenToKVPool):
    """``MHATokenToKVPool`` on VMM-backed, address-stable per-layer buffers.

    Args:
        backend: the VMM backend (``CudaBackend`` on GPU, ``HostBackend`` in tests).
        base_tokens: rows always backed, padding page included (rounded down
            to the arena's token quantum, a multiple of ``page_size``).
        max_elastic_tokens: most rows that can be lent on top.
        step_tokens: rows per lend/reclaim step (default: one step).
        round_base_up: back ``base_tokens`` rounded up to the arena's quantum
            (the server: the allocator then hands out exactly SGLang's count).
        *args, **kwargs: ``MHATokenToKVPool``'s, without ``size`` (derived).

    Shapes: ``k_buffer[l]`` is ``[base + max_elastic, head_num, head_dim]`` of
    ``store_dtype`` (NHD, SGLang's default layout); only rows below
    ``base + lent`` are backed.

    Raises:
        NotImplementedError: for the HND / vectorized_5d layouts or a quantized
            KV cache (their buffers are not one row per token).
        VmmError: when the arena cannot be reserved or its base backed.
    """

    def __init__(self, *args, backend: VmmBackend, base_tokens: int, max_elastic_tokens: int, step_tokens: Optional[int] = None, round_base_up: bool = False,
                 post_capture: bool = False, **kwargs):
        if "size" in kwargs:
            raise TypeError("ElasticMHATokenToKVPool derives size from base_tokens and max_elastic_tokens")
        self._elastic_spec = (backend, base_tokens, max_elastic_tokens, step_tokens)
        self.arena: Optional[ElasticArena] = None
        page_size = kwargs["page_size"]
        # Rows are fixed before MHATokenToKVPool sizes anything: build the
        # arena first, from the per-row bytes of each K and V buffer.
        dtype = kwargs["dtype"]
        store_bytes = torch.empty((), dtype=torch.uint8 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype).element_size()
        layers = kwargs["layer_num"]
        head_num = kwargs.get("swa_head_num") or kwargs["head_num"]
        head_dim = kwargs.get("swa_head_dim") or kwargs["head_dim"]
        v_head_dim = kwargs.get("swa_v_head_dim") or kwargs.get("v_head_dim") or head_dim
        rows = [head_num * head_dim * store_bytes] * layers + [head_num * v_head_dim * store_bytes] * layers
        close_deferred()  # arenas of pools dropped on another thread: closed here, on a thread that may join
        self.arena = ElasticArena(backend, rows, base_tokens, max_elastic_tokens, step_tokens, page_size=page_size, round_base_up=round_base_up)
        # The tensors do not own the arena's memory: the pool does, for its
        # whole life (SGLang keeps the pool as long as the server runs). A
        # tensor kept past the pool's end points at freed memory.
        weakref.finalize(self, _close_dropped, self.arena, threading.get_ident())
        total_rows = self.arena.base_tokens + self.arena.max_elastic_tokens
        try:
            super().__init__(total_rows - page_size, *args, **kwargs)
        except BaseException:
            self.arena.close()
            raise
        # SGLang's post-capture KV sizing: the scheduler sizes the pool after
        # CUDA-graph capture (Scheduler.__init__ checks this attribute, then
        # compute_post_capture_kv_resize calls finalize_backing and the
        # allocator's resize); what it leaves free is lent on top.
        self.post_capture_active = post_capture

    def _create_buffers_normal(self):
        if self.use_hnd or self.kv_cache_layout == "vectorized_5d":
            raise NotImplementedError("the elastic KV pool supports SGLang's NHD layout only")
        a = self.arena
        rows = self.size + self.page_size
        assert rows == a.base_tokens + a.max_elastic_tokens
        self.k_buffer = [tensor_at(a.buffer_va[i], (rows, self.head_num, self.head_dim), self.store_dtype, self.device) for i in range(self.layer_num)]
        self.v_buffer = [tensor_at(a.buffer_va[self.layer_num + i], (rows, self.head_num, self.v_head_dim), self.store_dtype, self.device) for i in range(self.layer_num)]
        # Stock pools start zeroed (torch.zeros); the base rows do here too.
        for buf in self.k_buffer + self.v_buffer:
            buf[: a.base_tokens].zero_()

    @property
    def post_capture_backed_bytes(self) -> int:
        """Bytes backed now (the base): SGLang's post-capture sizing adds
        them to the free memory it measured (``compute_post_capture_kv_resize``)."""
        return self.arena.base_tokens * sum(self.arena.row_bytes)

    def finalize_backing(self, config) -> None:
        """SGLang's post-capture hook: back the base up to
        ``config.max_total_num_tokens`` plus the padding page (rounded up to
        the arena's quantum), zeroed as SGLang's buffers start. ``size`` stays
        the span of the tensors (every lendable row); the allocator's
        ``resize`` takes SGLang's count.

        Raises:
            VmmError: when backing fails; ValueError: above the reservation.
        """
        a = self.arena
        old = a.base_tokens
        a.grow_base(int(config.max_total_num_tokens) + self.page_size)
        for buf in self.k_buffer + self.v_buffer:
            buf[old : a.base_tokens].zero_()

    def get_kv_size_bytes(self):
        """(K bytes, V bytes) of the always-backed base rows: what SGLang logs
        and reports as ``memory_usage.kvcache`` (the tensors span the whole
        reservation, lendable rows included, most of it unbacked)."""
        a = self.arena
        n = a.base_tokens
        half = len(a.row_bytes) // 2
        return sum(r * n for r in a.row_bytes[:half]), sum(r * n for r in a.row_bytes[half:])

    def _create_quantized_buffers(self):
        raise NotImplementedError("the elastic KV pool does not support a quantized KV cache yet")

    def _clear_buffers(self):
        super()._clear_buffers()
        if self.arena is not None:
            self.arena.close()
            self.arena = None


class _ElasticAllocatorMixin:
    """Lend/withdraw on top of an SGLang allocator whose ids are ``unit``-sized
    (tokens for page size 1, pages otherwise)."""

    def _init_elastic(self, pool: ElasticMHATokenToKVPool, base_tokens: Optional[int]) -> int:
        """Returns the base ids' count, padding page included."""
        self.arena = pool.arena
        self._lent_tokens = 0
        # Ids [page_size, usable_base) are the base; lent ids start at the
        # arena's (quantum-aligned) base, so rows in between stay unused.
        usable = pool.arena.base_tokens if base_tokens is None else base_tokens
        if usable % pool.page_size or not pool.page_size < usable <= pool.arena.base_tokens:
            raise ValueError(f"base_tokens {usable} must be a page multiple in ({pool.page_size}, {pool.arena.base_tokens}]")
        self.usable_base_tokens = usable
        # Between withdraw() and end_vacate(): frees of ids at or above this
        # unit are dropped (they are being unmapped), not put back on a list,
        # and recorded so still_in_use() can tell the vacate what is left.
        self._vacate_top: Optional[int] = None
        self._dropped: list = []
        return usable

    def _check_tokens(self, what: str, lent_tokens: int) -> None:
        if lent_tokens < 0 or lent_tokens % self.page_size:
            raise ValueError(f"{what}({lent_tokens}): lent tokens must be a non-negative multiple of the page size {self.page_size}")

    def _drop_vacated(self, units: torch.Tensor) -> torch.Tensor:
        """Units below the vacate top (all of them outside a vacate)."""
        if self._vacate_top is None or units.numel() == 0:
            return units
        keep = units < self._vacate_top
        self._dropped.append(units[~keep])
        return units[keep]

    def still_in_use(self, units: torch.Tensor) -> torch.Tensor:
        """``units`` (from :meth:`withdraw`) less those freed since (their
        owner finished, was evicted or retracted during the vacate)."""
        if not self._dropped or units.numel() == 0:
            return units
        gone = torch.cat(self._dropped)
        return units[~torch.isin(units, gone)]

    # unit conversion (token ids for page size 1, page ids otherwise)
    def _units(self, tokens: int) -> int:
        return tokens // self.page_size

    @property
    def base_tokens(self) -> int:
        return self.arena.base_tokens

    @property
    def lent_tokens(self) -> int:
        return self._lent_tokens

    def _set_size(self, lent_tokens: int) -> None:
        self.size = self.usable_base_tokens - self.page_size + lent_tokens
        if hasattr(self, "num_pages"):
            self.num_pages = self.size // self.page_size

    def resize(self, config) -> None:
        """SGLang's post-capture resize (``BaseTokenToKVPoolAllocator.resize``):
        the base becomes ``config.max_total_num_tokens`` usable ids (the pool's
        ``finalize_backing`` backed them), every id free; nothing is lent yet.

        Raises:
            ValueError: above what the pool backs, or while lent.
        """
        usable = int(config.max_total_num_tokens) + self.page_size
        if self._lent_tokens or usable % self.page_size or usable > self.arena.base_tokens:
            raise ValueError(f"resize to {config.max_total_num_tokens} tokens: the pool backs {self.arena.base_tokens - self.page_size} base "
                             f"tokens, {self._lent_tokens} lent")
        self.usable_base_tokens = usable
        self._set_size(0)
        self.clear()

    def clear(self):
        """SGLang's ``clear`` (every id free: ``flush_cache``), keeping the lent ids."""
        lent = self._lent_tokens
        self._set_size(0)
        super().clear()
        self._set_size(lent)
        if lent:
            lo, hi = self._units(self.base_tokens), self._units(self.base_tokens + lent)
            self.free_pages = torch.cat((self.free_pages, torch.arange(lo, hi, dtype=torch.int64, device=self.device)))

    def prepare_lend(self, lent_tokens: int) -> torch.Tensor:
        """The free list a :meth:`lend` up to ``lent_tokens`` will install:
        today's free ids, then those of ``[base + lent_now, base + lent_tokens)``
        (int64, on the pool's device). Pass it to ``lend(n, prepared=...)`` for
        any ``n`` from the lent tokens up to ``lent_tokens``, with no free or
        lend in between: that lend then allocates nothing.

        Why: the lend's own free list is a device allocation made after the
        step was mapped. With ``--elastic-kv-margin-mb 0`` the mapped step had
        taken the last free memory and that allocation (20 MiB) raised
        ``torch.OutOfMemoryError`` out of the scheduler's start-up (H100,
        2026-12-06). Made first, a failure leaves the free list as it was, and
        the controller rolls the mapped step back on every TP rank alike.

        Raises:
            ValueError: as :meth:`lend`.
            torch.OutOfMemoryError: no device memory for the new list (nothing changed).
        """
        self._check_lend(lent_tokens)
        lo, hi = self._units(self.base_tokens + self._lent_tokens), self._units(self.base_tokens + lent_tokens)
        prepared = torch.cat((self.free_pages, torch.arange(lo, hi, dtype=torch.int64, device=self.device)))
        # what it was made from: SGLang's alloc and free replace the free-list tensor, so a later change shows
        self._prepared_from = (weakref.ref(self.free_pages), self._lent_tokens, weakref.ref(prepared))
        return prepared

    def _check_lend(self, lent_tokens: int) -> None:
        self._check_tokens("lend", lent_tokens)
        if self._vacate_top is not None:
            raise RuntimeError("lend during a vacate: call end_vacate() after the arena reclaimed")
        if lent_tokens < self._lent_tokens:
            raise ValueError(f"lend({lent_tokens}) below the lent {self._lent_tokens}: use withdraw")
        if self.base_tokens + lent_tokens > self.arena.capacity_tokens:
            raise ValueError(f"lend({lent_tokens}): the arena backs only {self.arena.lent_tokens} lent tokens")

    def lend(self, lent_tokens: int, prepared: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Append the ids of ``[base + lent_now, base + lent_tokens)`` to the
        free list (the arena must back them already). Returns the new ids
        (token ids, or page ids when ``page_size > 1``). ``prepared``: a list
        from :meth:`prepare_lend` for at least ``lent_tokens``, made since the
        last change to the free list; its prefix is installed, nothing allocated.

        Raises:
            ValueError: a negative, page-unaligned or shrinking ``lent_tokens``,
                more than the arena backs, or a ``prepared`` list too short or
                not made by the last :meth:`prepare_lend` since the free list changed.
            RuntimeError: during a vacate.
        """
        if prepared is None:  # (prepare_lend checks lent_tokens)
            prepared = self.prepare_lend(lent_tokens)
        else:
            self._check_lend(lent_tokens)
        lo, hi = self._units(self.base_tokens + self._lent_tokens), self._units(self.base_tokens + lent_tokens)
        n = len(self.free_pages)
        src, lent, made = getattr(self, "_prepared_from", (None, None, None))
        if made is None or made() is not prepared or src() is not self.free_pages or lent != self._lent_tokens:
            raise ValueError(f"lend({lent_tokens}): the prepared free list was not made by this pool's last prepare_lend() "
                             f"since its free list or lent tokens last changed: make it again right before the lend")
        if len(prepared) < n + hi - lo:  # (its ids are not compared: that would wait for the device)
            raise ValueError(f"lend({lent_tokens}): the prepared free list has {len(prepared)} ids, fewer than this pool's "
                             f"{n} free ids and the {hi - lo} new ones: make it with prepare_lend() for that many tokens")
        self.free_pages = prepared[: n + hi - lo]
        self._prepared_from = (None, None, None)
        self._lent_tokens = lent_tokens
        self._set_size(lent_tokens)
        return self.free_pages[len(self.free_pages) - (hi - lo):]

    def withdraw(self, lent_tokens: int) -> torch.Tensor:
        """Shrink the lent range to ``lent_tokens``: drop the free ids at or
        above the new top from the free lists and return the ids there that
        are still in use (sorted), which the caller must vacate (migrate,
        evict, or retract their requests) before the arena unmaps them.

        Until :meth:`end_vacate`, frees of ids at or above the new top (an
        owner retracted or finished instead of migrated) are dropped rather
        than put back on a free list.

        Raises:
            RuntimeError: inside ``free_group_begin/end`` (frees still pending).
            ValueError: for a negative or non-page-multiple ``lent_tokens``.
        """
        self._check_tokens("withdraw", lent_tokens)
        if not getattr(self, "is_not_in_free_group", True):
            raise RuntimeError("withdraw inside a free group: end the group first")
        if lent_tokens > self._lent_tokens:
            raise ValueError(f"withdraw({lent_tokens}) above the lent {self._lent_tokens}: use lend")
        top = self._units(self.base_tokens + lent_tokens)
        old_top = self._units(self.base_tokens + self._lent_tokens)
        freed_above = torch.cat((self.free_pages[self.free_pages >= top], self.release_pages[self.release_pages >= top]))
        self.free_pages = self.free_pages[self.free_pages < top]
        self.release_pages = self.release_pages[self.release_pages < top]
        in_use = torch.ones(old_top - top, dtype=torch.bool, device=self.device)
        in_use[freed_above - top] = False
        self._lent_tokens = lent_tokens
        self._set_size(lent_tokens)
        self._vacate_top = top if self._vacate_top is None else min(self._vacate_top, top)
        return torch.nonzero(in_use).flatten().to(torch.int64) + top

    def restore_lent(self, lent_tokens: int, withdrawn: torch.Tensor) -> None:
        """Undo a :meth:`withdraw` whose vacate could not finish, while the
        arena still backs the range: the lent range grows back to
        ``lent_tokens``, its ids that are not held any more (free at the
        withdraw, or freed during the vacate window) go back on the free list,
        and the vacate window closes.

        Args:
            lent_tokens: the lent tokens before the withdraw.
            withdrawn: what :meth:`withdraw` returned (int64 ids: tokens for
                page size 1, pages otherwise).

        Raises:
            ValueError: for a ``lent_tokens`` below the lent tokens now, above
                what the arena backs, or not a page multiple.
        """
        self._check_tokens("restore_lent", lent_tokens)
        if lent_tokens < self._lent_tokens or self.base_tokens + lent_tokens > self.arena.capacity_tokens:
            raise ValueError(f"restore_lent({lent_tokens}): must lie in [{self._lent_tokens}, {self.arena.lent_tokens}] (what the arena backs)")
        lo, hi = self._units(self.base_tokens + self._lent_tokens), self._units(self.base_tokens + lent_tokens)
        held = self.still_in_use(withdrawn)
        held = held[(held >= lo) & (held < hi)]
        free = torch.ones(hi - lo, dtype=torch.bool, device=self.device)
        free[held - lo] = False
        self.free_pages = torch.cat((self.free_pages, torch.nonzero(free).flatten().to(torch.int64) + lo))
        self._lent_tokens = lent_tokens
        self._set_size(lent_tokens)
        self.end_vacate()

    def end_vacate(self) -> None:
        """Close the vacate window opened by :meth:`withdraw`: call it once the
        arena has reclaimed (no id at or above the top is held any more)."""
        self._vacate_top = None
        self._dropped = []


class ElasticTokenToKVPoolAllocator(_ElasticAllocatorMixin, TokenToKVPoolAllocator):
    """SGLang's page-size-1 allocator over an elastic pool; starts with the base ids only.

    Unlike SGLang's, a free goes to the head of the free list (as the paged
    allocator does), so lent ids appended by :meth:`lend` are handed out
    last and fewer of them need migrating on a reclaim.
    """

    def __init__(self, pool: ElasticMHATokenToKVPool, dtype: torch.dtype, device: str, need_sort: bool = False, base_tokens: Optional[int] = None):
        base = self._init_elastic(pool, base_tokens)
        super().__init__(base - 1, dtype, device, pool, need_sort)

    def free(self, free_index: torch.Tensor):
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(free_index)
            return
        free_index = self._drop_vacated(free_index)
        if self.need_sort:
            self.release_pages = torch.cat((self.release_pages, free_index))
        else:
            self.free_pages = torch.cat((free_index, self.free_pages))


class ElasticPagedTokenToKVPoolAllocator(_ElasticAllocatorMixin, PagedTokenToKVPoolAllocator):
    """SGLang's paged allocator (``page_size > 1``) over an elastic pool; ids are page ids."""

    def __init__(self, pool: ElasticMHATokenToKVPool, dtype: torch.dtype, device: str, need_sort: bool = False, base_tokens: Optional[int] = None):
        base = self._init_elastic(pool, base_tokens)
        super().__init__(base - pool.page_size, pool.page_size, dtype, device, pool, need_sort)

    def _release_page_ids(self, *page_ids: torch.Tensor):
        # Every paged free path (free, free_segment, free_group_end) ends here.
        super()._release_page_ids(*(self._drop_vacated(p) for p in page_ids))


def unit_tokens(units: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token ids of allocator units: the ids themselves for page size 1, every
    slot of each page (``page * page_size + [0, page_size)``) otherwise."""
    if page_size == 1:
        return units
    return (units[:, None] * page_size + torch.arange(page_size, device=units.device)).flatten()


def relocate_kv(pool: ElasticMHATokenToKVPool, allocator: _ElasticAllocatorMixin, src: torch.Tensor) -> Optional[torch.Tensor]:
    """Move the K/V of the in-use ids ``src`` (from :meth:`withdraw`) into
    freshly allocated ids below the lent top, for every layer.

    Args:
        src: int64 ids (token ids, or page ids when ``page_size > 1``).

    Returns:
        the destination ids, ``dst[i]`` taking ``src[i]``'s K/V (the caller
        rewrites ``req_to_token``, radix-tree values and prefix indices from
        ``src`` to ``dst``), or None, changing nothing, when the allocator has
        too few free ids (the caller then evicts or retracts first). If the
        copy raises, the destination ids are freed again before the error
        propagates.

    The copy is SGLang's ``move_kv_cache_native`` (memory_pool.py).
    """
    from sglang.srt.mem_cache.memory_pool import move_kv_cache_native

    n = src.numel()
    if n == 0:
        return src.clone()
    p = pool.page_size
    dst = allocator.alloc(n * p)
    if dst is None:
        return None
    # alloc returns token ids; for pages they come page by page
    try:
        move_kv_cache_native(pool.k_buffer, pool.v_buffer, dst, unit_tokens(src, p))
    except BaseException:
        allocator.free(dst)  # nothing moved: the destination goes back
        raise
    return dst if p == 1 else dst[::p] // p
