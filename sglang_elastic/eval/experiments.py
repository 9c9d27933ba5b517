"""The experiment runners: a config -> server jobs on the Ray launcher -> one
result JSON (``docs/results/eval/<name>.json``, header from
:mod:`sglang_elastic.results`).

Every row is one server (one start). A row with ``reuse: <experiment>/<label>``
copies that experiment's row when the server and the workloads are identical
(E2's stock and smaller-chunk rows from E1), so no server starts for it.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from sglang_elastic import results
from sglang_elastic.eval.client import client_current
from sglang_elastic.eval.config import Experiment, ServerConfig
from sglang_elastic.eval.launcher import NOT_STARTED, TOO_BIG, Launcher, ServerJob, ServerResult
from sglang_elastic.eval.ray_entry import MARK_HOOK

logger = logging.getLogger(__name__)

#: Multi-GPU hosts of this project need NVLink multicast off (docs/gpu.md).
MULTI_GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
#: Every TP rank's lines in the server log: Ray's driver otherwise folds lines
#: of several actors that differ only in words with digits into one
#: ("[repeated 2x across cluster]"), which hides all but one rank's
#: lend/reclaim times.
LOG_ENV = {"RAY_DEDUP_LOGS": "0"}
RESULTS_DIR = Path("docs/results/eval")
#: What the client needs of every server (:mod:`sglang_elastic.eval.client`):
#: chunks with the new tokens only, so reading 40 streams stays O(1) per token.
CLIENT_FLAGS = ("--incremental-streaming-output",)


def server_argv(s: ServerConfig, standin: bool = False) -> List[str]:
    """The command the launcher actor runs for this row (placeholders filled on the node)."""
    group = ["--placement-group", "{pg_name}", "--namespace", "{namespace}"]
    if standin:
        argv = ["{python}", "-m", "sglang_elastic.eval.standin", "--port", "{port}", *group, "--setup-hook", MARK_HOOK, "--tp-size", str(s.tp), *CLIENT_FLAGS]
        if s.chunked_prefill_size is not None:
            argv += ["--chunked-prefill-size", str(s.chunked_prefill_size)]
        if s.mem_fraction_static is not None:
            argv += ["--mem-fraction-static", str(s.mem_fraction_static)]
        if s.enable_elastic_kv:
            argv += ["--enable-elastic-kv"]  # the stand-in then writes lend/reclaim records
        return argv + list(s.extra_args)  # the stand-in ignores SGLang's flags (and takes its own, e.g. --fail)
    from sglang_elastic.serve import build_command

    flags = build_command(s.model, s.launch_flags(), python="python")[3:]  # our serve defaults: embedded shape, FlashInfer
    return ["{python}", "-m", "sglang_elastic.eval.ray_entry", *group, "--", *flags, *CLIENT_FLAGS, "--host", "0.0.0.0", "--port", "{port}", "--use-ray"]


def vocab_size(model: str) -> int:
    from sglang_elastic.serve import model_path

    return int(json.loads((model_path(model) / "config.json").read_text())["vocab_size"])


def job_for(exp: Experiment, s: ServerConfig, standin: bool = False) -> ServerJob:
    return ServerJob(
        name=s.label,
        argv=server_argv(s, standin),
        gpus=s.tp,
        env={**MULTI_GPU_ENV, **LOG_ENV, **s.env},
        workloads=[w.model_dump(mode="json") for w in exp.workloads],
        vocab_size=vocab_size(s.model),
        startup_timeout_s=exp.cluster.startup_timeout_s,
        cwd=str(Path.cwd()),
    )


def facts(info: Dict[str, Any], gpu_mem_mib: Optional[int]) -> Dict[str, Any]:
    """Server-side facts from SGLang 0.5.17's ``GET /server_info``: the server
    args (``mem_fraction_static``, ``chunked_prefill_size``, ``tp_size``), the
    scheduler's ``max_total_num_tokens`` and rank 0's
    ``internal_states[0].memory_usage`` (GiB: ``weight``, ``kvcache``,
    ``startup_available`` = free after CUDA-graph capture, ``graph``), and our
    patch's ``sglang_elastic`` key. The reserve is SGLang's slack
    ``pre_model_load_free * (1 - mem_fraction_static)``, with
    ``pre_model_load_free = (kvcache + weight) / mem_fraction_static``."""
    mem = results.scheduler_state(info).get("memory_usage") or {}
    mfs = info.get("mem_fraction_static")
    weight, kv, free = mem.get("weight"), mem.get("kvcache"), mem.get("startup_available")
    out: Dict[str, Any] = {
        "sglang_version": info.get("version"),
        "max_total_num_tokens": info.get("max_total_num_tokens"),
        "mem_fraction_static": mfs,
        "chunked_prefill_size": info.get("chunked_prefill_size"),
        "tp_size": info.get("tp_size"),
        "max_running_requests": info.get("max_running_requests"),
        "weight_gib": weight,
        "kv_cache_gib": kv,
        "free_after_graphs_gib": free,
        "graph_gib": mem.get("graph"),
        "gpu_mem_mib": gpu_mem_mib,
        # patch 0001's key (version, patches) and, with --enable-elastic-kv,
        # rank 0 scheduler's pool state (base / lendable / lent tokens)
        "sglang_elastic": {**(info.get("sglang_elastic") or {}), **(results.scheduler_state(info).get("sglang_elastic") or {})} or None,
    }
    if mfs and weight is not None and kv is not None:
        pre_free = (kv + weight) / mfs
        reserve = pre_free - kv - weight
        out["reserve_gib"] = reserve
        out["reserve_fraction_of_kv_pool"] = reserve / kv if kv else None
        out["reserve_fraction_of_hbm"] = reserve / (gpu_mem_mib / 1024) if gpu_mem_mib else None
    return out


def _row(s: ServerConfig, r: ServerResult) -> Dict[str, Any]:
    return {
        "label": s.label,
        "group": s.group,
        "server": s.model_dump(mode="json"),
        "identity": s.identity(),
        "ok": r.ok,
        "error": r.error,
        "node_ip": r.node_ip,
        "host": r.host,
        "startup_s": r.startup_s,
        "facts": facts(r.server_info, r.gpu_mem_mib) if r.server_info else None,
        "workloads": r.workloads,
        "log": r.log_path,
        "reused_from": None,
        # rows of one file may come from several calls (run.py --only)
        "measured": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": results.commit()},
    }


def row_of(data: Optional[Dict[str, Any]], label: str) -> Optional[Dict[str, Any]]:
    """The row labelled ``label`` of a result file's contents, or None."""
    return next((r for r in (data or {}).get("rows", []) if r.get("label") == label), None)


def find_reusable(exp: Experiment, s: ServerConfig, results_dir: Path) -> "tuple[Optional[Dict[str, Any]], str]":
    """The row ``s.reuse`` names, if it measured the same server and workloads."""
    other, label = s.reuse.split("/", 1)
    path = results_dir / f"{other}.json"
    if not path.is_file():
        return None, f"{path} not found"
    data = json.loads(path.read_text())
    row = row_of(data, label)
    if row is None:
        return None, f"no row {label!r} in {path}"
    if not row.get("ok"):
        return None, f"row {label!r} of {path} failed"
    if row.get("identity") != s.identity():
        return None, f"row {label!r} of {path} ran another server: {row.get('identity')}"
    want = [w.model_dump(mode="json") for w in exp.workloads]
    if want and not client_current(row):  # E3 reads server facts only: how the row streamed does not matter there
        return None, f"row {label!r} of {path} was measured with cumulative streaming output (an older client): measure it again"
    if want and [w.get("workload") for w in row.get("workloads", [])] != want:
        return None, f"row {label!r} of {path} ran other workloads"
    out = copy.deepcopy(row)
    if not want:
        out["workloads"] = []  # this experiment reads server facts only
    out.update(label=s.label, group=s.group, server=s.model_dump(mode="json"), reused_from=f"{path.as_posix()}#{label} ({data.get('commit', '?')[:12]}, {data.get('date', '?')})")
    return out, ""


def check_only(exp: Experiment, only: Optional[List[str]]) -> None:
    """Raises ``ValueError`` naming the labels of ``only`` the config lacks."""
    unknown = sorted(set(only or ()) - {s.label for s in exp.servers})
    if unknown:
        raise ValueError(f"--only: no row {', '.join(unknown)} in {exp.result_name}; rows: {', '.join(s.label for s in exp.servers)}")


def previous_row(exp: Experiment, s: ServerConfig, previous: Optional[Dict[str, Any]], ok_only: bool = True, stale_ok: bool = False) -> Optional[Dict[str, Any]]:
    """``previous``'s row for ``s`` if it was measured (``ok_only``: and
    succeeded) with the same server and the same workloads, else None.
    ``stale_ok``: also a row an older client measured (cumulative streaming,
    :func:`~sglang_elastic.eval.client.client_current`): kept in the file,
    marked by the report, until a new measurement replaces it; ``--resume``
    (:func:`measured_labels`) measures it again. The same holds for a row
    copied from another experiment (``reused_from``) once the config
    measures that row itself (no ``reuse``): E2's stock row, measured on the
    host of the rows it judges since E1's ran on another."""
    old = row_of(previous, s.label)
    if old is None or (ok_only and not old.get("ok")) or old.get("identity") != s.identity():
        return None
    if not_measured(old) or (old.get("ok") and not stale_ok and (not client_current(old) or (old.get("reused_from") and not s.reuse))):
        return None
    want = [w.model_dump(mode="json") for w in exp.workloads]
    if old.get("ok") and [w.get("workload") for w in old.get("workloads", [])] != want:
        return None
    return old


def measured_labels(exp: Experiment, previous: Optional[Dict[str, Any]]) -> List[str]:
    """Labels of the rows ``previous`` holds measured for the config as it is
    now (same server, same workloads, succeeded, by this client's streaming):
    what ``run.py --resume`` skips."""
    return [s.label for s in exp.servers if previous_row(exp, s, previous) is not None]


def not_measured(row: Dict[str, Any]) -> bool:
    """A row no server stood behind (:func:`_not_run`, :data:`NOT_STARTED`
    under a start deadline, :data:`TOO_BIG` on a cluster without a node of
    enough GPUs): not measured yet rather than failed."""
    return not row.get("ok") and (row.get("error") or "").startswith(NOT_RUN)


#: Error prefix of every row :func:`_not_run` writes (:data:`NOT_STARTED` and :data:`TOO_BIG` share it).
NOT_RUN = "not run"
assert NOT_STARTED.startswith(NOT_RUN) and TOO_BIG.startswith(NOT_RUN)


def started(r: ServerResult) -> bool:
    """Whether a server stood behind this launcher result (it may have failed):
    not one left waiting by a start deadline or too big for every node."""
    return r.ok or not (r.error or "").startswith(NOT_RUN)


def _earlier_not_run(s: ServerConfig, previous: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """``previous``'s row for ``s`` when it is one not measured yet
    (:func:`not_measured`) for the same server."""
    old = row_of(previous, s.label)
    return old if old is not None and not_measured(old) and old.get("identity") == s.identity() else None


def _not_run(s: ServerConfig, why: str) -> Dict[str, Any]:
    return {"label": s.label, "group": s.group, "server": s.model_dump(mode="json"), "identity": s.identity(), "ok": False,
            "error": why, "node_ip": None, "startup_s": None, "facts": None, "workloads": [], "log": None, "reused_from": None}


def run(exp: Experiment, launcher: Launcher, results_dir: Path = RESULTS_DIR, standin: bool = False, progress: bool = True,
        only: Optional[List[str]] = None, previous: Optional[Dict[str, Any]] = None, warm_first: Optional[bool] = None,
        on_progress: Optional[Callable[[Dict[str, Any]], None]] = None, start_deadline: Optional[float] = None,
        on_result: Optional[Callable[[ServerResult], None]] = None) -> Dict[str, Any]:
    """Run every row that cannot be reused; rows in the config's order.

    ``only``: run just these labels; a ``reuse`` row is taken from its source
    file whenever it can be (no server); every other row is kept from ``previous``
    (an earlier result of this experiment) when it measured the same server
    and workloads, else recorded as not run; so an experiment can be measured
    in several calls. ``on_progress`` gets the result body after each
    finished server (rows not finished yet: ``previous``'s, else not run),
    for a caller that writes it as it goes: a run killed at a time limit
    leaves what it measured and what the file held before; a row that never
    started (a start deadline, a cluster too small) calls it not, so a run
    that starts no server has nothing to write. ``on_result`` gets every
    launcher result, started or not (:func:`started`).
    ``start_deadline`` (``time.monotonic()`` seconds): no server starts after
    it (:meth:`Launcher.run`); those rows stay as ``previous`` had them, or
    not run.

    Raises:
        ValueError: ``only`` names a label the config does not have.
    """
    check_only(exp, only)

    def earlier(s: ServerConfig) -> Optional[Dict[str, Any]]:
        return previous_row(exp, s, previous, stale_ok=True)

    rows: Dict[str, Dict[str, Any]] = {}
    jobs: List[ServerJob] = []
    notes: List[str] = []
    for s in exp.servers:
        why = None
        if s.reuse and not standin:  # costs no GPU: taken whether or not --only names it
            row, why = find_reusable(exp, s, results_dir)
            if row is not None:
                rows[s.label] = row
                continue
        if only and s.label not in only:
            # the file's earlier row of the same server stays, a failure with
            # its reason, and so does a row not measured yet with its own
            # ("cluster too small", "interrupted before it finished")
            rows[s.label] = previous_row(exp, s, previous, ok_only=False, stale_ok=True) or _earlier_not_run(s, previous) or _not_run(
                s, "not run (not in --only, no earlier row of the same server and workloads)")
            continue
        if why is not None:
            notes.append(f"{s.label}: not reused ({why}); started")
            logger.warning("%s: not reused (%s); starting it", s.label, why)
        jobs.append(job_for(exp, s, standin))
    by_label = {s.label: s for s in exp.servers}

    def body() -> Dict[str, Any]:
        # a row still running keeps its earlier measurement, if any (a run
        # stopped half-way does not erase what the file held)
        out = [rows.get(s.label) or earlier(s) or _not_run(s, "not run (interrupted before it finished)") for s in exp.servers]
        return {"experiment": exp.experiment, "name": exp.result_name, "description": exp.description, "standin": standin, "notes": notes,
                "config": exp.model_dump(mode="json"), "rows": out}

    lock = threading.Lock()  # the launcher calls back from its worker threads

    def done(r: ServerResult) -> None:
        with lock:
            if on_result:
                on_result(r)
            old = earlier(by_label[r.name])
            if not started(r):  # never started (deadline, cluster too small): keep what the file had
                rows[r.name] = old or _not_run(by_label[r.name], r.error)
                return
            if not r.ok and old is not None and old.get("ok"):
                # measuring a row again failed (a stale one, --resume): the earlier measurement stays, the failure beside it
                rows[r.name] = {**old, "remeasure_error": r.error, "remeasure_log": r.log_path}
            else:
                rows[r.name] = _row(by_label[r.name], r)
            if on_progress:
                try:
                    on_progress(body())
                except Exception:  # a failed progress write must not stop the servers still running
                    logger.exception("writing the progress of %s failed", r.name)

    # The first start on a fresh host JIT-compiles FlashInfer (~4 min): let one
    # server warm the cache before the others start beside it.
    first = exp.cluster.warm_first if warm_first is None else warm_first
    waves = [jobs[:1], jobs[1:]] if first and len(jobs) > 1 else [jobs]
    for wave in waves:
        launcher.run(wave, max_parallel=exp.cluster.max_parallel_servers, progress=progress, on_result=done, start_deadline=start_deadline)
    return body()
