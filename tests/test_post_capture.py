"""Issue 22, build 3: the elastic pool on top of SGLang's post-capture KV
sizing (``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1``), on the host backend.

SGLang 0.5.17's own sizing runs (``compute_post_capture_kv_resize``,
sglang/srt/model_executor/model_runner_components/kv_pool_runtime.py: the
headroom rule, the budget, ``finalize_backing`` and the allocator's
``resize``) over our pool and allocator, with the real ``ServerArgs`` of an
H200 launch (its ``mem_fraction_static``, decode graphs' ``max_bs`` and
``pre_capture_activation_reserve_mb``); only what needs a GPU is given the
host backend's numbers (the free memory SGLang measures, the GPU's size,
the world group). The controller then lends what the sizing left free,
less the margin.
"""

from __future__ import annotations

import argparse
import types

import pytest
import torch

import sglang_sizing as ref
from sglang_elastic import config
from sglang_elastic.config import ElasticKVConfig
from sglang_elastic.serve import model_path
from sglang_elastic.vmm import HostBackend

from test_controller import LAYERS, Bed, sglang_runtime_context  # noqa: F401 (the autouse fixture: SGLang's runtime config)

H200_MIB = 143771
ROW = 2 * LAYERS * 2 * 64 * 2  # bytes per token, every layer's K and V (2 heads of 64, bf16)
GIB = 2**30


def test_elastic_kv_is_accepted_with_post_capture_sizing_and_offload_still_refuses_it(monkeypatch):
    from sglang.srt.server_args import ServerArgs

    ns = argparse.Namespace(**{f: getattr(ServerArgs, f) for f in ("enable_pdmux", "dllm_algorithm", "radix_cache_backend",
                                                                     "enable_session_radix_cache", "kv_canary")})
    for name in ("SGLANG_ENABLE_UNIFIED_RADIX_TREE", "SGLANG_EXPERIMENTAL_CPP_RADIX_TREE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING", "1")
    config.check_server_args(ElasticKVConfig(enabled=True), ns)  # before issue 22's build 3: refused


@pytest.mark.parametrize("max_running_requests, margin_mb", [(256, 16), (None, 256)],
                         ids=["mrr-256 (no eager-decode gap: SGLang leaves ~0.4 % free)", "default mrr (SGLang keeps its eager-decode reserve)"])
def test_sglangs_post_capture_sizing_sizes_the_base_and_the_controller_lends_what_it_left_free_less_the_margin(max_running_requests, margin_mb, monkeypatch):
    """With --max-running-requests at most the decode graphs' batch SGLang
    leaves only ``pre_model_load_memory * (1 - mem_fraction_static)`` free
    (0.4 %: ~0.56 GiB on an H200, less than the default 1 GiB margin, so
    nothing is lent there unless the margin is lowered, as here); without
    it SGLang keeps its whole activation reserve for eager decodes above the
    graphs (12.6 GiB on an H200), which the pool lends while the decode
    batch fits the graphs."""
    from sglang.srt.model_executor.model_runner_components import kv_pool_runtime
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig
    from sglang.srt.environ import envs

    from sglang_elastic.sched.build import _ElasticPoolFactory, build_allocator

    sa = ref.server_args(model_path("llama-3.1-8b"), H200_MIB, 1, post_capture=True, max_running_requests=max_running_requests)
    with envs.SGLANG_ENABLE_POST_CAPTURE_KV_SIZING.override(True):
        assert sa.post_capture_kv_sizing_planned()  # SGLang's own gate: the prefill graphs hold the chunk
    decode_bs = sa.cuda_graph_config.decode.max_bs
    mrr = max_running_requests or 4096
    pre_load_gib = 8.0  # free before the weights loaded (SGLang's pre_model_load_memory), scaled to this box
    headroom = pre_load_gib * (1 - sa.mem_fraction_static)  # SGLang's: what its mem_fraction_static kept back
    if mrr > decode_bs:  # SGLang keeps its whole activation reserve for eager decodes above the graphs
        headroom = max(headroom, sa.pre_capture_activation_reserve_mb(H200_MIB) / 1024)
    kv_after = 48 * 2**20  # what SGLang's budget leaves the base: free after capture = headroom + this
    reserved = int((headroom * GIB + kv_after) // ROW) + 4096  # SGLang's pre-capture bound: more than all of it
    be = HostBackend(granularity=4096)
    cfg = ElasticKVConfig(enabled=True, margin_mb=margin_mb)
    pool = _ElasticPoolFactory(be, cfg)(reserved, post_capture_active=True, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=64,
                                        layer_num=LAYERS, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    assert pool.post_capture_active and pool.arena.base_tokens == pool.arena.quantum  # one quantum backed before capture
    configurator = types.SimpleNamespace(kv_cache_dtype=torch.bfloat16, device="cpu")
    alloc = build_allocator(None, configurator, sizes=MemoryPoolConfig(max_total_num_tokens=reserved), token_to_kv_pool=pool)
    backed = sum(be._handle_bytes.values())
    be.capacity = backed + int(headroom * GIB) + kv_after  # the device after CUDA-graph capture

    class Configurator:  # SGLang's MHA configurator's arithmetic: tokens = budget // cell bytes, capped
        def config_from_budget(self, budget, cap_tokens=None):
            return MemoryPoolConfig(max_total_num_tokens=min(budget // ROW, cap_tokens or budget))

        def resolve_max_num_reqs(self, tokens):
            return mrr

    runner = types.SimpleNamespace(token_to_kv_pool=pool, token_to_kv_pool_allocator=alloc, device="cpu", gpu_id=0, server_args=sa,
                                   pre_model_load_memory=pre_load_gib, mem_fraction_static=sa.mem_fraction_static, max_running_requests=mrr,
                                   model_config=None, max_total_num_tokens=reserved, kv_cache_configurator=Configurator())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(kv_pool_runtime, "get_available_gpu_memory", lambda *a, **k: be.free_bytes() / GIB)
    monkeypatch.setattr(kv_pool_runtime, "get_world_group", lambda: types.SimpleNamespace(world_size=1, cpu_group=None))
    monkeypatch.setattr(kv_pool_runtime, "get_device_memory_capacity", lambda *a, **k: H200_MIB)
    monkeypatch.setattr(kv_pool_runtime, "mambaish_config", lambda mc: None)  # a Llama
    resize = kv_pool_runtime.compute_post_capture_kv_resize(runner)  # SGLang's own post-capture sizing
    final = resize.max_total_num_tokens
    # SGLang's budget: free - headroom + what the pool backed, in tokens; the base holds them
    assert final == (int(max(0.0, (be.capacity - backed) / GIB - headroom) * GIB) + backed) // ROW
    assert alloc.size == final and alloc.available_size() == final and pool.arena.base_tokens >= final + 1
    free_after = be.free_bytes()
    assert abs(free_after - headroom * GIB) < pool.arena.quantum * ROW + ROW  # SGLang left its headroom free

    bed = Bed(built=(be, pool, alloc), margin_mb=cfg.margin_mb, server_args=sa)  # the Scheduler.__init__ AFTER hook: measure and lend
    quantum = pool.arena.quantum
    want = (free_after - cfg.margin_mb * 2**20) // ROW // quantum * quantum
    assert bed.ctl.lendable_tokens == want > 0  # free after capture minus the margin, in whole token quanta
    assert bed.ctl.lendable_tokens * ROW <= free_after - cfg.margin_mb * 2**20 < (bed.ctl.lendable_tokens + quantum) * ROW
    assert bed.ctl.lend_max_bs == decode_bs  # lends while the decode batch fits the graphs
    assert bed.ctl.lend() == want and alloc.size == final + want
    assert be.free_bytes() >= cfg.margin_mb * 2**20
    bed.ctl.reclaim(bed.batch, why="test")
    bed.ctl.after_prefill(None, bed.batch)  # the next pass: the unmap and releases on the helper thread are done
    assert alloc.size == final and be.free_bytes() == free_after
    pool.arena.close()
    assert be.live_handles == 0
