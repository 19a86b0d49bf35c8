"""bench/rl_generate.py on the CPU (issue 46): the generator alone on the RL workload, each call's row consistent with
what the call asked for."""

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
