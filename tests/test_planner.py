"""The step planner against hand-computed plans (pure Python: no model, no ranks, microseconds)."""

from __future__ import annotations

import dataclasses

from megatron_hybrid.inference.planner import PlannerSettings, SlotMoves, StepPlan, StepPlanner, batch_sizes

SIG = ("greedy",)  # a stand-in sampling signature: the planner only puts it into graph keys

EAGER = PlannerSettings(num_slots=4, slot_tokens=64, prefill_tokens=10, batch_sizes=batch_sizes(4))
GRAPHS = dataclasses.replace(EAGER, graphs=True, length_granule=16, prefill_granule=8, prefill_rows=8,
                             prefill_graph_tokens=64, mixed_prompts=2, mixed_tokens=48)


def test_batch_buckets_and_rounding():
    assert batch_sizes(4) == (1, 2, 4) and batch_sizes(6) == (1, 2, 4, 6) and batch_sizes(5, (2, 8)) == (2, 5)
    planner = StepPlanner(GRAPHS)
    assert [planner.batch_bucket(b) for b in (1, 2, 3, 4)] == [1, 2, 4, 4]
    # Attended positions: whole granules of 16, at most a slot's 64.
    assert [planner.length_bucket(n) for n in (1, 16, 17, 63, 64)] == [16, 16, 32, 64, 64]


def test_prefill_cut_by_tokens_and_graph_shape():
    prompts = [[1] * 4, [2] * 5, [3] * 3, [4] * 12]
    admitted = [(seq, seq) for seq in range(4)]
    # Eager: in order, at most 10 prompt tokens a forward, a longer prompt alone.
    assert StepPlanner(EAGER).prefill_groups(admitted, prompts) == [[(0, 0), (1, 1)], [(2, 2)], [(3, 3)]]
    planner = StepPlanner(GRAPHS)
    # Rows exact up to 8, then whole eights; lengths whole granules of 8, at most a slot's.
    assert planner.prefill_shape(3, 5) == (3, 8) and planner.prefill_shape(9, 70) == (16, 64)
    assert planner.prefill_graph_fits(8, 8) and not planner.prefill_graph_fits(2, 40)  # 80 > 64 padded tokens
    # Graphs, by length 3, 4, 5, 12: [3, 4, 5] holds 12 > 10 tokens; [3, 4] + [5] (2 x 8 + 1 x 8 padded, 2 forwards:
    # 792) ties [3] + [4, 5] and is found first; the 12 goes alone.
    cut = planner.prefill_groups(admitted, prompts)
    assert cut == [[(2, 2), (0, 0)], [(1, 1)], [(3, 3)]]
    plan = planner.prefill([prompts[2], prompts[0]], [2, 0], [2, 0], signature=SIG)
    assert plan == StepPlan("prefill", batch=0, rows=2, length=8, attended=0, prompts=(prompts[2], prompts[0]),
                            slots=(2, 0), owners=(2, 0), graph_key=("prefill", 2, 8, SIG))
    # 3 rows x 40 = 120 padded tokens, more than the staging's 64: an eager prefill.
    long = planner.prefill([[5] * 40] * 3, [0, 1, 2], [0, 1, 2], signature=SIG)
    assert long.graph_key is None and (long.rows, long.length) == (3, 0)


def test_decode_and_mixed_plans():
    planner = StepPlanner(GRAPHS)
    plan = planner.decode([0, None, 2], 21, signature=SIG)  # slots 0..2, the longest sequence at 21 positions
    assert plan.graph_key == ("decode", 4, 32, SIG) and plan.owners == (0, None, 2, None)
    eager = StepPlanner(EAGER).decode([0, None, 2], 21, signature=SIG)
    assert (eager.batch, eager.attended, eager.graph_key, eager.owners) == (3, 21, None, (0, None, 2))
    # Mixed: 5 + 30 prompt tokens ride along 3 decode slots: 48 token rows (32, 48, ...), 2 prompt rows.
    prompts = [[1] * 5, [2] * 30]
    assert planner.mixed_fits([(3, 1), (4, 3)], {3: prompts[0], 4: prompts[1]})
    assert not planner.mixed_fits([(3, 1), (4, 3)], {3: prompts[0], 4: [2] * 44})  # 49 tokens > 48
    assert [planner.mixed_chunk(n) for n in (1, 32, 33, 48, 49)] == [32, 32, 48, 48, 48]
    plan = planner.mixed([0, None, 2], 21, prompts, [1, 3], [3, 4], signature=SIG)
    assert plan == StepPlan("mixed", batch=4, rows=2, length=48, attended=64, prompts=tuple(prompts), slots=(1, 3),
                            owners=(0, None, 2, None, 3, 4), graph_key=("mixed", 4, 48, SIG))
    eager = StepPlanner(dataclasses.replace(EAGER, mixed_prompts=2, mixed_tokens=48))
    plan = eager.mixed([0, None, 2], 21, prompts, [1, 3], [3, 4], signature=SIG)
    assert (plan.batch, plan.rows, plan.length, plan.attended, plan.graph_key) == (3, 2, 35, 30, None)


def _drive(schedule, limits: list[int], record) -> list[tuple]:
    """Run ``schedule`` as the replica would, each sequence closed once ``limits[seq]`` tokens are launched (its
    by-length end); what ``record`` says of each step plan, and every slot move."""
    seen = []
    for plan in schedule:
        if isinstance(plan, SlotMoves):
            seen.append(("moves", plan.sources, plan.targets, plan.positions))
            continue
        seen.append(record(plan))
        for seq in plan.owners:
            if seq is not None and schedule.launched[seq] == limits[seq]:
                schedule.finish(seq)
    return seen


def test_a_call_schedule_refills_mixes_and_compacts():
    # Three slots, five prompts; each sequence ends after its second token (the replica's by-length close).
    settings = dataclasses.replace(EAGER, num_slots=3, batch_sizes=batch_sizes(3), mixed_prompts=2,
                                   mixed_tokens=8, compact=True)
    prompts = [[1] * 6, [2] * 2, [3] * 3, [4] * 2, [5] * 2]
    schedule = StepPlanner(settings).schedule(prompts, signature=SIG)
    seen = _drive(schedule, [2] * 5, lambda plan: (plan.kind, plan.owners, plan.attended))
    assert seen == [
        ("prefill", (0, 1), 0), ("prefill", (2,), 0),  # 6 + 2 + 3 > 10 tokens: two forwards
        ("decode", (0, 1, 2), 7),  # the longest: 6 prompt tokens + 1; every sequence has its second token
        ("prefill", (3, 4), 0),  # the last two prompts: nothing decodes for them to ride along
        ("decode", (3, 4), 3),
    ]
    assert schedule.scheduler.done and schedule.launched == [2] * 5

    # A refill rides along the decode step after sequence 1 ends; once no prompt waits and sequence 0 has ended
    # too, the sequence of slot 2 moves down to slot 0 (buckets 1, 2, 3: 2 running fit 2 slots).
    prompts = [[1] * 2, [2] * 2, [3] * 2, [4] * 2]
    limits = [4, 2, 6, 3]
    schedule = StepPlanner(settings).schedule(prompts, signature=SIG)
    seen = _drive(schedule, limits, lambda plan: (plan.kind, plan.owners))
    assert seen == [
        ("prefill", (0, 1, 2)),
        ("decode", (0, 1, 2)),  # sequence 1 ends: slot 1 free
        ("mixed", (0, None, 2, 3)),  # prompt 3 into slot 1, riding along; no prompt waits after it
        ("decode", (0, 3, 2)),  # sequence 0 ends (4 tokens)
        ("moves", (2,), (0,), 6),  # sequence 2: 2 prompt tokens + 4 launched
        ("decode", (2, 3)),  # sequence 3 ends (3 tokens)
        ("decode", (2,)),  # sequence 2 ends (6 tokens)
    ]
