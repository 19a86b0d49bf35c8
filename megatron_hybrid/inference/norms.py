"""RMSNorm in one kernel while a generation step runs (:func:`.kernels.rms_norm`, Triton on a GPU).

PyTorch's ``torch.nn.RMSNorm`` (what megatron-core's local layer spec builds, through ``WrappedTorchNorm``) runs as
about eight kernels on a GPU (upcast, square, mean, add, rsqrt, two multiplies, downcast): in a decode step, where
every kernel is short, that is most of the time outside the matrix multiplies. :class:`StepRMSNorm` keeps the module
(its weight, eps and everything else) and changes only its forward while its stage's :class:`~.context.StepContext`
is in a step; outside a step it is ``torch.nn.RMSNorm``, unchanged. The kernel rounds once, like PyTorch's CPU
formula; its sum of squares is added in another order, so it can differ from the training forward by one unit in the
last place.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels import HAVE_TRITON
from . import kernels
from .context import StepContext


class StepRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` that runs :func:`.kernels.rms_norm` while its ``step_context`` is in a step."""

    step_context: Optional[StepContext] = None  # the stage's, given once by install_step_norms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context = self.step_context
        if context is None or context.kv is None or self.weight is None or len(self.normalized_shape) != 1:
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return kernels.rms_norm(x, self.weight, eps)


def install_step_norms(chunk: torch.nn.Module, device: torch.device, context: StepContext) -> list[StepRMSNorm]:
    """Swap the class of every ``torch.nn.RMSNorm`` in ``chunk`` for :class:`StepRMSNorm`, reading its steps from
    ``context``, when its kernel runs on ``device`` (a GPU with Triton); returns them (none otherwise).
    Idempotent."""
    if device.type != "cuda" or not HAVE_TRITON:
        return []
    out = []
    for module in chunk.modules():
        if type(module) is torch.nn.RMSNorm:
            module.__class__ = StepRMSNorm
        if isinstance(module, StepRMSNorm):
            module.step_context = context
            out.append(module)
    return out
