"""Environments for the multi-turn tests (``--env tests.env_fixtures:Class``; megatron_hybrid/rl/envs.py)."""

from __future__ import annotations

#: The built-in task's target token (the recipe's --target-token default).
TARGET = 3


class ThreeTurns:
    """Three turns: after each model turn the environment answers with the observation [1, 2] (after the third it is
    done); each step's reward is the share of that turn's model tokens equal to the target token, over 3."""

    def reset(self, example):
        self.turn = 0
        return list(example.tokens)

    def step(self, tokens):
        self.turn += 1
        reward = sum(t == TARGET for t in tokens) / max(len(tokens), 1) / 3
        return [1, 2], reward, self.turn == 3


#: (sample's first prompt token, turn, time.perf_counter()) at the start of each SlowFirstStep step (this process).
EVENTS: list = []


class SlowFirstStep(ThreeTurns):
    """ThreeTurns whose sample with first prompt token ``SLOW`` takes 4 s over its first step (a slow tool: long
    enough that the others' turns end first on a slow or busy 2-core machine); every step is logged in
    :data:`EVENTS`."""

    SLOW = None

    def reset(self, example):
        self.id = example.tokens[0]
        return super().reset(example)

    def step(self, tokens):
        import time

        EVENTS.append((self.id, self.turn + 1, time.perf_counter()))
        if self.id == SlowFirstStep.SLOW and self.turn == 0:
            time.sleep(4.0)
        return super().step(tokens)


class OutOfVocabulary(ThreeTurns):
    def step(self, tokens):
        return [1, 99], 0.0, False


class NotFinite(ThreeTurns):
    def step(self, tokens):
        return [1], float("nan"), False


class Raises(ThreeTurns):
    def step(self, tokens):
        raise KeyError("the tool is down")


class LongObservation(ThreeTurns):
    """An observation of 30 tokens: past any small --max-sample-tokens."""

    def step(self, tokens):
        return [2] * 30, 1.0, False


class NoStep:
    def reset(self, example):
        return list(example.tokens)


def target_anywhere(prompts, responses):
    """A ``--reward-fn`` (the dynamic-sampling tests): 1 when the response holds the target token at all. An untrained
    16-token policy hits it in 8 tokens with probability 1 - (15/16)^8 ≈ 0.40, so about 15 % of groups of 4 are all
    0 or all 1."""
    return [float(TARGET in r) for r in responses]
