"""Save a tiny random-weight Hugging Face model with an offline tokenizer (for trying the real-model path).

examples:
  # a Qwen2 (q/k/v biases, untied embeddings), then convert it for Megatron
  python tools/make_tiny_hf_model.py --hf-dir tiny-qwen2 --family qwen2
  python tools/convert_checkpoint.py hf-to-megatron --hf-dir tiny-qwen2 --megatron-dir tiny-qwen2-mcore

  # a Llama with tied embeddings, another seed
  python tools/make_tiny_hf_model.py --hf-dir tiny-llama --family llama --seed 3

The model has 2 layers, hidden size 64, GQA (4 heads, 2 KV heads) and SwiGLU 128; the tokenizer is a 128-token
byte-level BPE over ASCII with a ChatML chat template, built with the `tokenizers` library: nothing comes from a hub.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_hybrid.convert.tiny import FAMILIES, save_tiny_hf_model  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-dir", required=True, help="output directory (must not exist, or be empty)")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="qwen2", help="architecture (default: qwen2)")
    ap.add_argument("--seed", type=int, default=0, help="weights seed (default: 0)")
    args = ap.parse_args(argv)
    target = Path(args.hf_dir)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        ap.error(f"--hf-dir ({args.hf_dir}) exists and is not empty")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written whole or not at all: into a directory beside the target, renamed onto it at the end.
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        save_tiny_hf_model(str(work), args.family, seed=args.seed)
        if target.exists():
            target.rmdir()  # empty, checked above
        os.replace(work, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"saved a tiny {args.family} model to {args.hf_dir}")


if __name__ == "__main__":
    main()
