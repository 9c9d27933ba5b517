"""The advisor's light sizing (sglang_elastic/eval/sizing.py, no SGLang
import) against the real SGLang 0.5.17: ServerArgs, ModelConfig and the
req_to_token table over a grid of models, GPU sizes, TP degrees, chunks and
request caps, and the whole advisor run both ways."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys

import pytest

import sglang_sizing as ref
from sglang_elastic.eval import advisor, sizing
from sglang_elastic.serve import model_path

H200_MIB = 143771
EMBEDDED = ("llama-3.1-8b", "qwen2.5-32b", "llama-3.1-70b")


def _cfg(name: str) -> dict:
    return json.loads((model_path(name) / "config.json").read_text())


def _write(tmp_path, name: str, cfg: dict):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """Model directories: the embedded shapes and configs that take SGLang's
    other branches (defaults of each config class, rope scalings, context
    keys, a Llama-2 path, Mistral)."""
    tmp = tmp_path_factory.mktemp("models")
    llama, qwen = _cfg("llama-3.1-8b"), _cfg("qwen2.5-32b")
    no_rope = {k: v for k, v in llama.items() if k != "rope_scaling"}
    cfgs = {
        **{n: _cfg(n) for n in EMBEDDED},
        "Llama-2-7b-hf": {**no_rope, "max_position_embeddings": 4096, "num_key_value_heads": 32, "intermediate_size": 11008},
        "mistral-7b": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                       "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768, "vocab_size": 32768, "sliding_window": None},
        "mistral-defaults": {"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
        "llama-defaults": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
        "qwen-defaults": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
        "qwen-kv-null": {**qwen, "num_key_value_heads": None},
        "llama-head-dim": {**llama, "head_dim": 64},
        "llama-tied-bias": {**llama, "tie_word_embeddings": True, "attention_bias": True},
        "llama-linear": {**no_rope, "rope_scaling": {"type": "linear", "factor": 2.0}},
        "llama-dynamic": {**no_rope, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
        "llama-llama3-type": {**no_rope, "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
        "qwen-yarn": {**qwen, "rope_scaling": {"type": "yarn", "factor": 4.0}},
        "qwen-yarn-orig": {**qwen, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
        "qwen-linear": {**qwen, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        "llama-seq-length": {**no_rope, "seq_length": 16384},
    }
    return {n: _write(tmp, n, c) for n, c in cfgs.items()}


def test_model_facts_are_sglangs_model_config(variants):
    for name, d in variants.items():
        cfg = json.loads((d / "config.json").read_text())
        light = sizing.model_facts(str(d), cfg, name)
        mine = dataclasses.asdict(light)
        assert mine.pop("defaulted") == tuple(k for k in sizing._INT_KEYS + ("num_key_value_heads",) if cfg.get(k) is None), name  # advise's caveat
        theirs = dataclasses.asdict(ref.model_facts(str(d), cfg, name))
        theirs.pop("defaulted", None)  # (SGLang's ModelConfig has no such list)
        assert mine == theirs, name
    # the branches were taken: a scaled context, an ignored factor, a config-class default
    got = {n: sizing.model_facts(str(d), json.loads((d / "config.json").read_text()), n) for n, d in variants.items()}
    assert (got["llama-linear"].context_len, got["qwen-yarn"].context_len, got["qwen-linear"].context_len) == (262144, 32768, 65536)
    assert (got["qwen-defaults"].num_key_value_heads, got["mistral-defaults"].num_key_value_heads, got["qwen-kv-null"].num_key_value_heads) == (32, 8, 40)
    assert got["llama-seq-length"].context_len == 16384 and got["llama-head-dim"].head_dim == 64
    assert "num_key_value_heads" in got["mistral-defaults"].defaulted and got["llama-head-dim"].defaulted == ()


GPUS_MIB = (16 * 1024, 24 * 1024, 40 * 1024, 48 * 1024, 80 * 1024, 81559, 94 * 1024, H200_MIB, 160 * 1024, 183359)


def test_server_sizing_is_sglangs_server_args(variants):
    """chunk, mem_fraction_static, decode and prefill graph sizes, the
    post-capture plan and its activation reserve, for every GPU size band,
    TP degree, chunk (SGLang's default, its floor, an odd 10,000 the prefill
    graphs do not hold, the largest) and request cap."""
    n = 0
    for name, gpu, tp, chunk, post, mrr in itertools.product(("llama-3.1-8b", "Llama-2-7b-hf", "qwen2.5-32b"), GPUS_MIB, (1, 2, 4, 8),
                                                            (None, 2048, 4096, 10000, 32768), (False, True), (None, 256)):
        path = str(variants[name])
        light, sg = sizing.server_sizing(path, gpu, tp, chunk, post, mrr), ref.server_sizing(path, gpu, tp, chunk, post, mrr)
        case = (name, gpu, tp, chunk, post, mrr)
        assert dataclasses.astuple(light) == dataclasses.astuple(sg), case
        assert light.max_prefill_buffer_tokens() == sg.max_prefill_buffer_tokens(), case
        assert light.pre_capture_activation_reserve_mb(gpu) == sg.pre_capture_activation_reserve_mb(gpu), case
        n += 1
    assert n == 3 * len(GPUS_MIB) * 4 * 5 * 2 * 2
    # the grid reaches SGLang's branches: the Llama-2 cap on prefill graphs, post-capture sizing planned and not
    assert max(sizing.server_sizing(str(variants["Llama-2-7b-hf"]), H200_MIB, 1, 8192).prefill_bs) == 4096
    assert sizing.server_sizing(str(variants["llama-3.1-8b"]), H200_MIB, 1, post_capture=True).post_capture_planned
    assert not sizing.server_sizing(str(variants["llama-3.1-8b"]), H200_MIB, 1, 10000, post_capture=True).post_capture_planned


def test_the_req_to_token_table_is_sglangs():
    for tokens, ctx, mrr in itertools.product((0, 1, 1000, 8191, 50_000, 264_508, 906_056, 1_919_855, 5_000_000), (2048, 32768, 131072),
                                              (None, 1, 256, 5000)):
        assert sizing.resolve_max_num_reqs(tokens, ctx, mrr) == ref.resolve_max_num_reqs(tokens, ctx, mrr), (tokens, ctx, mrr)
    assert sizing.REQ_TO_TOKEN_EXTRA_CONTEXT_LEN == ref.req_to_token_extra_context_len(model_path("llama-3.1-8b")) == 4


CASES = [  # (model, GiB, TP, chunk, max_running_requests, margin MiB): the advisor tests' setups and their edges
    ("llama-3.1-8b", H200_MIB / 1024, 1, None, None, 1024), ("llama-3.1-8b", H200_MIB / 1024, 1, 2048, None, 1024),
    ("llama-3.1-8b", H200_MIB / 1024, 1, 32768, 256, 1024), ("llama-3.1-8b", H200_MIB / 1024, 2, 32768, 256, 1024),
    ("llama-3.1-8b", H200_MIB / 1024, 1, 16384, 128, 16000), ("llama-3.1-8b", H200_MIB / 1024, 1, 10000, None, 1024),
    ("llama-3.1-8b", H200_MIB / 1024, 4, 8192, 256, 1024), ("llama-3.1-8b", 24, 1, None, None, 1024), ("llama-3.1-8b", 80, 2, None, 257, 1024),
    ("llama-3.1-70b", H200_MIB / 1024, 1, None, None, 1024), ("llama-3.1-70b", H200_MIB / 1024, 2, 65536, None, 1024),
    ("llama-3.1-70b", H200_MIB / 1024, 8, None, None, 1024), ("llama-3.1-70b", 79.2, 1, None, None, 1024),
    ("qwen2.5-32b", H200_MIB / 1024, 1, 32768, None, 1024), ("qwen2.5-32b", 192, 4, None, 64, 0), ("Llama-2-7b-hf", 40, 1, None, None, 1024),
    ("mistral-7b", 48, 2, 4096, None, 512),
]


def test_the_advisor_answers_alike_through_sglang(variants, monkeypatch):
    """Every output of predict (calibration fit included), light and through
    SGLang's own ServerArgs / ModelConfig / KVCacheConfigurator."""
    def run():
        return [advisor.predict(str(variants[m]), g, tp, c, margin_mib=mm, max_running_requests=r) for m, g, tp, c, r, mm in CASES]

    light = run()
    ref.through_sglang(monkeypatch)
    assert sizing.server_sizing is ref.server_sizing
    assert run() == light
    assert {p["recommendation"] for p in light} == {"elastic", "post-capture sizing", "smaller chunk", "neither"}


def test_advise_imports_neither_sglang_nor_torch():
    code = ("import sys\nfrom sglang_elastic import cli\n"
            "rc = cli.main(['advise', '--model-config', 'llama-3.1-8b', '--gpu-mem-gb', '140.4', '--tp', '1'])\n"
            "print(rc, sorted(m for m in ('sglang', 'torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "0 []" and "recommendation: elastic" in r.stdout
