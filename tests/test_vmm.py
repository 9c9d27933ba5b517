"""VMM primitives and the elastic arena, on real mmap reservations."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_elastic.vmm import ElasticArena, HostBackend, VmmError, token_quantum

GRAN = 64 * 1024
ROWS = [2048] * 6 + [1024] * 2  # six K/V buffers of Hkv*d*2 bytes/token, two narrower ones


def pattern(buffer: int, token: int, size: int, salt: int = 0) -> bytes:
    seed = (buffer * 1_000_003 + token * 7919 + salt) & 0xFFFFFFFF
    return bytes(((seed >> (8 * (k % 4))) + k) & 0xFF for k in range(size))


def test_token_quantum_makes_every_buffer_granule_aligned():
    q = token_quantum([2048, 1024, 3 * 1024], 2 * 1024 * 1024, page_size=16)
    assert q % 16 == 0
    for r in (2048, 1024, 3 * 1024):
        assert q * r % (2 * 1024 * 1024) == 0
    # and it is the smallest such count
    smallest = next(t for t in range(16, q + 1, 16) if all(t * r % (2 << 20) == 0 for r in (2048, 1024, 3072)))
    assert smallest == q == 2048


def test_geometry_rounds_base_down_and_elastic_to_whole_steps():
    be = HostBackend(granularity=GRAN)
    a = ElasticArena(be, ROWS, base_tokens=1000, max_elastic_tokens=300, step_tokens=50)
    try:
        assert a.quantum == 64  # 64 KiB / 1024 B
        assert a.base_tokens == 960 and a.step_tokens == 64
        assert (a.max_steps, a.max_elastic_tokens) == (4, 256)
        assert a.capacity_tokens == 960 and a.lent_tokens == 0
        # buffers are disjoint and granule aligned
        for va, span in zip(a.buffer_va, a.spans):
            assert va % GRAN == 0 and span % GRAN == 0
        assert all(a.buffer_va[i] + a.spans[i] <= a.buffer_va[i + 1] for i in range(len(ROWS) - 1))
    finally:
        a.close()
    assert be.live_handles == 0


def test_one_handle_per_step_is_mapped_at_offsets_into_every_buffer():
    be = HostBackend(granularity=GRAN)
    a = ElasticArena(be, ROWS, base_tokens=640, max_elastic_tokens=256, step_tokens=128)
    try:
        creates = be.calls["create"]
        assert a.lend() == 2
        assert be.calls["create"] - creates == 2  # one handle per step, not per buffer
        assert be.calls["map"] == 3 * len(ROWS)  # base + 2 steps, each mapped into every buffer
        assert a.lent_bytes == 2 * 128 * sum(ROWS)
    finally:
        a.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["lend", "reclaim", "write"]), st.integers(0, 4), st.integers(0, 10**9)), min_size=1, max_size=30))
def test_lend_reclaim_sequences_keep_base_and_lent_bytes(ops):
    """Property: whatever the sequence, the base tokens keep their bytes, lent
    tokens keep theirs while lent, and no handle leaks."""
    be = HostBackend(granularity=GRAN)
    a = ElasticArena(be, ROWS, base_tokens=256, max_elastic_tokens=4 * 64, step_tokens=64)
    written = {}  # (buffer, token) -> bytes
    try:
        for op, n, r in ops:
            if op == "lend":
                a.lend(n)
            elif op == "reclaim":
                a.reclaim(n)
                written = {k: v for k, v in written.items() if k[1] < a.capacity_tokens}
            else:
                b, tok = r % len(ROWS), (r // 7) % a.capacity_tokens
                data = pattern(b, tok, ROWS[b], salt=r)
                be.write(a.token_va(b, tok), data)
                written[(b, tok)] = data
            assert be.live_handles == 1 + a.lent_steps
            assert a.capacity_tokens == a.base_tokens + a.lent_steps * a.step_tokens
            for (b, tok), data in written.items():
                assert be.read(a.token_va(b, tok), len(data)) == data
    finally:
        a.close()
    assert be.live_handles == 0


def test_a_reclaimed_token_is_unmapped_and_relending_gives_fresh_zeroed_memory():
    be = HostBackend(granularity=GRAN)
    a = ElasticArena(be, ROWS, base_tokens=128, max_elastic_tokens=128, step_tokens=128)
    try:
        a.lend()
        top = a.token_va(2, a.base_tokens + 5)
        be.write(top, b"\xab" * 64)
        a.reclaim()
        a.lend()
        assert be.read(top, 64) == b"\x00" * 64
    finally:
        a.close()


def test_touching_reclaimed_memory_faults_like_the_gpu_would():
    code = (
        "from sglang_elastic.vmm import ElasticArena, HostBackend\n"
        "be = HostBackend(granularity=65536)\n"
        "a = ElasticArena(be, [2048] * 4, base_tokens=64, max_elastic_tokens=64, step_tokens=64)\n"
        "a.lend(); a.reclaim()\n"
        "print('reading', flush=True)\n"
        "be.read(a.token_va(0, a.base_tokens), 16)\n"
        "print('read an unmapped page')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "reading" in r.stdout and "read an unmapped page" not in r.stdout
    assert r.returncode < 0 or r.returncode == -11 or r.returncode == 139


@pytest.mark.parametrize("fail_call", [1, 3, 8])
def test_a_failing_map_rolls_the_step_back_and_keeps_earlier_steps(fail_call):
    be = HostBackend(granularity=GRAN)
    a = ElasticArena(be, ROWS, base_tokens=128, max_elastic_tokens=3 * 64, step_tokens=64)
    try:
        assert a.lend(1) == 1
        base_maps = be.calls["map"]
        be.fail_on["map"] = lambda n: n == base_maps + fail_call
        be.write(a.token_va(0, 3), b"keep")
        with pytest.raises(VmmError, match="map failed: injected"):
            a.lend()
        assert a.lent_steps == 1 and be.live_handles == 2  # base + the step lent before
        assert be.read(a.token_va(0, 3), 4) == b"keep"
        assert a.lending_disabled
        be.fail_on.clear()
        assert a.lend() == 0 and a.lent_steps == 1  # disabled until the owner decides
        assert a.reclaim() == 1 and be.live_handles == 1
    finally:
        a.close()
    assert be.live_handles == 0


def test_out_of_memory_ends_the_lend_but_does_not_disable_lending():
    be = HostBackend(granularity=GRAN, fail_on={"create": lambda n: "oom" if n == 2 else False})
    a = ElasticArena(be, ROWS, base_tokens=128, max_elastic_tokens=64, step_tokens=64)
    try:
        with pytest.raises(VmmError) as err:
            a.lend()
        assert err.value.out_of_memory and not a.lending_disabled
        assert a.lend() == 1  # memory came back: lending works again
    finally:
        a.close()


def test_default_step_is_the_whole_reserve_even_when_it_is_not_a_quantum_multiple():
    be = HostBackend(granularity=GRAN)
    a = ElasticArena(be, ROWS, base_tokens=128, max_elastic_tokens=100)  # quantum 64
    try:
        assert (a.max_steps, a.step_tokens, a.max_elastic_tokens) == (1, 64, 64)
    finally:
        a.close()


def test_host_backend_enforces_cuda_mapping_rules():
    be = HostBackend(granularity=GRAN, offset_mapping=False)
    va = be.reserve(4 * GRAN)
    h = be.create(2 * GRAN)
    with pytest.raises(VmmError, match="nonzero handle offset"):
        be.map(va, GRAN, h, offset=GRAN)
    be.map(va, 2 * GRAN, h)
    with pytest.raises(VmmError, match="already mapped"):
        be.map(va + GRAN, GRAN, h)
    with pytest.raises(VmmError, match="whole mappings"):
        be.unmap(va, GRAN)
    with pytest.raises(VmmError, match="still has mappings"):
        be.free_va(va, 4 * GRAN)
    be.unmap(va, 2 * GRAN)
    be.release(h)
    be.free_va(va, 4 * GRAN)


def test_a_failing_create_leaves_nothing_behind():
    be = HostBackend(granularity=GRAN, fail_on={"create": lambda n: n == 2})
    a = ElasticArena(be, ROWS, base_tokens=128, max_elastic_tokens=64, step_tokens=64)
    try:
        with pytest.raises(VmmError, match="create failed"):
            a.lend()
        assert a.lent_steps == 0 and be.live_handles == 1
    finally:
        a.close()


def test_a_failing_unmap_still_drops_the_step_and_reports():
    be = HostBackend(granularity=GRAN)
    a = ElasticArena(be, ROWS, base_tokens=128, max_elastic_tokens=2 * 64, step_tokens=64)
    try:
        a.lend()
        be.fail_on["unmap"] = lambda n: n == 1
        with pytest.raises(VmmError, match="unmap failed"):
            a.reclaim()
        assert a.lent_steps == 0 and be.live_handles == 1
        assert a.lending_disabled and a.lend() == 0
    finally:
        a.close()


def test_a_failing_base_mapping_frees_the_reservation():
    be = HostBackend(granularity=GRAN, fail_on={"map": lambda n: n == 4})
    with pytest.raises(VmmError):
        ElasticArena(be, ROWS, base_tokens=128, max_elastic_tokens=64)
    assert be.live_handles == 0 and be.calls["free_va"] == 1


def test_host_backend_rejects_misaligned_requests():
    be = HostBackend(granularity=GRAN)
    with pytest.raises(VmmError, match="not a multiple of the granularity"):
        be.create(GRAN + 4096)
    with pytest.raises(ValueError):
        HostBackend(granularity=os.sysconf("SC_PAGE_SIZE") + 1)


def test_a_handle_whose_release_failed_in_a_reclaim_is_released_by_close():
    """Issue 22, defect 4: a failed cuMemRelease in a reclaim left the handle
    alive after close() (failed releases were not retried)."""
    be = HostBackend(granularity=GRAN)
    a = ElasticArena(be, ROWS, base_tokens=128, max_elastic_tokens=64, step_tokens=64)
    a.lend()
    be.fail_on["release"] = lambda n: n == 1
    with pytest.raises(VmmError, match="release failed"):
        a.reclaim()
    assert a.lent_steps == 0 and a.lending_disabled
    assert be.live_handles == 2  # the base's handle and the one whose release failed
    be.fail_on.clear()
    a.close()
    assert be.live_handles == 0


def test_an_out_of_memory_whose_rollback_unmap_fails_is_recorded_and_cleaned_up_by_close():
    """Issue 22, defect 4: out of memory in handle creation whose rollback
    unmap also failed left the mapping unrecorded: the next lend failed with
    'range already mapped', close() with 'range still has mappings'. Here
    one handle per buffer (the H200's case). Since build 2 a step creates
    all its handles before it maps any, so an out of memory in creation
    leaves nothing to unmap; a failing map whose rollback unmap fails is
    the remaining case, and it is recorded."""
    be = HostBackend(granularity=GRAN, offset_mapping=False)
    a = ElasticArena(be, ROWS, base_tokens=128, max_elastic_tokens=64, step_tokens=64)
    creates, unmaps, maps = be.calls["create"], be.calls.get("unmap", 0), be.calls["map"]
    be.fail_on = {"create": lambda n: "oom" if n == creates + 2 else False, "unmap": lambda n: n == unmaps + 1}
    with pytest.raises(VmmError) as err:
        a.lend()
    assert err.value.out_of_memory
    assert be.calls["map"] == maps and be.calls.get("unmap", 0) == unmaps  # nothing was mapped, nothing to roll back
    assert not a.lending_disabled and be.live_handles == len(ROWS)  # the base's handles only
    be.fail_on = {"map": lambda n: n == maps + 2, "unmap": lambda n: n == unmaps + 1}
    with pytest.raises(VmmError, match="map failed"):
        a.lend()
    be.fail_on = {}
    assert a.lent_steps == 0 and a.lending_disabled  # the range may still be mapped: no lend over it
    assert a.lend() == 0  # refused quietly, not 'range already mapped'
    a.close()  # not 'range still has mappings'
    assert be.live_handles == 0 and be._maps == {} and be.calls["free_va"] == 1
