"""Real models in and out of an RL run: ``--pretrained-checkpoint`` (a converted Hugging Face model) and
``--export-hf`` (the trained actor as a Hugging Face model).

In: the output of ``tools/convert_checkpoint.py hf-to-megatron``. Its architecture, padded vocabulary and tokenizer
(``hf_assets/``) become the run's (:func:`model_args_from_checkpoint`, part of argument validation: no collective);
its weights are loaded into the actor's stage at the training TP/PP (:func:`load_pretrained`), and the reference
policy and the critic's trunk copy them from the actor. Weights only: the run starts at step 0 with a fresh
optimizer (``--load`` resumes a run).

Out: :func:`export_hf` goes through the converter's own format. Every rank of data-parallel replica 0 writes its
stage's tensor-parallel shard, under its stage's names, into a Megatron checkpoint in a hidden directory next to
the target (``release/mp_rank_TT[_PPP]/model.safetensors`` plus the metadata, at the training TP/PP); with
experts, every rank of expert-data-parallel replica 0 writes its routed experts (its local expert numbers, its
expert-TP shard) into ``release/mp_rank_UU_PPP_EEE/`` (an expert-parallel group may span data-parallel replicas,
so these are other ranks than the dense files'; each file has one writer); rank 0 then
runs the converter's :func:`~megatron_hybrid.convert.megatron_to_hf` on it, which reassembles the shards band by
band (no rank ever holds the whole model) and applies the family's tensor mapping, and renames the result onto the
target. A failure on any rank raises on every rank and leaves no partial export behind.

An export replaces its whole directory, so it writes a marker (:data:`EXPORT_MARKER`, listing the files it wrote)
and replaces only a directory that is missing, empty or an earlier export (its marked files, its interval
exports ``iter_NNNNNNN`` and a killed export's hidden leftovers): checked at argument validation, with the
directory apart from every other path of the run, and again just before the rename onto it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..checks import check_number, flag_name, output_dir_error, with_flag_names
from ..convert import CheckpointError, MegatronCheckpoint, load_megatron_checkpoint, megatron_to_hf, read_architecture
# The converter's release directory; this module's ITERATION_DIR is the interval exports' (iter_NNNNNNN).
from ..convert.layout import ITERATION_DIR as RELEASE
from ..convert.layout import (ASSETS_DIR, WEIGHTS_FILE, CheckpointMeta, check_parallel_sizes, expert_of,
                              expert_rank_dir_name, megatron_lm_args, rank_dir_name, read_meta, write_meta)
from ..megatron import (GPTArchitecture, ddp_finish_param_sync, megatron_expert_groups, megatron_expert_ranks,
                        megatron_groups, unwrap_model)
from .faults import errors_on_every_rank
from .models import architecture_from_args
from .phases import recorded

#: The recipe's model flags (arguments dest) and the checkpoint architecture's value of each.
MODEL_FLAGS: dict[str, Callable[[GPTArchitecture], Any]] = {
    "num_layers": lambda a: a.num_layers,
    "hidden_size": lambda a: a.hidden_size,
    "num_attention_heads": lambda a: a.num_attention_heads,
    "group_query_attention": lambda a: a.num_query_groups is not None,
    "num_query_groups": lambda a: a.num_query_groups or a.num_attention_heads,
    "ffn_hidden_size": lambda a: a.ffn_hidden_size or 4 * a.hidden_size,
    "swiglu": lambda a: a.swiglu,
    "normalization": lambda a: a.normalization,
    "position_embedding_type": lambda a: a.position_embedding_type,
    "untie_embeddings_and_output_weights": lambda a: a.untie_embeddings_and_output_weights,
    "max_position_embeddings": lambda a: a.max_position_embeddings,
    "make_vocab_size_divisible_by": lambda a: a.make_vocab_size_divisible_by,
    # A mixture of experts (the moe_ flags compared and filled only when the checkpoint has experts; on a dense one
    # validate_args refuses them as expert flags on a dense model).
    "num_experts": lambda a: a.num_experts,
    "moe_router_topk": lambda a: a.moe_router_topk,
    "moe_ffn_hidden_size": lambda a: a.moe_ffn_hidden_size or a.ffn_hidden_size or 4 * a.hidden_size,
    "moe_shared_expert_intermediate_size": lambda a: a.moe_shared_expert_intermediate_size,
    "moe_router_score_function": lambda a: a.moe_router_score_function,
    "moe_router_pre_softmax": lambda a: a.moe_router_pre_softmax,
    "moe_router_enable_expert_bias": lambda a: a.moe_router_enable_expert_bias,
    "moe_shared_expert_gate": lambda a: a.moe_shared_expert_gate,
    "moe_layer_freq": lambda a: a.moe_layer_freq,
}
#: The MoE flags that change how the model trains, not the function it computes: a value on the command line wins
#: over the checkpoint's (a converted Hugging Face MoE has no load-balancing loss unless its config asked for
#: router logits), and an unset one takes the checkpoint's.
MOE_TRAINING_FLAGS = ("moe_aux_loss_coeff", "moe_router_load_balancing_type", "moe_token_dispatcher_type")
#: Where interval exports go inside ``--export-hf DIR`` (Megatron-LM's iteration directory names).
ITERATION_DIR = "iter_{:07d}"
#: The file that marks a directory as an export (JSON: format, version, iteration, the names written).
EXPORT_MARKER = "megatron_hybrid_export.json"
EXPORT_FORMAT, EXPORT_VERSION = "megatron_hybrid.export_hf", 1
_INTERVAL_EXPORT = re.compile(r"iter_\d{7}")
#: What a killed interval export leaves inside DIR: its staging, its conversion, its replaced copy.
_LEFTOVER = re.compile(r"\.iter_\d{7}\.(megatron-partial|hf-partial|old)")
#: The recipe's other paths: an export must be apart from each (the same path, or one inside the other). Outputs
#: (--log-dir, --tensorboard-dir) may hold the export, not be inside it.
_INPUT_PATH_FLAGS = ("pretrained_checkpoint", "load", "save", "prompt_data", "eval_prompt_data", "prompt_file",
                     "reward_model_load", "tokenizer_model")
_OUTPUT_PATH_FLAGS = ("log_dir", "tensorboard_dir")


def _open_checkpoint(directory: str):
    """The converted checkpoint at ``directory`` (metadata and every rank file's header read: cheap)."""
    if not os.path.isdir(directory):
        raise ValueError(f"--pretrained-checkpoint ({directory!r}) is not a directory")
    try:
        return MegatronCheckpoint(directory)
    except CheckpointError as e:
        raise ValueError(f"--pretrained-checkpoint ({directory!r}) is not a converted checkpoint ({e}); make one "
                         "with tools/convert_checkpoint.py hf-to-megatron (--load resumes the recipe's own "
                         "checkpoints)") from None


def model_args_from_checkpoint(args: argparse.Namespace) -> None:
    """Fill the model flags (:data:`MODEL_FLAGS`) and the tokenizer from ``--pretrained-checkpoint``, and check
    the export flags; no collective. ``ValueError`` for a missing or unconverted directory, a model flag given on
    the command line with another value than the checkpoint's (both named), a checkpoint without a tokenizer when
    none is given, or parallel sizes the model cannot be split into."""
    _check_export_args(args)
    if args.pretrained_checkpoint is None:
        return
    directory = args.pretrained_checkpoint
    ckpt = _open_checkpoint(directory)
    arch = ckpt.architecture
    for name, of in MODEL_FLAGS.items():
        if arch.num_experts is None and name.startswith("moe_"):
            continue
        given, stored = getattr(args, name), of(arch)
        if name == "moe_layer_freq" and given is not None:  # 1 and [1, 1] are the same layers
            same = dataclasses.replace(arch, moe_layer_freq=given).moe_layer_pattern() == arch.moe_layer_pattern()
        else:
            same = given == stored
        if given is not None and not same:
            raise ValueError(f"{flag_name(name)} ({given}) contradicts --pretrained-checkpoint {directory!r}, whose "
                             f"model has {stored}; leave the flag out to take the checkpoint's")
        setattr(args, name, stored)
    if arch.num_experts is not None:
        for name in MOE_TRAINING_FLAGS:
            if getattr(args, name) is None:
                setattr(args, name, getattr(arch, name))
    try:
        check_parallel_sizes(arch, tensor_model_parallel_size=args.tensor_model_parallel_size,
                             pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                             **({} if arch.num_experts is None else dict(
                                 expert_model_parallel_size=args.expert_model_parallel_size,
                                 expert_tensor_parallel_size=args.expert_tensor_parallel_size)))
    except ValueError as e:
        raise ValueError(f"--pretrained-checkpoint {directory!r}: {with_flag_names(str(e), vars(args))}") from None
    if args.tokenizer_model is None:
        assets = os.path.join(directory, ASSETS_DIR)
        if not os.path.isdir(assets):
            raise ValueError(f"--pretrained-checkpoint {directory!r} has no tokenizer ({ASSETS_DIR}/ is missing: "
                             "the Hugging Face directory it was converted from had none); pass --tokenizer-type "
                             "HuggingFaceTokenizer --tokenizer-model DIR")
        args.tokenizer_type, args.tokenizer_model = "HuggingFaceTokenizer", assets


def _check_export_args(args: argparse.Namespace) -> None:
    if args.export_hf_interval is not None:
        check_number("--export-hf-interval", args.export_hf_interval, ge=1)
        if args.export_hf is None:
            raise ValueError(f"--export-hf-interval ({args.export_hf_interval}) needs --export-hf DIR")
    if args.export_hf is None:
        return
    if args.pretrained_checkpoint is None:
        raise ValueError(f"--export-hf ({args.export_hf!r}) needs --pretrained-checkpoint: the Hugging Face family "
                         "and config come from the converted checkpoint (the built-in tiny model has none)")
    # Real paths: a symlink must not hide that two flags name the same place.
    out = Path(os.path.realpath(args.export_hf))
    for name in _INPUT_PATH_FLAGS + _OUTPUT_PATH_FLAGS:
        path = getattr(args, name)
        if path is None:
            continue
        other = Path(os.path.realpath(path))
        if out == other or out in other.parents or (other in out.parents and name in _INPUT_PATH_FLAGS):
            raise ValueError(f"--export-hf ({args.export_hf!r}) and {flag_name(name)} ({path!r}) must not contain one "
                             "another (an export replaces its whole directory)")
    error = export_target_error(out)
    if error:
        raise ValueError(f"--export-hf ({args.export_hf!r}) {error}")


def export_target_error(target: Path) -> Optional[str]:
    """Why an export must not replace ``target`` (``"is not a directory"``, ``"holds X, which no export
    wrote ..."``), or ``None`` when it is missing, empty or an earlier export: its marked files, its interval
    exports (each an export itself) and a killed interval export's hidden leftovers."""
    error = output_dir_error(str(target))
    if error or not target.is_dir():
        return error  # None: to be made
    foreign = _foreign_entries(target)
    if not foreign:
        return None
    more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
    return (f"holds {', '.join(foreign[:3])}{more}, which no export wrote (an export replaces its whole "
            "directory): pick a new or empty directory")


def _foreign_entries(directory: Path) -> list[str]:
    """The names in ``directory`` that no export wrote, sorted."""
    ours = _marked_files(directory)
    return [name for name in sorted(os.listdir(directory))
            if name not in ours and not _LEFTOVER.fullmatch(name)
            and not (_INTERVAL_EXPORT.fullmatch(name) and (directory / name).is_dir()
                     and _marked_files(directory / name) and not _foreign_entries(directory / name))]


def _marked_files(directory: Path) -> set[str]:
    """The names an export wrote into ``directory``, its marker's included, as the marker lists them; empty
    without a valid marker. (JSON: parsing it runs nothing.)"""
    try:
        marker = json.loads((directory / EXPORT_MARKER).read_text())
    except (OSError, ValueError):
        return set()
    if not (isinstance(marker, dict) and marker.get("format") == EXPORT_FORMAT
            and isinstance(marker.get("files"), list)):
        return set()
    return {str(name) for name in marker["files"]} | {EXPORT_MARKER}


def model_architecture(args: argparse.Namespace, vocab_size: int) -> GPTArchitecture:
    """The run's model: ``--pretrained-checkpoint``'s architecture in the training dtype (``--bf16``), or the
    model flags' (:func:`~megatron_hybrid.rl.architecture_from_args`); ``vocab_size`` is the tokenizer's.
    ``ValueError`` when the tokenizer has more tokens than the checkpoint's vocabulary."""
    if args.pretrained_checkpoint is None:
        return architecture_from_args(args, vocab_size)
    arch = read_architecture(args.pretrained_checkpoint)
    if vocab_size > arch.vocab_size:
        raise ValueError(f"the tokenizer ({args.tokenizer_model!r}) has {vocab_size} tokens, more than the "
                         f"vocabulary of --pretrained-checkpoint {args.pretrained_checkpoint!r} ({arch.vocab_size})")
    training = {name: getattr(args, name) for name in MOE_TRAINING_FLAGS} if arch.num_experts is not None else {}
    return dataclasses.replace(arch, params_dtype="bfloat16" if args.bf16 else "float32", **training)


def load_pretrained(model: torch.nn.Module, directory: str) -> None:
    """Copy a converted checkpoint's weights into this rank's stage (plain or DDP-wrapped), at its TP/PP (and, for
    experts, its EP/ETP)."""
    tp = megatron_groups()[0]
    ep_rank, ep_size, etp_rank, etp_size = megatron_expert_ranks()
    load_megatron_checkpoint([model], directory, tp_rank=tp.rank(), tp_size=tp.size(), ep_rank=ep_rank,
                             ep_size=ep_size, etp_rank=etp_rank, etp_size=etp_size)


@recorded("export", step="iteration")
def export_hf(model: torch.nn.Module, directory: str, pretrained_checkpoint: str, *,
              iteration: Optional[int] = None) -> str:
    """Write ``model`` (the actor's stage on this rank, plain or DDP-wrapped) as a Hugging Face checkpoint of
    ``pretrained_checkpoint``'s family and config (its tokenizer files included); called on every rank, in the
    training layout. Returns the directory written: ``directory``, or ``directory/iter_NNNNNNN`` for an
    ``iteration``. An existing export there is replaced (the ``iter_*`` directories inside ``directory`` are
    kept); anything else there is not (:func:`export_target_error`, checked just before the rename).
    ``RuntimeError`` on every rank, naming the failures, when some rank could not write or the target is not
    ours to replace; nothing partial is left."""
    ddp_finish_param_sync(model)  # with --overlap-param-gather the last step's weights are still being gathered
    # The real path: a symlinked DIR is itself replaced, not the link (and it was checked as a real path).
    target = Path(os.path.realpath(directory))
    if iteration is not None:
        target = target / ITERATION_DIR.format(iteration)
    staging = target.parent / f".{target.name}.megatron-partial"
    tp, pp, dp, _ = megatron_groups()
    rank = dist.get_rank()
    error = None
    if rank == 0:
        error = _attempt(lambda: _fresh_dir(staging), f"cannot create {staging}")
    errors = errors_on_every_rank([error] if error else [])  # also the barrier after which staging exists
    experts = _expert_grid(model)
    if not errors:
        # Data-parallel replicas hold the same dense weights, expert data-parallel replicas the same experts; the
        # two kinds of replica differ (an EP group spans DP replicas), so each file has its own writer.
        dense = dp.rank() == 0
        expert = experts is not None and experts.edp_rank == 0
        if dense or expert:
            error = _attempt(lambda: _write_shard(model, staging, tp=tp, pp=pp, dense=dense,
                                                  experts=experts if expert else None),
                             f"cannot write into {staging}")
        errors = errors_on_every_rank([error] if error else [])
    if not errors:
        if rank == 0:
            error = _attempt(lambda: _convert(staging, target, pretrained_checkpoint, model, tp=tp.size(),
                                              pp=pp.size(), experts=experts, iteration=iteration),
                             f"cannot write {target}")
        errors = errors_on_every_rank([error] if error else [])
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    if errors:
        raise RuntimeError(f"--export-hf: {target} was not written ({'; '.join(errors)})")
    return str(target)


def _attempt(fn: Callable[[], None], what: str) -> Optional[str]:
    """``None`` when ``fn()`` succeeds, else the message for every rank."""
    try:
        fn()
    except Exception as e:  # a full disk, a quota, a lost mount, a conversion error: every rank must learn of it
        return f"{what}: {type(e).__name__}: {e}"
    return None


def _fresh_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)  # left by an export that was killed
    (path / RELEASE).mkdir(parents=True)


@dataclass(frozen=True)
class _ExpertGrid:
    """This rank's place in Megatron's expert grid: (expert-TP, EP, expert-DP) ranks and the EP and expert-TP
    sizes."""

    etp_rank: int
    ep_rank: int
    edp_rank: int
    ep_size: int
    etp_size: int


def _expert_grid(model: torch.nn.Module) -> Optional[_ExpertGrid]:
    """``None`` for a dense model."""
    if unwrap_model(model).config.num_moe_experts is None:
        return None
    etp, ep, edp = megatron_expert_groups()
    return _ExpertGrid(etp.rank(), ep.rank(), edp.rank(), ep.size(), etp.size())


def _write_shard(model: torch.nn.Module, staging: Path, *, tp, pp, dense: bool,
                 experts: Optional[_ExpertGrid]) -> None:
    """This rank's stage as the converter's rank files, under its stage's local-spec names: with ``dense``, all but
    the routed experts (its tensor-parallel shard; a tied embedding's last-stage copy included, as
    ``hf-to-megatron`` writes it) into ``mp_rank_TT[_PPP]``; with ``experts``, its routed experts (its local expert
    numbers, its expert-TP shard) into ``mp_rank_UU_PPP_EEE``."""
    from safetensors.torch import save_file

    params = dict(unwrap_model(model).named_parameters())
    files = []
    if dense:
        files.append((rank_dir_name(tp.rank(), pp.rank(), pp.size()),
                      {n: p for n, p in params.items() if expert_of(n) is None}))
    if experts is not None:
        files.append((expert_rank_dir_name(experts.etp_rank, pp.rank(), experts.ep_rank),
                      {n: p for n, p in params.items() if expert_of(n) is not None}))
    for name, tensors in files:
        rank_dir = staging / RELEASE / name
        rank_dir.mkdir()
        # One file's tensors on the host at a time (safetensors serialises a whole file at once).
        save_file({n: p.detach().cpu().contiguous() for n, p in tensors.items()}, str(rank_dir / WEIGHTS_FILE))


def _convert(staging: Path, target: Path, pretrained_checkpoint: str, model: torch.nn.Module, *, tp: int,
             pp: int, experts: Optional[_ExpertGrid], iteration: Optional[int]) -> None:
    """Rank 0: the metadata next to the rank files, then the converter's Megatron → Hugging Face, marked as our
    export, onto ``target``."""
    source = read_meta(pretrained_checkpoint)
    dtype = next(model.parameters()).dtype
    arch = dataclasses.replace(source.architecture, params_dtype=str(dtype).removeprefix("torch."))
    config = dict(source.hf_config or {})
    for key in ("dtype", "torch_dtype"):  # transformers 5 writes dtype, 4 torch_dtype: the trained dtype now
        if key in config:
            config[key] = arch.params_dtype
    sizes = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if experts is not None:
        sizes.update(expert_model_parallel_size=experts.ep_size, expert_tensor_parallel_size=experts.etp_size)
    write_meta(staging, CheckpointMeta(
        architecture=arch, **sizes, transformer_impl="local", hf_model_type=source.hf_model_type,
        hf_config=config or None, megatron_lm_args=megatron_lm_args(arch, **sizes, transformer_impl="local")))
    assets = Path(os.path.abspath(pretrained_checkpoint)) / ASSETS_DIR
    if assets.is_dir():
        (staging / ASSETS_DIR).symlink_to(assets, target_is_directory=True)
    converted = target.parent / f".{target.name}.hf-partial"
    shutil.rmtree(converted, ignore_errors=True)  # left by an export that was killed
    try:
        megatron_to_hf(staging, converted, progress=False)  # written whole or not at all
        marker = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "iteration": iteration,
                  "files": sorted(os.listdir(converted))}
        (converted / EXPORT_MARKER).write_text(json.dumps(marker, indent=2) + "\n")  # inside the staged copy
        _replace_dir(converted, target)
    finally:
        shutil.rmtree(converted, ignore_errors=True)


def _replace_dir(new: Path, target: Path) -> None:
    """Rename ``new`` onto ``target``. An existing ``target`` is renamed aside first and its interval exports
    (``iter_*``) moved into the new one afterwards; the old one is deleted only once they all moved.
    ``FileExistsError`` when ``target`` is not an export to replace (checked at start-up too, but its content may
    have changed since)."""
    error = export_target_error(target)
    if error:
        raise FileExistsError(f"{target} {error}")
    if not target.exists():
        os.replace(new, target)
        return
    old = target.parent / f".{target.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(target, old)
    try:
        os.replace(new, target)
    except OSError:
        os.replace(old, target)
        raise
    for kept in sorted(old.glob("iter_*")):
        os.replace(kept, target / kept.name)
    shutil.rmtree(old)
