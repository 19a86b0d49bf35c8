"""Virtual tensors: a tensor described as rectangles of tensors stored in safetensors files, read lazily.

Every conversion is a rearrangement of stored numbers: the fused QKV is row blocks of q/k/v, a TP shard is a
slice, the padded vocabulary is rows plus zeros. So a converted tensor is planned as a :class:`Virtual` (shape,
dtype and the rectangles it copies from which file tensor) without reading anything, and read later in bands of
rows (:func:`iter_bands`, :func:`read_into`): peak memory is a band, never a whole tensor. Regions no piece covers
are zeros (the vocabulary padding).

Legend: ``dst`` an offset in the virtual tensor, ``src`` an offset in the stored tensor, one entry per dim (after
the piece's ``lead``: the fixed leading indices of a stored tensor that has more dims, e.g. one expert of a fused
``[experts, rows, cols]`` tensor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import torch

from ..megatron.sharding import TPSpec
from .safetensors_io import TensorReader

#: Bytes per band when reading a tensor. Small enough to be noise next to the Python/torch baseline, large enough
#: that the per-band overhead does not show.
BAND_BYTES = 16 << 20


@dataclass(frozen=True)
class Source:
    """A tensor in a safetensors file."""

    path: str
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Piece:
    """``virtual[dst : dst + shape] = stored(source)[*lead, src : src + shape]`` (per dim)."""

    source: Source
    dst: tuple[int, ...]
    src: tuple[int, ...]
    shape: tuple[int, ...]
    lead: tuple[int, ...] = ()


@dataclass(frozen=True)
class Virtual:
    """A tensor that is a zero-filled ``shape`` with stored rectangles (``pieces``, disjoint) copied in."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...] = ()

    @classmethod
    def stored(cls, path: str, name: str, shape: Sequence[int], dtype: torch.dtype) -> "Virtual":
        """The whole of a stored tensor."""
        shape = tuple(int(s) for s in shape)
        origin = (0,) * len(shape)
        return cls(shape, dtype, (Piece(Source(path, name, shape, dtype), origin, origin, shape),))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def narrow(self, dim: int, start: int, length: int) -> "Virtual":
        """``tensor.narrow(dim, start, length)``."""
        assert 0 <= start and start + length <= self.shape[dim], (self.shape, dim, start, length)
        pieces = []
        for p in self.pieces:
            lo, hi = max(p.dst[dim], start), min(p.dst[dim] + p.shape[dim], start + length)
            if lo < hi:
                pieces.append(Piece(p.source, _set(p.dst, dim, lo - start),
                                    _set(p.src, dim, p.src[dim] + lo - p.dst[dim]), _set(p.shape, dim, hi - lo),
                                    p.lead))
        return Virtual(_set(self.shape, dim, length), self.dtype, tuple(pieces))

    def select(self, index: int) -> "Virtual":
        """``tensor[index]``: dim 0 dropped (one expert of a fused ``[experts, …]`` tensor)."""
        assert 0 <= index < self.shape[0], (self.shape, index)
        pieces = [Piece(p.source, p.dst[1:], p.src[1:], p.shape[1:], p.lead + (p.src[0] + index - p.dst[0],))
                  for p in self.pieces if p.dst[0] <= index < p.dst[0] + p.shape[0]]
        return Virtual(self.shape[1:], self.dtype, tuple(pieces))

    def chunk(self, num_chunks: int, dim: int) -> list["Virtual"]:
        """``tensor.chunk(num_chunks, dim)`` for a size that ``num_chunks`` divides."""
        size = self.shape[dim]
        if size % num_chunks:
            raise ValueError(f"dimension {dim} of size {size} does not split into {num_chunks} equal pieces")
        n = size // num_chunks
        return [self.narrow(dim, i * n, n) for i in range(num_chunks)]

    def pad(self, dim: int, length: int) -> "Virtual":
        """Append ``length`` zeros along ``dim``."""
        return replace(self, shape=_set(self.shape, dim, self.shape[dim] + length))

    @staticmethod
    def cat(parts: Sequence["Virtual"], dim: int) -> "Virtual":
        """``torch.cat(parts, dim)``."""
        first = parts[0]
        pieces, offset = [], 0
        for part in parts:
            if part.dtype != first.dtype or _set(part.shape, dim, 0) != _set(first.shape, dim, 0):
                raise ValueError(f"cannot concatenate {part.dtype}{list(part.shape)} to {first.dtype}"
                                 f"{list(first.shape)} along dim {dim}")
            pieces += [replace(p, dst=_set(p.dst, dim, p.dst[dim] + offset)) for p in part.pieces]
            offset += part.shape[dim]
        return Virtual(_set(first.shape, dim, offset), first.dtype, tuple(pieces))


def _set(t: tuple[int, ...], i: int, value: int) -> tuple[int, ...]:
    return t[:i] + (value,) + t[i + 1:]


def shard(full: Virtual, spec: TPSpec, rank: int, world_size: int) -> Virtual:
    """Rank ``rank``'s shard: the same arithmetic as :func:`megatron_hybrid.megatron.sharding.shard`, on a virtual
    tensor."""
    if not spec.sharded or world_size == 1:
        return full
    pieces = full.chunk(spec.stride * world_size, spec.dim)
    return Virtual.cat([pieces[rank + j * world_size] for j in range(spec.stride)], spec.dim)


def unshard(shards: Sequence[Virtual], spec: TPSpec) -> Virtual:
    """The full tensor from all ranks' shards (inverse of :func:`shard`)."""
    if not spec.sharded or len(shards) == 1:
        return shards[0]
    world = len(shards)
    per_rank = [s.chunk(spec.stride, spec.dim) for s in shards]
    return Virtual.cat([per_rank[r][j] for j in range(spec.stride) for r in range(world)], spec.dim)


def _band_rows(v: Virtual, band_bytes: int) -> int:
    row_bytes = math.prod(v.shape[1:]) * v.dtype.itemsize
    for p in v.pieces:  # a piece is read as whole stored rows, then cut
        row_bytes = max(row_bytes, math.prod(p.source.shape[len(p.lead) + 1:]) * p.source.dtype.itemsize)
    return max(1, band_bytes // max(row_bytes, 1))


def read_rows(v: Virtual, out: torch.Tensor, row_start: int, reader: TensorReader) -> None:
    """Fill ``out`` with rows ``[row_start, row_start + len(out))`` of ``v`` (dim 0 is the row)."""
    rows = out.shape[0]
    covered = 0
    for p in v.pieces:
        lo, hi = max(p.dst[0], row_start), min(p.dst[0] + p.shape[0], row_start + rows)
        if lo >= hi:
            continue
        src_index = p.lead + (slice(p.src[0] + lo - p.dst[0], p.src[0] + hi - p.dst[0]),) + tuple(
            slice(s, s + n) for s, n in zip(p.src[1:], p.shape[1:]))
        dst_index = (slice(lo - row_start, hi - row_start),) + tuple(
            slice(d, d + n) for d, n in zip(p.dst[1:], p.shape[1:]))
        out[dst_index].copy_(reader.read(p.source.path, p.source.name, src_index))
        covered += (hi - lo) * math.prod(p.shape[1:])
    if covered != out.numel():  # pieces are disjoint, so anything less leaves uncovered (zero) elements
        _zero_uncovered(v, out, row_start)


def _zero_uncovered(v: Virtual, out: torch.Tensor, row_start: int) -> None:
    mask = torch.ones(out.shape, dtype=torch.bool)
    rows = out.shape[0]
    for p in v.pieces:
        lo, hi = max(p.dst[0], row_start), min(p.dst[0] + p.shape[0], row_start + rows)
        if lo < hi:
            mask[(slice(lo - row_start, hi - row_start),) + tuple(slice(d, d + n) for d, n in
                                                                   zip(p.dst[1:], p.shape[1:]))] = False
    out.masked_fill_(mask, 0)


def iter_bands(v: Virtual, reader: TensorReader, *, band_bytes: int = BAND_BYTES) -> Iterator[bytearray]:
    """The bytes of ``v`` (C order, its dtype), as consecutive bands of whole rows."""
    assert v.shape, "0-d tensors are not supported"
    step = _band_rows(v, band_bytes)
    row_bytes = math.prod(v.shape[1:]) * v.dtype.itemsize
    for start in range(0, v.shape[0], step):
        rows = min(step, v.shape[0] - start)
        buf = bytearray(rows * row_bytes)  # zero-filled: the padding comes for free
        if buf:
            band = torch.frombuffer(buf, dtype=v.dtype).view(rows, *v.shape[1:])
            read_rows(v, band, start, reader)
        yield buf


def read_into(v: Virtual, out: torch.Tensor, reader: TensorReader, *, band_bytes: int = BAND_BYTES) -> None:
    """Copy ``v`` into the existing tensor ``out`` (same shape; dtypes convert), one band at a time."""
    assert tuple(out.shape) == v.shape, (tuple(out.shape), v.shape)
    assert v.shape, "0-d tensors are not supported"
    step = _band_rows(v, band_bytes)
    for start in range(0, v.shape[0], step):
        read_rows(v, out.narrow(0, start, min(step, v.shape[0] - start)), start, reader)


def materialize(v: Virtual, reader: TensorReader) -> torch.Tensor:
    """The whole tensor (for small tensors and tests)."""
    out = torch.zeros(v.shape, dtype=v.dtype)
    read_into(v, out, reader)
    return out
