"""Binding: every rollout parameter points at its storage once, for the engine's lifetime (fixed addresses).

The buffers never move, so the bindings stay valid across switches; a switch only backs the peers' slots and
fills them. Three kinds of binding, one class per weight mode deciding between the last two:

- a view: the rollout tensor is one training tensor (own, or a peer's slot): zero copies (both modes);
- blocks (:class:`AliasedBinding`, weights): a placeholder standing for the views, computed on by
  :mod:`megatron_hybrid.reshard.aliased`;
- a canonical tensor (:class:`CanonicalBinding`, and 1-D sharded tensors such as biases in either mode):
  storage in a per-dtype range backed only while rolling out, refilled at every switch by one fused
  ``scatter_blocks`` per dtype (or, with t_g > t, by concatenating the own shard's pieces);
- FP8 (``rollout_weights="fp8"``, canonical mode; the dense layers' linear weights,
  :func:`megatron_hybrid.quant.fp8.is_target`): an FP8 tensor and its per-row scales in a range backed only while
  rolling out, refilled at every switch by a :class:`megatron_hybrid.quant.fp8.WeightQuantizer` from the gathered blocks
  (on a GPU, one kernel per row length); the parameter stays a placeholder, and the binding's
  :class:`~megatron_hybrid.quant.fp8.Fp8Table` says which tensors the FP8 linears compute with.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch

from ..kernels import ops
from ..megatron.sharding import expert_indices, global_name, layer_offset
from ..modes import RolloutWeights, WeightMode
from ..quant.fp8 import FP8_DTYPE, Fp8Table, WeightQuantizer, is_target
from .aliased import Blocks, BlockTable, placeholder
from .placement import DTYPE_NAMES, Placement, Placements

#: Buffers that decide what the model computes and change during training, so they move like weights: the MoE
#: router's expert bias (aux-loss-free balancing; Megatron updates it in place after every step).
WEIGHT_BUFFERS = ("router.expert_bias",)


def named_weights(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(global name, name in its chunk, tensor) of every weight of a rank's chunks: the parameters and the
    :data:`WEIGHT_BUFFERS` (layer numbers counted model-wide, routed experts by their global index)."""
    for chunk in chunks:
        offset, experts = layer_offset(chunk), expert_indices(chunk)
        for name, prm in chunk.named_parameters():
            yield global_name(name, offset, experts), name, prm
        for name, buf in chunk.named_buffers():
            if name.endswith(WEIGHT_BUFFERS):
                yield global_name(name, offset, experts), name, buf


def named_parameters(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """(global name, tensor) of every weight of a rank's chunks (see :func:`named_weights`)."""
    for name, _, tensor in named_weights(chunks):
        yield name, tensor


def _replace(chunk: torch.nn.Module, old: torch.Tensor, new: torch.nn.Parameter) -> None:
    for module in chunk.modules():
        for attr, value in module._parameters.items():
            if value is old:
                module._parameters[attr] = new
                return
        for attr, value in module._buffers.items():
            if value is old:  # a weight buffer stays a plain tensor (its binding is a view: already set)
                module._buffers[attr] = new.data
                return
    raise AssertionError("parameter not found in its chunk")


class Binding:
    """Binds a rank's rollout chunks to its :class:`Placements` (a :class:`Placement` per plane: the dense tensors,
    an MoE model's routed experts); :meth:`refill` rebuilds the canonical tensors (and the FP8 ones).

    ``rollout_weights``: ``"fp8"`` gives the :func:`~megatron_hybrid.quant.fp8.is_target` weights FP8 tensors (the
    rollout chunks' linears must be FP8 twins: :func:`megatron_hybrid.reshard.rollout_model.build_rollout_chunks`) in
    the decoder layers ``fp8_layers`` (numbered model-wide; all when None). The other layers' twins compute in the
    training dtype (:func:`~megatron_hybrid.quant.fp8.layers_in_bf16`).
    """

    mode = ""

    def __init__(self, chunks: list[torch.nn.Module], placements: Placements, *,
                 rollout_weights: str = "model", fp8_layers: Optional[range] = None) -> None:
        self.chunks, self.placement = chunks, placements
        self.table = BlockTable()
        self.fp8 = Fp8Table()
        self._refills: list[Callable[[], None]] = []
        # Per plane: the canonical tensors to rebuild by dtype, the FP8 ones, and the peers' ranges rollout
        # parameters view.
        pending: dict[int, dict[torch.dtype, list[tuple[str, torch.nn.Parameter, Blocks]]]] = {}
        quantized: dict[int, list[tuple[torch.nn.Parameter, Blocks]]] = {}
        viewed: dict[int, dict[str, list[tuple[int, int]]]] = {id(p): {} for p in placements.planes.values()}
        for chunk in chunks:
            for name, prm in list(named_parameters([chunk])):
                placement = placements.of(name)
                blocks = placement.blocks(name)
                new = placeholder(prm)
                if rollout_weights == RolloutWeights.FP8 and is_target(name, layers=fp8_layers):
                    # Only the quantization reads the blocks: the peers' slots among them are not kept.
                    quantized.setdefault(id(placement), []).append((new, blocks))
                elif len(blocks.views) == 1 and blocks.views[0].shape == prm.shape:
                    new.data = blocks.views[0]
                    for dtype, lo, hi in placement.peer_ranges(name):
                        viewed[id(placement)].setdefault(dtype, []).append((lo, hi))
                elif self.computes_on_blocks(prm):
                    self.table.set(new, blocks)
                else:
                    assert isinstance(prm, torch.nn.Parameter), name  # weight buffers are replicated: views
                    pending.setdefault(id(placement), {}).setdefault(prm.dtype, []).append((name, new, blocks))
                _replace(chunk, prm, new)
            for module in chunk.modules():
                if hasattr(module, "block_table"):
                    module.block_table = self.table
                if hasattr(module, "fp8_table"):
                    module.fp8_table = self.fp8
        for placement in placements.planes.values():
            self._after_views(placement, viewed[id(placement)])
            for dtype, items in pending.get(id(placement), {}).items():
                self._refills.append(self._canonical(placement, dtype, items))
            if id(placement) in quantized:
                self._refills.append(self._quantized(placement, quantized[id(placement)]))

    def computes_on_blocks(self, prm: torch.nn.Parameter) -> bool:
        """Whether a multi-block rollout parameter stays blocks (else it gets a canonical tensor)."""
        raise NotImplementedError

    def _after_views(self, placement: Placement, viewed: dict[str, list[tuple[int, int]]]) -> None:
        """Told which peers' ranges of ``placement`` rollout parameters view directly."""

    def _canonical(self, placement: Placement, dtype: torch.dtype,
                   items: list[tuple[str, torch.nn.Parameter, Blocks]]) -> Callable[[], None]:
        """Give ``items`` (tensors of ``placement``'s plane) storage in a rollout-only range; return what refills
        them from the gathered buffers."""
        # 16-element alignment keeps every canonical tensor's start vector-friendly for the copy kernels.
        offsets, total = [], 0
        for _, new, _ in items:
            offsets.append(total)
            total += -(-new.numel() // 16) * 16
        flat = placement.reserve_rollout(total, dtype, canonical=True).tensor
        dsts = []
        for (_, new, _), off in zip(items, offsets):
            new.data = flat[off: off + new.numel()].view(new.shape)
            dsts.append(new.data)
        plan = placement.plan
        if plan is None:  # a micro group of one rank: pieces of the own shard, no gather buffer involved
            pairs = [(blocks, dst) for (_, _, blocks), dst in zip(items, dsts)]

            def refill() -> None:
                with torch.no_grad():
                    for blocks, dst in pairs:
                        blocks.materialize(out=dst)

            return refill
        tables = []
        for i, (name, _, blocks) in enumerate(items):
            src = placement.sources[name]
            offs = [placement.where(b.member, b.name)[1] for b in src.blocks]
            tables.append(ops.plan_stack(blocks.views[0].shape, offs, partition_dim=src.dim,
                                         partition_stride=src.stride, dst_index=i))
        source = placement.buffers[DTYPE_NAMES[dtype]].tensor
        table = torch.cat(tables)
        return lambda: ops.scatter_blocks(source, dsts, table)

    def _quantized(self, placement: Placement,
                   items: list[tuple[torch.nn.Parameter, Blocks]]) -> Callable[[], None]:
        """Give ``items`` (2-D weights of ``placement``'s plane) an FP8 tensor and fp32 row scales in one rollout-only
        range of bytes; return what requantizes them from the gathered buffers."""
        # Each tensor starts on 16 bytes: the scales' fp32 view needs 4, vector loads like 16.
        offsets, total = [], 0
        for new, _ in items:
            rows, cols = new.shape
            w_off = total
            s_off = w_off + -(-rows * cols // 16) * 16
            total = s_off + -(-rows * 4 // 16) * 16
            offsets.append((w_off, s_off))
        flat = placement.reserve_rollout(total, torch.uint8, fp8=True).tensor
        targets = []
        for (new, blocks), (w_off, s_off) in zip(items, offsets):
            rows, cols = new.shape
            weight = flat[w_off: w_off + rows * cols].view(FP8_DTYPE).view(rows, cols)
            scale = flat[s_off: s_off + rows * 4].view(torch.float32)
            self.fp8.set(new, weight, scale)
            targets.append((blocks, weight, scale))

        return WeightQuantizer(targets).run

    def refill(self) -> None:
        """Rebuild the canonical tensors (and the FP8 ones) from the freshly gathered buffers."""
        self.fp8.drop_operands()  # derived from the FP8 tensors, which change in place
        for refill in self._refills:
            refill()

    def addresses(self) -> dict[str, list[int]]:
        """Where every rollout parameter's memory is: its storage address, its blocks' addresses, or its FP8 tensor's
        and its scales' addresses."""
        out = {}
        for name, p in named_parameters(self.chunks):
            blocks, fp8 = self.table.get(p), self.fp8.get(p)
            if fp8 is not None:
                out[name] = [t.data_ptr() for t in fp8]
            else:
                out[name] = [v.data_ptr() for v in blocks.views] if blocks is not None else [p.data_ptr()]
        return out

    def unbind(self) -> None:
        """The rollout model loses its weights (placeholders again); the table forgets them."""
        for chunk in self.chunks:
            for _, _, prm in list(named_weights([chunk])):
                _replace(chunk, prm, placeholder(prm))
        self.table.clear()
        self.fp8.clear()
        self._refills = []


class AliasedBinding(Binding):
    """Zero redundancy: multi-block weights compute as blocks of the training tensors and the peers' slots."""

    mode = WeightMode.ALIASED

    def computes_on_blocks(self, prm: torch.nn.Parameter) -> bool:
        return prm.dim() > 1  # 1-D sharded tensors (biases) are cheap to rebuild, and not every module adds blocks


class CanonicalBinding(Binding):
    """The standard Megatron rollout tensors, rebuilt at every switch into a range backed only while rolling out.

    The gathered shards are read once, into the canonical tensors: the peers' slots that no rollout parameter
    views are given back at the end of the switch.
    """

    mode = WeightMode.CANONICAL

    def computes_on_blocks(self, prm: torch.nn.Parameter) -> bool:
        return False

    def _after_views(self, placement: Placement, viewed: dict[str, list[tuple[int, int]]]) -> None:
        placement.keep_only(viewed)


BINDINGS = {cls.mode: cls for cls in (AliasedBinding, CanonicalBinding)}
