"""Packed micro-batches: a rank's rollout sequences concatenated without padding, at most a token budget each.

RL sequences are long-tailed; padding every sequence of a micro-batch to the longest spends the passes' time and
memory on padding. A packed micro-batch holds whole sequences back to back, ``[1, T]`` tokens with ``T`` at most
``max_tokens_per_micro_batch``, in megatron-core's ``thd`` format: ``cu_seqlens`` marks where each sequence starts,
the model's attention keeps each sequence to itself (``PackedSeqParams``; :mod:`megatron_hybrid.core_attention`)
and the rotary positions restart at every sequence (megatron-core's ``thd`` RoPE reads ``cu_seqlens``; learned
absolute positions read the restarting ``positions``). Sequences go into micro-batches by first-fit decreasing
(:func:`first_fit_decreasing`), which fills them to within a sequence of the budget.

A packed micro-batch has the keys of a padded one (``tokens``, ``index``, ``mask`` and the batch's per-sequence
``data``), its ``n`` sequences' rows of them (``index`` pointing into the pack), and ``positions``,
``cu_seqlens``, ``max_seqlen`` and ``rows`` (which of the batch's sequences it holds, in order).

Legend: B sequences of the batch, n of a micro-batch, T tokens of a pack, N response tokens per sequence.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .batch import Batch


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped so that each group's lengths sum to at most ``capacity``: longest first, each
    into the first group with room (a new group where none has). Deterministic (ties in index order).
    ``ValueError`` naming the budget and the sequence when one is longer than ``capacity``."""
    if capacity < 1:
        raise ValueError(f"max_tokens_per_micro_batch ({capacity}) must be ≥ 1")
    longest = max(range(len(lengths)), key=lambda i: lengths[i], default=None)
    if longest is not None and lengths[longest] > capacity:
        raise ValueError(f"max_tokens_per_micro_batch ({capacity}) is below the longest sequence's "
                         f"{lengths[longest]} tokens (sequence {longest}): a sequence is never split")
    groups: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for g, free in enumerate(room):
            if lengths[i] <= free:
                groups[g].append(i)
                room[g] -= lengths[i]
                break
        else:
            groups.append([i])
            room.append(capacity - lengths[i])
    return groups


def sequence_lengths(batch: Batch) -> list[int]:
    """Each sequence's real tokens (prompt + response)."""
    return (batch.data["end"] + 1).tolist()


def packed_micro_batches(batch: Batch, capacity: int) -> list[dict[str, Any]]:
    """``batch``'s sequences as packed micro-batches of at most ``capacity`` tokens (module docstring)."""
    if "routed_experts" in batch.data:
        raise ValueError("packed micro-batches do not replay MoE routing yet (its record is indexed by padded "
                         "position): leave max_tokens_per_micro_batch unset with routing replay")
    lengths = sequence_lengths(batch)
    device = batch.tokens_BS.device
    out = []
    for group in first_fit_decreasing(lengths, capacity):
        rows = torch.tensor(group, device=device)
        lens = [lengths[r] for r in group]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        tokens = torch.cat([batch.tokens_BS[r, :n] for r, n in zip(group, lens)]).unsqueeze(0)
        positions = torch.cat([torch.arange(n, device=device) for n in lens]).unsqueeze(0)
        start_n1 = torch.tensor(starts[:-1], device=device).unsqueeze(1)
        last_n1 = torch.tensor(lens, device=device).unsqueeze(1) - 1
        # The padded layout's positions within each sequence, moved to where the sequence sits in the pack; the
        # masked ones past a short response stay inside their own sequence.
        index = start_n1 + torch.minimum(batch.index_BN[rows], last_n1)
        mb: dict[str, Any] = {"tokens": tokens, "positions": positions, "index": index, "mask": batch.mask_BN[rows],
                              "cu_seqlens": torch.tensor(starts, dtype=torch.int32, device=device),
                              "max_seqlen": max(lens), "rows": rows}
        mb.update({k: v[rows] for k, v in batch.data.items()})
        out.append(mb)
    return out


def in_batch_order(values: Sequence[torch.Tensor], micro_batches: Sequence[dict[str, Any]],
                   num_sequences: int) -> torch.Tensor:
    """Per-micro-batch ``[n, ...]`` results as one ``[B, ...]`` tensor in the batch's order (packed micro-batches
    hold sequences in packing order)."""
    first = values[0]
    out = first.new_empty((num_sequences, *first.shape[1:]))
    for value, mb in zip(values, micro_batches):
        out[mb["rows"]] = value
    return out
