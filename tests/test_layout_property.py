"""Exact over the whole layout space: a property test of layout pairs × architectures × weight modes × optimizers.

``hypothesis`` draws the examples (:func:`megatron_hybrid.testing.layout_space.examples`: world 2–8, training
t, p, d and virtual chunks, any rollout t_g × p_g that divides the world, SwiGLU or GELU, RMSNorm or LayerNorm,
QKV and linear biases, MHA / GQA / MQA, tied or untied, vocabularies that are not a multiple of 128, 2–8 layers,
experts with their count, top-k, shared expert, mixed dense / MoE layers and e / et → e_g / et_g; aliased,
canonical or FP8 weights; SGD or megatron-core's Adam with the distributed optimizer), seeded: the same examples
every run. :func:`megatron_hybrid.testing.layout_check.check_many` runs each against the unsharded model (rollout
weights bit for bit, FP8 against an independent quantization, logits, bytes received = needed − held counted
element by element, a repeated switch calling no collective, before and after an optimizer step). A failure
prints each failing example as one line that ``check(LayoutExample(**{...}))`` reruns.

The fixed budget here (``NUM_EXAMPLES``) keeps the test within ~4 minutes on 2 cores; ``bench/layout_sweep.py``
runs thousands and shrinks what fails.
"""

from __future__ import annotations

import pytest

from megatron_hybrid.testing import layout_check
from megatron_hybrid.testing.layout_space import LayoutExample, draw, examples, shrink, simpler

pytest.importorskip("hypothesis")

NUM_EXAMPLES, SEED = 32, 34

# Faults the sweep found, kept as named examples.
FOUND = [
    # Megatron DDP + distributed optimizer with experts: the dense and expert parameter buffers share the engine's
    # storage, and the optimizer given both at creation and at close() had every view moved twice (a negative
    # storage offset at close).
    LayoutExample(world=4, t=2, p=1, t_g=1, p_g=1, num_experts=4, topk=2, moe_layers=(1, 0), e=2, et=1, e_g=1,
                  et_g=1, optimizer="adam"),
    # The same at close() where a DDP buffer fills the engine's storage exactly (5 data-parallel ranks): the move
    # out of it took the engine's own views for someone else's and refused.
    LayoutExample(world=5, t=1, p=1, t_g=1, p_g=1, num_layers=3, normalization="LayerNorm", num_query_groups=4,
                  tied=True, vocab_size=88, mode="fp8", optimizer="adam"),
]


def _report(batch: list[LayoutExample], results: list[list[str]]) -> str:
    lines = []
    for ex, failures in zip(batch, results):
        if failures:
            lines.append(f"{ex}\n    " + "\n    ".join(failures[:6]))
    return "\n".join(lines)


def test_layout_space_property():
    batch = draw(NUM_EXAMPLES, seed=SEED)
    assert len(batch) == NUM_EXAMPLES
    results = layout_check.check_many(batch)
    assert not any(results), "failing examples (rerun one with layout_check.check(...)):\n" + _report(batch, results)


@pytest.mark.parametrize("ex", FOUND, ids=str)
def test_found_faults(ex):
    assert layout_check.check(ex) == []


def test_examples_are_reproducible_and_buildable():
    """The same seed draws the same examples; every example's sizes are a layout Megatron builds (t | heads,
    t_g · p_g | world, both layouts split the layers, the expert grid covers each stage) and its repro line rebuilds
    it."""
    first, again = draw(200, seed=SEED), draw(200, seed=SEED)
    assert first == again
    for ex in first:
        assert ex.world % (ex.t * ex.p) == 0 and ex.world % (ex.t_g * ex.p_g) == 0, ex
        assert 8 % ex.t == 0 and 8 % ex.t_g == 0 and ex.num_query_groups % max(ex.t, ex.t_g) == 0, ex
        assert ex.num_layers % (ex.p * (ex.vpp or 1)) == 0 and ex.num_layers % ex.p_g == 0, ex
        assert ex.vocab_size % 128, ex
        if ex.num_experts is not None:
            assert (ex.world // ex.p) % (ex.e * ex.et) == 0 and ex.num_experts % ex.e == 0, ex
            assert (ex.world // ex.p_g) % (ex.e_g * ex.et_g) == 0 and ex.num_experts % ex.e_g == 0, ex
            assert len(ex.moe_layers) == ex.num_layers and any(ex.moe_layers), ex
        assert eval(str(ex), {"LayoutExample": LayoutExample}) == ex


def test_shrink_finds_the_simplest_failing_example():
    """Against a known fault (FP8 weights with a rollout TP above one): the shrunk example keeps exactly what
    the fault needs and drops every other option."""
    ex = LayoutExample(world=8, t=2, p=2, t_g=4, p_g=2, vpp=2, num_layers=4, swiglu=True, normalization="LayerNorm",
                       qkv_bias=True, linear_bias=True, num_query_groups=4, tied=True, vocab_size=201, mode="fp8",
                       optimizer="adam")
    shrunk = shrink(ex, lambda e: e.mode == "fp8" and e.t_g > 1)
    assert shrunk == LayoutExample(world=8, t=2, p=2, t_g=4, p_g=2, swiglu=False, mode="fp8")
    assert all(s != ex for s in simpler(ex))
