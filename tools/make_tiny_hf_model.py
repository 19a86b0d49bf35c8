"""Save a tiny random-weight Hugging Face model with an offline tokenizer (for trying the real-model path).

examples:
  # a Qwen2 (q/k/v biases, untied embeddings), then convert it for Megatron
  python tools/make_tiny_hf_model.py --hf-dir tiny-qwen2 --family qwen2
  python tools/convert_checkpoint.py hf-to-megatron --hf-dir tiny-qwen2 --megatron-dir tiny-qwen2-mcore

  # a Llama with tied embeddings, another seed
  python tools/make_tiny_hf_model.py --hf-dir tiny-llama --family llama --seed 3

  # mixtures of experts: Qwen3-MoE (an MoE layer, then a dense one), Qwen2-MoE (a gated shared expert), then
  # split the experts over 2 expert-parallel ranks
  python tools/make_tiny_hf_model.py --hf-dir tiny-qwen3-moe --family qwen3_moe
  python tools/make_tiny_hf_model.py --hf-dir tiny-qwen2-moe --family qwen2_moe
  python tools/convert_checkpoint.py hf-to-megatron --hf-dir tiny-qwen3-moe --megatron-dir tiny-qwen3-moe-mcore \\
      --expert-model-parallel-size 2

  # the random-init control of a real model: its config and tokenizer, fresh weights (not tiny)
  python tools/make_tiny_hf_model.py --hf-dir smollm2-random --like smollm2-hf

The model has 2 layers, hidden size 64, GQA (4 heads, 2 KV heads) and SwiGLU 128 (the MoE families: 4 experts of
32, top-2, in their MoE layers); the tokenizer is a 128-token
byte-level BPE over ASCII with a ChatML chat template, built with the `tokenizers` library: nothing comes from a hub.
With --like DIR the model is DIR's architecture at full size, initialised as transformers' from_config does, with
DIR's tokenizer.
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

from megatron_hybrid.convert.tiny import FAMILIES, save_random_model_like, save_tiny_hf_model  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_doc_blocks.py parses the documented commands with it)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-dir", required=True, help="output directory (must not exist, or be empty)")
    ap.add_argument("--family", choices=sorted(FAMILIES), default=None, help="architecture (default: qwen2)")
    ap.add_argument("--seed", type=int, default=0, help="weights seed (default: 0)")
    ap.add_argument("--like", default=None, help="a Hugging Face directory: its config and tokenizer, random weights, "
                    "instead of the tiny model")
    return ap


def check_args(args: argparse.Namespace) -> None:
    """The checks beyond the parser's (``ValueError``; ``main`` reports it as a usage error). Whether --hf-dir is
    empty is ``main``'s: it depends on the moment, not on the command."""
    if args.like is not None and args.family is not None:
        raise ValueError(f"--family ({args.family}) and --like ({args.like}) exclude each other: the family is "
                         "--like's")


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        ap.error(str(e))
    family = args.family or "qwen2"
    target = Path(args.hf_dir)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        ap.error(f"--hf-dir ({args.hf_dir}) exists and is not empty")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written whole or not at all: into a directory beside the target, renamed onto it at the end.
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        if args.like is not None:
            save_random_model_like(str(work), args.like, seed=args.seed)
        else:
            save_tiny_hf_model(str(work), family, seed=args.seed)
        if target.exists():
            target.rmdir()  # empty, checked above
        os.replace(work, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    what = f"a random-weight model like {args.like}" if args.like is not None else f"a tiny {family} model"
    print(f"saved {what} to {args.hf_dir}")


if __name__ == "__main__":
    main()
