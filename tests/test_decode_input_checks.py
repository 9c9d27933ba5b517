"""Inputs the decode kernels would read wrongly are refused with a ValueError
naming the tensor, or handled correctly (issue 23, build 7).

Under Triton's interpreter. Every "handled" case is checked against a float64
reference on fresh random inputs; every refusal names the tensor.
"""

from __future__ import annotations

import pytest
import torch

from sglang_elastic.attention.policy import PATHS, Calibration, DecodePolicy, PathCost
from sglang_elastic.kernels.decode_attention import (
    split_kv_decode, split_kv_plan, split_kv_run, work_queue_decode, work_queue_plan, work_queue_run,
)
from test_decode_kernels import make_case, reference

DT = torch.float16


def case(lens=(90, 7, 200), hq=8, hkv=2, d=64, seed=None):
    seed = int(torch.randint(0, 2**31, ())) if seed is None else seed
    return make_case(list(lens), hq, hkv, d, DT, 1, seed=seed)


def both(q, k, v, indptr, idx):
    """Each one-call kernel on these inputs."""
    yield lambda: split_kv_decode(q, k, v, indptr, idx, max_splits=4, min_chunk=64)
    yield lambda: work_queue_decode(q, k, v, indptr, idx, chunk=64, programs=3)


def test_q_head_dim_other_than_kv_is_refused_naming_k_buffer():
    q, k, v, indptr, idx = case()
    q96 = torch.randn(q.shape[0], q.shape[1], 96).to(DT)  # K/V have head_dim 64
    for run in both(q96, k, v, indptr, idx):
        with pytest.raises(ValueError, match=r"k_buffer head_dim 64 differs from q's 96"):
            run()


def test_v_with_another_head_count_or_head_dim_than_k_is_refused_naming_v_buffer():
    q, k, v, indptr, idx = case()
    for bad in (torch.randn(v.shape[0], 1, 64).to(DT), torch.randn(v.shape[0], 2, 32).to(DT)):
        for run in both(q, k, bad, indptr, idx):
            with pytest.raises(ValueError, match=r"^v_buffer must be \[slots, kv_heads, head_dim\] like k_buffer"):
                run()


def test_a_q_whose_last_dim_is_not_unit_stride_is_refused_naming_q():
    q, k, v, indptr, idx = case()
    wide = torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2]).to(DT)
    strided = wide[:, :, ::2]  # head_dim 64 with stride 2: the kernels index the last dim with stride 1
    assert strided.shape == q.shape and strided.stride(-1) == 2
    for run in both(strided, k, v, indptr, idx):
        with pytest.raises(ValueError, match=r"^q must have a unit-stride last dimension \(stride 2"):
            run()
    # the contiguous copy it asks for gives the right answer
    out = split_kv_decode(strided.contiguous(), k, v, indptr, idx, max_splits=4, min_chunk=64)
    ref = reference(strided, k, v, indptr, idx, 64**-0.5)
    assert ((out.double() - ref).norm() / ref.norm()).item() <= 2e-3


def test_strided_out_and_kv_dtype_mismatch_are_refused_naming_the_tensor():
    q, k, v, indptr, idx = case()
    out = torch.empty(q.shape[0], q.shape[1], 2 * q.shape[2], dtype=DT)[:, :, ::2]
    with pytest.raises(ValueError, match=r"^out must have a unit-stride last dimension"):
        split_kv_decode(q, k, v, indptr, idx, out=out)
    with pytest.raises(ValueError, match=r"^k_buffer / v_buffer dtype"):
        split_kv_decode(q, k, v.to(torch.bfloat16), indptr, idx)


def test_split_workspace_smaller_than_batch_times_splits_is_refused_naming_it():
    q, k, v, indptr, idx = case()
    B, Hq, D = q.shape
    chunk, nsplit = split_kv_plan(indptr, 4, 64)
    out = torch.empty_like(q)
    mid_o = torch.empty(B * 4, Hq, D)
    with pytest.raises(ValueError, match=rf"^mid_o holds {B * 4 - 1} rows, this launch needs {B * 4}"):
        split_kv_run(q, k, v, indptr, idx, chunk, nsplit, 4, mid_o[:-1], torch.empty(B * 4, Hq), out)
    with pytest.raises(ValueError, match=rf"^mid_lse holds {B * 4 - 2} rows, this launch needs {B * 4}"):
        split_kv_run(q, k, v, indptr, idx, chunk, nsplit, 4, mid_o, torch.empty(B * 4 - 2, Hq), out)


def test_work_queue_decode_with_fewer_item_rows_than_the_chunk_needs_grows_the_chunk_and_stays_exact():
    """chunk 32 makes 3 + 1 + 7 = 11 items; a 6-row workspace: the plan grows
    the chunk on the GPU until the list fits (no host read), result exact."""
    lens = (90, 7, 200)
    q, k, v, indptr, idx = case(lens)
    ref = reference(q, k, v, indptr, idx, 64**-0.5)
    c, offs, n = work_queue_plan(indptr, chunk=32, capacity=6)
    assert int(offs[-1]) <= 6 and int(c) % 32 == 0 and int(c) > 32
    out = work_queue_decode(q, k, v, indptr, idx, chunk=32, programs=2, max_items=6)
    assert ((out.double() - ref).norm() / ref.norm()).item() <= 2e-3
    # the target-items plan too: target 64 would make 11 items; capacity 5 (> batch 3) is honoured
    c, offs, n = work_queue_plan(indptr, target_items=64, min_chunk=32, capacity=5)
    assert int(offs[-1]) <= 5
    with pytest.raises(ValueError, match="capacity 3 rows cannot hold a work-queue list for 3 requests"):
        work_queue_plan(indptr, chunk=32, capacity=3)


def test_work_queue_run_on_a_list_longer_than_its_workspace_never_reads_past_it():
    """A plan built without ``capacity`` (11 items) run on 6 workspace rows: the
    requests whose items fit are exact, the others come out NaN (visibly
    wrong) although the rows past the workspace hold finite stale partials."""
    lens = (90, 7, 200)  # items at chunk 32: 3, 1, 7 -> request 2's items are rows 4..10
    q, k, v, indptr, idx = case(lens)
    B, Hq, D = q.shape
    chunk, offs, n = work_queue_plan(indptr, chunk=32)
    assert int(offs[-1]) == 11
    big_o, big_lse = torch.randn(16, Hq, D), torch.randn(16, Hq)  # finite stale rows past the view
    out = torch.full_like(q, 7.0)
    work_queue_run(q, k, v, indptr, idx, chunk, offs, n, big_o[:6], big_lse[:6], out, programs=2)
    ref = reference(q, k, v, indptr, idx, 64**-0.5)
    fit = out[:2].double()
    assert ((fit - ref[:2]).norm() / ref[:2].norm()).item() <= 2e-3
    assert torch.isnan(out[2]).all()
    with pytest.raises(ValueError, match=r"^mid_o holds 2 rows, this launch needs 3"):
        work_queue_run(q, k, v, indptr, idx, chunk, offs, n, big_o[:2], big_lse[:6], out, programs=2)


# -- FlashInfer's CUDA-core decode and GQA groups ------------------------------


def _calib(fast_flashinfer: bool) -> Calibration:
    fi = PathCost(launch_us=1.0, bw_tbps=8.0, cta_gbps=400.0) if fast_flashinfer else PathCost(launch_us=10.0, bw_tbps=4.0, cta_gbps=40.0)
    paths = {p: PathCost(launch_us=10.0, bw_tbps=4.0, cta_gbps=40.0) for p in PATHS}
    paths["flashinfer"] = fi
    return Calibration(gpu="test", sm_count=132, paths=paths)


@pytest.mark.parametrize("env,group,usable", [
    ("false", 7, False), ("false", 5, False), ("false", 16, False), ("false", 6, False),
    ("false", 1, True), ("false", 3, True), ("false", 4, True), ("false", 8, True),
    ("true", 7, True), (None, 7, True),  # tensor cores on (SGLang's default for GQA >= 4)
    (None, 3, True),  # SGLang's default for GQA < 4: CUDA cores, which have group 3
])
def test_flashinfer_cuda_core_decode_is_unavailable_exactly_for_groups_outside_its_kernels(monkeypatch, env, group, usable):
    from sglang_elastic.attention.backend import flashinfer_decode_unavailable

    if env is None:
        monkeypatch.delenv("SGLANG_FLASHINFER_USE_TENSOR_CORE", raising=False)
    else:
        monkeypatch.setenv("SGLANG_FLASHINFER_USE_TENSOR_CORE", env)
    why = flashinfer_decode_unavailable(2 * group, 2, torch.bfloat16)
    assert (why is None) == usable
    if not usable:
        assert f"GQA group {group}" in why and "SGLANG_FLASHINFER_USE_TENSOR_CORE=false" in why
    # deterministic inference makes SGLang use tensor cores whatever the variable says
    assert flashinfer_decode_unavailable(2 * group, 2, torch.bfloat16, deterministic=True) is None


def test_the_policy_never_returns_an_unavailable_flashinfer():
    why = {"flashinfer": "no kernel for GQA group 7"}
    shape = dict(q_heads=28, kv_heads=4, head_dim=128)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    fast = DecodePolicy(_calib(True), **shape)
    pol = DecodePolicy(_calib(True), **shape, unavailable=why)
    assert pol.paths == ("split", "compact")
    for _ in range(50):
        lens = torch.randint(1, 1 << 17, (int(torch.randint(1, 257, (), generator=g)),), generator=g).tolist()
        assert fast.choose(lens) == "flashinfer"  # where it were available it would be chosen
        assert pol.choose(lens) in ("split", "compact")
    with pytest.raises(ValueError, match=r"^--decode-policy flashinfer cannot run here: no kernel for GQA group 7; use --decode-policy auto or split or compact"):
        DecodePolicy(_calib(True), **shape, mode="flashinfer", unavailable=why)
    assert DecodePolicy(_calib(True), **shape, mode="split", unavailable=why).paths == ("split",)
