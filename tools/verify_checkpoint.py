#!/usr/bin/env python
"""Check a converted checkpoint: transformers and megatron-core logits on the same tokens, CPU, fp32.

Exits 0 when the largest absolute logit difference is within --atol, 1 when not.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

EPILOG = """\
examples:
  python tools/verify_checkpoint.py --hf-dir ./Qwen2.5-0.5B --megatron-dir ./qwen-mcore
  # megatron-core at TP=2 × PP=2: spawns 4 gloo ranks on this machine
  python tools/verify_checkpoint.py --hf-dir ./Qwen2.5-0.5B --megatron-dir ./qwen-mcore \\
      --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
  # a mixture of experts at TP=2 with the experts over 2 expert-parallel ranks: 2 gloo ranks
  python tools/verify_checkpoint.py --hf-dir ./Qwen3-30B-A3B --megatron-dir ./qwen3-moe-mcore \\
      --tensor-model-parallel-size 2 --expert-model-parallel-size 2 --expert-tensor-parallel-size 1

The megatron-core model may run at any TP/PP/EP/ETP, whatever the checkpoint was split for; it gets the fewest
data-parallel replicas over which EP × ETP fits (EP × ETP must divide TP × DP). Both models are held in
fp32 in this machine's memory (about 8 bytes per parameter, plus activations).
"""


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_doc_blocks.py parses the documented commands with it)."""
    from megatron_hybrid.convert.verify import DEFAULT_ATOL

    parser = argparse.ArgumentParser(prog="verify_checkpoint.py", description=__doc__.splitlines()[0], epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", required=True, help="the Hugging Face model directory")
    parser.add_argument("--megatron-dir", required=True, help="the converted checkpoint")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--expert-model-parallel-size", type=int, default=1)
    parser.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                        help="default: the tensor-parallel size")
    parser.add_argument("--atol", type=float, default=DEFAULT_ATOL,
                        help="largest acceptable |logit difference| (default %(default)g: fp32 reordering in a 1B "
                             "model stays below ~3e-4, layout bugs give ≥ 1e-2)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """The checks beyond the parser's (``ValueError``; ``main`` reports it as a usage error)."""
    from megatron_hybrid.checks import check_number

    check_number("--tensor-model-parallel-size", args.tensor_model_parallel_size, ge=1)
    check_number("--pipeline-model-parallel-size", args.pipeline_model_parallel_size, ge=1)
    check_number("--expert-model-parallel-size", args.expert_model_parallel_size, ge=1)
    if args.expert_tensor_parallel_size is not None:
        check_number("--expert-tensor-parallel-size", args.expert_tensor_parallel_size, ge=1)
    check_number("--batch-size", args.batch_size, ge=1)
    check_number("--seq-length", args.seq_length, ge=1)
    check_number("--atol", args.atol, ge=0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        parser.error(str(e))

    from megatron_hybrid.convert import CheckpointError, describe_os_error
    from megatron_hybrid.convert.verify import verify

    try:
        result = verify(args.hf_dir, args.megatron_dir, tensor_model_parallel_size=args.tensor_model_parallel_size,
                        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                        expert_model_parallel_size=args.expert_model_parallel_size,
                        expert_tensor_parallel_size=args.expert_tensor_parallel_size, batch_size=args.batch_size,
                        seq_length=args.seq_length, seed=args.seed)
    except CheckpointError as e:
        raise SystemExit(f"verify_checkpoint.py: error: {e}") from None
    except OSError as e:
        raise SystemExit(f"verify_checkpoint.py: error: {describe_os_error(e)}") from None
    experts = (f" EP {args.expert_model_parallel_size} ETP "
               f"{args.expert_tensor_parallel_size or args.tensor_model_parallel_size}"
               if args.expert_model_parallel_size > 1 or args.expert_tensor_parallel_size is not None else "")
    print(f"megatron-core TP {args.tensor_model_parallel_size} PP {args.pipeline_model_parallel_size}{experts} vs "
          f"transformers: {result.report(args.atol)}")
    return 0 if result.passed(args.atol) else 1


if __name__ == "__main__":
    sys.exit(main())
