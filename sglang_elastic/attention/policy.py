"""Adaptive decode policy: per decode batch, FlashInfer, split-KV or the compact work queue.

A roofline cost model over the batch's KV lengths (host-side, from
``ForwardBatch.seq_lens_cpu``, which SGLang already holds on the CPU; no
device read), with constants from a per-GPU calibration JSON written by
``scripts/gpu/bench_decode.py``. For each path the batch becomes the work
items that path would launch (per KV head), and

    t = launch_us + max(total / (r * active), max_item / cta, ceil(n / S) * mean_item / r)
        + merge_bytes / merge_bw

with ``n`` items, ``S = ctas_per_sm * sm_count`` resident items (a wave),
``active = min(n, S)``, per-item read rate ``r = min(cta, bw / active)`` and
``cta = cta_gbps`` (the most one item reads once the others are done):
the three terms are the bandwidth bound, the straggler bound (one long item
alone, FlashInfer's tensor-core plan without split at B > 2 * SMs / Hkv) and
wave quantisation (FA2's ``num_splits_heuristic``). Items per path:

- ``flashinfer``: FlashInfer's tensor-core decode plan (``PrefillSplitQOKVIndptr``
  / ``PrefillBinarySearchKVChunkSize`` in ``flashinfer/.../scheduler.cuh``):
  no split when ``B > 2 * SMs / Hkv``, else the smallest chunk (>= 128 tokens)
  with ``sum(ceil(len / chunk)) <= 2 * SMs / Hkv``;
- ``split``: ``min(max_splits(B), ceil(len / min_chunk))`` chunks per request
  (as :func:`sglang_elastic.kernels.decode_attention.split_kv_plan`);
- ``compact``: one chunk for all, ``max(min_chunk, ceil(sum(len) / target_items))``
  (as ``work_queue_plan``).

The policy picks ours only when predicted ``margin`` faster than FlashInfer
(FlashInfer is the stock path: ties go to it), and, where the calibration
records its fit's rms relative errors (``fit_rms_rel_err``), faster by more
than the two paths' combined error ``hypot(err[ours], err[flashinfer])``; of our
paths that clear their own margin it takes the fastest. A fit whose ``split``
constants err by 7 % predicted a 4 % win on 64 x 8K and 256 x 2K that measured a
5 % loss (``docs/results/decode_h200_repeat_2026-12-04.json.xz``).

Calibration JSON (schema ``version`` 1)::

    {
      "version": 1, "gpu": "NVIDIA H200", "sm_count": 132,
      "provisional": false, "source": "how the numbers were obtained",
      "stream_read_tbps": 4.3,          # measured streaming read (context)
      "merge_tbps": 3.0,                # bandwidth of the partial-output round trip
      "margin": 0.03,                   # ours must be predicted >= 3 % faster than FlashInfer
      "paths": {                         # one entry per path: flashinfer, split, compact
        "split": {"launch_us": 12.0,     # fixed time of the path's launches (graph replay), us
                  "bw_tbps": 3.9,        # KV read bandwidth with the GPU full, TB/s
                  "cta_gbps": 40.0,      # most one work item reads alone, GB/s
                  "ctas_per_sm": 2}, ...},
      "split":   {"max_splits": 64, "min_chunk": 512, "block_n": 32, "partial_budget": 4096,
                  "num_warps": null, "num_stages": null,
                  "pdl": false},             # programmatic dependent launch (optional, default false)
      "compact": {"target_items": 1024, "min_chunk": 256, "programs": null, "block_n": 32,
                  "num_warps": null, "num_stages": null, "pdl": false},
      "shape": {"q_heads": 32, "kv_heads": 8, "head_dim": 128,   # optional: the shape measured
                "dtype": "bfloat16", "page_sizes": [16, 1]},     # (per rank); absent: unknown
      "fit_rms_rel_err": {"flashinfer": 0.045, "split": 0.04, "compact": 0.026}  # optional: the fit's
                                         # rms relative error per path (widens the margin; absent: 0)
    }

A calibration is used only for the shape it was measured on
(:mod:`sglang_elastic.attention.calibration_cache`).

Ideas: FA2/FA3 ``num_splits_heuristic`` (wave efficiency), LeanAttention
(arXiv 2405.10480: equal work per CTA), FlashInfer's planners, the
PersistentKV paper's route cost model (arXiv 2606.26666).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Dict, Iterable, NamedTuple, Optional, Sequence, Tuple

import numpy as np

PATHS = ("flashinfer", "split", "compact")
MODES = ("auto",) + PATHS
SCHEMA_VERSION = 1
CALIBRATION_DIR = Path(__file__).parent / "calibration"
#: Preference order of the calibration files shipped in the package.
SHIPPED = ("h200.json", "h200_provisional.json")


class CalibrationError(ValueError):
    """A calibration file that is missing, malformed or out of range (the message names the field)."""


@dataclasses.dataclass(frozen=True)
class PathCost:
    launch_us: float
    bw_tbps: float
    cta_gbps: float
    ctas_per_sm: int = 2


@dataclasses.dataclass(frozen=True)
class SplitConfig:
    max_splits: int = 64
    min_chunk: int = 512
    block_n: int = 32
    partial_budget: int = 4096  # rows of the mid buffers: max_splits(B) = partial_budget // B
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    pdl: bool = False  # programmatic dependent launch of partials and merge (kernels/decode_attention.py pdl_supported)
    # batch-dependent minimum chunk: batches of large_batch requests or more split no chunk below
    # min_chunk_large tokens (0: off); 2048 at B >= 8 measured -1.4 to -1.7 % on the H200's mixed cases
    # (issue 23): a large batch fills the GPU without small chunks, whose partials only add merge work
    min_chunk_large: int = 2048
    large_batch: int = 8


def split_min_chunk(cfg: SplitConfig, batch: int) -> int:
    """The split path's minimum chunk at this batch size (tokens): ``max(min_chunk, min_chunk_large)``
    for ``batch >= large_batch`` when ``min_chunk_large`` is set, else ``min_chunk``."""
    if cfg.min_chunk_large and batch >= cfg.large_batch:
        return max(cfg.min_chunk, cfg.min_chunk_large)
    return cfg.min_chunk


@dataclasses.dataclass(frozen=True)
class CompactConfig:
    target_items: int = 1024
    min_chunk: int = 256
    programs: Optional[int] = None  # persistent programs per KV head; None: the SM count
    block_n: int = 32
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    pdl: bool = False


@dataclasses.dataclass(frozen=True)
class Calibration:
    gpu: str
    sm_count: int
    paths: Dict[str, PathCost]
    merge_tbps: float = 3.0
    margin: float = 0.03
    stream_read_tbps: Optional[float] = None
    provisional: bool = False
    source: str = ""
    split: SplitConfig = SplitConfig()
    compact: CompactConfig = CompactConfig()
    #: the layer shape the constants were measured on (``None``: unknown, e.g. a prior):
    #: ``{q_heads, kv_heads, head_dim, dtype, page_sizes}`` (:func:`check_shape`)
    shape: Optional[dict] = None
    #: the fit's rms relative error per path (``fit_rms_rel_err``; empty: unknown, e.g. a prior): the
    #: policy wants ours predicted faster than FlashInfer by more than the two paths' combined error
    fit_rms_rel_err: Dict[str, float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        return {"version": SCHEMA_VERSION, **d}


def _num(d: dict, key: str, where: str, kind=float, lo: float = 0.0, hi: float = math.inf, allow_none=False):
    if key not in d:
        raise CalibrationError(f"{where}: missing field {key!r}")
    v = d[key]
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise CalibrationError(f"{where}.{key} must be a{'n integer' if kind is int else ' number'}, not {v!r}")
    if not (lo <= v <= hi) or (kind is float and not math.isfinite(v)):
        raise CalibrationError(f"{where}.{key} = {v!r} is out of range [{lo}, {hi}]")
    return kind(v)


SHAPE_FIELDS = ("q_heads", "kv_heads", "head_dim")
DTYPES = ("bfloat16", "float16")


def check_shape(s, where: str) -> dict:
    """Validate a calibration's ``shape`` object (module docstring).

    Raises:
        CalibrationError: naming the bad field.
    """
    if not isinstance(s, dict):
        raise CalibrationError(f"{where}.shape must be an object")
    out = {k: _num(s, k, f"{where}.shape", kind=int, lo=1, hi=1 << 16) for k in SHAPE_FIELDS}
    if s.get("dtype") not in DTYPES:
        raise CalibrationError(f"{where}.shape.dtype must be one of {', '.join(DTYPES)}, not {s.get('dtype')!r}")
    ps = s.get("page_sizes")
    if not isinstance(ps, list) or not ps or any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in ps):
        raise CalibrationError(f"{where}.shape.page_sizes must be a non-empty list of positive integers, not {ps!r}")
    extra = set(s) - set(SHAPE_FIELDS) - {"dtype", "page_sizes"}
    if extra:
        raise CalibrationError(f"{where}.shape: unknown field(s) {sorted(extra)}")
    return {**out, "dtype": s["dtype"], "page_sizes": [int(p) for p in ps]}


def calibration_from_dict(d: dict, where: str = "calibration") -> Calibration:
    """Validate and build a :class:`Calibration` (schema in the module docstring).

    Raises:
        CalibrationError: naming the first bad field.
    """
    if not isinstance(d, dict):
        raise CalibrationError(f"{where}: top level must be a JSON object")
    if d.get("version") != SCHEMA_VERSION:
        raise CalibrationError(f"{where}: version must be {SCHEMA_VERSION}, not {d.get('version')!r}")
    if not isinstance(d.get("gpu"), str):
        raise CalibrationError(f"{where}: missing field 'gpu' (a string)")
    paths_d = d.get("paths")
    if not isinstance(paths_d, dict):
        raise CalibrationError(f"{where}: missing field 'paths' (an object with {', '.join(PATHS)})")
    unknown = set(paths_d) - set(PATHS)
    if unknown:
        raise CalibrationError(f"{where}.paths: unknown path(s) {sorted(unknown)}; known: {', '.join(PATHS)}")
    paths = {}
    for p in PATHS:
        if p not in paths_d or not isinstance(paths_d[p], dict):
            raise CalibrationError(f"{where}.paths: missing path {p!r}")
        e, w = paths_d[p], f"{where}.paths.{p}"
        paths[p] = PathCost(
            launch_us=_num(e, "launch_us", w, lo=0.0, hi=1e5),
            bw_tbps=_num(e, "bw_tbps", w, lo=1e-3, hi=100.0),
            cta_gbps=_num(e, "cta_gbps", w, lo=1e-3, hi=1e5),
            ctas_per_sm=_num(e, "ctas_per_sm", w, kind=int, lo=1, hi=64),
        )

    def sub(name, cls, ints, opt_ints, zero_ints=()):
        s = d.get(name, {})
        if not isinstance(s, dict):
            raise CalibrationError(f"{where}.{name} must be an object")
        kw = {}
        for k in ints:
            if k in s:
                kw[k] = _num(s, k, f"{where}.{name}", kind=int, lo=1, hi=1 << 24)
        for k in zero_ints:  # 0: off
            if k in s:
                kw[k] = _num(s, k, f"{where}.{name}", kind=int, lo=0, hi=1 << 24)
        for k in opt_ints:
            if k in s:
                kw[k] = _num(s, k, f"{where}.{name}", kind=int, lo=1, hi=1 << 16, allow_none=True)
        if "pdl" in s:
            if not isinstance(s["pdl"], bool):
                raise CalibrationError(f"{where}.{name}.pdl must be true or false, not {s['pdl']!r}")
            kw["pdl"] = s["pdl"]
        extra = set(s) - set(ints) - set(opt_ints) - set(zero_ints) - {"pdl"}
        if extra:
            raise CalibrationError(f"{where}.{name}: unknown field(s) {sorted(extra)}")
        cfg = cls(**kw)
        if cfg.min_chunk % cfg.block_n:
            raise CalibrationError(f"{where}.{name}: min_chunk {cfg.min_chunk} must be a multiple of block_n {cfg.block_n}")
        if getattr(cfg, "min_chunk_large", 0) % cfg.block_n:
            raise CalibrationError(f"{where}.{name}: min_chunk_large {cfg.min_chunk_large} must be a multiple of block_n {cfg.block_n}")
        return cfg

    split = sub("split", SplitConfig, ("max_splits", "min_chunk", "block_n", "partial_budget", "large_batch"),
                ("num_warps", "num_stages"), ("min_chunk_large",))
    compact = sub("compact", CompactConfig, ("target_items", "min_chunk", "block_n"), ("programs", "num_warps", "num_stages"))
    return Calibration(
        gpu=d["gpu"],
        sm_count=_num(d, "sm_count", where, kind=int, lo=1, hi=10000),
        paths=paths,
        merge_tbps=_num(d, "merge_tbps", where, lo=1e-3, hi=100.0),
        margin=_num(d, "margin", where, lo=0.0, hi=0.9),
        stream_read_tbps=_num(d, "stream_read_tbps", where, lo=0.0, hi=100.0, allow_none=True) if "stream_read_tbps" in d else None,
        provisional=bool(d.get("provisional", False)),
        source=str(d.get("source", "")),
        split=split,
        compact=compact,
        shape=check_shape(d["shape"], where) if d.get("shape") is not None else None,
        fit_rms_rel_err=_fit_errors(d.get("fit_rms_rel_err"), where),
    )


def _fit_errors(e, where: str) -> Dict[str, float]:
    if e is None:
        return {}
    if not isinstance(e, dict) or set(e) - set(PATHS):
        raise CalibrationError(f"{where}.fit_rms_rel_err must map paths ({', '.join(PATHS)}) to errors, not {e!r}")
    return {p: _num(e, p, f"{where}.fit_rms_rel_err", lo=0.0, hi=1.0) for p in e}


def load_calibration(path: Optional[os.PathLike] = None) -> Calibration:
    """Read a calibration JSON; ``None``: the first shipped file of :data:`SHIPPED`.

    Raises:
        CalibrationError: the file is missing, not JSON, or fails validation.
    """
    if path is None:
        for name in SHIPPED:
            if (CALIBRATION_DIR / name).is_file():
                path = CALIBRATION_DIR / name
                break
        else:
            raise CalibrationError(f"no calibration file shipped in {CALIBRATION_DIR}")
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise CalibrationError(f"cannot read calibration file {path}: {e}") from None
    except UnicodeDecodeError:
        raise CalibrationError(f"calibration file {path} is not UTF-8 text (a calibration is JSON)") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise CalibrationError(f"calibration file {path} is not JSON: {e}") from None
    return calibration_from_dict(d, where=str(path))


# ---------------------------------------------------------------------------
# work items per path (tokens per item, per KV head)
# ---------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def flashinfer_items(lens: Sequence[int], sm_count: int, kv_heads: int) -> Tuple[list, bool]:
    """Items (tokens) of FlashInfer's tensor-core decode plan and whether it splits."""
    max_bs_if_split = max(1, (2 * sm_count) // kv_heads)
    if len(lens) > max_bs_if_split or not any(n > 0 for n in lens):
        return [int(n) for n in lens if n > 0], False
    max_len = max(lens)
    chunk = _flashinfer_chunk(np.asarray(lens, dtype=np.int64), max_bs_if_split)
    items = [min(chunk, n - i * chunk) for n in lens if n > 0 for i in range(_cdiv(n, chunk))]
    return items, chunk < max_len


def split_max_splits(cfg: SplitConfig, batch: int) -> int:
    """The split path's chunks-per-request cap at this batch size (mid buffers hold ``partial_budget`` rows)."""
    return max(1, min(cfg.max_splits, cfg.partial_budget // max(1, batch)))


def work_queue_rows(cfg: CompactConfig, batch: int) -> int:
    """Workspace rows the compact plan can fill at this batch size
    (``sglang_elastic.kernels.decode_attention.work_queue_capacity``)."""
    return cfg.target_items + batch


def split_items(lens: Sequence[int], cfg: SplitConfig) -> list:
    ms, mc = split_max_splits(cfg, len(lens)), split_min_chunk(cfg, len(lens))
    items = []
    for n in lens:
        if n <= 0:
            continue
        s = min(ms, max(1, _cdiv(n, mc)))
        c = max(cfg.block_n, _cdiv(_cdiv(n, s), cfg.block_n) * cfg.block_n)
        k = _cdiv(n, c)
        items += [c] * (k - 1) + [n - (k - 1) * c]
    return items


def compact_chunk(lens: Sequence[int], cfg: CompactConfig) -> int:
    c = _cdiv(max(1, sum(lens)), cfg.target_items)
    return max(cfg.min_chunk, cfg.block_n, _cdiv(c, cfg.block_n) * cfg.block_n)


def compact_items(lens: Sequence[int], cfg: CompactConfig) -> list:
    c = compact_chunk(lens, cfg)
    items = []
    for n in lens:
        if n > 0:
            k = _cdiv(n, c)
            items += [c] * (k - 1) + [n - (k - 1) * c]
    return items


class ItemStats(NamedTuple):
    """What the cost model needs of a path's work items (per KV head)."""

    count: int
    total: int  # tokens
    largest: int  # tokens of the largest item
    merged: bool  # partial outputs are merged


_NUMPY_FROM = 64  # batch size from which numpy beats Python ints here


def path_stats(path: str, lens, calib: Calibration, kv_heads: int) -> ItemStats:
    """:class:`ItemStats` of ``path`` for these lengths (the per-step cost: Python
    ints for small batches, numpy for large; equal to the statistics of
    :func:`path_items`' lists)."""
    if path not in PATHS:
        raise ValueError(f"unknown decode path {path!r}; known: {', '.join(PATHS)}")
    big = len(lens) >= _NUMPY_FROM
    if big:
        n = np.asarray(lens, dtype=np.int64)
        n = n[n > 0]
        if n.size == 0:
            return ItemStats(0, 0, 0, path != "flashinfer")
        total, longest, count = int(n.sum()), int(n.max()), int(n.size)
    else:
        n = [int(x) for x in lens if x > 0]
        if not n:
            return ItemStats(0, 0, 0, path != "flashinfer")
        total, longest, count = sum(n), max(n), len(n)
    if path == "flashinfer":
        m = max(1, (2 * calib.sm_count) // kv_heads)
        if len(lens) > m:
            return ItemStats(count, total, longest, False)
        chunk = _flashinfer_chunk(n, m)
        return ItemStats(sum(-(-x // chunk) for x in n), total, min(longest, chunk), chunk < longest)
    if path == "compact":
        c = compact_chunk([total], calib.compact)
        k = int((-(-n // c)).sum()) if big else sum(-(-x // c) for x in n)
        return ItemStats(k, total, min(c, longest), True)
    cfg = calib.split
    ms, mc, bn = split_max_splits(cfg, len(lens)), split_min_chunk(cfg, len(lens)), cfg.block_n
    if big:
        sp = np.minimum(ms, np.maximum(1, -(-n // mc)))
        c = np.maximum(bn, -(-(-(-n // sp)) // bn) * bn)
        return ItemStats(int((-(-n // c)).sum()), total, int(np.minimum(n, c).max()), True)
    k = largest = 0
    for x in n:
        sp = min(ms, max(1, -(-x // mc)))
        c = max(bn, -(-(-(-x // sp)) // bn) * bn)
        k += -(-x // c)
        largest = max(largest, min(x, c))
    return ItemStats(k, total, largest, True)


def _flashinfer_chunk(n, max_items: int, step: int = 64) -> int:
    """Smallest chunk (>= 128 tokens, searched in ``step``-token units) with
    ``sum(ceil(n / chunk)) <= max_items`` (FlashInfer's ``PrefillBinarySearchKVChunkSize``;
    ``n`` holds at most ``max_items`` lengths)."""
    n = [int(x) for x in n]
    lo = max(128, -(-sum(n) // max_items)) // step
    hi = max(lo, -(-max(n) // step))
    while lo < hi:
        mid = (lo + hi) // 2
        c = mid * step
        if sum(-(-x // c) for x in n) <= max_items:
            hi = mid
        else:
            lo = mid + 1
    return max(128, lo * step)


def path_items(path: str, lens: Sequence[int], calib: Calibration, kv_heads: int) -> Tuple[list, bool]:
    """``(tokens per item per KV head, merges partials)`` for ``path``."""
    if path == "flashinfer":
        return flashinfer_items(lens, calib.sm_count, kv_heads)
    if path == "split":
        return split_items(lens, calib.split), True
    if path == "compact":
        return compact_items(lens, calib.compact), True
    raise ValueError(f"unknown decode path {path!r}; known: {', '.join(PATHS)}")


def path_time_us(cost: PathCost, stats: ItemStats, *, batch: int, sm_count: int, q_heads: int,
                 kv_heads: int, head_dim: int, dtype_bytes: int, merge_tbps: float) -> float:
    """Predicted microseconds of one layer's decode attention (module docstring)."""
    if stats.count == 0:
        return cost.launch_us
    tok_bytes = 2 * head_dim * dtype_bytes  # K and V of one token of one KV head
    n = stats.count * kv_heads
    total = stats.total * kv_heads * tok_bytes
    slots = cost.ctas_per_sm * sm_count
    active = min(n, slots)
    r = min(cost.cta_gbps * 1e3, cost.bw_tbps * 1e6 / active)  # bytes per us per item
    stream = max(total / (r * active), stats.largest * tok_bytes / (cost.cta_gbps * 1e3), math.ceil(n / slots) * (total / n) / r)
    merge = 0.0
    if stats.merged:
        partial_bytes = stats.count * q_heads * (head_dim + 1) * 4 * 2  # fp32 partial out + lse, written then read
        merge = (partial_bytes + batch * q_heads * head_dim * dtype_bytes) / (merge_tbps * 1e6)
    return cost.launch_us + stream + merge


class DecodePolicy:
    """Chooses the decode path of a batch from its KV lengths (CPU only).

    Args:
        calib: the GPU's :class:`Calibration`.
        q_heads, kv_heads, head_dim: the layer shape (per tensor-parallel rank).
        dtype_bytes: bytes per KV element (2 for bf16/fp16).
        mode: ``auto`` (cost model) or a forced path (``flashinfer``, ``split``, ``compact``).
        unavailable: ``{path: why}`` of paths this server cannot run (e.g.
            FlashInfer's CUDA-core decode for a GQA group it has no kernel for):
            ``auto`` never returns them.

    Raises:
        ValueError: an unknown mode, a forced mode that is unavailable (the
            message says why), or every path unavailable.
    """

    def __init__(self, calib: Calibration, q_heads: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2, mode: str = "auto",
                 unavailable: Optional[Dict[str, str]] = None):
        if mode not in MODES:
            raise ValueError(f"decode policy must be one of {', '.join(MODES)}, not {mode!r}")
        self.unavailable = dict(unavailable or {})
        unknown = set(self.unavailable) - set(PATHS)
        if unknown:
            raise ValueError(f"unknown decode path(s) {sorted(unknown)}; known: {', '.join(PATHS)}")
        if mode in self.unavailable:
            others = [m for m in MODES if m not in self.unavailable and m != mode]
            raise ValueError(f"--decode-policy {mode} cannot run here: {self.unavailable[mode]}; use --decode-policy {' or '.join(others)}")
        if mode == "auto" and set(self.unavailable) >= set(PATHS):
            raise ValueError("no decode path available: " + "; ".join(self.unavailable.values()))
        self.calib, self.mode = calib, mode
        self.q_heads, self.kv_heads, self.head_dim, self.dtype_bytes = q_heads, kv_heads, head_dim, dtype_bytes
        self._paths = tuple(p for p in PATHS if p not in self.unavailable) if mode == "auto" else (mode,)

    @property
    def paths(self) -> Tuple[str, ...]:
        """Paths this policy can return (each gets its own CUDA graph per batch size)."""
        return self._paths

    def predict(self, lens: Iterable[int]) -> Dict[str, float]:
        """Predicted us per layer of every path for these KV lengths."""
        if isinstance(lens, np.ndarray):
            if len(lens) < _NUMPY_FROM:
                lens = lens.tolist()
        else:
            lens = [int(x) for x in lens]
        out = {}
        for p in PATHS:
            out[p] = path_time_us(self.calib.paths[p], path_stats(p, lens, self.calib, self.kv_heads), batch=len(lens), sm_count=self.calib.sm_count,
                                  q_heads=self.q_heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
                                  dtype_bytes=self.dtype_bytes, merge_tbps=self.calib.merge_tbps)
        return out

    def choose(self, lens: Iterable[int]) -> str:
        """The path for a batch with these KV lengths (forced modes return themselves)."""
        if self.mode != "auto":
            return self.mode
        if len(self._paths) == 1:
            return self._paths[0]
        t = self.predict(lens)
        ours = [p for p in ("split", "compact") if p in self._paths]
        if "flashinfer" not in self._paths:
            return min(ours, key=t.get)
        # the fastest of ours that beats FlashInfer by its own margin (a path with a smaller fit error may clear
        # its margin where the fastest prediction does not clear a wider one)
        clear = [p for p in ours if t[p] <= (1.0 - self.margin_for(p)) * t["flashinfer"]]
        return min(clear, key=t.get) if clear else "flashinfer"

    def margin_for(self, path: str) -> float:
        """How much faster than FlashInfer ``path`` must be predicted (fraction): the calibration's
        ``margin``, or the fit's combined relative error of the two paths if larger."""
        e = self.calib.fit_rms_rel_err
        return max(self.calib.margin, math.hypot(e.get(path, 0.0), e.get("flashinfer", 0.0)))
