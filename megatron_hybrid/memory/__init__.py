"""Memory: address ranges reserved once and backed only while needed, and host offload.

- :mod:`.buffers`: :class:`ReservedBuffer`, an address range reserved once whose physical memory is mapped and
  unmapped by range (CUDA virtual memory on GPU, ``mmap`` + ``madvise`` on CPU), and the range arithmetic;
- :mod:`.rollout`: memory backed only while rolling out (:class:`RolloutBuffer`) and who decides when
  (:class:`RolloutMemoryProvider`, :class:`PerCallRolloutMemory`);
- :mod:`.offload`: optimizer states and gradients moved to host memory while rolling out (:class:`HostOffload`).

The names below are the room's interface: ``from megatron_hybrid.memory import ReservedBuffer`` (the three modules
import only torch).
"""

from .buffers import ReservedBuffer, allocation_granularity, merge_ranges, pad_to_granularity, subtract_ranges
from .offload import HostOffload, optimizer_tensors
from .rollout import PerCallRolloutMemory, RolloutBuffer, RolloutMemoryProvider

__all__ = ["HostOffload", "PerCallRolloutMemory", "ReservedBuffer", "RolloutBuffer", "RolloutMemoryProvider",
           "allocation_granularity", "merge_ranges", "optimizer_tensors", "pad_to_granularity", "subtract_ranges"]
