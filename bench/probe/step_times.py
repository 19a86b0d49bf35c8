"""Where one generate call's time goes on one GPU: per step kind (decode, mixed, prefill; by batch bucket), the
device time of its graph replays (CUDA events around each), the device's gaps between replays, the host's waits for
tokens; then every captured graph replayed alone, so a decode step's cost per batch bucket is measured directly.

The workloads are ``bench/generate.py``'s (same prompts, seeds and stop sets): ``top_p`` (B prompts of 128 tokens,
128 new ones) and ``mixed`` (4·B prompts of 32-224 tokens, at most 256 new ones, a stop set of 1/160 of the
vocabulary).

    python3 bench/probe/step_times.py --out /tmp/step_times.json
    python3 bench/probe/step_times.py --out /tmp/s.json --batch 128 --variants mixed
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import prompts_of  # noqa: E402
from one_gpu import engine_on_one_gpu  # noqa: E402


class Recorder:
    """CUDA events around every graph replay and eager prefill, and the host's waits on step events."""

    def __init__(self) -> None:
        self.on = False
        self.steps: list[tuple[tuple, torch.cuda.Event, torch.cuda.Event, float]] = []
        self.waits: list[float] = []
        self.host: dict[str, list[float]] = {}  # host seconds inside each wrapped call, by kind

    def wrap(self, kind_of, fn):
        def wrapped(*a, **k):
            if not self.on:
                return fn(*a, **k)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            kind = kind_of(*a)
            t = time.perf_counter()
            start.record()
            out = fn(*a, **k)
            end.record()
            self.steps.append((kind, start, end, t))
            self.host.setdefault(kind[0], []).append(time.perf_counter() - t)
            return out
        return wrapped

    def host_only(self, name, fn):
        def wrapped(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            if self.on:
                self.host.setdefault(name, []).append(time.perf_counter() - t)
            return out
        return wrapped

    def summary(self, wall: float) -> dict:
        torch.cuda.synchronize()
        kinds: dict = collections.defaultdict(list)
        gaps, launch_gaps = [], []
        around: dict = collections.defaultdict(lambda: [0, 0.0])  # gaps over 0.05 ms by (kind before, after)
        for i, (kind, start, end, t) in enumerate(self.steps):
            kinds[kind].append(start.elapsed_time(end))
            if i:
                gaps.append(self.steps[i - 1][2].elapsed_time(start))
                launch_gaps.append((t - self.steps[i - 1][3]) * 1e3)
                if gaps[-1] > 0.05:
                    entry = around[f"{self.steps[i - 1][0][0]} -> {kind[0]}"]
                    entry[0] += 1
                    entry[1] += gaps[-1]
        busy = sum(sum(v) for v in kinds.values())
        span = self.steps[0][1].elapsed_time(self.steps[-1][2]) if self.steps else 0.0
        by_kind = {" ".join(map(str, k)): {"count": len(v), "total_ms": sum(v), "mean_ms": statistics.mean(v)}
                   for k, v in sorted(kinds.items())}
        return {"wall_ms": wall * 1e3, "device_span_ms": span, "replay_ms": busy, "gap_ms": sum(gaps),
                "gaps_over_0.05ms": sum(g > 0.05 for g in gaps), "gap_ms_of_those": sum(g for g in gaps if g > 0.05),
                "host_launch_interval_ms_median": statistics.median(launch_gaps) if launch_gaps else 0.0,
                "host_wait_ms": sum(self.waits) * 1e3, "host_waits": len(self.waits),
                "gaps_by_neighbours": {k: {"count": v[0], "ms": v[1]} for k, v in around.items()},
                "host_ms_in_calls": {k: {"count": len(v), "mean_ms": 1e3 * statistics.mean(v)}
                                     for k, v in self.host.items()}, "by_kind": by_kind}


def replay_alone(runner, repeats: int = 20) -> dict:
    """Every captured decode graph replayed ``repeats`` times back to back, each slot at position 200: device ms
    per replay. (Prefill and mixed graphs read staged inputs that the last call left in another layout.)"""
    out = {}
    graphs = runner.graphs
    runner.slot_positions.fill_(200)
    with torch.no_grad(), runner.cache.backed(), graphs.backed(), runner.noise.backed():
        for key in [key for key in graphs.keys() if key[0] == "decode"]:
            graph = graphs._graphs[key][0]
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            out[" ".join(map(str, key[:3]))] = start.elapsed_time(end) / repeats
        decode = [key for key in graphs.keys() if key[0] == "decode"]
        for key in {decode[0], decode[len(decode) // 2], decode[-1]} if decode else ():
            profile_replays(graphs._graphs[key][0], " ".join(map(str, key[:3])))
    return out


def profile_replays(graph, title: str, repeats: int = 10) -> None:
    """The kernels of ``repeats`` replays of ``graph``, by device time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            graph.replay()
        torch.cuda.synchronize()
    print(f"== kernels of {repeats} replays of {title}", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--variants", nargs="+", default=["top_p", "mixed"], choices=["top_p", "mixed"])
    args = ap.parse_args()
    with engine_on_one_gpu() as (arch, engine):
        probe(arch, engine, args)


def probe(arch, engine, args) -> None:
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid.inference import GenerationConfig, RolloutGenerator
    from megatron_hybrid.inference.graphs import StepGraphs
    from megatron_hybrid.inference.host_syncs import synchronizing_calls
    from megatron_hybrid.inference.replica import ReplicaGenerator
    from megatron_hybrid.inference.runner import StageRunner
    from megatron_hybrid.inference.stage_buffers import StageBuffers

    rec = Recorder()
    StepGraphs.run = rec.wrap(lambda self, key, step: key[:3], StepGraphs.run)
    for name in ("_mixed", "_decode", "_prefill"):
        setattr(StageRunner, name, rec.host_only(name, getattr(StageRunner, name)))
    for label, name in (("stage_mixed", "stage_mixed"), ("_start", "start"), ("_advance", "advance")):
        setattr(StageBuffers, name, rec.host_only(label, getattr(StageBuffers, name)))
    ReplicaGenerator._in_flight = rec.host_only("_in_flight", ReplicaGenerator._in_flight)
    StageBuffers.move_slots = rec.wrap(lambda self, *a: ("compact",), StageBuffers.move_slots)
    StageRunner._eager_prefill = rec.wrap(lambda self, prompts, *a: ("eager_prefill", len(prompts)),
                                          StageRunner._eager_prefill)
    sync = torch.cuda.Event.synchronize

    def timed_sync(event):
        t = time.perf_counter()
        sync(event)
        if rec.on:
            rec.waits.append(time.perf_counter() - t)

    torch.cuda.Event.synchronize = timed_sync
    P, N, vocab = 128, 128, arch.vocab_size
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(1)).tolist()
    result = {}
    for B in args.batch:
        gen = RolloutGenerator(engine, GenerationConfig(max_batch_size=B, max_sequence_length=7 * P // 4 + 2 * N))
        workloads = {"top_p": (prompts_of(B, P, P, vocab, 10), N, []),
                     "mixed": (prompts_of(4 * B, P // 4, 7 * P // 4, vocab, 11), 2 * N, order[: vocab // 160])}
        for name in args.variants:
            prompts, cap, stops = workloads[name]
            params = SamplingParams(temperature=1.0, top_p=0.9, num_tokens_to_generate=cap)

            def run():
                return gen.generate(prompts, params, vocab_size=vocab, stop_token_ids=stops, seed=5)

            run()  # captures
            rec.steps.clear()
            rec.waits.clear()
            rec.host.clear()
            torch.cuda.synchronize()
            rec.on = True
            t = time.perf_counter()
            out = run()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
            rec.on = False
            tokens = sum(len(r.generated_tokens) for r in out)
            entry = dict(rec.summary(wall), tokens=tokens, tok_s=tokens / wall,
                         synchronizing_calls=dict(synchronizing_calls(run)[1]))
            result[f"B={B} {name}"] = entry
            print(json.dumps({f"B={B} {name}": entry}), flush=True)
        result[f"B={B} replay_alone_ms"] = replay_alone(gen.replica.runner)
        print(json.dumps({f"B={B} replay_alone_ms": result[f"B={B} replay_alone_ms"]}), flush=True)
        gen.close()
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
