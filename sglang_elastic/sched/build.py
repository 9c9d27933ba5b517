"""Building the elastic pool where SGLang builds its KV pool.

Two AROUND hooks on ``KVCacheConfigurator`` (sglang/srt/mem_cache/
kv_cache_configurator.py), registered only when ``--enable-elastic-kv``:

- ``_build_mha_kv_pool``: SGLang picks the pool class and its arguments; we
  hand it a factory in place of ``MHATokenToKVPool`` that builds
  :class:`~sglang_elastic.pool.ElasticMHATokenToKVPool` with SGLang's token
  count as the base (so, with nothing lent, the pool is the stock pool) and a
  VA reservation large enough for every byte that could be lent. A failing
  VMM call falls back to SGLang's pool and logs one error.
- ``_build_token_to_kv_pool_allocator``: our allocator for that pool (SGLang's
  token or paged allocator with lend/withdraw), passed in so SGLang's builder
  does the rest of its wiring.

What can be lent is decided after CUDA-graph capture
(:class:`~sglang_elastic.sched.controller.ElasticController`); here we only
reserve address space: the free device memory now, before the pool takes
its share.
"""

from __future__ import annotations

import logging

import torch

from sglang_elastic import config
from sglang_elastic.pool.kv_pool import ElasticMHATokenToKVPool, ElasticPagedTokenToKVPoolAllocator, ElasticTokenToKVPoolAllocator
from sglang_elastic.vmm import VmmError

logger = logging.getLogger(__name__)


class _ElasticPoolFactory:
    """Stands in for ``MHATokenToKVPool`` in ``_build_mha_kv_pool``: called as
    ``cls(size, **kwargs)`` with SGLang's arguments."""

    def __init__(self, backend, cfg: config.ElasticKVConfig):
        self.backend = backend
        self.cfg = cfg

    def __call__(self, size: int, **kwargs):
        post_capture = bool(kwargs.pop("post_capture_active", False))
        page = kwargs["page_size"]
        layers = kwargs["layer_num"]
        elem = torch.empty((), dtype=kwargs["dtype"]).element_size() if kwargs["dtype"] not in (torch.float8_e4m3fn, torch.float8_e5m2) else 1
        v_dim = kwargs.get("v_head_dim") or kwargs["head_dim"]
        token_bytes = layers * kwargs["head_num"] * (kwargs["head_dim"] + v_dim) * elem
        # VA only: every byte free now could in principle be lent later, and
        # no more (--elastic-kv-lend-bytes above it is capped after capture too).
        if post_capture:
            # SGLang's post-capture sizing: ``size`` is its reservation bound
            # (the whole pre-capture budget), of which one page is backed now;
            # finalize_backing backs its final size after capture, what stays
            # free is lent on top, within the same VA.
            return ElasticMHATokenToKVPool(backend=self.backend, base_tokens=page, max_elastic_tokens=size, round_base_up=True,
                                           post_capture=True, **kwargs)
        free = self.backend.free_bytes()
        lend = self.cfg.lend_bytes
        reserve = (lend or 0) if free is None else (free if lend is None else min(lend, free))
        max_elastic = max(reserve // token_bytes, 0)
        return ElasticMHATokenToKVPool(
            backend=self.backend, base_tokens=size + page, max_elastic_tokens=max_elastic,
            round_base_up=True, **kwargs,
        )


def _unsupported(configurator, mha_pool_class, quant_method) -> str:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if mha_pool_class is not MHATokenToKVPool:
        return f"SGLang chose {mha_pool_class.__name__} for this model"
    if quant_method is not None or configurator.kv_cache_dtype_str == "mxfp8":
        return "a quantized KV cache"
    return ""


def build_mha_kv_pool(orig, configurator, *args, mha_pool_class, quant_method=None, **kwargs):
    """AROUND hook of ``KVCacheConfigurator._build_mha_kv_pool``."""
    cfg = config.current()
    if not cfg.enabled:
        return orig(configurator, *args, mha_pool_class=mha_pool_class, quant_method=quant_method, **kwargs)
    why = _unsupported(configurator, mha_pool_class, quant_method)
    if why:
        raise RuntimeError(f"sglang-elastic: --enable-elastic-kv cannot build its pool: {why}")
    try:
        from sglang_elastic.vmm.cuda import CudaBackend

        backend = CudaBackend(torch.device(configurator.device).index or torch.cuda.current_device())
        return orig(configurator, *args, mha_pool_class=_ElasticPoolFactory(backend, cfg), quant_method=None, **kwargs)
    except VmmError as e:
        logger.error("sglang-elastic: the elastic KV pool could not be built (%s); serving on SGLang's stock pool", e)
        return orig(configurator, *args, mha_pool_class=mha_pool_class, quant_method=quant_method, **kwargs)


def build_allocator(orig, configurator, *args, sizes, token_to_kv_pool, token_to_kv_pool_allocator=None, **kwargs):
    """AROUND hook of ``KVCacheConfigurator._build_token_to_kv_pool_allocator``.

    For our pool, returns SGLang's token (page size 1) or paged allocator with
    lend/withdraw, over SGLang's token count; the rest of SGLang's builder
    (HiSparse, DSV4 and draft-worker wiring) does not apply to a plain MHA pool.
    """
    if token_to_kv_pool_allocator is None and isinstance(token_to_kv_pool, ElasticMHATokenToKVPool):
        page = token_to_kv_pool.page_size
        cls = ElasticTokenToKVPoolAllocator if page == 1 else ElasticPagedTokenToKVPoolAllocator
        # with post-capture sizing the pool backs one page until SGLang's resize after capture
        base = token_to_kv_pool.arena.base_tokens if token_to_kv_pool.post_capture_active else sizes.max_total_num_tokens + page
        return cls(token_to_kv_pool, dtype=configurator.kv_cache_dtype, device=configurator.device, base_tokens=base)
    return orig(configurator, *args, sizes=sizes, token_to_kv_pool=token_to_kv_pool, token_to_kv_pool_allocator=token_to_kv_pool_allocator, **kwargs)
