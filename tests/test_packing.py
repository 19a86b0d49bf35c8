"""Packed micro-batches (issue 44, step 3): first-fit decreasing into a token budget, the packed layout, and the
log-prob, entropy, value and reward-score passes over packed sequences equal to the padded passes (and to
megatron-core's own attention on the padded layout), with RoPE restarting at every sequence."""

from __future__ import annotations

import pytest
import torch

from megatron_hybrid.rl.packing import first_fit_decreasing, packed_micro_batches
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
