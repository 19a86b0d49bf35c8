"""Real models through the recipe: tiny random-weight Hugging Face models (:mod:`megatron_hybrid.convert.tiny`), and the rank body that trains one with ``--pretrained-checkpoint`` and
``--export-hf`` and reads the trained actor's logits at the moment it is exported."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_hybrid.convert.tiny import save_tiny_hf_model  # noqa: F401  (the tests take it from here)
from tests.ppo_cases import run_main


def parity_reward(prompts: list[list[int]], responses: list[list[int]], **kwargs: Any) -> list[float]:
    """A ``--reward-fn`` that varies within a GRPO group: the fraction of even token ids in the response."""
    return [sum(t % 2 == 0 for t in r) / max(len(r), 1) for r in responses]


def actor_logits(model: torch.nn.Module, tokens_BS: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The training-layout model's logits ``[B, S, vocab_size]`` (one pipeline stage; gathered over TP)."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid.megatron.compat import unwrap_model

    module = unwrap_model(model)
    positions = torch.arange(tokens_BS.shape[1]).expand_as(tokens_BS)
    was_training = module.training
    module.eval()
    with torch.no_grad():
        shard = module(tokens_BS, positions, None).contiguous()
    module.train(was_training)
    parts = [torch.empty_like(shard) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, shard, group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., :vocab_size]


def train_and_export(argv: list[str], log_dir: str, tokens_BS: torch.Tensor, vocab_size: int) -> dict[str, Any]:
    """Run the recipe; return its metrics and the actor's logits on ``tokens_BS`` as the final export wrote it
    (``rl.export_hf``, which the recipe calls, is wrapped for the duration)."""
    from megatron_hybrid import rl

    exported = rl.export_hf
    seen: dict[str, Any] = {"iterations": []}

    def export_hf(model, directory, pretrained_checkpoint, *, iteration=None):
        seen["iterations"].append(iteration)
        if iteration is None:
            seen["logits"] = actor_logits(model, tokens_BS, vocab_size)
        return exported(model, directory, pretrained_checkpoint, iteration=iteration)

    rl.export_hf = export_hf
    try:
        metrics = run_main(argv, log_dir)
    finally:
        rl.export_hf = exported
    return {"metrics": metrics, **seen}


def pretrained_models_case(megatron_dir: str, tokens_BS: torch.Tensor) -> dict[str, Any]:
    """As the recipe builds them: the actor loaded from ``megatron_dir``, then the reference and the critic from
    the actor. Returns the actor's logits and, for the others, the parameters that differ from the actor's."""
    from megatron_hybrid import rl
    from tests.rl_cases import recipe_args

    args = recipe_args("--pretrained-checkpoint", megatron_dir)
    arch = rl.model_architecture(args, 128)
    cpu = torch.device("cpu")
    actor = rl.build_stage(arch, device=cpu)
    rl.load_pretrained(actor, megatron_dir)
    loaded = dict(actor.named_parameters())

    def differing(model: torch.nn.Module) -> list[str]:
        return sorted(n for n, p in model.named_parameters() if n not in loaded or not torch.equal(p, loaded[n]))

    return {"logits": actor_logits(actor, tokens_BS, arch.vocab_size),
            "reference": differing(rl.build_reference(actor, arch, device=cpu)),
            "critic": differing(rl.build_critic(actor, arch, device=cpu))}


def export_case(megatron_dir: str, export_dir: str, *, fail_on_rank: int | None = None) -> dict[str, Any]:
    """Load ``megatron_dir`` into this rank's stage and export it untrained with ``rl.export_hf``; with
    ``fail_on_rank``, that rank's shard write fails with a full disk. Returns what was raised, if anything."""
    import errno

    import safetensors.torch

    from megatron_hybrid import rl
    from megatron_hybrid.megatron.compat import megatron_groups
    from tests.rl_cases import recipe_args

    tp, pp, _, _ = megatron_groups()
    args = recipe_args("--pretrained-checkpoint", megatron_dir, "--tensor-model-parallel-size", str(tp.size()),
                       "--pipeline-model-parallel-size", str(pp.size()))
    model = rl.build_stage(rl.model_architecture(args, 128), device=torch.device("cpu"))
    rl.load_pretrained(model, megatron_dir)
    save_file = safetensors.torch.save_file

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    if dist.get_rank() == fail_on_rank:
        safetensors.torch.save_file = full_disk
    try:
        return {"written": rl.export_hf(model, export_dir, megatron_dir)}
    except RuntimeError as e:
        return {"error": str(e)}
    finally:
        safetensors.torch.save_file = save_file
