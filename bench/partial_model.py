"""A model of the RL loop, synchronous against partial rollout (issue 46): what a staleness bound allows, in seconds.

    python bench/partial_model.py                                   # K = 1, 2, 4 at 2x and 4x in flight
    python bench/partial_model.py --max-staleness 1 --in-flight 40 64 96 --start-cap
    python bench/partial_model.py --steps 12 --seeds 1              # a quick look

No model runs: each decode step, prefill and training pass costs what an H100 measured for the 1.5B-like shape of
bench/partial_rollout.py (session 50; ``--decode-ms`` etc. change it), on that bench's workload: ``--prompts``
prompts a step of 32-512 tokens, 4 samples each, each prompt with a stop set of k tokens, k log-uniform in [1, 64],
so a sample's length is geometric with mean 1,024 / k, cut at 4,096.

- Synchronous: a step admits its samples into ``--slots`` slots (refilled as they end) and waits for the last.
- Partial: up to ``--in-flight`` prompts' groups are held; a step generates until ``--prompts`` groups have finished
  and every group at its staleness bound has finished (the recipe's ``Budget.required``), then trains the oldest
  finished groups; a group with a token more than ``--max-staleness`` steps old is dropped. Resumed samples are
  prefilled again (prompt and tokens so far). ``--start-cap``: no new sample starts once the quota has finished.

A decode step over b sequences costs ``decode_ms + per_sequence_ms * b`` plus ``per_position_ns`` per cached position
read; prefill ``prefill_us`` a token; training (log-probs and the update) ``train_us`` a prompt or response token.
Prints trained response tokens per second, the ratio to synchronous, drops a step and the share of decode steps with
at least half the slots running (the issue's "busy"). With the defaults the synchronous run makes 3,056 tokens/s
(measured: 3,021 and 3,253) and the partial run at K = 1 and 2x in flight 1.40x, busy 0.11 (measured: 1.37x, 0.13).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Costs:
    decode_ms: float = 2.1
    per_sequence_ms: float = 0.005
    per_position_ns: float = 11.3
    prefill_us: float = 8.0
    train_us: float = 65.0

    def step(self, rows: int, positions: int) -> float:
        return (self.decode_ms + self.per_sequence_ms * rows) / 1e3 + self.per_position_ns * positions / 1e9


@dataclass
class Group:
    """One prompt's samples: their lengths, tokens generated so far and the step of each one's first token."""

    prompt: int
    lengths: list[int]
    done: list[int] = field(default_factory=list)
    first: list[Optional[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.done, self.first = [0] * len(self.lengths), [None] * len(self.lengths)

    def finished(self) -> bool:
        return all(d >= n for d, n in zip(self.done, self.lengths))

    def oldest(self) -> Optional[int]:
        started = [f for f in self.first if f is not None]
        return min(started) if started else None


def draw(rng: random.Random, *, samples: int = 4, vocab: int = 1024, stop_sets: int = 64, longest: int = 4096) -> Group:
    k = min(stop_sets, int(math.exp(rng.random() * math.log(stop_sets + 1))))
    p = k / vocab
    lengths = [min(longest, int(math.log(1 - rng.random()) / math.log(1 - p)) + 1) for _ in range(samples)]
    return Group(rng.randint(32, 512), lengths)


def decode(active: list, costs: Costs) -> float:
    """One decode step over ``active`` ``(group, sample)`` pairs; their tokens advance."""
    seconds = costs.step(len(active), sum(g.prompt + g.done[i] for g, i in active))
    for g, i in active:
        g.done[i] += 1
    return seconds


def synchronous(args: argparse.Namespace, seed: int, costs: Costs) -> float:
    rng, tokens, seconds = random.Random(seed), 0, 0.0
    for _ in range(args.steps):
        groups = [draw(rng) for _ in range(args.prompts)]
        queue = [(g, i) for g in groups for i in range(len(g.lengths))]
        prompt = sum(g.prompt * len(g.lengths) for g in groups)
        t = prompt * costs.prefill_us / 1e6
        active, queue = queue[: args.slots], queue[args.slots:]
        while active:
            t += decode(active, costs)
            active = [(g, i) for g, i in active if g.done[i] < g.lengths[i]]
            while queue and len(active) < args.slots:
                active.append(queue.pop())
        response = sum(sum(g.lengths) for g in groups)
        tokens += response
        seconds += t + (response + prompt) * costs.train_us / 1e6
    return tokens / seconds


def partial(args: argparse.Namespace, seed: int, costs: Costs, staleness: int,
            in_flight: int) -> tuple[float, float, float]:
    """(trained tokens/s, groups dropped a step, busy share of decode steps) over the steps after ``--warmup``."""
    rng, held, tokens, seconds, drops, busy, steps = random.Random(seed), [], 0, 0.0, 0, 0, 0
    for step in range(args.warmup + args.steps):
        measured = step >= args.warmup
        kept = [g for g in held if g.oldest() is None or step - g.oldest() <= staleness]
        drops += (len(held) - len(kept)) * measured
        held = kept + [draw(rng) for _ in range(in_flight - len(kept))]
        t = 0.0
        if sum(g.finished() for g in held) < args.prompts:
            due = {id(g) for g in held
                   if not g.finished() and g.oldest() is not None and step - g.oldest() >= staleness}
            queue = [(g, i) for g in held for i in range(len(g.lengths)) if g.done[i] < g.lengths[i]]
            active, met = [], False
            while True:
                while queue and len(active) < args.slots and not (args.start_cap and met):
                    g, i = queue.pop(0)
                    t += (g.prompt + g.done[i]) * costs.prefill_us / 1e6  # a resumed sample is prefilled again
                    g.first[i] = step if g.first[i] is None else g.first[i]
                    active.append((g, i))
                finished = sum(g.finished() for g in held)
                met = finished >= args.prompts
                if not active or (met and all(g.finished() for g in held if id(g) in due)):
                    break
                busy += (len(active) >= args.slots // 2) * measured
                steps += measured
                t += decode(active, costs)
                active = [(g, i) for g, i in active if g.done[i] < g.lengths[i]]
        done = sorted((g for g in held if g.finished()), key=lambda g: g.oldest())[: args.prompts]
        held = [g for g in held if all(g is not d for d in done)]
        if measured:
            response = sum(sum(g.lengths) for g in done)
            tokens += response
            seconds += t + (response + sum(g.prompt * len(g.lengths) for g in done)) * costs.train_us / 1e6
    return tokens / seconds, drops / args.steps, busy / max(1, steps)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.split("\n")[2:5]))
    parser.add_argument("--prompts", type=int, default=32, help="prompts (groups) a step trains")
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--max-staleness", type=int, nargs="+", default=[1, 2, 4], metavar="K")
    parser.add_argument("--in-flight", type=int, nargs="+", default=None, metavar="PROMPTS",
                        help="prompts held in flight (default: 2x and 4x --prompts)")
    parser.add_argument("--start-cap", action="store_true", help="no new sample starts once the quota is met")
    parser.add_argument("--steps", type=int, default=32, help="measured steps of each run")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=2, help="runs averaged per setting")
    for name, value in vars(Costs()).items():
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=value)
    args = parser.parse_args(argv)
    for name in ("prompts", "slots", "steps", "seeds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} ({getattr(args, name)}) must be ≥ 1")
    if min(args.max_staleness) < 0:
        raise ValueError(f"--max-staleness ({min(args.max_staleness)}) must be ≥ 0")
    costs = Costs(**{name: getattr(args, name) for name in vars(Costs())})
    seeds = range(1, args.seeds + 1)
    sync = statistics.fmean(synchronous(args, s, costs) for s in seeds)
    print(f"synchronous: {sync:,.0f} trained tokens/s")
    print("| max staleness | in flight (prompts) | tokens/s | ratio | dropped a step | busy |")
    print("|---|---|---|---|---|---|")
    for k in args.max_staleness:
        for f in args.in_flight or [2 * args.prompts, 4 * args.prompts]:
            if f < args.prompts:
                raise ValueError(f"--in-flight ({f}) must be at least --prompts ({args.prompts})")
            runs = [partial(args, s, costs, k, f) for s in seeds]
            rate, drops, busy = (statistics.fmean(r[j] for r in runs) for j in range(3))
            print(f"| {k} | {f} | {rate:,.0f} | {rate / sync:.2f}x | {drops:.1f} | {busy:.2f} |", flush=True)


if __name__ == "__main__":
    main()
