"""The pinned host pool that holds V of every token of the sparse layers.

:class:`HostVPool` is SGLang's ``HostKVCache`` (``sglang/srt/mem_cache/
pool_host/base.py``) for V only, ``layer_first``: ``v_buffer[l]`` is
``[rows, kv_heads, v_head_dim]``, one contiguous V row per token and layer
(2 KiB on Llama-3.1-8B at TP 1), so a hot-buffer miss is one row copy.
Its rows mirror the device pool's token ids one to one (row ``i`` holds V of
the token in K-pool slot ``i``): the device allocator's free list is the only
free list, a token id is written once (by the request that computed it; with
SGLang's radix cache, requests that match a cached prefix then read its rows
as their own), and the host pool can never overflow while the K pool does not. Allocation, ``cudaHostRegister``
pinning and the check against free host RAM (leaving
``HICACHE_HOST_MEMORY_RESERVE_BYTES`` free) are SGLang's.

:func:`device_view` gives kernels a CUDA tensor over the pinned memory (UVA),
so copies from or to it are GPU-initiated (``copy_rows_run``), as SGLang's
``transfer_hicache_one_layer`` reads host pools.
"""

from __future__ import annotations

import logging
import os
from typing import List, Sequence

import torch
from sglang.srt.mem_cache.pool_host.base import HostKVCache
from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS

logger = logging.getLogger(__name__)


class _CudaArray:
    """A ``__cuda_array_interface__`` over a device pointer (to wrap as a tensor)."""

    def __init__(self, ptr: int, shape, typestr: str, strides):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": tuple(shape), "typestr": typestr,
                                         "strides": tuple(strides), "version": 3}


#: ``=1``: the host pool is allocated, then its pinning fails as a driver refusal would (issue 24's "no loss" on a GPU:
#: ``scripts/gpu/check_pin_fault.py`` starts a server so and checks it stops with the one line, freeing the GPU).
PIN_FAULT_ENV = "SGLANG_ELASTIC_TEST_PIN_FAULT"

#: typestr of a same-size integer type for each dtype (the interface has no bfloat16)
_TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _device_pointer(ptr: int) -> int:
    """``cudaHostGetDevicePointer`` of pinned memory (equal to ``ptr`` on UVA systems)."""
    try:
        from cuda.bindings import runtime  # cuda-python
    except ImportError:  # pragma: no cover - the GPU host has it; UVA gives the same pointer
        return ptr
    err, dptr = runtime.cudaHostGetDevicePointer(ptr, 0)
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"host buffer at {ptr:#x} is not pinned ({err}): register it before taking a device view")
    return int(dptr)


def device_view(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor aliasing pinned host memory (same shape, strides, dtype).

    Kernels reading or writing it cross PCIe (UVA, GPU-initiated); the host
    tensor must stay alive and pinned (``cudaHostRegister`` or
    ``pin_memory``) while the view is used. Without CUDA, or for a tensor
    already on a device, returns ``host`` itself (Triton's interpreter runs
    the kernels on CPU tensors).

    Raises:
        RuntimeError: the memory is not pinned.
    """
    if host.device.type != "cpu" or not torch.cuda.is_available():
        return host
    e = host.element_size()
    arr = _CudaArray(_device_pointer(host.data_ptr()), host.shape, _TYPESTR[e], [s * e for s in host.stride()])
    return torch.as_tensor(arr, device="cuda").view(_INT[e]).view(host.dtype)


class HostVPool(HostKVCache):
    """V of every token of the listed layers, in pinned host memory.

    Args:
        device_pool: the offload KV pool (``size``, ``page_size``,
            ``head_num``, ``v_head_dim``, ``store_dtype`` are read).
        layer_ids: the pool's local layer indices whose V lives here (the sparse layers).
        pin_memory: ``cudaHostRegister`` the buffer (False on a machine without CUDA).

    Shapes: ``v_buffer`` is ``[len(layer_ids), size, head_num, v_head_dim]`` with
    ``size >= device_pool.size + page_size`` (every device token id has a row).

    Raises:
        ValueError: not enough free host memory (SGLang's check, which keeps
            ``HICACHE_HOST_MEMORY_RESERVE_BYTES`` free); the message says how
            much was asked for and how much is free.
        RuntimeError: the allocation or its pinning failed (``cudaHostRegister``:
            a memlock limit, a driver out of pinnable memory); one line starting
            ``sglang-elastic:`` with the size and what to change. The server
            stops at start-up then, before any request.
    """

    def __init__(self, device_pool, layer_ids: Sequence[int], pin_memory: bool = True):
        self.layer_ids: List[int] = list(layer_ids)
        self.host_index = {l: i for i, l in enumerate(self.layer_ids)}
        super().__init__(device_pool, host_to_device_ratio=1.0, host_size=0, page_size=device_pool.page_size,
                         layout="layer_first", pin_memory=pin_memory, device="cpu")
        self.views = [device_view(self.v_buffer[i]) for i in range(len(self.layer_ids))] if pin_memory else list(self.v_buffer)

    def get_size_per_token(self):
        dp = self.device_pool
        return len(self.layer_ids) * dp.head_num * dp.v_head_dim * dp.store_dtype.itemsize

    def init_kv_buffer(self):
        dp = self.device_pool
        dims = (len(self.layer_ids), self.size, dp.head_num, dp.v_head_dim)
        try:
            fault = self.pin_memory and os.environ.get(PIN_FAULT_ENV) == "1"
            buf = ALLOC_MEMORY_FUNCS[dp.device](dims, dtype=self.dtype, device=self.device, pin_memory=self.pin_memory and not fault,
                                                allocator=self.allocator)
            if fault:  # the host memory taken, then the driver's refusal as SGLang's check raises it (the buffer is dropped)
                raise RuntimeError(f"cudaHostRegister failed (rc=2, out of memory) for ptr={buf.data_ptr():#x} size={buf.numel()} "
                                   f"({PIN_FAULT_ENV}=1: injected)")
            return buf
        except (RuntimeError, MemoryError) as e:  # SGLang's cudaHostRegister check, or the host allocation itself
            text = str(e)
            pin = "cudaHostRegister" in text
            if not (pin or isinstance(e, MemoryError) or "can't allocate memory" in text or "out of memory" in text.lower()):
                raise  # not a shortage of host memory (a CUDA or a shape error): as it is
            gb = f"{self.size * self.get_size_per_token() / 1e9:.3g}"
            detail = " ".join(text.split())[:200]
            raise RuntimeError(f"sglang-elastic: could not {'pin' if pin else 'allocate'} {gb} GB of host memory for the offload V tier "
                               f"({detail}): lower --kv-offload-host-gb, or raise the locked-memory limit (ulimit -l)") from e

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer

    def view(self, layer_id: int) -> torch.Tensor:
        """The device-addressable ``[size, head_num, v_head_dim]`` V rows of pool layer ``layer_id``."""
        return self.views[self.host_index[layer_id]]

    # HiCache's transfer interface, for the V rows (token id = host row)
    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend="kernel") -> None:
        """Copy V rows ``host_indices`` of layer ``layer_id`` into ``device_pool``'s V rows ``device_indices``
        (``HostKVCache``'s method: ``[n]`` int32/int64 token ids each, same length; a negative index skips its row),
        on the GPU from pinned memory (:func:`~sglang_elastic.kernels.offload.copy_rows_run`; ``io_backend`` is
        SGLang's argument, unused). Raises ValueError where the two pools' rows differ in size or dtype."""
        from sglang_elastic.kernels.offload import copy_rows_run

        copy_rows_run(self.view(layer_id), device_pool.get_value_buffer(layer_id), host_indices, device_indices, n=int(host_indices.numel()))

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend="kernel") -> None:
        """Copy ``device_pool``'s V rows ``device_indices`` of every layer this pool holds to its host rows
        ``host_indices`` (``[n]`` int32/int64 token ids each; as :meth:`load_to_device_per_layer`, the other way)."""
        from sglang_elastic.kernels.offload import copy_rows_run

        for layer_id in self.layer_ids:
            copy_rows_run(device_pool.get_value_buffer(layer_id), self.view(layer_id), device_indices, host_indices,
                          n=int(host_indices.numel()))

    def get_data_page(self, index, flat: bool = True):
        raise NotImplementedError("HostVPool mirrors the device pool's token ids; it has no HiCache storage pages")

    def get_dummy_flat_data_page(self):
        raise NotImplementedError("HostVPool mirrors the device pool's token ids; it has no HiCache storage pages")

    def set_from_flat_data_page(self, index: int, data_page) -> None:
        raise NotImplementedError("HostVPool mirrors the device pool's token ids; it has no HiCache storage pages")


__all__ = ["HostVPool", "device_view"]
