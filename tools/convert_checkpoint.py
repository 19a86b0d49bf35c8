#!/usr/bin/env python
"""Convert checkpoints between Hugging Face (safetensors) and Megatron (megatron-core GPTModel, TP/PP-split).

The library behind this is megatron_hybrid.convert; see the README's "Checkpoint conversion" section.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

EPILOG = """\
examples:
  # Hugging Face → Megatron, split for TP=2, PP=2 (megatron-core local spec names)
  python tools/convert_checkpoint.py hf-to-megatron --hf-dir ./Qwen2.5-0.5B --megatron-dir ./qwen-mcore \\
      --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

  # the same, with Transformer Engine parameter names, replacing an earlier output
  python tools/convert_checkpoint.py hf-to-megatron --hf-dir ./Llama-3.2-1B --megatron-dir ./llama-mcore \\
      --transformer-impl transformer_engine --force

  # a mixture of experts (Qwen3-MoE, Qwen2-MoE): 8 expert-parallel ranks, experts not tensor-parallel
  python tools/convert_checkpoint.py hf-to-megatron --hf-dir ./Qwen3-30B-A3B --megatron-dir ./qwen3-moe-mcore \\
      --tensor-model-parallel-size 2 --expert-model-parallel-size 8 --expert-tensor-parallel-size 1

  # Megatron → Hugging Face (any TP/PP/EP/ETP the checkpoint was written at)
  python tools/convert_checkpoint.py megatron-to-hf --megatron-dir ./qwen-mcore --hf-dir ./qwen-hf

  # then check the logits against transformers
  python tools/verify_checkpoint.py --hf-dir ./Qwen2.5-0.5B --megatron-dir ./qwen-mcore

Supported: Llama (incl. Llama 3 rope scaling), Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE, Qwen2-MoE. The Megatron side
is Megatron-LM's release/mp_rank_TT_PPP/ layout holding model.safetensors files (routed experts in
release/mp_rank_UU_PPP_EEE/: expert-TP rank UU, stage PPP, expert-parallel rank EEE), plus
megatron_hybrid_checkpoint.json (the GPTArchitecture, the Megatron-LM arguments and a sha256 of every file,
checked whenever it is read); megatron_hybrid.convert.load_megatron_checkpoint loads it into a GPTModel at any
TP/PP/EP/ETP. Memory stays at a few bands of 16 MiB whatever the model size. A Hugging Face input has no digests:
its safetensors headers are checked, and its weights must be finite (--allow-non-finite to convert NaN or ±inf as
they are).
"""


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_doc_blocks.py parses the documented commands with it)."""
    parser = argparse.ArgumentParser(prog="convert_checkpoint.py", description=__doc__.splitlines()[0],
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mg = sub.add_parser("hf-to-megatron", help="Hugging Face directory → Megatron checkpoint",
                           epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    to_mg.add_argument("--hf-dir", required=True, help="Hugging Face model directory (config.json, *.safetensors)")
    to_mg.add_argument("--megatron-dir", required=True, help="output directory")
    to_mg.add_argument("--tensor-model-parallel-size", type=int, default=1)
    to_mg.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    to_mg.add_argument("--expert-model-parallel-size", type=int, default=1,
                       help="expert-parallel ranks the routed experts are split over (default: %(default)s)")
    to_mg.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                       help="tensor-parallel ranks each expert is split over (default: the tensor-parallel size)")
    to_mg.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default="local",
                       help="whose parameter names to write (default: %(default)s)")
    to_mg.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="pad the vocabulary to a multiple of this × TP (default: %(default)s)")
    to_mg.add_argument("--allow-non-finite", action="store_true",
                       help="convert weights that hold NaN or ±inf (by default they are an error naming the tensor)")
    to_hf = sub.add_parser("megatron-to-hf", help="Megatron checkpoint → Hugging Face directory",
                           epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    to_hf.add_argument("--megatron-dir", required=True, help="a checkpoint written by hf-to-megatron")
    to_hf.add_argument("--hf-dir", required=True, help="output directory")
    to_hf.add_argument("--model-type", choices=("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"),
                       default=None,
                       help="Hugging Face family (default: the one the checkpoint came from)")
    to_hf.add_argument("--max-shard-size-gb", type=float, default=5.0,
                       help="split the safetensors output into files of at most this many GB (10^9 bytes; a larger "
                       "tensor gets a file of its own; default: %(default)s)")
    for p in (to_mg, to_hf):
        p.add_argument("--force", action="store_true", help="replace the output directory if it exists")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """The checks beyond the parser's (``ValueError``; ``main`` reports it as a usage error)."""
    from megatron_hybrid.checks import check_number

    if args.direction == "hf-to-megatron":
        check_number("--tensor-model-parallel-size", args.tensor_model_parallel_size, ge=1)
        check_number("--pipeline-model-parallel-size", args.pipeline_model_parallel_size, ge=1)
        check_number("--expert-model-parallel-size", args.expert_model_parallel_size, ge=1)
        if args.expert_tensor_parallel_size is not None:
            check_number("--expert-tensor-parallel-size", args.expert_tensor_parallel_size, ge=1)
        check_number("--make-vocab-size-divisible-by", args.make_vocab_size_divisible_by, ge=1)
    else:
        check_number("--max-shard-size-gb", args.max_shard_size_gb, gt=0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit status 0 on success; 2 for a bad flag (as argparse), 1 for an unusable input or a failed write, each
    with a one-line message (outputs are written whole or not at all)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        parser.error(str(e))
    from megatron_hybrid.convert import CheckpointError, describe_os_error, hf_to_megatron, megatron_to_hf

    output = args.megatron_dir if args.direction == "hf-to-megatron" else args.hf_dir
    try:
        if args.direction == "hf-to-megatron":
            arch = hf_to_megatron(args.hf_dir, args.megatron_dir,
                                  tensor_model_parallel_size=args.tensor_model_parallel_size,
                                  pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                                  expert_model_parallel_size=args.expert_model_parallel_size,
                                  expert_tensor_parallel_size=args.expert_tensor_parallel_size,
                                  transformer_impl=args.transformer_impl,
                                  make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                                  allow_non_finite=args.allow_non_finite, force=args.force,
                                  progress=not args.no_progress)
            print(f"wrote {args.megatron_dir} ({arch.num_layers} layers, hidden {arch.hidden_size}, vocab "
                  f"{arch.vocab_size} → {arch.padded_vocab_size(args.tensor_model_parallel_size)}, "
                  f"TP {args.tensor_model_parallel_size}, PP {args.pipeline_model_parallel_size}"
                  + (f", {arch.num_experts} experts: EP {args.expert_model_parallel_size}, ETP "
                     f"{args.expert_tensor_parallel_size or args.tensor_model_parallel_size}"
                     if arch.num_experts is not None else "") + ")")
        else:
            megatron_to_hf(args.megatron_dir, args.hf_dir, model_type=args.model_type,
                           max_shard_bytes=int(args.max_shard_size_gb * 10**9), force=args.force,
                           progress=not args.no_progress)
            print(f"wrote {args.hf_dir}")
    except CheckpointError as e:
        raise SystemExit(f"convert_checkpoint.py: error: {e}") from None
    except OSError as e:
        raise SystemExit(f"convert_checkpoint.py: error: {describe_os_error(e, output=output)}; nothing was "
                         f"written") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
