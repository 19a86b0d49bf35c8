"""The generator's MoE step on one GPU (not collected by pytest: needs a GPU; written, not yet run on one).

    python3 tests/gpu_moe_generation.py [--output /tmp/gpu_moe_generation.json]

One rank (NCCL world of 1), a bf16 MoE GPT (8 experts, top-2, a shared expert, softmax routing with the router in
fp32) whose expert weights are put in one storage (the layout the engine's canonical binding should give them), so
the grouped-GEMM path runs. Checked:

- ``torch._grouped_mm`` takes bf16 with int32 offsets here (:func:`grouped_mm_supported`);
- each MoE layer's step equals megatron-core's ``MoELayer`` forward on the same hidden states (bf16: a few ulp);
- one MoE layer's step captured in a CUDA graph and replayed on new hidden states (other routing, other group
  offsets) equals its eager step on them, bit for bit;
- greedy generation with CUDA graphs captures graphs, and a graphed generate call makes no synchronizing CUDA call
  inside the MoE layers (torch's sync debug mode, by line); whether its tokens equal eager generation's is reported
  (bf16 eager steps run other kernels, unpadded, so a near tie may differ: not a check).

Prints one JSON summary; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from megatron.core import parallel_state as ps
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_hybrid.inference import GenerationConfig, ReplicaGenerator
    from megatron_hybrid.inference.context import StepContext
    from megatron_hybrid.inference.host_syncs import synchronizing_calls
    from megatron_hybrid.inference.moe import grouped_mm_supported, install_step_moe
    from tests.moe_generation_cases import moe_arch, prompts_for, rehome_experts

    parser = argparse.ArgumentParser()
    parser.add_argument("--output")
    args = parser.parse_args()
    torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)  # the capturable RNG tracker
    arch = moe_arch(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4, num_experts=8,
                    moe_ffn_hidden_size=128, moe_shared_expert_intermediate_size=256, params_dtype="bfloat16",
                    max_position_embeddings=512, extra=dict(moe_router_dtype="fp32"))
    model = arch.build().cuda().eval()
    rehome_experts(model)
    out: dict = {"grouped_mm_bf16": grouped_mm_supported(torch.device("cuda", 0), torch.bfloat16)}

    layers = install_step_moe(model, StepContext())
    out["paths"] = [layer.experts_path().__name__ for layer in layers]
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        hidden = torch.randn(96, 1, 256, device="cuda", generator=g).to(torch.bfloat16)
        diffs = [float((layer.step_forward(hidden).float() - layer(hidden)[0].float()).abs().max())
                 for layer in layers]
        scale = max(float(layer(hidden)[0].float().abs().max()) for layer in layers)
        out["layer_vs_megatron"] = {"max_diff": max(diffs), "scale": scale}
        # Capture one layer's step, then replay it on other hidden states (other group offsets).
        static = hidden.clone()
        layers[0].step_forward(static)  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layers[0].step_forward(static)
        replays = []
        for seed in (1, 2, 3):
            static.copy_(torch.randn(96, 1, 256, device="cuda",
                                     generator=torch.Generator(device="cuda").manual_seed(seed)).to(torch.bfloat16))
            graph.replay()
            replays.append(bool(torch.equal(captured, layers[0].step_forward(static))))
        out["graph_replay_bit_exact"] = replays

    prompts = prompts_for(7, 24)
    params = SamplingParams(top_k=1, num_tokens_to_generate=32)
    runs = {}
    for graphs in (False, True):
        generator = ReplicaGenerator(model, tp_group=ps.get_tensor_model_parallel_group(),
                                     pp_group=ps.get_pipeline_model_parallel_group(),
                                     config=GenerationConfig(max_batch_size=8, max_sequence_length=96,
                                                             cuda_graphs=graphs, graph_pool_gib=0))
        runs[graphs] = [r.generated_tokens for r in generator.generate(prompts, params, vocab_size=250)]
        if graphs:
            _, syncs = synchronizing_calls(lambda: generator.generate(prompts, params, vocab_size=250))
            out["captures"] = generator.report()["cuda_graph_captures"]
            out["syncs_in_moe"] = {k: v for k, v in syncs.items() if k.startswith("moe.py")}
            out["syncs"] = dict(syncs)
        generator.close()
    out["graphs_equal_eager"] = runs[True] == runs[False]
    checks = {
        "grouped_mm_bf16": out["grouped_mm_bf16"],
        "grouped_path": set(out["paths"]) == {"grouped_experts"},
        "layer_vs_megatron": diffs and max(diffs) <= 2**-6 * scale,
        "graph_replay_bit_exact": all(replays),
        "captured": out["captures"] > 0,
        "no_moe_syncs": not out["syncs_in_moe"],
    }
    out["checks"] = checks
    text = json.dumps(out, indent=1, default=str)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    dist.destroy_process_group()
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
