"""Golden outputs, checked on any CPU: generation at three layouts (refills, stop tokens, mixed steps, slot
compaction; greedy and seeded top-p) and the PPO recipe's first step give the tokens, counters and bytes the
committed files record exactly, and their floats within a tolerance that covers a change of CPU kind
(tests/golden_cases.py says what is compared and why; tests/golden/make_golden.py writes the files, and compares two
commits bit for bit on one machine).
"""

from __future__ import annotations

import copy
import math

import pytest

from tests import golden_cases as golden


def _check(path: str, inputs: dict, outputs: dict, check) -> None:
    stored = golden.load(path)
    diff = golden.differences(stored["inputs"], inputs, "/inputs") + check(stored["outputs"], outputs)
    assert not diff, (f"{path} differs from this run (first differences below); written with "
                      f"{stored.get('environment')}, this run {golden.environment()}:\n  " + "\n  ".join(diff))


@pytest.mark.slow
def test_generation_matches_golden():
    outputs = golden.compute_generation()
    # The cases still exercise what they were chosen for (else a golden of the wrong thing would pass).
    assert not golden.exercised(outputs), golden.exercised(outputs)
    _check(golden.GENERATION_FILE, golden.generation_inputs(), outputs, golden.check_generation)


def test_recipe_matches_golden():  # the fast tier's recipe step
    _check(golden.RECIPE_FILE, golden.recipe_inputs(), golden.compute_recipe(1), golden.check_recipe)


# ---- the check itself, on the committed files (no run) ----------------------------------------------------------
def _generation() -> dict:
    return golden.load(golden.GENERATION_FILE)["outputs"]


def _recipe() -> dict:
    return golden.load(golden.RECIPE_FILE)["outputs"]


def _relative(value: float, by: float) -> float:
    return value * (1 + by)


def test_committed_goldens_pass_their_own_check_and_record_wide_margins():
    generation, recipe = _generation(), _recipe()
    assert golden.check_generation(generation, copy.deepcopy(generation)) == []
    assert golden.check_recipe(recipe, copy.deepcopy(recipe)) == []
    margins = [m for case in generation.values() for m in case["margins"].values()] + [recipe["margin"]]
    assert len(margins) == 7 and min(margins) >= golden.DECISION_MARGIN, margins


@pytest.mark.parametrize("where", ["t2p1d1-tg1pg1-aliased", "t2p2d1-tg1pg2-canonical", "t1p1d2-tg2pg1-aliased"])
def test_generation_check_fails_on_one_log_prob_or_token(where):
    generation = _generation()
    stored = generation[where]["results"]["dp0"]
    # A log-prob 1e-4 relative off fails; rounding-level drift (2e-7 relative, the CPU kinds' spread) passes.
    for by, fails in ((1e-4, True), (-1e-4, True), (2e-7, False)):
        run = copy.deepcopy(generation)
        lp = run[where]["results"]["dp0"]["top_p"]["log_probs"]
        lp[1][2] = _relative(lp[1][2], by)
        assert bool(golden.check_generation(generation, run)) == fails, (by, lp[1][2])
    run = copy.deepcopy(generation)
    tokens = run[where]["results"]["dp0"]["greedy"]["tokens"][0]
    tokens[3] = (tokens[3] + 1) % golden.VOCAB
    diff = golden.check_generation(generation, run)
    assert len(diff) == 1 and "/greedy/tokens[0][3]" in diff[0], diff
    run = copy.deepcopy(generation)
    run[where]["counters"]["greedy"][0]["slot_moves"] += 1
    assert golden.check_generation(generation, run)
    assert stored == generation[where]["results"]["dp0"]  # the stored golden itself untouched


@pytest.mark.parametrize("metric, index", [("actor_grad_norm", 0), ("critic_grad_norm", 0), ("vf_loss", 0),
                                           ("entropy", None), ("train_entropy", 0)])
def test_recipe_check_fails_on_a_float_1e4_relative_off(metric, index):
    recipe = _recipe()
    for by, fails in ((1e-4, True), (-1e-4, True), (2e-7, False)):
        run = copy.deepcopy(recipe)
        step = run["steps"][0]
        if index is None:
            step[metric] = _relative(step[metric], by)
        else:
            step[metric][index] = _relative(step[metric][index], by)
        assert bool(golden.check_recipe(recipe, run)) == fails, (metric, by)


def test_recipe_check_compares_counts_exactly_and_leaves_the_second_epoch():
    recipe = _recipe()
    run = copy.deepcopy(recipe)
    run["steps"][0]["reward_mean"] += 1 / 256  # one more rewarded sequence
    assert golden.check_recipe(recipe, run)
    run = copy.deepcopy(recipe)
    run["steps"][0]["switch_bytes"] += 1.0
    assert golden.check_recipe(recipe, run)
    # The second epoch follows an optimizer step: not compared across machines (tests/golden_cases.first_step).
    run = copy.deepcopy(recipe)
    run["steps"][0]["clipfrac"][1] += 0.25
    assert golden.check_recipe(recipe, run) == []
    # A cancellation-level loss (normalised advantages around 0) moves within ATOL.
    run = copy.deepcopy(recipe)
    run["steps"][0]["pg_loss"][0] += 2e-7
    assert golden.check_recipe(recipe, run) == []


def test_a_near_tie_golden_is_refused():
    generation, recipe = _generation(), _recipe()
    generation["t2p1d1-tg1pg1-aliased"]["margins"]["greedy"] = golden.DECISION_MARGIN / 2
    recipe["margin"] = golden.DECISION_MARGIN / 2
    assert any("near tie" in line for line in golden.check_generation(generation, copy.deepcopy(generation)))
    assert golden.check_recipe(recipe, copy.deepcopy(recipe))


def test_decision_margins_match_their_definition():
    import torch
    from megatron.core.inference.sampling_params import SamplingParams

    logits = torch.tensor([[0.0, 2.0, 1.5, -1.0, 9.0]])  # the last column is padding: never a candidate
    greedy = golden.decision_margins(logits, SamplingParams(top_k=1), vocab_size=4, noise_nV=None)
    assert greedy.tolist() == [0.5]
    noise = torch.tensor([[1.0, 2.0, 0.5, 1.0]])
    probs = torch.tensor([0.0, 2.0, 1.5, -1.0]).softmax(-1)
    scores = sorted((probs / noise[0]).tolist(), reverse=True)
    sampled = golden.decision_margins(logits, SamplingParams(temperature=1.0), vocab_size=4, noise_nV=noise)
    assert math.isclose(sampled.item(), (scores[0] - scores[1]) / scores[0], rel_tol=1e-6)


@pytest.mark.parametrize("expected, actual, line", [
    ({"a": [1.0, -0.0]}, {"a": [1.0, 0.0]}, "/a[1]: 0.0 (0x0.0p+0), expected -0.0 (-0x0.0p+0)"),
    ({"a": 1.0}, {"a": 1.0000000000000002}, "/a: 1.0000000000000002 (0x1.0000000000001p+0), expected 1.0"),
    ({"a": [1, 2]}, {"a": [1, 2, 3]}, "/a: length 3, expected 2"),
    ({"a": 1, "b": 2}, {"a": 1, "c": 2}, "/b: missing (expected 2)"),
    ({"a": 1}, {"a": 1.0}, "/a: 1.0 (0x1.0000000000000p+0), expected 1"),
])
def test_differences_are_exact(expected, actual, line):
    diff = golden.differences(expected, actual)
    assert diff and diff[0].startswith(line), diff
    assert golden.differences(expected, expected) == []
    assert golden.differences({"x": float("nan")}, {"x": float("nan")}) == []
