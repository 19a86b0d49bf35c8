"""Former home of rollout generation, now :mod:`megatron_hybrid.inference`.

Kept only for the callers that still import from here (``HybridEngine.generate`` and the PPO recipe's
``--no-hybrid-rollout``); delete it once they call :mod:`megatron_hybrid.inference` directly.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .inference import GenerationResult, generate_with_model, split_evenly

__all__ = ["GenerationResult", "generate_tokens", "split_evenly"]


def generate_tokens(chunk: torch.nn.Module, *, tp_group, pp_group, prompts: Sequence[Sequence[int]], params,
                    vocab_size: Optional[int] = None,
                    stop_token_ids: Sequence[int] = (), seed: int = 0) -> list[GenerationResult]:
    """:func:`megatron_hybrid.inference.generate_with_model` under its former name and keywords."""
    return generate_with_model(chunk, prompts, params, tp_group=tp_group, pp_group=pp_group, vocab_size=vocab_size,
                               stop_token_ids=stop_token_ids, seed=seed)
