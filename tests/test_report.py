"""The communication report: every collective of a switch in the JSONL trace, and a self-contained HTML page."""

from __future__ import annotations

import re

from megatron_hybrid.report import TRACE_FIELDS, read_trace, summarize, write_communication_report
from tests.harness import run_distributed

WORLD = 4


def switch_and_trace(out_dir: str):
    """Rank body: t=2, p=2 -> t_g=1, p_g=1 (gathers, cross-stage gathers and broadcasts), small buckets."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.megatron.models import tiny_llama
    from megatron_hybrid.report import gather_trace

    model = tiny_llama().build(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                               pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    engine = HybridEngine(model, RolloutLayout(1, 1), bucket_size_mb=0.05)
    engine.switch_to_rollout()
    report = engine.communication_report()
    records = gather_trace(engine)
    summary = None
    if dist.get_rank() == 0:
        summary = write_communication_report(records, f"{out_dir}/trace.jsonl", f"{out_dir}/report.html",
                                             step_seconds=0.5, title="test <switch>")
    engine.switch_to_training()
    return {"report": {k: report[k] for k in ("total_bytes", "num_collectives", "collectives")},
            "records": records, "summary": summary}


def test_trace_and_html_report(tmp_path):
    results = run_distributed(switch_and_trace, WORLD, str(tmp_path), tensor_model_parallel_size=2,
                              pipeline_model_parallel_size=2)
    assert all(r["records"] == [] for r in results[1:])  # only rank 0 receives the trace
    trace = read_trace(tmp_path / "trace.jsonl")
    assert trace == results[0]["records"]
    assert all(tuple(rec) == TRACE_FIELDS for rec in trace)

    ops = set()
    for rank, r in enumerate(results):
        mine = [rec for rec in trace if rec["rank"] == rank]
        rep = r["report"]
        # Every collective of the switch is there, in order, with its group and bytes.
        assert len(mine) == rep["num_collectives"] > 1
        assert [rec["index"] for rec in mine] == list(range(len(mine)))
        for rec, c in zip(mine, rep["collectives"]):
            assert (rec["op"], rec["group_ranks"], rec["bytes_received"]) == (c["op"], c["group_ranks"],
                                                                             c["bytes_received"])
            assert rank in rec["group_ranks"] and rec["end"] >= rec["start"]
        assert sum(rec["bytes_received"] for rec in mine) == rep["total_bytes"] > 0
        ops |= {rec["op"] for rec in mine}
    assert ops == {"all_gather_into_tensor", "broadcast"}

    summary = results[0]["summary"]
    assert summary == summarize(trace, step_seconds=0.5)
    assert summary["total_bytes"] == sum(r["report"]["total_bytes"] for r in results)
    assert 0 < summary["switch_share"] < 1

    page = (tmp_path / "report.html").read_text()
    # Self-contained: nothing to fetch, no scripts.
    assert not re.search(r"(?i)(https?:|ftp:|//[a-z0-9.-]+\.[a-z]{2,}|\bsrc\s*=|\bhref\s*=|url\(|@import|<script)",
                         page)
    # One timeline per rank.
    timelines = re.findall(r'<svg class="timeline" data-rank="(\d+)"', page)
    assert sorted(map(int, timelines)) == list(range(WORLD))
    # One bar per collective in the timelines, one table row per collective, titles escaped.
    assert page.count('stroke="#fff" stroke-width="0.5"><title>') == len(trace)
    assert "test &lt;switch&gt;" in page and "<switch>" not in page
    assert "share of the step spent switching" in page
