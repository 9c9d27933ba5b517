"""The VMM interface: reserve virtual addresses, back them with physical
memory handles, and take the backing away again, without moving the addresses.

Two backends implement it: :class:`~sglang_elastic.vmm.cuda.CudaBackend`
(CUDA driver VMM through ``cuda.bindings.driver``: ``cuMemAddressReserve``,
``cuMemCreate``, ``cuMemMap``, ``cuMemSetAccess``, ``cuMemUnmap``,
``cuMemRelease``) and :class:`~sglang_elastic.vmm.host.HostBackend` (the same
operations on host memory with ``mmap``: a ``PROT_NONE`` reservation, a memfd
as the physical handle, ``MAP_FIXED`` to map it). The pool logic above runs
unchanged on either, which is how it is tested on machines without a GPU.

Design after SGLang's ``sglang/srt/mem_cache/kv_vmm_backing.py`` (one concern,
every driver error turned into an exception naming the call) and kvcached
(VMM primitives apart from the engine integration).
"""

from __future__ import annotations

import abc
from typing import Any, Optional


class VmmError(RuntimeError):
    """A VMM call failed; the message names the call and the driver's error.

    ``out_of_memory`` is True when the driver had no memory to give (a
    temporary condition: the memory is in use elsewhere)."""

    def __init__(self, message: str, out_of_memory: bool = False):
        super().__init__(message)
        self.out_of_memory = out_of_memory


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


class VmmBackend(abc.ABC):
    """Physical-memory handles mapped into reserved virtual ranges.

    All sizes and offsets are bytes and must be multiples of
    :meth:`granularity`. Addresses are plain ``int``. A handle may be mapped at
    several places (each at its own offset into the handle); it is freed by
    :meth:`release` once no mapping uses it (the driver keeps it alive until
    then, as CUDA does).
    """

    #: Whether one handle can be mapped at a nonzero offset (``map(..., offset>0)``).
    supports_offset_mapping: bool = True

    @abc.abstractmethod
    def granularity(self) -> int:
        """Allocation and mapping granularity, bytes."""

    @abc.abstractmethod
    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of virtual address space; returns its start."""

    @abc.abstractmethod
    def free_va(self, va: int, size: int) -> None:
        """Give back a reservation (nothing may be mapped in it)."""

    @abc.abstractmethod
    def create(self, size: int) -> Any:
        """Create a physical allocation of ``size`` bytes; returns its handle."""

    @abc.abstractmethod
    def map(self, va: int, size: int, handle: Any, offset: int = 0) -> None:
        """Map ``[offset, offset+size)`` of ``handle`` at ``va`` and make it read-write."""

    @abc.abstractmethod
    def unmap(self, va: int, size: int) -> None:
        """Remove the mapping of ``[va, va+size)``; the reservation stays."""

    @abc.abstractmethod
    def release(self, handle: Any) -> None:
        """Drop the handle; its memory goes back once no mapping uses it."""

    def synchronize(self) -> None:
        """Wait for all queued device work (before unmapping memory it may use)."""

    def bind_thread(self) -> None:
        """Prepare the calling thread for this backend's calls (CUDA: make the
        context current); run first in the arena's helper thread."""

    def free_bytes(self) -> Optional[int]:
        """Device memory free now, bytes (``cuMemGetInfo``'s free); None when
        the backend cannot tell."""
        return None

    def memset(self, va: int, value: int, size: int) -> None:  # pragma: no cover - backends override
        raise NotImplementedError

    def read(self, va: int, size: int) -> bytes:  # pragma: no cover - backends override
        raise NotImplementedError

    def write(self, va: int, data: bytes) -> None:  # pragma: no cover - backends override
        raise NotImplementedError
