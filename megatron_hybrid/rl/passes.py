"""Passes over a rollout batch on Megatron's training layout, through its forward/backward schedule (1F1B).

A :class:`Batch` is one rank's sequences (prompt + response); the passes compute, on the last pipeline stage, the
policy's log-probabilities and entropies of the response tokens, a value model's values of them, or a reward
model's score at each sequence's last token. The same schedule runs the training passes of
:func:`megatron_hybrid.rl.optimizer.update`.

Legend: B sequences, S sequence length, N response tokens (``max_new_tokens``, right-padded), V_t this rank's
tensor-parallel shard of the (padded) vocabulary.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from ..megatron import megatron_groups
from ..reshard import agree_max
from . import ppo
from .batch import Batch, make_batch  # noqa: F401  (make_batch: the passes' batch, re-exported)
from .packing import first_fit_decreasing, in_batch_order, packed_micro_batches, sequence_lengths, split_to
from .phases import recorded
from .routing import TrainingRouting, moe_routers, replays_routing

#: ``loss_fn(output, micro_batch) -> (loss, stats)``: the loss of one micro-batch as the mean over its response
#: tokens (``micro_batch["mask"]``). ``output`` is the last stage's output (``[B, S, V_t]`` logits, or ``[B, S, 1]``
#: values); ``stats`` are detached tensors. :meth:`TrainingPasses.run` weighs each micro-batch by its tokens, so a
#: training step's objective is the mean over every response token of the step (verl's ``token-mean``), however the
#: sequences are grouped into micro-batches and data-parallel ranks.
LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]


def padded_seq_length(num_tokens: int, *, sequence_parallel: bool) -> int:
    """The sequence length of the passes for sequences of up to ``num_tokens`` (longest prompt + max new tokens):
    with sequence parallelism a multiple of the tensor-parallel size, as Megatron splits the sequence into equal
    slices (the padding comes after every sequence's end, so causal attention never reads it)."""
    multiple = megatron_groups()[0].size() if sequence_parallel else 1
    return -(-num_tokens // multiple) * multiple


def _weighed(loss: torch.Tensor, stats: dict, weight: torch.Tensor | float) -> tuple[torch.Tensor, dict]:
    """A micro-batch's token-mean ``loss`` times its weight in the step (:meth:`TrainingPasses.run`). (A new
    tensor: the schedule divides it in place, and a stat that is the loss itself, ``loss.detach()``, keeps its
    value.)"""
    return loss * weight, stats


def token_mean(stats: list[dict[str, torch.Tensor]], tokens: list[int], key: str) -> float:
    """``stats[i][key]`` (micro-batch i's mean over its ``tokens[i]`` response tokens) as the mean over all of them:
    what a step's objective weighs them by (:data:`LossFn`)."""
    total = sum(tokens)
    if total == 0:
        return float(torch.stack([s[key] for s in stats]).float().mean()) if stats else 0.0
    return sum(float(s[key]) * n for s, n in zip(stats, tokens)) / total


def _positions_like(tokens_BS: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens_BS.shape[1], device=tokens_BS.device).unsqueeze(0).expand_as(tokens_BS)


@dataclass(frozen=True)
class PassConfig:
    """What every pass over a rollout batch needs."""

    seq_length: int
    """Tokens per sequence (longest prompt + ``max_new_tokens``; :func:`padded_seq_length`)."""
    micro_batch_size: int
    """Sequences per micro-batch (``--micro-batch-size``)."""
    vocab_size: int
    """The tokenizer's vocabulary; the padded rows above it get no probability."""
    temperature: float = 1.0
    """The sampling temperature: log-probabilities are of softmax(logits / temperature)."""
    max_tokens_per_micro_batch: Optional[int] = None
    """Pack sequences without padding into micro-batches of at most this many tokens (:mod:`.packing`; a core
    attention that takes packed sequences: ``--attention-backend`` sdpa, flex or auto); at TP > 1 a pack is padded
    to a multiple of TP, at PP > 1 every pack to the budget so rounded. None: ``micro_batch_size`` sequences padded
    to ``seq_length``."""
    logit_chunk_tokens: int = 1024
    """Packed passes compute the log-probs and entropies over the vocabulary this many response positions at a
    time (recomputed in the backward pass), so their fp32 temporaries stay at a chunk's, not a pack's."""


class TrainingPasses:
    """Forward(-backward) passes over batches on Megatron's training groups (read once, here).

    Results live on the last pipeline stage; the other stages get ``None`` (except :meth:`scores`).
    """

    def __init__(self, config: PassConfig) -> None:
        self.config = config
        self.tp_group, self.pp_group, _, _ = megatron_groups()
        capacity = config.max_tokens_per_micro_batch
        # Packs are padded to a multiple of TP (sequence parallelism slices them evenly) and, across pipeline
        # stages, to one length: the budget so rounded (the stages' sends keep one shape).
        self.pack_multiple = self.tp_group.size()
        self.pack_fixed = None if capacity is None or self.pp_group.size() == 1 else \
            -(-capacity // self.pack_multiple) * self.pack_multiple
        self.last_stage = self.pp_group.rank() == self.pp_group.size() - 1
        self._measured: Optional[tuple[torch.nn.Module, TrainingRouting]] = None

    def _routing(self, model: torch.nn.Module, batch: Batch) -> Optional[TrainingRouting]:
        """The routing of a pass of ``model`` over ``batch``: replayed where the model's routers replay (built with
        ``moe_enable_routing_replay``), counted where :meth:`routing_metrics` measures this model."""
        if self._measured is not None and self._measured[0] is model:
            return self._measured[1]
        replay = replays_routing(model)
        if replay and "routed_experts" not in batch.data:
            raise ValueError("the model replays routing (moe_enable_routing_replay) but the batch has no routing "
                             "record: generate with GenerationConfig(record_routing=True) and pass "
                             "make_batch(routed_experts=)")
        if not replay:
            return None
        return TrainingRouting(model, batch.data["routed_experts"], tp_group=self.tp_group, pp_group=self.pp_group,
                               replay=True)

    @contextmanager
    def routing_metrics(self, model: torch.nn.Module, batch: Batch) -> Iterator[Callable[[], dict[str, float]]]:
        """Count, in the passes of ``model`` over ``batch`` in the body, the tokens routed differently from the
        rollout's record (:meth:`~.routing.TrainingRouting.metrics`). Yields a function that returns the counts
        after the body, to be called on every rank of the model's tensor- and pipeline-parallel groups; ``{}``
        for a batch without a record or a model without MoE layers."""
        if "routed_experts" not in batch.data or not moe_routers(model):
            yield lambda: {}
            return
        routing = TrainingRouting(model, batch.data["routed_experts"], tp_group=self.tp_group,
                                  pp_group=self.pp_group, replay=replays_routing(model))
        self._measured = (model, routing)
        try:
            yield routing.metrics
        finally:
            self._measured = None

    def micro_batches(self, batch: Batch) -> list[dict[str, torch.Tensor]]:
        """The micro-batches the schedule runs over ``batch``: packed (:mod:`.packing`) or padded (what counts them,
        e.g. the MoE losses' mean, asks here)."""
        capacity = self.config.max_tokens_per_micro_batch
        if capacity is None:
            return batch.micro_batches(self.config.micro_batch_size)
        lengths = sequence_lengths(batch)
        groups = first_fit_decreasing(lengths, capacity)
        _, _, dp_group, _ = megatron_groups()
        if dp_group.size() > 1:  # the same number on every DP rank (a collective: every rank packs its batch)
            groups = split_to(groups, lengths, agree_max([len(groups)], dp_group)[0])
        return packed_micro_batches(batch, capacity, groups, multiple=self.pack_multiple, fixed=self.pack_fixed)

    def run(self, model: torch.nn.Module, batch: Batch, loss_fn: LossFn, *, forward_only: bool,
            micro_batches: Optional[list[dict[str, torch.Tensor]]] = None) -> list[dict]:
        """Megatron's forward/backward schedule over ``batch``'s micro-batches; returns the per-micro-batch
        ``stats`` of ``loss_fn`` (last stage; ``[]`` elsewhere). Gradients, when not ``forward_only``, accumulate
        in DDP's buffers: of the mean of the losses over every response token of the micro-batches and the DP
        replicas (:data:`LossFn`, :meth:`_weights`). A model built with ``moe_enable_routing_replay`` routes the
        batch's tokens as its routing record says."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if micro_batches is None:
            micro_batches = self.micro_batches(batch)
        weights = [1.0] * len(micro_batches) if forward_only else self._weights(batch, micro_batches)
        routing = self._routing(model, batch)
        seq_length, micro_batch_size = self.config.seq_length, self.config.micro_batch_size
        if micro_batches and "cu_seqlens" in micro_batches[0]:
            _check_takes_packed_sequences(model)
            # The pipeline's send shape: every pack's (one length across stages), one "sequence" of T tokens.
            seq_length, micro_batch_size = micro_batches[0]["tokens"].shape[1], 1

        def forward_step(data_iterator, model):
            i, mb = next(data_iterator)
            with routing.micro_batch(mb) if routing is not None else nullcontext():
                if "cu_seqlens" in mb:
                    out = model(mb["tokens"], mb["positions"], None, packed_seq_params=_packed_seq_params(mb))
                else:
                    out = model(mb["tokens"], _positions_like(mb["tokens"]), None)
            return out, lambda output: _weighed(*loss_fn(output, mb), weights[i])

        with routing if routing is not None else nullcontext():
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(enumerate(micro_batches)), model=[model],
                num_microbatches=len(micro_batches), seq_length=seq_length, micro_batch_size=micro_batch_size,
                forward_only=forward_only)

    def _weights(self, batch: Batch, micro_batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each micro-batch's weight in a training step, the loss of which is the mean over every response token of
        the step (one all-reduce of the token count over data parallelism). Megatron's schedule divides each
        micro-batch's loss by this rank's number of micro-batches M and DDP averages the gradients over the D
        replicas, as for any Megatron loss (MoE auxiliary losses included); weighing micro-batch i's token mean by
        n_i · M · D / N (n_i its response tokens, N the step's) makes the sum over the step Σ n_i · mean_i / N.
        (megatron-core's own per-token loss, ``calculate_per_token_loss``, divides by the tokens counted in the
        loss, but scales the MoE auxiliary losses by every token of the micro-batch, prompts and padding
        included: their coefficient would then depend on the prompt length.)"""
        _, _, dp_group, _ = megatron_groups()
        total = batch.mask_BN.sum().reshape(1).double()
        if dp_group.size() > 1:
            dist.all_reduce(total, group=dp_group)
        if float(total) == 0:
            return [torch.zeros((), device=batch.mask_BN.device)] * len(micro_batches)
        scale = len(micro_batches) * dp_group.size() / float(total)
        return [mb["mask"].sum() * scale for mb in micro_batches]

    def token_stats(self, logits_BSVt: torch.Tensor, micro_batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies of the response tokens, ``[b, N]`` (differentiable), from vocabulary-parallel
        logits at the sampling temperature. A packed micro-batch's (``[1, T, V_t]`` logits) are computed at the
        response positions alone, :attr:`PassConfig.logit_chunk_tokens` at a time."""
        labels = torch.roll(micro_batch["tokens"], -1, dims=1)
        V_t = logits_BSVt.shape[-1]

        def stats(logits, labels_):
            return ppo.vocab_parallel_logprobs_entropy(
                logits, labels_, tp_group=self.tp_group, vocab_start=self.tp_group.rank() * V_t,
                vocab_size=self.config.vocab_size, temperature=self.config.temperature)

        if "cu_seqlens" in micro_batch:
            return _chunked(stats, logits_BSVt[0], labels[0], micro_batch["index"], micro_batch["mask"],
                            chunk=self.config.logit_chunk_tokens)
        logp, ent = stats(logits_BSVt, labels)
        return logp.gather(1, micro_batch["index"]), ent.gather(1, micro_batch["index"])

    def _forward(self, model: torch.nn.Module, batch: Batch, stats_fn) -> dict[str, torch.Tensor]:
        """``stats_fn``'s ``[n, ...]`` tensors of every micro-batch, in the batch's order (``{}`` off the last
        stage)."""
        def loss_fn(output, mb):
            stats = stats_fn(output, mb)
            return torch.zeros((), device=output.device), {k: v.detach() for k, v in stats.items()}

        micro_batches = self.micro_batches(batch)
        with torch.no_grad():
            out = self.run(model, batch, loss_fn, forward_only=True, micro_batches=micro_batches)
        if not out:
            return {}
        if "rows" in micro_batches[0]:
            return {k: in_batch_order([o[k] for o in out], micro_batches, batch.tokens_BS.shape[0]) for k in out[0]}
        return {k: torch.cat([o[k] for o in out]) for k in out[0]}

    @recorded("log-probs")
    def log_probs(self, model: torch.nn.Module, batch: Batch) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The policy's ``(log_probs_BN, entropy_BN)`` of the response tokens; ``None`` off the last stage."""
        def stats(output, mb):
            logp, ent = self.token_stats(output, mb)
            return {"logp": logp, "entropy": ent}

        out = self._forward(model, batch, stats)
        return (out["logp"], out["entropy"]) if self.last_stage else None

    @recorded("values")
    def values(self, model: torch.nn.Module, batch: Batch) -> Optional[torch.Tensor]:
        """A value model's values at the response tokens, ``[B, N]`` fp32; ``None`` off the last stage."""
        out = self._forward(model, batch, lambda output, mb: {"values": response_values(output, mb)})
        return out["values"] if self.last_stage else None

    @recorded("reward model")
    def scores(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """A reward model's score of each sequence (its value at the last real token), ``[B]`` fp32 on the CPU,
        on every rank (the last stage broadcasts it over the pipeline)."""
        def stats(output, mb):
            if "cu_seqlens" in mb:  # the last token of each sequence of the pack
                return {"score": output[0, mb["last"], 0].float()}
            return {"score": output[..., 0].float().gather(1, mb["end"].unsqueeze(1)).squeeze(1)}

        out = self._forward(model, batch, stats)
        scores = out["score"] if self.last_stage else \
            torch.zeros(batch.tokens_BS.shape[0], device=batch.tokens_BS.device)
        if self.pp_group.size() > 1:
            dist.broadcast(scores, src=dist.get_process_group_ranks(self.pp_group)[-1], group=self.pp_group)
        return scores.cpu()


def response_values(output_BS1: torch.Tensor, micro_batch: dict) -> torch.Tensor:
    """A value model's output at the response tokens, ``[b, N]`` fp32 (differentiable: the critic's loss); of a
    packed micro-batch (``[1, T, 1]``), at its response positions."""
    if "cu_seqlens" in micro_batch:
        return output_BS1[0, :, 0].float()[micro_batch["index"]]
    return output_BS1[..., 0].float().gather(1, micro_batch["index"])


def _chunked(stats: Callable, logits_TVt: torch.Tensor, labels_T: torch.Tensor, index_nN: torch.Tensor,
             mask_nN: torch.Tensor, *, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``stats(logits, labels)`` (log-probs and entropies) at the real response positions of a pack (``index_nN``
    where ``mask_nN`` is set; 0 at the others, which every loss masks out: with long-tailed responses most of a
    sequence's ``max_new_tokens`` slots are padding, and the vocabulary is not computed for them), ``chunk``
    positions at a time; with autograd on, each chunk is recomputed in the backward pass (its fp32 softmax is not
    kept), so the pass holds the model's logits and one chunk's temporaries."""
    real = mask_nN.reshape(-1) > 0
    flat = index_nN.reshape(-1)[real]

    def at(logits, labels, idx):
        logp, ent = stats(logits[idx].unsqueeze(0), labels[idx].unsqueeze(0))
        return logp[0], ent[0]

    parts = []
    for lo in range(0, flat.numel(), chunk):
        idx = flat[lo: lo + chunk]
        if torch.is_grad_enabled() and logits_TVt.requires_grad:
            parts.append(torch.utils.checkpoint.checkpoint(at, logits_TVt, labels_T, idx, use_reentrant=False))
        else:
            parts.append(at(logits_TVt, labels_T, idx))
    zeros = logits_TVt.new_zeros(real.numel(), dtype=torch.float32)
    if not parts:
        return zeros.view(index_nN.shape), zeros.view(index_nN.shape)
    logp = zeros.masked_scatter(real, torch.cat([p[0] for p in parts]))
    ent = zeros.masked_scatter(real, torch.cat([p[1] for p in parts]))
    return logp.view(index_nN.shape), ent.view(index_nN.shape)


def _packed_seq_params(mb: dict) -> Any:
    """megatron-core's ``thd`` description of a packed micro-batch (self-attention: one ``cu_seqlens``)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=mb["cu_seqlens"], cu_seqlens_kv=mb["cu_seqlens"],
                           max_seqlen_q=mb["max_seqlen"], max_seqlen_kv=mb["max_seqlen"])


def _check_takes_packed_sequences(model: torch.nn.Module) -> None:
    """``ValueError`` where the model's attention is megatron-core's ``DotProductAttention``, which refuses packed
    sequences (with an assert, in the middle of the schedule)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if any(isinstance(m, DotProductAttention) for m in model.modules()):
        raise ValueError("packed micro-batches (max_tokens_per_micro_batch) need a core attention that takes packed "
                         "sequences: build the model with attention_backend 'sdpa', 'flex' or 'auto' "
                         "(--attention-backend); megatron-core's DotProductAttention ('local') refuses them")
