"""Issue 45, step 1: a Qwen2.5-7B-like rollout at 256 slots on one 80 GB card (not collected by pytest: needs a GPU).

    python3 tests/gpu_rollout_memory.py --output /tmp/rollout_memory.json

The case that failed: the 7B shape (28 layers, hidden 3,584, 28 heads / 4 KV groups, QKV biases, vocabulary
152,064, bf16) in aliased mode at rollout TP 1, generating an RL-style ragged batch (bench/generate.py's ``mixed``
variant: 1,024 prompts of 64-448 tokens, up to 1,024 new at temperature 1 / top-p 0.9, a stop set of 1/160 of the
vocabulary) through ``GenerationConfig(max_batch_size=256)``. It ran out of memory on a ~612 MiB allocation with
39 GiB of the card free: the step graphs' pool was a fixed 4 GiB reservation of address space
(``graph_pool_gib=4``), and the captures of the 256-row steps (fp32 logits and sampling temporaries of 256 x 152k
vocabulary entries each) filled it. Now the reservation is the card's size in address space (physical memory follows
what the captures use), and a full pool is named in the error.

Runs, each in its own process (bench/generate.py, one timed call, no warm-up: the call captures the graphs):

- ``graph_pool_gib=4`` (the old default): expected to fail, with the error naming the pool;
- the default: expected to generate; its tok/s, the graph pool's bytes and the peak memory are reported.

Prints one JSON summary (also to ``--output``); exits 1 when the default run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASE = ["--shape", "qwen2.5-7b", "--batch", "256", "--prompt-len", "256", "--new-tokens", "512", "--variants",
        "mixed", "--methods", "ours", "--runs", "1", "--warmup", "0"]


def run(extra: list[str], timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, str(ROOT / "bench" / "generate.py"), *CASE, *extra, "--out", out]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {"command": " ".join(cmd[1:]), "ok": False, "error": f"timed out after {timeout} s"}
        lines = [line for line in proc.stderr.splitlines() + proc.stdout.splitlines()
                 if "OutOfMemoryError" in line or "out of memory" in line or "reserved pool" in line]
        result = {"command": " ".join(cmd[1:]), "ok": proc.returncode == 0, "returncode": proc.returncode,
                  "errors": lines[-3:], "tail": (proc.stdout + proc.stderr)[-1500:]}
        if proc.returncode == 0 and os.path.exists(out):
            result["rows"] = json.load(open(out))
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", default=None)
    ap.add_argument("--timeout", type=int, default=400, help="seconds per run")
    ap.add_argument("--skip-old", action="store_true", help="run only the default configuration")
    args = ap.parse_args()
    summary = {}
    if not args.skip_old:
        summary["graph_pool_gib_4"] = run(["--graph-pool-gib", "4"], args.timeout)
    summary["default"] = run([], args.timeout)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    sys.exit(0 if summary["default"]["ok"] else 1)


if __name__ == "__main__":
    main()
