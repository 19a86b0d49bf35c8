"""MoE models on exchange layouts: the routed experts get an exchange plan of their own on the rollout expert grid.

Each pair below was refused before (``p_g ∤ p``, ``t_g ∤ t``, virtual chunks with ``p_g ≠ p``, a rollout expert
shard that does not nest in training ones). :func:`megatron_hybrid.testing.layout_check.check_many` runs each
against the unsharded model built from the same seeded state: rollout weights (routed experts included) bit for
bit, FP8 ones against an independent quantization, logits within tolerance, bytes received = needed − held counted
element by element (the routed experts by expert TP and expert index), a repeated switch calling no collective,
before and after an optimizer step.
"""

from __future__ import annotations

from megatron_hybrid.testing import layout_check
from megatron_hybrid.testing.layout_space import LayoutExample

PAIRS = {
    # TP up and PP down, (2, 2) → (4, 1) on 8 ranks; the rollout expert TP (2) does not divide the training's (1).
    "tp_up_pp_down": LayoutExample(world=8, t=2, p=2, t_g=4, p_g=1, num_layers=4, num_experts=4, topk=2,
                                   shared_expert=True, moe_layers=(1, 1, 0, 1), e=2, et=1, e_g=2, et_g=2,
                                   mode="canonical"),
    # PP up, (1, 1) → (1, 2); expert TP 2 → 1, with megatron-core's Adam and the distributed optimizer.
    "pp_up": LayoutExample(world=4, t=1, p=1, t_g=1, p_g=2, num_layers=2, num_experts=4, topk=2, moe_layers=(1, 1),
                           e=2, et=2, e_g=2, et_g=1, normalization="LayerNorm", qkv_bias=True, mode="canonical",
                           optimizer="adam"),
    # Virtual pipeline chunks with p_g ≠ p, (1, 2 × 2 chunks) → (1, 1); EP up 2 → 4; FP8 rollout weights.
    "virtual_chunks": LayoutExample(world=4, t=1, p=2, vpp=2, t_g=1, p_g=1, num_layers=4, num_experts=4, topk=1,
                                    moe_layers=(1, 0, 1, 1), e=2, et=1, e_g=4, et_g=1, tied=True, mode="fp8"),
    # TP and PP in opposite directions, (2, 1) → (1, 2), tied embeddings, GQA.
    "tp_down_pp_up": LayoutExample(world=4, t=2, p=1, t_g=1, p_g=2, num_layers=2, num_experts=2, topk=1,
                                   moe_layers=(0, 1), e=1, et=2, e_g=2, et_g=1, num_query_groups=2, tied=True,
                                   qkv_bias=True, mode="canonical"),
}


def test_moe_exchange_pairs_are_exact():
    names = list(PAIRS)
    results = layout_check.check_many([PAIRS[n] for n in names])
    failed = {n: r for n, r in zip(names, results) if r}
    assert not failed, failed


def test_every_pair_is_an_exchange_layout():
    """Each pair is one the micro-EP gathers cannot serve (what the engine refused before)."""
    assert all(ex.exchange for ex in PAIRS.values())
    # The refusals that remain (a rollout expert grid that cannot split a stage): tests/test_moe_engine.py.
