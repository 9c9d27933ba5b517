"""Render a kernel-bench result of ``scripts/gpu/bench_decode.py`` (issue 23) as the
markdown table of ``docs/decode.md``, with issue 23's kernel acceptance checks under it.

Usage::

    python scripts/gpu/decode_table.py docs/results/decode_h100.json.xz [--page 16]

Columns are µs per layer (CUDA-graph replay, do_bench median) under the write flush,
then the read flush where the bench timed it; "floor" is the case's contiguous read of
the same K and V bytes in the same harness. Checks (issue 23's acceptance):

- B1 32K: our split at most 1.10x its read floor under both flushes;
- B32 Zipf and B64 8x32K+56x2K: our split at most 0.97x FlashInfer persistent
  (``BatchAttention``, a benchmark column: its plan synchronizes the device);
- every case: the policy's pick at least 1.00x FlashInfer's tensor-core decode (the
  FlashInfer path the policy can use), never below 0.98x.

A missing column prints "–"; a file without ``cases`` is refused with one line.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from sglang_elastic import results  # noqa: E402

COLUMNS = [("split", "ours_split_us"), ("split 1-launch", "ours_split_fused_us"), ("compact", "ours_compact_us"),
           ("FI tc", "flashinfer_us"), ("FI persistent", "flashinfer_persistent_us"), ("FI XQA", "flashinfer_xqa_us"),
           ("FA3", "fa3_us"), ("floor", "read_floor_us")]
READ_COLUMNS = [("split", "ours_split_us"), ("FI tc", "flashinfer_us"), ("FA3", "fa3_us")]
#: shown only where a run timed it: the one-launch split with its merge's old [8, 16, D] tile (the same-host A/B)
OPTIONAL_COLUMNS = [("1-launch, old merge tile", "ours_split_fused_wide_merge_us")]


def _f(x: Optional[float], nd: int = 1) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or not b else a / b


def table(d: dict, page: Optional[int] = None) -> str:
    rows = [c for c in d["cases"] if page is None or c["page_size"] == page]
    cols = COLUMNS[:2] + [oc for oc in OPTIONAL_COLUMNS if any(c.get(oc[1]) is not None for c in rows)] + COLUMNS[2:]
    head = ["case", "page", *[n for n, _ in cols], "read flush: " + " / ".join(n for n, _ in READ_COLUMNS) + " / floor",
            "split ÷ floor (write, read)", "policy", "policy speed vs FI tc"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in rows:
        rf = c.get("read_flush_us") or {}
        read = " / ".join(_f(rf.get(k)) for _, k in READ_COLUMNS) + " / " + _f(c.get("read_floor_read_flush_us"))
        fr = c.get("floor_ratio") or {}
        sf = f"{_f((fr.get('write') or {}).get('ours_split_us'), 2)}, {_f((fr.get('read') or {}).get('ours_split_us'), 2)}"
        pol = _ratio(c.get("flashinfer_us"), c.get("policy_us"))  # speed: FI time over the pick's time
        out.append("| " + " | ".join([c["name"], str(c["page_size"]), *[_f(c.get(k)) for _, k in cols], read, sf,
                                      str(c.get("policy_pick", "–")), _f(pol, 3) + "x"]) + " |")
    return "\n".join(out)


def checks(d: dict, page: Optional[int] = None) -> list:
    """Issue 23's kernel points, one line each: (name, value, bound, held)."""
    res = []
    for c in d["cases"]:
        if page is not None and c["page_size"] != page:
            continue
        tag = f"{c['name']} p{c['page_size']}"
        if c["name"] == "B1_32K":
            for flush in ("write", "read"):
                r = ((c.get("floor_ratio") or {}).get(flush) or {}).get("ours_split_us")
                res.append((f"{tag} split ÷ read floor ({flush} flush)", r, "≤ 1.10", r is not None and r <= 1.10))
        if c["name"] in ("B32_zipf_1K-61K", "B64_8x32K_56x2K"):
            r = _ratio(c.get("ours_split_us"), c.get("flashinfer_persistent_us"))
            res.append((f"{tag} split ÷ FI persistent", r, "≤ 0.97", r is not None and r <= 0.97))
        r = _ratio(c.get("flashinfer_us"), c.get("policy_us"))
        res.append((f"{tag} policy speed ÷ FI tc", r, "≥ 1.00 (never < 0.98)", r is not None and r >= 1.0 - 1e-9))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a bench_decode.py result JSON, or one xz-compressed (docs/results/decode_h100.json.xz)")
    ap.add_argument("--page", type=int, default=None, help="only cases of this page size")
    a = ap.parse_args(argv)
    try:
        d = results.read_json(a.result)
        cases = d["cases"]
        if not isinstance(cases, list) or not all(isinstance(c, dict) and "name" in c and "page_size" in c for c in cases):
            raise ValueError("its cases are not the kernel bench's (a name and a page_size each)")
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"decode_table: {a.result} is not a bench_decode.py result ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    if a.page is not None and not any(c["page_size"] == a.page for c in cases):
        print(f"decode_table: {a.result} has no case at page size {a.page} (it has {sorted({c['page_size'] for c in cases})})", file=sys.stderr)
        return 2
    try:  # rendered whole before printing: a malformed column is refused, not half printed
        out = [f"{d.get('gpu', '?')}, commit {d.get('commit', '?')}, {d.get('date', '?')}: `{d.get('command', '?')}`\n", table(d, a.page), ""]
        out += [f"- {name}: {_f(v, 3)} ({bound}) {'held' if held else '**missed**'}" for name, v, bound, held in checks(d, a.page)]
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        print(f"decode_table: {a.result} has a malformed case ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
