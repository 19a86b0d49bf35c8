"""CUDA graphs of generation steps, captured once per bucket and replayed for the generator's whole life.

A decode step's inputs (each slot's token and position, and the hidden states from the previous pipeline stage),
the KV cache, the rotary frequencies and the weights all sit at fixed addresses; between rollouts the engine
unmaps and maps the weights' peers' slots and the cache again at the same addresses, and optimizer steps write
training weights in place. So a graph captured in one rollout replays correctly in every later one and is never
captured again: what peers get wrong when their inference engine reallocates (stale graphs or re-capture).

A graph bakes in the batch (slots ``0 .. B-1``) and how many cached positions attention reads, so a step is run by
the graph of its bucket: the batch rounded up to a batch size of the list, the filled length rounded up to the
length granule (the step planner, :mod:`.planner`, rounds them and names the graph). megatron-core needs its
inference RNG tracker for capture (``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)``): the
default tracker's ``fork()`` fails inside a capture.

All graphs share one memory pool (they never run concurrently). Its memory would otherwise stay allocated as long
as the graphs live, training included; :class:`ReservedGraphPool` instead serves the pool's segments from one
growing rollout-only reservation (a ``torch.cuda.MemPool`` over a custom allocator), so they keep their addresses
but are backed only while rolling out, like the KV cache (see :mod:`megatron_hybrid.memory.rollout`).
"""

from __future__ import annotations

import ctypes
import warnings
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Optional

import torch

from ..memory import RolloutMemoryProvider

# torch's pluggable-allocator callbacks (c10/cuda/CUDAPluggableAllocator): alloc(size, device, stream) -> ptr and
# free(ptr, size, device, stream).
_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)


class ReservedGraphPool:
    """A ``torch.cuda.MemPool`` whose segments are carved, in order, out of one reserved address range.

    The caching allocator asks for a segment only when a capture needs more memory; the segment is mapped then and
    handed out for the pool's life (the pool reuses its blocks itself; nothing is given back before the pool goes).
    From then on it is backed with ``memory``'s other reservations, at the same addresses, which the graphs captured
    over it keep: with the engine's provider from every switch to rollout to the switch back (so it stays backed
    between two generate calls of one rollout, as the KV cache does; the GPU test checks what is held while
    training, and nothing between calls), with a generator's own provider for each generate call.

    Args:
        memory: the provider of the reservation (it needs CUDA virtual memory).
        reserve_bytes: address space to reserve (physical memory follows the segments actually handed out).
    """

    def __init__(self, memory: RolloutMemoryProvider, reserve_bytes: int) -> None:
        self.memory = memory
        self.buffer = memory.reserve(reserve_bytes, torch.uint8, grows=True, backend="cuda_vmm")
        # Read here: the callback runs inside the caching allocator's lock.
        self.base, self.granule = self.buffer.memory.data_ptr(), self.buffer.memory.granularity
        self.top = 0  # bytes handed out
        self.refused: Optional[int] = None  # the size of a segment the reservation could not hold
        # The callbacks must outlive the allocator that calls them. torch._C._cuda_customAllocator is what
        # torch.cuda.memory.CUDAPluggableAllocator calls with a shared library's function pointers (torch >= 2.0);
        # a MemPool over such an allocator serves CUDA-graph captures from torch 2.6 (checked up to 2.13).
        self._alloc_cb, self._free_cb = _ALLOC(self._alloc), _FREE(self._free)
        try:
            allocator = torch._C._cuda_customAllocator(ctypes.cast(self._alloc_cb, ctypes.c_void_p).value,
                                                       ctypes.cast(self._free_cb, ctypes.c_void_p).value)
            self.pool = torch.cuda.MemPool(allocator)
        except Exception:
            self.buffer.close()  # no pool (a torch without custom MemPools): the provider forgets the reservation
            raise
        self.id = self.pool.id

    def _alloc(self, size: int, device: int, stream: Any) -> Optional[int]:
        granule = self.granule
        size = -(-size // granule) * granule
        if self.top + size > self.buffer.numel:
            self.refused = size  # named by StepGraphs.run
            return None  # the caching allocator turns a null pointer into its out-of-memory error
        lo, self.top = self.top, self.top + size
        self.buffer.extend(lo, self.top)  # mapped now, and from now on with the provider's other reservations
        return self.base + lo

    def _free(self, ptr: Any, size: int, device: int, stream: Any) -> None:
        """Segments are only freed when the pool goes; the reservation goes with :meth:`close`."""

    def backed(self) -> ContextManager[None]:
        """Every segment handed out is backed for the body (new ones are mapped as they are handed out)."""
        return self.memory.backed()

    @property
    def mapped_bytes(self) -> int:
        return self.buffer.mapped_bytes

    def close(self) -> None:
        self.pool = None
        self.buffer.close()


class StepGraphs:
    """The CUDA graphs of one stage's steps, keyed by the step plan's graph key (:attr:`.planner.StepPlan.graph_key`:
    ``(kind, rows, length, sampling signature)`` of decode, prefill and mixed steps; the planner rounds the steps to
    the keys' buckets).

    Args:
        device: the GPU.
        pool_bytes: address space for a :class:`ReservedGraphPool` (0: a private pool that stays allocated).
        memory: the rollout-memory provider the reserved pool reserves from.
    """

    def __init__(self, *, device: torch.device, pool_bytes: int, memory: RolloutMemoryProvider) -> None:
        self.reserved: Optional[ReservedGraphPool] = None
        if pool_bytes > 0:
            try:
                self.reserved = ReservedGraphPool(memory, pool_bytes)
            except (AttributeError, RuntimeError, OSError) as exc:  # no VMM, or a torch without custom MemPools
                warnings.warn(f"decode graphs: no reserved memory pool ({exc}); their memory stays allocated "
                              "between generate calls", RuntimeWarning, stacklevel=2)
        self.pool = self.reserved.id if self.reserved is not None else torch.cuda.graph_pool_handle()
        # Captures run on a stream of these graphs' own. cuBLAS keeps a workspace per (handle, stream), allocated at
        # the stream's first GEMM, here inside a capture, so from this pool: on a stream shared with other graphs
        # (torch.cuda.graph's default one) their captures would write into this pool's memory, unmapped between
        # calls and freed at close (and the workspace would outlive it, see close()).
        self.stream = torch.cuda.Stream(device)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.captures = 0
        self.replays = 0

    def run(self, key: tuple, step: Callable[[], Any]) -> Any:
        """Replay the graph of ``key`` (capturing ``step`` first if it has none) and return its output.

        ``step`` must read only fixed-address tensors. The output is overwritten by the next replay of any graph.
        """
        entry = self._graphs.get(key)
        if entry is None:
            # Warm up outside the capture (cuBLAS handles, NCCL communicators and the like initialise lazily). It
            # computes this very step, so the K/V it writes are the ones the replay below writes again. On the
            # current stream, not a side stream: a new stream's cuBLAS workspace would stay allocated for good.
            step()
            graph = torch.cuda.CUDAGraph()
            # thread_local, as megatron-core's own graphs: the NCCL watchdog thread queries events meanwhile.
            try:
                with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                    out = step()
            except torch.OutOfMemoryError as error:
                reserved = self.reserved
                if reserved is None or reserved.refused is None:
                    raise
                raise torch.OutOfMemoryError(
                    f"the step graphs' reserved pool is full: {reserved.top / 2**30:.2f} GiB handed out of "
                    f"{reserved.buffer.numel / 2**30:.2f} GiB reserved, a {reserved.refused / 2**20:.0f} MiB segment "
                    f"refused while capturing {key} (GenerationConfig.graph_pool_gib; default: the card's total "
                    f"memory): {error}") from error
            entry = self._graphs[key] = (graph, out)
            self.captures += 1
        graph, out = entry
        graph.replay()
        self.replays += 1
        return out

    def keys(self) -> list[tuple]:
        """The keys of the graphs captured so far, sorted."""
        return sorted(self._graphs)

    def backed(self) -> ContextManager[None]:
        """The graphs' memory is there for the body (always, without a reserved pool)."""
        return self.reserved.backed() if self.reserved is not None else nullcontext()

    @property
    def pool_bytes(self) -> int:
        """Bytes of reserved pool memory handed out to the graphs (0 without a reserved pool)."""
        return self.reserved.top if self.reserved is not None else 0

    def close(self) -> None:
        self._graphs.clear()
        # torch keeps the capture stream's cuBLAS workspace, which lives in this pool, in a process-wide table: drop
        # it with the pool (pytorch#95668). Left there, it dangled; a later pool reserved at the same addresses had
        # its tensors overwritten by that stream's GEMMs (seen on an H200: two rows of the next generator's KV cache
        # turned NaN). The table is cleared for every stream: the others allocate a new workspace at their next GEMM.
        if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
            torch.cuda.synchronize()
            torch._C._cuda_clearCublasWorkspaces()
        if self.reserved is not None:
            self.reserved.close()


#: The former name: the storage holds prefill and mixed steps' graphs too.
DecodeGraphs = StepGraphs
