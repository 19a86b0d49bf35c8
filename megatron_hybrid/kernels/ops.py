"""Where bytes move: fused copies between many tensors and one flat buffer, and the block planners for resharding.

Four ops, registered by the native extension as ``torch.ops.megatron_hybrid.*`` (schemas in ``csrc/ops.cpp``):

- :func:`pack` / :func:`unpack`: whole tensors to / from element offsets of a flat 1-D buffer;
- :func:`scatter_blocks` / :func:`gather_blocks`: contiguous ``[rows, cols]`` blocks of a flat buffer to / from
  sub-blocks of 2-D tensors, the primitive of every layout transform (stacking TP shards on dim 0 or 1, Megatron's
  strided gate/up layout, vocabulary padding, QKV splitting).

Every copy casts to the destination's dtype. A CUDA call is one kernel launch for all same-dtype copies plus one
per (source, destination) dtype pair that needs a cast. Without the compiled extension (or without its CUDA
kernels, for CUDA tensors) the same functions run a pure-PyTorch reference with the same signature, after a
one-time warning; ``MEGATRON_HYBRID_DISABLE_NATIVE=1`` forces the reference silently.

Block tables are int64 CPU tensors ``[n, 6]``; each row is
``(tensor_index, flat_offset, rows, cols, row0, col0)``: the block stored row-major at
``flat[flat_offset : flat_offset + rows * cols]`` corresponds to ``tensors[tensor_index][row0 : row0 + rows,
col0 : col0 + cols]``. A 1-D tensor of n elements is addressed as an ``[n, 1]`` column (biases and norms follow
their weight's dim-0 layout); a tensor with more dims must be passed as a 2-D view (``t.flatten(1)``). The
planners below address every shape through the same 2-D view, ``[shape[0], prod(shape[1:])]``.

Bad arguments (offset counts, bounds, shapes, devices, block tables) raise ValueError on every path. Destination
regions must not overlap each other or the sources; that is not checked.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "BLOCK_FIELDS",
    "as_2d_shape",
    "gather_blocks",
    "gather_blocks_reference",
    "native_ops_available",
    "pack",
    "pack_reference",
    "plan_qkv_split",
    "plan_stack",
    "plan_vocab",
    "scatter_blocks",
    "scatter_blocks_reference",
    "unpack",
    "unpack_reference",
]

DISABLE_ENV = "MEGATRON_HYBRID_DISABLE_NATIVE"

#: Column names of a block table.
BLOCK_FIELDS = ("tensor_index", "flat_offset", "rows", "cols", "row0", "col0")

_OP_NAMES = ("pack", "unpack", "scatter_blocks", "gather_blocks")

_lock = threading.Lock()
_ext: Any = None
_ext_error: str | None = None
_ext_tried = False
_warned: set[str] = set()


# ---------------------------------------------------------------------------------------------------------------
# Loading the extension


def _disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _load_extension() -> Any:
    """Import ``megatron_hybrid.kernels._C`` once; remember why it failed. Returns the module or None."""
    global _ext, _ext_error, _ext_tried
    with _lock:
        if _ext_tried:
            return _ext
        _ext_tried = True
        try:
            from megatron_hybrid.kernels import _C  # lazily: the optional compiled extension, its import error kept
        except (ImportError, OSError) as exc:  # not built, or built against another torch
            _ext_error = f"{type(exc).__name__}: {exc}"
            return None
        _register_fakes()
        _ext = _C
        return _ext


def _fake_noop(*args: Any, **kwargs: Any) -> None:
    # All four ops only mutate their declared (a!) arguments and return nothing: no shapes to compute.
    return None


def _register_fakes() -> None:
    for name in _OP_NAMES:
        torch.library.register_fake(f"megatron_hybrid::{name}")(_fake_noop)


def native_ops_available() -> dict[str, Any]:
    """Which native kernels the ops will use.

    Returns ``{"cpu": bool, "cuda": bool, "disabled": bool, "error": str | None}``: ``cpu`` / ``cuda`` are True
    when the compiled kernels for that device will be used; ``disabled`` when ``MEGATRON_HYBRID_DISABLE_NATIVE``
    forces the reference (the extension is then not imported); ``error`` is why the extension failed to import.
    """
    if _disabled():
        return {"cpu": False, "cuda": False, "disabled": True, "error": None}
    ext = _load_extension()
    return {
        "cpu": ext is not None,
        "cuda": ext is not None and bool(ext.cuda_built()),
        "disabled": False,
        "error": _ext_error,
    }


def _warn_once(key: str, message: str) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def _use_native(device: torch.device) -> bool:
    if _disabled() or device.type not in ("cpu", "cuda"):
        return False
    ext = _load_extension()
    if ext is None:
        _warn_once("import", f"megatron_hybrid: native ops unavailable ({_ext_error}); using the PyTorch "
                             "reference implementation (slower: one copy per tensor)")
        return False
    if device.type == "cuda" and not ext.cuda_built():
        _warn_once("cuda", "megatron_hybrid: the native extension was built without CUDA kernels; using the "
                           "PyTorch reference for CUDA tensors (rebuild with a CUDA toolkit to get them)")
        return False
    return True


# ---------------------------------------------------------------------------------------------------------------
# Argument checks, shared by the reference and the native path. The native ops check the same things in C++
# (RuntimeError), but bad input is rejected here first: it raises ValueError on every path, and does not depend on
# C++ exceptions crossing the extension boundary (on the H200 image, torch 2.11, an exception thrown inside the
# extension crashed the process; see bench/results/ops_h200.txt).


def _check_flat(op: str, name: str, flat: torch.Tensor) -> None:
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"megatron_hybrid::{op}: {name} must be a 1-D contiguous tensor, got shape "
                         f"{tuple(flat.shape)} and strides {flat.stride()}")


def _check_device(op: str, what: str, i: int, t: torch.Tensor, flat: torch.Tensor) -> None:
    if t.device != flat.device:
        raise ValueError(f"megatron_hybrid::{op}: {what}[{i}] is on {t.device} but the flat buffer is on "
                         f"{flat.device}; all tensors must be on one device")


def _check_offsets(op: str, what: str, flat: torch.Tensor, tensors: Sequence[torch.Tensor],
                   offsets: Sequence[int]) -> None:
    _check_flat(op, "out" if what == "srcs" else "flat", flat)
    if len(tensors) != len(offsets):
        raise ValueError(f"megatron_hybrid::{op}: expected one offset per tensor, got {len(tensors)} tensors and "
                         f"{len(offsets)} offsets")
    total = flat.numel()
    for i, (t, offset) in enumerate(zip(tensors, offsets)):
        _check_device(op, what, i, t, flat)
        numel = t.numel()
        if offset < 0 or offset + numel > total:
            raise ValueError(f"megatron_hybrid::{op}: {what}[{i}] ({numel} elements) at offset {offset} does not "
                             f"fit in the flat buffer of {total} elements")


def _as_blocks(blocks: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
    table = torch.as_tensor(blocks, dtype=torch.int64, device="cpu")
    if table.numel() == 0:
        table = table.reshape(0, len(BLOCK_FIELDS))
    if table.dim() != 2 or table.shape[1] != len(BLOCK_FIELDS):
        raise ValueError(f"megatron_hybrid: a block table is [n, {len(BLOCK_FIELDS)}] with rows {BLOCK_FIELDS}, got "
                         f"shape {tuple(table.shape)}")
    return table.contiguous()


def _block_view(op: str, what: str, tensors: Sequence[torch.Tensor], row: Sequence[int], b: int,
                total: int) -> tuple[torch.Tensor, slice]:
    """The destination view and flat span of one block, after checking it."""
    index, offset, rows, cols, row0, col0 = row
    if not 0 <= index < len(tensors):
        raise ValueError(f"megatron_hybrid::{op}: block {b} names {what}[{index}] but {len(tensors)} tensors were "
                         "given")
    t = tensors[index]
    t2 = t.unsqueeze(1) if t.dim() == 1 else t
    if min(rows, cols, row0, col0) < 0 or row0 + rows > t2.shape[0] or col0 + cols > t2.shape[1]:
        raise ValueError(f"megatron_hybrid::{op}: block {b} covers rows [{row0}, {row0 + rows}) and cols "
                         f"[{col0}, {col0 + cols}) of {what}[{index}] whose 2-D shape is {list(t2.shape)}")
    if offset < 0 or offset + rows * cols > total:
        raise ValueError(f"megatron_hybrid::{op}: block {b} ([{rows}, {cols}] at flat offset {offset}) does not "
                         f"fit in the flat buffer of {total} elements")
    return t2[row0:row0 + rows, col0:col0 + cols], slice(offset, offset + rows * cols)


def _check_blocks(op: str, what: str, flat: torch.Tensor, tensors: Sequence[torch.Tensor],
                  table: torch.Tensor) -> None:
    _check_flat(op, "flat", flat)
    shapes = []
    for i, t in enumerate(tensors):
        _check_device(op, what, i, t, flat)
        if t.dim() not in (1, 2):
            raise ValueError(f"megatron_hybrid::{op}: {what}[{i}] must be 1-D (addressed as [n, 1]) or 2-D, got "
                             f"shape {tuple(t.shape)}; pass a 2-D view such as t.flatten(1)")
        shapes.append((t.shape[0], t.shape[1] if t.dim() == 2 else 1))
    if table.shape[0] == 0:
        return
    # Vectorised over the table (it can have thousands of rows); the per-row check then names the first bad row.
    index, offset, rows, cols, row0, col0 = table.unbind(1)
    ok = (index >= 0) & (index < len(tensors)) & (table[:, 1:] >= 0).all(dim=1)
    if bool(ok.all()) and tensors:
        dims = torch.tensor(shapes, dtype=torch.int64)[index]
        ok = (row0 + rows <= dims[:, 0]) & (col0 + cols <= dims[:, 1]) & (offset + rows * cols <= flat.numel())
        if bool(ok.all()):
            return
    bad = int((~ok).nonzero()[0, 0])
    _block_view(op, what, tensors, table[bad].tolist(), bad, flat.numel())
    raise AssertionError("the vectorised block check and the per-row check disagree")


# ---------------------------------------------------------------------------------------------------------------
# Reference implementations (the fallback path; same signatures as the ops)


def pack_reference(srcs: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int]) -> None:
    """Pure-PyTorch :func:`pack`: one ``copy_`` per tensor."""
    _check_offsets("pack", "srcs", out, srcs, offsets)
    for src, offset in zip(srcs, offsets):
        if src.numel():
            out.narrow(0, offset, src.numel()).view(src.shape).copy_(src)


def unpack_reference(flat: torch.Tensor, dsts: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """Pure-PyTorch :func:`unpack`: one ``copy_`` per tensor."""
    _check_offsets("unpack", "dsts", flat, dsts, offsets)
    for dst, offset in zip(dsts, offsets):
        if dst.numel():
            dst.copy_(flat.narrow(0, offset, dst.numel()).view(dst.shape))


def scatter_blocks_reference(flat: torch.Tensor, dsts: Sequence[torch.Tensor],
                             blocks: torch.Tensor | Sequence[Sequence[int]]) -> None:
    """Pure-PyTorch :func:`scatter_blocks`: one ``copy_`` per block."""
    table = _as_blocks(blocks)
    _check_blocks("scatter_blocks", "dsts", flat, dsts, table)
    for b, row in enumerate(table.tolist()):
        view, span = _block_view("scatter_blocks", "dsts", dsts, row, b, flat.numel())
        if view.numel():
            view.copy_(flat[span].view(view.shape))


def gather_blocks_reference(srcs: Sequence[torch.Tensor], flat: torch.Tensor,
                            blocks: torch.Tensor | Sequence[Sequence[int]]) -> None:
    """Pure-PyTorch :func:`gather_blocks`: one ``copy_`` per block."""
    table = _as_blocks(blocks)
    _check_blocks("gather_blocks", "srcs", flat, srcs, table)
    for b, row in enumerate(table.tolist()):
        view, span = _block_view("gather_blocks", "srcs", srcs, row, b, flat.numel())
        if view.numel():
            flat[span].view(view.shape).copy_(view)


# ---------------------------------------------------------------------------------------------------------------
# The ops


def pack(srcs: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int]) -> None:
    """Copy every ``srcs[i]`` (any strides, any float dtype) into ``out[offsets[i] : offsets[i] + numel]``.

    ``out`` is a 1-D contiguous tensor; values are cast to ``out.dtype``; empty sources are skipped.
    """
    srcs, offsets = list(srcs), [int(o) for o in offsets]
    if _use_native(out.device):
        _check_offsets("pack", "srcs", out, srcs, offsets)
        torch.ops.megatron_hybrid.pack(srcs, out, offsets)
    else:
        pack_reference(srcs, out, offsets)


def unpack(flat: torch.Tensor, dsts: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """Inverse of :func:`pack`: ``dsts[i].copy_(flat[offsets[i] : offsets[i] + numel].view(dsts[i].shape))``.

    Destinations may be non-contiguous views; values are cast to each destination's dtype.
    """
    dsts, offsets = list(dsts), [int(o) for o in offsets]
    if _use_native(flat.device):
        _check_offsets("unpack", "dsts", flat, dsts, offsets)
        torch.ops.megatron_hybrid.unpack(flat, dsts, offsets)
    else:
        unpack_reference(flat, dsts, offsets)


def scatter_blocks(flat: torch.Tensor, dsts: Sequence[torch.Tensor],
                   blocks: torch.Tensor | Sequence[Sequence[int]]) -> None:
    """Copy each contiguous ``[rows, cols]`` block of ``flat`` into its sub-block of ``dsts[tensor_index]``.

    ``blocks`` is a block table (see the module docstring) or a list of its rows. Destinations are 1-D (addressed
    as ``[n, 1]``) or 2-D with any strides; values are cast to each destination's dtype.
    """
    dsts, table = list(dsts), _as_blocks(blocks)
    if _use_native(flat.device):
        _check_blocks("scatter_blocks", "dsts", flat, dsts, table)
        torch.ops.megatron_hybrid.scatter_blocks(flat, dsts, table)
    else:
        scatter_blocks_reference(flat, dsts, table)


def gather_blocks(srcs: Sequence[torch.Tensor], flat: torch.Tensor,
                  blocks: torch.Tensor | Sequence[Sequence[int]]) -> None:
    """Inverse of :func:`scatter_blocks`: copy sub-blocks of ``srcs`` into contiguous blocks of ``flat``."""
    srcs, table = list(srcs), _as_blocks(blocks)
    if _use_native(flat.device):
        _check_blocks("gather_blocks", "srcs", flat, srcs, table)
        torch.ops.megatron_hybrid.gather_blocks(srcs, flat, table)
    else:
        gather_blocks_reference(srcs, flat, table)


# ---------------------------------------------------------------------------------------------------------------
# Block planners: pure functions from layouts to block tables (no tensors touched)


def as_2d_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The ``[rows, cols]`` view under which block tables address a tensor: ``[shape[0], prod(shape[1:])]``."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        return 1, 1
    return shape[0], math.prod(shape[1:])


def _table(rows: list[tuple[int, int, int, int, int, int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, len(BLOCK_FIELDS))


def plan_stack(shard_shape: Sequence[int], flat_offsets: Sequence[int], *, partition_dim: int,
               partition_stride: int = 1, dst_index: int = 0) -> torch.Tensor:
    """Blocks that assemble ``k = len(flat_offsets)`` shards into one destination, as ``torch.cat(dim=...)`` would.

    Shard ``j`` is stored row-major (``shard_shape``) at ``flat[flat_offsets[j]:]``. With ``partition_dim=0`` the
    destination is ``[k * shape[0], ...]`` (column-parallel weights, their biases, embeddings); with
    ``partition_dim=1`` it is ``[shape[0], k * shape[1], ...]`` (row-parallel weights).

    ``partition_stride=s > 1`` is Megatron's strided partitioning on dim 0 (gated MLP ``linear_fc1`` keeps
    ``[gate_r; up_r]`` per TP rank, s=2): each shard is ``s`` equal row chunks and the destination is
    ``[chunk 0 of every shard; chunk 1 of every shard; ...]``. Stacking the shards of a contiguous run of TP ranks
    gives the rank of a smaller TP degree in the same layout (or the full ``[gate; up]`` for all ranks).
    """
    rows, cols = as_2d_shape(shard_shape)
    ndim = len(shard_shape)
    dim = partition_dim + ndim if partition_dim < 0 else partition_dim
    if dim not in (0, 1) or dim >= max(ndim, 1):
        raise ValueError(f"plan_stack: partition_dim must be 0 or 1 (and < ndim={ndim}), got {partition_dim}")
    if partition_stride < 1:
        raise ValueError(f"plan_stack: partition_stride must be >= 1, got {partition_stride}")
    if partition_stride > 1 and dim != 0:
        raise ValueError(f"plan_stack: partition_stride={partition_stride} is supported on dim 0 only, got "
                         f"partition_dim={partition_dim}")
    if rows % partition_stride:
        raise ValueError(f"plan_stack: shard rows {rows} are not divisible by partition_stride={partition_stride}")
    k = len(flat_offsets)
    if dim == 1:
        shard_cols = cols
        return _table([(dst_index, int(off), rows, shard_cols, 0, j * shard_cols)
                       for j, off in enumerate(flat_offsets)])
    chunk = rows // partition_stride
    return _table([(dst_index, int(off) + i * chunk * cols, chunk, cols, (i * k + j) * chunk, 0)
                   for j, off in enumerate(flat_offsets) for i in range(partition_stride)])


def plan_vocab(shard_shape: Sequence[int], flat_offsets: Sequence[int], *, vocab_size: int, dst_row0: int = 0,
               dst_rows: int | None = None, dst_index: int = 0) -> torch.Tensor:
    """Blocks that move the real rows of vocab-parallel shards, skipping vocabulary padding.

    Shard ``j`` (``shard_shape = [R, ...]``, stored at ``flat[flat_offsets[j]:]``) holds global vocabulary rows
    ``[j * R, (j + 1) * R)`` of a table padded past ``vocab_size`` (Megatron pads to a multiple of
    ``make_vocab_size_divisible_by * tp``). The destination holds global rows ``[dst_row0, dst_row0 + dst_rows)``
    (default: all real rows, i.e. the unpadded ``[vocab_size, ...]`` table for export); it may be a shard of a
    differently padded layout (another TP degree: ``dst_row0 = rank * rows_per_rank``).

    Rows ``>= vocab_size`` are never copied, in either direction: padding rows of the destination are left as they
    are (allocate it with zeros once; padded logits are masked anyway), padding rows of the sources are skipped.
    Used with :func:`gather_blocks`, the same table writes an unpadded table back into padded shards.
    """
    shard_rows, cols = as_2d_shape(shard_shape)
    if dst_rows is None:
        dst_rows = vocab_size - dst_row0
    if vocab_size < 0 or dst_row0 < 0 or dst_rows < 0:
        raise ValueError(f"plan_vocab: vocab_size={vocab_size}, dst_row0={dst_row0} and dst_rows={dst_rows} must "
                         "be >= 0")
    hi_limit = min(vocab_size, dst_row0 + dst_rows)
    rows: list[tuple[int, int, int, int, int, int]] = []
    for j, off in enumerate(flat_offsets):
        lo, hi = max(j * shard_rows, dst_row0), min((j + 1) * shard_rows, hi_limit)
        if hi > lo:
            rows.append((dst_index, int(off) + (lo - j * shard_rows) * cols, hi - lo, cols, lo - dst_row0, 0))
    return _table(rows)


def plan_qkv_split(flat_offsets: Sequence[int], *, num_heads: int, num_query_groups: int, head_dim: int,
                   cols: int, dst_indices: tuple[int, int, int] = (0, 1, 2)) -> torch.Tensor:
    """Blocks that split Megatron's fused, group-interleaved QKV into separate q, k and v tensors (HF layout).

    ``k = len(flat_offsets)`` TP shards of ``linear_qkv`` (weight: ``cols`` = hidden size; bias: ``cols=1``) are
    stored at ``flat_offsets``; shard ``j`` holds query groups ``[j * ng/k, (j + 1) * ng/k)``, each as
    ``nh/ng`` query heads, then one key head, then one value head, ``head_dim`` rows per head. The destinations
    (``dst_indices`` for q, k, v) are ``[nh * head_dim, cols]``, ``[ng * head_dim, cols]``, ``[ng * head_dim, cols]``.
    """
    nh, ng, d = num_heads, num_query_groups, head_dim
    k = len(flat_offsets)
    if nh % ng:
        raise ValueError(f"plan_qkv_split: num_heads={nh} is not divisible by num_query_groups={ng}")
    if k == 0 or ng % k:
        raise ValueError(f"plan_qkv_split: num_query_groups={ng} is not divisible by the number of shards {k}")
    heads_per_group = nh // ng
    group_rows = (heads_per_group + 2) * d
    q_index, k_index, v_index = dst_indices
    rows: list[tuple[int, int, int, int, int, int]] = []
    for j, off in enumerate(flat_offsets):
        for local in range(ng // k):
            g = j * (ng // k) + local
            base = int(off) + local * group_rows * cols
            q_rows = heads_per_group * d
            rows.append((q_index, base, q_rows, cols, g * q_rows, 0))
            rows.append((k_index, base + q_rows * cols, d, cols, g * d, 0))
            rows.append((v_index, base + (q_rows + d) * cols, d, cols, g * d, 0))
    return _table(rows)


# The extension's schema names this module (set_python_module) as the home of its fake kernels: if the extension
# was imported first, register them now.
if "megatron_hybrid.kernels._C" in sys.modules:
    _load_extension()
