"""Loading megatron-core's ``DistributedOptimizer`` from a ``dist_checkpointing`` checkpoint with torch's Adam (no
Apex and no Transformer Engine: a CPU, or a GPU without either).

Needed by: megatron-core 0.16.1 (checked there). Both paths assume a fused Adam, which keeps the step in its
param groups, whereas torch's Adam keeps a ``step`` tensor in every parameter's state:

- ``state_dict()`` reads the step from the states and asserts that there is exactly one; an optimizer that has
  not stepped has no states, so ``sharded_state_dict(is_loading=True)`` of a fresh optimizer (every resume) fails
  with a bare ``AssertionError``;
- ``load_state_dict()`` sets every state's step from the checkpoint's param groups and then copies the loaded
  moments and main parameters with ``_set_main_param_and_optimizer_states``, which copies every key of the
  state, ``step`` included, from the loaded tensors, which have none: ``KeyError: 'step'``;
- and the step it sets is one tensor shared by every state, which torch's Adam increments in place once per
  parameter at the next ``step()``: the bias corrections of every later step would be wrong.

:func:`distributed_optimizer_loading` gives such optimizers their (zero) states before the sharded state dict is
built, and for the duration of the block copies only the loaded keys and gives every state a step tensor of its
own (the value the param groups set). Nothing changes with a fused Adam or outside the checked versions.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from packaging.version import Version

#: The megatron-core versions checked to need it.
_TORCH_ADAM_STEP_VERSIONS = (Version("0.16.1"), Version("0.17"))


def _distributed_optimizers(optimizer: Any) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [sub for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]
            if isinstance(sub, DistributedOptimizer)]


def _applies() -> bool:
    from megatron.core import __version__
    from megatron.core.optimizer import distrib_optimizer

    low, high = _TORCH_ADAM_STEP_VERSIONS
    return low <= Version(__version__) < high and not distrib_optimizer.HAVE_APEX_OR_TE


@contextlib.contextmanager
def distributed_optimizer_loading(optimizers: list) -> Iterator[None]:
    """Around building ``sharded_state_dict(is_loading=True)`` of ``optimizers`` (megatron-core optimizers,
    ``ChainedOptimizer`` walked), ``dist_checkpointing.load`` and their ``load_state_dict``."""
    subs = [sub for opt in optimizers for sub in _distributed_optimizers(opt)]
    if not subs or not _applies():
        yield
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for sub in subs:
        if not sub.optimizer.state:  # never stepped: zeros and step 0, which the load overwrites
            sub.init_state_fn(sub.optimizer, sub.config)
            for state in sub.optimizer.state.values():
                state["step"] = torch.tensor(0.0)
    original = DistributedOptimizer.__dict__["_set_main_param_and_optimizer_states"]

    def set_loaded_keys(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        if "step" in state and "step" not in tensors:
            state["step"] = state["step"].clone()  # its own, with the value the param groups set
            tensors = {**tensors, "step": state["step"]}  # copied onto itself
        return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_loaded_keys
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original
