"""The KV-cache decode kernels (megatron_hybrid.inference.kernels): references and Triton paths.

The PyTorch references, which every CPU run and every run without Triton uses, are checked against independent
computations: ``scaled_dot_product_attention`` row by row on its slot's sliced cache, and megatron-core's own
``_apply_rotary_pos_emb_bshd``. The Triton kernels are checked against the references: the rotary embedding and
cache write bit for bit, the attention within a tolerance of its dtype.

The Triton tests (named ``test_triton_*``) run where Triton is importable: on a GPU in this process; without one in
Triton's CPU interpreter, which must be switched on before the kernels are defined, so
:func:`test_interpreter_subprocess` runs them in a child pytest with ``TRITON_INTERPRET=1`` (running this file with
``TRITON_INTERPRET=1`` set runs them in process). Without Triton they are skipped.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from megatron_hybrid.inference import kernels
from tests.triton_support import CUDA, TRITON_DEVICE, needs_triton, run_interpreted

POISON = float("nan")  # in unfilled cache positions: a kernel that reads one returns NaN


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------------------
# Cases


def attention_case(*, B: int, G: int, R: int, D: int, N: int, L: int, lengths: list[int], dtype: torch.dtype,
                   device: str = "cpu", seed: int = 0, slots: list[int] | None = None) -> dict:
    """Queries as a strided view (a column slice of a wider tensor), random caches, ragged lengths; ``slots``: each
    row's cache slot (``slots_B``), None for row b in slot b."""
    g = _generator(seed)
    q_wide = torch.randn(B, G * R + 1, D, generator=g).to(dtype=dtype, device=device)
    keys = torch.randn(N, G, L, D, generator=g).to(dtype=dtype, device=device)
    values = torch.randn(N, G, L, D, generator=g).to(dtype=dtype, device=device)
    return {"q": q_wide[:, 1:].unflatten(1, (G, R)), "keys": keys, "values": values,
            "lengths": torch.tensor(lengths, dtype=torch.int64, device=device), "scale": 1.0 / math.sqrt(D),
            "max_length": max(lengths),
            "slots": None if slots is None else torch.tensor(slots, dtype=torch.int32, device=device)}


def poisoned(cache_NGLD: torch.Tensor, lengths_B: torch.Tensor, slots_B: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of the cache with every position that no row attends to set to NaN: in each slot those past the
    longest length of the rows that read it (all of a slot no row reads). Row b reads slot ``slots_B[b]``, or b."""
    out = cache_NGLD.clone()
    if slots_B is None:
        slots_B = torch.arange(len(lengths_B), device=out.device)
    filled_N = torch.zeros(out.shape[0], dtype=lengths_B.dtype, device=out.device)
    filled_N.scatter_reduce_(0, slots_B.long(), lengths_B, reduce="amax")
    unfilled_NL = torch.arange(out.shape[2], device=out.device) >= filled_N[:, None]
    out[unfilled_NL.unsqueeze(1).expand(-1, out.shape[1], -1)] = POISON
    return out


def rope_case(*, G: int, R: int, D: int, rotary_percent: float | None, dtype: torch.dtype, device: str = "cpu",
              seed: int = 0) -> dict:
    """Seven packed tokens: a prompt of three in slot 0, two in slot 2, and decode tokens of slots 1 and 3 at later
    positions; ``linear_qkv``'s output as a column slice of a wider tensor; caches of random contents."""
    g = _generator(seed)
    slots = torch.tensor([0, 0, 0, 2, 2, 1, 3])
    positions = torch.tensor([0, 1, 2, 0, 1, 5, 8])
    T, X = len(slots), G * (R + 2) * D
    mixed_wide = (4 * torch.randn(T, X + 3, generator=g)).to(dtype=dtype, device=device)
    case = {"mixed": mixed_wide[:, 3:], "slots": slots, "positions": positions,
            "keys": torch.randn(5, G, 10, D, generator=g).to(dtype),
            "values": torch.randn(5, G, 10, D, generator=g).to(dtype), "cos": None, "sin": None, "freqs": None}
    if rotary_percent is not None:
        rot = int(D * rotary_percent)
        # megatron-core's RotaryEmbedding: angles position * 10000^(-2i / rot), the half repeated: [T, 1, 1, rot].
        inv_freq = 1.0 / 10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
        angles = positions[:, None].float() * inv_freq
        case["freqs"] = torch.cat((angles, angles), dim=-1)[:, None, None, :]
        case["cos"] = torch.cos(case["freqs"]).to(dtype)[:, 0, 0]
        case["sin"] = torch.sin(case["freqs"]).to(dtype)[:, 0, 0]
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def run_rope(fn, case: dict, *, G: int, R: int, D: int, out_q: torch.Tensor | None = None,
             mixed: torch.Tensor | None = None, bias: torch.Tensor | None = None):
    """``fn`` (the public function or the reference) on copies of the case's caches: (queries, keys, values)."""
    keys, values = case["keys"].clone(), case["values"].clone()
    q = fn(case["mixed"] if mixed is None else mixed, case["cos"], case["sin"], case["slots"], case["positions"],
           keys, values, groups=G, ratio=R, head_dim=D, out_q=out_q,
           **({} if bias is None else {"bias_X": bias}))
    return q, keys, values


# ---------------------------------------------------------------------------------------------------------------
# References against independent computations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("N,slots,lengths", [
    (7, None, [1, 33, 7, 16, 17]),  # row b reads slot b
    (5, [3, 0, 4, 1, 2], [1, 33, 7, 16, 17]),  # slots_B a permutation
    # A prefill chunk of three tokens in slot 2 riding along decode rows; slot 0 read twice, at other lengths; 4
    # slots for 6 rows.
    (4, [2, 0, 2, 2, 3, 0], [31, 1, 32, 33, 16, 7]),
], ids=["row_slots", "permuted_slots", "shared_slots"])
def test_decode_reference_matches_sdpa_per_row(dtype: torch.dtype, ratio: int, N: int, slots: list[int] | None,
                                               lengths: list[int]) -> None:
    B, G, D = len(lengths), 2, 32
    case = attention_case(B=B, G=G, R=ratio, D=D, N=N, L=40, lengths=lengths, dtype=dtype, slots=slots)
    out = torch.empty(B, G, ratio, D + 3, dtype=dtype)[..., 3:]  # a strided out
    result = kernels._decode_attention_reference(case["q"], case["keys"], case["values"], case["lengths"],
                                                 scale=case["scale"], max_length=case["max_length"], out=out,
                                                 slots_B=case["slots"])
    assert result is out
    for b, length in enumerate(case["lengths"].tolist()):
        slot = b if slots is None else slots[b]
        expected = F.scaled_dot_product_attention(case["q"][b].float(), case["keys"][slot, :, :length].float(),
                                                  case["values"][slot, :, :length].float(), scale=case["scale"])
        # Both in fp32 from the same inputs, summed in other orders (~1e-7). In bf16 both round that once to the
        # dtype, so they may differ by one bf16 unit in the last place (at most 2**-7 relative) where a value falls
        # near a rounding boundary.
        torch.testing.assert_close(result[b], expected.to(dtype), atol=1e-6,
                                   rtol=1e-5 if dtype == torch.float32 else 2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("rotary_percent", [0.5, 1.0])
def test_rope_reference_matches_megatron(dtype: torch.dtype, ratio: int, rotary_percent: float) -> None:
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    G, D = 2, 16
    case = rope_case(G=G, R=ratio, D=D, rotary_percent=rotary_percent, dtype=dtype)
    q, keys, values = run_rope(kernels._rope_kv_write_reference, case, G=G, R=ratio, D=D)
    T = case["mixed"].shape[0]
    # megatron-core's split of linear_qkv's output (SelfAttention.get_query_key_value_tensors), [s, b, heads, D].
    q_ref, k_ref, v_ref = case["mixed"].reshape(T, 1, G, (ratio + 2) * D).split([ratio * D, D, D], dim=-1)
    q_ref = _apply_rotary_pos_emb_bshd(q_ref.reshape(T, 1, G * ratio, D), case["freqs"])
    k_ref = _apply_rotary_pos_emb_bshd(k_ref, case["freqs"])
    assert torch.equal(q, q_ref[:, 0])
    expected_keys, expected_values = case["keys"].clone(), case["values"].clone()
    for t, (slot, pos) in enumerate(zip(case["slots"].tolist(), case["positions"].tolist())):
        expected_keys[slot, :, pos] = k_ref[t, 0]
        expected_values[slot, :, pos] = v_ref[t, 0]
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)  # and nothing else written


def test_rope_reference_without_rotary() -> None:
    G, R, D = 2, 2, 8
    case = rope_case(G=G, R=R, D=D, rotary_percent=None, dtype=torch.float32)
    out_q = torch.full((7, G * R, D), POISON)
    q, keys, values = run_rope(kernels._rope_kv_write_reference, case, G=G, R=R, D=D, out_q=out_q)
    qkv = case["mixed"].reshape(7, G, R + 2, D)
    assert q is out_q and torch.equal(q, qkv[:, :, :R].reshape(7, G * R, D))
    assert torch.equal(keys[case["slots"], :, case["positions"]], qkv[:, :, R])
    assert torch.equal(values[case["slots"], :, case["positions"]], qkv[:, :, R + 1])


def test_cpu_tensors_take_the_reference_outside_the_interpreter(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not kernels.use_triton(torch.empty(1))
    case = rope_case(G=1, R=1, D=8, rotary_percent=1.0, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(run_rope(kernels.rope_kv_write, case, G=1, R=1, D=8),
                                                 run_rope(kernels._rope_kv_write_reference, case, G=1, R=1, D=8)))


def test_split_plan() -> None:
    # Few slots, long context: ~2 programs per SM (33 splits of 8 programs wanted; chunks of whole 64-position
    # steps give 32).
    assert kernels._split_plan(8, 8192, 132, None) == (32, 256)
    # Already enough programs, or a short context: one split.
    assert kernels._split_plan(2 * 132, 4096, 132, None) == (1, 4096)
    assert kernels._split_plan(1, 256, 132, None) == (1, 256)
    # A split covers at least 128 positions.
    assert kernels._split_plan(1, 1000, 132, None) == (8, 128)
    # num_splits is an upper bound: chunks are whole steps.
    assert kernels._split_plan(1, 200, 132, 4) == (4, 64)
    assert kernels._split_plan(1, 100, 132, 3) == (2, 64)
    with pytest.raises(ValueError, match="num_splits=0"):
        kernels._split_plan(1, 100, 132, 0)


@pytest.mark.usefixtures("triton_interpreter_fixes")  # its last call runs the kernel under TRITON_INTERPRET=1
def test_bad_shapes_raise() -> None:
    case = attention_case(B=2, G=2, R=1, D=8, N=2, L=4, lengths=[1, 4], dtype=torch.float32)
    with pytest.raises(ValueError, match=r"\[N >= B, G, L, D\]"):
        kernels.decode_attention(case["q"], case["keys"][:, :1], case["values"][:, :1], case["lengths"], scale=1.0,
                                 max_length=4)
    with pytest.raises(ValueError, match="max_length=5"):
        kernels.decode_attention(case["q"], case["keys"], case["values"], case["lengths"], scale=1.0, max_length=5)
    for bad_slots in (torch.zeros(2, 1, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), torch.zeros(2)):
        with pytest.raises(ValueError, match=re.escape(f"slots_B is {tuple(bad_slots.shape)} {bad_slots.dtype}, "
                                                       "expected (2,) of an integer dtype")):
            kernels.decode_attention(case["q"], case["keys"], case["values"], case["lengths"], scale=1.0,
                                     max_length=4, slots_B=bad_slots)
    # With slots_B, rows may outnumber the cache's slots.
    slots = torch.tensor([0, 0])
    result = kernels.decode_attention(case["q"], case["keys"][:1], case["values"][:1], case["lengths"], scale=1.0,
                                      max_length=4, slots_B=slots)
    torch.testing.assert_close(result, kernels._decode_attention_reference(
        case["q"], case["keys"][:1], case["values"][:1], case["lengths"], scale=1.0, max_length=4, slots_B=slots))
    rope = rope_case(G=2, R=1, D=8, rotary_percent=1.0, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"2 \* \(2 \+ 2\) \* 8 = 64"):
        run_rope(kernels.rope_kv_write, rope, G=2, R=2, D=8)
    rope["cos"] = rope["cos"].double()
    with pytest.raises(ValueError, match="mixed_qkv_TX's dtype"):
        run_rope(kernels.rope_kv_write, rope, G=2, R=1, D=8)


# ---------------------------------------------------------------------------------------------------------------
# Triton paths against the references


# The kernel rounds the probabilities to the cache's dtype before p . v (the reference keeps them fp32): each weight
# is off by at most 2**-8 (bf16) / 2**-11 (fp16) relative, so the output by at most that times max |v| (~4 for
# these randn caches), plus one unit in the last place of each rounded output (the rtol). Seen over three seeds:
# 3.9e-3 (bf16), 4.9e-4 (fp16), 6.3e-7 (fp32: IEEE products in both, summed in other orders).
ATTENTION_TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2**-10),
                       torch.bfloat16: dict(atol=1.6e-2, rtol=2**-7)}


@needs_triton
@pytest.mark.usefixtures("triton_interpreter_fixes")
@pytest.mark.parametrize("dtype,R,D,max_length,num_splits", [
    (torch.float32, 2, 64, 200, None),    # short context: one split, the single-kernel path
    (torch.float32, 5, 80, 200, 4),       # R and D not powers of two; splits of 64, the last one short
    (torch.float16, 4, 64, 300, None),    # long context, few slots: the heuristic splits
    (torch.bfloat16, 2, 64, 1500, None),  # slots far longer than most rows: each row splits its own length
    (torch.bfloat16, 1, 64, 200, 1),
    (torch.bfloat16, 4, 32, 200, 4),
    (torch.bfloat16, 8, 128, 300, None),  # Qwen3-30B-A3B's heads: 32 query heads on 4 key/value heads of 128
])
@pytest.mark.parametrize("with_slots", [False, True], ids=["row_slots", "slots_B"])
def test_triton_decode_attention_matches_reference(dtype: torch.dtype, R: int, D: int, max_length: int,
                                                   num_splits: int | None, with_slots: bool) -> None:
    G = 2
    if with_slots:
        # A prefill chunk of three tokens in slot 3, across a 64-step boundary, riding along decode rows of the
        # other slots (one position, the whole max_length, one 64-step, one past it): 7 rows, 5 slots.
        slots, N, lengths = [3, 0, 3, 3, 1, 4, 2], 5, [128, 1, 129, 130, max_length, 64, 65]
    else:
        # Ragged: one position, the whole max_length, exactly one 64-step, one past it; slots 5 .. 7 unused.
        slots, N, lengths = None, 8, [1, max_length, 64, 65, 130]
    B = len(lengths)
    case = attention_case(B=B, G=G, R=R, D=D, N=N, L=max_length + 11, lengths=lengths, dtype=dtype,
                          device=TRITON_DEVICE, slots=slots)
    expected = kernels._decode_attention_reference(case["q"], case["keys"], case["values"], case["lengths"],
                                                   scale=case["scale"], max_length=max_length, slots_B=case["slots"])
    out = torch.full((B, G, R, D + 5), POISON, dtype=dtype, device=TRITON_DEVICE)[..., 5:]
    result = kernels.decode_attention(case["q"], poisoned(case["keys"], case["lengths"], case["slots"]),
                                      poisoned(case["values"], case["lengths"], case["slots"]), case["lengths"],
                                      scale=case["scale"], max_length=max_length, out=out, num_splits=num_splits,
                                      slots_B=case["slots"])
    assert result is out
    torch.testing.assert_close(result, expected, **ATTENTION_TOLERANCE[dtype])


@needs_triton
def test_triton_decode_attention_rejects_unsupported_shapes() -> None:
    for R, D in ((1, 272), (65, 16)):
        case = attention_case(B=1, G=1, R=R, D=D, N=1, L=4, lengths=[4], dtype=torch.float32, device=TRITON_DEVICE)
        with pytest.raises(ValueError, match=f"D={D}, R={R}"):
            kernels.decode_attention(case["q"], case["keys"], case["values"], case["lengths"], scale=1.0,
                                     max_length=4)


@needs_triton
@pytest.mark.usefixtures("triton_interpreter_fixes")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("R,D,rotary_percent", [(1, 32, 1.0), (4, 48, 0.5), (2, 32, None)])
def test_triton_rope_kv_write_is_bit_exact(dtype: torch.dtype, R: int, D: int, rotary_percent: float | None) -> None:
    G = 2
    case = rope_case(G=G, R=R, D=D, rotary_percent=rotary_percent, dtype=dtype, device=TRITON_DEVICE)
    expected = run_rope(kernels._rope_kv_write_reference, case, G=G, R=R, D=D)
    out_q = torch.full((7, G * R, D + 2), POISON, dtype=dtype, device=TRITON_DEVICE)[..., 2:]
    result = run_rope(kernels.rope_kv_write, case, G=G, R=R, D=D, out_q=out_q)
    assert result[0] is out_q
    for actual, want in zip(result, expected):
        assert torch.equal(actual, want)
    # linear_qkv's bias, added in the kernel: as megatron-core's ``output + bias`` (rounded to the dtype) before
    # the same rotary embedding and cache write.
    bias = (2 * torch.randn(case["mixed"].shape[1], generator=_generator(9))).to(dtype=dtype, device=TRITON_DEVICE)
    expected = run_rope(kernels._rope_kv_write_reference, case, G=G, R=R, D=D, mixed=case["mixed"] + bias)
    for actual, want in zip(run_rope(kernels.rope_kv_write, case, G=G, R=R, D=D, bias=bias), expected):
        assert torch.equal(actual, want)
    assert all(torch.equal(a, b) for a, b in zip(run_rope(kernels._rope_kv_write_reference, case, G=G, R=R, D=D,
                                                          bias=bias), expected))


@needs_triton
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_triton_kernels_replay_in_a_cuda_graph() -> None:
    """One decode step (write the new token's K/V, attend up to it) captured once, replayed at other lengths."""
    B, G, R, D, L = 3, 2, 4, 64, 512
    g = _generator(1)
    keys = torch.randn(B, G, L, D, generator=g).bfloat16().cuda()
    values = torch.randn(B, G, L, D, generator=g).bfloat16().cuda()
    # Zeros, not torch.empty: the warm-up writes these into the cache, and garbage NaNs there would make the
    # torch.equal checks below fail whatever the kernels do (NaN != NaN).
    mixed = torch.zeros(B, G * (R + 2) * D, dtype=torch.bfloat16, device="cuda")
    cos = torch.zeros(B, D, dtype=torch.bfloat16, device="cuda")
    sin = torch.zeros_like(cos)
    slots = torch.arange(B, device="cuda")
    lengths = torch.ones(B, dtype=torch.int64, device="cuda")
    out = torch.empty(B, G, R, D, dtype=torch.bfloat16, device="cuda")

    def step():
        q = kernels.rope_kv_write(mixed, cos, sin, slots, lengths - 1, keys, values, groups=G, ratio=R, head_dim=D)
        kernels.decode_attention(q.view(B, G, R, D), keys, values, lengths, scale=D**-0.5, max_length=L, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for new_lengths in ([1, 2, 3], [L, 200, 65]):
        mixed.copy_(torch.randn(mixed.shape, generator=g))
        cos.copy_(torch.randn(cos.shape, generator=g))
        sin.copy_(torch.randn(sin.shape, generator=g))
        lengths.copy_(torch.tensor(new_lengths))
        ref_keys, ref_values = keys.clone(), values.clone()
        graph.replay()
        q = kernels._rope_kv_write_reference(mixed, cos, sin, slots, lengths - 1, ref_keys, ref_values, groups=G,
                                             ratio=R, head_dim=D)
        assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)
        expected = kernels._decode_attention_reference(q.view(B, G, R, D), ref_keys, ref_values, lengths,
                                                       scale=D**-0.5, max_length=L)
        torch.testing.assert_close(out, expected, **ATTENTION_TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reference_is_torchs(dtype: torch.dtype) -> None:
    # Without Triton (or on the CPU) rms_norm is PyTorch's formula: equal to torch's own rms_norm on the CPU.
    g = _generator(4)
    x = torch.randn(3, 7, 96, generator=g).to(dtype)
    w = (torch.randn(96, generator=g) * 0.3 + 1).to(dtype)
    assert torch.equal(kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (96,), w, 1e-5))


@needs_triton
@pytest.mark.usefixtures("triton_interpreter_fixes")
@pytest.mark.parametrize("dtype,H", [(torch.float32, 96), (torch.bfloat16, 2048)])
def test_triton_rms_norm_within_one_unit(dtype: torch.dtype, H: int) -> None:
    # The kernel sums the squares in another order than torch: the rsqrt can differ in its last fp32 bit, which
    # moves a rounded output by at most one unit in the last place of the dtype (the rtol below, 2**-7 for bf16).
    g = _generator(5)
    x = torch.randn(9, H, generator=g).to(dtype=dtype, device=TRITON_DEVICE)
    w = (torch.randn(H, generator=g) * 0.3 + 1).to(dtype=dtype, device=TRITON_DEVICE)
    up = x.float()
    expected = (up * torch.rsqrt(up.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(dtype)
    rtol = {torch.float32: 1e-6, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), expected, rtol=rtol, atol=1e-6)


def test_interpreter_subprocess() -> None:
    """The ``test_triton_*`` tests in Triton's CPU interpreter, in a child process (see the module docstring)."""
    run_interpreted(__file__)
