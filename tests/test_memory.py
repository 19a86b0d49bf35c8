"""ReservedBuffer: fixed address across map/unmap cycles, memory really released, the always-mapped part kept; the
per-call rollout-memory provider's lifetime."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest
import torch

from megatron_hybrid.memory import ReservedBuffer, allocation_granularity, pad_to_granularity

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
MIB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_cpu_buffer_uses_mmap_with_page_granularity() -> None:
    with ReservedBuffer(1000, torch.bfloat16, device="cpu") as buf:
        assert buf.backend == "mmap" and buf.releases_memory
        assert buf.granularity == mmap.PAGESIZE == allocation_granularity("cpu")
        assert buf.granularity_numel == mmap.PAGESIZE // 2
        assert buf.reserved_bytes == mmap.PAGESIZE
        assert buf.tensor().shape == (1000,) and buf.tensor().dtype == torch.bfloat16
    assert pad_to_granularity(1000, torch.float32, "cpu") == mmap.PAGESIZE // 4


def test_cpu_map_unmap_cycles_keep_address_release_memory_and_keep_own_part() -> None:
    numel = 64 * MIB // 4
    own = 4 * MIB // 4  # the always-mapped slot (a rank's training shard)
    buf = ReservedBuffer(numel, torch.float32, device="cpu")
    t = buf.tensor()
    ptr = t.data_ptr()
    buf.map(0, own)
    t[:own] = torch.arange(own, dtype=torch.float32)
    for cycle in range(3):
        before = rss_bytes()
        buf.map(own, numel)  # the peers' slots, for one rollout
        assert buf.is_mapped(0, numel) and buf.mapped_ranges() == [(0, own), (own, numel)]
        t[own:] = cycle + 1.0
        mapped = rss_bytes()
        assert mapped - before > 50 * MIB, (before, mapped)
        buf.unmap(own, numel)
        after = rss_bytes()
        assert mapped - after > 50 * MIB, (mapped, after)
        assert buf.tensor().data_ptr() == ptr and t.data_ptr() == ptr
        assert torch.equal(t[:own], torch.arange(own, dtype=torch.float32))  # own part survives
        assert not bool(t[own:].any())  # released pages read zero on CPU
    buf.close()


def test_map_fills_holes_and_unmap_refuses_to_split() -> None:
    with ReservedBuffer(10 * 1024, torch.float32, device="cpu") as buf:  # 10 pages
        g = buf.granularity_numel
        buf.map(2 * g, 4 * g)
        buf.map(0, 6 * g)  # fills [0, 2g) and [4g, 6g) around the existing mapping
        assert buf.mapped_ranges() == [(0, 2 * g), (2 * g, 4 * g), (4 * g, 6 * g)]
        assert buf.mapped_bytes == 6 * buf.granularity
        with pytest.raises(ValueError, match="would split the mapping"):
            buf.unmap(3 * g, 6 * g)
        buf.unmap(2 * g, 10 * 1024)  # removes the two mappings inside; the hole past 6g is fine
        assert buf.mapped_ranges() == [(0, 2 * g)]
        with pytest.raises(ValueError, match="multiples of granularity_numel"):
            buf.map(1, g)
        with pytest.raises(ValueError, match="0 <= start <= end"):
            buf.map(0, 10 * 1024 + 1)
        buf.map(9 * g, 10 * 1024)  # the end may be numel, even when it is not on a granule
        assert buf.is_mapped(9 * g, 10 * 1024)


def test_plain_fallback_keeps_books_but_not_memory() -> None:
    with ReservedBuffer(1000, torch.float16, device="cpu", backend="plain") as buf:
        assert buf.backend == "plain" and not buf.releases_memory
        t = buf.tensor()
        buf.map(0, 1000)
        t.fill_(3.0)
        buf.unmap(0, 1000)
        assert buf.tensor().data_ptr() == t.data_ptr()
        assert buf.mapped_ranges() == []


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="numel must be > 0"):
        ReservedBuffer(0, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="backend must be one of"):
        ReservedBuffer(10, torch.float32, device="cpu", backend="magic")
    buf = ReservedBuffer(10, torch.float32, device="cpu")
    buf.close()
    with pytest.raises(ValueError, match="closed"):
        buf.map(0, 10)


@needs_cuda
def test_cuda_vmm_cycles_at_fixed_address_release_device_memory() -> None:
    gib = 1 << 30
    numel = 2 * gib // 2
    buf = ReservedBuffer(numel, torch.bfloat16, device="cuda")
    assert buf.backend == "cuda_vmm", "the CUDA driver's virtual memory API is unavailable"
    g = buf.granularity_numel
    own = g  # one granule always mapped
    buf.map(0, own)
    t = buf.tensor()
    ptr = t.data_ptr()
    t[:own] = 1.5
    for cycle in range(3):
        free_before, _ = torch.cuda.mem_get_info()
        buf.map(own, numel)
        free_mapped, _ = torch.cuda.mem_get_info()
        assert free_before - free_mapped >= gib, (free_before, free_mapped)
        t[own:] = float(cycle)
        torch.cuda.synchronize()
        assert float(t[-1]) == float(cycle)
        buf.unmap(own, numel)
        free_after, _ = torch.cuda.mem_get_info()
        assert free_after - free_mapped >= gib, (free_mapped, free_after)
        assert buf.tensor().data_ptr() == ptr
        assert bool((t[:own] == 1.5).all())
    buf.close()


def test_per_call_rollout_memory_is_backed_for_each_call_only() -> None:
    # A generator without an engine: its reservations (one fixed, one that grows during a call, as the CUDA-graph
    # pool's does) are backed inside backed(), at the same addresses every call, and hold nothing between calls.
    from megatron_hybrid.memory import PerCallRolloutMemory

    memory = PerCallRolloutMemory(torch.device("cpu"))
    page = mmap.PAGESIZE
    fixed = memory.reserve(3 * page // 4 + 5, torch.float32)  # not a whole number of pages: mapped to its end
    grows = memory.reserve(8 * page, torch.uint8, grows=True)
    ptrs = (fixed.tensor.data_ptr(), grows.tensor.data_ptr())
    assert fixed.mapped_bytes == grows.mapped_bytes == 0
    for call in range(2):
        with memory.backed():
            assert fixed.mapped_bytes == fixed.memory.reserved_bytes
            assert grows.mapped_bytes == (2 * page if call else 0)
            if not call:
                grows.extend(0, page)  # handed out while in use: backed at once
                grows.extend(page, 2 * page)
                assert grows.mapped_bytes == 2 * page and grows.pieces == [(0, 2 * page, False)]
            with memory.backed():  # re-entrant: the inner body's end gives nothing back
                late = memory.reserve(10, torch.bfloat16)
            assert late.mapped_bytes == page and fixed.mapped_bytes == fixed.memory.reserved_bytes
            fixed.tensor.fill_(1.5)
            grows.tensor[: 2 * page].fill_(7)
        assert fixed.mapped_bytes == grows.mapped_bytes == late.mapped_bytes == 0
        assert (fixed.tensor.data_ptr(), grows.tensor.data_ptr()) == ptrs
        late.close()
    assert memory.buffers == [fixed, grows]  # closed ones are forgotten
    fixed.close()
    grows.close()


class _RefusingDriver:
    """cuMemCreate answers out of memory (2) ``refusals`` times, then succeeds; records the calls."""

    def __init__(self, refusals: int) -> None:
        self.refusals, self.calls = refusals, 0

    def cuMemCreate(self, handle, nbytes, prop, flags) -> int:  # noqa: N802 (the driver's name)
        self.calls += 1
        return 2 if self.calls <= self.refusals else 0

    def check(self, rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"{what}: {rc}")


@pytest.mark.parametrize("refusals", [0, 1, 2])
def test_a_refused_physical_allocation_empties_torch_cache_and_asks_once_more(monkeypatch, refusals) -> None:
    """The 7B step's engine build (issue 45, an H100): cuMemCreate of the rollout buffer ran out of memory while
    PyTorch's caching allocator held freed blocks the driver cannot hand out. One refusal empties that cache and
    retries; a second is torch.OutOfMemoryError naming the size and the card's figures."""
    from megatron_hybrid.memory import buffers

    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda ordinal: (3 * 2 ** 30, 80 * 2 ** 30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda ordinal: 60 * 2 ** 30)
    backend = object.__new__(buffers._CudaVmmBackend)  # no device here: only _create's logic runs
    backend.driver, backend.ordinal = _RefusingDriver(refusals), 0
    if refusals < 2:
        backend._create(2 ** 30, prop=ctypes.c_int())
        assert backend.driver.calls == refusals + 1 and len(emptied) == refusals
    else:
        with pytest.raises(torch.OutOfMemoryError, match=r"1073741824 bytes = 1.00 GiB.*3.00 GiB of 80.00 GiB free"
                                                         r".*60.00 GiB allocated"):
            backend._create(2 ** 30, prop=ctypes.c_int())
        assert backend.driver.calls == 2 and len(emptied) == 1
