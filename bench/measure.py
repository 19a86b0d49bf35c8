"""What the one-device benchmarks share: timing with the device synchronised, the copy bandwidth, and a world of
one rank (NCCL on a GPU, gloo with megatron-core's CPU shim otherwise) with megatron-core's parallel state."""

from __future__ import annotations

import datetime
import gc
import json
import os
import socket
import statistics
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist


def rows_writer(path: Optional[str]) -> Callable[[list[dict[str, Any]]], None]:
    """A function that writes the JSON list at ``path`` as the rows it held before, then the rows it is given (a
    run's so far: call it after each step or run, and a time limit leaves what was measured); atomically, through
    a temporary file. ``path`` None: writes nothing."""
    existing = json.load(open(path)) if path and os.path.exists(path) else []

    def write(rows: list[dict[str, Any]]) -> None:
        if path:
            with open(path + ".tmp", "w") as f:
                json.dump(existing + rows, f, indent=1)
            os.replace(path + ".tmp", path)
    return write


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, *, runs: int, warmup: int) -> tuple[Any, list[float]]:
    """``fn()``'s last result and the wall times of ``runs`` calls after ``warmup`` untimed ones."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(runs):
        gc.collect()
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return out, times


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes read + written per second by a large device copy (median of 10 copies of ``nbytes``)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _, times = timed(lambda: dst.copy_(src), device, runs=10, warmup=2)
    return 2 * nbytes / statistics.median(times)


@contextmanager
def one_rank(device: torch.device, *, seed: int = 1234) -> Iterator[None]:
    """A world of one rank on ``device`` with megatron-core's model-parallel state (TP = PP = 1) and its inference
    RNG tracker (CUDA graphs need it: the default tracker's ``fork()`` cannot be captured); on the CPU inside
    megatron-core's CPU shim (:func:`megatron_hybrid.megatron.patches.cpu_gloo`). The process group goes at the end."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1, timeout=datetime.timedelta(minutes=30))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        shim = nullcontext()
    else:
        from megatron_hybrid.megatron.patches import cpu_gloo

        shim = cpu_gloo()
    try:
        with shim:
            ps.initialize_model_parallel(1, 1)
            model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
            yield
    finally:
        dist.destroy_process_group()
