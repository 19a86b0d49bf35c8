"""Training passes at RL lengths (issue 44): forward + backward tokens/s, MFU and peak memory of the padded path
(every sequence padded to the longest prompt + the longest response, ``--micro-batch-size`` sequences a
micro-batch) against packed micro-batches (``--max-tokens-per-micro-batch``), each with its core attention, at the
same sequences per step, on a long-tailed RL length mix; then the longest single sequence each path fits.

    python bench/train_pass.py --shape qwen2.5-7b-8l --out bench/results/train_pass_h100.json
    python bench/train_pass.py --shape qwen2.5-1.5b --methods padded-local packed-sdpa --out results.json
    python bench/train_pass.py --shape cpu-tiny --smoke          # the code path on the CPU, in seconds
    python bench/train_pass.py --table bench/results/train_pass_h100.json   # the rows as a markdown table
    python bench/train_pass.py --recompute-granularity full --recompute-method uniform --recompute-num-layers 1

A step is one pass of megatron-core's schedule (TrainingPasses.run, forward and backward) over the step's
sequences with the token-mean NLL of the responses as the loss; no optimizer. Model FLOPs as Megatron-LM counts
them: 6 · (parameters less the input embedding) per real token, plus causal attention, 6 · layers · hidden · Σ L²
/ ... (QKᵀ and AV, forward and backward, half the square); MFU against the dense bf16 peak (989 TFLOP/s on H100 and
H200). Padding counts as time, not as tokens. Rows are appended to ``--out`` as they are measured (the command
and the recompute flags beside them); a method that runs out of memory gets a row saying so. Megatron-LM's
``--recompute-granularity``, ``--recompute-method`` and ``--recompute-num-layers`` (the recipe's) trade the
activations' memory for a rerun of the forward: the model FLOPs (and so MFU) count no recompute, as Megatron-LM's do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.measure import one_rank, sync, timed  # noqa: E402
from bench.shapes import SHAPES  # noqa: E402
from megatron_hybrid.rl.arguments import add_recompute_args, check_recompute, recompute_config  # noqa: E402

PEAK_BF16_FLOPS = 989e12  # H100 / H200 SXM dense bf16
METHODS = ("padded-local", "padded-sdpa", "packed-sdpa", "packed-flex")


def length_mix(num: int, *, prompt: tuple[int, int], response_max: int, seed: int) -> list[tuple[int, int]]:
    """``num`` (prompt, response) lengths: prompts uniform in ``prompt``, responses long-tailed (log-normal around a
    median of response_max / 8, cut at ``response_max``)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(prompt[0], prompt[1] + 1, (num,), generator=g)
    responses = (torch.randn(num, generator=g) * 0.9 + math.log(response_max / 8)).exp().clamp(16, response_max)
    return [(int(p), int(r)) for p, r in zip(prompts, responses)]


def model_flops(arch, params: int, lengths: list[int]) -> float:
    """Megatron-LM's count: 6 · parameters (less the input embedding) per token + causal attention."""
    embedding = arch.padded_vocab_size(1) * arch.hidden_size
    dense = params - (embedding if arch.untie_embeddings_and_output_weights else 0)
    attention = 6 * arch.num_layers * arch.hidden_size * sum(n * n for n in lengths)  # 12·L²·h halved (causal)
    return 6 * dense * sum(lengths) + attention


def nll(passes):
    def loss_fn(output, mb):
        logp, _ = passes.token_stats(output, mb)
        mask = mb["mask"]
        loss = -(logp * mask).sum() / mask.sum().clamp_min(1)
        return loss, {}
    return loss_fn


def run_method(method: str, arch, model_by_backend: dict, pairs: list[tuple[int, int]], args,
               device: torch.device, *, runs: int, warmup: int) -> dict[str, Any]:
    from megatron_hybrid import rl

    layout, backend = method.split("-")
    model = model_by_backend[backend]
    g = torch.Generator().manual_seed(7)
    vocab = arch.vocab_size
    prompts = [torch.randint(0, vocab, (p,), generator=g).tolist() for p, _ in pairs]
    responses = [torch.randint(0, vocab, (r,), generator=g).tolist() for _, r in pairs]
    new = max(r for _, r in pairs)
    seq_length = max(p for p, _ in pairs) + new
    batch = rl.make_batch(prompts, responses, max_new_tokens=new, seq_length=seq_length, device=device)
    budget = args.max_tokens_per_micro_batch if layout == "packed" else None
    passes = rl.TrainingPasses(rl.PassConfig(seq_length, args.micro_batch_size, vocab,
                                             max_tokens_per_micro_batch=budget,
                                             logit_chunk_tokens=args.logit_chunk_tokens))
    lengths = [p + r for p, r in pairs]
    row: dict[str, Any] = {"method": method, "sequences": len(pairs), "tokens": sum(lengths),
                           "longest": max(lengths), "padded_tokens": len(pairs) * seq_length,
                           "micro_batches": len(passes.micro_batches(batch)),
                           "recompute_granularity": args.recompute_granularity,
                           "recompute_method": args.recompute_method, "recompute_num_layers": args.recompute_num_layers}

    def step():
        model.zero_grad(set_to_none=True)
        passes.run(model, batch, nll(passes), forward_only=False)

    torch.cuda.empty_cache() if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        _, times = timed(step, device, runs=runs, warmup=warmup)
    except torch.OutOfMemoryError as error:
        model.zero_grad(set_to_none=True)
        return {**row, "oom": str(error).splitlines()[0][:200]}
    seconds = statistics.median(times)
    flops = model_flops(arch, sum(p.numel() for p in model.parameters()), lengths)
    row.update(seconds=seconds, times=times, tokens_per_s=sum(lengths) / seconds,
               tflops=flops / seconds / 1e12, mfu=flops / seconds / PEAK_BF16_FLOPS,
               peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None)
    model.zero_grad(set_to_none=True)
    return row


def profile(method: str, arch, model_by_backend: dict, pairs: list[tuple[int, int]], args,
            device: torch.device, tag: Optional[str] = None) -> None:
    """One step of ``method`` under torch.profiler: ``args.profile``/profile_<tag>.txt (``tag``: the method's name
    by default) lists the operators and kernels by their device time (the top 60)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        run_method(method, arch, model_by_backend, pairs, args, device, runs=1, warmup=0)
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    os.makedirs(args.profile, exist_ok=True)
    path = os.path.join(args.profile, f"profile_{tag or method}.txt")
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by=sort_by, row_limit=60, max_name_column_width=90))
    print(f"{method}: profile in {path}", flush=True)


def longest_fit(method: str, arch, model_by_backend: dict, args, device: torch.device,
                lengths: list[int]) -> Optional[int]:
    """The longest of ``lengths`` (one sequence: a prompt of up to 512 tokens and the rest response) the method
    trains."""
    fits = None
    for n in lengths:
        prompt = min(512, n // 2)
        pair = [(prompt, n - prompt)]
        budget_args = argparse.Namespace(**{**vars(args),
                                            "max_tokens_per_micro_batch": max(n, args.max_tokens_per_micro_batch)})
        row = run_method(method, arch, model_by_backend, pair, budget_args, device, runs=1, warmup=0)
        if "oom" in row:
            break
        fits = n
    return fits


def table(rows: list[dict]) -> str:
    """A markdown table of ``rows`` (``--out``'s JSON), grouped by shape and length mix, each row's tokens/s also
    as a ratio to padded-local's of the same group."""
    lines = ["| shape | responses ≤ | budget | method | tokens/s | × padded-local | MFU | peak GiB | longest fit |",
             "|---|---|---|---|---|---|---|---|---|"]
    key = lambda r: (r.get("shape"), r.get("response_max"), r.get("max_tokens_per_micro_batch"))  # noqa: E731
    for r in rows:
        base = next((b for b in rows if key(b) == key(r) and b["method"] == "padded-local" and "tokens_per_s" in b),
                    None)
        if "tokens_per_s" in r:
            ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "—"
            speed, mfu = f"{r['tokens_per_s']:.0f}", f"{r['mfu']:.3f}"
            peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "—"
        else:
            speed, ratio, mfu, peak = "out of memory", "—", "—", "—"
        method = f"{r['method']} ({r['packed_kernel']})" if r.get("packed_kernel") else r["method"]
        method += ", megatron-core's packed RoPE" if r.get("packed_rope") == "megatron" else ""
        lines.append(f"| {r.get('shape')} | {r.get('response_max')} | {r.get('max_tokens_per_micro_batch')} | "
                     f"{method} | {speed} | {ratio} | {mfu} | {peak} | {r.get('longest_fit', '—')} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-7b-8l", choices=sorted(SHAPES))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--sequences", type=int, default=32, help="sequences per step")
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(128, 1024))
    parser.add_argument("--response-max", type=int, default=8192)
    parser.add_argument("--micro-batch-size", type=int, default=1, help="padded path: sequences per micro-batch")
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=16384, help="packed path: the budget")
    parser.add_argument("--logit-chunk-tokens", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--longest", type=int, nargs="*", default=[8192, 16384, 32768],
                        help="single-sequence lengths to probe, per method (none: skip)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on whatever device there is")
    add_recompute_args(parser)  # Megatron-LM's flags, as the recipe takes them (default: no recompute)
    parser.add_argument("--packed-kernel", choices=["auto", "loop"], default="auto",
                        help="packed sdpa on a GPU: one varlen flash call a pack where torch has it (auto), or one "
                        "causal SDPA call per sequence (loop)")
    parser.add_argument("--packed-rope", choices=["ours", "megatron", "both"], default="ours",
                        help="packed sequences' rotary embeddings: ours (megatron_hybrid.megatron.patches.rope, no "
                        "host syncs; what the models get), megatron-core's own (a loop over the sequences, two host "
                        "reads a layer), or both, one after the other (rows tagged packed_rope)")
    parser.add_argument("--profile", default=None, metavar="DIR", help="also profile one step of each method "
                        "(torch.profiler): DIR/profile_<method>.txt, the kernels by device time")
    parser.add_argument("--out", default=None, help="JSON file the rows are appended to")
    parser.add_argument("--table", default=None, metavar="JSON", help="print a markdown table of a results file "
                        "and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.load(open(args.table))))
        return
    if args.max_tokens_per_micro_batch < args.prompt_range[1] + args.response_max:
        parser.error(f"--max-tokens-per-micro-batch ({args.max_tokens_per_micro_batch}) must hold the longest "
                     f"sequence ({args.prompt_range[1]} + {args.response_max})")
    if args.smoke:
        args.shape, args.sequences, args.prompt_range, args.response_max = "cpu-tiny", 6, (4, 12), 40
        args.max_tokens_per_micro_batch, args.logit_chunk_tokens, args.runs, args.warmup = 64, 16, 1, 0
        args.longest = [64, 128]
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    arch = SHAPES[args.shape]
    try:
        check_recompute(args.recompute_granularity, args.recompute_method, args.recompute_num_layers,
                        layers_per_stage=arch.num_layers, layers_from=f"--shape {args.shape}'s layers, one stage")
    except ValueError as error:
        parser.error(str(error))
    pairs = length_mix(args.sequences, prompt=tuple(args.prompt_range), response_max=args.response_max, seed=1)
    rows: list[dict] = []
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    with one_rank(device):
        from megatron_hybrid.core_attention import SDPADotProductAttention, _flex_error

        SDPADotProductAttention.packed_kernel = args.packed_kernel

        backends = sorted({m.split("-")[1] for m in args.methods})
        if "flex" in backends and _flex_error(device.type) is not None:
            print(f"flex skipped: {_flex_error(device.type)}")
            backends.remove("flex")
            args.methods = [m for m in args.methods if not m.endswith("flex")]
        torch.manual_seed(1234)
        config = arch.transformer_config(use_cpu_initialization=device.type != "cuda", **recompute_config(args))
        first = arch.build(config, attention_backend=backends[0]).to(device)
        models = {backends[0]: first}
        for backend in backends[1:]:  # the same weights: the core attention holds none
            models[backend] = arch.build(config, attention_backend=backend).to(device)
            models[backend].load_state_dict(first.state_dict())
        existing = json.load(open(args.out)) if args.out and os.path.exists(args.out) else []

        def save() -> None:  # every row so far (a run cut short keeps what it measured)
            if args.out:
                with open(args.out + ".tmp", "w") as f:
                    json.dump(existing + rows, f, indent=1)
                os.replace(args.out + ".tmp", args.out)

        from megatron_hybrid.megatron.patches.rope import megatron_packed_rope

        ropes = ["ours", "megatron"] if args.packed_rope == "both" else [args.packed_rope]
        for method, rope in ((m, r) for m in args.methods for r in ropes):
            with megatron_packed_rope() if rope == "megatron" else contextlib.nullcontext():
                row = run_method(method, arch, models, pairs, args, device, runs=args.runs, warmup=args.warmup)
            row.update(packed_rope=rope, shape=args.shape, prompt_range=list(args.prompt_range), response_max=args.response_max,
                       max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
                       micro_batch_size=args.micro_batch_size, device=name, torch=torch.__version__,
                       packed_kernel=args.packed_kernel if method == "packed-sdpa" else None,
                       command=" ".join(sys.argv))
            rows.append(row)
            save()
            print(json.dumps({k: v for k, v in row.items() if k not in ("times", "command")}), flush=True)
            if args.profile and "oom" not in row:
                with megatron_packed_rope() if rope == "megatron" else contextlib.nullcontext():
                    profile(method, arch, models, pairs, args, device, tag=f"{method}-{rope}-rope")
            if args.longest:
                row["longest_fit"] = longest_fit(method, arch, models, args, device, args.longest)
                row["longest_probed"] = args.longest
                save()
                print(f"{method}: longest single sequence trained {row['longest_fit']} of {args.longest}", flush=True)
        sync(device)
    base = next((r for r in rows if r["method"] == "padded-local" and "tokens_per_s" in r), None)
    for r in rows:
        if base is not None and "tokens_per_s" in r:
            print(f"{r['method']}: {r['tokens_per_s']:.0f} tokens/s = {r['tokens_per_s'] / base['tokens_per_s']:.2f}× "
                  f"padded-local, MFU {r['mfu']:.3f}, longest fit {r.get('longest_fit')}")


if __name__ == "__main__":
    main()
