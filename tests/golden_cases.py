"""Golden outputs: what generation and the recipe give, checked on any CPU, and a same-machine bit-for-bit tool.

What is recorded (``tests/golden/generation.json``, ``tests/golden/recipe.json``; written by
``tests/golden/make_golden.py --write``, checked by ``tests/test_golden.py``):

- generation, at three training → rollout layouts on CPU gloo (:data:`GENERATION_LAYOUTS`), with
  ``GenerationConfig(mixed_prefill_tokens=64, compact_slots=True)`` and more prompts than decode slots: a greedy call
  and a seeded top-p call (with tempered log-probs), each with stop tokens that end some sequences early. Per
  training DP rank and call: the generated tokens, the log-probs and the call's step counters (prefills, decode
  steps, mixed steps, slot moves), which show that refills rode along decode steps, that slots were compacted and
  that stop tokens fired; and per call the smallest decision margin (:func:`decision_margins`) of any token drawn;
- the recipe (``examples/ppo/train_ppo.py``'s ``main``, its defaults: the tiny model, TP=2 × DP=2 on 4 ranks,
  rollout TP=1) for its first step: every metric but the wall-clock ones, and the first step's smallest decision
  margin.

What a CPU can change, and so what the check (:func:`check`) compares. ATen's vectorised exp, log and reductions
round differently per instruction set and vendor (AVX2 / AVX-512, Intel / AMD), so floats differ in the last bits
between CPU kinds: the two golden sets once committed (an AVX-512 AMD machine and another) gave log-probs 1-2 ulp
apart (≤ 2.4e-7 relative) and first-step losses and gradient norms ≤ 2.4e-7 relative apart. Tokens, counters and
bytes are compared exactly: a token can only change where its decision is a near-tie, and every recorded decision
has a margin ≥ :data:`DECISION_MARGIN` (the write refuses cases with a closer one), ~40× the largest drift seen.
Floats of one deterministic pass (log-probs of fixed weights and inputs; the first step's losses and gradient norms
of its first optimizer step) are compared within :data:`RTOL` / :data:`ATOL`. What follows an optimizer step or a
later sampled step is not compared across machines: once a last-bit difference flips a sampled token the runs part
(the two sets' step-3 ``vf_clipfrac`` was 0.035 against 0.0625).

Bit for bit (a restructuring that must not change numerics): ``make_golden.py --out DIR`` at the parent commit,
then ``make_golden.py --against DIR`` at the change, on one machine: every float's bits over
:data:`RECIPE_STEPS` recipe steps.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import runpy
from typing import Any, Iterator, Optional

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


GENERATION_FILE = os.path.join(GOLDEN_DIR, "generation.json")
RECIPE_FILE = os.path.join(GOLDEN_DIR, "recipe.json")
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

RECIPE_STEPS = 5  # the same-machine bit-for-bit comparison (--out / --against); the golden file holds step 1
RECIPE_WORLD = 4
RECIPE_TP = 2  # the recipe's defaults otherwise: TP=2 × DP=2, rollout TP=1

#: The smallest decision margin a golden may hold (:func:`decision_margins`: logit units for greedy, relative for a
#: sampled token). Cross-CPU drift of the log-probs and logits is ≤ 2 ulp (≤ 5e-7 absolute at these magnitudes, see
#: the module docstring); a margin of 2e-5 leaves a factor of ~40, so no recorded token can flip on another CPU.
DECISION_MARGIN = 2e-5
#: Float tolerance of the cross-CPU check: |actual - expected| ≤ ATOL + RTOL·|expected|. RTOL is ~40× the largest
#: relative drift between the two CPU kinds' goldens (2.4e-7) and 10× below the 1e-4 relative change the check must
#: catch (tests/test_golden.py). ATOL covers values that are rounding noise around 0 themselves: a first-epoch policy
#: loss of normalised advantages, whose terms are ~1 and whose mean is ±1e-7 (the two sets: ≤ 9e-8 apart).
RTOL = 1e-5
ATOL = 3e-7
#: The rollout-vs-training log-prob mismatch statistics measure rounding (their values are a few ulp of a log-prob
#: of ~-4, 4.8e-7 each): another CPU may round one more or one less ulp.
NOISE_METRICS = "rollout_mismatch/"
NOISE_ATOL = 2e-6
#: Recipe metrics that are counts or settings, compared exactly (a changed token shows in reward_mean exactly too).
EXACT_METRICS = ("reward_mean", "response_length", "switch_bytes", "step", "lr", "kl_coef")


def is_timing(key: str) -> bool:
    """Wall-clock metrics, which no two runs share."""
    return key == "switch_seconds" or key.startswith(("time/", "throughput/", "switch/", "memory/"))


def prompts_for(dp_rank: int, count: int) -> list[list[int]]:
    """``count`` prompts of lengths drawn from 1..60 (seeded by the training DP rank)."""
    g = torch.Generator().manual_seed(900 + dp_rank)
    return [torch.randint(0, VOCAB, (int(torch.randint(1, 61, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


# ---- rank bodies -----------------------------------------------------------------------------------------------
def decision_margins(logits_nV: torch.Tensor, params, *, vocab_size: int, noise_nV: Optional[torch.Tensor]
                     ) -> torch.Tensor:
    """How far each row's token was from being another one: greedy, the gap between the two largest logits;
    sampled (the exponential race of ``sampling.sample``, its draws ``noise_nV``), the relative gap between the two
    largest scores p/E and, with top-p, the distance of the nucleus's edge to ``top_p`` where moving that edge by one
    token would change the winner. Computed here from the formulas, beside the sampler, not by it. ``[n]`` float."""
    from megatron_hybrid.inference.sampling import is_greedy

    logits = logits_nV[:, :vocab_size].float()
    if is_greedy(params):
        top = logits.topk(2, dim=-1).values
        return top[:, 0] - top[:, 1]
    x = logits / float(params.temperature)
    top_k, top_p = int(params.top_k or 0), float(params.top_p or 0.0)
    if top_k > 1:
        x = x.masked_fill(x < x.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
    race = noise_nV.clamp(min=torch.finfo(torch.float32).tiny)

    def winner(x_V: torch.Tensor, row: int) -> tuple[int, float]:
        scores = x_V.softmax(dim=-1) / race[row]
        top = scores.topk(2)
        return int(top.indices[0]), float((top.values[0] - top.values[1]) / top.values[0])

    margins = []
    for row in range(x.shape[0]):
        if not 0.0 < top_p < 1.0:
            margins.append(winner(x[row], row)[1])
            continue
        sorted_x, order = x[row].sort(descending=True)
        probs = sorted_x.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # the mass ahead of each token: dropped where it exceeds top_p
        kept = int((before <= top_p).sum())

        def nucleus(n: int) -> torch.Tensor:
            return torch.empty_like(x[row]).scatter_(0, order, sorted_x.masked_fill(torch.arange(len(order)) >= n,
                                                                                      float("-inf")))

        token, gap = winner(nucleus(kept), row)
        margin = gap
        for n, edge in ((kept - 1, kept - 1), (kept + 1, kept)):  # the last kept token out, the first dropped in
            if 1 <= n <= len(order) and winner(nucleus(n), row)[0] != token:
                margin = min(margin, abs(float(before[edge]) - top_p))
        margins.append(margin)
    return torch.tensor(margins)


@contextlib.contextmanager
def recorded_margins() -> Iterator[list[float]]:
    """Within the block, every sampling step of the generator (``runner.sample``) appends its smallest
    :func:`decision_margins` to the yielded list. A sampled step gets its race's draws from the step's generator
    here, as ``sample`` would draw them itself (same shape, same order), so tokens are unchanged."""
    from megatron_hybrid.inference import runner
    from megatron_hybrid.inference.sampling import is_greedy

    seen: list[float] = []
    sample = runner.sample

    def recording(logits_nV, params, *, vocab_size, generator=None, noise_nV=None, tempered_log_probs=False):
        if noise_nV is None and not is_greedy(params):
            noise_nV = torch.empty(logits_nV.shape[0], vocab_size, dtype=torch.float32,
                                   device=logits_nV.device).exponential_(generator=generator)
        if logits_nV.shape[0]:
            seen.append(float(decision_margins(logits_nV, params, vocab_size=vocab_size, noise_nV=noise_nV).min()))
        return sample(logits_nV, params, vocab_size=vocab_size, noise_nV=noise_nV,
                      tempered_log_probs=tempered_log_probs)

    runner.sample = recording
    try:
        yield seen
    finally:
        runner.sample = sample


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
    out: dict[str, Any] = {"dp": ps.get_data_parallel_rank(), "calls": {}, "counters": {}, "margins": {}}
    for name, (params, kwargs) in calls.items():
        before = generator.report()
        with recorded_margins() as margins:
            results = generator.generate(prompts, params, vocab_size=VOCAB, **kwargs)
        out["margins"][name] = min(margins, default=math.inf)  # ranks that sample nothing (not the last stage): inf
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


def recipe_case(argv: list[str]) -> tuple[Optional[list[dict]], float]:
    """The recipe's ``main(argv)`` on this rank's groups: rank 0's per-step metrics (every rank has the same),
    without the wall-clock ones, and this rank's smallest decision margin (inf where it sampled nothing)."""
    recipe = runpy.run_path(RECIPE, run_name="train_ppo")  # not __main__: its main() is called here
    with recorded_margins() as margins:
        history = recipe["main"]([*argv, "--no-progress"])
    margin = min(margins, default=math.inf)
    if dist.get_rank() != 0:
        return None, margin
    return [{k: v for k, v in m.items() if not is_timing(k)} for m in history], margin


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
                                                      for call in runs[0]["counters"]},
                     "margins": {call: min(r["margins"][call] for r in runs) for call in runs[0]["margins"]}}
    return out


def compute_recipe(steps: int = 1) -> dict:
    """``{"steps": [metrics per step], "margin": the smallest decision margin over the ranks}``."""
    from tests.harness import run_distributed

    runs = run_distributed(recipe_case, RECIPE_WORLD, ["--train-iters", str(steps)],
                           tensor_model_parallel_size=RECIPE_TP)
    return {"steps": runs[0][0], "margin": min(margin for _, margin in runs)}


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
    return {"argv": ["--train-iters", "1"], "world_size": RECIPE_WORLD, "tensor_model_parallel_size": RECIPE_TP}


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


def differences(expected: Any, actual: Any, path: str = "", *, rtol: float = 0.0, atol: float = 0.0,
                exact: tuple[str, ...] = (), limit: int = 20) -> list[str]:
    """Where ``actual`` differs from ``expected``: one line per difference, at most ``limit`` (then a count). Keys
    missing or extra, lengths, types and values all count. Floats are equal bit for bit (sign, NaN, every bit) by
    default; with ``rtol`` / ``atol`` within ``atol + rtol·|expected|``, except under a key named in ``exact``."""
    out: list[str] = []

    def walk(e: Any, a: Any, at: str, bits: bool) -> None:
        if isinstance(e, dict) and isinstance(a, dict):
            for k in sorted(set(e) | set(a)):
                if k not in a:
                    out.append(f"{at}/{k}: missing (expected {_show(canonical(e[k]))})")
                elif k not in e:
                    out.append(f"{at}/{k}: unexpected ({_show(canonical(a[k]))})")
                else:
                    walk(e[k], a[k], f"{at}/{k}", bits or k in exact)
        elif isinstance(e, (list, tuple)) and isinstance(a, (list, tuple)):
            if len(e) != len(a):
                out.append(f"{at}: length {len(a)}, expected {len(e)}: {_show(canonical(a))} vs "
                           f"{_show(canonical(e))}")
            for i, (x, y) in enumerate(zip(e, a)):
                walk(x, y, f"{at}[{i}]", bits)
        elif isinstance(e, float) and type(a) is float and not bits and (rtol or atol):
            if not (abs(a - e) <= atol + rtol * abs(e) or (math.isnan(a) and math.isnan(e))):
                out.append(f"{at}: {a!r}, expected {e!r} (off by {abs(a - e):.3g}; allowed "
                           f"{atol:g} + {rtol:g}·|expected|)")
        elif type(e) is not type(a) or canonical(e) != canonical(a):
            out.append(f"{at}: {_show(canonical(a))}, expected {_show(canonical(e))}")

    walk(expected, actual, path, False)
    if len(out) > limit:
        out = out[:limit] + [f"... {len(out) - limit} more"]
    return out


def check_generation(stored: dict, computed: dict) -> list[str]:
    """The cross-CPU check of the generation cases (module docstring): the stored decision margins are wide enough,
    tokens and counters are equal, log-probs within :data:`RTOL` / :data:`ATOL`."""
    problems = [f"/{name}/margins/{call}: the golden's decision margin {m:.3g} is below {DECISION_MARGIN:g}: a near "
                f"tie that another CPU may decide otherwise; pick other cases"
                for name, case in stored.items() for call, m in case.get("margins", {}).items()
                if m < DECISION_MARGIN]
    strip = {name: {k: v for k, v in case.items() if k != "margins"} for name, case in stored.items()}
    mine = {name: {k: v for k, v in case.items() if k != "margins"} for name, case in computed.items()}
    return problems + differences(strip, mine, rtol=RTOL, atol=ATOL)


def first_step(metrics: dict) -> dict:
    """What the cross-CPU check compares of the recipe's first step: every metric, of a per-epoch list its first
    entry (the pass before any optimizer step; the second epoch follows an Adam step, whose sign-like first update
    of a near-zero gradient is not a rounding-level quantity)."""
    return {k: v[0] if isinstance(v, list) else v for k, v in metrics.items()}


def check_recipe(stored: dict, computed: dict) -> list[str]:
    """The cross-CPU check of the recipe's first step (module docstring)."""
    problems = []
    if stored["margin"] < DECISION_MARGIN:
        problems.append(f"/margin: the golden's decision margin {stored['margin']:.3g} is below {DECISION_MARGIN:g}")
    expected, actual = first_step(stored["steps"][0]), first_step(computed["steps"][0])
    noise = {k for k in set(expected) | set(actual) if k.startswith(NOISE_METRICS)}

    def part(metrics: dict, noisy: bool) -> dict:
        return {k: v for k, v in metrics.items() if (k in noise) == noisy}

    return (problems + differences(part(expected, False), part(actual, False), "/steps[0]", rtol=RTOL, atol=ATOL,
                                   exact=EXACT_METRICS)
            + differences(part(expected, True), part(actual, True), "/steps[0]", rtol=RTOL, atol=NOISE_ATOL))


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
