"""Stopping an RL run on a fault, on every rank at once, before anything of the faulty step is saved.

A value only some ranks hold (a reward function's output on one DP replica, a loss on the last pipeline stage)
cannot be checked by those ranks alone: a rank that raises leaves the others waiting in their next collective
until the process-group timeout. Each check here is therefore one small all-reduce of a "this rank failed" flag
over the world; only when some rank failed are the messages gathered (once), so every rank raises the same error
naming the step, the quantity and the ranks. A quantity that flags scale (a loss and ``--lr``, the KL-penalised
rewards and ``--kl-coef``) names them too: the flags passed checks, the step overflowed.
"""

from __future__ import annotations

import argparse
import numbers
from decimal import Decimal
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from .phases import recorded

#: Flags and their values, as :func:`flag_values` gives them: what scales a quantity.
Flags = Sequence[tuple[str, Any]]


class StepFailure(RuntimeError):
    """A step produced a value training must not go on with (or a reward function failed); raised on every rank
    before anything of the step is saved."""


def _flag_device() -> torch.device:
    # NCCL reduces device tensors only; gloo reduces CPU tensors.
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@recorded("agree on errors")
def errors_on_every_rank(errors: Sequence[str]) -> list[str]:
    """Every rank's ``errors`` (empty: this rank is fine), each message once with the ranks that had it
    (``"message (ranks 0, 2)"``), ``[]`` when no rank failed; called on every rank. One all-reduce of a flag;
    the messages are gathered only after a failure."""
    flag = torch.tensor([1.0 if errors else 0.0], device=_flag_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0.0:
        return []
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(errors))
    by_message: dict[str, list[int]] = {}
    for rank, mine in enumerate(everyone):
        for e in mine:
            by_message.setdefault(e, []).append(rank)
    return [f"{e} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})" for e, r in by_message.items()]


def raise_on_every_rank(step: int, errors: Sequence[str]) -> None:
    """:class:`StepFailure` on every rank, naming ``step``, when any rank passes ``errors``."""
    everyone = errors_on_every_rank(errors)
    if everyone:
        raise StepFailure(f"step {step}: {'; '.join(everyone)}; the run stops before anything of this step is "
                          f"saved")


def flag_values(args: argparse.Namespace, *names: str) -> list[tuple[str, Any]]:
    """``[("--lr", 0.003), ...]``: the flags ``names`` (argument dests) that are set, with their values."""
    return [(f"--{name.replace('_', '-')}", getattr(args, name)) for name in names if getattr(args, name) is not None]


def _scaled_by(flags: Flags) -> str:
    named = [f"{flag} ({value:g})" if isinstance(value, float) else f"{flag} ({value})" for flag, value in flags]
    if not named:
        return ""
    return ", scaled by " + (named[0] if len(named) == 1 else f"{', '.join(named[:-1])} and {named[-1]}")


def non_finite(label: str, values: Any, *, scaled_by: Flags = ()) -> Optional[str]:
    """``"LABEL is not finite (nan)"`` for a number, ``"LABEL are not finite (k of n values; ...)"`` for a
    tensor, when it holds a NaN or an infinity (``", scaled by --lr (1e+30) and ..."`` added for flags
    ``scaled_by``); else ``None``."""
    t = torch.as_tensor(values, dtype=torch.float64).detach().cpu().reshape(-1)
    bad = ~torch.isfinite(t)
    if not bad.any():
        return None
    if not isinstance(values, torch.Tensor):
        return f"{label} is not finite ({float(t[0])}){_scaled_by(scaled_by)}"
    first = int(bad.nonzero()[0])
    return (f"{label} are not finite ({int(bad.sum())} of {t.numel()} values; the first, {float(t[first])}, at "
            f"{first}){_scaled_by(scaled_by)}")


def check_finite(step: int, quantities: dict[str, Any], *, scaled_by: Optional[Mapping[str, Flags]] = None) -> None:
    """:class:`StepFailure` on every rank when one of ``quantities`` (label → a number, or a tensor under a plural
    label; ``None`` where this rank does not hold it) is not finite on some rank; called on every rank.
    ``scaled_by``: label → the flags that scale that quantity (:func:`flag_values`), named with it."""
    scaled_by = scaled_by or {}
    raise_on_every_rank(step, [e for label, v in quantities.items() if v is not None
                               for e in [non_finite(label, v, scaled_by=scaled_by.get(label, ()))] if e is not None])


@recorded("reward", step="step")
def reward_scores(reward_fn: Callable[..., Sequence[float]], prompts: list[list[int]], responses: list[list[int]],
                  *, step: int, name: str) -> torch.Tensor:
    """``reward_fn(prompts, responses)`` as a ``[B]`` fp32 tensor, on every rank; ``name`` is how the user gave
    it (``--reward-fn module:function``). :class:`StepFailure` on every rank, naming ``step`` and ``name``, when
    on some rank it raises, returns another number of values than responses, something that is not a number
    (:func:`_is_number`: a string, a bool or ``None`` is refused, not converted), or a value that is not finite."""
    error, scores = None, torch.zeros(len(responses))
    try:
        values = list(reward_fn(prompts, responses))
    except Exception as e:  # the user's function: report whatever it raised, on every rank
        error = f"{name} raised {type(e).__name__}: {e}"
    else:
        if len(values) != len(responses):
            error = f"{name} returned {len(values)} values for {len(responses)} responses"
        else:
            error = _not_numbers(values, name)
            if error is None:
                try:
                    scores = torch.tensor([float(v) for v in values])
                except (OverflowError, ValueError) as e:  # an int or a Fraction past float's range, Decimal's sNaN
                    error = f"{name} returned a value that is not finite as a float ({e})"
                else:
                    error = non_finite(f"the rewards of {name}", scores)
    raise_on_every_rank(step, [] if error is None else [error])
    return scores


def _is_number(value: Any) -> bool:
    """A real number: Python's or numpy's ints and floats, a ``Fraction`` or ``Decimal``, a one-element real tensor
    (what iterating a returned tensor gives). Not a bool, a string, ``None`` or a complex number: ``float()`` would
    take ``"0.5"`` and ``True``, which are a reward function's bug, not its reward."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.dtype.is_complex and value.dtype != torch.bool
    return isinstance(value, (numbers.Real, Decimal)) and not isinstance(value, bool)


def _not_numbers(values: Sequence[Any], name: str) -> Optional[str]:
    bad = [i for i, v in enumerate(values) if not _is_number(v)]
    if not bad:
        return None
    first = values[bad[0]]
    kind = type(first).__qualname__ if type(first).__module__ == "builtins" else \
        f"{type(first).__module__}.{type(first).__qualname__}"
    shown = repr(first) if len(repr(first)) <= 40 else repr(first)[:37] + "..."
    return (f"{name} returned {len(bad)} of {len(values)} values that are not numbers (int or float): the first, "
            f"{shown} ({kind}), for response {bad[0]}; a reward is not converted from another type")
