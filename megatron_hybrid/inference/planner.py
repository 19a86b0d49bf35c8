"""Which step runs next: the generator's step planner (pure Python: no tensors, no ``torch.distributed``).

The policy room of the generator (vLLM's scheduler and its ``SchedulerOutput``, megatron-core's scheduler): from the
slot scheduler's state (:class:`~.scheduler.SlotScheduler`) and the tokens each sequence has launched, it decides each
step and emits it as a typed plan, which the stage runner (:mod:`.runner`) executes and the replica
(:mod:`.replica`) books:

- :class:`StepPlan`: a prefill of whole prompts, a decode step over slots ``0 .. B-1``, or a mixed step (a decode step
  with refills riding along), with its rows, slots, owners, attended positions and, for a CUDA-graph step, the key
  of its graph (derived here: the batch and length rounded up to the graphs' buckets);
- :class:`SlotMoves`: slot compaction, sequences of high slots moved into free low ones.

Every rank of a replica plans the same steps from the same prompts, so the plans need no communication.

Expert parallelism across replicas: when a stage's expert-parallel group holds ranks of several rollout replicas,
every MoE layer gathers the same number of rows on each of them, so the replicas of the group step in lockstep. Each
step's packed tokens (:func:`packed_tokens`) are agreed on over the group (the replica does it: one small host-side
maximum per step), and :meth:`StepPlanner.lockstep` stamps the agreed rows on the plan (``moe_rows``, rounded up to a
power of two with graphs, and part of the graph key); a replica with nothing left runs :meth:`StepPlanner.idle`
steps until every replica of the group is done.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

from .scheduler import SlotScheduler

# Mixed steps (prompts riding along a decode step): at most this many prompts, and by default this many tokens.
MIXED_PROMPTS = 8
MIXED_TOKENS = 512
# What one more prefill forward costs, in padded prompt tokens (gpu-1b on an H200: a forward's weight read and
# launches ~1.5 ms, a padded token ~4 µs), when prompts are cut into graph prefills.
PREFILL_FORWARD_TOKENS = 384


def batch_sizes(num_slots: int, configured: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """The decode batch buckets: ``configured`` (``GenerationConfig.graph_batch_sizes``), or powers of two below the
    slot count; and the slot count."""
    sizes = configured or [2**i for i in range(num_slots.bit_length())]
    return tuple(sorted({min(b, num_slots) for b in sizes} | {num_slots}))


@dataclass(frozen=True)
class PlannerSettings:
    """What the planner plans within: the cache's slots, the step buffers' sizes and the graphs' buckets."""

    num_slots: int
    """Decode slots of the KV cache."""
    slot_tokens: int
    """Positions per slot (the most any step attends to)."""
    prefill_tokens: int
    """Prompt tokens per prefill forward (``GenerationConfig.prefill_tokens``; a longer prompt goes alone)."""
    batch_sizes: tuple[int, ...]
    """Decode batch buckets, sorted, the largest the slot count: graph steps run at them, compaction aims at them."""
    graphs: bool = False
    """Steps run as CUDA graphs: rounded up to buckets, each named by a graph key."""
    length_granule: int = 1
    """Graph decode steps: attended positions are rounded up to a multiple of this."""
    reads_lengths: bool = False
    """The attention reads each row's own filled length: a graph decode step attends to ``slot_tokens`` whatever
    the sequences' lengths (no length bucket)."""
    prefill_granule: int = 1
    """Graph prefills: prompts are right-padded to a multiple of this."""
    prefill_rows: int = 0
    """Graph prefills: the most rows (prompts) the staging buffer holds."""
    prefill_graph_tokens: int = 0
    """Graph prefills: the most padded tokens (rows x length) the staging buffers hold."""
    mixed_prompts: int = 0
    """Mixed steps: the most prompts riding along a decode step (0: no mixed steps)."""
    mixed_tokens: int = 0
    """Mixed steps: the most prompt tokens riding along a decode step."""
    compact: bool = False
    """Move sequences into free low slots once no prompt waits, when that gives a smaller batch bucket."""


@dataclass(frozen=True)
class StepPlan:
    """One step: what the stage runner computes and whose rows the replica books.

    ``kind`` is ``"prefill"`` (whole prompts into their slots, from position 0), ``"decode"`` (one token for each of
    the slots ``0 .. batch-1``), ``"mixed"`` (a decode step with prompts riding along) or ``"idle"`` (in lockstep:
    only the MoE layers' collectives, nothing sampled). Sampled rows, in order: the decode rows (``batch``), then one
    per prompt row (``rows``); ``owners`` names the sequence of each.
    """

    kind: str
    batch: int
    """Decode rows, slots ``0 .. batch-1`` (a graph's bucket: rows past the running slots are idle); 0 in a
    prefill."""
    rows: int
    """Prompt rows: the prompts, then padded rows of a graph step; 0 in a decode step."""
    length: int
    """A graph prefill's padded prompt length; a mixed step's prompt-token rows (its prompts' tokens, then padding
    in a graph step); 0 otherwise."""
    attended: int
    """Decode and mixed steps: cached positions a decode row reads (at least every running slot's position + 1)."""
    prompts: tuple[Sequence[int], ...]
    """The prompts of a prefill or mixed step, in row order."""
    slots: tuple[int, ...]
    """Each prompt's slot."""
    owners: tuple[Optional[int], ...]
    """Per sampled row, its sequence (None: an idle slot or a padded row)."""
    graph_key: Optional[tuple] = None
    """``(kind, batch or rows, length or attended, sampling signature)``, then ``moe_rows`` in lockstep: the CUDA
    graph that runs the step; None for an eager step."""
    moe_rows: int = 0
    """In lockstep (an expert-parallel group over several replicas): the rows per rank every MoE layer's collectives
    carry, agreed over the group (at least this step's packed tokens); 0 otherwise."""
    starts: tuple[int, ...] = ()
    """A mixed step's continuations: per prompt, the cache position its tokens start at (its slot holds the
    positions before: a kept prefix); empty: every prompt starts at 0."""


def packed_tokens(plan: StepPlan) -> int:
    """The tokens one forward of ``plan`` packs (graph padding included): what its MoE layers route."""
    if plan.kind == "decode":
        return plan.batch
    if plan.kind == "mixed":
        return plan.batch + plan.length
    if plan.kind == "prefill":
        return plan.rows * plan.length if plan.graph_key is not None else sum(len(p) for p in plan.prompts)
    return 0


@dataclass(frozen=True)
class WaitForTurns:
    """Nothing runs and nothing waits, but sequences are between turns (an environment answering): the replica
    waits for one of them to come back (:meth:`CallSchedule.next_turn`) or end."""


@dataclass(frozen=True)
class SlotMoves:
    """Slot compaction: the sequences of slots ``sources`` move to ``targets`` (cache and decode state)."""

    sources: tuple[int, ...]
    targets: tuple[int, ...]
    positions: int
    """Cache positions to copy per slot: what the moved sequences' launched steps will have written, at most."""


class StepPlanner:
    """The generator's policy: prefill grouping, mixed steps, batch buckets and compaction, within ``settings``."""

    def __init__(self, settings: PlannerSettings) -> None:
        self.settings = settings

    def schedule(self, prompts: Sequence[Sequence[int]], *, signature: tuple,
                 continued: Optional[dict[int, tuple[int, int]]] = None, held: Sequence[int] = ()) -> "CallSchedule":
        """The steps of one generate call over ``prompts``; ``signature`` (the call's sampling settings) completes
        the graph keys. ``continued``: sequence -> (its held slot, positions cached there): it runs its tokens from
        there on in mixed steps (a kept prefix); ``held``: other held slots (evicted when prompts need them)."""
        return CallSchedule(self, prompts, signature, continued=continued, held=held)

    # -- buckets -----------------------------------------------------------------------------------------------

    def batch_bucket(self, batch: int) -> int:
        """The decode batch a step over slots ``0 .. batch-1`` runs at with graphs (their bucket), and the bucket
        slot compaction aims at without them (eager steps run at ``batch`` itself)."""
        sizes = self.settings.batch_sizes
        return sizes[bisect.bisect_left(sizes, batch)]

    def length_bucket(self, attended: int) -> int:
        """A graph decode step's attended positions: rounded up to the length granule, at most a slot's."""
        granule = self.settings.length_granule
        return min(-(-attended // granule) * granule, self.settings.slot_tokens)

    # -- prefills ----------------------------------------------------------------------------------------------

    def prefill_groups(self, admitted: list[tuple[int, int]],
                       prompts: Sequence[Sequence[int]]) -> list[list[tuple[int, int]]]:
        """``admitted`` (``(sequence, slot)`` pairs) cut into prefill forwards of at most ``prefill_tokens`` prompt
        tokens (a longer prompt alone), in order. With graphs, see :meth:`graph_prefill_groups`."""
        if self.settings.graphs:
            return self.graph_prefill_groups(admitted, prompts)
        groups: list[list[tuple[int, int]]] = [[]]
        size = 0
        for item in admitted:
            n = len(prompts[item[0]])
            if groups[-1] and size + n > self.settings.prefill_tokens:
                groups.append([])
                size = 0
            groups[-1].append(item)
            size += n
        return groups

    def graph_prefill_groups(self, admitted: list[tuple[int, int]],
                             prompts: Sequence[Sequence[int]]) -> list[list[tuple[int, int]]]:
        """``admitted`` cut into graph prefills, each a rectangle of rows x padded length that fits the graphs'
        buffers and holds at most ``prefill_tokens`` prompt tokens (a prompt too long for any graph goes alone, an
        eager prefill): by length, the cut with the least padded tokens plus ``PREFILL_FORWARD_TOKENS`` per
        forward (a forward reads the weights once more). An eager prefill of many ragged prompts costs an attention
        call per length and layer: a first fill of 83 prompts cut by tokens alone took 268 ms on an H200."""
        items = sorted(admitted, key=lambda item: len(prompts[item[0]]))
        lengths = [len(prompts[seq]) for seq, _ in items]
        # cost[j]: the cheapest cut of the first j prompts; start[j]: where its last group starts.
        cost, start = [0] + [float("inf")] * len(items), [0] * (len(items) + 1)
        for j in range(1, len(items) + 1):
            size = 0
            for i in range(j - 1, -1, -1):  # the group items[i:j], whose longest prompt is items[j - 1]
                size += lengths[i]
                rows, length = self.prefill_shape(j - i, lengths[j - 1])
                alone = i == j - 1
                if not alone and (size > self.settings.prefill_tokens or not self.prefill_graph_fits(rows, length)):
                    break  # and so is every larger group
                total = cost[i] + PREFILL_FORWARD_TOKENS + rows * length
                if total < cost[j]:
                    cost[j], start[j] = total, i
        groups, j = [], len(items)
        while j:
            groups.append(items[start[j]: j])
            j = start[j]
        return groups[::-1]

    def prefill_shape(self, count: int, longest: int) -> tuple[int, int]:
        """A graph prefill's rows and padded length for ``count`` prompts of at most ``longest`` tokens. Rows: exact
        up to 8 (refills are a few prompts: a power of two would pad 3 to 4), then whole eights; the length a
        multiple of ``prefill_granule``."""
        granule = self.settings.prefill_granule
        rows = count if count <= 8 else -(-count // 8) * 8
        return rows, min(-(-longest // granule) * granule, self.settings.slot_tokens)

    def prefill_graph_fits(self, rows: int, length: int) -> bool:
        """Whether a graph prefill of ``rows`` x ``length`` fits the staging buffers (else the prefill is eager)."""
        return rows <= self.settings.prefill_rows and rows * length <= self.settings.prefill_graph_tokens

    def prefill(self, prompts: Sequence[Sequence[int]], slots: Sequence[int], seqs: Sequence[int], *,
                signature: tuple) -> StepPlan:
        """The prefill of ``prompts`` (sequences ``seqs``) into ``slots``: a graph's rectangle when one fits."""
        rows, length, key = len(prompts), 0, None
        if self.settings.graphs:
            shape = self.prefill_shape(len(prompts), max(len(p) for p in prompts))
            if self.prefill_graph_fits(*shape):
                rows, length = shape
                key = ("prefill", rows, length, signature)
        return StepPlan("prefill", batch=0, rows=rows, length=length, attended=0, prompts=tuple(prompts),
                        slots=tuple(slots), owners=(*seqs, *[None] * (rows - len(seqs))), graph_key=key)

    # -- lockstep over an expert-parallel group ---------------------------------------------------------------

    def moe_bucket(self, rows: int) -> int:
        """The rows a lockstep step's MoE collectives carry for an agreed maximum of ``rows``: a power of two with
        graphs (few graphs per step shape), ``rows`` itself otherwise."""
        return 1 << max(rows - 1, 0).bit_length() if self.settings.graphs else rows

    def lockstep(self, plan: StepPlan, rows: int) -> StepPlan:
        """``plan`` with its MoE layers padded to ``rows`` (a :meth:`moe_bucket`), which its graph key names."""
        assert rows >= packed_tokens(plan), (rows, plan)
        key = plan.graph_key + (rows,) if plan.graph_key is not None else None
        return dataclasses.replace(plan, moe_rows=rows, graph_key=key)

    def idle(self, rows: int) -> StepPlan:
        """A step of the group this replica has nothing for: its MoE layers' collectives over ``rows``."""
        return StepPlan("idle", batch=0, rows=0, length=0, attended=0, prompts=(), slots=(), owners=(),
                        moe_rows=rows, graph_key=("idle", rows, 0, None) if self.settings.graphs else None)

    # -- decode and mixed steps --------------------------------------------------------------------------------

    def decode(self, owners: Sequence[Optional[int]], attended: int, *, signature: tuple) -> StepPlan:
        """A decode step over the slots of ``owners`` (each slot's sequence, None: idle), the longest of which has
        ``attended`` positions: with graphs, at its batch and length buckets."""
        batch, key = len(owners), None
        if self.settings.graphs:
            batch = self.batch_bucket(batch)
            attended = self.length_bucket(self.settings.slot_tokens if self.settings.reads_lengths else attended)
            key = ("decode", batch, attended, signature)
        return StepPlan("decode", batch=batch, rows=0, length=0, attended=attended, prompts=(), slots=(),
                        owners=(*owners, *[None] * (batch - len(owners))), graph_key=key)

    def mixed_fits(self, admitted: list[tuple[int, int]], prompts: Sequence[Sequence[int]]) -> bool:
        """Whether the ``admitted`` prompts can ride along the next decode step."""
        return (0 < len(admitted) <= self.settings.mixed_prompts
                and sum(len(prompts[seq]) for seq, _ in admitted) <= self.settings.mixed_tokens)

    def continuation_fits(self, tokens: int) -> bool:
        """Whether a continuation of ``tokens`` new tokens rides in one mixed step (else it is prefilled again)."""
        return self.settings.mixed_prompts > 0 and 0 < tokens <= self.settings.mixed_tokens

    def mixed_chunk(self, total: int) -> int:
        """Prompt-token rows of a graph mixed step carrying ``total`` tokens: 32, 48, 64, 96, 128, ... (at most a
        third of them padding), at most ``mixed_tokens``."""
        size = 32
        while size < total:
            size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
        return min(size, self.settings.mixed_tokens)

    def mixed(self, owners: Sequence[Optional[int]], attended: int, prompts: Sequence[Sequence[int]],
              slots: Sequence[int], seqs: Sequence[int], *, signature: tuple,
              starts: Sequence[int] = ()) -> StepPlan:
        """A decode step over the slots of ``owners`` (None: idle, or taking one of the prompts), with ``prompts``
        (sequences ``seqs``) riding along into ``slots`` (from positions ``starts``, default 0): with graphs, at the
        batch bucket, the prompts' tokens padded to :meth:`mixed_chunk` rows and the prompt rows to
        ``mixed_prompts``."""
        batch, total = len(owners), sum(len(p) for p in prompts)
        ends = [s + len(p) for s, p in zip(starts, prompts)] if starts else [len(p) for p in prompts]
        if self.settings.graphs:
            batch, length, rows = self.batch_bucket(batch), self.mixed_chunk(total), self.settings.mixed_prompts
            attended, key = self.settings.slot_tokens, ("mixed", batch, length, signature)
        else:
            length, rows, key = total, len(prompts), None
            attended = max(attended, max(ends))
        return StepPlan("mixed", batch=batch, rows=rows, length=length, attended=attended, prompts=tuple(prompts),
                        slots=tuple(slots), graph_key=key, starts=tuple(starts),
                        owners=(*owners, *[None] * (batch - len(owners)), *seqs, *[None] * (rows - len(seqs))))


class CallSchedule:
    """One generate call's steps, in order: iterate it for :class:`StepPlan` and :class:`SlotMoves`; the iteration
    ends when every sequence is closed.

    Between two plans the replica books the step just run: :meth:`finish` closes a sequence (its slot is free for
    the next prompt), and the plans that follow see it. Tokens launched per sequence are counted as the plans are
    made (the host knows them before they arrive): :attr:`launched`.
    """

    def __init__(self, planner: StepPlanner, prompts: Sequence[Sequence[int]], signature: tuple, *,
                 continued: Optional[dict[int, tuple[int, int]]] = None, held: Sequence[int] = ()) -> None:
        self.planner, self.prompts, self.signature = planner, list(prompts), signature
        self.continued = dict(continued or {})
        self.scheduler = SlotScheduler(len(prompts), planner.settings.num_slots,
                                       held=[*held, *(slot for slot, _ in self.continued.values())])
        self.launched = [0] * len(prompts)
        for seq, (slot, _) in sorted(self.continued.items()):
            self.scheduler.place(seq, slot)
        self.pending = sorted(self.continued)
        """Continued sequences placed in their slots whose new tokens have not run yet."""
        self.parked: set[int] = set()
        """Sequences between turns (:meth:`park`): the call goes on until each comes back or ends."""

    def park(self, seq: int) -> None:
        """Sequence ``seq`` ended a turn and an answer may follow (:meth:`next_turn`, or :meth:`unpark`)."""
        self.parked.add(seq)

    def unpark(self, seq: int) -> None:
        """Sequence ``seq`` takes no more turns."""
        self.parked.discard(seq)

    def next_turn(self, seq: int, tokens: Sequence[int], kept: Optional[tuple[int, int]]) -> None:
        """Parked sequence ``seq`` goes on as the whole sequence ``tokens``: from ``kept`` (its held slot and the
        positions cached there: only the tokens after them run) or, None, prefilled whole when a slot frees."""
        self.parked.discard(seq)
        self.prompts[seq] = tokens
        self.launched[seq] = 0
        if kept is not None:
            self.continued[seq] = kept
            self.scheduler.place(seq, kept[0])
            self.pending.append(seq)
        else:
            self.continued.pop(seq, None)
            self.scheduler.waiting.append(seq)

    def finish(self, seq: int, *, hold: bool = False) -> int:
        """No more steps for sequence ``seq``: its slot (returned) is free, or held for a continuation."""
        return self.scheduler.finish(seq, hold=hold)

    def _continuations(self) -> Iterator[StepPlan]:
        """The continued sequences back in their held slots, their new tokens in mixed steps (as many as fit one,
        each), before anything else runs."""
        sched, planner, prompts = self.scheduler, self.planner, self.prompts
        items = [(seq, (sched.slot_of[seq], self.continued[seq][1])) for seq in self.pending]
        self.pending = []
        while items:
            take, total = [], 0
            for seq, (slot, start) in items:
                n = len(prompts[seq]) - start
                if take and (len(take) == planner.settings.mixed_prompts or total + n > planner.settings.mixed_tokens):
                    break
                take.append((seq, slot, start))
                total += n
            items = items[len(take):]
            seqs = [seq for seq, _, _ in take]
            sched.decode_batch()
            owners, attended = self._decoding(sched.extent(), frozenset(seq for seq, _ in items) | frozenset(seqs))
            yield self._launch(planner.mixed(owners, attended, [prompts[seq][start:] for seq, _, start in take],
                                             [slot for _, slot, _ in take], seqs, signature=self.signature,
                                             starts=[start for _, _, start in take]))

    def __iter__(self) -> Iterator[Union[StepPlan, SlotMoves]]:
        sched, planner, prompts, sig = self.scheduler, self.planner, self.prompts, self.signature
        while True:
            if self.pending:
                yield from self._continuations()
            if planner.settings.compact and not sched.waiting:
                moves = self._compaction()
                if moves is not None:
                    yield moves
            extent = sched.extent()  # the slots decoding, before this step's admissions
            admitted = sched.admit()
            if admitted and extent and planner.mixed_fits(admitted, prompts):
                sched.decode_batch()  # counts the step: every slot decodes or takes a prompt in it
                seqs = [seq for seq, _ in admitted]
                owners, attended = self._decoding(extent, frozenset(seqs))
                yield self._launch(planner.mixed(owners, attended, [prompts[seq] for seq in seqs],
                                                 [slot for _, slot in admitted], seqs, signature=sig))
                continue
            while admitted:  # a prompt whose first token ends it frees its slot for the next at once
                for group in planner.prefill_groups(admitted, prompts):
                    seqs = [seq for seq, _ in group]
                    yield self._launch(planner.prefill([prompts[seq] for seq in seqs], [slot for _, slot in group],
                                                       seqs, signature=sig))
                admitted = sched.admit()
            batch = sched.decode_batch()
            if not batch and self.parked:  # nothing runs or waits: until an environment answers
                yield WaitForTurns()
                continue
            if not batch:  # nothing runs, so nothing waits: every sequence is closed
                assert sched.done and not self.pending
                return
            owners, attended = self._decoding(batch)
            yield self._launch(planner.decode(owners, attended, signature=sig))

    def _launch(self, plan: StepPlan) -> StepPlan:
        for seq in plan.owners:
            if seq is not None:
                self.launched[seq] += 1
        return plan

    def _decoding(self, width: int, new: frozenset = frozenset()) -> tuple[list[Optional[int]], int]:
        """Per slot ``0 .. width-1``, the sequence it decodes (None: idle, or taking one of the ``new`` prompts), and
        the most cache positions any of them reads."""
        owners: list[Optional[int]] = [None] * width
        attended = 0
        pending = set(self.pending)  # placed in their slots, their new tokens not run yet: nothing to decode
        for slot, seq in self.scheduler.active():
            if seq not in new and seq not in pending:
                owners[slot] = seq
                attended = max(attended, len(self.prompts[seq]) + self.launched[seq])
        return owners, attended

    def _compaction(self) -> Optional[SlotMoves]:
        """The moves of the sequences of high slots into free low ones when the running ones fit a smaller batch
        bucket than the slots they span (None: no move). Every rank of the replica moves its own stage's cache:
        the schedule is the same on all."""
        sched, planner = self.scheduler, self.planner
        running = len(sched.slot_of)
        if not running:
            return None
        target = planner.batch_bucket(running)
        if planner.batch_bucket(sched.extent()) <= target:
            return None
        held = set(sched.held)
        movers = sum(1 for slot in range(target, len(sched.slots)) if sched.slots[slot] is not None)
        if movers > sum(1 for slot in range(target) if sched.slots[slot] is None and slot not in held):
            return None  # kept prefixes hold the low slots
        moves = sched.compact(target)
        # Cache positions the moved sequences' launched steps will have written, at most.
        positions = max(len(self.prompts[sched.slots[to]]) + self.launched[sched.slots[to]] for _, to in moves)
        return SlotMoves(sources=tuple(a for a, _ in moves), targets=tuple(b for _, b in moves),
                         positions=min(positions, planner.settings.slot_tokens))

