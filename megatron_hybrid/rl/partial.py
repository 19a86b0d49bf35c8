"""Partial rollout in a colocated engine (``--partial-rollout``): a step stops generating once its quota of
finished units is met, trains on them, and resumes the rest first in the next step, with the new weights.

A *unit* is what trains as a whole: a GRPO group (the samples of one prompt; its advantages need them all) or one
PPO sample. Each DP rank keeps its own buffer (:class:`PartialRollout`), the same on every rank of its replica:

1. **drop**: a unit holding a token older than ``--max-staleness`` weight versions is dropped, with every sample
   of its group (counted);
2. **admit**: new prompts are admitted until ``--partial-rollout-in-flight`` prompts' units are in the buffer
   (rank r's k-th admitted prompt is the data set's prompt k · DP + r: the data position counts prompts admitted);
3. **generate**: every unfinished sample, the oldest units first (so the parked ones resume first: their tokens
   so far are prefilled again with the current weights), under a :class:`~megatron_hybrid.inference.Budget` that
   stops once the units this rank still needs for its quota have ended (``Budget.groups``: a unit counts once all of
   its samples ended) and every *due* unit has ended too (``Budget.required``): a unit whose oldest token is
   ``--max-staleness`` versions old (K ≥ 1) would be dropped if parked again, so it finishes in this step, while
   the other units keep the generator full beside it. Only a unit that could not finish (K = 0, where a unit is
   due as soon as it starts) is dropped, so long samples train rather than being dropped for their length;
4. **take**: the oldest ``quota`` finished units train; the rest stay (finished ones wait, unfinished ones are
   parked).

Each token carries the weight version that produced it (the number of updates the actor had made), so a step can
correct the off-policy tokens (``--tis-imp-ratio-cap``, from the recorded behaviour log-probs) or mask them out of
the losses (``--mask-offpolicy-in-partial-rollout``). The buffer is saved with a checkpoint (:meth:`state_dict`)
and loads only at the data-parallel size and vocabulary that wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..inference import Budget, GenerationResult
from .data import Example


@dataclass
class Unit:
    """What trains as a whole: the samples of one prompt (GRPO) or a single sample (PPO)."""

    label: int
    """This rank's running count of units: the unit's group label in a generate call's budget."""
    index: int
    """The admitted prompt's position in the data set (:meth:`PartialRollout.admit`)."""
    samples: list[GenerationResult]
    """Each sample so far: finished, or not (its tokens so far, maybe none)."""

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def oldest(self) -> Optional[int]:
        """The oldest weight version of any of its tokens (None: no tokens yet)."""
        versions = [min(s.weight_versions) for s in self.samples if s.weight_versions]
        return min(versions) if versions else None


@dataclass
class Counts:
    """One step's bookkeeping on this rank."""

    admitted: int = 0
    """Prompts admitted."""
    dropped: int = 0
    """Units dropped for staleness."""
    resumed: int = 0
    """Samples that went on from tokens of an earlier step."""
    generated: int = 0
    """Samples handed to the generator."""
    generated_tokens: int = 0
    """Tokens the step's generate call produced (:meth:`PartialRollout.absorb`)."""
    due: int = 0
    """Unfinished units at their staleness bound, which this step's generate call finished (``Budget.required``)."""
    waiting: int = 0
    """Finished units left for a later step, after this step's are taken (:meth:`PartialRollout.held`)."""
    parked: int = 0
    """Unfinished units, to go on at a later step."""
    staleness: list[float] = field(default_factory=list)
    """Share of the trained tokens at each staleness, 0 ... max_staleness versions (``staleness_histogram``)."""


class PartialRollout:
    """One DP rank's buffer of units across steps (see the module's docstring).

    ``quota``: units this rank trains per step; ``in_flight``: prompts whose units the buffer holds after
    admission (at least the prompts of ``quota``); ``unit_size``: samples per unit (the GRPO group, or 1 for PPO) out
    of ``samples_per_prompt``; ``max_staleness``: the oldest token a trained unit may hold, in weight versions
    behind the one that trains on it."""

    def __init__(self, *, quota: int, in_flight: int, samples_per_prompt: int, unit_size: int, max_staleness: int,
                 dp_rank: int, dp_size: int, vocab_size: int) -> None:
        assert samples_per_prompt % unit_size == 0 and in_flight * samples_per_prompt >= quota * unit_size
        self.quota, self.in_flight, self.max_staleness = quota, in_flight, max_staleness
        self.samples_per_prompt, self.unit_size = samples_per_prompt, unit_size
        self.dp_rank, self.dp_size, self.vocab_size = dp_rank, dp_size, vocab_size
        self.units: list[Unit] = []
        self.admitted = 0
        """Prompts this rank admitted since the run began (the data position)."""
        self.dropped = 0
        """Units this rank dropped since the run began."""
        self._labels = 0
        self._pending: list[tuple[Unit, int]] = []  # the last requests(): (unit, sample index)

    # -- one step's phases ---------------------------------------------------------------------------------------
    def drop_stale(self, version: int, counts: Counts) -> None:
        """Drop the units holding a token more than ``max_staleness`` versions behind ``version`` (the weights the
        step trains): they could not train any more, so they are not generated on either."""
        keep = []
        for unit in self.units:
            oldest = unit.oldest()
            if oldest is not None and version - oldest > self.max_staleness:
                counts.dropped += 1
            else:
                keep.append(unit)
        self.dropped += len(self.units) - len(keep)
        self.units = keep

    def admit(self, prompt: Callable[[int], Any], counts: Counts) -> None:
        """Admit prompts until ``in_flight`` prompts' units are held: ``prompt(index)`` gives the data set's
        prompt ``index`` (this rank's k-th admission is index k · DP + rank): its token ids, or its
        :class:`~.data.Example` (whose own ``stop_token_ids`` its samples keep until they finish)."""
        per_prompt = self.samples_per_prompt // self.unit_size
        while len(self.units) < self.in_flight * per_prompt:
            index = self.admitted * self.dp_size + self.dp_rank
            given = prompt(index)
            tokens, stops = (given.tokens, list(given.stop_token_ids)) if isinstance(given, Example) else (given, [])
            for _ in range(per_prompt):
                self.units.append(Unit(self._labels, index, [
                    GenerationResult(list(tokens), finished=False, stop_token_ids=list(stops))
                    for _ in range(self.unit_size)]))
                self._labels += 1
            self.admitted += 1
            counts.admitted += 1

    def need(self) -> int:
        """Units still to finish for this step's quota."""
        return max(0, self.quota - sum(u.finished for u in self.units))

    def requests(self, counts: Counts, version: Optional[int] = None
                 ) -> tuple[list[GenerationResult], Optional[Budget]]:
        """The unfinished samples, oldest units first, to pass as a generate call's ``resume``, and its budget
        (None when the quota is already met: nothing is generated). ``version``: the weights the step trains; the
        units due at it (:meth:`due`) must end in the call (``Budget.required``)."""
        need = self.need()
        self._pending = [] if not need else [(u, i) for u in self.units for i, s in enumerate(u.samples)
                                             if not s.finished]
        if not need:
            return [], None
        pending = [u.samples[i] for u, i in self._pending]
        counts.generated = len(pending)
        counts.resumed = sum(bool(s.generated_tokens) for s in pending)
        due = set() if version is None else {id(u) for u in self.due(version)}
        counts.due = len(due)
        return pending, Budget(finished=need, groups=tuple(u.label for u, _ in self._pending),
                               required=tuple(j for j, (u, _) in enumerate(self._pending) if id(u) in due))

    def due(self, version: int) -> list[Unit]:
        """The unfinished units that :meth:`drop_stale` would drop at the next step if they stay unfinished now:
        their oldest token is ``max_staleness`` versions behind ``version`` (none with ``max_staleness`` 0, where a
        unit is due as soon as its first token exists)."""
        if self.max_staleness < 1:
            return []
        return [u for u in self.units if not u.finished and u.oldest() is not None
                and version - u.oldest() >= self.max_staleness]

    def absorb(self, results: list[GenerationResult], version: int) -> int:
        """Put a generate call's results (for the last :meth:`requests`' samples, in order) in their places; the
        tokens it generated carry weight version ``version`` (instead of the engine's switch count). Returns how
        many it generated."""
        assert len(results) == len(self._pending), (len(results), len(self._pending))
        generated = 0
        for (unit, i), new in zip(self._pending, results):
            old = unit.samples[i]
            fresh = len(new.generated_tokens) - len(old.generated_tokens)
            assert fresh >= 0 and new.generated_tokens[:len(old.generated_tokens)] == old.generated_tokens
            new.weight_versions = old.weight_versions + [version] * fresh
            unit.samples[i] = new
            generated += fresh
        self._pending = []
        return generated

    def take(self) -> list[Unit]:
        """The oldest ``quota`` finished units, out of the buffer: the step's training units."""
        done = [u for u in self.units if u.finished][: self.quota]
        assert len(done) == self.quota, f"{len(done)} finished units for a quota of {self.quota}"
        taken = {id(u) for u in done}
        self.units = [u for u in self.units if id(u) not in taken]
        return done

    def held(self) -> tuple[int, int]:
        """(finished units waiting for a later step, unfinished units parked)."""
        waiting = sum(u.finished for u in self.units)
        return waiting, len(self.units) - waiting

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's buffer as plain numbers and lists (the checkpoint's common part holds every DP rank's)."""
        return {"admitted": self.admitted, "dropped": self.dropped, "labels": self._labels, "units": [
            {"label": u.label, "index": u.index, "samples": [
                {"prompt": s.prompt_tokens, "tokens": s.generated_tokens, "log_probs": s.generated_log_probs,
                 "tempered_log_probs": s.generated_tempered_log_probs, "versions": s.weight_versions,
                 "finished": s.finished, "stops": s.stop_token_ids} for s in u.samples]} for u in self.units]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.admitted, self.dropped, self._labels = state["admitted"], state["dropped"], state["labels"]
        self.units = [Unit(u["label"], u["index"], [
            GenerationResult(list(s["prompt"]), list(s["tokens"]), list(s["log_probs"]),
                             list(s["tempered_log_probs"]), finished=s["finished"], weight_versions=list(s["versions"]),
                             stop_token_ids=list(s.get("stops", ())))
            for s in u["samples"]]) for u in state["units"]]


def staleness_histogram(units: list[Unit], version: int, max_staleness: int) -> list[float]:
    """The share of the units' response tokens at each staleness 0 … ``max_staleness`` (versions behind
    ``version``)."""
    counts = [0] * (max_staleness + 1)
    for unit in units:
        for sample in unit.samples:
            for v in sample.weight_versions:
                counts[min(version - v, max_staleness)] += 1
    total = sum(counts)
    return [c / total if total else 0.0 for c in counts]


def onpolicy_mask(samples: list[GenerationResult], version: int, like: "torch.Tensor") -> "torch.Tensor":
    """``[B, N]`` (``like``'s shape, dtype and device): 1 at the response tokens weight version ``version`` made,
    0 at older ones and past each response (``--mask-offpolicy-in-partial-rollout``: multiplied into the loss
    mask)."""
    import torch

    out = torch.zeros_like(like)
    for b, sample in enumerate(samples):
        versions = torch.tensor(sample.weight_versions, device=like.device)
        out[b, : len(versions)] = (versions == version).to(like.dtype)
    return out


def check_resumable(state: dict[str, Any], *, dp_size: int, vocab_size: int) -> None:
    """``ValueError`` when saved partial-rollout samples cannot resume in this run (another data-parallel size or
    vocabulary); the same on every rank (every rank reads the same state)."""
    if state["dp_size"] != dp_size:
        raise ValueError(f"--load: the checkpoint's parked partial-rollout samples were written at data-parallel "
                         f"size {state['dp_size']}; this run has data-parallel size {dp_size} (resume at "
                         f"{state['dp_size']}, or load without --partial-rollout to drop them)")
    if state["vocab_size"] != vocab_size:
        raise ValueError(f"--load: the checkpoint's parked partial-rollout samples are of a vocabulary of "
                         f"{state['vocab_size']} tokens; this run's has {vocab_size}")

