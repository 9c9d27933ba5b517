"""Split-KV and work-queue decode kernels vs a float64 reference.

Runs under Triton's interpreter here (small shapes); the large shapes and the
timings are for ``scripts/gpu`` on the H200. Each case draws fresh random
K/V/Q, scatters the requests' KV over random slots (as SGLang's allocator
leaves them), poisons the output, and requires every element written.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang_elastic.kernels.decode_attention import (fused_merge_tile, longest_first, split_kv_decode, split_kv_fused_counters, split_kv_fused_run,
                                                     split_kv_plan, work_queue_decode)

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def reference(q, k, v, indptr, indices, scale):
    """float64 attention of each request's single query over its KV rows."""
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        ids = indices[indptr[b] : indptr[b + 1]].long()
        K, V = k[ids].double(), v[ids].double()
        for h in range(Hq):
            p = torch.softmax((K[:, h // G] @ q[b, h].double()) * scale, 0)
            out[b, h] = p @ V[:, h // G]
    return out


def make_case(lens, hq, hkv, d, dtype, page_size, seed):
    g = torch.Generator().manual_seed(seed)
    total = int(sum(lens))
    slots = (total // page_size + 2 * len(lens) + 4) * page_size
    k = torch.randn(slots, hkv, d, generator=g).to(dtype)
    v = torch.randn(slots, hkv, d, generator=g).to(dtype)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    # page-granular scatter: each request's pages are random pages (page 0 is the padding page)
    pages = (torch.randperm(slots // page_size - 1, generator=g) + 1).tolist()
    idx = []
    for n in lens:
        need = -(-n // page_size)
        mine, pages = pages[:need], pages[need:]
        toks = [p * page_size + i for p in mine for i in range(page_size)][:n]
        idx += toks
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(lens), 0)
    return q, k, v, indptr, torch.tensor(idx, dtype=torch.int32)


CASES = [
    # (name, lens, hq, hkv, d, page_size)
    ("len1", [1], 8, 2, 64, 1),
    ("ragged_page16", [37, 1, 130, 16], 8, 2, 64, 16),
    ("gqa1_mha", [50, 200], 4, 4, 64, 1),
    ("gqa8_d128", [300, 3], 16, 2, 128, 16),
    ("gqa16_d256", [40], 16, 1, 256, 1),
    # Qwen2.5-7B's group (28 / 4): not a power of two, so the fused merge's tile has a masked head row
    ("gqa7_qwen", [300, 90], 14, 2, 64, 1),
    ("one_long_among_1_token", [1, 1, 1500, 1, 1], 8, 2, 64, 16),
]


def fused(q, k, v, indptr, idx, out, max_splits=4, min_chunk=64, block_n=32):
    """One launch (the last chunk merges); the counters must be zero again afterwards."""
    chunk, _ = split_kv_plan(indptr, max_splits, min_chunk, block_n)
    B, Hq, D = q.shape
    mid_o = torch.full((B * max_splits, Hq, D), float("nan"))
    mid_lse = torch.full((B * max_splits, Hq), float("nan"))
    counters = split_kv_fused_counters(B, k.shape[1], q.device)
    split_kv_fused_run(q, k, v, indptr, idx, chunk, max_splits, mid_o, mid_lse, out, counters, block_n=block_n)
    assert not counters.any(), "a counter was left non-zero (the next CUDA-graph replay would merge early)"
    return out


KERNELS = {
    # one launch: partials, the last chunk of each (request, head) merges, single-chunk requests straight to out
    "split_kv_fused": lambda q, k, v, indptr, idx, out: fused(q, k, v, indptr, idx, out),
    "split_kv_fused_many_splits": lambda q, k, v, indptr, idx, out: fused(q, k, v, indptr, idx, out, max_splits=64, min_chunk=32),
    # chunks shorter than most requests and longer than some; 4 splits at most
    "split_kv": lambda q, k, v, indptr, idx, out: split_kv_decode(q, k, v, indptr, idx, max_splits=4, min_chunk=64, out=out),
    # one chunk per request (the split path at batch sizes past its partial budget)
    "split_kv_one_split": lambda q, k, v, indptr, idx, out: split_kv_decode(q, k, v, indptr, idx, max_splits=1, min_chunk=64, out=out),
    # 3 persistent programs per KV head stride over more items than they are
    "work_queue": lambda q, k, v, indptr, idx, out: work_queue_decode(q, k, v, indptr, idx, chunk=64, programs=3, out=out),
    # more partials per request than the merge loads in one step (MERGE_BLOCK_S = 32): 47 for 1,500 tokens
    "split_kv_many_splits": lambda q, k, v, indptr, idx, out: split_kv_decode(q, k, v, indptr, idx, max_splits=64, min_chunk=32, out=out),
    "work_queue_many_items": lambda q, k, v, indptr, idx, out: work_queue_decode(q, k, v, indptr, idx, chunk=32, programs=5, out=out),
    # the shipped tile widths (split 128, queue 64: the H200 calibration), split with int64 offsets and ids
    "split_kv_bn128_int64": lambda q, k, v, indptr, idx, out: split_kv_decode(q, k, v, indptr.long(), idx.long(), max_splits=4, min_chunk=128,
                                                                              block_n=128, out=out),
    "work_queue_bn64": lambda q, k, v, indptr, idx, out: work_queue_decode(q, k, v, indptr, idx, chunk=128, programs=3, block_n=64, out=out),
}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name,lens,hq,hkv,d,page_size", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_float64(name, lens, hq, hkv, d, page_size, dtype, kernel):
    seed = int(torch.randint(0, 2**31, ()))  # fresh inputs each run; printed on failure
    q, k, v, indptr, idx = make_case(lens, hq, hkv, d, dtype, page_size, seed=seed)
    out = torch.full_like(q, float("nan"))
    KERNELS[kernel](q, k, v, indptr, idx, out)
    assert not torch.isnan(out).any(), "an output element was not written"
    ref = reference(q, k, v, indptr, idx, d**-0.5)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err <= TOL[dtype], f"relative error {err:.2e} (seed {seed})"


def test_work_queue_with_a_fixed_item_capacity_needs_no_host_read_and_replays_other_lengths():
    """The capacity passed in fixes every buffer and the grid, so one launch
    shape serves batches of other lengths (what a CUDA graph replays)."""
    for lens in ([100, 5, 33], [7, 190, 64]):
        q, k, v, indptr, idx = make_case(lens, 8, 2, 64, torch.float16, 1, seed=sum(lens))
        out = work_queue_decode(q, k, v, indptr, idx, chunk=64, programs=2, max_items=3 * 4)
        ref = reference(q, k, v, indptr, idx, 64**-0.5)
        assert ((out.double() - ref).norm() / ref.norm()).item() <= 2e-3


def test_group_must_divide():
    q = torch.zeros(1, 6, 64, dtype=torch.float16)
    k = torch.zeros(4, 4, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="not a multiple"):
        split_kv_decode(q, k, k, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32))


def test_pdl_flag_and_launch_option_come_together_and_only_where_supported(monkeypatch):
    """The safety invariant: a PDL launch (``launch_pdl``) only of kernels
    compiled with their ``gdc_wait`` (``PDL``), and neither under the
    interpreter, on CPU tensors or before sm_90."""
    import triton

    from sglang_elastic.kernels import decode_attention as da

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert da._pdl_opts(True, cpu) == {} and not da.pdl_supported(cpu)
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    assert not da.pdl_supported(cpu)  # the device branch, not the interpreter's
    monkeypatch.setattr(da, "_sm_major", lambda index: 9)
    assert da.pdl_supported(gpu) and da._pdl_opts(True, gpu) == {"PDL": True, "launch_pdl": True} and da._pdl_opts(False, gpu) == {}
    monkeypatch.setattr(da, "_sm_major", lambda index: 8)
    assert not da.pdl_supported(gpu) and da._pdl_opts(True, gpu) == {}
    monkeypatch.setattr(triton.knobs.runtime, "interpret", True)
    monkeypatch.setattr(da, "_sm_major", lambda index: 9)
    assert da._pdl_opts(True, gpu) == {}


@pytest.mark.parametrize("kernel", ["split", "queue", "fused", "attend"])
def test_pdl_true_runs_plain_under_the_interpreter_with_the_same_output(kernel):
    seed = int(torch.randint(0, 2**31, ()))
    q, k, v, indptr, idx = make_case([300, 7, 130], 8, 2, 64, torch.float16, 1, seed=seed)
    ref = reference(q, k, v, indptr, idx, 64**-0.5)
    outs = []
    for pdl in (False, True):
        if kernel == "split":
            outs.append(split_kv_decode(q, k, v, indptr, idx, max_splits=4, min_chunk=64, pdl=pdl))
        elif kernel == "queue":
            outs.append(work_queue_decode(q, k, v, indptr, idx, chunk=64, programs=3, pdl=pdl))
        else:  # the KV offload's all-dense step: K and V at two id lists (here the same ids)
            from sglang_elastic.kernels.offload import attend_run

            chunk, nsplit = split_kv_plan(indptr, 4, 64)
            mid_o, mid_lse, o = torch.empty(12, 8, 64), torch.empty(12, 8), torch.empty_like(q)
            if kernel == "fused":
                split_kv_fused_run(q, k, v, indptr, idx, chunk, 4, mid_o, mid_lse, o, split_kv_fused_counters(3, 2, "cpu"), v_indices=idx, pdl=pdl)
            else:
                attend_run(q, k, v, indptr, idx, idx, chunk, nsplit, 4, mid_o, mid_lse, o, pdl=pdl)
            outs.append(o)
        assert ((outs[-1].double() - ref).norm() / ref.norm()).item() <= 2e-3, f"seed {seed}"
    assert torch.equal(outs[0], outs[1])


def _compile_sm90(script: str, tmp_path, *args: str, timeout: int = 600) -> str:
    """Run ``script`` (a compile for sm_90: no GPU needed) in a fresh interpreter without ``TRITON_INTERPRET``, the
    repository root as ``argv[1]`` and ``args`` after it, a Triton cache of its own; its stdout."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")
    out = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parents[1]), *args], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


_PTX_CHECK = r"""
import sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sglang_elastic.kernels import decode_attention as da
from sglang_elastic.kernels import offload as ko

types = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}
types.update({n: "*fp32" for n in ("mid_o_ptr", "mid_lse_ptr", "lse_full_ptr", "extra_ptr")})
types.update({n: "*i32" for n in ("indptr_ptr", "idx_ptr", "chunk_ptr", "item_offsets_ptr", "num_items_ptr", "seg_start_ptr", "seg_count_ptr",
                                  "kidx_ptr", "vidx_ptr", "count_ptr", "order_ptr")})
types["sm_scale"] = "fp32"
attn = dict(G=4, BLOCK_G=16, D=128, BLOCK_D=128, BLOCK_N=128, DOT_F32=False)
for fn, cx in ((da._split_kernel, attn), (da._queue_kernel, {**attn, "LOG2_BATCH": 3}), (da._merge_kernel, dict(D=128, BLOCK_D=128, SEGMENTED=False, BLOCK_S=32, FULL_LSE=False, GUARD_ROWS=False, EXTRA=False)),
               (ko._attend_kernel, attn), (da._split_fused_kernel, {**attn, **dict(zip(("BLOCK_GM", "BLOCK_S"), da.fused_merge_tile(4))), "ORDERED": False, "SEP_V": True})):
    for pdl in (False, True):
        sig = {n: types.get(n, "i32") for n in fn.arg_names if n not in cx and n != "PDL"}
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs={**cx, "PDL": pdl}), target=GPUTarget("cuda", 90, 32), options={"launch_pdl": pdl, "num_warps": 4})
        body = k.asm["ptx"].split(".entry", 1)[1]
        mem = min(i for i in (body.find("ld.global"), body.find("st.global")) if i >= 0)
        wait, trigger = body.find("griddepcontrol.wait"), body.find("griddepcontrol.launch_dependents")
        print(fn.__name__, pdl, k.metadata.launch_pdl, wait >= 0 and wait < mem, trigger >= 0)
"""


def test_pdl_kernels_wait_before_their_first_global_access_in_the_sm90_ptx(tmp_path):
    """Compiled for sm_90 (no GPU needed): with PDL every kernel's
    ``griddepcontrol.wait`` comes before its first global load or store, the
    partials kernels (ours and the KV offload's two-list ``_attend_kernel``)
    trigger the merge, the merge and the one-launch kernel (whose next kernel
    is not ours) trigger nothing, and the launch option is in the compiled
    metadata; without PDL neither appears."""
    rows = [line.split() for line in _compile_sm90(_PTX_CHECK, tmp_path).splitlines()]
    assert rows == [
        ["_split_kernel", "False", "False", "False", "False"], ["_split_kernel", "True", "True", "True", "True"],
        ["_queue_kernel", "False", "False", "False", "False"], ["_queue_kernel", "True", "True", "True", "True"],
        ["_merge_kernel", "False", "False", "False", "False"], ["_merge_kernel", "True", "True", "True", "False"],
        ["_attend_kernel", "False", "False", "False", "False"], ["_attend_kernel", "True", "True", "True", "True"],
        ["_split_fused_kernel", "False", "False", "False", "False"], ["_split_fused_kernel", "True", "True", "True", "False"],
    ]


@pytest.mark.parametrize("kernel", ["split_kv", "work_queue"])
def test_max_batch_256_matches_float64(kernel):
    """SGLang's largest decode CUDA-graph batch (256 requests) in one launch:
    fresh random lengths of 1-70 tokens at page 16 (most not a multiple of the
    page or the chunk), fp16, each request's own rows of the output checked."""
    seed = int(torch.randint(0, 2**31, ()))
    lens = (torch.randint(1, 71, (256,), generator=torch.Generator().manual_seed(seed))).tolist()
    q, k, v, indptr, idx = make_case(lens, 4, 1, 64, torch.float16, 16, seed=seed)
    out = torch.full_like(q, float("nan"))
    KERNELS[kernel](q, k, v, indptr, idx, out)
    assert not torch.isnan(out).any(), f"an output element was not written (seed {seed})"
    ref = reference(q, k, v, indptr, idx, 64**-0.5)
    per_request = ((out.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1))
    assert per_request.max().item() <= TOL[torch.float16], f"worst request {per_request.argmax().item()}: {per_request.max().item():.2e} (seed {seed})"


def test_fused_split_equals_the_two_launch_split_and_replays_with_the_same_counters():
    """The fused kernel against :func:`split_kv_decode` (same plan) on a batch with an
    empty, a one-chunk and several many-chunk requests, twice with one counter buffer
    (a CUDA-graph replay), and its refusals."""
    lens = [0, 40, 700, 1, 257]
    q, k, v, indptr, idx = make_case(lens, 8, 2, 64, torch.float16, 1, seed=int(torch.randint(0, 2**31, ())))
    two = split_kv_decode(q, k, v, indptr, idx, max_splits=8, min_chunk=64)
    chunk, nsplit = split_kv_plan(indptr, 8, 64)
    assert sorted(set(nsplit.tolist())) == [0, 1, 5, 8]  # empty, single-chunk and split requests
    mid_o, mid_lse = torch.empty(len(lens) * 8, 8, 64), torch.empty(len(lens) * 8, 8)
    counters = split_kv_fused_counters(len(lens), 2, "cpu")
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        split_kv_fused_run(q, k, v, indptr, idx, chunk, 8, mid_o, mid_lse, out, counters)
        assert not counters.any() and torch.equal(out[0], torch.zeros_like(out[0]))
        assert torch.allclose(out.float(), two.float(), atol=2e-3, rtol=0)
    ref = reference(q, k, v, indptr, idx, 64 ** -0.5)
    assert ((out.double() - ref).norm() / ref.norm()).item() < TOL[torch.float16]
    # longest requests first: the same output bit for bit (each request's sums do not depend on the launch order)
    order = longest_first(indptr)
    assert order.tolist() == [2, 4, 1, 3, 0] and order.dtype == torch.int32
    first = torch.full_like(q, float("nan"))
    split_kv_fused_run(q, k, v, indptr, idx, chunk, 8, mid_o, mid_lse, first, counters, order=order)
    assert torch.equal(first, out) and not counters.any()
    with pytest.raises(ValueError, match="counters must be int32 with >= batch \\* kv_heads = 10"):
        split_kv_fused_run(q, k, v, indptr, idx, chunk, 8, mid_o, mid_lse, out, torch.zeros(9, dtype=torch.int32))


def test_fused_split_with_v_at_its_own_ids_matches_float64_and_the_offload_two_launch_kernel():
    """``v_indices`` (the KV offload's all-dense step: K at token ids, V at kept rows that are
    other slots): against the float64 reference of the same rows, and against the offload's
    two-launch ``attend_run`` on the same plan, on an empty, a one-chunk (written directly) and
    several-chunk requests, twice with one counter buffer."""
    from sglang_elastic.kernels.offload import attend_run

    lens = [0, 40, 700, 1, 257]
    seed = int(torch.randint(0, 2**31, ()))
    q, k, v, indptr, idx = make_case(lens, 8, 2, 64, torch.float16, 1, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    vrows = torch.randn(3 * k.shape[0], 2, 64, generator=g).to(torch.float16)  # V lives elsewhere, at rows of its own
    vidx = torch.randperm(vrows.shape[0], generator=g)[: idx.numel()].to(torch.int32)
    v_at_k = torch.zeros_like(k)
    v_at_k[idx.long()] = vrows[vidx.long()]  # the same attention with V moved to the K slots: the reference's layout
    ref = reference(q, k, v_at_k, indptr, idx, 64 ** -0.5)
    chunk, nsplit = split_kv_plan(indptr, 8, 64)
    assert sorted(set(nsplit.tolist())) == [0, 1, 5, 8]
    mid_o, mid_lse = torch.empty(len(lens) * 8, 8, 64), torch.empty(len(lens) * 8, 8)
    counters = split_kv_fused_counters(len(lens), 2, "cpu")
    two = attend_run(q, k, vrows, indptr, idx, vidx, chunk, nsplit, 8, mid_o.clone(), mid_lse.clone(), torch.empty_like(q))
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        split_kv_fused_run(q, k, vrows, indptr, idx, chunk, 8, mid_o, mid_lse, out, counters, v_indices=vidx)
        assert not counters.any() and torch.equal(out[0], torch.zeros_like(out[0]))
        assert ((out[1:].double() - ref[1:]).norm() / ref[1:].norm()).item() < TOL[torch.float16], f"seed {seed}"
        assert torch.allclose(out[1:].float(), two[1:].float(), atol=2e-3, rtol=0)
    # the V ids are read: with V at the K ids instead, the output changes
    wrong = torch.empty_like(q)
    split_kv_fused_run(q, k, vrows, indptr, idx, chunk, 8, mid_o, mid_lse, wrong, counters)
    assert not torch.allclose(wrong[1:].float(), out[1:].float(), atol=1e-1)
    # a grid of fewer splits than the plan's chunks: those requests come out NaN and the counters stay at zero,
    # so the next launch with the right grid is exact again
    bad = torch.zeros_like(q)
    split_kv_fused_run(q, k, vrows, indptr, idx, chunk, 4, mid_o, mid_lse, bad, counters, v_indices=vidx)
    assert not counters.any() and torch.isnan(bad[2].float()).all() and torch.isnan(bad[4].float()).all()  # 8 and 5 chunks
    assert torch.equal(bad[1], out[1]) and torch.equal(bad[3], out[3])  # one chunk each: unaffected
    again = torch.empty_like(q)
    split_kv_fused_run(q, k, vrows, indptr, idx, chunk, 8, mid_o, mid_lse, again, counters, v_indices=vidx)
    assert torch.equal(again, out)
    with pytest.raises(ValueError, match="v_indices must match kv_indices"):
        split_kv_fused_run(q, k, vrows, indptr, idx, chunk, 8, mid_o, mid_lse, out, counters, v_indices=vidx.long())


def test_fused_merge_tile_override_matches_float64_and_refuses_a_bad_tile():
    """``merge_tile`` (the benchmark's A/B of the merge's old ``[8, 16, D]`` tile): the old tile and the shipped one
    (Qwen2.5-7B's group of 7: a masked head row) both match the float64 reference on a batch of many-chunk requests;
    a tile narrower than the group or not a power of two is refused before any launch."""
    lens = [700, 257, 1]
    seed = int(torch.randint(0, 2**31, ()))
    q, k, v, indptr, idx = make_case(lens, 14, 2, 64, torch.float16, 1, seed=seed)
    assert fused_merge_tile(7) == (8, 2) and fused_merge_tile(4) == (4, 4) and fused_merge_tile(1) == (1, 16) and fused_merge_tile(16) == (16, 1)
    ref = reference(q, k, v, indptr, idx, 64 ** -0.5)
    chunk, nsplit = split_kv_plan(indptr, 16, 64)
    assert nsplit.tolist() == [11, 5, 1]  # more partials than one merge step of either tile loads
    counters = split_kv_fused_counters(len(lens), 2, "cpu")
    outs = {}
    for tile in (None, (16, 8)):
        out = torch.full_like(q, float("nan"))
        split_kv_fused_run(q, k, v, indptr, idx, chunk, 16, torch.empty(48, 14, 64), torch.empty(48, 14), out, counters, merge_tile=tile)
        assert not counters.any()
        assert ((out.double() - ref).norm() / ref.norm()).item() < TOL[torch.float16], f"tile {tile}, seed {seed}"
        outs[tile] = out
    assert torch.allclose(outs[None].float(), outs[(16, 8)].float(), atol=2e-3, rtol=0)
    for bad in ((4, 2), (8, 3), (6, 2), (8, 0), (8.0, 2), (16, 32)):
        out = torch.full_like(q, float("nan"))
        with pytest.raises(ValueError, match="merge_tile must be two powers of two"):
            split_kv_fused_run(q, k, v, indptr, idx, chunk, 16, torch.empty(48, 14, 64), torch.empty(48, 14), out, counters, merge_tile=bad)
        assert torch.isnan(out.float()).all() and not counters.any()


class _LaunchSpy:
    """Stands in for a ``@triton.jit`` kernel: records each launch's keyword arguments, then launches the kernel."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_the_ab_switches_reach_the_launch(monkeypatch):
    """``merge_tile`` and ``carry_ids`` (the benchmarks' A/B of the kernels before) are what the launch gets: a switch
    validated and then dropped would have the A/B time the shipped kernel twice."""
    from sglang_elastic.kernels import decode_attention as da
    from sglang_elastic.kernels import offload as ko

    q, k, v, indptr, idx = make_case([300, 5], 14, 2, 64, torch.float16, 1, seed=int(torch.randint(0, 2**31, ())))
    chunk, _ = split_kv_plan(indptr, 8, 64)
    spy = _LaunchSpy(da._split_fused_kernel)
    monkeypatch.setattr(da, "_split_fused_kernel", spy)
    for tile, want in ((None, (8, 2)), ((16, 8), (16, 8)), ((8, 1), (8, 1))):
        split_kv_fused_run(q, k, v, indptr, idx, chunk, 8, torch.empty(16, 14, 64), torch.empty(16, 14), torch.empty_like(q),
                           split_kv_fused_counters(2, 2, "cpu"), merge_tile=tile)
        assert (spy.calls[-1]["BLOCK_GM"], spy.calls[-1]["BLOCK_S"]) == want, tile
    sspy = _LaunchSpy(ko._scores_kernel)
    monkeypatch.setattr(ko, "_scores_kernel", sspy)
    for carry in (True, False):
        ko.scores_run(q, k, indptr, idx, chunk, 8, torch.empty(14, 305), torch.empty(16, 14), carry_ids=carry)
        assert sspy.calls[-1]["CARRY_IDS"] is carry


#: the one-launch kernel's argument types, for the sm_90 compiles below (a script run with the repository root as argv[1])
_FUSED_PRELUDE = r"""
import os, subprocess, sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sglang_elastic.kernels import decode_attention as da

fn = da._split_fused_kernel
types = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}
types.update({n: "*fp32" for n in ("mid_o_ptr", "mid_lse_ptr")})
types.update({n: "*i32" for n in ("indptr_ptr", "idx_ptr", "chunk_ptr", "count_ptr", "order_ptr", "vidx_ptr")})
types["sm_scale"] = "fp32"
"""

_FUSED_PTX = _FUSED_PRELUDE + r"""
for tag, extra in (("", dict(ORDERED=True, SEP_V=False)), ("sep_v_", dict(ORDERED=False, SEP_V=True))):
    gm, bs = da.fused_merge_tile(4)
    cx = dict(G=4, BLOCK_G=16, D=128, BLOCK_D=128, BLOCK_N=128, DOT_F32=False, BLOCK_S=bs, BLOCK_GM=gm, **extra)
    sig = {n: types.get(n, "i32") for n in fn.arg_names if n not in cx}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = k.asm["ptx"]
    print(tag + "acq_rel_atomic", any(("atom" in l and ".acq_rel" in l and ".gpu" in l) for l in ptx.splitlines()))
    print(tag + "cg_loads", "ld.global.cg" in ptx)
    print(tag + "bar_sync", "bar.sync" in ptx)
"""


def test_fused_kernel_compiles_for_sm90_with_an_acquire_release_counter_and_l2_loads(tmp_path):
    """The one-launch kernel as the H200 gets it (PTX for sm_90, no GPU
    needed): the arrival counter is an acquire-release atomic at GPU scope
    after a CTA barrier, and the last program reads the partials from L2
    (``ld.global.cg``: other SMs wrote them), which the interpreter cannot show;
    also with V at its own ids (``SEP_V``: the KV offload's all-dense step)."""
    got = dict(line.split() for line in _compile_sm90(_FUSED_PTX, tmp_path).splitlines())
    assert got == {f"{t}{k}": "True" for t in ("", "sep_v_") for k in ("acq_rel_atomic", "cg_loads", "bar_sync")}


_FUSED_REGS = _FUSED_PRELUDE + r"""
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
strides = {"stride_qb", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_mo_s", "stride_mo_h", "stride_ml_s",
           "stride_ob", "stride_oh"}
# (name, group, merge tile or None for the shipped one, launch): the KV offload's all-dense launch (V at its own ids, PDL,
# 3 stages: --kv-offload-dense-launch's default) and the decode engine's one-launch split (ordered, 2 stages: the H100 calibration)
for name, group, tile, extra, stages in (
        ("dense_g4", 4, None, dict(ORDERED=False, SEP_V=True, PDL=True), 3),
        ("dense_g1", 1, None, dict(ORDERED=False, SEP_V=True, PDL=True), 3),
        ("dense_g7", 7, None, dict(ORDERED=False, SEP_V=True, PDL=True), 3),
        ("dense_g16", 16, None, dict(ORDERED=False, SEP_V=True, PDL=True), 3),
        ("split_g4", 4, None, dict(ORDERED=True, SEP_V=False, PDL=False), 2),
        ("dense_g4_old_tile", 4, (16, 8), dict(ORDERED=False, SEP_V=True, PDL=True), 3)):
    gm, bs = tile or da.fused_merge_tile(group)
    cx = dict(G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=128, BLOCK_D=128, BLOCK_N=128, DOT_F32=False,
              BLOCK_S=bs, BLOCK_GM=gm, **extra)
    sig, attrs = {}, {}
    for i, n in enumerate(fn.arg_names):  # aligned pointers and strides, as the JIT specialises SGLang's buffers
        if n in cx:
            continue
        sig[n] = types.get(n, "i32")
        if n in types and n != "sm_scale" or n in strides:
            attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": stages, "launch_pdl": extra["PDL"]})
    path = os.path.join(sys.argv[2], name + ".cubin")
    open(path, "wb").write(k.asm["cubin"])
    usage = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    regs = int(usage.split("REG:")[1].split()[0])
    stack = int(usage.split("STACK:")[1].split()[0])
    print(name, regs, stack)
"""


def test_fused_merge_tile_keeps_three_ctas_an_sm_on_hopper(tmp_path):
    """The one-launch kernel's registers as ptxas allocates them for sm_90 (no GPU needed; Triton's own
    ptxas and cuobjdump): with :func:`fused_merge_tile`'s merge tile, at most 168 a thread for groups 1, 4, 7
    and 16 in the KV offload's all-dense launch and for group 4 in the decode engine's one-launch split, so
    three 4-warp CTAs fit an SM's 65,536 registers (register files are allocated in 8s: 170 would not), and
    nothing spills; the merge's old ``[8, 16, D]`` tile (the attention's dot-padded group) takes two CTAs an SM
    (above 168), which this test tells apart."""
    out = _compile_sm90(_FUSED_REGS, tmp_path, str(tmp_path), timeout=900)
    got = {name: (int(regs), int(stack)) for name, regs, stack in (line.split() for line in out.splitlines())}
    assert set(got) == {"dense_g4", "dense_g1", "dense_g7", "dense_g16", "split_g4", "dense_g4_old_tile"}
    for name, (regs, stack) in got.items():
        if name != "dense_g4_old_tile":
            assert regs <= 168 and stack == 0, (name, regs, stack)
    assert got["dense_g4_old_tile"][0] > 168, got
