"""Client side of the experiments: streaming ``/generate`` with ``input_ids``.

The servers run with ``--skip-tokenizer-init`` and
``--incremental-streaming-output`` (the launcher adds both), so a stream chunk
carries the new ``output_ids`` only and the running count in
``meta_info.completion_tokens``, never text; bench_serving times text chunks,
so TTFT and ITL are timed here: TTFT = first chunk with a token - send, ITL =
gap between chunks / tokens the later chunk added.

Without ``--incremental-streaming-output`` SGLang 0.5.17 sends every token
generated so far in each chunk (``TokenizerManager._handle_batch_output``),
so parsing costs O(tokens) per chunk (``json.loads`` of 4,000 ids: 0.5 ms on
a CI core): E1's 40 decodes at a 4.4 ms step (TP 2) need more than one core
once they are a few thousand tokens long, and the streams arrive in bursts
(2026-11-30, TP 2: median ITL 0.2 ms, p99 0.4 s, while the server logged
9,000 tokens/s). Each workload result records the streaming mode its chunks
showed (``client.streaming``) and the client process's CPU share
(``client.cpu_share``), so a measurement bound by the client shows itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from sglang_elastic.eval.config import DecodeThenLong, Mix, Workload

#: How the servers stream (the launcher's ``--incremental-streaming-output``),
#: recorded as the chunks showed it (:func:`observed_streaming`); rows
#: measured otherwise are measured again on ``run.py --resume``.
STREAMING = "incremental"


@dataclasses.dataclass
class RequestRecord:
    input_len: int
    max_new_tokens: int
    t_send: float
    t_first: Optional[float] = None
    t_end: Optional[float] = None
    chunk_times: List[float] = dataclasses.field(default_factory=list)
    chunk_tokens: List[int] = dataclasses.field(default_factory=list)  # tokens added by each chunk
    output_tokens: int = 0
    error: Optional[str] = None
    cancelled: bool = False
    streaming: Optional[str] = None  # what the chunks showed: "incremental", "cumulative" (None: not told apart yet)

    @property
    def ttft(self) -> Optional[float]:
        return None if self.t_first is None else self.t_first - self.t_send


def random_ids(rng: random.Random, n: int, vocab_size: int) -> List[int]:
    """``n`` token ids, avoiding the lowest 1,000 ids (special tokens of most vocabularies)."""
    return [rng.randrange(1000, vocab_size) for _ in range(n)]


def _tokens_so_far(obj: Dict[str, Any], seen: int) -> int:
    """Tokens generated so far: SGLang's running ``completion_tokens``, else
    ``seen`` plus the chunk's new ``output_ids`` (incremental streaming)."""
    meta = obj.get("meta_info") or {}
    if "completion_tokens" in meta:
        return int(meta["completion_tokens"])
    return seen + len(obj.get("output_ids") or [])


def _chunk_streaming(obj: Dict[str, Any], seen: int, total: int) -> Optional[str]:
    """How a chunk after the first streams: its ``output_ids`` hold the new
    ``total - seen`` tokens (incremental) or all ``total`` (cumulative)."""
    n = len(obj.get("output_ids") or [])
    return "incremental" if n == total - seen else "cumulative" if n == total else None


def observed_streaming(records: Sequence[RequestRecord]) -> str:
    """The streaming mode the server used, as the chunks showed it:
    ``cumulative`` if any request saw cumulative chunks, :data:`STREAMING`
    if some saw incremental ones and none cumulative, else ``unknown`` (no
    request got a second chunk)."""
    seen = {r.streaming for r in records if r.streaming}
    return "cumulative" if "cumulative" in seen else (STREAMING if seen else "unknown")


async def stream_generate(session, url: str, input_ids: Sequence[int], max_new_tokens: int, rec: Optional[RequestRecord] = None) -> RequestRecord:
    """POST ``/generate`` with ``stream: true`` and time every chunk."""
    rec = rec or RequestRecord(len(input_ids), max_new_tokens, time.perf_counter())
    payload = {"input_ids": list(input_ids), "stream": True, "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0.0}}
    seen = 0
    try:
        rec.t_send = time.perf_counter()
        async with session.post(url.rstrip("/") + "/generate", json=payload) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            buf = b""
            async for piece in resp.content.iter_any():
                buf += piece
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.splitlines():
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue
                        obj = json.loads(data)
                        if "error" in obj:
                            rec.error = str(obj["error"])[:300]
                            continue
                        now = time.perf_counter()
                        total = _tokens_so_far(obj, seen)
                        if total > seen and seen and rec.streaming is None:
                            rec.streaming = _chunk_streaming(obj, seen, total)
                        if total > seen:
                            if rec.t_first is None:
                                rec.t_first = now
                            rec.chunk_times.append(now)
                            rec.chunk_tokens.append(total - seen)
                            seen = total
        rec.t_end = time.perf_counter()
    except asyncio.CancelledError:
        rec.cancelled = True
        rec.t_end = time.perf_counter()
    except Exception as e:  # a failed request is a row in the result, not a crash
        rec.error = f"{type(e).__name__}: {e}"[:300]
        rec.t_end = time.perf_counter()
    rec.output_tokens = seen
    return rec


# -- metrics ----------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    if not values:
        return None
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))


def summary(values: Sequence[float]) -> Dict[str, Optional[float]]:
    return {"n": len(values), "median": percentile(values, 50), "p99": percentile(values, 99), "mean": (sum(values) / len(values)) if values else None, "max": max(values) if values else None}


def itl_in_window(records: Sequence[RequestRecord], t0: float, t1: float) -> List[float]:
    """Per-token inter-token latencies of chunks that arrived in ``[t0, t1]``
    (a chunk adding k tokens after a gap g counts k times g/k)."""
    out: List[float] = []
    for r in records:
        for i in range(1, len(r.chunk_times)):
            t = r.chunk_times[i]
            if t0 <= t <= t1:
                k = r.chunk_tokens[i]
                out += [(t - r.chunk_times[i - 1]) / k] * k
    return out


def _union(intervals: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[Tuple[float, float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(iv: List[Tuple[float, float]]) -> float:
    return sum(b - a for a, b in iv)


def _intersect(x: List[Tuple[float, float]], y: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def time_shares(records: Sequence[RequestRecord]) -> Dict[str, float]:
    """Client-side split of the wall time from the first send to the last end.

    A request waits for prefill from send to first token, decodes from first
    token to end. ``decode_only``: some request decodes and none waits for its
    first token (the time the reserve could be lent); ``prefill``: some
    request waits for its first token; ``idle``: neither.
    """
    done = [r for r in records if r.t_end is not None]
    if not done:
        return {"wall_s": 0.0, "decode_only_s": 0.0, "prefill_s": 0.0, "idle_s": 0.0, "decode_only_fraction": 0.0}
    t0 = min(r.t_send for r in done)
    t1 = max(r.t_end for r in done)
    waiting = _union([(r.t_send, r.t_first if r.t_first is not None else r.t_end) for r in done])
    decoding = _union([(r.t_first, r.t_end) for r in done if r.t_first is not None])
    overlap = _length(_intersect(waiting, decoding))
    wall = t1 - t0
    decode_only = _length(decoding) - overlap
    prefill = _length(waiting)
    return {"wall_s": wall, "decode_only_s": decode_only, "prefill_s": prefill, "idle_s": max(0.0, wall - decode_only - prefill), "decode_only_fraction": decode_only / wall if wall > 0 else 0.0}


#: Seconds an idle connection is kept for reuse: below SGLang 0.5.17's server keep-alive (``SGLANG_TIMEOUT_KEEP_ALIVE``,
#: 5 s) and aiohttp's default (15 s), which let a request go out on a connection the server was closing (the client
#: then sees ``ServerDisconnectedError``; 1 and 3 of 110 prompts in two runs of scripts/gpu/bench_elastic.py on an H100).
KEEPALIVE_S = 2.0


def client_session(**kw):
    """``aiohttp.ClientSession`` whose connector drops idle connections after :data:`KEEPALIVE_S` (``limit``: its
    connection cap, aiohttp's 100 by default; 0: none)."""
    import aiohttp

    limit = kw.pop("limit", 100)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, keepalive_timeout=KEEPALIVE_S), **kw)


# -- workloads --------------------------------------------------------------


async def _decode_then_long_once(url: str, w: DecodeThenLong, vocab_size: int, rng: random.Random) -> Dict[str, Any]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)
    async with client_session(timeout=timeout) as session:
        dec = [RequestRecord(w.decode_input_len, w.decode_output_len, time.perf_counter()) for _ in range(w.decodes)]
        dec_tasks = [asyncio.create_task(stream_generate(session, url, random_ids(rng, w.decode_input_len, vocab_size), w.decode_output_len, r)) for r in dec]
        # every decode has its first token (or failed) before the long prompts arrive
        while any(r.t_first is None and r.error is None and not t.done() for r, t in zip(dec, dec_tasks)):
            await asyncio.sleep(0.02)
        await asyncio.sleep(w.settle_s)
        t_long0 = time.perf_counter()
        long_tasks = []
        for i in range(w.long_prompts):
            if i and w.long_interval_s:
                await asyncio.sleep(w.long_interval_s)
            long_tasks.append(asyncio.create_task(stream_generate(session, url, random_ids(rng, w.long_input_len, vocab_size), w.long_output_len)))
        longs = await asyncio.gather(*long_tasks)
        t_long1 = max((r.t_end for r in longs if r.t_end is not None), default=time.perf_counter())
        early = sum(1 for t in dec_tasks if t.done())
        for t in dec_tasks:
            t.cancel()  # closing the stream aborts the request in SGLang
        await asyncio.gather(*dec_tasks, return_exceptions=True)
    return {"t_long0": t_long0, "t_long1": t_long1, "long": longs, "decodes": dec, "decodes_finished_early": early}


def run_decode_then_long(url: str, w: DecodeThenLong, vocab_size: int) -> Dict[str, Any]:
    """E1/E2 workload; returns TTFT of the long prompts and the decodes' ITL while they ran."""
    rng = random.Random(w.seed)
    ttfts: List[float] = []
    itls: List[float] = []
    errors: List[str] = []
    early = 0
    recs: List[RequestRecord] = []
    for _ in range(w.repeats):
        out = asyncio.run(_decode_then_long_once(url, w, vocab_size, rng))
        recs += out["long"] + out["decodes"]
        ttfts += [r.ttft for r in out["long"] if r.ttft is not None]
        errors += [r.error for r in out["long"] + out["decodes"] if r.error]
        itls += itl_in_window(out["decodes"], out["t_long0"], out["t_long1"])
        early += out["decodes_finished_early"]
    return {
        "kind": "decode_then_long",
        "ttft_s": summary(ttfts),
        "ttft_values_s": ttfts,
        "decode_itl_s": summary(itls),
        "decodes_finished_early": early,
        "errors": errors[:20],
        "num_errors": len(errors),
        "workload": w.model_dump(),
        "streaming": observed_streaming(recs),
    }


async def _mix(url: str, w: Mix, vocab_size: int) -> List[RequestRecord]:
    import aiohttp

    rng = random.Random(w.seed)
    ins = w.input_len.sample(rng, w.num_requests)
    outs = w.output_len.sample(rng, w.num_requests)
    gaps = [0.0 if w.request_rate == float("inf") else rng.expovariate(w.request_rate) for _ in range(w.num_requests)]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)
    async with client_session(timeout=timeout, limit=0) as session:
        tasks = []
        for n_in, n_out, gap in zip(ins, outs, gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(stream_generate(session, url, random_ids(rng, n_in, vocab_size), n_out)))
        return list(await asyncio.gather(*tasks))


def run_mix(url: str, w: Mix, vocab_size: int) -> Dict[str, Any]:
    """E4 workload; returns the client-side time shares and TTFT/ITL."""
    recs = asyncio.run(_mix(url, w, vocab_size))
    ok = [r for r in recs if r.error is None]
    itls = itl_in_window(ok, float("-inf"), float("inf"))
    return {
        "kind": "mix",
        "name": w.name,
        **time_shares(ok),
        "ttft_s": summary([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": summary(itls),
        "input_tokens": sum(r.input_len for r in ok),
        "output_tokens": sum(r.output_tokens for r in ok),
        "num_errors": len(recs) - len(ok),
        "errors": [r.error for r in recs if r.error][:20],
        "workload": w.model_dump(),
        "streaming": observed_streaming(recs),
    }


async def _one(url: str, input_ids: Sequence[int], max_new_tokens: int) -> RequestRecord:
    import aiohttp

    async with client_session(timeout=aiohttp.ClientTimeout(total=None, sock_read=3600)) as session:
        return await stream_generate(session, url, input_ids, max_new_tokens)


def warm_up(url: str, w: Workload, vocab_size: int) -> Dict[str, Any]:
    """One unmeasured request of the workload's longest prompt (``long_input_len``,
    or the input distribution's ``upper``), alone, before the workload.

    A server's own start-up warm-up is one short request, so a host whose
    JIT caches are cold compiles the chunked-prefill kernels (prefill over a
    cached prefix) during the first long prompt: on 2026-11-30 the first row
    on a fresh H200 measured TTFTs of 8.7, 5.6 and 2.4 s for its first three
    25K-token prompts, then 1.01 s. Its prompt comes from its own random
    stream (seeded from the workload's ``seed``), so the measured requests
    are the ones the workload draws without it. Returns ``{"input_len",
    "ttft_s", "error"}`` (seconds; the error, if any, is reported and the
    workload still runs)."""
    n = w.long_input_len if w.kind == "decode_then_long" else w.input_len.upper
    rec = asyncio.run(_one(url, random_ids(random.Random(f"warm-up {w.seed}"), n, vocab_size), 1))
    return {"input_len": n, "ttft_s": rec.ttft, "error": rec.error}


def run_workload(url: str, workload: Dict[str, Any], vocab_size: int, warmup: bool = True,
                 after_warmup: Optional[Callable[[Dict[str, Any]], None]] = None) -> Dict[str, Any]:
    """Run one workload (its config as a dict, e.g. from a Ray actor call),
    after :func:`warm_up` unless ``warmup`` is false; the warm-up's result is
    the output's ``warmup`` (None when skipped). ``after_warmup(result)`` runs
    between the two; what it raises ends the call (the launcher stops there
    when the warm-up request took the server down)."""
    from pydantic import TypeAdapter

    w = TypeAdapter(Workload).validate_python(workload)
    warm = warm_up(url, w, vocab_size) if warmup else None
    if warm is not None and after_warmup is not None:
        after_warmup(warm)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    out = run_decode_then_long(url, w, vocab_size) if w.kind == "decode_then_long" else run_mix(url, w, vocab_size)
    out["warmup"] = warm
    # the client's own load: near 1.0 means one core was busy parsing the streams and ITL is the client's, not the server's
    out["client"] = {"streaming": out.pop("streaming"), "cpu_share": (time.process_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)}
    return out


def workload_current(w: Dict[str, Any]) -> bool:
    """True when the workload result ``w`` ran with this client's streaming (:data:`STREAMING`)."""
    return (w.get("client") or {}).get("streaming") == STREAMING


def client_current(row: Dict[str, Any]) -> bool:
    """True when every workload of ``row`` ran with this client's streaming
    (:func:`workload_current`); a row of server facts only (E3) always is."""
    return all(workload_current(w) for w in row.get("workloads") or [])
