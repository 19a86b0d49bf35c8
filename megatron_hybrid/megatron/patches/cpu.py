"""Run megatron-core on CPU with the gloo backend.

Needed by: megatron-core 0.16.x and 0.19.x (checked on 0.16.1; 0.19.2 has the same hard-coded CUDA calls).

megatron-core assumes CUDA in a handful of places that have nothing to do with the maths:

- ``torch.cuda.current_device()`` as a ``device=`` argument (rotary embeddings, layers, DDP buffers, schedules);
- factory calls and ``.cuda()`` / ``.to("cuda")`` with an explicit CUDA device;
- the CUDA RNG tracker (``torch.cuda.get_rng_state`` / ``manual_seed``);
- ``torch.cuda.Event``, ``Stream``, ``current_stream``, ``synchronize`` and ``empty_cache`` in the
  schedules, DDP and the inference engine;
- the same CUDA calls in the backward pass's rerun of a checkpointed forward (activation recompute): torch 2.13
  runs ``torch.autograd.backward`` outside the ``TorchFunctionMode`` below, so the rerun enters it again;
- ``dist_checkpointing``'s writer forks a process per write bucket and spawns a ``multiprocessing.Manager``
  (``dist_checkpointing.py``: the writes run in the rank's process instead);
- CUDA tensor type names in the optimizer (0.16.1 – 0.19.x): ``Float16OptimizerWithFloat16Params``, the
  ``DistributedOptimizer`` and ``clip_grad_by_total_norm_fp32`` tell parameter and gradient dtypes apart by
  ``tensor.type() == 'torch.cuda.BFloat16Tensor'`` (and ``…FloatTensor``, ``…HalfTensor``); a CPU tensor says
  ``'torch.BFloat16Tensor'``, so the optimizer refuses every parameter. Inside the block a CPU tensor's
  ``type()`` reports the CUDA name. (Its multi-tensor fallbacks, ``local_multi_tensor_l2_norm`` and
  ``local_multi_tensor_scale``, are plain torch and only need the device rewrite below.)
- sequence parallelism with the local layer spec (0.16.1 – 0.19.x): without apex (CUDA-only) the local spec's
  norms are ``WrappedTorchNorm``, which asserts ``not config.sequence_parallel``; on a GPU the same spec takes
  apex's ``FusedLayerNorm``, which supports it by marking its parameters ``sequence_parallel`` (so that
  ``finalize_model_grads`` sums their gradients, partial over the sequence shard, over the TP group). Inside the
  block ``WrappedTorchNorm`` does the same: the norm is per token, so only that marking differs.

:func:`cpu_gloo` redirects those, for the duration of a ``with`` block, to the CPU: a
``TorchFunctionMode`` rewrites CUDA devices to ``cpu`` in every torch call, and the ``torch.cuda`` entry points
above are swapped for CPU stand-ins (the RNG tracker forks the CPU generator instead). Everything else runs the
real megatron-core code. It refuses to run when CUDA is available, so it cannot leak into GPU production use.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Any, Iterator

import torch
from packaging.version import Version
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
#: The megatron-core versions whose optimizer compares CUDA type names (checked on 0.16.1 and 0.19.2).
_CUDA_TYPE_NAME_VERSIONS = (Version("0.16.1"), Version("0.20"))
#: The megatron-core versions whose ``WrappedTorchNorm`` refuses sequence parallelism (checked on 0.16.1).
_TORCH_NORM_SP_VERSIONS = (Version("0.16.1"), Version("0.20"))
_state = threading.local()


def cpu_gloo_active() -> bool:
    """Whether a :func:`cpu_gloo` block is active in this thread."""
    return getattr(_state, "depth", 0) > 0


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA ordinal in torch's factory functions.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU in every torch function and tensor method; with
    ``cuda_type_names``, a CPU tensor's ``type()`` (no arguments) is its CUDA type name."""

    def __init__(self, *, cuda_type_names: bool) -> None:
        super().__init__()
        self._cuda_type_names = cuda_type_names

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
        name = getattr(func, "__name__", "")
        if name == "type" and self._cuda_type_names and len(args) == 1 and not kwargs \
                and args[0].device.type == "cpu":  # Tensor.type(): 'torch.BFloat16Tensor' → 'torch.cuda.…'
            return "torch.cuda." + func(*args).removeprefix("torch.")
        if name == "cuda":  # Tensor.cuda(...)
            return args[0]
        if name == "to" and args:
            rest = list(args[1:])
            if rest and _is_cuda(rest[0]):
                rest[0] = _CPU
            args = (args[0], *rest)
        if name in ("pin_memory",):
            return args[0]
        if name == "is_pinned":
            return False
        return func(*args, **kwargs)


class _Event:
    """CPU stand-in for ``torch.cuda.Event``: records wall time so elapsed_time still means something."""

    def __init__(self, enable_timing: bool = False, **_: Any) -> None:
        self._t = None

    def record(self, stream: Any = None) -> None:
        import time

        self._t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_Event") -> float:
        return (end._t - self._t) * 1e3


class _Stream:
    """CPU stand-in for ``torch.cuda.Stream``: everything is synchronous on CPU."""

    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        return event or _Event()

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> "_Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


_STREAM = _Stream()


def _cuda_stand_ins() -> dict[str, Any]:
    return {
        "current_device": lambda: _CPU,
        "device_count": lambda: 1,
        "set_device": lambda *a, **k: None,
        "synchronize": lambda *a, **k: None,
        "empty_cache": lambda: None,
        "Event": _Event,
        "Stream": _Stream,
        "current_stream": lambda *a, **k: _STREAM,
        "default_stream": lambda *a, **k: _STREAM,
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "set_stream": lambda *a, **k: None,
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        "set_rng_state": lambda s, *a, **k: torch.set_rng_state(s),
        # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly.
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "manual_seed_all": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "memory_allocated": lambda *a, **k: 0,
        "max_memory_allocated": lambda *a, **k: 0,
        "memory_reserved": lambda *a, **k: 0,
        "reset_peak_memory_stats": lambda *a, **k: None,
    }


def _megatron_stand_ins() -> list[tuple[Any, str, Any]]:
    """Attributes of megatron-core modules that bound CUDA helpers at import time."""
    from megatron.core.tensor_parallel import random as mrandom

    from .dist_checkpointing import in_process_writes

    out = [
        (mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
        (mrandom, "_set_cuda_rng_state", lambda s, *a, **k: torch.set_rng_state(s)),
        (mrandom.CheckpointFunction, "backward", staticmethod(_recompute_inside(mrandom.CheckpointFunction.backward))),
    ]
    return out + in_process_writes()


def _recompute_inside(backward):
    """megatron-core's activation recompute (``CheckpointFunction.backward``: ``--recompute-granularity``) inside
    the device rewrite. torch 2.13 hands ``torch.autograd.backward`` to the ``TorchFunctionMode``, which runs it
    with the mode popped, so the rerun of a checkpointed forward in the backward pass would meet megatron-core's
    CUDA factory calls (the local attention's causal mask, ``device="cuda"``) outside the rewrite."""
    def recompute(ctx, *grads):
        with _CudaToCpu(cuda_type_names=_optimizer_compares_cuda_type_names()):
            return backward(ctx, *grads)
    return recompute


def _sequence_parallel_torch_norm() -> tuple[Any, str, Any]:
    """``WrappedTorchNorm.__new__`` that accepts ``sequence_parallel`` as apex's ``FusedLayerNorm`` does."""
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__dict__["__new__"]  # a staticmethod: restored as it was
    build = original.__func__

    def new(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return build(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = build(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True  # megatron-core's convention (apex and TE norms set it too)
        return norm

    return WrappedTorchNorm, "__new__", staticmethod(new)


def _mcore_in(versions: tuple[Version, Version]) -> bool:
    from megatron.core import __version__

    low, high = versions
    return low <= Version(__version__) < high


def _optimizer_compares_cuda_type_names() -> bool:
    return _mcore_in(_CUDA_TYPE_NAME_VERSIONS)


@contextlib.contextmanager
def cpu_gloo() -> Iterator[None]:
    """Redirect megatron-core's hard-coded CUDA calls to the CPU inside the block.

    Use around model construction, forward/backward, the pipeline schedules, DDP, the optimizer and the inference
    engine when running on CPU with gloo. Raises ``RuntimeError`` when CUDA is available: on a GPU, run the real thing.
    """
    if torch.cuda.is_available():
        raise RuntimeError("cpu_gloo() is for CPU-only runs; CUDA is available here, so use it instead")
    depth = getattr(_state, "depth", 0)
    if depth:
        _state.depth = depth + 1
        try:
            yield
        finally:
            _state.depth -= 1
        return
    saved: list[tuple[Any, str, Any]] = []
    try:
        for name, fn in _cuda_stand_ins().items():
            saved.append((torch.cuda, name, getattr(torch.cuda, name)))
            setattr(torch.cuda, name, fn)
        for owner, name, fn in _megatron_stand_ins():
            # getattr_static: a staticmethod of a class is restored as the staticmethod, not its function.
            saved.append((owner, name, inspect.getattr_static(owner, name)))
            setattr(owner, name, fn)
        if _mcore_in(_TORCH_NORM_SP_VERSIONS):
            owner, name, fn = _sequence_parallel_torch_norm()
            saved.append((owner, name, owner.__dict__[name]))
            setattr(owner, name, fn)
        _state.depth = 1
        with _CudaToCpu(cuda_type_names=_optimizer_compares_cuda_type_names()):
            yield
    finally:
        _state.depth = 0
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)
