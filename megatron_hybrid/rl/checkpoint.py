"""Resumable RL checkpoints: one file per rank, at the training layout it was written with.

``DIR/iter_{step:07d}/rank_{rank:05d}.pt`` holds what the caller passes (models, optimizer states and fp32 main
parameters, schedulers, KL controller, data position) plus the step, the (tensor, pipeline, data) sizes and the
torch, Python and Megatron RNG states. It is read back with ``torch.load(weights_only=True)`` (no pickled code), so
everything in it must be tensors, numbers, strings and containers of them.

Saving is crash-safe: at every instant ``latest_checkpointed_iteration.txt`` names a complete iteration. Every rank
writes (and syncs) its file into ``DIR/.iter_{step:07d}.tmp``; the ranks agree that all of them wrote it (one
all-reduce, so a rank that failed makes every rank raise instead of hanging, and a rank that died leaves the others
failing in that collective) and only then does rank 0 commit: an existing ``iter_{step:07d}`` is renamed aside to
``.iter_{step:07d}.old``, the new one renamed in, ``latest`` replaced through a temporary file and
``os.replace``, and the old one deleted. A crash between the two renames leaves the old copy, complete, under
``.old``: :func:`load_checkpoint` reads it there.

Loading is checked before training on every rank: each rank opens its own file, and the ranks agree (one
all-reduce) so that a missing, truncated or foreign file is the same ``ValueError``, naming the file, on every rank.
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..compat import megatron_groups
from .faults import errors_on_every_rank

#: 2: megatron-core optimizers (states, fp32 main parameters) and learning-rate schedulers; 1: torch.optim.Adam.
CHECKPOINT_VERSION = 2
LATEST = "latest_checkpointed_iteration.txt"


def _layout() -> list[int]:
    tp, pp, dp, _ = megatron_groups()
    return [tp.size(), pp.size(), dp.size()]


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "tracker": get_cuda_rng_tracker().get_states(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    # random.setstate wants tuples; a weights-only load gives lists.
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    get_cuda_rng_tracker().set_states(state["tracker"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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


def save_checkpoint(directory: str, step: int, state: dict[str, Any]) -> None:
    """Write this rank's ``state`` (and the RNG states) as iteration ``step``; called on every rank.

    ``OSError`` on every rank, naming the files, when some rank could not write its file; ``latest`` then still
    names the previous iteration, and an existing iteration ``step`` is untouched.
    """
    final, tmp, old = _iteration_dirs(directory, step)
    rank = dist.get_rank()
    error = None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed earlier
            os.makedirs(tmp)
        except OSError as e:
            error = f"{tmp}: {type(e).__name__}: {e}"
    # Also the barrier after which the directory exists for every rank.
    errors = errors_on_every_rank([error] if error else [])
    payload = {"version": CHECKPOINT_VERSION, "step": step, "layout": _layout(), "rng": _rng_state(), **state}
    path = os.path.join(tmp, f"rank_{rank:05d}.pt")
    if not errors:
        try:
            with open(path, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
        except Exception as e:  # a full disk, a quota, a lost mount: every rank must learn of it
            error = f"{path}: {type(e).__name__}: {e}"
        errors = errors_on_every_rank([error] if error else [])
    if errors:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(f"--save: iteration {step} was not saved ({'; '.join(errors)}); "
                      f"{os.path.join(directory, LATEST)} still names the previous iteration")
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


def _read_rank_file(directory: str) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """This rank's state of the latest iteration, or the error naming the file."""
    try:
        it = latest_iteration(directory)
    except ValueError as e:
        return None, str(e)
    final, _, old = _iteration_dirs(directory, it)
    if not os.path.isdir(final) and os.path.isdir(old):  # a re-save of ``it`` crashed between its two renames
        final = old
    path = os.path.join(final, f"rank_{dist.get_rank():05d}.pt")
    if not os.path.isfile(path):
        return None, f"--load: {path} is missing (was the checkpoint written with another world size?)"
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:  # torch.load raises anything from EOFError to RuntimeError for a damaged file
        return None, (f"--load: {path} cannot be read, it is truncated, empty or not a checkpoint "
                      f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    if not isinstance(state, dict) or state.get("version") != CHECKPOINT_VERSION:
        version = state.get("version") if isinstance(state, dict) else None
        return None, (f"--load: {path} is a version {version} checkpoint; this version reads version "
                      f"{CHECKPOINT_VERSION} (megatron-core optimizer states) only")
    if state.get("layout") != _layout():
        return None, (f"--load: {path} was written with (tensor, pipeline, data) sizes {state.get('layout')}, "
                      f"this run has {_layout()}")
    return state, None


def load_checkpoint(directory: str) -> dict[str, Any]:
    """This rank's state of the latest iteration in ``directory``, with the RNG states restored; the returned
    dict has the caller's keys and ``step``. Called on every rank, before training: ``ValueError`` on every rank,
    naming the file(s), for a bad ``latest`` file or a rank file that is missing, damaged, of another version or
    of another layout."""
    state, error = _read_rank_file(directory)
    errors = errors_on_every_rank([error] if error else [])
    if errors:
        raise ValueError("; ".join(errors))
    _set_rng_state(state.pop("rng"))
    del state["version"], state["layout"]
    return state
