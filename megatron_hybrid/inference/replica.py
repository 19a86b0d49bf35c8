"""Generation on one model replica (its tensor- and pipeline-parallel groups): prefill, then decode steps.

Every rank of the replica runs the same schedule (:class:`~.scheduler.SlotScheduler`) on the same prompts: the
last pipeline stage samples, broadcasts each step's tokens to the other stages (one ``[B]`` int64 broadcast per
step), and every rank reads them to the host, the one host round trip per step that stop detection needs. Inputs of
the next step (each slot's token and position) are updated on the device. Hidden states travel stage to stage with
send/recv on the pipeline group, as in :mod:`megatron_hybrid.forward`.

A step drives the GPTModel stage's own modules (embedding, decoder, output layer) rather than its ``forward``: a
prefill then computes logits only at each prompt's last token, and megatron-core's inference-context code paths
(global groups, one offset per batch) stay out of the way.

Refills of a few prompts, while other slots decode, ride along the next decode step ("mixed" steps, where the
attention reads each row's own slot and length): their tokens are extra rows of that step, each attending to its
slot up to its own position, and the logits are read at the decode rows and at each prompt's last token. One
forward then reads the weights once for both, where a prefill of two prompts would cost about as much as the decode
step itself. The first fill, and refills of more tokens than ``GenerationConfig.mixed_prefill_tokens``, are
prefills of their own.

Legend: T packed tokens, B decode slots, H hidden, V vocabulary (padded).
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..forward import gather_vocab
from ..groups import RolloutGroups
from ..rollout_memory import PerCallRolloutMemory, RolloutBuffer, RolloutMemoryProvider
from .attention import KVStep, install_kv_attention
from .config import GenerationConfig
from .graphs import DecodeGraphs
from .kv_cache import CacheGeometry, KVCache
from .norms import install_step_norms
from .sampling import draw_noise, is_greedy, sample
from .scheduler import SlotScheduler
from .validation import Limits

# Mixed steps (prompts riding along a decode step): at most this many prompts, and by default this many tokens.
_MIXED_PROMPTS = 8
_MIXED_TOKENS = 512
# What one more prefill forward costs, in padded prompt tokens (gpu-1b on an H200: a forward's weight read and
# launches ~1.5 ms, a padded token ~4 µs), when prompts are cut into graph prefills.
_PREFILL_FORWARD_TOKENS = 384


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


@dataclass
class _InFlight:
    """A launched step whose sampled tokens are on their way to the host."""

    owners: list[Optional[int]]
    """Per sampled row, the sequence it belongs to (None: an idle slot or a padded row). A row of a sequence that
    turns out to have ended before it (a stop token the host had not seen yet) is set to None when read."""
    tokens: torch.Tensor
    """The rows' tokens: a pinned host copy in flight (GPU), or the tokens themselves (CPU)."""
    event: Optional[torch.cuda.Event]


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
    """

    def __init__(self, chunk: torch.nn.Module, *, tp_group, pp_group, config: GenerationConfig,
                 memory: Optional[RolloutMemoryProvider] = None, groups: Optional[RolloutGroups] = None) -> None:
        self.chunk, self.tp_group, self.pp_group = chunk, tp_group, pp_group
        self.config, self.groups = config, groups
        self.memory = memory if memory is not None else PerCallRolloutMemory(next(chunk.parameters()).device)
        kind = getattr(chunk, "position_embedding_type", "rope")
        if kind not in ("rope", "learned_absolute", "none"):
            raise ValueError(f"KV-cache generation supports position_embedding_type rope, learned_absolute or none; "
                             f"the model has {kind!r}")
        self.attention = install_kv_attention(chunk)
        self.norms = install_step_norms(chunk, next(chunk.parameters()).device)
        ranks = dist.get_process_group_ranks(pp_group)
        me = ranks.index(dist.get_rank())
        self.prev_rank = ranks[me - 1] if me > 0 else None
        self.next_rank = ranks[me + 1] if me < len(ranks) - 1 else None
        self.last_rank = ranks[-1]
        self.is_last = self.next_rank is None
        self.device = next(chunk.parameters()).device
        cfg = chunk.config
        self.hidden_dtype = cfg.pipeline_dtype or cfg.params_dtype
        self.hidden_size = cfg.hidden_size
        on_gpu = self.device.type == "cuda"
        if config.cuda_graphs and not on_gpu:
            raise ValueError(f"GenerationConfig.cuda_graphs=True needs a model on a GPU; it is on {self.device}")
        self.use_graphs = on_gpu if config.cuda_graphs is None else config.cuda_graphs
        self.overlap = on_gpu if config.overlap_host is None else config.overlap_host
        self.compact = self.use_graphs if config.compact_slots is None else config.compact_slots
        # Whether the attention reads each slot's own filled length (a kernel of ours) rather than a masked window
        # of the longest: decode graphs then need no length bucket, and prompts can ride along decode steps.
        self.reads_lengths = all(a.decode_kernel_ok(self.device) for a in self.attention)
        mixed = config.mixed_prefill_tokens
        self.mixed_tokens = (_MIXED_TOKENS if self.reads_lengths else 0) if mixed is None else mixed
        self.geometry = self._geometry(chunk)
        self.mixed_prompts = min(_MIXED_PROMPTS, self.geometry.num_slots) if self.mixed_tokens else 0
        # No more than its prompts can hold: the staging and hidden buffers are sized by it.
        self.mixed_tokens = min(self.mixed_tokens, self.mixed_prompts * self.geometry.slot_tokens)
        self.limits = Limits(padded_vocab=int(chunk.vocab_size), slot_tokens=self.geometry.slot_tokens)
        self.rotary = chunk.rotary_pos_emb if kind == "rope" else None
        self.cache: Optional[KVCache] = None
        self.noise: Optional[RolloutBuffer] = None
        self.graphs: Optional[DecodeGraphs] = None
        self.prefill_hidden: Optional[torch.Tensor] = None
        self._signatures: dict[tuple, tuple] = {}  # a graph's sampling settings, by the key part naming them
        self._generator: Optional[torch.Generator] = None  # the call's sampling stream
        self.stats = {"prefill_forwards": 0, "prefill_graph_forwards": 0, "decode_steps": 0, "idle_slot_steps": 0,
                      "max_active_slots": 0, "dropped_rows": 0, "calls": 0, "mixed_steps": 0,
                      "slot_moves": 0}

    def _geometry(self, chunk) -> CacheGeometry:
        cfg, attn = self.config, self.attention[0]
        model_len = int(chunk.max_sequence_length)
        slot_tokens = cfg.max_sequence_length or model_len
        if slot_tokens > model_len:
            raise ValueError(f"GenerationConfig.max_sequence_length ({slot_tokens}) exceeds the model's "
                             f"max_sequence_length ({model_len})")
        kv_heads, head_dim = attn.num_query_groups_per_partition, attn.hidden_size_per_attention_head
        dtype = chunk.config.params_dtype
        if cfg.cache_gib is not None:
            per_token = CacheGeometry.bytes_per_token(len(self.attention), kv_heads, head_dim, dtype)
            tokens, what = int(cfg.cache_gib * 2**30) // per_token, f"cache_gib ({cfg.cache_gib})"
        elif cfg.cache_tokens is not None:
            tokens, what = cfg.cache_tokens, f"cache_tokens ({cfg.cache_tokens})"
        else:
            tokens, what = cfg.max_batch_size * slot_tokens, ""
        slots = min(cfg.max_batch_size, tokens // slot_tokens)
        if slots < 1:
            raise ValueError(f"GenerationConfig.{what} holds {tokens} positions, fewer than one sequence of "
                             f"max_sequence_length ({slot_tokens})")
        return CacheGeometry(num_layers=len(self.attention), num_slots=slots, slot_tokens=slot_tokens,
                             kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                             spare_slots=1 if self.use_graphs or self.mixed_tokens else 0)

    # -- fixed-address state (made once, at the first call) ------------------------------------------------

    def _ensure_state(self) -> None:
        if self.cache is not None:
            return
        g, dev = self.geometry, self.device
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
                          if self.prev_rank is not None else None)
        self.inv_freq = self.rotary.inv_freq.to(dev).clone() if self.rotary is not None else None
        if self.use_graphs:
            self.graphs = self._new_graphs(self._batch_sizes())
            # A graph prefill's inputs: rows x padded length tokens, their positions and slots, then per row the
            # index of its last token, its slot and its prompt length; filled by one host-to-device copy.
            self.prefill_rows = g.num_slots if g.num_slots <= 8 else -(-g.num_slots // 8) * 8
            self.prefill_tokens = max(self.config.prefill_tokens, self.config.prefill_graph_granule)
            # A mixed step's: see _stage_mixed.
            self.staging = torch.zeros(max(3 * 2 * self.prefill_tokens + self.prefill_rows,
                                           3 * self.mixed_tokens + 3 * self.mixed_prompts), dtype=torch.long,
                                       device=dev)
            self.token_index = torch.arange(2 * self.prefill_tokens, device=dev)
            self.prefill_hidden = (torch.zeros(max(2 * self.prefill_tokens, g.num_slots + self.mixed_tokens), 1,
                                               self.hidden_size, dtype=self.hidden_dtype, device=dev)
                                   if self.prev_rank is not None else None)
            if self.is_last:
                # The sampling race's draws of a graph step (made eagerly before the replay, read by the graph).
                rows = max(self.prefill_rows, g.num_slots + self.mixed_prompts)
                self.noise = self.memory.reserve(rows * int(self.chunk.vocab_size), torch.float32)

    def _new_graphs(self, batch_sizes: list[int]) -> DecodeGraphs:
        return DecodeGraphs(batch_sizes, length_granule=self.config.graph_length_granule,
                            max_length=self.geometry.slot_tokens, device=self.device,
                            pool_bytes=int(self.config.graph_pool_gib * 2**30), memory=self.memory)

    # -- one forward of this stage ---------------------------------------------------------------------------

    def _rotary(self, positions_T: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """cos and sin of the rotary angles at each token's position: megatron-core's ``RotaryEmbedding.get_emb``
        at arbitrary positions (the same products, so the same bits), from the model's own ``inv_freq``."""
        if self.inv_freq is None:
            return None
        seq = positions_T.to(self.inv_freq.dtype)
        if self.rotary.seq_len_interpolation_factor is not None:
            seq = seq * (1 / self.rotary.seq_len_interpolation_factor)
        freqs = seq.unsqueeze(-1) * self.inv_freq  # torch.outer(seq, inv_freq)
        if self.rotary.rotary_interleaved:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        emb = emb[:, None, None, :]
        dtype = self.chunk.config.params_dtype  # q and k's: megatron-core casts per layer, we once per step
        return torch.cos(emb).to(dtype), torch.sin(emb).to(dtype)

    def _forward(self, tokens_T: torch.Tensor, hidden_T1H: Optional[torch.Tensor], step: KVStep,
                 last_T: Optional[torch.Tensor]) -> torch.Tensor:
        """This stage on the packed tokens: hidden states ``[T, 1, H]`` for the next stage, or on the last stage
        the gathered logits ``[n, V]`` at the tokens ``last_T`` (all tokens when None)."""
        chunk = self.chunk
        for attn in self.attention:
            attn.kv_step = step
        for norm in self.norms:
            norm.in_step = True
        try:
            if chunk.pre_process:
                hidden_T1H = chunk.embedding(input_ids=tokens_T.unsqueeze(0),
                                             position_ids=step.positions_T.unsqueeze(0))
            else:
                chunk.set_input_tensor(hidden_T1H)
            hidden_T1H = chunk.decoder(hidden_states=hidden_T1H, attention_mask=None)
        finally:
            for attn in self.attention:
                attn.kv_step = None
            for norm in self.norms:
                norm.in_step = False
        if not chunk.post_process:
            return hidden_T1H
        if last_T is not None:
            hidden_T1H = hidden_T1H[last_T]
        weight = chunk.shared_embedding_or_output_weight() if chunk.share_embeddings_and_output_weights else None
        logits, _ = chunk.output_layer(hidden_T1H, weight=weight, runtime_gather_output=False)
        return gather_vocab(logits, self.tp_group)[:, 0]

    def _decode_forward(self, batch: int, attended: int) -> torch.Tensor:
        """A decode step over slots ``0 .. batch-1``, reading only fixed-address inputs (graph-capturable)."""
        positions = self.slot_positions[:batch]
        if self.reads_lengths:
            mask, lengths = None, positions + 1
        else:
            mask, lengths = (self.position_index[:attended] <= positions.unsqueeze(-1))[:, None, None, :], None
        step = KVStep(self.cache.keys, self.cache.values, slots_T=self.slot_index[:batch], positions_T=positions,
                      rotary_T11D=self._rotary(positions), decode=True, attended=attended, mask_B11L=mask,
                      lengths_B=lengths)
        hidden = self.hidden_in[:batch] if self.hidden_in is not None else None
        return self._forward(self.slot_tokens[:batch], hidden, step, None)

    def _mixed_forward(self, batch: int, chunk: int, rows: int, staged: torch.Tensor,
                       hidden_T1H: Optional[torch.Tensor], attended: int) -> torch.Tensor:
        """A decode step over slots ``0 .. batch-1`` with ``chunk`` prompt tokens riding along (``staged``, laid out
        by :meth:`_stage_mixed`). Every row reads its own slot up to its own position, so a prompt's tokens attend
        causally to each other (all rows write K/V before any reads). Logits at the decode rows, then at the last
        token of each of ``rows`` prompt rows."""
        tokens, positions, slots = (staged[i * chunk: (i + 1) * chunk] for i in range(3))
        last = staged[3 * chunk: 3 * chunk + rows]
        # An idle decode row writes (and reads) the spare slot: the slot it stands for may be taking a prompt in
        # this very step, whose tokens write its position 0.
        decode_slots = torch.where(self.slot_running[:batch] > 0, self.slot_index[:batch], self.geometry.num_slots)
        slots_T = torch.cat([decode_slots, slots])
        positions_T = torch.cat([self.slot_positions[:batch], positions])
        step = KVStep(self.cache.keys, self.cache.values, slots_T=slots_T, positions_T=positions_T,
                      rotary_T11D=self._rotary(positions_T), decode=True, attended=attended,
                      lengths_B=positions_T + 1, read_slots_B=slots_T)
        sampled = torch.cat([self.slot_index[:batch], last + batch])
        return self._forward(torch.cat([self.slot_tokens[:batch], tokens]), hidden_T1H, step, sampled)

    def _prefill_forward(self, rows: int, length: int) -> torch.Tensor:
        """A graph prefill: ``rows`` prompts right-padded to ``length`` tokens, from the staging buffer."""
        T = rows * length
        tokens, positions, slots = (self.staging[i * T: (i + 1) * T] for i in range(3))
        last = self.staging[3 * T: 3 * T + rows]
        step = KVStep(self.cache.keys, self.cache.values, slots_T=slots, positions_T=positions,
                      rotary_T11D=self._rotary(positions), decode=False, prompts=[(length, self.token_index[:T])])
        hidden = self.prefill_hidden[:T] if self.prefill_hidden is not None else None
        return self._forward(tokens, hidden, step, last)

    # -- graph steps: the forward and, on the last stage, the sampling --------------------------------------

    def _noise(self, rows: int, vocab: int) -> torch.Tensor:
        """The race's draws of a graph step over ``rows`` rows, ``[rows, vocab]`` at a fixed address."""
        return self.noise.tensor[: rows * vocab].view(rows, vocab)

    def _sampled(self, logits_nV: torch.Tensor, params, vocab: int, tempered: bool) -> tuple[torch.Tensor, ...]:
        noise = None if is_greedy(params) else self._noise(logits_nV.shape[0], vocab)
        tokens, logp = sample(logits_nV, params, vocab_size=vocab, noise_nV=noise, tempered_log_probs=tempered)
        return logits_nV, tokens, logp

    def _replay(self, key: tuple) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Run graph ``key`` (its draws made first); returns its tokens and a copy of its log-probs on the last
        stage (the graph's outputs are overwritten by the next replay), ``(None, None)`` on the others after
        sending the hidden states on."""
        kind, rows, _, sig = key
        rows += self.mixed_prompts if kind == "mixed" else 0  # sampled rows
        params, vocab, _ = self._signatures[sig]
        if self.is_last and not is_greedy(params):
            draw_noise(self._noise(rows, vocab), params, self._generator)
        out = self.graphs.run(key, self.graph_step(key))
        if not self.is_last:
            self._send(out[0])
            return None, None
        return out[1], out[2].clone()

    def graph_step(self, key: tuple) -> Callable[[], tuple[torch.Tensor, ...]]:
        """The capturable step of graph ``key``: ``(logits, tokens, log_probs)`` on the last stage, ``(hidden,)``
        on the others."""
        kind, rows, length, sig = key
        params, vocab, tempered = self._signatures[sig]
        if kind == "decode":
            forward = functools.partial(self._decode_forward, rows, length)
        elif kind == "mixed":  # rows: the decode batch; length: the prompt tokens riding along
            hidden = self.prefill_hidden[: rows + length] if self.prefill_hidden is not None else None
            forward = functools.partial(self._mixed_forward, rows, length, self.mixed_prompts, self.staging, hidden,
                                        self.geometry.slot_tokens)
        else:
            forward = functools.partial(self._prefill_forward, rows, length)
        if not self.is_last:
            return lambda: (forward(),)
        return lambda: self._sampled(forward(), params, vocab, tempered)

    def _signature(self, params, vocab: int, tempered: bool) -> tuple:
        sig = (is_greedy(params), float(params.temperature), int(params.top_k or 0), float(params.top_p or 0.0),
               vocab, tempered)
        self._signatures.setdefault(sig, (params, vocab, tempered))
        return sig

    # -- pipeline communication ------------------------------------------------------------------------------

    def _errors(self, what: str) -> Any:
        """On rollout groups, a failed or timed-out exchange names the phase and their timeout."""
        return self.groups.errors("generate", what) if self.groups is not None else nullcontext()

    def _receive(self, out: Optional[torch.Tensor], num_tokens: int) -> Optional[torch.Tensor]:
        if self.prev_rank is None:
            return None
        if out is None:
            out = torch.empty(num_tokens, 1, self.hidden_size, dtype=self.hidden_dtype, device=self.device)
        with self._errors(f"the receive of hidden states from rank {self.prev_rank}"):
            dist.recv(out, src=self.prev_rank, group=self.pp_group)
        return out

    def _send(self, hidden_T1H: torch.Tensor) -> None:
        with self._errors(f"the send of hidden states to rank {self.next_rank}"):
            dist.send(hidden_T1H.contiguous(), dst=self.next_rank, group=self.pp_group)

    def _share(self, tensor: Optional[torch.Tensor], numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The last stage's ``tensor`` on every stage."""
        if self.pp_group.size() == 1:
            return tensor
        if tensor is None:
            tensor = torch.empty(numel, dtype=dtype, device=self.device)
        with self._errors(f"the broadcast of sampled tokens from rank {self.last_rank}"):
            dist.broadcast(tensor, src=self.last_rank, group=self.pp_group)
        return tensor

    def _sample_or_send(self, out: torch.Tensor, sampler) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """An eager step's end: the last stage samples ``out`` (its logits), the others send it (hidden states)."""
        if self.is_last:
            return sampler(out)
        self._send(out)
        return None, None

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """``values`` on the device without a host sync (a pinned staging copy on a GPU)."""
        host = torch.tensor(values, dtype=torch.long)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    # -- the steps -------------------------------------------------------------------------------------------

    def _prefill(self, prompts: list[list[int]], slots: list[int], params, vocab: int, tempered: bool,
                 sampler) -> tuple[torch.Tensor, Optional[torch.Tensor], int]:
        """Run whole prompts into ``slots``; returns each row's first token (every stage), its log-prob (the last
        stage) and the rows computed (padded rows of a graph prefill come after the prompts')."""
        lengths = [len(p) for p in prompts]
        key = self._prefill_key(lengths, params, vocab, tempered)
        if key is not None:
            picked, logp, rows = self._graph_prefill(key, prompts, slots)
        else:
            picked, logp = self._eager_prefill(prompts, slots, sampler)
            rows = len(prompts)
        self._start(self._to_device(slots), picked[: len(prompts)], self._to_device(lengths))
        return picked, logp, rows

    def _prefill_key(self, lengths: list[int], params, vocab: int, tempered: bool) -> Optional[tuple]:
        if self.graphs is None:
            return None
        rows, length = self._prefill_shape(len(lengths), max(lengths))
        if not self._prefill_graph_fits(rows, length):
            return None
        return ("prefill", rows, length, self._signature(params, vocab, tempered))

    def _prefill_shape(self, count: int, longest: int) -> tuple[int, int]:
        """A graph prefill's rows and padded length for ``count`` prompts of at most ``longest`` tokens. Rows: exact
        up to 8 (refills are a few prompts: a power of two would pad 3 to 4), then whole eights; the length a
        multiple of ``prefill_graph_granule``."""
        granule = self.config.prefill_graph_granule
        rows = count if count <= 8 else -(-count // 8) * 8
        return rows, min(-(-longest // granule) * granule, self.geometry.slot_tokens)

    def _prefill_graph_fits(self, rows: int, length: int) -> bool:
        """Whether a graph prefill of ``rows`` x ``length`` fits the staging buffers (else the prefill is eager)."""
        return rows <= self.prefill_rows and rows * length <= 2 * self.prefill_tokens

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
        self.staging[: 3 * T + rows].copy_(self._to_device(tokens + positions + where + last))

    def _graph_prefill(self, key: tuple, prompts: list[list[int]], slots: list[int]):
        _, rows, length, _ = key
        T = rows * length
        self.stage_prefill(rows, length, prompts, slots)
        self._receive(self.prefill_hidden[:T] if self.prefill_hidden is not None else None, T)
        picked, logp = self._replay(key)
        self.stats["prefill_graph_forwards"] += 1
        picked = self._share(picked, rows, torch.long)
        return picked, logp, rows

    def _eager_prefill(self, prompts: list[list[int]], slots: list[int], sampler):
        lengths = [len(p) for p in prompts]
        tokens = self._to_device([t for p in prompts for t in p])
        positions = self._to_device([i for n in lengths for i in range(n)])
        where = self._to_device([s for s, n in zip(slots, lengths) for _ in range(n)])
        starts = [0, *itertools.accumulate(lengths)][:-1]
        by_length: dict[int, list[int]] = {}
        for start, n in zip(starts, lengths):
            by_length.setdefault(n, []).extend(range(start, start + n))
        step = KVStep(self.cache.keys, self.cache.values, slots_T=where, positions_T=positions,
                      rotary_T11D=self._rotary(positions), decode=False,
                      prompts=[(n, self._to_device(index)) for n, index in by_length.items()])
        last = self._to_device([s + n - 1 for s, n in zip(starts, lengths)])
        out = self._forward(tokens, self._receive(None, len(tokens)), step, last)
        self.stats["prefill_forwards"] += 1
        picked, logp = self._sample_or_send(out, sampler)
        picked = self._share(picked, len(prompts), torch.long)
        return picked, logp

    def _decode(self, batch: int, attended: int, params, vocab: int, tempered: bool,
                sampler) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One token for each of the slots ``0 .. batch-1``; returns the tokens (every stage), log-probs (last)."""
        if self.graphs is not None:
            batch, attended = self.graphs.bucket(batch, self.geometry.slot_tokens if self.reads_lengths
                                                 else attended)
        self._receive(self.hidden_in[:batch] if self.hidden_in is not None else None, batch)
        if self.graphs is not None:
            picked, logp = self._replay(("decode", batch, attended, self._signature(params, vocab, tempered)))
        else:
            picked, logp = self._sample_or_send(self._decode_forward(batch, attended), sampler)
        picked = self._share(picked, batch, torch.long)
        self._advance(batch, picked)
        return picked, logp

    def _advance(self, batch: int, picked: torch.Tensor) -> None:
        """After a step over slots ``0 .. batch-1``: their next inputs are the tokens just picked, one position on
        (idle slots stay at position 0)."""
        self.slot_tokens[:batch] = picked[:batch]
        self.slot_positions[:batch] += self.slot_running[:batch]

    def _start(self, slots: torch.Tensor, first: torch.Tensor, lengths: torch.Tensor) -> None:
        """Prompts of ``lengths`` now fill ``slots`` (device index tensors): they decode from their ``first``
        tokens, at the position after each prompt."""
        # index_copy_/index_fill_, not ``t[slots] = 1``: a Python scalar assigned through an index tensor is copied
        # to the device from pageable memory, a stream sync that stalled every refill's step on an H200.
        self.slot_tokens.index_copy_(0, slots, first)
        self.slot_positions.index_copy_(0, slots, lengths)
        self.slot_running.index_fill_(0, slots, 1)

    def _mixed_fits(self, admitted: list[tuple[int, int]], prompts) -> bool:
        """Whether the ``admitted`` prompts can ride along the next decode step."""
        return (0 < len(admitted) <= self.mixed_prompts
                and sum(len(prompts[seq]) for seq, _ in admitted) <= self.mixed_tokens)

    def _mixed_chunk(self, total: int) -> int:
        """Prompt-token rows of a graph mixed step carrying ``total`` tokens: 32, 48, 64, 96, 128, ... (at most a
        third of them padding), at most ``mixed_tokens``."""
        size = 32
        while size < total:
            size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
        return min(size, self.mixed_tokens)

    def _stage_mixed(self, chunk: int, rows: int, prompts: list[list[int]], slots: list[int]) -> list[int]:
        """A mixed step's inputs, flat: ``chunk`` prompt tokens (the prompts one after another, then padding that
        writes position 0 of the spare slot), their positions, their slots; per prompt row (``rows``, padded rows
        point at the last token) the index of its last token; then the prompts' slots and their lengths."""
        spare = self.geometry.num_slots
        tokens, positions, where = [], [], []
        for prompt, slot in zip(prompts, slots):
            tokens += prompt
            positions += range(len(prompt))
            where += [slot] * len(prompt)
        pad = chunk - len(tokens)
        ends = list(itertools.accumulate(len(p) for p in prompts))
        last = [end - 1 for end in ends] + [chunk - 1] * (rows - len(prompts))
        return (tokens + [0] * pad + positions + [0] * pad + where + [spare] * pad + last + list(slots)
                + [len(p) for p in prompts])

    def _mixed(self, batch: int, attended: int, prompts: list[list[int]], slots: list[int], params, vocab: int,
               tempered: bool, sampler) -> tuple[torch.Tensor, Optional[torch.Tensor], int, int]:
        """A decode step over slots ``0 .. batch-1`` with ``prompts`` riding along into their ``slots``. Returns
        the tokens (every stage: the decode rows', then one per prompt row), the log-probs (last stage), and the
        decode and prompt rows computed (graphs pad both)."""
        total = sum(len(p) for p in prompts)
        if self.graphs is not None:
            batch = self.graphs.bucket(batch, self.geometry.slot_tokens)[0]
            chunk, rows = self._mixed_chunk(total), self.mixed_prompts
            values = self._stage_mixed(chunk, rows, prompts, slots)
            staged = self.staging
            staged[: len(values)].copy_(self._to_device(values))
            self._receive(self.prefill_hidden[: batch + chunk] if self.prefill_hidden is not None else None,
                          batch + chunk)
            picked, logp = self._replay(("mixed", batch, chunk, self._signature(params, vocab, tempered)))
        else:
            chunk, rows = total, len(prompts)
            staged = self._to_device(self._stage_mixed(chunk, rows, prompts, slots))
            out = self._mixed_forward(batch, chunk, rows, staged, self._receive(None, batch + chunk),
                                      max(attended, max(len(p) for p in prompts)))
            picked, logp = self._sample_or_send(out, sampler)
        picked = self._share(picked, batch + rows, torch.long)
        self._advance(batch, picked)
        k, at = len(prompts), 3 * chunk + rows
        self._start(staged[at: at + k], picked[batch: batch + k], staged[at + k: at + 2 * k])
        self.stats["mixed_steps"] += 1
        return picked, logp, batch, rows

    def _batch_sizes(self) -> list[int]:
        """The decode batch buckets: ``graph_batch_sizes``, or powers of two below the slot count; and the slot
        count."""
        n = self.geometry.num_slots
        sizes = self.config.graph_batch_sizes or [2**i for i in range(n.bit_length())]
        return sorted({min(b, n) for b in sizes} | {n})

    def _batch_bucket(self, batch: int) -> int:
        """The decode batch a step over slots ``0 .. batch-1`` runs at with graphs (their bucket), and the bucket
        slot compaction aims at without them (eager steps run at ``batch`` itself)."""
        if self.graphs is not None:
            return self.graphs.bucket(batch, self.geometry.slot_tokens)[0]
        sizes = self._batch_sizes()
        return sizes[bisect.bisect_left(sizes, batch)]

    def _compact(self, sched: SlotScheduler, filled: Callable[[int], int]) -> None:
        """Move the sequences of high slots into free low ones when the running ones fit a smaller batch bucket
        than the slots they span (``filled(seq)``: cache positions a sequence's in-flight steps will have written,
        at most). Every rank of the replica moves its own stage's cache: the schedule is the same on all."""
        running = len(sched.slot_of)
        if not running:
            return
        target = self._batch_bucket(running)
        if self._batch_bucket(sched.extent()) <= target:
            return
        moves = sched.compact(target)
        positions = max(filled(sched.slots[to]) for _, to in moves)
        sources, targets = self._to_device([a for a, _ in moves]), self._to_device([b for _, b in moves])
        # Queued behind the steps in flight: they write the old slots first, then this copies them.
        self.cache.move_slots(sources, targets, min(positions, self.geometry.slot_tokens))
        for state in (self.slot_tokens, self.slot_positions, self.slot_running):
            state.index_copy_(0, targets, state.index_select(0, sources))
        self.slot_running.index_fill_(0, sources, 0)  # no scalar through an index tensor: see _start
        self.slot_positions.index_fill_(0, sources, 0)
        self.stats["slot_moves"] += len(moves)

    def _release(self, slots: list[int]) -> None:
        for slot in slots:
            # fill_ of a one-slot view takes the scalar as a kernel argument; ``t[slot] = 0`` copies it from pageable
            # host memory, a stream sync per finished sequence that left the device idle until the next launch.
            self.slot_running.narrow(0, slot, 1).fill_(0)
            self.slot_positions.narrow(0, slot, 1).fill_(0)  # an idle slot keeps writing garbage at position 0

    def _in_flight(self, picked: torch.Tensor, owners: list[Optional[int]]) -> _InFlight:
        if not self.overlap or self.device.type != "cuda":  # on a CPU the step has run already
            return _InFlight(owners, picked, None)
        host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
        host.copy_(picked, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return _InFlight(owners, host, event)

    # -- the loop ------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[list[int]], params, *, vocab_size: int, stop_token_ids: Sequence[int] = (),
                 seed: int = 0, tempered_log_probs: bool = False) -> list[GenerationResult]:
        """Generate for ``prompts`` (checked: non-empty, ids below ``vocab_size``, each fits a slot); every rank of
        the replica gets every result (``tempered_log_probs``, the same on every rank: also fill
        ``generated_tempered_log_probs``)."""
        results = [GenerationResult(list(p)) for p in prompts]
        if not prompts:
            return results
        self._ensure_state()
        self.slot_running.zero_()
        self.slot_positions.zero_()
        if self.inv_freq is not None:
            self.inv_freq.copy_(self.rotary.inv_freq)  # the model's rotary state, at this call
        stops = set(stop_token_ids) | ({int(params.termination_id)} if params.termination_id is not None else set())
        limit = int(params.num_tokens_to_generate)
        self._generator = generator = torch.Generator(device=self.device).manual_seed(seed)

        def sampler(logits_nV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return sample(logits_nV, params, vocab_size=vocab_size, generator=generator,
                          tempered_log_probs=tempered_log_probs)

        sched = SlotScheduler(len(prompts), self.geometry.num_slots)
        launched = [0] * len(prompts)  # tokens launched per sequence (the host knows them before they arrive)
        closed = [False] * len(prompts)  # no more steps will be launched for the sequence; its slot is free
        ended = [False] * len(prompts)  # its last token has arrived
        flight: deque[_InFlight] = deque()
        depth = 1 if self.overlap else 0
        # Per step, which sequence each sampled row belongs to (None: an idle slot), and the last stage's log-probs.
        rows: list[list[Optional[int]]] = []
        log_probs: list[torch.Tensor] = []

        def decoding(width: int, new: frozenset = frozenset()) -> tuple[list[Optional[int]], int]:
            """Per slot ``0 .. width-1``, the sequence it decodes (None: idle, or taking one of the ``new``
            prompts), and the most cache positions any of them reads."""
            owners: list[Optional[int]] = [None] * width
            attended = 0
            for slot, seq in sched.active():
                if seq not in new:
                    owners[slot] = seq
                    attended = max(attended, len(prompts[seq]) + launched[seq])
            return owners, attended

        def close(seq: int) -> None:
            closed[seq] = True
            self._release([sched.finish(seq)])

        def launched_step(picked: torch.Tensor, logp: Optional[torch.Tensor], owners: list[Optional[int]]) -> None:
            rows.append(owners)
            log_probs.append(logp)
            flight.append(self._in_flight(picked, owners))
            for seq in owners:
                if seq is not None:
                    launched[seq] += 1
            for seq in owners:  # by length: ends with this step, whatever its tokens are
                if seq is not None and launched[seq] == limit and not closed[seq]:
                    close(seq)

        def drain(keep: int) -> None:
            while len(flight) > keep:
                step = flight.popleft()
                if step.event is not None:
                    step.event.synchronize()
                for j, (tok, seq) in enumerate(zip(step.tokens.tolist(), step.owners)):
                    if seq is None:
                        continue
                    if ended[seq]:  # launched before the host saw this sequence's stop token
                        step.owners[j] = None
                        self.stats["dropped_rows"] += 1
                        continue
                    out = results[seq].generated_tokens
                    out.append(tok)
                    if tok in stops or len(out) == limit:
                        ended[seq] = True
                        if not closed[seq]:
                            close(seq)

        was_training = self.chunk.training
        self.chunk.eval()
        try:
            # The cache, the sampling noise and the graph pool: with the engine's provider this call is inside the
            # rollout its generator switched to (nothing to do here); with a provider of its own, mapped for it.
            with torch.no_grad(), self.memory.backed():
                while True:
                    if self.compact and not sched.waiting:
                        self._compact(sched, lambda seq: len(prompts[seq]) + launched[seq])
                    extent = sched.extent()  # the slots decoding, before this step's admissions
                    admitted = sched.admit()
                    if admitted and extent and self._mixed_fits(admitted, prompts):
                        sched.decode_batch()  # counts the step: every slot decodes or takes a prompt in it
                        owners, attended = decoding(extent, frozenset(seq for seq, _ in admitted))
                        picked, logp, batch, n = self._mixed(
                            extent, attended, [prompts[seq] for seq, _ in admitted], [slot for _, slot in admitted],
                            params, vocab_size, tempered_log_probs, sampler)
                        launched_step(picked, logp, owners + [None] * (batch - extent)
                                      + [seq for seq, _ in admitted] + [None] * (n - len(admitted)))
                        drain(depth)
                        continue
                    while admitted:  # a prompt whose first token ends it frees its slot for the next at once
                        for group in self._prefill_groups(admitted, prompts):
                            seqs, slots = [s for s, _ in group], [slot for _, slot in group]
                            picked, logp, n = self._prefill([prompts[s] for s in seqs], slots, params, vocab_size,
                                                            tempered_log_probs, sampler)
                            launched_step(picked, logp, seqs + [None] * (n - len(seqs)))
                            drain(depth)
                        admitted = sched.admit()
                    batch = sched.decode_batch()
                    if batch:
                        owners, attended = decoding(batch)
                        picked, logp = self._decode(batch, attended, params, vocab_size, tempered_log_probs,
                                                    sampler)
                        launched_step(picked, logp, owners + [None] * (len(picked) - batch))
                        drain(depth)
                    elif flight:
                        drain(0)
                    elif sched.done:
                        break
                self._collect_log_probs(results, rows, log_probs, tempered=tempered_log_probs)
        finally:
            self.chunk.train(was_training)
            self._generator = None
        for key in ("decode_steps", "idle_slot_steps"):
            self.stats[key] += getattr(sched, key)
        self.stats["max_active_slots"] = max(self.stats["max_active_slots"], sched.max_active)
        self.stats["calls"] += 1
        if self.device.type == "cuda" and self.config.release_memory:
            torch.cuda.empty_cache()
        return results

    def _prefill_groups(self, admitted: list[tuple[int, int]], prompts) -> list[list[tuple[int, int]]]:
        """``admitted`` cut into prefill forwards of at most ``prefill_tokens`` prompt tokens (a longer prompt
        alone), in order. With graphs, see :meth:`_graph_prefill_groups`."""
        if self.graphs is not None:
            return self._graph_prefill_groups(admitted, prompts)
        groups: list[list[tuple[int, int]]] = [[]]
        size = 0
        for item in admitted:
            n = len(prompts[item[0]])
            if groups[-1] and size + n > self.config.prefill_tokens:
                groups.append([])
                size = 0
            groups[-1].append(item)
            size += n
        return groups

    def _graph_prefill_groups(self, admitted: list[tuple[int, int]], prompts) -> list[list[tuple[int, int]]]:
        """``admitted`` cut into graph prefills, each a rectangle of rows x padded length that fits the graphs'
        buffers and holds at most ``prefill_tokens`` prompt tokens (a prompt too long for any graph goes alone, an
        eager prefill): by length, the cut with the least padded tokens plus ``_PREFILL_FORWARD_TOKENS`` per
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
                rows, length = self._prefill_shape(j - i, lengths[j - 1])
                alone = i == j - 1
                if not alone and (size > self.config.prefill_tokens or not self._prefill_graph_fits(rows, length)):
                    break  # and so is every larger group
                total = cost[i] + _PREFILL_FORWARD_TOKENS + rows * length
                if total < cost[j]:
                    cost[j], start[j] = total, i
        groups, j = [], len(items)
        while j:
            groups.append(items[start[j]: j])
            j = start[j]
        return groups[::-1]

    def _collect_log_probs(self, results: list[GenerationResult], rows: list[list[Optional[int]]],
                           log_probs: list[Optional[torch.Tensor]], *, tempered: bool) -> None:
        """Move the last stage's log-probs to the host in one copy and share them with the other stages. Each
        step's are ``[n]``, or ``[n, 2]`` with the tempered ones."""
        total = sum(len(r) for r in rows)
        columns = 2 if tempered else 1
        flat = torch.cat(log_probs).view(-1) if self.is_last else None
        flat = self._share(flat, total * columns, torch.float32).view(total, columns).tolist()
        i = 0
        for owners in rows:  # one row per sampled token, in the order the tokens were appended
            for seq in owners:
                if seq is not None:
                    results[seq].generated_log_probs.append(flat[i][0])
                    if columns == 2:
                        results[seq].generated_tempered_log_probs.append(flat[i][1])
                i += 1

    def report(self) -> dict[str, Any]:
        """Counters for the engine's communication report."""
        out = dict(self.stats)
        out["cuda_graph_captures"] = self.graphs.captures if self.graphs is not None else 0
        out["cuda_graph_replays"] = self.graphs.replays if self.graphs is not None else 0
        out["cuda_graph_buckets"] = self.graphs.keys() if self.graphs is not None else []
        out["cuda_graph_pool_bytes"] = self.graphs.pool_bytes if self.graphs is not None else 0
        out["cuda_graph_pool_mapped_bytes"] = (self.graphs.reserved.mapped_bytes if self.graphs is not None
                                               and self.graphs.reserved is not None else 0)
        out["kv_cache_slots"] = self.geometry.num_slots
        out["kv_cache_slot_tokens"] = self.geometry.slot_tokens
        out["kv_cache_bytes"] = self.geometry.nbytes
        out["kv_cache_mapped_bytes"] = self.cache.mapped_bytes if self.cache is not None else 0
        out["kv_cache_address"] = self.cache.data_ptr() if self.cache is not None else 0
        out["sampling_noise_mapped_bytes"] = self.noise.mapped_bytes if self.noise is not None else 0
        out["overlap_host"] = self.overlap
        out["attention_reads_lengths"] = self.reads_lengths
        return out

    def close(self) -> None:
        """Drop the graphs (and their reserved pool) and the cache's own reservation."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        if self.cache is not None:
            self.cache.close()
            self.cache = None
        if self.noise is not None:
            self.noise.close()
            self.noise = None
