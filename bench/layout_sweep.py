"""Sweep the layout space in one process: examples drawn like the property test's, each through the engine's
validation and, if accepted, the simulated world (issue 48).

    python bench/layout_sweep.py --examples 2000 --seed 1 --output sweep.jsonl     # resumable: run it again
    python bench/layout_sweep.py --summary sweep.jsonl                             # the tallies of a file
    python bench/layout_sweep.py --replay 17 --seed 1                              # one example, its faults shown
    python bench/layout_sweep.py --replay 17 --seed 1 --ranks                      # ... and on real gloo ranks
    python bench/layout_sweep.py --output sweep.jsonl --ranks-sample 20           # 20 of its examples on ranks
    python bench/layout_sweep.py --moe --examples 2000 --seed 1 --output moe.jsonl # MoE models and expert layouts

Example i of seed S is drawn by ``random.Random(f"{S}:{i}")`` through
:func:`megatron_hybrid.simulate.draw_example` (a world of 2-16 ranks, free training and rollout layouts, the
architecture options, aliased or canonical weights, 0 or 1 optimizer steps), so a file can be extended later and
any line replayed alone. Each line of ``--output`` (JSON) holds the example, its status (``refused`` with the
engine's reason, ``ok``, or ``fault`` with what differs), the bytes each rank received and the seconds; lines
already in the file are skipped. The summary counts each status, the refused share and each refusal rule.

``--ranks`` ties the simulation to the real engine: the replayed example also runs on t·p·d gloo ranks
(megatron-core models, :class:`~megatron_hybrid.HybridEngine`, a switch before and after an optimizer step, as
``tests/test_engine.py`` runs it), loaded with the simulation's unsharded model; the engine's rollout model, made
whole again, must equal that model bit for bit, and each rank's bytes of the first switch the simulation's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import sys
import time
from typing import Any, Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_hybrid.simulate import draw_example, run_example  # noqa: E402


def example_at(seed: int, index: int, moe: bool = False):
    """Example ``index`` of ``seed`` (an MoE one of its own stream with ``moe``)."""
    rng = random.Random(f"moe:{seed}:{index}" if moe else f"{seed}:{index}")
    return draw_example(lambda label, options: rng.choice(list(options)), moe=moe)


def build_stage(arch: Any, config: Any, chunks: int) -> list:
    """This rank's model chunks of ``arch`` (megatron-core's parallel state set): chunk v of this stage with
    virtual pipeline chunks, as Megatron-LM builds them, else the stage."""
    from megatron.core import parallel_state as ps

    if chunks > 1:
        return [arch.build(config, pre_process=ps.is_pipeline_first_stage(ignore_virtual=True) and v == 0,
                           post_process=ps.is_pipeline_last_stage(ignore_virtual=True) and v == chunks - 1,
                           vp_stage=v) for v in range(chunks)]
    return [arch.build(config, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())]


def two_switches(engine: Any, model: list, steps: int, observe: Callable[[], dict],
                 also_step: Optional[dict] = None) -> list[dict]:
    """Two switches of ``engine`` to rollout and back, the training weights of ``model`` (and the tensors of
    ``also_step``) updated element-wise between them when ``steps``; after each switch its bytes and ``observe()``."""
    import torch

    from megatron_hybrid.simulate import elementwise_step

    out = []
    for n in range(2):
        if n and steps:
            with torch.no_grad():
                for prm in (q for chunk in model for q in chunk.parameters()):
                    elementwise_step("", prm.data)
                for tensor in (also_step or {}).values():
                    elementwise_step("", tensor)
        engine.switch_to_rollout()
        out.append({"bytes": engine.communication_report()["total_bytes"], **observe()})
        engine.switch_to_training()
    return out


def moe_rank_switches(arch: dict, rollout: list[int], mode: str, state: dict, steps: int, chunks: int = 1) -> dict:
    """:func:`rank_switches` for an MoE model (run_distributed with its expert sizes): this rank's shards of
    ``state`` loaded (routed experts by global index over expert TP), a HybridEngine, two switches with the
    element-wise update between them when ``steps``; after each, the rollout tensors of this rank that differ in
    any bit from its rollout shard of the state (dense over rollout TP, experts over rollout expert TP)."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.megatron.models import GPTArchitecture
    from tests.moe_engine_cases import _load, _rollout_mismatches

    state = {name: tensor.clone() for name, tensor in state.items()}  # the ranks' copies share memory: stepped here
    a = GPTArchitecture.from_dict(arch)
    config = a.transformer_config(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None)
    model = build_stage(a, config, chunks)
    for chunk in model:
        _load(chunk, state)
    engine = HybridEngine(model if chunks > 1 else model[0], RolloutLayout(*rollout), weight_mode=mode,
                          bucket_size_mb=0.001)
    return {"switches": two_switches(engine, model, steps, lambda: {"mismatches": _rollout_mismatches(engine, state)},
                                     also_step=state)}


def rank_switches(arch: dict, rollout_tp: int, rollout_pp: int, mode: str, state: dict, steps: int,
                  chunks: int = 1) -> dict:
    """On one gloo rank (run_distributed): the model megatron-core builds for ``arch`` loaded with this rank's
    shards of ``state``, a HybridEngine, a switch, the training weights updated element-wise (when ``steps``), a
    second switch; the rollout model made whole after each, and the bytes each switch moved."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.megatron.models import GPTArchitecture
    from megatron_hybrid.megatron.sharding import load_full_state_dict
    from tests.engine_cases import rollout_full_weights

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    a = GPTArchitecture.from_dict(arch)
    config = a.transformer_config(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None)
    model = build_stage(a, config, chunks)
    load_full_state_dict(model, state, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp)
    engine = HybridEngine(model if chunks > 1 else model[0], RolloutLayout(rollout_tp, rollout_pp), weight_mode=mode,
                          bucket_size_mb=0.001)
    return {"switches": two_switches(engine, model, steps, lambda: {"weights": rollout_full_weights(engine)})}


def on_ranks(example, outcome: dict[str, Any]) -> dict[str, Any]:
    """The example on t·p·d real gloo ranks (:func:`rank_switches`) against the simulation: the rollout model
    after each switch equal to the unsharded model bit for bit (the updated one after the second), and each
    rank's bytes of the last switch the simulation's."""
    import torch

    from megatron_hybrid.simulate import elementwise_step, gpt_parameters, unsharded_model
    from tests.harness import run_distributed

    t, p, d = example.training
    state = unsharded_model(gpt_parameters(example.arch, vocab_size=example.arch.padded_vocab_size(t)))
    if example.expert_parallel is not None:
        return _moe_on_ranks(example, outcome, state)
    if not example.arch.untie_embeddings_and_output_weights:
        state.pop("output_layer.weight")  # megatron-core's tied output layer copies the embedding at build
    results = run_distributed(rank_switches, t * p * d, example.arch.to_dict(), *example.rollout,
                              example.weight_mode, state, example.steps, example.chunks,
                              tensor_model_parallel_size=t, pipeline_model_parallel_size=p,
                              virtual_pipeline_model_parallel_size=example.chunks if example.chunks > 1 else None)
    differ = []
    for n, switch in enumerate(results[0]["switches"]):
        if n and example.steps:
            with torch.no_grad():
                for name, tensor in state.items():
                    elementwise_step(name, tensor)
        got = switch["weights"]
        differ += [f"switch {n + 1}: {name}" for name in state if name not in got or not torch.equal(got[name],
                                                                                                      state[name])]
    engine_bytes = [r["switches"][-1]["bytes"] for r in results]
    return {"agree": not differ and engine_bytes == outcome["bytes_received"], "weights_differ": differ[:20],
            "engine_bytes": engine_bytes, "simulated_bytes": outcome["bytes_received"]}


def _moe_on_ranks(example, outcome: dict[str, Any], state: dict) -> dict[str, Any]:
    """:func:`on_ranks` for an MoE example (:func:`moe_rank_switches`): every rank's rollout tensors bit for bit
    after each switch, and each rank's bytes of the last switch the simulation's."""
    from megatron_hybrid.simulate import EMBEDDING, OUTPUT
    from tests.harness import run_distributed

    t, p, d = example.training
    e, et = example.expert_parallel
    if not example.arch.untie_embeddings_and_output_weights:
        state[OUTPUT] = state[EMBEDDING].clone()  # megatron-core keeps the tied copy equal
    results = run_distributed(moe_rank_switches, t * p * d, example.arch.to_dict(), list(example.rollout),
                              example.weight_mode, state, example.steps, example.chunks,
                              tensor_model_parallel_size=t, pipeline_model_parallel_size=p,
                              virtual_pipeline_model_parallel_size=example.chunks if example.chunks > 1 else None,
                              expert_model_parallel_size=e, expert_tensor_parallel_size=et)
    differ = [f"rank {r}, switch {n + 1}: {name}" for r, res in enumerate(results)
              for n, switch in enumerate(res["switches"]) for name in switch["mismatches"]]
    engine_bytes = [r["switches"][-1]["bytes"] for r in results]
    return {"agree": not differ and engine_bytes == outcome["bytes_received"], "weights_differ": differ[:20],
            "engine_bytes": engine_bytes, "simulated_bytes": outcome["bytes_received"]}


def read(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tallies(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The counts of a results file: examples by status, refusals by rule, faults, replays on ranks."""
    examples = [r for r in rows if r.get("kind", "example") == "example"]
    replays = [r for r in rows if r.get("kind") == "ranks"]
    status = collections.Counter(r["status"] for r in examples)
    # One rule per message: its numbers and tuples of numbers (layout sizes) left out.
    rules = collections.Counter(re.sub(r"\(\d+(, \d+)*\)", "(n)", r["reason"]) for r in examples
                                if r["status"] == "refused")
    return {"examples": len(examples), "exact": status["ok"], "faults": status["fault"], "refused": status["refused"],
            "refused_share": round(status["refused"] / max(1, len(examples)), 4),
            "exact_exchange_layouts": sum(1 for r in examples if r["status"] == "ok" and r.get("exchange")),
            "seeds": sorted({r["seed"] for r in examples}), "refused_by_rule": dict(rules.most_common()),
            "failing_examples": [{k: r[k] for k in ("seed", "index", "example", "faults")}
                                 for r in examples if r["status"] == "fault"],
            "replayed_on_ranks": len(replays), "replays_agreeing": sum(1 for r in replays if r["agree"]),
            "replays_disagreeing": [{k: r[k] for k in ("seed", "index", "example")} for r in replays
                                    if not r["agree"]]}


def summary(rows: list[dict[str, Any]]) -> str:
    t = tallies(rows)
    lines = [f"{t['examples']} examples: {t['exact']} exact ({t['exact_exchange_layouts']} of them exchange "
             f"layouts), {t['faults']} faults, {t['refused']} refused ({t['refused_share']:.0%})"]
    lines += [f"  refused {count:5d}: {rule}" for rule, count in t["refused_by_rule"].items()]
    lines += [f"  FAULT example {r['index']} (seed {r['seed']}): {r['example']} {r['faults'][:3]}"
              for r in t["failing_examples"]]
    if t["replayed_on_ranks"]:
        lines.append(f"{t['replayed_on_ranks']} replayed on gloo ranks: {t['replays_agreeing']} agree with the "
                     "simulation (bytes and bits)")
        lines += [f"  DISAGREES: example {r['index']} (seed {r['seed']}): {r['example']}"
                  for r in t["replays_disagreeing"]]
    return "\n".join(lines)


def _progress(it, **kw):
    try:
        from tqdm import tqdm
    except ImportError:  # progress is a nicety
        return it
    return tqdm(it, **kw)


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Examples 0 .. N-1 of the seed not yet in the output, run and appended as they finish."""
    done = {(r["seed"], r["index"]) for r in read(args.output) if r.get("kind", "example") == "example"
            and r.get("moe", False) == args.moe} if args.output else set()
    rows = []
    out = open(args.output, "a") if args.output else None
    try:
        for index in _progress(range(args.examples), desc="layout sweep"):
            if (args.seed, index) in done:
                continue
            example = example_at(args.seed, index, args.moe)
            t0 = time.perf_counter()
            row = {"kind": "example", "seed": args.seed, "index": index, **({"moe": True} if args.moe else {}),
                   "example": example.describe(),
                   **run_example(example), "seconds": round(time.perf_counter() - t0, 4)}
            rows.append(row)
            if out is not None:
                out.write(json.dumps(row) + "\n")
                out.flush()
    finally:
        if out is not None:
            out.close()
    return rows


def replay_sample(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--ranks-sample K``: K of the output's exact examples not yet replayed, on real gloo ranks (worlds of at
    most ``--max-ranks``; a deterministic spread: every kind of layout pair first), appended as ``ranks`` rows."""
    rows = read(args.output)
    replayed = {(r["seed"], r["index"], r.get("moe", False)) for r in rows if r.get("kind") == "ranks"}
    pool = [r for r in rows if r.get("kind", "example") == "example" and r["status"] == "ok"
            and (r["seed"], r["index"], r.get("moe", False)) not in replayed
            and r["example"]["training"][0] * r["example"]["training"][1] * r["example"]["training"][2]
            <= args.max_ranks]
    seen, picked = set(), []
    for r in pool:  # one of each (exchange, mode, steps, chunks, tied) first, then in file order
        kind = (r["exchange"], r["example"]["weight_mode"], r["example"]["steps"], r["example"].get("chunks", 1),
                r["example"]["arch"].get("untie_embeddings_and_output_weights", True), r.get("moe", False))
        if kind not in seen:
            seen.add(kind)
            picked.append(r)
    picked += [r for r in pool if r not in picked]
    new = []
    with open(args.output, "a") as out:
        for r in _progress(picked[: args.ranks_sample], desc="replays on gloo ranks"):
            example = example_at(r["seed"], r["index"], r.get("moe", False))
            assert example.describe() == r["example"], "the draw changed since the file was written"
            t0 = time.perf_counter()
            row = {"kind": "ranks", "seed": r["seed"], "index": r["index"],
                   **({"moe": True} if r.get("moe") else {}), "example": r["example"],
                   **on_ranks(example, r), "seconds": round(time.perf_counter() - t0, 2)}
            new.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
    return new


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=200, help="examples 0 .. N-1 of the seed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="JSON lines, appended to (resumable); its tallies go to "
                                                        "the same name with .json")
    parser.add_argument("--summary", default=None, metavar="JSONL", help="print a file's tallies and exit")
    parser.add_argument("--replay", type=int, default=None, metavar="INDEX", help="run one example and print it")
    parser.add_argument("--ranks", action="store_true", help="with --replay: also on real gloo ranks, compared")
    parser.add_argument("--ranks-sample", type=int, default=0, metavar="K",
                        help="replay K of --output's exact examples on real gloo ranks (no new examples)")
    parser.add_argument("--max-ranks", type=int, default=8, help="the largest world --ranks-sample replays")
    parser.add_argument("--moe", action="store_true",
                        help="MoE examples (routed experts, expert layouts; a stream of their own per seed)")
    args = parser.parse_args(argv)
    if args.examples < 0:
        raise ValueError(f"--examples ({args.examples}) must be ≥ 0")
    if args.ranks_sample < 0:
        raise ValueError(f"--ranks-sample ({args.ranks_sample}) must be ≥ 0")
    if args.summary:
        print(summary(read(args.summary)))
        return 0
    if args.ranks and args.replay is None:
        raise ValueError("--ranks replays one example: give --replay INDEX")
    if args.ranks_sample and not args.output:
        raise ValueError("--ranks-sample replays examples of a results file: give --output FILE")
    if args.replay is not None:
        example = example_at(args.seed, args.replay, args.moe)
        outcome = {"example": example.describe(), **run_example(example)}
        if args.ranks and outcome["status"] != "refused":
            outcome["ranks"] = on_ranks(example, outcome)
        print(json.dumps(outcome, indent=1))
        return 0 if outcome["status"] != "fault" and outcome.get("ranks", {}).get("agree", True) else 1
    new = replay_sample(args) if args.ranks_sample else sweep(args)
    rows = read(args.output) if args.output else new
    if args.output:
        base = args.output[: -len(".jsonl")] if args.output.endswith(".jsonl") else args.output
        commands = []  # every run that wrote the file, in order
        if os.path.exists(base + ".json"):
            with open(base + ".json") as f:
                commands = json.load(f).get("commands", [])
        commands.append("python " + " ".join(sys.argv))
        with open(base + ".json", "w") as f:
            json.dump({"commands": commands, **tallies(rows)}, f, indent=1)
    print(summary(rows))
    bad = any(r.get("status") == "fault" or r.get("agree") is False for r in new)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
