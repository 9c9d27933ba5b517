"""Aggregate per-sample outcomes into the issue's accuracy rows, and the
acceptance check.

Row schema (``docs/results/offload_h200.json``'s ``accuracy`` list):
``{task, context, samples, dense, offload, kept, kl, budget_frac}`` with
``dense`` / ``offload`` the fraction of samples solved (RULER's all-or-nothing
``string_match_all``, Hsieh et al. 2024), ``kept`` the fraction of
dense-solved samples the offload run also solves (the anchors' metric,
``shared/design/offload-anchors.md`` §5.3), ``kl`` the mean over samples of each
sample's mean next-token KL(dense || offload) in nats over its decode steps,
``budget_frac`` the mean attended fraction of the context in the sparse layers.
Natural-text rows carry ``kl`` and ``budget_frac`` only (the others ``None``).

Acceptance (the issue's): per task and length ``kept >= 0.98``,
``|offload - dense| <= 0.02``, ``kl <= 0.02``, and at least ``min_samples``
samples; a cell nobody solved densely cannot be judged and fails.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Iterable, List, Optional, Tuple

KEPT_MIN = 0.98
GAP_MAX = 0.02
KL_MAX = 0.02
MIN_SAMPLES = 50


@dataclasses.dataclass(frozen=True)
class Record:
    """One sample under one offload run (a policy, or a server).

    ``dense_solved`` / ``offload_solved``: ``None`` for natural text;
    ``kl``: that sample's mean KL(dense || offload) over its decode steps
    (nats), ``None`` when no step was compared; ``budget_frac``: its attended
    fraction, ``None`` if unknown (a server that does not report it).
    """

    task: str
    context: int
    dense_solved: Optional[bool]
    offload_solved: Optional[bool]
    kl: Optional[float]
    budget_frac: Optional[float]


def _mean(xs: List[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


def accuracy_rows(records: Iterable[Record]) -> List[Dict]:
    """Rows of the schema above, one per (task, context), in first-seen order."""
    cells: Dict[Tuple[str, int], List[Record]] = {}
    for r in records:
        cells.setdefault((r.task, r.context), []).append(r)
    rows = []
    for (task, context), rs in cells.items():
        graded = [r for r in rs if r.dense_solved is not None]
        dense_ok = [r for r in graded if r.dense_solved]
        rows.append({
            "task": task,
            "context": context,
            "samples": len(rs),
            "dense": _mean([float(r.dense_solved) for r in graded]),
            "offload": _mean([float(r.offload_solved) for r in graded]),
            "kept": _mean([float(r.offload_solved) for r in dense_ok]),
            "kl": _mean([r.kl for r in rs if r.kl is not None]),
            "budget_frac": _mean([r.budget_frac for r in rs if r.budget_frac is not None]),
        })
    return rows


def acceptance(rows: Iterable[Dict], min_samples: int = MIN_SAMPLES, kept_min: float = KEPT_MIN, gap_max: float = GAP_MAX,
               kl_max: float = KL_MAX) -> Tuple[bool, List[Dict]]:
    """The issue's accuracy gate over :func:`accuracy_rows`.

    Returns:
        ``(passed, failing)``: ``failing`` lists ``{task, context, reasons}``
        for each cell that misses a bound (reasons are short strings with
        the numbers).
    """
    failing = []
    for r in rows:
        why = []
        if r["samples"] < min_samples:
            why.append(f"samples {r['samples']} < {min_samples}")
        if r["task"] != "natural":
            if not r["dense"]:
                why.append("no dense-solved sample: kept undefined")
            elif r["kept"] < kept_min:
                why.append(f"kept {r['kept']:.3f} < {kept_min}")
            if r["dense"] is not None and abs(r["offload"] - r["dense"]) > gap_max + 1e-12:
                why.append(f"|offload - dense| {abs(r['offload'] - r['dense']):.3f} > {gap_max}")
        if r["kl"] is None:
            why.append("no KL measured")
        elif r["kl"] > kl_max:
            why.append(f"kl {r['kl']:.4f} > {kl_max}")
        if why:
            failing.append({"task": r["task"], "context": r["context"], "reasons": why})
    return not failing, failing


def two_way(records: Iterable[Record]) -> Dict:
    """Over every graded sample (natural text left out): ``both`` solved, ``lost`` (dense solved,
    offload not), ``gained`` (offload solved, dense not), and ``sign_test_p``, the exact two-sided
    sign test (McNemar's exact test) of "offload loses answers more often than it gains them":
    ``min(1, 2 * P[X <= min(lost, gained)])`` for ``X ~ Binomial(lost + gained, 1/2)`` (1.0 with
    no discordant sample). A selection that really drops what the answer needs loses far more than
    it gains; two kernels that differ only in rounding lose and gain alike (McNemar 1947)."""
    both = lost = gained = 0
    for r in records:
        if r.dense_solved is None or r.offload_solved is None:
            continue
        both += bool(r.dense_solved and r.offload_solved)
        lost += bool(r.dense_solved and not r.offload_solved)
        gained += bool(r.offload_solved and not r.dense_solved)
    n, m = lost + gained, min(lost, gained)
    tail = sum(math.comb(n, i) for i in range(m + 1)) / 2 ** n if n else 0.5
    return {"both": both, "lost": lost, "gained": gained, "sign_test_p": min(1.0, 2 * tail)}


def table(rows: Iterable[Dict], title: str = "") -> str:
    """A fixed-width text table of accuracy rows (one screen)."""
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    lines = [title] if title else []
    lines.append(f"{'task':<16} {'ctx':>5} {'n':>4} {'dense':>6} {'offl':>6} {'kept':>6} {'kl':>8} {'budget':>7}")
    for r in rows:
        lines.append(f"{r['task']:<16} {r['context']:>5} {r['samples']:>4} {f(r['dense'], '.3f'):>6} {f(r['offload'], '.3f'):>6} "
                     f"{f(r['kept'], '.3f'):>6} {f(r['kl'], '.4f'):>8} {f(r['budget_frac'], '.4f'):>7}")
    return "\n".join(lines)


__all__ = ["GAP_MAX", "KEPT_MIN", "KL_MAX", "MIN_SAMPLES", "Record", "acceptance", "accuracy_rows", "table", "two_way"]
