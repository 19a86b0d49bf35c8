"""Generation on the rollout layout: same tokens as the training layout, log-probs, data flow, offload."""

from __future__ import annotations

import pytest
import torch

from tests import engine_cases, rollout_cases
from tests.harness import run_distributed
from tests.test_engine import _reference

LAYOUTS = [((2, 1, 2), (1, 1)), ((2, 2, 1), (1, 1)), ((2, 2, 2), (1, 2)), ((2, 1, 4), (4, 1))]


@pytest.mark.parametrize("layout,uneven", [(l, i % 2 == 1) for i, l in enumerate(LAYOUTS)],
                         ids=lambda v: str(v) if isinstance(v, bool) else f"t{v[0][0]}p{v[0][1]}d{v[0][2]}-tg{v[1][0]}pg{v[1][1]}")
@pytest.mark.slow
def test_greedy_generation_matches_training_layout(layout, uneven):
    (t, p, d), (t_g, p_g) = layout
    state = _reference(())[0]
    runs = run_distributed(rollout_cases.generation_case, t * p * d, t_g, p_g, state, uneven,
                           tensor_model_parallel_size=t, pipeline_model_parallel_size=p)
    for r in runs:
        # Every training rank gets exactly its own prompts' results, in order.
        assert [res[0] for res in r["results"]] == r["prompts"] == rollout_cases.prompts_for(r["dp"], uneven)
        assert [(res[0], res[1]) for res in r["results"]] == r["reference"]
        assert all(len(res[1]) == 6 == len(res[2]) for res in r["results"])
        if r["forward_logps"] is not None:
            # fp32, different TP splits and sequence lengths between the two forwards: ~1e-6; PPO's first
            # importance ratio exp(new − old) is then 1 within 1e-4.
            for res, ref in zip(r["results"], r["forward_logps"]):
                torch.testing.assert_close(torch.tensor(res[2]), torch.tensor(ref), rtol=0, atol=1e-4)
    # Ranks of one training replica agree on sampled tokens (shared seeds inside each rollout replica).
    by_dp = {}
    for r in runs:
        by_dp.setdefault(r["dp"], []).append(r["sampled"])
    for samples in by_dp.values():
        assert all(s == samples[0] for s in samples)
        assert all(len(x) == 4 for x in samples[0])


def test_offload_optimizer_and_grads():
    for r in run_distributed(rollout_cases.offload_case, 2, tensor_model_parallel_size=2):
        assert r["resident"] == 0 and r["grad_resident"] == 0
        assert r["same"] and r["same_grads"] and r["ptrs_ok"]


def test_rollout_model_refuses_training_mode():
    run_distributed(engine_cases.misuse_case, 2, tensor_model_parallel_size=2)


def test_megatron_static_engine_on_rollout_model():
    state = _reference(())[0]
    for mega, ours in run_distributed(rollout_cases.static_engine_case, 2, state, tensor_model_parallel_size=2):
        assert mega == ours and all(len(x) == 5 for x in ours)
