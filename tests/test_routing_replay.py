"""Routing replay (issue 24 item 8, acceptance 6): the generator records every token's top-k experts per MoE layer
(GenerationConfig.record_routing), and the training passes replay them through megatron-core's RouterReplay
(--moe-enable-routing-replay), counting the tokens routed differently from the rollout."""

from __future__ import annotations

import math

import pytest

from tests import routing_replay_cases as cases
from tests.harness import run_distributed

# The acceptance test's tiny MoE (bf16): 32 experts, top-4, so that the 4th and 5th router logits of some tokens lie
# close enough for the layouts' different reduction orders to swap them; weights at std 0.1 so that a swapped expert
# shows in the log-probs.
ARCH = dict(num_experts=32, moe_router_topk=4, moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.01, init_method_std=0.1)


@pytest.mark.parametrize("kw", [dict(), dict(mixed=32), dict(bucketed=True)], ids=["eager", "mixed", "graph_buckets"])
def test_record_equals_full_forward_routing(kw):
    # Greedy fp32 generation with refills (7 prompts through 3 slots) and stop tokens; mixed: prompts ride along
    # decode steps; graph_buckets: steps rounded to graph buckets, padded rows in the spare slot, slots compacted.
    # Each record row is the experts megatron's routers chose for that token in a full forward over prompt +
    # response (the last generated token never ran); the dense layer has no column.
    (r,) = run_distributed(cases.record_case, 1, dict(moe_layer_freq=[1, 0, 1], num_layers=3), count=7, slots=3,
                           **kw)
    assert r["generated"] == r["reference"]
    assert r["dtype"] == "torch.int16" and r["layers"] == [0, 1]
    assert r["shapes"] == [(n, 2, 2) for n in r["lengths"]]
    assert r["differ"] == 0 and r["unfilled"] == 0


def test_record_merges_pipeline_stages():
    # PP=2: layers 0-1 on stage 0 (MoE ordinal 0, then a dense layer), layers 2-3 on stage 1 (ordinals 1 and 2).
    # Every rank gets all three layers; each stage's columns equal its routers in a pipeline forward.
    results = run_distributed(cases.pipeline_record_case, 2, dict(num_layers=4, moe_layer_freq=[1, 0, 1, 1]),
                              count=5, pipeline_model_parallel_size=2)
    assert [r["layers"] for r in results] == [[0], [1, 2]]
    for r in results:
        assert r["shapes"] == [(n, 3, 2) for n in r["lengths"]] and r["shapes"] == results[0]["shapes"]
        assert r["differ"] == 0 and r["unfilled"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, 40], ids=["padded", "packed"])
def test_replay_routes_training_as_the_rollout_did(budget):
    # Packed (issue 44, step 5): the record is read by each pack's rows and positions; a misaligned record would
    # replay other tokens' experts, which the log-probs' distance to the rollout's (below) would show.
    r0, r1 = run_distributed(cases.replay_case, 2, ARCH, count=8, new_tokens=12, seed=3,
                             micro_batch_size=3, max_tokens_per_micro_batch=budget, tensor_model_parallel_size=2)
    assert r0 == r1  # TP ranks: the same metrics
    plain, replay = r0["plain"], r0["replay"]
    assert all(shape[0] == n - 1 for shape, n in zip(r0["record_shapes"], r0["lengths"]))
    # Without replay: the training layout (TP=2: other reduction orders, bf16) routes some tokens elsewhere.
    assert plain["log_prob_pass"]["moe/routing_mismatch_tokens"] > 0
    assert plain["log_prob_pass"]["moe/router_choice_mismatch_tokens"] == \
        plain["log_prob_pass"]["moe/routing_mismatch_tokens"]
    # With replay: every recorded token routed as in the rollout, in the log-prob pass and in the training pass.
    for p in ("log_prob_pass", "update_pass"):
        assert replay[p]["moe/routing_mismatch_tokens"] == 0.0, replay
        assert replay[p]["moe/routing_recorded_tokens"] == plain[p]["moe/routing_recorded_tokens"] > 0
    # The routers' own choices on the replayed inputs differ from the record where plain routing did: the record
    # is aligned with the tokens (misaligned, nearly every token would differ).
    for p in ("log_prob_pass", "update_pass"):
        assert replay[p]["moe/router_choice_mismatch_tokens"] == plain[p]["moe/routing_mismatch_tokens"]
    if budget is None:  # (packed, sdpa's rounding leaves a near-tie whose other expert moves no bf16 log-prob)
        assert replay["mismatch"]["rollout_mismatch/logp_abs_diff_mean"] < \
            plain["mismatch"]["rollout_mismatch/logp_abs_diff_mean"]
    else:
        assert len(r0["packs"]) > 3 and max(r0["packs"]) <= 40
    for run in (plain, replay):
        assert run["losses"] and all(math.isfinite(x) for x in run["losses"])
        assert run["grads"] > 0 and run["finite_grads"]


def test_flag_needs_an_moe_model():
    import argparse

    from megatron_hybrid.rl.arguments import add_hybrid_args, add_megatron_args, validate_args

    args = add_hybrid_args(add_megatron_args(argparse.ArgumentParser())).parse_args(["--moe-enable-routing-replay"])
    with pytest.raises(ValueError, match="--moe-enable-routing-replay needs an MoE model"):
        validate_args(args, 4)  # no process group exists: a usage error, before any


@pytest.mark.slow
@pytest.mark.parametrize("packed", [[], ["--attention-backend", "sdpa", "--max-tokens-per-micro-batch", "40"]],
                         ids=["padded", "packed"])
def test_recipe_replays_routing(packed):
    # The recipe at TP=2 (sequence-parallel) on 2 ranks, rollout TP=1, bf16: the actor's log-prob pass routes every
    # recorded token as the rollout did; the metrics are logged. Packed too (issue 44, step 5).
    argv = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16", "--global-batch-size", "8",
            "--micro-batch-size", "4", "--max-new-tokens", "6", "--train-iters", "2", "--no-progress", *packed]
    history = run_distributed(cases.recipe_case, 2, argv, steps=2, tensor_model_parallel_size=2)[0]
    for m in history:
        assert m["moe/routing_mismatch_tokens"] == 0.0 and m["moe/routing_recorded_tokens"] > 0, m
        assert 0 <= m["moe/router_choice_mismatch_tokens"] <= 1
        assert math.isfinite(m["pg_loss"][0]) and math.isfinite(m["actor_grad_norm"][0])


def test_replay_refuses_full_activation_recompute():
    # The recipe refuses the flags together (tests/test_arguments.py); a library caller gets the same refusal.
    message = run_distributed(cases.replay_refuses_full_recompute_case, 1)[0]
    assert message.startswith("routing replay does not replay the backward pass's rerun of full activation recompute")
