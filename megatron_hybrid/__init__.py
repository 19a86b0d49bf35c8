"""megatron-hybrid: one copy of an RL actor's weights for Megatron-core training and rollout.

The 3D-HybridEngine of HybridFlow (EuroSys 2025, §5) on megatron-core.
"""

from .ops import native_ops_available

__version__ = "0.1.0"

__all__ = ["native_ops_available", "__version__"]
