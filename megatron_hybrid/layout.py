"""Training and rollout layouts, validated once, and the pure rank arithmetic of the optimised grouping.

Legend: t, p, d are the training tensor-, pipeline- and data-parallel sizes; t_g, p_g the rollout ones;
k = t / t_g training TP shards per rollout TP shard, q = p / p_g training stages per rollout stage, and
d_g = k · q the micro-DP size (HybridFlow §5). A rank is addressed by its training coordinates
(tp, pp, dp); ``Grid`` maps coordinates to global ranks as Megatron actually laid them out.

Optimised grouping (t_g ≤ t, p_g ≤ p): inside one training model-parallel group, the rank at (i, s) takes
rollout TP rank i // k and rollout stage s // q. Rollout TP groups take TP ranks at a stride of k, rollout PP
groups take stages at a stride of q, and the micro-DP group is the k · q ranks {i // k = r, s // q = s'}
between them: gathering over it turns each member's training shard into its rollout shard, of which the
training shard is a sub-block. No ``torch.distributed`` here: everything is testable in microseconds.

t_g > t (rollout TP wider than training TP) is valid when m = t_g / t divides d and p_g = p: m training DP
replicas form one rollout TP group, and each rank's rollout shard is a sub-block of the training shard it
already holds, so the switch moves nothing.

Every other pair (p_g > p, t_g > t with p_g ≠ p, TP and PP moving in opposite directions, ...) is an *exchange*
layout (``ParallelLayout.exchange``): its rollout coordinates and the bytes each rank misses come from
:mod:`megatron_hybrid.reshard.exchange`, not from the micro-DP arithmetic here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

from .constraints import Sizes, check


@dataclass(frozen=True)
class RolloutLayout:
    """The parallel layout the actor generates with."""

    tensor_model_parallel_size: int = 1
    """Rollout tensor-parallel size t_g (a divisor of the training TP size, or a multiple that divides TP × DP)."""
    pipeline_model_parallel_size: int = 1
    """Rollout pipeline-parallel size p_g (a divisor of the training PP size)."""
    expert_model_parallel_size: int = 1
    """Rollout expert-parallel size e_g (a divisor of the training EP size; MoE models only)."""
    expert_tensor_parallel_size: Optional[int] = None
    """Rollout expert tensor-parallel size et_g (a divisor of the training expert TP size); ``None``: t_g, as
    Megatron's ``expert_tensor_parallel_size`` defaults to the TP size."""

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                     "expert_tensor_parallel_size"):
            v = getattr(self, name)
            if v is None and name == "expert_tensor_parallel_size":
                continue
            # bool is an int subclass: RolloutLayout(True, 1) must not pass as t_g = 1.
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"rollout {name} ({v!r}) must be a positive integer")

    @property
    def expert_tp(self) -> int:
        """et_g, with Megatron's default (the rollout TP size) applied."""
        return self.tensor_model_parallel_size if self.expert_tensor_parallel_size is None \
            else self.expert_tensor_parallel_size


Coord = tuple[int, int, int]  # (tp, pp, dp)


@dataclass(frozen=True)
class Grid:
    """Where each training coordinate lives: ``ranks[dp][pp][tp]`` is a global rank."""

    ranks: tuple[tuple[tuple[int, ...], ...], ...]

    @classmethod
    def megatron_default(cls, t: int, p: int, d: int) -> "Grid":
        """Megatron-core's default order ``tp-cp-ep-dp-pp``: TP fastest, then DP, then PP."""
        return cls(tuple(tuple(tuple(i + t * dp + t * d * s for i in range(t)) for s in range(p))
                         for dp in range(d)))

    @classmethod
    def from_coords(cls, coords: dict[int, Coord]) -> "Grid":
        """Build from ``{global rank: (tp, pp, dp)}``, as gathered from the training process groups."""
        t = 1 + max(c[0] for c in coords.values())
        p = 1 + max(c[1] for c in coords.values())
        d = 1 + max(c[2] for c in coords.values())
        table = [[[-1] * t for _ in range(p)] for _ in range(d)]
        for rank, (i, s, dp) in coords.items():
            table[dp][s][i] = rank
        if any(r < 0 for plane in table for row in plane for r in row):
            raise ValueError(f"the training process groups do not form a {t}×{p}×{d} grid: {coords}")
        return cls(tuple(tuple(tuple(row) for row in plane) for plane in table))

    @property
    def sizes(self) -> tuple[int, int, int]:
        return len(self.ranks[0][0]), len(self.ranks[0]), len(self.ranks)

    def rank(self, tp: int, pp: int, dp: int) -> int:
        return self.ranks[dp][pp][tp]

    def coords(self) -> Iterator[tuple[int, Coord]]:
        for dp, plane in enumerate(self.ranks):
            for s, row in enumerate(plane):
                for i, r in enumerate(row):
                    yield r, (i, s, dp)


@dataclass(frozen=True)
class ParallelLayout:
    """Training (t, p, d) and rollout (t_g, p_g) sizes, checked once; everything else asks this object."""

    t: int
    p: int
    d: int
    t_g: int
    p_g: int

    exchange: bool = False
    """Served by the exchange plan (:mod:`megatron_hybrid.reshard.exchange`) rather than micro-DP gathers: set for every
    pair outside the gather contract (see the module docstring), and by the engine for pairs inside it that it still
    exchanges (virtual pipeline chunks with p_g < p; t_g > t where ``new_group`` sorts ranks)."""

    def __post_init__(self) -> None:
        for name, v in (("tensor_model_parallel_size", self.t), ("pipeline_model_parallel_size", self.p),
                        ("data_parallel_size", self.d), ("rollout tensor_model_parallel_size", self.t_g),
                        ("rollout pipeline_model_parallel_size", self.p_g)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} ({v!r}) must be a positive integer")
        check(Sizes(world=self.world_size, t=self.t, p=self.p, d=self.d, t_g=self.t_g, p_g=self.p_g),
              "rollout_layout_divides_world")
        if not self.gathers_in_place():
            object.__setattr__(self, "exchange", True)

    def gathers_in_place(self) -> bool:
        """Whether the pair is inside the micro-DP gather contract: every rollout shard a union of training
        shards (t_g | t, p_g | p) or a sub-block of the own (t_g = m · t, m | d, p_g = p)."""
        if self.p % self.p_g:
            return False
        if self.t_g <= self.t:
            return self.t % self.t_g == 0
        return self.t_g % self.t == 0 and self.d % (self.t_g // self.t) == 0 and self.p_g == self.p

    @classmethod
    def create(cls, *, training: tuple[int, int, int], rollout: RolloutLayout) -> "ParallelLayout":
        t, p, d = training
        return cls(t=t, p=p, d=d, t_g=rollout.tensor_model_parallel_size, p_g=rollout.pipeline_model_parallel_size)

    # Derived sizes -------------------------------------------------------------------------------------------
    @property
    def widens(self) -> bool:
        """Rollout TP wider than training TP, served in place: a no-communication switch."""
        return self.t_g > self.t and not self.exchange

    @property
    def k(self) -> int:
        """Training TP shards per rollout TP shard (1 when the rollout TP is wider)."""
        return 1 if self.widens else self.t // self.t_g

    @property
    def m(self) -> int:
        """Rollout TP shards per training TP shard (1 unless the rollout TP is wider)."""
        return self.t_g // self.t if self.widens else 1

    @property
    def q(self) -> int:
        """Training stages per rollout stage."""
        return self.p // self.p_g

    @property
    def d_g(self) -> int:
        """Micro-DP size: rollout replicas per training replica (1 when the rollout TP is wider)."""
        return self.k * self.q

    @property
    def world_size(self) -> int:
        return self.t * self.p * self.d

    @property
    def rollout_dp(self) -> int:
        """Rollout data-parallel size."""
        return self.world_size // (self.t_g * self.p_g)

    # Rank arithmetic ----------------------------------------------------------------------------------------
    def rollout_coords(self, coord: Coord) -> tuple[int, int, int]:
        """(rollout tp rank, rollout stage, rollout replica) of the rank at training ``coord``."""
        i, s, dp = coord
        if self.widens:
            return i * self.m + dp % self.m, s, dp // self.m
        a, b = i % self.k, s % self.q
        return i // self.k, s // self.q, dp * self.d_g + b * self.k + a

    def _groups(self, grid: Grid, key: Callable[[Coord], tuple],
                order: Optional[Callable[[Coord], int]] = None) -> list[list[int]]:
        """Ranks grouped by ``key(coord)``; inside a group in ``order(coord)`` order (default: global rank)."""
        if grid.sizes != (self.t, self.p, self.d):
            raise ValueError(f"grid sizes {grid.sizes} do not match the layout ({self.t}, {self.p}, {self.d})")
        return _group_ranks(grid.coords(), key, order)

    def rollout_stage_groups(self, grid: Grid) -> list[list[int]]:
        """Every rank of one rollout stage (megatron-core's tensor × data-parallel group of the rollout model)."""
        return self._groups(grid, lambda c: self.rollout_coords(c)[1])

    def rollout_tp_groups(self, grid: Grid) -> list[list[int]]:
        """Rollout TP groups, each in rollout TP rank order (group rank j holds rollout TP shard j)."""
        return self._groups(grid, lambda c: (self.rollout_coords(c)[1], self.rollout_coords(c)[2]),
                            order=lambda c: self.rollout_coords(c)[0])

    def rollout_pp_groups(self, grid: Grid) -> list[list[int]]:
        """Rollout PP groups, each in stage order."""
        return self._groups(grid, lambda c: (self.rollout_coords(c)[0], self.rollout_coords(c)[2]),
                            order=lambda c: self.rollout_coords(c)[1])

    def rollout_dp_groups(self, grid: Grid) -> list[list[int]]:
        return self._groups(grid, lambda c: self.rollout_coords(c)[:2])

    def micro_dp_groups(self, grid: Grid) -> list[list[int]]:
        """The groups a switch gathers over: same training replica, same rollout (tp rank, stage)."""
        if self.widens:
            return [[r] for r, _ in grid.coords()]
        return self._groups(grid, lambda c: (c[2], c[0] // self.k, c[1] // self.q))

    def cross_stage_groups(self, grid: Grid) -> list[list[int]]:
        """Micro-DP members with the same training TP rank: they exchange TP-replicated parameters."""
        if self.widens:
            return [[r] for r, _ in grid.coords()]
        return self._groups(grid, lambda c: (c[2], c[0], c[1] // self.q))

    def tied_embedding_groups(self, grid: Grid) -> list[list[int]]:
        """With tied embeddings gathered into one rollout stage (p_g = 1 < p): per micro-DP group and training TP
        shard a, the group over which the first stage's rank of column a broadcasts embedding shard a: every
        member but the last stage's rank of column a, which holds the same shard as its tied output layer."""
        if self.widens or self.p_g != 1 or self.p == 1:
            return []
        out = []
        coord_of = dict(grid.coords())
        for group in self.micro_dp_groups(grid):
            for a in range(self.k):
                out.append([r for r in group if not (coord_of[r][0] % self.k == a and coord_of[r][1] == self.p - 1)])
        return sorted(g for g in out if len(g) > 1)

    # Byte arithmetic ---------------------------------------------------------------------------------------
    def missing_fraction(self) -> float:
        """Fraction of the model (M) each rank receives per switch: (d_g − 1) / (t · p) (HybridFlow §5)."""
        return (self.d_g - 1) / (self.t * self.p)


def _group_ranks(coords: Iterable[tuple[int, Any]], key: Callable[[Any], tuple],
                 order: Optional[Callable[[Any], int]] = None) -> list[list[int]]:
    """Ranks grouped by ``key(coord)``; inside a group in ``order(coord)`` order (default: global rank)."""
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for rank, coord in coords:
        groups.setdefault(key(coord), []).append((rank if order is None else order(coord), rank))
    return sorted([r for _, r in sorted(g)] for g in groups.values())


# ---- experts -------------------------------------------------------------------------------------------------
# Megatron lays the expert tensors of an MoE model out on a grid of their own over the same ranks (its expert rank
# generator, order tp-ep-dp-pp): expert TP rank i (of et), expert-parallel rank j (of e), expert data-parallel rank
# x (of edp = world / (et · e · p)) and the pipeline stage s, which it shares with the dense grid. EP rank j holds
# experts [j · E/e, (j + 1) · E/e), each as expert-TP shard i.
#
# The rollout experts follow the optimised grouping of the dense tensors: with ke = et / et_g and ue = e / e_g, the
# rank at (i, j, x, s) serves rollout expert-TP rank i // ke, rollout EP rank j // ue and rollout stage s // q; its
# micro-EP group is the ke · ue · q ranks that share (x, i // ke, j // ue, s // q), and gathering over it turns each
# member's expert shard into its rollout expert shard, of which the training shard is a sub-block.

ExpertCoord = tuple[int, int, int, int]  # (expert tp, ep, expert dp, pp)


@dataclass(frozen=True)
class ExpertGrid:
    """Where each expert coordinate lives: ``coords[rank]`` is the rank's (expert tp, ep, expert dp, pp)."""

    coords: tuple[ExpertCoord, ...]

    @classmethod
    def megatron_default(cls, et: int, e: int, edp: int, p: int) -> "ExpertGrid":
        """Megatron-core's default order for the expert grid: expert TP fastest, then EP, expert DP, PP."""
        out = []
        for rank in range(et * e * edp * p):
            i, rest = rank % et, rank // et
            j, rest = rest % e, rest // e
            out.append((i, j, rest % edp, rest // edp))
        return cls(tuple(out))

    @classmethod
    def from_coords(cls, coords: dict[int, ExpertCoord]) -> "ExpertGrid":
        """Build from ``{global rank: coordinate}``, as gathered from the training expert process groups."""
        sizes = tuple(1 + max(c[axis] for c in coords.values()) for axis in range(4))
        cells = {tuple(c) for c in coords.values()}
        if sorted(coords) != list(range(len(coords))) or len(cells) != len(coords) or \
                len(coords) != sizes[0] * sizes[1] * sizes[2] * sizes[3]:
            raise ValueError(f"the expert process groups do not form a {'×'.join(map(str, sizes))} grid: {coords}")
        return cls(tuple(tuple(coords[r]) for r in range(len(coords))))

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return tuple(1 + max(c[axis] for c in self.coords) for axis in range(4))  # type: ignore[return-value]

    def items(self) -> Iterator[tuple[int, ExpertCoord]]:
        return iter(enumerate(self.coords))


@dataclass(frozen=True)
class ExpertLayout:
    """Training (et, e, edp, p) and rollout (et_g, e_g, p_g) sizes of the expert tensors, checked once."""

    et: int
    e: int
    edp: int
    p: int
    et_g: int
    e_g: int
    p_g: int
    exchange: bool = False
    """The experts move in an exchange layout's all-to-all (no micro-EP gather: the divisibility the gather needs,
    the in-place rules of :mod:`megatron_hybrid.constraints`, does not apply)."""

    def __post_init__(self) -> None:
        for name, v in (("expert_tensor_parallel_size", self.et), ("expert_model_parallel_size", self.e),
                        ("expert data-parallel size", self.edp), ("pipeline_model_parallel_size", self.p),
                        ("rollout expert_tensor_parallel_size", self.et_g),
                        ("rollout expert_model_parallel_size", self.e_g),
                        ("rollout pipeline_model_parallel_size", self.p_g)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} ({v!r}) must be a positive integer")
        check(Sizes(moe=True, exchange=self.exchange, e=self.e, et=self.et, p=self.p, e_g=self.e_g, et_g=self.et_g,
                    p_g=self.p_g), "e_g_divides_e", "et_g_divides_et", "experts_p_g_divides_p")

    @classmethod
    def create(cls, *, training: tuple[int, int, int, int], rollout: RolloutLayout) -> "ExpertLayout":
        et, e, edp, p = training
        return cls(et=et, e=e, edp=edp, p=p, et_g=rollout.expert_tp, e_g=rollout.expert_model_parallel_size,
                   p_g=rollout.pipeline_model_parallel_size)

    @property
    def ke(self) -> int:
        """Training expert-TP shards per rollout expert-TP shard."""
        return self.et // self.et_g

    @property
    def ue(self) -> int:
        """Training EP ranks whose experts one rollout EP rank holds."""
        return self.e // self.e_g

    @property
    def q(self) -> int:
        return self.p // self.p_g

    @property
    def micro_ep_size(self) -> int:
        return self.ke * self.ue * self.q

    @property
    def world_size(self) -> int:
        return self.et * self.e * self.edp * self.p

    def rollout_coords(self, coord: ExpertCoord) -> tuple[int, int, int, tuple[int, int, int, int]]:
        """(rollout expert-TP rank, rollout EP rank, rollout stage, rollout expert replica) of the rank at ``coord``;
        the replica names the rollout expert grid's data-parallel coordinate."""
        i, j, x, s = coord
        return i // self.ke, j // self.ue, s // self.q, (x, i % self.ke, j % self.ue, s % self.q)

    def _groups(self, grid: ExpertGrid, key: Callable[[ExpertCoord], tuple],
                order: Optional[Callable[[ExpertCoord], int]] = None) -> list[list[int]]:
        if grid.sizes != (self.et, self.e, self.edp, self.p):
            raise ValueError(f"expert grid sizes {grid.sizes} do not match the layout "
                             f"({self.et}, {self.e}, {self.edp}, {self.p})")
        return _group_ranks(grid.items(), key, order)

    def micro_ep_groups(self, grid: ExpertGrid) -> list[list[int]]:
        """The groups a switch gathers expert tensors over: same expert replica, same rollout expert shard."""
        return self._groups(grid, lambda c: (c[2], c[0] // self.ke, c[1] // self.ue, c[3] // self.q))

    def rollout_expt_tp_groups(self, grid: ExpertGrid) -> list[list[int]]:
        """Rollout expert-TP groups, in rollout expert-TP rank order."""
        rc = self.rollout_coords
        return self._groups(grid, lambda c: rc(c)[1:], order=lambda c: rc(c)[0])

    def rollout_ep_groups(self, grid: ExpertGrid) -> list[list[int]]:
        """Rollout expert-parallel groups, in rollout EP rank order (group rank j holds the j-th E/e_g experts)."""
        rc = self.rollout_coords
        return self._groups(grid, lambda c: (rc(c)[0], *rc(c)[2:]), order=lambda c: rc(c)[1])

    def rollout_tp_ep_groups(self, grid: ExpertGrid) -> list[list[int]]:
        """Rollout expert-TP × EP groups (the all-gather dispatcher's), expert TP fastest, as Megatron orders them."""
        rc = self.rollout_coords
        return self._groups(grid, lambda c: rc(c)[2:], order=lambda c: rc(c)[0] + self.et_g * rc(c)[1])

    def rollout_expt_dp_groups(self, grid: ExpertGrid) -> list[list[int]]:
        """Rollout expert data-parallel groups: the ranks that hold the same rollout expert shard."""
        return self._groups(grid, lambda c: self.rollout_coords(c)[:3])

    def missing_fraction(self) -> float:
        """Fraction of the expert bytes each rank receives per switch: (micro-EP size − 1) / (et · e · p)."""
        return (self.micro_ep_size - 1) / (self.et * self.e * self.p)
