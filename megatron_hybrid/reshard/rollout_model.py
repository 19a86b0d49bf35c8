"""The rollout model: one megatron-core model chunk per rollout stage on the rollout groups, built without weights.

Its parameters are placeholders until :mod:`megatron_hybrid.reshard.binding` points them at the training tensors and the
peers' slots. Everything that is not a parameter but decides the function (rotary frequencies, rope scaling) is
taken from the training model itself, not rebuilt from arguments: GPTModel does not keep every constructor
argument (``rope_scaling_factor``, ``seq_len_interpolation_factor`` live only inside its rotary module), so a
rebuilt model could compute another function than the one being trained.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch

from ..core_attention import with_local_core_attention
from ..layout import ExpertLayout, ParallelLayout
from ..megatron import compat
from ..modes import RolloutWeights, WeightMode
from ..quant.fp8 import is_target, make_fp8
from .aliased import make_aliased, placeholder, supports_blocks

ModelProvider = Callable[..., torch.nn.Module]


@contextmanager
def weightless_parameters() -> Iterator[None]:
    """Build modules whose parameters own no memory: every registered parameter becomes a placeholder.

    Keeps the rollout model's construction from allocating a second copy of the weights (each parameter's
    temporary allocation is dropped as soon as it is registered). torch.nn's own modules get their placeholders
    when the block exits instead: their constructors initialise the parameters they have just registered, whatever
    ``perform_initialization`` says, and ``torch.nn.Embedding`` (megatron-core's learned absolute position table)
    draws ``normal_`` values, which a placeholder (one element seen through ``expand``) cannot take. In a
    megatron-core GPTModel these are the position table and the norm weights, not a copy of the model.
    """
    deferred: list[tuple[torch.nn.Module, str]] = []

    def hook(module, name, param):
        if param is None:
            return None
        if type(module).__module__.startswith("torch.nn."):
            deferred.append((module, name))
            return None  # kept as it is, for now
        return placeholder(param)

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()
        for module, name in deferred:
            param = module._parameters.get(name)
            if param is not None:
                module._parameters[name] = placeholder(param)


def rollout_config(config, layout: ParallelLayout, experts: Optional[ExpertLayout] = None):
    """The training ``TransformerConfig`` with the rollout sizes, without sequence parallelism (generation runs a
    few tokens per step: nothing to split along the sequence) and without activation recompute (the rollout model
    never trains; a layer count per training stage need not fit its stages)."""
    config = copy.copy(config)
    config.tensor_model_parallel_size = layout.t_g
    config.pipeline_model_parallel_size = layout.p_g
    if layout.exchange:  # one rollout chunk per rank (see build_rollout_chunks)
        config.virtual_pipeline_model_parallel_size = None
    if experts is not None:
        config.expert_model_parallel_size = experts.e_g
        config.expert_tensor_parallel_size = experts.et_g
    config.sequence_parallel = False
    config.recompute_granularity = config.recompute_method = config.recompute_num_layers = None
    config.perform_initialization = False
    return config


def build_rollout_chunks(train_modules: list[torch.nn.Module], layout: ParallelLayout, *, pg_collection,
                         rollout_pp_rank: int, weight_mode: str, guard: Callable[[], None],
                         model_provider: Optional[ModelProvider] = None,
                         experts: Optional[ExpertLayout] = None,
                         rollout_weights: str = "model") -> list[torch.nn.Module]:
    """One rollout chunk per training chunk of this rank (virtual pipeline chunks stay chunks), or with an
    exchange layout one chunk: the rollout stage's layers in one model (the generator runs one chunk).
    ``rollout_weights="fp8"``: the linears of :func:`megatron_hybrid.quant.fp8.is_target` weights become FP8 twins.

    ``guard()`` runs before every forward and ``state_dict`` of the rollout model (the engine refuses them while
    training, when the weights are not there).
    """
    config = rollout_config(train_modules[0].config, layout, experts)
    chunks = []
    trains = train_modules[:1] if layout.exchange else train_modules
    for vp, train in enumerate(trains):
        vp_stage = vp if len(trains) > 1 else None
        # With virtual pipeline chunks, only the first chunk of the first stage embeds and only the last chunk of
        # the last stage has the output layer.
        pre = rollout_pp_rank == 0 and vp == 0
        post = rollout_pp_rank == layout.p_g - 1 and vp == len(trains) - 1
        with weightless_parameters():
            if model_provider is not None:
                chunk = model_provider(config=config, pg_collection=pg_collection, pre_process=pre,
                                       post_process=post)
            else:
                chunk = _rebuild_gpt(train, config, pre, post, vp_stage, pg_collection, rollout_pp_rank)
        chunk.eval()
        if weight_mode == WeightMode.ALIASED:
            for mod in chunk.modules():
                if supports_blocks(mod):
                    make_aliased(mod)
        if rollout_weights == RolloutWeights.FP8:
            for name, mod in chunk.named_modules():
                if is_target(f"{name}.weight"):
                    make_fp8(mod)
        _share_non_parameter_state(train, chunk)
        chunk.register_forward_pre_hook(lambda module, args: guard())
        chunk.register_state_dict_pre_hook(lambda module, prefix, keep_vars: guard())
        chunks.append(chunk)
    return chunks


def _rebuild_gpt(train: torch.nn.Module, config, pre: bool, post: bool, vp_stage: Optional[int], pg_collection,
                 pp_rank: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if not isinstance(train, GPTModel):
        raise ValueError(f"model is a {type(train).__name__}; pass model_provider= to build its rollout stage")
    if getattr(train, "mtp_process", False):
        raise ValueError("multi-token prediction (mtp_block_spec) is not supported by the rollout layout")
    spec = train.transformer_layer_spec
    if isinstance(spec, TransformerBlockSubmodules):
        # A block spec lists the training stage's own layers (dense and MoE mixed by moe_layer_freq): a rollout
        # stage of other layers needs its own, made the same way (the local spec, as the engine requires).
        spec = compat.gpt_decoder_block_spec(config, use_transformer_engine=False,
                                             normalization=config.normalization, vp_stage=vp_stage,
                                             pp_rank=pp_rank)
    else:
        # The training model's --attention-backend is a training choice: generation steps run the rollout's own
        # kernels (inference.attention), any other forward of the rollout model (megatron-core's static engine)
        # megatron-core's DotProductAttention, as before the choice existed; flex would be compiled there.
        spec = with_local_core_attention(spec)
    kwargs = dict(config=config, transformer_layer_spec=spec,
                  vocab_size=train.vocab_size, max_sequence_length=train.max_sequence_length,
                  pre_process=pre, post_process=post, fp16_lm_cross_entropy=train.fp16_lm_cross_entropy,
                  parallel_output=train.parallel_output,
                  share_embeddings_and_output_weights=train.share_embeddings_and_output_weights,
                  position_embedding_type=train.position_embedding_type, rotary_percent=train.rotary_percent,
                  rotary_base=train.rotary_base, rope_scaling=train.rotary_scaling,
                  pg_collection=pg_collection)
    if vp_stage is not None:
        kwargs["vp_stage"] = vp_stage
    return compat.build_gpt_model(**kwargs)


def _share_non_parameter_state(train: torch.nn.Module, chunk: torch.nn.Module) -> None:
    """Positional state is layout-invariant: the rollout chunk uses the training chunk's own.

    The rotary module (``inv_freq``, a plain attribute, with its scaling already applied) is shared outright;
    registered buffers of the same name and shape are copied.
    """
    rotary = getattr(train, "rotary_pos_emb", None)
    if rotary is not None and hasattr(chunk, "rotary_pos_emb"):
        chunk.rotary_pos_emb = rotary
    train_buffers = dict(train.named_buffers())
    for name, buf in chunk.named_buffers():
        src = train_buffers.get(name)
        if src is not None and src.shape == buf.shape:
            buf.copy_(src)
