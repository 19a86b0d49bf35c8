"""The communication report of a switch: a JSONL trace of every collective and one self-contained HTML page.

Where the bytes of a switch went, per rank: :func:`gather_trace` collects every rank's collective records of the
engine's last switch to rank 0 (a collective over the world); :func:`write_communication_report` writes them as
JSON lines and renders an HTML page with a timeline per rank, the bandwidth of every collective and the share of
the step spent switching. The page is one file with inline CSS and SVG: no scripts, fonts or anything fetched.

A trace record is one collective on one rank (:class:`megatron_hybrid.reshard.executor.CollectiveRecord`): ``rank``,
``index`` (its position in that rank's switch), ``op``, ``group_ranks``, ``bytes_received``, ``seconds``,
``start`` and ``end`` (``time.time()`` of that rank: one clock on one host; across hosts only as close as their
clocks), and ``gbps`` (bytes received per second / 1e9). Times are the host's view: on a GPU they cover the
collective up to the engine's synchronisation, so record with ``engine.set_profiling(True)``.
"""

from __future__ import annotations

import html
import json
import math
from fractions import Fraction
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch.distributed as dist

from .megatron.sharding import global_name, layer_offset

TRACE_FIELDS = ("rank", "index", "op", "group_ranks", "bytes_received", "seconds", "start", "end", "gbps")

_OP_COLOURS = {"all_gather_into_tensor": "#3b7dd8", "broadcast": "#e8912d"}
_OTHER_COLOUR = "#8a8a8a"


def missing_bytes(engine: Any) -> int:
    """The least a switch can move to this rank: its rollout shard's bytes less those of its own training tensors
    that are part of it (a tied output layer counts as its share of the embedding, which Megatron keeps equal to
    it). A sharded tensor it holds contributes the overlap of its training TP range [i/t, (i+1)/t) with its
    rollout range [j/t_g, (j+1)/t_g); a replicated one all of it. From the modules' shapes and the layout alone,
    not from the plan."""
    lay = engine.layout
    i, j = engine.tp_rank, engine.rollout_tp_rank
    own = Fraction(i, lay.t), Fraction(i + 1, lay.t)
    need = Fraction(j, lay.t_g), Fraction(j + 1, lay.t_g)
    held_share = max(Fraction(0), min(own[1], need[1]) - max(own[0], need[0])) * lay.t_g
    tied = bool(getattr(engine.modules[-1], "share_embeddings_and_output_weights", False))

    def key(name: str) -> str:
        return "embedding.word_embeddings.weight" if tied and name == "output_layer.weight" else name

    rollout = {}
    for chunk in engine.rollout_chunks:
        off = layer_offset(chunk)
        for name, p in chunk.named_parameters():
            rollout[key(global_name(name, off))] = (p.numel() * p.element_size(),
                                                    bool(getattr(p, "tensor_model_parallel", False)))
    if lay.widens:
        return 0
    held: dict[str, int] = {}
    for chunk in engine.modules:
        for name, p in chunk.named_parameters():
            held.setdefault(key(global_name(name, layer_offset(chunk))), p.numel() * p.element_size())
    total = Fraction(0)
    for name, (nbytes, sharded) in rollout.items():
        if name not in held:
            total += nbytes
        elif not lay.exchange:  # in place: the own shard is part of the rollout shard (routed experts included)
            total += nbytes - held[name]
        elif sharded:
            total += nbytes * (1 - held_share)
    return int(total)


def local_trace(engine: Any) -> list[dict[str, Any]]:
    """This rank's records of the engine's last switch to rollout (no communication)."""
    out = []
    for index, c in enumerate(engine.communication_report()["collectives"]):
        seconds = float(c["seconds"])
        out.append({
            "rank": int(c["rank"]),
            "index": index,
            "op": str(c["op"]),
            "group_ranks": [int(r) for r in c["group_ranks"]],
            "bytes_received": int(c["bytes_received"]),
            "seconds": seconds,
            "start": float(c["start"]),
            "end": float(c["end"]),
            "gbps": int(c["bytes_received"]) / seconds / 1e9 if seconds > 0 else 0.0,
        })
    return out


def gather_trace(engine: Any, *, dst: int = 0, group: Optional[dist.ProcessGroup] = None) -> list[dict[str, Any]]:
    """Every rank's records of the engine's last switch, ordered by (rank, index), on rank ``dst``; ``[]`` elsewhere.

    A collective over ``group`` (default: the world): call it on every rank. ``dst`` is a global rank.
    """
    mine = local_trace(engine)
    if not dist.is_initialized():
        return mine
    size = dist.get_world_size(group)
    if size == 1:
        return mine
    me = dist.get_rank()
    parts: Optional[list] = [None] * size if me == dst else None
    dist.gather_object(mine, parts, dst=dst, group=group)
    if me != dst:
        return []
    return sorted((r for part in parts for r in part), key=lambda r: (r["rank"], r["index"]))


def read_trace(jsonl_path: Union[str, Path]) -> list[dict[str, Any]]:
    """The records of a JSONL trace written by :func:`write_communication_report`."""
    with open(jsonl_path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(records: Sequence[dict[str, Any]], *, step_seconds: Optional[float] = None,
              switch_seconds: Optional[float] = None) -> dict[str, Any]:
    """Per-rank totals, the switch's span and its share of the step.

    ``switch_seconds`` defaults to the span of the trace (first start to last end over all ranks).
    ``step_seconds`` is one training step without the switch; the share is switch / (step + switch).
    """
    ranks: dict[int, dict[str, Any]] = {}
    for r in records:
        s = ranks.setdefault(int(r["rank"]), {"num_collectives": 0, "bytes_received": 0, "busy_seconds": 0.0,
                                               "start": math.inf, "end": -math.inf})
        s["num_collectives"] += 1
        s["bytes_received"] += int(r["bytes_received"])
        s["busy_seconds"] += float(r["seconds"])
        s["start"] = min(s["start"], float(r["start"]))
        s["end"] = max(s["end"], float(r["end"]))
    for s in ranks.values():
        s["span_seconds"] = s["end"] - s["start"]
        s["gbps"] = s["bytes_received"] / s["busy_seconds"] / 1e9 if s["busy_seconds"] > 0 else 0.0
    t0 = min((s["start"] for s in ranks.values()), default=0.0)
    t1 = max((s["end"] for s in ranks.values()), default=0.0)
    span = max(t1 - t0, 0.0)
    switch = span if switch_seconds is None else float(switch_seconds)
    share = None
    if step_seconds is not None and step_seconds + switch > 0:
        share = switch / (step_seconds + switch)
    return {"ranks": dict(sorted(ranks.items())), "t0": t0, "span_seconds": span, "switch_seconds": switch,
            "step_seconds": step_seconds, "switch_share": share, "num_records": len(records),
            "total_bytes": sum(s["bytes_received"] for s in ranks.values())}


def write_communication_report(records: Sequence[dict[str, Any]], jsonl_path: Union[str, Path, None],
                               html_path: Union[str, Path, None], *, step_seconds: Optional[float] = None,
                               switch_seconds: Optional[float] = None, title: str = "Switch to rollout",
                               notes: Sequence[str] = ()) -> dict[str, Any]:
    """Write the trace as JSON lines and the HTML report (either path may be None); return :func:`summarize`.

    ``records``: as :func:`gather_trace` returns them on rank 0. ``step_seconds``: one training step without the
    switch (e.g. a measured forward+backward), for the share of the step spent switching. ``switch_seconds``:
    the switch's wall time if measured outside (default: the trace's span). ``notes``: lines shown under the title.
    """
    records = sorted(records, key=lambda r: (int(r["rank"]), int(r["index"])))
    missing = [f for f in TRACE_FIELDS if records and f not in records[0]]
    if missing:
        raise ValueError(f"trace records lack the fields {missing}; expected {list(TRACE_FIELDS)}")
    if step_seconds is not None and step_seconds < 0:
        raise ValueError(f"step_seconds ({step_seconds}) must be non-negative")
    summary = summarize(records, step_seconds=step_seconds, switch_seconds=switch_seconds)
    if jsonl_path is not None:
        Path(jsonl_path).parent.mkdir(parents=True, exist_ok=True)
        with open(jsonl_path, "w") as f:
            for r in records:
                f.write(json.dumps({k: r[k] for k in TRACE_FIELDS}) + "\n")
    if html_path is not None:
        Path(html_path).parent.mkdir(parents=True, exist_ok=True)
        Path(html_path).write_text(_render_html(records, summary, title=title, notes=notes))
    return summary


# ---------------------------------------------------------------------------------------------------------------
# HTML rendering (inline CSS and SVG only)

_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #1d1d1f; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
table { border-collapse: collapse; margin: 8px 0; }
th, td { border-bottom: 1px solid #ddd; padding: 3px 10px; text-align: right; white-space: nowrap; }
th { background: #f3f3f5; } td.l, th.l { text-align: left; }
.bar { display: inline-block; height: 10px; background: #3b7dd8; vertical-align: middle; }
.legend span { display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 14px; vertical-align: middle; }
.timeline { display: block; margin: 2px 0; }
.note { color: #555; }
"""


def _fmt_bytes(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 10 else f"{s:.2f} s"


def _colour(op: str) -> str:
    return _OP_COLOURS.get(op, _OTHER_COLOUR)


def _ticks(span: float, num: int = 6) -> list[float]:
    if span <= 0:
        return [0.0]
    raw = span / num
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(span / step) + 1)]


def _timeline_svg(rank: int, rows: list[dict[str, Any]], t0: float, span: float, *, width: int = 900) -> str:
    label_w, height = 70, 26
    plot_w = width - label_w - 10
    scale = plot_w / span if span > 0 else 0.0
    parts = [f'<svg class="timeline" data-rank="{rank}" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="rank {rank} timeline">',
             f'<text x="0" y="17" font-size="12">rank {rank}</text>',
             f'<rect x="{label_w}" y="4" width="{plot_w}" height="18" fill="#f6f6f8"/>']
    for r in rows:
        x = label_w + (float(r["start"]) - t0) * scale
        w = max(float(r["end"]) - float(r["start"]), 0.0) * scale
        tip = (f'#{r["index"]} {r["op"]} over {r["group_ranks"]}: {_fmt_bytes(r["bytes_received"])} in '
               f'{_fmt_s(float(r["seconds"]))} ({float(r["gbps"]):.2f} GB/s), '
               f'+{_fmt_s(float(r["start"]) - t0)}')
        parts.append(f'<rect x="{x:.2f}" y="5" width="{max(w, 1.0):.2f}" height="16" fill="{_colour(r["op"])}" '
                     f'stroke="#fff" stroke-width="0.5"><title>{html.escape(tip)}</title></rect>')
    parts.append("</svg>")
    return "".join(parts)


def _axis_svg(span: float, *, width: int = 900) -> str:
    label_w = 70
    plot_w = width - label_w - 10
    parts = [f'<svg class="axis" width="{width}" height="22" viewBox="0 0 {width} 22">']
    for t in _ticks(span):
        x = label_w + (t / span * plot_w if span > 0 else 0)
        parts.append(f'<line x1="{x:.1f}" y1="0" x2="{x:.1f}" y2="6" stroke="#444"/>'
                     f'<text x="{x:.1f}" y="18" font-size="11" text-anchor="middle">{t * 1e3:.3g} ms</text>')
    parts.append("</svg>")
    return "".join(parts)


def _share_svg(switch: float, step: float, *, width: int = 600) -> str:
    total = switch + step
    ws = width * switch / total if total > 0 else 0
    return (f'<svg class="share" width="{width}" height="24" viewBox="0 0 {width} 24">'
            f'<rect x="0" y="2" width="{width - ws:.2f}" height="20" fill="#9bc59d"><title>training step '
            f'{html.escape(_fmt_s(step))}</title></rect>'
            f'<rect x="{width - ws:.2f}" y="2" width="{ws:.2f}" height="20" fill="#d9534f"><title>switch '
            f'{html.escape(_fmt_s(switch))}</title></rect></svg>')


def _render_html(records: list[dict[str, Any]], summary: dict[str, Any], *, title: str,
                 notes: Sequence[str]) -> str:
    esc = html.escape
    t0, span = summary["t0"], summary["span_seconds"]
    by_rank: dict[int, list[dict[str, Any]]] = {r: [] for r in summary["ranks"]}
    for r in records:
        by_rank[int(r["rank"])].append(r)
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{esc(title)}</title>",
           f"<style>{_CSS}</style></head><body>", f"<h1>{esc(title)}</h1>"]
    for n in notes:
        out.append(f'<p class="note">{esc(n)}</p>')

    out.append("<h2>Summary</h2><table>")
    out.append(f'<tr><td class="l">ranks</td><td>{len(by_rank)}</td></tr>'
               f'<tr><td class="l">collectives (all ranks)</td><td>{summary["num_records"]}</td></tr>'
               f'<tr><td class="l">bytes received (all ranks)</td><td>{esc(_fmt_bytes(summary["total_bytes"]))}'
               f'</td></tr><tr><td class="l">switch</td><td>{esc(_fmt_s(summary["switch_seconds"]))}</td></tr>'
               f'<tr><td class="l">span of the collectives</td><td>{esc(_fmt_s(span))}</td></tr>')
    if summary["step_seconds"] is not None:
        out.append(f'<tr><td class="l">training step (without the switch)</td>'
                   f'<td>{esc(_fmt_s(summary["step_seconds"]))}</td></tr>'
                   f'<tr><td class="l">share of the step spent switching</td>'
                   f'<td>{100 * summary["switch_share"]:.1f} %</td></tr>')
    out.append("</table>")
    if summary["step_seconds"] is not None:
        out.append("<p>Step time: training (green) and switch (red), share = switch / (step + switch).</p>")
        out.append(_share_svg(summary["switch_seconds"], summary["step_seconds"]))
    else:
        out.append('<p class="note">No step time given: pass step_seconds= for the share of the step.</p>')

    out.append('<h2>Per rank</h2><table><tr><th>rank</th><th>collectives</th><th>bytes received</th>'
               '<th>busy</th><th>span</th><th>GB/s while busy</th></tr>')
    for rank, s in summary["ranks"].items():
        out.append(f'<tr><td>{rank}</td><td>{s["num_collectives"]}</td><td>{esc(_fmt_bytes(s["bytes_received"]))}'
                   f'</td><td>{esc(_fmt_s(s["busy_seconds"]))}</td><td>{esc(_fmt_s(s["span_seconds"]))}</td>'
                   f'<td>{s["gbps"]:.2f}</td></tr>')
    out.append("</table>")

    ops = sorted({r["op"] for r in records})
    out.append('<h2>Timeline per rank</h2><p class="legend">'
               + "".join(f'<span style="background:{_colour(op)}"></span>{esc(op)}' for op in ops)
               + " (hover a bar for details; one clock for all ranks of a host)</p>")
    out.append('<div class="timelines">')
    for rank, rows in by_rank.items():
        out.append(_timeline_svg(rank, rows, t0, span))
    out.append(_axis_svg(span))
    out.append("</div>")

    top = max((float(r["gbps"]) for r in records), default=0.0)
    out.append('<h2>Bandwidth per collective</h2><table><tr><th>rank</th><th>#</th><th class="l">op</th>'
               '<th class="l">group ranks</th><th>bytes received</th><th>time</th><th>start</th><th>GB/s</th>'
               '<th class="l"></th></tr>')
    for r in records:
        w = 160 * float(r["gbps"]) / top if top > 0 else 0
        out.append(f'<tr><td>{r["rank"]}</td><td>{r["index"]}</td><td class="l">{esc(r["op"])}</td>'
                   f'<td class="l">{esc(str(r["group_ranks"]))}</td><td>{esc(_fmt_bytes(r["bytes_received"]))}</td>'
                   f'<td>{esc(_fmt_s(float(r["seconds"])))}</td><td>+{esc(_fmt_s(float(r["start"]) - t0))}</td>'
                   f'<td>{float(r["gbps"]):.3f}</td><td class="l"><span class="bar" style="width:{w:.1f}px;'
                   f'background:{_colour(r["op"])}"></span></td></tr>')
    out.append("</table></body></html>")
    return "\n".join(out)
