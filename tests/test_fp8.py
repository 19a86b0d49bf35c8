"""FP8 rollout weights (``HybridEngine(..., rollout_weights="fp8")``, ``--rollout-fp8``) on CPU/gloo.

The quantization against an independent plain-torch one, bit for bit (values and scales); the FP8 rollout weights
after every switch and after an optimizer step against the unsharded weights' quantization, bit for bit; the FP8
rollout model's logits against an unsharded plain-torch FP8 model and the training-dtype model; FP8 memory backed
only while rolling out; greedy generation; the errors before any collective; the recipe with ``--rollout-fp8``.
"""

from __future__ import annotations

import argparse
import functools
import types

import pytest
import torch

from megatron_hybrid.quant.fp8 import (FP8_DTYPE, fp8_linear, fp8_linear_reference, is_target, layers_in_bf16,
                                       quantize_reference, quantize_rows)
from megatron_hybrid.reshard.aliased import Blocks
from tests import fp8_cases, ppo_cases
from tests.harness import run_distributed


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == FP8_DTYPE and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---- the quantization, pure --------------------------------------------------------------------------------------
def _shards(full: torch.Tensor, k: int, dim: int, stride: int) -> list[torch.Tensor]:
    """Megatron's k TP shards of ``full`` (shard j: pieces j, j + k, ... of stride·k along ``dim``), as views of one
    buffer in an order of their own: the binding's blocks are views of slots, not of the canonical tensor."""
    pieces = full.chunk(stride * k, dim=dim)
    shards = [torch.cat([pieces[j + s * k] for s in range(stride)], dim=dim) for j in range(k)]
    buffer = torch.cat([s.flatten() for s in reversed(shards)])  # shard 0 last in the buffer
    out, end = [], buffer.numel()
    for s in shards:
        out.append(buffer[end - s.numel(): end].view(s.shape))
        end -= s.numel()
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape, k, dim, stride", [
    ((12, 40), 2, 0, 1),   # column-parallel (QKV): whole rows per shard
    ((21, 8), 3, 0, 1),    # an odd row count
    ((24, 10), 3, 0, 2),   # SwiGLU's fc1: [gate_j; up_j] per shard, [gate_0 … gate_2; up_0 … up_2] in the rollout
    ((9, 36), 4, 1, 1),    # row-parallel (attention output, fc2): every row split over the shards
    ((7, 33), 3, 1, 1),    # odd rows and columns
    ((5, 16), 1, 0, 1),    # one view: the rollout tensor is a training tensor
], ids=["dim0", "dim0-odd", "stride2", "dim1", "dim1-odd", "one"])
def test_quantize_rows_equals_reference_bit_for_bit(shape, k, dim, stride, dtype):
    g = torch.Generator().manual_seed(sum(shape) + k)
    full = (torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[0]).unsqueeze(1)).to(dtype)
    full[1] = 0  # a zero row: scale 1, zeros
    full[-1, ::3] = 0
    full[0, 0] = 448.0 * 3  # one large value: the row's scale > 1
    blocks = Blocks(_shards(full, k, dim, stride), dim, stride)
    assert torch.equal(blocks.materialize(), full)
    q = torch.full(shape, float("nan")).to(FP8_DTYPE)
    scale = torch.full((shape[0],), float("nan"))
    quantize_rows(blocks, q, scale)
    want_q, want_scale = quantize_reference(full)
    assert _same_bits(q, want_q) and torch.equal(scale, want_scale)
    assert scale[1] == 1.0 and not q[1].float().any()
    # The format itself: |w / s| <= 448 fits e4m3 (no NaN); dequantized within e4m3's half-ulp (2^-4 relative,
    # subnormals aside) of the weight.
    assert not q.float().isnan().any()
    deq = q.float() * scale.unsqueeze(1)
    assert ((deq - full.float()).abs() <= full.float().abs() / 16 + scale.unsqueeze(1) * 2.0 ** -9).all()


@pytest.mark.parametrize("step_numel", [1 << 24, 17], ids=["one-step", "rows-per-step"])
def test_quantize_rows_writes_strided_outputs(step_numel, monkeypatch):
    """A dim-1 split written into column slices of the output (the binding's FP8 tensor is contiguous; the pieces'
    columns are not); also a few rows per step, as a large weight is quantized (bounded temporaries)."""
    from megatron_hybrid.quant import fp8

    monkeypatch.setattr(fp8, "_STEP_NUMEL", step_numel)
    full = torch.randn(11, 20, generator=torch.Generator().manual_seed(3))
    for blocks in (Blocks([full[:, :7], full[:, 7:12], full[:, 12:]], 1, 1), Blocks([full[:4], full[4:]], 0, 1)):
        q, scale = torch.empty(11, 20, dtype=FP8_DTYPE), torch.empty(11)
        quantize_rows(blocks, q, scale)
        want_q, want_scale = quantize_reference(full)
        assert _same_bits(q, want_q) and torch.equal(scale, want_scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("lead, k, n", [((3, 2), 32, 16), ((5, 1), 17, 9), ((1, 1), 64, 96)],
                         ids=["SBK", "odd", "one-token"])
def test_fp8_linear_matches_plain_torch(lead, k, n, dtype):
    """One FP8 linear (torch._scaled_mm, row-wise scales: CPU torch 2.13 takes any shape) against dequantize-then-
    matmul in fp32: the same quantized operands, so only the GEMM's fp32 summation order differs (~1e-6 relative);
    bf16 output: within one rounding of it."""
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(*lead, k, generator=g).to(dtype)
    x[0, 0] = 0  # a zero token: scale 1
    w_q, w_scale = quantize_reference(torch.randn(n, k, generator=g))
    bias = torch.randn(n, generator=g).to(dtype)
    got, want = fp8_linear(x, w_q, w_scale, bias), fp8_linear_reference(x, w_q, w_scale, bias)
    assert got.dtype == dtype and got.shape == (*lead, n)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(got, want, **tol)
    # And against the unquantized product: FP8's error, ~2^-4 relative per operand, averaged over k terms.
    exact = torch.nn.functional.linear(x.float(), w_q.float() * w_scale.unsqueeze(1)) + bias.float()
    assert (got.float() - exact).norm() <= 0.1 * exact.norm()


def test_offered_quantization_is_taken_only_for_its_own_input():
    """An FP8 linear given the very input a fused kernel quantized ahead (``Fp8Table.offered``) multiplies those
    bits (the same result as quantizing it again), and nothing else: another tensor, a view of a part, or outside
    the offer quantizes its own input."""
    from megatron_hybrid.quant.fp8 import Fp8Table, quantize_activations

    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 1, 32, generator=g).to(torch.bfloat16)
    w_q, w_scale = quantize_reference(torch.randn(16, 32, generator=g))
    table = Fp8Table()
    x_q, x_scale = quantize_activations(x.reshape(-1, 32))
    assert table.quantized(x) is None
    with table.offered(x, x_q, x_scale):
        assert table.quantized(x) == (x_q, x_scale)
        assert table.quantized(x.clone()) is None and table.quantized(x[:2]) is None
        assert torch.equal(fp8_linear(x, w_q, w_scale, quantized=table.quantized(x)), fp8_linear(x, w_q, w_scale))
        # Bits that are not x's quantization are what the linear multiplies: the offer is taken, not checked.
        zeros = (torch.zeros_like(x_q), x_scale)
        assert not fp8_linear(x, w_q, w_scale, quantized=zeros).any()
    assert table.quantized(x) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("m, k, n", [(64, 576, 3072), (64, 1536, 576), (1, 576, 960), (7, 17, 9)],
                         ids=["fc1", "fc2", "one-token", "odd"])
def test_fp8_linear_cpu_operand_is_scaled_mm_bit_for_bit(m, k, n, dtype):
    """CPU: the kept dequantized operand (what CPU torch's emulated _scaled_mm builds at every call) gives the same
    bits as _scaled_mm; the decode shapes of SmolLM2-135M (M = 64 tokens) and odd ones."""
    from megatron_hybrid.quant.fp8 import dequantized_operand

    g = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(2, m, k, generator=g).to(dtype)
    x[0, 0] = 0
    w_q, w_scale = quantize_reference(torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n).unsqueeze(1))
    bias = torch.randn(n, generator=g).to(dtype)
    operand = dequantized_operand(w_q, w_scale)
    assert operand.dtype == torch.float32 and operand.shape == (k, n) and operand.is_contiguous()
    got = fp8_linear(x, w_q, w_scale, bias, dequantized_KN=operand)
    want = fp8_linear(x, w_q, w_scale, bias)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)


def test_fp8_table_keeps_cpu_operands_until_dropped():
    from megatron_hybrid.quant.fp8 import Fp8Table, dequantized_operand

    table, param = Fp8Table(), torch.empty(0)
    w_q, w_scale = quantize_reference(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)))
    table.set(param, w_q, w_scale)
    first = table.cpu_operand(param)
    assert torch.equal(first, dequantized_operand(w_q, w_scale)) and table.cpu_operand(param) is first
    new_q, new_scale = quantize_reference(torch.randn(6, 4, generator=torch.Generator().manual_seed(1)))
    w_q.copy_(new_q)  # a refill: the FP8 tensors change in place
    w_scale.copy_(new_scale)
    assert table.cpu_operand(param) is first  # kept until dropped: the binding's refill drops them
    table.drop_operands()
    assert torch.equal(table.cpu_operand(param), dequantized_operand(new_q, new_scale))
    table.cache_cpu_operands = False
    assert table.cpu_operand(param) is None
    del table.cache_cpu_operands
    table.clear()
    assert table.get(param) is None and not table._operands


def test_targets_are_the_dense_layers_linear_weights():
    assert all(is_target(f"decoder.layers.3.{n}.weight") for n in (
        "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"))
    assert not any(is_target(n) for n in (
        "embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight",
        "decoder.layers.0.self_attention.linear_qkv.bias", "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.1.mlp.router.weight",
        "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight",
        "decoder.layers.1.mlp.shared_experts.linear_fc2.weight"))


def test_first_last_layers_bf16_keep_their_weights():
    """Megatron's first_last_layers_bf16 (TransformerConfig) names the layers at either end whose rollout weights
    stay in the training dtype; global names count layers model-wide."""
    names = [f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(5)]
    assert [is_target(n, layers=range(1, 5 - 2)) for n in names] == [False, True, True, False, False]
    assert all(is_target(n) for n in names)
    assert not is_target("decoder.layers.2.mlp.linear_fc1.bias", layers=range(1, 5 - 2))
    config = types.SimpleNamespace(first_last_layers_bf16=True, num_layers_at_start_in_bf16=2,
                                   num_layers_at_end_in_bf16=1)
    assert layers_in_bf16(config) == (2, 1)
    config.first_last_layers_bf16 = False
    assert layers_in_bf16(config) == (0, 0)


# ---- the engine on gloo ranks ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _references(arch_items: tuple, rollout_tp: int, bf16_layers: tuple = (0, 0)):
    return run_distributed(fp8_cases.references, 1, dict(arch_items), rollout_tp, bf16_layers)[0]


# (t, p, d) -> (t_g, p_g): a micro-DP gather with QKV stacked and fc1 strided (own regions; greedy generation too),
# merged stages in bf16, TP widened (sub-blocks of the own shard), an exchange layout (p_g > p), and Megatron's
# first_last_layers_bf16 (the first and last layers keep bf16 rollout weights) on merged stages.
LAYOUTS = [
    pytest.param({"num_layers": 2}, ((2, 1, 2), (1, 1)), dict(own_region_min_numel=1024, generate=True),
                 id="t2d2-tg1-own-regions", marks=pytest.mark.slow),
    pytest.param({"num_layers": 2, "params_dtype": "bfloat16"}, ((2, 2, 1), (1, 1)), {}, id="t2p2-tg1-bf16",
                 marks=pytest.mark.slow),
    pytest.param({"num_layers": 2, "add_bias_linear": True}, ((1, 1, 2), (2, 1)), {}, id="t1d2-tg2-bias",
                 marks=pytest.mark.slow),
    pytest.param({"num_layers": 2}, ((2, 1, 2), (1, 2)), {}, id="t2d2-pg2-exchange", marks=pytest.mark.slow),
    # The fast tier's FP8 switch.
    pytest.param({"num_layers": 4, "params_dtype": "bfloat16"}, ((1, 2, 1), (1, 1)), dict(bf16_layers=(1, 2)),
                 id="p2-pg1-first-last-layers-bf16"),
]


@pytest.mark.parametrize("arch_kw, layout, kwargs", LAYOUTS)
def test_fp8_rollout_weights(arch_kw, layout, kwargs):
    (t, p, d), (t_g, p_g) = layout
    bf16_layers = kwargs.get("bf16_layers", (0, 0))
    state, new_state, logits, fp8_logits = _references(tuple(sorted(arch_kw.items())), t_g, bf16_layers)
    fp8_layers = arch_kw["num_layers"] - sum(bf16_layers)
    runs = run_distributed(fp8_cases.fp8_engine_case, t * p * d, arch_kw, t_g, p_g, state, new_state,
                           tensor_model_parallel_size=t, pipeline_model_parallel_size=p, **kwargs)
    bf16 = arch_kw.get("params_dtype") == "bfloat16"
    seen_logits = 0
    for rank, r in enumerate(runs):
        for i, phase in enumerate(("first", "second")):
            obs = r[phase]
            # After every switch, also after an SGD step: bit for bit the quantization of the unsharded weights'
            # rollout shard, scales included, for every QKV / proj / fc1 / fc2 of the rank's rollout stage.
            # With first_last_layers_bf16, exactly the other layers' weights are FP8.
            assert obs["mismatches"] == [] and obs["compared"] == 4 * fp8_layers // p_g, \
                (rank, phase, obs["mismatches"], obs["compared"])
            # FP8 memory: exactly the FP8 tensors and scales while rolling out (pages: resident), none while
            # training.
            rolling, training = obs["rolling"], obs["training"]
            assert rolling["fp8_bytes_mapped"] == r["first"]["fp8_needed"] > 0, (rank, rolling)
            assert rolling["fp8_resident"] >= rolling["fp8_bytes_mapped"]
            assert training == {"fp8_bytes_mapped": 0, "canonical_bytes_mapped": 0, "fp8_resident": 0,
                                "operands": 0}, training
            # CPU: every FP8 linear kept its dequantized operand from its first call after the switch (the second
            # phase's were rebuilt from the stepped weights: the logits below), and the forward equals, bit for
            # bit, the one with torch._scaled_mm at every call.
            assert obs["operands"] == obs["compared"] and obs["same_as_scaled_mm"], (rank, phase)
            # The peak of the switch holds the peers' slots the quantization reads, given back once read.
            assert rolling["switch_peak_bytes_mapped"] == (rolling["fp8_bytes_mapped"]
                                                           + rolling["canonical_bytes_mapped"]
                                                           + rolling["peer_bytes_mapped"]
                                                           + rolling["transient_bytes_released"]), rolling
            if obs["logits"] is not None:
                seen_logits += 1
                # The unsharded plain-torch FP8 model quantizes the same operands (the FP8 weights equal bit for
                # bit; activations per token, per TP slice for row-parallel inputs as the rollout ranks do): only the
                # GEMMs' fp32 summation order and the TP all-reduce differ, ~1e-6 relative (bf16: one rounding of a
                # bf16 hidden state), which may flip a rare activation's FP8 rounding. 0.0 on this machine in fp32.
                tol = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(obs["logits"], fp8_logits[i], **tol)
                # Against the training-dtype model: FP8's error, 2^-4 relative rounding per weight and activation
                # averaged over each dot product (measured 0.04-0.07 of the logits' norm in these models).
                assert (obs["logits"] - logits[i]).norm() <= 0.15 * logits[i].norm(), (rank, phase)
                assert (obs["logits"] - logits[i]).abs().max() > 1e-3  # and it is FP8, not the training dtype
        # Bound once: every FP8 tensor and scale stays at its address across switches and the optimizer step.
        assert r["first"]["addresses"] == r["second"]["addresses"], rank
        assert r["first"]["layers_in_bf16"] == list(bf16_layers)
    assert seen_logits >= 2
    if kwargs.get("own_region_min_numel"):
        # fc1 was gathered straight into its rollout layout (a strided region): read once by the quantization, then
        # released with the other transient ranges.
        assert all(r["first"]["strided"] for r in runs)
    if kwargs.get("generate"):
        # Greedy generation through the FP8 engine: the same tokens and log-probs call after call, and on every
        # rank of a training DP replica (each returns its prompts' results).
        for r in runs:
            first, again = r["generated"]
            assert first == again and all(len(tokens) == fp8_cases.NEW_TOKENS for tokens in first[0])
        assert runs[0]["generated"][0] == runs[1]["generated"][0]


# ---- errors before any collective --------------------------------------------------------------------------------
def test_bad_fp8_inputs_fail_before_any_collective():
    messages = run_distributed(fp8_cases.bad_inputs_case, 2, tensor_model_parallel_size=2)[0]
    assert messages == [
        "rollout_weights ('fp16') must be one of ('model', 'fp8')",
        "rollout_weights='fp8' needs weight_mode='canonical' (FP8 rollout weights are tensors rebuilt at every "
        "switch; weight_mode='aliased' computes on the training shards)",
        # (the CPU model's capability lookup answers 8.0 here; test_fp8_device_check names a CUDA device)
        "rollout_weights='fp8' needs FP8 tensor cores (compute capability ≥ 8.9), but the model's device cpu "
        "has compute capability 8.0; use rollout_weights='model'",
        "rollout_weights='fp8' cannot run decoder.layers.0.self_attention.linear_qkv.weight (OtherLinear) in FP8: "
        "only megatron-core's local-spec ColumnParallelLinear / RowParallelLinear have FP8 twins; use "
        "rollout_weights='model'",
        "the model's config keeps layers in bf16 under rollout_weights='fp8' (first_last_layers_bf16), but "
        "num_layers_at_start_in_bf16 (4) and num_layers_at_end_in_bf16 (1) must be integers ≥ 0 that sum to at "
        "most num_layers (4)",
    ]


def test_fp8_device_check():
    from megatron_hybrid.validation import check_fp8_device

    for capability in ((8, 9), (9, 0), (10, 0), None):  # Ada, Hopper, Blackwell; a CPU
        check_fp8_device(torch.device("cuda:1" if capability else "cpu"), capability)
    with pytest.raises(ValueError, match=r"device cuda:1 has compute capability 8\.6"):
        check_fp8_device(torch.device("cuda:1"), (8, 6))


def _validate(*argv: str) -> argparse.Namespace:
    from megatron_hybrid.rl.arguments import add_hybrid_args, add_megatron_args, validate_args

    args = add_hybrid_args(add_megatron_args(argparse.ArgumentParser())).parse_args(argv)
    validate_args(args, 4)
    return args


def test_recipe_flag_needs_the_canonical_engine():
    assert _validate("--rollout-fp8", "--hybrid-weight-mode", "canonical").rollout_fp8
    with pytest.raises(ValueError, match=r"--rollout-fp8 needs --hybrid-weight-mode canonical \(got "
                                         r"--hybrid-weight-mode aliased\)"):
        _validate("--rollout-fp8")
    with pytest.raises(ValueError, match="--rollout-fp8 needs the HybridEngine's rollout"):
        _validate("--rollout-fp8", "--hybrid-weight-mode", "canonical", "--no-hybrid-rollout")


def test_recipe_first_last_layers_bf16_flags():
    from megatron_hybrid.rl import rollout_fp8_config

    fp8 = ("--rollout-fp8", "--hybrid-weight-mode", "canonical")
    args = _validate(*fp8, "--num-layers", "4", "--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "2")
    assert rollout_fp8_config(args) == dict(first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
                                            num_layers_at_end_in_bf16=2)
    assert rollout_fp8_config(_validate(*fp8)) == {}
    with pytest.raises(ValueError, match="--first-last-layers-bf16 needs --rollout-fp8"):
        _validate("--first-last-layers-bf16")
    with pytest.raises(ValueError, match=r"--num-layers-at-start-in-bf16 \(-1\) and --num-layers-at-end-in-bf16 "
                                         r"\(1\) must be ≥ 0"):
        _validate(*fp8, "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "-1")


@pytest.mark.slow
def test_recipe_generates_with_fp8_and_measures_the_gap(tmp_path):
    # 2 ranks: training TP=2, rollout TP=1 in FP8. The rollout log-probs come from the FP8 model, the actor's from
    # the training dtype (fp32): rollout_mismatch/* shows the gap that fp32 alone keeps below 1e-5
    # (test_ppo.test_metrics_timing_mismatch_and_tensorboard), and TIS runs on it.
    argv = ["--train-iters", "2", "--hybrid-weight-mode", "canonical", "--rollout-fp8", "--tis-imp-ratio-cap", "2"]
    history = run_distributed(ppo_cases.run_main, 2, argv, str(tmp_path / "logs"), tensor_model_parallel_size=2)[0]
    for m in history:
        assert m["switch_bytes"] > 0 and "tis_capfrac" in m
        # Measured: mean 0.004, max 0.03; per-token ratios within 3 % of 1, which the cap of 2 never reaches.
        assert 1e-4 < m["rollout_mismatch/logp_abs_diff_mean"] <= m["rollout_mismatch/logp_abs_diff_max"] < 0.2, m
        assert 0.8 < m["rollout_mismatch/ratio_min"] <= m["rollout_mismatch/ratio_max"] < 1.25, m
