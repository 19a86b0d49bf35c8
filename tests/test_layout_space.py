"""Exactness over the layout space (issue 48, step 4): a seeded Hypothesis search over world sizes 2-16, free
training and rollout layouts, architectures, weight modes and optimizer steps, each example run through the
engine's validation (a ValueError counts as refused, never as a failure) and, if accepted, through the simulated
world (megatron_hybrid.simulate): every rank's rollout tensors bit for bit, the bytes each receives exact.

Derandomized (the same examples on every run and machine) and printed on failure with its draws labelled, so a
failing example replays; ``bench/layout_sweep.py`` sweeps the same space for as long as one likes."""

from __future__ import annotations

import re

import pytest

hypothesis = pytest.importorskip("hypothesis")  # in the [test] extra; a bare checkout without it skips
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from megatron_hybrid.simulate import draw_example, run_example  # noqa: E402

#: Examples a CI run draws: up to 0.3 s each when accepted (16 ranks at most), 1 ms when refused; about 20 s in
#: all on 2 cores, inside the 2-minute budget.
EXAMPLES = 150


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_every_accepted_layout_pair_reshards_exactly(data):
    example = draw_example(lambda label, options: data.draw(st.sampled_from(list(options)), label=label))
    outcome = run_example(example)
    if outcome["status"] == "refused":
        event("refused: " + re.sub(r"\(\d+\)", "(n)", outcome["reason"]))  # one line per rule
        return
    event("exchange" if outcome["exchange"] else "in place")
    assert outcome["status"] == "ok", (example.describe(), outcome.get("faults"))


#: MoE examples a CI run draws (the same space with routed experts and expert layouts; more ranks per accepted
#: example move experts): about 15 s on 2 cores.
MOE_EXAMPLES = 60


@settings(max_examples=MOE_EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_every_accepted_moe_layout_pair_reshards_exactly(data):
    example = draw_example(lambda label, options: data.draw(st.sampled_from(list(options)), label=label), moe=True)
    outcome = run_example(example)
    if outcome["status"] == "refused":
        event("refused: " + re.sub(r"\(\d+\)", "(n)", outcome["reason"]))
        return
    e, et = example.expert_parallel
    _, p_g, e_g, et_g = example.rollout
    event(f"micro-EP {et // et_g} x {e // e_g} x {example.training[1] // p_g}")
    assert outcome["status"] == "ok", (example.describe(), outcome.get("faults"))


@settings(max_examples=40, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_every_accepted_layout_pair_with_fp8_rollout_weights_is_exact(data):
    """The same space with FP8 rollout weights (canonical mode): the rollout tensors, and every quantized weight
    against the format's quantization of the unsharded shard."""
    example = draw_example(lambda label, options: data.draw(st.sampled_from(list(options)), label=label), fp8=True)
    outcome = run_example(example)
    if outcome["status"] == "refused":
        event("refused: " + re.sub(r"\(\d+\)", "(n)", outcome["reason"]))
        return
    assert outcome["status"] == "ok", (example.describe(), outcome.get("faults"))


def test_the_moe_space_is_not_all_refused():
    import random

    rng = random.Random(0)
    accepted = [_accepted(draw_example(lambda label, options: rng.choice(list(options)), moe=True))
                for _ in range(60)]
    assert sum(accepted) >= 8, accepted


def test_the_space_is_not_all_refused():
    """The sweep must test something: of the same draws, a fair share passes the validation (not a test that
    cannot fail because every example is refused)."""
    import random

    rng = random.Random(0)
    accepted = [_accepted(draw_example(lambda label, options: rng.choice(list(options)))) for _ in range(40)]
    assert sum(accepted) >= 8, accepted


def _accepted(example) -> bool:
    """Whether the engine's validation accepts the example (the property tests simulate what it accepts)."""
    from megatron_hybrid.layout import RolloutLayout
    from megatron_hybrid.simulate import validate

    try:
        validate(example.arch, example.training, RolloutLayout(*example.rollout), weight_mode=example.weight_mode,
                 chunks=example.chunks, expert_parallel=example.expert_parallel)
    except ValueError:
        return False
    return True


def test_the_sweep_resumes_and_tallies(tmp_path, capsys):
    from bench import layout_sweep

    out = tmp_path / "sweep.jsonl"
    assert layout_sweep.main(["--examples", "6", "--seed", "3", "--output", str(out)]) == 0
    assert layout_sweep.main(["--examples", "9", "--seed", "3", "--output", str(out)]) == 0  # adds 6, 7, 8 only
    rows = layout_sweep.read(str(out))
    assert [r["index"] for r in rows] == list(range(9))
    assert rows[4]["example"] == layout_sweep.example_at(3, 4).describe()  # a line replays from (seed, index)
    assert "\n9 examples: " in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"--ranks replays one example"):
        layout_sweep.main(["--ranks"])


@pytest.mark.slow
@pytest.mark.parametrize("index", [11, 40, 122], ids=["in-place-TP2-to-TP1-canonical-step",
                                                       "exchange-PP2xDP2-to-TP2-tied-canonical-step",
                                                       "exchange-2-virtual-chunks-PP2-to-TP2-canonical-step"])
def test_the_simulation_agrees_with_the_engine_on_gloo_ranks(index):
    """The simulated world against the real one: seed 1's example on 2-4 gloo ranks (megatron-core models, a
    HybridEngine, a switch, an element-wise step, a second switch), the rollout model bit for bit and every rank's
    bytes as simulated."""
    from bench import layout_sweep

    example = layout_sweep.example_at(1, index)
    outcome = run_example(example)
    assert outcome["status"] == "ok" and example.steps == 1
    ranks = layout_sweep.on_ranks(example, outcome)
    assert ranks["agree"], ranks


@pytest.mark.slow
@pytest.mark.parametrize("index", [95, 86], ids=["moe-DP4-EP4-to-EP2-canonical", "moe-PP3-to-PP1-tied-biases-step"])
def test_the_moe_simulation_agrees_with_the_engine_on_gloo_ranks(index):
    """MoE examples of seed 1 on 3-4 gloo ranks: experts gathered over EP (micro-EP 2), and over three stages with
    tied embeddings, expert biases and mixed dense / MoE layers; every rank's rollout tensors bit for bit after
    both switches (the second after an element-wise step), every rank's bytes as simulated."""
    from bench import layout_sweep

    example = layout_sweep.example_at(1, index, moe=True)
    outcome = run_example(example)
    assert outcome["status"] == "ok"
    ranks = layout_sweep.on_ranks(example, outcome)
    assert ranks["agree"], ranks


def _moe_exchange_examples() -> dict:
    from megatron_hybrid.megatron.models import tiny_llama
    from megatron_hybrid.simulate import Example

    mixed = tiny_llama(num_layers=4, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                       moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True, moe_layer_freq=[1, 0, 1, 0])
    wide = tiny_llama(hidden_size=48, num_attention_heads=6, num_query_groups=6, ffn_hidden_size=96, num_experts=6,
                      moe_ffn_hidden_size=24, make_vocab_size_divisible_by=6)
    return {"pp-exchange-PP1-to-PP2-EP2-to-EP1": Example(mixed, (2, 1, 2), (2, 2, 1, 1), "canonical", 1, 1, (2, 1)),
            "tp-exchange-TP3-to-TP2-EP3-to-EP2": Example(wide, (3, 1, 2), (2, 1, 2, 1), "canonical", 1, 1, (3, 1)),
            "TP-down-PP-up-TP2PP2-to-PP4": Example(mixed, (2, 2, 1), (1, 4, 1, 1), "aliased", 1, 1, (2, 1)),
            "virtual-chunks-PP2-to-PP1-EP2": Example(mixed, (1, 2, 2), (1, 1, 2, 1), "aliased", 1, 2, (2, 1))}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp-exchange-PP1-to-PP2-EP2-to-EP1", "tp-exchange-TP3-to-TP2-EP3-to-EP2",
                                  "TP-down-PP-up-TP2PP2-to-PP4", "virtual-chunks-PP2-to-PP1-EP2"])
def test_moe_exchange_layouts_agree_with_the_simulation_on_gloo_ranks(name):
    """Issue 48's MoE acceptance: the three exchange kinds (p_g ∤ p, t_g ∤ t, virtual chunks; and TP and PP moving
    the other way round) with routed experts on real gloo ranks: every rank's rollout tensors bit for bit after
    both switches (the second after an element-wise step) and every rank's bytes the simulation's needed − held."""
    from bench import layout_sweep

    example = _moe_exchange_examples()[name]
    outcome = run_example(example)
    assert outcome["status"] == "ok" and outcome["exchange"], outcome
    assert max(outcome["bytes_received"]) > 0
    ranks = layout_sweep.on_ranks(example, outcome)
    assert ranks["agree"], ranks
