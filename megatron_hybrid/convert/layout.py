"""The Megatron-side checkpoint: Megatron-LM's per-rank directory layout, holding safetensors files.

::

    <dir>/latest_checkpointed_iteration.txt               "release", as Megatron-LM's converters write it
    <dir>/megatron_hybrid_checkpoint.json                 format, GPTArchitecture, TP/PP, names, Megatron-LM args,
                                                          the Hugging Face config it came from, and the sha256 of
                                                          every other file (written last)
    <dir>/release/mp_rank_TT[_PPP]/model.safetensors      TP rank TT / PP rank PPP's parameters, under the names
                                                          its GPTModel stage has (stage-local layer numbers); with
                                                          experts, all but the routed experts'
    <dir>/release/mp_rank_UU_PPP_EEE/model.safetensors    with experts only: the routed experts of expert-parallel
                                                          rank EEE (its local expert i is global expert
                                                          EEE · E/e + i), expert-tensor-parallel shard UU, stage
                                                          PPP (always three fields: apart from mp_rank_TT_PPP)
    <dir>/hf_assets/                                      the Hugging Face directory's other files (tokenizer, …)

Each rank's file can be read (and written) as a stream, and by anyone with safetensors: no pickle. Opening a
checkpoint (:class:`MegatronCheckpoint`) checks every file against its digest (:mod:`.digests`) before any value
is used; a checkpoint written before digests existed (format version 1) is read with a warning. The TP/PP it
was written at is only the *stored* layout: :func:`load_megatron_checkpoint` reshards on the fly, so a checkpoint
loads into a GPTModel at any TP/PP/EP/ETP (and into a local- or Transformer-Engine-spec model, whatever names it
holds). The expert files depend on the expert sizes alone (e, et), not on the data-parallel size that places
them on a job's ranks: Megatron-LM's own ``mp_rank_TT_PPP_EEE`` files, one per (TP, PP, EP) rank of a job, hold
every dense tensor e times over and cannot say which expert-TP shard a rank holds when et ≠ t.

Legend: *canonical* names are the local spec's names with global layer numbers (``decoder.layers.{i}.…``) and
global expert numbers (``….mlp.experts.local_experts.{expert}.…``); t, p, e, et the tensor, pipeline, expert and
expert-tensor parallel sizes; E experts.
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

from ..constraints import Sizes, check
from ..megatron.models import GPTArchitecture
from ..megatron.sharding import TPSpec, global_name, layer_offset
from .digests import check_digests, digest_files
from .families import EMBEDDING, OUTPUT_LAYER, hf_shapes, infer_family, megatron_from_hf
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


_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def expert_of(name: str) -> Optional[int]:
    """The expert number in a routed expert's parameter name (``None`` for any other parameter)."""
    m = _EXPERT.match(name)
    return None if m is None else int(m.group(2))


def renumber_expert(name: str, offset: int) -> str:
    """A routed expert's parameter name with its expert number moved by ``offset`` (local ⇄ global)."""
    m = _EXPERT.match(name)
    assert m is not None, name
    return f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}"


def stored_name(canonical: str, transformer_impl: str, *, moe_layer: bool = False) -> str:
    """The parameter name under ``transformer_impl``'s layer spec (``moe_layer``: the name is in a layer with
    experts, whose pre-MLP norm Transformer Engine's spec keeps apart: experts have no one fc1 to fuse it into)."""
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise CheckpointError(f"transformer_impl {transformer_impl!r} must be one of {TRANSFORMER_IMPLS}")
    if transformer_impl == "local":
        return canonical
    for pattern, repl in _TO_TE[:1] if moe_layer else _TO_TE:
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
                         pipeline_model_parallel_size: int, expert_model_parallel_size: int = 1,
                         expert_tensor_parallel_size: Optional[int] = None,
                         data_parallel_size: Optional[int] = None) -> None:
    """``CheckpointError`` unless megatron-core can build ``arch`` at this TP/PP/EP/ETP (ETP default: TP), and,
    given ``data_parallel_size``, lay the experts over a stage's ranks."""
    tp, pp, ep = tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    if min(tp, pp, ep, etp) < 1:
        raise CheckpointError(f"parallel sizes must be ≥ 1 (tensor {tp}, pipeline {pp}, expert {ep}, expert tensor "
                              f"{etp})")
    try:
        arch.validate(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                      expert_tensor_parallel_size=etp)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    try:
        check(Sizes(moe=arch.num_experts is not None, t=tp, d=data_parallel_size, e=ep, et=etp),
              "expert_grid_fits_stage")
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


def expert_rank_dir_name(etp_rank: int, pp_rank: int, ep_rank: int) -> str:
    """Megatron-LM's ``mp_rank_TT_PPP_EEE`` with TT the expert-tensor-parallel rank, always all three fields."""
    return f"mp_rank_{etp_rank:02d}_{pp_rank:03d}_{ep_rank:03d}"


@dataclass(frozen=True)
class RankFile:
    """One rank file of a checkpoint: which shard of which tensors it holds."""

    path: str
    """``release/…/model.safetensors``, relative to the checkpoint."""
    pp_rank: int
    """The pipeline stage (its names use stage-local layer numbers)."""
    shard: int
    """The TP rank (dense file) or the expert-TP rank (expert file)."""
    ep_rank: Optional[int] = None
    """The expert-parallel rank of an expert file (``None``: the dense file)."""


def rank_files(*, tp: int, pp: int, ep: int, etp: int, moe: bool) -> list[RankFile]:
    """Every rank file of a checkpoint at these sizes, dense files first."""
    files = [RankFile(f"{ITERATION_DIR}/{rank_dir_name(t, p, pp)}/{WEIGHTS_FILE}", p, t)
             for p in range(pp) for t in range(tp)]
    if moe:
        files += [RankFile(f"{ITERATION_DIR}/{expert_rank_dir_name(u, p, x)}/{WEIGHTS_FILE}", p, u, x)
                  for p in range(pp) for x in range(ep) for u in range(etp)]
    return files


def megatron_lm_args(arch: GPTArchitecture, *, tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
                     transformer_impl: str, expert_model_parallel_size: int = 1,
                     expert_tensor_parallel_size: Optional[int] = None) -> list[str]:
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
    if a.num_experts is not None:
        freq = a.moe_layer_freq if isinstance(a.moe_layer_freq, int) else repr(a.moe_layer_freq).replace(" ", "")
        args += ["--num-experts", str(a.num_experts), "--moe-router-topk", str(a.moe_router_topk),
                 "--moe-ffn-hidden-size", str(a.moe_ffn_hidden_size or a.ffn_hidden_size or 4 * a.hidden_size),
                 "--moe-layer-freq", str(freq), "--moe-router-score-function", a.moe_router_score_function,
                 "--moe-router-load-balancing-type", a.moe_router_load_balancing_type,
                 "--moe-aux-loss-coeff", repr(a.moe_aux_loss_coeff),
                 "--moe-token-dispatcher-type", a.moe_token_dispatcher_type,
                 "--expert-model-parallel-size", str(expert_model_parallel_size),
                 "--expert-tensor-parallel-size", str(expert_tensor_parallel_size or tensor_model_parallel_size)]
        if a.moe_shared_expert_intermediate_size is not None:
            args += ["--moe-shared-expert-intermediate-size", str(a.moe_shared_expert_intermediate_size)]
        args += ["--moe-shared-expert-gate"] if a.moe_shared_expert_gate else []
        args += ["--moe-router-pre-softmax"] if a.moe_router_pre_softmax else []
        args += ["--moe-router-enable-expert-bias"] if a.moe_router_enable_expert_bias else []
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
    expert_model_parallel_size: int = 1
    """The EP size the expert files are split for (loading may use another)."""
    expert_tensor_parallel_size: Optional[int] = None
    """The expert-TP size the expert files are split for (``None``: the TP size; loading may use another)."""
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


def rank_tensors(global_tensors: dict[str, Virtual], arch: GPTArchitecture, file: RankFile, *, tp_size: int,
                 pp_size: int, ep_size: int = 1, etp_size: Optional[int] = None,
                 transformer_impl: str) -> dict[str, Virtual]:
    """What ``file`` holds: its shards, under its stage's module names (and, in an expert file, its expert-parallel
    rank's local expert numbers)."""
    layers = stage_layers(arch.num_layers, pp_size)[file.pp_rank]
    first, last = file.pp_rank == 0, file.pp_rank == pp_size - 1
    expert_file = file.ep_rank is not None
    num_local = arch.num_experts // ep_size if arch.num_experts else 0
    ranks = (etp_size or tp_size) if expert_file else tp_size
    moe_layers = arch.moe_layer_pattern()
    out = {}
    for name, v in global_tensors.items():
        expert = expert_of(name)
        if (expert is not None) != expert_file or expert_file and expert // num_local != file.ep_rank:
            continue
        m = re.match(r"decoder\.layers\.(\d+)\.", name)
        moe_layer = False
        if m:
            if int(m.group(1)) not in layers:
                continue
            moe_layer = bool(moe_layers[int(m.group(1))])
            local = global_name(name, -layers.start)
            if expert_file:
                local = renumber_expert(local, -file.ep_rank * num_local)
        elif name == EMBEDDING and first or name != EMBEDDING and last:
            local = name
        else:
            continue
        out[stored_name(local, transformer_impl, moe_layer=moe_layer)] = shard(v, tp_spec(name, arch), file.shard,
                                                                               ranks)
    if not expert_file and last and pp_size > 1 and not arch.untie_embeddings_and_output_weights:
        # A tied model's last stage holds its own copy of the embedding as output_layer.weight; Megatron keeps
        # the two equal (the embedding group all-reduces their gradients).
        out[OUTPUT_LAYER] = shard(global_tensors[EMBEDDING], tp_spec(OUTPUT_LAYER, arch), file.shard, tp_size)
    return out


class MegatronCheckpoint:
    """A converted checkpoint on disk, as global (canonical, unsharded) virtual tensors. Opening one reads every
    file once to check it against the manifest's digests: a damaged file is a :class:`CheckpointError` naming it."""

    def __init__(self, megatron_dir: str | os.PathLike) -> None:
        self.root = Path(megatron_dir)
        self.meta = read_meta(self.root)
        arch, meta = self.meta.architecture, self.meta
        tp, pp, ep = meta.tensor_model_parallel_size, meta.pipeline_model_parallel_size, meta.expert_model_parallel_size
        etp = meta.expert_tensor_parallel_size or tp
        check_parallel_sizes(arch, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                             expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        paths = {f: self.root / f.path for f in rank_files(tp=tp, pp=pp, ep=ep, etp=etp,
                                                            moe=arch.num_experts is not None)}
        missing = [str(path) for path in paths.values() if not path.is_file()]
        if missing:
            raise CheckpointError(f"{self.root}: missing rank files: {missing}")
        if self.meta.digests is None:
            warnings.warn(f"{self.root} was written without file digests (format version 1): its files cannot be "
                          "checked for damage; convert it again to add them", stacklevel=2)
        else:  # every rank that opens it reads all of it: the same verdict everywhere, before any collective
            check_digests(self.root, self.meta.digests, manifest=self.root / META_FILE, required=paths.values())
        num_local = arch.num_experts // ep if arch.num_experts else 0
        parts: dict[str, dict[int, Virtual]] = {}
        misplaced = []
        for f, path in paths.items():
            offset = stage_layers(arch.num_layers, pp)[f.pp_rank].start
            for name, info in read_header(path).items():
                key = canonical_name(global_name(name, offset))
                expert = expert_of(key)
                if (expert is not None) != (f.ep_rank is not None) or expert is not None and expert >= num_local:
                    misplaced.append(f"{f.path}: {name}")
                    continue
                if expert is not None:
                    key = renumber_expert(key, f.ep_rank * num_local)
                if key == OUTPUT_LAYER and not arch.untie_embeddings_and_output_weights:
                    continue  # the last stage's copy of a tied embedding
                parts.setdefault(key, {})[f.shard] = Virtual.stored(str(path), name, info.shape, info.dtype)
        if misplaced:
            raise CheckpointError(f"{self.root}: tensors in the wrong rank file (routed experts, {num_local} per "
                                  f"expert-parallel rank, belong in mp_rank_UU_PPP_EEE, the rest in "
                                  f"mp_rank_TT[_PPP]): {misplaced}")
        expected = expected_shapes(arch, tensor_model_parallel_size=tp)
        missing = sorted(set(expected) - set(parts))
        unexpected = sorted(set(parts) - set(expected))
        if missing or unexpected:
            raise CheckpointError(f"{self.root}: tensors do not match the architecture; missing: {missing}, "
                                  f"unexpected: {unexpected}")
        self.tensors: dict[str, Virtual] = {}
        for key, by_rank in parts.items():
            axis, ranks = ("expert TP", etp) if expert_of(key) is not None else ("TP", tp)
            if sorted(by_rank) != list(range(ranks)):
                raise CheckpointError(f"{self.root}: {key} is stored by {axis} ranks {sorted(by_rank)}, not "
                                      f"0..{ranks - 1}")
            v = unshard([by_rank[t] for t in range(ranks)], tp_spec(key, arch))
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
                             tp_rank: int, tp_size: int, ep_rank: int = 0, ep_size: int = 1,
                             etp_rank: Optional[int] = None, etp_size: Optional[int] = None) -> GPTArchitecture:
    """Copy a converted checkpoint into this rank's GPTModel chunk(s), at any TP/PP/EP/ETP.

    The chunks' own layer numbers (``layer_number``) say which layers they hold, so pipeline stages and virtual
    pipeline chunks need no further arguments. Routed experts: this rank's local expert i is global expert
    ``ep_rank · E/ep_size + i``, split over the expert-tensor-parallel ranks (``etp_rank``/``etp_size``, default
    the TP rank and size, as megatron-core's default). Parameters may use local or Transformer Engine names.
    Tensors are read band by band straight into the parameters, after every file was checked against its digest.
    Returns the stored architecture.
    """
    from ..megatron import compat  # megatron-core only where a model is walked

    ckpt = MegatronCheckpoint(megatron_dir)
    arch = ckpt.architecture
    etp_rank, etp_size = (tp_rank, tp_size) if etp_size is None else (etp_rank, etp_size)
    if arch.num_experts is not None and (ep_size < 1 or arch.num_experts % ep_size or not 0 <= ep_rank < ep_size):
        raise CheckpointError(f"expert-parallel rank {ep_rank} of {ep_size}: the size must divide num_experts "
                              f"({arch.num_experts}) and the rank be below it")
    num_local = arch.num_experts // ep_size if arch.num_experts else 0
    plan: list[tuple[torch.nn.Parameter, Virtual]] = []
    missing, mismatched, local_experts = [], [], set()
    for chunk in model_chunks:
        module = compat.unwrap_model(chunk)
        offset = layer_offset(module)
        for name, param in module.named_parameters():
            key = canonical_name(global_name(name, offset))
            if key == OUTPUT_LAYER and not arch.untie_embeddings_and_output_weights:
                key = EMBEDDING
            rank, size = tp_rank, tp_size
            expert = expert_of(key)
            if expert is not None:
                local_experts.add(expert)
                key = renumber_expert(key, ep_rank * num_local)
                rank, size = etp_rank, etp_size
            if key not in ckpt.tensors:
                missing.append(key)
                continue
            spec = TPSpec.of(param)
            if spec != tp_spec(key, arch):
                raise CheckpointError(f"{name}: the model splits it as {spec}, the checkpoint layout assumes "
                                      f"{tp_spec(key, arch)} (a megatron-core version this code does not know?)")
            full = (ckpt.vocab_tensor(key, param.shape[0] * tp_size) if key in (EMBEDDING, OUTPUT_LAYER)
                    else ckpt.tensors[key])
            part = shard(full, spec, rank, size)
            if part.shape != tuple(param.shape):
                mismatched.append(f"{name}: model {list(param.shape)}, checkpoint {list(part.shape)}")
                continue
            plan.append((param, part))
    if local_experts and len(local_experts) != num_local:
        raise CheckpointError(f"the model holds {len(local_experts)} experts per MoE layer; the checkpoint's "
                              f"{arch.num_experts} over expert_model_parallel_size {ep_size} are {num_local}")
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
