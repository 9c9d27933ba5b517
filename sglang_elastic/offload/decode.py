"""One decode step of the offload path, independent of SGLang's batch objects.

:class:`OffloadDecoder` owns the address-stable buffers of a step (sized for
the largest batch and the most KV tokens a batch can hold) and runs:

- :meth:`OffloadDecoder.plan` once per step (GPU ops only, recordable in a
  CUDA graph): the all-positions index list of each request (SGLang's
  ``create_flashinfer_kv_indices_triton``), split plans, the policy's counts
  (:meth:`~sglang_elastic.offload.policy.OffloadPolicy.counts_tensor`), the
  attended lists' offsets and their sink/window entries, the device V row of
  each new token;
- per layer, :meth:`OffloadDecoder.dense` (split-KV over every position, for
  the dense layers) or :meth:`OffloadDecoder.sparse` (scores over all K,
  top-k, hot-buffer swap-in with the miss copy from host memory, attention
  over the attended list), the kernels of :mod:`sglang_elastic.kernels.offload`.

With ``layout.resident_v`` the sparse layers run the same selection with V
read from the pool at the token ids (no host tier): the exactness reference.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from sglang_elastic.offload.pool import OffloadLayout


@dataclasses.dataclass(frozen=True)
class SplitConfig:
    """Split-KV shapes of the two passes: ``scores_*`` for the all-positions
    passes (scores, dense layers), ``attend_*`` for the attended lists.

    ``dense_min_chunk`` (0: ``scores_min_chunk``): the split length of the all-dense
    step's plan (a request of ``L`` positions runs ``ceil(L / dense_min_chunk)`` equal chunks, see
    :func:`~sglang_elastic.kernels.decode_attention.split_kv_plan`) (``plan(all_dense=True)``: the dense layers and :meth:`OffloadDecoder.dense_kept`
    read every position and run no scores pass, so fewer, longer chunks may pay);
    ``dense_fused``: the all-dense step's dense layers and ``dense_kept`` run the one-launch split-KV
    (:func:`~sglang_elastic.kernels.decode_attention.split_kv_fused_run`: the merge done by
    the last chunk to finish, a one-chunk request written directly) instead of partials and
    a merge launch; ``dense_pdl``: those launches with programmatic dependent launch (each
    starts while the layer's KV store before it finishes, and waits for it on the GPU);
    ``dense_block_n`` (0: ``scores_block_n``), ``dense_num_warps`` / ``dense_num_stages``
    (None: Triton's default): their tile and launch shape (the plan's chunks rounded to the
    block). These apply to the all-dense step and to a general step's kept requests (their own launch
    in a batch with sparse requests: :meth:`OffloadDecoder._plan_kept`), and only when the batch
    launches at least ``dense_min_ctas`` programs a chunk (requests x KV heads); a smaller batch and a
    general step's dense layers keep the scores plan and two launches. The defaults are
    ``scripts/gpu/sweep_dense_kept.py``'s pick on the H200 at 64 x 4.6K x 8 KV heads
    (``docs/results/offload_dense_kept_sweep_h200.json.xz``, 2026-12-05): one chunk a request up to
    8,192 positions, one launch, PDL, block 128, 3 stages: 0.301 ms a layer behind the KV store
    against FlashInfer's 0.303 and the earlier plan's 0.318. The one launch is slower than two once
    requests split (0.321 against 0.300 ms at 2 chunks each, 0.365 against 0.306 at 9): contexts
    past 8,192 positions in an all-dense batch paid that before ``dense_chunk_mean`` (below); below 256
    programs a chunk (e.g. 8 requests of 8 KV heads) one chunk a request would leave most SMs idle.

    ``dense_chunk_mean`` (percent; 0: off; default 125): the all-dense step's minimum chunk is
    raised to that share of the mean context of the batch's real requests (CUDA-graph padding rows,
    length 1, left out), computed on the GPU each step (:func:`dense_mean_chunk`), where no real
    request is longer than twice that chunk: a batch of similar long contexts runs one chunk a
    request, no merge, and a request somewhat longer splits in two chunks of at most that chunk
    (below 100 even a batch of equal lengths splits in two; below 50 every batch keeps the floor). A batch with a request past twice the
    share keeps ``dense_min_chunk``: with chunks near the mean its long requests become the tail
    (H200, 28 x 8,448 + 4 x 32,768, three chunks of ~10.9K each: 0.501 ms a layer with the mean's
    chunk against 0.459 with the floor; 24 x 10,000 + 8 x 3,000, all within the share: 0.280
    against 0.297; the bound at twice the share between those two points is not measured). ``dense_min_chunk`` stays the
    floor: the plan changes only where the mean context exceeds ``dense_min_chunk`` / 1.25 (6,554
    positions with 8,192). Measured on an H100 at 32 x 8,448 + 512 (dd653f0, ``docs/results/offload_h100.json``):
    median ITL 18.55 against 18.98 ms without it in one call (-2.3 %), and 18.56 against stock's
    18.42 ms (+0.8 %) in another, where the plan without it had given +3.5 % against stock (fc8598c,
    a third host). Through a server not measured on mixed lengths, past ~9K contexts, or on the H200.
    ``sweep_dense_kept.py`` times fixed minimum chunks, so its pick carries ``chunk_mean=0``.
    ``--kv-offload-dense-launch min_chunk=N`` alone turns it off (:meth:`with_dense_launch`).

    ``dense_kept_stream`` (default off): a general keep-v step's kept-request launch runs on a side stream beside the
    sparse requests' selection (scores, top-k, swap-in, copies, estimate), joined before their attention, instead of
    before it on the step's stream. Timed on an H100 at 64 x 4.6K (``check_offload.py --only keep_v_step``,
    2026-12-06 #23, 6f4a99e): the same output bit for bit (eager and replayed), a sparse layer 1.3-4.6 % faster where
    requests are kept (63 kept + 1 sparse: 0.530 -> 0.521 ms), equal with none kept; kernel level on one host only,
    so it stays off until a server run shows it."""

    scores_max_splits: int = 32
    scores_min_chunk: int = 512
    scores_block_n: int = 64
    # the scores kernel's Triton launch (None: Triton's 4 warps, 3 stages); timed per setting by
    # ``scripts/gpu/check_offload.py --only scores_sweep``
    scores_num_warps: Optional[int] = None
    scores_num_stages: Optional[int] = None
    attend_max_splits: int = 8
    attend_min_chunk: int = 256
    attend_block_n: int = 32
    select_block_n: int = 512
    select_parts: int = 16
    dense_min_chunk: int = 8192
    dense_fused: bool = True
    dense_pdl: bool = True
    dense_block_n: int = 128
    dense_num_warps: Optional[int] = None
    dense_num_stages: Optional[int] = 3
    dense_min_ctas: int = 256
    dense_chunk_mean: int = 125
    dense_kept_stream: bool = False

    @classmethod
    def with_dense_launch(cls, text: str) -> "SplitConfig":
        """The shipped configuration with the all-dense step's settings of ``--kv-offload-dense-launch``.

        Args:
            text: ``key=value`` pairs separated by commas, keys of :data:`DENSE_LAUNCH_KEYS` (the ``dense_*``
                fields without the prefix): ``min_chunk`` (positions, >= 0; 0: ``scores_min_chunk``),
                ``fused`` / ``pdl`` (0/1, true/false, on/off), ``block_n`` (0: ``scores_block_n``, or 16, 32, 64,
                128), ``num_warps`` (none, 1, 2, 4, 8, 16), ``num_stages`` (none, 1 to 6), ``min_ctas``
                (programs a chunk, requests x KV heads, from which these apply; 0: always), ``chunk_mean``
                (percent of the batch's mean context the minimum chunk is raised to where no request is past twice
                that, 0 to 1000; 0: off; :func:`dense_mean_chunk`), ``kept_stream`` (0/1: a general step's kept
                requests on a side stream beside the selection); e.g.
                ``fused=1,min_chunk=2048,pdl=1`` (what ``scripts/gpu/sweep_dense_kept.py`` reports as
                ``dense_launch``). Empty: the defaults. A ``min_chunk`` given without ``chunk_mean`` turns the
                default ``chunk_mean`` off, so the chunk given is the plan's (with ``chunk_mean`` on, ``min_chunk`` is
                only its floor).

        Raises:
            ValueError: an unknown key, a repeated key, or a value out of range; the message names it.
        """
        values = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, eq, raw = item.partition("=")
            key, raw = key.strip(), raw.strip().lower()
            if not eq or key not in DENSE_LAUNCH_KEYS:
                raise ValueError(f"--kv-offload-dense-launch: {item!r} is not key=value with a key of {', '.join(DENSE_LAUNCH_KEYS)}")
            if "dense_" + key in values:
                raise ValueError(f"--kv-offload-dense-launch: {key} given twice")
            values["dense_" + key] = _dense_value(key, raw)
        if "dense_min_chunk" in values and "dense_chunk_mean" not in values:
            values["dense_chunk_mean"] = 0  # the minimum chunk the user named is the plan's, not a floor under the mean's
        return dataclasses.replace(cls(), **values)

    def dense_plan(self, lens: torch.Tensor, bs: int):
        """The all-dense step's split plan inputs (``OffloadDecoder.plan`` where the batch takes the all-dense launch
        settings): ``(min_chunk, block_n)``, ``min_chunk`` ``dense_min_chunk`` (0: ``scores_min_chunk``) raised by
        :func:`dense_mean_chunk` when ``dense_chunk_mean`` is on (then a 0-d int64 tensor on ``lens``' device, else an
        int), ``block_n`` ``dense_block_n`` (0: ``scores_block_n``).

        Args:
            lens: ``[>= bs]`` int32 context lengths (positions).
            bs: rows of ``lens`` to read (> 0)."""
        min_chunk = self.dense_min_chunk or self.scores_min_chunk
        if self.dense_chunk_mean:
            min_chunk = dense_mean_chunk(lens, bs, min_chunk, self.dense_chunk_mean)
        return min_chunk, self.dense_block_n or self.scores_block_n

    def dense_launch(self) -> str:
        """The ``--kv-offload-dense-launch`` text of this configuration's ``dense_*`` fields (inverse of
        :meth:`with_dense_launch`)."""
        def text(v):
            return "none" if v is None else str(int(v))
        return ",".join(f"{k}={text(getattr(self, 'dense_' + k))}" for k in DENSE_LAUNCH_KEYS)


#: ``--kv-offload-dense-launch`` keys: :class:`SplitConfig`'s ``dense_*`` fields without the prefix
DENSE_LAUNCH_KEYS = ("min_chunk", "fused", "pdl", "block_n", "num_warps", "num_stages", "min_ctas", "chunk_mean", "kept_stream")
_DENSE_ALLOWED = {"block_n": (0, 16, 32, 64, 128), "num_warps": (None, 1, 2, 4, 8, 16), "num_stages": (None, 1, 2, 3, 4, 5, 6)}


def _dense_value(key: str, raw: str):
    """One ``--kv-offload-dense-launch`` value, checked (ValueError names the key)."""
    if key in ("fused", "pdl", "kept_stream"):
        flags = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}
        if raw not in flags:
            raise ValueError(f"--kv-offload-dense-launch: {key} takes 0/1, true/false or on/off, not {raw!r}")
        return flags[raw]
    if raw == "none" and None in _DENSE_ALLOWED.get(key, ()):
        return None
    try:
        v = int(raw)
    except ValueError:
        v = None
    if key in ("min_chunk", "min_ctas", "chunk_mean"):
        top, what = {"min_chunk": (1 << 20, "positions"), "min_ctas": (1 << 20, "programs"), "chunk_mean": (1000, "percent")}[key]
        if v is None or not 0 <= v <= top:
            raise ValueError(f"--kv-offload-dense-launch: {key} takes an integer 0 to {top} ({what}), not {raw!r}")
        return v
    if v not in _DENSE_ALLOWED[key]:
        allowed = ", ".join("none" if a is None else str(a) for a in _DENSE_ALLOWED[key])
        raise ValueError(f"--kv-offload-dense-launch: {key} takes one of {allowed}, not {raw!r}")
    return v


def dense_mean_chunk(lens: torch.Tensor, bs: int, floor: int, percent: int) -> torch.Tensor:
    """The minimum chunk :attr:`SplitConfig.dense_chunk_mean` asks for, by GPU ops only (no host read: a CUDA graph
    replays it with the step's lengths): ``c``, ``percent`` of the mean context of the batch's real requests, when no
    real request is longer than ``2 c`` (similar contexts run one chunk each, no merge; a somewhat longer one two chunks
    no longer than ``c``), else ``floor`` (requests that would split into three or more chunks near the mean set the
    tail; the floor's smaller chunks measured faster there). Never below ``floor``. A CUDA-graph padding row (length 1;
    a real decode step has at least 2 positions) is left out of the mean and the longest, so a batch below its captured
    size gets the same chunk as at it.

    Measured on the H200 (``sweep_dense_kept.py``'s ``dense_default_behind_store``, 54e28d5, the all-dense step's one
    launch behind the KV store): 24 x 10,000 + 8 x 3,000 positions, every request within ``c``: one chunk each, 0.280
    against 0.297 ms with the 8,192 floor; 28 x 8,448 + 4 x 32,768, the long ones past ``2 c``: 0.501 ms with ``c``
    (the long ones three chunks of ~10.9K) against 0.459 with the floor, which this rule takes there. The bound at
    ``2 c`` lies between those two points and is not measured itself.

    Args:
        lens: ``[>= bs]`` int32 context lengths (positions), on the decode's device.
        bs: rows of ``lens`` to read (> 0).
        floor: positions, the minimum chunk without the mean.
        percent: the share of the mean, in percent (1 to 1000, as ``--kv-offload-dense-launch chunk_mean`` allows).

    Returns:
        A 0-d int64 tensor on ``lens``' device: ``max(floor, c)`` with ``c = ceil(percent / 100 x the mean of the rows
        longer than 1)`` when no such row is longer than ``2 c``, else ``floor``; ``floor`` when every row is padding.

    Raises:
        ValueError: ``bs`` or ``percent`` out of range."""
    if bs < 1 or not 1 <= percent <= 1000:
        raise ValueError(f"dense_mean_chunk: bs {bs} must be >= 1 and percent {percent} in 1..1000")
    real = lens[:bs] > 1
    real_lens = lens[:bs].to(torch.int64) * real
    total = real_lens.sum() * percent
    den = 100 * torch.clamp(real.sum(), min=1)
    share = (total + den - 1) // den
    return torch.clamp(share * (real_lens.max() <= 2 * share), min=floor)


class _Selection:
    """Buffers of one layer's selection: scores, log-sum-exps, top-k, swap-in
    lists (``own_lists``: its own attended-list scratch, for the prefetch)."""

    def __init__(self, layout: OffloadLayout, q_heads: int, max_bs: int, token_capacity: int, split: SplitConfig, device,
                 own_lists: bool = False):
        i32 = dict(dtype=torch.int32, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        kmax = max(layout.policy.max_topk, 1)
        self.scores = torch.zeros((q_heads, max(token_capacity, 1)), **f32)
        self.p_buf = torch.zeros(max(token_capacity, 1), **f32)
        self.score_lse = torch.zeros((max_bs * split.scores_max_splits, q_heads), **f32)
        self.lse_full = torch.zeros((max_bs, q_heads), **f32)
        self.sel_pos = torch.zeros((max_bs, kmax), **i32)
        self.sel_hist = torch.zeros(max_bs * 4 * 256, **i32)
        self.sel_counts = torch.zeros(max_bs * split.select_parts * 2, **i32)
        self.scratch = torch.zeros((max_bs, layout.hot_tokens), **i32)
        self.miss_src = torch.zeros((max_bs, kmax), **i32)
        self.miss_dst = torch.zeros((max_bs, kmax), **i32)
        self.miss_cnt = torch.zeros(max_bs, **i32)
        #: accumulated since start: [hits, rows copied] of this pass's selected rows
        self.stats = torch.zeros(2, dtype=torch.int64, device=device)
        if own_lists:  # the sparse requests' entries only (kept requests have none in a general step's lists)
            n = max_bs * layout.policy.max_attended + 1
            self.att_kidx = torch.zeros(n, **i32)
            self.att_vidx = torch.zeros(n, **i32)


class OffloadDecoder:
    """Buffers and kernels of an offload decode step.

    Args:
        layout: the pool's :class:`~sglang_elastic.offload.pool.OffloadLayout`.
        q_heads, kv_heads, head_dim: per rank.
        max_bs: the largest batch (requests) a step may have.
        token_capacity: the most KV tokens of one batch (all requests' lengths summed).
        device: where the buffers live.
        split: :class:`SplitConfig`.
        prefetch: also keep the buffers of :meth:`prefetch` (a second selection).

    Raises:
        ValueError: ``estimate``'s chunk (``--kv-offload-chunk``) does not divide the scores'
            block of ``split.scores_block_n`` positions.
    """

    def __init__(self, layout: OffloadLayout, q_heads: int, kv_heads: int, head_dim: int, max_bs: int, token_capacity: int,
                 device, split: SplitConfig = SplitConfig(), prefetch: bool = False):
        #: ``layout.keep_v``: requests whose V is kept in idle pool slots attend over every position
        self.keep_v = layout.keep_v and not layout.resident_v
        self.layout = layout
        self.policy = layout.policy
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.max_bs = max_bs
        self.split = split
        self.token_capacity = token_capacity
        pol = self.policy
        i32 = dict(dtype=torch.int32, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        self.kv_indptr = torch.zeros(max_bs + 1, **i32)
        self.kv_indices = torch.zeros(max(token_capacity, 1), **i32)
        self.chunk = torch.zeros(max_bs, **i32)
        self.nsplit = torch.zeros(max_bs, **i32)
        self.s_eff = torch.zeros(max_bs, **i32)
        self.w_eff = torch.zeros(max_bs, **i32)
        self.k = torch.zeros(max_bs, **i32)
        self.att_indptr = torch.zeros(max_bs + 1, **i32)
        #: entries of the attended lists: every request's budget, plus (keep_v) every position for the all-dense step's V rows
        self.att_entries = max_bs * pol.max_attended + (token_capacity if self.keep_v else 0) + 1
        self.att_kidx = torch.zeros(self.att_entries, **i32)
        self.att_vidx = torch.zeros(self.att_entries, **i32)
        if self.keep_v:  # the scored (sparse) requests' own lists: a dense request has none
            self.sc_indptr = torch.zeros(max_bs + 1, **i32)
            self.sc_indices = torch.zeros(max(token_capacity, 1), **i32)
            self.sc_chunk = torch.zeros(max_bs, **i32)
            self.sc_nsplit = torch.zeros(max_bs, **i32)
            self.dense_lens = torch.zeros(max_bs, **i32)
            self.keep_rows = torch.zeros(max_bs, dtype=torch.int64, device=device)
            # a general step's kept requests' own lists (every position: K at token ids, V at kept rows) and plan:
            # they attend in the all-dense step's launch, not in the sparse requests' (:meth:`_every_position` with ``kept``)
            self.kd_indptr = torch.zeros(max_bs + 1, **i32)
            self.kd_kidx = torch.zeros(max(token_capacity, 1), **i32)
            self.kd_vidx = torch.zeros(max(token_capacity, 1), **i32)
            self.kd_chunk = torch.zeros(max_bs, **i32)
            self.kd_nsplit = torch.zeros(max_bs, **i32)
        else:
            self.sc_indptr, self.sc_indices, self.sc_chunk, self.sc_nsplit = self.kv_indptr, self.kv_indices, self.chunk, self.nsplit
            self.dense_lens = self.keep_rows = None
        self.att_chunk = torch.zeros(max_bs, **i32)
        self.att_nsplit = torch.zeros(max_bs, **i32)
        self.v_rows = torch.zeros(max_bs, dtype=torch.int64, device=device)
        rows = max_bs * max(split.scores_max_splits, split.attend_max_splits)
        self.mid_o = torch.zeros((rows, q_heads, head_dim), **f32)
        self.mid_lse = torch.zeros((rows, q_heads), **f32)
        if split.dense_fused:  # the one-launch kernel's arrival counters (each launch leaves them at zero)
            from sglang_elastic.kernels.decode_attention import split_kv_fused_counters

            self.counters = split_kv_fused_counters(max_bs, kv_heads, device)
        self.sel = _Selection(layout, q_heads, max_bs, token_capacity, split, device)
        # ``estimate``: the decode step's summary plan (the chunk each request's new token completes)
        # and the estimate's buffers (attended-position marks, per-split partial sums)
        self.estimate = pol.denominator == "estimate"
        if self.estimate:
            C = pol.chunk
            if split.scores_block_n % C:
                raise ValueError(f"--kv-offload-chunk {C} must divide the scores' block of {split.scores_block_n} positions")
            self.sum_src = torch.zeros((max_bs, C), dtype=torch.int64, device=device)
            self.sum_chunk = torch.zeros(max_bs, dtype=torch.int64, device=device)
            self.sum_valid = torch.zeros(max_bs, dtype=torch.int32, device=device)
            self.sum_dst = torch.zeros(max_bs, dtype=torch.int64, device=device)
            # attended marks: a position selected by this layer's exact pass holds this layer's stamp
            # (select_run writes it, lse_merge bumps the stamp once per pass: nothing is ever cleared)
            self.marks = torch.zeros(max(token_capacity, 1), dtype=torch.int32, device=device)
            self.stamp = torch.zeros(1, dtype=torch.int32, device=device)
            self.est_o = torch.zeros((max_bs * split.scores_max_splits, q_heads, head_dim), **f32)
        self.spec = _Selection(layout, q_heads, max_bs, token_capacity, split, device, own_lists=True) if prefetch else None
        #: [hits, misses] of the exact passes' selected rows (a prefetched row counts as a hit)
        self.stats = self.sel.stats
        self.bs = 0
        self.all_dense = False
        self.dense_tuned = False
        self.plan_block_n = self.split.scores_block_n
        #: ``split.dense_kept_stream`` on a GPU: the side stream a general step's kept-request launch runs on
        self._kept_stream = (torch.cuda.Stream(device=device) if self.keep_v and split.dense_kept_stream
                             and torch.device(device).type == "cuda" else None)
        #: a general keep-v step's kept-request launch: the all-dense step's settings (``kd_tuned``) and its plan's block
        self.kd_tuned = False
        self.kd_block_n = self.split.scores_block_n

    def plan(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, bs: int,
             keep: Optional[tuple] = None, all_dense: bool = False) -> None:
        """This step's lists and plans for ``bs`` requests (GPU ops only).

        Args:
            req_to_token: ``[rows, context]`` int32 (SGLang's ``req_to_token_pool.req_to_token``).
            req_pool_indices: ``[>= bs]``; seq_lens: ``[>= bs]`` lengths with the new token.
            keep: ``layout.keep_v`` only: ``(req_to_vrow, keep_len)``, the pool's V row of each
                position of a row (``[rows, context]`` int32) and how many leading positions have
                one (``[rows]`` int32) (:meth:`OffloadKVPool.keep_tables`). A request with
                ``keep_len >= seq_len`` is dense this step: no scores, no selection, no copy; it
                attends to every position (K ids from ``req_to_token``, V rows from ``req_to_vrow``),
                normalised by its own sum, in a launch of its own with the all-dense step's settings
                (:meth:`_plan_kept`; it has no entries in the attended lists). The others run the sparse path.
            all_dense: ``keep`` only: every request of the batch keeps V (the scheduler granted it
                this step, :attr:`sglang_elastic.offload.keep.KeepV.all_kept`): the step plans no
                selection at all, and the sparse layers run :meth:`dense_kept`. A request of length
                1 (a CUDA-graph padding entry; a real decode step has at least 2 positions) reads
                the padding row's kept entries, which point at the padding row's own V rows.

        Raises:
            ValueError: a batch larger than the workspace; ``keep`` given without ``layout.keep_v``
                or missing with it; ``all_dense`` without ``layout.keep_v``. Each leaves the last step's plan as it was.
        """
        if (keep is not None) != self.keep_v:
            raise ValueError("OffloadDecoder.plan: keep=(req_to_vrow, keep_len) goes with layout.keep_v, and only with it")
        if all_dense and not self.keep_v:  # (refused, as the above, before any of the step's state changes)
            raise ValueError("OffloadDecoder.plan: all_dense needs layout.keep_v")
        from sglang.kernels.ops.kvcache.kv_indices import create_flashinfer_kv_indices_triton

        from sglang_elastic.kernels.decode_attention import split_kv_plan
        from sglang_elastic.kernels.offload import fixed_entries_run, row_plan_run

        if bs > self.max_bs:
            raise ValueError(f"decode batch of {bs} requests exceeds the offload workspace's {self.max_bs}")
        self.bs = bs
        sp, pol, lay = self.split, self.policy, self.layout
        lens = seq_lens[:bs]
        rp = req_pool_indices[:bs]
        self.kv_indptr[1: bs + 1] = torch.cumsum(lens, 0)
        create_flashinfer_kv_indices_triton[(bs,)](
            req_to_token, rp, lens, self.kv_indptr, None, self.kv_indices, req_to_token.stride(0),
        )
        # the all-dense step's own launch only where the batch fills the GPU without small chunks (dense_min_ctas)
        self.dense_tuned = bool(all_dense) and bs * self.kv_heads >= sp.dense_min_ctas
        #: plan_block_n: the block the chunks are rounded to, which the all-positions launch must tile by (:meth:`_every_position`)
        if self.dense_tuned:
            min_chunk, self.plan_block_n = sp.dense_plan(lens, bs)
        else:
            min_chunk, self.plan_block_n = sp.scores_min_chunk, sp.scores_block_n
        split_kv_plan(self.kv_indptr[: bs + 1], sp.scores_max_splits, min_chunk, self.plan_block_n, self.chunk, self.nsplit)
        self.all_dense = bool(all_dense)
        if all_dense:
            req_to_vrow, _ = keep
            # every position, K at kv_indices and V at the kept rows: the dense layers' lists and split plan
            create_flashinfer_kv_indices_triton[(bs,)](req_to_vrow, rp, lens, self.kv_indptr, None, self.att_vidx, req_to_vrow.stride(0))
            # s_eff = w_eff = k = 0, dense_lens = lens, each new token's kept row, and the completed chunks' kept rows
            # (their means read no PCIe): one launch
            row_plan_run(lens, rp, dense=(req_to_vrow, self.s_eff, self.w_eff, self.k, self.dense_lens, self.keep_rows),
                         summary=self._summary_bufs(req_to_vrow))
            fixed_entries_run(lens, rp, req_to_token, self.s_eff[:bs], self.w_eff[:bs], self.kv_indptr, self.att_kidx, self.att_vidx,
                              self.v_rows, pol.sink, pol.window, lay.region_rows, resident=False)  # only the new tokens' ring rows
            self._rp = rp
            return
        s, w, k = pol.counts_tensor(lens)
        if self.keep_v:
            req_to_vrow, keep_len = keep
            dense = (keep_len[rp.to(torch.int64)] >= lens) & (lens > 0)
            dl = torch.where(dense, lens, 0).to(torch.int32)
            self.dense_lens[:bs] = dl
            sl = (lens - dl).to(torch.int32)  # the scored requests' lengths (0 for a dense one)
            self.sc_indptr[1: bs + 1] = torch.cumsum(sl, 0)
            create_flashinfer_kv_indices_triton[(bs,)](
                req_to_token, rp, sl, self.sc_indptr, None, self.sc_indices, req_to_token.stride(0),
            )
            split_kv_plan(self.sc_indptr[: bs + 1], sp.scores_max_splits, sp.scores_min_chunk, sp.scores_block_n, self.sc_chunk, self.sc_nsplit)
            s, w, k = (torch.where(dense, 0, x).to(torch.int32) for x in (s, w, k))
            self._plan_kept(req_to_token, req_to_vrow, rp, dl, bs)
        self.s_eff[:bs] = s
        self.w_eff[:bs] = w
        self.k[:bs] = k
        self.att_indptr[1: bs + 1] = torch.cumsum(s + w + k, 0)
        split_kv_plan(self.att_indptr[: bs + 1], sp.attend_max_splits, sp.attend_min_chunk, sp.attend_block_n, self.att_chunk, self.att_nsplit)
        fixed_entries_run(lens, rp, req_to_token, self.s_eff[:bs], self.w_eff[:bs], self.att_indptr, self.att_kidx, self.att_vidx,
                          self.v_rows, pol.sink, pol.window, lay.region_rows, resident=lay.resident_v)
        if self.keep_v:  # each kept request's new token's kept row (the store writes its V there too)
            dl = self.dense_lens[:bs]
            last = torch.clamp(lens.to(torch.int64) - 1, min=0)
            self.keep_rows[:bs] = torch.where(dl > 0, req_to_vrow[rp.to(torch.int64), last].to(torch.int64), -1)
        # estimate's chunk rows on the GPU: the ring / sink rows (the chunk lies in the window), or the token ids
        # when V is resident; never the host (a read over PCIe in every sparse layer of the step)
        row_plan_run(lens, rp, summary=self._summary_bufs(req_to_token),
                     ring=None if lay.resident_v else (pol.sink, pol.window, lay.region_rows))
        self._rp = rp

    def _plan_kept(self, req_to_token, req_to_vrow, rp, dl, bs: int) -> None:
        """A general keep-v step's kept requests (``dl``: ``[bs]`` int32, a kept request's length, 0 for a sparse
        one): their lists of every position (K at the token ids, V at the kept rows) and a split plan as the
        all-dense step's, so that one sparse request in the batch does not move the others to the sparse
        attention's small tiles (a 64 x 4K load's steps with one demoted request took 24 against 18.3 ms,
        an H100, 2026-12-06). With the all-dense settings (``bs`` x KV heads at least ``dense_min_ctas``) the
        minimum chunk is the all-dense plan's, lowered to ``sum(kept positions) x KV heads / dense_min_ctas``
        where that is smaller (a few kept requests among sparse ones split rather than leave most SMs idle;
        about ``dense_min_ctas`` programs, fewer where the block rounding or ``scores_max_splits`` cap it);
        otherwise the scores plan. In a general step where no request keeps V the launch still runs, its
        programs empty (not measured). GPU ops only."""
        if bs == 0:  # (an empty batch plans nothing; the backend never plans one)
            self.kd_tuned = False
            return
        from sglang.kernels.ops.kvcache.kv_indices import create_flashinfer_kv_indices_triton

        from sglang_elastic.kernels.decode_attention import split_kv_plan

        sp = self.split
        ind = self.kd_indptr
        ind[1: bs + 1] = torch.cumsum(dl, 0)
        create_flashinfer_kv_indices_triton[(bs,)](req_to_token, rp, dl, ind, None, self.kd_kidx, req_to_token.stride(0))
        create_flashinfer_kv_indices_triton[(bs,)](req_to_vrow, rp, dl, ind, None, self.kd_vidx, req_to_vrow.stride(0))
        self.kd_tuned = bs * self.kv_heads >= sp.dense_min_ctas
        if self.kd_tuned:
            min_chunk, self.kd_block_n = sp.dense_plan(dl, bs)
            if sp.dense_min_ctas:  # at least dense_min_ctas programs: chunks of sum(kept positions) x KV heads / that
                fill = (ind[bs].to(torch.int64) * self.kv_heads + sp.dense_min_ctas - 1) // sp.dense_min_ctas
                fill = torch.minimum(min_chunk, fill) if isinstance(min_chunk, torch.Tensor) else torch.clamp(fill, max=min_chunk)
                min_chunk = torch.clamp(fill, min=self.kd_block_n)
        else:
            min_chunk, self.kd_block_n = sp.scores_min_chunk, sp.scores_block_n
        split_kv_plan(ind[: bs + 1], sp.scores_max_splits, min_chunk, self.kd_block_n, self.kd_chunk, self.kd_nsplit)

    def _summary_bufs(self, table) -> Optional[tuple]:
        """``estimate``: the chunk each request's new token completes (positions ``[L - C, L)`` when ``L % C
        == 0``), as :func:`~sglang_elastic.kernels.offload.row_plan_run` writes it: ``table``'s entries (an
        all-dense step's ``req_to_vrow``: kept rows; ``req_to_token``: token ids, read only with resident V,
        else the ring / sink rows are computed); else None."""
        return (table, self.sum_src, self.sum_chunk, self.sum_valid) if self.estimate else None

    def summary_plan(self, pool):
        """This step's ``(src, dst)`` for :meth:`OffloadKVPool.set_summary_plan`
        (``estimate``; ``None`` otherwise), after :meth:`plan`: each request's
        last ``chunk`` positions as rows of the layer's device V, and the slot its completed chunk fills
        (given here by ``pool.assign_summary_slots``; GPU ops only)."""
        if not self.estimate:
            return None
        bs = self.bs
        dst = pool.assign_summary_slots(self._rp, self.sum_chunk[:bs], self.sum_valid[:bs], dst=self.sum_dst[:bs])
        return self.sum_src[:bs], dst

    def grant_pages(self, pool) -> None:
        """This step's hot-buffer pages (after :meth:`plan`; GPU ops only):
        each request gets the pages its ``k`` selected rows need
        (:meth:`OffloadKVPool.grant_pages`)."""
        if not self.layout.resident_v and not self.all_dense:
            pool.grant_pages(self._rp, self.k[: self.bs])

    def new_token_rows(self) -> torch.Tensor:
        """``[bs]`` int64 device V rows of this step's new tokens (sparse layers; token ids when resident)."""
        return self.v_rows[: self.bs]

    def new_token_keep_rows(self) -> Optional[torch.Tensor]:
        """``[bs]`` int64: the kept V row of each new token of a dense request (``-1``: none); None without ``keep_v``."""
        return self.keep_rows[: self.bs] if self.keep_v else None

    def dense(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, out: torch.Tensor, sm_scale: float) -> torch.Tensor:
        """Attention over every position (a dense layer; V in the pool)."""
        return self._every_position(q, k_buffer, v_buffer, out, sm_scale, None)

    def dense_kept(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, out: torch.Tensor, sm_scale: float) -> torch.Tensor:
        """A sparse layer of an all-dense step (:meth:`plan` with ``all_dense``): attention over every
        position, K at its token id, V at its kept row of ``v_buffer`` (the layer's shared K/V buffer),
        in one split-KV launch and its merge (one launch with ``split.dense_fused``), as :meth:`dense`
        runs a dense layer.

        Raises:
            RuntimeError: the step was not planned ``all_dense``.
        """
        if not self.all_dense:
            raise RuntimeError("OffloadDecoder.dense_kept runs a step planned with all_dense=True")
        return self._every_position(q, k_buffer, v_buffer, out, sm_scale, self.att_vidx)

    def _every_position(self, q, k_buffer, v_buffer, out, sm_scale, v_ids, kept: bool = False) -> torch.Tensor:
        """Split-KV over the step's all-positions lists (V at ``v_ids`` when given, else at the K ids). An all-dense
        step launches as ``SplitConfig.dense_*`` say; a general step's dense layers as the scores plan (two launches).
        ``kept``: a general keep-v step's kept requests over their own lists and plan instead (:meth:`_plan_kept`, V at
        ``v_ids``; the sparse requests' rows of ``out`` get zeros, which :meth:`sparse`'s attention after it overwrites)."""
        from sglang_elastic.kernels.decode_attention import split_kv_fused_run, split_kv_run
        from sglang_elastic.kernels.offload import attend_run

        bs, sp = self.bs, self.split
        if kept:
            tuned, bn, indptr, kidx, chunk, nsplit = (self.kd_tuned, self.kd_block_n, self.kd_indptr, self.kd_kidx, self.kd_chunk,
                                                      self.kd_nsplit)
        else:  # (dense_tuned: an all-dense step)
            tuned, bn, indptr, kidx, chunk, nsplit = self.dense_tuned, self.plan_block_n, self.kv_indptr, self.kv_indices, self.chunk, self.nsplit
        launch = dict(num_warps=sp.dense_num_warps, num_stages=sp.dense_num_stages) if tuned else {}
        pdl = sp.dense_pdl and tuned
        indptr, chunk, nsplit, ms = indptr[: bs + 1], chunk[:bs], nsplit[:bs], sp.scores_max_splits
        if sp.dense_fused and tuned:
            return split_kv_fused_run(q, k_buffer, v_buffer, indptr, kidx, chunk, ms, self.mid_o, self.mid_lse, out, self.counters,
                                      sm_scale, bn, v_indices=v_ids, pdl=pdl, **launch)
        if v_ids is None:
            return split_kv_run(q, k_buffer, v_buffer, indptr, kidx, chunk, nsplit, ms, self.mid_o, self.mid_lse, out, sm_scale, bn,
                                pdl=pdl, **launch)
        return attend_run(q, k_buffer, v_buffer, indptr, kidx, v_ids, chunk, nsplit, ms, self.mid_o, self.mid_lse, out, None,
                          sm_scale, bn, pdl=pdl, **launch)

    def _select(self, ws: _Selection, q, k_buffer, v_buffer, sm_scale, req_to_token, rp, lens, hot_state, host_v, att_kidx, att_vidx,
                spec: bool, mark: bool = False, record: Optional[tuple] = None, clock=None):
        from sglang_elastic.kernels.offload import copy_rows_run, gather_selected_run, lse_merge, scores_run, select_run, swap_in_run

        bs, sp, pol, lay = self.bs, self.split, self.policy, self.layout
        scores_run(q, k_buffer, self.sc_indptr[: bs + 1], self.sc_indices, self.sc_chunk[:bs], sp.scores_max_splits, ws.scores,
                   ws.score_lse, sm_scale, sp.scores_block_n, num_warps=sp.scores_num_warps, num_stages=sp.scores_num_stages)
        stamp = self.stamp if mark else None
        lse = lse_merge(ws.score_lse, bs, sp.scores_max_splits, ws.lse_full, stamp=stamp)
        select_run(ws.scores, lse, self.sc_indptr[: bs + 1], self.s_eff[:bs], self.w_eff[:bs], self.k[:bs], ws.p_buf,
                   ws.sel_pos, self.q_heads, sp.select_block_n, sp.select_parts, ws.sel_hist, ws.sel_counts,
                   marks=self.marks if mark else None, stamp=stamp)
        if lay.resident_v:
            gather_selected_run(ws.sel_pos, self.k[:bs], self.s_eff[:bs], self.w_eff[:bs], self.att_indptr, rp, req_to_token,
                                att_kidx, att_vidx, pol.max_topk)
        else:
            h = hot_state
            swap_in_run(ws.sel_pos, self.k[:bs], self.s_eff[:bs], self.w_eff[:bs], self.att_indptr, lens, rp, req_to_token,
                        h.loc_slot, h.slot_pos, h.slot_time, ws.scratch, att_kidx, att_vidx, ws.miss_src, ws.miss_dst,
                        ws.miss_cnt, ws.stats, pol.max_topk, h.table, h.count, h.base, h.page, spec=spec, eviction=lay.eviction,
                        spare_row=h.spare)
            if clock is not None:  # --kv-offload-copy-timing: events around the copy (sglang_elastic.offload.copytime)
                clock(0)
            copy_rows_run(host_v, v_buffer, ws.miss_src[:bs], ws.miss_dst[:bs], counts=ws.miss_cnt[:bs])
            if clock is not None:
                clock(1)
            if record is not None:  # this step's copies and selection per request row, for the adaptive hot pages
                rows64 = rp.to(torch.int64)
                miss = ws.miss_cnt[:bs].to(record[0].dtype)
                if record[2]:  # the exact pass after this layer's prefetch: its loads + these misses
                    record[0].index_add_(0, rows64, miss)
                else:
                    record[0].index_copy_(0, rows64, miss)
                record[1].index_copy_(0, rows64, self.k[:bs].to(record[1].dtype))
        return lse

    def sparse(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, out: torch.Tensor, sm_scale: float,
               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
               hot_state=None, host_v: Optional[torch.Tensor] = None, v_summary: Optional[tuple] = None,
               record: Optional[tuple] = None, clock=None) -> torch.Tensor:
        """Attention of a sparse layer over sink, window and the top-k rows
        (``estimate``: plus the unattended rows' share through their chunks' mean V).

        Args:
            q: ``[bs, q_heads, head_dim]`` bf16/fp16; k_buffer: the pool's K of the layer,
                ``[slots, kv_heads, head_dim]``, q's dtype.
            v_buffer: the layer's hot-buffer V rows (or, resident, the pool's V), ``[rows, kv_heads, head_dim]``.
            out: ``[bs, q_heads, head_dim]``, q's dtype, written (and returned).
            sm_scale: the softmax scale (SGLang's ``layer.scaling``).
            req_to_token, req_pool_indices, seq_lens: SGLang's ``[rows, context]`` int32 token ids, ``[bs]``
                request rows and ``[bs]`` lengths (this step's token included).
            hot_state: the layer's :class:`~sglang_elastic.offload.pool.HotState` (not resident; its
                page table must cover this step's selection: :meth:`grant_pages`).
            host_v: the layer's host V rows seen by the GPU (not resident).
            v_summary: ``(vsum, chunk_slot)``, the layer's V summaries and their slots
                (:meth:`OffloadKVPool.summaries`; ``estimate`` only).
            record: ``(row_miss, row_sel, add)`` ``[rows]`` int32: this step's misses (added to what the
                layer's prefetch recorded when ``add``) and selected rows at each request's row
                (:meth:`OffloadKVPool.miss_record`, the adaptive hot pages), or None.
            clock: ``f(0)`` / ``f(1)`` called around the miss copy (records timing events:
                :meth:`sglang_elastic.offload.copytime.CopyTimer.clock`), or None.

        Returns:
            ``out``.

        Raises:
            ValueError: ``estimate`` without ``v_summary``.
        """
        from sglang_elastic.kernels.offload import attend_run, estimate_run

        bs, sp, pol = self.bs, self.split, self.policy
        rp, lens = req_pool_indices[:bs], seq_lens[:bs]
        if self.estimate and v_summary is None:
            raise ValueError("--kv-offload-denominator estimate: OffloadDecoder.sparse needs the layer's V summaries (v_summary)")
        side = self._kept_stream
        if self.keep_v:  # the kept requests first, in their own launch; the sparse attention below leaves their rows
            if side is None:
                self._every_position(q, k_buffer, v_buffer, out, sm_scale, self.kd_vidx, kept=True)
            else:  # (dense_kept_stream) beside the selection, which touches none of its buffers; joined before the attention
                cur = torch.cuda.current_stream(side.device)
                side.wait_stream(cur)
                with torch.cuda.stream(side):  # (q and out need no record_stream: the step's stream joins below, before any reuse)
                    self._every_position(q, k_buffer, v_buffer, out, sm_scale, self.kd_vidx, kept=True)
        lse = self._select(self.sel, q, k_buffer, v_buffer, sm_scale, req_to_token, rp, lens, hot_state, host_v,
                           self.att_kidx, self.att_vidx, spec=False, mark=self.estimate, record=record, clock=clock)
        est = None
        if self.estimate:  # the unattended share's per-split partials, added by the attention's merge (no launch of their own)
            vsum, table = v_summary
            est = estimate_run(self.sel.scores, lse, self.sc_indptr[: bs + 1], self.sc_chunk[:bs], sp.scores_max_splits,
                               self.s_eff[:bs], self.w_eff[:bs], self.k[:bs], self.marks, vsum, rp, table,
                               pol.chunk, self.est_o, self.kv_heads, stamp=self.stamp, reduce=False)
        if side is not None:  # the kept launch shares the partials' workspace and out with the attention
            torch.cuda.current_stream(side.device).wait_stream(side)
        attend_run(q, k_buffer, v_buffer, self.att_indptr[: bs + 1], self.att_kidx, self.att_vidx, self.att_chunk[:bs],
                   self.att_nsplit[:bs], sp.attend_max_splits, self.mid_o, self.mid_lse, out,
                   None if pol.denominator == "selected" else lse, sm_scale, sp.attend_block_n,
                   extra=est, extra_splits=sp.scores_max_splits, extra_count=self.sc_nsplit[:bs], skip_empty=self.keep_v)
        return out

    def prefetch(self, q_spec: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, sm_scale: float,
                 req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, hot_state, host_v,
                 record: Optional[tuple] = None, clock=None) -> None:
        """Load the V rows a sparse layer will probably select, before its own pass runs
        (``record``: as :meth:`sparse`'s; the prefetch's loads are written, the exact pass adds its misses;
        ``clock``: as :meth:`sparse`'s, around the prefetch's copy).

        The InfiniGen idea (arXiv 2406.19707): consecutive layers' attention
        inputs are nearly parallel, so layer ``l``'s input through layer
        ``l + 1``'s query weights and RoPE (``q_spec``) ranks layer ``l + 1``'s
        tokens almost as its own query will. The same exact scoring and top-k
        as :meth:`sparse` run on ``q_spec`` against the layer's full K (no
        partial weights: K is resident), and the misses are copied into the
        hot buffer (:func:`~sglang_elastic.kernels.offload.swap_in_run` with
        ``spec``). The layer's own pass then finds them as hits; a wrong
        guess costs copies, never accuracy. Run it on a side stream while
        the layer before computes.

        Raises:
            RuntimeError: the decoder was built without ``prefetch`` buffers.
        """
        if self.spec is None:
            raise RuntimeError("OffloadDecoder(prefetch=True) keeps the prefetch's buffers")
        bs = self.bs
        self._select(self.spec, q_spec, k_buffer, v_buffer, sm_scale, req_to_token, req_pool_indices[:bs], seq_lens[:bs],
                     hot_state, host_v, self.spec.att_kidx, self.spec.att_vidx, spec=True,
                     record=None if record is None else (record[0], record[1], False), clock=clock)


__all__ = ["DENSE_LAUNCH_KEYS", "OffloadDecoder", "SplitConfig"]
