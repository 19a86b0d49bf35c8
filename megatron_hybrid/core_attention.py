"""Core attention (softmax(Q Kᵀ) V, between ``linear_qkv`` and ``linear_proj``) on PyTorch's attention kernels, for
megatron-core's local layer spec: ``--attention-backend`` (Megatron-LM's flag), issue 44.

- ``local``: megatron-core's ``DotProductAttention`` (Megatron-LM's name for it): baddbmm, softmax, bmm, with the
  ``[B, N, Sq, Sk]`` scores in memory. The default.
- ``sdpa``: :class:`SDPADotProductAttention`, ``torch.nn.functional.scaled_dot_product_attention``: flash, cuDNN
  or memory-efficient kernels on a GPU, torch's flash kernel on the CPU.
- ``flex``: :class:`FlexDotProductAttention`, ``torch.nn.attention.flex_attention`` (compiled on a GPU). torch has
  no backward for it on the CPU (2.13), so training there is refused (:func:`check_attention_backend`).
- ``auto``: :func:`resolve_attention_backend` picks one.

Megatron-LM's Transformer Engine values (``flash``, ``fused``, ``unfused``) select ``TEDotProductAttention``, which
needs Transformer Engine's layer spec; our models are built on the local spec, so those values are refused.

Both modules take ``DotProductAttention``'s constructor and ``forward`` signatures, so a layer spec swaps them in
for it (:func:`with_core_attention`). The rollout model keeps ``local`` whatever the training model uses
(:mod:`megatron_hybrid.reshard.rollout_model`); its generation steps run their own kernels
(:mod:`.inference.attention`).

Legend: Sq query positions, Sk key positions, B batch, N query heads and G key/value groups on this
tensor-parallel rank, D head dimension.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide
from packaging.version import Version
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["ATTENTION_BACKENDS", "TRANSFORMER_ENGINE_BACKENDS", "FlexDotProductAttention", "SDPADotProductAttention",
           "check_attention_backend", "core_attention_class", "resolve_attention_backend", "with_core_attention",
           "with_local_core_attention"]

#: Ours: ``--attention-backend``'s values.
ATTENTION_BACKENDS = ("local", "sdpa", "flex", "auto")
#: Megatron-LM's values that select Transformer Engine's attention (refused).
TRANSFORMER_ENGINE_BACKENDS = ("flash", "fused", "unfused")

#: ``scaled_dot_product_attention(enable_gqa=)`` came with torch 2.5; before, key and value heads are repeated.
_SDPA_GQA = Version(torch.__version__).release >= (2, 5)


def check_attention_backend(attention_backend: str, *, device_type: Optional[str] = None) -> None:
    """``ValueError`` unless ``attention_backend`` is one of :data:`ATTENTION_BACKENDS` that this torch offers; with
    ``device_type`` (``"cuda"``, ``"cpu"``), also unless a model can train with it there."""
    if attention_backend in TRANSFORMER_ENGINE_BACKENDS:
        raise ValueError(f"attention_backend ({attention_backend!r}) is one of Megatron-LM's Transformer Engine "
                         f"backends {list(TRANSFORMER_ENGINE_BACKENDS)}: it needs Transformer Engine's attention "
                         "(TEDotProductAttention) and layer spec, which megatron-hybrid's training models do not use "
                         "(they are built on megatron-core's local spec). Use 'sdpa' (torch's flash, cuDNN and "
                         "memory-efficient kernels), 'flex' or 'local'")
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend ({attention_backend!r}) must be one of {list(ATTENTION_BACKENDS)}")
    if attention_backend == "flex":
        error = _flex_error(device_type)
        if error is not None:
            raise ValueError(f"attention_backend ('flex'): {error}")


def resolve_attention_backend(attention_backend: str) -> str:
    """The concrete backend (``local``, ``sdpa`` or ``flex``) for ``attention_backend``; ``auto`` is the fastest
    this torch offers on every device: ``sdpa`` for now (``flex`` is compiled on first use and has no CPU
    backward; ``local`` keeps the scores in memory). Issue 44's step 6 benchmarks them and decides; where the
    answer comes to depend on the device, this function takes it."""
    check_attention_backend(attention_backend)
    return "sdpa" if attention_backend == "auto" else attention_backend


def core_attention_class(attention_backend: str) -> type:
    """The core-attention module of ``attention_backend`` (``auto`` resolved)."""
    return {"local": DotProductAttention, "sdpa": SDPADotProductAttention,
            "flex": FlexDotProductAttention}[resolve_attention_backend(attention_backend)]


def with_core_attention(spec: Any, attention_backend: str) -> Any:
    """``spec`` (a layer's ``ModuleSpec``, or a block spec's ``TransformerBlockSubmodules``: every layer) with the
    self-attention's core attention of ``attention_backend``. Copies where it changes something: the given spec is
    never modified (megatron-core's spec functions may hand out shared objects). ``ValueError`` for a layer whose
    core attention is not one of ours or megatron-core's ``DotProductAttention`` (Transformer Engine's spec, MLA)."""
    cls = core_attention_class(attention_backend)
    if hasattr(spec, "layer_specs"):  # TransformerBlockSubmodules
        return dataclasses.replace(spec, layer_specs=[with_core_attention(s, attention_backend)
                                                      for s in spec.layer_specs])
    layer = spec.submodules
    attention = layer.self_attention
    current = getattr(attention.submodules, "core_attention", None)
    if current is cls:
        return spec
    if current not in (DotProductAttention, SDPADotProductAttention, FlexDotProductAttention):
        raise ValueError(f"attention_backend ({attention_backend!r}) replaces megatron-core's DotProductAttention "
                         f"of the local layer spec; this layer's self-attention has core attention "
                         f"{getattr(current, '__name__', current)}")
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(attention.submodules,
                                                                                core_attention=cls))
    return dataclasses.replace(spec, submodules=dataclasses.replace(layer, self_attention=attention))


def with_local_core_attention(spec: Any) -> Any:
    """``spec`` with megatron-core's ``DotProductAttention`` where :func:`with_core_attention` put one of ours (a
    copy); any other spec as it is (Transformer Engine's keeps its attention)."""
    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=[with_local_core_attention(s) for s in spec.layer_specs])
    current = getattr(spec.submodules.self_attention.submodules, "core_attention", None)
    ours = current in (SDPADotProductAttention, FlexDotProductAttention)
    return with_core_attention(spec, "local") if ours else spec


#: Per mask tensor (by identity, while it lives): its version and whether it is the plain causal mask. The same
#: mask reaches every layer, in forward and again in recomputation: one comparison (a device sync) per mask
#: instead of per layer.
_CAUSAL_MASKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _is_causal_mask(mask: torch.Tensor, sq: int, sk: int) -> bool:
    """Whether ``mask`` (megatron's convention, True = masked out) is the causal mask of Sq = Sk positions in every
    batch row and head (as Megatron-LM's ``get_ltor_masks_and_position_ids`` makes it without resets)."""
    if sq != sk or mask.dtype != torch.bool or tuple(mask.shape[-2:]) != (sq, sk):
        return False
    seen = _CAUSAL_MASKS.get(mask)
    if seen is not None and seen[0] == mask._version:  # _version: an in-place change since
        return seen[1]
    causal = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu(1)
    plain = torch.equal(mask, causal.expand_as(mask))
    _CAUSAL_MASKS[mask] = (mask._version, plain)
    return plain


class SDPADotProductAttention(MegatronModule):
    """``DotProductAttention`` on ``torch.nn.functional.scaled_dot_product_attention``: the same constructor and
    ``forward`` signatures, the same function (to rounding; see below), the ``[B, N, Sq, Sk]`` scores never in
    memory on the fused kernels.

    - Masks: megatron's ``attention_mask`` is True where a key is masked out. None with the causal mask type and
      Sq > 1 (where ``DotProductAttention`` builds the causal mask itself), or a mask equal to the causal one, runs
      as ``is_causal=True`` (the flash kernels take no mask tensor); another mask is passed as its negation (SDPA's
      True = attend). ``forward``'s ``attn_mask_type`` wins over the constructor's, as in ``TEDotProductAttention``
      (megatron-core's ``Attention`` passes ``no_mask`` for a decode step with a KV cache). A query row whose keys
      are all masked out gives zeros here and the mean of the values in ``DotProductAttention`` (it fills masked
      scores with -10000); on rows that attend to nothing, neither means anything.
    - GQA: key and value keep their G heads (``enable_gqa``, torch ≥ 2.5; repeated to N heads before), the query
      heads of a group next to each other as ``DotProductAttention``'s ``repeat_interleave`` pairs them.
    - Scale: ``softmax_scale``, else 1/√D. ``DotProductAttention`` divides it by the layer number under
      ``apply_query_key_layer_scaling`` (an fp16 overflow guard for the scores it keeps in memory) and multiplies
      the scores by that number again inside its fp32 softmax: its softmax sees this scale either way, and these
      kernels accumulate in fp32. :attr:`softmax_scale` is the scale the softmax sees.
    - Dropout: ``attention_dropout`` (else the config's) in training only, drawn under megatron's RNG tracker fork
      unless sequence-parallel, as ``DotProductAttention`` draws it (the same distribution as its dropout, other
      entries dropped).

    - Packed sequences (``packed_seq_params`` of ``qkv_format="thd"``, megatron-core's packed format: query
      ``[T, N, D]``, key and value ``[T, G, D]``, sequence i at ``cu_seqlens[i]:cu_seqlens[i + 1]``): each
      sequence attends causally to itself alone: on a GPU one call of torch's varlen flash kernel for the whole
      pack (``torch.nn.attention.varlen``, where torch has it; not with dropout), else one causal kernel call per
      sequence; one document block mask in ``flex``. Returns ``[T, N·D]``. ``DotProductAttention`` refuses them.

    Refused at construction: context parallelism, a ``softmax_type`` other than ``vanilla``, window attention. In
    ``forward``: ``attention_bias``, as ``DotProductAttention`` refuses it, and packed formats other than ``thd``.
    """

    backend = "sdpa"

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None) -> None:
        super().__init__(config=config)
        name = f"attention_backend ({self.backend!r})"
        if config.context_parallel_size != 1:
            raise ValueError(f"{name} does not support context parallelism (context_parallel_size "
                             f"{config.context_parallel_size}), nor does megatron-core's DotProductAttention: only "
                             "Transformer Engine's attention has it")
        if config.softmax_type != "vanilla":
            raise ValueError(f"{name} supports softmax_type 'vanilla' only (got {config.softmax_type!r})")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise ValueError(f"{name} does not support window attention (window_size {config.window_size}, "
                             f"layer {layer_number}); use 'local'")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:  # as DotProductAttention: megatron's global TP group
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        tp = self.tp_group.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)
        self.softmax_scale = softmax_scale if softmax_scale is not None \
            else 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params: Any = None) -> torch.Tensor:
        """``query`` ``[Sq, B, N, D]``, ``key`` and ``value`` ``[Sk, B, G, D]``; returns ``[Sq, B, N·D]``. Packed
        (``packed_seq_params``, ``thd``): ``[T, N, D]`` and ``[T, G, D]``; returns ``[T, N·D]``."""
        if attention_bias is not None:
            raise NotImplementedError(f"attention_backend ({self.backend!r}) takes no attention_bias (nor does "
                                      "megatron-core's DotProductAttention)")
        if packed_seq_params is not None:
            return self._forward_packed(query, key, value, packed_seq_params)
        sq, b, sk = query.size(0), query.size(1), key.size(0)
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        is_causal, keep = False, None
        if attention_mask is None:
            if mask_type == AttnMaskType.causal and sq > 1:
                # Where DotProductAttention builds the causal mask itself; Sq = 1 is a decode step, unmasked there.
                assert sq == sk, f"the causal mask type needs Sq == Sk (got {sq}, {sk})"
                is_causal = True
        elif _is_causal_mask(attention_mask, sq, sk):
            is_causal = True
        else:
            keep = ~attention_mask
        # [S, B, heads, D] -> [B, heads, S, D]: views; the kernels take any strides with a contiguous last dim.
        q_BNSD, k_BGSD, v_BGSD = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out_BNSD = self._attend(q_BNSD, k_BGSD, v_BGSD, is_causal=is_causal, keep=keep, dropout_p=dropout_p)
        else:
            out_BNSD = self._attend(q_BNSD, k_BGSD, v_BGSD, is_causal=is_causal, keep=keep, dropout_p=dropout_p)
        return out_BNSD.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _forward_packed(self, query_TND: torch.Tensor, key_TGD: torch.Tensor, value_TGD: torch.Tensor,
                        packed_seq_params: Any) -> torch.Tensor:
        if packed_seq_params.qkv_format != "thd":
            raise NotImplementedError(f"attention_backend ({self.backend!r}) takes packed sequences in megatron-core's "
                                      f"'thd' format, not {packed_seq_params.qkv_format!r}")
        cu = packed_seq_params.cu_seqlens_q
        cu_kv = packed_seq_params.cu_seqlens_kv
        assert cu_kv is None or cu_kv is cu or torch.equal(cu_kv, cu), "self-attention packs: one cu_seqlens"
        # [T, heads, D] -> [1, heads, T, D]: views, as in forward.
        q, k, v = (t.unsqueeze(1).permute(1, 2, 0, 3) for t in (query_TND, key_TGD, value_TGD))
        dropout_p = self.dropout_p if self.training else 0.0
        max_seqlen = packed_seq_params.max_seqlen_q
        if dropout_p == 0 and self._use_varlen(query_TND):
            out_TND = _attend_varlen(query_TND, key_TGD, value_TGD, cu, max_seqlen, scale=self.softmax_scale,
                                     ratio=self.num_attention_heads_per_partition
                                     // self.num_query_groups_per_partition)
            return out_TND.reshape(query_TND.size(0), self.hidden_size_per_partition)
        if dropout_p > 0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out_1NTD = self._attend_packed(q, k, v, cu, dropout_p=dropout_p)
        else:
            out_1NTD = self._attend_packed(q, k, v, cu, dropout_p=dropout_p)
        return out_1NTD[0].permute(1, 0, 2).reshape(query_TND.size(0), self.hidden_size_per_partition)

    def _use_varlen(self, query_TND: torch.Tensor) -> bool:
        """Whether a pack runs as one varlen flash call (:func:`_attend_varlen`): on a GPU where this torch has
        ``torch.nn.attention.varlen`` and :attr:`packed_kernel` allows it."""
        if self.packed_kernel == "loop" or query_TND.device.type != "cuda":
            return False
        return _varlen_function() is not None

    #: How a pack is attended on a GPU: ``"auto"`` one varlen flash call where torch has one, ``"loop"`` one causal
    #: SDPA call per sequence (the CPU's way, and the fallback). ``bench/train_pass.py --packed-kernel`` sets it.
    packed_kernel = "auto"

    def _attend_packed(self, q_1NTD: torch.Tensor, k_1GTD: torch.Tensor, v_1GTD: torch.Tensor,
                       cu_seqlens: torch.Tensor, *, dropout_p: float) -> torch.Tensor:
        """Each sequence of the pack causally over itself: one causal kernel call per sequence (exactly the
        unpacked sequence's attention). Each call's output gradient is made contiguous first: the gradient of
        ``torch.cat`` is a slice of the pack's, whose strides depend on the pack's length, and torch's cuDNN
        attention backward (2.11) keys its cached plans on the output's strides alone, so a slice of another
        pack's length could run a plan built for other strides (reads past the tensor)."""
        bounds = cu_seqlens.tolist()
        outs = [_ContiguousGrad.apply(self._attend(q_1NTD[:, :, lo:hi], k_1GTD[:, :, lo:hi], v_1GTD[:, :, lo:hi],
                                                   is_causal=True, keep=None, dropout_p=dropout_p))
                for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]
        return torch.cat(outs, dim=2)

    def _attend(self, q_BNSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor, *, is_causal: bool,
                keep: Optional[torch.Tensor], dropout_p: float) -> torch.Tensor:
        gqa = {}
        ratio = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if ratio > 1 and _SDPA_GQA:
            gqa = dict(enable_gqa=True)
        elif ratio > 1:
            k_BGSD, v_BGSD = (t.repeat_interleave(ratio, dim=1) for t in (k_BGSD, v_BGSD))
        return F.scaled_dot_product_attention(q_BNSD, k_BGSD, v_BGSD, attn_mask=keep, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=self.softmax_scale, **gqa)


class _ContiguousGrad(torch.autograd.Function):
    """The identity; its backward makes the incoming gradient contiguous."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


@functools.lru_cache(maxsize=1)
def _varlen_function() -> Optional[tuple[Callable, frozenset]]:
    """``torch.nn.attention.varlen.varlen_attn`` and the names of its parameters (they changed between torch
    releases: ``is_causal`` became ``window_size``; ``scale`` and ``enable_gqa`` came later), or None where this
    torch has none or one without a causal option."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    import inspect

    names = frozenset(inspect.signature(varlen_attn).parameters)
    if not names & {"is_causal", "window_size"}:
        return None
    return varlen_attn, names


def _attend_varlen(query_TND: torch.Tensor, key_TGD: torch.Tensor, value_TGD: torch.Tensor,
                   cu_seqlens: torch.Tensor, max_seqlen: Optional[int], *, scale: float, ratio: int) -> torch.Tensor:
    """Every sequence of a pack causally over itself in one flash call (torch's ``varlen_attn``); ``[T, N, D]``.
    Where this torch's ``varlen_attn`` takes no ``scale`` and the scale is not 1/√D, the query is scaled first
    (the kernel then applies 1/√D); where it takes no ``enable_gqa``, key and value heads are repeated."""
    varlen_attn, names = _varlen_function()
    options: dict[str, Any] = {}
    options.update(window_size=(-1, 0)) if "window_size" in names else options.update(is_causal=True)
    default_scale = 1.0 / math.sqrt(query_TND.size(-1))
    if "scale" in names:
        options["scale"] = scale
    elif scale != default_scale:
        query_TND = query_TND * (scale / default_scale)
    if ratio > 1 and "enable_gqa" in names:
        options["enable_gqa"] = True
    elif ratio > 1:
        key_TGD, value_TGD = (t.repeat_interleave(ratio, dim=1) for t in (key_TGD, value_TGD))
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    cu = cu_seqlens.to(torch.int32)
    return varlen_attn(query_TND, key_TGD, value_TGD, cu, cu, max_seqlen, max_seqlen, **options)


class FlexDotProductAttention(SDPADotProductAttention):
    """:class:`SDPADotProductAttention` (its masks, scale and refusals) on ``torch.nn.attention.flex_attention``:
    the causal mask as a block mask (the blocks above the diagonal are skipped), another mask as a ``score_mod``
    (-inf where masked out; no blocks skipped). Compiled with ``torch.compile`` on a GPU (eager flex_attention
    materialises the scores); eager, forward only, on the CPU (torch has no CPU backward for it). No dropout:
    ``attention_dropout`` > 0 is refused."""

    backend = "flex"

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None) -> None:
        check_attention_backend("flex")
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if self.dropout_p > 0:
            raise ValueError(f"attention_backend ('flex') has no attention dropout (flex_attention takes none): "
                             f"attention_dropout ({self.dropout_p}) must be 0; use 'sdpa' or 'local'")

    def _attend(self, q_BNSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor, *, is_causal: bool,
                keep: Optional[torch.Tensor], dropout_p: float) -> torch.Tensor:
        sq, sk = q_BNSD.size(2), k_BGSD.size(2)
        block_mask = _causal_block_mask(sq, sk, q_BNSD.device) if is_causal else None
        score_mod = None
        if keep is not None:
            keep_BNSS = keep.expand(q_BNSD.size(0), q_BNSD.size(1), sq, sk)  # a view of the broadcast mask

            def score_mod(score, b, h, q_idx, kv_idx):
                return torch.where(keep_BNSS[b, h, q_idx, kv_idx], score, -float("inf"))
        ratio = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        return _flex_function(q_BNSD.device.type)(q_BNSD, k_BGSD, v_BGSD, score_mod=score_mod, block_mask=block_mask,
                                                  scale=self.softmax_scale, enable_gqa=ratio > 1)

    def _use_varlen(self, query_TND: torch.Tensor) -> bool:
        return False  # the document block mask below serves packs on every device

    def _attend_packed(self, q_1NTD: torch.Tensor, k_1GTD: torch.Tensor, v_1GTD: torch.Tensor,
                       cu_seqlens: torch.Tensor, *, dropout_p: float) -> torch.Tensor:
        """The whole pack in one call: a causal document block mask (blocks across sequences skipped)."""
        ratio = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        return _flex_function(q_1NTD.device.type)(q_1NTD, k_1GTD, v_1GTD, block_mask=_document_block_mask(cu_seqlens),
                                                  scale=self.softmax_scale, enable_gqa=ratio > 1)


def _flex_error(device_type: Optional[str]) -> Optional[str]:
    """Why ``flex`` cannot be used with this torch (on ``device_type`` for training, when given), or None."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return (f"torch {torch.__version__} has no torch.nn.attention.flex_attention (it came with torch 2.5); use "
                "'sdpa'")
    if device_type == "cpu":
        error = _flex_cpu_backward_error(flex_attention)
        if error is not None:
            return (f"torch {torch.__version__}'s flex_attention cannot train on the CPU ({error}); use 'sdpa' or "
                    "'local' there")
    return None


@functools.cache
def _flex_cpu_backward_error(flex_attention: Callable) -> Optional[str]:
    """torch's own answer whether flex_attention has a CPU backward (2.13 refuses inputs that require grad before
    computing anything), or None where it has one."""
    x = torch.zeros(1, 1, 1, 16, requires_grad=True)
    try:
        flex_attention(x, x, x)
    except (NotImplementedError, RuntimeError) as error:
        return str(error)
    return None


@functools.cache
def _flex_function(device_type: str) -> Callable:
    """flex_attention: compiled on a GPU (eager it runs an unfused reference that keeps the scores in memory),
    eager elsewhere (the CPU runs it forward only; compiling it there needs a C++ toolchain for nothing)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if device_type == "cuda" else flex_attention


_LAST_DOCUMENT_MASK: list = []  # [(cu_seqlens, block mask)]: every layer of a pack's forward passes the same tensor


def _document_block_mask(cu_seqlens: torch.Tensor):
    """The block mask of a pack: position q attends to kv at or before it in the same sequence. Made once per pack
    (the layers of one forward pass the same ``cu_seqlens`` tensor), not per layer."""
    if _LAST_DOCUMENT_MASK and _LAST_DOCUMENT_MASK[0][0] is cu_seqlens:
        return _LAST_DOCUMENT_MASK[0][1]
    mask = _make_document_block_mask(cu_seqlens)
    _LAST_DOCUMENT_MASK[:] = [(cu_seqlens, mask)]
    return mask


def _make_document_block_mask(cu_seqlens: torch.Tensor):
    from torch.nn.attention.flex_attention import create_block_mask

    total = int(cu_seqlens[-1])
    positions = torch.arange(total, device=cu_seqlens.device)
    document = torch.searchsorted(cu_seqlens[1:].to(positions.dtype), positions, right=True)

    def same_sequence_causal(b, h, q_idx, kv_idx):
        return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

    return create_block_mask(same_sequence_causal, None, None, total, total, device=cu_seqlens.device)


@functools.lru_cache(maxsize=32)
def _causal_block_mask(sq: int, sk: int, device: torch.device):
    """The causal block mask of Sq × Sk positions, made once per shape and device (not per layer and step)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return create_block_mask(causal, None, None, sq, sk, device=device)
