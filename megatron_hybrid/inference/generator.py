"""Generation on a HybridEngine's rollout layout, and the micro-DP data flow around it (HybridFlow §5.2).

Each training DP rank holds its prompts. Its d_g rollout replicas (one per micro-DP group member) each generate a
contiguous chunk of them; the results are all-gathered over the micro-DP group, so every training rank gets
exactly its own prompts' results, in order. With t_g > t one rollout replica spans m training replicas and
generates for all of their prompts at once.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from ..groups import RolloutGroups, collective_errors
from ..layout import ParallelLayout
from ..megatron import compat
from ..memory import RolloutMemoryProvider
from .config import GenerationConfig
from .replica import Budget, GenerationResult, KeptPrefix, ReplicaGenerator, Turns, split_evenly
from .validation import SEED_LIMIT, Limits, check_generate_call

#: Each rollout replica's sampling stream: the call's seed plus this much per replica index (mod 2**64).
REPLICA_SEED_STRIDE = 1_000_003


def replica_seed(seed: int, replica: int) -> int:
    """Rollout replica ``replica``'s sampling seed for a call seeded ``seed`` (a 64-bit seed, as the call's)."""
    return (seed + REPLICA_SEED_STRIDE * replica) % SEED_LIMIT


class RolloutEngine(Protocol):
    """What a :class:`RolloutGenerator` reads of a :class:`~megatron_hybrid.engine.HybridEngine`, once, at
    construction: the inference package never holds the engine itself."""

    @property
    def rollout_chunks(self) -> Sequence[torch.nn.Module]:
        """The rollout model's chunks on this rank (generation takes one)."""
        ...

    @property
    def rollout_groups(self) -> RolloutGroups:
        """The rollout groups (tensor, pipeline, micro-DP, the world) with their timeout, and this rank's rollout
        replica."""
        ...

    @property
    def layout(self) -> ParallelLayout:
        ...

    @property
    def dp_rank(self) -> int:
        """This rank's training data-parallel rank (whose prompts it holds)."""
        ...

    @property
    def rollout_memory(self) -> RolloutMemoryProvider:
        """Backs the KV cache, sampling noise and graph pool while rolling out; entering its ``backed()`` switches
        the engine to rollout."""
        ...


class RolloutGenerator:
    """KV-cache generation with a :class:`~megatron_hybrid.engine.HybridEngine`'s rollout model.

    Made once per engine and kept: its KV cache and CUDA graphs live (at fixed addresses) as long as it does, and
    serve every later rollout. ``generate`` is called on every rank of the training layout.

    Args:
        engine: the HybridEngine (its rollout model, groups, layout and rollout memory: :class:`RolloutEngine`).
        config: cache and decode settings (default :class:`GenerationConfig()`).
    """

    def __init__(self, engine: RolloutEngine, config: Optional[GenerationConfig] = None) -> None:
        chunks = engine.rollout_chunks
        if len(chunks) > 1:
            raise ValueError(f"generation with virtual pipeline chunks ({len(chunks)} rollout model chunks) is not "
                             "supported")
        self.groups, self.layout, self.dp_rank = engine.rollout_groups, engine.layout, engine.dp_rank
        self.engine = engine
        self.memory = engine.rollout_memory
        self.config = config if config is not None else GenerationConfig()
        tp, pp = self.groups.groups["tp"], self.groups.groups["pp"]
        # An MoE model's replicas of one expert-parallel group step in lockstep, agreeing over its gloo twin.
        self.replica = ReplicaGenerator(chunks[0], tp_group=tp, pp_group=pp, config=self.config, memory=self.memory,
                                        groups=self.groups, lockstep_group=self.groups.groups.get("tp_ep_host"))
        self.replica.replica_index = self.groups.replica

    def generate(self, prompts: Sequence[Sequence[int]], sampling_params, *, vocab_size: Optional[int] = None,
                 stop_token_ids: Sequence[int] = (), seed: int = 0,
                 tempered_log_probs: bool = False, budget: Optional[Budget] = None,
                 resume: Sequence[GenerationResult] = (), keep: bool = False,
                 continued: Sequence[Optional[KeptPrefix]] = (), turns: Optional[Turns] = None,
                 request_stop_token_ids: Optional[Sequence[Sequence[int]]] = None) -> list[GenerationResult]:
        """Generate for this training rank's prompts on the rollout layout; results in prompt order (after the
        resumed ones, when ``resume`` has any).

        Args:
            prompts: token-id lists, each non-empty.
            sampling_params: megatron-core ``SamplingParams`` (temperature, top_k, top_p, num_tokens_to_generate,
                termination_id).
            vocab_size: the real vocabulary; the output layer's padded rows are never sampled (default: all rows).
            stop_token_ids: tokens that end a sequence (kept in its output), besides ``termination_id``.
            request_stop_token_ids: per prompt, its own stop tokens besides ``stop_token_ids`` (as a request's
                ``stop_token_ids`` in vLLM's sampling parameters; e.g. an environment's turn-ending tokens, or a data
                row's), kept in its result's ``stop_token_ids``; a resumed sequence keeps its own. None: none.
            seed: sampling seed in [0, 2**64); each rollout replica draws from its own stream derived from it.
            tempered_log_probs: also return each token's log-prob at the sampling temperature
                (``generated_tempered_log_probs``); the same on every rank.
            budget: stop once it is met (:class:`~.replica.Budget`), returning the sequences not ended with
                ``finished`` False and their tokens so far (partial rollout). Rollout replicas inside training
                replicas (micro-DP, TP and PP layouts; a widening or exchange layout is a ``ValueError``): each
                micro-DP replica stops on its share of the quota (:meth:`~.replica.Budget.share`).
            resume: unfinished results of earlier calls (a budget's), generated on: each one's prompt and tokens so
                far are prefilled again with the current weights (in the same prefills and mixed steps as new
                prompts) and it goes on for what its ``num_tokens_to_generate`` left. Each comes back first, whole:
                its earlier tokens with their log-probs and weight versions, then the new ones. Same layouts as
                ``budget``.
            keep: multi-turn: each sequence that ends keeps its KV cache in its slot (``result.kept``, a
                :class:`~.replica.KeptPrefix`) for a later call to continue, until that call, :meth:`release`, a
                switch (other weights) or prompts needing the slot. Same layouts as ``budget``.
            continued: per prompt, None or the ``kept`` of an earlier result whose sequence the prompt extends (the
                prompt is that result's prompt and generated tokens, then new ones, e.g. an environment's
                observation): where its cache is still held, only the tokens after it run (in mixed steps beside
                other work; the prefix is not recomputed), on the replica that holds it; otherwise the whole prompt
                is prefilled, with the same result (to rounding).
            turns: multi-turn inside this call (:class:`~.replica.Turns`, e.g. environments answering on threads):
                a sequence that ends a turn waits, its slot held, for ``turns``' answer while the others decode,
                then goes on from its kept cache. Each rollout replica calls ``turns`` for its own share of the
                prompts (:func:`turn_share`), with indices into the whole list; each result holds all its turns'
                tokens. Rollout replicas of one rank (t_g = p_g = 1) inside training replicas; no budget, resume
                or continued.

        Each generated token carries the engine's switch count (``weight_versions``): the weights it came from.

        Every argument is checked on every rank before any generation collective (integers are ints, numpy
        integers or integer tensor scalars, never bools or floats); a bad one raises the same ``ValueError`` on
        every rank. Switches the engine to rollout if it is not there yet (it stays there after the call). Every
        collective runs on the engine's groups, within its timeout (a
        :class:`~megatron_hybrid.groups.CollectiveError` naming it otherwise).
        """
        groups = self.groups
        resume, continued = list(resume), list(continued)
        continuing = _check_call_shape(self.engine, prompts, resume, continued, budget, turns)
        with groups.errors("generate", "the ranks' agreement on the inputs"):
            # The resumed sequences' own prompts: the fit and vocabulary checks of their first call.
            given = [r.prompt_tokens for r in resume] + list(prompts) if resume else prompts  # (raw: checked)
            call = check_generate_call(given, sampling_params,
                                       vocab_size=vocab_size, stop_token_ids=stop_token_ids, seed=seed,
                                       limits=self.replica.limits, group=groups.world,
                                       request_stop_token_ids=_request_stops(resume, request_stop_token_ids,
                                                                             len(given)))
        prompts, params = call.prompts, call.params
        own = call.request_stop_token_ids  # None, or per sequence (resumed ones first) its own stop tokens
        lay = self.layout
        _check_layout_takes(lay, budget=budget, resume=resume, keep=keep or continuing)
        kwargs = dict(vocab_size=call.vocab_size, stop_token_ids=call.stop_token_ids,
                      seed=replica_seed(call.seed, groups.replica), tempered_log_probs=tempered_log_probs)
        # The one place a generate call switches to rollout: the engine's provider switches when entered (on every
        # rank, also one whose replica gets no prompts: the switch's collectives need every rank).
        with self.memory.backed():
            kwargs["weight_version"] = int(getattr(self.engine, "num_switches", 0))  # after the switch it made
            if lay.exchange:
                return self._generate_exchanged(prompts, params, kwargs, own)
            if lay.widens:
                return self._generate_widened(prompts, params, kwargs, own)
            replica = groups.replica - self.dp_rank * lay.d_g  # index among this training replica's d_g
            if continuing and lay.d_g > 1:
                return self._generate_continued(prompts, params, kwargs, continued, keep, replica, own)
            kwargs.update(keep=keep, continued=continued or None)
            results = self._generate_share(prompts, resume, params, kwargs, own, replica, budget=budget, turns=turns)
        if lay.d_g > 1:
            results = self._gathered(replica, results)
        return _joined(resume, results)

    def _generate_share(self, prompts: list, resume: list[GenerationResult], params, kwargs: dict,
                        own: Optional[list], replica: int, *, budget: Optional[Budget],
                        turns: Optional[Turns]) -> list[GenerationResult]:
        """Rollout replicas inside training replicas: the d_g micro-DP replicas of this training replica each
        generate a contiguous part of its prompts (even parts, or cut between a budget's groups); this one's part.
        A resumed sequence's prompt and tokens so far are its prefix; it may generate what its limit left."""
        n = int(params.num_tokens_to_generate)
        inputs = [p + r.generated_tokens for p, r in zip(prompts, resume)] + prompts[len(resume):]
        limits = [n - len(r.generated_tokens) for r in resume] + [n] * (len(prompts) - len(resume))
        d_g = self.layout.d_g
        lo, hi = (split_evenly(len(prompts), d_g) if budget is None else budget.split(len(prompts), d_g))[replica]
        if turns is not None:
            kwargs["turns"] = _Shifted(turns, lo)
        # A budget of finished sequences (or groups: each on one replica) is shared out with the prompts (each
        # micro-DP replica stops on its own share, no collective per step); decode steps are every replica's.
        share = None if budget is None else budget.share(lo, hi, len(prompts))
        return self.replica.generate(inputs[lo:hi], params, **kwargs, budget=share, limits=limits[lo:hi],
                                     request_stops=None if own is None else own[lo:hi])

    def _gathered(self, replica: int, results: list[GenerationResult]) -> list[GenerationResult]:
        """The micro-DP replicas' results (``replica``'s are ``results``) all-gathered, in prompt order."""
        gathered: list[Any] = [None] * self.layout.d_g
        with self.groups.errors("generate", "the micro-DP gather of the results"):
            dist.all_gather_object(gathered, (replica, results), group=self.groups.groups["micro_dp"])
        return [r for _, part in sorted(gathered, key=lambda x: x[0]) for r in part]

    def _generate_widened(self, prompts: list, params, kwargs: dict, own: Optional[list]) -> list[GenerationResult]:
        """A widening layout's data flow: this rollout replica spans m training replicas and generates for all of
        their prompts at once (gathered over the rollout tensor-parallel group); this training replica's results."""
        tp = self.groups.groups["tp"]
        mine: list[Any] = [None] * tp.size()
        with self.groups.errors("generate", "the rollout tensor-parallel group's gather of the prompts"):
            dist.all_gather_object(mine, (self.dp_rank, prompts, own), group=tp)
        by_dp = {dp: (part, stops) for dp, part, stops in sorted(mine, key=lambda x: x[0])}
        batch = [p for part, _ in by_dp.values() for p in part]
        stops = _joined_stops(by_dp.values())
        results = self.replica.generate(batch, params, **kwargs, request_stops=stops)
        start = sum(len(by_dp[dp][0]) for dp in by_dp if dp < self.dp_rank)
        return results[start: start + len(prompts)]

    def _generate_continued(self, prompts: list, params, kwargs: dict, continued: list, keep: bool,
                            replica: int, own: Optional[list]) -> list[GenerationResult]:
        """Micro-DP replicas with kept prefixes: each continued prompt goes to the replica that holds its prefix
        (:func:`assign_kept`), the others even out the counts; results gathered back in prompt order."""
        lay, groups = self.layout, self.groups
        first = groups.replica - replica
        owners = assign_kept(len(prompts), lay.d_g,
                             [None if k is None or not first <= k.replica < first + lay.d_g else k.replica - first
                              for k in continued])
        mine = [i for i, r in enumerate(owners) if r == replica]
        results = self.replica.generate([prompts[i] for i in mine], params, **kwargs, keep=keep,
                                        continued=[continued[i] for i in mine],
                                        request_stops=None if own is None else [own[i] for i in mine])
        gathered: list[Any] = [None] * lay.d_g
        with groups.errors("generate", "the micro-DP gather of the results"):
            dist.all_gather_object(gathered, (mine, results), group=groups.groups["micro_dp"])
        out: list[Optional[GenerationResult]] = [None] * len(prompts)
        for indices, part in gathered:
            for i, r in zip(indices, part):
                out[i] = r
        return out

    def release(self, kept: Sequence[Optional[KeptPrefix]]) -> None:
        """Free the slots of kept prefixes no later call will continue (an episode's end). Called on every rank
        with the same list; no communication."""
        self.replica.release(list(kept))

    def _generate_exchanged(self, prompts: list, params, kwargs: dict, own: Optional[list]) -> list[GenerationResult]:
        """An exchange layout's data flow: its rollout replicas need not lie inside training replicas, so every
        training replica's prompts are gathered, rollout replica r takes the r-th of
        ``num_replicas`` even parts of them all in training-replica order, and the results come back the same way
        (from each rollout replica's first rank)."""
        groups = self.groups
        sent: list[Any] = [None] * dist.get_world_size()
        with groups.errors("generate", "the world's gather of the prompts"):
            dist.all_gather_object(sent, (self.dp_rank, prompts, own), group=groups.world)
        by_dp: dict[int, tuple] = {}
        for dp, part, stops in sent:  # every rank of a training replica holds its prompts: the first stands for it
            by_dp.setdefault(dp, (part, stops))
        by_dp = dict(sorted(by_dp.items()))
        batch = [p for part, _ in by_dp.values() for p in part]
        stops = _joined_stops(by_dp.values())
        replicas = groups.arrangement.num_replicas
        lo, hi = split_evenly(len(batch), replicas)[groups.replica]
        results = self.replica.generate(batch[lo:hi], params, **kwargs,
                                        request_stops=None if stops is None else stops[lo:hi])
        first_of_replica = groups.tp_rank == 0 and groups.pp_rank == 0
        back: list[Any] = [None] * dist.get_world_size()
        with groups.errors("generate", "the world's gather of the results"):
            dist.all_gather_object(back, (groups.replica, results) if first_of_replica else None, group=groups.world)
        everything = [r for _, part in sorted((x for x in back if x is not None), key=lambda x: x[0]) for r in part]
        start = sum(len(by_dp[dp][0]) for dp in by_dp if dp < self.dp_rank)
        return everything[start: start + len(prompts)]

    def report(self) -> dict[str, Any]:
        """Counters (CUDA graph captures and replays, decode steps, idle slot steps, KV-cache size and address)."""
        return self.replica.report()

    def close(self) -> None:
        self.replica.close()


def turn_share(engine: RolloutEngine, n: int) -> tuple[int, int]:
    """The prompts ``[lo, hi)`` (of a training replica's ``n``) that this rank's rollout replica generates, and so
    serves ``turns`` for; ``ValueError`` for a layout whose rollout replicas are not single ranks inside training
    replicas (the answers of ``turns`` arrive on one rank)."""
    lay, groups = engine.layout, engine.rollout_groups
    if lay.exchange or lay.widens or groups.groups["tp"].size() > 1 or groups.groups["pp"].size() > 1:
        raise ValueError(f"generate(turns=) needs rollout replicas of one rank inside training replicas "
                         f"(rollout TP 1 and PP 1; this layout has rollout TP {groups.groups['tp'].size()}, PP "
                         f"{groups.groups['pp'].size()}{', an exchange' if lay.exchange else ''}"
                         f"{', a widening' if lay.widens else ''})")
    replica = groups.replica - engine.dp_rank * lay.d_g
    return split_evenly(n, lay.d_g)[replica]


class _Shifted:
    """A replica's :class:`~.replica.Turns` view of the call's: its sequences are prompts ``lo + seq``."""

    def __init__(self, turns: Turns, lo: int) -> None:
        self.turns, self.lo = turns, lo

    def ended(self, seq: int, tokens: list[int]) -> None:
        self.turns.ended(self.lo + seq, tokens)

    def ready(self, wait: bool) -> list:
        return [(i - self.lo, tokens, limit) for i, tokens, limit in self.turns.ready(wait)]


def assign_kept(n: int, parts: int, held_by: Sequence[Optional[int]]) -> list[int]:
    """The replica (of ``parts``) of each of ``n`` prompts: ``held_by[i]`` where prompt i's kept prefix is held,
    the others each to the replica with the fewest prompts so far (the lowest on ties), in order."""
    owners: list[int] = [-1] * n
    load = [0] * parts
    for i, r in enumerate(held_by):
        if r is not None:
            owners[i] = r
            load[r] += 1
    for i in range(n):
        if owners[i] < 0:
            owners[i] = min(range(parts), key=lambda r: (load[r], r))
            load[owners[i]] += 1
    return owners


def _check_call_shape(engine: RolloutEngine, prompts: Sequence, resume: list, continued: list,
                      budget: Optional[Budget], turns: Optional[Turns]) -> bool:
    """``ValueError`` for arguments of :meth:`RolloutGenerator.generate` that do not go together (the same on
    every rank: no collective); whether any prompt continues a kept prefix."""
    if continued and len(continued) != len(prompts):
        raise ValueError(f"continued has {len(continued)} entries for {len(prompts)} prompts: one per prompt "
                         "(None where a prompt continues nothing)")
    if any(k is not None and not isinstance(k, KeptPrefix) for k in continued):
        raise ValueError("continued takes KeptPrefix entries (an earlier result's kept) or None")
    continuing = any(k is not None for k in continued)
    if continuing and (resume or budget is not None):
        raise ValueError("continued (kept prefixes) cannot be combined with resume or a budget in one call")
    if turns is not None:
        turn_share(engine, len(prompts))  # the layout's refusal, on every rank alike
        if resume or budget is not None or continuing:
            raise ValueError("turns cannot be combined with resume, a budget or continued in one call")
    unfinished_only = [i for i, r in enumerate(resume) if not isinstance(r, GenerationResult) or r.finished]
    if unfinished_only:
        raise ValueError(f"resume takes unfinished GenerationResults (finished False); item {unfinished_only[0]} "
                         "is not one")
    if budget is not None and budget.groups is not None and len(budget.groups) != len(resume) + len(prompts):
        raise ValueError(f"Budget.groups has {len(budget.groups)} labels for {len(resume)} resumed sequences "
                         f"and {len(prompts)} prompts: one per sequence")
    if budget is not None and budget.required and max(budget.required) >= len(resume) + len(prompts):
        raise ValueError(f"Budget.required names sequence {max(budget.required)} of a call of {len(resume)} resumed "
                         f"sequences and {len(prompts)} prompts")
    return continuing


def _check_layout_takes(lay: ParallelLayout, *, budget: Optional[Budget], resume: list, keep: bool) -> None:
    """``ValueError`` for a budget, resumed sequences or kept prefixes (``keep``: kept or continued) on a layout
    whose rollout replicas are not inside training replicas (an exchange or a widening one)."""
    if (budget is not None or resume or keep) and (lay.exchange or lay.widens):
        what = ("a generate budget" if budget is not None else "resuming sequences" if resume
                else "keeping prefixes")
        raise ValueError(f"{what} needs rollout replicas inside training replicas for now (micro-DP, TP or PP "
                         f"rollout layouts); this is {'an exchange' if lay.exchange else 'a widening'} layout")


def _request_stops(resume: list[GenerationResult], asked: Any, count: int) -> Any:
    """The call's per-sequence stop tokens as :func:`~.validation.check_generate_call` checks them (``count``
    sequences, the resumed ones first, each keeping its own): None where no sequence has any; ``asked`` as given
    where it is not a list or tuple (the check names it)."""
    if asked is not None and not isinstance(asked, (list, tuple)):
        return asked
    asked = list(asked or [])
    if resume:
        mine = [r.stop_token_ids for r in resume]
        return mine + (asked or [[]] * (count - len(resume))) if any(mine) or asked else None
    return asked or None


def _joined_stops(parts) -> Optional[list]:
    """Several ranks' ``(prompts, per-prompt stops or None)`` as one per-prompt list (None where none has any)."""
    parts = list(parts)
    if all(stops is None for _, stops in parts):
        return None
    return [s for part, stops in parts for s in (stops if stops is not None else [[]] * len(part))]


def _joined(resume: list[GenerationResult], results: list[GenerationResult]) -> list[GenerationResult]:
    """``results``, the first ``len(resume)`` of which continue ``resume``'s sequences, each joined onto its earlier
    tokens, log-probs and weight versions (its prompt the original one)."""
    if resume:
        for i, (old, new) in enumerate(zip(resume, results)):
            results[i] = GenerationResult(
                list(old.prompt_tokens), old.generated_tokens + new.generated_tokens,
                old.generated_log_probs + new.generated_log_probs,
                old.generated_tempered_log_probs + new.generated_tempered_log_probs, finished=new.finished,
                weight_versions=old.weight_versions + new.weight_versions, routed_experts=new.routed_experts,
                stop_token_ids=list(old.stop_token_ids))
    return results


def generate_with_model(chunk: torch.nn.Module, prompts: Sequence[Sequence[int]], sampling_params, *, tp_group,
                        pp_group, config: Optional[GenerationConfig] = None, vocab_size: Optional[int] = None,
                        stop_token_ids: Sequence[int] = (), seed: int = 0,
                        tempered_log_probs: bool = False,
                        request_stop_token_ids: Optional[Sequence[Sequence[int]]] = None) -> list[GenerationResult]:
    """One-shot KV-cache generation with any GPTModel stage on its own groups (e.g. the training-layout model).

    Called on every rank (the checks agree over the world); the ranks of one model replica pass the same prompts.
    Without ``config`` the cache is sized to this call and decode steps run eagerly (graphs captured for one call
    would cost more than they save). The cache and graphs are dropped at the end: keep a :class:`ReplicaGenerator`
    to reuse them.
    """
    limit = config.max_sequence_length if config is not None and config.max_sequence_length else None
    limits = Limits(padded_vocab=int(chunk.vocab_size), slot_tokens=limit or int(chunk.max_sequence_length))
    world = dist.group.WORLD
    timeout = compat.group_timeout(world) or dist.distributed_c10d.default_pg_timeout
    with collective_errors("generate", "the ranks' agreement on the inputs", timeout=timeout,
                           whose="the world process group's"):
        call = check_generate_call(prompts, sampling_params, vocab_size=vocab_size, stop_token_ids=stop_token_ids,
                                   seed=seed, limits=limits, group=world,
                                   request_stop_token_ids=_request_stops([], request_stop_token_ids, 0))
    prompts = call.prompts
    if not prompts:
        return []
    if config is None:
        config = GenerationConfig(max_batch_size=min(64, len(prompts)), cuda_graphs=False,
                                  max_sequence_length=max(2, max(len(p) for p in prompts)
                                                          + call.params.num_tokens_to_generate))
    replica = ReplicaGenerator(chunk, tp_group=tp_group, pp_group=pp_group, config=config)
    try:
        return replica.generate(prompts, call.params, vocab_size=call.vocab_size,
                                stop_token_ids=call.stop_token_ids, seed=call.seed,
                                tempered_log_probs=tempered_log_probs, request_stops=call.request_stop_token_ids)
    finally:
        replica.close()
