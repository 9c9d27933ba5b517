"""Tables and plots regenerate from result JSON alone (fixtures in tests/fixtures/eval)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

from sglang_elastic.eval import report

FIX = Path(__file__).parent / "fixtures" / "eval"


def _doc(tmp_path: Path) -> Path:
    res = tmp_path / "docs" / "results" / "eval"
    res.mkdir(parents=True)
    for p in FIX.glob("*.json"):
        shutil.copy(p, res / p.name)
    doc = tmp_path / "docs" / "eval.md"
    doc.write_text("# Eval\n\nprose stays\n\n" + "".join(f"<!-- eval:{n} -->\nold\n<!-- /eval:{n} -->\n\n" for n in report.BLOCKS) + "tail stays\n")
    return doc


def _png_size(p: Path):
    head = p.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def _table_rows(text: str, block: str):
    body = text.split(f"<!-- eval:{block} -->")[1].split(f"<!-- /eval:{block} -->")[0]
    return [[c.strip() for c in line.strip("|").split("|")] for line in body.splitlines() if line.startswith("| ") and not line.startswith("| row") and not line.startswith("| model") and not line.startswith("| server") and not line.startswith("| measured")]


def test_every_block_is_rendered_from_the_json_and_the_prose_is_kept(tmp_path):
    doc = _doc(tmp_path)
    done = report.render_doc(doc, doc.parent / "results" / "eval", tmp_path)
    text = doc.read_text()
    assert done == list(report.BLOCKS)
    assert "prose stays" in text and text.endswith("tail stays\n") and "\nold\n" not in text
    # the advisor JSON is absent from the fixtures: the block says how to make it
    assert "Not measured yet: `python scripts/eval/advisor_points.py`" in text
    for name in ("ttft_vs_chunk", "capacity", "reserve_vs_tp", "decode_fraction"):
        png = doc.parent / "results" / "eval" / f"{name}.png"
        assert _png_size(png) == (800, 450)
        assert f"![{name}](results/eval/{name}.png)" in text


def test_e1_table_values(tmp_path):
    doc = _doc(tmp_path)
    report.render_doc(doc, doc.parent / "results" / "eval", tmp_path)
    rows = _table_rows(doc.read_text(), "ttft_vs_chunk")
    assert rows[0] == ["chunk-2048", "2,048", "no", "935,667", "", "2.100", "2.300", "11.0", "50.0", "80.0", "25.0 %", ""]
    assert rows[3][0] == "elastic-32768" and rows[3][2] == "yes" and rows[3][-1].startswith("failed: RuntimeError: server exited with status 1")
    assert "`docs/results/eval/ttft_vs_chunk.json` (2026-11-30, NVIDIA H200, 143771 MiB, 580.159.04, commit 0123456)" in doc.read_text()


def test_e1_elastic_column_names_a_mode_other_than_dynamic():
    stock = {"server": {"enable_elastic_kv": False}}
    dynamic = {"server": {"enable_elastic_kv": True}, "facts": {"sglang_elastic": {"mode": "dynamic"}}}
    given = {"server": {"enable_elastic_kv": True, "extra_args": ["--elastic-kv-mode", "always-lent"]}}  # not measured yet
    given_eq = {"server": {"enable_elastic_kv": True, "extra_args": ["--elastic-kv-mode=off"]}}
    reported = {"server": {"enable_elastic_kv": True, "extra_args": ["--elastic-kv-mode", "off"]}, "facts": {"sglang_elastic": {"mode": "always-lent"}}}
    assert [report._elastic_column(r) for r in (stock, dynamic, given, given_eq, reported)] == \
        ["no", "yes", "yes (always-lent)", "yes (off)", "yes (always-lent)"]


def test_e1_table_from_the_committed_h200_result():
    """The committed H200 run: the elastic row's capacity while lent is its base
    plus the lendable tokens /server_info reported (610,724 + 336,896)."""
    d = json.loads((Path(__file__).parents[1] / "docs/results/eval/ttft_vs_chunk.json").read_text())
    md, _ = report.ttft_vs_chunk(d)
    rows = {r[0]: r for r in _table_rows("<!-- eval:x -->\n" + md + "\n<!-- /eval:x -->", "x")}
    assert rows["elastic-32768"][3:5] == ["610,724", "947,620"]
    assert rows["chunk-8192"][3:5] == ["906,056", ""]


def test_e2_equal_ttft_and_capacity_against_the_baseline(tmp_path):
    d = json.loads((FIX / "capacity.json").read_text())
    cr = {x["row"]["label"]: x for x in report.capacity_rows(d)}
    assert cr["stock"]["equal_ttft"] and cr["stock"]["vs_baseline"] == 0
    assert not cr["small-chunk-2048"]["equal_ttft"]  # +5 % TTFT
    assert cr["mfs-0.92"]["equal_ttft"] and abs(cr["mfs-0.92"]["d_p99"] - (2.221 / 2.2 - 1)) < 1e-12
    assert cr["elastic"]["total"] == 906051 + 65536 and abs(cr["elastic"]["vs_baseline"] - 65536 / 906051) < 1e-12
    assert cr["mfs-0.93"]["total"] is None and not cr["mfs-0.93"]["equal_ttft"]
    doc = _doc(tmp_path)
    report.render_doc(doc, doc.parent / "results" / "eval", tmp_path)
    rows = {r[0]: r for r in _table_rows(doc.read_text(), "capacity")}
    assert rows["mfs-0.92"][7] == "yes (best of group)" and rows["mfs-0.91"][7] == "yes"
    assert rows["small-chunk-2048"][7:9] == ["no", "no"]  # +5 % TTFT: neither equal nor within budget
    assert cr["small-chunk-2048"]["within_budget"] is False and cr["stock"]["within_budget"] is True
    assert rows["elastic"][2:5] == ["906,051", "65,536", "7.2 %"]


def test_e3_and_e4_tables(tmp_path):
    doc = _doc(tmp_path)
    report.render_doc(doc, doc.parent / "results" / "eval", tmp_path)
    text = doc.read_text()
    e3 = _table_rows(text, "reserve_vs_tp")
    # reserve = (kv + weights) / mfs * (1 - mfs): (110.6 + 14.96) / 0.903 * 0.097 = 13.49 GiB, 9.6 % of 140.4 GiB, 12.2 % of the pool
    assert e3[0][:9] == ["llama-3.1-8b", "1", "8,192", "0.903", "13.49", "9.6 %", "12.2 %", "9.02", "906,051"]
    e4 = _table_rows(text, "decode_fraction")
    assert e4[0][:8] == ["llama-8b-stock", "chat", "400", "8", "80.0", "25.0 %", "70.0 %", "5.0 %"]
    assert e4[1][1] == "long-context" and e4[1][5] == "60.0 %" and e4[0][10] == ""
    assert report._workload_note({"num_errors": 3}) == "3 request errors; cumulative streaming (older client)"


def test_rendering_twice_gives_the_same_files(tmp_path):
    doc = _doc(tmp_path)
    report.render_doc(doc, doc.parent / "results" / "eval", tmp_path)
    first = doc.read_text(), (doc.parent / "results" / "eval" / "capacity.png").read_bytes()
    report.render_doc(doc, doc.parent / "results" / "eval", tmp_path)
    assert (doc.read_text(), (doc.parent / "results" / "eval" / "capacity.png").read_bytes()) == first


def test_a_faster_row_is_within_the_ttft_budget_but_not_equal():
    def row(label, med, p99, kv):
        return {"label": label, "group": label, "ok": True, "server": {}, "facts": {"max_total_num_tokens": kv},
                "workloads": [{"ttft_s": {"median": med, "p99": p99}}]}

    d = {"config": {"baseline": "stock", "ttft_tolerance": 0.01},
         "rows": [row("stock", 1.0, 1.1, 906056), row("fast", 0.85, 1.0, 610724), row("slow", 1.02, 1.1, 935704)]}
    cr = {x["row"]["label"]: x for x in report.capacity_rows(d)}
    assert (cr["fast"]["equal_ttft"], cr["fast"]["within_budget"]) == (False, True)
    assert (cr["slow"]["equal_ttft"], cr["slow"]["within_budget"]) == (False, False)
    assert cr["slow"]["placement"] is None  # rows measured before the launcher recorded hosts


def test_e2_says_whether_a_row_ran_on_the_baselines_gpu():
    node = ["GPU-1", "GPU-2"]
    on1 = {"host": {"hostname": "h", "node_gpu_uuids": node, "gpu_ids": ["0"], "gpu_uuids": ["GPU-1"]}}
    on2 = {"host": {"hostname": "h", "node_gpu_uuids": node, "gpu_ids": ["1"], "gpu_uuids": ["GPU-2"]}}
    elsewhere = {"host": {"hostname": "h", "node_gpu_uuids": ["GPU-3"], "gpu_ids": ["0"], "gpu_uuids": ["GPU-3"]}}  # a container's hostname repeats: the GPUs decide
    assert report.placement(on1, dict(on1)) == "same GPU" and report.placement(on1, on2) == "same host" and report.placement(on1, elsewhere) == "other host"
    cpu = {"host": {"hostname": "x", "node_gpu_uuids": [], "gpu_ids": ["0"], "gpu_uuids": []}}  # no nvidia-smi: hostname and Ray's ids
    assert report.placement(cpu, dict(cpu)) == "same GPU" and report.placement(cpu, {"host": {**cpu["host"], "gpu_ids": ["1"]}}) == "same host"
    assert report.placement(on1, {"host": None}) is None and report.placement({}, on1) is None

    def row(label, host):
        return {"label": label, "group": label, "ok": True, "server": {}, "host": host, "facts": {"max_total_num_tokens": 1000},
                "workloads": [{"ttft_s": {"median": 1.0, "p99": 1.0}}]}

    d = {"date": "d", "gpu": "g", "commit": "c", "command": "x", "config": {"baseline": "stock"},
         "rows": [row("stock", on1["host"]), row("here", on1["host"]), row("beside", on2["host"]), row("there", elsewhere["host"]), row("old", None)]}
    md, _ = report.capacity(d)
    rows = {r[0]: r for r in _table_rows("<!-- eval:x -->\n" + md + "\n<!-- /eval:x -->", "x")}
    assert [rows[k][9] for k in ("stock", "here", "beside", "there", "old")] == ["same GPU", "same GPU", "same host", "other host", "not recorded"]


def test_a_row_never_started_reads_not_measured_yet_and_a_failure_keeps_its_reason():
    assert report._err({"ok": False, "error": "not run (not in --only, no earlier row of the same server and workloads)"}) == "not measured yet"
    assert report._err({"ok": False, "error": "RuntimeError: server exited with status 1 | x\nmore"}) == "failed: RuntimeError: server exited with status 1 / x"
    too_big = "not run (cluster too small): qwen-32b-tp8 needs 8 GPU(s) on one node; the largest node in the cluster has 2"
    assert report._err({"ok": False, "error": too_big}) == "not measured yet: needs 8 GPUs on one node"
    new_client = {"streaming": "incremental", "cpu_share": 0.2}
    oom = {"input_len": 25000, "ttft_s": None, "error": "HTTP 500: CUDA out of memory | more\nlines"}
    assert report._err({"ok": True, "workloads": [{"num_errors": 0, "client": new_client, "warmup": oom}]}) == "warm-up failed: HTTP 500: CUDA out of memory / more"
    assert report._workload_note({"num_errors": 1, "client": new_client, "warmup": oom}) == "1 request errors; warm-up failed: HTTP 500: CUDA out of memory / more"
    assert report._err({"ok": True, "workloads": [{"num_errors": 0, "client": new_client, "warmup": {**oom, "error": None}}]}) == ""
    assert report._err({"ok": True, "workloads": [{"num_errors": 2, "client": new_client}]}) == "2 request errors"
    assert report._err({"ok": True, "workloads": [{"num_errors": 0, "client": new_client}], "reused_from": "x.json#a"}) == "reused"
    # a row the older client measured (cumulative streaming) says so until it is measured again; E3's facts-only rows never do
    assert report._err({"ok": True, "workloads": [{"num_errors": 2}]}) == "2 request errors; cumulative streaming (older client)"
    assert report._err({"ok": True, "workloads": []}) == ""


def test_a_failed_row_of_an_older_launcher_reads_the_cause_from_its_log_tail():
    """E2 TP 2's out-of-memory row was written before the launcher put the
    cause on the error's first line: the table finds it in the kept tail.
    A first line that already names it is left as it is."""
    tail = ("RuntimeError: server exited with status -9 during the warm-up request; log tail:\n  File \"x\", line 3\n"
            "\x1b[36m(SchedulerActor pid=8194)\x1b[0m [2026-11-30 21:14:39 DP0 TP1] Scheduler PP0 TP1 crashed: CUDA out of memory. Tried to allocate 98.00 MiB.\n"
            "[2026-11-30 21:14:44] kill_process_tree called\n")
    assert report._err({"ok": False, "error": tail}) == (
        "failed: RuntimeError: server exited with status -9 during the warm-up request; cause: CUDA out of memory. Tried to allocate 98.00 MiB.")
    named = "RuntimeError: server exited with status 4 during the workload (2 failed requests); cause: boom; log tail:\nScheduler PP0 TP0 crashed: other\n"
    assert report._err({"ok": False, "error": named}) == "failed: RuntimeError: server exited with status 4 during the workload (2 failed requests); cause: boom"
    assert report._err({"ok": False, "error": "RuntimeError: server exited with status 1; log tail:\nnothing here\n"}) == "failed: RuntimeError: server exited with status 1"


def test_the_dry_runs_render_into_their_own_file_and_leave_the_measurements_alone(tmp_path):
    """report.py --standin: the *.standin.json of a dry run become tables
    and *.standin.png in one file marked as not measurements; the measured
    JSON, their plots and docs/eval.md are not touched."""
    import subprocess
    import sys

    doc = _doc(tmp_path)
    res = doc.parent / "results" / "eval"
    before = doc.read_text()
    src = json.loads((FIX / "capacity.json").read_text())
    (res / "capacity.standin.json").write_text(json.dumps({**src, "standin": True}))
    out = tmp_path / "standin.md"
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "scripts/eval/report.py"), "--standin", "--results-dir", str(res), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == f"{out}: capacity", r.stdout + r.stderr[-2000:]
    text = out.read_text()
    assert text.startswith("# Evaluation dry runs (CPU stand-in, not measurements)") and "## capacity" in text and "## ttft_vs_chunk" not in text
    assert "capacity.standin.json" in text and "](docs/results/eval/capacity.standin.png)" in text  # the plot linked relative to the file
    rows = [l for l in text.splitlines() if l.startswith("| ") and not l.startswith("| row")]
    assert len(rows) == len(src["rows"]) and _png_size(res / "capacity.standin.png")[0] > 0
    assert doc.read_text() == before and not (res / "capacity.png").exists()
    # no dry run yet: said so, an empty file
    (res / "capacity.standin.json").unlink()
    r = subprocess.run([sys.executable, str(root / "scripts/eval/report.py"), "--standin", "--results-dir", str(res), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "no *.standin.json in" in r.stdout


def test_e2_counts_what_the_pool_lent_not_what_it_measured_at_start_up():
    """Issue 22 on the H200: the E2 ``elastic`` row at 00ea3e3 lent nothing (lending
    went off), yet its start-up facts said 65,536 lendable tokens; since then the
    one-step lend is cut to what is free (64,512 there). The capacity while lent is
    the smallest lend in the row's events, 0 when nothing was lent."""
    def row(label, ev=None, after=None, facts_el=None):
        w = {"ttft_s": {"median": 1.0, "p99": 1.0}, "sglang_elastic_events": ev, "sglang_elastic_after": after}
        f = {"max_total_num_tokens": 906057, **({"sglang_elastic": facts_el} if facts_el else {})}
        return {"label": label, "group": label, "ok": True, "server": {}, "facts": f, "workloads": [w]}

    el = {"mode": "dynamic", "lendable_tokens": 65536, "lent_tokens": 0, "lending_disabled": False}
    lends = {"source": "x", "lend_ms": {"n": 3}, "lent_tokens": {"min": 64512, "max": 65536, "n": 3}}
    d = {"config": {"baseline": "stock", "ttft_tolerance": 0.01},
         "rows": [row("stock"), row("cut", lends, facts_el=el), row("dead", None, {**el, "lending_disabled": True}, el),
                  row("no-lend", {"source": "x", "reclaims_skipped": 0}, facts_el=el), row("older", {"source": "x", "lend_ms": {"n": 2}}, facts_el=el)]}
    cr = {x["row"]["label"]: x["lent_tokens"] for x in report.capacity_rows(d)}
    assert cr == {"stock": None, "cut": 64512, "dead": 0, "no-lend": 0, "older": 65536}
