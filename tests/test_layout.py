"""Pure rank arithmetic and the reshard plan: no torch.distributed, microseconds each."""

from __future__ import annotations

import pytest

from megatron_hybrid.layout import Grid, ParallelLayout, RolloutLayout
from megatron_hybrid.reshard.plan import MemberInfo, ParamInfo, build_group_plan


def test_paper_example_t4_tg2():
    # HybridFlow §5, one training TP group G0..G3, t=4 -> t_g=2: rollout TP {G0,G2},{G1,G3}; micro-DP {G0,G1},{G2,G3}.
    lay = ParallelLayout(t=4, p=1, d=1, t_g=2, p_g=1)
    grid = Grid.megatron_default(4, 1, 1)
    assert lay.rollout_tp_groups(grid) == [[0, 2], [1, 3]]
    assert lay.micro_dp_groups(grid) == [[0, 1], [2, 3]]
    assert lay.d_g == 2


@pytest.mark.parametrize("t,p,d,t_g,p_g", [(2, 1, 4, 1, 1), (4, 1, 2, 2, 1), (8, 1, 1, 2, 1), (4, 2, 1, 2, 2),
                                           (2, 2, 2, 1, 1), (2, 4, 1, 1, 2), (4, 2, 2, 1, 2)])
def test_every_training_shard_is_inside_its_rollout_shard(t, p, d, t_g, p_g):
    lay = ParallelLayout(t=t, p=p, d=d, t_g=t_g, p_g=p_g)
    grid = Grid.megatron_default(t, p, d)
    coord = {r: c for r, c in grid.coords()}
    for group in lay.micro_dp_groups(grid):
        assert len(group) == lay.d_g
        tps = sorted({coord[r][0] for r in group})
        stages = sorted({coord[r][1] for r in group})
        # The group's training TP shards form one rollout TP shard; its stages form one rollout stage.
        assert tps == list(range(tps[0], tps[0] + t // t_g)) and tps[0] % (t // t_g) == 0
        assert stages == list(range(stages[0], stages[0] + p // p_g)) and stages[0] % (p // p_g) == 0
        assert len({coord[r][2] for r in group}) == 1
    for name, groups, size in (("tp", lay.rollout_tp_groups(grid), t_g), ("pp", lay.rollout_pp_groups(grid), p_g),
                               ("dp", lay.rollout_dp_groups(grid), lay.rollout_dp)):
        assert sorted(r for g in groups for r in g) == list(range(t * p * d)), name
        assert all(len(g) == size for g in groups), name
    for g in lay.rollout_tp_groups(grid):
        # Group rank order (torch sorts ranks) is the rollout TP rank order.
        assert [lay.rollout_coords(coord[r])[0] for r in g] == list(range(t_g))


def test_widening_groups_span_dp_replicas():
    lay = ParallelLayout(t=2, p=1, d=4, t_g=4, p_g=1)
    grid = Grid.megatron_default(2, 1, 4)
    assert lay.micro_dp_groups(grid) == [[r] for r in range(8)]
    for g in lay.rollout_tp_groups(grid):
        shards = sorted(lay.rollout_coords(dict(grid.coords())[r])[0] for r in g)
        assert shards == [0, 1, 2, 3]


@pytest.mark.parametrize("t,p,d,t_g,p_g,message", [
    (4, 1, 1, 3, 1, r"rollout tensor_model_parallel_size \(3\) × rollout pipeline_model_parallel_size \(1\) = 3 must "
                    r"divide the world \(4 × 1 × 1 = 4 ranks\)"),
    (2, 2, 1, 1, 3, r"= 3 must divide the world \(2 × 2 × 1 = 4 ranks\)"),
    (2, 1, 1, 4, 1, r"= 4 must divide the world \(2 × 1 × 1 = 2 ranks\)"),
    (2, 1, 1, 0, 1, r"rollout tensor_model_parallel_size \(0\) must be a positive integer"),
])
def test_bad_layouts(t, p, d, t_g, p_g, message):
    with pytest.raises(ValueError, match=message):
        ParallelLayout.create(training=(t, p, d), rollout=RolloutLayout(t_g, p_g))


@pytest.mark.parametrize("t,p,d,t_g,p_g,exchange", [
    (2, 2, 2, 4, 1, True),  # TP up, PP down
    (2, 1, 4, 1, 2, True),  # TP down, PP up
    (1, 1, 8, 1, 2, True),  # more rollout stages than training ones
    (2, 1, 2, 4, 1, False),  # t_g = 2t, 2 | d, p_g = p: in place
    (4, 2, 1, 2, 1, False),
    (2, 2, 2, 1, 1, False),
])
def test_exchange_layouts(t, p, d, t_g, p_g, exchange):
    """Pairs outside the micro-DP gather contract are exchange layouts (megatron_hybrid/reshard/exchange.py)."""
    lay = ParallelLayout.create(training=(t, p, d), rollout=RolloutLayout(t_g, p_g))
    assert lay.exchange == exchange and lay.gathers_in_place() == (not exchange)


def _members(t: int, p: int, t_g: int, p_g: int, layers: int = 4, hidden: int = 8, output: bool = False):
    """A model of ``layers`` layers with one sharded and one replicated tensor each, plus an embedding (and,
    with ``output``, an untied output layer and a final norm on the last stage)."""
    k, q = t // t_g, p // p_g
    per_stage = layers // p
    members = []
    for s in range(q):
        for i in range(k):
            params = []
            if s == 0:
                params.append(ParamInfo("embedding.word_embeddings.weight", "e", (64 // t, hidden), "float32", True))
            for l in range(per_stage):
                g = s * per_stage + l
                params.append(ParamInfo(f"decoder.layers.{g}.w", "w", (hidden * 2 // t, hidden), "float32", True))
                params.append(ParamInfo(f"decoder.layers.{g}.norm", "n", (hidden,), "float32", False))
            if output and s == q - 1:
                params.append(ParamInfo("decoder.final_layernorm.weight", "f", (hidden,), "float32", False))
                params.append(ParamInfo("output_layer.weight", "o", (64 // t, hidden), "float32", True))
            members.append(MemberInfo(rank=s * t + i, tp=i, pp=s, params=tuple(params), layers_per_stage=per_stage))
    return members


@pytest.mark.parametrize("output", [False, True], ids=["embedding", "embedding+output"])
@pytest.mark.parametrize("t,p,t_g,p_g", [(4, 1, 2, 1), (4, 1, 1, 1), (2, 2, 1, 1), (4, 2, 2, 1), (2, 4, 1, 2)])
def test_plan_moves_exactly_the_missing_bytes(t, p, t_g, p_g, output):
    members = _members(t, p, t_g, p_g, output=output)
    needed = sorted({prm.name for m in members for prm in m.params})
    plan = build_group_plan(members, needed, k=t // t_g, q=p // p_g, bucket_numel=40)
    for j, m in enumerate(members):
        # Missing = rollout shard − own shard, computed from the model description alone.
        rollout = 0
        for name in needed:
            holder = next(mm for mm in members if any(x.name == name for x in mm.params))
            info = next(x for x in holder.params if x.name == name)
            rollout += info.numel * (t // t_g if info.sharded else 1)
        own = sum(x.numel for x in m.params)
        assert plan.received_numel(j)["float32"] == rollout - own
        srcs = plan.sources(j)
        assert set(srcs) == set(needed)
        for name, src in srcs.items():
            assert len(src.blocks) == (t // t_g if src.sharded else 1)


@pytest.mark.parametrize("output", [False, True])
def test_plan_collectives_across_stages(output):
    # t=2, p=2 -> t_g=1, p_g=1: a micro-DP group of 4 (two TP columns × two stages), one bucket.
    members = _members(2, 2, 1, 1, output=output)
    plan = build_group_plan(members, sorted({x.name for m in members for x in m.params}), k=2, q=2,
                            bucket_numel=10**6)
    kinds = [(r.kind, len(r.members)) for r in plan.regions["float32"]]
    if output:
        # Layers' shards: one gather over 4; layer norms: a stage gather per TP column; embedding (stage 0) and
        # output layer (stage 1) shards are the same size on every member: one more gather over 4 instead of four
        # broadcasts; the final norm: a broadcast per TP column from the last stage.
        assert sorted(kinds) == sorted([("gather", 4), ("stage_gather", 2), ("stage_gather", 2), ("gather", 4),
                                        ("broadcast", 2), ("broadcast", 2)])
        assert all(plan.collectives(j) == 4 for j in range(4))
    else:
        # The embedding exists on stage 0 only: its two shards are broadcast by their owners.
        assert sorted(kinds) == sorted([("gather", 4), ("stage_gather", 2), ("stage_gather", 2), ("broadcast", 4),
                                        ("broadcast", 4)])
        assert all(plan.collectives(j) == 4 for j in range(4))


def test_plan_buckets_split_the_gather():
    members = _members(2, 1, 1, 1, layers=4)
    plan = build_group_plan(members, sorted({x.name for x in members[0].params}), k=2, q=1, bucket_numel=16)
    gathers = [r for r in plan.regions["float32"] if r.kind == "gather"]
    # Every tensor here is larger than a bucket, so each gets a bucket (and a collective) of its own.
    assert [r.slot_numel for r in gathers] == [256, 64, 64, 64, 64]
    plan = build_group_plan(members, sorted({x.name for x in members[0].params}), k=2, q=1, bucket_numel=10**6)
    assert [r.slot_numel for r in plan.regions["float32"] if r.kind == "gather"] == [512]


def test_plan_alignment_pads_every_slot():
    members = _members(4, 1, 2, 1)
    plan = build_group_plan(members, sorted({x.name for m in members for x in m.params}), k=2, q=1,
                            bucket_numel=100, alignment={"float32": 48})
    for reg in plan.regions["float32"]:
        assert reg.slot_numel % 48 == 0 and reg.offset % 48 == 0
