"""Tiny random-weight Hugging Face models with an offline tokenizer, for tests and demos (nothing from a hub).

:func:`save_tiny_tokenizer` builds a byte-level BPE over printable ASCII, space and newline with the ``tokenizers``
library (a few merges learnt from a fixed corpus), so any ASCII prompt or answer tokenises without unknowns and
decodes back to the same text. Its pre-tokenizer, normaliser and decoder are exactly Qwen2's: transformers 5
rebuilds those for a directory whose config.json says ``qwen2`` (whatever tokenizer_config.json says), and this way
the rebuilt tokenizer and the saved one agree, for every family. :func:`save_tiny_hf_model` saves a 2-layer model of
a supported family (Llama, Qwen2, Qwen3-MoE, Qwen2-MoE) beside it; ``tools/make_tiny_hf_model.py`` is the command
line. :func:`save_random_model_like` gives a real model's architecture and tokenizer fresh weights: the random-init
control of a run from its weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<unk>", "<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, the format of Qwen2's template: every message framed by <|im_start|>role\n ... <|im_end|>\n.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# transformers' Qwen2Tokenizer pre-tokenizer split (models/qwen2/tokenization_qwen2.py).
_QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
_CORPUS = [
    "What is 12 plus 7? The answer is 19.",
    "Tom has 3 apples and buys 5 more. How many apples does he have? 8",
    "the cat sat on the mat and the dog ran to the log",
    "Compute 45 minus 17, then give the final answer: 28",
] * 4


def save_tiny_tokenizer(directory: str, *, vocab_size: int = 128) -> int:
    """Save a tiny ``PreTrainedTokenizerFast`` (``vocab_size`` tokens, ChatML chat template, ``<|endoftext|>`` as
    end of sequence, ``<pad>`` as padding) to ``directory``, loadable with ``AutoTokenizer.from_pretrained``, and
    return its vocabulary size."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # GPT-2's byte-to-unicode map keeps bytes 33-126 as they are and moves space and newline to U+0120 and U+010A.
    alphabet = [chr(b) for b in range(33, 127)] + [chr(256 + ord(" ")), chr(256 + ord("\n"))]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet,
                                  limit_alphabet=len(alphabet), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<|endoftext|>", bos_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return len(fast)


#: 2 layers, hidden 64, GQA (4 heads, 2 KV heads), SwiGLU 128; the vocabulary is the tiny tokenizer's.
HF_BASE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-6)
#: A mixture of experts on top of HF_BASE: 4 experts of 32, top-2.
_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
#: family → (tied embeddings, further config): Llama tied; Qwen2 untied, with q/k/v biases; Qwen3-MoE with q/k norms,
#: an MoE layer then a dense one, renormalised top-2 weights; Qwen2-MoE with q/k/v biases and a gated shared expert
#: of 64 in both layers, top-2 weights as softmax probabilities.
FAMILIES = {
    "llama": (True, {}),
    "qwen2": (False, {}),
    "qwen3_moe": (False, dict(_EXPERTS, head_dim=16, mlp_only_layers=[1], norm_topk_prob=True)),
    "qwen2_moe": (False, dict(_EXPERTS, shared_expert_intermediate_size=64, norm_topk_prob=False)),
}


def save_tiny_hf_model(directory: str, family: str, *, seed: int = 0) -> str:
    """A random-weight ``family`` model and the tiny tokenizer, saved into ``directory`` as transformers does."""
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise ValueError(f"family ({family!r}) must be one of {sorted(FAMILIES)}")
    vocab_size = save_tiny_tokenizer(directory)
    tied, extra = FAMILIES[family]
    config = AutoConfig.for_model(family, vocab_size=vocab_size, tie_word_embeddings=tied, eos_token_id=2,
                                  bos_token_id=None, pad_token_id=1, **HF_BASE, **extra)
    return save_random_hf_model(directory, config, seed=seed)


def save_random_hf_model(directory, config, *, seed: int = 0):
    """A transformers model made from ``config`` with seeded random weights, saved into ``directory``."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):  # the caller's random stream is left as it was
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # transformers initialises biases and norms to constants; make them count
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(directory)
    return directory


def save_random_model_like(directory: str, like: str, *, seed: int = 0) -> str:
    """A model of ``like``'s config (a Hugging Face directory) with freshly initialised weights (transformers'
    ``from_config``, ``initializer_range``), and ``like``'s tokenizer, saved into ``directory``: the random-init
    control of a run that starts from ``like``'s pretrained weights (same architecture, vocabulary, prompts)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(like)
    with torch.random.fork_rng(devices=[]):  # the caller's random stream is left as it was
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(like).save_pretrained(directory)
    if (Path(like) / "generation_config.json").is_file():  # the end-of-sequence ids generation stops on
        shutil.copyfile(Path(like) / "generation_config.json", Path(directory) / "generation_config.json")
    return directory
