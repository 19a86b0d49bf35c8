"""FP8 matrix multiplies and quantization of one GPU, measured side by side on a Llama-3-8B layer's linears.

Per linear (qkv 6144x4096, proj 4096x4096, fc1 28672x4096, fc2 4096x14336, the output layer 128256x4096) and
token count M, the median device time of one call inside a CUDA graph of 40 calls that cycle through copies of the
weights (more than L2 holds), as a decode step's graph runs them, of

- ``bf16``: cuBLAS, ``x @ w.t()`` in bfloat16;
- ``fp8_scaled_mm``: ``torch._scaled_mm`` row-wise (FP8 activations and weights), and ``fp8_scaled_mm+quant`` with
  the activations' quantization kernel (``megatron_hybrid.quant.fp8.quantize_activations``) counted in;
- ``fp8_weight_only``: the Triton kernel that streams the FP8 weight with bfloat16 activations
  (``megatron_hybrid.quant.fp8_kernels.fp8_weight_matmul``), at its default plan, and (``--sweep``) the best of a sweep
  of tile sizes and K splits at M <= 64, with the plan;
- what ``fp8_linear`` picks (``megatron_hybrid.quant.fp8.uses_small_m_kernel``): the Triton small-M kernel or
  ``_scaled_mm``;

and the achieved weight-read bandwidth of each (weight bytes / time). Then the quantization of the weights
(``quantize_rows``' kernel: bf16 read once, FP8 and scales written) against a device copy of the same bytes:
bytes read + written per second, and their ratio (issue 26: >= 0.8).

    python3 bench/fp8_gemm.py --out bench/results/fp8_gemm_h200.json            # one GPU
    python3 bench/fp8_gemm.py --out /tmp/g.json --m 32 64 --sweep 32 64         # + the weight-only plan sweep
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_hybrid.quant import fp8, fp8_kernels  # noqa: E402

LINEARS = {"qkv": (6144, 4096), "proj": (4096, 4096), "fc1": (28672, 4096), "fc2": (4096, 14336),
           "output": (128256, 4096)}


def bench(fns: list, calls: int = 40) -> float:
    """Median device time of one call in microseconds: ``calls`` calls, cycling through ``fns`` (the same work on
    different copies of the weights, so that L2 does not keep them), captured in one CUDA graph (no launch gaps,
    as in a decode step's graph) and replayed; median of 10 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # compile and allocate outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times[2:])


def copies_for(nbytes: int) -> int:
    """Copies of a weight of ``nbytes`` whose total passes 4 x an H200's 50 MB L2 (at least 2)."""
    return max(2, -(-200 * 2**20 // nbytes))


def scaled_mm_with_quant(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    xq, xs = fp8.quantize_activations(x)
    return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=torch.bfloat16)


def small_m_with_quant(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    xq, xs = fp8.quantize_activations(x)
    return fp8_kernels.fp8_matmul(xq, xs.view(-1), q, s)


def sweep_plans(M: int, N: int, K: int, sms: int) -> list[dict]:
    base = fp8_kernels.weight_only_plan(M, N, K, sms)
    plans = []
    for block_n in (32, 64, 128):
        for block_k in (128, 256):
            if K % block_k:
                continue
            tiles = -(-N // block_n)
            steps = K // block_k
            for split in sorted({1, max(1, -(-2 * sms // tiles)), max(1, -(-4 * sms // tiles))}):
                split = min(split, steps)
                per = -(-steps // split)
                for stages in (3, 5):
                    plans.append(dict(base, BLOCK_N=block_n, BLOCK_K=block_k, split=-(-steps // per),
                                      k_per_split=per * block_k, num_stages=stages, num_warps=4))
    return plans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--m", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--sweep", type=int, nargs="*", default=None, metavar="M",
                    help="sweep the weight-only kernel's plans at these M (default with no value: 32)")
    ap.add_argument("--linears", nargs="+", default=list(LINEARS), choices=list(LINEARS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/fp8_gemm.py measures a GPU; none is visible")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    torch.manual_seed(0)
    rows = []
    for name in args.linears:
        N, K = LINEARS[name]
        n = copies_for(N * K)
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(n)]
        qs = [torch.empty(N, K, device=dev, dtype=fp8.FP8_DTYPE) for _ in range(n)]
        ss = [torch.empty(N, device=dev) for _ in range(n)]
        for w, q, s in zip(ws, qs, ss):
            fp8_kernels.quantize_rows_into(w, q, s)
        for M in args.m:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            xq, xs = fp8.quantize_activations(x)

            def each(f):
                return [lambda w=w, q=q, s=s: f(w, q, s) for w, q, s in zip(ws, qs, ss)]

            times = {
                "bf16": bench(each(lambda w, q, s: x @ w.t())),
                "fp8_scaled_mm": bench(each(lambda w, q, s: torch._scaled_mm(
                    xq, q.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=torch.bfloat16))),
                "fp8_scaled_mm+quant": bench(each(lambda w, q, s: scaled_mm_with_quant(x, q, s))),
                "fp8_linear": bench(each(lambda w, q, s: fp8.fp8_linear(x, q, s))),
            }
            if M <= fp8_kernels.WEIGHT_ONLY_MAX_M:  # its tiles hold all M rows: past 64, shared memory runs out
                times["fp8_weight_only"] = bench(each(lambda w, q, s: fp8_kernels.fp8_weight_matmul(x, q, s)))
            row = {"linear": name, "N": N, "K": K, "M": M, "us": times,
                   "weight_GB_s": {k: (N * K * (2 if k == "bf16" else 1)) / (v * 1e3) for k, v in times.items()},
                   "bf16_over": {k: times["bf16"] / v for k, v in times.items()},
                   "picked": "small_m_kernel" if fp8.uses_small_m_kernel(x) else "scaled_mm",
                   "default_plan": fp8_kernels.weight_only_plan(M, N, K, sms)}
            if M <= fp8_kernels.WEIGHT_ONLY_MAX_M:
                times["fp8_small_m"] = bench(each(lambda w, q, s: fp8_kernels.fp8_matmul(xq, xs.view(-1), q, s)))
                times["fp8_small_m+quant"] = bench(each(lambda w, q, s: small_m_with_quant(x, q, s)))
            if args.sweep is not None and M in (args.sweep or [32]):
                kernels = {"weight_only": lambda w, q, s, plan: fp8_kernels.fp8_weight_matmul(x, q, s, plan=plan),
                           "fp8_small_m": lambda w, q, s, plan: fp8_kernels.fp8_matmul(xq, xs.view(-1), q, s,
                                                                                       plan=plan)}
                for kernel, fn in kernels.items():
                    best, failed = None, 0
                    for plan in sweep_plans(M, N, K, sms):
                        try:
                            t = bench(each(lambda w, q, s, plan=plan, fn=fn: fn(w, q, s, plan)))
                        except Exception:  # a plan past the shared memory
                            failed += 1
                            continue
                        if best is None or t < best[0]:
                            best = (t, plan)
                    row[f"sweep_{kernel}"] = {"best_us": best[0], "plan": best[1], "failed_plans": failed,
                                              "GB_s": N * K / (best[0] * 1e3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ws, qs, ss
    # Quantization bandwidth against a copy of the same bytes.
    quant = []
    for name in args.linears:
        N, K = LINEARS[name]
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
        q = torch.empty(N, K, device=dev, dtype=fp8.FP8_DTYPE)
        s = torch.empty(N, device=dev)
        moved = N * K * 3 + N * 4  # bf16 read, fp8 written, scales written
        t_quant = bench([lambda: fp8_kernels.quantize_rows_into(w, q, s)], calls=10)
        src = torch.empty(moved // 4, dtype=torch.bfloat16, device=dev)  # moved / 2 bytes read, as many written
        dst = torch.empty_like(src)
        t_copy = bench([lambda: dst.copy_(src)], calls=10)  # a copy that reads and writes the same bytes in all
        configs = {}
        if args.sweep is not None:
            base = fp8_kernels.quantize_config(K)
            for rows_ in (1, 2, 4, 8):
                for warps in (4, 8, 16):
                    c = dict(base, ROWS=rows_, num_warps=warps)
                    try:
                        configs[f"rows{rows_}-warps{warps}"] = bench(
                            [lambda c=c: fp8_kernels.quantize_rows_into(w, q, s, config=c)], calls=10)
                    except Exception:
                        pass
        quant.append({"linear": name, "bytes": moved, "quant_us": t_quant, "copy_us": t_copy,
                      "quant_TB_s": moved / t_quant / 1e6, "copy_TB_s": moved / t_copy / 1e6,
                      "quant_over_copy_bandwidth": t_copy / t_quant, "default_config": fp8_kernels.quantize_config(K),
                      "config_sweep_us": configs})
        print(json.dumps(quant[-1]), flush=True)
    out = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "sms": sms,
           "command": " ".join(["python3"] + sys.argv), "gemm": rows, "quantization": quant,
           "quantization_over_copy_median": statistics.median(r["quant_over_copy_bandwidth"] for r in quant)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("device", "quantization_over_copy_median")}))


if __name__ == "__main__":
    main()
