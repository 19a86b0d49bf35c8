"""One pipeline stage's forward of each kind of step (decode, mixed, graph prefill, idle), graph-capturable.

A step drives the GPTModel stage's own modules (embedding, decoder, output layer) rather than its ``forward``: a
prefill then computes logits only at each prompt's last token, and megatron-core's inference-context code paths
(global groups, one offset per batch) stay out of the way. The decoder is megatron-core's TransformerBlock, or the
stage's layers with SwiGLU and residual add + norm fused (:mod:`.fused`). The step reaches the attention, norm and MoE
modules through the stage's :class:`~.context.StepContext`, set around each forward in one place
(:meth:`StageForwards.forward`).

The decode, mixed and graph-prefill forwards read only the fixed-address state of
:class:`~.stage_buffers.StageBuffers` (and the staging the runner filled), so a CUDA graph captures them; the
runner's eager prefill builds its inputs and calls :meth:`StageForwards.forward` itself.

Legend: T packed tokens, B decode slots, H hidden, V vocabulary (padded).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..reshard import gather_vocab
from .context import KVStep, StepContext
from .stage_buffers import StageBuffers


class StageForwards:
    """The forwards of ``chunk`` (this rank's GPTModel stage) on the fixed-address state ``buffers``.

    Args:
        chunk: a megatron-core GPTModel stage, its modules installed for steps (:class:`~.runner.StageRunner`).
        context: the stage's step context.
        fused: the stage's fused decoder, or None (megatron-core's TransformerBlock).
        moe: the stage's step MoE layers (an idle step runs their share of the expert-parallel collectives).
        tp_group: the tensor-parallel group the logits are gathered over.
        buffers: the stage's fixed-address state.
        rotary: the model's rotary embedding, or None (no rotary positions).
        reads_lengths: whether the attention reads each slot's own filled length rather than a masked window of the
            longest.
    """

    def __init__(self, chunk: torch.nn.Module, *, context: StepContext, fused: Optional[torch.nn.Module], moe: list,
                 tp_group, buffers: StageBuffers, rotary: Optional[torch.nn.Module], reads_lengths: bool) -> None:
        self.chunk, self.context, self.fused, self.moe = chunk, context, fused, moe
        self.tp_group, self.buffers = tp_group, buffers
        self.rotary_pos_emb, self.reads_lengths = rotary, reads_lengths
        self.moe_rows = 0
        """The step's MoE rows (its plan's, set by :meth:`~.runner.StageRunner.run`), read where the step's context
        is set."""

    def rotary(self, positions_T: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """cos and sin of the rotary angles at each token's position: megatron-core's ``RotaryEmbedding.get_emb``
        at arbitrary positions (the same products, so the same bits), from the model's own ``inv_freq``."""
        inv_freq, rotary = self.buffers.inv_freq, self.rotary_pos_emb
        if inv_freq is None:
            return None
        seq = positions_T.to(inv_freq.dtype)
        if rotary.seq_len_interpolation_factor is not None:
            seq = seq * (1 / rotary.seq_len_interpolation_factor)
        freqs = seq.unsqueeze(-1) * inv_freq  # torch.outer(seq, inv_freq)
        if rotary.rotary_interleaved:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        emb = emb[:, None, None, :]
        dtype = self.chunk.config.params_dtype  # q and k's: megatron-core casts per layer, we once per step
        return torch.cos(emb).to(dtype), torch.sin(emb).to(dtype)

    def forward(self, tokens_T: torch.Tensor, hidden_T1H: Optional[torch.Tensor], step: KVStep,
                last_T: Optional[torch.Tensor]) -> torch.Tensor:
        """This stage on the packed tokens: hidden states ``[T, 1, H]`` for the next stage, or on the last stage
        the gathered logits ``[n, V]`` at the tokens ``last_T`` (all tokens when None)."""
        chunk = self.chunk
        step.moe_rows = self.moe_rows
        step.routed_experts = self.buffers.routing_planes
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

    def decode(self, batch: int, attended: int) -> torch.Tensor:
        """A decode step over slots ``0 .. batch-1``, reading only fixed-address inputs (graph-capturable)."""
        b = self.buffers
        positions = b.slot_positions[:batch]
        if self.reads_lengths:
            mask, lengths = None, positions + 1
        else:
            mask, lengths = (b.position_index[:attended] <= positions.unsqueeze(-1))[:, None, None, :], None
        slots = b.slot_index[:batch]
        if b.geometry.spare_slots:  # (with mixed steps, which kept prefixes need)
            # An idle row writes the spare slot: its own may hold a kept prefix (multi-turn) from position 0 on.
            slots = torch.where(b.slot_running[:batch] > 0, slots, b.geometry.num_slots)
        step = KVStep(b.cache.keys, b.cache.values, slots_T=slots, positions_T=positions,
                      rotary_T11D=self.rotary(positions), decode=True, attended=attended, mask_B11L=mask,
                      lengths_B=lengths)
        hidden = b.hidden_in[:batch] if b.hidden_in is not None else None
        return self.forward(b.slot_tokens[:batch], hidden, step, None)

    def mixed(self, batch: int, chunk: int, rows: int, staged: torch.Tensor, hidden_T1H: Optional[torch.Tensor],
              attended: int) -> torch.Tensor:
        """A decode step over slots ``0 .. batch-1`` with ``chunk`` prompt tokens riding along (``staged``, laid out
        by :meth:`~.stage_buffers.StageBuffers.stage_mixed`). Every row reads its own slot up to its own position,
        so a prompt's tokens attend causally to each other (all rows write K/V before any reads). Logits at the
        decode rows, then at the last token of each of ``rows`` prompt rows."""
        b = self.buffers
        tokens, positions, slots = (staged[i * chunk: (i + 1) * chunk] for i in range(3))
        last = staged[3 * chunk: 3 * chunk + rows]
        # An idle decode row writes (and reads) the spare slot: the slot it stands for may be taking a prompt in
        # this very step, whose tokens write its position 0.
        decode_slots = torch.where(b.slot_running[:batch] > 0, b.slot_index[:batch], b.geometry.num_slots)
        slots_T = torch.cat([decode_slots, slots])
        positions_T = torch.cat([b.slot_positions[:batch], positions])
        step = KVStep(b.cache.keys, b.cache.values, slots_T=slots_T, positions_T=positions_T,
                      rotary_T11D=self.rotary(positions_T), decode=True, attended=attended,
                      lengths_B=positions_T + 1, read_slots_B=slots_T)
        sampled = torch.cat([b.slot_index[:batch], last + batch])
        return self.forward(torch.cat([b.slot_tokens[:batch], tokens]), hidden_T1H, step, sampled)

    def prefill(self, rows: int, length: int) -> torch.Tensor:
        """A graph prefill: ``rows`` prompts right-padded to ``length`` tokens, from the staging buffer."""
        b = self.buffers
        T = rows * length
        tokens, positions, slots = (b.staging[i * T: (i + 1) * T] for i in range(3))
        last = b.staging[3 * T: 3 * T + rows]
        step = KVStep(b.cache.keys, b.cache.values, slots_T=slots, positions_T=positions,
                      rotary_T11D=self.rotary(positions), decode=False, prompts=[(length, b.token_index[:T])])
        hidden = b.prefill_hidden[:T] if b.prefill_hidden is not None else None
        return self.forward(tokens, hidden, step, last)

    def idle(self, rows: int) -> tuple:
        """Only the MoE layers' collectives (and local experts) over ``rows`` agreed rows."""
        for layer in self.moe:
            layer.idle_step(rows)
        return ()
