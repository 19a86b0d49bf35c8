"""Triton kernels of the KV-cache decode step: attention over each slot's filled positions, and the rotary
embedding fused with the write of K/V into the cache.

- :func:`decode_attention`: one query token per row against its slot's cached positions, flash-decoding style. Row
  b reads slot b, or slot ``slots_B[b]``: rows may then share a slot with different lengths, as a prefill chunk's
  tokens riding along a decode step do. A program handles one (row, key/value head, split) and loops over the row's
  filled positions only (its length is loaded on the device), so the cost follows the real lengths, not the padded
  ``max_length``. The R query heads of a group are R rows of one ``tl.dot`` (padded to 16 rows for the tensor
  cores), so a key is read once per group. When rows times heads are too few to fill the GPU, the positions are
  split into chunks whose partial softmax statistics a second small kernel combines.
- :func:`rope_kv_write`: adds ``linear_qkv``'s bias (when given), splits its output into query, key and value,
  applies megatron-core's unfused rotary embedding to query and key with the same rounding as eager PyTorch (bit for
  bit), writes key and value into each token's cache slot and position, and returns the rotated queries.

Triton is optional. Each function runs a pure-PyTorch reference with the same signature when :func:`use_triton`
says no: Triton is not importable, or the tensors are on the CPU outside Triton's interpreter
(``TRITON_INTERPRET=1``, which the tests use). Both paths are CUDA-graph capturable: no host syncs, launch grids
from shapes and host ints only. A shape the kernels do not handle raises ValueError on the Triton path, naming the
condition, so that a caller can fall back to the reference.

Legend: B decode rows (query tokens), G key/value heads and R query heads per key/value head on this tensor-parallel
rank, D head dimension, N slots of the cache, L positions per slot, T tokens, X = G * (R + 2) * D the width of
``linear_qkv``'s output, Dr the rotary dimensions (D * rotary_percent), S splits of a slot's positions.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..kernels import HAVE_TRITON, next_pow2, num_sms, use_triton, warn_cuda_fallback

if HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = ["decode_attention", "decode_attention_supported", "rms_norm", "rope_kv_write"]

_LOG2E = 1.4426950408889634
_BLOCK_N = 64  # cached positions per inner step of decode attention
_MIN_ROWS = 16  # tl.dot needs at least 16 rows: the R query rows of a group are padded to this (masked)
_MAX_HEAD_DIM = 256  # one [BLOCK_N, D] tile of keys and one of values per pipeline stage in shared memory
_MAX_RATIO = 64  # fp32 accumulator [R, D] in registers
_SPLIT_MIN_POSITIONS = 128  # a split covers at least this many positions: its q load and partial write amortise
_NO_SPLIT_LENGTH = 256  # at or below this max_length a slot is one program: the combine would cost more than it saves
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_DECODE_FALLBACK = "the KV-cache decode kernels run their PyTorch reference"


def decode_attention_supported(head_dim: int, ratio: int) -> bool:
    """Whether :func:`decode_attention` runs its kernel for heads of ``head_dim`` with ``ratio`` query heads per
    key/value head (when Triton is there)."""
    return HAVE_TRITON and head_dim <= _MAX_HEAD_DIM and ratio <= _MAX_RATIO


def _split_plan(programs: int, max_length: int, num_sms: int, num_splits: Optional[int]) -> tuple[int, int]:
    """``(splits, chunk)``: the positions ``0 .. max_length-1`` of a slot in ``splits`` chunks of ``chunk``.

    Without ``num_splits``: one chunk when the ``programs`` (rows times heads) already give every SM two programs,
    or when the context is short; otherwise enough chunks for ~2 programs per SM, each at least
    ``_SPLIT_MIN_POSITIONS`` long. Chunks are whole ``_BLOCK_N`` steps, so a given ``num_splits`` is an upper bound.
    """
    if num_splits is None:
        if max_length <= _NO_SPLIT_LENGTH or programs >= 2 * num_sms:
            num_splits = 1
        else:
            num_splits = min(math.ceil(2 * num_sms / programs), math.ceil(max_length / _SPLIT_MIN_POSITIONS))
    elif num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be at least 1")
    chunk = math.ceil(math.ceil(max_length / num_splits) / _BLOCK_N) * _BLOCK_N
    return math.ceil(max_length / chunk), chunk


# ---------------------------------------------------------------------------------------------------------------
# Decode attention


def decode_attention(q_BGRD: torch.Tensor, keys_NGLD: torch.Tensor, values_NGLD: torch.Tensor,
                     lengths_B: torch.Tensor, *, scale: float, max_length: int, out: Optional[torch.Tensor] = None,
                     num_splits: Optional[int] = None, slots_B: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of one query token per row over its slot's cached keys and values.

    Args:
        q_BGRD: the queries of rows ``0 .. B-1``, query head ``g * R + r`` at ``[b, g, r]``; any strides.
        keys_NGLD: the key cache (N >= B without ``slots_B``); any strides.
        values_NGLD: the value cache, like the keys.
        lengths_B: integer tensor on the queries' device: row b attends to positions ``0 .. lengths_B[b] - 1`` of
            its slot (``1 <= lengths_B[b] <= max_length``; not checked, it lives on the device).
        scale: multiplies the scores ``q . k``.
        max_length: a host bound on ``lengths_B`` (``<= L``). The kernels read only the filled positions and use
            it to size the splits; the reference reads (and masks) ``max_length`` positions per slot.
        out: written with the result if given, ``[B, G, R, D]`` of the queries' dtype, any strides.
        num_splits: overrides the heuristic for how many chunks a row's filled positions are split into (an upper
            bound: chunks are whole steps of 64 positions). The heuristic plans the splits for ``max_length``, and
            each row cuts its own length into that many chunks of at least 128 positions.
        slots_B: integer tensor on the queries' device: row b reads cache slot ``slots_B[b]`` (``0 <= slots_B[b] <
            N``; not checked). Rows may share a slot, each with its own length. Without it row b reads slot b.

    Returns:
        ``[B, G, R, D]`` in the queries' dtype (``out`` if given). Softmax and accumulation are fp32; the Triton
        path rounds the probabilities to the values' dtype for the second product, as flash attention does.

    Raises:
        ValueError: inconsistent shapes or dtypes; on the Triton path also D > 256, R > 64 or a dtype other than
        float16 / bfloat16 / float32.
    """
    B, G, R, D = q_BGRD.shape
    N, G_k, L, D_k = keys_NGLD.shape
    if values_NGLD.shape != keys_NGLD.shape or (G_k, D_k) != (G, D) or (slots_B is None and N < B):
        slot_count = "N >= B" if slots_B is None else "N"
        raise ValueError(f"decode_attention: queries {tuple(q_BGRD.shape)} [B, G, R, D] need key and value caches "
                         f"[{slot_count}, G, L, D]; got keys {tuple(keys_NGLD.shape)}, values "
                         f"{tuple(values_NGLD.shape)}")
    if not q_BGRD.dtype == keys_NGLD.dtype == values_NGLD.dtype:
        raise ValueError(f"decode_attention: queries ({q_BGRD.dtype}), keys ({keys_NGLD.dtype}) and values "
                         f"({values_NGLD.dtype}) must share a dtype")
    if lengths_B.shape != (B,):
        raise ValueError(f"decode_attention: lengths_B has shape {tuple(lengths_B.shape)}, expected ({B},)")
    if slots_B is not None and (slots_B.shape != (B,) or slots_B.dtype.is_floating_point or slots_B.dtype.is_complex
                                or slots_B.dtype == torch.bool):
        raise ValueError(f"decode_attention: slots_B is {tuple(slots_B.shape)} {slots_B.dtype}, expected ({B},) of an "
                         f"integer dtype")
    if not 1 <= max_length <= L:
        raise ValueError(f"decode_attention: max_length={max_length} must be in 1 .. L={L}")
    if out is None:
        out = q_BGRD.new_empty(B, G, R, D)
    elif out.shape != q_BGRD.shape or out.dtype != q_BGRD.dtype:
        raise ValueError(f"decode_attention: out is {tuple(out.shape)} {out.dtype}, expected "
                         f"{tuple(q_BGRD.shape)} {q_BGRD.dtype}")
    if not use_triton(q_BGRD):
        warn_cuda_fallback(q_BGRD, _DECODE_FALLBACK)
        return _decode_attention_reference(q_BGRD, keys_NGLD, values_NGLD, lengths_B, scale=scale,
                                           max_length=max_length, out=out, slots_B=slots_B)
    if D > _MAX_HEAD_DIM or R > _MAX_RATIO or q_BGRD.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"decode_attention: the Triton kernel needs head_dim D <= {_MAX_HEAD_DIM}, query heads per "
                         f"key/value head R <= {_MAX_RATIO} and a dtype in {_KERNEL_DTYPES}; got D={D}, R={R}, "
                         f"{q_BGRD.dtype}")
    if B == 0:
        return out
    splits, chunk = _split_plan(B * G, max_length, num_sms(q_BGRD.device), num_splits)
    block_r, block_d = max(_MIN_ROWS, next_pow2(R)), max(16, next_pow2(D))
    # fp32 inputs: full-precision products (Triton's default for fp32 tl.dot is TF32); ignored for 16-bit inputs.
    precision = "ieee" if q_BGRD.dtype == torch.float32 else "tf32"
    launch = dict(HEAD_DIM=D, BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_N=_BLOCK_N, DOT_PRECISION=precision,
                  HAS_SLOTS=slots_B is not None, num_warps=4, num_stages=3 if block_d <= 128 else 2)
    slots = lengths_B if slots_B is None else slots_B  # a pointer the kernel never reads without HAS_SLOTS
    if splits == 1:
        _decode_split_kernel[(B, G, 1)](
            q_BGRD, keys_NGLD, values_NGLD, lengths_B, slots, out, out, out, *q_BGRD.stride(), *keys_NGLD.stride(),
            *values_NGLD.stride(), out.stride(0), out.stride(1), 0, out.stride(2), out.stride(3), R, chunk,
            scale * _LOG2E, PARTIAL=False, **launch)
        return out
    # Per split: the running max (log2 domain) and sum of each query row, and its unnormalised fp32 output.
    part_BGSRD = torch.empty(B, G, splits, R, D, device=q_BGRD.device, dtype=torch.float32)
    max_BGSR = torch.empty(B, G, splits, R, device=q_BGRD.device, dtype=torch.float32)
    sum_BGSR = torch.empty_like(max_BGSR)
    # Each row splits its own length (the plan's chunk is for max_length, a host bound that a graph bakes in):
    # chunks of at least _SPLIT_MIN_POSITIONS, or of one step when num_splits is given.
    min_chunk = _BLOCK_N if num_splits is not None else min(chunk, _SPLIT_MIN_POSITIONS)
    _decode_split_kernel[(B, G, splits)](
        q_BGRD, keys_NGLD, values_NGLD, lengths_B, slots, part_BGSRD, max_BGSR, sum_BGSR, *q_BGRD.stride(),
        *keys_NGLD.stride(), *values_NGLD.stride(), *part_BGSRD.stride(), R, min_chunk, scale * _LOG2E,
        PARTIAL=True, **launch)
    _decode_combine_kernel[(B, G)](
        part_BGSRD, max_BGSR, sum_BGSR, out, *part_BGSRD.stride(), *out.stride(), splits, R,
        HEAD_DIM=D, BLOCK_S=next_pow2(splits), BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
    return out


def _decode_attention_reference(q_BGRD: torch.Tensor, keys_NGLD: torch.Tensor, values_NGLD: torch.Tensor,
                                lengths_B: torch.Tensor, *, scale: float, max_length: int,
                                out: Optional[torch.Tensor] = None,
                                slots_B: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`decode_attention` in PyTorch: one fp32 softmax over ``max_length`` positions, masked by the lengths."""
    B = q_BGRD.shape[0]
    # long(): PyTorch indexes with int64 or int32 only, and would take uint8 for a mask.
    slots = slice(B) if slots_B is None else slots_B.long()
    k_BGLD = keys_NGLD[slots, :, :max_length].float()
    v_BGLD = values_NGLD[slots, :, :max_length].float()
    scores_BGRL = torch.matmul(q_BGRD.float(), k_BGLD.transpose(-1, -2)) * scale
    filled_B11L = (torch.arange(max_length, device=q_BGRD.device) < lengths_B[:, None])[:, None, None, :]
    probs_BGRL = torch.softmax(scores_BGRL.masked_fill(~filled_B11L, float("-inf")), dim=-1)
    result = torch.matmul(probs_BGRL, v_BGLD)
    if out is None:
        return result.to(q_BGRD.dtype)
    return out.copy_(result)


# ---------------------------------------------------------------------------------------------------------------
# Rotary embedding and cache write


def rope_kv_write(mixed_qkv_TX: torch.Tensor, cos_TDr: Optional[torch.Tensor], sin_TDr: Optional[torch.Tensor],
                  slots_T: torch.Tensor, positions_T: torch.Tensor, keys_NGLD: torch.Tensor,
                  values_NGLD: torch.Tensor, *, groups: int, ratio: int, head_dim: int,
                  out_q: Optional[torch.Tensor] = None, bias_X: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``linear_qkv``'s bias added, rotary embedding of the queries and keys in its output, and the write of keys
    and values into the cache; returns the rotated queries.

    megatron-core lays out ``linear_qkv``'s output per key/value group g as R query heads, one key head and one
    value head, each ``head_dim`` wide: viewed as ``[T, G, (R + 2) * D]``. The rotary embedding is megatron-core's
    unfused, non-interleaved one (``rope_utils._apply_rotary_pos_emb_bshd``) on the first Dr dimensions of each
    head, the rest unchanged; the result equals eager PyTorch's bit for bit in every dtype, because the kernel
    rounds where PyTorch does (each product to the tensor's dtype, then their sum).

    Args:
        mixed_qkv_TX: ``linear_qkv``'s output for T tokens, ``[T, G * (R + 2) * D]``; any strides.
        cos_TDr: cosines of each token's rotary angles, in the tensor's dtype (Dr even, Dr <= D); None (with
            ``sin_TDr``) for a layer without rotary embeddings.
        sin_TDr: their sines, like ``cos_TDr``.
        slots_T: integer tensor: the cache slot of each token.
        positions_T: integer tensor: the position of each token in its slot. Pairs (slot, position) must be
            distinct.
        keys_NGLD: the key cache, of the tensor's dtype; key head g of token t goes to
            ``[slots_T[t], g, positions_T[t]]``.
        values_NGLD: the value cache, likewise (unrotated).
        groups: G.
        ratio: R.
        head_dim: D.
        out_q: written with the rotated queries if given, ``[T, G * R, D]``, any strides.
        bias_X: ``linear_qkv``'s bias ``[X]`` when the linear skipped adding it: added to every token first, rounded
            to the dtype as megatron-core's ``output + bias`` rounds it.

    Returns:
        The rotated queries ``[T, G * R, D]``, query head ``g * R + r`` (``out_q`` if given).
    """
    T, X = mixed_qkv_TX.shape
    G, R, D = groups, ratio, head_dim
    dtype = mixed_qkv_TX.dtype
    if X != G * (R + 2) * D:
        raise ValueError(f"rope_kv_write: mixed_qkv_TX has {X} columns, expected groups * (ratio + 2) * head_dim = "
                         f"{G} * ({R} + 2) * {D} = {G * (R + 2) * D}")
    if keys_NGLD.shape != values_NGLD.shape or keys_NGLD.shape[1] != G or keys_NGLD.shape[3] != D:
        raise ValueError(f"rope_kv_write: key and value caches must be [N, G={G}, L, D={D}]; got keys "
                         f"{tuple(keys_NGLD.shape)}, values {tuple(values_NGLD.shape)}")
    if not dtype == keys_NGLD.dtype == values_NGLD.dtype:
        raise ValueError(f"rope_kv_write: mixed_qkv_TX ({dtype}), keys ({keys_NGLD.dtype}) and values "
                         f"({values_NGLD.dtype}) must share a dtype")
    if slots_T.shape != (T,) or positions_T.shape != (T,):
        raise ValueError(f"rope_kv_write: slots_T {tuple(slots_T.shape)} and positions_T {tuple(positions_T.shape)} "
                         f"must both be ({T},)")
    if (cos_TDr is None) != (sin_TDr is None):
        raise ValueError("rope_kv_write: cos_TDr and sin_TDr must both be given or both be None")
    rot = 0
    if cos_TDr is not None:
        rot = cos_TDr.shape[-1]
        if cos_TDr.shape != (T, rot) or sin_TDr.shape != (T, rot) or rot % 2 or rot > D:
            raise ValueError(f"rope_kv_write: cos_TDr {tuple(cos_TDr.shape)} and sin_TDr {tuple(sin_TDr.shape)} "
                             f"must both be [T={T}, Dr] with Dr even and <= head_dim={D}")
        if not cos_TDr.dtype == sin_TDr.dtype == dtype:
            raise ValueError(f"rope_kv_write: cos_TDr ({cos_TDr.dtype}) and sin_TDr ({sin_TDr.dtype}) must be in "
                             f"mixed_qkv_TX's dtype ({dtype}): the rounding then matches the eager formula")
    if bias_X is not None and (bias_X.shape != (X,) or bias_X.dtype != dtype):
        raise ValueError(f"rope_kv_write: bias_X is {tuple(bias_X.shape)} {bias_X.dtype}, expected ({X},) {dtype}")
    if out_q is None:
        out_q = mixed_qkv_TX.new_empty(T, G * R, D)
    elif out_q.shape != (T, G * R, D) or out_q.dtype != dtype:
        raise ValueError(f"rope_kv_write: out_q is {tuple(out_q.shape)} {out_q.dtype}, expected ({T}, {G * R}, {D}) "
                         f"{dtype}")
    if not use_triton(mixed_qkv_TX):
        warn_cuda_fallback(mixed_qkv_TX, _DECODE_FALLBACK)
        return _rope_kv_write_reference(mixed_qkv_TX, cos_TDr, sin_TDr, slots_T, positions_T, keys_NGLD,
                                        values_NGLD, groups=G, ratio=R, head_dim=D, out_q=out_q, bias_X=bias_X)
    if dtype not in _KERNEL_DTYPES:
        raise ValueError(f"rope_kv_write: the Triton kernel needs a dtype in {_KERNEL_DTYPES}; got {dtype}")
    if T == 0:
        return out_q
    cos_strides = cos_TDr.stride() if rot else (0, 0)
    sin_strides = sin_TDr.stride() if rot else (0, 0)
    _rope_kv_write_kernel[(T, G)](
        mixed_qkv_TX, cos_TDr if rot else mixed_qkv_TX, sin_TDr if rot else mixed_qkv_TX, slots_T, positions_T,
        keys_NGLD, values_NGLD, out_q, bias_X if bias_X is not None else mixed_qkv_TX, *mixed_qkv_TX.stride(),
        *cos_strides, *sin_strides, *keys_NGLD.stride(), *values_NGLD.stride(), *out_q.stride(), RATIO=R,
        HEAD_DIM=D, ROT_DIM=rot, BLOCK_H=next_pow2(R + 2), BLOCK_D=next_pow2(D), HAS_BIAS=bias_X is not None,
        # No fused multiply-add: in fp32 PyTorch rounds x * cos before adding, and so must the kernel.
        num_warps=4, enable_fp_fusion=False)
    return out_q


def _rope_kv_write_reference(mixed_qkv_TX: torch.Tensor, cos_TDr: Optional[torch.Tensor],
                             sin_TDr: Optional[torch.Tensor], slots_T: torch.Tensor, positions_T: torch.Tensor,
                             keys_NGLD: torch.Tensor, values_NGLD: torch.Tensor, *, groups: int, ratio: int,
                             head_dim: int, out_q: Optional[torch.Tensor] = None,
                             bias_X: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`rope_kv_write` in PyTorch, megatron-core's formula op for op."""
    T = mixed_qkv_TX.shape[0]
    if bias_X is not None:
        mixed_qkv_TX = mixed_qkv_TX + bias_X
    qkv_TGHD = mixed_qkv_TX.unflatten(-1, (groups, ratio + 2, head_dim))  # H: R queries, the key, the value
    qk_TGHD = qkv_TGHD[:, :, :ratio + 1]
    if cos_TDr is not None:
        rot = cos_TDr.shape[-1]
        cos, sin = cos_TDr[:, None, None, :], sin_TDr[:, None, None, :]
        x, rest = qk_TGHD[..., :rot], qk_TGHD[..., rot:]
        x1, x2 = x.chunk(2, dim=-1)
        qk_TGHD = torch.cat((x * cos + torch.cat((-x2, x1), dim=-1) * sin, rest), dim=-1)
    # Advanced indices around a slice: cache[slot_t, :, pos_t] is [T, G, D], one row per token.
    keys_NGLD[slots_T, :, positions_T] = qk_TGHD[:, :, ratio]
    values_NGLD[slots_T, :, positions_T] = qkv_TGHD[:, :, ratio + 1]
    q_TQD = qk_TGHD[:, :, :ratio].reshape(T, groups * ratio, head_dim)
    if out_q is None:
        return q_TQD.clone() if cos_TDr is None else q_TQD  # never a view of mixed_qkv_TX
    return out_q.copy_(q_TQD)


# ---------------------------------------------------------------------------------------------------------------
# Kernels



# ---------------------------------------------------------------------------------------------------------------
# RMSNorm


def rms_norm(x_TH: torch.Tensor, weight_H: torch.Tensor, eps: float) -> torch.Tensor:
    """``torch.nn.functional.rms_norm(x, (H,), weight, eps)`` over the last dimension, one kernel per call.

    Rounding as PyTorch's CPU formula: ``(x * rsqrt(mean(x^2) + eps) * weight)`` in fp32, rounded once to x's dtype.
    The mean is summed in another order than PyTorch's, so results may differ from it by one unit in the last place.
    ``x_TH``: any leading shape, the last dimension contiguous.
    """
    H = x_TH.shape[-1]
    if weight_H.shape != (H,):
        raise ValueError(f"rms_norm: weight is {tuple(weight_H.shape)}, expected ({H},)")
    if not use_triton(x_TH) or x_TH.dtype not in _KERNEL_DTYPES or x_TH.stride(-1) != 1:
        up = x_TH.float()
        return (up * torch.rsqrt(up.pow(2).mean(-1, keepdim=True) + eps) * weight_H.float()).to(x_TH.dtype)
    rows = x_TH.reshape(-1, H)
    out = torch.empty(rows.shape, dtype=x_TH.dtype, device=x_TH.device)
    if rows.shape[0]:
        block = next_pow2(H)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight_H, out, rows.stride(0), H, eps, BLOCK=block,
                                           num_warps=8 if block >= 4096 else 4)
    return out.view(x_TH.shape)


if HAVE_TRITON:

    @triton.jit
    def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, lengths_ptr, slots_ptr, out_ptr, max_ptr, sum_ptr,
        q_stride_b, q_stride_g, q_stride_r, q_stride_d,
        k_stride_n, k_stride_g, k_stride_l, k_stride_d,
        v_stride_n, v_stride_g, v_stride_l, v_stride_d,
        out_stride_b, out_stride_g, out_stride_s, out_stride_r, out_stride_d,
        num_rows, chunk, qk_scale,
        HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        PARTIAL: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SLOTS: tl.constexpr,
    ):
        # Program (row b, key/value head g, split s): positions [s * c, min((s + 1) * c, length)) of the row's slot
        # (slots_ptr[b] with HAS_SLOTS, else b), c the row's chunk (below).
        # PARTIAL: write the unnormalised output and the row statistics of this split for the combine kernel;
        # otherwise (one split) the normalised output. Offsets of slots and heads in int64: a cache passes 2**31
        # elements. HEAD_DIM is a constexpr: a mask along the contiguous dimension with a runtime bound would stop
        # vectorised loads.
        b = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        if HAS_SLOTS:
            slot = tl.load(slots_ptr + b).to(tl.int64)
        else:
            slot = b
        split = tl.program_id(2)
        length = tl.load(lengths_ptr + b).to(tl.int32)
        # The row's own filled positions in as many chunks as there are splits (whole BLOCK_N steps, at least
        # ``chunk``): a slot much longer than its filled part still spreads its reads over every split.
        row_chunk = tl.maximum(tl.cdiv(tl.cdiv(length, tl.num_programs(2)), BLOCK_N) * BLOCK_N, chunk)
        start = split * row_chunk
        end = tl.minimum(start + row_chunk, length)
        rows = tl.arange(0, BLOCK_R)
        dims = tl.arange(0, BLOCK_D)
        cols = tl.arange(0, BLOCK_N)
        row_ok = rows < num_rows
        dim_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + b * q_stride_b + g * q_stride_g + rows[:, None] * q_stride_r + dims[None, :] * q_stride_d,
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        k_slot = k_ptr + slot * k_stride_n + g * k_stride_g
        v_slot = v_ptr + slot * v_stride_n + g * v_stride_g
        row_max = tl.full([BLOCK_R], float("-inf"), tl.float32)  # log2 domain
        row_sum = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        for first in range(start, end, BLOCK_N):
            pos = first + cols
            pos_ok = pos < end
            kv_ok = pos_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_slot + pos[:, None] * k_stride_l + dims[None, :] * k_stride_d, mask=kv_ok, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            scores = tl.where(pos_ok[None, :], scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, axis=1))  # finite: every step has a filled position
            correction = tl.exp2(row_max - new_max)
            probs = tl.exp2(scores - new_max[:, None])
            row_sum = row_sum * correction + tl.sum(probs, axis=1)
            v = tl.load(v_slot + pos[:, None] * v_stride_l + dims[None, :] * v_stride_d, mask=kv_ok, other=0.0)
            acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
            row_max = new_max
        out_ptrs = (out_ptr + b * out_stride_b + g * out_stride_g + split * out_stride_s + rows[:, None] * out_stride_r
                    + dims[None, :] * out_stride_d)
        out_ok = row_ok[:, None] & dim_ok[None, :]
        if PARTIAL:
            # An empty split (past the slot's length) leaves max -inf, sum 0 and output 0: weight 0 in the combine.
            stats = ((b * tl.num_programs(1) + g) * tl.num_programs(2) + split) * num_rows + rows
            tl.store(max_ptr + stats, row_max, mask=row_ok)
            tl.store(sum_ptr + stats, row_sum, mask=row_ok)
            tl.store(out_ptrs, acc, mask=out_ok)
        else:
            tl.store(out_ptrs, (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty), mask=out_ok)

    @triton.jit
    def _decode_combine_kernel(
        part_ptr, max_ptr, sum_ptr, out_ptr,
        part_stride_b, part_stride_g, part_stride_s, part_stride_r, part_stride_d,
        out_stride_b, out_stride_g, out_stride_r, out_stride_d,
        num_splits, num_rows,
        HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # Program (row b, head g): out = sum_s w_s * part_s / sum_s w_s * sum_s, w_s = 2 ** (max_s - max over s).
        b = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        splits = tl.arange(0, BLOCK_S)
        rows = tl.arange(0, BLOCK_R)
        dims = tl.arange(0, BLOCK_D)
        row_ok = rows < num_rows
        out_ok = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
        stats_base = (b * tl.num_programs(1) + g) * num_splits * num_rows
        stats = stats_base + splits[:, None] * num_rows + rows[None, :]
        stats_ok = (splits[:, None] < num_splits) & row_ok[None, :]
        split_max = tl.load(max_ptr + stats, mask=stats_ok, other=float("-inf"))
        split_sum = tl.load(sum_ptr + stats, mask=stats_ok, other=0.0)
        # Split 0 holds position 0, so a query row's max is finite; padded rows get 0 (no -inf - -inf).
        row_max = tl.where(row_ok, tl.max(split_max, axis=0), 0.0)
        total = tl.sum(tl.exp2(split_max - row_max[None, :]) * split_sum, axis=0)
        total = tl.where(row_ok, total, 1.0)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        part_rows = (part_ptr + b * part_stride_b + g * part_stride_g + rows[:, None] * part_stride_r
                     + dims[None, :] * part_stride_d)
        for s in range(0, num_splits):
            weight = tl.exp2(tl.load(max_ptr + stats_base + s * num_rows + rows, mask=row_ok, other=0.0) - row_max)
            part = tl.load(part_rows + s * part_stride_s, mask=out_ok, other=0.0)
            acc += weight[:, None] * part
        out_ptrs = (out_ptr + b * out_stride_b + g * out_stride_g + rows[:, None] * out_stride_r
                    + dims[None, :] * out_stride_d)
        tl.store(out_ptrs, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=out_ok)

    @triton.jit
    def _rope_kv_write_kernel(
        x_ptr, cos_ptr, sin_ptr, slots_ptr, positions_ptr, k_ptr, v_ptr, q_ptr, bias_ptr,
        x_stride_t, x_stride_c,
        cos_stride_t, cos_stride_d, sin_stride_t, sin_stride_d,
        k_stride_n, k_stride_g, k_stride_l, k_stride_d,
        v_stride_n, v_stride_g, v_stride_l, v_stride_d,
        q_stride_t, q_stride_h, q_stride_d,
        RATIO: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):
        # Program (token t, key/value group g): the group's R + 2 heads as rows of one tile, rows 0 .. R-1 the
        # queries, row R the key, row R + 1 the value. Rows 0 .. R are rotated on dims < ROT_DIM.
        t = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        tile_ok = (heads < RATIO + 2)[:, None] & dim_ok[None, :]
        group = x_ptr + t * x_stride_t + (g * (RATIO + 2) * HEAD_DIM + heads[:, None] * HEAD_DIM) * x_stride_c
        x = tl.load(group + dims[None, :] * x_stride_c, mask=tile_ok, other=0.0)
        # rotate_half: [-x2, x1] over the first ROT_DIM dims, x1 and x2 their halves.
        half = ROT_DIM // 2
        in_rot = dims < ROT_DIM
        partner = tl.where(dims < half, dims + half, dims - half)
        rotate = (heads < RATIO + 1)[:, None] & in_rot[None, :]
        xp = tl.load(group + partner[None, :] * x_stride_c, mask=rotate, other=0.0)
        if HAS_BIAS:  # linear_qkv's bias first, rounded to the dtype as megatron-core's add rounds it
            columns = g * (RATIO + 2) * HEAD_DIM + heads[:, None] * HEAD_DIM
            x = (x.to(tl.float32) + tl.load(bias_ptr + columns + dims[None, :], mask=tile_ok, other=0.0)
                 .to(tl.float32)).to(x.dtype)
            xp = (xp.to(tl.float32) + tl.load(bias_ptr + columns + partner[None, :], mask=rotate, other=0.0)
                  .to(tl.float32)).to(xp.dtype)
        xp = xp.to(tl.float32)
        xp = tl.where((dims < half)[None, :], -xp, xp)
        cos = tl.load(cos_ptr + t * cos_stride_t + dims * cos_stride_d, mask=in_rot, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + t * sin_stride_t + dims * sin_stride_d, mask=in_rot, other=0.0).to(tl.float32)
        # Eager PyTorch's rounding: x * cos and rotated * sin each rounded to the dtype, then their sum. (A product
        # of two 16-bit floats is exact in fp32: rounded once, it is the correctly rounded product however PyTorch
        # computes it.)
        dtype = x_ptr.dtype.element_ty
        x_cos = (x.to(tl.float32) * cos[None, :]).to(dtype)
        xp_sin = (xp * sin[None, :]).to(dtype)
        y = tl.where(rotate, (x_cos.to(tl.float32) + xp_sin.to(tl.float32)).to(dtype), x)
        tl.store(q_ptr + t * q_stride_t + (g * RATIO + heads[:, None]) * q_stride_h + dims[None, :] * q_stride_d, y,
                 mask=(heads < RATIO)[:, None] & dim_ok[None, :])
        slot = tl.load(slots_ptr + t).to(tl.int64)
        pos = tl.load(positions_ptr + t).to(tl.int64)
        # One row of the tile each: the other rows' pointers repeat it, masked off.
        row = heads[:, None] * 0 + dims[None, :]
        tl.store(k_ptr + slot * k_stride_n + g * k_stride_g + pos * k_stride_l + row * k_stride_d, y,
                 mask=(heads == RATIO)[:, None] & dim_ok[None, :])
        tl.store(v_ptr + slot * v_stride_n + g * v_stride_g + pos * v_stride_l + row * v_stride_d, y,
                 mask=(heads == RATIO + 1)[:, None] & dim_ok[None, :])

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_stride, H, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
        tl.store(out_ptr + row * H + cols, (x * r * w).to(out_ptr.dtype.element_ty), mask=mask)
