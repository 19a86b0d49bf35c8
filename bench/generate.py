"""Generation throughput on one device: megatron_hybrid.inference ("ours", on a HybridEngine's rollout model) against
transformers' ``generate`` on the same shape (``LlamaForCausalLM``, or ``Qwen3MoeForCausalLM`` for an MoE shape), and
the decode memory roofline.

Rows, written as one JSON list to ``--out`` (compare them run to run)::

    {"method": "ours" | "ours-fp8" | "transformers" | "roofline", "variant": "greedy" | "top_p" | "mixed", "batch": B,
     "new_tokens": N, "prompt_len": P, "tok_s": X, "seconds": median, "runs": [...], "tokens": generated, ...}

- ``ours``: ``RolloutGenerator`` (KV cache, continuous batching, CUDA graphs on a GPU) on
  ``HybridEngine(model, RolloutLayout(1, 1))``: B slots; variants ``greedy`` (B prompts of P tokens, N new tokens
  each), ``top_p`` (the same with temperature 1, top_p 0.9), and two of mixed lengths, where sequences end at
  different steps on stop tokens and slots are refilled as they free up (4·B prompts of lengths uniform in
  [P/4, 7P/4], top_p 0.9):

  - ``mixed``: at most 2·N new tokens and a stop set of 1/160 of the vocabulary, so ~N new tokens per prompt on
    average (127.7 if the stop tokens carried their share of the mass): the fixed runs' work per generated token
    (P prompt tokens per N new ones), so the ratio to ``top_p`` measures what ragged lengths and refills cost;
  - ``mixed_prompt_heavy``: at most N new tokens and a stop set of 1/64 (~56 per prompt): 2.3 prompt tokens
    prefilled per generated token, against 1 in the fixed runs, so prefill compute bounds its tok/s below theirs.

  tok/s = generated tokens / wall time of the call (median of ``--runs`` after ``--warmup``; the warm-up captures
  the CUDA graphs). ``new_tokens`` is the cap; ``mean_new_tokens`` what the prompts got. ``digest``: SHA-256 of
  every call's tokens and log-probs (the bits of the float32 values), the same for every call of a row (else
  ``digests`` lists them): two commits that compute the same tokens and log-probs give the same digest.
- ``ours-fp8``: ours on ``HybridEngine(model, RolloutLayout(1, 1), weight_mode="canonical",
  rollout_weights="fp8")`` (every switch writes the dense layers' linear weights as float8 e4m3 with per-row scales;
  the rollout model multiplies in FP8: :mod:`megatron_hybrid.quant.fp8`), whatever ``--weight-mode`` says. Its rows also
  give the engine's FP8 bytes while rolling out. Target ratios ``ours-fp8/ours B=<B> N=<N>`` (greedy).
- ``transformers``: ``LlamaForCausalLM`` (``Qwen3MoeForCausalLM`` for an MoE shape) with the same shape and random
  weights, made on the device in the same dtype, its defaults (``attn_implementation="sdpa"``, dynamic cache, no
  compile; for MoE its default experts implementation, recorded with what its prefill and decode forwards ran);
  greedy, ``min_new_tokens = max_new_tokens = N``.
- ``roofline``: per decode step, the weight bytes read plus the KV-cache bytes read (on average P + N/2 positions per
  sequence), at the device's copy bandwidth (bytes read + written per second of a large device copy); tok/s =
  B / step time. The weights read: every weight (the embedding table whole, as for a dense model) except the routed
  experts, of which a step reads the distinct experts the batch's tokens were routed to in each MoE layer: as
  measured on ours' greedy rows of the same batch (``routed_experts``: megatron's own forward over the finished
  sequences, its routers' choices at the decode steps' tokens) when present, else the expectation for uniform
  routing, E·(1 − (1 − k/E)^B) (``distinct_experts_source`` says which).

An MoE shape's rows also give ``layers`` and ``parameters``; ours' rows the experts' path (``moe_experts``: grouped
GEMMs over one stride per layer, else the per-expert path without CUDA graphs). ``--append`` adds the rows to those
already in ``--out`` (one method per process, each under its own time limit) and prints the targets over all of them.

``--profile-json PATH`` (GPU): for ours and ours-fp8, one more greedy call at each batch (the first N) under
torch.profiler, its decode steps' kernels isolated by marker kernels around each step (:mod:`kernel_table`): per
kernel name its count and time and whether it is a matrix multiply, and per decode step the kernel time, the matmul
time, their ratio and the kernels launched (also per layer). Rows ``{"method", "batch", "shape", "layers",
"per_decode_step_us", "matmul_us_per_decode_step", "total_over_matmul", "kernels_per_decode_step",
"kernels_per_layer_per_decode_step", "kernels": [{"name", "count", "total_us", "matmul"}, ...], ...}`` are added to
the JSON list at PATH (across processes, as ``--append``). Skipped with a message on the CPU.

Dense shapes are initialised on the host (gpu-1b's weights as in earlier runs: digests compare across commits),
except those of ``DEVICE_INIT`` (llama3-8b: host initialisation of 8 B parameters takes minutes) and MoE shapes.

Also prints the issue's target ratios (ours / transformers, ours / roofline, 512 vs 128 new tokens, mixed vs
fixed, top-p vs greedy), and for a shape with targets of its own (``TARGETS``) whether each is met.

    python3 bench/generate.py --out bench/results/generate_h200.json          # one GPU: gpu-1b, B 32 and 128
    python3 bench/generate.py --smoke --out /tmp/generate_smoke.json          # tiny model on the CPU, seconds
    python3 bench/generate.py --out /tmp/g.json --batch 128 --methods ours --profile greedy mixed  # where time goes
    # an MoE: Qwen3-30B-A3B's layers, 8 of them (bench/run_moe_h200.sh runs the methods one process each)
    python3 bench/generate.py --shape qwen3-30b-a3b --layers 8 --new-tokens 128 --variants greedy \
        --out /tmp/moe.json
    python3 bench/generate.py --smoke --shape cpu-tiny-moe --out /tmp/moe_smoke.json   # a tiny MoE on the CPU
    # FP8 rollout weights against bf16 on Llama-3-8B's shape, one method per process, with the kernel tables
    python3 bench/generate.py --shape llama3-8b --methods ours --batch 32 128 256 --new-tokens 128 \
        --variants greedy --out /tmp/fp8.json --append --profile-json /tmp/fp8_kernels.json
    python3 bench/generate.py --shape llama3-8b --methods ours-fp8 --batch 32 128 256 --new-tokens 128 \
        --variants greedy --out /tmp/fp8.json --append --profile-json /tmp/fp8_kernels.json
    # the same with the first and the last layer in bf16 (Megatron's first_last_layers_bf16), rows of their own
    python3 bench/generate.py --shape llama3-8b --methods ours-fp8 --fp8-layers-in-bf16 1 1 --batch 256 32 \
        --new-tokens 128 --variants greedy --out /tmp/fp8_first_last_bf16.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_table import append_rows, profile_decode, read_rows  # noqa: E402
from measure import copy_bandwidth, one_rank, timed  # noqa: E402
from shapes import SHAPES as _BENCH_SHAPES  # noqa: E402

from megatron_hybrid.megatron.models import GPTArchitecture  # noqa: E402
from megatron_hybrid.modes import WeightMode  # noqa: E402

SHAPES: dict[str, GPTArchitecture] = {
    "gpu-1b": _BENCH_SHAPES["gpu-1b"],  # 0.89 B parameters (Llama-shaped, GQA), 1.8 GB in bf16
    "llama3-8b": _BENCH_SHAPES["llama3-8b"],  # 8.03 B parameters, 16.1 GB in bf16
    "qwen2.5-7b": _BENCH_SHAPES["qwen2.5-7b"],  # 7.6 B parameters, 15.2 GB in bf16 (issue 45's rollout memory)
    "qwen3-30b-a3b": _BENCH_SHAPES["qwen3-30b-a3b"],  # 48 layers: 30.5 B parameters; --layers 8: 5.6 B
    "cpu-tiny": _BENCH_SHAPES["cpu-tiny"],
    # qwen3-30b-a3b in miniature (q/k norms, head dim != hidden / heads, top-k softmax, bf16): the MoE smoke.
    "cpu-tiny-moe": GPTArchitecture(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                    kv_channels=32, qk_layernorm=True, ffn_hidden_size=128, vocab_size=256,
                                    make_vocab_size_divisible_by=32, max_position_embeddings=512, norm_epsilon=1e-6,
                                    rotary_base=1000000, params_dtype="bfloat16", num_experts=16, moe_router_topk=4,
                                    moe_ffn_hidden_size=32),
}

#: Dense shapes initialised on the device rather than on the host (see :func:`build_model`).
DEVICE_INIT = ("llama3-8b", "qwen2.5-7b")

#: The issue's targets for a shape (at 128 new tokens): ratio name (as :func:`targets` names it) -> the least value.
TARGETS: dict[str, dict[str, float]] = {
    "qwen3-30b-a3b": {"ours/transformers B=32 N=128": 3.0, "ours/transformers B=128 N=128": 5.0,
                      "ours/roofline B=128 N=128": 0.35},
    # Issue 26 (FP8 rollout weights).
    "llama3-8b": {"ours-fp8/ours B=256 N=128": 1.3, "ours-fp8/ours B=32 N=128": 1.3},
}
#: Targets that are upper bounds, from the kernel tables (``--profile-json``): name -> the most value.
PROFILE_TARGETS: dict[str, dict[str, float]] = {
    "llama3-8b": {"ours kernel/matmul time per decode step B=256 N=128": 1.25},
}

VARIANTS = ("greedy", "top_p", "mixed", "mixed_prompt_heavy")


def prompts_of(count: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def digest(results: list) -> str:
    """SHA-256 of the generated tokens and log-probs (float32 bits) of one call, prompt by prompt."""
    h = hashlib.sha256()
    for r in results:
        h.update(torch.tensor(r.generated_tokens, dtype=torch.int64).numpy().tobytes())
        h.update(torch.tensor(r.generated_log_probs, dtype=torch.float32).numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()


# -------------------------------------------------------------------------------------------------------------


def build_model(arch: GPTArchitecture, device: torch.device, *, on_device: bool = False) -> torch.nn.Module:
    """``arch``'s GPTModel on ``device``, the same weights in every run (digests compare across commits). Dense
    shapes are initialised on the host and moved (their weights as in earlier runs), unless ``on_device``; a model
    with experts is initialised where it lives (megatron's host initialisation of qwen3-30b-a3b's 8 layers, 5.6 B
    parameters drawn in fp32, or of llama3-8b's 8 B, would take minutes)."""
    torch.manual_seed(1234)
    if arch.num_experts is None and not on_device:
        return arch.build().to(device)
    model = arch.build(arch.transformer_config(use_cpu_initialization=False))
    assert next(model.parameters()).device == device, (next(model.parameters()).device, device)
    return model.to(device)  # buffers megatron keeps on the host, if any


def moe_layers(chunk: torch.nn.Module) -> list[torch.nn.Module]:
    """The ``MoELayer`` of every layer of ``chunk`` that has one, in layer order."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [layer.mlp for layer in chunk.decoder.layers if isinstance(getattr(layer, "mlp", None), MoELayer)]


def moe_experts(chunk: torch.nn.Module) -> dict[str, Any]:
    """How the generator runs the routed experts of ``chunk`` (a rollout chunk, its MoE layers installed): per
    layer the path (``grouped_experts``: two grouped GEMMs over 3-D views of the experts' weights, graph-capturable;
    ``sequential_experts``: per expert, host syncs, no CUDA graphs), and where the fc1 weights lie: how many storages
    hold them and the distinct distances between consecutive experts' fc1 (elements; one value per layer is the
    uniform stride the views need)."""
    out: dict[str, Any] = {"paths": {}, "layers": []}
    for layer in moe_layers(chunk):
        path = layer.experts_path().__name__
        out["paths"][path] = out["paths"].get(path, 0) + 1
        fc1 = [e.linear_fc1.weight for e in layer.experts.local_experts]
        strides = sorted({b.data_ptr() - a.data_ptr() for a, b in zip(fc1, fc1[1:])})
        out["layers"].append({"path": path, "storages": len({w.untyped_storage().data_ptr() for w in fc1}),
                              "fc1_strides": [d // fc1[0].element_size() for d in strides],
                              "fc1_offset_bytes_mod_16": fc1[0].data_ptr() % 16})
    return out


def routed_experts(model: torch.nn.Module, sequences: list[list[int]], first: int, *,
                   rows_per_forward: int) -> list[float]:
    """Per MoE layer of ``model`` (one stage, megatron's own MoE layers): how many distinct experts a decode step of
    the whole batch routes its tokens to, averaged over the steps. Read from megatron's forward over the finished
    sequences (of equal length; ``rows_per_forward`` at a time), its routers' routing maps at positions ``first``
    to the one before the last: the tokens the decode steps ran (the last sampled token is never run)."""
    layers = moe_layers(model)
    length = len(sequences[0])
    union = [None] * len(layers)  # per layer [positions, E]: experts any sequence's token there was routed to

    def hook(i: int):
        def record(module, inputs, output):
            routing_map = output[1].view(length, -1, output[1].shape[-1])  # [S, b, E]: tokens are s-major
            seen = routing_map.any(dim=1)
            union[i] = seen if union[i] is None else union[i] | seen
        return record

    handles = [layer.router.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for lo in range(0, len(sequences), rows_per_forward):
                tokens = torch.tensor(sequences[lo: lo + rows_per_forward], device=device)
                positions = torch.arange(length, device=device).expand(tokens.shape[0], -1)
                model(tokens, positions, None)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return [float(u[first: length - 1].sum(dim=-1).float().mean()) for u in union]


def bench_ours(arch: GPTArchitecture, model: torch.nn.Module, device: torch.device, args, method: str = "ours", *,
               on_row: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """``method`` ``"ours"`` (the engine's ``--weight-mode``, training-dtype rollout weights) or ``"ours-fp8"``
    (canonical, FP8 rollout weights) on ``model`` (:func:`build_model`; its engine is closed at the end, so the
    next method gets the same model back). ``on_row`` is called with each row as it is made."""
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.inference import GenerationConfig, RolloutGenerator

    counts = param_counts(arch)
    assert sum(counts.values()) == sum(p.numel() for p in model.parameters()), (counts, "the roofline's count")
    fp8 = method == "ours-fp8"
    # Megatron's first_last_layers_bf16, which the engine reads at construction (those layers keep bf16 weights);
    # the model's own values come back after it
    config = model.config
    fields = ("first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")
    saved = [getattr(config, f) for f in fields]
    first, last = args.fp8_layers_in_bf16 if fp8 else (0, 0)
    for field, value in zip(fields, (bool(first or last), first, last)):
        setattr(config, field, value)
    try:
        engine = HybridEngine(model, RolloutLayout(1, 1), weight_mode="canonical" if fp8 else args.weight_mode,
                              rollout_weights="fp8" if fp8 else "model", bucket_size_mb=args.bucket_size_mb)
    finally:
        for field, value in zip(fields, saved):
            setattr(config, field, value)
    P, vocab = args.prompt_len, arch.vocab_size
    longest = 7 * P // 4 + max(max(args.new_tokens), 2 * args.new_tokens[0])
    moe = arch.num_experts is not None
    finished: dict[int, list[list[int]]] = {}  # per batch: the greedy sequences (first N), for routed_experts
    rows = []
    for B in args.batch:
        config = GenerationConfig(max_batch_size=B, max_sequence_length=longest,
                                  fused_decoder={"on": True, "off": False}.get(args.fused_decoder),
                                  **({} if args.graph_pool_gib is None else {"graph_pool_gib": args.graph_pool_gib}))
        generator = RolloutGenerator(engine, config)
        order = torch.randperm(vocab, generator=torch.Generator().manual_seed(1)).tolist()
        variants = [("greedy", N, prompts_of(B, P, P, vocab, 10), SamplingParams(top_k=1, num_tokens_to_generate=N),
                     []) for N in args.new_tokens]
        n0 = args.new_tokens[0]
        variants.append(("top_p", n0, prompts_of(B, P, P, vocab, 10),
                         SamplingParams(temperature=1.0, top_p=0.9, num_tokens_to_generate=n0), []))
        mixed_prompts = prompts_of(4 * B, max(1, P // 4), 7 * P // 4, vocab, 11)
        variants.append(("mixed", 2 * n0, mixed_prompts,
                         SamplingParams(temperature=1.0, top_p=0.9, num_tokens_to_generate=2 * n0),
                         order[: max(1, vocab // 160)]))
        variants.append(("mixed_prompt_heavy", n0, mixed_prompts,
                         SamplingParams(temperature=1.0, top_p=0.9, num_tokens_to_generate=n0),
                         order[: max(1, vocab // 64)]))
        variants = [v for v in variants if v[0] in args.variants]
        for variant, N, prompts, params, stop_ids in variants:
            digests: list[str] = []

            def run():
                out = generator.generate(prompts, params, vocab_size=vocab, stop_token_ids=stop_ids, seed=5)
                digests.append(digest(out))
                return out

            before = generator.report()
            out, times = timed(run, device, runs=args.runs, warmup=args.warmup)
            tokens = sum(len(r.generated_tokens) for r in out)
            rep = generator.report()
            # Per call: the counters are the generator's totals.
            per_call = {key: (rep[key] - before[key]) / (args.runs + args.warmup) for key in
                        ("decode_steps", "mixed_steps", "prefill_forwards", "prefill_graph_forwards", "dropped_rows",
                         "idle_slot_steps", "slot_moves")}
            rows.append({"method": method, "variant": variant, "batch": B, "new_tokens": N, "prompt_len": P,
                         "num_prompts": len(prompts), "tokens": tokens, "mean_new_tokens": tokens / len(prompts),
                         "prompt_tokens_per_new_token": sum(map(len, prompts)) / tokens,
                         "tok_s": tokens / statistics.median(times), "seconds": statistics.median(times),
                         "runs": times, "cuda_graph_captures": rep["cuda_graph_captures"],
                         "per_call": per_call, "attention_reads_lengths": rep["attention_reads_lengths"],
                         "overlap_host": rep["overlap_host"], "kv_cache_bytes": rep["kv_cache_bytes"],
                         "fused_decoder": rep.get("fused_decoder"),  # (a generator that reports it)
                         "digest": digests[-1], **({"digests": digests} if len(set(digests)) > 1 else {})})
            report = engine.communication_report()  # rolling out: the rollout weights' bytes now
            rows[-1].update(weight_mode=engine.weight_mode, rollout_weights=engine.rollout_weights,
                            fp8_layers_in_bf16=report["fp8_layers_in_bf16"],
                            **{k: report[k] for k in ("fp8_bytes_mapped", "canonical_bytes_mapped",
                                                      "switch_peak_bytes_mapped") if k in report})
            if moe:
                rows[-1]["moe_experts"] = moe_experts(engine.rollout_chunks[0])
                if (variant, N) == ("greedy", n0):
                    finished[B] = [list(p) + list(r.generated_tokens) for p, r in zip(prompts, out)]
            print(json.dumps(rows[-1]), flush=True)
            on_row(rows[-1])
            if args.profile and device.type == "cuda" and variant in args.profile:
                profile(run, f"{variant} B={B} N={N}")
            if args.profile_json and device.type == "cuda" and (variant, N) == ("greedy", n0):
                table = profile_decode(run, generator, num_layers=arch.num_layers)
                append_rows(args.profile_json, [{"method": method, "batch": B, "shape": args.shape,
                                                 "fused_decoder": generator.report().get("fused_decoder"),
                                                 "layers": arch.num_layers, "variant": variant, "new_tokens": N,
                                                 "prompt_len": P, **table}])
                print(json.dumps({k: v for k, v in table.items() if k not in ("kernels", "matmul_kernel_names")}
                                 | {"method": method, "batch": B, "profile_json": args.profile_json}), flush=True)
        generator.close()
    engine.switch_to_training()
    for B, sequences in finished.items():  # on the training model: the same weights (one rank, no resharding)
        per_layer = routed_experts(model, sequences, P, rows_per_forward=args.routing_rows)
        for row in rows:
            if (row["variant"], row["batch"], row["new_tokens"]) == ("greedy", B, args.new_tokens[0]):
                row["routed_experts"] = {"mean": statistics.fmean(per_layer), "per_layer": per_layer,
                                         "decode_steps": len(sequences[0]) - P - 1}
                print(json.dumps({"batch": B, "routed_experts": row["routed_experts"]}), flush=True)
    engine.close()
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def profile(fn: Callable[[], Any], title: str) -> None:
    """Print where one call's device time goes: the kernels with the most CUDA time (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"== profile: {title}", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60),
          flush=True)


def hf_model(arch: GPTArchitecture, device: torch.device) -> torch.nn.Module:
    """transformers' model of ``arch`` with random weights, made on ``device`` in ``arch``'s dtype:
    ``LlamaForCausalLM`` for a dense shape, ``Qwen3MoeForCausalLM`` for an MoE (every layer MoE, no shared expert,
    top-k softmax: its ``norm_topk_prob``). Its defaults otherwise (attention and experts implementation)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(hidden_size=arch.hidden_size, num_hidden_layers=arch.num_layers,
                  num_attention_heads=arch.num_attention_heads,
                  num_key_value_heads=arch.num_query_groups or arch.num_attention_heads,
                  head_dim=arch.kv_channels or arch.hidden_size // arch.num_attention_heads,
                  vocab_size=arch.vocab_size, max_position_embeddings=arch.max_position_embeddings,
                  rms_norm_eps=arch.norm_epsilon, rope_theta=float(arch.rotary_base),
                  tie_word_embeddings=not arch.untie_embeddings_and_output_weights)
    if arch.num_experts is None:
        cls, config = LlamaForCausalLM, LlamaConfig(intermediate_size=arch.ffn_hidden_size, **common)
    else:
        if (arch.moe_shared_expert_intermediate_size is not None or arch.moe_router_score_function != "softmax"
                or arch.moe_router_pre_softmax or 0 in arch.moe_layer_pattern() or not arch.qk_layernorm):
            raise ValueError("transformers' side of an MoE shape is Qwen3-MoE: q/k norms, every layer MoE, top-k "
                             "softmax, no shared expert")
        cls = Qwen3MoeForCausalLM
        config = Qwen3MoeConfig(intermediate_size=arch.ffn_hidden_size or 4 * arch.hidden_size,
                                moe_intermediate_size=arch.moe_ffn_hidden_size or arch.ffn_hidden_size,
                                num_experts=arch.num_experts, num_experts_per_tok=arch.moe_router_topk,
                                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **common)
    torch.manual_seed(0)
    with torch.device(device):
        return cls._from_config(config, dtype=arch.dtype).eval()


def bench_transformers(arch: GPTArchitecture, device: torch.device, args) -> list[dict]:
    try:
        import transformers
        model = hf_model(arch, device)
    except ImportError as exc:
        print(f"transformers rows skipped: {exc}", file=sys.stderr)
        return []
    hf_params = sum(p.numel() for p in model.parameters())
    assert hf_params == sum(param_counts(arch).values()), (hf_params, param_counts(arch), "the same shape")
    moe = arch.num_experts is not None
    # What the experts ran, by forward kind: transformers 5.24 switches grouped_mm to batched_mm while decoding on a
    # GPU (``_optimize_model_for_decode``). getattr: the experts module and its setting are transformers 5's (the
    # device's transformers is not this machine's).
    seen: dict[str, dict[str, int]] = {}
    experts = getattr(model.model.layers[0].mlp, "experts", None) if moe else None
    if experts is not None:
        def record(module, inputs):
            kind = "prefill" if inputs[0].shape[0] > B else "decode"  # [tokens, hidden]: one per row when decoding
            impl = str(getattr(model.config, "_experts_implementation", None))
            seen.setdefault(kind, {}).setdefault(impl, 0)
            seen[kind][impl] += 1

        experts.register_forward_pre_hook(record)
    rows = []
    for B in args.batch:
        for N in args.new_tokens:
            ids = torch.randint(0, arch.vocab_size, (B, args.prompt_len), device=device)
            digests: list[str] = []

            def run():
                with torch.no_grad():
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                                         min_new_tokens=N, do_sample=False, pad_token_id=0)
                digests.append(hashlib.sha256(out[:, args.prompt_len:].cpu().numpy().tobytes()).hexdigest())
                return out

            seen.clear()
            out, times = timed(run, device, runs=args.transformers_runs, warmup=args.warmup)
            tokens = B * (out.shape[1] - args.prompt_len)
            rows.append({"method": "transformers", "variant": "greedy", "batch": B, "new_tokens": N,
                         "prompt_len": args.prompt_len, "tokens": tokens, "tok_s": tokens / statistics.median(times),
                         "seconds": statistics.median(times), "runs": times,
                         "attn_implementation": model.config._attn_implementation,
                         "transformers": transformers.__version__, "digest": digests[-1],
                         **({"digests": digests} if len(set(digests)) > 1 else {})})
            if moe:
                rows[-1].update(experts_implementation=getattr(model.config, "_experts_implementation", None),
                                experts_class=type(experts).__name__ if experts is not None else None,
                                experts_implementation_per_forward={k: dict(v) for k, v in seen.items()})
            print(json.dumps(rows[-1]), flush=True)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def param_counts(arch: GPTArchitecture) -> dict[str, int]:
    """Parameters of the GPTModel ``arch`` builds (no linear biases besides an optional QKV bias), by what a decode
    step reads of them: ``embedding``, ``output`` (an untied output layer), ``routed_experts`` (all of them) and
    ``rest`` (attention, norms, dense MLPs, routers, shared experts)."""
    H, V = arch.hidden_size, arch.padded_vocab_size(1)
    heads = arch.num_attention_heads
    groups, d = arch.num_query_groups or heads, arch.kv_channels or H // heads
    qkv = (heads + 2 * groups) * d
    norm = 2 if arch.normalization == "LayerNorm" else 1  # LayerNorm has a bias
    glu = 2 if arch.swiglu else 1
    attention = H * qkv + (qkv if arch.add_qkv_bias else 0) + heads * d * H + (2 * d * norm if arch.qk_layernorm
                                                                               else 0)
    rest, experts = H * norm, 0  # the final norm
    for is_moe in arch.moe_layer_pattern():
        rest += attention + 2 * H * norm  # the two norms of the layer
        if not is_moe:
            F = arch.ffn_hidden_size or 4 * H
            rest += (glu + 1) * H * F
            continue
        rest += arch.num_experts * H  # the router
        experts += arch.num_experts * (glu + 1) * H * (arch.moe_ffn_hidden_size or arch.ffn_hidden_size or 4 * H)
        shared = arch.moe_shared_expert_intermediate_size
        if shared is not None:
            rest += (glu + 1) * H * shared + (H if arch.moe_shared_expert_gate else 0)
    return {"embedding": V * H, "output": V * H if arch.untie_embeddings_and_output_weights else 0,
            "routed_experts": experts, "rest": rest}


def distinct_experts(E: int, k: int, B: int) -> float:
    """Expected distinct experts of B tokens routed uniformly to k of E experts each."""
    return E * (1 - (1 - k / E) ** B)


def roofline_rows(arch: GPTArchitecture, device: torch.device, args, measured: list[dict]) -> list[dict]:
    counts = param_counts(arch)
    size = arch.dtype.itemsize
    heads = arch.num_query_groups or arch.num_attention_heads
    head_dim = arch.kv_channels or arch.hidden_size // arch.num_attention_heads
    kv_bytes = 2 * arch.num_layers * heads * head_dim * size  # per position of one sequence
    bandwidth = copy_bandwidth(device, args.bandwidth_bytes)
    moe_layers_ = sum(arch.moe_layer_pattern())
    expert_bytes = counts["routed_experts"] // max(1, moe_layers_ * (arch.num_experts or 1)) * size  # one expert
    rows = []
    for B in args.batch:
        for N in args.new_tokens:
            positions = args.prompt_len + N / 2
            row: dict[str, Any] = {}
            weight_bytes = (counts["embedding"] + counts["output"] + counts["rest"]) * size
            if moe_layers_:
                routed = [r["routed_experts"]["mean"] for r in measured if r["method"] == "ours"
                          and r.get("routed_experts") and (r["batch"], r["new_tokens"]) == (B, N)]
                distinct = routed[-1] if routed else distinct_experts(arch.num_experts, arch.moe_router_topk, B)
                row.update(distinct_experts=distinct, distinct_experts_source="measured (ours, megatron's routing)"
                           if routed else "uniform routing: E(1-(1-k/E)^B)",
                           distinct_experts_uniform=distinct_experts(arch.num_experts, arch.moe_router_topk, B),
                           expert_bytes=expert_bytes, non_expert_bytes=weight_bytes,
                           embedding_bytes=counts["embedding"] * size)
                weight_bytes += distinct * moe_layers_ * expert_bytes
            step = (weight_bytes + positions * kv_bytes * B) / bandwidth
            rows.append({"method": "roofline", "variant": "greedy", "batch": B, "new_tokens": N,
                         "prompt_len": args.prompt_len, "tok_s": B / step, "weight_bytes": weight_bytes,
                         "kv_bytes_per_position": kv_bytes, "mean_positions": positions,
                         "copy_bandwidth_bytes_s": bandwidth, **row})
    return rows


def side_by_side(rows: list[dict], args) -> str:
    """Greedy tok/s of each method per batch (the first N), and ours' ratios, as a text table."""
    def tok_s(method: str, B: int) -> Optional[float]:
        found = [r["tok_s"] for r in rows if (r["method"], r["variant"], r["batch"], r["new_tokens"])
                 == (method, "greedy", B, args.new_tokens[0])]
        return found[-1] if found else None

    lines = [f"greedy, {args.prompt_len}-token prompts, {args.new_tokens[0]} new tokens (tok/s)",
             "batch  ours  ours-fp8  transformers  roofline  ours/transformers  ours/roofline  ours-fp8/ours"]
    for B in args.batch:
        ours, fp8, hf, roof = (tok_s(m, B) for m in ("ours", "ours-fp8", "transformers", "roofline"))
        cells = [f"{v:,.0f}" if v else "-" for v in (ours, fp8, hf, roof)]
        cells += [f"{ours / v:.2f}" if ours and v else "-" for v in (hf, roof)]
        cells.append(f"{fp8 / ours:.2f}" if fp8 and ours else "-")
        lines.append(f"{B}  " + "  ".join(cells))
    return "\n".join(lines)


def targets(rows: list[dict], args) -> dict[str, float]:
    """The issue's ratios, from the rows."""
    def tok_s(method: str, variant: str, B: int, N: int) -> Optional[float]:
        found = [r["tok_s"] for r in rows if (r["method"], r["variant"], r["batch"], r["new_tokens"])
                 == (method, variant, B, N)]
        return found[-1] if found else None

    out = {}
    n0 = args.new_tokens[0]
    for B in args.batch:
        ours = tok_s("ours", "greedy", B, n0)
        fp8 = tok_s("ours-fp8", "greedy", B, n0)
        if fp8 and ours:
            out[f"ours-fp8/ours B={B} N={n0}"] = fp8 / ours
        for name, other in (("transformers", tok_s("transformers", "greedy", B, n0)),
                            ("roofline", tok_s("roofline", "greedy", B, n0))):
            if ours and other:
                out[f"ours/{name} B={B} N={n0}"] = ours / other
        for variant, base in (("mixed", "top_p"), ("mixed_prompt_heavy", "top_p"), ("top_p", "greedy")):
            a, b = tok_s("ours", variant, B, 2 * n0 if variant == "mixed" else n0), tok_s("ours", base, B, n0)
            if a and b:
                out[f"ours {variant}/{base} B={B} N={n0}"] = a / b
        for N in args.new_tokens[1:]:
            a = tok_s("ours", "greedy", B, N)
            if a and ours:
                out[f"ours N={N}/N={n0} B={B}"] = a / ours
    return out


def profile_targets(rows: list[dict], args) -> dict[str, float]:
    """From the kernel tables (``--profile-json`` rows of this shape): each method's kernel time over its matmul
    time per decode step, per batch."""
    out = {}
    for r in rows:
        if r.get("total_over_matmul") is not None and r["new_tokens"] == args.new_tokens[0]:
            out[f"{r['method']} kernel/matmul time per decode step B={r['batch']} N={r['new_tokens']}"] = \
                r["total_over_matmul"]
            if r.get("total_over_matmul_and_attention") is not None:
                out[f"{r['method']} kernel/(matmul+attention) time per decode step B={r['batch']} "
                    f"N={r['new_tokens']}"] = r["total_over_matmul_and_attention"]
    return out


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: gpu-1b (cpu-tiny with --smoke)")
    ap.add_argument("--layers", type=int, default=None, help="the shape's depth cut (or grown) to this many layers")
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="decode slots (default 32 128)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128")
    ap.add_argument("--new-tokens", type=int, nargs="+", default=None, help="the first is the reference (128 512)")
    ap.add_argument("--methods", nargs="+", choices=["ours", "ours-fp8", "transformers", "roofline"],
                    default=["ours", "transformers", "roofline"])
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="ours' variants")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--transformers-runs", type=int, default=None, help="timed transformers calls (default --runs)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--weight-mode", choices=[m.value for m in WeightMode], default=WeightMode.ALIASED.value,
                    help="ours' engine")
    ap.add_argument("--bucket-size-mb", type=float, default=None, help="ours' engine (default: the engine's)")
    ap.add_argument("--fused-decoder", choices=["default", "on", "off"], default="default",
                    help="GenerationConfig.fused_decoder of ours (off: megatron-core's layer forward, the kernels "
                         "before the fusion; write those rows to files of their own)")
    ap.add_argument("--graph-pool-gib", type=float, default=None,
                    help="GenerationConfig.graph_pool_gib of ours (default: GenerationConfig's)")
    ap.add_argument("--routing-rows", type=int, default=16,
                    help="sequences per forward when reading an MoE's routing over ours' greedy sequences")
    ap.add_argument("--bandwidth-bytes", type=int, default=2**31, help="size of the copy that measures bandwidth")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (gloo): checks the bench runs")
    ap.add_argument("--out", required=True, help="JSON list of rows")
    ap.add_argument("--append", action="store_true",
                    help="add the rows to those in --out (if it exists); targets over all of them")
    ap.add_argument("--fp8-layers-in-bf16", nargs=2, type=int, default=[0, 0], metavar=("FIRST", "LAST"),
                    help="ours-fp8: the first FIRST and last LAST layers keep bf16 rollout weights (Megatron's "
                    "first_last_layers_bf16); write these rows to their own --out")
    ap.add_argument("--profile", nargs="*", default=[], choices=VARIANTS,
                    help="print a torch.profiler table of one more call of these variants (GPU)")
    ap.add_argument("--profile-json", default=None,
                    help="ours' and ours-fp8's decode kernel tables (one more greedy call per batch) added to this "
                         "JSON list (GPU; skipped on the CPU)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    args.shape = args.shape or ("cpu-tiny" if smoke else "gpu-1b")
    args.batch = args.batch or ([4] if smoke else [32, 128])
    args.prompt_len = args.prompt_len or (16 if smoke else 128)
    args.new_tokens = args.new_tokens or ([8, 16] if smoke else [128, 512])
    if smoke:
        args.runs, args.warmup, args.bandwidth_bytes = 1, 1, 2**26
    args.transformers_runs = args.transformers_runs or args.runs
    device = torch.device("cpu") if smoke or not torch.cuda.is_available() else torch.device("cuda", 0)
    arch = SHAPES[args.shape]
    if args.layers is not None:
        if arch.num_experts is not None and not isinstance(arch.moe_layer_freq, int):
            raise ValueError(f"--layers on {args.shape}: its moe_layer_freq lists every layer")
        arch = dataclasses.replace(arch, num_layers=args.layers)
    if args.profile_json and device.type != "cuda":
        print(f"--profile-json {args.profile_json}: skipped on the CPU (the kernel tables need CUDA)", flush=True)
        args.profile_json = None

    earlier = json.loads(Path(args.out).read_text()) if args.append and Path(args.out).exists() else []
    meta = {"shape": args.shape, "layers": arch.num_layers, "parameters": sum(param_counts(arch).values()),
            "dtype": arch.params_dtype, "device": torch.cuda.get_device_name(device)
            if device.type == "cuda" else platform.processor() or "cpu", "torch": torch.__version__,
            "command": " ".join(["python3"] + sys.argv)}
    rows: list[dict] = []

    def save() -> None:  # after every row of ours, too: a run cut short by its time limit keeps what it measured
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(earlier + [dict(r, **meta) for r in rows], indent=1) + "\n")

    def add(row: dict) -> None:
        rows.append(row)
        save()

    with one_rank(device):
        ours = [m for m in ("ours", "ours-fp8") if m in args.methods]
        if ours:
            model = build_model(arch, device, on_device=args.shape in DEVICE_INIT)  # once: the same weights for both
            for method in ours:
                bench_ours(arch, model, device, args, method, on_row=add)
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        save()  # an MoE's greedy rows got their routed experts at the end
        if "roofline" in args.methods:
            same = [r for r in earlier if (r.get("shape"), r.get("layers")) == (args.shape, arch.num_layers)]
            rows += roofline_rows(arch, device, args, measured=same + rows)
    if "transformers" in args.methods:
        rows += bench_transformers(arch, device, args)
    save()
    rows = earlier + [dict(r, **meta) for r in rows]
    mine = [r for r in rows if (r.get("shape"), r.get("layers")) == (args.shape, arch.num_layers)]
    ratios = targets(mine, args)
    print(json.dumps({"targets": ratios, "out": args.out}, indent=1))
    print(side_by_side(mine, args))
    for name, least in TARGETS.get(args.shape, {}).items():
        value = ratios.get(name)
        verdict = "not measured" if value is None else f"{value:.3f}: {'met' if value >= least else 'MISSED'}"
        print(f"target {name} >= {least}: {verdict}")
    if args.profile_json:
        tables = [r for r in read_rows(args.profile_json)
                  if (r.get("shape"), r.get("layers")) == (args.shape, arch.num_layers)]
        bounds = profile_targets(tables, args)
        print(json.dumps({"kernel_tables": bounds, "profile_json": args.profile_json}, indent=1))
        for name, most in PROFILE_TARGETS.get(args.shape, {}).items():
            value = bounds.get(name)
            verdict = "not measured" if value is None else f"{value:.3f}: {'met' if value <= most else 'MISSED'}"
            print(f"target {name} <= {most}: {verdict}")


if __name__ == "__main__":
    main()
