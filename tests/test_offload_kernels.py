"""The offload path's kernels against float64 and PyTorch references.

Under Triton's interpreter (small shapes; the H200 shapes and timings are
``scripts/gpu/check_offload.py`` / ``bench_offload.py``). Every case draws
fresh random inputs, scatters each request's tokens over random pool slots
(as SGLang's allocator leaves them) and poisons outputs before the kernels run.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_elastic.kernels import offload as ko
from sglang_elastic.kernels.decode_attention import split_kv_plan
from sglang_elastic.offload.oracle.reuse import HotBufferModel, hot_capacity
from sglang_elastic.offload.policy import OffloadPolicy, attend_reference, select_reference, token_scores

NAN = float("nan")


def scattered(lens, slots, g):
    """Request token ids: disjoint random slots in [1, slots) (slot 0 is SGLang's padding slot)."""
    perm = (torch.randperm(slots - 1, generator=g) + 1).to(torch.int32)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(lens), 0)
    return indptr, perm[: int(indptr[-1])]


def run_scores(q, kb, indptr, idx, max_splits=4, min_chunk=64, carry_ids=True):
    B, Hq, _ = q.shape
    chunk, _ = split_kv_plan(indptr, max_splits, min_chunk, 32)
    T = int(indptr[-1])
    scores = torch.full((Hq, T + 16), NAN)
    mid = torch.full((B * max_splits, Hq), NAN)
    ko.scores_run(q, kb, indptr, idx, chunk, max_splits, scores, mid, carry_ids=carry_ids)
    return scores, ko.lse_merge(mid, B, max_splits)


@pytest.mark.parametrize("lens,hq,hkv,d", [([1, 37, 700], 8, 2, 64), ([129, 5], 6, 3, 64), ([300], 4, 4, 32)])
def test_scores_and_lse_cover_every_position_and_match_float64(lens, hq, hkv, d):
    g = torch.Generator().manual_seed(sum(lens) + hq)
    slots = sum(lens) * 2 + 8
    kb = torch.randn(slots, hkv, d, generator=g).bfloat16()
    q = torch.randn(len(lens), hq, d, generator=g).bfloat16()
    indptr, idx = scattered(lens, slots, g)
    scores, lse = run_scores(q, kb, indptr, idx)
    # the ids loaded where they are used (the kernel before CARRY_IDS): the same scores and LSEs bit for bit
    before = run_scores(q, kb, indptr, idx, carry_ids=False)
    assert torch.equal(scores[:, : int(indptr[-1])], before[0][:, : int(indptr[-1])]) and torch.equal(lse, before[1])
    for b in range(len(lens)):
        lo, hi = int(indptr[b]), int(indptr[b + 1])
        K = kb[idx[lo:hi].long()].double().repeat_interleave(hq // hkv, 1)
        ref = torch.einsum("hd,lhd->hl", q[b].double(), K) * d ** -0.5
        assert not torch.isnan(scores[:, lo:hi]).any()
        assert torch.allclose(scores[:, lo:hi].double(), ref, atol=1e-5, rtol=1e-5)
        assert torch.allclose(lse[b].double(), torch.logsumexp(ref, 1), atol=1e-5)


def select(scores, lse, indptr, pol, hq):
    lens = indptr[1:] - indptr[:-1]
    s, w, k = (x.to(torch.int32) for x in pol.counts_tensor(lens))
    sel = torch.full((len(lens), max(pol.max_topk, 1)), -7, dtype=torch.int32)
    ko.select_run(scores, lse, indptr, s, w, k, torch.zeros(scores.shape[1]), sel, hq, block_n=64, parts=2)
    return sel, s, w, k


def test_select_refuses_a_part_count_that_is_not_a_power_of_two_before_writing():
    """``parts`` 0 (review #32: ``0 & -1`` passed the check and the empty grid wrote nothing) and 3: a ValueError,
    ``sel_pos`` untouched; 1 and 4 select."""
    g = torch.Generator().manual_seed(31)
    scores = torch.randn(2, 100, generator=g)
    lse = torch.logsumexp(scores, 1)[None]
    indptr = torch.tensor([0, 100], dtype=torch.int32)
    s, w, k = (torch.tensor([x], dtype=torch.int32) for x in (2, 3, 5))
    for parts in (0, 3):
        sel = torch.full((1, 9), -7, dtype=torch.int32)
        with pytest.raises(ValueError, match=f"parts must be a power of two, not {parts}"):
            ko.select_run(scores, lse, indptr, s, w, k, torch.zeros(100), sel, 2, block_n=16, parts=parts)
        assert (sel == -7).all()
    picks = []
    for parts in (1, 4):
        sel = torch.full((1, 9), -7, dtype=torch.int32)
        ko.select_run(scores, lse, indptr, s, w, k, torch.zeros(100), sel, 2, block_n=16, parts=parts)
        picks.append(sel[0, :5].tolist())
    p = torch.exp(scores.double() - lse.double().T).sum(0)[2:97]
    assert picks[0] == picks[1] and sorted(picks[0]) == sorted((p.topk(5).indices + 2).tolist())  # (the threshold's own last)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_radix_select_returns_the_exact_top_k_of_the_summed_softmax(seed):
    g = torch.Generator().manual_seed(seed)
    lens = [1, 30, 37, 500, 900]  # all-sink, window only, k = 0, k < middle, k hitting max_topk
    hq, hkv, d = 8, 2, 32
    slots = 4000
    kb = torch.randn(slots, hkv, d, generator=g).bfloat16()
    q = (3 * torch.randn(len(lens), hq, d, generator=g)).bfloat16()  # peaked softmax: a real ranking
    indptr, idx = scattered(lens, slots, g)
    scores, lse = run_scores(q, kb, indptr, idx)
    pol = OffloadPolicy(sink=3, window=8, budget_frac=0.05, max_topk=32)
    sel, s, w, k = select(scores, lse, indptr, pol, hq)
    for b, L in enumerate(lens):
        lo, hi = int(indptr[b]), int(indptr[b + 1])
        kk = int(k[b])
        assert (int(s[b]), int(w[b]), kk) == pol.counts(L)
        got = sel[b, :kk]
        # the kernel's set is the exact top-k of its fp32 summed softmax (ties to the lower position) ...
        p32 = torch.exp(scores[:, lo:hi] - lse[b][:, None]).sum(0)
        want = select_reference(p32, pol)[int(s[b]) + int(w[b]):]
        assert sorted(got.tolist()) == sorted(want.tolist())
        assert (sel[b, kk:] == -7).all()  # nothing written past k
        # ... and a valid top-k of the float64 one: nothing left out beats what was taken (beyond rounding)
        p64 = token_scores(scores[:, lo:hi], lse[b])
        mid = torch.arange(int(s[b]), L - int(w[b]))
        if kk and kk < len(mid):
            taken = torch.zeros(L, dtype=torch.bool)
            taken[got.long()] = True
            assert p64[got.long()].min() >= p64[mid][~taken[mid]].max() - 1e-6


def test_radix_select_breaks_ties_by_position_and_takes_all_when_the_budget_covers_the_middle():
    # equal scores everywhere: the first k middle positions win
    L, hq = 400, 4
    scores = torch.zeros(hq, L + 8)
    lse = torch.full((1, hq), float(torch.log(torch.tensor(float(L)))))
    indptr = torch.tensor([0, L], dtype=torch.int32)
    pol = OffloadPolicy(sink=2, window=4, budget_frac=0.1, max_topk=64)
    sel, s, w, k = select(scores, lse, indptr, pol, hq)
    assert sel[0, : int(k[0])].tolist() == list(range(2, 2 + int(k[0])))
    # a budget of the whole context selects every middle position, in order
    pol = OffloadPolicy(sink=2, window=4, budget_frac=1.0, max_topk=512)
    sel, s, w, k = select(scores, lse, indptr, pol, hq)
    assert int(k[0]) == L - 6 and sel[0, : L - 6].tolist() == list(range(2, L - 4))


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_swap_in_follows_lru_and_fills_the_hot_buffer_with_the_host_rows(eviction):
    """The hot buffer against a plain-Python LRU / LFU, each request within the
    slots its pages cover (row 2 holds 2 pages of 4 rows: 8 of the 12 slots),
    the pages scattered over the page pool (slot ``s`` is device row
    ``base + table[r, s // 4] * 4 + s % 4``)."""
    rnd = random.Random(0)
    g = torch.Generator().manual_seed(0)
    HN, MAXK, PRE, rows, ctx, B, PAGE, NP = 12, 8, 3, 4, 80, 3, 4, 10
    base = rows * PRE
    req = torch.tensor([1, 3, 2], dtype=torch.int32)
    pages = torch.randperm(NP, generator=g).to(torch.int32)
    table = torch.full((rows, 3), -1, dtype=torch.int32)
    table[1], table[3], table[2, :2] = pages[:3], pages[3:6], pages[6:8]
    count = torch.tensor([0, 3, 2, 3], dtype=torch.int32)
    cap = {1: 12, 3: 12, 2: 8}
    row_of = {(r, s): base + int(table[r, s // PAGE]) * PAGE + s % PAGE for r in cap for s in range(cap[r])}
    r2t = (torch.randperm(900, generator=g)[: rows * ctx].view(rows, ctx) + 1).to(torch.int32)
    loc_slot = torch.full((1024,), -1, dtype=torch.int16)
    slot_pos = torch.full((rows, HN), -1, dtype=torch.int32)
    slot_time = torch.full((rows, HN), -1, dtype=torch.int32)
    host = torch.randn(1024, 2, 8, generator=g).bfloat16()
    dev = torch.full((base + NP * PAGE + 1, 2, 8), NAN).bfloat16()
    stats = torch.zeros(2, dtype=torch.int64)
    refs = {r: HotBufferModel(cap[r], eviction) for r in cap}  # the CPU oracle's model of the hot buffer (oracle/reuse.py)
    hits = misses = 0
    last0 = []
    favourites = [5, 6, 7]  # selected often: LFU keeps them where LRU lets them go
    for step in range(40):
        now = 20 + step
        sels = [rnd.sample(range(3, now - 3), rnd.randint(0, MAXK)) for _ in range(B)]
        if step % 7 == 3:  # a repeated selection: all hits
            sels[0] = last0
        if step % 3 == 0 and step < 36:  # none in the last four steps: LRU has let them go by the end
            sels[1] = favourites + [p for p in sels[1] if p not in favourites][: MAXK - 3]
        last0 = sels[0]
        k = torch.tensor([len(x) for x in sels], dtype=torch.int32)
        sel = torch.zeros(B, MAXK, dtype=torch.int32)
        for b, x in enumerate(sels):
            sel[b, : len(x)] = torch.tensor(x, dtype=torch.int32)
        s_eff, w_eff = torch.full((B,), 1, dtype=torch.int32), torch.full((B,), 2, dtype=torch.int32)
        att_indptr = torch.zeros(B + 1, dtype=torch.int32)
        att_indptr[1:] = torch.cumsum(s_eff + w_eff + k, 0)
        att_k = torch.full((int(att_indptr[-1]) + 1,), -5, dtype=torch.int32)
        att_v = att_k.clone()
        ms, md = torch.full((B, MAXK), -1, dtype=torch.int32), torch.full((B, MAXK), -1, dtype=torch.int32)
        mc = torch.full((B,), -1, dtype=torch.int32)
        ko.swap_in_run(sel, k, s_eff, w_eff, att_indptr, torch.full((B,), now, dtype=torch.int32), req, r2t, loc_slot, slot_pos,
                       slot_time, torch.zeros(B, HN, dtype=torch.int32), att_k, att_v, ms, md, mc, stats, MAXK, table, count, base, PAGE,
                       eviction=eviction)
        ko.copy_rows_run(host, dev, ms, md, counts=mc)
        for b in range(B):
            r = int(req[b])
            ref = refs[r]
            want_slots, loaded = ref.step(sels[b], now)
            m = len(loaded)
            hits, misses = hits + len(sels[b]) - m, misses + m
            at = int(att_indptr[b]) + 3
            got_rows = [int(att_v[at + i]) for i in range(len(sels[b]))]
            assert got_rows == [row_of[r, j] for j in want_slots] and int(mc[b]) == m
            c = cap[r]
            assert slot_pos[r, :c].tolist() == ref.pos and slot_time[r, :c].tolist() == ref.time
            assert (slot_pos[r, c:] == -1).all() and (slot_time[r, c:] == -1).all()  # no slot past the pages is used
            held = [p for p in slot_pos[r].tolist() if p >= 0]
            assert len(held) == len(set(held))  # no position held twice
            for i, p in enumerate(sels[b]):
                loc = int(r2t[r, p])
                assert int(att_k[at + i]) == loc
                assert torch.equal(dev[int(att_v[at + i])], host[loc])  # the hot row is the host's V row
            assert (att_k[int(att_indptr[b]): at] == -5).all()  # sink/window entries are not this kernel's
    assert stats.tolist() == [hits, misses] and hits > 0 and misses > 0
    held = set(slot_pos[int(req[1])].tolist())
    assert set(favourites) <= held if eviction == "lfu" else not set(favourites) <= held  # the rule made a difference


@pytest.mark.parametrize("by_row", [False, True], ids=["hint_by_token", "hint_by_row"])
def test_requests_that_share_token_ids_find_their_own_hot_rows_with_the_hint_by_row(by_row):
    """Two requests whose first 40 positions are the same token ids (a prefix SGLang's radix cache
    matched) select the same 4 of them for 6 steps, after one of them loaded another row first (so
    their slots differ). Every entry reads the host's V row of its token either way; with the hint per
    token id each request finds the other's slot, misses and loads again (step after step, until their
    slots happen to line up), with the hint per request row and position (``loc_slot`` ``[rows, context]``)
    only the first step loads."""
    g = torch.Generator().manual_seed(3)
    HN, MAXK, rows, ctx, PAGE, B = 16, 8, 3, 64, 4, 2
    base = rows * 3
    req = torch.tensor([1, 2], dtype=torch.int32)
    table = torch.arange(rows * 4, dtype=torch.int32).view(rows, 4)
    count = torch.full((rows,), 4, dtype=torch.int32)
    r2t = (torch.randperm(500, generator=g)[: rows * ctx].view(rows, ctx) + 1).to(torch.int32)
    r2t[2, :40] = r2t[1, :40]
    loc_slot = torch.full((rows, ctx) if by_row else (512,), -1, dtype=torch.int16)
    slot_pos = torch.full((rows, HN), -1, dtype=torch.int32)
    slot_time = torch.full((rows, HN), -1, dtype=torch.int32)
    host = torch.randn(512, 2, 8, generator=g).bfloat16()
    dev = torch.full((base + rows * 4 * PAGE + 1, 2, 8), NAN).bfloat16()
    stats = torch.zeros(2, dtype=torch.int64)
    per_step = []
    for step in range(7):
        sels = [[10], []] if step == 0 else [[20, 21, 22, 23], [20, 21, 22, 23]]
        k = torch.tensor([len(x) for x in sels], dtype=torch.int32)
        sel = torch.zeros(B, MAXK, dtype=torch.int32)
        for b, x in enumerate(sels):
            sel[b, : len(x)] = torch.tensor(x, dtype=torch.int32)
        s_eff = w_eff = torch.zeros(B, dtype=torch.int32)
        att_indptr = torch.zeros(B + 1, dtype=torch.int32)
        att_indptr[1:] = torch.cumsum(k, 0)
        att_k = torch.full((int(att_indptr[-1]) + 1,), -5, dtype=torch.int32)
        att_v = att_k.clone()
        ms, md = torch.full((B, MAXK), -1, dtype=torch.int32), torch.full((B, MAXK), -1, dtype=torch.int32)
        mc = torch.full((B,), -1, dtype=torch.int32)
        ko.swap_in_run(sel, k, s_eff, w_eff, att_indptr, torch.full((B,), 50 + step, dtype=torch.int32), req, r2t, loc_slot, slot_pos,
                       slot_time, torch.zeros(B, HN, dtype=torch.int32), att_k, att_v, ms, md, mc, stats, MAXK, table, count, base, PAGE)
        ko.copy_rows_run(host, dev, ms, md, counts=mc)
        for b in range(B):
            for i, p in enumerate(sels[b]):
                at = int(att_indptr[b]) + i
                assert torch.equal(dev[int(att_v[at])], host[int(r2t[int(req[b]), p])])  # always the token's own V
        per_step.append(mc.tolist())
    assert per_step[1] == [4, 4]
    if by_row:
        assert per_step[2:] == [[0, 0]] * 5
    else:  # the ping-pong the hint by row removes (until the two requests' slots happen to line up)
        assert sum(sum(m) for m in per_step[2:]) >= 8, per_step


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_a_speculative_pass_loads_only_into_slots_the_last_step_left_and_the_model_agrees(eviction):
    """``swap_in_run(spec=True)`` (the prefetch) against :class:`HotBufferModel`:
    it stamps ``L - 1``, takes only slots older than the previous step (a guess
    with more misses than such slots loads the first ones only), and the exact
    pass that follows finds the loaded rows; the model's slots, clocks and
    loads equal the kernel's after every pass, over random guesses."""
    rnd = random.Random(1)
    HN, PAGE, ctx = 8, 4, 64
    r2t = (torch.randperm(500, generator=torch.Generator().manual_seed(1))[:ctx].view(1, ctx) + 1).to(torch.int32)
    loc_slot = torch.full((512,), -1, dtype=torch.int16)
    slot_pos = torch.full((1, HN), -1, dtype=torch.int32)
    slot_time = torch.full((1, HN), -1, dtype=torch.int32)
    table, count = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    stats = torch.zeros(2, dtype=torch.int64)
    model = HotBufferModel(HN, eviction)
    short = 0
    for step in range(30):
        now = 20 + step
        exact = rnd.sample(range(2, now - 2), rnd.randint(1, 6))
        guess = rnd.sample(range(2, now - 2), rnd.randint(1, 8))
        for sel_list, spec in ((guess, True), (exact, False)):
            k = torch.tensor([len(sel_list)], dtype=torch.int32)
            sel = torch.zeros(1, 8, dtype=torch.int32)
            sel[0, : len(sel_list)] = torch.tensor(sel_list, dtype=torch.int32)
            att = torch.zeros(len(sel_list) + 1, dtype=torch.int32)
            ms, md, mc = torch.zeros(1, 8, dtype=torch.int32), torch.zeros(1, 8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
            z = torch.zeros(1, dtype=torch.int32)
            ko.swap_in_run(sel, k, z, z, torch.tensor([0, len(sel_list)], dtype=torch.int32), torch.tensor([now], dtype=torch.int32), z, r2t,
                           loc_slot, slot_pos, slot_time, torch.zeros(1, HN, dtype=torch.int32), att, att.clone(), ms, md, mc, stats, 8, table,
                           count, 0, PAGE, spec=spec, eviction=eviction)
            _, loaded = model.step(sel_list, now, spec=spec)
            assert int(mc[0]) == len(loaded) and ms[0, : len(loaded)].tolist() == [int(r2t[0, p]) for p in loaded]
            assert slot_pos[0].tolist() == model.pos and slot_time[0].tolist() == model.time
            if spec:
                missing = [p for p in sel_list if p not in set(model.pos)]
                short += bool(missing)
                assert all(t != now - 1 or p in sel_list or p in prev for p, t in zip(model.pos, [model._last(x) for x in model.time]))
            else:
                prev = set(sel_list)
    assert short > 0  # some guesses found too few free slots: the partial load was exercised


def test_lfu_victims_of_slots_used_more_than_511_times_are_the_least_used():
    """LFU keys past ``2**30`` (``uses << 21 | last``, uses 512 to 1023, a request whose rows were selected in
    hundreds of steps): the victims are still the least used slots, as :class:`HotBufferModel` takes them.
    The victim search summed two such keys for its midpoint and overflowed int32 until 2026-12-06 (#23)."""
    rnd = random.Random(7)
    HN, PAGE, ctx = 16, 8, 2000
    r2t = (torch.randperm(4000, generator=torch.Generator().manual_seed(7))[:ctx].view(1, ctx) + 1).to(torch.int32)
    model = HotBufferModel(HN, "lfu")
    held = rnd.sample(range(10, 900), HN)
    uses = rnd.sample(range(512, 1024), HN)
    model.pos, model._slot = list(held), {p: j for j, p in enumerate(held)}
    model.time = [(u << 21) | rnd.randint(100, 900) for u in uses]
    slot_pos = torch.tensor([model.pos], dtype=torch.int32)
    slot_time = torch.tensor([model.time], dtype=torch.int32)
    loc_slot = torch.full((4096,), -1, dtype=torch.int16)
    for j, p in enumerate(held):
        loc_slot[int(r2t[0, p])] = j
    table, count = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    stats = torch.zeros(2, dtype=torch.int64)
    for now in (1000, 1001, 1002):
        sel_list = rnd.sample(held, 3) + rnd.sample(range(1000, 1990), 5)  # 3 hits, 5 misses: 5 victims among 13
        k = torch.tensor([len(sel_list)], dtype=torch.int32)
        sel = torch.tensor([sel_list], dtype=torch.int32)
        att = torch.zeros(len(sel_list) + 1, dtype=torch.int32)
        ms, md, mc = torch.zeros(1, 8, dtype=torch.int32), torch.zeros(1, 8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        z = torch.zeros(1, dtype=torch.int32)
        ko.swap_in_run(sel, k, z, z, torch.tensor([0, len(sel_list)], dtype=torch.int32), torch.tensor([now], dtype=torch.int32), z, r2t,
                       loc_slot, slot_pos, slot_time, torch.zeros(1, HN, dtype=torch.int32), att, att.clone(), ms, md, mc, stats, 8, table,
                       count, 0, PAGE, eviction="lfu")
        _, loaded = model.step(sel_list, now)
        assert int(mc[0]) == len(loaded) == 5
        assert slot_pos[0].tolist() == model.pos and slot_time[0].tolist() == model.time
        held = list(model.pos)


def test_hot_capacity_is_what_the_page_grant_gives():
    """The oracle's slot count for ``k`` selected rows equals the pages
    ``page_grant_run`` grants times their rows (capped at ``hot_tokens``)."""
    HN, PAGE = 40, 8
    for k, slack in [(0, 2.0), (1, 1.0), (5, 2.0), (13, 1.5), (30, 2.0), (40, 1.0), (3, 4.0)]:
        table = torch.full((1, 5), -1, dtype=torch.int32)
        count = torch.zeros(1, dtype=torch.int32)
        ko.page_grant_run(torch.tensor([0], dtype=torch.int32), torch.tensor([k], dtype=torch.int32), table, count,
                          torch.arange(5, dtype=torch.int32), torch.tensor([5], dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                          HN, PAGE, math.ceil(slack * 64))
        assert hot_capacity(k, slack, PAGE, HN) == min(int(count[0]) * PAGE, HN), (k, slack)


def test_swap_in_refuses_a_hot_buffer_smaller_than_the_selection():
    z = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv-offload-hot-tokens"):
        ko.swap_in_run(z, z[:, 0], z[:, 0], z[:, 0], torch.zeros(2, dtype=torch.int32), z[:, 0], z[:, 0], z, torch.zeros(4, dtype=torch.int16),
                       z, z, z, z[0], z[0], z, z, z[:, 0], torch.zeros(2, dtype=torch.int64), max_k=8, table=z, count=z[0], hot_base=0,
                       page=4)


def test_page_grant_gives_each_request_the_pages_its_selection_needs_from_one_stack():
    """``page_grant_run``: ``ceil(min(HN, ceil(k * slack)) / page)`` pages per row,
    never fewer than held, popped off one free stack without duplicates;
    released with the row (``slot_release_run``, zero -1); a stack too short
    for a grant leaves the row as it was and counts an overflow."""
    HN, PAGE, NP, rows = 40, 8, 12, 5
    table = torch.full((rows, 5), -1, dtype=torch.int32)
    count = torch.zeros(rows, dtype=torch.int32)
    stack = torch.arange(NP, dtype=torch.int32)
    top = torch.tensor([NP], dtype=torch.int32)
    over = torch.zeros(1, dtype=torch.int32)

    def grant(r, k, slack64=128):
        ko.page_grant_run(torch.tensor(r, dtype=torch.int32), torch.tensor(k, dtype=torch.int32), table, count, stack, top, over,
                          HN, PAGE, slack64)

    grant([1, 2, 3], [0, 5, 30])  # 0 rows; ceil(10 / 8) = 2 pages; min(40, 60) rows = 5 pages
    assert count.tolist() == [0, 0, 2, 5, 0] and int(top) == NP - 7
    owned = table[table >= 0].tolist()
    assert len(owned) == len(set(owned)) == 7 and set(owned) == set(range(NP - 7, NP))
    assert (table[2, 2:] == -1).all() and (table[1] == -1).all()
    grant([2, 3], [3, 1], slack64=96)  # asks for fewer than held: nothing changes
    assert count.tolist() == [0, 0, 2, 5, 0] and int(top) == NP - 7
    grant([2], [7], slack64=96)  # ceil(7 * 1.5) = 11 rows: 2 pages, held already
    assert count.tolist() == [0, 0, 2, 5, 0]
    grant([4], [20], slack64=96)  # 30 rows: 4 pages, 5 free
    assert count.tolist() == [0, 0, 2, 5, 4] and int(top) == 1
    grant([1], [9])  # 18 rows: 3 pages, 1 free: none given, one overflow
    assert count.tolist() == [0, 0, 2, 5, 4] and int(top) == 1 and int(over) == 1 and (table[1] == -1).all()
    ko.slot_release_run(torch.tensor([3, 0]), table, count, stack, top, -1)  # row 3's five pages back
    assert count.tolist() == [0, 0, 2, 0, 4] and int(top) == 6 and (table[3] == -1).all()
    grant([1], [9])
    held = table[table >= 0].tolist()
    assert count[1] == 3 and len(held) == len(set(held)) == 9 and int(over) == 1
    free = stack[: int(top)].tolist()
    assert set(free).isdisjoint(held) and len(free) + len(held) == NP
    with pytest.raises(ValueError, match="slack64"):
        grant([1], [1], slack64=63)


def test_copy_rows_moves_exactly_the_listed_rows_and_skips_negative_ids():
    g = torch.Generator().manual_seed(3)
    src = torch.randn(50, 3, 64, generator=g).bfloat16()  # a 192-element row (not a power of two)
    dst = torch.full((40, 3, 64), NAN).bfloat16()
    si = torch.tensor([5, 0, 49, 7, 3], dtype=torch.int64)
    di = torch.tensor([1, 2, -1, 39, 0], dtype=torch.int32)
    ko.copy_rows_run(src, dst, si, di, n=5)
    for s, d in zip(si.tolist(), di.tolist()):
        if d >= 0:
            assert torch.equal(dst[d], src[s])
    untouched = [i for i in range(40) if i not in (1, 2, 39, 0)]
    assert torch.isnan(dst[untouched].float()).all()
    with pytest.raises(ValueError, match="rows differ"):
        ko.copy_rows_run(src, torch.zeros(4, 2, 64).bfloat16(), n=1)


@pytest.mark.parametrize("denominator", ["full", "selected"])
def test_attend_over_the_attended_list_matches_the_policy_reference(denominator):
    g = torch.Generator().manual_seed(5)
    lens, hq, hkv, d = [40, 333, 3], 8, 2, 64
    slots = 900
    kb = torch.randn(slots, hkv, d, generator=g).bfloat16()
    vb = torch.randn(slots, hkv, d, generator=g).bfloat16()
    q = (2 * torch.randn(len(lens), hq, d, generator=g)).bfloat16()
    indptr, idx = scattered(lens, slots, g)
    scores, lse = run_scores(q, kb, indptr, idx)
    pol = OffloadPolicy(sink=2, window=5, budget_frac=0.1, max_topk=16, dense_layers=0, denominator=denominator)
    sel, s, w, k = select(scores, lse, indptr, pol, hq)
    # the attended lists, V read at the token ids (the resident reference's layout)
    att_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    att_indptr[1:] = torch.cumsum(s + w + k, 0)
    r2t = torch.zeros(len(lens), max(lens), dtype=torch.int32)
    for b in range(len(lens)):
        r2t[b, : lens[b]] = idx[int(indptr[b]): int(indptr[b + 1])]
    seq = torch.tensor(lens, dtype=torch.int32)
    rp = torch.arange(len(lens), dtype=torch.int32)
    n = int(att_indptr[-1])
    ak, av, vrows = torch.full((n + 1,), -1, dtype=torch.int32), torch.full((n + 1,), -1, dtype=torch.int32), torch.zeros(len(lens), dtype=torch.int64)
    ko.fixed_entries_run(seq, rp, r2t, s, w, att_indptr, ak, av, vrows, pol.sink, pol.window, 0, resident=True)
    ko.gather_selected_run(sel, k, s, w, att_indptr, rp, r2t, ak, av, pol.max_topk)
    assert torch.equal(ak[:n], av[:n]) and (ak[:n] > 0).all()
    chunk, nsplit = split_kv_plan(att_indptr, 2, 16, 32)
    out = torch.full_like(q, NAN)
    mid_o, mid_lse = torch.full((len(lens) * 2, hq, d), NAN), torch.full((len(lens) * 2, hq), NAN)
    ko.attend_run(q, kb, vb, att_indptr, ak, av, chunk, nsplit, 2, mid_o, mid_lse, out, lse if denominator == "full" else None)
    for b in range(len(lens)):
        ids = idx[int(indptr[b]): int(indptr[b + 1])].long()
        ref = attend_reference(q[b], kb[ids], vb[ids], pol, layer_id=5)
        assert float((out[b].double() - ref).abs().max() / ref.abs().max()) < 1e-2
    # full vs selected differ where the attended set misses mass (the long request)
    if denominator == "full":
        sel_out = torch.empty_like(q)
        ko.attend_run(q, kb, vb, att_indptr, ak, av, chunk, nsplit, 2, mid_o, mid_lse, sel_out, None)
        assert torch.allclose(out[2].float(), sel_out[2].float(), atol=1e-2)  # 3 tokens: everything attended
        assert not torch.allclose(out[1].float(), sel_out[1].float(), atol=1e-3)
    # extra partials (estimate's share) are added in the merge, before the cast: float32 output = without + their sum
    extra = torch.randn(len(lens) * 3, hq, d, generator=g)
    o32, o32x = torch.full(q.shape, NAN), torch.full(q.shape, NAN)
    den = lse if denominator == "full" else None
    ko.attend_run(q, kb, vb, att_indptr, ak, av, chunk, nsplit, 2, mid_o, mid_lse, o32, den)
    ko.attend_run(q, kb, vb, att_indptr, ak, av, chunk, nsplit, 2, mid_o, mid_lse, o32x, den, extra=extra, extra_splits=3)
    want = o32 + extra.view(len(lens), 3, hq, d).sum(1)
    assert torch.allclose(o32x, want, rtol=0, atol=1e-5) and (o32x - o32).abs().max() > 0.1
    # only each request's first extra_count[b] rows are added (the rest may hold anything: never read)
    cnt = torch.tensor([3, 1, 0], dtype=torch.int32)
    junk = extra.clone().view(len(lens), 3, hq, d)
    junk[1, 1:], junk[2] = NAN, NAN
    o32c = torch.full(q.shape, NAN)
    ko.attend_run(q, kb, vb, att_indptr, ak, av, chunk, nsplit, 2, mid_o, mid_lse, o32c, den, extra=junk.view(-1, hq, d), extra_splits=3,
                  extra_count=cnt)
    ex = extra.view(len(lens), 3, hq, d)
    want_c = o32 + torch.stack([ex[0].sum(0), ex[1, :1].sum(0), torch.zeros(hq, d)])
    assert torch.allclose(o32c, want_c, rtol=0, atol=1e-5) and not torch.isnan(o32c).any()


def test_a_request_with_minus_infinity_lse_is_normalised_over_its_own_list_the_others_by_the_full_lse():
    """The dense requests of ``--kv-offload-keep-v``: scored over no position (lse -inf), their list
    holds every position with V rows apart from K ids; the merge normalises them by their own sum."""
    g = torch.Generator().manual_seed(23)
    lens, hq, hkv, d = [50, 260, 7], 6, 2, 32
    slots = 1000
    kb = torch.randn(slots, hkv, d, generator=g).bfloat16()
    vb = torch.randn(2 * slots, hkv, d, generator=g).bfloat16()  # V rows of a dense request live elsewhere than its K
    q = (2 * torch.randn(len(lens), hq, d, generator=g)).bfloat16()
    indptr, idx = scattered(lens, slots, g)
    vidx = (idx.long() + slots).to(torch.int32)
    lse = 3 * torch.randn(len(lens), hq, generator=g)
    dense = [0, 2]
    lse[dense] = float("-inf")
    chunk, nsplit = split_kv_plan(indptr, 3, 16, 32)
    out = torch.full_like(q, NAN)
    mid_o, mid_lse = torch.full((len(lens) * 3, hq, d), NAN), torch.full((len(lens) * 3, hq), NAN)
    ko.attend_run(q, kb, vb, indptr, idx, vidx, chunk, nsplit, 3, mid_o, mid_lse, out, lse)
    assert not torch.isnan(out).any()
    G = hq // hkv
    for b in range(len(lens)):
        lo, hi = int(indptr[b]), int(indptr[b + 1])
        K = kb[idx[lo:hi].long()].double().repeat_interleave(G, 1)
        V = vb[vidx[lo:hi].long()].double().repeat_interleave(G, 1)
        s_ = torch.einsum("hd,lhd->hl", q[b].double(), K) * d ** -0.5
        den = torch.logsumexp(s_, 1) if b in dense else lse[b].double()  # own sum, or the given full lse
        ref = torch.einsum("hl,lhd->hd", torch.exp(s_ - den[:, None]), V)
        assert float((out[b].double() - ref).abs().max() / ref.abs().max()) < 1e-2, b
    # the sparse request really used the given denominator (not its own sum)
    own = torch.full_like(q, NAN)
    ko.attend_run(q, kb, vb, indptr, idx, vidx, chunk, nsplit, 3, mid_o, mid_lse, own, None)
    assert torch.equal(own[dense], out[dense]) and not torch.allclose(own[1].float(), out[1].float(), atol=1e-2)


def test_lse_merge_combines_chunks_and_keeps_empty_requests_at_minus_infinity():
    g = torch.Generator().manual_seed(11)
    x = 4 * torch.randn(4 * 6, 9, generator=g)
    x[2] = float("-inf")  # an empty chunk of request 0
    x[6:12] = float("-inf")  # request 1: no chunk at all (a padded CUDA-graph row)
    got = ko.lse_merge(x, 4, 6)
    ref = torch.logsumexp(x.double().view(4, 6, 9), 1)
    keep = [0, 2, 3]
    assert torch.allclose(got[keep].double(), ref[keep], atol=1e-5)
    assert torch.isneginf(got[1]).all()


# ---- estimate: the unattended rows through chunk-mean V ---------------------------------------


def test_estimate_reference_is_the_loop_over_chunks_and_unattended_positions():
    """``estimate_reference`` against plain loops; ``attend_reference(estimate)`` is ``full`` plus it."""
    from sglang_elastic.offload.policy import estimate_reference

    g = torch.Generator().manual_seed(21)
    Lq, hq, hkv, d, C = 203, 6, 3, 16, 8
    q = torch.randn(hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(Lq, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(Lq, hkv, d, generator=g, dtype=torch.float64)
    G = hq // hkv
    s = torch.einsum("hd,lhd->hl", q, k.repeat_interleave(G, 1)) * d ** -0.5
    lse = torch.logsumexp(s, 1)
    att = torch.tensor(sorted(random.Random(3).sample(range(Lq), 40)), dtype=torch.int64)
    got = estimate_reference(s, lse, v, att, C, G)
    want = torch.zeros(hq, d, dtype=torch.float64)
    for h in range(hq):
        for c in range(Lq // C):
            vbar = v[c * C:(c + 1) * C, h // G].mean(0)
            for i in range(c * C, (c + 1) * C):
                if i not in att.tolist():
                    want[h] += torch.exp(s[h, i] - lse[h]) * vbar
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12) and want.abs().max() > 1e-3
    pol = OffloadPolicy(sink=2, window=8, budget_frac=0.1, max_topk=16, dense_layers=0, denominator="estimate", chunk=C)
    full = OffloadPolicy(sink=2, window=8, budget_frac=0.1, max_topk=16, dense_layers=0, denominator="full")
    o_est, sel = attend_reference(q, k, v, pol, 0, return_selected=True)
    o_full = attend_reference(q, k, v, full, 0)
    assert torch.allclose(o_est, o_full + estimate_reference(s, lse, v, sel, C, G), rtol=1e-12, atol=1e-12)
    # with every position attended there is nothing to estimate
    assert estimate_reference(s, lse, v, torch.arange(Lq), C, G).abs().max() == 0


@pytest.mark.parametrize("denominator", ["selected", "full", "estimate"])
def test_kv_head_granularity_is_each_kv_head_on_its_own(denominator):
    """``granularity="kv_head"`` (the reference's per-KV-head top-k, issue 24's
    wording): each KV head's rows are exactly those of a one-KV-head model
    holding only that head and its query group, and they differ from the
    shared token-row selection; the kernels' layout refuses it."""
    from sglang_elastic.offload.policy import PolicyError
    from sglang_elastic.offload.pool import OffloadLayout

    g = torch.Generator().manual_seed(11)
    L, Hkv, G, D = 300, 3, 3, 16
    q, k, v = torch.randn(Hkv * G, D, generator=g), torch.randn(L, Hkv, D, generator=g), torch.randn(L, Hkv, D, generator=g)
    pol = OffloadPolicy(budget_frac=0.2, denominator=denominator, granularity="kv_head")
    out, sel = attend_reference(q, k, v, pol, 5, return_selected=True)
    assert sel.shape == (Hkv, pol.counts(L)[0] + pol.counts(L)[1] + pol.counts(L)[2])
    for h in range(Hkv):
        one = attend_reference(q[h * G:(h + 1) * G], k[:, h:h + 1], v[:, h:h + 1], OffloadPolicy(budget_frac=0.2, denominator=denominator), 5)
        assert torch.allclose(out[h * G:(h + 1) * G], one, rtol=0, atol=1e-12)
    shared = attend_reference(q, k, v, OffloadPolicy(budget_frac=0.2, denominator=denominator), 5)
    assert (shared - out).abs().max() > 1e-3  # a different rule, not the same one twice
    with pytest.raises(PolicyError, match="granularity"):
        OffloadPolicy(granularity="head")
    with pytest.raises(ValueError, match="reference's only"):
        OffloadLayout(OffloadPolicy(granularity="kv_head"), 4096, 4, 8)


@pytest.mark.parametrize("C,positions,heads", [(8, 256, (6, 2)), (16, 256, (6, 2)), (8, 32, (6, 2)), (8, 64, (2, 2))])
def test_estimate_kernel_matches_the_float64_reference(C, positions, heads):
    """``estimate_run`` over a real selection (scores, lse and top-k from the
    kernels), chunk means from the V rows, against ``estimate_reference``;
    ``positions``: scores per head a kernel step reads (32: several steps per
    split, the last one partly masked); ``heads``: (q, kv), MHA included."""
    from sglang_elastic.offload.policy import estimate_reference

    g = torch.Generator().manual_seed(22 + C)
    lens, (hq, hkv), d = [150, 700, 20, 5], heads, 32  # heads (2, 2): MHA, one query head per group
    slots = 1200
    kb = torch.randn(slots, hkv, d, generator=g).bfloat16()
    vb = torch.randn(slots, hkv, d, generator=g).bfloat16()
    q = (2 * torch.randn(len(lens), hq, d, generator=g)).bfloat16()
    indptr, idx = scattered(lens, slots, g)
    max_splits = 4
    chunk, _ = split_kv_plan(indptr, max_splits, 64, 32)
    T = int(indptr[-1])
    scores = torch.full((hq, T + 16), NAN)
    mid = torch.full((len(lens) * max_splits, hq), NAN)
    ko.scores_run(q, kb, indptr, idx, chunk, max_splits, scores, mid)
    lse = ko.lse_merge(mid, len(lens), max_splits)
    pol = OffloadPolicy(sink=2, window=C, budget_frac=0.05, max_topk=16, dense_layers=0, denominator="estimate", chunk=C)
    sel, s, w, k = select(scores, lse, indptr, pol, hq)
    rows = torch.tensor([3, 0, 2, 1], dtype=torch.int32)
    n_chunks = max(lens) // C + 1
    vsum = torch.full((4 * n_chunks + 1, hkv, d), NAN).bfloat16()
    for b, L in enumerate(lens):
        ids = idx[int(indptr[b]): int(indptr[b + 1])].long()
        for c in range(L // C):
            vsum[int(rows[b]) * n_chunks + c] = vb[ids[c * C:(c + 1) * C]].float().mean(0).bfloat16()
    attended = torch.zeros(T + 1, dtype=torch.uint8)
    for b in range(len(lens)):
        attended[int(indptr[b]) + sel[b, : int(k[b])].long()] = 1
    out = torch.full((len(lens) * max_splits, hq, d), NAN)
    table = (torch.arange(4)[:, None] * n_chunks + torch.arange(n_chunks)[None, :]).to(torch.int32)  # row r's chunk c: slot r * n + c
    est = ko.estimate_run(scores, lse, indptr, chunk, max_splits, s, w, k, attended, vsum, rows, table, C, out, hkv, block_positions=positions)
    # the decode step's way: lse_merge bumps a stamp, the top-k's last pass writes it at the selected positions, the
    # estimate reads "attended" as "holds this stamp"; older stamps everywhere (never cleared) count as unattended
    marks = torch.randint(0, 6, (T,), generator=g, dtype=torch.int32)
    before = marks.clone()
    stamp = torch.tensor([5], dtype=torch.int32)
    ko.lse_merge(mid, len(lens), max_splits, stamp=stamp)
    assert int(stamp) == 6
    sel2 = torch.full_like(sel, -7)
    ko.select_run(scores, lse, indptr, s, w, k, torch.zeros(scores.shape[1]), sel2, hq, block_n=64, parts=2, marks=marks, stamp=stamp)
    assert torch.equal(sel2, sel)
    want = before.clone()
    want[attended[:T].bool()] = 6
    assert torch.equal(marks, want)
    part = ko.estimate_run(scores, lse, indptr, chunk, max_splits, s, w, k, marks, vsum, rows, table, C,
                           torch.full_like(out, NAN), hkv, stamp=stamp, reduce=False, block_positions=positions)
    assert part.shape == (len(lens) * max_splits, hq, d)
    _, nsplit = split_kv_plan(indptr, max_splits, 64, 32)
    part = part.view(len(lens), max_splits, hq, d)
    for b in range(len(lens)):  # the splits of the request's length are written (their sum is the estimate), the others not at all
        n = int(nsplit[b])
        assert torch.equal(part[b, :n].sum(0), est[b]) and torch.isnan(part[b, n:]).all() and not torch.isnan(part[b, :n]).any()
    assert int(nsplit.min()) < max_splits  # a request with unwritten splits is among them
    for b, L in enumerate(lens):
        ids = idx[int(indptr[b]): int(indptr[b + 1])].long()
        G = hq // hkv
        sc = torch.einsum("hd,lhd->hl", q[b].double(), kb[ids].double().repeat_interleave(G, 1)) * d ** -0.5
        att = torch.cat([torch.arange(int(s[b])), torch.arange(L - int(w[b]), L), sel[b, : int(k[b])].long()])
        ref = estimate_reference(sc, torch.logsumexp(sc, 1), vb[ids].double(), att, C, G)
        if L - int(s[b]) - int(w[b]) <= int(k[b]):  # everything attended: nothing estimated
            assert est[b].abs().max() == 0 and ref.abs().max() == 0
        else:
            assert ref.abs().max() > 1e-3
            assert float((est[b].double() - ref).abs().max() / ref.abs().max()) < 1e-2, (b, L)
    assert (est[1].abs().max() > 0) and not torch.isnan(est).any()
    for bad in (C // 2, 3 * C):  # below the chunk, or not a power of two: refused before any launch
        with pytest.raises(ValueError, match=f"block_positions must be a power of two of at least summary_chunk {C}, not {bad}"):
            ko.estimate_run(scores, lse, indptr, chunk, max_splits, s, w, k, attended, vsum, rows, table, C, out, hkv, block_positions=bad)


def test_summary_slots_come_from_one_free_stack_and_go_back_per_row():
    """``slot_assign_run`` pops one slot per valid item (none for invalid ones,
    ``zero`` once the stack is empty), ``slot_release_run`` pushes a row's back."""
    R, MC, S = 4, 6, 5
    table = torch.full((R, MC), S + 1, dtype=torch.int32)
    count = torch.zeros(R, dtype=torch.int32)
    stack = torch.arange(S, dtype=torch.int32)
    top = torch.tensor([S], dtype=torch.int32)
    over = torch.zeros(1, dtype=torch.int32)

    def assign(rows, chunks, valid):
        dst = torch.full((len(rows),), -7, dtype=torch.int64)
        return ko.slot_assign_run(torch.tensor(rows), torch.tensor(chunks), torch.tensor(valid, dtype=torch.int32), table, count,
                                  stack, top, over, dst, S, S + 1).tolist()

    d = assign([1, 1, 2, 3], [0, 1, 0, 0], [1, 1, 0, 1])
    assert d[2] == S and len({d[0], d[1], d[3]}) == 3 and max(d[0], d[1], d[3]) < S and int(top) == 2
    assert count.tolist() == [0, 2, 0, 1] and table[1, :2].tolist() == d[:2] and table[2, 0] == S + 1
    d2 = assign([2, 2, 2], [0, 1, 2], [1, 1, 1])  # two slots left: the third chunk overflows to zero
    assert sorted(d2).count(S) == 1 and int(over) == 1 and int(top) == 0 and (table[2, :3] == S + 1).sum() == 1
    ko.slot_release_run(torch.tensor([1, 2]), table, count, stack, top, S + 1)
    assert int(top) == 4 and count.tolist() == [0, 0, 0, 1]
    assert sorted(stack[:4].tolist() + [int(table[3, 0])]) == list(range(S))  # every slot owned once: free or row 3's


def test_chunk_mean_writes_the_mean_of_each_items_rows_to_its_slot_and_nothing_else():
    """``chunk_mean_run`` (a decode step's V summaries, one launch): each item's
    ``C`` rows averaged in float32 into its slot; the spare slot takes what
    completes nothing, or nothing at all when named as ``skip``; other slots
    untouched; a width mismatch refused."""
    g = torch.Generator().manual_seed(9)
    src = torch.randn(300, 3, 40, generator=g).bfloat16()  # a 120-element row (not a power of two)
    ids = torch.randint(0, 300, (5, 8), generator=g)
    dst = torch.tensor([4, 0, 9, 2, 9])  # 9: the spare row, written twice (its value is never read)
    out = torch.full((10, 3, 40), NAN).bfloat16()
    ko.chunk_mean_run(src, ids, dst, out)
    for i in range(4):
        want = src[ids[i]].double().mean(0)
        if int(dst[i]) != 9:
            # within one bf16 step (Triton's interpreter truncates the cast; the GPU rounds to nearest)
            assert ((out[int(dst[i])].double() - want).abs() <= want.abs() * 2 ** -7 + 1e-6).all()
            assert (out[int(dst[i])].double() - want).abs().max() > 0  # a real mean, rounded
    assert torch.isnan(out[[1, 3, 5, 6, 7, 8]].float()).all() and not torch.isnan(out[[0, 2, 4, 9]].float()).any()
    # skip: the pool's spare slot; items given it (no chunk completed) write nothing, the others as before
    out2 = torch.full((10, 3, 40), NAN).bfloat16()
    ko.chunk_mean_run(src, ids, dst, out2, skip=9)
    assert torch.isnan(out2[[1, 3, 5, 6, 7, 8, 9]].float()).all()
    assert torch.equal(out2[[0, 2, 4]], out[[0, 2, 4]])
    with pytest.raises(ValueError, match="rows of 120 elements"):
        ko.chunk_mean_run(src, ids, dst, torch.zeros(10, 3, 41).bfloat16())


def test_a_request_short_of_pages_reads_the_spare_row_never_another_rows_or_outside():
    """If a grant had found the pool short (the sizing rules it out; counted
    as an overflow), the selected rows with no slot point at the spare row:
    not at another request's rows (``table`` -1 made ``base - page`` before)."""
    B, MAXK, HN, PAGE, rows = 1, 8, 16, 4, 3
    sel = torch.arange(8, dtype=torch.int32).view(1, 8) + 10
    k = torch.tensor([6], dtype=torch.int32)
    s_eff, w_eff = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    att_indptr = torch.tensor([0, 6], dtype=torch.int32)
    r2t = torch.arange(rows * 40, dtype=torch.int32).view(rows, 40) + 1
    table = torch.full((rows, 4), -1, dtype=torch.int32)
    table[1, 0] = 2  # row 1 holds one page (4 slots) for a selection of 6
    count = torch.tensor([0, 1, 0], dtype=torch.int32)
    att_k, att_v = torch.full((7,), -5, dtype=torch.int32), torch.full((7,), -5, dtype=torch.int32)
    ms, md, mc = torch.full((1, MAXK), -1, dtype=torch.int32), torch.full((1, MAXK), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    ko.swap_in_run(sel, k, s_eff, w_eff, att_indptr, torch.tensor([30], dtype=torch.int32), torch.tensor([1], dtype=torch.int32), r2t,
                   torch.full((200,), -1, dtype=torch.int16), torch.full((rows, HN), -1, dtype=torch.int32),
                   torch.full((rows, HN), -1, dtype=torch.int32), torch.zeros(1, HN, dtype=torch.int32), att_k, att_v, ms, md, mc,
                   torch.zeros(2, dtype=torch.int64), MAXK, table, count, 6, PAGE, spare_row=99)
    placed = [int(x) for x in att_v[:6]]
    assert sorted(placed[:4]) == [6 + 2 * 4 + j for j in range(4)] and placed[4:] == [99, 99]  # 4 slots, then the spare
    assert int(mc[0]) == 4 and sorted(md[0, :4].tolist()) == sorted(placed[:4])


_SM90_COMPILE = r"""
import sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sglang_elastic.kernels import offload as ko
from sglang_elastic.kernels import decode_attention as da

def sig(fn, ptrs, cx):
    return {n: ptrs.get(n, "*i32" if n.endswith("_ptr") else "i64" if n in ("hot_base", "spare_row", "stride_hint_r") else "i32")
            for n in fn.arg_names if n not in cx}

cases = [
    (ko._page_grant_kernel, {}, dict(HN=4096, PAGE=64, SLACK64=128, BLOCK=64, PER_ROW=True)),
    (ko._page_adapt_kernel, {}, dict(HN=4096, PAGE=64, BASE64=128, MAX64=256, GROW64=4)),
    (ko._page_shrink_kernel, {}, dict(HN=4096, PAGE=64, BASE64=128, BLOCK=64, BLOCK_S=1024)),
    (ko._store_sparse_kernel, {"k_ptr": "*bf16", "v_ptr": "*bf16", "kdst_ptr": "*bf16", "host_ptr": "*bf16", "vdst_ptr": "*bf16",
                               "loc_ptr": "*i64", "vrow_ptr": "*i64", "keep_ptr": "*i64"},
     dict(KROW=1024, VROW=1024, BLOCK_K=1024, BLOCK_V=1024, BLOCK_R=4, VROWS=True, KEEP=True, SUM=False, C=16, HOST=True)),
    (ko._store_sparse_kernel, {"k_ptr": "*bf16", "v_ptr": "*bf16", "kdst_ptr": "*bf16", "host_ptr": "*bf16", "vdst_ptr": "*bf16",
                               "loc_ptr": "*i64", "vrow_ptr": "*i64", "keep_ptr": "*i64", "ssrc_ptr": "*i64", "sdst_ptr": "*i64",
                               "vsum_ptr": "*bf16"},
     dict(KROW=1024, VROW=1024, BLOCK_K=1024, BLOCK_V=1024, BLOCK_R=4, VROWS=True, KEEP=True, SUM=True, C=16, HOST=False)),
    (ko._store_sparse_kernel, {"k_ptr": "*bf16", "v_ptr": "*bf16", "kdst_ptr": "*bf16", "host_ptr": "*bf16", "vdst_ptr": "*bf16",
                               "loc_ptr": "*i64", "vrow_ptr": "*i64", "keep_ptr": "*i64", "ssrc_ptr": "*i64", "sdst_ptr": "*i64",
                               "vsum_ptr": "*bf16"},
     dict(KROW=1024, VROW=1024, BLOCK_K=1024, BLOCK_V=1024, BLOCK_R=4, VROWS=True, KEEP=False, SUM=True, C=16, HOST=True)),
    (ko._swap_in_kernel, {"loc_slot_ptr": "*i16", "stats_ptr": "*i64"}, dict(HN=4096, BLOCK_K=2048, BLOCK_H=4096, PAGE=64, SPEC=False, LFU=False)),
    (ko._swap_in_kernel, {"loc_slot_ptr": "*i16", "stats_ptr": "*i64"}, dict(HN=4096, BLOCK_K=2048, BLOCK_H=4096, PAGE=64, SPEC=True, LFU=True)),
    (ko._swap_in_kernel, {"loc_slot_ptr": "*i16", "stats_ptr": "*i64"}, dict(HN=4096, BLOCK_K=2048, BLOCK_H=4096, PAGE=64, SPEC=False, LFU=False,
                                                                           HINT_ROW=True)),
    (ko._chunk_mean_kernel, {"src_ptr": "*bf16", "ids_ptr": "*i64", "dst_ptr": "*i64", "out_ptr": "*bf16"}, dict(C=16, ROW=1024, BLOCK_ROW=1024)),
    (ko._row_plan_kernel, {"keep_rows_ptr": "*i64", "sum_src_ptr": "*i64", "sum_chunk_ptr": "*i64"},
     dict(C=16, DENSE=True, SUMMARY=True, RING=False, SINK=0, WINDOW=1, REGION=1)),
    (ko._row_plan_kernel, {"keep_rows_ptr": "*i64", "sum_src_ptr": "*i64", "sum_chunk_ptr": "*i64"},
     dict(C=16, DENSE=False, SUMMARY=True, RING=True, SINK=4, WINDOW=32, REGION=36)),
    (ko._lse_merge_kernel, {"mid_lse_ptr": "*fp32", "out_ptr": "*fp32"}, dict(HQ=32, BLOCK_HQ=32, BLOCK_S=32, BUMP=True)),
    (ko._select_write_kernel, {"p_ptr": "*fp32"}, dict(COUNT=False, BLOCK_N=512, PARTS=16, MARK=True)),
    (ko._select_write_kernel, {"p_ptr": "*fp32"}, dict(COUNT=False, BLOCK_N=512, PARTS=16, MARK=False, mark_ptr=None, stamp_ptr=None)),
    (ko._select_write_kernel, {"p_ptr": "*fp32"}, dict(COUNT=True, BLOCK_N=512, PARTS=16, MARK=False, mark_ptr=None, stamp_ptr=None)),
    (ko._select_hist_kernel, {"scores_ptr": "*fp32", "lse_ptr": "*fp32", "p_ptr": "*fp32"}, dict(PASS=0, HQ=32, BLOCK_HQ=32, BLOCK_N=512, PARTS=16)),
    (ko._select_hist_kernel, {"scores_ptr": "*fp32", "lse_ptr": "*fp32", "p_ptr": "*fp32"}, dict(PASS=2, HQ=32, BLOCK_HQ=32, BLOCK_N=512, PARTS=16)),
    (ko._estimate_kernel, {"scores_ptr": "*fp32", "lse_ptr": "*fp32", "vsum_ptr": "*bf16", "out_ptr": "*fp32"},
     dict(C=16, G=4, BLOCK_G=4, D=128, BLOCK_D=128, BLOCK_CH=16)),
    (da._merge_kernel, {"mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "o_ptr": "*bf16", "lse_full_ptr": "*fp32", "extra_ptr": "*fp32"},
     dict(D=128, BLOCK_D=128, SEGMENTED=False, BLOCK_S=32, PDL=False, FULL_LSE=True, GUARD_ROWS=False, EXTRA=True, EXTRA_CNT=True)),
]
for fn, ptrs, cx in cases:
    k = triton.compile(ASTSource(fn=fn, signature=sig(fn, ptrs, cx), constexprs=cx), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = k.asm["ptx"]
    print(fn.__name__, "atom.global" in ptx or "atom." in ptx, "ld.global" in ptx)
"""


def test_the_new_offload_kernels_compile_for_sm90():
    """The page grant (its compare-and-swap loop), the adaptive pages' demand and
    give-back, the one-launch KV write (also with the chunk means fused, from the
    kept or ring rows, and without its host write), the paged swap-in, the chunk
    means, the decode plan's per-request entries, the stamping lse merge and top-k, the estimate and the merge that
    adds its share compile for the H200 (sm_90) without a
    GPU: the interpreter runs Python, not the compiler that a device call
    would meet first."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _SM90_COMPILE, str(Path(__file__).parents[1])], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()}
    assert rows["_page_grant_kernel"] == ["True", "True"]  # the CAS is there, and the stack loads
    assert rows["_page_shrink_kernel"][0] == "True" and rows["_page_adapt_kernel"][0] == "True"  # the pushes and the demand
    assert set(rows) == {"_page_grant_kernel", "_page_adapt_kernel", "_page_shrink_kernel", "_store_sparse_kernel", "_swap_in_kernel",
                         "_chunk_mean_kernel", "_row_plan_kernel", "_lse_merge_kernel", "_select_write_kernel", "_estimate_kernel",
                         "_merge_kernel", "_select_hist_kernel"}


def test_the_mark_stamp_wraps_without_ever_being_zero():
    """The stamp the lse merge bumps (one per sparse layer and step) is an
    int32: after 2**31 bumps it wraps to negative values, and it skips 0, the
    value of a position never marked, which would otherwise read as attended."""
    mid = torch.randn(8, 3)
    for before, after in ((-1, 1), (2**31 - 1, -2**31), (5, 6)):
        st = torch.tensor([before], dtype=torch.int32)
        ko.lse_merge(mid, 4, 2, stamp=st)
        assert int(st) == after


@pytest.mark.parametrize("keep", [False, True])
def test_store_sparse_writes_k_host_v_and_the_device_rows_of_each_token(keep):
    g = torch.Generator().manual_seed(11)
    n, slots, rows = 7, 60, 30
    qkv = torch.randn(n, 3, 2, 64, generator=g).bfloat16()  # K and V as views of a fused output (row stride 384)
    ck, cv = qkv[:, 1], qkv[:, 2]
    kd = torch.full((slots, 2, 64), NAN).bfloat16()
    host = torch.full((slots, 2, 64), NAN).bfloat16()
    vd = torch.full((rows, 2, 64), NAN).bfloat16()
    loc = torch.tensor([3, 59, 0, 17, -1, 40, 8], dtype=torch.int64)
    vr = torch.tensor([2, -1, 29, 5, 6, -1, 0], dtype=torch.int32)
    kr = torch.tensor([-1, 11, 12, -1, 13, -1, 1], dtype=torch.int64) if keep else None
    ko.store_sparse_run(ck, cv, kd, host, vd, loc, vr, kr)
    written = set()
    for i in range(n):
        if loc[i] >= 0:
            assert torch.equal(kd[loc[i]], ck[i]) and torch.equal(host[loc[i]], cv[i])
        for idx in (vr, kr):
            if idx is not None and idx[i] >= 0:
                assert torch.equal(vd[idx[i]], cv[i])
                written.add(int(idx[i]))
    used = set(loc[loc >= 0].tolist())
    assert torch.isnan(kd[[i for i in range(slots) if i not in used]].float()).all()
    assert torch.isnan(host[[i for i in range(slots) if i not in used]].float()).all()
    assert torch.isnan(vd[[i for i in range(rows) if i not in written]].float()).all()
    assert len(written) == (9 if keep else 5)
    with pytest.raises(ValueError, match="host_v"):
        ko.store_sparse_run(ck, cv, kd, torch.zeros(4, 2, 32).bfloat16(), vd, loc)
    with pytest.raises(ValueError, match="v_rows has 3 rows"):
        ko.store_sparse_run(ck, cv, kd, host, vd, loc, vr[:3])


def test_store_sparse_fuses_the_completed_chunk_means_bit_equal_to_chunk_mean_run():
    """``store_sparse_run(summary=...)`` (a decode step's V write and its completed chunk means in
    one launch): each completing token's mean is its chunk's first C - 1 rows from where they are
    stored on the GPU (here kept rows) and its own V, bit-equal to ``chunk_mean_run`` over the same
    rows once stored, within a bf16 step of the float64 mean; a token that completes nothing (the
    spare row) writes nothing; a chunk that is not a power of two is refused."""
    g = torch.Generator().manual_seed(12)
    n, slots, rows, C, S = 5, 120, 120, 8, 6  # S: the spare summary row
    ck, cv = torch.randn(n, 2, 32, generator=g).bfloat16(), torch.randn(n, 2, 32, generator=g).bfloat16()
    kd = torch.zeros(slots, 2, 32).bfloat16()
    host = torch.randn(slots, 2, 32, generator=g).bfloat16()
    vd = torch.randn(rows, 2, 32, generator=g).bfloat16()
    loc = torch.tensor([3, 50, 7, 19, 44], dtype=torch.int64)
    keep = torch.tensor([50, 51, 52, 53, 54], dtype=torch.int64)
    # each token's chunk: C - 1 older rows (distinct, not this step's), then the token's own row
    older = torch.randperm(35, generator=g)[: n * (C - 1)].view(n, C - 1) + 55  # rows 55..89: none the launch's stores write
    src = torch.cat([older, keep[:, None]], 1)
    dst = torch.tensor([2, S, 0, S, 4])
    out = torch.full((S + 1, 2, 32), NAN).bfloat16()
    ko.store_sparse_run(ck, cv, kd, host, vd, loc, None, keep, summary=(src, dst, out, S))
    ref = torch.full_like(out, NAN)
    ko.chunk_mean_run(vd, src, dst, ref, skip=S)  # the same rows, now stored
    base = vd
    for i in (0, 2, 4):
        assert torch.equal(out[int(dst[i])], ref[int(dst[i])])
        want = base[src[i]].double().mean(0)
        assert ((out[int(dst[i])].double() - want).abs() <= want.abs() * 2 ** -7 + 1e-6).all()
    assert torch.isnan(out[[1, 3, 5, 6]].float()).all()  # the spare row and the rows no chunk names
    with pytest.raises(ValueError, match="chunk 6 is not a power of two"):
        ko.store_sparse_run(ck, cv, kd, host, vd, loc, summary=(src[:, :6], dst, out, S))


def test_row_plan_writes_the_dense_entries_and_the_completed_chunks_as_the_torch_ops_did():
    """``row_plan_run`` (one launch for a decode plan's per-request entries) against the PyTorch
    ops it replaced, on lengths 1 (a CUDA-graph padding entry), below the chunk, at and past
    multiples of it: the all-dense entries and ``estimate``'s chunk rows, bit-equal; rows past the
    batch untouched; a non-contiguous ``sum_src`` refused."""
    g = torch.Generator().manual_seed(13)
    C, rows, ctx = 8, 6, 70
    lens = torch.tensor([1, 5, 8, 16, 23, 64, 70], dtype=torch.int32)
    rp = torch.tensor([0, 3, 1, 5, 2, 4, 1], dtype=torch.int32)
    B = lens.shape[0]
    table = torch.randint(0, 10_000, (rows, ctx), generator=g, dtype=torch.int32)
    vrow = torch.randint(0, 10_000, (rows, ctx), generator=g, dtype=torch.int32)
    i32 = dict(dtype=torch.int32)
    s_eff, w_eff, k, dl = (torch.full((B + 2,), 7, **i32) for _ in range(4))
    keep_rows = torch.full((B + 2,), -9, dtype=torch.int64)
    src, chunk = torch.full((B + 2, C), -9, dtype=torch.int64), torch.full((B + 2,), -9, dtype=torch.int64)
    valid = torch.full((B + 2,), -9, **i32)
    ko.row_plan_run(lens, rp, dense=(vrow, s_eff, w_eff, k, dl, keep_rows), summary=(table, src, chunk, valid))
    L64, r64 = lens.to(torch.int64), rp.to(torch.int64)
    assert (s_eff[:B] == 0).all() and (w_eff[:B] == 0).all() and (k[:B] == 0).all() and torch.equal(dl[:B], lens)
    assert torch.equal(keep_rows[:B], vrow[r64, torch.clamp(L64 - 1, min=0)].to(torch.int64))
    pos = torch.clamp(L64[:, None] - C + torch.arange(C)[None, :], min=0)
    assert torch.equal(src[:B], table[r64[:, None], pos].to(torch.int64))
    assert torch.equal(chunk[:B], torch.clamp(L64 // C - 1, min=0))
    assert valid[:B].tolist() == [0, 0, 1, 1, 0, 1, 0]
    for t, fill in ((s_eff, 7), (dl, 7), (keep_rows, -9), (chunk, -9), (valid, -9)):
        assert (t[B:] == fill).all()
    assert (src[B:] == -9).all()
    src2 = torch.full((B, C), -9, dtype=torch.int64)  # the summary alone (a general step): the dense entries untouched
    s_eff.fill_(7)
    ko.row_plan_run(lens, rp, summary=(table, src2, chunk, valid))
    assert torch.equal(src2, src[:B]) and (s_eff == 7).all()
    # a sparse step's chunk rows on the device: each position's sink row, or its ring row (fixed_entries_run's)
    sink, window, region = 4, 16, 40
    src3 = torch.full((B, C), -9, dtype=torch.int64)
    ko.row_plan_run(lens, rp, summary=(None, src3, chunk, valid), ring=(sink, window, region))
    assert torch.equal(src3, r64[:, None] * region + torch.where(pos < sink, pos, sink + pos % window))
    assert src3[1].tolist() == [3 * 40 + p for p in (0, 0, 0, 0, 1, 2, 3)] + [3 * 40 + 4 + 4]  # length 5: positions 0..4
    with pytest.raises(ValueError, match="contiguous"):
        ko.row_plan_run(lens, rp, summary=(table, torch.zeros(C, B, dtype=torch.int64).t(), chunk, valid))
    with pytest.raises(ValueError, match="window of at least one"):
        ko.row_plan_run(lens, rp, summary=(None, src3, chunk, valid), ring=(4, 0, region))


class _Adapt:
    """One pool's hot pages with the adaptive slack (``page_adapt_run``) on CPU tensors."""

    def __init__(self, rows=6, NP=40, HN=64, PAGE=8, layers=3, base=128, top64=256, reserve=4):
        self.HN, self.PAGE, self.NP, self.base, self.top64, self.reserve = HN, PAGE, NP, base, top64, reserve
        i32 = dict(dtype=torch.int32)
        self.table = torch.full((rows, -(-HN // PAGE)), -1, **i32)
        self.count = torch.zeros(rows, **i32)
        self.stack = torch.arange(NP, **i32)
        self.top = torch.tensor([NP], **i32)
        self.over = torch.zeros(1, **i32)
        self.slack = torch.full((rows,), base, **i32)
        self.steps, self.miss, self.sel = (torch.zeros(rows, **i32) for _ in range(3))
        self.demand, self.taken = torch.zeros(1, **i32), torch.zeros(1, **i32)
        g = torch.Generator().manual_seed(rows * NP)
        self.slot_pos = torch.randint(0, 1000, (layers, rows, HN), generator=g, dtype=torch.int32)  # stand-in LRU state
        self.slot_time = torch.randint(0, 1000, (layers, rows, HN), generator=g, dtype=torch.int32)

    def need(self, k, slack64):
        return -(-min(-(-k * slack64 // 64), self.HN) // self.PAGE)

    def step(self, rows, k, miss=None):
        if miss is not None:  # the previous step's swap-in record of these rows
            for r, kk, m in zip(rows, k, miss):
                self.sel[r], self.miss[r] = kk, m
        ko.page_adapt_run(torch.tensor(rows, dtype=torch.int32), torch.tensor(k, dtype=torch.int32), self.table, self.count,
                          self.stack, self.top, self.over, self.HN, self.PAGE, self.base, self.top64, self.slack, self.steps,
                          self.miss, self.sel, self.demand, self.taken, self.slot_pos, self.slot_time, reserve=self.reserve)

    def check_owned(self):
        held = self.table[self.table >= 0].tolist()
        free = self.stack[: int(self.top)].tolist()
        assert len(held) == len(set(held)) and set(free).isdisjoint(held) and sorted(free + held) == list(range(self.NP))
        for r in range(self.table.shape[0]):
            c = int(self.count[r])
            assert (self.table[r, :c] >= 0).all() and (self.table[r, c:] == -1).all()


def test_adaptive_pages_grow_while_the_selection_misses_and_come_back_when_the_pool_runs_short():
    a = _Adapt(reserve=8)
    a.step([0, 1], [6, 6])  # base: ceil(12 / 8) = 2 pages each
    assert a.count.tolist()[:2] == [2, 2] and int(a.top) == 36
    a.step([0, 1], [6, 6], miss=[6, 6])  # second step: not judged yet (the first step's misses are cold ones)
    assert a.slack.tolist()[:2] == [128, 128]
    a.step([0, 1], [6, 6], miss=[3, 0])  # row 0 missed half: slack 3 -> ceil(18 / 8) = 3 pages; row 1 hit all
    assert a.slack.tolist()[:2] == [192, 128] and a.count.tolist()[:2] == [3, 2]
    a.step([0, 1], [6, 6], miss=[1, 0])  # 1/6 >= 1/16: slack 4 (the most): 3 pages for 24 rows
    a.step([0, 1], [6, 6], miss=[1, 0])
    assert a.slack.tolist()[:2] == [256, 128] and a.count.tolist()[:2] == [3, 2] and int(a.top) == 35
    before = a.slot_pos.clone(), a.slot_time.clone()
    # four new requests of 64 rows (8 pages each at the base) ask for 32 of the 35 free: under demand + reserve // 2 (36),
    # so row 0 gives back its third page (slots 16..23 forgotten in every layer) before the base grants run, and does not
    # grow again into the 4 left (under the reserve of 8)
    a.step([0, 1, 2, 3, 4, 5], [6, 6, 32, 32, 32, 32], miss=[1, 0, 0, 0, 0, 0])
    assert a.count.tolist() == [2, 2, 8, 8, 8, 8] and int(a.over) == 0 and int(a.taken) == 1 and int(a.top) == 4
    assert a.slack[0] == 128
    assert (a.slot_pos[:, 0, 16:24] == -1).all() and (a.slot_time[:, 0, 16:24] == -1).all()
    keep = torch.ones_like(a.slot_pos, dtype=torch.bool)
    keep[:, 0, 16:24] = False
    assert torch.equal(a.slot_pos[keep], before[0][keep]) and torch.equal(a.slot_time[keep], before[1][keep])
    a.check_owned()
    steps = a.steps.clone()
    a.step([0, 1, 2, 3, 4, 5], [0, 6, 32, 32, 32, 32])  # row 0 attends densely this step (k = 0, keep-v): not a sparse step
    assert a.steps[0] == steps[0] and a.steps[1] == steps[1] + 1
    with pytest.raises(ValueError, match="below the base slack"):
        ko.page_adapt_run(torch.tensor([0], dtype=torch.int32), torch.tensor([1], dtype=torch.int32), a.table, a.count, a.stack,
                          a.top, a.over, a.HN, a.PAGE, 128, 64, a.slack, a.steps, a.miss, a.sel, a.demand, a.taken,
                          a.slot_pos, a.slot_time, reserve=0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=6, unique=True),
                          st.lists(st.integers(0, 12), min_size=6, max_size=6),
                          st.lists(st.integers(0, 12), min_size=6, max_size=6),
                          st.booleans()), min_size=1, max_size=12))
def test_adaptive_pages_never_lose_a_page_nor_short_a_base_grant(steps):
    """Random decode batches (requests join, grow, miss at random, finish): every page is owned once
    or free, no base grant overflows (the pool holds the base need of every row), growth
    leaves the reserve free, and a row never holds more than its slack allows."""
    a = _Adapt(NP=6 * 4, HN=32, PAGE=8, reserve=4)  # the base need of 6 rows at k <= 16 is at most 4 pages each
    k = [0] * 6
    for rows, grow, miss, finish in steps:
        # SGLang's decode batch holds every running request: every row that holds pages, and the new ones
        rows = sorted(set(rows) | {r for r in range(6) if int(a.count[r]) > 0})
        for r in rows:
            k[r] = min(16, k[r] + grow[r])
        before = a.count.clone()
        a.step(rows, [k[r] for r in rows], miss=[min(miss[r], k[r]) for r in rows])
        a.check_owned()
        assert int(a.over) == 0
        for r in rows:
            assert a.need(k[r], a.base) <= int(a.count[r]) <= max(a.need(k[r], int(a.slack[r])), a.need(k[r], a.base))
        grew = any(int(a.count[r]) > max(int(before[r]), a.need(k[r], a.base)) for r in rows)
        assert not grew or int(a.top) >= a.reserve  # growth (after the base grants) never cut into the reserve
        if finish:  # the first row of the batch finishes: its pages go back, its history is cleared
            r = rows[0]
            ko.slot_release_run(torch.tensor([r]), a.table, a.count, a.stack, a.top, -1)
            a.slack[r], a.steps[r], a.miss[r], a.sel[r], k[r] = a.base, 0, 0, 0, 0
            a.check_owned()

