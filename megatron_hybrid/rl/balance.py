"""Data-parallel balance: the step's rollout sequences moved between data-parallel ranks so that each trains about
the same number of tokens (verl's ``balance_batch``).

Generation hands each DP rank the responses to its own prompts, and RL responses are long-tailed: one rank may get
several times the tokens of another, and with packed micro-batches (``--max-tokens-per-micro-batch``) its passes
take that much longer while the others wait at the gradient all-reduce. :func:`balance_batch` moves whole units (a
GRPO group, whose advantages are computed within it, or one sequence) so that every rank keeps its number of units
and the largest rank's tokens are as small as a greedy partition gets them (:func:`balanced_partition`), then
moves the sequences with one ``all_to_all`` per tensor of the batch. Which bin of the partition a rank takes is
chosen to keep as many of its own tokens in place as it can; where the partition is no better than the ranks'
own, nothing moves.

A rank's balanced batch holds its units in one global order (source rank, then position there), so every rank's
result is the same whatever the order the collectives complete in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from ..reshard import collective_device
from .batch import Batch


def balanced_partition(costs: Sequence[int], counts: Sequence[int]) -> list[list[int]]:
    """Indices of ``costs`` into ``len(counts)`` bins, bin j exactly ``counts[j]`` of them: the costliest first,
    each into the least-loaded bin that has room (ties: the lower bin; equal costs: index order). Deterministic.
    The greedy (LPT) bound: the largest bin exceeds the best partition's by at most the costliest unit."""
    if sum(counts) != len(costs):
        raise ValueError(f"counts ({list(counts)}) must sum to the number of units ({len(costs)})")
    bins: list[list[int]] = [[] for _ in counts]
    load = [0] * len(counts)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        j = min((j for j in range(len(counts)) if len(bins[j]) < counts[j]), key=lambda j: (load[j], j))
        bins[j].append(i)
        load[j] += costs[i]
    return [sorted(b) for b in bins]


def assign_bins(bins: list[list[int]], owner: Sequence[int], costs: Sequence[int], counts: Sequence[int]) -> list[int]:
    """Which bin each rank takes: ``owner[i]`` is the rank that holds unit i; a bin goes to a rank whose count it
    matches, the pairs that keep the most tokens in place first (greedy). Returns ``bin_of_rank``."""
    kept = sorted(((sum(costs[i] for i in b if owner[i] == r), -j, -r) for j, b in enumerate(bins)
                   for r in range(len(counts)) if len(b) == counts[r]), reverse=True)
    bin_of_rank = [-1] * len(counts)
    taken = [False] * len(bins)
    for _, neg_j, neg_r in kept:
        j, r = -neg_j, -neg_r
        if bin_of_rank[r] < 0 and not taken[j]:
            bin_of_rank[r], taken[j] = j, True
    assert min(bin_of_rank) >= 0, "every rank's count matches a bin's (the partition kept the counts)"
    return bin_of_rank


@dataclass
class Balance:
    """What :func:`balance_batch` did: the ranks' tokens before and after, and the sequences this rank sent."""

    tokens_before: list[int]
    tokens_after: list[int]
    sequences_sent: int

    def metrics(self) -> dict[str, float]:
        """The largest rank's tokens over the mean, before and after (1 is perfect balance)."""
        def ratio(tokens: list[int]) -> float:
            mean = sum(tokens) / len(tokens)
            return max(tokens) / mean if mean else 1.0

        return {"dp_balance/max_over_mean_before": ratio(self.tokens_before),
                "dp_balance/max_over_mean_after": ratio(self.tokens_after)}


def balance_batch(batch: Batch, *, unit_size: int, group: dist.ProcessGroup) -> tuple[Batch, Balance]:
    """``batch`` (this rank's sequences, ``unit_size`` consecutive ones a unit: a GRPO group, or 1) with the units
    moved between the ranks of ``group`` (data parallelism) so that each rank trains about the same number of
    tokens (module docstring). Every rank keeps its number of units. Collectives on every rank of ``group``:
    an all-gather of the units' token counts, then one all-to-all per tensor of the batch."""
    B = batch.tokens_BS.shape[0]
    if unit_size < 1 or B % unit_size:
        raise ValueError(f"unit_size ({unit_size}) must be ≥ 1 and divide the rank's {B} sequences")
    size, rank = group.size(), group.rank()
    lengths = (batch.data["end"] + 1).to(torch.long)
    unit_tokens = lengths.view(-1, unit_size).sum(1).cpu()
    # Every rank's unit count, then every unit's tokens (padded to the largest count for the all-gather).
    device = collective_device(group)
    count = torch.tensor([unit_tokens.numel()], dtype=torch.long, device=device)
    counts_t = [torch.zeros_like(count) for _ in range(size)]
    dist.all_gather(counts_t, count, group=group)
    counts = [int(c) for c in counts_t]
    padded = torch.zeros(max(counts), dtype=torch.long, device=device)
    padded[: unit_tokens.numel()] = unit_tokens.to(device)
    gathered = [torch.zeros_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    costs: list[int] = []
    owner: list[int] = []
    for r, (c, t) in enumerate(zip(counts, gathered)):
        costs += t[:c].tolist()
        owner += [r] * c
    first = [sum(counts[:r]) for r in range(size)]  # each rank's first unit in the global order
    bins = balanced_partition(costs, counts)
    bin_of_rank = assign_bins(bins, owner, costs, counts)
    if max(sum(costs[i] for i in b) for b in bins) >= max(sum(costs[f: f + c]) for f, c in zip(first, counts)):
        # The greedy partition is no better than the ranks' own (a balanced step): nothing moves.
        bins, bin_of_rank = [list(range(f, f + c)) for f, c in zip(first, counts)], list(range(size))
    dest = [0] * len(costs)
    for r, j in enumerate(bin_of_rank):
        for i in bins[j]:
            dest[i] = r
    # Sequences this rank sends to each rank (its units in order), and receives from each (their units in order).
    mine = range(first[rank], first[rank] + counts[rank])
    send_units = [[i - first[rank] for i in mine if dest[i] == r] for r in range(size)]
    recv_counts = [sum(1 for i in range(first[s], first[s] + counts[s]) if dest[i] == rank) for s in range(size)]
    order = torch.tensor([u * unit_size + k for units in send_units for u in units for k in range(unit_size)],
                         dtype=torch.long)
    send_splits = [len(u) * unit_size for u in send_units]
    recv_splits = [c * unit_size for c in recv_counts]

    def move(t: torch.Tensor) -> torch.Tensor:
        src = t[order.to(t.device)].to(device).contiguous()
        out = src.new_empty((sum(recv_splits), *t.shape[1:]))
        dist.all_to_all_single(out, src, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
        return out.to(t.device)

    moved = Batch(move(batch.tokens_BS), move(batch.index_BN), move(batch.mask_BN), move(batch.scores_B),
                  {k: move(v) for k, v in batch.data.items()})
    after = [sum(costs[i] for i in bins[bin_of_rank[r]]) for r in range(size)]
    before = [sum(costs[first[r]: first[r] + counts[r]]) for r in range(size)]
    return moved, Balance(before, after, sum(send_splits) - send_splits[rank])

