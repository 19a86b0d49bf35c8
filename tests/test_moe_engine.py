"""The HybridEngine on MoE actors (issue 24, resharding): expert-parallel training layouts (t, p, e, et) switched to
rollout layouts (t_g, p_g, e_g, et_g) on 8 gloo ranks, in both weight modes, before and after an SGD step.

Checked on every rank against the unsharded model (one rank, the same seeded weights): every rollout tensor equals
the rank's rollout shard of the full tensor bit for bit (a routed expert by its global index); rollout and
training logits equal the unsharded model's; the bytes received equal the rollout shard minus what the rank's
own training tensors hold (counted by name), and the expert bytes (micro-EP size − 1) × the rank's own expert
bytes; in aliased mode the only memory mapped while rolling out is the peers' slots, and none while training;
greedy KV-cache generation through the engine (replicas of one rollout EP group in lockstep) equals the unsharded
model's full-recompute greedy decoding.
"""

from __future__ import annotations

import pytest
import torch

from tests import moe_engine_cases as cases
from tests.harness import run_distributed

# (t, p, e, et) -> (t_g, p_g, e_g, et_g), the model's extra fields, sequence parallelism in training.
_LAYOUTS = {
    "t1p1e8et1-e2": ((1, 1, 8, 1), (1, 1, 2, 1), {}, False),
    "t1p1e4et2-all": ((1, 1, 4, 2), (1, 1, 1, 1), {}, False),
    "t2p1e4et1sp-t1e2": ((2, 1, 4, 1), (1, 1, 2, 1), {}, True),
    "t2p2e2et1-all": ((2, 2, 2, 1), (1, 1, 1, 1),
                      dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True), False),
    "t4p1e2et2-t2e1et2": ((4, 1, 2, 2), (2, 1, 1, 2), {}, False),
    # Expert biases (replicated over expert TP, each expert's own) gathered over EP: found by the simulated world.
    "t1p1e4et1-bias-e1": ((1, 1, 4, 1), (1, 1, 1, 1), dict(add_bias_linear=True), False),
    "t1p2e4et1-p1e4": ((1, 2, 4, 1), (1, 1, 4, 1),
                       dict(num_layers=4, moe_layer_freq=[0, 1, 0, 1], moe_shared_expert_intermediate_size=32),
                       False),
}


_REFERENCES: dict[str, dict] = {}


def _reference(arch_kw: dict) -> dict:
    """The unsharded model's weights and logits, once per architecture."""
    key = repr(sorted(arch_kw.items()))
    if key not in _REFERENCES:
        (_REFERENCES[key],) = run_distributed(cases.reference_case, 1, arch_kw)
    return _REFERENCES[key]


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    # fp32 with the same weights: the layouts change only the order of sums (row-parallel partial products, the
    # reduce-scatter that adds each token's top-k expert outputs, per-expert token counts), a few ulp of O(1)
    # logits through 2-4 layers; 1e-5 of the largest logit leaves a 100-fold margin over that and is far below
    # what one wrong weight or one wrongly routed token would change (O(0.1)).
    return got.shape == want.shape and float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("name", sorted(_LAYOUTS))
@pytest.mark.slow
def test_moe_switch_is_exact_and_moves_only_missing_bytes(name):
    (t, p, e, et), (t_g, p_g, e_g, et_g), arch_kw, sp = _LAYOUTS[name]
    ref = _reference(arch_kw)
    rollout = dict(tensor_model_parallel_size=t_g, pipeline_model_parallel_size=p_g,
                   expert_model_parallel_size=e_g, expert_tensor_parallel_size=et_g)
    results = run_distributed(cases.moe_engine_case, 8, arch_kw, rollout, ref, sequence_parallel=sp,
                              tensor_model_parallel_size=t, pipeline_model_parallel_size=p,
                              expert_model_parallel_size=e, expert_tensor_parallel_size=et)
    micro_ep = (et // et_g) * (e // e_g) * (p // p_g)
    for r in results:
        for mode in ("aliased", "canonical"):
            res = r[mode]
            assert res["expert_layout"].micro_ep_size == micro_ep
            total, expert = res["missing"]
            for when, logits in (("first", ref["logits"]), ("second", ref["logits_stepped"])):
                got = res[when]
                ctx = (r["rank"], mode, when)
                assert got["mismatches"] == [], ctx
                if got["rollout_logits"] is not None:
                    assert _close(got["rollout_logits"], logits[res["seed_rollout"]]), ctx
                if got["train_logits"] is not None:
                    assert _close(got["train_logits"], logits[res["seed_train"]]), ctx
                rep = got["report"]
                assert rep["total_bytes"] == total, (ctx, rep, total)
                assert rep["expert_bytes"] == expert == (micro_ep - 1) * res["expert_numel"] * 4, (ctx, rep)
                assert ("experts" in got["planes"]) == (micro_ep > 1), ctx
                if mode == "aliased":  # zero redundancy: the peers' slots are all that is mapped, no rebuilt copy
                    # (the peers' bytes that are not mapped anew share a page with an own slot: resident anyway)
                    assert 0 <= total - rep["peer_bytes_mapped"] <= rep["resident_peer_bytes"], (ctx, rep)
                    assert rep["canonical_bytes_mapped"] == 0, (ctx, rep)
                assert rep["rollout_memory_bytes_mapped"] == 0 and got["peer_bytes_after"] == 0, (ctx, rep)
            assert res["second"]["report"] == res["first"]["report"], (r["rank"], mode)
            # Greedy KV-cache generation on the rollout layout = full recompute by the unsharded stepped model.
            assert res["generated"] == ref["greedy_stepped"][res["dp_rank"]], (r["rank"], mode)
            # Grouped GEMMs wherever a rollout layer's experts are one strided view: always in canonical mode (one
            # bucket per layer, or rebuilt back to back); in aliased mode unless the experts are expert-TP blocks.
            # (Expert biases: expert by expert, as ExpertStack.weights documents.)
            grouped = (mode == "canonical" or et == et_g) and not arch_kw.get("add_bias_linear")
            assert set(res["paths"]) == {"grouped_experts" if grouped else "sequential_experts"}, (r["rank"], mode)


#: MoE exchange layouts (the experts move in the exchange's all-to-all, on the expert-TP axis): more rollout stages
#: than training ones, dense and MoE layers mixed differently on the stages, on 8 ranks.
_EXCHANGES = {
    "t2p1e2et1-p2e1": ((2, 1, 2, 1), (2, 2, 1, 1), {}),
    "t1p2e4et1-p4e2-mixed": ((1, 2, 4, 1), (1, 4, 2, 1),
                             dict(num_layers=4, moe_layer_freq=[1, 0, 0, 1], moe_shared_expert_intermediate_size=32)),
}


@pytest.mark.parametrize("name", sorted(_EXCHANGES))
@pytest.mark.slow
def test_moe_exchange_layouts_are_exact_and_generate(name):
    """The engine on MoE exchange layouts (real ranks, megatron-core's rollout model on the arrangement's expert
    groups): every rollout tensor bit for bit before and after an SGD step, the bytes moved are what each rank
    misses, the rollout model's logits are the unsharded model's, greedy generation is the reference's."""
    (t, p, e, et), (t_g, p_g, e_g, et_g), arch_kw = _EXCHANGES[name]
    ref = _reference(arch_kw)
    rollout = dict(tensor_model_parallel_size=t_g, pipeline_model_parallel_size=p_g,
                   expert_model_parallel_size=e_g, expert_tensor_parallel_size=et_g)
    results = run_distributed(cases.moe_engine_case, 8, arch_kw, rollout, ref, tensor_model_parallel_size=t,
                              pipeline_model_parallel_size=p, expert_model_parallel_size=e,
                              expert_tensor_parallel_size=et)
    for r in results:
        for mode in ("aliased", "canonical"):
            res = r[mode]
            assert res["expert_layout"].exchange, res["expert_layout"]
            total, _ = res["missing"]  # t_g = t, et_g = et: a rollout tensor is held whole or not at all
            for when, logits in (("first", ref["logits"]), ("second", ref["logits_stepped"])):
                got, ctx = res[when], (r["rank"], mode, when)
                assert got["mismatches"] == [], ctx
                if got["rollout_logits"] is not None:
                    assert _close(got["rollout_logits"], logits[res["seed_rollout"]]), ctx
                assert got["report"]["total_bytes"] == total, (ctx, got["report"], total)
            assert res["generated"] == ref["greedy_stepped"][res["dp_rank"]], (r["rank"], mode)


_BAD = [
    (dict(expert_model_parallel_size=4), "rollout expert_model_parallel_size (4) must divide "
                                         "expert_model_parallel_size (2)"),
    (dict(expert_model_parallel_size=3), "rollout expert_model_parallel_size (3) must divide"),
    (dict(expert_tensor_parallel_size=2), "rollout expert_tensor_parallel_size (2) must divide "
                                          "expert_tensor_parallel_size (1)"),
    # More rollout stages than training ones: an exchange layout, whose rollout stages (one rank each here) cannot
    # hold two EP ranks.
    (dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2),
     "rollout expert_tensor_parallel_size (1) × rollout expert_model_parallel_size (2) must divide a rollout "
     "stage's ranks (1)"),
    (dict(expert_model_parallel_size=0), "rollout expert_model_parallel_size (0) must be a positive integer"),
]


def test_bad_expert_layouts_are_value_errors_before_any_collective():
    cases_ = [kw for kw, _ in _BAD if kw.get("expert_model_parallel_size", 1) > 0]
    results = run_distributed(cases.moe_bad_input_cases, 2, cases_, expert_model_parallel_size=2)
    expected = [msg for kw, msg in _BAD if kw.get("expert_model_parallel_size", 1) > 0]
    for messages in results:
        assert len(messages) == len(expected) + 2
        for got, want in zip(messages, expected):
            assert want in got, (got, want)
        assert "must cover the world (2 ranks)" in messages[-2], messages[-2]
        assert "needs a model with experts" in messages[-1], messages[-1]
    with pytest.raises(ValueError, match=_BAD[-1][1].replace("(", r"\(").replace(")", r"\)")):
        from megatron_hybrid import RolloutLayout

        RolloutLayout(1, 1, **_BAD[-1][0])


def test_experts_other_than_sequential_mlp_are_refused():
    """Only SequentialMLP's per-expert tensors are planned: grouped experts (``moe_grouped_gemm``, Transformer
    Engine's) are a ValueError naming the module and its class, before any collective."""
    (message,) = run_distributed(cases.grouped_experts_case, 1)
    assert message == ("decoder.layers.0.mlp.experts is a GroupedMLP; the HybridEngine moves SequentialMLP experts "
                       "(megatron-core's local spec, moe_grouped_gemm=False)"), message

@pytest.mark.slow
def test_distributed_optimizer_buffers_are_the_own_slots_of_both_planes():
    """DDP with the distributed optimizer keeps a routed expert's parameters in buffers of their own (over the
    expert data-parallel group): each buffer moves, whole, into the own slot of its plane's gather (dense over the
    micro-DP group, experts over the micro-EP group). 2 Adam steps through the engine equal 2 without it, bit for
    bit, and each switch's rollout tensors are that step's training weights. (Aliased mode: the planes' held
    regions are mode-independent; canonical mode only rebuilds from them, as with the dense distributed optimizer
    in test_distopt.)"""
    rollout = dict(expert_model_parallel_size=1)  # (t, p, e) = (2, 1, 2) on 4 ranks -> (1, 1, 1)
    results = run_distributed(cases.moe_distopt_case, 4, "aliased", rollout, steps=2, tensor_model_parallel_size=2,
                              expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    for rank, r in enumerate(results):
        assert r["losses_equal"] and r["params_differ"] == [], (rank, r)
        assert r["mismatches"] == [[]] * 2, (rank, r["mismatches"])
        assert r["num_buffers"] == 2 and all(r["inside"]), (rank, r)  # a dense and an expert buffer, both moved
        assert all(expert > 0 and total > expert for total, expert in r["moved"]), (rank, r["moved"])
