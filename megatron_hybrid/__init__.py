"""megatron-hybrid: one copy of an RL actor's weights for Megatron-core training and rollout.

The 3D-HybridEngine of HybridFlow (EuroSys 2025, §5) on megatron-core. Public names are imported lazily, so
``import megatron_hybrid`` stays cheap and works without the compiled extension.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "HybridEngine": ".engine",
    "RolloutLayout": ".layout",
    "ParallelLayout": ".layout",
    "native_ops_available": ".kernels.ops",
    "GPTArchitecture": ".megatron.models",
    "CollectiveError": ".groups",
    "WeightMode": ".modes",
    "RolloutWeights": ".modes",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'megatron_hybrid' has no attribute {name!r}")
