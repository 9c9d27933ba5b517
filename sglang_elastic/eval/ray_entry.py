"""``python -m sglang.launch_server ... --use-ray`` inside a placement group the
launcher already reserved.

    python -m sglang_elastic.eval.ray_entry --placement-group NAME [--namespace NS] -- LAUNCH_SERVER FLAGS...

SGLang 0.5.17's Ray mode (``--use-ray``: ``sglang/srt/ray/http_server.py`` ->
``RayEngine._launch_scheduler_processes`` in ``sglang/srt/ray/engine.py``)
starts one ``SchedulerActor`` per TP rank (``num_gpus=1``) inside
``ray.util.get_current_placement_group()``, or creates its own group when
there is none; the HTTP server clears any group given through ``ServerArgs``.
A ``launch_server`` process is a Ray driver, never inside a placement group,
so on its own it would reserve a second group beside the launcher's. Five
gaps, each closed here and nowhere else:

1. the group: this entry looks up the launcher's named group (one bundle of
   ``{"CPU": 1, "GPU": tp}``, the auto-group layout SGLang itself builds) and
   answers ``ray.util.get_current_placement_group()`` with it;
2. the environment: Ray actors start from the raylet's environment, not this
   process's, so ``SGLANG_*`` (e.g. ``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING``,
   and our ``SGLANG_ELASTIC_CONFIG``), ``NCCL_*`` and the other variables of
   :data:`FORWARD_PREFIXES` travel in the job's ``runtime_env``;
3. plugins: ``SchedulerActor`` builds the ``Scheduler`` directly and skips
   ``run_scheduler_process``, the only scheduler-side caller of
   ``load_plugins()``; the job's ``worker_process_setup_hook``
   (:func:`worker_setup`) loads them in every worker;
4. GPU ids: ``SchedulerActor`` takes Ray's physical GPU id as its device index
   (``torch.cuda.set_device``), while Ray narrows each actor's
   ``CUDA_VISIBLE_DEVICES`` to that one GPU. CUDA, already initialised in the
   worker, still sees every GPU, but the custom all-reduce maps the index
   through ``CUDA_VISIBLE_DEVICES``: at TP 2 rank 1 fails (``list index out of
   range``) while rank 0 waits in the handle exchange, and the server hangs
   (seen on two H200s). The job sets ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``,
   as SGLang's own Ray benchmark does (``sglang/benchmark/offline_throughput.py``),
   so every rank sees every GPU and the indices agree. So Ray's GPU ids must be
   CUDA indices: ``run.py`` refuses a ``CUDA_VISIBLE_DEVICES`` that renumbers
   them. Left as SGLang does it: its P2P probe (``can_p2p``) takes TP ranks as
   device indices, so on a host of more than two GPUs a TP2 server on GPUs
   2-3 probes GPUs 0-1 once (SGLang caches the answer per host);
5. a scheduler that dies: the multiprocess server's scheduler sends SIGQUIT
   to its parent when it crashes (``sglang/srt/managers/scheduler.py``), whose
   handler stops the whole server; the Ray HTTP server never waits on its
   actors' event loops (``block_until_scheduler_exits`` is called only on
   nodes other than the first and on the Rust-server path), so a scheduler
   actor that dies (a CUDA OOM, say) leaves the
   HTTP server up and every ``/generate`` waiting forever. Seen twice on a
   two-H200 host on 2026-11-30 (E2's ``post-capture-mrr256-32768`` at TP 2):
   each hang held both GPUs until the device call's time ran out.
   :func:`watch_schedulers` waits for the first event loop to end and sends
   the same SIGQUIT, so the server exits, the client's requests fail at once
   and the row is reported as failed with its log tail.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import signal
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

logger = logging.getLogger(__name__)

NAMESPACE = "sglang-eval"
#: Environment variables handed to SGLang's scheduler actors (Ray workers).
FORWARD_PREFIXES = ("SGLANG_", "NCCL_", "TORCH_", "NVSHMEM_", "PYTORCH_", "CUDA_", "FLASHINFER_", "TRITON_", "HF_", "TOKENIZERS_")
WORKER_SETUP_HOOK = "sglang_elastic.eval.ray_entry.worker_setup"
MARK_HOOK = "sglang_elastic.eval.ray_entry.mark_worker"
MARK_ENV = "SGLANG_ELASTIC_RAY_WORKER_SETUP"


def forwarded_env(environ: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The variables of ``environ`` that SGLang's Ray workers must see.
    ``CUDA_VISIBLE_DEVICES`` stays out: Ray sets it per actor from its GPUs."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(FORWARD_PREFIXES) and k != "CUDA_VISIBLE_DEVICES"}


#: Set in every worker of the server's job (gap 4 of the module docstring).
RAY_WORKER_ENV = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


def job_runtime_env(setup_hook: str = WORKER_SETUP_HOOK, environ: Optional[Dict[str, str]] = None) -> dict:
    return {"env_vars": {**forwarded_env(environ), **RAY_WORKER_ENV}, "worker_process_setup_hook": setup_hook}


def mark_worker() -> None:
    """Setup hook that only marks the worker (tests: proves the hook runs)."""
    os.environ[MARK_ENV] = "1"


def worker_setup() -> None:
    """Setup hook of every Ray worker of the server's job: SGLang's plugins
    (ours included), as ``run_scheduler_process`` would have loaded them."""
    mark_worker()
    from sglang.srt.plugins import load_plugins

    load_plugins()


def _drop_empty_cuda_visible_devices() -> None:
    # The launcher actor holds no GPU, so Ray gave it (and its child) an empty
    # CUDA_VISIBLE_DEVICES; SGLang's ServerArgs would then pick the CPU device.
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        del os.environ["CUDA_VISIBLE_DEVICES"]


def attach(placement_group: str, namespace: str = NAMESPACE, setup_hook: str = WORKER_SETUP_HOOK, address: Optional[str] = None):
    """Join the cluster as a driver whose workers get :func:`job_runtime_env`,
    and make the named group this process's "current" placement group.

    Returns the group. Raises ``ValueError`` when the group does not exist.
    """
    import ray
    import ray.util

    _drop_empty_cuda_visible_devices()
    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", namespace=namespace, runtime_env=job_runtime_env(setup_hook), log_to_driver=True)
    try:
        pg = ray.util.get_placement_group(placement_group)
    except ValueError as e:
        raise ValueError(f"placement group {placement_group!r} not found in namespace {namespace!r}: {e}") from None
    ray.util.get_current_placement_group = lambda: pg  # read by sglang/srt/ray/engine.py
    return pg


#: Seconds the watcher gives SGLang's SIGQUIT handler before it kills the
#: process tree itself (the handler runs on the asyncio loop, which a stuck
#: request handler could hold).
QUIT_GRACE_S = 30.0


def _quit_server(why: str, crashed: bool) -> None:
    logger.log(logging.ERROR if crashed else logging.WARNING,
               "sglang-elastic eval: %s; stopping the server (SIGQUIT, as a crashed scheduler does in SGLang's multiprocess server)", why)
    os.kill(os.getpid(), signal.SIGQUIT)
    threading.Event().wait(QUIT_GRACE_S)
    from sglang.srt.utils import kill_process_tree

    logger.error("sglang-elastic eval: the server outlived its SIGQUIT by %.0f s; killing its process tree", QUIT_GRACE_S)
    kill_process_tree(os.getpid())


def watch_schedulers(result: Any, on_exit: Callable[[str, bool], None] = _quit_server) -> threading.Thread:
    """Gap 5: call ``on_exit(why, crashed)`` once the first scheduler event
    loop of ``result`` (the ``RaySchedulerInitResult`` of
    ``RayEngine._launch_scheduler_processes``) ends: ``crashed`` when it
    raised or its actor died (the error is in ``why``), false when it returned
    (a normal shutdown). The default logs it (an error when crashed), sends
    this process SIGQUIT, whose handler (the launch-phase one of
    ``sglang/srt/entrypoints/engine.py``, then the running-phase one of
    ``sglang/srt/managers/tokenizer_manager.py``) kills the server's process
    tree, and kills the tree itself :data:`QUIT_GRACE_S` later if it still
    runs.

    The event loops' object refs live only in the closure of
    ``result.block_until_scheduler_exits`` (``sglang/srt/ray/engine.py``, the
    TP and the DP path); where they cannot be found there, the watcher waits
    on that function itself, which returns when every loop has ended or one
    has raised (then ``crashed`` is true: it cannot tell). Returns the
    (daemon) watcher thread."""
    import ray

    fn = getattr(result, "block_until_scheduler_exits")
    refs = None
    try:
        refs = inspect.getclosurevars(fn).nonlocals.get("event_loop_refs")
    except TypeError:  # not a plain function
        pass

    def wait_first():
        if not refs:
            fn()  # logs the error itself
            return "the scheduler event loops ended", True
        done, _ = ray.wait(list(refs), num_returns=1)
        try:
            ray.get(done)
        except Exception as e:  # noqa: BLE001 - any failure of the actor is the reason
            return f"a scheduler actor died: {type(e).__name__}: {e}", True
        return "a scheduler event loop returned", False

    t = threading.Thread(target=lambda: on_exit(*wait_first()), name="sglang-elastic-scheduler-watch", daemon=True)
    t.start()
    return t


def install_scheduler_watch() -> None:
    """Wrap ``RayEngine._launch_scheduler_processes`` so that every server
    this process launches runs :func:`watch_schedulers` on its schedulers."""
    from sglang.srt.ray.engine import RayEngine

    launch = RayEngine.__dict__["_launch_scheduler_processes"].__func__
    if getattr(launch, "_sglang_elastic_watch", False):
        return

    def launch_and_watch(cls, *args, **kwargs):
        result, procs = launch(cls, *args, **kwargs)
        watch_schedulers(result)
        return result, procs

    launch_and_watch._sglang_elastic_watch = True
    RayEngine._launch_scheduler_processes = classmethod(launch_and_watch)


def _parse(argv: Sequence[str]):
    ap = argparse.ArgumentParser(prog="python -m sglang_elastic.eval.ray_entry", description=__doc__.split("\n")[0])
    ap.add_argument("--placement-group", required=True)
    ap.add_argument("--namespace", default=NAMESPACE)
    argv = list(argv)
    if "--" not in argv:
        ap.error("put the launch_server flags after --")
    i = argv.index("--")
    return ap.parse_args(argv[:i]), argv[i + 1 :]


def main(argv: Optional[List[str]] = None) -> int:
    args, server_argv = _parse(sys.argv[1:] if argv is None else argv)
    _drop_empty_cuda_visible_devices()
    if "--use-ray" not in server_argv:
        server_argv.append("--use-ray")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.server_args import prepare_server_args

    # Parse first: our plugin publishes SGLANG_ELASTIC_CONFIG while parsing, and
    # the job's runtime_env is fixed at ray.init.
    server_args = prepare_server_args(server_argv)
    attach(args.placement_group, args.namespace)
    install_scheduler_watch()
    from sglang.launch_server import run_server
    from sglang.srt.utils import kill_process_tree

    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
