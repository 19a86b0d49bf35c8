"""The point-to-point and gather collectives of forward passes over given process groups (no Megatron globals).

One home for what the pipeline forward (:mod:`megatron_hybrid.forward`) and the generator's stage runner
(:mod:`megatron_hybrid.inference.runner`) exchange: hidden states sent from one pipeline stage to the next, the last
stage's tensor broadcast to the others, vocabulary-parallel logits gathered over the tensor-parallel group, as
megatron-core's ``tensor_parallel/mappings.py`` gathers: into one preallocated tensor; and for the generator's MoE
layers (:mod:`megatron_hybrid.inference.moe`) the rows of an expert-parallel group gathered and reduce-scattered
back (megatron-core's all-gather token dispatcher), and the small host-side agreement that keeps the replicas of
one expert-parallel group stepping together.

Each helper takes an optional ``errors`` context (a :func:`~megatron_hybrid.groups.collective_errors`, which names
the phase and the timeout when the collective fails) and global ranks computed once by the caller
(:func:`pipeline_peers`), so that a step looks nothing up.

Legend: V vocabulary (padded), V_t its tensor-parallel shard, t the tensor-parallel size.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager, Optional

import torch
import torch.distributed as dist

from ..megatron.compat import all_gather_into_tensor, reduce_scatter_tensor


def pipeline_peers(pp_group) -> tuple[Optional[int], Optional[int], int]:
    """Global ranks of this stage's previous and next stage in ``pp_group`` (None at either end) and of the last."""
    ranks = dist.get_process_group_ranks(pp_group)
    me = ranks.index(dist.get_rank())
    return (ranks[me - 1] if me > 0 else None, ranks[me + 1] if me < len(ranks) - 1 else None, ranks[-1])


def recv_from_previous(out: torch.Tensor, pp_group, *, src: int,
                       errors: Optional[ContextManager] = None) -> torch.Tensor:
    """Receive the previous stage's tensor (global rank ``src``) into ``out``, which is returned."""
    with errors if errors is not None else nullcontext():
        dist.recv(out, src=src, group=pp_group)
    return out


def send_to_next(tensor: torch.Tensor, pp_group, *, dst: int, errors: Optional[ContextManager] = None) -> None:
    """Send ``tensor`` to the next stage (global rank ``dst``)."""
    with errors if errors is not None else nullcontext():
        dist.send(tensor.contiguous(), dst=dst, group=pp_group)


def broadcast_from_last(tensor: torch.Tensor, pp_group, *, src: int,
                        errors: Optional[ContextManager] = None) -> torch.Tensor:
    """The last stage's (global rank ``src``) ``tensor`` on every stage: sent from there, received into it here."""
    with errors if errors is not None else nullcontext():
        dist.broadcast(tensor, src=src, group=pp_group)
    return tensor


def gather_vocab(logits_Vt: torch.Tensor, tp_group, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """All-gather vocabulary-parallel logits ``[..., V_t]`` to ``[..., V]`` (group rank j holds vocabulary shard
    j, as in every megatron-core model and the HybridEngine's rollout model); into ``out`` when given.

    One ``all_gather_into_tensor`` into the shards ``[t, ..., V_t]`` and one copy that moves them to the last
    dimension: the values of a list all-gather and a ``cat``, bit for bit (both are copies). Capturable in a CUDA
    graph (the gather buffer is allocated inside, from the graph's pool, like the list's tensors were).
    """
    t = tp_group.size()
    if t == 1:
        if out is None:
            return logits_Vt
        return out.copy_(logits_Vt)
    logits_Vt = logits_Vt.contiguous()
    shape = logits_Vt.shape
    # The shards one after another along dim 0 (gloo checks the output's shape so; NCCL takes it as well).
    shards = logits_Vt.new_empty((t * shape[0], *shape[1:]))
    all_gather_into_tensor(shards, logits_Vt, tp_group)
    by_vocab = shards.view(t, *shape).movedim(0, -2)  # [..., t, V_t]: shard j holds vocabulary entries j*V_t ...
    if out is None:
        return by_vocab.reshape(*shape[:-1], t * shape[-1])
    out.view(*shape[:-1], t, shape[-1]).copy_(by_vocab)
    return out


def gather_rows(rows_NC: torch.Tensor, group, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """All-gather ``[N, ...]`` over ``group`` into ``[size x N, ...]``, group rank j's rows at ``j*N`` (megatron-core's
    ``gather_from_sequence_parallel_region``, without autograd); into ``out`` when given. Capturable."""
    if out is None:
        out = rows_NC.new_empty((group.size() * rows_NC.shape[0], *rows_NC.shape[1:]))
    all_gather_into_tensor(out, rows_NC.contiguous(), group)
    return out


def reduce_scatter_rows(rows_MC: torch.Tensor, group, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum ``[size x N, ...]`` over ``group`` and keep this rank's ``N`` rows (rows ``j*N ..`` on group rank j:
    megatron-core's ``reduce_scatter_to_sequence_parallel_region``, without autograd); into ``out`` when given."""
    size = group.size()
    assert rows_MC.shape[0] % size == 0, (rows_MC.shape, size)
    if out is None:
        out = rows_MC.new_empty((rows_MC.shape[0] // size, *rows_MC.shape[1:]))
    reduce_scatter_tensor(out, rows_MC.contiguous(), group)
    return out


def collective_device(group) -> torch.device:
    """Where ``group``'s collectives take tensors: this rank's GPU for NCCL, the CPU otherwise (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_over(values: list[float], group) -> list[float]:
    """``values`` summed over ``group`` (one all-reduce, in float64; every rank of the group calls it)."""
    total = torch.tensor(values, dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(total, group=group)
    return total.tolist()


def agree_max(values: list[int], group, *, errors: Optional[ContextManager] = None) -> list[int]:
    """The element-wise maximum of ``values`` over ``group`` (every rank passes as many), on the host: a CPU tensor
    on a gloo group; on an NCCL group a device tensor, read back (a host sync: pass a gloo group where the caller
    cares)."""
    tensor = torch.tensor(values, dtype=torch.int64, device=collective_device(group))
    with errors if errors is not None else nullcontext():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()
