"""Prompt data of an RL run: ``--prompt-data`` / ``--eval-prompt-data`` files (JSONL or verl's parquet), the
recipe's ``--prompt-file`` lines and its built-in synthetic prompts, cut into each step's DP slices.

A data file holds one prompt a row:

- **JSONL** (``.jsonl`` or ``.json``): one JSON object a line (blank lines skipped), ``{"prompt": ..., "answer":
  "42"}``, optionally with ``"stop_token_ids": [...]``: token ids that end this prompt's responses besides the
  tokenizer's end token and ``--stop-token-ids`` (as a request's ``stop_token_ids`` in vLLM's sampling parameters);
- **parquet** (``.parquet``, read with ``pyarrow``), as verl writes it: a ``prompt`` column of chat messages and
  the ground truth in ``reward_model.ground_truth``, with optional ``data_source`` and ``extra_info``.

Both formats take both spellings: the ground truth is ``answer`` or ``reward_model.ground_truth`` (a string, or a
finite number that is kept as its digits), ``prompt`` is text (tokenised as it is) or chat messages ``[{"role": ...,
"content": ...}, ...]`` (the tokenizer's chat template applied, with the assistant's turn opened), ``data_source``
is a string and ``extra_info`` an object; other fields are ignored. Every row is checked when the file is read:
a bad row is a ``ValueError`` naming the file, the line (JSONL, from 1) or row (parquet, from 0), and the field;
a prompt that does not fit the model's positions with ``--max-new-tokens`` names the numbers. Under
``--tokenizer-type NullTokenizer`` a text prompt is token ids separated by spaces, each checked against
``--vocab-size``. JSONL and ``--prompt-file`` are UTF-8: another byte names its line and offset in the file.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import math
import os
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Iterator, Optional

import torch

from .tokenizers import HuggingFaceTokenizer, Tokenizer

#: File suffixes of the two formats.
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


@dataclass(frozen=True)
class Example:
    """One prompt of a data set and what its reward needs."""

    tokens: list[int]
    """The prompt's token ids (chat template applied)."""
    answer: Optional[str] = None
    """The ground truth (``None``: the prompt has none, e.g. a ``--prompt-file`` line)."""
    data_source: str = ""
    """verl's ``data_source`` (which task the row is from), for ``compute_score`` functions."""
    extra_info: dict = field(default_factory=dict)
    """verl's ``extra_info``, for ``compute_score`` functions."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end this prompt's responses, besides the run's (a data row's ``stop_token_ids``)."""


def _text_lines(path: str, flag: str) -> Iterator[tuple[int, str]]:
    """``(line number from 1, line)`` of a UTF-8 text file, its line ends as text mode reads them; ``ValueError``
    naming the line and the byte's offset in the file for a byte that is not UTF-8."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        # Everything before the bad byte decodes; its line ends (\n, \r\n or \r, as text mode reads them) count.
        before = data[:e.start].decode("utf-8")
        line = before.replace("\r\n", "\n").replace("\r", "\n").count("\n") + 1
        raise ValueError(f"{flag} {path} line {line}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start} "
                         f"of the file: {e.reason}); save the file as UTF-8") from e
    yield from enumerate(io.StringIO(text, newline=None), start=1)


def _rows(path: str, flag: str) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for every row of ``path``: ``where`` is ``"FILE line N"`` or ``"FILE row N"``."""
    if path.endswith(PARQUET_SUFFIXES):
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ValueError(f"{flag} {path}: reading parquet needs pyarrow (pip install pyarrow): {e}") from e
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow's errors (ArrowInvalid, OSError, ...) for a file that is not parquet
            raise ValueError(f"{flag} {path}: not a readable parquet file ({type(e).__name__}: {e})") from e
        for i, row in enumerate(rows):
            yield f"{flag} {path} row {i}", row
        return
    if not path.endswith(JSONL_SUFFIXES):
        raise ValueError(f"{flag} {path}: the file must end in {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}")
    for n, line in _text_lines(path, flag):
        if not line.strip():
            continue
        try:  # without its newline, a truncated row is reported at its last column, not a next line's first
            row = json.loads(line.rstrip("\r\n"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} {path} line {n}: not JSON ({e.msg} at column {e.colno})") from e
        yield f"{flag} {path} line {n}", row


def _ground_truth(row: dict, where: str) -> str:
    if "answer" in row:
        name, value = "'answer'", row["answer"]
    elif isinstance(row.get("reward_model"), dict) and "ground_truth" in row["reward_model"]:
        name, value = "'reward_model.ground_truth'", row["reward_model"]["ground_truth"]
    else:
        raise ValueError(f"{where}: no ground truth: the row has neither 'answer' nor 'reward_model.ground_truth' "
                         f"(fields: {', '.join(map(repr, row)) or 'none'})")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: {name} must be a string or a number, not {type(value).__name__} ({value!r})")
    if isinstance(value, float):
        # Python's json reads NaN, Infinity and 1e400 as floats (pandas writes a missing value as NaN): no answer.
        if not math.isfinite(value):
            raise ValueError(f"{where}: {name} must be a finite number, not {value}")
        # Its digits, never an exponent: the rewards read "1e+20" as the number 20.
        return format(Decimal(repr(value)), "f")
    return value if isinstance(value, str) else str(value)


def _tokenize(tokenizer: Tokenizer, text: str, where: str) -> list[int]:
    try:
        return tokenizer.tokenize(text)
    except ValueError as e:  # NullTokenizer's: a word that is not a token id of the vocabulary
        raise ValueError(f"{where}: {e}") from e


def _prompt_tokens(prompt: Any, where: str, tokenizer: Tokenizer) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{where}: 'prompt' is empty")
        return _tokenize(tokenizer, prompt, f"{where}: 'prompt'")
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"{where}: 'prompt' must be text or a non-empty list of chat messages, not "
                         f"{type(prompt).__name__} ({prompt!r})")
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: 'prompt'[{i}] must be a message object {{\"role\": ..., \"content\": ...}}, "
                             f"not {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(f"{where}: 'prompt'[{i}]['{key}'] must be a string, not "
                                 f"{type(message.get(key)).__name__}")
    if not isinstance(tokenizer, HuggingFaceTokenizer):
        raise ValueError(f"{where}: 'prompt' is chat messages, which need a chat template: use --tokenizer-type "
                         f"HuggingFaceTokenizer (this run's tokenizer is a {type(tokenizer).__name__})")
    try:
        return tokenizer.apply_chat_template(prompt)
    except ValueError as e:
        raise ValueError(f"{where}: 'prompt' is chat messages: {e}") from e


def _example(row: Any, where: str, tokenizer: Tokenizer) -> Example:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be an object with 'prompt' and 'answer', not {type(row).__name__}")
    if "prompt" not in row:
        raise ValueError(f"{where}: no 'prompt' (fields: {', '.join(map(repr, row)) or 'none'})")
    answer = _ground_truth(row, where)
    data_source = row.get("data_source") if row.get("data_source") is not None else ""
    if not isinstance(data_source, str):
        raise ValueError(f"{where}: 'data_source' must be a string, not {type(data_source).__name__}")
    extra_info = row.get("extra_info") if row.get("extra_info") is not None else {}
    if not isinstance(extra_info, dict):
        raise ValueError(f"{where}: 'extra_info' must be an object, not {type(extra_info).__name__}")
    tokens = _prompt_tokens(row["prompt"], where, tokenizer)
    if not tokens:
        raise ValueError(f"{where}: 'prompt' tokenises to no tokens")
    return Example(tokens, answer, data_source, extra_info, _stop_tokens(row, where, tokenizer.vocab_size))


def _stop_tokens(row: dict, where: str, vocab: int) -> tuple[int, ...]:
    """A row's ``stop_token_ids`` (absent or null: none), each an integer token id below ``vocab``."""
    given = row.get("stop_token_ids")
    if given is None:
        return ()
    if not isinstance(given, (list, tuple)) and not hasattr(given, "tolist"):  # parquet gives numpy arrays
        raise ValueError(f"{where}: 'stop_token_ids' must be a list of token ids, not {type(given).__name__}")
    ids = given.tolist() if hasattr(given, "tolist") else list(given)
    for i, tok in enumerate(ids):
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise ValueError(f"{where}: 'stop_token_ids'[{i}] ({tok!r}) must be an integer token id")
        if not 0 <= tok < vocab:
            raise ValueError(f"{where}: 'stop_token_ids'[{i}] is {tok}, outside the vocabulary [0, {vocab})")
    return tuple(ids)


def check_fits(tokens: list[int], where: str, *, max_new_tokens: int, max_positions: int) -> None:
    """``ValueError`` naming ``where`` and the numbers when the prompt and ``max_new_tokens`` exceed the
    model's positions."""
    if len(tokens) + max_new_tokens > max_positions:
        raise ValueError(f"{where}: the prompt is {len(tokens)} tokens; with --max-new-tokens ({max_new_tokens}) "
                         f"that is {len(tokens) + max_new_tokens} positions, more than the model's "
                         f"--max-position-embeddings ({max_positions})")


def load_prompt_data(path: str, tokenizer: Tokenizer, *, max_new_tokens: int, max_positions: int,
                     flag: str = "--prompt-data") -> list[Example]:
    """Every row of a JSONL or parquet prompt file (module docstring), tokenised and checked; ``flag`` is how the
    user named the file (in the messages). ``ValueError`` for a bad row, an empty file or a missing pyarrow."""
    examples = []
    for where, row in _rows(path, flag):
        example = _example(row, where, tokenizer)
        check_fits(example.tokens, where, max_new_tokens=max_new_tokens, max_positions=max_positions)
        examples.append(example)
    if not examples:
        raise ValueError(f"{flag} {path}: the file holds no rows")
    return examples


def eval_prompts(args: argparse.Namespace, tokenizer: Tokenizer, *, max_positions: int) -> Optional[list[Example]]:
    """The held-out prompts of ``--eval-prompt-data`` (``None`` without it, or without ``--eval-interval``)."""
    if args.eval_prompt_data is None or args.eval_interval is None:
        return None
    return load_prompt_data(args.eval_prompt_data, tokenizer, max_new_tokens=args.max_new_tokens,
                            max_positions=max_positions, flag="--eval-prompt-data")


class Prompts:
    """The training prompts of each step, the same whatever the layout: the step's global list (cycling through
    ``--prompt-data`` or ``--prompt-file`` in file order, else drawn at random from ``--seed`` and the step),
    cut into DP slices."""

    def __init__(self, args: argparse.Namespace, tokenizer: Tokenizer, *, max_positions: int) -> None:
        self.args, self.vocab = args, tokenizer.vocab_size
        self.examples: Optional[list[Example]] = None
        if args.prompt_data is not None:
            self.examples = load_prompt_data(args.prompt_data, tokenizer, max_new_tokens=args.max_new_tokens,
                                             max_positions=max_positions)
        elif args.prompt_file is not None:
            self.examples = []
            for n, line in _text_lines(args.prompt_file, "--prompt-file"):
                if line.strip():
                    where = f"--prompt-file {args.prompt_file} line {n}"
                    self.examples.append(Example(_tokenize(tokenizer, line.rstrip("\n"), where)))
                    check_fits(self.examples[-1].tokens, where, max_new_tokens=args.max_new_tokens,
                               max_positions=max_positions)
            if not self.examples:  # every step cycles through the prompts
                raise ValueError(f"--prompt-file {args.prompt_file} holds no prompts (it is empty or blank)")

    @property
    def has_answers(self) -> bool:
        """Whether the prompts come with ground truths (``--prompt-data``)."""
        return self.args.prompt_data is not None

    @property
    def has_stop_tokens(self) -> bool:
        """Whether some prompt has stop tokens of its own (a data row's ``stop_token_ids``)."""
        return any(e.stop_token_ids for e in self.examples or ())

    @property
    def max_length(self) -> int:
        """The longest prompt, in tokens."""
        return max(len(e.tokens) for e in self.examples) if self.examples else self.args.prompt_length

    def per_step(self) -> int:
        return self.args.global_batch_size // self.args.num_samples_per_prompt

    def for_step(self, step: int, *, dp_rank: int, dp_size: int) -> list[Example]:
        n = self.per_step()
        if self.examples is not None:
            everything = [self.examples[(step * n + i) % len(self.examples)] for i in range(n)]
        else:
            g = torch.Generator().manual_seed(self.args.seed * 1_000_003 + step)
            everything = [Example(t) for t in torch.randint(0, self.vocab, (n, self.args.prompt_length),
                                                            generator=g).tolist()]
        per = n // dp_size
        return everything[dp_rank * per: (dp_rank + 1) * per]

    def example(self, index: int) -> Example:
        """The data set's prompt ``index`` (partial rollout admits prompts one by one, not a step's at a time): the
        file's, cycling, or drawn at random from ``--seed`` and ``index``."""
        if self.examples is not None:
            return self.examples[index % len(self.examples)]
        g = torch.Generator().manual_seed((self.args.seed << 32) + index)  # --seed < 2**32, index < 2**32
        return Example(torch.randint(0, self.vocab, (self.args.prompt_length,), generator=g).tolist())


def data_file_error(flag: str, path: str) -> Optional[str]:
    """Why ``path`` cannot be a ``flag`` prompt file without reading it (missing, unknown suffix, parquet without
    pyarrow), or ``None``; for :func:`megatron_hybrid.rl.arguments.validate_args`."""
    if not os.path.isfile(path):
        return f"{flag} ({path!r}) does not exist"
    if not path.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES):
        return f"{flag} ({path!r}) must end in {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}"
    if path.endswith(PARQUET_SUFFIXES) and importlib.util.find_spec("pyarrow") is None:
        return f"{flag} ({path!r}) is parquet, which needs pyarrow (pip install pyarrow)"
    return None
