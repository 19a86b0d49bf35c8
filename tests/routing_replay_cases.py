"""Rank bodies for test_routing_replay.py: the generator's routing record against the routers of a full forward, and
routing replay in the training passes (rollout at TP=1, training at TP=2, bf16)."""

from __future__ import annotations

import torch

from tests import moe_generation_cases as gen

VOCAB = gen.VOCAB


def _router_topk(model, seqs: list[list[int]]) -> dict[int, list[torch.Tensor]]:
    """This stage's MoE layers in a forward of ``model`` (every stage runs it) over the right-padded ``seqs``: per
    layer ordinal among the model's MoE layers, per sequence, ``[len, k]``: the experts megatron's router chose for
    each token (read by forward hooks from its routing map), ascending."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid.forward import pipeline_forward
    from megatron_hybrid.rl.routing import moe_routers

    routers = moe_routers(model)
    width = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, s in enumerate(seqs):
        tokens[row, : len(s)] = torch.tensor(s)
    maps: dict[int, torch.Tensor] = {}

    def capture(ordinal):
        return lambda module, args, out: maps.__setitem__(ordinal, out[1].detach())

    handles = [router.register_forward_hook(capture(ordinal)) for ordinal, router in routers]
    try:
        with torch.no_grad():
            pipeline_forward(model, ps.get_pipeline_model_parallel_group(), tokens,
                             torch.arange(width).expand(len(seqs), -1))
    finally:
        for h in handles:
            h.remove()
    out = {}
    for ordinal, router in routers:  # routing map [S*B, E] (sequence-major) -> each token's k experts
        experts = maps[ordinal].view(width, len(seqs), -1).transpose(0, 1).float().topk(router.topk, dim=-1)
        out[ordinal] = [experts.indices.sort(-1).values[b, : len(s)] for b, s in enumerate(seqs)]
    return out


def _compared(results, model) -> dict:
    """The records (experts ascending) of this stage's MoE layers against :func:`_router_topk` of prompt + response
    without its last token (never an input)."""
    seqs = [r.prompt_tokens + r.generated_tokens[:-1] for r in results]
    expected = _router_topk(model, seqs)
    records = [r.routed_experts.sort(-1).values for r in results]
    return {"shapes": [tuple(r.shape) for r in records], "lengths": [len(s) for s in seqs],
            "layers": sorted(expected), "dtype": str(results[0].routed_experts.dtype),
            "differ": sum(int((rec[:, m] != exp).any(-1).sum()) for m, per_seq in expected.items()
                          for rec, exp in zip(records, per_seq)),
            "unfilled": sum(int((rec < 0).sum()) for rec in records)}


def record_case(arch_kw: dict, *, count: int, slots: int, mixed: int = 0, bucketed: bool = False) -> dict:
    """One rank: greedy generation with ``record_routing`` (refills, stop tokens; ``mixed``: prompts riding along
    decode steps; ``bucketed``: the graph-step path, slots compacted), the records against the routers of a full
    forward over each prompt + response."""
    from megatron.core.inference.sampling_params import SamplingParams

    torch.manual_seed(3)
    model = gen.moe_arch(**arch_kw).build()
    model.eval()
    gen.rehome_experts(model)
    prompts = gen.prompts_for(500, count)
    reference = gen.recompute_greedy(model, prompts, gen.NEW_TOKENS)
    stops = gen.stop_tokens(reference)
    generator = gen._generator(model, slots, mixed, bucketed=bucketed, record_routing=True)
    params = SamplingParams(top_k=1, num_tokens_to_generate=gen.NEW_TOKENS)
    results = generator.generate(prompts, params, vocab_size=VOCAB, stop_token_ids=stops)
    generator.close()
    return {"generated": [r.generated_tokens for r in results], "reference": gen.truncated(reference, stops),
            **_compared(results, model)}


def pipeline_record_case(arch_kw: dict, *, count: int) -> dict:
    """Two pipeline stages (the harness's PP=2), greedy generation on the stage models themselves
    (``generate_with_model``) with ``record_routing``: every rank's records hold every MoE layer; each stage checks
    its own layers' columns against its routers in a pipeline forward."""
    from megatron.core import parallel_state as ps
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid.inference import GenerationConfig, generate_with_model

    torch.manual_seed(3)
    model = gen.moe_arch(**arch_kw).build(pipeline_model_parallel_size=2, pre_process=ps.is_pipeline_first_stage(),
                                          post_process=ps.is_pipeline_last_stage())
    model.eval()
    prompts = gen.prompts_for(500, count)
    config = GenerationConfig(max_batch_size=3, max_sequence_length=gen.MAX_LEN, cuda_graphs=False,
                              record_routing=True)
    results = generate_with_model(model, prompts, SamplingParams(top_k=1, num_tokens_to_generate=gen.NEW_TOKENS),
                                  tp_group=ps.get_tensor_model_parallel_group(),
                                  pp_group=ps.get_pipeline_model_parallel_group(), config=config, vocab_size=VOCAB)
    return _compared(results, model)


def replay_case(arch_kw: dict, *, count: int, new_tokens: int, seed: int, micro_batch_size: int,
                max_tokens_per_micro_batch: int | None = None) -> dict:
    """Two ranks, training TP=2 with sequence parallelism, the HybridEngine's rollout at TP=1 (two replicas), bf16:
    sampled generation with a routing record, then the log-prob pass and a training (forward-backward) pass of the
    same weights built without routing replay and with it (``moe_enable_routing_replay``), each counting the tokens routed
    differently from the rollout and comparing its log-probs with the rollout's. With ``max_tokens_per_micro_batch``
    the passes are packed (``sdpa`` attention)."""
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
        backend = "local" if max_tokens_per_micro_batch is None else "sdpa"
        return arch.build(config, attention_backend=backend).to(arch.dtype)  # bf16, as rl.build_stage casts

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
    passes = TrainingPasses(PassConfig(seq_length, micro_batch_size, VOCAB,
                                       max_tokens_per_micro_batch=max_tokens_per_micro_batch))
    g = torch.Generator().manual_seed(seed)
    batch.data["advantages"] = torch.randn(batch.mask_BN.shape, generator=g) * batch.mask_BN

    def policy_loss(output, mb):
        logp, _ = passes.token_stats(output, mb)
        loss, stats = ppo.policy_loss(logp, mb["old_logp"], mb["advantages"], mb["mask"], clip_ratio=0.2,
                                      clip_ratio_high=None, rollout_logp_BT=mb["rollout_logp"],
                                      tis_imp_ratio_cap=None)
        return loss, {"loss": loss.detach()}

    out = {"record_shapes": [tuple(r.routed_experts.shape) for r in results],
           "packs": [mb["tokens"].shape[-1] for mb in passes.micro_batches(batch)],
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


def recipe_case(argv: list[str], *, steps: int) -> list[dict]:
    """The PPO recipe's steps (examples/ppo/train_ppo.py's Trainer) with ``--moe-enable-routing-replay`` on its
    built-in task, the architecture given experts (the recipe's MoE flags are another change's): every step's
    metrics."""
    import dataclasses
    import runpy

    from megatron_hybrid import rl

    from tests.ppo_cases import RECIPE

    recipe = runpy.run_path(RECIPE, run_name="recipe")
    args = recipe["parse_args"](argv)
    args.moe_enable_routing_replay = True
    task = rl.load_task(args)
    task = dataclasses.replace(task, arch=dataclasses.replace(task.arch, num_experts=8, moe_router_topk=2,
                                                                   moe_ffn_hidden_size=32),
                               generation=dataclasses.replace(task.generation, record_routing=True))
    with rl.initialize(args):
        trainer = recipe["Trainer"](args, task)
        return [trainer.train_step() for _ in range(steps)]


def replay_refuses_full_recompute_case() -> str:
    """One rank: a TrainingRouting that replays, on a tiny MoE stage built with routing replay and full activation
    recompute (rl.build_stage's config); returns the ValueError's message (empty when nothing was raised)."""
    from megatron_hybrid import rl
    from megatron_hybrid.megatron.compat import megatron_groups
    from megatron_hybrid.rl.routing import TrainingRouting, moe_routers

    model = rl.build_stage(gen.moe_arch(), device=torch.device("cpu"), moe_enable_routing_replay=True,
                           recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    num_moe = len(moe_routers(model))
    tp, pp, _, _ = megatron_groups()
    try:
        TrainingRouting(model, torch.zeros(1, 4, num_moe, model.config.moe_router_topk, dtype=torch.long),
                        tp_group=tp, pp_group=pp, replay=True)
    except ValueError as error:
        return str(error)
    return ""
