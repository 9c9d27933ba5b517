"""scripts/eval/host_batch.sh end to end on the CPU (--standin): a real Ray
head started by the script, two experiments at once on it, a second call
that resumes and starts nothing, and a tiny config whose second row needs
more GPUs than the cluster advertises."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def host(tmp_path):
    port = _free_port()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "SGLANG_ELASTIC_COMMIT": "0123abc",
           "RAY_PORT": str(port), "NUM_GPUS": "2", "OUT_DIR": str(tmp_path / "eval"), "LOG_DIR": str(tmp_path / "logs"), "OUT": str(tmp_path),
           "SERVER_LOG_DIR": str(tmp_path / "sglang-eval-logs")}
    yield env
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True, timeout=120)


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
    # a second call on the same host: E1 is measured, E3's tp4 still waits for a larger cluster
    again = subprocess.run(cmd, cwd=ROOT, env=host, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "every row of" in again.stdout and json.loads((tmp_path / "eval" / "ttft_vs_chunk.standin.json").read_text())["rows"] == e1["rows"]
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
