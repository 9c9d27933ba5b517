"""The ``persistentkv`` SGLang backend on SGLang's real pool classes.

``ReqToTokenPool``, ``MHATokenToKVPool`` (its ``set_kv_buffer`` writes the
new token), ``RadixAttention`` layers, ``ForwardMode`` and SGLang's
``create_flashinfer_kv_indices_triton`` all run on the CPU under Triton's
interpreter. What cannot: ``ModelRunner`` and ``ForwardBatch`` (built from a
scheduler batch on a GPU) are stood in for by namespaces holding exactly the
fields the backend reads, and the FlashInfer path (SGLang's
``FlashInferAttnBackend`` needs CUDA) is covered on the GPU by
``scripts/gpu/check_decode_e2e.py``. CUDA-graph capture/replay is simulated
by the runner's call order (``init_cuda_graph_state``; per step
``init_forward_metadata_out_graph`` then ``init_forward_metadata_in_graph``)
on the same buffers.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

from sglang_elastic.attention import backend as backend_mod
from sglang_elastic.attention.policy import load_calibration

HQ, HKV, D, LAYERS, CTX = 8, 2, 64, 2, 512


@pytest.fixture(autouse=True)
def _single_rank(monkeypatch):
    # SGLang's parallel context is only initialised inside a server process
    monkeypatch.setattr(backend_mod, "_attn_tp_size", lambda: 1)
    monkeypatch.setattr(backend_mod, "_attn_dcp_size", lambda: 1)
    monkeypatch.setattr(backend_mod, "_device_sm_count", lambda mr: 0)


def make_runner(page_size, dtype, slots=4096, max_reqs=6):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    return types.SimpleNamespace(
        device="cpu", gpu_id=0, page_size=page_size, kv_cache_dtype=dtype, sliding_window_size=None, use_mla_backend=False,
        req_to_token_pool=ReqToTokenPool(size=max_reqs, max_context_len=CTX, device="cpu", enable_memory_saver=False),
        token_to_kv_pool=MHATokenToKVPool(slots, page_size, dtype, head_num=HKV, head_dim=D, layer_num=LAYERS, device="cpu",
                                          enable_memory_saver=False, enable_alt_stream=False),
        model_config=types.SimpleNamespace(context_len=CTX, get_max_num_attention_heads=lambda: HQ),
        server_args=types.SimpleNamespace(speculative_algorithm=None),
    )


def make_batch(runner, lens, g, fill_pool=True):
    """Requests at random req_to_token rows, their KV on random pages; the
    last position of each is this step's new token (``out_cache_loc``)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    ps = runner.page_size
    pool = runner.token_to_kv_pool
    n_pages = pool.size // ps
    pages = (torch.randperm(n_pages - 1, generator=g) + 1).tolist()
    rows = (torch.randperm(runner.req_to_token_pool.size, generator=g)[: len(lens)] + 1).tolist()
    out_loc = []
    for r, n in zip(rows, lens):
        need = -(-n // ps)
        mine, pages = pages[:need], pages[need:]
        toks = torch.tensor([p * ps + i for p in mine for i in range(ps)][:n], dtype=torch.int32)
        runner.req_to_token_pool.req_to_token[r, :n] = toks
        out_loc.append(int(toks[-1]))
    if fill_pool:
        for layer_id in range(LAYERS):
            for buf in (pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)):
                buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    return types.SimpleNamespace(
        forward_mode=ForwardMode.DECODE, batch_size=len(lens), seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
        seq_lens_sum=int(sum(lens)), req_pool_indices=torch.tensor(rows, dtype=torch.int64),
        out_cache_loc=torch.tensor(out_loc, dtype=torch.int64),
    )


def reference(runner, fb, q, layer):
    """float64 softmax attention of each request's query over its KV rows (after the write)."""
    pool = runner.token_to_kv_pool
    kb, vb = pool.get_key_buffer(layer.layer_id).double(), pool.get_value_buffer(layer.layer_id).double()
    G = HQ // HKV
    out = torch.zeros(fb.batch_size, HQ, D, dtype=torch.float64)
    q3 = q.view(-1, HQ, D).double()
    for b in range(fb.batch_size):
        ids = runner.req_to_token_pool.req_to_token[fb.req_pool_indices[b], : fb.seq_lens[b]].long()
        for h in range(HQ):
            p = torch.softmax(kb[ids, h // G] @ q3[b, h] * layer.scaling, 0)
            out[b, h] = p @ vb[ids, h // G]
    return out.view(fb.batch_size, HQ * D)


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def radix_layer(layer_id):
    from sglang.srt.layers.radix_attention import RadixAttention

    return RadixAttention(num_heads=HQ, head_dim=D, scaling=1.3 * D**-0.5,  # not the kernels default: the layer scale must reach them
                           num_kv_heads=HKV, layer_id=layer_id)


TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def small_calibration():
    """The shipped calibration with kernel configs small enough to split these short requests."""
    import dataclasses

    c = load_calibration()
    return dataclasses.replace(
        c, split=dataclasses.replace(c.split, min_chunk=64, max_splits=4, partial_budget=24),
        compact=dataclasses.replace(c.compact, min_chunk=32, target_items=8, programs=3),
    )


def decode_step(be, runner, fb, g, dtype, layer_id=1):
    """One layer of one decode step through the base ``forward`` dispatch; returns (out, ref)."""
    layer = radix_layer(layer_id)
    bs = fb.batch_size
    q = torch.randn(bs, HQ * D, generator=g).to(dtype)
    k = torch.randn(bs, HKV, D, generator=g).to(dtype)
    v = torch.randn(bs, HKV, D, generator=g).to(dtype)
    ours = getattr(be, "decode_backend", be)  # behind SGLang's HybridAttnBackend, or ours alone
    ours.mid_o.fill_(float("nan"))  # poisoned workspaces: every partial read must have been written
    ours.mid_lse.fill_(float("nan"))
    out = be.forward(q, k, v, layer, fb)
    pool = runner.token_to_kv_pool
    assert torch.equal(pool.get_key_buffer(layer_id)[fb.out_cache_loc], k), "new K not written at out_cache_loc"
    assert torch.equal(pool.get_value_buffer(layer_id)[fb.out_cache_loc], v)
    return out, reference(runner, fb, q, layer)


@pytest.mark.parametrize("path", ["split", "compact"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_eager_decode_matches_float64(path, page_size, dtype):
    seed = int(torch.randint(0, 2**31, ()))
    g = torch.Generator().manual_seed(seed)
    runner = make_runner(page_size, dtype)
    be = backend_mod.PersistentKVAttnBackend(runner, policy=path, calibration=small_calibration())
    fb = make_batch(runner, [1, 37, 300, 16, 129], g)
    be.init_forward_metadata(fb)
    assert be.forward_metadata.path == path
    out, ref = decode_step(be, runner, fb, g, dtype)
    assert out.shape == (5, HQ * D) and not torch.isnan(out).any()
    assert rel_err(out, ref) <= TOL[dtype], f"seed {seed}"


@pytest.mark.parametrize("path", ["split", "compact"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_call_order_replays_other_lengths_on_the_same_buffers(path, page_size):
    """Capture with the runner's fill value (length 1), then two replays of
    other lengths: the metadata tensors keep their addresses and the outputs
    stay correct (what a captured graph relies on)."""
    dtype = torch.bfloat16
    seed = int(torch.randint(0, 2**31, ()))
    g = torch.Generator().manual_seed(seed)
    runner = make_runner(page_size, dtype)
    be = backend_mod.PersistentKVAttnBackend(runner, policy=path, calibration=small_calibration())
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    assert be.get_cuda_graph_seq_len_fill_value() == 1
    capture = make_batch(runner, [1, 1, 1, 1], g)
    be.init_forward_metadata_out_graph(capture, in_capture=True)
    be.init_forward_metadata_in_graph(capture)
    ptrs = (be.forward_metadata.kv_indptr.data_ptr(), be.forward_metadata.kv_indices.data_ptr())
    for lens in ([200, 3, 64, 1], [17, 250, 1, 90]):
        fb = make_batch(runner, lens, g)
        be.init_forward_metadata_out_graph(fb)
        be.init_forward_metadata_in_graph(fb)
        assert (be.forward_metadata.kv_indptr.data_ptr(), be.forward_metadata.kv_indices.data_ptr()) == ptrs
        assert be.graph_path == path
        out, ref = decode_step(be, runner, fb, g, dtype, layer_id=0)
        assert rel_err(out, ref) <= TOL[dtype], f"seed {seed}"


@pytest.mark.parametrize("path", ["split", "compact"])
def test_a_q_with_a_strided_last_dim_is_attended_correctly(path):
    """q as a slice of a wider projection (last-dim stride 2): the backend
    hands the kernels a unit-stride copy, the output matches float64."""
    dtype = torch.float16
    seed = int(torch.randint(0, 2**31, ()))
    g = torch.Generator().manual_seed(seed)
    runner = make_runner(1, dtype)
    be = backend_mod.PersistentKVAttnBackend(runner, policy=path, calibration=small_calibration())
    fb = make_batch(runner, [40, 300, 7], g)
    be.init_forward_metadata(fb)
    layer = radix_layer(1)
    q = torch.randn(3, 2 * HQ * D, generator=g).to(dtype)[:, ::2]
    assert q.stride(-1) == 2
    k, v = (torch.randn(3, HKV, D, generator=g).to(dtype) for _ in range(2))
    out = be.forward(q, k, v, layer, fb)
    assert rel_err(out, reference(runner, fb, q, layer)) <= TOL[dtype], f"seed {seed}"


def test_tensor_cores_off_keeps_flashinfer_out_of_the_policy_for_a_gqa_group_it_has_no_kernel_for(monkeypatch):
    """SGLANG_FLASHINFER_USE_TENSOR_CORE=false and GQA 7 (Qwen2.5-7B's 28/4):
    auto picks between ours only (no FlashInfer delegate is built), and a
    forced flashinfer is refused at construction with the reason."""
    monkeypatch.setenv("SGLANG_FLASHINFER_USE_TENSOR_CORE", "false")
    runner = make_runner(1, torch.float16)
    runner.model_config = types.SimpleNamespace(context_len=CTX, get_max_num_attention_heads=lambda: 7 * HKV)
    be = backend_mod.PersistentKVAttnBackend(runner, policy="auto", calibration=small_calibration())
    assert be.policy.paths == ("split", "compact") and be.flashinfer is None
    assert be.policy.choose([1, 300, 5000]) in ("split", "compact")
    with pytest.raises(ValueError, match="--decode-policy flashinfer cannot run here: FlashInfer's CUDA-core decode .* GQA group 7"):
        backend_mod.PersistentKVAttnBackend(runner, policy="flashinfer", calibration=small_calibration())


def test_idle_and_extend():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    runner = make_runner(1, torch.float16)
    be = backend_mod.PersistentKVAttnBackend(runner, policy="split", calibration=small_calibration())
    idle = types.SimpleNamespace(forward_mode=ForwardMode.IDLE, batch_size=0)
    be.init_forward_metadata(idle)
    q = torch.randn(0, HQ * D).half()
    assert be.forward(q, None, None, radix_layer(0), idle).shape == (0, HQ * D)
    extend = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=1)
    with pytest.raises(NotImplementedError, match="decode-only backend"):
        be.forward(torch.randn(3, HQ * D).half(), None, None, radix_layer(0), extend)
    with pytest.raises(NotImplementedError, match="DECODE/IDLE batches only"):
        be.init_forward_metadata(extend)


@pytest.mark.parametrize("attr,value,message", [
    ("kv_cache_dtype", torch.float8_e4m3fn, "bf16/fp16 KV"),
    ("sliding_window_size", 4096, "sliding-window"),
    ("use_mla_backend", True, "MLA"),
])
def test_unsupported_models_are_refused_at_construction(attr, value, message):
    runner = make_runner(1, torch.float16)
    setattr(runner, attr, value)
    with pytest.raises(ValueError, match=message):
        backend_mod.PersistentKVAttnBackend(runner, policy="split")


def test_registered_in_sglangs_registry_and_choices():
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    from sglang_elastic import attention, plugin

    plugin.load()
    attention.register()  # idempotent
    assert ATTENTION_BACKEND_CHOICES.count("persistentkv") == 1
    assert ATTENTION_BACKENDS["persistentkv"] is attention.create_persistentkv_backend
    from sglang.srt.plugins.hook_registry import HookRegistry

    hooks = [h for _, h, _ in HookRegistry._hooks["sglang.srt.managers.scheduler.Scheduler.get_internal_state"]]
    assert hooks.count(attention.after_internal_state) == 1  # /server_info's persistentkv state, registered once


def test_graph_hooks_capture_one_graph_per_path_and_key_replays_by_the_chosen_path():
    """The AROUND hooks on SGLang's DecodeCudaGraphRunner: capture loops the
    policy's paths (one graph key each), replay keys by the path out_graph chose."""
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.model_executor.runner.shape_key import ShapeKey

    runner = make_runner(1, torch.float16)
    be = backend_mod.PersistentKVAttnBackend(runner, policy="split", calibration=small_calibration())
    # a two-path policy without FlashInfer (which needs CUDA): auto restricted to ours
    be.policy = types.SimpleNamespace(paths=("split", "compact"), choose=lambda lens: "compact" if max(lens) > 100 else "split")
    fake_runner = types.SimpleNamespace(attn_backend=types.SimpleNamespace(decode_backend=be))
    keys = []

    def capture_one_shape(r, size, forward, stream_idx=None, variant_label=None):
        fb = make_batch(runner, [1] * size, torch.Generator().manual_seed(size), fill_pool=False)
        be.init_forward_metadata_out_graph(fb, in_capture=True)
        keys.append(DecodeCudaGraphRunner._make_graph_key(r, size, stream_idx, variant_label))

    backend_mod._capture_one_shape(capture_one_shape, fake_runner, 2, None, None, None)
    assert keys == [ShapeKey(2, None, "persistentkv:split"), ShapeKey(2, None, "persistentkv:compact")]
    be.init_cuda_graph_state(2, 2)
    fb = make_batch(runner, [300, 2], torch.Generator().manual_seed(0), fill_pool=False)
    be.init_forward_metadata_out_graph(fb)
    assert DecodeCudaGraphRunner._make_graph_key(fake_runner, 2, None, None) == ShapeKey(2, None, "persistentkv:compact")
    fb = make_batch(runner, [30, 2], torch.Generator().manual_seed(0), fill_pool=False)
    be.init_forward_metadata_out_graph(fb)
    assert DecodeCudaGraphRunner._make_graph_key(fake_runner, 2, None, None) == ShapeKey(2, None, "persistentkv:split")
    # another backend's runner keeps SGLang's keys
    other = types.SimpleNamespace(attn_backend=object())
    assert DecodeCudaGraphRunner._make_graph_key(other, 2, None, "lora") == ShapeKey(2, None, "lora")


def test_replay_without_a_graph_of_the_chosen_path_replays_the_captured_one():
    """Hooks inactive (one graph per bs): the replayed path is the captured one, never a path without a graph."""
    runner = make_runner(1, torch.float16)
    be = backend_mod.PersistentKVAttnBackend(runner, policy="split", calibration=small_calibration())
    be.policy = types.SimpleNamespace(paths=("split", "compact"), choose=lambda lens: "compact")
    be.init_cuda_graph_state(2, 2)
    g = torch.Generator().manual_seed(1)
    be.init_forward_metadata_out_graph(make_batch(runner, [1, 1], g, fill_pool=False), in_capture=True)  # captures paths[0]
    be.init_forward_metadata_out_graph(make_batch(runner, [300, 2], g, fill_pool=False))
    assert be.graph_path == "split" and be.forward_metadata.path == "split"


def test_the_policy_runs_again_only_when_the_batch_changes_or_grows_by_rechoose_tokens():
    """choose() memoises the cost model's pick: a stable batch growing one token
    per step reuses it for RECHOOSE_TOKENS steps; a new batch size, or a
    request swapped for a much longer one, runs the model again."""
    runner = make_runner(1, torch.float16)
    be = backend_mod.PersistentKVAttnBackend(runner, policy="split", calibration=small_calibration())
    calls = []

    def choose(lens):
        calls.append(list(lens))
        return "compact" if max(lens) > 1000 else "split"

    be.policy = types.SimpleNamespace(paths=("split", "compact"), choose=choose)

    def batch(lens):
        t = torch.tensor(lens, dtype=torch.int64)
        return types.SimpleNamespace(batch_size=len(lens), seq_lens_cpu=t, seq_lens_sum=int(t.sum()))

    base = [64, 96, 128]
    picks = [be.choose(batch([n + step for n in base])) for step in range(64)]
    assert picks == ["split"] * 64
    assert 2 <= len(calls) <= 6  # the model ran when a length crossed a 32-token bucket, not in each of the 64 steps
    assert be.choose(batch([64, 96, 5000])) == "compact" and calls[-1] == [64, 96, 5000]  # swapped request: recomputed
    n = len(calls)
    assert be.choose(batch([64, 96, 128, 1])) == "split" and len(calls) == n + 1  # new batch size: recomputed


def test_the_test_fault_scales_our_softmax_and_bad_values_are_refused(monkeypatch):
    """SGLANG_ELASTIC_TEST_DECODE_FAULT (the e2e check's negative control)
    really changes our kernels' result: it matches the float64 reference at
    the faulted scale, and misses the true one by far more than rounding."""
    assert backend_mod.fault_scale(None) == 1.0 and backend_mod.fault_scale("sm_scale:1.05") == 1.05
    for bad in ("sm_scale", "sm_scale:0", "sm_scale:x", "scale:1.05"):
        with pytest.raises(ValueError, match="expected sm_scale:<positive float>"):
            backend_mod.fault_scale(bad)
    monkeypatch.setenv(backend_mod.FAULT_ENV, "sm_scale:1.5")
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    runner = make_runner(1, torch.float16)
    be = backend_mod.PersistentKVAttnBackend(runner, policy="split", calibration=small_calibration())
    fb = make_batch(runner, [37, 300, 129], g)
    be.init_forward_metadata(fb)
    layer = radix_layer(1)
    q = torch.randn(3, HQ * D, generator=g).to(torch.float16)
    k = torch.randn(3, HKV, D, generator=g).to(torch.float16)
    v = torch.randn(3, HKV, D, generator=g).to(torch.float16)
    out = be.forward(q, k, v, layer, fb)
    true = reference(runner, fb, q, layer)
    layer.scaling *= 1.5
    faulted = reference(runner, fb, q, layer)
    assert rel_err(out, faulted) <= TOL[torch.float16]
    assert rel_err(out, true) > 20 * TOL[torch.float16]


def test_hybrid_attn_backend_routes_decode_to_persistentkv_and_prefill_to_the_other():
    """SGLang's ``HybridAttnBackend`` (what ``--attention-backend X
    --decode-attention-backend persistentkv`` builds) with SGLang's CPU
    ``torch_native`` backend for prefill: DECODE reaches ours (float64-exact,
    the prefill backend's decode never runs), EXTEND reaches torch_native (ours
    refuses EXTEND, so a correct causal output proves the routing), graph
    state and the CPU seq-lens flag come from ours, and the graph hooks find
    ours behind the hybrid."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.attention.hybrid_attn_backend import HybridAttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    dtype = torch.float16
    seed = int(torch.randint(0, 2**31, ()))
    g = torch.Generator().manual_seed(seed)
    runner = make_runner(1, dtype)
    runner.server_args.speculative_attention_mode = "prefill"
    ours = backend_mod.PersistentKVAttnBackend(runner, policy="compact", calibration=small_calibration())
    prefill = ATTENTION_BACKENDS["torch_native"](runner)
    hybrid = HybridAttnBackend(runner, prefill, ours)
    assert hybrid.needs_cpu_seq_lens and backend_mod.find_backend(types.SimpleNamespace(attn_backend=hybrid)) is ours

    def no_decode(*a, **k):
        raise AssertionError("the prefill backend ran a decode")

    prefill.forward_decode = no_decode
    fb = make_batch(runner, [33, 260, 5], g)
    hybrid.init_forward_metadata(fb)
    assert ours.forward_metadata.path == "compact"
    out, ref = decode_step(hybrid, runner, fb, g, dtype)
    assert rel_err(out, ref) <= TOL[dtype], f"seed {seed}"

    # EXTEND: one request, 20 cached tokens then 6 new ones (causal over all 26)
    pre, new = 20, 6
    lens_fb = make_batch(runner, [pre + new], g)
    row = int(lens_fb.req_pool_indices[0])
    slots = runner.req_to_token_pool.req_to_token[row, : pre + new].long()
    ext = types.SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, batch_size=1, req_pool_indices=lens_fb.req_pool_indices, seq_lens=lens_fb.seq_lens,
        seq_lens_cpu=lens_fb.seq_lens_cpu, extend_prefix_lens=torch.tensor([pre]), extend_seq_lens=torch.tensor([new]),
        extend_prefix_lens_cpu=[pre], extend_seq_lens_cpu=[new], encoder_lens=None, out_cache_loc=slots[pre:],
    )
    hybrid.init_forward_metadata(ext)  # ours would refuse an EXTEND batch here
    layer = radix_layer(0)
    q = torch.randn(new, HQ * D, generator=g).to(dtype)
    k = torch.randn(new, HKV, D, generator=g).to(dtype)
    v = torch.randn(new, HKV, D, generator=g).to(dtype)
    out = hybrid.forward(q, k, v, layer, ext)
    pool = runner.token_to_kv_pool
    kb, vb = pool.get_key_buffer(0)[slots].double(), pool.get_value_buffer(0)[slots].double()
    assert torch.equal(pool.get_key_buffer(0)[slots[pre:]], k)
    G = HQ // HKV
    want = torch.zeros(new, HQ, D, dtype=torch.float64)
    for i in range(new):
        for h in range(HQ):
            p = torch.softmax(kb[: pre + i + 1, h // G] @ q.view(new, HQ, D)[i, h].double() * layer.scaling, 0)
            want[i, h] = p @ vb[: pre + i + 1, h // G]
    assert rel_err(out.view(new, HQ * D), want.view(new, HQ * D)) <= TOL[dtype], f"seed {seed}"

    hybrid.init_cuda_graph_state(4, 4)
    assert ours.cuda_graph_kv_indices is not None and hybrid.get_cuda_graph_seq_len_fill_value() == 1


def test_a_path_file_forces_every_step_onto_the_named_path_and_auto_hands_back_to_the_policy(monkeypatch, tmp_path):
    """SGLANG_ELASTIC_DECODE_PATH_FILE (forced-path A/B on one live server): a
    path name forces it from the next read on, ``auto`` and a missing file give
    the policy back, a name the server has no graphs of is ignored (logged);
    the steps per path land in ``state()``, which ``/server_info`` shows."""
    f = tmp_path / "path"
    monkeypatch.setenv(backend_mod.PATH_FILE_ENV, str(f))
    monkeypatch.setattr(backend_mod, "PATH_FILE_POLL_S", 0.0)  # read every step
    runner = make_runner(1, torch.float16)
    be = backend_mod.PersistentKVAttnBackend(runner, policy="split", calibration=small_calibration())
    be.policy = types.SimpleNamespace(paths=("split", "compact"), mode="auto", choose=lambda lens: "compact" if max(lens) > 100 else "split")
    be.init_cuda_graph_state(2, 2)
    g = torch.Generator().manual_seed(3)

    def step(lens):
        be.init_forward_metadata_out_graph(make_batch(runner, lens, g, fill_pool=False))
        return be.graph_path

    assert step([300, 2]) == "compact" and be.forced is None  # no file: the policy
    f.write_text("split\n")
    assert step([300, 2]) == "split" and be.forced == "split"
    f.write_text("flashinfer")  # no graphs of it here: ignored
    assert step([300, 2]) == "compact" and be.forced is None
    f.write_text("auto")
    assert step([30, 2]) == "split" and step([300, 2]) == "compact"
    f.write_text("compact")
    assert step([30, 2]) == "compact"
    f.unlink()
    assert step([30, 2]) == "split"
    st = be.state()
    assert st["steps"] == {"replay:compact": 4, "replay:split": 3} and st["forced"] is None
    assert st["paths"] == ["split", "compact"] and st["policy"] == "auto"
    json.dumps(st)  # /server_info serialises it


def test_the_path_file_is_read_at_most_every_poll_interval_and_a_bad_name_is_logged_once(monkeypatch, tmp_path, caplog):
    f = tmp_path / "path"
    f.write_text("compact")
    monkeypatch.setenv(backend_mod.PATH_FILE_ENV, str(f))
    runner = make_runner(1, torch.float16)
    be = backend_mod.PersistentKVAttnBackend(runner, policy="split", calibration=small_calibration())
    be.policy = types.SimpleNamespace(paths=("split", "compact"), mode="auto", choose=lambda lens: "split")
    now = [100.0]
    monkeypatch.setattr(backend_mod.time, "monotonic", lambda: now[0])
    batch = types.SimpleNamespace(batch_size=2, seq_lens_cpu=torch.tensor([30, 2]), seq_lens_sum=32)
    assert be.choose(batch) == "compact"
    f.write_text("split")
    now[0] += 0.4  # inside the interval: the file is not read again
    assert be.choose(batch) == "compact"
    now[0] += 0.2
    assert be.choose(batch) == "split" and be.forced == "split"
    f.write_text("nope")
    with caplog.at_level("WARNING", logger=backend_mod.__name__):
        for _ in range(3):
            now[0] += 1.0
            assert be.choose(batch) == "split" and be.forced is None  # the policy's pick
    assert sum("names 'nope'" in r.getMessage() for r in caplog.records) == 1


def test_a_forced_path_without_a_graph_for_the_batch_size_keeps_the_online_correction(monkeypatch, tmp_path):
    """Forcing a path the graphs of some batch size lack replays the captured one,
    and leaves auto's online correction on for when the file says auto again."""
    from sglang_elastic.attention.online import OnlineCorrector

    f = tmp_path / "path"
    f.write_text("compact")
    monkeypatch.setenv(backend_mod.PATH_FILE_ENV, str(f))
    monkeypatch.setattr(backend_mod, "PATH_FILE_POLL_S", 0.0)
    runner = make_runner(1, torch.float16)
    be = backend_mod.PersistentKVAttnBackend(runner, policy="split", calibration=small_calibration())
    be.policy = types.SimpleNamespace(paths=("split", "compact"), mode="auto", choose=lambda lens: "split")
    be.online = OnlineCorrector(be.policy.paths)
    be.init_cuda_graph_state(2, 2)
    g = torch.Generator().manual_seed(5)
    be.init_forward_metadata_out_graph(make_batch(runner, [1, 1], g, fill_pool=False), in_capture=True)  # split only for bs 2
    be.init_forward_metadata_out_graph(make_batch(runner, [30, 2], g, fill_pool=False))
    assert be.graph_path == "split" and be.online is not None
    f.write_text("auto")
    be.init_forward_metadata_out_graph(make_batch(runner, [30, 2], g, fill_pool=False))
    assert be.graph_path == "split" and be.online is not None


def test_server_info_shows_the_decode_backends_state_through_the_get_internal_state_hook():
    """The AFTER hook on SGLang's Scheduler.get_internal_state adds ``persistentkv``
    (the backend's state) and leaves a server on another decode backend alone."""
    from sglang.srt.managers.io_struct import GetInternalStateReqOutput

    from sglang_elastic import attention

    runner = make_runner(1, torch.float16)
    be = backend_mod.PersistentKVAttnBackend(runner, policy="split", calibration=small_calibration())
    runner.attn_backend = types.SimpleNamespace(decode_backend=be)  # behind SGLang's HybridAttnBackend
    sched = types.SimpleNamespace(tp_worker=types.SimpleNamespace(model_runner=runner))
    out = attention.after_internal_state(GetInternalStateReqOutput(internal_state={"x": 1}), sched)
    assert out.internal_state["x"] == 1 and out.internal_state["persistentkv"]["paths"] == ["split"]
    assert out.internal_state["persistentkv"]["online"] is None  # a forced policy corrects nothing
    runner.attn_backend = object()
    out = attention.after_internal_state(GetInternalStateReqOutput(internal_state={"x": 1}), sched)
    assert out.internal_state == {"x": 1}
