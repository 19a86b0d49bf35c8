"""Self-attention over a per-slot KV cache, swapped into a megatron-core model by class.

megatron-core's own KV path (a ``StaticInferenceContext`` as ``inference_context``) keeps one scalar offset for the
whole batch, so every sequence of a batch must sit at the same position: no ragged prompts, no slot reuse.
:class:`KVCacheSelfAttention` keeps megatron-core's ``SelfAttention`` (its ``linear_qkv``, q/k layernorms and
``linear_proj``, aliased or not) and replaces only what happens between the projections while its stage's
:class:`~.context.StepContext` holds a :class:`~.context.KVStep`: rotary embeddings at each token's own position, a
write of K/V into the token's cache slot, and attention (``scaled_dot_product_attention``) over that slot's filled
positions. Without a step the module is megatron-core's ``SelfAttention``, unchanged, so the model stays a drop-in
megatron-core model.

Tokens always travel packed along the sequence dimension, ``[T, 1, H]`` (T tokens, batch 1): a prefill packs the
prompts one after another, a decode step packs one token per slot, each with its own position.

Rotary embeddings are megatron-core's unfused formula (``rope_utils._apply_rotary_pos_emb_bshd``, so the same bits
as a training forward without rope fusion), with the cosines and sines computed once per step for all layers
rather than in every layer: a decode step is launch-bound, and this saves four kernels per layer. A model trained
with TE's fused rotary kernel differs from it by rounding only.

Legend: T packed tokens, P prompts, S their length, B decode slots, N slots of the cache, G key/value heads and R
query heads per key/value head on this tensor-parallel rank, L cached positions per slot, D head dimension.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp

from . import kernels
from .context import KVStep, StepContext

__all__ = ["KVCacheSelfAttention", "KVStep", "install_kv_attention"]


class KVCacheSelfAttention(SelfAttention):
    """megatron-core's ``SelfAttention`` that attends over a per-slot KV cache while its ``step_context`` holds a
    step."""

    step_context: Optional[StepContext] = None  # the stage's, given once by install_kv_attention
    kv_layer: int = 0  # index of this layer among the stage's attention layers (its cache)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        step = self.step_context.kv if self.step_context is not None else None
        if step is None:
            return super().forward(hidden_states, *args, **kwargs)
        return self._cached_forward(hidden_states, step)

    def decode_kernel_ok(self, device: torch.device) -> bool:
        """Whether decode steps on ``device`` run the attention kernel of :mod:`.kernels` (Triton on a GPU)."""
        ratio = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        return device.type == "cuda" and kernels.decode_attention_supported(self.hidden_size_per_attention_head,
                                                                            ratio)

    def _fused_rope_ok(self, step: KVStep, no_rope: bool) -> bool:
        """Whether rotary embedding and the cache write run as one kernel: a decode step on the plain layout
        (no q/k norms, every key/value group on this rank, non-interleaved rotary on this layer)."""
        return (step.lengths_B is not None and step.rotary_T11D is not None and not no_rope
                and _no_op(self.q_layernorm) and _no_op(self.k_layernorm)
                and not self.config.rotary_interleaved and self.config.num_query_groups >= self.world_size)

    def _cached_forward(self, hidden_T1H: torch.Tensor, step: KVStep):
        no_rope_freq = getattr(self.config, "no_rope_freq", None)  # per-layer "skip rotary" (mirrors forward())
        no_rope = no_rope_freq[self.layer_number - 1] if no_rope_freq else False
        keys, values = step.keys[self.kv_layer], step.values[self.kv_layer]
        groups, head_dim = self.num_query_groups_per_partition, self.hidden_size_per_attention_head
        ratio = self.num_attention_heads_per_partition // groups
        scale = self.config.softmax_scale or 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        if self._fused_rope_ok(step, no_rope):
            # [T, 1, G, (R+2)*D] as linear_qkv lays it out; one kernel adds linear_qkv's bias (which the linear
            # then skips), rotates q and k and writes k and v.
            linear = self.linear_qkv
            bias = linear.bias if (isinstance(linear, ColumnParallelLinear) and getattr(linear, "bias", None)
                                   is not None and not linear.skip_bias_add) else None
            if bias is not None:
                linear.skip_bias_add = True
            try:
                mixed, _ = self.get_query_key_value_tensors(hidden_T1H, None, split_qkv=False)
            finally:
                if bias is not None:
                    linear.skip_bias_add = False
            T = mixed.shape[0]
            cos, sin = (x.reshape(T, -1) for x in step.rotary_T11D)
            query = kernels.rope_kv_write(mixed.reshape(T, -1), cos, sin, step.slots_T, step.positions_T, keys,
                                          values, groups=groups, ratio=ratio, head_dim=head_dim, bias_X=bias)
            out = kernels.decode_attention(query.view(T, groups, ratio, head_dim), keys, values, step.lengths_B,
                                           scale=scale, max_length=step.attended, slots_B=step.read_slots_B)
            return self.linear_proj(out.reshape(T, 1, groups * ratio * head_dim))
        # q [T, 1, G*R, D], k/v [T, 1, G, D]; query heads are group-major (head g*R + r uses key head g).
        query, key, value = self.get_query_key_value_tensors(hidden_T1H, None)
        if step.rotary_T11D is not None and not no_rope:
            query, key = self._rotate(query, *step.rotary_T11D), self._rotate(key, *step.rotary_T11D)
        # Advanced indices around a slice: cache[slot_t, :, pos_t] is [T, G, D], one row per token.
        keys[step.slots_T, :, step.positions_T] = key[:, 0]
        values[step.slots_T, :, step.positions_T] = value[:, 0]
        groups, head_dim = key.shape[2], key.shape[3]  # from the tensors: q/k norms or a q slice may apply
        ratio = query.shape[2] // groups
        if step.decode and step.lengths_B is not None:
            T = query.shape[0]
            out = kernels.decode_attention(query[:, 0].reshape(T, groups, ratio, head_dim), keys, values,
                                           step.lengths_B, scale=scale, max_length=step.attended,
                                           slots_B=step.read_slots_B)
            return self.linear_proj(out.reshape(T, 1, groups * ratio * head_dim))
        if step.decode:
            B, L = query.shape[0], step.attended
            # One query token per slot: the R query heads of a group act as R query rows over the group's keys,
            # so keys are read once per group (no repeat) and the mask is the slot's, for every row.
            q_BGRD = query[:, 0].reshape(B, groups, ratio, head_dim)
            out = F.scaled_dot_product_attention(q_BGRD, keys[:B, :, :L], values[:B, :, :L],
                                                 attn_mask=step.mask_B11L, scale=scale)
            context = out.reshape(B, 1, groups * ratio * head_dim)
        else:
            context = query.new_empty(query.shape[0], 1, query.shape[2] * head_dim)
            for length, index in step.prompts:
                # [P prompts, S = length, heads, D] -> [P, heads, S, D]; keys repeated per query head (prefill is
                # compute-bound, the copy is cheap next to the projections).
                q_PHSD = query[index, 0].unflatten(0, (-1, length)).transpose(1, 2)
                k_PHSD = key[index, 0].unflatten(0, (-1, length)).transpose(1, 2).repeat_interleave(ratio, dim=1)
                v_PHSD = value[index, 0].unflatten(0, (-1, length)).transpose(1, 2).repeat_interleave(ratio, dim=1)
                out = F.scaled_dot_product_attention(q_PHSD, k_PHSD, v_PHSD, is_causal=True, scale=scale)
                context[index, 0] = out.transpose(1, 2).flatten(0, 1).flatten(-2)
        return self.linear_proj(context)

    def _rotate(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """megatron-core's unfused rotary embedding of ``t`` [T, 1, heads, D], given the angles' cos and sin."""
        cos, sin = cos.to(t.dtype), sin.to(t.dtype)  # no-ops: the step casts them to the model's dtype once
        dim = cos.shape[-1]
        x, rest = t[..., :dim], t[..., dim:]  # rotary_percent < 1 leaves the tail as it is
        if self.config.rotary_interleaved:
            rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).view(x.shape)
        else:
            x1, x2 = x.chunk(2, dim=-1)
            rotated = torch.cat((-x2, x1), dim=-1)
        return torch.cat((x * cos + rotated * sin, rest), dim=-1)


def _no_op(module: Optional[torch.nn.Module]) -> bool:
    """Whether a q/k norm slot is empty: None, or megatron-core's ``IdentityOp`` (the local spec's, in 0.16)."""
    return module is None or isinstance(module, IdentityOp)


def _unsupported(config) -> Optional[str]:
    """Why the cached attention cannot serve ``config`` (None when it can)."""
    checks = [
        (getattr(config, "attention_output_gate", False), "attention_output_gate=True"),
        (getattr(config, "multi_latent_attention", False), "multi_latent_attention=True"),
        (getattr(config, "window_size", None) is not None, f"window_size={getattr(config, 'window_size', None)}"),
        (getattr(config, "softmax_type", "vanilla") != "vanilla",
         f"softmax_type={getattr(config, 'softmax_type', None)!r}"),
        ((getattr(config, "context_parallel_size", 1) or 1) > 1,
         f"context_parallel_size={getattr(config, 'context_parallel_size', None)}"),
        (getattr(config, "sequence_parallel", False), "sequence_parallel=True"),
        (getattr(config, "mtp_num_layers", None), f"mtp_num_layers={getattr(config, 'mtp_num_layers', None)}"),
    ]
    for bad, what in checks:
        if bad:
            return what
    return None


def install_kv_attention(chunk: torch.nn.Module, context: StepContext) -> list[KVCacheSelfAttention]:
    """Swap the class of every layer's ``self_attention`` in ``chunk`` (a GPTModel stage) for
    :class:`KVCacheSelfAttention`, reading its steps from ``context``; returns them in layer order. Idempotent.

    The modules keep their parameters, submodules and attributes; outside a generation step they compute exactly
    what megatron-core's ``SelfAttention`` computes.
    """
    decoder = getattr(chunk, "decoder", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise ValueError(f"{type(chunk).__name__} has no decoder.layers: KV-cache generation needs a megatron-core "
                         "GPTModel stage")
    why = _unsupported(chunk.config)
    if why is not None:
        raise ValueError(f"KV-cache generation does not support {why}")
    out = []
    for i, layer in enumerate(decoder.layers):
        attn = layer.self_attention
        if not isinstance(attn, SelfAttention):
            raise ValueError(f"layer {i}'s self_attention is a {type(attn).__name__}, not megatron-core's "
                             "SelfAttention: KV-cache generation cannot run it")
        if type(attn) is SelfAttention:
            attn.__class__ = KVCacheSelfAttention
        elif not isinstance(attn, KVCacheSelfAttention):
            raise ValueError(f"layer {i}'s self_attention is a {type(attn).__name__} (a SelfAttention subclass): "
                             "KV-cache generation would drop what it overrides")
        attn.kv_layer = i
        attn.step_context = context
        out.append(attn)
    return out
