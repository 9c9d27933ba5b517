"""Prometheus metrics of the KV offload path, on SGLang's ``/metrics``.

Created in the scheduler process like SGLang's own (``prometheus_client``
multiprocess files, ``sglang/srt/observability/metrics_collector.py``), with
SGLang's labels, when SGLang runs with ``--enable-metrics``; updated every
``--decode-log-interval`` decode steps from the backend's counters
(:meth:`sglang_elastic.offload.backend.OffloadAttnBackend.stats`).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple


def flat_counters(tensors: Sequence):
    """``tensors`` (integer counters of any dtype and shape) as one flat int64 tensor on their device, in order."""
    import torch

    return torch.cat([t.reshape(-1).to(torch.int64) for t in tensors])


class AsyncSnapshot:
    """Device counters, and the host state that goes with them, read back
    without a host sync.

    Why: the decode-log interval of a serving scheduler (every 40 decode steps
    by default) should not wait for the GPU; the offload counters were read
    there with ``.tolist()`` and ``int(tensor)``, each a wait for the current
    stream (how long that is under SGLang's overlap loop is not measured).

    :meth:`take` returns the snapshot queued by an earlier take once the GPU
    has copied it (its event ``query()``-ed, never waited for), each snapshot
    once, then queues the next: a ``torch.cat`` of the counters (int64) copied
    without blocking into pinned host memory behind the current stream's work,
    with an event and the host state and the time given with it. While a copy
    is in flight it returns None and queues nothing. CPU tensors (no CUDA) are
    read at once. The same pattern as the decode policy's ``ReplayTimer``
    (``sglang_elastic/attention/online.py``).

    Args:
        event_factory: makes one event (default ``torch.cuda.Event``; tests inject fakes).
        force_async: take the queued path for CPU tensors too (tests).
        clock: seconds (default ``time.monotonic``).
    """

    def __init__(self, event_factory: Optional[Callable[[], object]] = None, force_async: bool = False,
                 clock: Optional[Callable[[], float]] = None):
        import time

        self._make = event_factory
        self._force = force_async
        self._clock = clock or time.monotonic
        self._pending = None  # (event, host buffer, host state, time taken)

    def take(self, tensors: Sequence, host: dict) -> Optional[Tuple[List[int], dict, float]]:
        """``tensors``: device counters (any integer dtype and shape, read flattened in order); ``host``: the
        host state to keep with them. Returns ``(values, host, time)`` of the snapshot an earlier take queued,
        once its copy is done (each once), else None; CPU tensors: this take's, at once."""
        import torch

        done = None
        if self._pending is not None:
            ev, buf, h, t = self._pending
            if not ev.query():
                return None  # the GPU has not copied it yet: nothing new, nothing more queued
            done = ([int(x) for x in buf.tolist()], h, t)
            self._pending = None
        flat = flat_counters(tensors)
        now = self._clock()
        if not flat.is_cuda and not self._force:
            return [int(x) for x in flat.tolist()], host, now
        buf = torch.empty(flat.shape, dtype=torch.int64, pin_memory=flat.is_cuda)  # pinned: a pageable copy would block
        buf.copy_(flat, non_blocking=True)
        if self._make is not None:
            ev = self._make()
            ev.record()
        else:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(flat.device))  # the stream the copy was queued on
        self._pending = (ev, buf, host, now)
        return done


class OffloadMetrics:
    """Gauges ``sglang_elastic:offload_hit_rate`` (hot-buffer hits over the
    last interval), ``offload_pcie_read_gb_per_s`` / ``offload_pcie_write_gb_per_s``
    (over the interval's wall time), ``offload_pcie_bytes_per_step``,
    ``offload_host_pool_bytes`` (V bytes of the tokens in use),
    ``offload_hot_pages_used`` (hot-buffer pages held by running requests),
    ``offload_kept_tokens`` / ``offload_kept_requests`` (``--kv-offload-keep-v``),
    ``offload_copy_hidden_share`` / ``offload_copy_ms_per_step`` (``--kv-offload-copy-timing``:
    the share of the timed steps' V copy time hidden behind compute, and their copy time), counters
    ``offload_pcie_read_bytes`` / ``offload_pcie_write_bytes`` (the decode's V rows) and
    ``offload_prefix_stage_bytes`` (V of prefill prefixes read from the host: a chunked prompt's
    earlier chunks, a prefix SGLang's radix cache matched).

    Args:
        labels: SGLang's metric labels, or None (no Prometheus: only the log line).
    """

    def __init__(self, labels: Optional[Dict[str, str]]):
        import time

        self._clock = time.monotonic
        self._last = None  # (time, stats) at the previous update
        self.g = None
        if labels is not None:
            from prometheus_client import Counter, Gauge

            names = list(labels)

            def gauge(name, doc):
                return Gauge(f"sglang_elastic:{name}", doc, labelnames=names, multiprocess_mode="mostrecent").labels(**labels)

            def counter(name, doc):
                return Counter(f"sglang_elastic:{name}", doc, labelnames=names).labels(**labels)

            self.g = {
                "hit_rate": gauge("offload_hit_rate", "Hot-buffer hits / selected V rows over the last interval."),
                "read_gbps": gauge("offload_pcie_read_gb_per_s", "V rows copied host -> GPU, GB/s over the last interval."),
                "write_gbps": gauge("offload_pcie_write_gb_per_s", "V rows written GPU -> host, GB/s over the last interval."),
                "bytes_per_step": gauge("offload_pcie_bytes_per_step", "PCIe bytes (both directions) per decode step over the last interval."),
                "host_bytes": gauge("offload_host_pool_bytes", "Host V bytes of the tokens in use."),
                "hot_pages": gauge("offload_hot_pages_used", "Hot-buffer pages held by running requests."),
                "kept_tokens": gauge("offload_kept_tokens", "Pool slots holding kept V (--kv-offload-keep-v): dense requests' tokens."),
                "kept_requests": gauge("offload_kept_requests", "Requests attending densely from kept V (--kv-offload-keep-v)."),
                "copy_hidden": gauge("offload_copy_hidden_share", "Share of the V copy time hidden behind compute over the last interval's timed steps (--kv-offload-copy-timing)."),
                "copy_ms": gauge("offload_copy_ms_per_step", "V copy time (host -> GPU) per timed decode step, ms, over the last interval (--kv-offload-copy-timing)."),
                "read": counter("offload_pcie_read_bytes", "V bytes copied host -> GPU."),
                "write": counter("offload_pcie_write_bytes", "V bytes written GPU -> host."),
                "stage": counter("offload_prefix_stage_bytes", "V bytes of prefill prefixes (earlier chunks, radix-cache hits) read host -> GPU."),
            }

    def update(self, st: dict, used_tokens: int, host_token_bytes: int, now: Optional[float] = None) -> str:
        """Update from :meth:`~sglang_elastic.offload.backend.OffloadAttnBackend.stats`; ``now``: when those
        counters were taken (seconds, this object's clock; default: now), so a snapshot read an interval
        late still gives each interval's bytes over its own time. Returns a one-line summary."""
        now = self._clock() if now is None else now
        prev_t, prev = self._last if self._last else (None, None)
        self._last = (now, st)
        if prev is None:
            return ""
        dt = max(now - prev_t, 1e-9)
        d = {k: st[k] - prev[k] for k in ("hits", "misses", "pcie_read_bytes", "pcie_write_bytes", "decode_steps")}
        sel = d["hits"] + d["misses"]
        hit = d["hits"] / sel if sel else None
        steps = max(d["decode_steps"], 1)
        read_gbps, write_gbps = d["pcie_read_bytes"] / dt / 1e9, d["pcie_write_bytes"] / dt / 1e9
        per_step = (d["pcie_read_bytes"] + d["pcie_write_bytes"]) / steps
        host = used_tokens * host_token_bytes
        staged = st.get("prefix_stage_bytes", 0) - prev.get("prefix_stage_bytes", 0)
        if self.g is not None:
            if hit is not None:
                self.g["hit_rate"].set(hit)
            self.g["read_gbps"].set(read_gbps)
            self.g["write_gbps"].set(write_gbps)
            self.g["bytes_per_step"].set(per_step)
            self.g["host_bytes"].set(host)
            if "hot_pages" in st:
                self.g["hot_pages"].set(st["hot_pages"] - st["hot_pages_free"])
            if "kept_tokens" in st:
                self.g["kept_tokens"].set(st["kept_tokens"])
                self.g["kept_requests"].set(st["kept_requests"])
            self.g["read"].inc(d["pcie_read_bytes"])
            self.g["write"].inc(d["pcie_write_bytes"])
            self.g["stage"].inc(staged)
        copy = None
        if "copy_ms" in st:
            from sglang_elastic.offload.copytime import interval

            copy = interval(prev, st)
            if self.g is not None and copy["copy_ms_per_step"] is not None:
                self.g["copy_ms"].set(copy["copy_ms_per_step"])
                if copy["copy_hidden_share"] is not None:
                    self.g["copy_hidden"].set(copy["copy_hidden_share"])
        hit_s = "n/a" if hit is None else f"{hit:.3f}"
        lost = st.get("summary_overflow", 0) - prev.get("summary_overflow", 0)
        short = st.get("hot_page_overflow", 0) - prev.get("hot_page_overflow", 0)
        pages = f", hot pages {st['hot_pages'] - st['hot_pages_free']}/{st['hot_pages']}" if "hot_pages" in st else ""
        if "kept_tokens" in st:
            demoted = st["keep_demotions"] - prev.get("keep_demotions", 0)
            pages += f", kept V {st['kept_requests']} requests / {st['kept_tokens']} tokens ({demoted} demoted)"
        if copy is not None and copy["copy_ms_per_step"] is not None:
            share = copy["copy_hidden_share"]
            pages += f", copies {copy['copy_ms_per_step']:.2f} ms/step, {'n/a' if share is None else f'{share:.0%}'} hidden"
        if staged:
            pages += f", prefixes staged {staged / 1e9:.2f} GB"
        return (f"hit rate {hit_s}, PCIe read {read_gbps:.2f} GB/s write {write_gbps:.2f} GB/s, "
                f"{per_step / 1e6:.1f} MB/step, host pool {host / 1e9:.1f} GB in use{pages}"
                + (f"; {lost} chunks found no V-summary slot (estimate reads them as zero)" if lost > 0 else "")
                + (f"; {short} hot-page grants found the pool short" if short > 0 else ""))
