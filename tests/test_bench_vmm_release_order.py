"""scripts/gpu/bench_vmm.py's release-order case (issue 22) on the host VMM
backend: both orders run, the memory is back after each, and a release
before the unmap keeps the mapping readable until the unmap (memfd, as
cuMemRelease of a mapped handle)."""

from __future__ import annotations

from gpu_scripts import load_script

from sglang_elastic.vmm import HostBackend


def _bench():
    return load_script("bench_vmm")


def test_both_orders_run_and_give_the_memory_back():
    be = HostBackend(granularity=4096, capacity=64 << 20)
    out = _bench().release_order_case(be, [2048] * 6, 6 * 4096 * 3, cycles=3)
    assert out["memory_back"] and out["handles"] == 6 and out["bytes_per_handle"] == 3 * 4096
    for order in ("unmap_then_release", "release_then_unmap"):
        assert set(out[order]) == {"unmap_ms", "release_ms", "total_ms"}
        assert out[order]["total_ms"]["p50"] >= out[order]["unmap_ms"]["p50"] > 0
    assert be.free_bytes() == 64 << 20 and be.live_handles == 0


def test_a_handle_released_while_mapped_stays_readable_until_its_unmap():
    be = HostBackend(granularity=4096, capacity=1 << 20)
    va = be.reserve(4096)
    h = be.create(4096)
    be.map(va, 4096, h, 0)
    be.write(va, b"\x5a" * 64)
    be.release(h)
    assert be.read(va, 64) == b"\x5a" * 64  # the mapping still holds the memory
    be.unmap(va, 4096)
    be.free_va(va, 4096)
    assert be.live_handles == 0


def test_a_failure_midway_leaves_no_handle_or_mapping_behind():
    be = HostBackend(granularity=4096, capacity=5 * 4096)  # room for 5 of the 6 handles: the 6th create fails
    try:
        _bench().release_order_case(be, [2048] * 6, 6 * 4096, cycles=1)
    except Exception as e:
        assert "out of memory" in str(e)
    else:
        raise AssertionError("the 6th handle should not fit")
    assert be.live_handles == 0 and be.free_bytes() == 5 * 4096 and not be._maps
