"""Hugging Face ⇄ Megatron checkpoint conversion (megatron_hybrid.convert, tools/convert_checkpoint.py,
tools/verify_checkpoint.py).

Tiny random models saved by transformers (no downloads): round trips must be bit-exact, the converted model must
compute transformers' logits in megatron-core (TP=1, and TP=2 × PP=2 on gloo), bad inputs must fail early with
the culprit named and leave nothing behind, and conversion memory must not grow with the tensor size.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_hybrid.convert import CheckpointError, hf_to_megatron, megatron_to_hf, read_architecture
from megatron_hybrid.convert.layout import FORMAT, FORMAT_VERSION, canonical_name, stored_name
from tests.harness import run_distributed

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 1000  # pads to 1024 at TP 2 (multiple of 128 × 2): the padding rows are exercised

# Random init with std 0.2 (not transformers' 0.02) so that attention is far from uniform: a wrong rotary
# embedding, head order or scaling then moves the logits by ~1e-1 (checked: Llama 3 rope scaling left out gives
# 0.16), not by noise.
BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, num_hidden_layers=4,
            vocab_size=VOCAB, initializer_range=0.2, max_position_embeddings=131072)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
FAMILY_KWARGS = {
    "llama": dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    "mistral": dict(sliding_window=None),
    "qwen2": dict(),  # q/k/v biases
    "qwen3": dict(head_dim=32),  # q/k norms; head_dim 32 ≠ 64 / 4
}
CASES = [(family, tied) for family in FAMILY_KWARGS for tied in (False, True)]


def _case_id(case) -> str:
    return f"{case[0]}-{'tied' if case[1] else 'untied'}"


def make_hf(directory: Path, family: str, tied: bool, *, seed: int = 0, **overrides) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**BASE, **FAMILY_KWARGS[family], "tie_word_embeddings": tied, **overrides}
    config = AutoConfig.for_model(family, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if family == "qwen2":  # transformers initialises biases to zero; make them count
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.2)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf")
    return {case: make_hf(root / _case_id(case), *case) for case in CASES}


def _load_all(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


# ---------------------------------------------------------------- 1. bit-exact round trips


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_round_trip_tp2_pp2_is_bit_exact(hf_models, tmp_path, case):
    src = hf_models[case]
    hf_to_megatron(src, tmp_path / "mg", tensor_model_parallel_size=2, pipeline_model_parallel_size=2, progress=False)
    megatron_to_hf(tmp_path / "mg", tmp_path / "back", progress=False)
    a, b = _load_all(src), _load_all(tmp_path / "back")
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert (tmp_path / "back" / "generation_config.json").is_file()
    # The rank files are plain safetensors; a tied model's last stage holds the embedding as output_layer.
    ranks = sorted(p.parent.name for p in (tmp_path / "mg" / "release").glob("*/model.safetensors"))
    assert ranks == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    first, last = load_file(tmp_path / "mg/release/mp_rank_01_000/model.safetensors"), \
        load_file(tmp_path / "mg/release/mp_rank_01_001/model.safetensors")
    assert first["embedding.word_embeddings.weight"].shape == (512, 64)  # 1024 padded rows over 2 ranks
    assert torch.equal(first["embedding.word_embeddings.weight"][VOCAB - 512:], torch.zeros(1024 - VOCAB, 64))
    assert "decoder.layers.1.input_layernorm.weight" in last and "decoder.layers.2.input_layernorm.weight" not in last
    assert ("output_layer.weight" in last) and ("output_layer.weight" not in first)
    if case[1]:
        assert torch.equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])


def test_sharded_index_and_reshard_on_export(hf_models, tmp_path):
    """Sharded input (index json) and sharded output; TP 4 × PP 1 with 2 KV heads (fewer groups than ranks)."""
    from transformers import AutoModelForCausalLM

    src = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(hf_models[("qwen2", False)])
    model.save_pretrained(src, max_shard_size="200KB")
    assert (src / "model.safetensors.index.json").is_file()
    hf_to_megatron(src, tmp_path / "mg", tensor_model_parallel_size=4, progress=False)
    megatron_to_hf(tmp_path / "mg", tmp_path / "back", max_shard_bytes=300_000, progress=False)
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    a, b = _load_all(src), _load_all(tmp_path / "back")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back")  # transformers reads what we wrote
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)


def test_transformer_engine_names(hf_models, tmp_path):
    src = hf_models[("qwen3", False)]
    hf_to_megatron(src, tmp_path / "te", tensor_model_parallel_size=2, transformer_impl="transformer_engine",
                   progress=False)
    keys = set(load_file(tmp_path / "te/release/mp_rank_00/model.safetensors"))
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in keys
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in keys
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in keys)
    megatron_to_hf(tmp_path / "te", tmp_path / "back", progress=False)
    a, b = _load_all(src), _load_all(tmp_path / "back")
    assert all(torch.equal(a[k], b[k]) for k in a)
    for name in ("decoder.layers.3.input_layernorm.weight", "decoder.layers.3.pre_mlp_layernorm.weight",
                 "decoder.layers.3.input_layernorm.bias", "decoder.final_layernorm.weight"):
        assert canonical_name(stored_name(name, "transformer_engine")) == name
    assert stored_name("decoder.layers.3.pre_mlp_layernorm.bias", "transformer_engine") == \
        "decoder.layers.3.mlp.linear_fc1.layer_norm_bias"


def test_virtual_shard_matches_sharding_shard(tmp_path):
    from megatron_hybrid.convert.safetensors_io import TensorReader
    from megatron_hybrid.convert.virtual import Virtual, materialize, shard, unshard
    from megatron_hybrid.megatron.sharding import TPSpec, shard as real_shard

    full = torch.randn(12, 10)
    save_file({"w": full}, tmp_path / "w.safetensors")
    v = Virtual.stored(str(tmp_path / "w.safetensors"), "w", full.shape, full.dtype)
    with TensorReader() as reader:
        for spec in (TPSpec(True, 0, 1), TPSpec(True, 0, 2), TPSpec(True, 1, 1), TPSpec(False)):
            parts = [shard(v, spec, r, 2) for r in range(2)]
            for r in range(2):
                assert torch.equal(materialize(parts[r], reader), real_shard(full, spec, r, 2)), (spec, r)
            assert torch.equal(materialize(unshard(parts, spec), reader), full)
        padded = materialize(v.narrow(0, 2, 7).pad(0, 3), reader)
        assert torch.equal(padded, torch.cat([full[2:9], torch.zeros(3, 10)]))


# ---------------------------------------------------------------- 2. logits in megatron-core

# fp32 with different operation orders (fused QKV, sharded matmuls, another RMSNorm): ~1e-7 relative per op, ~1e-6
# after 4 layers; observed ≤ 4e-7 on logits up to |z| ≈ 7. 1e-5 leaves an order of magnitude and is still four
# orders below what a layout error costs (≈ 1e-1).
LOGITS_TOL = dict(rtol=1e-5, atol=1e-5)


def _tokens() -> torch.Tensor:
    from megatron_hybrid.convert.verify import random_tokens

    return random_tokens(VOCAB, batch_size=2, seq_length=32, seed=1)


def _megatron_logits(mg_dir: Path, tp: int, pp: int) -> torch.Tensor:
    from megatron_hybrid.convert.verify import megatron_logits_on_rank

    out = run_distributed(megatron_logits_on_rank, tp * pp, str(mg_dir), _tokens(), tensor_model_parallel_size=tp,
                          pipeline_model_parallel_size=pp)
    results = [r for r in out if r is not None]
    assert len(results) == tp  # the last stage's TP ranks
    return results[0]


@pytest.mark.parametrize("case", [("llama", True), ("mistral", False), ("qwen2", True), ("qwen3", False)],
                         ids=_case_id)
def test_logits_tp1(hf_models, tmp_path, case):
    from megatron_hybrid.convert.verify import hf_logits

    hf_to_megatron(hf_models[case], tmp_path / "mg", progress=False)
    torch.testing.assert_close(_megatron_logits(tmp_path / "mg", 1, 1), hf_logits(hf_models[case], _tokens()),
                               **LOGITS_TOL)


@pytest.mark.parametrize("stored,case,impl", [
    ((2, 2), ("qwen3", True), "local"),
    ((1, 1), ("qwen2", False), "transformer_engine"),  # resharded on load, TE names read into a local-spec model
    ((2, 4), ("llama", False), "local"),  # stored at TP 2 × PP 4, loaded at TP 2 × PP 2
], ids=["qwen3-stored-tp2pp2", "qwen2-stored-tp1pp1-te", "llama-stored-tp2pp4"])
def test_logits_tp2_pp2(hf_models, tmp_path, stored, case, impl):
    from megatron_hybrid.convert.verify import hf_logits

    hf_to_megatron(hf_models[case], tmp_path / "mg", tensor_model_parallel_size=stored[0],
                   pipeline_model_parallel_size=stored[1], transformer_impl=impl, progress=False)
    torch.testing.assert_close(_megatron_logits(tmp_path / "mg", 2, 2), hf_logits(hf_models[case], _tokens()),
                               **LOGITS_TOL)


def test_logits_tp2_pp2_one_kv_head(tmp_path):
    """Multi-query attention: 1 KV group split over 2 TP ranks (megatron-core regroups the QKV itself)."""
    from megatron_hybrid.convert.verify import hf_logits

    src = make_hf(tmp_path / "mqa", "llama", False, num_key_value_heads=1, seed=3)
    hf_to_megatron(src, tmp_path / "mg", tensor_model_parallel_size=2, pipeline_model_parallel_size=2, progress=False)
    torch.testing.assert_close(_megatron_logits(tmp_path / "mg", 2, 2), hf_logits(src, _tokens()), **LOGITS_TOL)


def _tool(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, str(ROOT / "tools" / name), *args], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.mark.slow
def test_tools_convert_then_verify(hf_models, tmp_path):
    src = hf_models[("qwen3", True)]
    mg = tmp_path / "mg"
    done = _tool("convert_checkpoint.py", "hf-to-megatron", "--hf-dir", str(src), "--megatron-dir", str(mg),
                 "--tensor-model-parallel-size", "2", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert read_architecture(mg).kv_channels == 32
    # megatron-core at TP 2 in two processes the tool spawns itself.
    done = _tool("verify_checkpoint.py", "--hf-dir", str(src), "--megatron-dir", str(mg),
                 "--tensor-model-parallel-size", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout and "top-1 agreement 100.00%" in done.stdout, done.stdout
    # The same comparison against a tolerance it cannot meet fails.
    done = _tool("verify_checkpoint.py", "--hf-dir", str(hf_models[("qwen3", False)]), "--megatron-dir", str(mg))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL" in done.stdout


@pytest.mark.slow
def test_help_has_examples():
    done = _tool("convert_checkpoint.py", "--help")
    assert done.returncode == 0 and "examples:" in done.stdout and "hf-to-megatron" in done.stdout
    done = _tool("verify_checkpoint.py", "--help")
    assert done.returncode == 0 and "examples:" in done.stdout and "--tensor-model-parallel-size 2" in done.stdout
    done = _tool("make_tiny_hf_model.py", "--help")
    assert done.returncode == 0 and "examples:" in done.stdout and "--family llama" in done.stdout


@pytest.mark.slow
def test_make_tiny_hf_model(tmp_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    done = _tool("make_tiny_hf_model.py", "--hf-dir", str(tmp_path / "m"), "--family", "llama", "--seed", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    assert model.config.vocab_size == len(tok) == 128
    text = "What is 12 plus 7?\nThe answer: 19"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: any ASCII text round-trips
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    again = _tool("make_tiny_hf_model.py", "--hf-dir", str(tmp_path / "m"))
    assert again.returncode == 2 and "exists and is not empty" in again.stderr


@pytest.mark.slow
def test_make_random_model_like(tmp_path: Path):
    from transformers import AutoTokenizer

    assert _tool("make_tiny_hf_model.py", "--hf-dir", str(tmp_path / "m"), "--family", "llama").returncode == 0
    # Another seed: with the same one, from_config would draw the tiny model's own weights again.
    done = _tool("make_tiny_hf_model.py", "--hf-dir", str(tmp_path / "r"), "--like", str(tmp_path / "m"), "--seed", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"a random-weight model like {tmp_path / 'm'}" in done.stdout
    # The control of a pretrained run: the same config and tokenizer, every weight drawn afresh.
    assert json.loads((tmp_path / "r" / "config.json").read_text()) == \
        json.loads((tmp_path / "m" / "config.json").read_text())
    text = "What is 12 plus 7?"
    assert AutoTokenizer.from_pretrained(tmp_path / "r")(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(tmp_path / "m")(text)["input_ids"]
    source, control = (load_file(tmp_path / d / "model.safetensors") for d in ("m", "r"))
    assert source.keys() == control.keys()
    assert all(not torch.equal(source[k], control[k]) for k in source)
    done = _tool("make_tiny_hf_model.py", "--hf-dir", str(tmp_path / "x"), "--like", str(tmp_path / "m"),
                 "--family", "qwen2")
    assert done.returncode == 2 and "--family (qwen2) and --like" in done.stderr


def test_make_tiny_hf_model_leaves_nothing_on_failure(tmp_path: Path, monkeypatch):
    import runpy

    tool = runpy.run_path(str(ROOT / "tools" / "make_tiny_hf_model.py"))

    def full_disk(directory, family, *, seed):
        (Path(directory) / "config.json").write_text("{")  # a partial write, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setitem(tool["main"].__globals__, "save_tiny_hf_model", full_disk)
    with pytest.raises(OSError, match="No space left"):
        tool["main"](["--hf-dir", str(tmp_path / "out" / "m")])
    assert list((tmp_path / "out").iterdir()) == []  # no target, no partial directory


# ---------------------------------------------------------------- 3. configs of real checkpoints


def _arch_of(tmp_path: Path, config: dict):
    from megatron_hybrid.convert.families import architecture_from_hf
    from megatron_hybrid.convert.hf_checkpoint import read_config

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return architecture_from_hf(read_config(tmp_path)[1])


def test_real_configs(tmp_path):
    # Field for field as on the Hub (transformers 4.x style: rope_theta/rope_scaling/torch_dtype at the top).
    _, llama = _arch_of(tmp_path / "llama", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
        "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "head_dim": 64,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "vocab_size": 128256,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False})
    assert (llama.use_rope_scaling, llama.rope_scaling_factor, llama.rotary_base) == (True, 32.0, 500000)
    assert (llama.num_query_groups, llama.kv_channels, llama.params_dtype) == (8, None, "bfloat16")
    assert not llama.untie_embeddings_and_output_weights and llama.norm_epsilon == 1e-5
    _, qwen3 = _arch_of(tmp_path / "qwen3", {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000, "rope_scaling": None,
        "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "vocab_size": 151936, "attention_bias": False, "hidden_act": "silu"})
    assert (qwen3.kv_channels, qwen3.qk_layernorm, qwen3.rotary_base) == (128, True, 1000000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # use_sliding_window false: nothing to warn about
        _, qwen2 = _arch_of(tmp_path / "qwen2", {
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
            "intermediate_size": 4864, "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
            "max_position_embeddings": 32768, "max_window_layers": 21, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
            "sliding_window": 32768, "use_sliding_window": False, "tie_word_embeddings": True,
            "torch_dtype": "bfloat16", "vocab_size": 151936, "hidden_act": "silu"})
    assert qwen2.add_qkv_bias and qwen2.kv_channels is None and qwen2.num_query_groups == 2
    with pytest.warns(UserWarning, match="sliding_window=4096 is ignored"):
        _, mistral = _arch_of(tmp_path / "mistral", {
            "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
            "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
            "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
            "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000,
            "head_dim": None, "hidden_act": "silu"})
    assert mistral.kv_channels is None and mistral.untie_embeddings_and_output_weights
    with pytest.raises(CheckpointError, match="rope scaling 'yarn' is not supported"):
        _arch_of(tmp_path / "yarn", {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
                                     "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 32768}})


def test_megatron_lm_args_stored(hf_models, tmp_path):
    hf_to_megatron(hf_models[("qwen3", False)], tmp_path / "mg", tensor_model_parallel_size=2, progress=False)
    meta = json.loads((tmp_path / "mg" / "megatron_hybrid_checkpoint.json").read_text())
    args = " ".join(meta["megatron_lm_args"])
    for flag in ("--group-query-attention --num-query-groups 2", "--kv-channels 32", "--qk-layernorm",
                 "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--swiglu",
                 "--tensor-model-parallel-size 2", "--normalization RMSNorm", "--position-embedding-type rope"):
        assert flag in args, flag
    assert (tmp_path / "mg" / "latest_checkpointed_iteration.txt").read_text().strip() == "release"


def test_export_without_stored_hf_config(hf_models, tmp_path):
    """A checkpoint that carries no Hugging Face config (e.g. saved by training) exports with one made from its
    architecture, which transformers reads back to the same model."""
    from transformers import AutoModelForCausalLM

    src = hf_models[("llama", True)]
    hf_to_megatron(src, tmp_path / "mg", progress=False)
    meta_path = tmp_path / "mg" / "megatron_hybrid_checkpoint.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "hf_config": None, "hf_model_type": None}))
    megatron_to_hf(tmp_path / "mg", tmp_path / "back", progress=False)
    hf_to_megatron(tmp_path / "back", tmp_path / "mg2", progress=False)
    assert read_architecture(tmp_path / "mg2") == read_architecture(tmp_path / "mg")
    a, b = AutoModelForCausalLM.from_pretrained(src), AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(a(tokens).logits, b(tokens).logits)


def test_parallel_size_checks():
    from megatron_hybrid.convert.layout import check_parallel_sizes
    from megatron_hybrid.megatron.models import GPTArchitecture

    arch = GPTArchitecture(num_layers=6, hidden_size=96, num_attention_heads=12, num_query_groups=4, vocab_size=100,
                           ffn_hidden_size=90)
    check_parallel_sizes(arch, tensor_model_parallel_size=2, pipeline_model_parallel_size=3)
    for tp, pp, match in [(3, 1, r"\(3\) must be a multiple or a divisor of num_query_groups \(4\)"),
                          (4, 1, r"tensor_model_parallel_size \(4\) must divide ffn_hidden_size \(90\)"),
                          (1, 4, r"pipeline_model_parallel_size \(4\) must divide num_layers \(6\)"),
                          (0, 1, "must be ≥ 1")]:
        with pytest.raises(CheckpointError, match=match):
            check_parallel_sizes(arch, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def _load_into_tiny_llama(mg_dir: str) -> str:
    from megatron_hybrid.convert import load_megatron_checkpoint
    from megatron_hybrid.megatron.models import tiny_llama

    model = tiny_llama().build()
    try:
        load_megatron_checkpoint([model], mg_dir, tp_rank=0, tp_size=1)
    except CheckpointError as e:
        return str(e)
    return "loaded"


def test_load_into_a_different_model_fails_clearly(hf_models, tmp_path):
    hf_to_megatron(hf_models[("qwen3", False)], tmp_path / "mg", progress=False)
    message = run_distributed(_load_into_tiny_llama, 1, str(tmp_path / "mg"))[0]
    assert "does not fit the model" in message
    assert "decoder.layers.0.self_attention.linear_qkv.weight: model [128, 64], checkpoint [256, 64]" in message


# ---------------------------------------------------------------- 4. bad inputs


def _tool_main(name: str, *args: str) -> int:
    """tools/NAME.py's main(args), in this process (so that tests can monkeypatch the library under it)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        module = __import__(name)
    finally:
        sys.path.pop(0)
    return module.main(list(args))


def _convert_cli(*args: str) -> None:
    _tool_main("convert_checkpoint", "hf-to-megatron", "--no-progress", *args)


def _expect_failure(tmp_path: Path, src: Path, match: str, *extra: str, output: Path | None = None) -> None:
    before = _listing(tmp_path)
    with pytest.raises(SystemExit, match=match):
        _convert_cli("--hf-dir", str(src), "--megatron-dir", str(output or tmp_path / "out" / "mg"), *extra)
    assert _listing(tmp_path) == before  # no output, no partial directory, not even the parent "out"


@pytest.fixture
def sharded_copy(hf_models, tmp_path) -> Path:
    from transformers import AutoModelForCausalLM

    src = tmp_path / "src"
    AutoModelForCausalLM.from_pretrained(hf_models[("llama", False)]).save_pretrained(src, max_shard_size="200KB")
    return src


def test_unsupported_model_type(sharded_copy, tmp_path):
    config = json.loads((sharded_copy / "config.json").read_text())
    (sharded_copy / "config.json").write_text(json.dumps({**config, "model_type": "phi3"}))
    _expect_failure(tmp_path, sharded_copy, r"unsupported model_type 'phi3'; supported: \['llama', 'mistral'")


def test_missing_shard(sharded_copy, tmp_path):
    shard = sorted(sharded_copy.glob("model-*.safetensors"))[1]
    shard.unlink()
    _expect_failure(tmp_path, sharded_copy, f"shard files listed in model.safetensors.index.json are missing: "
                                            f"\\['{shard.name}'\\]")


def test_truncated_shard(sharded_copy, tmp_path):
    shard = sorted(sharded_copy.glob("model-*.safetensors"))[-1]
    os.truncate(shard, shard.stat().st_size - 100)
    _expect_failure(tmp_path, sharded_copy, f"{shard.name} is truncated: its header describes")
    os.truncate(shard, 5)
    _expect_failure(tmp_path, sharded_copy, f"{shard.name} is truncated or not a safetensors file")


def test_missing_and_unexpected_tensors(hf_models, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    tensors = load_file(hf_models[("llama", False)] / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"], tensors["model.layers.3.self_attn.k_proj.weight"]
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, src / "model.safetensors")
    (src / "config.json").write_text((hf_models[("llama", False)] / "config.json").read_text())
    _expect_failure(tmp_path, src, r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight, "
                                   r"model\.layers\.3\.self_attn\.k_proj\.weight; unexpected tensors .*"
                                   r"model\.layers\.0\.mlp\.extra\.weight")


@pytest.mark.parametrize("sizes,match", [
    (("3", "1"), r"tensor_model_parallel_size \(3\) must divide num_attention_heads \(4\)"),
    (("1", "3"), r"pipeline_model_parallel_size \(3\) must divide num_layers \(4\)"),
    (("8", "1"), r"tensor_model_parallel_size \(8\) must divide num_attention_heads \(4\)"),
])
def test_indivisible_parallel_sizes(hf_models, tmp_path, sizes, match):
    _expect_failure(tmp_path, hf_models[("llama", False)], match, "--tensor-model-parallel-size", sizes[0],
                    "--pipeline-model-parallel-size", sizes[1])


def test_existing_output_needs_force_and_failures_leave_it_intact(hf_models, tmp_path, monkeypatch):
    from megatron_hybrid.convert import conversions

    src = hf_models[("mistral", False)]
    out = tmp_path / "mg"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="exists; pass --force to overwrite it"):
        hf_to_megatron(src, out, progress=False)
    with pytest.raises(CheckpointError, match="would overwrite the input"):
        hf_to_megatron(src, src.parent, force=True, progress=False)

    calls = []

    def failing_write(*args, **kwargs):  # the second rank file fails half way
        calls.append(args[0])
        if len(calls) == 2:
            raise OSError("disk full")
        return real_write(*args, **kwargs)

    real_write = conversions.write_safetensors
    monkeypatch.setattr(conversions, "write_safetensors", failing_write)
    with pytest.raises(OSError, match="disk full"):
        hf_to_megatron(src, out, tensor_model_parallel_size=2, force=True, progress=False)
    assert _listing(tmp_path) == ["mg", "mg/mine.txt"]  # the old output untouched, no partial directory
    monkeypatch.undo()
    hf_to_megatron(src, out, force=True, progress=False)
    assert not (out / "mine.txt").exists() and read_architecture(out).num_layers == 4
    assert [p.name for p in tmp_path.iterdir()] == ["mg"]


def test_broken_megatron_checkpoint(hf_models, tmp_path):
    hf_to_megatron(hf_models[("llama", True)], tmp_path / "mg", tensor_model_parallel_size=2, progress=False)
    (tmp_path / "mg/release/mp_rank_01/model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"missing rank files: \[.*mp_rank_01/model.safetensors'\]"):
        megatron_to_hf(tmp_path / "mg", tmp_path / "back", progress=False)
    assert not (tmp_path / "back").exists()
    with pytest.raises(CheckpointError, match="not a megatron-hybrid checkpoint"):
        read_architecture(tmp_path)


def _rewrite_header(path: Path, header: bytes) -> None:
    """Replace a safetensors file's JSON header (padded to the old length, so the data stays where it was)."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    assert len(header) <= n
    path.write_bytes(data[:8] + header.ljust(n) + data[8 + n:])


@pytest.mark.parametrize("fault", ["config-not-json", "config-a-list", "header-a-list", "index-no-weight-map",
                                   "index-weight-map-a-list"])
def test_malformed_json_inputs(sharded_copy, tmp_path, fault):
    """Each was a traceback (JSONDecodeError, AttributeError, KeyError); now a message naming the file."""
    first = sorted(sharded_copy.glob("model-*.safetensors"))[0]
    index = sharded_copy / "model.safetensors.index.json"
    if fault == "config-not-json":
        (sharded_copy / "config.json").write_text('{"model_type": "llama",')
        match = r"config\.json is not valid JSON \(Expecting property name enclosed in double quotes"
    elif fault == "config-a-list":
        (sharded_copy / "config.json").write_text("[1, 2]")
        match = r"config\.json must hold a JSON object, not an array$"
    elif fault == "header-a-list":
        _rewrite_header(first, b"[1, 2]")
        match = f"{first.name} is not a safetensors file: its header must hold a JSON object, not an array$"
    else:
        weight_map = json.loads(index.read_text())["weight_map"]
        index.write_text(json.dumps({"metadata": {}} if fault == "index-no-weight-map" else
                                    {"weight_map": list(weight_map)}))
        match = r"model\.safetensors\.index\.json has no \"weight_map\" object \(tensor name → shard file name\)$"
    _expect_failure(tmp_path, sharded_copy, "^convert_checkpoint.py: error: .*" + match)


def _meta_with(change: str) -> bytes:
    """A converted checkpoint's metadata, broken as ``change`` says."""
    data = {"format": FORMAT, "format_version": FORMAT_VERSION, "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "architecture": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100}}
    if change == "no-architecture":
        del data["architecture"]
    elif change == "architecture-a-number":
        data["architecture"] = 7
    elif change == "architecture-unknown-field":
        data["architecture"]["colour"] = "blue"
    return json.dumps(data).encode()


@pytest.mark.parametrize("meta, message", [
    (b'{"format": ', " is not valid JSON (Expecting value: line 1 column 12 (char 11))"),
    (b"\x89PNG", " is not valid JSON ('utf-8' codec can't decode byte 0x89 in position 0: invalid start byte)"),
    (b"[]", " must hold a JSON object, not an array"),
    (_meta_with("no-architecture"), ": missing fields ['architecture']"),
    (_meta_with("architecture-a-number"), ": architecture must be a JSON object, not 7"),
    (_meta_with("architecture-unknown-field"), ": architecture: unknown GPTArchitecture fields: ['colour']"),
], ids=["truncated", "binary", "a-list", "no-architecture", "architecture-a-number", "architecture-unknown-field"])
def test_corrupt_megatron_meta(tmp_path, meta, message):
    path = tmp_path / "mg" / "megatron_hybrid_checkpoint.json"
    path.parent.mkdir()
    path.write_bytes(meta)
    with pytest.raises(SystemExit) as e:
        _tool_main("convert_checkpoint", "megatron-to-hf", "--megatron-dir", str(path.parent), "--hf-dir",
                   str(tmp_path / "hf"), "--no-progress")
    assert str(e.value) == f"convert_checkpoint.py: error: {path}{message}"
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("argv, message", [
    (["hf-to-megatron", "--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by (0) must be ≥ 1"),
    (["hf-to-megatron", "--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size (0) must be ≥ 1"),
    (["megatron-to-hf", "--max-shard-size-gb", "-1"], "--max-shard-size-gb (-1.0) must be a finite number > 0"),
    (["megatron-to-hf", "--max-shard-size-gb", "nan"], "--max-shard-size-gb (nan) must be a finite number > 0"),
])
def test_bad_numbers_are_usage_errors(tmp_path, capsys, argv, message):
    """Exit 2 with argparse's usage line, before anything is read (the directories need not exist)."""
    with pytest.raises(SystemExit) as e:
        _tool_main("convert_checkpoint", *argv, "--hf-dir", str(tmp_path / "a"), "--megatron-dir", str(tmp_path / "b"))
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"convert_checkpoint.py: error: {message}"
    assert list(tmp_path.iterdir()) == []


def test_library_checks_its_numbers(hf_models, tmp_path):
    with pytest.raises(CheckpointError, match=r"make_vocab_size_divisible_by \(0\) must be ≥ 1"):
        hf_to_megatron(hf_models[("llama", True)], tmp_path / "x", make_vocab_size_divisible_by=0, progress=False)
    with pytest.raises(CheckpointError, match=r"max_shard_bytes \(-1\) must be ≥ 1"):
        megatron_to_hf(tmp_path / "x", tmp_path / "y", max_shard_bytes=-1, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_unwritable_output(hf_models, tmp_path, monkeypatch):
    """A parent that is a file, and a parent without write permission (simulated: root may write anywhere)."""
    src = hf_models[("llama", True)]
    (tmp_path / "a-file").write_text("")
    _expect_failure(tmp_path, src, f"^convert_checkpoint.py: error: cannot write {tmp_path}/a-file/sub/mg: Not a "
                                   f"directory; nothing was written$", output=tmp_path / "a-file" / "sub" / "mg")

    def refused(*args, dir=None, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", os.path.join(dir, ".mg.partial-x1y2"))

    monkeypatch.setattr(tempfile, "mkdtemp", refused)
    _expect_failure(tmp_path, src, f"^convert_checkpoint.py: error: cannot write {tmp_path}/out/mg: Permission "
                                   f"denied; nothing was written$")


def test_full_disk(hf_models, tmp_path, monkeypatch):
    """Writing the second rank file fails as on a full disk (write() raises an OSError that names no file): the
    message names the output and the cause, and nothing is left behind."""
    from megatron_hybrid.convert import conversions

    real_write = conversions.write_safetensors
    calls = []

    def filling_write(path, *args, **kwargs):
        calls.append(path)
        real_write(path, *args, **kwargs)
        if len(calls) % 2 == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(conversions, "write_safetensors", filling_write)
    _expect_failure(tmp_path, hf_models[("qwen2", False)], f"^convert_checkpoint.py: error: cannot write "
                                                           f"{tmp_path}/out/mg: No space left on device; nothing "
                                                           f"was written$", "--tensor-model-parallel-size", "2")
    with pytest.raises(OSError) as e:  # the library: an OSError with the output's path
        hf_to_megatron(hf_models[("qwen2", False)], tmp_path / "mg", tensor_model_parallel_size=2, progress=False)
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(tmp_path / "mg"))
    assert not list(tmp_path.iterdir())


def test_verify_checks_its_inputs_first(hf_models, sharded_copy, tmp_path, capsys):
    """verify_checkpoint.py: the same faults fail before any model is built or rank spawned."""
    good = hf_models[("llama", False)]
    (sharded_copy / "config.json").write_text("[]")
    with pytest.raises(SystemExit) as e:
        _tool_main("verify_checkpoint", "--hf-dir", str(sharded_copy), "--megatron-dir", str(tmp_path))
    assert str(e.value) == f"verify_checkpoint.py: error: {sharded_copy}/config.json must hold a JSON object, not " \
                           f"an array"
    (tmp_path / "mg").mkdir()
    (tmp_path / "mg" / "megatron_hybrid_checkpoint.json").write_text("[]")
    with pytest.raises(SystemExit) as e:
        _tool_main("verify_checkpoint", "--hf-dir", str(good), "--megatron-dir", str(tmp_path / "mg"))
    assert str(e.value).endswith("megatron_hybrid_checkpoint.json must hold a JSON object, not an array")
    for argv, message in [(["--atol", "nan"], "--atol (nan) must be a finite number ≥ 0"),
                          (["--seq-length", "0"], "--seq-length (0) must be ≥ 1")]:
        with pytest.raises(SystemExit) as e:
            _tool_main("verify_checkpoint", "--hf-dir", "x", "--megatron-dir", "y", *argv)
        assert e.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == f"verify_checkpoint.py: error: {message}"


@pytest.mark.slow
def test_cli_failure_is_one_line(tmp_path):
    """As a user sees it: exit status 1, one line on stderr, no traceback."""
    bad = tmp_path / "hf"
    bad.mkdir()
    (bad / "config.json").write_text("[1, 2]")
    done = _tool("convert_checkpoint.py", "hf-to-megatron", "--hf-dir", str(bad), "--megatron-dir",
                 str(tmp_path / "mg"))
    assert done.returncode == 1
    assert done.stderr == f"convert_checkpoint.py: error: {bad}/config.json must hold a JSON object, not an array\n"


# ---------------------------------------------------------------- 5. corruption and killed conversions


def _files_of(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("fault", ["0xff", "zeros", "asset", "unlisted"])
def test_corrupt_megatron_checkpoint_is_refused_naming_the_file(hf_models, tmp_path, fault):
    """4 KiB of 0xFF inside a rank file exported 1,024 NaNs with exit 0, and zeros loaded silently: every file's
    sha256 is in the manifest, checked whenever the checkpoint is read (export, load, --pretrained-checkpoint)."""
    mg = tmp_path / "mg"
    hf_to_megatron(hf_models[("llama", True)], mg, tensor_model_parallel_size=2, progress=False)
    meta_path = mg / "megatron_hybrid_checkpoint.json"
    meta = json.loads(meta_path.read_text())
    listed = sorted(meta.get("digests", {}))
    shard = mg / "release/mp_rank_01/model.safetensors"
    culprit, problem = shard, "does not match the sha256 recorded in"
    if fault in ("0xff", "zeros"):
        with open(shard, "r+b") as f:
            header = int.from_bytes(f.read(8), "little")
            f.seek(8 + header + 4096)  # inside the embedding's values: the header stays valid
            f.write((b"\xff" if fault == "0xff" else b"\x00") * 4096)
    elif fault == "asset":
        culprit = mg / "hf_assets/generation_config.json"
        culprit.write_text(culprit.read_text().replace("2", "3"))
    else:
        meta.get("digests", {}).pop("release/mp_rank_01/model.safetensors", None)
        meta_path.write_text(json.dumps(meta))
        problem = "has no digest in"
    with pytest.raises(SystemExit) as e:
        _tool_main("convert_checkpoint", "megatron-to-hf", "--megatron-dir", str(mg), "--hf-dir",
                   str(tmp_path / "hf"), "--no-progress")
    assert str(e.value).startswith(f"convert_checkpoint.py: error: {culprit}: {problem} {meta_path}"), str(e.value)
    assert not (tmp_path / "hf").exists()
    # The recipe opens it while validating its arguments: on every rank, before any collective.
    from megatron_hybrid.rl.arguments import add_hybrid_args, add_megatron_args, validate_args

    args = add_hybrid_args(add_megatron_args(argparse.ArgumentParser())).parse_args(
        ["--pretrained-checkpoint", str(mg)])
    with pytest.raises(ValueError, match=re.escape(f"{culprit}: {problem}")):
        validate_args(args, 2)
    assert listed == sorted(set(_files_of(mg)) - {meta_path.name})  # every file but the manifest itself


def test_manifest_without_digests_is_read_with_a_warning(hf_models, tmp_path):
    """A checkpoint converted before digests existed (format version 1) still exports, with a warning."""
    src = hf_models[("qwen2", False)]
    hf_to_megatron(src, tmp_path / "mg", progress=False)
    meta_path = tmp_path / "mg" / "megatron_hybrid_checkpoint.json"
    meta = json.loads(meta_path.read_text())
    meta.pop("digests", None)
    meta_path.write_text(json.dumps({**meta, "format_version": 1}))
    with pytest.warns(UserWarning, match=f"{tmp_path / 'mg'} was written without file digests"):
        megatron_to_hf(tmp_path / "mg", tmp_path / "back", progress=False)
    a, b = _load_all(src), _load_all(tmp_path / "back")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# Each was read without complaint: a negative offset reads the header's own bytes as values, a shape [2.9, 4] is
# taken as [2, 4]; a negative shape failed later with "length should not be negative", naming no file.
@pytest.mark.parametrize("damage", ["overlap", "negative-offset", "fractional-shape", "boolean-shape",
                                    "negative-shape"])
def test_damaged_safetensors_header_names_the_file(tmp_path, damage):
    from megatron_hybrid.convert.safetensors_io import read_header

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(2, 4), "b": torch.ones(2, 4)}, path, metadata={"room": "x" * 40})
    n = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8:8 + n])
    assert header["a"]["data_offsets"] == [0, 32] and header["b"]["data_offsets"] == [32, 64]
    del header["__metadata__"]
    change = {"overlap": ("b", "data_offsets", [16, 48]), "negative-offset": ("a", "data_offsets", [-8, 24]),
              "fractional-shape": ("a", "shape", [2.9, 4]), "boolean-shape": ("a", "shape", [True, 8]),
              "negative-shape": ("a", "shape", [-2, -4])}[damage]
    header[change[0]][change[1]] = change[2]
    _rewrite_header(path, json.dumps(header).encode())
    message = r"b \(bytes \[16, 48\)\) overlaps a \(bytes \[0, 32\)\)" if damage == "overlap" else \
        r"bad header entry for 'a'"
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(path))}: {message}"):
        read_header(path)


def test_non_finite_hf_weights_are_refused_unless_allowed(hf_models, tmp_path):
    good = hf_models[("llama", True)]
    src = tmp_path / "src"
    src.mkdir()
    tensors = load_file(good / "model.safetensors")
    name = "model.layers.2.mlp.down_proj.weight"
    tensors[name][5, 3], tensors[name][7, 1] = float("nan"), float("-inf")
    tensors["model.layers.0.mlp.up_proj.weight"][0, :2] = 3e38  # finite, though their sum is not: read first
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(good / "config.json", src)
    _expect_failure(tmp_path, src, f"^convert_checkpoint.py: error: {re.escape(str(src))}/model.safetensors: "
                                   f"{re.escape(name)} holds non-finite values "
                                   r"\(2 of the 6144 values read, e.g. nan at \[5, 3\]\); pass --allow-non-finite "
                                   r"\(allow_non_finite=True\) to convert it as it is$")
    _convert_cli("--hf-dir", str(src), "--megatron-dir", str(tmp_path / "mg"), "--allow-non-finite")
    out = load_file(tmp_path / "mg/release/mp_rank_00/model.safetensors")["decoder.layers.2.mlp.linear_fc2.weight"]
    assert out[5, 3].isnan() and out[7, 1].isneginf()  # kept as they were
    assert torch.equal(out.nan_to_num(0.0, 1.0, -1.0), tensors[name].nan_to_num(0.0, 1.0, -1.0))


def _convert_until_killed(src: Path, out: Path) -> None:
    """A conversion (in a forked process) that SIGKILLs itself once it has written its first rank file."""
    from megatron_hybrid.convert import conversions

    write = conversions.write_safetensors

    def write_then_die(path, *args, **kwargs):
        write(path, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    conversions.write_safetensors = write_then_die
    hf_to_megatron(src, out, tensor_model_parallel_size=2, progress=False)


def test_killed_conversion_is_cleaned_up_by_the_next(hf_models, tmp_path):
    """A SIGKILLed conversion leaves its hidden partial directory; the next conversion to the same target removes
    it, but not those of conversions that may still be running (a live process here, or another host)."""
    import multiprocessing

    src, out = hf_models[("llama", True)], tmp_path / "mg"
    child = multiprocessing.get_context("fork").Process(target=_convert_until_killed, args=(src, out))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL
    (killed,) = tmp_path.iterdir()
    assert killed.name.startswith(".mg.partial-") and (killed / "release/mp_rank_00/model.safetensors").is_file()
    host = killed.name.removeprefix(".mg.partial-").rsplit("-", 2)[0]  # as the converter spells this host
    live = tmp_path / f".mg.partial-{host}-{os.getpid()}-live1234"  # a conversion that is still running
    remote = tmp_path / f".mg.partial-other-host-7-{child.pid}-remote12"
    other_target = tmp_path / f".mg2.partial-{host}-{child.pid}-other123"
    # The previous output, set aside by a --force run that died before its new output took its place.
    set_aside = tmp_path / f".mg.old-{host}-{child.pid}-old12345"
    for d in (live, remote, other_target, set_aside):
        d.mkdir()
    kept = [live.name, remote.name, other_target.name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_to_megatron(src, out, tensor_model_parallel_size=2, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["mg", set_aside.name, *kept])
    assert [str(w.message) for w in caught if "left" in str(w.message)] == [
        f"left {tmp_path / remote.name} alone: it may belong to a conversion still running on other-host-7 (process "
        f"{child.pid}); delete it if none is"]
    hf_to_megatron(src, tmp_path / "ref", tensor_model_parallel_size=2, progress=False)
    assert _files_of(out) == _files_of(tmp_path / "ref")
    with pytest.warns(UserWarning, match="left"):  # once the target exists again, the set-aside copy goes too
        hf_to_megatron(src, out, tensor_model_parallel_size=2, force=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["mg", "ref", *kept])


# ---------------------------------------------------------------- 6. memory

# The child reports its own VmHWM as it exits; the parent's ru_maxrss would carry the pre-exec (forked) image's peak.
_PEAK_SHIM = """
import atexit, runpy, sys
def report():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            sys.stderr.write("PEAK_RSS_KB " + line.split()[1] + "\\n")
atexit.register(report)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _peak_rss_of_conversion(src: Path, out: Path) -> int:
    """Peak resident memory (bytes) of convert_checkpoint.py run as its own process."""
    done = subprocess.run([sys.executable, "-c", _PEAK_SHIM, str(ROOT / "tools/convert_checkpoint.py"),
                           "hf-to-megatron", "--hf-dir", str(src), "--megatron-dir", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr
    return int(done.stderr.rsplit("PEAK_RSS_KB ", 1)[1].split()[0]) * 1024


def _write_llama(directory: Path, *, vocab: int, hidden: int) -> int:
    """A one-layer Llama checkpoint whose embedding dominates, written tensor by tensor; returns its bytes."""
    directory.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
              "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
              "vocab_size": vocab, "tie_word_embeddings": True, "torch_dtype": "float32", "rms_norm_eps": 1e-5}
    (directory / "config.json").write_text(json.dumps(config))
    d = hidden // 4
    layer = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
             "self_attn.q_proj.weight": (hidden, hidden), "self_attn.k_proj.weight": (2 * d, hidden),
             "self_attn.v_proj.weight": (2 * d, hidden), "self_attn.o_proj.weight": (hidden, hidden),
             "mlp.gate_proj.weight": (64, hidden), "mlp.up_proj.weight": (64, hidden),
             "mlp.down_proj.weight": (hidden, 64)}
    save_file({f"model.layers.0.{k}": torch.randn(s) for k, s in layer.items()} |
              {"model.norm.weight": torch.ones(hidden)}, directory / "model-00002-of-00002.safetensors")
    save_file({"model.embed_tokens.weight": torch.randn(vocab, hidden)}, directory / "model-00001-of-00002.safetensors")
    weight_map = {f"model.layers.0.{k}": "model-00002-of-00002.safetensors" for k in layer}
    weight_map |= {"model.norm.weight": "model-00002-of-00002.safetensors",
                   "model.embed_tokens.weight": "model-00001-of-00002.safetensors"}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return vocab * hidden * 4


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_largest_tensor(tmp_path):
    """Bench's bound (peak ≤ 1.5 × largest tensor + a fixed overhead), on a 200 MB embedding: the overhead is the
    peak of converting a tiny model, and streaming should keep the growth far below even 0.5 × the tensor."""
    _write_llama(tmp_path / "tiny", vocab=256, hidden=64)
    largest = _write_llama(tmp_path / "big", vocab=50_000, hidden=1024)  # 204.8 MB, fp32
    overhead = _peak_rss_of_conversion(tmp_path / "tiny", tmp_path / "tiny_mg")
    peak = _peak_rss_of_conversion(tmp_path / "big", tmp_path / "big_mg")
    assert peak <= 1.5 * largest + overhead
    assert peak - overhead < 0.5 * largest, (peak - overhead) / 2**20
