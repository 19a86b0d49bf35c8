"""The resharding checks on GPUs with NCCL, one process per GPU (not collected by pytest: needs torchrun and GPUs).

For every layout (t, p, d) → (t_g, p_g) that fits the world size, both weight modes, fp32 and bf16:

- the rollout model's weights equal the training weights bit for bit, before and after an SGD step on the
  training layout (the reference: the training model's own full state, gathered independently);
- each rank receives exactly the missing bytes (rollout shard − own tensors, from the model alone), and a second
  call moves nothing;
- the rollout model's logits match the training layout's logits (see ``TOLERANCE``);
- device memory (``torch.cuda.mem_get_info``, which sees the CUDA virtual-memory mappings): while rolling out,
  the peers' slots (+ canonical tensors) at most plus one granule per range; after the switch back, what it was.

Writes one JSON line per case to ``--output`` (rank 0) and exits non-zero if any check failed.

    torchrun --standalone --nproc_per_node 2 tests/gpu_nccl.py --output /tmp/nccl.jsonl
    torchrun --standalone --nproc_per_node 8 tests/gpu_nccl.py --output bench/results/nccl_h200x8.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import engine_cases as cases  # noqa: E402

# Layouts per world size: (t, p, d, t_g, p_g).
LAYOUTS = {
    2: [(2, 1, 1, 1, 1), (1, 2, 1, 1, 1), (1, 1, 2, 2, 1)],
    4: [(2, 1, 2, 1, 1), (4, 1, 1, 2, 1), (4, 1, 1, 1, 1), (2, 2, 1, 1, 1), (2, 2, 1, 2, 1), (2, 2, 1, 1, 2),
        (2, 1, 2, 4, 1)],
    8: [(2, 1, 4, 1, 1), (4, 1, 2, 2, 1), (4, 1, 2, 1, 1), (8, 1, 1, 2, 1), (4, 2, 1, 2, 1), (4, 2, 1, 2, 2),
        (2, 2, 2, 1, 1), (2, 4, 1, 1, 2), (2, 1, 4, 4, 1), (8, 1, 1, 1, 1), (8, 1, 1, 4, 1)],
}
# Logits of two layouts differ by the order of their sums (row-parallel matmuls split the inner dimension; the
# all-reduce adds the partial sums; cuBLAS picks other kernels for other shapes). fp32 (TF32 off): relative error
# ~1e-6 of values ~1, so rtol 1e-4 / atol 1e-4. bf16: 8 mantissa bits, a few ulps of values ~0.5: atol 3e-2.
TOLERANCE = {"float32": dict(rtol=1e-4, atol=1e-4), "bfloat16": dict(rtol=0, atol=3e-2)}


def run_case(layout, mode: str, dtype: str) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.forward import gather_vocab, pipeline_forward
    from megatron_hybrid.megatron.sharding import full_state_dict

    t, p, d, t_g, p_g = layout
    ps.initialize_model_parallel(t, p)
    model_parallel_cuda_manual_seed(1234)
    tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    a = cases.arch(params_dtype=dtype, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8,
                   num_query_groups=4)
    config = a.transformer_config(tensor_model_parallel_size=t, pipeline_model_parallel_size=p)
    model = a.build(config, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    model.cuda()
    # Data-parallel replicas start equal, as Megatron's DDP makes them (it broadcasts from DP rank 0): the rollout
    # layout may combine shards of different replicas (t_g > t).
    dp_group = ps.get_data_parallel_group()
    with torch.no_grad():
        for prm in model.parameters():
            dist.broadcast(prm.data, src=dist.get_global_rank(dp_group, 0), group=dp_group)
    tok = cases.tokens().cuda()
    pos = torch.arange(cases.SEQ, device="cuda").expand(cases.BATCH, -1)
    with torch.no_grad():
        train_logits = pipeline_forward(model, pp_group, tok, pos)
    if train_logits is not None:
        train_logits = gather_vocab(train_logits, tp_group).float().cpu()
    def free() -> int:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0]

    dist.barrier()
    free0 = free()
    engine = HybridEngine(model, RolloutLayout(t_g, p_g), weight_mode=mode, bucket_size_mb=4)
    dist.barrier()
    free_built = free()
    # Warm-up: NCCL sets up each new group's communicator (and its device buffers) on first use; that is not
    # the engine's memory.
    engine.switch_to_rollout()
    cases.rollout_full_weights(engine)
    with torch.no_grad():
        pipeline_forward(engine.rollout_model, engine.groups["pp"], tok, pos)
    engine.switch_to_training()
    failures = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)

    out = {"layout": list(layout), "mode": mode, "dtype": dtype, "rank": dist.get_rank()}
    for phase in ("first", "second"):
        reference = full_state_dict([model], tp_group=tp_group, pp_group=pp_group)
        free_before = free()
        engine.switch_to_rollout()
        free_during = free()
        report = engine.communication_report()
        switches = engine.num_switches
        engine.switch_to_rollout()
        check(engine.num_switches == switches, f"{phase}: a second call switched again")
        weights = cases.rollout_full_weights(engine)
        check(weights.keys() == reference.keys(), f"{phase}: rollout names differ")
        bad = [n for n in reference if n in weights and not torch.equal(weights[n], reference[n])]
        check(not bad, f"{phase}: rollout weights differ from training weights: {bad[:3]}")
        expected = cases.expected_missing_bytes(engine)
        check(report["total_bytes"] == expected, f"{phase}: received {report['total_bytes']} bytes, expected "
                                                 f"{expected}")
        with torch.no_grad():
            logits = pipeline_forward(engine.rollout_model, engine.groups["pp"], tok, pos)
        if logits is not None:
            logits = gather_vocab(logits, engine.groups["tp"]).float().cpu()
            if phase == "first" and train_logits is not None:
                try:
                    torch.testing.assert_close(logits, train_logits, **TOLERANCE[dtype])
                except AssertionError as err:
                    failures.append(f"logits: {str(err).splitlines()[0:3]}")
                out["max_logit_diff"] = float((logits - train_logits).abs().max())
        engine.switch_to_training()
        free_after = free()
        # Each rank has its own GPU: device-wide free memory is this rank's.
        grown = free_before - free_during
        mapped = report["peer_bytes_mapped"] + report["canonical_bytes_mapped"]
        granule = 2 * 2**20
        ranges = sum(len(b.peer_ranges) for b in engine.placement.buffers.values()) + len(engine.placement.rollout_only)
        check(grown <= mapped + granule * (ranges + 1) + 8 * 2**20,
              f"{phase}: device memory grew {grown} while rolling out, mapped {mapped}")
        check(free_before - free_after <= 2 * 2**20,
              f"{phase}: {free_before - free_after} bytes not returned after the switch back")
        out[phase] = {"bytes": report["total_bytes"], "expected": expected, "collectives": report["num_collectives"],
                      "switch_s": report["switch_seconds"], "phases": report["phases"], "grown": grown,
                      "mapped": mapped, "not_returned": free_before - free_after}
        if phase == "first":  # an SGD step on the training layout, then the same checks again
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with torch.no_grad():
                for prm in model.parameters():
                    prm.grad = torch.randn_like(prm) * 0.01
                    dist.broadcast(prm.grad, src=dist.get_global_rank(dp_group, 0), group=dp_group)  # as DDP's
            opt.step()
    out["engine_resident_bytes"] = free0 - free_built
    out["failures"] = failures
    engine.close()
    del engine, model
    ps.destroy_model_parallel()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", type=Path, default=None, help="JSON lines, one per case (rank 0)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--modes", nargs="+", default=["aliased", "canonical"], choices=["aliased", "canonical"])
    args = ap.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world not in LAYOUTS:
        raise ValueError(f"world size ({world}) must be one of {sorted(LAYOUTS)}")
    rows, failed = [], 0
    for layout in LAYOUTS[world]:
        for mode in args.modes:
            for dtype in args.dtypes:
                start = time.perf_counter()
                try:
                    row = run_case(layout, mode, dtype)
                except Exception:  # report and go on: one broken layout must not hide the others
                    row = {"layout": list(layout), "mode": mode, "dtype": dtype, "rank": rank,
                           "failures": [traceback.format_exc(limit=6)]}
                rows_all = [None] * world
                dist.all_gather_object(rows_all, row)
                bad = [r for r in rows_all if r["failures"]]
                failed += bool(bad)
                if rank == 0:
                    first = rows_all[0].get("first", {})
                    print(f"{'FAIL' if bad else 'ok  '} {layout} {mode:9s} {dtype:8s} bytes {first.get('bytes')} "
                          f"(expected {first.get('expected')}) switch {first.get('switch_s', 0) * 1e3:.1f} ms  "
                          f"logit diff {rows_all[0].get('max_logit_diff', float('nan')):.2e}  "
                          f"({time.perf_counter() - start:.1f} s)", flush=True)
                    for r in bad:
                        print(f"  rank {r['rank']}: {r['failures']}", flush=True)
                rows += rows_all
    if rank == 0 and args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
