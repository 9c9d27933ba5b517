"""Experiment configs: every shipped config validates; bad ones fail with one message naming the field."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from sglang_elastic.eval import config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "scripts/eval/configs").glob("*.yaml"))
E1 = {
    "experiment": "ttft_vs_chunk",
    "server_defaults": {"model": "llama-3.1-8b", "tp": 1},
    "servers": [{"label": "chunk-2048", "chunked_prefill_size": 2048}, {"label": "elastic", "enable_elastic_kv": True}],
    "workloads": [{"kind": "decode_then_long", "decodes": 40, "long_prompts": 6, "long_input_len": 25000}],
}


def test_every_shipped_config_validates_and_covers_the_four_experiments():
    exps = {config.load(p).experiment for p in CONFIGS}
    assert exps == set(config.EXPERIMENTS)


def test_server_defaults_merge_and_flags_follow_the_fields():
    e = config.parse(E1)
    s = e.servers[1]
    assert (s.model, s.tp, s.enable_elastic_kv) == ("llama-3.1-8b", 1, True)
    assert e.servers[0].launch_flags() == ["--tp-size", "1", "--chunked-prefill-size", "2048"]
    assert s.launch_flags() == ["--tp-size", "1", "--enable-elastic-kv"]
    assert e.result_name == "ttft_vs_chunk"


@pytest.mark.parametrize(
    "patch, needle",
    [
        ({"servers": [{"label": "a", "tp": 3}]}, "servers.0.tp: tp must be one of (1, 2, 4, 8), not 3"),
        ({"servers": [{"label": "a", "model": "gpt-5"}]}, "servers.0.model: unknown embedded model 'gpt-5'"),
        ({"servers": [{"label": "a"}, {"label": "a"}]}, "server labels must be unique: a"),
        ({"servers": [{"label": "a", "extra_args": ["--port", "1"]}]}, "launcher owns --host/--port/--use-ray"),
        ({"servers": [{"label": "a", "extra_args": ["--incremental-streaming-output"]}]}, "launcher owns --host/--port/--use-ray/--incremental-streaming-output"),
        ({"servers": [{"label": "a", "extra_args": ["--stream-output"]}]}, "--stream-output: set through the server's own fields"),
        ({"servers": [{"label": "a", "mem_fraction_static": 1.2}]}, "servers.0.mem_fraction_static: Input should be less than 1"),
        ({"servers": [{"label": "a", "chunked_prefill_size": 0}]}, "chunked_prefill_size must be positive"),
        ({"servers": [{"label": "a", "chunk": 2048}]}, "servers.0.chunk: Extra inputs are not permitted"),
        ({"workloads": []}, "ttft_vs_chunk needs exactly decode_then_long workloads, got none"),
        ({"workloads": [{"kind": "decode_then_long", "decodes": -1}]}, "decodes: Input should be greater than or equal to 0"),
        ({"experiment": "capacity"}, "capacity needs baseline"),
        ({"experiment": "reserve_vs_tp"}, "reserve_vs_tp reads server facts only: no workloads"),
        ({"experiment": "decode_fraction"}, "decode_fraction needs mix workloads"),
        ({"baseline": "nope"}, "baseline 'nope' is not a server label"),
        ({"experiment": "e9"}, "experiment: Input should be 'ttft_vs_chunk'"),
    ],
)
def test_bad_configs_are_refused_with_the_field_named(patch, needle):
    with pytest.raises(config.EvalConfigError) as ei:
        config.parse({**E1, **patch}, "e.yaml")
    msg = str(ei.value)
    assert msg.startswith("e.yaml: ") and needle in msg and "\n" not in msg


def test_bad_mix_distribution_and_bad_yaml(tmp_path):
    bad = {"experiment": "decode_fraction", "servers": [{"label": "a"}], "workloads": [{"kind": "mix", "name": "chat", "num_requests": 5, "request_rate": 1, "input_len": {"dist": "lognormal", "median": 512}, "output_len": {"dist": "fixed", "value": 8}}]}
    with pytest.raises(config.EvalConfigError, match=r"workloads\.0\.mix\.input_len: dist lognormal needs sigma, min, max"):
        config.parse(bad)
    p = tmp_path / "x.yaml"
    p.write_text("servers: [unclosed")
    with pytest.raises(config.EvalConfigError, match="x.yaml: not valid YAML at line 1, column 19: ") as e:
        config.load(p)
    assert "\n" not in str(e.value)  # one line (PyYAML's own message spans four)
    with pytest.raises(config.EvalConfigError, match="cannot read"):
        config.load(tmp_path / "missing.yaml")
    p.write_text("- a list\n")
    with pytest.raises(config.EvalConfigError, match="must be a mapping, not list"):
        config.load(p)


def test_length_distributions_stay_in_bounds_and_are_seeded():
    d = config.Dist(dist="lognormal", median=512, sigma=1.0, min=16, max=8192)
    xs = d.sample(random.Random(1), 4000)
    assert min(xs) >= 16 and max(xs) <= 8192
    assert 400 < sorted(xs)[2000] < 650  # the median is the configured one
    assert xs[:50] == d.sample(random.Random(1), 50)
    u = config.Dist(dist="uniform", min=8192, max=32768).sample(random.Random(2), 1000)
    assert min(u) >= 8192 and max(u) <= 32768 and max(u) - min(u) > 20000


def test_run_script_refuses_a_bad_config_with_one_line_and_status_2(tmp_path):
    import subprocess
    import sys

    p = tmp_path / "bad.yaml"
    p.write_text("experiment: ttft_vs_chunk\nservers: [{label: a, tp: 5}]\n")
    r = subprocess.run([sys.executable, str(ROOT / "scripts/eval/run.py"), str(p)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().count("\n") == 0 and "servers.0.tp: tp must be one of (1, 2, 4, 8), not 5" in r.stderr


def test_run_script_resume_starts_nothing_when_every_row_is_measured(tmp_path):
    import json
    import subprocess
    import sys

    from sglang_elastic.eval import config

    text = "experiment: reserve_vs_tp\nservers: [{label: a, tp: 1}, {label: b, tp: 2}]\n"
    p = tmp_path / "e.yaml"
    p.write_text(text)
    exp = config.load(p)
    out = tmp_path / "out"
    out.mkdir()
    rows = [{"label": s.label, "ok": True, "identity": s.identity(), "workloads": []} for s in exp.servers]
    (out / "reserve_vs_tp.json").write_text(json.dumps({"rows": rows}))
    cmd = [sys.executable, str(ROOT / "scripts/eval/run.py"), str(p), "--out-dir", str(out), "--resume", "--no-report"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "every row of" in r.stdout and "is measured" in r.stdout, r.stderr
    # with --only, --resume keeps to the named rows: here all measured too
    r = subprocess.run(cmd + ["--only", "b"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "is measured" in r.stdout, r.stderr


def test_run_script_names_asked_rows_a_start_deadline_left_unmeasured(tmp_path):
    """--only re-measures a row; when the call's start deadline passes first,
    no server starts: the file is left byte for byte as it was and the run
    exits 2 naming the rows (it once rewrote the header and exited 0); when
    another row does start, the summary line says the earlier result of the
    waiting one was kept (it once read as if the row had been measured again)."""
    import json
    import subprocess
    import sys

    from sglang_elastic.eval import config

    p = tmp_path / "e.yaml"
    p.write_text("experiment: reserve_vs_tp\nservers: [{label: a, tp: 1}, {label: b, tp: 1}]\n")
    exp = config.load(p)
    out = tmp_path / "out"
    out.mkdir()
    rows = [{"label": s.label, "ok": True, "identity": s.identity(), "workloads": [], "measured": {"date": "2026-11-29"}} for s in exp.servers]
    rows[1] = {**rows[1], "ok": False, "error": "RuntimeError: server exited with status -9 during the warm-up request: CUDA out of memory"}
    f = out / "reserve_vs_tp.standin.json"
    f.write_text(json.dumps({"date": "earlier", "rows": rows}))
    before = f.read_bytes()
    r = subprocess.run([sys.executable, str(ROOT / "scripts/eval/run.py"), str(p), "--out-dir", str(out), "--standin", "--num-gpus", "1",
                        "--only", "a", "--start-deadline-s", "0", "--no-report"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr[-3000:]
    assert "run.py: the start deadline passed before a could start\n" in r.stderr
    assert f"run.py: no server started, nothing measured: {f} left as they were\n" in r.stderr and r.stdout == ""
    assert f.read_bytes() == before and sorted(x.name for x in out.iterdir()) == [f.name]
    # a row that starts beside one no node can hold (TP 2 on one GPU): the
    # waiting row keeps its earlier result, named so; a failure the file held,
    # not run again (not in --only), is an earlier one and does not fail this run
    p.write_text("experiment: reserve_vs_tp\nservers: [{label: a, tp: 1}, {label: b, tp: 2}, {label: c, tp: 1}]\n")
    exp = config.load(p)
    rows = [{"label": s.label, "ok": True, "identity": s.identity(), "workloads": [], "measured": {"date": "2026-11-29"}} for s in exp.servers]
    rows[2] = {**rows[2], "ok": False, "error": "RuntimeError: server exited with status -9 during the warm-up request: CUDA out of memory"}
    f.write_text(json.dumps({"rows": rows}))
    r = subprocess.run([sys.executable, str(ROOT / "scripts/eval/run.py"), str(p), "--out-dir", str(out), "--standin", "--num-gpus", "1",
                        "--only", "a,b", "--no-report"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "failed: none; failed in an earlier run, not run again: c; not started this time, earlier result kept: b\n" in r.stdout, r.stdout
    assert "run.py: not run (cluster too small): b needs 2 GPU(s) on one node; the largest node in the cluster has 1" in r.stderr
    got = {x["label"]: x for x in json.loads(f.read_text())["rows"]}
    assert got["b"] == rows[1] and got["c"] == rows[2] and got["a"]["ok"] and got["a"]["measured"]["date"] != "2026-11-29"


def test_resume_skips_only_rows_measured_for_the_config_as_it_is():
    from sglang_elastic.eval import experiments

    exp = config.parse({"experiment": "reserve_vs_tp", "servers": [{"label": "a", "tp": 1}, {"label": "b", "tp": 2}, {"label": "c", "tp": 1}, {"label": "d", "tp": 1}]})
    a, b, c, d = exp.servers
    previous = {"rows": [
        {"label": "a", "ok": True, "identity": a.identity(), "workloads": []},
        {"label": "b", "ok": False, "identity": b.identity(), "error": "RuntimeError: server exited with status 1"},
        {"label": "c", "ok": True, "identity": {**c.identity(), "chunked_prefill_size": 1}, "workloads": []},  # the config changed since
        {"label": "d", "ok": False, "identity": d.identity(), "error": "not run (not in --only, ...)"},
    ]}
    assert experiments.measured_labels(exp, previous) == ["a"]
    # a failed row of the same server is kept (with its reason) when --only passes it by; a never-run one is not
    assert experiments.previous_row(exp, b, previous, ok_only=False)["error"].startswith("RuntimeError")
    assert experiments.previous_row(exp, d, previous, ok_only=False) is None
    assert experiments.previous_row(exp, c, previous, ok_only=False) is None


def test_rows_of_the_older_client_are_kept_but_measured_again():
    """A row whose workloads ran with cumulative streaming (no client marker)
    stays in the file until replaced, and --resume measures it again."""
    from sglang_elastic.eval import experiments

    exp = config.parse(E1)
    s = exp.servers[0]
    w = exp.workloads[0].model_dump(mode="json")
    new = {"label": s.label, "ok": True, "identity": s.identity(), "workloads": [{"workload": w, "client": {"streaming": "incremental", "cpu_share": 0.3}}]}
    old = {**new, "workloads": [{"workload": w}]}
    assert experiments.previous_row(exp, s, {"rows": [new]}) is new
    assert experiments.previous_row(exp, s, {"rows": [old]}) is None
    assert experiments.previous_row(exp, s, {"rows": [old]}, stale_ok=True) is old
    assert s.label in experiments.measured_labels(exp, {"rows": [new]}) and s.label not in experiments.measured_labels(exp, {"rows": [old]})


def test_a_row_once_copied_from_another_experiment_is_measured_again_when_the_config_measures_it():
    """E2's stock row was E1's (another host); the config now measures it:
    --resume runs it, and the copy stays in the file until then."""
    from sglang_elastic.eval import experiments

    exp = config.parse({**E1, "servers": [{"label": "stock", "chunked_prefill_size": 8192}, {"label": "copy", "chunked_prefill_size": 2048, "reuse": "ttft_vs_chunk/chunk-2048"}]})
    stock, copy = exp.servers
    w = [x.model_dump(mode="json") for x in exp.workloads]
    cur = {"streaming": "incremental", "cpu_share": 0.2}
    copied = {"label": "stock", "ok": True, "identity": stock.identity(), "workloads": [{"workload": x, "client": cur} for x in w], "reused_from": "docs/results/eval/ttft_vs_chunk.json#chunk-8192"}
    still = {**copied, "label": "copy", "identity": copy.identity()}
    prev = {"rows": [copied, still]}
    assert experiments.measured_labels(exp, prev) == ["copy"]  # a row the config still reuses counts
    assert experiments.previous_row(exp, stock, prev, stale_ok=True) is copied and experiments.previous_row(exp, stock, prev) is None
    assert experiments.measured_labels(exp, {"rows": [{**copied, "reused_from": None}, still]}) == ["stock", "copy"]


def test_run_script_without_gpus_leaves_every_file_as_it_was_and_exits_2(tmp_path):
    """Issue 21: a real (not --standin) run of E1 on a machine without a GPU,
    with the default output folder and the report on, rewrote the committed
    result's header (date, "gpu": "unknown", commit, command) and
    docs/eval.md's caption, and exited 0. In a copy of the repository's docs/
    and scripts/: every file stays byte for byte, status 2, each row's
    reason and the way out on stderr."""
    import os
    import shutil
    import subprocess
    import sys

    from conftest import snapshot

    repo = tmp_path / "repo"
    for d in ("docs", "scripts"):
        shutil.copytree(ROOT / d, repo / d, ignore=shutil.ignore_patterns("*.standin.json", "standin.md", "__pycache__"))
    before = snapshot(repo)
    assert "docs/results/eval/ttft_vs_chunk.json" in before  # a committed result is there to be overwritten
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    r = subprocess.run([sys.executable, str(repo / "scripts/eval/run.py"), str(repo / "scripts/eval/configs/e1_ttft_vs_chunk.yaml"), "--num-gpus", "0"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=repo)
    assert r.returncode == 2, r.stdout + r.stderr[-3000:]
    assert snapshot(repo) == before
    assert r.stdout == ""
    assert "run.py: not run (cluster too small): chunk-2048 needs 1 GPU(s) on one node; the largest node in the cluster has 0" in r.stderr
    assert "the Ray cluster has no GPU: run on a GPU host, or add --standin for a CPU dry run" in r.stderr
    assert r.stderr.endswith(f"run.py: no server started, nothing measured: {repo / 'docs/results/eval/ttft_vs_chunk.json'} and docs/eval.md left as they were\n")
    assert "Traceback" not in r.stderr


def test_the_launcher_starts_its_own_local_instance_beside_a_running_cluster(monkeypatch, tmp_path):
    """Without an address ray.init gets address='local': a plain ray.init
    would join a cluster already running on the machine (host_batch.sh
    --standin leaves one) and refuse num_cpus/num_gpus."""
    import ray

    from sglang_elastic.eval.launcher import Launcher

    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    Launcher(num_cpus=2, num_gpus=8, log_dir=str(tmp_path))
    assert seen["address"] == "local" and seen["num_gpus"] == 8 and seen["num_cpus"] == 2
    seen.clear()
    Launcher(address="127.0.0.1:6379", log_dir=str(tmp_path))
    assert seen["address"] == "127.0.0.1:6379" and "num_gpus" not in seen


def test_run_script_refuses_renumbered_gpus(tmp_path):
    import os
    import subprocess
    import sys

    p = tmp_path / "e.yaml"
    p.write_text("experiment: reserve_vs_tp\nservers: [{label: a, tp: 1}]\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "scripts/eval/run.py"), str(p), "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "CUDA_VISIBLE_DEVICES=1 renumbers the GPUs" in r.stderr


@pytest.mark.parametrize("args, env, message", [
    ([], {"SGLANG_ELASTIC_COMMIT": "abc"}, "name at least one config"),
    (["--bogus"], {}, "unknown option --bogus"),
    (["scripts/eval/configs/nope.yaml"], {}, "no config scripts/eval/configs/nope.yaml"),
    (["scripts/eval/configs/e4_decode_fraction.yaml"], {"SGLANG_ELASTIC_COMMIT": ""}, "set SGLANG_ELASTIC_COMMIT"),
    (["--budget", "9m", "scripts/eval/configs/e4_decode_fraction.yaml"], {"SGLANG_ELASTIC_COMMIT": "abc"}, "take whole seconds, not '9m'"),
    (["--budget", "0600", "scripts/eval/configs/e4_decode_fraction.yaml"], {"SGLANG_ELASTIC_COMMIT": "abc"}, "take whole seconds, not '0600'"),
    (["scripts/eval/configs/e4_decode_fraction.yaml", "--row-s"], {"SGLANG_ELASTIC_COMMIT": "abc"}, "--row-s needs a value"),
    (["--budget", "300", "--row-s", "290", "scripts/eval/configs/e4_decode_fraction.yaml"], {"SGLANG_ELASTIC_COMMIT": "abc"},
     "--budget 300 leaves no time for one row (--row-s 290) and packing"),
    (["--jit-cache", "/nonexistent/jit.tgz", "scripts/eval/configs/e4_decode_fraction.yaml"], {"SGLANG_ELASTIC_COMMIT": "abc"},
     "no JIT cache /nonexistent/jit.tgz or /nonexistent/jit.tgz.00"),
])
def test_host_batch_refuses_bad_calls_before_touching_the_host(args, env, message):
    """scripts/eval/host_batch.sh (one device call's evaluation) checks its
    arguments first: status 2 and one line, nothing installed or started."""
    import os
    import subprocess

    e = {**os.environ, **env}
    if "SGLANG_ELASTIC_COMMIT" in env and not env["SGLANG_ELASTIC_COMMIT"]:
        e.pop("SGLANG_ELASTIC_COMMIT")
    r = subprocess.run(["bash", str(ROOT / "scripts/eval/host_batch.sh"), *args], cwd=ROOT, env=e, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


def test_a_reuse_target_must_name_a_row_of_a_config_beside_it(tmp_path):
    """A typo in ``reuse: <experiment>/<label>`` fails when the config loads,
    naming the row, the target and what exists; it once surfaced only as a
    run-time warning and the row was measured anew. The shipped configs'
    targets all resolve."""
    from sglang_elastic.eval import config

    (tmp_path / "e1.yaml").write_text("experiment: ttft_vs_chunk\nservers: [{label: chunk-8192, chunked_prefill_size: 8192}, {label: chunk-2048, chunked_prefill_size: 2048}]\n")
    (tmp_path / "broken.yaml").write_text("experiment: [not, parsed\n")  # a sibling that does not parse is skipped
    e2 = tmp_path / "e2.yaml"

    def e2_with(target):
        e2.write_text("experiment: capacity\nbaseline: stock\nservers: [{label: stock, chunked_prefill_size: 8192, reuse: " + target + "}]\n"
                      "workloads: [{kind: decode_then_long, decodes: 4, long_prompts: 2, long_input_len: 4096}]\n")
        return e2

    assert config.load(e2_with("ttft_vs_chunk/chunk-8192")).servers[0].reuse == "ttft_vs_chunk/chunk-8192"
    with pytest.raises(config.EvalConfigError, match=r"servers\.0\.reuse: 'ttft_vs_chunk' has no row 'chunk-8129' \(rows: chunk-8192, chunk-2048\)"):
        config.load(e2_with("ttft_vs_chunk/chunk-8129"))
    with pytest.raises(config.EvalConfigError, match=r"servers\.0\.reuse: no experiment 'ttft_vs_chunks' among the configs in .* \(there: capacity, ttft_vs_chunk\)"):
        config.load(e2_with("ttft_vs_chunks/chunk-8192"))
    for shipped in sorted((ROOT / "scripts/eval/configs").glob("*.yaml")):
        config.load(shipped)


def test_run_script_without_ray_says_which_interpreter_to_use(tmp_path):
    """Issue 21: the README's dry run, with a python that lacks Ray, ended in
    ModuleNotFoundError; now one line naming the missing package and .venv/bin/python."""
    import subprocess
    import sys

    code = ("import importlib.util, runpy, sys\n"
            "real = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda name, package=None: None if name == 'ray' else real(name, package)  # an interpreter without Ray\n"
            f"sys.argv = ['run.py', {str(ROOT / 'scripts/eval/configs/e1_ttft_vs_chunk.yaml')!r}, '--standin']\n"
            f"runpy.run_path({str(ROOT / 'scripts/eval/run.py')!r}, run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr == (f"run.py: ray not importable by {sys.executable}: run it with the test environment's interpreter, .venv/bin/python "
                        "(bash ci/test.sh builds it), or install ci/requirements-cpu.txt with ci/constraints-cpu.txt\n")


def test_the_issue22_config_runs_e2s_own_servers_and_workload():
    """e2_capacity_issue22.yaml repeats four of e2_capacity.yaml's rows in a file of its own (so --resume can run them
    across device calls); its comment says they are the same servers under the same workload: a drift in either file
    would make its rows incomparable with E2's."""
    e2 = config.load(ROOT / "scripts/eval/configs/e2_capacity.yaml")
    i22 = config.load(ROOT / "scripts/eval/configs/e2_capacity_issue22.yaml")
    by_label = {s.label: s.model_dump(mode="json") for s in e2.servers}
    assert [s.label for s in i22.servers] == ["post-capture", "post-capture-elastic", "stock", "elastic"]
    for s in i22.servers:
        assert s.model_dump(mode="json") == by_label[s.label], s.label
    assert [w.model_dump(mode="json") for w in i22.workloads] == [w.model_dump(mode="json") for w in e2.workloads]
    assert (i22.experiment, i22.baseline, i22.ttft_tolerance, i22.result_name) == ("capacity", e2.baseline, e2.ttft_tolerance, "capacity_issue22")


def test_run_script_name_writes_the_rows_to_a_file_of_their_own_and_refuses_a_bad_name(tmp_path):
    """The same rows measured again on another GPU (issue 22's E1/E2 on an H200 after the H100 filled
    capacity_issue22.json) go to --name's file; --resume then reads that file, not the config's."""
    import json
    import subprocess
    import sys

    p = tmp_path / "e.yaml"
    p.write_text("experiment: reserve_vs_tp\nname: mine\nservers: [{label: a, tp: 1}]\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.standin.json").write_text('{"rows": []}')
    before = (out / "mine.standin.json").read_bytes()
    base = [sys.executable, str(ROOT / "scripts/eval/run.py"), str(p), "--out-dir", str(out), "--standin", "--num-gpus", "1", "--no-report"]
    r = subprocess.run(base + ["--name", "mine_h200"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    got = json.loads((out / "mine_h200.standin.json").read_text())
    assert got["name"] == "mine_h200" and [x["label"] for x in got["rows"]] == ["a"] and got["rows"][0]["ok"]
    assert (out / "mine.standin.json").read_bytes() == before  # the config's own file untouched
    r = subprocess.run(base + ["--name", "mine_h200", "--resume"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "mine_h200.standin.json is measured" in r.stdout, r.stdout + r.stderr[-2000:]
    for bad in ("../elsewhere", "..", "."):  # "..": a file "...json" and its logs in the log folder's parent
        r = subprocess.run(base + ["--name", bad], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.startswith(f"run.py: --name {bad!r}: ") and "pattern" in r.stderr and r.stderr.count("\n") == 1
    assert sorted(x.name for x in out.iterdir()) == ["mine.standin.json", "mine_h200.standin.json"]
    # a config that does not load is the config's error, not --name's
    (tmp_path / "bad.yaml").write_text("experiment: reserve_vs_tp\nservers: [{label: a, tp: 3}]\n")
    r = subprocess.run([*base[:2], str(tmp_path / "bad.yaml"), *base[3:], "--name", "fine"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith(f"run.py: {tmp_path / 'bad.yaml'}: ") and "--name" not in r.stderr


def test_run_script_name_measures_the_rows_a_config_would_take_from_another_experiments_result(tmp_path):
    """``reuse`` takes a row from another experiment's result, measured on whatever GPU that one ran on: under --name
    (the same rows on another GPU) the row is measured here instead, and the run says so."""
    import subprocess
    import sys

    from sglang_elastic.eval import config

    (tmp_path / "other.yaml").write_text("experiment: reserve_vs_tp\nname: other\nservers: [{label: x, tp: 1}]\n")
    (tmp_path / "mine.yaml").write_text("experiment: reserve_vs_tp\nname: mine\nservers: [{label: y, tp: 1, reuse: other/x}, {label: z, tp: 2}]\n")
    exp = config.load(tmp_path / "mine.yaml")
    again, reused = config.renamed(exp, "mine_h100")
    assert reused == ["y"] and again.result_name == "mine_h100" and [s.reuse for s in again.servers] == [None, None]
    assert [s.identity() for s in again.servers] == [s.identity() for s in exp.servers]
    assert again.model_dump(exclude={"name", "servers"}) == exp.model_dump(exclude={"name", "servers"})
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "scripts/eval/run.py"), str(tmp_path / "mine.yaml"), "--out-dir", str(out), "--standin",
                        "--num-gpus", "2", "--no-report", "--name", "mine_h100"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "run.py: --name: y measured here, not taken from another experiment's result (reuse)\n" in r.stdout
    # every config shipped: a new name changes nothing else of any row
    for f in sorted((ROOT / "scripts/eval/configs").glob("*.yaml")):
        exp = config.load(f)
        again, reused = config.renamed(exp, "x_h200")
        assert [s.identity() for s in again.servers] == [s.identity() for s in exp.servers], f.name
        assert [s.model_dump(exclude={"reuse"}) for s in again.servers] == [s.model_dump(exclude={"reuse"}) for s in exp.servers], f.name
        assert reused == [s.label for s in exp.servers if s.reuse] and again.workloads == exp.workloads, f.name
