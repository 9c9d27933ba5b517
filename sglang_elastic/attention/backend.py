"""The ``persistentkv`` SGLang attention backend: decode on split-KV, the compact
work queue or FlashInfer, chosen per batch by :mod:`sglang_elastic.attention.policy`.

Use it for decode only, beside FlashInfer for prefill (SGLang's
``HybridAttnBackend`` routes DECODE/IDLE here, EXTEND/MIXED to the prefill
backend)::

    python -m sglang.launch_server ... --attention-backend flashinfer \\
        --decode-attention-backend persistentkv [--decode-policy auto]

Interface: SGLang 0.5.17's ``AttentionBackend``
(``sglang/srt/layers/attention/base_attn_backend.py``); patterns from its
Triton backend (``triton_backend.py``: ``kv_indptr`` / ``kv_indices`` built
from ``req_to_token`` with ``create_flashinfer_kv_indices_triton``,
preallocated CUDA-graph buffers sized ``max_num_tokens * context_len``).

Per decode step (once, not per layer):

1. ``init_forward_metadata_out_graph`` (host, before replay): the policy picks
   the path from ``seq_lens_cpu`` (SGLang's CPU mirror, no device read). For
   ``flashinfer`` it delegates to SGLang's own ``FlashInferAttnBackend``
   (built through SGLang's registry, not re-implemented), which plans.
2. ``init_forward_metadata_in_graph`` (recorded in the CUDA graph): for split /
   compact, ``kv_indptr = cumsum(seq_lens)``, ``kv_indices`` gathered from
   ``req_to_token`` and the kernel plan (chunk counts or the item list), all
   GPU ops on address-stable buffers.

Per layer, ``forward_decode`` writes the new K/V (``set_kv_buffer``) and runs
the chosen path (two launches for ours: partials, merge).

CUDA graphs: SGLang captures one decode graph per batch size. A graph holds
one path's kernels, so with ``--decode-policy auto`` the backend has every
batch size captured once per path (``graph_paths``) and the runner replays
the graph of the path the policy picked for this step: two ``HookRegistry``
AROUND hooks installed when the backend is built (:func:`install_graph_hooks`)
loop ``DecodeCudaGraphRunner.capture_one_shape`` over the paths and add the
path to the graph key's ``variant_label`` in ``_make_graph_key`` (which the
runner calls after ``init_forward_metadata_out_graph`` on replay). A forced
policy captures one graph per batch size, as stock SGLang does.

Calibration per shape (``calibration_cache.py``): the backend keys its
calibration by GPU and layer shape; where nothing measured covers the key it
starts on the cost-model prior and, under ``auto``, times every path on
synthetic batches over its own pool in ``init_cuda_graph_state`` (the start
of CUDA-graph capture; :meth:`PersistentKVAttnBackend.startup_calibrate`),
then caches the fit. Online (``online.py``): a third AROUND hook on
``DecodeCudaGraphRunner.execute`` times one replay in 16 with CUDA events read
back by ``query()`` on later steps, and :meth:`choose` lets the measured
per-bucket choice override the model's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from typing import Dict, Optional, Set

import numpy as np
import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from sglang_elastic.attention import NAME
from sglang_elastic.attention.calibration_cache import CalibrationCache, ShapeKey, resolve
from sglang_elastic.attention.online import OnlineCorrector, ReplayTimer, bucket_key
from sglang_elastic.attention.policy import (
    PATHS, Calibration, DecodePolicy, load_calibration, split_max_splits, split_min_chunk, work_queue_rows,
)

logger = logging.getLogger(__name__)
_SUPPORTED_KV_DTYPES = (torch.bfloat16, torch.float16)
#: Debug: a file this process rewrites with per-path step counts (scripts/gpu/check_decode_e2e.py).
TRACE_ENV = "SGLANG_ELASTIC_DECODE_TRACE"
#: Test only, like SGLang's ``SGLANG_TEST_*`` switches: ``sm_scale:F`` multiplies
#: the softmax scale of our kernels (not FlashInfer's) by ``F``: a deliberately
#: wrong kernel that the end-to-end check (``scripts/gpu/check_decode_e2e.py``,
#: mode ``mutant-split``) must fail.
FAULT_ENV = "SGLANG_ELASTIC_TEST_DECODE_FAULT"
#: A file naming the path every decode step replays (``split``, ``compact``,
#: ``flashinfer``; ``auto``, empty or no file: the policy decides), read at most
#: every :data:`PATH_FILE_POLL_S` seconds: forced-path A/B runs on one live
#: ``--decode-policy auto`` server, every path's graphs already captured
#: (``scripts/gpu/bench_decode_serving.py``). Each TP rank reads it on its own
#: clock, so for a step after a write the ranks may run different paths (every
#: path holds the same collectives: correct, only not yet all forced);
#: ``/server_info`` shows the first rank's state.
PATH_FILE_ENV = "SGLANG_ELASTIC_DECODE_PATH_FILE"
PATH_FILE_POLL_S = 0.5


def fault_scale(value: Optional[str]) -> float:
    """The softmax-scale factor ``FAULT_ENV`` asks for (1.0 when unset).

    Raises:
        ValueError: a value other than ``sm_scale:<positive float>``.
    """
    if not value:
        return 1.0
    kind, _, arg = value.partition(":")
    try:
        f = float(arg)
    except ValueError:
        f = -1.0
    if kind != "sm_scale" or not f > 0:
        raise ValueError(f"{FAULT_ENV}={value!r}: expected sm_scale:<positive float>, e.g. sm_scale:1.05")
    return f


#: The policy's pick for a batch is reused until the batch's shape moves: its
#: mean or longest KV length by this many tokens, its shortest by 8x this
#: (:meth:`PersistentKVAttnBackend.choose` lists the whole key).
RECHOOSE_TOKENS = 32
_MAX_CHOICES = 4096


def _attn_tp_size() -> int:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().attn_tp_size


def _attn_dcp_size() -> int:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().attn_dcp_size


#: GQA group sizes FlashInfer's CUDA-core decode is compiled for
#: (``DISPATCH_GQA_GROUP_SIZE`` in ``flashinfer/utils.cuh``); others it refuses.
CUDA_CORE_GQA_GROUPS = (1, 2, 3, 4, 8)


def flashinfer_decode_unavailable(q_heads: int, kv_heads: int, kv_dtype, deterministic: bool = False) -> Optional[str]:
    """Why SGLang's FlashInfer decode cannot serve this shape, or ``None``.

    SGLang's ``FlashInferAttnBackend`` picks tensor-core or CUDA-core decode by
    ``should_use_tensor_core`` (``SGLANG_FLASHINFER_USE_TENSOR_CORE`` first,
    else GQA >= 4; tensor cores always under deterministic inference); that
    function is called here, so the answer is the delegate's. CUDA-core decode
    has kernels only for GQA groups :data:`CUDA_CORE_GQA_GROUPS`.
    """
    if deterministic or _should_use_tensor_core(kv_dtype, q_heads, kv_heads):
        return None
    group = q_heads // kv_heads
    if group in CUDA_CORE_GQA_GROUPS:
        return None
    return (f"FlashInfer's CUDA-core decode (tensor cores off: SGLANG_FLASHINFER_USE_TENSOR_CORE="
            f"{os.environ.get('SGLANG_FLASHINFER_USE_TENSOR_CORE')}) has no kernel for GQA group {group} "
            f"(only {', '.join(map(str, CUDA_CORE_GQA_GROUPS))})")


def _should_use_tensor_core(kv_dtype, q_heads: int, kv_heads: int) -> bool:
    from sglang.srt.layers.attention.flashinfer_backend import should_use_tensor_core

    return should_use_tensor_core(kv_cache_dtype=kv_dtype, num_attention_heads=q_heads, num_kv_heads=kv_heads)


def _device_name(model_runner) -> str:
    """The GPU's name as ``torch.cuda.get_device_name`` gives it (``cpu`` off a GPU)."""
    if not str(getattr(model_runner, "device", "cpu")).startswith("cuda"):
        return "cpu"
    from sglang.srt.utils import get_device_name

    return get_device_name(getattr(model_runner, "gpu_id", 0)) or "unknown"


def _device_sm_count(model_runner) -> int:
    from sglang.srt.utils import get_device_core_count

    return get_device_core_count(getattr(model_runner, "gpu_id", 0))


@dataclasses.dataclass
class DecodeMetadata:
    """One step's decode metadata (views of the backend's buffers)."""

    path: str
    bs: int
    kv_indptr: Optional[torch.Tensor] = None  # [bs + 1] int32
    kv_indices: Optional[torch.Tensor] = None  # [>= sum(seq_lens)] int32 token ids
    max_splits: int = 1  # split path: chunks per request cap at this batch size


class PersistentKVAttnBackend(AttentionBackend):
    """Decode attention over SGLang's KV pool with an adaptive choice of kernel.

    Args:
        model_runner: SGLang's ``ModelRunner`` (reads ``req_to_token_pool``,
            ``token_to_kv_pool``, ``model_config``, ``server_args``, ``device``).
        policy: ``auto`` / ``flashinfer`` / ``split`` / ``compact``; default from
            ``--decode-policy`` (:func:`sglang_elastic.config.current`).
        calibration: a :class:`Calibration`; default from ``--decode-calibration``
            or the file shipped in the package.

    Raises:
        ValueError: a model or setting this backend does not serve (MLA,
            sliding window, KV dtype other than bf16/fp16, speculative decoding,
            decode context parallelism), naming what to use instead.
    """

    # The policy reads seq_lens_cpu: keep SGLang's per-step CPU mirror on.
    needs_cpu_seq_lens: bool = True

    def __init__(self, model_runner, policy: Optional[str] = None, calibration: Optional[Calibration] = None):
        super().__init__()
        from sglang_elastic import config

        cfg = config.current()
        mode = policy or cfg.decode_policy
        explicit = calibration or (load_calibration(cfg.decode_calibration) if cfg.decode_calibration else None)
        self._check_supported(model_runner)

        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.page_size = getattr(model_runner, "page_size", 1) or 1
        self.max_context_len = model_runner.model_config.context_len
        self.kv_heads = self.token_to_kv_pool.head_num
        self.head_dim = self.token_to_kv_pool.head_dim
        self.q_heads = model_runner.model_config.get_max_num_attention_heads() // _attn_tp_size()
        self.kv_dtype = self.token_to_kv_pool.dtype
        sm = _device_sm_count(model_runner)
        # the calibration of this shape on this GPU (calibration_cache: explicit, cache, shipped, else the prior)
        self.shape_key = ShapeKey(gpu=_device_name(model_runner), sm_count=sm or (explicit.sm_count if explicit else 132),
                                  q_heads=self.q_heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
                                  dtype=str(self.kv_dtype).removeprefix("torch."), page_size=self.page_size)
        self.calibration_cache = None if cfg.decode_calibration_cache == "off" else CalibrationCache(cfg.decode_calibration_cache)
        calib, self.calibration_source = resolve(self.shape_key, explicit, self.calibration_cache)
        if explicit is not None and sm and sm != calib.sm_count:
            logger.warning("persistentkv: calibration is for %s (%d SMs), this GPU has %d SMs: the policy's choices may be off; "
                           "run scripts/gpu/bench_decode.py on this GPU and pass --decode-calibration", calib.gpu, calib.sm_count, sm)
        if calib.provisional and mode == "auto" and self.calibration_source != "prior":
            logger.warning("persistentkv: using the PROVISIONAL calibration (%s)", calib.source[:120])
        self.sm_count = sm or calib.sm_count
        self.calib = calib
        deterministic = bool(getattr(model_runner.server_args, "enable_deterministic_inference", False))
        why = flashinfer_decode_unavailable(self.q_heads, self.kv_heads, self.kv_dtype, deterministic)
        self._flashinfer_tensor_cores = deterministic or _should_use_tensor_core(self.kv_dtype, self.q_heads, self.kv_heads)
        self.policy = DecodePolicy(calib, self.q_heads, self.kv_heads, self.head_dim, self.kv_dtype.itemsize, mode,
                                   unavailable={"flashinfer": why} if why else None)
        if why and mode == "auto":
            logger.warning("persistentkv: %s; the policy picks between split and compact only", why)
        # the startup measurement (init_cuda_graph_state) where no measurement covers this shape, or when forced
        startup = cfg.decode_startup_calibration
        self._needs_startup = (mode == "auto" and len(self.policy.paths) > 1 and str(self.device).startswith("cuda")
                               and (startup == "force" or (startup == "auto" and self.calibration_source == "prior")))
        self._startup_timer = None  # None: calibrate.graph_timer() (tests inject theirs)
        #: the startup measurement's ``{seconds, batches, fit_rms_rel_err}`` once it ran (:meth:`state`)
        self.startup_info: Optional[dict] = None
        logger.info("persistentkv: %s calibration for %s%s", self.calibration_source, self.shape_key.file_name(),
                    "; measuring at CUDA-graph capture" if self._needs_startup else "")
        # online correction from timed graph replays (online.py)
        self.online: Optional[OnlineCorrector] = None
        self.replay_timer: Optional[ReplayTimer] = None
        if mode == "auto" and cfg.decode_online == "on" and len(self.policy.paths) > 1:
            self.online = OnlineCorrector(self.policy.paths)
            self.replay_timer = ReplayTimer(self.online)

        self.flashinfer = None
        if "flashinfer" in self.policy.paths:
            from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

            self.flashinfer = ATTENTION_BACKENDS["flashinfer"](model_runner)

        # Eager and graph buffers of our paths (address-stable: allocated once here).
        max_bs = self.req_to_token_pool.size + 1  # + SGLang's padding row
        self.max_bs = max_bs
        dev = self.device
        self.kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self.split_chunk = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self.split_nsplit = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self.queue_chunk = torch.zeros(1, dtype=torch.int32, device=dev)
        self.queue_item_offsets = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self.queue_n_items = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        rows = 0
        if "split" in self.policy.paths:
            rows = max(rows, calib.split.partial_budget, max_bs)
        if "compact" in self.policy.paths:
            rows = max(rows, work_queue_rows(calib.compact, max_bs))
        self.mid_o = torch.empty((rows, self.q_heads, self.head_dim), dtype=torch.float32, device=dev)
        self.mid_lse = torch.empty((rows, self.q_heads), dtype=torch.float32, device=dev)
        self.cuda_graph_kv_indices: Optional[torch.Tensor] = None

        self.forward_metadata: Optional[DecodeMetadata] = None
        #: Path of the current step (read by the graph-key hook).
        self.graph_path: str = self.policy.paths[0]
        self._capture_path: Optional[str] = None
        self._captured: Dict[int, Set[str]] = {}
        self.variant_graphs = False  # set by the capture hook: one graph per (bs, path)
        self._warned_fallback = False
        self._choices: Dict[tuple, str] = {}  # memoised policy picks (choose)
        self._fault_scale = fault_scale(os.environ.get(FAULT_ENV))
        if self._fault_scale != 1.0:
            logger.warning("%s set: persistentkv's kernels scale the softmax by %s (a deliberate fault for tests)", FAULT_ENV, self._fault_scale)
        self._trace_file = os.environ.get(TRACE_ENV)
        self._trace_counts: Dict[str, int] = {}
        self._trace_written = 0.0
        #: seconds between rewrites of the trace file (0: every step, exact counts; a live server sets 1)
        self._trace_every_s = float(os.environ.get(TRACE_ENV + "_EVERY_S", "0") or 0)
        #: decode steps per ``kind:path`` (``replay`` / ``eager``), for ``/server_info`` (:meth:`state`)
        self.steps: Dict[str, int] = {}
        #: the path forced through :data:`PATH_FILE_ENV` (None: the policy decides)
        self.forced: Optional[str] = None
        self._path_file = os.environ.get(PATH_FILE_ENV) or None
        self._path_read = -math.inf
        self._path_warned: Optional[str] = None
        install_graph_hooks()

    def _forced_path(self) -> Optional[str]:
        """The path named in :data:`PATH_FILE_ENV`'s file (re-read every
        :data:`PATH_FILE_POLL_S` s); ``None`` for ``auto``, an empty or missing
        file, or a name this server has no graphs of (logged once)."""
        if self._path_file is None:
            return None
        now = time.monotonic()
        if now - self._path_read < PATH_FILE_POLL_S:
            return self.forced
        self._path_read = now
        try:
            with open(self._path_file) as f:
                name = f.read().strip()
        except OSError:
            name = ""
        if name in ("", "auto") or name in self.policy.paths:
            self.forced = name if name in self.policy.paths else None
        elif name != self._path_warned:
            self._path_warned = name
            logger.warning("persistentkv: %s names %r, not one of this server's paths %s: the policy decides",
                           self._path_file, name, "/".join(self.policy.paths))
            self.forced = None
        return self.forced

    def state(self) -> dict:
        """What ``/server_info`` shows under ``internal_states[i]["persistentkv"]``:
        ``{policy, paths, forced, calibration_source, startup, shape, steps: {kind:path: n},
        online: {buckets, switches, choices: {path: buckets}, top: the 8 most visited
        buckets' means (:meth:`OnlineCorrector.summary`)} | None}``."""
        online = None
        if self.online is not None:
            choices: Dict[str, int] = {}
            for b in self.online.buckets.values():
                if b.choice is not None:
                    choices[b.choice] = choices.get(b.choice, 0) + 1
            online = {"buckets": len(self.online.buckets), "switches": self.online.switches, "choices": choices,
                      "top": self.online.summary(top=8)}
        return {"policy": self.policy.mode, "paths": list(self.policy.paths), "forced": self.forced,
                "calibration_source": self.calibration_source, "startup": self.startup_info, "shape": self.shape_key.file_name(),
                "steps": dict(self.steps), "online": online}

    def _trace(self, kind: str, path: str, bs: int) -> None:
        """Count steps per (kind, path) into ``$SGLANG_ELASTIC_DECODE_TRACE.<pid>`` (debug only).
        Rewritten every step, or, with ``$SGLANG_ELASTIC_DECODE_TRACE_EVERY_S``,
        when a key first appears and else at most that often (a live server:
        the last interval's counts may be missing)."""
        if not self._trace_file:
            return
        key = f"{kind}:{path}"
        new_key = key not in self._trace_counts
        self._trace_counts[key] = self._trace_counts.get(key, 0) + 1
        now = time.monotonic()
        if not new_key and now - self._trace_written < self._trace_every_s:
            return
        self._trace_written = now
        with open(f"{self._trace_file}.{os.getpid()}", "w") as f:
            json.dump({"counts": self._trace_counts, "variant_graphs": self.variant_graphs, "policy": self.policy.mode if hasattr(self.policy, "mode") else None}, f)

    # ------------------------------------------------------------------ checks

    @staticmethod
    def _check_supported(model_runner) -> None:
        fix = "use --decode-attention-backend flashinfer (or triton) for this model"
        if getattr(model_runner, "use_mla_backend", False):
            raise ValueError(f"persistentkv does not serve MLA models; {fix}")
        if getattr(model_runner, "sliding_window_size", None) is not None:
            raise ValueError(f"persistentkv does not serve sliding-window attention; {fix}")
        dtype = getattr(model_runner, "kv_cache_dtype", None)
        if dtype is not None and dtype not in _SUPPORTED_KV_DTYPES:
            raise ValueError(f"persistentkv reads bf16/fp16 KV caches, not {dtype}; {fix} or drop --kv-cache-dtype")
        sa = model_runner.server_args
        if getattr(sa, "speculative_algorithm", None) is not None:
            raise ValueError("persistentkv has no target-verify path: speculative decoding needs another decode backend")
        if _attn_dcp_size() > 1:
            raise ValueError(f"persistentkv does not support decode context parallelism; {fix}")

    # ------------------------------------------------------------------ policy

    def choose(self, forward_batch) -> str:
        """The path for this batch from host-side data only (``seq_lens_cpu``,
        else ``seq_lens_sum`` spread evenly, else the first path).

        The cost model (20-85 us of CPython at batch 1-256) runs again when
        the batch's size or its count of requests past twice the mean length
        changes, or its mean or longest KV length moves by
        :data:`RECHOOSE_TOKENS` tokens, or its shortest by 8x that; in
        between, the memoised pick is reused. A stable batch grows by one
        token per request per step, so the model runs every 15-32 steps and
        a step costs a few us. A stale pick is only slower, never wrong:
        every path computes the same attention, and under ``auto`` every
        captured batch size has all three graphs.
        """
        if len(self.policy.paths) == 1:
            return self.policy.paths[0]
        forced = self._forced_path()
        if forced is not None:
            return forced
        bs = forward_batch.batch_size
        lens_cpu = getattr(forward_batch, "seq_lens_cpu", None)
        if lens_cpu is not None and bs > 0:
            lens = lens_cpu.numpy()[:bs]  # a view: cheaper than slicing the tensor first
            mean, longest = int(lens.sum()) // bs, int(lens.max())
            # size, mean, longest, shortest and how many run past twice the mean:
            # batches alike in these are alike to the cost model
            key = (bs, mean // RECHOOSE_TOKENS, longest // RECHOOSE_TOKENS, int(lens.min()) // (8 * RECHOOSE_TOKENS),
                   int(np.count_nonzero(lens > 2 * mean)))
            path = self._choices.get(key)
            if path is None:
                if len(self._choices) >= _MAX_CHOICES:
                    self._choices.clear()
                path = self._choices[key] = self.policy.choose(lens)  # the policy picks Python ints or numpy by size
            if self.online is not None:  # measured replays override the prior per bucket
                path = self.online.choose(bucket_key(bs, mean, longest), path)
            return path
        total = getattr(forward_batch, "seq_lens_sum", None)
        if total is not None and bs > 0:
            return self.policy.choose([max(1, total // bs)] * bs)
        return self.policy.paths[0]

    # ---------------------------------------------------------------- metadata

    def init_forward_metadata(self, forward_batch):
        """Eager step (no CUDA graph): choose, then plan on the GPU (or let FlashInfer plan)."""
        bs = forward_batch.batch_size
        if forward_batch.forward_mode.is_idle() or bs == 0:
            self.forward_metadata = DecodeMetadata(path="idle", bs=0)
            return
        self._require_decode(forward_batch)
        path = self.choose(forward_batch)
        self._count("eager", path)
        self._trace("eager", path, bs)
        if path == "flashinfer":
            self.flashinfer.init_forward_metadata(forward_batch)
            self.forward_metadata = DecodeMetadata(path=path, bs=bs)
            return
        total = forward_batch.seq_lens_sum
        if total is None:  # no CPU mirror: size the index list from the device (eager only)
            total = int(forward_batch.seq_lens[:bs].sum().item())
        kv_indices = torch.empty(max(1, total), dtype=torch.int32, device=self.device)
        self.forward_metadata = self._our_metadata(path, bs, kv_indices)
        self._plan(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        """Address-stable graph buffers: ``kv_indices`` of ``max_num_tokens *
        context_len`` int32 (SGLang's sizing), shared with the FlashInfer delegate when it is a path."""
        self.cuda_graph_kv_indices = torch.zeros(max_num_tokens * self.max_context_len, dtype=torch.int32, device=self.device)
        if self.flashinfer is not None:
            # one index buffer for both: a step runs one path, and each path refills it for its step
            self.flashinfer.init_cuda_graph_state(max_bs, max_num_tokens, kv_indices_buf=self.cuda_graph_kv_indices)
        if self._needs_startup:
            self._needs_startup = False
            self.startup_calibrate()

    # ------------------------------------------------------- calibration

    def set_calibration(self, calib: Calibration, source: str) -> None:
        """Use ``calib`` from now on (its kernel configs must be the current ones: the workspaces were sized for them).

        Raises:
            ValueError: ``calib``'s split / compact configs differ from the current ones.
        """
        if (calib.split, calib.compact) != (self.calib.split, self.calib.compact):
            raise ValueError("a new calibration must keep the kernel configs the workspaces were sized for")
        self.calib, self.calibration_source = calib, source
        self.policy = DecodePolicy(calib, self.q_heads, self.kv_heads, self.head_dim, self.kv_dtype.itemsize, self.policy.mode,
                                   unavailable=self.policy.unavailable)
        self._choices.clear()

    def startup_calibrate(self) -> Optional[Calibration]:
        """The startup measurement (:func:`sglang_elastic.attention.calibrate.calibrate_shape`):
        every policy path timed on :func:`~sglang_elastic.attention.calibrate.probe_cases`
        over this server's own KV pool (layer 0) and workspaces, the fit used
        from now on and written to the calibration cache. A failure is logged
        and keeps the current calibration (a server must still start).

        Returns:
            The new calibration, or ``None`` when the measurement failed.
        """
        from sglang_elastic.attention.calibrate import calibrate_shape, graph_timer, probe_cases

        t0 = time.monotonic()
        slots = self.token_to_kv_pool.size
        cases = probe_cases(self.max_bs - 1, self.max_context_len, max(1, slots - 2 * self.page_size * (self.max_bs + 1)))
        timer = self._startup_timer or graph_timer()
        try:
            calib, errs, _ = calibrate_shape(self.shape_key, self.calib, self.policy.paths, self._probe_launch, timer, cases,
                                             self.kv_dtype.itemsize)
        except Exception as e:  # noqa: BLE001 - the server starts on the calibration it has
            logger.warning("persistentkv: startup calibration failed (%s: %s); keeping the %s calibration",
                           type(e).__name__, str(e)[:200], self.calibration_source)
            return None
        self.set_calibration(calib, "measured")
        self.startup_info = {"seconds": round(time.monotonic() - t0, 2), "batches": len(cases),
                             "fit_rms_rel_err": {p: round(x, 4) for p, x in errs.items()}}
        where = None
        if self.calibration_cache is not None:
            try:
                where = self.calibration_cache.store(self.shape_key, calib, {"seconds": round(time.monotonic() - t0, 2)})
            except OSError as e:
                logger.warning("persistentkv: cannot write the calibration cache %s: %s", self.calibration_cache.root, e)
        logger.info("persistentkv: measured %d batches x %s in %.1f s (fit rms rel err %s)%s", len(cases), "/".join(self.policy.paths),
                    time.monotonic() - t0, {p: round(x, 3) for p, x in errs.items()}, f"; cached in {where}" if where else "")
        return calib

    def _probe_launch(self, path: str, lens):
        """One layer's decode of ``path`` for a synthetic batch of ``lens`` over
        layer 0 of the pool (random pages; GPU only), as a no-argument launch."""
        from sglang_elastic.kernels.decode_attention import split_kv_plan, split_kv_run, work_queue_plan, work_queue_run

        dev, ps, B = self.device, self.page_size, len(lens)
        g = torch.Generator(device=dev).manual_seed(7919 * B + int(sum(lens)))
        need = [-(-int(n) // ps) for n in lens]
        pages = torch.randperm(self.token_to_kv_pool.size // ps - 1, device=dev, generator=g)[: sum(need)] + 1
        toks = (pages[:, None] * ps + torch.arange(ps, device=dev)).view(-1, ps)
        idx, at = [], 0
        for n, k in zip(lens, need):
            idx.append(toks[at: at + k].reshape(-1)[: int(n)])
            at += k
        idx = torch.cat(idx).to(torch.int32)
        indptr = torch.zeros(B + 1, dtype=torch.int32, device=dev)
        indptr[1:] = torch.cumsum(torch.tensor(list(lens), device=dev), 0)
        q = torch.randn(B, self.q_heads, self.head_dim, device=dev, generator=g).to(self.kv_dtype)
        o = torch.empty_like(q)
        kb, vb = self.token_to_kv_pool.get_key_buffer(0), self.token_to_kv_pool.get_value_buffer(0)
        scale = self.head_dim ** -0.5
        if path == "split":
            c = self.calib.split
            ms = split_max_splits(c, B)
            chunk, nsplit = split_kv_plan(indptr, ms, split_min_chunk(c, B), c.block_n)
            return lambda: split_kv_run(q, kb, vb, indptr, idx, chunk, nsplit, ms, self.mid_o, self.mid_lse, o, scale, c.block_n,
                                        c.num_warps, c.num_stages, c.pdl)
        if path == "compact":
            c = self.calib.compact
            qc, qo, qn = work_queue_plan(indptr, target_items=c.target_items, min_chunk=c.min_chunk, block_n=c.block_n,
                                         capacity=min(self.mid_o.shape[0], self.mid_lse.shape[0]))
            return lambda: work_queue_run(q, kb, vb, indptr, idx, qc, qo, qn, self.mid_o, self.mid_lse, o, c.programs or self.sm_count,
                                          scale, c.block_n, c.num_warps, c.num_stages, c.pdl)
        import flashinfer  # FlashInfer's decode as SGLang's backend plans it: page size 1, token ids

        ones = torch.ones(B, dtype=torch.int32, device=dev)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.flashinfer.workspace_buffer, "NHD", use_cuda_graph=True, use_tensor_cores=self._flashinfer_tensor_cores,
            paged_kv_indptr_buffer=torch.empty_like(indptr), paged_kv_indices_buffer=torch.empty_like(idx), paged_kv_last_page_len_buffer=ones)
        w.plan(indptr, idx, ones, self.q_heads, self.kv_heads, self.head_dim, 1, q_data_type=self.kv_dtype, kv_data_type=self.kv_dtype,
               sm_scale=scale)
        kv = (kb.view(-1, 1, self.kv_heads, self.head_dim), vb.view(-1, 1, self.kv_heads, self.head_dim))
        return lambda: w.run(q, kv, out=o)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Host side of a graph step: pick the path (capture: the path being
        captured), let FlashInfer plan if it is the path. No device read."""
        bs = forward_batch.batch_size
        self._require_decode(forward_batch)
        if in_capture:
            path = self._capture_path or self.policy.paths[0]
            self._captured.setdefault(bs, set()).add(path)
        else:
            path = self.choose(forward_batch)
            captured = self._captured.get(bs)
            if captured and path not in captured:
                # the graph hooks are not active: replay what was captured for this bs
                if not self._warned_fallback:
                    logger.warning("persistentkv: no decode graph of path %s for bs %d (graph hooks inactive?); replaying %s",
                                   path, bs, sorted(captured))
                    self._warned_fallback = True
                path = next(p for p in self.policy.paths if p in captured)
                if self.forced is None:  # one graph per bs: nothing to explore or correct (a forced path says nothing of that)
                    self.online = None
        if not in_capture:
            self._count("replay", path)
        self._trace("capture" if in_capture else "replay", path, bs)
        if not in_capture and self.online is not None and self.online.explored == path:  # a timed step off the choice
            self._trace("explore", path, bs)
        self.graph_path = path
        if path == "flashinfer":
            self.flashinfer.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
            self.forward_metadata = DecodeMetadata(path=path, bs=bs)
        else:
            self.forward_metadata = self._our_metadata(path, bs, self.cuda_graph_kv_indices)

    def init_forward_metadata_in_graph(self, forward_batch):
        """Recorded in the graph: ``kv_indptr`` / ``kv_indices`` and the kernel plan (GPU ops only)."""
        meta = self.forward_metadata
        if meta is not None and meta.path in ("split", "compact"):
            self._plan(forward_batch)

    def _count(self, kind: str, path: str) -> None:
        key = f"{kind}:{path}"
        self.steps[key] = self.steps.get(key, 0) + 1

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def _require_decode(self, forward_batch) -> None:
        mode = forward_batch.forward_mode
        if not mode.is_decode_or_idle():
            raise NotImplementedError(f"persistentkv serves DECODE/IDLE batches only, not {mode.name}: "
                                      "run prefill on another backend (--attention-backend flashinfer --decode-attention-backend persistentkv)")

    def _our_metadata(self, path: str, bs: int, kv_indices: torch.Tensor) -> DecodeMetadata:
        return DecodeMetadata(path=path, bs=bs, kv_indptr=self.kv_indptr[: bs + 1], kv_indices=kv_indices,
                              max_splits=split_max_splits(self.calib.split, bs))

    def _plan(self, forward_batch) -> None:
        from sglang.kernels.ops.kvcache.kv_indices import create_flashinfer_kv_indices_triton

        from sglang_elastic.kernels.decode_attention import split_kv_plan, work_queue_plan

        meta = self.forward_metadata
        bs = meta.bs
        seq_lens = forward_batch.seq_lens[:bs]
        meta.kv_indptr[1:] = torch.cumsum(seq_lens, 0)
        create_flashinfer_kv_indices_triton[(bs,)](
            self.req_to_token, forward_batch.req_pool_indices[:bs], seq_lens, meta.kv_indptr, None, meta.kv_indices,
            self.req_to_token.stride(0),
        )
        if meta.path == "split":
            c = self.calib.split
            split_kv_plan(meta.kv_indptr, meta.max_splits, split_min_chunk(c, bs), c.block_n, self.split_chunk, self.split_nsplit)
        else:
            c = self.calib.compact
            work_queue_plan(meta.kv_indptr, target_items=c.target_items, min_chunk=c.min_chunk, block_n=c.block_n,
                            chunk_out=self.queue_chunk, item_offsets_out=self.queue_item_offsets, n_items_out=self.queue_n_items,
                            capacity=min(self.mid_o.shape[0], self.mid_lse.shape[0]))

    # ----------------------------------------------------------------- forward

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """One layer's decode attention.

        Args:
            q: ``[bs, q_heads * head_dim]`` (or any shape viewable as ``[bs, q_heads, head_dim]``).
            k, v: ``[bs, kv_heads, head_dim]`` new keys/values, written at ``out_cache_loc``.
            layer: SGLang's ``RadixAttention`` (``layer_id``, ``scaling``, ``logit_cap``).

        Returns:
            ``[bs, q_heads * head_dim]`` in ``q``'s dtype.

        Raises:
            NotImplementedError: logit soft-capping or sliding window (not in these kernels).
        """
        meta = self.forward_metadata
        if meta.path == "flashinfer":
            return self.flashinfer.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)
        if (layer.logit_cap or 0) > 0 or (getattr(layer, "sliding_window_size", -1) or -1) > -1:
            raise NotImplementedError("persistentkv kernels have no logit soft-cap or sliding window: use --decode-policy flashinfer")
        if save_kv_cache and k is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v, layer.k_scale, layer.v_scale)
        from sglang_elastic.kernels.decode_attention import split_kv_run, work_queue_run

        H, D = layer.tp_q_head_num, layer.head_dim
        q3 = q.reshape(-1, H, D)
        if q3.stride(-1) != 1:  # e.g. a slice of a fused QKV projection with a strided last dim: the kernels need unit stride
            q3 = q3.contiguous()
        o = q3.new_empty(q3.shape)
        kb = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        vb = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        scale = layer.scaling * self._fault_scale
        if meta.path == "split":
            c = self.calib.split
            split_kv_run(q3, kb, vb, meta.kv_indptr, meta.kv_indices, self.split_chunk[: meta.bs], self.split_nsplit[: meta.bs],
                         meta.max_splits, self.mid_o, self.mid_lse, o, scale, c.block_n, c.num_warps, c.num_stages, c.pdl)
        else:
            c = self.calib.compact
            work_queue_run(q3, kb, vb, meta.kv_indptr, meta.kv_indices, self.queue_chunk, self.queue_item_offsets[: meta.bs + 1],
                           self.queue_n_items[: meta.bs], self.mid_o, self.mid_lse, o, c.programs or self.sm_count,
                           scale, c.block_n, c.num_warps, c.num_stages, c.pdl)
        return o.view(-1, H * D)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        raise NotImplementedError(
            "persistentkv is a decode-only backend: prefill (EXTEND/MIXED) must run on the prefill backend; "
            "launch with --attention-backend flashinfer --decode-attention-backend persistentkv"
        )

    @contextlib.contextmanager
    def capturing(self, path: str):
        """Capture the graphs of one path (used by the capture hook)."""
        if path not in self.policy.paths:
            raise ValueError(f"path {path!r} is not one of this policy's {self.policy.paths}")
        self._capture_path = path
        try:
            yield
        finally:
            self._capture_path = None


# --------------------------------------------------------------------------
# registration and CUDA-graph hooks
# --------------------------------------------------------------------------


_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
_hooks_installed = False


def find_backend(runner) -> Optional[PersistentKVAttnBackend]:
    """The persistentkv backend behind a graph runner (directly or as the hybrid's decode backend)."""
    ab = getattr(runner, "attn_backend", None)
    for cand in (ab, getattr(ab, "decode_backend", None)):
        if isinstance(cand, PersistentKVAttnBackend):
            return cand
    return None


def _capture_one_shape(original, runner, *args, **kwargs):
    be = find_backend(runner)
    if be is None or len(be.policy.paths) == 1:
        return original(runner, *args, **kwargs)
    be.variant_graphs = True
    out = None
    for path in be.policy.paths:
        with be.capturing(path):
            out = original(runner, *args, **kwargs)
    return out


def _execute(original, runner, forward_batch, *args, **kwargs):
    """Times one decode step in ``sample_every`` with CUDA events around
    ``DecodeCudaGraphRunner.execute`` (online correction, ``online.py``):
    completed samples are read at the start of later steps with ``query()``,
    never with a sync."""
    be = find_backend(runner)
    if be is None or be.online is None:
        return original(runner, forward_batch, *args, **kwargs)
    be.replay_timer.poll()
    pair = be.replay_timer.start() if be.online.begin_step() else None
    if pair is None:
        be.online.sampling = False  # not timed (no free event pair): no exploring either
    try:
        return original(runner, forward_batch, *args, **kwargs)
    finally:
        ran = be.online.end_step()
        if pair is not None:
            be.replay_timer.stop(pair, *(ran or (None, None)))


def _make_graph_key(original, runner, size, stream_idx=None, variant_label=None):
    be = find_backend(runner)
    if be is not None and be.variant_graphs:
        tag = f"{NAME}:{be.graph_path}"
        variant_label = f"{variant_label}+{tag}" if variant_label else tag
    return original(runner, size, stream_idx, variant_label)


def install_graph_hooks() -> None:
    """Per-path decode graphs: AROUND hooks on ``DecodeCudaGraphRunner.capture_one_shape``
    and ``._make_graph_key`` through SGLang's ``HookRegistry`` (idempotent; run in
    the process that builds the backend, where the runner module is loaded anyway)."""
    global _hooks_installed
    if _hooks_installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{_RUNNER}.capture_one_shape", _capture_one_shape, HookType.AROUND)
    HookRegistry.register(f"{_RUNNER}._make_graph_key", _make_graph_key, HookType.AROUND)
    HookRegistry.register(f"{_RUNNER}.execute", _execute, HookType.AROUND)
    HookRegistry.apply_hooks()
    _hooks_installed = True


__all__ = ["NAME", "PATHS", "PersistentKVAttnBackend", "install_graph_hooks"]
