"""Top-p sampling on one GPU: the race-by-rejection kernel (``topp_kernel.top_p_race``) at several launch settings
against the sort-based PyTorch path of ``sampling.sample``, per batch and vocabulary; checks that every setting
draws the same tokens as the default one.

    python3 bench/topp.py --out /tmp/topp.json                       # B 32 128, V 32000 152064
    python3 bench/topp.py --batch 32 --vocab 32000 --out /tmp/t.json --runs 50
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_hybrid.inference import topp_kernel  # noqa: E402


def _time(fn, runs: int) -> float:
    """Median milliseconds of ``fn()`` replayed from a CUDA graph (as a decode step runs it)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 152064])
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    settings = list(itertools.product([4, 8, 16], [1024, 2048, 4096]))
    for B, V in itertools.product(args.batch, args.vocab):
        g = torch.Generator(device="cuda").manual_seed(0)
        logits = torch.randn(B, V, device="cuda", generator=g)  # near-uniform: the widest nucleus
        noise = torch.empty(B, V, device="cuda").exponential_(generator=g)
        defaults = (topp_kernel._NUM_WARPS, topp_kernel._BLOCK)
        want = topp_kernel.top_p_race(logits, noise, vocab_size=V, temperature=1.0, top_p=args.top_p)

        def sort_path():
            x = logits
            sorted_x, order = x.sort(dim=-1, descending=True)
            probs = sorted_x.softmax(dim=-1)
            sorted_x = sorted_x.masked_fill(probs.cumsum(dim=-1) - probs > args.top_p, float("-inf"))
            x = torch.empty_like(x).scatter_(-1, order, sorted_x)
            return (x.softmax(dim=-1) / noise).argmax(dim=-1)

        rows.append({"B": B, "V": V, "method": "sort", "ms": _time(sort_path, args.runs)})
        print(json.dumps(rows[-1]), flush=True)
        for warps, block in settings:
            topp_kernel._NUM_WARPS, topp_kernel._BLOCK = warps, block
            try:
                fn = lambda: topp_kernel.top_p_race(logits, noise, vocab_size=V, temperature=1.0,  # noqa: E731
                                                    top_p=args.top_p)
                same = bool(torch.equal(fn(), want))
                rows.append({"B": B, "V": V, "method": "kernel", "num_warps": warps, "block": block,
                             "ms": _time(fn, args.runs), "same_tokens": same})
            except Exception as exc:  # a setting that does not compile (registers) is reported, not fatal
                rows.append({"B": B, "V": V, "method": "kernel", "num_warps": warps, "block": block,
                             "error": repr(exc)[:200]})
            print(json.dumps(rows[-1]), flush=True)
        topp_kernel._NUM_WARPS, topp_kernel._BLOCK = defaults
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
