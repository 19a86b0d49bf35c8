"""The generation step a model stage is running, as one object its modules read (megatron-core's
``inference_context``, passed here by reference once rather than per call).

The stage runner (:class:`~.runner.StageRunner`) owns a stage's :class:`StepContext`, gives it to the attention
modules (:class:`~.attention.KVCacheSelfAttention`), norms (:class:`~.norms.StepRMSNorm`) and MoE layers
(:class:`~.moe.StepMoELayer`) once when it installs them, and its forwards (:mod:`.stage_forwards`) set and clear the
step in one place, around each forward (:meth:`StepContext.step`). Outside a step the modules are megatron-core's,
unchanged. Nothing else writes step state onto modules.

Legend: T packed tokens, B decode slots, N slots of the cache, G key/value heads on this tensor-parallel rank, L
cached positions per slot, D head dimension.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch


@dataclass
class KVStep:
    """What one forward of the packed tokens needs to know, shared by every attention and MoE layer of a stage."""

    keys: list[torch.Tensor]
    """Per layer of the stage, the key cache ``[N, G, L, D]``."""
    values: list[torch.Tensor]
    """Per layer, the value cache ``[N, G, L, D]``."""
    slots_T: torch.Tensor
    """The cache slot of every packed token."""
    positions_T: torch.Tensor
    """The position of every packed token in its sequence."""
    rotary_T11D: Optional[tuple[torch.Tensor, torch.Tensor]]
    """Cosines and sines of the rotary angles at each token's position, or None without rotary embeddings."""
    decode: bool
    """One query token per row over the cache: a decode step (row b is slot b, T = B), or with ``read_slots_B`` a
    decode step with prompt tokens riding along; otherwise a prefill of whole prompts from position 0."""
    attended: int = 0
    """Decode: cached positions read per slot (at least every slot's position + 1)."""
    mask_B11L: Optional[torch.Tensor] = None
    """Decode: which of the ``attended`` positions each slot may read (None with ``lengths_B``)."""
    lengths_B: Optional[torch.Tensor] = None
    """Decode: positions each row reads (its position + 1), for the attention kernel that reads only those."""
    read_slots_B: Optional[torch.Tensor] = None
    """Decode with ``lengths_B``: the slot each row reads (rows may share one: a prompt's tokens riding along a
    decode step, each reading its slot up to its own position); None: row b reads slot b."""
    moe_rows: int = 0
    """Rows per rank the MoE layers' expert-parallel collectives carry (the agreed maximum over the replicas of an
    expert-parallel group, at least T; 0: T itself)."""
    routed_experts: Optional[list[torch.Tensor]] = None
    """With ``GenerationConfig.record_routing``: per MoE layer of the stage, the record ``[N, L, k]`` its top-k
    experts are written into at each token's ``(slots_T, positions_T)``; None: nothing is recorded."""
    prompts: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """Prefill: ``(length, token indices)`` per prompt length: the packed tokens of all prompts of that length,
    prompt after prompt (one attention call per length, so repeated prompts cost one call)."""


class StepContext:
    """The step now running on one model stage: its :class:`KVStep`, or None outside a step. One per stage: every
    generator over the stage shares it (:func:`stage_context`)."""

    __slots__ = ("kv",)

    def __init__(self) -> None:
        self.kv: Optional[KVStep] = None

    @property
    def in_step(self) -> bool:
        """Whether a generation step runs (the norms' fused kernel applies)."""
        return self.kv is not None

    @contextmanager
    def step(self, kv: KVStep) -> Iterator[None]:
        """``kv`` is the stage's step for the body (a forward of the packed tokens), cleared after it."""
        assert self.kv is None, "generation steps do not nest"
        self.kv = kv
        try:
            yield
        finally:
            self.kv = None


def stage_context(chunk: torch.nn.Module) -> StepContext:
    """The context the modules of ``chunk`` (a model stage) were given when installed, or a new one: a second
    generator over the same stage shares the first one's, so that both reach the modules."""
    for module in chunk.modules():
        context = getattr(module, "step_context", None)
        if isinstance(context, StepContext):
            return context
    return StepContext()
