"""The generator alone on issue 46's RL workload: where a rollout phase's time goes, call by call.

    python bench/rl_generate.py --out /tmp/rl_generate.json                    # one GPU: the 1.5B shape, 128 slots
    python bench/rl_generate.py --out /tmp/rl.json --profile quota             # + the kernels of one quota call
    python bench/rl_generate.py --smoke --out /tmp/rl_smoke.json               # a tiny model on the CPU, seconds

The model is the recipe's in bench/rl_step.py (Qwen2.5-1.5B's layers, no QKV bias, untied, a 1,024-token
vocabulary, random weights) on ``HybridEngine(model, RolloutLayout(1, 1))``, generating from a
``RolloutGenerator`` of ``--slots`` slots as the recipe's rollout does (temperature 1, log-probs). The prompts are
bench/rl_step.py's: 32-512 random tokens, each with its own stop set (k - 1 random tokens besides the end token 0,
k log-uniform in [1, ``--stop-sets``]), at most ``--max-new-tokens`` new tokens: responses ~300 tokens on average
with a tail to 4,096. Calls, each timed after an untimed warm-up of the same call (graph captures):

- ``fixed``: ``--slots`` prompts of 128 tokens, 512 new tokens each, no stop token (bench/generate.py's top_p row):
  the generator's rate at a full batch of short contexts;
- ``tail``: ``--slots`` RL prompts run to their ends (a synchronous rollout: the longest sequence sets its length);
- ``quota``: 4 x ``--slots`` RL prompts under ``Budget(finished=--slots)`` (a partial rollout's phase: the slots
  stay full, refilled as sequences end, until the quota has ended);
- ``resume``: the unfinished sequences of the ``quota`` call resumed (their prefixes prefilled again) with as many new
  prompts again, under the same budget (the next phase).

Each row: seconds, generated tokens, tok/s, decode steps, ms per decode step, the mean decode batch (slots busy per
step), mixed steps, prefill forwards (graph / eager), CUDA-graph captures during the timed call, slot moves.
``--profile CALL ...`` (GPU): one more call of each under torch.profiler: the device's busy time against the
wall time (a host-bound loop leaves the device idle) and the kernels with the most device time, grouped
(attention, matmul, other), as ``{"kind": "profile", ...}`` rows. ``--attention``: decode attention alone at the
shape's heads, 128 rows, lengths spread over [lo, hi], per split count: microseconds and GB/s of K/V read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.generate import build_model  # noqa: E402
from bench.kernel_table import is_attention, is_matmul, kernel_base  # noqa: E402
from bench.measure import copy_bandwidth, one_rank, rows_writer, sync  # noqa: E402
from bench.rl_step import draw_prompts  # noqa: E402
from bench.shapes import SHAPES  # noqa: E402

COUNTERS = ("decode_steps", "busy_steps", "idle_slot_steps", "mixed_steps", "prefill_forwards",
            "prefill_graph_forwards", "slot_moves", "dropped_rows", "cuda_graph_captures")


def counters(generator: Any) -> dict[str, float]:
    report = generator.report()
    return {key: report.get(key, 0) for key in COUNTERS}


def call_row(name: str, generator: Any, run: Any, device: torch.device) -> tuple[dict[str, Any], list]:
    """Warm-up call, then the timed one: its row and results."""
    run()
    before = counters(generator)
    sync(device)
    t0 = time.perf_counter()
    out = run()
    sync(device)
    seconds = time.perf_counter() - t0
    after = counters(generator)
    delta = {key: after[key] - before[key] for key in COUNTERS}
    tokens = sum(len(r.generated_tokens) for r in out)
    steps = max(1, delta["decode_steps"])
    slots = generator.report()["kv_cache_slots"]
    row = {"kind": "call", "call": name, "seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds,
           "sequences": len(out), "finished": sum(r.finished for r in out),
           "ms_per_decode_step": 1e3 * seconds / steps,
           "mean_decode_batch": slots - delta["idle_slot_steps"] / steps, **delta}
    print(json.dumps(row), flush=True)
    return row, out


def device_profile(name: str, run: Any, *, top: int) -> dict[str, Any]:
    """One call under torch.profiler: wall time, the union of kernel intervals (device busy), kernel groups."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    kernels.sort(key=lambda k: k[1])
    busy, end = 0.0, -1.0
    for _, a, b in kernels:  # the union of the intervals (us)
        if b > end:
            busy += b - max(a, end)
            end = b
    span = (kernels[-1][2] - kernels[0][1]) if kernels else 0.0
    by_name: dict[str, list[float]] = {}
    for kname, a, b in kernels:
        by_name.setdefault(kernel_base(kname), []).append(b - a)
    groups = {"attention": 0.0, "matmul": 0.0, "other": 0.0}
    for kname, times in by_name.items():
        group = "attention" if is_attention(kname) else "matmul" if is_matmul(kname) else "other"
        groups[group] += sum(times)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    row = {"kind": "profile", "call": name, "wall_s": wall, "device_busy_s": busy / 1e6, "span_s": span / 1e6,
           "busy_over_wall": busy / 1e6 / wall, "kernel_s": {k: v / 1e6 for k, v in groups.items()},
           "kernels": [{"name": k, "count": len(v), "total_ms": sum(v) / 1e3} for k, v in ranked]}
    print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
    for k in row["kernels"]:
        print(f"  {k['total_ms']:9.1f} ms {k['count']:7d}  {k['name'][:100]}", flush=True)
    return row


def attention_rows(arch: Any, device: torch.device, *, rows: int, spreads: list[tuple[int, int]],
                   bandwidth: float) -> list[dict[str, Any]]:
    """decode_attention at ``arch``'s heads (one layer's cache), per length spread and split count."""
    from megatron_hybrid.inference.kernels import decode_attention

    G = arch.num_query_groups or arch.num_attention_heads
    R, D = arch.num_attention_heads // G, arch.hidden_size // arch.num_attention_heads
    out = []
    for lo, hi in spreads:
        L = hi
        keys = torch.randn(rows, G, L, D, device=device, dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        q = torch.randn(rows, G, R, D, device=device, dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(lo, hi + 1, (rows,), generator=g).to(device)
        read = int(lengths.sum()) * G * D * 2 * 2  # K and V, bf16
        for splits in (None, 1, 2, 4, 8, 16, 32):
            def call():
                decode_attention(q, keys, values, lengths, scale=D ** -0.5, max_length=L, num_splits=splits)
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                call()
            stop.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(stop) * 1e3 / 50
            row = {"kind": "attention", "rows": rows, "groups": G, "ratio": R, "head_dim": D, "lengths": [lo, hi],
                   "num_splits": splits, "us": us, "gb_s": read / us / 1e3,
                   "of_copy_bandwidth": read / (us / 1e6) / bandwidth}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.split("\n")[2:6]))
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--max-new-tokens", type=int, default=4096)
    parser.add_argument("--stop-sets", type=int, default=64, metavar="K")
    parser.add_argument("--calls", nargs="+", choices=["fixed", "tail", "quota", "resume"],
                        default=["fixed", "tail", "quota", "resume"])
    parser.add_argument("--profile", nargs="*", default=[], choices=["fixed", "tail", "quota", "resume"])
    parser.add_argument("--attention", action="store_true", help="the decode-attention rows too (GPU)")
    parser.add_argument("--top", type=int, default=25, help="kernels listed per profile")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the bench runs")
    parser.add_argument("--out", default=None, help="JSON list the rows are appended to")
    args = parser.parse_args(argv)
    if args.slots < 1 or args.max_new_tokens < 1:
        raise ValueError(f"--slots ({args.slots}) and --max-new-tokens ({args.max_new_tokens}) must be positive")

    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.inference import Budget, GenerationConfig, RolloutGenerator

    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.smoke else torch.device("cpu")
    if args.smoke:
        arch = SHAPES["cpu-tiny"]
        args.slots, args.max_new_tokens, args.prompt_range = 4, 16, (4, 12)
    else:
        arch = dataclasses.replace(SHAPES["qwen2.5-1.5b"], vocab_size=args.vocab_size, add_qkv_bias=False,
                                   untie_embeddings_and_output_weights=True,
                                   max_position_embeddings=args.prompt_range[1] + args.max_new_tokens)
    vocab, B = args.vocab_size if not args.smoke else arch.vocab_size, args.slots
    write = rows_writer(args.out)
    rows: list[dict[str, Any]] = []
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "command": "bench/rl_generate.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    with one_rank(device):
        model = build_model(arch, device)
        engine = HybridEngine(model, RolloutLayout(1, 1))
        engine.switch_to_rollout()
        longest = args.prompt_range[1] + args.max_new_tokens
        generator = RolloutGenerator(engine, GenerationConfig(max_batch_size=B, max_sequence_length=longest))
        rl = SamplingParams(temperature=1.0, top_k=0, top_p=0.0, num_tokens_to_generate=args.max_new_tokens,
                            termination_id=0)
        runs: dict[str, Any] = {}
        if "fixed" in args.calls:
            g = torch.Generator().manual_seed(0)
            fixed = [torch.randint(1, vocab, (128 if not args.smoke else 8,), generator=g).tolist() for _ in range(B)]
            params = SamplingParams(temperature=1.0, top_p=0.9, num_tokens_to_generate=512 if not args.smoke else 8)
            runs["fixed"] = lambda: generator.generate(fixed, params, vocab_size=vocab, seed=3)
        lo, hi = args.prompt_range
        tail_p, tail_s = draw_prompts(B, lo=lo, hi=hi, vocab=vocab, stop_sets=args.stop_sets, seed=1)
        runs["tail"] = lambda: generator.generate(tail_p, rl, vocab_size=vocab, seed=3,
                                                  request_stop_token_ids=tail_s)
        quota_p, quota_s = draw_prompts(4 * B, lo=lo, hi=hi, vocab=vocab, stop_sets=args.stop_sets, seed=2)
        budget = Budget(finished=B)
        runs["quota"] = lambda: generator.generate(quota_p, rl, vocab_size=vocab, seed=3, budget=budget,
                                                   request_stop_token_ids=quota_s)
        new_p, new_s = draw_prompts(4 * B, lo=lo, hi=hi, vocab=vocab, stop_sets=args.stop_sets, seed=4)
        results: dict[str, list] = {}
        for name in args.calls:
            if name == "resume":
                first = results.get("quota") or runs["quota"]()  # the unfinished of a quota call resume
                parked = [r for r in first if not r.finished]
                fresh = len(first) - len(parked)
                runs["resume"] = lambda: generator.generate(new_p[:fresh], rl, vocab_size=vocab, seed=5, budget=budget,
                                                            resume=parked, request_stop_token_ids=new_s[:fresh])
            row, results[name] = call_row(name, generator, runs[name], device)
            rows.append({**row, **meta, "slots": B, "max_new_tokens": args.max_new_tokens})
            write(rows)
            if name in args.profile and device.type == "cuda":
                rows.append({**device_profile(name, runs[name], top=args.top), **meta})
                write(rows)
        if args.attention and device.type == "cuda":
            bandwidth = copy_bandwidth(device, 2 ** 31)
            rows += [{**r, **meta} for r in attention_rows(
                arch, device, rows=B, spreads=[(32, 1024), (256, 4608), (2048, 4608)], bandwidth=bandwidth)]
            write(rows)
        generator.close()
        engine.switch_to_training()
    calls = {r["call"]: r for r in rows if r["kind"] == "call"}
    print("| call | s | tokens | tok/s | decode steps | ms/step | mean batch | mixed | prefills (graph) | captures |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in calls.items():
        print(f"| {name} | {r['seconds']:.2f} | {r['tokens']} | {r['tok_s']:.0f} | {r['decode_steps']} | "
              f"{r['ms_per_decode_step']:.2f} | {r['mean_decode_batch']:.1f} | {r['mixed_steps']} | "
              f"{r['prefill_forwards'] + r['prefill_graph_forwards']} ({r['prefill_graph_forwards']}) | "
              f"{r['cuda_graph_captures']} |")
    if calls:
        print(json.dumps({"median ms/step": statistics.median(r["ms_per_decode_step"] for r in calls.values())}))


if __name__ == "__main__":
    main()
