"""The Ray launcher on a real local Ray cluster (2 CPUs, 4 fake GPUs): placement
groups of TP GPUs, the server's Ray workers inside them with the forwarded
environment and the setup hook, health wait, workloads timed from the stream,
failures as rows, logs on the driver. The server is the CPU stand-in."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from sglang_elastic.eval import client, config, experiments
from sglang_elastic.eval.client import RequestRecord

ray = pytest.importorskip("ray")


def test_time_shares_split_the_wall_time_by_request_phase():
    # A waits 0-1 and decodes 1-5; B waits 2-3 and decodes 3-4; C waits 6-7, decodes 7-8.
    recs = [RequestRecord(1, 1, 0.0, 1.0, 5.0), RequestRecord(1, 1, 2.0, 3.0, 4.0), RequestRecord(1, 1, 6.0, 7.0, 8.0)]
    s = client.time_shares(recs)
    assert s["wall_s"] == 8.0
    assert s["prefill_s"] == 3.0  # 0-1, 2-3, 6-7
    assert s["decode_only_s"] == 4.0  # 1-2, 3-5, 7-8
    assert s["idle_s"] == 1.0  # 5-6
    assert s["decode_only_fraction"] == 0.5


def test_itl_counts_every_token_of_a_chunk_inside_the_window():
    r = RequestRecord(1, 8, 0.0, 1.0, 2.0, chunk_times=[1.0, 1.1, 1.5, 1.6], chunk_tokens=[1, 1, 2, 1])
    assert client.itl_in_window([r], 1.05, 1.55) == pytest.approx([0.1, 0.2, 0.2])
    assert client.summary([1.0, 2.0, 3.0, 4.0])["median"] == 2.5


@pytest.mark.parametrize("incremental", [True, False])
def test_the_client_counts_tokens_of_incremental_and_cumulative_streams(incremental):
    """Against the stand-in's /generate (SGLang's chunk format): one token per
    chunk either way; with --incremental-streaming-output a chunk holds the
    new ids only and the count comes from the running completion_tokens."""
    import asyncio

    import aiohttp
    from aiohttp.test_utils import TestServer

    from sglang_elastic.eval.standin import make_app

    async def go():
        server = TestServer(make_app({"chunked_prefill_size": 8}, prefill_tok_s=1e6, itl_s=0.001, incremental=incremental))
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as session:
                return await client.stream_generate(session, str(server.make_url("")), [11, 12, 13], 5)
        finally:
            await server.close()

    rec = asyncio.run(go())
    assert rec.error is None and rec.output_tokens == 5 and rec.chunk_tokens == [1] * 5 and len(rec.chunk_times) == 5
    # the mode is read off the chunks, not assumed
    mode = "incremental" if incremental else "cumulative"
    assert rec.streaming == mode and client.observed_streaming([RequestRecord(1, 1, 0.0), rec]) == mode
    assert client.observed_streaming([RequestRecord(1, 1, 0.0)]) == "unknown"  # no second chunk: cannot tell
    assert client.observed_streaming([rec, dataclasses.replace(rec, streaming="cumulative")]) == "cumulative"
    # without completion_tokens, an incremental chunk adds its ids to the count so far
    assert client._tokens_so_far({"output_ids": [4, 5]}, 3) == 5 and client._tokens_so_far({"output_ids": [4], "meta_info": {"completion_tokens": 9}}, 3) == 9


@pytest.mark.parametrize("kind", ["decode_then_long", "mix"])
def test_the_warm_up_sends_one_longest_prompt_first_and_leaves_the_measured_requests_unchanged(kind, monkeypatch):
    """run_workload's warm-up: one unmeasured request of the workload's longest
    prompt, before any measured one; the measured requests are the same ids
    with and without it (its prompt comes from its own random stream)."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "sglang_elastic.eval.standin", "--port", str(port), "--host", "127.0.0.1", "--chunked-prefill-size", "16",
                             "--prefill-tok-s", "1e6", "--itl-ms", "1", "--incremental-streaming-output"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        sent = []
        real = client.stream_generate

        async def recording(session, u, input_ids, max_new_tokens, rec=None):
            sent.append((list(input_ids), max_new_tokens))
            return await real(session, u, input_ids, max_new_tokens, rec)

        monkeypatch.setattr(client, "stream_generate", recording)
        if kind == "decode_then_long":
            w = {"kind": kind, "decodes": 2, "decode_input_len": 5, "decode_output_len": 40, "long_prompts": 2, "long_input_len": 37, "long_output_len": 2, "settle_s": 0.0, "seed": 3}
            longest = 37
        else:
            w = {"kind": kind, "name": "m", "num_requests": 3, "request_rate": float("inf"), "input_len": {"dist": "uniform", "min": 4, "max": 29}, "output_len": {"dist": "fixed", "value": 3}, "seed": 3}
            longest = 29
        out = client.run_workload(url, w, vocab_size=32000)
        with_warm, sent[:] = list(sent), []
        plain = client.run_workload(url, w, vocab_size=32000, warmup=False)
        without = list(sent)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    ids, n_out = with_warm[0]
    assert len(ids) == longest and n_out == 1 and all(1000 <= i < 32000 for i in ids)
    assert out["warmup"]["input_len"] == longest and out["warmup"]["error"] is None and out["warmup"]["ttft_s"] > 0
    assert plain["warmup"] is None
    assert sorted(map(str, with_warm[1:])) == sorted(map(str, without)) and len(without) == (4 if kind == "decode_then_long" else 3)
    assert ids not in [x for x, _ in without]


def test_facts_read_sglang_0_5_17_server_info_fields():
    info = {"version": "0.5.17", "max_total_num_tokens": 906051, "mem_fraction_static": 0.903, "chunked_prefill_size": 8192, "tp_size": 1,
            "internal_states": [{"memory_usage": {"weight": 15.0, "kvcache": 110.6, "startup_available": 9.02, "token_capacity": 906051, "graph": {"decode": 0.5}}}]}
    f = experiments.facts(info, 143771)
    assert (f["max_total_num_tokens"], f["free_after_graphs_gib"], f["kv_cache_gib"]) == (906051, 9.02, 110.6)
    pre_free = (110.6 + 15.0) / 0.903
    assert f["reserve_gib"] == pytest.approx(pre_free * 0.097)
    assert f["reserve_fraction_of_kv_pool"] == pytest.approx(pre_free * 0.097 / 110.6)
    assert f["reserve_fraction_of_hbm"] == pytest.approx(pre_free * 0.097 / (143771 / 1024))
    assert f["sglang_elastic"] is None  # stock server, unpatched
    info["sglang_elastic"] = {"version": "0.1.0", "patched": True}
    info["internal_states"][0]["sglang_elastic"] = {"base_tokens": 906051, "lendable_tokens": 65536, "lent_tokens": 0}
    f = experiments.facts(info, 143771)
    assert f["sglang_elastic"] == {"version": "0.1.0", "patched": True, "base_tokens": 906051, "lendable_tokens": 65536, "lent_tokens": 0}


def test_real_server_rows_run_sglang_launch_server_with_use_ray_in_the_group():
    e = config.parse({"experiment": "reserve_vs_tp", "servers": [{"label": "q", "model": "qwen2.5-32b", "tp": 2, "chunked_prefill_size": 4096, "env": {"SGLANG_ENABLE_POST_CAPTURE_KV_SIZING": "1"}}]})
    job = experiments.job_for(e, e.servers[0])
    i = job.argv.index("--")
    assert job.argv[:i] == ["{python}", "-m", "sglang_elastic.eval.ray_entry", "--placement-group", "{pg_name}", "--namespace", "{namespace}"]
    rest = job.argv[i + 1 :]
    assert rest[rest.index("--model-path") + 1].endswith("models/qwen2.5-32b")
    for flag, value in (("--tp-size", "2"), ("--chunked-prefill-size", "4096"), ("--load-format", "dummy"), ("--attention-backend", "flashinfer"), ("--port", "{port}")):
        assert rest[rest.index(flag) + 1] == value
    assert "--use-ray" in rest and "--skip-tokenizer-init" in rest and "--incremental-streaming-output" in rest
    assert job.gpus == 2 and job.vocab_size == 152064
    assert job.env["SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"] == "1" and job.env["NCCL_NVLS_ENABLE"] == "0"
    assert job.env["RAY_DEDUP_LOGS"] == "0"  # each TP rank's lend/reclaim lines, not one per cluster


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    from sglang_elastic.eval.launcher import Launcher

    if ray.is_initialized():
        ray.shutdown()
    with Launcher(num_cpus=2, num_gpus=4, log_dir=str(tmp_path_factory.mktemp("logs"))) as L:
        yield L


def _exp(**kw):
    base = {
        "experiment": "ttft_vs_chunk",
        "cluster": {"warm_first": False},
        "servers": [{"label": "tp2", "tp": 2, "chunked_prefill_size": 2048, "env": {"SGLANG_EVAL_PROBE": "forwarded"}}, {"label": "tp1", "tp": 1, "chunked_prefill_size": 8192}],
        "workloads": [{"kind": "decode_then_long", "decodes": 3, "decode_input_len": 8, "decode_output_len": 3000, "long_prompts": 2, "long_input_len": 4096, "long_output_len": 4, "settle_s": 0.1}],
    }
    base.update(kw)
    return config.parse(base)


def test_servers_run_in_their_placement_groups_and_results_reach_the_driver(launcher, tmp_path):
    out = experiments.run(_exp(), launcher, results_dir=tmp_path, standin=True, progress=False)
    rows = {r["label"]: r for r in out["rows"]}
    assert [r["label"] for r in out["rows"]] == ["tp2", "tp1"]
    assert all(r["ok"] for r in rows.values()), [r["error"] for r in rows.values()]
    r2 = rows["tp2"]
    assert r2["facts"]["chunked_prefill_size"] == 2048 and r2["facts"]["max_total_num_tokens"] == 906051
    w = r2["workloads"][0]
    assert w["num_errors"] == 0 and w["ttft_s"]["n"] == 2 and w["decodes_finished_early"] == 0
    assert w["ttft_s"]["median"] > 0 and w["decode_itl_s"]["n"] > 10
    # the client says how the server streamed, and what share of a core it used
    assert w["client"]["streaming"] == "incremental" and 0 < w["client"]["cpu_share"] < 2
    assert "sglang_elastic_after" in w and w["sglang_elastic_after"] is None  # read again after the workload; a stock server has none
    assert w["warmup"]["input_len"] == 4096 and w["warmup"]["error"] is None  # one unmeasured long prompt first
    import socket

    # where each row ran: the node, and the bundle's GPUs, the ones SGLang's ranks got
    h2, h1 = r2["host"], rows["tp1"]["host"]
    assert h2["hostname"] == h1["hostname"] == socket.gethostname()
    assert len(h2["gpu_ids"]) == 2 and h2["gpu_uuids"] == [] and h2["node_gpu_uuids"] == []  # no nvidia-smi here
    assert len(h1["gpu_ids"]) == 1 and not set(h1["gpu_ids"]) & set(h2["gpu_ids"])  # side by side on the 4 fake GPUs
    # the server's log came back to the driver, and it holds the stand-in's own output
    assert "standin: serving on" in Path(r2["log"]).read_text()
    # the decodes' streams closed at the end are aborts, as in SGLang, not tracebacks in the server log
    assert "Traceback" not in Path(r2["log"]).read_text()


def test_an_elastic_rows_lend_and_reclaim_records_reach_its_row_and_its_table_note(launcher, tmp_path):
    from sglang_elastic.eval import report

    # the long prompts 0.5 s apart: each one's 2-ms prefill ends before the next arrives
    spaced = {**_exp().workloads[0].model_dump(mode="json"), "long_interval_s": 0.5}
    exp = _exp(servers=[{"label": "el", "tp": 1, "chunked_prefill_size": 2048, "enable_elastic_kv": True}, {"label": "stock", "tp": 1, "chunked_prefill_size": 2048}],
               workloads=[spaced])
    out = experiments.run(exp, launcher, results_dir=tmp_path, standin=True, progress=False)
    rows = {r["label"]: r for r in out["rows"]}
    assert all(r["ok"] for r in rows.values()), [r["error"] for r in rows.values()]
    ev = rows["el"]["workloads"][0]["sglang_elastic_events"]
    # as the controller's dynamic mode: the warm-up request comes alone with
    # nothing lent (no reclaim) and does not decode (no lend); the decodes
    # lend; each long prompt reclaims before its prefill and lends after it
    assert ev["reclaim_ms"]["n"] == 2 and ev["lend_ms"]["n"] == 3 and ev["reclaim_ms"]["values"] == [1.5] * 2
    assert ev["reclaim_wait_ms"] == {"first": 0.5, "median": 0.5, "max": 0.5} and ev["moved_units"] == 0 and ev["retracted"] == 0
    assert rows["stock"]["workloads"][0]["sglang_elastic_events"] is None  # no events file without the elastic pool
    md, _plot = report.ttft_vs_chunk(out)
    [el_line] = [l for l in md.splitlines() if l.startswith("| el |")]
    assert "reclaims 1.5–1.5 ms (median 1.5; the first 1.5)" in el_line


def test_the_standin_lends_and_reclaims_as_the_dynamic_controller(tmp_path, monkeypatch):
    """No reclaim for a prompt that finds nothing lent, no lend while a
    prefill is pending. 100-token chunks take 0.2 s each, one at a time:
    long prompts A and B (300 tokens) arrive together and alternate chunks,
    A is done at 1.0 s, B at 1.2 s; C arrives at 1.1 s, when a lend after A
    alone would have made it reclaim."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from sglang_elastic.config import EVENTS_ENV
    from sglang_elastic.eval import standin

    events = tmp_path / "events.jsonl"
    monkeypatch.setenv(EVENTS_ENV, str(events))
    app = standin.make_app({"chunked_prefill_size": 100}, prefill_tok_s=500.0, itl_s=0.001, incremental=True, elastic=True)

    async def go():
        async with TestClient(TestServer(app)) as c:
            async def gen(n_in: int, n_out: int, after_s: float = 0.0) -> None:
                await asyncio.sleep(after_s)
                r = await c.post("/generate", json={"input_ids": [1] * n_in, "sampling_params": {"max_new_tokens": n_out}})
                await r.read()

            await gen(300, 1)  # alone: nothing lent, and no decode step to lend after
            assert not events.exists()
            await gen(10, 50)  # a decode lends once its prefill is done
            await asyncio.gather(gen(300, 2), gen(300, 2), gen(300, 2, after_s=1.1))

    asyncio.run(go())
    assert [json.loads(line)["op"] for line in events.read_text().splitlines()] == ["lend", "reclaim", "lend"]


def test_events_are_read_from_an_offset_and_a_line_still_being_written_waits(tmp_path):
    from sglang_elastic.eval.launcher import ServerActor, summarize_events

    a = ServerActor("row", str(tmp_path))
    assert a.events(0) == ([], 0)  # no file: a stock server
    a.events_path.write_text('{"op": "reclaim", "ms": 20.0, "wait_ms": 1.0, "vacate_ms": 3.0, "unmap_ms": 16.0, "moved_units": 2, "retracted": 0}\n{"op": "lend", "ms": 1')
    recs, off = a.events(0)
    assert [r["op"] for r in recs] == ["reclaim"] and off == a.events_path.read_text().index("\n") + 1
    with open(a.events_path, "a") as f:
        f.write('2.5}\n{"op": "reclaim", "ms": 60.0, "vacate_ms": 50.0, "moved_units": 3, "retracted": 1}\n{"op": "reclaim_skipped", "need": 0}\n{"op": "reclaim", "ms": 10.0}\n')
    more, off2 = a.events(off)
    assert [r["op"] for r in more] == ["lend", "reclaim", "reclaim_skipped", "reclaim"] and off2 == a.events_path.stat().st_size
    ev = summarize_events(recs + more)
    assert ev["reclaim_ms"] == {"n": 3, "first": 20.0, "min": 10.0, "median": 20.0, "max": 60.0, "values": [20.0, 60.0, 10.0]}
    assert ev["lend_ms"]["values"] == [12.5] and ev["reclaim_vacate_ms"] == {"first": 3.0, "median": 26.5, "max": 50.0}
    assert ev["moved_units"] == 5 and ev["retracted"] == 1 and ev["reclaims_skipped"] == 1
    # malformed records do not cost the row its measurement; a recreated file is read from its start
    bad = summarize_events([{"op": "reclaim", "ms": float("nan"), "moved_units": "2.0"}, {"op": "reclaim", "ms": "x", "retracted": None}, {"op": "lend", "ms": 3}])
    assert "reclaim_ms" not in bad and bad["lend_ms"]["values"] == [3.0] and bad["moved_units"] == 2 and bad["retracted"] == 0 and bad["reclaims_skipped"] == 0
    a.events_path.write_text('[1, 2]\n{"op": "lend", "ms": 4.0}\n')  # shorter than off2 now; a line that is not a record is skipped
    assert a.events(off2) == ([{"op": "lend", "ms": 4.0}], a.events_path.stat().st_size)


def test_only_runs_the_named_rows_keeps_earlier_ones_and_reports_progress(launcher, tmp_path):
    first = experiments.run(_exp(), launcher, results_dir=tmp_path, standin=True, progress=False, only=["tp1"])
    rows = {r["label"]: r for r in first["rows"]}
    assert rows["tp1"]["ok"] and rows["tp1"]["measured"]["date"]
    assert not rows["tp2"]["ok"] and "not in --only" in rows["tp2"]["error"]
    seen = []
    second = experiments.run(_exp(), launcher, results_dir=tmp_path, standin=True, progress=False, only=["tp2"], previous=first,
                             on_progress=lambda body: seen.append({r["label"]: r["ok"] for r in body["rows"]}))
    rows2 = {r["label"]: r for r in second["rows"]}
    assert rows2["tp1"] is not None and rows2["tp1"]["measured"] == rows["tp1"]["measured"]  # kept, not rerun
    assert rows2["tp2"]["ok"]
    assert seen == [{"tp2": True, "tp1": True}]  # one progress write per finished server
    # a kept row must have measured the same server: another chunk size is not kept
    changed = _exp(servers=[{"label": "tp2", "tp": 2, "chunked_prefill_size": 2048, "env": {"SGLANG_EVAL_PROBE": "forwarded"}}, {"label": "tp1", "tp": 1, "chunked_prefill_size": 4096}])
    third = experiments.run(changed, launcher, results_dir=tmp_path, standin=True, progress=False, only=["tp2"], previous=second)
    assert not {r["label"]: r for r in third["rows"]}["tp1"]["ok"]
    # nor one that ran other workloads
    other = _exp(workloads=[{**_exp().workloads[0].model_dump(mode="json"), "decodes": 2}])
    fourth = experiments.run(other, launcher, results_dir=tmp_path, standin=True, progress=False, only=["tp2"], previous=second)
    assert not {r["label"]: r for r in fourth["rows"]}["tp1"]["ok"]
    # a row not measured yet keeps its reason when --only names another row
    waiting = {**second, "rows": [r if r["label"] != "tp1" else {**r, "ok": False, "error": "not run (cluster too small): tp1 needs 1 GPU(s)", "workloads": []} for r in second["rows"]]}
    fifth = experiments.run(_exp(), launcher, results_dir=tmp_path, standin=True, progress=False, only=["tp2"], previous=waiting)
    assert {r["label"]: r for r in fifth["rows"]}["tp1"]["error"] == "not run (cluster too small): tp1 needs 1 GPU(s)"
    # a full rerun reports the earlier rows for servers not finished yet
    early = []
    experiments.run(_exp(), launcher, results_dir=tmp_path, standin=True, progress=False, previous=second,
                    on_progress=lambda body: early.append({r["label"]: r.get("measured") for r in body["rows"]}))
    first_write = early[0]
    assert sum(m != rows2[k]["measured"] for k, m in first_write.items()) == 1  # one row new, the other still the earlier one
    with pytest.raises(ValueError, match="no row nope"):
        experiments.run(_exp(), launcher, results_dir=tmp_path, standin=True, progress=False, only=["nope"])


def test_the_server_job_sees_the_reserved_group_gpus_env_and_setup_hook(launcher, tmp_path):
    e = _exp(workloads=[{"kind": "decode_then_long", "decodes": 0, "long_prompts": 1, "long_input_len": 16, "long_output_len": 2, "settle_s": 0}])
    job = experiments.job_for(e, e.servers[0], standin=True)
    [res] = launcher.run([job], progress=False)
    assert res.ok, res.error
    assert "--incremental-streaming-output" in res.server_info["standin"]["argv"]  # what the client needs of every server
    probe = res.server_info["standin"]["probe"]
    assert probe["bundle_specs"] == [{"CPU": 1.0, "GPU": 2.0}]
    assert probe["pg_is_named_group"] is True  # ray.util.get_current_placement_group() answered with ours
    ranks = probe["ranks"]
    assert len(ranks) == 2 and sorted(g for r in ranks for g in r["gpu_ids"]) == sorted(set(g for r in ranks for g in r["gpu_ids"]))
    assert all(r["setup_hook_ran"] and r["env"]["SGLANG_EVAL_PROBE"] == "forwarded" for r in ranks)
    assert all(r["node_ip"] == probe["driver_ip"] for r in ranks)  # rank 0 beside the HTTP server, as RayEngine requires
    # the GPUs recorded for the row (a task holding the bundle before the start) are the ones the ranks got
    assert res.host["gpu_ids"] == sorted(g for r in ranks for g in r["gpu_ids"])


def test_failures_are_rows_with_the_reason(launcher, tmp_path):
    from sglang_elastic.eval.launcher import ServerJob

    jobs = [
        ServerJob(name="dies", argv=["{python}", "-m", "sglang_elastic.eval.standin", "--port", "{port}", "--fail"], gpus=1, startup_timeout_s=60),
        ServerJob(name="too-big", argv=["{python}", "-c", "pass"], gpus=8),
    ]
    dies, big = launcher.run(jobs, progress=False)
    assert not dies.ok and "RuntimeError: server exited with status 3 before it was healthy" in dies.error and "failing on purpose" in dies.error
    assert not big.ok and big.error == "not run (cluster too small): too-big needs 8 GPU(s) on one node; the largest node in the cluster has 4"
    assert experiments.not_measured({"ok": big.ok, "error": big.error})  # a row waiting for a larger cluster, not a failure
    assert ray.util.placement_group_table() and all(p["state"] == "REMOVED" for p in ray.util.placement_group_table().values())


@pytest.mark.parametrize("crash_at, during", [(1, "the warm-up request"), (2, "the workload (")])
def test_a_server_that_dies_is_a_failed_row_with_its_log_tail(launcher, crash_at, during):
    """The client's requests fail once the server is gone, and the row says
    why instead of reporting the requests that happened to finish; a server
    the warm-up request took down gets no workload."""
    import time

    from sglang_elastic.eval.launcher import ServerJob

    w = _exp().workloads[0].model_dump(mode="json")  # 4,096-token long prompts (the warm-up's too), 3,000-token decodes
    argv = ["{python}", "-m", "sglang_elastic.eval.standin", "--port", "{port}", "--crash-above", "1000", "--crash-at", str(crash_at)]
    t0 = time.monotonic()
    [res] = launcher.run([ServerJob(name=f"dies-at-{crash_at}", argv=argv, gpus=1, workloads=[w], startup_timeout_s=60)], progress=False)
    assert not res.ok and res.workloads == []
    # the first line says why: the crash line the server wrote, found in its log
    first = res.error.splitlines()[0]
    assert first.startswith(f"RuntimeError: server exited with status 4 during {during}")
    assert first.endswith(f"; cause: exiting on purpose at prompt {crash_at} of more than 1000 tokens (--crash-above, --crash-at); log tail:")
    if crash_at == 1:  # not the workload's 3,000-token decodes against a dead server
        assert time.monotonic() - t0 < 30


def _scheduler_loops(ray_mod):
    """Two stand-ins of ``SchedulerActor.run_event_loop`` (rank 1 raises after
    0.3 s, rank 0 runs for 2 min) and a
    ``block_until_scheduler_exits`` that closes over their refs under
    SGLang's name, as ``sglang/srt/ray/engine.py`` does."""
    import time
    import types

    @ray_mod.remote(num_cpus=0)
    def run_event_loop(rank: int):
        time.sleep(0.3 if rank == 1 else 120.0)
        if rank == 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 98.00 MiB (rank 1)")

    event_loop_refs = [run_event_loop.remote(0), run_event_loop.remote(1)]

    def block_until_scheduler_exits():
        try:
            ray_mod.get(event_loop_refs)
        except Exception:
            pass

    return types.SimpleNamespace(block_until_scheduler_exits=block_until_scheduler_exits), event_loop_refs


def test_a_dead_scheduler_actor_stops_the_server_while_the_others_run_on(launcher):
    """Gap 5 of ray_entry: the watcher fires on the first event loop that
    ends (rank 1's error), not when every rank has ended."""
    from sglang_elastic.eval import ray_entry

    result, refs = _scheduler_loops(ray)
    calls = []
    t = ray_entry.watch_schedulers(result, lambda why, crashed: calls.append((why, crashed)))
    t.join(60)
    try:
        assert not t.is_alive() and len(calls) == 1
        why, crashed = calls[0]
        assert crashed and why.startswith("a scheduler actor died: ") and "CUDA out of memory. Tried to allocate 98.00 MiB (rank 1)" in why
        assert ray.wait([refs[0]], timeout=0)[0] == []  # rank 0 still runs: the watcher did not wait for it
    finally:
        ray.cancel(refs[0], force=True)


def test_a_scheduler_loop_that_returns_is_a_shutdown_not_a_crash(launcher):
    from sglang_elastic.eval import ray_entry

    @ray.remote(num_cpus=0)
    def run_event_loop():
        return None

    event_loop_refs = [run_event_loop.remote()]

    def block_until_scheduler_exits():
        ray.get(event_loop_refs)

    import types

    calls = []
    t = ray_entry.watch_schedulers(types.SimpleNamespace(block_until_scheduler_exits=block_until_scheduler_exits), lambda *a: calls.append(a))
    t.join(60)
    assert calls == [("a scheduler event loop returned", False)]


def test_the_watcher_falls_back_to_sglangs_own_wait_when_the_refs_are_not_found(launcher):
    """Without the refs it waits as SGLang's own function does: ``ray.get``
    of the list, which raises at the first error (rank 1's) while rank 0
    still runs."""
    from sglang_elastic.eval import ray_entry

    result, refs = _scheduler_loops(ray)
    inner = result.block_until_scheduler_exits

    def opaque():  # no closure over event_loop_refs
        inner()

    result.block_until_scheduler_exits = opaque
    calls = []

    def on_exit(why, crashed):
        calls.append((why, crashed, [r in ray.wait(refs, num_returns=2, timeout=0)[0] for r in refs]))

    t = ray_entry.watch_schedulers(result, on_exit)
    t.join(60)
    try:
        assert not t.is_alive() and calls == [("the scheduler event loops ended", True, [False, True])]
    finally:
        ray.cancel(refs[0], force=True)


def test_every_ray_server_launch_gets_the_watcher_and_sglang_still_needs_it(monkeypatch):
    """SGLang 0.5.17's Ray HTTP server never calls block_until_scheduler_exits
    (gap 5 still open in the pinned release) and keeps the event loops' refs
    under the name the watcher reads, on the TP and the DP path;
    install_scheduler_watch wraps the launch once, however often it is
    called, passes the class on and hands back SGLang's result; main()
    installs it."""
    import inspect

    import sglang.srt.ray.http_server as ray_http
    from sglang.srt.ray.engine import RayEngine

    from sglang_elastic.eval import ray_entry

    assert "block_until_scheduler_exits" not in inspect.getsource(ray_http)
    for path in (RayEngine._launch_scheduler_processes, RayEngine._launch_dp_scheduler_processes):
        src = inspect.getsource(path)
        assert "def block_until_scheduler_exits" in src and "ray.get(event_loop_refs)" in src
    assert "install_scheduler_watch()" in inspect.getsource(ray_entry.main)

    sentinel = object()
    seen = []

    def fake_launch(cls, *args, **kwargs):
        seen.append((cls, args))
        return sentinel, None

    monkeypatch.setattr(RayEngine, "_launch_scheduler_processes", classmethod(fake_launch))
    watched = []
    monkeypatch.setattr(ray_entry, "watch_schedulers", watched.append)
    ray_entry.install_scheduler_watch()
    ray_entry.install_scheduler_watch()
    assert RayEngine._launch_scheduler_processes("server_args", "port_args", "run_scheduler_process_func") == (sentinel, None)
    assert watched == [sentinel] and seen == [(RayEngine, ("server_args", "port_args", "run_scheduler_process_func"))]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_server_does_not_outlive_its_actor(launcher, tmp_path):
    """A device call's time limit kills the whole Ray session, the actor's
    worker with it; the server, in a session of its own, must stop with its
    actor instead of holding GPUs the next call waits for."""
    import os
    import signal
    import time

    actor = launcher._actor_cls.options(num_cpus=0).remote("orphan", str(tmp_path))
    started = ray.get(actor.start.remote(["{python}", "-m", "sglang_elastic.eval.standin", "--port", "{port}"], {}, "none", "ns"))
    ray.get(actor.wait_healthy.remote(60))  # a later call on the actor: the server outlives the call that started it
    pid = started["pid"]
    time.sleep(0.5)
    assert _alive(pid)
    # the actor's worker dies without a word (its raylet gone, as when a
    # device call's time limit kills the whole Ray session)
    worker = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    survived = _alive(pid)
    if survived:  # leave no stand-in behind for the tests after this one
        os.kill(pid, signal.SIGKILL)
    assert not survived, f"server {pid} outlived its actor"


def test_reuse_takes_an_identical_row_and_refuses_a_different_server(tmp_path):
    e1 = _exp()
    row = {"label": "tp1", "ok": True, "identity": e1.servers[1].identity(), "workloads": [{"workload": e1.workloads[0].model_dump(mode="json"), "ttft_s": {"median": 1.0}, "client": {"streaming": "incremental"}}], "facts": {"max_total_num_tokens": 5}}
    (tmp_path / "ttft_vs_chunk.json").write_text(json.dumps({"commit": "abc", "date": "2026-11-30", "rows": [row]}))
    e2 = config.parse({**_exp().model_dump(mode="json"), "experiment": "capacity", "baseline": "stock", "server_defaults": {}, "servers": [
        {"label": "stock", "tp": 1, "chunked_prefill_size": 8192, "reuse": "ttft_vs_chunk/tp1"},
        {"label": "other", "tp": 1, "chunked_prefill_size": 4096, "reuse": "ttft_vs_chunk/tp1"}]})
    got, why = experiments.find_reusable(e2, e2.servers[0], tmp_path)
    assert why == "" and got["label"] == "stock" and got["facts"]["max_total_num_tokens"] == 5 and "ttft_vs_chunk.json#tp1" in got["reused_from"]
    got, why = experiments.find_reusable(e2, e2.servers[1], tmp_path)
    assert got is None and "ran another server" in why
    # a row the older client measured (cumulative streaming, no client marker) is not reused
    del row["workloads"][0]["client"]
    (tmp_path / "ttft_vs_chunk.json").write_text(json.dumps({"commit": "abc", "date": "2026-11-30", "rows": [row]}))
    got, why = experiments.find_reusable(e2, e2.servers[0], tmp_path)
    assert got is None and "cumulative streaming" in why
    # E3 reads server facts only: how that row streamed does not matter there
    e3 = config.parse({"experiment": "reserve_vs_tp", "servers": [{"label": "llama-8b-tp1", "tp": 1, "chunked_prefill_size": 8192, "reuse": "ttft_vs_chunk/tp1"}]})
    got, why = experiments.find_reusable(e3, e3.servers[0], tmp_path)
    assert why == "" and got["facts"]["max_total_num_tokens"] == 5 and got["workloads"] == []


def test_sglangs_ray_engine_accepts_the_group_ray_entry_hands_it(launcher, monkeypatch):
    """SGLang's own bundle lookup (sglang/srt/ray/engine.py) on the group that
    ray_entry.attach makes current: rank 0 lands in bundle 0 beside the driver."""
    import ray.util
    from ray.util.placement_group import placement_group, remove_placement_group

    from sglang_elastic.eval import ray_entry

    pg = placement_group([{"CPU": 1, "GPU": 2}], strategy="STRICT_PACK", name="sglang-eval-test-attach")
    ray.get(pg.ready())
    monkeypatch.setattr(ray.util, "get_current_placement_group", ray.util.get_current_placement_group)  # restored after the test
    try:
        got = ray_entry.attach("sglang-eval-test-attach", launcher.namespace)
        assert got.id == pg.id and ray.util.get_current_placement_group().id == pg.id
        from sglang.srt.ray.engine import _find_engine_bundle

        assert _find_engine_bundle(ray.util.get_current_placement_group(), 1) == (0, ray.util.get_node_ip_address())
        with pytest.raises(ValueError, match="placement group 'nope' not found in namespace"):
            ray_entry.attach("nope", launcher.namespace)
    finally:
        remove_placement_group(pg)


def test_job_runtime_env_forwards_sglang_and_nccl_but_not_cuda_visible_devices():
    env = {"SGLANG_ENABLE_POST_CAPTURE_KV_SIZING": "1", "SGLANG_ELASTIC_CONFIG": "{}", "NCCL_NVLS_ENABLE": "0", "CUDA_VISIBLE_DEVICES": "0,1", "HOME": "/root"}
    from sglang_elastic.eval import ray_entry

    rt = ray_entry.job_runtime_env(environ=env)
    assert rt == {"env_vars": {"SGLANG_ENABLE_POST_CAPTURE_KV_SIZING": "1", "SGLANG_ELASTIC_CONFIG": "{}", "NCCL_NVLS_ENABLE": "0", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}, "worker_process_setup_hook": "sglang_elastic.eval.ray_entry.worker_setup"}


def test_a_reuse_row_is_taken_even_when_only_names_other_rows(tmp_path):
    """E3's llama-8b-tp1 reuses E1's stock row: a call that measures only the
    TP2 rows (--only / --resume) still fills it, since it costs no server."""
    e1 = _exp()
    row = {"label": "tp1", "ok": True, "identity": e1.servers[1].identity(), "workloads": [], "facts": {"max_total_num_tokens": 906051}}
    (tmp_path / "ttft_vs_chunk.json").write_text(json.dumps({"commit": "abc", "date": "2026-11-30", "rows": [row]}))
    e3 = config.parse({"experiment": "reserve_vs_tp", "servers": [
        {"label": "llama-8b-tp1", "tp": 1, "chunked_prefill_size": 8192, "reuse": "ttft_vs_chunk/tp1"},
        {"label": "llama-8b-tp2", "tp": 2, "chunked_prefill_size": 8192}]})

    class Recorder:  # stands in for the Ray launcher: records what it is asked to start
        def __init__(self):
            self.names = []

        def run(self, jobs, **kw):
            self.names += [j.name for j in jobs]
            return []

    rec = Recorder()
    out = experiments.run(e3, rec, results_dir=tmp_path, progress=False, only=["llama-8b-tp2"])
    rows = {r["label"]: r for r in out["rows"]}
    assert rec.names == ["llama-8b-tp2"]
    assert rows["llama-8b-tp1"]["ok"] and rows["llama-8b-tp1"]["facts"]["max_total_num_tokens"] == 906051
    assert "ttft_vs_chunk.json#tp1" in rows["llama-8b-tp1"]["reused_from"]


def test_no_server_starts_after_the_start_deadline_and_earlier_rows_stay(launcher, tmp_path):
    """run.py --start-deadline-s: a call with a time limit stops starting
    servers; rows not started keep the file's earlier measurement (or read as
    not run, for --resume), and their placement groups are released."""
    import time

    from sglang_elastic.eval.launcher import NOT_STARTED

    e = _exp()
    tp2, tp1 = e.servers
    kept = {"label": "tp1", "ok": True, "identity": tp1.identity(), "measured": {"date": "earlier"},
            "workloads": [{"workload": e.workloads[0].model_dump(mode="json"), "client": {"streaming": "incremental"}}]}
    out = experiments.run(e, launcher, results_dir=tmp_path, standin=True, progress=False, previous={"rows": [kept]},
                          start_deadline=time.monotonic() - 1.0)
    rows = {r["label"]: r for r in out["rows"]}
    assert rows["tp1"] is kept  # never started: the earlier row stands
    assert not rows["tp2"]["ok"] and rows["tp2"]["error"].startswith(NOT_STARTED)
    assert experiments.measured_labels(e, out) == ["tp1"]  # --resume would start tp2 only
    assert all(p["state"] == "REMOVED" for p in ray.util.placement_group_table().values())
    # a row the older client measured (no client marker) stays too, through a deadline and through --only, though --resume would measure it again
    stale = {**kept, "workloads": [{"workload": e.workloads[0].model_dump(mode="json")}]}
    for only in (None, ["tp2"]):
        out = experiments.run(e, launcher, results_dir=tmp_path, standin=True, progress=False, previous={"rows": [stale]}, only=only,
                              start_deadline=time.monotonic() - 1.0)
        assert {r["label"]: r for r in out["rows"]}["tp1"] is stale and experiments.measured_labels(e, out) == []


def test_a_failed_new_measurement_keeps_the_earlier_row_with_the_failure(launcher, tmp_path):
    e = _exp(servers=[{"label": "tp1", "tp": 1, "extra_args": ["--fail"]}])
    s = e.servers[0]
    stale = {"label": "tp1", "ok": True, "identity": s.identity(), "facts": {"max_total_num_tokens": 906056},
             "workloads": [{"workload": e.workloads[0].model_dump(mode="json")}]}
    out = experiments.run(e, launcher, results_dir=tmp_path, standin=True, progress=False, previous={"rows": [stale]})
    [row] = out["rows"]
    assert row["ok"] and row["facts"]["max_total_num_tokens"] == 906056 and "status 3" in row["remeasure_error"]
    from sglang_elastic.eval import report

    assert report._err(row).startswith("cumulative streaming (older client); measuring again failed: ")


def test_the_crash_cause_is_sglangs_crash_line_else_the_last_exception():
    """E2 TP 2's out-of-memory row (docs/results/eval/logs/, as SGLang's Ray
    mode wrote it: Ray's actor prefix, a traceback, the crash diagnostics
    after it) names the allocation that failed; a log with only a traceback
    names its exception; a log with neither names nothing."""
    from sglang_elastic.eval.launcher import crash_cause

    log = (Path(__file__).resolve().parents[1] / "docs/results/eval/logs/capacity_tp2.post-capture-mrr256-32768.oom.txt").read_text()
    cause = crash_cause(log)
    assert cause.startswith("CUDA out of memory. Tried to allocate 98.00 MiB. GPU ") and cause.endswith("…") and len(cause) <= 160
    tb = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\nValueError: first\n"
          "\x1b[36m(SchedulerActor pid=7)\x1b[0m Traceback (most recent call last):\n\x1b[36m(SchedulerActor pid=7)\x1b[0m   File \"y.py\", line 2\n"
          "\x1b[36m(SchedulerActor pid=7)\x1b[0m torch.OutOfMemoryError: CUDA out of memory. [repeated 2x across cluster]\nbye\n")
    assert crash_cause(tb) == "OutOfMemoryError: CUDA out of memory."  # the last traceback's, Ray's prefix and repeat mark gone
    # an exception-like line outside a traceback (a logged import warning) is not the cause
    assert crash_cause("ModuleNotFoundError: No module named 'vllm'\nstarting\nKilled\n") is None
    assert crash_cause("starting\nstopped by SIGTERM\n") is None
