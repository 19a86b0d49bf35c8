"""Hugging Face vs megatron-core logits for the same tokens, both on CPU in fp32.

megatron-core runs on gloo ranks under :func:`megatron_hybrid.megatron.patches.cpu_gloo`: spawned here (TP × PP × DP
processes, DP the fewest data-parallel replicas over which EP × ETP experts ranks fit, rendezvous on a
``TCPStore`` that the OS gives a free port), in this process when all sizes are 1, or as launched by ``torchrun``
(:func:`megatron_logits_on_rank` on every rank).
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import math
import os
import queue
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..megatron.patches import cpu_gloo
from . import hf_checkpoint as hfc
from .layout import MegatronCheckpoint, check_parallel_sizes, load_megatron_checkpoint, read_architecture

#: fp32 logits of the same weights computed by two implementations differ by reordered sums: ~1e-7 relative per
#: op, growing with depth and width to ~1e-5 relative for a 1B model; logits there reach |z| ≈ 30, so ~3e-4
#: absolute. A layout bug (a swapped head, a missing rope scaling, a shifted vocabulary row) moves logits by
#: ≥ 1e-2. 1e-3 sits between the two.
DEFAULT_ATOL = 1e-3


@dataclass
class Comparison:
    max_abs_diff: float
    mean_abs_diff: float
    top1_agreement: float
    num_tokens: int

    def passed(self, atol: float) -> bool:
        return self.max_abs_diff <= atol

    def report(self, atol: float) -> str:
        verdict = "PASS" if self.passed(atol) else "FAIL"
        return (f"max |Δlogit| {self.max_abs_diff:.3e}, mean |Δlogit| {self.mean_abs_diff:.3e}, top-1 agreement "
                f"{100 * self.top1_agreement:.2f}% of {self.num_tokens} tokens; atol {atol:g}: {verdict}")


def compare(reference: torch.Tensor, other: torch.Tensor) -> Comparison:
    if reference.shape != other.shape:
        raise ValueError(f"logit shapes differ: {list(reference.shape)} vs {list(other.shape)}")
    diff = (reference.double() - other.double()).abs()
    top1 = (reference.argmax(-1) == other.argmax(-1)).double().mean().item()
    return Comparison(diff.max().item(), diff.mean().item(), top1, reference.shape[0] * reference.shape[1])


def random_tokens(vocab_size: int, *, batch_size: int = 2, seq_length: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch_size, seq_length), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf_dir: str | os.PathLike, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits ``[batch, seq, vocab]``, fp32, eager attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def megatron_logits_on_rank(megatron_dir: str | os.PathLike, tokens: torch.Tensor) -> Optional[torch.Tensor]:
    """Build this rank's GPTModel stage (fp32) from the checkpoint and run ``tokens`` through the pipeline.

    Call on every rank with Megatron's parallel state initialised (expert sizes included); the last stage returns
    the full logits ``[batch, seq, vocab]`` (gathered over TP, padding sliced off), the others ``None``. Every
    data-parallel replica runs the same tokens.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    arch = dataclasses.replace(read_architecture(megatron_dir), params_dtype="float32")
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    model = arch.build(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pre_process=first,
                       post_process=last, **(dict(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
                                             if arch.num_experts is not None else {}))
    load_megatron_checkpoint([model], megatron_dir, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp,
                             ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ep,
                             etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=etp)
    model.eval()
    batch, seq = tokens.shape
    positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    with torch.no_grad():
        if not first:
            hidden = torch.empty(seq, batch, arch.hidden_size)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(tokens, positions, None)
        if not last:
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
        parts = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
        return torch.cat(parts, dim=-1)[..., : arch.vocab_size]


def data_parallel_size_for(*, tensor_model_parallel_size: int, expert_model_parallel_size: int = 1,
                           expert_tensor_parallel_size: Optional[int] = None) -> int:
    """The fewest data-parallel replicas d for which megatron-core can lay EP × ETP expert ranks over a stage's
    TP × d ranks (EP × ETP must divide TP × d)."""
    tp = tensor_model_parallel_size
    experts = expert_model_parallel_size * (expert_tensor_parallel_size or tp)
    return math.lcm(tp, experts) // tp


def _in_parallel_state(tp: int, pp: int, megatron_dir: str, tokens: torch.Tensor, ep: int = 1,
                       etp: Optional[int] = None) -> Optional[torch.Tensor]:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    with cpu_gloo():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        try:
            model_parallel_cuda_manual_seed(0)
            return megatron_logits_on_rank(megatron_dir, tokens)
        finally:
            ps.destroy_model_parallel()


def _spawned_rank(rank: int, world_size: int, port: int, tp: int, pp: int, ep: int, etp: Optional[int],
                  megatron_dir: str, tokens: torch.Tensor, results: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=datetime.timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        logits = _in_parallel_state(tp, pp, megatron_dir, tokens, ep, etp)
        dist.destroy_process_group()
        # As bytes: a tensor would travel as a shared-memory handle that dies with this process.
        payload = None
        if logits is not None:
            buf = io.BytesIO()
            torch.save(logits, buf)
            payload = buf.getvalue()
        results.put((rank, True, payload))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def megatron_logits(megatron_dir: str | os.PathLike, tokens: torch.Tensor, *, tensor_model_parallel_size: int = 1,
                    pipeline_model_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                    expert_tensor_parallel_size: Optional[int] = None, timeout_s: float = 600) -> torch.Tensor:
    """megatron-core's logits at the given TP/PP/EP/ETP, on TP × PP × DP gloo ranks spawned for the purpose
    (DP: :func:`data_parallel_size_for`)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    ep, etp = expert_model_parallel_size, expert_tensor_parallel_size
    world = tp * pp * data_parallel_size_for(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_spawned_rank, args=(r, world, store.port, tp, pp, ep, etp, str(megatron_dir), tokens,
                                                     results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    logits, failures, done = None, [], set()
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) < world and not failures:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode not in (None, 0)]
                if dead:  # died before it could report (e.g. killed, or failed to start)
                    failures.append(f"ranks {dead} exited with codes {[procs[r].exitcode for r in dead]}")
                elif time.monotonic() > deadline:
                    raise RuntimeError(f"megatron-core ranks did not finish within {timeout_s:.0f} s") from None
                continue
            done.add(rank)
            if not ok:  # the others may be stuck in a collective with the failed rank: stop here
                failures.append(f"--- rank {rank} ---\n{payload}")
            elif payload is not None:
                logits = torch.load(io.BytesIO(payload), weights_only=True)
    finally:
        for p in procs:
            p.join(timeout=5 if failures else 30)
            if p.is_alive():
                p.kill()
    if failures:
        raise RuntimeError("megatron-core rank failed:\n" + "\n".join(failures))
    assert logits is not None
    return logits


def megatron_logits_here(megatron_dir: str | os.PathLike, tokens: torch.Tensor) -> torch.Tensor:
    """megatron-core's logits at TP = PP = 1 in this process (a one-rank gloo group of its own)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        return _in_parallel_state(1, 1, str(megatron_dir), tokens)
    finally:
        dist.destroy_process_group()


def verify(hf_dir: str | os.PathLike, megatron_dir: str | os.PathLike, *, tensor_model_parallel_size: int = 1,
           pipeline_model_parallel_size: int = 1, expert_model_parallel_size: int = 1,
           expert_tensor_parallel_size: Optional[int] = None, batch_size: int = 2, seq_length: int = 32,
           seed: int = 0) -> Comparison:
    """Compare the two models' logits on random tokens. Both checkpoints are checked first (configs and headers:
    cheap), so that a broken input fails with its name rather than inside transformers or a spawned rank."""
    hfc.read_config(Path(hf_dir))
    hfc.open_weights(Path(hf_dir))
    arch = MegatronCheckpoint(megatron_dir).architecture
    sizes = dict(tensor_model_parallel_size=tensor_model_parallel_size,
                 pipeline_model_parallel_size=pipeline_model_parallel_size,
                 expert_model_parallel_size=expert_model_parallel_size,
                 expert_tensor_parallel_size=expert_tensor_parallel_size)
    check_parallel_sizes(arch, **sizes)
    tokens = random_tokens(arch.vocab_size, batch_size=batch_size, seq_length=seq_length, seed=seed)
    reference = hf_logits(hf_dir, tokens)
    etp = expert_tensor_parallel_size or tensor_model_parallel_size
    if tensor_model_parallel_size * pipeline_model_parallel_size * expert_model_parallel_size * etp == 1:
        ours = megatron_logits_here(megatron_dir, tokens)
    else:
        ours = megatron_logits(megatron_dir, tokens, **sizes)
    return compare(reference, ours)
