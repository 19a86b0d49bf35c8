"""The Triton kernels of FP8 rollout (megatron_hybrid.quant.fp8_kernels) and of the fused decoder step
(megatron_hybrid.inference.fused), against plain PyTorch.

- Row quantization: bit for bit :func:`megatron_hybrid.quant.fp8.quantize_reference` (values and scales), also for rows
  longer than one pass holds, strided rows, zero rows and subnormal results; given scales and amax only; many
  tensors in one launch (:class:`~megatron_hybrid.quant.fp8_kernels.RowQuantizer`, the switch's
  :class:`~megatron_hybrid.quant.fp8.WeightQuantizer`).
- The weight-only FP8 matrix multiply against the weight dequantized in fp32 and one fp32 matmul, with and without
  K split over programs: the tolerance is a few units of bfloat16's last place of the output (both sum the same
  exact products in fp32, in other orders, then round once).
- SwiGLU and residual add + RMSNorm against the eager formulas: the sum bit for bit (the same rounding), SwiGLU and
  the norm within one unit in the last place (exp; another summation order); the FP8 quantization they fuse bit for
  bit the reference quantization of the values they wrote.

The ``test_triton_*`` tests run on a GPU, or in Triton's CPU interpreter in a child process
(:func:`test_interpreter_subprocess`, as tests/test_kernels.py), skipped without Triton.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_hybrid.inference import fused
from megatron_hybrid.quant import fp8_kernels
from megatron_hybrid.quant.fp8 import FP8_DTYPE, quantize_reference, row_scales
from tests.triton_support import TRITON_DEVICE, needs_triton, run_interpreted


def _rows(R: int, K: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """R rows of a wider tensor (a row stride past K), magnitudes over four decades, a zero row and tiny values
    whose quantized values are subnormal."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(R, K + 5, generator=g) * torch.logspace(-3, 1, R).unsqueeze(1)
    wide[1] = 0
    wide[0, 2] = 1000.0  # (the view's first column) the rest of row 0 quantizes to subnormals and zeros
    return wide.to(dtype=dtype, device=TRITON_DEVICE)[:, 2: K + 2]


@needs_triton
@pytest.mark.usefixtures("triton_interpreter_fixes")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("R, K", [(6, 100), (5, 4096), (4, 20000)], ids=["short", "4096", "two-pass"])
def test_triton_quantize_rows_bit_for_bit(R, K, dtype):
    x = _rows(R, K, dtype, R + K)
    q_ref, s_ref = quantize_reference(x.cpu())
    q = torch.full((R, K), float("nan"), device=TRITON_DEVICE).to(FP8_DTYPE)
    scale = torch.full((R,), float("nan"), device=TRITON_DEVICE)
    fp8_kernels.quantize_rows_into(x, q, scale)
    assert torch.equal(scale.cpu(), s_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert (q_ref.view(torch.uint8)[0] & 0x78 == 0).sum() > K // 2  # most of row 0 is subnormal or zero

    given = torch.full((R, K), float("nan"), device=TRITON_DEVICE).to(FP8_DTYPE)
    fp8_kernels.quantize_rows_into(x, given, scale, mode=fp8_kernels.QUANTIZE_WITH_SCALES)
    assert torch.equal(given.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    amax = torch.full((R,), float("nan"), device=TRITON_DEVICE)
    fp8_kernels.quantize_rows_into(x, None, amax, mode=fp8_kernels.AMAX)
    assert torch.equal(amax.cpu(), x.cpu().float().abs().amax(dim=1))
    assert torch.equal(row_scales(amax).cpu(), s_ref)


@needs_triton
@pytest.mark.usefixtures("triton_interpreter_fixes")
@pytest.mark.parametrize("tile, rows, aligned", [(8, 1, True), (4, 2, False), (3, 1, True)],
                         ids=["tiles-8", "tiles-4x2-unaligned", "tiles-3"])
def test_triton_row_quantizer_bit_for_bit(tile, rows, aligned):
    """One launch per (row length, dtype) over many tensors, through the table of addresses: each tensor's FP8
    rows and scales are quantize_reference's, with partial tiles and rows of several lengths (two in one group),
    an empty tensor and a tensor of rows with no elements (scale 1); rows on 16-byte boundaries (the kernel is told
    so) and strided rows off them."""
    K0 = 96 if aligned else 100
    specs = [(6, K0, torch.bfloat16), (5, K0, torch.bfloat16), (7, 4096, torch.float32), (4, 20000, torch.bfloat16),
             (0, K0, torch.bfloat16), (3, 0, torch.bfloat16)]
    jobs, refs = [], []
    for i, (R, K, dtype) in enumerate(specs):
        x = _rows(R, K, dtype, 31 * i + R) if R and K else torch.zeros(R, K, dtype=dtype, device=TRITON_DEVICE)
        if aligned:
            x = x.clone()  # contiguous, at the allocator's (aligned) address
            out = torch.full((R, K), float("nan"), device=TRITON_DEVICE).to(FP8_DTYPE)
        else:
            out = torch.full((R, K + 3), float("nan"), device=TRITON_DEVICE).to(FP8_DTYPE)[:, 1: K + 1]
        scale = torch.full((R,), float("nan"), device=TRITON_DEVICE)
        jobs.append((x, out, scale))
        # (rows with no elements: amax 0, so scale 1, as quantize_rows_into writes; the reference needs K > 0)
        refs.append(quantize_reference(x.cpu()) if K else (torch.empty(R, 0, dtype=FP8_DTYPE), torch.ones(R)))

    def config(K):
        return dict(fp8_kernels.tiles_config(K), TILE=tile, ROWS=rows)

    quantizer = fp8_kernels.RowQuantizer(jobs, config_for=config)
    assert len(quantizer.launches) == 3  # (K0, bf16), (4096, fp32), (20000, bf16)
    assert [launch[4]["ALIGNED"] for launch in quantizer.launches] == [aligned] * 3
    for run in range(2):  # a second run rewrites the same bits (the switch runs it at every switch)
        quantizer.run()
        for (x, out, scale), (q_ref, s_ref) in zip(jobs, refs):
            assert torch.equal(scale.cpu(), s_ref), (x.shape, run)
            assert torch.equal(out.cpu().view(torch.uint8), q_ref.view(torch.uint8)), (x.shape, run)


@needs_triton
@pytest.mark.usefixtures("triton_interpreter_fixes")
def test_triton_weight_quantizer_groups_whole_rows():
    """A binding's weights: pieces along dim 0 and single pieces (whichever their dim) go to the grouped kernel,
    pieces that split rows go weight by weight; every weight equals quantize_reference of its whole tensor."""
    from megatron_hybrid.quant.fp8 import WeightQuantizer
    from megatron_hybrid.reshard.aliased import Blocks

    full = [_rows(12, 96, torch.bfloat16, s) for s in range(4)]
    blocks = [Blocks([full[0][:5], full[0][5:]], 0, 1), Blocks([full[1]], 1, 1),
              Blocks([full[2][:, :40], full[2][:, 40:]], 1, 1), Blocks([full[3][:6], full[3][6:]], 0, 2)]
    targets = [(b, torch.empty(12, 96, device=TRITON_DEVICE).to(FP8_DTYPE), torch.empty(12, device=TRITON_DEVICE))
               for b in blocks]
    quantizer = WeightQuantizer(targets)
    assert [t[0] for t in quantizer.per_weight] == [blocks[2]]
    assert len(quantizer.grouped.jobs) == 2 + 1 + 4  # 2 pieces, 1 piece, 2 views of 2 interleaved chunks
    quantizer.run()
    for b, q, scale in targets:
        q_ref, s_ref = quantize_reference(b.materialize().cpu())
        assert torch.equal(scale.cpu(), s_ref)
        assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


@needs_triton
@pytest.mark.usefixtures("triton_interpreter_fixes")
@pytest.mark.parametrize("M, N, K", [(3, 70, 256), (17, 64, 4096), (32, 96, 1000), (1, 8, 5120)],
                         ids=["odd-n", "split-k", "uneven-k", "one-row-split"])
def test_triton_weight_only_matmul(M, N, K):
    g = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    q, s = quantize_reference(torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g))
    plan = fp8_kernels.weight_only_plan(M, N, K, 132)
    if (M, N, K) in ((17, 64, 4096), (1, 8, 5120)):
        assert plan["split"] > 1
    y = fp8_kernels.fp8_weight_matmul(x.to(TRITON_DEVICE), q.to(TRITON_DEVICE), s.to(TRITON_DEVICE)).cpu()
    reference = (x.double() @ (q.double() * s.double()[:, None]).t())
    # The kernel sums the exact bf16 x fp8 products in fp32 in tiles (and splits), the reference in fp64: after
    # one rounding to bfloat16 they differ by at most one unit of bf16 (2^-8 relative) plus the fp32 sums' error
    # (K * 2^-24 of the sum of magnitudes).
    magnitude = x.double().abs() @ (q.double().abs() * s.double()[:, None]).t()
    bound = reference.abs() * 2.0 ** -8 + magnitude * K * 2.0 ** -24
    assert ((y.double() - reference).abs() <= bound).all()
    # FP8 activations too (what torch._scaled_mm computes, summed in another order): the same bound.
    xq, xs = quantize_reference(x.float())
    y = fp8_kernels.fp8_matmul(xq.to(TRITON_DEVICE), xs.to(TRITON_DEVICE), q.to(TRITON_DEVICE),
                               s.to(TRITON_DEVICE)).cpu()
    dequantized = xq.double() * xs.double()[:, None]
    reference = dequantized @ (q.double() * s.double()[:, None]).t()
    bound = reference.abs() * 2.0 ** -8 + (dequantized.abs() @ (q.double().abs() * s.double()[:, None]).t()) * K * 2.0 ** -24
    assert ((y.double() - reference).abs() <= bound).all()


@needs_triton
@pytest.mark.usefixtures("triton_interpreter_fixes")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_triton_swiglu_and_add_rms_norm(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 2 * 1100, generator=g) * 4).to(dtype=dtype, device=TRITON_DEVICE)
    a, b = x.cpu().chunk(2, dim=-1)
    eager = F.silu(a) * b
    got, quantized = fused.swiglu(x, quantize=True)
    assert fused.swiglu(x)[1] is None and torch.equal(fused.swiglu(x)[0], got)  # the kernel without quantization
    q_ref, s_ref = quantize_reference(got.cpu())  # of the written (rounded) values, bit for bit
    assert torch.equal(quantized[0].cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(quantized[1].cpu().view(-1), s_ref)
    got = got.cpu()
    # silu's exp may differ from PyTorch's in the last fp32 bits: rounded to 16 bits the results are equal but for
    # a rare near-halfway case (one unit: 2^-7 relative at most); in fp32 they agree to a few units (2^-20).
    assert torch.allclose(got.float(), eager.float(), rtol=2.0 ** -20 if dtype == torch.float32 else 2.0 ** -7,
                          atol=1e-30)
    h = torch.randn(7, 96, generator=g).to(dtype=dtype, device=TRITON_DEVICE)
    r = torch.randn(7, 96, generator=g).to(dtype=dtype, device=TRITON_DEVICE)
    w = torch.randn(96, generator=g).to(dtype=dtype, device=TRITON_DEVICE)
    total, normed, quantized = fused.add_rms_norm(h, r, w, 1e-5, quantize=True)
    assert torch.equal(total.cpu(), r.cpu() + h.cpu())
    q_ref, s_ref = quantize_reference(normed.cpu())
    assert torch.equal(quantized[0].cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(quantized[1].cpu().view(-1), s_ref)
    assert fused.add_rms_norm(h, r, w, 1e-5)[2] is None
    expected = F.rms_norm((r.cpu() + h.cpu()).float(), (96,), w.cpu().float(), 1e-5).to(dtype)
    assert torch.allclose(normed.cpu().float(), expected.float(), rtol=2.0 ** -7 if dtype != torch.float32 else 1e-6,
                          atol=1e-6)


def test_interpreter_subprocess() -> None:
    """The ``test_triton_*`` tests in Triton's CPU interpreter, in a child process (see the module docstring)."""
    run_interpreted(__file__)
