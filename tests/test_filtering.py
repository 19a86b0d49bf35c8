"""Dynamic sampling (issue 47, step 6; megatron_hybrid/rl/filtering.py): the rounds against hand-made rewards, the
flags, and the recipe with --filter-groups on 4 gloo ranks (training TP 2 × DP 2, rollout TP 1)."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_hybrid import rl
from megatron_hybrid.inference import GenerationResult
from megatron_hybrid.rl.arguments import add_hybrid_args, add_megatron_args, validate_args
from megatron_hybrid.rl.filtering import filter_groups, zero_variance_groups
from tests import ppo_cases
from tests.harness import run_distributed


def rounds_case(rewards_by_prompt: dict, quota: int, max_rounds: int) -> dict:
    """:func:`filter_groups` over prompts 0, 1, 2, ... (groups of 2) whose samples' rewards are
    ``rewards_by_prompt[prompt]`` (default (0, 1)); what it kept, its counts and each round's prompts."""
    admitted = iter(range(1000))
    rounds = []

    def generate(prompts, round_):
        rounds.append(sorted({p[0] for p in prompts}))
        return [GenerationResult(list(p), [p[0], 9], [-0.1, -0.2], [-0.3, -0.4]) for p in prompts]

    def score(examples, prompts, responses):
        out = []
        for i, p in enumerate(prompts):
            out.append(rewards_by_prompt.get(p[0], (0.0, 1.0))[i % 2])
        return torch.tensor(out)

    out = filter_groups(lambda: rl.Example([next(admitted)]), generate, score, quota=quota, group_size=2,
                        max_rounds=max_rounds)
    return {"prompts": [e.tokens[0] for e in out.examples], "scores": out.scores, "counts": out.counts,
            "rounds": rounds, "log_probs": out.log_probs}


def test_uniform_groups_are_dropped_and_refilled():
    # Prompts 0 and 2 give uniform groups: round 1 keeps 1 and 3 of 0-3; the shortfall of 2 over the kept share 1/2
    # asks 4 more (4-7), of which 4 and 5 fill the quota and 6, 7 are surplus.
    out = run_distributed(rounds_case, 1, {0: (1.0, 1.0), 2: (0.0, 0.0)}, 4, 4)[0]
    assert out["rounds"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert out["prompts"] == [1, 1, 3, 3, 4, 4, 5, 5] and out["scores"] == [0.0, 1.0] * 4
    assert out["log_probs"][0] == [-0.3, -0.4]  # the rollout's, at the sampling temperature
    assert out["counts"] == dict(rounds=2, generated=8, dropped=2, uniform_trained=0, surplus=2, tokens=32)


def test_after_the_last_round_dropped_groups_fill_the_quota():
    out = run_distributed(rounds_case, 1, {i: (0.5, 0.5) for i in range(100)}, 3, 2)[0]
    # Nothing has spread: round 2 asks 4 × 3 prompts (the cap), then the quota is filled with uniform groups.
    assert out["rounds"] == [[0, 1, 2], list(range(3, 15))]
    assert out["prompts"] == [0, 0, 1, 1, 2, 2] and out["counts"]["uniform_trained"] == 3


def test_zero_variance_groups_are_counted():
    assert zero_variance_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), 2) == 2


def _validate(*argv: str) -> argparse.Namespace:
    args = add_hybrid_args(add_megatron_args(argparse.ArgumentParser())).parse_args(argv)
    validate_args(args, 4)
    return args


@pytest.mark.parametrize("argv, message", [
    (["--filter-groups"], "--filter-groups does not work with --algorithm ppo (it filters GRPO groups"),
    (["--max-filter-rounds", "2"], "--max-filter-rounds needs --filter-groups"),
    (["--filter-groups", "--algorithm", "grpo", "--num-samples-per-prompt", "2", "--max-filter-rounds", "0"],
     "--max-filter-rounds (0) must be ≥ 1"),
    (["--filter-groups", "--algorithm", "grpo", "--num-samples-per-prompt", "2", "--partial-rollout"],
     "--filter-groups does not work with --partial-rollout"),
])
def test_filter_flags_are_checked(argv, message):
    with pytest.raises(ValueError) as e:
        _validate(*argv)
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.slow
def test_filtered_steps_train_no_uniform_group(tmp_path):
    """With --filter-groups no trained batch holds a group of equal rewards (the count is taken from the rewards the
    step trains on), where the same run without it does; uniform groups were dropped and refilled."""
    common = ["--train-iters", "6", "--algorithm", "grpo", "--num-samples-per-prompt", "4", "--reward-fn",
              "tests.env_fixtures:target_anywhere"]
    plain, filtered = (run_distributed(ppo_cases.run_main, 4, common + extra, str(tmp_path / name),
                                       tensor_model_parallel_size=2)[0]
                       for name, extra in (("plain", []), ("filtered", ["--filter-groups"])))
    assert sum(m["grpo/zero_variance_groups"] for m in plain) > 0
    assert all(m["grpo/zero_variance_groups"] == 0 and m["filter/uniform_trained_groups"] == 0 for m in filtered)
    assert sum(m["filter/dropped_groups"] for m in filtered) > 0 and max(m["filter/rounds"] for m in filtered) > 1
    for m in filtered:  # 32 sequences of groups of 4: 8 groups trained a step
        assert m["filter/generated_groups"] - m["filter/dropped_groups"] - m["filter/surplus_groups"] == 8
