"""The decode-step trace summary (``sglang_elastic.eval.steptrace``) on traces built
as CUPTI records them in torch-profiler Chrome traces: ``cudaGraphLaunch`` runtime
records and the kernels of each graph carrying the launch's correlation id."""

from __future__ import annotations

import gzip
import json
import random

import pytest

from sglang_elastic.eval import steptrace


def _kernel(name, ts, dur, corr, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr, "stream": stream}}


def _launch(ts, corr):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 5, "args": {"correlation": corr}}


def _trace(steps, step_us, gap_us, rng):
    """``steps + 1`` graph launches ``step_us + gap_us`` apart. Each step: a GEMM, an attention kernel, a
    kv store on a side stream overlapping the attention by half its length, then a host-launched copy
    (outside the graph) after the graph, then ``gap_us`` with nothing on the GPU. Returns the events and
    the expected per-step (busy, idle, {category: us})."""
    ev, corr = [], 100
    gemm, attn, store, copy = (rng.uniform(100, 200) for _ in range(4))
    body = gemm + attn + copy
    assert body < step_us
    for i in range(steps + 1):
        t = 1000.0 + i * (step_us + gap_us)
        corr += 1
        ev.append(_launch(t - 20, corr))
        ev.append(_kernel("sm90_xmma_gemm_bf16bf16_bf16f32", t, gemm, corr))
        ev.append(_kernel("_attend_kernel", t + gemm, attn, corr))
        ev.append(_kernel("_store_sparse_kernel", t + gemm + attn / 2, store, corr, stream=9))
        ev.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": t + gemm + attn + max(0, store - attn / 2),
                   "dur": copy, "args": {"correlation": 5000 + i}})
        ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": t, "dur": 50})  # CPU work: not GPU time
    # the step's GPU busy time: gemm, then attention and the store overlapping, then the copy
    busy = gemm + max(attn, attn / 2 + store) + copy
    return ev, (busy, step_us + gap_us - busy, {"gemm": gemm, "attention": attn, "kv_store": store, "memcpy_memset": copy})


def test_steps_busy_idle_and_categories_are_exact_on_a_synthetic_graph_trace():
    rng = random.Random(11)
    for _ in range(5):
        steps, step_us, gap = rng.randint(2, 9), rng.uniform(900, 1500), rng.uniform(0, 300)
        ev, (busy, idle, cats) = _trace(steps, step_us, gap, rng)
        rng.shuffle(ev)  # a trace's order is not time order
        s = steptrace.summarize(ev, steps=steps)
        assert s["steps"] == steps and s["graph_launches"] == steps + 1 and s["warnings"] == []
        per = s["per_step_us"]
        assert per["span"] == pytest.approx(step_us + gap, abs=0.01)
        assert per["busy"] == pytest.approx(busy, abs=0.01)
        assert per["idle"] == pytest.approx(idle, abs=0.01)
        assert per["kernels"] == pytest.approx(cats, abs=0.01)
        top = {k["name"]: k for k in s["kernels"]}
        assert top["_attend_kernel"]["count_per_step"] == 1 and top["_attend_kernel"]["category"] == "attention"
        assert top["gpu_memcpy"]["category"] == "memcpy_memset"


def test_compare_names_where_the_second_server_spends_more():
    rng = random.Random(3)
    a_ev, _ = _trace(4, 1000, 0, rng)
    b_ev = [dict(e, dur=e["dur"] + 10) if e.get("name") == "_attend_kernel" else e for e in a_ev]
    a, b = steptrace.summarize(a_ev), steptrace.summarize(b_ev)
    d = steptrace.compare(a, b)
    assert d["kernels"]["attention"] == pytest.approx(10, abs=0.01) and d["kernels"]["gemm"] == 0
    assert d["span"] == 0 and d["idle"] == -d["busy"]


def test_an_eager_trace_is_divided_by_the_steps_given_and_refused_without_them():
    ev = [_kernel("flashinfer::BatchDecodeWithPagedKVCacheKernel", 0, 30, 1), _kernel("rms_norm_kernel", 40, 10, 2),
          _kernel("void at::native::vectorized_elementwise_kernel", 60, 40, 3)]
    s = steptrace.summarize(ev, steps=2)
    assert s["steps"] == 2 and s["graph_launches"] == 0
    assert s["per_step_us"] == {"span": 50.0, "busy": 40.0, "idle": 10.0, "kernels": {"other": 20.0, "attention": 15.0, "norm_rope_act": 5.0}}
    with pytest.raises(ValueError, match="give the steps"):
        steptrace.summarize(ev)
    with pytest.raises(ValueError, match="no GPU kernel"):
        steptrace.summarize([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}], steps=1)


def test_categories_tell_offload_kernels_from_attention_merges():
    assert steptrace.category("_lse_merge_kernel") == "offload_select"
    assert steptrace.category("_merge_kernel") == "attention"
    assert steptrace.category("_row_plan_kernel") == "plan"
    assert steptrace.category("nvjet_tst_128x64_64x4_1x2_h_bz_coopA_NTN") == "gemm"
    assert steptrace.category("something_else") == "other"
    # seen in the H200 profile of 2026-12-05: FlashInfer's norm was counted as attention, the host V writes as selection
    assert steptrace.category("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*)") == "norm_rope_act"
    assert steptrace.category("void flashinfer::BatchPrefillWithPagedKVCacheKernel<flashinfer::KernelTraits<>>") == "attention"
    assert steptrace.category("void flashinfer::PersistentVariableLengthMergeStatesKernel<8u, 16u>") == "attention"
    assert steptrace.category("_copy_rows_kernel") == "offload_copy"
    assert steptrace.category("void (anonymous namespace)::fused_rope_kernel<true, 128l>") == "norm_rope_act"
    assert steptrace.category("_split_fused_kernel") == "attention"


def test_load_reads_gzip_traces_and_refuses_other_json(tmp_path):
    p = tmp_path / "x-TP-0.trace.json.gz"
    ev = [_kernel("_attend_kernel", 0, 5, 1)]
    with gzip.open(p, "wt") as f:
        json.dump({"traceEvents": ev, "deviceProperties": []}, f)
    assert steptrace.load(str(p)) == ev
    q = tmp_path / "bad.json"
    q.write_text(json.dumps({"events": []}))
    with pytest.raises(ValueError, match="not a Chrome trace"):
        steptrace.load(str(q))


def test_a_launch_recorded_twice_counts_once_and_a_step_count_that_disagrees_is_named():
    """A runtime and a driver record of one launch share its correlation id: one step. Two graph
    launches a step (a breakable graph) are counted as launches, and the expected step count
    given by the caller makes the summary say so."""
    rng = random.Random(5)
    ev, (busy, idle, _) = _trace(4, 1000, 100, rng)
    driver = [dict(e, name="cuGraphLaunch", cat="cuda_driver") for e in ev if e.get("name") == "cudaGraphLaunch"]
    s = steptrace.summarize(ev + driver, steps=4)
    assert s["steps"] == 4 and s["warnings"] == [] and s["per_step_us"]["busy"] == pytest.approx(busy, abs=0.01)
    s = steptrace.summarize(ev, steps=2)  # the caller expected 2 whole steps: the 4 found are flagged, not hidden
    assert s["steps"] == 4 and "5 graph launches in the window, 2 steps expected" in s["warnings"][0]


def test_events_crossing_the_window_edges_are_cut_there_in_busy_time_and_categories_alike():
    """A kernel that starts before the first step and runs into it, and one that starts in the
    last step and runs past the window: both count only their microseconds inside it, in busy time
    and in their category, so the categories never add up to more than the window."""
    ev = [_launch(-5, 1), _kernel("_attend_kernel", 0, 600, 1), _launch(995, 2), _kernel("_attend_kernel", 1000, 600, 2),
          _launch(1995, 3), _kernel("_attend_kernel", 2000, 100, 3),
          _kernel("nvjet_gemm", -200, 250, 99),  # 50 us inside the window
          _kernel("nvjet_gemm", 1900, 300, 98)]  # 100 us inside (the window ends at 2000)
    s = steptrace.summarize(ev, steps=2)
    per = s["per_step_us"]
    assert per["span"] == 1000 and per["kernels"] == {"attention": 600.0, "gemm": 75.0}
    assert per["busy"] == pytest.approx((600 + 600 + 100) / 2) and per["idle"] == pytest.approx(1000 - 650)
    assert sum(per["kernels"].values()) <= per["span"]
