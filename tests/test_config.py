"""sglang-elastic flags inside SGLang's own argument parsing (through the plugin)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_elastic import config

MODEL = os.path.join(os.path.dirname(config.__file__), "models", "llama-3.1-8b")

PARSE = """
import json, os, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
sa = prepare_server_args(sys.argv[1:])
print("CONFIG", os.environ.get("SGLANG_ELASTIC_CONFIG"))
print("MODEL", sa.model_path)
"""


@pytest.fixture
def launch_args(sglang_python, monkeypatch):
    """SGLang's own parse of ``--model-path MODEL --device cpu FLAGS`` with the
    plugins loaded, in a process of its own (forked after SGLang's import)."""
    monkeypatch.delenv("SGLANG_ELASTIC_CONFIG", raising=False)

    def parse(*flags):
        r = sglang_python.run(PARSE, ["--model-path", MODEL, "--device", "cpu", *flags])
        cfg = next((json.loads(l.split(" ", 1)[1]) for l in r.stdout.splitlines() if l.startswith("CONFIG ") and l != "CONFIG None"), None)
        return r, cfg

    return parse


def test_flags_join_sglangs_parser_and_reach_the_scheduler_processes(launch_args):
    r, cfg = launch_args("--enable-elastic-kv", "--elastic-kv-mode", "always-lent", "--elastic-kv-lend-bytes", "8GiB", "--elastic-kv-handle-mb", "128")
    assert r.returncode == 0, r.stderr[-2000:]
    assert cfg == {"enabled": True, "mode": "always-lent", "lend_bytes": 8 << 30, "handle_mb": 128, "lend_after_steps": 32, "margin_mb": 1024,
                   "activation_rule": "sglang", "reclaim_wait": "decode", "decode_policy": "auto", "decode_calibration": None, "decode_calibration_cache": None,
                   "decode_startup_calibration": "auto", "decode_online": "on",
                   "offload": {"enabled": False, "topk": 2048, "budget": 0.05, "sink": 4, "window": 32, "dense_layers": 2,
                               "denominator": "estimate", "chunk": 16, "hot_tokens": 4096, "hot_slack": 2.0, "hot_slack_max": 0.0, "host_gb": None, "resident_v": False, "prefetch": "off", "eviction": "lru", "keep_v": None, "keep_reserve": None, "copy_timing": False, "dense_launch": ""}}
    assert f"MODEL {MODEL}" in r.stdout


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--speculative-algorithm", "NGRAM"], "does not support --speculative-algorithm 'NGRAM'"),
        (["--enable-hierarchical-cache"], "does not support --enable-hierarchical-cache True"),
        (["--pp-size", "2"], "does not support --pp-size 2"),
    ],
)
def test_unsupported_sglang_features_are_refused_at_start_up(flags, message, launch_args):
    r, cfg = launch_args("--enable-elastic-kv", *flags)
    assert r.returncode != 0 and cfg is None
    assert message in r.stderr and "Traceback" not in r.stderr


def test_published_config_reaches_child_processes(monkeypatch):
    import argparse

    p = argparse.ArgumentParser()
    config.add_cli_args(p)
    cfg = config.from_namespace(p.parse_args(["--enable-elastic-kv", "--elastic-kv-mode", "always-lent", "--elastic-kv-lend-bytes", "8GiB", "--elastic-kv-handle-mb", "128"]))
    assert cfg == config.ElasticKVConfig(enabled=True, mode="always-lent", lend_bytes=8 << 30, handle_mb=128, lend_after_steps=32, margin_mb=1024)
    monkeypatch.delenv(config.ENV, raising=False)
    config.publish(cfg)
    out = subprocess.run([sys.executable, "-c", "from sglang_elastic import config; print(config.current())"], capture_output=True, text=True)
    assert "ElasticKVConfig(enabled=True, mode='always-lent', lend_bytes=8589934592, handle_mb=128" in out.stdout


def test_without_the_flag_nothing_is_enabled(launch_args):
    r, cfg = launch_args()
    assert r.returncode == 0, r.stderr[-2000:]
    assert cfg["enabled"] is False
    assert f"MODEL {MODEL}" in r.stdout  # SGLang's own args are untouched


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--enable-elastic-kv", "--elastic-kv-lend-bytes", "8XB"], "not a byte size: '8XB'"),
        (["--enable-elastic-kv", "--elastic-kv-mode", "sometimes"], "invalid choice: 'sometimes'"),
        (["--elastic-kv-mode", "always-lent"], "--elastic-kv-mode (and every --elastic-kv-* flag) needs --enable-elastic-kv"),
        (["--enable-elastic-kv", "--elastic-kv-lend-after-steps", "0"], "--elastic-kv-lend-after-steps must be >= 1"),
        (["--enable-elastic-kv", "--elastic-kv-lend-bytes", "0"], "--elastic-kv-lend-bytes must be positive"),
    ],
)
def test_bad_values_stop_the_launch_with_one_clear_line(flags, message, launch_args):
    r, cfg = launch_args(*flags)
    assert r.returncode != 0 and cfg is None
    assert message in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("text,value", [("8589934592", 8 << 30), ("8GiB", 8 << 30), ("512MiB", 512 << 20), ("1.5G", 1_500_000_000), ("64 kib", 65536)])
def test_parse_bytes(text, value):
    assert config.parse_bytes(text) == value


def test_parse_bytes_names_what_was_typed_when_it_is_under_one_byte_or_not_a_size():
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match=r"'0.1' is less than one byte"):
        config.parse_bytes("0.1")
    with pytest.raises(argparse.ArgumentTypeError, match=r"not a byte size: '8 apples'"):
        config.parse_bytes("8 apples")
    assert config.parse_bytes("0") == 0  # refused later with the flag's name (must be positive)
    assert config.parse_bytes("1.005KB") == 1005 and config.parse_bytes("9" * 400) == int("9" * 400)  # exact, no float overflow


def test_config_round_trips_through_the_environment():
    cfg = config.ElasticKVConfig(enabled=True, mode="off", lend_bytes=123, handle_mb=2, lend_after_steps=5, margin_mb=0)
    assert config.ElasticKVConfig.from_env(cfg.to_env()) == cfg
    with pytest.raises(config.ConfigError, match="not a valid sglang-elastic config"):
        config.ElasticKVConfig.from_env('{"enabled": true, "colour": "red"}')


@pytest.mark.parametrize("flag,value", [("--elastic-kv-lend-after-steps", "8"), ("--elastic-kv-margin-mb", "0"), ("--elastic-kv-handle-mb", "64"),
                                        ("--elastic-kv-activation-rule", "measured"), ("--elastic-kv-reclaim-wait", "block"),
                                        ("--elastic-kv-reclaim-wait", "decode"),
                                        # at their default values too (a new user's finding, as for the offload flags)
                                        ("--elastic-kv-activation-rule", "sglang"), ("--elastic-kv-mode", "dynamic"),
                                        ("--elastic-kv-margin-mb", "1024"), ("--elastic-kv-handle-mb", "0"), ("--elastic-kv-lend-after-steps", "32")])
def test_every_elastic_flag_needs_the_enable_flag(flag, value):
    import argparse

    p = argparse.ArgumentParser()
    config.add_cli_args(p)
    with pytest.raises(config.ConfigError, match=flag + r" \(and every --elastic-kv-\* flag\) needs --enable-elastic-kv"):
        config.from_namespace(p.parse_args([flag, value]))


def test_decode_policy_reaches_the_schedulers_through_sglangs_parser(launch_args):
    r, cfg = launch_args("--attention-backend", "flashinfer", "--decode-attention-backend", "persistentkv", "--decode-policy", "compact")
    assert r.returncode == 0, r.stderr[-2000:]
    assert cfg["decode_policy"] == "compact" and cfg["decode_calibration"] is None


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--decode-attention-backend", "persistentkv", "--decode-policy", "fastest"], "invalid choice: 'fastest'"),
        (["--decode-policy", "split"], "--decode-policy applies only with --decode-attention-backend persistentkv"),
        (["--attention-backend", "flashinfer", "--decode-policy", "split"], "--decode-policy applies only with --decode-attention-backend persistentkv (decode backend here: flashinfer)"),
        (["--decode-attention-backend", "triton", "--decode-calibration", "x.json"], "--decode-calibration applies only with --decode-attention-backend persistentkv"),
        (["--decode-attention-backend", "persistentkv", "--decode-calibration", "/nonexistent.json"], "--decode-calibration: cannot read calibration file /nonexistent.json"),
        (["--decode-attention-backend", "persistentkv", "--decode-calibration", str(Path(__file__).parents[1] / "docs/results/eval/ttft_vs_chunk.png")],
         "is not UTF-8 text"),
        (["--decode-calibration-cache", "/tmp/x"], "--decode-calibration-cache applies only with --decode-attention-backend persistentkv"),
        (["--decode-attention-backend", "triton", "--decode-online-correction", "off"], "--decode-online-correction applies only with"),
        (["--decode-attention-backend", "persistentkv", "--decode-startup-calibration", "always"], "invalid choice: 'always'"),
    ],
)
def test_bad_decode_flags_stop_with_one_clear_line(flags, message, capsys):
    """The same parse as inside SGLang (its parser gains these flags through the plugin's hook)."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--attention-backend")
    p.add_argument("--decode-attention-backend")
    config.add_cli_args(p)
    try:
        config.from_namespace(p.parse_args(flags))
    except config.ConfigError as e:
        assert message in str(e)
    except SystemExit:
        assert message in capsys.readouterr().err
    else:
        pytest.fail(f"{flags} accepted")


def test_decode_calibration_flags_reach_the_config(tmp_path):
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--decode-attention-backend")
    config.add_cli_args(p)
    cfg = config.from_namespace(p.parse_args(["--decode-attention-backend", "persistentkv", "--decode-calibration-cache", str(tmp_path / "c"),
                                              "--decode-startup-calibration", "force", "--decode-online-correction", "off"]))
    assert (cfg.decode_calibration_cache, cfg.decode_startup_calibration, cfg.decode_online) == (str(tmp_path / "c"), "force", "off")
    cfg = config.from_namespace(p.parse_args(["--decode-attention-backend", "persistentkv", "--decode-calibration-cache", "off"]))
    assert (cfg.decode_calibration_cache, cfg.decode_startup_calibration, cfg.decode_online) == ("off", "auto", "on")
    assert config.ElasticKVConfig.from_env(cfg.to_env()) == cfg
    with pytest.raises(config.ConfigError, match="--decode-online-correction must be one of on, off"):
        config.ElasticKVConfig(decode_online="maybe")


def test_decode_policy_value_checked_in_the_config_object():
    with pytest.raises(config.ConfigError, match="--decode-policy must be one of"):
        config.ElasticKVConfig(decode_policy="fastest")


@pytest.mark.parametrize(
    "flags,env,message",
    [
        ({"enable_pdmux": True}, None, "does not support --enable-pdmux True (PD-multiplexing keeps its split prefill batch's KV outside"),
        ({"dllm_algorithm": "LowConfidence"}, None, "does not support --dllm-algorithm 'LowConfidence' (diffusion LLMs keep requests' KV in a staging queue"),
        ({"radix_cache_backend": "mine"}, None, "does not support --radix-cache-backend 'mine' (a registered radix-cache backend"),
        ({"enable_session_radix_cache": True}, None, "does not support --enable-session-radix-cache True (it needs SGLang's unified radix tree"),
        ({"kv_canary": "log"}, None, "does not support --kv-canary 'log' (the KV canary attaches only to SGLang's own pool classes)"),
        ({}, "SGLANG_ENABLE_UNIFIED_RADIX_TREE", "does not support SGLANG_ENABLE_UNIFIED_RADIX_TREE=1 (the unified radix tree keeps KV ids in components"),
        ({}, "SGLANG_EXPERIMENTAL_CPP_RADIX_TREE", "does not support SGLANG_EXPERIMENTAL_CPP_RADIX_TREE=1 (the C++ radix tree"),
    ],
)
def test_kv_holders_a_reclaim_cannot_vacate_are_refused_with_the_reason(flags, env, message, monkeypatch):
    """Issue 22, defect 1 and 5: every SGLang feature that keeps KV ids where
    a reclaim does not look is refused at start-up, one line naming it and why."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    ns = argparse.Namespace(**{f: getattr(ServerArgs, f) for f in ("enable_pdmux", "dllm_algorithm", "radix_cache_backend",
                                                                     "enable_session_radix_cache", "kv_canary")})
    for name in ("SGLANG_ENABLE_UNIFIED_RADIX_TREE", "SGLANG_EXPERIMENTAL_CPP_RADIX_TREE", "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"):
        monkeypatch.delenv(name, raising=False)
    config.check_server_args(config.ElasticKVConfig(enabled=True), ns)  # SGLang's defaults pass
    if env:
        monkeypatch.setenv(env, "1")
    for k, v in flags.items():
        setattr(ns, k, v)
    with pytest.raises(config.ConfigError) as e:
        config.check_server_args(config.ElasticKVConfig(enabled=True), ns)
    assert message in str(e.value) and "\n" not in str(e.value)
    config.check_server_args(config.ElasticKVConfig(enabled=False), ns)  # nothing is refused without the pool


def test_streaming_sessions_are_accepted_with_the_elastic_pool(launch_args):
    """Their slots are remapped by a reclaim (tests/test_sessions.py)."""
    r, cfg = launch_args("--enable-elastic-kv", "--enable-streaming-session")
    assert r.returncode == 0, r.stderr[-2000:]
    assert cfg["enabled"] is True


def test_the_activation_rule_is_sglangs_estimate_by_default_and_measured_by_flag():
    import argparse

    p = argparse.ArgumentParser()
    config.add_cli_args(p)
    assert config.from_namespace(p.parse_args(["--enable-elastic-kv"])).activation_rule == "sglang"
    cfg = config.from_namespace(p.parse_args(["--enable-elastic-kv", "--elastic-kv-activation-rule", "measured"]))
    assert cfg.activation_rule == "measured" and config.ElasticKVConfig.from_env(cfg.to_env()).activation_rule == "measured"
    with pytest.raises(config.ConfigError, match="--elastic-kv-activation-rule must be one of sglang, measured, not 'guess'"):
        config.ElasticKVConfig(enabled=True, activation_rule="guess")


def test_a_bad_value_in_the_published_config_names_the_variable(monkeypatch):
    """Review #32: a field error in ``SGLANG_ELASTIC_CONFIG`` named only the flag (the plugin load then said "unset it"
    of nothing); every error now names the variable."""
    import pytest

    from sglang_elastic import config

    monkeypatch.setenv(config.ENV, '{"offload": {"topk": -1}}')
    with pytest.raises(config.ConfigError, match=r"^SGLANG_ELASTIC_CONFIG is not a valid sglang-elastic config: --kv-offload-topk must be >= 0, not -1$"):
        config.current()
