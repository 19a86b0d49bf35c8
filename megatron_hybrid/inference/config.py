"""Settings of KV-cache generation (the sampling settings are megatron-core's ``SamplingParams``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class GenerationConfig:
    """How a generator lays out its KV cache and runs its decode steps."""

    max_batch_size: int = 64
    """Decode slots: sequences generated at once (fewer when the cache size below allows fewer)."""
    max_sequence_length: Optional[int] = None
    """Positions one sequence may take (prompt plus generated tokens); default: the model's
    ``max_sequence_length``. A prompt that cannot fit with ``num_tokens_to_generate`` is a ``ValueError``."""
    cache_tokens: Optional[int] = None
    """KV-cache size in positions over all slots; slots = min(max_batch_size, cache_tokens // max_sequence_length).
    Default: ``max_batch_size × max_sequence_length``."""
    cache_gib: Optional[float] = None
    """KV-cache size in GiB on this rank, instead of ``cache_tokens``."""
    prefill_tokens: int = 8192
    """At most this many prompt tokens per prefill forward (a longer prompt goes alone), bounding its activations."""
    cuda_graphs: Optional[bool] = None
    """Replay decode steps from CUDA graphs (one per batch and length bucket); default: on for a model on a GPU."""
    graph_batch_sizes: Optional[tuple[int, ...]] = None
    """Batch buckets of the decode graphs; default: powers of two below the slot count, and the slot count."""
    graph_length_granule: int = 256
    """Decode graphs attend over the filled positions rounded up to a multiple of this (eager steps: exactly);
    unused where the attention kernel reads each slot's own length (Triton on a GPU): one graph per batch bucket."""
    prefill_graph_granule: int = 32
    """With CUDA graphs, prefills run from graphs too, keyed by rows (exact up to 8, then whole eights) and the
    longest prompt rounded up to a multiple of this: right-padded prompts, padded rows written to a spare slot."""
    mixed_prefill_tokens: Optional[int] = None
    """Prompts admitted while other slots decode ride along the next decode step when they hold at most this many
    tokens (and are at most 8): one forward, the weights read once, instead of a prefill forward and a decode step.
    Larger refills, and the first fill, are prefills of their own. Default: 512 where decode attention is the
    kernel that reads each row's own length (Triton on a GPU), else 0 (off); a positive value on the CPU runs the
    kernel's PyTorch reference."""
    compact_slots: Optional[bool] = None
    """Once no prompt waits, move the sequences of high slots into free low ones (their cache positions copied)
    when that lets decode steps run at a smaller batch bucket: the last sequences of a call then decode in a small
    batch rather than across the whole cache. Default: with CUDA graphs."""
    overlap_host: Optional[bool] = None
    """Launch each step before reading the previous one's tokens on the host, so stop detection and refills
    overlap the device's work (a sequence ending on a stop token costs one dropped row); default: on a GPU."""
    graph_pool_gib: Optional[float] = None
    """Address space reserved for the step graphs' memory, backed only during generate calls as the graphs need
    it (0: a private CUDA-graph pool, which stays allocated while training). Default: the card's total memory, as
    address space only (physical memory follows what the captures use): a fixed few GiB ran out at 256 slots of a
    152k vocabulary, an out-of-memory error with most of the card free."""
    fused_decoder: Optional[bool] = None
    """Run each step's dense layers with SwiGLU in one kernel and every residual add fused with the next RMSNorm
    (:mod:`.fused`); default: on a GPU with Triton, for stages whose layers it computes (Llama-like: RMSNorm,
    SwiGLU, no biases on linear_proj and the MLP). False: megatron-core's layer forward; True: a ValueError where
    the layers do not qualify."""
    release_memory: bool = True
    """On a GPU, return the caching allocator's free blocks (prefill and sampling scratch) after each call."""
    record_routing: bool = False
    """MoE models: record the top-k experts every MoE layer chose for every token the model ran (prompt tokens
    included) into a ``[slots, positions, k]`` buffer per layer (reserved with the KV cache, written at each token's
    slot and position, so graph steps keep their addresses) and return them as ``GenerationResult.routed_experts``:
    what routing replay (``--moe-enable-routing-replay``) feeds to the training routers. It takes M x slots x
    positions x k x 2 bytes on a stage with M MoE layers (48 x 64 x 4096 x 8 x 2 B = 192 MiB), beside the cache
    (``cache_gib`` does not count it)."""

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "prefill_tokens", "graph_length_granule", "prefill_graph_granule"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GenerationConfig.{name} ({value!r}) must be a positive integer")
        if self.max_sequence_length is not None and (not isinstance(self.max_sequence_length, int)
                                                     or self.max_sequence_length < 2):
            raise ValueError(f"GenerationConfig.max_sequence_length ({self.max_sequence_length!r}) must be an "
                             "integer >= 2 (a prompt token and a generated one)")
        if self.mixed_prefill_tokens is not None and (not isinstance(self.mixed_prefill_tokens, int)
                                                      or self.mixed_prefill_tokens < 0):
            raise ValueError(f"GenerationConfig.mixed_prefill_tokens ({self.mixed_prefill_tokens!r}) must be an "
                             "integer >= 0")
        if self.compact_slots not in (None, True, False):
            raise ValueError(f"GenerationConfig.compact_slots ({self.compact_slots!r}) must be True, False or None")
        if self.overlap_host not in (None, True, False):
            raise ValueError(f"GenerationConfig.overlap_host ({self.overlap_host!r}) must be True, False or None")
        if self.cache_tokens is not None and self.cache_gib is not None:
            raise ValueError(f"give cache_tokens ({self.cache_tokens}) or cache_gib ({self.cache_gib}), not both")
        if self.cache_tokens is not None and (not isinstance(self.cache_tokens, int) or self.cache_tokens < 1):
            raise ValueError(f"GenerationConfig.cache_tokens ({self.cache_tokens!r}) must be a positive integer")
        if self.graph_pool_gib is not None and not self.graph_pool_gib >= 0:
            raise ValueError(f"GenerationConfig.graph_pool_gib ({self.graph_pool_gib!r}) must be >= 0 (or None: "
                             "the card's total memory)")
        if self.cache_gib is not None and not self.cache_gib > 0:
            raise ValueError(f"GenerationConfig.cache_gib ({self.cache_gib!r}) must be positive")
        if self.graph_batch_sizes is not None and (not self.graph_batch_sizes or any(
                not isinstance(b, int) or b < 1 for b in self.graph_batch_sizes)):
            raise ValueError(f"GenerationConfig.graph_batch_sizes ({self.graph_batch_sizes!r}) must be positive "
                             "integers")
