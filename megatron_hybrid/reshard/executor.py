"""The distributed side of the reshard plan: the exchange that makes a micro-DP group's plan, and the executor
that runs its collectives at every switch.

:mod:`megatron_hybrid.reshard.plan` decides which bytes move where without ``torch.distributed``. Here
:func:`make_group_plan` gathers the members' parameter descriptions once (one ``all_gather_object`` over the
micro-DP group) and plans on every member alike, and :class:`PlanExecutor` runs this member's part of a switch:
one in-place collective per region it shares with others, in the plan's order. Every member walks the same
regions in the same order, so a switch needs no further agreement. Where the bytes of a switch move: only here.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence

import torch

from ..groups import RolloutGroups
from ..megatron import compat
from ..megatron.sharding import TPSpec, is_expert
from .binding import named_parameters, named_weights
from .exchange import ExchangePlan, RankTensors, build_exchange_plan, keys_of
from .placement import DTYPE_NAMES, DTYPES, HeldBuffer
from .plan import GroupPlan, MemberInfo, ParamInfo, Region, RegionKind, build_group_plan


@dataclasses.dataclass
class CollectiveRecord:
    """One collective of a switch, as the communication report and the trace show it."""

    op: str
    group_ranks: list[int]
    bytes_received: int
    seconds: float
    start: float  # time.time() at the start
    end: float
    rank: int
    plane: str = "dense"  # the tensors it moved: "dense", or an MoE model's routed "experts"


# ---- the exchange that makes the plan ----------------------------------------------------------------------
def held_buffers(chunks: Sequence[torch.nn.Module], *, optimizers: list[Any], experts: Optional[bool] = None
                 ) -> tuple[list[HeldBuffer], dict[int, tuple[int, int]]]:
    """Megatron DDP's parameter buffers of ``chunks`` (distributed optimizer), and id(parameter) -> (buffer index,
    offset in it). ``optimizers``: the optimizers whose shards view the buffers and move with them; read when a
    buffer moves, so one appended later (``HybridEngine.close(optimizer=...)``) is moved too. ``experts``: only
    the buffers of routed experts (True: DDP's expert-parallel buffers, over the expert data-parallel group) or
    only the others (False); all with None."""
    held, at = [], {}
    for chunk in chunks:
        for buffer in compat.ddp_param_buffers(chunk):
            offsets = compat.ddp_param_offsets(buffer)
            # DDP keeps a routed expert's parameters (allreduce=False) in buffers of their own.
            if experts is not None and any(getattr(p, "allreduce", True) is False for p in offsets) != experts:
                continue

            def move(new, chunk=chunk, buffer=buffer):
                compat.ddp_move_param_buffer(chunk, buffer, new, optimizers=optimizers)

            for prm, offset in offsets.items():
                at[id(prm)] = (len(held), offset)
            held.append(HeldBuffer(lambda buffer=buffer: buffer.param_data, move))
    return held, at


def param_infos(modules: Sequence[torch.nn.Module], *,
                held_at: Mapping[int, tuple[int, int]]) -> list[ParamInfo]:
    """The plan's description of every training weight of ``modules``, in module order (global names)."""
    out = []
    for name, local, prm in named_weights(list(modules)):
        spec = TPSpec.of(prm)
        out.append(ParamInfo(name, local, tuple(prm.shape), DTYPE_NAMES[prm.dtype], spec.sharded, spec.dim,
                             spec.stride, held=held_at.get(id(prm))))
    return out


@dataclasses.dataclass(frozen=True)
class PlaneSpec:
    """A *plane*: a set of training tensors with a micro group of its own, and this rank's place in it.

    The dense tensors gather over the micro-DP group (``ParallelLayout``); an MoE model's routed experts over the
    micro-EP group (``ExpertLayout``), on the expert grid: tensor parallelism is then expert TP.
    """

    name: str
    """``"dense"`` or ``"experts"``."""
    group: str
    """The rollout group kind its members form (``micro_dp`` or ``micro_ep``)."""
    tp_size: int
    rollout_tp_size: int
    """Training and rollout (expert) tensor-parallel sizes: a rollout shard has tp_size / rollout_tp_size times the
    training shard's rows along ``partition_dim``."""
    k: int
    q: int
    u: int
    tp_rank: int
    pp_rank: int
    ep_rank: int = 0

    @property
    def gathers(self) -> bool:
        """Whether a switch gathers this plane over its micro group: False when the group is one rank (a rollout
        TP wider than training's: every rollout shard a sub-block of the own shard; or the training layout
        itself, t_g = t and p_g = p, as on one GPU: every rollout shard is the own shard). Then no buffer is
        made and the training tensors, DDP's buffer included, stay where they are."""
        return self.k * self.q * self.u > 1

    def holds(self, name: str) -> bool:
        return is_expert(name) == (self.name == "experts")


def adopt_training_attributes(rollout_params: Mapping[str, torch.nn.Parameter], infos: Mapping[str, ParamInfo], *,
                              tp: int, rollout_tp: int, holders: str) -> None:
    """The rollout model was built without initialisation, so Megatron never set its tensor-parallel attributes:
    they are layout-invariant, so take them from the training tensor of the same name (``infos``), and check each
    rollout shape against it (a TP-sharded one has tp / rollout_tp times its rows along ``partition_dim``)."""
    for name, prm in rollout_params.items():
        info = infos.get(name)
        if info is None:
            raise ValueError(f"no {holders} holds {name}: the rollout model does not correspond to the training "
                             "model")
        shape = list(info.shape)
        if info.sharded:
            prm.tensor_model_parallel, prm.partition_dim, prm.partition_stride = True, info.dim, info.stride
            shape[info.dim] = shape[info.dim] * tp // rollout_tp
        if tuple(shape) != tuple(prm.shape):
            raise ValueError(f"rollout parameter {name} has shape {tuple(prm.shape)}, expected {tuple(shape)} "
                             "from the training model")


def make_group_plan(modules: Sequence[torch.nn.Module], rollout_chunks: Sequence[torch.nn.Module],
                    plane: PlaneSpec, groups: RolloutGroups, *, layers_per_stage: int, bucket_size_mb: float,
                    held: Sequence[HeldBuffer] = (), held_at: Mapping[int, tuple[int, int]] = {},
                    alignment: Optional[dict[str, int]] = None,
                    tied: Optional[tuple[str, str]] = None, strided: bool = False
                    ) -> tuple[Optional[GroupPlan], int]:
    """Gather the members' descriptions of ``plane``'s tensors and plan their switch (the same plan on each member).

    ``modules``: this rank's training model chunks (unwrapped); ``rollout_chunks``: the rollout model built without
    weights, whose parameters get their tensor-parallel attributes here and are checked against the training
    shapes. ``held``/``held_at``: see :func:`held_buffers`; ``alignment``, ``tied``, ``strided``: see
    :func:`~megatron_hybrid.reshard.plan.build_group_plan`. Returns the plan (``None`` when the plane does not gather)
    and this rank's member index.
    """
    mine = [info for info in param_infos(modules, held_at=held_at) if plane.holds(info.name)]
    names = [info.name for info in mine]
    if len(set(names)) != len(names):
        raise ValueError("duplicate parameter names across model chunks")
    rollout_params = {n: p for n, p in named_parameters(list(rollout_chunks)) if plane.holds(n)}
    transport = groups.transport
    member = MemberInfo(transport.rank, plane.tp_rank, plane.pp_rank, tuple(mine), layers_per_stage,
                        held=tuple((DTYPE_NAMES[h.dtype], h.numel) for h in held), ep=plane.ep_rank)
    members: list[Any] = [member]
    if plane.gathers:
        with groups.errors("HybridEngine()", f"the {plane.group.replace('_', '-')} gather of the parameter "
                                             "descriptions"):
            members = transport.all_gather_object(member, groups.groups[plane.group])
    members.sort(key=lambda m: m.rank)
    info_by_name = {p.name: p for m in members for p in m.params}
    adopt_training_attributes(rollout_params, info_by_name, tp=plane.tp_size, rollout_tp=plane.rollout_tp_size,
                              holders=f"training rank of this {plane.group.replace('_', '-')} group")
    index = [m.rank for m in members].index(transport.rank)
    if not plane.gathers:
        return None, index
    bucket_numel = {name: max(1, int(bucket_size_mb * 2**20) // torch.empty((), dtype=dt).element_size())
                    for name, dt in DTYPES.items()}
    # Routed experts: a bucket per layer, so that a rollout layer's experts are one strided view (grouped GEMMs).
    plan = build_group_plan(members, list(rollout_params), k=plane.k, q=plane.q, u=plane.u,
                            bucket_numel=bucket_numel, alignment=alignment, tied=tied, strided=strided,
                            bucket_per_layer=plane.name == "experts")
    return plan, index


# ---- the executor ------------------------------------------------------------------------------------------
class PlanExecutor:
    """Runs one member's collectives of a :class:`~megatron_hybrid.reshard.plan.GroupPlan` at each switch.

    Args:
        plan: the micro-DP group's plan (the same on every member).
        member: this rank's index among the plan's members.
        groups: the rollout groups; every collective runs on the group of its region's members, inside
            :meth:`~megatron_hybrid.groups.RolloutGroups.errors` (a failure or timeout names the collective).
        training_params: this rank's training parameters by global name: a ``strided`` region is gathered
            straight from them (read at every switch).
        device: where the buffers live; with profiling, a CUDA device is synchronised after every collective.
        plane: the name of the plane the plan moves (its records carry it).
    """

    #: The collective that fills each kind of region, as the report names it (a stage_gather region is a gather
    #: over a cross-stage group; a strided one is gathered part by part).
    OPS: ClassVar[dict[RegionKind, str]] = {RegionKind.GATHER: "all_gather_into_tensor",
                                            RegionKind.STAGE_GATHER: "all_gather_into_tensor",
                                            RegionKind.STRIDED: "all_gather_into_tensor",
                                            RegionKind.BROADCAST: "broadcast"}

    def __init__(self, plan: GroupPlan, member: int, groups: RolloutGroups, *,
                 training_params: Mapping[str, torch.nn.Parameter], device: torch.device,
                 plane: str = "dense") -> None:
        self.plan = plan
        self.plane = plane
        self.member = member
        self.groups = groups
        self.training_params = training_params
        self.device = device
        # Each method fills a region of its kind and returns the bytes this member received.
        self._fill: dict[RegionKind, Callable[[torch.Tensor, Region, Any], int]] = {
            RegionKind.GATHER: self._gather, RegionKind.STAGE_GATHER: self._gather,
            RegionKind.STRIDED: self._strided, RegionKind.BROADCAST: self._broadcast}

    def regions(self) -> list[tuple[str, Region]]:
        """(dtype, region) of every collective this member takes part in, in the order they run."""
        j = self.member
        return [(dtype, reg) for dtype, regs in self.plan.regions.items() for reg in regs
                if j in reg.members and len(reg.members) > 1]

    def run(self, buffers: Mapping[str, torch.Tensor], *, profile: bool = False) -> list[CollectiveRecord]:
        """Fill this member's regions of ``buffers`` (the flat buffer of each of the plan's dtypes, mapped) and
        return one record per collective. ``profile``: synchronise after each, so that its ``seconds`` is its
        time rather than its launch time (GPU)."""
        return [self._run(buffers[dtype], reg, profile) for dtype, reg in self.regions()]

    def _run(self, flat: torch.Tensor, reg: Region, profile: bool) -> CollectiveRecord:
        ranks = [self.plan.members[i].rank for i in reg.members]
        group = self.groups.group_of(ranks)
        region = flat[reg.offset: reg.offset + reg.numel]
        kind = RegionKind(reg.kind)
        t0, wall0 = time.perf_counter(), time.time()
        op = self.OPS[kind]
        with self.groups.errors("switch_to_rollout", f"the {op} over ranks {ranks}"):
            received = self._fill[kind](region, reg, group)
        if profile and self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        return CollectiveRecord(op, ranks, received, seconds, wall0, wall0 + seconds, self.groups.transport.rank,
                                self.plane)

    def _broadcast(self, region: torch.Tensor, reg: Region, group: Any) -> int:
        """A tensor of one training stage, sent in place by its owner."""
        self.groups.transport.broadcast(region, self.plan.members[reg.owner].rank, group)
        return 0 if reg.owner == self.member else reg.slot_numel * region.element_size()

    def _strided(self, region: torch.Tensor, reg: Region, group: Any) -> int:
        """Part i of every member's shard, side by side: the rollout tensor's layout, gathered from the training
        tensors (one all-gather per part)."""
        own = self.training_params[reg.tensor].data.reshape(reg.stride, -1)
        part = reg.slot_numel // reg.stride
        size = len(reg.members)
        for i in range(reg.stride):
            self.groups.transport.all_gather_into_tensor(region[i * part * size: (i + 1) * part * size], own[i],
                                                         group)
        return reg.slot_numel * (size - 1) * region.element_size()

    def _gather(self, region: torch.Tensor, reg: Region, group: Any) -> int:
        """Every member's slot, gathered in place from its own."""
        lo = reg.slot_offset(self.member) - reg.offset
        self.groups.transport.all_gather_into_tensor(region, region[lo: lo + reg.slot_numel], group)
        return reg.slot_numel * (len(reg.members) - 1) * region.element_size()


# ---- any layout pair: the exchange ------------------------------------------------------------------------
def make_exchange_plan(modules: Sequence[torch.nn.Module], rollout_chunks: Sequence[torch.nn.Module],
                       groups: RolloutGroups, *, tp_rank: int, tied: bool,
                       experts: Optional[tuple[Any, int]] = None) -> ExchangePlan:
    """Gather every rank's training tensors and rollout needs (one ``all_gather_object`` over the world) and plan
    the exchange (the same plan on every rank). The rollout parameters get their tensor-parallel attributes here and
    are checked against the training shapes, as in :func:`make_group_plan`. ``experts``: an MoE model's
    :class:`~megatron_hybrid.layout.ExpertLayout` and this rank's training expert-TP rank (its routed experts move
    on their own axis, expert TP; the rollout expert-TP rank is the rollout groups')."""
    lay = groups.layout
    held: dict[str, ParamInfo] = {}
    for info in param_infos(modules, held_at={}):
        key = keys_of([info.name], tied=tied)[info.name]
        held.setdefault(key, dataclasses.replace(info, name=key))
    rollout_params = dict(named_parameters(list(rollout_chunks)))
    needs = keys_of(list(rollout_params), tied=tied)
    ex, expert_tp = experts if experts is not None else (None, 0)
    rollout_expert_tp = groups.ranks["expt_tp"].index(groups.transport.rank) if ex is not None else 0
    mine = RankTensors(groups.transport.rank, tp_rank, groups.tp_rank, tuple(held.values()), tuple(needs.values()),
                       expert_tp, rollout_expert_tp)
    with groups.errors("HybridEngine()", "the world's gather of the parameter descriptions"):
        everyone = groups.transport.all_gather_object(mine, groups.world)
    infos = {info.name: info for rt in everyone for info in rt.held}
    for axis_is_expert, (tp, rollout_tp) in ((False, (lay.t, lay.t_g)),
                                             (True, (ex.et, ex.et_g) if ex is not None else (1, 1))):
        adopt_training_attributes({n: p for n, p in rollout_params.items() if is_expert(n) == axis_is_expert},
                                  {n: infos[k] for n, k in needs.items() if k in infos}, tp=tp, rollout_tp=rollout_tp,
                                  holders="training rank")
    return build_exchange_plan(everyone, t=lay.t, t_g=lay.t_g, et=ex.et if ex is not None else 1,
                               et_g=ex.et_g if ex is not None else 1, is_expert=is_expert)


class ExchangeExecutor:
    """Runs this rank's part of an :class:`~megatron_hybrid.reshard.exchange.ExchangePlan` at each switch: per dtype,
    the pieces it sends packed into one transient buffer (in destination order), and one ``all_to_all_single`` over the
    world that lands every piece it misses in its receive buffer (in source order), where the rollout tensors view
    them. A dtype no rank misses anything of runs no collective.

    Args:
        plan: the exchange plan (the same on every rank).
        rank: this rank.
        groups: the rollout groups (the world group, and the error context of a collective).
        training_params: this rank's training parameters by global name (read at every switch).
        keys: global name -> plan key of this rank's training parameters (a tied output layer is the embedding).
        device: where the buffers live; with profiling, a CUDA device is synchronised after every collective.
    """

    plane = "dense"

    def __init__(self, plan: ExchangePlan, rank: int, groups: RolloutGroups, *,
                 training_params: Mapping[str, torch.nn.Parameter], keys: Mapping[str, str],
                 device: torch.device) -> None:
        self.plan, self.rank, self.groups, self.device = plan, rank, groups, device
        self.training_params = training_params
        self._own = {key: name for name, key in keys.items()}  # plan key -> the training parameter holding it
        self._sends = {dtype: plan.sends(rank, dtype) for dtype in plan.dtypes()}
        # (receive, send) split sizes per dtype, in rank order: planned once, like the pieces.
        self._splits = {dtype: (plan.splits(rank, dtype, sending=False), plan.splits(rank, dtype, sending=True))
                        for dtype in plan.dtypes()}

    def source_view(self, key: str, part: int, lo: int, hi: int) -> torch.Tensor:
        """Units [lo, hi) of ``part`` of this rank's training tensor ``key`` (a view, strided for dim 1)."""
        return self.plan.view_of(self.training_params[self._own[key]].data, key, self.plan.source_tp(self.rank, key),
                                 part, lo, hi)

    def run(self, buffers: Mapping[str, torch.Tensor], *, profile: bool = False) -> list[CollectiveRecord]:
        """One ``all_to_all_single`` per dtype that moves anything; ``buffers``: this rank's receive buffers."""
        records = []
        world = list(range(self.plan.world))
        for dtype in self.plan.dtypes():
            sends = self._sends[dtype]
            send = torch.empty(sum(pc.numel for _, pc in sends), dtype=DTYPES[dtype], device=self.device)
            off = 0
            with torch.no_grad():
                for _, pc in sends:
                    send[off: off + pc.numel].view(pc.shape).copy_(self.source_view(pc.key, pc.part, pc.lo, pc.hi))
                    off += pc.numel
            out_splits, in_splits = self._splits[dtype]
            recv = buffers[dtype][: sum(out_splits)] if dtype in buffers else send.new_empty(0)
            t0, wall0 = time.perf_counter(), time.time()
            with self.groups.errors("switch_to_rollout", f"the all_to_all_single of {dtype} pieces over the world"):
                self.groups.transport.all_to_all_single(recv, send, out_splits, in_splits, self.groups.world)
            if profile and self.device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            del send
            records.append(CollectiveRecord("all_to_all_single", world, recv.numel() * recv.element_size(), seconds,
                                            wall0, wall0 + seconds, self.rank, self.plane))
        return records
