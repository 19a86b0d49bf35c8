"""Start-up of an RL run (what Megatron-LM's ``initialize_megatron`` does for pretraining): the process group,
Megatron's training groups, the CPU patches when there is no GPU, and the seeds."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import random
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from ..patches import cpu_gloo
from . import phases


@contextlib.contextmanager
def initialize(args: argparse.Namespace) -> Iterator[None]:
    """The process group (from torchrun's environment unless one exists; gloo on CPU, NCCL on GPU), megatron-core's
    CPU patches when there is no GPU, and Megatron's training groups (unless set up already, with the same sizes),
    all with ``--distributed-timeout-minutes``; seeds from ``--seed``. What this block set up it tears down.
    During the block each rank records the phases of the run (:mod:`.phases`), so that a collective that times out
    names its phase, the timeout and the ranks that did not arrive.

    ``ValueError`` when Megatron's groups exist with other (tensor, pipeline, expert, expert tensor) sizes than
    the arguments'.
    """
    use_cuda = torch.cuda.is_available()
    own_pg = not dist.is_initialized()
    if own_pg:
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if use_cuda else "gloo",
                                timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    try:
        recorder = phases.PhaseRecorder.for_default_group(
            timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes),
            timeout_source=f"--distributed-timeout-minutes {args.distributed_timeout_minutes:g}")
        with contextlib.nullcontext() if use_cuda else cpu_gloo(), phases.recording(recorder):
            own_mp = not ps.model_parallel_is_initialized()
            t, p = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
            e, et = args.expert_model_parallel_size, args.expert_tensor_parallel_size or t  # megatron's default
            if own_mp:
                # megatron-core (0.16.1) annotates the minutes as int but only computes timedelta(minutes=...)
                # from them, so fractional minutes reach its groups unchanged.
                with phases.phase("initialize"):
                    ps.initialize_model_parallel(tensor_model_parallel_size=t, pipeline_model_parallel_size=p,
                                                 expert_model_parallel_size=e, expert_tensor_parallel_size=et,
                                                 distributed_timeout_minutes=args.distributed_timeout_minutes)
            else:
                have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                        ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size())
                if have != (t, p, e, et):
                    raise ValueError(f"Megatron's parallel state is set up for (tensor, pipeline, expert, expert "
                                     f"tensor) = {have}, the arguments ask for {(t, p, e, et)}")
            model_parallel_cuda_manual_seed(args.seed)
            torch.manual_seed(args.seed)
            random.seed(args.seed)
            try:
                yield
            finally:
                if own_mp:
                    ps.destroy_model_parallel()
    finally:
        if own_pg:
            dist.destroy_process_group()
