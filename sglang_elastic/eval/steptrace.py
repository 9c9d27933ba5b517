"""Where a live server's decode step spends its GPU time, from a torch-profiler trace.

SGLang 0.5.17's ``/start_profile`` (``ProfileReq``: ``num_steps``, ``activities``,
``output_dir``, ``profile_id``; ``sglang/srt/managers/scheduler_components/profiler_manager.py``)
records the next forward steps with ``torch.profiler`` and writes
``{output_dir}/{profile_id}-TP-{rank}.trace.json.gz`` (Chrome trace format, the
same file Perfetto opens). :func:`summarize` reads such a trace and answers
the question a benchmark's median ITL cannot: is a slower step slower on the
GPU (which kernels), or does the GPU wait between kernels (the CPU, the
scheduler, a host sync)?

- **Steps.** A decode step under SGLang's CUDA graphs is one ``cudaGraphLaunch``
  (CUPTI's runtime record; every kernel of the graph carries its correlation
  id). The window runs from the first kernel of the first graph launch to the
  first kernel of the last one: ``launches - 1`` whole steps (SGLang's profiler
  records ``num_steps`` forwards: ``num_steps - 1`` whole steps), with whatever
  else the step launched outside the graph (the scheduler's ``req_to_token``
  writes, metadata copies) in it. A trace without graph launches (eager
  decode) is read whole and divided by the ``steps`` the caller gives.
- **Busy and idle.** ``busy`` is the union of all kernel, memcpy and memset
  intervals over every stream (concurrent streams count once), each cut at the
  window's edges; ``idle`` is the window minus ``busy``: time with nothing
  running on the GPU.
- **Categories.** Kernel time (summed, not unioned) per :data:`CATEGORIES`
  entry, matched on the kernel name in order; the rest is ``other``.

Times are in microseconds (the trace's unit) unless a key says ``_ms``.
"""

from __future__ import annotations

import gzip
import json
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

#: (category, regex on the kernel name), first match wins. ``offload_*`` are this project's KV offload
#: kernels (``sglang_elastic.kernels.offload``); ``attention`` covers FlashInfer's, SGLang's Triton and ours.
CATEGORIES: Tuple[Tuple[str, str], ...] = (
    ("offload_select", r"_scores_kernel|_select_hist|_select_write|_lse_merge|_swap_in|_gather_selected|_estimate_kernel"
                       r"|_chunk_mean|_page_grant|_page_adapt|_page_shrink|_slot_assign|_slot_release"),
    # row copies: a decode step's new V to the host (side stream) and the hot buffers' misses
    ("offload_copy", r"_copy_rows"),
    # before attention: FlashInfer's norms are named flashinfer::norm::...
    ("norm_rope_act", r"rms_?norm|layer_?norm|norm::|silu|gelu|act_and_mul|rotary|rope"),
    ("plan", r"_row_plan|_fixed_entries|create_flashinfer_kv_indices|_plan_kernel|split_kv_plan|longest_first"),
    ("kv_store", r"_store_sparse|store_kv|set_kv_buffer|store_cache|_kv_store"),
    ("attention", r"flashinfer|BatchDecode|BatchPrefill|PrefillWithKVCache|DecodeWithKVCache|_attend_kernel|_split_kernel|_split_fused"
                  r"|_merge_kernel|_queue_kernel|_fwd_kernel|decode_attention|fmha|flash_fwd|xqa"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|matmul|sm90_|sm100_|Kernel2"),
    ("sampling", r"sampl|argmax|softmax|topk|top_k|multinomial"),
)
#: Trace categories of GPU work.
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
#: Runtime / driver calls that launch a CUDA graph.
GRAPH_LAUNCH = ("cudaGraphLaunch", "cuGraphLaunch")


def load(path: str) -> List[dict]:
    """The events of a Chrome trace file (``.json`` or ``.json.gz``).

    Raises:
        ValueError: not a trace (no ``traceEvents`` list).
    """
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    return events


def category(name: str, categories: Sequence[Tuple[str, str]] = CATEGORIES) -> str:
    """The :data:`CATEGORIES` entry of kernel ``name`` (``other`` when none matches)."""
    for cat, rx in categories:
        if re.search(rx, name, re.IGNORECASE):
            return cat
    return "other"


def _union(intervals: Iterable[Tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def summarize(events: List[dict], steps: Optional[int] = None, top: int = 25,
              categories: Sequence[Tuple[str, str]] = CATEGORIES) -> dict:
    """Per-step GPU time of a profiled stretch of decode steps.

    Args:
        events: a trace's events (:func:`load`).
        steps: the whole steps the trace should hold: used when it has no graph launch to count, else
            checked against the launches (a ``warnings`` entry when they differ).
        top: how many kernels to list by total time.

    Returns:
        ``{"steps", "graph_launches", "window_us", "warnings", "per_step_us": {"span", "busy", "idle", "kernels":
        {category: us}}, "kernels": [{"name", "category", "count_per_step", "us_per_step"}...]}``;
        kernel names cut to 160 characters.

    Raises:
        ValueError: the trace holds no GPU work, or neither graph launches nor ``steps``.
    """
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS and "dur" in e]
    if not gpu:
        raise ValueError("the trace holds no GPU kernel, memcpy or memset (was the profile started with GPU activity?)")
    launches = {(e.get("args") or {}).get("correlation") for e in events if e.get("ph") == "X" and e.get("name") in GRAPH_LAUNCH}
    corr_start: Dict[int, float] = {}
    for e in gpu:
        c = (e.get("args") or {}).get("correlation")
        if c is not None:
            corr_start[c] = min(corr_start.get(c, float("inf")), float(e["ts"]))
    # one entry per launch: a runtime and a driver record of one launch share its correlation id
    starts = sorted(corr_start[c] for c in launches if c in corr_start)
    if len(starts) >= 2:
        lo, hi, n = starts[0], starts[-1], len(starts) - 1
    else:
        if not steps:
            raise ValueError("the trace holds fewer than two graph launches: give the steps it covers")
        lo = min(float(e["ts"]) for e in gpu)
        hi = max(float(e["ts"]) + float(e["dur"]) for e in gpu)
        n = steps
    # every event that overlaps the window, cut at its edges (busy time and categories count the same microseconds)
    clipped = [(e, max(float(e["ts"]), lo), min(float(e["ts"]) + float(e["dur"]), hi)) for e in gpu]
    clipped = [(e, a, b) for e, a, b in clipped if b > a]
    window = hi - lo
    busy = _union((a, b) for _, a, b in clipped)
    per_cat: Dict[str, float] = {}
    per_name: Dict[str, list] = {}  # name: [category, count, us]; a name's category is matched once
    for e, a, b in clipped:
        kernel = e.get("cat") == "kernel"
        name = e["name"] if kernel else e.get("cat")
        acc = per_name.get(name)
        if acc is None:
            acc = per_name[name] = [category(name, categories) if kernel else "memcpy_memset", 0, 0.0]
        acc[1] += 1
        acc[2] += b - a
        per_cat[acc[0]] = per_cat.get(acc[0], 0.0) + (b - a)
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][2])[:top]
    out_warn = []
    if len(starts) >= 2 and steps and n != steps:
        out_warn.append(f"{len(starts)} graph launches in the window, {steps} steps expected: a step that is not exactly one graph "
                        "launch (an eager step, a breakable graph) makes the per-step figures wrong")
    return {
        "steps": n, "graph_launches": len(starts), "window_us": round(window, 1), "warnings": out_warn,
        "per_step_us": {"span": round(window / n, 2), "busy": round(busy / n, 2), "idle": round((window - busy) / n, 2),
                        "kernels": {k: round(v / n, 2) for k, v in sorted(per_cat.items(), key=lambda kv: -kv[1])}},
        "kernels": [{"name": k[:160], "category": cat, "count_per_step": round(c / n, 3), "us_per_step": round(t / n, 2)}
                    for k, (cat, c, t) in rows],
    }


def compare(a: dict, b: dict) -> dict:
    """``b`` minus ``a`` per step (two :func:`summarize` results): span, busy, idle and each category, in us."""
    pa, pb = a["per_step_us"], b["per_step_us"]
    cats = sorted(set(pa["kernels"]) | set(pb["kernels"]))
    return {**{k: round(pb[k] - pa[k], 2) for k in ("span", "busy", "idle")},
            "kernels": {c: round(pb["kernels"].get(c, 0.0) - pa["kernels"].get(c, 0.0), 2) for c in cats}}


__all__ = ["CATEGORIES", "category", "compare", "load", "summarize"]
