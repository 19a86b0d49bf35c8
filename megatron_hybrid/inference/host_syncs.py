"""The synchronizing CUDA calls a piece of host code makes, by the Python line that made each one.

The generate loop stays one step ahead of the device (``GenerationConfig.overlap_host``) only if its host code
never waits on the stream outside the step events it reads tokens from. Such waits are easy to write without seeing
them. For example, ``t[index] = 0`` on a CUDA tensor copies the scalar from pageable host memory, a stream sync.
:func:`synchronizing_calls` lists them through torch's sync debug mode, which warns at each one.
"""

from __future__ import annotations

import collections
import warnings
from pathlib import Path
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

# What torch's sync debug mode warns with (c10/cuda/CUDAFunctions.cpp, warn_or_error_on_sync).
_SYNC_WARNING = "called a synchronizing CUDA operation"


def synchronizing_calls(fn: Callable[[], T]) -> tuple[T, collections.Counter]:
    """``fn()``'s result, and how many synchronizing CUDA calls it made, by ``"file.py:line"`` of the Python call.

    Event waits (``torch.cuda.Event.synchronize``) are not counted, nor are calls on a machine without CUDA (where
    nothing is run on a stream).
    """
    if not torch.cuda.is_available():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn()
        return out, _count(caught)
    torch.cuda.synchronize()  # what came before is not this call's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, _count(caught)


def _count(caught: list[warnings.WarningMessage]) -> collections.Counter:
    return collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                               if _SYNC_WARNING in str(w.message))
