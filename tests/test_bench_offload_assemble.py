"""scripts/gpu/bench_offload.py assemble (CPU): the committed H200 parts give
the committed ``docs/results/offload_h200.json`` rows, in the issue's schema."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ROOT / "docs" / "results" / "offload_h200_parts"


def _assemble(parts: Path, out: Path) -> dict:
    r = subprocess.run([sys.executable, str(ROOT / "scripts/gpu/bench_offload.py"), "assemble", "--parts", str(parts), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(out.read_text())


def test_committed_parts_assemble_into_the_committed_result(tmp_path):
    got = _assemble(PARTS, tmp_path / "o.json")
    want = json.loads((ROOT / "docs/results/offload_h200.json").read_text())
    assert {"date", "gpu", "commit", "command", "capacity", "throughput", "exactness"} <= set(got)
    assert "H200" in got["gpu"]  # the parts' GPU, not the assembling machine's
    for key in ("capacity", "throughput", "exactness", "part_commits"):
        assert got[key] == want[key], key
    fits = next(r for r in got["throughput"] if r["workload"] == "fits")
    src = json.loads((PARTS / "throughput_fits.json").read_text())["servers"]
    assert fits["stock_median_itl_ms"] == src["stock"]["median_itl_ms"] and fits["offload_output_tok_s"] == src["offload"]["output_tok_s"]
    assert got["capacity"]["offload_tokens"] == src["offload"]["max_total_num_tokens"] > 1.6 * 906_051


def test_a_capacity_part_wins_over_the_throughput_pool_sizes(tmp_path):
    parts = tmp_path / "parts"
    shutil.copytree(PARTS, parts)
    cap = {"part": "capacity", "gpu": "NVIDIA H200", "commit": "x", "servers": {
        "stock": {"max_total_num_tokens": 900_000, "peak_used_tokens": 880_000},
        "offload": {"max_total_num_tokens": 1_500_000, "peak_used_tokens": 1_490_000, "offload": {"sizing": {"bound": "hbm"}}}}}
    (parts / "capacity.json").write_text(json.dumps(cap))
    got = _assemble(parts, tmp_path / "o.json")
    assert got["capacity"] == {"stock_tokens": 900_000, "offload_tokens": 1_500_000, "stock_peak_used_tokens": 880_000,
                               "offload_peak_used_tokens": 1_490_000, "bound": "hbm"}
