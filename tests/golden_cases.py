"""Golden outputs: generation and recipe results recorded bit for bit, so a change that should not alter numerics
(issue 23's restructuring of the generator and the package) shows that it did not.

What is recorded (``tests/golden/generation.json``, ``tests/golden/recipe.json``; written by
``tests/golden/make_golden.py --write``, compared by ``tests/test_golden.py``):

- generation, at three training → rollout layouts on CPU gloo (:data:`GENERATION_LAYOUTS`), with
  ``GenerationConfig(mixed_prefill_tokens=64, compact_slots=True)`` and more prompts than decode slots: a greedy call
  and a seeded top-p call (with tempered log-probs), each with stop tokens that end some sequences early. Per
  training DP rank and call: the generated tokens, the log-probs (float32 values, compared as bit patterns) and the
  call's step counters (prefills, decode steps, mixed steps, slot moves), which show that refills rode along decode
  steps, that slots were compacted and that stop tokens fired;
- the recipe (``examples/ppo/train_ppo.py``'s ``main``, its defaults: the tiny model, TP=2 × DP=2 on 4 ranks,
  rollout TP=1) for :data:`RECIPE_STEPS` steps: every metric but the wall-clock ones.

Floats are stored as JSON numbers (Python writes the shortest repr that reads back as the same double) and
compared as ``float.hex`` strings, so -0.0, NaN and the last bit all count.
"""

from __future__ import annotations

import json
import math
import os
import platform
import runpy
from typing import Any, Optional

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN_DIR = os.path.join(HERE, "golden")


def cpu_signature() -> str:
    """The kind of CPU the bits depend on: ATen's vector ISA (its vectorised exp, log and reductions round
    differently per ISA) and the vendor (BLAS picks other kernels). The same code gave 1-ulp different log-probs on
    an AVX512 AMD machine than on the machine the first goldens were written on, and the recipe's cancellation-level
    metrics (a policy loss of 1e-8) and clip fractions then differ outright: goldens are per kind of CPU."""
    vendor = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            vendor = next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), vendor)
    except OSError:
        pass
    return f"{torch.backends.cpu.get_cpu_capability()}-{vendor}"


#: This kind of CPU's goldens (``tests/golden/<cpu_signature()>/``, written by ``make_golden.py --write`` on it), or
#: the first ones (``tests/golden/``, written in session 8 on the machine of that session).
CPU_GOLDEN_DIR = os.path.join(GOLDEN_DIR, cpu_signature())
_FILES_DIR = CPU_GOLDEN_DIR if os.path.isdir(CPU_GOLDEN_DIR) else GOLDEN_DIR
GENERATION_FILE = os.path.join(_FILES_DIR, "generation.json")
RECIPE_FILE = os.path.join(_FILES_DIR, "recipe.json")
RECIPE = os.path.join(os.path.dirname(HERE), "examples", "ppo", "train_ppo.py")

VOCAB = 250  # tiny_llama's real vocabulary (256 padded rows at every TP size)
NEW_TOKENS = 16
MAX_LEN = 96  # positions per slot: the longest prompt (60) plus 16 new tokens fit
MIXED_PREFILL_TOKENS = 64  # a refill of one prompt (1-60 tokens) rides along a decode step; two long ones do not
#: Greedy stop tokens: between them they end 4 of the 12 sequences of each layout after 4 to 15 of the 16 new tokens
#: (picked from the greedy continuations without stops: ``make_golden.py --probe``).
GREEDY_STOPS = [206, 136, 194, 232]
#: Top-p stops: the sampled distribution of this barely trained model is nearly flat over 250 tokens, so a larger
#: set (a sixteenth of the vocabulary) ends more than half of the sequences early.
SAMPLED_STOPS = list(range(3, VOCAB, 16))
TOP_P = dict(temperature=0.8, top_p=0.9, seed=11)

#: (name, training (t, p, d), rollout (t_g, p_g), weight mode, prompts per training DP rank, decode slots). Each
#: rollout replica gets at least twice as many prompts as it has slots, so slots are refilled as sequences end.
GENERATION_LAYOUTS = [
    # t_g < t: the switch gathers over a micro-DP group of 2; each rollout replica generates half the prompts and
    # the results are all-gathered back.
    ("t2p1d1-tg1pg1-aliased", (2, 1, 1), (1, 1), "aliased", 12, 3),
    # p_g = 2: pipeline send/recv of hidden states in every prefill, decode and mixed step; t_g < t as well.
    ("t2p2d1-tg1pg2-canonical", (2, 2, 1), (1, 2), "canonical", 12, 3),
    # t_g > t: one rollout replica spans both training replicas (their prompts gathered over the rollout TP
    # group), vocabulary-parallel logits and TP all-reduces in every step.
    ("t1p1d2-tg2pg1-aliased", (1, 1, 2), (2, 1), "aliased", 6, 3),
]

#: Per-call step counters of the replica (``ReplicaGenerator.stats``), recorded and compared with the outputs.
COUNTERS = ("prefill_forwards", "decode_steps", "mixed_steps", "slot_moves", "idle_slot_steps", "dropped_rows")

RECIPE_STEPS = 5
RECIPE_WORLD = 4
RECIPE_ARGV = ["--train-iters", str(RECIPE_STEPS)]  # the recipe's defaults otherwise: TP=2 × DP=2, rollout TP=1


def is_timing(key: str) -> bool:
    """Wall-clock metrics, which no two runs share."""
    return key == "switch_seconds" or key.startswith(("time/", "throughput/"))


def prompts_for(dp_rank: int, count: int) -> list[list[int]]:
    """``count`` prompts of lengths drawn from 1..60 (seeded by the training DP rank)."""
    g = torch.Generator().manual_seed(900 + dp_rank)
    return [torch.randint(0, VOCAB, (int(torch.randint(1, 61, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


# ---- rank bodies -----------------------------------------------------------------------------------------------
def generation_case(rollout_tp: int, rollout_pp: int, mode: str, state: dict, count: int, slots: int,
                    greedy_stops: list[int]) -> dict:
    """The two generate calls of one layout on this rank: per call its results and step counters."""
    from megatron.core import parallel_state as ps
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.inference import GenerationConfig, RolloutGenerator
    from tests.inference_cases import _training_model

    model = _training_model(state)
    engine = HybridEngine(model, RolloutLayout(rollout_tp, rollout_pp), weight_mode=mode)
    generator = RolloutGenerator(engine, GenerationConfig(max_batch_size=slots, max_sequence_length=MAX_LEN,
                                                          mixed_prefill_tokens=MIXED_PREFILL_TOKENS,
                                                          compact_slots=True))
    prompts = prompts_for(ps.get_data_parallel_rank(), count)
    calls = {
        "greedy": (SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS),
                   dict(stop_token_ids=greedy_stops)),
        "top_p": (SamplingParams(temperature=TOP_P["temperature"], top_p=TOP_P["top_p"],
                                 num_tokens_to_generate=NEW_TOKENS),
                  dict(stop_token_ids=SAMPLED_STOPS, seed=TOP_P["seed"], tempered_log_probs=True)),
    }
    out: dict[str, Any] = {"dp": ps.get_data_parallel_rank(), "calls": {}, "counters": {}}
    for name, (params, kwargs) in calls.items():
        before = generator.report()
        results = generator.generate(prompts, params, vocab_size=VOCAB, **kwargs)
        after = generator.report()
        # This rank's rollout replica's steps (replicas of one training replica generate different prompts).
        out["counters"][name] = {k: after[k] - before[k] for k in COUNTERS}
        call = {"tokens": [r.generated_tokens for r in results],
                "log_probs": [r.generated_log_probs for r in results]}
        if kwargs.get("tempered_log_probs"):
            call["tempered_log_probs"] = [r.generated_tempered_log_probs for r in results]
        out["calls"][name] = call
    engine.switch_to_training()
    generator.close()
    return out


def recipe_case(argv: list[str]) -> Optional[list[dict]]:
    """The recipe's ``main(argv)`` on this rank's groups; rank 0 returns its per-step metrics (every rank has the
    same), without the wall-clock ones."""
    recipe = runpy.run_path(RECIPE, run_name="train_ppo")  # not __main__: its main() is called here
    history = recipe["main"]([*argv, "--no-progress"])
    if dist.get_rank() != 0:
        return None
    return [{k: v for k, v in m.items() if not is_timing(k)} for m in history]


# ---- driving them (the parent process) -------------------------------------------------------------------------
def compute_generation(*, greedy_stops: Optional[list[int]] = None) -> dict:
    """Every layout's calls: per training DP rank its results (each DP rank's ranks must agree), per rank its
    rollout replica's step counters."""
    from tests import engine_cases
    from tests.harness import run_distributed

    stops = GREEDY_STOPS if greedy_stops is None else greedy_stops
    state = run_distributed(engine_cases.reference, 1, {})[0][0]
    out: dict[str, Any] = {}
    for name, (t, p, d), (t_g, p_g), mode, count, slots in GENERATION_LAYOUTS:
        runs = run_distributed(generation_case, t * p * d, t_g, p_g, mode, state, count, slots, stops,
                               tensor_model_parallel_size=t, pipeline_model_parallel_size=p)
        results: dict[str, Any] = {}
        for rank, r in enumerate(runs):
            key = f"dp{r['dp']}"
            # Every rank of a training replica gets that replica's results, bit for bit.
            assert canonical(results.setdefault(key, r["calls"])) == canonical(r["calls"]), (name, rank, key)
        out[name] = {"results": results, "counters": {call: [r["counters"][call] for r in runs]
                                                      for call in runs[0]["counters"]}}
    return out


def compute_recipe() -> list[dict]:
    from tests.harness import run_distributed

    return run_distributed(recipe_case, RECIPE_WORLD, RECIPE_ARGV, tensor_model_parallel_size=2)[0]


def summary(generation: dict) -> list[str]:
    """Per layout and call: the step counters summed over the ranks, and the sequences' lengths."""
    lines = []
    for name, case in generation.items():
        for call, per_rank in case["counters"].items():
            counters = {k: sum(c[k] for c in per_rank) for k in COUNTERS}
            lengths = sorted(len(t) for by_dp in case["results"].values() for t in by_dp[call]["tokens"])
            lines.append(f"{name} {call}: {counters} lengths {lengths}")
    return lines


def exercised(generation: dict, *, greedy_stops: Optional[list[int]] = None) -> list[str]:
    """What the cases must exercise and, where one does not, a line saying so (empty: all of it)."""
    stops = {"greedy": set(GREEDY_STOPS if greedy_stops is None else greedy_stops), "top_p": set(SAMPLED_STOPS)}
    problems = []
    for name, case in generation.items():
        for call, per_rank in case["counters"].items():
            for key in ("prefill_forwards", "mixed_steps", "slot_moves"):
                if not sum(c[key] for c in per_rank):
                    problems.append(f"{name} {call}: no {key}")
            sequences = [t for by_dp in case["results"].values() for t in by_dp[call]["tokens"]]
            lengths = sorted(len(t) for t in sequences)
            if lengths[0] == NEW_TOKENS or lengths[-1] < NEW_TOKENS:
                problems.append(f"{name} {call}: lengths {lengths}: not some stopped early and some full")
            if any(len(t) < NEW_TOKENS and t[-1] not in stops[call] for t in sequences):
                problems.append(f"{name} {call}: a sequence ended early without a stop token")
    return problems


def generation_inputs() -> dict:
    """What the generation cases are (stored beside their outputs: a golden file of other cases is stale)."""
    return {"layouts": [{"name": n, "training_tpd": list(tpd), "rollout_tp_pp": list(r), "weight_mode": m,
                         "prompts_per_dp_rank": c, "slots": k} for n, tpd, r, m, c, k in GENERATION_LAYOUTS],
            "new_tokens": NEW_TOKENS, "max_sequence_length": MAX_LEN, "mixed_prefill_tokens": MIXED_PREFILL_TOKENS,
            "compact_slots": True, "greedy_stops": GREEDY_STOPS, "sampled_stops": SAMPLED_STOPS, "top_p": TOP_P}


def recipe_inputs() -> dict:
    return {"argv": RECIPE_ARGV, "world_size": RECIPE_WORLD, "tensor_model_parallel_size": 2}


def environment() -> dict:
    """The wheels and CPU the goldens were written with (not compared: a failure message shows them)."""
    import megatron.core

    return {"torch": torch.__version__, "megatron_core": megatron.core.__version__,
            "python": platform.python_version(), "machine": platform.machine(), "cpu": cpu_signature()}


# ---- canonical form and diff -----------------------------------------------------------------------------------
def canonical(value: Any) -> Any:
    """``value`` with every float as its ``float.hex`` (exact: sign, NaN, every bit), tuples as lists."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return "nan" if math.isnan(value) else value.hex()
    if isinstance(value, dict):
        return {str(k): canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    raise TypeError(f"no canonical form for {type(value).__name__}: {value!r}")


def differences(expected: Any, actual: Any, path: str = "", *, limit: int = 20) -> list[str]:
    """Where ``actual`` differs from ``expected`` (in canonical form): one line per difference, at most ``limit``
    (then a count). Keys missing or extra, lengths, types and values all count."""
    out: list[str] = []

    def walk(e: Any, a: Any, at: str) -> None:
        if isinstance(e, dict) and isinstance(a, dict):
            for k in sorted(set(e) | set(a)):
                if k not in a:
                    out.append(f"{at}/{k}: missing (expected {_show(e[k])})")
                elif k not in e:
                    out.append(f"{at}/{k}: unexpected ({_show(a[k])})")
                else:
                    walk(e[k], a[k], f"{at}/{k}")
        elif isinstance(e, list) and isinstance(a, list):
            if len(e) != len(a):
                out.append(f"{at}: length {len(a)}, expected {len(e)}: {_show(a)} vs {_show(e)}")
            for i, (x, y) in enumerate(zip(e, a)):
                walk(x, y, f"{at}[{i}]")
        elif type(e) is not type(a) or e != a:
            out.append(f"{at}: {_show(a)}, expected {_show(e)}")

    walk(canonical(expected), canonical(actual), path)
    if len(out) > limit:
        out = out[:limit] + [f"... {len(out) - limit} more"]
    return out


def _show(v: Any) -> str:
    """A canonical value for a diff line: hex floats also as decimals."""
    if isinstance(v, str) and ("0x" in v or v in ("inf", "-inf", "nan")):
        return f"{float.fromhex(v)!r} ({v})"
    text = json.dumps(v)
    return text if len(text) <= 120 else text[:117] + "..."


# ---- files -----------------------------------------------------------------------------------------------------
def dumps(value: Any) -> str:
    """JSON with one line per list of scalars (a sequence's tokens or log-probs), nested structure indented."""
    def enc(v: Any, indent: int) -> str:
        pad = " " * indent
        if isinstance(v, dict):
            if not v:
                return "{}"
            items = [f'{pad} {json.dumps(str(k))}: {enc(x, indent + 1)}' for k, x in v.items()]
            return "{\n" + ",\n".join(items) + "\n" + pad + "}"
        if isinstance(v, list) and any(isinstance(x, (dict, list)) for x in v):
            return "[\n" + ",\n".join(f"{pad} {enc(x, indent + 1)}" for x in v) + "\n" + pad + "]"
        return json.dumps(v)

    return enc(value, 0) + "\n"


def write_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a failed write leaves the old file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
