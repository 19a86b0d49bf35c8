"""Training an RL model (actor, critic) with megatron-core's optimizer and learning-rate schedule.

As Megatron-LM's training loop does: the model is wrapped in Megatron DDP, ``get_megatron_optimizer`` builds Adam
(AdamW: decoupled weight decay, none on biases and norms) and, for bf16 parameters, keeps fp32 main parameters
(``Float16OptimizerWithFloat16Params``); ``OptimizerParamScheduler`` sets the learning rate, counting samples
(iterations × global batch size) as Megatron-LM does. One update is ``zero_grad_buffer`` + ``zero_grad``, the
forward/backward schedule, ``optimizer.step()``: Megatron's step computes the gradient norm over the
model-parallel group (tensor-parallel duplicates and the tied output layer of the last pipeline stage counted once),
clips and steps. The scheduler is stepped once per RL iteration, after its updates (all PPO epochs of an
iteration use one learning rate, as in verl).

``--use-distributed-optimizer`` shards the states and fp32 main parameters over the data-parallel ranks
(``DistributedOptimizer``, the parameters in DDP's buffer); ``--overlap-grad-reduce`` and
``--overlap-param-gather`` overlap DDP's reduction with the backward pass and the optimizer's all-gather with the
next forward, as in Megatron-LM.

The HybridEngine takes these optimizers as they are: ``switch_to_rollout(offload_optimizer=trained.optimizer)``
moves their states and fp32 main parameters to host memory while generating; a distributed optimizer built before
the engine is passed to it, ``HybridEngine(..., optimizer=trained.optimizer)``, so that its shards of DDP's
buffer move with the buffer.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..megatron import megatron_groups, unwrap_model
from .faults import Flags, check_finite
from .metrics import clear_moe_aux_losses, moe_aux_losses
from .models import wrap_ddp
from .passes import Batch, LossFn, TrainingPasses, token_mean
from .phases import recorded


def optimizer_config(args: argparse.Namespace, *, lr: float):
    """megatron-core's ``OptimizerConfig`` for Adam from Megatron-LM's flags, at peak learning rate ``lr``:
    with ``--use-distributed-optimizer`` megatron-core's ``DistributedOptimizer`` (its all-gather deferred to the
    next forward with ``--overlap-param-gather``), which the HybridEngine serves from DDP's own buffer.
    """
    from megatron.core.optimizer import OptimizerConfig

    from megatron_hybrid.megatron import compat

    compat.te_version_known()  # megatron-core 0.16 reads a missing Transformer Engine's version as None
    return OptimizerConfig(optimizer="adam", lr=lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                           adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                           clip_grad=args.clip_grad, bf16=args.bf16,
                           params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
                           use_distributed_optimizer=args.use_distributed_optimizer,
                           overlap_param_gather=args.overlap_param_gather,
                           **offload_config(args))


def offload_config(args: argparse.Namespace) -> dict:
    """megatron-core's optimizer CPU offload fields of Megatron-LM's flags (none unless asked: older callers'
    namespaces may lack them)."""
    if not getattr(args, "optimizer_cpu_offload", False) and not getattr(args, "use_precision_aware_optimizer", False):
        return {}
    return dict(optimizer_cpu_offload=args.optimizer_cpu_offload,
                optimizer_offload_fraction=args.optimizer_offload_fraction,
                use_precision_aware_optimizer=args.use_precision_aware_optimizer,
                overlap_cpu_optimizer_d2h_h2d=args.overlap_cpu_optimizer_d2h_h2d)


def build_scheduler(optimizer: Any, args: argparse.Namespace, *, lr: float):
    """Megatron's ``OptimizerParamScheduler`` as Megatron-LM's ``get_optimizer_param_scheduler`` builds it from
    ``--lr-warmup-iters``, ``--lr-decay-iters`` (default ``--train-iters``), ``--lr-decay-style``, ``--min-lr``
    and ``--weight-decay`` (constant), in samples: step it with ``increment=args.global_batch_size``.

    On resume the command line's schedule applies from the checkpoint's position (Megatron-LM's
    ``--override-opt_param-scheduler``), so a run resumed with a larger ``--train-iters`` decays over the new
    length instead of failing Megatron's equality asserts.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    samples = args.global_batch_size
    decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters * samples,
        lr_decay_steps=decay_iters * samples, lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters * samples, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)


@dataclass
class TrainedModel:
    """A model under training: Megatron DDP, its megatron-core optimizer and its learning-rate scheduler (what
    Megatron-LM's ``setup_model_and_optimizer`` returns)."""

    model: torch.nn.Module
    """The stage wrapped in Megatron DDP."""
    optimizer: Any
    """megatron-core's optimizer (a ``ChainedOptimizer``)."""
    scheduler: Any
    """megatron-core's ``OptimizerParamScheduler``."""


def setup_model_and_optimizer(stage: torch.nn.Module, args: argparse.Namespace, *,
                              lr: Optional[float] = None) -> TrainedModel:
    """Wrap ``stage`` in Megatron DDP and give it Adam and a schedule from the flags (peak rate ``lr``, default
    ``--lr``; ``--use-distributed-optimizer``, ``--overlap-grad-reduce``, ``--overlap-param-gather``)."""
    from megatron.core.optimizer import get_megatron_optimizer

    lr = args.lr if lr is None else lr
    model = wrap_ddp(stage, use_distributed_optimizer=args.use_distributed_optimizer,
                     overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather)
    optimizer = get_megatron_optimizer(optimizer_config(args, lr=lr), [model])
    return TrainedModel(model, optimizer, build_scheduler(optimizer, args, lr=lr))


@dataclass
class UpdateResult:
    """What one optimizer update reports."""

    stats: list[dict[str, torch.Tensor]]
    """``loss_fn``'s stats per micro-batch (last pipeline stage; empty elsewhere)."""
    grad_norm: float
    """The global gradient norm before clipping, as Megatron's optimizer computed it (the same on every rank)."""
    aux_losses: dict[str, float] = field(default_factory=dict)
    """An MoE model's load-balancing losses of this update (:func:`~.metrics.moe_aux_losses`; the same on every
    rank), e.g. ``load_balancing_loss``; empty for a dense model."""
    tokens: list[int] = field(default_factory=list)
    """The response tokens of each micro-batch of ``stats`` (last pipeline stage; empty elsewhere)."""

    def mean(self, key: str) -> float:
        """Stat ``key`` over this rank's response tokens (each micro-batch's weighed by its tokens, as the loss)."""
        return token_mean(self.stats, self.tokens, key)


@recorded("update", step="step")
def update(trained: TrainedModel, batch: Batch, loss_fn: LossFn, *, passes: TrainingPasses,
           step: int, name: str = "the model", scaled_by: Flags = ()) -> UpdateResult:
    """One optimizer update of ``trained`` on ``batch`` (Megatron-LM's ``train_step``): gradients of the mean of
    ``loss_fn`` over the step's response tokens, on every DP replica (:data:`~.passes.LossFn`), clipped to
    ``--clip-grad`` by their global norm, then Adam at the scheduler's current learning rate.

    A loss or gradient norm that is not finite on any rank raises :class:`~.faults.StepFailure` on every rank
    (naming ``step``, the RL iteration, ``name``, e.g. "the actor", and the flags ``scaled_by`` that scale the loss
    and the updates, :func:`~.faults.flag_values`), so the caller never saves the parameters it produced.
    """
    config = unwrap_model(trained.model).config
    # Training mode: megatron-core's MoE routers add their load-balancing loss (MoEAuxLossAutoScaler) only then.
    trained.model.train()
    clear_moe_aux_losses()  # what earlier passes tracked is not this update's
    trained.model.zero_grad_buffer()
    trained.optimizer.zero_grad()
    losses: list[torch.Tensor] = []

    def recorded(output: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict]:
        loss, stats = loss_fn(output, mb)
        losses.append(loss.detach())
        return loss, stats

    micro_batches = passes.micro_batches(batch)  # packed once: the schedule and the counts below read them
    stats = passes.run(trained.model, batch, recorded, forward_only=False, micro_batches=micro_batches)
    successful, grad_norm, _ = trained.optimizer.step()
    # Only a loss scaler (fp16) or megatron-core ≥ 0.19's grad_norm_skip_threshold (left at inf) skip a step.
    assert successful, "megatron-core's optimizer skipped a step"
    # The losses live on the last stage; the norm is the same everywhere (the optimizer reduced it over the
    # model-parallel group, the gradients over DP), but one flag for both keeps the ranks in step regardless.
    quantities = {f"{name}'s micro-batch losses": torch.stack(losses) if losses else None,
                  f"{name}'s gradient norm": float(grad_norm)}
    check_finite(step, quantities, scaled_by=dict.fromkeys(quantities, scaled_by))
    _, pp, dp, _ = megatron_groups()
    aux = moe_aux_losses(config, num_microbatches=len(micro_batches), pp_group=pp, dp_group=dp)
    tokens = [int(mb["mask"].sum()) for mb in micro_batches] if stats else []
    return UpdateResult(stats, float(grad_norm), aux, tokens)
