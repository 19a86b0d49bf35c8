"""Host offload: tensors that are not needed while rolling out (optimizer states, fp32 main parameters, gradient
buffers) go to host memory and come back bit for bit, at the same tensor objects.

:class:`HostOffload` moves whole storages; :func:`optimizer_tensors` lists the device tensors an optimizer owns
(what ``HybridEngine.switch_to_rollout(offload_optimizer=...)`` offloads).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["HostOffload", "optimizer_tensors"]


class HostOffload:
    """Tensors' storages copied to host memory (pinned on GPU) and released in place, whole.

    Whole storages, not tensor extents: a tensor may be one view of a larger storage (an fp32 main parameter's
    gradient is a view of DDP's gradient buffer), and releasing the storage releases every view of it. Views and
    pointers held elsewhere (DDP's ``main_grad`` views, an optimizer's references to its state) stay valid objects;
    their memory and values come back in :meth:`reload`.
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (whole storage as bytes, host copy)
        self._swapped: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, host copy): non-resizable storages
        seen: set[int] = set()
        with torch.no_grad():
            for t in tensors:
                storage = t.untyped_storage()
                if storage.data_ptr() in seen or storage.nbytes() == 0:
                    continue
                seen.add(storage.data_ptr())
                if storage.resizable():
                    whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                    host = torch.empty(whole.shape, dtype=torch.uint8, pin_memory=t.is_cuda)
                    host.copy_(whole, non_blocking=t.is_cuda)
                    self._saved.append((whole, host))
                else:  # e.g. tensors from torch.load(weights_only=True): swap the data behind the same tensor
                    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
                    host.copy_(t, non_blocking=t.is_cuda)
                    self._swapped.append((t, host))
            if any(t.is_cuda for t in tensors):
                torch.cuda.synchronize()
            for whole, _ in self._saved:
                whole.untyped_storage().resize_(0)  # keeps the storage object: every view of it stays a view
            for t, _ in self._swapped:
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)

    @property
    def device_bytes(self) -> int:
        """Device bytes given back by the offload."""
        return sum(host.numel() for whole, host in self._saved if whole.device.type != "cpu") + \
            sum(host.numel() * host.element_size() for t, host in self._swapped if t.device.type != "cpu")

    def reload(self) -> None:
        """Bring every storage back (same objects, same values)."""
        with torch.no_grad():
            for whole, host in self._saved:
                whole.untyped_storage().resize_(host.numel())
                whole.set_(whole.untyped_storage())
                whole.copy_(host, non_blocking=whole.is_cuda)
            for t, host in self._swapped:
                t.data = host.to(t.device, non_blocking=t.is_cuda)
        self._saved, self._swapped = [], []


def optimizer_tensors(optimizer: Any, *, keep: list[torch.Tensor]) -> list[torch.Tensor]:
    """The device tensors an optimizer owns: its states and, for Megatron's mixed-precision optimizers, the fp32
    main parameters, each storage once.

    ``optimizer`` is a torch optimizer or a megatron-core one (``ChainedOptimizer``, ``DistributedOptimizer``,
    ``Float16OptimizerWithFloat16Params``, ``FP32Optimizer``). Tensors whose storage is that of a tensor in
    ``keep`` (the model's parameters, which the rollout needs) are left out: an FP32 optimizer's parameters are
    the model's own. Only tensors on the device of ``keep`` count: megatron-core's ``HybridDeviceOptimizer``
    (``--optimizer-cpu-offload``) already holds its states on the host.
    """
    kept = {t.untyped_storage().data_ptr() for t in keep}
    devices = {t.device for t in keep}
    seen: set[int] = set()
    out: list[torch.Tensor] = []

    def add(t: Optional[torch.Tensor]) -> None:
        if t is None or not torch.is_tensor(t) or t.dim() == 0 or t.numel() == 0:
            return  # 0-dim step counters stay
        if devices and t.device not in devices:
            return  # already elsewhere (a host optimizer's states)
        ptr = t.untyped_storage().data_ptr()
        if ptr in kept or ptr in seen:
            return
        seen.add(ptr)
        out.append(t)

    def visit(opt: Any) -> None:
        for sub in getattr(opt, "chained_optimizers", None) or []:
            visit(sub)
        if getattr(opt, "chained_optimizers", None):
            return
        inner = opt if isinstance(opt, torch.optim.Optimizer) else getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            raise ValueError(f"offload_optimizer ({type(opt).__name__}) is neither a torch optimizer nor a "
                             "megatron-core optimizer wrapping one")
        for state in inner.state.values():
            for v in state.values():
                add(v)
        for group in inner.param_groups:
            for p in group["params"]:
                # An fp32 main parameter, not the model's own. Its gradient is left out: it is a view of DDP's
                # gradient buffer (offload_grads moves those), or it is dropped by the next zero_grad.
                if p.untyped_storage().data_ptr() not in kept:
                    add(p)

    visit(optimizer)
    return out
