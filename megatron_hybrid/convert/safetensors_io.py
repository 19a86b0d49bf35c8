"""Safetensors files, read lazily and written as a stream.

Reading is positioned ``read``s of whole row ranges into fresh buffers (:class:`TensorReader`). Not
``safetensors.safe_open``: its tensors are views of a memory map, and every page a conversion touches then stays
in the process's resident set until the file is closed (measured: converting a 2.5 GB checkpoint peaked at
2.6 GB RSS that way, against the 0.3 GB baseline). Before a file is used its header is checked against its size,
so a truncated download fails with the file's name, not deep inside a conversion.

Writing is our own: ``safetensors.save_file`` wants every tensor in memory at once, but the format is only
``[8-byte little-endian header length][JSON header][raw C-order bytes]``, so once the shapes are known the header
can be written first and the tensors streamed after it, band by band. The files are ordinary safetensors files
(the tests read them with ``safetensors.torch.load_file`` and transformers).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import torch

if TYPE_CHECKING:
    from .virtual import Virtual


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
    """The tensors a safetensors file holds, after checking that the file is as long as its header says."""
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
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(s) for s in entry["shape"])
            begin, stop = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: bad header entry for {name!r}: {entry!r}") from None
        if stop - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"{path}: {name} is {entry['dtype']}{list(shape)} but spans {stop - begin} bytes")
        infos[name] = TensorInfo(dtype, shape, 8 + n + begin)
        end = max(end, stop)
    if 8 + n + end > size:
        raise CheckpointError(f"{path} is truncated: its header describes {8 + n + end} bytes, the file has {size}")
    return infos


class TensorReader:
    """Reads row ranges of stored tensors with positioned reads (no memory map), one descriptor per file."""

    def __init__(self) -> None:
        self._files: dict[str, tuple[int, dict[str, TensorInfo]]] = {}

    def info(self, path: str, name: str) -> TensorInfo:
        return self._open(path)[1][name]

    def _open(self, path: str) -> tuple[int, dict[str, TensorInfo]]:
        entry = self._files.get(path)
        if entry is None:
            entry = self._files[path] = (os.open(path, os.O_RDONLY), read_header(path))
        return entry

    def read(self, path: str, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """``stored[index]``, where ``index`` has one ``slice`` (step 1) per dim. Reads the whole rows of
        ``index[0]`` and returns a view of the rest."""
        fd, infos = self._open(path)
        info = infos[name]
        start, stop, _ = index[0].indices(info.shape[0])
        row_bytes = math.prod(info.shape[1:]) * info.dtype.itemsize
        buf = bytearray((stop - start) * row_bytes)
        if not buf:
            return torch.empty((0, *info.shape[1:]), dtype=info.dtype)[(slice(None), *index[1:])]
        view, pos = memoryview(buf), info.offset + start * row_bytes
        while view:
            try:
                n = os.preadv(fd, [view], pos)
            except OSError as e:  # preadv names no file; the caller must tell a failed read from a failed write
                raise OSError(e.errno, e.strerror, path) from e
            if n == 0:
                raise CheckpointError(f"{path} ended while reading {name}")
            view, pos = view[n:], pos + n
        rows = torch.frombuffer(buf, dtype=info.dtype).view(stop - start, *info.shape[1:])
        return rows[(slice(None), *index[1:])]

    def close(self) -> None:
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, "Virtual"], reader: TensorReader, *,
                      metadata: Optional[dict[str, str]] = None,
                      progress: Optional[Callable[[int], None]] = None) -> None:
    """Write ``tensors`` to a new safetensors file, reading each one band by band (memory: one band)."""
    from .virtual import iter_bands

    # Like safetensors: larger elements first, so that every tensor starts aligned to its element size.
    order = sorted(tensors, key=lambda k: (-tensors[k].dtype.itemsize, k))
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name in order:
        v = tensors[name]
        header[name] = {"dtype": DTYPE_NAMES[v.dtype], "shape": list(v.shape),
                        "data_offsets": [offset, offset + v.nbytes]}
        offset += v.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data then starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in order:
            for band in iter_bands(tensors[name], reader):
                f.write(band)
                if progress is not None:
                    progress(len(band))
