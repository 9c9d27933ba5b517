"""Lend/reclaim latency of the elastic arena on a real GPU (CUDA VMM).

Builds :class:`sglang_elastic.vmm.ElasticArena` with SGLang's per-layer KV
buffers for a model shape (Llama-3.1-8B: 64 buffers = 32 layers x K,V, each
8 KV heads x 128 x bf16 = 2,048 B/token), the base sized like the stock pool
(906,051 tokens on the H200), and times lend and reclaim of the elastic tail
for several sizes and handle layouts. Checks on the way that base bytes survive
every cycle and that lent memory is usable (written and read back).

    python scripts/gpu/bench_vmm.py --out docs/results/vmm_h200.json

This times the VMM part of lend/reclaim only (map/unmap/create/release); the
pool-level numbers (vacating pages, scheduler hooks) come with the pool.
"""

from __future__ import annotations

import argparse
import statistics
import time

from sglang_elastic import results
from sglang_elastic.vmm import ElasticArena
from sglang_elastic.vmm.cuda import CudaBackend

GiB = 1 << 30


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


class CallTimer:
    """Wraps a backend's driver calls and sums their wall time per call name."""

    NAMES = ("create", "map", "unmap", "release")

    def __init__(self, be):
        self.be, self.ms = be, {n: 0.0 for n in self.NAMES}
        for n in self.NAMES:
            setattr(be, n, self._wrap(n, getattr(be, n)))

    def _wrap(self, name, fn):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.ms[name] += (time.perf_counter() - t0) * 1e3

        return timed

    def reset(self):
        self.ms = {n: 0.0 for n in self.NAMES}

    def remove(self):
        for n in self.NAMES:
            delattr(self.be, n)


def run_case(be, rows, base_tokens, elastic_bytes, steps, cycles, offset_mapping=True):
    per_token = sum(rows)
    elastic_tokens = elastic_bytes // per_token
    saved = be.supports_offset_mapping
    be.supports_offset_mapping = offset_mapping and saved
    a = ElasticArena(be, rows, base_tokens, elastic_tokens, step_tokens=-(-elastic_tokens // steps))
    try:
        probe = [(i, t) for i in (0, len(rows) // 2, len(rows) - 1) for t in (1, a.base_tokens // 2, a.base_tokens - 1)]
        for i, t in probe:
            be.write(a.token_va(i, t), bytes([(i * 31 + t) & 0xFF]) * 64)
        lend_ms, reclaim_ms = [], []
        timer = CallTimer(be)
        for c in range(cycles):
            t0 = time.perf_counter()
            a.lend()
            t1 = time.perf_counter()
            lend_ms.append((t1 - t0) * 1e3)
            # lent memory is real: write the top token of every 8th buffer, read back
            top = a.base_tokens + a.lent_tokens - 1
            for i in range(0, len(rows), 8):
                be.write(a.token_va(i, top), bytes([c & 0xFF]) * 16)
                assert be.read(a.token_va(i, top), 16) == bytes([c & 0xFF]) * 16
            be.synchronize()
            t2 = time.perf_counter()
            a.reclaim()
            t3 = time.perf_counter()
            reclaim_ms.append((t3 - t2) * 1e3)
        timer.remove()
        breakdown = {k: v / cycles for k, v in timer.ms.items()}
        base_ok = all(be.read(a.token_va(i, t), 64) == bytes([(i * 31 + t) & 0xFF]) * 64 for i, t in probe)
        return {
            "elastic_bytes": a.max_elastic_tokens * per_token,
            "elastic_tokens": a.max_elastic_tokens,
            "steps": a.max_steps,
            "handles_per_step": 1 if be.supports_offset_mapping else len(rows),
            "cycles": cycles,
            "lend_ms": {"p50": statistics.median(lend_ms), "p99": pct(lend_ms, 99), "max": max(lend_ms)},
            "reclaim_ms": {"p50": statistics.median(reclaim_ms), "p99": pct(reclaim_ms, 99), "max": max(reclaim_ms)},
            "base_bytes_intact": base_ok,
            "per_cycle_call_ms": breakdown,  # create+map(+set access) in lend; unmap+release in reclaim
        }
    finally:
        a.close()
        be.supports_offset_mapping = saved


def release_order_case(be, rows, elastic_bytes, cycles):
    """Issue 22: may the handles of a reclaim be released before their unmap?

    ``cuMemRelease`` of a mapped handle only drops the handle; the memory is
    freed when its last mapping goes (CUDA driver API, "Virtual Memory
    Management"). If the release is cheap then and the unmap does not grow by
    the same amount, a reclaim can release while the last forward still runs
    and the forward after it waits only for the unmap. Times both orders on
    one handle per buffer (the H200's layout), alternating per cycle, and
    checks that the memory is back at the driver after each.

    Returns:
        ``{"unmap_then_release": {"unmap_ms", "release_ms", "total_ms"},
        "release_then_unmap": {...}, "memory_back": bool, ...}``, each a
        ``{p50, p99}`` over ``cycles`` per order (ms, wall time on the host).
    """
    g = be.granularity()
    size = max(-(-(elastic_bytes // len(rows)) // g) * g, g)
    va = be.reserve(size * len(rows))
    out = {"handles": len(rows), "bytes_per_handle": size, "cycles": cycles}
    times = {"unmap_then_release": {"unmap_ms": [], "release_ms": [], "total_ms": []},
             "release_then_unmap": {"unmap_ms": [], "release_ms": [], "total_ms": []}}
    back = True
    handles, mapped = [], []  # of the cycle in flight: what a failure leaves is undone in ``finally``
    try:
        for c in range(2 * cycles):
            order = "unmap_then_release" if c % 2 == 0 else "release_then_unmap"
            free0 = be.free_bytes()
            handles, mapped = [], []
            for _ in rows:
                handles.append(be.create(size))
            for i, h in enumerate(handles):
                be.map(va + i * size, size, h, 0)
                mapped.append(i)
            be.synchronize()
            steps = ("unmap", "release") if order == "unmap_then_release" else ("release", "unmap")
            t_all = time.perf_counter()
            for step in steps:
                t = time.perf_counter()
                if step == "unmap":
                    while mapped:
                        be.unmap(va + mapped[0] * size, size)
                        mapped.pop(0)
                else:
                    while handles:
                        be.release(handles[0])
                        handles.pop(0)
                times[order][f"{step}_ms"].append((time.perf_counter() - t) * 1e3)
            times[order]["total_ms"].append((time.perf_counter() - t_all) * 1e3)
            free1 = be.free_bytes()
            if free0 is not None and free1 is not None and free1 < free0 - size // 2:  # another process may move a little
                back = False
    finally:
        for i in mapped:
            be.unmap(va + i * size, size)
        for h in handles:
            be.release(h)
        be.free_va(va, size * len(rows))
    for order, parts in times.items():
        out[order] = {k: {"p50": statistics.median(v), "p99": pct(v, 99)} for k, v in parts.items()}
    out["memory_back"] = back
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--row-bytes", type=int, default=8 * 128 * 2, help="bytes per token per K or V buffer")
    ap.add_argument("--base-tokens", type=int, default=906_051)
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--release-order-only", action="store_true",
                    help="only the release-before-unmap timing (issue 22), 8 GiB over one handle per buffer, --cycles per order")
    a = ap.parse_args()
    be = CudaBackend(0)
    rows = [a.row_bytes] * (2 * a.layers)
    def release_order():
        try:
            order = release_order_case(be, rows, 8 * GiB, a.cycles)
        except Exception as e:  # e.g. 8 GiB not free: the other cases keep their results
            print(f"release order: {type(e).__name__}: {e}", flush=True)
            return {"error": f"{type(e).__name__}: {e}"}
        print(f"release order, 8 GiB in {order['handles']} handles: " + " | ".join(
            f"{k}: unmap {order[k]['unmap_ms']['p50']:.2f} release {order[k]['release_ms']['p50']:.2f} total p50 {order[k]['total_ms']['p50']:.2f} "
            f"p99 {order[k]['total_ms']['p99']:.2f} ms" for k in ("unmap_then_release", "release_then_unmap")), flush=True)
        return order

    if a.release_order_only:
        order = release_order()
        if "error" in order:
            raise SystemExit(f"release order: nothing measured ({order['error']}); no result written")
        results.write(a.out, {**results.header(), "granularity_bytes": be.granularity(), "buffers": len(rows), "row_bytes": a.row_bytes,
                              "release_order": order})
        return
    cases = []
    plan = [  # (GiB, steps, cycles, offset mapping if the driver allows it)
        (8, 1, a.cycles, True),
        (8, 8, 20, True),
        (1, 1, a.cycles, True),
        (8, 1, 10, False),
    ]
    seen = set()
    for gib, steps, cycles, offs in plan:
        handles = "1handle" if (offs and be.supports_offset_mapping) else "handle_per_buffer"
        name = f"{gib}GiB_{steps}step{'s' if steps > 1 else ''}_{handles}"
        if name in seen:  # offset mapping refused: the last case repeats the first
            continue
        seen.add(name)
        nbytes = gib * GiB
        t0 = time.perf_counter()
        r = run_case(be, rows, a.base_tokens, nbytes, steps, cycles, offs)
        r["name"] = name
        cases.append(r)
        print(f"{name:32s} lend p50 {r['lend_ms']['p50']:8.2f} ms p99 {r['lend_ms']['p99']:8.2f} | reclaim p50 {r['reclaim_ms']['p50']:8.2f} ms p99 {r['reclaim_ms']['p99']:8.2f} | base ok {r['base_bytes_intact']} ({time.perf_counter() - t0:.1f}s)", flush=True)
    result = {
        **results.header(),
        "granularity_bytes": be.granularity(),
        "supports_offset_mapping": be.supports_offset_mapping,
        "offset_mapping_error": be.offset_mapping_error,
        "buffers": len(rows),
        "row_bytes": a.row_bytes,
        "base_tokens": a.base_tokens,
        "cases": cases,
        "release_order": release_order(),  # after the cases: a failure here costs them nothing
    }
    results.write(a.out, result)


if __name__ == "__main__":
    main()
