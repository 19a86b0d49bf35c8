"""Checks of user input that need no collective, shared by the recipe's argument validation
(:mod:`megatron_hybrid.rl.arguments`), the modules it validates with (:mod:`megatron_hybrid.rl.pretrained`) and the
tools.

Nothing here imports the rest of the package or megatron-core, so a converter tool can range-check its flags
without loading the RL recipe, and the recipe's modules can share these helpers without importing one another.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Iterable, Optional


def flag_name(dest: str) -> str:
    """The command-line spelling of an ``argparse`` destination: ``"tensor_model_parallel_size"`` →
    ``"--tensor-model-parallel-size"``."""
    return f"--{dest.replace('_', '-')}"


def with_flag_names(message: str, dests: Iterable[str]) -> str:
    """``message`` with each snake_case word that is one of ``dests`` spelled as its flag: a library's error about
    ``expert_model_parallel_size (3)`` told as one about ``--expert-model-parallel-size (3)``."""
    names = "|".join(sorted((re.escape(d) for d in dests if "_" in d), key=len, reverse=True))
    return re.sub(rf"(?<![\w-])({names})(?!\w)", lambda m: flag_name(m.group(1)), message) if names else message


def check_number(flag: str, value: float, *, ge: Optional[float] = None, gt: Optional[float] = None,
                 le: Optional[float] = None, lt: Optional[float] = None, hint: str = "") -> None:
    """``ValueError`` naming ``flag`` and ``value`` unless ``value`` is finite and within the given bounds.

    Every bound is tested as "inside", so NaN (which compares false with everything) never passes.
    """
    if (math.isfinite(value) and (ge is None or value >= ge) and (gt is None or value > gt)
            and (le is None or value <= le) and (lt is None or value < lt)):
        return
    low = f"[{ge:g}" if ge is not None else f"({gt:g}" if gt is not None else None
    high = f"{le:g}]" if le is not None else f"{lt:g})" if lt is not None else None
    if low is not None and high is not None:
        want = f"in {low}, {high}"
    else:
        bounds = [f"{op} {b:g}" for op, b in (("≥", ge), (">", gt), ("≤", le), ("<", lt)) if b is not None]
        # ints are finite; for floats "finite" says why nan or inf fails a one-sided bound
        want = " ".join(["a finite number"] * isinstance(value, float) + bounds)
    raise ValueError(f"{flag} ({value}) must be {want}" + (f" ({hint})" if hint else ""))


def output_dir_error(path: str) -> Optional[str]:
    """Why ``path`` cannot be a directory the run writes into (``"is not a directory"``, ``"is inside F, which
    is not a directory"``), or ``None`` when it is one or can be made."""
    target = Path(os.path.abspath(path))
    for above in (target, *target.parents):  # the nearest that exists ("/" does)
        if os.path.lexists(above):
            break
    if os.path.isdir(above):
        return None
    return "is not a directory" if above == target else f"is inside {above}, which is not a directory"
