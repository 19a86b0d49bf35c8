"""Rollout-only memory: an address range reserved once, with physical memory mapped only while it is needed.

A rank's all-gather output during rollout is ``d_g`` slots; only its own slot (the training shard) must exist
during training. :class:`ReservedBuffer` reserves the whole range once, so ``tensor()`` and every view of it
(parameters, the all-gather output) keep their addresses across training/rollout switches; the peers' slots are
mapped before the all-gather and unmapped after rollout, and their memory goes back to the device or OS.

Backends, picked by ``backend="auto"``:

- ``cuda_vmm``: the CUDA driver's virtual memory API through ctypes on ``libcuda`` (the mechanism behind
  PyTorch's expandable segments): ``cuMemAddressReserve`` once, ``cuMemCreate`` + ``cuMemMap`` +
  ``cuMemSetAccess`` per mapped range, ``cuMemUnmap`` to give it back. Granularity: the device's minimum
  allocation granularity (2 MiB on Hopper). Freshly mapped memory holds undefined values; touching an unmapped
  range from a kernel is an illegal address error.
- ``mmap``: CPU, an anonymous private mapping; unmap is ``madvise(MADV_DONTNEED)`` (the pages go back to the OS
  and the range reads zeros afterwards). Granularity: the page size.
- ``plain``: a fallback when neither works: one ordinary allocation of the whole range that stays allocated;
  ``map``/``unmap`` only keep the books and ``releases_memory`` is False. (Freeing the peers' part of a plain
  allocation would move the part that must survive, and break the fixed addresses that ``tensor()`` promises;
  callers that prefer the memory back can check ``releases_memory`` and allocate a temporary gather buffer.)

Ranges are in elements of the buffer's dtype and must start on a granule (``granularity_numel``); the end may also
be ``numel``. ``map`` fills every unmapped hole in the range (each hole becomes one mapping); ``unmap`` removes the
mappings inside the range and refuses to split one. The same rules hold for every backend so that code tested on
CPU behaves the same on a GPU.
"""

from __future__ import annotations

import ctypes
import mmap
import warnings
import weakref
from typing import Any, Iterable

import torch

_CUDA_ERROR_OUT_OF_MEMORY = 2  # CUresult CUDA_ERROR_OUT_OF_MEMORY

__all__ = ["ReservedBuffer", "allocation_granularity", "pad_to_granularity"]


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint union of ``[lo, hi)`` ranges."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def subtract_ranges(ranges: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of sorted, disjoint ``[lo, hi)`` ranges that no range of sorted, disjoint ``holes`` covers."""
    out = []
    for lo, hi in ranges:
        cur = lo
        for h_lo, h_hi in holes:
            if h_hi <= cur or h_lo >= hi:
                continue
            if h_lo > cur:
                out.append((cur, h_lo))
            cur = max(cur, h_hi)
        if cur < hi:
            out.append((cur, hi))
    return out


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


# ---------------------------------------------------------------------------------------------------------------
# CUDA driver API (ctypes)

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CUmemAllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _CUmemAllocationProp(ctypes.Structure):
    # cuda.h, CUmemAllocationProp_v1 (unchanged from CUDA 10.2 to 13.0).
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _CUmemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _CUmemAllocFlags)]


class _CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", _CUmemLocation), ("flags", ctypes.c_int)]


class _CudaDriver:
    """The few driver entry points we need, with errors turned into RuntimeError."""

    _instance: _CudaDriver | None = None

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        u64, size_t, p = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER
        self._sigs = {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGet": [p(ctypes.c_int), ctypes.c_int],
            "cuCtxGetCurrent": [p(ctypes.c_void_p)],
            "cuCtxSetCurrent": [ctypes.c_void_p],
            "cuDevicePrimaryCtxRetain": [p(ctypes.c_void_p), ctypes.c_int],
            "cuMemGetAllocationGranularity": [p(size_t), p(_CUmemAllocationProp), ctypes.c_int],
            "cuMemAddressReserve": [p(u64), size_t, size_t, u64, ctypes.c_ulonglong],
            "cuMemAddressFree": [u64, size_t],
            "cuMemCreate": [p(u64), size_t, p(_CUmemAllocationProp), ctypes.c_ulonglong],
            "cuMemRelease": [u64],
            "cuMemMap": [u64, size_t, size_t, u64, ctypes.c_ulonglong],
            "cuMemUnmap": [u64, size_t],
            "cuMemSetAccess": [u64, size_t, p(_CUmemAccessDesc), size_t],
            "cuGetErrorString": [ctypes.c_int, p(ctypes.c_char_p)],
        }
        for name, argtypes in self._sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            setattr(self, name, fn)
        self.check(self.cuInit(0), "cuInit")

    @classmethod
    def get(cls) -> _CudaDriver:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            self.cuGetErrorString(rc, ctypes.byref(msg))
            text = msg.value.decode() if msg.value else "unknown error"
            raise RuntimeError(f"{what} failed with CUDA driver error {rc}: {text}")

    def ensure_context(self, ordinal: int) -> None:
        # The runtime (torch) makes the primary context current per thread lazily; the driver calls below need one.
        ctx = ctypes.c_void_p()
        self.check(self.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            dev = ctypes.c_int()
            self.check(self.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
            self.check(self.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev.value), "cuDevicePrimaryCtxRetain")
            self.check(self.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def allocation_prop(self, ordinal: int) -> _CUmemAllocationProp:
        prop = _CUmemAllocationProp()
        prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = _CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        return prop

    def granularity(self, ordinal: int) -> int:
        size = ctypes.c_size_t()
        prop = self.allocation_prop(ordinal)
        self.check(self.cuMemGetAllocationGranularity(ctypes.byref(size), ctypes.byref(prop),
                                                      _CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                   "cuMemGetAllocationGranularity")
        return int(size.value)


class _CudaArray:
    """Exposes a device address range to torch through ``__cuda_array_interface__``; keeps its owner alive."""

    def __init__(self, ptr: int, nbytes: int, owner: Any) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3, "stream": None}


# ---------------------------------------------------------------------------------------------------------------
# Backends: reserve once; map(lo, hi) / unmap(lo, hi) in bytes, aligned to `granularity`


class _CudaVmmBackend:
    name = "cuda_vmm"
    releases_memory = True

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        self.ordinal = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.init()
        self.driver = _CudaDriver.get()
        with torch.cuda.device(self.ordinal):
            self.driver.ensure_context(self.ordinal)
        self.granularity = self.driver.granularity(self.ordinal)
        self.nbytes = _round_up(nbytes, self.granularity)
        ptr = ctypes.c_uint64()
        self.driver.check(self.driver.cuMemAddressReserve(ctypes.byref(ptr), self.nbytes, self.granularity, 0, 0),
                          f"cuMemAddressReserve({self.nbytes} bytes)")
        self.ptr = int(ptr.value)
        # Mapped byte ranges. The range lives as long as this object, which every tensor over it keeps alive
        # (through _CudaArray): when the last of them goes, the finalizer unmaps what is left and frees it.
        self.mapped: list[tuple[int, int]] = []
        self._free = weakref.finalize(self, _cuda_release, self.driver, self.ptr, self.nbytes, self.mapped)

    def map(self, lo: int, hi: int) -> None:
        self.map_many([(lo, hi)])

    def _create(self, nbytes: int, prop: Any) -> ctypes.c_uint64:
        """A physical allocation of ``nbytes``. PyTorch's caching allocator keeps the blocks it freed (a model's
        build leaves gigabytes of them) and the driver cannot hand those out, so a first refusal empties that
        cache and asks once more; a second refusal is ``torch.OutOfMemoryError`` with the card's figures."""
        d = self.driver
        handle = ctypes.c_uint64()
        rc = d.cuMemCreate(ctypes.byref(handle), nbytes, ctypes.byref(prop), 0)
        if rc == _CUDA_ERROR_OUT_OF_MEMORY:
            torch.cuda.empty_cache()
            rc = d.cuMemCreate(ctypes.byref(handle), nbytes, ctypes.byref(prop), 0)
            if rc == _CUDA_ERROR_OUT_OF_MEMORY:
                free, total = torch.cuda.mem_get_info(self.ordinal)
                gib = 2 ** 30
                raise torch.OutOfMemoryError(
                    f"cuMemCreate({nbytes} bytes = {nbytes / gib:.2f} GiB) for a rollout buffer: out of memory with "
                    f"{free / gib:.2f} GiB of {total / gib:.2f} GiB free after emptying PyTorch's cache "
                    f"({torch.cuda.memory_allocated(self.ordinal) / gib:.2f} GiB allocated by PyTorch)")
        d.check(rc, f"cuMemCreate({nbytes} bytes)")
        return handle

    def map_many(self, ranges: list[tuple[int, int]]) -> None:
        """Back each range with a physical allocation of its own.

        One allocation per range, not one for all: ``cuMemMap`` only maps a physical allocation from its start
        (its ``offset`` must be 0; CUDA 13.0 answers 801, operation not supported, otherwise). Access is then set
        once per contiguous mapped span (a rank's own slots sit between its peers' slots, so a switch's pieces
        usually form one span per buffer) rather than once per range. A failure unmaps what this call mapped.
        """
        d = self.driver
        done: list[tuple[int, int]] = []
        access = _CUmemAccessDesc()
        access.location.type = _CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.ordinal
        access.flags = _CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        prop = d.allocation_prop(self.ordinal)
        try:
            for lo, hi in ranges:
                handle = self._create(hi - lo, prop)
                try:
                    d.check(d.cuMemMap(self.ptr + lo, hi - lo, 0, handle.value, 0), "cuMemMap")
                finally:
                    # The mapping holds the physical memory; dropping the handle now means cuMemUnmap frees it.
                    d.check(d.cuMemRelease(handle.value), "cuMemRelease")
                done.append((lo, hi))
            spans: list[list[int]] = []
            for lo, hi in sorted(self.mapped + done):
                if spans and spans[-1][1] == lo:
                    spans[-1][1] = hi
                else:
                    spans.append([lo, hi])
            for lo, hi in spans:
                inside = [(a, b) for a, b in done if lo <= a and b <= hi]
                if inside and d.cuMemSetAccess(self.ptr + lo, hi - lo, ctypes.byref(access), 1) != 0:
                    for a, b in inside:  # a driver that wants one update per allocation
                        d.check(d.cuMemSetAccess(self.ptr + a, b - a, ctypes.byref(access), 1), "cuMemSetAccess")
        except RuntimeError:
            for lo, hi in done:
                d.cuMemUnmap(self.ptr + lo, hi - lo)
            raise
        self.mapped.extend(done)

    def unmap(self, lo: int, hi: int, synchronize: bool = True) -> None:
        if synchronize:  # kernels queued on any stream may still read or write the range
            torch.cuda.synchronize(self.device)
        self.driver.check(self.driver.cuMemUnmap(self.ptr + lo, hi - lo), "cuMemUnmap")
        self.mapped.remove((lo, hi))

    def tensor(self) -> torch.Tensor:
        return torch.as_tensor(_CudaArray(self.ptr, self.nbytes, self), device=self.device)

    def close(self) -> None:
        self._free()


def _cuda_release(driver: _CudaDriver, ptr: int, nbytes: int, mapped: list[tuple[int, int]]) -> None:
    if mapped:  # only at garbage collection: nothing can have queued work on a range that no tensor views
        torch.cuda.synchronize()
    for lo, hi in mapped:
        driver.cuMemUnmap(ptr + lo, hi - lo)
    mapped.clear()
    driver.check(driver.cuMemAddressFree(ptr, nbytes), "cuMemAddressFree")


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux's value; Python 3.11 does not name it


class _MmapBackend:
    name = "mmap"
    releases_memory = True
    _populate = True  # until the kernel refuses MADV_POPULATE_WRITE once

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.granularity = mmap.PAGESIZE
        self.nbytes = _round_up(nbytes, self.granularity)
        self.mm = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
        # No transparent huge pages (MADV_HUGEPAGE): they made faulting the peers' slots back 6x faster on idle
        # processes (19 vs 117 ms for 8 x 54 MB) but 3x slower once other allocations had churned memory (355 vs
        # 116 ms for 216 MB in bench/reshard.py's few-large shape at 2 ranks): with the kernel's default
        # defrag=madvise, each huge-page fault may compact memory synchronously. 4 KiB faults cost the same each
        # time.
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)

    def map(self, lo: int, hi: int) -> None:
        # Make the range resident now, as on the GPU: one MADV_POPULATE_WRITE (Linux >= 5.14) faults every page in
        # one call (64 MiB: 38 ms against 53 ms for touching a byte per page, medians of 15, this 2-core machine);
        # older kernels answer EINVAL and get the per-page touch.
        if self._populate:
            try:
                self.mm.madvise(_MADV_POPULATE_WRITE, lo, hi - lo)
                return
            except OSError:
                type(self)._populate = False
        self.bytes[lo:hi:self.granularity].zero_()

    def map_many(self, ranges: list[tuple[int, int]]) -> None:
        for lo, hi in ranges:
            self.map(lo, hi)

    def unmap(self, lo: int, hi: int, synchronize: bool = True) -> None:
        self.mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def tensor(self) -> torch.Tensor:
        return self.bytes

    def close(self) -> None:
        self.bytes = None
        try:
            self.mm.close()
        except BufferError:
            # Tensors over the mapping are still alive; the mapping goes away with the last of them.
            pass


class _PlainBackend:
    name = "plain"
    releases_memory = False
    granularity = 512  # bookkeeping only; matches the caching allocator's rounding

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = _round_up(nbytes, self.granularity)
        self.bytes = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)

    def map(self, lo: int, hi: int) -> None:
        pass

    def map_many(self, ranges: list[tuple[int, int]]) -> None:
        pass

    def unmap(self, lo: int, hi: int, synchronize: bool = True) -> None:
        pass

    def tensor(self) -> torch.Tensor:
        return self.bytes

    def close(self) -> None:
        self.bytes = None


_BACKENDS = {"cuda_vmm": _CudaVmmBackend, "mmap": _MmapBackend, "plain": _PlainBackend}


def _make_backend(backend: str, nbytes: int, device: torch.device) -> Any:
    if backend != "auto":
        if backend not in _BACKENDS:
            raise ValueError(f"ReservedBuffer: backend must be one of auto, {', '.join(_BACKENDS)}; got {backend!r}")
        return _BACKENDS[backend](nbytes, device)
    preferred = {"cuda": _CudaVmmBackend, "cpu": _MmapBackend}.get(device.type)
    if preferred is not None:
        try:
            return preferred(nbytes, device)
        except (OSError, RuntimeError, AttributeError, ValueError) as exc:
            warnings.warn(f"ReservedBuffer: the {preferred.name} backend is unavailable on {device} ({exc}); "
                          "falling back to a plain allocation that stays allocated (unmap releases nothing)",
                          RuntimeWarning, stacklevel=3)
    return _PlainBackend(nbytes, device)


def allocation_granularity(device: torch.device | str | int, *, backend: str = "auto") -> int:
    """Bytes to which mapped ranges are aligned on ``device`` (to size slots before creating a buffer)."""
    device = _as_device(device)
    if backend == "plain":
        return _PlainBackend.granularity
    if device.type == "cuda" and backend in ("auto", "cuda_vmm"):
        try:
            torch.cuda.init()
            driver = _CudaDriver.get()
            ordinal = device.index if device.index is not None else torch.cuda.current_device()
            with torch.cuda.device(ordinal):
                driver.ensure_context(ordinal)
            return driver.granularity(ordinal)
        except (OSError, RuntimeError, AttributeError):
            if backend == "cuda_vmm":
                raise
            return _PlainBackend.granularity
    if device.type == "cpu" and backend in ("auto", "mmap"):
        return mmap.PAGESIZE
    return _PlainBackend.granularity


def pad_to_granularity(numel: int, dtype: torch.dtype, device: torch.device | str | int, *,
                       backend: str = "auto") -> int:
    """``numel`` rounded up to whole granules of ``device``: the slot size that lets each slot map on its own."""
    granule_numel = allocation_granularity(device, backend=backend) // torch.empty((), dtype=dtype).element_size()
    return _round_up(numel, granule_numel)


def _as_device(device: torch.device | str | int) -> torch.device:
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


# ---------------------------------------------------------------------------------------------------------------


class ReservedBuffer:
    """``numel`` elements of ``dtype`` at a fixed address, with physical memory mapped per sub-range.

    Args:
        numel: elements in the buffer.
        dtype: element type.
        device: where the memory lives (``"cuda"``, ``"cuda:1"``, ``"cpu"``).
        backend: ``"auto"`` (CUDA VMM on GPUs, mmap on CPU, plain if those fail), or one of ``"cuda_vmm"``,
            ``"mmap"``, ``"plain"`` to insist.

    Nothing is mapped at construction. ``tensor()`` covers the whole range; only mapped parts may be touched.
    """

    def __init__(self, numel: int, dtype: torch.dtype, *, device: torch.device | str | int = "cuda",
                 backend: str = "auto") -> None:
        if numel <= 0:
            raise ValueError(f"ReservedBuffer: numel must be > 0, got {numel}")
        self.numel = int(numel)
        self.dtype = dtype
        self.device = _as_device(device)
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self._backend = _make_backend(backend, self.numel * self.element_size, self.device)
        self._mappings: list[tuple[int, int]] = []  # byte ranges [lo, hi), sorted, disjoint
        self._tensor: torch.Tensor | None = None
        self._closed = False

    # -- properties ------------------------------------------------------------------------------------------

    @property
    def backend(self) -> str:
        """Name of the backend in use: ``cuda_vmm``, ``mmap`` or ``plain``."""
        return self._backend.name

    @property
    def releases_memory(self) -> bool:
        """Whether ``unmap`` returns physical memory (False only for the plain fallback)."""
        return self._backend.releases_memory

    @property
    def granularity(self) -> int:
        """Alignment of mapped ranges, in bytes."""
        return self._backend.granularity

    @property
    def granularity_numel(self) -> int:
        """Alignment of mapped ranges, in elements: pad slots to a multiple of this to map them one by one."""
        return self._backend.granularity // self.element_size

    @property
    def reserved_bytes(self) -> int:
        """Bytes of address space reserved (``numel`` rounded up to whole granules)."""
        return self._backend.nbytes

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` gave the range back."""
        return self._closed

    @property
    def mapped_bytes(self) -> int:
        """Bytes currently backed by physical memory (as far as this buffer's mappings go)."""
        return sum(hi - lo for lo, hi in self._mappings)

    def mapped_ranges(self) -> list[tuple[int, int]]:
        """Mapped element ranges ``[(start, end), ...]``, in order (ends clipped to ``numel``)."""
        return [(lo // self.element_size, min(hi // self.element_size, self.numel)) for lo, hi in self._mappings]

    def is_mapped(self, start: int, end: int) -> bool:
        """Whether every element of ``[start, end)`` is mapped."""
        lo, hi = start * self.element_size, end * self.element_size
        for m_lo, m_hi in self._mappings:
            if m_lo <= lo < m_hi:
                lo = m_hi
        return lo >= hi

    # -- mapping ---------------------------------------------------------------------------------------------

    def _byte_range(self, op: str, start: int, end: int) -> tuple[int, int]:
        self._check_open()
        g = self.granularity_numel
        if not 0 <= start <= end <= self.numel:
            raise ValueError(f"ReservedBuffer.{op}: need 0 <= start <= end <= numel={self.numel}, got start={start}, "
                             f"end={end}")
        if start % g or (end % g and end != self.numel):
            raise ValueError(f"ReservedBuffer.{op}: start={start} and end={end} must be multiples of "
                             f"granularity_numel={g} ({self.granularity} bytes; end may also be numel={self.numel})")
        return start * self.element_size, min(_round_up(end * self.element_size, self.granularity),
                                               self.reserved_bytes)

    def map(self, start: int, end: int) -> None:
        """Back elements ``[start, end)`` with physical memory; already mapped parts are left as they are.

        Each unmapped hole in the range becomes one mapping. New memory holds undefined values (zeros on CPU).
        """
        self.map_many([(start, end)])

    def map_many(self, ranges: list[tuple[int, int]]) -> None:
        """:meth:`map` of several element ranges at once: every unmapped hole becomes a mapping of its own (each
        can be unmapped on its own)."""
        holes: list[tuple[int, int]] = []
        for start, end in ranges:
            lo, hi = self._byte_range("map", start, end)
            holes.extend(subtract_ranges([(lo, hi)], sorted(self._mappings + holes)))
        self._backend.map_many(holes)
        self._mappings = sorted(self._mappings + holes)

    def unmap(self, start: int, end: int, *, synchronize: bool = True) -> None:
        """Give back the physical memory of every mapping inside ``[start, end)``; the address stays reserved.

        A mapping that straddles either end is an error (map in smaller pieces to unmap in smaller pieces). On CUDA
        this synchronizes the device first, so no queued kernel touches the range afterwards (``synchronize=False``
        skips that, for a caller that has synchronized already).
        """
        lo, hi = self._byte_range("unmap", start, end)
        inside = []
        for m_lo, m_hi in self._mappings:
            if m_hi <= lo or m_lo >= hi:
                continue
            if m_lo < lo or m_hi > hi:
                raise ValueError(
                    f"ReservedBuffer.unmap: elements [{start}, {end}) would split the mapping of elements "
                    f"[{m_lo // self.element_size}, {min(m_hi // self.element_size, self.numel)}), which was mapped "
                    "in one piece")
            inside.append((m_lo, m_hi))
        for i, m in enumerate(inside):
            self._backend.unmap(*m, synchronize=synchronize and i == 0)
            self._mappings.remove(m)

    # -- access ----------------------------------------------------------------------------------------------

    def tensor(self) -> torch.Tensor:
        """A 1-D tensor over the whole range; its ``data_ptr`` never changes. Touch only mapped parts."""
        self._check_open()
        if self._tensor is None:
            self._tensor = self._backend.tensor().view(self.dtype)[: self.numel]
        return self._tensor

    def data_ptr(self) -> int:
        """Address of element 0."""
        return self.tensor().data_ptr()

    # -- lifetime --------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("ReservedBuffer: the buffer is closed")

    def close(self) -> None:
        """Unmap everything and free the address range. Tensors from ``tensor()`` must not be used afterwards."""
        if self._closed:
            return
        for m in list(self._mappings):
            self._backend.unmap(*m)
        self._mappings.clear()
        self._tensor = None
        self._backend.close()
        self._closed = True

    def __enter__(self) -> ReservedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # No __del__: the memory lives as long as the buffer or any tensor over it (a parameter viewing a slot keeps
    # it alive), and goes back when the last of them is gone; close() gives it back at once.

    def __repr__(self) -> str:
        return (f"ReservedBuffer(numel={self.numel}, dtype={self.dtype}, device={self.device}, backend={self.backend}, "
                f"mapped={self.mapped_ranges()})")
