#!/usr/bin/env python
"""Peak resident memory of tools/convert_checkpoint.py on a 1B-parameter Llama-shaped checkpoint.

Writes a random bf16 checkpoint shaped like Llama-3.2-1B (hidden 2048, 16 layers, 32 heads, 8 KV heads, ffn 8192,
vocabulary 128256, tied; 1.24 B parameters, 2.5 GB) as two safetensors shards plus an index, converts it in child
processes (HF → Megatron at TP 1 × PP 1, back to HF, HF → Megatron at TP 2 × PP 2) and reports each child's peak
RSS (its ``VmHWM``) against the largest tensor (the 525 MB embedding). The fixed overhead is the
peak of the same tool converting a tiny model (interpreter, torch, safetensors, transformers). The claim checked:
peak ≤ 1.5 × largest + overhead. Needs ~7.5 GB of disk at most; everything is deleted at the end.

    python bench/convert_memory.py [--workdir DIR] [--output bench/results/convert_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                num_hidden_layers=16, vocab_size=128256, head_dim=64)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            vocab_size=256, head_dim=16)
MB = 2**20


def write_checkpoint(directory: Path, dims: dict) -> int:
    """A random bf16 Llama checkpoint in two shards (embedding + first half of the layers, the rest), written
    shard by shard with safetensors; returns the largest tensor's bytes."""
    directory.mkdir(parents=True)
    h, f, L, v = dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"], dims["vocab_size"]
    q, kv = dims["num_attention_heads"] * dims["head_dim"], dims["num_key_value_heads"] * dims["head_dim"]
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16",
              "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
              "max_position_embeddings": 131072, **dims,
              "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                   p + "mlp.down_proj.weight": (h, f)}
    shapes["model.norm.weight"] = (h,)
    names = list(shapes)
    split = names.index(f"model.layers.{L // 2}.input_layernorm.weight")
    files = {"model-00001-of-00002.safetensors": names[:split], "model-00002-of-00002.safetensors": names[split:]}
    weight_map = {}
    for fname, group in files.items():
        save_file({n: torch.randn(shapes[n], dtype=torch.bfloat16) for n in group}, directory / fname)
        weight_map |= {n: fname for n in group}
    total = sum(torch.Size(s).numel() * 2 for s in shapes.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return max(torch.Size(s).numel() * 2 for s in shapes.values())


# The child reports its own high-water mark (VmHWM) as it exits. Not the parent's ru_maxrss: Linux carries the
# RSS peak of the pre-exec (forked) image into the child's, so a big parent inflates it (seen: +1.3 GB here).
PEAK_SHIM = """
import atexit, runpy, sys
def report():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            sys.stderr.write("PEAK_RSS_KB " + line.split()[1] + "\\n")
atexit.register(report)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_tool(*args: str) -> tuple[int, float]:
    """Run convert_checkpoint.py in a child; return (its peak RSS in bytes, seconds)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PEAK_SHIM, str(ROOT / "tools" / "convert_checkpoint.py"), *args,
                           "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"convert_checkpoint.py {' '.join(args)} failed:\n{done.stderr}")
    return int(done.stderr.rsplit("PEAK_RSS_KB ", 1)[1].split()[0]) * 1024, seconds


def spot_check(a: Path, b: Path, names: list[str]) -> bool:
    """A few tensors of two HF directories are equal (the tests check every tensor on small models)."""
    def find(d: Path, name: str) -> torch.Tensor:
        index = d / "model.safetensors.index.json"
        fname = json.loads(index.read_text())["weight_map"][name] if index.exists() else "model.safetensors"
        with safe_open(d / fname, "pt") as f:
            return f.get_tensor(name)

    return all(torch.equal(find(a, n), find(b, n)) for n in names)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a new one under $TMPDIR)")
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "convert_memory.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="convert_memory-", dir=args.workdir))
    results: dict = {"model": "Llama-3.2-1B-shaped, random bf16, tied", **LLAMA_1B}
    try:
        write_checkpoint(work / "tiny", TINY)
        overhead, _ = run_tool("hf-to-megatron", "--hf-dir", str(work / "tiny"),
                               "--megatron-dir", str(work / "tiny_mg"))
        t = time.perf_counter()
        largest = write_checkpoint(work / "hf", LLAMA_1B)
        results |= {"checkpoint_bytes": sum(p.stat().st_size for p in (work / "hf").iterdir()),
                    "write_seconds": round(time.perf_counter() - t, 1), "largest_tensor_bytes": largest,
                    "fixed_overhead_bytes": overhead, "bound_bytes": int(1.5 * largest + overhead), "runs": []}
        runs = [("hf-to-megatron TP1 PP1", ["hf-to-megatron", "--hf-dir", str(work / "hf"), "--megatron-dir",
                                            str(work / "mg")]),
                ("megatron-to-hf", ["megatron-to-hf", "--megatron-dir", str(work / "mg"),
                                    "--hf-dir", str(work / "back")]),
                ("hf-to-megatron TP2 PP2", ["hf-to-megatron", "--hf-dir", str(work / "hf"), "--megatron-dir",
                                            str(work / "mg2"), "--tensor-model-parallel-size", "2",
                                            "--pipeline-model-parallel-size", "2"])]
        for label, argv in runs:
            if label.endswith("TP2 PP2"):  # keep the disk footprint at three copies
                ok = spot_check(work / "hf", work / "back", ["model.embed_tokens.weight",
                                                             "model.layers.7.self_attn.k_proj.weight",
                                                             "model.layers.15.mlp.up_proj.weight"])
                results["round_trip_spot_check_equal"] = ok
                shutil.rmtree(work / "mg")
                shutil.rmtree(work / "back")
            peak, seconds = run_tool(*argv)
            results["runs"].append({"run": label, "peak_rss_bytes": peak, "seconds": round(seconds, 1),
                                    "within_bound": peak <= results["bound_bytes"]})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"largest tensor {largest / MB:.0f} MiB, fixed overhead (tiny model) {overhead / MB:.0f} MiB, "
          f"bound 1.5 × largest + overhead = {results['bound_bytes'] / MB:.0f} MiB")
    for r in results["runs"]:
        print(f"  {r['run']:<24} peak RSS {r['peak_rss_bytes'] / MB:6.0f} MiB "
              f"(overhead {(r['peak_rss_bytes'] - overhead) / MB:+.0f} MiB)  {r['seconds']:6.1f} s  "
              f"{'OK' if r['within_bound'] else 'OVER'}")
    print(f"round trip spot check equal: {results.get('round_trip_spot_check_equal')}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["within_bound"] for r in results["runs"]) and results.get("round_trip_spot_check_equal") else 1


if __name__ == "__main__":
    sys.exit(main())
