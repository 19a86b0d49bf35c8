"""Rank bodies for the megatron_hybrid.rl tests (module-level so the harness can send them to its ranks)."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

VOCAB, PROMPT, NEW = 16, 4, 8


def recipe_args(*argv: str) -> argparse.Namespace:
    """The recipe's flags (Megatron-LM names and ours), parsed and validated for this world."""
    from megatron_hybrid.rl.arguments import add_hybrid_args, add_megatron_args, validate_args

    args = add_hybrid_args(add_megatron_args(argparse.ArgumentParser())).parse_args(list(argv))
    validate_args(args, dist.get_world_size() if dist.is_initialized() else 1)
    return args


def _batch(seed: int, num: int):
    from megatron_hybrid import rl

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, VOCAB, (num, PROMPT), generator=g).tolist()
    responses = torch.randint(0, VOCAB, (num, NEW), generator=g).tolist()
    return rl.make_batch(prompts, responses, max_new_tokens=NEW, seq_length=PROMPT + NEW, device=torch.device("cpu"))


def _nll(passes):
    """A loss through the recipe's log-prob path: the mean negative log-likelihood of the response tokens."""
    from megatron_hybrid.rl import ppo

    def loss_fn(output, mb):
        logp, _ = passes.token_stats(output, mb)
        loss = -ppo.masked_mean(logp, mb["mask"])
        return loss, {"nll": loss.detach()}
    return loss_fn


def _objects(obj, group) -> list:
    out = [None] * group.size()
    dist.all_gather_object(out, obj, group=group)
    return out


def _full(model, select) -> dict[str, torch.Tensor]:
    """``select(param)`` of every parameter as a full tensor by global name, gathered over TP and PP. The last
    stage's copy of a tied embedding is reported as ``tied:output_layer.weight``."""
    from megatron_hybrid.megatron.compat import megatron_groups, unwrap_model
    from megatron_hybrid.megatron.sharding import TPSpec, global_name, layer_offset, unshard

    tp, pp, _, _ = megatron_groups()
    module = unwrap_model(model)
    offset = layer_offset(module)
    local = {}
    for name, p in module.named_parameters():
        key = global_name(name, offset)
        if getattr(p, "shared_embedding", False) and name.startswith("output_layer"):
            key = "tied:" + key
        local[key] = (select(p).detach().cpu().clone(), TPSpec.of(p))
    parts = _objects(local, tp)
    merged = {k: unshard([part[k][0] for part in parts], spec) for k, (_, spec) in local.items()}
    full: dict[str, torch.Tensor] = {}
    for stage in _objects(merged, pp):
        full.update(stage)
    return full


def _spy_main_grads(trained) -> dict:
    """A dict that the next ``trained.optimizer.step()`` fills with the full fp32 main gradients it steps with."""
    grads: dict = {}
    step = trained.optimizer.step

    def spying_step():
        grads.update(_full(trained.model, lambda p: p.main_grad))
        return step()

    trained.optimizer.step = spying_step
    return grads


#: Acceptance 2's run: bf16, a warmup of 4 iterations then cosine decay to --min-lr at iteration 10, AdamW with
#: weight decay, and a clip that bites (the NLL's gradient norm here is ~1).
OPTIMIZER_FLAGS = ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--bf16",
                   "--lr", "0.01", "--min-lr", "0.001", "--lr-warmup-iters", "4", "--lr-decay-style", "cosine",
                   "--train-iters", "10", "--weight-decay", "0.1", "--adam-beta2", "0.95", "--adam-eps", "1e-6",
                   "--clip-grad", "0.3", "--global-batch-size", "8", "--micro-batch-size", "2")


def optimizer_step_case() -> list[dict]:
    """Two updates through :func:`megatron_hybrid.rl.update`, the first one iteration into the warmup, the second
    at the end of the decay; per update the full fp32 main gradients and main parameters before it (read just
    before ``optimizer.step()``), the full fp32 main and bf16 parameters after it, and the reported norm."""
    from megatron_hybrid import rl
    from megatron_hybrid.megatron.compat import megatron_groups

    args = recipe_args(*OPTIMIZER_FLAGS)
    arch = rl.architecture_from_args(args, VOCAB)
    trained = rl.setup_model_and_optimizer(rl.build_stage(arch, device=torch.device("cpu")), args)
    passes = rl.TrainingPasses(rl.PassConfig(PROMPT + NEW, args.micro_batch_size, VOCAB))
    dp = megatron_groups()[2].rank()
    samples = args.global_batch_size
    before: dict = {}
    step = trained.optimizer.step

    def spying_step():
        before["grads"] = _full(trained.model, lambda p: p.main_grad)
        before["main"] = _full(trained.model, lambda p: p.main_param)
        return step()

    trained.optimizer.step = spying_step
    out = []
    decay_iters = args.train_iters
    for increment, seed in ((1 * samples, 1), ((decay_iters - 1) * samples, 2)):
        trained.scheduler.step(increment=increment)
        result = rl.update(trained, _batch(100 * seed + dp, samples // 2), _nll(passes), passes=passes, step=seed)
        out.append({"grad_norm": result.grad_norm, "lr": trained.optimizer.param_groups[0]["lr"], **before,
                    "main_after": _full(trained.model, lambda p: p.main_param),
                    "bf16_after": _full(trained.model, lambda p: p)})
    return out


def moe_aux_loss_case(coeff: float) -> dict:
    """One update of a tiny MoE actor (left in eval mode) whose own loss is 0 × its output: the gradient is the
    routers' load-balancing loss alone, if :func:`megatron_hybrid.rl.update` trains with it. Returns the reported
    aux losses, the gradient norm and the routers' fp32 main gradients."""
    from megatron_hybrid import rl

    args = recipe_args("--tensor-model-parallel-size", "1", "--num-experts", "4", "--moe-aux-loss-coeff", str(coeff),
                       "--global-batch-size", "8", "--micro-batch-size", "2")
    trained = rl.setup_model_and_optimizer(rl.build_stage(rl.architecture_from_args(args, VOCAB),
                                                          device=torch.device("cpu")), args)
    trained.model.eval()
    passes = rl.TrainingPasses(rl.PassConfig(PROMPT + NEW, args.micro_batch_size, VOCAB))
    grads: dict = {}
    step = trained.optimizer.step

    def spying_step():
        grads.update({n: p.main_grad.clone() for n, p in trained.model.named_parameters() if ".router." in n})
        return step()

    trained.optimizer.step = spying_step
    result = rl.update(trained, _batch(3, 8), lambda output, mb: (output.sum() * 0, {}), passes=passes, step=1)
    return {"aux": result.aux_losses, "grad_norm": result.grad_norm, "router_grads": grads}


def offload_case() -> dict:
    """Megatron's optimizers leave the device while rolling out and come back bit for bit: the recipe's actor
    optimizer (a ChainedOptimizer around one Float16OptimizerWithFloat16Params, bf16 parameters) and a
    ChainedOptimizer of two (actor and critic)."""
    from megatron.core.optimizer import ChainedOptimizer

    from megatron_hybrid import HybridEngine, RolloutLayout, rl

    args = recipe_args("--bf16", "--global-batch-size", "4", "--micro-batch-size", "2")
    arch = rl.architecture_from_args(args, VOCAB)
    actor_stage = rl.build_stage(arch, device=torch.device("cpu"))
    actor = rl.setup_model_and_optimizer(actor_stage, args)
    critic = rl.setup_model_and_optimizer(rl.build_critic(actor_stage, arch, device=torch.device("cpu")), args)
    passes = rl.TrainingPasses(rl.PassConfig(PROMPT + NEW, 2, VOCAB))
    batch = _batch(dist.get_rank() // 2, 4)
    rl.update(actor, batch, _nll(passes), passes=passes, step=1)
    rl.update(critic, batch, lambda out, mb: (rl.response_values(out, mb).square().mean(), {}), passes=passes,
              step=1)
    engine = HybridEngine(actor.model, RolloutLayout(1, 1))
    inner = actor.optimizer.chained_optimizers + critic.optimizer.chained_optimizers

    report = {}
    for name, optimizer, covered in (("actor", actor.optimizer, inner[:1]),
                                     ("chained", ChainedOptimizer(inner), inner)):
        states = [v for opt in covered for s in opt.optimizer.state.values() for v in s.values() if v.dim() > 0]
        mains = [p for opt in covered for group in opt.fp32_from_float16_groups for p in group]
        saved = [t.clone() for t in states + mains]
        params = [p.clone() for p in actor.model.parameters()]
        engine.switch_to_rollout(offload_optimizer=optimizer)
        resident = sum(t.untyped_storage().nbytes() for t in states + mains)
        params_there = all(torch.equal(p, q) for p, q in zip(actor.model.parameters(), params))
        engine.switch_to_training()
        report[name] = {"num_states": len(states), "num_mains": len(mains), "resident": resident,
                        "params_there": params_there,
                        "same": all(torch.equal(t, s) for t, s in zip(states + mains, saved))}
    engine.close()
    return report


def _uneven_batch(seed: int, num: int):
    """``num`` sequences whose responses have 1 to NEW tokens (drawn): micro-batches of unequal token counts."""
    from megatron_hybrid import rl

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, VOCAB, (num, PROMPT), generator=g).tolist()
    responses = [torch.randint(0, VOCAB, (int(torch.randint(1, NEW + 1, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(num)]
    return rl.make_batch(prompts, responses, max_new_tokens=NEW, seq_length=PROMPT + NEW, device=torch.device("cpu"))


def token_mean_gradient_case(micro_batch_size: int, *, sequences: int = 8) -> dict:
    """The fp32 main gradients of one :func:`megatron_hybrid.rl.update` on the same ``sequences`` uneven sequences,
    split over the data-parallel ranks (in rank order) and into micro-batches of ``micro_batch_size``; the loss is
    the recipe's kind, a token mean per micro-batch (the NLL). Also each micro-batch's token count and mean NLL."""
    from megatron_hybrid import rl
    from megatron_hybrid.megatron.compat import megatron_groups

    dp_group = megatron_groups()[2]
    per_rank = sequences // dp_group.size()
    args = recipe_args("--tensor-model-parallel-size", "1", "--global-batch-size", str(sequences),
                       "--micro-batch-size", str(micro_batch_size))
    torch.manual_seed(5)  # the same initial weights on every layout
    trained = rl.setup_model_and_optimizer(rl.build_stage(rl.architecture_from_args(args, VOCAB),
                                                          device=torch.device("cpu")), args)
    passes = rl.TrainingPasses(rl.PassConfig(PROMPT + NEW, micro_batch_size, VOCAB))
    whole = _uneven_batch(11, sequences)
    lo = dp_group.rank() * per_rank
    mine = rl.Batch(whole.tokens_BS[lo: lo + per_rank], whole.index_BN[lo: lo + per_rank],
                    whole.mask_BN[lo: lo + per_rank], whole.scores_B[lo: lo + per_rank],
                    {k: v[lo: lo + per_rank] for k, v in whole.data.items()})
    grads = _spy_main_grads(trained)
    result = rl.update(trained, mine, _nll(passes), passes=passes, step=1)
    return {"grads": grads, "tokens": result.tokens, "nll": [float(s["nll"]) for s in result.stats],
            "mean_nll": result.mean("nll")}


def _ragged_batch(seed: int, num: int, *, prompt_max: int = 9, new: int = NEW, multiple: int = 1):
    """``num`` sequences with prompts of 1 to ``prompt_max`` tokens and responses of 1 to ``new`` tokens, padded to
    a multiple of ``multiple``."""
    from megatron_hybrid import rl

    g = torch.Generator().manual_seed(seed)

    def draw(hi: int) -> list[int]:
        return torch.randint(0, VOCAB, (int(torch.randint(1, hi + 1, (1,), generator=g)),), generator=g).tolist()

    prompts = [draw(prompt_max) for _ in range(num)]
    responses = [draw(new) for _ in range(num)]
    seq_length = -(-(max(map(len, prompts)) + new) // multiple) * multiple
    return rl.make_batch(prompts, responses, max_new_tokens=new, seq_length=seq_length, device=torch.device("cpu"))


def packed_passes_case(capacity: int, chunk: int, arch_overrides: dict) -> dict:
    """One rank: an actor and a critic (random value head) with ``sdpa`` attention, their passes over 10 ragged
    sequences padded (micro-batches of 3) and packed (at most ``capacity`` tokens, log-probs ``chunk`` positions at a
    time); the same padded passes of a copy with megatron-core's ``local`` attention; and the gradients of one
    token-mean NLL backward both ways. Returns every result."""
    import dataclasses

    from megatron_hybrid import rl
    from megatron_hybrid.rl.packing import packed_micro_batches

    args = recipe_args("--tensor-model-parallel-size", "1")
    arch = dataclasses.replace(rl.architecture_from_args(args, VOCAB), **arch_overrides)
    cpu = torch.device("cpu")
    torch.manual_seed(7)
    actor = rl.build_stage(arch, device=cpu, attention_backend="sdpa")
    critic = rl.build_critic(actor, arch, device=cpu, attention_backend="sdpa")
    for p in critic.output_layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    local_actor = rl.build_stage(arch, device=cpu)
    local_critic = rl.build_critic(local_actor, arch, device=cpu)
    rl.copy_weights(local_actor, actor)
    rl.copy_weights(local_critic, critic)
    batch = _ragged_batch(3, 10)
    seq_length = batch.tokens_BS.shape[1]
    padded = rl.TrainingPasses(rl.PassConfig(seq_length, 3, VOCAB))
    packed = rl.TrainingPasses(rl.PassConfig(seq_length, 3, VOCAB, max_tokens_per_micro_batch=capacity,
                                             logit_chunk_tokens=chunk))
    out = {"packs": [mb["rows"].tolist() for mb in packed_micro_batches(batch, capacity)],
           "mask": batch.mask_BN.clone()}
    for name, passes, a, c in (("padded", padded, actor, critic), ("packed", packed, actor, critic),
                               ("local", padded, local_actor, local_critic)):
        logp, ent = passes.log_probs(a, batch)
        out[name] = {"logp": logp, "entropy": ent, "values": passes.values(c, batch),
                     "scores": passes.scores(c, batch)}
        a.zero_grad()
        # The NLL's gradient, token-mean over the batch: the same objective packed or padded.
        with torch.enable_grad():
            total = torch.zeros(())
            for mb in passes.micro_batches(batch):
                output = a(mb["tokens"], mb["positions"] if "positions" in mb else
                           torch.arange(mb["tokens"].shape[1]).unsqueeze(0).expand_as(mb["tokens"]), None,
                           **({"packed_seq_params": rl.passes._packed_seq_params(mb)} if "cu_seqlens" in mb else {}))
                lp, _ = passes.token_stats(output, mb)
                total = total - (lp * mb["mask"]).sum()
            (total / batch.mask_BN.sum()).backward()
        out[name]["grads"] = {n: p.grad.clone() for n, p in a.named_parameters() if p.grad is not None}
    return out


def packed_dp_gradient_case(capacity: int, balance: bool, *, sequences: int = 8) -> dict:
    """The fp32 main gradients of one packed :func:`megatron_hybrid.rl.update` (``sdpa`` attention, at most
    ``capacity`` tokens a micro-batch) on ``sequences`` ragged sequences, split over the data-parallel ranks
    longest first (rank 0 gets the long ones: the ranks' token counts differ by several times), moved between the
    ranks by :func:`megatron_hybrid.rl.balance_batch` in units of 2 when ``balance``. Also the rank's sequences (as
    token lists, after any move), its micro-batches' token counts and the balance's report."""
    from megatron_hybrid import rl
    from megatron_hybrid.megatron.compat import megatron_groups
    from megatron_hybrid.rl.packing import first_fit_decreasing

    dp_group = megatron_groups()[2]
    per_rank = sequences // dp_group.size()
    args = recipe_args("--tensor-model-parallel-size", "1", "--global-batch-size", str(sequences),
                       "--micro-batch-size", "1")
    torch.manual_seed(5)  # the same initial weights on every layout
    trained = rl.setup_model_and_optimizer(rl.build_stage(rl.architecture_from_args(args, VOCAB),
                                                          device=torch.device("cpu"), attention_backend="sdpa"), args)
    whole = _ragged_batch(8, sequences)  # pairs of 11 to 32 tokens
    seq_length = whole.tokens_BS.shape[1]
    passes = rl.TrainingPasses(rl.PassConfig(seq_length, 1, VOCAB, max_tokens_per_micro_batch=capacity))
    # Pairs (units of 2) ordered by their tokens, longest first: rank 0 the longest pairs.
    lengths = (whole.data["end"] + 1).view(-1, 2).sum(1)
    pairs = sorted(range(sequences // 2), key=lambda u: (-int(lengths[u]), u))
    rows = torch.tensor([2 * u + k for u in pairs for k in (0, 1)])
    rows = rows[dp_group.rank() * per_rank: (dp_group.rank() + 1) * per_rank]
    mine = rl.Batch(whole.tokens_BS[rows], whole.index_BN[rows], whole.mask_BN[rows], whole.scores_B[rows],
                    {k: v[rows] for k, v in whole.data.items()})
    mine.scores_B = rows.float()  # where each sequence came from, moved with it
    own_packs = len(first_fit_decreasing((mine.data["end"] + 1).tolist(), capacity))
    report = None
    if balance:
        mine, info = rl.balance_batch(mine, unit_size=2, group=dp_group)
        report = {"before": info.tokens_before, "after": info.tokens_after, "sent": info.sequences_sent,
                  "metrics": info.metrics()}
    grads = _spy_main_grads(trained)
    result = rl.update(trained, mine, _nll(passes), passes=passes, step=1)
    lengths_mine = (mine.data["end"] + 1).tolist()
    return {"grads": grads, "tokens": result.tokens, "origin": mine.scores_B.long().tolist(),
            "sequences": [mine.tokens_BS[b, :n].tolist() for b, n in enumerate(lengths_mine)],
            "whole": [whole.tokens_BS[b, :n].tolist() for b, n in enumerate((whole.data["end"] + 1).tolist())],
            "own_packs": own_packs, "report": report}


def packed_layout_case(capacity: int, sequence_parallel: bool) -> dict:
    """On the harness's TP/PP layout (DP 1): an actor and a critic (random value head) with ``sdpa`` attention,
    built twice from one seed; the passes over 10 ragged sequences padded (micro-batches of 2) with one and packed
    (at most ``capacity`` tokens, log-probs 5 positions at a time) with the other: log-probs, entropies, values,
    scores, then the full fp32 main gradients of one :func:`megatron_hybrid.rl.update` with the token-mean NLL.
    Also the packs' token lengths and the last stage's flag."""
    from megatron_hybrid import rl
    from megatron_hybrid.megatron.compat import megatron_groups

    tp, pp, _, _ = megatron_groups()
    argv = ["--tensor-model-parallel-size", str(tp.size()), "--pipeline-model-parallel-size", str(pp.size()),
            "--global-batch-size", "10", "--micro-batch-size", "2", "--attention-backend", "sdpa"]
    args = recipe_args(*argv, *(["--sequence-parallel"] if sequence_parallel else []))
    arch = rl.architecture_from_args(args, VOCAB)
    cpu = torch.device("cpu")
    batch = _ragged_batch(3, 10, multiple=tp.size())
    seq_length = batch.tokens_BS.shape[1]
    out: dict = {"last_stage": pp.rank() == pp.size() - 1, "mask": batch.mask_BN.clone()}
    for name, budget in (("padded", None), ("packed", capacity)):
        torch.manual_seed(7)
        kw = dict(device=cpu, sequence_parallel=sequence_parallel, attention_backend="sdpa")
        actor = rl.build_stage(arch, **kw)
        critic = rl.build_critic(actor, arch, **kw)
        if pp.rank() == pp.size() - 1:
            for p in critic.output_layer.parameters():
                torch.nn.init.normal_(p, std=0.5)
        trained = rl.setup_model_and_optimizer(actor, args)
        passes = rl.TrainingPasses(rl.PassConfig(seq_length, 2, VOCAB, max_tokens_per_micro_batch=budget,
                                                 logit_chunk_tokens=5))
        res: dict = {"packs": [mb["tokens"].shape[1] for mb in passes.micro_batches(batch)]}
        logp = passes.log_probs(trained.model, batch)
        res.update(logp=None if logp is None else logp[0], entropy=None if logp is None else logp[1],
                   values=passes.values(critic, batch), scores=passes.scores(critic, batch))
        grads = _spy_main_grads(trained)
        rl.update(trained, batch, _nll(passes), passes=passes, step=1)
        res["grads"] = grads
        out[name] = res
    return out


#: The activation recompute compared with none (``--recompute-granularity`` and friends, as TransformerConfig fields):
#: every layer rerun, one at a time and all 4 as one chunk (uniform), the first 2 of 4 layers alone (block), and the
#: core attention of every layer (selective).
RECOMPUTE = {
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-uniform-4": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=4),
    "full-block-2": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "selective": dict(recompute_granularity="selective"),
}
RECOMPUTE_LAYERS, RECOMPUTE_BATCH = 4, 3


def _saved_bytes(run, model) -> dict:
    """Run ``run()`` (a forward) and count what autograd saves for the backward (``saved_tensors_hooks``): the bytes
    of every distinct storage saved, parameters left out (saved by reference, never copies), in all and in the
    forward of a decoder layer (a ``TransformerLayer``); and ``run()``'s result."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, tuple[int, bool]] = {}
    depth = [0]

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in saved:
            saved[storage.data_ptr()] = (storage.nbytes(), depth[0] > 0)
        return t

    hooks = []
    for layer in model.decoder.layers:
        hooks.append(layer.register_forward_pre_hook(lambda *_: depth.__setitem__(0, depth[0] + 1)))
        hooks.append(layer.register_forward_hook(lambda *_: depth.__setitem__(0, depth[0] - 1)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run()
    finally:
        for h in hooks:
            h.remove()
    return {"all": sum(n for n, _ in saved.values()), "in_layers": sum(n for n, inside in saved.values() if inside),
            "out": out}


def recompute_case(attention_backend: str) -> dict:
    """One rank: a 4-layer GPT stage from :func:`megatron_hybrid.rl.build_stage` without recompute and with each of
    :data:`RECOMPUTE` (``config_overrides``), the same weights; per model, one forward + backward of the mean
    next-token NLL over a padded batch (and, with sdpa, over a pack of 3 sequences in megatron-core's ``thd`` format):
    the loss, every parameter's gradient and the bytes autograd saved in the forward (:func:`_saved_bytes`), beside
    the bytes of one layer input; and the logits of a no-grad forward in training mode (the log-prob passes': the
    checkpointed path under ``no_grad``) and in eval mode (generation's: no recompute)."""
    from megatron_hybrid import rl

    args = recipe_args("--tensor-model-parallel-size", "1", "--num-layers", str(RECOMPUTE_LAYERS))
    arch = rl.architecture_from_args(args, VOCAB)
    cpu = torch.device("cpu")
    torch.manual_seed(11)
    base = rl.build_stage(arch, device=cpu, attention_backend=attention_backend)
    g = torch.Generator().manual_seed(5)
    B, S = RECOMPUTE_BATCH, PROMPT + NEW
    tokens = torch.randint(0, VOCAB, (B, S), generator=g)
    positions = torch.arange(S).unsqueeze(0).expand(B, S)
    inputs = {"padded": ((tokens, positions, None), {})}
    if attention_backend != "local":  # megatron-core's local attention takes no packed sequences
        lens = [7, 12, 5]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        pack = torch.randint(0, VOCAB, (1, sum(lens)), generator=g)
        pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
        inputs["packed"] = ((pack, pos, None), {"packed_seq_params": rl.passes._packed_seq_params(
            {"cu_seqlens": cu, "max_seqlen": max(lens)})})
    out: dict = {}
    for name, overrides in {"none": {}, **RECOMPUTE}.items():
        model = base if name == "none" else rl.build_stage(arch, device=cpu, attention_backend=attention_backend,
                                                           **overrides)
        if model is not base:
            rl.copy_weights(model, base)
        config = model.config
        out[name] = {"config": (config.recompute_granularity, config.recompute_method, config.recompute_num_layers),
                     "runs": {}}
        for kind, (call_args, call_kwargs) in inputs.items():
            model.train()
            model.zero_grad(set_to_none=True)

            def loss():
                logits = model(*call_args, **call_kwargs)
                labels = call_args[0][:, 1:]
                return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                         labels.reshape(-1))

            measured = _saved_bytes(loss, model)
            measured["out"].backward()
            with torch.no_grad():
                train_logits = model(*call_args, **call_kwargs)
                model.eval()
                eval_logits = model(*call_args, **call_kwargs)
                model.train()
            out[name]["runs"][kind] = {"loss": measured["out"].detach(), "saved": measured["all"],
                                       "saved_in_layers": measured["in_layers"],
                                       "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                                       "train_logits": train_logits, "eval_logits": eval_logits,
                                       "hidden_bytes": call_args[0].numel() * arch.hidden_size * 4}
    return out
