"""How long ``sglang-elastic advise`` takes on this machine, against
``python -c "import torch"`` on the same machine (the target: at most 1.5x
that; issue 21, where advise imported SGLang and took 18-127 s on 2 cores).

    python scripts/bench_advise.py [--runs 7] [--out docs/results/advise_timing_cpu.json]

Each command runs --runs times as a fresh process (wall clock, the two
alternating so a busy spell hits both), with the interpreter that runs this
script and the ``sglang-elastic`` script beside it: an answer for the
embedded Llama-3.1-8B on an H200, and a refusal of a malformed config.json.
Medians are compared. Nothing is written when a command fails (the run
measured nothing); the exit status is 1 when the target is missed.
"""

import argparse
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_elastic import results  # noqa: E402

TARGET = 1.5  # advise's median at most this many times torch's import


def timed(cmd, expect_rc: int) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    dt = time.perf_counter() - t
    if r.returncode != expect_rc:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}, not {expect_rc}: {(r.stderr.strip().splitlines() or [''])[-1]}")
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None, help="write the result JSON here (e.g. docs/results/advise_timing_cpu.json)")
    a = ap.parse_args()
    if a.runs < 1:
        print("bench_advise.py: --runs must be at least 1", file=sys.stderr)
        return 2
    exe = Path(sys.executable).parent / "sglang-elastic"
    if not exe.is_file():
        print(f"bench_advise.py: no {exe}: run it with the interpreter of the environment where sglang-elastic is installed (.venv/bin/python)", file=sys.stderr)
        return 2
    bad = Path(tempfile.mkdtemp()) / "config.json"
    bad.write_text('{"model_type": "llama",\n')
    cmds = {
        "advise": ([str(exe), "advise", "--model-config", "llama-3.1-8b", "--gpu-mem-gb", "140.4", "--tp", "1"], 0),
        "advise_malformed_config": ([str(exe), "advise", "--model-config", str(bad), "--gpu-mem-gb", "140.4", "--tp", "1"], 2),
        "import_torch": ([sys.executable, "-c", "import torch"], 0),
    }
    load_before = os.getloadavg()
    times = {k: [] for k in cmds}
    try:
        for _ in range(a.runs):
            for k, (cmd, rc) in cmds.items():
                times[k].append(timed(cmd, rc))
    except RuntimeError as e:
        print(f"bench_advise.py: {e}; nothing written", file=sys.stderr)
        return 1
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["advise"] / med["import_torch"]
    slowest = max(med["advise"], med["advise_malformed_config"]) / med["import_torch"]
    for k, v in times.items():
        print(f"{k:24s} median {med[k]:6.3f} s  (runs: {', '.join(f'{x:.3f}' for x in v)})")
    print(f"advise / import torch: {ratio:.3f} (target <= {TARGET}); the refusal: {med['advise_malformed_config'] / med['import_torch']:.3f}")
    if a.out:
        shown = {k: shlex.join("<a malformed config.json>" if c == str(bad) else os.path.relpath(c, ROOT) if os.path.isabs(c) else c for c in cmd)
                 for k, (cmd, _) in cmds.items()}
        results.write(str(a.out), {
            **results.header(), "gpu": "none (CPU only)",
            "machine": {"cpu": results.cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                        "load_average_before": [round(x, 2) for x in load_before]},
            "runs": a.runs, "commands": shown,
            "seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
            "median_s": {k: round(v, 4) for k, v in med.items()},
            "ratio_advise_to_import_torch": round(ratio, 4), "ratio_slowest_advise_to_import_torch": round(slowest, 4),
            "target_ratio": TARGET, "meets_target": slowest <= TARGET,
        })
        print(a.out)
    return 0 if slowest <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
