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


def recipe_output_case(argv: list[str]) -> str:
    """The recipe run as a script with ``argv``; what this rank printed."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run_recipe(argv + ["--no-progress"])
    return out.getvalue()


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


def _partial_write(transform_list, local_proc_idx, write_bucket, results_queue, count_queue, *args, **kwargs):
    """dist_checkpointing's per-file writer that writes part of the file, then fails (a full disk; a killed rank
    leaves the same), reporting back as the real one does."""
    with open(write_bucket[0], "wb") as f:
        f.write(b"part of a shard")
    results_queue.put((local_proc_idx, OSError(28, "No space left on device")))
    count_queue.get()
    count_queue.task_done()


def _on_rank_0(fn) -> None:
    """``fn`` on rank 0 alone, between two barriers: no rank still reads what it changes, every rank sees it."""
    dist.barrier()
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def checkpoint_faults_case(directory: str) -> dict[str, object]:
    """Saves and loads of a small model with ``{"n": n}``; what each step read back or raised."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megatron_hybrid import rl
    from megatron_hybrid.rl.checkpoint import LATEST, MANIFEST

    rank = dist.get_rank()
    latest = os.path.join(directory, LATEST)
    args = recipe_args()
    models = {"reference": rl.build_stage(rl.architecture_from_args(args, VOCAB), device=torch.device("cpu"))}
    out: dict[str, object] = {}

    def loaded() -> list[float]:
        s = rl.load_checkpoint(directory, models)
        return [s["step"], s["n"]]

    def failing_save(step: int, n: float) -> str:
        write = FileSystemWriterAsync.__dict__["write_preloaded_data"]
        if rank == 1:
            FileSystemWriterAsync.write_preloaded_data = staticmethod(_partial_write)
        try:
            rl.save_checkpoint(directory, step, models, {"n": n})
        except OSError as e:
            return _error(e)
        finally:
            FileSystemWriterAsync.write_preloaded_data = write
        return ""

    rl.save_checkpoint(directory, 1, models, {"n": 1.0})
    rl.save_checkpoint(directory, 2, models, {"n": 2.0})
    out["after_two"] = loaded()
    out["failed_new"] = failing_save(3, 3.0)                 # rank 1 fails part-way through its shard file
    out["failed_new_latest"] = open(latest).read()
    out["failed_new_loads"] = loaded()
    out["failed_resave"] = failing_save(2, 20.0)             # the same, re-saving the iteration `latest` names
    out["failed_resave_loads"] = loaded()
    rl.save_checkpoint(directory, 2, models, {"n": 22.0})   # a re-save that succeeds replaces it
    out["resaved_loads"] = loaded()
    out["leftovers"] = sorted(n for n in os.listdir(directory) if n.startswith("."))
    # A crash between the two renames of a re-save: the old copy, complete, is under .iter_0000002.old.
    it2, old2 = os.path.join(directory, "iter_0000002"), os.path.join(directory, ".iter_0000002.old")
    _on_rank_0(lambda: os.replace(it2, old2))
    out["between_renames_loads"] = loaded()
    _on_rank_0(lambda: os.replace(old2, it2))
    # Damaged files: rank 1's shard file truncated, then empty; a manifest missing; a `latest` that is no number.
    mine = os.path.join(it2, "__1_0.distcp")
    good = open(mine, "rb").read()
    for name, content in (("truncated", good[: len(good) // 2]), ("empty", b"")):
        _on_rank_0(lambda: open(mine, "wb").write(content))
        try:
            loaded()
            out[name] = ""
        except ValueError as e:
            out[name] = _error(e)
    _on_rank_0(lambda: open(mine, "wb").write(good))
    manifest = os.path.join(it2, MANIFEST)
    for name, change, undo in (("no_manifest", lambda: os.replace(manifest, manifest + ".x"),
                                lambda: os.replace(manifest + ".x", manifest)),
                               ("bad_latest", lambda: open(latest, "w").write("two\n"), lambda: None)):
        _on_rank_0(change)
        try:
            loaded()
            out[name] = ""
        except ValueError as e:
            out[name] = _error(e)
        _on_rank_0(undo)
    return out
