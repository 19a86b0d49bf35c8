"""Rank bodies for tests/test_ppo_distopt.py: the recipe (run as a script, tests.ppo_cases.run_main) with what it
built for training recorded on each rank, so that a test can tell the flags took effect."""

from __future__ import annotations

from typing import Any

from tests import ppo_cases


def _describe(trained) -> dict[str, Any]:
    from megatron_hybrid.megatron.compat import unwrap_model

    return {"optimizers": sorted({type(o).__name__ for o in trained.optimizer.chained_optimizers}),
            "sequence_parallel": unwrap_model(trained.model).config.sequence_parallel,
            "overlap_grad_reduce": trained.model.ddp_config.overlap_grad_reduce,
            "overlap_param_gather": trained.model.ddp_config.overlap_param_gather}


def run_main_recording(argv: list[str], log_dir: str) -> dict[str, Any]:
    """:func:`tests.ppo_cases.run_main`, and per model the recipe trains (actor, then critic) its megatron-core
    optimizers and the DDP and model settings, as ``rl.setup_model_and_optimizer`` returned them."""
    from megatron_hybrid import rl

    built: list[dict[str, Any]] = []
    setup = rl.setup_model_and_optimizer

    def recording(*args, **kwargs):
        trained = setup(*args, **kwargs)
        built.append(_describe(trained))
        return trained

    rl.setup_model_and_optimizer = recording  # the recipe looks it up on rl at each call
    try:
        return {"metrics": ppo_cases.run_main(argv, log_dir), "built": built}
    finally:
        rl.setup_model_and_optimizer = setup
