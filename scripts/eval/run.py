"""Run one experiment on Ray and write docs/results/eval/<name>.json, then
regenerate docs/eval.md's tables and the plots.

    python scripts/eval/run.py scripts/eval/configs/e1_ttft_vs_chunk.yaml [--address auto] [--standin] [--out-dir DIR] [--no-report]
        [--only LABEL,...] [--resume] [--start-deadline-s S] [--no-warm-first] [--log-dir DIR] [--name NAME]

The JSON is rewritten after every finished server, so a run stopped at a time
limit keeps what it measured. --only runs some rows and keeps the others from
the existing result file (when they measured the same server): a long
experiment can be measured in several calls. A run that starts no server (no
GPU, a cluster too small for every row, a start deadline already passed)
writes nothing, neither the JSON nor docs/eval.md, and exits with status 2.

--name writes docs/results/eval/NAME.json instead of the config's name: the
same rows measured again elsewhere (another GPU, say) get a file of their own,
and --only / --resume read and keep that file; rows that would take another
experiment's result (reuse) are measured too.

--address joins a running Ray cluster (default: the config's cluster.address,
else a local cluster on this machine). --standin runs the CPU stand-in server
(sglang_elastic.eval.standin) instead of SGLang: a dry run of the launcher and
the workloads, marked as such in the JSON.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the source tree when the package is not installed


def _missing_packages() -> list:
    """What this script imports beyond the standard library, where this interpreter lacks it."""
    import importlib.util

    return [m for m in ("ray", "yaml", "pydantic") if importlib.util.find_spec(m) is None]


if __name__ == "__main__" and _missing_packages():
    print(f"run.py: {', '.join(_missing_packages())} not importable by {sys.executable}: run it with the test environment's "
          f"interpreter, {os.path.relpath(ROOT / '.venv/bin/python')} (bash ci/test.sh builds it), or install ci/requirements-cpu.txt "
          "with ci/constraints-cpu.txt", file=sys.stderr)
    sys.exit(2)

from sglang_elastic import results  # noqa: E402
from sglang_elastic.eval import config, experiments, report  # noqa: E402
from sglang_elastic.eval.client import client_current  # noqa: E402
from sglang_elastic.eval.launcher import NOT_STARTED, TOO_BIG, Launcher  # noqa: E402


def nothing_measured(seen, out: Path, standin: bool, node_gpus: float) -> int:
    """No server started: say why, one line per reason, write nothing, status 2."""
    too_big = [r for r in seen if (r.error or "").startswith(TOO_BIG)]
    for r in too_big:
        print(f"run.py: {r.error}", file=sys.stderr)
    if too_big and not standin and not node_gpus:
        print("run.py: the Ray cluster has no GPU: run on a GPU host, or add --standin for a CPU dry run", file=sys.stderr)
    waited = [r.name for r in seen if (r.error or "").startswith(NOT_STARTED)]
    if waited:
        print(f"run.py: the start deadline passed before {', '.join(waited)} could start", file=sys.stderr)
    if not seen:
        print("run.py: no row to start (every row asked for is copied from another experiment or kept from the file)", file=sys.stderr)
    kept = [f"{out}"] + ([] if standin else ["docs/eval.md"])
    print(f"run.py: no server started, nothing measured: {' and '.join(kept)} left as they were", file=sys.stderr)
    return 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("config", type=Path)
    ap.add_argument("--address", default=None, help="Ray cluster to join (default: the config's, else start a local one)")
    ap.add_argument("--standin", action="store_true", help="CPU stand-in server instead of SGLang (dry run)")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs/results/eval")
    ap.add_argument("--num-gpus", type=int, default=None, help="local cluster only: GPUs to advertise (default: detected; with --standin: 8)")
    ap.add_argument("--no-report", action="store_true")
    ap.add_argument("--only", default=None, help="comma-separated row labels to run; other rows are kept from the existing result file")
    ap.add_argument("--name", default=None, help="result name (docs/results/eval/NAME.json; default: the config's name, else its experiment)")
    ap.add_argument("--resume", action="store_true", help="run only the rows the existing result file lacks or failed (e.g. after a time limit cut a run)")
    ap.add_argument("--start-deadline-s", type=float, default=None, metavar="S",
                    help="start no server later than S seconds from now (a call with a time limit: rows not started stay for --resume)")
    ap.add_argument("--no-warm-first", action="store_true", help="start every server at once (the host's JIT caches are already warm)")
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="servers' logs go to LOG_DIR/<result name>/ (default: the config's cluster.log_dir)")
    a = ap.parse_args()
    t0 = time.monotonic()
    try:
        exp = config.load(a.config)
    except config.EvalConfigError as e:
        print(f"run.py: {e}", file=sys.stderr)
        return 2
    if a.name is not None:
        try:
            exp, reused = config.renamed(exp, a.name)
        except config.EvalConfigError as e:
            print(f"run.py: --name {a.name!r}: {e}", file=sys.stderr)
            return 2
        if reused:
            print(f"run.py: --name: {', '.join(reused)} measured here, not taken from another experiment's result (reuse)")
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not a.standin and cvd and cvd.replace(" ", "") != ",".join(str(i) for i in range(len(cvd.split(",")))):
        # SGLang's SchedulerActor takes Ray's GPU id as its CUDA device index, and
        # ray_entry keeps every GPU visible to the workers: ids must be indices
        print(f"run.py: CUDA_VISIBLE_DEVICES={cvd} renumbers the GPUs, which SGLang's Ray mode cannot follow; "
              "unset it (rows take their GPUs through Ray placement groups)", file=sys.stderr)
        return 2
    address = a.address or exp.cluster.address
    num_gpus = a.num_gpus if a.num_gpus is not None else (8 if a.standin and not address else None)
    out = a.out_dir / f"{exp.result_name}{'.standin' if a.standin else ''}.json"
    only = [x for x in a.only.split(",") if x] if a.only else None
    try:
        experiments.check_only(exp, only)
    except ValueError as e:
        print(f"run.py: {e}", file=sys.stderr)
        return 2
    previous = json.loads(out.read_text()) if out.is_file() else None
    if a.resume:
        done = set(experiments.measured_labels(exp, previous))  # a row of a changed server or workload runs again
        only = [s.label for s in exp.servers if s.label not in done and (not only or s.label in only)]
        if not only:
            print(f"run.py --resume: every row of {out} is measured")
            return 0
    head = results.header()

    def write(body):
        a.out_dir.mkdir(parents=True, exist_ok=True)
        results.write(str(out), {**head, **body})

    log_dir = (a.log_dir or Path(exp.cluster.log_dir)) / out.stem  # per experiment: E1 and E1 at TP 2 share row labels
    seen = []  # every launcher result: whether any server started decides whether anything is written
    with Launcher(address=address, log_dir=str(log_dir), num_gpus=num_gpus) as launcher:
        body = experiments.run(exp, launcher, results_dir=a.out_dir, standin=a.standin, only=only, previous=previous,
                               warm_first=False if a.no_warm_first else None, on_progress=write, on_result=seen.append,
                               start_deadline=None if a.start_deadline_s is None else t0 + a.start_deadline_s)
        node_gpus = launcher.largest_node_gpus()
    if not any(experiments.started(r) for r in seen):
        return nothing_measured(seen, out, a.standin, node_gpus)
    write(body)

    before = {r.get("label"): r for r in (previous or {}).get("rows", [])}

    def failure(r):  # a server stood behind it and it failed (a row never started is not measured yet)
        return (not r["ok"] and not experiments.not_measured(r)) or bool(r.get("remeasure_error"))

    # failed in this run; a failure the file held and this run did not touch (not in --only, not started) is an earlier one
    failed = [r["label"] for r in body["rows"] if failure(r) and before.get(r["label"]) != r]
    failed_before = [r["label"] for r in body["rows"] if failure(r) and before.get(r["label"]) == r]
    missing = [r["label"] for r in body["rows"] if not r["ok"] and experiments.not_measured(r)]
    stale = [r["label"] for r in body["rows"] if r["ok"] and not client_current(r)]  # kept until --resume measures them again
    # asked for, but never started (a start deadline, a cluster too small): the file keeps its earlier measurement
    kept = [r["label"] for r in body["rows"] if (not only or r["label"] in only) and r["ok"] and not r.get("reused_from") and before.get(r["label"]) == r]
    print(f"{out}: {len(body['rows'])} row(s), failed: {', '.join(failed) or 'none'}"
          + (f"; failed in an earlier run, not run again: {', '.join(failed_before)}" if failed_before else "")
          + (f"; not measured yet: {', '.join(missing)}" if missing else "")
          + (f"; older client (cumulative streaming), to measure again: {', '.join(stale)}" if stale else "")
          + (f"; not started this time, earlier result kept: {', '.join(kept)}" if kept else ""))
    # rows asked for that no node of the cluster can hold: say why on the console, not only in the file
    for r in seen:
        if (r.error or "").startswith(TOO_BIG):
            print(f"run.py: {r.error}", file=sys.stderr)
    if not a.no_report and not a.standin:
        try:
            report.render_doc(ROOT / "docs/eval.md", a.out_dir, ROOT)
        except ImportError as e:  # the offline GPU bundle has no matplotlib
            print(f"report not regenerated ({e}); run python scripts/eval/report.py where matplotlib is installed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
