"""The CPU smoke runs of issue 46's benches: bench/rl_generate.py (the generator alone on the RL workload, each call's
row consistent with what the call asked for) and bench/partial_model.py (the model of the loop)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_rl_generate_bench_smoke(tmp_path):
    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, "bench/rl_generate.py", "--smoke", "--out", str(out)], check=True, timeout=600,
                   cwd=ROOT, capture_output=True)
    calls = {r["call"]: r for r in json.loads(out.read_text()) if r["kind"] == "call"}
    assert set(calls) == {"fixed", "tail", "quota", "resume"}
    slots = calls["fixed"]["sequences"]
    # --smoke: 4 slots, 8 new tokens for the fixed call (no stop token), at most 16 for the RL prompts.
    assert slots == 4 and calls["fixed"]["tokens"] == 4 * 8 and calls["fixed"]["finished"] == 4
    assert calls["tail"]["finished"] == calls["tail"]["sequences"] == 4
    assert 4 <= calls["tail"]["tokens"] <= 4 * 16
    for name in ("quota", "resume"):  # 4 x slots sequences under Budget(finished=slots)
        assert calls[name]["sequences"] == 16 and 4 <= calls[name]["finished"] < 16, calls[name]
        assert calls[name]["decode_steps"] >= 1 and calls[name]["seconds"] > 0


def test_partial_model_smoke():
    """bench/partial_model.py: a table row per setting, each ratio the row's tokens/s over the synchronous rate."""
    done = subprocess.run([sys.executable, "bench/partial_model.py", "--steps", "3", "--warmup", "1", "--seeds", "1",
                           "--max-staleness", "1", "3", "--in-flight", "64"], check=True, timeout=600, cwd=ROOT,
                          capture_output=True, text=True)
    lines = done.stdout.splitlines()
    sync = float(lines[0].split(":")[1].split()[0].replace(",", ""))
    rows = [line.split("|")[1:-1] for line in lines[3:]]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(1, 64), (3, 64)]
    for _, _, rate, ratio, dropped, busy in rows:
        assert abs(float(rate.replace(",", "")) / sync - float(ratio.strip().rstrip("x"))) < 0.01
        assert float(dropped) >= 0 and 0 <= float(busy) <= 1
