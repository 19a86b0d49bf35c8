"""Generation throughput on one device: megatron_hybrid.inference ("ours", on a HybridEngine's rollout model) against
transformers' ``LlamaForCausalLM.generate`` on the same shape, and the decode memory roofline.

Rows, written as one JSON list to ``--out`` (compare them run to run)::

    {"method": "ours" | "transformers" | "roofline", "variant": "greedy" | "top_p" | "mixed", "batch": B,
     "new_tokens": N, "prompt_len": P, "tok_s": X, "seconds": median, "runs": [...], "tokens": generated, ...}

- ``ours``: ``RolloutGenerator`` (KV cache, continuous batching, CUDA graphs on a GPU) on
  ``HybridEngine(model, RolloutLayout(1, 1))``: B slots; variants ``greedy`` (B prompts of P tokens, N new tokens
  each), ``top_p`` (the same with temperature 1, top_p 0.9), and two of mixed lengths, where sequences end at
  different steps on stop tokens and slots are refilled as they free up (4·B prompts of lengths uniform in
  [P/4, 7P/4], top_p 0.9):

  - ``mixed``: at most 2·N new tokens and a stop set of 1/160 of the vocabulary, so ~N new tokens per prompt on
    average (127.7 if the stop tokens carried their share of the mass): the fixed runs' work per generated token
    (P prompt tokens per N new ones), so the ratio to ``top_p`` measures what ragged lengths and refills cost;
  - ``mixed_prompt_heavy``: at most N new tokens and a stop set of 1/64 (~56 per prompt): 2.3 prompt tokens
    prefilled per generated token, against 1 in the fixed runs, so prefill compute bounds its tok/s below theirs.

  tok/s = generated tokens / wall time of the call (median of ``--runs`` after ``--warmup``; the warm-up captures
  the CUDA graphs). ``new_tokens`` is the cap; ``mean_new_tokens`` what the prompts got. ``digest``: SHA-256 of
  every call's tokens and log-probs (the bits of the float32 values), the same for every call of a row (else
  ``digests`` lists them): two commits that compute the same tokens and log-probs give the same digest.
- ``transformers``: ``LlamaForCausalLM`` with the same shape and random weights, in the same dtype, its defaults
  (``attn_implementation="sdpa"``, dynamic cache, no compile); greedy, ``min_new_tokens = max_new_tokens = N``.
- ``roofline``: per decode step, the weight bytes plus the KV-cache bytes read (on average P + N/2 positions per
  sequence), at the device's copy bandwidth (bytes read + written per second of a large device copy); tok/s =
  B / step time.

Also prints the issue's target ratios (ours / transformers, ours / roofline, 512 vs 128 new tokens, mixed vs
fixed, top-p vs greedy).

    python3 bench/generate.py --out bench/results/generate_h200.json          # one GPU: gpu-1b, B 32 and 128
    python3 bench/generate.py --smoke --out /tmp/generate_smoke.json          # tiny model on the CPU, seconds
    python3 bench/generate.py --out /tmp/g.json --batch 128 --methods ours --profile greedy mixed  # where time goes
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import platform
import socket
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES as _BENCH_SHAPES  # noqa: E402

from megatron_hybrid.models import GPTArchitecture  # noqa: E402

SHAPES: dict[str, GPTArchitecture] = {
    "gpu-1b": _BENCH_SHAPES["gpu-1b"],  # 0.89 B parameters (Llama-shaped, GQA), 1.8 GB in bf16
    "cpu-tiny": GPTArchitecture(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=128, vocab_size=256, make_vocab_size_divisible_by=32,
                                max_position_embeddings=512),
}

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, *, runs: int, warmup: int) -> tuple[Any, list[float]]:
    """``fn()``'s last result and the wall times of ``runs`` calls after ``warmup`` untimed ones."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(runs):
        gc.collect()
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return out, times


def prompts_of(count: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def digest(results: list) -> str:
    """SHA-256 of the generated tokens and log-probs (float32 bits) of one call, prompt by prompt."""
    h = hashlib.sha256()
    for r in results:
        h.update(torch.tensor(r.generated_tokens, dtype=torch.int64).numpy().tobytes())
        h.update(torch.tensor(r.generated_log_probs, dtype=torch.float32).numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes read + written per second by a large device copy."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _, times = timed(lambda: dst.copy_(src), device, runs=10, warmup=2)
    return 2 * nbytes / statistics.median(times)


# -------------------------------------------------------------------------------------------------------------


def bench_ours(arch: GPTArchitecture, device: torch.device, args) -> list[dict]:
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.inference import GenerationConfig, RolloutGenerator

    torch.manual_seed(1234)  # the same weights in every run, so that digests compare across commits
    model = arch.build().to(device)
    engine = HybridEngine(model, RolloutLayout(1, 1))
    P, vocab = args.prompt_len, arch.vocab_size
    longest = 7 * P // 4 + max(max(args.new_tokens), 2 * args.new_tokens[0])
    rows = []
    for B in args.batch:
        generator = RolloutGenerator(engine, GenerationConfig(max_batch_size=B, max_sequence_length=longest))
        order = torch.randperm(vocab, generator=torch.Generator().manual_seed(1)).tolist()
        variants = [("greedy", N, prompts_of(B, P, P, vocab, 10), SamplingParams(top_k=1, num_tokens_to_generate=N),
                     []) for N in args.new_tokens]
        n0 = args.new_tokens[0]
        variants.append(("top_p", n0, prompts_of(B, P, P, vocab, 10),
                         SamplingParams(temperature=1.0, top_p=0.9, num_tokens_to_generate=n0), []))
        mixed_prompts = prompts_of(4 * B, max(1, P // 4), 7 * P // 4, vocab, 11)
        variants.append(("mixed", 2 * n0, mixed_prompts,
                         SamplingParams(temperature=1.0, top_p=0.9, num_tokens_to_generate=2 * n0),
                         order[: max(1, vocab // 160)]))
        variants.append(("mixed_prompt_heavy", n0, mixed_prompts,
                         SamplingParams(temperature=1.0, top_p=0.9, num_tokens_to_generate=n0),
                         order[: max(1, vocab // 64)]))
        for variant, N, prompts, params, stop_ids in variants:
            digests: list[str] = []

            def run():
                out = generator.generate(prompts, params, vocab_size=vocab, stop_token_ids=stop_ids, seed=5)
                digests.append(digest(out))
                return out

            before = generator.report()
            out, times = timed(run, device, runs=args.runs, warmup=args.warmup)
            tokens = sum(len(r.generated_tokens) for r in out)
            rep = generator.report()
            # Per call: the counters are the generator's totals.
            per_call = {key: (rep[key] - before[key]) / (args.runs + args.warmup) for key in
                        ("decode_steps", "mixed_steps", "prefill_forwards", "prefill_graph_forwards", "dropped_rows",
                         "idle_slot_steps", "slot_moves")}
            rows.append({"method": "ours", "variant": variant, "batch": B, "new_tokens": N, "prompt_len": P,
                         "num_prompts": len(prompts), "tokens": tokens, "mean_new_tokens": tokens / len(prompts),
                         "prompt_tokens_per_new_token": sum(map(len, prompts)) / tokens,
                         "tok_s": tokens / statistics.median(times), "seconds": statistics.median(times),
                         "runs": times, "cuda_graph_captures": rep["cuda_graph_captures"],
                         "per_call": per_call, "attention_reads_lengths": rep["attention_reads_lengths"],
                         "overlap_host": rep["overlap_host"], "kv_cache_bytes": rep["kv_cache_bytes"],
                         "digest": digests[-1], **({"digests": digests} if len(set(digests)) > 1 else {})})
            print(json.dumps(rows[-1]), flush=True)
            if args.profile and device.type == "cuda" and variant in args.profile:
                profile(run, f"{variant} B={B} N={N}")
        generator.close()
    engine.switch_to_training()
    engine.close()
    del model, engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def profile(fn: Callable[[], Any], title: str) -> None:
    """Print where one call's device time goes: the kernels with the most CUDA time (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"== profile: {title}", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60),
          flush=True)


def bench_transformers(arch: GPTArchitecture, device: torch.device, args) -> list[dict]:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        print(f"transformers rows skipped: {exc}", file=sys.stderr)
        return []
    config = LlamaConfig(hidden_size=arch.hidden_size, intermediate_size=arch.ffn_hidden_size,
                         num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_attention_heads,
                         num_key_value_heads=arch.num_query_groups or arch.num_attention_heads,
                         vocab_size=arch.vocab_size, max_position_embeddings=arch.max_position_embeddings,
                         rms_norm_eps=arch.norm_epsilon, rope_theta=float(arch.rotary_base),
                         tie_word_embeddings=not arch.untie_embeddings_and_output_weights)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=arch.dtype).eval()
    rows = []
    for B in args.batch:
        for N in args.new_tokens:
            ids = torch.randint(0, arch.vocab_size, (B, args.prompt_len), device=device)

            def run():
                with torch.no_grad():
                    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                                          min_new_tokens=N, do_sample=False, pad_token_id=0)

            out, times = timed(run, device, runs=args.runs, warmup=args.warmup)
            tokens = B * (out.shape[1] - args.prompt_len)
            rows.append({"method": "transformers", "variant": "greedy", "batch": B, "new_tokens": N,
                         "prompt_len": args.prompt_len, "tokens": tokens, "tok_s": tokens / statistics.median(times),
                         "seconds": statistics.median(times), "runs": times,
                         "attn_implementation": model.config._attn_implementation})
            print(json.dumps(rows[-1]), flush=True)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def weight_count(arch: GPTArchitecture) -> int:
    """Parameters of the GPTModel ``arch`` builds (Llama-shaped: no linear biases besides an optional QKV bias)."""
    H, F, V = arch.hidden_size, arch.ffn_hidden_size or 4 * arch.hidden_size, arch.padded_vocab_size(1)
    heads = arch.num_attention_heads
    groups, d = arch.num_query_groups or heads, arch.kv_channels or H // heads
    qkv = (heads + 2 * groups) * d
    layer = H * qkv + (qkv if arch.add_qkv_bias else 0) + heads * d * H + H * F * (2 if arch.swiglu else 1) + F * H
    layer += 2 * H * (2 if arch.normalization == "LayerNorm" else 1)  # the two norms (LayerNorm has a bias)
    final_norm = H * (2 if arch.normalization == "LayerNorm" else 1)
    return arch.num_layers * layer + V * H * (2 if arch.untie_embeddings_and_output_weights else 1) + final_norm


def roofline_rows(arch: GPTArchitecture, device: torch.device, args) -> list[dict]:
    model_bytes = weight_count(arch) * arch.dtype.itemsize
    heads = arch.num_query_groups or arch.num_attention_heads
    head_dim = arch.kv_channels or arch.hidden_size // arch.num_attention_heads
    kv_bytes = 2 * arch.num_layers * heads * head_dim * arch.dtype.itemsize  # per position of one sequence
    bandwidth = copy_bandwidth(device, args.bandwidth_bytes)
    rows = []
    for B in args.batch:
        for N in args.new_tokens:
            positions = args.prompt_len + N / 2
            step = (model_bytes + positions * kv_bytes * B) / bandwidth
            rows.append({"method": "roofline", "variant": "greedy", "batch": B, "new_tokens": N,
                         "prompt_len": args.prompt_len, "tok_s": B / step, "weight_bytes": model_bytes,
                         "kv_bytes_per_position": kv_bytes, "mean_positions": positions,
                         "copy_bandwidth_bytes_s": bandwidth})
    return rows


def targets(rows: list[dict], args) -> dict[str, float]:
    """The issue's ratios, from the rows."""
    def tok_s(method: str, variant: str, B: int, N: int) -> Optional[float]:
        found = [r["tok_s"] for r in rows if (r["method"], r["variant"], r["batch"], r["new_tokens"])
                 == (method, variant, B, N)]
        return found[0] if found else None

    out = {}
    n0 = args.new_tokens[0]
    for B in args.batch:
        ours = tok_s("ours", "greedy", B, n0)
        for name, other in (("transformers", tok_s("transformers", "greedy", B, n0)),
                            ("roofline", tok_s("roofline", "greedy", B, n0))):
            if ours and other:
                out[f"ours/{name} B={B} N={n0}"] = ours / other
        for variant, base in (("mixed", "top_p"), ("mixed_prompt_heavy", "top_p"), ("top_p", "greedy")):
            a, b = tok_s("ours", variant, B, 2 * n0 if variant == "mixed" else n0), tok_s("ours", base, B, n0)
            if a and b:
                out[f"ours {variant}/{base} B={B} N={n0}"] = a / b
        for N in args.new_tokens[1:]:
            a = tok_s("ours", "greedy", B, N)
            if a and ours:
                out[f"ours N={N}/N={n0} B={B}"] = a / ours
    return out


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: gpu-1b (cpu-tiny with --smoke)")
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="decode slots (default 32 128)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128")
    ap.add_argument("--new-tokens", type=int, nargs="+", default=None, help="the first is the reference (128 512)")
    ap.add_argument("--methods", nargs="+", choices=["ours", "transformers", "roofline"],
                    default=["ours", "transformers", "roofline"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bandwidth-bytes", type=int, default=2**31, help="size of the copy that measures bandwidth")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (gloo): checks the bench runs")
    ap.add_argument("--out", required=True, help="JSON list of rows")
    ap.add_argument("--profile", nargs="*", default=[], choices=["greedy", "top_p", "mixed", "mixed_prompt_heavy"],
                    help="print a torch.profiler table of one more call of these variants (GPU)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    args.shape = args.shape or ("cpu-tiny" if smoke else "gpu-1b")
    args.batch = args.batch or ([4] if smoke else [32, 128])
    args.prompt_len = args.prompt_len or (16 if smoke else 128)
    args.new_tokens = args.new_tokens or ([8, 16] if smoke else [128, 512])
    if smoke:
        args.runs, args.warmup, args.bandwidth_bytes = 1, 1, 2**26
    device = torch.device("cpu") if smoke or not torch.cuda.is_available() else torch.device("cuda", 0)
    arch = SHAPES[args.shape]

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1, timeout=datetime.timedelta(minutes=30))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        shim = nullcontext()
    else:
        from megatron_hybrid.patches import cpu_gloo

        shim = cpu_gloo()
    rows: list[dict] = []
    with shim:
        ps.initialize_model_parallel(1, 1)
        # The inference RNG tracker: megatron-core's default one cannot be captured in a CUDA graph.
        model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)
        if "ours" in args.methods:
            rows += bench_ours(arch, device, args)
        if "roofline" in args.methods:
            rows += roofline_rows(arch, device, args)
    if "transformers" in args.methods:
        rows += bench_transformers(arch, device, args)
    meta = {"shape": args.shape, "dtype": arch.params_dtype, "device": torch.cuda.get_device_name(device)
            if device.type == "cuda" else platform.processor() or "cpu", "torch": torch.__version__,
            "command": " ".join(["python3"] + sys.argv)}
    rows = [dict(r, **meta) for r in rows]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(json.dumps({"targets": targets(rows, args), "out": args.out}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
