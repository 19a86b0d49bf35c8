r"""Continuous batching: which sequence decodes in which cache slot (pure Python, no tensors).

Prompts wait in their order; a free slot takes the next waiting prompt before the next decode step, so no decode
step runs with a free slot while a prompt waits (:attr:`SlotScheduler.idle_slot_steps` counts the violations and
stays 0). Slots are filled lowest first, so the decode batch (slots ``0 .. B-1``) is as short as it can be.

Kept prefixes (multi-turn): a slot may be *held* — a sequence that ended keeps its KV cache there for a later
continuation (:meth:`SlotScheduler.hold`, or given at construction from earlier calls). A held slot is not free;
when a prompt waits and no slot is free, the oldest held slot is evicted for it (:attr:`SlotScheduler.evicted`).
A continuation is :meth:`~SlotScheduler.place`\ d back into its own held slot.
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Sequence


class SlotScheduler:
    """Assign ``num_sequences`` sequences to ``num_slots`` decode slots as slots free up."""

    def __init__(self, num_sequences: int, num_slots: int, *, held: Sequence[int] = ()) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots ({num_slots}) must be at least 1")
        self.waiting: deque[int] = deque(range(num_sequences))
        self.slots: list[Optional[int]] = [None] * num_slots
        self.slot_of: dict[int, int] = {}
        self.held: list[int] = list(held)
        """Slots holding an ended sequence's cache for a continuation, oldest first (not free)."""
        self.evicted: list[int] = []
        """Held slots given to waiting prompts (their kept caches lost), in order."""
        self.decode_steps = 0
        self.prefills = 0
        self.idle_slot_steps = 0
        """Free slots summed over decode steps that ran while a prompt waited (0 by construction)."""
        self.max_active = 0
        self.busy_steps = 0
        """Decode steps that ran with at least half of the slots decoding."""

    def admit(self) -> list[tuple[int, int]]:
        """Give free slots (lowest first) to waiting sequences; ``[(sequence, slot), ...]`` in waiting order."""
        out = []
        held = set(self.held)
        free = [slot for slot, seq in enumerate(self.slots) if seq is None and slot not in held]
        while len(free) < len(self.waiting) and self.held:  # the oldest kept caches make room for waiting prompts
            slot = self.held.pop(0)
            self.evicted.append(slot)
            free.append(slot)
        for slot in sorted(free):
            if not self.waiting:
                break
            nxt = self.waiting.popleft()
            self.slots[slot] = nxt
            self.slot_of[nxt] = slot
            out.append((nxt, slot))
        if out:
            self.prefills += 1
            self.max_active = max(self.max_active, len(self.slot_of))
        return out

    def finish(self, seq: int, *, hold: bool = False) -> int:
        """Sequence ``seq`` is done: free its slot (returned), or with ``hold`` keep it held for a continuation."""
        slot = self.slot_of.pop(seq)
        self.slots[slot] = None
        if hold:
            self.held.append(slot)
        return slot

    def place(self, seq: int, slot: int) -> None:
        """Waiting sequence ``seq`` continues the cache of held ``slot``: it runs there (not admitted elsewhere)."""
        assert slot in self.held and self.slots[slot] is None, (seq, slot)
        self.held.remove(slot)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.slots[slot] = seq
        self.slot_of[seq] = slot
        self.max_active = max(self.max_active, len(self.slot_of))

    def active(self) -> list[tuple[int, int]]:
        """``[(slot, sequence), ...]`` of the running sequences, by slot."""
        return [(slot, seq) for slot, seq in enumerate(self.slots) if seq is not None]

    def extent(self) -> int:
        """Slots up to the highest taken one (0 when none is)."""
        return max((slot + 1 for slot, seq in enumerate(self.slots) if seq is not None), default=0)

    def free_slots(self) -> int:
        """Slots neither running nor held."""
        held = set(self.held)
        return sum(1 for slot, seq in enumerate(self.slots) if seq is None and slot not in held)

    def decode_batch(self) -> int:
        """Slots a decode step covers now: up to the highest running one (0 when nothing runs); counts the step."""
        running = [slot for slot, seq in enumerate(self.slots) if seq is not None]
        if not running:
            return 0
        self.decode_steps += 1
        if 2 * len(running) >= len(self.slots):
            self.busy_steps += 1
        if self.waiting:
            self.idle_slot_steps += self.free_slots()
        return running[-1] + 1

    def compact(self, extent: int) -> list[tuple[int, int]]:
        """Move the sequences in slots from ``extent`` on into free slots below it (lowest first), so that decode
        steps cover fewer slots; ``[(from, to), ...]``. The caller makes sure the free slots below suffice."""
        held = set(self.held)
        free = [slot for slot in range(extent) if self.slots[slot] is None and slot not in held]
        moves = []
        for slot in range(extent, len(self.slots)):
            seq = self.slots[slot]
            if seq is not None:
                to = free.pop(0)
                self.slots[to], self.slots[slot] = seq, None
                self.slot_of[seq] = to
                moves.append((slot, to))
        return moves

    @property
    def done(self) -> bool:
        return not self.waiting and not self.slot_of
