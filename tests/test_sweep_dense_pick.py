"""``scripts/gpu/sweep_dense_kept.py``'s pick: the fastest exact row behind the KV store, as the
``--kv-offload-dense-launch`` text a server reads back to the same settings."""

from __future__ import annotations

import importlib.util
import os

import pytest

from sglang_elastic.offload.decode import SplitConfig

_PATH = os.path.join(os.path.dirname(__file__), "..", "scripts", "gpu", "sweep_dense_kept.py")
_spec = importlib.util.spec_from_file_location("sweep_dense_kept", _PATH)
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)


def row(**kw):
    base = dict(max_splits=32, min_chunk=512, block_n=64, num_warps=None, num_stages=None, fused=False, chunks=9)
    return {**base, **kw}


def test_pick_skips_a_faster_row_whose_output_did_not_match_and_round_trips():
    shipped = row(ms=0.300, ms_pdl=0.296, max_abs_diff=1e-3, max_abs_diff_pdl=1e-3)
    fused = row(min_chunk=2048, fused=True, block_n=128, num_warps=8, num_stages=3, chunks=3,
                ms=0.281, ms_pdl=0.270, max_abs_diff=2e-3, max_abs_diff_pdl=0.5)  # PDL read stale rows: not taken
    broken = row(min_chunk=4096, fused=True, chunks=2, ms=0.100, max_abs_diff=float("nan"), error_pdl="OutOfResources")
    pick = sweep.dense_pick([shipped, fused, broken], row(ms=0.312))  # the grid's row of the same configuration
    assert pick == {"text": "min_chunk=2048,fused=1,pdl=0,block_n=128,num_warps=8,num_stages=3,min_ctas=256,chunk_mean=0,kept_stream=0", "ms": 0.281, "pdl": False,
                    "shipped_ms": 0.300}
    got = SplitConfig.with_dense_launch(pick["text"])
    assert (got.dense_min_chunk, got.dense_fused, got.dense_pdl, got.dense_block_n, got.dense_num_warps, got.dense_num_stages) == \
        (2048, True, False, 128, 8, 3)


def test_pick_takes_pdl_when_faster_and_exact_and_none_without_an_exact_row():
    shipped = row(ms=0.300, ms_pdl=0.290, max_abs_diff=1e-3, max_abs_diff_pdl=1e-3)
    pick = sweep.dense_pick([shipped], shipped)
    assert pick["pdl"] and pick["ms"] == 0.290 and SplitConfig.with_dense_launch(pick["text"]) == SplitConfig(dense_min_chunk=512, dense_fused=False, dense_pdl=True, dense_block_n=64, dense_num_stages=None,
                                                                                                                  dense_chunk_mean=0)  # the timed plan: chunk_mean off
    assert pick["shipped_ms"] == 0.300
    assert sweep.dense_pick([row(ms=0.2, max_abs_diff=0.3)], None) is None
    assert sweep.dense_pick([], None) is None


def test_contexts_groups_give_one_context_a_request_and_bad_groups_one_line_refusals(capsys):
    assert sweep.parse_contexts("3x4608,1x65536") == [4608] * 3 + [65536]
    assert sweep.parse_contexts(" 2x16 ") == [16, 16]
    for bad in ("0x4096", "4x15", "4096", "x4096", "2x", "2x4096,", "2*4096"):
        with pytest.raises(ValueError, match="COUNTxLENGTH"):
            sweep.parse_contexts(bad)
    # refused by the parser before anything needs a GPU, with the group named, and nothing written
    with pytest.raises(SystemExit) as e:
        sweep.main(["--out", "/nonexistent/x.json", "--contexts", "31x4608,1xlong"])
    assert e.value.code == 2 and "'1xlong'" in capsys.readouterr().err


def test_plan_key_merges_minimum_chunks_that_give_one_launch_and_nothing_else():
    import torch

    from sglang_elastic.kernels.decode_attention import split_kv_plan

    def key(lens, min_chunk, fused=False, block_n=64, warps=None):
        indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(torch.tensor(lens), 0)
        chunk, nsplit = split_kv_plan(indptr, 32, min_chunk, block_n)
        return sweep.plan_key(fused, block_n, warps, None, chunk.tolist(), nsplit.tolist())

    short = [40, 40, 40, 300]  # every context under 512: the shipped 512 plan is the 8192 plan (one chunk a request)
    assert key(short, 512) == key(short, 8192) == key(short, 131072)
    assert key(short, 256) != key(short, 512)  # the 300-position request splits in two
    mix = [4608, 4600, 8448, 65536]
    assert key(mix, 8192) != key(mix, 16384) != key(mix, 131072)  # 65,536 splits under the first two, 8,448 under 8192 only
    assert key(mix, 8192) != key(mix, 8192, fused=True) and key(mix, 8192) != key(mix, 8192, warps=4)
    assert key(mix, 8192) != key(mix, 8192, block_n=128)


def test_contexts_refuses_an_empty_value_and_more_positions_than_the_buffers_hold(capsys):
    for bad, said in (("", "group ''"), ("1000x5000", "at most 4,194,304")):
        with pytest.raises(SystemExit) as e:
            sweep.main(["--out", "/nonexistent/x.json", "--contexts", bad])
        assert e.value.code == 2 and said in capsys.readouterr().err


def test_contexts_refuses_batch_or_context_beside_it(capsys):
    with pytest.raises(SystemExit) as e:
        sweep.main(["--out", "/nonexistent/x.json", "--contexts", "32x8960", "--batch", "32"])
    assert e.value.code == 2 and "leave out --batch and --context" in capsys.readouterr().err


def test_default_dense_configs_raise_the_minimum_chunk_to_the_mean_share_only_where_no_request_is_past_twice_it():
    import torch

    sp = SplitConfig()
    mix = torch.tensor([10000] * 24 + [3000] * 8, dtype=torch.int32)  # mean 8,250: 125 % of it is 10,313, past every request
    got = sweep.default_dense_configs(mix, sp)
    assert got["chunk_mean0"]["min_chunk"] == sp.dense_min_chunk == 8192
    assert got["chunk_mean"]["min_chunk"] == -(-(24 * 10000 + 8 * 3000) * 125 // (32 * 100)) == 10313
    want = dict(max_splits=sp.scores_max_splits, block_n=128, num_warps=None, num_stages=3, fused=True, pdl=True)
    for cfg in got.values():
        assert {k: cfg[k] for k in want} == want
    # 28 x 8,448 + 4 x 32,768: the long ones past twice 125 % of the mean (14,360): the floor; 31 x 4,608 + 65,536: the
    # mean's 125 % (8,140) is under the floor anyway
    for lens in ([8448] * 28 + [32768] * 4, [4608] * 31 + [65536]):
        got = sweep.default_dense_configs(torch.tensor(lens, dtype=torch.int32), sp)
        assert got["chunk_mean"] == got["chunk_mean0"] and got["chunk_mean"]["min_chunk"] == 8192
    off = sweep.default_dense_configs(mix, SplitConfig(dense_chunk_mean=0))
    assert off["chunk_mean"] == off["chunk_mean0"]
