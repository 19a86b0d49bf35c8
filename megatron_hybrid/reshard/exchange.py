"""The exchange plan: any training/rollout layout pair, as index ranges. Pure arithmetic, no ``torch.distributed``.

Legend as in :mod:`megatron_hybrid.layout` (t, p, d training sizes; t_g, p_g rollout sizes; N = t · p · d ranks).
A pair outside the micro-DP gather contract (p_g > p, rollout TP up with another pipeline depth, TP and PP moving
in opposite directions, virtual pipeline chunks with p_g < p, t_g > t where process groups keep global rank
order) is served here, in two steps:

1. **Arrangement** (:func:`arrange`): which rollout coordinate (rollout TP rank j, rollout stage, rollout
   replica) every rank serves. Each rank takes, greedily in rank order, the rollout cell (j, stage) with spare
   room that overlaps its training shard most (TP overlap × common layers); a cell's holders in rank order are its
   replicas 0, 1, ... When process groups must list their ranks in global order (``keeps_order=False``: torch
   < 2.13 sorts ``new_group``'s ranks, and megatron-core takes group rank j for vocabulary shard j) and that
   arrangement's groups are not in order, Megatron's own rank order is used instead (rollout TP fastest, then
   rollout DP, then rollout PP): always in order, and whatever bytes it misses are planned, not refused.
2. **Plan** (:func:`build_exchange_plan`): a tensor-parallel tensor of partition stride s is cut along its
   partition dim into s parts and each part into L = lcm(t, t_g) *units*: training TP rank i holds units
   [i · L/t, (i + 1) · L/t) of every part, rollout TP rank j needs [j · L/t_g, (j + 1) · L/t_g). A replicated
   tensor is one unit. What a rank misses of a tensor it needs is needed − held (whole tensors it does not hold
   at all; the rest of a TP range it holds part of), each missing range cut where training shards end and fetched
   from one rank that holds it: the least loaded so far (bytes sent), then the nearest rank. Everything then
   moves in one ``all_to_all_single`` per dtype over the world, exactly the missing bytes.

A tied output layer (``output_layer.weight`` of a model that shares it with the embedding) is the embedding under
another name: Megatron keeps the two equal, so either serves the other (the caller names both by the embedding).

An MoE model's routed experts are tensors of their own axis: split over expert TP (et training shards, et_g
rollout shards: L_e = lcm(et, et_g) units) instead of TP, each expert held by the ranks of its training EP rank
and needed by those of its rollout EP rank (the names say which: global expert indices). A rank brings its expert
TP ranks beside its TP ranks; everything else is the same plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

from ..layout import Grid, ParallelLayout, _group_ranks
from .plan import ParamInfo

if TYPE_CHECKING:
    import torch

RolloutCoord = tuple[int, int, int]  # (rollout tp rank, rollout stage, rollout replica)


# ---- 1. the arrangement ---------------------------------------------------------------------------------------
def stage_layers(num_layers: int, stages: int, chunks: int = 1) -> list[frozenset[int]]:
    """The layers of each pipeline stage, split evenly as Megatron does: with ``chunks`` virtual chunks per stage,
    model chunk c = v · stages + s (layers [c · n, (c + 1) · n), n = num_layers / (stages · chunks)) is stage s's."""
    n = num_layers // (stages * chunks)
    return [frozenset(layer for v in range(chunks) for layer in range((v * stages + s) * n, (v * stages + s + 1) * n))
            for s in range(stages)]


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


@dataclass(frozen=True)
class Arrangement:
    """Every rank's rollout coordinate in an exchange layout, and the rollout groups it implies."""

    t_g: int
    p_g: int
    coords: dict[int, RolloutCoord]
    """Global rank -> (rollout TP rank, rollout stage, rollout replica)."""

    @property
    def num_replicas(self) -> int:
        return len(self.coords) // (self.t_g * self.p_g)

    def rank(self, j: int, stage: int, replica: int) -> int:
        return self._cells[(j, stage, replica)]

    @property
    def _cells(self) -> dict[RolloutCoord, int]:
        cells = self.__dict__.get("_cell_index")
        if cells is None:
            cells = {c: r for r, c in self.coords.items()}
            object.__setattr__(self, "_cell_index", cells)
        return cells

    def tp_groups(self) -> list[list[int]]:
        """Rollout TP groups, each in rollout TP rank order."""
        return _group_ranks(self.coords.items(), lambda c: (c[1], c[2]), order=lambda c: c[0])

    def pp_groups(self) -> list[list[int]]:
        """Rollout PP groups, each in stage order."""
        return _group_ranks(self.coords.items(), lambda c: (c[0], c[2]), order=lambda c: c[1])

    def dp_groups(self) -> list[list[int]]:
        return _group_ranks(self.coords.items(), lambda c: c[:2])

    def stage_groups(self) -> list[list[int]]:
        return _group_ranks(self.coords.items(), lambda c: c[1])

    def expert_coords(self, et_g: int, e_g: int) -> dict[int, tuple[int, int, int, int]]:
        """Every rank's rollout expert coordinate (expert TP, EP, expert DP, stage): the ranks of a rollout stage
        in Megatron's order (rollout TP fastest, then the replicas), cut expert TP fastest, then EP, as
        megatron-core cuts a stage's tensor × data-parallel ranks (et_g · e_g divides them)."""
        out = {}
        for rank, (j, stage, replica) in self.coords.items():
            idx = j + self.t_g * replica
            out[rank] = (idx % et_g, (idx // et_g) % e_g, idx // (et_g * e_g), stage)
        return out

    def in_order(self) -> bool:
        """Whether every rollout TP and PP group lists its ranks in global order (as a sorting ``new_group`` would)."""
        return all(g == sorted(g) for g in self.tp_groups() + self.pp_groups())


def megatron_order(layout: ParallelLayout) -> Arrangement:
    """Megatron's own rank order for the rollout grid: rollout TP fastest, then rollout DP, then rollout PP."""
    replicas = layout.world_size // (layout.t_g * layout.p_g)
    coords = {}
    for rank in range(layout.world_size):
        j, rest = rank % layout.t_g, rank // layout.t_g
        coords[rank] = (j, rest // replicas, rest % replicas)
    return Arrangement(layout.t_g, layout.p_g, coords)


def arrange(layout: ParallelLayout, grid: Grid, *, num_layers: int, chunks: int = 1,
            keeps_order: bool = True) -> Arrangement:
    """The rollout coordinate of every rank (see the module docstring). ``chunks``: virtual pipeline chunks per
    training stage; ``keeps_order``: whether process groups may list their ranks in any order."""
    t, t_g, p_g = layout.t, layout.t_g, layout.p_g
    units = math.lcm(t, t_g)
    train_layers = stage_layers(num_layers, layout.p, chunks)
    roll_layers = stage_layers(num_layers, p_g)
    replicas = layout.world_size // (t_g * p_g)
    room = {(j, s): replicas for s in range(p_g) for j in range(t_g)}
    taken: dict[tuple[int, int], list[int]] = {cell: [] for cell in room}
    for rank, (i, s, _) in sorted(grid.coords()):
        mine = (i * units // t, (i + 1) * units // t)

        def score(cell: tuple[int, int]) -> int:
            j, sg = cell
            return _overlap(mine, (j * units // t_g, (j + 1) * units // t_g)) * len(train_layers[s] & roll_layers[sg])

        cell = max((c for c in sorted(room, key=lambda c: (c[1], c[0])) if room[c]), key=score)
        room[cell] -= 1
        taken[cell].append(rank)
    coords = {rank: (j, sg, r) for (j, sg), ranks in taken.items() for r, rank in enumerate(ranks)}
    out = Arrangement(t_g, p_g, coords)
    if not keeps_order and not out.in_order():
        return megatron_order(layout)
    return out


# ---- 2. the plan --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankTensors:
    """What one rank brings to the plan: its training tensors and the rollout tensors it needs."""

    rank: int
    tp: int
    """Training TP rank (which TP shard its sharded tensors are)."""
    rollout_tp: int
    held: tuple[ParamInfo, ...]
    """Its training tensors, named by key (global name; a tied output layer by the embedding's name)."""
    needs: tuple[str, ...]
    """The keys of its rollout tensors, in rollout-model order."""
    expert_tp: int = 0
    """Training expert-TP rank (which expert-TP shard its routed experts are; MoE models)."""
    rollout_expert_tp: int = 0
    """Rollout expert-TP rank."""


@dataclass(frozen=True)
class Piece:
    """Units [lo, hi) of part ``part`` of tensor ``key``, sent by ``src`` to ``dst`` (a replicated tensor: the
    whole tensor, part 0, units [0, 1)). ``shape``: the piece as a contiguous tensor."""

    src: int
    dst: int
    key: str
    part: int
    lo: int
    hi: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Run:
    """Part of a rollout tensor, in canonical order: units [lo, hi) of part ``part``, from the rank's own training
    tensor (``piece`` None) or received (``piece``: its index in the plan)."""

    part: int
    lo: int
    hi: int
    piece: Optional[int] = None


@dataclass
class ExchangePlan:
    """Who sends which units of which tensor to whom, the same on every rank."""

    t: int
    t_g: int
    units: int
    """L = lcm(t, t_g) units per part of a sharded tensor."""
    tensors: dict[str, ParamInfo]
    """Key -> one training shard's description (shape of a training shard)."""
    pieces: list[Piece]
    runs: dict[int, dict[str, list[Run]]]
    """Rank -> key -> the runs its rollout tensor is made of, in canonical order."""
    tp_of: dict[int, int]
    """Rank -> training TP rank."""
    world: int = 0
    et: int = 1
    et_g: int = 1
    """Training and rollout expert-TP sizes (routed experts: :attr:`expert_keys`)."""
    expert_tp_of: dict[int, int] = field(default_factory=dict)
    """Rank -> training expert-TP rank."""
    expert_keys: frozenset = frozenset()
    """The keys of routed experts' tensors (split over expert TP)."""
    _index: dict = field(default_factory=dict, repr=False)

    def axis(self, key: str) -> tuple[int, int]:
        """(training TP size, units a part) of ``key``'s axis: expert TP for a routed expert's tensor."""
        if key in self.expert_keys:
            return self.et, math.lcm(self.et, self.et_g)
        return self.t, self.units

    def source_tp(self, rank: int, key: str) -> int:
        """``rank``'s training TP rank on ``key``'s axis (the shard its tensor ``key`` is)."""
        return (self.expert_tp_of if key in self.expert_keys else self.tp_of)[rank]

    # -- per rank -----------------------------------------------------------------------------------------
    def dtypes(self) -> list[str]:
        """The dtypes that move at all (one collective each), in a fixed order."""
        return sorted({pc.dtype for pc in self.pieces})

    def _ordered(self, rank: int, dtype: str, *, sending: bool) -> list[tuple[int, Piece]]:
        key = (rank, dtype, sending)
        if key not in self._index:
            mine = [(n, pc) for n, pc in enumerate(self.pieces) if pc.dtype == dtype
                    and (pc.src if sending else pc.dst) == rank]
            # Grouped by peer in rank order (all_to_all_single's split order), plan order inside.
            mine.sort(key=lambda x: ((x[1].dst if sending else x[1].src), x[0]))
            self._index[key] = mine
        return self._index[key]

    def sends(self, rank: int, dtype: str) -> list[tuple[int, Piece]]:
        """(piece index, piece) that ``rank`` sends, in its send buffer's order."""
        return self._ordered(rank, dtype, sending=True)

    def receives(self, rank: int, dtype: str) -> list[tuple[int, Piece]]:
        """(piece index, piece) that ``rank`` receives, in its receive buffer's order."""
        return self._ordered(rank, dtype, sending=False)

    def splits(self, rank: int, dtype: str, *, sending: bool) -> list[int]:
        """Elements to (``sending``) or from each rank, in rank order."""
        out = [0] * self.world
        for _, pc in self._ordered(rank, dtype, sending=sending):
            out[pc.dst if sending else pc.src] += pc.numel
        return out

    def receive_offsets(self, rank: int) -> dict[int, tuple[str, int]]:
        """Piece index -> (dtype, element offset in ``rank``'s receive buffer of that dtype)."""
        out = {}
        for dtype in self.dtypes():
            off = 0
            for n, pc in self.receives(rank, dtype):
                out[n] = (dtype, off)
                off += pc.numel
        return out

    def received_numel(self, rank: int) -> dict[str, int]:
        return {dtype: sum(pc.numel for _, pc in self.receives(rank, dtype)) for dtype in self.dtypes()}

    def sent_numel(self, rank: int) -> dict[str, int]:
        return {dtype: sum(pc.numel for _, pc in self.sends(rank, dtype)) for dtype in self.dtypes()}

    # -- geometry -------------------------------------------------------------------------------------------
    def unit_len(self, key: str) -> int:
        """Rows (along the partition dim) of one unit of a sharded tensor."""
        return _unit_len(self.tensors[key], *self.axis(key))

    def local_range(self, key: str, tp: int, part: int, lo: int, hi: int) -> tuple[int, int]:
        """(start, length) along the partition dim of units [lo, hi) of ``part`` in training TP rank ``tp``'s shard
        (expert-TP rank for a routed expert's tensor)."""
        info = self.tensors[key]
        t, units = self.axis(key)
        per_part = info.shape[info.dim] // info.stride
        first = tp * units // t
        assert first <= lo <= hi <= first + units // t, (key, tp, lo, hi)
        step = self.unit_len(key)
        return part * per_part + (lo - first) * step, (hi - lo) * step

    def view_of(self, tensor: "torch.Tensor", key: str, tp: int, part: int, lo: int, hi: int) -> "torch.Tensor":
        """Units [lo, hi) of ``part`` of training TP rank ``tp``'s shard ``tensor`` of ``key`` (a view, strided for
        dim 1); a replicated tensor is itself."""
        info = self.tensors[key]
        if not info.sharded:
            return tensor
        start, length = self.local_range(key, tp, part, lo, hi)
        return tensor.narrow(info.dim, start, length)


def _unit_len(info: ParamInfo, t: int, units: int) -> int:
    return info.shape[info.dim] * t // (info.stride * units)


def _cut(lo: int, hi: int, step: int) -> list[tuple[int, int]]:
    """[lo, hi) cut where multiples of ``step`` fall."""
    out, a = [], lo
    while a < hi:
        b = min(hi, (a // step + 1) * step)
        out.append((a, b))
        a = b
    return out


def build_exchange_plan(ranks: Sequence[RankTensors], *, t: int, t_g: int, et: int = 1, et_g: int = 1,
                        is_expert: Callable[[str], bool] = lambda key: False) -> ExchangePlan:
    """Plan the exchange (see the module docstring). ``ranks``: every rank's :class:`RankTensors`; ``et``,
    ``et_g`` and ``is_expert``: an MoE model's expert-TP sizes and which keys are routed experts' tensors."""
    units = math.lcm(t, t_g)
    ranks = sorted(ranks, key=lambda r: r.rank)
    tensors: dict[str, ParamInfo] = {}
    holders: dict[str, list[RankTensors]] = {}
    for rt in ranks:
        for info in rt.held:
            first = tensors.setdefault(info.name, info)
            if (first.shape, first.dtype, first.sharded, first.dim, first.stride) != \
                    (info.shape, info.dtype, info.sharded, info.dim, info.stride):
                raise ValueError(f"training tensor {info.name} differs between ranks: {first} and {info}")
            holders.setdefault(info.name, []).append(rt)
    load = {rt.rank: 0 for rt in ranks}
    pieces: list[Piece] = []
    runs: dict[int, dict[str, list[Run]]] = {}
    experts = frozenset(key for key in tensors if is_expert(key))

    def axis(key: str) -> tuple[int, int, int]:  # (training TP size, units, per training shard, per rollout shard)
        kt, kt_g = (et, et_g) if key in experts else (t, t_g)
        n = math.lcm(kt, kt_g)
        return kt, n, n // kt, n // kt_g

    def tp(rt: RankTensors, key: str, rollout: bool = False) -> int:
        if key in experts:
            return rt.rollout_expert_tp if rollout else rt.expert_tp
        return rt.rollout_tp if rollout else rt.tp

    for rt in ranks:
        mine = {info.name for info in rt.held}
        runs[rt.rank] = {}
        for key in rt.needs:
            info = tensors.get(key)
            if info is None:
                raise ValueError(f"no training rank holds {key}: the rollout model does not correspond to the "
                                 "training model")
            kt, kunits, per_train, per_roll = axis(key)
            if not info.sharded:
                need, parts, own = (0, 1), 1, (0, 1) if key in mine else (0, 0)
            else:
                need = (tp(rt, key, True) * per_roll, (tp(rt, key, True) + 1) * per_roll)
                parts = info.stride
                own = (tp(rt, key) * per_train, (tp(rt, key) + 1) * per_train) if key in mine else (0, 0)
            # needed − held, in canonical order: before the own range, the own range, after it.
            lo, hi = need
            a, b = max(lo, own[0]), min(hi, own[1])
            spans = [(lo, a, False), (a, b, True), (b, hi, False)] if a < b else [(lo, hi, False)]
            out: list[Run] = []
            for part in range(parts):
                for x, y, held in spans:
                    if x >= y:
                        continue
                    if held:
                        out.append(Run(part, x, y))
                        continue
                    for u, v in (_cut(x, y, per_train) if info.sharded else [(x, y)]):
                        cands = [h.rank for h in holders[key] if h.rank != rt.rank
                                 and (not info.sharded or tp(h, key) == u // per_train)]
                        src = min(cands, key=lambda c: (load[c], abs(c - rt.rank), c))
                        shape = list(info.shape)
                        if info.sharded:
                            shape[info.dim] = (v - u) * _unit_len(info, kt, kunits)
                        pc = Piece(src, rt.rank, key, part, u, v, info.dtype, tuple(shape))
                        load[src] += pc.numel
                        out.append(Run(part, u, v, len(pieces)))
                        pieces.append(pc)
            runs[rt.rank][key] = out
    return ExchangePlan(t, t_g, units, tensors, pieces, runs, {rt.rank: rt.tp for rt in ranks}, world=len(ranks),
                        et=et, et_g=et_g, expert_tp_of={rt.rank: rt.expert_tp for rt in ranks}, expert_keys=experts)


def keys_of(names: Iterable[str], *, tied: bool) -> dict[str, str]:
    """Global name -> key: with tied embeddings the output layer is the embedding."""
    return {n: ("embedding.word_embeddings.weight" if tied and n == "output_layer.weight" else n) for n in names}
