"""``--enable-kv-offload``: flags through SGLang's own parser, refusals at
start-up, and the pool's sizing arithmetic."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_elastic import config
from sglang_elastic.offload.decode import SplitConfig
from sglang_elastic.offload.policy import OffloadPolicy
from sglang_elastic.offload.sizing import HOST_RESERVE_BYTES, ModelShape, SizingError, device_fixed_bytes, size_pool

MODEL = os.path.join(os.path.dirname(config.__file__), "models", "llama-3.1-8b")
PARSE = """
import json, os, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
sa = prepare_server_args(sys.argv[1:])
print("CONFIG", os.environ.get("SGLANG_ELASTIC_CONFIG"))
print("BACKENDS", json.dumps(sa.get_attention_backends()))
"""


def test_offload_flags_reach_the_schedulers_and_select_the_kvoffload_backend(sglang_python, monkeypatch):
    """SGLang's own parse with the plugin loaded, in a process of its own (forked after SGLang's import)."""
    monkeypatch.delenv("SGLANG_ELASTIC_CONFIG", raising=False)
    r = sglang_python.run(PARSE, ["--model-path", MODEL, "--device", "cpu", "--enable-kv-offload", "--disable-radix-cache",
                                  "--kv-offload-topk", "1024", "--kv-offload-hot-tokens", "3000", "--kv-offload-denominator", "estimate",
                                  "--kv-offload-chunk", "32", "--kv-offload-host-gb", "80", "--kv-offload-eviction", "lfu",
                                  "--kv-offload-hot-slack", "1.5", "--kv-offload-keep-v", "--kv-offload-hot-slack-max", "4",
                                  "--kv-offload-copy-timing", "--kv-offload-dense-launch", "fused=1,min_chunk=2048,pdl=on",
                                  "--kv-offload-keep-reserve", "0.03"])
    out = dict(l.split(" ", 1) for l in r.stdout.splitlines() if l.startswith(("CONFIG ", "BACKENDS ")))
    assert r.returncode == 0, r.stderr[-2000:]
    off = json.loads(out["CONFIG"])["offload"]
    assert off == {"enabled": True, "topk": 1024, "budget": 0.05, "sink": 4, "window": 32, "dense_layers": 2, "denominator": "estimate",
                   "chunk": 32, "hot_tokens": 3000, "hot_slack": 1.5, "hot_slack_max": 4.0, "host_gb": 80.0, "resident_v": False, "prefetch": "off",
                   "eviction": "lfu", "keep_v": True, "keep_reserve": 0.03, "copy_timing": True, "dense_launch": "fused=1,min_chunk=2048,pdl=on"}
    assert json.loads(out["BACKENDS"]) == ["kvoffload", "kvoffload"]
    got = config.ElasticKVConfig.from_env(out["CONFIG"]).offload
    assert got.policy() == OffloadPolicy(max_topk=1024, denominator="estimate", chunk=32)
    # min_chunk given without chunk_mean: the chunk named is the plan's (the default chunk_mean off with it)
    assert got.split_config() == dataclasses.replace(SplitConfig(), dense_fused=True, dense_min_chunk=2048, dense_pdl=True, dense_chunk_mean=0)


def namespace(*flags, **sglang):
    """Our flags parsed as SGLang's parser parses them (``config.add_cli_args``),
    plus SGLang's own fields the checks read (defaults as SGLang's)."""
    import argparse

    p = argparse.ArgumentParser()
    config.add_cli_args(p)
    ns = p.parse_args(list(flags))
    base = dict(disable_radix_cache=False, attention_backend=None, prefill_attention_backend=None, decode_attention_backend=None,
                speculative_algorithm=None, page_size=None, enable_mixed_chunk=False, kv_cache_dtype="auto", pp_size=1)
    for k, v in {**base, **sglang}.items():
        setattr(ns, k, v)
    return ns


@pytest.mark.parametrize("env", ["SGLANG_EXPERIMENTAL_CPP_RADIX_TREE", "SGLANG_ENABLE_UNIFIED_RADIX_TREE"])
def test_the_radix_cache_is_accepted_and_other_radix_trees_are_refused_with_one_line(env, monkeypatch):
    """SGLang's default radix cache passes the checks (a matched prefix is rebuilt in the request's row:
    ``OffloadKVPool.plan_prefix``); the C++ and unified radix trees, chosen by environment switches, stop
    the launch with one line unless the radix cache is off."""
    from sglang_elastic import plugin

    monkeypatch.setenv("SGLANG_ELASTIC_CONFIG", "")  # an accepted launch publishes its config here: the teardown restores it
    for name in ("SGLANG_EXPERIMENTAL_CPP_RADIX_TREE", "SGLANG_ENABLE_UNIFIED_RADIX_TREE"):
        monkeypatch.delenv(name, raising=False)
    assert plugin._from_cli_args(None, namespace("--enable-kv-offload")) is None
    monkeypatch.setenv(env, "y")
    with pytest.raises(SystemExit) as e:
        plugin._from_cli_args(None, namespace("--enable-kv-offload"))
    assert str(e.value) == (f"sglang-elastic: --enable-kv-offload does not support {env}=y: validated with SGLang's default radix "
                            "cache only (unset it, or pass --disable-radix-cache)")
    assert plugin._from_cli_args(None, namespace("--enable-kv-offload", disable_radix_cache=True)) is None


@pytest.mark.parametrize("flags,sglang,message", [
    ([], dict(disable_radix_cache=True, speculative_algorithm="NGRAM"), "does not support --speculative-algorithm 'NGRAM'"),
    ([], dict(disable_radix_cache=True, attention_backend="triton"), "drop --attention-backend triton"),
    (["--enable-elastic-kv"], dict(disable_radix_cache=True), "use one"),
    (["--kv-offload-hot-tokens", "100"], dict(disable_radix_cache=True), "at least --kv-offload-topk 2048"),
    (["--kv-offload-hot-slack", "0.5"], dict(disable_radix_cache=True), "--kv-offload-hot-slack must be between 1 and 16"),
    (["--kv-offload-hot-slack-max", "1.5"], dict(disable_radix_cache=True),
     "--kv-offload-hot-slack-max must be between --kv-offload-hot-slack (2.0) and 16, or 0 (off), not 1.5"),
    (["--kv-offload-hot-slack-max", "4", "--kv-offload-resident-v"], dict(disable_radix_cache=True),
     "--kv-offload-hot-slack-max has no hot buffers to grow with --kv-offload-resident-v"),
    (["--kv-offload-copy-timing", "--kv-offload-resident-v"], dict(disable_radix_cache=True),
     "--kv-offload-copy-timing has no copies to time with --kv-offload-resident-v"),
    # resident V has no hot buffers and no host pool: these were accepted and did nothing (new-user finding)
    (["--kv-offload-hot-slack", "4", "--kv-offload-resident-v"], dict(disable_radix_cache=True),
     "--kv-offload-hot-slack has no hot buffers to size with --kv-offload-resident-v (V stays on the GPU)"),
    (["--kv-offload-eviction", "lfu", "--kv-offload-resident-v"], dict(disable_radix_cache=True),
     "--kv-offload-eviction has no hot buffers to evict from with --kv-offload-resident-v"),
    (["--kv-offload-host-gb", "10", "--kv-offload-resident-v"], dict(disable_radix_cache=True),
     "--kv-offload-host-gb has no host pool to cap with --kv-offload-resident-v"),
    # given at their default values: refused as well (review #32: the check compared values with the defaults)
    (["--kv-offload-resident-v", "--kv-offload-hot-slack", "2"], dict(disable_radix_cache=True),
     "--kv-offload-hot-slack has no hot buffers to size with --kv-offload-resident-v (V stays on the GPU)"),
    (["--kv-offload-resident-v", "--kv-offload-hot-slack-max", "0"], dict(disable_radix_cache=True),
     "--kv-offload-hot-slack-max has no hot buffers to grow with --kv-offload-resident-v"),
    (["--kv-offload-resident-v", "--kv-offload-eviction", "lru"], dict(disable_radix_cache=True),
     "--kv-offload-eviction has no hot buffers to evict from with --kv-offload-resident-v"),
    (["--kv-offload-dense-launch", "fused=1", "--kv-offload-resident-v"], dict(disable_radix_cache=True),
     "--kv-offload-dense-launch sets the all-dense step of --kv-offload-keep-v, which is off (off with --kv-offload-resident-v)"),
    (["--kv-offload-dense-launch", "fused=1", "--no-kv-offload-keep-v"], dict(disable_radix_cache=True),
     "--kv-offload-dense-launch sets the all-dense step of --kv-offload-keep-v, which is off"),
    (["--kv-offload-keep-reserve", "0.6"], dict(disable_radix_cache=True),
     "--kv-offload-keep-reserve must be a share of the pool between 0 and 0.5, not 0.6"),
    (["--kv-offload-keep-reserve", "nan"], dict(disable_radix_cache=True), "--kv-offload-keep-reserve must be a share of the pool between 0 and 0.5"),
    (["--kv-offload-keep-reserve", "0.05", "--no-kv-offload-keep-v"], dict(disable_radix_cache=True),
     "--kv-offload-keep-reserve sets a share kept free by --kv-offload-keep-v, which is off"),
    # given at its default value, still refused where it has nothing to set
    (["--kv-offload-keep-reserve", "0.02", "--kv-offload-resident-v"], dict(disable_radix_cache=True),
     "--kv-offload-keep-reserve sets a share kept free by --kv-offload-keep-v, which is off (off with --kv-offload-resident-v)"),
    (["--kv-offload-dense-launch", "fuse=1"], dict(disable_radix_cache=True), "'fuse=1' is not key=value with a key of min_chunk, fused"),
    (["--kv-offload-dense-launch", "block_n=48"], dict(disable_radix_cache=True), "block_n takes one of 0, 16, 32, 64, 128, not '48'"),
    (["--kv-offload-dense-launch", "num_warps=3"], dict(disable_radix_cache=True), "num_warps takes one of none, 1, 2, 4, 8, 16, not '3'"),
    (["--kv-offload-dense-launch", "pdl=yes"], dict(disable_radix_cache=True), "pdl takes 0/1, true/false or on/off, not 'yes'"),
    (["--kv-offload-dense-launch", "kept_stream=2"], dict(disable_radix_cache=True), "kept_stream takes 0/1, true/false or on/off, not '2'"),
    (["--kv-offload-dense-launch", "min_chunk=-1"], dict(disable_radix_cache=True), "min_chunk takes an integer 0 to 1048576 (positions), not '-1'"),
    (["--kv-offload-dense-launch", "chunk_mean=1001"], dict(disable_radix_cache=True), "chunk_mean takes an integer 0 to 1000 (percent), not '1001'"),
    (["--kv-offload-dense-launch", "chunk_mean=125", "--kv-offload-dense-launch", "pdl=0,pdl=1"], dict(disable_radix_cache=True),
     "pdl given twice"),
    (["--kv-offload-dense-launch", "pdl=1,pdl=0"], dict(disable_radix_cache=True), "pdl given twice"),
    (["--kv-offload-dense-launch", "", "--no-kv-offload-keep-v"], dict(disable_radix_cache=True),
     "--kv-offload-dense-launch needs KEY=VALUE,... (omit it for the defaults)"),
    (["--kv-offload-budget", "1.5"], dict(disable_radix_cache=True), "--kv-offload-budget must be in (0, 1]"),
    (["--kv-offload-window", "0"], dict(disable_radix_cache=True), "--kv-offload-window must be >= 1"),
    (["--kv-offload-host-gb", "inf"], dict(disable_radix_cache=True), "--kv-offload-host-gb must be a positive number of GB (omit it for free host RAM), not inf"),
    (["--kv-offload-host-gb", "nan"], dict(disable_radix_cache=True), "--kv-offload-host-gb must be a positive number of GB"),
    (["--kv-offload-denominator", "estimate", "--kv-offload-chunk", "64"], dict(disable_radix_cache=True),
     "--kv-offload-chunk 64 must be at most --kv-offload-window 32"),
    (["--kv-offload-denominator", "selected", "--kv-offload-chunk", "16"], dict(disable_radix_cache=True),
     "--kv-offload-chunk applies only with --kv-offload-denominator estimate"),
    (["--kv-offload-window", "4"], dict(disable_radix_cache=True),
     "--kv-offload-window 4 is below the smallest V-summary chunk (8) of --kv-offload-denominator estimate (the default)"),
    (["--kv-offload-window", "8", "--kv-offload-chunk", "16"], dict(disable_radix_cache=True), "--kv-offload-chunk 16 must be at most --kv-offload-window 8"),
    (["--kv-offload-denominator", "full", "--kv-offload-chunk", "8"], dict(disable_radix_cache=True), "estimate (the chunk means it sizes), not full"),
    ([], dict(disable_radix_cache=True, enable_mixed_chunk=True), "does not support --enable-mixed-chunk"),
    ([], dict(disable_radix_cache=True, page_size=16), "does not support --page-size 16"),
    ([], dict(disable_radix_cache=True, kv_cache_dtype="fp8_e4m3"), "does not support --kv-cache-dtype 'fp8_e4m3'"),
])
def test_unsupported_combinations_are_refused_with_one_line(flags, sglang, message):
    """The plugin's hook on ``ServerArgs.from_cli_args`` stops the launch with one line."""
    from sglang_elastic import plugin

    with pytest.raises(SystemExit) as e:
        plugin._from_cli_args(None, namespace("--enable-kv-offload", *flags, **sglang))
    text = str(e.value)
    assert text.startswith("sglang-elastic: ") and message in text and "\n" not in text


@pytest.mark.parametrize("flags,message", [
    (["--enable-pdmux", "--chunked-prefill-size", "-1", "--disable-overlap-schedule"], "does not support --enable-pdmux True: PD-multiplexing"),
    (["--radix-cache-backend", "mine"], "does not support --radix-cache-backend 'mine': validated with SGLang's default radix cache only"),
    (["--enable-prefill-cp"], "does not support --enable-prefill-cp True: context-parallel prefill"),
    (["--attn-cp-size", "2", "--tp", "2"], "does not support --attn-cp-size 2"),
    (["--dllm-algorithm", "LowConfidence"], "does not support --dllm-algorithm 'LowConfidence'"),
    (["--cuda-graph-backend-decode", "breakable"], "does not support --cuda-graph-backend-decode 'breakable'"),
    (["--cuda-graph-backend-prefill", "full"], "does not support --cuda-graph-backend-prefill 'full'"),
    (["--debug-cuda-graph"], "does not support --debug-cuda-graph True"),
    (["--enable-torch-compile"], "does not support --enable-torch-compile True"),
    (["--enable-deterministic-inference"], "does not support --enable-deterministic-inference True"),
    (["--enable-flexkv"], "does not support --enable-flexkv True"),
    (["--enable-session-radix-cache"], "does not support --enable-session-radix-cache True"),
    (["--kv-canary", "log"], "does not support --kv-canary 'log'"),
    (["--cuda-graph-backend-prefill", "tc_piecewise"], "validated with SGLang's breakable prefill graphs"),
    (["--cuda-graph-config", '{"decode": {"backend": "breakable"}}'], "does not support --cuda-graph-config decode backend 'breakable'"),
    (["--cuda-graph-config", '{"prefill": {"backend": "full"}}'], "does not support --cuda-graph-config prefill backend 'full'"),
    (["--rl-on-policy-target", "fsdp"], "does not support --rl-on-policy-target 'fsdp': SGLang turns on deterministic inference"),
])
def test_sglang_features_the_pool_does_not_plan_are_refused_through_sglangs_own_parser(flags, message):
    """A review of SGLang 0.5.17's flags (2026-12-04) found these accepted: each runs KV writes or graph replays
    the offload pool does not plan. Through SGLang's real parser (the flag names are SGLang's), one line each;
    the defaults of the graph backends stay accepted."""
    from sglang_elastic import serve

    base = ["--enable-kv-offload", "--disable-radix-cache"]
    err = serve.check_flags(serve.build_command("llama-3.1-8b", base + flags)[3:])
    assert err is not None and err.startswith("--enable-kv-offload ") and message in err and "\n" not in err, err
    for ok in (["--cuda-graph-backend-decode", "full"], ["--cuda-graph-backend-prefill", "breakable"], ["--disable-cuda-graph"],
               ["--cuda-graph-config", '{"decode": {"backend": "full"}, "prefill": {"backend": "breakable"}}']):
        assert serve.check_flags(serve.build_command("llama-3.1-8b", base + ok)[3:]) is None, ok


def test_offload_sets_its_attention_backend():
    ns = namespace("--enable-kv-offload", disable_radix_cache=True)
    cfg = config.from_namespace(ns)
    config.check_server_args(cfg, ns)
    config.apply_offload_defaults(cfg, ns)
    assert ns.attention_backend == config.OFFLOAD_BACKEND


@pytest.mark.parametrize("flags", [["--kv-offload-topk", "2048"], ["--kv-offload-denominator", "selected"], ["--kv-offload-resident-v"],
                                   ["--kv-offload-host-gb", "40"], ["--kv-offload-copy-timing"], ["--kv-offload-dense-launch", "pdl=1"],
                                   ["--kv-offload-keep-reserve", "0.02"]])
def test_offload_flags_given_without_enable_are_refused_even_at_their_default(flags):
    """A flag at its default value was accepted silently without --enable-kv-offload (seen by a new user)."""
    with pytest.raises(config.ConfigError, match=f"{flags[0]} .*needs --enable-kv-offload"):
        config.from_namespace(namespace(*flags))
    cfg = config.from_namespace(namespace("--enable-kv-offload", *flags, disable_radix_cache=True)).offload
    want = "selected" if "selected" in flags else "estimate"
    assert cfg.enabled and cfg.topk == 2048 and cfg.denominator == want and cfg.hot_tokens == 4096  # defaults fill the rest
    assert config.from_namespace(namespace()).offload == config.OffloadConfig()  # nothing given: off, nothing refused


@pytest.mark.parametrize("window,chunk", [(32, 16), (16, 16), (15, 8), (8, 8), (100, 16)])
def test_estimate_is_the_default_and_its_chunk_follows_a_smaller_window(window, chunk):
    """The shipped rule is ``estimate`` (it met the KL gate through SGLang where
    ``selected`` did not); a window below the default chunk takes the largest
    chunk that fits it, rather than refusing a flag the user never gave."""
    cfg = config.from_namespace(namespace("--enable-kv-offload", "--kv-offload-window", str(window), disable_radix_cache=True)).offload
    assert (cfg.denominator, cfg.chunk, cfg.policy().denominator, cfg.policy().chunk) == ("estimate", chunk, "estimate", chunk)
    sel = config.from_namespace(namespace("--enable-kv-offload", "--kv-offload-window", "4", "--kv-offload-denominator", "selected",
                                          disable_radix_cache=True)).offload
    assert (sel.denominator, sel.window) == ("selected", 4)  # a small window with another rule is fine


def test_offload_flags_without_enable_are_refused():
    with pytest.raises(config.ConfigError, match="needs --enable-kv-offload"):
        config.OffloadConfig(topk=10)
    with pytest.raises(config.ConfigError, match="needs --enable-kv-offload"):
        config.OffloadConfig(resident_v=True)


LLAMA8B = ModelShape(layers=32, kv_heads=8, head_dim=128, v_head_dim=128, q_heads=32, elem=2, context_len=131072)
STOCK_H200 = 906051 * 131072  # the KV budget stock SGLang turned into 906,051 tokens on the H200


def test_sizing_on_the_h200_budget_holds_about_1_7x_stock_with_k_on_the_gpu():
    sz = size_pool(STOCK_H200, LLAMA8B, OffloadPolicy(), hot_tokens=4096, requests=64, host_available_bytes=120 << 30)
    assert sz.stock_tokens == 906051 and sz.bound == "hbm"
    # per token: K of 32 layers (64 KiB) + V of 2 dense layers (4 KiB) + 30 loc_slot int16 + 32 scores + 8
    assert sz.device_token_bytes == 65536 + 4096 + 60 + 128 + 8
    # beside it: 65 request rows x (4 + 32) fixed V rows, the hot pages of 64 rows that T tokens' selections need
    # (2 slots per selected row, 5 % of T selected), each x 30 layers x 2 KiB; the slots' state, the page table,
    # the staging of one layer
    T = sz.tokens + 1
    pages = -(-(-(-T * 50000 * 2 // 1_000_000) + 65) // 64) + 65
    assert pages < 65 * 64  # the tokens bound the pages, not a full buffer per request row
    fixed = (65 * 36 + pages * 64 + 1) * 30 * 2048 + 65 * 4096 * 30 * 8 + 65 * 65 * 4 + 131072 * 8 * 256 * 2
    assert sz.device_fixed_bytes == fixed
    # the most tokens that fit, the page slot SGLang keeps aside
    assert T * sz.device_token_bytes + fixed <= STOCK_H200
    assert (T + 1) * sz.device_token_bytes + device_fixed_bytes(LLAMA8B, OffloadPolicy(), 4096, 64, tokens=T + 1) > STOCK_H200
    assert 1.70 < sz.tokens / 906051 < 1.72  # 1.61x with a fixed 4,096-row buffer per request row
    assert sz.host_bytes == (sz.tokens + 1) * 30 * 2048
    # fewer hot rows per selected row leave more K; so do fewer requests when their full buffers are the smaller bound
    assert size_pool(STOCK_H200, LLAMA8B, OffloadPolicy(), 4096, 64, 120 << 30, slack=1.5).tokens > sz.tokens
    assert size_pool(STOCK_H200, LLAMA8B, OffloadPolicy(), 4096, 8, 120 << 30).tokens > sz.tokens
    # the request count barely matters now (it did: 1.61x at 64, 1.67x at 48)
    assert abs(size_pool(STOCK_H200, LLAMA8B, OffloadPolicy(), 4096, 128, 120 << 30).tokens / sz.tokens - 1) < 0.01
    # SGLang's radix cache on: the hot buffers' hint per request row and position (65 x 131,072 int16 per sparse layer,
    # 511 MB) instead of per token id (60 bytes a token): 0.3 % fewer tokens here
    radix = size_pool(STOCK_H200, LLAMA8B, OffloadPolicy(), 4096, 64, 120 << 30, hint_by_row=True)
    assert radix.device_token_bytes == sz.device_token_bytes - 60
    T = radix.tokens + 1
    assert radix.device_fixed_bytes == device_fixed_bytes(LLAMA8B, OffloadPolicy(), 4096, 64, tokens=T) + 65 * 131072 * 30 * 2
    assert T * radix.device_token_bytes + radix.device_fixed_bytes <= STOCK_H200
    assert 0.995 < radix.tokens / sz.tokens < 0.998
    # keep-v (on by default): 12 bytes a token (its lists) and the kept rows' table, int32 per request row and position
    # of the context, and the kept lengths (65 x 131,073 int32: 34 MB); the kept V rows are pool slots, not counted here
    kept = size_pool(STOCK_H200, LLAMA8B, OffloadPolicy(), 4096, 64, 120 << 30, keep_v=True)
    assert kept.device_token_bytes == sz.device_token_bytes + 12
    T = kept.tokens + 1
    assert kept.device_fixed_bytes == device_fixed_bytes(LLAMA8B, OffloadPolicy(), 4096, 64, tokens=T) + 65 * 131073 * 4
    assert T * kept.device_token_bytes + kept.device_fixed_bytes <= STOCK_H200
    assert (T + 1) * kept.device_token_bytes + device_fixed_bytes(LLAMA8B, OffloadPolicy(), 4096, 64, tokens=T + 1, keep_v=True) > STOCK_H200
    assert sz.tokens - 1000 < kept.tokens < sz.tokens


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6000), st.sampled_from([0.01, 0.05, 0.2, 1.0]), st.sampled_from([1.0, 1.3, 2.0, 3.5]), st.sampled_from([16, 100, 4096]),
       st.sampled_from([1, 4, 64]), st.integers(1, 9), st.data())
def test_hot_pages_cover_every_set_of_running_requests_the_tokens_allow(T, budget, slack, hot, page, rows, data):
    """``hot_pages``: whatever the running requests' lengths (at most ``rows``
    of them, their tokens adding up to at most ``T``), the pages each is
    granted (``page_grant_run``'s rule) fit in the pool: a grant never finds it short."""
    from sglang_elastic.offload.sizing import hot_pages, slack_64ths

    pol = OffloadPolicy(sink=4, window=32, budget_frac=budget, max_topk=min(hot, 2048))
    n = data.draw(st.integers(1, rows))
    cuts = sorted(data.draw(st.lists(st.integers(0, T), min_size=n - 1, max_size=n - 1)))
    lens = [b - a for a, b in zip([0] + cuts, cuts + [T])]
    s64 = slack_64ths(slack)
    need = sum(-(-min(hot, -(-pol.counts(L)[2] * s64 // 64)) // page) for L in lens)
    assert need <= hot_pages(pol, T, rows, hot, slack, page)


def test_sizing_refuses_dense_layers_that_leave_nothing_sparse():
    """``--kv-offload-dense-layers 32`` on a 32-layer model was clamped silently: the server ran without offloading."""
    with pytest.raises(SizingError, match="--kv-offload-dense-layers 32 leaves none of the model's 32 layers sparse"):
        size_pool(STOCK_H200, LLAMA8B, OffloadPolicy(dense_layers=32), 4096, 48, 200 * 2**30)
    assert size_pool(STOCK_H200, LLAMA8B, OffloadPolicy(dense_layers=31), 4096, 48, 200 * 2**30).tokens > 0
    assert size_pool(STOCK_H200, LLAMA8B, OffloadPolicy(dense_layers=32), 4096, 48, 200 * 2**30, resident=True).tokens > 0  # no host tier


def test_sizing_names_the_host_as_the_bound_and_refuses_a_pool_below_one_request():
    host = HOST_RESERVE_BYTES + 40 * 10**9
    sz = size_pool(STOCK_H200, LLAMA8B, OffloadPolicy(), 4096, 64, host_available_bytes=host)
    assert sz.bound == "host" and sz.tokens == 40 * 10**9 // (30 * 2048) - 1
    capped = size_pool(STOCK_H200, LLAMA8B, OffloadPolicy(), 4096, 64, host_available_bytes=120 << 30, host_limit_bytes=30 * 10**9)
    assert capped.bound == "host" and capped.tokens == 30 * 10**9 // (30 * 2048) - 1
    assert size_pool(STOCK_H200, LLAMA8B, OffloadPolicy(), 4096, 64, 120 << 30, max_total_tokens=500000).bound == "max-total-tokens"
    with pytest.raises(SizingError, match="host memory holds V of only"):
        size_pool(STOCK_H200, LLAMA8B, OffloadPolicy(), 4096, 64, host_available_bytes=HOST_RESERVE_BYTES + 10**9)
    with pytest.raises(SizingError, match="--kv-offload-window, --kv-offload-hot-slack, --max-running-requests or --kv-offload-hot-tokens"):
        size_pool(8 << 30, LLAMA8B, OffloadPolicy(), 4096, 64, host_available_bytes=120 << 30)
    resident = size_pool(STOCK_H200, LLAMA8B, OffloadPolicy(), 4096, 64, 0, resident=True)
    assert resident.bound == "hbm" and resident.host_bytes == 0 and 0.99 < resident.tokens / 906051 < 1.0


def hook_targets(register, monkeypatch) -> list:
    """The SGLang targets ``register`` hands ``HookRegistry.register``, each checked to resolve to a method of the
    installed SGLang (a renamed method would silently never be called)."""
    import importlib

    from sglang.srt.plugins.hook_registry import HookRegistry

    seen = []
    monkeypatch.setattr(HookRegistry, "register", classmethod(lambda cls, target, fn, kind: seen.append(target)))
    register()
    for target in seen:
        mod, cls, meth = target.rsplit(".", 2)
        assert callable(getattr(getattr(importlib.import_module(mod), cls), meth)), target
    return seen


def test_every_offload_hook_names_a_method_of_sglang_0_5_17(monkeypatch):
    """The hooks' targets resolve in the installed SGLang (a renamed method would silently never be called)."""
    from sglang_elastic.offload import hooks

    seen = hook_targets(hooks.register, monkeypatch)
    assert "sglang.srt.mem_cache.memory_pool.ReqToTokenPool.free" in seen and len(seen) == 7
    assert {"sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req", "sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem"} <= set(seen)


def test_estimate_costs_a_summary_row_per_chunk_of_tokens_not_per_context():
    """``--kv-offload-denominator estimate``: the V summaries grow with the tokens held
    (one V row of the 30 sparse layers per 16 tokens), so a 128K context at 64 requests
    keeps ~1.6x stock (a per-row provisioning would have held 1.09x)."""
    from sglang_elastic.offload.sizing import summary_bytes, summary_token_bytes

    est = OffloadPolicy(denominator="estimate", chunk=16)
    base = size_pool(STOCK_H200, LLAMA8B, OffloadPolicy(), 4096, 64, host_available_bytes=120 << 30)
    sz = size_pool(STOCK_H200, LLAMA8B, est, 4096, 64, host_available_bytes=120 << 30)
    # a V row of 30 layers and its int32 stack entry per 16 tokens, and the token's int32 attended mark
    assert summary_token_bytes(LLAMA8B, est) == -(-(30 * 2048 + 4) // 16) + 4 == 3845
    assert sz.device_token_bytes == base.device_token_bytes + 3845
    T = sz.tokens + 1
    assert sz.device_fixed_bytes == device_fixed_bytes(LLAMA8B, OffloadPolicy(), 4096, 64, tokens=T) + summary_bytes(LLAMA8B, est, 64)
    assert summary_bytes(LLAMA8B, est, 64) == 65 * 8192 * 4 + 67 * 30 * 2048 + 65 * 32 * 32 * 128 * 4
    assert 1.61 < sz.tokens / 906051 < 1.64 < 1.70 < base.tokens / 906051  # 1.52x / 1.61x with fixed 4,096-row buffers
    assert summary_bytes(LLAMA8B, OffloadPolicy(), 64) == summary_token_bytes(LLAMA8B, OffloadPolicy()) == 0


def test_serves_offload_command_passes_the_plugins_checks(sglang_python, monkeypatch):
    """``sglang-elastic serve --enable-kv-offload --disable-radix-cache`` (the
    README's command) leaves the attention backend to the plugin: SGLang's own
    parse of the exact command line it builds selects ``kvoffload`` (before,
    serve's ``--attention-backend flashinfer`` default made the plugin refuse it)."""
    from sglang_elastic import serve

    monkeypatch.delenv("SGLANG_ELASTIC_CONFIG", raising=False)
    argv = serve.build_command("llama-3.1-8b", ["--enable-kv-offload", "--disable-radix-cache"])
    assert "--attention-backend" not in argv and argv[argv.index("--sampling-backend") + 1] == "pytorch"
    r = sglang_python.run(PARSE, argv[3:] + ["--device", "cpu"])
    assert r.returncode == 0, r.stderr[-2000:]
    out = dict(l.split(" ", 1) for l in r.stdout.splitlines() if l.startswith(("CONFIG ", "BACKENDS ")))
    assert json.loads(out["BACKENDS"]) == ["kvoffload", "kvoffload"] and json.loads(out["CONFIG"])["offload"]["enabled"] is True
    assert "--attention-backend" in serve.build_command("llama-3.1-8b", ["--enable-elastic-kv"])  # other features keep FlashInfer


def test_dense_while_v_fits_is_on_by_default_off_with_its_no_flag_and_with_resident_v():
    """``--kv-offload-keep-v`` became the default after its H200 runs (2026-12-04); the
    sparse rule for every request is ``--no-kv-offload-keep-v``, which also needs
    ``--enable-kv-offload``; resident V (the exactness reference) keeps nothing."""
    def off(*flags):
        return config.from_namespace(namespace(*flags, disable_radix_cache=True)).offload

    on = off("--enable-kv-offload")
    assert on.keep_v is None and on.keep_v_wanted
    assert off("--enable-kv-offload", "--kv-offload-keep-v").keep_v is True
    no = off("--enable-kv-offload", "--no-kv-offload-keep-v")
    assert no.keep_v is False and not no.keep_v_wanted
    assert off("--enable-kv-offload", "--no-kv-offload-keep-v", "--kv-offload-keep-v").keep_v_wanted  # the last one wins
    res = off("--enable-kv-offload", "--kv-offload-resident-v")
    assert res.keep_v is None and not res.keep_v_wanted
    assert not off("--enable-kv-offload", "--kv-offload-resident-v", "--no-kv-offload-keep-v").keep_v_wanted
    with pytest.raises(config.ConfigError, match="has nothing to keep with --kv-offload-resident-v"):
        off("--enable-kv-offload", "--kv-offload-resident-v", "--kv-offload-keep-v")
    with pytest.raises(config.ConfigError, match=r"^--kv-offload-keep-v false \(--no-kv-offload-keep-v\) .*needs --enable-kv-offload"):
        config.from_namespace(namespace("--no-kv-offload-keep-v"))
    with pytest.raises(config.ConfigError, match=r"^--kv-offload-keep-v false \(--no-kv-offload-keep-v\) .*needs --enable-kv-offload"):
        config.OffloadConfig(keep_v=False)
    with pytest.raises(config.ConfigError, match="^--kv-offload-keep-v .*needs --enable-kv-offload"):
        config.from_namespace(namespace("--kv-offload-keep-v"))
    assert not config.OffloadConfig().keep_v_wanted  # offload off: nothing to keep
    # the choice travels to the scheduler processes (SGLANG_ELASTIC_CONFIG) as given
    for cfg in (on, no):
        assert config.ElasticKVConfig.from_env(config.ElasticKVConfig(offload=cfg).to_env()).offload == cfg


def test_the_help_of_every_flag_formats():
    """Review finding: a bare percent sign in a help text made ``launch_server --help`` raise
    (argparse formats help strings with %)."""
    import argparse

    p = argparse.ArgumentParser()
    config.add_cli_args(p)
    text = " ".join(p.format_help().split())  # argparse wraps the lines
    assert "--no-kv-offload-keep-v" in text and "+0.5 % median ITL" in text and "--elastic-kv-activation-rule" in text


def test_models_the_pool_cannot_serve_are_named_before_it_is_sized():
    """``hooks._unsupported_model`` on SGLang's KV-cache configurator: soft-capped attention (Grok's default 30, Gemma-2's
    config key) was not refused and raised NotImplementedError at capture, or mid-serving without CUDA graphs."""
    import types

    from sglang_elastic.offload import hooks

    def kvc(hf=None, **kw):
        base = dict(use_mla_backend=False, is_hybrid_swa=False, mambaish_config=None, is_draft_worker=False, sliding_window_size=None,
                    model_config=types.SimpleNamespace(is_multimodal=False, hf_config=hf or types.SimpleNamespace(architectures=["LlamaForCausalLM"])))
        return types.SimpleNamespace(**{**base, **kw})

    assert hooks._unsupported_model(kvc()) == ""
    assert hooks._unsupported_model(kvc(types.SimpleNamespace(architectures=["Grok1ForCausalLM"]))).startswith("attention logit soft-capping")
    assert hooks._unsupported_model(kvc(types.SimpleNamespace(architectures=["X"], attn_logit_softcapping=50.0))).startswith("attention logit")
    assert hooks._unsupported_model(kvc(types.SimpleNamespace(architectures=["X"], attn_logit_softcapping=None))) == ""
    assert hooks._unsupported_model(kvc(types.SimpleNamespace(architectures=["Grok1ForCausalLM"], attn_logit_softcapping=0.0))) == ""  # no cap
    assert hooks._unsupported_model(kvc(use_mla_backend=True)) == "an MLA model"


@pytest.mark.parametrize("text,want", [
    ("", {}),
    # a min_chunk given alone is the plan's chunk: the default chunk_mean (a floor under the mean) goes off with it
    ("fused=1,min_chunk=2048,pdl=true", dict(dense_fused=True, dense_min_chunk=2048, dense_pdl=True, dense_chunk_mean=0)),
    ("min_chunk=2048,chunk_mean=150", dict(dense_min_chunk=2048, dense_chunk_mean=150)),
    (" block_n = 128 , num_warps=none,num_stages=3 ,", dict(dense_block_n=128, dense_num_warps=None, dense_num_stages=3)),
    ("fused=off,pdl=0,min_chunk=0,block_n=0,num_warps=8,num_stages=none,min_ctas=0",
     dict(dense_fused=False, dense_pdl=False, dense_min_chunk=0, dense_block_n=0, dense_num_warps=8, dense_num_stages=None, dense_min_ctas=0,
          dense_chunk_mean=0)),
    ("chunk_mean=0", dict(dense_chunk_mean=0)),
    ("pdl=0", dict(dense_pdl=False)),  # the default chunk_mean stays
    ("kept_stream=1", dict(dense_kept_stream=True)),
    ("kept_stream=on,chunk_mean=0", dict(dense_kept_stream=True, dense_chunk_mean=0)),
])
def test_dense_launch_text_sets_only_the_all_dense_fields_and_round_trips(text, want):
    """``--kv-offload-dense-launch`` changes the dense_* fields it names and nothing else (a ``min_chunk`` without
    ``chunk_mean`` also turns the default ``chunk_mean`` off); ``dense_launch()`` prints a text that reads back to the
    same configuration (the sweep reports its pick that way)."""
    assert SplitConfig().dense_chunk_mean == 125
    got = SplitConfig.with_dense_launch(text)
    assert got == dataclasses.replace(SplitConfig(), **want)
    assert SplitConfig.with_dense_launch(got.dense_launch()) == got
    assert got.scores_min_chunk == SplitConfig().scores_min_chunk and got.attend_block_n == SplitConfig().attend_block_n


@pytest.mark.parametrize("given,share", [(None, 0.02), ("0", 0.0), ("0.5", 0.5), ("0.125", 0.125)])
def test_the_keep_reserve_takes_its_bounds_and_defaults_to_the_shipped_share(given, share):
    """``--kv-offload-keep-reserve`` accepts 0 and 0.5 (its bounds) and, not given, is None and resolves to
    :data:`config.KEEP_RESERVE` (the manager reads ``reserve_share``)."""
    flags = ["--enable-kv-offload"] + (["--kv-offload-keep-reserve", given] if given is not None else [])
    cfg = config.from_namespace(namespace(*flags, disable_radix_cache=True)).offload
    assert cfg.keep_reserve == (None if given is None else share) and cfg.reserve_share == share


def test_keep_v_flags_on_a_model_whose_v_rows_differ_from_k_slots_are_refused_not_ignored():
    """A model with V head_dim != K's cannot keep V in K slots: keep-v turns off quietly by default, but an explicit
    keep-v flag (the switch, the reserve, the kept launch) is refused with one line naming it (a new user's try:
    the reserve and the launch were silently ignored there)."""
    from sglang_elastic.offload.hooks import keep_v_for_model

    mla_like = dataclasses.replace(LLAMA8B, v_head_dim=64)
    on = config.OffloadConfig(enabled=True)
    assert keep_v_for_model(on, LLAMA8B) and not keep_v_for_model(on, mla_like)
    assert not keep_v_for_model(config.OffloadConfig(enabled=True, keep_v=False), LLAMA8B)
    for kw, flag in ((dict(keep_v=True), "--kv-offload-keep-v"), (dict(keep_reserve=0.05), "--kv-offload-keep-reserve"),
                     (dict(dense_launch="kept_stream=1"), "--kv-offload-dense-launch")):
        cfg = config.OffloadConfig(enabled=True, **kw)
        assert keep_v_for_model(cfg, LLAMA8B)
        with pytest.raises(RuntimeError, match=f"^sglang-elastic: {flag} sets keep-v.*V head_dim 64 differs from K's 128: drop {flag}$"):
            keep_v_for_model(cfg, mla_like)


def test_the_server_keeps_the_hot_buffers_hint_by_row_and_position_when_the_radix_cache_is_on():
    """(A review of 6261cd9: no test saw the server choose the per-row hint.) SGLang's own ``ServerArgs``: the radix
    cache on (its default) gives a layout with ``hint_by_row`` (``[rows, context]`` hints per sparse layer), off
    (``--disable-radix-cache``) the per-token hint; the sizing counts the same."""
    import os

    import sglang_elastic
    from sglang.srt.server_args import ServerArgs

    from sglang_elastic.offload import hooks

    model = os.path.join(os.path.dirname(sglang_elastic.__file__), "models", "llama-3.1-8b")
    cfg = config.from_namespace(namespace("--enable-kv-offload")).offload
    shape = dataclasses.replace(LLAMA8B, context_len=1024)
    for disable, by_row in ((False, True), (True, False)):
        on = hooks.radix_cache_on(ServerArgs(model_path=model, device="cpu", disable_radix_cache=disable))
        assert on == by_row
        lay = hooks.offload_layout(cfg, cfg.policy(), 4, shape, keep_v=True, hint_by_row=on)
        assert lay.hint_by_row == by_row and lay.request_rows == 5 and lay.stage_tokens == 1024
    assert not hooks.radix_cache_on(None)
    # the hot-buffer flags reach the layout the decoder reads (the flag's path; the kernels' rules are tested apart)
    cfg = config.from_namespace(namespace("--enable-kv-offload", "--kv-offload-eviction", "lfu", "--kv-offload-hot-slack", "3",
                                          "--kv-offload-hot-slack-max", "6", "--kv-offload-hot-tokens", "6000")).offload
    lay = hooks.offload_layout(cfg, cfg.policy(), 4, shape, keep_v=False, hint_by_row=False)
    assert (lay.eviction, lay.hot_slack, lay.hot_slack_max, lay.hot_tokens, lay.keep_v) == ("lfu", 3.0, 6.0, 6000, False)


@pytest.mark.parametrize("flags, disable_radix", [(["--enable-kv-offload"], False), (["--enable-kv-offload"], True),
                                                  (["--enable-kv-offload", "--no-kv-offload-keep-v"], False)])
def test_the_servers_sizing_counts_the_layout_it_builds(monkeypatch, flags, disable_radix):
    """(A mutation pass: nothing on the CPU called the pool-size hook, so its sizing could drop the kept rows' table
    or the per-row hint and hand SGLang more tokens than the GPU holds.) SGLang's ``KVCacheConfigurator`` hook, with
    a real ``ServerArgs`` (its radix cache on or off) and stand-ins for the scheduler's runtime config bags (no
    process groups on a CPU): the tokens it gives SGLang are the sizing of the very layout it leaves for the pool
    builder (keep-v, the radix cache's hint), and that sizing fits the budget."""
    import types

    import sglang_elastic
    from sglang.srt.server_args import ServerArgs

    from sglang_elastic.offload import hooks
    from sglang_elastic.offload.sizing import device_fixed_bytes, size_pool

    model = os.path.join(os.path.dirname(sglang_elastic.__file__), "models", "llama-3.1-8b")
    sa = ServerArgs(model_path=model, device="cpu", disable_radix_cache=disable_radix, max_running_requests=16)
    cfg = config.from_namespace(namespace(*flags))
    monkeypatch.setattr(config, "current", lambda: cfg)
    monkeypatch.setattr(hooks, "_tp_min", lambda v: v)
    import sglang.srt.runtime_context as rc
    monkeypatch.setattr(rc, "get_parallel", lambda: types.SimpleNamespace(attn_tp_size=1, tp_size=1))  # no process groups on a CPU
    # the scheduler's config bag as SGLang publishes it from these ServerArgs (not published here: it is process-global)
    monkeypatch.setattr(rc, "get_schedule", lambda: types.SimpleNamespace(max_running_requests=sa.max_running_requests, max_total_tokens=None,
                                                                           page_size=1, mem_fraction_static=0.9))
    import psutil
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=200 << 30))
    budget = 40 << 30
    mc = types.SimpleNamespace(get_num_kv_heads=lambda tp: 8, head_dim=128, v_head_dim=128, get_max_num_attention_heads=lambda: 32,
                               context_len=8192, hf_config=types.SimpleNamespace(architectures=["LlamaForCausalLM"]))
    kvc = types.SimpleNamespace(model_config=mc, layer_info=types.SimpleNamespace(num_effective_layers=32), kv_cache_dtype=torch.bfloat16,
                                use_mla_backend=False, is_hybrid_swa=False, mambaish_config=None, is_draft_worker=False,
                                sliding_window_size=None, server_args=sa, _profile_available_bytes=lambda pre: budget)
    hooks._BUILT.clear()
    out = hooks.resolve_memory_pool_config(None, kvc, 0)
    lay, sz = hooks._BUILT["layout"], hooks._BUILT["sizing"]
    assert lay.hint_by_row == (not disable_radix) and lay.keep_v == ("--no-kv-offload-keep-v" not in flags)
    shape = hooks.model_shape(kvc)
    pol = cfg.offload.policy()
    ref = size_pool(budget, shape, pol, cfg.offload.hot_tokens, 16, 200 << 30, slack=cfg.offload.hot_slack,
                    keep_v=lay.keep_v, hint_by_row=lay.hint_by_row, page_size=1)
    assert out.max_total_num_tokens == sz.tokens == ref.tokens and out.max_running_requests == 16
    T = sz.tokens + 1
    fixed = device_fixed_bytes(shape, pol, cfg.offload.hot_tokens, 16, slack=cfg.offload.hot_slack, tokens=T, keep_v=lay.keep_v,
                               hint_by_row=lay.hint_by_row)
    assert T * sz.device_token_bytes + fixed <= budget  # what the pool builder will allocate fits the budget
    hooks._BUILT.clear()


import torch  # noqa: E402  (the test above: the KV dtype SGLang's configurator carries)
