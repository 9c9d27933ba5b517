"""Ray launcher: one placement group per SGLang server, a launcher actor in it,
results and logs gathered on the driver.

Layout (one server, TP = N):

- placement group ``[{"CPU": 1, "GPU": N}]``, ``STRICT_PACK``: the one-bundle
  layout SGLang's own Ray engine builds when it finds no group
  (``sglang/srt/ray/engine.py``), so several servers share a node where their
  bundles fit and wait in Ray's queue where they do not;
- :class:`ServerActor` (``num_cpus=1, num_gpus=0``) in that bundle: starts the
  server command as a child process group on its node, waits for ``/health``,
  reads ``/server_info``, runs the workloads against it from the same node
  (no cross-node hop in TTFT), stops it and hands its log back;
- the command for SGLang is ``python -m sglang_elastic.eval.ray_entry
  --placement-group NAME -- <launch_server flags> --use-ray``: SGLang's
  ``SchedulerActor`` per TP rank (``num_gpus=1``) lands in the same bundle.

The driver runs each server's life in a thread (``max_parallel`` at a time)
and shows progress with tqdm.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from sglang_elastic import results
from sglang_elastic.config import EVENTS_ENV
from sglang_elastic.eval.ray_entry import NAMESPACE


@dataclasses.dataclass
class ServerJob:
    """One server's life: ``argv`` may hold ``{port}``, ``{pg_name}``,
    ``{namespace}``, ``{python}``; ``workloads`` are dicts for
    :func:`sglang_elastic.eval.client.run_workload`."""

    name: str
    argv: List[str]
    gpus: int
    env: Dict[str, str] = dataclasses.field(default_factory=dict)
    workloads: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    vocab_size: int = 128256
    startup_timeout_s: float = 1200.0
    cwd: Optional[str] = None


@dataclasses.dataclass
class ServerResult:
    name: str
    ok: bool
    error: Optional[str] = None
    node_ip: Optional[str] = None
    url: Optional[str] = None
    startup_s: Optional[float] = None
    server_info: Dict[str, Any] = dataclasses.field(default_factory=dict)
    gpu_mem_mib: Optional[int] = None
    host: Optional[Dict[str, Any]] = None  # hostname, node_gpu_uuids (ServerActor.host), gpu_ids, gpu_uuids (bundle_gpus)
    workloads: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    log_path: Optional[str] = None


def _nvidia_smi_gpus(*fields: str) -> List[List[str]]:
    """One row per GPU of this node with ``fields`` (``--query-gpu``, no units), empty without nvidia-smi."""
    try:
        out = subprocess.check_output(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"], text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]


def _nvidia_smi_uuids() -> Dict[str, str]:
    """``{index: UUID}`` of this node's GPUs (nvidia-smi), empty without one."""
    return {i: u for i, u in _nvidia_smi_gpus("index", "uuid")}


def bundle_gpus() -> Dict[str, Any]:
    """Run as a Ray task holding all GPUs of a row's bundle, before the
    server starts: the bundle's GPU ids (Ray's, the physical indices, as
    ``run.py`` refuses a renumbering ``CUDA_VISIBLE_DEVICES``) and their
    UUIDs. Ray commits a bundle's GPUs when it reserves the group, so
    SGLang's scheduler actors get the same ones. H200s of one model differ
    by about 1 % in TTFT, so E2's verdicts want a row and its baseline on one
    GPU, or at least one host."""
    import ray

    ids = sorted(str(g) for g in ray.get_gpu_ids())
    by_index = _nvidia_smi_uuids()
    return {"gpu_ids": ids, "gpu_uuids": [by_index[i] for i in ids if i in by_index]}


def _describe(e: BaseException) -> str:
    """One message for an error, the actor's own exception rather than Ray's wrapper."""
    cause = getattr(e, "cause", None)
    e = cause if isinstance(cause, BaseException) else e
    return f"{type(e).__name__}: {e}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _libc_prctl():
    """libc's ``prctl``, looked up before any fork (the child must not load
    libraries), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()
_PR_SET_PDEATHSIG = 1


def _term_with_parent(parent: int) -> None:
    """Runs in the server's child process before exec: SIGTERM it when its
    parent, the :class:`ServerActor`'s worker, dies (``PR_SET_PDEATHSIG``).
    A call whose time limit kills the whole Ray session, raylet included,
    then leaves no server holding GPUs for the next call; SGLang's launcher
    tears its own children down on SIGTERM (as :meth:`ServerActor.stop`
    relies on). The server runs in its own session, so nothing else would
    reach it: it outlived such a call on the H200 host (2026-11-30).
    ``parent`` is the actor's pid: had it died between the fork and the
    ``prctl``, no signal would come, so the child exits at once instead.
    (Python code between fork and exec in a threaded process: only a
    pre-resolved C call and ``getppid``, no imports or locks.)"""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)


def _get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


class ServerActor:
    """Runs on the server's node (as a Ray actor; a plain object in-process works too)."""

    def __init__(self, name: str, log_dir: str):
        self.name = name
        self.log_path = Path(log_dir) / f"{name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        #: the elastic pool's lend/reclaim records (TP rank 0), unless the job sets its own file
        self.events_path = (Path(log_dir) / f"{name}.events.jsonl").resolve()  # absolute: Ray workers run in other folders
        self.events_path.unlink(missing_ok=True)
        self.proc: Optional[subprocess.Popen] = None
        self.url: Optional[str] = None

    def node_ip(self) -> str:
        try:
            import ray

            return ray.util.get_node_ip_address()
        except Exception:
            return "127.0.0.1"

    def start(self, argv: List[str], env: Dict[str, str], pg_name: str, namespace: str, cwd: Optional[str] = None) -> Dict[str, Any]:
        port = _free_port()
        subs = {"port": str(port), "pg_name": pg_name, "namespace": namespace, "python": sys.executable}
        cmd = [a.format(**subs) for a in argv]
        child_env = dict(os.environ)
        if child_env.get("CUDA_VISIBLE_DEVICES") == "":  # this actor holds no GPU; SGLang's actors get theirs from Ray
            del child_env["CUDA_VISIBLE_DEVICES"]
        try:
            import ray

            child_env.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
        except Exception:
            pass
        child_env.update(env)
        # ours, or the row's own (relative to its cwd); never one inherited from the raylet's shell: rows would share it
        self.events_path = Path(cwd or ".").resolve() / env.get(EVENTS_ENV, self.events_path)
        child_env[EVENTS_ENV] = str(self.events_path)
        log = open(self.log_path, "wb")
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, cwd=cwd, start_new_session=True,
                                     preexec_fn=functools.partial(_term_with_parent, os.getpid()))
        log.close()
        ip = self.node_ip()
        self.url = f"http://{ip}:{port}"
        self.t_start = time.monotonic()
        return {"url": self.url, "port": port, "node_ip": ip, "pid": self.proc.pid, "command": cmd}

    def wait_healthy(self, timeout_s: float, poll_s: float = 0.25) -> float:
        """Seconds from start until ``GET /health`` answers 200; raises with the
        log's tail when the process exits or the time runs out."""
        deadline = self.t_start + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with status {self.proc.returncode} before it was healthy{self._cause()}; log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - self.t_start
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(poll_s)
        raise TimeoutError(f"server not healthy after {timeout_s:.0f} s; log tail:\n{self.log_tail()}")

    def server_info(self) -> Dict[str, Any]:
        """``GET /server_info`` (0.5.17; ``/get_server_info`` is its deprecated alias)."""
        try:
            return _get_json(self.url + "/server_info", timeout=60)
        except urllib.error.HTTPError:
            return _get_json(self.url + "/get_server_info", timeout=60)

    def gpu_mem_mib(self) -> Optional[int]:
        """The smallest ``memory.total`` nvidia-smi lists on this node (what SGLang sizes by)."""
        try:
            return min(int(mib) for [mib] in _nvidia_smi_gpus("memory.total"))
        except ValueError:  # no GPU listed, or not a number
            return None

    def host(self) -> Dict[str, Any]:
        """The node a row ran on: its hostname and the UUIDs of all its GPUs
        (``node_gpu_uuids``; nvidia-smi, empty without one)."""
        return {"hostname": socket.gethostname(), "node_gpu_uuids": sorted(_nvidia_smi_uuids().values())}

    def run_workload(self, workload: Dict[str, Any], vocab_size: int) -> Dict[str, Any]:
        """The workload's numbers (:func:`sglang_elastic.eval.client.run_workload`).

        Raises ``RuntimeError`` with the log tail when the server exited
        during the warm-up request (then the workload does not run) or the
        workload (a crashed scheduler stops the server: gap 5 of
        :mod:`sglang_elastic.eval.ray_entry`), so the row is a failure with
        its reason, not numbers of the requests that happened to finish."""
        from sglang_elastic.eval.client import run_workload

        def after_warmup(warm: Dict[str, Any]) -> None:
            self._raise_if_exited("the warm-up request", failed=bool(warm.get("error")))

        out = run_workload(self.url, workload, vocab_size, after_warmup=after_warmup)
        self._raise_if_exited(f"the workload ({out.get('num_errors', 0)} failed requests)", failed=bool(out.get("num_errors")))
        return out

    def _raise_if_exited(self, during: str, failed: bool, wait_s: float = 10.0) -> None:
        """Raise when the server has exited; after ``failed`` requests, first
        give a server on its way down ``wait_s`` seconds to exit."""
        if self.proc is None:
            return
        if failed:
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with status {self.proc.returncode} during {during}{self._cause()}; log tail:\n{self.log_tail()}")

    def stop(self, grace_s: float = 60.0) -> Optional[int]:
        """SIGTERM to the server's process group (SGLang's launcher tears down
        its children and, with them, the Ray job's scheduler actors), SIGKILL
        after ``grace_s``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(30)
        return self.proc.returncode

    def events(self, offset: int = 0):
        """The lend/reclaim records written since byte ``offset`` of the
        events file, and the offset after them: ``(records, offset)``. No
        file (a stock server, or rank 0 on another node): ``([], offset)``.
        A line still being written is left for the next call; a file now
        shorter than ``offset`` (recreated) is read from its start."""
        try:
            with open(self.events_path, "rb") as f:
                if os.fstat(f.fileno()).st_size < offset:
                    offset = 0
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return [], offset
        done = data[: data.rfind(b"\n") + 1]
        recs = []
        for line in done.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                recs.append(rec)
        return recs, offset + len(done)

    def log_text(self, max_bytes: int = 8 << 20) -> str:
        data = self.log_path.read_bytes() if self.log_path.exists() else b""
        return data[-max_bytes:].decode(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text(1 << 20).splitlines()[-lines:])

    def _cause(self) -> str:
        cause = crash_cause(self.log_text(1 << 20))
        return f"{CAUSE}{cause}" if cause else ""


#: Where a launcher error names the server's crash cause (report.py reads it back).
CAUSE = "; cause: "
#: SGLang's line naming why a scheduler stopped (sglang/srt/ray/scheduler_actor.py
#: ``Scheduler PP{pp} TP{tp} crashed: {e}``), and the exception line ending a traceback.
_CRASH_LINE = re.compile(r"Scheduler PP\d+ TP\d+ crashed: (?P<msg>.+)")
_EXC_LINE = re.compile(r"^(?:[\w.]+\.)?(?P<name>\w*(?:Error|Exception|Interrupt)): (?P<msg>.+)$")
#: Ray's prefix on an actor's lines, e.g. ``\x1b[36m(SchedulerActor pid=8194)\x1b[0m ``, and its suffix on deduplicated ones.
_RAY_PREFIX = re.compile(r"^(?:\x1b\[\d+m)?\(\w+ pid=\d+(?:, ip=[\d.]+)?\)(?:\x1b\[0m)? ")
_RAY_REPEATED = re.compile(r"\s*\[repeated \d+x across cluster\]\s*$")


def crash_cause(log: str, max_chars: int = 160) -> Optional[str]:
    """Why a server stopped, from its log text: the first scheduler crash
    line SGLang wrote (its exception's message), else the exception line
    that ends the log's last Python traceback (``Name: message``), cut to
    ``max_chars``; None when the log has neither (an exception-like line
    outside a traceback, e.g. a logged import warning, is not a cause)."""
    lines = [_RAY_REPEATED.sub("", _RAY_PREFIX.sub("", line)).strip() for line in log.splitlines()]
    cause = next((m.group("msg") for m in map(_CRASH_LINE.search, lines) if m), None)
    if cause is None:
        last = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")), default=None)
        if last is not None:
            cause = next((f"{m.group('name')}: {m.group('msg')}" for m in map(_EXC_LINE.match, lines[last + 1:]) if m), None)
    return None if cause is None else shorten(cause.strip(), max_chars)


def shorten(text: str, max_chars: int) -> str:
    """``text`` cut at a word boundary to at most ``max_chars`` characters, ``…`` marking the cut."""
    return text if len(text) <= max_chars else text[: max_chars - 1].rsplit(" ", 1)[0] + "…"


def _stats(xs: List[float]) -> Dict[str, Any]:
    return {"n": len(xs), "first": round(xs[0], 2), "min": round(min(xs), 2), "median": round(statistics.median(xs), 2),
            "max": round(max(xs), 2), "values": [round(x, 2) for x in xs]}


def summarize_events(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One workload's lend/reclaim records (``SGLANG_ELASTIC_EVENTS`` lines of
    TP rank 0, :meth:`sglang_elastic.sched.controller.ElasticController.lend`
    / ``reclaim``) as the row keeps them: per operation its count and ms
    (first, min, median, max, every value in order), the reclaims' wait /
    vacate / unmap split (ms), the pages moved and requests retracted, and
    ``reclaims_skipped``: prefills that ran while lent with nothing
    reclaimed (issue 22: the CUDA graphs, or the free memory, held their
    activations; event ``reclaim_skipped``), and ``lent_tokens``
    (min / max / n over the lends: the tokens lent after each)."""
    out: Dict[str, Any] = {"source": "TP rank 0's events file"}
    for op in ("lend", "reclaim"):
        xs = [x for x in (_num(r.get("ms")) for r in records if r.get("op") == op) if x is not None]
        if xs:
            out[f"{op}_ms"] = _stats(xs)
    rec = [r for r in records if r.get("op") == "reclaim"]
    for part in ("wait_ms", "vacate_ms", "unmap_ms"):
        xs = [x for x in (_num(r.get(part)) for r in rec) if x is not None]
        if xs:
            st = _stats(xs)
            out[f"reclaim_{part}"] = {k: st[k] for k in ("first", "median", "max")}
    out["moved_units"] = int(sum(_num(r.get("moved_units")) or 0 for r in rec))
    out["retracted"] = int(sum(_num(r.get("retracted")) or 0 for r in rec))
    out["reclaims_skipped"] = sum(r.get("op") == "reclaim_skipped" for r in records)
    lent = [int(x) for x in (_num(r.get("tokens")) for r in records if r.get("op") == "lend") if x is not None]
    if lent:  # what each lend held: the one-step lend is cut to what is free (issue 22), so it may be below lendable_tokens
        out["lent_tokens"] = {"min": min(lent), "max": max(lent), "n": len(lent)}
    return out


def _num(x: Any) -> Optional[float]:
    """A finite number from a record field, else None (a malformed record
    does not cost the row its measurement)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


#: Error prefix of a job the launcher never started (``start_deadline``): the
#: experiment records the row as not run (``run.py --resume`` runs it later).
NOT_STARTED = "not run (not started)"
#: Error prefix of a job that needs more GPUs on one node than the cluster's
#: largest node has: not run here (the row waits for a larger cluster), not failed.
TOO_BIG = "not run (cluster too small)"


class Launcher:
    """A Ray cluster session: ``address=None`` starts a local cluster (its
    ``num_cpus`` / ``num_gpus`` / ``resources`` as given, else detected), else
    joins ``address`` (``"auto"``, ``"ray://..."``, ``"HOST:PORT"``)."""

    def __init__(self, address: Optional[str] = None, namespace: str = NAMESPACE, log_dir: str = "/tmp/sglang-eval/logs", num_cpus: Optional[int] = None, num_gpus: Optional[int] = None, resources: Optional[Dict[str, float]] = None, runtime_env: Optional[dict] = None):
        import ray

        self.namespace = namespace
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._owns = not ray.is_initialized()
        if self._owns:
            kw: Dict[str, Any] = {"namespace": namespace, "runtime_env": runtime_env or {}, "log_to_driver": True}
            if address:
                kw["address"] = address
            else:  # a new local instance, also beside a running cluster (ray.init would join that one, refusing num_gpus)
                kw.update(address="local", num_cpus=num_cpus, num_gpus=num_gpus, resources=resources, include_dashboard=False)
            ray.init(**kw)
        self._run_id = f"{os.getpid()}-{int(time.time())}"
        self._actor_cls = ray.remote(ServerActor)

    def close(self) -> None:
        import ray

        if self._owns and ray.is_initialized():
            ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def largest_node_gpus(self) -> float:
        import ray

        return max((n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n.get("Alive")), default=0.0)

    def run(self, jobs: List[ServerJob], max_parallel: Optional[int] = None, progress: bool = True, on_result: Optional[Callable[[ServerResult], None]] = None,
            start_deadline: Optional[float] = None) -> List[ServerResult]:
        """Run every job's server life; results in the jobs' order.

        ``start_deadline`` (``time.monotonic()`` seconds): no server starts
        after it; a job still waiting for its GPUs then returns a result whose
        error begins with :data:`NOT_STARTED` (a row to run again, not a failure).
        A job needing more GPUs than the largest node has returns at once with
        an error beginning with :data:`TOO_BIG` (likewise not a failure)."""
        from tqdm.auto import tqdm

        names = [j.name for j in jobs]
        if len(set(names)) != len(names):
            raise ValueError(f"job names must be unique: {names}")
        results: Dict[str, ServerResult] = {}
        bar = tqdm(total=len(jobs), desc="servers", unit="server", disable=not progress, dynamic_ncols=True)
        lock = threading.Lock()
        stages: Dict[str, str] = {}

        def stage(name: str, text: str) -> None:
            with lock:
                stages[name] = text
                bar.set_postfix_str(", ".join(f"{k}: {v}" for k, v in stages.items())[:200], refresh=True)

        def one(job: ServerJob) -> ServerResult:
            try:
                res = self._run_one(job, lambda t: stage(job.name, t), start_deadline)
            except Exception as e:  # recorded in the result, other servers go on
                res = ServerResult(job.name, ok=False, error=_describe(e))
            with lock:
                stages.pop(job.name, None)
                bar.update(1)
            if on_result:
                on_result(res)
            return res

        with concurrent.futures.ThreadPoolExecutor(max_workers=max_parallel or max(1, len(jobs))) as pool:
            for res in pool.map(one, jobs):
                results[res.name] = res
        bar.close()
        return [results[n] for n in names]

    def _run_one(self, job: ServerJob, stage: Callable[[str], None], start_deadline: Optional[float] = None) -> ServerResult:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        have = self.largest_node_gpus()
        if job.gpus > have:
            return ServerResult(job.name, ok=False, error=f"{TOO_BIG}: {job.name} needs {job.gpus} GPU(s) on one node; the largest node in the cluster has {have:g}")
        pg_name = f"sglang-eval-{self._run_id}-{job.name}"
        pg = placement_group([{"CPU": 1, "GPU": job.gpus}], strategy="STRICT_PACK", name=pg_name)
        res = ServerResult(job.name, ok=False)
        actor = None
        try:
            stage("waiting for GPUs")
            if start_deadline is None:
                ray.get(pg.ready())
            else:
                ready, _ = ray.wait([pg.ready()], timeout=max(0.0, start_deadline - time.monotonic()))
                if not ready or time.monotonic() > start_deadline:
                    res.error = f"{NOT_STARTED}: the start deadline passed while it waited for GPUs"
                    return res
            in_bundle = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0)
            gpus = ray.get(ray.remote(bundle_gpus).options(num_cpus=0, num_gpus=job.gpus, scheduling_strategy=in_bundle).remote())
            actor = self._actor_cls.options(num_cpus=1, num_gpus=0, scheduling_strategy=in_bundle).remote(job.name, str(self.log_dir))
            stage("starting")
            started = ray.get(actor.start.remote(job.argv, job.env, pg_name, self.namespace, job.cwd))
            res.url, res.node_ip = started["url"], started["node_ip"]
            res.startup_s = ray.get(actor.wait_healthy.remote(job.startup_timeout_s))
            res.server_info = ray.get(actor.server_info.remote())
            res.gpu_mem_mib = ray.get(actor.gpu_mem_mib.remote())
            res.host = {**ray.get(actor.host.remote()), **gpus}
            events_at = ray.get(actor.events.remote(0))[1]  # skip start-up's records (always-lent's first lend)
            for i, w in enumerate(job.workloads):
                stage(f"workload {i + 1}/{len(job.workloads)}")
                out = ray.get(actor.run_workload.remote(w, job.vocab_size))
                # the elastic pool's counters after the workload (cycles, lent
                # tokens): rank 0 scheduler's internal state, None on a stock server
                try:
                    after = ray.get(actor.server_info.remote())
                    out["sglang_elastic_after"] = results.scheduler_state(after).get("sglang_elastic")
                except Exception as e:  # the workload's numbers stand without it
                    out["sglang_elastic_after"] = {"error": _describe(e)}
                try:  # read after the counters, so that the records cover every cycle counted
                    recs, events_at = ray.get(actor.events.remote(events_at))
                    out["sglang_elastic_events"] = summarize_events(recs) if recs else None
                except Exception as e:  # likewise
                    out["sglang_elastic_events"] = {"error": _describe(e)}
                res.workloads.append(out)
            res.ok = True
        except Exception as e:
            res.error = _describe(e)
        finally:
            if actor is not None:
                stage("stopping")
                try:
                    ray.get(actor.stop.remote())
                    log = ray.get(actor.log_text.remote())
                    local = self.log_dir / f"{job.name}.driver.log"
                    local.write_text(log)
                    res.log_path = str(local)
                except Exception as e:
                    res.error = (res.error + "; " if res.error else "") + "stop/log: " + _describe(e)
                ray.kill(actor)
            remove_placement_group(pg)
        return res
