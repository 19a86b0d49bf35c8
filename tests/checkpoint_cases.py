"""Rank bodies for the checkpoint tests (tests/test_checkpoint.py): a checkpoint of actor, critic and reference
saved at one layout and loaded at another, each side reporting the full (gathered) parameters, fp32 main
parameters and Adam moments; with megatron-core's plain and distributed optimizers."""

from __future__ import annotations

import os
import warnings

import torch

from tests.rl_cases import NEW, PROMPT, VOCAB, _batch, _full, _nll, recipe_args

KINDS = ("param", "main", "exp_avg", "exp_avg_sq")
#: (bf16, distributed optimizer) of each checkpoint written.
CONFIGS = ((False, False), (True, False), (False, True), (True, True))


def _models(bf16: bool, distopt: bool) -> dict:
    from megatron_hybrid import rl

    args = recipe_args(*(["--bf16"] if bf16 else []), *(["--use-distributed-optimizer"] if distopt else []),
                       "--global-batch-size", "8", "--micro-batch-size", "2", "--lr-warmup-iters", "2")
    arch = rl.architecture_from_args(args, VOCAB)
    stage = rl.build_stage(arch, device=torch.device("cpu"))
    reference = rl.build_reference(stage, arch, device=torch.device("cpu"))
    actor = rl.setup_model_and_optimizer(stage, args)
    critic = rl.setup_model_and_optimizer(rl.build_critic(stage, arch, device=torch.device("cpu")), args)
    return {"actor": actor, "critic": critic, "reference": reference}


def _distributed_adam(opt) -> dict:
    """Per model parameter, whole: the ``DistributedOptimizer``'s fp32 main parameter and moments, of which each
    data-parallel rank holds a flat slice (``param_map``'s ``param`` range), summed over DP into zeros: every
    element comes from its one owner, unchanged."""
    import torch.distributed as dist

    params = [p for buffer in opt.buffers for p in buffer.params]  # DDP's order: the same on every DP rank
    owned = {p: r["param"] for ranges in opt.gbuf_ranges for maps in ranges.values() for bucket in maps
             for p, r in bucket["param_map"].items()}
    table = {}
    for p in params:  # the same order on every rank
        full = {k: torch.zeros(p.numel(), dtype=torch.float32) for k in ("main", "exp_avg", "exp_avg_sq")}
        step = None  # Adam's step count of the parameters this rank owns a slice of
        if p in owned:
            state = opt._get_main_param_and_optimizer_states(p)
            step = float(state["step"])
            for kind, key in (("main", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                full[kind][owned[p].start: owned[p].end] = state[key].detach()
        for t in full.values():
            dist.all_reduce(t, group=opt.data_parallel_group)
        table[p] = {"param": p, **{k: v.view(p.shape) for k, v in full.items()}, "step": step}
    return table


def _adam(trained) -> dict:
    """Per model parameter: its fp32 main parameter (itself for fp32 parameters) and Adam's two moments."""
    table = {}
    for opt in trained.optimizer.chained_optimizers:
        if hasattr(opt, "gbuf_ranges"):
            table.update(_distributed_adam(opt))
            continue
        if hasattr(opt, "float16_groups"):  # bf16 parameters: Float16OptimizerWithFloat16Params
            pairs = [(p, m) for g, mg in zip(opt.float16_groups, opt.fp32_from_float16_groups) for p, m in zip(g, mg)]
        else:
            pairs = [(p, p) for g in opt.optimizer.param_groups for p in g["params"]]
        for p, main in pairs:
            state = opt.optimizer.state[main]
            table[p] = {"param": p, "main": main, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"],
                        "step": float(state["step"])}
    return table


def _snapshot(models: dict) -> dict:
    out = {"reference": {"param": _full(models["reference"], lambda p: p)}}
    for name in ("actor", "critic"):
        trained = models[name]
        table = _adam(trained)
        out[name] = {kind: _full(trained.model, lambda p, kind=kind: table[p][kind]) for kind in KINDS}
        out[name]["steps"] = sorted({v["step"] for v in table.values() if v["step"] is not None})
        out[name]["scheduler"] = trained.scheduler.state_dict()
        out[name]["optimizers"] = sorted({type(o).__name__ for o in trained.optimizer.chained_optimizers})
    return out


def reshard_save_case(directory: str) -> dict:
    """fp32 and bf16 (fp32 main parameters) runs: one update of actor and critic, saved as iteration 1."""
    from megatron_hybrid import rl
    from megatron_hybrid.megatron.compat import megatron_groups

    out = {}
    for bf16, distopt in CONFIGS:
        models = _models(bf16, distopt)
        passes = rl.TrainingPasses(rl.PassConfig(PROMPT + NEW, 2, VOCAB))
        batch = _batch(7 + megatron_groups()[2].rank(), 4)
        for name, loss in (("actor", _nll(passes)),
                           ("critic", lambda o, mb: (rl.response_values(o, mb).square().mean(), {}))):
            models[name].scheduler.step(increment=8)
            rl.update(models[name], batch, loss, passes=passes, step=1)
        rl.save_checkpoint(os.path.join(directory, f"bf16={bf16},distopt={distopt}"), 1, models,
                           {"consumed_prompts": 4})
        out[bf16, distopt] = _snapshot(models)
    return out


def reshard_load_case(directory: str) -> dict:
    """Fresh models at this rank's layout, loaded from :func:`reshard_save_case`'s checkpoints."""
    from megatron_hybrid import rl

    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for bf16, distopt in CONFIGS:
            models = _models(bf16, distopt)
            state = rl.load_checkpoint(os.path.join(directory, f"bf16={bf16},distopt={distopt}"), models)
            out[bf16, distopt] = {"state": state, **_snapshot(models)}
    out["warnings"] = [str(w.message) for w in caught if "--load" in str(w.message)]
    return out


def _reference() -> dict:
    """A frozen model alone: the smallest checkpoint with shard files of every rank."""
    from megatron_hybrid import rl

    return {"reference": rl.build_stage(rl.architecture_from_args(recipe_args(), VOCAB), device=torch.device("cpu"))}


def small_save_case(directory: str) -> None:
    """The checkpoint the damage tests copy and damage: :func:`_reference` with ``{"n": 1.0}`` as iteration 1."""
    from megatron_hybrid import rl

    rl.save_checkpoint(directory, 1, _reference(), {"n": 1.0})


def small_load_case(directory: str) -> dict:
    """:func:`small_save_case`'s checkpoint loaded into a fresh model: the state, or the error this rank raised,
    and the ``--load`` warnings it issued."""
    from megatron_hybrid import rl

    out: dict = {"state": None, "error": ""}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out["state"] = rl.load_checkpoint(directory, _reference())
        except ValueError as e:
            out["error"] = f"{type(e).__name__}: {e}"
    out["warnings"] = [str(w.message) for w in caught if "--load" in str(w.message)]
    return out


#: A mixture of experts on the built-in tiny model: 4 experts, top-2, with a load-balancing loss.
MOE_FLAGS = ("--tensor-model-parallel-size", "1", "--num-experts", "4", "--moe-aux-loss-coeff", "0.01",
             "--global-batch-size", "8", "--micro-batch-size", "2")


def _moe_models() -> dict:
    """Actor, critic (an MoE trunk) and reference at this job's expert parallelism (TP 1)."""
    from megatron_hybrid import rl
    from megatron_hybrid.megatron.compat import megatron_expert_ranks

    args = recipe_args(*MOE_FLAGS, "--expert-model-parallel-size", str(megatron_expert_ranks()[1]))
    arch = rl.architecture_from_args(args, VOCAB)
    cpu = torch.device("cpu")
    stage = rl.build_stage(arch, device=cpu)
    reference = rl.build_reference(stage, arch, device=cpu)
    return {"actor": rl.setup_model_and_optimizer(stage, args), "reference": reference,
            "critic": rl.setup_model_and_optimizer(rl.build_critic(stage, arch, device=cpu), args)}


def _moe_snapshot(models: dict) -> dict:
    """Per model, per parameter under its global name (routed experts by their global number), gathered over the
    expert-parallel group: the parameter and, for a trained model, its fp32 main parameter and Adam moments."""
    import torch.distributed as dist

    from megatron_hybrid.convert.layout import expert_of, renumber_expert
    from megatron_hybrid.megatron.compat import megatron_expert_groups, unwrap_model

    _, ep, _ = megatron_expert_groups()
    out = {}
    for name, m in models.items():
        trained = name != "reference"
        module = unwrap_model(m.model if trained else m)
        table = _adam(m) if trained else {}
        offset = ep.rank() * module.config.num_moe_experts // ep.size()
        mine = {}
        for n, p in module.named_parameters():
            key = n if expert_of(n) is None else renumber_expert(n, offset)
            kinds = {"param": p, **{k: table[p][k] for k in KINDS[1:]}} if trained else {"param": p}
            mine[key] = {k: v.detach().clone() for k, v in kinds.items()}
        parts: list = [None] * ep.size()
        dist.all_gather_object(parts, mine, group=ep)
        out[name] = {k: v for part in parts for k, v in part.items()}
    return out


def moe_save_case(directory: str) -> dict:
    """One update of an MoE actor and critic at this job's expert parallelism, saved as iteration 1."""
    from megatron_hybrid import rl
    from megatron_hybrid.megatron.compat import megatron_groups

    models = _moe_models()
    passes = rl.TrainingPasses(rl.PassConfig(PROMPT + NEW, 2, VOCAB))
    batch = _batch(7 + megatron_groups()[2].rank(), 4)
    aux = {}
    for name, loss in (("actor", _nll(passes)),
                       ("critic", lambda o, mb: (rl.response_values(o, mb).square().mean(), {}))):
        models[name].scheduler.step(increment=8)
        aux[name] = rl.update(models[name], batch, loss, passes=passes, step=1).aux_losses
    rl.save_checkpoint(directory, 1, models, {"consumed_prompts": 4})
    return {"aux": aux, **_moe_snapshot(models)}


def moe_load_case(directory: str) -> dict:
    """Fresh MoE models at this job's expert parallelism, loaded from :func:`moe_save_case`'s checkpoint."""
    from megatron_hybrid import rl

    models = _moe_models()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            state = rl.load_checkpoint(directory, models)
        except ValueError as e:
            return {"error": str(e)}
    return {"state": state, "warnings": [str(w.message) for w in caught if "--load" in str(w.message)],
            **_moe_snapshot(models)}
