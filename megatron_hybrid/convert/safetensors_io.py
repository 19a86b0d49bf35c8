"""Safetensors files, read lazily; the checkpoint error and the JSON checks every reader of a checkpoint shares.

Reading is positioned ``read``s of whole row ranges into fresh buffers (:class:`TensorReader`). Not
``safetensors.safe_open``: its tensors are views of a memory map, and every page a conversion touches then stays
in the process's resident set until the file is closed (measured: converting a 2.5 GB checkpoint peaked at
2.6 GB RSS that way, against the 0.3 GB baseline). Before a file is used its header is checked against its size,
so a truncated download fails with the file's name, not deep inside a conversion.

Writing, which reads its tensors through :mod:`.virtual` (itself a reader of this module), is in
:mod:`.safetensors_writer`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch


class CheckpointError(ValueError):
    """A checkpoint or a conversion request that cannot be used as it is; the message names the culprit."""


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


def json_object(data: bytes | str, *, where: str) -> dict[str, Any]:
    """``data`` parsed as a JSON object; ``CheckpointError`` naming ``where`` when it is not JSON or not an object."""
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where} is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where} must hold a JSON object, not {_JSON_TYPES.get(type(obj), type(obj).__name__)}")
    return obj


def read_json_object(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object a file holds (see :func:`json_object`)."""
    with open(path, "rb") as f:
        return json_object(f.read(), where=os.fspath(path))


DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

#: A header larger than this is not a header (safetensors itself refuses above 100 MB).
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's entry in a safetensors header."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Where the tensor's bytes start in the file."""


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """The tensors a safetensors file holds, after checking its header: valid JSON, every entry a known dtype with
    a shape of non-negative integers and the byte range it implies, ranges that do not overlap, and a file as long
    as its header says. (We read the file with positioned reads, not with safetensors' loader, so these checks are
    ours.)"""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise CheckpointError(f"missing file: {path}") from None
    with open(path, "rb") as f:
        if size < 8:
            raise CheckpointError(f"{path} is truncated or not a safetensors file ({size} bytes)")
        n = int.from_bytes(f.read(8), "little")
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path} is truncated or not a safetensors file: its header claims {n} bytes, "
                                  f"the file has {size}")
        header = json_object(f.read(n), where=f"{path} is not a safetensors file: its header")
    infos: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[entry["dtype"]]
            shape, offsets = entry["shape"], entry["data_offsets"]
            if not (_naturals(shape) and _naturals(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: bad header entry for {name!r}: {entry!r}") from None
        begin, stop = offsets
        if stop - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"{path}: {name} is {entry['dtype']}{list(shape)} but spans {stop - begin} bytes")
        infos[name] = TensorInfo(dtype, tuple(shape), 8 + n + begin)
        if stop > begin:  # an empty tensor overlaps nothing
            spans.append((begin, stop, name))
    spans.sort()
    for (b0, s0, n0), (b1, s1, n1) in zip(spans, spans[1:]):
        if b1 < s0:  # two tensors would read the same bytes
            raise CheckpointError(f"{path}: {n1} (bytes [{b1}, {s1})) overlaps {n0} (bytes [{b0}, {s0})) in the "
                                  "header's data_offsets")
    end = spans[-1][1] if spans else 0
    if 8 + n + end > size:
        raise CheckpointError(f"{path} is truncated: its header describes {8 + n + end} bytes, the file has {size}")
    return infos


def _naturals(values: Any) -> bool:
    """A JSON list of integers ≥ 0 (not booleans, not 2.0: a header that says 2.9 is damaged, not 2)."""
    return isinstance(values, list) and all(type(v) is int and v >= 0 for v in values)


class TensorReader:
    """Reads row ranges of stored tensors with positioned reads (no memory map), one descriptor per file.

    With ``check_finite``, every floating-point value read is checked: a NaN or ±inf is a :class:`CheckpointError`
    naming the tensor and the file. Streamed: one pass over data already in memory (a sum per band), not another
    read of the file.
    """

    def __init__(self, *, check_finite: bool = False) -> None:
        self._files: dict[str, tuple[int, dict[str, TensorInfo]]] = {}
        self._check_finite = check_finite

    def info(self, path: str, name: str) -> TensorInfo:
        return self._open(path)[1][name]

    def _open(self, path: str) -> tuple[int, dict[str, TensorInfo]]:
        entry = self._files.get(path)
        if entry is None:
            entry = self._files[path] = (os.open(path, os.O_RDONLY), read_header(path))
        return entry

    def read(self, path: str, name: str, index: tuple[int | slice, ...]) -> torch.Tensor:
        """``stored[index]``, where ``index`` is some ``int``s that fix leading dims (one expert of a fused
        ``[experts, …]`` tensor), then one ``slice`` (step 1) per remaining dim. Reads the whole rows of the first
        slice and returns a view of the rest."""
        fd, infos = self._open(path)
        info = infos[name]
        lead = [i for i in index if isinstance(i, int)]
        k = len(lead)
        assert index[:k] == tuple(lead) and all(isinstance(s, slice) for s in index[k:]), index
        block = info.shape[k:]  # the tensor left once the leading dims are fixed
        flat = 0
        for i, n in zip(lead, info.shape[:k]):
            assert 0 <= i < n, (name, index, info.shape)
            flat = flat * n + i
        start, stop, _ = index[k].indices(block[0])
        row_bytes = math.prod(block[1:]) * info.dtype.itemsize
        buf = bytearray((stop - start) * row_bytes)
        if not buf:
            return torch.empty((0, *block[1:]), dtype=info.dtype)[(slice(None), *index[k + 1:])]
        view, pos = memoryview(buf), info.offset + flat * block[0] * row_bytes + start * row_bytes
        while view:
            try:
                n = os.preadv(fd, [view], pos)
            except OSError as e:  # preadv names no file; the caller must tell a failed read from a failed write
                raise OSError(e.errno, e.strerror, path) from e
            if n == 0:
                raise CheckpointError(f"{path} ended while reading {name}")
            view, pos = view[n:], pos + n
        rows = torch.frombuffer(buf, dtype=info.dtype).view(stop - start, *block[1:])
        part = rows[(slice(None), *index[k + 1:])]
        if self._check_finite and info.dtype.is_floating_point:
            _check_finite(part, path, name, lead + [start] + [s.indices(n)[0] for s, n in zip(index[k + 1:],
                                                                                              block[1:])])
        return part

    def close(self) -> None:
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_finite(part: torch.Tensor, path: str, name: str, origin: list[int]) -> None:
    """``origin``: where ``part`` starts in the stored tensor, per dim."""
    if part.dtype.itemsize == 1:  # torch neither sums nor isfinite()s 8-bit floats; their values fit in float16
        part = part.to(torch.float16)
    # A sum is non-finite when any value is (NaN and ±inf propagate), or when it overflows: then the exact check
    # below finds nothing. One pass with no temporaries: isfinite() allocates three, measured +74 MiB of peak
    # memory converting a 200 MB embedding.
    if math.isfinite(part.sum().item()):
        return
    bad = ~torch.isfinite(part)
    if bad.any():
        where = tuple(bad.nonzero()[0].tolist())
        raise CheckpointError(f"{path}: {name} holds non-finite values ({int(bad.sum())} of the {part.numel()} "
                              f"values read, e.g. {part[where].item()} at {[i + o for i, o in zip(where, origin)]}); "
                              "pass --allow-non-finite (allow_non_finite=True) to convert it as it is")
