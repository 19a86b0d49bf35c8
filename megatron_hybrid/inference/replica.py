"""Generation on one model replica (its tensor- and pipeline-parallel groups): the loop, stops and results.

The generator is three rooms, as in generation engines (vLLM: scheduler, model runner, runner output; megatron-core:
scheduler, text-generation controller, model-inference wrapper):

- policy, :mod:`.planner`: which step runs next (prefill groups, mixed steps, batch buckets, slot compaction), as a
  typed :class:`~.planner.StepPlan`, pure Python;
- execution, :mod:`.runner`: the stage's fixed-address inputs, forwards, CUDA graphs and pipeline exchange, which
  turn a plan into a :class:`~.runner.StepOutput`;
- bookkeeping, here: :class:`ReplicaGenerator` runs the loop over the two, reads each step's tokens to the host
  (stop tokens, lengths, sequences launched before the host saw their end) and collects the results and log-probs;
  :class:`KeptSlots` keeps the ended sequences' caches between calls (multi-turn).

Every rank of the replica plans the same steps (:class:`~.scheduler.SlotScheduler`) from the same prompts: the
last pipeline stage samples and broadcasts each step's tokens to the other stages, and every rank reads them to the
host, the one host round trip per step that stop detection needs.

Refills of a few prompts, while other slots decode, ride along the next decode step ("mixed" steps); the first fill,
and refills of more tokens than ``GenerationConfig.mixed_prefill_tokens``, are prefills of their own.

Lockstep: when a stage's expert-parallel group spans several rollout replicas (an MoE model with e_g > t_g), every
MoE layer's all-gather over the group needs the same rows from each of them, in every forward. Before each step the
replicas agree on ``[still running, packed tokens]`` by one element-wise maximum over the group on the host
(:func:`~megatron_hybrid.reshard.communication.agree_max`, over ``lockstep_group``); the step then runs with its MoE
layers padded to the agreed rows (the plan's ``moe_rows``, a fixed bucket a CUDA graph can hold), and a replica that is
done (or had no prompts) runs idle steps, only its MoE layers' collectives, until the maximum says every replica of
the group is done. With no such group, nothing of this runs (no agreement, no padding).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from ..groups import RolloutGroups
from ..memory import RolloutBuffer, RolloutMemoryProvider
from ..reshard import agree_max
from .config import GenerationConfig
from .graphs import StepGraphs
from .kv_cache import CacheGeometry, KVCache
from .planner import MIXED_PROMPTS as _MIXED_PROMPTS  # noqa: F401  (the former homes of the planner's constants)
from .planner import MIXED_TOKENS as _MIXED_TOKENS  # noqa: F401
from .planner import PREFILL_FORWARD_TOKENS as _PREFILL_FORWARD_TOKENS  # noqa: F401
from .planner import CallSchedule, SlotMoves, StepPlan, StepPlanner, WaitForTurns, packed_tokens
from .runner import StageRunner, StepOutput
from .validation import Limits


@dataclass
class GenerationResult:
    """One prompt's generation."""

    prompt_tokens: list[int]
    generated_tokens: list[int] = field(default_factory=list)
    generated_log_probs: list[float] = field(default_factory=list)
    """log p(token) under the model's untempered distribution over the real vocabulary."""
    generated_tempered_log_probs: list[float] = field(default_factory=list)
    """log p(token) under softmax(logits / temperature) over the real vocabulary, before top-k/top-p: what training
    passes at the sampling temperature compute (filled when generating with ``tempered_log_probs=True``)."""
    finished: bool = True
    """Whether the sequence ended (a stop token or the length limit); False for one a ``budget`` left unfinished:
    its tokens so far (none if it never got a slot), to be resumed."""
    weight_versions: list[int] = field(default_factory=list)
    """Per generated token, the version of the weights that produced it (the engine's switch count, or the call's
    ``weight_version``)."""
    kept: Optional["KeptPrefix"] = None
    """With ``keep``: where the ended sequence's KV cache is kept for a continuation (multi-turn); None when it
    was not kept (or not asked to be)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """The request's own stop tokens, besides the call's (``request_stop_token_ids``): a resumed sequence stops on
    them as it would have in its first call."""
    routed_experts: Optional[torch.Tensor] = None
    """With ``GenerationConfig.record_routing`` (an MoE model): ``[P + n - 1, M, k]`` int16 on the host (int32 past
    32,767 experts), the top-k experts each of the model's M MoE layers chose for every token the rollout ran
    through the model: the P prompt tokens and the first n - 1 of the n generated ones (the last generated token is
    never an input). Row i is token i of prompt + response; every rank of the replica gets all layers."""


class Turns(Protocol):
    """Multi-turn inside one generate call (``generate(turns=)``), e.g. environments answering on threads."""

    def ended(self, seq: int, tokens: list[int]) -> None:
        """Sequence ``seq`` (the call's index) ended a turn with ``tokens``; its answer comes through ready."""

    def ready(self, wait: bool) -> list[tuple[int, Optional[list[int]], int]]:
        """Answers so far, each ``(seq, tokens, limit)``: the sequence's whole next prompt (its last prompt, its
        tokens and an observation) and the tokens its next turn may generate, or ``tokens`` None where it takes
        no more turns. ``wait``: block until there is at least one."""


@dataclass(frozen=True)
class KeptPrefix:
    """An ended sequence's KV cache kept in a slot of a rollout replica (``generate(keep=True)``): a later call
    continues it (``continued``) by running only the tokens after ``positions``, while the weights are the same
    (``weight_version``) and the slot was not given to other prompts in between (then it is prefilled again)."""

    replica: int
    """The rollout replica whose cache holds it (0 for a lone :class:`ReplicaGenerator`)."""
    slot: int
    positions: int
    """Cache positions holding the sequence: its prompt and all but the last generated token."""
    weight_version: int


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) chunks of n items over ``parts`` takers, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for j in range(parts):
        end = start + base + (1 if j < extra else 0)
        out.append((start, end))
        start = end
    return out


@dataclass(frozen=True)
class Budget:
    """When a generate call stops before every sequence has ended (partial rollout): once ``finished`` of its
    sequences have ended, or once it has run ``decode_steps`` decode steps, whichever comes first. The sequences
    still running (and those still waiting for a slot) come back with ``finished`` False and their tokens so far.
    Checked where the host reads each step's tokens anyway: no extra synchronisation.

    ``groups``: per sequence of the call (the resumed ones first, then the prompts), a group label, each group's
    sequences consecutive; ``finished`` then counts the groups all of whose sequences in the call have ended (a GRPO
    group trains once all its samples are done), and a micro-DP split keeps every group on one replica.

    ``required``: sequences (indices into the call's) that must end before ``finished`` may stop the call (partial
    rollout: samples at their staleness bound, which would be dropped if parked again); ``decode_steps`` still
    stops it."""

    finished: Optional[int] = None
    decode_steps: Optional[int] = None
    groups: Optional[tuple[int, ...]] = None
    required: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("finished", "decode_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"Budget.{name} ({value!r}) must be a positive integer")
        if self.finished is None and self.decode_steps is None:
            raise ValueError("Budget needs finished (sequences wanted) or decode_steps")
        object.__setattr__(self, "required", tuple(self.required))
        bad = [i for i in self.required if not isinstance(i, int) or isinstance(i, bool) or i < 0]
        if bad:
            raise ValueError(f"Budget.required holds {bad[0]!r}: it takes indices of the call's sequences (ints >= 0)")
        if self.groups is not None:
            object.__setattr__(self, "groups", tuple(self.groups))
            seen: set = set()
            for i, label in enumerate(self.groups):
                if label in seen and self.groups[i - 1] != label:
                    raise ValueError(f"Budget.groups: the sequences of group {label!r} must be consecutive "
                                     f"(sequence {i} is apart from the rest)")
                seen.add(label)

    def _runs(self, count: int) -> list[int]:
        """The start of every group among ``count`` sequences (each sequence its own group without ``groups``)."""
        if self.groups is None:
            return list(range(count))
        return [i for i in range(count) if i == 0 or self.groups[i] != self.groups[i - 1]]

    def split(self, count: int, parts: int) -> list[tuple[int, int]]:
        """``count`` sequences in ``parts`` contiguous [start, end) chunks (micro-DP replicas' shares) of about
        equal size, cut only between groups."""
        if self.groups is None:
            return split_evenly(count, parts)
        cuts, runs = [0], self._runs(count) + [count]
        for j in range(1, parts):  # the group start nearest each even cut, never before the previous cut
            target = j * count / parts
            cuts.append(max(cuts[-1], min(runs, key=lambda r: (abs(r - target), r))))
        cuts.append(count)
        return list(zip(cuts[:-1], cuts[1:]))

    def share(self, lo: int, hi: int, whole: int) -> Optional["Budget"]:
        """This budget for sequences [lo, hi) of ``whole`` (a micro-DP replica's, from :meth:`split`): the finished
        quota in proportion to its sequences (or groups), rounded up (None when the part is empty); decode steps
        unchanged."""
        if hi == lo:
            return None
        required = tuple(i - lo for i in self.required if lo <= i < hi)
        if self.finished is None:
            return Budget(None, self.decode_steps)
        if self.groups is None:
            return Budget(max(1, -(-self.finished * (hi - lo) // whole)), self.decode_steps, required=required)
        mine, total = len(self._runs(hi)) - len(self._runs(lo)), len(self._runs(whole))
        return Budget(min(mine, max(1, -(-self.finished * mine // total))), self.decode_steps, self.groups[lo:hi],
                      required)

    def complete(self, ended: Sequence[bool]) -> int:
        """How many groups (or sequences, without ``groups``) have ended."""
        if self.groups is None:
            return sum(ended)
        runs = self._runs(len(ended)) + [len(ended)]
        return sum(all(ended[a:b]) for a, b in zip(runs[:-1], runs[1:]))

    def met(self, ended: Sequence[bool], decode_steps: int) -> bool:
        if self.decode_steps is not None and decode_steps >= self.decode_steps:
            return True
        # Every group has a sequence: fewer ended sequences than the quota cannot make it up.
        return self.finished is not None and sum(ended) >= self.finished and self.complete(ended) >= self.finished \
            and all(ended[i] for i in self.required)


@dataclass
class _InFlight:
    """A launched step whose sampled tokens are on their way to the host."""

    owners: list[Optional[int]]
    """Per sampled row, the sequence it belongs to (None: an idle slot or a padded row). A row of a sequence that
    turns out to have ended before it (a stop token the host had not seen yet) is set to None when read."""
    tokens: torch.Tensor
    """The rows' tokens: a pinned host copy in flight (GPU), or the tokens themselves (CPU)."""
    event: Optional[torch.cuda.Event]


@dataclass
class _Call:
    """One generate call's host-side state."""

    results: list[GenerationResult]
    schedule: CallSchedule
    stops: set[int]
    own_stops: list[frozenset]
    """Per sequence, its request's own stop tokens (empty for most)."""
    limit: list[int]
    """Per sequence, the tokens this call may generate at most."""
    closed: list[bool]
    """Per sequence: no more steps will be launched for it; its slot is free."""
    ended: list[bool]
    """Per sequence: its last token has arrived."""
    flight: deque = field(default_factory=deque)
    """The launched steps whose tokens the host has not read yet (:class:`_InFlight`)."""
    rows: list[list[Optional[int]]] = field(default_factory=list)
    """Per step, which sequence each sampled row belongs to (None: an idle slot or a dropped row)."""
    log_probs: list[Optional[torch.Tensor]] = field(default_factory=list)
    """Per step, the last stage's log-probs."""
    keep: bool = False
    """Ended sequences hold their slots (multi-turn)."""
    holds: dict[int, int] = field(default_factory=dict)
    """With ``keep``: sequence -> the slot it held when it closed."""
    holder: dict[int, int] = field(default_factory=dict)
    """With ``keep``: slot -> the sequence that closed there last."""
    turns: Optional["Turns"] = None
    """Multi-turn inside the call (:class:`Turns`)."""
    base: list[int] = field(default_factory=list)
    """Per sequence, its generated tokens before its current turn (``limit`` counts the turn's)."""
    just_ended: list[int] = field(default_factory=list)
    """Sequences whose turn ended since ``turns`` last heard."""
    deferred: list = field(default_factory=list)
    """Answers of ``turns`` waiting for their sequence's rows in flight."""
    routed: dict[int, torch.Tensor] = field(default_factory=dict)
    """With a routing record: per sequence, its slot's rows copied out when it closed (``[positions, M, k]``, this
    stage's MoE layers; trimmed to the tokens it ran once its length is known)."""


class KeptSlots:
    """A replica's held slots: the kept prefixes of ended sequences (``generate(keep=True)``), oldest first, each
    with the weight version its cache holds. A call's ``continued`` prompts run on from them (:meth:`take`), the
    call books its ended sequences' (:meth:`book`), and :meth:`release` frees those no later call continues."""

    def __init__(self) -> None:
        self.versions: dict[int, int] = {}
        """slot -> the weight version it holds."""

    def __len__(self) -> int:
        return len(self.versions)

    def clear(self) -> None:
        self.versions.clear()

    def forget_stale(self, weight_version: int) -> None:
        """Other weights than the kept caches': they are stale."""
        if self.versions and weight_version != next(iter(self.versions.values())):
            self.versions.clear()

    def take(self, prompts: Sequence[list[int]], continued: Sequence[Optional[KeptPrefix]], *, replica: int,
             weight_version: int, fits: Callable[[int], bool]) -> tuple[dict[int, tuple[int, int]], list[int]]:
        """The prompts that run on from a kept prefix: sequence -> (slot, positions), those slots no longer kept;
        and the slots still held. One whose prefix is no longer held (another replica's, other weights, evicted,
        or continued twice) or whose new tokens do not fit a mixed step (``fits``) is prefilled whole (its held
        slot, if any, is freed)."""
        out: dict[int, tuple[int, int]] = {}
        taken: set[int] = set()
        for seq, (prompt, kept) in enumerate(zip(prompts, continued)):
            if kept is None:
                continue
            if kept.replica != replica or kept.weight_version != weight_version:
                continue
            if self.versions.get(kept.slot) != weight_version or kept.slot in taken:
                continue
            if not (0 < kept.positions < len(prompt)) or not fits(len(prompt) - kept.positions):
                self.versions.pop(kept.slot)
                continue
            out[seq] = (kept.slot, kept.positions)
            taken.add(kept.slot)
        held = [slot for slot in self.versions if slot not in {s for s, _ in out.values()}]
        for slot, _ in out.values():
            del self.versions[slot]
        return out, held

    def book(self, call: _Call, *, replica: int, weight_version: int, keeps_between_calls: bool) -> int:
        """After a call: evicted slots forgotten; with ``keep``, each ended sequence whose slot is still held gets
        its :class:`KeptPrefix` and the slot is kept (newest last). ``keeps_between_calls``: whether the cache
        outlives the call. Returns how many kept prefixes were evicted."""
        sched = call.schedule.scheduler
        if call.keep and not keeps_between_calls:
            sched.held.clear()  # the cache is given back after the call: nothing to keep
        for slot in sched.evicted:
            self.versions.pop(slot, None)
        held = set(sched.held)
        self.versions = {slot: v for slot, v in self.versions.items() if slot in held}  # earlier holds still standing
        for seq, slot in call.holds.items():
            result = call.results[seq]
            if call.holder[slot] != seq:  # evicted, and taken by a later sequence
                continue
            if slot in held and call.ended[seq]:
                positions = len(result.prompt_tokens) + len(result.generated_tokens) - 1
                result.kept = KeptPrefix(replica, slot, positions, weight_version)
                self.versions[slot] = weight_version
            elif slot in held:  # held at close, but it did not end (a budget stopped it): free
                sched.held.remove(slot)
        return len(sched.evicted)

    def release(self, kept: Sequence[Optional[KeptPrefix]], *, replica: int) -> None:
        """Free the slots of these kept prefixes (``replica``'s; others and stale ones are ignored)."""
        for k in kept:
            if k is not None and k.replica == replica and self.versions.get(k.slot) == k.weight_version:
                del self.versions[k.slot]


#: :class:`ReplicaGenerator`'s counters (``report()``). busy_steps: decode steps with at least half of the slots
#: decoding; kept_continued: prompts run on from a kept prefix; kept_evicted: kept prefixes given to waiting prompts.
COUNTERS = ("prefill_forwards", "prefill_graph_forwards", "decode_steps", "busy_steps", "idle_slot_steps",
            "max_active_slots", "dropped_rows", "calls", "mixed_steps", "slot_moves", "lockstep_steps",
            "lockstep_idle_steps", "lockstep_padded_rows", "kept_continued", "kept_evicted", "turns")


class ReplicaGenerator:
    """KV-cache generation with one model replica: ``chunk`` (this rank's GPTModel stage) on ``tp_group`` and
    ``pp_group``. Called by every rank of the replica with the same, already checked prompts.

    On a GPU the loop runs one step ahead of the host: step k+1 is launched before step k's tokens are read, so
    the host's bookkeeping (stop tokens, refills) overlaps the device's work (``GenerationConfig.overlap_host``).
    A sequence that ends on a stop token therefore has one more row computed in the step after, which is dropped
    (``report()["dropped_rows"]``); sequences that end by length are known in advance and cost nothing.

    Args:
        chunk: a megatron-core GPTModel stage; its self-attention modules become
            :class:`~.attention.KVCacheSelfAttention` (unchanged behaviour outside a generation step).
        tp_group, pp_group: the replica's groups.
        config: cache and decode settings.
        memory: where the KV cache, the sampling noise and the CUDA-graph pool are reserved, and what backs them
            for a generate call (a HybridEngine's ``rollout_memory``); default: a provider of its own that backs
            them for the duration of each call.
        groups: the rollout groups ``tp_group`` and ``pp_group`` belong to: a failed or timed-out exchange then
            names the phase and their timeout.
        lockstep_group: where this stage's expert-parallel group spans other replicas, the group the replicas agree
            on each step over: a gloo group over the same ranks keeps the agreement off the device (default: the
            expert-parallel group itself). Unused otherwise.
    """

    def __init__(self, chunk: torch.nn.Module, *, tp_group, pp_group, config: GenerationConfig,
                 memory: Optional[RolloutMemoryProvider] = None, groups: Optional[RolloutGroups] = None,
                 lockstep_group=None) -> None:
        self.chunk, self.tp_group, self.pp_group = chunk, tp_group, pp_group
        self.config = config
        self.runner = StageRunner(chunk, tp_group=tp_group, pp_group=pp_group, config=config, memory=memory,
                                  groups=groups)
        self.device = self.runner.device
        spans = self.runner.spans_replicas
        self.lockstep_group = (lockstep_group if lockstep_group is not None else self.runner.expert_group) if spans \
            else None
        on_gpu = self.device.type == "cuda"
        self.overlap = on_gpu if config.overlap_host is None else config.overlap_host
        self.compact = self.runner.use_graphs if config.compact_slots is None else config.compact_slots
        self.limits = Limits(padded_vocab=int(chunk.vocab_size), slot_tokens=self.geometry.slot_tokens)
        self.planner: Optional[StepPlanner] = None  # made with the runner's buffers, at the first call
        self.kept = KeptSlots()
        """Held slots (kept prefixes of ended sequences)."""
        self.replica_index = 0  # what KeptPrefix.replica says (the engine's generator sets its replica's)
        self.stats = dict.fromkeys(COUNTERS, 0)

    # The runner's state, under the names tests and tools read it by.
    @property
    def geometry(self) -> CacheGeometry:
        return self.runner.geometry

    @property
    def attention(self) -> list:
        return self.runner.attention

    @property
    def graphs(self) -> Optional[StepGraphs]:
        return self.runner.graphs

    @property
    def cache(self) -> Optional[KVCache]:
        return self.runner.cache

    @property
    def noise(self) -> Optional[RolloutBuffer]:
        return self.runner.noise

    def _ensure_state(self) -> None:
        """The runner's buffers (again after :meth:`close`) and the planner over them."""
        self.runner.allocate()
        if self.planner is None:
            self.planner = StepPlanner(self.runner.plan_settings(compact=self.compact))

    # -- the loop ----------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[list[int]], params, *, vocab_size: int, stop_token_ids: Sequence[int] = (),
                 seed: int = 0, tempered_log_probs: bool = False, budget: Optional[Budget] = None,
                 weight_version: int = 0, limits: Optional[Sequence[int]] = None, keep: bool = False,
                 continued: Optional[Sequence[Optional[KeptPrefix]]] = None, turns: Optional["Turns"] = None,
                 request_stops: Optional[Sequence[Sequence[int]]] = None) -> list[GenerationResult]:
        """Generate for ``prompts`` (checked: non-empty, ids below ``vocab_size``, each fits a slot); every rank of
        the replica gets every result (``tempered_log_probs``, the same on every rank: also fill
        ``generated_tempered_log_probs``). ``budget``: stop early (:class:`Budget`; every rank of the replica
        decides alike, from the same tokens). Each generated token is tagged with ``weight_version``. ``limits``:
        per prompt, the tokens to generate at most (default: ``num_tokens_to_generate`` each; a resumed sequence
        has what it had left). ``request_stops``: per prompt, its own stop tokens besides ``stop_token_ids``
        (checked by the caller; kept in each result's ``stop_token_ids``).

        Multi-turn: with ``keep`` an ended sequence keeps its slot's cache (``result.kept``) until a later call
        continues it, :meth:`release` frees it, the weights change, or waiting prompts need the slot.
        ``continued``: per prompt, None or the :class:`KeptPrefix` of an earlier result whose sequence the prompt
        extends (the prompt is that result's prompt and generated tokens, then new ones): only the tokens after
        ``positions`` run (in mixed steps), where the prefix is still held; else the whole prompt is prefilled.

        ``turns`` (:class:`Turns`): multi-turn inside the call. A sequence that ends a turn holds its slot and is
        handed to ``turns.ended``; whatever ``turns.ready`` answers goes on in this call (from the kept cache,
        only the new tokens run, beside the other sequences) or ends; the call returns when every sequence has
        taken its last turn. Each result holds all of its turns' generated tokens (their log-probs and versions
        alike), not the answers between them. Needs a replica of one rank (the answers arrive on it alone)."""
        if turns is not None and (self.tp_group.size() > 1 or self.pp_group.size() > 1 or
                                  self.lockstep_group is not None or self.runner.records_routing or budget):
            raise ValueError("generate(turns=) needs a rollout replica of one rank, without a budget or a routing "
                             "record")
        own = [()] * len(prompts) if request_stops is None else [tuple(r) for r in request_stops]
        results = [GenerationResult(list(p), stop_token_ids=list(r)) for p, r in zip(prompts, own)]
        self.kept.forget_stale(weight_version)
        if not prompts and self.lockstep_group is None:  # in lockstep, a replica without prompts steps idle
            return results
        self._ensure_state()
        signature = self.runner.begin(params, vocab_size=vocab_size, tempered_log_probs=tempered_log_probs,
                                      seed=seed)
        stops = set(stop_token_ids) | ({int(params.termination_id)} if params.termination_id is not None else set())
        resumed, held = self.kept.take(prompts, continued or [None] * len(prompts), replica=self.replica_index,
                                       weight_version=weight_version, fits=self.planner.continuation_fits)
        self.stats["kept_continued"] += len(resumed)
        schedule = self.planner.schedule(prompts, signature=signature, continued=resumed, held=held)
        call = _Call(results, schedule, stops, [frozenset(r) for r in own], keep=keep or turns is not None,
                     turns=turns,
                     limit=[int(params.num_tokens_to_generate)] * len(prompts) if limits is None else list(limits),
                     closed=[False] * len(prompts),
                     ended=[False] * len(prompts), base=[0] * len(prompts))
        depth = 1 if self.overlap else 0
        was_training = self.chunk.training
        self.chunk.eval()
        try:
            # The cache, the sampling noise and the graph pool: with the engine's provider this call is inside the
            # rollout its generator switched to (nothing to do here); with a provider of its own, mapped for it.
            with torch.no_grad(), self.runner.backed():
                for plan in call.schedule:
                    if isinstance(plan, SlotMoves):
                        self.runner.move_slots(plan)
                        self.stats["slot_moves"] += len(plan.sources)
                        continue
                    if isinstance(plan, WaitForTurns):
                        self._drain(call, 0)
                        self._turns(call, wait=True)
                        continue
                    if self.lockstep_group is not None:
                        plan = self._agree(plan)
                    self._launched(call, plan, self.runner.run(plan))
                    self._drain(call, depth)
                    if turns is not None:
                        self._turns(call, wait=False)
                    if budget is not None and budget.met(call.ended, call.schedule.scheduler.decode_steps):
                        break
                self._drain(call, 0)
                self._leave_unfinished(call)
                self.stats["kept_evicted"] += self.kept.book(
                    call, replica=self.replica_index, weight_version=weight_version,
                    keeps_between_calls=getattr(self.runner.memory, "keeps_between_calls", True))
                if self.lockstep_group is not None:
                    self._idle_until_done()
                if call.rows:
                    self._collect_log_probs(call, tempered=tempered_log_probs)
                if self.runner.records_routing and prompts:
                    self._collect_routing(call)
        finally:
            self.chunk.train(was_training)
            self.runner.end()
        for result in results:
            result.weight_versions = [weight_version] * len(result.generated_tokens)
        sched = call.schedule.scheduler
        for key in ("decode_steps", "busy_steps", "idle_slot_steps"):
            self.stats[key] += getattr(sched, key)
        self.stats["max_active_slots"] = max(self.stats["max_active_slots"], sched.max_active)
        self.stats["calls"] += 1
        if self.device.type == "cuda" and self.config.release_memory:
            torch.cuda.empty_cache()
        return results

    # -- lockstep over an expert-parallel group spanning replicas ----------------------------------------------

    def _agreed(self, running: int, tokens: int) -> tuple[int, int]:
        with self.runner._errors("the expert-parallel group's agreement on the next step"):
            running, rows = agree_max([running, tokens], self.lockstep_group)
        return running, rows

    def _agree(self, plan: StepPlan) -> StepPlan:
        """``plan`` padded for the group: its MoE layers carry the group's most packed tokens (bucketed)."""
        tokens = packed_tokens(plan)
        _, rows = self._agreed(1, tokens)
        rows = self.planner.moe_bucket(rows)
        self.stats["lockstep_steps"] += 1
        self.stats["lockstep_padded_rows"] += rows - tokens
        return self.planner.lockstep(plan, rows)

    def _idle_until_done(self) -> None:
        """This replica is done: idle steps for as long as another replica of the group runs steps."""
        while True:
            running, rows = self._agreed(0, 0)
            if not running:
                return
            self.runner.run(self.planner.idle(self.planner.moe_bucket(rows)))
            self.stats["lockstep_idle_steps"] += 1

    def _launched(self, call: _Call, plan: StepPlan, out: StepOutput) -> None:
        """Book a launched step: its rows in flight, and the sequences it ends by length (whatever its tokens)."""
        if plan.kind == "prefill":
            self.stats["prefill_graph_forwards" if plan.graph_key is not None else "prefill_forwards"] += 1
        elif plan.kind == "mixed":
            self.stats["mixed_steps"] += 1
        owners = list(plan.owners)  # one list: a row dropped when read is dropped from the log-probs too
        call.rows.append(owners)
        call.log_probs.append(out.log_probs)
        call.flight.append(self._in_flight(out.tokens, owners))
        launched = call.schedule.launched  # counted as the plans were made
        for seq in owners:
            if seq is not None and launched[seq] == call.limit[seq] and not call.closed[seq]:
                self._close(call, seq)

    def _leave_unfinished(self, call: _Call) -> None:
        """After a budget stopped the call: the sequences that have not ended are unfinished (their slots freed,
        their routing rows taken)."""
        for seq, ended in enumerate(call.ended):
            if not ended:
                call.results[seq].finished = False
                if not call.closed[seq] and seq in call.schedule.scheduler.slot_of:
                    self._close(call, seq)

    def release(self, kept: Sequence[Optional[KeptPrefix]]) -> None:
        """Free the slots of these kept prefixes (this replica's; others and stale ones are ignored)."""
        self.kept.release(kept, replica=self.replica_index)

    def _turns(self, call: _Call, *, wait: bool) -> None:
        """Hand the sequences that ended a turn to ``call.turns``; put its answers in the schedule (``wait``: at
        least one, blocking, when nothing else can run). A sequence with rows still in flight (launched before its
        stop token was seen) goes on only once they are read."""
        turns, sched = call.turns, call.schedule
        for seq in call.just_ended:
            out = call.results[seq].generated_tokens
            sched.park(seq)
            turns.ended(seq, out[call.base[seq]:])
        call.just_ended = []
        in_flight = {seq for step in call.flight for seq in step.owners if seq is not None}
        answers = call.deferred + turns.ready(wait=wait and not call.deferred)
        call.deferred = []
        for seq, tokens, limit in answers:
            if seq in in_flight:
                call.deferred.append((seq, tokens, limit))
                continue
            slot = call.holds.get(seq)
            held = slot is not None and slot in sched.scheduler.held and call.holder.get(slot) == seq
            if tokens is None:  # its last turn
                sched.unpark(seq)
                if held:
                    sched.scheduler.held.remove(slot)
                continue
            result = call.results[seq]
            written = len(sched.prompts[seq]) + len(result.generated_tokens) - call.base[seq] - 1
            kept = (slot, written) if held and self.planner.continuation_fits(len(tokens) - written) else None
            if held and kept is None:
                sched.scheduler.held.remove(slot)
            call.base[seq], call.limit[seq] = len(result.generated_tokens), int(limit)
            call.closed[seq] = call.ended[seq] = False
            sched.next_turn(seq, list(tokens), kept)
            self.stats["turns"] += 1
            self.stats["kept_continued"] += kept is not None

    def _close(self, call: _Call, seq: int) -> None:
        call.closed[seq] = True
        slot = call.schedule.finish(seq, hold=call.keep)
        if call.keep:
            call.holds[seq] = slot
            call.holder[slot] = seq
        if self.runner.records_routing:
            # Every position its launched steps wrote (a stop token not yet seen may end it earlier: trimmed later).
            positions = len(call.results[seq].prompt_tokens) + call.schedule.launched[seq] - 1
            call.routed[seq] = self.runner.take_routing(slot, positions)
        self.runner.release([slot])

    def _in_flight(self, picked: torch.Tensor, owners: list[Optional[int]]) -> _InFlight:
        if not self.overlap or self.device.type != "cuda":  # on a CPU the step has run already
            return _InFlight(owners, picked, None)
        host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
        host.copy_(picked, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return _InFlight(owners, host, event)

    def _drain(self, call: _Call, keep: int) -> None:
        """Read the tokens of the steps in flight, oldest first, until ``keep`` are left: stop tokens and lengths
        end sequences (closing those still open); a row of a sequence that had ended already is dropped."""
        while len(call.flight) > keep:
            step = call.flight.popleft()
            if step.event is not None:
                step.event.synchronize()
            for j, (tok, seq) in enumerate(zip(step.tokens.tolist(), step.owners)):
                if seq is None:
                    continue
                if call.ended[seq]:  # launched before the host saw this sequence's stop token
                    step.owners[j] = None
                    self.stats["dropped_rows"] += 1
                    continue
                out = call.results[seq].generated_tokens
                out.append(tok)
                if tok in call.stops or tok in call.own_stops[seq] or len(out) - call.base[seq] == call.limit[seq]:
                    call.ended[seq] = True
                    if not call.closed[seq]:
                        self._close(call, seq)
                    if call.turns is not None:
                        call.just_ended.append(seq)

    def _collect_log_probs(self, call: _Call, *, tempered: bool) -> None:
        """Move the last stage's log-probs to the host in one copy and share them with the other stages. Each
        step's are ``[n]``, or ``[n, 2]`` with the tempered ones."""
        total = sum(len(r) for r in call.rows)
        columns = 2 if tempered else 1
        flat = torch.cat(call.log_probs).view(-1) if self.runner.is_last else None
        flat = self.runner.share(flat, total * columns, torch.float32).view(total, columns).tolist()
        i = 0
        for owners in call.rows:  # one row per sampled token, in the order the tokens were appended
            for seq in owners:
                if seq is not None:
                    call.results[seq].generated_log_probs.append(flat[i][0])
                    if columns == 2:
                        call.results[seq].generated_tempered_log_probs.append(flat[i][1])
                i += 1

    def _collect_routing(self, call: _Call) -> None:
        """Each result's routing record: the rows of the tokens it ran, every stage's MoE layers (one copy to the
        host and one merge over the pipeline for the whole call)."""
        # (A sequence a budget left waiting never ran: no rows.)
        lengths = [len(r.prompt_tokens) + len(r.generated_tokens) - 1 if seq in call.routed else 0
                   for seq, r in enumerate(call.results)]
        stage = torch.cat([call.routed[seq][:n] for seq, n in enumerate(lengths) if seq in call.routed])
        for seq, (result, rows) in enumerate(zip(call.results, self.runner.merge_routing(stage).split(lengths))):
            result.routed_experts = rows if seq in call.routed else None

    def report(self) -> dict[str, Any]:
        """Counters for the engine's communication report."""
        graphs, cache, noise = self.graphs, self.cache, self.noise
        out = dict(self.stats)
        out["cuda_graph_captures"] = graphs.captures if graphs is not None else 0
        out["cuda_graph_replays"] = graphs.replays if graphs is not None else 0
        out["cuda_graph_buckets"] = graphs.keys() if graphs is not None else []
        out["cuda_graph_pool_bytes"] = graphs.pool_bytes if graphs is not None else 0
        out["cuda_graph_pool_mapped_bytes"] = (graphs.reserved.mapped_bytes if graphs is not None
                                               and graphs.reserved is not None else 0)
        out["kv_cache_slots"] = self.geometry.num_slots
        out["kv_cache_slot_tokens"] = self.geometry.slot_tokens
        out["kv_cache_bytes"] = self.geometry.nbytes
        out["kv_cache_mapped_bytes"] = cache.mapped_bytes if cache is not None else 0
        out["kv_cache_address"] = cache.data_ptr() if cache is not None else 0
        out["sampling_noise_mapped_bytes"] = noise.mapped_bytes if noise is not None else 0
        routing = self.runner.routing
        out["routing_record_mapped_bytes"] = routing.mapped_bytes if routing is not None else 0
        out["overlap_host"] = self.overlap
        out["attention_reads_lengths"] = self.runner.reads_lengths
        out["fused_decoder"] = self.runner.fused is not None
        return out

    def close(self) -> None:
        """Drop the graphs (and their reserved pool) and the cache's own reservation (and the kept prefixes)."""
        self.kept.clear()
        self.runner.close()
