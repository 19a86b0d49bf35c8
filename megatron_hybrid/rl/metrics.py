"""Per-iteration metrics of an RL run: where the time goes, gathered over the ranks, logged (JSONL, TensorBoard, a
progress bar) and summed up at the end."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from types import SimpleNamespace
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from .phases import recorded


class StepTimer:
    """Where one iteration's wall-clock time goes on this rank: seconds per phase, and the tokens a phase
    processed for this rank's DP replica where given. :func:`aggregate_metrics` turns them into ``time/<phase>``,
    ``time/step`` (from construction to that call) and ``throughput/<phase>_tokens_per_second``."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.tokens: dict[str, int] = {}
        self.flops: dict[str, float] = {}
        self.peak_bytes: dict[str, int] = {}
        self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()

    @contextlib.contextmanager
    def phase(self, name: str, *, tokens: Optional[int] = None, flops: Optional[float] = None) -> Iterator[None]:
        """Time the block as phase ``name`` (seconds, tokens and this rank's model FLOPs add up over repeated
        phases); on a GPU also the most memory PyTorch allocated in it (``torch.cuda.max_memory_allocated``)."""
        start = time.perf_counter()
        try:
            with self.peak(name):
                yield
        finally:
            self.add(name, time.perf_counter() - start, tokens=tokens, flops=flops)

    @contextlib.contextmanager
    def peak(self, name: str) -> Iterator[None]:
        """Only the most memory PyTorch allocated in the block, as phase ``name``'s (on a GPU; no seconds): for a
        phase whose seconds are measured inside it and given to :meth:`add`, as the rollout's are."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            yield
        finally:
            if self.cuda:
                peak = torch.cuda.max_memory_allocated()
                self.peak_bytes[name] = max(self.peak_bytes.get(name, 0), peak)

    def add(self, name: str, seconds: float, *, tokens: Optional[int] = None, flops: Optional[float] = None) -> None:
        """Add ``seconds`` (and ``tokens``, ``flops``) measured elsewhere to phase ``name``."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        if tokens is not None:
            self.tokens[name] = self.tokens.get(name, 0) + tokens
        if flops is not None:
            self.flops[name] = self.flops.get(name, 0.0) + flops


#: Dense bf16 peak FLOP/s by device name (MFU's denominator); other devices get no MFU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H20": 148e12, "A100": 312e12, "B200": 2250e12}


def peak_flops() -> Optional[float]:
    """This rank's GPU's dense bf16 peak (:data:`PEAK_BF16_FLOPS`), or None (a CPU, an unlisted GPU)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0])) if k in name), None)


def training_flops(models: list[torch.nn.Module], tokens: int) -> float:
    """This rank's model FLOPs of a forward and backward pass over ``tokens`` (its DP replica's): 6 · its
    parameters · tokens, Megatron-LM's count without the attention term. The mean over the ranks of flops / (seconds
    · peak) is the run's MFU."""
    return 6.0 * tokens * sum(p.numel() for m in models for p in m.parameters())


def _reduce(key: str, vals: list[float]) -> float:
    if key.endswith("_max"):
        return max(vals)
    if key.endswith("_min"):
        return min(vals)
    return sum(vals) / len(vals)


@recorded("metrics")
def aggregate_metrics(local: Optional[dict[str, Any]], timer: StepTimer, *,
                      switch_bytes: float = 0.0) -> dict[str, Any]:
    """One iteration's metrics on every rank. Called on every rank.

    - ``local``'s keys, from the ranks that pass it (one per DP replica: its last stage, TP rank 0): the mean over
      them (a list value element-wise), or for keys ending in ``_max`` / ``_min`` the max / min;
    - ``time/<phase>`` and ``time/step``: the mean over all ranks of each rank's ``timer`` seconds (the phases of
      each rank, and so their means, sum to at most its step);
    - ``throughput/<phase>_tokens_per_second``: the phase's tokens over all DP replicas (as the reporting ranks
      counted them) per second of ``time/<phase>``;
    - ``switch_bytes`` (this rank's received bytes) summed over all ranks, ``switch_seconds``: the slowest rank's
      ``switch`` phase;
    - on a GPU, ``memory/<phase>_peak_gib``: the most PyTorch allocated in the phase on any rank, and where the
      phase counted model FLOPs on a GPU of known peak, ``throughput/<phase>_mfu``: the mean over the ranks of
      FLOPs / (seconds · peak).
    """
    seconds = timer.seconds | {"step": time.perf_counter() - timer.start}
    everyone: list[Any] = [None] * dist.get_world_size()
    peak = peak_flops()
    mfu = {name: flops / max(seconds.get(name, 0.0), 1e-9) / peak for name, flops in timer.flops.items()} \
        if peak else {}
    dist.all_gather_object(everyone, {"metrics": local, "seconds": seconds, "tokens": timer.tokens,
                                      "switch_bytes": switch_bytes, "peak_bytes": timer.peak_bytes, "mfu": mfu})
    reporting = [e for e in everyone if e["metrics"] is not None]
    parts = [e["metrics"] for e in reporting]
    out: dict[str, Any] = {}
    for key in parts[0]:
        vals = [p[key] for p in parts]
        if isinstance(vals[0], list):
            out[key] = [_reduce(key, [v[i] for v in vals]) for i in range(len(vals[0]))]
        else:
            out[key] = _reduce(key, vals)
    out["switch_bytes"] = sum(e["switch_bytes"] for e in everyone)
    out["switch_seconds"] = max(e["seconds"].get("switch", 0.0) for e in everyone)
    for name in seconds:
        out[f"time/{name}"] = sum(e["seconds"].get(name, 0.0) for e in everyone) / len(everyone)
    for name in timer.tokens:
        tokens = sum(e["tokens"].get(name, 0) for e in reporting)
        out[f"throughput/{name}_tokens_per_second"] = tokens / max(out[f"time/{name}"], 1e-9)
    for name in timer.peak_bytes:
        out[f"memory/{name}_peak_gib"] = max(e["peak_bytes"].get(name, 0) for e in everyone) / 2**30
    for name in mfu:
        out[f"throughput/{name}_mfu"] = sum(e["mfu"].get(name, 0.0) for e in everyone) / len(everyone)
    return out


#: megatron-core's tracker name of each load-balancing type's loss (Megatron-LM logs them under these names).
_AUX_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                   "global_aux_loss": "global_load_balancing_loss"}


def moe_aux_losses(config: Any, *, num_microbatches: int, pp_group: Any, dp_group: Any) -> dict[str, float]:
    """The MoE load-balancing losses of the forward-backward passes since the last call (megatron-core's routers
    track them in training mode, with autograd on; Megatron-LM's ``track_moe_metrics``): each the mean over the
    model's MoE layers and the micro-batches, reduced over the ranks as Megatron-LM does (summed over the stages,
    the layer's own group and averaged over data parallelism), unscaled by ``--moe-aux-loss-coeff``; the tracker is
    emptied. Called on every rank (collectives); ``{}`` for a dense model or without a load-balancing loss.
    ``config``: the model's TransformerConfig."""
    from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker,
                                                         reduce_aux_losses_tracker_across_ranks)

    name = _AUX_LOSS_NAMES.get(getattr(config, "moe_router_load_balancing_type", None))
    if config.num_moe_experts is None or not config.moe_aux_loss_coeff or name is None:
        return {}
    tracker = get_moe_layer_wise_logging_tracker()
    # A stage without MoE layers tracks nothing, but joins the reduction over the stages all the same.
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    tracker.setdefault(name, {"values": torch.zeros(config.num_layers, device=device), "reduce_group": None,
                              "avg_group": None, "reduce_group_has_dp": False})
    reduce_aux_losses_tracker_across_ranks([name], pg_collection=SimpleNamespace(pp=pp_group, dp=dp_group))
    pattern = config.moe_layer_freq
    num_moe_layers = sum(pattern) if isinstance(pattern, list) else len(range(0, config.num_layers, pattern))
    value = float(tracker[name]["values"].sum()) / num_moe_layers / num_microbatches
    clear_aux_losses_tracker()
    return {name: value}


def clear_moe_aux_losses() -> None:
    """Forget the MoE load-balancing losses tracked so far (before the passes :func:`moe_aux_losses` reports)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


class MetricsLogger:
    """``--log-dir``'s ``metrics.jsonl`` (one line per iteration, appended), TensorBoard events in
    ``--tensorboard-dir`` (a scalar per metric; a per-epoch list as its mean), and a tqdm bar (unless
    ``--no-progress``); on rank 0 only."""

    def __init__(self, args: argparse.Namespace, *, start: int) -> None:
        self.active = dist.get_rank() == 0
        self.jsonl = self.tb = self.bar = None
        if not self.active:
            return
        if args.log_dir is not None:
            os.makedirs(args.log_dir, exist_ok=True)
            self.jsonl = open(os.path.join(args.log_dir, "metrics.jsonl"), "a")
        if args.tensorboard_dir is not None:  # validate_args checked that tensorboard is installed
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(args.tensorboard_dir)
        if not args.no_progress:
            from tqdm import tqdm

            self.bar = tqdm(total=args.train_iters, initial=start, desc=args.algorithm, file=sys.stderr)

    def log(self, m: dict[str, Any]) -> None:
        """Log one iteration's metrics (with ``step``, ``reward_mean`` and ``kl``)."""
        if not self.active:
            return
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(m) + "\n")
            self.jsonl.flush()
        if self.tb is not None:
            for k, v in m.items():
                if isinstance(v, list) and v:
                    v = sum(v) / len(v)
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, m["step"])
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{m['reward_mean']:.3f}", kl=f"{m['kl']:.4f}")

    def close(self) -> None:
        for h in (self.bar, self.jsonl, self.tb):
            if h is not None:
                h.close()


def summary(history: list[dict[str, Any]], window: int = 5, *, args: Optional[argparse.Namespace] = None,
            loaded_step: int = 0) -> str:
    """One line: the mean reward of the first and last ``window`` iterations, and the switch's bytes and time.
    Without steps, why (as Megatron-LM's loop, the recipe's runs up to ``--train-iters``: ``loaded_step``, the
    iteration ``args.load`` resumed from, may be there already)."""
    if not history:
        if args is not None and args.load is not None and loaded_step >= args.train_iters:
            return (f"no steps run: the iteration loaded from --load {args.load}, {loaded_step}, is already at or "
                    f"past --train-iters {args.train_iters}")
        return "no steps run"
    k = min(window, len(history))
    first = sum(m["reward_mean"] for m in history[:k]) / k
    last = sum(m["reward_mean"] for m in history[-k:]) / k
    mb = sum(m["switch_bytes"] for m in history) / len(history) / 2**20
    sec = sum(m["switch_seconds"] for m in history) / len(history)
    return (f"steps {history[0]['step']}..{history[-1]['step']}: mean reward of the first {k} steps {first:.3f}, "
            f"of the last {k} {last:.3f} (rise {last - first:+.3f}); per switch {mb:.2f} MiB over all ranks, "
            f"{sec * 1e3:.1f} ms")
