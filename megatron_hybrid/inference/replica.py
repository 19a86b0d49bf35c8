"""Generation on one model replica (its tensor- and pipeline-parallel groups): prefill, then decode steps.

Every rank of the replica runs the same schedule (:class:`~.scheduler.SlotScheduler`) on the same prompts: the
last pipeline stage samples, broadcasts each step's tokens to the other stages (one ``[B]`` int64 broadcast per
step), and every rank reads them to the host, the one host round trip per step that stop detection needs. Inputs of
the next step (each slot's token and position) are updated on the device. Hidden states travel stage to stage with
send/recv on the pipeline group, as in :mod:`megatron_hybrid.forward`.

A step drives the GPTModel stage's own modules (embedding, decoder, output layer) rather than its ``forward``: a
prefill then computes logits only at each prompt's last token, and megatron-core's inference-context code paths
(global groups, one offset per batch) stay out of the way.

Legend: T packed tokens, B decode slots, H hidden, V vocabulary (padded).
"""

from __future__ import annotations

import itertools
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..forward import gather_vocab
from .attention import KVStep, install_kv_attention
from .config import GenerationConfig
from .graphs import DecodeGraphs
from .kv_cache import CacheGeometry, KVCache
from .sampling import sample
from .scheduler import SlotScheduler
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


class ReplicaGenerator:
    """KV-cache generation with one model replica: ``chunk`` (this rank's GPTModel stage) on ``tp_group`` and
    ``pp_group``. Called by every rank of the replica with the same, already checked prompts.

    Args:
        chunk: a megatron-core GPTModel stage; its self-attention modules become
            :class:`~.attention.KVCacheSelfAttention` (unchanged behaviour outside a generation step).
        tp_group, pp_group: the replica's groups.
        config: cache and decode settings.
        engine: the HybridEngine whose rollout phases back the KV cache, or None (the cache backs itself during
            each call).
    """

    def __init__(self, chunk: torch.nn.Module, *, tp_group, pp_group, config: GenerationConfig,
                 engine: Optional[Any] = None) -> None:
        self.chunk, self.tp_group, self.pp_group = chunk, tp_group, pp_group
        self.config, self.engine = config, engine
        kind = getattr(chunk, "position_embedding_type", "rope")
        if kind not in ("rope", "learned_absolute", "none"):
            raise ValueError(f"KV-cache generation supports position_embedding_type rope, learned_absolute or none; "
                             f"the model has {kind!r}")
        self.attention = install_kv_attention(chunk)
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
        self.geometry = self._geometry(chunk)
        self.limits = Limits(padded_vocab=int(chunk.vocab_size), slot_tokens=self.geometry.slot_tokens)
        self.rotary = chunk.rotary_pos_emb if kind == "rope" else None
        on_gpu = self.device.type == "cuda"
        if config.cuda_graphs and not on_gpu:
            raise ValueError(f"GenerationConfig.cuda_graphs=True needs a model on a GPU; it is on {self.device}")
        self.use_graphs = on_gpu if config.cuda_graphs is None else config.cuda_graphs
        self.cache: Optional[KVCache] = None
        self.graphs: Optional[DecodeGraphs] = None
        self.stats = {"prefill_forwards": 0, "decode_steps": 0, "idle_slot_steps": 0, "max_active_slots": 0,
                      "calls": 0}

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
                             kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)

    # -- fixed-address state (made once, at the first call) ------------------------------------------------

    def _ensure_state(self) -> None:
        if self.cache is not None:
            return
        g, dev = self.geometry, self.device
        self.cache = KVCache(g, dev, engine=self.engine)
        # Each slot's next input token and its position, and whether it runs: the decode step's inputs, updated
        # in place on the device (decode graphs read them at these addresses).
        self.slot_tokens = torch.zeros(g.num_slots, dtype=torch.long, device=dev)
        self.slot_positions = torch.zeros(g.num_slots, dtype=torch.long, device=dev)
        self.slot_running = torch.zeros(g.num_slots, dtype=torch.long, device=dev)
        self.slot_index = torch.arange(g.num_slots, device=dev)
        self.position_index = torch.arange(g.slot_tokens, device=dev)
        self.hidden_in = (torch.zeros(g.num_slots, 1, self.hidden_size, dtype=self.hidden_dtype, device=dev)
                          if self.prev_rank is not None else None)
        self.inv_freq = self.rotary.inv_freq.to(dev).clone() if self.rotary is not None else None
        if self.use_graphs:
            sizes = self.config.graph_batch_sizes or [2**i for i in range(g.num_slots.bit_length())]
            sizes = sorted({min(b, g.num_slots) for b in sizes} | {g.num_slots})
            self.graphs = DecodeGraphs(sizes, length_granule=self.config.graph_length_granule,
                                       max_length=g.slot_tokens, device=dev,
                                       pool_bytes=int(self.config.graph_pool_gib * 2**30))

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
        step = KVStep(self.cache.keys, self.cache.values, slots_T=self.slot_index[:batch], positions_T=positions,
                      rotary_T11D=self._rotary(positions), decode=True, attended=attended,
                      mask_B11L=(self.position_index[:attended] <= positions.unsqueeze(-1))[:, None, None, :])
        hidden = self.hidden_in[:batch] if self.hidden_in is not None else None
        return self._forward(self.slot_tokens[:batch], hidden, step, None)

    # -- pipeline communication ------------------------------------------------------------------------------

    def _receive(self, out: Optional[torch.Tensor], num_tokens: int) -> Optional[torch.Tensor]:
        if self.prev_rank is None:
            return None
        if out is None:
            out = torch.empty(num_tokens, 1, self.hidden_size, dtype=self.hidden_dtype, device=self.device)
        dist.recv(out, src=self.prev_rank, group=self.pp_group)
        return out

    def _send(self, hidden_T1H: torch.Tensor) -> None:
        dist.send(hidden_T1H.contiguous(), dst=self.next_rank, group=self.pp_group)

    def _share(self, tensor: Optional[torch.Tensor], numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The last stage's ``tensor`` on every stage."""
        if self.pp_group.size() == 1:
            return tensor
        if tensor is None:
            tensor = torch.empty(numel, dtype=dtype, device=self.device)
        dist.broadcast(tensor, src=self.last_rank, group=self.pp_group)
        return tensor

    # -- the steps -------------------------------------------------------------------------------------------

    def _prefill(self, prompts: list[list[int]], slots: list[int],
                 sampler) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Run whole prompts into ``slots``; returns each one's first token (every stage) and its log-prob (the
        last stage)."""
        lengths = [len(p) for p in prompts]
        dev = self.device
        tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=dev)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(dev)
        where = torch.repeat_interleave(torch.tensor(slots), torch.tensor(lengths)).to(dev)
        starts = [0, *itertools.accumulate(lengths)][:-1]
        by_length: dict[int, list[int]] = {}
        for start, n in zip(starts, lengths):
            by_length.setdefault(n, []).extend(range(start, start + n))
        step = KVStep(self.cache.keys, self.cache.values, slots_T=where, positions_T=positions,
                      rotary_T11D=self._rotary(positions), decode=False,
                      prompts=[(n, torch.tensor(index, device=dev)) for n, index in by_length.items()])
        last = torch.tensor([s + n - 1 for s, n in zip(starts, lengths)], device=dev)
        out = self._forward(tokens, self._receive(None, len(tokens)), step, last)
        self.stats["prefill_forwards"] += 1
        picked = logp = None
        if self.is_last:
            picked, logp = sampler(out)
        else:
            self._send(out)
        picked = self._share(picked, len(prompts), torch.long)
        index = torch.tensor(slots, device=dev)
        self.slot_tokens[index] = picked
        self.slot_positions[index] = torch.tensor(lengths, device=dev)
        self.slot_running[index] = 1
        return picked, logp

    def _decode(self, batch: int, attended: int, sampler) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One token for each of the slots ``0 .. batch-1``; returns the tokens (every stage), log-probs (last)."""
        if self.graphs is not None:
            batch, attended = self.graphs.bucket(batch, attended)
        self._receive(self.hidden_in[:batch] if self.hidden_in is not None else None, batch)
        if self.graphs is not None:
            out = self.graphs.run((batch, attended), lambda: self._decode_forward(batch, attended))
        else:
            out = self._decode_forward(batch, attended)
        picked = logp = None
        if self.is_last:
            picked, logp = sampler(out)
        else:
            self._send(out)
        picked = self._share(picked, batch, torch.long)
        self.slot_tokens[:batch] = picked
        self.slot_positions[:batch] += self.slot_running[:batch]
        return picked, logp

    def _release(self, slots: list[int]) -> None:
        index = torch.tensor(slots, device=self.device)
        self.slot_running[index] = 0
        self.slot_positions[index] = 0  # an idle slot keeps writing (garbage) at a valid position: 0

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
        generator = torch.Generator(device=self.device).manual_seed(seed)

        def sampler(logits_nV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return sample(logits_nV, params, vocab_size=vocab_size, generator=generator,
                          tempered_log_probs=tempered_log_probs)

        sched = SlotScheduler(len(prompts), self.geometry.num_slots)
        # Per step, which sequence each sampled row belongs to (None: an idle slot), and the last stage's log-probs.
        rows: list[list[Optional[int]]] = []
        log_probs: list[torch.Tensor] = []

        def record(tokens: list[int], owners: list[Optional[int]]) -> list[int]:
            done = []
            for tok, seq in zip(tokens, owners):
                if seq is None:
                    continue
                out = results[seq].generated_tokens
                out.append(tok)
                if tok in stops or len(out) == limit:
                    done.append(seq)
            return done

        was_training = self.chunk.training
        self.chunk.eval()
        try:
            graph_memory = self.graphs.backed() if self.graphs is not None else nullcontext()
            with torch.no_grad(), self.cache.backed(), graph_memory:
                while not sched.done:
                    admitted = sched.admit()
                    while admitted:  # a prompt whose first token ends it frees its slot for the next at once
                        for group in self._prefill_groups(admitted, prompts):
                            seqs, slots = [s for s, _ in group], [slot for _, slot in group]
                            picked, logp = self._prefill([prompts[s] for s in seqs], slots, sampler)
                            rows.append(seqs)
                            log_probs.append(logp)
                            finished = record(picked.tolist(), seqs)
                            if finished:
                                self._release([sched.finish(s) for s in finished])
                        admitted = sched.admit()
                    batch = sched.decode_batch()
                    if batch == 0:
                        continue
                    owners: list[Optional[int]] = [None] * batch
                    attended = 0
                    for slot, seq in sched.active():
                        owners[slot] = seq
                        attended = max(attended, len(prompts[seq]) + len(results[seq].generated_tokens))
                    picked, logp = self._decode(batch, attended, sampler)
                    owners += [None] * (len(picked) - batch)  # slots a graph bucket adds
                    rows.append(owners)
                    log_probs.append(logp)
                    finished = record(picked.tolist(), owners)
                    if finished:
                        self._release([sched.finish(s) for s in finished])
                self._collect_log_probs(results, rows, log_probs, tempered=tempered_log_probs)
        finally:
            self.chunk.train(was_training)
        for key in ("decode_steps", "idle_slot_steps"):
            self.stats[key] += getattr(sched, key)
        self.stats["max_active_slots"] = max(self.stats["max_active_slots"], sched.max_active)
        self.stats["calls"] += 1
        if self.device.type == "cuda" and self.config.release_memory:
            torch.cuda.empty_cache()
        return results

    def _prefill_groups(self, admitted: list[tuple[int, int]], prompts) -> list[list[tuple[int, int]]]:
        """``admitted`` cut into prefill forwards of at most ``prefill_tokens`` prompt tokens (a longer prompt
        alone)."""
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
        return out

    def close(self) -> None:
        """Drop the graphs (and their reserved pool) and the cache's own reservation."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        if self.cache is not None:
            self.cache.close()
            self.cache = None
