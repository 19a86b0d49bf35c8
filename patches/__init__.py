"""Version-guarded, explicitly applied changes to megatron-core behaviour.

Installed as ``megatron_hybrid.patches``. Nothing here is applied on import: every patch is a function or a
context manager the caller chooses to use. Each states the megatron-core versions that need it and why.

- :func:`cpu_gloo` (``cpu.py``): lets GPTModel, the 1F1B schedule, Megatron DDP, megatron-core's optimizer and
  the static inference engine run on CPU with the gloo backend. For tests and CPU demos only; never applied in GPU
  production use. It includes ``dist_checkpointing.py``'s in-process shard writes.
"""

from .cpu import cpu_gloo, cpu_gloo_active

__all__ = ["cpu_gloo", "cpu_gloo_active"]
