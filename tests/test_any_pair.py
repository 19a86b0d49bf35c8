"""Any layout pair through the HybridEngine at world size 8, on CPU/gloo: Megatron-LM's ten ``test_model_swap``
dense pairs with its model, and the pairs outside the micro-DP gather contract (more rollout stages than training
ones, TP up with PP down and the reverse, virtual pipeline chunks, rollout TP above training TP with process groups
in global rank order).

Against independent references: the unsharded model's tensors (rollout weights bit for bit), its logits, its
full-recompute greedy decoding, and the bytes each rank misses counted element by element
(:func:`tests.pair_cases.missing_by_ids`).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests import pair_cases as cases
from tests.harness import run_distributed

# Megatron-LM's tests/unit_tests/resharding/test_model_swap.py: (TP, PP) -> (TP, PP) at world size 8.
MEGATRON_PAIRS = [((2, 1), (1, 1)), ((1, 1), (2, 1)), ((2, 1), (4, 1)), ((1, 2), (1, 1)), ((1, 1), (1, 2)),
                  ((2, 2), (1, 1)), ((1, 1), (2, 2)), ((2, 1), (1, 2)), ((1, 2), (2, 1)), ((1, 2), (2, 4))]
# (TP, PP, virtual chunks) -> (TP, PP), with the model changes they need: 8 query groups for TP 8, 8 layers for
# 4 stages of 2 chunks.
MORE_PAIRS = [((4, 2, None), (2, 4), {}), ((1, 4, 2), (2, 1), {"num_layers": 8}), ((2, 2, 2), (1, 1), {}),
              ((8, 1, None), (2, 2), {"num_query_groups": 8})]
WORLD = 8


def _layers(p: int, p_g: int, vpp=None) -> int:
    """The Megatron test's depth: 2 layers, 4 where either layout has a pipeline."""
    return 2 if p == p_g == 1 and vpp is None else 4


@functools.lru_cache(maxsize=None)
def _reference(arch_items: tuple):
    return run_distributed(cases.reference, 1, dict(arch_items), [1, 2, 4, 8])[0]


def _check(runs: list, ref: dict, *, expect_exchange=None):
    for rank, r in enumerate(runs):
        for mode, m in r["modes"].items():
            if expect_exchange is not None:
                assert m["exchange"] == expect_exchange, (rank, mode)
            for phase in ("state", "stepped"):
                obs = m[phase]
                # Resharding is exact: the rollout weights are the training weights, bit for bit.
                assert obs["weights"].keys() == ref[phase].keys()
                for name, w in ref[phase].items():
                    assert torch.equal(obs["weights"][name], w), (rank, mode, phase, name)
                # Exactly the bytes the rank misses: none it holds, none twice.
                assert obs["bytes"] == m["expected_bytes"], (rank, mode, phase, obs["bytes"], m["expected_bytes"])
                if obs["logits"] is not None:
                    # The Megatron test's tolerance; fp32 sums over a TP split in another order differ by ~1e-7.
                    torch.testing.assert_close(obs["logits"], ref[f"{phase}_logits"], atol=1e-4, rtol=1e-4)
                if "generated" in obs:
                    for prompt, tokens in obs["generated"].items():
                        assert tokens == ref[f"{phase}_greedy"][prompt], (rank, mode, phase, prompt)
        aliased = r["modes"].get("aliased")
        if aliased is not None and aliased["exchange"]:
            for phase in ("state", "stepped"):
                obs = aliased[phase]
                # Aliased: no second copy of an owned byte. Every rollout weight views a training tensor or the
                # engine's ranges, and what of those is backed while rolling out (pagemap) is the received pieces
                # and the rebuilt 1-D sharded tensors (biases, as in every layout), plus the generator's own rollout
                # memory (its KV cache, once it exists), each range to a page; nothing after the switch back.
                assert obs["memory"]["outside"] == [], (rank, obs["memory"]["outside"][:3])
                extra = obs["canonical_bytes_mapped"] + obs["rollout_memory_bytes_mapped"]
                assert obs["memory"]["resident"] <= obs["bytes"] + extra + 8 * 4096, \
                    (rank, phase, obs["memory"], obs["bytes"], extra)
                assert obs["peer_bytes_mapped"] <= obs["bytes"] + 4096, (rank, phase)
                assert obs["resident_after"] == 0, (rank, phase)


@pytest.mark.parametrize("train,rollout", MEGATRON_PAIRS, ids=lambda x: ",".join(map(str, x)))
@pytest.mark.slow
def test_megatron_swap_pairs(train, rollout):
    (t, p), (t_g, p_g) = train, rollout
    arch_kw = {"num_layers": _layers(p, p_g)}
    ref = _reference(tuple(sorted(arch_kw.items())))
    runs = run_distributed(cases.pair_case, WORLD, arch_kw, t_g, p_g, ref, tensor_model_parallel_size=t,
                           pipeline_model_parallel_size=p)
    _check(runs, ref)


@pytest.mark.parametrize("train,rollout,arch_kw", MORE_PAIRS, ids=lambda x: ",".join(map(str, x))
                         if isinstance(x, tuple) else "")
@pytest.mark.slow
def test_more_pairs(train, rollout, arch_kw):
    (t, p, vpp), (t_g, p_g) = train, rollout
    arch_kw = {"num_layers": _layers(p, p_g, vpp), **arch_kw}
    ref = _reference(tuple(sorted(arch_kw.items())))
    runs = run_distributed(cases.pair_case, WORLD, arch_kw, t_g, p_g, ref, vpp=vpp, tensor_model_parallel_size=t,
                           pipeline_model_parallel_size=p, virtual_pipeline_model_parallel_size=vpp)
    _check(runs, ref, expect_exchange=True)


@pytest.mark.slow
def test_tp_up_pp_down_canonical_swiglu_biases():
    """The pair that issue 34 found wrong: TP 2 × PP 2 → TP 4 × PP 1 in canonical mode, with SwiGLU, LayerNorm,
    QKV and linear biases, 4 query groups and untied embeddings. A rank misses the other stage's fc1 (bias) whole;
    its gate and up parts arrive from one sender back to back and become one view of the receive buffer, which
    canonical mode released as transient after the switch (zeros on CPU) because only single-piece views were
    kept."""
    arch_kw = {"num_layers": 4, "swiglu": True, "add_qkv_bias": True, "untie_embeddings_and_output_weights": True}
    ref = _reference(tuple(sorted(arch_kw.items())))
    runs = run_distributed(cases.pair_case, WORLD, arch_kw, 4, 1, ref, tensor_model_parallel_size=2,
                           pipeline_model_parallel_size=2)
    _check(runs, ref, expect_exchange=True)


@pytest.mark.parametrize("train,rollout", [((2, 1), (4, 1)), ((1, 1), (2, 1))], ids=["2,1-4,1", "1,1-2,1"])
@pytest.mark.slow
def test_wider_rollout_tp_with_sorted_groups(train, rollout):
    """``new_group`` forced to sort ranks (torch < 2.13): rollout TP above training TP still works; where the sorted
    groups cannot keep every rollout shard inside the own training shard, the missing bytes are planned and moved."""
    (t, p), (t_g, p_g) = train, rollout
    arch_kw = {"num_layers": 2}
    ref = _reference(tuple(sorted(arch_kw.items())))
    runs = run_distributed(cases.pair_case, WORLD, arch_kw, t_g, p_g, ref, sort_ranks=True,
                           tensor_model_parallel_size=t, pipeline_model_parallel_size=p)
    _check(runs, ref)
    moved = sum(r["modes"]["aliased"]["state"]["bytes"] for r in runs)
    if t > 1:  # t = 2: the groups in rank order pair training shards with other rollout shards
        assert moved > 0
    else:  # t = 1: every rank holds the whole model; nothing moves
        assert moved == 0
