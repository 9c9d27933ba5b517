"""Probe (issue 22, ``lend_ms`` p99): can an eager prefill's activations live in the lent step's own handles?

Today a reclaim unmaps the lent step's handles and releases them to the driver; the eager
prefill then ``cudaMalloc``s its activations into torch's cache; the next lend must empty
that cache (``torch.cuda.empty_cache()``, 8.5-9.4 ms after a 62K-token prompt on the H100)
and create the handles again (4-6 ms on the scheduler) - the 3 slow lends of 114 that put
``lend_ms`` p99 at 14-19 ms (docs/elastic.md). The alternative probed here never gives the
physical memory back: a reclaim remaps the step's handles from the KV range to a second
reserved range, the eager prefill allocates inside a ``torch.cuda.MemPool`` whose allocator
hands out that range (a pluggable allocator made of two ctypes callbacks, no compiled
library), and the lend remaps the handles back. Torch keeps the pool's segments cached
across cycles (their addresses stay valid while they are unmapped, as nothing allocates from
the pool outside an eager prefill), so no cycle after the first calls the allocator.

What it measures on one GPU, for a step of ``--gib`` GiB in ``--handles`` handles
(Llama-3.1-8B's 64 KV buffers):

- the present path's parts: ``empty_cache`` after freeing activations of that size,
  ``cuMemCreate`` / ``cuMemMap`` / ``cuMemUnmap`` / ``cuMemRelease`` of the step;
- the aliasing path: reclaim (unmap from the KV range, map into the activation range),
  lend (the reverse), the pool's snapshot that proves no activation is alive before a lend,
  over ``--cycles`` cycles of a synthetic eager forward (matmuls whose peak is ~80 % of
  the step) run in the pool;
- checks: every pool tensor lies in the activation range; the forward's output inside the
  pool equals the same forward outside it bit for bit; the allocator is called only in the
  first cycle; ``empty_cache`` with the pool alive frees none of its segments.

    python scripts/gpu/probe_activation_alias.py --out docs/results/activation_alias_probe_h200.json

Nothing here changes the server; it decides whether the elastic pool's reclaim and lend can
be built this way. A run that fails a step writes nothing and names the step.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time

import torch

from sglang_elastic import results
from sglang_elastic.vmm.cuda import CudaBackend

MiB, GiB = 1 << 20, 1 << 30
ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)


class RangeAllocator:
    """First-fit allocator over one mapped address range, for torch's pluggable allocator.

    ``alloc(size, device, stream) -> pointer`` (0: none fits), ``free(pointer, size, device, stream)``;
    sizes rounded up to 2 MiB; free ranges coalesced. ``calls`` / ``frees`` count the callbacks."""

    def __init__(self, base: int, size: int):
        self.base, self.size = base, size
        self.free_ranges = [(base, size)]
        self.live = {}
        self.calls = self.frees = self.refused = 0
        self._alloc = ALLOC_FN(self.alloc)
        self._free = FREE_FN(self.free)

    def alloc(self, size, device, stream):
        self.calls += 1
        n = -(-int(size) // (2 * MiB)) * 2 * MiB
        for i, (a, s) in enumerate(self.free_ranges):
            if s >= n:
                self.free_ranges[i] = (a + n, s - n)
                if s == n:
                    del self.free_ranges[i]
                self.live[a] = n
                return a
        self.refused += 1
        return 0

    def free(self, ptr, size, device, stream):
        self.frees += 1
        n = self.live.pop(int(ptr))
        rs = sorted(self.free_ranges + [(int(ptr), n)])
        merged = [rs[0]]
        for a, s in rs[1:]:
            if merged[-1][0] + merged[-1][1] == a:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((a, s))
        self.free_ranges = merged

    def torch_allocator(self):
        """torch's ``_cuda_CUDAAllocator`` over these callbacks (``torch.cuda.MemPool(allocator=...)``)."""
        alloc = ctypes.cast(self._alloc, ctypes.c_void_p).value
        free = ctypes.cast(self._free, ctypes.c_void_p).value
        return torch._C._cuda_customAllocator(alloc, free)


def forward(x: torch.Tensor, ws, keep: bool = False):
    """A synthetic eager forward: a chain of matmuls and activations over ``x`` (tokens x hidden) whose
    intermediates stay alive until the end when ``keep`` (the peak an eager prefill reaches)."""
    held, h = [], x
    for w in ws:
        a = h @ w
        b = torch.nn.functional.silu(a) * a
        h = b @ w.t()
        h = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)  # RMS-normed: no overflow over the layers
        if keep:
            held += [a, b, h]
    out = h.float().sum(dim=1)
    return out, held


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    r = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3, r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=8.0, help="the lent step, GiB (default 8: the H200's measured lend)")
    ap.add_argument("--handles", type=int, default=64, help="handles per step (one per KV buffer: 64 for Llama-3.1-8B)")
    ap.add_argument("--cycles", type=int, default=8, help="reclaim / prefill / lend cycles (at least 1)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.cycles < 1:
        print("probe_activation_alias: --cycles must be at least 1; nothing measured, nothing written", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("probe_activation_alias: no CUDA device; nothing measured, nothing written", file=sys.stderr)
        return 2
    torch.cuda.init()
    be = CudaBackend(torch.cuda.current_device())
    g = be.granularity()
    per = -(-int(a.gib * GiB / a.handles) // g) * g
    step = per * a.handles
    res = results.header(" ".join(["python", "scripts/gpu/probe_activation_alias.py", *(argv or sys.argv[1:])]))
    res.update(step_bytes=step, handles=a.handles, handle_bytes=per, cycles=a.cycles)

    # the synthetic forward: tokens x hidden bf16, peak of its kept intermediates ~80 % of the step
    hidden = 4096
    tokens = 8192
    per_layer = 3 * tokens * hidden * 2
    layers = max(1, int(0.8 * step // per_layer))
    ws = [torch.randn(hidden, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5 for _ in range(4)]
    ws = [ws[i % 4] for i in range(layers)]
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    ref, held = forward(x, ws, keep=True)
    del held
    res["forward"] = {"tokens": tokens, "hidden": hidden, "layers": layers, "peak_bytes": layers * per_layer}

    # -- the present path: activations in torch's cache, emptied before the lend; handles made and released
    timed(torch.cuda.empty_cache)  # whatever the warm-up left
    present = {"empty_cache_ms": [], "create_ms": [], "map_ms": [], "unmap_ms": [], "release_ms": []}
    kv_va = be.reserve(step)
    for _ in range(3):
        _, held = forward(x, ws, keep=True)
        del held
        torch.cuda.synchronize()
        ms, _ = timed(torch.cuda.empty_cache)
        present["empty_cache_ms"].append(ms)
        t = time.perf_counter()
        hs = [be.create(per) for _ in range(a.handles)]
        present["create_ms"].append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        for i, h in enumerate(hs):
            be.map(kv_va + i * per, per, h)
        present["map_ms"].append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        for i in range(a.handles):
            be.unmap(kv_va + i * per, per)
        present["unmap_ms"].append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        for h in hs:
            be.release(h)
        present["release_ms"].append((time.perf_counter() - t) * 1e3)
    res["present"] = present

    # -- the aliasing path
    act_va = be.reserve(step)
    hs = [be.create(per) for _ in range(a.handles)]
    for i, h in enumerate(hs):
        be.map(kv_va + i * per, per, h)  # lent: the step backs KV
    ra = RangeAllocator(act_va, step)
    pool = torch.cuda.MemPool(ra.torch_allocator())
    alias = {"reclaim_ms": [], "lend_ms": [], "snapshot_ms": [], "alloc_calls": [], "forward_ms": []}
    checks = {"pointers_in_range": True, "outputs_equal": True, "max_abs_diff": 0.0, "finite": True, "kv_readback_ok": True,
              "active_blocks_before_lend": [], "refused": 0, "forward_oom": None}

    mapped = {"at": kv_va}

    def remap(src: int, dst: int) -> float:
        """The step's handles unmapped from ``src`` and mapped at ``dst``, in milliseconds."""
        t = time.perf_counter()
        for i in range(a.handles):
            be.unmap(src + i * per, per)
        for i, h in enumerate(hs):
            be.map(dst + i * per, per, h)
        mapped["at"] = dst
        return (time.perf_counter() - t) * 1e3

    for c in range(a.cycles):
        alias["reclaim_ms"].append(remap(kv_va, act_va))
        calls = ra.calls
        t = time.perf_counter()
        try:
            with torch.cuda.use_mem_pool(pool):
                out, held = forward(x, ws, keep=True)
                ptrs = [int(h_.data_ptr()) for h_ in held] + [int(out.data_ptr())]
        except torch.OutOfMemoryError as e:  # the range allocator refused a segment (returned 0)
            checks["forward_oom"] = f"cycle {c}: {e}"[:300]
            break
        torch.cuda.synchronize()
        alias["forward_ms"].append((time.perf_counter() - t) * 1e3)  # the forward alone (the checks below wait on the GPU)
        alias["alloc_calls"].append(ra.calls - calls)
        checks["pointers_in_range"] &= all(act_va <= p < act_va + step for p in ptrs)
        checks["outputs_equal"] &= bool(torch.equal(out, ref))
        diff = torch.nan_to_num((out - ref).abs(), nan=float("inf"))  # (a NaN is no match: max() would skip it)
        checks["max_abs_diff"] = max(checks["max_abs_diff"], float(diff.max()))
        checks["finite"] &= bool(torch.isfinite(out).all())
        del held, out
        t = time.perf_counter()
        snap = pool.snapshot()
        active = sum(1 for s in snap for b in s.get("blocks", []) if b.get("state") == "active_allocated")
        alias["snapshot_ms"].append((time.perf_counter() - t) * 1e3)
        checks["active_blocks_before_lend"].append(active)
        if active:
            print(f"probe_activation_alias: cycle {c}: {active} pool blocks still alive before the lend; nothing written", file=sys.stderr)
            return 1
        alias["lend_ms"].append(remap(act_va, kv_va))
        be.memset(kv_va, 0x5A, step)  # the lent step backs KV again: every handle written and its last bytes read back
        checks["kv_readback_ok"] &= all(be.read(kv_va + (i + 1) * per - 16, 16) == b"\x5a" * 16 for i in range(a.handles))
    frees = ra.frees
    ms, _ = timed(torch.cuda.empty_cache)
    checks["frees_by_empty_cache_with_pool_alive"] = ra.frees - frees
    alias["empty_cache_pool_alive_ms"] = ms
    checks["refused"] = ra.refused
    res["alias"] = alias
    res["checks"] = checks
    summary = {k: {"median": statistics.median(v), "max": max(v)} for part in (present, alias) for k, v in part.items()
               if isinstance(v, list) and v and k != "alloc_calls"}
    res["summary_ms"] = summary
    ok = (checks["pointers_in_range"] and checks["outputs_equal"] and checks["finite"] and checks["kv_readback_ok"]
          and not checks["refused"] and checks["forward_oom"] is None and bool(alias["lend_ms"]))
    res["verdict"] = "aliasing works" if ok else "aliasing failed a check"
    frees = ra.frees
    del pool  # torch empties the pool's cache as it goes: its segments come back through the free callback (bookkeeping only)
    torch.cuda.empty_cache()
    checks["frees_after_pool_deleted"] = ra.frees - frees
    checks["range_free_after_pool_deleted"] = not ra.live
    for i in range(a.handles):
        be.unmap(mapped["at"] + i * per, per)  # (the activation range after a refused forward)
    for h in hs:
        be.release(h)
    results.write(a.out, res)
    print(results.dumps({"summary_ms": summary, "checks": checks, "alloc_calls": alias["alloc_calls"]}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
