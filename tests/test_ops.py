"""Native ops vs the pure-PyTorch reference; block planners vs torch.cat / chunk; the fallback path.

Copies and casts are exact (the kernels and the reference convert with the same rounding), so every comparison
is bit-exact. Outputs are poisoned before each call so that unwritten (or wrongly written) elements show.
"""

from __future__ import annotations

import itertools
import math
import random
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from megatron_hybrid.kernels import ops

NATIVE = ops.native_ops_available()
needs_native = pytest.mark.skipif(not NATIVE["cpu"], reason=f"native extension not built: {NATIVE['error']}")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    bits = _BITS[actual.element_size()]
    assert torch.equal(actual.contiguous().view(bits).cpu(), expected.contiguous().view(bits).cpu())


def poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(-7777.0)  # not produced by randn, representable in every float dtype (bf16 rounds it)


def strided_sources(device: str, seed: int = 0) -> list[torch.Tensor]:
    """Odd shapes, every kind of view, all three dtypes, empty / one-element / 0-dim tensors."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)

    return [
        rnd(3, 5),                                             # contiguous fp32
        rnd(7, dtype=torch.bfloat16),                          # odd-length bf16
        rnd(9, 13, dtype=torch.float16).t(),                   # transposed
        rnd(6, 10)[1:5, ::3],                                  # sliced with steps
        rnd(2, 3, 4, 5, dtype=torch.bfloat16).permute(3, 1, 0, 2),  # 4-D permuted
        rnd(4, 6, 5, 3, dtype=torch.float16)[:, 1::2, :4, 1:],     # 4-D sliced
        rnd(1, 5).expand(3, 5),                                # zero stride (read side only)
        rnd(0, 4),                                             # empty
        rnd(1, dtype=torch.bfloat16),                          # one element
        rnd(()),                                               # 0-dim
        rnd(129, 33, dtype=torch.bfloat16)[:, 1:],             # rows longer than a vector, misaligned start
        rnd(5000),                                             # several CPU tiles worth of 16-byte units
    ]


def layout(tensors: list[torch.Tensor], *, gap: int = 3) -> tuple[list[int], int]:
    """Offsets with odd gaps (so most regions start misaligned) and the total flat size."""
    offsets, cursor = [], 1
    for t in tensors:
        offsets.append(cursor)
        cursor += t.numel() + gap
    return offsets, cursor


@pytest.fixture
def native_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ops.DISABLE_ENV, raising=False)


# ---------------------------------------------------------------------------------------------------------------
# The reference itself against plain torch expressions


def test_reference_pack_matches_torch_cat() -> None:
    srcs = strided_sources("cpu")
    out = torch.empty(sum(s.numel() for s in srcs), dtype=torch.float32)
    offsets = list(itertools.accumulate([0] + [s.numel() for s in srcs[:-1]]))
    ops.pack_reference(srcs, out, offsets)
    assert_same_bits(out, torch.cat([s.flatten().to(torch.float32) for s in srcs]))


def test_reference_scatter_matches_slicing() -> None:
    flat = torch.randn(40)
    dst, col = torch.zeros(6, 7), torch.zeros(5)
    ops.scatter_blocks_reference(flat, [dst, col], [[0, 3, 2, 4, 1, 2], [1, 30, 3, 1, 2, 0]])
    expected, expected_col = torch.zeros(6, 7), torch.zeros(5)
    expected[1:3, 2:6] = flat[3:11].view(2, 4)
    expected_col[2:5] = flat[30:33]
    assert_same_bits(dst, expected)
    assert_same_bits(col, expected_col)


# ---------------------------------------------------------------------------------------------------------------
# Native vs reference


@needs_native
@pytest.mark.usefixtures("native_enabled")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_pack_unpack(device: str, out_dtype: torch.dtype) -> None:
    srcs = strided_sources(device)
    offsets, total = layout(srcs)
    out = poison(torch.empty(total, dtype=out_dtype, device=device))
    expected = out.clone()
    ops.pack(srcs, out, offsets)
    ops.pack_reference(srcs, expected, offsets)
    assert_same_bits(out, expected)

    # unpack into non-contiguous views of poisoned parents: the views get the values, the rest stays poisoned.
    parents = [poison(torch.empty(s.shape[::-1] + (2,), dtype=s.dtype, device=device)) for s in srcs]
    dsts = [p[..., 1].permute(tuple(reversed(range(s.dim())))) for p, s in zip(parents, srcs)]
    ref_parents = [p.clone() for p in parents]
    ref_dsts = [p[..., 1].permute(tuple(reversed(range(s.dim())))) for p, s in zip(ref_parents, srcs)]
    ops.unpack(out, dsts, offsets)
    ops.unpack_reference(expected, ref_dsts, offsets)
    for p, r in zip(parents, ref_parents):
        assert_same_bits(p, r)


@needs_native
@pytest.mark.usefixtures("native_enabled")
@pytest.mark.parametrize("device", DEVICES)
def test_pack_unpack_round_trip_is_exact(device: str) -> None:
    srcs = [s for s in strided_sources(device, seed=1) if s.dtype == torch.bfloat16]
    offsets, total = layout(srcs, gap=0)
    flat = torch.empty(total, dtype=torch.bfloat16, device=device)
    ops.pack(srcs, flat, offsets)
    back = [torch.empty_like(s) for s in srcs]
    ops.unpack(flat, back, offsets)
    for b, s in zip(back, srcs):
        assert_same_bits(b, s.contiguous())


def random_blocks(dst_shapes: list[tuple[int, int]], rng: random.Random, num_blocks: int
                  ) -> tuple[torch.Tensor, int]:
    """Disjoint blocks in the destinations (a grid per tensor, some cells used) stored back to back."""
    rows_out, cursor = [], 0
    for index, (r, c) in enumerate(dst_shapes):
        row_cuts = sorted({0, r, *(rng.randrange(r + 1) for _ in range(2))})
        col_cuts = sorted({0, c, *(rng.randrange(c + 1) for _ in range(2))})
        cells = [(r0, r1, c0, c1) for r0, r1 in zip(row_cuts, row_cuts[1:]) for c0, c1 in zip(col_cuts, col_cuts[1:])]
        for r0, r1, c0, c1 in rng.sample(cells, min(len(cells), num_blocks)):
            rows_out.append((index, cursor, r1 - r0, c1 - c0, r0, c0))
            cursor += (r1 - r0) * (c1 - c0) + rng.randrange(3)
    rng.shuffle(rows_out)
    rows_out.append((0, cursor, 0, 0, 0, 0))  # an empty block
    return torch.tensor(rows_out, dtype=torch.int64), cursor


@needs_native
@pytest.mark.usefixtures("native_enabled")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flat_dtype", DTYPES)
def test_scatter_gather_blocks(device: str, flat_dtype: torch.dtype) -> None:
    rng = random.Random(str(flat_dtype))
    g = torch.Generator().manual_seed(2)

    def make_dsts() -> list[torch.Tensor]:
        return [
            poison(torch.empty(37, 21, dtype=torch.bfloat16, device=device)),
            poison(torch.empty(40, 11, dtype=torch.float32, device=device)).t(),   # transposed
            poison(torch.empty(30, 64, dtype=torch.float16, device=device))[::2, 8:56],  # strided rows
            poison(torch.empty(19, dtype=torch.bfloat16, device=device)),          # 1-D, addressed as [19, 1]
            poison(torch.empty(128, 256, dtype=torch.bfloat16, device=device)),    # 16-byte-aligned rows
        ]

    dsts, expected = make_dsts(), make_dsts()
    blocks, total = random_blocks([(d.shape[0], d.shape[1] if d.dim() == 2 else 1) for d in dsts], rng, 5)
    flat = torch.randn(total, generator=g).to(dtype=flat_dtype, device=device)
    ops.scatter_blocks(flat, dsts, blocks)
    ops.scatter_blocks_reference(flat, expected, blocks)
    for d, e in zip(dsts, expected):
        assert_same_bits(d, e)

    srcs = [torch.randn(d.shape, generator=g).to(dtype=d.dtype, device=device) for d in dsts]
    out, out_ref = poison(torch.empty_like(flat)), poison(torch.empty_like(flat))
    ops.gather_blocks(srcs, out, blocks)
    ops.gather_blocks_reference(srcs, out_ref, blocks)
    assert_same_bits(out, out_ref)


@needs_native
@pytest.mark.usefixtures("native_enabled")
def test_unusual_dtypes_and_many_dims_take_the_slow_path() -> None:
    # int64 -> fp32 is outside the cast kernels, a 7-D permuted view exceeds the kernels' dims: both still work.
    srcs = [torch.arange(10, dtype=torch.int64), torch.randn([2] * 7).permute(6, 5, 4, 3, 2, 1, 0)]
    offsets, total = layout(srcs)
    out, expected = poison(torch.empty(total)), poison(torch.empty(total))
    ops.pack(srcs, out, offsets)
    ops.pack_reference(srcs, expected, offsets)
    assert_same_bits(out, expected)


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
def test_bad_arguments_raise_value_error(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ops.DISABLE_ENV, "0" if native else "1")
    out = torch.zeros(10)
    with pytest.raises(ValueError, match="does not fit"):
        ops.pack([torch.zeros(5)], out, [6])
    with pytest.raises(ValueError, match="one offset per tensor"):
        ops.pack([torch.zeros(5)], out, [])
    with pytest.raises(ValueError, match="1-D contiguous"):
        ops.unpack(torch.zeros(4, 4)[:, 0], [torch.zeros(2)], [0])
    with pytest.raises(ValueError, match="covers rows"):
        ops.scatter_blocks(out, [torch.zeros(3, 3)], [[0, 0, 2, 2, 2, 0]])
    with pytest.raises(ValueError, match="names dsts"):
        ops.scatter_blocks(out, [torch.zeros(3, 3)], [[1, 0, 1, 1, 0, 0]])


NATIVE_ERROR_SCRIPT = """
import torch
import megatron_hybrid.kernels.ops as ops
ops.native_ops_available()
for call in (
    lambda: torch.ops.megatron_hybrid.pack([torch.zeros(5)], torch.zeros(10), [6]),
    lambda: torch.ops.megatron_hybrid.scatter_blocks(torch.zeros(10), [torch.zeros(3, 3)],
                                                     torch.tensor([[0, 0, 2, 2, 2, 0]])),
):
    try:
        call()
    except RuntimeError as exc:
        print("RuntimeError:", str(exc).splitlines()[0])
"""


@needs_native
def test_native_checks_raise_runtime_error() -> None:
    """The C++ checks behind the Python ones, for callers of torch.ops.megatron_hybrid.* directly.

    In a subprocess: on the H200 image (torch 2.11) the first exception thrown inside the extension crashed the
    process, so a crash here must fail this test only, not the whole session.
    """
    proc = subprocess.run([sys.executable, "-c", NATIVE_ERROR_SCRIPT], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and "does not fit" in lines[0] and "covers rows" in lines[1], proc.stdout


# ---------------------------------------------------------------------------------------------------------------
# Registration


OPCHECK_CASES = {
    "pack": lambda: ([torch.randn(3, 5), torch.randn(7).bfloat16(), torch.randn(4, 6)[:, ::2]], torch.zeros(40),
                     [0, 16, 24]),
    "unpack": lambda: (torch.randn(40), [torch.empty(3, 5), torch.empty(7).bfloat16(), torch.empty(6, 4).t()[:2]],
                       [0, 16, 24]),
    "scatter_blocks": lambda: (torch.randn(40), [torch.zeros(6, 5), torch.zeros(4).half()],
                               torch.tensor([[0, 0, 2, 3, 1, 1], [1, 10, 3, 1, 1, 0]])),
    "gather_blocks": lambda: ([torch.randn(6, 5), torch.randn(4)], torch.zeros(20),
                              torch.tensor([[0, 0, 2, 3, 1, 1], [1, 10, 3, 1, 1, 0]])),
}


@needs_native
@pytest.mark.parametrize("name", sorted(OPCHECK_CASES))
def test_opcheck(name: str) -> None:
    torch.library.opcheck(getattr(torch.ops.megatron_hybrid, name).default, OPCHECK_CASES[name]())


# ---------------------------------------------------------------------------------------------------------------
# Fallback


def test_disable_env_forces_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ops.DISABLE_ENV, "1")
    assert ops.native_ops_available() == {"cpu": False, "cuda": False, "disabled": True, "error": None}
    srcs = strided_sources("cpu")
    offsets, total = layout(srcs)
    out, expected = poison(torch.empty(total)), poison(torch.empty(total))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit opt-out does not warn
        ops.pack(srcs, out, offsets)
    ops.pack_reference(srcs, expected, offsets)
    assert_same_bits(out, expected)


def test_missing_extension_warns_once_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ops.DISABLE_ENV, raising=False)
    monkeypatch.setattr(ops, "_ext", None)
    monkeypatch.setattr(ops, "_ext_tried", True)
    monkeypatch.setattr(ops, "_ext_error", "ImportError: simulated")
    monkeypatch.setattr(ops, "_warned", set())
    assert ops.native_ops_available()["error"] == "ImportError: simulated"
    flat = torch.randn(12)
    dst = torch.zeros(3, 4)
    with pytest.warns(RuntimeWarning, match="simulated"):
        ops.unpack(flat, [dst], [0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.unpack(flat, [dst], [0])
    assert_same_bits(dst, flat.view(3, 4))


# ---------------------------------------------------------------------------------------------------------------
# Planners, checked with the ops against torch.cat / chunk references


def flat_of(shards: list[torch.Tensor], *, gap: int = 5) -> tuple[torch.Tensor, list[int]]:
    """Shards stored back to back in a poisoned flat buffer, with gaps."""
    offsets, total = layout(shards, gap=gap)
    flat = poison(torch.empty(total))
    for shard, off in zip(shards, offsets):
        flat[off:off + shard.numel()] = shard.flatten()
    return flat, offsets


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
@pytest.mark.parametrize("shape,dim", [((12, 5), 0), ((12, 5), 1), ((9,), 0), ((4, 3, 2), 0), ((4, 6, 2), 1)])
def test_plan_stack(native: bool, shape: tuple[int, ...], dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ops.DISABLE_ENV, "0" if native else "1")
    k = 3
    full = torch.randn(*[s * k if d == dim else s for d, s in enumerate(shape)])
    shards = list(full.chunk(k, dim=dim))
    flat, offsets = flat_of([s.contiguous() for s in shards])
    blocks = ops.plan_stack(shape, offsets, partition_dim=dim)
    rows, cols = ops.as_2d_shape(full.shape)
    dst = poison(torch.empty(rows, cols))
    ops.scatter_blocks(flat, [dst], blocks)
    assert_same_bits(dst.view(full.shape), torch.cat(shards, dim=dim))

    back = poison(torch.empty_like(flat))
    ops.gather_blocks([dst], back, blocks)
    for shard, off in zip(shards, offsets):
        assert_same_bits(back[off:off + shard.numel()], shard.flatten())


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
@pytest.mark.parametrize("tp,tp_rollout", [(4, 1), (4, 2), (2, 2)])
def test_plan_stack_strided_gate_up(native: bool, tp: int, tp_rollout: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gated MLP fc1: training rank r holds [gate_r; up_r]; a rollout rank of a smaller TP degree holds
    [gate_{r'}; up_{r'}] over the merged chunks, and TP degree 1 is the canonical [gate; up]."""
    monkeypatch.setenv(ops.DISABLE_ENV, "0" if native else "1")
    ffn, hidden = 24, 5
    gate, up = torch.randn(ffn, hidden), torch.randn(ffn, hidden)
    train = [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]
    k = tp // tp_rollout
    for rollout_rank in range(tp_rollout):
        group = train[rollout_rank * k:(rollout_rank + 1) * k]
        flat, offsets = flat_of(group)
        blocks = ops.plan_stack(train[0].shape, offsets, partition_dim=0, partition_stride=2)
        dst = poison(torch.empty(2 * ffn // tp_rollout, hidden))
        ops.scatter_blocks(flat, [dst], blocks)
        expected = torch.cat([gate.chunk(tp_rollout)[rollout_rank], up.chunk(tp_rollout)[rollout_rank]])
        assert_same_bits(dst, expected)


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
def test_plan_vocab(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ops.DISABLE_ENV, "0" if native else "1")
    vocab, hidden, tp = 50, 3, 4
    padded = math.ceil(vocab / (8 * tp)) * 8 * tp  # Megatron: multiple of make_vocab_size_divisible_by * tp = 64
    table = torch.randn(padded, hidden)
    table[vocab:] = 0
    shards = list(table.chunk(tp))
    flat, offsets = flat_of(shards)

    # Export: the unpadded [vocab, hidden] table.
    dst = poison(torch.empty(vocab, hidden))
    blocks = ops.plan_vocab(shards[0].shape, offsets, vocab_size=vocab)
    ops.scatter_blocks(flat, [dst], blocks)
    assert_same_bits(dst, table[:vocab])

    # Back into padded shards with gather_blocks: real rows restored, padding rows of the flat buffer untouched.
    back = poison(torch.empty_like(flat))
    ops.gather_blocks([dst], back, blocks)
    for j, (shard, off) in enumerate(zip(shards, offsets)):
        real = max(0, min(shard.shape[0], vocab - j * shard.shape[0]))
        assert_same_bits(back[off:off + real * hidden], shard[:real].flatten())
        assert bool((back[off + real * hidden:off + shard.numel()] == -7777.0).all())

    # Another TP degree with its own padding (tp 4 -> 1 rank of tp 2, padded to a multiple of 8 * 2 = 16 per rank):
    # rows past the vocabulary stay as allocated (zeros).
    rows_per_rank = math.ceil(vocab / (8 * 2)) * 8
    for rank in range(2):
        dst = torch.zeros(rows_per_rank, hidden)
        blocks = ops.plan_vocab(shards[0].shape, offsets, vocab_size=vocab, dst_row0=rank * rows_per_rank,
                                dst_rows=rows_per_rank)
        ops.scatter_blocks(flat, [dst], blocks)
        expected = torch.zeros(rows_per_rank, hidden)
        real = table[rank * rows_per_rank:min(vocab, (rank + 1) * rows_per_rank)]
        expected[:real.shape[0]] = real
        assert_same_bits(dst, expected)


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
@pytest.mark.parametrize("tp,cols", [(1, 6), (2, 6), (4, 1)])
def test_plan_qkv_split(native: bool, tp: int, cols: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ops.DISABLE_ENV, "0" if native else "1")
    nh, ng, d = 8, 4, 3
    q, k, v = torch.randn(nh * d, cols), torch.randn(ng * d, cols), torch.randn(ng * d, cols)
    # Megatron's fused layout: per query group, its nh/ng query heads, then its key head, then its value head.
    groups = [torch.cat([qg, kg, vg]) for qg, kg, vg in zip(q.chunk(ng), k.chunk(ng), v.chunk(ng))]
    fused = torch.cat(groups)
    shards = [s.squeeze(1) if cols == 1 else s for s in fused.chunk(tp)]  # a bias is 1-D
    flat, offsets = flat_of([s.contiguous() for s in shards])
    blocks = ops.plan_qkv_split(offsets, num_heads=nh, num_query_groups=ng, head_dim=d, cols=cols)
    dsts = [poison(torch.empty(t.shape)) for t in (q, k, v)]
    if cols == 1:
        dsts = [t.squeeze(1) for t in dsts]
    ops.scatter_blocks(flat, dsts, blocks)
    for got, want in zip(dsts, (q, k, v)):
        assert_same_bits(got.reshape(want.shape), want)


def test_planner_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="partition_stride=2 is supported on dim 0 only"):
        ops.plan_stack((4, 4), [0], partition_dim=1, partition_stride=2)
    with pytest.raises(ValueError, match="partition_dim must be 0 or 1"):
        ops.plan_stack((4, 4, 4), [0], partition_dim=2)
    with pytest.raises(ValueError, match="not divisible by the number of shards"):
        ops.plan_qkv_split([0, 1, 2], num_heads=8, num_query_groups=4, head_dim=2, cols=3)


# ---------------------------------------------------------------------------------------------------------------
# CUDA only


@needs_native
@needs_cuda
@pytest.mark.usefixtures("native_enabled")
def test_cuda_kernels_are_built_and_one_launch_per_dtype_pair() -> None:
    assert ops.native_ops_available()["cuda"], "the extension was built without its CUDA kernels"
    dev = "cuda"
    srcs = [torch.randn(n, device=dev, dtype=dt) for n, dt in zip(range(100, 140), itertools.cycle(DTYPES))]
    offsets, total = layout(srcs)
    out = torch.empty(total, dtype=torch.bfloat16, device=dev)
    ops.pack(srcs, out, offsets)  # warm-up: table upload, lazy init
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ops.pack(srcs, out, offsets)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "megatron_hybrid" in e.name]
    # bf16 -> bf16 copies (1 launch), fp32 -> bf16 and fp16 -> bf16 casts (1 launch each).
    assert sorted("cast" if "cast_kernel" in k else "copy" for k in kernels) == ["cast", "cast", "copy"], kernels


@needs_native
@needs_cuda
@pytest.mark.usefixtures("native_enabled")
def test_cuda_large_pack_scatter_matches_reference() -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    srcs = [torch.randn(s, device="cuda", generator=g).bfloat16() for s in [(4096, 1024), (1023, 7), (1,), (8192,)]]
    offsets, total = layout(srcs, gap=8)
    out, ref = poison(torch.empty(total, device="cuda").bfloat16()), poison(torch.empty(total, device="cuda").bfloat16())
    ops.pack(srcs, out, offsets)
    ops.pack_reference(srcs, ref, offsets)
    assert_same_bits(out, ref)
    # Row-parallel layout: two [4096, 512] shards stacked on dim 1 of a [4096, 1024] weight.
    shards = list(srcs[0].chunk(2, dim=1))
    flat, offs = torch.cat([s.flatten() for s in shards]), [0, shards[0].numel()]
    dst = poison(torch.empty(4096, 1024, device="cuda").bfloat16())
    ops.scatter_blocks(flat, [dst], ops.plan_stack((4096, 512), offs, partition_dim=1))
    assert_same_bits(dst, srcs[0])
