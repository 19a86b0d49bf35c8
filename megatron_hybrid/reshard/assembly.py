"""One engine's reshard put together: per plane, the plan, where its tensors live and the executor of its collectives.

:class:`~megatron_hybrid.engine.HybridEngine` builds it once, after the rollout groups and the rollout model: an
in-place layout gets a group plan per plane (:func:`place_planes`: the dense tensors over the micro-DP groups, an MoE
model's routed experts over the micro-EP groups), any other layout pair one exchange plan (:func:`place_exchange`).
Making a plan gathers the members' parameter descriptions (a collective): every rank builds its reshard at the same
point of the engine's construction.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..groups import RolloutGroups
from ..layout import ExpertLayout
from ..megatron.sharding import is_expert
from .binding import named_parameters
from .exchange import ExchangePlan, keys_of
from .executor import ExchangeExecutor, PlaneSpec, PlanExecutor, held_buffers, make_exchange_plan, make_group_plan
from .placement import ExchangePlacement, Placement, Placements

#: The expert groups of an MoE model's training layout: (expert tensor-parallel, expert-parallel, expert data-parallel).
ExpertGroups = tuple[Any, Any, Any]


@dataclasses.dataclass
class Reshard:
    """What a switch to rollout runs: every plane's placement, the plans and their executors."""

    placement: Placements
    plans: dict[str, tuple[Optional[Any], int]]
    """Per plane, its group plan (None where the micro group is one rank) and this rank's member index; an exchange
    layout's ``"dense"`` is (None, the global rank)."""
    executors: list[Any]
    """The switch's collectives, plane by plane."""
    exchange_plan: Optional[ExchangePlan] = None
    """An exchange layout's plan (None for an in-place one)."""


def plane_specs(groups: RolloutGroups, *, expert_layout: Optional[ExpertLayout],
                expert_groups: Optional[ExpertGroups], tp_rank: int, pp_rank: int) -> list[PlaneSpec]:
    """The dense plane over the micro-DP groups, and an MoE model's routed experts over the micro-EP groups
    (``tp_rank``, ``pp_rank``: this rank's in the training layout)."""
    lay = groups.layout
    specs = [PlaneSpec(name="dense", group="micro_dp", tp_size=lay.t, rollout_tp_size=lay.t_g, k=lay.k, q=lay.q, u=1,
                       tp_rank=tp_rank, pp_rank=pp_rank)]
    ex = expert_layout
    if ex is not None:
        et_rank, ep_rank, _ = (dist.get_rank(g) for g in expert_groups)
        specs.append(PlaneSpec(name="experts", group="micro_ep", tp_size=ex.et, rollout_tp_size=ex.et_g, k=ex.ke,
                               q=ex.q, u=ex.ue, tp_rank=et_rank, pp_rank=pp_rank, ep_rank=ep_rank))
    return specs


def place_planes(modules: Sequence[torch.nn.Module], rollout_chunks: Sequence[torch.nn.Module],
                 groups: RolloutGroups, *, chunks: Sequence[torch.nn.Module], optimizers: list[Any],
                 training_params: dict[str, torch.nn.Parameter], device: torch.device,
                 expert_layout: Optional[ExpertLayout], expert_groups: Optional[ExpertGroups], tp_rank: int,
                 pp_rank: int, num_layers: int, bucket_size_mb: float, align_slots: bool,
                 tied: Optional[tuple[str, str]], strided: bool) -> Reshard:
    """The gather plans of an in-place layout, plane by plane, their placements and executors.

    ``chunks``: the training model as given (DDP's parameter buffers, with the distributed optimizer, become the own
    slots; ``optimizers`` view them and move with them); ``modules``: the same unwrapped. ``tied``: the tied output
    layer and embedding when the last stage's output layer is the rollout embedding (the dense plane's). ``strided``:
    canonical rollout weights (see :func:`~megatron_hybrid.reshard.plan.build_group_plan`)."""
    lay = groups.layout
    alignment = Placement.alignment(device) if align_slots else None
    plans: dict[str, tuple[Optional[Any], int]] = {}
    planes: dict[str, Placement] = {}
    executors: list[Any] = []
    for spec in plane_specs(groups, expert_layout=expert_layout, expert_groups=expert_groups, tp_rank=tp_rank,
                            pp_rank=pp_rank):
        dense = spec.name == "dense"
        # DDP's parameter buffers (distributed optimizer): its expert-parallel ones are the experts plane's.
        held, held_at = held_buffers(chunks, optimizers=optimizers,
                                     experts=None if expert_layout is None else not dense)
        plan, index = make_group_plan(
            modules, rollout_chunks, spec, groups, layers_per_stage=num_layers // lay.p, bucket_size_mb=bucket_size_mb,
            held=held, held_at=held_at, alignment=alignment, tied=tied if dense else None, strided=strided)
        plans[spec.name] = (plan, index)
        planes[spec.name] = Placement(plan, index, training_params, lay, rollout_tp_rank=groups.tp_rank,
                                      device=device, held=held if plan is not None else ())
        if plan is not None:  # none when the micro group is one rank: every rank holds its rollout shard
            executors.append(PlanExecutor(plan, index, groups, plane=spec.name, training_params=training_params,
                                          device=device))
    return Reshard(Placements(planes, lambda name: "experts" if is_expert(name) else "dense"), plans, executors)


def place_exchange(modules: Sequence[torch.nn.Module], rollout_chunks: Sequence[torch.nn.Module],
                   groups: RolloutGroups, *, training_params: dict[str, torch.nn.Parameter], device: torch.device,
                   expert_layout: Optional[ExpertLayout], expert_groups: Optional[ExpertGroups], tp_rank: int,
                   tied: bool) -> Reshard:
    """The exchange plan of any other layout pair (:mod:`megatron_hybrid.reshard.exchange`), its placement (the
    training tensors stay where they are; a receive buffer per dtype) and executor. An MoE model's routed experts
    move in the same all-to-all, on their own axis (expert TP). ``tied``: the model ties its output layer to its
    embedding."""
    rank = dist.get_rank()
    experts = None if expert_groups is None else (expert_layout, dist.get_rank(expert_groups[0]))
    plan = make_exchange_plan(modules, rollout_chunks, groups, tp_rank=tp_rank, tied=tied, experts=experts)
    names = list(training_params) + [n for n, _ in named_parameters(rollout_chunks)]
    keys = keys_of(names, tied=tied)
    placement = ExchangePlacement(plan, rank, training_params, groups.layout, keys=keys,
                                  rollout_tp_rank=groups.tp_rank, device=device)
    executor = ExchangeExecutor(plan, rank, groups, training_params=training_params,
                                keys={n: keys[n] for n in training_params}, device=device)
    return Reshard(Placements({"dense": placement}, lambda name: "dense"), {"dense": (None, rank)}, [executor],
                   exchange_plan=plan)
