"""Safetensors files written as a stream.

``safetensors.save_file`` wants every tensor in memory at once, but the format is only
``[8-byte little-endian header length][JSON header][raw C-order bytes]``, so once the shapes are known the header
can be written first and the tensors streamed after it, band by band (read through :mod:`.virtual`). The files are
ordinary safetensors files (the tests read them with ``safetensors.torch.load_file`` and transformers).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable, Mapping, Optional

from .digests import ALGORITHM
from .safetensors_io import DTYPE_NAMES, TensorReader
from .virtual import Virtual, iter_bands


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, Virtual], reader: TensorReader, *,
                      metadata: Optional[dict[str, str]] = None,
                      progress: Optional[Callable[[int], None]] = None) -> str:
    """Write ``tensors`` to a new safetensors file, reading each one band by band (memory: one band). Returns the
    file's digest (see :mod:`.digests`), computed from the bytes as they are written."""
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
    digest = hashlib.new(ALGORITHM)
    with open(path, "wb") as f:
        for chunk in (len(raw).to_bytes(8, "little"), raw):
            f.write(chunk)
            digest.update(chunk)
        for name in order:
            for band in iter_bands(tensors[name], reader):
                f.write(band)
                digest.update(band)
                if progress is not None:
                    progress(len(band))
    return f"{ALGORITHM}:{digest.hexdigest()}"
