"""One pipeline stage's execution of the generator's steps: fixed-address inputs, forwards, graphs, pipeline exchange.

The execution room of the generator (vLLM's model runner, megatron-core's model-inference wrapper):
:meth:`StageRunner.run` takes a :class:`~.planner.StepPlan` and returns a :class:`StepOutput`. It owns

- the fixed-address inputs: each slot's next token, its position and whether it runs (the decode step's inputs,
  updated in place on the device: graphs read them at these addresses), the staging buffer of graph prefills and
  mixed steps, the hidden-state buffers and a copy of the rotary frequencies;
- the four forwards (eager prefill, graph prefill, decode, mixed), capture and replay of their CUDA graphs
  (:class:`~.graphs.StepGraphs`, keyed by the plan's graph key), and sampling on the last stage;
- the pipeline exchange (:mod:`megatron_hybrid.reshard.communication`): hidden states travel stage to stage with
  send/recv on the pipeline group; the last stage samples and broadcasts each step's tokens to the others (one ``[B]``
  int64 broadcast per step);
- the device-side bookkeeping: slots started by a prefill, advanced by a decode step, released, moved.

A step drives the GPTModel stage's own modules (embedding, decoder, output layer) rather than its ``forward``: a
prefill then computes logits only at each prompt's last token, and megatron-core's inference-context code paths
(global groups, one offset per batch) stay out of the way. The step reaches the attention and norm modules through
the stage's :class:`~.context.StepContext`, set around each forward in one place (:meth:`StageRunner._forward`).

MoE layers run :mod:`.moe`'s step (dropless, no host sync with the grouped experts). When the stage's expert-parallel
group spans other rollout replicas, each step's plan carries the rows the group agreed on (``StepPlan.moe_rows``,
agreed by :mod:`.replica`), which the MoE layers pad to, and an ``"idle"`` plan runs only the MoE layers' share of
the group's collectives (:meth:`StageRunner._idle`).

Routing record (``GenerationConfig.record_routing``, MoE stages): one more rollout-only reservation, ``[M, N, L, k]``
(the stage's MoE layers, cache slots, positions, experts per token; int16, int32 past 32,767 experts), which every
MoE layer writes its tokens' top-k experts into at their slots and positions, as attention writes the KV cache.
A finished sequence's rows are copied out before its slot is released (:meth:`StageRunner.take_routing`), move with
compacted slots, and the stages' layers are merged into the whole model's at the end of a call
(:meth:`StageRunner.merge_routing`).

Mixed steps: refills of a few prompts ride along a decode step, their tokens extra rows of it, each attending to its
slot up to its own position; the logits are read at the decode rows and at each prompt's last token. One forward
then reads the weights once for both, where a prefill of two prompts would cost about as much as the decode step.

Legend: T packed tokens, B decode slots, H hidden, V vocabulary (padded).
"""

from __future__ import annotations

import functools
import itertools
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch

import torch.distributed as dist

from ..groups import RolloutGroups
from ..memory import PerCallRolloutMemory, RolloutBuffer, RolloutMemoryProvider
from ..reshard import broadcast_from_last, gather_vocab, pipeline_peers, recv_from_previous, send_to_next
from .attention import install_kv_attention
from .config import GenerationConfig
from .context import KVStep, stage_context
from .fused import install_fused_decoder
from .graphs import StepGraphs
from .kv_cache import CacheGeometry, KVCache
from .moe import install_step_moe, moe_layer_ordinals, sequential_experts
from .norms import install_step_norms
from .planner import MIXED_PROMPTS, MIXED_TOKENS, PlannerSettings, SlotMoves, StepPlan, batch_sizes
from .sampling import draw_noise, is_greedy, sample


@dataclass(frozen=True)
class _Sampling:
    """A call's sampling: its settings and its stream."""

    params: Any
    vocab_size: int
    tempered_log_probs: bool
    generator: torch.Generator


@dataclass(frozen=True)
class StepOutput:
    """What one step gives back (vLLM's ``ModelRunnerOutput``)."""

    tokens: torch.Tensor
    """The sampled rows' tokens, ``[rows]`` int64, on every stage (the plan's owners name each row's sequence)."""
    log_probs: Optional[torch.Tensor]
    """Their log-probs on the last stage (``[rows]``, or ``[rows, 2]`` with the tempered ones), None elsewhere."""
    rows: int
    """Rows computed and sampled (a graph step's padded rows included)."""


class StageRunner:
    """Runs the steps of generation on ``chunk`` (this rank's GPTModel stage) over ``tp_group`` and ``pp_group``.

    Its self-attention modules become :class:`~.attention.KVCacheSelfAttention` (and its RMSNorms
    :class:`~.norms.StepRMSNorm` on a GPU with Triton), unchanged outside a step. Device buffers are made at the
    first call (:meth:`allocate`) and kept at their addresses for the runner's life.

    Args:
        chunk: a megatron-core GPTModel stage.
        tp_group, pp_group: the replica's groups.
        config: cache and decode settings.
        memory: where the KV cache, the sampling draws and the graphs' pool are reserved: the engine's provider
            (backed from its switch to rollout to its switch back), or None: a :class:`PerCallRolloutMemory`
            (backed for each generate call).
        groups: the engine's rollout groups, whose error context names a failed or timed-out exchange, or None.
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
        self.device = next(chunk.parameters()).device
        self.context = stage_context(chunk)
        self.attention = install_kv_attention(chunk, self.context)
        self.norms = install_step_norms(chunk, self.device, self.context)
        self.moe = install_step_moe(chunk, self.context)
        # The stage's layers with SwiGLU and residual add + norm fused (None: megatron-core's TransformerBlock).
        self.fused = install_fused_decoder(chunk, self.device, enabled=config.fused_decoder)
        # The stage's MoE layers' ordinals among the model's (layer_number is global and 1-based).
        ordinals = (moe_layer_ordinals(chunk.config.num_layers, chunk.config.moe_layer_freq)
                    if chunk.config.num_moe_experts else [])
        self.moe_ordinals = [ordinals[layer.layer_number - 1] for layer in self.moe]
        self.num_moe_layers = sum(o is not None for o in ordinals)
        # Every stage takes part in the merge of a recording MoE model, one without MoE layers too.
        self.records_routing = bool(config.record_routing and self.num_moe_layers)
        groups_ = {id(layer.group): layer.group for layer in self.moe}
        assert len(groups_) <= 1, "the MoE layers of one stage share their expert-parallel group"
        self.expert_group = next(iter(groups_.values()), None)
        self.prev_rank, self.next_rank, self.last_rank = pipeline_peers(pp_group)
        self.is_last = self.next_rank is None
        cfg = chunk.config
        self.hidden_dtype = cfg.pipeline_dtype or cfg.params_dtype
        self.hidden_size = cfg.hidden_size
        on_gpu = self.device.type == "cuda"
        if config.cuda_graphs and not on_gpu:
            raise ValueError(f"GenerationConfig.cuda_graphs=True needs a model on a GPU; it is on {self.device}")
        self.use_graphs = on_gpu if config.cuda_graphs is None else config.cuda_graphs
        # An MoE layer whose experts cannot run as grouped GEMMs reads its group sizes on the host (no graphs).
        host_experts = [i for i, layer in enumerate(self.moe) if layer.experts_path() is sequential_experts]
        if host_experts and self.use_graphs:
            if config.cuda_graphs:
                raise ValueError(f"GenerationConfig.cuda_graphs=True: the experts of MoE layers {host_experts} run "
                                 "one by one with host-read group sizes (their weights are not one storage at a "
                                 "uniform stride, have biases, or grouped GEMMs do not support them here)")
            self.use_graphs = False
        # Whether the attention reads each slot's own filled length (a kernel of ours) rather than a masked window
        # of the longest: decode graphs then need no length bucket, and prompts can ride along decode steps.
        self.reads_lengths = all(a.decode_kernel_ok(self.device) for a in self.attention)
        mixed = config.mixed_prefill_tokens
        self.mixed_tokens = (MIXED_TOKENS if self.reads_lengths else 0) if mixed is None else mixed
        self.geometry = self._geometry(chunk)
        self.mixed_prompts = min(MIXED_PROMPTS, self.geometry.num_slots) if self.mixed_tokens else 0
        # No more than its prompts can hold: the staging and hidden buffers are sized by it.
        self.mixed_tokens = min(self.mixed_tokens, self.mixed_prompts * self.geometry.slot_tokens)
        self.rotary = chunk.rotary_pos_emb if kind == "rope" else None
        self.cache: Optional[KVCache] = None
        self.noise: Optional[RolloutBuffer] = None
        self.routing: Optional[RolloutBuffer] = None  # the routing record (record_routing), and its planes:
        self.routing_planes: Optional[list[torch.Tensor]] = None
        self.graphs: Optional[StepGraphs] = None
        self.prefill_hidden: Optional[torch.Tensor] = None
        self.prefill_rows = self.prefill_tokens = 0  # a graph prefill's staging capacity (with graphs)
        self._signatures: dict[tuple, tuple] = {}  # a graph's sampling settings, by the key part naming them
        self._sampling: Optional[_Sampling] = None  # the call's
        self._moe_rows = 0  # the step's MoE rows (its plan's), read where the step's context is set

    @property
    def spans_replicas(self) -> bool:
        """Whether this stage's expert-parallel group holds ranks of other rollout replicas (not only this replica's
        tensor-parallel ranks): then the replicas of the group step together (:mod:`.replica`)."""
        if self.expert_group is None or self.expert_group.size() == 1:
            return False
        return not set(dist.get_process_group_ranks(self.expert_group)) <= set(
            dist.get_process_group_ranks(self.tp_group))

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

    # -- rollout memory: every buffer reserved from the memory provider, and backing, here ----------------------

    def allocate(self) -> None:
        """Make the fixed-address state (once, at the first call)."""
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
        if self.records_routing and self.moe:
            cfg = self.chunk.config
            dtype = torch.int16 if cfg.num_moe_experts <= torch.iinfo(torch.int16).max else torch.int32
            plane = (n, g.slot_tokens, cfg.moe_router_topk)
            size = plane[0] * plane[1] * plane[2]
            self.routing = self.memory.reserve(len(self.moe) * size, dtype)
            self.routing_planes = [self.routing.tensor[i * size: (i + 1) * size].view(plane)
                                   for i in range(len(self.moe))]
        if self.use_graphs:
            self.graphs = self._new_graphs()
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
                                   if self.prev_rank is not None else None)
            if self.is_last:
                # The sampling race's draws of a graph step (made eagerly before the replay, read by the graph).
                rows = max(self.prefill_rows, g.num_slots + self.mixed_prompts)
                self.noise = self.memory.reserve(rows * int(self.chunk.vocab_size), torch.float32)

    def _new_graphs(self) -> StepGraphs:
        gib = self.config.graph_pool_gib
        pool_bytes = torch.cuda.get_device_properties(self.device).total_memory if gib is None else int(gib * 2**30)
        return StepGraphs(device=self.device, pool_bytes=pool_bytes,
                          memory=self.memory)

    def backed(self) -> ContextManager[None]:
        """The cache, the graphs' pool and the sampling draws are backed for the body (a generate call): the
        provider backs everything it reserved, for the call or (the engine's) for the whole rollout."""
        return self.memory.backed()

    def _errors(self, what: str) -> Any:
        """With the engine's groups, a failed or timed-out exchange names the phase and the engine's timeout."""
        return self.groups.errors("generate", what) if self.groups is not None else nullcontext()

    def close(self) -> None:
        """Drop the graphs (and their reserved pool), the cache's own reservation and the sampling draws'."""
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

    # -- a call ------------------------------------------------------------------------------------------------

    def plan_settings(self, *, compact: bool) -> PlannerSettings:
        """What the planner plans within: this runner's slots, buffers and graphs (after :meth:`allocate`)."""
        g, cfg = self.geometry, self.config
        return PlannerSettings(num_slots=g.num_slots, slot_tokens=g.slot_tokens, prefill_tokens=cfg.prefill_tokens,
                               batch_sizes=batch_sizes(g.num_slots, cfg.graph_batch_sizes),
                               graphs=self.graphs is not None, length_granule=cfg.graph_length_granule,
                               reads_lengths=self.reads_lengths, prefill_granule=cfg.prefill_graph_granule,
                               prefill_rows=self.prefill_rows, prefill_graph_tokens=2 * self.prefill_tokens,
                               mixed_prompts=self.mixed_prompts, mixed_tokens=self.mixed_tokens, compact=compact)

    def begin(self, params, *, vocab_size: int, tempered_log_probs: bool, seed: int) -> tuple:
        """Start a call sampling with ``params`` over ``vocab_size`` ids from a stream seeded ``seed``: every slot
        idle, the model's rotary state copied (after :meth:`allocate`). Returns the sampling signature that names
        the call's graphs."""
        self.slot_running.zero_()
        self.slot_positions.zero_()
        if self.inv_freq is not None:
            self.inv_freq.copy_(self.rotary.inv_freq)  # the model's rotary state, at this call
        generator = torch.Generator(device=self.device).manual_seed(seed)
        self._sampling = _Sampling(params, vocab_size, tempered_log_probs, generator)
        return self._signature(params, vocab_size, tempered_log_probs)

    def end(self) -> None:
        """The call is over (its sampling stream goes)."""
        self._sampling = None

    def run(self, plan: StepPlan) -> StepOutput:
        """Run the step ``plan`` on this stage."""
        self._moe_rows = plan.moe_rows
        if plan.kind == "idle":
            return self._idle(plan)
        if plan.kind == "decode":
            tokens, log_probs = self._decode(plan)
        elif plan.kind == "prefill":
            tokens, log_probs = self._prefill(plan)
        else:
            tokens, log_probs = self._mixed(plan)
        return StepOutput(tokens, log_probs, len(plan.owners))

    def move_slots(self, moves: SlotMoves) -> None:
        """Move the sequences of ``moves.sources`` to ``moves.targets``: their cache and decode state."""
        sources, targets = self._to_device(list(moves.sources)), self._to_device(list(moves.targets))
        # Queued behind the steps in flight: they write the old slots first, then this copies them.
        self.cache.move_slots(sources, targets, moves.positions)
        for plane in self.routing_planes or ():
            plane[targets, : moves.positions] = plane[sources, : moves.positions]
        for state in (self.slot_tokens, self.slot_positions, self.slot_running):
            state.index_copy_(0, targets, state.index_select(0, sources))
        self.slot_running.index_fill_(0, sources, 0)  # no scalar through an index tensor: see _start
        self.slot_positions.index_fill_(0, sources, 0)

    def release(self, slots: Sequence[int]) -> None:
        """The sequences of ``slots`` are done: the slots idle."""
        for slot in slots:
            # fill_ of a one-slot view takes the scalar as a kernel argument; ``t[slot] = 0`` copies it from pageable
            # host memory, a stream sync per finished sequence that left the device idle until the next launch.
            self.slot_running.narrow(0, slot, 1).fill_(0)
            self.slot_positions.narrow(0, slot, 1).fill_(0)  # an idle slot keeps writing garbage at position 0

    def take_routing(self, slot: int, positions: int) -> torch.Tensor:
        """A copy of the first ``positions`` rows of ``slot``'s routing record, ``[positions, M, k]`` (the stage's
        MoE layers): taken before the slot is released (queued behind the steps that wrote it)."""
        if not self.routing_planes:  # a stage without MoE layers
            return torch.zeros(positions, 0, self.chunk.config.moe_router_topk, dtype=torch.int16,
                               device=self.device)
        return torch.stack([plane[slot, :positions] for plane in self.routing_planes], dim=1)

    def merge_routing(self, stage_TMk: torch.Tensor) -> torch.Tensor:
        """The whole model's routing ``[T, M_all, k]`` int16 on the host, on every stage, from this stage's
        ``[T, M, k]`` (its MoE layers; the same tokens on every stage): each stage fills its layers' ordinals, -1
        elsewhere, and one all-reduce (maximum) over the pipeline group merges them."""
        T, _, k = stage_TMk.shape
        full = torch.full((T, self.num_moe_layers, k), -1, dtype=torch.int32, device=self.device)
        full[:, self.moe_ordinals] = stage_TMk.to(torch.int32)
        if self.pp_group.size() > 1:  # int32: the maximum over int16 is not in every backend
            with self._errors("the pipeline stages' merge of the routing record"):
                dist.all_reduce(full, op=dist.ReduceOp.MAX, group=self.pp_group)
        experts = self.chunk.config.num_moe_experts
        return full.to(device="cpu", dtype=torch.int16 if experts <= torch.iinfo(torch.int16).max else torch.int32)

    def share(self, tensor: Optional[torch.Tensor], numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The last stage's ``tensor`` (``numel`` of ``dtype``) on every stage."""
        if self.pp_group.size() == 1:
            return tensor
        if tensor is None:
            tensor = torch.empty(numel, dtype=dtype, device=self.device)
        return broadcast_from_last(tensor, self.pp_group, src=self.last_rank,
                                   errors=self._errors(f"the broadcast of sampled tokens from rank {self.last_rank}"))

    # -- one forward of this stage -----------------------------------------------------------------------------

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
        step.moe_rows = self._moe_rows
        step.routed_experts = self.routing_planes
        with self.context.step(step):  # the one place a step reaches the attention and norm modules
            if chunk.pre_process:
                hidden_T1H = chunk.embedding(input_ids=tokens_T.unsqueeze(0),
                                             position_ids=step.positions_T.unsqueeze(0))
            else:
                chunk.set_input_tensor(hidden_T1H)
            if self.fused is not None:
                hidden_T1H = self.fused(hidden_T1H)
            else:
                hidden_T1H = chunk.decoder(hidden_states=hidden_T1H, attention_mask=None)
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
        slots = self.slot_index[:batch]
        if self.geometry.spare_slots:  # (with mixed steps, which kept prefixes need)
            # An idle row writes the spare slot: its own may hold a kept prefix (multi-turn) from position 0 on.
            slots = torch.where(self.slot_running[:batch] > 0, slots, self.geometry.num_slots)
        step = KVStep(self.cache.keys, self.cache.values, slots_T=slots, positions_T=positions,
                      rotary_T11D=self._rotary(positions), decode=True, attended=attended, mask_B11L=mask,
                      lengths_B=lengths)
        hidden = self.hidden_in[:batch] if self.hidden_in is not None else None
        return self._forward(self.slot_tokens[:batch], hidden, step, None)

    def _mixed_forward(self, batch: int, chunk: int, rows: int, staged: torch.Tensor,
                       hidden_T1H: Optional[torch.Tensor], attended: int) -> torch.Tensor:
        """A decode step over slots ``0 .. batch-1`` with ``chunk`` prompt tokens riding along (``staged``, laid out
        by :meth:`stage_mixed`). Every row reads its own slot up to its own position, so a prompt's tokens attend
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

    # -- graph steps: the forward and, on the last stage, the sampling -----------------------------------------

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
        kind, rows, _, sig = key[:4]
        rows += self.mixed_prompts if kind == "mixed" else 0  # sampled rows
        params, vocab, _ = self._signatures[sig]
        if self.is_last and not is_greedy(params):
            draw_noise(self._noise(rows, vocab), params, self._sampling.generator)
        out = self.graphs.run(key, self.graph_step(key))
        if not self.is_last:
            self._send(out[0])
            return None, None
        return out[1], out[2].clone()

    def graph_step(self, key: tuple) -> Callable[[], tuple[torch.Tensor, ...]]:
        """The capturable step of graph ``key``: ``(logits, tokens, log_probs)`` on the last stage, ``(hidden,)``
        on the others."""
        kind, rows, length, sig = key[:4]
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

    # -- pipeline exchange -------------------------------------------------------------------------------------

    def _receive(self, out: Optional[torch.Tensor], num_tokens: int) -> Optional[torch.Tensor]:
        if self.prev_rank is None:
            return None
        if out is None:
            out = torch.empty(num_tokens, 1, self.hidden_size, dtype=self.hidden_dtype, device=self.device)
        return recv_from_previous(out, self.pp_group, src=self.prev_rank,
                                  errors=self._errors(f"the receive of hidden states from rank {self.prev_rank}"))

    def _send(self, hidden_T1H: torch.Tensor) -> None:
        send_to_next(hidden_T1H, self.pp_group, dst=self.next_rank,
                     errors=self._errors(f"the send of hidden states to rank {self.next_rank}"))

    def _sample_or_send(self, out: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """An eager step's end: the last stage samples ``out`` (its logits), the others send it (hidden states)."""
        if self.is_last:
            call = self._sampling
            return sample(out, call.params, vocab_size=call.vocab_size, generator=call.generator,
                          tempered_log_probs=call.tempered_log_probs)
        self._send(out)
        return None, None

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """``values`` on the device without a host sync (a pinned staging copy on a GPU)."""
        host = torch.tensor(values, dtype=torch.long)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    # -- the steps ---------------------------------------------------------------------------------------------

    def _prefill(self, plan: StepPlan) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Whole prompts into their slots; returns each row's first token (every stage) and its log-prob (the last
        stage); padded rows of a graph prefill come after the prompts'."""
        prompts, slots = list(plan.prompts), list(plan.slots)
        if plan.graph_key is not None:
            picked, logp = self._graph_prefill(plan.graph_key, prompts, slots)
        else:
            picked, logp = self._eager_prefill(prompts, slots)
        self._start(self._to_device(slots), picked[: len(prompts)], self._to_device([len(p) for p in prompts]))
        return picked, logp

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
        _, rows, length, _ = key[:4]
        T = rows * length
        self.stage_prefill(rows, length, prompts, slots)
        self._receive(self.prefill_hidden[:T] if self.prefill_hidden is not None else None, T)
        picked, logp = self._replay(key)
        picked = self.share(picked, rows, torch.long)
        return picked, logp

    def _eager_prefill(self, prompts: list[list[int]], slots: list[int]):
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
        picked, logp = self._sample_or_send(out)
        picked = self.share(picked, len(prompts), torch.long)
        return picked, logp

    def _idle(self, plan: StepPlan) -> StepOutput:
        """This replica has no step while others of its expert-parallel group do: only the MoE layers' collectives
        (and local experts), over the agreed rows; nothing is sampled."""
        if plan.graph_key is not None:
            self.graphs.run(plan.graph_key, functools.partial(self._idle_forward, plan.moe_rows))
        else:
            self._idle_forward(plan.moe_rows)
        return StepOutput(torch.zeros(0, dtype=torch.long, device=self.device), None, 0)

    def _idle_forward(self, rows: int) -> tuple:
        for layer in self.moe:
            layer.idle_step(rows)
        return ()

    def _decode(self, plan: StepPlan) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One token for each of the slots ``0 .. batch-1``; returns the tokens (every stage), log-probs (last)."""
        batch = plan.batch
        self._receive(self.hidden_in[:batch] if self.hidden_in is not None else None, batch)
        if plan.graph_key is not None:
            picked, logp = self._replay(plan.graph_key)
        else:
            picked, logp = self._sample_or_send(self._decode_forward(batch, plan.attended))
        picked = self.share(picked, batch, torch.long)
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

    def _mixed(self, plan: StepPlan) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """A decode step over slots ``0 .. batch-1`` with the plan's prompts riding along into their slots.
        Returns the tokens (every stage: the decode rows', then one per prompt row) and the log-probs (last
        stage)."""
        batch, chunk, rows, prompts = plan.batch, plan.length, plan.rows, plan.prompts
        if plan.graph_key is not None:
            values = self.stage_mixed(chunk, rows, prompts, plan.slots, plan.starts)
            staged = self.staging
            staged[: len(values)].copy_(self._to_device(values))
            self._receive(self.prefill_hidden[: batch + chunk] if self.prefill_hidden is not None else None,
                          batch + chunk)
            picked, logp = self._replay(plan.graph_key)
        else:
            staged = self._to_device(self.stage_mixed(chunk, rows, prompts, plan.slots, plan.starts))
            out = self._mixed_forward(batch, chunk, rows, staged, self._receive(None, batch + chunk), plan.attended)
            picked, logp = self._sample_or_send(out)
        picked = self.share(picked, batch + rows, torch.long)
        self._advance(batch, picked)
        k, at = len(prompts), 3 * chunk + rows
        self._start(staged[at: at + k], picked[batch: batch + k], staged[at + k: at + 2 * k])
        return picked, logp
