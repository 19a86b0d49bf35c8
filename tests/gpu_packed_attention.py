"""Packed attention on a GPU (issues 44 and 45; not collected by pytest: needs a GPU).

    python3 tests/gpu_packed_attention.py --output /tmp/packed_attention.json

1. **Exactness of the packed paths.** ``SDPADotProductAttention`` on packs in megatron-core's ``thd`` format (query
   a strided view of a fused QKV tensor, as megatron-core's attention hands it over), once as one varlen flash call
   a pack (``packed_kernel="auto"``) and once as one causal SDPA call per sequence (``"loop"``), forward and
   backward, against an fp32 reference: each sequence alone through SDPA's math kernel with the key and value heads
   repeated. The bf16 kernels round differently, so each kernel's error is measured against the fp32 reference and
   the varlen call must stay within twice the per-sequence loop's error (plus 1 % of the reference's largest
   value: both are bf16 results of an fp32-accumulated softmax; the loop is what the CPU tests pin to ``local``).
2. **The cuDNN backward with sliced output gradients** (issue 45's illegal memory access in the actor update): per
   sequence cuDNN attention on slices of packs of different lengths, the output gradient a slice of the pack's, in
   a subprocess each (an illegal access ends the CUDA context): ``raw`` as the loop ran before, ``contiguous`` as
   it runs now (each output gradient made contiguous). Each gradient is compared with the math kernel's.
3. **Time** of a pack's forward + backward for both paths at the 7B and 1.5B head shapes.

Prints one JSON summary (also to ``--output``); exits 1 when a check of part 1 fails or the ``contiguous`` run of
part 2 does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEVICE = "cuda"  # --dry-run: "cpu" (parts 1 and 3 on the CPU, where the loop serves both kernels)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


SHAPES = {"qwen2.5-7b": (28, 4, 128), "qwen2.5-1.5b": (12, 2, 128)}  # query heads, KV groups, head dim
PACKS = {"4k": [1500, 900, 1200, 496], "ragged": [64, 192, 1, 833, 2112, 704, 190], "one": [4096]}


def fused_qkv(lengths: list[int], heads: int, groups: int, dim: int, *, seed: int):
    """query ``[T, N, D]``, key and value ``[T, G, D]``: strided views of one ``[T, G, (N/G + 2)·D]`` tensor, as
    megatron-core's attention splits its fused QKV projection."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    T, r = sum(lengths), heads // groups
    mixed = torch.randn(T, groups, (r + 2) * dim, device=DEVICE, generator=g, dtype=torch.bfloat16)
    mixed.requires_grad_(True)
    q, k, v = torch.split(mixed, [r * dim, dim, dim], dim=2)
    return mixed, q.reshape(T, heads, dim), k, v


def reference(q, k, v, lengths, grad_out, heads, groups):
    """Each sequence alone, fp32, SDPA's math kernel, key and value heads repeated: out, dq, dk, dv."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    outs, lo = [], 0
    with sdpa_kernel(SDPBackend.MATH):
        for n in lengths:
            qs, ks, vs = (t[lo:lo + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            ks, vs = (t.repeat_interleave(heads // groups, dim=1) for t in (ks, vs))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0].transpose(0, 1))
            lo += n
    out = torch.cat(outs)
    out.backward(grad_out.float())
    return out.detach(), q.grad, k.grad, v.grad


def module(heads: int, groups: int, dim: int):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hybrid.core_attention import SDPADotProductAttention

    config = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=dim, bf16=True, params_dtype=torch.bfloat16,
                               attention_dropout=0.0, hidden_dropout=0.0)
    return SDPADotProductAttention(config, 1, AttnMaskType.causal, "self").to(DEVICE)


def packed(attn, q, k, v, lengths):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    return attn(q, k, v, None, packed_seq_params=params)


def check_exactness() -> list[dict]:
    rows = []
    for shape, (heads, groups, dim) in SHAPES.items():
        attn = module(heads, groups, dim)
        for pack, lengths in PACKS.items():
            errors = {}
            grad_out = torch.randn(sum(lengths), heads, dim, device=DEVICE, dtype=torch.bfloat16)
            ref = None
            for kernel in ("auto", "loop"):
                type(attn).packed_kernel = kernel
                mixed, q, k, v = fused_qkv(lengths, heads, groups, dim, seed=3)
                out = packed(attn, q, k, v, lengths).view(-1, heads, dim)
                q.retain_grad(), k.retain_grad(), v.retain_grad()
                out.backward(grad_out)
                if ref is None:
                    ref = reference(q, k, v, lengths, grad_out, heads, groups)
                errors[kernel] = [float((a.float() - b).abs().max() / b.abs().max())
                                  for a, b in zip((out, q.grad, k.grad, v.grad), ref)]
            type(attn).packed_kernel = "auto"
            ok = all(a <= 2 * b + 1e-2 for a, b in zip(errors["auto"], errors["loop"]))
            rows.append({"shape": shape, "pack": pack, "lengths": lengths,
                         "relative_error_out_dq_dk_dv": errors, "ok": ok})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def time_packs() -> list[dict]:
    rows = []
    for shape, (heads, groups, dim) in SHAPES.items():
        attn = module(heads, groups, dim)
        lengths = PACKS["4k"]
        grad_out = torch.randn(sum(lengths), heads * dim, device=DEVICE, dtype=torch.bfloat16)
        for kernel in ("auto", "loop"):
            type(attn).packed_kernel = kernel
            mixed, q, k, v = fused_qkv(lengths, heads, groups, dim, seed=4)
            times = []
            for i in range(12):
                sync()
                t0 = time.perf_counter()
                packed(attn, q, k, v, lengths).backward(grad_out)
                sync()
                times.append(time.perf_counter() - t0)
            ms = sorted(times[2:])[len(times[2:]) // 2] * 1e3
            flops = 4 * 3 * heads * dim * sum(n * n for n in lengths) / 2  # QKᵀ and AV, fwd + 2× bwd, causal half
            rows.append({"shape": shape, "kernel": kernel, "lengths": lengths, "ms_fwd_bwd": ms,
                         "tflops": flops / ms / 1e9})
            print(json.dumps(rows[-1]), flush=True)
        type(attn).packed_kernel = "auto"
    return rows


def sliced_grads(mode: str) -> dict:
    """Part 2 in this process (``--sliced MODE``): cuDNN per sequence, output gradients slices of the pack's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_hybrid.core_attention import _ContiguousGrad

    heads, groups, dim = SHAPES["qwen2.5-1.5b"]
    worst, trials = 0.0, 0
    for total_extra in (0, 96, 1000, 64, 2048, 0, 448):
        lengths = [1000, 700, 1000, 300 + total_extra]
        mixed, q, k, v = fused_qkv(lengths, heads, groups, dim, seed=total_extra)
        q1, k1, v1 = (t.unsqueeze(1).permute(1, 2, 0, 3) for t in (q, k, v))
        outs, lo = [], 0
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for n in lengths:
                out = F.scaled_dot_product_attention(q1[:, :, lo:lo + n], k1[:, :, lo:lo + n], v1[:, :, lo:lo + n],
                                                     is_causal=True, enable_gqa=True)
                outs.append(_ContiguousGrad.apply(out) if mode == "contiguous" else out)
                lo += n
            out = torch.cat(outs, dim=2)[0].transpose(0, 1)
            q.retain_grad()
            grad_out = torch.randn_like(out)
            out.backward(grad_out)
        sync()
        ref = reference(q, k, v, lengths, grad_out, heads, groups)
        error = float((q.grad.float() - ref[1]).abs().max() / ref[1].abs().max())
        worst, trials = max(worst, error if error == error else float("inf")), trials + 1
    return {"mode": mode, "trials": trials, "worst_relative_dq_error": worst}


def run_sliced(mode: str) -> dict:
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    proc = subprocess.run([sys.executable, __file__, "--sliced", mode], capture_output=True, text=True, timeout=300,
                          env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    row = json.loads(lines[-1]) if lines else {"mode": mode}
    row.update(returncode=proc.returncode, stderr_tail=proc.stderr[-1500:] if proc.returncode else "")
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=None)
    parser.add_argument("--dry-run", action="store_true", help="parts 1 and 3 on the CPU (a check of this script)")
    parser.add_argument("--sliced", choices=["raw", "contiguous"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sliced:
        print(json.dumps(sliced_grads(args.sliced)), flush=True)
        return
    from bench.measure import one_rank

    global DEVICE
    if args.dry_run:
        DEVICE = "cpu"
        PACKS.update(ragged=[5, 1, 17], one=[40])
        PACKS["4k"] = [30, 20, 14]
    summary = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__}
    summary["sliced"] = ([run_sliced("raw"), run_sliced("contiguous")] if DEVICE == "cuda"
                         else [{}, {"returncode": 0, "worst_relative_dq_error": 0}])
    with one_rank(torch.device(DEVICE, 0) if DEVICE == "cuda" else torch.device("cpu")):
        from megatron_hybrid.core_attention import _varlen_function

        found = _varlen_function()
        summary["varlen_parameters"] = sorted(found[1]) if found else None
        summary["exactness"] = check_exactness()
        summary["time"] = time_packs()
    if args.output:
        with open(args.output, "w") as f:
            json.dump(summary, f, indent=1)
    contiguous = summary["sliced"][1]
    failed = (not all(r["ok"] for r in summary["exactness"]) or contiguous["returncode"] != 0
              or contiguous.get("worst_relative_dq_error", 1) > 0.05)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("exactness", "time")}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
