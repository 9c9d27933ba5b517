"""CUDA driver VMM backend (``cuda.bindings.driver``, cuda-python).

Same calls as SGLang's ``kv_vmm_backing.py`` (``cuMemCreate`` with pinned
device memory, ``cuMemMap``, ``cuMemSetAccess``), plus ``cuMemUnmap`` and
``cuMemRelease`` so memory can be given back while the addresses stay
reserved (CUDA graphs captured the addresses; they must never move).

Few, large handles: the project brief reports that on the H200 mapping 8 GiB
took 1.6 ms as one handle and 194 ms as 2 MiB handles (not re-measured here;
``scripts/gpu/bench_vmm.py`` measures this code's own calls). Mapping one handle at nonzero offsets into several
buffers would need ``cuMemMap``'s ``offset`` argument, which the driver
documents as "currently must be zero": ``supports_offset_mapping`` is probed
once, and on the H200 here (driver 580.159.04, CUDA 13.0) the probe is refused
(``offset_mapping_error`` keeps why), so the arena creates one handle per
buffer per lend step (64 for Llama-3.1-8B) instead.
"""

from __future__ import annotations

from typing import Any

from sglang_elastic.vmm.base import VmmBackend, VmmError


def _driver():
    from cuda.bindings import driver

    return driver


class CudaBackend(VmmBackend):
    """VMM on one CUDA device.

    Args:
        device: CUDA ordinal. The device's primary context is made current if
            no context is (torch's, when torch initialised CUDA first).

    Raises:
        VmmError: when the driver cannot be loaded or initialised.
    """

    offset_mapping_error: str = ""

    def __init__(self, device: int = 0):
        try:
            self._d = _driver()
        except Exception as e:  # no cuda-python, or no driver library
            raise VmmError(f"cuda.bindings.driver unavailable: {e}") from e
        d = self._d
        self.device = int(device)
        self._check(d.cuInit(0), "cuInit")
        ctx = self._check(d.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if ctx is None or int(ctx) == 0:
            dev = self._check(d.cuDeviceGet(self.device), "cuDeviceGet")
            ctx = self._check(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            self._check(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self._ctx = ctx
        self._prop = d.CUmemAllocationProp()
        self._prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = self.device
        self._access = d.CUmemAccessDesc()
        self._access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = self.device
        self._access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._gran = int(self._check(d.cuMemGetAllocationGranularity(self._prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity"))
        self.supports_offset_mapping = self._probe_offset_mapping()

    def _check(self, result, label: str):
        err = result[0] if isinstance(result, tuple) else result
        if err != self._d.CUresult.CUDA_SUCCESS:
            raise VmmError(f"{label} failed: {err}", out_of_memory=err == self._d.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        return result[1] if isinstance(result, tuple) and len(result) > 1 else None

    def _probe_offset_mapping(self) -> bool:
        g = self._gran
        va = self.reserve(g)
        h = self.create(2 * g)
        try:
            self.map(va, g, h, offset=g)
            self.unmap(va, g)
            return True
        except VmmError as e:
            self.offset_mapping_error = str(e)
            return False
        finally:
            self.release(h)
            self.free_va(va, g)

    def bind_thread(self) -> None:
        """Make this backend's context current in the calling thread (the
        arena's helper thread creates and releases handles; driver calls
        need a current context in every thread)."""
        self._check(self._d.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def granularity(self) -> int:
        return self._gran

    def reserve(self, size: int) -> int:
        return int(self._check(self._d.cuMemAddressReserve(size, self._gran, 0, 0), "cuMemAddressReserve"))

    def free_va(self, va: int, size: int) -> None:
        self._check(self._d.cuMemAddressFree(va, size), "cuMemAddressFree")

    def create(self, size: int) -> Any:
        return self._check(self._d.cuMemCreate(size, self._prop, 0), "cuMemCreate")

    def map(self, va: int, size: int, handle: Any, offset: int = 0) -> None:
        self._check(self._d.cuMemMap(va, size, offset, handle, 0), "cuMemMap")
        try:
            self._check(self._d.cuMemSetAccess(va, size, [self._access], 1), "cuMemSetAccess")
        except VmmError:
            self._d.cuMemUnmap(va, size)
            raise

    def unmap(self, va: int, size: int) -> None:
        self._check(self._d.cuMemUnmap(va, size), "cuMemUnmap")

    def release(self, handle: Any) -> None:
        self._check(self._d.cuMemRelease(handle), "cuMemRelease")

    def memset(self, va: int, value: int, size: int) -> None:
        self._check(self._d.cuMemsetD8(va, value, size), "cuMemsetD8")
        self._check(self._d.cuCtxSynchronize(), "cuCtxSynchronize")

    def read(self, va: int, size: int) -> bytes:
        buf = bytearray(size)
        self._check(self._d.cuMemcpyDtoH(buf, va, size), "cuMemcpyDtoH")
        return bytes(buf)

    def write(self, va: int, data: bytes) -> None:
        self._check(self._d.cuMemcpyHtoD(va, data, len(data)), "cuMemcpyHtoD")

    def synchronize(self) -> None:
        self._check(self._d.cuCtxSynchronize(), "cuCtxSynchronize")

    def free_bytes(self) -> int:
        err, free, _total = self._d.cuMemGetInfo()
        self._check(err, "cuMemGetInfo")
        return int(free)
