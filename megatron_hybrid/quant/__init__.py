"""Quantization: FP8 rollout weights (``HybridEngine(rollout_weights="fp8")``).

- :mod:`.fp8`: which dense linear weights become float8 e4m3 with a scale per row, their quantization at every
  switch (from the binding's blocks) and the FP8 linears of the rollout model;
- :mod:`.fp8_kernels`: their Triton kernels (row quantization, the small-M weight-only FP8 matmul) and PyTorch
  references.

Below the inference package: nothing here imports :mod:`megatron_hybrid.inference` (the kernels' shared Triton
helpers are in :mod:`megatron_hybrid.kernels`). The names below are the room's interface for the fused decoder of
:mod:`megatron_hybrid.inference`: the FP8 format (:mod:`.fp8_kernels`, which needs no megatron-core) and the
activations' quantization (:mod:`.fp8`). They are imported on first use, as the package root's names are, so
importing this package imports neither module.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "FP8_DTYPE": ".fp8_kernels",
    "FP8_MAX": ".fp8_kernels",
    "quantize_activations": ".fp8",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
