"""Per-iteration metrics of an RL run: gathered over the ranks, logged (JSONL, TensorBoard, a progress bar) and
summed up at the end."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

import torch.distributed as dist


def aggregate_metrics(local: Optional[dict[str, Any]], switch: dict[str, float]) -> dict[str, Any]:
    """One iteration's metrics on every rank: the means over the ranks that pass ``local`` (one per DP replica:
    its last stage, TP rank 0; a list value is averaged element-wise), the switch bytes summed over all ranks and
    the switch seconds of the slowest. Called on every rank."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"metrics": local, "switch": switch})
    parts = [e["metrics"] for e in everyone if e["metrics"] is not None]
    out: dict[str, Any] = {}
    for key in parts[0]:
        vals = [p[key] for p in parts]
        if isinstance(vals[0], list):
            out[key] = [sum(v[i] for v in vals) / len(vals) for i in range(len(vals[0]))]
        else:
            out[key] = sum(vals) / len(vals)
    out["switch_bytes"] = sum(e["switch"]["switch_bytes"] for e in everyone)
    out["switch_seconds"] = max(e["switch"]["switch_seconds"] for e in everyone)
    return out


class MetricsLogger:
    """``--log-dir``'s ``metrics.jsonl`` (one line per iteration, appended), TensorBoard events when
    ``tensorboard`` is installed, and a tqdm bar (unless ``--no-progress``); on rank 0 only."""

    def __init__(self, args: argparse.Namespace, *, start: int) -> None:
        self.active = dist.get_rank() == 0
        self.jsonl = self.tb = self.bar = None
        if not self.active:
            return
        if args.log_dir is not None:
            os.makedirs(args.log_dir, exist_ok=True)
            self.jsonl = open(os.path.join(args.log_dir, "metrics.jsonl"), "a")
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                SummaryWriter = None
            if SummaryWriter is not None:
                self.tb = SummaryWriter(args.log_dir)
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
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, m["step"])
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{m['reward_mean']:.3f}", kl=f"{m['kl']:.4f}")

    def close(self) -> None:
        for h in (self.bar, self.jsonl, self.tb):
            if h is not None:
                h.close()


def summary(history: list[dict[str, Any]], window: int = 5) -> str:
    """One line: the mean reward of the first and last ``window`` iterations, and the switch's bytes and time."""
    if not history:
        return "no steps run"
    k = min(window, len(history))
    first = sum(m["reward_mean"] for m in history[:k]) / k
    last = sum(m["reward_mean"] for m in history[-k:]) / k
    mb = sum(m["switch_bytes"] for m in history) / len(history) / 2**20
    sec = sum(m["switch_seconds"] for m in history) / len(history)
    return (f"steps {history[0]['step']}..{history[-1]['step']}: mean reward of the first {k} steps {first:.3f}, "
            f"of the last {k} {last:.3f} (rise {last - first:+.3f}); per switch {mb:.2f} MiB over all ranks, "
            f"{sec * 1e3:.1f} ms")
