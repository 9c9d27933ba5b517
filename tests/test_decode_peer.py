"""``scripts/gpu/check_decode_peer.py``: SGLang 0.5.17's attention test kit against ``persistentkv``.

On the CPU: the case matrix (enumerated from the installed kit), the kit's
layouts against its source, the error metrics, the result file and exit
status with a stand-in runner, and the kit itself for real on a few cases
(``--device cpu``, Triton's interpreter, SGLang's CPU ``torch_native``
backend as the hybrid's prefill backend instead of FlashInfer, no FlashInfer
peer): an eager decode case, the CUDA-graph decode runner replaying below
its captured batch size, and a prefill-then-decode case; then the same with
our kernels' softmax deliberately wrong (``SGLANG_ELASTIC_TEST_DECODE_FAULT``),
which the check must fail. FlashInfer (prefill, the peer, the ``auto``
path's delegate) and the kit at full breadth need the GPU.

The kit's runs go to forked children of a process that imported the kit
once (tests/forkrun.py): importing the kit forces ``attn_tp_size=1`` and
each of its fixtures installs SGLang server args for the whole process,
which must not leak into the rest of the session.
"""

from __future__ import annotations

import importlib.util
import json
import re
import types
from pathlib import Path

import gpu_scripts
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu" / "check_decode_peer.py"


def load_script():
    return gpu_scripts.load_script("check_decode_peer")


peer = load_script()

CPU_ARGS = ["--device", "cpu", "--prefill-backend", "torch_native", "--peer", "none"]
RUN = f"import runpy, sys; sys.argv[0] = {str(SCRIPT)!r}; runpy.run_path({str(SCRIPT)!r}, run_name='__main__')"


@pytest.fixture(scope="module")
def kit_python():
    from forkrun import Forker

    f = Forker(["torch", peer.DENSE_MOD, "sglang.srt.layers.attention.hybrid_attn_backend",
                "sglang.srt.layers.attention.attention_registry", "sglang_elastic.attention.backend"])
    yield f
    f.close()


def run_script(kit_python, argv, env=None):
    import os

    e = dict(os.environ)
    e.update(env or {})
    return kit_python.run(RUN, argv, env=e, cwd=str(ROOT))


# ------------------------------------------------------------------ the kit


def kit_source(module: str) -> str:
    """The installed source of ``module`` (read, not imported: importing the kit has side effects)."""
    root = Path(list(importlib.util.find_spec("sglang").submodule_search_locations)[0]).parent
    return (root / (module.replace(".", "/") + ".py")).read_text()


def test_the_layouts_and_runner_entry_points_are_the_kits():
    """The layouts the script runs are exactly make_loc_fn's, and the kit still
    has the runner pieces the script calls (read from the installed source)."""
    dense = kit_source(peer.DENSE_MOD)
    body = dense[dense.index("def make_loc_fn("): dense.index("def _make_forward_batch(")]
    assert set(re.findall(r'layout == "(\w+)"', body)) == set(peer.KIT_LAYOUTS)
    assert set(peer.DECODE_LAYOUTS) == set(peer.KIT_LAYOUTS) - {"non_monotonic_extend"}
    runner = kit_source(peer.RUNNER_MOD)
    for name in ("class CudaGraphDecodeAdapter", "def _run_cuda_graph_decode_case(", "DENSE_CUDA_GRAPH_CAPTURE_BATCH_SIZE = 4",
                 "assert_cg_metadata_well_formed(backend, bs=capture_batch_size)"):
        assert name in runner, name


KIT_DECODE = {"mha_decode_page_boundary", "mha_decode_bsz1_nonzero_prefix", "gqa_decode_page_boundary"}
KIT_EXTEND = {"mha_extend_page_size_1", "mha_extend_zero_prefix_exact_page", "mha_extend_zero_prefix_input_page_edges",
              "mha_extend_prefix_exact_page", "mha_extend_total_exact_page", "mha_extend_cross_page_boundary",
              "mha_extend_ragged_page_boundary", "mha_extend_page32_cross_boundary", "mqa_extend_total_exact_page"}


def test_the_case_matrix_covers_every_kit_case_layout_path_and_calibration(kit_python):
    r = run_script(kit_python, ["--list", "--device", "cpu"])
    assert r.returncode == 0, r.stderr[-3000:]
    names = r.stdout.split()
    assert len(names) == len(set(names))
    rows = [n.split(":") for n in names]
    by_kind = {}
    for kind, case, layout, path, cal in rows:
        by_kind.setdefault(kind, set()).add((case, layout, path, cal))
    assert set(by_kind) == {"eager", "cuda_graph", "extend_decode"}
    full = {(p, c) for p in ("split", "compact", "auto") for c in ("serving", "fine")}

    def grid(kind):
        cases = {c for c, *_ in by_kind[kind]}
        layouts = {lay for _, lay, _, _ in by_kind[kind]}
        for c in cases:
            for lay in layouts:
                assert {(p, k) for cc, ll, p, k in by_kind[kind] if (cc, ll) == (c, lay)} == full, (kind, c, lay)
        return cases, layouts

    cases, layouts = grid("eager")
    assert cases == KIT_DECODE | {"layout_decode_page_boundary"}
    assert layouts == {"contiguous", "shuffled_pages", "interleaved_pages"}
    cases, layouts = grid("extend_decode")
    assert cases == KIT_EXTEND | {"layout_extend_two_request_ragged"}
    assert layouts == set(peer.KIT_LAYOUTS)  # non_monotonic_extend and interleaved_pages included
    cases, layouts = grid("cuda_graph")
    assert cases == {"runner_cuda_graph_decode_page_boundary", "runner_cuda_graph_gqa_decode_page_boundary",
                     "runner_cuda_graph_mqa_decode_bsz1"}
    assert layouts == {"kit_default", "shuffled_pages", "interleaved_pages"}
    assert len(names) == (4 * 3 + 10 * 4 + 3 * 3) * 6 == 366
    assert [r[3] for r in rows][:1] == ["split"] and rows[-1][3] == "auto"  # forced paths first, auto last

    r = run_script(kit_python, ["--list", "--device", "cpu", "--paths", "compact", "--kinds", "cuda_graph", "--only", "gqa,mqa"])
    assert r.returncode == 0
    assert sorted(r.stdout.split()) == sorted(f"cuda_graph:runner_cuda_graph_{c}:{lay}:compact:{cal}"
                                              for c in ("gqa_decode_page_boundary", "mqa_decode_bsz1")
                                              for lay in ("kit_default", "shuffled_pages", "interleaved_pages")
                                              for cal in ("serving", "fine"))


# --------------------------------------------------------- metrics and file


def test_error_metrics_and_the_kits_verdict():
    import torch

    e = torch.tensor([[1.0, -2.0, 0.001], [0.5, 0.0, 4.0]], dtype=torch.float16)
    a = e.clone()
    a[0, 1] = -2.25  # abs 0.25, rel 0.125
    a[1, 1] = 0.02  # abs 0.02 on a near-zero reference: not in max_rel_err
    m = peer.error_metrics(a, e, atol=0.03)
    assert m["max_abs_err"] == pytest.approx(0.25)
    assert m["max_rel_err"] == pytest.approx(0.125)
    assert m["nonfinite"] == 0 and m["rel_l2_err"] > 0
    a[0, 0] = float("nan")
    m = peer.error_metrics(a, e, atol=0.03)
    assert m["nonfinite"] == 1 and m["max_abs_err"] is None
    json.dumps(m, allow_nan=False)  # a NaN never reaches the file as a bare NaN

    ch = peer.Checks(atol=0.03, rtol=0.03)
    assert ch.check("close", e + 0.01, e) is True
    assert ch.check("far", e + 0.2, e, ours=False) is False
    assert ch.items[1]["error"].startswith("Tensor-likes are not close!") and ch.items[1]["max_abs_err"] == pytest.approx(0.2, abs=2e-3)
    r = peer.summarize("n", {"kind": "eager"}, ch.items, None, {}, 0.0)
    assert r["passed"] is False and r["error"].startswith("far: Tensor-likes are not close!")
    assert r["max_abs_err"] == pytest.approx(0.01, abs=2e-3)  # worst over our checks only
    assert peer.summarize("n", {}, [], None, {}, 0.0)["passed"] is False  # no comparison: not a pass


def test_the_auto_capture_runs_once_per_policy_path():
    """For auto under the kit's runner, capture goes through every policy path
    (as the capture_one_shape hook does), replay through the policy's pick."""
    import contextlib

    calls = []
    ours = types.SimpleNamespace(policy=types.SimpleNamespace(paths=("flashinfer", "split", "compact")), _capture_path=None)

    @contextlib.contextmanager
    def capturing(path):
        ours._capture_path = path
        yield
        ours._capture_path = None

    ours.capturing = capturing
    ours.init_forward_metadata_out_graph = lambda fb, in_capture=False: calls.append((fb, in_capture, ours._capture_path))
    peer.capture_every_path(ours)
    ours.init_forward_metadata_out_graph("cap", in_capture=True)
    ours.init_forward_metadata_out_graph("rep")
    assert calls == [("cap", True, "flashinfer"), ("cap", True, "split"), ("cap", True, "compact"), ("rep", False, None)]
    assert ours.variant_graphs is True


class StandIn:
    """A runner that returns canned results (``fail``: names that fail)."""

    def __init__(self, fail=(), delay=0.0, build_delay=0.0):
        self.fail, self.delay, self.build_delay, self.seen = set(fail), delay, build_delay, []

    def __call__(self, opts, stubs):
        import time

        time.sleep(self.build_delay)  # as the real runner's kit import and registration
        self.opts = opts
        return self

    def run(self, spec):
        import time

        time.sleep(self.delay)
        self.seen.append(spec.name)
        bad = spec.name in self.fail
        check = {"what": "decode vs the kit's reference", "ours": True, "max_abs_err": 0.5 if bad else 1e-4,
                 "max_rel_err": 0.2 if bad else 1e-3, "rel_l2_err": 0.1, "nonfinite": 0, "passed": not bad,
                 "error": "Tensor-likes are not close!" if bad else None}
        return peer.summarize(spec.name, {"kind": spec.kind, "kit_case": spec.kit_case.name, "layout": spec.layout,
                                          "path": spec.path, "calibration": spec.calibration}, [check], None, {}, 0.01)


def fake_cases():
    mk = lambda n: types.SimpleNamespace(name=n)  # noqa: E731
    return [peer.PeerCase("eager", mk("mha_decode_page_boundary"), "interleaved_pages", "split", "fine"),
            peer.PeerCase("cuda_graph", mk("runner_cuda_graph_mqa_decode_bsz1"), "kit_default", "compact", "serving"),
            peer.PeerCase("extend_decode", mk("mha_extend_page_size_1"), "non_monotonic_extend", "auto", "fine")]


def test_the_result_file_and_exit_status_with_a_stand_in_runner(tmp_path, capsys):
    out = tmp_path / "peer.json"
    argv = ["--device", "cpu", "--out", str(out)]
    runner = StandIn()
    assert peer.main(argv, runner_factory=runner, cases=fake_cases()) == 0
    d = json.loads(out.read_text())
    assert {"date", "gpu", "commit", "command"} <= set(d) and d["command"].startswith("python3 scripts/gpu/check_decode_peer.py")
    assert d["summary"] == {"cases": 3, "passed": 3, "failed": 0, "failed_names": [], "not_run": 0, "complete": True}
    assert [c["name"] for c in d["cases"]] == [c.name for c in fake_cases()] == runner.seen
    c = d["cases"][2]
    assert (c["kind"], c["layout"], c["path"], c["calibration"], c["passed"], c["error"]) == (
        "extend_decode", "non_monotonic_extend", "auto", "fine", True, None)
    assert c["max_abs_err"] == 1e-4 and c["max_rel_err"] == 1e-3
    assert runner.opts.calibration_files["serving"] is None and runner.opts.calibration_files["fine"].endswith("fine_calibration.json")

    # one failure: exit 1, its message in the file
    bad = fake_cases()[1].name
    assert peer.main(argv, runner_factory=StandIn(fail=[bad]), cases=fake_cases()) == 1
    d = json.loads(out.read_text())
    assert d["summary"]["failed_names"] == [bad] and d["summary"]["passed"] == 2
    c = next(c for c in d["cases"] if c["name"] == bad)
    assert c["passed"] is False and c["max_abs_err"] == 0.5 and "Tensor-likes are not close!" in c["error"]

    # the budget: cases left unrun are listed and the run exits 1
    assert peer.main(argv + ["--max-seconds", "0.5"], runner_factory=StandIn(delay=1.0), cases=fake_cases()) == 1
    d = json.loads(out.read_text())
    assert d["summary"]["cases"] == 1 and d["summary"]["complete"] is False and d["not_run"] == [c.name for c in fake_cases()[1:]]

    # no case ran: no file, one line, exit 1
    out.unlink()
    capsys.readouterr()
    assert peer.main(argv + ["--only", "no-such-case"], runner_factory=StandIn(), cases=fake_cases()) == 1
    err = capsys.readouterr().err.strip()
    assert not out.exists() and len(err.splitlines()) == 1 and "ran no case" in err

    # the budget counts from the start: a runner that takes longer to build than the budget runs nothing
    capsys.readouterr()
    assert peer.main(argv + ["--max-seconds", "0.3"], runner_factory=StandIn(build_delay=0.6), cases=fake_cases()) == 1
    err = capsys.readouterr().err
    assert not out.exists() and "--max-seconds 0.3 reached: 3 cases not run" in err and "ran no case (3 selected, none started)" in err

    # --out in a folder that does not exist yet: made, not a crash after the first case
    nested = tmp_path / "new" / "dir" / "peer.json"
    assert peer.main(["--device", "cpu", "--out", str(nested)], runner_factory=StandIn(), cases=fake_cases()) == 0
    assert json.loads(nested.read_text())["summary"]["cases"] == 3


def test_a_kit_error_in_the_cuda_graph_runner_fails_the_case_with_its_traceback():
    """An exception inside the kit's CUDA-graph runner (not one of its assert_close
    verdicts) fails the case and keeps the traceback: a one-shot GPU run must say where."""
    r = peer.Runner.__new__(peer.Runner)  # no kit import: D and R stand in
    r.opts = peer.Options(device="cpu")
    r.D = types.SimpleNamespace(DENSE_ATOL=3e-2, DENSE_RTOL=3e-2, DEFAULT_MAX_CONTEXT_LEN=64, _make_forward_batch=None,
                                prepare_dense_runner_inputs=None, make_dense_case_with_prefix_lens=None,
                                dense_fixture_inputs=None, make_dense_random_inputs=None, make_dense_padded_replay_inputs=None)

    def kit_runner_that_breaks(*_a, **_k):
        raise TypeError("init_cuda_graph_state() got an unexpected keyword argument 'max_bs'")

    r._R = types.SimpleNamespace(CudaGraphDecodeAdapter=lambda **kw: kw, _run_cuda_graph_decode_case=kit_runner_that_breaks,
                                 DENSE_CUDA_GRAPH_CAPTURE_BATCH_SIZE=4)
    spec = peer.PeerCase("cuda_graph", types.SimpleNamespace(name="runner_cuda_graph_mqa_decode_bsz1", num_input_tokens=1),
                         "kit_default", "split", "fine")
    res = r.run(spec)
    assert res["passed"] is False and res["checks"] == []
    assert res["error"] == "TypeError: init_cuda_graph_state() got an unexpected keyword argument 'max_bs'"
    assert "in kit_runner_that_breaks" in res["traceback"]


PIN_CHILD = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("check_decode_peer", sys.argv[1])
m = importlib.util.module_from_spec(spec)
sys.modules["check_decode_peer"] = m
spec.loader.exec_module(m)
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils.common import get_cuda_graph_max_batch_size

fields = ("tp_size", "tp_rank", "attn_tp_size", "attn_tp_rank", "attn_cp_size", "attn_cp_rank")
r = m.Runner(m.Options(device="cpu"))
case = next(c for c in r.D.make_dense_cases("torch_native") if c.name == "mha_decode_page_boundary")
fixture = r.D.build_dense_attention_fixture(m._TestCase(), case, device="cpu")
before = {f: getattr(get_parallel(), f) for f in fields}
max_bs = get_cuda_graph_max_batch_size(fixture.runner.server_args, fixture.runner.req_to_token_pool.size)
m.import_kit_runner([])
after = {f: getattr(get_parallel(), f) for f in fields}
print(json.dumps({"before": before, "after": after, "max_bs": max_bs}))
"""


def test_the_runner_pins_the_single_rank_state_flashinfer_needs_before_any_case(kit_python):
    """Before the kit's CUDA-graph runner is imported, SGLang's FlashInferAttnBackend()
    (the prefill backend of every case, the peer, auto's delegate) dies in
    get_cuda_graph_max_batch_size: attn_cp_size has no distributed group. The runner
    pins the kit's single-rank state at once, the same before and after that import."""
    r = kit_python.run(PIN_CHILD, [str(SCRIPT)], cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout.strip().splitlines()[-1])
    single = {"tp_size": 1, "tp_rank": 0, "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0}
    assert d == {"before": single, "after": single, "max_bs": 3}


def test_the_fine_calibration_splits_the_kits_short_requests():
    from sglang_elastic.attention.policy import calibration_from_dict
    from sglang_elastic.kernels.decode_attention import split_kv_plan
    import torch

    c = calibration_from_dict(peer.fine_calibration().to_json())  # what the backend reads from the file
    assert (c.split.min_chunk, c.split.block_n, c.compact.min_chunk, c.compact.block_n) == (16, 16, 16, 16)
    lens = torch.tensor([15, 16, 17, 35])
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    _, nsplit = split_kv_plan(indptr, c.split.max_splits, c.split.min_chunk, c.split.block_n)
    assert nsplit.tolist() == [1, 1, 2, 3]


# --------------------------------------------------------- the kit, for real


def cases_of(path):
    return {c["name"]: c for c in json.loads(Path(path).read_text())["cases"]}


REAL = ["eager:mha_decode_page_boundary:interleaved_pages:split:fine",
        "cuda_graph:runner_cuda_graph_gqa_decode_page_boundary:interleaved_pages:compact:fine",
        "extend_decode:mha_extend_ragged_page_boundary:non_monotonic_extend:split:fine"]


def test_the_kit_runs_our_split_and_compact_kernels_on_the_cpu(kit_python, tmp_path):
    out = tmp_path / "peer.json"
    r = run_script(kit_python, CPU_ARGS + ["--out", str(out), "--only", ",".join(REAL)])
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    d = json.loads(out.read_text())
    assert d["summary"]["cases"] == 3 and d["summary"]["failed"] == 0 and d["sglang_version"] == "0.5.17"
    cs = cases_of(out)
    assert set(cs) == set(REAL)
    for c in cs.values():
        assert c["passed"] and c["error"] is None
        assert 0 <= c["max_abs_err"] < 3e-2 and c["calibration_source"] == "explicit"
    e = cs[REAL[0]]  # lengths 15, 16, 17 on 16-token chunks: the 17 is cut in two, the merge runs
    assert e["paths_run"] == {"eager:split": 1} and e["plan"] == {"path": "split", "bs": 3, "max_chunks_per_request": 2}
    g = cs[REAL[1]]  # capture at batch 4, replay 3 live requests + 1 pad
    assert g["captured_paths"] == ["compact"] and g["paths_run"] == {"replay:compact": 1}
    assert [x["what"] for x in g["checks"]] == ["eager decode vs the kit's reference",
                                                "graph replay (batch 4, 3 live) vs the kit's reference",
                                                "graph replay (live rows) vs eager"]
    assert g["plan"]["bs"] == 4 and g["plan"]["items"] > 4  # more work items than requests: chunks were cut
    x = cs[REAL[2]]  # prefill on torch_native through the hybrid (ours never ran it), then our decode
    assert [(k["ours"], k["passed"]) for k in x["checks"]] == [(False, True), (True, True)]
    assert x["checks"][0]["what"].startswith("extend on torch_native") and x["paths_run"] == {"eager:split": 1}


def test_a_wrong_decode_kernel_fails_the_check(kit_python, tmp_path):
    """Our kernels' softmax scale doubled (the e2e check's fault switch): every
    case fails on our output, the prefill check stays green, the file names why."""
    out = tmp_path / "peer.json"
    r = run_script(kit_python, CPU_ARGS + ["--out", str(out), "--only", ",".join(REAL)],
                   env={"SGLANG_ELASTIC_TEST_DECODE_FAULT": "sm_scale:2"})
    assert r.returncode == 1, (r.stdout + r.stderr)[-4000:]
    d = json.loads(out.read_text())
    assert d["summary"]["failed"] == 3 and sorted(d["summary"]["failed_names"]) == sorted(REAL)
    cs = cases_of(out)
    for c in cs.values():
        assert c["passed"] is False and "Tensor-likes are not close!" in c["error"] and c["max_abs_err"] > 3e-2
    assert [(k["ours"], k["passed"]) for k in cs[REAL[2]]["checks"]] == [(False, True), (True, False)]
