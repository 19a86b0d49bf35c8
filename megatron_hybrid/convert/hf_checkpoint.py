"""A Hugging Face model directory: its config, its (possibly sharded) safetensors weights, its other files.

Everything is checked before a conversion writes anything: the config's family and features, every shard file
named by ``model.safetensors.index.json`` (present, header consistent with itself and with the file size), and
the tensor names and shapes against what the config implies. The values, which no digest vouches for, are checked
as they are read (finite, unless allowed).
"""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path
from typing import Any

from ..megatron.models import GPTArchitecture
from .families import FUSED_EXPERTS, Family, family_of, hf_shapes, per_expert_tensors
from .safetensors_io import CheckpointError, read_header, read_json_object
from .virtual import Virtual

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_SKIPPED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # a buffer some older exports saved; recomputed on load
_MAX_LISTED = 20


def read_config(hf_dir: Path) -> tuple[dict, Any]:
    """``config.json`` as stored, and as a transformers config object (which supplies the class defaults)."""
    path = hf_dir / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{hf_dir} has no {CONFIG_FILE}")
    raw = read_json_object(path)
    family_of(raw.get("model_type"))  # an unsupported family fails here, with its name
    from transformers import AutoConfig

    return raw, AutoConfig.from_pretrained(str(hf_dir))


def open_weights(hf_dir: Path) -> dict[str, Virtual]:
    """Every stored tensor, as a lazily read :class:`Virtual`; checks every shard file first."""
    index = hf_dir / INDEX_FILE
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index} has no \"weight_map\" object (tensor name → shard file name)")
        files = sorted(set(weight_map.values()))
    elif (hf_dir / SINGLE_FILE).is_file():
        weight_map, files = {}, [SINGLE_FILE]
    else:
        others = sorted(p.name for p in hf_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" (found {others}: re-save with save_pretrained(safe_serialization=True))" if others else ""
        raise CheckpointError(f"{hf_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")
    missing = [f for f in files if not (hf_dir / f).is_file()]
    if missing:
        raise CheckpointError(f"{hf_dir}: shard files listed in {INDEX_FILE} are missing: {missing}")
    tensors: dict[str, Virtual] = {}
    for f in files:
        path = hf_dir / f
        for name, info in read_header(path).items():
            if name in tensors:
                raise CheckpointError(f"{hf_dir}: tensor {name} is stored twice (in "
                                      f"{tensors[name].pieces[0].source.path} and {path})")
            tensors[name] = Virtual.stored(str(path), name, info.shape, info.dtype)
    absent = sorted(n for n, f in weight_map.items() if n not in tensors)
    if absent:
        raise CheckpointError(f"{hf_dir}: {INDEX_FILE} lists tensors its shard files do not hold: {_some(absent)}")
    return tensors


def check_tensors(family: Family, arch: GPTArchitecture, tensors: dict[str, Virtual],
                  where: Path) -> dict[str, Virtual]:
    """The tensors the model uses, after checking that all are present with the shapes the config implies; experts
    one tensor each, whether stored so or fused (:func:`~.families.per_expert_tensors`)."""
    present = {n: v for n, v in tensors.items() if not _SKIPPED.search(n)}
    expected = hf_shapes(family, arch, fused_experts=any(FUSED_EXPERTS.match(n) for n in present))
    if not arch.untie_embeddings_and_output_weights and "lm_head.weight" in present:
        warnings.warn(f"{where}: tie_word_embeddings is set but lm_head.weight is stored; using the embedding and "
                      f"ignoring lm_head.weight", stacklevel=2)
        del present["lm_head.weight"]
    missing = sorted(set(expected) - set(present), key=natural_key)
    unexpected = sorted(set(present) - set(expected), key=natural_key)
    wrong = [f"{n} {list(present[n].shape)} (expected {list(s)})" for n, s in expected.items()
             if n in present and present[n].shape != s]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_some(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors (the converter would drop them): {_some(unexpected)}")
    if wrong:
        problems.append(f"tensors whose shapes do not match config.json: {_some(wrong)}")
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))
    dtypes = {v.dtype for v in present.values()}
    if len(dtypes) > 1:
        warnings.warn(f"{where}: tensors are stored in several dtypes ({sorted(map(str, dtypes))}); each is kept "
                      f"as stored", stacklevel=2)
    return per_expert_tensors(present)


def _some(names: list[str]) -> str:
    more = f" … and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


def natural_key(name: str) -> list:
    """Sort ``layers.10`` after ``layers.9``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def copy_assets(src: Path, dst: Path) -> None:
    """Copy a model directory's non-weight files (tokenizer, generation config, …), not ``config.json``."""
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name != CONFIG_FILE and not path.name.endswith(_WEIGHT_SUFFIXES) \
                and path.name != INDEX_FILE:
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dst / path.name)


def shard_files(tensors: dict[str, Virtual], max_shard_bytes: int) -> list[dict[str, Virtual]]:
    """Split tensors (in natural order) into files of at most ``max_shard_bytes`` (a larger tensor gets its own)."""
    files: list[dict[str, Virtual]] = [{}]
    size = 0
    for name in sorted(tensors, key=natural_key):
        v = tensors[name]
        if files[-1] and size + v.nbytes > max_shard_bytes:
            files.append({})
            size = 0
        files[-1][name] = v
        size += v.nbytes
    return files
