"""The recipe's tokenizers, chosen by Megatron-LM's ``--tokenizer-type`` / ``--tokenizer-model``.

Each has ``vocab_size``, ``eod`` (the end-of-document token, or ``None``), ``tokenize(text) -> list[int]`` and
``detokenize(ids) -> str``.
"""

from __future__ import annotations

import argparse
import re
from typing import Sequence, Union


# A token id as NullTokenizer's text spells it: ASCII digits (int() would also take "1_000", "+3" and other
# scripts' digits), a minus sign let through so that a negative id is reported as outside the vocabulary.
_TOKEN_ID = re.compile(r"-?[0-9]+")


class NullTokenizer:
    """A synthetic vocabulary of ``vocab_size`` ids; text is the ids separated by spaces. No end token."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size, self.eod = vocab_size, None

    def tokenize(self, text: str) -> list[int]:
        """The ids of ``text``; ``ValueError`` for a word that is not an id in ``[0, vocab_size)``."""
        ids = []
        for i, word in enumerate(text.split()):
            if not _TOKEN_ID.fullmatch(word):
                raise ValueError(f"NullTokenizer takes token-id prompts (ids separated by spaces, as '5 17 3'): "
                                 f"word {i} ({word!r}) is not a token id (text needs --tokenizer-type "
                                 f"HuggingFaceTokenizer or SentencePieceTokenizer)")
            ids.append(int(word))
            if not 0 <= ids[-1] < self.vocab_size:
                raise ValueError(f"token {i} is {ids[-1]}, outside the vocabulary [0, {self.vocab_size}) "
                                 f"(--vocab-size {self.vocab_size})")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(map(str, ids))


class HuggingFaceTokenizer:
    """A Hugging Face tokenizer directory (``AutoTokenizer``); no special tokens added when tokenising."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)
        self.vocab_size, self.eod = len(self._tok), self._tok.eos_token_id

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """The token ids of ``messages`` in the tokenizer's chat template, the assistant's turn opened
        (``add_generation_prompt``); ``ValueError`` when the tokenizer has no chat template."""
        if not self._tok.chat_template:
            raise ValueError(f"the tokenizer ({self._tok.name_or_path}) has no chat template")
        return list(self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` file."""

    def __init__(self, path: str) -> None:
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id() if self._sp.eos_id() >= 0 else None

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))


Tokenizer = Union[NullTokenizer, HuggingFaceTokenizer, SentencePieceTokenizer]


def build_tokenizer(args: argparse.Namespace) -> Tokenizer:
    """The tokenizer of ``--tokenizer-type`` (``NullTokenizer``: ``--vocab-size`` ids)."""
    if args.tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(args.tokenizer_model)
    if args.tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(args.tokenizer_model)
    return NullTokenizer(args.vocab_size)
