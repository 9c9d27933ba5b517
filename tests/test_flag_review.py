"""A new user's review of the flags (2026-12-06): each case was accepted (or refused for the wrong reason)
before, and is checked here through SGLang 0.5.17's own parser with the plugin's flags (``serve.check_flags``,
as the plugin's start-up runs them) or through the config it builds."""

from __future__ import annotations

import pytest

from sglang_elastic import config, serve

BASE_OFFLOAD = ["--enable-kv-offload", "--disable-radix-cache"]


def check(*flags):
    return serve.check_flags(serve.build_command("llama-3.1-8b", list(flags))[3:])


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "yes", "y", "Y", "0", "false", "no", "n", "N", "maybe", ""])
def test_env_switches_are_read_as_sglang_reads_them(raw, monkeypatch):
    """SGLang's EnvBool takes y/Y as on; an invalid value falls back to its default (off)."""
    from sglang.srt.environ import envs

    monkeypatch.setenv("SGLANG_ENABLE_DETERMINISTIC_INFERENCE", raw)
    assert config.env_on("SGLANG_ENABLE_DETERMINISTIC_INFERENCE") == bool(envs.SGLANG_ENABLE_DETERMINISTIC_INFERENCE.get())


@pytest.mark.parametrize("env,flags,message", [
    ("SGLANG_ENABLE_DETERMINISTIC_INFERENCE", BASE_OFFLOAD, "--enable-kv-offload does not support SGLANG_ENABLE_DETERMINISTIC_INFERENCE=y: it needs"),
    ("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING", BASE_OFFLOAD, "unset SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"),
    ("SGLANG_ENABLE_UNIFIED_RADIX_TREE", ["--enable-elastic-kv"], "--enable-elastic-kv does not support SGLANG_ENABLE_UNIFIED_RADIX_TREE=y"),
    ("SGLANG_EXPERIMENTAL_CPP_RADIX_TREE", ["--enable-elastic-kv"], "--enable-elastic-kv does not support SGLANG_EXPERIMENTAL_CPP_RADIX_TREE=y"),
])
def test_a_switch_turned_on_with_y_is_refused_like_one(env, flags, message, monkeypatch):
    monkeypatch.setenv(env, "y")
    err = check(*flags)
    assert err is not None and message in err and "\n" not in err, err
    monkeypatch.setenv(env, "n")
    assert check(*flags) is None


@pytest.mark.parametrize("dtype", ["nvfp4", "fp4_mx_block16", "mxfp8"])
def test_the_elastic_pool_refuses_every_quantized_kv_cache_of_sglang_at_parse(dtype):
    err = check("--enable-elastic-kv", "--kv-cache-dtype", dtype)
    assert err is not None and f"--kv-cache-dtype {dtype!r}" in err and "quantized KV cache" in err, err
    assert check("--enable-elastic-kv", "--kv-cache-dtype", "fp8_e4m3") is None  # SGLang's MHA pool with an fp8 dtype


@pytest.mark.parametrize("flags,message", [
    (["--elastic-kv-mode", "off", "--elastic-kv-lend-after-steps", "5"], "--elastic-kv-mode off never lends or reclaims: drop --elastic-kv-lend-after-steps 5"),
    (["--elastic-kv-mode", "off", "--elastic-kv-reclaim-wait", "block"], "drop --elastic-kv-reclaim-wait block"),
    (["--elastic-kv-mode", "always-lent", "--elastic-kv-reclaim-wait", "block"],
     "--elastic-kv-mode always-lent lends once at start-up and never reclaims: drop --elastic-kv-reclaim-wait block"),
    (["--elastic-kv-mode", "always-lent", "--elastic-kv-lend-after-steps", "5"], "drop --elastic-kv-lend-after-steps 5"),
    (["--elastic-kv-mode", "always-lent", "--elastic-kv-activation-rule", "measured"], "drop --elastic-kv-activation-rule measured"),
])
def test_flags_the_chosen_mode_never_reads_are_refused(flags, message):
    err = check("--enable-elastic-kv", *flags)
    assert err is not None and message in err and "\n" not in err, err


def test_the_flags_a_mode_reads_stay_accepted():
    assert check("--enable-elastic-kv", "--elastic-kv-mode", "always-lent", "--elastic-kv-lend-bytes", "8GiB", "--elastic-kv-handle-mb", "128",
                 "--elastic-kv-margin-mb", "512") is None
    assert check("--enable-elastic-kv", "--elastic-kv-mode", "off", "--elastic-kv-lend-bytes", "8GiB", "--elastic-kv-margin-mb", "512") is None
    assert check("--enable-elastic-kv", "--elastic-kv-mode", "dynamic", "--elastic-kv-reclaim-wait", "block", "--elastic-kv-lend-after-steps", "5") is None


def test_sink_and_window_have_an_upper_bound_and_the_sizing_names_them():
    err = check(*BASE_OFFLOAD, "--kv-offload-window", "100000000")
    assert err is not None and "--kv-offload-sink 4 + --kv-offload-window 100000000 must be below 32768" in err, err
    err = check(*BASE_OFFLOAD, "--kv-offload-sink", "32760", "--kv-offload-window", "32")
    assert err is not None and "must be below 32768" in err, err
    assert check(*BASE_OFFLOAD, "--kv-offload-sink", "64", "--kv-offload-window", "4096") is None
    # a pool the fixed rows crowd out: the error names sink and window among the flags to lower
    from sglang_elastic.offload.policy import OffloadPolicy
    from sglang_elastic.offload.sizing import ModelShape, SizingError, size_pool

    shape = ModelShape(layers=32, q_heads=32, kv_heads=8, head_dim=128, v_head_dim=128, elem=2, context_len=131072)
    policy = OffloadPolicy(sink=4, window=30000, budget_frac=0.05, max_topk=2048, dense_layers=2)
    with pytest.raises(SizingError) as e:
        size_pool(60 << 30, shape, policy, 4096, 64, 500 << 30)
    assert "each request keeps 4 + 30000 sink and window V rows per sparse layer" in str(e.value) and "--kv-offload-window" in str(e.value)


def test_dense_layers_that_leave_nothing_sparse_are_refused_before_the_weights_load():
    """llama-3.1-8b (the embedded config) has 32 layers: 32 dense layers offload nothing; the resident-V reference may."""
    err = check(*BASE_OFFLOAD, "--kv-offload-dense-layers", "32")
    assert err is not None and "--kv-offload-dense-layers 32 leaves none of the model's 32 layers sparse" in err, err
    assert check(*BASE_OFFLOAD, "--kv-offload-dense-layers", "31") is None
    assert check(*BASE_OFFLOAD, "--kv-offload-dense-layers", "32", "--kv-offload-resident-v") is None
    # with --json-model-override-args, the layers SGLang will build (review #32: the file's count was read alone)
    over = ["--json-model-override-args", '{"num_hidden_layers": 64}']
    assert check(*BASE_OFFLOAD, "--kv-offload-dense-layers", "40", *over) is None
    err = check(*BASE_OFFLOAD, "--kv-offload-dense-layers", "4", "--json-model-override-args", '{"num_hidden_layers": 4}')
    assert err is not None and "--kv-offload-dense-layers 4 leaves none of the model's 4 layers sparse" in err, err
    from sglang_elastic import config
    from sglang_elastic.kernels import offload as ko

    assert config.LFU_MAX_LEN == ko.LFU_MAX_LEN == 1 << 21  # one bound for the flag check and the kernels, their literals' 21 bits


def test_serve_reads_an_abbreviated_flag_as_sglangs_parser_does():
    cmd = serve.build_command("llama-3.1-8b", ["--enable-kv-off", "--disable-radix-cache"])
    assert "--attention-backend" not in cmd  # the plugin picks the offload backend
    assert serve.check_flags(cmd[3:]) is None
    cmd = serve.build_command("llama-3.1-8b", ["--attention-back=triton"])
    assert cmd.count("--attention-backend") == 0 and "--attention-back=triton" in cmd


def test_the_calibration_cache_takes_a_directory_or_off_in_any_case(tmp_path):
    dec = ["--attention-backend", "flashinfer", "--decode-attention-backend", "persistentkv"]
    err = check(*dec, "--decode-calibration-cache", "")
    assert err is not None and "--decode-calibration-cache needs a directory or off" in err, err
    f = tmp_path / "file"
    f.write_text("x")
    err = check(*dec, "--decode-calibration-cache", str(f))
    assert err is not None and "is a file" in err, err
    assert check(*dec, "--decode-calibration-cache", "OFF") is None
    assert config._calibration_cache("OFF") == "off" and config._calibration_cache(str(tmp_path / "new")) == str(tmp_path / "new")


def test_a_decode_flag_with_offload_names_the_offload_backend():
    err = check(*BASE_OFFLOAD, "--decode-policy", "split")
    assert err is not None and "(decode backend here: kvoffload)" in err, err


@pytest.mark.parametrize("extra", [["--decode-startup-calibration", "force"], ["--decode-online-correction", "on"]])
def test_calibration_or_correction_asked_for_beside_a_forced_path_is_refused(extra):
    dec = ["--attention-backend", "flashinfer", "--decode-attention-backend", "persistentkv"]
    err = check(*dec, "--decode-policy", "split", *extra)
    assert err is not None and f"{extra[0]} {extra[1]} applies to --decode-policy auto only: --decode-policy split" in err, err
    assert check(*dec, "--decode-policy", "auto", *extra) is None
    assert check(*dec, "--decode-policy", "split", "--decode-online-correction", "off", "--decode-startup-calibration", "off") is None


@pytest.mark.parametrize("identity", [False, True])
@pytest.mark.parametrize("mode", ["stock", "elastic", "always-lent"])
def test_every_server_the_elastic_benchmark_starts_passes_the_plugins_checks(mode, identity):
    """scripts/gpu/bench_elastic.py's server commands (with an --elastic-extra for the dynamic servers) must
    pass the flag checks they meet at start-up: the mode refusals above once stopped its always-lent servers."""
    from gpu_scripts import load_script

    b = load_script("bench_elastic")
    cmd = b.server_cmd(mode, 1, 30000, identity, extra=["--elastic-kv-reclaim-wait", "block"])
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    err = serve.check_flags(cmd[3:])
    assert err is None, err


def test_dry_run_refuses_a_tp_the_heads_do_not_split_over_and_a_local_model_path_that_does_not_exist(tmp_path):
    """New-user finding (2026-12-07): ``serve --dry-run --tp 3`` printed a command that SGLang refuses (32 heads over 3
    ranks) and ``--model-path /nonexistent`` passed; both now get the advisor's one line. A Hugging Face id and a
    model the advisor does not read are left to SGLang."""
    import json

    assert check("--tp", "3") == "--tp 3: the model's 32 attention heads do not split evenly over 3 GPUs (SGLang refuses it)"
    assert check("--tp", "2") is None and check("--tp", "8") is None  # 8 KV heads replicate or split over 2 and 8
    assert check("--model-path", str(tmp_path / "none")) == (f"--model-path {tmp_path / 'none'}: no such file or directory "
                                                             "(a Hugging Face id, org/name, is downloaded by SGLang)")
    assert check("--model-path", "meta-llama/Llama-3.1-8B", "--tp", "3") is None  # a hub id: SGLang's to fetch and check
    cfg = json.loads((serve.model_path("llama-3.1-8b") / "config.json").read_text())
    (tmp_path / "kv6").mkdir()
    (tmp_path / "kv6" / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 6, "num_attention_heads": 24, "hidden_size": 3072}))
    assert "6 KV heads neither split evenly over 4 GPUs" in check("--model-path", str(tmp_path / "kv6"), "--tp", "4")
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 8}))
    assert check("--model-path", str(tmp_path / "moe"), "--tp", "3") is None  # not the advisor's to judge
    (tmp_path / "awq").mkdir()  # quantized weights split their heads as the 16-bit ones do
    (tmp_path / "awq" / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq", "bits": 4}}))
    assert check("--model-path", str(tmp_path / "awq"), "--tp", "3").startswith("--tp 3: the model's 32 attention heads")
    assert check("--model-path", str(tmp_path / "awq"), "--tp", "2") is None
    # the heads SGLang builds with --json-model-override-args (review #32: the file's were read alone)
    over = json.dumps({"num_attention_heads": 48, "num_key_value_heads": 12, "hidden_size": 6144, "intermediate_size": 12288})
    assert check("--tp", "3", "--json-model-override-args", over) is None
    assert check("--tp", "4", "--json-model-override-args", json.dumps({"num_attention_heads": 30, "hidden_size": 3840})).startswith(
        "--tp 4: the model's 30 attention heads")
