"""The end-to-end check's comparison (scripts/gpu/check_decode_e2e.py
``compare``): logprobs compared up to a request's first divergence, and a
divergence accepted only as a near-tie. Pure Python, no GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("check_decode_e2e", Path(__file__).parents[1] / "scripts/gpu/check_decode_e2e.py")
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)


def _req(ids, lps, tops):
    return {"ids": ids, "logprobs": lps, "top": tops}


def _ref():
    # three tokens; at position 1 the reference's top-2 are 11 (-0.70) and 12 (-0.71): a near-tie
    return {"s": [_req([10, 11, 13], [-0.5, -0.70, -1.2], [[[-0.5, 10], [-2.0, 20]], [[-0.70, 11], [-0.71, 12]], [[-1.2, 13], [-3.0, 30]]])]}


def test_identical_runs_are_close_and_equal():
    c = e2e.compare(_ref(), _ref())
    assert c["tokens_equal"] and c["close"] and c["max_rel_logprob_diff"] == 0.0 and c["divergences"] == []


def test_a_near_tie_flip_is_close_but_not_equal_and_later_logprobs_are_not_compared():
    got = {"s": [_req([10, 12, 99], [-0.5005, -0.703, -9.0], [[[-0.5005, 10]], [[-0.703, 12], [-0.706, 11]], [[-9.0, 99]]])]}
    c = e2e.compare(_ref(), got)
    assert not c["tokens_equal"] and c["close"]
    [d] = c["divergences"]
    assert (d["request"], d["token"], d["ref_id"], d["got_id"]) == (0, 1, 11, 12)
    assert d["ref_margin_nats"] == pytest.approx(0.01) and d["got_margin_nats"] == pytest.approx(0.003) and d["near_tie"]
    # position 0 and both candidates at the flip (same prefix there); -9.0 after the flip is ignored
    assert c["max_rel_logprob_diff"] == pytest.approx(0.007)
    assert c["first_token_mismatch"] == "s request 0 token 1"


def test_a_flip_with_a_wide_reference_margin_fails():
    ref = _ref()
    ref["s"][0]["top"][1] = [[-0.2, 11], [-1.9, 12]]  # 1.7 nats apart: no rounding noise explains the flip
    got = {"s": [_req([10, 12, 13], [-0.5, -0.3, -1.2], [[[-0.5, 10]], [[-0.3, 12], [-1.5, 11]], [[-1.2, 13]]])]}
    c = e2e.compare(ref, got)
    assert not c["close"] and not c["divergences"][0]["near_tie"]


def test_a_flip_to_a_token_outside_the_reference_top_k_fails():
    got = {"s": [_req([10, 77, 13], [-0.5, -0.6, -1.2], [[[-0.5, 10]], [[-0.6, 77], [-0.7, 11]], [[-1.2, 13]]])]}
    c = e2e.compare(_ref(), got)
    assert not c["close"] and c["divergences"][0]["ref_margin_nats"] is None and not c["divergences"][0]["got_in_ref_top"]


def test_logprobs_off_by_more_than_the_tolerance_fail_without_any_flip():
    got = _ref()
    got["s"][0]["logprobs"] = [-0.5, -0.70, -1.25]  # 0.05 / 1.2 = 4 % > 1 %
    c = e2e.compare(_ref(), got)
    assert c["tokens_equal"] and not c["close"] and c["max_rel_logprob_diff"] == pytest.approx(0.05 / 1.2)


def test_a_flip_that_distorts_both_candidates_fails_even_inside_both_top_k():
    """The reference had x = -2.00 and y = -2.05 (a near-tie); a run that gives
    y = -0.5 and x = -4.0 at the same prefix is a broken kernel, not rounding."""
    ref = {"s": [_req([1, 2], [-0.3, -2.00], [[[-0.3, 1]], [[-2.00, 2], [-2.05, 3]]])]}
    got = {"s": [_req([1, 3], [-0.3, -0.5], [[[-0.3, 1]], [[-0.5, 3], [-4.0, 2]]])]}
    c = e2e.compare(ref, got)
    assert not c["close"] and not c["divergences"][0]["near_tie"] and c["max_rel_logprob_diff"] > 0.5


def test_missing_or_truncated_outputs_fail():
    short = {"s": [_req([10, 11], [-0.5, -0.70], _ref()["s"][0]["top"][:2])]}
    c = e2e.compare(_ref(), short)
    assert not c["close"] and not c["tokens_equal"] and "2 tokens" in c["problems_outputs"][0]
    c = e2e.compare(_ref(), {"s": []})
    assert not c["close"] and "0 outputs" in c["problems_outputs"][0]
