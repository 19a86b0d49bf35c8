"""Whole RL steps of the recipe on one device (issue 45, step 5): where a GRPO step's time and memory go.

    python bench/rl_step.py --out bench/results/rl_step_h100.json               # the 1.5B shape, one GPU
    python bench/rl_step.py --shape qwen2.5-1.5b --rollout-fp8 --out rows.json  # FP8 rollout weights, same seeds
    python bench/rl_step.py --smoke                                             # a tiny model on the CPU, seconds
    python bench/rl_step.py --shape qwen2.5-7b --out rows.json -- --use-distributed-optimizer \
        --optimizer-cpu-offload --use-precision-aware-optimizer --optimizer-offload-fraction 0.9 \
        --recompute-granularity full --recompute-method uniform --recompute-num-layers 1

The recipe's own Trainer (examples/ppo/train_ppo.py) at world size 1, random weights, the built-in task (reward:
the target token's share of the response) on variable prompts: ``--prompts`` prompts of 128-1,024 random tokens
(``--prompt-range``), ``--num-samples-per-prompt`` 4 samples each, GRPO, at most ``--max-new-tokens`` 4,096 new
tokens that end at a stop token: the bench gives the NullTokenizer token 0 as its end token, which a random model
samples about once in ``--vocab-size`` tokens, so responses are long-tailed (geometric, mean ~ the vocabulary,
cut at the maximum). Packed training passes (``--max-tokens-per-micro-batch``, sdpa), bf16 with fp32 main
parameters. ``--warmup`` steps (CUDA graphs captured, kernels compiled), then ``--steps`` measured: one row per
measured step with every phase's seconds (``time/*``), each way of the switch and of the offload, the peak memory
of each phase (``memory/*``), generation tokens/s and the update's MFU, then a ``summary`` row of medians. Rows go
to ``--out`` (a JSON list) with the command and the device; the phase table is printed as markdown.

``--compare-generation RUNS`` (issue 45: generation inside the loop against ``bench/generate.py``'s way, side by
side): after the measured steps, with the weights of the last one, the last step's prompts and seed are generated
RUNS times through the loop's own call (``Trainer.generate``: the switch, the offload policy, the cache sized to
what is free; its generation seconds as the loop's phase counts them) and RUNS times as ``bench/generate.py`` calls
the generator (the engine in rollout with the optimizer and gradients on the host, a generator of
``--inference-max-requests`` slots made for the purpose, one untimed warm-up call, wall time of each call). A
``generation`` row gives both tok/s, their ratio (the acceptance's 90 %), tokens and slots of each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import runpy
import statistics
import sys
import tempfile
from typing import Any, Callable, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.measure import rows_writer  # noqa: E402

RECIPE = os.path.join(ROOT, "examples", "ppo", "train_ppo.py")
#: Model flags of each shape (Megatron-LM names); the vocabulary is --vocab-size's.
SHAPES = {
    # Qwen2.5-1.5B's layers (28, hidden 1,536, 12 heads / 2 KV groups, SwiGLU 8,960, RMSNorm, RoPE), no QKV bias.
    "qwen2.5-1.5b": ["--num-layers", "28", "--hidden-size", "1536", "--num-attention-heads", "12",
                     "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "8960", "--swiglu",
                     "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                     "--untie-embeddings-and-output-weights"],
    # Qwen2.5-7B's layers (28, hidden 3,584, 28 heads / 4 KV groups, SwiGLU 18,944), no QKV bias: issue 45's 7B rows
    # (add e.g. -- --use-distributed-optimizer --optimizer-cpu-offload --use-precision-aware-optimizer
    # --optimizer-offload-fraction 0.9 --recompute-granularity full --recompute-method uniform
    # --recompute-num-layers 1: the host holds 16 bytes per offloaded parameter, fp32 copy, gradient and moments).
    "qwen2.5-7b": ["--num-layers", "28", "--hidden-size", "3584", "--num-attention-heads", "28",
                   "--group-query-attention", "--num-query-groups", "4", "--ffn-hidden-size", "18944", "--swiglu",
                   "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                   "--untie-embeddings-and-output-weights"],
    "cpu-tiny": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size",
                 "128"],
}
PHASES = ("generation", "switch", "reward", "actor_log_probs", "reference_log_probs", "critic_values", "update",
          "step")


def draw_prompts(count: int, *, lo: int, hi: int, vocab: int, seed: int, stop_sets: int = 0,
                 target: int = 5) -> tuple[list[list[int]], Optional[list[list[int]]]]:
    """``count`` prompts of ``lo``-``hi`` random token ids, none the end token 0; with ``stop_sets`` K > 0 also each
    one's stop set: k - 1 random tokens besides the end token (never the reward's ``target``), k log-uniform in
    [1, K], so that a response ends after about vocab / k tokens: most short, a long tail of those with few stop
    tokens (None without)."""
    import math

    g = torch.Generator().manual_seed(seed)
    prompts, stops = [], []
    for _ in range(count):
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        prompts.append(torch.randint(1, vocab, (n,), generator=g).tolist())
        if stop_sets:
            k = min(stop_sets, int(math.exp(float(torch.rand((), generator=g)) * math.log(stop_sets + 1))))
            others = [t for t in torch.randperm(vocab - 1, generator=g).add(1).tolist() if t != target][: k - 1]
            stops.append(sorted(others))
    return prompts, (stops if stop_sets else None)


def prompt_file(path: str, *, count: int, lo: int, hi: int, vocab: int, seed: int, stop_sets: int = 0,
                target: int = 5) -> None:
    """:func:`draw_prompts`' prompts as NullTokenizer text (ids separated by spaces), one a line; with ``stop_sets``
    JSONL rows (``--prompt-data``), each with its own ``stop_token_ids``."""
    prompts, stops = draw_prompts(count, lo=lo, hi=hi, vocab=vocab, seed=seed, stop_sets=stop_sets, target=target)
    with open(path, "w") as f:
        for i, prompt in enumerate(prompts):
            text = " ".join(map(str, prompt))
            if stops is None:
                f.write(text + "\n")
            else:
                f.write(json.dumps({"prompt": text, "answer": "", "stop_token_ids": stops[i]}) + "\n")


def recipe_argv(args: argparse.Namespace, prompts: str) -> list[str]:
    """The recipe's command line for the bench's settings."""
    per_step = args.prompts * args.num_samples_per_prompt
    argv = [*SHAPES[args.shape], "--tokenizer-type", "NullTokenizer", "--vocab-size", str(args.vocab_size),
            "--max-position-embeddings", str(args.prompt_range[1] + args.max_new_tokens),
            "--make-vocab-size-divisible-by", "128", "--tensor-model-parallel-size", "1",
            "--algorithm", "grpo", "--num-samples-per-prompt", str(args.num_samples_per_prompt),
            "--global-batch-size", str(per_step), "--max-new-tokens", str(args.max_new_tokens),
            *(["--prompt-data", prompts, "--reward-type", "target-token"] if args.stop_sets else
              ["--prompt-file", prompts]), "--train-iters", str(args.warmup + args.steps), "--no-progress",
            "--attention-backend", "sdpa", "--max-tokens-per-micro-batch", str(args.max_tokens_per_micro_batch),
            "--inference-max-requests", str(args.inference_max_requests), "--offload-optimizer", args.offload_optimizer,
            "--target-token", "5", "--lr", str(args.lr)]
    if not args.smoke:
        argv.append("--bf16")
    if args.rollout_fp8:  # FP8 rollout weights are rebuilt at every switch: canonical mode
        argv += ["--rollout-fp8", "--hybrid-weight-mode", "canonical"]
    return argv + args.recipe_args


def run(args: argparse.Namespace, on_step: Optional[Callable[[list[dict[str, Any]]], None]] = None
        ) -> list[dict[str, Any]]:
    """The measured steps' rows and their summary; ``on_step`` gets them after every measured step (so a run cut
    short by a time limit leaves the steps it measured)."""
    from megatron_hybrid import rl

    import socket

    with socket.socket() as sock:  # one process: a world of one, as torchrun --nproc_per_node 1 would set it up
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port)).items():
        os.environ.setdefault(key, value)
    recipe = runpy.run_path(RECIPE, run_name="recipe")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "prompts.jsonl" if args.stop_sets else "prompts.txt")
        prompt_file(path, count=args.prompts * (args.warmup + args.steps), lo=args.prompt_range[0],
                    hi=args.prompt_range[1], vocab=args.vocab_size, seed=args.seed, stop_sets=args.stop_sets)
        argv = recipe_argv(args, path)
        parsed = recipe["parse_args"](argv)
        task = rl.load_task(parsed)
        task = dataclasses.replace(task, tokenizer=_with_end_token(task.tokenizer, 0))
        history = []
        with rl.initialize(parsed):
            trainer = recipe["Trainer"](parsed, task)
            mem = _memory()
            print(f"built: {_memory_line(mem)}", flush=True)
            built = {f"{k}_after_build": v for k, v in mem.items()}
            for step in range(args.warmup + args.steps):
                step_metrics = trainer.train_step()
                mem = _memory()  # after the step: its peak host memory, the card as the step left it
                metrics = {**step_metrics, **mem, **built}
                history.append(metrics)
                print(f"step {step + 1}: {metrics['time/step']:.2f} s, reward {metrics['reward_mean']:.3f}, "
                      f"response length {metrics['response_length']:.0f}; {_memory_line(mem)}", flush=True)
                if on_step is not None and step >= args.warmup:
                    on_step(_rows(args, argv, history))
            compared = [compare_generation(trainer, args, argv)] if args.compare_generation else []
    return _rows(args, argv, history) + compared


_SET_ASIDE = [0]  # bytes --card-gib mapped aside


def _ballast(card_gib: Optional[float]) -> Any:
    """``--card-gib``: map all of the card but ``card_gib`` GiB (CUDA virtual memory, which PyTorch's counters do not
    see), so that everything this run allocates, PyTorch's or not, fits in ``card_gib`` or fails as it would there."""
    if card_gib is None:
        return None
    from megatron_hybrid.memory import ReservedBuffer, allocation_granularity

    if not torch.cuda.is_available():
        raise ValueError(f"--card-gib ({card_gib}) needs a GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    granule = allocation_granularity(device)
    extra = (total - int(card_gib * 2**30)) // granule * granule
    if card_gib <= 0:
        raise ValueError(f"--card-gib ({card_gib}) must be positive")
    if extra <= 0:  # this card is no larger: run as it is
        print(f"--card-gib {card_gib}: the card has {total / 2**30:.1f} GiB, nothing set aside", flush=True)
        return None
    buf = ReservedBuffer(extra, torch.uint8, device=device, backend="cuda_vmm")
    buf.map(0, extra)
    _SET_ASIDE[0] = extra
    print(f"--card-gib {card_gib}: {extra / 2**30:.1f} GiB of the card's {total / 2**30:.1f} GiB mapped aside",
          flush=True)
    return buf


def _memory() -> dict[str, float]:
    """The device's memory now (``memory/device_used_gib``: held by every allocation of the process, PyTorch's or
    not) and the host's peak resident set (``memory/host_peak_rss_gib``), in GiB."""
    import resource

    out = {"memory/host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        out["memory/device_used_gib"] = (total - free - _SET_ASIDE[0]) / 2**30  # --card-gib's share not counted
    return out


def _memory_line(mem: dict[str, float]) -> str:
    """:func:`_memory`'s reading (and PyTorch's allocated memory) as a line of the log."""
    host = f"host peak RSS {mem['memory/host_peak_rss_gib']:.1f} GiB"
    if "memory/device_used_gib" not in mem:
        return host
    total = (torch.cuda.mem_get_info()[1] - _SET_ASIDE[0]) / 2**30
    return (f"GPU {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated, {mem['memory/device_used_gib']:.1f} of "
            f"{total:.1f} GiB used; {host}")


def compare_generation(trainer: Any, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """The ``generation`` row of ``--compare-generation`` (the module docstring): the loop's generate call against
    the generator called as ``bench/generate.py`` calls it, same weights, prompts, seed and sampling."""
    from megatron_hybrid.inference import GenerationConfig

    from bench.measure import timed

    a, step = trainer.args, trainer.step - 1  # the last step's prompts and seed
    base = trainer.prompts.for_step(step, dp_rank=trainer.dp_rank, dp_size=trainer.dp_size)
    prompts = [e.tokens for e in base for _ in range(a.num_samples_per_prompt)]
    seed = a.seed * 7919 + step
    loop = []
    for _ in range(args.compare_generation):
        rollout = trainer.generate(prompts, seed)
        loop.append((rollout.num_tokens, rollout.generation_seconds, trainer.engine.generation_report()))
    engine, device = trainer.engine, trainer.device
    sizes = trainer.generation_config
    config = GenerationConfig(max_batch_size=args.inference_max_requests, max_sequence_length=sizes.max_sequence_length)
    params = _sampling_params(a)
    stop = ([] if trainer.tokenizer.eod is None else [trainer.tokenizer.eod]) + a.stop_token_ids
    engine.switch_to_rollout(offload_optimizer=trainer.actor.optimizer, offload_grads=True)
    try:
        out, times = timed(lambda: engine.generate(prompts, params, seed=seed, vocab_size=trainer.tokenizer.vocab_size,
                                                   stop_token_ids=stop, tempered_log_probs=True, config=config),
                           device, runs=args.compare_generation, warmup=1)
        alone_report = engine.generation_report()
    finally:
        engine.switch_to_training()
    alone_tokens = sum(len(r.generated_tokens) for r in out)
    loop_tok_s = statistics.median(n / s for n, s, _ in loop)
    alone_tok_s = alone_tokens / statistics.median(times)
    row = {"kind": "generation", "shape": args.shape, "device": _device_name(), "command": " ".join(sys.argv),
           "recipe_argv": argv, "prompts": len(prompts), "runs": args.compare_generation,
           "loop_tok_s": loop_tok_s, "standalone_tok_s": alone_tok_s, "loop_over_standalone": loop_tok_s / alone_tok_s,
           "loop_tokens": [n for n, _, _ in loop], "loop_seconds": [s for _, s, _ in loop],
           "standalone_tokens": alone_tokens, "standalone_seconds": times,
           "loop_slots": loop[-1][2].get("kv_cache_slots"), "standalone_slots": alone_report.get("kv_cache_slots"),
           "loop_kv_cache_bytes": loop[-1][2].get("kv_cache_bytes"),
           "standalone_kv_cache_bytes": alone_report.get("kv_cache_bytes")}
    print(json.dumps({k: v for k, v in row.items() if k not in ("command", "recipe_argv")}), flush=True)
    return row


def _sampling_params(a: argparse.Namespace) -> Any:
    """The recipe's sampling settings (Trainer.generate's)."""
    from megatron.core.inference.sampling_params import SamplingParams

    return SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                          num_tokens_to_generate=a.max_new_tokens)


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _rows(args: argparse.Namespace, argv: list[str], history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    device = _device_name()
    rows = [{**{k: v if k == "partial/staleness" else _scalar(v) for k, v in m.items()}, "kind": "step",
             "shape": args.shape, "device": device, "command": " ".join(sys.argv), "recipe_argv": argv}
            for i, m in enumerate(history) if i >= args.warmup]
    summary = {"kind": "summary", "shape": args.shape, "device": device, "steps": len(rows),
               "command": " ".join(sys.argv), "rollout_fp8": args.rollout_fp8}
    for key in sorted({k for r in rows for k in r if isinstance(r[k], (int, float)) and not isinstance(r[k], bool)}
                      - {"step"}):
        values = [r[key] for r in rows if key in r]
        summary[key] = statistics.median(values)
    if len(rows) >= 10:  # the acceptance's rise of the reward: the last 5 measured steps' mean minus the first 5's
        rewards = [r["reward_mean"] for r in rows]
        summary["reward_rise"] = statistics.fmean(rewards[-5:]) - statistics.fmean(rewards[:5])
    return rows + [summary]


def _scalar(value: Any) -> Any:
    """A metric as one number: a per-epoch list as its mean."""
    return sum(value) / len(value) if isinstance(value, list) and value else value


def _with_end_token(tokenizer: Any, token: int) -> Any:
    """The task's NullTokenizer with ``token`` as its end token (the recipe stops each response there)."""
    tokenizer.eod = token
    return tokenizer


def table(rows: list[dict[str, Any]]) -> str:
    """The summary rows' phase seconds as a markdown table (one column per summary row)."""
    summaries = [r for r in rows if r.get("kind") == "summary"]
    head = "| phase | " + " | ".join(f"{r['shape']}{' fp8' if r.get('rollout_fp8') else ''} ({r['device']})"
                                     for r in summaries) + " |"
    lines = [head, "|---|" + "---|" * len(summaries)]
    for phase in PHASES:
        lines.append(f"| {phase} s | " + " | ".join(f"{r.get(f'time/{phase}', float('nan')):.2f}"
                                                    for r in summaries) + " |")
    for key, label in (("throughput/generation_tokens_per_second", "generation tok/s"),
                       ("throughput/effective_tokens_per_second", "effective tok/s (trained / step time)"),
                       ("rollout/busy_fraction", "decode steps with ≥ half the slots busy"),
                       ("throughput/update_mfu", "update MFU"), ("response_length", "mean response tokens"),
                       ("switch/offload_gib", "offloaded GiB"), ("memory/update_peak_gib", "update peak GiB"),
                       ("memory/generation_peak_gib", "generation peak GiB")):
        lines.append(f"| {label} | " + " | ".join(f"{r[key]:.3g}" if key in r else "—" for r in summaries) + " |")
    for r in rows:
        if r.get("kind") == "generation":
            lines.append(f"\ngeneration in the loop {r['loop_tok_s']:.0f} tok/s, as bench/generate.py calls it "
                         f"{r['standalone_tok_s']:.0f} tok/s: {r['loop_over_standalone']:.1%} ({r['shape']}, "
                         f"{r['prompts']} prompts, {r['loop_slots']} vs {r['standalone_slots']} slots)")
        elif r.get("kind") == "summary" and "reward_rise" in r:
            lines.append(f"\nreward rise (last 5 steps minus first 5): {r['reward_rise']:+.3f} ({r['command']})")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=64, help="prompts per step")
    parser.add_argument("--num-samples-per-prompt", type=int, default=4)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(128, 1024))
    parser.add_argument("--max-new-tokens", type=int, default=4096)
    parser.add_argument("--stop-sets", type=int, default=0, metavar="K",
                        help="stop-token sets drawn per request (issue 46's ragged workload): each prompt a data row "
                        "with its own stop_token_ids, k - 1 random tokens besides the end token, k log-uniform in "
                        "[1, K]; responses then end after about vocabulary / k tokens (0: the end token alone)")
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=8192)
    parser.add_argument("--inference-max-requests", type=int, default=256)
    parser.add_argument("--offload-optimizer", choices=["auto", "always", "never"], default="auto")
    parser.add_argument("--rollout-fp8", action="store_true", help="FP8 rollout weights (--rollout-fp8)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-6,
                        help="the actor's learning rate (default 1e-6, verl's actor default; the recipe's own 3e-3 "
                             "suits tiny CPU models: on the 1.5B shape it drove the stop token out within two steps, "
                             "every response then ran to --max-new-tokens)")
    parser.add_argument("--compare-generation", type=int, default=0, metavar="RUNS",
                        help="after the measured steps: RUNS generate calls through the loop against RUNS as "
                             "bench/generate.py makes them, same weights and prompts (a 'generation' row)")
    parser.add_argument("--card-gib", type=float, default=None, metavar="GIB",
                        help="run as on a card of GIB GiB: the rest of a larger card is mapped first, outside "
                             "PyTorch (79.2 = an H100 80 GB's memory, on an H200)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and batch on whatever device there is")
    parser.add_argument("--out", default=None, help="JSON list the rows are appended to")
    parser.add_argument("--table", default=None, metavar="JSON", help="print a results file's table and exit")
    parser.add_argument("recipe_args", nargs="*", help="after --: more flags for the recipe")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.load(open(args.table))))
        return
    if args.smoke:
        args.shape, args.vocab_size, args.prompts, args.prompt_range = "cpu-tiny", 64, 2, (4, 12)
        args.max_new_tokens, args.max_tokens_per_micro_batch, args.warmup, args.steps = 24, 64, 1, 2
        args.inference_max_requests = 8
    write = rows_writer(args.out)  # the file's earlier rows, then this run's so far
    ballast = _ballast(args.card_gib)  # held until the process ends
    rows = run(args, on_step=write)
    del ballast
    write(rows)
    print(table(rows))


if __name__ == "__main__":
    main()
