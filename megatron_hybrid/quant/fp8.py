"""FP8 rollout weights (``HybridEngine(..., rollout_weights="fp8")``): the switch writes the rollout model's dense
linear weights as float8 e4m3 with one fp32 scale per output row, and the rollout model computes with them.

Which weights: every decoder layer's ``linear_qkv``, ``linear_proj`` and, in a dense MLP, ``linear_fc1`` and
``linear_fc2`` (:func:`is_target`), except in the first and last layers that the model's config keeps in bf16 as
Megatron's FP8 training does (``first_last_layers_bf16``: :func:`layers_in_bf16`). The embedding, the output layer,
norms, biases, the router and the MoE experts (routed and shared) stay in the training dtype.

The format, the same for weights and activations: a row r of ``w`` (an output row of a weight, a token of the
activations) becomes ``q_r = (w_r.float() / s_r).to(float8_e4m3fn)`` with ``s_r = amax(|w_r|) / 448`` in fp32 (448:
e4m3's largest finite value) and ``s_r = 1`` for a zero row, so ``w_r ≈ q_r.float() * s_r``. A product is then
``torch._scaled_mm(x_q, w_q.t(), scale_a=s_x [M, 1], scale_b=s_w [1, N])``, row-wise scaled: on CPU (torch 2.13)
and on GPUs with FP8 tensor cores (compute capability ≥ 8.9) alike, so a CPU run quantizes and multiplies with the
same ops as the GPU. (CPU torch emulates ``_scaled_mm``: both operands dequantized to fp32, one fp32 matmul. The CPU
FP8 linears keep the weight's dequantized operand from their first call after a switch instead of converting it at
every call, and so compute the same bits as ``_scaled_mm``: :func:`fp8_linear`, :meth:`Fp8Table.cpu_operand`.)

Legend: N output features (rows of a weight), K input features, M tokens.

- :func:`quantize_rows`: the rollout tensor, given as the binding's :class:`~megatron_hybrid.reshard.aliased.Blocks`
  (views of gathered training shards), straight into FP8 and its scales, without materialising the
  training-dtype tensor; :class:`WeightQuantizer`: the binding's weights, planned once and (on a GPU) quantized by
  one kernel per row length; :func:`quantize_reference`: the same format from a whole tensor, in plain torch, for
  tests.
- :func:`fp8_linear` (activations quantized per token, one ``_scaled_mm``) and :func:`fp8_linear_reference`.
- :class:`Fp8Table`, owned by the binding: which rollout parameter computes with which FP8 tensor and scales;
  :class:`Fp8ColumnParallelLinear`, :class:`Fp8RowParallelLinear`: megatron-core's local-spec linears that read it.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import layers as tpl

from ..megatron import compat
from ..modes import RolloutWeights
from ..reshard.aliased import Blocks
from . import fp8_kernels

FP8_DTYPE, FP8_MAX = fp8_kernels.FP8_DTYPE, fp8_kernels.FP8_MAX  # float8_e4m3fn, 448.0
#: ``rollout_weights`` values: the training dtype, or FP8 for the :func:`is_target` weights.
ROLLOUT_WEIGHTS = tuple(r.value for r in RolloutWeights)  # the names, as before RolloutWeights
#: The first CUDA compute capability with FP8 tensor cores (Ada, sm_89; Hopper is 9.0).
MIN_CUDA_CAPABILITY = (8, 9)
#: Elements quantized per step of :func:`quantize_rows` (bounds its fp32 temporaries to 64 MiB per step).
_STEP_NUMEL = 1 << 24

# A dense layer's linear weights: decoder.layers.<i>.self_attention.linear_{qkv,proj}.weight and
# decoder.layers.<i>.mlp.linear_fc{1,2}.weight (an MoE layer's experts are ``mlp.experts...``, its shared experts
# ``mlp.shared_experts...``: not matched).
_TARGET = re.compile(r"(^|\.)layers\.(?P<layer>\d+)\.(self_attention\.linear_(qkv|proj)|mlp\.linear_fc[12])"
                     r"\.weight$")


def is_target(name: str, *, layers: Optional[range] = None) -> bool:
    """Whether parameter ``name`` is a weight that FP8 rollout weights quantize: a dense layer's linear weight
    (global or chunk-local name) and, with ``layers`` (the decoder layers whose weights are FP8, numbered
    model-wide: ``HybridEngine.fp8_layers``, all but :func:`layers_in_bf16`; a global name), in one of them."""
    match = _TARGET.search(name)
    return match is not None and (layers is None or int(match["layer"]) in layers)


def layers_in_bf16(config) -> tuple[int, int]:
    """(first, last): how many decoder layers at the start and at the end of the model keep their weights in the
    training dtype under ``rollout_weights="fp8"``: Megatron's FP8 convention, read from the model's
    ``TransformerConfig`` (``first_last_layers_bf16`` with ``num_layers_at_start_in_bf16`` and
    ``num_layers_at_end_in_bf16``; Megatron-LM's ``--first-last-layers-bf16``). (0, 0) when it is off."""
    if not getattr(config, "first_last_layers_bf16", False):
        return 0, 0
    return int(config.num_layers_at_start_in_bf16), int(config.num_layers_at_end_in_bf16)


def row_scales(amax_N: torch.Tensor) -> torch.Tensor:
    """The fp32 scale of every row from its amax: ``amax / 448``, 1 where that is 0 (a zero row).

    Divided by a tensor, not a Python number: PyTorch's CUDA division by a host scalar multiplies by its reciprocal,
    which can differ from the CPU's (and the kernels') correctly rounded quotient in the last bit."""
    amax = amax_N.float()
    scale = amax / torch.full_like(amax, FP8_MAX)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _row_steps(w_NK: torch.Tensor) -> Iterator[slice]:
    """``w``'s rows, a few at a time: the temporaries of one step stay within :data:`_STEP_NUMEL` elements."""
    rows = max(1, _STEP_NUMEL // max(1, w_NK.shape[1]))
    for lo in range(0, w_NK.shape[0], rows):
        yield slice(lo, min(lo + rows, w_NK.shape[0]))


def _row_amax(w_NK: torch.Tensor) -> torch.Tensor:
    """amax(|w_r|) of every row in fp32 (exact in any dtype: no rounding in abs and max)."""
    if fp8_kernels.supports_kernel(w_NK):
        amax = torch.empty(w_NK.shape[0], dtype=torch.float32, device=w_NK.device)
        fp8_kernels.quantize_rows_into(w_NK, None, amax, mode=fp8_kernels.AMAX)
        return amax
    return torch.cat([w_NK[rows].abs().amax(dim=1) for rows in _row_steps(w_NK)]).float()


def _quantize_into(w_NK: torch.Tensor, scale_N: torch.Tensor, out_NK: torch.Tensor) -> None:
    """``out = (w.float() / scale[:, None]).to(fp8)``, a few rows at a time (elementwise: the same bits)."""
    if fp8_kernels.supports_kernel(w_NK, out_NK):
        fp8_kernels.quantize_rows_into(w_NK, out_NK, scale_N, mode=fp8_kernels.QUANTIZE_WITH_SCALES)
        return
    for rows in _row_steps(w_NK):
        out_NK[rows].copy_((w_NK[rows].float() / scale_N[rows, None]).to(FP8_DTYPE))


def _quantize_part(w_NK: torch.Tensor, out_NK: torch.Tensor, scale_N: torch.Tensor) -> None:
    """Whole rows: their scales into ``scale_N``, their values into ``out_NK`` (one kernel on a GPU, reading the
    rows once)."""
    if fp8_kernels.supports_kernel(w_NK, out_NK):
        fp8_kernels.quantize_rows_into(w_NK, out_NK, scale_N, mode=fp8_kernels.QUANTIZE)
        return
    scale_N.copy_(row_scales(_row_amax(w_NK)))
    _quantize_into(w_NK, scale_N, out_NK)


def _parts(blocks: Blocks) -> list[torch.Tensor]:
    """The blocks' pieces in canonical order along ``blocks.dim`` (as :meth:`Blocks.materialize` concatenates)."""
    if blocks.stride == 1:
        return list(blocks.views)
    chunks = [v.chunk(blocks.stride, dim=blocks.dim) for v in blocks.views]
    return [c[j] for j in range(blocks.stride) for c in chunks]


def _whole_rows(blocks: Blocks, out_fp8_NK: torch.Tensor,
                out_scale_N: torch.Tensor) -> Optional[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """(piece, its FP8 rows, their scales) of every non-empty piece of ``blocks`` when each holds whole rows of
    the rollout tensor (pieces split along dim 0, or a single piece); None for pieces that split rows."""
    parts = _parts(blocks)
    assert out_fp8_NK.dtype == FP8_DTYPE and out_scale_N.dtype == torch.float32
    assert sum(p.shape[blocks.dim] for p in parts) == out_fp8_NK.shape[blocks.dim], (blocks.dim, out_fp8_NK.shape)
    if len(parts) == 1:
        return [(parts[0], out_fp8_NK, out_scale_N)] if parts[0].shape[0] else []
    if blocks.dim != 0:
        return None
    out, row = [], 0
    for part in parts:
        n = part.shape[0]
        if n:
            out.append((part, out_fp8_NK[row: row + n], out_scale_N[row: row + n]))
        row += n
    return out


class WeightQuantizer:
    """A binding's FP8 weights, requantized at every switch (:meth:`run`) from their blocks, planned once.

    ``targets``: (blocks, FP8 tensor, scales) of each weight, all at fixed addresses (the binding's). Pieces that
    hold whole rows (:func:`_whole_rows`) go to one :class:`~megatron_hybrid.quant.fp8_kernels.RowQuantizer` where the
    kernels run (one launch per row length, not one or more a weight); the rest, and everything without the
    kernels, go through :func:`quantize_rows` weight by weight. The same bits either way."""

    def __init__(self, targets: list[tuple[Blocks, torch.Tensor, torch.Tensor]]) -> None:
        self.per_weight: list[tuple[Blocks, torch.Tensor, torch.Tensor]] = []
        jobs = []
        for blocks, weight, scale in targets:
            whole = _whole_rows(blocks, weight, scale)
            if whole is not None and all(fp8_kernels.supports_kernel(x, out) for x, out, _ in whole):
                jobs += whole
            else:
                self.per_weight.append((blocks, weight, scale))
        self.grouped = fp8_kernels.RowQuantizer(jobs) if jobs else None

    @torch.no_grad()
    def run(self) -> None:
        if self.grouped is not None:
            self.grouped.run()
        for blocks, weight, scale in self.per_weight:
            quantize_rows(blocks, weight, scale)


@torch.no_grad()
def quantize_rows(blocks: Blocks, out_fp8_NK: torch.Tensor, out_scale_N: torch.Tensor) -> None:
    """Write the rollout tensor that ``blocks`` stand for into ``out_fp8_NK`` (``float8_e4m3fn``) and its per-row
    scales into ``out_scale_N`` (fp32), without materialising it: pieces split along dim 0 hold whole rows and are
    quantized one by one; pieces split along dim 1 (row-parallel weights) share rows, so their row amaxes are
    combined first, then each piece is quantized into its columns. Bit for bit :func:`quantize_reference` of
    ``blocks.materialize()``."""
    whole = _whole_rows(blocks, out_fp8_NK, out_scale_N)
    if whole is not None:
        for part, out, scale in whole:
            _quantize_part(part, out, scale)
        return
    parts = _parts(blocks)
    assert blocks.dim == 1, blocks.dim
    amax = None
    for part in parts:
        if part.shape[1]:
            a = _row_amax(part)
            amax = a if amax is None else torch.maximum(amax, a)
    out_scale_N.copy_(row_scales(amax))
    col = 0
    for part in parts:
        _quantize_into(part, out_scale_N, out_fp8_NK[:, col: col + part.shape[1]])
        col += part.shape[1]


def quantize_reference(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 tensor, fp32 scale per row) of a whole 2-D tensor, in plain torch: the reference of
    :func:`quantize_rows` (an independent write-up of the format)."""
    w = w_NK.float()
    amax = w.abs().amax(dim=1)
    # amax / 448 correctly rounded on any device: CUDA divides by a Python number through its reciprocal.
    scale = amax / torch.full_like(amax, 448.0)
    scale[scale == 0] = 1.0
    return (w / scale.unsqueeze(1)).to(torch.float8_e4m3fn), scale


def quantize_activations(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token (row) of ``x_MK`` as FP8 with its fp32 scale ``[M, 1]`` (the format of the weights): one kernel
    on a GPU with Triton, PyTorch's ops elsewhere (the same bits)."""
    if fp8_kernels.supports_kernel(x_MK):
        q = torch.empty(x_MK.shape, dtype=FP8_DTYPE, device=x_MK.device)
        scale = torch.empty(x_MK.shape[0], 1, dtype=torch.float32, device=x_MK.device)
        fp8_kernels.quantize_rows_into(x_MK, q, scale.view(-1), mode=fp8_kernels.QUANTIZE)
        return q, scale
    scale_M1 = row_scales(x_MK.abs().amax(dim=1, keepdim=True))
    return (x_MK.float() / scale_M1).to(FP8_DTYPE), scale_M1


def dequantized_operand(weight_fp8_NK: torch.Tensor, scale_N: torch.Tensor) -> torch.Tensor:
    """The fp32 ``[K, N]`` operand that CPU torch's ``_scaled_mm`` builds from ``weight_fp8_NK.t()`` and the
    row-wise ``scale_b`` at every call (``mat_b.contiguous().to(float) * scale_b``, its emulated kernel; torch
    2.13 has no FP8 GEMM on CPUs without AMX): :func:`fp8_linear` on CPU takes it once per switch instead
    (:meth:`Fp8Table.cpu_operand`)."""
    return weight_fp8_NK.t().contiguous().float() * scale_N.view(1, -1)


def uses_small_m_kernel(x_MK: torch.Tensor) -> bool:
    """Whether :func:`fp8_linear` multiplies ``x_MK`` (2-D) with the Triton kernel for a few tokens
    (:func:`.fp8_kernels.fp8_matmul`: K split over programs) rather than ``torch._scaled_mm``: a GPU with Triton
    and at most :data:`~.fp8_kernels.SMALL_M_MAX` tokens, where reading the weights bounds the step and cuBLAS' FP8
    GEMM streams them at a fraction of the bandwidth."""
    return x_MK.is_cuda and fp8_kernels.use_triton(x_MK) and x_MK.shape[0] <= fp8_kernels.SMALL_M_MAX


def fp8_matmul(x_q_MK: torch.Tensor, x_scale_M1: torch.Tensor, weight_fp8_NK: torch.Tensor, scale_N: torch.Tensor,
               out_dtype: torch.dtype, dequantized_KN: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[M, N]`` in ``out_dtype`` from FP8 activations (row scales ``[M, 1]``) and an FP8 weight (row scales
    ``[N]``): :func:`.fp8_kernels.fp8_matmul` for a few tokens on a GPU (:func:`uses_small_m_kernel`), one row-wise
    scaled ``torch._scaled_mm`` otherwise (on a GPU with a bfloat16 output, cast to ``out_dtype``).

    ``dequantized_KN`` (CPU only: :func:`dequantized_operand` of the weight and scales): the rest of CPU
    ``_scaled_mm``'s emulated kernel, the activations dequantized in fp32 and one fp32 matmul with that operand,
    the same ops on the same operands, so the same bits (``test_fp8_linear_cpu_operand_is_scaled_mm_bit_for_bit``).
    Without it, CPU ``_scaled_mm`` converts the whole FP8 weight to fp32 at every call: ~15x a bf16 linear's time
    at decode (M = 64 tokens, SmolLM2-135M's shapes)."""
    if dequantized_KN is not None:
        assert not x_q_MK.is_cuda and dequantized_KN.shape == (x_q_MK.shape[1], weight_fp8_NK.shape[0]), \
            dequantized_KN.shape
        return torch.matmul(x_q_MK.float() * x_scale_M1, dequantized_KN).to(out_dtype)
    if uses_small_m_kernel(x_q_MK):
        dtype = out_dtype if out_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        return fp8_kernels.fp8_matmul(x_q_MK, x_scale_M1.view(-1), weight_fp8_NK, scale_N,
                                      out_dtype=dtype).to(out_dtype)
    mm_dtype = torch.bfloat16 if x_q_MK.is_cuda else out_dtype
    y = torch._scaled_mm(x_q_MK, weight_fp8_NK.t(), scale_a=x_scale_M1, scale_b=scale_N.view(1, -1),
                         out_dtype=mm_dtype)
    return y.to(out_dtype)


def fp8_linear(x: torch.Tensor, weight_fp8_NK: torch.Tensor, scale_N: torch.Tensor,
               bias: Optional[torch.Tensor] = None,
               quantized: Optional[tuple[torch.Tensor, torch.Tensor]] = None, *,
               dequantized_KN: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ W.t() (+ bias)`` in FP8: ``x`` (``[..., K]``, the training dtype) quantized per token, multiplied by
    the FP8 weight with its scales (:func:`fp8_matmul`), the output and the bias in ``x``'s dtype.

    ``quantized``: ``x``'s quantization ``(q [M, K], scale [M, 1])`` made already (by a fused kernel that produced
    ``x``), the same bits :func:`quantize_activations` would give. ``dequantized_KN``: see :func:`fp8_matmul`.

    On a GPU, ``_scaled_mm`` wants K and N multiples of 16 and (row-wise scaling) a bfloat16 output, which an fp32
    model then casts back; on CPU there is no such constraint."""
    lead, k = x.shape[:-1], x.shape[-1]
    x_q, x_scale = quantized if quantized is not None else quantize_activations(x.reshape(-1, k))
    y = fp8_matmul(x_q, x_scale, weight_fp8_NK, scale_N, x.dtype,
                   dequantized_KN=dequantized_KN).view(*lead, weight_fp8_NK.shape[0])
    return y if bias is None else y + bias


def fp8_linear_reference(x: torch.Tensor, weight_fp8_NK: torch.Tensor, scale_N: torch.Tensor,
                         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`fp8_linear` in plain torch: both operands quantized and dequantized in fp32, one fp32 matmul."""
    x32 = x.float()
    x_scale = x32.abs().amax(dim=-1, keepdim=True) / 448.0
    x_scale[x_scale == 0] = 1.0
    x_deq = (x32 / x_scale).to(torch.float8_e4m3fn).float() * x_scale
    w_deq = weight_fp8_NK.float() * scale_N.unsqueeze(1)
    y = F.linear(x_deq, w_deq).to(x.dtype)
    return y if bias is None else y + bias


class Fp8Table:
    """Which rollout parameters compute in FP8, and with which tensors (fp8 ``[N, K]``, fp32 scales ``[N]``): owned
    by the binding, read by the FP8 linears. Keyed by the parameter object (its placeholder).

    It also carries activations quantized ahead (:meth:`offered`): a fused kernel that makes a linear's input can
    quantize it on the way (:mod:`megatron_hybrid.inference.fused`), and the linear then takes those bits rather than
    quantizing again.

    On CPU it also keeps each weight's :func:`dequantized_operand` once computed (:meth:`cpu_operand`): fp32, 4
    bytes per weight element, outside the engine's rollout memory; :meth:`drop_operands` frees them, which the
    binding's refill (the FP8 tensors change in place) and the switch back to training do."""

    #: Whether CPU FP8 linears keep their dequantized operand between calls (False: ``_scaled_mm`` at every call).
    cache_cpu_operands = True

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._operands: dict[int, torch.Tensor] = {}
        self._offered: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None

    @contextlib.contextmanager
    def offered(self, x: torch.Tensor, x_q: torch.Tensor, x_scale_M1: torch.Tensor) -> Iterator[None]:
        """Within the body, an FP8 linear given ``x`` (the same storage, offset and shape) multiplies ``x_q`` and
        ``x_scale_M1``, its quantization."""
        assert self._offered is None, "one offered activation at a time"
        self._offered = (x, x_q, x_scale_M1)
        try:
            yield
        finally:
            self._offered = None

    def quantized(self, x: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The offered quantization of ``x``, or None."""
        if self._offered is None:
            return None
        ref, x_q, x_scale = self._offered
        same = (x.data_ptr() == ref.data_ptr() and x.shape == ref.shape and x.stride() == ref.stride())
        return (x_q, x_scale) if same else None

    def set(self, param: torch.Tensor, weight_fp8: torch.Tensor, scale: torch.Tensor) -> None:
        self._by_id[id(param)] = (param, weight_fp8, scale)  # holding the parameter keeps its id unique
        self._operands.pop(id(param), None)

    def get(self, param: Optional[torch.Tensor]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        entry = self._by_id.get(id(param)) if param is not None else None
        return entry[1:] if entry is not None else None

    def cpu_operand(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """``param``'s :func:`dequantized_operand`, computed at its first use after a :meth:`drop_operands`; None
        for a CUDA weight (its ``_scaled_mm`` is an FP8 GEMM) or with :attr:`cache_cpu_operands` off."""
        entry = self._by_id[id(param)]
        if entry[1].is_cuda or not self.cache_cpu_operands:
            return None
        operand = self._operands.get(id(param))
        if operand is None:
            operand = self._operands[id(param)] = dequantized_operand(entry[1], entry[2])
        return operand

    def drop_operands(self) -> None:
        self._operands.clear()

    def clear(self) -> None:
        self._by_id.clear()
        self._operands.clear()


class _Fp8:
    """What the FP8 twins share: the binding's table (``None`` until the rollout model is bound)."""

    fp8_table: Optional[Fp8Table] = None


def _forward_impl(base):
    """The per-matmul hook of ``base``'s FP8 twin: FP8 for a weight in the table, megatron-core's own otherwise."""
    own = compat.linear_forward_impl(base)

    def impl(self, input, weight, *args, **kwargs):
        entry = self.fp8_table.get(weight) if self.fp8_table is not None else None
        if entry is None:
            return own(self, input, weight, *args, **kwargs)
        return fp8_linear(input, *entry, bias=kwargs.get("bias", args[0] if args else None),
                          quantized=self.fp8_table.quantized(input),
                          dequantized_KN=self.fp8_table.cpu_operand(weight))

    return impl


class Fp8ColumnParallelLinear(_Fp8, tpl.ColumnParallelLinear):
    pass


class Fp8RowParallelLinear(_Fp8, tpl.RowParallelLinear):
    pass


# megatron-core's linears call a private per-matmul hook from forward(): override exactly that, behind compat (the
# versions it is checked for). The row-parallel one adds its bias after the all-reduce, in the training dtype.
compat.override_linear_forward_impl(Fp8ColumnParallelLinear, _forward_impl(tpl.ColumnParallelLinear))
compat.override_linear_forward_impl(Fp8RowParallelLinear, _forward_impl(tpl.RowParallelLinear))

FP8_CLASSES = {tpl.ColumnParallelLinear: Fp8ColumnParallelLinear, tpl.RowParallelLinear: Fp8RowParallelLinear}


def supports_fp8(module: torch.nn.Module) -> bool:
    """Whether ``module`` has an FP8 twin (megatron-core's local-spec parallel linears)."""
    return type(module) in FP8_CLASSES or type(module) in FP8_CLASSES.values()


def make_fp8(module: torch.nn.Module) -> None:
    """Swap ``module``'s class for its FP8 twin (same state, same attributes)."""
    cls = FP8_CLASSES.get(type(module))
    if cls is None and type(module) not in FP8_CLASSES.values():
        raise ValueError(f"{type(module).__name__} has no FP8 twin; rollout_weights='fp8' needs megatron-core's "
                         "local-spec ColumnParallelLinear / RowParallelLinear")
    if cls is not None:
        module.__class__ = cls
