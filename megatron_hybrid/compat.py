"""Every megatron-core version difference we depend on, guarded here and nowhere else.

Supported: megatron-core 0.16.1 (the newest for Python 3.11) up to 0.19.x.
"""

from __future__ import annotations

import warnings

from packaging.version import Version

import megatron.core

MCORE_VERSION = Version(megatron.core.__version__)
MIN_VERSION = Version("0.16.1")
MAX_VERSION_EXCLUSIVE = Version("0.20")

if not (MIN_VERSION <= MCORE_VERSION < MAX_VERSION_EXCLUSIVE):
    warnings.warn(f"megatron-hybrid is tested with megatron-core >= {MIN_VERSION}, < {MAX_VERSION_EXCLUSIVE}; "
                  f"found {MCORE_VERSION}", stacklevel=2)

#: 0.17+ deprecates constructing GPTModel directly (it still works; silence the warning at our call sites).
GPTMODEL_DEPRECATION_WARNING = MCORE_VERSION >= Version("0.17")


def build_gpt_model(*args, **kwargs):
    """``GPTModel(*args, **kwargs)``, without 0.17+'s deprecation warning."""
    from megatron.core.models.gpt import GPTModel

    with warnings.catch_warnings():
        if GPTMODEL_DEPRECATION_WARNING:
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            warnings.filterwarnings("ignore", message=".*GPTModel.*deprecat.*")
        return GPTModel(*args, **kwargs)
