"""Torch tensors over memory at a raw address (a VMM reservation).

SGLang's KV pools hold one ``torch`` tensor per layer; over an elastic arena
those tensors must sit at the arena's fixed virtual addresses. This builds them
through DLPack (a ``DLManagedTensor`` made with ``ctypes``, handed to
``torch.from_dlpack``), so no compiled extension is needed and the same code
serves CUDA device memory and host memory (the CPU test bed). The tensor does
not own the memory: the arena does, and must outlive it.

Reference: the DLPack C header (dmlc/dlpack ``dlpack.h``, v0.8 ABI).
"""

from __future__ import annotations

import ctypes
from typing import List, Sequence

import torch


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_kDLCPU, _kDLCUDA = 1, 2
_kDLInt, _kDLUInt, _kDLFloat, _kDLBfloat = 0, 1, 2, 4
_DTYPES = {
    torch.float32: (_kDLFloat, 32),
    torch.float16: (_kDLFloat, 16),
    torch.bfloat16: (_kDLBfloat, 16),
    torch.float64: (_kDLFloat, 64),
    torch.uint8: (_kDLUInt, 8),  # fp8 KV is stored as uint8 (KVCache.store_dtype)
    torch.int8: (_kDLInt, 8),
    torch.int32: (_kDLInt, 32),
    torch.int64: (_kDLInt, 64),
}

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# The DLManagedTensor structs (and their shape arrays) live as long as the
# process: a handful per pool, and torch may read them until the tensor dies.
_keep: List[object] = []


def tensor_at(address: int, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A contiguous tensor of ``shape``/``dtype`` whose storage starts at ``address``.

    Args:
        address: a CUDA device pointer (``device`` cuda) or host address (cpu),
            valid for ``prod(shape) * itemsize`` bytes for the tensor's lifetime.
        shape: tensor shape, e.g. ``(rows, kv_heads, head_dim)`` for one layer's K.
        dtype: one of float32/float16/bfloat16/float64/uint8/int8/int32/int64.
        device: ``"cuda[:i]"`` or ``"cpu"``.

    Raises:
        TypeError: for an unsupported dtype or device type.
    """
    dev = torch.device(device)
    if dtype not in _DTYPES:
        raise TypeError(f"tensor_at: unsupported dtype {dtype}")
    if dev.type == "cuda":
        dl_dev = _DLDevice(_kDLCUDA, dev.index if dev.index is not None else torch.cuda.current_device())
    elif dev.type == "cpu":
        dl_dev = _DLDevice(_kDLCPU, 0)
    else:
        raise TypeError(f"tensor_at: unsupported device {dev}")
    nd = len(shape)
    shape_arr = (ctypes.c_int64 * nd)(*shape)
    code, bits = _DTYPES[dtype]
    mt = _DLManagedTensor()
    mt.dl_tensor = _DLTensor(ctypes.c_void_p(address), dl_dev, nd, _DLDataType(code, bits, 1), shape_arr, None, 0)
    mt.manager_ctx = None
    mt.deleter = _DELETER()  # NULL: the arena owns the memory
    _keep.append((mt, shape_arr))
    capsule = _PyCapsule_New(ctypes.addressof(mt), b"dltensor", None)
    t = torch.utils.dlpack.from_dlpack(capsule)
    assert t.data_ptr() == address and tuple(t.shape) == tuple(shape)
    return t
