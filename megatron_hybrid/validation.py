"""The HybridEngine's checks of its arguments, layout and model: local, and all run before any collective.

A bad input is a ``ValueError`` naming the argument and its value on every rank at once, instead of a collective
that some ranks enter and others never reach. The engine calls them in this order: :func:`check_arguments` (the
arguments as passed), :func:`check_layout` (the layout the training groups give), :func:`check_model` (the
model's configuration against that layout).
"""

from __future__ import annotations

import datetime
import math
from typing import Any, Optional, Sequence, Union

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from .constraints import Sizes, check
from .layout import ExpertLayout, ParallelLayout, RolloutLayout
from .megatron import compat
from .megatron.models import moe_layer_pattern
from .megatron.sharding import TPSpec
from .modes import RolloutWeights, WeightMode, parse_mode
from .quant.fp8 import MIN_CUDA_CAPABILITY, is_target, supports_fp8
from .reshard.aliased import supports_blocks

WEIGHT_MODES = tuple(m.value for m in WeightMode)  # the names, as before WeightMode


def as_timeout(timeout: Any) -> datetime.timedelta:
    """``timeout`` (a positive ``datetime.timedelta`` or number of seconds) as a ``timedelta``."""
    value = timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and math.isfinite(timeout):
        value = datetime.timedelta(seconds=timeout)
    if not isinstance(value, datetime.timedelta) or not value.total_seconds() > 0:
        raise ValueError(f"timeout ({timeout!r}) must be a positive datetime.timedelta or number of seconds")
    return value


def cuda_capability(device: torch.device) -> Optional[tuple[int, int]]:
    """The compute capability of a CUDA ``device``; ``None`` for any other device."""
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def check_fp8_device(device: torch.device, capability: Optional[tuple[int, int]]) -> None:
    """FP8 rollout weights need FP8 tensor cores on a CUDA device (``capability``: its compute capability); a CPU
    runs them with torch's CPU ``_scaled_mm``."""
    if capability is not None and tuple(capability) < MIN_CUDA_CAPABILITY:
        need = ".".join(map(str, MIN_CUDA_CAPABILITY))
        raise ValueError(f"rollout_weights='fp8' needs FP8 tensor cores (compute capability ≥ {need}), but the "
                         f"model's device {device} has compute capability {'.'.join(map(str, capability))}; use "
                         "rollout_weights='model'")


def check_arguments(model: Union[torch.nn.Module, Sequence[torch.nn.Module]], rollout: Any, *, weight_mode: Any,
                    bucket_size_mb: Any, align_slots: Any, timeout: Any, rollout_weights: Any = "model") -> None:
    """The engine's arguments as passed (see :class:`~megatron_hybrid.engine.HybridEngine`)."""
    weight_mode = parse_mode(WeightMode, weight_mode, "weight_mode")
    rollout_weights = parse_mode(RolloutWeights, rollout_weights, "rollout_weights")
    if rollout_weights == RolloutWeights.FP8 and weight_mode == WeightMode.ALIASED:
        raise ValueError("rollout_weights='fp8' needs weight_mode='canonical' (FP8 rollout weights are tensors "
                         "rebuilt at every switch; weight_mode='aliased' computes on the training shards)")
    if bucket_size_mb is not None and (isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (
            int, float)) or not math.isfinite(bucket_size_mb) or bucket_size_mb <= 0):
        raise ValueError(f"bucket_size_mb ({bucket_size_mb!r}) must be a positive number of MiB")
    if not isinstance(align_slots, bool):
        raise ValueError(f"align_slots ({align_slots!r}) must be True or False")
    if timeout is not None:
        as_timeout(timeout)
    if not isinstance(rollout, RolloutLayout):
        raise ValueError(f"rollout ({rollout!r}) must be a RolloutLayout")
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise ValueError("model is an empty list of model chunks")
    for c in chunks:
        inner = compat.unwrap_model(c) if isinstance(c, torch.nn.Module) else c
        if not isinstance(inner, torch.nn.Module) or not isinstance(getattr(inner, "config", None),
                                                                     TransformerConfig):
            raise ValueError(f"model ({type(c).__name__}) must be a megatron-core model (a GPTModel, a list of "
                             "its chunks, or Megatron DDP around one) with a TransformerConfig as .config")
    if rollout_weights == RolloutWeights.FP8:
        first = next((p for c in chunks for p in compat.unwrap_model(c).parameters()), None)
        if first is not None:
            check_fp8_device(first.device, cuda_capability(first.device))
        config = compat.unwrap_model(chunks[0]).config
        if getattr(config, "first_last_layers_bf16", False):
            start, end = config.num_layers_at_start_in_bf16, config.num_layers_at_end_in_bf16
            if not (isinstance(start, int) and isinstance(end, int) and start >= 0 and end >= 0
                    and start + end <= config.num_layers):
                raise ValueError(f"the model's config keeps layers in bf16 under rollout_weights='fp8' "
                                 f"(first_last_layers_bf16), but num_layers_at_start_in_bf16 ({start!r}) and "
                                 f"num_layers_at_end_in_bf16 ({end!r}) must be integers ≥ 0 that sum to at most "
                                 f"num_layers ({config.num_layers})")


def check_layout(layout: ParallelLayout, *, world_size: int, num_chunks: int) -> None:
    """The layout that the training groups give, against the world and the model's virtual pipeline chunks."""
    check(Sizes(world=world_size, t=layout.t, p=layout.p, d=layout.d), "training_layout_covers_world")


def _owner_modules(module: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """id(parameter) -> the module that registered it."""
    return {id(p): m for m in module.modules() for p in m._parameters.values() if p is not None}


#: megatron-core's config fields for pipeline stages of uneven depth (and their defaults): the plan splits the layers
#: evenly over the stages and chunks (``exchange.stage_layers``), so a model built with any of them is refused.
UNEVEN_STAGE_FIELDS = {"num_layers_in_first_pipeline_stage": None, "num_layers_in_last_pipeline_stage": None,
                       "pipeline_model_parallel_layout": None, "account_for_embedding_in_pipeline_split": False,
                       "account_for_loss_in_pipeline_split": False}


def check_even_stages(config: Any) -> None:
    """``ValueError`` naming the fields where ``config`` asks for pipeline stages of uneven depth."""
    uneven = [f"{name} ({getattr(config, name)!r})" for name, default in UNEVEN_STAGE_FIELDS.items()
              if getattr(config, name, default) not in (None, False, default)]
    if uneven:
        raise ValueError(f"the model's config sets {', '.join(uneven)}: pipeline stages of uneven depth are not "
                         "resharded (the HybridEngine splits the layers evenly over the stages and virtual chunks); "
                         "build the model with an even split")


def check_model(modules: Sequence[torch.nn.Module], layout: ParallelLayout, *, weight_mode: str,
                rollout_weights: str = "model") -> None:
    """The model (its unwrapped chunks; the first one's ``config``) against the layout, the weight mode and the
    rollout weights."""
    lay, config = layout, modules[0].config
    check_even_stages(config)
    if getattr(config, "mtp_num_layers", None):  # before any collective (the rollout model's build came after some)
        raise ValueError(f"the model's config sets mtp_num_layers ({config.mtp_num_layers}): multi-token prediction "
                         "layers are not resharded (the rollout model has none); build the model without them")
    sizes = Sizes(t_g=lay.t_g, p_g=lay.p_g, num_attention_heads=config.num_attention_heads,
                  num_query_groups=config.num_query_groups or config.num_attention_heads,
                  ffn_hidden_size=config.ffn_hidden_size, num_layers=config.num_layers,
                  padded_vocab_size=getattr(modules[0], "vocab_size", None))
    check(sizes, "t_g_divides_heads", "t_g_divides_ffn", "t_g_divides_query_groups", "p_g_divides_layers")
    if config.tensor_model_parallel_size != lay.t or config.pipeline_model_parallel_size != lay.p:
        raise ValueError(f"the model was built for tensor/pipeline sizes ({config.tensor_model_parallel_size}, "
                         f"{config.pipeline_model_parallel_size}) but the groups are ({lay.t}, {lay.p})")
    check(sizes, "t_g_divides_vocab")
    if weight_mode == WeightMode.ALIASED and (lay.exchange or lay.k > 1 or lay.widens):
        for mod in modules:
            owners = _owner_modules(mod)
            for name, prm in mod.named_parameters():
                if TPSpec.of(prm).sharded and prm.dim() > 1 and not supports_blocks(owners[id(prm)]):
                    raise ValueError(f"weight_mode='aliased' cannot run {name} ({type(owners[id(prm)]).__name__}"
                                     ") on blocks; use weight_mode='canonical' for this model")
    if rollout_weights == RolloutWeights.FP8:
        for mod in modules:
            owners = _owner_modules(mod)
            for name, prm in mod.named_parameters():
                if is_target(name) and not supports_fp8(owners[id(prm)]):
                    raise ValueError(f"rollout_weights='fp8' cannot run {name} ({type(owners[id(prm)]).__name__}) "
                                     "in FP8: only megatron-core's local-spec ColumnParallelLinear / "
                                     "RowParallelLinear have FP8 twins; use rollout_weights='model'")


def check_stage_patterns(config: Any, layout: ParallelLayout) -> None:
    """``ValueError`` for dense and MoE layers mixed (``moe_layer_freq``) so that the training stages one rollout
    stage gathers (p_g < p, in place) differ: their layers are gathered as counterparts, one for one."""
    if layout.exchange or layout.q == 1:
        return
    pattern, per = moe_layer_pattern(config.moe_layer_freq, config.num_layers), config.num_layers // layout.p
    stages = [tuple(pattern[s * per:(s + 1) * per]) for s in range(layout.p)]
    for first in range(0, layout.p, layout.q):
        if len(set(stages[first:first + layout.q])) > 1:
            raise ValueError(f"moe_layer_freq ({config.moe_layer_freq}) gives the pipeline stages "
                             f"{first}-{first + layout.q - 1} different layers (MoE = 1: "
                             f"{[list(p) for p in stages[first:first + layout.q]]}); rollout "
                             f"pipeline_model_parallel_size ({layout.p_g}) gathers them into one rollout stage, "
                             "which needs the same layers on each: use a rollout PP size whose stages repeat the "
                             "pattern, or the training PP size")


def check_experts(modules: Sequence[torch.nn.Module], layout: ParallelLayout,
                  rollout: RolloutLayout, *, expert_groups: Optional[tuple[Any, Any, Any]],
                  world_size: int) -> Optional[ExpertLayout]:
    """An MoE model's expert layout (``None`` for a dense model) against the rollout layout, the world and the
    model: ``expert_groups`` are the training groups (expert tp, ep, expert dp) of an MoE model. The layout rules
    are :func:`check_expert_layout`'s (which the recipe's argument checks call too)."""
    config = modules[0].config
    if config.num_moe_experts is None:
        check(Sizes(moe=False, e_g=rollout.expert_model_parallel_size), "dense_has_no_rollout_ep")
        return None
    et, e, edp = (g.size() for g in expert_groups)
    built = (config.expert_tensor_parallel_size, config.expert_model_parallel_size)
    if built != (et, e):
        raise ValueError(f"the model was built for expert tensor/expert parallel sizes {built} but the groups are "
                         f"({et}, {e})")
    lay = check_expert_layout(config, layout, rollout, training=(et, e, edp), world_size=world_size)
    check_sequential_experts(modules)
    return lay


def check_expert_layout(config: Any, layout: ParallelLayout, rollout: RolloutLayout, *,
                        training: tuple[int, int, int], world_size: int) -> ExpertLayout:
    """The one home of the MoE layout rules (no model, no groups: the engine and the recipe's argument checks call
    it). ``config``: the model's megatron-core ``TransformerConfig`` (``num_moe_experts``, ``moe_ffn_hidden_size``,
    ``add_bias_linear``, ``moe_layer_freq``, ``num_layers``); ``training``: (expert tp, ep, expert dp). The rules
    are :mod:`megatron_hybrid.constraints`' MoE rules: in place the experts gather over micro-EP groups (e_g | e,
    et_g | et, checked by :class:`~megatron_hybrid.layout.ExpertLayout`); on an exchange layout they move in its
    all-to-all, each rollout stage's t_g · d_g ranks cut into et_g · e_g · edp_g
    (:meth:`~megatron_hybrid.reshard.exchange.Arrangement.expert_coords`)."""
    et, e, edp = training
    sizes = Sizes(moe=True, exchange=layout.exchange, world=world_size, t=layout.t, p=layout.p, et=et, e=e, edp=edp,
                  t_g=layout.t_g, p_g=layout.p_g, et_g=rollout.expert_tp, e_g=rollout.expert_model_parallel_size,
                  num_moe_experts=config.num_moe_experts, moe_ffn_hidden_size=config.moe_ffn_hidden_size,
                  add_bias_linear=config.add_bias_linear)
    check(sizes, "expert_grid_covers_world", "moe_rollout_tp_not_wider")
    check_stage_patterns(config, layout)
    lay = ExpertLayout(et=et, e=e, edp=edp, p=layout.p, et_g=sizes.et_g, e_g=sizes.e_g, p_g=layout.p_g,
                       exchange=layout.exchange)
    check(sizes, "rollout_expert_grid_fits_stage", "e_g_divides_experts", "et_g_divides_expert_ffn",
          "rollout_expert_bias_needs_et_g_1")
    return lay


def check_sequential_experts(modules: Sequence[torch.nn.Module]) -> None:
    """``ValueError`` for routed experts other than megatron-core's SequentialMLP (a tensor per expert)."""
    for module in modules:
        for name, sub in module.named_modules():
            if hasattr(sub, "local_expert_indices") and type(sub.experts).__name__ != "SequentialMLP":
                raise ValueError(f"{name}.experts is a {type(sub.experts).__name__}; the HybridEngine moves "
                                 "SequentialMLP experts (megatron-core's local spec, moe_grouped_gemm=False)")
