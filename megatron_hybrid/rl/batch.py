"""A rank's rollout batch: its sequences (prompt + response) right-padded, the positions of the outputs that predict
the response tokens, and the per-sequence tensors the losses read (:class:`Batch`, :func:`make_batch`).

Legend: B sequences, S sequence length, N response tokens (``max_new_tokens``, right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .routing import routed_experts_BSMk


@dataclass
class Batch:
    """One rank's rollout batch. Response-aligned tensors are [B, N]; ``index_BN`` is where the logits that
    predict response token j of sequence b sit in the sequence (position len(prompt_b) − 1 + j)."""

    tokens_BS: torch.Tensor
    """Prompt + response, zero-padded to the sequence length."""
    index_BN: torch.Tensor
    """Positions of the outputs that predict the response tokens."""
    mask_BN: torch.Tensor
    """1 on real response tokens."""
    scores_B: torch.Tensor
    """The sequence rewards."""
    data: dict[str, torch.Tensor]
    """Further per-sequence tensors the losses read (``end``: each sequence's last position; old log-probs, …)."""

    @property
    def num_tokens(self) -> int:
        """The real tokens of all sequences (prompt + response)."""
        return int(self.data["end"].sum()) + self.tokens_BS.shape[0]

    def micro_batches(self, size: int) -> list[dict[str, torch.Tensor]]:
        """Consecutive slices of ``size`` sequences, as dicts (``tokens``, ``index``, ``mask`` and ``data``)."""
        out = []
        for lo in range(0, self.tokens_BS.shape[0], size):
            mb = {"tokens": self.tokens_BS[lo: lo + size], "index": self.index_BN[lo: lo + size],
                  "mask": self.mask_BN[lo: lo + size]}
            mb.update({k: v[lo: lo + size] for k, v in self.data.items()})
            out.append(mb)
        return out


def make_batch(prompts: list[list[int]], responses: list[list[int]], *, max_new_tokens: int, seq_length: int,
               device: torch.device, rollout_log_probs: Optional[list[list[float]]] = None,
               routed_experts: Optional[list[torch.Tensor]] = None,
               loss_masks: Optional[list[list[int]]] = None) -> Batch:
    """The batch of ``prompts[b] + responses[b]``; scores are zero until the reward is known.
    ``rollout_log_probs``: the generator's log-probs of the response tokens, kept as ``data["rollout_logp"]``
    (``[B, N]``, zero-padded). ``routed_experts``: the generator's routing records
    (``GenerationResult.routed_experts``), kept on the host as ``data["routed_experts"]`` (``[B, S, M, k]``, -1
    where nothing was recorded; :mod:`.routing`): the passes then replay or count them. ``loss_masks``: per
    response, 1 at the tokens that train and 0 at the others (a multi-turn sample's observations), in the mask."""
    B, N = len(prompts), max_new_tokens
    tokens = torch.zeros(B, seq_length, dtype=torch.long)
    index = torch.zeros(B, N, dtype=torch.long)
    mask = torch.zeros(B, N)
    end = torch.zeros(B, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        seq = list(p) + list(r)
        tokens[b, : len(seq)] = torch.tensor(seq)
        # Padding positions past a short response point inside the sequence; the mask drops them.
        index[b] = (len(p) - 1 + torch.arange(N)).clamp(max=seq_length - 2)
        mask[b, : len(r)] = 1.0 if loss_masks is None else torch.tensor(loss_masks[b], dtype=mask.dtype)
        end[b] = len(seq) - 1
    data = {"end": end.to(device)}
    if rollout_log_probs is not None:
        logp = torch.zeros(B, N)
        for b, row in enumerate(rollout_log_probs):
            logp[b, : len(row)] = torch.tensor(row)
        data["rollout_logp"] = logp.to(device)
    if routed_experts is not None:
        data["routed_experts"] = routed_experts_BSMk(routed_experts, seq_length)
    return Batch(tokens.to(device), index.to(device), mask.to(device), torch.zeros(B), data)
