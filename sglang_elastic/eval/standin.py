"""A CPU stand-in for ``launch_server``: the HTTP surface the launcher and the
client use (``/health``, ``/server_info``, streaming ``/generate`` with
``input_ids``), with a simple timing model, so the Ray launcher and the
workloads run end to end without a GPU (tests; a dry run of a config with
``scripts/eval/run.py --standin``).

    python -m sglang_elastic.eval.standin --port P [--placement-group NAME --namespace NS]
        [--max-total-num-tokens N] [--chunked-prefill-size C] [--prefill-tok-s R] [--itl-ms T]
        [--incremental-streaming-output]

With ``--placement-group`` it joins the group the way
:mod:`sglang_elastic.eval.ray_entry` does for SGLang, then, like SGLang's
``RayEngine``, runs a ``num_gpus=1`` probe actor per TP rank in bundle 0 and
reports what those workers saw (their GPU ids, the forwarded environment and
whether the worker setup hook ran) under ``standin`` in ``/server_info``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional


def _probe(pg, tp: int) -> Dict[str, Any]:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from sglang_elastic.eval.ray_entry import MARK_ENV

    @ray.remote
    class Probe:  # stands for sglang.srt.ray.scheduler_actor.SchedulerActor
        def info(self) -> Dict[str, Any]:
            return {
                "gpu_ids": [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])],
                "node_ip": ray.util.get_node_ip_address(),
                "setup_hook_ran": os.environ.get(MARK_ENV) == "1",
                "env": {k: v for k, v in os.environ.items() if k.startswith("SGLANG_")},
            }

    current = ray.util.get_current_placement_group()
    actors = [Probe.options(num_cpus=0, num_gpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=current, placement_group_bundle_index=0)).remote() for _ in range(tp)]
    infos = ray.get([a.info.remote() for a in actors], timeout=120)
    for a in actors:
        ray.kill(a)
    return {"bundle_specs": current.bundle_specs, "pg_is_named_group": current.id == pg.id, "ranks": infos, "driver_ip": ray.util.get_node_ip_address()}


def _record(op: str, **fields) -> None:
    """One line of the elastic pool's events file, as the controller writes it."""
    from sglang_elastic.config import EVENTS_ENV

    path = os.environ.get(EVENTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"op": op, **fields, "t": time.time()}) + "\n")


def make_app(info: Dict[str, Any], prefill_tok_s: float, itl_s: float, incremental: bool = False, elastic: bool = False,
             crash_above: int = 0, crash_at: int = 1):
    from aiohttp import web

    chunk = max(1, int(info.get("chunked_prefill_size") or 8192))
    lock = asyncio.Lock()  # one "GPU": prefill chunks run one at a time
    # the elastic pool's dynamic mode, as the controller runs it: lend once
    # requests decode and no prefill is pending, reclaim before a prompt
    # longer than a chunk if lent
    state = {"lent": False, "prefilling": 0, "long_prompts": 0}

    async def health(_):
        return web.Response(text="ok")

    async def server_info(_):
        return web.json_response(info)

    async def generate(request):
        body = await request.json()
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            return web.json_response({"error": {"message": "input_ids required (server runs with --skip-tokenizer-init)"}}, status=400)
        n_out = int(body.get("sampling_params", {}).get("max_new_tokens", 16))
        if crash_above and len(ids) > crash_above:
            state["long_prompts"] += 1
            if state["long_prompts"] == crash_at:  # as SGLang's server exits once a scheduler dies
                # the line SGLang's scheduler actor writes as it dies (sglang/srt/ray/scheduler_actor.py)
                print(f"[standin] Scheduler PP0 TP0 crashed: exiting on purpose at prompt {crash_at} of more than {crash_above} tokens (--crash-above, --crash-at)", flush=True)
                os._exit(4)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if elastic and len(ids) > chunk and state["lent"]:
            state["lent"] = False
            _record("reclaim", ms=1.5, wait_ms=0.5, vacate_ms=0.5, unmap_ms=0.5, moved_units=0, retracted=0)
        state["prefilling"] += 1
        try:
            for start in range(0, len(ids), chunk):
                async with lock:
                    await asyncio.sleep(min(chunk, len(ids) - start) / prefill_tok_s)
        finally:
            state["prefilling"] -= 1
        if elastic and n_out > 1 and not state["lent"] and not state["prefilling"]:
            state["lent"] = True
            _record("lend", ms=1.0)
        out: List[int] = []
        try:
            for i in range(n_out):
                if i:
                    await asyncio.sleep(itl_s)
                out.append(7)
                obj = {"output_ids": [7] if incremental else list(out), "meta_info": {"prompt_tokens": len(ids), "completion_tokens": len(out), "finish_reason": None if i < n_out - 1 else {"type": "length"}}}
                await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:  # the client closed the stream (an aborted request, as SGLang sees it): not an error
            pass
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_post("/generate", generate)
    return app


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_elastic.eval.standin")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--placement-group", default=None)
    ap.add_argument("--namespace", default=None)
    ap.add_argument("--setup-hook", default=None, help="worker_process_setup_hook for the group's workers (default: ray_entry's)")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--max-total-num-tokens", type=int, default=906051)
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--mem-fraction-static", type=float, default=0.903)
    ap.add_argument("--prefill-tok-s", type=float, default=2_000_000.0)
    ap.add_argument("--itl-ms", type=float, default=2.0)
    ap.add_argument("--startup-delay-s", type=float, default=0.0)
    ap.add_argument("--incremental-streaming-output", action="store_true", help="chunks carry the new output_ids only, as SGLang's flag")
    ap.add_argument("--fail", action="store_true", help="exit with status 3 before serving (tests)")
    ap.add_argument("--crash-above", type=int, default=0, metavar="N", help="exit with status 4 when the --crash-at-th prompt longer than N tokens arrives (tests: a server that dies)")
    ap.add_argument("--crash-at", type=int, default=1, metavar="K", help="which prompt longer than --crash-above ends the server (default 1: the first)")
    ap.add_argument("--enable-elastic-kv", action="store_true", help="write lend and reclaim records to $SGLANG_ELASTIC_EVENTS: a lend when a request starts decoding with no prefill pending and nothing lent, a reclaim before a prompt longer than a chunk while lent")
    a, _unknown = ap.parse_known_args(argv)  # SGLang flags a config passes are accepted and ignored
    time.sleep(a.startup_delay_s)
    if a.fail:
        print("standin: failing on purpose (--fail)", flush=True)
        return 3
    info: Dict[str, Any] = {
        "version": "standin",
        "tp_size": a.tp_size,
        "max_total_num_tokens": a.max_total_num_tokens,
        "chunked_prefill_size": a.chunked_prefill_size,
        "mem_fraction_static": a.mem_fraction_static,
        "internal_states": [{"memory_usage": {"weight": 14.96, "kvcache": round(a.max_total_num_tokens * 131072 / (1 << 30), 3), "startup_available": 9.02, "token_capacity": a.max_total_num_tokens, "graph": {}}}],
        "standin": {"pid": os.getpid(), "argv": sys.argv[1:]},
    }
    if a.placement_group:
        from sglang_elastic.eval import ray_entry

        kw = {"setup_hook": a.setup_hook} if a.setup_hook else {}
        pg = ray_entry.attach(a.placement_group, a.namespace or ray_entry.NAMESPACE, **kw)
        info["standin"]["probe"] = _probe(pg, a.tp_size)
    from aiohttp import web

    print(f"standin: serving on {a.host}:{a.port}", flush=True)
    web.run_app(make_app(info, a.prefill_tok_s, a.itl_ms / 1000.0, a.incremental_streaming_output, a.enable_elastic_kv, a.crash_above, a.crash_at), host=a.host, port=a.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
