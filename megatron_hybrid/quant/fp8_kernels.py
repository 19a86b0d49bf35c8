"""Triton kernels of FP8 rollout weights: row quantization (the switch's weights and the linears' activations) and
a weight-only FP8 matrix multiply for small batches.

- :func:`quantize_rows_into`: rows of a 2-D tensor (any row stride, contiguous rows) into float8 e4m3 and one fp32
  scale per row, in one kernel that reads the input once (rows up to :data:`_ONE_PASS_MAX` elements stay in
  registers; longer rows are read a second time, from L2). The format is :mod:`megatron_hybrid.quant.fp8`'s, bit for
  bit: ``s = amax / 448`` (1 for a zero row) and ``q = (x / s)`` rounded to nearest even, with IEEE-rounded divisions
  (``div_rn``), as PyTorch computes them. It also quantizes with given scales (the shards of a row-parallel weight
  share their rows' scales) and computes row amaxes only.
- :func:`fp8_weight_matmul`: ``x @ (q * s).t()`` with ``x`` in bfloat16 and the weight streamed as FP8: each
  [BLOCK_N, BLOCK_K] tile of the weight is read once, converted to bfloat16 (exact: every e4m3 value is a bfloat16
  value) and multiplied on the tensor cores; the scales multiply the fp32 accumulator at the end. At a few tokens a
  decode step is bound by reading the weights, and FP8 halves those bytes; cuBLAS' FP8 GEMM at M = 32 reaches only
  about a third of the memory bandwidth on fc2 of a Llama-3-8B layer (issue 26). Narrow weights split K over
  several programs to fill the GPU; their fp32 partials are summed in a fixed order by a second kernel, so a result
  does not depend on scheduling (CUDA-graph replays equal eager runs bit for bit).

Both run on a GPU with Triton, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, the tests); each has
a PyTorch reference that the callers use elsewhere (:func:`use_triton`). Both are CUDA-graph capturable (no host
syncs; grids from shapes).

Legend: R rows, K their length (input features), N output features, M tokens, S splits of K.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..kernels.triton_helpers import HAVE_TRITON, next_pow2, use_triton
from ..kernels.triton_helpers import num_sms as device_sms

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0, e4m3's largest finite value

if HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = ["RowQuantizer", "fp8_matmul", "fp8_weight_matmul", "fp8_weight_matmul_reference", "quantize_rows_into",
           "use_triton"]

_ONE_PASS_MAX = 8192  # a row up to this long is read once, held in registers
_CHUNK = 4096  # elements per step of a longer row

#: Modes of :func:`quantize_rows_into` (and of its kernel).
QUANTIZE, QUANTIZE_WITH_SCALES, AMAX = 0, 1, 2


def quantize_rows_into(x_RK: torch.Tensor, out_RK: Optional[torch.Tensor], scale_R: torch.Tensor, *,
                       mode: int = QUANTIZE, config: Optional[dict] = None) -> None:
    """Quantize every row of ``x_RK`` (Triton; the caller checks :func:`supports_kernel`).

    ``mode``: :data:`QUANTIZE` writes each row's scale into ``scale_R`` and its FP8 values into ``out_RK``;
    :data:`QUANTIZE_WITH_SCALES` reads the scales from ``scale_R``; :data:`AMAX` writes each row's ``amax(|x|)``
    (fp32) into ``scale_R`` and nothing else (``out_RK`` unused). ``x_RK`` and ``out_RK``: 2-D, unit stride along
    K, any row stride; ``scale_R``: contiguous fp32. ``config`` overrides :func:`quantize_config` (a sweep).
    """
    R, K = x_RK.shape
    if R == 0 or K == 0:
        if mode == QUANTIZE:
            scale_R.fill_(1.0)
        elif mode == AMAX:
            scale_R.zero_()
        return
    out = out_RK if out_RK is not None else x_RK  # a pointer the AMAX kernel never writes
    c = config or quantize_config(K)
    _quantize_rows_kernel[(math.ceil(R / c["ROWS"]),)](
        x_RK, out, scale_R, R, K, x_RK.stride(0), out.stride(0), FP8_MAX, MODE=mode, ONE_PASS=c["ONE_PASS"],
        ROWS=c["ROWS"], BLOCK=c["BLOCK"], num_warps=c["num_warps"])


def quantize_config(K: int) -> dict:
    """Rows per program, block and warps of the quantization kernel for rows of K elements. Measured on an H200
    (bench/fp8_gemm.py's sweep, bench/results/fp8_gemm_h200.json): one row a program with 4 warps quantizes rows
    of 4096 at the copy bandwidth; a row held whole past 8192 elements runs at half of it, so longer rows are read
    in steps of 4096 and a second time (from L2) to quantize."""
    one_pass = K <= _ONE_PASS_MAX
    block = next_pow2(K) if one_pass else _CHUNK
    return dict(ONE_PASS=one_pass, BLOCK=block, ROWS=1, num_warps=4 if block <= 4096 else 8)


def supports_kernel(x_RK: torch.Tensor, out_RK: Optional[torch.Tensor] = None) -> bool:
    """Whether :func:`quantize_rows_into` runs for these tensors: Triton runs here (a GPU, or the interpreter), both
    2-D with unit stride along K, the input in a 16- or 32-bit float dtype."""
    ok = (use_triton(x_RK) and x_RK.dim() == 2 and x_RK.stride(1) == 1
          and x_RK.dtype in (torch.bfloat16, torch.float16, torch.float32))
    return ok and (out_RK is None or (out_RK.dim() == 2 and out_RK.stride(1) == 1))


def tiles_config(K: int) -> dict:
    """Launch parameters of :class:`RowQuantizer` for rows of K elements: :func:`quantize_config`'s, and ``TILE``
    rows share one table row."""
    return dict(quantize_config(K), TILE=1024)


class RowQuantizer:
    """Whole-row quantizations (``quantize_rows_into(x, out, scale, mode=QUANTIZE)``) of tensors that keep their
    addresses, such as a switch's FP8 weights, run as one kernel per row length and input dtype.

    The tensors' addresses go into a table once, one table row per ``TILE`` consecutive rows of a tensor (the
    addresses of the tile's first input row, FP8 row and scale, the row strides and its row count), so
    :meth:`run` costs one launch per group however many tensors there are: a switch of a Llama-3-8B shape
    quantizes 128 weights in two launches (rows of 4096 and of 14,336) instead of one or more launches each,
    whose host time exceeded the kernels' (issue 26).

    ``jobs``: ``(x [R, K], out [R, K] float8_e4m3fn, scale [R] fp32)``, each as :func:`quantize_rows_into` takes
    them (the caller checks :func:`supports_kernel`). Every tensor must keep its storage, shape and strides for the
    quantizer's lifetime: the quantizer holds references, and the caller must not give them new storage.
    ``config_for(K)`` overrides :func:`tiles_config` (a sweep).
    """

    COLUMNS = 6  # x address, x row stride, out address, out row stride, scale address, rows (the kernel reads these)
    MAX_TILES = 65535  # a grid's second dimension

    def __init__(self, jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], *, config_for=None) -> None:
        groups: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._ones: list[torch.Tensor] = []  # scales of rows with no elements: 1
        for x, out, scale in jobs:
            R, K = x.shape
            assert out.shape == x.shape and out.dtype == FP8_DTYPE and out.stride(1) == 1 and x.stride(1) == 1
            assert scale.shape == (R,) and scale.dtype == torch.float32 and scale.is_contiguous()
            if R and not K:
                self._ones.append(scale)
            elif R:
                groups.setdefault((K, x.dtype), []).append((x, out, scale))
        self.launches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, dict]] = []
        for (K, _), items in groups.items():
            c = dict((config_for or tiles_config)(K))
            # (no longer than the group's longest tensor: programs past a tile's rows do nothing)
            longest = -(-next_pow2(max(x.shape[0] for x, _, _ in items)) // c["ROWS"]) * c["ROWS"]
            tile = c["TILE"] = min(c["TILE"], longest)
            assert tile % c["ROWS"] == 0
            table = []
            for x, out, scale in items:
                for lo in range(0, x.shape[0], tile):
                    table.append([x[lo].data_ptr(), x.stride(0), out[lo].data_ptr(), out.stride(0),
                                  scale[lo].data_ptr(), min(tile, x.shape[0] - lo)])
            device = items[0][0].device
            c["ALIGNED"] = all(row[0] % 16 == 0 and row[2] % 16 == 0 and row[1] % 16 == 0 and row[3] % 16 == 0
                               for row in table)
            for lo in range(0, len(table), self.MAX_TILES):
                part = torch.tensor(table[lo: lo + self.MAX_TILES], dtype=torch.int64, device=device)
                self.launches.append((part, items[0][0], items[0][1], K, c))
        self.jobs = jobs  # the tensors whose addresses the tables hold

    def run(self) -> None:
        """Quantize every job's rows (asynchronously on a GPU; CUDA-graph capturable)."""
        for scale in self._ones:
            scale.fill_(1.0)
        for table, x_like, out_like, K, c in self.launches:
            grid = (c["TILE"] // c["ROWS"], table.shape[0])
            _quantize_tiles_kernel[grid](table, x_like, out_like, K, FP8_MAX, COLUMNS=self.COLUMNS,
                                         ONE_PASS=c["ONE_PASS"], ROWS=c["ROWS"], BLOCK=c["BLOCK"],
                                         ALIGNED=c["ALIGNED"], STAGES=c.get("STAGES", 1), num_warps=c["num_warps"])


# ---------------------------------------------------------------------------------------------------------------
# Weight-only FP8 matrix multiply

#: Tokens up to which ``megatron_hybrid.quant.fp8.fp8_linear`` multiplies with :func:`fp8_matmul` on a GPU (decode steps
#: of a few slots, bound by reading the weights); above it, ``torch._scaled_mm``. On an H200 at M = 32 the kernel
#: takes 77 us for a Llama-3-8B layer's four linears against cuBLAS' 120 us in bfloat16 and 128 us in FP8.
SMALL_M_MAX = 64
WEIGHT_ONLY_MAX_M = SMALL_M_MAX  # the weight-only kernel's tiles hold all M rows


def weight_only_plan(M: int, N: int, K: int, num_sms: int) -> dict:
    """Tile sizes and the split of K for ``[M, K] @ [N, K].t()`` at a few tokens. From a sweep on an H200 at
    M = 32 over a Llama-3-8B layer's linears (bench/fp8_gemm.py): 128 output features a program for wide weights
    (N >= 6144), 64 or (K > 8192) 32 for narrow ones; K in steps of 256 where it divides; K split until about 2
    programs run per SM (4 for K > 8192), each over at least 2 steps."""
    block_m = max(16, next_pow2(M))
    block_n = 128 if N >= 6144 else 64 if K <= 8192 else 32
    block_k = 256 if K % 256 == 0 else 128
    tiles = math.ceil(N / block_n)
    steps = math.ceil(K / block_k)
    target = (4 if K > 8192 else 2) * num_sms
    split = max(1, min(round(target / tiles), steps // 2))
    per_split = math.ceil(steps / split)
    split = math.ceil(steps / per_split)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, split=split, k_per_split=per_split * block_k,
                num_stages=3 if block_k == 256 else 5, num_warps=4)


def fp8_weight_matmul(x_MK: torch.Tensor, weight_NK: torch.Tensor, scale_N: torch.Tensor, *,
                      plan: Optional[dict] = None) -> torch.Tensor:
    """``x @ (weight.float() * scale[:, None]).t()`` as ``[M, N]`` in x's dtype (bfloat16 or float16), the FP8
    weight read once. fp32 accumulation; the scale is applied to the accumulated sums, then one rounding.

    ``plan`` overrides :func:`weight_only_plan` (a benchmark's sweep)."""
    M, K = x_MK.shape
    N = weight_NK.shape[0]
    if weight_NK.shape != (N, K) or weight_NK.dtype != FP8_DTYPE or scale_N.shape != (N,):
        raise ValueError(f"fp8_weight_matmul: x {tuple(x_MK.shape)} needs a float8_e4m3fn weight [N, {K}] and fp32 "
                         f"scales [N]; got {tuple(weight_NK.shape)} {weight_NK.dtype}, {tuple(scale_N.shape)}")
    if x_MK.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_weight_matmul: x is {x_MK.dtype}; the kernel takes bfloat16 or float16")
    return weight_matmul(x_MK if x_MK.stride(1) == 1 else x_MK.contiguous(), weight_NK, scale_N, plan=plan)


def weight_matmul(x_MK: torch.Tensor, weight_NK: torch.Tensor, scale_N: torch.Tensor, *,
                  plan: Optional[dict] = None, x_scale_M: Optional[torch.Tensor] = None,
                  out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The kernel of :func:`fp8_weight_matmul`, unchecked, for a weight of any dtype that converts to x's exactly
    (Triton's interpreter does not convert float8 values as the GPU does: its tests pass a bfloat16 weight).

    With ``x_scale_M`` (fp32 ``[M]``), ``x_MK`` is FP8 too (:func:`fp8_matmul`): both tiles go to the tensor cores
    as they are, and each output is scaled by its row's and its column's scales."""
    M, K = x_MK.shape
    N = weight_NK.shape[0]
    out = torch.empty(M, N, dtype=out_dtype or x_MK.dtype, device=x_MK.device)
    if M == 0:
        return out
    p = plan or weight_only_plan(M, N, K, device_sms(x_MK.device))
    split = p["split"]
    part = torch.empty(split, M, N, dtype=torch.float32, device=x_MK.device) if split > 1 else out
    x_scale = x_scale_M if x_scale_M is not None else scale_N  # a pointer read only with X_FP8
    grid = (math.ceil(N / p["BLOCK_N"]), split)
    _fp8_weight_matmul_kernel[grid](
        x_MK, weight_NK, scale_N, x_scale, out, part, M, N, K, x_MK.stride(0), weight_NK.stride(0),
        p["k_per_split"], BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"], SPLIT=split > 1,
        EVEN_K=K % p["BLOCK_K"] == 0 and p["k_per_split"] % p["BLOCK_K"] == 0, X_FP8=x_scale_M is not None,
        num_warps=p.get("num_warps", 4), num_stages=p.get("num_stages", 4))
    if split > 1:
        block = 128
        _sum_splits_kernel[(M, math.ceil(N / block))](part, scale_N, x_scale, out, N, split, M * N, BLOCK=block,
                                                      X_FP8=x_scale_M is not None, num_warps=4)
    return out


def fp8_matmul(x_fp8_MK: torch.Tensor, x_scale_M: torch.Tensor, weight_NK: torch.Tensor, scale_N: torch.Tensor, *,
               out_dtype: torch.dtype = torch.bfloat16, plan: Optional[dict] = None) -> torch.Tensor:
    """``(x_q * x_scale[:, None]) @ (w_q * scale[:, None]).t()`` for FP8 activations and weights at a few tokens:
    FP8 tensor-core products of each tile, K split over programs as :func:`fp8_weight_matmul` does (the same
    function as ``torch._scaled_mm`` row-wise, summed in another order)."""
    return weight_matmul(x_fp8_MK, weight_NK, scale_N, plan=plan, x_scale_M=x_scale_M, out_dtype=out_dtype)


def fp8_weight_matmul_reference(x_MK: torch.Tensor, weight_NK: torch.Tensor, scale_N: torch.Tensor) -> torch.Tensor:
    """:func:`fp8_weight_matmul` in PyTorch: the weight dequantized in fp32, one fp32 matmul, rounded once."""
    return (x_MK.float() @ (weight_NK.float() * scale_N[:, None]).t()).to(x_MK.dtype)


if HAVE_TRITON:

    @triton.jit
    def _quantize_rows_body(x_rows, out_rows, scale_ptr, rows, row_ok, K, fp8_max, MODE: tl.constexpr,
                            ONE_PASS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
        # ROWS rows at x_rows / out_rows ([ROWS, 1] pointers), their scales at scale_ptr + rows. MODE 0: amax,
        # scale, quantize; 1: quantize with the rows' given scales; 2: amax only. STAGES: loads in flight in
        # the loops over a long row's chunks (software pipelining; 1: none).
        cols = tl.arange(0, BLOCK)[None, :]
        if ONE_PASS:
            mask = row_ok[:, None] & (cols < K)
            x = tl.load(x_rows + cols, mask=mask, other=0.0).to(tl.float32)
        if MODE == 1:
            scale = tl.load(scale_ptr + rows, mask=row_ok, other=1.0)
        else:
            if ONE_PASS:
                amax = tl.max(tl.abs(x), axis=1)
            else:
                running = tl.zeros([ROWS, BLOCK], tl.float32)
                for start in tl.range(0, K, BLOCK, num_stages=STAGES):
                    chunk = tl.load(x_rows + start + cols, mask=row_ok[:, None] & (start + cols < K),
                                    other=0.0).to(tl.float32)
                    running = tl.maximum(running, tl.abs(chunk))
                amax = tl.max(running, axis=1)
            if MODE == 2:
                tl.store(scale_ptr + rows, amax, mask=row_ok)
            else:
                scale = tl.math.div_rn(amax, tl.zeros([ROWS], tl.float32) + fp8_max)
                scale = tl.where(scale == 0.0, 1.0, scale)
                tl.store(scale_ptr + rows, scale, mask=row_ok)
        if MODE != 2:
            if ONE_PASS:
                q = tl.math.div_rn(x, tl.zeros([ROWS, BLOCK], tl.float32) + scale[:, None])
                tl.store(out_rows + cols, q.to(out_rows.dtype.element_ty), mask=mask)
            else:
                for start in tl.range(0, K, BLOCK, num_stages=STAGES):
                    m = row_ok[:, None] & (start + cols < K)
                    chunk = tl.load(x_rows + start + cols, mask=m, other=0.0).to(tl.float32)
                    q = tl.math.div_rn(chunk, tl.zeros([ROWS, BLOCK], tl.float32) + scale[:, None])
                    tl.store(out_rows + start + cols, q.to(out_rows.dtype.element_ty), mask=m)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, R, K, x_stride, out_stride, fp8_max,
                              MODE: tl.constexpr, ONE_PASS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        # Program p: rows p*ROWS .. p*ROWS + ROWS-1 of one tensor.
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        _quantize_rows_body(x_ptr + rows[:, None] * x_stride, out_ptr + rows[:, None] * out_stride, scale_ptr,
                            rows, rows < R, K, fp8_max, MODE, ONE_PASS, ROWS, BLOCK, 1)

    @triton.jit
    def _quantize_tiles_kernel(table_ptr, x_like, out_like, K, fp8_max, COLUMNS: tl.constexpr,
                               ONE_PASS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                               ALIGNED: tl.constexpr, STAGES: tl.constexpr):
        # Program (p, t): rows p*ROWS .. p*ROWS + ROWS-1 of tile t, whose table row holds the addresses of its
        # first row (input, FP8 output, scale), the row strides and its row count (see RowQuantizer). ALIGNED:
        # every address is a multiple of 16 bytes and every row stride of 16 elements, which the compiler cannot
        # see in addresses loaded from memory; told so, it loads and stores 16 bytes at a time.
        entry = table_ptr + tl.program_id(1).to(tl.int64) * COLUMNS
        x_ptr = tl.load(entry).to(tl.pointer_type(x_like.dtype.element_ty))
        x_stride = tl.load(entry + 1)
        out_ptr = tl.load(entry + 2).to(tl.pointer_type(out_like.dtype.element_ty))
        out_stride = tl.load(entry + 3)
        if ALIGNED:
            x_ptr = tl.multiple_of(x_ptr, 16)
            out_ptr = tl.multiple_of(out_ptr, 16)
            x_stride = tl.multiple_of(x_stride, 16)
            out_stride = tl.multiple_of(out_stride, 16)
        scale_ptr = tl.load(entry + 4).to(tl.pointer_type(tl.float32))
        n_rows = tl.load(entry + 5)
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        _quantize_rows_body(x_ptr + rows[:, None] * x_stride, out_ptr + rows[:, None] * out_stride, scale_ptr,
                            rows, rows < n_rows, K, fp8_max, 0, ONE_PASS, ROWS, BLOCK, STAGES)

    @triton.jit
    def _fp8_weight_matmul_kernel(x_ptr, w_ptr, scale_ptr, x_scale_ptr, out_ptr, part_ptr, M, N, K, x_stride,
                                  w_stride, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                  BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                                  X_FP8: tl.constexpr):
        # Program (n tile, split s): out[:, tile] (or split s's fp32 partial) over K range [s*k_per_split, ...).
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        feats = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_ok = rows < M
        feat_ok = feats < N
        k_start = pid_s * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        x_tile = x_ptr + rows[:, None].to(tl.int64) * x_stride + ks[None, :]
        w_tile = w_ptr + feats[:, None].to(tl.int64) * w_stride + ks[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(k_start, k_end, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_tile + k, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_tile + k, mask=feat_ok[:, None], other=0.0)
            else:
                k_ok = (k + ks < k_end)[None, :]
                x = tl.load(x_tile + k, mask=row_ok[:, None] & k_ok, other=0.0)
                w = tl.load(w_tile + k, mask=feat_ok[:, None] & k_ok, other=0.0)
            if X_FP8:
                acc += tl.dot(x, tl.trans(w))
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        if SPLIT:
            offsets = (pid_s * M + rows[:, None]).to(tl.int64) * N + feats[None, :]
            tl.store(part_ptr + offsets, acc, mask=row_ok[:, None] & feat_ok[None, :])
        else:
            scale = tl.load(scale_ptr + feats, mask=feat_ok, other=0.0)
            y = acc * scale[None, :]
            if X_FP8:
                y = y * tl.load(x_scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
            tl.store(out_ptr + rows[:, None].to(tl.int64) * N + feats[None, :], y.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & feat_ok[None, :])

    @triton.jit
    def _sum_splits_kernel(part_ptr, scale_ptr, x_scale_ptr, out_ptr, N, splits, split_stride, BLOCK: tl.constexpr,
                           X_FP8: tl.constexpr):
        # Program (row m, feature block): the splits' partials summed in split order, scaled, rounded once.
        m = tl.program_id(0).to(tl.int64)
        feats = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = feats < N
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(0, splits):
            acc += tl.load(part_ptr + s * split_stride + m * N + feats, mask=ok, other=0.0)
        y = acc * tl.load(scale_ptr + feats, mask=ok, other=0.0)
        if X_FP8:
            y = y * tl.load(x_scale_ptr + m)
        tl.store(out_ptr + m * N + feats, y.to(out_ptr.dtype.element_ty), mask=ok)
