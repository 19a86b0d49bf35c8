"""``--attention-backend`` (megatron_hybrid.core_attention, issue 44 step 1): sdpa and flex against megatron-core's
DotProductAttention (``local``), forward and backward, as a module and inside a GPTModel at TP 1 and TP 2; the
flag's refusals before any collective; the rollout model keeps its own attention.

Tolerances (fp32 on the CPU): the kernels sum the same products in another order (torch's flash kernel on the CPU
runs an online softmax over key blocks; DotProductAttention takes a full softmax of baddbmm's scores). Measured:
outputs and logits (O(1)) within 3e-7, gradients within 4e-7 relative (whole tensor), module and two-layer model
alike; rtol 1e-5 leaves a factor 25 for other CPUs and still fails on a wrong scale, mask, head pairing or shard,
which are off by O(1e-2) or more. Gradients are compared as the relative error of the whole tensor (element-wise
relative error is meaningless where a gradient is zero up to rounding).
"""

from __future__ import annotations

import argparse
import re
import sys

import pytest
import torch

from tests.harness import run_distributed

FP32_RTOL = 1e-5  # see the module docstring
FP32_ATOL = 1e-6  # outputs are O(1): rounding of values near zero


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _flex_cpu_training_error() -> str | None:
    from megatron_hybrid.core_attention import check_attention_backend

    try:
        check_attention_backend("flex", device_type="cpu")
    except ValueError as error:
        return str(error)
    return None


# ------------------------------------------------------------------------------------------------ 1. the module


def _config(num_heads: int, num_groups: int, head_dim: int, **overrides):
    from megatron.core.transformer import TransformerConfig

    kw = dict(num_layers=1, hidden_size=num_heads * head_dim, num_attention_heads=num_heads,
              num_query_groups=num_groups, kv_channels=head_dim, attention_dropout=0.0, hidden_dropout=0.0,
              use_cpu_initialization=True)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _inputs(sq: int, sk: int, b: int, n: int, g: int, d: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, n, d, generator=gen).to(dtype)
    k = torch.randn(sk, b, g, d, generator=gen).to(dtype)
    v = torch.randn(sk, b, g, d, generator=gen).to(dtype)
    grad_out = torch.randn(sq, b, n * d, generator=gen).to(dtype)
    return q, k, v, grad_out


def _mask(kind: str, sq: int, sk: int, b: int, seed: int):
    """megatron's convention (True = masked out), or None."""
    if kind in ("none", "decode"):
        return None
    causal = torch.ones(sq, sk, dtype=torch.bool).triu(1)
    if kind == "causal_tensor":  # as Megatron-LM's get_ltor_masks_and_position_ids makes it
        return causal.view(1, 1, sq, sk)
    assert kind == "padded"
    # Right padding: sequence i has lengths[i] real tokens; every query still sees key 0 (no empty rows, where
    # the two modules differ by design: see SDPADotProductAttention).
    lengths = torch.randint(1, sk + 1, (b,), generator=torch.Generator().manual_seed(seed))
    pad = torch.arange(sk).view(1, sk) >= lengths.view(b, 1)
    return causal.view(1, 1, sq, sk) | pad.view(b, 1, 1, sk)


def _attend(module, q, k, v, grad_out, mask, mask_type, *, backward: bool = True):
    q, k, v = (t.clone().requires_grad_(backward) for t in (q, k, v))
    out = module(q, k, v, mask, attn_mask_type=mask_type)
    if not backward:
        return out.detach(), None
    out.backward(grad_out)
    return out.detach(), [t.grad for t in (q, k, v)]


def module_case(backend: str, num_heads: int, num_groups: int, mask_kind: str, scale: str,
                dtype_name: str = "float32") -> dict:
    """One rank: ``backend``'s module and DotProductAttention on the same random input; the errors."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_hybrid.core_attention import core_attention_class

    sq, b, d = 7, 3, 12  # odd sizes: no power-of-two block fits them
    sk = 9 if mask_kind == "decode" else sq
    if mask_kind == "decode":
        sq = 1  # one new token over a cache of 9: megatron-core's Attention passes no_mask for it
    dtype = getattr(torch, dtype_name)
    # 'layer_scaling': DotProductAttention divides the scale by the layer number and multiplies it back in its
    # fp32 softmax; 'explicit': a given softmax_scale.
    config = _config(num_heads, num_groups, d, apply_query_key_layer_scaling=scale == "layer_scaling",
                     params_dtype=dtype, bf16=dtype == torch.bfloat16)
    kw = dict(layer_number=3, attn_mask_type=AttnMaskType.causal, attention_type="self",
              softmax_scale=0.37 if scale == "explicit" else None)
    local = DotProductAttention(config, **kw)
    ours = core_attention_class(backend)(config, **kw)
    q, k, v, grad_out = _inputs(sq, sk, b, num_heads, num_groups, d, dtype, seed=11)
    mask = _mask(mask_kind, sq, sk, b, seed=12)
    mask_type = AttnMaskType.no_mask if mask_kind == "decode" else None
    backward = backend != "flex" or _flex_cpu_training_error() is None
    want, want_grads = _attend(local, q, k, v, grad_out, mask, mask_type, backward=backward)
    got, got_grads = _attend(ours, q, k, v, grad_out, mask, mask_type, backward=backward)
    result = {"shape": (tuple(got.shape), tuple(want.shape)), "out": (got, want), "grads": None}
    if backward:
        result["grads"] = (got_grads, want_grads)
    if dtype != torch.float32:  # the independent reference: the same input in fp32 through DotProductAttention
        config32 = _config(num_heads, num_groups, d, apply_query_key_layer_scaling=scale == "layer_scaling")
        ref, ref_grads = _attend(DotProductAttention(config32, **kw), q.float(), k.float(), v.float(),
                                 grad_out.float(), mask, mask_type)
        result["reference"] = (ref, ref_grads)
    return result


MODULE_CASES = [
    # (num_heads, num_groups): MHA, GQA 2 query heads per group, GQA 3 per group.
    pytest.param(4, 4, "none", "layer_scaling", id="mha-causal-none"),
    pytest.param(4, 2, "none", "layer_scaling", id="gqa2-causal-none"),
    pytest.param(6, 2, "causal_tensor", "explicit", id="gqa3-causal-tensor"),
    pytest.param(4, 2, "padded", "explicit", id="gqa2-padded"),
    pytest.param(4, 4, "padded", "layer_scaling", id="mha-padded"),
    pytest.param(6, 2, "decode", "explicit", id="gqa3-decode"),
]


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("num_heads, num_groups, mask_kind, scale", MODULE_CASES)
def test_core_attention_matches_dot_product_attention(backend, num_heads, num_groups, mask_kind, scale):
    r = run_distributed(module_case, 1, backend, num_heads, num_groups, mask_kind, scale)[0]
    assert r["shape"][0] == r["shape"][1]
    torch.testing.assert_close(*r["out"], rtol=FP32_RTOL, atol=FP32_ATOL)
    if r["grads"] is None:
        pytest.skip(f"forward only: {_flex_cpu_training_error()}")
    for name, got, want in zip("qkv", *r["grads"]):
        assert want.norm() > 0, name
        assert _rel_err(got, want) < FP32_RTOL, (name, _rel_err(got, want))


def test_sdpa_in_bfloat16_is_as_close_to_fp32_as_local():
    """bf16: both modules against the same input in fp32 through DotProductAttention (the independent reference).
    Both errors are mostly the bf16 rounding of the same inputs and outputs (~2e-3); DotProductAttention also
    rounds the scores to bf16 before its fp32 softmax, which the SDPA kernel does not. Measured: sdpa's error is
    0.7 to 0.97 times local's (outputs and q/k/v gradients); at most 1.5 times allows for other CPUs, and a wrong
    scale or mask (errors of O(1e-2) and more) still fails."""
    for kind in ("none", "padded"):
        r = run_distributed(module_case, 1, "sdpa", 4, 2, kind, "explicit", "bfloat16")[0]
        (ours, local), (ref, ref_grads) = r["out"], r["reference"]
        assert _rel_err(ours, ref) <= 1.5 * _rel_err(local, ref), (kind, _rel_err(ours, ref), _rel_err(local, ref))
        for name, got, want, exact in zip("qkv", *r["grads"], ref_grads):
            assert _rel_err(got, exact) <= 1.5 * _rel_err(want, exact), (kind, name)


def dropout_case() -> dict:
    """attention_dropout 0.3: off in eval; in training drawn under megatron's RNG tracker (the default generator
    untouched), reproducible from the tracker's seed."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_hybrid.core_attention import FlexDotProductAttention, SDPADotProductAttention

    config = _config(4, 2, 8, attention_dropout=0.3)
    kw = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    ours, local = SDPADotProductAttention(config, **kw), DotProductAttention(config, **kw)
    q, k, v, _ = _inputs(6, 6, 2, 4, 2, 8, torch.float32, seed=5)
    ours.eval(), local.eval()
    eval_err = (ours(q, k, v, None) - local(q, k, v, None)).abs().max().item()
    ours.train()
    model_parallel_cuda_manual_seed(77)
    before = torch.get_rng_state()
    first = ours(q, k, v, None)
    untouched = torch.equal(before, torch.get_rng_state())
    model_parallel_cuda_manual_seed(77)
    again = ours(q, k, v, None)
    try:
        FlexDotProductAttention(config, **kw)
        flex_error = None
    except ValueError as error:
        flex_error = str(error)
    return {"eval_err": eval_err, "dropped": not torch.allclose(first, ours.eval()(q, k, v, None)),
            "untouched": untouched, "reproducible": torch.equal(first, again), "flex_error": flex_error}


def test_attention_dropout_only_in_training_under_the_rng_tracker():
    r = run_distributed(dropout_case, 1)[0]
    assert r["eval_err"] < FP32_ATOL
    assert r["dropped"] and r["untouched"] and r["reproducible"], r
    assert r["flex_error"] == ("attention_backend ('flex') has no attention dropout (flex_attention takes none): "
                               "attention_dropout (0.3) must be 0; use 'sdpa' or 'local'")


def forward_refusals_case() -> list[str]:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_hybrid.core_attention import SDPADotProductAttention

    module = SDPADotProductAttention(_config(4, 4, 8), layer_number=1, attn_mask_type=AttnMaskType.causal,
                                     attention_type="self")
    q, k, v, _ = _inputs(4, 4, 1, 4, 4, 8, torch.float32, seed=1)
    messages = []
    for kw in (dict(packed_seq_params=PackedSeqParams(qkv_format="sbhd")), dict(attention_bias=torch.zeros(1))):
        with pytest.raises(NotImplementedError) as e:
            module(q, k, v, None, **kw)
        messages.append(str(e.value))
    return messages


def test_other_packed_formats_and_attention_bias_are_refused():
    packed, bias = run_distributed(forward_refusals_case, 1)[0]
    assert "'thd' format, not 'sbhd'" in packed
    assert "attention_bias" in bias


def packed_module_case(backend: str, num_heads: int, num_groups: int) -> dict:
    """One rank: ``backend``'s module over 4 sequences of 5, 1, 7 and 3 tokens packed (``thd``), and
    DotProductAttention over each sequence alone (the independent reference); outputs and q/k/v gradients."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_hybrid.core_attention import core_attention_class

    d, lengths = 12, [5, 1, 7, 3]
    total = sum(lengths)
    config = _config(num_heads, num_groups, d)
    kw = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    local, ours = DotProductAttention(config, **kw), core_attention_class(backend)(config, **kw)
    q, k, v, grad_out = _inputs(total, total, 1, num_heads, num_groups, d, torch.float32, seed=5)
    q, k, v = (t[:, 0].clone() for t in (q, k, v))  # [T, heads, D]
    grad_out = grad_out[:, 0]
    cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    backward = backend != "flex" or _flex_cpu_training_error() is None
    q1, k1, v1 = (t.clone().requires_grad_(backward) for t in (q, k, v))
    got = ours(q1, k1, v1, None, packed_seq_params=params)
    got_grads = None
    if backward:
        got.backward(grad_out)
        got_grads = [t.grad for t in (q1, k1, v1)]
    q2, k2, v2 = (t.clone().requires_grad_(True) for t in (q, k, v))
    bounds = cu.tolist()
    want = torch.cat([local(q2[lo:hi, None], k2[lo:hi, None], v2[lo:hi, None], None)[:, 0]
                      for lo, hi in zip(bounds[:-1], bounds[1:])])
    want.backward(grad_out)
    return {"out": (got.detach(), want.detach()), "grads": (got_grads, [t.grad for t in (q2, k2, v2)])}


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("num_heads, num_groups", [(4, 4), (6, 2)], ids=["mha", "gqa"])
def test_packed_sequences_attend_within_each_sequence(backend, num_heads, num_groups):
    result = run_distributed(packed_module_case, 1, backend, num_heads, num_groups)[0]
    got, want = result["out"]
    assert got.shape == want.shape == (16, num_heads * 12)
    # fp32, the same products summed in another order (the kernels' tiles): ~1e-7.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got_grads, want_grads = result["grads"]
    if got_grads is None:
        pytest.skip(f"flex forward checked; {_flex_cpu_training_error()}")
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _sequence_by_sequence(query, key, value, cu, scale, gqa):
    """Each sequence causally over itself through SDPA (fp32): what a varlen kernel computes, ``[T, N, D]``."""
    bounds = cu.tolist()
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        q, k, v = (t[lo:hi].transpose(0, 1)[None] for t in (query, key, value))
        outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                     enable_gqa=gqa)[0].transpose(0, 1))
    return torch.cat(outs)


def _varlen_new(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False):
    """torch ≥ 2.12's signature (causal as a window, a scale, GQA)."""
    assert window_size == (-1, 0) and cu_seq_q.dtype == torch.int32 and cu_seq_k is cu_seq_q
    assert max_q == max_k == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    return _sequence_by_sequence(query, key, value, cu_seq_q, scale, enable_gqa)


def _varlen_old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.9-2.10's signature: ``is_causal``, the default scale, as many key/value heads as query heads."""
    assert is_causal and key.size(1) == value.size(1) == query.size(1)
    assert max_q == max_k == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    return _sequence_by_sequence(query, key, value, cu_seq_q, None, False)


def packed_varlen_case(api: str, num_heads: int, num_groups: int, softmax_scale) -> dict:
    """packed_module_case's pack through the one-call varlen path, ``varlen_attn`` replaced by a function of
    ``api``'s signature (the CPU has no flash varlen kernel), against DotProductAttention per sequence."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_hybrid import core_attention

    fake = {"new": _varlen_new, "old": _varlen_old}[api]
    core_attention._varlen_function = lambda: (fake, frozenset(__import__("inspect").signature(fake).parameters))
    core_attention.SDPADotProductAttention._use_varlen = lambda self, query: True
    d, cu = 12, torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    config = _config(num_heads, num_groups, d)
    kw = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self", softmax_scale=softmax_scale)
    local, ours = DotProductAttention(config, **kw), core_attention.SDPADotProductAttention(config, **kw)
    q, k, v, grad_out = _inputs(16, 16, 1, num_heads, num_groups, d, torch.float32, seed=6)
    q, k, v, grad_out = (t[:, 0].clone() for t in (q, k, v, grad_out))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    q1, k1, v1 = (t.clone().requires_grad_(True) for t in (q, k, v))
    got = ours(q1, k1, v1, None, packed_seq_params=params)
    got.backward(grad_out)
    q2, k2, v2 = (t.clone().requires_grad_(True) for t in (q, k, v))
    bounds = cu.tolist()
    want = torch.cat([local(q2[lo:hi, None], k2[lo:hi, None], v2[lo:hi, None], None)[:, 0]
                      for lo, hi in zip(bounds[:-1], bounds[1:])])
    want.backward(grad_out)
    return {"out": (got.detach(), want.detach()),
            "grads": ([t.grad for t in (q1, k1, v1)], [t.grad for t in (q2, k2, v2)])}


@pytest.mark.parametrize("api", ["new", "old"])
@pytest.mark.parametrize("num_heads, num_groups, softmax_scale", [(4, 4, None), (6, 2, 0.5)],
                         ids=["mha", "gqa-scaled"])
def test_packs_in_one_varlen_call_on_either_torch_signature(api, num_heads, num_groups, softmax_scale):
    """The GPU's one-call path (torch.nn.attention.varlen): the arguments it passes on the signature of torch 2.9-2.10
    (``is_causal``; no scale: the query is pre-scaled; no GQA: key and value heads repeated) and of later torch
    (``window_size``, ``scale``, ``enable_gqa``) give each sequence's own causal attention. The flash kernel itself
    is checked against fp32 on a GPU by tests/gpu_packed_attention.py."""
    result = run_distributed(packed_varlen_case, 1, api, num_heads, num_groups, softmax_scale)[0]
    got, want = result["out"]
    torch.testing.assert_close(got, want, rtol=FP32_RTOL, atol=FP32_ATOL)  # fp32, another summation order
    for g, w in zip(*result["grads"]):
        torch.testing.assert_close(g, w, rtol=FP32_RTOL, atol=FP32_ATOL)


@pytest.mark.parametrize("overrides, message", [
    (dict(context_parallel_size=2), "attention_backend ('sdpa') does not support context parallelism "
                                    "(context_parallel_size 2)"),
    (dict(softmax_type="off-by-one"), "attention_backend ('sdpa') supports softmax_type 'vanilla' only "
                                      "(got 'off-by-one')"),
    (dict(window_size=(4, 0)), "attention_backend ('sdpa') does not support window attention (window_size (4, 0), "
                               "layer 1)"),
], ids=["context-parallel", "softmax-type", "window"])
def test_unsupported_configs_are_refused_at_construction(overrides, message):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_hybrid.core_attention import SDPADotProductAttention

    config = _config(4, 4, 8)
    for name, value in overrides.items():  # after __post_init__: its own checks are not the subject here
        setattr(config, name, value)
    with pytest.raises(ValueError, match=r"^" + re.escape(message)):
        SDPADotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


# ------------------------------------------------------------------------------------------------ 2. the model


def _arch(num_query_groups: int, add_qkv_bias: bool, **kw):
    from megatron_hybrid.megatron.models import tiny_llama

    # Two layers keep it fast; tiny_llama's 8 heads split over TP 2 into 4 per rank (GQA: 2 groups per rank).
    return tiny_llama(num_layers=2, num_query_groups=num_query_groups, add_qkv_bias=add_qkv_bias, **kw)


def model_case(num_query_groups: int, add_qkv_bias: bool, backends: tuple[str, ...]) -> dict:
    """This rank's GPTModel with each backend, the weights of the local one; logits (this rank's vocabulary shard)
    and every parameter's gradient of one loss, per backend. Forward only for a backend that cannot train here."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid.rl.models import copy_weights

    tp = ps.get_tensor_model_parallel_world_size()
    arch = _arch(num_query_groups, add_qkv_bias)
    torch.manual_seed(0)
    models = {name: arch.build(tensor_model_parallel_size=tp, attention_backend=name) for name in ("local",
                                                                                                  *backends)}
    for name in backends:
        copy_weights(models[name], models["local"])
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, arch.vocab_size, (2, 16), generator=gen)
    positions = torch.arange(16).unsqueeze(0).expand(2, -1)
    weights = None
    out = {}
    for name, model in models.items():
        trains = name != "flex" or _flex_cpu_training_error() is None
        with torch.set_grad_enabled(trains):
            logits = model(tokens, positions, None)
        if weights is None:  # one random linear functional of the logits (per vocabulary shard), every backend
            seed = 4 + ps.get_tensor_model_parallel_rank()
            weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed))
        grads = None
        if trains:
            (logits * weights).sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        core = type(model.decoder.layers[0].self_attention.core_attention).__name__
        out[name] = {"logits": logits.detach(), "grads": grads, "core": core}
    return out


MODEL_CASES = [pytest.param(8, False, id="mha"), pytest.param(4, False, id="gqa"),
               pytest.param(8, True, id="mha-qkv-bias"), pytest.param(4, True, id="gqa-qkv-bias")]


def _check_model(runs: list[dict], backends: tuple[str, ...]) -> None:
    for rank in runs:
        assert rank["local"]["core"] == "DotProductAttention"
        for name in backends:
            assert rank[name]["core"] == {"sdpa": "SDPADotProductAttention", "flex": "FlexDotProductAttention"}[name]
            torch.testing.assert_close(rank[name]["logits"], rank["local"]["logits"], rtol=FP32_RTOL, atol=FP32_ATOL)
            if rank[name]["grads"] is None:
                continue
            assert rank[name]["grads"].keys() == rank["local"]["grads"].keys()
            for param, want in rank["local"]["grads"].items():
                assert want.norm() > 0, param
                assert _rel_err(rank[name]["grads"][param], want) < FP32_RTOL, (name, param)


@pytest.mark.parametrize("num_query_groups, add_qkv_bias", MODEL_CASES)
def test_gpt_model_tp1_matches_local(num_query_groups, add_qkv_bias):
    _check_model(run_distributed(model_case, 1, num_query_groups, add_qkv_bias, ("sdpa", "flex")), ("sdpa", "flex"))


@pytest.mark.parametrize("num_query_groups, add_qkv_bias", MODEL_CASES)
def test_gpt_model_tp2_matches_local(num_query_groups, add_qkv_bias):
    runs = run_distributed(model_case, 2, num_query_groups, add_qkv_bias, ("sdpa",), tensor_model_parallel_size=2)
    _check_model(runs, ("sdpa",))


def test_flex_trains_where_torch_has_its_backward():
    error = _flex_cpu_training_error()
    if error is not None:
        pytest.skip(f"flex's gradients are not compared on the CPU: {error}")
    runs = run_distributed(model_case, 1, 4, True, ("flex",))
    _check_model(runs, ("flex",))


def moe_spec_case() -> list[str]:
    """The decoder block spec path (dense and MoE layers mixed): every layer gets the backend's attention."""
    from megatron_hybrid.megatron.models import tiny_llama

    model = tiny_llama(num_layers=2, num_experts=4, moe_layer_freq=[1, 0]).build(attention_backend="sdpa")
    return [type(layer.self_attention.core_attention).__name__ for layer in model.decoder.layers]


def test_moe_block_spec_takes_the_backend():
    assert run_distributed(moe_spec_case, 1)[0] == ["SDPADotProductAttention"] * 2


def test_layer_spec():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_hybrid.core_attention import SDPADotProductAttention, with_local_core_attention

    arch = _arch(4, False)

    def core(spec):
        return spec.submodules.self_attention.submodules.core_attention

    assert core(arch.layer_spec()) is DotProductAttention
    assert core(arch.layer_spec(attention_backend="auto")) is SDPADotProductAttention  # auto: sdpa for now
    assert core(with_local_core_attention(arch.layer_spec(attention_backend="sdpa"))) is DotProductAttention
    with pytest.raises(ValueError, match=r"^attention_backend \('sdpa'\) is for transformer_impl 'local'"):
        arch.layer_spec("transformer_engine", attention_backend="sdpa")


def rollout_case(state: dict) -> dict:
    """A training model on sdpa reshards (TP 2 → rollout TP 1) and generates the tokens a local one does: the rollout
    model keeps megatron-core's DotProductAttention and the generation kernels."""
    from megatron.core import parallel_state as ps
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.megatron.sharding import load_full_state_dict

    tp = ps.get_tensor_model_parallel_world_size()
    greedy = SamplingParams(temperature=1.0, top_k=1, num_tokens_to_generate=4)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    out = {}
    for backend in ("local", "sdpa"):
        model = _arch(4, True).build(tensor_model_parallel_size=tp, attention_backend=backend)
        load_full_state_dict([model], state, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp)
        engine = HybridEngine(model, RolloutLayout(1, 1))
        results = engine.generate(prompts, greedy, vocab_size=250)
        rollout = engine.rollout_model
        out[backend] = {"tokens": [r.generated_tokens for r in results],
                        "rollout_core": type(rollout.decoder.layers[0].self_attention.core_attention).__name__,
                        "train_core": type(model.decoder.layers[0].self_attention.core_attention).__name__}
        engine.switch_to_training()
    return out


def initial_state() -> dict:
    from megatron.core import parallel_state as ps

    from megatron_hybrid.megatron.sharding import full_state_dict

    torch.manual_seed(0)
    model = _arch(4, True).build()
    return full_state_dict([model], tp_group=ps.get_tensor_model_parallel_group(),
                           pp_group=ps.get_pipeline_model_parallel_group())


def test_sdpa_training_model_reshards_and_generates():
    state = run_distributed(initial_state, 1)[0]
    for rank in run_distributed(rollout_case, 2, state, tensor_model_parallel_size=2):
        assert rank["sdpa"]["train_core"] == "SDPADotProductAttention"
        assert rank["sdpa"]["rollout_core"] == rank["local"]["rollout_core"] == "DotProductAttention"
        assert rank["sdpa"]["tokens"] == rank["local"]["tokens"]
        assert all(len(t) == 4 for t in rank["sdpa"]["tokens"])


# ------------------------------------------------------------------------------------------------ 3. the flag


def _validate(*argv: str, world_size: int = 4) -> argparse.Namespace:
    from megatron_hybrid.rl.arguments import add_hybrid_args, add_megatron_args, validate_args

    args = add_hybrid_args(add_megatron_args(argparse.ArgumentParser())).parse_args(argv)
    validate_args(args, world_size)
    return args


def test_the_default_is_local_on_the_cpu_and_sdpa_on_a_gpu(monkeypatch):
    """Issue 44 step 6: the rows chose packed sdpa for GPUs (6.25x padded local's tokens/s on an H100); the CPU keeps
    megatron-core's attention (the goldens' numerics)."""
    assert _validate().attention_backend == "local"
    for backend in ("sdpa", "auto", "local"):
        assert _validate("--attention-backend", backend).attention_backend == backend
    from megatron_hybrid.rl import arguments

    monkeypatch.setattr(arguments, "select_device", lambda args: "cuda")
    assert _validate().attention_backend == "sdpa"
    assert _validate("--attention-backend", "local").attention_backend == "local"


@pytest.mark.parametrize("backend", ["flash", "fused", "unfused"])
def test_transformer_engine_backends_are_refused(backend):
    with pytest.raises(ValueError) as e:
        _validate("--attention-backend", backend)
    assert str(e.value).startswith(f"--attention-backend ({backend!r}) is one of Megatron-LM's Transformer Engine "
                                   "backends ['flash', 'fused', 'unfused']: it needs Transformer Engine")


def test_unknown_backend_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        _validate("--attention-backend", "fast")
    assert "invalid choice: 'fast'" in capsys.readouterr().err


def test_flex_without_flex_attention_names_the_torch_version(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.nn.attention.flex_attention", None)  # import raises ImportError
    with pytest.raises(ValueError) as e:
        _validate("--attention-backend", "flex")
    assert str(e.value) == (f"--attention-backend ('flex'): torch {torch.__version__} has no "
                            "torch.nn.attention.flex_attention (it came with torch 2.5); use 'sdpa'")


def test_flex_on_the_cpu_is_refused_where_torch_has_no_backward(monkeypatch):
    from megatron_hybrid.rl import arguments

    error = _flex_cpu_training_error()
    if error is None:
        pytest.skip(f"torch {torch.__version__}'s flex_attention has a CPU backward")
    # The ranks train on the CPU (select_device's answer; --device cpu would also hide this process's GPUs).
    monkeypatch.setattr(arguments, "select_device", lambda args: "cpu")
    with pytest.raises(ValueError) as e:
        _validate("--attention-backend", "flex")
    assert str(e.value).startswith(f"--attention-backend ('flex'): torch {torch.__version__}'s flex_attention "
                                   "cannot train on the CPU (")
