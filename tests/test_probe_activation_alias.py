"""The CPU half of ``scripts/gpu/probe_activation_alias.py``: its range allocator (what torch's
pluggable allocator calls for the pool's segments) and its refusal without a GPU."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_scripts import load_script

MiB = 1 << 20


def test_the_range_allocator_fits_first_rounds_to_2_mib_coalesces_and_refuses_what_does_not_fit():
    probe = load_script("probe_activation_alias")
    base = 7 << 30
    ra = probe.RangeAllocator(base, 64 * MiB)
    a = ra.alloc(3 * MiB, 0, None)  # rounded to 4 MiB
    b = ra.alloc(1, 0, None)  # 2 MiB
    c = ra.alloc(10 * MiB, 0, None)
    assert (a, b, c) == (base, base + 4 * MiB, base + 6 * MiB)
    ra.free(b, 1, 0, None)
    assert ra.alloc(2 * MiB, 0, None) == b  # the hole is reused first
    ra.free(a, 3 * MiB, 0, None)
    ra.free(b, 2 * MiB, 0, None)
    assert ra.free_ranges[0] == (base, 6 * MiB)  # a and b merged
    assert ra.alloc(60 * MiB, 0, None) == 0 and ra.refused == 1  # 6 + 48 MiB free, not in one piece
    ra.free(c, 10 * MiB, 0, None)
    assert ra.free_ranges == [(base, 64 * MiB)] and not ra.live
    assert (ra.calls, ra.frees) == (5, 4)


def test_random_allocations_never_overlap_and_all_frees_restore_the_range():
    probe = load_script("probe_activation_alias")
    rng = random.Random(1234)
    base, size = 1 << 40, 256 * MiB
    ra = probe.RangeAllocator(base, size)
    live = {}
    for _ in range(400):
        if live and rng.random() < 0.45:
            p = rng.choice(sorted(live))
            ra.free(p, live.pop(p), 0, None)
        else:
            n = rng.randint(1, 24 * MiB)
            p = ra.alloc(n, 0, None)
            if p:
                live[p] = n
        spans = sorted((p, ra.live[p]) for p in live)
        assert all(base <= p and p + s <= base + size for p, s in spans)
        assert all(p1 + s1 <= p2 for (p1, s1), (p2, _) in zip(spans, spans[1:]))
        assert sum(s for _, s in ra.free_ranges) + sum(ra.live.values()) == size
    for p in sorted(live):
        ra.free(p, live[p], 0, None)
    assert ra.free_ranges == [(base, size)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_without_a_gpu_the_probe_measures_nothing_and_writes_nothing(tmp_path, capsys):
    probe = load_script("probe_activation_alias")
    out = tmp_path / "probe.json"
    assert probe.main(["--out", str(out)]) == 2
    assert not out.exists()
    assert "no CUDA device" in capsys.readouterr().err
    assert probe.main(["--cycles", "0", "--out", str(out)]) == 2 and not out.exists()
    assert "--cycles must be at least 1" in capsys.readouterr().err
