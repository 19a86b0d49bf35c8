"""What the probes share: the bench's gpu-1b model in a HybridEngine (rollout layout TP=1, PP=1) on one GPU, one NCCL
rank, with megatron-core's inference RNG tracker (CUDA graphs need it)."""

from __future__ import annotations

import datetime
import socket
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shapes import SHAPES  # noqa: E402


@contextmanager
def engine_on_one_gpu(shape: str = "gpu-1b") -> Iterator[tuple]:
    """``(arch, engine)`` for the body; the engine and the process group are closed after it."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_hybrid import HybridEngine, RolloutLayout

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(minutes=10))
    torch.cuda.set_device(0)
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)
    arch = SHAPES[shape]
    engine = HybridEngine(arch.build().cuda(), RolloutLayout(1, 1))
    try:
        yield arch, engine
    finally:
        engine.switch_to_training()
        engine.close()
        dist.destroy_process_group()
