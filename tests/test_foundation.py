"""Megatron-core trains on CPU/gloo under our patches: TP=2 × PP=2, 1F1B, Megatron DDP, two Adam steps.

The sharded run must match a single-rank run of the same model and data.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed

NUM_MICROBATCHES = 4
MICRO_BATCH = 2
SEQ = 16
STEPS = 2


def _arch():
    from megatron_hybrid.megatron.models import tiny_llama

    # GQA (8 heads, 4 groups), SwiGLU, RMSNorm, RoPE, untied embeddings.
    return tiny_llama()


def _batches(step: int):
    g = torch.Generator().manual_seed(1000)  # the same batch each step: the loss must fall
    return [torch.randint(0, 250, (MICRO_BATCH, SEQ), generator=g) for _ in range(NUM_MICROBATCHES)]


def _train(full_init):
    """Train for STEPS steps in the current parallel state; return losses, full grads and full weights."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_hybrid.megatron.sharding import full_state_dict, load_full_state_dict

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    arch = _arch()
    config = arch.transformer_config(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    config.finalize_model_grads_func = finalize_model_grads
    model = arch.build(config, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    load_full_state_dict([model], full_init, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    # Megatron's optimizer asserts CUDA tensors; on CPU we step torch's SGD on the DDP's main_grads. (SGD, not
    # Adam: Adam's update of a near-zero gradient is ±lr whatever its rounding, which hides nothing but makes
    # the comparison of weights after the step meaningless for those elements.)
    opt = torch.optim.SGD([p for p in ddp.parameters()], lr=0.5)
    positions = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, -1)

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        labels = torch.roll(tokens, -1, dims=1)
        out = model(tokens, positions, None, labels=labels)

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    losses, grads = [], []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(_batches(step)), model=[ddp],
            num_microbatches=NUM_MICROBATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False)
        for p in ddp.parameters():
            p.grad = p.main_grad.to(p.dtype)
        g = full_state_dict([_GradView(ddp.module)], tp_group=ps.get_tensor_model_parallel_group(),
                            pp_group=ps.get_pipeline_model_parallel_group())
        grads.append(g)
        opt.step()
        if ps.is_pipeline_last_stage():
            losses.append(torch.stack([o["loss"] for o in out]).mean().item())
    weights = full_state_dict([ddp], tp_group=ps.get_tensor_model_parallel_group(),
                              pp_group=ps.get_pipeline_model_parallel_group())
    return {"losses": losses, "grads": grads, "weights": weights, "last": ps.is_pipeline_last_stage()}


class _GradView(torch.nn.Module):
    """Presents a model's gradients under its parameter names and attributes, for full_state_dict."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def named_parameters(self, *args, **kwargs):
        for name, p in self.model.named_parameters():
            g = torch.nn.Parameter(p.grad.detach().clone(), requires_grad=False)
            for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "shared_embedding"):
                if hasattr(p, attr):
                    setattr(g, attr, getattr(p, attr))
            yield name, g

    @property
    def decoder(self):
        return self.model.decoder


def _initial_weights():
    torch.manual_seed(0)
    from megatron_hybrid.megatron.sharding import full_state_dict
    from megatron.core import parallel_state as ps

    model = _arch().build()
    return full_state_dict([model], tp_group=ps.get_tensor_model_parallel_group(),
                           pp_group=ps.get_pipeline_model_parallel_group())


@pytest.mark.slow
def test_gpt_tp2_pp2_1f1b_matches_single_rank():
    init = run_distributed(_initial_weights, 1)[0]
    ref = run_distributed(_train, 1, init)[0]
    runs = run_distributed(_train, 4, init, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    last = [r for r in runs if r["last"]]
    assert len(last) == 2
    # fp32 with a different reduction order (TP splits the matmuls' inner sums, the 1F1B schedule accumulates
    # micro-batch gradients in another order): ~1e-6 relative per op; 1e-5 leaves an order of magnitude.
    for r in last:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    assert ref["losses"][1] < ref["losses"][0]  # the step did something
    # Gradients and weights: relative error of the whole tensor (element-wise relative error is meaningless for
    # gradients that are zero up to rounding). fp32 reordering gives ~1e-7; 1e-5 still catches a wrong shard,
    # a missing reduction or a scaled gradient, which are off by O(1).
    for r in runs:
        for step in range(STEPS):
            assert r["grads"][step].keys() == ref["grads"][step].keys()
            for name, g in ref["grads"][step].items():
                assert g.norm() > 0, name
                assert _rel_err(r["grads"][step][name], g) < 1e-5, (step, name, _rel_err(r["grads"][step][name], g))
        for name, w in ref["weights"].items():
            assert _rel_err(r["weights"][name], w) < 1e-6, (name, _rel_err(r["weights"][name], w))
        for name, w in ref["weights"].items():
            assert not torch.equal(w, init[name]), name  # every weight moved


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
