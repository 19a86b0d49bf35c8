"""FP8 rollout weights on one GPU, one rank: exact quantization and bit-exact decode graphs (issue 26, acceptance 3).
Not collected by pytest (needs a GPU for most of it; ``--smoke`` runs the CPU part).

    python3 tests/gpu_fp8.py --output /tmp/gpu_fp8.json      # one GPU
    python3 tests/gpu_fp8.py --smoke                          # the CPU part (part 1 on the CPU; 2 to 4 skipped)

A small Llama-shaped bf16 model (4 layers, hidden 1024, 16 heads / 8 KV groups, ffn 2816, vocabulary 32,000: every
dimension a multiple of 16, as ``torch._scaled_mm`` wants) in a ``HybridEngine(..., weight_mode="canonical",
rollout_weights="fp8")`` (rollout layout TP = PP = 1). Checked:

1. quantization: after the first switch, and again after an optimizer step (a real forward and backward, then
   ``torch.optim.SGD`` in place on the training parameters, then the next switch), every FP8 weight of the rollout
   model and its scales equal :func:`megatron_hybrid.quant.fp8.quantize_reference` of its training weight, bit for bit
   (the FP8 bytes compared as ``uint8``, the fp32 scales exactly), computed on the GPU and computed on the CPU from
   the same weights moved there; exactly the :func:`~megatron_hybrid.quant.fp8.is_target` weights are FP8; and the step
   changed every FP8 weight (else the second check would prove nothing).
2. FP8 decode graphs replay an eager FP8 run bit for bit, at two levels:

   - a generation: the same greedy call (8 prompts of 64 tokens on 8 slots, 32 new tokens, log-probs) on a
     generator with ``cuda_graphs=False`` and then on one with ``cuda_graphs=True`` (twice: the call that captures
     the graphs and one that only replays them) gives the same tokens and log-probs, exactly. The prompts fill the
     graph prefill's rectangle (8 rows of 64 tokens, a multiple of the prefill granule) and the slots fill the decode
     batch bucket, so the graph steps compute exactly the eager steps' shapes: no padding to explain a difference
     (and 96 positions per slot keep decode attention in one program per slot, whatever the step's length bound);
   - each graph step: for every captured graph (decode and prefill), the replayed logits equal an eager run of the
     same step from the same state (inputs and cache), bit for bit (as tests/gpu_inference.py checks bf16 steps).
3. the same two for the training dtype (``rollout_weights="model"``), the control.
4. FP8 with the first and the last layer in bf16 (Megatron's ``first_last_layers_bf16`` in the model's config):
   exactly the other layers' weights are FP8, equal to ``quantize_reference``; its graphs replay eager runs bit
   for bit. The fused decoder then hands a pre-quantized input only to the FP8 layers' linears.

Prints one JSON summary; exits 1 when a check fails. ``--output PATH`` writes it too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import sys
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NUM_PROMPTS, PROMPT_LEN, NEW_TOKENS = 8, 64, 32


def _arch(smoke: bool):
    from megatron_hybrid.megatron.models import GPTArchitecture, tiny_llama

    if smoke:
        return tiny_llama(params_dtype="bfloat16")
    return GPTArchitecture(num_layers=4, hidden_size=1024, num_attention_heads=16, num_query_groups=8,
                           ffn_hidden_size=2816, vocab_size=32000, params_dtype="bfloat16",
                           max_position_embeddings=4096)


# ---- 1. quantization ---------------------------------------------------------------------------------------------

def _fp8_bytes(engine) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every FP8 weight of the rollout model and its scales, copied to the host, by global name."""
    from megatron_hybrid.reshard.binding import named_parameters

    out = {}
    for name, param in named_parameters(engine.rollout_chunks):
        entry = engine.binding.fp8.get(param)
        if entry is not None:
            # clone: on the CPU, .cpu() is the tensor itself, which the next switch overwrites
            out[name] = (entry[0].view(torch.uint8).cpu().clone(), entry[1].cpu().clone())
    return out


def check_quantization(engine) -> dict[str, Any]:
    """The rollout model's FP8 weights (engine rolling out) against ``quantize_reference`` of the training weights
    (rollout TP = 1: the whole tensors, under the same names) on their device and on the CPU."""
    from megatron_hybrid.quant.fp8 import is_target, quantize_reference
    from megatron_hybrid.reshard.binding import named_parameters

    train = dict(named_parameters(engine.modules))
    on_gpu = engine.device.type == "cuda"
    wrong_set, device_mismatch, cpu_mismatch, compared = [], [], [], 0
    for name, param in named_parameters(engine.rollout_chunks):
        entry = engine.binding.fp8.get(param)
        if (entry is not None) != is_target(name, layers=engine.fp8_layers):
            wrong_set.append(name)
            continue
        if entry is None:
            continue
        compared += 1
        got_q, got_s = entry[0].view(torch.uint8).cpu(), entry[1].cpu()
        weight = train[name].detach()
        references = [("cpu", quantize_reference(weight.cpu()), cpu_mismatch)]
        if on_gpu:
            references.append(("device", quantize_reference(weight), device_mismatch))
        for _, (want_q, want_s), bad in references:
            if not (torch.equal(got_q, want_q.view(torch.uint8).cpu()) and torch.equal(got_s, want_s.cpu())):
                bad.append(name)
    return {"compared": compared, "fp8_set_wrong": wrong_set, "device_reference_mismatches": device_mismatch,
            "cpu_reference_mismatches": cpu_mismatch, "device_reference": "on the GPU" if on_gpu else "skipped (CPU)"}


def optimizer_step(model: torch.nn.Module, vocab: int, device: torch.device) -> None:
    """One real training step: forward, backward, ``torch.optim.SGD`` in place (the engine's storage stays). Each
    parameter's learning rate makes its update 5 % of its mean magnitude: a random model's gradients are so small
    that a plain step would leave most per-row FP8 values (3 mantissa bits) as they were."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (2, 32), generator=g).to(device)
    positions = torch.arange(32, device=device).expand(2, -1)
    model.zero_grad(set_to_none=True)
    model(tokens, positions, None).float().square().mean().backward()
    params = [p for p in model.parameters() if p.grad is not None]
    groups = [{"params": [p], "lr": 0.05 * float(p.detach().float().abs().mean())
               / max(float(p.grad.float().abs().mean()), 1e-30)} for p in params]
    opt = torch.optim.SGD(groups, lr=0.0)
    with torch.no_grad():
        opt.step()
    model.zero_grad(set_to_none=True)


def part_quantization(model, vocab: int, device: torch.device) -> dict[str, Any]:
    from megatron_hybrid import HybridEngine, RolloutLayout

    engine = HybridEngine(model, RolloutLayout(1, 1), weight_mode="canonical", rollout_weights="fp8")
    try:
        engine.switch_to_rollout()
        first = check_quantization(engine)
        before = _fp8_bytes(engine)
        engine.switch_to_training()
        optimizer_step(model, vocab, device)
        engine.switch_to_rollout()
        second = check_quantization(engine)
        after = _fp8_bytes(engine)
        engine.switch_to_training()
    finally:
        engine.close()
    unchanged = [n for n in before if torch.equal(before[n][0], after[n][0])]
    checks = {
        "quantization_exact_first_switch": _clean(first),
        "quantization_exact_after_step": _clean(second),
        "step_changed_every_fp8_weight": not unchanged and len(before) == len(after) > 0,
    }
    return {"checks": checks, "first_switch": first, "after_step": second, "unchanged_by_step": unchanged}


def _clean(result: dict) -> bool:
    return result["compared"] > 0 and not (result["fp8_set_wrong"] or result["device_reference_mismatches"]
                                           or result["cpu_reference_mismatches"])


# ---- 2. and 3. graphs against eager ------------------------------------------------------------------------------

def check_graph_steps(generator, vocab: int) -> dict[str, dict]:
    """Every captured decode and prefill graph: replayed logits against an eager run of the same step (same inputs,
    same cache), bit for bit."""
    runner = generator.replica.runner
    out = {}
    with torch.no_grad(), runner.cache.backed(), runner.graphs.backed():
        for key in runner.graphs.keys():
            kind, rows, length, _ = key[:4]
            g = torch.Generator(device="cuda").manual_seed(1000 + rows + length)
            if kind == "decode":
                runner.slot_tokens[:rows] = torch.randint(0, vocab, (rows,), generator=g, device="cuda")
                runner.slot_positions[:rows] = torch.randint(0, PROMPT_LEN + NEW_TOKENS, (rows,), generator=g,
                                                             device="cuda")
                runner.slot_running[:rows] = 1
            elif kind == "prefill":
                n = min(rows, runner.geometry.num_slots)
                prompts = torch.randint(0, vocab, (n, length), generator=g, device="cuda").tolist()
                runner.stage_prefill(rows, length, prompts, list(range(n)))
            else:
                out[f"{kind}:{rows}x{length}"] = {"bit_exact": False, "error": f"no check written for {key}"}
                continue
            captures = runner.graphs.captures
            replayed = runner.graphs.run(key, runner.graph_step(key))[0].clone()
            eager = runner.graph_step(key)()[0]
            assert runner.graphs.captures == captures, "the check must replay an existing graph"
            out[f"{kind}:{rows}x{length}"] = {"bit_exact": bool(torch.equal(replayed, eager)),
                                             "max_abs_diff": float((replayed.float() - eager.float()).abs().max())}
        runner.slot_running.zero_()
        runner.slot_positions.zero_()
    return out


def _first_difference(a: list, b: list) -> Optional[dict]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            j = next(k for k, (u, v) in enumerate(zip(x, y)) if u != v) if len(x) == len(y) else None
            return {"prompt": i, "position": j}
    return None if len(a) == len(b) else {"prompts": (len(a), len(b))}


def part_graphs(model, vocab: int, rollout_weights: str) -> dict[str, Any]:
    """Greedy generation eager and from graphs on a canonical engine with ``rollout_weights``; every graph step
    against an eager run of it."""
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.inference import GenerationConfig, RolloutGenerator

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(NUM_PROMPTS)]
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS, return_log_probs=True)
    engine = HybridEngine(model, RolloutLayout(1, 1), weight_mode="canonical", rollout_weights=rollout_weights)
    calls, steps, report = {}, {}, {}
    try:
        for graphs in (False, True):
            config = GenerationConfig(max_batch_size=NUM_PROMPTS, max_sequence_length=PROMPT_LEN + NEW_TOKENS,
                                      cuda_graphs=graphs)
            generator = RolloutGenerator(engine, config)
            try:
                for i in range(2 if graphs else 1):
                    results = generator.generate(prompts, greedy, vocab_size=vocab, seed=5)
                    calls[f"{'graphs' if graphs else 'eager'}{i}"] = (
                        [r.generated_tokens for r in results], [r.generated_log_probs for r in results])
                if graphs:
                    steps = check_graph_steps(generator, vocab)
                report[f"graphs={graphs}"] = {k: generator.report()[k] for k in (
                    "cuda_graph_captures", "cuda_graph_replays", "decode_steps", "prefill_forwards",
                    "prefill_graph_forwards", "attention_reads_lengths")}
            finally:
                generator.close()
            engine.switch_to_training()
    finally:
        engine.close()
    eager = calls["eager0"]
    compared = {name: {"tokens_equal": calls[name][0] == eager[0], "log_probs_equal": calls[name][1] == eager[1],
                       "first_token_difference": _first_difference(calls[name][0], eager[0]),
                       "first_log_prob_difference": _first_difference(calls[name][1], eager[1])}
                for name in ("graphs0", "graphs1")}
    decode_keys = [k for k in steps if k.startswith("decode:")]
    checks = {
        "generation_graphs_equal_eager": all(c["tokens_equal"] and c["log_probs_equal"] for c in compared.values()),
        "graph_steps_bit_exact": bool(decode_keys) and all(s["bit_exact"] for s in steps.values()),
    }
    return {"rollout_weights": rollout_weights, "checks": checks, "generation": compared, "graph_steps": steps,
            "generator_reports": report, "first_tokens": eager[0][0][:8]}


# ---- the run -----------------------------------------------------------------------------------------------------

def run(smoke: bool) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    device = torch.device("cpu") if smoke or not torch.cuda.is_available() else torch.device("cuda", 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1, timeout=datetime.timedelta(minutes=10))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        shim = nullcontext()
    else:
        from megatron_hybrid.megatron.patches import cpu_gloo

        shim = cpu_gloo()
    summary: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                               "torch": torch.__version__, "skipped": []}
    try:
        with shim:
            ps.initialize_model_parallel(1, 1)
            # megatron-core's default RNG tracker cannot be captured (its fork() reseeds); the inference one can.
            model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)
            arch = _arch(smoke)
            torch.manual_seed(1234)
            model = arch.build().to(device)
            summary["quantization"] = part_quantization(model, arch.vocab_size, device)
            checks = dict(summary["quantization"]["checks"])
            if device.type == "cuda":
                for weights in ("fp8", "model"):
                    part = part_graphs(model, arch.vocab_size, weights)
                    summary[f"{weights}_graphs"] = part
                    checks.update({f"{weights}: {k}": v for k, v in part["checks"].items()})
                config = model.config  # part 4: Megatron's first_last_layers_bf16, read by the engine
                config.first_last_layers_bf16 = True
                config.num_layers_at_start_in_bf16 = config.num_layers_at_end_in_bf16 = 1
                try:
                    quantized = part_quantization(model, arch.vocab_size, device)
                    graphs = part_graphs(model, arch.vocab_size, "fp8")
                finally:
                    config.first_last_layers_bf16 = False
                summary["fp8_first_last_bf16"] = {"quantization": quantized, "graphs": graphs}
                checks.update({f"fp8 first+last bf16: {k}": v for k, v in quantized["checks"].items()})
                checks.update({f"fp8 first+last bf16: {k}": v for k, v in graphs["checks"].items()})
                # 2 of the 4 layers' weights are FP8 (4 linears each)
                checks["fp8 first+last bf16: 8 FP8 weights"] = quantized["first_switch"]["compared"] == 8
            else:
                summary["skipped"].append("parts 2 to 4 (CUDA graphs against eager): need a GPU")
                print("gpu_fp8: CUDA graphs need a GPU: parts 2 to 4 skipped", file=sys.stderr)
    finally:
        dist.destroy_process_group()
    summary["checks"] = checks
    summary["ok"] = all(checks.values())
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="the CPU part only (a tiny model, gloo)")
    ap.add_argument("--output", default=None, help="also write the JSON summary here")
    args = ap.parse_args()
    try:
        summary = run(args.smoke)
    except Exception:  # a failure is a summary too
        summary = {"ok": False, "error": traceback.format_exc()}
    print(json.dumps(summary))
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
