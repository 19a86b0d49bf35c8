"""Rank bodies for the fault tests (tests/test_rl_faults.py): reward functions that fail on one rank, updates whose
loss or gradient norm is not finite, checkpoints that are damaged or whose save fails on one rank. Each body
returns the error its rank raised, so a test sees that every rank stopped with the same message (and none hung)."""

from __future__ import annotations

import os
import torch
import torch.distributed as dist

from tests.ppo_cases import run_recipe
from tests.rl_cases import NEW, PROMPT, VOCAB, _batch, recipe_args

_calls = 0


def nan_on_second_call(prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
    """A ``--reward-fn``: 0.5 at the first step, NaN for one response at the second."""
    global _calls
    _calls += 1
    return [0.5] * len(responses) if _calls == 1 else [float("nan")] + [0.5] * (len(responses) - 1)


def raises_on_rank_1(prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
    """A ``--reward-fn`` that fails on rank 1 only (the others would wait for it in their next collective)."""
    if dist.get_rank() == 1:
        raise ZeroDivisionError("no reward for you")
    return [0.5] * len(responses)


def miscounts_on_rank_2(prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
    """A ``--reward-fn`` that returns one value too few on rank 2 only."""
    return [0.5] * (len(responses) - (dist.get_rank() == 2))


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def recipe_error_case(argv: list[str]) -> str:
    """The recipe run as a script with ``argv``; the error this rank stopped with (``""``: none)."""
    global _calls
    _calls = 0
    try:
        run_recipe(argv + ["--no-progress"])
    except Exception as e:
        return _error(e)
    return ""


def update_fault_case(kind: str) -> str:
    """One :func:`megatron_hybrid.rl.update` on 2 pipeline stages whose loss is NaN (``kind="loss"``) or finite
    with NaN gradients (``"grad_norm"``: the square root of 0 · output, differentiated at 0)."""
    from megatron_hybrid import rl

    args = recipe_args("--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                       "--global-batch-size", "4", "--micro-batch-size", "2")
    trained = rl.setup_model_and_optimizer(rl.build_stage(rl.architecture_from_args(args, VOCAB),
                                                          device=torch.device("cpu")), args)
    passes = rl.TrainingPasses(rl.PassConfig(PROMPT + NEW, 2, VOCAB))

    def loss_fn(output, mb):
        out = output.float()
        # "* 1.0": Megatron's schedule scales the loss in place, which the square root's backward cannot allow.
        return (out.mean() * float("nan") if kind == "loss" else (out * 0).sum().sqrt() * 1.0), {}

    try:
        rl.update(trained, _batch(0, 4), loss_fn, passes=passes, step=7, name="the actor")
    except rl.StepFailure as e:
        return _error(e)
    return ""


def _partial_write(obj, f) -> None:
    """``torch.save`` that writes part of the file, then fails (a full disk; a killed rank leaves the same)."""
    f.write(b"PK\x03\x04 part of a rank file")
    raise OSError(28, "No space left on device")


def _on_rank_0(fn) -> None:
    """``fn`` on rank 0 alone, between two barriers: no rank still reads what it changes, every rank sees it."""
    dist.barrier()
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def checkpoint_faults_case(directory: str) -> dict[str, object]:
    """Saves and loads of ``{"x": [rank, n]}`` on every rank; what each step read back or raised."""
    from megatron_hybrid import rl
    from megatron_hybrid.rl.checkpoint import LATEST

    rank = dist.get_rank()
    latest = os.path.join(directory, LATEST)
    out: dict[str, object] = {}

    def state(n: float) -> dict:
        return {"x": torch.tensor([float(rank), n])}

    def loaded() -> list[float]:
        s = rl.load_checkpoint(directory)
        return [s["step"], *s["x"].tolist()]

    def failing_save(step: int, n: float) -> str:
        saved = torch.save
        if rank == 1:
            torch.save = _partial_write
        try:
            rl.save_checkpoint(directory, step, state(n))
        except OSError as e:
            return _error(e)
        finally:
            torch.save = saved
        return ""

    rl.save_checkpoint(directory, 1, state(1.0))
    rl.save_checkpoint(directory, 2, state(2.0))
    out["after_two"] = loaded()
    out["failed_new"] = failing_save(3, 3.0)                 # rank 1 fails part-way through its file
    out["failed_new_latest"] = open(latest).read()
    out["failed_new_loads"] = loaded()
    out["failed_resave"] = failing_save(2, 20.0)             # the same, re-saving the iteration `latest` names
    out["failed_resave_loads"] = loaded()
    rl.save_checkpoint(directory, 2, state(22.0))           # a re-save that succeeds replaces it
    out["resaved_loads"] = loaded()
    out["leftovers"] = sorted(n for n in os.listdir(directory) if n.startswith("."))
    # A crash between the two renames of a re-save: the old copy, complete, is under .iter_0000002.old.
    it2, old2 = os.path.join(directory, "iter_0000002"), os.path.join(directory, ".iter_0000002.old")
    _on_rank_0(lambda: os.replace(it2, old2))
    out["between_renames_loads"] = loaded()
    _on_rank_0(lambda: os.replace(old2, it2))
    # Damaged files: rank 1's truncated, then empty; then a `latest` that is not a number.
    mine = os.path.join(it2, "rank_00001.pt")
    good = open(mine, "rb").read()
    for name, content in (("truncated", good[: len(good) // 2]), ("empty", b"")):
        _on_rank_0(lambda: open(mine, "wb").write(content))
        try:
            loaded()
            out[name] = ""
        except ValueError as e:
            out[name] = _error(e)
    _on_rank_0(lambda: open(mine, "wb").write(good))
    _on_rank_0(lambda: open(latest, "w").write("two\n"))
    try:
        loaded()
        out["bad_latest"] = ""
    except ValueError as e:
        out["bad_latest"] = _error(e)
    return out
