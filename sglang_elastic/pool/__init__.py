"""The elastic KV pool: SGLang's MHA pool and allocators over a VMM arena.

Knows SGLang's pool classes (``sglang/srt/mem_cache``); the VMM part lives in
:mod:`sglang_elastic.vmm`. Scheduler wiring (when to lend and reclaim) is
:mod:`sglang_elastic.sched`.
"""

from sglang_elastic.pool.kv_pool import (
    ElasticMHATokenToKVPool,
    ElasticPagedTokenToKVPoolAllocator,
    ElasticTokenToKVPoolAllocator,
    relocate_kv,
    unit_tokens,
)
from sglang_elastic.pool.tensor import tensor_at

__all__ = ["ElasticMHATokenToKVPool", "ElasticPagedTokenToKVPoolAllocator", "ElasticTokenToKVPoolAllocator", "relocate_kv", "tensor_at", "unit_tokens"]
from sglang_elastic.pool.vacate import evict_above, iter_nodes, plan_tree_remap, remap_ids, remap_many, remap_tree  # noqa: E402

__all__ += ["evict_above", "iter_nodes", "plan_tree_remap", "remap_ids", "remap_many", "remap_tree"]
