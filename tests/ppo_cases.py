"""Rank bodies for the PPO/GRPO recipe tests (run by tests.harness.run_distributed).

The recipe is run as a script, the way torchrun runs it (``__main__``, its command line), on the rank's process
groups; its per-step metrics are read back from ``--log-dir``'s ``metrics.jsonl``. Nothing inside it is imported.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from typing import Optional

import torch
import torch.distributed as dist

from tests.rl_cases import recipe_args

RECIPE = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, "examples", "ppo", "train_ppo.py"))


def run_recipe(argv: list[str]) -> None:
    """``train_ppo.py argv`` in this process (argument errors exit with ``SystemExit``)."""
    saved = sys.argv
    sys.argv = [RECIPE, *argv]
    try:
        runpy.run_path(RECIPE, run_name="__main__")
    finally:
        sys.argv = saved


def run_main(argv: list[str], log_dir: str) -> Optional[list[dict]]:
    """Run the recipe with ``--log-dir log_dir``; rank 0 returns the metrics it logged (one dict per step)."""
    run_recipe(argv + ["--no-progress", "--log-dir", log_dir])
    if dist.get_rank() != 0:
        return None
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def vocab_parallel_case(vocab_size: int):
    """Log-probs, entropies and their gradients with the vocabulary split over TP equal the unsplit ones."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid.rl.ppo import vocab_parallel_logprobs_entropy

    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 5, 16, generator=g)
    labels = torch.randint(0, vocab_size, (2, 5), generator=g)
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    V_t = 16 // tp
    shard = full[..., rank * V_t: (rank + 1) * V_t].clone().requires_grad_(True)
    logp, ent = vocab_parallel_logprobs_entropy(shard, labels, tp_group=ps.get_tensor_model_parallel_group(),
                                                vocab_start=rank * V_t, vocab_size=vocab_size, temperature=0.7)
    (logp.sum() + 0.5 * ent.sum()).backward()
    return {"logp": logp.detach(), "entropy": ent.detach(), "grad": shard.grad, "rank": rank}


def constant_reward(prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
    """A ``--reward-fn`` for the tests: 0.5 for every response."""
    return [0.5] * len(responses)


def save_constant_reward_model(directory: str, bias: float) -> None:
    """A reward model whose head reads nothing (zero weight) and adds ``bias``: it scores every sequence ``bias``."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid import rl

    args = recipe_args()
    arch = rl.architecture_from_args(args, args.vocab_size)
    model = rl.build_stage(arch, value_head=True, device=torch.device("cpu"))
    if ps.is_pipeline_last_stage():
        with torch.no_grad():
            model.output_layer.bias.fill_(bias)
    rl.save_value_model(model, directory, arch)


def write_sentencepiece_model(directory: str) -> str:
    """Train a tiny SentencePiece model (a few hundred ms) and return its path."""
    import sentencepiece

    corpus = os.path.join(directory, "corpus.txt")
    with open(corpus, "w") as f:
        for i in range(200):
            f.write(f"the cat sat on mat {i % 7} and the dog ran to log {i % 5}\n")
    prefix = os.path.join(directory, "sp")
    sentencepiece.SentencePieceTrainer.train(input=corpus, model_prefix=prefix, vocab_size=20,
                                             model_type="word", minloglevel=2)
    return prefix + ".model"
