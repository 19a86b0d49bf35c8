"""Resumable RL checkpoints: one file per rank, at the training layout it was written with.

``DIR/iter_{step:07d}/rank_{rank:05d}.pt`` holds what the caller passes (models, optimizer states and fp32 main
parameters, schedulers, KL controller, data position) plus the step, the (tensor, pipeline, data) sizes and the
torch, Python and Megatron RNG states. It is written into ``DIR/.iter_{step:07d}.tmp`` and renamed once every rank
has written, then ``latest_checkpointed_iteration.txt`` is replaced atomically; it is read back with
``torch.load(weights_only=True)`` (no pickled code), so everything in it must be tensors, numbers, strings and
containers of them.
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Any

import torch
import torch.distributed as dist

from ..compat import megatron_groups

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


def save_checkpoint(directory: str, step: int, state: dict[str, Any]) -> None:
    """Write this rank's ``state`` (and the RNG states) as iteration ``step``; called on every rank."""
    final = os.path.join(directory, f"iter_{step:07d}")
    tmp = os.path.join(directory, f".iter_{step:07d}.tmp")
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    payload = {"version": CHECKPOINT_VERSION, "step": step, "layout": _layout(), "rng": _rng_state(), **state}
    torch.save(payload, os.path.join(tmp, f"rank_{dist.get_rank():05d}.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest = os.path.join(directory, LATEST)
        with open(latest + ".tmp", "w") as f:
            f.write(f"{step}\n")
        os.replace(latest + ".tmp", latest)
    dist.barrier()


def load_checkpoint(directory: str) -> dict[str, Any]:
    """This rank's state of the latest iteration in ``directory``, with the RNG states restored; the returned
    dict has the caller's keys and ``step``. ``ValueError`` (naming ``--load``) for another layout or version."""
    with open(os.path.join(directory, LATEST)) as f:
        it = int(f.read().strip())
    path = os.path.join(directory, f"iter_{it:07d}", f"rank_{dist.get_rank():05d}.pt")
    if not os.path.isfile(path):
        raise ValueError(f"--load: {path} is missing (was the checkpoint written with another world size?)")
    state = torch.load(path, weights_only=True)
    if state.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"--load: {path} is a version {state.get('version')} checkpoint; this version reads "
                         f"version {CHECKPOINT_VERSION} (megatron-core optimizer states) only")
    if state["layout"] != _layout():
        raise ValueError(f"--load: the checkpoint's (tensor, pipeline, data) sizes {state['layout']} differ from "
                         f"this run's {_layout()}")
    _set_rng_state(state.pop("rng"))
    del state["version"], state["layout"]
    return state
