"""GPU smoke test of the engine on one GPU: 2 ranks share the device over gloo (NCCL refuses two ranks per GPU).

Checks the CUDA path end to end: CUDA virtual memory behind the gather buffers, the in-place all-gather, the aliased
(block) modules on CUDA, and logits against the training layout. Not a speed measurement.
    torchrun --nproc_per_node 2 bench/gpu_smoke.py --output bench/results/gpu_smoke.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    torch.cuda.set_device(0)
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.forward import gather_vocab
    from megatron_hybrid.megatron.models import tiny_llama

    ps.initialize_model_parallel(2, 1)
    model_parallel_cuda_manual_seed(0)
    arch = tiny_llama(hidden_size=256, ffn_hidden_size=512, num_layers=4)
    model = arch.build(tensor_model_parallel_size=2).cuda()
    out = {}
    tokens = torch.arange(32, device="cuda").remainder(250).unsqueeze(0)
    pos = torch.arange(32, device="cuda").unsqueeze(0)
    with torch.no_grad():
        train_logits = gather_vocab(model(tokens, pos, None), ps.get_tensor_model_parallel_group())
    for mode, align in (("aliased", False), ("canonical", False), ("aliased", True)):
        free0 = torch.cuda.mem_get_info()[0]
        engine = HybridEngine(model, RolloutLayout(1, 1), weight_mode=mode, bucket_size_mb=1, align_slots=align)
        backends = {k: b.memory.backend for k, b in engine.placement.buffers.items()}
        engine.switch_to_rollout()
        torch.cuda.synchronize()
        free_rollout = torch.cuda.mem_get_info()[0]
        rollout_report = engine.communication_report()
        with torch.no_grad():
            logits = engine.rollout_model(tokens, pos, None)
        engine.switch_to_training()
        free_back = torch.cuda.mem_get_info()[0]
        rep = engine.communication_report()
        out[f"{mode}{'-aligned' if align else ''}"] = {"backends": backends, "max_abs_logit_diff": (logits - train_logits).abs().max().item(),
                     "bytes": rep["total_bytes"], "collectives": rep["num_collectives"],
                     "free_drop_rollout": free0 - free_rollout, "free_drop_after": free0 - free_back,
                     "peer_bytes": sum(b.peer_bytes for b in engine.placement.buffers.values()),
                     "resident_peer_bytes": sum(b.resident_peer_bytes for b in engine.placement.buffers.values()),
                     "peer_bytes_mapped_rolling_out": rollout_report["peer_bytes_mapped"],
                     "canonical_bytes_mapped": rollout_report["canonical_bytes_mapped"],
                     "transient_bytes_released": rollout_report["transient_bytes_released"]}
        engine.close()  # the training parameters go back to ordinary memory; the next engine starts afresh
        torch.cuda.synchronize()
        out[f"{mode}{'-aligned' if align else ''}"]["free_drop_after_close"] = free0 - torch.cuda.mem_get_info()[0]
        with torch.no_grad():
            again = gather_vocab(model(tokens, pos, None), ps.get_tensor_model_parallel_group())
        out[f"{mode}{'-aligned' if align else ''}"]["train_logits_unchanged"] = bool(torch.equal(again, train_logits))
    res = [None, None]
    dist.all_gather_object(res, out)
    if dist.get_rank() == 0:
        print(json.dumps(res, indent=1))
        if args.output:
            with open(args.output, "w") as f:
                json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
