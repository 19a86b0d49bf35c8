"""Checks of a generate call, agreed on by every rank before any generation collective.

Ranks hold different prompts, so a bad prompt is seen by one rank while its peers would go on into the micro-DP
gather and wait forever. Every rank therefore checks its own prompts and the shared arguments and writes its first
problem, as UTF-8 text, into its row of a ``[world, MESSAGE_BYTES]`` byte table; one all-reduce gives every rank
every row, and all ranks raise the same ``ValueError`` (the lowest failing rank's), naming the argument, the value
and its type. Text, never pickles: nothing a peer sends is unpickled.

Integers are ``int``s or what ``operator.index`` takes, so numpy integer scalars and 0-dim integer tensors (what
iterating a tokenizer's array or a tensor of ids gives) count as the ints they are, exactly. Booleans do not
(``True`` is not token 1, nor one token to generate), and neither do floats (``3.0``), whatever their value.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
import reprlib
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..reshard import collective_device

# SamplingParams fields that would change what generate returns: refused rather than silently ignored.
UNSUPPORTED_FIELDS = ("num_tokens_total", "top_n_logprobs", "return_prompt_top_n_logprobs", "return_segments",
                      "stop_words")
#: Bytes of a rank's row in the agreement's table: a message longer than this is cut (values are shortened to
#: ~60 characters first, so none of ours is).
MESSAGE_BYTES = 512
#: Seeds are what ``torch.Generator.manual_seed`` is seeded with: 64 bits. It also takes negative ones, folded
#: onto the upper half (-1 is 2**64 - 1): refused here, so that one stream has one name.
SEED_LIMIT = 2**64

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = 6


@dataclass(frozen=True)
class Limits:
    """What the generator can serve."""

    padded_vocab: int
    """Rows of the model's output layer."""
    slot_tokens: int
    """Positions one sequence (prompt plus generated tokens) may take."""


@dataclass(frozen=True)
class CheckedCall:
    """A generate call's arguments as checked, in plain Python types."""

    prompts: list[list[int]]
    params: Any
    """A copy of the ``SamplingParams`` whose checked fields are ints and floats."""
    vocab_size: int
    """The vocabulary generation samples from."""
    stop_token_ids: list[int]
    seed: int
    request_stop_token_ids: Optional[list[list[int]]] = None
    """Per prompt, its own stop tokens (None: no prompt has any)."""


class _Refused(Exception):
    """One rank's first problem, before the ranks agree on it (never leaves this module)."""


def _shown(value: Any) -> str:
    """``value`` and its type, short: ``True, of type bool``."""
    return f"{_REPR.repr(value)}, of type {type(value).__name__}"


def as_int(value: Any) -> Optional[int]:
    """``value`` as an int when it is an integer (see the module's docstring), else None."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and (value.dim() != 0
                                                                        or value.dtype == torch.bool)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _as_real(value: Any) -> Optional[float]:
    """``value`` as a float when it is a real number (an int or a float; not a bool, a string or None)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def _int_arg(name: str, value: Any, what: str) -> int:
    out = as_int(value)
    if out is None:
        raise _Refused(f"{name} ({_shown(value)}) must be {what}")
    return out


def _check_arguments(params, vocab_size: Any, stop_token_ids: Any, seed: Any,
                     limits: Limits) -> tuple[Any, int, list[int], int]:
    """The shared arguments, checked: (params, vocab, stop tokens, seed); raises ``_Refused``."""
    from megatron.core.inference.sampling_params import SamplingParams

    if not isinstance(params, SamplingParams):
        raise _Refused(f"sampling_params ({_shown(params)}) must be a megatron-core SamplingParams "
                       "(megatron.core.inference.sampling_params.SamplingParams)")
    between = f"an integer between 1 and the output layer's padded vocabulary ({limits.padded_vocab})"
    vocab = limits.padded_vocab if vocab_size is None else _int_arg("vocab_size", vocab_size, between)
    if not 1 <= vocab <= limits.padded_vocab:
        raise _Refused(f"vocab_size ({vocab}) must be between 1 and the output layer's padded vocabulary "
                       f"({limits.padded_vocab})")
    n = _int_arg("SamplingParams.num_tokens_to_generate", params.num_tokens_to_generate, "a positive integer")
    if n < 1:
        raise _Refused(f"SamplingParams.num_tokens_to_generate ({n}) must be a positive integer")
    temperature = _as_real(params.temperature)
    if temperature is None or not math.isfinite(temperature) or temperature < 0:
        raise _Refused(f"SamplingParams.temperature ({_shown(params.temperature)}) must be a finite number >= 0")
    top_k = 0 if params.top_k is None else as_int(params.top_k)
    if top_k is None or not 0 <= top_k <= vocab:
        raise _Refused(f"SamplingParams.top_k ({_shown(params.top_k)}) must be an integer in [0, "
                       f"vocab_size={vocab}]")
    top_p = 0.0 if params.top_p is None else _as_real(params.top_p)
    if top_p is None or not 0.0 <= top_p <= 1.0:
        raise _Refused(f"SamplingParams.top_p ({_shown(params.top_p)}) must be in [0, 1]")
    if isinstance(stop_token_ids, (str, bytes)) or not hasattr(stop_token_ids, "__iter__"):
        raise _Refused(f"stop_token_ids ({_shown(stop_token_ids)}) must be a sequence of token ids (() for none)")
    try:
        given = list(stop_token_ids)
    except TypeError:  # a 0-dim tensor has __iter__ but no elements
        raise _Refused(f"stop_token_ids ({_shown(stop_token_ids)}) must be a sequence of token ids (() for none)")
    stops = [_int_arg(f"stop_token_ids[{i}]", s, "an integer token id") for i, s in enumerate(given)]
    termination = None
    if params.termination_id is not None:
        termination = _int_arg("SamplingParams.termination_id", params.termination_id, "None or an integer token id")
    for s in stops + ([termination] if termination is not None else []):
        if not 0 <= s < vocab:
            raise _Refused(f"stop token {s} (stop_token_ids or SamplingParams.termination_id) is outside [0, {vocab})")
    seed = _int_arg("seed", seed, "an integer")
    if not 0 <= seed < SEED_LIMIT:
        raise _Refused(f"seed ({_shown(seed)}) must be in [0, 2**64): torch.Generator takes a 64-bit seed")
    for name in UNSUPPORTED_FIELDS:
        if getattr(params, name, None) not in (None, 0, False):
            raise _Refused(f"SamplingParams.{name} is not supported by this generator"
                           + (" (pass stop_token_ids instead)" if name == "stop_words" else ""))
    checked = dataclasses.replace(params, num_tokens_to_generate=n, temperature=temperature, top_k=top_k,
                                  top_p=top_p, termination_id=termination)
    return checked, vocab, stops, seed


def _check_prompts(prompts: Any, vocab: int, num_tokens: int, limits: Limits, rank: int) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
        raise _Refused(f"prompts (rank {rank}) must be a sequence of token-id sequences, not {_shown(prompts)}")
    out: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
            raise _Refused(f"prompts (rank {rank}) must be a sequence of token-id sequences; element {i} "
                           f"({_shown(prompt)}) is not one")
        where = f"prompt {i} (rank {rank})"
        try:
            length = len(prompt)
        except TypeError:  # a 0-dim tensor has __len__ but no length
            raise _Refused(f"prompts (rank {rank}) must be a sequence of token-id sequences; element {i} "
                           f"({_shown(prompt)}) is not one")
        if length == 0:
            raise _Refused(f"{where} is empty: every prompt needs at least one token")
        ids = []
        for pos, value in enumerate(prompt):
            tok = as_int(value)
            if tok is None:
                raise _Refused(f"{where}: token {pos} ({_shown(value)}) is not an integer token id")
            if not 0 <= tok < vocab:
                raise _Refused(f"{where}: token {pos} is {tok}, outside the vocabulary [0, {vocab})")
            ids.append(tok)
        if len(ids) + num_tokens > limits.slot_tokens:
            raise _Refused(f"{where} has {len(ids)} tokens; with num_tokens_to_generate={num_tokens} it needs "
                           f"{len(ids) + num_tokens} positions, more than a sequence may take in the KV cache "
                           f"(max_sequence_length={limits.slot_tokens})")
        out.append(ids)
    return out


def _check_request_stops(given: Any, count: int, vocab: int, rank: int) -> Optional[list[list[int]]]:
    """``request_stop_token_ids``: None, or one sequence of token ids in ``[0, vocab)`` per prompt (``count``);
    None also when every prompt's is empty. Raises ``_Refused``."""
    if given is None:
        return None
    name = f"request_stop_token_ids (rank {rank})"
    if isinstance(given, (str, bytes)) or not hasattr(given, "__len__"):
        raise _Refused(f"{name} ({_shown(given)}) must hold one sequence of stop token ids per prompt")
    if len(given) != count:
        raise _Refused(f"{name} has {len(given)} entries for {count} prompts: one per prompt (() for none)")
    out = []
    for i, stops in enumerate(given):
        if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__"):
            raise _Refused(f"{name}[{i}] ({_shown(stops)}) must be a sequence of token ids (() for none)")
        ids = [_int_arg(f"{name}[{i}][{j}]", s, "an integer token id") for j, s in enumerate(stops)]
        bad = [s for s in ids if not 0 <= s < vocab]
        if bad:
            raise _Refused(f"{name}[{i}] holds stop token {bad[0]}, outside [0, {vocab})")
        out.append(ids)
    return out if any(out) else None


def check_generate_call(prompts: Any, params, *, vocab_size: Any, stop_token_ids: Any, seed: Any, limits: Limits,
                        group=None, request_stop_token_ids: Any = None) -> CheckedCall:
    """Check one generate call on every rank of ``group`` (default: the world) and agree on the outcome.
    ``request_stop_token_ids``: None, or per prompt its own stop tokens (besides ``stop_token_ids``).

    Returns the call's arguments as plain ints and floats; raises the same ``ValueError`` on every rank when any
    rank's call is bad. One all-reduce of ``MESSAGE_BYTES × world`` bytes, nothing else.
    """
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    checked: Optional[CheckedCall] = None
    problem = ""
    try:
        params, vocab, stops, seed = _check_arguments(params, vocab_size, stop_token_ids, seed, limits)
        clean = _check_prompts(prompts, vocab, params.num_tokens_to_generate, limits, rank)
        own = _check_request_stops(request_stop_token_ids, len(clean), vocab, rank)
        checked = CheckedCall(clean, params, vocab, stops, seed, own)
    except _Refused as refused:
        problem = str(refused)
    device = collective_device(group)
    table = torch.zeros(dist.get_world_size(group), MESSAGE_BYTES, dtype=torch.uint8)
    data = problem.encode()[:MESSAGE_BYTES]
    if data:
        table[rank, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    table = table.to(device)
    dist.all_reduce(table, group=group)  # one row per rank, the others zero: the sum is every rank's row
    failed = table.any(dim=1).nonzero()
    if len(failed):
        row = bytes(table[int(failed[0, 0])].cpu().tolist()).rstrip(b"\0")
        raise ValueError(f"generate: {row.decode('utf-8', 'ignore')}")
    assert checked is not None
    return checked
