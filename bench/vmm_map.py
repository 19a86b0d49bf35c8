"""How long mapping CUDA virtual memory takes, and whether it waits for work already queued on the device.

For each size and piece size: reserve once, then time ``ReservedBuffer.map`` of the whole range (in pieces) on an
idle device and again right after queueing ~``--busy-ms`` of matmuls (the host call returns at once if the driver
does not wait for them), then unmap. One GPU.

    python bench/vmm_map.py --output bench/results/vmm_map_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megatron_hybrid.memory import ReservedBuffer


def busy(ms: float) -> None:
    """Queue about ``ms`` of matmuls without waiting for them."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t = time.perf_counter()
    (a @ a).sum().item()
    one = time.perf_counter() - t
    for _ in range(max(1, int(ms / 1e3 / one))):
        a @ a


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", default=None)
    ap.add_argument("--busy-ms", type=float, default=50.0)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for total_mb, piece_mb in ((1024, 1024), (1024, 256), (6656, 6656), (6656, 1024), (6656, 256)):
        numel = total_mb * 2**20 // 2
        piece = piece_mb * 2**20 // 2
        buf = ReservedBuffer(numel, torch.bfloat16, device="cuda")
        out = {"total_mb": total_mb, "piece_mb": piece_mb}
        for state in ("idle", "busy"):
            times, waits = [], []
            for _ in range(args.runs):
                torch.cuda.synchronize()
                if state == "busy":
                    busy(args.busy_ms)
                t0 = time.perf_counter()
                for lo in range(0, numel, piece):
                    buf.map(lo, min(lo + piece, numel))
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                waits.append(time.perf_counter() - t1)
                times.append(t1 - t0)
                buf.unmap(0, numel)
            out[f"{state}_map_ms"] = statistics.median(times) * 1e3
            out[f"{state}_then_wait_ms"] = statistics.median(waits) * 1e3
        buf.close()
        rows.append(out)
        print(json.dumps(out), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "busy_ms": args.busy_ms,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
