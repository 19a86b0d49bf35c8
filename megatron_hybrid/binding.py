"""Binding: every rollout parameter points at its storage once, for the engine's lifetime (fixed addresses).

The buffers never move, so the bindings stay valid across switches; a switch only backs the peers' slots and
fills them. Three kinds of binding, one class per weight mode deciding between the last two:

- a view: the rollout tensor is one training tensor (own, or a peer's slot): zero copies (both modes);
- blocks (:class:`AliasedBinding`, weights): a placeholder standing for the views, computed on by
  :mod:`megatron_hybrid.aliased`;
- a canonical tensor (:class:`CanonicalBinding`, and 1-D sharded tensors such as biases in either mode):
  storage in a per-dtype range backed only while rolling out, refilled at every switch by one fused
  ``scatter_blocks`` per dtype (or, with t_g > t, by concatenating the own shard's pieces).
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from . import ops
from .aliased import Blocks, BlockTable, placeholder
from .placement import DTYPE_NAMES, Placement
from .sharding import global_name, layer_offset


def named_parameters(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(global name, parameter) of every parameter of a rank's chunks (layer numbers counted model-wide)."""
    for chunk in chunks:
        offset = layer_offset(chunk)
        for name, prm in chunk.named_parameters():
            yield global_name(name, offset), prm


def _replace(chunk: torch.nn.Module, old: torch.nn.Parameter, new: torch.nn.Parameter) -> None:
    for module in chunk.modules():
        for attr, value in module._parameters.items():
            if value is old:
                module._parameters[attr] = new
                return
    raise AssertionError("parameter not found in its chunk")


class Binding:
    """Binds a rank's rollout chunks to a :class:`Placement`; :meth:`refill` rebuilds the canonical tensors."""

    mode = ""

    def __init__(self, chunks: list[torch.nn.Module], placement: Placement) -> None:
        self.chunks, self.placement = chunks, placement
        self.table = BlockTable()
        self._refills: list[Callable[[], None]] = []
        pending: dict[torch.dtype, list[tuple[str, torch.nn.Parameter, Blocks]]] = {}
        viewed: dict[str, list[tuple[int, int]]] = {}  # peers' ranges that rollout parameters view directly
        for chunk in chunks:
            for name, prm in list(named_parameters([chunk])):
                blocks = placement.blocks(name)
                new = placeholder(prm)
                if len(blocks.views) == 1 and blocks.views[0].shape == prm.shape:
                    new.data = blocks.views[0]
                    for dtype, lo, hi in placement.peer_ranges(name):
                        viewed.setdefault(dtype, []).append((lo, hi))
                elif self.computes_on_blocks(prm):
                    self.table.set(new, blocks)
                else:
                    pending.setdefault(prm.dtype, []).append((name, new, blocks))
                _replace(chunk, prm, new)
            for module in chunk.modules():
                if hasattr(module, "block_table"):
                    module.block_table = self.table
        self._after_views(viewed)
        for dtype, items in pending.items():
            self._refills.append(self._canonical(dtype, items))

    def computes_on_blocks(self, prm: torch.nn.Parameter) -> bool:
        """Whether a multi-block rollout parameter stays blocks (else it gets a canonical tensor)."""
        raise NotImplementedError

    def _after_views(self, viewed: dict[str, list[tuple[int, int]]]) -> None:
        """Told which peers' ranges rollout parameters view directly."""

    def _canonical(self, dtype: torch.dtype, items: list[tuple[str, torch.nn.Parameter, Blocks]]) -> Callable[[], None]:
        """Give ``items`` storage in a rollout-only range; return what refills them from the gathered buffers."""
        # 16-element alignment keeps every canonical tensor's start vector-friendly for the copy kernels.
        offsets, total = [], 0
        for _, new, _ in items:
            offsets.append(total)
            total += -(-new.numel() // 16) * 16
        flat = self.placement.reserve_rollout(total, dtype, canonical=True).tensor
        dsts = []
        for (_, new, _), off in zip(items, offsets):
            new.data = flat[off: off + new.numel()].view(new.shape)
            dsts.append(new.data)
        plan = self.placement.plan
        if plan is None:  # t_g > t: pieces of the own shard, no gather buffer involved
            pairs = [(blocks, dst) for (_, _, blocks), dst in zip(items, dsts)]

            def refill() -> None:
                with torch.no_grad():
                    for blocks, dst in pairs:
                        blocks.materialize(out=dst)

            return refill
        tables = []
        for i, (name, _, blocks) in enumerate(items):
            src = self.placement.sources[name]
            offs = [self.placement.where(b.member, b.name)[1] for b in src.blocks]
            tables.append(ops.plan_stack(blocks.views[0].shape, offs, partition_dim=src.dim,
                                         partition_stride=src.stride, dst_index=i))
        source = self.placement.buffers[DTYPE_NAMES[dtype]].tensor
        table = torch.cat(tables)
        return lambda: ops.scatter_blocks(source, dsts, table)

    def refill(self) -> None:
        """Rebuild the canonical tensors from the freshly gathered buffers."""
        for refill in self._refills:
            refill()

    def addresses(self) -> dict[str, list[int]]:
        """Where every rollout parameter's memory is: its storage address, or its blocks' addresses."""
        out = {}
        for name, p in named_parameters(self.chunks):
            blocks = self.table.get(p)
            out[name] = [v.data_ptr() for v in blocks.views] if blocks is not None else [p.data_ptr()]
        return out

    def unbind(self) -> None:
        """The rollout model loses its weights (placeholders again); the table forgets them."""
        for chunk in self.chunks:
            for _, prm in list(chunk.named_parameters()):
                _replace(chunk, prm, placeholder(prm))
        self.table.clear()
        self._refills = []


class AliasedBinding(Binding):
    """Zero redundancy: multi-block weights compute as blocks of the training tensors and the peers' slots."""

    mode = "aliased"

    def computes_on_blocks(self, prm: torch.nn.Parameter) -> bool:
        return prm.dim() > 1  # 1-D sharded tensors (biases) are cheap to rebuild, and not every module adds blocks


class CanonicalBinding(Binding):
    """The standard Megatron rollout tensors, rebuilt at every switch into a range backed only while rolling out.

    The gathered shards are read once, into the canonical tensors: the peers' slots that no rollout parameter
    views are given back at the end of the switch.
    """

    mode = "canonical"

    def computes_on_blocks(self, prm: torch.nn.Parameter) -> bool:
        return False

    def _after_views(self, viewed: dict[str, list[tuple[int, int]]]) -> None:
        self.placement.keep_only(viewed)


BINDINGS = {cls.mode: cls for cls in (AliasedBinding, CanonicalBinding)}
