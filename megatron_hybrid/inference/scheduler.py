"""Continuous batching: which sequence decodes in which cache slot (pure Python, no tensors).

Prompts wait in their order; a free slot takes the next waiting prompt before the next decode step, so no decode
step runs with a free slot while a prompt waits (:attr:`SlotScheduler.idle_slot_steps` counts the violations and
stays 0). Slots are filled lowest first, so the decode batch (slots ``0 .. B-1``) is as short as it can be.
"""

from __future__ import annotations

from collections import deque
from typing import Optional


class SlotScheduler:
    """Assign ``num_sequences`` sequences to ``num_slots`` decode slots as slots free up."""

    def __init__(self, num_sequences: int, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots ({num_slots}) must be at least 1")
        self.waiting: deque[int] = deque(range(num_sequences))
        self.slots: list[Optional[int]] = [None] * num_slots
        self.slot_of: dict[int, int] = {}
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
        for slot, seq in enumerate(self.slots):
            if not self.waiting:
                break
            if seq is None:
                nxt = self.waiting.popleft()
                self.slots[slot] = nxt
                self.slot_of[nxt] = slot
                out.append((nxt, slot))
        if out:
            self.prefills += 1
            self.max_active = max(self.max_active, len(self.slot_of))
        return out

    def finish(self, seq: int) -> int:
        """Sequence ``seq`` is done: free its slot (returned)."""
        slot = self.slot_of.pop(seq)
        self.slots[slot] = None
        return slot

    def active(self) -> list[tuple[int, int]]:
        """``[(slot, sequence), ...]`` of the running sequences, by slot."""
        return [(slot, seq) for slot, seq in enumerate(self.slots) if seq is not None]

    def extent(self) -> int:
        """Slots up to the highest taken one (0 when none is)."""
        return max((slot + 1 for slot, seq in enumerate(self.slots) if seq is not None), default=0)

    def decode_batch(self) -> int:
        """Slots a decode step covers now: up to the highest running one (0 when nothing runs); counts the step."""
        running = [slot for slot, seq in enumerate(self.slots) if seq is not None]
        if not running:
            return 0
        self.decode_steps += 1
        if 2 * len(running) >= len(self.slots):
            self.busy_steps += 1
        if self.waiting:
            self.idle_slot_steps += len(self.slots) - len(running)
        return running[-1] + 1

    def compact(self, extent: int) -> list[tuple[int, int]]:
        """Move the sequences in slots from ``extent`` on into free slots below it (lowest first), so that decode
        steps cover fewer slots; ``[(from, to), ...]``. The caller makes sure the free slots below suffice."""
        free = [slot for slot in range(extent) if self.slots[slot] is None]
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
