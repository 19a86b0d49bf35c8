"""The recipe's command line, at its former path: it lives in :mod:`megatron_hybrid.rl.arguments` (the RL recipe's
arguments and their validation); its range and directory checks in :mod:`megatron_hybrid.checks`. Kept so that
``from megatron_hybrid.arguments import add_hybrid_args`` (Megatron-LM's ``extra_args_provider``) keeps working."""

from .checks import check_number, output_dir_error
from .rl.arguments import TINY_MODEL, TOKENIZER_TYPES, add_hybrid_args, add_megatron_args, validate_args
from .rl.rewards import load_callable

__all__ = ["TINY_MODEL", "TOKENIZER_TYPES", "add_hybrid_args", "add_megatron_args", "check_number", "load_callable",
           "output_dir_error", "validate_args"]
