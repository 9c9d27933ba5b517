"""Elastic KV pool on the GPU: one server per mode, the same workloads, one JSON.

    # one phase per server (each starts SGLang, runs the workloads, stops it)
    python scripts/gpu/bench_elastic.py phase --mode elastic --out $OUT/elastic.json
    python scripts/gpu/bench_elastic.py phase --mode stock --out $OUT/stock.json
    python scripts/gpu/bench_elastic.py phase --mode always-lent --out $OUT/always.json
    python scripts/gpu/bench_elastic.py phase --mode elastic --tp 2 --out $OUT/tp2.json
    # then
    python scripts/gpu/bench_elastic.py assemble $OUT/*.json --out docs/results/elastic_h200.json

``scripts/gpu/bench_elastic.sh`` runs them in order. Every server gets the same
SGLang flags (Llama-3.1-8B shape, dummy weights with a fixed seed, FlashInfer,
``--enable-deterministic-inference`` so greedy outputs do not depend on how
requests happened to be batched: the elastic run's reclaims shift batch
timing). Workloads (token ids; ``--skip-tokenizer-init``):

- ``cycles``: 40 long decodes run while short requests arrive one by one; each
  arrival makes the elastic server reclaim (migrating the decodes' lent pages),
  and ``--elastic-kv-lend-after-steps`` decode steps later it lends again. The
  first 64 short requests are the identity set: their greedy output ids are
  compared with the stock server's.
- ``burst``: 40 running decodes, then three ~62K-token prompts arrive while the
  reserve is lent: failed requests and the prompts' TTFT (ms).
- ``itl``: 40 requests decoding together after a lend (nothing toggling):
  median inter-token latency (ms).

Lend/reclaim latencies come from the server's own event log
(``SGLANG_ELASTIC_EVENTS``, one JSON line per operation, scheduler-thread ms).
Issue 22's keys: ``reclaim_needed_ms`` (p50/p99 over the reclaims that had to
unmap; from the eager-prefill elastic phase, whose every prefill needs the
reserve: it runs the cycles workload too), ``lend_ms_p99``, and
``reclaims_skipped`` (prefills that ran while lent with nothing reclaimed:
the CUDA graphs, or the free memory, held their activations), per phase.
Since build 2 ``reclaim_needed_ms`` adds ``release_wait_ms`` (the handles are
released on a helper thread; the scheduler waits for them before the
forward), and ``lends_prepared`` counts the lends whose handles were all made
ahead. Since ``--elastic-kv-reclaim-wait decode`` (the default) the scheduler
runs the decode batch while the reclaim's memory comes back: ``reclaim_needed_ms``
is what the scheduler itself waited, ``reclaim_delay_ms`` the reclaim's start to
the forward it was for (those decode passes included), ``prefills_deferred``
the passes that ran the decode batch instead; the cycles workload records the
running decodes' inter-token gaps (``long_itl_ms``) and the short prompts'
TTFT (``short_ttft_ms``). Build 3: ``--post-capture`` runs a phase with
``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1`` (``stock-pc``: SGLang's sizing
alone; ``elastic-pc``: the pool lending what it left free), summarised under
``post_capture``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import lzma
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "sglang_elastic" / "models" / "llama-3.1-8b"
VOCAB = 128256
SEED = 1234


#: The identity servers: batch-invariant kernels (SGLang's deterministic
#: inference; Triton attention keeps the radix cache there), a small base so
#: the decodes spill into lent pages and reclaims must migrate or retract.
ID_FLAGS = ["--attention-backend", "triton", "--enable-deterministic-inference", "--cuda-graph-backend-prefill", "disabled", "--max-total-tokens", "65536"]
#: The dynamic identity server lends what is measured free (the pool's default, one step): each short arrival's eager
#: prefill then needs more than the margin left free, so its reclaim takes the whole step back, the decodes' lent pages
#: with it. A fixed 4 GiB lend (the runs up to 2026-12-07 #27) left tens of GiB free beside it, and since issue 22's
#: "reclaim only what the forward needs" no arrival reclaimed: those identities compared servers that never moved KV.
ID_ELASTIC = ["--elastic-kv-lend-after-steps", "4"]
#: always-lent lends once at start-up, a size it must be given.
ID_ALWAYS_LENT = ["--elastic-kv-lend-bytes", "4GiB"]


#: A reclaim event's time split, as the controller logs it (keys an older event lacks are left out of a breakdown).
RECLAIM_PARTS = ("wait_ms", "vacate_ms", "withdraw_ms", "make_room_ms", "unmap_ms", "release_wait_ms", "release_overlap_ms")


#: Prefill without CUDA graphs: its activations come from torch's allocator
#: at run time (with SGLang's default breakable prefill graphs they sit in the
#: graph pool captured at start-up, and lending the free memory cannot starve them).
EAGER = ["--cuda-graph-backend-prefill", "disabled"]


def server_cmd(mode: str, tp: int, port: int, identity: bool, eager: bool = False, extra: List[str] = ()) -> List[str]:
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(MODEL), "--load-format", "dummy",
        "--skip-tokenizer-init", "--sampling-backend", "pytorch", "--grammar-backend", "none", "--random-seed", "0",
        "--host", "127.0.0.1", "--port", str(port), "--tp", str(tp), "--enable-metrics",
    ]
    cmd += ID_FLAGS if identity else ["--attention-backend", "flashinfer"] + (EAGER if eager else [])
    if mode != "stock":
        cmd += ["--enable-elastic-kv", "--elastic-kv-mode", "dynamic" if mode == "elastic" else "always-lent"]
        if mode == "elastic":  # always-lent lends once at start-up: the plugin refuses the flags it never reads
            cmd += ID_ELASTIC if identity else ["--elastic-kv-lend-after-steps", "8"]
            cmd += list(extra)  # e.g. --elastic-kv-activation-rule measured (the dynamic servers only)
        elif identity:
            cmd += ID_ALWAYS_LENT
    return cmd


def server_env(events: Path, identity: bool, post_capture: bool) -> Dict[str, str]:
    """A server's environment: its event log, NVLink multicast off, SGLang's post-capture KV sizing where asked (issue 22,
    build 3: the pool lends on top of it), and the dummy weights: unit scale for the identity servers
    (``sglang_elastic/dummy_init.py``: under them a reclaim that moved KV wrong changes the outputs; under SGLang's own
    dummy weights, every run before 2026-12-07, it does not), SGLang's for the timed ones (comparable with earlier runs)."""
    env = dict(os.environ, SGLANG_ELASTIC_EVENTS=str(events), NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    if post_capture:
        env["SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"] = "1"
    env["SGLANG_ELASTIC_DUMMY_INIT"] = "unit" if identity else ""
    return env


class Server:
    def __init__(self, mode: str, tp: int, port: int, workdir: Path, identity: bool = False, eager: bool = False, post_capture: bool = False,
                 extra: List[str] = ()):
        self.mode, self.tp, self.port, self.workdir, self.identity, self.eager = mode, tp, port, workdir, identity, eager
        self.extra = list(extra)
        self.post_capture = post_capture
        self.log = workdir / f"server_{mode}_tp{tp}.log"
        self.events = workdir / f"events_{mode}_tp{tp}.jsonl"
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self):
        env = server_env(self.events, self.identity, self.post_capture)
        self.events.unlink(missing_ok=True)
        self.cmd = server_cmd(self.mode, self.tp, self.port, self.identity, self.eager, self.extra)
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        t0 = time.time()
        import urllib.request

        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server ({self.mode}) exited during start-up; tail:\n" + self.tail())
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        self.start_s = time.time() - t0
        print(f"[{self.mode}] up in {self.start_s:.0f}s", flush=True)
        return self

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 40) -> str:
        return "".join(open(self.log, errors="replace").readlines()[-n:])

    def __exit__(self, *exc):
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except Exception:
            os.killpg(self.proc.pid, signal.SIGKILL)

    def log_int(self, pattern: str) -> Optional[int]:
        m = re.findall(pattern, open(self.log, errors="replace").read())
        return int(m[-1]) if m else None

    def event_list(self) -> List[Dict[str, Any]]:
        if not self.events.exists():
            return []
        return [json.loads(line) for line in open(self.events) if line.strip()]


#: Seen on an H100 (2026-12-06): 1 and 3 of 110 short prompts of the cycles workload failed with
#: ServerDisconnectedError, the likely cause a connection the server was closing after 5 s idle (they most likely never
#: reached the scheduler: those runs made about one reclaim fewer per lost prompt): the eval client's session, which
#: drops idle connections first (sglang_elastic.eval.client.KEEPALIVE_S).
def client_session() -> "aiohttp.ClientSession":
    from sglang_elastic.eval.client import client_session as session

    return session()


async def generate_whole(session, url: str, ids: List[int], max_new: int) -> Dict[str, Any]:
    """One greedy request, not streamed, with each output token's logprob (``logprobs``): the identity runs' comparison.
    Not streamed because SGLang 0.5.17 (``incremental_streaming_output`` off, its default) sends the whole cumulative
    ``output_token_logprobs`` in every chunk: ~22 MB of JSON for a 1,024-token request, on the client's one event loop."""
    body = {"input_ids": ids, "return_logprob": True, "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}}
    try:
        async with session.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=1800)) as r:
            if r.status != 200:
                return {"ok": False, "error": f"HTTP {r.status}: {(await r.text())[:200]}"}
            res = await r.json()
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return {"ok": False, "error": repr(e)[:200]}
    out = res.get("output_ids") or []
    meta = res.get("meta_info") or {}
    fin = meta.get("finish_reason") or {}
    if fin.get("type") == "abort" or len(out) != max_new:
        return {"ok": False, "error": f"aborted: {fin}" if fin.get("type") == "abort" else f"{len(out)} of {max_new} tokens", "output_ids": out}
    return {"ok": True, "output_ids": out, "logprobs": [x[0] for x in meta.get("output_token_logprobs") or []]}


async def generate(session, url: str, ids: List[int], max_new: int, t_sent: Optional[list] = None) -> Dict[str, Any]:
    """Stream one greedy request; returns output ids, TTFT and inter-token gaps (ms), and each gap's end (``gap_ends``,
    ``time.time()``, the clock of the server's events)."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}}
    t0 = time.perf_counter()
    wall = time.time() - t0  # perf_counter -> time.time(), the clock of the server's events
    stamps, out, err = [], [], None
    try:
        async with session.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=1800)) as r:
            if r.status != 200:
                return {"ok": False, "error": f"HTTP {r.status}: {(await r.text())[:200]}"}
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    err = str(chunk["error"])[:200]
                    continue
                stamps.append(time.perf_counter())
                out = chunk.get("output_ids", out)
                fin = chunk.get("meta_info", {}).get("finish_reason")
                if fin and fin.get("type") == "abort":
                    err = f"aborted: {fin}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return {"ok": False, "error": repr(e)[:200]}
    if err or len(out) != max_new:
        return {"ok": False, "error": err or f"{len(out)} of {max_new} tokens", "output_ids": out}
    gaps = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    return {"ok": True, "output_ids": out, "ttft_ms": (stamps[0] - t0) * 1e3, "gaps_ms": gaps, "gap_ends": [wall + b for b in stamps[1:]]}


def slow_steps(results: List[Dict[str, Any]], factor: float = 4.0, merge_ms: float = 5.0, keep: int = 64) -> List[Dict[str, Any]]:
    """The decode steps whose token gaps exceed ``factor`` times the median gap, over ``results`` (:func:`generate`'s,
    streamed together): gaps ending within ``merge_ms`` of each other are one step (every running request waits for
    it). Each: ``t`` (the first gap's end, ``time.time()``), ``gap_ms`` (the longest), ``requests`` (gaps in it); the
    ``keep`` longest, in time order. Why: a p999 of the gaps says how long, not when; beside the server's lend and
    reclaim events (:func:`beside_events`) it says what the scheduler was doing."""
    pts = sorted((t, g) for r in results if r.get("ok") for t, g in zip(r.get("gap_ends", []), r["gaps_ms"]))
    if not pts:
        return []
    gaps = sorted(g for _, g in pts)
    bar = factor * gaps[len(gaps) // 2]
    steps: List[Dict[str, Any]] = []
    for t, g in pts:
        if g <= bar:
            continue
        if steps and (t - steps[-1]["last"]) * 1e3 <= merge_ms:
            st = steps[-1]
            st["gap_ms"], st["requests"], st["last"] = max(st["gap_ms"], g), st["requests"] + 1, t
        else:
            steps.append({"t": t, "gap_ms": g, "requests": 1, "last": t})
    steps = sorted(sorted(steps, key=lambda x: -x["gap_ms"])[:keep], key=lambda x: x["t"])
    return [{"t": round(x["t"], 4), "gap_ms": round(x["gap_ms"], 2), "requests": x["requests"]} for x in steps]


def beside_events(steps: List[Dict[str, Any]], events: List[Dict[str, Any]], slack_ms: float = 50.0) -> List[Dict[str, Any]]:
    """Each slow step with the lend and reclaim events (``op``, ``ms``, ``ahead_empty_cache_ms`` where set) that ended
    while its gap ran (from ``slack_ms`` before the gap began to its end): what held the scheduler then, if anything."""
    out = []
    for st in steps:
        lo, hi = st["t"] - (st["gap_ms"] + slack_ms) / 1e3, st["t"]
        near = [{k: (round(e[k], 3) if isinstance(e[k], float) else e[k]) for k in ("op", "ms", "ahead_empty_cache_ms", "t") if k in e}
                for e in events if lo <= e.get("t", 0) <= hi]
        out.append({**st, "events": near})
    return out


def prompts(n: int, lo: int, hi: int, seed: int) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


#: The identity's fill: prompts answered with one token each, so that SGLang's radix cache holds about the whole
#: 65,536-token base before the background decodes start (:func:`workload_identity`).
ID_FILL = (96, 700)
#: Seconds from the background prompts to the first short arrival: their prefill, the lend after 4 decode-only
#: steps, then decode tokens written into lent ids.
ID_LEAD_S = 4.0


async def workload_identity(url: str, lead_s: float = ID_LEAD_S) -> Dict[str, Any]:
    """The fill (``ID_FILL``: the radix cache then holds about the base), 32 background decodes of 1,024 + 1,024
    tokens, and ``lead_s`` later 64 short requests arriving two at a time, 0.3 s apart.

    On the elastic server (a small base, all free memory lent in one step) each arrival's eager prefill reclaims the
    step, and every id it holds must move into the base or its request be retracted. Without the fill the base keeps
    free ids until the cached short prompts reach it (about the 48th arrival), so the decodes wrote into lent ids
    only near the end: 3 of 33 reclaims moved KV on an H200 (d44b45f), 0 of 0 on an H100 (4bfd5a6). With it the
    base has at most one evicted leaf free when the pool lends, the decodes write into lent ids from then on, and the
    first arrival's reclaim moves them (SGLang evicts cached leaves to make room); later ones move what was written
    since the previous lend, when a leaf's leftover does not take it. ``fill_failed``: fill requests that failed."""
    async with client_session() as s:
        n_fill, fill_len = ID_FILL
        fill = await asyncio.gather(*[generate_whole(s, url, p, 1) for p in prompts(n_fill, fill_len, fill_len, SEED + 7)])
        longs = [asyncio.create_task(generate_whole(s, url, p, 1024)) for p in prompts(32, 1024, 1024, SEED + 5)]
        await asyncio.sleep(lead_s)
        shorts = []
        for i, p in enumerate(prompts(64, 256, 768, SEED + 6)):
            shorts.append(asyncio.create_task(generate_whole(s, url, p, 48)))
            if i % 2:
                await asyncio.sleep(0.3)
        short_res = await asyncio.gather(*shorts)
        long_res = await asyncio.gather(*longs)
    return {"identity_outputs": [r.get("output_ids") for r in short_res], "background_outputs": [r.get("output_ids") for r in long_res],
            # the greedy tokens can survive a few wrong KV rows; their logprobs (batch-invariant kernels: bit-equal) cannot
            "identity_logprobs": [r.get("logprobs") for r in short_res], "background_logprobs": [r.get("logprobs") for r in long_res],
            "fill": {"requests": n_fill, "tokens": fill_len}, "fill_failed": sum(not r["ok"] for r in fill), "lead_s": lead_s,
            "failed": sum(not r["ok"] for r in short_res + long_res), "errors": [r["error"] for r in fill + short_res + long_res if not r["ok"]][:5]}


async def workload_cycles(url: str, n_short: int, gap_s: float) -> Dict[str, Any]:
    async with client_session() as s:
        longs = [asyncio.create_task(generate(s, url, p, 1536)) for p in prompts(40, 1024, 1024, SEED)]
        await asyncio.sleep(3.0)
        shorts = []
        for p in prompts(n_short, 64, 512, SEED + 1):
            shorts.append(asyncio.create_task(generate(s, url, p, 32)))
            await asyncio.sleep(gap_s)
        short_res = await asyncio.gather(*shorts)
        long_res = await asyncio.gather(*longs)
    # what the reclaims cost the requests: the running decodes' inter-token gaps (a short prompt's prefill and
    # any wait for its reclaim land in them) and the short prompts' TTFT
    gaps = [g for r in long_res if r["ok"] for g in r["gaps_ms"]]
    ttft = [r["ttft_ms"] for r in short_res if r["ok"]]
    return {"identity_outputs": [r.get("output_ids") for r in short_res[:64]], "failed": sum(not r["ok"] for r in short_res + long_res),
            "errors": [r["error"] for r in short_res + long_res if not r["ok"]][:5],
            "long_itl_ms": {**stats(gaps), "p90": pct(gaps, 90), "p999": pct(gaps, 99.9)}, "short_ttft_ms": {**stats(ttft), "p90": pct(ttft, 90)},
            "long_slow_steps": slow_steps(long_res)}


async def workload_burst(url: str) -> Dict[str, Any]:
    async with client_session() as s:
        longs = [asyncio.create_task(generate(s, url, p, 1024)) for p in prompts(40, 512, 2048, SEED + 2)]
        await asyncio.sleep(4.0)  # decode-only long enough to lend
        bursts = [asyncio.create_task(generate(s, url, p, 16)) for p in prompts(3, 62000, 62000, SEED + 3)]
        b = await asyncio.gather(*bursts)
        l = await asyncio.gather(*longs)
    ok_ttft = [r["ttft_ms"] for r in b if r["ok"]]
    return {"failed_requests": sum(not r["ok"] for r in b + l), "errors": [r["error"] for r in b + l if not r["ok"]][:5],
            "ttft_ms": ok_ttft, "ttft_ms_median": statistics.median(ok_ttft) if ok_ttft else None}


async def workload_itl(url: str) -> Dict[str, Any]:
    async with client_session() as s:
        res = await asyncio.gather(*[generate(s, url, p, 512) for p in prompts(40, 512, 512, SEED + 4)])
    # skip the first 64 tokens: prefill, and the lend after the first decode steps
    gaps = [g for r in res if r["ok"] for g in r["gaps_ms"][64:]]
    return {"failed": sum(not r["ok"] for r in res), "itl_ms_median": statistics.median(gaps) if gaps else None,
            "itl_ms_mean": statistics.fmean(gaps) if gaps else None, "samples": len(gaps)}


def stats(xs: List[float]) -> Dict[str, Optional[float]]:
    return {"p50": pct(xs, 50), "p99": pct(xs, 99), "max": max(xs) if xs else None, "n": len(xs)}


def pct(xs: List[float], q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def phase(args) -> None:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from sglang_elastic import results

    res: Dict[str, Any] = {**results.header(), "mode": args.mode, "tp": args.tp, "identity": args.identity, "eager": args.eager,
                           "post_capture": args.post_capture}
    with Server(args.mode, args.tp, args.port, work, args.identity, args.eager, args.post_capture, shlex.split(args.elastic_extra)) as srv:
        res["server_command"] = ("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1 " if args.post_capture else "") + " ".join(srv.cmd)
        res["start_s"] = srv.start_s
        res["kv_tokens_base"] = srv.log_int(r"max_total_num_tokens=(\d+)")
        if args.post_capture:  # the pool after SGLang's post-capture sizing (its own log line)
            res["kv_tokens_base"] = srv.log_int(r"Post-capture KV sizing: KV cache allocated\. dtype: \S+, #tokens: (\d+)") or res["kv_tokens_base"]
        if args.identity:
            res["identity_run"] = {**asyncio.run(workload_identity(srv.url)), "dummy_init": "unit"}
            print(f"[{args.mode}-id] failed={res['identity_run']['failed']}", flush=True)
        if "burst" in args.workloads:
            res["burst"] = asyncio.run(workload_burst(srv.url))
            print(f"[{args.mode}] burst {res['burst']}", flush=True)
        res["alive_after_burst"] = srv.alive()
        if srv.alive() and "cycles" in args.workloads:
            res["cycles_run"] = asyncio.run(workload_cycles(srv.url, args.short_requests, args.gap_s))
            print(f"[{args.mode}] cycles failed={res['cycles_run']['failed']}", flush=True)
        if srv.alive() and "itl" in args.workloads:
            res["itl"] = asyncio.run(workload_itl(srv.url))
            print(f"[{args.mode}] itl {res['itl']}", flush=True)
        res["alive"] = srv.alive()
        # torch's "CUDA out of memory", FlashInfer/driver OOM; not our own start-up warning
        res["oom_in_log"] = bool(re.search(r"CUDA out of memory|OutOfMemoryError|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation", open(srv.log, errors="replace").read()))
        ev = srv.event_list()
        res["lends"] = [e for e in ev if e["op"] == "lend"]
        res["reclaims"] = [e for e in ev if e["op"] == "reclaim"]
        res["reclaims_skipped"] = sum(e["op"] == "reclaim_skipped" for e in ev)
        res["reclaim_stops"] = sum(e["op"] == "reclaim_stopped" for e in ev)
        # issue 22: what each eager prefill allocated against SGLang's estimate (--elastic-kv-activation-rule measured)
        res["eager_prefills"] = [{k: e.get(k) for k in ("tokens", "requests", "peak_bytes", "estimate_bytes", "need_bytes", "plain")}
                                 for e in ev if e["op"] == "eager_prefill"]
        res["lent_tokens_max"] = max((e["tokens"] for e in res["lends"]), default=0)
        res["lent_bytes_max"] = max((e["bytes"] for e in res["lends"]), default=0)
        res["log_tail"] = srv.tail(25)
    Path(args.out).write_text(json.dumps(res, separators=(",", ":")) + "\n")
    print(f"[{args.mode}] wrote {args.out}", flush=True)


def _read_part(path: str) -> Dict[str, Any]:
    """A phase's part as a run writes it (.json) or kept compressed in the repo (.json.gz: the identity runs' outputs; .json.xz)."""
    sys.path.insert(0, str(ROOT))
    from sglang_elastic import results

    return results.read_json(path)


#: An identity run's per-request lists: the comparison needs their equality only (``assemble``).
IDENTITY_LISTS = ("identity_outputs", "background_outputs", "identity_logprobs", "background_logprobs")


def digest_identity(part: Dict[str, Any]) -> Dict[str, Any]:
    """``part`` with each request's output ids and logprobs in its identity run replaced by the sha256 of their JSON
    (``None`` kept): ``assemble`` compares them for equality only, and on unit-scale weights the raw logprobs of one
    identity pair are ~1 MB compressed (the tracked tree stays under 5.5 MiB: ``tests/test_packaging.py``). The part
    records ``identity_run.digested``."""
    import hashlib

    run = dict(part["identity_run"])
    for key in IDENTITY_LISTS:
        if run.get(key) is not None:
            run[key] = [None if x is None else "sha256:" + hashlib.sha256(json.dumps(x, separators=(",", ":")).encode()).hexdigest()
                        for x in run[key]]
    run["digested"] = True
    return {**part, "identity_run": run}


def digest(args) -> None:
    for src in args.parts:
        d = digest_identity(_read_part(src))
        out = Path(args.out_dir) / (Path(src).name.split(".json")[0] + ".json.xz")
        out.write_bytes(lzma.compress(json.dumps(d, separators=(",", ":")).encode(), preset=9 | lzma.PRESET_EXTREME))
        print(f"wrote {out}")


def eager_summary(evs: List[dict]) -> Dict[str, object]:
    """What the eager prefill passes of a phase allocated (plain ones: those the measured rule bounds), against
    SGLang's estimate and the need the pass was given (``peak_over_need`` above 1: the rule under-reserved)."""
    plain = [e for e in evs if e.get("plain")]
    with_need = [e for e in plain if e.get("need_bytes")]
    return {"eager_prefill_peak_gib": stats([e["peak_bytes"] / 2**30 for e in plain]),
            "eager_prefill_estimate_gib": stats([e["estimate_bytes"] / 2**30 for e in plain]),
            "eager_prefill_tokens": stats([e["tokens"] for e in plain]),
            "eager_prefill_peak_over_need": stats([e["peak_bytes"] / e["need_bytes"] for e in with_need]),
            "eager_prefill_need_gib": stats([e["need_bytes"] / 2**30 for e in with_need]),
            "eager_prefills_not_plain": len(evs) - len(plain)}


def assemble(args) -> None:
    sys.path.insert(0, str(ROOT))
    from sglang_elastic import results

    parts = {}
    for p in args.parts:
        d = _read_part(p)
        parts[(d["mode"] + ("-id" if d.get("identity") else "") + ("-eager" if d.get("eager") else "") + ("-pc" if d.get("post_capture") else ""), d["tp"])] = d
    st, el, al = parts.get(("stock", 1)), parts.get(("elastic", 1)), parts.get(("always-lent", 1))
    sid, eid = parts.get(("stock-id", 1)), parts.get(("elastic-id", 1))
    ale, ele, ste = parts.get(("always-lent-eager", 1)), parts.get(("elastic-eager", 1)), parts.get(("stock-eager", 1))
    epc, spc = parts.get(("elastic-pc", 1)), parts.get(("stock-pc", 1))

    def burst_of(d):
        if not d or "burst" not in d:
            return None
        return {"oom": bool(d["oom_in_log"] or not d["alive"]), "failed_requests": d["burst"]["failed_requests"], "ttft_ms_median": d["burst"]["ttft_ms_median"],
                "alive_after_burst": d["alive_after_burst"], "lent_tokens": d["lent_tokens_max"], "errors": d["burst"]["errors"]}

    def needed(d, decoding=None):  # reclaims that unmapped (events written before issue 22 have no "steps": each unmapped all)
        # since build 2 the handles are released on a helper thread; the scheduler waits for them before the
        # forward (release_wait_ms): counted, so the time is what the prompt waited; an idle reclaim's own time
        # (on_idle) kept nobody waiting. decoding: only the reclaims whose prefill formed with decodes running
        # (the event's "decodes" at that pass: a wait then stalled them, or they ran meanwhile), or only those
        # that found none (the GPU idle: nothing to run instead; a deferral whose decodes all finished too)
        return [e.get("release_wait_ms", 0.0) + (0.0 if str(e.get("why", "")).startswith("idle") else e["ms"]) for e in d["reclaims"]
                if e.get("steps", 1) > 0 and (decoding is None or ("decodes" in e and (e["decodes"] > 0) == decoding))] if d else []

    def reclaim_wait(d):  # what the server did while a reclaim's memory came back (--elastic-kv-reclaim-wait, since 346ad55)
        m = re.search(r"--elastic-kv-reclaim-wait[= ](decode|block)\b", d.get("server_command", ""))
        if m:
            return m.group(1)
        if any("deferred" in e or "defer_end" in e for e in d["reclaims"]):
            return "decode"  # the default, and the events say the server had the flag
        return None  # a part from before the flag (the scheduler waited), or no reclaim to tell

    def delays(d):  # from a reclaim's start to the forward it was for, decode passes run meanwhile included (--elastic-kv-reclaim-wait)
        return [e["delay_ms"] for e in d["reclaims"] if "delay_ms" in e] if d else []

    def lends_prepared(d):  # lends whose every step's handles were made ahead on the helper thread (build 2)
        return sum(1 for e in d["lends"] if e.get("steps") and e.get("prepared_steps") == e["steps"]) if d else None

    def lend_p99(d):
        return pct([e["ms"] for e in d["lends"]], 99) if d else None

    def breakdown(evs, keys):
        # keys no event has (written before they existed: issue 22's release_*) are left out
        return {k: {"p50": pct([e[k] for e in evs if k in e], 50), "p99": pct([e[k] for e in evs if k in e], 99)} for k in keys
                if any(k in e for e in evs) or k in ("wait_ms", "vacate_ms", "unmap_ms", "empty_cache_ms", "map_ms")}

    def tp_summary(d):  # one elastic phase at TP > 1: None when not run
        if not d:
            return None
        ls, rs = [e["ms"] for e in d["lends"]], [e["ms"] for e in d["reclaims"]]
        fails = (d.get("burst", {}).get("failed_requests") or 0) + (d.get("cycles_run", {}).get("failed") or 0)
        return {"ok": bool(d["alive"] and fails == 0 and len(rs) > 0), "lend_ms_p99": pct(ls, 99), "reclaim_ms_p99": pct(rs, 99),
                "lend_ms": stats(ls), "reclaim_ms": stats(rs), "reclaim_breakdown_ms": breakdown(d["reclaims"], RECLAIM_PARTS),
                "cycles": len(rs), "failed_requests": fails, "lent_tokens": d["lent_tokens_max"], "kv_tokens_base": d["kv_tokens_base"],
                "reclaim_needed_ms": stats(needed(d)), "reclaims_skipped": d.get("reclaims_skipped", 0), "reclaim_stops": d.get("reclaim_stops", 0)}
    lend = [e["ms"] for e in el["lends"]] if el else []
    rec = [e["ms"] for e in el["reclaims"]] if el else []
    ident, identity = None, None
    if sid and eid and "identity_run" in sid and "identity_run" in eid:
        a, b = sid["identity_run"], eid["identity_run"]
        # per request: stock's answer, and the elastic server's equal to it (raw lists, or their digests)
        same, same_bg, same_lp, same_lp_bg = ([x is not None and x == y for x, y in zip(a.get(k) or [], b.get(k) or [])] for k in IDENTITY_LISTS)
        ident = len(same) == 64 and all(same)
        identity = {"requests": len(same), "identical": sum(same), "background_requests": len(same_bg), "background_identical": sum(same_bg),
                    # runs before 2026-12-07 #26 compared ids only (None here)
                    "logprobs_identical": sum(same_lp) if same_lp else None, "background_logprobs_identical": sum(same_lp_bg) if same_lp_bg else None,
                    "reclaims": len(eid["reclaims"]), "lends": len(eid["lends"]),
                    "migrated_units": sum(e.get("moved_units", 0) for e in eid["reclaims"]), "retracted": sum(e.get("retracted", 0) for e in eid["reclaims"]),
                    # what the identity can vouch for: 0 means no reclaim moved KV, and the comparison says nothing about
                    # migration; an idle reclaim (no decode batch: after the last output, or between loads) does not count
                    "reclaims_moving_kv": sum(bool(e.get("moved_units") or e.get("retracted")) and not str(e.get("why", "")).startswith("idle")
                                              for e in eid["reclaims"]),
                    "fill": a.get("fill"), "fill_failed": a.get("fill_failed", 0) + b.get("fill_failed", 0),
                    "failed_requests": a["failed"] + b["failed"], "dummy_init": a.get("dummy_init", "sglang"), "server_stock": sid.get("server_command", sid["command"]), "server_elastic": eid.get("server_command", eid["command"])}
    itl_overhead = None
    if st and el and st.get("itl", {}).get("itl_ms_median") and el.get("itl", {}).get("itl_ms_median"):
        itl_overhead = (el["itl"]["itl_ms_median"] / st["itl"]["itl_ms_median"] - 1) * 100
    out = results.header(args.command)
    if args.keep_header:  # the parts' own run (its date, GPU, commit, command); this summary's code beside it
        kept = json.loads(Path(args.keep_header).read_text())
        out = {**{k: kept[k] for k in ("date", "gpu", "commit", "command")}, "summarised": {"commit": out["commit"], "date": out["date"]}}
    gpus = sorted({d.get("gpu") for d in parts.values() if d.get("gpu") not in (None, "unknown")})
    if gpus:  # what the parts ran on (the assembly may run on a machine without a GPU)
        out["gpu"] = "; ".join(gpus)
    out.update({
        "lent_bytes": el["lent_bytes_max"] if el else None,
        "kv_tokens_stock": st["kv_tokens_base"] if st else None,
        "kv_tokens_lent": (el["kv_tokens_base"] + el["lent_tokens_max"]) if el and el["kv_tokens_base"] else None,
        "lend_ms": stats(lend),
        "reclaim_ms": stats(rec),
        # issue 22: the reclaims that had to unmap, from the eager-prefill phase (the acceptance's 8 GiB eager reclaim),
        # the lend p99, and the reclaims the CUDA graphs made unnecessary; per phase beside
        "reclaim_needed_ms": stats(needed(ele)),
        "reclaim_delay_ms": stats(delays(ele)),
        "lend_ms_p99": lend_p99(el),
        "reclaims_skipped": el.get("reclaims_skipped", 0) if el else None,
        "per_phase": {name: {"reclaim_needed_ms": stats(needed(d)), "lend_ms_p99": lend_p99(d), "reclaims_skipped": d.get("reclaims_skipped", 0),
                             "reclaim_stops": d.get("reclaim_stops", 0), "reclaims": len(d["reclaims"]),
                             "lends": len(d["lends"]), "lends_prepared": lends_prepared(d),
                             "lend_breakdown_ms": breakdown(d["lends"], ["empty_cache_ms", "ahead_empty_cache_ms", "map_ms"]),
                             "reclaim_ms": stats([e["ms"] for e in d["reclaims"]]),
                             "reclaim_breakdown_ms": breakdown(d["reclaims"], RECLAIM_PARTS),
                             "reclaim_delay_ms": stats(delays(d)), "prefills_deferred": sum(e.get("deferred", 0) for e in d["reclaims"]),
                             "reclaim_needed_ms_decoding": stats(needed(d, True)), "reclaim_needed_ms_gpu_idle": stats(needed(d, False)),
                             "reclaims_idle": sum(str(e.get("why", "")).startswith("idle") for e in d["reclaims"]),
                             "reclaim_wait": reclaim_wait(d),
                             **({k: d["cycles_run"][k] for k in ("long_itl_ms", "short_ttft_ms") if k in d["cycles_run"]} if d.get("cycles_run") else {}),
                             # the slowest decode steps of the long requests, each beside the lends and reclaims that ended in it
                             **({"long_slow_steps": beside_events(d["cycles_run"]["long_slow_steps"], d["lends"] + d["reclaims"])}
                                if (d.get("cycles_run") or {}).get("long_slow_steps") else {}),
                             **(eager_summary(d["eager_prefills"]) if d.get("eager_prefills") else {})}
                      for name, d in (("elastic", el), ("elastic_eager", ele), ("elastic_id", eid), ("elastic_post_capture", epc)) if d},
        # issue 22, build 3: SGLang's post-capture sizing alone (stock-pc) and with the pool lending what it left free (elastic-pc)
        "post_capture": None if not (epc or spc) else {
            "kv_tokens_post_capture": spc.get("kv_tokens_base") if spc else None,
            "kv_tokens_base_elastic": epc.get("kv_tokens_base") if epc else None,
            "lent_tokens": epc.get("lent_tokens_max") if epc else None,
            "kv_tokens_while_lent": (epc["kv_tokens_base"] or 0) + epc["lent_tokens_max"] if epc and epc.get("kv_tokens_base") is not None else None,
            "lend_ms_p99": lend_p99(epc), "reclaim_needed_ms": stats(needed(epc)), "reclaims_skipped": epc.get("reclaims_skipped", 0) if epc else None,
            "burst": burst_of(epc), "burst_post_capture_alone": burst_of(spc)},
        "cycles": len(rec),
        "outputs_identical": ident,
        "identity": identity,
        "burst": {
            "oom": bool(el and (el["oom_in_log"] or not el["alive"])),
            "failed_requests": el["burst"]["failed_requests"] if el and "burst" in el else None,
            "ttft_ms_stock": st["burst"]["ttft_ms_median"] if st and "burst" in st else None,
            "ttft_ms_elastic": el["burst"]["ttft_ms_median"] if el and "burst" in el else None,
        },
        "always_lent": {
            # true when the permanently lent reserve ran out of memory in any prefill configuration
            "oom": any(b["oom"] for b in (burst_of(al), burst_of(ale)) if b),
            "prefill_graphs": burst_of(al),  # SGLang's default: prefill activations pre-captured in the graph pool
            "eager_prefill": burst_of(ale),  # --cuda-graph-backend-prefill disabled
        },
        "burst_eager_prefill": {"stock": burst_of(ste), "elastic": burst_of(ele), "always_lent": burst_of(ale)},
        "lend_breakdown_ms": breakdown(el["lends"], ["empty_cache_ms", "ahead_empty_cache_ms", "map_ms"]) if el else None,
        "lends_prepared": lends_prepared(el),
        "reclaim_breakdown_ms": breakdown(el["reclaims"], RECLAIM_PARTS) if el else None,
        "itl_overhead_pct": itl_overhead,
        "itl_ms_median": {"stock": st["itl"]["itl_ms_median"] if st and "itl" in st else None, "elastic": el["itl"]["itl_ms_median"] if el and "itl" in el else None},
        # the TP1 cycles server (little memory pressure); the identity run's are under "identity"
        "cycles_server_migrated_units": sum(e.get("moved_units", 0) for e in el["reclaims"]) if el else None,
        "cycles_server_retracted": sum(e.get("retracted", 0) for e in el["reclaims"]) if el else None,
        "failed_requests_total": {f"{k[0]}_tp{k[1]}": (d.get("burst", {}).get("failed_requests") or 0) + (d.get("cycles_run", {}).get("failed") or 0) + (d.get("itl", {}).get("failed") or 0) for k, d in parts.items()},
        # the elastic pool at TP > 1, every rank in lockstep (bench_elastic.sh's elastic-tpN phases)
        **{f"tp{n}": tp_summary(parts.get(("elastic", n))) for n in MULTI_GPU_TP},
        "server_commands": {f"{k[0]}_tp{k[1]}": d.get("server_command", d["command"]) for k, d in parts.items()},
    })
    results.write(args.out, out)
    print(json.dumps({k: v for k, v in out.items() if k != "server_commands"}, indent=1))


#: The TP degrees of the elastic pool's multi-GPU phases: keys tp2, tp4, tp8 of the result.
MULTI_GPU_TP = (2, 4, 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("phase")
    p.add_argument("--mode", choices=["stock", "elastic", "always-lent"], required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--eager", action="store_true", help="prefill without CUDA graphs (--cuda-graph-backend-prefill disabled)")
    p.add_argument("--post-capture", action="store_true", help="SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1 (issue 22, build 3)")
    p.add_argument("--identity", action="store_true", help="the identity servers (deterministic Triton attention, small base) and workload")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--workloads", default="burst,cycles,itl")
    p.add_argument("--short-requests", type=int, default=110, help="short arrivals in the cycles workload (the first 64 are the identity set)")
    p.add_argument("--gap-s", type=float, default=0.25, help="seconds between short arrivals")
    p.add_argument("--workdir", default="/tmp/bench_elastic")
    p.add_argument("--elastic-extra", default="", help="more flags for an elastic server (one string), e.g. '--elastic-kv-activation-rule measured'")
    p.add_argument("--out", required=True)
    a = sub.add_parser("assemble")
    a.add_argument("parts", nargs="+")
    a.add_argument("--out", required=True)
    a.add_argument("--command", default="bash scripts/gpu/bench_elastic.sh")
    a.add_argument("--keep-header", default=None, metavar="RESULT",
                   help="summarise the parts of an earlier run again with this code: keep RESULT's date, gpu, commit and command "
                        "(the run's), and record this summary's commit and date under 'summarised'")
    g = sub.add_parser("digest", help="an identity part with its per-request outputs and logprobs as sha256 digests, xz-compressed")
    g.add_argument("parts", nargs="+")
    g.add_argument("--out-dir", required=True)
    args = ap.parse_args()
    {"phase": phase, "assemble": assemble, "digest": digest}[args.cmd](args)


if __name__ == "__main__":
    main()
