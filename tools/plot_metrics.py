"""Plot the held-out accuracy (and the mean reward) of RL runs from their metrics.jsonl files.

examples:
  # one run: eval accuracy against step and against minutes
  python tools/plot_metrics.py run/metrics.jsonl --output curve.png

  # a run and its control, labelled, with the training reward and a zero-shot start at step 0
  python tools/plot_metrics.py pretrained=runs/a/metrics.jsonl random-init=runs/b/metrics.jsonl \\
      --reward --start pretrained=0.19 --start random-init=0.0 --title "GRPO, SmolLM2-135M" --output curve.png

Each file is what train_ppo.py --log-dir writes: one JSON object a line with "step", "time/step" (seconds) and,
every --eval-interval steps, "eval_accuracy". Minutes are the sum of "time/step" up to a step plus "time/eval" where
the line has it (the evaluations' own time): the run's time, not the process's start-up. Needs matplotlib
(pip install matplotlib, or the package's `plot` extra).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence


@dataclass
class Curve:
    """One run's series, read from its metrics.jsonl."""

    label: str
    steps: list[int] = field(default_factory=list)
    """Every logged step."""
    minutes: list[float] = field(default_factory=list)
    """The run's minutes at the end of each of ``steps`` (its evaluations included)."""
    reward: list[float] = field(default_factory=list)
    """The mean training reward of each of ``steps``."""
    eval_steps: list[int] = field(default_factory=list)
    """The steps that have an ``eval_accuracy``."""
    eval_minutes: list[float] = field(default_factory=list)
    eval_accuracy: list[float] = field(default_factory=list)


def read_curve(label: str, path: str) -> Curve:
    """The series of ``path`` (a metrics.jsonl); ``ValueError`` naming the file and line on a malformed line."""
    curve, minutes = Curve(label), 0.0
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                m = json.loads(line)
                step = int(m["step"])
                minutes += (float(m["time/step"]) + float(m.get("time/eval", 0.0))) / 60
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{number}: not a metrics line with 'step' and 'time/step' ({e})") from e
            curve.steps.append(step)
            curve.minutes.append(minutes)
            curve.reward.append(float(m.get("reward_mean", float("nan"))))
            if "eval_accuracy" in m:
                curve.eval_steps.append(step)
                curve.eval_minutes.append(minutes)
                curve.eval_accuracy.append(float(m["eval_accuracy"]))
    if not curve.steps:
        raise ValueError(f"{path} has no metrics lines")
    return curve


def _labelled(spec: str, *, flag: str) -> tuple[str, str]:
    """``label=value`` → (label, value); a bare value is labelled by itself."""
    label, sep, value = spec.partition("=")
    if not sep:
        return spec, spec
    if not label or not value:
        raise ValueError(f"{flag} ({spec!r}) must be 'label=value' or a bare value")
    return label, value


def plot(curves: Sequence[Curve], output: str, *, reward: bool = False, starts: Optional[dict[str, float]] = None,
         title: Optional[str] = None) -> None:
    """Write a PNG to ``output``: eval accuracy (%) against step (left) and against minutes (right), one line per
    curve, a point at step 0 / minute 0 for each label in ``starts`` (an accuracy measured before training); with
    ``reward``, each curve's mean training reward dotted on a second axis of the same panel."""
    starts = starts or {}
    unknown = sorted(set(starts) - {c.label for c in curves})
    if unknown:
        raise ValueError(f"--start labels {unknown} are not among the runs' {[c.label for c in curves]}")
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit(f"plot_metrics.py needs matplotlib (pip install matplotlib, or pip install "
                         f"'megatron-hybrid[plot]'): {e}")
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, x_name in zip(axes, ("step", "minutes")):
        twin = ax.twinx() if reward else None
        for i, c in enumerate(curves):
            color = f"C{i}"
            xs = list(c.eval_steps if x_name == "step" else c.eval_minutes)
            ys = [100 * a for a in c.eval_accuracy]
            if c.label in starts:
                xs, ys = [0.0, *xs], [100 * starts[c.label], *ys]
            ax.plot(xs, ys, "o-", color=color, label=f"{c.label}: eval accuracy")
            if twin is not None:
                twin.plot(c.steps if x_name == "step" else c.minutes, c.reward, ":", color=color, alpha=0.7,
                          label=f"{c.label}: mean reward")
        ax.set_xlabel("training step" if x_name == "step" else "minutes (time/step + time/eval where logged)")
        ax.set_ylim(bottom=-1)  # 0 % (a control's flat line) stays visible
        ax.grid(alpha=0.3)
        if twin is not None:
            twin.set_ylim(0, 1)
            twin.set_ylabel("mean training reward (dotted)")
    axes[0].set_ylabel("held-out exact match (%)")
    axes[0].legend(loc="best", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="plot_metrics.py", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="[LABEL=]METRICS_JSONL", help="the runs' metrics.jsonl files")
    ap.add_argument("--output", required=True, help="the PNG to write")
    ap.add_argument("--reward", action="store_true", help="also the mean training reward (dotted, right axis)")
    ap.add_argument("--start", action="append", default=[], metavar="LABEL=ACCURACY",
                    help="an accuracy (0-1) measured before the first step, drawn at step 0; repeatable")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    try:
        runs = [_labelled(spec, flag="run") for spec in args.runs]
        starts = {}
        for spec in args.start:
            label, value = _labelled(spec, flag="--start")
            if label == value:
                raise ValueError(f"--start ({spec!r}) must be 'label=accuracy'")
            try:
                starts[label] = float(value)
            except ValueError:
                raise ValueError(f"--start ({spec!r}): {value!r} is not a number") from None
        for label, path in runs:
            if not Path(path).is_file():
                raise ValueError(f"run {label!r}: {path} is not a file")
        curves = [read_curve(label, path) for label, path in runs]
        plot(curves, args.output, reward=args.reward, starts=starts, title=args.title)
    except ValueError as e:
        ap.error(str(e))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
