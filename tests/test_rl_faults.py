"""Faults of an RL run (issue 15, Build 7): a reward function that raises, miscounts or returns NaN, and a loss or
gradient norm that is not finite, stop the run on every rank with a message naming the step, before anything of
that step is saved; damaged checkpoints are the same ``ValueError`` naming the file on every rank; a save that
fails on one rank leaves ``latest`` and the iteration it names loadable."""

from __future__ import annotations

import pytest

from tests import fault_cases
from tests.harness import run_distributed

# Short runs of the recipe's default (4 ranks, training TP=2 × DP=2).
SHORT = ["--train-iters", "2", "--global-batch-size", "16", "--micro-batch-size", "4"]


def _errors(argv: list[str]) -> list[str]:
    return run_distributed(fault_cases.recipe_error_case, 4, argv, tensor_model_parallel_size=2)


@pytest.mark.slow
def test_non_finite_reward_stops_before_the_save_and_a_damaged_checkpoint_names_its_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    errors = _errors(SHORT + ["--reward-fn", "tests.fault_cases:nan_on_second_call", "--save", str(ckpt),
                              "--save-interval", "1"])
    for e in errors:  # every rank, the same message
        assert e == errors[0]
        assert e.startswith("StepFailure: step 2: the rewards of --reward-fn tests.fault_cases:nan_on_second_call "
                            "are not finite"), e
        assert "ranks 0, 1, 2, 3" in e and "before anything of this step is saved" in e
    # Step 1 was saved; step 2 never was.
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1\n"
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    # Resuming from it with a shard file (rank 1's; DP replica 0 writes them all) truncated: the file's name on
    # every rank, before training.
    bad = ckpt / "iter_0000001" / "__1_0.distcp"
    bad.write_bytes(bad.read_bytes()[:1000])
    errors = _errors(SHORT + ["--load", str(ckpt)])
    for e in errors:
        assert e.startswith(f"ValueError: --load: {bad} cannot be read, it is truncated, empty or not a checkpoint"), e
        assert e.endswith("(ranks 0, 1, 2, 3)")


# The smallest recipe run: 2 ranks, training TP=2, one micro-batch of 4 a step.
TINY = ["--train-iters", "2", "--global-batch-size", "4", "--micro-batch-size", "4"]


@pytest.mark.parametrize("flag, value, step, quantity", [
    # Adam's first update moves every weight by ~--lr: the second epoch's gradients are not finite.
    ("--lr", "1e30", 1, "the actor's gradient norm is not finite (nan)"),
    # Step 1's KL is 0 (the actor is the reference); step 2's penalty overflows the advantages' whitening.
    ("--kl-coef", "1e38", 2, "the advantages are not finite"),
    # A subnormal temperature: the tempered logits overflow.
    ("--temperature", "1e-39", 1, "the actor's log-probs are not finite"),
], ids=["lr", "kl-coef", "temperature"])
@pytest.mark.slow
def test_non_finite_step_names_the_quantity_and_the_flags_that_scale_it(flag, value, step, quantity, tmp_path):
    """Issue 22: values that pass the checks and end in a non-finite step. The failure names the step, the
    quantity and the flags that scale it, on every rank; nothing of the step is saved."""
    ckpt = tmp_path / "ckpt"
    errors = run_distributed(fault_cases.recipe_error_case, 2, TINY + [flag, value, "--save", str(ckpt),
                                                                       "--save-interval", "1"],
                             tensor_model_parallel_size=2)
    for e in errors:
        assert e == errors[0]
        assert e.startswith(f"StepFailure: step {step}: {quantity}"), e
        assert f"scaled by {flag} ({float(value):g})" in e.split(" (rank")[0], e  # the first quantity's flags
    if step == 1:
        assert not ckpt.exists()
    else:
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1\n"


@pytest.mark.slow
def test_load_at_or_past_train_iters_says_why_no_step_ran(tmp_path):
    """Issue 22: ``--load`` of a checkpoint at iteration 1 with ``--train-iters 1`` printed "no steps run" and no
    reason."""
    ckpt = tmp_path / "ckpt"
    run_distributed(fault_cases.recipe_output_case, 2, TINY[2:] + ["--train-iters", "1", "--save", str(ckpt)],
                    tensor_model_parallel_size=2)
    out = run_distributed(fault_cases.recipe_output_case, 2, TINY[2:] + ["--train-iters", "1", "--load", str(ckpt)],
                          tensor_model_parallel_size=2)
    assert out[0].splitlines()[-1] == (f"no steps run: the iteration loaded from --load {ckpt}, 1, is already at or "
                                       "past --train-iters 1"), out[0]
    assert out[1] == ""  # rank 0 reports


@pytest.mark.parametrize("fn, message", [
    ("raises_on_rank_1", "step 1: --reward-fn tests.fault_cases:raises_on_rank_1 raised ZeroDivisionError: "
                         "no reward for you (rank 1); the run stops"),
    ("miscounts_on_rank_2", "step 1: --reward-fn tests.fault_cases:miscounts_on_rank_2 returned 7 values for 8 "
                            "responses (rank 2); the run stops"),
], ids=["raises", "miscounts"])
@pytest.mark.slow
def test_failing_reward_function_stops_every_rank(fn, message, tmp_path):
    errors = _errors(SHORT + ["--reward-fn", f"tests.fault_cases:{fn}", "--save", str(tmp_path / "ckpt"),
                              "--save-interval", "1"])
    assert all(message in e for e in errors), errors
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("kind, message", [
    ("loss", "StepFailure: step 7: the actor's gradient norm is not finite (nan) (ranks 0, 1); the actor's "
             "micro-batch losses are not finite (2 of 2 values; the first, nan, at 0) (rank 1); the run stops"),
    ("grad_norm", "StepFailure: step 7: the actor's gradient norm is not finite (nan) (ranks 0, 1); the run stops"),
])
def test_non_finite_loss_or_gradient_norm_stops_every_rank(kind, message):
    # 2 pipeline stages: the loss exists on the last one only, yet the first stops too.
    for e in run_distributed(fault_cases.update_fault_case, 2, kind, pipeline_model_parallel_size=2):
        assert e.startswith(message), e


def test_checkpoint_faults(tmp_path):
    ckpt = tmp_path / "ckpt"
    for rank, r in enumerate(run_distributed(fault_cases.checkpoint_faults_case, 2, str(ckpt),
                                             tensor_model_parallel_size=2)):
        assert r["after_two"] == [2, 2.0]
        # Rank 1 failed part-way through its shard file (as a killed rank would leave it): every rank raised,
        # naming the iteration and the failure; `latest` and the iteration it names are untouched, the partial
        # iteration is gone.
        for key, step in (("failed_new", 3), ("failed_resave", 2)):
            assert r[key].startswith(f"OSError: --save: iteration {step} was not saved ({ckpt}/.iter_{step:07d}.tmp: "
                                     f"dist_checkpointing: rank 1 failed with RuntimeError: Worker failure: "
                                     f"[Errno 28] No space left on device (rank 0)); "), r[key]
            assert r[key].endswith(f"{ckpt / 'latest_checkpointed_iteration.txt'} still names the previous "
                                   f"iteration"), r[key]
        assert r["failed_new_latest"] == "2\n" and r["failed_new_loads"] == [2, 2.0]
        assert r["failed_resave_loads"] == [2, 2.0]
        assert r["resaved_loads"] == [2, 22.0] and r["leftovers"] == []
        assert r["between_renames_loads"] == [2, 22.0]
        # Every rank checks every file before any collective: the same message, naming the file, on every rank.
        bad = ckpt / "iter_0000002" / "__1_0.distcp"
        for key in ("truncated", "empty"):
            assert r[key].startswith(f"ValueError: --load: {bad} cannot be read, it is truncated, empty or not a "
                                     f"checkpoint ("), r[key]
            assert r[key].endswith("(ranks 0, 1)")
        assert r["no_manifest"].startswith(f"ValueError: --load: {ckpt / 'iter_0000002' / 'rl_checkpoint.json'} "
                                           f"cannot be read (FileNotFoundError"), r["no_manifest"]
        assert r["bad_latest"] == (f"ValueError: --load: {ckpt / 'latest_checkpointed_iteration.txt'} must hold an "
                                   f"iteration number (a non-negative integer, written by save_checkpoint), it "
                                   f"holds 'two\\n' (ranks 0, 1)")
