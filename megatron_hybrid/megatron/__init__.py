"""The megatron-core glue: what the package knows of megatron-core, in one room.

- :mod:`.compat`: every megatron-core version difference and internal we read (0.16.1 to 0.19.x);
- :mod:`.models`: :class:`~.models.GPTArchitecture`, dense or mixture-of-experts, under Megatron-LM's names, and
  the model it builds;
- :mod:`.sharding`: how a full tensor maps onto Megatron's tensor-parallel shards;
- :mod:`.patches`: version-guarded changes to megatron-core's behaviour, applied only by the caller
  (:func:`~.patches.cpu_gloo`: megatron-core on CPU with gloo).

It imports none of the layers built on it. The names below are the room's interface for those layers
(``from megatron_hybrid.megatron import unwrap_model``). They are imported on first use, as the package root's
names are, so importing this package imports none of its modules (checkpoint conversion reads
:class:`~.models.GPTArchitecture` without importing megatron-core).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "GPTArchitecture": ".models",
    "ddp_finish_param_sync": ".compat",
    "full_state_dict": ".sharding",
    "load_full_state_dict": ".sharding",
    "megatron_expert_groups": ".compat",
    "megatron_expert_ranks": ".compat",
    "megatron_groups": ".compat",
    "sequence_parallel_off": ".compat",
    "unwrap_model": ".compat",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
