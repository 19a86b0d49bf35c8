"""Kernels the rooms share: the native copy ops and the Triton helpers.

- :mod:`.ops`: fused copies between many tensors and one flat buffer, and the block planners of resharding; the
  optional compiled extension ``megatron_hybrid.kernels._C`` (built from ``csrc/``) when it is there, a PyTorch
  reference otherwise;
- :mod:`.triton_helpers`: whether Triton is there and a tensor takes the Triton kernels, and launch helpers, for the
  kernels of :mod:`megatron_hybrid.inference` and :mod:`megatron_hybrid.quant`.

Imports nothing else of the package. The names below are the room's interface for the kernels of other rooms, the
Triton helpers (``from megatron_hybrid.kernels import use_triton``); they are imported on first use, as the package
root's names are, so importing this package imports neither module.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "HAVE_TRITON": ".triton_helpers",
    "next_pow2": ".triton_helpers",
    "num_sms": ".triton_helpers",
    "use_triton": ".triton_helpers",
    "warn_cuda_fallback": ".triton_helpers",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
