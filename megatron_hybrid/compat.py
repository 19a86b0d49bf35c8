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
