"""The CPU half of scripts/gpu/bench_decode.py: cases, rows, policy columns, the result file."""

from __future__ import annotations

import pytest
from gpu_scripts import load_script

from sglang_elastic.attention import bench, calibrate
from sglang_elastic.attention.policy import Calibration, DecodePolicy, PathCost



def test_cases_are_the_issues():
    cases = {c["name"]: c["lens"] for c in bench.bench_cases()}
    assert list(cases) == ["B1_8K", "B1_32K", "B1_128K", "B8_2x64K_6x4K", "B8_32K", "B32_zipf_1K-61K", "B64_8x32K_56x2K", "B64_8K", "B256_2K"]
    assert cases["B8_2x64K_6x4K"] == [65536] * 2 + [4096] * 6
    assert cases["B64_8x32K_56x2K"] == [32768] * 8 + [2048] * 56
    z = cases["B32_zipf_1K-61K"]
    assert len(z) == 32 and z == sorted(z, reverse=True) and 1024 < z[-1] < 4096 and 60 * 1024 < z[0] <= 62 * 1024
    assert [len(cases[n]) for n in ("B64_8K", "B256_2K")] == [64, 256]
    assert bench.kv_bytes([32768]) == 32768 * 8 * 128 * 2 * 2  # 134 MB, as in the anchors doc
    assert bench.PAGE_SIZES == (16, 1)


def fake_timings(pol, lens):
    t = pol.predict(lens)
    return {"ours_split_us": t["split"], "ours_compact_us": t["compact"], "flashinfer_us": t["flashinfer"],
            "flashinfer_persistent_us": 0.9 * t["flashinfer"], "sglang_triton_us": 2 * t["flashinfer"]}


def test_rows_policy_columns_fit_and_result_file():
    truth = Calibration(gpu="t", sm_count=132, paths={
        "flashinfer": PathCost(15.0, 4.3, 30.0), "split": PathCost(6.0, 4.0, 60.0), "compact": PathCost(9.0, 4.4, 60.0)})
    pol = DecodePolicy(truth, **bench.SHAPE)
    cases = {c["name"]: c for c in bench.bench_cases()}
    rows = [bench.add_flush_columns(bench.make_row(c, ps, fake_timings(pol, c["lens"]), {"ours_split": 3e-3}),
                                    {k: 0.97 * v for k, v in fake_timings(pol, c["lens"]).items()}, {"write": 9.0, "read": 4.0})
            for ps in bench.PAGE_SIZES for c in cases.values()]
    fitted, errs = calibrate.fit_calibration(bench.calibration_timings(rows, cases), gpu="t", sm_count=132, **bench.SHAPE)
    assert max(errs.values()) < 0.05
    bench.fill_policy(rows, cases, DecodePolicy(fitted, **bench.SHAPE))
    col = {"split": "ours_split_us", "compact": "ours_compact_us", "flashinfer": "flashinfer_us"}
    for r in rows:
        assert r["policy_pick"] == pol.choose(cases[r["name"]]["lens"])
        assert r["policy_us"] == r[col[r["policy_pick"]]]  # the measured time of the picked path, not a prediction
        assert r["policy_read_tbps"] == pytest.approx(r["kv_mb"] * 1e6 / (r["policy_us"] * 1e-6) / 1e12)
    assert {r["policy_pick"] for r in rows} >= {"split", "flashinfer"}
    header = {"date": "d", "gpu": "g", "commit": "c", "command": "x"}
    res = bench.assemble(header, 4.3, rows, {}, {})
    assert res["stream_read_tbps"] == 4.3 and len(res["cases"]) == 18
    assert all(set(bench.ROW_FIELDS) <= set(r) for r in res["cases"])
    with pytest.raises(ValueError, match="lacks 'commit'"):
        bench.assemble({"date": "d", "gpu": "g", "command": "x"}, 4.3, rows, {}, {})
    del rows[0]["policy_pick"]
    with pytest.raises(ValueError, match=r"lacks \['policy_pick'\]"):
        bench.assemble(header, 4.3, rows, {}, {})


def test_a_row_needs_positive_times_for_every_policy_path():
    c = bench.bench_cases()[0]
    t = {"ours_split_us": 10.0, "ours_compact_us": 11.0, "flashinfer_us": 9.0, "flashinfer_persistent_us": None, "sglang_triton_us": 20.0}
    assert bench.make_row(c, 16, t, {})["flashinfer_persistent_us"] is None  # a baseline may be missing (noted in the file)
    with pytest.raises(ValueError, match="ours_compact_us is needed"):
        bench.make_row(c, 16, {**t, "ours_compact_us": None}, {})
    with pytest.raises(ValueError, match="not a positive time"):
        bench.make_row(c, 16, {**t, "flashinfer_us": float("nan")}, {})


def test_gpu_scripts_import_on_the_cpu():
    for name in ("bench_decode", "bench_decode_ab", "check_decode_e2e"):
        assert callable(load_script(name).main)


def _e2e():
    return load_script("check_decode_e2e")


def test_e2e_comparison_and_trace_checks():
    e2e = _e2e()
    ref = {"s": [{"ids": [5, 6, 7], "logprobs": [-0.5, -2.0, -30.0]}]}
    c = e2e.compare(ref, {"s": [{"ids": [5, 6, 7], "logprobs": [-0.504, -2.01, -30.2]}]})
    assert (c["tokens_equal"], c["max_rel_logprob_diff"], c["close"]) == (True, pytest.approx(0.2 / 30), True)
    c = e2e.compare(ref, {"s": [{"ids": [5, 9, 7], "logprobs": [-0.5, -2.0, -30.0]}]})
    assert not c["tokens_equal"] and c["first_token_mismatch"] == "s request 0 token 1"
    assert not c["close"]  # no top-k logprobs recorded: a flip cannot be shown to be a near-tie
    assert e2e.check_trace("split", {"capture:split": 4, "replay:split": 64}) == []
    assert e2e.check_trace("split", {"replay:split": 60, "replay:flashinfer": 4}) == ["split: expected replays of split only, got {'flashinfer': 4}"]
    assert e2e.check_trace("auto", {"eager:split": 3, "capture:flashinfer": 1, "capture:split": 1, "capture:compact": 1}) == ["no decode step replayed a CUDA graph of persistentkv"]
    three = {"capture:flashinfer": 2, "capture:split": 2, "capture:compact": 2}
    assert e2e.check_trace("auto", {**three, "replay:flashinfer": 9, "replay:split": 3}) == []
    assert e2e.check_trace("auto-ours", {**three, "replay:flashinfer": 9}) == [
        "auto-ours: expected replays of split only (besides the online correction's exploring steps), got {'flashinfer': 9}"]
    assert e2e.check_trace("auto", {"capture:flashinfer": 2, "replay:flashinfer": 9}) == ["auto: graphs captured for ['flashinfer'], not one per path"]
    kw = e2e.engine_kwargs("/m", "persistentkv")
    assert kw["cuda_graph_backend_decode"] == "full" and kw["cuda_graph_backend_prefill"] == "disabled"
    assert kw["attention_backend"] == "flashinfer" and kw["decode_attention_backend"] == "persistentkv"


def test_e2e_ours_calibration_makes_auto_pick_split(tmp_path):
    from sglang_elastic.attention.policy import DecodePolicy, load_calibration

    c = load_calibration(_e2e().ours_calibration(str(tmp_path / "c.json")))
    pol = DecodePolicy(c, q_heads=16, kv_heads=4, head_dim=64)
    assert {pol.choose(lens) for lens in ([3000], [1500, 700, 3000, 50, 2100, 900, 10, 1200], [1] * 8)} == {"split"}


def test_e2e_engine_kwargs_are_sglang_server_args():
    """Every keyword the e2e passes to sglang.Engine is a ServerArgs field (a typo would only show on the GPU)."""
    import dataclasses

    from sglang.srt.server_args import ServerArgs

    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    assert set(_e2e().engine_kwargs("/m", "persistentkv")) <= fields


def test_the_sweep_grid_is_centred_on_the_shipped_configs_and_clipped():
    mod = load_script("bench_decode")
    assert mod.around(1024, 64, 8192) == (512, 1024, 2048)
    assert mod.around(256, 16, 256) == (128, 256)  # double clipped to the top
    assert mod.around(16, 16, 256) == (16, 32)  # half clipped to the bottom


def test_the_streaming_read_reads_every_element_once():
    """The benchmark's bandwidth reference must read all of its input: the
    per-program sums add up to the float64 sum of fresh random data, for a
    length no block divides and more programs than blocks."""
    import torch

    x = torch.randn(10_007, dtype=torch.bfloat16)
    for programs, block in ((3, 1024), (32, 1024)):  # 10 blocks: 3 programs stride, 32 leave 22 idle
        out = torch.full((programs + 2,), float("nan"))
        bench.stream_read(x, out, programs, block)
        assert out[:programs].double().sum().item() == pytest.approx(x.double().sum().item(), abs=1e-2)
    with pytest.raises(ValueError, match="2 sums, 3 programs"):
        bench.stream_read(x, torch.empty(2), 3)
    assert len(bench.STREAM_CONFIGS) == 18


def test_both_flushes_and_their_read_floors_land_in_every_row():
    c = bench.bench_cases()[1]
    t = {"ours_split_us": 60.0, "ours_compact_us": 66.0, "flashinfer_us": 54.0, "flashinfer_persistent_us": None, "sglang_triton_us": 90.0}
    read = {**t, "ours_split_us": 52.0, "flashinfer_persistent_us": 50.0}
    row = bench.add_flush_columns(bench.make_row(c, 16, t, {}), read, {"write": 40.0, "read": 32.0}, {"write": 55.0, "read": 47.0})
    assert (row["read_floor_us"], row["read_floor_read_flush_us"], row["fa3_us"]) == (40.0, 32.0, 55.0)
    assert row["read_flush_us"] == {**read, "fa3_us": 47.0}
    assert row["floor_ratio"]["write"]["ours_split_us"] == pytest.approx(1.5)
    assert row["floor_ratio"]["read"]["ours_split_us"] == pytest.approx(52 / 32)
    assert row["floor_ratio"]["write"]["flashinfer_persistent_us"] is None and row["floor_ratio"]["read"]["fa3_us"] == pytest.approx(47 / 32)
    # FA3 absent: the column is None under both flushes, nothing else changes
    row = bench.add_flush_columns(bench.make_row(c, 16, t, {}), read, {"write": 40.0, "read": 32.0}, None)
    assert row["fa3_us"] is None and row["read_flush_us"]["fa3_us"] is None
    assert set(bench.ROW_FIELDS) - set(row) == {"policy_pick", "policy_us", "policy_read_tbps"}  # fill_policy adds those
    with pytest.raises(ValueError, match="read floors for \\['write'\\], need \\['write', 'read'\\]"):
        bench.add_flush_columns(bench.make_row(c, 16, t, {}), read, {"write": 40.0})
    with pytest.raises(ValueError, match="ours_compact_us under the read flush is needed"):
        bench.add_flush_columns(bench.make_row(c, 16, t, {}), {**read, "ours_compact_us": None}, {"write": 40.0, "read": 32.0})
    with pytest.raises(ValueError, match="read floor = 0.0 under the read flush is not a positive time"):
        bench.add_flush_columns(bench.make_row(c, 16, t, {}), read, {"write": 40.0, "read": 0.0})


def test_bench_us_flushes_before_every_timed_run_and_returns_the_median():
    """do_bench's loop with the flush as an argument, on a simulated device
    clock: each run takes its scripted time; the flush is outside the timed window."""
    clock = {"t": 0.0}
    log = []
    # ms: the first call, 5 estimate runs (with their flushes: 1.32 ms each -> 1 warm-up, 4 timed), warm-up, timed
    times = iter([1.0] + [0.8] * 5 + [0.1] + [0.1, 0.3, 0.2, 0.4])

    class Ev:
        def record(self):
            self.t = clock["t"]

        def elapsed_time(self, end):
            return end.t - self.t

    def fn():
        log.append("fn")
        clock["t"] += next(times)

    def flush():
        log.append("flush")
        clock["t"] += 0.52

    us = bench.bench_us(fn, flush, warmup_ms=2.0, rep_ms=6.0, event=Ev, synchronize=lambda: None)
    assert us == pytest.approx(250.0)  # median of 0.1, 0.2, 0.3, 0.4 ms
    assert log[1:11] == ["flush", "fn"] * 5 and log[11] == "fn"  # estimate, then one warm-up run without a flush
    assert log[12:] == ["flush", "fn"] * 4  # every timed run after its flush


def test_fa3_column_is_skipped_cleanly_without_the_package():
    f = bench.fa3_decode()
    assert f is None or callable(f)


def test_decode_table_renders_the_acceptance_checks_from_a_result(tmp_path, capsys):
    """scripts/gpu/decode_table.py: the docs table and issue 23's kernel checks, computed from the columns."""
    dt = load_script("decode_table")
    case = lambda name, **kw: {"name": name, "page_size": 16, **kw}
    d = {"gpu": "g", "commit": "c", "date": "d", "command": "x", "cases": [
        case("B1_32K", ours_split_us=66.0, flashinfer_us=68.0, policy_us=68.0, policy_pick="flashinfer", read_floor_us=60.0,
             floor_ratio={"write": {"ours_split_us": 1.1}, "read": {"ours_split_us": 1.25}}, read_flush_us={"ours_split_us": 55.0}),
        case("B32_zipf_1K-61K", ours_split_us=300.0, flashinfer_persistent_us=320.0, flashinfer_us=450.0, policy_us=310.0, policy_pick="compact"),
        case("B64_8K", ours_split_us=700.0, flashinfer_us=690.0, policy_us=700.0, policy_pick="split")]}
    got = {name: (round(v, 4), held) for name, v, _, held in dt.checks(d)}
    assert got["B1_32K p16 split ÷ read floor (write flush)"] == (1.1, True)
    assert got["B1_32K p16 split ÷ read floor (read flush)"] == (1.25, False)
    assert got["B32_zipf_1K-61K p16 split ÷ FI persistent"] == (round(300 / 320, 4), True)
    assert got["B32_zipf_1K-61K p16 policy speed ÷ FI tc"] == (round(450 / 310, 4), True)
    assert got["B64_8K p16 policy speed ÷ FI tc"] == (round(690 / 700, 4), False)
    p = tmp_path / "r.json"
    p.write_text(__import__("json").dumps(d))
    assert dt.main([str(p)]) == 0
    out = capsys.readouterr().out
    assert "| B1_32K | 16 | 66.0 | – |" in out and "55.0 / – / – / –" in out and "**missed**" in out
    assert "old merge tile" not in out  # no run timed it: no column
    d["cases"][0].update(ours_split_fused_us=61.0, ours_split_fused_wide_merge_us=64.5)
    p.write_text(__import__("json").dumps(d))
    assert dt.main([str(p)]) == 0
    out = capsys.readouterr().out
    assert "| split | split 1-launch | 1-launch, old merge tile | compact |" in out and "| B1_32K | 16 | 66.0 | 61.0 | 64.5 | – |" in out
    assert "| B64_8K | 16 | 700.0 | – | – | – |" in out
    assert dt.main([str(p), "--page", "3"]) == 2 and "no case at page size 3 (it has [16])" in capsys.readouterr().err
    import lzma

    x = tmp_path / "r.json.xz"  # the committed benches are xz-compressed: the same table from the .xz
    x.write_bytes(lzma.compress(p.read_bytes()))
    assert dt.main([str(x)]) == 0 and "| B1_32K | 16 | 66.0 | 61.0 | 64.5 | – |" in capsys.readouterr().out
    x.write_bytes(p.read_bytes())  # not xz inside
    assert dt.main([str(x)]) == 2 and "not a bench_decode.py result" in capsys.readouterr().err
    for bad in ("{}", '{"cases": 3}', '{"cases": [{"name": "x", "kind": "eager"}]}'):  # the last: the peer kit's result
        p.write_text(bad)
        assert dt.main([str(p)]) == 2
        assert "not a bench_decode.py result" in capsys.readouterr().err
    p.write_text('{"cases": [{"name": "B1_32K", "page_size": 16, "ours_split_us": "fast"}]}')  # a timing that is not a number
    assert dt.main([str(p)]) == 2
    assert "malformed case" in capsys.readouterr().err
