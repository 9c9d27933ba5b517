"""Lend and reclaim inside SGLang's scheduler.

One :class:`ElasticController` per scheduler process (one per TP rank) owns
the decisions; :mod:`sglang_elastic.sched.hooks` calls it from two places of
``Scheduler._get_new_batch_prefill_raw`` (sglang/srt/managers/scheduler.py):

- before it, :meth:`ElasticController.before_prefill`: when the reserve is
  lent and a prefill batch may form (waiting requests or a chunked request),
  reclaim first, because ``PrefillAdder`` reads ``available_size()`` live and
  the prefill's activations need the reserve;
- after it, :meth:`ElasticController.after_prefill`: count decode-only steps;
  after ``--elastic-kv-lend-after-steps`` of them in a row, lend.

A reclaim (:meth:`reclaim`) vacates the lent rows, SGLang's way where SGLang
has a way:

1. ``allocator.withdraw(0)``: the free lent ids leave the free list, the
   in-use ones come back (free-list work only: it does not wait for the
   forward in flight);
2. if the base lacks free room for them: SGLang's ``evict_from_tree_cache``
   (least recently used first, wherever the pages are: a recently used
   prefix in lent pages moves into the base, an older one in the base goes),
   then drop the KV of idle streaming sessions (least recently active
   first), then retract decode requests, largest first (fewest retractions),
   with SGLang's ``ScheduleBatch.release_req``; they are re-queued and finish
   normally;
3. every TP rank goes on or every rank stops (a MIN over the ranks);
4. copy the K/V of what is left into free base ids (``relocate_kv``),
   queued after the fence of the last forward launched while lent (the
   overlap scheduler's in-flight batch reads and writes lent rows;
   :meth:`ElasticController.after_forward`), and rewrite every holder of a
   lent id (:meth:`ElasticController._remap`);
5. on the arena's helper thread: wait for that fence and the vacate's own
   device work (nothing else), unmap and release buffer by buffer
   (``arena.reclaim(unmap_async=True)``). Until what the prefill needs is
   back, the scheduler forms no prefill and runs the decode batch
   (:meth:`ElasticController.defer_prefill`, ``--elastic-kv-reclaim-wait
   decode``); :meth:`ElasticController.after_prefill` waits for what is
   still missing before the forward that needs it is launched.

A lend (:meth:`ElasticController.lend`) maps handles made ahead on the
helper thread during the run of decode-only steps before it, measures what
else fits instead of trying, and empties torch's cache only when the
driver's free memory falls short (:meth:`ElasticController.steps_that_fit`).

Who holds KV ids in SGLang 0.5.17, and what a reclaim does with each:

- running requests (``req_to_token`` rows up to ``kv_allocated_len``,
  ``prefix_indices``) and the chunked request, kept out of the running batch
  between chunks: remapped;
- the radix tree's node values (``RadixCache``; locked nodes too): remapped;
- streaming-session slots (``--enable-streaming-session``:
  ``StreamingSession.slots``, each a ``req_to_token`` row that outlives its
  turn; the waiting request that restored a slot shares that row): the rows
  are remapped; an idle slot (no request references its row) may be
  dropped with SGLang's ``release_session`` when the base has no room, and
  its session's next turn then prefills from the radix tree;
- waiting requests: they hold no KV of their own; their ``prefix_indices``
  are re-matched by SGLang before admission (``init_next_round_input`` in
  ``_get_new_batch_prefill_raw``, which runs after the reclaim);
- requests waiting for a grammar: no KV (they have not been scheduled);
- holders we do not remap are refused at start-up
  (:func:`sglang_elastic.config.check_server_args`): PD disaggregation's
  queues, HiCache / HiSparse / LMCache / FlexKV, PD-multiplexing's split
  prefill batch, diffusion LLMs' staging queue, the unified and C++ radix
  trees and registered radix-cache backends; a tree cache of any other type
  turns lending off at start-up (:func:`unsupported_tree`).

A reclaim never raises out of the scheduler: when the base cannot take what
is in use, or any step before the ids are rewritten fails, it stops, puts
the lent range back as it was (still mapped), re-queues the requests it
retracted, logs one error and turns lending off; the reclaim is tried again
before the next prefill, without retracting (:meth:`ElasticController._stop_reclaim`).

The pool's owner-visible size follows the lent capacity: the allocator's
``size``, the invariant checker's and the pool-stats observer's
``max_total_num_tokens``. The scheduler's own ``max_total_num_tokens`` (request
length limits, ``max_new_tokens`` clipping) stays the base: a request must fit
in what cannot be reclaimed.

TP > 1: every rank takes the same decisions from the same inputs (SGLang's
schedulers are replicated); what can differ, a lend cut short by out of
memory on one rank, is agreed with a MIN all-reduce over the TP CPU group.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Callable, List, Optional, Tuple

import torch

from sglang_elastic.config import EVENTS_ENV, ElasticKVConfig  # EVENTS_ENV: one JSON line per lend/reclaim
from sglang_elastic.pool import plan_tree_remap, relocate_kv, remap_ids, remap_many
from sglang_elastic.pool.kv_pool import ElasticMHATokenToKVPool, unit_tokens
from sglang_elastic.vmm import VmmError

logger = logging.getLogger(__name__)


def agree_min(sched, *values: int):
    """The smallest of each value over ``sched``'s TP group (a collective on
    its CPU group: every rank must call it at the same point). One int for
    one value, a tuple for several."""
    if sched.tp_group.world_size > 1:
        t = torch.tensor(values, dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=sched.tp_cpu_group)
        values = tuple(int(v) for v in t.tolist())
    return values[0] if len(values) == 1 else tuple(values)


#: Lends in a row that lend nothing for lack of device memory before lending
#: stops (each one creates handles until the driver refuses, then rolls back).
MAX_OOM_LENDS = 3
#: A re-cut one-step lend (:meth:`ElasticController._recut`) smaller than this share of the start-up
#: measure counts as a lend without memory: with eager prefill every lend costs a reclaim before the
#: next prefill, not worth a few hundred MiB.
MIN_CUT_FRAC = 0.25
#: A re-cut lend step grows back only by 1/RECUT_GROW_DIV of the start-up measure or more at once.
RECUT_GROW_DIV = 8
#: ``--elastic-kv-reclaim-wait decode``: most scheduler passes in a row that run the decode batch while
#: a prefill waits for its reclaim's memory (:meth:`ElasticController.defer_prefill`); then the scheduler waits.
MAX_DEFERRED_PASSES = 16

#: SGLang's activation estimate for ``T`` tokens in flight, in MiB:
#: ``512 + 1.5 * max(T, 2048) + TP * PP / 8 * 1024``
#: (``ServerArgs.pre_capture_activation_reserve_mb``, sglang/srt/server_args.py,
#: which sizes its reserve "for eager decode above the captured max_bs and
#: transient prefill/logits").
EAGER_FIXED_MB, EAGER_MB_PER_TOKEN, EAGER_MIN_TOKENS, EAGER_MB_PER_RANK = 512, 1.5, 2048, 1024 / 8


#: ``--elastic-kv-activation-rule measured``: a plain eager prefill needs at most MEASURED_SAFETY x the bound the
#: measured passes give, plus MEASURED_SLACK_MB (never more than SGLang's estimate); the last MEASURED_KEEP
#: (tokens, requests) shapes are kept.
MEASURED_SAFETY, MEASURED_SLACK_MB, MEASURED_KEEP = 1.25, 256, 256


class PeakMemory:
    """The caching allocator's allocated bytes and their peak since a reset
    (``torch.cuda.memory_allocated`` / ``max_memory_allocated`` /
    ``reset_peak_memory_stats``; nothing in SGLang 0.5.17 reads the peak on
    CUDA after start-up). Without CUDA it measures nothing (:attr:`available`
    False). Tests put a stand-in in its place."""

    @property
    def available(self) -> bool:
        return torch.cuda.is_available()

    def reset(self) -> int:
        """Start a measurement; returns the bytes allocated now."""
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated()


def plain_request(r) -> bool:
    """A request whose prefill allocates what the LLM forward and its sampling of one token
    allocate: no logprobs, hidden states, input or override embeddings, multimodal inputs or
    grammar (whose vocabulary mask and sampling may run after ``run_batch`` returns)."""
    return not (getattr(r, "return_logprob", False) or getattr(r, "return_hidden_states", False)
                or getattr(r, "input_embeds", None) is not None or getattr(r, "positional_embed_overrides", None) is not None
                or getattr(r, "multimodal_inputs", None) is not None or getattr(r, "grammar", None) is not None)


class EagerActivations:
    """What the eager prefills of this server really allocate, against SGLang's
    estimate (:func:`eager_activation_bytes`): issue 22's "SGLang's own
    estimate, measured and checked".

    Why: SGLang's estimate is 512 MiB + 1.5 MiB a token + 128 MiB a rank (12.6 GiB for a chunk
    of 8,192 tokens), more than the 8.6 GiB step lent on the H200, so every
    eager prefill reclaimed the whole step (8.6 / 15.0 ms p50 / p99), whatever
    the prefill took and whatever torch's cache still held from the last one.

    Measured (always): the peak of ``torch.cuda.max_memory_allocated`` over a
    whole scheduler pass that ran an eager prefill (from before the batch
    forms to before the next one does: the forward, its sampling, the result
    processing), above what was allocated at its start (:class:`PeakMemory`);
    an ``eager_prefill`` event beside SGLang's estimate and the need taken.
    Checked: a pass that took more than SGLang's estimate is counted
    (:attr:`over_estimate`) and logged once.

    Used only with ``--elastic-kv-activation-rule measured`` (the default is
    SGLang's estimate until GPU runs show the rule safe): a pass of ``t_i``
    tokens and ``r_i`` requests that took ``p_i`` bytes bounds one of up to
    ``T`` tokens and ``R`` requests by ``p_i * max(T / t_i, R / r_i, 1)``
    (activations ``a + b t + c r`` with ``a, b, c >= 0``: the forward's per
    token, the logits and sampling per request); :meth:`need` takes the
    tightest such bound, or the largest peak a smaller pass took where that
    is more (the model was wrong there), times :data:`MEASURED_SAFETY`, plus
    :data:`MEASURED_SLACK_MB`, never more than SGLang's estimate, which it is
    until a pass was measured. Only plain passes (:func:`plain_request`) are
    measured into the bound and bounded by it.
    """

    def __init__(self):
        self.peaks: dict = {}  # (tokens, requests) -> the most bytes a plain pass of that shape took; insertion order = age
        self.measured = 0
        self.over_estimate = 0
        self._warned = False

    def add(self, tokens: int, requests: int, peak: int, plain: bool, ranks: int = 1) -> dict:
        """One eager prefill pass of ``tokens`` tokens and ``requests`` requests that took ``peak`` bytes; returns its record."""
        est = eager_activation_bytes(tokens, ranks)
        self.measured += 1
        if peak > est:
            self.over_estimate += 1
            if not self._warned:
                self._warned = True
                logger.warning("sglang-elastic: an eager prefill of %d tokens took %.2f GiB, more than SGLang's estimate (%.2f GiB)",
                               tokens, peak / 2**30, est / 2**30)
        if plain and tokens > 0 and requests > 0:
            key = (tokens, requests)
            self.peaks[key] = max(self.peaks.pop(key, 0), peak)  # re-inserted: the newest
            while len(self.peaks) > MEASURED_KEEP:
                del self.peaks[next(iter(self.peaks))]  # the oldest shape
        return {"tokens": tokens, "requests": requests, "peak_bytes": peak, "estimate_bytes": est, "plain": plain}

    def need(self, tokens: int, requests: int, estimate: int) -> int:
        """Bytes a plain eager prefill of up to ``tokens`` tokens and ``requests`` requests is taken to need (``estimate`` at most)."""
        if not self.peaks or tokens <= 0 or requests <= 0:
            return estimate
        bound = min(p * max(tokens / t, requests / r, 1.0) for (t, r), p in self.peaks.items())
        seen = max((p for (t, r), p in self.peaks.items() if t <= tokens and r <= requests), default=0)
        return min(estimate, int(max(bound, seen) * MEASURED_SAFETY) + MEASURED_SLACK_MB * 2**20)


class TorchCache:
    """PyTorch's CUDA caching allocator as the lend sees it: the bytes it
    reserves but does not use (``memory_reserved - memory_allocated``:
    blocks freed by tensors, kept for reuse) and a way to hand them back to
    the driver (``torch.cuda.empty_cache``). Without CUDA both are nothing.
    ``device``: the scheduler's GPU (``None``: the calling thread's current
    one), named rather than taken from the calling thread, as the arena's
    helper thread calls it too (its current device is the one its bound
    context gives).
    Tests put a stand-in holding real host-backend memory in its place."""

    def __init__(self, device: Optional[int] = None):
        self.device = device
        conf = ",".join(os.environ.get(v, "") for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
        #: ``expandable_segments:True``: freed blocks sit beside live ones in one segment (counted as split),
        #: and ``empty_cache`` unmaps them all the same.
        self.expandable = "expandable_segments:true" in conf.replace(" ", "").lower()

    def unused(self) -> int:
        if not torch.cuda.is_available():
            return 0
        return max(torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device), 0)

    def reusable(self) -> int:
        """:meth:`unused` less the split remainders of segments in use
        (``inactive_split_bytes``), which a large allocation cannot take."""
        if not torch.cuda.is_available():
            return 0
        st = torch.cuda.memory_stats(self.device)
        return max(st.get("reserved_bytes.all.current", 0) - st.get("allocated_bytes.all.current", 0)
                   - st.get("inactive_split_bytes.all.current", 0), 0)

    def returnable(self) -> int:
        """What ``empty_cache`` is taken to hand back to the driver: :meth:`reusable` (the split
        remainders of live segments stay), or :meth:`unused` with expandable segments. Free blocks
        of a live CUDA graph's private pool count here and do not come back: the controller learns
        that shortfall from the emptyings it measures (``ElasticController._empty_overstated``)."""
        return self.unused() if self.expandable else self.reusable()

    def empty(self) -> None:
        if torch.cuda.is_available():
            with torch.cuda.device(self.device):
                torch.cuda.empty_cache()


class DeviceFences:
    """Completion fences for the device work that may touch lent rows: CUDA
    events recorded on SGLang's ``forward_stream`` (the overlap scheduler's)
    and the current stream; without CUDA (host backend) every fence is
    complete at once (host work is synchronous), so ``None``. Tests put a
    stand-in in its place to order a reclaim against an in-flight forward.

    Idea: SGLang's unified pool gates its lazy compaction on a
    ``forward_done`` event recorded after each forward (``Scheduler.run_batch``)."""

    def __init__(self, sched):
        self.sched = sched

    def record(self):
        """A fence after the work queued so far on the forward and current streams."""
        if not torch.cuda.is_available():
            return None
        evs = []
        for stream in (getattr(self.sched, "forward_stream", None), torch.cuda.current_stream()):
            if stream is not None:
                ev = torch.cuda.Event()
                ev.record(stream)
                evs.append(ev)
        return evs

    def order_after(self, fence) -> None:
        """Make work queued from now on the current stream start after ``fence`` (device side, the host does not wait)."""
        for ev in fence or ():
            torch.cuda.current_stream().wait_event(ev)

    def wait(self, fence) -> None:
        """Block the host until ``fence`` completed."""
        for ev in fence or ():
            ev.synchronize()


def lend_max_batch(server_args, margin_mb: int, encoder_decoder: bool = False) -> int:
    """Largest decode batch, in requests, that may run while the reserve is lent.

    A decode batch up to the decode CUDA graphs' ``max_bs`` replays a graph
    whose activations live in the graph pool captured at start-up; a larger
    one (or any, with decode graphs disabled) runs eagerly and allocates its
    activations then, from the memory SGLang kept back and we lend. So the
    bound is the graphs' ``max_bs`` (with ``--disable-cuda-graph-padding``,
    only the sizes up to the first gap in the captured list: a batch between
    captured sizes runs eagerly then), or, if larger, the batch whose eager
    activations by SGLang's own estimate (:data:`EAGER_FIXED_MB` +
    :data:`EAGER_MB_PER_TOKEN` per token, at least :data:`EAGER_MIN_TOKENS`
    tokens, a request counting its speculative draft tokens, plus
    :data:`EAGER_MB_PER_RANK` per TP x PP rank) fit in ``margin_mb``; with
    the default 1024 MiB no eager batch does. SGLang's
    post-capture KV sizing keeps its whole reserve for the same case
    (``compute_post_capture_kv_resize``, sglang/srt/model_executor/
    model_runner_components/kv_pool_runtime.py).

    Batches the graphs do not replay whatever their size count as eager
    (``DecodeCudaGraphRunner.can_run_graph``): with two-batch overlap, a batch
    whose split cannot run (``can_run_tbo``), and in an encoder-decoder model a
    batch holding a request without encoder input; for both only the margin
    bounds the batch. Token-embedding overrides (``replace_embeds``) are a
    property of the batch: :meth:`ElasticController.after_prefill` checks them.

    Args:
        server_args: SGLang's resolved ``ServerArgs`` (``cuda_graph_config.decode``:
            ``backend``, ``max_bs``, ``bs``; ``disable_cuda_graph_padding``,
            ``speculative_num_draft_tokens``, ``tp_size``, ``pp_size``).
        margin_mb: ``--elastic-kv-margin-mb``, MiB left free while lent.
        encoder_decoder: the model is an encoder-decoder one
            (``ModelConfig.is_encoder_decoder``).

    Returns:
        requests (>= 0; 0: never lend); the same on every TP rank (a
        function of the flags).
    """
    from sglang.srt.model_executor.cuda_graph_config import Backend

    decode = server_args.cuda_graph_config.decode
    graph_bs = 0 if decode.backend == Backend.DISABLED else int(decode.max_bs or 0)
    if encoder_decoder or getattr(server_args, "enable_two_batch_overlap", False):
        graph_bs = 0  # the graphs may refuse a batch of any size
    if graph_bs and getattr(server_args, "disable_cuda_graph_padding", False):  # only captured sizes replay
        captured = set(decode.bs or [])
        contiguous = 0
        while contiguous + 1 in captured:
            contiguous += 1
        graph_bs = min(graph_bs, contiguous)
    per_req = max(int(getattr(server_args, "speculative_num_draft_tokens", None) or 1), 1)
    ranks = int(getattr(server_args, "tp_size", 1) or 1) * int(getattr(server_args, "pp_size", 1) or 1)
    eager_tokens = (margin_mb - EAGER_FIXED_MB - EAGER_MB_PER_RANK * ranks) / EAGER_MB_PER_TOKEN
    eager_bs = int(eager_tokens // per_req) if eager_tokens >= EAGER_MIN_TOKENS else 0
    return max(graph_bs, eager_bs)


#: :meth:`ElasticController.reserve_needed`'s reason for a prefill outside CUDA graphs
EAGER_PREFILL = "prefills run outside CUDA graphs"
#: A reclaim made while the scheduler is idle, for the next eager prefill (:meth:`ElasticController.on_idle`).
IDLE = "idle: the next prefill runs outside CUDA graphs"


def eager_activation_bytes(tokens: int, ranks: int = 1) -> int:
    """SGLang's activation estimate for ``tokens`` in flight outside CUDA
    graphs, bytes: ``512 + 1.5 * max(tokens, 2048)`` MiB plus 128 MiB per
    TP x PP rank (``ServerArgs.pre_capture_activation_reserve_mb``; the
    constants above)."""
    mb = EAGER_FIXED_MB + EAGER_MB_PER_TOKEN * max(tokens, EAGER_MIN_TOKENS) + EAGER_MB_PER_RANK * ranks
    return int(mb * 2**20)


def prefill_graphs_hold(server_args) -> bool:
    """Whether SGLang's prefill CUDA graphs hold the activations of every
    prefill the scheduler can form, so that a prefill needs nothing of the
    lent reserve.

    SGLang's own rule for dropping the prefill activation reserve
    (``ServerArgs.post_capture_kv_sizing_planned``: "we can only skip eager
    activation headroom when the largest prefill forward batch size is
    already graph-captured"): prefill graphs on, chunked prefill on, and
    ``max_prefill_buffer_tokens()`` at most the largest captured size. LoRA
    prefills replay eagerly (``PrefillCudaGraphRunner.can_replay_locally``):
    False with ``--enable-lora``. Requests whose own features make a prefill
    eager are checked at each pass (:meth:`ElasticController.reserve_needed`).

    Args:
        server_args: SGLang's resolved ``ServerArgs`` (``cuda_graph_config.prefill``,
            ``chunked_prefill_size``, ``enable_lora``, ``max_prefill_buffer_tokens()``).
    """
    from sglang.srt.model_executor.cuda_graph_config import Backend

    prefill = getattr(getattr(server_args, "cuda_graph_config", None), "prefill", None)
    if prefill is None or prefill.backend in (None, Backend.DISABLED) or not prefill.bs:
        return False
    if (getattr(server_args, "chunked_prefill_size", 0) or 0) <= 0 or getattr(server_args, "enable_lora", False):
        return False
    return server_args.max_prefill_buffer_tokens() <= max(prefill.bs)


def unsupported_tree(tree) -> str:
    """Why the reclaim cannot vacate ``tree`` (SGLang's tree cache), or "".

    The reclaim walks SGLang's ``RadixCache`` (``root_node``, ``TreeNode.value``)
    and needs nothing of ``ChunkCache``; ``StreamingSession`` wraps either and
    its slots are remapped. Subclasses and other trees keep ids where the
    reclaim does not look (HiCache's host values, the unified tree's
    components, the C++ tree's nodes)."""
    from sglang.srt.mem_cache.chunk_cache import ChunkCache
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.session.streaming_session import StreamingSession

    inner = tree.inner if type(tree) is StreamingSession else tree
    if type(inner) in (RadixCache, ChunkCache):
        return ""
    return f"SGLang's tree cache here is {type(inner).__name__}; the reclaim can vacate RadixCache and ChunkCache only"


class ElasticController:
    """Lend/reclaim policy and mechanics for one scheduler.

    Args:
        sched: SGLang's ``Scheduler`` (after ``__init__``), whose
            ``token_to_kv_pool_allocator`` is one of ours.
        cfg: the server's :class:`~sglang_elastic.config.ElasticKVConfig`.
    """

    def __init__(self, sched, cfg: ElasticKVConfig):
        self.sched = sched
        self.cfg = cfg
        self.alloc = sched.token_to_kv_pool_allocator
        self.pool: ElasticMHATokenToKVPool = self.alloc._kvcache
        self.arena = self.pool.arena
        self.page = self.alloc.page_size
        self.tp_size = sched.tp_group.world_size
        self.decode_only_steps = 0
        self.cycles = 0
        #: Lending stopped on every rank (agreed in :meth:`lend`); a rank's own
        #: ``arena.lending_disabled`` alone must not change what it does.
        self.disabled = False
        #: Why this rank must stop lending (a reclaim that stopped), agreed
        #: with the other ranks at the next :meth:`lend`.
        self._stop: Optional[str] = None
        #: Lends in a row that lent nothing for lack of device memory.
        self._oom_lends = 0
        #: Prefills the CUDA graphs hold, so that a prefill reclaims nothing
        #: (:func:`prefill_graphs_hold`; the same on every rank).
        self.prefill_in_graphs = prefill_graphs_hold(sched.server_args)
        #: Prefills that ran while lent with nothing reclaimed (the graphs, or
        #: the free memory, held what they need).
        self.reclaims_skipped = 0
        #: Passes that ran the decode batch instead of a prefill whose memory a reclaim was still giving back
        #: (:meth:`defer_prefill`).
        self.prefills_deferred = 0
        self._skip: Optional[dict] = None  # this pass reclaimed nothing: counted if a prefill forms
        self._idle_decided = False  # on_idle decided for this idle period (reset by the next forward)
        self.metrics = None
        #: PyTorch's caching allocator (:class:`TorchCache`) and the device fences (:class:`DeviceFences`).
        self.torch_cache = TorchCache(getattr(self.arena.backend, "device", None))
        self._ahead_empty = (-1, 0.0)  # (run, ms): torch's cache emptied on the helper thread in that run (_empty_ahead)
        self._run = 0  # runs of decode-only steps begun (a new batch begins one): the lend reports its own run's emptying
        #: Bytes the last emptying gave back less than :meth:`TorchCache.returnable` said (a live CUDA graph's pool
        #: blocks): taken off the next predictions (:meth:`_fit_if_emptied`).
        self._empty_overstated = 0
        self._ahead_cancel = threading.Event()  # set: an eager forward needs the memory, the job makes no step
        self.fences = DeviceFences(sched)
        #: The eager prefills' real peaks (``--elastic-kv-activation-rule``; :class:`EagerActivations`) and the
        #: allocator's peak counter they are read from; ``_probe``: bytes allocated when this pass's measurement
        #: began; ``_measuring``: the last pass's eager prefill (its peak is read when the next pass begins).
        self.activations = EagerActivations()
        self.peak_memory = PeakMemory()
        self._probe: Optional[int] = None
        self._measuring: Optional[dict] = None
        #: the bytes this pass's steps_needed took the next forward to need (None: not asked this pass), for the events
        self._pass_need: Optional[int] = None
        self._pass_free: Optional[Tuple[int, int]] = None
        #: what that forward needs beyond what was free (None: the driver's free memory unknown): a reclaim's room_bytes
        self._pass_room: Optional[int] = None
        #: the same before clamping at 0 (what was free beyond the need, negative), with the unmap still running counted free
        self._pass_short: Optional[int] = None
        #: Fence after the last forward launched while lent (:meth:`after_forward`).
        self._forward_fence = None
        #: A reclaim whose handles are being released on the arena's helper
        #: thread: its event, written once :meth:`_settle` waited for them.
        self._releasing: Optional[dict] = None
        self._dropped_prepared = False  # handles made ahead released on the helper since the last settle
        #: Lends whose handles were all made ahead on the helper thread (not counted in warm_up).
        self.lends_prepared = 0
        self._quiet = False  # inside warm_up: lend/reclaim lines at DEBUG, not counted
        self._last_reclaim = "no reclaim"  # the last reclaim's time split, for warm_up's line
        if sched.metrics_reporter.enable_metrics:
            from sglang_elastic.sched.metrics import ElasticMetrics

            self.metrics = ElasticMetrics({k: str(v) for k, v in sched.metrics_collector.labels.items()})
        #: Largest decode batch (requests) that may run while lent: see :func:`lend_max_batch`.
        model = getattr(sched, "model_config", None)
        self.lend_max_bs = lend_max_batch(sched.server_args, cfg.margin_mb, bool(getattr(model, "is_encoder_decoder", False)))
        path = os.environ.get(EVENTS_ENV)
        self._events = open(path, "a", buffering=1) if path and sched.tp_group.rank_in_group == 0 else None
        self.lendable_tokens = self._measure()
        logger.info(
            "sglang-elastic: base %d KV tokens (SGLang's max_total_num_tokens), lendable %d tokens = %.2f GiB in %d step(s), mode %s, "
            "lends while the decode batch has at most %d requests; %s",
            self.alloc.usable_base_tokens - self.page, self.lendable_tokens,
            self.lendable_tokens * self.arena.step_bytes() / max(self.arena.step_tokens, 1) / 2**30, self.arena.max_steps, cfg.mode,
            self.lend_max_bs,
            "prefills run in CUDA graphs: a reclaim only before an eager forward" if self.prefill_in_graphs else "every prefill reclaims",
        )
        why = unsupported_tree(sched.tree_cache)  # the same on every rank: the same flags
        if why and cfg.mode != "off":
            self.disabled = True
            logger.error("sglang-elastic: %s; lending is off", why)
        elif cfg.mode == "always-lent":
            self.lend()
        elif cfg.mode == "dynamic" and self.lendable_tokens > 0:
            self.warm_up()

    def warm_up(self) -> None:
        """One lend/reclaim cycle at start-up, before any request, so that the
        first calls of a cycle's kernels and driver paths are paid here rather
        than by the first long prompt's reclaim.

        Measured on two H200s (TP 2) without it: the first reclaim of a
        server took 67, 94 and 114 ms (the 94 ms one: 77 ms of vacate with
        0 pages moved), later ones 14–21 ms (7.6 GiB per rank) and 49–90 ms
        (40 GiB), so the first long prompt waited up to 50 ms longer
        (``docs/eval.md``, E2 at TP 2; ``docs/elastic.md``, Findings).

        Besides the real lend, ``withdraw`` and unmap, it runs the vacate
        path's other operations on one page (:meth:`_warm_vacate_ops`): the
        radix-tree scan and id remap of :mod:`sglang_elastic.pool.vacate`,
        ``still_in_use``'s ``isin`` and SGLang's ``move_kv_cache_native``,
        from a base row into a lent one that is then unmapped (no base row
        changes). The same operations on a small input; where PyTorch picks
        another kernel for a larger one, that kernel still loads later.

        Not counted in :attr:`cycles`, the lend/reclaim metrics or the events
        file; one INFO line. Failures: a VMM failure in the lend is handled
        as at run time (out of memory retried later, any other failure turns
        lending off on every rank). Any other exception is logged, the
        pool is put back to its base and lending is turned off on every rank
        (agreed over TP, like the lend); only if the base cannot be restored
        does it raise, and the server does not start.
        """
        self._quiet = True
        try:
            t0 = time.perf_counter()
            if self.lend() == 0:  # agreed over TP: every rank returns here or none
                return
            t_lent = time.perf_counter()
            failed = False
            why = "sglang-elastic: the start-up warm-up cycle failed; restoring the base pool and turning lending off"
            try:
                self._warm_vacate_ops()
            except Exception:
                failed = True
                logger.exception(why)
            try:  # every rank reclaims, the one whose vacate ops failed too: the reclaim is a collective over TP
                if not self.reclaim(self.sched.running_batch) and not failed:
                    raise RuntimeError("the warm-up reclaim stopped")
            except Exception:
                if not failed:
                    logger.exception(why)
                failed = True
            if failed:
                self._restore_base()
            if not agree_min(self.sched, int(not failed)):
                self.disabled = True
                if not failed:
                    logger.error("sglang-elastic: another TP rank's start-up warm-up cycle failed; lending is off")
            self.cycles = 0
            logger.info("sglang-elastic: warm-up lend/reclaim cycle at start-up%s: lent in %.2f ms, reclaimed in %.2f ms (%s)",
                        " failed" if failed else "", (t_lent - t0) * 1e3, (time.perf_counter() - t_lent) * 1e3, self._last_reclaim)
        finally:
            self._quiet = False

    def _warm_vacate_ops(self) -> None:
        """The vacate path's tensor operations on one lent page, while lent
        and before any request (see :meth:`warm_up`)."""
        from sglang.srt.mem_cache.memory_pool import move_kv_cache_native

        dev, p, top = self.alloc.device, self.page, self.arena.base_tokens
        lent = torch.tensor([top // p], dtype=torch.int64, device=dev)  # first lent unit: free, mapped
        base = torch.tensor([1], dtype=torch.int64, device=dev)  # first base unit after SGLang's padding slot 0
        lent_tok, base_tok = unit_tokens(lent, p), unit_tokens(base, p)
        move_kv_cache_native(self.pool.k_buffer, self.pool.v_buffer, lent_tok, base_tok)  # base -> lent: no base row changes
        remapped, hit = remap_many([lent_tok, lent_tok.to(torch.int32)], top, lent, base, p)  # tree values, prefix_indices
        block = lent_tok.to(torch.int32)[None, :]  # req_to_token rows, as _remap edits them
        valid = torch.arange(block.shape[1], device=dev)[None, :] < torch.tensor([block.shape[1]], device=dev)[:, None]
        block[valid] = remap_ids(block[valid], top, lent, base, p)
        torch.isin(lent, base)  # still_in_use after frees during a vacate
        if hit != [0, 1] or not torch.equal(remapped[0], base_tok) or not torch.equal(block[0].to(torch.int64), base_tok):
            raise RuntimeError("sglang-elastic: warm-up remap gave wrong ids")  # the remap is what keeps requests' KV readable

    def _restore_base(self) -> None:
        """After a failed warm-up (nothing in use yet): the lent ids off the
        free list, the arena unmapped, the vacate window closed. Raises if
        it cannot (the pool's state is unknown: the server must not start)."""
        if self.alloc.lent_tokens:
            self.alloc.withdraw(0)
        self._unmap_lent("reclaim after a failed warm-up")

    def _unmap_lent(self, what: str, steps: Optional[int] = None, wait=None, release_async: bool = False, unmap_async: bool = False) -> None:
        """Unmap the top ``steps`` lent steps (default: every one; nothing if
        none), close the vacate window and publish the size. ``wait``: what
        must complete before the unmap (default: the device synchronized);
        ``release_async``: the handles are released on the arena's helper
        thread (:meth:`_settle` waits for it before the next forward);
        ``unmap_async``: ``wait`` and the unmaps run there too, the next
        forward waits only for the memory it needs (:meth:`after_prefill`). A
        failing unmap is logged and counted, not raised (with ``unmap_async``
        when the helper's work is settled: the next pass, lend or reclaim):
        the rows are vacated already, lending stops."""
        try:
            self.arena.reclaim(steps, wait=wait, release_async=release_async, unmap_async=unmap_async)
        except VmmError as e:
            self._vmm_failed(what, e)
        self.alloc.end_vacate()
        self._sync_sizes()

    def _settle(self) -> float:
        """Wait for the arena's helper thread (handles released after a
        reclaim's unmap, made ahead of a lend); count what failed there as
        :meth:`_vmm_failed` does (a failed release: its handle is kept for
        the arena's ``close``, which retries it, and lending is off). Writes
        the pending reclaim's event with ``release_wait_ms``, the time this
        call waited (the release overlapped the scheduler's work since the
        unmap). Returns that time, ms."""
        t = time.perf_counter()
        errors = self.arena.settle()
        waited = (time.perf_counter() - t) * 1e3
        for e in errors:
            self._vmm_failed("work on the helper thread (a reclaimed step's release, or a step made ahead)", e)
        rec, self._releasing = self._releasing, None
        self._dropped_prepared = False
        if rec is not None:
            overlap = (t - rec.pop("t_end")) * 1e3
            if rec.pop("unmap_async", False):  # the fence wait and the unmaps ran on the helper thread: its timings
                done = self.arena.last_unmap
                rec.update(wait_ms=done.get("wait_ms", 0.0), unmap_ms=done.get("unmap_ms", 0.0),
                           unmap_end_ms=(done["t_end"] - rec["t_start_unmap"]) * 1e3 if "t_end" in done else None)
            rec.pop("t_start_unmap", None)
            if "release_wait_ms" in rec:  # the forward waited for its room only (after_prefill); this wait came later
                rec["settle_wait_ms"] = waited
            else:
                rec["release_wait_ms"] = waited
                if rec.get("deferred"):  # passes ran the decodes, then this wait (a deferred pass that reclaimed again)
                    rec["delay_ms"] = rec["ms"] + overlap + waited
            self._reclaim_event(dict(rec, release_overlap_ms=overlap, release_failed=len(errors)))
        return waited

    def _reclaim_event(self, rec: dict) -> None:
        """Write a reclaim's event and observe ``reclaim_needed_ms``: what the scheduler waited for it,
        the reclaim on this thread (``ms``) and the wait for its memory (``release_wait_ms``); and
        ``reclaim_delay_ms``: from its start to the forward it was for (``delay_ms``, decode passes run
        meanwhile included: :meth:`defer_prefill`)."""
        if self.metrics and not self._quiet:
            # an idle reclaim's own time kept no request waiting (on_idle): only what a prefill then waited for its memory
            waited = rec["release_wait_ms"] + (0.0 if rec.get("why") == IDLE else rec["ms"])
            self.metrics.reclaim_needed_ms.observe(waited)
            self.metrics.reclaim_delay_ms.observe(rec.get("delay_ms", waited))
        self._event(**rec)

    def _wait_room(self) -> None:
        """Before the forward a reclaim was for: wait until the unmap on the
        helper thread has given back what the forward needs beyond what was
        free when the reclaim was decided (``room_bytes``; a deferred pass may
        have raised it, :meth:`before_prefill`), not for the whole step. Sets
        the event's ``release_wait_ms`` (this wait) and ``delay_ms`` (from the
        reclaim's start to now; for an idle reclaim, made for no forward in
        particular, this wait only)."""
        rec = self._releasing
        t = time.perf_counter()
        self.arena.wait_freed(rec["room_bytes"])
        now = time.perf_counter()
        rec["release_wait_ms"] = (now - t) * 1e3
        # an idle reclaim (on_idle) was for no forward in particular: what the forward that came waited for it
        rec["delay_ms"] = rec["release_wait_ms"] if rec.get("why") == IDLE else rec["ms"] + (now - rec["t_end"]) * 1e3

    def _room_awaited(self) -> Optional[dict]:
        """The pending event of the reclaim whose unmap was handed to the helper
        thread (maybe finished since: the arena is not settled yet) to give
        back memory the next forward needs (``room_bytes``), not waited for
        yet; None without one, or when handles made ahead were dropped since
        (then the whole release is waited for, :meth:`after_prefill`)."""
        rec = self._releasing
        if (rec is None or not self.arena.unsettled or rec.get("room_bytes") is None or "release_wait_ms" in rec
                or self._dropped_prepared):
            return None
        return rec

    def defer_prefill(self, running_batch) -> bool:
        """Whether this scheduler pass forms no prefill (``--elastic-kv-reclaim-wait
        decode``, the default): the reclaim made for it is still giving back, on
        the helper thread, the memory its forward needs (``room_bytes``), and the
        running decode batch can take a step meanwhile. SGLang then runs that
        decode batch, as it does when its own prefill delayers hold a prefill
        back (``_get_new_batch_prefill_raw``: ``min_free_slots_delayer``); the
        prefill forms at the first pass that finds the memory back, so the
        running requests do not stall behind the unmap (measured on an H100: the
        in-flight forward's ~6 ms and the driver's ~10 ms for a 9.5 GiB step).

        Nothing to defer (False, nothing recorded) when no prefill can form this
        pass (SGLang's own early exit, :meth:`_prefill_may_form`). Not deferred
        (False; the event's ``defer_end`` says which): with ``block``; with a
        chunked request between chunks (its
        next chunk must run, as SGLang's delayers leave it); when the decode
        batch is empty, prefill-only, above :attr:`lend_max_bs` or carries
        embedding overrides (it would run outside the decode graphs, on the
        memory coming back); after :data:`MAX_DEFERRED_PASSES` passes (then
        :meth:`after_prefill` waits for the rest). TP > 1: a collective (a MAX
        over the ranks): every rank defers while any rank's memory is not back.
        """
        rec = self._room_awaited()
        if rec is None or not self._prefill_may_form(running_batch):
            return False  # no prefill can form this pass (an idle pass after on_idle): nothing to defer or end
        deferred = rec.get("deferred", 0)
        # the same on every rank: why the prefill forms now (the reclaim's event: defer_end, with the decodes then)
        end = ("block" if self.cfg.reclaim_wait != "decode" else "most passes" if deferred >= MAX_DEFERRED_PASSES
               else "chunked request" if self.sched.chunked_req is not None
               else "no decode batch" if running_batch.is_empty() or getattr(running_batch, "is_prefill_only", False)
               else "decode batch outside the graphs" if self._decode_outside_graphs(running_batch)
               else None)
        if end is None:
            short = not self.arena.wait_freed(rec["room_bytes"], timeout=0)
            end = None if -agree_min(self.sched, -int(short)) else "memory back"
        if end is not None:
            rec.update(defer_end=end, decodes=len(running_batch.reqs))
            return False
        rec["deferred"] = deferred + 1
        self.prefills_deferred += 1
        if self.metrics and not self._quiet:
            self.metrics.prefills_deferred.inc()
        return True

    def on_idle(self) -> None:
        """Before SGLang's idle sleep (``Scheduler.maybe_sleep_on_idle``, which its
        ``on_idle`` calls once nothing ran in this pass or the one before and
        nothing waits; with ``--sleep-on-idle`` it then polls for the next
        request for up to a second, so the reclaim must come first), once per
        idle period (until the next forward: :meth:`after_forward`): with eager
        prefills (no prefill CUDA graphs) and SGLang's activation rule, reclaim
        now what the next prefill will need (:meth:`steps_needed` for the
        largest prefill pass, :meth:`_prefill_budget`), while no
        request waits for it. Its unmap runs on the helper thread; a request
        that arrives meanwhile waits only for the rest (no decode batch runs
        to defer it to). Seen on an H100 (2026-12-06, 64 to 512-token prompts
        arriving every 0.25 s after the long decodes ended): each arrival found
        the pool lent and the GPU idle, and its prefill waited 6-13 ms for a
        whole-step reclaim. Nothing with the prefill graphs (no prefill needs
        the reserve) or the measured rule (its lend leaves a plain prefill's
        need free). The pool lends again after the next run of decode-only
        steps. A collective at TP > 1 (every rank is idle at the same pass)."""
        if (self._idle_decided or self.cfg.mode != "dynamic" or not self.lent or self.prefill_in_graphs
                or self.cfg.activation_rule != "sglang" or self._releasing is not None or not self.sched.is_fully_idle()):
            return
        self._idle_decided = True  # every rank: the same inputs (a collective follows)
        self._pass_need = self._pass_free = self._pass_room = self._pass_short = None
        steps = self.steps_needed(self._prefill_budget())
        if steps:
            self.reclaim(self.sched.running_batch, steps, IDLE)

    def after_forward(self, batch=None) -> None:
        """After ``Scheduler.run_batch`` launched ``batch``: while lent, a
        fence after it (a reclaim waits on this fence only, not on the
        whole device); after an eager prefill, what it allocated
        (:class:`EagerActivations`, an ``eager_prefill`` event)."""
        if self.lent:
            self._forward_fence = self.fences.record()
        self._idle_decided = False  # a forward ran: the next idle period decides again (on_idle)
        base, self._probe = self._probe, None
        mode = getattr(batch, "forward_mode", None)
        if base is None or mode is None or not mode.is_extend():
            return
        reqs = list(getattr(batch, "reqs", None) or [])
        plain = (bool(reqs) and all(plain_request(r) for r in reqs) and not getattr(batch, "return_logprob", False)
                 and not getattr(batch, "return_hidden_states", False) and getattr(batch, "input_embeds", None) is None)
        # read when the next pass begins: the sampling of a grammar batch, under the overlap scheduler, runs after run_batch
        self._measuring = {"base": base, "tokens": int(getattr(batch, "extend_num_tokens", 0) or 0), "requests": len(reqs),
                           "plain": plain, "need_bytes": self._pass_need}

    def _finish_measuring(self) -> None:
        """The last pass's eager prefill: its peak, an ``eager_prefill`` event (:class:`EagerActivations`)."""
        m, self._measuring = self._measuring, None
        if m is None:
            return
        rec = self.activations.add(m["tokens"], m["requests"], max(self.peak_memory.peak() - m["base"], 0), m["plain"], self._ranks())
        self._event(op="eager_prefill", **rec, need_bytes=m["need_bytes"])

    def _ranks(self) -> int:
        sa = self.sched.server_args
        return int(getattr(sa, "tp_size", 1) or 1) * int(getattr(sa, "pp_size", 1) or 1)

    def _log(self, msg: str, *args) -> None:
        """INFO, or DEBUG inside :meth:`warm_up`."""
        logger.log(logging.DEBUG if self._quiet else logging.INFO, msg, *args)

    # -- sizing -------------------------------------------------------------

    def _measure(self) -> int:
        """Tokens to lend: the free device memory now (after CUDA-graph
        capture, torch's cache emptied) less ``--elastic-kv-margin-mb``, or
        ``--elastic-kv-lend-bytes`` capped at that (one warning when it asks
        for more); agreed over TP, cut into steps. A backend that cannot tell
        its free memory (the host one without a capacity) lends
        ``--elastic-kv-lend-bytes`` as given, or nothing."""
        row_bytes = sum(self.arena.row_bytes)  # bytes per token, all layers, K and V
        self.arena.backend.synchronize()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        free = self.arena.backend.free_bytes()
        room = None if free is None else free - self.cfg.margin_mb * 2**20
        want = self.cfg.lend_bytes if self.cfg.lend_bytes is not None else (room or 0)
        if room is not None and want > room:
            logger.warning("sglang-elastic: --elastic-kv-lend-bytes %d is more than is free after CUDA-graph capture (%.2f GiB, less "
                           "--elastic-kv-margin-mb %d): lending at most %.2f GiB", want, free / 2**30, self.cfg.margin_mb, max(room, 0) / 2**30)
            want = room
        tokens = agree_min(self.sched, max(want, 0) // row_bytes)
        step = self.cfg.handle_mb * 2**20 // max(self.arena.row_bytes) if self.cfg.handle_mb else None
        lendable = self.arena.set_steps(tokens, step)
        if lendable == 0 and self.cfg.lend_bytes is not None and self.cfg.lend_bytes < self.arena.quantum * row_bytes:
            logger.warning("sglang-elastic: --elastic-kv-lend-bytes %d is less than the smallest lend step (%d tokens, %d bytes "
                           "over all layers): nothing is lent", self.cfg.lend_bytes, self.arena.quantum, self.arena.quantum * row_bytes)
        return lendable

    @property
    def lent(self) -> bool:
        return self.alloc.lent_tokens > 0

    def _sync_sizes(self) -> None:
        """Point every live copy of the pool size at the allocator's."""
        s = self.sched
        s.invariant_checker.max_total_num_tokens = self.alloc.size
        # A frozen dataclass in SGLang (the size never changes there): its
        # token usage must divide by the capacity that is backed now.
        object.__setattr__(s.pool_stats_observer, "max_total_num_tokens", self.alloc.size)
        # /v1/loads (max_total_num_tokens, memory.token_capacity) and the KV
        # events' kv_total_blocks / kv_active_blocks (token_usage times this)
        # beside the token_usage that divides by the size above.
        for name in ("load_inquirer", "kv_events_publisher"):
            if getattr(s, name, None) is not None:
                object.__setattr__(getattr(s, name), "max_total_num_tokens", self.alloc.size)
        if self.metrics:
            self.metrics.lent_tokens.set(self.alloc.lent_tokens)
            self.metrics.lent_bytes.set(self.arena.lent_bytes)

    def _event(self, **rec) -> None:
        if self._events is not None and not self._quiet:
            rec.update(t=time.time(), lent_tokens=self.alloc.lent_tokens, tp=self.tp_size)
            self._events.write(json.dumps(rec) + "\n")

    def state(self) -> dict:
        """The ``sglang_elastic`` entry of this scheduler's internal state
        (``GET /server_info`` -> ``internal_states[i]``)."""
        return {
            "mode": self.cfg.mode, "base_tokens": self.alloc.usable_base_tokens - self.page,
            "lendable_tokens": self.arena.lendable_tokens if self.lendable_tokens else 0, "lent_tokens": self.alloc.lent_tokens, "lent_bytes": self.arena.lent_bytes,
            "cycles": self.cycles, "lending_disabled": self.disabled or self.arena.lending_disabled, "reclaims_skipped": self.reclaims_skipped,
            "prefills_deferred": self.prefills_deferred,
        }

    # -- scheduler hooks ------------------------------------------------------

    def _prefill_may_form(self, running_batch) -> bool:
        """``_get_new_batch_prefill_raw``'s early-exit condition, negated, as
        it will be evaluated: SGLang first moves ready grammar requests into
        the waiting queue, and ignores ``batch_is_full`` under priority
        preemption. Checked before SGLang matches the waiting requests'
        prefixes (a reclaim evicts and moves tree nodes)."""
        s = self.sched
        full = running_batch.batch_is_full and not getattr(s, "enable_priority_preemption", False)
        grammars = getattr(s, "grammar_manager", None)
        waiting = len(s.waiting_queue) > 0 or (grammars is not None and grammars.has_waiting_grammars())
        return s.chunked_req is not None or (not full and waiting)

    def before_prefill(self, running_batch) -> None:
        """When lent, before SGLang forms the next batch: reclaim what the next
        forward needs outside the CUDA graphs (:meth:`reserve_needed`), in
        steps (:meth:`steps_needed`), or nothing when the graphs (or the
        memory still free) hold it; a prefill that then forms is counted in
        :attr:`reclaims_skipped` (:meth:`after_prefill`)."""
        if self.cfg.mode != "dynamic":
            return
        self._pass_need = self._pass_free = self._pass_room = self._pass_short = None
        if not self.prefill_in_graphs and self.peak_memory.available:  # measure the eager prefill this pass may launch
            self._finish_measuring()
            self._probe = self.peak_memory.reset()
        awaited = self._room_awaited()
        if not self.lent and awaited is None:
            # Handles made ahead of a lend hold device memory: an eager
            # forward needs it back (released on the helper thread while
            # SGLang forms the batch; after_prefill waits for it).
            if (self.arena.prepared_steps or self.arena.preparing) and self.reserve_needed(running_batch)[0]:
                self._ahead_cancel.set()  # a job emptying torch's cache makes no step after it
                if self.arena.drop_prepared(release_async=True):  # waits for a prepare still running (not for an unmap's rest)
                    self._dropped_prepared = True
            return
        why, tokens = self.reserve_needed(running_batch)
        if why is None:  # decodes only, in the graphs: nothing to decide
            return
        requests = self._requests_bound(running_batch) if why == EAGER_PREFILL and self.cfg.activation_rule == "measured" else 0
        steps = self.steps_needed(tokens, requests) if why else 0
        if steps and awaited is not None:  # more than that unmap gives: reclaim() settles it first (the scheduler waits)
            awaited.update(defer_end="more needed", decodes=len(running_batch.reqs))
        if steps == 0 and awaited is not None:
            # an earlier pass's reclaim is still giving back its memory (defer_prefill ran the decode batch): this
            # pass's forward waits for what it needs of it, now measured (more waiting requests may need more)
            if self._pass_short is not None:
                room = self.arena.unmap_progress()[1] + self._pass_short
                # an idle reclaim was sized for the largest prefill (on_idle): this pass's prefill, the first that
                # can form after it (no decode batch runs to defer it to), waits only for what it needs
                awaited["room_bytes"] = room if awaited.get("why") == IDLE else max(awaited["room_bytes"], room)
            return
        if steps == 0:  # counted in after_prefill, if a prefill forms
            self._skip = {"held_by": "the free memory" if why else "the CUDA graphs", "why": why, "tokens": tokens,
                          **({"need_bytes": self._pass_need} if why else {})}
            return
        self.reclaim(running_batch, steps, why)

    def _pending(self) -> list:
        """The requests the next prefill may take: waiting, waiting for a grammar, and the chunked one."""
        s = self.sched
        grammars = getattr(getattr(s, "grammar_manager", None), "grammar_queue", None) or []
        return list(s.waiting_queue) + list(grammars) + ([s.chunked_req] if s.chunked_req is not None else [])

    def _requests_bound(self, running_batch) -> int:
        """The most requests the next eager prefill may hold, for :meth:`EagerActivations.need`; 0 (SGLang's
        estimate) when a request it may take is not plain (:func:`plain_request`), without chunked prefill (a
        first request is admitted whole, whatever its length) or with pipeline stages (their chunks may grow)."""
        sa = self.sched.server_args
        if not self._chunk_size() or int(getattr(sa, "pp_size", 1) or 1) > 1:
            return 0
        pending = self._pending()
        if self._mixed_chunk():  # the running decodes join the prefill batch
            pending += list(running_batch.reqs)
        return len(pending) if pending and all(plain_request(r) for r in pending) else 0

    def reserve_needed(self, running_batch):
        """What the next forward may need outside the CUDA graphs: ``(why,
        tokens)``, ``why`` empty when the graphs hold it, None when no
        prefill can form and the decode batch replays a graph (nothing to
        reclaim for); ``tokens`` for SGLang's activation estimate
        (:func:`eager_activation_bytes`): a prefill's at most
        :meth:`_prefill_tokens` (the chunk, or fewer when fewer wait).

        A decode batch above :attr:`lend_max_bs` or with embedding overrides
        runs eagerly (it can only have grown through a prefill that needed
        no reclaim). A prefill needs the reserve unless
        :attr:`prefill_in_graphs` and no request it may take (waiting,
        chunked, waiting for a grammar) has what makes SGLang's prefill graphs
        refuse a batch (``PrefillCudaGraphRunner.can_replay_locally``: input
        embeddings or embedding overrides, hidden states, more requests than a
        ``full`` graph holds) or has logprobs (``tc_piecewise`` refuses them,
        ``breakable`` and ``full`` compute their logits in an eager tail, up
        to the chunk's tokens times the vocabulary), and the
        decode batch it leads to stays within :attr:`lend_max_bs`.
        """
        from sglang.srt.model_executor.cuda_graph_config import Backend

        s = self.sched
        sa = s.server_args
        per_req = max(int(getattr(sa, "speculative_num_draft_tokens", None) or 1), 1)
        if self._decode_outside_graphs(running_batch):
            return "the decode batch runs outside the decode graphs", max(len(running_batch.reqs) * per_req, self._prefill_budget())
        if not self._prefill_may_form(running_batch):
            return None, 0
        budget = self._prefill_tokens(running_batch)
        if not self.prefill_in_graphs:
            return EAGER_PREFILL, budget
        pending = self._pending()
        prefill = sa.cuda_graph_config.prefill
        if len(running_batch.reqs) + len(pending) > self.lend_max_bs:
            # the prefill, then a decode step of every request outside the graphs
            return "the decode batch after this prefill may outgrow the decode graphs", max(budget, len(running_batch.reqs) + len(pending))
        if prefill.backend == Backend.FULL and len(pending) > (getattr(prefill, "full_prefill_max_req", None) or 1):
            return "more requests than the full prefill graphs hold", budget
        for r in pending:
            if getattr(r, "input_embeds", None) is not None or getattr(r, "positional_embed_overrides", None) is not None:
                return "a request with input or override embeddings", budget
            if getattr(r, "return_hidden_states", False):
                return "a request for hidden states", budget
            if getattr(r, "return_logprob", False):  # tc_piecewise refuses it; breakable and full run its logits tail eagerly
                return "a request for logprobs (their logits run outside the prefill graphs)", budget
        return "", 0

    def _decode_outside_graphs(self, batch) -> bool:
        """Whether ``batch`` decodes outside the decode CUDA graphs while lent: more than :attr:`lend_max_bs`
        requests, or token-embedding overrides (``replace_embeds``, which the graphs refuse at any size)."""
        return len(batch.reqs) > self.lend_max_bs or getattr(batch, "replace_embeds", None) is not None

    def _prefill_tokens(self, running_batch) -> int:
        """The most tokens the prefill this pass may form can take: the
        chunk (:meth:`_prefill_budget`), but no more than the requests it
        may take hold (:meth:`_pending`: each request's prompt and output so
        far, ``Req.seqlen``, before any cached prefix is matched; with mixed
        chunks one token of each running request too). Without chunked
        prefill SGLang admits a first request whole whatever its length
        (``PrefillAdder.add_one_req``), so then at least the longest one.
        A short prompt that finds the pool lent is sized by its own tokens
        (SGLang's estimate still floors them at 2,048), not by a whole chunk:
        seen on an H100 (2026-12-06), 64 to 512-token prompts arriving at an
        idle GPU waited 6-13 ms for the unmap of a whole 9.5 GiB step because
        a chunk of 8,192 tokens was taken to need 12.6 GiB. Only plain
        requests (:func:`plain_request`) are sized so: with one that is not
        (its prompt may be embeddings ``seqlen`` does not count, its prefill
        may run a vision encoder, its logits tail may cover every prompt
        token), the whole chunk, as before."""
        budget = self._prefill_budget()
        pending = self._pending()
        if not all(plain_request(r) for r in pending):
            return budget
        lengths = [int(getattr(r, "seqlen", 0) or 0) for r in pending]
        held = sum(lengths) + (len(running_batch.reqs) if self._mixed_chunk() else 0)
        if not self._chunk_size() and lengths:
            budget = max(budget, max(lengths))
        return min(budget, held)

    def _chunk_size(self) -> int:
        """The chunk the scheduler prefills in, 0 without chunked prefill: SGLang's
        ``Scheduler.chunked_prefill_size``, which ``init_chunked_prefill`` sets to None
        where it turns chunking off (``--chunked-prefill-size -1``, and multimodal
        models on the Transformers backend, whose server args keep the chunk), else
        the server args' (a scheduler without the attribute)."""
        s = self.sched
        chunk = s.chunked_prefill_size if hasattr(s, "chunked_prefill_size") else getattr(s.server_args, "chunked_prefill_size", 0)
        return chunk if chunk and chunk > 0 else 0

    def _mixed_chunk(self) -> bool:
        """Whether running decodes join a chunked prefill batch (``Scheduler.is_mixed_chunk``: off without chunking)."""
        s = self.sched
        return bool(s.is_mixed_chunk if hasattr(s, "is_mixed_chunk") else getattr(s.server_args, "enable_mixed_chunk", False))

    def _prefill_budget(self) -> int:
        """The tokens of the largest prefill pass: the chunk, or ``max_prefill_tokens`` without chunked prefill
        (:meth:`_chunk_size`)."""
        return self._chunk_size() or (getattr(self.sched.server_args, "max_prefill_tokens", 0) or 0)

    def steps_needed(self, tokens: int, requests: int = 0) -> int:
        """Lent steps to reclaim so that the device has SGLang's activation
        estimate for ``tokens`` free (what is free now, with what torch's
        cache holds unused, counts), or with ``requests`` (a plain eager
        prefill of at most that many, ``--elastic-kv-activation-rule
        measured``) the bound the measured passes give
        (:meth:`EagerActivations.need`; then torch's cache counts without the
        split remainders a large allocation cannot take); the most any TP rank
        needs (a collective: every rank calls it at the same pass)."""
        need = eager_activation_bytes(tokens, self._ranks())
        measured = requests > 0 and self.activations.peaks
        if measured:
            need = self.activations.need(tokens, requests, need)
        self._pass_need = need
        driver = self.arena.backend.free_bytes()
        if driver is not None:  # a reclaim's unmap still running on the helper thread: its bytes are coming back (after_prefill waits for them)
            driver += self.arena.freeing_bytes()
        cached = self.torch_cache.reusable() if measured else self.torch_cache.unused()
        free = (driver or 0) + cached
        self._pass_free = (driver, cached)  # for the reclaim's event: what was free at the driver (None: unknown) and in torch's cache
        self._pass_short = None if driver is None else need - free
        self._pass_room = None if driver is None else max(need - free, 0)
        step = max(self.arena.step_bytes(), 1)
        steps = min(max(-(-(need - free) // step), 0), self.arena.lent_steps)
        return -agree_min(self.sched, -steps)

    def after_prefill(self, new_batch, running_batch) -> None:
        """Count decode-only steps; lend after enough in a row, unless the
        next pass would reclaim at once (:meth:`reserve_needed`: requests wait
        whose prefill the CUDA graphs do not hold) or the decode batch would
        run eagerly and need the memory lent: more than :attr:`lend_max_bs`
        requests, or token-embedding overrides (``replace_embeds``: SGLang
        keeps the prefill's tensor on the batch, and the decode graphs refuse
        such a batch at any size, ``DecodeCudaGraphRunner.can_run_graph``).
        The batch grows only through a prefill; one that needed no reclaim
        may leave a decode batch above :attr:`lend_max_bs`, and the next
        pass's :meth:`before_prefill` reclaims before that decode runs."""
        if self.arena.unsettled and not self._preparing_only():  # a reclaim's (or dropped prepare's) handles released there: their memory is the forward's
            if self._room_awaited() is not None:
                # only a forward that needs the memory waits for it: a prefill that formed, or a decode batch that runs
                # eagerly; an idle pass leaves the unmap running (the same on every rank: no collective follows)
                if new_batch is not None or self.reserve_needed(running_batch)[0]:
                    self._wait_room()  # as much as the forward needs; the rest goes on behind it
            else:
                self._settle()
        skip, self._skip = self._skip, None
        if skip is not None and new_batch is not None:
            self.reclaims_skipped += 1
            if self.metrics and not self._quiet:
                self.metrics.reclaims_skipped.inc()
            self._event(op="reclaim_skipped", **skip)
        if new_batch is not None or running_batch.is_empty():
            self._run += 1
            self.decode_only_steps = 0
            return
        self.decode_only_steps += 1
        if (
            self.cfg.mode == "dynamic" and not self.lent and not self.disabled and self.lendable_tokens > 0 and self._stop is None
            and self.decode_only_steps >= self.prepare_after_steps and self.reserve_needed(running_batch)[0] in (None, "")
            and not self._decode_outside_graphs(running_batch)
        ):
            if self.decode_only_steps < self.cfg.lend_after_steps:
                self._prepare_ahead()
            elif self.lend() == 0:  # out of memory somewhere: try again after another run of decode-only steps
                self.decode_only_steps = 0

    def _preparing_only(self) -> bool:
        """The helper's only work is a prepare ahead of the lend (nothing
        released since the last settle): no forward waits for it."""
        return self._releasing is None and self._dropped_prepared is False

    @property
    def prepare_after_steps(self) -> int:
        """Decode-only steps after which the next lend's handles are made on
        the arena's helper thread: half of ``--elastic-kv-lend-after-steps``
        (none ahead with 1)."""
        return max(self.cfg.lend_after_steps // 2, 1)

    def _prepare_ahead(self) -> None:
        """Make the next lend's handles on the helper thread, once per run of
        decode-only steps, mapped at their rows: the lend maps nothing. What
        fits is :meth:`steps_that_fit`'s; where the driver's free memory falls
        short and torch's cache holds unused blocks (an eager prefill's, seen
        before the slow lends of issue 22), the cache is emptied there too,
        first (:meth:`_empty_ahead`), so that the lend neither empties it nor
        creates handles on the scheduler. Not a collective: each rank
        prepares what fits, the lend agrees."""
        a = self.arena
        if a.prepared_steps or a.busy or a.lending_disabled:
            return
        fit, _ = self.steps_that_fit(may_empty=False)  # nothing is lent here (the steps it counts are all new)
        if self.decode_only_steps == self.prepare_after_steps and self.steps_if_emptied() > fit:  # once a run, at its first try
            self._ahead_cancel.clear()
            margin, run = self._lend_margin(), self._run  # here: the helper must not read the activations' peaks mid-update
            a.prepare_async(first=lambda: self._empty_ahead(margin, run))
        elif fit:
            a.prepare_async(fit)

    def _empty_ahead(self, lend_margin: int, run: int) -> int:
        """On the arena's helper thread, before its prepare: :meth:`steps_that_fit`, emptying torch's
        cache where that backs more steps; its milliseconds go to this run's lend's event
        (``ahead_empty_cache_ms``; ``run``: :attr:`_run` when submitted). ``lend_margin``: :meth:`_lend_margin`, taken on the scheduler
        thread (it reads :class:`EagerActivations`, which that thread changes). Returns the steps to make.

        Off the scheduler, not free: ``empty_cache`` holds the caching allocator's lock while its
        ``cudaFree`` calls wait for the device, so a scheduler allocation meanwhile waits too (the
        decode already launched runs on). Measured as the decode token gaps (``bench_elastic.py``).
        An eager forward that comes meanwhile (:meth:`before_prefill` sets ``_ahead_cancel``) needs
        the memory, not a step: none is made then."""
        fit, ms = self.steps_that_fit(may_empty=True, lend_margin=lend_margin)
        self._ahead_empty = (run, ms)
        return 0 if self._ahead_cancel.is_set() else fit - self.arena.prepared_steps

    # -- lend -------------------------------------------------------------

    def lend(self) -> int:
        """Back every lendable step that fits and append its ids to the free
        list. Returns the tokens lent now (0 when nothing could be lent).

        What fits (:meth:`steps_that_fit`) is measured, not found by
        creating handles until the driver refuses; handles made ahead on the
        arena's helper thread (:meth:`after_prefill`) are mapped first, with
        no creation on this path. ``torch.cuda.empty_cache()`` runs only when
        the driver's free memory falls short of the step and the caching
        allocator's unused blocks would make up for it.

        TP > 1: a collective over the TP CPU group; every rank calls it at the
        same scheduler step (the decision inputs are replicated). A failing
        VMM call is logged and counted, never raised: the arena rolls its step
        back, out of memory is retried after the next run of decode-only
        steps (after :data:`MAX_OOM_LENDS` lends in a row that lent nothing,
        lending stops), any other failure stops lending on every rank, as
        does a rank's stopped reclaim. Without device memory left for the
        free list of the newly mapped steps, that rank rolls them back
        (:meth:`_prepare_free_list`); with nothing lent before, that is a
        lend without memory.
        """
        if self.lendable_tokens == 0:  # agreed over TP: no rank enters the collective
            return 0
        t0 = time.perf_counter()
        self._settle()  # the helper thread's prepares and releases, done before this lend measures anything
        (run, ahead_ms), self._ahead_empty = self._ahead_empty, (-1, 0.0)  # this run's, whether it lends or not
        ahead_ms = ahead_ms if run == self._run else 0.0
        err: Optional[VmmError] = None
        empty_ms = 0.0
        t_map = time.perf_counter()
        want = 0
        if self._stop is None:  # one step, nothing lent: _recut decides, emptying the cache only if that backs more
            want, empty_ms = self.steps_that_fit(may_empty=not self._one_step_unlent)
        want, recut_ms = self._recut(want, emptied=empty_ms > 0)  # a collective over TP when nothing is lent
        empty_ms += recut_ms
        prepared = self.arena.prepared_steps  # after a re-cut, which drops handles made for another size
        if self._stop is None:
            t_map = time.perf_counter()
            try:
                if want:
                    self.arena.lend(want)
            except VmmError as e:  # the arena rolled the failing step back
                err = e
                self._vmm_failed("lend", e)
        free_list = self._prepare_free_list()  # the lend's free list, made before the agreement
        # Every rank takes the same decision: lend what all ranks could back,
        # and stop lending everywhere once any rank's arena disabled lending
        # or its reclaim stopped (a rank deciding alone would leave the
        # others in this all-reduce).
        steps, ok = agree_min(self.sched, self.arena.lent_steps, int(not self.arena.lending_disabled and self._stop is None))
        if not ok:
            if not self.disabled and not self.arena.lending_disabled:
                logger.error("sglang-elastic: %s; lending is off", f"lending stopped after a reclaim stopped ({self._stop})" if self._stop else "another TP rank stopped lending")
            self.disabled = True
            steps = 0
        if self.arena.lent_steps > steps:
            try:
                self.arena.reclaim(self.arena.lent_steps - steps)
            except VmmError as e:  # the steps are dropped all the same; lending is off here from now on
                self._vmm_failed("reclaim after a short lend", e)
        if steps == 0:
            if ok:  # no device memory on some rank (every rank counts alike)
                self._oom_lends += 1
                if self._oom_lends >= MAX_OOM_LENDS:
                    self.disabled = True
                    need = self.arena.step_bytes() if self.arena.max_steps else self.lendable_tokens * sum(self.arena.row_bytes)  # a cut to nothing
                    logger.error("sglang-elastic: %d lends in a row found no device memory for %.2f GiB; lending is off", self._oom_lends,
                                 need / 2**30)
            return 0
        self._oom_lends = 0
        self.alloc.lend(steps * self.arena.step_tokens, prepared=free_list)
        self._sync_sizes()
        ms = (time.perf_counter() - t0) * 1e3
        used_prepared = min(prepared, steps)
        if self.metrics and not self._quiet:
            self.metrics.lends.inc()
            self.metrics.lend_ms.observe(ms)
        if not self._quiet and used_prepared == steps:
            self.lends_prepared += 1
        self._event(op="lend", ms=ms, empty_cache_ms=empty_ms, ahead_empty_cache_ms=ahead_ms,
                    map_ms=(time.perf_counter() - t_map) * 1e3, prepared_steps=used_prepared,
                    steps=steps, tokens=self.alloc.lent_tokens, bytes=self.arena.lent_bytes, partial=err is not None,
                    **({"free_after_bytes": self.arena.backend.free_bytes()} if self._events is not None else {}))
        self._log("sglang-elastic: lent %d KV tokens (%.2f GiB) in %.2f ms (%d of %d step(s) made ahead)", self.alloc.lent_tokens,
                  self.arena.lent_bytes / 2**30, ms, used_prepared, steps)
        return self.alloc.lent_tokens

    @property
    def _one_step_unlent(self) -> bool:
        """Lending is one step (no ``--elastic-kv-handle-mb``) and nothing is lent: :meth:`_recut` sizes the step."""
        a = self.arena
        return not self.cfg.handle_mb and not a.lent_steps and a.max_steps <= 1 and self.lendable_tokens > 0

    def _room(self, free: int, cached: int, lend_margin: Optional[int] = None) -> int:
        """Bytes a one-step lend may take: the step must be backed by ``free``
        (the driver's free memory, with handles made ahead); the margin
        (:meth:`_lend_margin`) may sit in torch's ``cached`` unused blocks
        (counted by :meth:`_margin_cache`: they serve the next eager forward, which is
        what the margin is kept for), so a cut that fits that way stays without
        emptying the cache at every lend (:meth:`_recut`) and its handles are
        made ahead (:meth:`steps_that_fit`)."""
        return min(free + cached - (self._lend_margin() if lend_margin is None else lend_margin), free)

    def _margin_cache(self) -> int:
        """torch's cached bytes that count towards the margin, as :meth:`steps_needed`
        will count them at the next eager prefill: with ``--elastic-kv-activation-rule
        measured`` (eager prefills, a pass measured) only what a large allocation can
        take (:meth:`TorchCache.reusable`), otherwise every unused block.

        Why: on the H200 (1a4cb5f) the measured margin was 1.38 GiB, but the cut
        counted 0.23 GiB of split remainders in torch's cache towards it (after
        emptying the cache, they were what it could not give back); the prefill
        counted them out, found 1.17 GiB, and each of 112 reclaimed the whole step."""
        acts = self.activations
        if self.cfg.activation_rule == "measured" and not self.prefill_in_graphs and acts.peaks:
            return self.torch_cache.reusable()
        return self.torch_cache.unused()

    def _lend_margin(self) -> int:
        """Bytes a one-step lend leaves free: ``--elastic-kv-margin-mb``, or, with
        ``--elastic-kv-activation-rule measured`` and eager prefills, the need the
        measured passes give a chunk of as many requests as the most a measured
        pass held (:meth:`EagerActivations.need`) when that is more and below half
        the start-up measure: the next such prefill then finds its activations free
        and skips the reclaim (:meth:`steps_needed`), for a step that much smaller.

        Why: on the H200 (2085840) the rule gave an 8,192-token eager prefill
        1.39 GiB against SGLang's 12.6 GiB, but the 1 GiB margin was short of it,
        so each of 113 prefills still unmapped the whole 8.6 GiB step and waited
        for the driver's release (9.3 / 15.8 ms p50 / p99) to take back 0.4 GiB."""
        margin = self.cfg.margin_mb * 2**20
        acts = self.activations
        if self.cfg.activation_rule != "measured" or self.prefill_in_graphs or not acts.peaks:
            return margin
        sa = self.sched.server_args
        chunk = self._chunk_size()
        if chunk <= 0 or int(getattr(sa, "pp_size", 1) or 1) > 1:  # as _requests_bound: SGLang's estimate there
            return margin
        estimate = eager_activation_bytes(chunk, self._ranks())
        need = acts.need(chunk, max(r for _, r in acts.peaks), estimate)
        if need >= estimate or need - margin > self.lendable_tokens * sum(self.arena.row_bytes) // 2:
            return margin
        return max(margin, need)

    def _recut(self, want: int, emptied: bool = False):
        """One-step lending (the default: no ``--elastic-kv-handle-mb``) with
        nothing lent: cut the step to what is free now less the margin, at
        most the start-up measure (:attr:`lendable_tokens`). Returns the steps
        to lend now (``want``, or the new cut's one step when it fits) and the
        milliseconds spent emptying torch's cache: only when its unused
        blocks, handed back to the driver, would back a larger cut, and not
        twice in one lend (``emptied``).

        Why: the start-up measure is the free memory after CUDA-graph capture
        less the margin, so it leaves no slack. Whatever the server allocates
        for good after that (FlashInfer's and cuBLAS's workspaces, buffers
        made at the first long prompt) made the whole step not fit, the lend
        lent nothing three times in a row and lending went off for the rest of
        the run (seen on the H200 with SGLang's default prefill graphs: 8 GiB
        measured, 9.015 GiB free after capture, margin 1 GiB, not one lend).
        Now the step shrinks to what fits and grows back, up to the start-up
        measure, when at least 1/:data:`RECUT_GROW_DIV` of it is free again; a cut below
        :data:`MIN_CUT_FRAC` of the start-up measure counts as a lend without
        memory. Handles made ahead for
        another size are released first. TP > 1: every rank calls this at the
        same lend (the conditions are replicated) and the cut is the MIN over
        ranks, so every rank lends the same token range."""
        a = self.arena
        if not self._one_step_unlent:
            return want, 0.0
        free = a.backend.free_bytes()
        if free is None:
            return want, 0.0
        row = max(sum(a.row_bytes), 1)
        margin = self._lend_margin()
        ms = 0.0

        cur = a.lendable_tokens
        full = self.lendable_tokens // a.quantum * a.quantum
        grow = max(a.quantum, self.lendable_tokens // RECUT_GROW_DIV)
        prep = a.prepared_bytes()  # handles made ahead hold memory this lend has already

        def cut(room: int) -> int:
            """The cut for ``room`` bytes: 0 below :data:`MIN_CUT_FRAC` of the start-up measure; smaller
            than the current one when that does not fit; larger only by ``grow`` tokens or more, or up to
            the whole measure (a cut that moved by a quantum at every lend would drop and remake the
            handles made ahead each time)."""
            c = min(self.lendable_tokens, max(room, 0) // row) // a.quantum * a.quantum
            if c < self.lendable_tokens * MIN_CUT_FRAC:
                return 0
            return c if c < cur or c >= min(cur + grow, full) else cur

        def room(free: int, cached: int) -> int:  # the handles made ahead back the step as the driver's free memory does
            return self._room(free + prep, cached)

        mine = 0
        if self._stop is None and not a.lending_disabled:
            # what emptying torch's cache could give back, as the margin counts it (without split remainders under the
            # measured rule: emptying cannot return those, and a 34 ms empty_cache for nothing is a slow lend)
            cached = 0 if emptied else self._margin_cache()
            mine = cut(room(free, cached))
            back = self._emptying_returns() if cached else 0
            if back and cut(room(free + back, max(cached - back, 0))) > mine:  # the cache's blocks, back at the driver, would back more
                free, ms = self._empty_measured(free)
                mine = max(mine, cut(room(free, self._margin_cache())))  # what it could not give back still counts as margin
        tokens = agree_min(self.sched, mine)  # whole token quanta on every rank (cut)
        if tokens != a.lendable_tokens:
            if a.prepared_steps:
                a.drop_prepared()  # sized for the old cut
            before = a.lendable_tokens
            a.set_steps(tokens)
            self._event(op="recut", tokens=a.lendable_tokens, before=before, free_bytes=free, margin_bytes=margin)
            self._log("sglang-elastic: the lend step is now %d tokens (%.2f GiB; it was %d): what is free less the margin "
                      "(%.2f GiB: --elastic-kv-margin-mb, or the measured eager prefill's need)", a.lendable_tokens,
                      a.lendable_tokens * row / 2**30, before, margin / 2**30)
        return (a.max_steps if self._stop is None else 0), ms

    def steps_that_fit(self, may_empty: bool = True, lend_margin: Optional[int] = None):
        """Steps the next lend may back, and the milliseconds spent emptying
        torch's cache for it (0 when it was not emptied).

        Why not ``torch.cuda.empty_cache()`` before every lend, as before
        issue 22: it synchronizes the device and returns every cached segment
        to the driver (19-33 ms of a 25-37 ms lend on the H200), and the next
        eager forward must ``cudaMalloc`` them again. What it protected: the
        caching allocator keeps freed blocks reserved, and ``cuMemCreate``
        takes only memory the driver has free (``cuMemGetInfo``'s free), so a
        lend measured at start-up could run out of memory once prefill
        activations sat in the cache. What replaces it: the handles made
        ahead need nothing; for the rest, a step fits when the driver's free
        memory covers it and the margin (``(free - margin) // step_bytes``):
        only truly free bytes are lent, and the margin stays free at the
        driver, where any allocation can use it (NCCL and other non-torch
        users included, which torch's cached blocks cannot serve). Only when
        that falls short and the cache holds unused blocks (so that emptying
        it can help) is the cache emptied, once, and the steps measured
        again; a lend is never tried on memory the allocator still holds. So
        in the common case (a lend after a run of graph-replayed decodes,
        the cache's blocks not needed) the lend costs one ``cuMemGetInfo``
        and keeps the cache for the next eager forward. A backend that
        cannot tell its free memory lends every step (the host backend
        without a capacity).

        One step with nothing lent (the default), the step is :meth:`_recut`'s
        cut and the margin may sit in torch's unused cached blocks, as the cut
        counts it: the step itself must fit in the driver's free memory.

        Args:
            may_empty: False: never empty the cache.
            lend_margin: :meth:`_lend_margin`, taken by the caller (the helper thread's
                :meth:`_empty_ahead`); None: taken here.
        """
        remaining, new, free = self._lend_room()
        if new <= 0 or free is None:
            return remaining, 0.0
        fit = self._step_fit(lend_margin)
        ms = 0.0
        if may_empty and fit(free) < min(new, self._fit_if_emptied(free, fit)):
            free, ms = self._empty_measured(free)
        return remaining - new + min(new, fit(free)), ms

    def _emptying_returns(self) -> int:
        """Bytes emptying torch's cache is taken to give the driver: :meth:`TorchCache.returnable`, less what
        the last emptying gave back short of it (``_empty_overstated``)."""
        return max(self.torch_cache.returnable() - self._empty_overstated, 0)

    def _empty_measured(self, free: int) -> Tuple[int, float]:
        """Empty torch's cache; returns the driver's free bytes after and the milliseconds spent, and
        keeps how much less than :meth:`TorchCache.returnable` came back (``_empty_overstated``)."""
        said = self.torch_cache.returnable()
        t = time.perf_counter()
        self.torch_cache.empty()
        ms = (time.perf_counter() - t) * 1e3
        after = self.arena.backend.free_bytes() or 0
        self._empty_overstated = max(said - (after - free), 0)
        return after, ms

    def steps_if_emptied(self) -> int:
        """What :meth:`steps_that_fit` would give after emptying torch's cache, as it predicts that
        before emptying (no emptying here): more than it gives now only where the cache's whole
        blocks, back at the driver, would back another step."""
        remaining, new, free = self._lend_room()
        if new <= 0 or free is None:
            return remaining
        return remaining - new + min(new, self._fit_if_emptied(free, self._step_fit(None)))

    def _lend_room(self) -> Tuple[int, int, Optional[int]]:
        """The steps not lent, those of them not made ahead, and the driver's free bytes (None: unknown)."""
        a = self.arena
        remaining = a.max_steps - a.lent_steps
        return remaining, remaining - min(a.prepared_steps, remaining), a.backend.free_bytes()

    def _step_fit(self, lend_margin: Optional[int]) -> Callable[..., int]:
        """``fit(free, cached=None)``: the new steps ``free`` driver bytes back, with ``cached`` (default: now) of
        torch's unused blocks counted as :meth:`_margin_cache` counts them."""
        a = self.arena
        step, margin = max(a.step_bytes(), 1), self.cfg.margin_mb * 2**20
        # one step with nothing lent (the step :meth:`_recut` sizes): the margin may sit in torch's unused cached
        # blocks, as the cut counts it, or the handles made ahead for the cut would never fit (seen on the H200:
        # 112 of 113 eager lends created their 8.6 GiB of handles on the lend path, map_ms p50 5.8 against 3.3)
        one = self._one_step_unlent

        def fit(free: int, cached: Optional[int] = None) -> int:
            c = self._margin_cache() if cached is None else cached
            return max(self._room(free, c, lend_margin) if one else free - margin, 0) // step

        return fit

    def _fit_if_emptied(self, free: int, fit: Callable[..., int]) -> int:
        """The new steps ``fit`` gives once torch's cache is emptied: its whole blocks
        (:meth:`TorchCache.returnable`, less what the last emptying gave back short of it) back at
        the driver, the rest (split remainders, which ``empty_cache`` cannot return) still counted
        towards the margin where it counts them."""
        back = self._emptying_returns()
        return fit(free + back, max(self._margin_cache() - back, 0)) if back > 0 else fit(free)

    def _prepare_free_list(self) -> Optional[torch.Tensor]:
        """The free list for every step the arena backs now
        (:meth:`~sglang_elastic.pool.kv_pool._ElasticAllocatorMixin.prepare_lend`), made before the TP
        ranks agree on the steps to lend. Without device memory for it, this rank's newly mapped
        steps are rolled back (so it offers no more than it lent before, and the agreement lends
        that on every rank) and ``None`` is returned.

        Why: made after the mapping and the agreement, it raised ``torch.OutOfMemoryError`` out of
        the scheduler when the step took the last free memory (``--elastic-kv-margin-mb 0`` on an
        H100: the server died at start-up), and at TP > 1 a rank failing there alone would leave the
        ranks with different lent ranges."""
        a = self.arena
        if a.lent_steps * a.step_tokens <= self.alloc.lent_tokens:
            return None
        try:
            return self.alloc.prepare_lend(a.lent_steps * a.step_tokens)
        except torch.OutOfMemoryError:
            new = a.lent_steps - self.alloc.lent_tokens // a.step_tokens
            logger.warning("sglang-elastic: no device memory for the lend's free list after mapping %d step(s); rolled them "
                           "back (--elastic-kv-margin-mb %d: raise it if this repeats)", new, self.cfg.margin_mb)
            try:
                a.reclaim(new)
            except VmmError as e:  # the steps are dropped all the same; lending is off here from now on
                self._vmm_failed("reclaim after a lend without memory for its free list", e)
            return None

    def _vmm_failed(self, what: str, e: VmmError) -> None:
        if self.metrics:
            self.metrics.vmm_failures.inc()
        if self.arena.lending_disabled:
            logger.error("sglang-elastic: %s failed (%s); lending disabled, serving on the base pool", what, e)
        else:
            logger.warning("sglang-elastic: %s ran out of device memory (%s); will try again later", what, e)

    # -- reclaim ------------------------------------------------------------

    def reclaim(self, running_batch, steps: Optional[int] = None, why: str = "") -> bool:
        """Vacate and unmap the top ``steps`` lent steps (default: every lent
        row; see the module docstring); ``why``: for the event log.
        Requests whose KV cannot move into the base are retracted (re-queued),
        never dropped; idle streaming sessions may lose their KV (their next
        turn prefills again). No collective: every rank reaches the same state
        from the same inputs.

        Args:
            running_batch: SGLang's running ``ScheduleBatch`` (retracted
                requests are filtered out of it).

        Returns:
            True when every lent row was vacated and unmapped; False when the
            reclaim stopped (:meth:`_stop_reclaim`): the pool is lent as
            before, every retracted request is re-queued, one error is logged,
            lending is off and the reclaim is tried again before the next
            prefill. Never raises, but for a failure while the remapped ids
            are being written (tensor assignments, after every check passed).
        A failing unmap is logged, not raised: the rows are vacated, lending
        stops. TP > 1: a collective (every lent rank calls it at the same
        pass); when any rank's reclaim must stop, every rank stops, before
        anything is rewritten or unmapped, so the ranks stay lent alike.
        """
        t0 = time.perf_counter()
        self._settle()
        # The overlap scheduler's in-flight batch reads and writes lent rows:
        # the vacate's device work (copies, row rewrites) is queued after the
        # last forward that used them, the host waits only before the unmap.
        fwd_fence = self._forward_fence  # kept: a reclaim that stops is tried again, maybe before another forward
        t_vacate = time.perf_counter()
        steps = self.arena.lent_steps if steps is None else min(steps, self.arena.lent_steps)
        keep = (self.arena.lent_steps - steps) * self.arena.step_tokens  # the lower steps stay lent
        top = self.arena.base_tokens + keep
        lent_before = self.alloc.lent_tokens
        retracted: List = []
        stop: Optional[str] = None
        commit = dst = withdrawn = None
        dropped = 0
        t_withdrawn = t_room = None  # the vacate's parts, for the event log (the withdraw reads the free list on the device)
        try:
            # withdraw's own checks raise before it changes anything (withdrawn stays None: nothing to undo)
            withdrawn = in_use = self.alloc.withdraw(keep)
            t_withdrawn = time.perf_counter()
            in_use, dropped = self._make_room(running_batch, in_use, retracted)
            t_room = time.perf_counter()
            if in_use.numel() * self.page > self.alloc.available_size():
                stop = (f"the base has no room for {in_use.numel()} lent page(s) still in use after evicting, dropping idle "
                        f"sessions' KV{'' if self._stop else ' and retracting every running request'}")
            elif in_use.numel():
                # the copies read rows the last forward may still write: queued after it. Only here: the
                # free-list work above reads the device (withdraw, still_in_use), and on a stream ordered
                # after the forward each such read waited for it (the H200: ~8 ms at p99 of "vacate"
                # with 40 decodes in flight and nothing to move)
                self.fences.order_after(fwd_fence)
                dst = relocate_kv(self.pool, self.alloc, in_use)  # cannot be None: the room is there
                try:
                    commit = self._remap(running_batch, top, in_use, dst)
                except BaseException:
                    self.alloc.free(unit_tokens(dst, self.page))
                    dst = None
                    raise
        except Exception as e:  # a bug: nothing was rewritten yet, so the pool can go back
            logger.exception("sglang-elastic: reclaim failed")
            stop = f"{type(e).__name__}: {e}"
        # Every TP rank goes on, or every rank stops, before anything is rewritten or unmapped: a rank
        # that stopped alone would stay lent while the others are not, and the next collective
        # (steps_needed before a prefill, the next lend) would find it missing.
        if not agree_min(self.sched, int(stop is None)):
            if dst is not None:  # copied into, never written into any holder: back to the free list
                self.alloc.free(unit_tokens(dst, self.page))
            return self._stop_reclaim(running_batch, lent_before, withdrawn, retracted, stop or "another TP rank's reclaim stopped")
        moved = in_use.numel()
        if commit is not None:
            commit()
        t_unmap = time.perf_counter()
        vacate_fence = self.fences.record()  # after the copies and row rewrites
        waited = []

        def wait():  # what the unmap requires: the last forward that used the rows, and the vacate's own device work
            t = time.perf_counter()
            self.fences.wait(fwd_fence)
            self.fences.wait(vacate_fence)
            waited.append(time.perf_counter() - t)

        t_start_unmap = time.perf_counter()
        unmap_async = not self._quiet  # the warm-up's reclaim stays on this thread
        self._unmap_lent("reclaim", steps, wait=wait, release_async=unmap_async, unmap_async=unmap_async)
        if retracted:
            self._requeue(running_batch, retracted)
        if dropped:
            logger.warning("sglang-elastic: reclaim dropped the KV of %d idle streaming session(s) (the base had no room); their next turn prefills again", dropped)
        self.cycles += 1
        self.decode_only_steps = 0
        ms = (time.perf_counter() - t0) * 1e3
        if self.metrics and not self._quiet:
            self.metrics.reclaims.inc()
            self.metrics.reclaim_ms.observe(ms)
            self.metrics.migrated_pages.inc(moved)
            self.metrics.retracted_reqs.inc(len(retracted))
        wait_ms = sum(waited) * 1e3
        vacate_ms, unmap_ms = (t_unmap - t_vacate) * 1e3, (time.perf_counter() - t_unmap) * 1e3 - wait_ms
        rec = dict(op="reclaim", ms=ms, wait_ms=wait_ms, vacate_ms=vacate_ms, unmap_ms=unmap_ms, moved_units=moved, retracted=len(retracted),
                   dropped_sessions=dropped, steps=steps, why=why, need_bytes=self._pass_need,
                   **({"withdraw_ms": (t_withdrawn - t_vacate) * 1e3, "make_room_ms": (t_room - t_withdrawn) * 1e3} if t_room else {}),
                   **({"free_bytes": self._pass_free[0], "cache_bytes": self._pass_free[1]} if self._pass_free else {}))
        if self.arena.unsettled:  # handles released on the helper thread: the event is written once they are (_settle)
            self._releasing = dict(rec, t_end=time.perf_counter(), unmap_async=unmap_async, t_start_unmap=t_start_unmap,
                                   room_bytes=self._pass_room)
        else:
            self._reclaim_event(dict(rec, release_wait_ms=0.0))
        self._last_reclaim = f"wait {wait_ms:.2f}, vacate {vacate_ms:.2f}, unmap {unmap_ms:.2f} ms"
        self._log("sglang-elastic: reclaimed in %.2f ms (%s; %d pages moved, %d requests retracted)", ms, self._last_reclaim, moved, len(retracted))
        return True

    def _make_room(self, batch, in_use: torch.Tensor, retracted: List):
        """Free base room for the lent units still in use, cheapest first:
        SGLang's LRU eviction of the radix tree (``evict_from_tree_cache``;
        frees of lent ids are dropped and shrink what must move), then the KV
        of an idle streaming session (:meth:`_drop_idle_session`), then a
        retraction (:meth:`_retract_one`; not after a stopped reclaim: it could
        not make room then). Returns the units still in use and the sessions
        dropped; there may still be too little room."""
        from sglang.srt.mem_cache.common import evict_from_tree_cache

        dropped = 0
        while True:
            in_use = self.alloc.still_in_use(in_use)
            need, avail = in_use.numel() * self.page, self.alloc.available_size()
            if need <= avail:
                return in_use, dropped
            evict_from_tree_cache(self.sched.tree_cache, need)
            after = self.alloc.still_in_use(in_use)
            if after.numel() < in_use.numel() or self.alloc.available_size() > avail:
                continue
            if self._drop_idle_session(batch):
                dropped += 1
            elif self._stop is not None or not self._retract_one(batch, retracted):
                return after, dropped

    def _requests(self, batch) -> List:
        """Every request that may hold a ``req_to_token`` row now: the running
        batch, the chunked request, the last batch, the waiting queue (a
        streaming request restores its session's row when SGLang matches it,
        before admission)."""
        s = self.sched
        last = getattr(s, "last_batch", None)
        reqs = list(batch.reqs) + ([s.chunked_req] if s.chunked_req is not None else [])
        reqs += list(last.reqs) if last is not None else []
        return reqs + list(s.waiting_queue)

    def _drop_idle_session(self, batch) -> bool:
        """Release the KV of the least recently active streaming session whose
        slot no request references (SGLang's ``StreamingSession.release_session``,
        as for an aborted turn: its next turn matches the radix tree and
        prefills the rest). Returns False when there is none."""
        s = self.sched
        slots = getattr(s.tree_cache, "slots", None)
        if not slots:
            return False
        referenced = {getattr(r, "req_pool_idx", None) for r in self._requests(batch)}
        idle = [sid for sid, slot in slots.items() if slot.is_holding_kv and slot.req_pool_idx not in referenced]
        if not idle:
            return False
        sessions = getattr(getattr(s, "session_controller", None), "sessions", {})
        sid = min(idle, key=lambda i: getattr(sessions.get(i), "last_active_time", 0.0))
        s.tree_cache.release_session(sid)
        return True

    def _stop_reclaim(self, batch, lent_before: int, withdrawn: Optional[torch.Tensor], retracted: List, why: str) -> bool:
        """A reclaim that cannot finish: the withdraw is undone (the arena
        still backs every lent row; what is no longer held goes back on the
        free list), the retracted requests are re-queued, lending stops (on
        every rank at the next :meth:`lend`), one error. The reclaim is tried
        again before the next prefill, without retracting: a retraction did
        not make room, and a re-queued request re-admitted on lent rows would
        be retracted again at every pass. ``withdrawn`` None: the withdraw
        itself refused (it changed nothing). Returns False."""
        if withdrawn is not None:
            self.alloc.restore_lent(lent_before, withdrawn)
        self._sync_sizes()
        if retracted:
            self._requeue(batch, retracted)
        self._stop = why
        self.decode_only_steps = 0
        if self.metrics and not self._quiet:
            self.metrics.reclaim_stops.inc()
        self._event(op="reclaim_stopped", why=why, retracted=len(retracted))
        logger.error("sglang-elastic: reclaim stopped (%s): the pool stays lent (%d tokens), %d retracted request(s) re-queued, "
                     "lending is off; the reclaim is tried again before the next prefill", why, self.alloc.lent_tokens, len(retracted))
        return False

    def _retract_one(self, batch, retracted: List) -> bool:
        """Retract the running request holding the most KV (fewest retractions
        free the room). Unlike SGLang's ``retract_decode``, which aborts its
        last request when even that one does not fit, the last one is
        re-queued too: nothing is dropped."""
        if not batch.reqs:
            return False
        idx = max(range(len(batch.reqs)), key=lambda i: batch.reqs[i].kv.kv_allocated_len if batch.reqs[i].kv else 0)
        req = batch.reqs[idx]
        batch.release_req(idx, len(batch.reqs) - 1, self.sched.server_args)
        batch.filter_batch(keep_indices=[i for i in range(len(batch.reqs)) if i != idx])
        batch.batch_is_full = False
        retracted.append(req)
        return True

    def _requeue(self, batch, retracted: List) -> None:
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker

        s = self.sched
        if batch.reqs:  # as SGLang's retract_decode, from the requests kept (it always keeps one)
            s.new_token_ratio_tracker.current = NewTokenRatioTracker.estimate_new_token_ratio_after_retract(batch.reqs)
        for req in retracted:
            s._add_request_to_queue(req, is_retracted=True)
        logger.warning("sglang-elastic: reclaim retracted %d request(s) (the base had no room for their KV); re-queued", len(retracted))

    def _remap(self, batch, top: int, src: torch.Tensor, dst: torch.Tensor):
        """Every id held above ``top`` moved from ``src`` to ``dst``, computed
        first and written by the returned callable: ``req_to_token`` rows of
        the running requests, the chunked request and the streaming-session
        slots (each up to its allocated length), the running and chunked
        requests' ``prefix_indices``, and the radix tree's node values.

        Raises:
            ValueError: from :func:`~sglang_elastic.pool.remap_ids` when a held
                id above the top was not relocated; nothing is written then.
        """
        s = self.sched
        nodes, values = ([], []) if s.tree_cache.is_chunk_cache() else plan_tree_remap(s.tree_cache, top, src, dst, self.page)
        # the chunked request is kept out of the running batch between chunks
        owners = list(batch.reqs) + ([s.chunked_req] if s.chunked_req is not None and s.chunked_req not in batch.reqs else [])
        rows = {}  # req_pool_idx -> allocated length; a running turn shares its session slot's row
        for r in owners:
            if r.kv is not None and r.kv.kv_allocated_len > 0:
                rows[r.req_pool_idx] = max(rows.get(r.req_pool_idx, 0), r.kv.kv_allocated_len)
        for slot in (getattr(s.tree_cache, "slots", None) or {}).values():
            if slot.is_holding_kv and slot.kv.kv_allocated_len > 0:
                rows[slot.req_pool_idx] = max(rows.get(slot.req_pool_idx, 0), slot.kv.kv_allocated_len)
        r2t = s.req_to_token_pool.req_to_token
        block = None
        if rows:
            idx = torch.tensor(list(rows), dtype=torch.int64, device=r2t.device)
            lens = torch.tensor(list(rows.values()), dtype=torch.int64, device=r2t.device)
            width = int(max(rows.values()))
            block = r2t[idx, :width]
            valid = torch.arange(width, device=r2t.device)[None, :] < lens[:, None]
            block[valid] = remap_ids(block[valid], top, src, dst, self.page)
        holders = [r for r in owners if getattr(r, "prefix_indices", None) is not None and r.prefix_indices.numel()]
        prefixes, hit = remap_many([r.prefix_indices for r in holders], top, src, dst, self.page)

        def commit():
            for node, value in zip(nodes, values):
                node.value = value
            if block is not None:
                r2t[idx, :width] = block
            for i in hit:
                holders[i].prefix_indices = prefixes[i]

        return commit
