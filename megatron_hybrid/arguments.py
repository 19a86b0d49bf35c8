"""The recipe's command line, at its former path (deprecated): it lives in :mod:`megatron_hybrid.rl.arguments`
(the RL recipe's arguments and their validation); its range and directory checks in :mod:`megatron_hybrid.checks`;
``load_callable`` in :mod:`megatron_hybrid.rl.rewards`. Kept so that ``from megatron_hybrid.arguments import
add_hybrid_args`` (Megatron-LM's ``extra_args_provider``) keeps working; importing it warns."""

import warnings

from .checks import check_number, output_dir_error
from .rl.arguments import TINY_MODEL, TOKENIZER_TYPES, add_hybrid_args, add_megatron_args, validate_args
from .rl.rewards import load_callable

warnings.warn("megatron_hybrid.arguments is deprecated: import add_hybrid_args, add_megatron_args, validate_args, "
              "TINY_MODEL and TOKENIZER_TYPES from megatron_hybrid.rl.arguments, check_number and output_dir_error "
              "from megatron_hybrid.checks, load_callable from megatron_hybrid.rl.rewards", DeprecationWarning,
              stacklevel=2)

__all__ = ["TINY_MODEL", "TOKENIZER_TYPES", "add_hybrid_args", "add_megatron_args", "check_number", "load_callable",
           "output_dir_error", "validate_args"]
