"""MoE GPTs from GPTArchitecture (issue 24, models): the fields' validation, a forward and backward on one rank
(all-MoE with a shared expert, mixed dense/MoE layers, sigmoid routing with expert bias), and expert
parallelism 2 on gloo computing the unsharded model's logits."""

from __future__ import annotations

import math

import pytest

from tests import moe_cases as cases
from tests.harness import run_distributed

_ONE_RANK = {
    "shared_expert": (dict(moe_shared_expert_intermediate_size=32), ["MoELayer", "MoELayer"]),
    "mixed_layers": (dict(moe_layer_freq=[0, 1]), ["MLP", "MoELayer"]),
    "sigmoid_expert_bias": (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                 moe_layer_freq=2, num_layers=3), ["MoELayer", "MLP", "MoELayer"]),
}


@pytest.mark.parametrize("name", sorted(_ONE_RANK))
def test_forward_backward_on_one_rank(name):
    arch_kw, kinds = _ONE_RANK[name]
    (result,) = run_distributed(cases.forward_backward_case, 1, arch_kw)
    assert result["kinds"] == kinds
    assert all(result["shared"]) == ("moe_shared_expert_intermediate_size" in arch_kw)
    assert all(result["expert_bias"]) == arch_kw.get("moe_router_enable_expert_bias", False)
    assert math.isfinite(result["loss"])
    assert result["missing_grads"] == [] and result["finite_grads"]
    assert result["aux"] and all(math.isfinite(v) and v > 0 for v in result["aux"].values())


@pytest.mark.parametrize("arch_kw", [dict(), dict(moe_shared_expert_intermediate_size=32, moe_layer_freq=[1, 0])],
                         ids=["all_moe", "shared_mixed"])
def test_expert_parallel_logits_equal_the_unsharded_model(arch_kw):
    results = run_distributed(cases.expert_parallel_case, 2, arch_kw)
    for r in results:
        assert r["num_local"] == 2  # 4 experts over 2 expert-parallel ranks
        # fp32: the same router and the same expert weights; with experts split over ranks, a token's top-2
        # expert outputs are summed by the reduce-scatter instead of in one unpermute, and each expert's matmul
        # sees another token count. Both may change only rounding (a few ulp of O(1) logits through 2 layers);
        # on megatron-core 0.16.1 with torch 2.13's CPU BLAS the logits are in fact bit-identical.
        assert r["max_diff"] <= 1e-5 * max(1.0, r["scale"]), r
        assert r["finite"] and r["ep_aux"] and r["ref_aux"].keys() == r["ep_aux"].keys()
        assert r["refused"] is not None and "rollout expert_model_parallel_size (4) must divide " \
                                            "expert_model_parallel_size (2)" in r["refused"]


_BAD = [
    (dict(num_experts=0), "num_experts (0)"),
    (dict(num_experts=4, moe_router_topk=5), "moe_router_topk (5) must be between 1 and num_experts (4)"),
    (dict(num_experts=4, moe_layer_freq=[1, 0, 1]), "moe_layer_freq ([1, 0, 1]) must list 0 or 1 for each of the "
                                                    "2 layers"),
    (dict(num_experts=4, moe_layer_freq=[1, 2]), "moe_layer_freq ([1, 2])"),
    (dict(num_experts=4, moe_layer_freq=0), "moe_layer_freq (0)"),
    (dict(num_experts=4, moe_router_score_function="tanh"), "moe_router_score_function ('tanh')"),
    (dict(num_experts=4, moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type ('flex')"),
    (dict(num_experts=4, moe_router_load_balancing_type="sinkhorn"), "moe_router_load_balancing_type ('sinkhorn')"),
    (dict(num_experts=4, moe_router_enable_expert_bias=True), "moe_router_enable_expert_bias needs "
                                                              "moe_router_score_function 'sigmoid'"),
    (dict(num_experts=4, moe_aux_loss_coeff=-1.0), "moe_aux_loss_coeff (-1.0)"),
    (dict(num_experts=4, moe_aux_loss_coeff=float("nan")), "moe_aux_loss_coeff (nan)"),
    (dict(num_experts=4, moe_ffn_hidden_size=33), "expert_tensor_parallel_size (2) must divide "
                                                  "moe_ffn_hidden_size (33)"),  # defaults to the TP size
    (dict(num_experts=4, moe_router_score_function="sigmoid", moe_router_pre_softmax=True),
     "moe_router_pre_softmax needs moe_router_score_function 'softmax'"),
    (dict(num_experts=4, moe_router_topk=1), "moe_router_topk (1) with moe_router_score_function 'softmax' needs "
                                             "moe_router_pre_softmax"),
    (dict(num_experts=4, moe_shared_expert_gate=True), "moe_shared_expert_gate needs "
                                                       "moe_shared_expert_intermediate_size"),
]


@pytest.mark.parametrize("arch_kw,message", _BAD, ids=[m.split(" ")[0] for _, m in _BAD])
def test_bad_moe_fields_are_value_errors(arch_kw, message):
    from megatron_hybrid.megatron.models import tiny_llama

    arch = tiny_llama(num_layers=2, **arch_kw)
    with pytest.raises(ValueError) as info:
        arch.validate(tensor_model_parallel_size=2)
    assert message in str(info.value)
    with pytest.raises(ValueError):  # transformer_config validates before building anything
        arch.transformer_config(tensor_model_parallel_size=2)


def test_expert_parallel_size_must_divide_the_experts():
    from megatron_hybrid.megatron.models import tiny_llama

    with pytest.raises(ValueError, match=r"expert_model_parallel_size \(3\) must divide num_experts \(4\)"):
        tiny_llama(num_experts=4).validate(expert_model_parallel_size=3)
    with pytest.raises(ValueError, match=r"expert_model_parallel_size \(2\) needs num_experts"):
        tiny_llama().validate(expert_model_parallel_size=2)
    with pytest.raises(ValueError, match=r"expert_tensor_parallel_size \(5\) must divide "
                                         r"ffn_hidden_size \(96\)"):
        tiny_llama(num_experts=4).validate(expert_tensor_parallel_size=5)
    with pytest.raises(ValueError, match=r"expert_tensor_parallel_size \(2\) needs num_experts"):
        tiny_llama().validate(expert_tensor_parallel_size=2)


def test_dense_transformer_config_has_no_moe_fields():
    from megatron_hybrid.megatron.models import tiny_llama

    config = tiny_llama().transformer_config()
    assert config.num_moe_experts is None and config.moe_ffn_hidden_size is None
    moe = tiny_llama(num_experts=4, moe_router_topk=2).transformer_config()
    assert (moe.num_moe_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size, moe.moe_grouped_gemm) == (4, 2, 96,
                                                                                                      False)
