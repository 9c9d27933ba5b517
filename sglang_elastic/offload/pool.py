"""The KV pool of the offload path: K of every token on the GPU, V of the
sparse layers in pinned host memory plus per-request hot buffers.

:class:`OffloadKVPool` is SGLang's ``MHATokenToKVPool``
(``sglang/srt/mem_cache/memory_pool.py``) with other V buffers:

- ``k_buffer[l]``: ``[size + page, kv_heads, head_dim]`` for every layer, as
  stock (token id = row; SGLang's allocators, admission, radix cache and
  ``max_total_num_tokens`` count these ids);
- dense layers (``l < policy.dense_layers``) keep ``v_buffer[l]`` of the same
  shape (they attend to everything every step);
- sparse layers: V of every token in :class:`~.host_pool.HostVPool` (row =
  token id), and ``v_buffer[l]`` is ``[rows * R + pages * P + 1, kv_heads,
  v_head_dim]``: request row ``r`` (its ``req_to_token`` row) owns the
  fixed rows ``[r * R, (r + 1) * R)`` with ``R = sink + window`` (``sink``
  rows for positions ``< sink``, a ring of ``window`` rows: position ``p`` at
  ``sink + p % window``) and the hot-buffer pages its page table lists
  (``hot_table[r]``, ``hot_count[r]`` of them, ``P = hot_page`` rows each,
  after the fixed rows): LRU slot ``s`` is row ``rows * R + hot_table[r, s //
  P] * P + s % P`` (``slot_pos`` / ``slot_time`` / ``loc_slot``,
  :func:`~sglang_elastic.kernels.offload.swap_in_run`). Pages come from one
  free stack on the GPU as a request's selection grows (each decode step's
  plan: :func:`~sglang_elastic.kernels.offload.page_grant_run`, ``slack``
  rows per selected row, at most ``hot_tokens``) and go back with the row
  (``ReqToTokenPool.free``, hooked): the pool holds pages for the tokens
  SGLang can hold (:func:`~sglang_elastic.offload.sizing.hot_pages`), not a
  full buffer per request row. With ``keep_v`` (``--kv-offload-keep-v``, on by
  default) a sparse layer's K and V share one buffer of ``[hot_rows + size +
  page, kv_heads, head_dim]`` (``hot_rows = rows * R + pages * P + 1``):
  ``v_buffer[l]`` is all of it, hot rows first, and ``k_buffer[l]`` the part
  after them, so that a pool slot SGLang's allocator leaves idle holds a kept
  request's V row at ``keep_base + slot`` (:mod:`sglang_elastic.offload.keep`).

Writes (``set_kv_buffer``): K to the pool; for sparse layers V to the host
row of its token id and, when the step's write plan
(:meth:`OffloadKVPool.set_v_rows`) gives one, to the request's sink or ring
row. Reads: decode reads K from the pool and V from the hot buffers; a
prefill whose requests have a prefix (a chunked prompt's later chunks) reads
both through staging buffers the backend fills per layer
(:meth:`OffloadKVPool.stage_layer`).

``resident_v``: V of every layer stays on the GPU (stock shapes, no host
pool): the same selection and kernels over resident V, the reference the
offload path must match exactly.

``estimate`` (``--kv-offload-denominator``): ``vsum[l]`` ``[size // chunk +
rows + 2, kv_heads, v_head_dim]`` holds, per sparse layer, the mean V of each
complete ``chunk``-position chunk of every live request, written when the
chunk completes (by a prefill or a decode step, from the V rows just stored:
:meth:`OffloadKVPool.set_summary_plan`). Slots come from a free stack on the
GPU (``chunk_slot[row, chunk]`` records them) and go back when SGLang frees
the request's row (``ReqToTokenPool.free``, hooked) or a new request takes
it: the means cost ``1 / chunk`` of a V row per token, not per context.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple, Optional

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from sglang_elastic.offload.policy import OffloadPolicy

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class OffloadLayout:
    """The shape of the offload pool beside SGLang's pool arguments.

    Fields: ``policy``; ``hot_tokens`` (the most LRU slots one request may
    hold per sparse layer, ``--kv-offload-hot-tokens``; at least ``policy.max_topk``);
    ``request_rows`` (``req_to_token`` rows, SGLang's padding row included);
    ``stage_tokens`` (rows of each prefix staging buffer: the longest prefix
    a prefill can have, the context length); ``resident_v`` (the all-resident
    reference); ``eviction`` (the hot buffer's victim rule,
    ``--kv-offload-eviction``: ``lru`` or InfiniGen's least-selected ``lfu``,
    :func:`~sglang_elastic.kernels.offload.swap_in_run`); ``hot_slack`` (hot
    rows granted per selected row, ``--kv-offload-hot-slack``, 1 to 16);
    ``hot_page`` (rows per hot-buffer page); ``hot_slack_max`` (``--kv-offload-hot-slack-max``:
    the most rows per selected row a request's hot buffer grows to while its selection
    keeps missing, in pages nobody needs now, given back when the pool runs short;
    0: no growth, :func:`~sglang_elastic.kernels.offload.page_adapt_run`); ``keep_v`` (``--kv-offload-keep-v``: a
    request keeps its V in idle pool slots while SGLang's allocator has them, and
    attends densely: :mod:`sglang_elastic.offload.keep`); ``hint_by_row`` (SGLang's radix cache on):
    the hot buffers' slot hint ``loc_slot`` is kept per request row and position (``[rows,
    stage_tokens]`` per sparse layer) instead of per token id. With the radix cache, requests share
    a cached prefix's token ids; a per-token hint then names one request's slot, the others miss
    (the hint is verified against the request's own ``slot_pos``: never a wrong row) and load the
    row again, every step, each moving the hint to its own slot.

    Raises:
        ValueError: ``hot_tokens < policy.max_topk`` or ``>= 32768``, a non-positive
            size or ``hot_page``, an unknown ``eviction``, ``lfu`` with a context of
            2**21 tokens or more, a policy granularity other than ``token``, a slack
            outside [1, 16], a ``hot_slack_max`` below ``hot_slack`` (other than 0) or above 16.
    """

    policy: OffloadPolicy
    hot_tokens: int
    request_rows: int
    stage_tokens: int
    resident_v: bool = False
    eviction: str = "lru"
    hot_slack: float = 2.0
    hot_page: int = 64
    keep_v: bool = False
    hot_slack_max: float = 0.0
    hint_by_row: bool = False

    def __post_init__(self):
        from sglang_elastic.kernels.offload import EVICTIONS, LFU_MAX_LEN

        if self.eviction not in EVICTIONS:
            raise ValueError(f"--kv-offload-eviction must be {' or '.join(EVICTIONS)}, not {self.eviction!r}")
        if self.eviction == "lfu" and self.stage_tokens >= LFU_MAX_LEN:
            raise ValueError(f"--kv-offload-eviction lfu packs a slot's last use in 21 bits: a context of {self.stage_tokens} tokens is too long")
        if self.policy.granularity != "token":
            raise ValueError(f"the offload kernels select one set of token rows per request (granularity 'token'), "
                             f"not {self.policy.granularity!r}: that one is the float64 reference's only")
        if self.hot_tokens < self.policy.max_topk:
            raise ValueError(f"--kv-offload-hot-tokens {self.hot_tokens} must be at least --kv-offload-topk {self.policy.max_topk}")
        if self.request_rows < 1 or self.stage_tokens < 1:
            raise ValueError(f"offload layout needs request_rows and stage_tokens >= 1, not {self.request_rows}, {self.stage_tokens}")
        if self.hot_tokens >= 32768:
            raise ValueError(f"--kv-offload-hot-tokens {self.hot_tokens} must be below 32768 (slots are int16)")
        if not 1.0 <= self.hot_slack <= 16.0:
            raise ValueError(f"--kv-offload-hot-slack must be between 1 and 16 (hot rows per selected row), not {self.hot_slack}")
        if self.hot_page < 1:
            raise ValueError(f"hot_page must be >= 1, not {self.hot_page}")
        if self.hot_slack_max and not self.hot_slack <= self.hot_slack_max <= 16.0:
            raise ValueError(f"--kv-offload-hot-slack-max must be 0 (off) or between --kv-offload-hot-slack {self.hot_slack} and 16, "
                             f"not {self.hot_slack_max}")

    @property
    def adaptive(self) -> bool:
        """Hot buffers grow past ``hot_slack`` while their selection misses (``hot_slack_max``)."""
        from sglang_elastic.offload.sizing import slack_64ths

        return bool(self.hot_slack_max) and slack_64ths(self.hot_slack_max) > slack_64ths(self.hot_slack)

    @property
    def lru_base(self) -> int:
        return self.policy.sink + self.policy.window

    @property
    def region_rows(self) -> int:
        """Fixed device V rows per request row (sink and window ring); the LRU slots live in pages."""
        return self.lru_base

    @property
    def max_pages(self) -> int:
        """Pages one request may hold (its ``hot_tokens`` slots)."""
        return -(-self.hot_tokens // self.hot_page)

    def pages_for(self, tokens: int) -> int:
        """Hot-buffer pages of a pool of ``tokens`` token ids (:func:`~sglang_elastic.offload.sizing.hot_pages`)."""
        from sglang_elastic.offload.sizing import hot_pages

        return hot_pages(self.policy, tokens, self.request_rows, self.hot_tokens, self.hot_slack, self.hot_page)

    @property
    def summary_chunks(self) -> int:
        """Chunks of the longest context (``estimate``; else 0): the columns of the pool's slot table."""
        if self.policy.denominator != "estimate":
            return 0
        return -(-self.stage_tokens // self.policy.chunk)

    def sparse_layers(self, layer_num: int):
        return [l for l in range(layer_num) if not self.policy.is_dense_layer(l)]


class OffloadKVPool(MHATokenToKVPool):
    """``MHATokenToKVPool`` whose sparse layers keep V on the host.

    Args:
        layout: :class:`OffloadLayout`.
        pin_memory: pin the host pool (``cudaHostRegister``; False on a CPU).
        *args, **kwargs: ``MHATokenToKVPool``'s (``size`` = token ids, as SGLang sized them).

    Raises:
        NotImplementedError: a quantized KV cache, the HND layout, or a
            layer range (pipeline parallelism).
        ValueError: not enough host memory for the V rows (SGLang's check).
        RuntimeError: the host V pool could not be allocated or pinned (one
            ``sglang-elastic:`` line with the size and the flag to lower, :class:`~.host_pool.HostVPool`).
    """

    def __init__(self, *args, layout: OffloadLayout, pin_memory: bool = True, **kwargs):
        self.layout = layout
        super().__init__(*args, **kwargs)
        if self.is_quantized_kv_cache or self.use_hnd or self.kv_cache_layout != "nhd":
            raise NotImplementedError("the KV offload pool keeps SGLang's default NHD layout without KV quantization")
        if self.start_layer != 0:
            raise NotImplementedError("the KV offload pool holds every layer of the model (no pipeline parallelism)")
        self.sparse_layer_ids = [] if layout.resident_v else layout.sparse_layers(self.layer_num)
        self._sparse = set(self.sparse_layer_ids)
        dev = self.device
        n_sparse = len(self.sparse_layer_ids)
        rows = layout.request_rows
        # hot-buffer state, per sparse layer (index: position in sparse_layer_ids)
        self.slot_pos = torch.full((n_sparse, rows, layout.hot_tokens), -1, dtype=torch.int32, device=dev)
        self.slot_time = torch.full((n_sparse, rows, layout.hot_tokens), -1, dtype=torch.int32, device=dev)
        hint = (rows, layout.stage_tokens) if layout.hint_by_row else (self.size + self.page_size,)  # per row and position, or per token id
        self.loc_slot = torch.full((n_sparse, *hint), -1, dtype=torch.int16, device=dev)
        # hot-buffer pages (one table for every sparse layer): a free stack on the GPU, granted by the decode plan
        self.hot_table = torch.full((rows, layout.max_pages), -1, dtype=torch.int32, device=dev)
        self.hot_count = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.page_stack = torch.arange(self.hot_pages, dtype=torch.int32, device=dev)
        self.page_top = torch.full((1,), self.hot_pages, dtype=torch.int32, device=dev)
        #: grants that found too few free pages (should stay 0: the pool is sized for every running request)
        self.page_overflow = torch.zeros(1, dtype=torch.int32, device=dev)
        # adaptive hot pages (--kv-offload-hot-slack-max): per request row its slack (64ths), decode steps, and the
        # first sparse layer's misses / selected rows of its last step; the step's base demand; pages taken back
        self.adaptive = bool(self.hot_pages) and layout.adaptive and n_sparse > 0
        if self.adaptive:
            from sglang_elastic.offload.sizing import slack_64ths

            i32 = dict(dtype=torch.int32, device=dev)
            self.row_slack64 = torch.full((rows,), slack_64ths(layout.hot_slack), **i32)
            self.row_steps = torch.zeros(rows, **i32)
            self.row_miss = torch.zeros(rows, **i32)
            self.row_sel = torch.zeros(rows, **i32)
            self.page_demand = torch.zeros(1, **i32)
            self.page_taken = torch.zeros(1, **i32)
        self._sparse_index = {l: i for i, l in enumerate(self.sparse_layer_ids)}
        self.host = None
        if n_sparse:
            from sglang_elastic.offload.host_pool import HostVPool

            self.host = HostVPool(self, self.sparse_layer_ids, pin_memory=pin_memory)
        # prefix staging (one layer at a time)
        self.k_stage = torch.zeros((layout.stage_tokens, self.head_num, self.head_dim), dtype=self.store_dtype, device=dev)
        self.v_stage = torch.zeros((layout.stage_tokens, self.head_num, self.v_head_dim), dtype=self.store_dtype, device=dev)
        self.stage_active = False
        #: this forward's device V row of each written token (sparse layers), or None
        self._v_rows: Optional[torch.Tensor] = None
        # V summaries (``estimate``), per sparse layer of the policy (also when resident): slots from a free
        # stack on the GPU, one per complete chunk of a live request (at most size // chunk of them);
        # slot SPARE takes writes that keep nothing, ZERO (never written) reads as zeros
        self.summary_layer_ids = layout.sparse_layers(self.layer_num) if layout.summary_chunks else []
        n_slots = self.size // layout.policy.chunk + layout.request_rows if self.summary_layer_ids else 0
        self.summary_slots, self.SPARE, self.ZERO = n_slots, n_slots, n_slots + 1
        self.vsum = {l: torch.zeros((n_slots + 2, self.head_num, self.v_head_dim), dtype=self.store_dtype, device=dev)
                     for l in self.summary_layer_ids}
        i32 = dict(dtype=torch.int32, device=dev)
        cols = layout.summary_chunks if self.summary_layer_ids else 0
        self.chunk_slot = torch.full((layout.request_rows, max(cols, 1)), self.ZERO, **i32)
        self.slot_count = torch.zeros(layout.request_rows, **i32)
        self.slot_stack = torch.arange(n_slots, **i32)
        self.slot_top = torch.full((1,), n_slots, **i32)
        #: chunks that found no free slot (their estimate reads zeros); should stay 0
        self.slot_overflow = torch.zeros(1, **i32)
        self._summary_plan = None
        self._prefix_fill = None  # this prefill's prefix rebuild (plan_prefix), applied per layer by stage_layer
        self._release_pending = []  # request rows SGLang freed, returned at the next forward (on its stream)
        # ``keep_v``: the V row (in the sparse layers' shared K/V buffers) of each position of a dense
        # request, and how many leading positions have one; the CPU mirror of keep_len for the prefill's plan
        self.keep_v = self.keep_base is not None
        self.req_to_vrow = torch.full((rows, layout.stage_tokens), -1, dtype=torch.int32, device=dev) if self.keep_v else None
        if self.keep_v:  # SGLang's padding row 0 (CUDA-graph padding entries) names its own fixed V row 0: never read as a kept
            self.req_to_vrow[0] = 0  # row, only by an all-dense step's padding, whose output is dropped
        self.keep_len = torch.zeros(rows, dtype=torch.int32, device=dev) if self.keep_v else None
        self.keep_len_cpu = [0] * rows
        self._v_keep_rows: Optional[torch.Tensor] = None
        # a decode step's host V writes, off the critical path (set_host_writes_async): copied from the new
        # tokens' ring rows on a side stream while the layer's attention runs, joined once per step
        self._host_async = False
        self._host_async_ok = layout.policy.window > 0  # every new decode token then has a ring row to copy from
        self._host_stream = torch.cuda.Stream(device=dev) if torch.device(dev).type == "cuda" and self.sparse_layer_ids else None
        self._host_pending = False

    # --------------------------------------------------------------- buffers

    def _create_buffers_normal(self):
        rows = self.size + self.page_size
        lay = self.layout
        self.hot_pages = 0 if lay.resident_v else lay.pages_for(self.size)
        self.hot_base = lay.request_rows * lay.region_rows  # the first page's row
        hot_rows = self.hot_base + self.hot_pages * lay.hot_page + 1  # + a row that padded writes may hit
        # keep_v: a sparse layer's hot V rows and K share one buffer, hot rows first, so that a
        # pool slot SGLang's allocator lends holds a V row at row keep_base + slot of the layer's V
        keep = lay.keep_v and not lay.resident_v and self.head_dim == self.v_head_dim
        self.keep_base = hot_rows if keep else None
        self.k_buffer, self.v_buffer = [], []
        for l in range(self.layer_num):
            full = lay.resident_v or lay.policy.is_dense_layer(l)
            if keep and not full:
                kv = torch.zeros((hot_rows + rows, self.head_num, self.head_dim), dtype=self.store_dtype, device=self.device)
                self.k_buffer.append(kv[hot_rows:])
                self.v_buffer.append(kv)
                continue
            self.k_buffer.append(torch.zeros((rows, self.head_num, self.head_dim), dtype=self.store_dtype, device=self.device))
            self.v_buffer.append(torch.zeros((rows if full else hot_rows, self.head_num, self.v_head_dim),
                                             dtype=self.store_dtype, device=self.device))

    def is_sparse_layer(self, layer_id: int) -> bool:
        return (layer_id - self.start_layer) in self._sparse

    def hot_state(self, layer_id: int) -> "HotState":
        """Sparse layer ``layer_id``'s hot-buffer state (:class:`HotState`)."""
        i = self._sparse_index[layer_id - self.start_layer]
        return HotState(self.loc_slot[i], self.slot_pos[i], self.slot_time[i], self.hot_table, self.hot_count, self.hot_base,
                        self.layout.hot_page, self.hot_base + self.hot_pages * self.layout.hot_page)

    def grant_pages(self, rows: torch.Tensor, k: torch.Tensor) -> None:
        """Give each request row of this decode step the pages its selection of
        ``k`` rows needs (GPU ops only: recorded in the decode CUDA graph;
        :func:`~sglang_elastic.kernels.offload.page_grant_run`)."""
        if self.hot_pages:
            from sglang_elastic.kernels.offload import page_grant_run
            from sglang_elastic.offload.sizing import slack_64ths

            lay = self.layout
            if self.adaptive:
                from sglang_elastic.kernels.offload import page_adapt_run

                page_adapt_run(rows, k, self.hot_table, self.hot_count, self.page_stack, self.page_top, self.page_overflow,
                               lay.hot_tokens, lay.hot_page, slack_64ths(lay.hot_slack), slack_64ths(lay.hot_slack_max),
                               self.row_slack64, self.row_steps, self.row_miss, self.row_sel, self.page_demand, self.page_taken,
                               self.slot_pos, self.slot_time, reserve=self.page_reserve)
                return
            page_grant_run(rows, k, self.hot_table, self.hot_count, self.page_stack, self.page_top, self.page_overflow,
                           lay.hot_tokens, lay.hot_page, slack_64ths(lay.hot_slack))

    @property
    def page_reserve(self) -> int:
        """Free hot pages the adaptive growth leaves for admissions: an eighth of the pool (grown
        requests give back under half of it)."""
        return max(2, self.hot_pages // 8)

    def miss_record(self, layer_id: int, add: bool = False):
        """``(row_miss, row_sel, add)`` for the first sparse layer's swap-in when the hot pages adapt
        (:meth:`OffloadDecoder.sparse`'s and :meth:`OffloadDecoder.prefetch`'s ``record``), else None.
        ``add``: the exact pass after a prefetch of the layer adds its misses to the prefetch's loads
        (rows the prefetch loaded are hits of the exact pass, but copies all the same)."""
        if self.adaptive and self.sparse_layer_ids and layer_id - self.start_layer == self.sparse_layer_ids[0]:
            return self.row_miss, self.row_sel, add
        return None

    def get_kv_size_bytes(self):
        k = sum(b.numel() * b.element_size() for b in self.k_buffer)
        v = sum(b.numel() * b.element_size() for b in self.v_buffer)
        if self.keep_base is not None:  # a shared K/V buffer counts its K rows once
            v -= sum(kb.numel() * kb.element_size() for kb, vb in zip(self.k_buffer, self.v_buffer) if vb.shape[0] > kb.shape[0])
        return k, v

    def keep_tables(self):
        """``(req_to_vrow, keep_len)`` for :meth:`OffloadDecoder.plan` (``keep_v``), else None."""
        return (self.req_to_vrow, self.keep_len) if self.keep_v else None

    def set_keep(self, row: int, start: int, rows: Optional[torch.Tensor]) -> None:
        """Row ``row`` keeps V of positions ``[start, start + len(rows))`` at pool slots ``rows``
        (``[n]`` int64 token ids from SGLang's allocator) and has ``start + n`` kept positions;
        ``rows=None``: none any more (the request attends sparsely from now on). GPU writes on the
        current stream, as SGLang writes ``req_to_token`` (:mod:`sglang_elastic.offload.keep`)."""
        if rows is None:
            if self.keep_len_cpu[row]:
                self.keep_len[row] = 0
            self.keep_len_cpu[row] = 0
            return
        n = int(rows.numel())
        if n:
            self.req_to_vrow[row, start: start + n] = (rows.to(self.req_to_vrow.device) + self.keep_base).to(torch.int32)
        self.keep_len[row] = start + n
        self.keep_len_cpu[row] = start + n

    def host_bytes(self) -> int:
        return 0 if self.host is None else self.host.v_buffer.numel() * self.host.v_buffer.element_size()

    # ---------------------------------------------------------------- writes

    def set_v_rows(self, rows: Optional[torch.Tensor], keep_rows: Optional[torch.Tensor] = None) -> None:
        """This forward's device V row per written token (int32/int64, ``-1``:
        host only), aligned with the ``loc`` that ``set_kv_buffer`` receives;
        ``None``: host only. ``keep_rows`` (``keep_v``): a second row per token in
        the shared K/V buffer (a dense request's kept V; ``-1``: none), or None."""
        self._v_rows = rows
        self._v_keep_rows = keep_rows

    def set_host_writes_async(self, on: bool) -> None:
        """A decode step's V goes to the host off the critical path (the backend sets it per forward:
        on for a decode step, off for a prefill, whose middle tokens have no device row). The layer's
        store writes K, the ring / sink row and the kept row; a side stream then copies the new
        tokens' ring rows to the host pool while the layer's attention runs (GPU-initiated PCIe
        stores, ~2 KiB a token and sparse layer), and :meth:`join_host_writes` makes the step's
        stream wait for them once, after its last layer. Nothing reads a token's host row before
        that: the step attends to its newest tokens through the ring, and later steps come after
        the join. Without a GPU the copy runs inline; without a ring (``window`` 0, which the flags refuse)
        the store writes the host itself."""
        self._host_async = bool(on) and self._host_async_ok

    def join_host_writes(self) -> None:
        """The current stream waits for the step's side-stream host writes (:meth:`set_host_writes_async`);
        nothing to wait for: nothing done. Inside a CUDA-graph capture this is the join of the fork."""
        if self._host_pending:
            torch.cuda.current_stream(self._host_stream.device).wait_stream(self._host_stream)
            self._host_pending = False

    def _host_write_async(self, layer_idx: int, loc: torch.Tensor, n: int) -> None:
        """V of this step's ``n`` new tokens from their ring rows to the host pool, on the side stream (inline without one)."""
        from sglang_elastic.kernels.offload import copy_rows_run

        src, dst = self.v_buffer[layer_idx], self.host.view(layer_idx)
        side = self._host_stream
        if side is None:
            copy_rows_run(src, dst, self._v_rows, loc, n=n)
            return
        cur = torch.cuda.current_stream(side.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            copy_rows_run(src, dst, self._v_rows, loc, n=n)
        if not torch.cuda.is_current_stream_capturing():  # an eager step's loc is a temporary of the current stream
            loc.record_stream(side)
        self._host_pending = True

    def _store_kv_layer(self, layer_idx: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor):
        if layer_idx not in self._sparse:
            super()._store_kv_layer(layer_idx, loc, cache_k, cache_v)
        else:
            from sglang_elastic.kernels.offload import store_sparse_run

            # one launch: K to the pool, V to the host pool (or, a decode step, later from the ring row on a side
            # stream), to the ring/sink row and to the kept row, and a decode step's completed chunk means
            # ((src, dst) of device rows; a prefill's plan has more)
            plan = self._summary_plan
            fused = plan is not None and len(plan) == 2 and layer_idx in self.vsum
            # a decode step's chunk rows are device rows of the layer's V (ring / sink rows, or an all-dense step's kept rows)
            summary = (plan[0], plan[1], self.vsum[layer_idx], self.SPARE) if fused else None
            async_host = self._host_async and self._v_rows is not None
            store_sparse_run(cache_k, cache_v, self.k_buffer[layer_idx], self.host.view(layer_idx), self.v_buffer[layer_idx],
                             loc, self._v_rows, self._v_keep_rows, summary=summary, host=not async_host)
            if async_host:
                self._host_write_async(layer_idx, loc, int(cache_k.shape[0]))
            if fused:
                return
        if self._summary_plan is not None and layer_idx in self.vsum:
            self._write_summaries(layer_idx, cache_v)

    # ------------------------------------------------------------- summaries

    def set_summary_plan(self, plan) -> None:
        """The chunks whose V summary this forward completes: a decode step's
        ``(src, dst)`` with ``src`` ``[n, chunk]`` int64 rows of the layer's
        device V (a chunk's positions, in order: sink / ring rows, an all-dense
        step's kept rows, or token ids when V is resident; never host rows)
        and ``dst`` ``[n]`` int64 summary rows (the spare last row for an entry
        that completes nothing); a prefill's ``(src, dst, new_items, new_rows,
        old_items)`` has token ids and says which items to average from the
        forward's own V (:meth:`plan_extend_summaries`) — or ``None``. Written by every
        ``set_kv_buffer`` of a sparse layer after its V is stored
        (:meth:`plan_extend_summaries`, :meth:`OffloadDecoder.summary_plan`)."""
        self._summary_plan = plan

    def _write_summaries(self, layer_idx: int, cache_v: torch.Tensor) -> None:
        """Each planned chunk's mean V into its slot. A prefill's chunks that
        lie inside this forward's new tokens are averaged from ``cache_v``
        (still on the GPU, the same bf16 values as stored); the others (a
        chunk straddling a prompt chunk's start; a decode step's chunk of a
        layer whose V is in the pool, ``resident_v``) read their rows back from
        where they are stored. A sparse layer's decode step makes its means in
        its store launch (:meth:`_store_kv_layer`), with the same sums."""
        plan = self._summary_plan
        src, dst = plan[0], plan[1]
        if src.shape[0] == 0:
            return
        H, D = self.head_num, self.v_head_dim
        out = self.vsum[layer_idx]
        if len(plan) == 2:  # a decode step (inside the CUDA graph) of a layer whose V is in the pool: one launch
            from sglang_elastic.kernels.offload import chunk_mean_run

            chunk_mean_run(self.v_buffer[layer_idx], src, dst, out, skip=self.SPARE)
            return
        new_items, new_rows, old_items = plan[2:]  # a prefill: (src, dst, new_items, new_rows, old_items)
        if new_items.shape[0]:
            out[dst[new_items]] = cache_v[new_rows.reshape(-1)].view(new_rows.shape[0], new_rows.shape[1], H, D).float().mean(1).to(self.store_dtype)
        if old_items.shape[0] == 0:
            return
        src, dst = src[old_items], dst[old_items]
        v = self.host.view(layer_idx) if layer_idx in self._sparse else self.v_buffer[layer_idx]
        rows = v[src.reshape(-1)].view(src.shape[0], src.shape[1], H, D)
        out[dst] = rows.float().mean(1).to(self.store_dtype)

    def summaries(self, layer_id: int):
        """``(vsum, chunk_slot)`` of a sparse layer (``estimate``), else None: what
        :meth:`OffloadDecoder.sparse` reads as ``v_summary``."""
        v = self.vsum.get(layer_id - self.start_layer)
        return None if v is None else (v, self.chunk_slot)

    def assign_summary_slots(self, rows: torch.Tensor, chunks: torch.Tensor, valid: torch.Tensor, dst: Optional[torch.Tensor] = None):
        """Slots for chunks completed this forward (GPU ops only: the decode
        step's plan runs it inside the CUDA graph): ``[n]`` int64, the slot
        each item fills (``SPARE`` where ``valid`` is 0), recorded in
        ``chunk_slot[row, chunk]`` (:func:`~sglang_elastic.kernels.offload.slot_assign_run`)."""
        from sglang_elastic.kernels.offload import slot_assign_run

        dst = torch.empty(rows.shape[0], dtype=torch.int64, device=self.device) if dst is None else dst
        return slot_assign_run(rows, chunks, valid, self.chunk_slot, self.slot_count, self.slot_stack, self.slot_top,
                               self.slot_overflow, dst, self.SPARE, self.ZERO)

    def release_rows(self, rows) -> None:
        """Return request rows' hot-buffer pages and summary slots to their
        free stacks and forget their hot slots: now (on the current stream) for
        a tensor; for a list (SGLang freed the rows, from ``ReqToTokenPool.free``),
        at the next forward (:meth:`flush_releases`)."""
        if not self.summary_layer_ids and not self.hot_pages and not self.slot_pos.shape[0]:
            return
        if isinstance(rows, torch.Tensor):
            from sglang_elastic.kernels.offload import slot_release_run

            rows = rows.to(device=self.device, non_blocking=True)
            if self.summary_layer_ids:
                slot_release_run(rows, self.chunk_slot, self.slot_count, self.slot_stack, self.slot_top, self.ZERO)
            if self.hot_pages:
                slot_release_run(rows, self.hot_table, self.hot_count, self.page_stack, self.page_top, -1)
            if self.slot_pos.shape[0]:  # no slot of a freed row may look valid to the row's next request, whatever pages it gets
                r64 = rows.to(torch.int64)
                self.slot_pos.index_fill_(1, r64, -1)
                self.slot_time.index_fill_(1, r64, -1)
            if self.adaptive:  # the row's next request starts at the base slack with no history
                from sglang_elastic.offload.sizing import slack_64ths

                self.row_slack64.index_fill_(0, rows, slack_64ths(self.layout.hot_slack))
                for t in (self.row_steps, self.row_miss, self.row_sel):
                    t.index_fill_(0, rows, 0)
        else:
            self._release_pending.extend(int(r) for r in rows)

    def flush_releases(self) -> None:
        """Release the rows SGLang freed since the last forward (the backend calls it first in every forward).
        The row list goes to the GPU from pinned memory without a host sync: under SGLang's overlap
        scheduler the previous forward is still running when this one is prepared."""
        if self._release_pending:
            # swap, not copy-then-clear: SGLang's scheduler thread may append while the forward thread flushes
            pending, self._release_pending = self._release_pending, []
            pin = torch.device(self.device).type == "cuda"
            self.release_rows(torch.tensor(sorted(set(pending)), dtype=torch.int64, pin_memory=pin))

    def plan_extend_summaries(self, req_pool_indices: torch.Tensor, prefix_lens_cpu, extend_lens_cpu, req_to_token: torch.Tensor):
        """The summary plan of a prefill (``None`` without ``estimate`` or when
        no chunk completes): request row ``r`` extended over positions
        ``[prefix, prefix + extend)`` completes chunks ``prefix // C`` to
        ``(prefix + extend) // C - 1``, each given a slot here. A chunk inside
        the new tokens is averaged from the forward's own V (``cache_v``,
        rows in batch order, as ``out_cache_loc`` lists the tokens); one that
        straddles the prefix (at most one per request) reads its rows back
        from the host pool once this layer's rows are written.

        Returns:
            ``(src, dst, new_items, new_rows, old_items)`` (see
            :meth:`set_summary_plan`; ``new_rows`` ``[n_new, C]`` are rows of
            ``cache_v``), or None.

        Args:
            req_pool_indices: ``[bs]`` request rows; prefix_lens_cpu, extend_lens_cpu: ``bs`` ints.
            req_to_token: SGLang's ``[rows, context]`` token ids.
        """
        if not self.summary_layer_ids:
            return None
        C = self.layout.policy.chunk
        rows, chunks, first_new = [], [], []  # per item: its request's batch index, chunk, and the row in cache_v of its first position (or -1)
        start = 0  # this request's first token in the forward's new tokens (cache_v rows, batch order)
        for b, (p, e) in enumerate(zip(prefix_lens_cpu, extend_lens_cpu)):
            p, e = int(p), int(e)
            lo, hi = p // C, (p + e) // C
            rows += [b] * (hi - lo)
            chunks += range(lo, hi)
            first_new += [start + c * C - p if c * C >= p else -1 for c in range(lo, hi)]
            start += e
        if not rows:
            return None
        dev = req_to_token.device
        # the request rows from the batch's GPU tensor: no device-to-host read (it would wait for the last forward)
        r_t = req_pool_indices.to(dev, torch.int64)[torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)]
        c_t = torch.tensor(chunks, dtype=torch.int64, device=dev)
        pos = c_t[:, None] * C + torch.arange(C, device=dev)[None, :]
        src = req_to_token[r_t[:, None], pos].to(torch.int64).to(self.device)
        dst = self.assign_summary_slots(r_t.to(self.device), c_t.to(self.device), torch.ones(len(rows), dtype=torch.int32, device=self.device))
        f = torch.tensor(first_new, dtype=torch.int64)
        new_items = torch.nonzero(f >= 0).flatten()
        new_rows = f[new_items][:, None] + torch.arange(C)[None, :]
        old_items = torch.nonzero(f < 0).flatten()
        return src, dst, new_items.to(self.device), new_rows.to(self.device), old_items.to(self.device)

    # --------------------------------------------------------------- staging

    def plan_prefix(self, req_pool_indices: torch.Tensor, prefix_lens_cpu, extend_lens_cpu,
                    req_to_token: torch.Tensor) -> Optional[torch.Tensor]:
        """A prefill's prefixes: their token ids, and what :meth:`stage_layer` rebuilds from them.

        A request's prefix is either its own earlier prompt chunks or, with SGLang's radix
        cache, token ids another request computed (``match_prefix``; SGLang wrote them into
        the request's ``req_to_token`` row). Its row then has no sink or ring rows, no V
        summaries and no kept V of those positions yet. So, per layer, once the prefix is
        staged, the pool writes from the staging buffer:

        - the sink rows (positions ``< sink``) and the ring rows of the prefix positions among
          the last ``window`` of the request after this prefill (the rule of
          :meth:`extend_v_rows`), every time: for an own prefix they are rewritten with the
          values they hold, and where SGLang's radix cache swapped a chunk's ids for a cached
          copy (``cache_unfinished_req``) they then match the ids the request reads;
        - each complete prefix chunk's V mean (``estimate``) where its ``chunk_slot`` entry
          is empty (a cached prefix; an own prefix's chunks already have theirs), decided on
          the GPU;
        - a kept request's V of every prefix position (``keep_v``: rows ``req_to_vrow``, for
          rows whose ``keep_len`` covers this prefill), every time, as the sink rows.

        Args:
            req_pool_indices: ``[bs]`` request rows (on the GPU: never read by the host).
            prefix_lens_cpu, extend_lens_cpu: ``bs`` ints each (SGLang's CPU lists).
            req_to_token: SGLang's ``[rows, context]`` token ids.

        Returns:
            ``[P]`` int64 token ids of every prefix position, requests in batch order (the
            rows of the staging buffers), or None when no request has a prefix.
        """
        self._prefix_fill = None
        pre = [int(x) for x in prefix_lens_cpu]
        ext = [int(x) for x in extend_lens_cpu]
        P = sum(pre)
        if not P:
            return None
        bs = len(pre)
        owner, pos, _ = self.extend_positions([0] * bs, pre)  # stage row i holds position pos[i] of request owner[i]
        end = torch.tensor([p + e for p, e in zip(pre, ext)], dtype=torch.int64)[owner]
        dev = req_to_token.device
        # the rows from the batch's GPU tensor: no device-to-host read (it would wait for the last forward)
        rows = req_pool_indices[:bs].to(dev, torch.int64)[owner.to(dev, non_blocking=True)]
        locs = req_to_token[rows, pos.to(dev, non_blocking=True)].to(torch.int64)
        rows = rows.to(self.device)
        fixed = kept = means = None
        if self.sparse_layer_ids:
            off = self._fixed_offsets(pos, end)
            sel = torch.nonzero(off >= 0).flatten()
            if sel.numel():
                sel_d = sel.to(self.device, non_blocking=True)
                fixed = (sel_d, rows[sel_d] * self.layout.region_rows + off[sel].to(self.device, non_blocking=True))
            if self.keep_v:
                kept = self._kept_rows(rows, pos, end)
        if self.summary_layer_ids:
            C = self.layout.policy.chunk
            pre_t = torch.tensor(pre, dtype=torch.int64)
            n = pre_t // C  # complete chunks of each prefix
            if int(n.sum()):
                b_t = torch.repeat_interleave(torch.arange(bs), n)  # item -> its request, chunk -> its index
                c_t = torch.arange(int(n.sum())) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
                ids = ((torch.cumsum(pre_t, 0) - pre_t)[b_t] + c_t * C)[:, None] + torch.arange(C)[None, :]  # stage rows of each chunk
                r_t = req_pool_indices[:bs].to(self.device, torch.int64)[b_t.to(self.device, non_blocking=True)]
                c_d = c_t.to(self.device, non_blocking=True)
                empty = (self.chunk_slot[r_t, c_d] == self.ZERO).to(torch.int32)
                means = (ids.to(self.device, non_blocking=True), self.assign_summary_slots(r_t, c_d, empty))
        self._prefix_fill = (fixed, kept, means)
        return locs

    def stage_layer(self, layer_id: int, prefix_locs: torch.Tensor) -> None:
        """Gather K and V of ``prefix_locs`` (``[P]`` token ids) of one layer into
        rows ``[0, P)`` of the staging buffers (V of a sparse layer from the
        host pool, over PCIe), then write this layer's sink, ring and kept rows
        and V summaries of the prefixes from them (:meth:`plan_prefix`)."""
        from sglang_elastic.kernels.offload import chunk_mean_run, copy_rows_run

        P = int(prefix_locs.numel())
        if P > self.k_stage.shape[0]:
            raise RuntimeError(f"a prefill's prefixes hold {P} tokens, more than the staging buffers' {self.k_stage.shape[0]}")
        l = layer_id - self.start_layer
        copy_rows_run(self.k_buffer[l], self.k_stage, prefix_locs, None, n=P)
        src_v = self.host.view(l) if l in self._sparse else self.v_buffer[l]
        copy_rows_run(src_v, self.v_stage, prefix_locs, None, n=P)
        fill = self._prefix_fill
        if fill is None:
            return
        fixed, kept, means = fill
        if l in self._sparse:
            if fixed is not None:
                copy_rows_run(self.v_stage, self.v_buffer[l], fixed[0], fixed[1], n=int(fixed[0].numel()))
            if kept is not None:
                copy_rows_run(self.v_stage, self.v_buffer[l], None, kept, n=P)
        if means is not None and l in self.vsum:
            chunk_mean_run(self.v_stage, means[0], means[1], self.vsum[l], skip=self.SPARE)

    def get_kv_buffer(self, layer_id: int):
        if self.stage_active:
            return self.k_stage, self.v_stage
        return super().get_kv_buffer(layer_id)

    def extend_v_rows(self, req_pool_indices: torch.Tensor, prefix_lens_cpu, extend_lens_cpu) -> torch.Tensor:
        """The device V row of each token a prefill writes (``-1``: host only).

        Token ``p`` of request row ``r`` (positions ``[prefix, prefix + extend)``
        of each request, in batch order, as ``out_cache_loc`` lists them) goes
        to its sink row if ``p < sink``, to its ring row ``sink + p % window``
        if it is among the last ``window`` positions of this chunk (the ring
        then holds the last ``window`` positions of the prompt after its last
        chunk), else nowhere on the device.

        Args:
            req_pool_indices: ``[bs]`` request rows.
            prefix_lens_cpu, extend_lens_cpu: ``bs`` ints each (SGLang's CPU lists).

        Returns:
            ``[sum(extend_lens)]`` int64 on the pool's device.
        """
        lay = self.layout
        owner, pos, end = self.extend_positions(prefix_lens_cpu, extend_lens_cpu)
        # the row within the request's region on the CPU (from the CPU lengths), the region on the GPU:
        # no device-to-host read of the request rows (under the overlap scheduler it would wait for the last forward)
        off = self._fixed_offsets(pos, end)
        dev = req_pool_indices.device
        rows = req_pool_indices[: len(extend_lens_cpu)].to(torch.int64)[owner.to(dev, non_blocking=True)]
        off = off.to(dev, non_blocking=True)
        return torch.where(off >= 0, rows * lay.region_rows + off, -1).to(self.device)

    @staticmethod
    def extend_positions(prefix_lens_cpu, extend_lens_cpu):
        """Per token a prefill writes (batch order): its request's index, its position, and its request's end (CPU int64)."""
        ext = torch.tensor([int(x) for x in extend_lens_cpu], dtype=torch.int64)
        pre = torch.tensor([int(x) for x in prefix_lens_cpu], dtype=torch.int64)
        n = int(ext.sum())
        owner = torch.repeat_interleave(torch.arange(len(ext)), ext)
        first = torch.cumsum(ext, 0) - ext
        return owner, pre[owner] + (torch.arange(n) - first[owner]), (pre + ext)[owner]

    def extend_keep_rows(self, req_pool_indices: torch.Tensor, prefix_lens_cpu, extend_lens_cpu) -> Optional[torch.Tensor]:
        """The kept V row of each token a prefill writes (``keep_v``): for a request whose row keeps
        every position up to the end of this chunk (``keep_len``), its ``req_to_vrow`` entries;
        ``-1`` for the others. ``[sum(extend_lens)]`` int64 on the pool's device (GPU ops only, no
        host read), or None without ``keep_v``."""
        if not self.keep_v:
            return None
        owner, pos, end = self.extend_positions(prefix_lens_cpu, extend_lens_cpu)
        dev = self.req_to_vrow.device
        rows = req_pool_indices[: len(extend_lens_cpu)].to(dev, torch.int64)[owner.to(dev, non_blocking=True)]
        return self._kept_rows(rows, pos, end)

    def _fixed_offsets(self, pos: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """Each position's row in its request's fixed region (CPU int64 ``pos`` and its request's ``end``):
        ``pos`` below ``sink``, ``sink + pos % window`` among the last ``window`` before ``end``, else ``-1``."""
        pol = self.layout.policy
        ring = torch.where(pos >= end - pol.window, pol.sink + pos % max(pol.window, 1), torch.full_like(pos, -1))
        return torch.where(pos < pol.sink, pos, ring)

    def _kept_rows(self, rows: torch.Tensor, pos: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """Each position's kept V row (``req_to_vrow``) where its request row (``rows``, on the GPU) keeps every
        position before ``end``, else ``-1`` (int64). GPU reads only: ``keep_len`` and ``req_to_vrow`` were
        written by this batch's grants, earlier on the stream."""
        dev = self.req_to_vrow.device
        pos, end = pos.to(dev, non_blocking=True), end.to(dev, non_blocking=True)
        return torch.where(self.keep_len[rows] >= end, self.req_to_vrow[rows, pos].to(torch.int64), -1)

    # ----------------------------------------------------------- lifecycle

    def reset_requests(self, rows: torch.Tensor) -> None:
        """Forget the hot buffers of request rows ``rows`` (new requests: their
        rows may hold a finished request's slots): :meth:`release_rows`, which
        a row SGLang freed has been through already (then nothing is left).
        ``loc_slot`` entries stay: a hit is only one whose ``slot_pos`` agrees."""
        if rows.numel():
            self.release_rows(rows.to(torch.int64))

    def _clear_buffers(self):
        if self.host is not None:
            self.host.destroy()
            self.host = None
        super()._clear_buffers()


class HotState(NamedTuple):
    """One sparse layer's hot-buffer state, as :func:`~sglang_elastic.kernels.offload.swap_in_run` reads it:
    ``loc_slot`` ``[tokens]`` (a token's slot) or ``[rows, context]`` (a request's position's slot:
    ``hint_by_row``), ``slot_pos`` / ``slot_time`` ``[rows, hot_tokens]``,
    the page table ``table`` ``[rows, max_pages]`` int32 and ``count`` ``[rows]`` int32 (pages held),
    ``base`` (the first page's device row), ``page`` (rows per page) and ``spare`` (the last row, which
    only padded writes and a slot-less selected row touch; -1: none)."""

    loc_slot: torch.Tensor
    slot_pos: torch.Tensor
    slot_time: torch.Tensor
    table: torch.Tensor
    count: torch.Tensor
    base: int
    page: int
    spare: int = -1


__all__ = ["HotState", "OffloadKVPool", "OffloadLayout"]
