"""A GPT architecture description with Megatron-LM's argument names, and the megatron-core model it builds.

Used by the recipes, the conversion tools, the benchmarks and the tests, so that all of them build the same
model from the same few numbers. Field names follow Megatron-LM's flags (``--num-layers`` → ``num_layers``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    extra: dict = field(default_factory=dict)
    """Further TransformerConfig fields, passed through as given."""

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        """Megatron-LM's padding: a multiple of ``make_vocab_size_divisible_by × TP``."""
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.params_dtype]

    def validate(self, *, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1) -> None:
        """Raise ``ValueError`` when the sizes do not divide the model."""
        t, p = tensor_model_parallel_size, pipeline_model_parallel_size
        groups = self.num_query_groups or self.num_attention_heads
        if self.params_dtype not in _DTYPES:
            raise ValueError(f"params_dtype ({self.params_dtype!r}) must be one of {sorted(_DTYPES)}")
        if self.make_vocab_size_divisible_by < 1:  # padded_vocab_size divides by it
            raise ValueError(f"make_vocab_size_divisible_by ({self.make_vocab_size_divisible_by}) must be ≥ 1")
        if self.num_attention_heads % groups:
            raise ValueError(f"num_query_groups ({groups}) must divide num_attention_heads "
                             f"({self.num_attention_heads})")
        if self.num_attention_heads % t:
            raise ValueError(f"tensor_model_parallel_size ({t}) must divide num_attention_heads "
                             f"({self.num_attention_heads})")
        if self.num_layers % p:
            raise ValueError(f"pipeline_model_parallel_size ({p}) must divide num_layers ({self.num_layers})")
        ffn = self.ffn_hidden_size or 4 * self.hidden_size
        if ffn % t:
            raise ValueError(f"tensor_model_parallel_size ({t}) must divide ffn_hidden_size ({ffn})")

    def transformer_config(self, *, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                           **overrides: Any):
        """The megatron-core ``TransformerConfig`` for this architecture at the given parallel sizes."""
        from megatron.core.transformer import TransformerConfig

        self.validate(tensor_model_parallel_size=tensor_model_parallel_size,
                      pipeline_model_parallel_size=pipeline_model_parallel_size)
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
        kwargs.update(self.extra)
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)

    def layer_spec(self, transformer_impl: str = "local"):
        """Megatron's GPT layer spec: ``local`` (plain PyTorch) or ``transformer_engine``."""
        from megatron.core.models.gpt import gpt_layer_specs as specs

        if transformer_impl == "transformer_engine":
            return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=self.qk_layernorm)
        if transformer_impl != "local":
            raise ValueError(f"transformer_impl ({transformer_impl!r}) must be 'local' or 'transformer_engine'")
        return specs.get_gpt_layer_local_spec(normalization=self.normalization, qk_layernorm=self.qk_layernorm)

    def build(self, config=None, *, pre_process: bool = True, post_process: bool = True, pg_collection=None,
              transformer_impl: str = "local", tensor_model_parallel_size: int = 1,
              pipeline_model_parallel_size: int = 1, vp_stage: Optional[int] = None):
        """Build this rank's GPTModel stage. ``config`` defaults to :meth:`transformer_config`."""
        from .compat import build_gpt_model  # megatron-core only where a model is built (convert/ needs none)

        if config is None:
            config = self.transformer_config(tensor_model_parallel_size=tensor_model_parallel_size,
                                             pipeline_model_parallel_size=pipeline_model_parallel_size)
        kwargs = dict(
            config=config,
            transformer_layer_spec=self.layer_spec(transformer_impl),
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
