"""The advisor against every measured point: each calibration point
(sglang_elastic/eval/calibration.json) predicted from a fit without it
(leave-one-out), E3's rows not among them, E1's and E2's elastic rows, E2's
post-capture rows (SGLang's own sizing) and the elastic pool's own runs (their lendable tokens; predicted without the
calibration point of the same model, TP and chunk) -> docs/results/eval/advisor.json,
the table in docs/eval.md. CPU only (the advisor no longer imports SGLang).

    python scripts/eval/advisor_points.py [--out docs/results/eval/advisor.json]
"""

import argparse
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sglang_elastic import results  # noqa: E402
from sglang_elastic.eval import advisor, report  # noqa: E402


#: The calibration's GPU (an H200, 143,771 MiB): rows measured on another card say which.
CALIBRATED_MIB = 143771


def _on(facts) -> str:
    """`` on a 79.6 GiB GPU`` for a row measured on another card than the calibration's, else nothing."""
    mib = facts.get("gpu_mem_mib")
    return "" if not mib or abs(mib - CALIBRATED_MIB) < 1 else f" on a {mib / 1024:.1f} GiB GPU"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs/results/eval/advisor.json")
    a = ap.parse_args()
    cal = advisor.load_calibration()
    points = []
    calibrated = set()

    def without(model, tp, chunk):
        """The calibration less its points of this setup (leave-one-out): a check, not a restatement of the fit."""
        rest = [p for p in cal["points"] if (p["model"], p["tp"], p.get("chunked_prefill_size")) != (model, tp, chunk)]
        return ({**cal, "points": rest}, True) if rest else (cal, False)

    def source(text, pred, held_out, it="it"):
        ext = pred["factors"]["extrapolated_from_tp"]
        return text + (f"; predicted without {it}" if held_out else "; in the fit (the only point)") + (f"; TP {ext}'s factors" if ext else "")

    for p in cal["points"]:
        key = (p["model"], p["tp"], p.get("chunked_prefill_size"))
        held, held_out = without(*key)
        pred = advisor.predict(p["model"], p["gpu_mem_mib"] / 1024, p["tp"], p.get("chunked_prefill_size"), calibration=held)
        points.append({"label": p["label"], "tp": p["tp"], "source": source(p["source"].split(" (")[0], pred, held_out), "held_out": held_out,
                       "measured": {k: p.get(k) for k in ("mem_fraction_static", "max_total_num_tokens", "free_after_graphs_gib")}, "predicted": pred})
        calibrated.add(key)
    e3 = ROOT / "docs/results/eval/reserve_vs_tp.json"
    if e3.is_file():  # E3 rows not (yet) among the calibration points
        d = json.loads(e3.read_text())
        for r in d["rows"]:
            f = r.get("facts") or {}
            s = r["server"]
            if not (r.get("ok") and f.get("gpu_mem_mib")) or (s["model"], s["tp"], s.get("chunked_prefill_size")) in calibrated:
                continue
            pred = advisor.predict(s["model"], f["gpu_mem_mib"] / 1024, s["tp"], s.get("chunked_prefill_size"), calibration=cal)
            points.append({"label": f"{s['model']} TP{s['tp']} (E3 {r['label']})", "tp": s["tp"], "source": f"{e3.relative_to(ROOT)} ({d.get('date', '?')[:10]})", "held_out": True,
                           "measured": {k: f.get(k) for k in ("mem_fraction_static", "max_total_num_tokens", "free_after_graphs_gib")}, "predicted": pred})
    # E1's and E2's elastic rows (not reused ones): SGLang's token count and the
    # tokens the pool reported lendable, at the row's chunk
    for path in sorted((ROOT / "docs/results/eval").glob("*.json")):
        d = json.loads(path.read_text())
        if d.get("experiment") not in ("ttft_vs_chunk", "capacity"):
            continue
        for r in d["rows"]:
            f, s = r.get("facts") or {}, r["server"]
            el = f.get("sglang_elastic") or {}
            if not (r.get("ok") and el.get("lendable_tokens") is not None and f.get("gpu_mem_mib")) or r.get("reused_from"):
                continue
            if (s.get("env") or {}).get("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING") == "1":
                continue  # lending on top of post-capture sizing: the advisor predicts its pool (below), not that lend
            chunk = s.get("chunked_prefill_size")
            held, held_out = without(s["model"], s["tp"], chunk)
            pred = advisor.predict(s["model"], f["gpu_mem_mib"] / 1024, s["tp"], chunk, calibration=held)
            points.append({"label": f"{s['model']} TP{s['tp']}{_on(f)} ({d['experiment'].replace('ttft_vs_chunk', 'E1').replace('capacity', 'E2')} {r['label']}, {el.get('mode', 'dynamic')})", "tp": s["tp"],
                           "source": source(f"{path.relative_to(ROOT)} row {r['label']}", pred, held_out, "the stock point of its setup"), "held_out": held_out,
                           "measured": {"mem_fraction_static": f.get("mem_fraction_static"), "max_total_num_tokens": f.get("max_total_num_tokens"), "free_after_graphs_gib": f.get("free_after_graphs_gib"), "extra_kv_tokens": el["lendable_tokens"]}, "predicted": pred})
    # E2's post-capture rows: SGLang's own sizing (SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1) against
    # the advisor's prediction of it, with the row's --max-running-requests
    for path in sorted((ROOT / "docs/results/eval").glob("capacity*.json")):
        d = json.loads(path.read_text())
        for r in d["rows"]:
            f, s = r.get("facts") or {}, r["server"]
            # a row that failed after start-up still measured SGLang's sizing (its /server_info facts)
            if not ((r.get("ok") or f.get("max_total_num_tokens")) and f.get("gpu_mem_mib") and (s.get("env") or {}).get("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING") == "1") or r.get("reused_from"):
                continue
            args = s.get("extra_args") or []
            mrr = int(args[args.index("--max-running-requests") + 1]) if "--max-running-requests" in args else None
            chunk = s.get("chunked_prefill_size")
            held, held_out = without(s["model"], s["tp"], chunk)
            pred = advisor.predict(s["model"], f["gpu_mem_mib"] / 1024, s["tp"], chunk, calibration=held, max_running_requests=mrr)
            points.append({"label": f"{s['model']} TP{s['tp']}{_on(f)} (E2 {r['label']}, post-capture sizing{'' if r.get('ok') else '; the server failed after start-up'})", "tp": s["tp"],
                           "source": source(f"{path.relative_to(ROOT)} row {r['label']}", pred, held_out, "the stock point of its setup"), "held_out": held_out,
                           "measured": {"mem_fraction_static": f.get("mem_fraction_static"), "post_capture_kv_tokens": f.get("max_total_num_tokens")}, "predicted": pred})
    # The elastic pool's own H200 runs: SGLang's token count and what was lent
    # (free after graphs, torch cache emptied, less the 1 GiB default margin).
    parts = ROOT / "docs/results/elastic_h200_parts"
    for name, label in (("elastic_tp1.json.gz", "llama-3.1-8b TP1 (elastic run)"), ("elastic_tp2.json.gz", "llama-3.1-8b TP2 (elastic run)")):
        f = parts / name  # kept gzipped (the tracked tree's size)
        if not f.is_file():
            continue
        d = json.loads(gzip.decompress(f.read_bytes()))
        held, held_out = without("llama-3.1-8b", d["tp"], 8192)  # SGLang's H200 default chunk, as the runs had
        pred = advisor.predict("llama-3.1-8b", 143771 / 1024, d["tp"], None, calibration=held)
        points.append({"label": label, "tp": d["tp"], "source": source(f"{f.relative_to(ROOT)} (scripts/gpu/bench_elastic.sh)", pred, held_out, "the stock point of its setup"), "held_out": held_out,
                       "measured": {"max_total_num_tokens": d["kv_tokens_base"], "extra_kv_tokens": d["lent_tokens_max"]}, "predicted": pred})
    hdr = results.header("python scripts/eval/advisor_points.py")
    hdr["gpu"] = "none: predicted on CPU, the measured points cite their source"
    results.write(str(a.out), {**hdr, "points": points})
    if a.out.resolve().parent == (ROOT / "docs/results/eval").resolve():  # the doc's tables read that folder only
        report.render_doc(ROOT / "docs/eval.md", a.out.parent, ROOT)
    else:
        print(f"docs/eval.md left as it is: {a.out} is outside docs/results/eval")
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
