"""How many rejection rounds the top-p kernel's rows take in a real generation (one GPU): every graph replay's
logits and draws are read back, the rejection is simulated in PyTorch, and rows with non-finite logits are counted.

    python3 bench/probe/topp_rounds.py --out /tmp/topp_rounds.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from one_gpu import engine_on_one_gpu  # noqa: E402


def rounds(logits_nV: torch.Tensor, noise_nV: torch.Tensor, top_p: float, cap: int = 64) -> torch.Tensor:
    """Per row, the kernel's rejection rounds (cap + 1: not accepted within ``cap``)."""
    x = logits_nV.float()
    e = torch.exp(x - x.amax(-1, keepdim=True))
    total = e.sum(-1)
    race = e / noise_nV.clamp(min=torch.finfo(torch.float32).tiny)
    candidates = torch.ones_like(x, dtype=torch.bool)
    out = torch.full((x.shape[0],), cap + 1, dtype=torch.long, device=x.device)
    done = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    for r in range(1, cap + 1):
        winner = torch.where(candidates, race, -1.0).argmax(-1, keepdim=True)
        wx = x.gather(-1, winner)
        above = torch.where(x > wx, e, 0.0).sum(-1)
        accept = (above <= top_p * total) & ~done
        out[accept] = r
        done |= accept
        if bool(done.all()):
            break
        candidates &= x > wx
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with engine_on_one_gpu() as (arch, engine):
        probe(arch, engine, args.out)


def probe(arch, engine, out: str) -> None:
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid.inference import GenerationConfig, RolloutGenerator
    from megatron_hybrid.inference.runner import StageRunner
    from megatron_hybrid.inference.sampling import is_greedy

    stats: dict = {}
    original = StageRunner._replay

    def record(self, kind, logits, noise, params):
        sampled = logits.shape[0]
        bad = ~torch.isfinite(logits.float()).all(-1)
        entry = stats.setdefault(kind, collections.Counter())
        entry["steps"] += 1
        entry["rows"] += sampled
        entry["nonfinite_rows"] += int(bad.sum())
        if bad.any() and len(stats.setdefault("bad", [])) < 6:
            rows = bad.nonzero().flatten().tolist()
            stats["bad"].append({"kind": kind, "step": entry["steps"], "rows": rows[:8],
                                 "positions": self.slot_positions[rows[:8]].tolist(),
                                 "tokens": self.slot_tokens[rows[:8]].tolist()})
        if not is_greedy(params):
            r = rounds(logits, noise, float(params.top_p))
            for k, v in zip(*torch.unique(r, return_counts=True)):
                entry[f"rounds_{int(k)}"] += int(v)
            entry["steps_max_rounds_over_6"] += int(r.max() > 6)

    def replay(self, key):
        out = original(self, key)
        kind, _, _, sig = key
        params, vocab, _ = self._signatures[sig]
        logits = self.graphs._graphs[key][1][0][:, :vocab]
        record(self, kind, logits, None if is_greedy(params) else self._noise(logits.shape[0], vocab), params)
        return out

    StageRunner._replay = replay
    result = {}
    top_p = SamplingParams(temperature=1.0, top_p=0.9, num_tokens_to_generate=128)
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=128)
    # The bench's order: a generator at batch 32, closed, then one at 128 (before the fix in StepGraphs.close(),
    # the second one's KV cache had rows overwritten by the first one's dangling cuBLAS workspace).
    variants = [("B=32 top_p", 32, top_p, {}), ("B=128 top_p", 128, top_p, {}), ("B=128 greedy", 128, greedy, {}),
                ("B=128 top_p private pool", 128, top_p, {"graph_pool_gib": 0.0})]
    for name, B, params, extra in variants:
        stats.clear()
        gen = RolloutGenerator(engine, GenerationConfig(max_batch_size=B, max_sequence_length=512, **extra))
        g = torch.Generator().manual_seed(10)
        prompts = [torch.randint(0, arch.vocab_size, (128,), generator=g).tolist() for _ in range(B)]
        gen.generate(prompts, params, vocab_size=arch.vocab_size, seed=5)
        result[name] = {k: (dict(v) if isinstance(v, collections.Counter) else v) for k, v in stats.items()}
        print(json.dumps({name: result[name]}), flush=True)
        gen.close()
    Path(out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
