"""Where a decode step's device time goes: a table of the CUDA kernels of one generate call's decode steps
(torch.profiler), with the matrix multiplies told apart by kernel name.

How decode steps are isolated. The generator has no profiler ranges of its own, and one generate call runs prefill
forwards, decode steps, sampling and the log-probs' collection on one stream. For the profiled call the stage
runner's ``run`` is wrapped (an instance attribute over the method, for that call only) so that a decode step's
launches are bracketed on the device by a marker kernel (``torch.cuda._sleep``: ``spin_kernel``) before and after.
Every step is launched on the current stream (a CUDA graph's replay included: the graph's kernels run on the stream
it is launched on), so in device time order the kernels between an opening and a closing marker are exactly the
decode step's: its graph's kernels and the step's own launches around it (the next tokens' copy into the decode
inputs). The markers themselves are left out; everything else (prefills, the log-probs' copy) is reported apart as
``outside_decode``. This needs no clock alignment between host and device, nor the profiler's linking of kernels to
host ranges (which a graph replay, not an aten op, does not give reliably).

The figures are kernel time (the sum of the kernels' durations), not wall time: gaps between kernels are not in
``per_decode_step_us``; ``decode_span_us_per_step`` is the device's first-to-last span of the decode kernels per
step, gaps included (and ``span_over_matmul`` that span over the matmul time).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Optional

import torch

#: A kernel is a matrix multiply when its base name (without ``void``, template arguments and parameters) contains
#: one of these, case-insensitively: cuBLAS/cuBLASLt (``nvjet_*`` on Hopper, ``sm90_xmma_gemm_*``, ``*gemm*``,
#: ``gemv*``, the split-K reduction ``splitKreduce_kernel`` that finishes a split-K GEMM), CUTLASS
#: (``cutlass::Kernel2``, ``cutlass::device_kernel``: torch's row-wise ``_scaled_mm``), and Triton matmuls by their
#: function names (``*matmul*``, ``*scaled_mm*``, ``*fp8_gemm*``, ``*wgmma*``; ``_sum_splits_kernel``: the split-K
#: reduction of megatron_hybrid's FP8 weight matmul, like cuBLAS's ``splitKreduce``).
MATMUL_PATTERNS = ("gemm", "gemv", "nvjet", "xmma", "wgmma", "sm90_", "cutlass", "splitkreduce", "scaled_mm",
                   "fp8_gemm", "matmul", "sum_splits")
#: ... unless it names attention (flash and cuDNN attention kernels are CUTLASS / wgmma kernels too).
NOT_MATMUL = ("attn", "attention", "flash", "fmha", "sdpa")
#: Attention kernels (reported apart: a decode step's attention reads the KV cache, B x positions x layers x 4 KiB
#: for a Llama-3-8B at bf16, 6.4 GB a step at batch 256 and 192 positions): the flash/SDPA names, and
#: megatron_hybrid's decode attention (``_decode_split_kernel`` and its ``_decode_combine_kernel``).
ATTENTION_PATTERNS = NOT_MATMUL + ("_decode_split_kernel", "_decode_combine_kernel")
MARKER = "spin_kernel"  # torch.cuda._sleep's kernel
_MARKER_CYCLES = 100


def kernel_base(name: str) -> str:
    """``name`` without a leading ``void``, its template arguments and its parameter list."""
    name = name.strip()
    if name.startswith("void "):
        name = name[5:]
    return re.split(r"[<(]", name, maxsplit=1)[0]


def is_matmul(name: str) -> bool:
    """Whether kernel ``name`` is a matrix multiply (:data:`MATMUL_PATTERNS`, :data:`NOT_MATMUL`)."""
    base = kernel_base(name).lower()
    return any(p in base for p in MATMUL_PATTERNS) and not any(p in base for p in NOT_MATMUL)


def is_attention(name: str) -> bool:
    """Whether kernel ``name`` is attention (:data:`ATTENTION_PATTERNS`)."""
    base = kernel_base(name).lower()
    return any(p in base for p in ATTENTION_PATTERNS)


def _is_copy(name: str) -> bool:
    return name.startswith(("Memcpy", "Memset"))


def profile_decode(call: Callable[[], Any], generator: Any, *, num_layers: int) -> dict[str, Any]:
    """Run ``call`` (one generate call of ``generator``, a RolloutGenerator on a GPU) under torch.profiler and
    return its decode steps' kernel table (see the module's docstring)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    runner = generator.replica.runner
    step = runner.run
    marked = 0

    def run_marked(plan):
        nonlocal marked
        if plan.kind != "decode":
            return step(plan)
        torch.cuda._sleep(_MARKER_CYCLES)
        out = step(plan)
        torch.cuda._sleep(_MARKER_CYCLES)
        marked += 1
        return out

    before = generator.report()["decode_steps"]
    torch.cuda.synchronize()
    runner.run = run_marked
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
    finally:
        del runner.run  # the method again
    decode_steps = generator.report()["decode_steps"] - before
    # Device events: kernels, copies and sets (a host range's device-side span, a user annotation, is not one).
    device = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
              if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    return decode_table(device, decode_steps=decode_steps, marked=marked, num_layers=num_layers)


def split_decode(events: list[tuple[str, float, float]]) -> tuple[list, list, int, int]:
    """``events`` (device events: name, start and end in µs) split by the marker kernels: the kernels inside a
    marked decode step, those outside, the markers seen and the copies/sets inside (neither kernels)."""
    inside, outside, markers, copies, open_ = [], [], 0, 0, False
    for e in sorted(events, key=lambda e: e[1]):
        if MARKER in e[0]:
            markers += 1
            open_ = not open_
        elif _is_copy(e[0]):
            copies += open_
        else:
            (inside if open_ else outside).append(e)
    return inside, outside, markers, copies


def decode_table(events: list[tuple[str, float, float]], *, decode_steps: int, marked: int,
                 num_layers: int) -> dict[str, Any]:
    """The kernel table of the marked decode steps among ``events`` (see :func:`split_decode`)."""
    inside, outside, markers, copies = split_decode(events)
    out: dict[str, Any] = {
        "decode_steps": decode_steps, "marked_decode_steps": marked, "markers_seen": markers,
        "attribution": "kernels between marker kernels launched around each decode step, in device time order "
                       "(bench/kernel_table.py)",
        "matmul_patterns": list(MATMUL_PATTERNS), "not_matmul_patterns": list(NOT_MATMUL),
        "attention_patterns": list(ATTENTION_PATTERNS),
        "outside_decode": {"kernels": len(outside), "total_us": sum(end - start for _, start, end in outside)},
        "copies_in_decode": copies,
    }
    if markers != 2 * marked or not marked or not inside:
        # The profiler lost the markers (or no decode step ran): no figures rather than wrong ones.
        out["error"] = f"{markers} marker kernels for {marked} marked decode steps, {len(inside)} kernels inside"
        return out
    if decode_steps != marked:
        out["warning"] = f"the generator counted {decode_steps} decode steps, {marked} were marked"
    table: dict[str, dict[str, Any]] = {}
    for name, start, end in inside:
        row = table.setdefault(name, {"name": name, "count": 0, "total_us": 0.0, "matmul": is_matmul(name),
                                      "attention": is_attention(name)})
        row["count"] += 1
        row["total_us"] += end - start
    kernels = sorted(table.values(), key=lambda r: -r["total_us"])
    total = sum(r["total_us"] for r in kernels)
    matmul = sum(r["total_us"] for r in kernels if r["matmul"])
    attention = sum(r["total_us"] for r in kernels if r["attention"])
    steps = marked
    span = max(e[2] for e in inside) - min(e[1] for e in inside)
    out.update(
        per_decode_step_us=total / steps, matmul_us_per_decode_step=matmul / steps,
        total_over_matmul=total / matmul if matmul else None,
        attention_us_per_decode_step=attention / steps,
        total_over_matmul_and_attention=total / (matmul + attention) if matmul + attention else None,
        other_us_per_decode_step=(total - matmul - attention) / steps,
        kernels_per_decode_step=len(inside) / steps,
        kernels_per_layer_per_decode_step=len(inside) / steps / num_layers,
        decode_span_us_per_step=span / steps, span_over_matmul=span / matmul if matmul else None,
        matmul_kernel_names=sorted(r["name"] for r in kernels if r["matmul"]),
        kernels=kernels)
    return out


def append_rows(path: str, rows: list[dict]) -> None:
    """Add ``rows`` to the JSON list at ``path`` (made if missing): one file across processes."""
    p = Path(path)
    earlier = json.loads(p.read_text()) if p.exists() else []
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(earlier + rows, indent=1) + "\n")


def read_rows(path: Optional[str]) -> list[dict]:
    return json.loads(Path(path).read_text()) if path and Path(path).exists() else []
