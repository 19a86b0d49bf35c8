"""The switch's collectives behind a transport (issue 48, step 2): the in-process world against formulas, its
failure modes, and the executor's own code run for every member of a plan through it, checked bit for bit against
every member's training tensors."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch

from megatron_hybrid.groups import RolloutGroups
from megatron_hybrid.groups import InProcessGroups as SimulatedGroups
from megatron_hybrid.reshard.executor import PlanExecutor
from megatron_hybrid.reshard.plan import RegionKind, build_group_plan
from megatron_hybrid.transport import TORCH, InProcessWorld, TorchTransport, WorldBroken

from .test_executor import _members


def test_the_engine_default_is_torch_distributed():
    groups = RolloutGroups(None, {}, {}, {}, None, 0, 0, 0, datetime.timedelta(seconds=1), None)
    assert groups.transport is TORCH and isinstance(TORCH, TorchTransport)


def test_in_process_collectives_match_their_definitions():
    n = 4

    def body(t):
        r = t.rank
        objects = t.all_gather_object({"rank": r}, tuple(range(n)))
        # In place, as the executor gathers a region: the input is this rank's slot of the output.
        out = torch.full((n * 3,), -1.0)
        out[r * 3: (r + 1) * 3] = torch.arange(3.0) + 10 * r
        t.all_gather_into_tensor(out, out[r * 3: (r + 1) * 3], tuple(range(n)))
        # A group in group-rank order that is not global order: (3, 1); src is a global rank.
        b = torch.full((2,), float(r))
        if r in (3, 1):
            t.broadcast(b, 1, (3, 1))
        # Uneven splits: rank r sends (r + d) elements of value 100 r + d to rank d.
        send = torch.cat([torch.full((r + d,), 100.0 * r + d) for d in range(n)])
        recv = torch.empty(sum(s + r for s in range(n)))
        t.all_to_all_single(recv, send, [s + r for s in range(n)], [r + d for d in range(n)], tuple(range(n)))
        return objects, out, b, recv

    world = InProcessWorld(n)
    results = world.run(body)
    for r, (objects, out, b, recv) in enumerate(results):
        assert objects == [{"rank": s} for s in range(n)]
        assert torch.equal(out, torch.cat([torch.arange(3.0) + 10 * s for s in range(n)]))
        assert torch.equal(b, torch.full((2,), 1.0 if r in (3, 1) else float(r)))
        assert torch.equal(recv, torch.cat([torch.full((s + r,), 100.0 * s + r) for s in range(n)]))
    assert world.collectives == 4  # three over the world (object, tensor, all-to-all), one broadcast


def test_a_failed_rank_ends_the_others_and_its_error_is_raised():
    def body(t):
        if t.rank == 2:
            raise KeyError("rank 2's own fault")
        return t.all_gather_object(t.rank, (0, 1, 2))

    with pytest.raises(KeyError, match="rank 2's own fault"):
        InProcessWorld(3, timeout=30).run(body)


def test_a_rank_that_never_arrives_is_named_after_the_timeout():
    release = threading.Event()

    def body(t):
        if t.rank == 1:
            release.wait(5)
            return None
        return t.all_gather_object(t.rank, (0, 1))

    with pytest.raises(WorldBroken, match=r"all_gather_object on ranks \[0, 1\] waited 0.2 s: ranks \[1\] did "
                                          r"not arrive"):
        InProcessWorld(2, timeout=0.2).run(body)
    release.set()


def test_bad_worlds_and_groups_are_refused():
    with pytest.raises(ValueError, match=r"world_size \(0\)"):
        InProcessWorld(0)
    with pytest.raises(ValueError, match=r"rank \(2\) must be in \[0, 2\)"):
        InProcessWorld(2).transport(2)
    with pytest.raises(ValueError, match=r"rank 0 is not a member of group \[1\]"):
        InProcessWorld(2).transport(0).all_gather_object(None, (1,))


def _tensor(name: str, tp: int, shape) -> torch.Tensor:
    """Member ``tp``'s training tensor ``name``: distinct values per name and shard, bit-exact to compare."""
    g = torch.Generator().manual_seed(hash((name, tp)) % 2**31)
    return torch.randn(shape, generator=g)


@pytest.mark.parametrize("k,q,strided", [(2, 2, False), (4, 1, True), (1, 4, False)], ids=["k2q2", "k4-strided",
                                                                                         "k1q4"])
def test_the_executor_runs_every_member_of_a_plan_in_one_process(k, q, strided):
    """Every member's PlanExecutor, each in its own rank thread, through the in-process transport: afterwards
    every block a member's rollout tensors read holds the right peer's training tensor, bit for bit, a strided
    region is the canonical tensor (part i of every member side by side), and each member received exactly the
    plan's bytes."""
    hidden = 1024 if strided else 16  # strided regions only for tensors of >= plan.STACKED_MIN_NUMEL elements
    members = _members(k, q, hidden=hidden)
    plan = build_group_plan(members, sorted({p.name for m in members for p in m.params}), k=k, q=q,
                            bucket_numel=10**4, strided=strided)
    kinds = {reg.kind for regs in plan.regions.values() for reg in regs}
    assert (RegionKind.STRIDED in kinds) == strided
    training = [{p.name: _tensor(p.name, m.tp, p.shape) for p in m.params} for m in members]
    # The tensors the plan places (a TP-replicated one at q = 1 stays where it is: the rollout reads its own copy).
    slots = {(sl.member, sl.name) for regs in plan.regions.values() for reg in regs for sl in reg.slices}

    def body(t):
        j = next(i for i, m in enumerate(plan.members) if m.rank == t.rank)
        buffers = {dt: torch.zeros(plan.buffer_numel(dt)) for dt in plan.regions}
        for name, value in training[j].items():  # what Placement does at construction
            if (j, name) in slots:
                dtype, off = plan.where(j, name)
                buffers[dtype][off: off + value.numel()] = value.reshape(-1)
        params = {n: torch.nn.Parameter(v.clone()) for n, v in training[j].items()}
        records = PlanExecutor(plan, j, SimulatedGroups(t, []), training_params=params,
                               device=torch.device("cpu")).run(buffers)
        return j, buffers, records

    for j, buffers, records in InProcessWorld(k * q).run(body):
        assert sum(r.bytes_received for r in records) == 4 * plan.received_numel(j)["float32"]
        for name, src in plan.sources(j).items():
            if name in plan.strided:
                dtype, reg = plan.strided[name]
                owners = [plan.members[i] for i in reg.members]
                parts = [training[i][name].reshape(reg.stride, -1) for i in reg.members]
                canonical = torch.cat([parts[m][s] for s in range(reg.stride) for m in range(len(owners))])
                assert torch.equal(buffers[dtype][reg.offset: reg.offset + reg.numel], canonical), name
                continue
            for block in src.blocks:
                if (block.member, block.name) not in slots:
                    assert block.member == j, (j, name, block)  # read in place from its own training tensor
                    continue
                dtype, off = plan.where(block.member, block.name)
                want = training[block.member][block.name]
                got = buffers[dtype][off: off + want.numel()].view(want.shape)
                assert torch.equal(got, want), (j, name, block)
