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
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from ..compat import megatron_groups
from . import ppo
from .phases import recorded
from .routing import TrainingRouting, moe_routers, replays_routing, routed_experts_BSMk

#: ``loss_fn(output, micro_batch) -> (loss, stats)``: Megatron's loss function of one micro-batch. ``output`` is
#: the last stage's output (``[B, S, V_t]`` logits, or ``[B, S, 1]`` values); ``stats`` are detached tensors.
LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]


@dataclass
class Batch:
    """One rank's rollout batch. Response-aligned tensors are [B, N]; ``index_BN`` is where the logits that
    predict response token j of sequence b sit in the sequence (position len(prompt_b) − 1 + j)."""

    tokens_BS: torch.Tensor
    """Prompt + response, zero-padded to the sequence length."""
    index_BN: torch.Tensor
    """Positions of the outputs that predict the response tokens."""
    mask_BN: torch.Tensor
    """1 on real response tokens."""
    scores_B: torch.Tensor
    """The sequence rewards."""
    data: dict[str, torch.Tensor]
    """Further per-sequence tensors the losses read (``end``: each sequence's last position; old log-probs, …)."""

    @property
    def num_tokens(self) -> int:
        """The real tokens of all sequences (prompt + response)."""
        return int(self.data["end"].sum()) + self.tokens_BS.shape[0]

    def micro_batches(self, size: int) -> list[dict[str, torch.Tensor]]:
        """Consecutive slices of ``size`` sequences, as dicts (``tokens``, ``index``, ``mask`` and ``data``)."""
        out = []
        for lo in range(0, self.tokens_BS.shape[0], size):
            mb = {"tokens": self.tokens_BS[lo: lo + size], "index": self.index_BN[lo: lo + size],
                  "mask": self.mask_BN[lo: lo + size]}
            mb.update({k: v[lo: lo + size] for k, v in self.data.items()})
            out.append(mb)
        return out


def make_batch(prompts: list[list[int]], responses: list[list[int]], *, max_new_tokens: int, seq_length: int,
               device: torch.device, rollout_log_probs: Optional[list[list[float]]] = None,
               routed_experts: Optional[list[torch.Tensor]] = None) -> Batch:
    """The batch of ``prompts[b] + responses[b]``; scores are zero until the reward is known.
    ``rollout_log_probs``: the generator's log-probs of the response tokens, kept as ``data["rollout_logp"]``
    (``[B, N]``, zero-padded). ``routed_experts``: the generator's routing records
    (``GenerationResult.routed_experts``), kept on the host as ``data["routed_experts"]`` (``[B, S, M, k]``, -1
    where nothing was recorded; :mod:`.routing`): the passes then replay or count them."""
    B, N = len(prompts), max_new_tokens
    tokens = torch.zeros(B, seq_length, dtype=torch.long)
    index = torch.zeros(B, N, dtype=torch.long)
    mask = torch.zeros(B, N)
    end = torch.zeros(B, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        seq = list(p) + list(r)
        tokens[b, : len(seq)] = torch.tensor(seq)
        # Padding positions past a short response point inside the sequence; the mask drops them.
        index[b] = (len(p) - 1 + torch.arange(N)).clamp(max=seq_length - 2)
        mask[b, : len(r)] = 1.0
        end[b] = len(seq) - 1
    data = {"end": end.to(device)}
    if rollout_log_probs is not None:
        logp = torch.zeros(B, N)
        for b, row in enumerate(rollout_log_probs):
            logp[b, : len(row)] = torch.tensor(row)
        data["rollout_logp"] = logp.to(device)
    if routed_experts is not None:
        data["routed_experts"] = routed_experts_BSMk(routed_experts, seq_length)
    return Batch(tokens.to(device), index.to(device), mask.to(device), torch.zeros(B), data)


def padded_seq_length(num_tokens: int, *, sequence_parallel: bool) -> int:
    """The sequence length of the passes for sequences of up to ``num_tokens`` (longest prompt + max new tokens):
    with sequence parallelism a multiple of the tensor-parallel size, as Megatron splits the sequence into equal
    slices (the padding comes after every sequence's end, so causal attention never reads it)."""
    multiple = megatron_groups()[0].size() if sequence_parallel else 1
    return -(-num_tokens // multiple) * multiple


def _fresh_loss(loss: torch.Tensor, stats: dict) -> tuple[torch.Tensor, dict]:
    """A copy of the loss for Megatron's schedule, which divides it in place by the number of micro-batches: a
    stat that is the loss itself (``loss.detach()`` shares its storage) keeps its value."""
    return loss.clone(), stats


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


class TrainingPasses:
    """Forward(-backward) passes over batches on Megatron's training groups (read once, here).

    Results live on the last pipeline stage; the other stages get ``None`` (except :meth:`scores`).
    """

    def __init__(self, config: PassConfig) -> None:
        self.config = config
        self.tp_group, self.pp_group, _, _ = megatron_groups()
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

    def run(self, model: torch.nn.Module, batch: Batch, loss_fn: LossFn, *, forward_only: bool) -> list[dict]:
        """Megatron's forward/backward schedule over ``batch``'s micro-batches; returns the per-micro-batch
        ``stats`` of ``loss_fn`` (last stage; ``[]`` elsewhere). Gradients, when not ``forward_only``, accumulate
        in DDP's buffers: of the loss averaged over the micro-batches (the schedule) and the DP replicas (DDP).
        A model built with ``moe_enable_routing_replay`` routes the batch's tokens as its routing record says."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        routing = self._routing(model, batch)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            with routing.micro_batch(mb["routed_experts"]) if routing is not None else nullcontext():
                out = model(mb["tokens"], _positions_like(mb["tokens"]), None)
            return out, lambda output: _fresh_loss(*loss_fn(output, mb))

        micro_batches = batch.micro_batches(self.config.micro_batch_size)
        with routing if routing is not None else nullcontext():
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
                num_microbatches=len(micro_batches), seq_length=self.config.seq_length,
                micro_batch_size=self.config.micro_batch_size, forward_only=forward_only)

    def token_stats(self, logits_BSVt: torch.Tensor, micro_batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies of the response tokens, ``[b, N]`` (differentiable), from vocabulary-parallel
        logits at the sampling temperature."""
        labels = torch.roll(micro_batch["tokens"], -1, dims=1)
        V_t = logits_BSVt.shape[-1]
        logp, ent = ppo.vocab_parallel_logprobs_entropy(
            logits_BSVt, labels, tp_group=self.tp_group, vocab_start=self.tp_group.rank() * V_t,
            vocab_size=self.config.vocab_size, temperature=self.config.temperature)
        return logp.gather(1, micro_batch["index"]), ent.gather(1, micro_batch["index"])

    def _forward(self, model: torch.nn.Module, batch: Batch, stats_fn) -> list[dict]:
        def loss_fn(output, mb):
            stats = stats_fn(output, mb)
            return torch.zeros((), device=output.device), {k: v.detach() for k, v in stats.items()}

        with torch.no_grad():
            return self.run(model, batch, loss_fn, forward_only=True)

    @recorded("log-probs")
    def log_probs(self, model: torch.nn.Module, batch: Batch) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The policy's ``(log_probs_BN, entropy_BN)`` of the response tokens; ``None`` off the last stage."""
        def stats(output, mb):
            logp, ent = self.token_stats(output, mb)
            return {"logp": logp, "entropy": ent}

        out = self._forward(model, batch, stats)
        if not self.last_stage:
            return None
        return torch.cat([o["logp"] for o in out]), torch.cat([o["entropy"] for o in out])

    @recorded("values")
    def values(self, model: torch.nn.Module, batch: Batch) -> Optional[torch.Tensor]:
        """A value model's values at the response tokens, ``[B, N]`` fp32; ``None`` off the last stage."""
        out = self._forward(model, batch, lambda output, mb: {"values": response_values(output, mb)})
        return torch.cat([o["values"] for o in out]) if self.last_stage else None

    @recorded("reward model")
    def scores(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """A reward model's score of each sequence (its value at the last real token), ``[B]`` fp32 on the CPU,
        on every rank (the last stage broadcasts it over the pipeline)."""
        def stats(output, mb):
            return {"score": output[..., 0].float().gather(1, mb["end"].unsqueeze(1)).squeeze(1)}

        out = self._forward(model, batch, stats)
        scores = torch.cat([o["score"] for o in out]) if self.last_stage else \
            torch.zeros(batch.tokens_BS.shape[0], device=batch.tokens_BS.device)
        if self.pp_group.size() > 1:
            dist.broadcast(scores, src=dist.get_process_group_ranks(self.pp_group)[-1], group=self.pp_group)
        return scores.cpu()


def response_values(output_BS1: torch.Tensor, micro_batch: dict) -> torch.Tensor:
    """A value model's output at the response tokens, ``[b, N]`` fp32 (differentiable: the critic's loss)."""
    return output_BS1[..., 0].float().gather(1, micro_batch["index"])
