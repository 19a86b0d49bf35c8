"""CUDA graphs and memory of KV-cache generation on one GPU, one rank (not collected by pytest: needs a GPU).

    python3 tests/gpu_inference.py                      # both graph-pool variants, each in its own process
    python3 tests/gpu_inference.py --graph-pool reserved --output /tmp/gpu_inference.json
    python3 tests/gpu_inference.py --graph-pool reserved --optimizer distributed   # issue 16, Acceptance 5

A HybridEngine (one rank: NCCL world of 1, training and rollout layout TP=1) and a RolloutGenerator with CUDA graphs
go through 4 rollouts: the first captures the graphs (decode steps in 4 batch buckets: calls with 16, 5, 2 and 1
prompts; prefills by rows and padded length), and each later one follows switch_to_training() → an in-place SGD
step on the training parameters → switch_to_rollout(). Checked, per rollout:

- graphs: for every captured graph (decode and prefill), the replayed logits equal an eager run's of the same step
  (same inputs, same cache) bit for bit, after each step changed the weights (a stale graph would differ);
  captures == graphs after the first rollout and never grow;
- memory: after switch_to_training(), the device memory that inference still holds (``torch.cuda.mem_get_info``
  against a baseline taken before the first rollout, both after ``empty_cache``), less what stays once the
  generator is closed (kernel modules loaded on first use, library handles: code, not inference state), is at most
  one granule per buffer (KV cache, graph pool, sampling noise, decode state); the KV cache's address is the same
  in every rollout. The baseline follows one throwaway eager generation, which loads most kernels; the held bytes
  against a baseline before it are reported too (``held_bytes_with_kernel_modules``).
- host syncs: one more generate call, with refills, stop tokens, mixed steps and slot compaction (48 prompts on 16
  slots, top-p), makes at most 3 synchronizing CUDA calls (torch's sync debug mode) besides the step events the host
  waits on, however many steps it runs: the ranks' agreement on bad input, the rotary state, the log-probs' copy.
  (An index assignment of a Python scalar, ``t[index] = 0``, is a synchronizing copy: one per finished sequence
  and per refill stalled the device until the host's next launch.) After it, every graph (now also mixed steps')
  replays an eager run's logits bit for bit.

``--optimizer distributed`` trains instead through Megatron DDP with ``use_distributed_optimizer=True`` and
megatron-core's mixed-precision distributed Adam (bf16 parameters, fp32 main parameters): each step is a real
forward/backward and ``optimizer.step()``, whose parameter all-gather writes into DDP's buffer, which is the
engine's own slot (the engine is built over it, with ``optimizer=``).

The ``reserved`` variant keeps the graphs' memory in a reserved range (``GenerationConfig.graph_pool_gib > 0``);
``private`` uses a plain CUDA-graph pool, whose memory stays allocated (its memory check is expected to fail: it
shows what the reserved pool saves). Prints one JSON summary; exits 1 when a check of the reserved variant fails.
Multi-rank capture (NCCL collectives inside the graphs, TP > 1) is written but not exercised here.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 32000
BUCKET_PROMPTS = (16, 5, 2, 1)  # prompts per generate call: batch buckets 16, 8, 2 and 1
NEW_TOKENS = 32


def _free_bytes() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def _check_buckets(generator, cycle: int) -> dict:
    """Every captured graph (decode and prefill steps): replayed logits vs an eager run of the same step (same
    inputs, same cache), bit for bit."""
    runner = generator.replica.runner  # the stage runner: its fixed-address inputs, staging and graphs
    num_slots = runner.geometry.num_slots
    out = {}
    with torch.no_grad(), runner.cache.backed(), runner.graphs.backed():
        for key in runner.graphs.keys():
            kind, rows, length, _ = key
            assert kind in ("decode", "prefill", "mixed"), f"no check written for graph {key}"
            g = torch.Generator(device="cuda").manual_seed(1000 + rows + length)  # the same inputs every rollout
            if kind in ("decode", "mixed"):
                runner.slot_tokens[:rows] = torch.randint(0, VOCAB, (rows,), generator=g, device="cuda")
                top = length if kind == "decode" else 64  # a mixed key's length is its prompt rows
                runner.slot_positions[:rows] = torch.randint(0, top, (rows,), generator=g, device="cuda")
                runner.slot_running[:rows] = 1
            if kind == "mixed":  # rows: the decode batch; length: the prompt tokens riding along
                # Two prompts into slots 0 and 1, whose decode rows are then idle (they write the spare slot).
                half = max(1, length // 4)
                prompts = torch.randint(0, VOCAB, (2, half), generator=g, device="cuda").tolist()
                runner.slot_running[:2] = 0
                values = runner.stage_mixed(length, runner.mixed_prompts, prompts, [0, 1])
                runner.staging[: len(values)].copy_(torch.tensor(values, device="cuda"))
            elif kind == "prefill":
                n = min(rows, num_slots)
                prompts = torch.randint(0, VOCAB, (n, length), generator=g, device="cuda").tolist()
                runner.stage_prefill(rows, length, prompts, list(range(n)))
            captures = runner.graphs.captures
            replayed = runner.graphs.run(key, runner.graph_step(key))[0].clone()
            eager = runner.graph_step(key)()[0]
            assert runner.graphs.captures == captures, "the check must replay an existing graph"
            out[f"{kind}:{rows}x{length}"] = {"bit_exact": bool(torch.equal(replayed, eager)),
                                             "max_abs_diff": float((replayed.float() - eager.float()).abs().max())}
        runner.slot_running.zero_()
        runner.slot_positions.zero_()
    return out


def _host_syncs(engine, generator, prompts: list[list[int]]) -> dict:
    """The synchronizing CUDA calls (torch's sync debug mode) of one generate call with refills, stop tokens, mixed
    steps and slot compaction (48 prompts on 16 slots, top-p), besides the step events the host waits on, by the
    line that made them. Run once before, so that its graphs are captured (a capture synchronizes)."""
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid.inference.host_syncs import synchronizing_calls

    engine.switch_to_rollout()
    top_p = SamplingParams(temperature=1.0, top_p=0.9, num_tokens_to_generate=48)
    many = (prompts * 3)[:48]

    def run():
        return generator.generate(many, top_p, vocab_size=VOCAB, stop_token_ids=list(range(0, VOCAB, 97)), seed=3)

    run()
    before = generator.report()
    _, where = synchronizing_calls(run)
    report = generator.report()
    buckets = _check_buckets(generator, -1)  # now with mixed graphs, and batch buckets of compacted slots
    engine.switch_to_training()
    return {"count": sum(where.values()), "where": dict(where), "buckets": buckets,
            "steps": {key: report[key] - before[key] for key in ("decode_steps", "mixed_steps", "slot_moves")}}


def _megatron_distributed(model):
    """``model`` in Megatron DDP over its own parameter buffer, and megatron-core's distributed mixed-precision Adam."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16,
                                                 use_distributed_optimizer=True, clip_grad=1.0), [ddp])
    return ddp, opt


def run_variant(graph_pool: str, optimizer: str = "sgd") -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.inference import GenerationConfig, RolloutGenerator
    from megatron_hybrid.megatron.models import GPTArchitecture
    from megatron_hybrid.memory import allocation_granularity

    torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    # megatron-core's default RNG tracker cannot be captured (its fork() reseeds); the inference one can.
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)
    arch = GPTArchitecture(num_layers=8, hidden_size=1024, num_attention_heads=16, num_query_groups=8,
                           ffn_hidden_size=2816, vocab_size=VOCAB, params_dtype="bfloat16",
                           max_position_embeddings=4096)
    model = arch.build().cuda()
    tokens = torch.randint(0, VOCAB, (2, 64), device="cuda")
    positions = torch.arange(64, device="cuda").expand(2, -1)
    if optimizer == "distributed":
        model, opt = _megatron_distributed(model)
        engine = HybridEngine(model, RolloutLayout(1, 1), optimizer=opt)

        def step() -> None:  # a real update: the distributed optimizer all-gathers into DDP's buffer (own slot)
            model.zero_grad_buffer()
            opt.zero_grad()
            model(tokens, positions, None).float().square().mean().backward()
            model.finish_grad_sync()
            ok, _, _ = opt.step()
            assert ok
    else:
        engine = HybridEngine(model, RolloutLayout(1, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)

        def step() -> None:
            with torch.no_grad():
                opt.step()  # in place: the rollout weights (and the graphs) keep their addresses
    # Gradients from a real backward: cuBLAS, autograd and the optimizer's lazy state all exist before the baseline.
    if optimizer == "distributed":
        step()
    else:
        model(tokens, positions, None).float().square().mean().backward()
    dist.all_reduce(torch.zeros(1, device="cuda"))  # NCCL's own buffers come with the first collective
    config = GenerationConfig(max_batch_size=16, max_sequence_length=256,
                              graph_pool_gib=4.0 if graph_pool == "reserved" else 0.0)
    generator = RolloutGenerator(engine, config)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (int(torch.randint(16, 160, (1,), generator=g)),), generator=g).tolist()
               for _ in range(max(BUCKET_PROMPTS))]
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS)
    granule = allocation_granularity(torch.device("cuda", 0))
    # CUDA loads a kernel's module on its first launch and keeps it: that is code, not inference state. One
    # throwaway eager generation (no graphs, its cache freed after) loads the kernels generation uses before the
    # baseline; the held bytes are also reported against a baseline taken before it.
    base_cold = _free_bytes()
    from megatron_hybrid.inference import generate_with_model

    top_p = SamplingParams(temperature=1.0, top_p=0.9, num_tokens_to_generate=4)
    for params in (greedy, top_p):
        generate_with_model(getattr(engine.chunks[0], "module", engine.chunks[0]), prompts[:2], params, tp_group=ps.get_tensor_model_parallel_group(),
                            pp_group=ps.get_pipeline_model_parallel_group(), vocab_size=VOCAB)
    base = _free_bytes()
    base_reserved, base_allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    cycles = []
    for cycle in range(4):
        if cycle:
            engine.switch_to_training()
            step()
        engine.switch_to_rollout()
        tokens_out = [[r.generated_tokens for r in generator.generate(prompts[:n], greedy, vocab_size=VOCAB)]
                      for n in BUCKET_PROMPTS]
        buckets = _check_buckets(generator, cycle)
        report = generator.report()
        engine.switch_to_training()
        free = _free_bytes()
        held, held_cold = base - free, base_cold - free
        cycles.append({"captures": report["cuda_graph_captures"], "replays": report["cuda_graph_replays"],
                       "weight_checksum": float(next(model.parameters()).float().sum()),
                       "reserved_graph_pool": generator.replica.graphs.reserved is not None,
                       "buckets": buckets, "held_bytes_while_training": held,
                       "held_bytes_with_kernel_modules": held_cold,
                       # Where the held bytes are: the caching allocator's blocks (reserved, of which allocated are
                       # live tensors), or outside it (driver objects such as instantiated graphs).
                       "allocator_reserved_growth": torch.cuda.memory_reserved() - base_reserved,
                       "allocator_allocated_growth": torch.cuda.memory_allocated() - base_allocated,
                       "kv_cache_address": report["kv_cache_address"], "kv_cache_bytes": report["kv_cache_bytes"],
                       "graph_pool_bytes": report["cuda_graph_pool_bytes"],
                       "kv_cache_mapped_while_training": generator.report()["kv_cache_mapped_bytes"],
                       "first_tokens": tokens_out[0][0][:8]})
    num_buffers = 4  # KV cache, graph pool, sampling noise, decode-state tensors
    first = cycles[0]
    generator.close()
    # close() clears torch's cuBLAS workspaces (StepGraphs.close: the capture stream's lives in the graph pool),
    # those of the training stream too, which its next GEMM makes again: as here, before the measure.
    x = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    torch.nn.functional.linear(x, x, x[0])
    x.float() @ x.float()
    del x
    # What stays after the generator is gone (its graphs, pool and cache freed) is not inference state: kernel
    # modules first loaded by the captured shapes, cuBLAS and Triton handles. Held while training, less that.
    after_close = base - _free_bytes()
    # Last, on a generator of its own: the kernels its calls load first would otherwise count as "after close".
    generator = RolloutGenerator(engine, config)
    syncs = _host_syncs(engine, generator, prompts)
    generator.close()
    checks = {
        "bit_exact": all(b["bit_exact"] for c in cycles for b in c["buckets"].values()),
        "buckets_at_least_3": len(first["buckets"]) >= 3,
        "captures_equal_buckets": all(c["captures"] == len(first["buckets"]) for c in cycles),
        "weights_changed_each_cycle": len({c["weight_checksum"] for c in cycles}) == len(cycles),
        "kv_cache_address_fixed": len({c["kv_cache_address"] for c in cycles}) == 1,
        # Per call, whatever its steps: the ranks' agreement on bad input, the rotary state, the log-probs' copy.
        "host_syncs_per_call_at_most_3": syncs["count"] <= 3,
        # Every graph after that call, mixed steps' included, replays an eager run's logits bit for bit.
        "bit_exact_with_mixed_graphs": (any(k.startswith("mixed:") for k in syncs["buckets"])
                                        and all(b["bit_exact"] for b in syncs["buckets"].values())),
        "memory_held_within_granules": all(c["held_bytes_while_training"] - after_close <= num_buffers * granule
                                           for c in cycles),
    }
    engine.close()  # the distributed optimizer was given at construction: its views move back too
    dist.destroy_process_group()
    return {"graph_pool": graph_pool, "optimizer": optimizer, "checks": checks, "ok": all(checks.values()), "granule": granule,
            "held_bound_bytes": num_buffers * granule, "held_after_close_bytes": after_close, "host_syncs": syncs, "cycles": cycles, "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--graph-pool", choices=["reserved", "private"], default=None,
                    help="run one variant in this process (default: both, each in a subprocess)")
    ap.add_argument("--optimizer", choices=["sgd", "distributed"], default="sgd",
                    help="in-place torch SGD on the parameters (default), or Megatron DDP + the distributed optimizer")
    ap.add_argument("--output", default=None, help="also write the JSON summary here")
    args = ap.parse_args()
    if args.graph_pool is not None:
        try:
            summary = run_variant(args.graph_pool, args.optimizer)
        except Exception:  # report the failure as JSON too, so the parent's summary keeps it
            summary = {"graph_pool": args.graph_pool, "ok": False, "error": traceback.format_exc()}
    else:
        variants = []
        for variant in ("reserved", "private"):
            proc = subprocess.run([sys.executable, __file__, "--graph-pool", variant, "--optimizer", args.optimizer],
                                  capture_output=True, text=True, env=dict(os.environ))
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            variants.append(json.loads(lines[-1]) if lines else
                            {"graph_pool": variant, "ok": False, "returncode": proc.returncode,
                             "stderr_tail": proc.stderr[-4000:]})
        summary = {"ok": variants[0]["ok"], "variants": variants}
    text = json.dumps(summary)
    print(text)
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
