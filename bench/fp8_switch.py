"""What FP8 rollout weights add to a switch, on one device (issue 26, acceptance 2).

On a shape (default llama3-8b; ``--layers`` cuts its depth), one rank, rollout layout TP = PP = 1:

1. ``copy_bandwidth``: bytes read + written per second of a large device copy (``measure.copy_bandwidth``, as
   bench/generate.py's roofline).
2. ``floor``: the bytes of the FP8 target weights' quantization, each read once in the training dtype and written
   once in FP8 plus its fp32 row scales, at that bandwidth: the least time any quantization could take.
3. ``quantize``: :func:`megatron_hybrid.fp8.quantize_rows` over every target weight of the rollout model, as the
   switch calls it (the placement's :class:`~megatron_hybrid.aliased.Blocks` of each weight, into the binding's FP8
   tensor and scales), while rolling out; its bandwidth is the floor's bytes over the median time of the whole pass
   (a kernel that reads a weight twice, for the row amax and then to quantize, moves more than these bytes), and
   its ratio to the copy bandwidth (target ≥ 0.8). The binding's whole ``refill()`` is timed beside it (on one
   rank it is the quantization alone: every other rollout tensor is a view of its training tensor).
4. ``switch``: ``HybridEngine(model, RolloutLayout(1, 1), weight_mode="canonical")`` and the same with
   ``rollout_weights="fp8"``, one after the other on the same model (one engine at a time): the wall time of
   ``switch_to_rollout()`` and of ``switch_to_training()``, the device synchronised before and after each, median of
   ``--rounds`` round trips after one untimed; the engine's phase times (median), and its memory report while
   rolling out (``switch_peak_bytes_mapped``, ``fp8_bytes_mapped``, ``canonical_bytes_mapped``) and while
   training (all 0).
5. the targets: quantize bandwidth / copy bandwidth ≥ 0.8, and FP8 switch ≤ 1.25 × (bf16 switch + floor).

Rows (``"kind"``: ``copy_bandwidth``, ``quantize``, ``switch`` per ``rollout_weights``, ``targets``) go to
``--out`` as one JSON list (``--append`` adds them to those there).

    python3 bench/fp8_switch.py --out /tmp/fp8_switch.json                   # one GPU, llama3-8b
    python3 bench/fp8_switch.py --layers 4 --out /tmp/fp8_switch.json        # a quicker cut
    python3 bench/fp8_switch.py --smoke --out /tmp/fp8_switch_smoke.json     # a tiny model on the CPU (gloo)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import DEVICE_INIT, SHAPES, build_model  # noqa: E402
from measure import copy_bandwidth, one_rank, sync, timed  # noqa: E402

#: The issue's targets: quantization at ≥ this share of the copy bandwidth ...
QUANTIZE_SHARE = 0.8
#: ... and the FP8 switch within this factor of the bf16 switch plus the quantization floor.
SWITCH_FACTOR = 1.25


def fp8_targets(engine) -> list[tuple[str, Any, torch.Tensor, torch.Tensor]]:
    """(name, blocks, FP8 tensor, scales) of every FP8 weight of ``engine``'s rollout model: what its switch
    quantizes, read from the placement and the binding as the binding itself reads them."""
    from megatron_hybrid.binding import named_parameters

    out = []
    for name, param in named_parameters(engine.rollout_chunks):
        entry = engine.binding.fp8.get(param)
        if entry is not None:
            out.append((name, engine.placement.of(name).blocks(name), *entry))
    return out


def target_bytes(targets: list[tuple[str, Any, torch.Tensor, torch.Tensor]]) -> int:
    """Bytes a quantization of ``targets`` moves at least: each weight read once in the training dtype, written
    once in FP8, and its fp32 scales written."""
    total = 0
    for _, blocks, weight, scale in targets:
        element = blocks.views[0].element_size()
        total += weight.numel() * (element + weight.element_size()) + scale.numel() * scale.element_size()
    return total


def switch_times(engine, device: torch.device, rounds: int) -> dict[str, Any]:
    """Median wall times of ``engine``'s switches (``rounds`` round trips after one untimed), its phases, and its
    memory report while rolling out and while training."""
    to_rollout, to_training, phases = [], [], []
    rolling = training = {}
    for i in range(rounds + 1):
        sync(device)
        t0 = time.perf_counter()
        engine.switch_to_rollout()
        sync(device)
        t1 = time.perf_counter()
        rolling = engine.communication_report()
        sync(device)
        t2 = time.perf_counter()
        engine.switch_to_training()
        sync(device)
        t3 = time.perf_counter()
        training = engine.communication_report()
        if i:  # the first round maps fresh memory and loads kernels
            to_rollout.append(t1 - t0)
            to_training.append(t3 - t2)
            phases.append(rolling["phases"])
    keys = ("switch_peak_bytes_mapped", "fp8_bytes_mapped", "canonical_bytes_mapped", "peer_bytes_mapped")
    return {"to_rollout_s": statistics.median(to_rollout), "to_training_s": statistics.median(to_training),
            "to_rollout_runs": to_rollout, "to_training_runs": to_training,
            "phases_median_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
            "rolling_out": {k: rolling[k] for k in keys},
            # (switch_peak_bytes_mapped describes the last switch: it stays in the report while training)
            "training": {k: training[k] for k in keys[1:]}}


def measure_quantize(engine, device: torch.device, rounds: int) -> dict[str, Any]:
    """``quantize_rows`` over every FP8 target of ``engine`` (rolling out), and the binding's ``refill()``."""
    from megatron_hybrid.fp8 import quantize_rows

    engine.switch_to_rollout()
    try:
        targets = fp8_targets(engine)

        def quantize() -> None:
            for _, blocks, weight, scale in targets:
                quantize_rows(blocks, weight, scale)

        _, times = timed(quantize, device, runs=rounds, warmup=1)
        _, refill = timed(engine.binding.refill, device, runs=rounds, warmup=1)
    finally:
        engine.switch_to_training()
    nbytes = target_bytes(targets)
    return {"weights": len(targets), "elements": sum(w.numel() for _, _, w, _ in targets), "bytes": nbytes,
            "seconds": statistics.median(times), "runs": times, "bandwidth_bytes_s": nbytes / statistics.median(times),
            "refill_seconds": statistics.median(refill), "refill_runs": refill}


def run(arch, device: torch.device, args) -> list[dict]:
    from megatron_hybrid import HybridEngine, RolloutLayout

    bandwidth = copy_bandwidth(device, args.bandwidth_bytes)
    rows: list[dict] = [{"kind": "copy_bandwidth", "bytes": args.bandwidth_bytes, "bandwidth_bytes_s": bandwidth}]
    model = build_model(arch, device, on_device=args.shape in DEVICE_INIT)
    switches = {}
    for weights in ("model", "fp8"):
        engine = HybridEngine(model, RolloutLayout(1, 1), weight_mode="canonical", rollout_weights=weights)
        try:
            switches[weights] = switch_times(engine, device, args.rounds)
            if weights == "fp8":
                quant = measure_quantize(engine, device, args.rounds)
        finally:
            engine.close()
        rows.append({"kind": "switch", "rollout_weights": weights, "weight_mode": "canonical", **switches[weights]})
        print(json.dumps(rows[-1]), flush=True)
    floor = quant["bytes"] / bandwidth
    rows.append({"kind": "quantize", **quant, "floor_seconds": floor,
                 "over_copy_bandwidth": quant["bandwidth_bytes_s"] / bandwidth})
    print(json.dumps(rows[-1]), flush=True)
    bf16, fp8 = switches["model"]["to_rollout_s"], switches["fp8"]["to_rollout_s"]
    rows.append({"kind": "targets",
                 "quantize_over_copy_bandwidth": quant["bandwidth_bytes_s"] / bandwidth,
                 "quantize_over_copy_bandwidth_least": QUANTIZE_SHARE,
                 "fp8_switch_s": fp8, "bf16_switch_s": bf16, "floor_s": floor,
                 "fp8_switch_over_bf16_plus_floor": fp8 / (bf16 + floor),
                 "fp8_switch_over_bf16_plus_floor_most": SWITCH_FACTOR})
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: llama3-8b (cpu-tiny with --smoke)")
    ap.add_argument("--layers", type=int, default=None, help="the shape's depth cut (or grown) to this many layers")
    ap.add_argument("--rounds", type=int, default=7, help="timed switch round trips and quantization passes (≥ 5)")
    ap.add_argument("--bandwidth-bytes", type=int, default=2**31, help="size of the copy that measures bandwidth")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (gloo): checks the bench runs")
    ap.add_argument("--out", required=True, help="JSON list of rows")
    ap.add_argument("--append", action="store_true", help="add the rows to those in --out (if it exists)")
    args = ap.parse_args(argv)
    if args.rounds < 5:
        raise ValueError(f"--rounds ({args.rounds}) must be at least 5 (medians)")
    args.shape = args.shape or ("cpu-tiny" if args.smoke else "llama3-8b")
    if args.smoke:
        args.rounds, args.bandwidth_bytes = 5, 2**26
    device = torch.device("cpu") if args.smoke or not torch.cuda.is_available() else torch.device("cuda", 0)
    arch = SHAPES[args.shape]
    if arch.num_experts is not None:
        raise ValueError(f"--shape {args.shape}: a dense shape (FP8 rollout weights leave MoE experts alone)")
    if args.layers is not None:
        arch = dataclasses.replace(arch, num_layers=args.layers)
    with one_rank(device):
        rows = run(arch, device, args)
    meta = {"shape": args.shape, "layers": arch.num_layers, "dtype": arch.params_dtype,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "command": " ".join(["python3"] + sys.argv)}
    earlier = json.loads(Path(args.out).read_text()) if args.append and Path(args.out).exists() else []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(earlier + [dict(r, **meta) for r in rows], indent=1) + "\n")
    t = rows[-1]
    print(json.dumps(t | {"out": args.out}, indent=1))
    share = t["quantize_over_copy_bandwidth"]
    print(f"target quantize bandwidth / copy bandwidth >= {QUANTIZE_SHARE}: {share:.3f}: "
          f"{'met' if share >= QUANTIZE_SHARE else 'MISSED'}")
    factor = t["fp8_switch_over_bf16_plus_floor"]
    print(f"target fp8 switch / (bf16 switch + floor) <= {SWITCH_FACTOR}: {factor:.3f} "
          f"({t['fp8_switch_s'] * 1e3:.2f} ms / ({t['bf16_switch_s'] * 1e3:.2f} + {t['floor_s'] * 1e3:.2f}) ms): "
          f"{'met' if factor <= SWITCH_FACTOR else 'MISSED'}")


if __name__ == "__main__":
    main()
