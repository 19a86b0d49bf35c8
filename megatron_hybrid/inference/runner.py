"""One pipeline stage's execution of the generator's steps: fixed-address inputs, forwards, graphs, pipeline exchange.

The execution room of the generator (vLLM's model runner, megatron-core's model-inference wrapper):
:meth:`StageRunner.run` takes a :class:`~.planner.StepPlan` and returns a :class:`StepOutput`. It owns

- the fixed-address state (:class:`~.stage_buffers.StageBuffers`): each slot's next token, its position and whether
  it runs (the decode step's inputs, updated in place on the device: graphs read them at these addresses), the
  staging buffer of graph prefills and mixed steps, the hidden-state buffers, a copy of the rotary frequencies, the
  KV cache, the step graphs (:class:`~.graphs.StepGraphs`, keyed by the plan's graph key), and the device-side
  bookkeeping: slots started by a prefill, advanced by a decode step, released, moved;
- the forwards (:class:`~.stage_forwards.StageForwards`: decode, mixed, graph prefill, idle, each graph-capturable;
  dense or fused decoder, MoE layers);
- the steps themselves: the eager prefill, capture and replay of the graphs, and sampling on the last stage;
- the pipeline exchange (:mod:`megatron_hybrid.reshard.communication`): hidden states travel stage to stage with
  send/recv on the pipeline group; the last stage samples and broadcasts each step's tokens to the others (one ``[B]``
  int64 broadcast per step).

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
from typing import Any, Callable, ContextManager, Optional

import torch

import torch.distributed as dist

from ..groups import RolloutGroups
from ..memory import PerCallRolloutMemory, RolloutMemoryProvider
from ..reshard import broadcast_from_last, pipeline_peers, recv_from_previous, send_to_next
from .attention import install_kv_attention
from .config import GenerationConfig
from .context import KVStep, stage_context
from .fused import install_fused_decoder
from .graphs import StepGraphs
from .kv_cache import CacheGeometry
from .moe import install_step_moe, moe_layer_ordinals, sequential_experts
from .norms import install_step_norms
from .planner import MIXED_PROMPTS, MIXED_TOKENS, PlannerSettings, StepPlan, batch_sizes
from .sampling import draw_noise, is_greedy, sample
from .stage_buffers import StageBuffers, routing_dtype
from .stage_forwards import StageForwards


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


def _of_buffers(name: str) -> property:
    """The runner's read-only name for its buffers' ``name``."""
    return property(lambda self: getattr(self.buffers, name), doc=f"The buffers' ``{name}``.")


class StageRunner:
    """Runs the steps of generation on ``chunk`` (this rank's GPTModel stage) over ``tp_group`` and ``pp_group``.

    Its self-attention modules become :class:`~.attention.KVCacheSelfAttention` (and its RMSNorms
    :class:`~.norms.StepRMSNorm` on a GPU with Triton), unchanged outside a step. Its fixed-address state,
    ``buffers`` (:class:`~.stage_buffers.StageBuffers`), is made at the first call (:meth:`allocate`) and kept at its
    addresses for the runner's life; its forwards are ``forwards`` (:class:`~.stage_forwards.StageForwards`).

    Args:
        chunk: a megatron-core GPTModel stage.
        tp_group, pp_group: the replica's groups.
        config: cache and decode settings.
        memory: where the KV cache, the sampling draws and the graphs' pool are reserved: the engine's provider
            (backed from its switch to rollout to its switch back), or None: a :class:`PerCallRolloutMemory`
            (backed for each generate call).
        groups: the engine's rollout groups, whose error context names a failed or timed-out exchange, or None.
    """

    # The fixed-address state and its bookkeeping (:attr:`buffers`), read by the generator, tests and tools by the
    # runner's names.
    cache = _of_buffers("cache")
    graphs = _of_buffers("graphs")
    noise = _of_buffers("noise")
    routing = _of_buffers("routing")
    slot_tokens = _of_buffers("slot_tokens")
    slot_positions = _of_buffers("slot_positions")
    slot_running = _of_buffers("slot_running")
    staging = _of_buffers("staging")
    stage_prefill = _of_buffers("stage_prefill")
    stage_mixed = _of_buffers("stage_mixed")
    move_slots = _of_buffers("move_slots")
    release = _of_buffers("release")

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
        routing = ((len(self.moe), cfg.moe_router_topk, routing_dtype(cfg.num_moe_experts))
                   if self.records_routing and self.moe else None)
        self.buffers = StageBuffers(device=self.device, memory=self.memory, config=config,
                                    hidden_size=self.hidden_size, hidden_dtype=self.hidden_dtype,
                                    receives=self.prev_rank is not None, rotary=self.rotary,
                                    mixed_prompts=self.mixed_prompts, mixed_tokens=self.mixed_tokens, routing=routing,
                                    draws_vocab=int(chunk.vocab_size) if self.is_last else None)
        self.forwards = StageForwards(chunk, context=self.context, fused=self.fused, moe=self.moe, tp_group=tp_group,
                                      buffers=self.buffers, rotary=self.rotary, reads_lengths=self.reads_lengths)
        self._sampling: Optional[_Sampling] = None  # the call's

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

    # -- rollout memory: the buffers' reservations (made and dropped by StageBuffers), and backing ---------------

    def allocate(self) -> None:
        """Make the fixed-address state (once, at the first call)."""
        self.buffers.allocate(self.geometry, new_graphs=self._new_graphs if self.use_graphs else None)

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
        """Drop the graphs (and their reserved pool), the cache's own reservation, the sampling draws' and the
        routing record's."""
        self.buffers.close()

    # -- a call ------------------------------------------------------------------------------------------------

    def plan_settings(self, *, compact: bool) -> PlannerSettings:
        """What the planner plans within: this runner's slots, buffers and graphs (after :meth:`allocate`)."""
        g, cfg, b = self.geometry, self.config, self.buffers
        return PlannerSettings(num_slots=g.num_slots, slot_tokens=g.slot_tokens, prefill_tokens=cfg.prefill_tokens,
                               batch_sizes=batch_sizes(g.num_slots, cfg.graph_batch_sizes),
                               graphs=b.graphs is not None, length_granule=cfg.graph_length_granule,
                               reads_lengths=self.reads_lengths, prefill_granule=cfg.prefill_graph_granule,
                               prefill_rows=b.prefill_rows, prefill_graph_tokens=2 * b.prefill_tokens,
                               mixed_prompts=self.mixed_prompts, mixed_tokens=self.mixed_tokens, compact=compact)

    def begin(self, params, *, vocab_size: int, tempered_log_probs: bool, seed: int) -> tuple:
        """Start a call sampling with ``params`` over ``vocab_size`` ids from a stream seeded ``seed``: every slot
        idle, the model's rotary state copied (after :meth:`allocate`). Returns the sampling signature that names
        the call's graphs."""
        self.buffers.begin()
        generator = torch.Generator(device=self.device).manual_seed(seed)
        self._sampling = _Sampling(params, vocab_size, tempered_log_probs, generator)
        return self.buffers.signature(params, vocab_size, tempered_log_probs)

    def end(self) -> None:
        """The call is over (its sampling stream goes)."""
        self._sampling = None

    def run(self, plan: StepPlan) -> StepOutput:
        """Run the step ``plan`` on this stage."""
        self.forwards.moe_rows = plan.moe_rows
        if plan.kind == "idle":
            return self._idle(plan)
        if plan.kind == "decode":
            tokens, log_probs = self._decode(plan)
        elif plan.kind == "prefill":
            tokens, log_probs = self._prefill(plan)
        else:
            tokens, log_probs = self._mixed(plan)
        return StepOutput(tokens, log_probs, len(plan.owners))

    def take_routing(self, slot: int, positions: int) -> torch.Tensor:
        """A copy of the first ``positions`` rows of ``slot``'s routing record, ``[positions, M, k]`` (the stage's
        MoE layers): taken before the slot is released (queued behind the steps that wrote it)."""
        planes = self.buffers.routing_planes
        if not planes:  # a stage without MoE layers
            return torch.zeros(positions, 0, self.chunk.config.moe_router_topk, dtype=torch.int16,
                               device=self.device)
        return torch.stack([plane[slot, :positions] for plane in planes], dim=1)

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
        return full.to(device="cpu", dtype=routing_dtype(self.chunk.config.num_moe_experts))

    def share(self, tensor: Optional[torch.Tensor], numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The last stage's ``tensor`` (``numel`` of ``dtype``) on every stage."""
        if self.pp_group.size() == 1:
            return tensor
        if tensor is None:
            tensor = torch.empty(numel, dtype=dtype, device=self.device)
        return broadcast_from_last(tensor, self.pp_group, src=self.last_rank,
                                   errors=self._errors(f"the broadcast of sampled tokens from rank {self.last_rank}"))

    # -- graph steps: the forward and, on the last stage, the sampling -----------------------------------------

    def _sampled(self, logits_nV: torch.Tensor, params, vocab: int, tempered: bool) -> tuple[torch.Tensor, ...]:
        noise = None if is_greedy(params) else self.buffers.draws(logits_nV.shape[0], vocab)
        tokens, logp = sample(logits_nV, params, vocab_size=vocab, noise_nV=noise, tempered_log_probs=tempered)
        return logits_nV, tokens, logp

    def _replay(self, key: tuple) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Run graph ``key`` (its draws made first); returns its tokens and a copy of its log-probs on the last
        stage (the graph's outputs are overwritten by the next replay), ``(None, None)`` on the others after
        sending the hidden states on."""
        kind, rows, _, sig = key[:4]
        rows += self.mixed_prompts if kind == "mixed" else 0  # sampled rows
        params, vocab, _ = self.buffers.signatures[sig]
        if self.is_last and not is_greedy(params):
            draw_noise(self.buffers.draws(rows, vocab), params, self._sampling.generator)
        out = self.buffers.graphs.run(key, self.graph_step(key))
        if not self.is_last:
            self._send(out[0])
            return None, None
        return out[1], out[2].clone()

    def graph_step(self, key: tuple) -> Callable[[], tuple[torch.Tensor, ...]]:
        """The capturable step of graph ``key``: ``(logits, tokens, log_probs)`` on the last stage, ``(hidden,)``
        on the others."""
        kind, rows, length, sig = key[:4]
        params, vocab, tempered = self.buffers.signatures[sig]
        forwards, buffers = self.forwards, self.buffers
        if kind == "decode":
            forward = functools.partial(forwards.decode, rows, length)
        elif kind == "mixed":  # rows: the decode batch; length: the prompt tokens riding along
            hidden = buffers.prefill_hidden[: rows + length] if buffers.prefill_hidden is not None else None
            forward = functools.partial(forwards.mixed, rows, length, self.mixed_prompts, buffers.staging, hidden,
                                        self.geometry.slot_tokens)
        else:
            forward = functools.partial(forwards.prefill, rows, length)
        if not self.is_last:
            return lambda: (forward(),)
        return lambda: self._sampled(forward(), params, vocab, tempered)

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

    # -- the steps ---------------------------------------------------------------------------------------------

    def _prefill(self, plan: StepPlan) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Whole prompts into their slots; returns each row's first token (every stage) and its log-prob (the last
        stage); padded rows of a graph prefill come after the prompts'."""
        prompts, slots = list(plan.prompts), list(plan.slots)
        if plan.graph_key is not None:
            picked, logp = self._graph_prefill(plan.graph_key, prompts, slots)
        else:
            picked, logp = self._eager_prefill(prompts, slots)
        b = self.buffers
        b.start(b.to_device(slots), picked[: len(prompts)], b.to_device([len(p) for p in prompts]))
        return picked, logp

    def _graph_prefill(self, key: tuple, prompts: list[list[int]], slots: list[int]):
        _, rows, length, _ = key[:4]
        T = rows * length
        b = self.buffers
        b.stage_prefill(rows, length, prompts, slots)
        self._receive(b.prefill_hidden[:T] if b.prefill_hidden is not None else None, T)
        picked, logp = self._replay(key)
        picked = self.share(picked, rows, torch.long)
        return picked, logp

    def _eager_prefill(self, prompts: list[list[int]], slots: list[int]):
        b, lengths = self.buffers, [len(p) for p in prompts]
        tokens = b.to_device([t for p in prompts for t in p])
        positions = b.to_device([i for n in lengths for i in range(n)])
        where = b.to_device([s for s, n in zip(slots, lengths) for _ in range(n)])
        starts = [0, *itertools.accumulate(lengths)][:-1]
        by_length: dict[int, list[int]] = {}
        for start, n in zip(starts, lengths):
            by_length.setdefault(n, []).extend(range(start, start + n))
        step = KVStep(b.cache.keys, b.cache.values, slots_T=where, positions_T=positions,
                      rotary_T11D=self.forwards.rotary(positions), decode=False,
                      prompts=[(n, b.to_device(index)) for n, index in by_length.items()])
        last = b.to_device([s + n - 1 for s, n in zip(starts, lengths)])
        out = self.forwards.forward(tokens, self._receive(None, len(tokens)), step, last)
        picked, logp = self._sample_or_send(out)
        picked = self.share(picked, len(prompts), torch.long)
        return picked, logp

    def _idle(self, plan: StepPlan) -> StepOutput:
        """This replica has no step while others of its expert-parallel group do: only the MoE layers' collectives
        (and local experts), over the agreed rows; nothing is sampled."""
        if plan.graph_key is not None:
            self.buffers.graphs.run(plan.graph_key, functools.partial(self.forwards.idle, plan.moe_rows))
        else:
            self.forwards.idle(plan.moe_rows)
        return StepOutput(torch.zeros(0, dtype=torch.long, device=self.device), None, 0)

    def _decode(self, plan: StepPlan) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One token for each of the slots ``0 .. batch-1``; returns the tokens (every stage), log-probs (last)."""
        batch, b = plan.batch, self.buffers
        self._receive(b.hidden_in[:batch] if b.hidden_in is not None else None, batch)
        if plan.graph_key is not None:
            picked, logp = self._replay(plan.graph_key)
        else:
            picked, logp = self._sample_or_send(self.forwards.decode(batch, plan.attended))
        picked = self.share(picked, batch, torch.long)
        b.advance(batch, picked)
        return picked, logp

    def _mixed(self, plan: StepPlan) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """A decode step over slots ``0 .. batch-1`` with the plan's prompts riding along into their slots.
        Returns the tokens (every stage: the decode rows', then one per prompt row) and the log-probs (last
        stage)."""
        batch, chunk, rows, prompts = plan.batch, plan.length, plan.rows, plan.prompts
        b = self.buffers
        if plan.graph_key is not None:
            values = b.stage_mixed(chunk, rows, prompts, plan.slots, plan.starts)
            staged = b.staging
            staged[: len(values)].copy_(b.to_device(values))
            self._receive(b.prefill_hidden[: batch + chunk] if b.prefill_hidden is not None else None,
                          batch + chunk)
            picked, logp = self._replay(plan.graph_key)
        else:
            staged = b.to_device(b.stage_mixed(chunk, rows, prompts, plan.slots, plan.starts))
            out = self.forwards.mixed(batch, chunk, rows, staged, self._receive(None, batch + chunk), plan.attended)
            picked, logp = self._sample_or_send(out)
        picked = self.share(picked, batch + rows, torch.long)
        b.advance(batch, picked)
        k, at = len(prompts), 3 * chunk + rows
        b.start(staged[at: at + k], picked[batch: batch + k], staged[at + k: at + 2 * k])
        return picked, logp
