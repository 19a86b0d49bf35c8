"""The simulated world (issue 48, step 3): every rank of a layout pair in one process, the engine's plan,
placement and executor through the in-process transport, each rank's rollout tensors against the unsharded
model's rollout shard, bit for bit, and the bytes each rank receives against an independent count."""

from __future__ import annotations

import pytest
import torch

from megatron_hybrid.layout import RolloutLayout
from megatron_hybrid.megatron.models import tiny_llama
from megatron_hybrid.megatron.sharding import shard, unshard
from megatron_hybrid.reshard.plan import build_group_plan
from megatron_hybrid.simulate import check_switch, gpt_parameters, simulate_switch, stage_names, validate

from .harness import run_distributed

#: Architecture options, as tiny_llama overrides (GPTArchitecture: Megatron-LM's flags).
KWARGS = {"swiglu-rms-gqa": {},
          "gelu-layernorm-biases-mha": dict(swiglu=False, normalization="LayerNorm", add_qkv_bias=True,
                                            add_bias_linear=True, num_query_groups=None),
          "gqa-qk-norm-learned-pos": dict(num_query_groups=2, add_qkv_bias=True, qk_layernorm=True,
                                          position_embedding_type="learned_absolute", max_position_embeddings=64,
                                          vocab_size=96, make_vocab_size_divisible_by=8),
          "swiglu-biases": dict(add_bias_linear=True, num_layers=2, hidden_size=32, num_attention_heads=8,
                                num_query_groups=4, ffn_hidden_size=48),
          "tied": dict(untie_embeddings_and_output_weights=False)}
ARCHS = {name: tiny_llama(**kw) for name, kw in KWARGS.items()}

#: (t, p, d) -> (t_g, p_g). In place: gathers over TP, over stages and both, a rollout TP wider than training's,
#: d > 1. Exchanged: TP 2 x PP 2 -> TP 4 (where canonical mode once rebuilt fc1 wrong), more rollout stages than
#: training ones, both sizes changing the other way round.
PAIRS = [((2, 1, 1), (1, 1)), ((2, 2, 1), (1, 1)), ((4, 1, 1), (2, 1)), ((2, 2, 2), (1, 2)), ((1, 2, 2), (1, 1)),
         ((1, 1, 2), (2, 1)), ((2, 2, 1), (2, 1)), ((4, 2, 1), (2, 1)), ((2, 1, 2), (4, 1)), ((2, 2, 2), (4, 2)),
         ((2, 2, 1), (4, 1)), ((4, 1, 1), (1, 2)), ((2, 2, 1), (1, 4)), ((2, 4, 1), (4, 2)), ((4, 2, 1), (2, 4))]


def _update(name: str, tensor: torch.Tensor) -> None:
    """An optimizer step's stand-in: element-wise, so a shard and the full tensor get the same bits."""
    tensor.mul_(0.5).add_(0.25)


@pytest.mark.parametrize("mode", ["aliased", "canonical"])
@pytest.mark.parametrize("arch", list(ARCHS), ids=list(ARCHS))
@pytest.mark.parametrize("training,rollout", PAIRS, ids=[f"{t}-{r}" for t, r in PAIRS])
def test_every_rank_gets_its_rollout_shard_bit_for_bit(training, rollout, arch, mode):
    try:  # two query groups do not split over TP 4; two layers not over 4 stages
        validate(ARCHS[arch], training, RolloutLayout(*rollout), weight_mode=mode)
    except ValueError as exc:
        pytest.skip(f"refused by the engine's validation: {exc}")
    result = simulate_switch(ARCHS[arch], training, RolloutLayout(*rollout), weight_mode=mode, switches=2,
                             update=_update)
    assert len(result.ranks) == training[0] * training[1] * training[2]
    assert result.layout.exchange == ((training, rollout) in PAIRS[10:])
    assert check_switch(result) == []
    # The check sees the updated weights: switch 2 delivered them (switch 1 moved the old ones).
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    rank = result.ranks[0]
    assert torch.equal(rank.rollout[name], result.expected(rank)[name])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("training,rollout", [((2, 2, 1), (1, 2)), ((2, 2, 1), (1, 1)), ((1, 2, 2), (2, 1)),
                                              ((2, 2, 2), (4, 2))])
def test_virtual_chunks_are_served_as_an_exchange_layout(training, rollout, tied):
    """Two virtual chunks a stage (model chunk v of stage s holds layers of chunk v·p + s): the engine exchanges
    whatever the pair, and every rank still gets its rollout shard bit for bit."""
    arch = tiny_llama(untie_embeddings_and_output_weights=not tied)
    result = simulate_switch(arch, training, RolloutLayout(*rollout), weight_mode="canonical", switches=2,
                             update=_update, chunks=2)
    assert result.layout.exchange
    assert check_switch(result) == []


#: MoE architectures (routed experts, a shared expert and its gate, dense and MoE layers mixed, biases).
MOE_KWARGS = {
    "moe-shared-gate-mixed": dict(num_layers=4, num_experts=4, moe_ffn_hidden_size=32, moe_layer_freq=[1, 0, 1, 0],
                                  moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True),
    "moe-biases-gelu-layernorm": dict(num_layers=2, num_experts=4, moe_ffn_hidden_size=32, add_bias_linear=True,
                                      swiglu=False, normalization="LayerNorm"),
    "moe-tied-8-experts": dict(num_layers=2, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16,
                               untie_embeddings_and_output_weights=False),
}
MOE_ARCHS = {name: tiny_llama(**kw) for name, kw in MOE_KWARGS.items()}

#: (t, p, d), (EP, expert TP) -> rollout (t_g, p_g, e_g, et_g): micro-EP gathers over expert TP, over EP, over
#: stages and all three, expert data parallelism, EP wider than TP, the rollout keeping training's EP.
MOE_PAIRS = [((2, 1, 1), (2, 1), (1, 1, 1, 1)), ((2, 1, 2), (2, 2), (1, 1, 1, 1)), ((2, 2, 2), (4, 1), (1, 1, 2, 1)),
             ((1, 2, 2), (2, 1), (1, 1, 1, 1)), ((2, 1, 2), (4, 1), (2, 1, 4, 1)), ((4, 1, 1), (2, 2), (2, 1, 1, 1)),
             ((2, 2, 1), (2, 1), (1, 2, 2, 1)), ((1, 2, 4), (4, 1), (1, 2, 2, 1))]


@pytest.mark.parametrize("mode", ["aliased", "canonical"])
@pytest.mark.parametrize("arch", list(MOE_ARCHS), ids=list(MOE_ARCHS))
@pytest.mark.parametrize("training,experts,rollout", MOE_PAIRS, ids=[f"{t}{e}-{r}" for t, e, r in MOE_PAIRS])
def test_moe_ranks_get_their_rollout_shard_and_experts_bit_for_bit(training, experts, rollout, arch, mode):
    """The routed experts as a second plane over the micro-EP groups (the engine's), beside the dense one: every
    rank's rollout experts are its rollout EP rank's, cut for its rollout expert-TP rank, bit for bit, and each
    rank receives the bytes it misses."""
    try:  # expert biases need expert TP 1; the mixed pattern does not gather over 2 stages of 2 layers
        validate(MOE_ARCHS[arch], training, RolloutLayout(*rollout), weight_mode=mode, expert_parallel=experts)
    except ValueError as exc:
        pytest.skip(f"refused by the engine's validation: {exc}")
    result = simulate_switch(MOE_ARCHS[arch], training, RolloutLayout(*rollout), weight_mode=mode, switches=2,
                             update=_update, expert_parallel=experts)
    (e, et), (_, p_g, e_g, et_g) = experts, rollout
    assert result.experts.micro_ep_size == (et // et_g) * (e // e_g) * (training[1] // p_g)
    assert check_switch(result) == []


#: MoE exchange layouts (the exchange plan's expert axis): more rollout stages than training ones (PP exchange),
#: TP 4 -> 3 (TP exchange), TP and PP moving the other way round, two virtual chunks.
MOE_EXCHANGES = [((2, 2, 2), (2, 2), (2, 4, 2, 1), 1, "moe-shared-gate-mixed"),
                 ((4, 1, 1), (2, 2), (2, 2, 2, 1), 1, "moe-shared-gate-mixed"),
                 ((2, 2, 2), (4, 1), (1, 4, 1, 1), 1, "moe-biases-gelu-layernorm"),
                 ((4, 1, 3), (3, 1), (3, 1, 6, 1), 1, "moe-12-heads"),
                 ((2, 2, 1), (1, 2), (1, 1, 2, 1), 2, "moe-shared-gate-mixed"),
                 ((1, 2, 4), (2, 1), (1, 1, 4, 1), 2, "moe-tied-8-experts")]


@pytest.mark.parametrize("mode", ["aliased", "canonical"])
@pytest.mark.parametrize("training,experts,rollout,chunks,arch", MOE_EXCHANGES,
                         ids=[f"{t}{e}-{r}-chunks{c}-{a}" for t, e, r, c, a in MOE_EXCHANGES])
def test_moe_exchange_layouts_move_experts_on_their_own_axis(training, experts, rollout, chunks, arch, mode):
    """The exchange plan with routed experts (expert TP as their axis, the rollout EP rank's experts by name):
    every rank's rollout tensors bit for bit, the bytes each receives exact, after an element-wise step too."""
    archs = {**{name: tiny_llama(**{**kw, "num_layers": 4}) for name, kw in MOE_KWARGS.items()},
             "moe-12-heads": tiny_llama(hidden_size=96, num_attention_heads=12, num_query_groups=12,
                                                     ffn_hidden_size=96, num_experts=6, moe_ffn_hidden_size=24,
                                                     make_vocab_size_divisible_by=12)}
    result = simulate_switch(archs[arch], training, RolloutLayout(*rollout), weight_mode=mode, switches=2,
                             update=_update, expert_parallel=experts, chunks=chunks)
    assert result.layout.exchange and result.experts.exchange
    assert check_switch(result) == []


def test_expert_biases_gathered_over_expert_parallel_ranks():
    """A routed expert's fc2 bias is replicated over expert TP but each expert's own: with e_g < e the micro-EP
    group must gather it from the other EP ranks (the plan once left it out, a KeyError at the first switch)."""
    arch = MOE_ARCHS["moe-biases-gelu-layernorm"]
    result = simulate_switch(arch, (1, 1, 2), RolloutLayout(1, 1, 1, 1), expert_parallel=(2, 1))
    assert check_switch(result) == []
    name = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.bias"
    rank0 = result.ranks[0]  # EP rank 0 holds experts 0 and 1; rolling out with e_g = 1 it holds all four
    assert name not in result.training_names(rank0) and torch.equal(rank0.rollout[name], result.full[name])


def _megatron_moe_table(arch_kw: dict) -> tuple[int, list]:
    from megatron.core import parallel_state as ps

    from megatron_hybrid.megatron.sharding import TPSpec

    model = tiny_llama(**arch_kw).build(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                        expert_tensor_parallel_size=1)
    return ps.get_expert_model_parallel_rank(), [(n, tuple(p.shape), TPSpec.of(p)) for n, p in
                                                 model.named_parameters()]


def test_the_moe_parameter_table_is_the_model_megatron_core_builds():
    """gpt_parameters of MoE models against megatron-core (TP 2, EP 2, expert TP 1 on two gloo ranks): each rank's
    names are the table's with its EP rank's experts (local index j is global index ep · E/e + j), in order, with
    the same attributes, dense tensors cut over TP and experts whole."""
    import re

    for name, kw in MOE_KWARGS.items():
        arch = MOE_ARCHS[name]
        table = gpt_parameters(arch, vocab_size=arch.padded_vocab_size(2))
        per = arch.num_experts // 2
        for tp_rank, (ep, built) in enumerate(run_distributed(_megatron_moe_table, 2, kw, tensor_model_parallel_size=2,
                                                              expert_model_parallel_size=2,
                                                              expert_tensor_parallel_size=1)):
            names = []
            for n, shape, spec in built:
                m = re.match(r"(.*\.local_experts\.)(\d+)(\..*)$", n)
                full = f"{m[1]}{ep * per + int(m[2])}{m[3]}" if m else n
                names.append(full)
                full_shape, want = table[full]
                assert spec == want, (name, full)
                assert shape == tuple(shard(torch.empty(full_shape), spec, *((0, 1) if m else (tp_rank, 2))).shape)
            one_stage = stage_names(list(table), stage=0, stages=1, num_layers=arch.num_layers,
                                    tied=not arch.untie_embeddings_and_output_weights)
            experts = [int(x[1]) if (x := re.search(r"local_experts\.(\d+)\.", n)) else None for n in one_stage]
            assert names == [n for n, j in zip(one_stage, experts) if j is None or j // per == ep], name


def _megatron_table(arch_kw: dict) -> list:
    """(name, shape, spec) of every parameter of the model megatron-core builds, on this TP rank."""
    from megatron_hybrid.megatron.sharding import TPSpec

    return [(n, tuple(p.shape), TPSpec.of(p)) for n, p in tiny_llama(**arch_kw).build().named_parameters()]


def test_the_parameter_table_is_the_model_megatron_core_builds():
    """gpt_parameters against megatron-core itself (TP 2, two gloo ranks): the same names in the same order, the
    same tensor-parallel attributes, and each rank's shape the table's full shape cut by the sharding function."""
    for name, kw in KWARGS.items():
        table = gpt_parameters(ARCHS[name], vocab_size=ARCHS[name].padded_vocab_size(2))
        one_stage = stage_names(list(table), stage=0, stages=1, num_layers=ARCHS[name].num_layers,
                                tied=not ARCHS[name].untie_embeddings_and_output_weights)
        for tp_rank, built in enumerate(run_distributed(_megatron_table, 2, kw, tensor_model_parallel_size=2)):
            assert [n for n, _, _ in built] == one_stage, name
            for n, shape, spec in built:
                full_shape, want = table[n]
                assert spec == want, (name, n)
                assert shape == tuple(shard(torch.empty(full_shape), spec, tp_rank, 2).shape), (name, n)


def test_a_gated_fc1_shard_is_its_gate_and_up_rows():
    spec = gpt_parameters(ARCHS["swiglu-rms-gqa"])["decoder.layers.0.mlp.linear_fc1.weight"][1]
    fc1 = torch.arange(192 * 4, dtype=torch.float32).view(192, 4)
    shards = [shard(fc1, spec, r, 2) for r in range(2)]
    gate, up = fc1.chunk(2)
    assert torch.equal(shards[1], torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
    assert torch.equal(unshard(shards, spec), fc1)


@pytest.mark.parametrize("training,rollout", PAIRS, ids=[f"{t}-{r}" for t, r in PAIRS])
def test_every_pair_with_fp8_rollout_weights(training, rollout):
    """FP8 rollout weights (canonical mode) over every pair, on the gated GQA model: rollout tensors and quantized
    weights exact (the other architectures in FP8: the FP8 property search of test_layout_space)."""
    try:
        validate(ARCHS["swiglu-rms-gqa"], training, RolloutLayout(*rollout), weight_mode="fp8")
    except ValueError as exc:
        pytest.skip(f"refused by the engine's validation: {exc}")
    result = simulate_switch(ARCHS["swiglu-rms-gqa"], training, RolloutLayout(*rollout), weight_mode="fp8",
                             switches=2, update=_update)
    assert result.ranks[0].fp8 and check_switch(result) == []


def test_fp8_rollout_weights_are_the_shards_quantization():
    """FP8 rollout weights (canonical mode): every dense linear weight of every rank quantized from its blocks as
    the engine does, bit for bit the format's quantization of the unsharded model's shard (written independently in
    the simulation); TP-sharded along dim 0 and dim 1 (row amaxes combined across blocks), SwiGLU's interleave."""
    result = simulate_switch(ARCHS["swiglu-rms-gqa"], (2, 2, 1), RolloutLayout(1, 1), weight_mode="fp8",
                             switches=2, update=_update)
    assert check_switch(result) == []
    quantized = result.ranks[0].fp8
    assert {n.rsplit(".", 2)[-2] for n in quantized} == {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}
    assert all(q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 for q, s in quantized.values())


def test_a_wrong_fp8_scale_is_found(monkeypatch):
    """The FP8 check can fail: a quantizer whose scales are off by one ulp is caught, by name."""
    import megatron_hybrid.simulate as simulate

    real = simulate.quantize_rows

    def off_by_one_ulp(blocks, out, scale):
        real(blocks, out, scale)
        scale.copy_(torch.nextafter(scale, torch.full_like(scale, float("inf"))))

    monkeypatch.setattr(simulate, "quantize_rows", off_by_one_ulp)
    result = simulate_switch(ARCHS["swiglu-rms-gqa"], (2, 1, 1), RolloutLayout(1, 1), weight_mode="fp8")
    faults = check_switch(result)
    assert faults and all("FP8" in f for f in faults)


def test_a_misplaced_block_is_found(monkeypatch):
    """The check can fail: a plan that loses fc1's interleave (its stride taken as 1) is caught, by name."""
    import megatron_hybrid.simulate as simulate

    def no_stride(members, needed, **kw):
        plan = build_group_plan(members, needed, **kw)
        sources = plan.sources

        def flat(member):
            out = sources(member)
            for src in out.values():
                src.stride = 1
            return out

        plan.sources = flat
        return plan

    monkeypatch.setattr(simulate, "build_group_plan", no_stride)
    result = simulate_switch(ARCHS["swiglu-rms-gqa"], (2, 1, 1), RolloutLayout(1, 1))
    faults = check_switch(result)
    assert faults and all("linear_fc1.weight differs" in f for f in faults)


@pytest.mark.parametrize("kwargs,match", [
    (dict(weight_mode="fp4"), r"weight_mode \('fp4'\) must be one of \('aliased', 'canonical', 'fp8'\)"),
    # MoE: what the engine refuses (check_experts) and what megatron-core cannot build.
    (dict(arch=tiny_llama(num_experts=4, moe_ffn_hidden_size=32), rollout=RolloutLayout(1, 4, 1, 2)),
     r"rollout expert_tensor_parallel_size \(2\) × rollout expert_model_parallel_size \(1\) must divide a rollout "
     r"stage's ranks \(1\)"),
    (dict(arch=tiny_llama(num_experts=4, moe_ffn_hidden_size=32, add_bias_linear=True), training=(1, 2, 2),
          expert_parallel=(2, 1), rollout=RolloutLayout(2, 1, 1, 2)),
     r"rollout tensor_model_parallel_size \(2\) > tensor_model_parallel_size \(1\)"),
    (dict(arch=tiny_llama(num_experts=4, moe_ffn_hidden_size=32, add_bias_linear=True), training=(2, 1, 2),
          expert_parallel=(2, 1), rollout=RolloutLayout(2, 2, 1, 2)),
     r"rollout expert_tensor_parallel_size \(2\) must be 1 for a model with biases"),
    (dict(arch=tiny_llama(num_experts=4, moe_ffn_hidden_size=32), training=(1, 2, 2), rollout=RolloutLayout(2, 2),
          expert_parallel=(2, 1)), r"rollout tensor_model_parallel_size \(2\) > tensor_model_parallel_size \(1\) "
                                   r"is not supported for MoE models"),
    (dict(arch=tiny_llama(num_experts=4, moe_ffn_hidden_size=32, num_layers=2, moe_layer_freq=[1, 0])),
     r"moe_layer_freq \(\[1, 0\]\) gives the pipeline stages 0-1 different layers"),
    (dict(arch=tiny_llama(num_experts=4, moe_ffn_hidden_size=32, add_bias_linear=True), expert_parallel=(2, 1),
          rollout=RolloutLayout(1, 1, 1, 2)),
     r"rollout expert_tensor_parallel_size \(2\) must divide expert_tensor_parallel_size \(1\)"),
    (dict(arch=tiny_llama(num_experts=4, moe_ffn_hidden_size=32, add_bias_linear=True)),
     r"add_bias_linear with experts needs expert_tensor_parallel_size 1 \(got 2\)"),
    (dict(arch=tiny_llama(num_experts=4, moe_ffn_hidden_size=32), expert_parallel=(4, 2)),
     r"expert_model_parallel_size \(4\) × expert_tensor_parallel_size \(2\) = 8 must divide "
     r"tensor_model_parallel_size \(2\) × data_parallel_size \(1\) = 2: the ranks of a pipeline stage"),
    (dict(expert_parallel=(2, 1)), r"expert_parallel \(\(2, 1\)\) needs a model with experts"),
    # The engine's own checks (validation.check_model), and megatron-core's for the training model:
    (dict(arch=tiny_llama(num_layers=3)), r"pipeline_model_parallel_size \(2\) must divide num_layers \(3\)"),
    (dict(arch=tiny_llama(vocab_size=250, make_vocab_size_divisible_by=1), training=(2, 1, 2),
          rollout=RolloutLayout(4, 1)), r"rollout tensor_model_parallel_size \(4\) must divide the padded "
                                        r"vocabulary \(250\)"),
    (dict(arch=tiny_llama(num_query_groups=1)), r"tensor_model_parallel_size \(2\) must divide num_query_groups"),
    # An exchange pair whose rollout TP divides the heads but not the query groups (the rollout model's build
    # would fail on megatron-core's assertion, after the engine's first collectives):
    (dict(arch=tiny_llama(hidden_size=96, num_attention_heads=12, num_query_groups=4), training=(4, 1, 3),
          rollout=RolloutLayout(3, 1)), r"rollout tensor_model_parallel_size \(3\) must divide num_query_groups "
                                        r"\(4\)"),
    (dict(training=[2, 2, 1]), r"training \(\[2, 2, 1\]\) must be a \(t, p, d\) tuple"),
    (dict(chunks=2, training=(2, 1, 2)), r"virtual pipeline chunks \(2\) need pipeline_model_parallel_size \(1\)"),
    (dict(chunks=0), r"chunks \(0\) must be a positive integer"),
])
def test_what_it_cannot_simulate_is_refused(kwargs, match):
    args = dict(arch=tiny_llama(), training=(2, 2, 1), rollout=RolloutLayout(1, 1))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        simulate_switch(args.pop("arch"), args.pop("training"), args.pop("rollout"), **args)
