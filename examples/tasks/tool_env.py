"""A synthetic tool task for ``train_ppo.py --env`` (two turns; a tiny model learns it on the CPU):

    torchrun --nproc_per_node 4 examples/ppo/train_ppo.py --env examples/tasks/tool_env.py:KeyTool --max-turns 2 \\
        --algorithm grpo --num-samples-per-prompt 4 --train-iters 30

The model's first turn is its call of the tool (its tokens are not scored); the tool answers with one key token
(one of ``KEYS``, drawn for the prompt by a seeded generator: no simple function of the prompt gives it); the reward
is the share of the model's second-turn tokens equal to that key. An untrained model gets about 1/16; to do better
it has to read the tool's answer, which sits in the context as an observation (loss mask 0: never trained on).

Environments are plain classes (megatron_hybrid/rl/envs.py): ``reset(example) -> prompt tokens`` and
``step(tokens) -> (observation tokens, reward, done)``, one instance per sample.
"""

from __future__ import annotations

import random

KEYS = (3, 5)


class KeyTool:
    def reset(self, example) -> list[int]:
        self.key = random.Random(",".join(map(str, example.tokens))).choice(KEYS)
        self.turn = 0
        return list(example.tokens)

    def step(self, tokens: list[int]) -> tuple[list[int], float, bool]:
        self.turn += 1
        if self.turn == 1:  # the call: the tool answers with the key
            return [self.key], 0.0, False
        return [], sum(t == self.key for t in tokens) / max(len(tokens), 1), True
