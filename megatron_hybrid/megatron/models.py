"""A GPT architecture description with Megatron-LM's argument names, and the megatron-core model it builds.

Used by the recipes, the conversion tools, the benchmarks and the tests, so that all of them build the same
model from the same few numbers. Field names follow Megatron-LM's flags (``--num-layers`` → ``num_layers``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from ..constraints import Sizes, check

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SCORE_FUNCTIONS = ("softmax", "sigmoid")
_DISPATCHERS = ("allgather", "alltoall")
_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")


def moe_layer_pattern(moe_layer_freq: Union[int, list], num_layers: int) -> list[int]:
    """1 for each MoE layer, 0 for a dense one, as Megatron-LM reads ``moe_layer_freq``: an int n makes every n-th
    layer from the first MoE, a list gives one entry a layer."""
    if isinstance(moe_layer_freq, int):
        return [int(i % moe_layer_freq == 0) for i in range(num_layers)]
    return [int(v) for v in moe_layer_freq]


@dataclass
class GPTArchitecture:
    """A decoder-only transformer, in Megatron-LM's terms."""

    num_layers: int
    """--num-layers"""
    hidden_size: int
    """--hidden-size"""
    num_attention_heads: int
    """--num-attention-heads"""
    vocab_size: int
    """The tokenizer's vocabulary size (before padding)."""
    ffn_hidden_size: Optional[int] = None
    """--ffn-hidden-size (default 4 × hidden)."""
    num_query_groups: Optional[int] = None
    """--num-query-groups with --group-query-attention (None: multi-head attention)."""
    kv_channels: Optional[int] = None
    """--kv-channels, the head dimension (default hidden / heads)."""
    max_position_embeddings: int = 4096
    """--max-position-embeddings"""
    make_vocab_size_divisible_by: int = 128
    """--make-vocab-size-divisible-by; the padded vocabulary is a multiple of this × TP."""
    swiglu: bool = True
    """--swiglu (gated SiLU MLP)."""
    normalization: str = "RMSNorm"
    """--normalization: RMSNorm or LayerNorm."""
    norm_epsilon: float = 1e-5
    """--norm-epsilon"""
    position_embedding_type: str = "rope"
    """--position-embedding-type: rope or learned_absolute."""
    rotary_base: int = 10000
    """--rotary-base"""
    rotary_percent: float = 1.0
    """--rotary-percent"""
    use_rope_scaling: bool = False
    """--use-rope-scaling (Llama 3.1 style)."""
    rope_scaling_factor: float = 8.0
    """--rope-scaling-factor"""
    untie_embeddings_and_output_weights: bool = True
    """--untie-embeddings-and-output-weights"""
    add_bias_linear: bool = False
    """Bias on all linear layers (Megatron-LM's default; --disable-bias-linear turns it off)."""
    add_qkv_bias: bool = False
    """--add-qkv-bias (Qwen2)."""
    qk_layernorm: bool = False
    """--qk-layernorm (Qwen3)."""
    params_dtype: str = "float32"
    """float32, bfloat16 or float16 (--bf16 / --fp16)."""
    init_method_std: float = 0.02
    """--init-method-std"""
    num_experts: Optional[int] = None
    """--num-experts (None: a dense model)."""
    moe_router_topk: int = 2
    """--moe-router-topk: experts per token."""
    moe_ffn_hidden_size: Optional[int] = None
    """--moe-ffn-hidden-size: each expert's hidden size (None: ``ffn_hidden_size``)."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """--moe-shared-expert-intermediate-size: the shared experts' total hidden size (None: no shared expert)."""
    moe_router_score_function: str = "softmax"
    """--moe-router-score-function: softmax or sigmoid."""
    moe_aux_loss_coeff: float = 0.0
    """--moe-aux-loss-coeff: weight of the load-balancing loss."""
    moe_token_dispatcher_type: str = "allgather"
    """--moe-token-dispatcher-type: allgather, or alltoall (NCCL only on megatron-core 0.16.1: on gloo its
    ``all_to_all_single`` rejects the tensor split sizes)."""
    moe_layer_freq: Union[int, list] = 1
    """--moe-layer-freq: N makes every N-th layer (0, N, 2N, ...) an MoE layer; a list of 0/1, one per layer,
    says which are (1: MoE)."""
    moe_router_enable_expert_bias: bool = False
    """--moe-router-enable-expert-bias: aux-loss-free balancing by a per-expert routing bias (sigmoid scores)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """--moe-router-load-balancing-type: aux_loss, seq_aux_loss or none."""
    moe_router_pre_softmax: bool = False
    """--moe-router-pre-softmax: the top-k weights are the softmax over all experts' logits, taken at the chosen
    experts (they need not sum to 1); off, they are the softmax over the top-k logits alone (they sum to 1).
    Softmax scores only; required with top-1 (a softmax over one logit is constant)."""
    moe_shared_expert_gate: bool = False
    """--moe-shared-expert-gate: the shared experts' output is scaled per token by ``sigmoid(x · w)`` (a learnt
    ``[1, hidden]`` weight, as Qwen2-MoE's ``shared_expert_gate``). Needs a shared expert."""
    extra: dict = field(default_factory=dict)
    """Further TransformerConfig fields, passed through as given."""

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        """Megatron-LM's padding: a multiple of ``make_vocab_size_divisible_by × TP``."""
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.params_dtype]

    def moe_layer_pattern(self) -> list[int]:
        """One entry per layer, 1 for an MoE layer and 0 for a dense one (all 0 without experts), read from
        ``moe_layer_freq`` as Megatron-LM reads it."""
        if self.num_experts is None:
            return [0] * self.num_layers
        return moe_layer_pattern(self.moe_layer_freq, self.num_layers)

    def validate(self, *, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                 expert_model_parallel_size: int = 1, expert_tensor_parallel_size: Optional[int] = None) -> None:
        """Raise ``ValueError`` when a field is invalid or the sizes do not divide the model.
        ``expert_tensor_parallel_size`` defaults to the tensor-parallel size (as in megatron-core)."""
        t, p = tensor_model_parallel_size, pipeline_model_parallel_size
        self._validate_moe(expert_model_parallel_size=expert_model_parallel_size, tensor_model_parallel_size=t,
                           expert_tensor_parallel_size=t if expert_tensor_parallel_size is None
                           else expert_tensor_parallel_size)
        groups = self.num_query_groups or self.num_attention_heads
        if self.params_dtype not in _DTYPES:
            raise ValueError(f"params_dtype ({self.params_dtype!r}) must be one of {sorted(_DTYPES)}")
        if self.make_vocab_size_divisible_by < 1:  # padded_vocab_size divides by it
            raise ValueError(f"make_vocab_size_divisible_by ({self.make_vocab_size_divisible_by}) must be ≥ 1")
        if self.num_attention_heads % groups:
            raise ValueError(f"num_query_groups ({groups}) must divide num_attention_heads "
                             f"({self.num_attention_heads})")
        # Not t | num_query_groups: the converter writes checkpoints with TP a multiple of the groups too.
        check(Sizes(t=t, p=p, num_attention_heads=self.num_attention_heads, num_layers=self.num_layers,
                    ffn_hidden_size=self.ffn_hidden_size or 4 * self.hidden_size),
              "t_divides_heads", "p_divides_layers", "t_divides_ffn")

    def _validate_moe(self, *, expert_model_parallel_size: int, tensor_model_parallel_size: int,
                      expert_tensor_parallel_size: int) -> None:
        e, t, et = expert_model_parallel_size, tensor_model_parallel_size, expert_tensor_parallel_size
        if self.num_experts is None:
            if e != 1:
                raise ValueError(f"expert_model_parallel_size ({e}) needs num_experts (None: a dense model)")
            if et != t:
                raise ValueError(f"expert_tensor_parallel_size ({et}) needs num_experts (None: a dense model)")
            return
        n = self.num_experts
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_experts ({n!r}) must be an integer ≥ 1, or None for a dense model")
        k = self.moe_router_topk
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
            raise ValueError(f"moe_router_topk ({self.moe_router_topk}) must be between 1 and num_experts ({n})")
        for name, value, allowed in (
                ("moe_router_score_function", self.moe_router_score_function, _SCORE_FUNCTIONS),
                ("moe_token_dispatcher_type", self.moe_token_dispatcher_type, _DISPATCHERS),
                ("moe_router_load_balancing_type", self.moe_router_load_balancing_type, _LOAD_BALANCING)):
            if value not in allowed:
                raise ValueError(f"{name} ({value!r}) must be one of {list(allowed)}")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError(f"moe_router_enable_expert_bias needs moe_router_score_function 'sigmoid' "
                             f"(got {self.moe_router_score_function!r})")
        if self.moe_router_pre_softmax and self.moe_router_score_function != "softmax":
            raise ValueError(f"moe_router_pre_softmax needs moe_router_score_function 'softmax' "
                             f"(got {self.moe_router_score_function!r})")
        if k == 1 and self.moe_router_score_function == "softmax" and not self.moe_router_pre_softmax:
            raise ValueError("moe_router_topk (1) with moe_router_score_function 'softmax' needs "
                             "moe_router_pre_softmax (a softmax over one logit is constant)")
        if self.moe_shared_expert_intermediate_size is not None and self.add_bias_linear:
            raise ValueError(f"moe_shared_expert_intermediate_size ({self.moe_shared_expert_intermediate_size}) "
                             "with add_bias_linear: megatron-core's shared experts have no biases")
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            raise ValueError("moe_shared_expert_gate needs moe_shared_expert_intermediate_size (None: no shared "
                             "expert to gate)")
        coeff = self.moe_aux_loss_coeff
        if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not 0 <= coeff < float("inf"):
            raise ValueError(f"moe_aux_loss_coeff ({coeff!r}) must be a finite number ≥ 0")
        freq = self.moe_layer_freq
        if isinstance(freq, bool) or not isinstance(freq, (int, list)):
            raise ValueError(f"moe_layer_freq ({freq!r}) must be an int or a list of 0/1 per layer")
        if isinstance(freq, int) and freq < 1:
            raise ValueError(f"moe_layer_freq ({freq}) must be ≥ 1")
        if isinstance(freq, list) and (len(freq) != self.num_layers or any(v not in (0, 1) for v in freq)):
            raise ValueError(f"moe_layer_freq ({freq}) must list 0 or 1 for each of the {self.num_layers} layers")
        # megatron-core's default for the routed experts' MLP is the dense one's.
        expert_ffn = (self.ffn_hidden_size or 4 * self.hidden_size) if self.moe_ffn_hidden_size is None \
            else self.moe_ffn_hidden_size
        for name, value in (("moe_ffn_hidden_size", expert_ffn), ("expert_model_parallel_size", e),
                            ("expert_tensor_parallel_size", et),
                            ("moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size)):
            if value is not None and value < 1:
                raise ValueError(f"{name} ({value}) must be ≥ 1")
        check(Sizes(moe=True, t=t, e=e, et=et, num_moe_experts=n, moe_ffn_hidden_size=expert_ffn,
                    moe_shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size,
                    add_bias_linear=self.add_bias_linear),
              "et_divides_expert_ffn", "t_divides_shared_expert", "e_divides_experts", "expert_bias_needs_et_1",
              rename={"num_moe_experts": "num_experts",
                      **({"moe_ffn_hidden_size": "ffn_hidden_size"} if self.moe_ffn_hidden_size is None else {})})

    def transformer_config(self, *, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                           expert_model_parallel_size: int = 1, expert_tensor_parallel_size: Optional[int] = None,
                           **overrides: Any):
        """The megatron-core ``TransformerConfig`` for this architecture at the given parallel sizes
        (``expert_tensor_parallel_size`` defaults to the tensor-parallel size)."""
        from megatron.core.transformer import TransformerConfig

        self.validate(tensor_model_parallel_size=tensor_model_parallel_size,
                      pipeline_model_parallel_size=pipeline_model_parallel_size,
                      expert_model_parallel_size=expert_model_parallel_size,
                      expert_tensor_parallel_size=expert_tensor_parallel_size)
        kwargs: dict[str, Any] = dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            ffn_hidden_size=self.ffn_hidden_size or 4 * self.hidden_size,
            kv_channels=self.kv_channels,
            gated_linear_unit=self.swiglu,
            activation_func=torch.nn.functional.silu if self.swiglu else torch.nn.functional.gelu,
            normalization=self.normalization,
            layernorm_epsilon=self.norm_epsilon,
            add_bias_linear=self.add_bias_linear,
            add_qkv_bias=self.add_qkv_bias,
            qk_layernorm=self.qk_layernorm,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            init_method_std=self.init_method_std,
            params_dtype=self.dtype,
            bf16=self.dtype == torch.bfloat16,
            fp16=self.dtype == torch.float16,
            pipeline_dtype=self.dtype,
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            sequence_parallel=False,
            # Initialise the full weight on the host and split it, so every layout starts from the same numbers.
            use_cpu_initialization=True,
        )
        if self.num_experts is not None:  # a dense config gets no MoE keys: its TransformerConfig is unchanged
            kwargs.update(
                num_moe_experts=self.num_experts,
                moe_router_topk=self.moe_router_topk,
                moe_ffn_hidden_size=self.moe_ffn_hidden_size or kwargs["ffn_hidden_size"],
                moe_shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size,
                moe_router_score_function=self.moe_router_score_function,
                moe_aux_loss_coeff=self.moe_aux_loss_coeff,
                moe_token_dispatcher_type=self.moe_token_dispatcher_type,
                moe_layer_freq=self.moe_layer_freq,
                moe_router_enable_expert_bias=self.moe_router_enable_expert_bias,
                moe_router_load_balancing_type=self.moe_router_load_balancing_type,
                moe_router_pre_softmax=self.moe_router_pre_softmax,
                moe_shared_expert_gate=self.moe_shared_expert_gate,
                # SequentialMLP: 0.16.1's GroupedMLP needs the CUDA-only grouped_gemm package.
                moe_grouped_gemm=False,
                expert_model_parallel_size=expert_model_parallel_size,
                expert_tensor_parallel_size=expert_tensor_parallel_size or tensor_model_parallel_size,
            )
        kwargs.update(self.extra)
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)

    def layer_spec(self, transformer_impl: str = "local", *, attention_backend: str = "local"):
        """Megatron's GPT layer spec: ``local`` (plain PyTorch) or ``transformer_engine``; the local spec's core
        attention is ``attention_backend``'s (:mod:`megatron_hybrid.core_attention`: ``local``, ``sdpa``,
        ``flex`` or ``auto``)."""
        from megatron.core.models.gpt import gpt_layer_specs as specs

        from ..core_attention import check_attention_backend, with_core_attention

        check_attention_backend(attention_backend)
        # Every layer's spec: with experts, each layer is an MoE layer (mixed layers go through build()'s block spec).
        moe = {} if self.num_experts is None else dict(num_experts=self.num_experts, moe_grouped_gemm=False)
        if transformer_impl == "transformer_engine":
            if attention_backend != "local":  # TE's spec has TE's attention, chosen by TE's own settings
                raise ValueError(f"attention_backend ({attention_backend!r}) is for transformer_impl 'local'; "
                                 "transformer_impl 'transformer_engine' takes 'local' (its own attention)")
            return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=self.qk_layernorm, **moe)
        if transformer_impl != "local":
            raise ValueError(f"transformer_impl ({transformer_impl!r}) must be 'local' or 'transformer_engine'")
        return with_core_attention(specs.get_gpt_layer_local_spec(normalization=self.normalization,
                                                                  qk_layernorm=self.qk_layernorm, **moe),
                                   attention_backend)

    def build(self, config=None, *, pre_process: bool = True, post_process: bool = True, pg_collection=None,
              transformer_impl: str = "local", tensor_model_parallel_size: int = 1,
              pipeline_model_parallel_size: int = 1, expert_model_parallel_size: int = 1,
              expert_tensor_parallel_size: Optional[int] = None, vp_stage: Optional[int] = None,
              attention_backend: str = "local"):
        """Build this rank's GPTModel stage. ``config`` defaults to :meth:`transformer_config`; the core attention
        is ``attention_backend``'s (:meth:`layer_spec`).

        With rotary embeddings it applies :func:`megatron_hybrid.megatron.patches.rope.packed_rope_without_host_syncs`
        (packed sequences' rotary embeddings, the same bits, without reading ``cu_seqlens`` to the host in every
        layer). With experts it applies :func:`megatron_hybrid.megatron.patches.moe.moe_router_without_te` first;
        with dense and MoE layers mixed (``moe_layer_freq``) the stage's layers come from megatron-core's decoder
        block spec.
        """
        from ..core_attention import with_core_attention
        from .compat import build_gpt_model, gpt_decoder_block_spec  # megatron-core only where a model is built

        if config is None:
            config = self.transformer_config(tensor_model_parallel_size=tensor_model_parallel_size,
                                             pipeline_model_parallel_size=pipeline_model_parallel_size,
                                             expert_model_parallel_size=expert_model_parallel_size,
                                             expert_tensor_parallel_size=expert_tensor_parallel_size)
        spec = self.layer_spec(transformer_impl, attention_backend=attention_backend)
        if self.position_embedding_type == "rope":  # packed passes' rotary embeddings without host syncs
            from .patches.rope import packed_rope_without_host_syncs

            packed_rope_without_host_syncs()
        if self.num_experts is not None:
            from .patches.moe import moe_router_without_te

            moe_router_without_te()
            if 0 in self.moe_layer_pattern():
                pp = getattr(pg_collection, "pp", None) if pg_collection is not None else None
                spec = gpt_decoder_block_spec(
                    config, use_transformer_engine=transformer_impl == "transformer_engine",
                    normalization=self.normalization, vp_stage=vp_stage,
                    pp_rank=pp.rank() if pp is not None else None)
                if attention_backend != "local":  # the local spec's layers (layer_spec refused it for TE's)
                    spec = with_core_attention(spec, attention_backend)
        kwargs = dict(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=self.padded_vocab_size(config.tensor_model_parallel_size),
            max_sequence_length=self.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=not self.untie_embeddings_and_output_weights,
            position_embedding_type=self.position_embedding_type,
            rotary_base=self.rotary_base,
            rotary_percent=self.rotary_percent,
            rope_scaling=self.use_rope_scaling,
            rope_scaling_factor=self.rope_scaling_factor,
        )
        if pg_collection is not None:
            kwargs["pg_collection"] = pg_collection
        if vp_stage is not None:
            kwargs["vp_stage"] = vp_stage
        return build_gpt_model(**kwargs)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "GPTArchitecture":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown GPTArchitecture fields: {unknown}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def tiny_llama(**overrides: Any) -> GPTArchitecture:
    """A tiny Llama-shaped model (GQA, SwiGLU, RMSNorm, RoPE, untied embeddings) for tests and demos."""
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=96,
                vocab_size=250, make_vocab_size_divisible_by=32, max_position_embeddings=256)
    # 250 pads to 256 rows at every TP size up to 8, so all layouts compute the same function.
    base.update(overrides)
    return GPTArchitecture(**base)
