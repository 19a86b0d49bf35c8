"""Resumable RL checkpoints in megatron-core's ``dist_checkpointing`` format (``torch_dist``), loadable at another
tensor/pipeline layout with the optimizer state included.

``DIR/iter_{step:07d}/`` is one ``dist_checkpointing`` checkpoint of the whole training state:

- each model's ``sharded_state_dict()`` under its name (``actor.``, ``critic.``, ``reference.``): every tensor is
  stored once, as shards of a global tensor, whatever the layout that wrote it;
- each trained model's megatron-core optimizer, ``optimizer.sharded_state_dict(model_sharded_state_dict)``
  as Megatron-LM saves it: Adam's moments and the fp32 main parameters as shards of the same global tensors as their
  parameters (``optimizer.state.exp_avg.actor.…``, ``optimizer.state.fp32_param.actor.…``), param groups and
  step in the common part; and its ``OptimizerParamScheduler``'s state in the common part. The distributed
  optimizer's too (``fully_reshardable``: its data-parallel slices are gathered into each parameter's shape
  first, so a checkpoint loads at any TP, PP and DP);
- the step and the caller's ``state`` (KL controller, data position) in the common part;
- ``rng/rank_{rank:05d}.safetensors``: this rank's torch, Python, Megatron RNG-tracker (and CUDA) states, as
  tensors and JSON metadata (nothing is unpickled). They are restored when the checkpoint is loaded at the layout
  that wrote it, so a resumed run reproduces the uninterrupted one; at another layout they mean nothing to the new
  ranks, which keep the states ``--seed`` gave them (with a warning), as Megatron-LM does;
- ``rl_checkpoint.json``, written last: format, version, step, (tensor, pipeline, data) sizes, model names and
  the size and SHA-256 of every file of the iteration (checkpoints written before the digests list sizes only).

Saving is crash-safe: at every instant ``latest_checkpointed_iteration.txt`` names a complete iteration. Every rank
writes its ``dist_checkpointing`` shards and its RNG file into ``DIR/.iter_{step:07d}.tmp`` (``dist_checkpointing``
reports a rank's failed write to every rank); the ranks agree that all of them succeeded (one all-reduce, so a rank
that failed makes every rank raise instead of hanging, and a rank that died leaves the others failing in a
collective); each rank hashes the files it wrote (see :func:`_writer`) and sends the digests to rank 0, and only
then does rank 0 sync the files, write the manifest and commit: an existing
``iter_{step:07d}`` is renamed aside to ``.iter_{step:07d}.old``, the new one renamed in, ``latest`` replaced
through a temporary file and ``os.replace``, and the old one deleted. A crash between the two renames leaves the
old copy, complete, under ``.old``: :func:`load_checkpoint` reads it there.

Loading is checked before training, and before any collective, on every rank: the manifest, the size of every
file it lists (every rank checks every file), the digests of the files the rank reads (see :func:`_verified_by`)
and its RNG file's content; the ranks then agree on the outcome (one all-reduce), so a missing, truncated, damaged
or foreign checkpoint is the same ``ValueError``, naming the file, on every rank, and no rank enters
``dist_checkpointing.load`` without the others. A failure inside ``dist_checkpointing.load`` is agreed the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from ..megatron import ddp_finish_param_sync, megatron_expert_ranks, megatron_groups, unwrap_model
from ..megatron.patches import distributed_optimizer_loading
from .faults import errors_on_every_rank
from .optimizer import TrainedModel
from .phases import recorded

FORMAT = "megatron-hybrid-rl"
#: 3: megatron-core dist_checkpointing (torch_dist); 2: per-rank torch.save files of megatron-core optimizers.
CHECKPOINT_VERSION = 3
LATEST = "latest_checkpointed_iteration.txt"
MANIFEST = "rl_checkpoint.json"
RNG_DIR = "rng"
#: The manifest's key for the files' digests. SHA-256 (hashlib, ~0.7 GB/s per core here, SHA-NI where the CPU has
#: it): a write that went wrong anywhere, as well as a flipped bit, changes it.
DIGEST = "sha256"

#: What :func:`save_checkpoint` and :func:`load_checkpoint` take by name: a model under training (its optimizer
#: and scheduler included), a frozen module (the reference), or ``None`` (a model this run does not have).
Checkpointed = Optional[Union[TrainedModel, torch.nn.Module]]


def _layout() -> list[int]:
    """(tensor, pipeline, data) sizes, and (expert, expert tensor) where experts are split (the RNG states of
    Megatron's expert-parallel tracker are per expert rank)."""
    tp, pp, dp, _ = megatron_groups()
    _, ep, _, etp = megatron_expert_ranks()
    return [tp.size(), pp.size(), dp.size()] + ([ep, etp] if (ep, etp) != (1, tp.size()) else [])


# ---- RNG states: one safetensors file per rank ----------------------------------------------------------------
def _write_rng_state(path: str) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from safetensors.torch import save_file

    version, internal, gauss_next = random.getstate()
    tensors = {"torch": torch.get_rng_state(), "python": torch.tensor(internal, dtype=torch.int64)}
    tensors.update({f"tracker.{name}": state for name, state in get_cuda_rng_tracker().get_states().items()})
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state()
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, path,
              metadata={"python_version": json.dumps(version), "python_gauss_next": json.dumps(gauss_next)})


def _read_rng_state(path: str) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    python = (json.loads(meta["python_version"]), tuple(tensors.pop("python").tolist()),
              json.loads(meta["python_gauss_next"]))
    tracker = {k.removeprefix("tracker."): v for k, v in tensors.items() if k.startswith("tracker.")}
    return {"torch": tensors["torch"], "python": python, "tracker": tracker, "cuda": tensors.get("cuda")}


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---- the sharded state dict -----------------------------------------------------------------------------------
#: How megatron-core's ``DistributedOptimizer`` lays out its state in a checkpoint (Megatron-LM's
#: ``sharding_type``, 0.16.1 – 0.19.x). ``dp_reshardable``, Megatron-LM's default, stores DDP's flat buckets and
#: loads at another DP size only; ``fully_sharded_model_space`` (0.16.1's default) stores each rank's flat slice
#: of each parameter, which 0.16.1's dist_checkpointing refuses (``flattened_range is not supported``);
#: ``fully_reshardable`` (Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``) all-gathers the slices over DP
#: and stores every state in its parameter's shape and shards, as the other optimizers do: any TP/PP/DP loads it.
#: The other optimizers ignore it.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _sharded_state_dict(models: Mapping[str, Checkpointed], *, is_loading: bool) -> dict[str, Any]:
    """Megatron-LM's ``generate_state_dict`` for several models: each under its name, keys prefixed by it."""
    out: dict[str, Any] = {}
    for name, m in models.items():
        if m is None:
            continue
        trained = isinstance(m, TrainedModel)
        model_sd = unwrap_model(m.model if trained else m).sharded_state_dict(prefix=f"{name}.")
        out[name] = {"model": model_sd}
        if trained:
            # Its states and fp32 main parameters become shards of the parameters' global tensors, so they
            # reshard like the parameters.
            out[name]["optimizer"] = m.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                                    metadata=dict(OPTIMIZER_METADATA))
            out[name]["scheduler"] = m.scheduler.state_dict()
    return out


def _describe(e: BaseException) -> str:
    """One line for an exception; for ``dist_checkpointing``'s ``CheckpointException`` the failures it gathered
    from the ranks (the coordinator, rank 0, holds them all; the others hold none: ``""``)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        return "; ".join(f"dist_checkpointing: rank {r} failed with {type(f[0]).__name__}: {f[0]}"
                         for r, f in sorted(failures.items()))
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}"


# ---- digests ----------------------------------------------------------------------------------------------------
#: ``dist_checkpointing``'s shard files are named by the global rank that wrote them (megatron-core 0.16.1 –
#: 0.19.x, ``FileSystemWriterAsync``: ``[hint]__{rank}_{n}.distcp``); our RNG files by theirs.
_SHARD = re.compile(r"__(\d+)_\d+\.distcp$")
_RNG_FILE = re.compile("^" + re.escape(os.path.join(RNG_DIR, "rank_")) + r"(\d+)\.safetensors$")


def _writer(name: str) -> int:
    """The rank that wrote the file ``name`` (a path relative to the iteration) and hashes it at save: a shard or
    RNG file's rank, rank 0 (``dist_checkpointing``'s coordinator) for the rest (``common.pt``, ``metadata.json``,
    ``.metadata``).

    Hashing on the writer spreads the reading over the ranks as the writing was (a multi-GB checkpoint is not read
    through one rank) and reads what the rank's node has just written, most of it still in its page cache."""
    m = _SHARD.search(os.path.basename(name)) or _RNG_FILE.match(name)
    return int(m.group(1)) if m else 0


def _verified_by(files: Mapping[str, int], rank: int, world_size: int, *, rng: bool) -> list[str]:
    """The files of ``files`` (relative path → size) whose digests ``rank`` of a load on ``world_size`` ranks
    verifies: the ones every rank reads (all but shard and RNG files), its own RNG file when it restores it
    (``rng``), and a share of the shard files.

    Which ranks read which shard files is decided inside ``dist_checkpointing`` from the shardings at both layouts;
    instead the shard files are split over the ranks by size (each verifies about 1/``world_size`` of the bytes),
    and the ranks agree on the outcome before ``dist_checkpointing`` reads any: a damaged shard is found wherever it
    is, each shard read once."""
    shards = sorted((n for n in files if _SHARD.search(os.path.basename(n))), key=lambda n: (-files[n], n))
    load = [0] * world_size
    mine = []
    for name in shards:  # the largest first, each to the least loaded rank: the same split on every rank
        owner = load.index(min(load))
        load[owner] += files[name]
        if owner == rank:
            mine.append(name)
    own_rng = os.path.join(RNG_DIR, f"rank_{rank:05d}.safetensors")
    common = [n for n in files if not _SHARD.search(os.path.basename(n)) and not _RNG_FILE.match(n)]
    return sorted(common + mine + ([own_rng] if rng and own_rng in files else []))


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, DIGEST).hexdigest()


def _digests(root: str, names: Iterable[str]) -> dict[str, str]:
    """The SHA-256 of the files ``names`` under ``root``, a thread per file (up to 8): ``dist_checkpointing``
    writes a rank's shards as several files (2 by default), and hashlib and file reads release the GIL, so they
    are hashed on as many cores."""
    names = list(names)
    with ThreadPoolExecutor(max_workers=max(1, min(len(names), 8))) as pool:
        return dict(zip(names, pool.map(lambda name: _sha256(os.path.join(root, name)), names)))


# ---- saving ---------------------------------------------------------------------------------------------------
def _iteration_dirs(directory: str, step: int) -> tuple[str, str, str]:
    """``(final, temporary, old)`` directories of iteration ``step``."""
    name = f"iter_{step:07d}"
    return (os.path.join(directory, name), os.path.join(directory, f".{name}.tmp"),
            os.path.join(directory, f".{name}.old"))


def _write_synced(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _files(root: str) -> dict[str, int]:
    """Every file under ``root`` by relative path, with its size."""
    out = {}
    for parent, _, names in os.walk(root):
        for name in names:
            path = os.path.join(parent, name)
            out[os.path.relpath(path, root)] = os.path.getsize(path)
    return dict(sorted(out.items()))


def _sync_tree(root: str) -> None:
    """fsync every file and directory under ``root`` (``dist_checkpointing`` syncs its shards, not the rest)."""
    for parent, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(parent, name), "rb") as f:
                os.fsync(f.fileno())
        fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _agreed(step: int, error: Optional[str]) -> None:
    """``OSError`` on every rank when some rank failed (``error``)."""
    errors = errors_on_every_rank([error] if error else [])
    if errors:
        raise OSError(f"--save: iteration {step} was not saved ({'; '.join(errors)})")


@recorded("save", step="step")
def save_checkpoint(directory: str, step: int, models: Mapping[str, Checkpointed], state: dict[str, Any]) -> None:
    """Write iteration ``step``: ``models`` by name (their parameters; for a :class:`TrainedModel` also its
    optimizer and scheduler), ``state`` (numbers, strings, containers of them: the KL controller, the data
    position) and this rank's RNG states; called on every rank with the same names.

    ``OSError`` on every rank, naming the files, when some rank could not write; ``latest`` then still names the
    previous iteration, and an existing iteration ``step`` is untouched.
    """
    from megatron.core import dist_checkpointing

    final, tmp, old = _iteration_dirs(directory, step)
    for m in models.values():  # with --overlap-param-gather the last step's weights are still being gathered
        if isinstance(m, TrainedModel):
            ddp_finish_param_sync(m.model)
    rank = dist.get_rank()
    error = None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed earlier
            os.makedirs(tmp)
        except OSError as e:
            error = f"{tmp}: {type(e).__name__}: {e}"
    try:
        # Also the barrier after which the directory exists for every rank.
        _agreed(step, error)
        sharded = _sharded_state_dict(models, is_loading=False)
        sharded.update(step=step, state=state)
        try:
            dist_checkpointing.save(sharded, tmp)
        except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
            # A rank's failed write raises on every rank, its details on the coordinator (rank 0) only.
            error = f"{tmp}: {_describe(e)}" if _describe(e) else None
        _agreed(step, error)
        rng = os.path.join(tmp, RNG_DIR, f"rank_{rank:05d}.safetensors")
        digests: dict[str, str] = {}
        try:
            os.makedirs(os.path.dirname(rng), exist_ok=True)
            _write_rng_state(rng)
        except Exception as e:  # a full disk, a quota, a lost mount: every rank must learn of it
            error = f"{rng}: {type(e).__name__}: {e}"
        _agreed(step, error)
        # Only now is the directory complete for every rank to list: before, another rank may still be writing
        # its RNG file (through a temporary file that safetensors renames).
        try:
            digests = _digests(tmp, [n for n in _files(tmp) if _writer(n) == rank])
        except OSError as e:  # names the file
            error = f"{tmp}: cannot hash the files of rank {rank} ({type(e).__name__}: {e})"
        _agreed(step, error)
        everyone: Optional[list[Any]] = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(digests, everyone, dst=0)  # a few small dicts: one line per file
        if rank == 0:
            try:
                _sync_tree(tmp)
                files = _files(tmp)
                sha256 = {name: digest for mine in everyone for name, digest in mine.items()}
                assert sorted(sha256) == list(files), (sorted(sha256), list(files))  # _writer covers every file
                manifest = {"format": FORMAT, "version": CHECKPOINT_VERSION, "step": step, "layout": _layout(),
                            "models": [n for n, m in models.items() if m is not None], "files": files,
                            DIGEST: dict(sorted(sha256.items()))}
                _write_synced(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1) + "\n")
            except OSError as e:
                error = f"{os.path.join(tmp, MANIFEST)}: {type(e).__name__}: {e}"
        _agreed(step, error)
    except OSError as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(f"{e}; {os.path.join(directory, LATEST)} still names the previous iteration") from None
    if rank == 0:
        if os.path.isdir(final):
            shutil.rmtree(old, ignore_errors=True)  # left by a crash after the commit: final is complete
            os.replace(final, old)
        os.replace(tmp, final)
        latest = os.path.join(directory, LATEST)
        _write_synced(latest + ".tmp", f"{step}\n")
        os.replace(latest + ".tmp", latest)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


# ---- loading --------------------------------------------------------------------------------------------------
def latest_iteration(directory: str) -> int:
    """The iteration ``DIR/latest_checkpointed_iteration.txt`` names; ``ValueError`` naming the file and its
    content when it is missing or not a non-negative integer."""
    latest = os.path.join(directory, LATEST)
    try:
        with open(latest) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--load: cannot read {latest} ({type(e).__name__}: {e})") from e
    if not text.strip().isdigit():
        raise ValueError(f"--load: {latest} must hold an iteration number (a non-negative integer, written by "
                         f"save_checkpoint), it holds {text[:80]!r}")
    return int(text)


def iteration_dir(directory: str) -> str:
    """The directory of the iteration ``latest`` names (``.old`` when a re-save crashed between its renames)."""
    final, _, old = _iteration_dirs(directory, latest_iteration(directory))
    return old if not os.path.isdir(final) and os.path.isdir(old) else final


def _manifest(directory: str, names: Optional[list[str]]) -> tuple[str, dict[str, Any]]:
    """The latest iteration's directory and its manifest after checking it and the size of every file it lists;
    ``ValueError`` naming the file for a bad ``latest``, a missing or foreign manifest, a missing or truncated
    file, or (``names``) a model the checkpoint lacks."""
    it = iteration_dir(directory)
    path = os.path.join(it, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--load: {path} cannot be read ({type(e).__name__}: {e}); {it} is not a complete "
                         f"{FORMAT} checkpoint (written by save_checkpoint)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
            or manifest.get("version") != CHECKPOINT_VERSION:
        found = (manifest.get("format"), manifest.get("version")) if isinstance(manifest, dict) else manifest
        raise ValueError(f"--load: {path} describes a {found!r} checkpoint; this version reads "
                         f"({FORMAT!r}, {CHECKPOINT_VERSION}) (megatron-core dist_checkpointing) only")
    if DIGEST in manifest and sorted(manifest[DIGEST]) != sorted(manifest["files"]):
        raise ValueError(f"--load: {path} is damaged: its {DIGEST!r} and 'files' name different files")
    for name, size in manifest["files"].items():
        file = os.path.join(it, name)
        actual = os.path.getsize(file) if os.path.isfile(file) else None
        if actual is None:
            raise ValueError(f"--load: {file} is missing")
        if actual != size:
            raise ValueError(f"--load: {file} cannot be read, it is truncated, empty or not a checkpoint "
                             f"({actual} bytes, {path} says {size})")
    missing = sorted(set(names or ()) - set(manifest["models"]))
    if missing:
        raise ValueError(f"--load: {it} holds the models {manifest['models']}, not {missing} that this run "
                         f"trains")
    return it, manifest


def _verify(it: str, manifest: dict[str, Any], names: Iterable[str]) -> None:
    """``ValueError`` naming the first of the files ``names`` whose SHA-256 is not the manifest's; nothing for a
    manifest without digests."""
    if DIGEST not in manifest:
        return
    try:
        digests = _digests(it, names)
    except OSError as e:  # permissions, a lost mount (the message names the file): agreed, not a hang
        raise ValueError(f"--load: {it} cannot be read ({type(e).__name__}: {e})") from None
    for name, actual in digests.items():
        if actual != manifest[DIGEST][name]:
            raise ValueError(f"--load: {os.path.join(it, name)} is damaged: its sha256 is {actual[:16]}…, "
                             f"{os.path.join(it, MANIFEST)} says {manifest[DIGEST][name][:16]}…")


def _unverified_warning(it: str) -> str:
    return (f"--load: {os.path.join(it, MANIFEST)} lists no digests (a checkpoint written before they were): its "
            f"files are checked by size only")


def check_checkpoint(directory: str, names: Optional[list[str]] = None) -> dict[str, Any]:
    """The manifest of the latest iteration in ``directory`` after checking it, the size and the digest of every
    file it lists (no collective; all files in this process); ``ValueError`` naming the file for a bad
    ``latest``, a missing or foreign manifest, a missing, truncated or damaged file, or (``names``) a model the
    checkpoint lacks."""
    it, manifest = _manifest(directory, names)
    if DIGEST not in manifest:
        warnings.warn(_unverified_warning(it), stacklevel=2)
    _verify(it, manifest, manifest["files"])
    return manifest


def _check_expert_optimizers(it: str, saved_layout: list[int], models: Mapping[str, Checkpointed]) -> None:
    """``ValueError`` when a trained MoE model's optimizer was saved with expert parallelism and is loaded without
    it, or the other way round: megatron-core (0.16.1) gives the routed experts an optimizer of their own only at
    EP > 1 (at EP = 1 they are ordinary data-parallel parameters), so the saved optimizer's structure (a
    ``ChainedOptimizer`` of one or two) does not match."""
    saved_ep = saved_layout[3] if len(saved_layout) > 3 else 1
    ep = megatron_expert_ranks()[1]
    moe = [name for name, m in models.items() if isinstance(m, TrainedModel)
           and unwrap_model(m.model).config.num_moe_experts is not None]
    if moe and (saved_ep > 1) != (ep > 1):
        raise ValueError(f"--load: {it} holds the optimizer of {', '.join(moe)} at expert-parallel size {saved_ep}; "
                         f"megatron-core keeps the experts' optimizer apart only at sizes > 1, so it cannot be "
                         f"loaded at expert-parallel size {ep}: resume at a size {'> 1' if saved_ep > 1 else 'of 1'}")


@recorded("load")
def load_checkpoint(directory: str, models: Mapping[str, Checkpointed]) -> dict[str, Any]:
    """Load the latest iteration in ``directory`` into ``models`` (in place: parameters, and for a
    :class:`TrainedModel` its optimizer's states, fp32 main parameters and its scheduler), at whatever
    (tensor, pipeline, data) layout this run has; restore this rank's RNG states when the layout is the one that
    wrote them. Returns the ``state`` that was saved, with ``step``.

    Called on every rank, before training: ``ValueError`` on every rank, naming the file(s), for a bad ``latest``
    file, a checkpoint that is incomplete, damaged, of another format or lacks one of ``models``.
    """
    from megatron.core import dist_checkpointing

    names = [n for n, m in models.items() if m is not None]
    rank = dist.get_rank()
    it, manifest, rng, error = None, None, None, None
    # Every check a rank can make alone, then one agreement: a rank that found a fault must not leave the others
    # in dist_checkpointing.load's collectives.
    try:
        it, manifest = _manifest(directory, names)
        _check_expert_optimizers(it, manifest["layout"], models)
        same_layout = manifest["layout"] == _layout()
        _verify(it, manifest, _verified_by(manifest["files"], rank, dist.get_world_size(), rng=same_layout))
        if same_layout:
            path = os.path.join(it, RNG_DIR, f"rank_{rank:05d}.safetensors")
            try:
                rng = _read_rng_state(path)
            except Exception as e:  # safetensors raises its own errors for a damaged file
                raise ValueError(f"--load: {path} cannot be read ({_describe(e)})") from None
    except ValueError as e:
        error = str(e)
    errors = errors_on_every_rank([error] if error else [])
    if errors:
        raise ValueError("; ".join(errors))
    if DIGEST not in manifest and rank == 0:
        warnings.warn(_unverified_warning(it), stacklevel=2)
    loaded = None
    # torch's Adam in megatron-core's DistributedOptimizer (megatron_hybrid/megatron/patches/distrib_optimizer.py)
    with distributed_optimizer_loading([m.optimizer for m in models.values() if isinstance(m, TrainedModel)]):
        try:
            with warnings.catch_warnings():
                # megatron-core (0.16.1) calls torch.distributed.checkpoint.load_state_dict, deprecated in
                # torch 2.13.
                warnings.filterwarnings("ignore", message=".*load_state_dict. is deprecated",
                                        category=FutureWarning)
                loaded = dist_checkpointing.load(_sharded_state_dict(models, is_loading=True), it)
        except (Exception, CheckpointException) as e:  # a failure the checks could not see: agreed, naming the dir
            error = f"--load: {it} cannot be read by dist_checkpointing ({_describe(e) or type(e).__name__})"
        errors = errors_on_every_rank([error] if error else [])
        if errors:
            raise ValueError("; ".join(errors))
        for name in names:
            m = models[name]
            trained = isinstance(m, TrainedModel)
            # In place (load_state_dict copies): views of the parameters, e.g. the HybridEngine's, stay valid.
            unwrap_model(m.model if trained else m).load_state_dict(
                {k.removeprefix(f"{name}."): v for k, v in loaded[name]["model"].items()})
            if trained:
                m.optimizer.load_state_dict(loaded[name]["optimizer"])
                m.scheduler.load_state_dict(loaded[name]["scheduler"])
    if rng is not None:
        _set_rng_state(rng)
    elif rank == 0:
        axes = "tensor, pipeline, data" + (", expert, expert tensor" if len(manifest["layout"]) > 3 else "")
        warnings.warn(f"--load: {it} was written with ({axes}) sizes {manifest['layout']}, this "
                      f"run has {_layout()}: its RNG states are not restored (the ranks keep --seed's)",
                      stacklevel=2)
    return {**loaded["state"], "step": loaded["step"]}
