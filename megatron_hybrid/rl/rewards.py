"""Rewards of an RL run: the built-in verifiable rewards (``--reward-type``), a user's ``--reward-fn`` in either
calling convention, and the accuracy of greedy generation on held-out prompts (``--eval-interval``).

**Final answers.** A response's final answer is read from, in order: the content of its last ``\\boxed{...}``
(braces balanced); else the text after its last ``####`` (GSM8K's marker); else the whole response. Of that
text, the last number counts (an optional minus sign, digits with optional thousands commas, an optional decimal
part: ``"-1,234.50"`` is -1234.5). A ground truth is read the same way, so ``"72"`` and GSM8K's ``"... #### 72"``
both mean 72. Numbers compare by value (``42`` equals ``42.0``); a ground truth without a number is compared as
text with the response's final-answer text (both stripped).

**Built-in rewards** (``--reward-type``), per response, decoded up to its first end-of-sequence token:

- ``exact-match``: 1.0 when the final answer equals the ground truth, else 0.0 (the accuracy);
- ``format``: 1.0 when the response marks a final answer (``\\boxed{...}`` or ``####``) that holds a number;
- ``target-token``: the built-in synthetic task's reward, the fraction of response tokens equal to
  ``--target-token`` (on token ids).

**--reward-fn module:function**, told apart by its signature:

- ``fn(prompts, responses)``: token-id lists, one float per response;
- ``fn(prompts, responses, *, answers)`` (or ``**kwargs``): the same, given the ground truths too (``None`` for
  prompts without one);
- verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` (a function with
  ``solution_str`` and ``ground_truth`` parameters): called once per response on the decoded text, with
  keywords (``data_source`` and ``extra_info`` only when it takes them, as verl's ``gsm8k.compute_score(
  solution_str, ground_truth)`` does not); it returns a number or a dict with ``"score"``, as verl's reward
  managers accept.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist

from ..inference import split_evenly
from .data import Example
from .phases import recorded
from .tokenizers import Tokenizer

REWARD_TYPES = ("exact-match", "format", "target-token")

#: A reward over a step: prompts and responses as token ids, and the examples the prompts came from.
RewardFn = Callable[[list[list[int]], list[list[int]], Sequence[Example]], Sequence[float]]

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?|-?\.\d+")


def _last_boxed(text: str) -> Optional[str]:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: no final answer in a box


def final_answer_text(text: str) -> tuple[str, bool]:
    """The text a final answer is read from (module docstring), and whether the response marked it (``\\boxed``
    or ``####``)."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed, True
    marker = text.rfind("####")
    if marker >= 0:
        return text[marker + len("####"):], True
    return text, False


def last_number(text: str) -> Optional[Decimal]:
    """The last number in ``text`` (thousands commas allowed), or ``None``."""
    numbers = _NUMBER.findall(text)
    return Decimal(numbers[-1].replace(",", "")) if numbers else None


def exact_match(response: str, ground_truth: str) -> float:
    """1.0 when the response's final answer equals ``ground_truth`` (module docstring), else 0.0."""
    expected = last_number(final_answer_text(ground_truth)[0])
    answer_text = final_answer_text(response)[0]
    if expected is None:
        return float(answer_text.strip() == ground_truth.strip())
    got = last_number(answer_text)
    return float(got is not None and got == expected)


def format_score(response: str) -> float:
    """1.0 when the response marks a final answer (``\\boxed{...}`` or ``####``) that holds a number, else 0.0."""
    text, marked = final_answer_text(response)
    return float(marked and last_number(text) is not None)


def decode_response(tokenizer: Tokenizer, tokens: Sequence[int]) -> str:
    """A response's text: its tokens up to the first end-of-sequence token (which generation keeps), decoded."""
    tokens = list(tokens)
    if tokenizer.eod is not None and tokenizer.eod in tokens:
        tokens = tokens[:tokens.index(tokenizer.eod)]
    return tokenizer.detokenize(tokens)


def target_token_reward(target: int) -> RewardFn:
    """The built-in synthetic task: the fraction of response tokens equal to ``target``."""
    def reward(prompts: list[list[int]], responses: list[list[int]], examples: Sequence[Example]) -> list[float]:
        return [sum(t == target for t in r) / max(len(r), 1) for r in responses]
    return reward


def text_reward(score: Callable[[str, Optional[str]], float], tokenizer: Tokenizer) -> RewardFn:
    """``score(response_text, ground_truth)`` for every response."""
    def reward(prompts: list[list[int]], responses: list[list[int]], examples: Sequence[Example]) -> list[float]:
        return [score(decode_response(tokenizer, r), e.answer) for r, e in zip(responses, examples)]
    return reward


def load_callable(spec: str, flag: str = "--reward-fn") -> Callable:
    """``flag``'s ``module:function`` (or ``module:Class``; the module a dotted name or a ``.py`` file) → the
    function; ``ValueError`` naming the flag and the spec when it is not there."""
    kind = "function" if flag == "--reward-fn" else "Class"
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{flag} ({spec!r}) must be 'module:{kind}'")
    try:
        if module_name.endswith(".py"):  # a file (verl's custom_reward_function.path): loaded under its stem
            if not os.path.isfile(module_name):
                raise FileNotFoundError(f"no file {module_name!r}")
            spec_ = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
            module = importlib.util.module_from_spec(spec_)
            spec_.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as e:  # the user's module runs on import: a SyntaxError, a missing package, its own raise
        raise ValueError(f"{flag} ({spec!r}): cannot import module {module_name!r}: {type(e).__name__}: "
                         f"{e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{flag} ({spec!r}): module {module_name!r} has no {kind.lower()} {attr!r}")
    return fn


def reward_fn_style(fn: Callable) -> str:
    """How ``fn`` is called: ``"verl"`` (``compute_score(data_source, solution_str, ground_truth, extra_info)``),
    ``"answers"`` (token lists and ``answers=``) or ``"tokens"`` (token lists only)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or extension callable without a signature: the original call
        return "tokens"
    if {"solution_str", "ground_truth"} <= params.keys():
        return "verl"
    if "answers" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return "answers"
    return "tokens"


def adapt_reward_fn(fn: Callable, tokenizer: Tokenizer) -> RewardFn:
    """A user's ``--reward-fn`` in whichever convention its signature shows (:func:`reward_fn_style`)."""
    style = reward_fn_style(fn)
    if style == "tokens":
        return lambda prompts, responses, examples: fn(prompts, responses)
    if style == "answers":
        return lambda prompts, responses, examples: fn(prompts, responses, answers=[e.answer for e in examples])
    params = inspect.signature(fn).parameters
    # verl's own scorers differ: default_compute_score takes all four, gsm8k.compute_score only the two strings.
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    optional = [name for name in ("data_source", "extra_info") if takes_all or name in params]

    def verl(prompts: list[list[int]], responses: list[list[int]], examples: Sequence[Example]) -> list[Any]:
        out = []
        for r, e in zip(responses, examples):
            given = {"data_source": e.data_source, "extra_info": e.extra_info}
            value = fn(solution_str=decode_response(tokenizer, r), ground_truth=e.answer,
                       **{name: given[name] for name in optional})
            if isinstance(value, dict):  # verl's reward managers take {"score": ..., other logged values}
                if "score" not in value:
                    raise ValueError(f"it returned a dict without 'score' (keys: {', '.join(map(str, value))})")
                value = value["score"]
            out.append(value)
        return out
    return verl


@dataclass(frozen=True)
class Reward:
    """A run's reward, as its flags chose it."""

    fn: RewardFn
    """Scores a step's responses."""
    name: str
    """How the user chose it (``--reward-type exact-match``, ``--reward-fn module:function``), for messages."""

    def for_examples(self, examples: Sequence[Example]) -> Callable[[list[list[int]], list[list[int]]], Any]:
        """The two-argument ``(prompts, responses)`` function of one step whose prompts came from ``examples``
        (one per response), as :func:`megatron_hybrid.rl.reward_scores` calls it."""
        return lambda prompts, responses: self.fn(prompts, responses, examples)


def resolved_reward_type(args: Any) -> Optional[str]:
    """``--reward-type``, or its default: none with ``--reward-fn`` / ``--reward-model-load``, ``exact-match``
    with ``--prompt-data``, else ``target-token``."""
    if args.reward_type is not None:
        return args.reward_type
    if args.reward_fn is not None or args.reward_model_load is not None:
        return None
    return "exact-match" if args.prompt_data is not None else "target-token"


def build_reward(args: Any, tokenizer: Tokenizer) -> Optional[Reward]:
    """The reward of ``--reward-type`` / ``--reward-fn`` (``None`` with ``--reward-model-load``, which the
    training passes score)."""
    if args.reward_fn is not None:
        return Reward(adapt_reward_fn(load_callable(args.reward_fn), tokenizer), f"--reward-fn {args.reward_fn}")
    kind = resolved_reward_type(args)
    if kind is None:
        return None
    if kind == "target-token":
        # Named by its flag, as the synthetic task always was in messages.
        return Reward(target_token_reward(args.target_token), f"--target-token {args.target_token}")
    score = exact_match if kind == "exact-match" else lambda response, answer: format_score(response)
    return Reward(text_reward(score, tokenizer), f"--reward-type {kind}")


def accuracy(tokenizer: Tokenizer, responses: Sequence[Sequence[int]], examples: Sequence[Example]) -> float:
    """The mean :func:`exact_match` of ``responses`` against their examples' answers."""
    return sum(exact_match(decode_response(tokenizer, r), e.answer) for r, e in zip(responses, examples)) \
        / max(len(responses), 1)


@recorded("eval")
def evaluate_accuracy(generate: Callable[[list[list[int]]], list[list[int]]], examples: Sequence[Example],
                      tokenizer: Tokenizer, *, dp_rank: int, dp_size: int, dp_group: Any) -> float:
    """The exact-match accuracy over all of ``examples`` (held-out prompts with answers) of the responses
    ``generate`` gives (the recipe generates greedily; ``generate(prompts, stops)`` where the rows have stop
    tokens of their own); called on every rank. Each DP replica generates an even,
    contiguous share of the examples (an empty one when there are fewer examples than replicas: generation
    takes empty lists on every layout); the counts are summed over ``dp_group``, so every rank returns the same
    value, that of the whole set."""
    lo, hi = split_evenly(len(examples), dp_size)[dp_rank]
    mine = examples[lo:hi]
    stops = [list(e.stop_token_ids) for e in mine]  # a data row's own stop tokens, as in training
    responses = generate([e.tokens for e in mine], stops) if any(stops) else generate([e.tokens for e in mine])
    correct = sum(exact_match(decode_response(tokenizer, r), e.answer) for r, e in zip(responses, mine))
    counts: list[Any] = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(counts, (correct, len(mine)), group=dp_group)
    return sum(c for c, _ in counts) / sum(n for _, n in counts)
