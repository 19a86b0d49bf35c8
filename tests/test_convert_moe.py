"""Mixture-of-experts checkpoint conversion (issue 24, MoE actors): Qwen3-MoE and Qwen2-MoE ⇄ megatron-core at any
TP/PP/EP/ETP (megatron_hybrid.convert, tools/convert_checkpoint.py, tools/make_tiny_hf_model.py).

Tiny random models saved by transformers (no downloads): round trips through expert-parallel and expert-tensor-
parallel layouts are bit-exact (also from transformers 5.x's fused expert layout), the converted model computes
transformers' logits in megatron-core (one rank, and two gloo ranks with the experts split over EP or ETP ranks),
and parallel sizes that do not divide the model fail before anything is written.
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_hybrid.convert import CheckpointError, hf_to_megatron, megatron_to_hf, read_architecture
from megatron_hybrid.convert.layout import check_parallel_sizes
from tests.harness import run_distributed

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 300  # pads to 384 at TP 1 and 512 at TP 2: the padding rows are exercised

# std 0.2 (not transformers' 0.02): router logits spread over ~±3, so a token's top-2 experts are well apart and a
# routing error (wrong expert order, renormalised vs not) moves the logits by ≫ the tolerance (checked below).
BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, num_hidden_layers=2,
            vocab_size=VOCAB, initializer_range=0.2, max_position_embeddings=256, num_experts_per_tok=2,
            moe_intermediate_size=32)
FAMILY_KWARGS = {
    # 8 experts; layer 0 MoE, layer 1 dense (mlp_only_layers); renormalised top-2 (megatron's default routing).
    "qwen3_moe": dict(num_experts=8, head_dim=32, mlp_only_layers=[1], norm_topk_prob=True),
    # 4 experts; layer 0 dense, layer 1 MoE (decoder_sparse_step 2 counts from 1); a gated shared expert; top-2
    # softmax probabilities as they are (--moe-router-pre-softmax).
    "qwen2_moe": dict(num_experts=4, decoder_sparse_step=2, shared_expert_intermediate_size=48, norm_topk_prob=False),
}
FAMILIES = sorted(FAMILY_KWARGS)


def make_hf(directory: Path, family: str, *, seed: int = 0, **overrides) -> Path:
    from transformers import AutoConfig

    from megatron_hybrid.convert.tiny import save_random_hf_model

    config = AutoConfig.for_model(family, **{**BASE, **FAMILY_KWARGS[family], **overrides})
    return save_random_hf_model(directory, config, seed=seed)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_moe")
    return {family: make_hf(root / family, family) for family in FAMILIES}


def _load_all(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def _sizes(tp: int, pp: int, ep: int, etp: int) -> dict[str, int]:
    return dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                expert_tensor_parallel_size=etp)


# ---------------------------------------------------------------- 1. bit-exact round trips

LAYOUTS = [(2, 2, 2, 1), (1, 1, 4, 2), (2, 1, 1, 2)]  # (t, p, e, et)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda s: "t{}p{}e{}et{}".format(*s))
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_exact(hf_models, tmp_path, family, layout):
    from transformers import AutoModelForCausalLM

    tp, pp, ep, etp = layout
    src = hf_models[family]
    arch = hf_to_megatron(src, tmp_path / "mg", **_sizes(*layout), progress=False)
    megatron_to_hf(tmp_path / "mg", tmp_path / "back", progress=False)
    _assert_same_tensors(_load_all(src), _load_all(tmp_path / "back"))
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    # What transformers reads back, with nothing missing or left over.
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info.values()), info
    # The files: dense parts per (TP, PP) rank, experts per (expert TP, PP, EP) rank under local expert numbers.
    release = tmp_path / "mg" / "release"
    dirs = sorted(p.parent.name for p in release.glob("*/model.safetensors"))
    dense = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for t in range(tp) for p in range(pp)]
    experts = [f"mp_rank_{u:02d}_{p:03d}_{x:03d}" for u in range(etp) for p in range(pp) for x in range(ep)]
    assert dirs == sorted(dense + experts)
    moe_layer = arch.moe_layer_pattern().index(1)
    stage, local_layer = divmod(moe_layer, arch.num_layers // pp)
    last_ep = load_file(release / f"mp_rank_{etp - 1:02d}_{stage:03d}_{ep - 1:03d}" / "model.safetensors")
    per_rank = arch.num_experts // ep
    assert sorted(last_ep) == sorted(f"decoder.layers.{local_layer}.mlp.experts.local_experts.{i}.linear_fc{j}.weight"
                                     for i in range(per_rank) for j in (1, 2))
    fc1 = last_ep[f"decoder.layers.{local_layer}.mlp.experts.local_experts.{per_rank - 1}.linear_fc1.weight"]
    hf = _load_all(src)
    expert = f"model.layers.{moe_layer}.mlp.experts.{arch.num_experts - 1}."
    f = arch.moe_ffn_hidden_size // etp  # the last ETP rank's [gate_r; up_r] (stride 2, as the dense fc1)
    assert torch.equal(fc1, torch.cat([hf[expert + "gate_proj.weight"][-f:], hf[expert + "up_proj.weight"][-f:]]))
    meta = json.loads((tmp_path / "mg" / "megatron_hybrid_checkpoint.json").read_text())
    assert (meta["expert_model_parallel_size"], meta["expert_tensor_parallel_size"]) == (ep, etp)
    args = " ".join(meta["megatron_lm_args"])
    for flag in (f"--num-experts {arch.num_experts}", "--moe-router-topk 2", "--moe-ffn-hidden-size 32",
                 f"--moe-layer-freq {str(arch.moe_layer_freq).replace(' ', '')}",  # [1,0] or [0,1]
                 f"--expert-model-parallel-size {ep}", f"--expert-tensor-parallel-size {etp}"):
        assert flag in args, (flag, args)


def test_architecture_of_each_family(hf_models):
    q3, q2 = read_architecture_of(hf_models["qwen3_moe"]), read_architecture_of(hf_models["qwen2_moe"])
    assert (q3.num_experts, q3.moe_layer_freq, q3.moe_router_pre_softmax, q3.qk_layernorm) == (8, [1, 0], False, True)
    assert q3.moe_shared_expert_intermediate_size is None and not q3.moe_shared_expert_gate
    assert (q2.num_experts, q2.moe_layer_freq, q2.moe_router_pre_softmax, q2.add_qkv_bias) == (4, [0, 1], True, True)
    assert (q2.moe_shared_expert_intermediate_size, q2.moe_shared_expert_gate) == (48, True)
    # transformers adds the load-balancing loss only with output_router_logits (off here): so does the conversion.
    assert (q3.moe_aux_loss_coeff, q3.moe_router_load_balancing_type) == (0.0, "none")


def read_architecture_of(hf_dir: Path):
    from megatron_hybrid.convert.families import architecture_from_hf
    from megatron_hybrid.convert.hf_checkpoint import read_config

    return architecture_from_hf(read_config(hf_dir)[1])[1]


def _fused_copy(src: Path, dst: Path, num_layers: int) -> None:
    """``src`` with each MoE layer's experts stored as transformers 5.x's modules hold them: ``gate_up_proj``
    ``[E, 2·Fe, H]`` and ``down_proj`` ``[E, H, Fe]``."""
    tensors = _load_all(src)
    for i in range(num_layers):
        p = f"model.layers.{i}.mlp.experts."
        names = sorted({k[len(p):].split(".")[0] for k in tensors if k.startswith(p)}, key=int)
        if not names:
            continue
        gate_up = [torch.cat([tensors.pop(f"{p}{e}.gate_proj.weight"), tensors.pop(f"{p}{e}.up_proj.weight")])
                   for e in names]
        down = [tensors.pop(f"{p}{e}.down_proj.weight") for e in names]
        tensors[p + "gate_up_proj"], tensors[p + "down_proj"] = torch.stack(gate_up), torch.stack(down)
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_expert_layout_is_read(hf_models, tmp_path, family):
    from transformers import AutoModelForCausalLM

    src = hf_models[family]
    _fused_copy(src, tmp_path / "fused", BASE["num_hidden_layers"])
    # transformers reads the fused file into the same model: the layout (gate rows first) is its own.
    a, b = AutoModelForCausalLM.from_pretrained(src), AutoModelForCausalLM.from_pretrained(tmp_path / "fused")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    hf_to_megatron(tmp_path / "fused", tmp_path / "mg", **_sizes(1, 1, 2, 2), progress=False)
    megatron_to_hf(tmp_path / "mg", tmp_path / "back", progress=False)
    _assert_same_tensors(_load_all(src), _load_all(tmp_path / "back"))  # written per expert, as 5.24 saves


def test_transformer_engine_names_keep_the_moe_layers_norm(hf_models, tmp_path):
    src = hf_models["qwen3_moe"]  # layer 0 MoE, layer 1 dense
    hf_to_megatron(src, tmp_path / "te", **_sizes(1, 1, 2, 1), transformer_impl="transformer_engine",
                   progress=False)
    keys = set(load_file(tmp_path / "te/release/mp_rank_00/model.safetensors"))
    # Transformer Engine's spec fuses the pre-MLP norm into a dense fc1; an MoE layer keeps it apart.
    assert {"decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.1.mlp.linear_fc1.layer_norm_weight",
            "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"} <= keys
    assert "decoder.layers.1.pre_mlp_layernorm.weight" not in keys
    megatron_to_hf(tmp_path / "te", tmp_path / "back", progress=False)
    _assert_same_tensors(_load_all(src), _load_all(tmp_path / "back"))


# ---------------------------------------------------------------- 2. logits in megatron-core

# fp32 with other operation orders (fused QKV, sharded matmuls, the router's softmax over the top-k logits where
# transformers renormalises the top-k probabilities, experts' outputs summed by the reduce-scatter): ~1e-7 relative
# per op; observed ≤ 3e-7 on logits up to |z| ≈ 10. 1e-5 leaves over an order of magnitude and is four orders
# below a routing error (the control below: ≈ 1e-1).
LOGITS_TOL = dict(rtol=1e-5, atol=1e-5)


def _tokens() -> torch.Tensor:
    from megatron_hybrid.convert.verify import random_tokens

    return random_tokens(VOCAB, batch_size=2, seq_length=16, seed=1)


@pytest.fixture(scope="module")
def hf_reference(hf_models) -> dict[str, torch.Tensor]:
    from megatron_hybrid.convert.verify import hf_logits

    return {family: hf_logits(hf_models[family], _tokens()) for family in FAMILIES}


def logits_in_layout(megatron_dir: str, tokens: torch.Tensor, tp: int, pp: int, ep: int, etp: int):
    """Rank body: Megatron's parallel state again with the expert sizes, then the converted model's logits."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_hybrid.convert.verify import megatron_logits_on_rank

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    model_parallel_cuda_manual_seed(1234)
    return megatron_logits_on_rank(megatron_dir, tokens)


def _megatron_logits(mg_dir: Path, world: int, layout: tuple[int, int, int, int]) -> torch.Tensor:
    out = [r for r in run_distributed(logits_in_layout, world, str(mg_dir), _tokens(), *layout) if r is not None]
    assert out and all(torch.equal(out[0], r) for r in out)  # every last-stage rank gathered the same logits
    return out[0]


# (family, stored (t, p, e, et), run (t, p, e, et), ranks): the model loads at another layout than stored. Two
# ranks throughout (the unsharded model as 2 data-parallel replicas): one pool of ranks, started once, serves all.
LOGIT_CASES = [
    ("qwen3_moe", (2, 2, 2, 1), (1, 1, 1, 1), 2),
    ("qwen3_moe", (1, 1, 1, 1), (2, 1, 2, 1), 2),  # 8 experts over 2 EP ranks, attention over 2 TP ranks
    ("qwen2_moe", (2, 1, 4, 2), (1, 1, 1, 2), 2),  # each expert over 2 ETP ranks, 2 data-parallel replicas
    ("qwen2_moe", (1, 1, 2, 1), (1, 2, 1, 1), 2),  # the dense layer on stage 0, the MoE layer on stage 1
]


@pytest.mark.parametrize("family,stored,run,world", LOGIT_CASES,
                         ids=[f"{c[0]}-run-t{c[2][0]}p{c[2][1]}e{c[2][2]}et{c[2][3]}" for c in LOGIT_CASES])
def test_logits_equal_transformers(hf_models, hf_reference, tmp_path, family, stored, run, world):
    hf_to_megatron(hf_models[family], tmp_path / "mg", **_sizes(*stored), progress=False)
    torch.testing.assert_close(_megatron_logits(tmp_path / "mg", world, run), hf_reference[family], **LOGITS_TOL)


def load_at_the_wrong_expert_parallel_size(megatron_dir: str) -> str:
    """Rank body: a model with all experts local (EP 1) loaded as if it were one of 2 expert-parallel ranks."""
    from megatron_hybrid.convert import load_megatron_checkpoint

    model = read_architecture(megatron_dir).build()
    with pytest.raises(CheckpointError) as info:
        load_megatron_checkpoint([model], megatron_dir, tp_rank=0, tp_size=1, ep_rank=1, ep_size=2)
    return str(info.value)


def test_loading_at_the_wrong_expert_parallel_size_fails_clearly(hf_models, tmp_path):
    hf_to_megatron(hf_models["qwen3_moe"], tmp_path / "mg", **_sizes(1, 1, 2, 1), progress=False)
    for message in run_distributed(load_at_the_wrong_expert_parallel_size, 2, str(tmp_path / "mg")):
        assert "the model holds 8 experts per MoE layer; the checkpoint's 8 over expert_model_parallel_size 2 " \
               "are 4" in message


def test_routing_mapping_is_what_makes_the_logits_equal(hf_models, hf_reference, tmp_path):
    """The control of the tolerance: the same weights with the other top-k weighting (probabilities not
    renormalised) are far off."""
    from megatron_hybrid.convert.layout import META_FILE

    hf_to_megatron(hf_models["qwen3_moe"], tmp_path / "mg", progress=False)
    meta_path = tmp_path / "mg" / META_FILE  # the manifest holds the other files' digests, not its own
    meta = json.loads(meta_path.read_text())
    meta["architecture"]["moe_router_pre_softmax"] = True
    meta_path.write_text(json.dumps(meta))
    diff = (_megatron_logits(tmp_path / "mg", 2, (1, 1, 1, 1)) - hf_reference["qwen3_moe"]).abs().max().item()
    assert diff > 1e-2, diff


# ---------------------------------------------------------------- 3. bad parallel sizes, bad configs


@pytest.mark.parametrize("family,sizes,message", [
    ("qwen3_moe", _sizes(1, 1, 3, 1), r"expert_model_parallel_size \(3\) must divide num_experts \(8\)"),
    ("qwen2_moe", _sizes(1, 1, 1, 3), r"expert_tensor_parallel_size \(3\) must divide "
                                      r"moe_ffn_hidden_size \(32\)"),
    ("qwen2_moe", _sizes(2, 1, 1, 1), None),  # fine: the shared expert (48) splits over TP 2, experts unsplit
    ("qwen3_moe", _sizes(3, 1, 1, 1), r"tensor_model_parallel_size \(3\) must divide num_attention_heads \(4\)"),
    ("qwen3_moe", _sizes(1, 1, 0, 1), r"parallel sizes must be ≥ 1 \(tensor 1, pipeline 1, expert 0, expert tensor "
                                      r"1\)"),
])
def test_indivisible_sizes_fail_before_writing(hf_models, tmp_path, family, sizes, message):
    out = tmp_path / "out" / "mg"
    if message is None:
        hf_to_megatron(hf_models[family], out, **sizes, progress=False)
        return
    with pytest.raises(CheckpointError, match=message):
        hf_to_megatron(hf_models[family], out, **sizes, progress=False)
    assert not (tmp_path / "out").exists()  # no output, no partial directory


def test_expert_sizes_of_a_dense_model_and_the_ranks_of_a_stage(hf_models):
    arch = read_architecture_of(hf_models["qwen3_moe"])
    # EP × ETP ranks must fit a stage's TP × DP ranks: megatron-core lays both over the same ranks.
    check_parallel_sizes(arch, **_sizes(2, 1, 2, 2), data_parallel_size=2)
    with pytest.raises(CheckpointError, match=r"expert_model_parallel_size \(2\) × expert_tensor_parallel_size "
                                              r"\(2\) = 4 must divide tensor_model_parallel_size \(1\) × "
                                              r"data_parallel_size \(2\) = 2"):
        check_parallel_sizes(arch, **_sizes(1, 1, 2, 2), data_parallel_size=2)
    from megatron_hybrid.megatron.models import tiny_llama

    for sizes, message in ((_sizes(1, 1, 2, 1), r"expert_model_parallel_size \(2\) needs num_experts"),
                           (_sizes(1, 1, 1, 2), r"expert_tensor_parallel_size \(2\) needs num_experts")):
        with pytest.raises(CheckpointError, match=message):
            check_parallel_sizes(tiny_llama(), **sizes)


def _config_dir(tmp_path: Path, config: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_real_configs(tmp_path):
    # Field for field as on the Hub.
    q3 = read_architecture_of(_config_dir(tmp_path / "q3", {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_scaling": None, "router_aux_loss_coef": 0.001,
        "output_router_logits": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
        "use_sliding_window": False, "sliding_window": None, "attention_bias": False, "hidden_act": "silu"}))
    assert (q3.num_experts, q3.moe_router_topk, q3.moe_ffn_hidden_size, q3.ffn_hidden_size) == (128, 8, 768, 6144)
    assert (q3.moe_layer_freq, q3.moe_router_pre_softmax, q3.kv_channels, q3.params_dtype) == (1, False, 128,
                                                                                              "bfloat16")
    q2 = read_architecture_of(_config_dir(tmp_path / "q2", {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
        "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
        "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001, "output_router_logits": True, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vocab_size": 151936, "use_sliding_window": False, "hidden_act": "silu"}))
    assert (q2.num_experts, q2.moe_router_topk, q2.moe_router_pre_softmax, q2.add_qkv_bias) == (60, 4, True, True)
    assert (q2.moe_shared_expert_intermediate_size, q2.moe_shared_expert_gate) == (5632, True)
    assert (q2.moe_aux_loss_coeff, q2.moe_router_load_balancing_type) == (0.001, "aux_loss")
    base = {"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4, "num_experts": 4,
            "moe_intermediate_size": 32}
    with pytest.raises(CheckpointError, match=r"num_experts_per_tok=1 with norm_topk_prob=True .* "
                                              r"--moe-router-pre-softmax"):
        read_architecture_of(_config_dir(tmp_path / "top1", {**base, "num_experts_per_tok": 1,
                                                              "norm_topk_prob": True}))
    top1 = read_architecture_of(_config_dir(tmp_path / "top1b", {**base, "num_experts_per_tok": 1}))
    assert top1.moe_router_pre_softmax  # norm_topk_prob False: the softmax probability, megatron's pre-softmax
    with pytest.raises(CheckpointError, match=r"no layer has experts"):
        read_architecture_of(_config_dir(tmp_path / "none", {**base, "num_hidden_layers": 2,
                                                              "mlp_only_layers": [0, 1]}))


@pytest.mark.parametrize("family", FAMILIES)
def test_export_without_stored_hf_config(hf_models, tmp_path, family):
    """A checkpoint with no Hugging Face config of its own (as training writes) exports with one made from its
    architecture; converting that back gives the same architecture and tensors."""
    src = hf_models[family]
    hf_to_megatron(src, tmp_path / "mg", **_sizes(1, 1, 2, 1), progress=False)
    meta_path = tmp_path / "mg" / "megatron_hybrid_checkpoint.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "hf_config": None, "hf_model_type": None}))
    megatron_to_hf(tmp_path / "mg", tmp_path / "back", progress=False)
    hf_to_megatron(tmp_path / "back", tmp_path / "mg2", progress=False)
    assert read_architecture(tmp_path / "mg2") == read_architecture(tmp_path / "mg")
    _assert_same_tensors(_load_all(src), _load_all(tmp_path / "back"))


# ---------------------------------------------------------------- 4. the tools


def _run_tool(name: str, argv: list[str]) -> int:
    main = runpy.run_path(str(ROOT / "tools" / name))["main"]
    try:
        return main(argv) or 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code)
            return 1
        return e.code or 0


def test_tools_make_tiny_convert_and_refuse(tmp_path, capsys):
    from transformers import AutoTokenizer

    for family in ("qwen3_moe", "qwen2_moe"):
        assert _run_tool("make_tiny_hf_model.py", ["--hf-dir", str(tmp_path / family), "--family", family]) == 0
        arch = read_architecture_of(tmp_path / family)
        assert arch.num_experts == 4 and len(AutoTokenizer.from_pretrained(tmp_path / family)) == arch.vocab_size
    mg = tmp_path / "mg"
    assert _run_tool("convert_checkpoint.py", [
        "hf-to-megatron", "--hf-dir", str(tmp_path / "qwen3_moe"), "--megatron-dir", str(mg), "--no-progress",
        "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"]) == 0
    assert "4 experts: EP 2, ETP 2" in capsys.readouterr().out
    assert (mg / "release" / "mp_rank_01_000_001" / "model.safetensors").is_file()
    assert _run_tool("convert_checkpoint.py", ["megatron-to-hf", "--megatron-dir", str(mg), "--hf-dir",
                                               str(tmp_path / "back"), "--no-progress"]) == 0
    _assert_same_tensors(_load_all(tmp_path / "qwen3_moe"), _load_all(tmp_path / "back"))
    assert _run_tool("convert_checkpoint.py", [
        "hf-to-megatron", "--hf-dir", str(tmp_path / "qwen2_moe"), "--megatron-dir", str(tmp_path / "bad"),
        "--no-progress", "--expert-model-parallel-size", "3"]) == 1
    assert "expert_model_parallel_size (3) must divide num_experts (4)" in capsys.readouterr().out
    assert not (tmp_path / "bad").exists()


def test_help_has_moe_examples(capsys):
    assert _run_tool("convert_checkpoint.py", ["hf-to-megatron", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--expert-model-parallel-size" in out and "--expert-tensor-parallel-size" in out and "Qwen3-MoE" in out
    assert _run_tool("make_tiny_hf_model.py", ["--help"]) == 0
    assert "--family qwen3_moe" in capsys.readouterr().out
    assert _run_tool("verify_checkpoint.py", ["--help"]) == 0
    assert "--expert-model-parallel-size 2" in capsys.readouterr().out
