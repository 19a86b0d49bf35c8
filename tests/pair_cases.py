"""Rank bodies for any layout pair (test_any_pair.py): Megatron-LM's resharding test model and pairs through the
HybridEngine, in both weight modes, before and after an optimizer step, with greedy generation."""

from __future__ import annotations

from typing import Optional

import torch

from tests.engine_cases import BATCH, SEQ, full_grads, rollout_full_weights, seeded, sgd_step, stepped

NEW_TOKENS = 4


def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 128, (BATCH, SEQ), generator=g)


def swap_test_arch(**overrides):
    """Megatron-LM's ``tests/unit_tests/resharding/test_model_swap.py`` model: hidden 32, 8 heads / 4 query groups,
    vocabulary 128, tied embeddings, fp32, megatron-core's defaults otherwise (LayerNorm, GELU MLP of 4 × hidden,
    biases, learned absolute positions) on the local spec; 2 layers (the tests pass 4 with pipelines)."""
    from megatron_hybrid.megatron.models import GPTArchitecture

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4, vocab_size=128,
                make_vocab_size_divisible_by=16, max_position_embeddings=64, swiglu=False, normalization="LayerNorm",
                position_embedding_type="learned_absolute", untie_embeddings_and_output_weights=False,
                add_bias_linear=True)
    base.update(overrides)
    return GPTArchitecture(**base)


def prompts_for(dp_rank: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(300 + dp_rank)
    return [torch.randint(0, 128, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
            for _ in range(1 + dp_rank % 2)]


def reference(arch_kw: dict, dp_sizes: list[int]) -> dict:
    """World of one: initial weights, their stepped version, the logits of both and full-recompute greedy decoding
    of every training replica's prompts (``dp_sizes``: the data-parallel sizes whose prompts are needed)."""
    from megatron_hybrid.megatron.sharding import load_full_state_dict
    from tests.inference_cases import recompute_greedy

    model = swap_test_arch(**arch_kw).build()
    state = {}
    for name, p in model.named_parameters():
        w = seeded(name, p.shape, 0) * 0.05
        if p.dim() == 1 and ("norm" in name) and "bias" not in name:
            w = 1.0 + w
        state[name] = w.to(p.dtype)
    out = {"state": state, "stepped": stepped(state)}
    prompts = sorted({tuple(p) for d in dp_sizes for dp in range(d) for p in prompts_for(dp)})
    for phase in ("state", "stepped"):
        load_full_state_dict([model], out[phase], tp_rank=0, tp_size=1)
        with torch.no_grad():
            out[f"{phase}_logits"] = model(tokens(), torch.arange(SEQ).expand(BATCH, -1), None).float()
        greedy = recompute_greedy(model, [list(p) for p in prompts], set(), NEW_TOKENS)
        out[f"{phase}_greedy"] = {p: g for p, g in zip(prompts, greedy)}
    return out


def missing_by_ids(engine, full_shapes: dict[str, tuple[int, ...]], tied: bool) -> int:
    """Bytes this rank misses, counted element by element: every full tensor is numbered, cut into the rank's
    rollout shard and its training shard as Megatron cuts them, and what the rollout shard has that no training
    tensor of the rank has is missing (independent of the plan and of the library's byte formula)."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid.megatron.sharding import TPSpec, global_name, layer_offset, shard

    def key(name: str) -> str:
        return "embedding.word_embeddings.weight" if tied and name == "output_layer.weight" else name

    tp, t = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    held: dict[str, torch.Tensor] = {}
    for chunk in engine.modules:
        for name, p in chunk.named_parameters():
            k = key(global_name(name, layer_offset(chunk)))
            ids = torch.arange(int(torch.Size(full_shapes[k]).numel())).view(full_shapes[k])
            held[k] = shard(ids, TPSpec.of(p), tp, t).flatten()
    total = 0
    for chunk in engine.rollout_chunks:
        for name, p in chunk.named_parameters():
            k = key(global_name(name, layer_offset(chunk)))
            ids = torch.arange(int(torch.Size(full_shapes[k]).numel())).view(full_shapes[k])
            need = shard(ids, TPSpec.of(p), engine.rollout_tp_rank, engine.layout.t_g).flatten()
            have = torch.isin(need, held[k]).sum().item() if k in held else 0
            total += (need.numel() - have) * p.element_size()
    return total


def present_bytes_in(spans: list[tuple[int, int]]) -> int:
    """Bytes of the pages inside ``spans`` that are backed now, page by page from ``/proc/self/pagemap`` (bit 63:
    present, bit 62: swapped): exact, where smaps' per-mapping counts also take in neighbours that the kernel merged
    into the same mapping."""
    import os
    import struct

    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    with open("/proc/self/pagemap", "rb") as f:
        for lo, hi in spans:
            first, last = lo // page, -(-hi // page)
            f.seek(first * 8)
            data = f.read((last - first) * 8)
            for (entry,) in struct.iter_unpack("<Q", data):
                total += page if entry >> 62 & 0b11 else 0
    return total


def _aliased_memory(engine) -> dict:
    """Where an aliased rollout model's weights live while rolling out: every view is inside a training tensor of
    this rank or inside the engine's reserved ranges, and how much of those ranges is backed."""
    train = [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in engine._train_params.values()]
    spans = engine.placement.spans()
    outside = []
    for name, ptrs in engine.binding.addresses().items():
        for ptr in ptrs:
            if not any(lo <= ptr < hi for lo, hi in train + spans):
                outside.append(name)
    return {"outside": outside, "resident": present_bytes_in(spans)}


def _build(arch_kw: dict, vpp: Optional[int]):
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    a = swap_test_arch(**arch_kw)
    if vpp is None:
        config = a.transformer_config(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        return [a.build(config, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())]
    config = a.transformer_config(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  virtual_pipeline_model_parallel_size=vpp)
    return [a.build(config, pre_process=ps.is_pipeline_first_stage(ignore_virtual=True) and vp == 0,
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=True) and vp == vpp - 1, vp_stage=vp)
            for vp in range(vpp)]


def pair_case(arch_kw: dict, rollout_tp: int, rollout_pp: int, ref: dict, *, vpp: Optional[int] = None,
              modes: tuple[str, ...] = ("aliased", "canonical"), sort_ranks: bool = False) -> dict:
    """Per weight mode: an engine on the training model, a switch (rollout weights, logits, bytes), greedy
    generation (aliased: before the step; canonical: after it), an SGD step of the training model and a switch again.
    ``sort_ranks``: process groups list their ranks in global order, as ``new_group`` does before torch 2.13."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.forward import gather_vocab, pipeline_forward
    from megatron_hybrid.inference import GenerationConfig
    from megatron_hybrid.megatron import compat
    from megatron_hybrid.megatron.sharding import load_full_state_dict

    saved = compat.NEW_GROUP_KEEPS_ORDER
    if sort_ranks:
        compat.NEW_GROUP_KEEPS_ORDER = False
    try:
        from megatron.core.inference.sampling_params import SamplingParams

        chunks = _build(arch_kw, vpp)
        full_shapes = {n: tuple(w.shape) for n, w in ref["state"].items()}
        greedy = SamplingParams(temperature=1.0, top_k=1, num_tokens_to_generate=NEW_TOKENS)
        prompts = prompts_for(ps.get_data_parallel_rank())
        out: dict = {"modes": {}}
        for mode in modes:
            load_full_state_dict(chunks, ref["state"], tp_rank=ps.get_tensor_model_parallel_rank(),
                                 tp_size=ps.get_tensor_model_parallel_world_size())
            engine = HybridEngine(chunks if vpp else chunks[0], RolloutLayout(rollout_tp, rollout_pp),
                                  weight_mode=mode)
            runs = {}
            for phase in ("state", "stepped"):
                if phase == "stepped":
                    sgd_step(chunks, full_grads(ref["state"]))
                engine.switch_to_rollout()
                report = engine.communication_report()
                if mode == "aliased":
                    mem = _aliased_memory(engine)
                with torch.no_grad():
                    logits = pipeline_forward(engine.rollout_chunks[0], engine.groups["pp"], tokens(),
                                              torch.arange(SEQ).expand(BATCH, -1))
                runs[phase] = {"weights": rollout_full_weights(engine), "bytes": report["total_bytes"],
                               "collectives": report["num_collectives"],
                               "logits": None if logits is None else gather_vocab(logits, engine.groups["tp"]).float(),
                               "peer_bytes_mapped": report["peer_bytes_mapped"],
                               "canonical_bytes_mapped": report["canonical_bytes_mapped"],
                               "rollout_memory_bytes_mapped": report["rollout_memory_bytes_mapped"]}
                if mode == "aliased":
                    runs[phase]["memory"] = mem
                if (mode, phase) in (("aliased", "state"), ("canonical", "stepped")):
                    results = engine.generate(prompts, greedy, config=GenerationConfig(
                        max_batch_size=4, max_sequence_length=16, cuda_graphs=False))
                    runs[phase]["generated"] = {tuple(p): r.generated_tokens for p, r in zip(prompts, results)}
                engine.switch_to_training()
                if mode == "aliased":
                    runs[phase]["resident_after"] = present_bytes_in(engine.placement.spans())
            runs["expected_bytes"] = missing_by_ids(
                engine, full_shapes, tied=not swap_test_arch(**arch_kw).untie_embeddings_and_output_weights)
            runs["exchange"] = engine.layout.exchange
            runs["arrangement"] = (engine.rollout_tp_rank, engine.rollout_pp_rank, engine.rollout_replica)
            engine.close()
            out["modes"][mode] = runs
        return out
    finally:
        compat.NEW_GROUP_KEEPS_ORDER = saved
