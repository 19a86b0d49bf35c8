"""Packed micro-batches (issue 44, step 3): first-fit decreasing into a token budget, the packed layout, and the
log-prob, entropy, value and reward-score passes over packed sequences equal to the padded passes (and to
megatron-core's own attention on the padded layout), with RoPE restarting at every sequence."""

from __future__ import annotations

import pytest
import torch

from megatron_hybrid.rl.balance import balanced_partition
from megatron_hybrid.rl.packing import first_fit_decreasing, in_batch_order, packed_micro_batches, split_to
from tests import rl_cases
from tests.harness import run_distributed


def test_first_fit_decreasing_by_hand():
    # Longest first, each into the first group with room: 5 | 4 | 3 -> first (5+3) | 3 -> second (4+3) |
    # 2 -> new | 2 -> third | 1 -> second (4+3+1).
    assert first_fit_decreasing([5, 4, 3, 3, 2, 2, 1], 8) == [[0, 2], [1, 3, 6], [4, 5]]
    assert first_fit_decreasing([], 8) == []
    assert first_fit_decreasing([8, 8], 8) == [[0], [1]]


@pytest.mark.parametrize("seed", range(5))
def test_first_fit_decreasing_keeps_the_budget_and_every_sequence(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (50,), generator=g).tolist()
    groups = first_fit_decreasing(lengths, 64)
    assert sorted(i for grp in groups for i in grp) == list(range(50))
    assert all(sum(lengths[i] for i in grp) <= 64 for grp in groups)
    # First fit: no later group could have taken a sequence of an earlier-opened group's... the bound FFD keeps:
    # at most one group is half empty or less.
    assert sum(sum(lengths[i] for i in grp) <= 32 for grp in groups) <= 1


def test_a_budget_below_the_longest_sequence_is_named():
    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch \(10\) is below the longest sequence's 12 "
                                         r"tokens \(sequence 1\)"):
        first_fit_decreasing([3, 12, 5], 10)
    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch \(0\) must be ≥ 1"):
        first_fit_decreasing([3], 0)


def test_packed_layout_holds_each_sequence_with_its_positions_and_labels():
    batch = rl_cases._ragged_batch(3, 10)
    lengths = (batch.data["end"] + 1).tolist()
    mbs = packed_micro_batches(batch, 24)
    assert sorted(r for mb in mbs for r in mb["rows"].tolist()) == list(range(10))
    for mb in mbs:
        cu = mb["cu_seqlens"].tolist()
        assert mb["tokens"].shape == (1, cu[-1]) and cu[-1] <= 24 and mb["cu_seqlens"].dtype == torch.int32
        for j, row in enumerate(mb["rows"].tolist()):
            lo, hi = cu[j], cu[j + 1]
            assert hi - lo == lengths[row]
            assert torch.equal(mb["tokens"][0, lo:hi], batch.tokens_BS[row, :lengths[row]])
            assert mb["positions"][0, lo:hi].tolist() == list(range(lengths[row]))  # restarting per sequence
            # The response positions predict the same labels as in the padded layout.
            real = batch.mask_BN[row] > 0
            packed_labels = torch.roll(mb["tokens"][0], -1)[mb["index"][j]][real]
            padded_labels = torch.roll(batch.tokens_BS[row], -1)[batch.index_BN[row]][real]
            assert torch.equal(packed_labels, padded_labels)
            assert ((mb["index"][j] >= lo) & (mb["index"][j] < hi)).all()
            assert torch.equal(mb["mask"][j], batch.mask_BN[row])


# RoPE is relative, so a pack's attention within a sequence does not see where the sequence starts; learned
# absolute positions do (the restarting ``positions``).
@pytest.mark.parametrize("arch", [dict(), dict(num_query_groups=2, add_qkv_bias=True),
                                  dict(position_embedding_type="learned_absolute")],
                         ids=["mha-rope", "gqa-qkv-bias", "learned-positions"])
def test_packed_passes_equal_the_padded_ones(arch):
    capacity, chunk = 24, 5  # several packs, and several log-prob chunks per pack
    out = run_distributed(rl_cases.packed_passes_case, 1, capacity, chunk, arch)[0]
    assert len(out["packs"]) >= 3 and max(map(len, out["packs"])) >= 2
    mask = out["mask"] > 0
    assert (~mask).any()  # short responses: padding slots, where a pack computes nothing over the vocabulary
    assert not out["packed"]["logp"][~mask].any() and not out["packed"]["entropy"][~mask].any()
    for ref in ("padded", "local"):
        for key in ("logp", "entropy", "values"):
            # fp32; the same per-sequence attention in other kernels and shapes (a pack's rows, a chunk's
            # log-softmax): the sums differ in order, ~1e-7 relative.
            torch.testing.assert_close(out["packed"][key][mask], out[ref][key][mask], rtol=1e-5, atol=1e-5,
                                       msg=f"{key} packed vs {ref}")
        torch.testing.assert_close(out["packed"]["scores"], out[ref]["scores"], rtol=1e-5, atol=1e-5)
        assert out["packed"]["grads"].keys() == out[ref]["grads"].keys()
        for name, grad in out[ref]["grads"].items():
            torch.testing.assert_close(out["packed"]["grads"][name], grad, rtol=1e-4,
                                       atol=1e-5 * float(grad.abs().max()), msg=f"{name} packed vs {ref}")


def test_split_to_makes_the_count_within_the_budget():
    lengths = [9, 7, 5, 3, 2, 1]
    groups = first_fit_decreasing(lengths, 16)
    assert groups == [[0, 1], [2, 3, 4, 5]]  # 16 and 11 tokens
    four = split_to(groups, lengths, 4)
    # The heavier group splits first (9 | 7), then the 11-token one, longest first into the lighter half:
    # 5 | 3, then 2 -> the 3 side, 1 -> the 5 side (a tie goes to the first half).
    assert four == [[0], [1], [2, 5], [3, 4]]
    assert split_to(groups, lengths, 2) == groups
    # Too few sequences for the count: fillers ([]), which train nothing.
    assert split_to([[0], [1]], [4, 4], 4) == [[0], [1], [], []]


@pytest.mark.parametrize("seed", range(4))
def test_balanced_partition_keeps_counts_and_meets_the_greedy_bound(seed):
    import itertools

    g = torch.Generator().manual_seed(seed)
    costs = torch.randint(1, 100, (8,), generator=g).tolist()
    counts = [4, 4] if seed % 2 else [2, 2, 2, 2]
    bins = balanced_partition(costs, counts)
    assert sorted(i for b in bins for i in b) == list(range(8)) and [len(b) for b in bins] == counts
    # The best partition with these counts, by brute force over every assignment.
    best = min(max(sum(costs[i] for i, r in enumerate(assign) if r == j) for j in range(len(counts)))
               for assign in itertools.product(range(len(counts)), repeat=8)
               if all(assign.count(j) == c for j, c in enumerate(counts)))
    assert max(sum(costs[i] for i in b) for b in bins) <= best + max(costs)
    with pytest.raises(ValueError, match=r"counts \(\[1, 1\]\) must sum to the number of units \(3\)"):
        balanced_partition([1, 2, 3], [1, 1])


def test_filler_micro_batches_train_nothing_and_are_skipped_in_results():
    batch = rl_cases._ragged_batch(3, 4)
    mbs = packed_micro_batches(batch, 64, [[0, 1], [2, 3], []])
    assert mbs[2]["filler"] and not mbs[2]["mask"].any() and "filler" not in mbs[0]
    values = [torch.full((len(mb["rows"]),), float(i)) for i, mb in enumerate(mbs)]
    assert in_batch_order(values, mbs, 4).tolist() == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize("balance", [False, True], ids=["unbalanced", "balanced"])
def test_packed_update_on_two_dp_ranks_equals_one_rank(balance):
    """Issue 44, step 4: with packing, data-parallel ranks run the same number of micro-batches (a rank with fewer
    packs splits them, or runs fillers), and ``balance_batch`` moves whole units of 2 so that the ranks' tokens
    even out; either way the step's gradient is that of the whole batch on one rank (the token-mean objective)."""
    capacity = 24
    whole = run_distributed(rl_cases.packed_dp_gradient_case, 1, capacity, False)[0]
    runs = run_distributed(rl_cases.packed_dp_gradient_case, 2, capacity, balance)
    counts = [len(r["tokens"]) for r in runs]
    assert counts[0] == counts[1]
    tokens = [sum(r["tokens"]) for r in runs]
    assert sum(tokens) == sum(whole["tokens"])
    if balance:
        report = runs[0]["report"]
        assert report == runs[1]["report"]
        assert max(report["before"]) > 1.5 * min(report["before"])  # the split longest first is lopsided
        # The greedy partition's bound: the ranks differ by at most the largest unit.
        largest = max(len(a) + len(b) for a, b in zip(whole["sequences"][::2], whole["sequences"][1::2]))
        assert max(report["after"]) - min(report["after"]) <= largest
        assert report["metrics"]["dp_balance/max_over_mean_after"] < report["metrics"][
            "dp_balance/max_over_mean_before"]
        # Every sequence arrives once, with its data, and units stay whole and in order: (2u, 2u + 1).
        origin = [o for r in runs for o in r["origin"]]
        assert sorted(origin) == list(range(8))
        for r in runs:
            assert all(b - a == 1 and a % 2 == 0 for a, b in zip(r["origin"][::2], r["origin"][1::2]))
            assert r["sequences"] == [whole["whole"][o] for o in r["origin"]]
            # The prompt + response tokens each rank trains are what the partition promised.
            assert sum(map(len, r["sequences"])) in report["after"]
    else:  # rank 0's 59 tokens take 4 packs of 24, rank 1's 33 take 2: it splits its packs to run 4 too
        assert [r["own_packs"] for r in runs] == [4, 2] and counts == [4, 4]
    for r in runs:
        for name, grad in whole["grads"].items():
            # fp32 sums of the same per-token terms in another order (packs, then the DP all-reduce): ~1e-7
            # relative of the gradient's scale.
            torch.testing.assert_close(r["grads"][name], grad, rtol=1e-5, atol=1e-6 * float(grad.abs().max()),
                                       msg=f"{name}, balance={balance}")


@pytest.mark.parametrize("tp, pp, sp", [(2, 1, True), (1, 2, False),
                                        pytest.param(2, 2, True, marks=pytest.mark.slow)],
                         ids=["tp2-sp", "pp2", "tp2-sp-pp2"])
def test_packed_passes_at_tensor_and_pipeline_parallelism(tp, pp, sp):
    """Issue 44, step 5: packs at TP 2 with sequence parallelism (padded to a multiple of 2) and across 2 pipeline
    stages (every pack padded to the budget: one send shape) give the padded passes' log-probs, entropies, values,
    scores and update gradients on the same layout."""
    capacity = 25
    runs = run_distributed(rl_cases.packed_layout_case, tp * pp, capacity, sp, tensor_model_parallel_size=tp,
                           pipeline_model_parallel_size=pp)
    for r in runs:
        packs = r["packed"]["packs"]
        assert len(packs) >= 3 and all(n % tp == 0 for n in packs)
        if pp > 1:
            assert set(packs) == {26 if tp == 2 else 25}  # the budget, rounded up to a multiple of TP
        if not r["last_stage"]:
            assert r["packed"]["logp"] is None
            continue
        mask = r["mask"]  # the padded passes compute the masked slots too, the packed ones leave them 0
        for key in ("logp", "entropy", "values"):
            # fp32; the same per-sequence attention in other shapes (a pack's rows, a chunk's log-softmax, the
            # tensor-parallel vocabulary's reductions): sums in another order, ~1e-7 relative.
            torch.testing.assert_close(r["packed"][key] * mask, r["padded"][key] * mask, rtol=1e-5, atol=1e-5,
                                       msg=key)
        torch.testing.assert_close(r["packed"]["scores"], r["padded"]["scores"], rtol=1e-5, atol=1e-5)
    for r in runs:
        for name, grad in r["padded"]["grads"].items():
            torch.testing.assert_close(r["packed"]["grads"][name], grad, rtol=1e-5,
                                       atol=1e-6 * float(grad.abs().max()), msg=name)
