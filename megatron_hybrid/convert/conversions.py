"""The two conversions, Hugging Face → Megatron and back, each planned and checked in full before writing.

Output goes to a hidden ``.<name>.partial-<host>-<pid>-<random>`` directory next to the target and is renamed onto
it at the end; on any failure (an exception or Ctrl-C) the partial directory is removed. An existing target is
replaced only with ``force=True``. A killed process cannot clean up: the next conversion to the same target removes
the partial directories of writers that are gone (:func:`remove_stale_partials`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import tempfile
import warnings
from pathlib import Path
from typing import Iterator, Optional

from ..megatron.models import GPTArchitecture
from . import hf_checkpoint as hfc
from .families import architecture_from_hf, family_of, hf_config_from_architecture, hf_from_megatron, infer_family
from .families import megatron_from_hf
from .layout import (ASSETS_DIR, CheckpointMeta, MegatronCheckpoint, check_parallel_sizes, json_ready, megatron_lm_args,
                     rank_files, rank_tensors, write_meta)
from .safetensors_io import CheckpointError, TensorReader
from .safetensors_writer import write_safetensors

#: As ``save_pretrained``'s historical default.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


@contextlib.contextmanager
def staged_directory(target: Path, *, force: bool, keep_clear_of: tuple[Path, ...] = ()) -> Iterator[Path]:
    """A fresh directory that becomes ``target`` when the block succeeds and vanishes when it fails.

    An ``OSError`` of the output (a full disk, a read-only or missing parent) names ``target`` or the file under
    it, not the hidden partial directory the user never asked for.
    """
    target = Path(os.path.abspath(target))
    for other in keep_clear_of:
        other = Path(os.path.abspath(other))
        if target == other or target in other.parents:
            raise CheckpointError(f"the output {target} would overwrite the input {other}")
    if (target.exists() or target.is_symlink()) and not force:
        raise CheckpointError(f"{target} exists; pass --force to overwrite it")
    created = [p for p in [target.parent, *target.parent.parents] if not p.exists()]
    remove_stale_partials(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=_staging_prefix(target, "partial"), dir=target.parent))
    except OSError as e:
        _remove_dirs(created)
        raise OSError(e.errno, e.strerror, str(target)) from e
    try:
        yield tmp
        old = None
        if target.exists() or target.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=_staging_prefix(target, "old"), dir=target.parent))
            os.replace(target, old / "x")
        os.replace(tmp, target)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_dirs(created)
        renamed = _named_as_output(e, tmp, target) if isinstance(e, OSError) and e.errno is not None else e
        if renamed is not e:
            raise renamed from e
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# Which process writes a staging directory is in its name, set atomically by mkdtemp (a file inside would leave a
# window in which a killed writer's directory has no owner). The host: on a shared file system a PID says nothing
# about another machine's processes. Characters outside [A-Za-z0-9-] are spelled "_", so that the name cannot run
# into another target's (".mg" vs ".mg.partial-…": a dot never appears in the host part).
_HOST = re.sub(r"[^A-Za-z0-9-]", "_", socket.gethostname())


def _staging_prefix(target: Path, kind: str) -> str:
    return f".{target.name}.{kind}-{_HOST}-{os.getpid()}-"


def remove_stale_partials(target: Path) -> None:
    """Remove the staging directories that conversions to ``target`` left when they were killed: those named as
    this module names them (:func:`_staging_prefix`) whose process, on this host, is gone. Not reused: which of
    their files are whole is unknown, and rewriting them costs no more than checking them.

    A live PID keeps its directory, even when the PID was reused by an unrelated process after the writer died
    (a leak, never the loss of a running conversion's output). Another host's directories are kept, with a
    warning. ``.old-*`` directories (the previous output, set aside while it is replaced) go only once ``target``
    exists again: if a writer died between its two renames, that is the only copy left.
    """
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(partial|old)-([A-Za-z0-9_-]*)-([0-9]+)-[a-z0-9_]+")
    try:
        entries = list(os.scandir(target.parent))
    except OSError:  # the conversion reports an unusable parent when it creates its own directory
        return
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None or not entry.is_dir(follow_symlinks=False):
            continue
        kind, host, pid = m.group(1), m.group(2), int(m.group(3))
        if host != _HOST:
            warnings.warn(f"left {entry.path} alone: it may belong to a conversion still running on {host} "
                          f"(process {pid}); delete it if none is", stacklevel=2)
        elif not _alive(pid) and (kind == "partial" or target.exists()):
            shutil.rmtree(entry.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except (ProcessLookupError, OverflowError):  # OverflowError: a number no PID can be
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_dirs(created: list[Path]) -> None:
    for p in created:  # innermost first
        with contextlib.suppress(OSError):
            p.rmdir()


def _named_as_output(e: OSError, tmp: Path, target: Path) -> OSError:
    """``e`` naming the output instead of the partial directory; errors of input files (which name them) stay."""
    for name in (e.filename2, e.filename):  # shutil's copies name the source first, the destination second
        if name is not None:
            path = Path(os.fsdecode(name))
            if path == tmp or tmp in path.parents:
                return OSError(e.errno, e.strerror, str(target / path.relative_to(tmp)))
    # write() names no file; a copy that fills the disk names its source.
    if e.filename is None or e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return OSError(e.errno, e.strerror, str(target))
    return e


def describe_os_error(e: OSError, *, output: str | os.PathLike | None = None) -> str:
    """One line for an ``OSError`` of a conversion: which file could not be read, or which ``output`` could not be
    written, and why."""
    if e.filename is None:
        return str(e)
    name = os.path.abspath(os.fsdecode(e.filename))
    out = os.path.abspath(output) if output is not None else None
    writing = out is not None and (name == out or name.startswith(out + os.sep))
    return f"cannot {'write' if writing else 'read'} {name}: {e.strerror or e}"


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled)


def hf_to_megatron(hf_dir: str | os.PathLike, megatron_dir: str | os.PathLike, *, tensor_model_parallel_size: int = 1,
                   pipeline_model_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                   expert_tensor_parallel_size: Optional[int] = None, transformer_impl: str = "local",
                   make_vocab_size_divisible_by: int = 128, allow_non_finite: bool = False, force: bool = False,
                   progress: bool = True) -> GPTArchitecture:
    """Convert a Hugging Face checkpoint directory into a Megatron checkpoint for the given TP/PP, and for a
    mixture of experts EP/ETP (expert parallel, expert tensor parallel; ETP default: TP).

    Returns the architecture. Raises :class:`CheckpointError` (a ``ValueError``) before writing anything when
    the input or the request is unusable. Every weight is checked as it is read: a NaN or ±inf (which a Hugging
    Face file has no digest to tell from damage) is a ``CheckpointError`` naming the tensor and the file, and
    the output is not written, unless ``allow_non_finite``.
    """
    hf_dir, out = Path(hf_dir), Path(megatron_dir)
    tp, pp, ep = tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size
    etp = expert_tensor_parallel_size or tp
    if not hf_dir.is_dir():
        raise CheckpointError(f"{hf_dir} is not a directory")
    if (out.exists() or out.is_symlink()) and not force:
        raise CheckpointError(f"{out} exists; pass --force to overwrite it")
    raw_config, config = hfc.read_config(hf_dir)
    stored = hfc.open_weights(hf_dir)
    embedding = stored.get("model.embed_tokens.weight")
    family, arch = architecture_from_hf(config, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                        fallback_dtype=embedding.dtype if embedding is not None else None)
    check_parallel_sizes(arch, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    hf = hfc.check_tensors(family, arch, stored, hf_dir)
    full = megatron_from_hf(family, arch, hf, padded_vocab_size=arch.padded_vocab_size(tp))
    files = {f.path: rank_tensors(full, arch, f, tp_size=tp, pp_size=pp, ep_size=ep, etp_size=etp,
                                  transformer_impl=transformer_impl)
             for f in rank_files(tp=tp, pp=pp, ep=ep, etp=etp, moe=arch.num_experts is not None)}
    moe = arch.num_experts is not None
    meta = CheckpointMeta(architecture=arch, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          expert_model_parallel_size=ep, expert_tensor_parallel_size=etp if moe else None,
                          transformer_impl=transformer_impl, hf_model_type=family.model_type,
                          hf_config=json_ready(raw_config),
                          megatron_lm_args=megatron_lm_args(arch, tensor_model_parallel_size=tp,
                                                            pipeline_model_parallel_size=pp,
                                                            expert_model_parallel_size=ep,
                                                            expert_tensor_parallel_size=etp,
                                                            transformer_impl=transformer_impl))
    total = sum(v.nbytes for tensors in files.values() for v in tensors.values())
    digests = {}
    with staged_directory(out, force=force, keep_clear_of=(hf_dir,)) as tmp, \
            TensorReader(check_finite=not allow_non_finite) as reader, \
            _progress(total, f"{hf_dir.name} → Megatron TP{tp} PP{pp}" + f" EP{ep} ETP{etp}" * moe, progress) as bar:
        for name, tensors in files.items():
            (tmp / name).parent.mkdir(parents=True)
            digests[name] = write_safetensors(tmp / name, tensors, reader, progress=bar.update)
        hfc.copy_assets(hf_dir, tmp / ASSETS_DIR)
        write_meta(tmp, meta, digests=digests)
    return arch


def megatron_to_hf(megatron_dir: str | os.PathLike, hf_dir: str | os.PathLike, *, model_type: Optional[str] = None,
                   max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, force: bool = False,
                   progress: bool = True) -> GPTArchitecture:
    """Convert a Megatron checkpoint (as written by :func:`hf_to_megatron`) into a Hugging Face directory.

    The Hugging Face config is the one the checkpoint was converted from, or else one made from the stored
    architecture for ``model_type`` (default: the stored family, else inferred from the architecture). Every file
    is checked against its digest first (:class:`~.layout.MegatronCheckpoint`).
    """
    src, out = Path(megatron_dir), Path(hf_dir)
    if max_shard_bytes < 1:
        raise CheckpointError(f"max_shard_bytes ({max_shard_bytes}) must be ≥ 1")
    if (out.exists() or out.is_symlink()) and not force:
        raise CheckpointError(f"{out} exists; pass --force to overwrite it")
    ckpt = MegatronCheckpoint(src)
    arch, meta = ckpt.architecture, ckpt.meta
    family = family_of(model_type or meta.hf_model_type or infer_family(arch).model_type)
    if meta.hf_config is not None and meta.hf_model_type == family.model_type:
        config = meta.hf_config
    else:
        config = json_ready(hf_config_from_architecture(arch, family))
    tensors = hf_from_megatron(family, arch, ckpt.tensors)
    shards = hfc.shard_files(tensors, max_shard_bytes)
    names = ([hfc.SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    total = sum(v.nbytes for v in tensors.values())
    with staged_directory(out, force=force, keep_clear_of=(src,)) as tmp, TensorReader() as reader, \
            _progress(total, f"{src.name} → Hugging Face", progress) as bar:
        if (src / ASSETS_DIR).is_dir():
            hfc.copy_assets(src / ASSETS_DIR, tmp)
        (tmp / hfc.CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name, shard in zip(names, shards):
            write_safetensors(tmp / name, shard, reader, progress=bar.update)
        if len(shards) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {t: name for name, shard in zip(names, shards) for t in shard}}
            (tmp / hfc.INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return arch
