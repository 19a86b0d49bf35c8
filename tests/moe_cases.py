"""Rank bodies for test_moe.py: tiny MoE GPTs from GPTArchitecture on CPU/gloo, with and without expert
parallelism."""

from __future__ import annotations

import math
import re

import torch

SEQ, BATCH = 8, 2
_LOCAL_EXPERT = re.compile(r"^(.*\.local_experts\.)(\d+)(\..*)$")


def moe_arch(**overrides):
    """2 layers, hidden 32, 4 experts, top-2, fp32; an aux loss so that its value can be checked."""
    from megatron_hybrid.megatron.models import tiny_llama

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01)
    base.update(overrides)
    return tiny_llama(**base)


def _tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 250, (BATCH, SEQ), generator=g)
    return tokens, torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)


def _aux_losses() -> dict[str, float]:
    """The MoE layers' tracked aux losses (summed over layers) since the last call, then emptied: the tracker is
    a process-wide dict whose tensors are sized by the first model's layer count, and ranks serve many tests."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    out = {name: float(entry["values"].sum()) for name, entry in tracker.items()}
    tracker.clear()
    return out


def forward_backward_case(arch_kw: dict) -> dict:
    """One rank: build, forward with labels, backward. Returns the layer kinds, the loss, the aux losses and
    whether every trainable parameter got a finite gradient."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    arch = moe_arch(**arch_kw)
    _aux_losses()
    model = arch.build()
    model.train()
    tokens, positions = _tokens(0)
    per_token = model(tokens, positions, None, labels=torch.roll(tokens, -1, dims=1))
    loss = per_token.float().mean()
    loss.backward()
    aux = _aux_losses()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    kinds = [type(layer.mlp).__name__ for layer in model.decoder.layers]
    shared = [getattr(layer.mlp, "shared_experts", None) is not None for layer in model.decoder.layers
              if isinstance(layer.mlp, MoELayer)]
    return dict(kinds=kinds, shared=shared, loss=float(loss), aux=aux,
                missing_grads=sorted(n for n, g in grads.items() if g is None),
                finite_grads=all(bool(torch.isfinite(g).all()) for g in grads.values() if g is not None),
                expert_bias=[layer.mlp.router.expert_bias is not None for layer in model.decoder.layers
                             if isinstance(layer.mlp, MoELayer)])


def _load_ep_sharded(model: torch.nn.Module, full: dict[str, torch.Tensor], *, ep_rank: int, num_local: int) -> None:
    """Copy ``full`` (an unsharded model's state) into an expert-parallel model: experts are sharded by expert
    index (this rank's local expert i is global expert ``ep_rank × num_local + i``); the rest is replicated."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            match = _LOCAL_EXPERT.match(name)
            if match:
                name = f"{match[1]}{ep_rank * num_local + int(match[2])}{match[3]}"
            p.copy_(full[name])


def expert_parallel_case(arch_kw: dict) -> dict:
    """Two ranks: the unsharded model (expert parallelism 1) and the same weights with expert parallelism 2 and
    the all-gather dispatcher, on each rank's own tokens. Returns the largest logit difference, the aux losses of
    both, the local expert counts and the engine's refusal of a rollout EP size that does not divide the training
    one."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_hybrid import HybridEngine, RolloutLayout

    rank = dist.get_rank()
    arch = moe_arch(**arch_kw)
    tokens, positions = _tokens(100 + rank)  # different tokens per rank: the all-gather dispatcher mixes them

    _aux_losses()
    reference = arch.build()
    reference.train()  # training mode: the router computes (and tracks) its aux loss
    ref_logits = reference(tokens, positions, None).detach()  # with autograd on: the router tracks its aux loss
    ref_aux = _aux_losses()
    full = {n: p.detach().clone() for n, p in reference.named_parameters()}

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                 expert_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1234)
    ep_model = arch.build(expert_model_parallel_size=2)
    ep_model.train()
    num_local = len(ep_model.decoder.layers[0].mlp.experts.local_experts)
    _load_ep_sharded(ep_model, full, ep_rank=ps.get_expert_model_parallel_rank(), num_local=num_local)
    ep_logits = ep_model(tokens, positions, None).detach()
    ep_aux = _aux_losses()

    refused = None
    try:
        HybridEngine(ep_model, RolloutLayout(1, 1, expert_model_parallel_size=4))
    except ValueError as exc:
        refused = str(exc)
    return dict(max_diff=float((ep_logits - ref_logits).abs().max()), scale=float(ref_logits.abs().max()),
                ref_aux=ref_aux, ep_aux=ep_aux, num_local=num_local, refused=refused,
                finite=bool(torch.isfinite(ep_logits).all()) and all(math.isfinite(v) for v in ep_aux.values()))
