"""KV offload against stock SGLang on one H200: exactness, capacity, throughput.

Parts (each writes its own JSON; ``assemble`` joins them into the issue's
``docs/results/offload_h200.json``):

    python scripts/gpu/bench_offload.py smoke --out PART.json
        The Llama-3.1-8B shape (dummy weights): the offload server against the
        same server with V resident on the GPU (``--kv-offload-resident-v``:
        the same selection, no host tier) on random prompts of 100 to 30,000
        tokens (one chunked), greedy: identical tokens and logprobs expected.
        Small graphs, no prefill graphs (fast start); both servers' pool sizes.
    python scripts/gpu/bench_offload.py capacity --out PART.json
        Stock SGLang and the offload server at SGLang's defaults: each one's
        ``max_total_num_tokens``, and the tokens it really holds at once under
        a load of 32K-token requests (peak of ``#token`` in use).
    python scripts/gpu/bench_offload.py throughput --workload NAME --servers stock,offload[,hicache] --out PART.json
        Every prompt (random ids) sent at once to each server in turn, streamed
        (``load``: TTFT, ITL and output throughput as ``sglang.bench_serving``
        computes them, without its tokenizer round trip, which took 150 s to
        draw 64 x 32K ids): output throughput, median ITL / TTFT, peak tokens
        held, and for offload its hit rate and PCIe traffic. Workloads: ``long32k`` (64 x 32,768 in, 512 out),
        ``long128k`` (16 x 130,560 in, 512 out), ``fits`` (64 x 4,096 in, 512 out),
        ``over8k`` (32 x 8,448 in, 512 out; fits in HBM, two chunks a request).
    python scripts/gpu/bench_offload.py assemble --parts DIR --out docs/results/offload_h200.json

Needs the bundle in /tmp/site (``../shared/gpu-host``) and this package
installed there. A part that measured nothing writes nothing and exits 1.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import lzma
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from sglang_elastic import gcstats, results  # noqa: E402
from sglang_elastic.config import without_host_tier_flags  # noqa: E402

MODEL = os.path.join(ROOT, "sglang_elastic", "models", "llama-3.1-8b")
COMMON = ["--model-path", MODEL, "--load-format", "dummy", "--sampling-backend", "pytorch", "--grammar-backend", "none",
          "--host", "127.0.0.1"]
SERVERS = {
    "stock": ["--attention-backend", "flashinfer"],
    # the sparse rule for every request (keep-v is on by default since 2026-12-04; "offload-keep" runs it)
    "offload": ["--enable-kv-offload", "--no-kv-offload-keep-v", "--disable-radix-cache", "--max-running-requests", "48"],
    "resident": ["--enable-kv-offload", "--kv-offload-resident-v", "--disable-radix-cache", "--max-running-requests", "48"],
    # dense while V fits (--kv-offload-keep-v): to run beside stock and offload on the fitting load and past HBM
    "offload-keep": ["--enable-kv-offload", "--kv-offload-keep-v", "--disable-radix-cache", "--max-running-requests", "48"],
    # InfiniGen's prefetch on (beside "offload": the step time with and without it through SGLang)
    "offload-prefetch": ["--enable-kv-offload", "--no-kv-offload-keep-v", "--kv-offload-prefetch", "speculative", "--disable-radix-cache", "--max-running-requests", "48"],
    # adaptive hot buffers (--kv-offload-hot-slack-max 4): growth past the base slack while a request's selection misses
    "offload-adaptive": ["--enable-kv-offload", "--no-kv-offload-keep-v", "--kv-offload-hot-slack-max", "4", "--disable-radix-cache", "--max-running-requests", "48"],
    "hicache": ["--attention-backend", "flashinfer", "--enable-hierarchical-cache", "--hicache-size", "90",
                "--hicache-mem-layout", "layer_first", "--hicache-io-backend", "kernel"],
}
#: the offload variants' columns in the assembled throughput rows (``{column}_output_tok_s``, ``_median_itl_ms``, ``_p99_itl_ms``,
#: ``_median_ttft_ms``)
VARIANT_COLUMNS = {"offload-keep": "keep_v", "offload-prefetch": "prefetch", "offload-adaptive": "adaptive"}
WORKLOADS = {  # name: (input_len, output_len, num_prompts)
    "long32k": (32768, 512, 64),
    "long128k": (130560, 512, 16),
    "fits": (4096, 512, 64),
    # fits in HBM (an H100's keep-v holds ~290K tokens of V); every context passes dense_min_chunk (8,192), so each request
    # is two chunks of the all-dense launch, which then merges them
    "over8k": (8448, 512, 32),
}


class Server:
    """One ``python -m sglang.launch_server`` in its own process group."""

    def __init__(self, name: str, args: List[str], port: int, work: str, env: Optional[dict] = None):
        self.name, self.port, self.work = name, port, work
        self.log = os.path.join(work, f"server_{name}.log")
        cmd = [sys.executable, "-m", "sglang.launch_server", *COMMON, *args, "--port", str(port)]
        self.cmd = cmd
        e = dict(os.environ, **(env or {}))
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True, env=e)
        self.t0 = time.time()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait(self, timeout: float = 900) -> float:
        while time.time() - self.t0 < timeout:
            try:
                urllib.request.urlopen(self.url("/health"), timeout=5).read()
                return time.time() - self.t0
            except Exception:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} server exited ({self.proc.returncode}): " + tail(self.log))
                time.sleep(1)
        raise RuntimeError(f"{self.name} server not up after {timeout:.0f} s: " + tail(self.log))

    def info(self) -> dict:
        return json.loads(urllib.request.urlopen(self.url("/server_info"), timeout=30).read())

    def generate(self, payload: dict, timeout: float = 1200) -> dict:
        req = urllib.request.Request(self.url("/generate"), data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=timeout).read())

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def tp_args(a) -> List[str]:
    """``--tp N`` for every server of a part run at TP > 1 (each rank offloads its own KV heads)."""
    return ["--tp", str(a.tp)] if a.tp > 1 else []


def log_size(path: str) -> int:
    """Bytes in a server log so far (0 before it exists): where a later :func:`log_tail_from` starts."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def log_tail_from(path: str, offset: int) -> str:
    """A server log from byte ``offset`` on."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def tail(path: str, n: int = 30) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def dummy_init(a) -> str:
    """The servers' dummy weights: ``--dummy-init`` as given, else ``unit`` for the smoke (an exactness check, which SGLang's own
    dummy weights would pass whatever the attention did) and ``sglang`` for the loads (comparable with the committed runs)."""
    v = getattr(a, "dummy_init", None)
    return v if v else ("unit" if getattr(a, "part", "smoke") == "smoke" else "sglang")


def dummy_env(a) -> dict:
    """``SGLANG_ELASTIC_DUMMY_INIT`` for a server (``sglang_elastic/dummy_init.py``), set either way so the caller's
    environment does not leak in."""
    return {"SGLANG_ELASTIC_DUMMY_INIT": "unit" if dummy_init(a) == "unit" else ""}


#: SGLang's "Prefill batch" log line (``scheduler_components/metrics_reporter.py``; with ``SGLANG_LOG_FORWARD_ITERS``
#: numbered ``Prefill batch [57],``), read by :func:`prefill_log` and :func:`prefill_schedule`
_PREFILL_LINE = re.compile(r"^\[(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[^\]]*\].*Prefill batch.*?#new-seq: (?P<seq>\d+), "
                           r"#new-token: (?P<tok>\d+),(?: #cached-token: (?P<cached>\d+),)?.*?#running-req: (?P<running>\d+), "
                           r"#queue-req: (?P<queue>\d+),.*?input throughput \(token/s\): (?P<rate>[\d.]+)")


def _prefill_lines(text: str) -> list:
    """The :data:`_PREFILL_LINE` matches of ``text``, in order."""
    return [m for m in map(_PREFILL_LINE.search, text.splitlines()) if m]


def prefill_log(text: str) -> Optional[dict]:
    """SGLang's "Prefill batch" log lines (one a prefill forward, ``scheduler_components/metrics_reporter.py``) in
    ``text``, the server log written during a load: how many prefill batches ran, their new tokens, the seconds from
    the first to the last line (the log's timestamps: 1 s resolution), the longest queue and the most running
    requests seen at a prefill, and the median (the upper middle one) of SGLang's "input throughput" (new tokens
    over the time since the previous prefill line, so decode steps between prefills count against it).
    ``seq_entries`` sums "#new-seq", which counts a chunked prefill's request again for each chunk. With DP
    attention each DP rank logs its own lines: the queue and running maxima are then per rank. Says whether a
    slow TTFT came from the prefills themselves or from waiting to be admitted. None when the text has no such
    line."""
    rows = _prefill_lines(text)
    if not rows:
        return None
    stamps = [datetime.datetime.strptime(r["ts"], "%Y-%m-%d %H:%M:%S") for r in rows]
    seqs, toks, running, queue = ([int(r[k]) for r in rows] for k in ("seq", "tok", "running", "queue"))
    rate = sorted(float(r["rate"]) for r in rows)
    return {"batches": len(rows), "seq_entries": sum(seqs), "new_tokens": sum(toks), "max_batch_tokens": max(toks),
            "span_s": (stamps[-1] - stamps[0]).total_seconds(), "max_queue": max(queue), "max_running": max(running),
            "median_input_tok_s": rate[len(rate) // 2]}


def offload_state(info: dict) -> Optional[dict]:
    from sglang_elastic.offload.hooks import state_from_server_info

    return state_from_server_info(info)


def log_value(log: str, key: str) -> Optional[str]:
    """The last ``key=VALUE`` SGLang logged (e.g. ``max_total_num_tokens``)."""
    val = None
    with open(log) as f:
        for line in f:
            i = line.find(key + "=")
            if i >= 0:
                val = line[i + len(key) + 1:].split(",")[0].split()[0]
    return val


class PeakPoller:
    """Polls ``/metrics`` every 0.5 s in a thread: the peak of SGLang's
    ``sglang:num_used_tokens`` (KV tokens held) and ``num_running_reqs``, and with
    ``--kv-offload-keep-v`` ``sglang_elastic:offload_kept_tokens`` / ``_kept_requests``."""

    KEYS = {"sglang:num_used_tokens": "tokens", "sglang:num_running_reqs": "running",
            "sglang_elastic:offload_kept_tokens": "kept_tokens", "sglang_elastic:offload_kept_requests": "kept_requests"}

    def __init__(self, server: "Server"):
        import threading

        self.server, self.peak = server, {"tokens": 0, "running": 0, "kept_tokens": 0, "kept_requests": 0}
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, daemon=True)
        self._th.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                text = urllib.request.urlopen(self.server.url("/metrics"), timeout=10).read().decode()
                for line in text.splitlines():
                    key = self.KEYS.get(line.split("{", 1)[0].split(" ", 1)[0])
                    if key is not None:
                        self.peak[key] = max(self.peak[key], int(float(line.split()[-1])))
            except Exception:
                pass
            time.sleep(0.5)

    def stop(self) -> dict:
        self._stop.set()
        self._th.join()
        return dict(self.peak)


def prompts(lengths: List[int], seed: int, vocab: int = 128000) -> List[List[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(100, vocab) for _ in range(n)] for n in lengths]


# --------------------------------------------------------------------- parts

SMOKE_FLAGS = ["--disable-prefill-cuda-graph", "--cuda-graph-max-bs", "16", "--context-length", "40960", "--skip-tokenizer-init"]
SMOKE_LENGTHS = [100, 1000, 5000, 12000, 30000, 3000]


def radix_followups(ps: List[List[int]], seed: int = 7, keep: float = 0.75, new: int = 50) -> List[List[int]]:
    """A follow-up of each prompt: its first ``keep`` share (what SGLang's radix cache holds once the prompt
    finished: a later turn of a chat, or another question over one document) and ``new`` fresh tokens."""
    rnd = random.Random(seed)
    return [p[: int(len(p) * keep)] + [rnd.randrange(100, 128000) for _ in range(new)] for p in ps]


#: ``smoke --pair``: the two servers the smoke compares, and whether their outputs must be bit-identical
SMOKE_PAIRS = {
    # the offload path against the same selection with every V row on the GPU: bit-identical
    "resident,offload": True,
    # dense while V fits (the shipped default) against stock SGLang: two kernels, so a kernel tolerance; compared up to each
    # request's first differing token, the follow-ups (cache hits) against the fresh prompts
    "stock,offload-keep": False,
}


def first_divergence(x: List[int], y: List[int]) -> int:
    """Leading tokens ``x`` and ``y`` share (two greedy runs: their contexts agree up to there)."""
    n = 0
    for u, v in zip(x, y):
        if u != v:
            break
        n += 1
    return n


def logprob_diffs(a_: List[dict], b_: List[dict], idx) -> List[float]:
    """|delta logprob| of requests ``idx`` (each server's greedy token's), at the steps up to and including each one's first
    differing token: both contexts agree up to there, so even a request whose first token differs counts once (at a
    near-tie the two greedy tokens' logprobs are close; where one server's attention is wrong, they are not)."""
    return [abs(u - v) for i in idx
            for u, v in list(zip(a_[i]["logprobs"], b_[i]["logprobs"]))[: first_divergence(a_[i]["ids"], b_[i]["ids"]) + 1]]


def prefill_schedule(log_text: str) -> List[List[int]]:
    """SGLang's ``Prefill batch`` log lines (:data:`_PREFILL_LINE`) as ``[new_seq, new_token, cached_token, running_req, queue_req]``:
    the order in which the scheduler took a batch of requests in, and how many were still waiting. Two servers whose
    batched outputs differ although these agree ran different batches only if the decode steps between prefills differed
    (the lines do not show those); two servers whose lines differ took the batch in differently, and their batched outputs
    need not agree. Agreeing lines are necessary for a verdict, not sufficient."""
    return [[int(m[k] or 0) for k in ("seq", "tok", "cached", "running", "queue")] for m in _prefill_lines(log_text)]


def part_smoke(a) -> dict:
    """Two servers (``a.pair``, :data:`SMOKE_PAIRS`; by default resident V against offload, the same selection with every V
    row on the GPU), greedy, the same prompts one by one and then at once. ``a.radix``: both servers with SGLang's radix
    cache (default on; the other parts turn it off), and after the prompts a follow-up of each sharing 3/4 of it, which the
    cache matches (``cached_tokens``): the request's sink, ring and V summaries (and a kept request's V) are rebuilt from the
    cached prefix (``OffloadKVPool.plan_prefix``). ``a.dummy_init``: ``unit`` (the default) starts the servers with
    ``SGLANG_ELASTIC_DUMMY_INIT=unit``, under which wrong attention shows in the outputs (``sglang_elastic/dummy_init.py``);
    ``sglang``: SGLang's own dummy weights, under which it does not."""
    radix = bool(getattr(a, "radix", False))
    pair = getattr(a, "pair", "resident,offload")
    exact = SMOKE_PAIRS[pair]
    init = dummy_init(a)
    out = {"lengths": SMOKE_LENGTHS, "max_new_tokens": a.new_tokens, "servers": {}, "radix_cache": radix, "pair": pair, "dummy_init": init}
    ps = prompts(SMOKE_LENGTHS, seed=0)
    if radix:
        ps = ps + radix_followups(ps)
    runs, batched, schedules = {}, {}, {}
    names = pair.split(",")
    for i, name in enumerate(names):
        base = [x for x in SERVERS[name] if not (radix and x == "--disable-radix-cache")]
        if not radix and "--disable-radix-cache" not in base:
            base = base + ["--disable-radix-cache"]
        args = base + SMOKE_FLAGS + ["--max-running-requests", "16"]  # the last occurrence of a flag wins
        s = Server(name, args + tp_args(a), 30100 + i, a.work, env=dummy_env(a))
        try:
            up = s.wait()
            res = []
            for p in ps:
                r = s.generate({"input_ids": p, "sampling_params": {"max_new_tokens": a.new_tokens, "temperature": 0.0, "ignore_eos": True},
                                "return_logprob": True})
                res.append({"ids": r["output_ids"], "logprobs": [x[0] for x in r["meta_info"]["output_token_logprobs"]],
                            "cached_tokens": r["meta_info"].get("cached_tokens")})
            # the same prompts again at once (a batch of 6: hot buffers of several requests in one step)
            import concurrent.futures as cf

            seen = log_size(s.log)
            with cf.ThreadPoolExecutor(len(ps)) as ex:
                batch = list(ex.map(lambda p: s.generate({"input_ids": p, "sampling_params": {"max_new_tokens": a.new_tokens, "temperature": 0.0,
                                                                                              "ignore_eos": True}}), ps))
            schedules[name] = prefill_schedule(log_tail_from(s.log, seen))
            batched[name] = [b["output_ids"] for b in batch]
            info = s.info()
            out["servers"][name] = {"startup_s": round(up, 1), "max_total_num_tokens": info.get("max_total_num_tokens"),
                                    "offload": offload_state(info), "batched_equals_sequential": [b["output_ids"] == r["ids"] for b, r in zip(batch, res)],
                                    "cached_tokens": [r["cached_tokens"] for r in res]}
            runs[name] = res
        finally:
            s.stop()
    a_, b_ = runs[names[0]], runs[names[1]]
    same = [x["ids"] == y["ids"] for x, y in zip(a_, b_)]
    # bit-identical pairs: every step; two kernels: the steps whose contexts agree (after a differing token the two runs
    # decode different texts, and their logprobs say nothing of each other)
    dlp = max((abs(u - v) for x, y in zip(a_, b_) for u, v in zip(x["logprobs"], y["logprobs"])) if exact
              else logprob_diffs(a_, b_, range(len(a_))), default=0.0)
    out["exactness"] = {"compared": len(same), "identical": sum(same), "max_abs_logprob_diff": dlp,
                        "tokens_compared": sum(len(x["ids"]) for x in a_), "bit_identical_expected": exact}
    # the same prompts at once: a batch's outputs need not equal one request's (its GEMMs and splits differ), but two servers
    # that took the batch in alike (the same prefill batches) must agree as the sequential runs do
    same_b = [x == y for x, y in zip(batched[names[0]], batched[names[1]])]
    # no line read (another log format or level) is no evidence of the same schedule
    agree = bool(schedules[names[0]]) and schedules[names[0]] == schedules[names[1]]
    out["exactness"]["batched"] = {"compared": len(same_b), "identical": sum(same_b), "same_schedule": agree, "schedules": schedules}
    fresh, follow = range(len(SMOKE_LENGTHS)), range(len(SMOKE_LENGTHS), len(ps))
    hit = [i for i in follow if all((runs[n][i]["cached_tokens"] or 0) > 0 for n in runs)]  # matched by the cache in both
    if not exact:  # two kernels: how far apart while their contexts agree, fresh prompts against cache hits
        out["exactness"]["first_divergence"] = [first_divergence(x["ids"], y["ids"]) for x, y in zip(a_, b_)]
        for key, idx in (("fresh", fresh), ("cache_hits", hit)):
            d = logprob_diffs(a_, b_, idx)
            if d:
                out["exactness"][f"{key}_logprob"] = {"requests": len(idx), "steps": len(d), "max_abs_logprob_diff": max(d),
                                                      "mean_abs_logprob_diff": sum(d) / len(d)}
    if radix:  # the follow-ups: how many the cache matched in both servers, and whether those came out identical
        out["exactness"]["cache_hits"] = {"followups": len(follow), "matched": len(hit), "identical": sum(same[i] for i in hit)}
    return out


def part_capacity(a) -> dict:
    """Pool sizes at SGLang's defaults and the peak tokens held under 32K requests."""
    out = {"servers": {}}
    n_req, plen = a.requests, 32768
    ps = prompts([plen] * n_req, seed=1)
    for i, name in enumerate(a.servers.split(",")):
        s = Server(name, SERVERS[name] + ["--skip-tokenizer-init", "--enable-metrics"] + tp_args(a), 30200 + i, a.work, env=dummy_env(a))
        try:
            up = s.wait()
            info = s.info()
            import concurrent.futures as cf

            poller = PeakPoller(s)
            t0 = time.time()
            with cf.ThreadPoolExecutor(n_req) as ex:
                list(ex.map(lambda p: s.generate({"input_ids": p, "sampling_params": {"max_new_tokens": a.new_tokens, "temperature": 0.0,
                                                                                      "ignore_eos": True}}), ps))
            peak = poller.stop()
            out["servers"][name] = {"startup_s": round(up, 1), "max_total_num_tokens": info.get("max_total_num_tokens"),
                                    "peak_used_tokens": peak["tokens"], "peak_running_reqs": peak["running"],
                                    "requests": n_req, "prompt_tokens": plen, "seconds": round(time.time() - t0, 1),
                                    "offload": offload_state(s.info())}
        finally:
            s.stop()
    return out


def load(url: str, ps: List[List[int]], out_len: int, timeout: float, when_all_started=None, trace: Optional[list] = None) -> dict:
    """Send every prompt at once to ``/generate`` (streaming, greedy, ``ignore_eos``)
    and time it as ``sglang.bench_serving`` does: TTFT = first streamed chunk,
    ITL = the gaps between chunks divided by the tokens each brings, output
    throughput = output tokens / wall time of the whole load.

    Returns:
        ``{completed, output_tokens, duration_s, output_tok_s, median_ttft_ms,
        median_itl_ms, p99_itl_ms, itl}``; ``itl``: the ITL samples' count, their p90 / p95 / max (ms) and
        how many exceed twice the median (``spikes``: a step held up by a prefill or a stall, which p99
        alone does not separate from a slower step); requests that fail are counted out of ``completed``.
        ``when_all_started``: an ``async`` callable given the session, awaited once every request has
        its first token (every prefill done: the decode phase; :func:`profile_decode`).
        ``trace``: a list that gets this load's client timeline appended (``--itl-trace``): per request its
        first-token and last-token time and its gaps as ``[end_s, token_index, gap_ms]``, times in s from the
        load's start on the client's clock, to find which server steps were slow and what else happened then.
    """
    import asyncio
    import statistics

    import aiohttp

    started = [0]
    first_tokens: List[float] = []

    async def one(session, p):
        t0 = time.perf_counter()
        ttft, last, n, itl, ends = None, None, 0, [], []
        payload = {"input_ids": p, "stream": True,
                   "sampling_params": {"max_new_tokens": out_len, "temperature": 0.0, "ignore_eos": True}}
        async with session.post(url + "/generate", json=payload) as r:
            if r.status != 200:
                return None
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                got = json.loads(line[5:])["meta_info"]["completion_tokens"]
                if got <= n:
                    continue
                if ttft is None:
                    ttft = now - t0
                    started[0] += 1
                    first_tokens.append(now)
                    if started[0] == len(ps) and when_all_started is not None:
                        await when_all_started(session)
                else:
                    itl += [(now - last) / (got - n)] * (got - n)
                    ends += [(now, n, last)] * (got - n)
                last, n = now, got
        return ttft, itl, n, ends

    async def main():
        from sglang_elastic.eval.client import client_session  # drops idle connections before SGLang's server does

        async with client_session(limit=0, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            t0 = time.perf_counter()
            res = await asyncio.gather(*(one(session, p) for p in ps), return_exceptions=True)
            return res, time.perf_counter() - t0

    t_start = time.perf_counter()
    res, dur = asyncio.run(main())
    ok = [r for r in res if isinstance(r, tuple)]
    if trace is not None:
        trace.append({"requests": [{"first_s": round(r[3][0][2] - t_start if r[3] else r[0], 6),
                                    "last_s": round(r[3][-1][0] - t_start, 6) if r[3] else None,
                                    "gaps": [[round(e - t_start, 6), i, round(1e3 * g, 4)] for (e, i, _), g in zip(r[3], r[1])]}
                                   for r in ok]})
    itl = sorted(x for r in ok for x in r[1])
    toks = sum(r[2] for r in ok)

    def pct(q):
        return 1e3 * itl[min(len(itl) - 1, int(q * len(itl)))]

    med = statistics.median(itl) if itl else None
    return {"completed": len(ok), "output_tokens": toks, "duration_s": dur, "output_tok_s": toks / dur if dur else None,
            "median_ttft_ms": 1e3 * statistics.median(r[0] for r in ok) if ok else None,
            "median_itl_ms": 1e3 * med if itl else None,
            "p99_itl_ms": pct(0.99) if itl else None,
            "itl": {"samples": len(itl), "p90_ms": pct(0.90), "p95_ms": pct(0.95), "max_ms": 1e3 * itl[-1],
                    "spikes": sum(x > 2 * med for x in itl),
                    **itl_tail([list(zip(r[3], r[1])) for r in ok], max(first_tokens) if len(first_tokens) == len(ps) else None)}
            if itl else None}


def write_trace(directory: str, server: str, loads: list) -> str:
    """Write one server's load timelines (:func:`load`'s ``trace``) to ``directory/itl_trace_<server>.json.xz``
    and return its path (the row names it; the file stays out of the part's JSON: ~1 MB a 64-request load)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"itl_trace_{server}.json.xz")
    with lzma.open(path, "wt") as f:
        json.dump({"server": server, "loads": loads}, f)
    return path


def itl_tail(per_request: List[List[tuple]], decode_from: Optional[float], factor: float = 1.5, top: int = 12) -> dict:
    """Where a load's slow inter-token gaps come from: the decode phase alone, and the slow server steps.

    Args:
        per_request: per request, its gaps as ``((end_time_s, token_index, start_time_s), gap_s)`` in stream
            order (on the client's ``perf_counter`` clock: when the chunk arrived and when the one before it did;
            ``token_index``: the tokens the request had before it; a chunk of k tokens gives k gaps of 1/k its
            time, as ``sglang.bench_serving`` counts them, with the same three fields).
        decode_from: when the last request streamed its first token (every prefill done), or None.
        factor: a gap is slow above ``factor`` times the median gap.
        top: the slowest steps listed.

    Returns:
        ``{"decode_phase": {samples, median_ms, p99_ms, max_ms} | None`` (gaps whose chunk began after ``decode_from``:
        the p99 of decode steps alone, with no prefill in the load), ``"slow_steps": {threshold_ms, steps,
        gaps (slow chunks), largest: [{at_s, max_ms, requests}], token_indices}}``. A server step streams to every request
        in its batch at once, so slow gaps whose ends lie within half a median gap of each other are one
        step (``steps``); ``at_s`` counts from the first slow step; ``token_indices``: the slow gaps of the
        request with the most, by its token index (a fixed stride between them points at a periodic cost,
        e.g. SGLang's decode log every ``--decode-log-interval`` steps).
    """
    import statistics

    gaps = [g for r in per_request for _, g in r]
    if not gaps:
        return {"decode_phase": None, "slow_steps": None}
    med = statistics.median(gaps)

    def stats(xs):
        xs = sorted(xs)
        return {"samples": len(xs), "median_ms": 1e3 * statistics.median(xs), "p99_ms": 1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))],
                "max_ms": 1e3 * xs[-1]} if xs else None

    # a gap of the decode phase began after the last first token (the other requests' gap of that step held its prefill)
    decode = stats([g for r in per_request for (_, _, start), g in r if start >= decode_from - 1e-3]) if decode_from is not None else None
    thr = factor * med
    # one entry per slow chunk (a chunk of k tokens is k gaps above, one here): a step's requests, not its tokens
    slow = sorted({(end, ri, i, g) for ri, r in enumerate(per_request) for (end, i, _), g in r if g > thr})
    slow = [(end, g) for end, _, _, g in slow]
    steps: List[List[tuple]] = []
    for end, g in slow:
        if steps and end - steps[-1][-1][0] <= med / 2:
            steps[-1].append((end, g))
        else:
            steps.append([(end, g)])
    first = steps[0][0][0] if steps else 0.0
    largest = sorted(({"at_s": round(st[0][0] - first, 4), "max_ms": 1e3 * max(g for _, g in st), "requests": len(st)} for st in steps),
                     key=lambda d: -d["max_ms"])[:top]
    mine = max(per_request, key=lambda r: sum(g > thr for _, g in r))
    return {"decode_phase": decode,
            "slow_steps": {"threshold_ms": 1e3 * thr, "steps": len(steps), "gaps": len(slow), "largest": largest,
                           "token_indices": sorted({i for (_, i, _), g in mine if g > thr})}}


def profile_batch(info: dict, input_len: int, steps: int, held: int = 0) -> Optional[int]:
    """How many requests :func:`profile_decode` sends: as many as the server runs at once, so that the profiled
    steps are one full batch and every request is admitted at once. The least of its request cap
    (``max_running_requests``), what its KV pool holds of a prompt and the profile load's ``steps + 64`` output
    tokens (``max_total_num_tokens``), and ``held``: the most requests the measured load ran at once (0: not
    known), since SGLang's admission also reserves output tokens and the offload pool counts per-request costs
    (64 x 32K on an H100: a pool of 20 such requests held 19). Sending the cap alone where the pool binds (48
    there) profiled the queue's tail, a batch of a few requests; sending one more than fits would profile a lone
    late request. None: nothing is known (send them all)."""
    caps = [int(held)] if held and held > 0 else []
    if info.get("max_running_requests"):
        caps.append(int(info["max_running_requests"]))
    if info.get("max_total_num_tokens"):
        caps.append(max(1, int(info["max_total_num_tokens"]) // (input_len + steps + 64)))
    return min(caps) if caps else None


def profile_decode(s: "Server", ps: List[List[int]], steps: int, work: str, timeout: float, running: Optional[int] = None) -> dict:
    """A second load (new prompts: no prefix cache hit) with SGLang's torch profiler
    (``/start_profile``, GPU activity only) over ``steps`` forward steps once every request decodes;
    the trace's per-step GPU time by kernel category and the GPU's idle time
    (:func:`sglang_elastic.eval.steptrace.summarize`: ``steps - 1`` whole steps between the first and
    the last graph launch). Only as many of ``ps`` as the server runs at once (``running``:
    :func:`profile_batch`) are sent, so that the profiled steps are a full batch of them, not the
    tail of a queue. Not the measured load: the profiler's own cost stays out of the ITL reported.

    Raises:
        RuntimeError: no trace came (the profiler did not start or stop) or it holds no GPU work.
    """
    from sglang_elastic.eval import steptrace

    out_dir = os.path.join(work, "profile")
    os.makedirs(out_dir, exist_ok=True)
    pid = f"{s.name}-{int(time.time())}"
    path = os.path.join(out_dir, f"{pid}-TP-0.trace.json.gz")
    asked = {}
    if running:
        ps = ps[:running]

    async def start(session):
        async with session.post(s.url("/start_profile"), json={"output_dir": out_dir, "num_steps": steps, "activities": ["GPU"],
                                                               "profile_id": pid, "with_stack": False, "record_shapes": False}) as r:
            asked["status"] = r.status

    rec = load(s.url(""), ps, steps + 64, timeout, when_all_started=start)
    if asked.get("status") != 200:
        raise RuntimeError(f"{s.name}: /start_profile answered {asked.get('status')} (completed {rec['completed']} of {len(ps)})")
    for stop_asked in (False, True):
        if stop_asked:  # fewer forward steps ran than asked for: stop it by hand
            try:
                urllib.request.urlopen(urllib.request.Request(s.url("/stop_profile"), data=b"", method="POST"), timeout=120).read()
            except Exception:
                pass
        err = None
        for _ in range(90):
            if os.path.exists(path) and os.path.getsize(path) > 0:
                time.sleep(2)  # written by export_chrome_trace: read it once it parses (a partial gzip does not)
                try:
                    summary = steptrace.summarize(steptrace.load(path), steps=steps - 1)
                except (OSError, EOFError, ValueError) as e:
                    err = e
                    continue
                return {"steps_asked": steps, "requests": len(ps), "trace": os.path.basename(path), "activities": ["GPU"], **summary}
            time.sleep(1)
        if err is not None:
            raise RuntimeError(f"{s.name}: {path}: {err}")
    raise RuntimeError(f"{s.name}: no trace at {path} after the profiled load: " + tail(s.log))


def scheduler_gc(info: dict) -> Optional[dict]:
    """The first scheduler's garbage collections so far (``gc``, :mod:`sglang_elastic.gcstats`; the servers
    here run with ``SGLANG_ELASTIC_GC_STATS=1``), or None."""
    return results.scheduler_state(info).get("gc")


def running_cap(info: dict) -> Optional[int]:
    """The request cap a server's scheduler runs under (SGLang's ``effective_max_running_requests_per_dp``),
    else the flag as given (``max_running_requests``, None if none)."""
    return results.scheduler_state(info).get("effective_max_running_requests_per_dp", info.get("max_running_requests"))


def request_cap(flags: List[str]) -> Optional[str]:
    """The ``--max-running-requests`` a flag list gives (the last one wins, as in argparse; ``--flag=N`` too), or None."""
    cap = None
    for i, f in enumerate(flags):
        if f == "--max-running-requests" and i + 1 < len(flags):
            cap = flags[i + 1]
        elif f.startswith("--max-running-requests="):
            cap = f.split("=", 1)[1]
    return cap


def offload_flags(a, name: str) -> List[str]:
    """The flags a throughput server gets as an offload server (``--offload-extra``, less the host tier's flags for a
    resident-V server, which refuses them; ``--dense-launch`` for keep-v)."""
    flags = a.offload_extra.split() if "--enable-kv-offload" in SERVERS[name] else []
    if "--kv-offload-resident-v" in SERVERS[name]:
        flags = without_host_tier_flags(flags)
    if a.dense_launch and "--kv-offload-keep-v" in SERVERS[name]:
        flags.append(f"--kv-offload-dense-launch={a.dense_launch}")
    return flags


def server_flags(a, name: str) -> List[str]:
    """A throughput server's own flags in the order they are given (the last of a flag wins): its kind's
    (:data:`SERVERS`), every server's (``--extra``), then the offload servers' (:func:`offload_flags`)."""
    return SERVERS[name] + a.extra.split() + offload_flags(a, name)


def same_caps(a, names: List[str]) -> Optional[str]:
    """The one ``--max-running-requests`` every server of a throughput part runs under: the cap the servers that
    give one agree on, which the others (stock, HiCache: SGLang's default is no cap) are then given.

    Why: on 2026-12-06 (H100, 64 x 4K) the offload server ran at most 48 requests, its default here, and stock
    all 64: 0.80x stock's output throughput for a cap, not for the offload path (earlier runs gave every server
    ``--max-running-requests 64`` by hand).

    Raises:
        ValueError: two servers would run under different caps (e.g. ``--offload-extra`` gives the offload servers
            one and nothing gives stock the same).
    """
    caps = {name: request_cap(server_flags(a, name)) for name in names}
    given = {c for c in caps.values() if c is not None}
    if len(given) > 1:
        raise ValueError("the servers would run under different --max-running-requests ("
                         + ", ".join(f"{n} {c or 'none'}" for n, c in caps.items()) + "): give one to all with --extra")
    return given.pop() if given else None


def part_throughput(a) -> dict:
    ilen, olen, n = WORKLOADS[a.workload]
    olen, n = a.output_len or olen, a.num_prompts or n
    out = {"workload": a.workload, "input_len": ilen, "output_len": olen, "num_prompts": n, "client": "bench_offload.load (streaming /generate)",
           "servers": {}}
    ps = prompts([ilen] * n, seed=2)
    names = a.servers.split(",")
    cap = same_caps(a, names)
    for i, name in enumerate(names):
        offload_extra = offload_flags(a, name)
        s = Server(name, SERVERS[name] + ["--skip-tokenizer-init", "--enable-metrics"]
                   + (["--max-running-requests", cap] if cap is not None and request_cap(server_flags(a, name)) is None else [])
                   + tp_args(a) + a.extra.split() + offload_extra, 30300 + i,
                   a.work, env={gcstats.ENV: "1", **dummy_env(a)})  # the scheduler's garbage collections, per load (row "gc")
        try:
            up = s.wait()
            # warm-up at the workload's size (a 256-token one left a first-use JIT in stock's measured prefill on fits)
            import concurrent.futures as cf

            with cf.ThreadPoolExecutor(4) as ex:
                list(ex.map(lambda p: s.generate({"input_ids": p, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}),
                            [ps[0][:256]] + [p[::-1] for p in ps[:3]]))
            info = s.info()
            before, gc0 = offload_state(info), scheduler_gc(info)
            poller = PeakPoller(s)
            log_at = os.path.getsize(s.log) if os.path.exists(s.log) else 0
            t0 = time.time()
            trace = [] if a.itl_trace else None
            rec = load(s.url(""), ps, olen, a.timeout, trace=trace)
            peak = poller.stop()
            info = s.info()  # the counters, collections and sizes after the load, read once
            rec["gc"] = gcstats.window(gc0, scheduler_gc(info), t0, time.time())
            if rec["completed"] == 0:
                raise RuntimeError(f"no request completed on {name}: " + tail(s.log))
            after = offload_state(info)
            row = {"startup_s": round(up, 1), "seconds": round(time.time() - t0, 1), **rec,
                   "max_total_num_tokens": info.get("max_total_num_tokens"), "peak_used_tokens": peak["tokens"],
                   "peak_running_reqs": peak["running"], "max_running_requests": running_cap(info), "extra_flags": " ".join(filter(None, [a.extra, " ".join(offload_extra)]))}
            try:  # the load's prefill batches, from the server's own log (what a TTFT is made of)
                with open(s.log, errors="replace") as f:
                    f.seek(log_at)
                    row["prefill_log"] = prefill_log(f.read())
            except OSError as e:
                row["prefill_log"] = {"error": str(e)[:200]}
            if after is not None:
                b = before or {k: 0 for k in after}
                hits, misses = after["hits"] - b.get("hits", 0), after["misses"] - b.get("misses", 0)
                rd = after["pcie_read_bytes"] - b.get("pcie_read_bytes", 0)
                wr = after["pcie_write_bytes"] - b.get("pcie_write_bytes", 0)
                dur = rec["duration_s"] or 1
                row.update({"hit_rate": hits / (hits + misses) if hits + misses else None, "pcie_read_gb": rd / 1e9, "pcie_write_gb": wr / 1e9,
                            "pcie_gb_per_s": (rd + wr) / dur / 1e9, "prefetched_rows": after.get("prefetched_rows", 0) - b.get("prefetched_rows", 0)})
                if "copy_ms" in after:  # --kv-offload-copy-timing: the sampled steps' V copy time and the share prefetch hid
                    from sglang_elastic.offload.copytime import interval

                    timed = after["copy_timed_steps"] - b.get("copy_timed_steps", 0)
                    row["copy_timing"] = {"timed_steps": timed, "unread_steps": after.get("copy_unread_steps", 0) - b.get("copy_unread_steps", 0),
                                          "host_waits": after.get("copy_waits", 0) - b.get("copy_waits", 0),
                                          "host_wait_ms": after.get("copy_wait_ms", 0.0) - b.get("copy_wait_ms", 0.0),
                                          **interval(b, after),
                                          **{k: (after[k] - b.get(k, 0)) / timed if timed else None
                                             for k in ("copy_exposed_ms", "copy_prefetch_ms", "copy_stall_ms")}}
                    row["copy_hidden_share"] = row["copy_timing"]["copy_hidden_share"]
                if "keep_granted_tokens" in after:  # --kv-offload-keep-v: how much ran dense, and how often HBM ran short
                    row["keep_v"] = {"peak_kept_tokens": peak["kept_tokens"], "peak_kept_requests": peak["kept_requests"],
                                     "granted_tokens": after["keep_granted_tokens"] - b.get("keep_granted_tokens", 0),
                                     "demotions": after["keep_demotions"] - b.get("keep_demotions", 0)}
                # the pool as built and its overflow counters (both should stay 0), the rule that ran
                row["offload_pool"] = {k: after.get(k) for k in ("sizing", "policy", "hot_pages", "hot_pages_free", "hot_page_overflow",
                                                                 "summary_overflow", "summary_slots", "hot_pages_taken_back") if k in after}
            for k in range(a.repeat_loads):  # the same load again with new prompts (no prefix hit): how much its tail moves
                gc0, t2 = scheduler_gc(s.info()), time.time()
                r2 = load(s.url(""), prompts([ilen] * n, seed=20 + k), olen, a.timeout, trace=trace)
                r2["gc"] = gcstats.window(gc0, scheduler_gc(s.info()), t2, time.time())
                it = r2.get("itl") or {}
                row.setdefault("repeats", []).append({**{x: r2.get(x) for x in ("completed", "output_tok_s", "median_ttft_ms", "median_itl_ms",
                                                                                "p99_itl_ms")},
                                                      "decode_phase": it.get("decode_phase"), "gc": r2["gc"],
                                                      "slow_steps": {x: (it.get("slow_steps") or {}).get(x)
                                                                     for x in ("threshold_ms", "steps", "gaps", "token_indices")}})
            if a.profile_steps:
                try:
                    row["profile"] = profile_decode(s, prompts([ilen] * n, seed=3), a.profile_steps, a.work, a.timeout,
                                                    running=profile_batch(s.info(), ilen, a.profile_steps, held=peak["running"]))
                except RuntimeError as e:  # the measured load stands; the profile's failure is named
                    row["profile"] = {"error": str(e)[:2000]}
            if trace:
                row["itl_trace"] = write_trace(a.itl_trace, name, trace)
            out["servers"][name] = row
            results.write(a.out, {**results.header(), "part": "throughput", "incomplete": True, **out})  # survives a cut-off call
        finally:
            s.stop()
    return out


def read_parts(paths: List[str], keys: tuple) -> List[dict]:
    """The throughput part JSONs at ``paths`` (``.json``, or ``.json.xz`` as committed where the tree has no room),
    in order, each agreeing with the first on ``keys`` (a part from before ``--tp`` ran at TP 1: its ``tp`` is set to 1).

    Raises:
        RuntimeError: one cannot be read, is not JSON or not a throughput part, or differs from the first on a key
            (the message names the file and the keys).
    """
    parts = []
    for f in paths:
        try:
            p = results.read_json(f)
        except (OSError, ValueError) as e:
            raise RuntimeError(f"{f}: {e}") from None
        p.setdefault("tp", 1)
        if p.get("part") != "throughput":
            raise RuntimeError(f"{f} is not a throughput part")
        first = (parts or [p])[0]
        diff = [f"{k} {p.get(k)!r} against {first.get(k)!r}" for k in keys if p.get(k) != first.get(k)]
        if diff:
            raise RuntimeError(f"{f}: " + ", ".join(diff))
        parts.append(p)
    return parts


def part_merge(a) -> dict:
    """One throughput part from several of the same workload and size run in calls in a row on one host
    (one server per call where two do not fit in a call's time): servers side by side, commands joined.

    Raises:
        RuntimeError: not throughput parts, another workload or size, one server twice, or another GPU.
    """
    keys = ("part", "workload", "input_len", "output_len", "num_prompts", "gpu", "tp")
    parts = read_parts(a.inputs, keys)
    first = parts[0]
    servers = {}
    for p, f in zip(parts, a.inputs):
        for name, row in p["servers"].items():
            if name in servers:
                raise RuntimeError(f"{f}: server {name} is in two parts")
            servers[name] = row
    flags = {row.get("extra_flags", "").replace("--kv-offload-copy-timing", "").strip() for p in parts for row in p["servers"].values()}
    if len(flags) > 1:
        raise RuntimeError("the parts ran with other flags: " + " / ".join(sorted(flags)))
    commits = sorted({str(p.get("commit")) for p in parts})
    return {"date": max(p.get("date", "") for p in parts), "gpu": first.get("gpu"), "commit": commits[0] if len(commits) == 1 else "; ".join(commits),
            "command": "; ".join(p.get("command", "?") for p in parts), **{k: first.get(k) for k in keys},
            "seconds": round(sum(p.get("seconds", 0) for p in parts), 1), "client": first.get("client"), "servers": servers,
            "merged_from": [{"file": os.path.basename(f), "date": p.get("date"), "servers": sorted(p["servers"])} for p, f in zip(parts, a.inputs)]}


def part_ceiling(a) -> dict:
    """The most output throughput any server can gain over stock on a workload whose prefills it runs as stock
    does: stock's duration on the workload over its duration on the same prompts with one output token (the
    prefills alone, every request leaving at its first token). A server that holds more requests shortens the
    decode phase (duration minus prefill), never the prefills themselves.

    ``--inputs FULL.json PREFILL.json [OTHER.json ...]``: throughput parts of one workload, prompt length, prompt
    count, TP and GPU (:func:`part_throughput`; prompts are drawn from the same seed, so they are the same
    prompts); FULL and PREFILL each with a ``stock`` row, PREFILL at ``output_len`` 1; any server of FULL and of
    the OTHER parts gets its ratio to stock and the share of the ceiling it reached.

    Returns:
        ``{date, gpu, commit, command, workload, input_len, num_prompts, output_len, tp, stock: {duration_s,
        output_tok_s, median_itl_ms}, prefill_only: {duration_s, input_tok_s, prefill_log}, decode_phase_s,
        ceiling_x, servers: {name: {output_tok_s, ratio, share_of_ceiling}}}``; ``ceiling_x`` is stock's duration
        over the prefills' (1.0 where the decode phase took nothing).

    Raises:
        RuntimeError: an input that is not a throughput part, another workload, length, count, TP or GPU, no
            stock row, a PREFILL part not at one output token or a FULL one at one, a PREFILL stock server with other
            flags, pool, request cap or dummy weights than FULL's, a server in two parts, or a load that did not complete.
    """
    if not a.inputs or len(a.inputs) < 2:
        raise RuntimeError("ceiling needs --inputs FULL.json PREFILL.json [OTHER.json ...]")
    keys = ("workload", "input_len", "num_prompts", "gpu", "tp")
    parts = read_parts(a.inputs, keys)
    for p, f in zip(parts, a.inputs):
        if p.get("incomplete"):
            raise RuntimeError(f"{f} is an incomplete part (its call was cut off)")
    full, pre = parts[0], parts[1]
    for p, f, what in ((full, a.inputs[0], "FULL"), (pre, a.inputs[1], "PREFILL")):
        row = p["servers"].get("stock")
        if row is None:
            raise RuntimeError(f"{f} ({what}) has no stock row")
        if row.get("completed") != p.get("num_prompts"):
            raise RuntimeError(f"{f} ({what}): stock completed {row.get('completed')} of {p.get('num_prompts')} requests")
    same = ("extra_flags", "max_running_requests", "max_total_num_tokens")  # stock the same server in both, by its flags and pool
    diff = [f"stock's {k} {pre['servers']['stock'].get(k)!r} against {full['servers']['stock'].get(k)!r}"
            for k in same if pre["servers"]["stock"].get(k) != full["servers"]["stock"].get(k)]
    if pre.get("dummy_init") != full.get("dummy_init"):
        diff.append(f"dummy_init {pre.get('dummy_init')!r} against {full.get('dummy_init')!r}")
    if diff:
        raise RuntimeError(f"{a.inputs[1]} (PREFILL) ran another stock server than {a.inputs[0]}: " + ", ".join(diff))
    if pre.get("output_len") != 1:
        raise RuntimeError(f"{a.inputs[1]} (PREFILL) ran {pre.get('output_len')} output tokens a request, not 1")
    if full.get("output_len") == 1:
        raise RuntimeError(f"{a.inputs[0]} (FULL) ran 1 output token a request: that is a PREFILL part")
    st, pf = full["servers"]["stock"], pre["servers"]["stock"]
    ceiling = st["duration_s"] / pf["duration_s"]
    servers = {}
    for p, f in zip([full] + parts[2:], [a.inputs[0]] + a.inputs[2:]):
        if p.get("output_len") != full.get("output_len"):
            raise RuntimeError(f"{f}: output_len {p.get('output_len')} against {full.get('output_len')}")
        for name, row in p["servers"].items():
            if name == "stock" or row.get("output_tok_s") is None:
                continue
            if name in servers:
                raise RuntimeError(f"{f}: server {name} is in two parts")
            if row.get("completed") != p.get("num_prompts"):
                raise RuntimeError(f"{f}: {name} completed {row.get('completed')} of {p.get('num_prompts')} requests")
            ratio = row["output_tok_s"] / st["output_tok_s"]
            servers[name] = {"output_tok_s": row["output_tok_s"], "median_itl_ms": row.get("median_itl_ms"), "ratio": ratio,
                             "share_of_ceiling": (ratio - 1) / (ceiling - 1) if ceiling > 1 else None, "file": os.path.basename(f)}
    commits = sorted({str(p.get("commit")) for p in parts})
    return {"date": max(p.get("date", "") for p in parts), "gpu": full.get("gpu"), "commit": "; ".join(commits),
            "command": "; ".join(p.get("command", "?") for p in parts) + "; python " + " ".join(sys.argv),
            "part": "ceiling", **{k: full.get(k) for k in keys}, "output_len": full.get("output_len"),
            "stock": {k: st.get(k) for k in ("duration_s", "output_tok_s", "median_itl_ms", "median_ttft_ms")},
            "prefill_only": {"duration_s": pf["duration_s"],
                             "input_tok_s": full["input_len"] * full["num_prompts"] / pf["duration_s"],
                             "prefill_log": pf.get("prefill_log")},
            "decode_phase_s": st["duration_s"] - pf["duration_s"], "ceiling_x": ceiling, "servers": servers,
            "inputs": [os.path.basename(f) for f in a.inputs]}


def pool_sizing(server: dict, key: str = "offload_pool") -> dict:
    """An offload server's pool sizing (``sglang_elastic.offload.sizing``: tokens, bound, stock_tokens, ...) from its
    row in a part: under ``offload_pool`` in throughput rows, under ``offload`` in capacity and smoke rows; ``{}`` for
    a server without one (stock)."""
    return (server.get(key) or {}).get("sizing") or {}


def part_assemble(a) -> dict:
    files = sorted(glob.glob(os.path.join(a.parts, "*.json")))
    every = [json.load(open(f)) for f in files]
    parts = [p for p in every if p.get("tp", 1) == 1]  # the keys are TP 1; parts at TP > 1 go under "tp"
    out = results.header(a.command)
    by = {p.get("part"): p for p in parts}
    out["parts"] = sorted(k for k in by if k)
    gpus = sorted({g for p in every if p.get("gpu") and p["gpu"] != "unknown" for g in p["gpu"].split("; ")})  # a host's GPUs, once each
    if gpus:  # assembled on any machine: the GPU the parts ran on
        out["gpu"] = "; ".join(gpus)
    out["part_commits"] = {os.path.basename(f): p.get("commit") for f, p in zip(files, every)}
    cap = next((p for p in parts if p.get("part") == "capacity"), None)
    if cap:
        st, off = cap["servers"].get("stock", {}), cap["servers"].get("offload", {})
        out["capacity"] = {"stock_tokens": st.get("max_total_num_tokens"), "offload_tokens": off.get("max_total_num_tokens"),
                           "stock_peak_used_tokens": st.get("peak_used_tokens"), "offload_peak_used_tokens": off.get("peak_used_tokens"),
                           "bound": pool_sizing(off, "offload").get("bound")}
    if cap is None:  # no capacity part: the pool sizes of the newest throughput part's offload server (same defaults),
        # one that ran stock beside it first (both pools measured on one host)
        tps = sorted((p for p in parts if p.get("part") == "throughput" and "offload" in p["servers"]),
                     key=lambda p: ("stock" in p["servers"], p.get("date", "")))
        if tps:
            tp = tps[-1]
            off = tp["servers"]["offload"]
            st = tp["servers"].get("stock")
            sizing = pool_sizing(off)
            if st is not None:  # stock's own pool in the same run
                stock, how = st.get("max_total_num_tokens"), ("stock server in another call of the same device session, "
                                                              + ", ".join(m["file"] for m in tp["merged_from"])
                                                              if tp.get("merged_from") else "stock server in the same run")
            else:  # SGLang's own count for the same KV budget, computed by the offload server's sizing in the same run
                stock, how = sizing.get("stock_tokens"), "SGLang's token count for the same KV budget, in the offload server's sizing"
            out["capacity"] = {"stock_tokens": stock, "offload_tokens": off.get("max_total_num_tokens"), "bound": sizing.get("bound"),
                               "policy": (off.get("offload_pool") or {}).get("policy"),
                               "source": f"throughput part {tp['workload']} of {tp.get('date', '?')[:10]} ({off.get('extra_flags') or 'defaults'}); "
                                         f"stock: {how}"}
    out["throughput"] = []
    for p in parts:
        if p.get("part") != "throughput":
            continue
        st, off = p["servers"].get("stock", {}), p["servers"].get("offload", {})
        out["throughput"].append({
            "workload": p["workload"], "num_prompts": p.get("num_prompts"), "input_len": p.get("input_len"), "output_len": p.get("output_len"),
            "date": p.get("date"), "commit": p.get("commit"),
            "offload_denominator": ((off.get("offload_pool") or {}).get("policy") or {}).get("denominator"), "stock_output_tok_s": st.get("output_tok_s"), "offload_output_tok_s": off.get("output_tok_s"),
            "stock_median_itl_ms": st.get("median_itl_ms"), "offload_median_itl_ms": off.get("median_itl_ms"),
            "stock_p99_itl_ms": st.get("p99_itl_ms"), "offload_p99_itl_ms": off.get("p99_itl_ms"),
            "stock_median_ttft_ms": st.get("median_ttft_ms"), "offload_median_ttft_ms": off.get("median_ttft_ms"),
            "hit_rate": off.get("hit_rate"), "pcie_gb_per_s": off.get("pcie_gb_per_s"), "copy_hidden_share": off.get("copy_hidden_share"),
            # the servers' dummy weights: SGLang's (every load before 2026-12-07; a selection that barely moves, an optimistic
            # hit rate) or unit scale (one that moves as on random data, a pessimistic one); sglang_elastic/dummy_init.py
            "dummy_init": p.get("dummy_init", "sglang"),
            "hicache_output_tok_s": p["servers"].get("hicache", {}).get("output_tok_s"),
            "hicache_median_itl_ms": p["servers"].get("hicache", {}).get("median_itl_ms"),
            **{f"{col}_{k}": p["servers"][name].get(k) for name, col in VARIANT_COLUMNS.items() if name in p["servers"]
               for k in ("output_tok_s", "median_itl_ms", "p99_itl_ms", "median_ttft_ms", "hit_rate", "copy_hidden_share")},
            # per server: requests completed of those sent (none lost), its flags beyond its kind's, the pool it ran on
            "runs": {name: {"completed": r.get("completed"), "extra_flags": r.get("extra_flags") or "",
                            "max_total_num_tokens": r.get("max_total_num_tokens"), "peak_running_reqs": r.get("peak_running_reqs"),
                            "bound": pool_sizing(r).get("bound")}
                     for name, r in p["servers"].items()},
        })
    smoke = by.get("smoke")
    if smoke:  # parts before 2026-12-07 ran on SGLang's own dummy weights, under which attention does not reach the outputs
        init = smoke.get("dummy_init", "sglang")
        out["exactness"] = {"compared": smoke["exactness"]["compared"], "identical": smoke["exactness"]["identical"],
                            "model": f"llama-3.1-8b shape (dummy weights: {init})", "dummy_init": init,
                            "max_abs_logprob_diff": smoke["exactness"]["max_abs_logprob_diff"]}
    # the same check with SGLang's radix cache (follow-ups matching cached prefixes, smoke --radix), and the shipped default
    # (keep-v) against stock within a kernel tolerance (smoke --pair stock,offload-keep), each with its date and commit
    for key, name in (("radix_cache", "smoke_radix"), ("keep_v_vs_stock", "smoke_keep"), ("radix_cache_keep_v_vs_stock", "smoke_radix_keep")):
        p = by.get(name)
        if p:
            out.setdefault("exactness", {})[key] = {**p["exactness"], "dummy_init": p.get("dummy_init", "sglang"), "date": p.get("date"),
                                                    "commit": p.get("commit")}
    # accuracy parts (offload_accuracy.py), oldest first: the newest gives the rows; every one is listed
    # (TP 1 only, as the other keys; rows_in names the parts' folder as given, e.g. offload_h200_parts/accuracy.json)
    folder = os.path.basename(os.path.normpath(a.parts))
    accs = sorted(((os.path.basename(f), p) for f, p in zip(files, every) if p.get("part") == "accuracy" and p.get("tp", 1) == 1),
                  key=lambda fp: fp[1].get("date", ""))
    if accs:
        name, acc = accs[-1]
        out["accuracy"] = acc["accuracy"]
        # whose rows these are (the first offload server's flags), the gate's verdict, the other servers' rows
        out["accuracy_part"] = name
        out["accuracy_policy"] = acc.get("offload_policy")
        out["accuracy_acceptance"] = acc.get("acceptance")
        # the other servers' verdicts, of every run; their rows per cell are in the accuracy parts (the tracked results stay small)
        out["accuracy_variants"] = [{k: v.get(k) for k in ("server", "offload_args", "offload_policy", "acceptance")}
                                    | {"rows_in": f"{folder}/{n}"} for n, p in accs for v in p.get("variants", [])]
        if acc.get("server_stats"):  # per server name: its hit rate, prefetch rows, keep-v demotions over the samples (SmolLM2's real weights)
            out["accuracy_server_stats"] = acc["server_stats"]
        ex = next((p["exactness"] for _, p in reversed(accs) if p.get("exactness")), None)
        if ex:
            out.setdefault("exactness_smollm2", ex)
        ctl = next(((n, p["control"]) for n, p in reversed(accs) if p.get("control")), None)
        if ctl:  # dense against dense on another attention kernel, by the same gate: the gate's own noise
            out["accuracy_control"] = {k: ctl[1].get(k) for k in ("server", "control_args", "acceptance", "two_way", "identical_texts",
                                                                 "compared", "lost", "gained", "failed")} | {"rows_in": f"{folder}/{ctl[0]}"}
        out["accuracy_runs"] = [{"part": n, "date": p.get("date"), "commit": p.get("commit"), "passed": (p.get("acceptance") or {}).get("passed"),
                                 "failing": [f"{c['task']} {c['context']}: {'; '.join(c['reasons'])}" for c in (p.get("acceptance") or {}).get("failing", [])],
                                 "two_way": p.get("two_way"),
                                 "control_passed": ((p.get("control") or {}).get("acceptance") or {}).get("passed")} for n, p in accs]
    out["tp"] = tp_summary([p for p in every if p.get("tp", 1) > 1])
    out["part_files"] = [os.path.basename(f) for f in files]
    return out


def tp_summary(parts: List[dict]) -> dict:
    """Per TP degree above 1 (key ``"2"``, ...): the smoke part's exactness (offload against resident V, greedy
    tokens and logprobs) and the offload server's pool against SGLang's count for the same KV budget per rank;
    each server's pool and peak of a capacity part, and each throughput part's rows as the TP-1 parts give them."""
    out: dict = {}
    for p in sorted(parts, key=lambda p: p.get("date", "")):
        row = out.setdefault(str(p["tp"]), {})
        if p.get("part") == "capacity":
            row["capacity"] = {name: {k: v.get(k) for k in ("max_total_num_tokens", "peak_used_tokens", "peak_running_reqs")}
                               for name, v in p["servers"].items()} | {"date": p.get("date"), "commit": p.get("commit")}
        elif p.get("part") == "throughput":
            row.setdefault("throughput", []).append({"workload": p["workload"], "num_prompts": p.get("num_prompts"), "date": p.get("date"),
                                                     "commit": p.get("commit"),
                                                     **{name: {k: v.get(k) for k in ("output_tok_s", "median_itl_ms", "median_ttft_ms", "hit_rate")}
                                                        for name, v in p["servers"].items()}})
        elif p.get("part") == "smoke":
            off = p["servers"].get("offload", {})
            sizing = pool_sizing(off, "offload")
            row.update({"date": p.get("date"), "commit": p.get("commit"), "gpu": p.get("gpu"),
                        "exactness": {k: p["exactness"][k] for k in ("compared", "identical", "max_abs_logprob_diff", "tokens_compared")}
                        | {"dummy_init": p.get("dummy_init", "sglang")},  # SGLang's own (every part before 2026-12-07): blind to attention
                        "offload_tokens": off.get("max_total_num_tokens"), "stock_tokens_same_budget": sizing.get("stock_tokens"),
                        "bound": sizing.get("bound"), "host_pool_gb_per_rank": ((off.get("offload") or {}).get("host_pool_bytes") or 0) / 1e9,
                        "batched_equals_sequential": all(all(v.get("batched_equals_sequential") or [False]) for v in p["servers"].values()),
                        "flags": "smoke: --disable-prefill-cuda-graph --cuda-graph-max-bs 16 --max-running-requests 16"})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=("smoke", "capacity", "throughput", "assemble", "merge", "ceiling"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/bench_offload")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="long32k")
    ap.add_argument("--servers", default="stock,offload")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=None, help="throughput: output tokens per request (default: the workload's)")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="throughput: requests (default: the workload's; e.g. 8 x 130,560 of long128k, 1.04M tokens, still exceed stock's pool)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--tp", type=int, default=1, help="smoke, capacity, throughput: tensor parallel size of every server (GPUs 0..N-1)")
    ap.add_argument("--radix", action="store_true", help="smoke: with SGLang's radix cache, and a follow-up of each prompt that the "
                                                         "cache matches (part \"smoke_radix\")")
    ap.add_argument("--pair", choices=sorted(SMOKE_PAIRS), default="resident,offload",
                    help="smoke: the two servers compared (stock,offload-keep: the shipped default against stock, within a kernel "
                         "tolerance; part \"smoke_keep\" / \"smoke_radix_keep\")")
    ap.add_argument("--dummy-init", choices=("unit", "sglang"), default=None,
                    help="smoke, capacity, throughput: the servers' dummy weights: unit (SGLANG_ELASTIC_DUMMY_INIT=unit, under which "
                         "attention reaches the outputs and a sparse selection moves between steps as it does on random data) or "
                         "sglang (SGLang's own U(-1e-3, 1e-3): outputs blind to attention, near-equal scores); default: unit for "
                         "the smoke, sglang for the loads (comparable with the committed runs)")
    ap.add_argument("--extra", default="", help="throughput: extra SGLang flags for every server (one string)")
    ap.add_argument("--offload-extra", default="", help="throughput: extra flags for the --enable-kv-offload servers only (one string), "
                                                     "e.g. --kv-offload-copy-timing")
    ap.add_argument("--dense-launch", default="", help="throughput: --kv-offload-dense-launch for the keep-v servers only (e.g. the "
                                                     "dense_launch that scripts/gpu/sweep_dense_kept.py picked)")
    ap.add_argument("--repeat-loads", type=int, default=0,
                    help="throughput: after the measured load, run it this many times more on the same server with new prompts; "
                         "each one's ITL, TTFT and slow steps in the row's \"repeats\" (after the offload counters are read; "
                         "before the profile); the row's own ITL stays the first load's")
    ap.add_argument("--itl-trace", default=None, metavar="DIR",
                    help="throughput: write each server's client timeline of every load (each request's first and last token "
                         "and its gaps) to DIR/itl_trace_<server>.json.xz, to place the slow steps")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="throughput: after the measured load, a second one profiled over this many forward steps (SGLang's "
                         "/start_profile, GPU only): each server's per-step kernel time by category and GPU idle time (0: none)")
    ap.add_argument("--parts", default=None, help="assemble: the folder of part JSONs")
    ap.add_argument("--command", default=None, help="assemble: the command line recorded in the result")
    ap.add_argument("--inputs", nargs="+", default=None, help="merge: throughput parts of one workload and size (one server per call); "
                                                                "ceiling: FULL.json PREFILL.json [OTHER.json ...] (part_ceiling)")
    a = ap.parse_args()
    for flag, v in (("--num-prompts", a.num_prompts), ("--output-len", a.output_len), ("--tp", a.tp)):
        if v is not None and v < 1:
            ap.error(f"{flag} {v}: give 1 or more")
    if a.repeat_loads < 0 or (a.repeat_loads and a.part != "throughput"):
        ap.error(f"--repeat-loads {a.repeat_loads}: give 0 (none) or more, with the throughput part only")
    if a.profile_steps < 0 or a.profile_steps == 1 or (a.profile_steps and a.part != "throughput"):
        ap.error(f"--profile-steps {a.profile_steps}: give 0 (none) or 2 or more, with the throughput part only")
    os.makedirs(a.work, exist_ok=True)
    t0 = time.time()
    try:
        if a.part in ("merge", "ceiling") and not a.inputs:
            ap.error(f"{a.part} needs --inputs PART.json ...")
        if a.part not in ("merge", "ceiling") and a.inputs:
            ap.error(f"--inputs applies only to merge and ceiling, not {a.part}")
        if a.radix and a.part != "smoke":
            ap.error(f"--radix applies only to smoke, not {a.part}")
        if a.part != "smoke" and a.pair != "resident,offload":
            ap.error(f"--pair applies only to smoke, not {a.part}")
        if a.part in ("assemble", "merge", "ceiling") and a.dummy_init:
            ap.error(f"--dummy-init applies to the parts that start servers, not {a.part}")
        if a.part != "throughput" and (a.offload_extra or a.dense_launch):
            ap.error(f"--offload-extra / --dense-launch apply only to throughput, not {a.part}")
        if a.dense_launch:
            from sglang_elastic.offload.decode import SplitConfig

            try:
                SplitConfig.with_dense_launch(a.dense_launch)
            except ValueError as e:
                ap.error(str(e))
        if a.part == "throughput":
            try:
                same_caps(a, a.servers.split(","))
            except (ValueError, KeyError) as e:
                ap.error(str(e))  # before any server starts
        res = {"smoke": part_smoke, "capacity": part_capacity, "throughput": part_throughput, "assemble": part_assemble,
               "merge": part_merge, "ceiling": part_ceiling}[a.part](a)
    except RuntimeError as e:
        sys.exit(f"bench_offload {a.part}: {e}")
    if a.part not in ("assemble", "merge", "ceiling"):
        part = a.part + ("_radix" if a.radix else "") + ("_keep" if a.part == "smoke" and not SMOKE_PAIRS[a.pair] else "")
        res = {**results.header(), "part": part, "tp": a.tp, "dummy_init": dummy_init(a), "seconds": round(time.time() - t0, 1), **res}
    results.write(a.out, res)
    print(json.dumps(res, indent=1)[:4000])


if __name__ == "__main__":
    main()
