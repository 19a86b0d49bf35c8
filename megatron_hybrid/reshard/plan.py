"""The reshard plan: which bytes move where, and where every rollout parameter's blocks live. Pure arithmetic.

Inputs are plain descriptions of parameters (``ParamInfo``) gathered once from the ranks of a micro-DP group;
the output (``GroupPlan``) is identical on every member, so each member can execute its part without further
agreement (the gather of the descriptions and the execution: :mod:`megatron_hybrid.reshard.executor`). Buffers are
laid out per dtype as a list of *regions*:

- ``gather`` regions (one per bucket): d_g equal slots in micro-DP order; member j's training tensors live in
  slot j, so a switch is one in-place ``all_gather_into_tensor`` per bucket. They hold the tensor-parallel
  shards that every member has a counterpart of (all of them when q = 1; the transformer layers when q > 1).
- ``stage_gather`` regions (q > 1 only): q slots over the cross-stage group, for TP-replicated layer tensors
  (norm weights, row-parallel biases), which TP peers already share.
- ``broadcast`` regions (q > 1 only): tensors that exist on one training stage only (embedding, output layer,
  final norm), sent in place by their owner; TP-sharded ones of equal size on every member (an untied embedding
  and output layer) travel instead as one more ``gather`` region.

A rank receives exactly the bytes of its rollout shard that it does not hold: (d_g − 1) slots of every gather
region, (q − 1) of every stage_gather region and every broadcast region it does not own.

In canonical mode (``strided=True``, q = 1) a tensor sharded along dim 0 with interleaved parts (SwiGLU's fc1: each
shard is [gate_j; up_j], the rollout tensor [gate_0 … gate_k-1; up_0 … up_k-1]) gets a ``strided`` region of its
own, laid out as the rollout tensor: part i of every member side by side, each part gathered straight from the
members' training tensors (one all-gather per part). The region is then the canonical rollout tensor: no peers'
slots and no copy; the own shard is not placed there (its copy in the region is part of the rollout tensor).

A buffer that already holds a member's parameters in a layout of its own (Megatron DDP's parameter buffer with the
distributed optimizer, ``MemberInfo.held``) is that member's slot of one more gather region, as it is: the
optimizer's all-gather then writes the own slot directly. Such a region also carries what the rollout shard does
not need from the peers (their TP-replicated tensors, DDP's padding).
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass, field
from typing import Optional, Union

_LAYER = re.compile(r"^(?P<prefix>.*?layers)\.(?P<idx>\d+)\.(?P<rest>.+)$")


@dataclass(frozen=True)
class ParamInfo:
    """One training parameter of one rank, as the plan sees it."""

    name: str
    """Global name (layer indices counted from the first layer of the model)."""
    local_name: str
    """The name inside the rank's model chunk."""
    shape: tuple[int, ...]
    dtype: str
    sharded: bool
    dim: int = 0
    stride: int = 1
    held: Optional[tuple[int, int]] = None
    """(i, offset): the tensor lies in the member's held buffer i, ``offset`` elements from its start (see
    :class:`MemberInfo`); ``None``: the plan places it."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class MemberInfo:
    """A micro-DP member: its training coordinates and parameters (in module order)."""

    rank: int
    tp: int
    """The member's tensor-parallel rank: training TP for dense tensors, expert TP for routed experts."""
    pp: int
    params: tuple[ParamInfo, ...]
    layers_per_stage: int
    held: tuple[tuple[str, int], ...] = ()
    """(dtype, numel) of each flat buffer that holds parameters in a layout of its own (Megatron DDP's parameter
    buffer with the distributed optimizer): it is the member's slot of a gather region as a whole."""
    ep: int = 0
    """The member's expert-parallel rank (routed experts; 0 for dense tensors)."""


@dataclass
class Slice:
    """``numel`` elements at ``offset`` of a dtype's buffer holding parameter ``name`` of member ``member``."""

    member: int  # index into the group's members
    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]


class RegionKind(enum.StrEnum):
    """What a region is, and so which collective fills it (see the module docstring). A ``str`` enum: a kind
    compares equal to, and hashes as, its name."""

    GATHER = "gather"
    STAGE_GATHER = "stage_gather"
    BROADCAST = "broadcast"
    STRIDED = "strided"


@dataclass
class Region:
    """A contiguous part of one dtype's buffer that one collective fills."""

    kind: RegionKind
    offset: int
    slot_numel: int
    members: list[int]  # member indices of the collective's group, in group-rank order
    owner: Optional[int] = None  # for broadcasts
    slices: list[Slice] = field(default_factory=list)
    held: Optional[int] = None  # the held buffer that each member's slot is (its first elements), if any
    tensor: Optional[str] = None  # strided: the one tensor (global name) it is, whose stride gives its parts
    stride: int = 1

    @property
    def numel(self) -> int:
        return self.slot_numel * (1 if self.kind == RegionKind.BROADCAST else len(self.members))

    def slot_offset(self, member: int) -> int:
        if self.kind == RegionKind.BROADCAST:
            return self.offset
        return self.offset + self.members.index(member) * self.slot_numel


@dataclass
class Block:
    """Where a block of a rollout parameter lives: a training tensor of some member."""

    member: int
    name: str


@dataclass
class RolloutSource:
    """The blocks that make one rollout parameter, in canonical order along ``dim``."""

    blocks: list[Block]
    sharded: bool
    dim: int
    stride: int  # Megatron's partition_stride of the parameter: how the stacked blocks interleave


@dataclass
class GroupPlan:
    members: list[MemberInfo]
    regions: dict[str, list[Region]]  # per dtype
    stage_of: dict[str, int]  # rollout parameter (global name) -> stage offset b of its training tensors
    at: dict[tuple[int, int, int], int]  # (tp offset a, stage offset b, expert-parallel offset c) -> member index
    k: int
    by_name: list[dict[str, ParamInfo]]
    tied: Optional[tuple[str, str]] = None
    """(output layer, embedding) when the last training stage's tied output layer serves the rollout embedding."""
    q: int = 1

    @functools.cached_property
    def strided(self) -> dict[str, tuple[str, Region]]:
        """Rollout parameter -> (dtype, its ``strided`` region): the tensors gathered straight into their layout."""
        return {reg.tensor: (dtype, reg) for dtype, regs in self.regions.items() for reg in regs
                if reg.kind == RegionKind.STRIDED}

    def sources(self, member: int) -> dict[str, RolloutSource]:
        """The blocks of every rollout parameter as ``member`` reads them, in canonical order.

        A TP-sharded parameter is the k shards of the TP ranks that hold it (its stage's; a routed expert's: its
        expert-parallel rank's), stacked along ``partition_dim`` in TP order; a replicated one is the copy of the
        member's own TP column (which its cross-stage group delivered).
        """
        me = self.members[member]
        out = {}
        for name in self.stage_of:
            owners = sorted((j for j, params in enumerate(self.by_name) if name in params),
                            key=lambda j: self.members[j].tp)
            src = self.by_name[owners[0]][name]
            if src.sharded:
                assert len(owners) == self.k, (name, owners)
                blocks = [Block(j, name) for j in owners]
                if self.tied is not None and name == self.tied[1]:
                    # Megatron keeps the last stage's tied output layer equal to the embedding: its own copy is
                    # the block, not a peer's.
                    blocks = [Block(member, self.tied[0]) if self.at[(a, self.q - 1, 0)] == member else blk
                              for a, blk in enumerate(blocks)]
                out[name] = RolloutSource(blocks, True, src.dim, src.stride)
            else:
                column = next(j for j in owners if self.members[j].tp == me.tp)
                out[name] = RolloutSource([Block(column, name)], False, 0, 1)
        return out

    def buffer_numel(self, dtype: str) -> int:
        regs = self.regions.get(dtype, [])
        return max((r.offset + r.numel for r in regs), default=0)

    def where(self, member: int, name: str) -> tuple[str, int]:
        """(dtype, offset) of member's tensor ``name`` in the buffers, if it is placed there."""
        index = self.__dict__.get("_where")
        if index is None:  # built once: the plan does not change
            index = {(sl.member, sl.name): (dtype, sl.offset) for dtype, regs in self.regions.items()
                     for reg in regs for sl in reg.slices}
            self.__dict__["_where"] = index
        return index[(member, name)]

    def received_numel(self, member: int) -> dict[str, int]:
        """Elements per dtype that ``member`` receives in a switch."""
        out: dict[str, int] = {}
        for dtype, regs in self.regions.items():
            n = 0
            for reg in regs:
                if member not in reg.members:
                    continue
                if reg.kind == RegionKind.BROADCAST:
                    n += 0 if reg.owner == member else reg.slot_numel
                else:
                    n += reg.slot_numel * (len(reg.members) - 1)
            out[dtype] = n
        return out

    def collectives(self, member: int) -> int:
        return sum(1 for regs in self.regions.values() for reg in regs if member in reg.members
                   and len(reg.members) > 1)


def _pair_key(info: ParamInfo, layers_per_stage: int) -> tuple:
    """What a tensor corresponds to on the other members: a layer tensor by its place in the stage and its name
    inside the layer as the member's chunk names it (a routed expert by its local index); others by name."""
    m = _LAYER.match(info.name)
    if m is None:
        return ("stage", info.name)
    local = _LAYER.match(info.local_name)
    return ("layer", int(m.group("idx")) % layers_per_stage, m.group("prefix"),
            (local or m).group("rest"))


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def build_group_plan(members: list[MemberInfo], needed: list[str], *, k: int, q: int,
                     bucket_numel: Union[int, dict[str, int]], alignment: Optional[dict[str, int]] = None,
                     tied: Optional[tuple[str, str]] = None, strided: bool = False, u: int = 1,
                     bucket_per_layer: bool = False) -> GroupPlan:
    """Plan the switch for one micro-DP group (or, for an MoE model's routed experts, one micro-EP group).

    ``members`` are ordered by global rank (the group-rank order of torch process groups); member j sits at
    training coordinates (tp, pp, ep). ``needed`` lists the global names of the rollout parameters that the group's
    rollout shard consists of. ``k``, ``q`` as in :mod:`megatron_hybrid.layout`; for routed experts k = ke (expert
    TP shards per rollout shard) and ``u`` = ue (expert-parallel ranks whose experts a rollout rank holds: the
    members at different ep hold different experts, each gathered like a layer of another stage). ``alignment``
    (elements per dtype) pads every slot, so that slots can be mapped and unmapped page by page; the padding then
    travels too.
    ``tied`` = (output layer, embedding) names when the embedding is tied and every stage is gathered into one
    (p_g = 1 < p): the last stage's output layer is a copy of the embedding, so its ranks receive no embedding;
    each embedding shard is broadcast to the other members only (the layout's ``tied_embedding_groups``).
    ``strided``: interleaved dim-0 shards get ``strided`` regions (canonical mode; see the module docstring).
    ``bucket_per_layer``: one gather bucket per layer, whatever its size (routed experts: a layer's experts then lie
    at one stride across the members' slots, each expert's weights after the previous one's, so the rollout
    layer's experts are one strided 3-D view for a grouped GEMM).
    """
    if len(members) != k * q * u:
        raise AssertionError(f"micro-DP group of {len(members)} members, expected {k} × {q} × {u}")
    plan = _PlanBuilder(members, needed, k=k, q=q, u=u, alignment=alignment)
    plan.gather_regions(bucket_numel, strided=strided, bucket_per_layer=bucket_per_layer)
    if q > 1 or u > 1:
        plan.stage_gather_regions(bucket_numel)
    if q > 1:
        plan.stage_only_regions(tied)
    return GroupPlan(members, plan.regions, plan.needed_stage, plan.at, k, plan.by_name, tied, q)


class _PlanBuilder:
    """The regions of one group's plan, laid out dtype by dtype in the order :func:`build_group_plan` asks for
    them (that order is the plan: every member builds the same)."""

    def __init__(self, members: list[MemberInfo], needed: list[str], *, k: int, q: int, u: int,
                 alignment: Optional[dict[str, int]]) -> None:
        self.members, self.k, self.q, self.u, self.alignment = members, k, q, u, alignment or {}
        self.tp0, self.pp0, self.ep0 = (min(m.tp for m in members), min(m.pp for m in members),
                                        min(m.ep for m in members))
        self.at: dict[tuple[int, int, int], int] = {(m.tp - self.tp0, m.pp - self.pp0, m.ep - self.ep0): j
                                                    for j, m in enumerate(members)}
        self.by_name = [{p.name: p for p in m.params} for m in members]
        self.everyone = list(range(len(members)))
        # Which rollout parameters exist, and where (which stage offset b) their training tensors live.
        self.needed_stage: dict[str, int] = {}
        for need in needed:
            owners = [j for j in self.everyone if need in self.by_name[j]]
            if not owners:
                raise ValueError(f"no member of the micro-DP group holds {need}")
            self.needed_stage[need] = members[owners[0]].pp - self.pp0
        self.regions: dict[str, list[Region]] = {}
        self.offsets: dict[str, int] = {}
        _held_regions(members, self.regions, self.offsets, alignment)

    def wanted(self, p: ParamInfo) -> bool:
        return p.name in self.needed_stage and p.held is None  # held tensors travel with their buffer

    def add_region(self, dtype: str, kind: RegionKind, group: list[int], per_member: dict[int, list[ParamInfo]],
                   owner: Optional[int] = None) -> None:
        sizes = {j: sum(p.numel for p in ps) for j, ps in per_member.items()}
        slot = _align(max(sizes.values()), self.alignment.get(dtype, 1))
        if kind != RegionKind.BROADCAST and len(set(sizes.values())) != 1:
            raise AssertionError(f"uneven {kind} slots {sizes}")
        reg = Region(kind, self.offsets.get(dtype, 0), slot, group, owner)
        for j, ps in per_member.items():
            off = reg.slot_offset(j)
            for p in ps:
                reg.slices.append(Slice(j, p.name, off, p.numel, p.shape))
                off += p.numel
        self.regions.setdefault(dtype, []).append(reg)
        self.offsets[dtype] = reg.offset + reg.numel

    def gather_regions(self, bucket_numel: Union[int, dict[str, int]], *, strided: bool,
                       bucket_per_layer: bool) -> None:
        """1. gather regions: TP shards with a counterpart on every member, bucketed (``strided``: interleaved
        dim-0 shards straight into the rollout tensor's layout)."""
        members, k, q, u = self.members, self.k, self.q, self.u
        even: dict[int, list[ParamInfo]] = {}
        for j, m in enumerate(members):
            even[j] = [p for p in m.params if p.sharded and self.wanted(p)
                       and (q == 1 or _pair_key(p, m.layers_per_stage)[0] == "layer")]
        keys = {j: [(_pair_key(p, members[j].layers_per_stage), p.numel, p.dtype) for p in ps]
                for j, ps in even.items()}
        if len({tuple(v) for v in keys.values()}) != 1:
            raise ValueError("the micro-DP members' tensor-parallel parameters do not correspond one to one; "
                             "every pipeline stage must hold the same number of identical layers")
        # Strided regions need the members in shard order (member a holds shard a), as Megatron's rank order gives.
        if strided and q == 1 and u == 1 and k > 1 and all(self.at.get((a, 0, 0)) == a for a in range(k)):
            first = even[0]
            direct = {i for i, p in enumerate(first) if p.dim == 0 and p.stride > 1 and p.numel % p.stride == 0
                      and p.numel * k >= STACKED_MIN_NUMEL}
            for i in sorted(direct):
                p = first[i]
                reg = Region(RegionKind.STRIDED, self.offsets.get(p.dtype, 0), p.numel, self.everyone,
                             tensor=p.name, stride=p.stride)
                self.regions.setdefault(p.dtype, []).append(reg)
                # Padded to whole granules, so that the region's pages are its own (released with it).
                self.offsets[p.dtype] = reg.offset + _align(reg.numel, self.alignment.get(p.dtype, 1))
            even = {j: [p for i, p in enumerate(ps) if i not in direct] for j, ps in even.items()}
        _bucketed(even, None if bucket_per_layer else bucket_numel,
                  lambda dtype, per: self.add_region(dtype, RegionKind.GATHER, self.everyone, per),
                  alone=lambda p: _stacks_whole(p, k, self.alignment.get(p.dtype, 1)),
                  group=(lambda p: _pair_key(p, members[0].layers_per_stage)[:2]) if bucket_per_layer else None)

    def stage_gather_regions(self, bucket_numel: Union[int, dict[str, int]]) -> None:
        """2. stage_gather regions: TP-replicated layer tensors, exchanged within a TP column: the other stages'
        layers, and (u > 1) the other expert-parallel ranks' experts (a routed expert's replicated tensor, say its
        fc2 bias, is the same on every expert-TP rank but each expert's own)."""
        for a in range(self.k):
            group = sorted(self.at[(a, b, c)] for b in range(self.q) for c in range(self.u))
            rep = {j: [p for p in self.members[j].params if not p.sharded and self.wanted(p)
                       and _pair_key(p, self.members[j].layers_per_stage)[0] == "layer"] for j in group}
            _bucketed(rep, bucket_numel,
                      lambda dtype, per, group=group: self.add_region(dtype, RegionKind.STAGE_GATHER, group, per))

    def _stage_only(self, j: int, sharded: bool, dtype: str) -> list[ParamInfo]:
        m = self.members[j]
        return [p for p in m.params if _pair_key(p, m.layers_per_stage)[0] == "stage" and p.sharded == sharded
                and self.wanted(p) and p.dtype == dtype]

    def stage_only_regions(self, tied: Optional[tuple[str, str]]) -> None:
        """3. tensors of one stage only (embedding, output layer, final norm). TP-sharded ones go to every member:
        when every member holds the same number of elements of them (untied embedding and output layer of equal
        size), one gather region moves them all; otherwise each owner broadcasts its own. Replicated ones go to the
        owner's cross-stage group."""
        members, everyone = self.members, self.everyone
        dtypes = sorted({p.dtype for m in members for p in m.params})
        for dtype in dtypes:
            per = {j: self._stage_only(j, True, dtype) for j in everyone}
            sizes = {sum(p.numel for p in ps) for ps in per.values()}
            if len(sizes) == 1 and sizes != {0} and all(per.values()):
                self.add_region(dtype, RegionKind.GATHER, everyone, per)
            else:
                for j, ps in per.items():
                    if ps:
                        self._broadcast_stage_shards(dtype, j, ps, tied)
            if tied is not None:
                # The tied output layer, placed in its rank's own slot (no collective): it serves the embedding.
                for j, m in enumerate(members):
                    out = [p for p in m.params if p.name == tied[0] and p.dtype == dtype and p.held is None]
                    if out:
                        self.add_region(dtype, RegionKind.BROADCAST, [j], {j: out}, owner=j)
        for j, m in enumerate(members):
            cross = [self.at[(m.tp - self.tp0, b, m.ep - self.ep0)] for b in range(self.q)]
            for dtype in dtypes:
                replicated = self._stage_only(j, False, dtype)
                if replicated:
                    self.add_region(dtype, RegionKind.BROADCAST, cross, {j: replicated}, owner=j)

    def _broadcast_stage_shards(self, dtype: str, j: int, ps: list[ParamInfo],
                                tied: Optional[tuple[str, str]]) -> None:
        """Member ``j`` broadcasts its TP shards of one-stage tensors; a tied embedding's not to the last stage's
        rank of the same TP column, which holds it already."""
        group = self.everyone
        if tied is not None and any(p.name == tied[1] for p in ps):
            twin = self.at[(self.members[j].tp - self.tp0, self.q - 1, 0)]
            group = [i for i in self.everyone if i != twin]
            if len(ps) > 1:
                raise AssertionError(f"tied embedding shares a broadcast with {[p.name for p in ps]}")
        self.add_region(dtype, RegionKind.BROADCAST, group, {j: ps}, owner=j)


def _held_regions(members: list[MemberInfo], regions: dict[str, list[Region]], offsets: dict[str, int],
                  alignment: Optional[dict[str, int]]) -> None:
    """One gather region per held buffer, first in each dtype: member j's slot is its buffer i as it is (its own
    order and padding), padded to the largest member's. Every member receives the other members' whole buffers:
    TP-replicated tensors and Megatron's padding travel too, and with p_g < p the stage-only tensors go to everyone
    (the regions of a plan without held buffers move exactly the missing bytes)."""
    counts = {len(m.held) for m in members}
    if counts == {0}:
        return
    if len(counts) != 1 or len({tuple(dt for dt, _ in m.held) for m in members}) != 1:
        raise ValueError("the micro-DP members' Megatron DDP parameter buffers do not correspond one to one "
                         f"(dtypes per member: {[[dt for dt, _ in m.held] for m in members]})")
    everyone = list(range(len(members)))
    for i in range(counts.pop()):
        dtype = members[0].held[i][0]
        slot = _align(max(m.held[i][1] for m in members), max(HELD_ALIGNMENT, (alignment or {}).get(dtype, 1)))
        reg = Region(RegionKind.GATHER, offsets.get(dtype, 0), slot, everyone, held=i)
        for j, m in enumerate(members):
            for p in m.params:
                if p.held is not None and p.held[0] == i:
                    reg.slices.append(Slice(j, p.name, reg.slot_offset(j) + p.held[1], p.numel, p.shape))
        regions.setdefault(dtype, []).append(reg)
        offsets[dtype] = reg.offset + reg.numel


#: Held slots are padded to a multiple of this many elements, so that each starts as aligned as Megatron aligns its
#: buckets (128 elements: 256 bytes for 16-bit types) when the buffer itself is.
HELD_ALIGNMENT = 128


#: A dim-0 shard whose rollout tensor has at least this many elements gets a gather region of its own (one more
#: collective, negligible next to moving >= 4 MB in fp32; stride collectives for a strided one), so the region is
#: the rollout tensor itself. Below it, the collectives' latency costs more than the copy saved (8 CPU ranks, 48
#: layers of hidden 64: 550 against 69 ms a switch).
STACKED_MIN_NUMEL = 2**20


def _stacks_whole(p: ParamInfo, k: int, alignment: int) -> bool:
    """Whether the k shards of ``p``, slot after slot in a region of its own, are its rollout tensor as laid out in
    memory: sharded along dim 0 without interleaving (QKV, word embedding, output layer; not SwiGLU's stacked fc1)
    and no slot padding between them."""
    return (k > 1 and p.sharded and p.dim == 0 and p.stride == 1 and p.numel % alignment == 0
            and p.numel * k >= STACKED_MIN_NUMEL)


def _bucketed(per_member: dict[int, list[ParamInfo]], bucket_numel: Union[None, int, dict[str, int]], emit, *,
              alone=lambda p: False, group=None) -> None:
    """Split each member's (corresponding) lists into dtype-homogeneous buckets of about ``bucket_numel``; a
    parameter for which ``alone`` holds gets a bucket of its own. With ``group``, a bucket also ends where
    ``group(parameter)`` changes (and ``bucket_numel`` None: only there)."""
    first = next(iter(per_member))
    n = len(per_member[first])
    dtypes = sorted({p.dtype for p in per_member[first]})
    for dtype in dtypes:
        idx = [i for i in range(n) if per_member[first][i].dtype == dtype]
        limit = bucket_numel[dtype] if isinstance(bucket_numel, dict) else bucket_numel
        if limit is None:
            limit = float("inf")
        start = 0
        while start < len(idx):
            end, total = start, 0
            while end < len(idx) and (end == start or total + per_member[first][idx[end]].numel <= limit):
                if group is not None and end > start and \
                        group(per_member[first][idx[end]]) != group(per_member[first][idx[end - 1]]):
                    break
                if alone(per_member[first][idx[end]]) and end > start:
                    break  # ends the bucket before it; it is a bucket of its own next
                total += per_member[first][idx[end]].numel
                end += 1
                if alone(per_member[first][idx[end - 1]]):
                    break
            emit(dtype, {j: [ps[i] for i in idx[start:end]] for j, ps in per_member.items()})
            start = end
