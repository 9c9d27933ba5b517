"""Where the offload pool hooks into SGLang 0.5.17 (no patch needed).

Registered with SGLang's ``HookRegistry`` (sglang/srt/plugins/hook_registry.py)
by the plugin, in each scheduler process, when ``--enable-kv-offload``:

| target | kind | does |
|---|---|---|
| ``KVCacheConfigurator._resolve_memory_pool_config`` | AROUND | sizes the pool (:func:`sglang_elastic.offload.sizing.size_pool`): ``max_total_num_tokens`` = what K on the GPU and V on the host hold, ``max_running_requests`` = hot-buffer rows |
| ``KVCacheConfigurator._build_mha_kv_pool`` | AROUND | builds :class:`~sglang_elastic.offload.pool.OffloadKVPool` where SGLang builds ``MHATokenToKVPool`` |
| ``Scheduler.get_internal_state`` | AFTER | adds ``sglang_elastic_offload`` (pool size and bound, hit rate, PCIe bytes) to ``/server_info``'s ``internal_states`` |
| ``SchedulerMetricsReporter.report_decode_stats`` | AFTER | every ``--decode-log-interval`` decode steps: ``sglang_elastic:offload_*`` on ``/metrics`` (with ``--enable-metrics``) and one log line |
| ``ReqToTokenPool.free`` | AROUND | a finished or retracted request's row gives its hot-buffer pages and (``--kv-offload-denominator estimate``) its V-summary slots back (at the next forward, on its stream), and (``--kv-offload-keep-v``) its kept V slots to SGLang's allocator; AROUND because ``free`` clears ``req.req_pool_idx`` |
| ``ScheduleBatch.prepare_for_extend`` / ``prepare_for_decode``, ``TokenToKVPoolAllocator.alloc`` / ``available_size`` | AFTER / AROUND | dense while V fits (``--kv-offload-keep-v``, on by default; they pass through for a pool built without kept V): :mod:`sglang_elastic.offload.keep` |
| ``PrefillAdder.add_one_req`` | AROUND | a prefill batch's prefixes fit the staging buffers (one layer's K and V of the context length): with SGLang's radix cache several requests of a batch may have a cached prefix, and a request that would take the batch past the staging waits for the next batch; with the radix cache, also the running requests' lengths (:func:`around_add_one_req`) |
| ``ScheduleBatch.check_decode_mem`` | AROUND | with SGLang's radix cache: the next decode step fits only while the running requests' lengths add up to the pool's token count, so SGLang's own retraction (``retract_decode``) takes requests back until they do (:func:`around_check_decode_mem`) |

SGLang's allocator, admission (``PrefillAdder``), retraction and request
limits then run unchanged on the counts the pool really holds.
"""

from __future__ import annotations

import logging

import torch

from sglang_elastic import config

logger = logging.getLogger(__name__)

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_REPORTER = "sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter"
_REQ_POOL = "sglang.srt.mem_cache.memory_pool.ReqToTokenPool"
_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
#: ``--max-running-requests`` when the user gives none: hot buffers are per request.
DEFAULT_REQUESTS = 64
#: What the sizing hook decided, for the pool builder and the server state (this process's target worker).
_BUILT: dict = {}
#: The key of the offload state in ``/server_info``'s ``internal_states`` entries.
STATE_KEY = "sglang_elastic_offload"


def state_from_server_info(info: dict):
    """The offload state a server reports in ``/server_info`` (:func:`state`), or None (no offload)."""
    for st in info.get("internal_states", []) or []:
        if isinstance(st, dict) and STATE_KEY in st:
            return st[STATE_KEY]
    return None


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{_CONFIGURATOR}._resolve_memory_pool_config", resolve_memory_pool_config, HookType.AROUND)
    HookRegistry.register(f"{_CONFIGURATOR}._build_mha_kv_pool", build_mha_kv_pool, HookType.AROUND)
    HookRegistry.register(f"{_SCHEDULER}.get_internal_state", _after_internal_state, HookType.AFTER)
    HookRegistry.register(f"{_REPORTER}.report_decode_stats", _after_decode_stats, HookType.AFTER)
    HookRegistry.register(f"{_REQ_POOL}.free", around_req_free, HookType.AROUND)
    HookRegistry.register(f"{_ADDER}.add_one_req", around_add_one_req, HookType.AROUND)
    HookRegistry.register(f"{_BATCH}.check_decode_mem", around_check_decode_mem, HookType.AROUND)
    if config.current().offload.keep_v_wanted:  # its hooks act only on a pool built with kept V (keep._offload_backend)
        from sglang_elastic.offload import keep

        keep.register()


def _offload_pool(allocator):
    """The :class:`~sglang_elastic.offload.pool.OffloadKVPool` SGLang's allocator serves, else None."""
    from sglang_elastic.offload.pool import OffloadKVPool

    pool = getattr(allocator, "_kvcache", None)
    return pool if isinstance(pool, OffloadKVPool) else None


def _shares_ids(tree) -> bool:
    """SGLang's radix cache is on: requests may hold the same token ids (a matched prefix)."""
    return tree is not None and not tree.is_chunk_cache() and not getattr(tree, "disable", False)


def _lengths(reqs) -> int:
    """The running requests' lengths after their next token (``Req.seqlen``: prompt, earlier chunks included, and
    output), added up: what the pool's per-step buffers are sized for (:func:`around_check_decode_mem`)."""
    return sum(r.seqlen + 1 for r in reqs)


def _admitted_lengths(reqs, new_token_ratio: float) -> int:
    """What the admission counts of requests' lengths (:func:`around_add_one_req`): each one's length two tokens on
    (``Req.seqlen`` + 2: under SGLang's overlap scheduler the running requests' last decode is still in flight while
    a prefill batch forms, and without it the prefill's result adds a token before the next decode check), plus the
    growth SGLang's own admission reserves for it (its remaining new tokens, at most ``CLIP_MAX_NEW_TOKENS``,
    times the scheduler's ``new_token_ratio``). Without the headroom, a request admitted at the bound was the
    first that the very next :func:`around_check_decode_mem` retracted, before it decoded a token (a review)."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    def growth(r):
        left = max((r.sampling_params.max_new_tokens or 0) - len(r.output_ids), 0)
        return int(min(left, CLIP_MAX_NEW_TOKENS) * new_token_ratio)

    return sum(r.seqlen + 2 + growth(r) for r in reqs)


def around_add_one_req(orig, adder, req, *args, **kwargs):
    """AROUND hook of ``PrefillAdder.add_one_req``: a request joins the prefill batch being formed only while

    - the batch's prefixes (``prefix_indices``: a prefix the radix cache matched, or a chunked prompt's earlier
      chunks) fit the offload pool's staging buffers, which hold every prefix of a batch for one layer (the
      context length: :meth:`~sglang_elastic.offload.pool.OffloadKVPool.stage_layer`);
    - with SGLang's radix cache, the running requests', the batch's and its own lengths (its whole prompt), with
      room for the steps in flight and the growth SGLang reserves (:func:`_admitted_lengths`), add up to the
      pool's token count at most (:func:`around_check_decode_mem` says why).

    Else SGLang's ``OTHER`` (stop adding, as SGLang stops for its own limits): the request waits for a later
    batch (first in it under SGLang's ``fcfs`` / ``lof`` orders). A request joins an empty batch beside no
    running request always (its prompt is shorter than the context, and the pool holds at least one context).
    The bound does not trigger SGLang's priority preemption (``--enable-priority-scheduling``): a request it
    holds back waits for running requests to finish."""
    pool = _offload_pool(getattr(adder, "token_to_kv_pool_allocator", None))
    if pool is not None:
        batch = list(adder.can_run_list)
        over = batch and sum(len(r.prefix_indices) for r in batch) + len(req.prefix_indices) > pool.layout.stage_tokens
        if not over and _shares_ids(adder.tree_cache):
            running = list(adder.running_batch.reqs) if adder.running_batch is not None else []
            over = (running or batch) and _admitted_lengths(running + batch + [req], adder.new_token_ratio) > pool.size
        if over:
            from sglang.srt.managers.schedule_policy import AddReqResult

            return AddReqResult.OTHER
    return orig(adder, req, *args, **kwargs)


def around_check_decode_mem(orig, batch, *args, **kwargs):
    """AROUND hook of ``ScheduleBatch.check_decode_mem`` (does the next decode step fit?): with SGLang's radix
    cache, also no more than while the requests' lengths (``selected_indices`` of them, as SGLang passes them)
    add up to the pool's token count. The decode step's lists and scores, the hot-buffer pages and the V-summary
    slots are sized for that many positions (:func:`~sglang_elastic.offload.sizing.size_pool`): without the
    cache it holds, since every position has a token id of its own; with it, requests that share a cached
    prefix hold more positions than ids. A False here makes SGLang retract (``retract_decode``, its own order)
    until the rest fit; a request alone always fits."""
    ok = orig(batch, *args, **kwargs)
    pool = _offload_pool(getattr(batch, "token_to_kv_pool_allocator", None))
    if not ok or pool is None or not _shares_ids(getattr(batch, "tree_cache", None)):
        return ok
    sel = kwargs.get("selected_indices", args[0] if args else None)
    reqs = batch.reqs if sel is None else [batch.reqs[i] for i in sel]
    return len(reqs) <= 1 or _lengths(reqs) <= pool.size


def around_req_free(orig, req_pool, req, *args, **kwargs):
    """AROUND hook of ``ReqToTokenPool.free``: the request's ``req_to_token`` row is free
    again, so its hot-buffer pages and summary slots go back (queued for the next forward;
    with every denominator: an idle row must hold no page, or the page pool sized for the
    live tokens runs short). The row is read before ``free`` runs: SGLang's ``free`` sets
    ``req.req_pool_idx = None``."""
    row = getattr(req, "req_pool_idx", None)
    result = orig(req_pool, req, *args, **kwargs)
    pool = _BUILT.get("pool")
    if pool is not None and row is not None and (pool.summary_layer_ids or pool.hot_pages):
        pool.release_rows([row])
    if pool is not None and row is not None and pool.keep_v:
        from sglang_elastic.offload import keep

        keep.release_row(row)  # its kept V slots back to SGLang's allocator
    return result


def _backend(sched):
    from sglang_elastic.offload.backend import OffloadAttnBackend

    try:
        ab = sched.tp_worker.model_runner.attn_backend
    except AttributeError:
        return None
    return ab if isinstance(ab, OffloadAttnBackend) else None


def state(sched) -> dict:
    """The ``sglang_elastic_offload`` entry of a scheduler's internal state."""
    be = _backend(sched)
    if be is None:
        return {}
    pool = be.pool
    lay = pool.layout
    out = {"tokens": pool.size, "request_rows": lay.request_rows, "hot_tokens": lay.hot_tokens, "hot_slack": lay.hot_slack, "hot_slack_max": lay.hot_slack_max,
           "resident_v": lay.resident_v, "host_pool_bytes": pool.host_bytes(),
           "policy": {k: getattr(lay.policy, k) for k in ("sink", "window", "budget_frac", "max_topk", "dense_layers", "denominator", "chunk")}}
    sz = _BUILT.get("sizing")
    if sz is not None:
        out["sizing"] = sz.to_dict()
    out.update(be.stats())
    return out


def _after_internal_state(result, sched, *args, **kwargs):
    if isinstance(getattr(result, "internal_state", None), dict):
        st = state(sched)
        if st:
            result.internal_state[STATE_KEY] = st
    return result


def _after_decode_stats(result, reporter, *args, **kwargs):
    """Every decode-log interval: the interval's hit rate and PCIe traffic, from the counters of the
    last snapshot the GPU has copied (:class:`~sglang_elastic.offload.metrics.AsyncSnapshot`: no host
    sync, so SGLang's overlap loop keeps running; one interval behind)."""
    if reporter.forward_ct_decode % reporter.decode_log_interval != 0:
        return result
    sched = reporter.scheduler
    be = _backend(sched)
    if be is None:
        return result
    st = be.stats(sync=False)  # never a host sync here: the counters of the last copy the GPU has finished
    if st is None:
        return result
    from sglang_elastic.offload.metrics import OffloadMetrics

    m = getattr(be, "_metrics", None)
    if m is None:
        labels = {k: str(v) for k, v in sched.metrics_collector.labels.items()} if reporter.current_scheduler_metrics_enabled else None
        m = be._metrics = OffloadMetrics(labels)
    used = be.pool.size - sched.token_to_kv_pool_allocator.available_size()
    line = m.update(st, used_tokens=used, host_token_bytes=be.pool.host.get_size_per_token() if be.pool.host is not None else 0,
                    now=be.snapshot_time)
    if line and sched.tp_group.rank_in_group == 0:
        logger.info("sglang-elastic offload: %s", line)
    return result


def _unsupported_model(kvc) -> str:
    if kvc.use_mla_backend:
        return "an MLA model"
    if kvc.is_hybrid_swa:
        return "a hybrid sliding-window model"
    if kvc.mambaish_config is not None:
        return "a hybrid linear-attention / Mamba model"
    if kvc.is_draft_worker:
        return "a draft model"
    if getattr(kvc.model_config, "is_multimodal", False):
        return "a multimodal model"
    if kvc.sliding_window_size is not None:
        return "sliding-window attention"
    hf = getattr(kvc.model_config, "hf_config", None)
    grok = any("Grok" in a for a in (getattr(hf, "architectures", None) or []))
    cap = getattr(hf, "attn_logit_softcapping", None)
    if cap is None and grok:
        cap = 30.0  # grok.py: max(config.attn_logit_softcapping (default 30), 0)
    if (cap or 0) > 0:
        return "attention logit soft-capping (not in these kernels)"
    return ""


def _tp_min(value: int) -> int:
    """The smallest ``value`` over the world group (ranks differ in free host RAM)."""
    from sglang.srt.distributed import get_world_group

    g = get_world_group()
    if g.world_size <= 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=g.cpu_group)
    return int(t.item())


def model_shape(kvc):
    """The per-rank :class:`~sglang_elastic.offload.sizing.ModelShape` of a ``KVCacheConfigurator``."""
    from sglang.srt.runtime_context import get_parallel

    from sglang_elastic.offload.sizing import ModelShape

    mc = kvc.model_config
    tp = get_parallel().attn_tp_size
    return ModelShape(
        layers=kvc.layer_info.num_effective_layers, kv_heads=mc.get_num_kv_heads(tp), head_dim=mc.head_dim,
        v_head_dim=mc.v_head_dim, q_heads=mc.get_max_num_attention_heads() // tp,
        elem=torch.empty((), dtype=kvc.kv_cache_dtype).element_size(), context_len=mc.context_len,
    )


def keep_v_for_model(cfg, shape) -> bool:
    """Whether the pool keeps V in idle K slots (``--kv-offload-keep-v``) for this model: as the flags want, but off
    for a model whose V head_dim differs from K's (a V row must have a K slot's shape), quietly by default.

    Args:
        cfg: the server's :class:`~sglang_elastic.config.OffloadConfig`; shape: :func:`model_shape`'s.

    Raises:
        RuntimeError: that model with a keep-v flag given (``--kv-offload-keep-v``, ``--kv-offload-keep-reserve``
            or ``--kv-offload-dense-launch``): one line naming the flag, rather than ignoring what was asked for."""
    if not cfg.keep_v_wanted or shape.head_dim == shape.v_head_dim:
        return cfg.keep_v_wanted
    given = ("--kv-offload-keep-v" if cfg.keep_v else "--kv-offload-keep-reserve" if cfg.keep_reserve is not None
             else "--kv-offload-dense-launch" if cfg.dense_launch else None)
    if given:
        raise RuntimeError(f"sglang-elastic: {given} sets keep-v, which keeps V rows in K slots: this model's V head_dim "
                           f"{shape.v_head_dim} differs from K's {shape.head_dim}: drop {given}")
    logger.info("sglang-elastic: V head_dim %d differs from K's %d: no dense-while-V-fits (--kv-offload-keep-v) for this model",
                shape.v_head_dim, shape.head_dim)
    return False


def radix_cache_on(server_args) -> bool:
    """SGLang's radix cache is on (``--disable-radix-cache`` not given): requests then share a cached prefix's
    token ids, and the hot buffers' hint goes by request row and position (``OffloadLayout.hint_by_row``)."""
    return server_args is not None and not server_args.disable_radix_cache


def offload_layout(cfg, policy, requests: int, shape, keep_v: bool, hint_by_row: bool):
    """The :class:`~sglang_elastic.offload.pool.OffloadLayout` of the server's flags (``cfg``: its
    :class:`~sglang_elastic.config.OffloadConfig`), for ``requests`` running requests (plus SGLang's padding row)."""
    from sglang_elastic.offload.pool import OffloadLayout

    return OffloadLayout(policy, cfg.hot_tokens, request_rows=requests + 1, stage_tokens=shape.context_len, hot_slack=cfg.hot_slack,
                         hot_slack_max=cfg.hot_slack_max, resident_v=cfg.resident_v, eviction=cfg.eviction, keep_v=keep_v,
                         hint_by_row=hint_by_row)


def resolve_memory_pool_config(orig, kvc, pre_model_load_memory, *args, **kwargs):
    """AROUND hook of ``KVCacheConfigurator._resolve_memory_pool_config``."""
    cfg = config.current().offload
    if not cfg.enabled:
        return orig(kvc, pre_model_load_memory, *args, **kwargs)
    why = _unsupported_model(kvc)
    if why:
        raise RuntimeError(f"sglang-elastic: --enable-kv-offload does not serve {why}: drop --enable-kv-offload")
    import psutil
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig
    from sglang.srt.runtime_context import get_parallel, get_schedule

    from sglang_elastic.offload.sizing import SizingError, size_pool

    sched = get_schedule()
    shape = model_shape(kvc)
    keep_v = keep_v_for_model(cfg, shape)
    policy = cfg.policy()
    requests = sched.max_running_requests or DEFAULT_REQUESTS
    if sched.max_running_requests is None:
        logger.info("sglang-elastic: --enable-kv-offload without --max-running-requests: %d requests (each holds a hot buffer)", requests)
    available = kvc._profile_available_bytes(pre_model_load_memory)
    ranks_here = max(1, min(get_parallel().tp_size, torch.cuda.device_count() or 1))
    host_free = psutil.virtual_memory().available // ranks_here
    # the layout the pool builder gets, and the sizing from the same keep-v and hint choices (one source: a sizing that
    # left out the kept rows' table or the per-row hint would hand SGLang more tokens than the GPU holds)
    layout = offload_layout(cfg, policy, requests, shape, keep_v, radix_cache_on(getattr(kvc, "server_args", None)))
    try:
        sz = size_pool(available, shape, policy, cfg.hot_tokens, requests, host_free, slack=cfg.hot_slack,
                       host_limit_bytes=None if cfg.host_gb is None else int(cfg.host_gb * 1e9),
                       max_total_tokens=sched.max_total_tokens, page_size=sched.page_size or 1, resident=cfg.resident_v,
                       keep_v=layout.keep_v, hint_by_row=layout.hint_by_row)
    except SizingError as e:
        raise RuntimeError(f"sglang-elastic: {e}") from None
    tokens = _tp_min(sz.tokens)
    logger.info(
        "sglang-elastic: KV offload pool: %d tokens (%.2fx the %d SGLang would hold; bound: %s), %d requests, "
        "GPU %.1f GiB (+%.1f GiB hot buffers and staging), host %.1f GB of V%s",
        tokens, tokens / max(sz.stock_tokens, 1), sz.stock_tokens, sz.bound, requests,
        tokens * sz.device_token_bytes / 2**30, sz.device_fixed_bytes / 2**30, (tokens + 1) * sz.host_token_bytes / 1e9,
        " (resident V: the exactness reference)" if cfg.resident_v else "",
    )
    # KVCacheConfigurator has __slots__: the layout waits here for the pool builder (one target worker per process)
    _BUILT["layout"] = layout
    _BUILT["sizing"] = sz
    out = MemoryPoolConfig(max_total_num_tokens=tokens, max_running_requests=requests)
    out.mem_fraction_static = sched.mem_fraction_static
    return out


def build_mha_kv_pool(orig, kvc, *args, mha_pool_class, quant_method=None, **kwargs):
    """AROUND hook of ``KVCacheConfigurator._build_mha_kv_pool``."""
    layout = _BUILT.get("layout")
    if layout is None:
        return orig(kvc, *args, mha_pool_class=mha_pool_class, quant_method=quant_method, **kwargs)
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sglang_elastic.offload.pool import OffloadKVPool

    if mha_pool_class is not MHATokenToKVPool or quant_method is not None or kvc.kv_cache_dtype_str == "mxfp8":
        raise RuntimeError("sglang-elastic: --enable-kv-offload builds SGLang's plain MHA pool only (no page-major layout, no KV quantization)")
    pin = torch.cuda.is_available()

    def factory(size, **kw):
        kw.pop("post_capture_active", None)
        pool = OffloadKVPool(size, layout=layout, pin_memory=pin, **kw)
        _BUILT["pool"] = pool
        return pool

    return orig(kvc, *args, mha_pool_class=factory, quant_method=None, **kwargs)


__all__ = ["DEFAULT_REQUESTS", "around_req_free", "build_mha_kv_pool", "model_shape", "register", "resolve_memory_pool_config", "state"]
