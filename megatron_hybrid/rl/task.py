"""What an RL run trains on (:func:`load_task`): the tokenizer, the model's architecture, the training and
held-out prompts, the reward and the rollout's KV-cache sizing, each from its own module, assembled from the
recipe's arguments before any process group exists."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from ..inference import GenerationConfig
from ..megatron import GPTArchitecture
from .data import Example, Prompts, eval_prompts
from .pretrained import model_architecture
from .rewards import Reward, build_reward
from .rollout import generation_config
from .tokenizers import Tokenizer, build_tokenizer


@dataclass
class Task:
    """What a run trains on, loaded and checked before any process group exists: every rank reads the same files,
    so a bad row is the same ``ValueError`` on every rank and nothing waits in a collective."""

    tokenizer: Tokenizer
    arch: GPTArchitecture
    """The model's architecture (``--pretrained-checkpoint``'s, or the flags')."""
    prompts: Prompts
    eval_prompts: Optional[list[Example]]
    reward: Optional[Reward]
    """:func:`megatron_hybrid.rl.rewards.build_reward`'s (``None`` when ``--reward-model-load`` scores)."""
    generation: GenerationConfig
    """The rollout's KV-cache settings: sized to these prompts (:func:`megatron_hybrid.rl.generation_config`)."""


def check_token_budget(args: argparse.Namespace, *, longest_prompt: int) -> None:
    """``ValueError`` when ``--max-tokens-per-micro-batch`` cannot hold the longest training sequence (the longest
    prompt + ``--max-new-tokens``): a packed micro-batch never splits a sequence."""
    budget = getattr(args, "max_tokens_per_micro_batch", None)
    new, flag = (args.max_sample_tokens, "--max-sample-tokens") if getattr(args, "env", None) else \
        (args.max_new_tokens, "--max-new-tokens")
    if budget is not None and budget < longest_prompt + new:
        raise ValueError(f"--max-tokens-per-micro-batch ({budget}) must be at least the longest sequence: the longest "
                         f"prompt ({longest_prompt} tokens) + {flag} ({new}) = {longest_prompt + new}")


def load_task(args: argparse.Namespace) -> Task:
    """The tokenizer, the architecture, the training and held-out prompts and the reward of a run."""
    tokenizer = build_tokenizer(args)
    arch = model_architecture(args, tokenizer.vocab_size)
    positions = arch.max_position_embeddings
    prompts = Prompts(args, tokenizer, max_positions=positions)
    held_out = eval_prompts(args, tokenizer, max_positions=positions)
    longest = max([prompts.max_length] + [len(e.tokens) for e in held_out or []])
    check_token_budget(args, longest_prompt=prompts.max_length)
    return Task(tokenizer, arch, prompts, held_out, build_reward(args, tokenizer),
                generation_config(args, max_prompt_length=longest))
