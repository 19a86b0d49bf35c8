"""Rank bodies for the FP8 rollout-weight tests (module-level so the harness can send them to its ranks)."""

from __future__ import annotations

from typing import Optional

import torch

from tests.engine_cases import BATCH, SEQ, arch, full_grads, sgd_step, tokens
from tests.pair_cases import present_bytes_in

NEW_TOKENS = 6
PROMPTS = [[5, 17, 3, 99], [42, 7], [1, 2, 3, 4, 5, 6, 7]]


def fp8_reference(arch_kw: dict, state: dict, rollout_tp: int = 1, bf16_layers: tuple = (0, 0)) -> torch.Tensor:
    """World of one: the logits of the unsharded model whose QKV, attention-output, fc1 and fc2 linears compute as
    the FP8 rollout model at rollout TP ``rollout_tp`` does, written independently in plain torch: weights quantized
    per output row of their rollout shard, activations per token, both dequantized in fp32, fp32 matmuls. A
    row-parallel linear's shard holds K / t_g of every row and of every token's features: each of the t_g slices
    is quantized on its own and the partial products are summed (the rollout model's all-reduce). ``bf16_layers``:
    (first, last) layers at either end that keep the model's own linears (first_last_layers_bf16)."""
    from megatron_hybrid.megatron.sharding import load_full_state_dict

    def dequantized(w: torch.Tensor) -> torch.Tensor:  # along the last dim, one scale per row
        w = w.float()
        scale = w.abs().amax(dim=-1, keepdim=True) / 448.0
        scale[scale == 0] = 1.0
        return (w / scale).to(torch.float8_e4m3fn).float() * scale

    def column(input, weight, *args, bias=None, **kwargs):
        y = torch.nn.functional.linear(dequantized(input), dequantized(weight)).to(input.dtype)
        return y if bias is None else y + bias

    def row(input, weight, *args, bias=None, **kwargs):
        parts = [torch.nn.functional.linear(dequantized(x), dequantized(w)).to(input.dtype)
                 for x, w in zip(input.chunk(rollout_tp, dim=-1), weight.chunk(rollout_tp, dim=-1))]
        y = sum(parts[1:], parts[0])
        return y if bias is None else y + bias

    model = arch(**arch_kw).build()
    load_full_state_dict([model], state, tp_rank=0, tp_size=1)
    layers = model.decoder.layers
    for layer in list(layers)[bf16_layers[0]: len(layers) - bf16_layers[1]]:  # megatron-core's linears call their
        attention, mlp = layer.self_attention, layer.mlp                   # _forward_impl: an instance attribute
        attention.linear_qkv._forward_impl = mlp.linear_fc1._forward_impl = column
        attention.linear_proj._forward_impl = mlp.linear_fc2._forward_impl = row
    with torch.no_grad():
        logits = model(tokens(), torch.arange(SEQ).expand(BATCH, -1), None)
    return logits.float()


def references(arch_kw: dict, rollout_tp: int, bf16_layers: tuple = (0, 0)) -> tuple:
    """World of one: the initial and the SGD-stepped unsharded weights (engine_cases' ``reference`` and ``stepped``),
    their logits in the training dtype, and their :func:`fp8_reference` logits at rollout TP ``rollout_tp``."""
    from tests.engine_cases import reference, stepped

    state, logits = reference(arch_kw)
    new_state = stepped(state)
    _, new_logits = reference(arch_kw, new_state)
    fp8 = [fp8_reference(arch_kw, s, rollout_tp, bf16_layers) for s in (state, new_state)]
    return state, new_state, (logits, new_logits), fp8


def _fp8_mismatches(engine, state: dict, bf16_layers: tuple) -> tuple[list[str], int]:
    """The FP8 rollout weights that differ from an independent quantization (``torch.float8_e4m3fn`` cast of the
    fp32 weight over its row amax / 448) of this rank's rollout shard of the unsharded ``state``, bit for bit, scales
    included; and how many were compared."""
    from megatron_hybrid.megatron.sharding import TPSpec, global_name, layer_offset, shard
    from megatron_hybrid.quant.fp8 import is_target, quantize_reference

    bad, seen = [], 0
    t_g = engine.layout.t_g
    for chunk in engine.rollout_chunks:
        off = layer_offset(chunk)
        for name, p in chunk.named_parameters():
            key = global_name(name, off)
            entry = engine.binding.fp8.get(p)
            if (entry is not None) != is_target(key, layers=range(bf16_layers[0], engine.config.num_layers
                                                                 - bf16_layers[1])):
                bad.append(f"{key}: FP8 {entry is not None}")
                continue
            if entry is None:
                continue
            seen += 1
            want_q, want_s = quantize_reference(shard(state[key], TPSpec.of(p), engine.rollout_tp_rank, t_g))
            got_q, got_s = entry
            if not (torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(got_s, want_s)):
                bad.append(key)
    return bad, seen


def fp8_engine_case(arch_kw: dict, rollout_tp: int, rollout_pp: int, state: dict, new_state: dict, *,
                    own_region_min_numel: Optional[int] = None, generate: bool = False,
                    bf16_layers: tuple = (0, 0)) -> dict:
    """The FP8 engine before and after an SGD step: its FP8 weights against an independent quantization of
    ``state`` / ``new_state`` (the stepped unsharded weights), its logits, its memory while rolling out and
    training; with ``generate`` also greedy generation, twice. ``own_region_min_numel``: the plan's size threshold
    for stacked and strided regions, lowered so that the tiny model's QKV and fc1 get them. ``bf16_layers``:
    (first, last), set in the model's config as Megatron's first_last_layers_bf16."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.forward import gather_vocab, pipeline_forward
    from megatron_hybrid.megatron.sharding import load_full_state_dict
    from megatron_hybrid.reshard import plan

    saved = plan.STACKED_MIN_NUMEL
    if own_region_min_numel is not None:
        plan.STACKED_MIN_NUMEL = own_region_min_numel
    try:
        tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
        a = arch(**arch_kw)
        bf16 = dict(first_last_layers_bf16=True, num_layers_at_start_in_bf16=bf16_layers[0],
                    num_layers_at_end_in_bf16=bf16_layers[1]) if any(bf16_layers) else {}
        config = a.transformer_config(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **bf16)
        model = a.build(config, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
        load_full_state_dict([model], state, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp)
        engine = HybridEngine(model, RolloutLayout(rollout_tp, rollout_pp), weight_mode="canonical",
                              rollout_weights="fp8", bucket_size_mb=0.01)
        strided = sorted(engine.plan.strided) if engine.plan is not None else []
    finally:
        plan.STACKED_MIN_NUMEL = saved
    tok, pos = tokens(), torch.arange(SEQ).expand(BATCH, -1)
    entries = [engine.binding.fp8.get(p) for chunk in engine.rollout_chunks for p in chunk.parameters()]
    ends = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for e in entries if e is not None for t in e]
    fp8_spans = [(min(lo for lo, _ in ends), max(hi for _, hi in ends))]  # the FP8 tensors and scales, one range

    def observe(ref_state: dict) -> dict:
        engine.switch_to_rollout()
        report = engine.communication_report()
        mismatches, compared = _fp8_mismatches(engine, ref_state, bf16_layers)
        table = engine.binding.fp8
        with torch.no_grad():
            logits = pipeline_forward(engine.rollout_model, engine.groups["pp"], tok, pos)
            operands = len(table._operands)  # the CPU linears' dequantized operands, kept since the switch
            table.cache_cpu_operands = False  # the same forward with torch._scaled_mm at every call
            try:
                uncached = pipeline_forward(engine.rollout_model, engine.groups["pp"], tok, pos)
            finally:
                del table.cache_cpu_operands
        same_as_scaled_mm = (logits is None and uncached is None) or torch.equal(logits, uncached)
        if logits is not None:
            logits = gather_vocab(logits, engine.groups["tp"]).float()
        rolling = {k: report[k] for k in ("fp8_bytes_mapped", "canonical_bytes_mapped", "peer_bytes_mapped",
                                          "transient_bytes_released", "switch_peak_bytes_mapped")}
        rolling["fp8_resident"] = present_bytes_in(fp8_spans)
        engine.switch_to_training()
        after = engine.communication_report()
        return {"mismatches": mismatches, "compared": compared, "logits": logits, "rolling": rolling,
                "operands": operands, "same_as_scaled_mm": same_as_scaled_mm,
                "training": {"fp8_bytes_mapped": after["fp8_bytes_mapped"],
                             "canonical_bytes_mapped": after["canonical_bytes_mapped"],
                             "fp8_resident": present_bytes_in(fp8_spans), "operands": len(table._operands)},
                "addresses": engine.binding.addresses()}

    first = observe(state)
    # The FP8 bytes this rank's rollout shard needs: one byte per weight element and 4 per row.
    first["fp8_needed"] = sum(p.numel() + 4 * p.shape[0] for chunk in engine.rollout_chunks
                              for p in chunk.parameters() if engine.binding.fp8.get(p) is not None)
    first["strided"] = strided
    first["layers_in_bf16"] = engine.communication_report()["fp8_layers_in_bf16"]
    # An SGD step on the training layout: this rank's shard of the known full gradient (engine_cases.stepped).
    sgd_step(engine.modules, full_grads(state))
    second = observe(new_state)
    out = {"first": first, "second": second}
    if generate:
        from megatron.core.inference.sampling_params import SamplingParams

        greedy = SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS, return_log_probs=True)
        runs = []
        for _ in range(2):
            results = engine.generate(PROMPTS, greedy, vocab_size=250)
            engine.switch_to_training()
            runs.append(([r.generated_tokens for r in results], [r.generated_log_probs for r in results]))
        out["generated"] = runs
    engine.close()
    return out


def bad_inputs_case() -> list[str]:
    """Each bad FP8 input raises ValueError before the engine runs any collective; returns the messages."""
    import pytest
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_hybrid import HybridEngine, RolloutLayout, validation

    class OtherLinear(ColumnParallelLinear):  # stands for a linear without an FP8 twin (Transformer Engine's)
        pass

    def no_collective(*a, **k):
        raise AssertionError("a collective ran before the input was validated")

    model = arch().build(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size())
    other = arch().build(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size())
    other.decoder.layers[0].self_attention.linear_qkv.__class__ = OtherLinear
    saved = {n: getattr(dist, n) for n in ("all_gather_object", "new_group", "all_gather_into_tensor", "broadcast",
                                           "all_reduce")}
    saved_capability = validation.cuda_capability
    messages = []

    def refused(model, **kwargs) -> None:
        with pytest.raises(ValueError) as err:
            HybridEngine(model, RolloutLayout(1, 1), **kwargs)
        messages.append(str(err.value))

    try:
        for n in saved:
            setattr(dist, n, no_collective)
        refused(model, weight_mode="canonical", rollout_weights="fp16")
        refused(model, rollout_weights="fp8")  # weight_mode's default: aliased
        # A GPU without FP8 tensor cores (an A100, 8.0), as the capability lookup would report it.
        validation.cuda_capability = lambda device: (8, 0)
        refused(model, weight_mode="canonical", rollout_weights="fp8")
        validation.cuda_capability = saved_capability
        refused(other, weight_mode="canonical", rollout_weights="fp8")
        config = model.config  # Megatron's first_last_layers_bf16 asking for more layers than the model has
        config.first_last_layers_bf16, config.num_layers_at_start_in_bf16 = True, config.num_layers
        try:
            refused(model, weight_mode="canonical", rollout_weights="fp8")
        finally:
            config.first_last_layers_bf16, config.num_layers_at_start_in_bf16 = False, 1
    finally:
        validation.cuda_capability = saved_capability
        for n, f in saved.items():
            setattr(dist, n, f)
    return messages
