"""Rank bodies for test_moe_engine.py: an MoE actor switched between an expert-parallel training layout and a
rollout layout with its own expert parallelism, checked against the unsharded model.

The reference is computed on one rank (:func:`reference_case`): the full weights (seeded by name), their state
after a known SGD step, and the logits of a few token sets at both. The sharded body (:func:`moe_engine_case`)
loads its shards of the same weights, runs both weight modes, and reports what each rank saw; the test compares.
"""

from __future__ import annotations

import zlib
from typing import Any, Optional

import torch
import torch.distributed as dist

from tests.moe_generation_cases import VOCAB, prompts_for, recompute_greedy

SEQ, BATCH, LR, NUM_TOKEN_SETS = 8, 2, 0.1, 8
PROMPTS_PER_RANK, NEW_TOKENS = 2, 6


def moe_arch(**overrides):
    """Hidden 32, 4 heads / 4 query groups (TP up to 4), 8 experts of ffn 32, top-2, fp32."""
    from megatron_hybrid.megatron.models import tiny_llama

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=64,
                num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32)
    base.update(overrides)
    return tiny_llama(**base)


def token_set(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, 250, (BATCH, SEQ), generator=g), torch.arange(SEQ).expand(BATCH, -1)


def _seeded(name: str, shape, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + salt)
    return torch.randn(shape, generator=g)


def _weight_buffers(model: torch.nn.Module):
    from megatron_hybrid.reshard.binding import WEIGHT_BUFFERS

    return [(n, b) for n, b in model.named_buffers() if n.endswith(WEIGHT_BUFFERS)]


def reference_case(arch_kw: dict) -> dict:
    """One rank: the unsharded model's weights (with the router's expert bias, if any), the weights after one SGD
    step with seeded gradients, and the logits of every token set at both."""
    model = moe_arch(**arch_kw).build()
    model.eval()
    full = {}
    for name, p in list(model.named_parameters()) + _weight_buffers(model):
        w = _seeded(name, p.shape, 0) * 0.1
        full[name] = (1.0 + w if p.dim() == 1 and "norm" in name else w).to(p.dtype)
    stepped = {n: w if n.endswith("expert_bias") else torch.add(w, _seeded(n, w.shape, 1) * 0.01, alpha=-LR)
               for n, w in full.items()}
    out = {"full": full, "stepped": stepped}
    for key, state in (("logits", full), ("logits_stepped", stepped)):
        with torch.no_grad():
            for name, t in list(model.named_parameters()) + _weight_buffers(model):
                t.copy_(state[name])
            out[key] = [model(*token_set(s), None).float() for s in range(NUM_TOKEN_SETS)]
    # Full-recompute greedy decoding of the stepped model, for each training DP rank's prompts.
    out["greedy_stepped"] = [recompute_greedy(model, rank_prompts(dp), NEW_TOKENS) for dp in range(8)]
    return out


def rank_prompts(dp_rank: int) -> list[list[int]]:
    """Training DP rank ``dp_rank``'s prompts."""
    return prompts_for(700 + dp_rank, PROMPTS_PER_RANK)


def _shard_of(full: torch.Tensor, spec, rank: int, size: int) -> torch.Tensor:
    from megatron_hybrid.megatron.sharding import shard

    return shard(full, spec, rank, size)


def _load(model: torch.nn.Module, state: dict) -> None:
    """This rank's shards of ``state``: dense tensors over the TP group, routed experts (by global index) over the
    expert-TP group."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid.megatron.sharding import TPSpec, is_expert
    from megatron_hybrid.reshard.binding import named_weights

    with torch.no_grad():
        for name, _, t in named_weights([model]):
            if is_expert(name):
                rank, size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
            else:
                rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
            t.copy_(_shard_of(state[name], TPSpec.of(t), rank, size))


def _rollout_tensor(engine, p: torch.Tensor) -> torch.Tensor:
    """What the rollout model computes with for ``p``: its storage, or its blocks stacked in canonical order."""
    blocks = engine.binding.table.get(p)
    if blocks is None:
        return p.detach().clone()
    return blocks.materialize().clone()


def _rollout_mismatches(engine, state: dict) -> list[str]:
    """Rollout tensors that differ in any bit from this rank's rollout shard of ``state`` (TP shard t_g of a dense
    tensor, expert-TP shard et_g of a routed expert's, the expert by its global index)."""
    from megatron_hybrid.megatron.sharding import TPSpec, is_expert
    from megatron_hybrid.reshard.binding import named_weights

    ex = engine.expert_layout
    et_rank = engine.group_ranks["expt_tp"].index(dist.get_rank())
    bad = []
    for name, _, p in named_weights(engine.rollout_chunks):
        rank, size = (et_rank, ex.et_g) if is_expert(name) else (engine.rollout_tp_rank, engine.layout.t_g)
        want = _shard_of(state[name], TPSpec.of(p), rank, size)
        got = _rollout_tensor(engine, p)
        if got.shape != want.shape or not torch.equal(got.view(torch.int32), want.view(torch.int32)):
            bad.append(name)
    return bad


def _missing_bytes(engine) -> tuple[int, int]:
    """(all, expert) bytes of this rank's rollout shard that its own training tensors do not hold, counted by name:
    a rollout tensor of the same name as a training tensor of this rank holds that tensor as a block."""
    from megatron_hybrid.megatron.sharding import is_expert
    from megatron_hybrid.reshard.binding import named_weights

    own = {name: t.numel() * t.element_size() for name, _, t in named_weights(engine.modules)}
    total = expert = 0
    for name, _, p in named_weights(engine.rollout_chunks):
        missing = p.numel() * p.element_size() - own.get(name, 0)
        total += missing
        expert += missing if is_expert(name) else 0
    return total, expert


def _logits(chunk, pp_group, tp_group, seed: int) -> Optional[torch.Tensor]:
    from megatron_hybrid.forward import gather_vocab, pipeline_forward

    with torch.no_grad():
        logits = pipeline_forward(chunk, pp_group, *token_set(seed))
    return gather_vocab(logits, tp_group).float() if logits is not None else None


def moe_engine_case(arch_kw: dict, rollout_kw: dict, ref: dict, *, sequence_parallel: bool = False,
                    modes: tuple[str, ...] = ("aliased", "canonical")) -> dict[str, Any]:
    """Build the MoE model at this run's (t, p, e, et), then for each weight mode: an engine switching to
    ``RolloutLayout(**rollout_kw)``, checked before and after an SGD step of the training layout, and closed."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.megatron.sharding import TPSpec, is_expert
    from megatron_hybrid.reshard.binding import named_weights

    t, p = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    e, et = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    arch = moe_arch(**arch_kw)
    config = arch.transformer_config(tensor_model_parallel_size=t, pipeline_model_parallel_size=p,
                                     expert_model_parallel_size=e, expert_tensor_parallel_size=et,
                                     sequence_parallel=sequence_parallel)
    model = arch.build(config, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    model.eval()
    out: dict[str, Any] = {"rank": dist.get_rank()}
    for mode in modes:
        _load(model, ref["full"])
        engine = HybridEngine(model, RolloutLayout(**rollout_kw), weight_mode=mode, bucket_size_mb=0.01)
        seed_train = ps.get_data_parallel_rank() % NUM_TOKEN_SETS
        seed_rollout = engine.rollout_replica % NUM_TOKEN_SETS
        res: dict[str, Any] = {"seed_train": seed_train, "seed_rollout": seed_rollout}
        for when, state in (("first", ref["full"]), ("second", ref["stepped"])):
            if when == "second":  # an SGD step of the training layout with this rank's shards of the gradients
                params = []
                for name, _, prm in named_weights(engine.modules):
                    if isinstance(prm, torch.nn.Parameter):
                        g = _seeded(name, ref["full"][name].shape, 1) * 0.01
                        rank, size = ((ps.get_expert_tensor_parallel_rank(), et) if is_expert(name)
                                      else (ps.get_tensor_model_parallel_rank(), t))
                        prm.grad = _shard_of(g, TPSpec.of(prm), rank, size)
                        params.append(prm)
                torch.optim.SGD(params, lr=LR).step()
            train_logits = _logits(model, ps.get_pipeline_model_parallel_group(),
                                   ps.get_tensor_model_parallel_group(), seed_train)
            engine.switch_to_rollout()
            report = engine.communication_report()
            rollout_logits = _logits(engine.rollout_model, engine.groups["pp"], engine.groups["tp"], seed_rollout)
            res[when] = dict(report={k: report[k] for k in ("total_bytes", "expert_bytes", "num_collectives",
                                                            "peer_bytes_mapped", "canonical_bytes_mapped",
                                                            "rollout_memory_bytes_mapped", "resident_peer_bytes")},
                             planes=sorted({c["plane"] for c in report["collectives"]}),
                             mismatches=_rollout_mismatches(engine, state), train_logits=train_logits,
                             rollout_logits=rollout_logits)
            engine.switch_to_training()
            res[when]["peer_bytes_after"] = engine.placement.report()["peer_bytes_mapped"]
        # Greedy generation on the rollout layout (this training rank's prompts), stepped weights.
        from megatron.core.inference.sampling_params import SamplingParams

        params = SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS)
        results = engine.generate(rank_prompts(ps.get_data_parallel_rank()), params, vocab_size=VOCAB)
        res["generated"] = [r.generated_tokens for r in results]
        res["dp_rank"] = ps.get_data_parallel_rank()
        # Which expert path each MoE layer of the rollout model took: grouped GEMMs over strided 3-D views of its
        # experts' weights, or expert by expert.
        res["paths"] = [m.experts_path().__name__ for m in engine.rollout_chunks[0].modules()
                        if hasattr(m, "experts_path")]
        engine.switch_to_training()
        res["missing"] = _missing_bytes(engine)
        res["expert_layout"] = engine.expert_layout
        res["expert_numel"] = sum(prm.numel() for name, _, prm in named_weights(engine.modules) if is_expert(name))
        engine.close()
        out[mode] = res
    return out


def moe_bad_input_cases(rollout_kws: list[dict]) -> list[str]:
    """The engine on an MoE model at this run's layout with each ``RolloutLayout(**kw)``, then with expert groups
    that do not cover the world, then a dense model with a rollout expert size: each ValueError's text, raised before
    any collective (every collective is replaced by one that fails the test)."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.megatron import compat

    arch = moe_arch()
    model = arch.build(arch.transformer_config(expert_model_parallel_size=ps.get_expert_model_parallel_world_size()))
    from megatron_hybrid.megatron.models import tiny_llama

    dense = tiny_llama(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4,
                       ffn_hidden_size=64).build()

    class _Sized:
        def __init__(self, n: int) -> None:
            self.n = n

        def size(self) -> int:
            return self.n

    def no_collective(*a, **k):
        raise AssertionError("a collective ran before the input was validated")

    def refusal(m, rollout) -> str:
        try:
            HybridEngine(m, rollout)
        except ValueError as exc:
            return str(exc)
        return ""

    saved = {n: getattr(dist, n) for n in ("all_gather_object", "new_group", "all_gather_into_tensor", "broadcast")}
    groups = compat.megatron_expert_groups
    try:
        for n in saved:
            setattr(dist, n, no_collective)
        out = [refusal(model, RolloutLayout(**kw)) for kw in rollout_kws]
        # Expert groups of 1 × 2 × 2 ranks per stage on a world of 2.
        compat.megatron_expert_groups = lambda: (_Sized(1), _Sized(2), _Sized(2))
        out.append(refusal(model, RolloutLayout(1, 1)))
        compat.megatron_expert_groups = groups
        out.append(refusal(dense, RolloutLayout(1, 1, expert_model_parallel_size=2)))
        return out
    finally:
        compat.megatron_expert_groups = groups
        for n, f in saved.items():
            setattr(dist, n, f)


def grouped_experts_case() -> str:
    """The engine on an MoE model whose experts are megatron-core's ``GroupedMLP`` (what ``moe_grouped_gemm=True``
    builds; the class swapped onto built ``SequentialMLP`` experts, since GroupedMLP needs the CUDA-only
    grouped_gemm package): refused before any collective; returns the message."""
    from megatron.core.transformer.moe.experts import GroupedMLP

    from megatron_hybrid import HybridEngine, RolloutLayout

    def no_collective(*a, **k):
        raise AssertionError("a collective ran before the input was validated")

    model = moe_arch().build()
    for layer in model.decoder.layers:
        layer.mlp.experts.__class__ = GroupedMLP
    saved = {n: getattr(dist, n) for n in ("all_gather_object", "new_group", "all_gather_into_tensor", "broadcast")}
    try:
        for n in saved:
            setattr(dist, n, no_collective)
        HybridEngine(model, RolloutLayout(1, 1))
    except ValueError as exc:
        return str(exc)
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    return ""

def _full_state(chunks) -> dict[str, torch.Tensor]:
    """Every training weight as a full tensor by global name (routed experts by global index), on every rank: the
    ranks' shards, gathered over the world as objects (tiny models only)."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid.megatron.sharding import TPSpec, is_expert, unshard
    from megatron_hybrid.reshard.binding import named_weights

    mine = {}
    for name, _, t in named_weights(chunks):
        rank = ps.get_expert_tensor_parallel_rank() if is_expert(name) else ps.get_tensor_model_parallel_rank()
        mine[name] = (rank, t.detach().clone(), TPSpec.of(t))
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    shards: dict[str, dict[int, tuple[torch.Tensor, Any]]] = {}
    for part in parts:
        for name, (rank, t, spec) in part.items():
            shards.setdefault(name, {})[rank] = (t, spec)
    return {name: unshard([s[r][0] for r in sorted(s)], next(iter(s.values()))[1]) for name, s in shards.items()}


def moe_distopt_case(mode: str, rollout_kw: dict, steps: int = 3) -> dict[str, Any]:
    """An MoE actor in Megatron DDP with the distributed optimizer (Adam): ``steps`` updates without the engine,
    then the same updates through it (a switch to rollout and back after every ``step()``). Returns whether losses
    and parameters are the same bits, the rollout tensors that differ from each step's training weights, and the
    bytes received (all, experts)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.megatron import compat
    from tests.distopt_cases import train_step

    def build():
        torch.manual_seed(1234)
        model_parallel_cuda_manual_seed(1234)
        arch = moe_arch()
        config = arch.transformer_config(
            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
            expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
            expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
            sequence_parallel=ps.get_tensor_model_parallel_world_size() > 1)  # megatron-core's MoE asks for it
        config.finalize_model_grads_func = finalize_model_grads
        stage = arch.build(config, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
        model = DistributedDataParallel(config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True, bucket_size=1500), stage)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0,
                                                           use_distributed_optimizer=True), [model])
        return model, optimizer

    model, optimizer = build()
    ref_losses, ref_states = [], []
    for s in range(steps):
        ref_losses.append(train_step(model, optimizer, s))
        ref_states.append(_full_state([compat.unwrap_model(model)]))
    del model, optimizer

    model, optimizer = build()
    engine = HybridEngine(model, RolloutLayout(**rollout_kw), weight_mode=mode, bucket_size_mb=0.01,
                          optimizer=optimizer)
    buffers = compat.ddp_param_buffers(model)
    spans = engine.placement.spans()
    inside = [any(lo <= b.param_data.data_ptr() < hi for lo, hi in spans) for b in buffers]
    losses, mismatches, moved = [], [], []
    for s in range(steps):
        losses.append(train_step(model, optimizer, s))
        engine.switch_to_rollout()
        report = engine.communication_report()
        moved.append((report["total_bytes"], report["expert_bytes"]))
        mismatches.append(_rollout_mismatches(engine, ref_states[s]))
        engine.switch_to_training()
    params_differ = sorted(n for n, t in _full_state([compat.unwrap_model(model)]).items()
                           if not torch.equal(t, ref_states[-1][n]))
    engine.close()
    return {"losses_equal": losses == ref_losses, "params_differ": params_differ, "mismatches": mismatches,
            "moved": moved, "inside": inside, "num_buffers": len(buffers)}
