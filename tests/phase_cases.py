"""Rank bodies for tests/test_phases.py: a rank that stalls in one phase while the other waits in the next."""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist


def stalled_rank_case(stall_s: float, timeout_s: float) -> str:
    """Rank 1 stalls in phase "generate" of step 3; rank 0 goes on into "reward" and waits in its all-reduce, on a
    group whose timeout is ``timeout_s`` (the world keeps the harness's long one: it must stay usable). Returns the
    error this rank raised."""
    from megatron_hybrid.rl import phases

    short = datetime.timedelta(seconds=timeout_s)
    group = dist.new_group([0, 1], timeout=short)
    recorder = phases.PhaseRecorder.for_default_group(timeout=short, timeout_source="the test's group")
    try:
        with phases.recording(recorder), phases.phase("train step", step=3):
            with phases.phase("generate"):
                if dist.get_rank() == 1:
                    time.sleep(stall_s)
            with phases.phase("reward"):
                dist.all_reduce(torch.ones(1), group=group)
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return ""


def recipe_phases_case(argv: list[str]) -> dict[str, object]:
    """The recipe run with ``argv``; every record this rank wrote (``"<kind> <label>"``, in order), and the recorder
    installed after it (``None``: :func:`megatron_hybrid.rl.initialize` installs one for its block only)."""
    from megatron_hybrid.rl import phases
    from tests.ppo_cases import run_recipe

    written: list[str] = []
    write = phases.PhaseRecorder._write

    def spy(self, kind: str, label: str = "") -> None:
        written.append(f"{kind} {label}".rstrip())
        write(self, kind, label)

    phases.PhaseRecorder._write = spy
    try:
        run_recipe(argv + ["--no-progress"])
    finally:
        phases.PhaseRecorder._write = write
    return {"written": written, "after": phases.current()}
