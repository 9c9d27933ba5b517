"""Host-memory VMM backend: real ``mmap`` reservations, for CPU tests.

- reserve: ``mmap(NULL, size, PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)``
- create: a ``memfd_create`` file of ``size`` bytes (the physical handle)
- map: ``mmap(va, size, PROT_READ|PROT_WRITE, MAP_SHARED|MAP_FIXED, fd, offset)``
- unmap: ``mmap(va, size, PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE|MAP_FIXED)``
  (replaces the mapping by a fresh reservation, as ``cuMemUnmap`` keeps the VA)
- release: close the memfd (pages go once the last mapping is gone)

An access to an unmapped address faults, as on the GPU. The backend also
enforces CUDA's rules that ``mmap`` alone would let pass: no mapping over a
mapped range, unmap only whole mappings, no freeing a reservation that still
has mappings; and with ``offset_mapping=False`` it refuses nonzero handle
offsets as the H200's driver does (``CUDA_ERROR_NOT_SUPPORTED``). ``fail_on``
injects failures into named calls for fault tests; ``capacity`` gives it a
device size (``create`` runs out of memory beyond it, ``free_bytes`` reports
what is left). Calls may come from several threads (the arena's helper
thread creates and releases handles): the bookkeeping is under one lock, as
the CUDA driver's calls are thread-safe.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
from typing import Callable, Dict, Optional

from sglang_elastic.vmm.base import VmmBackend, VmmError

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FIXED = 0x10
_PROT_NONE = 0


class HostBackend(VmmBackend):
    """VMM on host memory.

    Args:
        granularity: bytes; a multiple of the OS page size (default: the page
            size). Tests use 64 KiB-2 MiB to mimic the GPU's 2 MiB.
        fail_on: call name ("create", "map", "unmap", ...) -> predicate on the
            call count; when it returns True the call raises ``VmmError``
            before doing anything (fault injection); when it returns "oom" the
            error is an out-of-memory one.
        offset_mapping: whether ``map`` accepts a nonzero handle offset.
        capacity: bytes of "device memory" the live handles may hold in all
            (default: no limit; ``free_bytes`` is None then).
    """

    def __init__(self, granularity: Optional[int] = None, fail_on: Optional[Dict[str, Callable[[int], bool]]] = None, offset_mapping: bool = True,
                 capacity: Optional[int] = None):
        page = mmap.PAGESIZE
        self._gran = granularity or page
        if self._gran % page:
            raise ValueError(f"granularity {self._gran} is not a multiple of the page size {page}")
        self.fail_on = dict(fail_on or {})
        self.calls: Dict[str, int] = {}
        self.live_handles = 0
        self.supports_offset_mapping = offset_mapping
        self._maps: Dict[int, int] = {}  # va -> size of each live mapping
        self.capacity = capacity
        self._handle_bytes: Dict[int, int] = {}  # handle -> its size
        self._lock = threading.RLock()
        #: Called with the call's name on entry, before anything else (tests
        #: block a call here on a threading.Event to order it against another thread).
        self.on_call: Optional[Callable[[str], None]] = None

    def _enter(self, name: str) -> None:
        if self.on_call is not None:
            self.on_call(name)
        with self._lock:
            n = self.calls.get(name, 0) + 1
            self.calls[name] = n
        pred = self.fail_on.get(name)
        verdict = pred(n) if pred is not None else False
        if verdict:
            raise VmmError(f"{name} failed: injected fault (call {n})", out_of_memory=verdict == "oom")

    def _check_aligned(self, name: str, *values: int) -> None:
        for v in values:
            if v % self._gran:
                raise VmmError(f"{name} failed: {v} is not a multiple of the granularity {self._gran}")

    def granularity(self) -> int:
        return self._gran

    def reserve(self, size: int) -> int:
        self._enter("reserve")
        self._check_aligned("reserve", size)
        # Over-reserve by one granule so the start can be aligned to it.
        raw = _libc.mmap(None, size + self._gran, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if raw in (None, _MAP_FAILED):
            raise VmmError(f"reserve failed: mmap errno {ctypes.get_errno()}")
        va = (raw + self._gran - 1) // self._gran * self._gran
        if va > raw:
            _libc.munmap(ctypes.c_void_p(raw), va - raw)
        tail = raw + size + self._gran - (va + size)
        if tail:
            _libc.munmap(ctypes.c_void_p(va + size), tail)
        return va

    def _overlaps(self, va: int, size: int):
        return [m for m, sz in self._maps.items() if m < va + size and va < m + sz]

    def free_va(self, va: int, size: int) -> None:
        self._enter("free_va")
        if self._overlaps(va, size):
            raise VmmError("free_va failed: the range still has mappings (cuMemAddressFree would refuse)")
        if _libc.munmap(ctypes.c_void_p(va), size) != 0:
            raise VmmError(f"free_va failed: munmap errno {ctypes.get_errno()}")

    def create(self, size: int) -> int:
        self._enter("create")
        self._check_aligned("create", size)
        with self._lock:
            if self.capacity is not None and sum(self._handle_bytes.values()) + size > self.capacity:
                raise VmmError(f"create failed: out of memory ({size} bytes asked, {self.free_bytes()} free)", out_of_memory=True)
            fd = os.memfd_create("sglang-elastic-kv", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
            except OSError as e:
                os.close(fd)
                raise VmmError(f"create failed: {e}") from e
            self.live_handles += 1
            self._handle_bytes[fd] = size
        return fd

    def map(self, va: int, size: int, handle: int, offset: int = 0) -> None:
        self._enter("map")
        self._check_aligned("map", va, size, offset)
        if offset and not self.supports_offset_mapping:
            raise VmmError("map failed: nonzero handle offset not supported (as CUDA_ERROR_NOT_SUPPORTED)")
        with self._lock:
            if self._overlaps(va, size):
                raise VmmError("map failed: the range is already mapped")
            got = _libc.mmap(ctypes.c_void_p(va), size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, handle, offset)
            if got != va:
                raise VmmError(f"map failed: mmap errno {ctypes.get_errno()}")
            self._maps[va] = size

    def unmap(self, va: int, size: int) -> None:
        self._enter("unmap")
        with self._lock:
            inside = self._overlaps(va, size)
            if not inside or sum(self._maps[m] for m in inside) != size or min(inside) != va:
                raise VmmError("unmap failed: the range is not a set of whole mappings")
            got = _libc.mmap(ctypes.c_void_p(va), size, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1, 0)
            if got != va:
                raise VmmError(f"unmap failed: mmap errno {ctypes.get_errno()}")
            for m in inside:
                del self._maps[m]

    def release(self, handle: int) -> None:
        self._enter("release")
        with self._lock:
            os.close(handle)
            self.live_handles -= 1
            self._handle_bytes.pop(handle, None)

    def free_bytes(self) -> Optional[int]:
        with self._lock:
            return None if self.capacity is None else self.capacity - sum(self._handle_bytes.values())

    def memset(self, va: int, value: int, size: int) -> None:
        ctypes.memset(va, value, size)

    def read(self, va: int, size: int) -> bytes:
        return ctypes.string_at(va, size)

    def write(self, va: int, data: bytes) -> None:
        ctypes.memmove(va, data, len(data))
