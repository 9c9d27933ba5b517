"""CUDA VMM primitives (and a host stand-in) for the elastic KV pool.

Knows nothing of SGLang: :mod:`sglang_elastic.vmm.base` is the interface,
:mod:`~sglang_elastic.vmm.cuda` and :mod:`~sglang_elastic.vmm.host` the
backends, :mod:`~sglang_elastic.vmm.arena` the VA-stable per-layer buffers with
a lendable tail.
"""

from sglang_elastic.vmm.arena import ElasticArena, token_quantum
from sglang_elastic.vmm.base import VmmBackend, VmmError, align_up
from sglang_elastic.vmm.host import HostBackend

__all__ = ["ElasticArena", "HostBackend", "VmmBackend", "VmmError", "align_up", "token_quantum"]
