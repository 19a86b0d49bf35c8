"""The reshard plan's executor on its own: which collective each region gets, on which ranks, with which byte
counts, in one process (the collectives recorded, not run; the engine tests run them on gloo ranks)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from megatron_hybrid.groups import CollectiveError, RolloutGroups
from megatron_hybrid.megatron import compat
from megatron_hybrid.reshard.executor import PlanExecutor
from megatron_hybrid.reshard.plan import MemberInfo, ParamInfo, RegionKind, build_group_plan


def _members(k: int, q: int, *, hidden: int) -> list[MemberInfo]:
    """k TP columns × q stages, two layers a stage: a SwiGLU-like fc1 (dim 0, stride 2) and a norm per layer, an
    embedding on the first stage, a final norm and an output layer on the last."""
    out = []
    for s in range(q):
        for i in range(k):
            params = []
            if s == 0:
                params.append(ParamInfo("embedding.word_embeddings.weight", "e", (64 // k, 8), "float32", True))
            for g in (2 * s, 2 * s + 1):
                params.append(ParamInfo(f"decoder.layers.{g}.mlp.linear_fc1.weight", "w", (2 * hidden // k, hidden),
                                        "float32", True, 0, 2))
                params.append(ParamInfo(f"decoder.layers.{g}.norm", "n", (hidden,), "float32", False))
            if s == q - 1:
                params.append(ParamInfo("decoder.final_layernorm.weight", "f", (8,), "float32", False))
                params.append(ParamInfo("output_layer.weight", "o", (32 // k, 8), "float32", True))
            out.append(MemberInfo(rank=s * k + i, tp=i, pp=s, params=tuple(params), layers_per_stage=2))
    return out


def _groups(plan) -> RolloutGroups:
    by_ranks = {tuple(plan.members[i].rank for i in reg.members): object()
                for regs in plan.regions.values() for reg in regs}
    return RolloutGroups(None, {}, {}, by_ranks, None, 0, 0, 0, datetime.timedelta(seconds=3), None)


@pytest.mark.parametrize("k,q,strided", [(2, 2, False), (4, 1, True)], ids=["k2q2", "k4-strided"])
def test_executor_runs_each_region_once_with_the_plans_bytes(monkeypatch, k, q, strided):
    hidden = 1024 if strided else 16  # strided regions only for tensors of >= plan.STACKED_MIN_NUMEL elements
    members = _members(k, q, hidden=hidden)
    plan = build_group_plan(members, sorted({p.name for m in members for p in m.params}), k=k, q=q,
                            bucket_numel=10**4, strided=strided)
    kinds = {reg.kind for regs in plan.regions.values() for reg in regs}
    assert kinds == ({RegionKind.STRIDED, RegionKind.GATHER} if strided
                     else {RegionKind.GATHER, RegionKind.STAGE_GATHER, RegionKind.BROADCAST})
    groups = _groups(plan)
    calls = []

    def broadcast(tensor, src, group):
        calls.append(("broadcast", tensor.numel(), src, group))

    def all_gather(output, input_, group, async_op=False):
        assert output.numel() == input_.numel() * len(next(r for r, g in groups.by_ranks.items() if g is group))
        if input_.data_ptr() >= output.data_ptr() and input_.data_ptr() < output.data_ptr() + output.nbytes:
            calls.append(("all_gather_into_tensor", "in place", group))
        else:
            calls.append(("all_gather_into_tensor", "from the training tensor", group))

    monkeypatch.setattr(dist, "broadcast", broadcast)
    monkeypatch.setattr(compat, "all_gather_into_tensor", all_gather)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    for j, me in enumerate(members):
        buffers = {dt: torch.zeros(plan.buffer_numel(dt)) for dt in plan.regions}
        own = {p.name: torch.nn.Parameter(torch.zeros(p.shape)) for p in me.params}
        calls.clear()
        records = PlanExecutor(plan, j, groups, training_params=own, device=torch.device("cpu")).run(buffers)
        regions = [reg for regs in plan.regions.values() for reg in regs if j in reg.members and len(reg.members) > 1]
        assert len(records) == plan.collectives(j) == len(regions)
        assert sum(r.bytes_received for r in records) == 4 * plan.received_numel(j)["float32"]
        for rec, reg in zip(records, regions):
            assert rec.group_ranks == [plan.members[i].rank for i in reg.members]
            assert rec.op == ("broadcast" if reg.kind == RegionKind.BROADCAST else "all_gather_into_tensor")
        # One collective per region (a strided one: one per part), on the region's group, in the plan's order.
        expected = []
        for reg in regions:
            group = groups.group_of([plan.members[i].rank for i in reg.members])
            if reg.kind == RegionKind.BROADCAST:
                expected.append(("broadcast", reg.slot_numel, plan.members[reg.owner].rank, group))
            elif reg.kind == RegionKind.STRIDED:
                expected += [("all_gather_into_tensor", "from the training tensor", group)] * reg.stride
            else:
                expected.append(("all_gather_into_tensor", "in place", group))
        assert calls == expected


def test_executor_names_the_failed_collective(monkeypatch):
    members = _members(2, 2, hidden=16)
    plan = build_group_plan(members, sorted({p.name for m in members for p in m.params}), k=2, q=2,
                            bucket_numel=10**4)

    def stalled(*args, **kwargs):
        raise RuntimeError("[gloo] Timed out waiting 3000ms for recv operation to complete")

    monkeypatch.setattr(compat, "all_gather_into_tensor", stalled)
    buffers = {dt: torch.zeros(plan.buffer_numel(dt)) for dt in plan.regions}
    executor = PlanExecutor(plan, 0, _groups(plan), training_params={}, device=torch.device("cpu"))
    with pytest.raises(CollectiveError, match=r"switch_to_rollout: the all_gather_into_tensor over ranks "
                                              r"\[0, 1, 2, 3\] timed out after 3 s"):
        executor.run(buffers)
