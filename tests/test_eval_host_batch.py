"""scripts/eval/host_batch.sh end to end on the CPU (--standin): a real Ray
head started by the script, two experiments at once on it, a second call
that resumes and starts nothing, and a tiny config whose second row needs
more GPUs than the cluster advertises."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_processes_naming(mark: str, grace_s: float = 10.0) -> None:
    """SIGKILL (then wait up to ``grace_s`` for them to go) every process whose command line
    names ``mark`` and their descendants (Ray's workers, the servers they
    started): the Ray head this test started, not every Ray on the machine as
    ``ray stop`` would (other test runs share it)."""
    import signal

    def table():
        out = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            out[int(pid)] = (ppid, cmd)
        return out

    procs = table()
    ours = {pid for pid, (_, cmd) in procs.items() if mark in cmd and pid != os.getpid()}
    while True:
        children = {pid for pid, (ppid, _) in procs.items() if ppid in ours} - ours
        if not children:
            break
        ours |= children

    def alive(pid):
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    for pid in ours:  # SIGKILL, as ray stop --force did
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    t = time.monotonic()
    while time.monotonic() - t < grace_s and any(alive(pid) for pid in ours):
        time.sleep(0.2)


@pytest.fixture
def host(tmp_path):
    port = _free_port()
    ray_tmp = tempfile.mkdtemp(prefix="ray-hb-", dir="/tmp")  # the head's session files, named in its processes' command lines (short: socket paths)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "SGLANG_ELASTIC_COMMIT": "0123abc",
           "RAY_PORT": str(port), "NUM_GPUS": "2", "OUT_DIR": str(tmp_path / "eval"), "LOG_DIR": str(tmp_path / "logs"), "OUT": str(tmp_path),
           "SERVER_LOG_DIR": str(tmp_path / "sglang-eval-logs"), "RAY_TMPDIR": ray_tmp}
    yield env
    _stop_processes_naming(ray_tmp)
    shutil.rmtree(ray_tmp, ignore_errors=True)


def test_two_experiments_share_one_head_and_a_second_call_resumes(host, tmp_path):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "e1.yaml").write_text(
        "experiment: ttft_vs_chunk\ncluster: {warm_first: false}\n"
        "servers: [{label: c2048, tp: 1, chunked_prefill_size: 2048}, {label: c8192, tp: 1, chunked_prefill_size: 8192}]\n"
        "workloads: [{kind: decode_then_long, decodes: 2, decode_input_len: 8, decode_output_len: 400, long_prompts: 1, "
        "long_input_len: 1024, long_output_len: 2, settle_s: 0.1}]\n")
    (cfg / "e3.yaml").write_text("experiment: reserve_vs_tp\nservers: [{label: tp2, tp: 2}, {label: tp4, tp: 4}]\n")
    cmd = ["bash", str(ROOT / "scripts/eval/host_batch.sh"), "--standin", "--budget", "400", "--row-s", "120", str(cfg / "e1.yaml"), str(cfg / "e3.yaml")]
    r = subprocess.run(cmd, cwd=ROOT, env=host, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:] + (tmp_path / "logs" / "e1.log").read_text()[-3000:]
    e1 = json.loads((tmp_path / "eval" / "ttft_vs_chunk.standin.json").read_text())
    e3 = json.loads((tmp_path / "eval" / "reserve_vs_tp.standin.json").read_text())
    assert [row["ok"] for row in e1["rows"]] == [True, True] and e1["commit"] == "0123abc"
    assert e3["rows"][0]["ok"] and e3["rows"][1]["error"].startswith("not run (cluster too small): tp4 needs 4 GPU(s)")
    assert "ttft_vs_chunk.standin.json: 2 row(s), failed: none" in r.stdout and "not measured yet: tp4" in r.stdout
    assert (tmp_path / "eval.tgz").stat().st_size > 0
    # a second call on the same host: E1 is measured; E3's tp4 still waits for a
    # larger cluster, so E3's run.py starts nothing, writes nothing and fails the call, saying so
    e3_before = (tmp_path / "eval" / "reserve_vs_tp.standin.json").read_bytes()
    again = subprocess.run(cmd, cwd=ROOT, env=host, capture_output=True, text=True, timeout=600)
    assert again.returncode == 1, again.stderr[-3000:]
    assert "every row of" in again.stdout and json.loads((tmp_path / "eval" / "ttft_vs_chunk.standin.json").read_text())["rows"] == e1["rows"]
    assert f"e3.yaml: run.py exited with status 2" in again.stderr
    assert f"run.py: no server started, nothing measured: {tmp_path / 'eval' / 'reserve_vs_tp.standin.json'} left as they were" in again.stdout
    assert (tmp_path / "eval" / "reserve_vs_tp.standin.json").read_bytes() == e3_before
    # the servers' logs are kept per experiment: E1's and E3's rows may share labels
    assert sorted(p.name for p in (tmp_path / "sglang-eval-logs" / "ttft_vs_chunk.standin").glob("*.log")) == \
        ["c2048.driver.log", "c2048.log", "c8192.driver.log", "c8192.log"]
    # a call whose budget is spent by set-up (CALL_START 480 s ago: the Ray
    # part's install, say) starts nothing and says so; the results still go back
    (tmp_path / "eval.tgz").unlink()
    short = subprocess.run(cmd[:4] + ["560", "--row-s", "60"] + cmd[7:], cwd=ROOT, env={**host, "CALL_START": str(int(time.time()) - 480)},
                           capture_output=True, text=True, timeout=600)
    assert short.returncode == 2 and "less than one row (--row-s 60): nothing started" in short.stderr
    assert (tmp_path / "eval.tgz").stat().st_size > 0
    # CONFIG:LABEL measures that row again although it is measured; the other row is kept
    redo = subprocess.run(cmd[:-2] + [f"{cfg / 'e1.yaml'}:c2048"], cwd=ROOT, env=host, capture_output=True, text=True, timeout=600)
    assert redo.returncode == 0, redo.stderr[-3000:]
    rows = {x["label"]: x for x in json.loads((tmp_path / "eval" / "ttft_vs_chunk.standin.json").read_text())["rows"]}
    assert rows["c2048"]["ok"] and rows["c2048"]["workloads"] != e1["rows"][0]["workloads"] and rows["c8192"] == e1["rows"][1]
    # another checkout's results on a host lent again are moved aside, not merged
    other = subprocess.run(cmd[:4] + ["560", "--row-s", "60"] + cmd[7:], cwd=ROOT, env={**host, "SGLANG_ELASTIC_COMMIT": "fedcba9", "CALL_START": str(int(time.time()) - 480)},
                           capture_output=True, text=True, timeout=600)
    assert other.returncode == 2 and "is from another checkout: moved to" in other.stderr
    assert (tmp_path / "eval" / ".commit").read_text().strip() == "fedcba9" and not list((tmp_path / "eval").glob("*.json"))
    moved = [p for p in tmp_path.glob("eval.*") if p.is_dir()]
    assert len(moved) == 1 and (moved[0] / "ttft_vs_chunk.standin.json").exists()


@pytest.mark.parametrize("args, says", [
    (["{c}/e1_ttft_vs_chunk.yaml:"], "names no rows after the colon"),
    (["{c}/e1_ttft_vs_chunk.yaml:,"], "names no rows after the colon"),
    (["{c}/e1_ttft_vs_chunk.yaml", "{c}/./e1_ttft_vs_chunk.yaml:chunk-2048"], "is named twice"),  # two run.py would share one result file
    (["{c}/nope.yaml:chunk-2048"], "/nope.yaml"),
])
def test_bad_config_arguments_are_refused_before_anything_starts(args, says, tmp_path):
    argv = [a.format(c=ROOT / "scripts/eval/configs") for a in args]
    r = subprocess.run(["bash", str(ROOT / "scripts/eval/host_batch.sh"), "--standin"] + argv, cwd=ROOT,
                       env={**os.environ, "SGLANG_ELASTIC_COMMIT": "0123abc", "OUT_DIR": str(tmp_path / "eval"), "LOG_DIR": str(tmp_path / "logs")},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert not (tmp_path / "logs").exists()  # refused before set-up


def test_a_config_path_with_a_colon_is_a_config_not_a_row_list(tmp_path):
    d = tmp_path / "a:b"
    d.mkdir()
    (d / "e.yaml").write_text("experiment: reserve_vs_tp\nservers: [{label: x, tp: 1}]\n")
    r = subprocess.run(["bash", str(ROOT / "scripts/eval/host_batch.sh"), "--standin", "--budget", "x", str(d / "e.yaml")], cwd=ROOT,
                       env={**os.environ, "SGLANG_ELASTIC_COMMIT": "0123abc"}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "take whole seconds, not 'x'" in r.stderr, r.stderr  # got past the config check


def test_stop_servers_stops_a_server_an_earlier_call_left_running(tmp_path):
    """The leftover server's command line starts its pattern with -m, which
    pgrep would take for an option without --."""
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "-m", "sglang_elastic.eval.ray_entry", "--placement-group", "pg-left"])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "sglang_elastic.eval.ray_entry"])
    try:
        time.sleep(0.5)
        r = subprocess.run(["bash", str(ROOT / "scripts/eval/stop_servers.sh")], capture_output=True, text=True, timeout=60, env={**os.environ, "GRACE_S": "5"})
        assert r.returncode == 0 and f"left running: {left.pid}" in r.stderr, r.stderr
        assert left.wait(timeout=10) == -15  # SIGTERM
        assert bystander.poll() is None
        again = subprocess.run(["bash", str(ROOT / "scripts/eval/stop_servers.sh")], capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and again.stderr == ""
    finally:
        for p in (left, bystander):
            p.kill()
            p.wait()
