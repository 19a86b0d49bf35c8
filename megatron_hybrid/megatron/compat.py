"""Every megatron-core version difference we depend on, guarded here and nowhere else.

Supported: megatron-core 0.16.1 (the newest for Python 3.11) up to 0.19.x.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from typing import Iterator, Optional

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


def gpt_decoder_block_spec(config, *, use_transformer_engine: bool, normalization: Optional[str] = None,
                           vp_stage: Optional[int] = None, pp_rank: Optional[int] = None):
    """``get_gpt_decoder_block_spec``: this pipeline stage's layer specs, dense and MoE mixed by
    ``config.moe_layer_freq``.

    0.16.1 takes ``(config, use_transformer_engine, normalization, qk_l2_norm, vp_stage, pp_rank)``; older and
    some newer trees drop ``pp_rank`` or ``normalization`` (and the newest drop ``use_transformer_engine``), so
    only the keywords this version's signature names are passed.
    """
    import inspect

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    accepted = inspect.signature(get_gpt_decoder_block_spec).parameters
    wanted = dict(use_transformer_engine=use_transformer_engine, normalization=normalization,
                  vp_stage=vp_stage, pp_rank=pp_rank)
    if not use_transformer_engine and "use_transformer_engine" not in accepted:
        wanted.pop("use_transformer_engine")  # a local-only signature
    missing = [name for name, value in wanted.items() if name not in accepted and value is not None]
    if missing:
        raise RuntimeError(f"megatron-core {MCORE_VERSION}'s get_gpt_decoder_block_spec takes none of {missing}")
    return get_gpt_decoder_block_spec(config, **{k: v for k, v in wanted.items() if k in accepted})


def all_gather_into_tensor(output, input_, group, async_op: bool = False):
    """``torch.distributed.all_gather_into_tensor``; torch 2.13 deprecates it for ``all_gather_single``."""
    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        return dist.all_gather_into_tensor(output, input_, group=group, async_op=async_op)


def reduce_scatter_tensor(output, input_, group, async_op: bool = False):
    """``torch.distributed.reduce_scatter_tensor`` (sum); torch 2.13 deprecates it for ``reduce_scatter_single``."""
    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        return dist.reduce_scatter_tensor(output, input_, group=group, async_op=async_op)


def megatron_groups():
    """Megatron's global training groups (tp, pp, dp, cp), read in this one place."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise ValueError("megatron.core.parallel_state is not initialized: call initialize_model_parallel(t, p) "
                         "first, or pass tp_group, pp_group and dp_group explicitly")
    return (ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
            ps.get_data_parallel_group(), ps.get_context_parallel_group())


def megatron_expert_groups():
    """Megatron's global training groups of the expert grid (expert tp, ep, expert dp), read in this one place."""
    from megatron.core import parallel_state as ps

    return (ps.get_expert_tensor_parallel_group(), ps.get_expert_model_parallel_group(),
            ps.get_expert_data_parallel_group())


def megatron_expert_ranks() -> tuple[int, int, int, int]:
    """This rank's (expert-parallel rank, size, expert-tensor-parallel rank, size) in Megatron's global expert
    groups (sizes 1 and the TP group's without experts), read in this one place."""
    from megatron.core import parallel_state as ps

    return (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())


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
        engine = StaticInferenceEngine(controller, max_batch_size=max_batch_size, legacy=True)
    return _scoped_inference_mode(engine)


def _scoped_inference_mode(engine):
    """megatron-core ≥ 0.19: the static engine sets a process-wide ``InferenceMode`` flag in its constructor and
    never clears it, and with the flag set every later GPTModel forward that does not ask for gathered logits
    asserts ("Inference must always gather TP logits"): our own generation and the training log-prob passes.
    Keep the flag to the engine's own ``generate`` calls."""
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:  # 0.16 - 0.18: no such flag
        return engine
    InferenceMode.unset_active()
    generate = engine.generate

    def scoped_generate(*args, **kwargs):
        with InferenceMode.active():
            return generate(*args, **kwargs)

    engine.generate = scoped_generate
    return engine


# ---------------------------------------------------------------------------------------------------------------
# torch.distributed


def _new_group_keeps_order() -> bool:
    import inspect

    import torch.distributed as dist

    return "sort_ranks" in inspect.signature(dist.new_group).parameters


#: torch ≥ 2.13: ``new_group(sort_ranks=False)`` makes the position in ``ranks`` the group rank.
NEW_GROUP_KEEPS_ORDER = _new_group_keeps_order()


def new_group(ranks: list[int], *, timeout, backend: Optional[str] = None):
    """``dist.new_group(ranks, timeout=timeout, backend=backend)`` with group rank i = ``ranks[i]``.

    Older torch sorts the ranks; a list that is not sorted is then refused (a ``ValueError``, raised on every rank
    alike, since the lists are the same everywhere).
    """
    import torch.distributed as dist

    if NEW_GROUP_KEEPS_ORDER:
        return dist.new_group(ranks, timeout=timeout, backend=backend, sort_ranks=False)
    if list(ranks) != sorted(ranks):
        import torch

        raise ValueError(f"this layout needs a process group whose ranks are not in global order ({ranks}); "
                         f"torch {torch.__version__} sorts them: use torch >= 2.13 (new_group(sort_ranks=False))")
    return dist.new_group(ranks, timeout=timeout, backend=backend)


def group_timeout(group):
    """The timeout a process group was created with (``None`` when its backend does not say)."""
    import torch
    import torch.distributed as dist

    backend = dist.get_backend(group)
    device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


# ---------------------------------------------------------------------------------------------------------------
# megatron-core model wrappers: what the engine reads of Megatron DDP (0.16.1 – 0.19.x)


def unwrap_model(chunk):
    """The model inside Megatron's ``DistributedDataParallel`` / ``Float16Module`` wrappers (each ``.module``)."""
    import torch

    while isinstance(getattr(chunk, "module", None), torch.nn.Module):
        chunk = chunk.module
    return chunk


def ddp_param_and_grad_buffers(chunk) -> list:
    """Megatron DDP's ``_ParamAndGradBuffer``s of a wrapped chunk (``ddp.buffers``; also the expert-parallel
    ones), or ``[]`` for an unwrapped model."""
    from megatron.core.distributed import DistributedDataParallel

    if not isinstance(chunk, DistributedDataParallel):
        return []
    return list(chunk.buffers) + list(getattr(chunk, "expert_parallel_buffers", []) or [])


def ddp_uses_distributed_optimizer(chunk) -> bool:
    """Whether Megatron DDP keeps this chunk's parameters in its own buckets (``use_distributed_optimizer``)."""
    return bool(ddp_param_buffers(chunk))


def ddp_param_buffers(chunk) -> list:
    """The ``_ParamAndGradBuffer``s of a chunk that hold its parameters (``buffer.param_data``: Megatron DDP with the
    distributed optimizer, whose all-gather after every step writes into the buckets' ``param_data`` views)."""
    return [buf for buf in ddp_param_and_grad_buffers(chunk) if getattr(buf, "param_data", None) is not None]


def ddp_param_offsets(buffer) -> dict:
    """parameter -> its first element in ``buffer.param_data`` (``param_index_map``: (start, end, bucket id))."""
    return {param: index[0] for param, index in buffer.param_index_map.items()}


def ddp_finish_param_sync(chunk) -> None:
    """Complete the distributed optimizer's parameter all-gather of a chunk, so ``param_data`` holds the weights of
    the last step. With ``overlap_param_gather=True`` the gather after ``step()`` is only dispatched by the next
    forward's pre-hooks (0.16.1 – 0.19.x: ``param_gather_dispatched`` is cleared by ``finish_grad_sync``): run the
    ones not dispatched now, synchronously, and wait for those in flight; the next forward then finds every bucket
    group gathered and gathers nothing."""
    from megatron.core.distributed import DistributedDataParallel

    if not isinstance(chunk, DistributedDataParallel) or not ddp_param_buffers(chunk):
        return
    groups = list(getattr(chunk, "bucket_groups", [])) + list(getattr(chunk, "expert_parallel_bucket_groups", []))
    for group in groups:
        if not group.ddp_config.overlap_param_gather:
            continue  # gathered synchronously by the optimizer's step
        if group.param_gather_dispatched and group.param_gather_handle is None:
            continue  # gathered already (a forward ran since the step)
        group.start_param_sync(force_sync=True)  # waits for one in flight, or gathers now


@contextlib.contextmanager
def sequence_parallel_off(module) -> Iterator[None]:
    """Run ``module`` (a GPTModel stage, plain or wrapped) without sequence parallelism inside the block, e.g. to
    generate with the training-layout model (the KV-cache attention refuses it): its configs'
    ``sequence_parallel`` and what megatron-core's modules copy from it at construction (0.16.1 – 0.19.x: the
    parallel linears' ``sequence_parallel``, the embeddings' ``reduce_scatter_embeddings``) are turned off, and
    restored afterwards."""
    saved = []
    for m in unwrap_model(module).modules():
        for owner, attr in ((m, "sequence_parallel"), (m, "reduce_scatter_embeddings"),
                            (getattr(m, "config", None), "sequence_parallel")):
            if getattr(owner, attr, None) is True:
                saved.append((owner, attr))
                setattr(owner, attr, False)
    try:
        yield
    finally:
        for owner, attr in saved:
            setattr(owner, attr, True)


def _repointed(t, old, new):
    """A view of ``new``'s storage where ``t`` views ``old``'s (``old`` and ``new`` of equal numel and dtype)."""
    import torch

    offset = new.storage_offset() + t.storage_offset() - old.storage_offset()
    return torch.empty(0, dtype=new.dtype, device=new.device).set_(new.untyped_storage(), offset, t.shape, t.stride())


def _distributed_optimizer_views(optimizer) -> list[tuple[list, int]]:
    """(list, index) of the tensors of megatron-core optimizers (``ChainedOptimizer`` walked) that may view DDP's
    parameter buffer: the ``DistributedOptimizer``'s model-parameter shards (``shard_float16_groups``;
    ``shard_fp32_groups``, which are the fp32 optimizer's own parameters). 0.16.1 – 0.19.x names."""
    out = []
    for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        for attr in ("shard_float16_groups", "shard_fp32_groups"):
            for group in getattr(sub, attr, None) or []:
                out.extend((group, i) for i, t in enumerate(group) if t is not None)
    return out


def ddp_move_param_buffer(chunk, buffer, new, *, optimizers=()) -> None:
    """Move Megatron DDP's parameter buffer ``buffer`` of ``chunk`` into ``new`` (a 1-D tensor of its numel and
    dtype), once: values are copied, then every view of the old buffer is pointed at the same place in ``new`` (the
    buffer's and its buckets' ``param_data``, the parameters, the bucket groups' cached shards, and the shards the
    distributed ``optimizers`` built over it). When the old buffer is a storage of its own (DDP's allocation), a
    view of it that nobody told us about is a ``ValueError`` (and nothing moves): it would go on using a second
    copy."""
    import torch

    old = buffer.param_data
    if new.numel() != old.numel() or new.dtype != old.dtype or new.dim() != 1:
        raise AssertionError(f"DDP parameter buffer of {old.numel()} {old.dtype} moved to {new.numel()} {new.dtype}")
    storage = old.untyped_storage()
    alone = old.storage_offset() == 0 and storage.nbytes() == old.numel() * old.element_size()
    groups = list(getattr(chunk, "bucket_groups", [])) + list(getattr(chunk, "expert_parallel_bucket_groups", []))
    views = [(group, i) for opt in optimizers for group, i in _distributed_optimizer_views(opt)
             if group[i].untyped_storage().data_ptr() == storage.data_ptr()]
    params = list(buffer.param_index_map)

    def point(to, frm):
        with torch.no_grad():
            for group, i in views:
                t = group[i]
                if t._base is None or isinstance(t._base, torch.nn.Parameter):
                    t.data = _repointed(t, frm, to)  # an optimizer's parameter (fp32): it keeps its identity
                else:
                    # A view of a detached parameter (bf16: ``param.detach().view(-1)[...]``) would keep its base,
                    # hence the old buffer, alive: a fresh view replaces it, with its Megatron attributes.
                    fresh = _repointed(t, frm, to)
                    fresh.__dict__.update(t.__dict__)
                    group[i] = fresh
            for p in params:
                p.data = _repointed(p.data, frm, to)
            for bucket in buffer.buckets:
                bucket.param_data = _repointed(bucket.param_data, frm, to)
            buffer.param_data = to
        for group in groups:  # rebuilt from bucket.param_data at the next gather
            group.cached_param_buffer_shard_list = [None] * len(group.buckets)

    with torch.no_grad():
        new.copy_(old)
    point(new, old)
    # What still holds the old storage: ``storage`` and ``old`` here, and whatever nobody told us about.
    if alone and storage_use_count(storage) > 2:
        point(old, new)
        raise ValueError("something still views Megatron DDP's parameter buffer after the HybridEngine moved it "
                         "(a distributed optimizer built before the engine?): pass it as "
                         "HybridEngine(..., optimizer=...) so that its views move too")


def storage_use_count(storage) -> int:
    """How many tensors and storage objects share ``storage`` (torch's private ``_storage_Use_Count``)."""
    import torch

    return torch._C._storage_Use_Count(storage._cdata)


def ddp_grad_buffers(chunk):
    """Megatron DDP's contiguous gradient buffers of a chunk (one per dtype), or ``None`` for an unwrapped model."""
    buffers = ddp_param_and_grad_buffers(chunk)
    return [b.grad_data for b in buffers] if buffers else None


# ---------------------------------------------------------------------------------------------------------------
# megatron-core linear layers: the private per-matmul hook the aliased (block-wise) twins override.
# ColumnParallelLinear.forward and RowParallelLinear.forward call ``self._forward_impl(input, weight, ...)``
# (a private method, present from 0.16.1 through 0.19.x; the column one also receives a tied output layer's
# external weight there). Checked at import, so a megatron-core that renames it fails loudly, not silently.

LINEAR_FORWARD_IMPL = "_forward_impl"


def linear_forward_impl(cls):
    """megatron-core's own per-matmul hook of ``cls`` (ColumnParallelLinear or RowParallelLinear)."""
    return getattr(cls, LINEAR_FORWARD_IMPL)


def override_linear_forward_impl(cls, fn) -> None:
    """Install ``fn`` as the per-matmul hook of ``cls``, a subclass of a megatron-core parallel linear."""
    import inspect

    base = next(b for b in cls.__mro__[1:] if b.__module__.startswith("megatron.core"))
    if not hasattr(base, LINEAR_FORWARD_IMPL) or LINEAR_FORWARD_IMPL not in inspect.getsource(base.forward):
        raise ImportError(f"megatron-core {MCORE_VERSION}: {base.__name__}.forward no longer calls "
                          f"{LINEAR_FORWARD_IMPL}; megatron-hybrid's aliased weight mode supports 0.16.1 - 0.19.x")
    setattr(cls, LINEAR_FORWARD_IMPL, fn)


def te_version_known() -> None:
    """megatron-core 0.16's ``get_te_version()`` is None without Transformer Engine, and ``OptimizerConfig`` compares
    it with a version for ``use_precision_aware_optimizer`` (a ``TypeError``); 0.19 reads a missing Transformer
    Engine as version 0.0.0. Do as 0.19 does (nothing when Transformer Engine is there or the version is set)."""
    import megatron.core.utils as mcore_utils

    if getattr(mcore_utils, "_te_version", "absent") is None and importlib.util.find_spec("transformer_engine") is None:
        mcore_utils._te_version = Version("0.0.0")
