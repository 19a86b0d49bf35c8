"""MoE layers in the generator (megatron_hybrid.inference.moe, issue 24 part 4): the step against megatron-core's
MoELayer on one rank; greedy generation of tiny MoE GPTs against a full-recompute greedy decoding (refills, stop
tokens, mixed steps); expert parallelism 2 on two gloo ranks, each its own replica, stepping in lockstep."""

from __future__ import annotations

import pytest

from tests import moe_generation_cases as cases
from tests.harness import run_distributed

# One rank: each case's MoE layers on 13 random tokens. The step runs the same operations as megatron-core's MoELayer
# (router GEMM, top-k, the experts' matmuls, pairs summed into their tokens in megatron's permute order), so on a CPU
# it is bit-exact (0.0 seen for every case, bf16 included). The allowance is for a BLAS that blocks a grouped GEMM's
# rows differently from per-expert matmuls, or sums a token's k > 2 expert outputs in another order: a few ulp of
# the output (fp32: 1e-6 of its scale; bf16: 2^-7, one ulp of its 8-bit mantissa).
_LAYERS = {
    "softmax_top2": dict(),
    "sigmoid_expert_bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
    "shared_expert": dict(moe_shared_expert_intermediate_size=32),
    "mixed_layers": dict(moe_layer_freq=[0, 1]),
    "pre_softmax_scaled": dict(extra=dict(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.5)),
    "bf16_fp32_router_gated_shared": dict(params_dtype="bfloat16", moe_shared_expert_intermediate_size=32,
                                          extra=dict(moe_router_dtype="fp32", moe_shared_expert_gate=True)),
    "group_limited_top3": dict(num_experts=8, moe_router_topk=3,
                               extra=dict(moe_router_num_groups=4, moe_router_group_topk=2)),
    "probs_on_input_top1": dict(moe_router_topk=1, moe_router_pre_softmax=True,
                                extra=dict(moe_apply_probs_on_input=True)),
}


@pytest.mark.parametrize("name", sorted(_LAYERS))
def test_step_equals_megatron_moe_layer(name):
    arch_kw = _LAYERS[name]
    (r,) = run_distributed(cases.layer_case, 1, arch_kw, 13)
    tol = (2**-7 if arch_kw.get("params_dtype") == "bfloat16" else 1e-6) * r["scale"]
    assert r["after"] == 0.0  # outside a step: megatron-core's own forward
    for path in ("sequential", "grouped", "padded", "in_step"):
        assert r[path] <= tol, (path, r)
    assert r["pairs"] <= tol * r["pairs_scale"] / r["scale"] and r["pairs_scale"] > 0, r
    assert r["in_step_bias"] == [True] * len(r["in_step_bias"])  # (output, None), as MoELayer.forward
    # Separate allocations: the experts' own MLPs; one storage at a uniform stride: grouped GEMMs.
    assert set(r["paths_before"]) == {"sequential_experts"} and set(r["paths_after"]) == {"grouped_experts"}
    assert all(r["shared"]) == ("moe_shared_expert_intermediate_size" in arch_kw)
    if name == "mixed_layers":
        assert r["kinds"] == ["MLP", "MoELayer"]


def test_step_with_expert_tensor_parallelism():
    # Tensor parallelism 2 (expert TP 2, one replica): both ranks hold the same tokens, gather them over tp_ep,
    # compute their experts' partial sums and reduce-scatter them, as megatron's all-gather dispatcher does.
    for r in run_distributed(cases.layer_case, 2, dict(moe_shared_expert_intermediate_size=32), 13,
                             tensor_model_parallel_size=2):
        assert r["after"] == 0.0
        for path in ("sequential", "grouped", "padded", "in_step"):
            assert r[path] <= 1e-6 * r["scale"], (path, r)
        assert set(r["paths_after"]) == {"grouped_experts"}


@pytest.mark.parametrize("arch_kw,grouped,mixed", [
    (dict(moe_shared_expert_intermediate_size=32, moe_layer_freq=[1, 0]), True, 32),
    (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True), False, 0),
], ids=["shared_mixed_layers_grouped_mixed_steps", "sigmoid_expert_bias_sequential"])
def test_greedy_generation_equals_recompute(arch_kw, grouped, mixed):
    (r,) = run_distributed(cases.generation_case, 1, arch_kw, grouped=grouped, count=7, slots=3, mixed=mixed)
    assert r["generated"] == r["reference"]
    assert r["paths"] == ["grouped_experts" if grouped else "sequential_experts"] * len(r["paths"])
    lengths = [len(g) for g in r["generated"]]
    assert len(r["stops"]) >= 2 and min(lengths) < cases.NEW_TOKENS == max(lengths)  # stops ended some
    rep = r["report"]
    assert rep["idle_slot_steps"] == 0 and rep["max_active_slots"] == 3  # refills: 7 prompts through 3 slots
    assert (rep["mixed_steps"] > 0) == bool(mixed)
    assert rep["lockstep_steps"] == rep["lockstep_idle_steps"] == 0  # one replica: no agreement


@pytest.mark.parametrize("bucketed", [False, True], ids=["eager", "graph_buckets"])
@pytest.mark.slow
def test_expert_parallel_replicas_step_in_lockstep(bucketed):
    # Call 1: rank 0 has 5 prompts, rank 1 two (it finishes first and steps idle); call 2: rank 1 has none.
    # eager: the experts' own MLPs (the aliased weight mode's path); graph_buckets: grouped GEMMs, the steps as CUDA
    # graphs would run them (rounded to buckets, the MoE rows to a power of two named by the graph key, idle steps
    # keyed too), run eagerly on the CPU, the host one step behind the launches.
    counts = [[5, 2], [3, 0]]
    results = run_distributed(cases.expert_parallel_case, 2, dict(), counts, grouped=bucketed, slots=2,
                              bucketed=bucketed)
    for rank, r in enumerate(results):
        assert r["spans"] and r["lockstep"] and r["num_local"] == [2, 2]
        assert r["paths"] == ["grouped_experts" if bucketed else "sequential_experts"] * 2
        assert r["generated"] == r["reference"], rank
    # Every replica ran as many steps (own plus idle) as the other in each call, so their collectives matched.
    for call in range(len(counts)):
        steps = [r["reports"][call]["lockstep_steps"] + r["reports"][call]["lockstep_idle_steps"] for r in results]
        assert steps[0] == steps[1] > 0, steps
    assert results[1]["reports"][0]["lockstep_idle_steps"] > 0  # rank 1 finished first
    assert results[1]["reports"][1]["lockstep_steps"] == 0 < results[1]["reports"][1]["lockstep_idle_steps"]
    assert results[0]["reports"][1]["lockstep_idle_steps"] == 0
    assert sum(r["reports"][0]["lockstep_padded_rows"] for r in results) > 0  # the smaller step was padded
    if bucketed:
        for r in results:
            # Every step's graph names its MoE rows, a power of two: (kind, rows, length, sig, moe_rows), or
            # ("idle", moe_rows, 0, None).
            moe_rows = [key[1] if key[0] == "idle" else key[4] for key in r["keys"]]
            assert r["keys"] and all(n & (n - 1) == 0 for n in moe_rows), r["keys"]
            assert all(len(key) == 5 for key in r["keys"] if key[0] != "idle")
        assert any(key[0] == "idle" for key in results[1]["keys"])


def test_unsupported_moe_settings_are_refused():
    (message,) = run_distributed(cases.refused_case, 1, dict(extra=dict(moe_expert_capacity_factor=1.0)))
    assert "moe_expert_capacity_factor=1.0 (token dropping) (layer 0)" in message, message


def test_lockstep_plans():
    from megatron_hybrid.inference.planner import PlannerSettings, StepPlanner, packed_tokens

    sig = ("greedy",)
    for graphs, buckets in ((False, {1: 1, 5: 5, 9: 9}), (True, {1: 1, 5: 8, 9: 16, 16: 16})):
        planner = StepPlanner(PlannerSettings(num_slots=4, slot_tokens=64, prefill_tokens=64,
                                              batch_sizes=(1, 2, 4), graphs=graphs, prefill_rows=4,
                                              prefill_graph_tokens=128))
        assert {n: planner.moe_bucket(n) for n in buckets} == buckets
        decode = planner.decode([0, None, 2], 10, signature=sig)
        prefill = planner.prefill([[1, 2, 3], [4]], [0, 1], [0, 1], signature=sig)
        assert packed_tokens(decode) == (4 if graphs else 3)
        assert packed_tokens(prefill) == (prefill.rows * prefill.length if graphs else 4)
        stepped = planner.lockstep(decode, 16)
        assert stepped.moe_rows == 16 and stepped.owners == decode.owners
        assert stepped.graph_key == ((*decode.graph_key, 16) if graphs else None)
        idle = planner.idle(8)
        assert (idle.kind, idle.moe_rows, idle.owners) == ("idle", 8, ())
        assert idle.graph_key == (("idle", 8, 0, None) if graphs else None)
        with pytest.raises(AssertionError):
            planner.lockstep(prefill, packed_tokens(prefill) - 1)


def test_expert_weight_views():
    import torch

    from megatron_hybrid.inference.moe import stacked_view

    buffer = torch.arange(3 * 20, dtype=torch.float32)
    weights = [buffer[i * 20: i * 20 + 12].view(3, 4) for i in range(3)]  # 8 elements between experts
    view = stacked_view(weights)
    assert view is not None and view.shape == (3, 3, 4) and all(torch.equal(view[i], w) for i, w in
                                                                 enumerate(weights))
    assert view.data_ptr() == weights[0].data_ptr()  # a view, not a copy
    assert stacked_view([w.clone() for w in weights]) is None  # separate allocations
    assert stacked_view([weights[0], weights[2], weights[1]]) is None  # not a uniform stride
    assert stacked_view([buffer[:12].view(3, 4), buffer[6:18].view(3, 4)]) is None  # overlapping
    assert stacked_view([torch.zeros(1).expand(3, 4)] * 2) is None  # an aliased placeholder
    assert stacked_view(weights[:1]).shape == (1, 3, 4)
