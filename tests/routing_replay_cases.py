"""Rank bodies for test_routing_replay.py: the generator's routing record against the routers of a full forward, and
routing replay in the training passes (rollout at TP=1, training at TP=2, bf16)."""

from __future__ import annotations

import torch

from tests import moe_generation_cases as gen

VOCAB = gen.VOCAB


def _router_topk(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, ``[len, M, k]``: every MoE layer's top-k experts of each token in a full forward of the one-
    stage ``model`` over the right-padded sequences (megatron's routers, read by forward hooks)."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    width = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, s in enumerate(seqs):
        tokens[row, : len(s)] = torch.tensor(s)
    maps: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda mod, args, out: maps.append(out[1].detach())) for r in routers]
    try:
        with torch.no_grad():
            model(tokens, torch.arange(width).expand(len(seqs), -1), None)
    finally:
        for h in handles:
            h.remove()
    k = routers[0].topk
    # routing_map [S*B, E] (sequence-major) -> the k experts of each token, ascending
    experts = [m.view(width, len(seqs), -1).transpose(0, 1).float().topk(k, dim=-1).indices.sort(-1).values
               for m in maps]
    per_seq = torch.stack(experts, dim=2)  # [B, S, M, k]
    return [per_seq[b, : len(s)] for b, s in enumerate(seqs)]


def record_case(arch_kw: dict, *, count: int, slots: int, mixed: int = 0, bucketed: bool = False) -> dict:
    """One rank: greedy generation with ``record_routing`` (refills, stop tokens; ``mixed``: prompts riding along
    decode steps; ``bucketed``: the graph-step path, slots compacted), the records against the routers of a full
    forward over each prompt + response (all but its last token)."""
    import dataclasses

    from megatron.core.inference.sampling_params import SamplingParams

    torch.manual_seed(3)
    model = gen.moe_arch(**arch_kw).build()
    model.eval()
    gen.rehome_experts(model)
    prompts = gen.prompts_for(500, count)
    reference = gen.recompute_greedy(model, prompts, gen.NEW_TOKENS)
    stops = gen.stop_tokens(reference)
    generator = gen._generator(model, slots, mixed, bucketed=bucketed)
    generator.config = dataclasses.replace(generator.config, record_routing=True)
    generator.runner.config = generator.config
    generator.runner.records_routing = True
    params = SamplingParams(top_k=1, num_tokens_to_generate=gen.NEW_TOKENS)
    results = generator.generate(prompts, params, vocab_size=VOCAB, stop_token_ids=stops)
    seqs = [r.prompt_tokens + r.generated_tokens[:-1] for r in results]
    expected = _router_topk(model, seqs)
    report = generator.report()
    generator.close()
    return {"generated": [r.generated_tokens for r in results], "reference": gen.truncated(reference, stops),
            "records": [r.routed_experts.sort(-1).values for r in results], "expected": expected,
            "dtype": str(results[0].routed_experts.dtype), "report": report}


def replay_case(arch_kw: dict, *, count: int, new_tokens: int, seed: int, micro_batch_size: int) -> dict:
    """Two ranks, training TP=2 with sequence parallelism, the HybridEngine's rollout at TP=1 (two replicas), bf16: sampled generation with
    a routing record, then the log-prob pass and a training (forward-backward) pass of the same weights built
    without routing replay and with it (``moe_enable_routing_replay``), each counting the tokens routed
    differently from the rollout and comparing its log-probs with the rollout's."""
    from megatron.core import parallel_state as ps
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.inference import GenerationConfig
    from megatron_hybrid.rl import PassConfig, TrainingPasses, copy_weights, make_batch, padded_seq_length, ppo

    tp = ps.get_tensor_model_parallel_world_size()
    arch = gen.moe_arch(params_dtype="bfloat16", **arch_kw)

    def build(replay: bool):
        # MoE layers train under TP only with sequence parallelism (megatron-core refuses otherwise)
        config = arch.transformer_config(tensor_model_parallel_size=tp, sequence_parallel=True,
                                         moe_enable_routing_replay=replay)
        return arch.build(config).to(arch.dtype)  # every parameter bf16, as rl.build_stage casts them

    plain, replayed = build(False), build(True)
    copy_weights(replayed, plain)
    engine = HybridEngine(plain, RolloutLayout(1, 1))
    prompts = gen.prompts_for(seed, count)
    params = SamplingParams(temperature=1.0, num_tokens_to_generate=new_tokens)
    config = GenerationConfig(max_batch_size=count, max_sequence_length=gen.MAX_LEN, record_routing=True)
    results = engine.generate(prompts, params, vocab_size=VOCAB, seed=seed, tempered_log_probs=True, config=config)
    engine.switch_to_training()
    responses = [r.generated_tokens for r in results]
    seq_length = padded_seq_length(max(len(p) for p in prompts) + new_tokens, sequence_parallel=True)
    batch = make_batch(prompts, responses, max_new_tokens=new_tokens, seq_length=seq_length,
                       device=torch.device("cpu"), rollout_log_probs=[r.generated_tempered_log_probs for r in results],
                       routed_experts=[r.routed_experts for r in results])
    passes = TrainingPasses(PassConfig(seq_length, micro_batch_size, VOCAB))
    g = torch.Generator().manual_seed(seed)
    batch.data["advantages"] = torch.randn(batch.mask_BN.shape, generator=g) * batch.mask_BN

    def policy_loss(output, mb):
        logp, _ = passes.token_stats(output, mb)
        loss, stats = ppo.policy_loss(logp, mb["old_logp"], mb["advantages"], mb["mask"], clip_ratio=0.2,
                                      clip_ratio_high=None, rollout_logp_BT=mb["rollout_logp"],
                                      tis_imp_ratio_cap=None)
        return loss, {"loss": loss.detach()}

    out = {"record_shapes": [tuple(r.routed_experts.shape) for r in results],
           "lengths": [len(p) + len(r) for p, r in zip(prompts, responses)]}
    for name, model in (("plain", plain), ("replay", replayed)):
        with passes.routing_metrics(model, batch) as metrics:
            logp, _ = passes.log_probs(model, batch)
        log_prob_pass = metrics()
        batch.data["old_logp"] = logp
        with passes.routing_metrics(model, batch) as metrics:
            stats = passes.run(model, batch, policy_loss, forward_only=False)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        out[name] = {"log_prob_pass": log_prob_pass, "update_pass": metrics(),
                     "mismatch": {k: float(v) for k, v in ppo.rollout_mismatch(logp, batch.data["rollout_logp"],
                                                                               batch.mask_BN).items()},
                     "losses": [float(s["loss"]) for s in stats],
                     "grads": len(grads), "finite_grads": all(bool(torch.isfinite(g).all()) for g in grads)}
    return out
