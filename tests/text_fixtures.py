"""Offline text fixtures for the tests: the library's tiny tokenizer (see :mod:`megatron_hybrid.convert.tiny`)."""

from megatron_hybrid.convert.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, save_tiny_tokenizer

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "save_tiny_tokenizer"]
