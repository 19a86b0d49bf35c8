"""Every megatron-core version difference we depend on, guarded here and nowhere else.

Supported: megatron-core 0.16.1 (the newest for Python 3.11) up to 0.19.x.
"""

from __future__ import annotations

import warnings

from packaging.version import Version

import megatron.core

MCORE_VERSION = Version(megatron.core.__version__)
MIN_VERSION = Version("0.16.1")
MAX_VERSION_EXCLUSIVE = Version("0.20")

if not (MIN_VERSION <= MCORE_VERSION < MAX_VERSION_EXCLUSIVE):
    warnings.warn(f"megatron-hybrid is tested with megatron-core >= {MIN_VERSION}, < {MAX_VERSION_EXCLUSIVE}; "
                  f"found {MCORE_VERSION}", stacklevel=2)

#: 0.17+ deprecates constructing GPTModel directly (it still works; silence the warning at our call sites).
GPTMODEL_DEPRECATION_WARNING = MCORE_VERSION >= Version("0.17")


def build_gpt_model(*args, **kwargs):
    """``GPTModel(*args, **kwargs)``, without 0.17+'s deprecation warning."""
    from megatron.core.models.gpt import GPTModel

    with warnings.catch_warnings():
        if GPTMODEL_DEPRECATION_WARNING:
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            warnings.filterwarnings("ignore", message=".*GPTModel.*deprecat.*")
        return GPTModel(*args, **kwargs)


def all_gather_into_tensor(output, input_, group, async_op: bool = False):
    """``torch.distributed.all_gather_into_tensor``; torch 2.13 deprecates it for ``all_gather_single``."""
    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        return dist.all_gather_into_tensor(output, input_, group=group, async_op=async_op)


def megatron_groups():
    """Megatron's global training groups (tp, pp, dp, cp), read in this one place."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise ValueError("megatron.core.parallel_state is not initialized: call initialize_model_parallel(t, p) "
                         "first, or pass tp_group, pp_group and dp_group explicitly")
    return (ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
            ps.get_data_parallel_group(), ps.get_context_parallel_group())


#: 0.17+ dropped ``InferenceWrapperConfig``: the wrapper takes its process groups from the context's config.
INFERENCE_WRAPPER_CONFIG = MCORE_VERSION < Version("0.17")


def static_inference_engine(model, *, pg_collection, tokenizer, max_batch_size: int, max_sequence_length: int):
    """megatron-core's legacy static inference engine over ``model`` with the given process groups.

    Megatron's pipeline helpers for inference read its global groups, so use this where the model's pipeline
    groups are Megatron's (p = p_g = 1 for a rollout model).
    """
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.engines import StaticInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    context = StaticInferenceContext(max_batch_size, max_sequence_length)
    if INFERENCE_WRAPPER_CONFIG:
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
            InferenceWrapperConfig,
        )

        config = model.config
        wrapper_config = InferenceWrapperConfig(
            hidden_size=config.hidden_size, params_dtype=config.params_dtype,
            inference_batch_times_seqlen_threshold=max_batch_size * max_sequence_length,
            padded_vocab_size=model.vocab_size, inference_max_requests=max_batch_size,
            inference_max_seq_length=max_sequence_length)
        wrapped = GPTInferenceWrapper(model, wrapper_config, context, pg_collection=pg_collection)
    else:
        context.config.pg_collection = pg_collection
        wrapped = GPTInferenceWrapper(model, context)
    controller = TextGenerationController(wrapped, tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return StaticInferenceEngine(controller, max_batch_size=max_batch_size, legacy=True)
