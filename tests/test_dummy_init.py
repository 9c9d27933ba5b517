"""``SGLANG_ELASTIC_DUMMY_INIT=unit``: random weights under which attention reaches the outputs.

The first test is why it exists: under SGLang's own ``initialize_dummy_weights`` (the real
function) a Llama whose attention reads zeros for half of every layer's V rows gives the same
greedy token and log-probabilities as the correct one; under :func:`unit_init_` it does not."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sglang_elastic import dummy_init

from test_plugin import run_py


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                      vocab_size=1000, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def _last_logprobs(model, ids, zero_v_before=None):
    """The last position's log-probabilities (float64), optionally with every layer's V zeroed at positions
    below ``zero_v_before`` (a server that read the wrong V rows for the first part of the context)."""
    hooks = []
    if zero_v_before is not None:
        def zero(mod, inp, out):
            out = out.clone()
            out[:, :zero_v_before] = 0
            return out
        hooks = [layer.self_attn.v_proj.register_forward_hook(zero) for layer in model.model.layers]
    try:
        with torch.no_grad():
            logits = model(ids).logits[0, -1].double()
    finally:
        for h in hooks:
            h.remove()
    assert torch.isfinite(logits).all()
    return logits, torch.log_softmax(logits, -1)


def test_under_sglangs_dummy_weights_wrong_v_rows_leave_the_outputs_unchanged_and_under_unit_init_they_do_not():
    from sglang.srt.model_loader.weight_utils import initialize_dummy_weights

    model = _tiny_llama()
    ids = torch.randint(5, 1000, (1, 192), generator=torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,)))))
    initialize_dummy_weights(model)
    logits, ok = _last_logprobs(model, ids)
    _, bad = _last_logprobs(model, ids, zero_v_before=96)
    assert logits.std() < 1e-3  # SGLang's fill: every logit within a hair of the others
    assert ok.argmax() == bad.argmax() and (ok - bad).abs().max() < 1e-4  # half of V wrong, nothing to see

    assert dummy_init.unit_init_(model) == len(list(model.parameters()))
    logits, ok = _last_logprobs(model, ids)
    _, bad = _last_logprobs(model, ids, zero_v_before=96)
    assert 0.3 < logits.std() < 5  # unit-scale logits, neither flat nor saturated
    assert (ok - bad).abs().max() > 0.05  # the same error moves the log-probabilities by tenths


def test_unit_init_is_deterministic_by_name_and_scales_each_weight_by_its_layers_whole_fan_in():
    from sglang.srt.layers.linear import RowParallelLinear

    a, b = _tiny_llama(), _tiny_llama()
    torch.nn.init.normal_(b.model.layers[0].mlp.down_proj.weight)  # b starts elsewhere: the fill must not depend on it
    dummy_init.unit_init_(a), dummy_init.unit_init_(b)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na
    q = a.model.layers[1].self_attn.q_proj.weight.double()
    bound = math.sqrt(3.0 / 256)  # U(-a, a), a = sqrt(3 / fan_in): variance 1 / fan_in
    assert q.abs().max() <= bound * 1.01 and abs(q.var().item() * 256 - 1) < 0.05
    assert not torch.equal(a.model.layers[1].self_attn.q_proj.weight, a.model.layers[2].self_attn.q_proj.weight)  # seeded by name
    for norm in (a.model.layers[0].input_layernorm, a.model.norm):
        assert torch.equal(norm.weight, torch.ones_like(norm.weight))

    # a row-parallel shard at TP 2 (SGLang's class): scaled by the unsharded layer's 512 inputs, not its 256 local ones
    row = RowParallelLinear(512, 64, bias=True, params_dtype=torch.float32, tp_rank=0, tp_size=2)
    row.bias.data.normal_()
    dummy_init.unit_init_(row)
    w = row.weight.double()
    assert w.shape == (64, 256) and w.abs().max() <= math.sqrt(3.0 / 512) * 1.001 and w.abs().max() > math.sqrt(3.0 / 256) * 0.5
    assert torch.equal(row.bias, torch.zeros_like(row.bias))


def test_the_tp_ranks_shards_differ_as_an_unsharded_weights_parts_do_and_one_rank_is_the_same_on_two_servers():
    """Seeded by name alone, both ranks' shards were equal: rank 1's KV equalled rank 0's, so a rank reading the other's could
    not show, and the row-parallel partial sums added up to variance TP instead of 1."""
    from sglang.srt.layers.linear import QKVParallelLinear, RowParallelLinear

    def shards(cls, *args, **kw):
        out = []
        for rank in (0, 1, 1):
            m = torch.nn.Module()
            m.proj = cls(*args, params_dtype=torch.float32, tp_rank=rank, tp_size=2, **kw)
            dummy_init.unit_init_(m)
            out.append(m.proj.weight.detach().clone())
        return out

    for cls, args, kw in ((QKVParallelLinear, (256, 64, 8, 2), {"bias": False}), (RowParallelLinear, (512, 64), {"bias": False})):
        r0, r1, r1_again = shards(cls, *args, **kw)
        assert not torch.equal(r0, r1) and torch.equal(r1, r1_again), cls.__name__
    # the two ranks' o_proj partial sums of unit-variance inputs add up to unit variance, as one unsharded layer's would
    x = torch.randn(4096, 512, dtype=torch.float64)
    r0, r1, _ = shards(RowParallelLinear, 512, 64, bias=False)
    y = x[:, :256] @ r0.double().T + x[:, 256:] @ r1.double().T
    assert abs(y.var().item() - 1) < 0.1


def test_gemma_norms_get_zero_and_low_precision_parameters_keep_their_values():
    class GemmaRMSNorm(torch.nn.Module):  # SGLang's Gemma norms multiply by (1 + weight)
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8))

    class Fp8LinearMethod:  # the class name SGLang's FP8 layers carry; their float32 scales are SGLang's to fill
        pass

    m = torch.nn.Module()
    m.norm = GemmaRMSNorm()
    m.fp8 = torch.nn.Parameter(torch.randn(4, 4).to(torch.float8_e4m3fn), requires_grad=False)
    m.quant = torch.nn.Linear(4, 4)
    m.quant.quant_method = Fp8LinearMethod()
    m.quant.weight_scale = torch.nn.Parameter(torch.rand(4) + 0.5, requires_grad=False)
    m.layer_norm = torch.nn.LayerNorm(8)  # weight 1, bias 0
    m.normalizer_proj = torch.nn.Linear(16, 8)  # "norm" in its path, not its class: a linear layer
    for p in (m.layer_norm.weight, m.layer_norm.bias, m.normalizer_proj.bias):
        p.data.normal_()
    before = m.fp8.detach().clone()
    quant_before = [p.detach().clone() for p in m.quant.parameters()]
    assert dummy_init.unit_init_(m) == 5
    assert torch.equal(m.norm.weight, torch.zeros(8)) and torch.equal(m.fp8.view(torch.uint8), before.view(torch.uint8))
    assert all(torch.equal(a, b) for a, b in zip(quant_before, m.quant.parameters()))
    assert torch.equal(m.layer_norm.weight, torch.ones(8)) and torch.equal(m.layer_norm.bias, torch.zeros(8))
    w = m.normalizer_proj.weight
    assert torch.equal(m.normalizer_proj.bias, torch.zeros(8)) and 0.5 * math.sqrt(3 / 16) < w.abs().max() <= math.sqrt(3 / 16)


def test_a_bad_value_is_one_line_at_the_launcher_and_unset_registers_nothing(monkeypatch):
    from sglang_elastic import plugin

    monkeypatch.setenv(dummy_init.ENV, "uniform")
    with pytest.raises(ValueError, match=r"SGLANG_ELASTIC_DUMMY_INIT='uniform': give one of unit"):
        dummy_init.mode()
    with pytest.raises(SystemExit) as e:
        plugin._from_cli_args(None, None)
    assert str(e.value).startswith("sglang-elastic: SGLANG_ELASTIC_DUMMY_INIT='uniform'") and "\n" not in str(e.value)

    from sglang.srt.plugins.hook_registry import HookRegistry

    seen = []
    monkeypatch.setattr(HookRegistry, "register", classmethod(lambda cls, target, fn, kind: seen.append(target)))
    monkeypatch.setattr(dummy_init, "_registered", False)
    monkeypatch.delenv(dummy_init.ENV)
    dummy_init.register()
    assert seen == []
    monkeypatch.setenv(dummy_init.ENV, "unit")
    dummy_init.register()
    assert seen == ["sglang.srt.model_loader.weight_utils.initialize_dummy_weights"]
    # where no command line is parsed (sgl.Engine), a bad value fails the model load with the same line
    monkeypatch.setattr(dummy_init, "_registered", False)
    monkeypatch.setenv(dummy_init.ENV, "uniform")
    dummy_init.register()
    assert len(seen) == 2
    lin = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="SGLANG_ELASTIC_DUMMY_INIT='uniform'"):
        dummy_init.around_initialize_dummy_weights(lambda m: None, lin)


def test_through_sglangs_plugin_loader_the_model_loaders_dummy_fill_is_unit_scale(sglang_python):
    """The hook reaches the name SGLang's ``DummyModelLoader`` calls (``loader.initialize_dummy_weights``,
    imported from ``weight_utils``) in a process that loads the plugins as a scheduler does."""
    code = (
        "import json, torch\n"
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "from sglang.srt.model_loader import loader\n"
        "m = torch.nn.Linear(400, 16, bias=False)\n"
        "loader.initialize_dummy_weights(m)\n"
        "print(json.dumps(m.weight.abs().max().item()))\n"
    )
    on = json.loads(run_py(code, sglang_python, SGLANG_ELASTIC_DUMMY_INIT="unit", SGLANG_PLUGINS="sglang_elastic"))
    off = json.loads(run_py(code, sglang_python, SGLANG_ELASTIC_DUMMY_INIT="", SGLANG_PLUGINS="sglang_elastic"))
    assert math.sqrt(3 / 400) * 0.9 < on <= math.sqrt(3 / 400) * 1.001
    assert off <= 1e-3  # SGLang's own U(-1e-3, 1e-3)
