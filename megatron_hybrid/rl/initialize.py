"""Start-up of an RL run (what Megatron-LM's ``initialize_megatron`` does for pretraining): the process group,
Megatron's training groups, the CPU patches when there is no GPU, and the seeds."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import math
import random
import sys
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from ..megatron.patches import cpu_gloo
from . import phases


def select_device(args: argparse.Namespace, *, local_world_size: Optional[int] = None) -> str:
    """Apply ``--device`` and check that every rank of this node gets a GPU of its own; returns ``"cuda"`` or
    ``"cpu"``. Call it before anything touches CUDA (argument parsing does): ``--device cpu`` hides the GPUs from
    this process (``CUDA_VISIBLE_DEVICES=``), so :func:`initialize` takes gloo and megatron-core's CPU patches.

    ``ValueError`` (before any collective) when more ranks run on this node (``local_world_size``, default torchrun's
    ``LOCAL_WORLD_SIZE``) than GPUs are visible, naming both counts and the two launches that work; when
    ``--device cuda`` finds no GPU; and when ``--device cpu`` comes after CUDA already read its device list.
    """
    device = getattr(args, "device", None)
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if torch.cuda.is_available():  # the CUDA runtime read CUDA_VISIBLE_DEVICES before the flag could set it
            raise ValueError("--device cpu: CUDA was initialised in this process before the flag could hide the "
                             "GPUs; set CUDA_VISIBLE_DEVICES= in the launch's environment instead")
        return "cpu"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        if device == "cuda":
            raise ValueError("--device cuda: no GPU is visible to this process (torch.cuda.device_count() = 0; "
                             f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, torch "
                             f"{torch.__version__})")
        return "cpu"
    local = local_world_size if local_world_size is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local > gpus:
        script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else "train_ppo.py"
        t = math.gcd(args.tensor_model_parallel_size, gpus)
        raise ValueError(
            f"{local} ranks run on this node (torchrun --nproc_per_node {local}) but {gpus} GPU"
            f"{'s are' if gpus > 1 else ' is'} visible (torch.cuda.device_count() = {gpus}): every rank needs a GPU "
            f"of its own. Either run one rank per GPU, with parallel sizes whose product fits {gpus} rank"
            f"{'s' if gpus > 1 else ''}: `torchrun --nproc_per_node {gpus} {script} --tensor-model-parallel-size "
            f"{t} --rollout-tensor-model-parallel-size {math.gcd(args.rollout_tensor_model_parallel_size, t)} "
            f"...`; or keep {local} ranks on the CPU (gloo): `torchrun --nproc_per_node {local} {script} ... "
            "--device cpu`")
    return "cuda"


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
