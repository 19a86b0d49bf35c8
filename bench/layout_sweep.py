"""Sweep the layout space: thousands of drawn examples through the HybridEngine on CPU, each against the unsharded
model, the failures shrunk to the simplest example that still fails.

Every example (:class:`megatron_hybrid.testing.layout_space.LayoutExample`: world 2–8, a training and a rollout
layout, a tiny architecture, a weight mode, an optimizer) runs through
:func:`megatron_hybrid.testing.layout_check.check_many`: rollout weights bit for bit against the unsharded model's
rollout shard (FP8 against an independent quantization), logits within tolerance, bytes received = needed − held
on every rank, a repeated switch calling no collective, before and after an optimizer step. The examples are drawn
by ``hypothesis`` from ``--seed`` (the same seed, the same examples) and run grouped by world size and training
layout. Writes a JSON object: the command, the counts (examples tried, by world size, mode, optimizer, experts,
exchange or not), the seconds, and every failing example with its failures and its shrunk form.

Examples:

    # the committed sweep (about 80 minutes on 2 cores)
    python bench/layout_sweep.py --examples 2000 --out bench/results/layout_sweep_cpu.json
    # a quick look at MoE only, 50 examples of another seed
    python bench/layout_sweep.py --examples 50 --experts only --seed 7 --out /tmp/sweep_moe.json
    # the same 2000 examples in 24 parts (run anywhere, in parallel), then one results file from the parts
    for k in $(seq 0 23); do python bench/layout_sweep.py --shard $k/24 --out /tmp/part$k.json & done; wait
    python bench/layout_sweep.py --merge /tmp/part*.json --out bench/results/layout_sweep_cpu.json
    # rerun one printed failing example
    python bench/layout_sweep.py --rerun "LayoutExample(**{'world': 8, 't': 2, 'p': 2, 't_g': 4, 'p_g': 1})"
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__[__doc__.index("Examples:"):],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=2000, help="how many distinct examples to draw (default 2000)")
    ap.add_argument("--seed", type=int, default=34, help="the hypothesis seed the examples are drawn from")
    ap.add_argument("--experts", choices=("both", "only", "none"), default="both",
                    help="MoE examples too (both, the default), only MoE, or only dense models")
    ap.add_argument("--max-world", type=int, default=8, help="the largest world size drawn (from 2; default 8)")
    ap.add_argument("--shrink-budget", type=int, default=40, help="checks spent shrinking each failing example")
    ap.add_argument("--out", type=Path, default=None, help="the results JSON (default: print only)")
    ap.add_argument("--shard", default=None, metavar="K/N",
                    help="check only examples K, K+N, K+2N, ... of the drawn ones (parts to run in parallel)")
    ap.add_argument("--merge", nargs="+", type=Path, default=None, metavar="PART",
                    help="combine the results files of all N parts of one sweep into --out, and exit")
    ap.add_argument("--rerun", default=None, help="check one example given as its printed line and exit")
    args = ap.parse_args(argv)
    if args.examples < 1:
        ap.error(f"--examples must be at least 1 (got {args.examples})")
    if not 2 <= args.max_world <= 8:
        ap.error(f"--max-world must be between 2 and 8 (got {args.max_world})")
    if args.shard is not None:
        k, _, n = args.shard.partition("/")
        if not (k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)):
            ap.error(f"--shard must be K/N with 0 <= K < N (got {args.shard!r})")
        args.shard = (int(k), int(n))
    return args


def _merge(parts: list[Path]) -> dict:
    """One results object from the files of every part of one sweep (same seed, examples and part count)."""
    loaded = [json.loads(p.read_text()) for p in parts]
    first = loaded[0]
    key = lambda r: (r["seed"], r["examples_drawn"], r["experts"], r["max_world"], r["shard"][1])  # noqa: E731
    if any(key(r) != key(first) for r in loaded) or sorted(r["shard"][0] for r in loaded) != list(
            range(first["shard"][1])):
        raise ValueError(f"--merge needs every part of one sweep once (got {[str(p) for p in parts]})")

    def add(a: dict, b: dict) -> dict:
        out = dict(a)
        for k, v in b.items():
            out[k] = add(out.get(k, {}), v) if isinstance(v, dict) else out.get(k, 0) + v
        return out

    counts: dict = {}
    for r in loaded:
        counts = add(counts, r["counts"])
    return {"command": " && ".join(r["command"] for r in loaded[:1]) + f" (and the other {len(loaded) - 1} parts)",
            "parts": [r["command"] for r in loaded], "seed": first["seed"], "experts": first["experts"],
            "max_world": first["max_world"], "examples_drawn": first["examples_drawn"],
            "examples_tried": sum(r["examples_tried"] for r in loaded),
            "failures": sum(r["failures"] for r in loaded),
            "seconds": round(sum(r["seconds"] for r in loaded), 1),
            "seconds_longest_part": max(r["seconds"] for r in loaded), "versions": first["versions"],
            "counts": counts, "failing_examples": [f for r in loaded for f in r["failing_examples"]]}


def _write(out: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    tmp.replace(path)  # never a half-written results file


def _counts(examples, results) -> dict:
    def by(field) -> dict:
        return dict(sorted(collections.Counter(str(field(ex)) for ex in examples).items()))

    return {"world": by(lambda ex: ex.world), "mode": by(lambda ex: ex.mode), "optimizer": by(lambda ex: ex.optimizer),
            "experts": by(lambda ex: ex.num_experts is not None), "exchange": by(lambda ex: ex.exchange),
            "virtual_chunks": by(lambda ex: ex.vpp is not None), "failed": sum(1 for r in results if r)}


def main(argv=None) -> int:
    from tqdm import tqdm

    from megatron_hybrid.testing import layout_check
    from megatron_hybrid.testing.layout_space import LayoutExample, draw, shrink

    args = parse_args(argv)
    if args.merge is not None:
        out = _merge(args.merge)
        print(json.dumps({k: v for k, v in out.items() if k not in ("failing_examples", "parts")}, indent=1))
        if args.out is not None:
            _write(out, args.out)
        return 1 if out["failures"] else 0
    if args.rerun is not None:
        ex = eval(args.rerun, {"LayoutExample": LayoutExample})  # our own repro line, typed by the user
        failures = layout_check.check(ex)
        print("\n".join(failures) if failures else f"{ex}: exact")
        return 1 if failures else 0
    experts = {"both": None, "only": True, "none": False}[args.experts]
    start = time.perf_counter()
    examples = draw(args.examples, seed=args.seed, experts=experts, max_world=args.max_world)
    shard = args.shard or (0, 1)
    examples = examples[shard[0]::shard[1]]
    with tqdm(total=len(examples), desc="layout examples", unit="ex") as bar:
        results = layout_check.check_many(examples, progress=bar.update)
    failing = []
    for ex, failures in zip(examples, results):
        if failures:
            tqdm.write(f"FAIL {ex}\n    " + "\n    ".join(failures[:4]))
            shrunk = shrink(ex, lambda e: bool(layout_check.check(e)), budget=args.shrink_budget)
            failing.append({"example": str(ex), "failures": failures[:20], "shrunk": str(shrunk),
                            "shrunk_failures": layout_check.check(shrunk)[:20]})
    out = {"command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
           "seed": args.seed, "experts": args.experts, "max_world": args.max_world, "examples_drawn": args.examples,
           "shard": list(shard), "examples_tried": len(examples), "failures": len(failing),
           "seconds": round(time.perf_counter() - start, 1), "counts": _counts(examples, results),
           "versions": _versions(), "failing_examples": failing}
    print(json.dumps({k: v for k, v in out.items() if k != "failing_examples"}, indent=1))
    if args.out is not None:
        _write(out, args.out)
    return 1 if failing else 0


def _versions() -> dict:
    import platform

    import hypothesis
    import megatron.core
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__,
            "megatron-core": megatron.core.__version__, "hypothesis": hypothesis.__version__,
            "cpus": os.cpu_count()}


if __name__ == "__main__":
    sys.exit(main())
