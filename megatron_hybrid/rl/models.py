"""The RL models on Megatron's training layout: actor, frozen reference, critic (a value model) and reward model.

Every model is this rank's stage of a megatron-core GPTModel built from one :class:`GPTArchitecture`. A value model
(the PPO critic, a reward model) is the same trunk with :class:`ValueHead` in place of the output layer. Stages
are built on Megatron's global training groups (``initialize_model_parallel``), as Megatron-LM's
``model_provider`` builds them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

import torch
import torch.distributed as dist

from ..megatron import GPTArchitecture, full_state_dict, load_full_state_dict, megatron_expert_ranks, unwrap_model

VALUE_MODEL_CONFIG = "value_model.json"
VALUE_MODEL_WEIGHTS = "model.safetensors"


class ValueHead(torch.nn.Module):
    """A scalar head on the final hidden state, in place of GPTModel's output layer (same call signature).

    Replicated over tensor-parallel ranks: the hidden state it reads is replicated there, so its gradient is too.
    With sequence parallelism (``tp_group``) the trunk's output is this rank's slice of the sequence: the head
    gathers the whole sequence first, and since every TP rank then computes the same loss, the gather's backward
    keeps this rank's slice of the (replicated) gradient instead of summing the copies.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, *, tp_group=None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.tp_group = tp_group
        """The tensor-parallel group when the trunk is sequence-parallel, else None."""

    def forward(self, hidden_SBH: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.tp_group is not None:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_SBH = gather_from_sequence_parallel_region(hidden_SBH, tensor_parallel_output_grad=False,
                                                              group=self.tp_group)
        return torch.nn.functional.linear(hidden_SBH, self.weight, self.bias), None


#: Megatron-LM's MoE flags (arguments dest), each a :class:`GPTArchitecture` field of the same name.
MOE_FLAGS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
             "moe_router_score_function", "moe_router_pre_softmax", "moe_router_enable_expert_bias",
             "moe_shared_expert_gate", "moe_layer_freq", "moe_aux_loss_coeff", "moe_router_load_balancing_type",
             "moe_token_dispatcher_type")


def architecture_from_args(args: argparse.Namespace, vocab_size: int) -> GPTArchitecture:
    """The GPT architecture of Megatron-LM's model flags (``--num-layers``, ``--hidden-size``, …, ``--bf16``)."""
    return GPTArchitecture(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        vocab_size=vocab_size, ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        max_position_embeddings=args.max_position_embeddings,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, swiglu=args.swiglu,
        normalization=args.normalization, position_embedding_type=args.position_embedding_type,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        params_dtype="bfloat16" if args.bf16 else "float32",
        **({} if args.num_experts is None else {name: getattr(args, name) for name in MOE_FLAGS}))


def build_stage(arch: GPTArchitecture, *, value_head: bool = False, device: torch.device,
                sequence_parallel: bool = False, moe_enable_routing_replay: bool = False,
                attention_backend: str = "local", **config_overrides: Any) -> torch.nn.Module:
    """This rank's stage of a GPTModel on Megatron's training groups, every parameter in ``arch.dtype``; with a
    :class:`ValueHead` if asked; with Megatron's sequence parallelism if asked (``--sequence-parallel``, TP > 1);
    with a ``RouterReplay`` in every MoE router if asked (``--moe-enable-routing-replay``, the actor's: its passes
    then route as the rollout's record says, :mod:`.routing`); its core attention ``attention_backend``'s
    (``--attention-backend``, :mod:`megatron_hybrid.core_attention`). ``config_overrides``: further
    ``TransformerConfig`` fields (the actor's :func:`~megatron_hybrid.rl.arguments.rollout_fp8_config`; the
    activation recompute of the models that train, :func:`~megatron_hybrid.rl.arguments.recompute_config`, which
    megatron-core applies in training mode only: generation and a model in eval mode run every layer as usual).

    The config carries megatron-core's ``finalize_model_grads`` (DP all-reduce, and the tied embedding's gradient
    summed over the first and last stages), as Megatron-LM's training loop sets it.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    if value_head:  # the value head replaces the output layer, so nothing may be tied to it
        arch = dataclasses.replace(arch, untie_embeddings_and_output_weights=True)
    experts = {}
    if arch.num_experts is not None:  # the experts over Megatron's expert groups
        _, ep_size, _, etp_size = megatron_expert_ranks()
        experts = dict(expert_model_parallel_size=ep_size, expert_tensor_parallel_size=etp_size)
    config = arch.transformer_config(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                                     pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                                     sequence_parallel=sequence_parallel,
                                     moe_enable_routing_replay=moe_enable_routing_replay, **experts,
                                     **config_overrides)
    config.finalize_model_grads_func = finalize_model_grads
    model = arch.build(config, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                       attention_backend=attention_backend)
    if value_head and ps.is_pipeline_last_stage():
        model.output_layer = ValueHead(arch.hidden_size, arch.dtype,
                                       tp_group=ps.get_tensor_model_parallel_group() if sequence_parallel else None)
    # The local spec's torch norms ignore params_dtype (fp32 in a bf16 model); Megatron-LM's Float16Module casts
    # the whole module, and so do we: every parameter in the architecture's dtype.
    return model.to(device=device, dtype=arch.dtype)


def wrap_ddp(model: torch.nn.Module, *, use_distributed_optimizer: bool = False, overlap_grad_reduce: bool = False,
             overlap_param_gather: bool = False) -> torch.nn.Module:
    """Megatron DDP, gradients reduced in fp32 (bf16 parameters keep fp32 main gradients for the optimizer's fp32
    main params); with ``use_distributed_optimizer`` the parameters live in DDP's contiguous buffer, which the
    distributed optimizer all-gathers into after every step (the HybridEngine takes that buffer as its own: pass
    it an optimizer built before it, ``HybridEngine(..., optimizer=)``). With ``overlap_grad_reduce`` the
    model's ``no_sync`` becomes its config's ``no_sync_func``, as Megatron-LM's training loop sets it, so the
    reduction starts only in the last micro-batch's backward."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer,
        overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather), model)
    if overlap_grad_reduce:
        model.config.no_sync_func = ddp.no_sync
    return ddp


def copy_weights(dst: torch.nn.Module, src: torch.nn.Module, *, skip_missing: bool = False) -> None:
    """Copy ``src``'s parameters into ``dst``'s of the same name and shape, in place.

    ``skip_missing``: leave ``dst``'s parameters that ``src`` lacks (a critic's value head) as they are; otherwise
    such a parameter is a ``ValueError``.
    """
    src_params = dict(src.named_parameters())
    with torch.no_grad():
        for name, p in dst.named_parameters():
            if name in src_params and src_params[name].shape == p.shape:
                p.copy_(src_params[name])
            elif not skip_missing:
                raise ValueError(f"no parameter {name} of shape {tuple(p.shape)} to copy")


def parameters_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU copies of ``model``'s parameters (plain or wrapped), by name: for checkpoints."""
    return {n: p.detach().cpu().clone() for n, p in unwrap_model(model).named_parameters()}


def load_parameters(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy :func:`parameters_state`'s values back in place (views of the parameters, e.g. the HybridEngine's,
    stay valid)."""
    with torch.no_grad():
        for n, p in unwrap_model(model).named_parameters():
            p.copy_(state[n])


def build_reference(actor: torch.nn.Module, arch: GPTArchitecture, *, device: torch.device,
                    sequence_parallel: bool = False, attention_backend: str = "local") -> torch.nn.Module:
    """A frozen copy of the actor's stage (``actor`` plain or DDP-wrapped): the KL reference policy."""
    reference = build_stage(arch, device=device, sequence_parallel=sequence_parallel,
                            attention_backend=attention_backend).requires_grad_(False).eval()
    copy_weights(reference, unwrap_model(actor))
    return reference


def build_critic(actor: torch.nn.Module, arch: GPTArchitecture, *, device: torch.device,
                 sequence_parallel: bool = False, attention_backend: str = "local",
                 **config_overrides: Any) -> torch.nn.Module:
    """A value model started from the actor's trunk (its value head from zero), not yet wrapped.
    ``config_overrides``: further ``TransformerConfig`` fields, as :func:`build_stage` takes them (the activation
    recompute of ``--recompute-granularity``)."""
    critic = build_stage(arch, value_head=True, device=device, sequence_parallel=sequence_parallel,
                         attention_backend=attention_backend, **config_overrides)
    copy_weights(critic, unwrap_model(actor), skip_missing=True)
    return critic


def save_value_model(model: torch.nn.Module, directory: str, arch: GPTArchitecture) -> None:
    """Write a value model (critic or reward model) for ``--reward-model-load``: full tensors, any layout.

    Called on every rank; rank 0 writes ``model.safetensors`` and ``value_model.json`` (the architecture).
    """
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    full = full_state_dict([model], tp_group=ps.get_tensor_model_parallel_group(),
                           pp_group=ps.get_pipeline_model_parallel_group())
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        save_file({k: v.contiguous() for k, v in full.items()}, os.path.join(directory, VALUE_MODEL_WEIGHTS))
        with open(os.path.join(directory, VALUE_MODEL_CONFIG), "w") as f:
            json.dump({"architecture": arch.to_dict()}, f, indent=2)
    dist.barrier()


def load_value_model(directory: str, *, device: torch.device) -> torch.nn.Module:
    """A value model written by :func:`save_value_model`, as this rank's frozen stage (any TP/PP)."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    with open(os.path.join(directory, VALUE_MODEL_CONFIG)) as f:
        arch = GPTArchitecture.from_dict(json.load(f)["architecture"])
    model = build_stage(arch, value_head=True, device=device)
    load_full_state_dict([model], load_file(os.path.join(directory, VALUE_MODEL_WEIGHTS)),
                         tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size())
    return model.eval().requires_grad_(False)
