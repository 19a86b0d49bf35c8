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

from typing import Any, Optional, Sequence

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


def split_to(groups: list[list[int]], lengths: Sequence[int], count: int) -> list[list[int]]:
    """``groups`` made ``count`` groups (data-parallel ranks run the same number of micro-batches, so that
    collectives inside the model, MoE's expert all-to-all, stay matched): the group of the most tokens that holds
    two sequences or more is split in two (its sequences, longest first, each into the lighter half) until there
    are ``count``; ``[]`` entries (a filler micro-batch, which trains nothing) where too few sequences remain to
    split. Every group stays within the budget the first packing kept."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        splittable = [g for g in range(len(groups)) if len(groups[g]) > 1]
        if not splittable:
            groups += [[] for _ in range(count - len(groups))]
            break
        g = max(splittable, key=lambda g: (sum(lengths[i] for i in groups[g]), -g))
        halves: list[list[int]] = [[], []]
        load = [0, 0]
        for i in sorted(groups[g], key=lambda i: (-lengths[i], i)):
            h = 0 if load[0] <= load[1] else 1
            halves[h].append(i)
            load[h] += lengths[i]
        groups[g: g + 1] = halves
    return groups


def sequence_lengths(batch: Batch) -> list[int]:
    """Each sequence's real tokens (prompt + response)."""
    return (batch.data["end"] + 1).tolist()


def pack_length(tokens: int, *, multiple: int = 1, fixed: Optional[int] = None) -> int:
    """The length a pack of ``tokens`` real tokens is padded to: ``fixed`` (the pipeline's one shape) or the next
    multiple of ``multiple`` (sequence parallelism splits a pack into tensor-parallel slices of equal length)."""
    if fixed is not None:
        if fixed < tokens or fixed % multiple:
            raise ValueError(f"a pack of {tokens} tokens does not fit the fixed length {fixed} (a multiple of "
                             f"{multiple} at least as long as the budget)")
        return fixed
    return -(-tokens // multiple) * multiple


def packed_micro_batches(batch: Batch, capacity: int, groups: Optional[list[list[int]]] = None, *,
                         multiple: int = 1, fixed: Optional[int] = None) -> list[dict[str, Any]]:
    """``batch``'s sequences as packed micro-batches of at most ``capacity`` tokens (module docstring), grouped
    as ``groups`` says (default: :func:`first_fit_decreasing`). An empty group is a filler: the batch's first
    sequence with its mask zeroed (it trains nothing and :func:`in_batch_order` skips it), ``filler`` set.
    A pack shorter than :func:`pack_length` (``multiple``, ``fixed``) ends in padding tokens (0), a segment of its
    own in ``cu_seqlens`` (attending to itself alone), read by no loss; ``last`` is each sequence's last token in
    the pack."""
    lengths = sequence_lengths(batch)
    device = batch.tokens_BS.device
    if groups is None:
        groups = first_fit_decreasing(lengths, capacity)
    out = []
    for group in groups:
        filler = not group
        group = group or [0]
        rows = torch.tensor(group, device=device)
        lens = [lengths[r] for r in group]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        pad = pack_length(starts[-1], multiple=multiple, fixed=fixed) - starts[-1]
        segments = lens + ([pad] if pad else [])
        tokens = torch.cat([batch.tokens_BS[r, :n] for r, n in zip(group, lens)]
                           + [batch.tokens_BS.new_zeros(pad)]).unsqueeze(0)
        positions = torch.cat([torch.arange(n, device=device) for n in lens]  # the padding's: 0 (read by none)
                              + [torch.zeros(pad, dtype=torch.long, device=device)]).unsqueeze(0)
        start_n1 = torch.tensor(starts[:-1], device=device).unsqueeze(1)
        last_n1 = torch.tensor(lens, device=device).unsqueeze(1) - 1
        # The padded layout's positions within each sequence, moved to where the sequence sits in the pack; the
        # masked ones past a short response stay inside their own sequence.
        index = start_n1 + torch.minimum(batch.index_BN[rows], last_n1)
        cu = starts + ([starts[-1] + pad] if pad else [])
        mb: dict[str, Any] = {"tokens": tokens, "positions": positions, "index": index, "mask": batch.mask_BN[rows],
                              "cu_seqlens": torch.tensor(cu, dtype=torch.int32, device=device),
                              "max_seqlen": max(segments), "rows": rows, "last": (start_n1 + last_n1)[:, 0]}
        # (A routing record stays with the batch: TrainingRouting reads it by the pack's rows.)
        mb.update({k: v[rows] for k, v in batch.data.items() if k != "routed_experts"})
        if filler:
            mb.update(mask=torch.zeros_like(mb["mask"]), filler=True)
        out.append(mb)
    return out


def in_batch_order(values: Sequence[torch.Tensor], micro_batches: Sequence[dict[str, Any]],
                   num_sequences: int) -> torch.Tensor:
    """Per-micro-batch ``[n, ...]`` results as one ``[B, ...]`` tensor in the batch's order (packed micro-batches
    hold sequences in packing order)."""
    first = values[0]
    out = first.new_empty((num_sequences, *first.shape[1:]))
    for value, mb in zip(values, micro_batches):
        if not mb.get("filler", False):
            out[mb["rows"]] = value
    return out
