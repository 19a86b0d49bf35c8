"""tools/plot_metrics.py: the curves read from metrics.jsonl, its errors, and the PNG (where matplotlib is)."""

from __future__ import annotations

import json
import re
import runpy
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "plot_metrics.py"


@pytest.fixture
def tool() -> dict:
    return runpy.run_path(str(TOOL))


def _metrics(path: Path, lines: list[dict]) -> str:
    path.write_text("".join(json.dumps(m) + "\n" for m in lines))
    return str(path)


RUN = [{"step": 1, "time/step": 60.0, "reward_mean": 0.1},
       {"step": 2, "time/step": 90.0, "reward_mean": 0.2, "eval_accuracy": 0.25, "time/eval": 30.0},
       {"step": 3, "time/step": 60.0, "reward_mean": 0.4},
       {"step": 4, "time/step": 60.0, "reward_mean": 0.5, "eval_accuracy": 0.5}]


def test_read_curve(tool, tmp_path):
    curve = tool["read_curve"]("a", _metrics(tmp_path / "m.jsonl", RUN))
    assert curve.steps == [1, 2, 3, 4] and curve.reward == [0.1, 0.2, 0.4, 0.5]
    # Minutes add each step's time and the evaluations' own time: 1, 1 + 1.5 + 0.5, then + 1 twice.
    assert curve.minutes == [1.0, 3.0, 4.0, 5.0]
    assert (curve.eval_steps, curve.eval_minutes, curve.eval_accuracy) == ([2, 4], [3.0, 5.0], [0.25, 0.5])


def test_bad_input(tool, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(RUN[0]) + "\n" + json.dumps({"step": 2}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a metrics line"):
        tool["read_curve"]("bad", str(bad))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="has no metrics lines"):
        tool["read_curve"]("empty", str(tmp_path / "empty.jsonl"))
    good = _metrics(tmp_path / "m.jsonl", RUN)
    for argv, message in ((["a=" + str(tmp_path / "missing.jsonl")], "run 'a': .* is not a file"),
                          ([f"a={good}", "--start", "0.2"], "must be 'label=accuracy'"),
                          ([f"a={good}", "--start", "=0.2"], "must be 'label=value'")):
        with pytest.raises(SystemExit):
            tool["main"]([*argv, "--output", str(tmp_path / "x.png")])
        assert re.search(message, capsys.readouterr().err), message
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(SystemExit):
        tool["main"](["--help"])
    assert "examples:" in capsys.readouterr().out


def test_missing_matplotlib_says_what_to_install(tool, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(SystemExit, match=r"needs matplotlib \(pip install matplotlib"):
        tool["main"]([_metrics(tmp_path / "m.jsonl", RUN), "--output", str(tmp_path / "x.png")])


def test_png(tool, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    control = [dict(m, reward_mean=0.0, **({"eval_accuracy": 0.0} if "eval_accuracy" in m else {})) for m in RUN]
    out = tmp_path / "curve.png"
    tool["main"]([f"pretrained={_metrics(tmp_path / 'a.jsonl', RUN)}",
                  f"control={_metrics(tmp_path / 'b.jsonl', control)}", "--reward", "--start", "pretrained=0.2",
                  "--title", "t", "--output", str(out)])
    assert f"wrote {out}" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):  # a --start label that names no run
        tool["main"]([f"pretrained={tmp_path / 'a.jsonl'}", "--start", "other=0.1", "--output", str(out)])
    assert "--start labels ['other']" in capsys.readouterr().err
