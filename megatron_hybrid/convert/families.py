"""Hugging Face model families: their config ⇄ :class:`GPTArchitecture`, and their tensors ⇄ megatron-core's.

Supported: Llama (incl. Llama 3.x ``rope_scaling``), Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k RMSNorm, a head
dimension other than hidden/heads), and the mixtures of experts Qwen3-MoE (Qwen3's attention, routed experts,
dense layers where ``mlp_only_layers``/``decoder_sparse_step`` say) and Qwen2-MoE (Qwen2's attention, routed
experts plus a sigmoid-gated shared expert). All share Llama's attention and dense-MLP tensor names; they differ
only in the flags of :class:`Family`. The mapping (see docs/conversion.md in the shared references) works on
*global* megatron-core tensors: canonical (local-spec) names, global layer numbers, global expert numbers
(``mlp.experts.local_experts.{expert}``), unsharded, the vocabulary padded. Sharding (tensor, expert and expert
tensor parallel), stage numbering and the Transformer Engine names are the checkpoint layout's business
(``layout.py``). Which tensors exist follows the architecture's own fields (biases, norms, experts), so that a
checkpoint written by training, with no family of its own, is read the same way.

Routing: both Qwen MoE families take a softmax over all experts, pick the top k and, with ``norm_topk_prob``,
divide by the picked probabilities' sum. Renormalised, that is ``exp(l_i) / Σ_topk exp(l_j)``: megatron-core's
default softmax over the top-k logits. Not renormalised, it is ``--moe-router-pre-softmax``.

Experts on disk: the Hub's checkpoints and transformers 5.24's ``save_pretrained`` store one tensor per expert
(``mlp.experts.{e}.gate_proj.weight`` …); transformers 5.x models hold them fused (``mlp.experts.gate_up_proj``
``[E, 2·Fe, H]``, gate rows first, and ``mlp.experts.down_proj`` ``[E, H, Fe]``), a layout a checkpoint may also
have. Both are read; the per-expert one is written.

Legend: H hidden, nh heads, ng KV heads (query groups), d head dim, F ffn hidden, Fe an expert's ffn hidden, Fs the
shared expert's, E experts, V vocabulary, Vp padded V.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..megatron.models import GPTArchitecture
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
    moe: bool = False
    """Routed experts (Qwen-MoE's sparse blocks: ``mlp.gate``, ``mlp.experts``) in the layers the config names."""
    shared_expert: bool = False
    """A shared expert beside the routed ones, scaled by ``sigmoid(shared_expert_gate(x))`` (Megatron
    ``--moe-shared-expert-intermediate-size`` with ``--moe-shared-expert-gate``)."""


FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM"),
    "mistral": Family("mistral", "MistralForCausalLM"),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", qk_norm=True),
    "qwen2_moe": Family("qwen2_moe", "Qwen2MoeForCausalLM", qkv_bias=True, moe=True, shared_expert=True),
    "qwen3_moe": Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, moe=True),
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
    if arch.num_experts is not None:
        return FAMILIES["qwen2_moe"] if arch.moe_shared_expert_intermediate_size else FAMILIES["qwen3_moe"]
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
    if family.qkv_bias and not getattr(config, "qkv_bias", True):  # Qwen2-MoE has the switch, Qwen2 has not
        raise CheckpointError(f"{name}: qkv_bias=False is not supported")
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
        **(_moe_from_hf(config, family) if family.moe else {}),
    )
    return family, arch


def _moe_from_hf(config: Any, family: Family) -> dict[str, Any]:
    """GPTArchitecture's MoE fields for a Qwen-MoE config (see the module docstring for the routing)."""
    name, layers = family.model_type, config.num_hidden_layers
    experts, k = config.num_experts, config.num_experts_per_tok
    # transformers' Qwen*MoeDecoderLayer: layer i is sparse unless listed in mlp_only_layers, and only every
    # decoder_sparse_step-th layer counting from 1 (Megatron's integer moe_layer_freq counts from 0: a list then).
    dense, step = set(getattr(config, "mlp_only_layers", None) or []), getattr(config, "decoder_sparse_step", 1)
    pattern = [int(i not in dense and experts > 0 and (i + 1) % step == 0) for i in range(layers)]
    if not any(pattern):
        raise CheckpointError(f"{name}: no layer has experts (num_experts={experts}, decoder_sparse_step={step}, "
                              f"mlp_only_layers={sorted(dense)}); convert it as a dense model")
    renormalise = bool(getattr(config, "norm_topk_prob", False))
    if k == 1 and renormalise:
        raise CheckpointError(f"{name}: num_experts_per_tok=1 with norm_topk_prob=True (every routing weight 1.0) "
                              "is not supported: megatron-core routes top-1 only with --moe-router-pre-softmax")
    # transformers adds the load-balancing loss only with output_router_logits; so does the converted model.
    coeff = float(config.router_aux_loss_coef) if getattr(config, "output_router_logits", False) else 0.0
    out: dict[str, Any] = dict(
        num_experts=experts, moe_router_topk=k, moe_ffn_hidden_size=config.moe_intermediate_size,
        moe_layer_freq=1 if all(pattern) else pattern, moe_router_score_function="softmax",
        moe_router_pre_softmax=not renormalise, moe_aux_loss_coeff=coeff,
        moe_router_load_balancing_type="aux_loss" if coeff else "none")
    if family.shared_expert:
        size = config.shared_expert_intermediate_size
        if not size:
            raise CheckpointError(f"{name}: shared_expert_intermediate_size={size} is not supported (≥ 1)")
        out |= dict(moe_shared_expert_intermediate_size=size, moe_shared_expert_gate=True)
    return out


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
    shared = arch.moe_shared_expert_intermediate_size is not None
    if (arch.num_experts is not None) != family.moe or family.moe and (
            shared != family.shared_expert or arch.moe_shared_expert_gate != family.shared_expert
            or arch.moe_router_score_function != "softmax" or arch.moe_router_enable_expert_bias):
        raise CheckpointError(
            f"{family.model_type} has experts={family.moe}, a gated shared expert={family.shared_expert} and "
            f"softmax routing; the checkpoint has num_experts={arch.num_experts}, "
            f"moe_shared_expert_intermediate_size={arch.moe_shared_expert_intermediate_size}, moe_shared_expert_gate="
            f"{arch.moe_shared_expert_gate}, moe_router_score_function={arch.moe_router_score_function!r}, "
            f"moe_router_enable_expert_bias={arch.moe_router_enable_expert_bias}")
    kwargs: dict[str, Any] = dict(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=_ffn(arch),
        num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=_groups(arch), head_dim=_head_dim(arch),
        max_position_embeddings=arch.max_position_embeddings, rms_norm_eps=arch.norm_epsilon,
        rope_theta=float(arch.rotary_base), tie_word_embeddings=not arch.untie_embeddings_and_output_weights,
        initializer_range=arch.init_method_std, hidden_act="silu", architectures=[family.hf_class],
    )
    if family.moe:
        pattern = arch.moe_layer_pattern()
        kwargs |= dict(num_experts=arch.num_experts, num_experts_per_tok=arch.moe_router_topk,
                       moe_intermediate_size=_expert_ffn(arch), norm_topk_prob=not arch.moe_router_pre_softmax,
                       decoder_sparse_step=1, mlp_only_layers=[i for i, m in enumerate(pattern) if not m],
                       router_aux_loss_coef=arch.moe_aux_loss_coeff, output_router_logits=arch.moe_aux_loss_coeff > 0)
        if family.shared_expert:
            kwargs["shared_expert_intermediate_size"] = arch.moe_shared_expert_intermediate_size
    if arch.use_rope_scaling:
        kwargs["rope_scaling"] = {"rope_type": "llama3", "factor": arch.rope_scaling_factor, **_MCORE_LLAMA3_ROPE}
    config = AutoConfig.for_model(family.model_type, **kwargs)
    config.torch_dtype = getattr(torch, arch.params_dtype)  # transformers 5 maps this onto ``dtype``
    return config.to_dict()


def _ffn(arch: GPTArchitecture) -> int:
    return arch.ffn_hidden_size or 4 * arch.hidden_size


def _expert_ffn(arch: GPTArchitecture) -> int:
    return arch.moe_ffn_hidden_size or _ffn(arch)


def _groups(arch: GPTArchitecture) -> int:
    return arch.num_query_groups or arch.num_attention_heads


def _head_dim(arch: GPTArchitecture) -> int:
    return arch.kv_channels or arch.hidden_size // arch.num_attention_heads


def _layer(i: int) -> str:
    return f"decoder.layers.{i}."


def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


#: A fused expert tensor of transformers 5.x (``…mlp.experts.gate_up_proj`` / ``…mlp.experts.down_proj``).
FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$")


def hf_shapes(family: Family, arch: GPTArchitecture, *, fused_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of ``arch`` holds, with its shape; experts one tensor each, or
    ``fused_experts`` (transformers 5.x's module layout)."""
    h, v, f, d = arch.hidden_size, arch.vocab_size, _ffn(arch), _head_dim(arch)
    q, kv = arch.num_attention_heads * d, _groups(arch) * d
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if arch.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = (v, h)
    for i, moe in enumerate(arch.moe_layer_pattern()):
        p = _hf_layer(i)
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)}
        if arch.add_qkv_bias:
            out |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,)}
        if arch.qk_layernorm:
            out |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if not moe:
            out |= _gated_mlp_shapes(p + "mlp.", h, f)
            continue
        n, fe = arch.num_experts, _expert_ffn(arch)
        out[p + "mlp.gate.weight"] = (n, h)
        if fused_experts:
            out |= {p + "mlp.experts.gate_up_proj": (n, 2 * fe, h), p + "mlp.experts.down_proj": (n, h, fe)}
        else:
            for e in range(n):
                out |= _gated_mlp_shapes(f"{p}mlp.experts.{e}.", h, fe)
        if arch.moe_shared_expert_intermediate_size is not None:
            out |= _gated_mlp_shapes(p + "mlp.shared_expert.", h, arch.moe_shared_expert_intermediate_size)
            if arch.moe_shared_expert_gate:
                out[p + "mlp.shared_expert_gate.weight"] = (1, h)
    return out


def _gated_mlp_shapes(prefix: str, h: int, f: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (f, h), prefix + "up_proj.weight": (f, h), prefix + "down_proj.weight": (h, f)}


def per_expert_tensors(hf: dict[str, Virtual]) -> dict[str, Virtual]:
    """``hf`` with fused expert tensors (``mlp.experts.gate_up_proj`` ``[E, 2·Fe, H]``, gate rows first, and
    ``down_proj`` ``[E, H, Fe]``) replaced by the per-expert names the Hub's checkpoints use."""
    out = {}
    for name, v in hf.items():
        m = FUSED_EXPERTS.match(name)
        if m is None:
            out[name] = v
            continue
        for e in range(v.shape[0]):
            expert = v.select(e)
            prefix = f"{m.group(1)}{e}."
            if m.group(2) == "down_proj":
                out[prefix + "down_proj.weight"] = expert
            else:
                gate, up = expert.chunk(2, 0)
                out[prefix + "gate_proj.weight"], out[prefix + "up_proj.weight"] = gate, up
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


def _fc1(hf: dict[str, Virtual], prefix: str) -> Virtual:
    """Megatron's gated fc1, ``[gate; up]``."""
    return Virtual.cat([hf[prefix + "gate_proj.weight"], hf[prefix + "up_proj.weight"]], 0)


def megatron_from_hf(family: Family, arch: GPTArchitecture, hf: dict[str, Virtual], *,
                     padded_vocab_size: int) -> dict[str, Virtual]:
    """Global megatron-core tensors (canonical names) from a Hugging Face checkpoint's tensors (experts one
    tensor each: :func:`per_expert_tensors`)."""
    g, d, v = _groups(arch), _head_dim(arch), arch.vocab_size
    out = {EMBEDDING: hf["model.embed_tokens.weight"].pad(0, padded_vocab_size - v),
           FINAL_NORM: hf["model.norm.weight"]}
    if arch.untie_embeddings_and_output_weights:
        out[OUTPUT_LAYER] = hf["lm_head.weight"].pad(0, padded_vocab_size - v)
    for i, moe in enumerate(arch.moe_layer_pattern()):
        p, m = _hf_layer(i), _layer(i)
        attn = p + "self_attn."
        out[m + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = _interleave_qkv(
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], g, d)
        if arch.add_qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _interleave_qkv(
                hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"], g, d)
        if arch.qk_layernorm:
            out[m + "self_attention.q_layernorm.weight"] = hf[attn + "q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[attn + "k_norm.weight"]
        out[m + "self_attention.linear_proj.weight"] = hf[attn + "o_proj.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        if not moe:
            out[m + "mlp.linear_fc1.weight"] = _fc1(hf, p + "mlp.")
            out[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
            continue
        out[m + "mlp.router.weight"] = hf[p + "mlp.gate.weight"]
        for e in range(arch.num_experts):
            expert = f"{m}mlp.experts.local_experts.{e}."
            out[expert + "linear_fc1.weight"] = _fc1(hf, f"{p}mlp.experts.{e}.")
            out[expert + "linear_fc2.weight"] = hf[f"{p}mlp.experts.{e}.down_proj.weight"]
        if arch.moe_shared_expert_intermediate_size is not None:
            out[m + "mlp.shared_experts.linear_fc1.weight"] = _fc1(hf, p + "mlp.shared_expert.")
            out[m + "mlp.shared_experts.linear_fc2.weight"] = hf[p + "mlp.shared_expert.down_proj.weight"]
            if arch.moe_shared_expert_gate:
                out[m + "mlp.shared_experts.gate_weight"] = hf[p + "mlp.shared_expert_gate.weight"]
    return out


def _gated_mlp(fc1: Virtual, fc2: Virtual, prefix: str) -> dict[str, Virtual]:
    """Hugging Face's gate/up/down projections from Megatron's ``[gate; up]`` fc1 and fc2."""
    gate, up = fc1.chunk(2, 0)
    return {prefix + "gate_proj.weight": gate, prefix + "up_proj.weight": up, prefix + "down_proj.weight": fc2}


def hf_from_megatron(family: Family, arch: GPTArchitecture, mg: dict[str, Virtual]) -> dict[str, Virtual]:
    """A Hugging Face checkpoint's tensors from global megatron-core tensors (inverse of megatron_from_hf; experts
    one tensor each, as transformers 5.24's ``save_pretrained`` writes them)."""
    g, d, v = _groups(arch), _head_dim(arch), arch.vocab_size
    out = {"model.embed_tokens.weight": mg[EMBEDDING].narrow(0, 0, v), "model.norm.weight": mg[FINAL_NORM]}
    if arch.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = mg[OUTPUT_LAYER].narrow(0, 0, v)
    for i, moe in enumerate(arch.moe_layer_pattern()):
        p, m = _hf_layer(i), _layer(i)
        attn = p + "self_attn."
        out[p + "input_layernorm.weight"] = mg[m + "input_layernorm.weight"]
        q, k, val = _split_qkv(mg[m + "self_attention.linear_qkv.weight"], g, d)
        out |= {attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": val}
        if arch.add_qkv_bias:
            q, k, val = _split_qkv(mg[m + "self_attention.linear_qkv.bias"], g, d)
            out |= {attn + "q_proj.bias": q, attn + "k_proj.bias": k, attn + "v_proj.bias": val}
        if arch.qk_layernorm:
            out[attn + "q_norm.weight"] = mg[m + "self_attention.q_layernorm.weight"]
            out[attn + "k_norm.weight"] = mg[m + "self_attention.k_layernorm.weight"]
        out[attn + "o_proj.weight"] = mg[m + "self_attention.linear_proj.weight"]
        out[p + "post_attention_layernorm.weight"] = mg[m + "pre_mlp_layernorm.weight"]
        if not moe:
            out |= _gated_mlp(mg[m + "mlp.linear_fc1.weight"], mg[m + "mlp.linear_fc2.weight"], p + "mlp.")
            continue
        out[p + "mlp.gate.weight"] = mg[m + "mlp.router.weight"]
        for e in range(arch.num_experts):
            expert = f"{m}mlp.experts.local_experts.{e}."
            out |= _gated_mlp(mg[expert + "linear_fc1.weight"], mg[expert + "linear_fc2.weight"],
                              f"{p}mlp.experts.{e}.")
        if arch.moe_shared_expert_intermediate_size is not None:
            out |= _gated_mlp(mg[m + "mlp.shared_experts.linear_fc1.weight"],
                              mg[m + "mlp.shared_experts.linear_fc2.weight"], p + "mlp.shared_expert.")
            if arch.moe_shared_expert_gate:
                out[p + "mlp.shared_expert_gate.weight"] = mg[m + "mlp.shared_experts.gate_weight"]
    return out
