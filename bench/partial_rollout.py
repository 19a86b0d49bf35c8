"""Partial rollout against synchronous steps (issue 46, step 5): effective tokens/s and how busy the generator is.

    python bench/partial_rollout.py --out bench/results/partial_rollout_h100.json     # one GPU, the 1.5B shape
    python bench/partial_rollout.py --smoke                                           # a tiny model, any device
    python bench/partial_rollout.py --table bench/results/partial_rollout_h100.json   # the rows as a table

Two runs of the recipe's own Trainer through bench/rl_step.py (each in its own process: one model on the card at a
time), same seeds and workload: GRPO on the 1.5B-like shape, ``--prompts`` prompts of 32-512 random tokens a step,
4 samples each, at most 4,096 new tokens, ended by stop-token sets drawn per request (``--stop-sets`` K: each
prompt's own set of k tokens besides the end token, k log-uniform in [1, K], so a response ends after about
``--vocab-size`` / k tokens of the random model: most short, a long tail up to 4,096; 0: the end token alone,
geometric lengths); ``--warmup`` steps, then ``--steps`` measured. The first run is synchronous (a step waits
for its longest sample); then one run per ``--max-staleness`` K (1 by default) adds ``--partial-rollout
--max-staleness K --tis-imp-ratio-cap 2`` (a step trains once its quota of groups finished and the groups at their
staleness bound finished too; the rest resume in the next step), with
``--in-flight-factor`` (4) times the step's prompts in flight. Per run: effective tokens/s (the
response tokens trained per second of whole steps, the median over measured steps), the share of decode steps with
at least half the slots decoding, the generation and step seconds, the staleness of the trained tokens, and the
parked, resumed and dropped counts; then the ratio of the two effective rates. Rows (every measured step, a
summary per run, the ratio) go to ``--out`` with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.measure import rows_writer  # noqa: E402

PARTIAL = ["--partial-rollout", "--tis-imp-ratio-cap", "2"]
KEYS = (("throughput/effective_tokens_per_second", "effective tok/s", ".0f"),
        ("rollout/busy_fraction", "decode steps ≥ half the slots busy", ".2f"),
        ("time/generation", "generation s", ".1f"), ("time/step", "step s", ".1f"),
        ("throughput/generation_tokens_per_second", "generation tok/s", ".0f"),
        ("response_length", "mean trained response tokens", ".0f"),
        ("partial/resumed", "samples resumed", ".0f"), ("partial/parked", "groups parked", ".0f"),
        ("partial/due", "groups finished at their staleness bound", ".0f"),
        ("partial/dropped", "groups dropped", ".0f"))


def run(mode: str, args: argparse.Namespace, extra: list[str]) -> list[dict[str, Any]]:
    """One bench/rl_step.py run (``mode``: sync or partial); its rows, tagged with the mode."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, os.path.join(ROOT, "bench", "rl_step.py"), "--shape", args.shape,
               "--vocab-size", str(args.vocab_size), "--prompts", str(args.prompts), "--prompt-range",
               *map(str, args.prompt_range), "--max-new-tokens", str(args.max_new_tokens),
               "--stop-sets", str(args.stop_sets),
               "--max-tokens-per-micro-batch", str(args.max_tokens_per_micro_batch), "--inference-max-requests",
               str(args.inference_max_requests), "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--out", out, "--", *extra]
        print(" ".join(cmd), flush=True)
        proc = subprocess.run(cmd, cwd=ROOT)
        rows = json.load(open(out)) if os.path.exists(out) else []
        if proc.returncode and not rows:
            return [{"kind": "error", "mode": mode, "returncode": proc.returncode}]
        return [{**r, "mode": mode} for r in rows]


def table(rows: list[dict[str, Any]]) -> str:
    summaries = {r["mode"]: r for r in rows if r.get("kind") == "summary"}
    lines = ["| | " + " | ".join(summaries) + " |", "|---|" + "---|" * len(summaries)]
    for key, label, fmt in KEYS:
        lines.append(f"| {label} | " + " | ".join(format(s[key], fmt) if key in s else "—"
                                                  for s in summaries.values()) + " |")
    for ratio in [r for r in rows if r.get("kind") == "ratio"][-max(1, len(summaries) - 1):]:
        line = (f"\n{ratio.get('mode', 'partial')} / synchronous effective tokens/s: {ratio['effective_speedup']:.2f}x "
                "(medians of steps)")
        if ratio.get("effective_speedup_overall") is not None:
            line += f", {ratio['effective_speedup_overall']:.2f}x (trained tokens / seconds of all measured steps)"
        lines.append(line)
    return "\n".join(lines)


def overall(rows: list[dict[str, Any]], mode: str) -> Optional[float]:
    """The response tokens one run trained over all its measured steps / their seconds (a partial run's steps can
    alternate long and short, which a median of per-step rates hides)."""
    steps = [r for r in rows if r.get("kind") == "step" and r.get("mode") == mode]
    seconds = sum(r["time/step"] for r in steps)
    tokens = sum(r["throughput/effective_tokens_per_second"] * r["time/step"] for r in steps)
    return tokens / seconds if seconds else None


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=64, help="prompts per step (4 samples each)")
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--max-new-tokens", type=int, default=4096)
    parser.add_argument("--stop-sets", type=int, default=64, metavar="K",
                        help="stop-token sets drawn per request, k in [1, K] tokens (bench/rl_step.py --stop-sets)")
    parser.add_argument("--in-flight-factor", type=int, default=4,
                        help="the partial run's --partial-rollout-in-flight, in step's prompts (default 4)")
    parser.add_argument("--max-staleness", type=int, nargs="+", default=[1], metavar="K",
                        help="one partial run per K (--max-staleness K of the recipe; default 1)")
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=8192)
    parser.add_argument("--inference-max-requests", type=int, default=None,
                        help="cache slots (default: one step's samples, 4 x --prompts, so that 'half the slots busy' "
                             "means what it says at any --prompts)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="measured steps (warm-up + measured: 10 by default)")
    parser.add_argument("--modes", nargs="+", choices=["sync", "partial"], default=["sync", "partial"])
    parser.add_argument("--smoke", action="store_true", help="a tiny model and batch on whatever device there is")
    parser.add_argument("--out", default=None, help="JSON list the rows are appended to")
    parser.add_argument("--table", default=None, metavar="JSON", help="print a results file's table and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.load(open(args.table))))
        return
    if args.smoke:
        args.shape, args.vocab_size, args.prompts, args.prompt_range = "cpu-tiny", 16, 4, (4, 12)
        args.max_new_tokens, args.max_tokens_per_micro_batch, args.warmup, args.steps = 24, 256, 1, 2
        args.stop_sets = min(args.stop_sets, 4)
        args.inference_max_requests = 8
    if args.inference_max_requests is None:
        args.inference_max_requests = 4 * args.prompts
    write = rows_writer(args.out)  # the file's earlier rows, then this run's so far
    rows: list[dict[str, Any]] = []
    runs = [("sync", [])] if "sync" in args.modes else []
    if "partial" in args.modes:
        runs += [("partial" if len(args.max_staleness) == 1 else f"partial K={k}",
                  PARTIAL + ["--max-staleness", str(k), "--partial-rollout-in-flight",
                             str(args.in_flight_factor * args.prompts)]) for k in args.max_staleness]
    for mode, extra in runs:
        rows += run(mode, args, extra)
        write(rows)
    summaries = {r["mode"]: r for r in rows if r.get("kind") == "summary"}
    key = "throughput/effective_tokens_per_second"
    for (mode, _), k in zip(runs[1:] if "sync" in summaries else [], args.max_staleness):
        if mode not in summaries:
            continue
        sync, partial = overall(rows, "sync"), overall(rows, mode)
        rows.append({"kind": "ratio", "mode": mode, "max_staleness": k,
                     "effective_speedup": summaries[mode][key] / summaries["sync"][key],
                     "effective_speedup_overall": partial / sync if sync and partial else None,
                     "command": " ".join(sys.argv), "device": summaries["sync"]["device"]})
        write(rows)
    print(table(rows))


if __name__ == "__main__":
    main()
