"""What every Triton kernel of the package shares: whether Triton is there, whether a tensor takes the kernels or
their PyTorch reference, and small launch helpers.

Triton is optional. The kernels of :mod:`megatron_hybrid.inference` (decode attention, top-p sampling, the fused
decoder step) and of :mod:`megatron_hybrid.quant` (FP8) run a PyTorch reference when :func:`use_triton` says no:
Triton is not importable, or the tensors are on the CPU outside Triton's interpreter (``TRITON_INTERPRET=1``, which
the tests use). This module imports nothing of the package, so any room may use it.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Optional

import torch

try:
    import triton  # noqa: F401  (importable: the kernels' modules import it again under HAVE_TRITON)
except ImportError as exc:
    HAVE_TRITON = False
    _TRITON_ERROR: Optional[ImportError] = exc
else:
    HAVE_TRITON = True
    _TRITON_ERROR = None

__all__ = ["HAVE_TRITON", "next_pow2", "num_sms", "use_triton", "warn_cuda_fallback"]

_warned_fallbacks: set[str] = set()


def use_triton(t: torch.Tensor) -> bool:
    """Whether the kernels run for tensors like ``t``: Triton is importable and ``t`` is on a GPU, or Triton's CPU
    interpreter is on (``TRITON_INTERPRET=1`` in the environment before Triton was imported)."""
    return HAVE_TRITON and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def next_pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def warn_cuda_fallback(t: torch.Tensor, what: str) -> None:
    """Warn once per ``what`` (what runs instead) that a CUDA tensor takes a PyTorch reference: Triton is missing."""
    if t.is_cuda and what not in _warned_fallbacks:
        _warned_fallbacks.add(what)
        warnings.warn(f"megatron_hybrid: Triton is not available ({_TRITON_ERROR}); {what}", RuntimeWarning,
                      stacklevel=3)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """The device's streaming multiprocessors (an H200's 132 off a GPU: the interpreter runs the GPU's plan)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H200's: the interpreter then runs the plan the GPU would
