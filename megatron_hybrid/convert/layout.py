"""The Megatron-side checkpoint: Megatron-LM's per-rank directory layout, holding safetensors files.

::

    <dir>/latest_checkpointed_iteration.txt               "release", as Megatron-LM's converters write it
    <dir>/megatron_hybrid_checkpoint.json                 format, GPTArchitecture, TP/PP, names, Megatron-LM args,
                                                          the Hugging Face config it came from, and the sha256 of
                                                          every other file (written last)
    <dir>/release/mp_rank_TT[_PPP]/model.safetensors      TP rank TT / PP rank PPP's parameters, under the names
                                                          its GPTModel stage has (stage-local layer numbers)
    <dir>/hf_assets/                                      the Hugging Face directory's other files (tokenizer, …)

Each rank's file can be read (and written) as a stream, and by anyone with safetensors: no pickle. Opening a
checkpoint (:class:`MegatronCheckpoint`) checks every file against its digest (:mod:`.digests`) before any value
is used; a checkpoint written before digests existed (format version 1) is read with a warning. The TP/PP it
was written at is only the *stored* layout: :func:`load_megatron_checkpoint` reshards on the fly, so a checkpoint
loads into a GPTModel at any TP/PP (and into a local- or Transformer-Engine-spec model, whatever names it holds).

Legend: *canonical* names are the local spec's names with global layer numbers (``decoder.layers.{i}.…``).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import MISSING, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..models import GPTArchitecture
from ..sharding import TPSpec, global_name, layer_offset
from .families import EMBEDDING, OUTPUT_LAYER, hf_shapes, infer_family, megatron_from_hf
from .digests import check_digests, digest_files
from .safetensors_io import CheckpointError, TensorReader, json_object, read_header
from .virtual import Virtual, read_into, shard, unshard

META_FILE = "megatron_hybrid_checkpoint.json"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
ITERATION_DIR = "release"
WEIGHTS_FILE = "model.safetensors"
ASSETS_DIR = "hf_assets"
FORMAT = "megatron-hybrid/per-rank-safetensors"
FORMAT_VERSION = 2
#: Version 1 had no ``digests``; it is still read.
_READABLE_VERSIONS = (1, FORMAT_VERSION)
TRANSFORMER_IMPLS = ("local", "transformer_engine")

# Transformer Engine fuses the pre-attention and pre-MLP norms into the next linear layer.
_TO_TE = ((re.compile(r"\.input_layernorm\.(weight|bias)$"), r".self_attention.linear_qkv.layer_norm_\1"),
          (re.compile(r"\.pre_mlp_layernorm\.(weight|bias)$"), r".mlp.linear_fc1.layer_norm_\1"))
_FROM_TE = ((re.compile(r"\.self_attention\.linear_qkv\.layer_norm_(weight|bias)$"), r".input_layernorm.\1"),
            (re.compile(r"\.mlp\.linear_fc1\.layer_norm_(weight|bias)$"), r".pre_mlp_layernorm.\1"))


def stored_name(canonical: str, transformer_impl: str) -> str:
    """The parameter name under ``transformer_impl``'s layer spec."""
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise CheckpointError(f"transformer_impl {transformer_impl!r} must be one of {TRANSFORMER_IMPLS}")
    if transformer_impl == "local":
        return canonical
    for pattern, repl in _TO_TE:
        canonical = pattern.sub(repl, canonical)
    return canonical


def canonical_name(name: str) -> str:
    """The local-spec name of a local- or Transformer-Engine-spec parameter name."""
    for pattern, repl in _FROM_TE:
        name = pattern.sub(repl, name)
    return name


def tp_spec(canonical: str, arch: GPTArchitecture) -> TPSpec:
    """How megatron-core splits a parameter over tensor-parallel ranks (its ``partition_dim``/``_stride``)."""
    if canonical in (EMBEDDING, OUTPUT_LAYER) or canonical.endswith((".linear_qkv.weight", ".linear_qkv.bias")):
        return TPSpec(sharded=True, dim=0)
    if canonical.endswith((".linear_fc1.weight", ".linear_fc1.bias")):
        return TPSpec(sharded=True, dim=0, stride=2 if arch.swiglu else 1)  # rank r: [gate_r; up_r]
    if canonical.endswith((".linear_proj.weight", ".linear_fc2.weight")):
        return TPSpec(sharded=True, dim=1)
    return TPSpec(sharded=False)


def check_parallel_sizes(arch: GPTArchitecture, *, tensor_model_parallel_size: int,
                         pipeline_model_parallel_size: int) -> None:
    """``CheckpointError`` unless megatron-core can build ``arch`` at this TP/PP."""
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if arch.num_experts is not None:  # the families' weight maps know dense layers only: experts would be dropped
        raise CheckpointError(f"converting mixture-of-experts models (num_experts={arch.num_experts}) is not "
                              "supported yet")
    if tp < 1 or pp < 1:
        raise CheckpointError(f"parallel sizes must be ≥ 1 (tensor {tp}, pipeline {pp})")
    try:
        arch.validate(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    groups = arch.num_query_groups or arch.num_attention_heads
    if groups % tp and tp % groups:
        raise CheckpointError(f"tensor_model_parallel_size ({tp}) must be a multiple or a divisor of "
                              f"num_query_groups ({groups})")


def stage_layers(num_layers: int, pipeline_model_parallel_size: int) -> list[range]:
    """The global layer numbers of each pipeline stage (even split, as Megatron-LM's default)."""
    n = num_layers // pipeline_model_parallel_size
    return [range(p * n, (p + 1) * n) for p in range(pipeline_model_parallel_size)]


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """Megatron-LM's ``mp_rank_TT`` (no pipeline) or ``mp_rank_TT_PPP``."""
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def megatron_lm_args(arch: GPTArchitecture, *, tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
                     transformer_impl: str) -> list[str]:
    """Megatron-LM command-line flags that build this model (tokenizer and training flags not included)."""
    a = arch
    args = ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
            "--ffn-hidden-size", str(a.ffn_hidden_size or 4 * a.hidden_size),
            "--num-attention-heads", str(a.num_attention_heads)]
    if a.num_query_groups:
        args += ["--group-query-attention", "--num-query-groups", str(a.num_query_groups)]
    if a.kv_channels:
        args += ["--kv-channels", str(a.kv_channels)]
    args += ["--max-position-embeddings", str(a.max_position_embeddings),
             "--make-vocab-size-divisible-by", str(a.make_vocab_size_divisible_by),
             "--normalization", a.normalization, "--norm-epsilon", repr(a.norm_epsilon),
             "--position-embedding-type", a.position_embedding_type]
    if a.position_embedding_type == "rope":
        args += ["--rotary-base", str(a.rotary_base), "--rotary-percent", repr(a.rotary_percent)]
    if a.use_rope_scaling:
        args += ["--use-rope-scaling", "--rope-scaling-factor", repr(a.rope_scaling_factor)]
    args += ["--swiglu"] if a.swiglu else []
    args += ["--untie-embeddings-and-output-weights"] if a.untie_embeddings_and_output_weights else []
    args += [] if a.add_bias_linear else ["--disable-bias-linear"]
    args += ["--add-qkv-bias"] if a.add_qkv_bias else []
    args += ["--qk-layernorm"] if a.qk_layernorm else []
    args += {"bfloat16": ["--bf16"], "float16": ["--fp16"]}.get(a.params_dtype, [])
    args += ["--attention-dropout", "0.0", "--hidden-dropout", "0.0",
             "--tensor-model-parallel-size", str(tensor_model_parallel_size),
             "--pipeline-model-parallel-size", str(pipeline_model_parallel_size),
             "--transformer-impl", transformer_impl, "--ckpt-format", "torch", "--vocab-size", str(a.vocab_size)]
    return args


@dataclass
class CheckpointMeta:
    """``megatron_hybrid_checkpoint.json``."""

    architecture: GPTArchitecture
    """The model, in Megatron-LM's terms."""
    tensor_model_parallel_size: int
    """The TP size the files are split for (loading may use another)."""
    pipeline_model_parallel_size: int
    """The PP size the files are split for (loading may use another)."""
    transformer_impl: str = "local"
    """Whose parameter names the files use: ``local`` or ``transformer_engine``."""
    hf_model_type: Optional[str] = None
    """The Hugging Face family (``llama``, ``qwen2``, …) to export to."""
    hf_config: Optional[dict] = None
    """The Hugging Face ``config.json`` the checkpoint was converted from, written back on export."""
    megatron_lm_args: list[str] = field(default_factory=list)
    """Megatron-LM flags for this model, for reference."""
    digests: Optional[dict[str, str]] = None
    """``sha256:<hex>`` of every other file of the checkpoint, by its ``/``-separated path in the directory
    (:func:`write_meta` fills it in); ``None`` only in format version 1."""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        data = {k: getattr(self, k) for k in self.__dataclass_fields__}
        data["architecture"] = self.architecture.to_dict()
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, *, path: str = META_FILE) -> "CheckpointMeta":
        data = json_object(text, where=path)
        if data.get("format") != FORMAT or data.get("format_version") not in _READABLE_VERSIONS:
            raise CheckpointError(f"{path}: format {data.get('format')!r} version {data.get('format_version')!r} "
                                  f"is not {FORMAT!r} version {' or '.join(map(str, _READABLE_VERSIONS))}")
        fields = cls.__dataclass_fields__
        unknown = sorted(set(data) - set(fields))
        missing = sorted(n for n, f in fields.items()
                         if n not in data and f.default is MISSING and f.default_factory is MISSING)
        problems = [f"unknown fields {unknown}"] * bool(unknown) + [f"missing fields {missing}"] * bool(missing)
        if problems:
            raise CheckpointError(f"{path}: {'; '.join(problems)}")
        if not isinstance(data["architecture"], dict):
            raise CheckpointError(f"{path}: architecture must be a JSON object, not {data['architecture']!r}")
        try:
            data["architecture"] = GPTArchitecture.from_dict(data["architecture"])
        except (TypeError, ValueError) as e:  # unknown or missing GPTArchitecture fields
            raise CheckpointError(f"{path}: architecture: {e}") from None
        digests = data.get("digests")
        if data["format_version"] == 1 and digests is not None:
            raise CheckpointError(f"{path}: format version 1 has no digests, but \"digests\" is given")
        if data["format_version"] > 1 and not (isinstance(digests, dict) and digests and
                                               all(isinstance(v, str) for v in digests.values())):
            raise CheckpointError(f"{path}: \"digests\" must be an object of file name → \"sha256:<hex>\", not "
                                  f"{digests!r}")
        return cls(**data)


def read_meta(megatron_dir: str | os.PathLike) -> CheckpointMeta:
    path = Path(megatron_dir) / META_FILE
    if not path.is_file():
        raise CheckpointError(f"{megatron_dir} is not a megatron-hybrid checkpoint: {META_FILE} is missing")
    return CheckpointMeta.from_json(path.read_bytes(), path=str(path))


def read_architecture(megatron_dir: str | os.PathLike) -> GPTArchitecture:
    """The :class:`GPTArchitecture` stored with a converted checkpoint."""
    return read_meta(megatron_dir).architecture


def expected_shapes(arch: GPTArchitecture, *, tensor_model_parallel_size: int) -> dict[str, tuple[int, ...]]:
    """Every global tensor (canonical name) of ``arch`` with its shape, vocabulary padded for this TP."""
    family = infer_family(arch)
    dtype = arch.dtype
    hf = {n: Virtual(s, dtype) for n, s in hf_shapes(family, arch).items()}
    mg = megatron_from_hf(family, arch, hf, padded_vocab_size=arch.padded_vocab_size(tensor_model_parallel_size))
    return {n: v.shape for n, v in mg.items()}


def rank_tensors(global_tensors: dict[str, Virtual], arch: GPTArchitecture, *, tp_rank: int, tp_size: int,
                 pp_rank: int, pp_size: int, transformer_impl: str) -> dict[str, Virtual]:
    """What rank (tp_rank, pp_rank)'s file holds: its shards, under its stage's module names."""
    layers = stage_layers(arch.num_layers, pp_size)[pp_rank]
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out = {}
    for name, v in global_tensors.items():
        m = re.match(r"decoder\.layers\.(\d+)\.", name)
        if m:
            if int(m.group(1)) not in layers:
                continue
            local = global_name(name, -layers.start)
        elif name == EMBEDDING and first or name != EMBEDDING and last:
            local = name
        else:
            continue
        out[stored_name(local, transformer_impl)] = shard(v, tp_spec(name, arch), tp_rank, tp_size)
    if last and pp_size > 1 and not arch.untie_embeddings_and_output_weights:
        # A tied model's last stage holds its own copy of the embedding as output_layer.weight; Megatron keeps
        # the two equal (the embedding group all-reduces their gradients).
        out[OUTPUT_LAYER] = shard(global_tensors[EMBEDDING], tp_spec(OUTPUT_LAYER, arch), tp_rank, tp_size)
    return out


class MegatronCheckpoint:
    """A converted checkpoint on disk, as global (canonical, unsharded) virtual tensors. Opening one reads every
    file once to check it against the manifest's digests: a damaged file is a :class:`CheckpointError` naming it."""

    def __init__(self, megatron_dir: str | os.PathLike) -> None:
        self.root = Path(megatron_dir)
        self.meta = read_meta(self.root)
        arch = self.meta.architecture
        tp, pp = self.meta.tensor_model_parallel_size, self.meta.pipeline_model_parallel_size
        check_parallel_sizes(arch, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        paths = {(t, p): self.root / ITERATION_DIR / rank_dir_name(t, p, pp) / WEIGHTS_FILE
                 for p in range(pp) for t in range(tp)}
        missing = [str(path) for path in paths.values() if not path.is_file()]
        if missing:
            raise CheckpointError(f"{self.root}: missing rank files: {missing}")
        if self.meta.digests is None:
            warnings.warn(f"{self.root} was written without file digests (format version 1): its files cannot be "
                          "checked for damage; convert it again to add them", stacklevel=2)
        else:  # every rank that opens it reads all of it: the same verdict everywhere, before any collective
            check_digests(self.root, self.meta.digests, manifest=self.root / META_FILE, required=paths.values())
        parts: dict[str, dict[int, Virtual]] = {}
        tied_copies = set()
        for (t, p), path in paths.items():
            offset = stage_layers(arch.num_layers, pp)[p].start
            for name, info in read_header(path).items():
                key = canonical_name(global_name(name, offset))
                if key == OUTPUT_LAYER and not arch.untie_embeddings_and_output_weights:
                    tied_copies.add(p)  # the last stage's copy of a tied embedding
                    continue
                parts.setdefault(key, {})[t] = Virtual.stored(str(path), name, info.shape, info.dtype)
        expected = expected_shapes(arch, tensor_model_parallel_size=tp)
        missing = sorted(set(expected) - set(parts))
        unexpected = sorted(set(parts) - set(expected))
        if missing or unexpected:
            raise CheckpointError(f"{self.root}: tensors do not match the architecture; missing: {missing}, "
                                  f"unexpected: {unexpected}")
        self.tensors: dict[str, Virtual] = {}
        for key, by_rank in parts.items():
            if sorted(by_rank) != list(range(tp)):
                raise CheckpointError(f"{self.root}: {key} is stored by TP ranks {sorted(by_rank)}, not 0..{tp - 1}")
            v = unshard([by_rank[t] for t in range(tp)], tp_spec(key, arch))
            if v.shape != expected[key]:
                raise CheckpointError(f"{self.root}: {key} has shape {list(v.shape)}, the architecture says "
                                      f"{list(expected[key])}")
            self.tensors[key] = v

    @property
    def architecture(self) -> GPTArchitecture:
        return self.meta.architecture

    def vocab_tensor(self, key: str, padded_rows: int) -> Virtual:
        """An embedding-like tensor with its vocabulary re-padded (zeros) to ``padded_rows`` rows."""
        v = self.tensors[key].narrow(0, 0, self.architecture.vocab_size)
        return v.pad(0, padded_rows - v.shape[0])


def load_megatron_checkpoint(model_chunks: Sequence[torch.nn.Module], megatron_dir: str | os.PathLike, *,
                             tp_rank: int, tp_size: int) -> GPTArchitecture:
    """Copy a converted checkpoint into this rank's GPTModel chunk(s), at any TP/PP.

    The chunks' own layer numbers (``layer_number``) say which layers they hold, so pipeline stages and virtual
    pipeline chunks need no further arguments. Parameters may use local or Transformer Engine names. Tensors are
    read band by band straight into the parameters, after every file was checked against its digest. Returns the
    stored architecture.
    """
    from .. import compat  # megatron-core only where a model is walked

    ckpt = MegatronCheckpoint(megatron_dir)
    arch = ckpt.architecture
    plan: list[tuple[torch.nn.Parameter, Virtual]] = []
    missing, mismatched = [], []
    for chunk in model_chunks:
        module = compat.unwrap_model(chunk)
        offset = layer_offset(module)
        for name, param in module.named_parameters():
            key = canonical_name(global_name(name, offset))
            if key == OUTPUT_LAYER and not arch.untie_embeddings_and_output_weights:
                key = EMBEDDING
            if key not in ckpt.tensors:
                missing.append(key)
                continue
            spec = TPSpec.of(param)
            if spec != tp_spec(key, arch):
                raise CheckpointError(f"{name}: the model splits it as {spec}, the checkpoint layout assumes "
                                      f"{tp_spec(key, arch)} (a megatron-core version this code does not know?)")
            full = (ckpt.vocab_tensor(key, param.shape[0] * tp_size) if key in (EMBEDDING, OUTPUT_LAYER)
                    else ckpt.tensors[key])
            part = shard(full, spec, tp_rank, tp_size)
            if part.shape != tuple(param.shape):
                mismatched.append(f"{name}: model {list(param.shape)}, checkpoint {list(part.shape)}")
                continue
            plan.append((param, part))
    if missing or mismatched:
        raise CheckpointError(f"{megatron_dir} does not fit the model; missing: {sorted(missing)}; "
                              f"shape mismatches: {mismatched}")
    with TensorReader() as reader, torch.no_grad():
        for param, part in plan:
            read_into(part, param.data, reader)
    return arch


def write_meta(directory: Path, meta: CheckpointMeta, *, digests: Optional[dict[str, str]] = None) -> None:
    """Finish a checkpoint whose other files are written: the tracker file, then the manifest with the digest of
    every file in ``directory`` (``digests``: those computed while writing; the rest are read here)."""
    (directory / TRACKER_FILE).write_text(ITERATION_DIR + "\n")
    listed = digest_files(directory, skip=[META_FILE], known=digests or {})
    meta = replace(meta, format_version=FORMAT_VERSION, digests=listed)
    (directory / META_FILE).write_text(meta.to_json() + "\n")


def json_ready(obj: Any) -> Any:
    """A transformers ``config.to_dict()`` made JSON-safe (dtypes as strings)."""
    return json.loads(json.dumps(obj, default=str))
