"""Dynamic sampling (DAPO's ``filter_groups``; ``--filter-groups``): GRPO groups whose samples all got the same
reward have zero advantage and give the policy no gradient, so a step drops them and generates more prompts until
it has its quota of groups with some spread.

Within one rollout phase (:func:`~.rollout.generate_on_engine`'s driver), round by round on every rank: a rank
short of its quota (``--global-batch-size`` / ``--num-samples-per-prompt`` / DP groups) admits new prompts (the
first round its quota, later ones its shortfall over the share of groups kept so far, at most 4×), generates and
scores them, and keeps the groups whose rewards differ. The ranks agree on whether anyone is still short (one
all-reduce a round), so every rank runs the same rounds (a rank with enough generates for no prompts). After
``--max-filter-rounds`` rounds a rank still short fills its quota with dropped groups (counted); groups kept past the
quota are discarded (counted). Rank r's k-th admitted prompt is the data set's prompt k · DP + r.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist


@dataclass
class FilteredSamples:
    """A step's samples after filtering, whole groups in order (:func:`filter_groups`)."""

    examples: list[Any] = field(default_factory=list)
    responses: list[list[int]] = field(default_factory=list)
    log_probs: list[list[float]] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    """This rank's ``rounds``, ``generated`` (groups), ``dropped`` (uniform groups), ``uniform_trained`` (dropped
    groups filled back in after the last round), ``surplus`` (groups kept past the quota) and ``tokens`` (every
    response token generated)."""


def uniform(scores: torch.Tensor) -> bool:
    """Whether a group's rewards are all equal (its GRPO advantages are all 0)."""
    return bool(scores.max() == scores.min())


def filter_groups(next_prompt: Callable[[], Any], generate: Callable[[list[list[int]], int], list],
                  score: Callable[[list[Any], list[list[int]], list[list[int]]], torch.Tensor], *, quota: int,
                  group_size: int, max_rounds: int) -> FilteredSamples:
    """``quota`` groups of ``group_size`` samples with some spread in their rewards (module docstring).
    ``next_prompt()``: the next admitted example (with ``.tokens``, maybe ``.stop_token_ids``); ``generate(prompts,
    round)`` (with ``request_stop_token_ids=`` where the examples have stop tokens of their own): the results
    (``generated_tokens``, ``generated_tempered_log_probs``); ``score(examples, prompts, responses)``: the
    rewards (a collective: every rank calls it every round)."""
    from ..reshard import agree_max

    kept: list[tuple] = []
    dropped: list[tuple] = []
    out = FilteredSamples(counts=dict(rounds=0, generated=0, dropped=0, uniform_trained=0, surplus=0, tokens=0))
    for round_ in range(max_rounds):
        short = quota - len(kept)
        if round_ == 0:
            count = quota
        elif short <= 0:
            count = 0
        else:  # the shortfall over the share of groups kept so far (at least a quarter), at most 4 times it
            rate = max(len(kept) / max(out.counts["generated"], 1), 0.25)
            count = min(math.ceil(short / rate), 4 * short)
        if not agree_max([count], dist.group.WORLD)[0]:
            break
        examples = [e for e in (next_prompt() for _ in range(count)) for _ in range(group_size)]
        prompts = [list(e.tokens) for e in examples]
        stops = [list(getattr(e, "stop_token_ids", ())) for e in examples]  # a data row's own stop tokens
        results = generate(prompts, round_, **({"request_stop_token_ids": stops} if any(stops) else {}))
        responses = [list(r.generated_tokens) for r in results]
        scores = score(examples, prompts, responses)
        out.counts["rounds"] += 1
        out.counts["generated"] += count
        out.counts["tokens"] += sum(len(r) for r in responses)
        for g in range(count):
            lo, hi = g * group_size, (g + 1) * group_size
            group = (examples[lo:hi], responses[lo:hi], [list(r.generated_tempered_log_probs) for r in results[lo:hi]],
                     scores[lo:hi].tolist())
            if uniform(scores[lo:hi]):
                dropped.append(group)
                out.counts["dropped"] += 1
            else:
                kept.append(group)
    if len(kept) < quota:  # the rounds ran out: uniform groups fill the quota (they train no policy gradient)
        out.counts["uniform_trained"] = quota - len(kept)
        kept += dropped[: quota - len(kept)]
    out.counts["surplus"] = len(kept) - quota
    for examples, responses, log_probs, scores in kept[:quota]:
        out.examples += examples
        out.responses += responses
        out.log_probs += log_probs
        out.scores += scores
    return out


def zero_variance_groups(scores: torch.Tensor, group_size: int) -> int:
    """How many of the consecutive groups of ``group_size`` rewards in ``scores`` are uniform."""
    return sum(uniform(g) for g in scores.view(-1, group_size))
