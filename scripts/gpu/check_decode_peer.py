"""SGLang 0.5.17's own attention test kit against the ``persistentkv`` decode backend
(issue 23, build 6, peer tests).

Usage::

    PYTHONPATH=/tmp/site python3 scripts/gpu/check_decode_peer.py --out peer.json \\
        [--paths split,compact,auto] [--kinds eager,cuda_graph,extend_decode] \\
        [--calibrations serving,fine] [--only SUBSTR[,SUBSTR...]] [--max-seconds 540] [--list]

The kit is ``sglang/test/kits/attention_unittest`` (installed with SGLang): its
dense cases (``attention_methods/dense_attention.py``: ``MockModelRunner``,
projected q/k/v/o modules, the float32 PyTorch reference, the
``contiguous`` / ``shuffled_pages`` / ``interleaved_pages`` /
``non_monotonic_extend`` slot layouts, tolerance ``DENSE_ATOL`` /
``DENSE_RTOL`` = 3e-2 on the projected output) and its CUDA-graph decode
runner (``runner_modes/cuda_graph_decode_runner.py``, which checks the
``forward_metadata`` invariants of ``runner_modes/metadata_invariants.py``).
The kit builds the backend from SGLang's registry,
``ATTENTION_BACKENDS[case.backend](runner)``: cases name ``persistentkv``
(registered by :func:`sglang_elastic.attention.register`), and the policy
reaches it as ``--decode-policy`` does, through ``SGLANG_ELASTIC_CONFIG``
(calibration cache, startup measurement and online correction off, so
every run sees the same calibration). The kit's backend is then wrapped, as
SGLang's own ``unittest/dense/test_hybrid_attn.py`` does with
``replace_backend``, in SGLang's ``HybridAttnBackend``: prefill
(``--prefill-backend``, FlashInfer) for EXTEND, ours for DECODE.

Kinds of case (``kind:kit_case:layout:path:calibration`` names them):

- ``eager``: the kit's ``run_dense_attention_case`` for its decode cases
  (``make_dense_cases``) and the decode case of SGLang's FlashInfer layout
  test, under each layout that changes a decode step; FlashInfer alone on
  the same inputs as a second reference (``vs_flashinfer``, informative).
- ``cuda_graph``: the kit's ``_run_cuda_graph_decode_case`` with the dense
  adapter of ``run_dense_cuda_graph_decode_case`` (capture at batch 4, replay
  of 1-3 live requests padded to 4, replay compared with the reference and
  with eager) on the CUDA-graph cases of SGLang's FlashInfer test (MHA, GQA,
  MQA); layout ``kit_default`` is the kit's own (eager shuffled, replay
  contiguous), ``shuffled_pages`` / ``interleaved_pages`` lay the capture and
  replay batches out so too.
- ``extend_decode``: the kit's extend cases (and SGLang's layout extend
  case) prefill through the hybrid on the prefill backend, which writes
  their KV at the layout's slots, then one decode step on ours over it,
  checked with the kit's reference (the extend tokens become prefix).

Paths: ``split`` and ``compact`` (forced), ``auto`` (the policy; which path
each step ran is in ``paths_run``; for ``cuda_graph`` the capture is
repeated per policy path, as the backend's ``capture_one_shape`` hook does
under SGLang's runner, so replay runs the policy's pick). Calibrations:
``serving`` (what the backend resolves for the shape: shipped or prior;
requests this short fit one chunk) and ``fine`` (split / compact chunks of
16 tokens, so the kit's 1-35-token requests span several chunks and the
merge runs).

Kit limits met (also in the result's ``limitations``): the kit's decode cases
never prefill (prefix KV is written straight into the pool), so
``non_monotonic_extend`` leaves a decode step as ``contiguous`` (SGLang's
tests skip it for decode): that layout runs as ``extend_decode``. The
CUDA-graph runner captures no graph (it calls the capture / replay metadata
hooks and runs eager forwards): real capture and replay are
``scripts/gpu/check_decode_e2e.py``'s. ``assert_cg_metadata_well_formed``
reads ``backend.forward_metadata``, which ``HybridAttnBackend`` lacks (the
check would pass vacuously): the wrapper here shows the decode backend's.
The kit runs without distributed init: the single-rank parallel state its
modules pin at import is pinned up front (:data:`SINGLE_RANK`), or SGLang's
FlashInfer backend could not be built before a ``cuda_graph`` case ran.

Writes ``--out`` (``results.header()`` plus ``settings``, ``summary``,
``limitations``, ``cases``: per case ``name, kind, kit_case, layout, path,
calibration, passed, max_abs_err, max_rel_err, error`` and the checks behind
them), rewritten after each case; exits 1 when a case fails or the
``--max-seconds`` budget left cases unrun; a run that ran no case writes no
file and exits 1 with one line on stderr. No network access.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import importlib.machinery
import json
import os
import sys
import tempfile
import time
import traceback
import types
from typing import Any, Callable, Dict, List, Optional, Sequence

NAME = "persistentkv"
KIT = "sglang.test.kits.attention_unittest"
DENSE_MOD = KIT + ".attention_methods.dense_attention"
RUNNER_MOD = KIT + ".runner_modes.cuda_graph_decode_runner"
INVARIANTS_MOD = KIT + ".runner_modes.metadata_invariants"

#: ``make_loc_fn``'s layouts in SGLang 0.5.17's kit (tests/test_decode_peer.py checks the kit's source still has these).
KIT_LAYOUTS = ("contiguous", "shuffled_pages", "interleaved_pages", "non_monotonic_extend")
#: layouts that change a decode step of the kit's decode cases (``non_monotonic_extend``
#: permutes the one new token there: the same slots as ``contiguous``)
DECODE_LAYOUTS = ("contiguous", "shuffled_pages", "interleaved_pages")
CG_LAYOUTS = ("kit_default", "shuffled_pages", "interleaved_pages")
PATHS = ("split", "compact", "auto")
KINDS = ("eager", "cuda_graph", "extend_decode")
CALIBRATIONS = ("serving", "fine")
#: as SGLang's FlashInfer kit tests: SM90 FlashInfer prefill wants head dim 64/128/256
HEAD_DIM, HIDDEN_SIZE = 64, 256
CG_LOC_SEED = 4049

LIMITATIONS = [
    "The kit's decode cases never prefill: their prefix KV is written straight into the pool (_populate_prefix_kv), "
    "so non_monotonic_extend permutes one new token and equals contiguous for a decode step (SGLang's own tests skip it "
    "for decode); it runs here as extend_decode (prefill on the prefill backend, then a decode step on ours).",
    "The kit's CUDA-graph decode runner records no CUDA graph: it runs init_cuda_graph_state, the capture and replay "
    "metadata hooks and eager forwards, so it checks graph-mode metadata (address-stable buffers, padded replay below "
    "the captured batch size, the seq-len fill value), not graph capture; check_decode_e2e.py covers real graphs.",
    "The runner captures once per batch size; for path auto the capture is repeated per policy path here, as "
    "persistentkv's capture_one_shape hook does under SGLang's DecodeCudaGraphRunner.",
    "assert_cg_metadata_well_formed reads backend.forward_metadata, which HybridAttnBackend lacks (the check would "
    "pass vacuously); the hybrid here exposes the decode backend's.",
    "The kit's tolerance (torch.testing.assert_close, atol = rtol = 3e-2 on the o_proj output) is loose for a "
    "decode kernel: on the CPU our outputs were 1e-4 to 2.5e-4 off, and a softmax scale 1.5x wrong was off by only "
    "0.04-0.07 (caught, barely); read max_abs_err, not only passed.",
    "The kit builds backends with ATTENTION_BACKENDS[case.backend](runner); a decode-only backend serves only its "
    "DECODE cases, so EXTEND goes through SGLang's HybridAttnBackend (replace_backend), as SGLang's test_hybrid_attn.py does.",
]


class KitSkip(Exception):
    """The kit asked to skip (it could not build a backend): a failure of this check."""


class _TestCase:
    """The ``testcase`` the kit's functions take (they call only ``skipTest``)."""

    def skipTest(self, reason):  # noqa: N802 - unittest's name
        raise KitSkip(f"the kit skipped the case: {reason}")


@dataclasses.dataclass(frozen=True)
class PeerCase:
    kind: str
    kit_case: Any  # the kit's DenseAttentionCase (backend persistentkv)
    layout: str
    path: str
    calibration: str

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.kit_case.name}:{self.layout}:{self.path}:{self.calibration}"


@dataclasses.dataclass
class Options:
    device: str = "cuda"
    dtype: Any = None  # torch dtype
    head_dim: int = HEAD_DIM
    hidden_size: int = HIDDEN_SIZE
    prefill_backend: str = "flashinfer"
    peer: str = "flashinfer"  # or "none"
    calibration_files: Dict[str, Optional[str]] = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------- kit


def _kit():
    return importlib.import_module(DENSE_MOD)


def install_stub(name: str) -> None:
    """An importable stand-in for module ``name`` whose every attribute raises when called."""

    class _Stub(types.ModuleType):
        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)

            def _absent(*_a, **_k):
                raise RuntimeError(f"{self.__name__}.{attr} is a stub of check_decode_peer.py ({self.__name__} is not installed)")

            return _absent

    mod = _Stub(name)
    mod.__path__ = []
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    sys.modules[name] = mod


def import_kit_runner(stubs: List[str]):
    """The kit's CUDA-graph decode runner module. It imports every attention
    method of the kit, the dual-chunk one ``sgl_kernel.sparse_flash_attn``;
    where ``sgl_kernel`` (or that module) is absent, a stub that raises when
    called stands in (appended to ``stubs``, recorded in the result)."""
    for _ in range(4):
        try:
            return importlib.import_module(RUNNER_MOD)
        except ModuleNotFoundError as e:
            if not e.name or not (e.name == "sgl_kernel" or e.name.startswith("sgl_kernel.")) or e.name in stubs:
                raise
            install_stub(e.name)
            stubs.append(e.name)
    return importlib.import_module(RUNNER_MOD)


def _case(D, name, mode, heads, kv_heads, page, prefix, extend=()):
    return D.DenseAttentionCase(name=name, backend=NAME, forward_mode=mode, num_heads=heads, num_kv_heads=kv_heads,
                                page_size=page, prefix_lens=prefix, extend_lens=extend)


def kit_cases(D):
    """``(decode, extend, cuda_graph)`` kit cases, backend ``persistentkv``: the
    kit's ``make_dense_cases`` plus the layout and CUDA-graph cases of SGLang's
    own FlashInfer kit test (``test/registered/attention/unittest/dense``)."""
    FM = importlib.import_module("sglang.srt.model_executor.forward_batch_info").ForwardMode
    dense = D.make_dense_cases(NAME)
    decode = [c for c in dense if c.forward_mode.is_decode()]
    decode.append(_case(D, "layout_decode_page_boundary", FM.DECODE, 12, 12, 16, (15, 16, 17)))
    extend = [c for c in dense if c.forward_mode.is_extend() and not c.forward_mode.is_decode()]
    extend.append(_case(D, "layout_extend_two_request_ragged", FM.EXTEND, 12, 12, 16, (8, 16), (8, 16)))
    graph = [
        _case(D, "runner_cuda_graph_decode_page_boundary", FM.DECODE, 4, 4, 16, (14, 15, 16)),
        _case(D, "runner_cuda_graph_gqa_decode_page_boundary", FM.DECODE, 4, 2, 16, (14, 15, 16)),
        _case(D, "runner_cuda_graph_mqa_decode_bsz1", FM.DECODE, 4, 1, 16, (7,)),
    ]
    return decode, extend, graph


def enumerate_cases(D, kinds: Sequence[str] = KINDS, paths: Sequence[str] = PATHS,
                    calibrations: Sequence[str] = CALIBRATIONS) -> List[PeerCase]:
    """Every case, path by path (split, compact, then auto), kind by kind within a path."""
    decode, extend, graph = kit_cases(D)
    per_kind = {
        "eager": [(c, lay) for c in decode for lay in DECODE_LAYOUTS],
        "cuda_graph": [(c, lay) for c in graph for lay in CG_LAYOUTS],
        "extend_decode": [(c, lay) for c in extend for lay in KIT_LAYOUTS],
    }
    out = []
    for path in paths:
        for kind in kinds:
            for c, lay in per_kind[kind]:
                for cal in calibrations:
                    out.append(PeerCase(kind, c, lay, path, cal))
    return out


def select(cases: Sequence[PeerCase], only: Optional[str]) -> List[PeerCase]:
    if not only:
        return list(cases)
    subs = [s for s in only.split(",") if s]
    return [c for c in cases if any(s in c.name for s in subs)]


# --------------------------------------------------------------- calibration


def fine_calibration():
    """The shipped calibration with split / compact chunks of 16 tokens (block 16):
    the kit's 1-35-token requests then span up to 3 chunks (split: up to 4
    per request; compact: about 8 items per batch on 3 programs per KV head)."""
    from sglang_elastic.attention.policy import load_calibration

    c = load_calibration()
    return dataclasses.replace(
        c, shape=None, source="check_decode_peer.py: split/compact chunks of 16 tokens for the kit's short requests",
        split=dataclasses.replace(c.split, max_splits=4, min_chunk=16, block_n=16, partial_budget=64, min_chunk_large=0),
        compact=dataclasses.replace(c.compact, target_items=8, min_chunk=16, block_n=16, programs=3),
    )


def calibration_files(names: Sequence[str], tmpdir: str) -> Dict[str, Optional[str]]:
    files: Dict[str, Optional[str]] = {}
    for n in names:
        if n == "serving":
            files[n] = None
        elif n == "fine":
            p = os.path.join(tmpdir, "fine_calibration.json")
            with open(p, "w") as f:
                json.dump(fine_calibration().to_json(), f)
            files[n] = p
        else:
            raise ValueError(f"unknown calibration {n!r}: one of {', '.join(CALIBRATIONS)}")
    return files


@contextlib.contextmanager
def policy_env(path: str, calibration_file: Optional[str]):
    """``SGLANG_ELASTIC_CONFIG`` as ``--decode-policy PATH [--decode-calibration FILE]`` publishes it."""
    from sglang_elastic.config import ENV, ElasticKVConfig

    cfg = ElasticKVConfig(decode_policy=path, decode_calibration=calibration_file, decode_calibration_cache="off",
                          decode_startup_calibration="off", decode_online="off")
    old = os.environ.get(ENV)
    os.environ[ENV] = cfg.to_env()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


# ------------------------------------------------------------------- metrics


def _finite(x: float) -> Optional[float]:
    return x if x == x and abs(x) != float("inf") else None


def error_metrics(actual, expected, atol: float) -> Dict[str, Any]:
    """``max_abs_err``; ``max_rel_err`` over the elements with ``|expected| >= atol``
    (near-zero references make a relative error meaningless); ``rel_l2_err``;
    ``nonfinite`` (count of NaN / inf outputs; their errors are then ``None``)."""
    import torch

    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        return {"max_abs_err": None, "max_rel_err": None, "rel_l2_err": None, "nonfinite": 0,
                "shape": [list(a.shape), list(e.shape)]}
    d = (a - e).abs()
    big = e.abs() >= atol
    rel = (d[big] / e.abs()[big]).max().item() if bool(big.any()) else 0.0
    norm = e.norm().item()
    return {
        "max_abs_err": _finite(d.max().item()) if d.numel() else 0.0,
        "max_rel_err": _finite(rel),
        "rel_l2_err": _finite((a - e).norm().item() / norm) if norm else None,
        "nonfinite": int((~torch.isfinite(a)).sum().item()),
    }


class Checks:
    """The comparisons of one case, each with the kit's ``torch.testing.assert_close`` verdict."""

    def __init__(self, atol: float, rtol: float):
        self.atol, self.rtol = atol, rtol
        self.items: List[Dict[str, Any]] = []

    def check(self, what: str, actual, expected, ours: bool = True) -> bool:
        import torch

        rec = {"what": what, "ours": ours, **error_metrics(actual, expected, self.atol)}
        try:
            torch.testing.assert_close(actual, expected, atol=self.atol, rtol=self.rtol)
            rec["passed"], rec["error"] = True, None
        except AssertionError as e:
            rec["passed"], rec["error"] = False, str(e)[:2000]
        self.items.append(rec)
        return rec["passed"]


def summarize(name: str, spec_fields: Dict[str, Any], checks: List[Dict[str, Any]], error: Optional[str],
              extra: Dict[str, Any], seconds: float) -> Dict[str, Any]:
    """One case's result: passed when it ran to the end (``error`` None) with every check passed;
    ``max_abs_err`` / ``max_rel_err``: the worst over the checks of our output (``None``: none ran)."""
    ours = [c for c in checks if c.get("ours")]

    def worst(key):
        vals = [c[key] for c in ours if c.get(key) is not None]
        if any(c.get(key) is None and c.get("nonfinite") for c in ours):
            return None
        return max(vals) if vals else None

    failed = next((c for c in checks if not c["passed"]), None)
    if error is None and failed is not None:
        error = f"{failed['what']}: {failed['error']}"
    return {
        "name": name, **spec_fields,
        "passed": error is None and bool(checks),
        "max_abs_err": worst("max_abs_err"), "max_rel_err": worst("max_rel_err"),
        "error": error if error is not None else (None if checks else "no comparison ran"),
        "checks": checks, **extra, "seconds": round(seconds, 3),
    }


# ------------------------------------------------------------------- runners


_HYBRID = None

#: The single-rank parallel state the kit's modules pin at import (``dense_attention``:
#: attn_tp; the CUDA-graph runner's imports ``dsa`` / ``dsv4`` / ``mamba2`` /
#: ``dual_chunk``: attn_cp, tp). Without attn_cp, SGLang's ``FlashInferAttnBackend()``
#: (prefill, peer, ``auto``'s delegate) raises "attention context model parallel group
#: is not initialized" (``get_cuda_graph_max_batch_size``) until a ``cuda_graph`` case
#: has imported the runner: pinned here once, so no case depends on the ones before it.
SINGLE_RANK = dict(tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0, attn_cp_size=1, attn_cp_rank=0)
_SINGLE_RANK_OVERRIDE = None  # entered for the process's life (collecting it would restore the old state)


def pin_single_rank() -> None:
    """Enter :data:`SINGLE_RANK` through SGLang's ``get_parallel().override`` (idempotent)."""
    global _SINGLE_RANK_OVERRIDE
    if _SINGLE_RANK_OVERRIDE is None:
        from sglang.srt.runtime_context import get_parallel

        _SINGLE_RANK_OVERRIDE = get_parallel().override(**SINGLE_RANK)
        _SINGLE_RANK_OVERRIDE.__enter__()


def peer_hybrid_cls():
    """SGLang's ``HybridAttnBackend`` showing its decode backend's ``forward_metadata``
    (the kit's metadata invariants read it; the stock class has none)."""
    global _HYBRID
    if _HYBRID is None:
        from sglang.srt.layers.attention.hybrid_attn_backend import HybridAttnBackend

        class PeerHybridAttnBackend(HybridAttnBackend):
            @property
            def forward_metadata(self):
                return getattr(self.decode_backend, "forward_metadata", None)

        _HYBRID = PeerHybridAttnBackend
    return _HYBRID


class Runner:
    """Runs :class:`PeerCase` s with the kit on ``opts.device``."""

    def __init__(self, opts: Options, stubs: Optional[List[str]] = None):
        import torch

        self.torch = torch
        self.opts = opts
        self.D = _kit()
        pin_single_rank()
        self.stubs = stubs if stubs is not None else []
        self._R = None
        from sglang_elastic import attention

        attention.register()
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

        self.registry = ATTENTION_BACKENDS

    @property
    def R(self):
        if self._R is None:
            self._R = import_kit_runner(self.stubs)
        return self._R

    # -- fixtures

    def kit_kwargs(self) -> Dict[str, Any]:
        o = self.opts
        return dict(head_dim=o.head_dim, hidden_size=o.hidden_size, dtype=o.dtype, device=o.device)

    def build(self, spec: PeerCase, case, **kw):
        """The kit's fixture with ``ATTENTION_BACKENDS["persistentkv"]`` built under ``spec.path``'s
        policy, wrapped in the hybrid (prefill: ``opts.prefill_backend``). Returns (fixture, ours)."""
        from sglang_elastic.attention.backend import PersistentKVAttnBackend

        D = self.D
        with policy_env(spec.path, self.opts.calibration_files.get(spec.calibration)):
            fixture = D.build_dense_attention_fixture(_TestCase(), case, **kw)
        ours = fixture.backend
        if not isinstance(ours, PersistentKVAttnBackend):
            raise TypeError(f"the kit built {type(ours).__name__} for {case.backend!r}, not PersistentKVAttnBackend")
        prefill = self.registry[self.opts.prefill_backend](fixture.runner)
        hybrid = peer_hybrid_cls()(fixture.runner, prefill_backend=prefill, decode_backend=ours)
        return D.replace_backend(fixture, hybrid), ours

    @staticmethod
    def plan(ours) -> Dict[str, Any]:
        """The last step's plan: path, batch and how the split / compact kernels cut it."""
        meta = ours.forward_metadata
        if meta is None:
            return {}
        out = {"path": meta.path, "bs": meta.bs}
        if meta.path == "split":
            out["max_chunks_per_request"] = int(ours.split_nsplit[: meta.bs].max().item())
        elif meta.path == "compact":
            out["items"] = int(ours.queue_item_offsets[meta.bs].item())
            out["chunk"] = int(ours.queue_chunk[0].item())
        return out

    def invariants(self, ours, bs: int) -> None:
        importlib.import_module(INVARIANTS_MOD).assert_cg_metadata_well_formed(ours, bs=bs)

    def peer(self, case, layout: str, ours_out, fixture) -> Dict[str, Any]:
        """FlashInfer alone (the kit's own setup for it) on the same inputs: ours' distance from it."""
        if self.opts.peer == "none":
            return {}
        D = self.D
        try:
            pcase = dataclasses.replace(case, backend=self.opts.peer)
            pf = D.build_dense_attention_fixture(_TestCase(), pcase, loc_layout=layout, **self.kit_kwargs())
            same = self.torch.equal(pf.input_hidden, fixture.input_hidden) and all(
                self.torch.equal(a, b) for a, b in zip(pf.prefix_hidden, fixture.prefix_hidden))
            if not same:
                return {"vs_flashinfer": {"error": "the kit drew other inputs for the peer fixture"}}
            theirs = D.run_dense_fixture_eager(pf)
            ref = D.expected_dense_fixture_output(pf)
            return {"vs_flashinfer": {**error_metrics(ours_out, theirs, D.DENSE_ATOL),
                                      "flashinfer_vs_reference": error_metrics(theirs, ref, D.DENSE_ATOL)["max_abs_err"]}}
        except Exception as e:  # noqa: BLE001 - informative only
            return {"vs_flashinfer": {"error": f"{type(e).__name__}: {str(e)[:500]}"}}

    # -- kinds

    def run_eager(self, spec: PeerCase, checks: Checks, extra: Dict[str, Any]) -> None:
        D = self.D
        fixture, ours = self.build(spec, spec.kit_case, loc_layout=spec.layout, **self.kit_kwargs())
        actual = D.run_dense_fixture_eager(fixture)
        expected = D.expected_dense_fixture_output(fixture)
        extra.update(paths_run=dict(ours.steps), plan=self.plan(ours), calibration_source=ours.calibration_source)
        self.invariants(ours, spec.kit_case.batch_size)
        checks.check("decode vs the kit's reference", actual, expected)
        extra.update(self.peer(spec.kit_case, spec.layout, actual, fixture))

    def decode_step_locs(self, case, layout: str, runner, max_context_len: int):
        """``loc(req, pos)`` of the decode step after ``case``'s extend: the extend's slots
        (as the kit laid them out, checked against ``req_to_token``) and one free slot per
        request for the new token, placed by the same layout."""
        D = self.D
        seed = 2026 + len(case.name) + case.num_kv_heads  # build_dense_attention_fixture's seed
        n = case.seq_lens
        common = dict(batch_size=case.batch_size, prefix_lens=case.prefix_lens, page_size=case.page_size,
                      max_context_len=max_context_len, seed=seed)
        if layout == "non_monotonic_extend":
            base = D.make_loc_fn(layout, seq_lens=n, **common)

            def new(r):  # the request's block, past the extend's permuted slots
                return case.page_size + r * max_context_len + n[r]
        else:
            base = D.make_loc_fn(layout, seq_lens=tuple(s + 1 for s in n), **common)

            def new(r):
                return base(r, n[r])

        def loc(r, pos):
            return base(r, pos) if pos < n[r] else new(r)

        rt = runner.req_to_token_pool.req_to_token
        for r in range(case.batch_size):
            if rt[r, : n[r]].tolist() != [loc(r, p) for p in range(n[r])]:
                raise RuntimeError(f"request {r}: req_to_token is not the kit's {layout} layout (has its seed rule changed?)")
        slots = [loc(r, p) for r in range(case.batch_size) for p in range(n[r] + 1)]
        if len(set(slots)) != len(slots) or max(slots) >= runner.token_to_kv_pool.size + case.page_size:
            raise RuntimeError(f"the decode step's slots collide or leave the pool ({layout})")
        return loc

    def run_extend_decode(self, spec: PeerCase, checks: Checks, extra: Dict[str, Any]) -> None:
        import torch
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        D, o = self.D, self.opts
        ecase = spec.kit_case
        mcl = D.DEFAULT_MAX_CONTEXT_LEN
        fixture, ours = self.build(spec, ecase, loc_layout=spec.layout, max_context_len=mcl, **self.kit_kwargs())
        ext_out = D.run_dense_fixture_eager(fixture)  # EXTEND: the hybrid runs it on the prefill backend
        ext_ref = D.expected_dense_fixture_output(fixture)
        if ours.steps:
            raise AssertionError(f"persistentkv ran during the EXTEND step: {ours.steps}")
        checks.check(f"extend on {o.prefill_backend} (through the hybrid) vs the kit's reference", ext_out, ext_ref, ours=False)

        dcase = D.DenseAttentionCase(name=f"{ecase.name}_then_decode", backend=NAME, forward_mode=ForwardMode.DECODE,
                                     num_heads=ecase.num_heads, num_kv_heads=ecase.num_kv_heads, page_size=ecase.page_size,
                                     prefix_lens=ecase.seq_lens)
        loc = self.decode_step_locs(ecase, spec.layout, fixture.runner, mcl)
        batch = D._make_forward_batch(dcase, fixture.runner, max_context_len=mcl, device=o.device, loc_fn=loc)
        hidden = torch.randn(dcase.batch_size, o.hidden_size, dtype=o.dtype, device=o.device)
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=fixture.backend)):
            fixture.backend.init_forward_metadata(batch)
            out = fixture.actual_module(hidden, batch)
        parts = D._split_by_lens(fixture.input_hidden, ecase.extend_lens)
        prefix = [torch.cat([p, x], dim=0) for p, x in zip(fixture.prefix_hidden, parts)]
        ref = D._dense_attention_reference(fixture.reference_module, dcase, prefix, hidden)
        extra.update(paths_run=dict(ours.steps), plan=self.plan(ours), calibration_source=ours.calibration_source)
        self.invariants(ours, dcase.batch_size)
        checks.check("decode after the extend vs the kit's reference", out, ref)

    def run_cuda_graph(self, spec: PeerCase, checks: Checks, extra: Dict[str, Any]) -> None:
        D, R, o = self.D, self.R, self.opts
        case = spec.kit_case
        mcl = D.DEFAULT_MAX_CONTEXT_LEN
        seen: Dict[str, list] = {"eager": [], "forward": [], "expected": []}
        built: List[tuple] = []

        def build_fixture(testcase, c, **kw):
            graph = not kw.get("disable_cuda_graph", True)
            if spec.layout != "kit_default":
                kw["loc_layout"] = spec.layout
            fixture, ours = self.build(spec, c, **kw)
            if graph and spec.path == "auto":
                capture_every_path(ours)
            built.append((graph, ours))
            return fixture

        def run_eager(fixture):
            out = D.run_dense_fixture_eager(fixture)
            seen["eager"].append(out.detach().clone())
            return out

        def run_forward(fixture, batch, inputs):
            out = D.run_dense_forward(fixture, batch, inputs)
            seen["forward"].append(out.detach().clone())
            return out

        def expected_output(fixture, c, inputs, state):
            out = D.expected_dense_output_from_inputs(fixture, c, inputs, state)
            seen["expected"].append(out.detach().clone())
            return out

        make_batch, prepare = D._make_forward_batch, D.prepare_dense_runner_inputs
        if spec.layout != "kit_default":
            def loc_for(c):
                return D.make_loc_fn(spec.layout, batch_size=c.batch_size, seq_lens=c.seq_lens, prefix_lens=c.prefix_lens,
                                     page_size=c.page_size, max_context_len=mcl, seed=CG_LOC_SEED)

            def make_batch(c, runner, *, max_context_len, device):
                return D._make_forward_batch(c, runner, max_context_len=max_context_len, device=device, loc_fn=loc_for(c))

            def prepare(fixture, c, batch, inputs, *, max_context_len):
                D._populate_prefix_kv(fixture.actual_module, c, fixture.runner, inputs["prefix_hidden"],
                                      max_context_len=max_context_len, loc_fn=loc_for(c))

        adapter = R.CudaGraphDecodeAdapter(
            build_fixture=build_fixture, make_case=D.make_dense_case_with_prefix_lens, make_forward_batch=make_batch,
            fixture_inputs=D.dense_fixture_inputs, make_capture_inputs=D.make_dense_random_inputs,
            make_replay_inputs=D.make_dense_padded_replay_inputs, prepare_inputs=prepare, run_eager=run_eager,
            run_forward=run_forward, expected_output=expected_output, atol=D.DENSE_ATOL, rtol=D.DENSE_RTOL,
        )
        error = None
        try:
            R._run_cuda_graph_decode_case(
                _TestCase(), case, adapter=adapter,
                build_kwargs=dict(head_dim=o.head_dim, hidden_size=o.hidden_size, max_context_len=mcl, dtype=o.dtype, device=o.device),
                capture_batch_size=R.DENSE_CUDA_GRAPH_CAPTURE_BATCH_SIZE, max_context_len=mcl, dtype=o.dtype, device=o.device,
            )
        except KitSkip:
            raise
        except Exception as e:  # noqa: BLE001 - the kit's own assertion: recorded with the numbers below
            error = f"{type(e).__name__}: {str(e)[:2000]}"
            extra["traceback"] = traceback.format_exc()[-4000:]  # where in the kit (or below it) it raised
        n = case.num_input_tokens
        if seen["eager"] and seen["expected"]:
            checks.check("eager decode vs the kit's reference", seen["eager"][0], seen["expected"][0])
        if len(seen["forward"]) >= 2 and len(seen["expected"]) >= 2:
            replay = seen["forward"][-1]
            checks.check(f"graph replay (batch {R.DENSE_CUDA_GRAPH_CAPTURE_BATCH_SIZE}, {n} live) vs the kit's reference",
                         replay, seen["expected"][-1])
            if seen["eager"]:
                checks.check("graph replay (live rows) vs eager", replay[:n], seen["eager"][0])
        graph_be = next((be for g, be in built if g), None)
        if graph_be is not None:
            extra.update(paths_run=dict(graph_be.steps), plan=self.plan(graph_be), calibration_source=graph_be.calibration_source,
                         captured_paths=sorted(graph_be._captured.get(R.DENSE_CUDA_GRAPH_CAPTURE_BATCH_SIZE, ())))
        if error is not None:
            raise _Recorded(error)

    # -- one case

    def run(self, spec: PeerCase) -> Dict[str, Any]:
        D = self.D
        checks = Checks(D.DENSE_ATOL, D.DENSE_RTOL)
        extra: Dict[str, Any] = {}
        error = None
        t0 = time.monotonic()
        try:
            {"eager": self.run_eager, "extend_decode": self.run_extend_decode, "cuda_graph": self.run_cuda_graph}[spec.kind](
                spec, checks, extra)
            if str(self.opts.device).startswith("cuda"):
                self.torch.cuda.synchronize()
        except _Recorded as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - one case's failure is its result
            error = f"{type(e).__name__}: {str(e)[:2000]}"
            extra["traceback"] = traceback.format_exc()[-4000:]
        fields = {"kind": spec.kind, "kit_case": spec.kit_case.name, "layout": spec.layout, "path": spec.path,
                  "calibration": spec.calibration}
        return summarize(spec.name, fields, checks.items, error, extra, time.monotonic() - t0)


class _Recorded(Exception):
    """A failure whose numbers are already in the case's checks."""


def capture_every_path(ours) -> None:
    """What persistentkv's ``capture_one_shape`` hook does under SGLang's runner: the
    capture runs once per policy path (``capturing(path)``), so every batch size has
    each path and replay runs the policy's pick (the kit's runner captures once)."""
    original = ours.init_forward_metadata_out_graph

    def out_graph(forward_batch, in_capture: bool = False):
        if in_capture and len(ours.policy.paths) > 1:
            for p in ours.policy.paths:
                with ours.capturing(p):
                    original(forward_batch, in_capture=True)
            return None
        return original(forward_batch, in_capture=in_capture)

    ours.variant_graphs = True
    ours.init_forward_metadata_out_graph = out_graph


# ---------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="result JSON (required unless --list)")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma list of {', '.join(PATHS)}")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma list of {', '.join(KINDS)}")
    ap.add_argument("--calibrations", default=",".join(CALIBRATIONS), help=f"comma list of {', '.join(CALIBRATIONS)}")
    ap.add_argument("--only", help="run only cases whose name contains one of these comma-separated substrings")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (Triton's interpreter: TRITON_INTERPRET=1)")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"), help="the kit's default: float16")
    ap.add_argument("--head-dim", type=int, default=HEAD_DIM)
    ap.add_argument("--hidden-size", type=int, default=HIDDEN_SIZE)
    ap.add_argument("--prefill-backend", default="flashinfer", help="the hybrid's prefill backend (torch_native on a CPU)")
    ap.add_argument("--peer", default="flashinfer", help="second reference run alone on eager cases (none: off)")
    ap.add_argument("--max-seconds", type=float, default=540.0, help="start no case once this many seconds have passed since the script started (0: no limit)")
    ap.add_argument("--list", action="store_true", help="print the selected cases' names and exit")
    a = ap.parse_args(argv)
    for flag, allowed in (("paths", PATHS), ("kinds", KINDS), ("calibrations", CALIBRATIONS)):
        vals = [v for v in getattr(a, flag).split(",") if v]
        bad = [v for v in vals if v not in allowed]
        if bad or not vals:
            ap.error(f"--{flag.replace('_', '-')}: {bad or 'empty'}; choose from {', '.join(allowed)}")
        setattr(a, flag, vals)
    if not a.list and not a.out:
        ap.error("--out is required")
    return a


def finish(out: str, doc: Dict[str, Any], results_list: List[Dict[str, Any]], not_run: List[str]) -> int:
    """Write the result (nothing when no case ran) and return the exit status."""
    from sglang_elastic import results

    if not results_list:
        print("check_decode_peer: ran no case" + (f" ({len(not_run)} selected, none started)" if not_run else ""), file=sys.stderr)
        return 1
    failed = [r["name"] for r in results_list if not r["passed"]]
    doc["summary"] = {"cases": len(results_list), "passed": len(results_list) - len(failed), "failed": len(failed),
                      "failed_names": failed, "not_run": len(not_run), "complete": not not_run}
    doc["not_run"] = not_run
    doc["cases"] = results_list
    results.write(out, doc)
    return 1 if failed or not_run else 0


def main(argv=None, *, runner_factory: Optional[Callable[[Options, List[str]], Any]] = None,
         cases: Optional[List[PeerCase]] = None) -> int:
    """Run the selected cases; ``runner_factory`` / ``cases`` stand in for the kit in tests."""
    t0 = time.monotonic()  # --max-seconds counts from here: importing the kit and building the runner take time too
    a = parse_args(argv)
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is imported
    if cases is None:
        cases = select(enumerate_cases(_kit(), a.kinds, a.paths, a.calibrations), a.only)
    else:
        cases = select(cases, a.only)
    if a.list:
        for c in cases:
            print(c.name)
        return 0
    if not cases:
        print("check_decode_peer: ran no case: no case matches the selection", file=sys.stderr)
        return 1
    import torch

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("check_decode_peer: ran no case: CUDA is not available (--device cpu runs under Triton's interpreter)", file=sys.stderr)
        return 1
    from sglang_elastic import results

    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)  # not a crash after the first case
    tmp = tempfile.TemporaryDirectory(prefix="check_decode_peer-")
    opts = Options(device=a.device, dtype=getattr(torch, a.dtype), head_dim=a.head_dim, hidden_size=a.hidden_size,
                   prefill_backend=a.prefill_backend, peer=a.peer,
                   calibration_files=calibration_files(sorted({c.calibration for c in cases}), tmp.name))
    stubs: List[str] = []
    runner = (runner_factory or Runner)(opts, stubs)
    import sglang

    command = None if argv is None else " ".join(["python3", "scripts/gpu/check_decode_peer.py", *argv])
    doc: Dict[str, Any] = {
        **results.header(command),
        "sglang_version": getattr(sglang, "__version__", "unknown"),
        "kit": KIT,
        "settings": {"device": a.device, "dtype": a.dtype, "head_dim": a.head_dim, "hidden_size": a.hidden_size,
                     "prefill_backend": a.prefill_backend, "peer": a.peer, "paths": a.paths, "kinds": a.kinds,
                     "calibrations": a.calibrations, "only": a.only,
                     "tolerance": "the kit's torch.testing.assert_close(atol=DENSE_ATOL, rtol=DENSE_RTOL) on the o_proj output"},
        "kit_stubs": stubs,
        "limitations": LIMITATIONS,
    }
    done: List[Dict[str, Any]] = []
    not_run: List[str] = []
    try:
        for i, spec in enumerate(cases):
            if a.max_seconds and time.monotonic() - t0 > a.max_seconds:
                not_run = [c.name for c in cases[i:]]
                print(f"check_decode_peer: --max-seconds {a.max_seconds:g} reached: {len(not_run)} cases not run", file=sys.stderr)
                break
            r = runner.run(spec)
            done.append(r)
            print(f"[{i + 1}/{len(cases)}] {'PASS' if r['passed'] else 'FAIL'} {r['name']} max_abs_err={r['max_abs_err']}"
                  + ("" if r["passed"] else f"  {str(r['error'])[:300]}"), flush=True)
            finish(a.out, dict(doc), done, [c.name for c in cases[i + 1:]])  # a killed run leaves what it did
            if a.device.startswith("cuda") and (i + 1) % 25 == 0:  # fixtures hold FlashInfer workspaces
                gc.collect()
                torch.cuda.empty_cache()
    finally:
        tmp.cleanup()
    return finish(a.out, doc, done, not_run)


if __name__ == "__main__":
    sys.exit(main())
