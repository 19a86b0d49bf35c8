"""A collective that fails inside a phase of an RL run names the phase, its step, the timeout and the ranks that did
not arrive, with the phase each of them is in (issue 22, item 3): gloo alone says "Timed out waiting 3000ms"."""

from __future__ import annotations

import pytest

from tests import phase_cases
from tests.harness import run_distributed


def test_message_names_the_phase_the_timeout_and_the_late_ranks():
    from megatron_hybrid.rl.phases import timeout_message

    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to "
                        "complete\nmore detail")
    records = {1: "5 in 'train step > generate' (step 3)", 2: "5 in 'train step > generate' (step 3)",
               3: "7 in 'train step > reward' (step 3)",  # arrived: not named
               4: "2 after 'setup'", 5: None, 6: "9 failed 'train step > reward' (step 3) with ValueError: bad",
               7: "5 in 'train step > generate' (step 3)", 8: "0 ready"}
    assert timeout_message(phase="'train step > reward' (step 3)", rank=0, events=7, records=records,
                           timeout="3 s (--distributed-timeout-minutes 0.05)", error=gloo) == (
        "phase 'train step > reward' (step 3) failed on rank 0 (RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:78]"
        " Timed out waiting 3000ms for recv operation to complete); the timeout is 3 s (--distributed-timeout-minutes "
        "0.05); did not arrive: ranks 1-2, 7 are in 'train step > generate' (step 3), rank 4 has left 'setup' and "
        "entered no phase since, rank 8 has entered no phase yet; rank 6 failed in 'train step > reward' (step 3) "
        "with ValueError: bad; rank 5 recorded no phase")
    # Every rank at or past this point: the trouble is inside the phase.
    assert timeout_message(phase="'save' (step 2)", rank=1, events=4, records={0: "4 in 'save' (step 2)"},
                           timeout="600 s", error=gloo).endswith(
        "; the timeout is 600 s; every rank reached this phase (one stalls in it, or the ranks issue different "
        "collectives in it)")


@pytest.mark.slow
def test_stalled_rank_is_named_in_the_timeout():
    first, second = run_distributed(phase_cases.stalled_rank_case, 2, 4.0, 2.0)
    assert first.startswith("PhaseTimeout: phase 'train step > reward' (step 3) failed on rank 0 (RuntimeError: "), first
    assert "Timed out waiting 2000ms" in first, first  # gloo's own message stays
    assert first.endswith("; the timeout is 2 s (the test's group); did not arrive: rank 1 is in 'train step > "
                          "generate' (step 3)"), first
    # The stalled rank, once awake, finds the peer gone and says that rank 0 failed there (and why).
    assert second.startswith("PhaseTimeout: phase 'train step > reward' (step 3) failed on rank 1 ("), second
    assert "rank 0 failed in 'train step > reward' (step 3) with RuntimeError: " in second, second


def test_recipe_records_its_phases_alike_on_every_rank(tmp_path):
    # Training TP=2, rollout TP=1: a real switch. One step, then the final save.
    argv = ["--tensor-model-parallel-size", "2", "--train-iters", "1", "--global-batch-size", "4",
            "--micro-batch-size", "2", "--save", str(tmp_path / "ckpt")]
    first, second = run_distributed(phase_cases.recipe_phases_case, 2, argv, tensor_model_parallel_size=2)
    # The counts are compared across ranks: every rank must go through the same phases in the same order.
    assert first["written"] == second["written"]
    entered = {w.split(" ", 1)[1] for w in first["written"] if w.startswith("in ")}
    step = [f"'train step > {p}' (step 1)" for p in (
        "generate", "generate > switch to rollout", "generate > switch to training", "reward",
        "reward > agree on errors", "log-probs", "values", "update", "update > agree on errors", "metrics")]
    assert {"'setup'", "'train step' (step 1)", *step, "'save' (step 1)"} <= entered, sorted(entered)
    assert first["written"][0] == "ready" and first["written"][-1] == "after 'save' (step 1)"
    assert first["after"] is None and second["after"] is None
