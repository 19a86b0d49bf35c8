"""Switch a tiny Llama-shaped actor from its training layout to a rollout layout and back, and say what moved.

Run (CPU, gloo, 4 ranks: training TP=2 × DP=2, rollout TP=1):
    torchrun --nproc_per_node 4 examples/reshard_demo.py
GPU (NCCL), training TP=4, rollout TP=2:
    torchrun --nproc_per_node 4 examples/reshard_demo.py --tensor-model-parallel-size 4 \
        --rollout-tensor-model-parallel-size 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch
import torch.distributed as dist

from megatron_hybrid.modes import WeightMode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensor-model-parallel-size", type=int, default=2)
    ap.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    ap.add_argument("--rollout-tensor-model-parallel-size", type=int, default=1)
    ap.add_argument("--rollout-pipeline-model-parallel-size", type=int, default=1)
    ap.add_argument("--hybrid-weight-mode", choices=[m.value for m in WeightMode], default=WeightMode.ALIASED.value)
    ap.add_argument("--reshard-bucket-size-mb", type=float, default=256.0)
    args = ap.parse_args()

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.forward import gather_vocab, pipeline_forward
    from megatron_hybrid.megatron.models import tiny_llama
    from megatron_hybrid.megatron.patches import cpu_gloo

    with contextlib.nullcontext() if use_cuda else cpu_gloo():
        ps.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
        model_parallel_cuda_manual_seed(0)
        arch = tiny_llama()
        model = arch.build(tensor_model_parallel_size=args.tensor_model_parallel_size,
                           pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                           pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
        if use_cuda:
            model.cuda()
        engine = HybridEngine(model, RolloutLayout(args.rollout_tensor_model_parallel_size,
                                                   args.rollout_pipeline_model_parallel_size),
                              weight_mode=args.hybrid_weight_mode, bucket_size_mb=args.reshard_bucket_size_mb)
        device = torch.device("cuda") if use_cuda else torch.device("cpu")
        tokens = torch.arange(16, device=device).remainder(arch.vocab_size).unsqueeze(0)
        positions = torch.arange(16, device=device).unsqueeze(0)
        with engine.rollout() as rollout_model, torch.no_grad():
            report = engine.communication_report()
            logits = pipeline_forward(rollout_model, engine.groups["pp"], tokens, positions)
            if logits is not None:
                logits = gather_vocab(logits, engine.groups["tp"])
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, {k: report[k] for k in ("total_bytes", "num_collectives", "switch_seconds")}
                               | {"rollout_tp_group": report["groups"]["tp"], "micro_dp_group":
                                  report["groups"]["micro_dp"], "logits": None if logits is None else
                                  list(logits.shape)})
        if dist.get_rank() == 0:
            lay = engine.layout
            print(f"training (t, p, d) = ({lay.t}, {lay.p}, {lay.d}) -> rollout (t_g, p_g) = ({lay.t_g}, {lay.p_g}), "
                  f"micro-DP d_g = {lay.d_g}, weight mode {engine.weight_mode}")
            for rank, r in enumerate(reports):
                print(f"rank {rank}: " + json.dumps(r))
            print("switched back to training: the peers' slots are released; the training shards never moved")
        ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
