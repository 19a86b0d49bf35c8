"""Write the documentation's figures (docs/img/*.svg): two diagrams and the benchmark plots, read from bench/results/.

examples:
  # regenerate every figure after a benchmark wrote new rows (or after changing a diagram)
  python tools/make_doc_figures.py

  # only the RL step's plot, into another folder
  python tools/make_doc_figures.py --only rl_step_phases.svg --out /tmp/img

  # the figures, the results files each reads, and nothing written
  python tools/make_doc_figures.py --list

The figures:
  switch.svg            the switch: plan -> transport -> placement -> binding, and what switch_to_rollout() runs
  decode_step.svg       one generation step: planner -> fixed-address inputs -> graph replay or forward ->
                        sampling -> the host reads the tokens
  generation_speed.svg  generation tok/s against transformers and the decode memory roofline, per shape
                        (generate_h200.json, generate_moe_h200.json)
  train_pass.svg        packed against padded training passes, tokens/s (train_pass_h100.json)
  rl_step_phases.svg    a whole RL step's phase seconds (rl_step_h100.json)

Each plot names its device and results file, and plots the rows the documentation's tables state. The SVGs are
reproducible (no date, a fixed id salt), so rewriting an unchanged figure changes no byte with the same matplotlib;
their text stays text, drawn in the first font of matplotlib's list that the browser has. Needs matplotlib (pip
install matplotlib, or the package's `plot` extra); files only (Agg).
tests/test_docs.py runs this into a temporary folder and checks that every image the pages show is one it writes.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "docs" / "img"

#: Diagram colours, one per room of the package.
ROOM = {"plan": "#dbe9f6", "transport": "#fde2c8", "placement": "#d9f0d3", "binding": "#e8dcf1", "host": "#f2f2f2"}
#: Plot colours: ours, the comparison, the bound.
OURS, OTHER, BOUND = "#1f77b4", "#ff7f0e", "#9e9e9e"


# -- drawing helpers ---------------------------------------------------------------------------------------------

def _pyplot():
    """matplotlib's pyplot on the Agg backend, with reproducible SVG output."""
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit(f"make_doc_figures.py needs matplotlib (pip install matplotlib, or pip install "
                         f"'megatron-hybrid[plot]'): {e}")
    matplotlib.use("Agg")  # files only: no display needed
    matplotlib.rcParams.update({"svg.hashsalt": "megatron-hybrid", "svg.fonttype": "none", "font.size": 9})
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    fig.savefig(path, format="svg", bbox_inches="tight",
                metadata={"Date": None, "Creator": "tools/make_doc_figures.py"})
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)


@dataclass(frozen=True)
class Box:
    """A diagram's box: a bold title, the modules in monospace, then the text."""

    x: float
    y: float
    w: float
    h: float
    title: str
    where: str
    text: str
    color: str

    def draw(self, ax) -> None:
        from matplotlib.patches import FancyBboxPatch

        ax.add_patch(FancyBboxPatch((self.x, self.y), self.w, self.h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                    facecolor=self.color, edgecolor="#555555", linewidth=0.8))
        top = self.y + self.h - 0.12
        ax.text(self.x + 0.12, top, self.title, fontsize=10, fontweight="bold", va="top")
        if self.where:
            ax.text(self.x + 0.12, top - 0.27, self.where, fontsize=7.5, family="monospace", color="#333333",
                    va="top")
        below = 0.27 + (0.15 * (self.where.count("\n") + 1) + 0.1 if self.where else 0.05)
        ax.text(self.x + 0.12, top - below, self.text, fontsize=8, va="top", linespacing=1.35)

    def side(self, which: str) -> tuple[float, float]:
        """The middle of the box's ``"left"``, ``"right"``, ``"top"`` or ``"bottom"`` edge."""
        return {"left": (self.x, self.y + self.h / 2), "right": (self.x + self.w, self.y + self.h / 2),
                "top": (self.x + self.w / 2, self.y + self.h), "bottom": (self.x + self.w / 2, self.y)}[which]


def _arrow(ax, start: tuple[float, float], end: tuple[float, float], label: str = "", *, curve: float = 0.0,
           label_at: Optional[tuple[float, float]] = None) -> None:
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="-|>", color="#333333", linewidth=1.1,
                                                          shrinkA=2, shrinkB=2,
                                                          connectionstyle=f"arc3,rad={curve}"))
    if label:
        x, y = label_at or ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.12)
        ax.text(x, y, label, fontsize=7.5, ha="center", va="bottom", style="italic", color="#333333")


def _canvas(plt, width: float, height: float):
    """A figure whose data units are inches, without axes."""
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    return fig, ax


# -- the diagrams ------------------------------------------------------------------------------------------------

def draw_switch(results: Path, out: Path) -> None:
    """The switch's four rooms, built once, and the steps of every ``switch_to_rollout()``."""
    plt = _pyplot()
    fig, ax = _canvas(plt, 14.0, 5.6)
    ax.text(0.1, 5.5, "Built once, in HybridEngine(...): each room decides or holds one thing", fontsize=11,
            fontweight="bold", va="top")
    w, h, y, gap = 2.8, 2.2, 2.85, 0.85
    parts = [
        ("plan", "reshard/plan.py\nreshard/exchange.py",
         "pure arithmetic, no torch.distributed:\nwhich bytes move where, as regions\nper dtype (gather, stage "
         "gather,\nbroadcast) or, on an exchange layout,\nthe ranges each rank misses\n(needed − held)"),
        ("transport", "transport.py, driven by\nreshard/executor.py",
         "the collectives behind one interface\n(torch.distributed, or a whole world\nin one process); once: one\n"
         "all_gather_object of the members'\nparameter descriptions, the plan's\ninput"),
        ("placement", "reshard/placement.py\nmemory/buffers.py",
         "each training tensor moved once into\nits own slot of a per-dtype range\nreserved at fixed addresses; "
         "the\npeers' slots are backed only while\nrolling out"),
        ("binding", "reshard/binding.py\nreshard/aliased.py",
         "every rollout parameter pointed at\nits storage once: a view, blocks of\nthe training shards (aliased), "
         "a\ncanonical tensor refilled at every\nswitch, or FP8 weights"),
    ]
    rooms = [Box(0.1 + i * (w + gap), y, w, h, room, where, text, ROOM[room])
             for i, (room, where, text) in enumerate(parts)]
    for box in rooms:
        box.draw(ax)
    for a, b, label in zip(rooms, rooms[1:], ("what to send,\nto whom", "into the\nslots of", "viewed by")):
        _arrow(ax, a.side("right"), b.side("left"), label)

    ax.text(0.1, 2.5, "Every switch_to_rollout() (the report's phases in brackets)", fontsize=11,
            fontweight="bold", va="top")
    steps = [
        ("placement", "1  back the peers' slots", "placement.map_rollout()\n(map_seconds)"),
        ("transport", "2  move the missing bytes", "one in-place all_gather_into_tensor\nper region (or broadcast), "
                                                  "or one\nall_to_all_single per dtype\n(collectives_seconds)"),
        ("binding", "3  refill", "canonical: one fused scatter per\ndtype; FP8: quantize; aliased:\nnothing "
                                 "(canonical_seconds)"),
        ("host", "4  offload (optional)", "optimizer states and gradients\nto host (offload_seconds)"),
        ("placement", "5  give back", "slots no rollout tensor views\n(release_transient)"),
    ]
    sw, sh, gap = 2.45, 1.35, 0.4
    boxes = [Box(0.1 + i * (sw + gap), 0.7, sw, sh, title, "", text, ROOM[room])
             for i, (room, title, text) in enumerate(steps)]
    for box in boxes:
        box.draw(ax)
    for a, b in zip(boxes, boxes[1:]):
        _arrow(ax, a.side("right"), b.side("left"))
    ax.text(0.1, 0.45, "switch_to_training(): the peers' slots and the rollout-only memory are released; the "
            "training tensors never moved, and every address stays bound for the next switch.", fontsize=8.5,
            va="top")
    _save(fig, out)


def draw_decode_step(results: Path, out: Path) -> None:
    """One step of the generator: policy (the planner), execution (the stage runner), bookkeeping (the replica)."""
    plt = _pyplot()
    fig, ax = _canvas(plt, 14.5, 4.3)
    ax.text(0.1, 4.2, "One generation step on a rollout replica", fontsize=11, fontweight="bold", va="top")
    w, h, y, gap = 2.55, 2.15, 1.0, 0.35
    execution = "#d9f0d3"
    parts = [
        ("plan the step", "inference/planner.py\nStepPlanner", ROOM["plan"],
         "policy, pure Python: the next\nStepPlan: prefill, decode, mixed\n(refills riding along) or idle;\n"
         "its batch bucket, attended\npositions and graph_key"),
        ("fixed-address inputs", "inference/runner.py\nStageRunner", execution,
         "the slots' tokens and positions\nlive on the device, advanced in\nplace; a mixed step's prompts\n"
         "staged in one buffer; later\nstages receive hidden states"),
        ("replay or forward", "inference/graphs.py\ninference/context.py", execution,
         "graph_key set: replay its CUDA\ngraph (captured once, kept across\nswitches); else megatron-core's\n"
         "forward, with our KV-cache\nattention via one StepContext"),
        ("sample", "inference/sampling.py\ninference/topp_kernel.py", execution,
         "last stage: greedy, temperature,\ntop-k or top-p on the device;\ntokens and log-probs; tokens\n"
         "shared with every stage; others\nsend their hidden states on"),
        ("the host reads tokens", "inference/replica.py\nReplicaGenerator", ROOM["host"],
         "a pinned copy of the tokens; with\noverlap_host step k+1 launches\nbefore step k is read; stop\n"
         "tokens and lengths end\nsequences and free their slots"),
    ]
    boxes = [Box(0.1 + i * (w + gap), y, w, h, title, where, text, color)
             for i, (title, where, color, text) in enumerate(parts)]
    for box in boxes:
        box.draw(ax)
    for a, b in zip(boxes, boxes[1:]):
        _arrow(ax, a.side("right"), b.side("left"))
    for first, last, label in ((0, 0, "policy: a StepPlan"), (1, 3, "execution: StageRunner.run(plan) → StepOutput"),
                               (4, 4, "bookkeeping")):
        x0, x1 = boxes[first].x, boxes[last].x + boxes[last].w
        ax.plot([x0, x1], [y + h + 0.12] * 2, color="#555555", linewidth=1.0)
        ax.text((x0 + x1) / 2, y + h + 0.17, label, ha="center", va="bottom", fontsize=8.5, style="italic")
    # The loop: from the host's bookkeeping back to the planner, under the boxes.
    low = 0.45
    ax.plot([boxes[-1].side("bottom")[0]] * 2, [y, low], color="#333333", linewidth=1.1)
    ax.plot([boxes[-1].side("bottom")[0], boxes[0].side("bottom")[0]], [low, low], color="#333333", linewidth=1.1)
    _arrow(ax, (boxes[0].side("bottom")[0], low), boxes[0].side("bottom"))
    ax.text(7.1, low - 0.08, "freed slots take waiting prompts in the next plans; the log-probs are read once, at "
            "the end of the call", ha="center", va="top", fontsize=8, style="italic")
    _save(fig, out)


# -- the plots ---------------------------------------------------------------------------------------------------

def _rows(path: Path) -> list[dict[str, Any]]:
    rows = json.loads(path.read_text())
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path}: expected a JSON list of rows")
    return rows


def _one(rows: list[dict], source: str, **match: Any) -> dict:
    """The only row of ``rows`` whose fields equal ``match``; ``ValueError`` naming ``source`` otherwise."""
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        raise ValueError(f"{source}: {len(found)} rows with {match}, expected 1")
    return found[0]


def plot_generation(results: Path, out: Path) -> None:
    """Greedy generation, 128-token prompts and 128 new tokens: ours, transformers' generate and the decode memory
    roofline (bench/generate.py's bound: weights plus KV-cache bytes per step at the copy bandwidth), per shape."""
    plt = _pyplot()
    files = ["generate_h200.json", "generate_moe_h200.json"]
    fig, axes = plt.subplots(1, len(files), figsize=(11, 3.8))
    for ax, name in zip(axes, files):
        rows = [r for r in _rows(results / name)
                if r.get("variant") == "greedy" and r.get("new_tokens") == 128 and r.get("prompt_len") == 128]
        batches = sorted({r["batch"] for r in rows if r.get("method") == "ours"})
        if not batches:
            raise ValueError(f"{results / name}: no greedy 128 + 128 rows of ours")
        series = [("ours", "ours", OURS), ("transformers", "transformers' generate", OTHER),
                  ("roofline", "decode memory roofline", BOUND)]
        width = 0.8 / len(series)
        for i, (method, label, color) in enumerate(series):
            values = [_one(rows, name, method=method, batch=b)["tok_s"] / 1e3 for b in batches]
            xs = [j + (i - 1) * width for j in range(len(batches))]
            ax.bar(xs, values, width, label=label, color=color)
            if method == "ours":
                roof = [_one(rows, name, method="roofline", batch=b)["tok_s"] / 1e3 for b in batches]
                for x, v, r in zip(xs, values, roof):
                    ax.text(x, v, f"{v:.1f}k\n{v / r:.0%} of\nroofline", ha="center", va="bottom", fontsize=7)
        first = rows[0]
        layers = f", {first['layers']} layers" if first.get("layers") else ""
        ax.set_title(f"{first['shape']}{layers}, {first['dtype']}, {first['device']}\n(bench/results/{name})",
                     fontsize=9)
        ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
        ax.set_ylabel("generated tokens/s (thousands)")
        ax.margins(y=0.25)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle("Generation speed: greedy, 128-token prompts, 128 new tokens", fontsize=10)
    fig.tight_layout()
    _save(fig, out)


def plot_train_pass(results: Path, out: Path) -> None:
    """Training passes over the same 32 sequences, packed against padded, at two response lengths."""
    plt = _pyplot()
    name = "train_pass_h100.json"
    rows = _rows(results / name)
    fig, ax = plt.subplots(figsize=(9, 3.8))
    labels, values = [], []
    for r in rows:
        method = r["method"].replace("-", ", ").replace("padded, local", "padded, local attention")
        pack = f"\npacks of {r['max_tokens_per_micro_batch']:,}" if r["method"].startswith("packed") else ""
        labels.append(f"responses ≤ {r['response_max']:,}\n{method}{pack}")
        values.append((r.get("tokens_per_s") or 0.0) / 1e3)
    colors = [OURS if r["method"].startswith("packed") else OTHER for r in rows]
    ax.bar(range(len(rows)), values, color=colors)
    for i, (r, v) in enumerate(zip(rows, values)):
        note = ("out of\nmemory" if r.get("oom") else
                f"{v:.1f}k\nMFU {r['mfu']:.0%}\n{r['peak_gib']:.1f} GiB")
        ax.text(i, v, note, ha="center", va="bottom", fontsize=7.5)
    ax.set_xticks(range(len(rows)), labels, fontsize=7.5)
    ax.set_ylabel("training tokens/s (thousands)")
    ax.margins(y=0.3)
    ax.grid(axis="y", alpha=0.3)
    first = rows[0]
    ax.set_title(f"Forward + backward, {first['shape']}, {first['sequences']} sequences (prompts "
                 f"{first['prompt_range'][0]:,}-{first['prompt_range'][1]:,} tokens), {first['device']}\n"
                 f"(bench/results/{name})", fontsize=9)
    fig.tight_layout()
    _save(fig, out)


#: The phases of an RL step in the order they run, with the results files' keys.
PHASES = [("generation", "time/generation"), ("switches", "time/switch"), ("actor log-probs", "time/actor_log_probs"),
          ("reference log-probs", "time/reference_log_probs"), ("update", "time/update")]


def plot_rl_step(results: Path, out: Path) -> None:
    """The phase seconds of whole RL steps on one H100: the 1.5B shape's medians with bf16 and FP8 rollout weights
    (session 47's summaries) and the 7B shape's warm step (session 48, step 2)."""
    plt = _pyplot()
    name = "rl_step_h100.json"
    rows = _rows(results / name)
    picked = [(f"{r['shape']}, {'FP8' if fp8 else 'bf16'} rollout weights\nmedian of {r['steps']} steps", r)
              for fp8 in (False, True)
              for r in [_one(rows, name, kind="summary", session=47, rollout_fp8=fp8)]]
    warm = _one(rows, name, kind="step", session=48, step=2)
    picked.append((f"{warm['shape']}, bf16 rollout weights\nwarm step (host optimizer)", warm))
    fig, ax = plt.subplots(figsize=(10, 3.4))
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#98df8a", "#ff7f0e"]
    for y, (label, r) in enumerate(reversed(picked)):
        left = 0.0
        for (phase, key), color in zip(PHASES, colors):
            s = r[key]
            ax.barh(y, s, left=left, color=color, label=phase if y == 0 else None)
            if s >= 1.5:
                ax.text(left + s / 2, y, f"{s:.1f}", ha="center", va="center", fontsize=7.5,
                        color="black" if color == "#98df8a" else "white")
            left += s
        ax.text(left + 0.3, y, f"step {r['time/step']:.1f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(picked)), [label for label, _ in reversed(picked)], fontsize=8)
    ax.set_xlabel("seconds")
    ax.margins(x=0.08)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7.5, ncol=len(PHASES) + 1, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    ax.set_title(f"A GRPO step, phase by phase, one {statistics.mode(r['device'] for _, r in picked)}: "
                 f"medians are per phase (reward and bookkeeping, under 0.3 s, left out)\n(bench/results/{name})",
                 fontsize=9)
    fig.tight_layout()
    _save(fig, out)


# -- the command line --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Figure:
    make: Callable[[Path, Path], None]
    """Writes the figure: ``make(results_dir, output_path)``."""
    reads: tuple[str, ...]
    """The results files it plots (names in the results folder)."""


FIGURES: dict[str, Figure] = {
    "switch.svg": Figure(draw_switch, ()),
    "decode_step.svg": Figure(draw_decode_step, ()),
    "generation_speed.svg": Figure(plot_generation, ("generate_h200.json", "generate_moe_h200.json")),
    "train_pass.svg": Figure(plot_train_pass, ("train_pass_h100.json",)),
    "rl_step_phases.svg": Figure(plot_rl_step, ("rl_step_h100.json",)),
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="make_doc_figures.py", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="the folder of the benchmarks' results files (default: bench/results)")
    ap.add_argument("--out", type=Path, default=OUT, help="the folder to write the figures to (default: docs/img)")
    ap.add_argument("--only", nargs="+", choices=list(FIGURES), metavar="FIGURE",
                    help=f"write only these figures, of: {', '.join(FIGURES)}")
    ap.add_argument("--list", action="store_true", help="list the figures and the results files each reads")
    return ap


def check_args(args: argparse.Namespace) -> None:
    """``ValueError`` naming a results file that the chosen figures read and that is missing, or an output path
    that is a file."""
    for name in args.only or FIGURES:
        for source in FIGURES[name].reads:
            if not (args.results / source).is_file():
                raise ValueError(f"{name} reads {args.results / source}, which is not a file")
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} is a file, not a folder")


def main(argv: Optional[Sequence[str]] = None) -> list[Path]:
    """Write the figures; returns their paths."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.list:
        for name, figure in FIGURES.items():
            print(f"{name}: {', '.join(figure.reads) or '(a diagram)'}")
        return []
    try:
        check_args(args)
        args.out.mkdir(parents=True, exist_ok=True)
        written = []
        for name in args.only or FIGURES:
            FIGURES[name].make(args.results, args.out / name)
            written.append(args.out / name)
    except ValueError as e:
        ap.error(str(e))
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
