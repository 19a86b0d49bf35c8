"""Top-p (nucleus) sampling by the exponential race in one Triton kernel, without sorting the vocabulary.

:func:`top_p_race` draws one token per row from the nucleus of ``softmax(logits / temperature)``, with the race of
:mod:`megatron_hybrid.inference.sampling`: ``argmax(p / E)`` over the kept tokens, ``E ~ Exp(1)`` drawn by the
caller. The sort-based rule there ("keep the smallest prefix whose mass reaches top_p") is restated as a threshold,
which needs no order:

    token i is kept iff  f(x_i) <= top_p,   f(t) = sum of p_j over the tokens with x_j > t.

f is non-increasing, so the kept tokens are those with ``x_i >= t*`` for the smallest threshold t* with
``f(t*) <= top_p``, found by a search instead of a sort. The two rules agree except at exact ties at the boundary,
where this one keeps every tied token (the sorted rule keeps those the sort happens to put first).

The kernel runs one program per row and re-reads the row (from L2 on a GPU) once per pass:

1. the row's largest x and smallest order-preserving int32 key of the fp32 x (``key = bits`` for x >= 0,
   ``-(bits & 0x7FFFFFFF)`` below, so that -0.0 and +0.0 share key 0, as they compare equal);
2. the race over the candidates (at first every token), with the row's total mass;
3. the mass above the winner's key: the winner is kept iff it is at most ``top_p`` of the total. If it is not, no
   token at or below its key is kept (the kept tokens are those above a threshold t*), so passes 2-3 run again over
   the tokens above it, on the same draws. The winner over a superset of the nucleus that lies in the nucleus is
   the nucleus's own winner, so the result is the race over the kept tokens, found without t*. A winner falls
   outside with probability about ``1 - top_p``: a row takes ~3 passes on average (a 16-way search for t* took
   10; one H200 at batch 32, vocabulary 32000: 0.14 ms for that search against 0.24 ms for the sort).

Both this kernel and the PyTorch reference (:func:`_top_p_race_reference`, which every run without Triton, or on the
CPU outside Triton's interpreter, takes) compute ``x = logits.float() * (1 / temperature)``, the reciprocal rounded
to fp32: what PyTorch computes for ``logits / temperature`` on a GPU (a CUDA division by a host scalar multiplies
by its reciprocal; on the CPU it divides, which may differ by one unit in the last place). The masses are fp32 sums
in different orders in the two paths (and the GPU's ``exp`` is not the CPU's): a row whose boundary mass lies
within fp32 rounding (~1e-6 relative) of ``top_p`` may keep one token (or one group of tied tokens) more or fewer in
one than in the other, and two race values within that rounding of each other may rank differently. Otherwise the
two return the same tokens.

CUDA-graph capturable: no host syncs, the grid is the number of rows; ``temperature`` and ``top_p`` are host floats
baked into a captured launch.

Legend: n rows (sequences), V the logits' (padded) vocabulary, of which the first ``vocab_size`` are candidates.
"""

from __future__ import annotations

import math
import struct
from typing import Optional

import torch

from megatron_hybrid.kernels import HAVE_TRITON, use_triton, warn_cuda_fallback

if HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = ["HAVE_TRITON", "top_p_race", "use_triton"]

_BLOCK = 2048  # columns per step of a pass (8 per thread at 8 warps)
_NUM_WARPS = 8
# Rejection rounds before the kernel searches for the threshold itself (each rejects with probability ~1 - top_p).
_MAX_ROUNDS = 6
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fp32(value: float) -> float:
    """``value`` rounded to the nearest float32."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _inverse_temperature(temperature: float) -> float:
    # 1 / t correctly rounded to fp32, as CUDA PyTorch computes it for logits / t: the double quotient of two floats
    # rounds to the same float32 as an fp32 division (double has more than 2 * 24 + 2 bits).
    return _fp32(1.0 / _fp32(temperature))


def top_p_race(logits_nV: torch.Tensor, noise_nV: torch.Tensor, *, vocab_size: int, temperature: float,
               top_p: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One token per row from the top-p nucleus of ``softmax(logits_nV[:, :vocab_size] / temperature)``, by the
    exponential race ``argmax over kept i of p_i / E_i`` (ties to the lowest index).

    Token i is kept iff the probability mass of the tokens strictly more probable than it is at most ``top_p`` (see
    the module docstring for how this relates to sampling.sample()'s sorted prefix, and for rounding).

    Args:
        logits_nV: ``[n, V]`` float32, bfloat16 or float16, any strides; columns from ``vocab_size`` on are never
            read. Finite or -inf (no NaN, no +inf).
        noise_nV: ``[n, vocab_size]`` float32, any strides: the race's Exp(1) draws, floored at the smallest normal
            float32 as in sampling.sample().
        vocab_size: the number of candidate columns, ``1 <= vocab_size <= V``.
        temperature: > 0; the logits are multiplied by its reciprocal rounded to float32.
        top_p: in (0, 1).
        out: written with the tokens if given, ``[n]`` int64 on the logits' device.

    Returns:
        The tokens, ``[n]`` int64 (``out`` if given).

    Raises:
        ValueError: bad shapes, dtypes or devices, a temperature not positive and finite, or ``top_p`` outside
            (0, 1).
    """
    if logits_nV.dim() != 2 or logits_nV.dtype not in _LOGIT_DTYPES:
        raise ValueError(f"top_p_race: logits_nV must be 2-D [n, V] of a dtype in {_LOGIT_DTYPES}; got "
                         f"{tuple(logits_nV.shape)} {logits_nV.dtype}")
    n, V = logits_nV.shape
    if not 1 <= vocab_size <= V:
        raise ValueError(f"top_p_race: vocab_size={vocab_size} must be in 1 .. V={V} (logits_nV's columns)")
    if noise_nV.shape != (n, vocab_size) or noise_nV.dtype != torch.float32 or noise_nV.device != logits_nV.device:
        raise ValueError(f"top_p_race: noise_nV must be ({n}, {vocab_size}) float32 on {logits_nV.device}; got "
                         f"{tuple(noise_nV.shape)} {noise_nV.dtype} on {noise_nV.device}")
    if not (temperature > 0.0 and math.isfinite(temperature)):
        raise ValueError(f"top_p_race: temperature={temperature} must be positive and finite")
    if not 0.0 < top_p < 1.0:
        raise ValueError(f"top_p_race: top_p={top_p} must be in (0, 1)")
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=logits_nV.device)
    elif out.shape != (n,) or out.dtype != torch.int64 or out.device != logits_nV.device:
        raise ValueError(f"top_p_race: out is {tuple(out.shape)} {out.dtype} on {out.device}, expected ({n},) "
                         f"torch.int64 on {logits_nV.device}")
    if not use_triton(logits_nV):
        warn_cuda_fallback(logits_nV, "top-p sampling runs its PyTorch reference (a sort of the vocabulary per row)")
        return _top_p_race_reference(logits_nV, noise_nV, vocab_size=vocab_size, temperature=temperature,
                                     top_p=top_p, out=out)
    if n == 0:
        return out
    _top_p_race_kernel[(n,)](
        logits_nV, noise_nV, out, *logits_nV.stride(), *noise_nV.stride(), out.stride(0), vocab_size,
        _inverse_temperature(temperature), top_p, torch.finfo(torch.float32).tiny,
        BLOCK=_BLOCK, MAX_ROUNDS=_MAX_ROUNDS,
        # No fused multiply-add: x = logit * (1 / t) must be rounded before x - max, as in the reference.
        num_warps=_NUM_WARPS, enable_fp_fusion=False)
    return out


def _top_p_race_reference(logits_nV: torch.Tensor, noise_nV: torch.Tensor, *, vocab_size: int,
                          temperature: float, top_p: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`top_p_race` in PyTorch (unvalidated): the threshold from one sort and cumsum of each row."""
    x = logits_nV[:, :vocab_size].float() * _inverse_temperature(temperature)
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))  # p up to the row's normalisation
    kept = _nucleus(x, e, top_p)
    race = torch.where(kept, e / noise_nV.clamp(min=torch.finfo(torch.float32).tiny), -1.0)
    tokens = race.argmax(dim=-1)
    if out is None:
        return tokens
    return out.copy_(tokens)


def _nucleus(x_nV: torch.Tensor, e_nV: torch.Tensor, top_p: float) -> torch.Tensor:
    """The kept tokens, bool ``[n, V]``: those whose strictly larger ``x_nV`` carry at most ``top_p`` of the mass
    ``e_nV`` (``exp(x - max)``, fp32)."""
    x_sorted, order = x_nV.sort(dim=-1, descending=True)
    e_sorted = e_nV.gather(-1, order)
    # The mass before each sorted position (partial sums: non-decreasing). At the first position of a group of tied
    # x it is the mass strictly above the group; the positions where it is within the bound are a prefix, whose
    # last position lies in the last kept group: its x is the threshold.
    before = torch.cat([e_sorted.new_zeros(e_sorted.shape[0], 1), e_sorted[:, :-1].cumsum(dim=-1)], dim=-1)
    within = (before <= top_p * e_nV.sum(dim=-1, keepdim=True)).sum(dim=-1, keepdim=True)  # >= 1: before[0] = 0
    return x_nV >= x_sorted.gather(-1, within - 1)


# ---------------------------------------------------------------------------------------------------------------
# Kernel


if HAVE_TRITON:

    @triton.jit
    def _order_key(x):
        # fp32 -> int32 that orders as the floats do (for non-NaN): sign-magnitude to two's complement. -0.0 and
        # +0.0 both map to 0, and the range is [-(2**31 - 1), 2**31 - 1]: key - 1 cannot overflow.
        bits = x.to(tl.int32, bitcast=True)
        return tl.where(bits < 0, -(bits & 0x7FFFFFFF), bits)

    @triton.jit
    def _scaled_row(logits_row, stride_v, cols, valid, inv_temperature):
        return tl.load(logits_row + cols * stride_v, mask=valid, other=0.0).to(tl.float32) * inv_temperature

    @triton.jit
    def _race_above(logits_row, noise_row, logits_stride_v, noise_stride_v, vocab_size, inv_temperature, x_max, tiny,
                    bound, BLOCK: tl.constexpr):
        # The race's winner over the tokens with key > bound (the lowest column on a tie), and the row's total mass
        # sum exp(x - x_max) over every token.
        lanes = tl.arange(0, BLOCK)
        lane_best = tl.full([BLOCK], -1.0, tl.float32)
        lane_token = tl.zeros([BLOCK], tl.int32)
        lane_total = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab_size, BLOCK):
            cols = start + lanes
            valid = cols < vocab_size
            x = _scaled_row(logits_row, logits_stride_v, cols, valid, inv_temperature)
            e = tl.where(valid, tl.exp(x - x_max), 0.0)
            lane_total += e
            draw = tl.load(noise_row + cols * noise_stride_v, mask=valid, other=1.0)
            # IEEE division, as PyTorch's (Triton's `/` on fp32 is approximate). It flushes results below the smallest
            # normal float to 0: such values cannot beat the most probable token's 1 / E.
            race = tl.math.div_rn(e, tl.maximum(draw, tiny))
            race = tl.where(valid & (_order_key(x) > bound), race, -1.0)
            # Per lane the first best (later steps of a lane hold larger columns), then the lowest column.
            better = race > lane_best
            lane_best = tl.where(better, race, lane_best)
            lane_token = tl.where(better, cols, lane_token)
        best = tl.max(lane_best, axis=0)
        token = tl.min(tl.where(lane_best == best, lane_token, 2147483647), axis=0)
        return token, tl.sum(lane_total, axis=0)

    @triton.jit
    def _top_p_race_kernel(
        logits_ptr, noise_ptr, out_ptr,
        logits_stride_n, logits_stride_v, noise_stride_n, noise_stride_v, out_stride,
        vocab_size, inv_temperature, top_p, tiny,
        BLOCK: tl.constexpr, MAX_ROUNDS: tl.constexpr,
    ):
        # Program: one row. Row offsets in int64 (n * V passes 2**31 for long batches of large vocabularies).
        row = tl.program_id(0).to(tl.int64)
        logits_row = logits_ptr + row * logits_stride_n
        noise_row = noise_ptr + row * noise_stride_n
        lanes = tl.arange(0, BLOCK)

        # Pass 1: the largest x (the softmax shift) and the smallest key, per lane, then over the lanes.
        lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_min_key = tl.full([BLOCK], 2147483647, tl.int32)
        for start in range(0, vocab_size, BLOCK):
            cols = start + lanes
            valid = cols < vocab_size
            x = _scaled_row(logits_row, logits_stride_v, cols, valid, inv_temperature)
            lane_max = tl.maximum(lane_max, tl.where(valid, x, float("-inf")))
            lane_min_key = tl.minimum(lane_min_key, tl.where(valid, _order_key(x), 2147483647))
        x_max = tl.max(lane_max, axis=0)

        # The race restricted to the nucleus, by rejection: the race's winner w over the candidates (at first every
        # token) is kept iff mass(key > key_w) <= top_p * total. If it is not, no token with key <= key_w is kept
        # (the kept tokens are those above a threshold), so the candidates become key > key_w and the race is run
        # again on the same draws: the winner over a superset of the nucleus that lies in the nucleus is the
        # nucleus's winner. A winner falls outside with probability about 1 - top_p, so a row takes ~3 passes
        # (the max, the race with the total, the mass above the winner), not a search of ~10.
        bound = tl.min(lane_min_key, axis=0) - 1  # candidates: key > bound (every token)
        token = tl.zeros([], tl.int32)
        done = tl.zeros([], tl.int32)
        rounds = tl.zeros([], tl.int32)
        total = tl.zeros([], tl.float32)
        # A constexpr condition, resolved at compile time: with MAX_ROUNDS = 0 the loop fails the GPU compile (MLIR).
        if MAX_ROUNDS > 0:
            while (done == 0) & (rounds < MAX_ROUNDS):
                rounds += 1
                token, total = _race_above(logits_row, noise_row, logits_stride_v, noise_stride_v, vocab_size,
                                           inv_temperature, x_max, tiny, bound, BLOCK)
                winner_key = _order_key(_scaled_row(logits_row, logits_stride_v, token, True, inv_temperature))
                lane_above = tl.zeros([BLOCK], tl.float32)
                for start in range(0, vocab_size, BLOCK):
                    cols = start + lanes
                    valid = cols < vocab_size
                    x = _scaled_row(logits_row, logits_stride_v, cols, valid, inv_temperature)
                    lane_above += tl.where(valid & (_order_key(x) > winner_key), tl.exp(x - x_max), 0.0)
                done = (tl.sum(lane_above, axis=0) <= top_p * total).to(tl.int32)
                bound = winner_key
        if done == 0:
            # Still outside after MAX_ROUNDS (draws that favour improbable tokens, round after round): the threshold
            # t* itself, by a 16-way search over (bound, key(max)] (mass(key > bound) > top_p * total: the last
            # winner was rejected), then the race above it. Bounded: 8 more passes.
            lo = bound.to(tl.int64)
            hi = _order_key(x_max).to(tl.int64)
            k = tl.arange(0, 16).to(tl.int64) + 1
            search_lanes = tl.arange(0, 512)[None, :]  # [16, 512] partial sums: 32 registers a thread at 8 warps
            for _ in range(8):
                candidates = lo + ((hi - lo) * k + 15) // 16
                candidate_keys = candidates.to(tl.int32)[:, None]
                above = tl.zeros([16, 512], tl.float32)
                lane_total = tl.zeros([1, 512], tl.float32)
                for start in range(0, vocab_size, 512):
                    cols = start + search_lanes
                    valid = cols < vocab_size
                    x = _scaled_row(logits_row, logits_stride_v, cols, valid, inv_temperature)
                    e = tl.where(valid, tl.exp(x - x_max), 0.0)
                    above += tl.where(_order_key(x) > candidate_keys, e, 0.0)
                    lane_total += e
                total = tl.sum(tl.sum(lane_total, axis=1), axis=0)
                meets = (tl.sum(above, axis=1) <= top_p * total) | (k == 16)
                new_hi = tl.min(tl.where(meets, candidates, hi), axis=0)
                lo = tl.max(tl.where(meets, lo, candidates), axis=0)
                hi = new_hi
            # The race over key >= t*, i.e. key > t* - 1 (t* > the smallest key - 1 >= -2**31: no overflow).
            token, _ = _race_above(logits_row, noise_row, logits_stride_v, noise_stride_v, vocab_size,
                                   inv_temperature, x_max, tiny, hi.to(tl.int32) - 1, BLOCK)
        tl.store(out_ptr + row * out_stride, token.to(tl.int64))
