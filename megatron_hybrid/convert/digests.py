"""Per-file digests of a Megatron checkpoint: computed when it is written, checked whenever it is read.

A file's size is checked by its safetensors header, but bytes overwritten in place (a bad disk, a bad copy, a
stray ``dd``) keep the size and read as wrong weights: 4 KiB of 0xFF are 1,024 NaNs. The manifest written last
(``megatron_hybrid_checkpoint.json``) therefore records a ``sha256:<hex>`` digest of every other file, by its
path relative to the checkpoint directory. sha256: in hashlib, with the SHA extensions of current x86 and ARM
CPUs it hashes at 1-2 GB/s on one core, ahead of blake2b (about 0.5-1 GB/s).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Iterable, Mapping

from .safetensors_io import CheckpointError

ALGORITHM = "sha256"


# (device, inode, size, mtime, ctime) → digest, for files this process has hashed. The recipe opens its
# --pretrained-checkpoint twice per rank (while validating the arguments, then to load it): the second check of
# an unchanged file is then free. Only files untouched for a while are remembered, as git does for "racily
# clean" files: the kernel stamps writes with a coarse clock (a few ms), so a file rewritten within the same tick
# as it was hashed would keep its key.
_hashed: dict[tuple[int, ...], str] = {}
_SETTLED_NS = 2 * 10**9


def digest_of(path: Path) -> str:
    """``sha256:<hex>`` of a file's bytes, read in 256 KiB blocks."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    digest = _hashed.get(key)
    if digest is None:
        with open(path, "rb") as f:
            digest = f"{ALGORITHM}:{hashlib.file_digest(f, ALGORITHM).hexdigest()}"
        if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > _SETTLED_NS:
            _hashed[key] = digest
    return digest


def digest_files(root: Path, *, skip: Iterable[str], known: Mapping[str, str]) -> dict[str, str]:
    """The digest of every file under ``root`` (following links: an export links its tokenizer directory),
    except those in ``skip``; ``known`` gives the digests already computed while writing."""
    skipped = set(skip)
    out = {}
    for directory, _, files in os.walk(root, followlinks=True):
        for name in files:
            rel = (Path(directory) / name).relative_to(root).as_posix()
            if rel not in skipped:
                out[rel] = known[rel] if rel in known else digest_of(root / rel)
    return dict(sorted(out.items()))


def check_digests(root: Path, digests: Mapping[str, str], *, manifest: Path, required: Iterable[Path]) -> None:
    """``CheckpointError`` naming the first file under ``root`` that ``digests`` lists with another digest or
    that is missing, or a ``required`` file it does not list."""
    for path in required:
        if path.relative_to(root).as_posix() not in digests:
            raise CheckpointError(f"{path}: has no digest in {manifest}: the manifest was edited or belongs to "
                                  "another checkpoint")
    for rel, expected in digests.items():
        path = root / rel
        if not path.is_file():
            raise CheckpointError(f"{path}: missing, but listed in {manifest}")
        if not expected.startswith(f"{ALGORITHM}:"):
            raise CheckpointError(f"{path}: {manifest} records its digest as {expected!r}, not {ALGORITHM}:<hex>")
        actual = digest_of(path)
        if actual != expected:
            raise CheckpointError(f"{path}: does not match the {ALGORITHM} recorded in {manifest} (the file is "
                                  f"damaged or was changed after it was written; convert it again)")
