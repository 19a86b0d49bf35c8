"""Benchmark generation: the HybridEngine's rollout layout against generation in the training layout, same batch.

For every layout (t, p, d → t_g, p_g), one torchrun job builds a GPT model in the training layout (Megatron's
``initialize_model_parallel(t, p)``), wraps it in ``HybridEngine(model, RolloutLayout(t_g, p_g))`` and, for one
global batch of prompts split evenly over the d training DP replicas, times:

- ``training``: ``megatron_hybrid.rollout.generate_tokens`` with the training model on each training DP replica
  (Megatron's TP and PP groups), the engine in training mode;
- ``switch``: ``engine.switch_to_rollout()`` (the reshard; ``communication_report()["switch_seconds"]`` is
  recorded next to the wall time);
- ``rollout``: ``engine.generate(prompts, SamplingParams(...))`` on the rollout layout (already switched): each
  training replica's prompts split over its d_g = t·p / (t_g·p_g) rollout replicas, results all-gathered back;
- ``rollout+switch``: the two above together, what a rollout phase costs from training mode.

Greedy decoding (top_k = 1), fixed prompt length, ``--new-tokens`` tokens per prompt, no stop tokens. Both ways
must produce the same tokens; fp32/bf16 reduction order differs between layouts and can, rarely, flip an argmax,
so the bench counts mismatches (``tokens_match``, ``mismatched_sequences``, ``mismatched_tokens``) instead of
failing. Generation in this repository recomputes the whole prefix at every step (no KV cache): keep
``--new-tokens`` small on CPU.

Timing: per run, training generate, switch, rollout generate, each after a barrier (garbage collection before,
untimed); a run's time is the slowest rank's; reported: the median over ``--runs`` runs after ``--warmup``
warm-up runs. Throughput = generated tokens of the whole global batch / that time. On CPU, cpu_gloo()'s CUDA→CPU
shim stays active in both ways (the model's forward needs it); it costs both the same per torch call.

Outputs in ``--output-dir``: ``NAME.json`` (one row per method, layout and shape) and ``NAME.md`` (tables).

Examples:
    # CPU, gloo, 4 ranks, the default layouts, tiny model (a short run):
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 bench/generate.py --output-dir /tmp/gen --runs 2
    # chosen layouts (t,p,d,t_g,p_g), bigger batch, more tokens:
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 bench/generate.py --output-dir /tmp/gen \\
        --layouts 2,2,1,1,1 2,2,1,2,1 --batch 16 --prompt-len 32 --new-tokens 16
    # 8 GPUs, NCCL, a 1B model in bf16:
    torchrun --standalone --nproc_per_node 8 bench/generate.py --shape gpu-1b --batch 64 --prompt-len 128 \\
        --new-tokens 32 --output-dir bench/results
    # 4 ranks sharing 1 GPU over gloo (device = LOCAL_RANK % device_count):
    torchrun --standalone --nproc_per_node 4 bench/generate.py --shape gpu-1b --backend gloo --output-dir /tmp/g
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
import warnings
import zlib
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_hybrid.models import GPTArchitecture  # noqa: E402

Layout = tuple[int, int, int, int, int]  # (t, p, d, t_g, p_g)
METHODS = ("training", "rollout", "rollout+switch")

SHAPES: dict[str, GPTArchitecture] = {
    # 256 rows pad to 256 at every TP size up to 8 (32 × 8): every layout computes the same function.
    "cpu-tiny": GPTArchitecture(num_layers=4, hidden_size=128, num_attention_heads=8, ffn_hidden_size=256,
                                vocab_size=256, make_vocab_size_divisible_by=32, max_position_embeddings=1024),
    "gpu-1b": GPTArchitecture(num_layers=16, hidden_size=2048, num_attention_heads=16, num_query_groups=8,
                              ffn_hidden_size=5632, vocab_size=32000, make_vocab_size_divisible_by=128,
                              max_position_embeddings=4096, params_dtype="bfloat16"),
    "llama-7b": GPTArchitecture(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                                vocab_size=32000, make_vocab_size_divisible_by=128, max_position_embeddings=4096,
                                params_dtype="bfloat16"),
}

DEFAULT_LAYOUTS: dict[int, list[Layout]] = {
    2: [(2, 1, 1, 1, 1)],
    4: [(2, 1, 2, 1, 1), (4, 1, 1, 2, 1), (2, 2, 1, 1, 1)],
    8: [(8, 1, 1, 1, 1), (8, 1, 1, 2, 1), (4, 2, 1, 2, 1), (2, 2, 2, 1, 1)],
}


def default_layouts(world: int) -> list[Layout]:
    if world in DEFAULT_LAYOUTS:
        return list(DEFAULT_LAYOUTS[world])
    return [(world, 1, 1, 1, 1)]


def parse_layout(text: str) -> Layout:
    parts = text.replace("(", "").replace(")", "").split(",")
    if len(parts) != 5 or not all(s.strip().isdigit() for s in parts):
        raise argparse.ArgumentTypeError(f"layout {text!r} must be five integers t,p,d,t_g,p_g")
    return tuple(int(s) for s in parts)  # type: ignore[return-value]


# -------------------------------------------------------------------------------------------------------------
# Model and prompts


def _no_init(weight: torch.Tensor) -> None:
    """An init_method that leaves the weight as allocated (set_weights fills it)."""


def set_weights(model: torch.nn.Module, tp_rank: int, tp_size: int) -> None:
    """Deterministic weights, generated on the model's device: each full tensor from a seed of its global name,
    this rank's TP shard of it copied in, so every layout of a shape computes the same function (as long as the
    padded vocabulary is the same: always for ``cpu-tiny``). Norm weights 1, word embeddings N(0, 1), matrices
    N(0, 1/fan_in): every layer moves the residual stream, so greedy continuations depend on the whole prefix
    instead of collapsing onto one token (as they do with std 0.02 everywhere), which makes the token check
    meaningful."""
    from megatron_hybrid.sharding import TPSpec, global_name, layer_offset, shard

    offset = layer_offset(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
                continue
            spec = TPSpec.of(p)
            full_shape = list(p.shape)
            if spec.sharded:
                full_shape[spec.dim] *= tp_size
            std = 1.0 if "word_embeddings" in name else full_shape[-1] ** -0.5
            g = torch.Generator(device=p.device).manual_seed(zlib.crc32(global_name(name, offset).encode()))
            full = torch.randn(full_shape, generator=g, device=p.device, dtype=torch.float32).mul_(std)
            p.copy_(shard(full, spec, tp_rank, tp_size) if spec.sharded else full)
            del full


def global_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()


def build_model(arch: GPTArchitecture, t: int, p: int, device: torch.device):
    from megatron.core import parallel_state as ps

    config = arch.transformer_config(tensor_model_parallel_size=t, pipeline_model_parallel_size=p,
                                     use_cpu_initialization=False, init_method=_no_init,
                                     output_layer_init_method=_no_init, embedding_init_method=_no_init)
    model = arch.build(config, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    model.to(device)
    model.eval()
    set_weights(model, ps.get_tensor_model_parallel_rank(), t)
    return model


# -------------------------------------------------------------------------------------------------------------
# Timing helpers


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _all_objects(obj) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def timed(fn, device: torch.device) -> tuple[Any, float]:
    """Run ``fn`` after gc and a barrier; return its result and the slowest rank's seconds."""
    gc.collect()
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    dt = time.perf_counter() - t0
    return out, _max_over_ranks(dt, device)


def _destroy_subgroups() -> None:
    """Free every process group but the world (Megatron's and the engine's): each gloo group keeps threads of its
    own, and those accumulating over layouts slow every later collective down (see bench/README.md)."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d.GroupMember.WORLD
    for pg in list(c10d._world.pg_map):
        if pg is not world:
            dist.destroy_process_group(pg)
    gc.collect()


def compare(a: list, b: list) -> dict[str, Any]:
    """Greedy tokens of two generations of the same prompts: mismatched sequences, tokens after (and at) the
    first divergence, and the largest log-prob difference over the tokens before it."""
    seqs = toks = 0
    logp = 0.0
    for ra, rb in zip(a, b):
        ta, tb = ra.generated_tokens, rb.generated_tokens
        first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        if first < max(len(ta), len(tb)):
            seqs += 1
            toks += max(len(ta), len(tb)) - first
        for x, y in zip(ra.generated_log_probs[:first], rb.generated_log_probs[:first]):
            logp = max(logp, abs(x - y))
    if len(a) != len(b):
        seqs += abs(len(a) - len(b))
    return {"mismatched_sequences": seqs, "mismatched_tokens": toks, "max_logp_diff": logp}


# -------------------------------------------------------------------------------------------------------------
# One layout


def bench_layout(args, arch: GPTArchitecture, layout: Layout, device: torch.device, backend: str) -> list[dict]:
    from megatron.core import parallel_state as ps
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.rollout import generate_tokens, split_evenly

    t, p, d, t_g, p_g = layout
    rank = dist.get_rank()
    ps.initialize_model_parallel(tensor_model_parallel_size=t, pipeline_model_parallel_size=p)
    model_parallel_cuda_manual_seed(0)
    engine = None
    try:
        model = build_model(arch, t, p, device)
        engine = HybridEngine(model, RolloutLayout(t_g, p_g), weight_mode=args.weight_mode,
                              bucket_size_mb=args.reshard_bucket_size_mb)
        d_g = engine.layout.d_g
        dp = ps.get_data_parallel_rank()
        prompts_all = global_prompts(args.batch, args.prompt_len, arch.vocab_size, args.seed)
        lo, hi = split_evenly(len(prompts_all), d)[dp]
        prompts = prompts_all[lo:hi]
        params = SamplingParams(temperature=1.0, top_k=1, num_tokens_to_generate=args.new_tokens,
                                return_log_probs=True)
        tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()

        def train_gen():
            return generate_tokens(model, tp_group=tp_group, pp_group=pp_group, prompts=prompts, params=params,
                                   vocab_order=None, vocab_size=arch.vocab_size)

        def rollout_gen():
            return engine.generate(prompts, params, vocab_size=arch.vocab_size)

        times: dict[str, list[float]] = {m: [] for m in METHODS + ("switch",)}
        reported_switch: list[float] = []
        cmp_runs: list[dict] = []
        train_tokens = rollout_tokens = None
        first_train = first_rollout = None
        gc.collect()
        gc.freeze()  # the per-run collection only looks at what the runs create (see bench/README.md)
        try:
            for i in range(args.warmup + args.runs):
                engine.switch_to_training()
                train_res, t_train = timed(train_gen, device)
                _, t_switch = timed(engine.switch_to_rollout, device)
                # Read now: a later no-op switch (generate() calls switch_to_rollout()) overwrites the report.
                rep_switch = engine.communication_report()["switch_seconds"]
                rep_switch = _max_over_ranks(rep_switch, device)
                roll_res, t_roll = timed(rollout_gen, device)
                if first_train is None:
                    first_train, first_rollout = train_res, roll_res
                else:  # greedy: every run must give the same tokens as the first
                    same = ([r.generated_tokens for r in train_res] == [r.generated_tokens for r in first_train]
                            and [r.generated_tokens for r in roll_res] == [r.generated_tokens for r in first_rollout])
                    if not same:
                        print(f"WARNING rank {rank} {layout}: run {i} generated other tokens than run 0", flush=True)
                cmp_runs.append(compare(roll_res, train_res))
                train_tokens = sum(len(r.generated_tokens) for r in train_res)
                rollout_tokens = sum(len(r.generated_tokens) for r in roll_res)
                if i >= args.warmup:
                    times["training"].append(t_train)
                    times["switch"].append(t_switch)
                    times["rollout"].append(t_roll)
                    times["rollout+switch"].append(t_switch + t_roll)
                    reported_switch.append(rep_switch)
                if rank == 0 and args.verbose:
                    print(f"  run {i}{' (warm-up)' if i < args.warmup else ''}: training {t_train:.3f} s, switch "
                          f"{t_switch * 1e3:.1f} ms, rollout {t_roll:.3f} s", flush=True)
        finally:
            gc.unfreeze()
        engine.switch_to_training()
        # Generated tokens of the whole batch: one count per training DP replica (its TP/PP ranks agree).
        local = {"dp": dp, "first_of_replica": ps.get_tensor_model_parallel_rank() == 0
                 and ps.get_pipeline_model_parallel_rank() == 0, "train_tokens": train_tokens,
                 "rollout_tokens": rollout_tokens, "cmp": cmp_runs[-1], "prompts": len(prompts),
                 "sample": {"training": first_train[0].generated_tokens if first_train else [],
                            "rollout": first_rollout[0].generated_tokens if first_rollout else []}}
        everyone = _all_objects(local)
        engine.close()
        engine = None
    finally:
        if engine is not None:
            engine.close()
        ps.destroy_model_parallel()
        _destroy_subgroups()
    if rank != 0:
        return []

    heads = [e for e in everyone if e["first_of_replica"]]
    train_total = sum(e["train_tokens"] for e in heads)
    rollout_total = sum(e["rollout_tokens"] for e in heads)
    # Every rank of a replica compares its own copy of the results: take the worst rank of each replica.
    mism_seq = sum(max(e["cmp"]["mismatched_sequences"] for e in everyone if e["dp"] == h["dp"]) for h in heads)
    mism_tok = sum(max(e["cmp"]["mismatched_tokens"] for e in everyone if e["dp"] == h["dp"]) for h in heads)
    logp_diff = max(e["cmp"]["max_logp_diff"] for e in everyone)
    switch_med = statistics.median(times["switch"])
    common = {
        "shape": args.shape, "layout": list(layout), "d_g": d_g, "world_size": dist.get_world_size(),
        "backend": backend, "device": device.type if device.type == "cpu" else torch.cuda.get_device_name(device),
        "cpu_count": os.cpu_count(), "dtype": arch.params_dtype, "weight_mode": args.weight_mode,
        "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "runs": args.runs, "warmup": args.warmup, "torch": torch.__version__,
    }
    rows = []
    for name in METHODS:
        runs = times[name]
        med = statistics.median(runs)
        tokens = train_total if name == "training" else rollout_total
        row = {"method": name, **common, "seconds_median": med, "seconds_runs": runs, "generated_tokens": tokens,
               "tokens_per_s": tokens / med if med > 0 else float("inf"),
               # the first prompt's greedy continuation (rank 0), to see that it is not degenerate
               "sample_tokens": everyone[0]["sample"]["training" if name == "training" else "rollout"]}
        if name != "training":
            row["switch_s_median"] = switch_med
            row["switch_report_s_median"] = statistics.median(reported_switch)
            row["tokens_match"] = mism_seq == 0 and train_total == rollout_total
            row["mismatched_sequences"] = mism_seq
            row["mismatched_tokens"] = mism_tok
            row["max_logp_diff"] = logp_diff
        rows.append(row)
    train_tps = rows[0]["tokens_per_s"]
    for r in rows[1:]:
        r["ratio_vs_training"] = r["tokens_per_s"] / train_tps if train_tps else float("nan")
    return rows


# -------------------------------------------------------------------------------------------------------------
# Outputs


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Generation: rollout layout vs training layout, {meta['world_size']} {meta['backend']} ranks on "
             f"{meta['device']} ({meta['cpu_count']} cores)", "",
             f"torch {meta['torch']}; shape `{meta['shape']}` ({meta['dtype']}), weight_mode {meta['weight_mode']}; "
             f"batch {meta['batch']} prompts × {meta['prompt_len']} tokens, {meta['new_tokens']} new tokens each, "
             f"greedy, no KV cache; median of {meta['runs']} runs after {meta['warmup']} warm-up; a run's time is "
             "the slowest rank's. tok/s = generated tokens of the whole batch / that time. ratio = rollout tok/s / "
             "training tok/s. switch: engine.switch_to_rollout() wall time (communication_report's "
             "switch_seconds in brackets).", "",
             "| layout t,p,d→t_g,p_g | d_g | training tok/s | rollout tok/s | ratio | switch ms (report) | "
             "rollout+switch tok/s (ratio) | tokens match (mismatched seqs / tokens) | max log-p diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    layouts: list = []
    for r in rows:
        if r["layout"] not in layouts:
            layouts.append(r["layout"])
    for lay in layouts:
        by = {r["method"]: r for r in rows if r["layout"] == lay}
        tr, ro, rs = by["training"], by["rollout"], by["rollout+switch"]
        lines.append(
            f"| {'{},{},{}→{},{}'.format(*lay)} | {ro['d_g']} | {tr['tokens_per_s']:.1f} | {ro['tokens_per_s']:.1f} | "
            f"{ro['ratio_vs_training']:.2f} | {ro['switch_s_median'] * 1e3:.1f} ({ro['switch_report_s_median'] * 1e3:.1f}) | "
            f"{rs['tokens_per_s']:.1f} ({rs['ratio_vs_training']:.2f}) | "
            f"{'yes' if ro['tokens_match'] else 'NO'} ({ro['mismatched_sequences']} / {ro['mismatched_tokens']}) | "
            f"{ro['max_logp_diff']:.2g} |")
    lines += ["", "## All rows", "", "| method | layout | seconds (median) | runs | tokens | tok/s |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {','.join(map(str, r['layout']))} | {r['seconds_median']:.4f} | "
                     + ", ".join(f"{s:.4f}" for s in r["seconds_runs"])
                     + f" | {r['generated_tokens']} | {r['tokens_per_s']:.1f} |")
    a = SHAPES[meta["shape"]]
    lines += ["", f"Shape `{meta['shape']}`: {a.num_layers} layers, hidden {a.hidden_size}, ffn {a.ffn_hidden_size}, "
              f"heads {a.num_attention_heads}/{a.num_query_groups or a.num_attention_heads}, vocab {a.vocab_size}, "
              f"{a.params_dtype}.", ""]
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-dir", type=Path, required=True, help="where NAME.json and NAME.md go")
    ap.add_argument("--name", default=None, help="file stem (default: generate_cpu or generate_gpu)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="cpu-tiny")
    ap.add_argument("--layouts", nargs="+", type=parse_layout, default=None,
                    help="t,p,d,t_g,p_g ... (default per world size: " + "; ".join(
                        f"{w}: " + " ".join(",".join(map(str, lay)) for lay in ls)
                        for w, ls in DEFAULT_LAYOUTS.items()) + ")")
    ap.add_argument("--batch", type=int, default=8, help="global batch: prompts over all training DP replicas")
    ap.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt")
    ap.add_argument("--new-tokens", type=int, default=8, help="generated tokens per prompt (greedy)")
    ap.add_argument("--runs", type=int, default=5, help="timed runs (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    ap.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                    help="auto: nccl with CUDA, else gloo; gloo on CUDA lets several ranks share a GPU")
    ap.add_argument("--weight-mode", choices=("aliased", "canonical"), default="aliased",
                    help="HybridEngine weight_mode")
    ap.add_argument("--reshard-bucket-size-mb", type=float, default=256.0, help="HybridEngine bucket_size_mb")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    ap.add_argument("--verbose", action="store_true", help="a line per run on rank 0")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.warmup < 0:
        raise ValueError(f"--runs ({args.runs}) must be >= 1 and --warmup ({args.warmup}) >= 0")
    if min(args.batch, args.prompt_len, args.new_tokens) < 1:
        raise ValueError("--batch, --prompt-len and --new-tokens must be positive")
    arch = SHAPES[args.shape]
    if args.prompt_len + args.new_tokens > arch.max_position_embeddings:
        raise ValueError(f"--prompt-len + --new-tokens exceeds max_position_embeddings ({arch.max_position_embeddings})")

    use_cuda = torch.cuda.is_available()
    backend = args.backend if args.backend != "auto" else ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise ValueError("--backend nccl needs CUDA")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(backend)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    if backend == "nccl" and int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > torch.cuda.device_count():
        raise ValueError("NCCL needs one GPU per rank; use --backend gloo to share GPUs")
    args.name = args.name or ("generate_gpu" if use_cuda else "generate_cpu")
    layouts = args.layouts or default_layouts(world)
    for lay in layouts:
        if lay[0] * lay[1] * lay[2] != world:
            raise ValueError(f"layout {lay}: t·p·d = {lay[0] * lay[1] * lay[2]} but the world has {world} ranks")
    from megatron_hybrid.patches import cpu_gloo

    rows: list[dict] = []
    started = time.perf_counter()
    with contextlib.nullcontext() if use_cuda else cpu_gloo(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
        for n, layout in enumerate(layouts):
            t1 = time.perf_counter()
            if rank == 0:
                print(f"[{n + 1}/{len(layouts)}] {args.shape} {layout} ...", flush=True)
            new = bench_layout(args, arch, layout, device, backend)
            rows += new
            if rank == 0:
                by = {r["method"]: r for r in new}
                ro = by["rollout"]
                print(f"[{n + 1}/{len(layouts)}] {args.shape} t,p,d={layout[:3]} -> t_g,p_g={layout[3:]} "
                      f"(d_g={ro['d_g']}): training {by['training']['tokens_per_s']:.1f} tok/s, rollout "
                      f"{ro['tokens_per_s']:.1f} tok/s (x{ro['ratio_vs_training']:.2f}), switch "
                      f"{ro['switch_s_median'] * 1e3:.1f} ms, rollout+switch "
                      f"{by['rollout+switch']['tokens_per_s']:.1f} tok/s, tokens_match {ro['tokens_match']} "
                      f"({ro['mismatched_sequences']} seqs)  [{time.perf_counter() - t1:.0f} s, total "
                      f"{time.perf_counter() - started:.0f} s]", flush=True)
    if rank == 0:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        meta = {k: rows[0][k] for k in ("world_size", "backend", "device", "cpu_count", "torch", "shape", "dtype",
                                         "weight_mode", "batch", "prompt_len", "new_tokens", "runs", "warmup")}
        host = platform.platform()
        for r in rows:
            r["host"] = host
        (args.output_dir / f"{args.name}.json").write_text(json.dumps(rows, indent=1) + "\n")
        (args.output_dir / f"{args.name}.md").write_text(markdown(rows, meta))
        print(f"wrote {args.output_dir}/{args.name}.{{json,md}} in {time.perf_counter() - started:.0f} s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
