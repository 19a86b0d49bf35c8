"""The KV cache of one pipeline stage: every attention layer's keys and values in one reserved range.

Per layer, keys and values are ``[N, G, L, D]`` (slot, key/value head of this tensor-parallel rank, position, head
dimension): a slot's positions are contiguous, so a decode step over slots ``0 .. B-1`` and positions
``0 .. A-1`` reads the strided view ``cache[:B, :, :A]`` (no gather, nothing past the filled part).

The whole cache is one :class:`~megatron_hybrid.memory.rollout.RolloutBuffer`, reserved once for the generator's
life from a :class:`~megatron_hybrid.memory.rollout.RolloutMemoryProvider`: its address never changes, so CUDA graphs
captured over it replay in every later rollout. It is backed by memory only while rolling out: with a
:class:`~megatron_hybrid.engine.HybridEngine`'s provider from every ``switch_to_rollout()`` to the
``switch_to_training()``; for a generator without an engine (on a training-layout model) for the duration of each
``generate`` call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ContextManager, Optional

import torch

from ..memory import PerCallRolloutMemory, RolloutMemoryProvider


@dataclass(frozen=True)
class CacheGeometry:
    """The shape of one stage's cache."""

    num_layers: int
    """Attention layers of this pipeline stage."""
    num_slots: int
    """Sequences decoded at once."""
    slot_tokens: int
    """Positions per slot (L): a sequence's prompt plus its generated tokens."""
    kv_heads: int
    """Key/value heads on this tensor-parallel rank (G)."""
    head_dim: int
    """D."""
    dtype: torch.dtype
    spare_slots: int = 0
    """Slots past ``num_slots`` that no sequence owns: padded rows of a CUDA-graph prefill write there."""

    @property
    def cache_slots(self) -> int:
        """Slots of the cache (N): ``num_slots + spare_slots``."""
        return self.num_slots + self.spare_slots

    @property
    def layer_numel(self) -> int:
        """Elements of one layer's keys (or values)."""
        return self.cache_slots * self.kv_heads * self.slot_tokens * self.head_dim

    @property
    def numel(self) -> int:
        return 2 * self.num_layers * self.layer_numel

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Cache bytes one position of one sequence takes on this rank (keys and values of every layer)."""
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class KVCache:
    """Keys and values of every attention layer of one stage, as views of one rollout-only reservation.

    Args:
        geometry: the cache's shape.
        device: where it lives.
        memory: the provider whose lifetime backs the cache (the engine's: from every switch to rollout until the
            switch back); default: one of its own that backs it for the duration of :meth:`backed`.
    """

    def __init__(self, geometry: CacheGeometry, device: torch.device, *,
                 memory: Optional[RolloutMemoryProvider] = None) -> None:
        self.memory: RolloutMemoryProvider = memory if memory is not None else PerCallRolloutMemory(device)
        self.buffer = self.memory.reserve(geometry.numel, geometry.dtype)
        self.geometry = geometry
        flat = self.buffer.tensor
        n, shape = geometry.layer_numel, (geometry.cache_slots, geometry.kv_heads, geometry.slot_tokens,
                                          geometry.head_dim)
        self.keys = [flat[(2 * i) * n: (2 * i + 1) * n].view(shape) for i in range(geometry.num_layers)]
        self.values = [flat[(2 * i + 1) * n: (2 * i + 2) * n].view(shape) for i in range(geometry.num_layers)]

    def backed(self) -> ContextManager[None]:
        """Memory behind the cache (and the provider's other reservations) for the body."""
        return self.memory.backed()

    def data_ptr(self) -> int:
        """Address of the cache (the same for its whole life)."""
        return self.buffer.memory.data_ptr()

    @property
    def mapped_bytes(self) -> int:
        return self.buffer.mapped_bytes

    def close(self) -> None:
        """Give the reservation back."""
        self.buffer.close()

    def move_slots(self, sources: torch.Tensor, targets: torch.Tensor, positions: int) -> None:
        """Copy the first ``positions`` keys and values of slots ``sources`` into slots ``targets`` (int64 on the
        cache's device, disjoint), in every layer: a gather and a scatter per layer's keys or values (one over the
        whole cache would need a copy of every moved slot of every layer at once)."""
        for cache in (*self.keys, *self.values):
            cache[targets, :, :positions] = cache[sources, :, :positions]
