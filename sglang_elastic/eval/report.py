"""Tables (Markdown, in ``docs/eval.md``) and plots (PNG) from the committed
result JSON; nothing here measures. One block per experiment between
``<!-- eval:NAME -->`` and ``<!-- /eval:NAME -->`` is replaced; the rest of the
document is left as written.

    python scripts/eval/report.py    # docs/results/eval/*.json -> docs/eval.md, docs/results/eval/*.png
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from sglang_elastic.eval.client import client_current, workload_current
from sglang_elastic.eval.experiments import not_measured
from sglang_elastic.eval.launcher import CAUSE, TOO_BIG, crash_cause, shorten

RUN = {
    "ttft_vs_chunk": "python scripts/eval/run.py scripts/eval/configs/e1_ttft_vs_chunk.yaml",
    "ttft_vs_chunk_tp2": "python scripts/eval/run.py scripts/eval/configs/e1_ttft_vs_chunk_tp2.yaml",
    "capacity": "python scripts/eval/run.py scripts/eval/configs/e2_capacity.yaml",
    "capacity_tp2": "python scripts/eval/run.py scripts/eval/configs/e2_capacity_tp2.yaml",
    "capacity_issue22": "python scripts/eval/run.py scripts/eval/configs/e2_capacity_issue22.yaml",
    "ttft_vs_chunk_70b_tp4": "python scripts/eval/run.py scripts/eval/configs/e1_ttft_vs_chunk_70b_tp4.yaml",
    "capacity_70b_tp4": "python scripts/eval/run.py scripts/eval/configs/e2_capacity_70b_tp4.yaml",
    "reserve_vs_tp": "python scripts/eval/run.py scripts/eval/configs/e3_reserve_vs_tp.yaml",
    "decode_fraction": "python scripts/eval/run.py scripts/eval/configs/e4_decode_fraction.yaml",
    "advisor": "python scripts/eval/advisor_points.py",
}
#: The generated blocks of docs/eval.md, in the page's order.
BLOCKS = tuple(RUN)


def _n(x: Any, fmt: str = "{:,}") -> str:
    return "–" if x is None else fmt.format(x)


def _ms(x: Optional[float]) -> str:
    return _n(None if x is None else x * 1000, "{:,.1f}")


def _s(x: Optional[float]) -> str:
    return _n(x, "{:,.3f}")


def _pct(x: Optional[float]) -> str:
    return _n(None if x is None else 100 * x, "{:.1f} %")


def _table(head: List[str], rows: List[List[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows])


def _header_line(d: Dict[str, Any], png: Optional[str]) -> str:
    src = f"`{d['_path']}` ({d.get('date', '?')[:10]}, {d.get('gpu', '?').split(';')[0]}, commit {str(d.get('commit', '?'))[:7]})"
    if d.get("standin"):
        src += " **stand-in server, not a GPU measurement**"
    return src + (f"; plot: `{png}`" if png else "")


def _w(row: Dict[str, Any], i: int = 0) -> Dict[str, Any]:
    ws = row.get("workloads") or []
    return ws[i] if len(ws) > i else {}


#: The note of a row measured before the launcher turned on --incremental-streaming-output.
OLDER_CLIENT = "cumulative streaming (older client)"


def _warmup_note(w: Dict[str, Any]) -> str:
    """The warm-up prompt's failure (:func:`sglang_elastic.eval.client.warm_up`), if it failed."""
    err = (w.get("warmup") or {}).get("error")
    return "warm-up failed: " + err.splitlines()[0][:60].replace("|", "/") if err else ""


def _workload_note(w: Dict[str, Any]) -> str:
    """One workload's request errors (its warm-up's too), and whether the older client (cumulative streaming) measured it."""
    n = w.get("num_errors", 0)
    notes = [f"{n} request errors" if n else "", _warmup_note(w), "" if workload_current(w) else OLDER_CLIENT]
    return "; ".join(x for x in notes if x)


def _elastic_mode(row: Dict[str, Any]) -> Optional[str]:
    """The row's ``--elastic-kv-mode``: what the server reported, else what it
    was given (default ``dynamic``); None without ``--enable-elastic-kv``."""
    if not row["server"].get("enable_elastic_kv"):
        return None
    args = list(row["server"].get("extra_args") or [])
    given = next((a.split("=", 1)[1] for a in args if a.startswith("--elastic-kv-mode=")), None)
    if given is None and "--elastic-kv-mode" in args[:-1]:
        given = args[args.index("--elastic-kv-mode") + 1]
    return ((row.get("facts") or {}).get("sglang_elastic") or {}).get("mode") or given or "dynamic"


def _reclaims_note(w: Dict[str, Any]) -> str:
    """The workload's reclaims on TP rank 0, from the events the launcher
    collected (rows measured before it did: nothing). The first is the first
    after start-up, as the warm-up cycle leaves it: the client's warm-up
    request comes alone, with nothing lent, so in E1/E2's workload it is the
    first measured long prompt's."""
    rc = ((w.get("sglang_elastic_events") or {}).get("reclaim_ms")) or {}
    if not rc.get("n"):
        return ""
    return f"reclaims {rc['min']:.1f}–{rc['max']:.1f} ms (median {rc['median']:.1f}; the first {rc['first']:.1f})"


def _elastic_column(row: Dict[str, Any]) -> str:
    """E1's "elastic" column: no, yes (dynamic), or yes with the other mode."""
    mode = _elastic_mode(row)
    return "no" if mode is None else "yes" if mode == "dynamic" else f"yes ({mode})"


def _failure(err: str, max_chars: int = 160) -> str:
    """A failed row's error in one line: its first line, and when that does
    not say why (a launcher's "server exited ...; log tail:" from before it
    named the cause), the cause found in the log tail kept with it."""
    first = err.splitlines()[0] if err else "?"
    if first.endswith("; log tail:"):
        first = first[: -len("; log tail:")]
        cause = None if CAUSE in first else crash_cause("\n".join(err.splitlines()[1:]))  # the tail, not this line
        first += f"{CAUSE}{cause}" if cause else ""
    return shorten(first, max_chars)


def _err(row: Dict[str, Any]) -> str:
    if not row.get("ok"):
        err = row.get("error") or "?"
        if not_measured(row):  # never started (run.py --only / --resume, a start deadline, a cluster too small)
            need = re.search(r"needs (\d+) GPU", err) if err.startswith(TOO_BIG) else None
            return f"not measured yet: needs {need.group(1)} GPUs on one node" if need else "not measured yet"
        return "failed: " + _failure(err).replace("|", "/")
    n = sum(w.get("num_errors", 0) for w in row.get("workloads") or [])
    warm = next((x for x in map(_warmup_note, row.get("workloads") or []) if x), "")
    notes = [f"{n} request errors" if n else "", warm, "reused" if row.get("reused_from") else "", "" if client_current(row) else OLDER_CLIENT]
    if row.get("remeasure_error"):
        notes.append("measuring again failed: " + row["remeasure_error"].splitlines()[0][:80].replace("|", "/"))
    return "; ".join(x for x in notes if x)


def _lent_tokens(r: Dict[str, Any]) -> Optional[int]:
    """KV tokens a row's pool held lent during its workload: the smallest lend
    in its events (the one-step lend is cut to what is free, issue 22), 0
    when the events show no lend at all, or no events exist and the server
    said after the workload that lending was off with nothing lent (the
    H200's E2 ``elastic`` row at 00ea3e3); for rows recorded before the events kept ``lent_tokens``, the
    server's ``lendable_tokens``; None for a row that cannot lend."""
    f = r.get("facts") or {}
    el = f.get("sglang_elastic") or {}
    if el.get("lendable_tokens") is None or el.get("mode", "dynamic") == "off":
        return el.get("lent_tokens")
    w = _w(r)
    ev, after = w.get("sglang_elastic_events") or {}, w.get("sglang_elastic_after") or {}
    if "lent_tokens" in ev:
        return int(ev["lent_tokens"]["min"])
    if (ev and "lend_ms" not in ev) or (not ev and after.get("lending_disabled") and not after.get("lent_tokens")):
        return 0
    return None if el.get("lending_disabled") else el["lendable_tokens"]


# -- E1 ---------------------------------------------------------------------


def ttft_vs_chunk(d: Dict[str, Any]) -> Tuple[str, Callable]:
    rows = []
    for r in d["rows"]:
        f, w = r.get("facts") or {}, _w(r)
        t, itl = w.get("ttft_s") or {}, w.get("decode_itl_s") or {}
        kv = f.get("max_total_num_tokens")
        held = _lent_tokens(r)
        lent = (kv + held) if kv and held else None
        after = w.get("sglang_elastic_after") or {}
        note = _err(r)
        if after.get("cycles") is not None:
            note = (note + "; " if note else "") + f"{after['cycles']} lend/reclaim cycles"
        note = "; ".join(x for x in (note, _reclaims_note(w)) if x)
        rows.append([r["label"], _n((f.get("chunked_prefill_size") or r["server"].get("chunked_prefill_size"))), _elastic_column(r), _n(kv), _n(lent) if lent else "", _s(t.get("median")), _s(t.get("p99")), _ms(itl.get("median")), _ms(itl.get("p99")), _ms(itl.get("max")), _pct((w.get("client") or {}).get("cpu_share")), note])
    md = _table(["row", "chunked_prefill_size", "elastic", "max_total_num_tokens", "KV tokens while lent", "long TTFT median s", "long TTFT p99 s", "decode ITL median ms", "ITL p99 ms", "ITL max ms", "client CPU", "notes"], rows)

    def plot(ax_fig):
        fig, ax = ax_fig
        pts = [(r, (r.get("facts") or {}).get("chunked_prefill_size") or r["server"].get("chunked_prefill_size")) for r in d["rows"] if r.get("ok")]
        stock = sorted((c, _w(r)["ttft_s"]) for r, c in pts if c and not r["server"].get("enable_elastic_kv") and _w(r).get("ttft_s", {}).get("median") is not None)
        if stock:
            ax.plot([c for c, _ in stock], [t["median"] for _, t in stock], "o-", label="TTFT median")
            ax.plot([c for c, _ in stock], [t["p99"] for _, t in stock], "s--", label="TTFT p99")
        for r, c in pts:
            t = _w(r).get("ttft_s") or {}
            mode = _elastic_mode(r)
            if mode is not None and t.get("median") is not None:
                ax.plot([c], [t["median"]], "r*" if mode == "dynamic" else "mX", ms=12, label=f"elastic median ({r['label']}, {mode})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("--chunked-prefill-size (tokens)")
        ax.set_ylabel("TTFT of the long prompts (s)")
        ax2 = ax.twinx()
        kv = sorted((c, (r.get("facts") or {}).get("max_total_num_tokens")) for r, c in pts if c and not r["server"].get("enable_elastic_kv") and (r.get("facts") or {}).get("max_total_num_tokens"))
        if kv:
            ax2.plot([c for c, _ in kv], [k for _, k in kv], "g^:", label="max_total_num_tokens")
        ax2.set_ylabel("KV tokens (max_total_num_tokens)")
        ax.legend(loc="upper left", fontsize=8)
        ax2.legend(loc="upper right", fontsize=8)
        ax.set_title("E1: long-prompt TTFT and KV capacity vs chunked prefill size")

    return md, plot


# -- E2 ---------------------------------------------------------------------


def placement(a: Dict[str, Any], b: Dict[str, Any]) -> Optional[str]:
    """Where row ``a`` ran against row ``b`` (the launcher's ``host``):
    ``same GPU`` (same GPU UUIDs, or the same Ray GPU ids on the same host
    where there is no nvidia-smi), ``same host`` (the node's GPU UUIDs, or its
    hostname without them), ``other host``; None when either row predates
    the record. H200s of one model differ by about 1 % in TTFT, as much as
    E2's tolerance, so an equal-TTFT verdict across GPUs is weak."""
    ha, hb = a.get("host") or {}, b.get("host") or {}
    if not ha or not hb:
        return None

    def node(h):
        return tuple(h.get("node_gpu_uuids") or ()) or h.get("hostname")

    if node(ha) != node(hb):
        return "other host"
    ga, gb = tuple(ha.get("gpu_uuids") or ha.get("gpu_ids") or ()), tuple(hb.get("gpu_uuids") or hb.get("gpu_ids") or ())
    return "same GPU" if ga and ga == gb else "same host"


def capacity_rows(d: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per row: KV tokens (plus lent tokens when the server reports them), TTFT
    deltas against the baseline and whether both are within the tolerance."""
    cfg = d["config"]
    tol = cfg.get("ttft_tolerance", 0.01)
    base = next((r for r in d["rows"] if r["label"] == cfg.get("baseline")), None)
    bt = (_w(base).get("ttft_s") or {}) if base else {}
    out = []
    for r in d["rows"]:
        f, t = r.get("facts") or {}, _w(r).get("ttft_s") or {}
        lent = _lent_tokens(r)  # capacity while lent
        kv = f.get("max_total_num_tokens")
        dm = (t["median"] / bt["median"] - 1) if t.get("median") and bt.get("median") else None
        dp = (t["p99"] / bt["p99"] - 1) if t.get("p99") and bt.get("p99") else None
        out.append({"row": r, "kv_tokens": kv, "lent_tokens": lent, "total": (kv or 0) + (lent or 0) if kv else None, "d_median": dm, "d_p99": dp, "equal_ttft": dm is not None and dp is not None and abs(dm) <= tol and abs(dp) <= tol,
                    "within_budget": dm is not None and dp is not None and dm <= tol and dp <= tol, "placement": placement(r, base) if base else None})
    base_total = next((x["total"] for x in out if x["row"] is base), None)
    for x in out:
        x["vs_baseline"] = (x["total"] / base_total - 1) if x["total"] and base_total else None
    return out


def capacity(d: Dict[str, Any]) -> Tuple[str, Callable]:
    tol = d["config"].get("ttft_tolerance", 0.01)
    cr = capacity_rows(d)
    best: Dict[str, Dict[str, Any]] = {}
    for x in cr:
        g = x["row"].get("group") or x["row"]["label"]
        if x["equal_ttft"] and x["total"] and (g not in best or x["total"] > best[g]["total"]):
            best[g] = x
    rows = [[x["row"]["label"], x["row"].get("group") or "", _n(x["kv_tokens"]), _n(x["lent_tokens"]), _pct(x["vs_baseline"]), _pct(x["d_median"]), _pct(x["d_p99"]), ("yes" if x["equal_ttft"] else "no") + (" (best of group)" if best.get(x["row"].get("group") or x["row"]["label"]) is x and x["row"].get("group") else ""), "yes" if x["within_budget"] else "no", x["placement"] or "not recorded", "; ".join(y for y in (_err(x["row"]), _reclaims_note(_w(x["row"]))) if y)] for x in cr]
    md = _table(["row", "group", "KV tokens", "lent tokens", "capacity vs baseline", "TTFT median vs baseline", "TTFT p99 vs baseline", f"equal TTFT (±{tol:.0%})", f"TTFT no worse (≤ +{tol:.0%})", "ran where the baseline ran", "notes"], rows)

    def plot(ax_fig):
        fig, ax = ax_fig
        xs = [x for x in cr if x["total"]]
        ax.bar(range(len(xs)), [x["kv_tokens"] for x in xs], color=["tab:green" if x["equal_ttft"] else "tab:gray" for x in xs], label="KV tokens")
        ax.bar(range(len(xs)), [x["lent_tokens"] or 0 for x in xs], bottom=[x["kv_tokens"] for x in xs], color="tab:orange", label="lent tokens")
        ax.set_xticks(range(len(xs)), [x["row"]["label"] for x in xs], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("KV tokens")
        ax.set_title(f"E2: KV capacity (green: TTFT median and p99 within ±{tol:.0%} of the baseline)")
        ax.legend(fontsize=8)

    return md, plot


# -- E3 ---------------------------------------------------------------------


def reserve_vs_tp(d: Dict[str, Any]) -> Tuple[str, Callable]:
    rows = []
    for r in d["rows"]:
        f = r.get("facts") or {}
        rows.append([r["server"]["model"], str(r["server"]["tp"]), _n(r["server"].get("chunked_prefill_size")), _n(f.get("mem_fraction_static")), _n(f.get("reserve_gib"), "{:.2f}"), _pct(f.get("reserve_fraction_of_hbm")), _pct(f.get("reserve_fraction_of_kv_pool")), _n(f.get("free_after_graphs_gib"), "{:.2f}"), _n(f.get("max_total_num_tokens")), _err(r)])
    md = _table(["model", "TP", "chunk", "mem_fraction_static", "reserve GiB/GPU", "reserve / HBM", "reserve / KV pool", "free after graphs GiB", "max_total_num_tokens", "notes"], rows)
    md += "\n\nThe advisor's predictions for these rows, each from a fit without the row: the advisor table below.\n"

    def plot(ax_fig):
        fig, ax = ax_fig
        models = sorted({r["server"]["model"] for r in d["rows"]})
        chunk = ((d.get("config") or {}).get("server_defaults") or {}).get("chunked_prefill_size")
        for i, m in enumerate(models):  # one colour per model; rows at another chunk size are in the table only
            pts = sorted((r["server"]["tp"], r["facts"]) for r in d["rows"] if r["server"]["model"] == m and r.get("ok") and r.get("facts")
                         and (chunk is None or r["server"].get("chunked_prefill_size") == chunk))
            pts = [(tp, f) for tp, f in pts if f.get("reserve_fraction_of_hbm") is not None]
            if pts:
                c = f"C{i}"
                ax.plot([tp for tp, _ in pts], [100 * f["reserve_fraction_of_hbm"] for _, f in pts], "o-", color=c, markersize=8 - 2 * i, label=f"{m}: / HBM")
                ax.plot([tp for tp, _ in pts], [100 * (f.get("reserve_fraction_of_kv_pool") or 0) for _, f in pts], "s--", color=c, label=f"{m}: / KV pool")
        ax.set_xscale("log", base=2)
        tps = sorted({r["server"]["tp"] for r in d["rows"] if r.get("ok")})
        ax.set_xticks(tps, [str(t) for t in tps])  # 1, 2, 4, 8 rather than 2^0, 2^1
        ax.minorticks_off()
        ax.set_xlabel("TP")
        ax.set_ylabel("reserve (%)")
        ax.set_title("E3: SGLang's prefill reserve per GPU vs TP")
        ax.legend(fontsize=7)

    return md, plot


# -- E4 ---------------------------------------------------------------------


def decode_fraction(d: Dict[str, Any]) -> Tuple[str, Callable]:
    rows = []
    mixes = []
    for r in d["rows"]:
        for w in r.get("workloads") or []:
            cfg = w.get("workload") or {}
            mixes.append((f"{r['label']}/{w.get('name')}", w))
            rows.append([r["label"], str(w.get("name")), _n(cfg.get("num_requests")), _n(cfg.get("request_rate"), "{:g}"), _n(w.get("wall_s"), "{:.1f}"), _pct(w.get("decode_only_fraction")), _pct(w.get("prefill_s") / w["wall_s"] if w.get("wall_s") else None), _pct(w.get("idle_s") / w["wall_s"] if w.get("wall_s") else None), _s((w.get("ttft_s") or {}).get("median")), _ms((w.get("itl_s") or {}).get("median")), _workload_note(w)])
        if not r.get("ok"):
            rows.append([r["label"], "–", "–", "–", "–", "–", "–", "–", "–", "–", _err(r)])
    md = _table(["server", "mix", "requests", "rate req/s", "wall s", "decode-only", "prefill pending", "idle", "TTFT median s", "ITL median ms", "notes"], rows)

    def plot(ax_fig):
        fig, ax = ax_fig
        names = [n for n, _ in mixes]
        parts = [("decode_only_s", "decode-only", "tab:green"), ("prefill_s", "prefill pending", "tab:red"), ("idle_s", "idle", "tab:gray")]
        bottom = [0.0] * len(mixes)
        for key, lab, col in parts:
            vals = [100 * w.get(key, 0) / w["wall_s"] if w.get("wall_s") else 0 for _, w in mixes]
            ax.bar(range(len(mixes)), vals, bottom=bottom, label=lab, color=col)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(mixes)), names, fontsize=8)
        ax.set_ylabel("share of wall time (%)")
        ax.set_title("E4: time with only decodes running (the reserve is lendable)")
        ax.legend(fontsize=8)

    return md, plot


# -- advisor ----------------------------------------------------------------


def advisor(d: Dict[str, Any]) -> Tuple[str, None]:
    rows = []

    def err(k, m, pr):  # signed relative error of the prediction, where both exist
        if not m.get(k) or pr.get(k) is None:
            return "–"
        e = round(100 * (pr[k] - m[k]) / m[k], 2)
        return f"{e:+.2f}%" if e else "0.00%"

    for p in d["points"]:
        m, pr = p["measured"], p["predicted"]
        if "post_capture_kv_tokens" in m:  # SGLang's post-capture sizing: its own fraction and pool, nothing lent
            pr = {"mem_fraction_static": pr.get("post_capture_mem_fraction_static"), "post_capture_kv_tokens": pr.get("post_capture_kv_tokens"),
                  "recommendation": pr.get("recommendation")}
        rows.append([p["label"], str(p["tp"]), _n(m.get("mem_fraction_static")), _n(pr.get("mem_fraction_static")), _n(m.get("max_total_num_tokens")), _n(pr.get("max_total_num_tokens")), err("max_total_num_tokens", m, pr),
                     _n(m.get("free_after_graphs_gib"), "{:.2f}"), _n(pr.get("free_after_graphs_gib"), "{:.2f}"), err("free_after_graphs_gib", m, pr),
                     _n(m.get("extra_kv_tokens")), _n(pr.get("extra_kv_tokens")), err("extra_kv_tokens", m, pr),
                     _n(m.get("post_capture_kv_tokens")), _n(pr.get("post_capture_kv_tokens")), err("post_capture_kv_tokens", m, pr),
                     pr.get("recommendation", "–"), p.get("source", "")])
    md = _table(["measured point", "TP", "mem_fraction_static measured", "predicted", "max_total_num_tokens measured", "predicted", "error", "free after graphs GiB measured", "predicted", "error",
                 "extra KV tokens (lent) measured", "predicted", "error", "post-capture KV tokens measured", "predicted", "error", "recommendation", "source"], rows)
    return md, None


RENDER = {"ttft_vs_chunk": ttft_vs_chunk, "ttft_vs_chunk_tp2": ttft_vs_chunk, "capacity": capacity, "capacity_tp2": capacity, "capacity_issue22": capacity, "ttft_vs_chunk_70b_tp4": ttft_vs_chunk, "capacity_70b_tp4": capacity, "reserve_vs_tp": reserve_vs_tp, "decode_fraction": decode_fraction, "advisor": advisor}


def _save_plot(plot: Callable, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    plot((fig, ax))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    buf.seek(0)
    quantize_png(buf, path)


def quantize_png(src, path: Path) -> None:
    """Write the PNG ``src`` (a path or file) to ``path`` as 64 colours, no
    dithering, no metadata (no matplotlib version: the PNG depends on the JSON
    only): a plot loses nothing visible and a quarter of the bytes stays (the
    tracked tree must leave room for the GPU bundle in one device transfer)."""
    from PIL import Image

    with Image.open(src) as im:
        im.convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, format="PNG", optimize=True)


def render_block(name: str, results_dir: Path, root: Path, doc_dir: Path, suffix: str = "") -> str:
    """One ``<!-- eval:NAME -->`` block (header line, table, plot) from
    ``results_dir/NAME{suffix}.json``; the plot goes to ``NAME{suffix}.png``
    beside it, linked relative to ``doc_dir``, the folder of the Markdown
    file that holds the block."""
    path = results_dir / f"{name}{suffix}.json"
    if not path.is_file():
        return f"Not measured yet: `{RUN[name]}` writes `{path.relative_to(root) if path.is_relative_to(root) else path}`."
    d = json.loads(path.read_text())
    d["_path"] = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
    md, plot = RENDER[name](d)
    png = None
    if plot is not None:
        png_path = results_dir / f"{name}{suffix}.png"
        _save_plot(plot, png_path)
        png = png_path.relative_to(root).as_posix() if png_path.is_relative_to(root) else str(png_path)
    return _header_line(d, png) + "\n\n" + md + (f"\n\n![{name}]({Path(os.path.relpath(png_path, doc_dir)).as_posix()})" if png else "")


def render_standin(out: Path, results_dir: Path, root: Path) -> List[str]:
    """The tables and plots of the CPU dry runs (``run.py --standin``:
    ``NAME.standin.json``) in one Markdown file ``out``, marked as not
    measurements; returns the names rendered (none: no dry run yet)."""
    done = [name for name in BLOCKS if (results_dir / f"{name}.standin.json").is_file()]
    parts = ["# Evaluation dry runs (CPU stand-in, not measurements)", "",
             "Written by `python scripts/eval/report.py --standin` from `run.py --standin` results: the stand-in server's timing "
             "model, not SGLang; they check configs, launcher and workloads (docs/eval.md)."]
    for name in done:
        parts += ["", f"## {name}", "", render_block(name, results_dir, root, out.parent, suffix=".standin")]
    out.write_text("\n".join(parts) + "\n")
    return done


def render_doc(doc: Path, results_dir: Path, root: Path) -> List[str]:
    """Rewrite every ``<!-- eval:NAME -->`` block of ``doc``; returns the names rendered."""
    text = doc.read_text()
    done = []
    for name in BLOCKS:
        pat = re.compile(rf"(<!-- eval:{name} -->\n)(.*?)(<!-- /eval:{name} -->)", re.S)
        if pat.search(text):
            body = render_block(name, results_dir, root, doc.parent)
            text = pat.sub(lambda m: m.group(1) + body + "\n" + m.group(3), text)
            done.append(name)
    doc.write_text(text)
    return done
