"""Fast generation on the rollout layout: KV cache, on-device sampling, continuous batching, CUDA graphs.

Pieces, one module each:

- :mod:`.attention`: megatron-core's ``SelfAttention`` with a per-slot KV cache (swapped in by class; ragged
  prompts, per-token positions); :mod:`.norms`: RMSNorm in one kernel during a step; :mod:`.moe`: megatron-core's
  ``MoELayer`` as one dropless step without host syncs (grouped expert GEMMs, expert parallelism by all-gather and
  reduce-scatter, replicas of one expert-parallel group in lockstep); :mod:`.context`: the step a
  stage runs, the one object those modules read it from; :mod:`.kv_cache`: the cache, one reserved range at a
  fixed address;
- :mod:`.scheduler`: continuous batching over decode slots; :mod:`.sampling`: greedy / temperature / top-k /
  top-p on the device; :mod:`.graphs`: step graphs captured once per bucket, replayed across rollouts;
- the generator of one model replica (tensor and pipeline groups) in three rooms: :mod:`.planner` decides each step
  (a typed plan, pure Python), :mod:`.runner` executes it on this stage (graphs, sampling, pipeline exchange; its
  fixed-address buffers in :mod:`.stage_buffers`, its forwards in :mod:`.stage_forwards`), :mod:`.replica` runs the
  loop, stops and results;
- :mod:`.generator`: the HybridEngine's micro-DP data flow around it; :mod:`.validation`: argument checks that
  every rank agrees on before any generation collective; :mod:`.host_syncs`: which host lines wait on the device.

Why our own attention path rather than megatron-core's: its static ``inference_context`` keeps one offset for the
whole batch (no ragged prompts, no slot reuse), its dynamic engine needs flash-attn for dynamic batching, and its
engines read Megatron's global pipeline groups. Here the model stays megatron-core's GPTModel on the engine's
weights; only the attention core between ``linear_qkv`` and ``linear_proj`` changes while a step runs.
"""

from .config import GenerationConfig
from .generator import RolloutGenerator, generate_with_model, replica_seed, split_evenly, turn_share
from .replica import Budget, GenerationResult, KeptPrefix, ReplicaGenerator, Turns

__all__ = ["Budget", "GenerationConfig", "GenerationResult", "KeptPrefix", "ReplicaGenerator", "RolloutGenerator",
           "Turns", "generate_with_model", "replica_seed", "split_evenly", "turn_share"]
