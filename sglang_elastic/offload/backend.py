"""The ``kvoffload`` SGLang attention backend: prefill on FlashInfer over the
offload pool, decode on the offload path.

Selected by ``--enable-kv-offload`` (the plugin sets ``--attention-backend
kvoffload``); it needs :class:`~sglang_elastic.offload.pool.OffloadKVPool`
as SGLang's ``token_to_kv_pool`` (built by :mod:`sglang_elastic.offload.hooks`).
Interface: SGLang 0.5.17's ``AttentionBackend``
(``sglang/srt/layers/attention/base_attn_backend.py``).

Prefill (EXTEND): SGLang's own ``FlashInferAttnBackend`` (built through
SGLang's registry, not re-implemented) in its ragged mode: the chunk's new
K/V go to FlashInfer's ragged kernel directly, and, when requests have a
prefix (the later chunks of a chunked prompt, or a prefix SGLang's radix
cache matched), the prefix is read by FlashInfer's paged kernel from staging
buffers that hold, per layer, the prefix's K from the pool and V from the
host pool (``custom_kv_indices`` = staging rows; :meth:`OffloadKVPool.stage_layer`,
which also rebuilds a cached prefix's sink, ring and kept rows and V
summaries in the request's own row: :meth:`OffloadKVPool.plan_prefix`). The pool writes every new
token's K to the GPU, V to the host, and the prompt's first ``sink`` and
each chunk's last ``window`` positions also to the request's hot buffer.
New requests' hot buffers are reset here. With ``--kv-offload-keep-v`` a
request whose V is kept in pool slots (:mod:`sglang_elastic.offload.keep`)
also writes V there, and its decode steps attend to every position.

Decode: :class:`~sglang_elastic.offload.decode.OffloadDecoder` — planned
once per step (recorded in the decode CUDA graph), then per layer split-KV
for the dense layers, or scores / top-k / swap-in / sparse attention for the
others.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext as _nullcontext
from typing import Optional

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from sglang_elastic.offload import NAME
from sglang_elastic.offload.copytime import CRIT, PREFETCH, STALL
from sglang_elastic.offload.decode import OffloadDecoder
from sglang_elastic.offload.pool import OffloadKVPool

logger = logging.getLogger(__name__)
_SUPPORTED_KV_DTYPES = (torch.bfloat16, torch.float16)


def _attn_tp_size() -> int:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().attn_tp_size


class OffloadAttnBackend(AttentionBackend):
    """Prefill through FlashInfer, decode through the offload path.

    Args:
        model_runner: SGLang's ``ModelRunner`` (``token_to_kv_pool`` must be an
            :class:`OffloadKVPool`).

    Raises:
        ValueError: another pool, an MLA / sliding-window / encoder-decoder /
            multimodal model, a KV dtype other than bf16/fp16 (one line each,
            saying to drop ``--enable-kv-offload``).
    """

    needs_cpu_seq_lens: bool = True

    def __init__(self, model_runner):
        super().__init__()
        self._check_supported(model_runner)
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

        self.prefill = ATTENTION_BACKENDS["flashinfer"](model_runner)
        self.device = model_runner.device
        self.pool: OffloadKVPool = model_runner.token_to_kv_pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        mc = model_runner.model_config
        self.q_heads = mc.get_max_num_attention_heads() // _attn_tp_size()
        rows = self.req_to_token.shape[0]
        from sglang_elastic import config

        self.prefetch_on = config.current().offload.prefetch == "speculative" and not self.pool.layout.resident_v
        self.spec_modules = {}
        if self.prefetch_on:
            from sglang_elastic.offload import prefetch as _prefetch

            self.prefetch_on = _prefetch.install(self, model_runner.model)
        layout = self.pool.layout
        if layout.keep_v and not self.pool.keep_v:  # the pool could not share K and V rows (head dims differ)
            import dataclasses

            layout = dataclasses.replace(layout, keep_v=False)
        self.decoder = OffloadDecoder(layout, self.q_heads, self.pool.head_num, self.pool.head_dim, max_bs=rows,
                                      token_capacity=self.pool.size + self.pool.page_size + rows, device=self.device,
                                      split=config.current().offload.split_config(), prefetch=self.prefetch_on)
        self._spec_stream = torch.cuda.Stream() if self.prefetch_on and torch.cuda.is_available() else None
        #: --kv-offload-copy-timing: events around the V copies and prefetch waits (sglang_elastic.offload.copytime)
        self.copy_timer = None
        self._snapshot = None  # the decode-log interval's counters, read without a host sync (stats(sync=False))
        self.snapshot_time = None  # when the counters stats(sync=False) returned last were taken (time.monotonic)
        if config.current().offload.copy_timing and not self.pool.layout.resident_v:
            if torch.cuda.is_available():
                from sglang_elastic.offload.copytime import CopyTimer

                self.copy_timer = CopyTimer()
            else:
                logger.warning("sglang-elastic: --kv-offload-copy-timing times CUDA events; without a GPU it records nothing")
        self._spec_pending = {}  # layer id -> event of its prefetch in this step
        self._spec_done = {}  # layer id -> True: prefetched in this step (its exact pass adds to the prefetch's miss record)
        self._mode = None  # "decode" / "extend" / "idle" of the current forward
        #: --kv-offload-keep-v: an all-dense step runs no selection (eager: the scheduler's grant says so;
        #: CUDA graphs: the graph variant captured for it, sglang_elastic.offload.keep.DENSE_VARIANT)
        self._all_dense = False
        self.graph_variants = False  # set when SGLang's decode graph runner captures the all-dense variant too
        self._prefix_locs: Optional[torch.Tensor] = None
        #: host-side counters (no device read): tokens whose V went to the host, decode steps
        self.prefill_tokens = 0
        self.prefix_tokens = 0  # prefix positions the prefills staged (their V read from the host, per sparse layer)
        self.decode_tokens = 0
        self.decode_steps = 0

    @staticmethod
    def _check_supported(model_runner) -> None:
        drop = "drop --enable-kv-offload"
        if not isinstance(model_runner.token_to_kv_pool, OffloadKVPool):
            raise ValueError(f"the {NAME} attention backend needs the KV offload pool (--enable-kv-offload), "
                             f"not {type(model_runner.token_to_kv_pool).__name__}")
        if getattr(model_runner, "use_mla_backend", False):
            raise ValueError(f"KV offload does not serve MLA models; {drop}")
        if getattr(model_runner, "sliding_window_size", None) is not None:
            raise ValueError(f"KV offload does not serve sliding-window attention; {drop}")
        mc = model_runner.model_config
        if getattr(mc, "is_encoder_decoder", False) or getattr(mc, "is_multimodal", False):
            raise ValueError(f"KV offload serves decoder-only text models; {drop}")
        dtype = getattr(model_runner, "kv_cache_dtype", None)
        if dtype is not None and dtype not in _SUPPORTED_KV_DTYPES:
            raise ValueError(f"KV offload reads bf16/fp16 KV caches, not {dtype}; {drop} or --kv-cache-dtype")

    # ---------------------------------------------------------------- prefill

    def _init_extend(self, fb) -> None:
        from sglang.srt.layers.attention.flashinfer_backend import PrefillMetadata

        pool, fi = self.pool, self.prefill
        bs = fb.batch_size
        prefix_cpu = [int(x) for x in fb.extend_prefix_lens_cpu]
        ext_cpu = [int(x) for x in fb.extend_seq_lens_cpu]
        rows = fb.req_pool_indices[:bs]
        new = [i for i, p in enumerate(prefix_cpu) if p == 0]
        if new:
            pool.reset_requests(rows[torch.tensor(new, device=rows.device)] if len(new) < bs else rows)
        pool.set_host_writes_async(False)  # a prefill's middle tokens have no device row: its store writes the host itself
        pool.set_v_rows(pool.extend_v_rows(rows, prefix_cpu, ext_cpu), pool.extend_keep_rows(rows, prefix_cpu, ext_cpu))
        pool.set_summary_plan(pool.plan_extend_summaries(rows, prefix_cpu, ext_cpu, self.req_to_token))
        total_prefix = sum(prefix_cpu)
        self.prefix_tokens += total_prefix
        custom = None
        # the prefixes' token ids (gathered on the GPU) and what each layer's staging rebuilds from them: the sink, ring
        # and kept rows and the V summaries of a prefix SGLang's radix cache matched (OffloadKVPool.plan_prefix)
        self._prefix_locs = pool.plan_prefix(rows, prefix_cpu, ext_cpu, self.req_to_token)
        if total_prefix:
            custom = torch.arange(total_prefix, dtype=torch.int32, device=self.device)
        fi.indices_updater_prefill.update(
            fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu, fb.seq_lens_sum, fb.extend_prefix_lens,
            prefill_wrappers=fi.prefill_wrappers_paged, use_ragged=True, encoder_lens=None, spec_info=None,
            extend_prefix_lens_cpu=prefix_cpu, custom_kv_indices=custom,
        )
        fi.forward_metadata = PrefillMetadata(fi.prefill_wrappers_paged, True, not total_prefix)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """Prefill attention of one layer (FlashInfer ragged + paged over the staged prefix)."""
        pool = self.pool
        if self._prefix_locs is None:
            return self.prefill.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)
        pool.stage_layer(layer.layer_id, self._prefix_locs)
        pool.stage_active = True
        try:
            return self.prefill.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)
        finally:
            pool.stage_active = False

    # ----------------------------------------------------------------- decode

    def _require(self, fb) -> str:
        mode = fb.forward_mode
        if mode.is_decode_or_idle():
            return "idle" if (mode.is_idle() or fb.batch_size == 0) else "decode"
        if mode.is_extend() and not mode.is_target_verify() and not mode.is_mixed():
            return "extend"
        raise NotImplementedError(f"{NAME} serves EXTEND and DECODE batches, not {mode.name}")

    def _count(self, fb) -> None:
        if self._mode == "extend":
            self.prefill_tokens += int(sum(fb.extend_seq_lens_cpu))
        elif self._mode == "decode":
            self.decode_tokens += fb.batch_size
            self.decode_steps += 1

    def init_forward_metadata(self, forward_batch):
        """Eager step: plan the decode, or set up the prefill (staging, hot-buffer writes)."""
        self._mode = self._require(forward_batch)
        self.pool.join_host_writes()  # (a step cut short before its last layer left them pending)
        self.pool.flush_releases()
        self._count(forward_batch)
        self._all_dense = False
        if self._mode == "decode" and self.pool.keep_v:
            from sglang_elastic.offload import keep

            self._all_dense = keep.dense_step(forward_batch.batch_size)
        self._time_step("eager" if self._mode == "decode" else None)
        if self._mode == "extend":
            self._init_extend(forward_batch)
        elif self._mode == "decode":
            self._plan(forward_batch)

    def _plan(self, fb) -> None:
        bs = fb.batch_size
        self.decoder.plan(self.req_to_token, fb.req_pool_indices, fb.seq_lens, bs, keep=self.pool.keep_tables(),
                          all_dense=self._all_dense)
        self.decoder.grant_pages(self.pool)
        self.pool.set_v_rows(self.decoder.new_token_rows(), self.decoder.new_token_keep_rows())
        self.pool.set_summary_plan(self.decoder.summary_plan(self.pool))
        self.pool.set_host_writes_async(True)  # the new tokens' V to the host beside the attention, joined after the last layer

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        """The decoder's buffers are address-stable already; grow them if the graphs' batch is larger."""
        if max_bs > self.decoder.max_bs:
            d = self.decoder
            self.decoder = OffloadDecoder(d.layout, d.q_heads, d.kv_heads, d.head_dim, max_bs=max_bs,
                                          token_capacity=d.token_capacity + max_bs, device=self.device, split=d.split,
                                          prefetch=d.spec is not None)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        self._mode = self._require(forward_batch)
        if in_capture:  # which graph variant this capture records (the all-dense one: no selection)
            from sglang_elastic.offload import keep

            self._all_dense = self.graph_variants and keep.capturing_dense_variant()
        if not in_capture:
            self._count(forward_batch)
            self.pool.join_host_writes()
            self.pool.flush_releases()  # before the graph's plan pops slots: rows SGLang freed give theirs back
            if self._mode == "decode":  # the variant this replay runs (a full graph ignores the flag; a step that reruns the plan reads it)
                self._all_dense = self._replays_dense(forward_batch)
        if self.copy_timer is not None:
            if self._mode == "decode":
                self._time_step((forward_batch.batch_size, self._all_dense), in_capture)  # (set above for a capture and a replay)
            else:
                self._time_step(None)

    def _replays_dense(self, fb) -> bool:
        """The decode graph about to replay (``fb``: SGLang's replay view, padded to the graph's batch size) is the
        all-dense variant: as :func:`sglang_elastic.offload.keep.around_resolve_variant` picks it, on the raw batch."""
        if not self.graph_variants:
            return False
        from sglang_elastic.offload import keep

        return keep.dense_step(fb.batch_size - (getattr(fb, "num_padding", 0) or 0))

    def _time_step(self, key, capture: bool = False) -> None:
        """--kv-offload-copy-timing: read a finished step's events, then time this forward (``key``: its graph, None: not a decode)."""
        t = self.copy_timer
        if t is None:
            return
        if capture:
            t.begin(key, capture=True)
            return
        t.poll()
        if key is None:
            t.end()
        else:
            t.begin(key)

    def init_forward_metadata_in_graph(self, forward_batch):
        """Recorded in the decode graph: the step's lists and plans (GPU ops only)."""
        if self._mode == "decode":
            self._plan(forward_batch)

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """One layer's decode attention.

        Args:
            q: ``[bs, q_heads * head_dim]``; k, v: ``[bs, kv_heads, head_dim]`` new keys/values.
            layer: SGLang's ``RadixAttention``.

        Returns:
            ``[bs, q_heads * head_dim]`` in ``q``'s dtype.

        Raises:
            NotImplementedError: logit soft-capping (not in these kernels).
        """
        if (layer.logit_cap or 0) > 0:
            raise NotImplementedError(f"{NAME} has no logit soft-cap: drop --enable-kv-offload for this model")
        pool, dec = self.pool, self.decoder
        prefetched = self._spec_done.pop(layer.layer_id, False)
        ev = self._spec_pending.pop(layer.layer_id, None)
        timer = self.copy_timer
        if ev is not None:  # this layer's prefetch ran on the side stream: its hot buffer is ready after it
            if timer is not None:
                timer.mark(layer.layer_id, STALL[0])
            torch.cuda.current_stream().wait_event(ev)
            if timer is not None:
                timer.mark(layer.layer_id, STALL[1])
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v, layer.k_scale, layer.v_scale)
        H, D = layer.tp_q_head_num, layer.head_dim
        q3 = q.reshape(-1, H, D)
        o = q3.new_empty(q3.shape)
        lid = layer.layer_id
        kb = pool.get_key_buffer(lid)
        vb = pool.get_value_buffer(lid)
        if pool.layout.policy.is_dense_layer(lid - pool.start_layer):
            dec.dense(q3, kb, vb, o, layer.scaling)
        elif self._all_dense:  # every request keeps V (--kv-offload-keep-v): one split-KV pass over K and the kept V
            dec.dense_kept(q3, kb, vb, o, layer.scaling)
        elif pool.layout.resident_v:
            dec.sparse(q3, kb, vb, o, layer.scaling, self.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                       v_summary=pool.summaries(lid))
        else:
            dec.sparse(q3, kb, vb, o, layer.scaling, self.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                       pool.hot_state(lid), pool.host.view(lid - pool.start_layer), v_summary=pool.summaries(lid),
                       record=pool.miss_record(lid, add=prefetched), clock=None if timer is None else timer.clock(lid, CRIT))
        if pool.sparse_layer_ids and lid == pool.sparse_layer_ids[-1]:  # the last layer that forks host V writes: they join here
            pool.join_host_writes()
        return o.view(-1, H * D)

    # ---------------------------------------------------------------- prefetch

    def wants_prefetch(self, layer_id: int) -> bool:
        """Prefetch for ``layer_id`` in this forward (a decode step, a sparse layer, prefetch on)."""
        return self.prefetch_on and self._mode == "decode" and not self._all_dense and self.pool.is_sparse_layer(layer_id)

    def prefetch(self, layer_id: int, q_spec: torch.Tensor, forward_batch, sm_scale: float) -> None:
        """Select and copy ``layer_id``'s guessed rows on the side stream
        (:meth:`OffloadDecoder.prefetch`); ``forward_decode`` of that layer waits for it.

        Args:
            q_spec: ``[bs, q_heads * head_dim]`` the guessed query (:func:`~sglang_elastic.offload.prefetch.guessed_query`).
        """
        pool, dec = self.pool, self.decoder
        lid = layer_id - pool.start_layer
        cur = torch.cuda.current_stream() if self._spec_stream is not None else None
        ctx = torch.cuda.stream(self._spec_stream) if cur is not None else _nullcontext()
        if cur is not None:
            self._spec_stream.wait_stream(cur)  # the guessed query, the step's plan, this layer's state
            q_spec.record_stream(self._spec_stream)
        with ctx:
            dec.prefetch(q_spec.reshape(-1, self.q_heads, pool.head_dim), pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id),
                         sm_scale, self.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                         pool.hot_state(layer_id), pool.host.view(lid), record=pool.miss_record(layer_id),
                         clock=None if self.copy_timer is None else self.copy_timer.clock(layer_id, PREFETCH, main=False))
            self._spec_done[layer_id] = True
            if cur is not None:
                ev = torch.cuda.Event()
                ev.record(self._spec_stream)
                self._spec_pending[layer_id] = ev

    def stats(self, sync: bool = True) -> Optional[dict]:
        """Counters since start. ``sync`` (the default, for ``/server_info`` and the
        benchmarks): the device counters read now (a host sync: off the hot path). Without it
        (the decode-log interval of a serving scheduler): the counters and the host state of the
        snapshot an earlier call queued, once the GPU has copied it, each once, read without waiting
        (None otherwise; :class:`~sglang_elastic.offload.metrics.AsyncSnapshot`; ``snapshot_time``
        says when it was taken), one interval behind.
        ``hits`` / ``misses`` of the selected rows (per sparse layer; a
        prefetched row is a hit), ``hit_rate``, ``prefetched_rows`` / ``prefetch_hits``
        (the prefetch's copies and the rows it found resident already),
        ``pcie_read_bytes`` (V rows copied host -> GPU, prefetch included),
        ``pcie_write_bytes`` (V rows written GPU -> host), ``prefix_stage_bytes`` (V of the
        prefills' prefixes read host -> GPU for their attention: a chunked prompt's earlier chunks,
        a prefix SGLang's radix cache matched; not in ``pcie_read_bytes``), ``decode_steps``,
        ``decode_tokens``, ``prefill_tokens``; with ``estimate``,
        ``summary_slots_free`` / ``summary_slots`` (V-summary slots) and
        ``summary_overflow`` (chunks that found no slot: should stay 0);
        ``hot_pages`` / ``hot_pages_free`` (hot-buffer pages of ``hot_page_rows``
        V rows per sparse layer) and ``hot_page_overflow`` (grants that found
        too few free pages: should stay 0); with ``--kv-offload-hot-slack-max``,
        ``hot_pages_taken_back`` (pages grown requests gave back when the pool ran short); with ``--kv-offload-keep-v``,
        ``kept_tokens`` / ``kept_requests`` (V kept in pool slots now) and
        ``keep_granted_tokens`` / ``keep_demotions`` since start
        (:meth:`sglang_elastic.offload.keep.KeepV.stats`); with ``--kv-offload-copy-timing``,
        ``copy_timed_steps``, ``copy_ms``, ``copy_exposed_ms``, ``copy_prefetch_ms``, ``copy_stall_ms``, ``copy_waits``, ``copy_wait_ms``
        and ``copy_hidden_share`` (:meth:`sglang_elastic.offload.copytime.CopyTimer.stats`)."""
        pool = self.pool
        named = [("hits", self.decoder.stats[0:1]), ("misses", self.decoder.stats[1:2])]
        if self.decoder.spec is not None:
            named += [("prefetch_hits", self.decoder.spec.stats[0:1]), ("prefetched_rows", self.decoder.spec.stats[1:2])]
        if pool.summary_layer_ids:
            named += [("summary_slots_free", pool.slot_top), ("summary_overflow", pool.slot_overflow)]
        if pool.hot_pages:
            named += [("hot_pages_free", pool.page_top), ("hot_page_overflow", pool.page_overflow)]
        if pool.adaptive:
            named += [("hot_pages_taken_back", pool.page_taken)]
        host = {"decode_steps": self.decode_steps, "decode_tokens": self.decode_tokens, "prefill_tokens": self.prefill_tokens,
                "prefix_tokens": self.prefix_tokens,
                **(self._keep_stats() if pool.keep_v else {}), **(self.copy_timer.stats() if self.copy_timer is not None else {})}
        from sglang_elastic.offload.metrics import AsyncSnapshot, flat_counters

        tensors = [t for _, t in named]
        if sync:
            values = [int(x) for x in flat_counters(tensors).tolist()]
        else:
            if self._snapshot is None:
                self._snapshot = AsyncSnapshot()
            got = self._snapshot.take(tensors, host)
            if got is None:
                return None
            values, host, self.snapshot_time = got
        dev = dict(zip((n for n, _ in named), values))
        hits, misses = dev["hits"], dev["misses"]
        spec_hits, spec_rows = dev.get("prefetch_hits", 0), dev.get("prefetched_rows", 0)
        row = pool.head_num * pool.v_head_dim * pool.store_dtype.itemsize
        total = hits + misses
        sparse = len(pool.sparse_layer_ids)
        return {
            "hits": hits, "misses": misses, "hit_rate": hits / total if total else None,
            "prefetched_rows": spec_rows, "prefetch_hits": spec_hits,
            "pcie_read_bytes": (misses + spec_rows) * row,
            "pcie_write_bytes": (host["prefill_tokens"] + host["decode_tokens"]) * sparse * row,
            "prefix_stage_bytes": host["prefix_tokens"] * sparse * row,
            "decode_steps": host["decode_steps"], "decode_tokens": host["decode_tokens"], "prefill_tokens": host["prefill_tokens"],
            **({"summary_slots": pool.summary_slots, "summary_slots_free": dev["summary_slots_free"], "summary_overflow": dev["summary_overflow"]}
               if pool.summary_layer_ids else {}),
            **({"hot_pages": pool.hot_pages, "hot_pages_free": dev["hot_pages_free"], "hot_page_overflow": dev["hot_page_overflow"],
                "hot_page_rows": pool.layout.hot_page} if pool.hot_pages else {}),
            **({"hot_pages_taken_back": dev["hot_pages_taken_back"]} if pool.adaptive else {}),
            **{k: v for k, v in host.items() if k not in ("decode_steps", "decode_tokens", "prefill_tokens", "prefix_tokens")},
        }

    @staticmethod
    def _keep_stats() -> dict:
        from sglang_elastic.offload import keep

        m = keep.current()
        return m.stats() if m is not None else dict.fromkeys(keep.STATS, 0)


__all__ = ["OffloadAttnBackend"]
