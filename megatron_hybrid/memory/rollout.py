"""Memory backed only while rolling out: one abstraction, two lifetimes.

:class:`RolloutBuffer` is a flat range reserved once (:class:`~megatron_hybrid.memory.ReservedBuffer`), so every
tensor viewing it keeps its address, whose physical memory is mapped and unmapped with the rollout. Part of it may
stay backed for good (``own``: a rank's training shard in its gather buffer); the rest (``used`` less ``own``: the
peers' slots, a rollout-only range) is backed only while rolling out; a range may also grow while rolling out
(:meth:`RolloutBuffer.extend`: a CUDA-graph pool handing out segments during a capture).

Who decides *when* is a :class:`RolloutMemoryProvider`, what the inference package gets instead of the engine:

- the engine's (:class:`megatron_hybrid.reshard.placement.EngineRolloutMemory`): its reservations are backed from every
  ``switch_to_rollout()`` to the ``switch_to_training()``, and entering :meth:`RolloutMemoryProvider.backed` for a
  generate call is what switches the engine to rollout;
- :class:`PerCallRolloutMemory`, for a generator without an engine (a training-layout model): its reservations
  are backed for the duration of each generate call.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import ContextManager, Iterable, Iterator, Protocol

import torch

from .buffers import ReservedBuffer, merge_ranges, subtract_ranges


def warn_once(message: str, _seen: set = set()) -> None:  # noqa: B006 - a process-wide memo on purpose
    if message not in _seen:
        _seen.add(message)
        warnings.warn(message, stacklevel=3)


class RolloutBuffer:
    """A reserved flat range of ``numel`` elements: ``own`` ranges always backed, the rest of ``used`` (the peers'
    part, or all of a rollout-only range) backed only while rolling out, between :meth:`map_peers` and
    :meth:`unmap_peers`.

    Args:
        numel, dtype, device: the range.
        own: element ranges backed for the buffer's life (rounded out to whole granules).
        used: element ranges backed while rolling out (those of ``own`` included); more may come by :meth:`extend`.
        backend: the :class:`~megatron_hybrid.memory.ReservedBuffer` backend (``"cuda_vmm"`` to insist on it).
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, *, own: list[tuple[int, int]],
                 used: list[tuple[int, int]], backend: str = "auto") -> None:
        self.dtype, self.device, self.numel = dtype, device, numel
        self.memory = ReservedBuffer(max(numel, 1), dtype, device=device, backend=backend)
        if not self.memory.releases_memory:
            warn_once(f"no releasable memory backend on {device}: memory needed only while rolling out (peers' "
                      "slots, rollout-only ranges) stays allocated while training")
        # Round the own ranges out to whole granules: they stay backed; the peers' part is what is left.
        own_pages = self._granules(own)
        self.own_ranges = own_pages
        self.peer_ranges = subtract_ranges(self._granules(used), own_pages)
        # Peers' elements that share a granule with the own slots, hence stay backed while training.
        self.resident_peer_bytes = (sum(hi - lo for lo, hi in own_pages) - sum(hi - lo for lo, hi in merge_ranges(own))) \
            * self.memory.element_size
        self.memory.map_many(self.own_ranges)
        self.peers_mapped = False
        self._touched = False  # some peers' range is (partly) mapped
        # The peers' ranges as pieces that are unmapped on their own: (lo, hi, transient). Transient pieces are
        # needed only during the switch (see set_kept); by default nothing is.
        self.pieces = [(lo, hi, False) for lo, hi in self.peer_ranges]

    def _granules(self, ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """``ranges`` rounded out to whole granules (the last one may end at ``numel``), merged."""
        g = self.memory.granularity_numel
        return merge_ranges((lo // g * g, min(-(-hi // g) * g, self.memory.numel)) for lo, hi in ranges)

    def set_kept(self, ranges: list[tuple[int, int]]) -> None:
        """Mark every peers' element outside ``ranges`` as transient: :meth:`release_transient` gives it back
        once the switch has consumed it (canonical mode reads the gathered shards once, into its own tensors)."""
        transient = subtract_ranges(self.peer_ranges, self._granules(ranges))
        kept = subtract_ranges(self.peer_ranges, transient)
        self.pieces = sorted([(lo, hi, False) for lo, hi in kept] + [(lo, hi, True) for lo, hi in transient])

    def extend(self, start: int, end: int) -> None:
        """Add elements ``[start, end)`` (granule-aligned, past every range so far) to what is backed while rolling
        out, and back them now: a range that grows while in use (the CUDA-graph pool's segments, handed out during
        a capture). Contiguous growth stays one piece, so the next rollout maps it as one range.

        Makes no tensor and never synchronises: the graph pool calls it inside the caching allocator's lock."""
        assert not self.peer_ranges or start >= self.peer_ranges[-1][1], (start, self.peer_ranges)
        self.memory.map(start, end)
        self._touched = True
        self.peer_ranges = merge_ranges(self.peer_ranges + [(start, end)])
        if self.pieces and self.pieces[-1][1] == start and not self.pieces[-1][2]:
            self.pieces[-1] = (self.pieces[-1][0], end, False)
        else:
            self.pieces.append((start, end, False))

    @property
    def mapped_peer_bytes(self) -> int:
        """Peers' bytes backed now: all of them while rolling out, less the transient ones once released."""
        if not self._touched:
            return 0
        return self.peer_bytes - (0 if self.peers_mapped else self.transient_bytes)

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the whole range backed now (own part included)."""
        return self.memory.mapped_bytes

    @property
    def transient_bytes(self) -> int:
        return sum(hi - lo for lo, hi, t in self.pieces if t) * self.memory.element_size

    @property
    def tensor(self) -> torch.Tensor:
        return self.memory.tensor()[: self.numel]

    @property
    def peer_bytes(self) -> int:
        return sum(hi - lo for lo, hi in self.peer_ranges) * self.memory.element_size

    def map_peers(self) -> None:
        """Back the peers' ranges (each piece a mapping of its own, so that pieces are given back on their own)."""
        if self.peers_mapped:
            return
        self.memory.map_many([(lo, hi) for lo, hi, _ in self.pieces])
        self.peers_mapped = True
        self._touched = self._touched or bool(self.pieces)

    def _unmap(self, pieces: list[tuple[int, int, bool]], synchronize: bool) -> None:
        for i, (lo, hi, _) in enumerate(pieces):
            self.memory.unmap(lo, hi, synchronize=synchronize and i == 0)  # one device sync covers them all

    def release_transient(self, *, synchronize: bool = True) -> None:
        """Give back the transient pieces (after the switch has read them)."""
        transient = [p for p in self.pieces if p[2]]
        if transient:
            self._unmap(transient, synchronize)
            self.peers_mapped = False

    def unmap_peers(self, *, synchronize: bool = True) -> None:
        """``synchronize=False``: the caller has made sure that no queued kernel touches the peers' ranges."""
        if self.peers_mapped or self._touched:
            self._unmap(self.pieces, synchronize)  # pieces already released are not mapped: nothing to do there
            self.peers_mapped = self._touched = False

    def span(self) -> tuple[int, int]:
        """The address range ``[start, end)`` reserved for this buffer."""
        start = self.memory.data_ptr()
        return start, start + self.memory.reserved_bytes

    @property
    def closed(self) -> bool:
        return self.memory.closed

    def close(self) -> None:
        """Give the reservation back (its provider forgets it). Tensors over it must not be used afterwards."""
        self.memory.close()


class RolloutMemoryProvider(Protocol):
    """Where a component that needs memory only while generating (a KV cache, the sampling noise, a CUDA-graph
    pool) reserves it, and when that memory is backed."""

    def reserve(self, numel: int, dtype: torch.dtype, *, grows: bool = False,
                backend: str = "auto") -> RolloutBuffer:
        """A range of ``numel`` elements at an address fixed for its life, backed like every reservation of this
        provider (at once if they are backed now). ``grows``: nothing of it is backed until handed out by
        :meth:`RolloutBuffer.extend`. ``backend``: as :class:`~megatron_hybrid.memory.ReservedBuffer`'s.
        ``RolloutBuffer.close()`` gives it back."""
        ...

    def backed(self) -> ContextManager[None]:
        """Every reservation is backed for the body: one generate call. Re-entrant (an inner entry does nothing)."""
        ...


class PerCallRolloutMemory:
    """The lifetime of a generator without an engine: every reservation is backed for the duration of
    :meth:`backed` (one generate call) and given back after, at the same addresses.

    Args:
        device: where the reservations live.
    """

    #: A generate call's cache is given back after it: nothing is kept for the next call (no kept prefixes).
    keeps_between_calls = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[RolloutBuffer] = []
        self._depth = 0  # nested backed() bodies

    @property
    def buffers(self) -> list[RolloutBuffer]:
        """The reservations not yet closed."""
        self._buffers = [b for b in self._buffers if not b.closed]
        return self._buffers

    def reserve(self, numel: int, dtype: torch.dtype, *, grows: bool = False,
                backend: str = "auto") -> RolloutBuffer:
        buf = RolloutBuffer(numel, dtype, self.device, own=[], used=[] if grows else [(0, numel)], backend=backend)
        if self._depth:
            buf.map_peers()  # reserved inside a call: it needs the memory now
        self._buffers.append(buf)
        return buf

    @contextmanager
    def backed(self) -> Iterator[None]:
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        buffers = self.buffers
        try:
            for buf in buffers:
                buf.map_peers()
            self._depth = 1
            yield
        finally:
            self._depth = 0
            for buf in self.buffers:
                buf.unmap_peers()
