"""Version-guarded, explicitly applied changes to megatron-core behaviour.

Part of the megatron-core glue (:mod:`megatron_hybrid.megatron`). Nothing here is applied on import: every patch is a
function or a context manager the caller chooses to use. Each states the megatron-core versions that need it and why.

- :func:`cpu_gloo` (``cpu.py``): lets GPTModel, the 1F1B schedule, Megatron DDP, megatron-core's optimizer and
  the static inference engine run on CPU with the gloo backend. For tests and CPU demos only; never applied in GPU
  production use. It includes ``dist_checkpointing.py``'s in-process shard writes.
- :func:`distributed_optimizer_loading` (``distrib_optimizer.py``): loading a ``DistributedOptimizer`` checkpoint
  with torch's Adam (no Apex or Transformer Engine), which megatron-core 0.16.1 fails on; applied by
  ``megatron_hybrid.rl.checkpoint.load_checkpoint``.
- :func:`~megatron_hybrid.megatron.patches.moe.moe_router_without_te` (``moe.py``): the MoE router's gating GEMM without
  Transformer Engine (a ``NameError`` on 0.16.1); applied by ``GPTArchitecture.build`` for a model with experts.
- :func:`~megatron_hybrid.megatron.patches.rope.packed_rope_without_host_syncs` (``rope.py``): rotary embeddings of
  packed (``thd``) sequences without reading ``cu_seqlens`` to the host in every layer and without a loop over the
  sequences, the same bits; applied by ``GPTArchitecture.build`` for a model with rotary embeddings.
"""

from .cpu import cpu_gloo, cpu_gloo_active
from .distrib_optimizer import distributed_optimizer_loading

__all__ = ["cpu_gloo", "cpu_gloo_active", "distributed_optimizer_loading"]
