"""The engine's own map phase for a 7B switch, in one process: backing the peers' slots of one rank.

Builds the reshard plan of ``llama-7b`` (bf16) at training TP=2 → rollout TP=1 for one member of the micro-DP
group (no process group is needed: the plan is pure arithmetic), places a rank's own training shard in its
:class:`~megatron_hybrid.reshard.placement.Placement` (3.2 GiB), then times what ``switch_to_rollout`` does before its
collectives (``placement.map_rollout()``: every piece at once, access set once per contiguous span) and what
``switch_to_training`` does (``placement.unmap_rollout()``), against the mapping it replaced (``ReservedBuffer.map``
region by region, each piece with its own access update). Medians of ``--runs``. One GPU (CPU: mmap).

    python bench/map_phase.py --output bench/results/map_phase_h200.json
    python bench/map_phase.py --device cpu --shape few-large --runs 3    # a quick look on a CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES  # noqa: E402  (the benchmark shapes, one definition)

from megatron_hybrid.layout import ParallelLayout, RolloutLayout  # noqa: E402
from megatron_hybrid.reshard.placement import DTYPES, Placement  # noqa: E402
from megatron_hybrid.reshard.plan import MemberInfo, ParamInfo, build_group_plan  # noqa: E402


def member_params(arch, tp: int, tp_rank: int) -> tuple[ParamInfo, ...]:
    """A local-spec GPTModel's parameters at TP size ``tp`` (Megatron's names, shapes and split attributes)."""
    h, f, nh = arch.hidden_size, arch.ffn_hidden_size, arch.num_attention_heads
    ng = arch.num_query_groups or nh
    d = arch.kv_channels or h // nh
    mult = arch.make_vocab_size_divisible_by * tp
    vp = -(-arch.vocab_size // mult) * mult
    dt = arch.params_dtype
    out = [ParamInfo("embedding.word_embeddings.weight", "embedding.word_embeddings.weight", (vp // tp, h), dt,
                     True, 0, 1)]
    for i in range(arch.num_layers):
        p = f"decoder.layers.{i}."
        out += [ParamInfo(p + "input_layernorm.weight", p + "input_layernorm.weight", (h,), dt, False),
                ParamInfo(p + "self_attention.linear_qkv.weight", p + "self_attention.linear_qkv.weight",
                          ((nh + 2 * ng) * d // tp, h), dt, True, 0, 1),
                ParamInfo(p + "self_attention.linear_proj.weight", p + "self_attention.linear_proj.weight",
                          (h, nh * d // tp), dt, True, 1, 1),
                ParamInfo(p + "pre_mlp_layernorm.weight", p + "pre_mlp_layernorm.weight", (h,), dt, False),
                ParamInfo(p + "mlp.linear_fc1.weight", p + "mlp.linear_fc1.weight", (2 * f // tp, h), dt, True, 0, 2),
                ParamInfo(p + "mlp.linear_fc2.weight", p + "mlp.linear_fc2.weight", (h, f // tp), dt, True, 1, 1)]
    out += [ParamInfo("decoder.final_layernorm.weight", "decoder.final_layernorm.weight", (h,), dt, False),
            ParamInfo("output_layer.weight", "output_layer.weight", (vp // tp, h), dt, True, 0, 1)]
    return tuple(out)


def median_ms(fn, runs: int, sync) -> float:
    times = []
    for _ in range(runs):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-7b")
    ap.add_argument("--tensor-model-parallel-size", type=int, default=2)
    ap.add_argument("--bucket-size-mb", type=float, default=1024.0)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--output", default=None, help="write the result as JSON here")
    args = ap.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    arch, t = SHAPES[args.shape], args.tensor_model_parallel_size
    layout = ParallelLayout.create(training=(t, 1, 1), rollout=RolloutLayout(1, 1))
    members = [MemberInfo(r, r, 0, member_params(arch, t, r), arch.num_layers) for r in range(t)]
    bucket = {n: int(args.bucket_size_mb * 2**20) // torch.empty((), dtype=dt).element_size()
              for n, dt in DTYPES.items()}
    plan = build_group_plan(members, [p.name for p in members[0].params], k=t, q=1, bucket_numel=bucket)
    own = {p.name: torch.nn.Parameter(torch.zeros(p.shape, dtype=DTYPES[p.dtype], device=device),
                                      requires_grad=False) for p in members[0].params}
    placement = Placement(plan, 0, own, layout, rollout_tp_rank=0, device=device)
    peer_bytes = sum(b.peer_bytes for b in placement.buffers.values())

    def old_way() -> None:  # one allocation per region (and per piece of it), as before
        for dtype, regions in plan.regions.items():
            buf = placement.buffers[dtype]
            g = buf.memory.granularity_numel
            for reg in regions:
                lo, hi = reg.offset // g * g, min(-(-(reg.offset + reg.numel) // g) * g, buf.memory.numel)
                for p_lo, p_hi, _ in buf.pieces:
                    a, b = max(p_lo, lo), min(p_hi, hi)
                    if a < b:
                        buf.memory.map(a, b)
            buf.peers_mapped = buf._touched = True

    placement.map_rollout()  # warm-up: the driver's first mapping
    placement.unmap_rollout()
    rows = {}
    for name, fn in (("map_rollout", placement.map_rollout), ("per_region", old_way)):
        maps, unmaps = [], []
        for _ in range(args.runs):
            maps.append(median_ms(fn, 1, sync))
            sync()
            unmaps.append(median_ms(placement.unmap_rollout, 1, sync))
        rows[name] = {"map_ms": statistics.median(maps), "unmap_ms": statistics.median(unmaps)}
    result = {"shape": args.shape, "layout": f"t{t}->t_g1", "bucket_size_mb": args.bucket_size_mb,
              "peer_bytes": peer_bytes, "regions": sum(len(r) for r in plan.regions.values()),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "runs": args.runs, **rows,
              "speedup": rows["per_region"]["map_ms"] / rows["map_rollout"]["map_ms"]}
    print(json.dumps(result, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
