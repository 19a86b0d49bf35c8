"""Hugging Face model families: their config ⇄ :class:`GPTArchitecture`, and their tensors ⇄ megatron-core's.

Supported: Llama (incl. Llama 3.x ``rope_scaling``), Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k RMSNorm, a head
dimension other than hidden/heads). All four share Llama's tensor names; they differ only in the flags of
:class:`Family`. The mapping (see docs/conversion.md in the shared references) works on *global* megatron-core
tensors: canonical (local-spec) names, global layer numbers, unsharded, the vocabulary padded. Sharding, stage
numbering and the Transformer Engine names are the checkpoint layout's business (``layout.py``).

Legend: H hidden, nh heads, ng KV heads (query groups), d head dim, F ffn hidden, V vocabulary, Vp padded V.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..models import GPTArchitecture
from .safetensors_io import CheckpointError
from .virtual import Virtual


@dataclass(frozen=True)
class Family:
    """What distinguishes one Llama-like Hugging Face family from another."""

    model_type: str
    """``config.json``'s ``model_type``."""
    hf_class: str
    """The transformers class in ``config.json``'s ``architectures``."""
    qkv_bias: bool = False
    """q/k/v projections carry a bias (Megatron ``--add-qkv-bias``)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys (Megatron ``--qk-layernorm``)."""


FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM"),
    "mistral": Family("mistral", "MistralForCausalLM"),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", qk_norm=True),
}

# megatron-core hard-codes Llama 3's rope scaling constants (RotaryEmbedding._apply_scaling, 0.16.1).
_MCORE_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"


def family_of(model_type: Optional[str]) -> Family:
    if model_type not in FAMILIES:
        raise CheckpointError(f"unsupported model_type {model_type!r}; supported: {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def infer_family(arch: GPTArchitecture) -> Family:
    """The family whose flags match ``arch`` (Llama for a plain one)."""
    if arch.qk_layernorm:
        return FAMILIES["qwen3"]
    return FAMILIES["qwen2"] if arch.add_qkv_bias else FAMILIES["llama"]


def _dtype_name(dtype: Any) -> Optional[str]:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _rope(config: Any) -> tuple[float, Optional[dict]]:
    """(theta, scaling or None) from a transformers config: 5.x keeps both in ``rope_parameters``, 4.x has
    ``rope_theta`` and ``rope_scaling``."""
    params = getattr(config, "rope_parameters", None)
    if params:
        if "rope_theta" not in params:  # per-layer-type parameters (not in the supported families)
            raise CheckpointError(f"unsupported rope_parameters {params!r}")
        theta, scaling = params["rope_theta"], params
    else:
        theta, scaling = getattr(config, "rope_theta", 10000.0), getattr(config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling


def architecture_from_hf(config: Any, *, make_vocab_size_divisible_by: int = 128,
                         fallback_dtype: Optional[torch.dtype] = None) -> tuple[Family, GPTArchitecture]:
    """The family and architecture of a transformers config object; ``CheckpointError`` for what Megatron's
    GPTModel cannot express."""
    family = family_of(getattr(config, "model_type", None))
    name = family.model_type
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{name}: hidden_act {act!r} is not supported (only silu, i.e. SwiGLU)")
    if getattr(config, "mlp_bias", False):
        raise CheckpointError(f"{name}: mlp_bias=True is not supported")
    if not family.qkv_bias and getattr(config, "attention_bias", False):
        # q/k/v *and* o_proj biases: Megatron has --add-qkv-bias (q/k/v only) or biases on every linear.
        raise CheckpointError(f"{name}: attention_bias=True (biases on q/k/v and o_proj) is not supported")
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    if not getattr(config, "head_dim", None) and hidden % heads:
        raise CheckpointError(f"{name}: hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads})")
    groups = getattr(config, "num_key_value_heads", None) or heads
    theta, scaling = _rope(config)
    if float(theta) != int(theta):
        raise CheckpointError(f"{name}: rope_theta {theta} is not an integer (Megatron's --rotary-base is)")
    use_rope_scaling, factor = False, 8.0
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type != "llama3":
            raise CheckpointError(f"{name}: rope scaling {rope_type!r} is not supported (only 'llama3')")
        for key, want in _MCORE_LLAMA3_ROPE.items():
            if float(scaling.get(key, want)) != want:
                raise CheckpointError(f"{name}: rope scaling {key}={scaling[key]} is not supported; megatron-core "
                                      f"hard-codes {want}")
        use_rope_scaling, factor = True, float(scaling["factor"])
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", True)  # Mistral has no switch: a window is a window
    if window and uses_window and window < config.max_position_embeddings:
        warnings.warn(f"{name}: sliding_window={window} is ignored (Megatron's GPTModel attends to the whole "
                      f"sequence); outputs differ for sequences longer than {window} tokens", stacklevel=2)
    dtype = _dtype_name(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))
    if dtype not in ("float32", "bfloat16", "float16"):
        dtype = _dtype_name(fallback_dtype) or "float32"
    arch = GPTArchitecture(
        num_layers=config.num_hidden_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        vocab_size=config.vocab_size,
        ffn_hidden_size=config.intermediate_size,
        num_query_groups=groups if groups != heads else None,
        kv_channels=head_dim if head_dim * heads != hidden else None,
        max_position_embeddings=config.max_position_embeddings,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        swiglu=True,
        normalization="RMSNorm",
        norm_epsilon=float(config.rms_norm_eps),
        position_embedding_type="rope",
        rotary_base=int(theta),
        use_rope_scaling=use_rope_scaling,
        rope_scaling_factor=factor,
        untie_embeddings_and_output_weights=not getattr(config, "tie_word_embeddings", False),
        add_bias_linear=False,
        add_qkv_bias=family.qkv_bias,
        qk_layernorm=family.qk_norm,
        params_dtype=dtype,
        init_method_std=float(getattr(config, "initializer_range", 0.02)),
    )
    return family, arch


def hf_config_from_architecture(arch: GPTArchitecture, family: Family) -> dict:
    """A ``config.json`` for ``arch`` (used when a checkpoint carries no Hugging Face config of its own)."""
    from transformers import AutoConfig

    a = arch
    if a.normalization != "RMSNorm" or not a.swiglu or a.add_bias_linear or a.position_embedding_type != "rope":
        raise CheckpointError(f"{family.model_type} needs RMSNorm, SwiGLU, RoPE and no linear biases; the checkpoint "
                              f"has normalization={a.normalization}, swiglu={a.swiglu}, add_bias_linear="
                              f"{a.add_bias_linear}, position_embedding_type={a.position_embedding_type}")
    if arch.add_qkv_bias != family.qkv_bias or arch.qk_layernorm != family.qk_norm:
        raise CheckpointError(f"{family.model_type} has qkv_bias={family.qkv_bias}, qk_norm={family.qk_norm}; the "
                              f"checkpoint has add_qkv_bias={arch.add_qkv_bias}, qk_layernorm={arch.qk_layernorm}")
    kwargs: dict[str, Any] = dict(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=_ffn(arch),
        num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=_groups(arch), head_dim=_head_dim(arch),
        max_position_embeddings=arch.max_position_embeddings, rms_norm_eps=arch.norm_epsilon,
        rope_theta=float(arch.rotary_base), tie_word_embeddings=not arch.untie_embeddings_and_output_weights,
        initializer_range=arch.init_method_std, hidden_act="silu", architectures=[family.hf_class],
    )
    if arch.use_rope_scaling:
        kwargs["rope_scaling"] = {"rope_type": "llama3", "factor": arch.rope_scaling_factor, **_MCORE_LLAMA3_ROPE}
    config = AutoConfig.for_model(family.model_type, **kwargs)
    config.torch_dtype = getattr(torch, arch.params_dtype)  # transformers 5 maps this onto ``dtype``
    return config.to_dict()


def _ffn(arch: GPTArchitecture) -> int:
    return arch.ffn_hidden_size or 4 * arch.hidden_size


def _groups(arch: GPTArchitecture) -> int:
    return arch.num_query_groups or arch.num_attention_heads


def _head_dim(arch: GPTArchitecture) -> int:
    return arch.kv_channels or arch.hidden_size // arch.num_attention_heads


def _layer(i: int) -> str:
    return f"decoder.layers.{i}."


def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def hf_shapes(family: Family, arch: GPTArchitecture) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of ``arch`` holds, with its shape."""
    h, v, f, d = arch.hidden_size, arch.vocab_size, _ffn(arch), _head_dim(arch)
    q, kv = arch.num_attention_heads * d, _groups(arch) * d
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if arch.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = (v, h)
    for i in range(arch.num_layers):
        p = _hf_layer(i)
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f)}
        if family.qkv_bias:
            out |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,)}
        if family.qk_norm:
            out |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return out


def _interleave_qkv(q: Virtual, k: Virtual, v: Virtual, groups: int, d: int) -> Virtual:
    """Megatron's fused QKV: for each KV group g, its query heads, then its key, then its value."""
    a = q.shape[0] // groups
    parts = []
    for g in range(groups):
        parts += [q.narrow(0, g * a, a), k.narrow(0, g * d, d), v.narrow(0, g * d, d)]
    return Virtual.cat(parts, 0)


def _split_qkv(qkv: Virtual, groups: int, d: int) -> tuple[Virtual, Virtual, Virtual]:
    block = qkv.shape[0] // groups
    a = block - 2 * d
    q = Virtual.cat([qkv.narrow(0, g * block, a) for g in range(groups)], 0)
    k = Virtual.cat([qkv.narrow(0, g * block + a, d) for g in range(groups)], 0)
    v = Virtual.cat([qkv.narrow(0, g * block + a + d, d) for g in range(groups)], 0)
    return q, k, v


def megatron_from_hf(family: Family, arch: GPTArchitecture, hf: dict[str, Virtual], *,
                     padded_vocab_size: int) -> dict[str, Virtual]:
    """Global megatron-core tensors (canonical names) from a Hugging Face checkpoint's tensors."""
    g, d, v = _groups(arch), _head_dim(arch), arch.vocab_size
    out = {EMBEDDING: hf["model.embed_tokens.weight"].pad(0, padded_vocab_size - v),
           FINAL_NORM: hf["model.norm.weight"]}
    if arch.untie_embeddings_and_output_weights:
        out[OUTPUT_LAYER] = hf["lm_head.weight"].pad(0, padded_vocab_size - v)
    for i in range(arch.num_layers):
        p, m = _hf_layer(i), _layer(i)
        attn = p + "self_attn."
        out[m + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = _interleave_qkv(
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], g, d)
        if family.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _interleave_qkv(
                hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"], g, d)
        if family.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf[attn + "q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[attn + "k_norm.weight"]
        out[m + "self_attention.linear_proj.weight"] = hf[attn + "o_proj.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = Virtual.cat(
            [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], 0)
        out[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
    return out


def hf_from_megatron(family: Family, arch: GPTArchitecture, mg: dict[str, Virtual]) -> dict[str, Virtual]:
    """A Hugging Face checkpoint's tensors from global megatron-core tensors (inverse of megatron_from_hf)."""
    g, d, v, f = _groups(arch), _head_dim(arch), arch.vocab_size, _ffn(arch)
    out = {"model.embed_tokens.weight": mg[EMBEDDING].narrow(0, 0, v), "model.norm.weight": mg[FINAL_NORM]}
    if arch.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = mg[OUTPUT_LAYER].narrow(0, 0, v)
    for i in range(arch.num_layers):
        p, m = _hf_layer(i), _layer(i)
        attn = p + "self_attn."
        out[p + "input_layernorm.weight"] = mg[m + "input_layernorm.weight"]
        q, k, val = _split_qkv(mg[m + "self_attention.linear_qkv.weight"], g, d)
        out |= {attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": val}
        if family.qkv_bias:
            q, k, val = _split_qkv(mg[m + "self_attention.linear_qkv.bias"], g, d)
            out |= {attn + "q_proj.bias": q, attn + "k_proj.bias": k, attn + "v_proj.bias": val}
        if family.qk_norm:
            out[attn + "q_norm.weight"] = mg[m + "self_attention.q_layernorm.weight"]
            out[attn + "k_norm.weight"] = mg[m + "self_attention.k_layernorm.weight"]
        out[attn + "o_proj.weight"] = mg[m + "self_attention.linear_proj.weight"]
        out[p + "post_attention_layernorm.weight"] = mg[m + "pre_mlp_layernorm.weight"]
        fc1 = mg[m + "mlp.linear_fc1.weight"]
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = fc1.narrow(0, 0, f), fc1.narrow(0, f, f)
        out[p + "mlp.down_proj.weight"] = mg[m + "mlp.linear_fc2.weight"]
    return out
