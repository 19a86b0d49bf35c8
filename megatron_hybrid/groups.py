"""The rollout process groups: created once, on every rank, from :mod:`megatron_hybrid.layout`'s rank lists.

Where the rollout groups come from. The rank arithmetic is pure (``ParallelLayout``); this module only asks the
training groups where every rank sits (one ``all_gather_object``) and calls ``new_group`` for every list, with
the engine's timeout (by default the training groups'), so that a stalled or dead rank fails the others within it
instead of hanging them. A world-sized group with that timeout serves what needs every rank (where the training
ranks sit, the agreement on a generate call's inputs): the default group's timeout may be far longer (10 minutes
by default in Megatron-LM), and the engine never uses it. :func:`collective_errors` names the phase, the
collective and the timeout when one of them fails.

Group ranks are in the order of the coordinate they stand for (rollout TP rank, rollout stage), not in global
rank order: with t_g > t the rollout TP shard a rank can serve without communication is fixed by its training
shard, and megatron-core assumes that group rank j holds vocabulary shard j (``ColumnParallelLinear`` with
``parallel_output=False``, its inference engines). torch ≥ 2.13's ``new_group(sort_ranks=False)`` keeps that
order. On an older torch, an in-place layout whose groups are not in global order (t_g > t with t > 1) is served
as an exchange layout instead (:mod:`megatron_hybrid.reshard.exchange`), whose arrangement keeps every group in order.
Exchange layouts take their rollout groups from their :class:`~megatron_hybrid.reshard.exchange.Arrangement`.
"""

from __future__ import annotations

import dataclasses
import datetime
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch.distributed as dist

from .layout import ExpertGrid, ExpertLayout, Grid, ParallelLayout, _group_ranks
from .megatron import compat
from .reshard.exchange import Arrangement, arrange
from .transport import TORCH, Transport

#: Group kinds, in creation order (every rank creates every group in the same order). The expert kinds (an MoE
#: model's: its rollout expert groups and the micro-EP groups its switch gathers expert tensors over) and
#: ``stage`` (every rank of a rollout stage, megatron-core's tensor × data-parallel group) exist only with experts.
KINDS = ("tp", "pp", "dp", "micro_dp", "cross_stage", "tied_embedding", "single", "stage", "ep", "expt_tp",
         "tp_ep", "expt_dp", "micro_ep", "tp_ep_host")
#: Kinds made with the gloo backend whatever the default is: host-side agreements (the generator's replicas of one
#: expert-parallel group agree on each step's rows there, with no device sync).
HOST_KINDS = ("tp_ep_host",)


@dataclass
class RolloutGroups:
    """This rank's rollout groups and where it sits in them."""

    grid: Grid
    groups: dict[str, Any]
    """This rank's group of each kind (``tied_embedding`` and ``single`` only where they exist)."""
    ranks: dict[str, list[int]]
    """The global ranks of each of those groups, in group-rank order."""
    by_ranks: dict[tuple[int, ...], Any]
    """Every group this rank is in, keyed by its ranks in group-rank order (the plan names groups so)."""
    pg_collection: Any
    """megatron-core's ``ProcessGroupCollection`` for the rollout model."""
    tp_rank: int
    pp_rank: int
    replica: int
    """Rollout TP rank, rollout stage and rollout replica of this rank."""
    timeout: datetime.timedelta
    world: Any
    """Every rank, in rank order, with ``timeout``: for what needs the whole world."""
    expert_grid: Optional[ExpertGrid] = None
    """Where every expert coordinate lives (MoE models only)."""
    layout: Optional[ParallelLayout] = None
    """The layout the groups serve (an exchange one where the in-place groups could not keep their order)."""
    arrangement: Optional[Arrangement] = None
    """Every rank's rollout coordinate (exchange layouts only)."""
    transport: Transport = TORCH
    """How the switch's collectives move bytes (:mod:`megatron_hybrid.transport`): ``torch.distributed`` here; an
    in-process world's rank for a simulated one."""

    def group_of(self, ranks: list[int]) -> Any:
        return self.by_ranks[tuple(ranks)]

    def errors(self, phase: str, what: str) -> Any:
        """:func:`collective_errors` for a collective on these groups."""
        return collective_errors(phase, what, timeout=self.timeout)


class CollectiveError(RuntimeError):
    """A collective of the engine failed or timed out: the message names the phase, the collective and the
    timeout; the backend's own error (gloo's "Timed out waiting 3000ms ...") is chained as ``__cause__``."""


def _seconds(timeout: datetime.timedelta) -> str:
    return f"{timeout.total_seconds():g} s"


@contextmanager
def collective_errors(phase: str, what: str, *, timeout: datetime.timedelta,
                      whose: str = "HybridEngine") -> Iterator[None]:
    """Raise a :class:`CollectiveError` naming ``phase``, ``what`` and ``timeout`` when the collective(s) inside
    fail. Wrap collectives only: gloo raises plain ``RuntimeError``s (NCCL ``DistBackendError``s, a subclass), so
    any ``RuntimeError`` inside is taken for the collective's."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:
        text = str(exc)
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise CollectiveError(f"{phase}: {what} timed out after {_seconds(timeout)} ({whose} timeout): a rank "
                                  "did not arrive in time (stalled, or failed before it)") from exc
        raise CollectiveError(f"{phase}: {what} failed: {text.splitlines()[0] if text else type(exc).__name__} "
                              "(a rank may have left it after an error or a timeout of its own)") from exc


def training_grid(tp_group, pp_group, dp_group, *, world,
                  expert_groups: Optional[tuple[Any, Any, Any]] = None) -> tuple[Grid, Optional[ExpertGrid]]:
    """Where every training coordinate (tp, pp, dp) lives, as the training groups say, and with
    ``expert_groups`` (expert tp, ep, expert dp) every expert coordinate (one collective on ``world``, a group of
    every rank)."""
    mine = (dist.get_rank(tp_group), dist.get_rank(pp_group), dist.get_rank(dp_group))
    if expert_groups is not None:
        mine += tuple(dist.get_rank(g) for g in expert_groups)
    coords: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(coords, mine, group=world)
    grid = Grid.from_coords({r: tuple(c[:3]) for r, c in enumerate(coords)})
    if expert_groups is None:
        return grid, None
    return grid, ExpertGrid.from_coords({r: (c[3], c[4], c[5], c[1]) for r, c in enumerate(coords)})


def _in_place_lists(layout: ParallelLayout, grid: Grid, *, tied_embedding: bool) -> dict[str, list[list[int]]]:
    return {
        "tp": layout.rollout_tp_groups(grid),
        "pp": layout.rollout_pp_groups(grid),
        "dp": layout.rollout_dp_groups(grid),
        "micro_dp": layout.micro_dp_groups(grid),
        "cross_stage": layout.cross_stage_groups(grid),
        "tied_embedding": layout.tied_embedding_groups(grid) if tied_embedding else [],
    }


def _exchange_lists(arrangement: Arrangement) -> dict[str, list[list[int]]]:
    singles = [[r] for r in sorted(arrangement.coords)]
    return {"tp": arrangement.tp_groups(), "pp": arrangement.pp_groups(), "dp": arrangement.dp_groups(),
            "micro_dp": singles, "cross_stage": singles, "tied_embedding": []}


def _exchange_expert_lists(arrangement: Arrangement, ex: ExpertLayout) -> dict[str, list[list[int]]]:
    """An MoE model's rollout expert groups on an exchange layout: each rollout stage's ranks cut into expert TP ×
    EP × expert DP (:meth:`~megatron_hybrid.reshard.exchange.Arrangement.expert_coords`); no micro-EP groups (the
    experts move in the exchange's all-to-all)."""
    coords = arrangement.expert_coords(ex.et_g, ex.e_g).items()
    return {"stage": arrangement.stage_groups(),
            "ep": _group_ranks(coords, lambda c: (c[0], c[2], c[3]), order=lambda c: c[1]),
            "expt_tp": _group_ranks(coords, lambda c: (c[1], c[2], c[3]), order=lambda c: c[0]),
            "tp_ep": _group_ranks(coords, lambda c: (c[2], c[3]), order=lambda c: c[0] + ex.et_g * c[1]),
            "expt_dp": _group_ranks(coords, lambda c: (c[0], c[1], c[3]), order=lambda c: c[2]),
            "micro_ep": [[r] for r in sorted(arrangement.coords)]}


def create_rollout_groups(layout: ParallelLayout, tp_group, pp_group, dp_group, *, timeout: datetime.timedelta,
                          cp_group: Optional[Any] = None, tied_embedding: bool = False,
                          experts: Optional[tuple[ExpertLayout, tuple[Any, Any, Any]]] = None,
                          num_layers: int = 0, chunks: int = 1) -> RolloutGroups:
    """Create every rollout group on every rank (torch needs all ranks in every ``new_group`` call), from where
    the training groups ``tp_group``, ``pp_group``, ``dp_group`` place each rank. ``experts``: an MoE model's
    expert layout and training expert groups (expert tp, ep, expert dp). ``num_layers``, ``chunks``: the model's
    layers and virtual pipeline chunks per stage (where an exchange layout's arrangement finds the layers)."""
    me = dist.get_rank()
    everyone = list(range(dist.get_world_size()))
    world = compat.new_group(everyone, timeout=timeout)
    with collective_errors("HybridEngine()", "the gather of every rank's training coordinates", timeout=timeout):
        grid, expert_grid = training_grid(tp_group, pp_group, dp_group, world=world,
                                          expert_groups=experts[1] if experts is not None else None)
    arrangement = None
    if not layout.exchange:
        lists = _in_place_lists(layout, grid, tied_embedding=tied_embedding)
        if not compat.NEW_GROUP_KEEPS_ORDER and any(g != sorted(g) for kind in lists.values() for g in kind) \
                and experts is None:
            layout = dataclasses.replace(layout, exchange=True)  # the exchange's arrangement keeps groups in order
    if layout.exchange:
        arrangement = arrange(layout, grid, num_layers=num_layers, chunks=chunks,
                              keeps_order=compat.NEW_GROUP_KEEPS_ORDER)
        lists = _exchange_lists(arrangement)
    # The rollout model's context-parallel group when Megatron has none: one rank each.
    lists["single"] = [[r] for r in range(dist.get_world_size())] if cp_group is None else []
    if experts is not None and arrangement is not None:
        lists.update(_exchange_expert_lists(arrangement, experts[0]))
    elif experts is not None:
        ex = experts[0]
        lists.update(stage=layout.rollout_stage_groups(grid), ep=ex.rollout_ep_groups(expert_grid),
                     expt_tp=ex.rollout_expt_tp_groups(expert_grid), tp_ep=ex.rollout_tp_ep_groups(expert_grid),
                     expt_dp=ex.rollout_expt_dp_groups(expert_grid), micro_ep=ex.micro_ep_groups(expert_grid))
        if dist.get_backend() != "gloo":  # on gloo, tp_ep itself is a host group
            lists["tp_ep_host"] = lists["tp_ep"]
    groups: dict[str, Any] = {}
    ranks: dict[str, list[int]] = {}
    by_ranks: dict[tuple[int, ...], Any] = {}
    # One group per distinct rank list (the lists are the same everywhere); the world group is one of them.
    created: dict[tuple[int, ...], Any] = {tuple(everyone): world}
    for kind in KINDS:
        host = kind in HOST_KINDS
        for members in lists.get(kind, []):
            key = tuple(members)
            if host:  # a gloo twin of a device group over the same ranks: not the group the plan names by ranks
                group = compat.new_group(members, timeout=timeout, backend="gloo")
            else:
                if key not in created:
                    created[key] = compat.new_group(members, timeout=timeout)
                group = created[key]
            if me in members:
                if not host:
                    by_ranks[key] = group
                if kind != "tied_embedding":
                    groups[kind], ranks[kind] = group, list(members)
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection()
    pgc.tp, pgc.pp, pgc.dp = groups["tp"], groups["pp"], groups["dp"]
    pgc.cp = cp_group if cp_group is not None else groups["single"]
    pgc.tp_cp = pgc.tp
    pgc.dp_cp = pgc.dp
    pgc.embd = None
    pgc.pos_embd = None
    if experts is not None:  # what megatron-core's MoE layer, router, dispatcher and experts read
        pgc.ep, pgc.expt_tp, pgc.tp_ep, pgc.expt_dp = (groups[k] for k in ("ep", "expt_tp", "tp_ep", "expt_dp"))
        pgc.tp_dp_cp = groups["stage"]
    coord = dict(grid.coords())[me]
    if arrangement is not None:
        tp_rank, pp_rank, replica = arrangement.coords[me]
    else:
        tp_rank, pp_rank, replica = layout.rollout_coords(coord)
    assert ranks["tp"].index(me) == tp_rank and ranks["pp"].index(me) == pp_rank, (ranks, coord)
    return RolloutGroups(grid, groups, ranks, by_ranks, pgc, tp_rank, pp_rank, replica, timeout, world,
                         expert_grid, layout, arrangement)


class InProcessGroups:
    """What the executors read of :class:`RolloutGroups`, for a rank of an
    :class:`~megatron_hybrid.transport.InProcessWorld`: its transport, its micro-DP and micro-EP groups, the world;
    a group is the tuple of its global ranks. ``errors`` names a failed or timed-out collective as the real groups
    do (60 s)."""

    def __init__(self, transport: Transport, micro_dp: Sequence[int], micro_ep: Sequence[int] = ()) -> None:
        self.transport = transport
        self.groups = {"micro_dp": tuple(micro_dp), "micro_ep": tuple(micro_ep)}
        self.world = tuple(range(transport.world_size))

    def group_of(self, ranks: Sequence[int]) -> tuple[int, ...]:
        return tuple(ranks)

    def errors(self, phase: str, what: str) -> Any:
        return collective_errors(phase, what, timeout=datetime.timedelta(seconds=60))
