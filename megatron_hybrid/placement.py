"""Per-dtype flat buffers that hold the training shards in place and the peers' slots only while rolling out.

One ``RolloutBuffer`` per dtype spans the plan's regions (see :mod:`megatron_hybrid.plan`). The ranges that hold
this rank's own training tensors are backed for the engine's lifetime; every other range this rank takes part
in is backed at the switch to rollout and released at the switch back. Backing comes from
:mod:`megatron_hybrid.memory` (CUDA virtual memory on GPU, ``mmap`` + ``madvise`` on CPU): the address range is
reserved once, so tensors viewing it keep their addresses across switches.
"""

from __future__ import annotations

import warnings
from typing import Iterable, Optional

import torch

from .memory import subtract_ranges


def _merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


class RolloutBuffer:
    """A reserved flat range of ``numel`` elements: ``own`` ranges always backed, ``peer`` ranges on demand."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, *, own: list[tuple[int, int]],
                 used: list[tuple[int, int]]) -> None:
        self.dtype, self.device, self.numel = dtype, device, numel
        self._mem = _reserve(numel, dtype, device)
        # Round the own ranges out to whole granules: they stay backed; the peers' part is what is left.
        own_pages = self._granules(own)
        used_pages = self._granules(used)
        self.own_ranges = own_pages
        self.peer_ranges = subtract_ranges(used_pages, own_pages)
        # Peers' elements that share a granule with the own slots, hence stay backed while training.
        exact_own = _merge(own)
        self.resident_peer_bytes = (sum(hi - lo for lo, hi in own_pages) - sum(hi - lo for lo, hi in exact_own)) \
            * torch.empty((), dtype=dtype).element_size()
        for lo, hi in self.own_ranges:
            self._mem.map(lo, hi)
        self.peers_mapped = False
        self._touched = False  # some peers' range is (partly) mapped
        # The peers' ranges as pieces that are mapped and unmapped on their own: (lo, hi, transient). Transient
        # pieces are needed only during the switch (see set_kept); by default nothing is.
        self.pieces = [(lo, hi, False) for lo, hi in self.peer_ranges]

    def _granules(self, ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """``ranges`` rounded out to whole granules (the last one may end at ``numel``), merged."""
        g = self._mem.granularity  # elements per page/granule
        return _merge((lo // g * g, min(-(-hi // g) * g, self._mem.numel)) for lo, hi in ranges)

    def set_kept(self, ranges: list[tuple[int, int]]) -> None:
        """Mark every peers' element outside ``ranges`` as transient: :meth:`release_transient` gives it back
        once the switch has consumed it (canonical mode reads the gathered shards once, into its own tensors)."""
        transient = subtract_ranges(self.peer_ranges, self._granules(ranges))
        kept = subtract_ranges(self.peer_ranges, transient)
        self.pieces = sorted([(lo, hi, False) for lo, hi in kept] + [(lo, hi, True) for lo, hi in transient])

    @property
    def mapped_peer_bytes(self) -> int:
        """Peers' bytes backed now: all of them while rolling out, less the transient ones once released."""
        if not self._touched:
            return 0
        return self.peer_bytes - (0 if self.peers_mapped else self.transient_bytes)

    @property
    def transient_bytes(self) -> int:
        return sum(hi - lo for lo, hi, t in self.pieces if t) * self.tensor.element_size()

    @property
    def tensor(self) -> torch.Tensor:
        return self._mem.tensor()[: self.numel]

    @property
    def granularity(self) -> int:
        return self._mem.granularity

    @property
    def peer_bytes(self) -> int:
        return sum(hi - lo for lo, hi in self.peer_ranges) * self.tensor.element_size()

    def map_peers(self, start: int = 0, end: Optional[int] = None) -> None:
        """Back the peers' ranges that overlap elements ``[start, end)`` (rounded out to granules); by default all
        of them. Mapping region by region lets the host map the next region while the device gathers this one."""
        if self.peers_mapped or (end is not None and end <= start):
            return
        ((lo, hi),) = self._granules([(start, self._mem.numel if end is None else end)])
        for p_lo, p_hi, _ in self.pieces:  # each mapping stays inside one piece, so pieces unmap on their own
            a, b = max(p_lo, lo), min(p_hi, hi)
            if a < b:
                self._mem.map(a, b)
                self._touched = True
        if end is None:
            self.peers_mapped = True

    def _unmap(self, pieces: list[tuple[int, int, bool]], synchronize: bool) -> None:
        for i, (lo, hi, _) in enumerate(pieces):
            self._mem.unmap(lo, hi, synchronize=synchronize and i == 0)  # one device sync covers them all

    def release_transient(self, *, synchronize: bool = True) -> None:
        """Give back the transient pieces (after the switch has read them)."""
        transient = [p for p in self.pieces if p[2]]
        if transient:
            self._unmap(transient, synchronize)
            self.peers_mapped = False

    def unmap_peers(self, *, synchronize: bool = True) -> None:
        """``synchronize=False``: the caller has made sure that no queued kernel touches the peers' ranges."""
        if self.peers_mapped or self._touched:
            self._unmap(self.pieces, synchronize)
            self.peers_mapped = self._touched = False

    def close(self) -> None:
        self._mem.close()


def warn_once(message: str, _seen: set = set()) -> None:  # noqa: B006 - a process-wide memo on purpose
    if message not in _seen:
        _seen.add(message)
        warnings.warn(message, stacklevel=3)


class _Reservation:
    """Adapts :class:`megatron_hybrid.memory.ReservedBuffer` (element ranges, page-aligned)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        from .memory import ReservedBuffer

        self._buf = ReservedBuffer(numel, dtype, device=device)
        self.numel = numel
        self.granularity = self._buf.granularity_numel
        if not self._buf.releases_memory:
            warn_once(f"no releasable memory backend on {device}: peers' slots stay allocated while training")

    def tensor(self) -> torch.Tensor:
        return self._buf.tensor()

    def map(self, lo: int, hi: int) -> None:
        self._buf.map(lo, hi)

    def unmap(self, lo: int, hi: int, *, synchronize: bool = True) -> None:
        self._buf.unmap(lo, hi, synchronize=synchronize)

    def close(self) -> None:
        self._buf.close()


def _reserve(numel: int, dtype: torch.dtype, device: torch.device) -> _Reservation:
    return _Reservation(max(numel, 1), dtype, device)
