"""The engine's two mode choices and the one home of their names.

``WeightMode`` says how the rollout model holds its weights (``HybridEngine(weight_mode=...)``, the recipe's
``--hybrid-weight-mode``); ``RolloutWeights`` in which precision the rollout computes (``HybridEngine(
rollout_weights=...)``, the recipe's ``--rollout-fp8``). Both are ``str`` enums: a plain string of a member's value
is accepted wherever a member is (``weight_mode="canonical"``), compares equal to it and hashes like it.
"""

from __future__ import annotations

import enum
from typing import Any, TypeVar

__all__ = ["RolloutWeights", "WeightMode", "parse_mode"]

_Mode = TypeVar("_Mode", bound=enum.Enum)


class WeightMode(str, enum.Enum):
    """How the rollout model holds its weights."""

    ALIASED = "aliased"
    """Zero redundancy: the rollout model computes on the training shards and the peers' slots, as blocks."""
    CANONICAL = "canonical"
    """The standard Megatron rollout tensors, rebuilt at every switch into memory backed only while rolling out."""

    def __str__(self) -> str:
        return self.value


class RolloutWeights(str, enum.Enum):
    """In which precision the rollout model's weights are."""

    MODEL = "model"
    """The training dtype."""
    FP8 = "fp8"
    """The dense layers' linear weights in FP8 (e4m3, a scale per output row), written by the switch (canonical
    mode only)."""

    def __str__(self) -> str:
        return self.value


def parse_mode(cls: type[_Mode], value: Any, name: str) -> _Mode:
    """``value`` (a member or its string) as a member of ``cls``; ``ValueError`` naming ``name`` and the value."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        for member in cls:
            if member.value == value:
                return member
    raise ValueError(f"{name} ({value!r}) must be one of {tuple(m.value for m in cls)}")
