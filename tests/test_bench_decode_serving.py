"""The decode serving benchmark's CPU half: its workloads, path order, the
acceptance verdict per workload and the assembly of the result file."""

from __future__ import annotations

import json
import math

import pytest
from gpu_scripts import load_script


def bench():
    return load_script("bench_decode_serving")


def test_workloads_have_the_named_sizes_and_the_loguniform_spread():
    b = bench()
    lens = b.workload_lengths("loguniform", seed=1)
    assert len(lens) == 24 and min(lens) >= 1024 and max(lens) <= 100 * 1024
    logs = [math.log(x) for x in lens]
    # log-uniform: the logs spread over the whole range, not bunched at one end
    assert max(lens) / min(lens) > 10 and abs(sum(logs) / 24 - (math.log(1024) + math.log(102400)) / 2) < 1.0
    assert lens == b.workload_lengths("loguniform", seed=1) and lens != b.workload_lengths("loguniform", seed=2)
    assert b.workload_lengths("bimodal") == [32768] * 8 + [2048] * 56
    assert len(b.workload_lengths("zipf")) == 32 and max(b.workload_lengths("zipf")) == 62464
    assert b.workload_lengths("uniform8k") == [8192] * 64 and b.workload_lengths("short") == [2048] * 128
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        b.workload_lengths("nope")


def test_path_order_rotates_so_no_path_always_runs_first():
    b = bench()
    firsts = {b.path_order(list(b.PATHS), i)[0] for i in range(4)}
    assert firsts == set(b.PATHS)
    assert sorted(b.path_order(list(b.PATHS), 5)) == sorted(b.PATHS)


def test_verdict_holds_auto_to_two_percent_of_the_best_forced_path_and_one_of_flashinfer():
    b = bench()

    def paths(auto, fi, split, compact):
        return {"auto": {"median_itl_ms": auto}, "flashinfer": {"median_itl_ms": fi}, "split": {"median_itl_ms": split},
                "compact": {"median_itl_ms": compact}}

    v = b.verdict(paths(18.5, 19.54, 18.40, 18.9))
    assert v["best_forced"] == "split" and v["auto_over_best"] == pytest.approx(18.5 / 18.40)
    assert v["within_2pct_of_best"] and v["within_1pct_of_flashinfer"]
    v = b.verdict(paths(19.54, 19.54, 18.40, 18.9))  # the run: auto ran FlashInfer, split 1.062x faster
    assert not v["within_2pct_of_best"] and v["within_1pct_of_flashinfer"]
    v = b.verdict(paths(20.0, 19.7, 21.0, 21.0))  # auto 1.5 % behind FlashInfer, the best
    assert v["best_forced"] == "flashinfer" and v["within_2pct_of_best"] and not v["within_1pct_of_flashinfer"]
    assert b.verdict({"auto": {"median_itl_ms": 1.0}}) is None and b.verdict({"split": {"median_itl_ms": 1.0}}) is None
    partial = paths(18.5, 19.54, 18.40, 18.9)
    del partial["flashinfer"]  # a call cut off before FlashInfer's pass: no best of three, no verdict
    assert b.verdict(partial) is None and b.verdict(partial, required=("auto", "split", "compact"))["best_forced"] == "split"


def test_path_figures_take_every_figure_from_the_median_pass_and_irregular_passes_are_named():
    b = bench()
    rounds = [{"path": "split", "median_itl_ms": 10.0, "output_tok_s": 900.0, "median_ttft_ms": 5.0, "steps": {"replay:split": 256}},
              {"path": "split", "median_itl_ms": 12.0, "output_tok_s": 1000.0, "median_ttft_ms": 1.0, "steps": {"replay:split": 257}},
              {"path": "split", "median_itl_ms": 11.0, "output_tok_s": 950.0, "median_ttft_ms": 3.0, "steps": {"replay:split": 256}},
              {"path": "auto", "median_itl_ms": 9.0, "output_tok_s": 800.0, "median_ttft_ms": 650.0,
               "steps": {"replay:split": 300, "replay:flashinfer": 8}}]
    assert b.path_figures(rounds, ["auto", "split", "compact"]) == {
        "auto": {"median_itl_ms": 9.0, "output_tok_s": 800.0, "median_ttft_ms": 650.0},
        "split": {"median_itl_ms": 11.0, "output_tok_s": 950.0, "median_ttft_ms": 3.0}}  # one pass's figures, not three medians
    two = rounds[:2]
    assert b.path_figures(two, ["split"])["split"]["median_itl_ms"] == 10.0  # even count: the lower middle
    assert b.irregular(rounds, 256) == ["auto"]  # 308 steps for 256 tokens: part of its batch decoded alone
    # with the output length, an irregular pass does not stand for a path that has a regular one: split's 257-step
    # pass is within the slack (8); a FlashInfer pass of 319 steps (Qwen 128 x 2K on the H200, 2026-12-05) with a
    # lower ITL than its retry's gives way to the retry, and a path with only irregular passes keeps them
    fi = [{"path": "flashinfer", "median_itl_ms": 8.82, "output_tok_s": 11531.0, "median_ttft_ms": 700.6, "steps": {"replay:flashinfer": 319}},
          {"path": "flashinfer", "median_itl_ms": 9.05, "output_tok_s": 12600.0, "median_ttft_ms": 220.0, "steps": {"replay:flashinfer": 258}}]
    got = b.path_figures(rounds + fi, ["auto", "split", "flashinfer"], 256)
    assert got["flashinfer"]["median_itl_ms"] == 9.05 and got["split"]["median_itl_ms"] == 11.0 and got["auto"]["median_itl_ms"] == 9.0
    assert b.path_figures(rounds + fi, ["flashinfer"])["flashinfer"]["median_itl_ms"] == 8.82  # without it: the lower middle of both
    assert b.irregular(rounds + fi, 256) == ["auto"] and b.irregular(rounds + fi[:1], 256) == ["auto", "flashinfer"]
    assert b.is_regular({"steps": {"replay:split": 264}}, 256) and not b.is_regular({"steps": {"replay:split": 265}}, 256)


def test_the_result_names_how_it_measured():
    b = bench()
    method = " ".join(" ".join(b.__doc__.split("\n\n")[b.METHOD_PARAGRAPHS]).split())
    assert method.startswith("``run`` starts ONE server") and "**warm** passes" in method and "Each pass:" in method


def test_steps_between_and_the_servers_decode_state():
    b = bench()
    info = {"internal_states": [{"other": 1, "persistentkv": {"steps": {"replay:split": 10, "replay:flashinfer": 3}}}]}
    before = b.decode_state(info)
    after = {"steps": {"replay:split": 266, "replay:flashinfer": 3, "eager:compact": 2}}
    assert b.steps_between(before, after) == {"eager:compact": 2, "replay:split": 256}
    assert b.decode_state({"internal_states": [{}]}) is None and b.decode_state({}) is None


def test_assemble_takes_each_rows_newest_verdict_keeps_the_rest_as_repeats_and_reads_xz_parts(tmp_path):
    import lzma

    b = bench()

    def paths(auto, fi=20.0):
        p = {"auto": {"median_itl_ms": auto}, "split": {"median_itl_ms": 18.4}, "compact": {"median_itl_ms": 19.0}}
        if fi:
            p["flashinfer"] = {"median_itl_ms": fi}
        return p

    def part(model, date, rows):
        return {"date": date, "gpu": "NVIDIA H200", "commit": date[-2:], "command": f"run {model}", "part": "run", "model": model,
                "server_flags": "--decode-policy auto", "server": {"startup_s": 60},
                "workloads": [{"name": n, "model": model, "paths": ps, "cold": {}, "rounds": [], "output_len": 256,
                               "verdict": b.verdict(ps) if ps else None}
                              for n, ps in rows]}

    (tmp_path / "llama_1.json").write_text(json.dumps(part("llama-3.1-8b", "2026-12-04T01", [("loguniform", paths(18.5)),
                                                                                           ("bimodal", paths(17.0, fi=None))])))
    with lzma.open(tmp_path / "llama_2.json.xz", "wt") as f:  # the newer call: bimodal complete, uniform8k cut off, zipf not reached
        json.dump(part("llama-3.1-8b", "2026-12-04T02", [("loguniform", paths(18.6)), ("bimodal", paths(17.1)),
                                                        ("uniform8k", {"split": {"median_itl_ms": 21.0}}), ("zipf", {})]), f)
    (tmp_path / "qwen.json").write_text(json.dumps(part("qwen2.5-7b", "2026-12-04T03", [("loguniform", paths(21.0))])))
    (tmp_path / "other.json").write_text(json.dumps({"part": "something else"}))
    res = b.part_assemble(type("A", (), {"parts": str(tmp_path), "command": None})())
    got = [(w["model"], w["name"], w["commit"], len(w["repeats"])) for w in res["workloads"]]
    assert got == [("llama-3.1-8b", "loguniform", "02", 1), ("llama-3.1-8b", "bimodal", "02", 1), ("llama-3.1-8b", "uniform8k", "02", 0),
                   ("qwen2.5-7b", "loguniform", "03", 0)]
    assert res["workloads"][0]["paths"]["auto"]["median_itl_ms"] == 18.6 and res["workloads"][0]["repeats"][0]["median_itl_ms"]["auto"] == 18.5
    assert res["workloads"][2]["verdict"] is None and "rounds" not in res["workloads"][0]
    assert res["summary"] == {"workloads": 4, "with_verdict": 3, "auto_within_2pct_of_best": 2, "auto_within_1pct_of_flashinfer": 2,
                              "worst_auto_over_best": pytest.approx(21.0 / 18.4, abs=1e-4), "worst_auto_over_flashinfer": 1.05,  # rounded
                              "rows_with_irregular_passes": []}
    assert res["method"].startswith("``run`` starts ONE server")
    assert res["workloads"][1]["repeats"][0]["auto_over_best"] is None  # the older bimodal pass had no FlashInfer: no verdict
    assert set(res["servers"]) == {"llama-3.1-8b", "qwen2.5-7b"} and len(res["servers"]["llama-3.1-8b"]) == 2
    assert res["date"] == "2026-12-04T03" and res["gpu"] == "NVIDIA H200"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RuntimeError, match="no run parts"):
        b.part_assemble(type("A", (), {"parts": str(empty), "command": None})())


def test_run_without_a_gpu_says_so_in_one_line_and_writes_nothing(tmp_path, monkeypatch):
    """New-user finding: ``run`` on a CPU machine ended in SGLang's 20-line traceback."""
    import sys

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    b = bench()
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["bench_decode_serving.py", "run", "--out", str(out), "--work", str(tmp_path / "w")])
    with pytest.raises(SystemExit) as e:
        b.main()
    assert "no CUDA GPU here" in str(e.value) and "\n" not in str(e.value) and not out.exists()


def test_the_committed_h100_serving_result_is_its_parts_assembled_and_docs_quote_it():
    """``docs/results/decode_serving_h100.json`` (2026-12-05, dd653f0; Qwen's row from 2026-12-06's three-round repeat,
    d641282) is what ``assemble`` makes of its parts: three
    workloads, ``auto`` within 2 % of the best forced path and 1 % of FlashInfer on each, both shapes on their own
    startup calibration (no shipped one covers an H100), uniform8k's passes named irregular (the pool could not cache
    its prompts); docs/decode.md's table carries these medians."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    args = type("A", (), {"parts": str(root / "docs/results/decode_serving_h100_parts"), "command": "x"})()
    out = bench().part_assemble(args)
    want = json.loads((root / "docs/results/decode_serving_h100.json").read_text())
    assert "H100" in out["gpu"] and out["workloads"] == want["workloads"] and out["summary"] == want["summary"]
    assert [(w["model"], w["name"]) for w in out["workloads"]] == [("llama-3.1-8b", "uniform8k"), ("llama-3.1-8b", "short"),
                                                                   ("qwen2.5-7b", "short")]
    s = out["summary"]
    assert s["auto_within_2pct_of_best"] == s["auto_within_1pct_of_flashinfer"] == s["with_verdict"] == 3
    assert all(v[0]["calibration_source"] == "measured" for v in out["servers"].values())
    assert out["workloads"][0]["irregular"] == ["auto", "compact", "flashinfer", "split"]
    doc = " ".join((root / "docs/decode.md").read_text().split())
    for w in out["workloads"]:
        p = w["paths"]
        cells = " | ".join(f"{p[k]['median_itl_ms']:.2f}" for k in ("auto", "flashinfer", "split", "compact"))
        assert cells.replace(f"{p['auto']['median_itl_ms']:.2f}", f"**{p['auto']['median_itl_ms']:.2f}**", 1) in doc, w["name"]


def test_fit_to_pool_keeps_the_first_requests_whose_prompts_and_outputs_fit_and_never_none():
    """A warm pass must come from the radix cache: 64 x 8K + 256 on an H100's pool (410,620 tokens) left every pass
    prefilling again (2026-12-05); the first 43 fit in 90 % of it (369,558: (8,192 + 256) x 43 = 363,264)."""
    b = bench()
    lens = b.workload_lengths("uniform8k")
    got = b.fit_to_pool(lens, 256, 410620)
    assert got == lens[:43] and sum(got) + 256 * 43 <= 0.9 * 410620 < sum(lens[:44]) + 256 * 44
    assert b.fit_to_pool(lens, 256, 906051) == lens  # an H200's pool holds it whole
    assert b.fit_to_pool(lens, 256, None) == lens and b.fit_to_pool(lens, 256, 0) == lens  # no pool size known
    assert b.fit_to_pool([100000, 5], 256, 1000) == [100000]  # one request at least, even past the pool
    lu = b.workload_lengths("loguniform")
    got = b.fit_to_pool(lu, 256, 400000)
    assert got == lu[: len(got)] and sum(got) + 256 * len(got) <= 360000 and (len(got) == len(lu) or sum(lu[: len(got) + 1]) + 256 * (len(got) + 1) > 360000)
