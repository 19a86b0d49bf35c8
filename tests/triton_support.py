"""What the Triton kernel tests share (test_kernels.py, test_topp_kernel.py): where their Triton paths run, and
running them in Triton's CPU interpreter in a child process.

A file's Triton tests (named ``test_triton_*``) run where Triton is importable: on a GPU in the test process;
without one in Triton's CPU interpreter, which must be switched on before the kernels are defined, so
:func:`run_interpreted` runs them in a child pytest with ``TRITON_INTERPRET=1``. Without Triton they are skipped.
The interpreter's own defects are worked around by the ``triton_interpreter_fixes`` fixture (conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_hybrid.kernels.triton_helpers import HAVE_TRITON

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
TRITON_DEVICE = "cuda" if CUDA else "cpu"
needs_triton = pytest.mark.skipif(
    not (HAVE_TRITON and (CUDA or INTERPRET)),
    reason="needs Triton and a GPU, or TRITON_INTERPRET=1 (test_interpreter_subprocess runs these interpreted)")


def run_interpreted(test_file: str) -> None:
    """Run ``test_file``'s ``test_triton_*`` tests in Triton's CPU interpreter, in a child pytest; fails with its
    output unless they pass (skipped without Triton, or where they run in this process)."""
    pytest.importorskip("triton")
    if CUDA or INTERPRET:
        pytest.skip("the Triton tests run in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", "triton"],
                          capture_output=True, text=True, timeout=600, env=env,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout and "failed" not in proc.stdout, proc.stdout[-3000:]
