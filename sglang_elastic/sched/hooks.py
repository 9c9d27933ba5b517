"""Where the elastic KV pool hooks into SGLang 0.5.17 (no patch needed).

Registered with SGLang's ``HookRegistry`` (sglang/srt/plugins/hook_registry.py)
by the plugin, in each scheduler process, when ``--enable-elastic-kv``:

| target | kind | does |
|---|---|---|
| ``KVCacheConfigurator._build_mha_kv_pool`` | AROUND | builds the elastic pool (:mod:`.build`) |
| ``KVCacheConfigurator._build_token_to_kv_pool_allocator`` | AROUND | its allocator |
| ``Scheduler.__init__`` | AFTER | measures the lendable bytes after CUDA-graph capture, creates the :class:`.ElasticController` |
| ``Scheduler._get_new_batch_prefill_raw`` | AROUND | reclaim before a prefill may form (with ``--elastic-kv-reclaim-wait decode`` and a decode batch in the graphs, no prefill forms while the reclaim's unmap is still giving back what its forward needs: the decode batch runs, at most 16 passes; :meth:`.ElasticController.defer_prefill` says when not); lend after decode-only steps |
| ``Scheduler.run_batch`` | AFTER | while lent, a fence after the forward it launched (a reclaim waits on it, not on the whole device); notes an eager prefill, whose pass peak is read when the next pass begins (``EagerActivations``) |
| ``Scheduler.maybe_sleep_on_idle`` | BEFORE | in ``dynamic`` mode with eager prefills and SGLang's activation rule, once per idle period: reclaim what the next prefill needs, before SGLang's idle sleep (with ``--sleep-on-idle`` it polls there for up to a second) (:meth:`.ElasticController.on_idle`) |
| ``Scheduler.get_internal_state`` | AFTER | adds ``sglang_elastic`` (base, lendable, lent tokens) to ``/server_info``'s ``internal_states`` |
"""

from __future__ import annotations

import logging

from sglang_elastic import config

logger = logging.getLogger(__name__)

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_elastic.sched import build

    HookRegistry.register(f"{_CONFIGURATOR}._build_mha_kv_pool", build.build_mha_kv_pool, HookType.AROUND)
    HookRegistry.register(f"{_CONFIGURATOR}._build_token_to_kv_pool_allocator", build.build_allocator, HookType.AROUND)
    HookRegistry.register(f"{_SCHEDULER}.__init__", _after_scheduler_init, HookType.AFTER)
    HookRegistry.register(f"{_SCHEDULER}._get_new_batch_prefill_raw", _around_prefill_raw, HookType.AROUND)
    HookRegistry.register(f"{_SCHEDULER}.run_batch", _after_run_batch, HookType.AFTER)
    HookRegistry.register(f"{_SCHEDULER}.get_internal_state", _after_internal_state, HookType.AFTER)
    HookRegistry.register(f"{_SCHEDULER}.maybe_sleep_on_idle", _before_idle_sleep, HookType.BEFORE)


def _after_scheduler_init(result, sched, *args, **kwargs):
    from sglang_elastic.pool.kv_pool import _ElasticAllocatorMixin
    from sglang_elastic.sched.controller import ElasticController, agree_min

    ours = isinstance(getattr(sched, "token_to_kv_pool_allocator", None), _ElasticAllocatorMixin)
    # Every rank must run a controller (its lends are collectives) or none:
    # a rank whose pool fell back to SGLang's stock pool turns lending off everywhere.
    if agree_min(sched, int(ours)):
        sched._sglang_elastic = ElasticController(sched, config.current())
    else:
        logger.error("sglang-elastic: --enable-elastic-kv is on but %s runs SGLang's stock pool (see the error above): nothing will be lent",
                     "this scheduler" if not ours else "another TP rank")
    return result


def _around_prefill_raw(orig, sched, *args, **kwargs):
    ctl = getattr(sched, "_sglang_elastic", None)
    if ctl is None:
        return orig(sched, *args, **kwargs)
    running_batch = kwargs["running_batch"] if "running_batch" in kwargs else args[1]
    ctl.before_prefill(running_batch)
    if ctl.defer_prefill(running_batch):  # the reclaim's memory is not back yet: SGLang runs the decode batch
        return None, running_batch
    new_batch, running_batch = orig(sched, *args, **kwargs)
    ctl.after_prefill(new_batch, running_batch)
    return new_batch, running_batch


def _after_run_batch(result, sched, *args, **kwargs):
    ctl = getattr(sched, "_sglang_elastic", None)
    if ctl is not None:
        ctl.after_forward(kwargs["batch"] if "batch" in kwargs else (args[0] if args else None))
    return result


def _before_idle_sleep(sched, *args, **kwargs):
    ctl = getattr(sched, "_sglang_elastic", None)
    if ctl is not None:
        ctl.on_idle()
    return None  # the arguments unchanged


def _after_internal_state(result, sched, *args, **kwargs):
    ctl = getattr(sched, "_sglang_elastic", None)
    if ctl is not None and isinstance(getattr(result, "internal_state", None), dict):
        result.internal_state["sglang_elastic"] = ctl.state()
    return result
