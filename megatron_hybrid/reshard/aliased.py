"""Rollout modules that compute on training shards as blocks ("virtual TP ranks"), so nothing is copied.

After a switch, a rollout TP shard is k training shards that sit in k slots of the gather buffer: not one
tensor. A rollout rank then does the work of the k training TP ranks it stands for: a column-parallel linear
concatenates the k blocks' outputs (re-interleaving gated-MLP halves), a row-parallel linear sums the k partial
products before its usual TP all-reduce, and a vocabulary-parallel embedding looks each token up in the block
that holds it. Parameters keep their Megatron names, shapes and attributes; their storage is a zero-byte
placeholder (``expand`` of one element), and the binding's :class:`BlockTable` says which views it stands for.
Weights never move, so their addresses stay fixed across switches.

Supported: megatron-core's local-spec ``ColumnParallelLinear``, ``RowParallelLinear`` and
``VocabParallelEmbedding``. Other modules with multi-block parameters need ``weight_mode="canonical"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import layers as tpl
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from ..megatron import compat


@dataclass
class Blocks:
    """A rollout parameter as views of training shards, in canonical order along ``dim``."""

    views: list[torch.Tensor]
    dim: int
    stride: int  # each view holds ``stride`` row-chunks that interleave in the canonical tensor

    def materialize(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The canonical tensor (a copy)."""
        if self.stride == 1:
            parts = self.views
        else:
            chunks = [v.chunk(self.stride, dim=self.dim) for v in self.views]
            parts = [c[j] for j in range(self.stride) for c in chunks]
        if out is None:
            return torch.cat(parts, dim=self.dim)
        return torch.cat(parts, dim=self.dim, out=out)


def placeholder(like: torch.Tensor) -> torch.nn.Parameter:
    """A parameter with ``like``'s shape, dtype, device and Megatron attributes, owning no memory."""
    data = torch.zeros(1, dtype=like.dtype, device=like.device).expand(like.shape)
    p = torch.nn.Parameter(data, requires_grad=False)
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "shared", "shared_embedding",
                 "allreduce", "sequence_parallel"):
        if hasattr(like, attr):
            setattr(p, attr, getattr(like, attr))
    return p


class BlockTable:
    """Which rollout parameters compute as blocks, and on which views: owned by the binding, read by the aliased
    modules. Keyed by the parameter object (a tied output layer computes with the embedding's parameter)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[torch.Tensor, Blocks]] = {}

    def set(self, param: torch.Tensor, blocks: Blocks) -> None:
        self._by_id[id(param)] = (param, blocks)  # holding the parameter keeps its id unique

    def get(self, param: Optional[torch.Tensor]) -> Optional[Blocks]:
        entry = self._by_id.get(id(param)) if param is not None else None
        return entry[1] if entry is not None else None

    def clear(self) -> None:
        self._by_id.clear()


class _Aliased:
    """What the block-aware twins share: the binding's table (``None`` until the rollout model is bound)."""

    block_table: Optional[BlockTable] = None

    def blocks_of(self, param: Optional[torch.Tensor]) -> Optional[Blocks]:
        return self.block_table.get(param) if self.block_table is not None else None


def _column(x: torch.Tensor, b: Blocks) -> torch.Tensor:
    ys = [F.linear(x, w) for w in b.views]
    if b.stride == 1:
        return torch.cat(ys, dim=-1)
    chunks = [y.chunk(b.stride, dim=-1) for y in ys]
    return torch.cat([c[j] for j in range(b.stride) for c in chunks], dim=-1)


def _column_impl(self, input, weight, *args, **kwargs):
    b = self.blocks_of(weight)
    if b is None:
        return compat.linear_forward_impl(tpl.ColumnParallelLinear)(self, input, weight, *args, **kwargs)
    bias = kwargs.get("bias", args[0] if args else None)
    y = _column(input, b)
    return y if bias is None else y + bias


def _row_impl(self, input, weight, *args, **kwargs):
    b = self.blocks_of(weight)
    if b is None:
        return compat.linear_forward_impl(tpl.RowParallelLinear)(self, input, weight, *args, **kwargs)
    xs = input.split([w.shape[1] for w in b.views], dim=-1)
    y = F.linear(xs[0], b.views[0])
    for x, w in zip(xs[1:], b.views[1:]):
        y = y + F.linear(x, w)
    return y


class AliasedColumnParallelLinear(_Aliased, tpl.ColumnParallelLinear):
    pass


class AliasedRowParallelLinear(_Aliased, tpl.RowParallelLinear):
    pass


# Megatron's linears call a private per-matmul hook from forward() (the column one also for a tied output layer's
# external weight): override exactly that, behind compat (the versions it is checked for).
compat.override_linear_forward_impl(AliasedColumnParallelLinear, _column_impl)
compat.override_linear_forward_impl(AliasedRowParallelLinear, _row_impl)


class AliasedVocabParallelEmbedding(_Aliased, tpl.VocabParallelEmbedding):
    def forward(self, input_):
        b = self.blocks_of(self.weight)
        if b is None:
            return super().forward(input_)
        if self.reduce_scatter_embeddings:
            raise NotImplementedError("sequence-parallel embeddings are not supported in the rollout layout")
        out = None
        start = self.vocab_start_index
        for w in b.views:
            rows = w.shape[0]
            inside = (input_ >= start) & (input_ < start + rows)
            e = F.embedding((input_ - start).clamp(0, rows - 1), w) * inside.unsqueeze(-1).to(w.dtype)
            out = e if out is None else out + e
            start += rows
        return reduce_from_tensor_model_parallel_region(out, group=self.tp_group)


ALIASED_CLASSES = {
    tpl.ColumnParallelLinear: AliasedColumnParallelLinear,
    tpl.RowParallelLinear: AliasedRowParallelLinear,
    tpl.VocabParallelEmbedding: AliasedVocabParallelEmbedding,
}


def supports_blocks(module: torch.nn.Module) -> bool:
    return type(module) in ALIASED_CLASSES or type(module) in ALIASED_CLASSES.values()


def make_aliased(module: torch.nn.Module) -> None:
    """Swap ``module``'s class for its block-aware twin (same state, same attributes)."""
    cls = ALIASED_CLASSES.get(type(module))
    if cls is None and type(module) not in ALIASED_CLASSES.values():
        raise ValueError(f"{type(module).__name__} cannot compute on blocks; use weight_mode='canonical'")
    if cls is not None:
        module.__class__ = cls
