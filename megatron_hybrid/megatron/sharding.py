"""How a full tensor maps onto Megatron's tensor-parallel shards, read from the parameter attributes.

Megatron marks every tensor-parallel parameter with ``tensor_model_parallel=True``, ``partition_dim`` (0 for
column-parallel weights and vocabulary-parallel embeddings, 1 for row-parallel weights) and ``partition_stride``
(2 for the gated MLP's fc1, whose rank-r shard is ``[gate_r; up_r]``). With stride s the full tensor is cut along
``partition_dim`` into ``s · world`` equal pieces and rank r holds pieces ``r, r + world, …`` in that order.
Everything here is pure tensor arithmetic: no process groups.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class TPSpec:
    """The tensor-parallel placement of one parameter."""

    sharded: bool
    """Whether the parameter is split across tensor-parallel ranks (else replicated)."""
    dim: int = 0
    """The split dimension (``partition_dim``)."""
    stride: int = 1
    """Megatron's ``partition_stride``."""

    @classmethod
    def of(cls, param: torch.Tensor) -> "TPSpec":
        if not getattr(param, "tensor_model_parallel", False):
            return cls(sharded=False)
        return cls(sharded=True, dim=int(getattr(param, "partition_dim", 0)),
                   stride=int(getattr(param, "partition_stride", 1)))


def shard(full: torch.Tensor, spec: TPSpec, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` among ``world_size`` tensor-parallel ranks (a new tensor)."""
    if not spec.sharded or world_size == 1:
        return full.clone()
    pieces = full.chunk(spec.stride * world_size, dim=spec.dim)
    if len(pieces) != spec.stride * world_size or full.shape[spec.dim] % (spec.stride * world_size):
        raise ValueError(f"dimension {spec.dim} of size {full.shape[spec.dim]} does not split into "
                         f"{spec.stride} × {world_size} equal pieces")
    return torch.cat([pieces[rank + j * world_size] for j in range(spec.stride)], dim=spec.dim)


def unshard(shards: Sequence[torch.Tensor], spec: TPSpec) -> torch.Tensor:
    """The full tensor from all ranks' shards (inverse of :func:`shard`)."""
    if not spec.sharded or len(shards) == 1:
        return shards[0].clone()
    world = len(shards)
    per_rank = [s.chunk(spec.stride, dim=spec.dim) for s in shards]
    return torch.cat([per_rank[r][j] for j in range(spec.stride) for r in range(world)], dim=spec.dim)


_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"^(?P<moe>.+)\.experts\.local_experts\.(?P<i>\d+)\.(?P<rest>.+)$")


def global_name(name: str, layer_offset: int, experts: Optional[dict[str, list[int]]] = None) -> str:
    """Rename a stage-local parameter name (``decoder.layers.{i}.…``) to its global layer index, and a local
    expert's (``….experts.local_experts.{i}.…``, megatron-core's SequentialMLP) to its global expert index, with
    ``experts`` as :func:`expert_indices` gives them."""
    if experts:
        m = _LOCAL_EXPERT.match(name)
        if m is not None and m["moe"] in experts:
            name = f"{m['moe']}.experts.local_experts.{experts[m['moe']][int(m['i'])]}.{m['rest']}"
    if not layer_offset:
        return name
    return _LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + layer_offset}.", name, count=1)


def expert_indices(model: torch.nn.Module) -> dict[str, list[int]]:
    """Each MoE layer of ``model`` (module name) -> the global index of each of its local experts
    (megatron-core's ``local_expert_indices``: expert-parallel rank j holds experts j · E/e to (j + 1) · E/e − 1)."""
    return {name: list(m.local_expert_indices) for name, m in model.named_modules()
            if getattr(m, "local_expert_indices", None) is not None}


def is_expert(name: str) -> bool:
    """Whether a parameter is a routed expert's (sharded over the expert grid, not the dense one)."""
    return _LOCAL_EXPERT.match(name) is not None


def layer_offset(model: torch.nn.Module) -> int:
    """The global index of a GPTModel stage's first transformer layer."""
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    if not layers:
        return 0
    return int(layers[0].layer_number) - 1


def _all_gather_objects(obj, group) -> list:
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def full_state_dict(chunks: Sequence[torch.nn.Module], *, tp_group, pp_group) -> dict[str, torch.Tensor]:
    """Every parameter of the model as a full tensor with its global name, on every rank of ``tp_group`` ×
    ``pp_group``. Object collectives: for tests, tools and small models, not for the hot path.

    A tied output layer on the last pipeline stage (``shared_embedding``) is reported once, as the embedding.
    """
    from . import compat  # megatron-core only where a model is walked

    local = {}
    for chunk in chunks:
        module = compat.unwrap_model(chunk)
        offset = layer_offset(module)
        for name, p in module.named_parameters():
            if getattr(p, "shared_embedding", False) and name.startswith("output_layer"):
                continue
            local[global_name(name, offset)] = (p.detach().cpu().clone(), TPSpec.of(p))
    tp_parts = _all_gather_objects(local, tp_group)
    merged = {name: unshard([part[name][0] for part in tp_parts], spec) for name, (_, spec) in local.items()}
    full: dict[str, torch.Tensor] = {}
    for stage in _all_gather_objects(merged, pp_group):
        full.update(stage)
    return full


def load_full_state_dict(chunks: Sequence[torch.nn.Module], full: dict[str, torch.Tensor], *, tp_rank: int,
                         tp_size: int) -> None:
    """Copy this rank's shards of ``full`` (global names, as from :func:`full_state_dict`) into the model."""
    from . import compat  # megatron-core only where a model is walked

    for chunk in chunks:
        module = compat.unwrap_model(chunk)
        offset = layer_offset(module)
        for name, p in module.named_parameters():
            key = global_name(name, offset)
            if getattr(p, "shared_embedding", False) and name.startswith("output_layer"):
                key = "embedding.word_embeddings.weight"
            if key not in full:
                raise ValueError(f"parameter {key} is missing from the state dict")
            with torch.no_grad():
                p.copy_(shard(full[key], TPSpec.of(p), tp_rank, tp_size))
