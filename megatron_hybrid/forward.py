"""Forward passes over a pipeline given its process groups (no Megatron globals): for rollout and checks.

Legend: B batch, S sequence, H hidden, V vocabulary (padded), V_t its tensor-parallel shard.
"""

from __future__ import annotations

from typing import Optional

import torch

from .reshard.communication import gather_vocab, pipeline_peers, recv_from_previous, send_to_next

__all__ = ["gather_vocab", "pipeline_forward"]


def pipeline_forward(chunk: torch.nn.Module, pp_group, tokens_BS: torch.Tensor, positions_BS: torch.Tensor,
                     attention_mask: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Forward-only pass of one micro-batch through the stages of ``pp_group``.

    Returns the last stage's logits ``[B, S, V_t]`` there and ``None`` on the other stages. Every stage must be
    given the same ``tokens_BS`` (the first stage embeds them, the others only need their shape).
    """
    previous, following, _ = pipeline_peers(pp_group)
    config = chunk.config
    dtype = config.pipeline_dtype or config.params_dtype
    B, S = tokens_BS.shape
    if previous is not None:
        hidden_SBH = torch.empty(S, B, config.hidden_size, dtype=dtype, device=tokens_BS.device)
        chunk.set_input_tensor(recv_from_previous(hidden_SBH, pp_group, src=previous))
    out = chunk(tokens_BS, positions_BS, attention_mask)
    if following is not None:
        send_to_next(out, pp_group, dst=following)
        return None
    return out
