"""One pipeline stage's fixed-address state for the generator's steps, and the graphs captured over it.

The state that :class:`~.runner.StageRunner` fills and its forwards (:mod:`.stage_forwards`) read; made at the first
call and kept at its addresses for the runner's life, so that CUDA graphs captured over it replay in every later step:

- the decode step's inputs: each slot's next token, its position and whether it runs (updated in place on the
  device; the spare slot takes padded rows), index ranges and a copy of the rotary frequencies;
- the staging buffer of graph prefills and mixed steps (one host-to-device copy fills it) and the hidden-state
  buffers that a later pipeline stage receives into;
- what is reserved from the rollout-memory provider: the KV cache, the sampling draws of graph steps, the routing
  record (``GenerationConfig.record_routing``) and the graphs' pool;
- the step graphs (:class:`~.graphs.StepGraphs`) and the sampling settings their keys name;
- the device-side bookkeeping: slots started by a prefill, advanced by a decode step, released, moved.
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional, Sequence

import torch

from ..memory import RolloutBuffer, RolloutMemoryProvider
from .config import GenerationConfig
from .graphs import StepGraphs
from .kv_cache import CacheGeometry, KVCache
from .planner import SlotMoves
from .sampling import is_greedy


def routing_dtype(num_experts: int) -> torch.dtype:
    """The routing record's dtype: int16, int32 past 32,767 experts."""
    return torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32


class StageBuffers:
    """The fixed-address state of one stage's steps, made by :meth:`allocate` (the first call) and kept at its
    addresses until :meth:`close`.

    Args:
        device: the stage's device.
        memory: where the KV cache, the sampling draws, the routing record and the graphs' pool are reserved.
        config: the staging's sizes (``prefill_tokens``, ``prefill_graph_granule``).
        hidden_size, hidden_dtype: the hidden states a stage after the first receives.
        receives: whether this stage receives hidden states (it is not the first).
        rotary: the model's rotary embedding (its ``inv_freq`` is copied at each call), or None.
        mixed_prompts, mixed_tokens: prompts and prompt tokens of a mixed step at most (0: no mixed steps).
        routing: ``(MoE layers, experts per token, dtype)`` of the routing record, or None (no record).
        draws_vocab: the padded vocabulary of the sampling draws of graph steps (on the last stage), or None.
    """

    def __init__(self, *, device: torch.device, memory: RolloutMemoryProvider, config: GenerationConfig,
                 hidden_size: int, hidden_dtype: torch.dtype, receives: bool, rotary: Optional[torch.nn.Module],
                 mixed_prompts: int, mixed_tokens: int, routing: Optional[tuple[int, int, torch.dtype]],
                 draws_vocab: Optional[int]) -> None:
        self.device, self.memory, self.config = device, memory, config
        self.hidden_size, self.hidden_dtype, self.receives = hidden_size, hidden_dtype, receives
        self.rotary, self.routing_shape, self.draws_vocab = rotary, routing, draws_vocab
        self.mixed_prompts, self.mixed_tokens = mixed_prompts, mixed_tokens
        self.geometry: Optional[CacheGeometry] = None  # the cache's (at allocate)
        self.cache: Optional[KVCache] = None
        self.noise: Optional[RolloutBuffer] = None
        self.routing: Optional[RolloutBuffer] = None  # the routing record (record_routing), and its planes:
        self.routing_planes: Optional[list[torch.Tensor]] = None
        self.graphs: Optional[StepGraphs] = None
        self.prefill_hidden: Optional[torch.Tensor] = None
        self.prefill_rows = self.prefill_tokens = 0  # a graph prefill's staging capacity (with graphs)
        self.signatures: dict[tuple, tuple] = {}  # a graph's sampling settings, by the key part naming them

    def allocate(self, geometry: CacheGeometry, *, new_graphs: Optional[Callable[[], StepGraphs]]) -> None:
        """Make the fixed-address state of a cache of ``geometry`` (once; again after :meth:`close`), with the graphs
        ``new_graphs`` makes (None: the steps run eagerly)."""
        if self.cache is not None:
            return
        g, dev = geometry, self.device
        self.geometry = g
        self.cache = KVCache(g, dev, memory=self.memory)
        n = g.cache_slots
        # Each slot's next input token and its position, and whether it runs: the decode step's inputs, updated
        # in place on the device (graphs read them at these addresses). The spare slot takes padded rows.
        self.slot_tokens = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_running = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_index = torch.arange(n, device=dev)
        self.position_index = torch.arange(g.slot_tokens, device=dev)
        self.hidden_in = (torch.zeros(g.num_slots, 1, self.hidden_size, dtype=self.hidden_dtype, device=dev)
                          if self.receives else None)
        self.inv_freq = self.rotary.inv_freq.to(dev).clone() if self.rotary is not None else None
        if self.routing_shape is not None:
            layers, topk, dtype = self.routing_shape
            plane = (n, g.slot_tokens, topk)
            size = plane[0] * plane[1] * plane[2]
            self.routing = self.memory.reserve(layers * size, dtype)
            self.routing_planes = [self.routing.tensor[i * size: (i + 1) * size].view(plane) for i in range(layers)]
        if new_graphs is not None:
            self.graphs = new_graphs()
            # A graph prefill's inputs: rows x padded length tokens, their positions and slots, then per row the
            # index of its last token, its slot and its prompt length; filled by one host-to-device copy.
            self.prefill_rows = g.num_slots if g.num_slots <= 8 else -(-g.num_slots // 8) * 8
            self.prefill_tokens = max(self.config.prefill_tokens, self.config.prefill_graph_granule)
            # A mixed step's: see stage_mixed.
            self.staging = torch.zeros(max(3 * 2 * self.prefill_tokens + self.prefill_rows,
                                           3 * self.mixed_tokens + 3 * self.mixed_prompts), dtype=torch.long,
                                       device=dev)
            self.token_index = torch.arange(2 * self.prefill_tokens, device=dev)
            self.prefill_hidden = (torch.zeros(max(2 * self.prefill_tokens, g.num_slots + self.mixed_tokens), 1,
                                               self.hidden_size, dtype=self.hidden_dtype, device=dev)
                                   if self.receives else None)
            if self.draws_vocab is not None:
                # The sampling race's draws of a graph step (made eagerly before the replay, read by the graph).
                rows = max(self.prefill_rows, g.num_slots + self.mixed_prompts)
                self.noise = self.memory.reserve(rows * self.draws_vocab, torch.float32)

    def close(self) -> None:
        """Drop the graphs (and their reserved pool), the cache's own reservation, the sampling draws' and the
        routing record's."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        if self.cache is not None:
            self.cache.close()
            self.cache = None
        if self.noise is not None:
            self.noise.close()
            self.noise = None
        if self.routing is not None:
            self.routing.close()
            self.routing = self.routing_planes = None

    def begin(self) -> None:
        """A call starts: every slot idle, the model's rotary state copied (after :meth:`allocate`)."""
        self.slot_running.zero_()
        self.slot_positions.zero_()
        if self.inv_freq is not None:
            self.inv_freq.copy_(self.rotary.inv_freq)  # the model's rotary state, at this call

    # -- graph steps' sampling -----------------------------------------------------------------------------------

    def signature(self, params, vocab: int, tempered: bool) -> tuple:
        """The part of a graph key that names sampling with ``params`` over ``vocab`` ids (:attr:`signatures` keeps
        the settings it stands for)."""
        sig = (is_greedy(params), float(params.temperature), int(params.top_k or 0), float(params.top_p or 0.0),
               vocab, tempered)
        self.signatures.setdefault(sig, (params, vocab, tempered))
        return sig

    def draws(self, rows: int, vocab: int) -> torch.Tensor:
        """The race's draws of a graph step over ``rows`` rows, ``[rows, vocab]`` at a fixed address."""
        return self.noise.tensor[: rows * vocab].view(rows, vocab)

    # -- inputs and the device-side bookkeeping ----------------------------------------------------------------

    def to_device(self, values: list[int]) -> torch.Tensor:
        """``values`` on the device without a host sync (a pinned staging copy on a GPU)."""
        host = torch.tensor(values, dtype=torch.long)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def stage_prefill(self, rows: int, length: int, prompts: list[list[int]], slots: list[int]) -> None:
        """Write a graph prefill's inputs: ``prompts`` (at most ``rows``, each at most ``length`` tokens) into
        ``slots``, right-padded to ``length``; rows past the prompts write the spare slot."""
        T, spare = rows * length, self.geometry.num_slots
        tokens, positions, where = [], [], []
        for r in range(rows):
            prompt = prompts[r] if r < len(prompts) else [0]
            tokens += prompt + [0] * (length - len(prompt))  # right padding: causal attention never reads it
            positions += range(length)
            where += [slots[r] if r < len(prompts) else spare] * length
        last = [r * length + (len(prompts[r]) if r < len(prompts) else 1) - 1 for r in range(rows)]
        self.staging[: 3 * T + rows].copy_(self.to_device(tokens + positions + where + last))

    def stage_mixed(self, chunk: int, rows: int, prompts: Sequence[Sequence[int]], slots: Sequence[int],
                    starts: Sequence[int] = ()) -> list[int]:
        """A mixed step's inputs, flat: ``chunk`` prompt tokens (the prompts one after another, then padding that
        writes position 0 of the spare slot), their positions (from each prompt's start: 0, or a continuation's
        cached positions), their slots; per prompt row (``rows``, padded rows point at the last token) the index of
        its last token; then the prompts' slots and their lengths (start + tokens)."""
        spare = self.geometry.num_slots
        starts = list(starts) or [0] * len(prompts)
        tokens, positions, where = [], [], []
        for prompt, slot, start in zip(prompts, slots, starts):
            tokens += prompt
            positions += range(start, start + len(prompt))
            where += [slot] * len(prompt)
        pad = chunk - len(tokens)
        ends = list(itertools.accumulate(len(p) for p in prompts))
        last = [end - 1 for end in ends] + [chunk - 1] * (rows - len(prompts))
        return (tokens + [0] * pad + positions + [0] * pad + where + [spare] * pad + last + list(slots)
                + [start + len(p) for p, start in zip(prompts, starts)])

    def start(self, slots: torch.Tensor, first: torch.Tensor, lengths: torch.Tensor) -> None:
        """Prompts of ``lengths`` now fill ``slots`` (device index tensors): they decode from their ``first``
        tokens, at the position after each prompt."""
        # index_copy_/index_fill_, not ``t[slots] = 1``: a Python scalar assigned through an index tensor is copied
        # to the device from pageable memory, a stream sync that stalled every refill's step on an H200.
        self.slot_tokens.index_copy_(0, slots, first)
        self.slot_positions.index_copy_(0, slots, lengths)
        self.slot_running.index_fill_(0, slots, 1)

    def advance(self, batch: int, picked: torch.Tensor) -> None:
        """After a step over slots ``0 .. batch-1``: their next inputs are the tokens just picked, one position on
        (idle slots stay at position 0)."""
        self.slot_tokens[:batch] = picked[:batch]
        self.slot_positions[:batch] += self.slot_running[:batch]

    def move_slots(self, moves: SlotMoves) -> None:
        """Move the sequences of ``moves.sources`` to ``moves.targets``: their cache and decode state."""
        sources, targets = self.to_device(list(moves.sources)), self.to_device(list(moves.targets))
        # Queued behind the steps in flight: they write the old slots first, then this copies them.
        self.cache.move_slots(sources, targets, moves.positions)
        for plane in self.routing_planes or ():
            plane[targets, : moves.positions] = plane[sources, : moves.positions]
        for state in (self.slot_tokens, self.slot_positions, self.slot_running):
            state.index_copy_(0, targets, state.index_select(0, sources))
        self.slot_running.index_fill_(0, sources, 0)  # no scalar through an index tensor: see start
        self.slot_positions.index_fill_(0, sources, 0)

    def release(self, slots: Sequence[int]) -> None:
        """The sequences of ``slots`` are done: the slots idle."""
        for slot in slots:
            # fill_ of a one-slot view takes the scalar as a kernel argument; ``t[slot] = 0`` copies it from pageable
            # host memory, a stream sync per finished sequence that left the device idle until the next launch.
            self.slot_running.narrow(0, slot, 1).fill_(0)
            self.slot_positions.narrow(0, slot, 1).fill_(0)  # an idle slot keeps writing garbage at position 0
