"""megatron_hybrid.rl: one update through Megatron's optimizer equals an fp64 AdamW step (TP=2 × PP=2 × DP=2, tied
embeddings, bf16 parameters with fp32 main parameters), its states leave the device and come back bit for bit, and
the CPU patch that lets its optimizer run on CPU; activation recompute (Megatron-LM's flags) keeps the loss and the
gradients and saves the activations."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_hybrid.rl.arguments import TINY_MODEL
from tests import rl_cases
from tests.harness import run_distributed

TIED = "embedding.word_embeddings.weight"
# fp32 Adam against the fp64 reference, per update: the parameter rounds to fp32 once or twice (2^-22 relative;
# for the norms' weights near 1 that is most of the difference, measured ≤ 1.1e-7 after two updates), and the fp32
# update (≤ lr = 0.01, its moments, square root and clip coefficient each ~1e-7 relative) adds ≤ 1e-8 (measured
# 2.5e-9). A wrong learning rate, clip or decay moves parameters by ~1e-4.
MAIN_RTOL, MAIN_ATOL = 2.0 ** -22, 1e-8


def test_cpu_gloo_reports_cuda_type_names():
    from megatron_hybrid.megatron.patches import cpu_gloo

    t = torch.zeros(2, dtype=torch.bfloat16)
    with cpu_gloo():
        assert t.type() == "torch.cuda.BFloat16Tensor" and t.float().type() == "torch.cuda.FloatTensor"
        assert t.type(torch.float32).dtype == torch.float32  # a conversion stays a conversion
    assert t.type() == "torch.BFloat16Tensor"


def _flag(name: str) -> str:
    flags = rl_cases.OPTIMIZER_FLAGS
    return flags[flags.index(name) + 1]


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -126))) - 7)


@pytest.mark.slow
def test_update_equals_fp64_adamw_step():
    runs = run_distributed(rl_cases.optimizer_step_case, 8, tensor_model_parallel_size=2,
                           pipeline_model_parallel_size=2)
    lr, min_lr = float(_flag("--lr")), float(_flag("--min-lr"))
    warmup, clip, wd = int(_flag("--lr-warmup-iters")), float(_flag("--clip-grad")), float(_flag("--weight-decay"))
    beta1, beta2, eps = 0.9, float(_flag("--adam-beta2")), float(_flag("--adam-eps"))
    # The schedule's rate one iteration into the warmup (linear from 0), then at the end of the cosine decay.
    expected_lrs = [lr * 1 / warmup, min_lr]
    updates = runs[0]
    for r in runs[1:]:  # every rank of every DP replica gathered the same full tensors
        for mine, theirs in zip(r, updates):
            assert all(torch.equal(mine[k][n], theirs[k][n]) for k in ("grads", "main", "main_after", "bf16_after")
                       for n in theirs[k])
    names = [n for n in updates[0]["grads"] if not n.startswith("tied:")]
    assert TIED in names and "output_layer.weight" not in names  # tied: the last stage holds a copy
    params = {n: updates[0]["main"][n].double() for n in names}
    m = {n: torch.zeros_like(p) for n, p in params.items()}
    v = {n: torch.zeros_like(p) for n, p in params.items()}
    for t, (u, rate) in enumerate(zip(updates, expected_lrs), start=1):
        assert u["lr"] == rate
        # The last stage's copy of the tied embedding got the same (summed) gradient and stays equal.
        for k in ("grads", "main", "main_after", "bf16_after"):
            assert torch.equal(u[k]["tied:output_layer.weight"], u[k][TIED]), k
        grads = {n: u["grads"][n].double() for n in names}
        norm = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
        twice = math.sqrt(norm ** 2 + float(grads[TIED].square().sum()))
        # fp32 sums of ~10^5 squares in another order: ~1e-6 relative; counting the tied weight twice is off by
        # more than 10 % here.
        assert math.isclose(u["grad_norm"], norm, rel_tol=1e-5), (u["grad_norm"], norm, twice)
        assert not math.isclose(u["grad_norm"], twice, rel_tol=1e-2)
        assert norm > clip  # the clip bites
        coeff = min(1.0, clip / (norm + 1e-6))
        for n in names:
            g = grads[n] * coeff
            decay = wd if params[n].dim() > 1 and not n.endswith(".bias") else 0.0  # Megatron: none on biases, norms
            m[n] = beta1 * m[n] + (1 - beta1) * g
            v[n] = beta2 * v[n] + (1 - beta2) * g * g
            step = (m[n] / (1 - beta1 ** t)) / ((v[n] / (1 - beta2 ** t)).sqrt() + eps)
            params[n] = params[n] * (1 - rate * decay) - rate * step
        for n in names:
            main, bf16, ref = u["main_after"][n], u["bf16_after"][n], params[n]
            # fp32 main parameters: Adam in fp32 against fp64 (see MAIN_RTOL, MAIN_ATOL).
            torch.testing.assert_close(main.double(), ref, rtol=MAIN_RTOL, atol=MAIN_ATOL, msg=n)
            # bf16 parameters: Megatron's round-to-nearest copy of the fp32 main parameters, hence within one bf16
            # ulp of the fp64 reference (plus the fp32 difference above, for values near a rounding boundary).
            assert torch.equal(bf16, main.to(torch.bfloat16)), n
            assert ((bf16.double() - ref).abs() <= _bf16_ulp(ref) + MAIN_ATOL + MAIN_RTOL * ref.abs()).all(), n
        if t < len(updates):  # the next update starts from these main parameters
            assert all(torch.equal(updates[t]["main"][n], u["main_after"][n]) for n in names)


def test_megatron_optimizers_offload_bit_for_bit():
    for r in run_distributed(rl_cases.offload_case, 2, tensor_model_parallel_size=2):
        for name, rep in r.items():
            # Adam's two moments per parameter and every fp32 main parameter, off the device while rolling out;
            # the bf16 model parameters (which the rollout reads) stay.
            assert rep["num_mains"] > 0 and rep["num_states"] == 2 * rep["num_mains"], (name, rep)
            assert rep["resident"] == 0 and rep["params_there"] and rep["same"], (name, rep)


def test_the_update_trains_an_moe_model_with_its_load_balancing_loss():
    """Issue 24: megatron-core's routers add the load-balancing loss (MoEAuxLossAutoScaler) in training mode only;
    rl.update puts the model there (it was left in eval mode), the loss's gradient is coefficient × the same loss
    (0 without it), and the loss is reported under Megatron-LM's name."""
    off, one, two = (run_distributed(rl_cases.moe_aux_loss_case, 1, coeff)[0] for coeff in (0.0, 0.01, 0.02))
    assert off["aux"] == {} and off["grad_norm"] == 0.0
    assert set(one["aux"]) == {"load_balancing_loss"}
    # Reported unscaled by the coefficient (coefficient × loss / coefficient: equal up to fp32 rounding).
    assert two["aux"]["load_balancing_loss"] == pytest.approx(one["aux"]["load_balancing_loss"], rel=1e-6)
    assert 0.5 < one["aux"]["load_balancing_loss"] < 4  # 1 when balanced (megatron-core's normalisation), ≤ E/k
    assert one["grad_norm"] > 0 and sorted(one["router_grads"]) == sorted(two["router_grads"])
    for name, grad in one["router_grads"].items():
        assert grad.abs().max() > 0, name
        # The same forward, the loss scaled by 2: the gradient doubles up to fp32 rounding (≤ 1 ulp per sum).
        torch.testing.assert_close(two["router_grads"][name], 2 * grad, rtol=1e-6, atol=1e-9)


def test_the_step_objective_is_the_token_mean_however_sequences_are_grouped():
    """Issue 44, step 2: the policy's loss is the mean over every response token of the step (verl's token-mean),
    so splitting the same 8 sequences (1 to 8 response tokens each) into micro-batches of 1 on 2 data-parallel
    ranks, or of 2 on one, gives the gradient of one micro-batch holding them all."""
    whole = run_distributed(rl_cases.token_mean_gradient_case, 1, 8)[0]
    assert whole["tokens"] == [sum(whole["tokens"])] and len(whole["nll"]) == 1
    for world, micro_batch_size in ((2, 1), (1, 2)):
        runs = run_distributed(rl_cases.token_mean_gradient_case, world, micro_batch_size)
        tokens = [n for r in runs for n in r["tokens"]]
        nll = [x for r in runs for x in r["nll"]]
        assert sum(tokens) == whole["tokens"][0] and len(set(tokens)) > 1  # unequal micro-batches
        # The mean of the micro-batches' means, the aggregation before, is another objective here (its value ~6e-4
        # relative off for this near-uniform NLL; its gradient weighs a token by 1 / its micro-batch's tokens).
        assert abs(sum(nll) / len(nll) - whole["nll"][0]) > 1e-4 * abs(whole["nll"][0])
        assert math.isclose(sum(r["mean_nll"] * sum(r["tokens"]) for r in runs) / sum(tokens), whole["nll"][0],
                            rel_tol=1e-6)
        for r in runs:
            for name, grad in whole["grads"].items():
                # fp32 sums of the same per-token terms in another order (micro-batches, then the DP all-reduce):
                # ~1e-7 relative of the gradient's scale.
                torch.testing.assert_close(r["grads"][name], grad, rtol=1e-5, atol=1e-6 * float(grad.abs().max()),
                                           msg=f"{name} at world {world}, micro-batch {micro_batch_size}")


# ---- activation recompute (--recompute-granularity, issue 44 step 5) -------------------------------------------
@pytest.mark.parametrize("backend", ["local", "sdpa"])
def test_activation_recompute_keeps_the_numbers_and_saves_the_activations(backend):
    """Megatron-LM's activation recompute through rl.build_stage's config: one forward + backward of a 4-layer GPT
    with full recompute (uniform chunks of 1 and 4 layers, block of 2) and selective recompute gives the loss and
    gradients of the model without it, bit for bit: the checkpointed layers rerun the same CPU kernels on the same
    inputs (and RNG states), and each parameter's gradient is accumulated from the same terms. The no-grad forward
    in training mode (the log-prob passes) and in eval mode (generation) give the same logits too. What autograd
    keeps for the backward drops to the checkpointed chunks' inputs."""
    r = run_distributed(rl_cases.recompute_case, 1, backend)[0]
    L, B, S = rl_cases.RECOMPUTE_LAYERS, rl_cases.RECOMPUTE_BATCH, rl_cases.PROMPT + rl_cases.NEW
    assert r["none"]["config"] == (None, None, None)
    for name, overrides in rl_cases.RECOMPUTE.items():
        granularity, method, n = r[name]["config"]
        assert (granularity, method, n) == tuple(overrides.get(k) for k in (
            "recompute_granularity", "recompute_method", "recompute_num_layers")), name
        assert r[name]["runs"].keys() == r["none"]["runs"].keys() == ({"padded"} if backend == "local" else
                                                                      {"padded", "packed"})
        for kind, ref in r["none"]["runs"].items():
            got = r[name]["runs"][kind]
            assert torch.equal(got["loss"], ref["loss"]), (name, kind)
            assert got["grads"].keys() == ref["grads"].keys()
            for param, grad in ref["grads"].items():
                assert torch.equal(got["grads"][param], grad), (name, kind, param)
            for logits in ("train_logits", "eval_logits"):
                assert torch.equal(got[logits], ref[logits]), (name, kind, logits)
            # Memory. Without recompute every layer keeps its activations, the same bytes per layer. Full
            # recompute: a recomputed layer keeps nothing (it runs under no_grad in the forward) and its chunk keeps
            # its input ([s, b, h] fp32: hidden_bytes) and the rotary table (shared by the chunks, smaller than an
            # input); the rest of the model keeps what it kept.
            per_layer, outside = ref["saved_in_layers"] / L, ref["saved"] - ref["saved_in_layers"]
            if granularity == "full":
                recomputed, chunks = (L, -(-L // n)) if method == "uniform" else (n, n)
                assert got["saved_in_layers"] == (L - recomputed) * per_layer, (name, kind)
                inputs = got["saved"] - got["saved_in_layers"] - outside
                assert chunks * got["hidden_bytes"] <= inputs < (chunks + 1) * got["hidden_bytes"], (name, kind)
                if method == "uniform" and n == L:  # the whole stage one chunk: a small part of the activations
                    assert got["saved"] < ref["saved"] / 2, (name, kind)
            else:  # selective: the core attention's inner activations go (local: its [b, n, s, s] fp32 scores)
                assert got["saved"] < ref["saved"], (name, kind)
                if backend == "local":
                    scores = B * TINY_MODEL["num_attention_heads"] * S * S * 4
                    assert ref["saved"] - got["saved"] >= L * scores, (name, kind)


def test_the_rollout_model_is_built_without_recompute():
    """The HybridEngine's rollout model never trains: its config (the actor's, at the rollout sizes) drops the
    recompute fields, whose layer count is per training stage (4 layers on 1 stage here, 2 per stage at PP=2)."""
    from megatron_hybrid import RolloutLayout
    from megatron_hybrid.layout import ParallelLayout
    from megatron_hybrid.megatron.models import GPTArchitecture
    from megatron_hybrid.reshard.rollout_model import rollout_config

    fields = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=4)
    config = GPTArchitecture(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=16).transformer_config(
        **fields)
    rollout = rollout_config(config, ParallelLayout.create(training=(1, 1, 2), rollout=RolloutLayout(1, 2)))
    assert (rollout.recompute_granularity, rollout.recompute_method, rollout.recompute_num_layers) == (None,) * 3
    assert rollout.pipeline_model_parallel_size == 2
    assert {k: getattr(config, k) for k in fields} == fields  # the actor's own config is untouched
