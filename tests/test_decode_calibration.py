"""A policy that transfers (issue 23, build 1): per-shape calibrations cached by
shape and GPU, the startup measurement (with an injected timer: no GPU here),
and the online correction from timed replays (with injected CUDA events).

The backend runs on SGLang's real pool classes (as in test_decode_backend);
FlashInfer needs CUDA, so the backend cases keep it out of the policy the way
a server does for a GQA group its CUDA-core decode has no kernel for.
"""

from __future__ import annotations

import dataclasses
import json
import random
import types

import pytest
import torch

from sglang_elastic import config
from sglang_elastic.attention import backend as backend_mod
from sglang_elastic.attention import calibration_cache as cc
from sglang_elastic.attention.calibrate import calibrate_shape, probe_cases
from sglang_elastic.attention.online import OnlineCorrector, ReplayTimer, bucket_key
from sglang_elastic.attention.policy import PATHS, Calibration, DecodePolicy, PathCost, load_calibration

H200 = dict(gpu="NVIDIA H200", sm_count=132)
LLAMA = dict(q_heads=32, kv_heads=8, head_dim=128, dtype="bfloat16")
QWEN = dict(q_heads=28, kv_heads=4, head_dim=128, dtype="bfloat16")


def key(**kw) -> cc.ShapeKey:
    return cc.ShapeKey(**{**H200, **LLAMA, "page_size": 16, **kw})


def measured(k: cc.ShapeKey, launch=(9.0, 7.0, 8.0)) -> Calibration:
    paths = {p: PathCost(launch_us=l, bw_tbps=3.5 + i / 10, cta_gbps=30.0 + i) for i, (p, l) in enumerate(zip(PATHS, launch))}
    return Calibration(gpu=k.gpu, sm_count=k.sm_count, paths=paths, shape=k.shape(), source="test")


# -- the cache -----------------------------------------------------------------


def test_cache_round_trips_a_calibration_under_its_key(tmp_path):
    cache = cc.CalibrationCache(tmp_path)
    k = key()
    assert cache.load(k) is None
    c = measured(k)
    p = cache.store(k, c, {"seconds": 1.5})
    assert p.parent == tmp_path and p.name == "nvidia-h200-sm132_q32-kv8-d128_bfloat16_page16.json"
    assert cache.load(k) == c
    assert json.loads(p.read_text())["key"] == k.to_json()
    c2 = dataclasses.replace(c, fit_rms_rel_err={"split": 0.07, "flashinfer": 0.045})  # a fit carries its errors
    cache.store(k, c2)
    assert cache.load(k) == c2


def test_a_cache_file_from_before_the_fit_errors_moved_into_the_calibration_keeps_its_margin(tmp_path):
    # files written before 2026-12-04 #2 kept the startup fit's errors beside the calibration, not in it: they must
    # still widen the policy's margin, or a refit with a 7 % split error trades at the flat 3 %
    cache = cc.CalibrationCache(tmp_path)
    k = key()
    c = measured(k)
    p = cache.store(k, c, {"fit_rms_rel_err": {"split": 0.0703546, "flashinfer": 0.0454153, "compact": 1.7}})
    got = cache.load(k)
    assert got.fit_rms_rel_err == {"split": 0.0704, "flashinfer": 0.0454, "compact": 1.0}
    assert DecodePolicy(got, **{f: LLAMA[f] for f in ("q_heads", "kv_heads", "head_dim")}).margin_for("split") > 0.08
    d = json.loads(p.read_text())
    d["fit_rms_rel_err"] = {"split": "bad"}
    p.write_text(json.dumps(d))
    assert cache.load(k) is None  # unreadable errors: the file is ignored (measured again), never a crash


@pytest.mark.parametrize("other", [
    dict(kv_heads=4), dict(q_heads=28), dict(head_dim=64), dict(dtype="float16"), dict(page_size=1),
    dict(gpu="NVIDIA H100 80GB HBM3"), dict(sm_count=114),
])
def test_a_different_shape_or_gpu_never_reuses_a_cached_calibration(tmp_path, other):
    cache = cc.CalibrationCache(tmp_path)
    k = key()
    cache.store(k, measured(k))
    o = key(**other)
    assert o.file_name() != k.file_name()
    assert cache.load(o) is None
    # nor a file copied under the other key's name: the stored key is checked
    cache.path(o).write_text(cache.path(k).read_text())
    assert cache.load(o) is None
    # a calibration measured on one key is not stored under another
    with pytest.raises(ValueError, match="cannot be cached under"):
        cache.store(o, measured(k))


def test_an_unreadable_cache_file_is_a_miss_not_an_error(tmp_path):
    cache = cc.CalibrationCache(tmp_path)
    k = key()
    cache.path(k).write_text("{not json")
    assert cache.load(k) is None
    cache.path(k).write_text(json.dumps({"key": k.to_json(), "calibration": {"version": 1}}))
    assert cache.load(k) is None


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(cc.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cc.default_cache_dir() == tmp_path / "xdg" / "sglang_elastic" / "decode"
    monkeypatch.setenv(cc.CACHE_ENV, str(tmp_path / "mine"))
    assert cc.default_cache_dir() == tmp_path / "mine" / "decode"


def test_the_shipped_h200_file_is_used_only_for_its_own_shape(tmp_path):
    shipped = load_calibration()
    empty = cc.CalibrationCache(tmp_path)
    for page in (16, 1):
        c, src = cc.resolve(key(page_size=page), cache=empty)
        assert (c, src) == (shipped, "shipped")
    for k in (key(**QWEN), key(gpu="NVIDIA H100 80GB HBM3", sm_count=132), key(page_size=64), key(dtype="float16")):
        c, src = cc.resolve(k, cache=empty)
        assert src == "prior" and c.shape is None and c.gpu == k.gpu
        assert len({c.paths[p] for p in PATHS}) == 1, "the prior has one set of constants for every path"
        assert c.margin >= cc.PRIOR_MARGIN
    # the cache beats the shipped file; an explicit file beats both
    k = key()
    empty.store(k, measured(k))
    assert cc.resolve(k, cache=empty) == (measured(k), "cache")
    other = measured(key(**QWEN))
    assert cc.resolve(k, explicit=other, cache=empty) == (other, "explicit")


def test_the_prior_keeps_flashinfer_where_only_a_fitted_constant_favoured_split():
    """The issue's Qwen2.5-7B case (28/4 heads, B1 32K and a B32 Zipf batch,
    FlashInfer measured faster): the Llama-fitted constants pick split there;
    the prior, whose paths differ only in their plans, does not."""
    k = key(**QWEN)
    zipf = [int(1024 + 60 * 1024 / (r + 1) ** 1.1) for r in range(32)]
    prior, _ = cc.resolve(k, shipped=[load_calibration()])
    pol = DecodePolicy(prior, q_heads=28, kv_heads=4, head_dim=128)
    assert pol.choose([32768]) == "flashinfer" and pol.choose(zipf) == "flashinfer"
    # where the structure itself says ours (FlashInfer's unsplit straggler past its split limit), the prior says ours
    assert pol.choose([32768] * 8 + [2048] * 56 + [1024] * 64) != "flashinfer"


# -- the startup measurement ---------------------------------------------------


def test_probe_cases_respect_the_servers_limits():
    cases = probe_cases(max_batch=16, max_len=4096, max_tokens=20000)
    assert cases and all(1 <= len(c) <= 16 and max(c) <= 4096 and sum(c) <= 20000 for c in cases)
    assert len({tuple(c) for c in cases}) == len(cases)
    full = probe_cases(256, 1 << 17, 1 << 22)
    assert [131072] in full and any(len(c) == 256 for c in full) and any(max(c) > 8 * min(c) for c in full)


def truth_calibration(k: cc.ShapeKey, like: Calibration) -> Calibration:
    """This GPU's 'real' constants (what the injected timer reports) with
    ``like``'s kernel configs: compact reads slower but launches cheaper than split."""
    return dataclasses.replace(like, gpu=k.gpu, sm_count=k.sm_count, shape=k.shape(), margin=0.03, paths={
        "flashinfer": PathCost(launch_us=15.0, bw_tbps=4.0, cta_gbps=30.0),
        "split": PathCost(launch_us=25.0, bw_tbps=4.3, cta_gbps=45.0),
        "compact": PathCost(launch_us=8.0, bw_tbps=3.2, cta_gbps=35.0),
    }, source="truth")


def test_calibrate_shape_fits_what_the_timer_measures():
    k = key(**QWEN)
    prior, _ = cc.resolve(k, shipped=[load_calibration()])
    truth = DecodePolicy(truth_calibration(k, prior), q_heads=28, kv_heads=4, head_dim=128)
    launched = []

    def make_launch(path, lens):
        launched.append((path, tuple(lens)))
        return lambda: None

    cases = probe_cases(256, 1 << 17, 1 << 21)
    calib, errs, timings = calibrate_shape(k, prior, PATHS, make_launch,
                                           timer=lambda fn: truth.predict(launched[-1][1])[launched[-1][0]], cases=cases)
    assert len(launched) == 3 * len(cases) and max(errs.values()) < 0.05
    assert calib.shape == k.shape() and not calib.provisional and cc.covers(calib, k)
    assert (calib.split, calib.compact) == (prior.split, prior.compact)
    fitted = DecodePolicy(calib, q_heads=28, kv_heads=4, head_dim=128)
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    agree = 0
    batches = [[rng.choice([1, 2, 8]) * rng.randrange(256, 1 << 15) for _ in range(rng.choice([1, 4, 16, 32, 64, 200]))] for _ in range(60)]
    for lens in batches:
        t = truth.predict(lens)
        pick = fitted.choose(lens)
        agree += t[pick] <= 1.05 * min(t.values())  # within 5 % of the truly best path
    assert agree >= 0.9 * len(batches)


HQ7, HKV, D = 14, 2, 64  # GQA 7: FlashInfer's CUDA-core decode has no kernel, so no CUDA is needed here


def make_runner(monkeypatch, tmp_path, hq=HQ7, hkv=HKV, **cfg):
    from test_decode_backend import CTX, LAYERS  # noqa: F401 (same pool sizes)
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    monkeypatch.setattr(backend_mod, "_attn_tp_size", lambda: 1)
    monkeypatch.setattr(backend_mod, "_attn_dcp_size", lambda: 1)
    monkeypatch.setattr(backend_mod, "_device_sm_count", lambda mr: 132)
    monkeypatch.setenv("SGLANG_FLASHINFER_USE_TENSOR_CORE", "false")
    monkeypatch.setenv(config.ENV, config.ElasticKVConfig(decode_calibration_cache=str(tmp_path / "cache"), **cfg).to_env())
    runner = types.SimpleNamespace(
        device="cpu", gpu_id=0, page_size=1, kv_cache_dtype=torch.float16, sliding_window_size=None, use_mla_backend=False,
        req_to_token_pool=ReqToTokenPool(size=8, max_context_len=CTX, device="cpu", enable_memory_saver=False),
        token_to_kv_pool=MHATokenToKVPool(4096, 1, torch.float16, head_num=hkv, head_dim=D, layer_num=2, device="cpu",
                                          enable_memory_saver=False, enable_alt_stream=False),
        model_config=types.SimpleNamespace(context_len=CTX, get_max_num_attention_heads=lambda: hq),
        server_args=types.SimpleNamespace(speculative_algorithm=None),
    )
    return runner


def make_backend(monkeypatch, tmp_path, hq=HQ7, hkv=HKV, policy="auto", **cfg):
    return backend_mod.PersistentKVAttnBackend(make_runner(monkeypatch, tmp_path, hq, hkv, **cfg), policy=policy)


def test_startup_measurement_replaces_the_prior_caches_it_and_the_next_server_reuses_it(monkeypatch, tmp_path):
    be = make_backend(monkeypatch, tmp_path)
    assert be.calibration_source == "prior" and be.policy.paths == ("split", "compact")
    k = be.shape_key
    assert (k.gpu, k.q_heads, k.kv_heads, k.head_dim, k.dtype, k.page_size) == ("cpu", 14, 2, 64, "float16", 1)
    truth = DecodePolicy(truth_calibration(k, be.calib), q_heads=14, kv_heads=2, head_dim=64, dtype_bytes=2)
    monkeypatch.setattr(be, "_probe_launch", lambda path, lens: (path, tuple(lens)))
    be._startup_timer = lambda tag: truth.predict(tag[1])[tag[0]]
    calib = be.startup_calibrate()
    assert calib is be.calib and be.calibration_source == "measured" and cc.covers(calib, k)
    st = be.state()["startup"]  # /server_info shows the measurement: its time, batches and fit errors
    assert st["batches"] == len(probe_cases(be.max_bs - 1, be.max_context_len, max(1, be.token_to_kv_pool.size - 2 * be.page_size * be.max_bs)))
    assert st["seconds"] >= 0 and set(st["fit_rms_rel_err"]) == {"split", "compact"}
    cases = probe_cases(be.max_bs - 1, be.max_context_len, 4096)
    for lens in cases:
        assert be.policy.choose(lens) == min(("split", "compact"), key=truth.predict(lens).get), lens
    assert be.calibration_cache.load(k) == calib
    again = make_backend(monkeypatch, tmp_path)
    assert again.calibration_source == "cache" and again.calib == calib and not again._needs_startup
    # another shape on the same GPU does not get it
    other = make_backend(monkeypatch, tmp_path, hq=7, hkv=1)
    assert other.calibration_source == "prior" and other.calib != calib


def test_a_failed_startup_measurement_keeps_the_prior(monkeypatch, tmp_path):
    be = make_backend(monkeypatch, tmp_path)
    prior = be.calib

    def boom(path, lens):
        raise RuntimeError("no kernel image")

    monkeypatch.setattr(be, "_probe_launch", boom)
    be._startup_timer = lambda fn: 1.0
    assert be.startup_calibrate() is None and be.calib is prior and be.calibration_source == "prior"
    assert be.calibration_cache.load(be.shape_key) is None


# -- online correction ---------------------------------------------------------


def feed(oc: OnlineCorrector, key, prior, truth, steps):
    """``steps`` steps of one bucket, each timed step recorded at once; returns the untimed steps' picks."""
    picks = []
    for _ in range(steps):
        timed = oc.begin_step()
        path = oc.choose(key, prior)
        ran = oc.end_step()
        if timed:
            assert ran == (key, path)
            oc.record(key, path, truth[path])
        else:
            assert ran is None
            picks.append(path)
    return picks


def test_online_correction_switches_when_a_paths_measured_time_crosses_another():
    oc = OnlineCorrector(("flashinfer", "split", "compact"), sample_every=4, min_samples=3, refresh_every=4)
    b = bucket_key(32, 20000, 60000)
    # the prior says split; measured, flashinfer is faster: after min_samples of each, flashinfer
    picks = feed(oc, b, "split", {"flashinfer": 100.0, "split": 110.0, "compact": 130.0}, 4 * 3 * 3 + 4)
    assert picks[0] == "split" and picks[-1] == "flashinfer" and oc.buckets[b].choice == "flashinfer"
    # a 0.5 % gain (inside the 1 % margin) does not flip it
    feed(oc, b, "split", {"flashinfer": 100.0, "split": 99.5, "compact": 130.0}, 400)
    assert oc.buckets[b].choice == "flashinfer" and oc.switches == 0
    # split's time crosses flashinfer's by more than the margin: the choice moves to split
    picks = feed(oc, b, "split", {"flashinfer": 100.0, "split": 80.0, "compact": 130.0}, 400)
    assert oc.buckets[b].choice == "split" and picks[-1] == "split" and oc.switches == 1
    # and back when flashinfer becomes the faster again (refresh keeps re-timing the others)
    feed(oc, b, "split", {"flashinfer": 60.0, "split": 80.0, "compact": 130.0}, 800)
    assert oc.buckets[b].choice == "flashinfer" and oc.switches == 2
    # untimed steps never explore: they return the bucket's choice; other buckets keep the prior
    assert not oc.sampling
    assert oc.choose(b, "split") == "flashinfer" and oc.choose(bucket_key(1, 500, 500), "compact") == "compact"


def test_the_corrector_says_which_timed_steps_ran_a_path_other_than_the_buckets_choice():
    """``explored`` names the path of a timed step that is not the bucket's choice (exploring a path with too few
    samples, or re-timing another), and is None on every other step: the decode trace counts those replays
    (``explore:PATH``) so the end-to-end check allows exactly them off a forced-looking ``auto``."""
    oc = OnlineCorrector(("flashinfer", "split", "compact"), sample_every=4, min_samples=3, refresh_every=4)
    b = bucket_key(32, 20000, 60000)
    seen = []
    for step in range(4 * 40):
        timed = oc.begin_step()
        path = oc.choose(b, "split")
        choice = oc.buckets[b].choice or "split"
        oc.end_step()
        assert oc.explored == (path if timed and path != choice else None)
        seen.append((timed, path, oc.explored))
        if timed:
            oc.record(b, path, {"flashinfer": 100.0, "split": 90.0, "compact": 130.0}[path])
    explored = [e for _, _, e in seen if e]
    assert explored and set(explored) <= {"flashinfer", "compact"}  # split stays the choice; the others are timed
    assert all(t for t, _, e in seen if e) and sum(1 for t, p, _ in seen if not t and p != "split") == 0


def noisy_picks(seed, truth, sd_frac, steps, z):
    """The share of untimed steps on the prior (``flashinfer``) when every sample is ``truth * (1 + N(0, sd_frac))``."""
    import random

    rnd = random.Random(seed)
    oc = OnlineCorrector(("flashinfer", "split", "compact"), z=z)  # the server's defaults: 1 step in 16 timed
    b = bucket_key(128, 2048, 2100)
    picks = []
    for _ in range(steps):
        timed = oc.begin_step()
        path = oc.choose(b, "flashinfer")
        oc.end_step()
        if timed:
            oc.record(b, path, truth[path] * (1 + rnd.gauss(0, sd_frac)))
        else:
            picks.append(path)
    return picks.count("flashinfer") / len(picks), oc


def test_a_near_tie_inside_the_noise_keeps_the_prior_and_a_clear_gain_still_switches():
    """The H200's 128 x 2K case (Qwen2.5-7B shape, 2026-12-04): split 0.9 % slower
    than FlashInfer; step times with 3 % noise (assumed: the run recorded no
    per-bucket spread). With the margin alone (z = 0) noisy samples move the
    bucket to split in several of 40 runs; with the default z = 3 standard
    errors over the last WINDOW samples the prior (FlashInfer) stays, also over
    20,000 steps. A path 6 % faster under the same noise is still taken in
    every run."""
    tie = {"flashinfer": 9166.0, "split": 9247.0, "compact": 9825.0}
    assert OnlineCorrector(("a", "b")).z == 3.0
    flipped_z0 = sum(noisy_picks(seed, tie, 0.03, 2000, z=0.0)[0] < 0.5 for seed in range(40))
    flipped = sum(noisy_picks(seed, tie, 0.03, 2000, z=3.0)[0] < 0.5 for seed in range(40))
    assert flipped_z0 >= 3, "the plain margin should flip on this noise in several runs (else this test shows nothing)"
    assert flipped <= 1
    # the test's standard error shrinks with the window's samples, not a fixed threshold: no drift to split over 10x longer
    long_runs = [noisy_picks(seed, tie, 0.03, 20000, z=3.0) for seed in range(20)]
    assert sum(next(iter(oc.buckets.values())).choice != "flashinfer" for _, oc in long_runs) <= 1
    assert sum(share for share, _ in long_runs) / 20 > 0.95
    win = {"flashinfer": 9166.0, "split": 9166.0 * 0.94, "compact": 9825.0}
    shares = []
    for seed in range(40):
        share, oc = noisy_picks(seed, win, 0.03, 6000, z=3.0)
        (b,) = oc.buckets.values()
        assert b.choice == "split", f"seed {seed}: a 6 % gain must still be taken ({b.stats})"
        shares.append(share)
    assert sum(shares) / len(shares) < 0.2  # most steps on the faster path
    (entry,) = oc.summary(top=1).values()
    assert entry["choice"] == "split" and entry["visits"] > 300 and 0 < entry["paths"]["split"][2] < 0.1 * entry["paths"]["split"][0]
    with pytest.raises(ValueError, match="z >= 0"):
        OnlineCorrector(("a", "b"), z=-1)


def test_buckets_separate_batch_size_and_length_profile():
    assert bucket_key(5, 8192, 8192) == bucket_key(8, 8192 + 100, 8192 + 100)
    assert bucket_key(5, 8192, 8192) != bucket_key(9, 8192, 8192)
    assert bucket_key(8, 8192, 8192) != bucket_key(8, 16384, 16384)
    assert bucket_key(8, 8192, 8192)[2] == 0 and bucket_key(8, 8192, 70000)[2] == 3


class Clock:
    def __init__(self):
        self.t_us, self.step, self.synced = 0.0, 0, 0


class FakeEvent:
    """A CUDA event on a simulated stream: complete LAG steps after it was recorded."""

    LAG = 2

    def __init__(self, clock):
        self.clock, self.t, self.step = clock, None, None

    def record(self):
        self.t, self.step = self.clock.t_us, self.clock.step

    def query(self):
        return self.clock.step >= self.step + self.LAG

    def elapsed_time(self, end):
        assert end.query(), "elapsed_time of an event not yet complete would block the host"
        return (end.t - self.t) / 1e3

    def synchronize(self):  # pragma: no cover - must never be called
        self.clock.synced += 1


def test_replay_timer_reads_events_only_once_complete_and_bounds_those_in_flight():
    clock = Clock()
    oc = OnlineCorrector(("split", "compact"))
    got = []
    oc.record = lambda k, p, us: got.append((k, p, us))
    rt = ReplayTimer(oc, lambda: FakeEvent(clock), max_pending=2)
    pairs = []
    for i in range(3):
        pair = rt.start()
        if i == 2:
            assert pair is None  # both pairs in flight: this step is not timed
            break
        clock.t_us += 10.0 * (i + 1)
        rt.stop(pair, ("b",), "split")
        pairs.append(pair)
    assert rt.poll() == 0 and rt.in_flight == 2  # the GPU has not reached them
    clock.step += 2
    assert rt.poll() == 2 and got == [(("b",), "split", 10.0), (("b",), "split", 20.0)]
    assert rt.start() is not None and clock.synced == 0


def test_the_replay_hook_times_sampled_steps_off_the_hot_path_and_corrects_the_backend(monkeypatch, tmp_path):
    """The backend behind SGLang's graph runner (``execute`` AROUND hook):
    the prior's pick is split; the simulated GPU runs compact faster. After a
    few hundred steps the backend replays compact, without a single event
    synchronisation; when split becomes the faster, it moves back."""
    from test_decode_backend import make_batch

    runner = make_runner(monkeypatch, tmp_path)
    be = backend_mod.PersistentKVAttnBackend(runner, policy="auto")
    be.init_cuda_graph_state(4, 4)
    for p in be.policy.paths:  # auto: every path captured for this bs (the capture hook)
        be._captured.setdefault(4, set()).add(p)
    be.variant_graphs = True
    be._choices.clear()
    monkeypatch.setattr(be.policy, "choose", lambda lens: "split")  # the prior
    clock = Clock()
    be.online = OnlineCorrector(be.policy.paths, sample_every=4, refresh_every=4)  # the defaults (16, 32), scaled down
    be.replay_timer = ReplayTimer(be.online, lambda: FakeEvent(clock))
    fb = make_batch(runner, [300, 200, 250, 280], torch.Generator().manual_seed(0), fill_pool=False)
    gpu_us = {"split": 120.0, "compact": 90.0}
    ran = []

    def execute(runner, forward_batch):
        be.init_forward_metadata_out_graph(forward_batch)  # inside SGLang's load_batch: the choice
        ran.append(be.graph_path)
        clock.t_us += gpu_us[be.graph_path]
        clock.step += 1

    graph_runner = types.SimpleNamespace(attn_backend=types.SimpleNamespace(decode_backend=be))
    for _ in range(400):
        backend_mod._execute(execute, graph_runner, fb)
    choice = lambda: {b.choice for b in be.online.buckets.values()}  # noqa: E731 (one bucket here)
    # every untimed step replays the choice; timed ones may re-time the other path (1 in 4 here)
    assert ran[0] == "split" and choice() == {"compact"} and ran[-20:].count("compact") >= 15
    assert clock.synced == 0
    gpu_us = {"split": 60.0, "compact": 90.0}
    for _ in range(1500):
        backend_mod._execute(execute, graph_runner, fb)
    assert choice() == {"split"} and ran[-20:].count("split") >= 15
    assert sum(r != "split" for r in ran[-1000:]) <= 1000 // 4, "exploring runs on timed steps only (one in sample_every)"
    assert be.replay_timer.in_flight <= FakeEvent.LAG


def test_online_correction_and_startup_are_off_for_a_forced_policy_or_when_asked(monkeypatch, tmp_path):
    assert make_backend(monkeypatch, tmp_path).online is not None
    assert make_backend(monkeypatch, tmp_path, decode_online="off").online is None
    forced = make_backend(monkeypatch, tmp_path, policy="split")
    assert forced.online is None and not forced._needs_startup
