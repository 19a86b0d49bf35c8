"""Where every tensor lives, and which ranges are backed: the training shards, the peers' slots, rollout-only memory.

Where the bytes live (they move in :class:`megatron_hybrid.reshard.executor.PlanExecutor`, at every switch to rollout).
One :class:`~megatron_hybrid.memory.rollout.RolloutBuffer` per dtype spans the plan's regions
(:mod:`megatron_hybrid.reshard.plan`). At construction each training tensor of this rank moves, once, into its own slot,
and stays there: the own slots are backed for the engine's lifetime; every other range this rank takes part in (the
peers' slots) is backed at the switch to rollout and released at the switch back. Rollout-only ranges are reserved the
same way with no own part: canonical tensors, and what the generator reserves through :class:`EngineRolloutMemory` (the
engine's :class:`~megatron_hybrid.memory.rollout.RolloutMemoryProvider`: a KV cache, sampling noise, a CUDA-graph pool).
Backing comes from :mod:`megatron_hybrid.memory` (CUDA virtual memory on GPU, ``mmap`` + ``madvise`` on CPU): each
address range is reserved once, so tensors viewing it keep their addresses across switches, and the memory lives as
long as the buffer or any tensor viewing it. A buffer that holds training tensors in a layout of its own (Megatron
DDP's parameter buffer with the distributed optimizer: :class:`HeldBuffer`) moves whole into its own slot instead,
and its views (DDP's buckets, the parameters, the optimizer's shards) with it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from ..layout import ParallelLayout
from ..megatron.sharding import TPSpec
from ..memory import RolloutBuffer, allocation_granularity, merge_ranges
from .aliased import Blocks
from .exchange import ExchangePlan
from .plan import GroupPlan

# RolloutBuffer and merge_ranges lived here: importable from here still.
__all__ = ["DTYPES", "DTYPE_NAMES", "EngineRolloutMemory", "ExchangePlacement", "HeldBuffer", "Placement", "Placements",
           "RolloutBuffer", "merge_ranges"]

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


@dataclass
class HeldBuffer:
    """A flat buffer that holds training tensors in a layout of its own (Megatron DDP's parameter buffer with the
    distributed optimizer): it moves, whole, into its own slot (``MemberInfo.held`` in the plan)."""

    current: Callable[[], torch.Tensor]
    """The buffer now (1-D); read when needed, since a reference held here would be one more view of it."""
    move_to: Callable[[torch.Tensor], None]
    """Moves it into the given 1-D tensor of its numel: copies the values and points every view at the new place."""

    @property
    def numel(self) -> int:
        return self.current().numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.current().dtype


class Placement:
    """Where the training tensors, the peers' slots and the rollout-only memory of one rank live.

    ``plan`` is the micro-DP group's reshard plan and ``member`` this rank's index in it; where the group is one
    rank (t_g > t, or t_g = t and p_g = p) there is no plan (``None``): every rollout tensor is a sub-block of the
    rank's own training shard, or that shard itself, and nothing moves. ``held``: the rank's
    held buffers, in the plan's order; each becomes its own slot of its region as it is.
    """

    def __init__(self, plan: Optional[GroupPlan], member: int, train_params: dict[str, torch.nn.Parameter],
                 layout: ParallelLayout, *, rollout_tp_rank: int, device: torch.device,
                 held: Sequence[HeldBuffer] = ()) -> None:
        self.plan, self.member, self.layout = plan, member, layout
        self.train_params = train_params
        self.held = list(held)
        self.rollout_tp_rank = rollout_tp_rank
        self.device = device
        self.buffers: dict[str, RolloutBuffer] = {}
        self._rollout_only: list[RolloutBuffer] = []
        self.rolling_out = False  # between map_rollout() and unmap_rollout()
        self.closed = False
        self.placed: list[str] = []  # the training tensors that live in this rank's buffers
        self._canonical_ids: set[int] = set()
        self._fp8_ids: set[int] = set()
        self._kept: Optional[dict[str, list[tuple[int, int]]]] = None  # see keep_only
        self.sources = plan.sources(member) if plan is not None else {}
        if plan is not None:
            self._place_training_tensors()

    @staticmethod
    def alignment(device: torch.device) -> dict[str, int]:
        """Elements per granule for every dtype (``align_slots=True``)."""
        granule = allocation_granularity(device)
        return {name: max(1, granule // torch.empty((), dtype=dt).element_size()) for name, dt in DTYPES.items()}

    def _place_training_tensors(self) -> None:
        """Move each training tensor of this rank into its own slot (a one-time copy at construction); a held
        buffer moves whole."""
        j = self.member
        mine = self.plan.by_name[j]
        for dtype, regions in self.plan.regions.items():
            own, used = [], []
            for reg in regions:
                if j not in reg.members:
                    continue
                used.append((reg.offset, reg.offset + reg.numel))
                if reg.kind == "strided":
                    continue  # the rollout tensor itself: no own slot (the own shard is gathered into it)
                if reg.kind != "broadcast" or reg.owner == j:
                    lo = reg.slot_offset(j)
                    own.append((lo, lo + reg.slot_numel))
            buf = RolloutBuffer(self.plan.buffer_numel(dtype), DTYPES[dtype], self.device, own=own, used=used)
            self.buffers[dtype] = buf
            flat = buf.tensor
            for reg in regions:
                if reg.held is not None:
                    held = self.held[reg.held]
                    lo = reg.slot_offset(j)
                    held.move_to(flat[lo: lo + held.numel])
                    continue
                for sl in reg.slices:
                    if sl.member != j or mine[sl.name].held is not None:
                        continue
                    prm = self.train_params[sl.name]
                    view = flat[sl.offset: sl.offset + sl.numel].view(sl.shape)
                    with torch.no_grad():
                        view.copy_(prm.data)
                    prm.data = view  # the buffer's memory now lives as long as this parameter views it
                    self.placed.append(sl.name)

    # -- where tensors are -------------------------------------------------------------------------------------
    def where(self, member: int, name: str) -> tuple[str, int]:
        """(dtype, offset) of ``member``'s training tensor ``name`` in the buffers."""
        return self.plan.where(member, name)

    def slot_view(self, member: int, name: str) -> torch.Tensor:
        """``member``'s training tensor ``name`` as it lies in this rank's buffers (its own, or a peer's slot)."""
        dtype, off = self.plan.where(member, name)
        info = self.plan.by_name[member][name]
        return self.buffers[dtype].tensor[off: off + info.numel].view(info.shape)

    def blocks(self, name: str) -> Blocks:
        """The rollout parameter ``name`` as views of training tensors (own, or in peers' slots)."""
        lay = self.layout
        if self.plan is None:  # t_g > t: a sub-block of the own shard; t_g = t, p_g = p: the own shard
            prm = self.train_params[name]
            spec = TPSpec.of(prm)
            if not spec.sharded or lay.m == 1:
                return Blocks([prm.data], 0, 1)
            j = self.rollout_tp_rank % lay.m
            pieces = prm.data.chunk(spec.stride * lay.m, dim=spec.dim)
            return Blocks([pieces[s * lay.m + j] for s in range(spec.stride)], spec.dim, 1)
        if name in self.plan.strided:  # gathered straight into the rollout tensor's layout
            dtype, reg = self.plan.strided[name]
            info = self.plan.by_name[self.member][name]
            shape = (info.shape[0] * len(reg.members), *info.shape[1:])
            return Blocks([self.buffers[dtype].tensor[reg.offset: reg.offset + reg.numel].view(shape)], 0, 1)
        src = self.sources[name]
        views = [self.train_params[b.name].data if b.member == self.member else self.slot_view(b.member, b.name)
                 for b in src.blocks]
        stacked = self._stacked(views, src.dim, src.stride)
        if stacked is not None:
            return Blocks([stacked], 0, 1)
        return Blocks(views, src.dim, src.stride if len(views) > 1 else 1)

    @staticmethod
    def _stacked(views: list[torch.Tensor], dim: int, stride: int) -> Optional[torch.Tensor]:
        """The blocks as one tensor when they lie back to back in one buffer in canonical order along dim 0 (the
        plan gives such shards a region of their own): the gathered region is then the rollout tensor."""
        if len(views) < 2 or dim != 0 or stride != 1 or not all(v.is_contiguous() for v in views):
            return None
        first = views[0]
        if any(v.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for v in views):
            return None
        size = first.element_size()
        end = first.data_ptr()
        for v in views:
            if v.data_ptr() != end or v.shape[1:] != first.shape[1:]:
                return None
            end += v.numel() * size
        rows = sum(v.shape[0] for v in views)
        start = first.storage_offset()
        return first.new_empty(0).set_(first.untyped_storage(), start, (rows, *first.shape[1:]))

    def peer_ranges(self, name: str) -> list[tuple[str, int, int]]:
        """(dtype, start, end) of the peers' slots that rollout parameter ``name`` views directly: the peer's slot
        it is, or the peers' shards of a stacked one (see :meth:`blocks`); empty if it is computed from them."""
        if self.plan is None:
            return []
        if name in self.plan.strided:
            dtype, reg = self.plan.strided[name]
            return [(dtype, reg.offset, reg.offset + reg.numel)]
        blocks = self.sources[name].blocks
        if len(blocks) > 1 and self._stacked([self.slot_view(b.member, b.name) for b in blocks],
                                             self.sources[name].dim, self.sources[name].stride) is None:
            return []
        out = []
        for b in blocks:
            if b.member != self.member:
                dtype, off = self.plan.where(b.member, b.name)
                out.append((dtype, off, off + self.plan.by_name[b.member][b.name].numel))
        return out

    def keep_only(self, viewed: dict[str, list[tuple[int, int]]]) -> None:
        """Only the ``viewed`` peers' ranges are needed after the switch; the rest is released once read."""
        self._kept = viewed
        for dtype, buf in self.buffers.items():
            buf.set_kept(viewed.get(dtype, []))

    @property
    def rollout_only(self) -> list[RolloutBuffer]:
        """The rollout-only ranges not yet closed (a generator closes its own reservations)."""
        self._rollout_only = [b for b in self._rollout_only if not b.closed]
        return self._rollout_only

    def reserve_rollout(self, numel: int, dtype: torch.dtype, *, canonical: bool = False, fp8: bool = False,
                        grows: bool = False, backend: str = "auto") -> RolloutBuffer:
        """A range of its own, backed only while rolling out (by :meth:`map_rollout`; at once if rolling out now).
        ``canonical``: it holds canonical rollout tensors; ``fp8``: FP8 rollout weights and their scales (each
        reported apart from other rollout memory). ``grows``: nothing is backed until :meth:`RolloutBuffer.extend`
        hands it out."""
        assert not self.closed and not (canonical and fp8)
        buf = RolloutBuffer(numel, dtype, self.device, own=[], used=[] if grows else [(0, numel)], backend=backend)
        self._rollout_only.append(buf)
        if canonical:
            self._canonical_ids.add(id(buf))
        if fp8:
            self._fp8_ids.add(id(buf))
        if self.rolling_out:
            buf.map_peers()
        return buf

    # -- backing -------------------------------------------------------------------------------------------
    def map_rollout(self) -> None:
        """Back the peers' slots and every rollout-only range."""
        self.rolling_out = True
        for buf in list(self.buffers.values()) + self.rollout_only:
            buf.map_peers()

    def release_transient(self) -> None:
        """Give back the peers' slots that no rollout tensor views (the caller has synchronised)."""
        for buf in self.buffers.values():
            buf.release_transient(synchronize=False)

    def unmap_rollout(self) -> None:
        """Release everything that only rolling out needs (the caller has synchronised)."""
        for buf in list(self.buffers.values()) + self.rollout_only:
            buf.unmap_peers(synchronize=False)
        self.rolling_out = False

    def detach_training_tensors(self) -> None:
        """Give every training tensor (and held buffer) ordinary memory again, one copy: before :meth:`close`."""
        with torch.no_grad():
            for name in self.placed:
                prm = self.train_params[name]
                prm.data = prm.data.clone()
            for held in self.held:
                held.move_to(torch.empty(held.numel, dtype=held.dtype, device=self.device))
        self.placed = []

    def close(self) -> None:
        for buf in list(self.buffers.values()) + self.rollout_only:
            buf.close()
        self.buffers, self._rollout_only, self._canonical_ids, self._fp8_ids = {}, [], set(), set()
        self.rolling_out, self.closed = False, True

    # -- accounting ----------------------------------------------------------------------------------------
    def spans(self) -> list[tuple[int, int]]:
        """Every reserved address range of this rank's engine (gather buffers and rollout-only ranges)."""
        return [b.span() for b in list(self.buffers.values()) + self.rollout_only]

    def _strided_bytes_mapped(self) -> int:
        """Bytes of the strided regions (canonical rollout tensors inside the gather buffers) backed now: those
        that a rollout parameter views (with FP8 rollout weights an fc1 region is only read by the quantization,
        and given back with the other transient ranges)."""
        if self.plan is None:
            return 0
        return sum(reg.numel * self.buffers[dtype].memory.element_size for dtype, reg in self.plan.strided.values()
                   if self.buffers[dtype].mapped_peer_bytes and (
                       self._kept is None or (reg.offset, reg.offset + reg.numel) in self._kept.get(dtype, [])))

    def rollout_bytes_mapped(self) -> int:
        """Every byte backed now beyond what stays while training: the peers' slots, canonical and FP8 tensors,
        the rollout memory reservations."""
        return sum(b.mapped_peer_bytes for b in self.buffers.values()) + sum(
            b.peer_bytes for b in self.rollout_only if b.peers_mapped)

    def report(self) -> dict[str, int]:
        strided = self._strided_bytes_mapped()
        special = self._canonical_ids | self._fp8_ids
        return {
            "peer_bytes_mapped": sum(b.mapped_peer_bytes for b in self.buffers.values()) - strided,
            "transient_bytes_released": sum(b.transient_bytes for b in self.buffers.values()),
            "canonical_bytes_mapped": strided + sum(b.peer_bytes for b in self.rollout_only
                                                    if b.peers_mapped and id(b) in self._canonical_ids),
            "fp8_bytes_mapped": sum(b.peer_bytes for b in self.rollout_only
                                    if b.peers_mapped and id(b) in self._fp8_ids),
            "rollout_memory_bytes_mapped": sum(b.peer_bytes for b in self.rollout_only
                                               if b.peers_mapped and id(b) not in special),
            "resident_peer_bytes": sum(b.resident_peer_bytes for b in self.buffers.values()),
        }


class ExchangePlacement(Placement):
    """The placement of an exchange layout (:mod:`megatron_hybrid.reshard.exchange`): the training tensors stay where
    they are (views of them are the rollout pieces the rank holds), and one receive buffer per dtype, backed only while
    rolling out, holds the pieces it misses, each a contiguous tensor, in the order the all-to-all delivers them.

    Args:
        plan: the exchange plan (the same on every rank); ``rank``: this rank.
        train_params: this rank's training parameters by global name.
        keys: global name -> plan key, for this rank's training and rollout parameters (a tied output layer is
            the embedding).
    """

    def __init__(self, plan: ExchangePlan, rank: int, train_params: dict[str, torch.nn.Parameter],
                 layout: ParallelLayout, *, keys: dict[str, str], rollout_tp_rank: int,
                 device: torch.device) -> None:
        super().__init__(None, rank, train_params, layout, rollout_tp_rank=rollout_tp_rank, device=device)
        self.exchange, self.rank, self.keys = plan, rank, keys
        self._own = {keys[name]: name for name in train_params}
        self._offsets = plan.receive_offsets(rank)
        for dtype, numel in plan.received_numel(rank).items():
            if numel:
                self.buffers[dtype] = RolloutBuffer(numel, DTYPES[dtype], device, own=[], used=[(0, numel)])

    def _piece_view(self, index: int) -> torch.Tensor:
        dtype, off = self._offsets[index]
        piece = self.exchange.pieces[index]
        return self.buffers[dtype].tensor[off: off + piece.numel].view(piece.shape)

    def blocks(self, name: str) -> Blocks:
        """The rollout parameter ``name`` as views: of the own training tensor, and of received pieces."""
        key = self.keys[name]
        info = self.exchange.tensors[key]
        views = []
        for run in self.exchange.runs[self.rank][key]:
            if run.piece is not None:
                views.append(self._piece_view(run.piece))
                continue
            views.append(self.exchange.view_of(self.train_params[self._own[key]].data, key,
                                               self.exchange.source_tp(self.rank, key), run.part, run.lo, run.hi))
        if len(views) > 1:
            merged = self._stacked(views, info.dim, 1)
            if merged is not None:
                return Blocks([merged], 0, 1)
        return Blocks(views, info.dim if info.sharded else 0, 1)

    def peer_ranges(self, name: str) -> list[tuple[str, int, int]]:
        """The received pieces that rollout parameter ``name`` views directly: one piece, or several that
        :meth:`blocks` merged into one view because they arrived back to back (SwiGLU fc1's gate and up parts from
        one sender); empty where it is the own tensor or computed from several views."""
        runs = self.exchange.runs[self.rank][self.keys[name]]
        if any(run.piece is None for run in runs) or len(self.blocks(name).views) != 1:
            return []
        out = []
        for run in runs:
            dtype, off = self._offsets[run.piece]
            out.append((dtype, off, off + self.exchange.pieces[run.piece].numel))
        return out


class EngineRolloutMemory:
    """The engine's :class:`~megatron_hybrid.memory.rollout.RolloutMemoryProvider`: reservations are rollout-only
    ranges of its :class:`Placement`, backed from every switch to rollout until the switch back, like the peers'
    slots. Its generate-call context is the one place a generate call switches the engine to rollout; the engine
    then stays there after the call (until ``switch_to_training()``), so its reservations stay backed between two
    generate calls of one rollout.

    Args:
        placement: the engine's placement (where the reservations live).
        switch_to_rollout: the engine's switch (a no-op when it is rolling out already).
    """

    def __init__(self, placement: Placement, switch_to_rollout: Callable[[], None]) -> None:
        self.placement = placement
        self._switch_to_rollout = switch_to_rollout
        self._depth = 0  # nested backed() bodies

    def reserve(self, numel: int, dtype: torch.dtype, *, grows: bool = False,
                backend: str = "auto") -> RolloutBuffer:
        if self.placement.closed:
            raise RuntimeError("the engine was closed")
        return self.placement.reserve_rollout(numel, dtype, grows=grows, backend=backend)

    @contextmanager
    def backed(self) -> Iterator[None]:
        if not self._depth:
            self._switch_to_rollout()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1


class Placements:
    """A rank's placements seen as one: one :class:`Placement` per *plane*, a set of tensors with a micro group of
    its own (the dense tensors over the micro-DP group; an MoE model's routed experts over the micro-EP group, whose
    buffers are keyed ``experts/<dtype>`` in :attr:`buffers`). Rollout-only memory is reserved in the first plane.

    Args:
        planes: the placement of each plane, the dense one first.
        plane_of: the plane of a tensor's global name.
    """

    def __init__(self, planes: dict[str, Placement], plane_of: Callable[[str], str]) -> None:
        self.planes = planes
        self._plane_of = plane_of
        self.primary = next(iter(planes.values()))

    def of(self, name: str) -> Placement:
        """The placement of the plane that tensor ``name`` belongs to."""
        return self.planes[self._plane_of(name)]

    @property
    def plan(self) -> Optional[GroupPlan]:
        """The dense plane's plan."""
        return self.primary.plan

    @property
    def buffers(self) -> dict[str, RolloutBuffer]:
        """Every plane's gather buffers, by dtype (``plane/dtype`` beyond the first plane)."""
        first = next(iter(self.planes))
        return {(dtype if plane == first else f"{plane}/{dtype}"): buf
                for plane, placement in self.planes.items() for dtype, buf in placement.buffers.items()}

    @property
    def closed(self) -> bool:
        return self.primary.closed

    @property
    def rolling_out(self) -> bool:
        return self.primary.rolling_out

    @property
    def rollout_only(self) -> list[RolloutBuffer]:
        return [buf for placement in self.planes.values() for buf in placement.rollout_only]

    def reserve_rollout(self, numel: int, dtype: torch.dtype, **kwargs) -> RolloutBuffer:
        """See :meth:`Placement.reserve_rollout` (in the first plane)."""
        return self.primary.reserve_rollout(numel, dtype, **kwargs)

    def map_rollout(self) -> None:
        for placement in self.planes.values():
            placement.map_rollout()

    def release_transient(self) -> None:
        for placement in self.planes.values():
            placement.release_transient()

    def unmap_rollout(self) -> None:
        for placement in self.planes.values():
            placement.unmap_rollout()

    def detach_training_tensors(self) -> None:
        for placement in self.planes.values():
            placement.detach_training_tensors()

    def close(self) -> None:
        for placement in self.planes.values():
            placement.close()

    def spans(self) -> list[tuple[int, int]]:
        return [span for placement in self.planes.values() for span in placement.spans()]

    def rollout_bytes_mapped(self) -> int:
        return sum(placement.rollout_bytes_mapped() for placement in self.planes.values())

    def report(self) -> dict[str, int]:
        reports = [placement.report() for placement in self.planes.values()]
        return {key: sum(r[key] for r in reports) for key in reports[0]}
