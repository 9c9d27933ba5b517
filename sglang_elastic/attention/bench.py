"""The CPU half of ``scripts/gpu/bench_decode.py``: its cases, rows, result
file and calibration fit (unit-tested here; the script adds the GPU timings).

Result file ``docs/results/decode_h200.json``: the common header
(:func:`sglang_elastic.results.header`: ``date, gpu, commit, command``), then
``stream_read_tbps``, ``shape``, ``notes``, ``calibration`` (where the fitted
file went and its fit error) and ``cases``: one row per (case, page size) with
:data:`ROW_FIELDS`. Times are microseconds per layer (one decode attention
call), CUDA-graph replay, L2 flushed between replays, medians.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import triton
import triton.language as tl

from sglang_elastic.attention.policy import PATHS, DecodePolicy

SHAPE = {"q_heads": 32, "kv_heads": 8, "head_dim": 128}
DTYPE_BYTES = 2  # bf16
PAGE_SIZES = (16, 1)
#: timing columns of a row, and the policy path each one measures (None: a baseline only)
METHODS = {
    "ours_split_us": "split",
    "ours_compact_us": "compact",
    "flashinfer_us": "flashinfer",
    "flashinfer_persistent_us": None,
    "sglang_triton_us": None,
}
ROW_FIELDS = (
    "name", "batch", "lengths_desc", "page_size", "ours_split_us", "ours_compact_us", "policy_pick", "policy_us",
    "flashinfer_us", "flashinfer_persistent_us", "sglang_triton_us", "policy_read_tbps",
    "fa3_us", "read_floor_us", "read_floor_read_flush_us", "read_flush_us", "floor_ratio",
)
#: L2 flushes between timed replays: ``write`` (``triton.testing.do_bench``'s:
#: zeroing a 256 MB buffer, which leaves dirty lines the next kernel's reads
#: wait behind: ~8 us a case on the H200) and ``read`` (a streaming read of the
#: same buffer: clean lines). The ``*_us`` columns are the write flush's (as
#: before); ``read_flush_us`` holds the same columns under the read flush.
FLUSHES = ("write", "read")
#: Optional columns: None where the method did not run (FA3 not installed, a
#: BatchAttention plan refused).
OPTIONAL = ("flashinfer_persistent_us", "fa3_us")


def zipf_lengths(n: int = 32, lo: int = 1024, top: int = 61440, s: float = 1.1) -> List[int]:
    """``lo + top / rank**s`` for ranks 1..n: 62,464 down to 2,368 tokens at the defaults
    (the set of ``scripts/gpu/check_decode.py``)."""
    return [int(lo + top / (r + 1) ** s) for r in range(n)]


def bench_cases() -> List[dict]:
    """The issue's cases: ``{name, lens, lengths_desc}``."""
    K = 1024
    return [
        {"name": "B1_8K", "lens": [8 * K], "lengths_desc": "1 x 8K"},
        {"name": "B1_32K", "lens": [32 * K], "lengths_desc": "1 x 32K"},
        {"name": "B1_128K", "lens": [128 * K], "lengths_desc": "1 x 128K"},
        {"name": "B8_2x64K_6x4K", "lens": [64 * K] * 2 + [4 * K] * 6, "lengths_desc": "2 x 64K + 6 x 4K"},
        {"name": "B8_32K", "lens": [32 * K] * 8, "lengths_desc": "8 x 32K"},
        {"name": "B32_zipf_1K-61K", "lens": zipf_lengths(), "lengths_desc": "32, Zipf: 1024 + 61440 / rank^1.1 (2.4K-61K)"},
        {"name": "B64_8x32K_56x2K", "lens": [32 * K] * 8 + [2 * K] * 56, "lengths_desc": "8 x 32K + 56 x 2K"},
        {"name": "B64_8K", "lens": [8 * K] * 64, "lengths_desc": "64 x 8K"},
        {"name": "B256_2K", "lens": [2 * K] * 256, "lengths_desc": "256 x 2K"},
    ]


def calibration_shape() -> dict:
    """The ``shape`` the fitted calibration records (it is used only for this shape:
    :mod:`sglang_elastic.attention.calibration_cache`)."""
    return {**SHAPE, "dtype": "bfloat16", "page_sizes": list(PAGE_SIZES)}


def kv_bytes(lens: Sequence[int], kv_heads: int = SHAPE["kv_heads"], head_dim: int = SHAPE["head_dim"], dtype_bytes: int = DTYPE_BYTES) -> int:
    """Bytes of K and V one decode step of one layer must read."""
    return int(sum(lens)) * kv_heads * head_dim * 2 * dtype_bytes


def make_row(case: dict, page_size: int, timings: Dict[str, Optional[float]], rel_errs: Dict[str, Optional[float]]) -> dict:
    """A result row before the policy columns (:func:`fill_policy`).

    Raises:
        ValueError: a timing column missing or not positive.
    """
    row = {"name": case["name"], "batch": len(case["lens"]), "lengths_desc": case["lengths_desc"], "page_size": page_size,
           "tokens": int(sum(case["lens"])), "kv_mb": kv_bytes(case["lens"]) / 1e6}
    for col in METHODS:
        us = timings.get(col)
        if us is not None and not us > 0:
            raise ValueError(f"{case['name']} page {page_size}: {col} = {us!r} is not a positive time")
        if us is None and METHODS[col] is not None:
            raise ValueError(f"{case['name']} page {page_size}: {col} is needed (the policy's {METHODS[col]} path)")
        row[col] = us
    row["rel_err_vs_flashinfer"] = dict(rel_errs)
    return row


def fill_policy(rows: List[dict], cases: Dict[str, dict], policy: DecodePolicy, key: str = "policy") -> None:
    """Add ``{key}_pick``, ``{key}_us`` (the measured time of the picked path) and
    ``{key}_read_tbps`` (KV bytes / that time) to each row."""
    col = {p: c for c, p in METHODS.items() if p is not None}
    for r in rows:
        lens = cases[r["name"]]["lens"]
        pick = policy.choose(lens)
        us = r[col[pick]]
        r[f"{key}_pick"] = pick
        r[f"{key}_us"] = us
        r[f"{key}_read_tbps"] = kv_bytes(lens) / (us * 1e-6) / 1e12


def add_flush_columns(row: dict, read_flush: Dict[str, Optional[float]], floors: Dict[str, float],
                      fa3: Optional[Dict[str, Optional[float]]] = None) -> dict:
    """Add the columns of the second flush and the floors to a :func:`make_row` row.

    Args:
        read_flush: the row's timing columns (:data:`METHODS`) measured under the read flush.
        floors: ``{"write": us, "read": us}``: the bare read of the case's K/V bytes under each flush.
        fa3: ``{"write": us, "read": us}`` of FA3's decode, or ``None`` (not installed).

    Sets ``fa3_us`` (write flush), ``read_floor_us`` (write), ``read_floor_read_flush_us``,
    ``read_flush_us`` (``{column: us}`` incl. ``fa3_us``) and ``floor_ratio``
    (``{flush: {column: us / floor}}``: 1.0 is the floor) and returns the row.

    Raises:
        ValueError: a flush or a floor missing, or a time that is not positive.
    """
    where = f"{row['name']} page {row['page_size']}"
    if set(floors) != set(FLUSHES):
        raise ValueError(f"{where}: read floors for {sorted(floors)}, need {list(FLUSHES)}")
    fa3 = fa3 or {}
    rf = {}
    for col in list(METHODS) + ["fa3_us"]:
        us = fa3.get("read") if col == "fa3_us" else read_flush.get(col)
        if us is None and col not in OPTIONAL:
            raise ValueError(f"{where}: {col} under the read flush is needed")
        rf[col] = us
    times = {"write": {c: (fa3.get("write") if c == "fa3_us" else row[c]) for c in rf}, "read": rf}
    for flush, cols in times.items():
        for c, us in list(cols.items()) + [("read floor", floors[flush])]:
            if us is not None and not us > 0:
                raise ValueError(f"{where}: {c} = {us!r} under the {flush} flush is not a positive time")
    row["fa3_us"] = fa3.get("write")
    row["read_floor_us"] = floors["write"]
    row["read_floor_read_flush_us"] = floors["read"]
    row["read_flush_us"] = rf
    row["floor_ratio"] = {f: {c: (us / floors[f] if us is not None else None) for c, us in times[f].items()} for f in FLUSHES}
    return row


def bench_us(fn, flush, *, warmup_ms: float = 10.0, rep_ms: float = 60.0, event=None, synchronize=None) -> float:
    """Median us of ``fn`` with ``flush()`` before every timed run: the loop of
    ``triton.testing.do_bench`` (5 runs to estimate, then ``warmup_ms`` of
    warm-up and ``rep_ms`` of timed runs, each between two events) with the
    flush as an argument, so both flushes are timed by one harness.

    Args:
        event: makes a timing event (default ``torch.cuda.Event(enable_timing=True)``).
        synchronize: waits for the device (default ``torch.cuda.synchronize``).
    """
    if event is None or synchronize is None:
        import torch

        event = event or (lambda: torch.cuda.Event(enable_timing=True))
        synchronize = synchronize or torch.cuda.synchronize
    fn()
    synchronize()
    a, b = event(), event()
    a.record()
    for _ in range(5):
        flush()
        fn()
    b.record()
    synchronize()
    est = max(1e-6, a.elapsed_time(b) / 5)
    n_warm, n_rep = max(1, int(warmup_ms / est)), max(1, int(rep_ms / est))
    for _ in range(n_warm):
        fn()
    ev = [(event(), event()) for _ in range(n_rep)]
    for s, e in ev:
        flush()
        s.record()
        fn()
        e.record()
    synchronize()
    ts = sorted(s.elapsed_time(e) for s, e in ev)
    n = len(ts)
    return 1e3 * (ts[n // 2] if n % 2 else (ts[n // 2 - 1] + ts[n // 2]) / 2)


def fa3_decode():
    """FA3's ``flash_attn_with_kvcache`` from PyPI ``tokenspeed-fa3`` (or any
    FlashAttention-3 install), or ``None`` when it does not import."""
    for mod in ("flash_attn_interface", "flash_attn_3.flash_attn_interface"):
        try:
            m = __import__(mod, fromlist=["flash_attn_with_kvcache"])
            return m.flash_attn_with_kvcache
        except Exception:  # noqa: BLE001 - absent, or a build for another CUDA / torch: no FA3 column
            continue
    return None


def calibration_timings(rows: List[dict], cases: Dict[str, dict]) -> Dict[str, list]:
    """``{path: [(lens, us), ...]}`` over every row, for
    :func:`sglang_elastic.attention.calibrate.fit_calibration`."""
    out: Dict[str, list] = {p: [] for p in PATHS}
    for r in rows:
        for c, p in METHODS.items():
            if p is not None:
                out[p].append((cases[r["name"]]["lens"], r[c]))
    return out


def assemble(header: dict, stream_read_tbps: float, rows: List[dict], notes: dict, calibration: dict) -> dict:
    """The result file; checks every row has :data:`ROW_FIELDS`.

    Raises:
        ValueError: a row lacks a field, or the header lacks one of date/gpu/commit/command.
    """
    for k in ("date", "gpu", "commit", "command"):
        if k not in header:
            raise ValueError(f"result header lacks {k!r}")
    for r in rows:
        missing = [f for f in ROW_FIELDS if f not in r]
        if missing:
            raise ValueError(f"row {r.get('name')} page {r.get('page_size')} lacks {missing}")
    return {**header, "stream_read_tbps": stream_read_tbps,
            "shape": {**SHAPE, "dtype": "bfloat16"}, "notes": notes, "calibration": calibration, "cases": rows}


# -- the streaming-read reference ---------------------------------------------

#: (block, num_warps, programs per SM) tried for the streaming read: the
#: anchors doc's "streaming read" is the best such Triton kernel over 4 GiB
#: (4.53 TB/s on the H200, against 4.27 for ``torch.sum``).
STREAM_CONFIGS = tuple((b, w, p) for b in (2048, 4096, 8192) for w in (4, 8) for p in (2, 4, 8))


@triton.jit
def _stream_read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Program ``p`` sums blocks ``p, p + P, ...`` of ``x`` in fp32 and
    stores its partial sum (the store keeps the loads alive)."""
    pid = tl.program_id(0).to(tl.int64)
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def stream_read(x, out, programs: int, block: int = 4096, num_warps: int = 4):
    """Read every element of the flat tensor ``x`` once (grid-stride, ``programs``
    programs of ``block`` elements a step); ``out``: ``[>= programs]`` float32,
    the per-program sums (``out[:programs].sum()`` is ``x.sum()``). The
    benchmark's streaming-read reference and size-matched read floor.

    Raises:
        ValueError: ``out`` holds fewer than ``programs`` elements.
    """
    if out.numel() < programs:
        raise ValueError(f"out holds {out.numel()} sums, {programs} programs need one each")
    _stream_read_kernel[(programs,)](x, out, x.numel(), BLOCK=block, num_warps=num_warps)
    return out
