"""Multi-turn environments (``--env module:Class``): the model answers, the environment replies, the model goes on;
only the model's own tokens train.

An environment is a class the recipe makes once per sample (``Class()``, or ``Class(tokenizer=...)`` where its
constructor takes the run's tokenizer, to read and write text), with two methods::

    class MyEnv:
        def reset(self, example: rl.Example) -> list[int]:
            ...  # the first prompt's token ids (e.g. example.tokens, or a system turn around them)
        def step(self, tokens: list[int]) -> tuple[list[int], float, bool]:
            ...  # the model's tokens of this turn -> (observation token ids, reward, done)

A sample's rollout (:class:`EnvRunner`): ``reset``, then up to ``--max-turns`` turns of generating (each turn a
generate call over the sample's whole sequence so far) and ``step``; the observation is appended to the sequence
unless the episode is done. Each turn's sequence continues the last turn's KV cache where the rollout still holds
it (``keep``: only the model's last token and the observation run, beside other work in mixed steps; the weights
do not change within a rollout), else it is prefilled again (``--no-keep-prefix``: always). The sample's response
is everything after the first prompt; its loss mask is 1 at the model's tokens and 0 at the observations'
(context, never trained); its reward is the sum of its steps' rewards. A sample whose response reaches
``--max-sample-tokens`` is cut there and ends (counted).

Each sample's environment lives on one rank of its training replica (sample i on rank i mod the replica's
model-parallel size), and what it returns is gathered to the others, so it runs once however the replica is laid
out. What an environment returns is checked (token ids in the vocabulary, a finite reward, tokens that fit); a bad
value or an exception stops every rank with a :class:`~.faults.StepFailure` naming the sample, before anything of
the step is saved.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch.distributed as dist

from .data import Example
from .faults import raise_on_every_rank


class Environment(Protocol):
    """What ``--env module:Class`` names (module docstring)."""

    def reset(self, example: Example) -> list[int]: ...

    def step(self, tokens: list[int]) -> tuple[list[int], float, bool]: ...


@dataclass
class Episodes:
    """One step's multi-turn samples on this rank (its training replica's, in order)."""

    prompts: list[list[int]]
    """Each sample's first prompt (``reset``'s)."""
    responses: list[list[int]] = field(default_factory=list)
    """Everything after it: the model's turns and the observations between them."""
    log_probs: list[list[float]] = field(default_factory=list)
    """The rollout's log-probs of the response tokens (at the sampling temperature); 0.0 at observation tokens."""
    loss_masks: list[list[int]] = field(default_factory=list)
    """1 at the model's tokens, 0 at the observations'."""
    rewards: list[float] = field(default_factory=list)
    """The sum of each sample's step rewards."""
    turns: list[int] = field(default_factory=list)
    """The generate calls each sample took part in."""
    truncated: int = 0
    """Samples cut at the token budget."""
    env_seconds: float = 0.0
    """This rank's seconds in ``reset`` and ``step``."""

    @property
    def model_tokens(self) -> int:
        return sum(sum(m) for m in self.loss_masks)


#: generate(prompts, turn, continued) -> one ``GenerationResult`` per prompt (the engine's, at the sampling
#: temperature); ``continued``: per prompt, the last turn's ``result.kept`` (None on the first turn).
Generate = Callable[[list[list[int]], int, list], list]


class EnvRunner:
    """Runs a step's samples through their environments (module docstring). ``group``: the training replica's
    model-parallel group (None: this rank alone); ``max_prompt_tokens``: the longest first prompt the rollout's
    KV cache was sized for."""

    def __init__(self, make_env: Callable[..., Any], *, name: str, vocab_size: int, max_turns: int, budget: int,
                 max_prompt_tokens: int, group: Any = None, keep_prefix: bool = True, tokenizer: Any = None) -> None:
        self.make_env, self.name, self.vocab_size = make_env, name, vocab_size
        if tokenizer is not None and _takes_tokenizer(make_env):  # an environment that reads and writes text
            self.make_env = functools.partial(make_env, tokenizer=tokenizer)
        self.keep_prefix = keep_prefix
        self.max_turns, self.budget, self.max_prompt_tokens, self.group = max_turns, budget, max_prompt_tokens, group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)

    # -- one call on every sample this rank owns, checked, gathered --------------------------------------------------
    def _on_owners(self, indices: list[int], fn: Callable[[int], Any], *, step: int, what: str,
                   episodes: Episodes) -> dict[int, Any]:
        """``fn(i)`` for the samples ``indices`` this rank owns; the failures stop every rank (one all-reduce of
        the world), the values are gathered over the replica."""
        mine: dict[int, Any] = {}
        errors = []
        start = time.perf_counter()
        for i in indices:
            if i % self.size != self.rank:
                continue
            try:
                mine[i] = fn(i)
            except Exception as e:  # the user's environment, or a check of what it returned
                errors.append(f"--env {self.name}: sample {i}'s {what}: {type(e).__name__}: {e}")
        episodes.env_seconds += time.perf_counter() - start
        raise_on_every_rank(step, errors)
        if self.size == 1:
            return mine
        everyone: list[Any] = [None] * self.size
        dist.all_gather_object(everyone, mine, group=self.group)
        return {i: v for part in everyone for i, v in part.items()}

    def _tokens(self, tokens: Any, what: str) -> list[int]:
        if not isinstance(tokens, (list, tuple)) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in tokens):
            raise ValueError(f"{what} must be a list of token ids, not {tokens!r:.80}")
        bad = [int(t) for t in tokens if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"{what} holds token {bad[0]}, outside the vocabulary [0, {self.vocab_size - 1}]")
        return [int(t) for t in tokens]

    def _reset(self, envs: dict[int, Any], examples: list[Example], i: int) -> list[int]:
        envs[i] = self.make_env()
        tokens = self._tokens(envs[i].reset(examples[i]), "reset's prompt")
        if not tokens or len(tokens) > self.max_prompt_tokens:
            raise ValueError(f"reset's prompt has {len(tokens)} tokens: it needs 1 to {self.max_prompt_tokens} (the "
                             "longest prompt the rollout's KV cache holds beside --max-sample-tokens; raise "
                             "--inference-max-seq-length)")
        return tokens

    def _step(self, envs: dict[int, Any], i: int, tokens: list[int]) -> tuple[list[int], float, bool]:
        out = envs[i].step(list(tokens))
        if not isinstance(out, tuple) or len(out) != 3:
            raise ValueError(f"step must return (observation tokens, reward, done), not {out!r:.80}")
        observation, reward, done = out
        observation = self._tokens(observation, "step's observation")
        if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise ValueError(f"step's reward ({reward!r}) must be a finite number")
        return observation, float(reward), bool(done)

    # -- a step's samples ---------------------------------------------------------------------------------------
    def run_async(self, examples: list[Example], generate: Callable[[list[list[int]], Any], list], *, step: int,
                  share: tuple[int, int], max_new_tokens: int, workers: int) -> Episodes:
        """Every turn of every sample inside one generate call: ``generate(first prompts, turns)`` passes ``turns``
        (a :class:`~megatron_hybrid.inference.Turns`) to the engine, whose rollout replica of this rank generates the
        samples ``share`` = ``[lo, hi)`` (:func:`~megatron_hybrid.inference.turn_share`). Their environments live
        here: ``reset`` before the call, each ``step`` on one of ``workers`` threads as soon as the sample's turn
        ends, while the replica decodes the others; the sample goes on from its kept cache once its answer is in
        (a slow environment delays its own sample only). The samples' episodes are gathered over the training
        replica's model-parallel group, so every rank returns all of them, as :meth:`run` does."""
        n = len(examples)
        lo, hi = share
        envs: dict[int, Any] = {}
        episodes = Episodes([])
        start = time.perf_counter()
        errors, mine = [], {}
        for i in range(lo, hi):
            try:
                mine[i] = self._reset(envs, examples, i)
            except Exception as e:
                errors.append(f"--env {self.name}: sample {i}'s reset: {type(e).__name__}: {e}")
        episodes.env_seconds += time.perf_counter() - start
        raise_on_every_rank(step, errors)
        firsts = self._gathered(mine)
        turns = _EnvTurns(self, envs, [firsts.get(i, []) for i in range(n)], max_new=max_new_tokens,
                          workers=workers)
        try:
            results = generate([firsts[i] for i in range(n)], turns)
        finally:
            turns.close()
        raise_on_every_rank(step, [message for _, message in sorted(turns.errors)])  # in sample order
        parts = self._gathered({i: (turns.responses[i], turns.masks[i], turns.rewards[i], turns.turns[i])
                                for i in range(lo, hi)})
        truncated = self._gathered({self.rank: (turns.truncated, turns.env_seconds)})
        episodes.prompts = [firsts[i] for i in range(n)]
        for i in range(n):
            responses, masks, reward, turn_counts = parts[i]
            # The results hold every turn's generated tokens (and their log-probs); the budget kept a prefix of each.
            kept = iter(_kept_log_probs(list(results[i].generated_tempered_log_probs), turn_counts))
            log_probs = [next(kept) if m else 0.0 for m in masks]
            episodes.responses.append(responses)
            episodes.log_probs.append(log_probs)
            episodes.loss_masks.append(masks)
            episodes.rewards.append(reward)
            episodes.turns.append(len(turn_counts))
        episodes.truncated = sum(t for t, _ in truncated.values())
        episodes.env_seconds += sum(s for _, s in truncated.values())
        return episodes

    def _gathered(self, mine: dict[int, Any]) -> dict[int, Any]:
        """The union of every model-parallel rank's ``mine``."""
        if self.size == 1:
            return dict(mine)
        everyone: list[Any] = [None] * self.size
        dist.all_gather_object(everyone, mine, group=self.group)
        return {k: v for part in everyone for k, v in part.items()}

    def run(self, examples: list[Example], generate: Generate, *, step: int,
            release: Optional[Callable[[list], None]] = None) -> Episodes:
        """Reset every sample's environment, then turns of ``generate`` and ``step`` until every sample is done
        (or took ``max_turns`` turns). Called on every rank: the world runs as many turns as its longest
        replica (a replica with nothing left generates for no prompts), and every rank of a replica returns the
        same episodes. With ``keep_prefix``, ``release(kept)`` frees the kept caches of the samples that end."""
        from ..reshard import agree_max

        envs: dict[int, Any] = {}
        n = len(examples)
        episodes = Episodes([])
        firsts = self._on_owners(list(range(n)), lambda i: self._reset(envs, examples, i), step=step,
                                 what="reset", episodes=episodes)
        episodes.prompts = [firsts[i] for i in range(n)]
        episodes.responses, episodes.log_probs = [[] for _ in range(n)], [[] for _ in range(n)]
        episodes.loss_masks, episodes.rewards, episodes.turns = [[] for _ in range(n)], [0.0] * n, [0] * n
        live = list(range(n))
        kept: list[Any] = [None] * n  # each sample's kept cache from its last turn
        for turn in range(self.max_turns):
            if not agree_max([len(live)], dist.group.WORLD)[0]:
                break
            results = generate([episodes.prompts[i] + episodes.responses[i] for i in live], turn,
                               [kept[i] for i in live])
            if self.keep_prefix:
                for i, r in zip(live, results):
                    kept[i] = getattr(r, "kept", None)
            said: dict[int, list[int]] = {}  # each sample's tokens of this turn (cut at the budget)
            for i, r in zip(live, results):
                said[i], cut = self._model_turn(len(episodes.responses[i]), r.generated_tokens)
                episodes.responses[i] += said[i]
                episodes.log_probs[i] += list(r.generated_tempered_log_probs)[:len(said[i])]
                episodes.loss_masks[i] += [1] * len(said[i])
                episodes.turns[i] += 1
                episodes.truncated += cut
            replies = self._on_owners(live, lambda i: self._step(envs, i, said[i]), step=step,
                                      what=f"step (turn {turn + 1})", episodes=episodes)
            going = []
            for i in live:
                observation, reward, done = replies[i]
                episodes.rewards[i] += reward
                appended, goes, cut = self._answer(len(episodes.responses[i]), turn + 1, observation, done)
                episodes.responses[i] += appended
                episodes.log_probs[i] += [0.0] * len(appended)
                episodes.loss_masks[i] += [0] * len(appended)
                episodes.truncated += cut
                if goes:
                    going.append(i)
            ended = [kept[i] for i in live if i not in set(going) and kept[i] is not None]
            if ended and release is not None:
                release(ended)
            live = going
        return episodes

    # -- the token budget, for both forms ---------------------------------------------------------------------
    def _model_turn(self, length: int, tokens: Sequence[int]) -> tuple[list[int], bool]:
        """A model turn's tokens that fit the budget after a response of ``length`` tokens, and whether it was
        cut."""
        room = self.budget - length
        return list(tokens)[:room], len(tokens) > room

    def _answer(self, length: int, turns: int, observation: list[int], done: bool) -> tuple[list[int], bool, bool]:
        """What a step's answer adds to a response of ``length`` tokens after ``turns`` turns: the observation
        tokens (cut at the budget), whether the sample takes another turn, and whether it was cut."""
        if done or turns == self.max_turns or length >= self.budget:
            return [], False, False
        room = self.budget - length
        if len(observation) >= room:  # no room left for the model to answer: cut here
            return observation[:room], False, True
        return observation, True, False


def _takes_tokenizer(make_env: Callable[..., Any]) -> bool:
    """Whether ``make_env`` (an environment class) takes a ``tokenizer`` keyword."""
    try:
        return "tokenizer" in inspect.signature(make_env).parameters
    except (TypeError, ValueError):
        return False


def _kept_log_probs(log_probs: list[float], turns: list[tuple[int, int]]) -> list[float]:
    """The log-probs of the tokens each turn kept (``(generated, kept)`` per turn) out of all generated ones."""
    out, at = [], 0
    for generated, kept in turns:
        out += log_probs[at: at + kept]
        at += generated
    return out


class _EnvTurns:
    """:class:`~megatron_hybrid.inference.Turns` over this rank's samples ``[lo, hi)`` (:meth:`EnvRunner.run_async`):
    each ``step`` runs on a thread of ``workers`` as soon as its sample's turn ends; its answer is checked and
    booked here, and the sample goes on with its next prompt (or ends). Errors are kept for the caller to raise on
    every rank."""

    def __init__(self, runner: "EnvRunner", envs: dict[int, Any], firsts: list[list[int]], *, max_new: int,
                 workers: int) -> None:
        import queue
        from concurrent.futures import ThreadPoolExecutor

        self.runner, self.envs, self.firsts, self.max_new = runner, envs, firsts, max_new
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="env")
        self.answers: "queue.Queue[tuple[int, Any, Optional[BaseException], float]]" = queue.Queue()
        self.responses: dict[int, list[int]] = {i: [] for i in envs}
        self.masks: dict[int, list[int]] = {i: [] for i in envs}
        self.rewards: dict[int, float] = {i: 0.0 for i in envs}
        self.turns: dict[int, list[tuple[int, int]]] = {i: [] for i in envs}
        """Per sample, each turn's (generated tokens, kept tokens) (the rest cut at the token budget)."""
        self.truncated, self.env_seconds, self.errors = 0, 0.0, []

    def ended(self, i: int, tokens: list[int]) -> None:
        said, cut = self.runner._model_turn(len(self.responses[i]), tokens)
        self.truncated += cut
        self.responses[i] += said
        self.masks[i] += [1] * len(said)
        self.turns[i].append((len(tokens), len(said)))
        self.pool.submit(self._step, i, said)

    def _step(self, i: int, said: list[int]) -> None:
        start = time.perf_counter()
        try:
            out, error = self.runner._step(self.envs, i, said), None
        except Exception as e:  # the user's environment, or a check of what it returned
            out, error = None, e
        self.answers.put((i, out, error, time.perf_counter() - start))

    def ready(self, wait: bool) -> list[tuple[int, Optional[list[int]], int]]:
        import queue

        out = []
        while True:
            try:
                i, answer, error, seconds = self.answers.get(block=wait and not out)
            except queue.Empty:
                return out
            self.env_seconds += seconds
            out.append((i, *self._next(i, answer, error)))

    def _next(self, i: int, answer: Any, error: Optional[BaseException]) -> tuple[Optional[list[int]], int]:
        """Sample i's next prompt and its turn's token limit, or (None, 0) where it ends."""
        runner = self.runner
        if error is not None:
            turn = len(self.turns[i])
            self.errors.append((i, f"--env {runner.name}: sample {i}'s step (turn {turn}): {type(error).__name__}: "
                                   f"{error}"))
            return None, 0
        observation, reward, done = answer
        self.rewards[i] += reward
        appended, goes, cut = runner._answer(len(self.responses[i]), len(self.turns[i]), observation, done)
        self.responses[i] += appended
        self.masks[i] += [0] * len(appended)
        self.truncated += cut
        if not goes:
            return None, 0
        return self.firsts[i] + self.responses[i], min(self.max_new, runner.budget - len(self.responses[i]))

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def load_env(spec: str) -> Callable[[], Any]:
    """``--env module:Class`` → the class; ``ValueError`` naming the spec when it is not there or lacks
    ``reset``/``step``."""
    from .rewards import load_callable

    cls = load_callable(spec, flag="--env")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"--env ({spec!r}) has no {' or '.join(missing)} method: an environment has "
                         "reset(example) -> tokens and step(tokens) -> (observation tokens, reward, done)")
    return cls


def max_response_tokens(args: Any) -> int:
    """The most response tokens a sample has: ``--max-sample-tokens`` with ``--env`` (model turns and
    observations), else ``--max-new-tokens``."""
    return args.max_sample_tokens if getattr(args, "env", None) else args.max_new_tokens
