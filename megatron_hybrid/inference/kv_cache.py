"""The KV cache of one pipeline stage: every attention layer's keys and values in one reserved range.

Per layer, keys and values are ``[N, G, L, D]`` (slot, key/value head of this tensor-parallel rank, position, head
dimension): a slot's positions are contiguous, so a decode step over slots ``0 .. B-1`` and positions
``0 .. A-1`` reads the strided view ``cache[:B, :, :A]`` (no gather, nothing past the filled part).

The whole cache is one :class:`~megatron_hybrid.memory.ReservedBuffer`, reserved once for the generator's life: its
address never changes, so CUDA graphs captured over it replay in every later rollout. It is backed by memory only
while rolling out: with a :class:`~megatron_hybrid.engine.HybridEngine` the engine maps its rollout reservations at
every ``switch_to_rollout()`` and unmaps them at ``switch_to_training()``; a generator without an engine (on a
training-layout model) maps its cache for the duration of each ``generate`` call.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from ..memory import ReservedBuffer


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


class RolloutMemory:
    """``numel`` elements of ``dtype`` at an address fixed for this object's life, backed only while generating.

    With an engine (``reserve_rollout_memory``), the engine maps the range at every ``switch_to_rollout()`` and
    unmaps it at ``switch_to_training()``; without one, :meth:`backed` maps it for the duration of its body.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, *, engine: Optional[Any] = None) -> None:
        if engine is not None and hasattr(engine, "reserve_rollout_memory"):
            self.buffer = engine.reserve_rollout_memory(numel, dtype)
            self._maps_itself = False
            if not self.buffer.is_mapped(0, self.buffer.numel):
                # Reserved while rolling out: the engine maps its reservations at the next switch, this rollout
                # needs the memory now (one mapping over the whole range, which the engine's unmap removes).
                self.buffer.map(0, self.buffer.numel)
        else:
            self.buffer = ReservedBuffer(numel, dtype, device=device)
            self._maps_itself = True

    def tensor(self) -> torch.Tensor:
        return self.buffer.tensor()

    @contextmanager
    def backed(self) -> Iterator[None]:
        """Memory behind the range for the body (mapped by the engine's rollout, or here)."""
        if not self._maps_itself:
            if not self.buffer.is_mapped(0, self.buffer.numel):
                raise RuntimeError("rollout memory is not backed: generate only while the engine is rolling out")
            yield
            return
        self.buffer.map(0, self.buffer.numel)
        try:
            yield
        finally:
            self.buffer.unmap(0, self.buffer.numel)

    def data_ptr(self) -> int:
        """Address of the range (the same for its whole life)."""
        return self.buffer.data_ptr()

    @property
    def mapped_bytes(self) -> int:
        return self.buffer.mapped_bytes

    def close(self) -> None:
        """Give the reservation back (only one made here; the engine frees its own)."""
        if self._maps_itself:
            self.buffer.close()


class KVCache(RolloutMemory):
    """Keys and values of every attention layer of one stage, as views of one :class:`RolloutMemory`.

    Args:
        geometry: the cache's shape.
        device: where it lives.
        engine: the HybridEngine whose rollout phases back the cache (``reserve_rollout_memory``), or None: the
            cache then maps itself for the duration of :meth:`backed`.
    """

    def __init__(self, geometry: CacheGeometry, device: torch.device, *, engine: Optional[Any] = None) -> None:
        super().__init__(geometry.numel, geometry.dtype, device, engine=engine)
        self.geometry = geometry
        flat = self.tensor()
        n, shape = geometry.layer_numel, (geometry.cache_slots, geometry.kv_heads, geometry.slot_tokens,
                                          geometry.head_dim)
        self.keys = [flat[(2 * i) * n: (2 * i + 1) * n].view(shape) for i in range(geometry.num_layers)]
        self.values = [flat[(2 * i + 1) * n: (2 * i + 2) * n].view(shape) for i in range(geometry.num_layers)]

    def move_slots(self, sources: torch.Tensor, targets: torch.Tensor, positions: int) -> None:
        """Copy the first ``positions`` keys and values of slots ``sources`` into slots ``targets`` (int64 on the
        cache's device, disjoint), in every layer: a gather and a scatter per layer's keys or values (one over the
        whole cache would need a copy of every moved slot of every layer at once)."""
        for cache in (*self.keys, *self.values):
            cache[targets, :, :positions] = cache[sources, :, :positions]
