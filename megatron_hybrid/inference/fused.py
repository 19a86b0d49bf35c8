"""The fused decoder step: a stage's dense layers with SwiGLU's activation in one kernel and each residual add in
one kernel with the RMSNorm after it.

megatron-core's ``TransformerLayer`` runs, between the matrix multiplies of a Llama-like layer, the input RMSNorm,
the attention's residual add (bias-dropout-add), the pre-MLP RMSNorm, SwiGLU as ``silu`` then a product, and the
MLP's residual add: at a decode step each is a short kernel of its own, and together they cost about as much as a
fifth of the matrix multiplies (issue 26: 1.1–1.3 ms of an 11.5 ms step on a 7.6B model at batch 256). While a
generation step runs, :class:`FusedDecoder` computes the stage's layers as vLLM does, carrying the residual stream
beside the normed hidden states:

    h = norm_in_0(x); r = x
    per layer i:  a = attention_i(h)            (linear_qkv, rotary + KV write, attention, linear_proj)
                  r, h = r + a, norm_mlp_i(r + a)                       (:func:`add_rms_norm`, one kernel)
                  m = linear_fc2(swiglu(linear_fc1(h)))                 (:func:`swiglu`, one kernel)
                  r, h = r + m, norm_in_{i+1}(r + m)   (the next layer's input norm, or the final norm)

so a layer runs its four linears, rotary + KV write, attention and three elementwise kernels, against six
elementwise kernels before. The modules are the stage's own (their TP communication included; FP8 linears compute
in FP8). Rounding: each residual sum is rounded to the model's dtype as megatron-core's add rounds it, the norm
rounds once (as :func:`.kernels.rms_norm`), and SwiGLU rounds ``silu(a)`` to the dtype before the product, as the
eager ``F.silu(a) * b`` does; ``exp`` may differ from PyTorch's in the last fp32 bit, and the norm's sum of squares
is added in another order (one unit in the last place at most, rarely).

A stage takes the fused path only when every layer is one it computes exactly (:func:`why_not_fused`): RMSNorms,
megatron-core's dense ``MLP`` with SwiGLU and no biases on fc1, fc2 and linear_proj, no dropout while training,
no fp32 residual, the attention :class:`~.attention.KVCacheSelfAttention`. Otherwise the stage runs megatron-core's
``TransformerBlock`` as before.

Legend: T packed tokens, H hidden, F the MLP's width on this rank (fc1 gives 2F).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from ..kernels import HAVE_TRITON, next_pow2, use_triton
from ..quant import FP8_DTYPE, FP8_MAX
from . import kernels
from .attention import KVCacheSelfAttention

if HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = ["FusedDecoder", "add_rms_norm", "install_fused_decoder", "swiglu", "why_not_fused"]

_MAX_HIDDEN = 16384  # add_rms_norm holds a row in registers
_SWIGLU_BLOCK = 1024


Quantized = tuple[torch.Tensor, torch.Tensor]  # FP8 values [T, K] and fp32 row scales [T, 1]


def _quantize(y_TK: torch.Tensor) -> Quantized:
    from ..quant import quantize_activations

    return quantize_activations(y_TK.reshape(-1, y_TK.shape[-1]))


def swiglu(x_T2F: torch.Tensor, *, quantize: bool = False) -> tuple[torch.Tensor, Optional[Quantized]]:
    """``F.silu(a) * b`` with ``a, b = x.chunk(2, dim=-1)``, ``[..., F]``, one kernel (Triton) or the eager formula;
    with ``quantize`` also its FP8 quantization per row (the format of :mod:`megatron_hybrid.quant.fp8`, of the rounded
    result: the bits ``quantize_activations`` gives), from the same kernel.

    The kernel rounds as the eager formula does: ``silu(a)`` computed in fp32 and rounded to x's dtype, then the
    product in fp32, rounded again."""
    F2 = x_T2F.shape[-1]
    if F2 % 2:
        raise ValueError(f"swiglu: the last dimension ({F2}) must be even")
    if not use_triton(x_T2F) or x_T2F.stride(-1) != 1 or x_T2F.dtype not in (torch.bfloat16, torch.float16,
                                                                               torch.float32):
        a, b = torch.chunk(x_T2F, 2, dim=-1)
        out = F.silu(a) * b
        return out, (_quantize(out) if quantize else None)
    rows = x_T2F.reshape(-1, F2)
    T, width = rows.shape[0], F2 // 2
    out = torch.empty(T, width, dtype=x_T2F.dtype, device=x_T2F.device)
    quantized = None
    if quantize:
        quantized = (torch.empty(T, width, dtype=FP8_DTYPE, device=x_T2F.device),
                     torch.empty(T, 1, dtype=torch.float32, device=x_T2F.device))
    if T:
        chunks = triton.cdiv(width, _SWIGLU_BLOCK)
        # With quantize, each program also writes its chunk's amax; a second kernel (as parallel: a program per row
        # and chunk) takes each row's amax over its chunks and quantizes the chunk. One program per row, reading
        # the row twice, took 17 us a layer at 32 rows of 14,336 on an H200.
        amax = torch.empty(T, chunks, dtype=torch.float32, device=x_T2F.device) if quantize else out
        _swiglu_kernel[(T, chunks)](rows, out, amax, rows.stride(0), width, chunks, BLOCK=_SWIGLU_BLOCK,
                                    AMAX=quantize, num_warps=4)
        if quantize:
            _quantize_chunks_kernel[(T, chunks)](out, amax, quantized[0], quantized[1], width, chunks, FP8_MAX,
                                                 BLOCK=_SWIGLU_BLOCK, BLOCK_C=next_pow2(chunks), num_warps=4)
    return out.view(*x_T2F.shape[:-1], width), quantized


def add_rms_norm(x_TH: torch.Tensor, residual_TH: torch.Tensor, weight_H: Optional[torch.Tensor],
                 eps: float, *, quantize: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor],
                                                                 Optional[Quantized]]:
    """``(s, n, q)``: ``s = residual + x`` rounded to x's dtype, ``n = rms_norm(s) * weight`` (fp32, rounded once:
    :func:`.kernels.rms_norm`'s formula) and with ``quantize`` n's FP8 quantization per row (the bits
    ``quantize_activations(n)`` gives), in one kernel (Triton). ``weight_H`` None: the sum only."""
    H = x_TH.shape[-1]
    if residual_TH.shape != x_TH.shape or residual_TH.dtype != x_TH.dtype:
        raise ValueError(f"add_rms_norm: x {tuple(x_TH.shape)} {x_TH.dtype} and residual "
                         f"{tuple(residual_TH.shape)} {residual_TH.dtype} must match")
    if weight_H is None:
        return residual_TH + x_TH, None, None
    kernel = (use_triton(x_TH) and H <= _MAX_HIDDEN and x_TH.is_contiguous() and residual_TH.is_contiguous()
              and x_TH.dtype in (torch.bfloat16, torch.float16, torch.float32))
    if not kernel:
        total = residual_TH + x_TH
        normed = kernels.rms_norm(total, weight_H, eps)
        return total, normed, (_quantize(normed) if quantize else None)
    total, normed = torch.empty_like(x_TH), torch.empty_like(x_TH)
    rows = x_TH.numel() // H
    quantized = None
    if quantize:
        quantized = (torch.empty(rows, H, dtype=FP8_DTYPE, device=x_TH.device),
                     torch.empty(rows, 1, dtype=torch.float32, device=x_TH.device))
    if rows:
        block = next_pow2(H)
        q_out, s_out = quantized if quantize else (normed, normed)  # pointers the kernel writes only with QUANT
        _add_rms_norm_kernel[(rows,)](x_TH, residual_TH, weight_H, total, normed, q_out, s_out, H, eps, FP8_MAX,
                                      BLOCK=block, QUANT=quantize, num_warps=8 if block >= 4096 else 4)
    return total, normed, quantized


def _norm_eps(norm: torch.nn.Module, dtype: torch.dtype) -> float:
    return norm.eps if norm.eps is not None else torch.finfo(dtype).eps


def _is_rms_norm(module) -> bool:
    return (isinstance(module, torch.nn.RMSNorm) and module.weight is not None
            and len(module.normalized_shape) == 1)


def why_not_fused(chunk: torch.nn.Module) -> Optional[str]:
    """Why :class:`FusedDecoder` cannot compute ``chunk``'s decoder exactly (None when it can)."""
    from megatron.core.transformer.mlp import MLP

    decoder = chunk.decoder
    cfg = chunk.config
    if getattr(cfg, "fp32_residual_connection", False) or getattr(cfg, "apply_residual_connection_post_layernorm",
                                                                  False):
        return "fp32_residual_connection or apply_residual_connection_post_layernorm"
    if not cfg.gated_linear_unit or cfg.activation_func is not F.silu:
        return "the MLP is not SwiGLU"
    if getattr(cfg, "use_te_activation_func", False) or getattr(cfg, "activation_func_clamp_value", None) is not None \
            or getattr(cfg, "glu_linear_offset", 0.0):
        return "a TE activation, a clamped or offset GLU"
    final = getattr(decoder, "final_layernorm", None)
    if final is not None and not _is_rms_norm(final):
        return f"the final norm is a {type(final).__name__}"
    if not len(decoder.layers):
        return "no layers"
    for i, layer in enumerate(decoder.layers):
        if not isinstance(layer.self_attention, KVCacheSelfAttention):
            return f"layer {i}'s attention is not the KV-cache attention"
        if not (_is_rms_norm(layer.input_layernorm) and _is_rms_norm(layer.pre_mlp_layernorm)):
            return f"layer {i}'s norms are not RMSNorms"
        if type(layer.mlp) is not MLP:
            return f"layer {i}'s MLP is a {type(layer.mlp).__name__}"
        if type(getattr(layer, "cross_attention", None)).__name__ != "IdentityOp":
            return f"layer {i} has cross-attention"
        for linear in (layer.self_attention.linear_proj, layer.mlp.linear_fc1, layer.mlp.linear_fc2):
            if getattr(linear, "bias", None) is not None:
                return f"layer {i} has linear biases"
        if layer.training and cfg.hidden_dropout > 0:
            return "hidden dropout while training"
    return None


class FusedDecoder:
    """A stage's decoder layers computed with :func:`add_rms_norm` and :func:`swiglu` (module docstring)."""

    def __init__(self, chunk: torch.nn.Module) -> None:
        self.chunk = chunk
        decoder = chunk.decoder
        self.layers = list(decoder.layers)
        self.final_norm = getattr(decoder, "final_layernorm", None)

    def __call__(self, hidden_T1H: torch.Tensor) -> torch.Tensor:
        layers = self.layers
        dtype = hidden_T1H.dtype
        first = layers[0].input_layernorm
        residual = hidden_T1H
        hidden = first(hidden_T1H)  # the stage's StepRMSNorm (its kernel) or torch's RMSNorm
        quantized = None  # hidden's FP8 quantization, made by the kernel that made it, for an FP8 linear
        for i, layer in enumerate(layers):
            attention_module, mlp = layer.self_attention, layer.mlp
            with _offered(attention_module.linear_qkv, hidden, quantized):
                attention, _ = attention_module(hidden, attention_mask=None)
            norm = layer.pre_mlp_layernorm
            residual, hidden, quantized = add_rms_norm(attention, residual, norm.weight, _norm_eps(norm, dtype),
                                                       quantize=_fp8_input(mlp.linear_fc1))
            with _offered(mlp.linear_fc1, hidden, quantized):
                fc1, _ = mlp.linear_fc1(hidden)
            act, act_quantized = swiglu(fc1, quantize=_fp8_input(mlp.linear_fc2))
            with _offered(mlp.linear_fc2, act, act_quantized):
                out, _ = mlp.linear_fc2(act)
            last = i + 1 == len(layers)
            norm = self.final_norm if last else layers[i + 1].input_layernorm
            weight = norm.weight if norm is not None else None
            quantize = not last and _fp8_input(layers[i + 1].self_attention.linear_qkv)
            residual, hidden, quantized = add_rms_norm(out, residual, weight, _norm_eps(norm, dtype)
                                                       if norm is not None else 0.0, quantize=quantize)
        return hidden if self.final_norm is not None else residual


def _fp8_input(linear: torch.nn.Module) -> bool:
    """Whether ``linear`` multiplies in FP8 now (its weight in its FP8 table) and takes an input quantized ahead:
    a column-parallel linear (its input is used as it is), or a row-parallel one on one rank (no reduction)."""
    table = getattr(linear, "fp8_table", None)
    if table is None or table.get(linear.weight) is None or not use_triton(linear.weight):
        return False
    group = getattr(linear, "tp_group", None)
    return isinstance(linear, ColumnParallelLinear) or group is None or group.size() == 1


@contextmanager
def _offered(linear: torch.nn.Module, x: torch.Tensor, quantized: Optional[Quantized]) -> Iterator[None]:
    """``linear`` (an FP8 linear) takes ``quantized`` as the quantization of its input ``x`` in the body."""
    if quantized is None:
        yield
        return
    with linear.fp8_table.offered(x, *quantized):
        yield


def install_fused_decoder(chunk: torch.nn.Module, device: torch.device, *, enabled: Optional[bool]) -> \
        Optional[FusedDecoder]:
    """The stage's :class:`FusedDecoder` when ``enabled`` (None: on a GPU with Triton, where its kernels run) and
    every layer qualifies (:func:`why_not_fused`); None otherwise. ``enabled=True`` on a stage that does not
    qualify is a ValueError naming why."""
    explicit = enabled is True
    if enabled is None:
        enabled = device.type == "cuda" and HAVE_TRITON
    if not enabled:
        return None
    why = why_not_fused(chunk)
    if why is None:
        return FusedDecoder(chunk)
    if explicit:
        raise ValueError(f"GenerationConfig.fused_decoder=True: this stage's layers cannot run fused ({why})")
    return None


if HAVE_TRITON:

    @triton.jit
    def _swiglu_kernel(x_ptr, out_ptr, amax_ptr, x_stride, width, chunks, BLOCK: tl.constexpr, AMAX: tl.constexpr):
        # Program (row t, chunk c): SwiGLU of the chunk, rounded as the eager formula; with AMAX also the chunk's
        # amax(|y|) of the rounded values into amax[t, c].
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        a = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + row * x_stride + width + cols, mask=ok, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        silu = tl.math.div_rn(a, 1.0 + tl.exp(-a)).to(dtype)
        y = (silu.to(tl.float32) * b).to(dtype)
        tl.store(out_ptr + row * width + cols, y, mask=ok)
        if AMAX:
            tl.store(amax_ptr + row * chunks + chunk, tl.max(tl.abs(y.to(tl.float32)), axis=0))

    @triton.jit
    def _quantize_chunks_kernel(y_ptr, amax_ptr, q_ptr, scale_ptr, width, chunks, fp8_max, BLOCK: tl.constexpr,
                                BLOCK_C: tl.constexpr):
        # Program (row t, chunk c): the row's scale from its chunks' amaxes (written by chunk 0), and the chunk's
        # FP8 values: the bits quantize_activations gives for the row.
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        c = tl.arange(0, BLOCK_C)
        amax = tl.max(tl.load(amax_ptr + row * chunks + c, mask=c < chunks, other=0.0), axis=0)
        scale = tl.math.div_rn(amax, fp8_max)
        scale = tl.where(scale == 0.0, 1.0, scale)
        if chunk == 0:
            tl.store(scale_ptr + row, scale)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        y = tl.load(y_ptr + row * width + cols, mask=ok, other=0.0).to(tl.float32)
        q = tl.math.div_rn(y, tl.zeros([BLOCK], tl.float32) + scale)
        tl.store(q_ptr + row * width + cols, q.to(q_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, sum_ptr, out_ptr, q_ptr, scale_ptr, H, eps, fp8_max,
                             BLOCK: tl.constexpr, QUANT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < H
        x = tl.load(x_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
        r = tl.load(res_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        s = (x + r).to(dtype)
        tl.store(sum_ptr + row * H + cols, s, mask=ok)
        up = s.to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(up * up, axis=0) / H + eps)
        normed = (up * inv * w).to(dtype)
        tl.store(out_ptr + row * H + cols, normed, mask=ok)
        if QUANT:  # the rounded normed row, as quantize_activations quantizes it
            n = normed.to(tl.float32)
            scale = tl.math.div_rn(tl.max(tl.abs(n), axis=0), fp8_max)
            scale = tl.where(scale == 0.0, 1.0, scale)
            tl.store(scale_ptr + row, scale)
            q = tl.math.div_rn(n, tl.zeros([BLOCK], tl.float32) + scale)
            tl.store(q_ptr + row * H + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
