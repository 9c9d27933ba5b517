"""Prometheus metrics of the elastic KV pool, on SGLang's ``/metrics``.

SGLang's scheduler processes write prometheus_client's multiprocess files
(``sglang/srt/observability/metrics_collector.py``); metrics created here in
the same process, with the same labels, appear on the HTTP server's
``/metrics`` next to SGLang's own ``sglang:*`` series. Created only when
SGLang runs with ``--enable-metrics``.
"""

from __future__ import annotations

from typing import Dict

# Latencies seen on the H200: lend 4-20 ms, reclaim 3-10 ms (full reserve).
_MS_BUCKETS = (0.5, 1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 30, 50, 100, 250, 1000)


class ElasticMetrics:
    """Gauges ``sglang_elastic:lent_bytes`` / ``lent_tokens``; counters
    ``lends`` / ``reclaims`` / ``migrated_pages`` / ``retracted_reqs`` /
    ``vmm_failures`` / ``reclaim_stops`` / ``reclaims_skipped`` / ``prefills_deferred``; histograms ``lend_ms`` / ``reclaim_ms`` /
    ``reclaim_needed_ms`` / ``reclaim_delay_ms`` (milliseconds)."""

    def __init__(self, labels: Dict[str, str]):
        from prometheus_client import Counter, Gauge, Histogram

        names = list(labels)
        self.labels = dict(labels)

        def gauge(name, doc):
            return Gauge(f"sglang_elastic:{name}", doc, labelnames=names, multiprocess_mode="mostrecent").labels(**self.labels)

        def counter(name, doc):
            return Counter(f"sglang_elastic:{name}", doc, labelnames=names).labels(**self.labels)

        def hist(name, doc):
            return Histogram(f"sglang_elastic:{name}", doc, labelnames=names, buckets=_MS_BUCKETS).labels(**self.labels)

        self.lent_bytes = gauge("lent_bytes", "Bytes of the prefill reserve lent to the KV cache now.")
        self.lent_tokens = gauge("lent_tokens", "KV tokens lent now (on top of SGLang's max_total_num_tokens).")
        self.lends = counter("lends", "Lend operations.")
        self.reclaims = counter("reclaims", "Reclaim operations.")
        self.migrated_pages = counter("migrated_pages", "Pages (tokens at page size 1) whose K/V moved into the base on a reclaim.")
        self.retracted_reqs = counter("retracted_reqs", "Decode requests retracted (re-queued) because the base had no room on a reclaim.")
        self.vmm_failures = counter("vmm_failures", "Failed VMM calls (lending is disabled after a non-OOM one).")
        self.reclaims_skipped = counter("reclaims_skipped", "Prefills that ran while lent with nothing reclaimed (the CUDA graphs, or the free memory, held their activations).")
        self.prefills_deferred = counter("prefills_deferred", "Scheduler passes that ran the decode batch instead of a prefill whose memory a reclaim "
                                         "was still giving back (--elastic-kv-reclaim-wait decode).")
        self.reclaim_stops = counter("reclaim_stops", "Reclaims that stopped with the pool still lent (no base room, or a failure); lending is off after one.")
        self.lend_ms = hist("lend_ms", "Lend latency on the scheduler thread, ms.")
        self.reclaim_ms = hist("reclaim_ms", "Reclaim latency on the scheduler thread (the vacate; the unmap runs on a helper thread), ms.")
        self.reclaim_needed_ms = hist("reclaim_needed_ms", "What the scheduler waited for a reclaim: the reclaim on its thread (not for one "
                                      "made while idle, which kept nobody waiting) plus the wait for the memory the forward needs from the "
                                      "helper thread's unmap (passes that ran the decode batch meanwhile not counted: reclaim_delay_ms), ms.")
        self.reclaim_delay_ms = hist("reclaim_delay_ms", "From a reclaim's start to the launch of the forward it was for, decode passes run "
                                     "meanwhile included (--elastic-kv-reclaim-wait decode); for one made while idle, what the "
                                     "next forward waited for it, ms.")
