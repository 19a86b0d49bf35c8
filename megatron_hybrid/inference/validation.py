"""Checks of a generate call, agreed on by every rank before any generation collective.

Ranks hold different prompts, so a bad prompt is seen by one rank while its peers would go on into the micro-DP
gather and wait forever. Every rank therefore checks its own prompts and the shared arguments, writes its first
problem (numbers only) into its row of a ``[world, 6]`` table, and one all-reduce gives every rank every row: all
ranks raise the same ``ValueError`` (the lowest failing rank's), naming the prompt index and the value.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

# SamplingParams fields that would change what generate returns: refused rather than silently ignored.
UNSUPPORTED_FIELDS = ("num_tokens_total", "top_n_logprobs", "return_prompt_top_n_logprobs", "return_segments",
                      "stop_words")
_EMPTY, _NOT_INT, _TOKEN, _TOO_LONG, _NOT_A_LIST = 1, 2, 3, 4, 5
_VOCAB, _NUM_TOKENS, _TEMPERATURE, _TOP_K, _TOP_P, _STOP, _UNSUPPORTED = 10, 11, 12, 13, 14, 15, 16


@dataclass(frozen=True)
class Limits:
    """What the generator can serve."""

    padded_vocab: int
    """Rows of the model's output layer."""
    slot_tokens: int
    """Positions one sequence (prompt plus generated tokens) may take."""


def _message(row: list[float], rank: int) -> str:
    code, index, position, value, limit, extra = (int(x) if math.isfinite(x) and x == int(x) else x for x in row)
    where = f"prompt {index} (rank {rank})"
    if code == _EMPTY:
        return f"{where} is empty: every prompt needs at least one token"
    if code == _NOT_INT:
        return f"{where}: token {position} is not an integer token id"
    if code == _TOKEN:
        return f"{where}: token {position} is {value}, outside the vocabulary [0, {limit})"
    if code == _TOO_LONG:
        return (f"{where} has {value} tokens; with num_tokens_to_generate={extra} it needs {value + extra} positions, "
                f"more than a sequence may take in the KV cache (max_sequence_length={limit})")
    if code == _NOT_A_LIST:
        return f"prompts (rank {rank}) must be a sequence of token-id sequences; element {index} is not one"
    if code == _VOCAB:
        return f"vocab_size ({value}) must be between 1 and the output layer's padded vocabulary ({limit})"
    if code == _NUM_TOKENS:
        return f"SamplingParams.num_tokens_to_generate ({value}) must be a positive integer"
    if code == _TEMPERATURE:
        return f"SamplingParams.temperature ({value}) must be finite and >= 0"
    if code == _TOP_K:
        return f"SamplingParams.top_k ({value}) must be an integer in [0, vocab_size={limit}]"
    if code == _TOP_P:
        return f"SamplingParams.top_p ({value}) must be in [0, 1]"
    if code == _STOP:
        return f"stop token {value} (stop_token_ids or SamplingParams.termination_id) is outside [0, {limit})"
    if code == _UNSUPPORTED:
        return (f"SamplingParams.{UNSUPPORTED_FIELDS[index]} is not supported by this generator"
                + (" (pass stop_token_ids instead)" if UNSUPPORTED_FIELDS[index] == "stop_words" else ""))
    raise AssertionError(f"unknown check code {code}")


def _check_arguments(params, vocab_size: Optional[int], stop_token_ids: Sequence[int],
                     limits: Limits) -> tuple[Optional[list[float]], int]:
    """The first problem with the shared arguments (or None), and the vocabulary generation samples from."""
    vocab = limits.padded_vocab if vocab_size is None else vocab_size
    if not isinstance(vocab, int) or not 1 <= vocab <= limits.padded_vocab:
        return [_VOCAB, 0, 0, float(vocab) if isinstance(vocab, (int, float)) else math.nan, limits.padded_vocab,
                0], vocab
    n = params.num_tokens_to_generate
    if not isinstance(n, int) or n < 1:
        return [_NUM_TOKENS, 0, 0, float(n) if isinstance(n, (int, float)) else math.nan, 0, 0], vocab
    temperature = float(params.temperature)
    if not math.isfinite(temperature) or temperature < 0:
        return [_TEMPERATURE, 0, 0, temperature, 0, 0], vocab
    top_k = params.top_k or 0
    if not isinstance(top_k, int) or not 0 <= top_k <= vocab:
        return [_TOP_K, 0, 0, float(top_k), vocab, 0], vocab
    top_p = float(params.top_p or 0.0)
    if not 0.0 <= top_p <= 1.0:
        return [_TOP_P, 0, 0, top_p, 0, 0], vocab
    stops = list(stop_token_ids) + ([params.termination_id] if params.termination_id is not None else [])
    for s in stops:
        if not isinstance(s, int) or not 0 <= s < vocab:
            return [_STOP, 0, 0, float(s) if isinstance(s, (int, float)) else math.nan, vocab, 0], vocab
    for i, name in enumerate(UNSUPPORTED_FIELDS):
        if getattr(params, name, None) not in (None, 0, False):
            return [_UNSUPPORTED, i, 0, 0, 0, 0], vocab
    return None, vocab


def _check_prompts(prompts: Any, vocab: int, num_tokens: int,
                   limits: Limits) -> tuple[Optional[list[float]], list[list[int]]]:
    out: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
            return [_NOT_A_LIST, i, 0, 0, 0, 0], out
        if len(prompt) == 0:
            return [_EMPTY, i, 0, 0, 0, 0], out
        ids = []
        for pos, tok in enumerate(prompt):
            try:
                tok = operator.index(tok)
            except TypeError:
                return [_NOT_INT, i, pos, 0, 0, 0], out
            if not 0 <= tok < vocab:
                return [_TOKEN, i, pos, float(tok), vocab, 0], out
            ids.append(tok)
        if len(ids) + num_tokens > limits.slot_tokens:
            return [_TOO_LONG, i, 0, len(ids), limits.slot_tokens, num_tokens], out
        out.append(ids)
    return None, out


def check_generate_call(prompts: Any, params, *, vocab_size: Optional[int], stop_token_ids: Sequence[int],
                        limits: Limits, group=None) -> tuple[list[list[int]], int]:
    """Check one generate call on every rank of ``group`` (default: the world) and agree on the outcome.

    Returns the prompts as lists of ints and the vocabulary size to sample from; raises the same ``ValueError`` on
    every rank when any rank's call is bad. One all-reduce of ``6 × world`` numbers, nothing else.
    """
    row, vocab = _check_arguments(params, vocab_size, stop_token_ids, limits)
    clean: list[list[int]] = []
    if row is None:
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
            row = [_NOT_A_LIST, 0, 0, 0, 0, 0]
        else:
            row, clean = _check_prompts(prompts, vocab, params.num_tokens_to_generate, limits)
    group = group if group is not None else dist.group.WORLD
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    table = torch.zeros(dist.get_world_size(group), 6, dtype=torch.float64, device=device)
    if row is not None:
        table[dist.get_rank(group)] = torch.tensor(row, dtype=torch.float64)
    dist.all_reduce(table, group=group)
    failed = (table[:, 0] != 0).nonzero()
    if len(failed):
        rank = int(failed[0, 0])
        raise ValueError(f"generate: {_message(table[rank].tolist(), rank)}")
    return clean, vocab
