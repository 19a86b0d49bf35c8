"""Routing replay on the training layout (Megatron-LM's ``--moe-enable-routing-replay``), and how often the training
routers route a token differently from the rollout.

The generator records the top-k experts every MoE layer chose for every token it ran
(``GenerationConfig.record_routing``: ``GenerationResult.routed_experts``, ``[P + n - 1, M, k]``);
:func:`routed_experts_BSMk` lays them out like a batch's tokens. During a pass over the batch, a
:class:`TrainingRouting` hooks the model's routers (megatron-core's ``TopKRouter``) and, per micro-batch, aligns the
record with the tokens each router sees (``[S, b]`` flattened sequence-major, or a pack's sequences back to back: this
rank's slice of them with sequence parallelism). Before each router runs it takes the router's own top-k
(:func:`~megatron_hybrid.inference.moe.route`, megatron's computation, without gradients); where the model replays (its routers carry megatron-core's
``RouterReplay``: built with ``moe_enable_routing_replay``), it hands the ``RouterReplay`` the recorded experts of
each token with ``REPLAY_FORWARD``, so megatron's router takes those experts and computes their probabilities from
its own logits (gathered at them, then its score function: the gradient reaches the router's weights as without
replay). Tokens without a record (each sequence's last token, never an input of the rollout, and padding) keep
the router's own choice; causal attention keeps them out of every loss term but the load-balancing loss. After the
router ran, the routing map it produced (what the experts got) is compared with the record.

The counts are per token over all MoE layers: a token differs when its expert set differs in any layer.

Legend: B sequences, S positions, b sequences of a micro-batch, M MoE layers of the model, k experts per token,
T tokens a router sees, E experts.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from ..inference.moe import moe_layer_ordinals, route
from ..megatron import unwrap_model
from ..reshard import collective_device

__all__ = ["TrainingRouting", "moe_routers", "replays_routing", "routed_experts_BSMk"]


def routed_experts_BSMk(records: Sequence[torch.Tensor], seq_length: int) -> torch.Tensor:
    """The rollout's routing records (``[n_b, M, k]`` each, row i for token i of prompt + response) as one
    ``[B, S, M, k]`` tensor on the host, ``-1`` where a sequence has no record (its last token, the padding)."""
    first = records[0]
    out = torch.full((len(records), seq_length, *first.shape[1:]), -1, dtype=first.dtype)
    for b, rec in enumerate(records):
        if rec.shape[1:] != first.shape[1:]:
            raise ValueError(f"routing record {b} has shape {tuple(rec.shape)}; record 0 has "
                             f"{tuple(first.shape)} (the same MoE layers and top-k expected)")
        if rec.shape[0] > seq_length:
            raise ValueError(f"routing record {b} covers {rec.shape[0]} tokens, more than the sequence length "
                             f"({seq_length})")
        out[b, : rec.shape[0]] = rec
    return out


def moe_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """This stage's routers (megatron-core ``TopKRouter``) with their ordinals among the model's MoE layers."""
    from megatron.core.transformer.moe.router import TopKRouter

    stage = unwrap_model(model)
    config = stage.config
    if not config.num_moe_experts:
        return []
    ordinals = moe_layer_ordinals(config.num_layers, config.moe_layer_freq)
    return [(ordinals[m.layer_number - 1], m) for m in stage.modules() if isinstance(m, TopKRouter)]


def replays_routing(model: torch.nn.Module) -> bool:
    """Whether the model's routers replay recorded routing (built with ``moe_enable_routing_replay``: each carries
    megatron-core's ``RouterReplay``)."""
    return any(router.router_replay is not None for _, router in moe_routers(model))


def _expert_map(experts_Tk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[T, E]`` bool: the experts of each token (rows with a negative index: none)."""
    out = torch.zeros(experts_Tk.shape[0], num_experts, dtype=torch.bool, device=experts_Tk.device)
    return out.scatter_(1, experts_Tk.clamp(min=0), True)


class TrainingRouting:
    """One model's MoE routers during the passes over one batch with a routing record (a context manager: hooks on
    the routers while entered). See the module docstring.

    Args:
        model: this rank's stage (plain or DDP-wrapped).
        routed_BSMk: the batch's record (:func:`routed_experts_BSMk`).
        tp_group, pp_group: the model's tensor- and pipeline-parallel groups (:meth:`metrics` reduces over them).
        replay: route every recorded token to its recorded experts (the model's routers must carry a
            ``RouterReplay``); otherwise only count.
    """

    def __init__(self, model: torch.nn.Module, routed_BSMk: torch.Tensor, *, tp_group, pp_group,
                 replay: bool) -> None:
        self.routers = moe_routers(model)
        self.config = unwrap_model(model).config
        self.tp_group, self.pp_group, self.replay = tp_group, pp_group, replay
        B, S, M, _ = routed_BSMk.shape
        num_moe = sum(o is not None for o in moe_layer_ordinals(self.config.num_layers, self.config.moe_layer_freq))
        if M != num_moe:
            raise ValueError(f"the routing record has {M} MoE layers; the model has {num_moe}")
        if replay and any(router.router_replay is None for _, router in self.routers):
            raise ValueError("routing replay needs routers built with moe_enable_routing_replay "
                             "(--moe-enable-routing-replay)")
        if replay and self.config.recompute_granularity == "full":
            # The hooks hand a router the record during a micro-batch's forward; the backward pass's rerun of a
            # checkpointed layer comes after it and would route by the router's own top-k: other experts' gradients.
            raise ValueError("routing replay does not replay the backward pass's rerun of full activation recompute "
                             "(recompute_granularity 'full', --recompute-granularity full): build the model without "
                             "it, or with 'selective'")
        self.shape_BS = (B, S)
        self.valid_BS = (routed_BSMk >= 0).all(-1).all(-1)
        self.record_XMk = routed_BSMk.reshape(B * S, M, -1)  # X: a token's flat position b · S + s in the batch
        # Per token: its routing differs from the record in a layer of this stage, in what the experts got
        # (used) and in the router's own top-k (own). Sequence-parallel ranks fill their slice of the sequence.
        self.used_X = torch.zeros(B * S, dtype=torch.int32)
        self.own_X = torch.zeros(B * S, dtype=torch.int32)
        self._cursor = 0  # the next micro-batch's first sequence: the schedule runs them in order on every stage
        self._current: Optional[torch.Tensor] = None  # the micro-batch's tokens as flat positions, router order
        self._own: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> "TrainingRouting":
        self._cursor = 0  # each pass starts at the batch's first sequence
        for ordinal, router in self.routers:
            self._handles.append(router.register_forward_pre_hook(self._before(ordinal)))
            self._handles.append(router.register_forward_hook(self._after(ordinal)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for _, router in self.routers:
            if router.router_replay is not None:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()

    @contextmanager
    def micro_batch(self, mb: dict) -> Iterator[None]:
        """The next micro-batch's forward runs in the body: padded (``[b, S]`` tokens, the b sequences after the
        previous micro-batch's) or packed (:mod:`.packing`: its ``rows``, their lengths, then padding)."""
        B, S = self.shape_BS
        if "cu_seqlens" in mb:  # [1, T]: each sequence's positions, then the pack's padding (no record: -1)
            lengths = (mb["end"] + 1).tolist()
            parts = [row * S + torch.arange(n) for row, n in zip(mb["rows"].tolist(), lengths)]
            pad = mb["tokens"].shape[1] - sum(lengths)
            self._current = torch.cat(parts + [torch.full((pad,), -1, dtype=torch.long)])
        else:  # [S, b] sequence-major, as the model's hidden states
            b = mb["tokens"].shape[0]
            rows = self._cursor + torch.arange(b)
            self._current = (rows.view(1, b) * S + torch.arange(S).view(S, 1)).reshape(-1)
            self._cursor += b
        try:
            yield
        finally:
            self._current = None

    def _slice(self) -> torch.Tensor:
        """The flat positions of the tokens this rank's routers see: its sequence-parallel slice, or all."""
        flat = self._current
        if not self.config.sequence_parallel:
            return flat
        t, r = self.tp_group.size(), self.tp_group.rank()
        return flat[r * flat.numel() // t: (r + 1) * flat.numel() // t]

    def _record_Tk(self, ordinal: int, device: torch.device) -> torch.Tensor:
        """The current micro-batch's record for layer ``ordinal`` in the router's token order, ``[T, k]`` int64
        (-1 for tokens without one)."""
        flat = self._slice()
        record = self.record_XMk[flat.clamp(min=0), ordinal].to(torch.long)
        record[flat < 0] = -1
        return record.to(device)

    def _before(self, ordinal: int):
        def hook(router, args):
            if self._current is None:  # a forward outside the passes' micro-batches
                return None
            x = args[0]
            with torch.no_grad():
                own_Tk = route(router, x.detach().reshape(-1, x.shape[-1]))[1]
            self._own[ordinal] = own_Tk
            if self.replay:
                record_Tk = self._record_Tk(ordinal, own_Tk.device)
                recorded_T = (record_Tk >= 0).all(-1, keepdim=True)
                from megatron.core.transformer.moe.router_replay import RouterReplayAction

                replay = router.router_replay
                replay.set_target_indices(torch.where(recorded_T, record_Tk, own_Tk))
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            return None
        return hook

    def _after(self, ordinal: int):
        def hook(router, args, output):
            if self._current is None:
                return None
            if self.replay:  # set and cleared around each call: no state left for the next micro-batch
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()
            routing_map_TE = output[1].detach()
            E = routing_map_TE.shape[-1]
            record_Tk = self._record_Tk(ordinal, routing_map_TE.device)
            recorded_T = (record_Tk >= 0).all(-1)
            expected_TE = _expert_map(record_Tk, E)
            used_T = (routing_map_TE.bool() != expected_TE).any(-1) & recorded_T
            own_T = (_expert_map(self._own.pop(ordinal), E) != expected_TE).any(-1) & recorded_T
            flat = self._slice()
            real = flat >= 0
            for flags, diff_T in ((self.used_X, used_T), (self.own_X, own_T)):
                flags[flat[real]] |= diff_T.to(device="cpu", dtype=torch.int32)[real]
            return None
        return hook

    def metrics(self) -> dict[str, float]:
        """The fractions of the recorded tokens whose experts differ from the rollout's in some MoE layer:
        ``moe/routing_mismatch_tokens`` in the routing the training forward used (0 when replaying) and
        ``moe/router_choice_mismatch_tokens`` in the training routers' own top-k (the same without replay; with
        replay, what the routers would have chosen on the replayed inputs); and the recorded tokens counted. A
        collective over the model's tensor- and pipeline-parallel groups: call it on every rank of them."""
        flags = torch.stack([self.used_X, self.own_X]).view(2, *self.shape_BS)
        device = collective_device(self.pp_group)
        flags = flags.to(device)
        for group in (self.tp_group, self.pp_group):
            if group.size() > 1:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        valid = self.valid_BS.to(device)
        n = int(valid.sum())
        used, own = (float(f[valid].sum()) / max(n, 1) for f in flags)
        return {"moe/routing_mismatch_tokens": used, "moe/router_choice_mismatch_tokens": own,
                "moe/routing_recorded_tokens": float(n)}
