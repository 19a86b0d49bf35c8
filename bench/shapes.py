"""The model shapes the benchmarks share (one definition; a benchmark picks the ones it needs)."""

from __future__ import annotations

from megatron_hybrid.megatron.models import GPTArchitecture

SHAPES: dict[str, GPTArchitecture] = {
    # 2 layers, hidden 64, fp32: the CPU smoke runs of the one-device benchmarks (seconds).
    "cpu-tiny": GPTArchitecture(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=128, vocab_size=256, make_vocab_size_divisible_by=32,
                                max_position_embeddings=512),
    # 48 layers of a tiny model: 291 parameter tensors, 7.2 MB (fp32) in all, 3.6 MB per rank at t·p = 2.
    "many-small": GPTArchitecture(num_layers=48, hidden_size=64, num_attention_heads=8, ffn_hidden_size=128,
                                  vocab_size=256, make_vocab_size_divisible_by=32, max_position_embeddings=256),
    # 4 wide layers: 27 parameter tensors, 453 MB (fp32) in all, 113 MB per rank at t·p = 4.
    "few-large": GPTArchitecture(num_layers=4, hidden_size=1536, num_attention_heads=12, num_query_groups=4,
                                 ffn_hidden_size=4096, vocab_size=4096, make_vocab_size_divisible_by=128,
                                 max_position_embeddings=256),
    # 0.89 B parameters (Llama-shaped, GQA), 1.8 GB in bf16: one GPU shared by 2 or 4 gloo ranks (--backend gloo).
    "gpu-1b": GPTArchitecture(num_layers=16, hidden_size=2048, num_attention_heads=16, num_query_groups=8,
                              ffn_hidden_size=5632, vocab_size=32000, make_vocab_size_divisible_by=32,
                              max_position_embeddings=4096, params_dtype="bfloat16"),
    # Llama-3-8B's shape (8.03 B parameters, 16.1 GB in bf16): 32 layers, hidden 4096, 32 heads / 8 KV groups of
    # head dim 128, SwiGLU ffn 14,336, RMSNorm (eps 1e-5), RoPE base 500,000, untied embeddings, vocabulary 128,256
    # (a multiple of 128: no padding). GPTArchitecture's defaults are Llama's (swiglu, RMSNorm, rope, untied).
    "llama3-8b": GPTArchitecture(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                                 ffn_hidden_size=14336, vocab_size=128256, make_vocab_size_divisible_by=128,
                                 max_position_embeddings=8192, norm_epsilon=1e-5, rotary_base=500000,
                                 untie_embeddings_and_output_weights=True, params_dtype="bfloat16"),
    # Llama-2-7B-like (6.7 B parameters, 13.5 GB in bf16): an 8-GPU node.
    "llama-7b": GPTArchitecture(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=32,
                                ffn_hidden_size=11008, vocab_size=32000, make_vocab_size_divisible_by=32,
                                max_position_embeddings=4096, params_dtype="bfloat16"),
    # Qwen3-30B-A3B's shape (30.5 B parameters at its 48 layers, 61 GB in bf16; benchmarks cut the depth, e.g. 8
    # layers: 5.6 B): hidden 2048, 32 heads / 4 KV groups of head dim 128 with q/k RMSNorm, RoPE base 1e6, every
    # layer an MoE of 128 experts (ffn 768, SwiGLU), top-8, no shared expert, untied embeddings, vocabulary 151,936.
    # Its norm_topk_prob (the top-k probabilities renormalised) is megatron's default softmax over the top-k logits.
    # ffn_hidden_size is its dense intermediate size (no dense layer uses it).
    "qwen3-30b-a3b": GPTArchitecture(num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                                     kv_channels=128, qk_layernorm=True, ffn_hidden_size=6144, vocab_size=151936,
                                     make_vocab_size_divisible_by=128, max_position_embeddings=40960,
                                     norm_epsilon=1e-6, rotary_base=1000000, params_dtype="bfloat16",
                                     num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768),
    # Qwen2.5-7B's layer shape cut to 8 layers (2.95 B parameters, 5.9 GB in bf16): hidden 3584, 28 heads / 4 KV
    # groups, SwiGLU ffn 18,944, QKV biases, RoPE base 1e6, untied embeddings, vocabulary 152,064 (issue 44's
    # training-pass benchmark).
    "qwen2.5-7b-8l": GPTArchitecture(num_layers=8, hidden_size=3584, num_attention_heads=28, num_query_groups=4,
                                     ffn_hidden_size=18944, vocab_size=152064, make_vocab_size_divisible_by=128,
                                     max_position_embeddings=32768, norm_epsilon=1e-6, rotary_base=1000000,
                                     add_qkv_bias=True, params_dtype="bfloat16"),
    # Qwen2.5-7B's shape (7.6 B parameters, 15.2 GB in bf16): the 8-layer cut's layers, 28 of them (issue 45's
    # rollout memory on one 80 GB card).
    "qwen2.5-7b": GPTArchitecture(num_layers=28, hidden_size=3584, num_attention_heads=28, num_query_groups=4,
                                  ffn_hidden_size=18944, vocab_size=152064, make_vocab_size_divisible_by=128,
                                  max_position_embeddings=32768, norm_epsilon=1e-6, rotary_base=1000000,
                                  add_qkv_bias=True, params_dtype="bfloat16"),
    # Qwen2.5-1.5B's shape (1.54 B parameters): 28 layers, hidden 1536, 12 heads / 2 KV groups, ffn 8,960, QKV
    # biases, tied embeddings, vocabulary 151,936.
    "qwen2.5-1.5b": GPTArchitecture(num_layers=28, hidden_size=1536, num_attention_heads=12, num_query_groups=2,
                                    ffn_hidden_size=8960, vocab_size=151936, make_vocab_size_divisible_by=128,
                                    max_position_embeddings=32768, norm_epsilon=1e-6, rotary_base=1000000,
                                    add_qkv_bias=True, untie_embeddings_and_output_weights=False,
                                    params_dtype="bfloat16"),
}
