"""Forward passes over a pipeline given its process groups (no Megatron globals): for rollout and checks.

Legend: B batch, S sequence, H hidden, V vocabulary (padded), V_t its tensor-parallel shard.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def pipeline_forward(chunk: torch.nn.Module, pp_group, tokens_BS: torch.Tensor, positions_BS: torch.Tensor,
                     attention_mask: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Forward-only pass of one micro-batch through the stages of ``pp_group``.

    Returns the last stage's logits ``[B, S, V_t]`` there and ``None`` on the other stages. Every stage must be
    given the same ``tokens_BS`` (the first stage embeds them, the others only need their shape).
    """
    size, rank = pp_group.size(), pp_group.rank()
    ranks = dist.get_process_group_ranks(pp_group)
    config = chunk.config
    dtype = config.pipeline_dtype or config.params_dtype
    B, S = tokens_BS.shape
    if rank > 0:
        hidden_SBH = torch.empty(S, B, config.hidden_size, dtype=dtype, device=tokens_BS.device)
        dist.recv(hidden_SBH, src=ranks[rank - 1], group=pp_group)
        chunk.set_input_tensor(hidden_SBH)
    out = chunk(tokens_BS, positions_BS, attention_mask)
    if rank < size - 1:
        dist.send(out.contiguous(), dst=ranks[rank + 1], group=pp_group)
        return None
    return out


def gather_vocab(logits_BSVt: torch.Tensor, tp_group) -> torch.Tensor:
    """All-gather vocabulary-parallel logits to ``[B, S, V]`` (group rank j holds vocabulary shard j, as in every
    megatron-core model and the HybridEngine's rollout model)."""
    if tp_group.size() == 1:
        return logits_BSVt
    parts = [torch.empty_like(logits_BSVt) for _ in range(tp_group.size())]
    dist.all_gather(parts, logits_BSVt.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)
