"""Rollout memory on the card (issue 45): the KV cache sized to a fraction of the card, and the optimizer offloaded
only when the rollout does not fit beside it.

- ``--inference-memory-fraction F`` (vLLM's ``gpu_memory_utilization``): while rolling out the process may hold F of
  the card's total memory. At the first rollout, after the switch (the rollout weights bound, anything offloaded
  gone), the KV cache gets what is left of F · total after what the process holds then and the step graphs'
  reserve (:func:`graph_reserve_bytes`); the slots follow (``--inference-max-requests`` caps them) and are logged.
  The ranks agree on the smallest cache (the rollout replicas' ranks must lay out the same slots). A cache that
  cannot hold one sequence of ``--inference-max-seq-length`` positions is an error naming both lengths. On the CPU
  the fraction is ignored, with a warning.
- ``--offload-optimizer auto|always|never`` (``--no-offload-optimizer``: ``never``): ``always`` moves optimizer
  states, fp32 main parameters and gradient buffers to the host at every switch to rollout (the engine's
  ``offload_optimizer``/``offload_grads``); ``auto`` does so only when what the rollout needs, the cache for
  ``--inference-max-requests`` × ``--inference-max-seq-length`` positions plus the graphs' reserve, does not fit in
  F · total (F: the fraction, else :data:`AUTO_FRACTION`) beside what the process holds while training; on the CPU,
  never (the host is where it would go). ``never`` where the rollout does not fit is an error naming the bytes.
  The decision is taken on every rank with one MAX all-reduce, so every rank offloads alike and the log tells one
  story.

Legend: the byte counts are this rank's.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

from ..reshard import agree_max

if TYPE_CHECKING:
    from ..inference import GenerationConfig

logger = logging.getLogger(__name__)

OFFLOAD_MODES = ("auto", "always", "never")
#: ``auto``'s share of the card without ``--inference-memory-fraction`` (vLLM's default gpu_memory_utilization).
AUTO_FRACTION = 0.9
#: The step graphs' and a step's temporaries, in fp32 copies of every slot's logits (the logits, tempered, their
#: softmax, the sampling race's draws, top-p's sort and its indices: what a 256-slot capture of a 152k vocabulary
#: filled a 4 GiB pool with), plus one GiB for the layers' activations and the libraries' workspaces.
GRAPH_LOGIT_COPIES = 8


def kv_bytes_per_token(arch: Any, *, rollout_tp: int, rollout_pp: int) -> int:
    """KV-cache bytes one position of one sequence takes on a rank of the rollout layout (keys and values of its
    stage's layers, its share of the KV heads; megatron_hybrid.inference's ``CacheGeometry.bytes_per_token``)."""
    layers = -(-arch.num_layers // rollout_pp)
    kv_heads = max(1, (arch.num_query_groups or arch.num_attention_heads) // rollout_tp)
    head_dim = arch.kv_channels or arch.hidden_size // arch.num_attention_heads
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=arch.dtype).element_size()


def graph_reserve_bytes(arch: Any, *, rollout_tp: int, max_requests: int) -> int:
    """What the rollout takes beside the cache and the weights (an estimate, :data:`GRAPH_LOGIT_COPIES`): the
    replica's generator reports what its graphs' pool really took (``cuda_graph_pool_bytes``)."""
    vocab = arch.padded_vocab_size(rollout_tp) // rollout_tp
    return GRAPH_LOGIT_COPIES * max_requests * vocab * 4 + 2**30


def cache_tokens(*, fraction: float, total: int, used: int, reserve: int, per_token: int) -> int:
    """The positions a cache of what is left of ``fraction`` · ``total`` after ``used`` and ``reserve`` holds."""
    return max(0, int(fraction * total) - used - reserve) // per_token


def check_fraction(fraction: Optional[float]) -> None:
    """``ValueError`` naming ``--inference-memory-fraction`` unless it is None or in (0, 1]."""
    if fraction is not None and not 0 < fraction <= 1:
        raise ValueError(f"--inference-memory-fraction ({fraction}) must be in (0, 1]: the share of the card's total "
                         "memory the process may hold while rolling out")


@dataclass
class MemoryInfo:
    """A card's memory as the process sees it (``torch.cuda.mem_get_info`` after ``empty_cache``)."""

    free: int
    total: int

    @property
    def used(self) -> int:
        return self.total - self.free

    @staticmethod
    def of(device: torch.device) -> "MemoryInfo":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the caching allocator's free blocks are no use to the cache's own reservation
        free, total = torch.cuda.mem_get_info(device)
        return MemoryInfo(free, total)


class RolloutMemoryPolicy:
    """The two decisions of the module docstring for one run: :meth:`offload` before each switch to rollout,
    :meth:`sized` after it (the cache, sized once).

    Args:
        config: the rollout's :class:`GenerationConfig` (``max_batch_size``: ``--inference-max-requests``;
            ``max_sequence_length``: ``--inference-max-seq-length``).
        fraction: ``--inference-memory-fraction`` (None: the cache is ``max_batch_size`` full sequences).
        offload: ``--offload-optimizer``.
        per_token, reserve: :func:`kv_bytes_per_token`, :func:`graph_reserve_bytes`.
        device: this rank's device. ``memory_info``: how the card is read (tests give their own).
    """

    def __init__(self, config: GenerationConfig, *, fraction: Optional[float], offload: str, per_token: int,
                 reserve: int, device: torch.device,
                 memory_info: Optional[Callable[[torch.device], MemoryInfo]] = None) -> None:
        check_fraction(fraction)
        if offload not in OFFLOAD_MODES:
            raise ValueError(f"--offload-optimizer ({offload}) must be one of {', '.join(OFFLOAD_MODES)}")
        self.config, self.fraction, self.mode = config, fraction, offload
        self.per_token, self.reserve, self.device = per_token, reserve, device
        self.memory_info = memory_info or MemoryInfo.of
        self.on_card = device.type == "cuda" or memory_info is not None
        self._sized: Optional[GenerationConfig] = None
        self.slots: Optional[int] = None
        if fraction is not None and not self.on_card:
            warnings.warn(f"--inference-memory-fraction ({fraction}) is ignored on the CPU: the cache is "
                          f"--inference-max-requests ({config.max_batch_size}) sequences", RuntimeWarning,
                          stacklevel=2)

    @property
    def full_cache_bytes(self) -> int:
        """The cache of ``max_batch_size`` sequences of ``max_sequence_length`` positions."""
        return self.config.max_batch_size * self.config.max_sequence_length * self.per_token

    def offload(self) -> bool:
        """Whether this switch to rollout offloads the optimizer (every rank gets the same answer: one collective
        where the answer depends on the card). ``ValueError`` for ``never`` where the rollout does not fit."""
        if self.mode == "always":
            return True
        if not self.on_card:
            return False
        info = self.memory_info(self.device)
        fraction = self.fraction or AUTO_FRACTION
        need = self.full_cache_bytes + self.reserve
        room = int(fraction * info.total) - info.used
        short = max(0, need - room)
        if dist.is_initialized() and dist.get_world_size() > 1:
            short = agree_max([short], dist.group.WORLD)[0]
        if short == 0:
            return False
        if self.mode == "never":
            raise ValueError(f"--offload-optimizer never: the rollout needs {need / 2**30:.2f} GiB (a KV cache of "
                             f"{self.config.max_batch_size} x {self.config.max_sequence_length} positions, "
                             f"{self.full_cache_bytes / 2**30:.2f} GiB, and {self.reserve / 2**30:.2f} GiB for the "
                             f"step graphs) but {max(room, 0) / 2**30:.2f} GiB of {fraction} x "
                             f"{info.total / 2**30:.2f} GiB are free beside the training state on some rank: offload "
                             "(--offload-optimizer auto or always) or lower --inference-max-requests")
        return True

    def sized(self) -> GenerationConfig:
        """The rollout's config, its cache sized to ``fraction`` at the first call (after the switch; a collective:
        every rank calls it), the same object after."""
        if self._sized is not None:
            return self._sized
        config = self.config
        if self.fraction is not None and self.on_card:
            info = self.memory_info(self.device)
            tokens = cache_tokens(fraction=self.fraction, total=info.total, used=info.used, reserve=self.reserve,
                                  per_token=self.per_token)
            if dist.is_initialized() and dist.get_world_size() > 1:
                tokens = -agree_max([-tokens], dist.group.WORLD)[0]  # the smallest
            if tokens < config.max_sequence_length:
                raise ValueError(f"--inference-memory-fraction ({self.fraction}): the KV cache gets {tokens} positions "
                                 f"({tokens * self.per_token / 2**30:.2f} GiB of {self.fraction} x "
                                 f"{info.total / 2**30:.2f} GiB after {info.used / 2**30:.2f} GiB held and "
                                 f"{self.reserve / 2**30:.2f} GiB for the step graphs), fewer than one sequence of "
                                 f"--inference-max-seq-length ({config.max_sequence_length}) positions")
            config = dataclasses.replace(config, cache_tokens=tokens)
        self.slots = min(config.max_batch_size, (config.cache_tokens or config.max_batch_size
                                                 * config.max_sequence_length) // config.max_sequence_length)
        logger.info("rollout KV cache: %d slots of %d positions (%.2f GiB)", self.slots, config.max_sequence_length,
                    self.slots * config.max_sequence_length * self.per_token / 2**30)
        self._sized = config
        return config
