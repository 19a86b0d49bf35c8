"""Benchmark the switch to rollout: the HybridEngine against megatron-core's swap_model_weights, a whole-model
gather and the all-gather bound, measured on every rank of one torchrun job.

Methods (same model, same layout, same job):

- ``ours-aliased``, ``ours-canonical``: ``HybridEngine(weight_mode=...).switch_to_rollout()`` (map the peers'
  slots and the canonical ranges, one in-place collective per bucket/region, refill the canonical tensors by one
  fused scatter per dtype; the rollout model is bound once, at construction), with ``set_profiling(False)``. On an
  exchange layout (``engine.layout.exchange``: a pair outside the micro-DP gather contract, e.g. p_g > p or TP and
  PP moving in opposite directions; ``EXCHANGE_PAIRS_8``) the switch packs what the rank sends and runs one
  ``all_to_all_single`` per dtype over the world into receive buffers mapped for the rollout.
  Per switch, the engine's own phase timings (``communication_report()["phases"]``: map, collectives,
  canonical, offload, sync) are kept; the rows hold their medians (``phases_median_s``). On a GPU without
  profiling the phases before ``sync`` are host (launch) times: the device is synchronised once, in ``sync``.
- ``swap``: ``megatron.core.resharding.swap_model_weights(train, rollout, "gloo"|"nccl")`` into a second rollout
  model built with its own process groups (the engine's ``pg_collection``). Its plan is built on the warm-up.
- ``naive-gather``: every rank all-gathers the whole model over the world, one all-gather per parameter, each rank
  contributing 1/world of it (DeepSpeed-Chat's ZeRO-3 hybrid engine): (tpd-1)/(tpd)·M bytes per rank.
- ``bound``: one ``all_gather_into_tensor`` of exactly the bytes ``ours`` receives (the most any rank receives),
  in the model's dtype, over our micro-DP groups, into a resident preallocated buffer: the floor of a switch.
  An exchange layout has no micro-DP groups (they are singletons, ``d_g`` means nothing: the rows say
  ``exchange: true`` and ``d_g: null``): there ``bound`` is one ``all_to_all_single`` per dtype over the engine's
  world group with exactly ours' splits (the plan's, rank by rank), from a resident send buffer into a resident
  receive buffer; none where nothing moves (p_g > p at t = t_g).
- ``bound-fresh``: the same all-gather (all-to-all) into an output the call allocates (``torch.empty``), as a plain
  all-gather does: the floor of a switch that, like ours, must obtain memory that was not resident before it (on
  CPU, large allocations are fresh pages that fault in during the gather; on a GPU the caching allocator reuses a
  block).
- ``base-aliased``, ``base-canonical`` (with ``--baseline-commit REV``): ours' methods run by the engine of commit
  REV, whose ``megatron_hybrid/`` is extracted and imported as ``megatron_hybrid_base`` (see :func:`load_baseline`).
  Two engines cannot serve one model (each moves the parameters into its own buffers), so the base engine serves a
  second copy of the training model, built and filled alike; both engines live side by side and their runs
  alternate run by run (base-aliased with ours-aliased in phase 1, base-canonical with ours-canonical in phase 2):
  the same layout, shape, groups' sizes, machine load and allocator state within each pair of runs, which closing
  one engine to build the other between blocks of runs would not give. Their rows hold, for ours, whether every
  rank received the same bytes in the same number of collectives as under the base engine, ``over_base`` (ratio of
  the medians) and ``over_base_paired_median`` (median over runs i of ours_i / base_i); canonical also checks that
  both rollout models hold the same bytes (``matches_base``).

Timing: before every run, garbage collection, ``malloc_trim(0)`` (CUDA: ``torch.cuda.empty_cache()``) and a
barrier; a run's time is the largest per-rank time of the call (CUDA: up to a ``torch.cuda.synchronize()``);
reported: the median over ``--runs`` runs after ``--warmup`` warm-up runs. The runs of ours-aliased, bound, swap
and naive-gather are interleaved (run i of each method, then run i + 1; in the listed order on even i, in reverse
on odd i, so that no method always runs right after the same other one), so that a change of machine load hits
all of them alike; ours-canonical needs its own engine and runs right after, interleaved with swap again
(``swap-beside-canonical``, the times canonical's `swap / this` compares against). On CPU the timed calls run with
cpu_gloo()'s TorchFunctionMode suspended (a per-torch-call test shim absent on a GPU; ``--keep-cpu-shim`` keeps
it).

Memory, CPU: resident-set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) during the call
minus the resident set just before it, plus what the method's setup kept that only the rollout needs (swap's
second model copy, bound's buffer); the largest over runs and ranks.
Memory, CUDA: device memory in use (``total - free`` of ``torch.cuda.mem_get_info()``; the engine's buffers are
CUDA virtual memory, cuMemCreate/cuMemMap, invisible to ``torch.cuda.memory_allocated``), sampled just before the
call and right after it (after ``torch.cuda.synchronize()``), with the caching allocator emptied before each run
(so what torch allocates inside the call, even if freed there, is still reserved, hence counted, when sampled).
``mem_get_info`` is device-wide: every sample is taken by all ranks between two barriers, so that no rank runs
anything then, and the growth of a device is divided by the number of ranks sharing it (``ranks_per_device``;
exact with one rank per GPU, an average over the device's ranks with ``--backend gloo`` and several ranks per GPU).
Both: ``extra_mem_after_bytes`` is the same growth measured after switching back (after ``after()``, a trim and
on CUDA ``empty_cache()``): what a method keeps once training resumes (≈ 0 for ours; swap's second copy is
setup, not counted there).
Beside it the bytes accounted by construction: ours = peers' slots + the canonical ranges (``engine.placement.rollout_only``,
mapped only while rolling out) + gloo's flat staging of the largest collective (CPU tensors only: gloo's staging
of CUDA tensors is not accounted); swap = second model copy + its receive staging (a buffer per receive plus
gloo's CPU copy of it) + contiguous copies of strided send slices; naive = the gathered model; bound = its buffer
+ gloo's staging (CPU).

Outputs in ``--output-dir``: ``NAME.json`` (one row per method, layout and shape), ``NAME.md`` (tables),
``NAME.png`` (plot; needs matplotlib) and, in ``--report-dir``, one communication report (JSONL trace + HTML) per
layout and shape of a profiled ours-aliased switch, with a training forward+backward as the step time.

Shapes: ``many-small`` and ``few-large`` (fp32, CPU-sized), ``gpu-1b`` (0.89 B parameters, bf16: one GPU, 2 or
4 ranks) and ``llama-7b`` (Llama-2-7B-like, bf16: an 8-GPU node). ``--params-dtype`` overrides any shape's dtype.

Examples:
    # CPU, gloo, 8 ranks, the default layouts of both CPU shapes (bench/results/reshard_cpu.*):
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 8 bench/reshard.py --output-dir bench/results
    # the exchange pairs against swap_model_weights, both modes (bench/results/reshard_pairs_cpu.*):
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 8 bench/reshard.py --shapes many-small \
        --layouts 1,2,4,2,1 2,1,4,1,2 4,2,1,2,4 8,1,1,2,2 1,1,8,1,2 1,2,4,2,4 \
        --methods ours-aliased ours-canonical swap bound --no-report --output-dir bench/results --name reshard_pairs_cpu
    # the default in-place layouts against the engine of commit 5dd0705, interleaved (bench/results/reshard_base_cpu.*):
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 8 bench/reshard.py --shapes many-small \
        --baseline-commit 5dd0705 --methods ours-aliased ours-canonical base-aliased base-canonical --runs 10 \
        --no-report --output-dir bench/results --name reshard_base_cpu
    # one shape, two layouts (t,p,d,t_g,p_g), more runs, smaller buckets:
    torchrun --standalone --nproc_per_node 8 bench/reshard.py --shapes many-small \\
        --layouts 4,1,2,2,1 2,2,2,1,1 --runs 9 --reshard-bucket-size-mb 64 --output-dir /tmp/reshard
    # 4 ranks, only ours and the bound, bf16, no plot:
    torchrun --standalone --nproc_per_node 4 bench/reshard.py --methods ours-aliased bound --no-plot \\
        --params-dtype bfloat16 --output-dir /tmp/reshard4
    # one GPU, 4 gloo ranks sharing it (NCCL refuses two ranks per GPU), the 0.89 B bf16 shape:
    torchrun --standalone --nproc_per_node 4 bench/reshard.py --backend gloo --shapes gpu-1b \\
        --output-dir bench/results --name reshard_gpu1_gloo
    # an 8-GPU node, NCCL, Llama-2-7B-like shape (bench/results/reshard_gpu.*):
    torchrun --standalone --nproc_per_node 8 bench/reshard.py --shapes llama-7b --output-dir bench/results
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import copy
import ctypes
import dataclasses
import gc
import importlib
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
import zlib
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_hybrid.megatron.models import GPTArchitecture  # noqa: E402
from megatron_hybrid.megatron.sharding import TPSpec, global_name, layer_offset  # noqa: E402
from megatron_hybrid.report import missing_bytes as expected_missing_bytes  # noqa: E402
from megatron_hybrid.modes import WeightMode  # noqa: E402
from megatron_hybrid.reshard.placement import DTYPES  # noqa: E402

METHODS = ("ours-aliased", "ours-canonical", "swap", "naive-gather", "bound", "bound-fresh")
# The engine of another commit (--baseline-commit), interleaved with ours on the same layout and model shape.
BASE_METHODS = ("base-aliased", "base-canonical")
BASE_PACKAGE = "megatron_hybrid_base"
# swap_model_weights timed again in phase 2, interleaved with ours-canonical (which needs an engine of its own):
# its times are what canonical's `swap / this` compares against, so that both see the same machine load.
SWAP_BESIDE_CANONICAL = "swap-beside-canonical"
ROW_METHODS = METHODS + (SWAP_BESIDE_CANONICAL,) + BASE_METHODS
Layout = tuple[int, int, int, int, int]  # (t, p, d, t_g, p_g)

from shapes import SHAPES  # noqa: E402  (one definition for every benchmark)
# Vocabulary sizes are multiples of make_vocab_size_divisible_by × 8, so every TP size up to 8 pads them alike
# (32000 = 125 × 32 × 8: no padding, as Llama-2's checkpoint); swap's second rollout model is built for t_g and
# must pad like the training model.

# Per shape: layouts for 8 ranks. few-large keeps d_g = 2 with t·p = 4 (113 MB per rank): swap_model_weights
# stages every receive twice next to its second model copy (≈ 3 rollout shards per rank), which at d_g = 4 would
# need ≈ 12 GB across 8 ranks on top of the processes themselves.
DEFAULT_LAYOUTS_8: dict[str, list[Layout]] = {
    "many-small": [(2, 1, 4, 1, 1), (4, 1, 2, 2, 1), (4, 1, 2, 1, 1), (2, 2, 2, 1, 1), (8, 1, 1, 2, 1)],
    "few-large": [(4, 1, 2, 2, 1), (2, 2, 2, 1, 2), (2, 2, 2, 2, 1)],
    "llama-7b": [(8, 1, 1, 4, 1), (8, 1, 1, 2, 1), (8, 1, 1, 1, 1), (4, 2, 1, 2, 1), (4, 2, 1, 2, 2)],
}
# Exchange layouts (pairs outside the micro-DP gather contract, issue 25) for 8 ranks, both CPU shapes allow them
# but (8,1,1,2,2) on few-large (4 query groups, t = 8): TP up with PP down, TP down with PP up, PP up at either TP,
# p_g > p with t = t_g = 1 (nothing moves) and TP and PP both up.
EXCHANGE_PAIRS_8: list[Layout] = [(1, 2, 4, 2, 1), (2, 1, 4, 1, 2), (4, 2, 1, 2, 4), (8, 1, 1, 2, 2), (1, 1, 8, 1, 2),
                                  (1, 2, 4, 2, 4)]
# Per shape and world size other than 8: layouts of the shapes meant for one GPU shared by a few ranks.
DEFAULT_LAYOUTS: dict[str, dict[int, list[Layout]]] = {
    "gpu-1b": {2: [(2, 1, 1, 1, 1)], 4: [(2, 1, 2, 1, 1), (4, 1, 1, 2, 1), (2, 2, 1, 1, 1)]},
}


def default_layouts(shape: str, world: int) -> list[Layout]:
    """The layouts benchmarked for ``shape`` on ``world`` ranks when ``--layouts`` is not given."""
    if world in DEFAULT_LAYOUTS.get(shape, {}):
        return list(DEFAULT_LAYOUTS[shape][world])
    if world == 8 and shape in DEFAULT_LAYOUTS_8:
        return list(DEFAULT_LAYOUTS_8[shape])
    out: list[Layout] = []
    for t, p, t_g, p_g in ((2, 1, 1, 1), (4, 1, 2, 1), (2, 2, 1, 1), (2, 2, 2, 1)):
        if world % (t * p) == 0:
            out.append((t, p, world // (t * p), t_g, p_g))
    return out or [(world, 1, 1, 1, 1)]


def shape_arch(shape: str, params_dtype: Optional[str] = None) -> GPTArchitecture:
    """The architecture of ``shape``, with its parameter dtype replaced by ``params_dtype`` if given."""
    arch = SHAPES[shape]
    return arch if params_dtype is None else dataclasses.replace(arch, params_dtype=params_dtype)


def parse_layout(text: str) -> Layout:
    parts = text.replace("(", "").replace(")", "").split(",")
    if len(parts) != 5 or not all(s.strip().isdigit() for s in parts):
        raise argparse.ArgumentTypeError(f"layout {text!r} must be five integers t,p,d,t_g,p_g")
    return tuple(int(s) for s in parts)  # type: ignore[return-value]


# -------------------------------------------------------------------------------------------------------------
# The engine of another commit


def load_baseline(commit: str, repo: Path) -> tuple[ModuleType, str]:
    """``megatron_hybrid/`` of ``commit`` imported as the package ``megatron_hybrid_base``; returns it and the full
    commit id.

    The package is extracted (``git archive``) into a temporary folder of this process. Its modules import each other
    relatively, so they run as that commit's code, beside the current package. One module is shared with the
    current package instead, ``kernels.ops``: the native extension registers its operators and their fake kernels
    once per process (``megatron_hybrid::*``; a second registration fails), and the commit's ``kernels/ops.py``
    imports ``megatron_hybrid.kernels._C`` by its absolute name anyway. The built extension is therefore not copied.
    A commit whose ``kernels/ops.py`` differs from the current one is refused (so is one from before issue 49, whose
    ``ops.py`` was at the package root). A commit whose ``patches/`` was still a top-level folder (installed as
    ``megatron_hybrid.patches``, so not in its ``megatron_hybrid/``) gets this tree's ``megatron.patches`` as its
    ``patches``.
    """
    def git(*argv: str) -> bytes:
        return subprocess.run(["git", "-C", str(repo), *argv], check=True, capture_output=True).stdout

    sha = git("rev-parse", "--verify", f"{commit}^{{commit}}").decode().strip()
    import megatron_hybrid
    from megatron_hybrid.kernels import ops
    from megatron_hybrid.megatron import patches

    try:
        base_ops = git("show", f"{sha}:megatron_hybrid/kernels/ops.py").decode()
    except subprocess.CalledProcessError:
        base_ops = None
    if base_ops != Path(ops.__file__).read_text():
        raise ValueError(f"--baseline-commit {commit}: its megatron_hybrid/kernels/ops.py differs from this tree's "
                         "(or it has none), and the native operators can be registered only once per process")
    folder = Path(tempfile.mkdtemp(prefix="reshard_base_"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(git("archive", "--format=tar", sha, "megatron_hybrid"))) as tar:
        tar.extractall(folder, filter="data")
    (folder / "megatron_hybrid").rename(folder / BASE_PACKAGE)
    assert BASE_PACKAGE not in sys.modules and megatron_hybrid.__name__ == "megatron_hybrid"
    if not (folder / BASE_PACKAGE / "megatron" / "patches").is_dir():
        sys.modules[f"{BASE_PACKAGE}.patches"] = patches
    sys.modules[f"{BASE_PACKAGE}.kernels.ops"] = ops
    sys.path.insert(0, str(folder))
    try:
        base = importlib.import_module(BASE_PACKAGE)
        for name in ("engine", "layout", "report"):
            importlib.import_module(f"{BASE_PACKAGE}.{name}")
    finally:
        sys.path.remove(str(folder))
    return base, sha


# -------------------------------------------------------------------------------------------------------------
# Measurement helpers


class Memory:
    """Resident memory of this process: current, and the high-water mark since the last :meth:`reset_peak`."""

    kind = "cpu-VmHWM"
    ranks_per_device = 1

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        try:
            self._libc = ctypes.CDLL("libc.so.6")
        except OSError:
            self._libc = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.has_peak = True
        except OSError:
            self.has_peak = False
            warnings.warn("cannot reset the resident high-water mark (/proc/self/clear_refs): the memory columns "
                          "show the resident set after the call instead of the peak during it")

    def trim(self) -> None:
        # Temporaries freed by torch/gloo stay cached in glibc's heap: hand them back, so that what is measured
        # is what is held (as tests/engine_cases.py memory_case does).
        gc.collect()
        if self._libc is not None:
            self._libc.malloc_trim(0)

    def current(self) -> int:
        return self._proc.memory_info().rss

    def reset_peak(self) -> None:
        if self.has_peak:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def peak(self) -> int:
        if not self.has_peak:
            return self.current()
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return self.current()


class CudaMemory(Memory):
    """Device memory in use on this rank's GPU (``total - free`` of ``torch.cuda.mem_get_info()``), per rank.

    The engine's buffers are CUDA virtual memory (cuMemCreate/cuMemMap), which torch's allocator statistics do
    not see; ``mem_get_info`` does, but device-wide. Every sample is therefore a collective: all ranks synchronise
    their device, meet at a barrier, sample, and meet again, so that no rank allocates or frees while another one
    samples; the value is the device's usage divided by the number of ranks sharing the device (one with NCCL).
    There is no high-water mark: :meth:`peak` samples right after the call; the caching allocator is emptied by
    :meth:`trim` before each run, so what torch allocated inside the call (even if freed) is still reserved then.
    """

    kind = "cuda-mem_get_info"

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        where = (platform.node(), str(getattr(torch.cuda.get_device_properties(device), "uuid", device.index)))
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, where)
        self.ranks_per_device = everyone.count(where)
        if len(set(everyone.count(w) for w in everyone)) > 1:
            warnings.warn(f"devices are shared by different numbers of ranks ({sorted(set(everyone))}): the "
                          "per-rank device memory is each device's usage divided by its own number of ranks")

    def trim(self) -> None:
        super().trim()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def current(self) -> int:
        torch.cuda.synchronize(self.device)
        dist.barrier()
        free, total = torch.cuda.mem_get_info(self.device)
        dist.barrier()
        return (total - free) // self.ranks_per_device

    def reset_peak(self) -> None:
        pass

    def peak(self) -> int:
        return self.current()


@dataclasses.dataclass
class Method:
    """One way of switching: ``op`` is timed, ``after`` undoes it (untimed)."""

    name: str
    op: Callable[[], Any]
    after: Callable[[], Any] = lambda: None
    setup_extra: int = 0  # resident bytes its setup kept that only the rollout needs
    times: list = dataclasses.field(default_factory=list)
    extras: list = dataclasses.field(default_factory=list)
    extras_after: list = dataclasses.field(default_factory=list)  # growth still held after switching back
    info: dict = dataclasses.field(default_factory=dict)  # bytes, collectives, accounted memory, ...
    phases: list = dataclasses.field(default_factory=list)  # ours: communication_report()["phases"] per switch
    state: dict = dataclasses.field(default_factory=dict)  # what the method holds (engine, buffers, models)

    def release(self) -> None:
        """Drop everything the method holds; the measurements stay."""
        self.op = self.after = lambda: None
        self.state.clear()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def _without_cpu_function_mode(enabled: bool):
    """Suspend cpu_gloo()'s TorchFunctionMode (it rewrites CUDA devices in every torch call: ~5-10 µs each on this
    machine, a CPU test shim that does not exist on a GPU); its torch.cuda stand-ins stay, swap needs them."""
    from torch.overrides import _get_current_function_mode_stack, _pop_mode_temporarily

    if not enabled or not _get_current_function_mode_stack():
        yield
        return
    with _pop_mode_temporarily():
        yield


def run_once(m: Method, mem: Memory, device: torch.device, *, record: bool, keep_shim: bool = False) -> None:
    # On CUDA, mem.current()/peak() are collectives (a barrier either side of the device-wide sample).
    mem.trim()
    mem.reset_peak()
    base = mem.current()
    dist.barrier()
    with _without_cpu_function_mode(not keep_shim):
        t0 = time.perf_counter()
        m.op()
        _sync(device)
    dt = time.perf_counter() - t0
    peak = mem.peak()
    m.after()
    mem.trim()
    back = mem.current()
    if record:
        m.times.append(dt)
        m.extras.append(max(peak - base, 0))
        m.extras_after.append(back - base)


def run_interleaved(methods: list[Method], mem: Memory, device: torch.device, *, warmup: int, runs: int,
                    keep_shim: bool = False) -> None:
    # A full gc.collect() over megatron's object graph costs ~100 ms of CPU per rank here and slows the next
    # collective down (a 3.8 MB pair all-gather: 20 ms -> 180 ms median): freeze what exists, so that the
    # collection before each run only looks at what the runs create.
    gc.collect()
    gc.freeze()
    try:
        for i in range(warmup + runs):
            # Forward on even runs, backward on odd ones: no method always runs right after the same other one.
            for m in methods if i % 2 == 0 else methods[::-1]:
                run_once(m, mem, device, record=i >= warmup, keep_shim=keep_shim)
    finally:
        gc.unfreeze()


# -------------------------------------------------------------------------------------------------------------
# Model


def _no_init(weight: torch.Tensor) -> None:
    """An init_method that leaves the weight as allocated (fill_weights sets it)."""


def fill_weights(model: torch.nn.Module, tp_rank: int) -> None:
    """Deterministic weights: the same tensor on every holder of the same shard, a different one per shard."""
    offset = layer_offset(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            seed = zlib.crc32(global_name(name, offset).encode())
            if TPSpec.of(p).sharded:
                seed = seed * 31 + tp_rank + 1
            g = torch.Generator().manual_seed(seed)
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02).to(p.dtype))


def full_sizes(model: torch.nn.Module, t: int) -> dict[str, tuple[int, torch.dtype]]:
    """{global name: (full numel, dtype)} of the whole model, from every rank's stage (a world collective)."""
    offset = layer_offset(model)
    mine = {global_name(n, offset): (p.numel() * (t if TPSpec.of(p).sharded else 1), str(p.dtype))
            for n, p in model.named_parameters()}
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out: dict[str, tuple[int, torch.dtype]] = {}
    for part in parts:
        for name, (numel, dtype) in part.items():
            out[name] = (numel, getattr(torch, dtype.split(".")[-1]))
    return dict(sorted(out.items()))


def step_seconds(model: torch.nn.Module, arch: GPTArchitecture, *, seq: int, runs: int, device) -> float:
    """Median time of one training forward+backward (one micro-batch of ``seq`` tokens) through the pipeline."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (1, seq), generator=g).to(device)
    positions = torch.arange(seq, device=device).unsqueeze(0)

    def forward_step(data_iterator, model):
        tok = next(data_iterator)
        out = model(tok, positions, None, labels=torch.roll(tok, -1, dims=1))
        return out, lambda per_token: (per_token.float().mean(), {})

    times = []
    for i in range(runs + 1):
        dist.barrier()
        t0 = time.perf_counter()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]), model=[model],
                                    num_microbatches=1, seq_length=seq, micro_batch_size=1, forward_only=False)
        _sync(device)
        dt = _max_over_ranks([time.perf_counter() - t0])[0]
        if i:
            times.append(dt)
        for p in model.parameters():
            p.grad = None
    return statistics.median(times)


def build_rollout_model(arch: GPTArchitecture, engine, config) -> torch.nn.Module:
    """A second rollout model with its own memory, on the engine's rollout process groups (swap's target)."""
    lay = engine.layout
    rcfg = copy.copy(config)
    rcfg.tensor_model_parallel_size, rcfg.pipeline_model_parallel_size = lay.t_g, lay.p_g
    return arch.build(rcfg, pre_process=engine.rollout_pp_rank == 0, post_process=engine.rollout_pp_rank == lay.p_g - 1,
                      pg_collection=engine.pg_collection)


def tensor_crcs(module: torch.nn.Module) -> dict[str, int]:
    with torch.no_grad():
        return {n: zlib.crc32(p.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy())
                for n, p in module.named_parameters()}


# -------------------------------------------------------------------------------------------------------------
# Methods


def ours(engine, name: str, backend: str, *, expected: Callable[[Any], int] = expected_missing_bytes) -> Method:
    """HybridEngine.switch_to_rollout(); ``after`` keeps the engine's phase timings, checks the bytes and switches
    back. ``expected``: the engine's package's ``report.missing_bytes`` (the base commit's for its engine)."""
    engine.set_profiling(False)
    m = Method(name, lambda: m.state["engine"].switch_to_rollout(), state={"engine": engine})

    def after():
        eng = m.state["engine"]
        rep = eng.communication_report()
        if not m.info:
            m.info.update(_ours_accounting(eng, backend), bytes=rep["total_bytes"],
                          collectives=rep["num_collectives"], expected_bytes=expected(eng),
                          canonical_bytes_mapped=rep["canonical_bytes_mapped"])
        elif rep["total_bytes"] != m.info["bytes"]:
            raise AssertionError(f"{name}: received {rep['total_bytes']} bytes, before {m.info['bytes']}")
        # Inside collectives_seconds, the time in the collective calls themselves (the rest: packing, slicing).
        m.phases.append(dict(rep["phases"], calls_seconds=sum(c["seconds"] for c in rep["collectives"])))
        eng.switch_to_training()

    m.after = after
    return m


def _ours_accounting(engine, backend: str) -> dict[str, int]:
    """While rolling out: the peers' slots (an exchange layout: the receive buffers), the canonical ranges, gloo's
    staging (an exchange layout: the packed send buffer of the all-to-all)."""
    peers = sum(b.peer_bytes for b in engine.placement.buffers.values())
    # Canonical tensors (canonical mode; 1-D sharded tensors such as biases in either mode) live in one reserved
    # range per dtype, mapped only while rolling out.
    canonical = sum(buf.peer_bytes for buf in engine.placement.rollout_only)
    # gloo's all_gather_into_tensor gathers CPU tensors into a flat temporary of the whole region, then copies it
    # out. With CUDA tensors gloo copies through host memory and its device-side staging is not accounted here
    # (on an H200, gpu-1b at (2,1,2)->(1,1), 2 ranks per GPU: ≈ 0.5 GB per rank measured above the accounted).
    largest = 0
    device = engine.device
    if engine.plan is not None and backend == "gloo" and device.type == "cpu":
        largest = max((r.numel * engine.placement.buffers[dt].tensor.element_size()
                       for dt, regs in engine.plan.regions.items() for r in regs), default=0)
    if _is_exchange(engine):
        # ExchangeExecutor packs what this rank sends into one transient buffer per dtype (gloo's all-to-all of CPU
        # tensors then works on the given tensors); the dtypes run one after the other.
        plan = engine.exchange_plan
        largest = max((n * torch.empty((), dtype=DTYPES[dt]).element_size()
                       for dt, n in plan.sent_numel(dist.get_rank()).items()), default=0)
    return {"peer_bytes": peers, "canonical_bytes": canonical, "staging_bytes": largest,
            "accounted": peers + canonical + largest}


def _is_exchange(engine) -> bool:
    """Whether the engine serves an exchange layout (an engine of a commit before the exchange never does)."""
    return bool(getattr(engine.layout, "exchange", False))


def bound_exchange(engine, mem: Memory, *, fresh: bool) -> Method:
    """Exchange layouts (no micro-DP gather to bound): one ``all_to_all_single`` per dtype over the engine's world
    group with exactly ours' splits (the plan's), from a resident send buffer into a resident receive buffer
    (``bound``) or into one the call allocates (``bound-fresh``): ours' exchange without packing the send buffer,
    mapping the receive buffer or binding."""
    plan, rank, device = engine.exchange_plan, dist.get_rank(), engine.device
    group = engine.rollout_groups.world
    mem.trim()
    before = mem.current()
    legs = []
    for dtype in plan.dtypes():
        recv_splits = plan.splits(rank, dtype, sending=False)
        send_splits = plan.splits(rank, dtype, sending=True)
        send = torch.zeros(sum(send_splits), dtype=DTYPES[dtype], device=device)
        recv = None if fresh else torch.zeros(sum(recv_splits), dtype=DTYPES[dtype], device=device)
        legs.append((send, recv, recv_splits, send_splits))
    mem.trim()

    def op():
        for send, recv, recv_splits, send_splits in m.state["legs"]:
            if recv is None:
                recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=device)
                m.state["held"].append(recv)
            dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)

    m = Method("bound-fresh" if fresh else "bound", op, state={"legs": legs, "held": []},
               setup_extra=0 if fresh else mem.current() - before)
    m.after = lambda: m.state["held"].clear()
    received = sum(sum(r) * s.element_size() for s, _, r, _ in legs)
    sent = sum(sum(x) * s.element_size() for s, _, _, x in legs)
    m.info.update(bytes=received, collectives=len(legs), accounted=received + sent)
    return m


def bound(engine, missing_max: int, mem: Memory, dtype: torch.dtype) -> Method:
    """One all-gather of ``missing_max`` bytes (in ``dtype``, the model's) over the micro-DP group, into a
    resident buffer."""
    d_g = engine.layout.d_g
    group = engine.groups["micro_dp"]
    elem = torch.empty((), dtype=dtype).element_size()
    slot = -(-missing_max // (elem * (d_g - 1)))  # elements per member
    mem.trim()
    before = mem.current()
    device = engine.device
    out = torch.zeros(slot * d_g, dtype=dtype, device=device)
    me = group.rank()
    mem.trim()
    from megatron_hybrid.megatron import compat

    m = Method("bound", lambda: compat.all_gather_into_tensor(m.state["out"], m.state["in"], group=m.state["group"]),
               setup_extra=mem.current() - before,
               state={"out": out, "in": out[me * slot: (me + 1) * slot], "group": group})
    staged = dist.get_backend(group) == "gloo" and device.type == "cpu"
    m.info.update(bytes=slot * elem * (d_g - 1), collectives=1, accounted=slot * elem * d_g * (2 if staged else 1))
    return m


def bound_fresh(engine, missing_max: int, dtype: torch.dtype) -> Method:
    """The same all-gather into an output allocated by the call (as a plain ``torch.empty`` + all-gather would):
    the floor of a switch that, like ours, has to obtain memory that was not resident before it. On CPU the
    allocator hands out fresh pages for large outputs (glibc mmaps them), which then fault in during the gather.
    """
    from megatron_hybrid.megatron import compat

    d_g = engine.layout.d_g
    group = engine.groups["micro_dp"]
    elem = torch.empty((), dtype=dtype).element_size()
    slot = -(-missing_max // (elem * (d_g - 1)))
    device = engine.device

    def op():
        out = torch.empty(slot * d_g, dtype=dtype, device=device)
        compat.all_gather_into_tensor(out, m.state["in"], group=group)
        m.state["held"].append(out)

    m = Method("bound-fresh", op, state={"in": torch.zeros(slot, dtype=dtype, device=device), "held": []})
    m.after = lambda: m.state["held"].clear()
    staged = dist.get_backend(group) == "gloo" and device.type == "cpu"
    m.info.update(bytes=slot * elem * (d_g - 1), collectives=1, accounted=slot * elem * d_g * (2 if staged else 1))
    return m


def naive_gather(sizes: dict[str, tuple[int, torch.dtype]], device) -> Method:
    """One all-gather over the world per parameter of the whole model; the gathered model is kept until after."""
    from megatron_hybrid.megatron import compat

    world = dist.get_world_size()
    parts = [torch.zeros(-(-numel // world), dtype=dtype, device=device) for numel, dtype in sizes.values()]

    def op():
        for part in m.state["parts"]:
            out = torch.empty(part.numel() * world, dtype=part.dtype, device=device)
            compat.all_gather_into_tensor(out, part, group=None)
            m.state["held"].append(out)

    m = Method("naive-gather", op, state={"parts": parts, "held": []})
    m.after = lambda: m.state["held"].clear()
    part_bytes = sum(p.numel() * p.element_size() for p in parts)
    m.info.update(bytes=part_bytes * (world - 1), collectives=len(parts), accounted=part_bytes * world)
    return m


def swap_method(train_model, dst_model, backend: str) -> Method:
    from megatron.core.resharding import swap_model_weights

    m = Method("swap", lambda: None, state={"src": train_model, "dst": dst_model})
    m.op = lambda: swap_model_weights(m.state["src"], m.state["dst"], backend)
    return m


def _swap_plan(dst_model):
    """swap_model_weights' cached plan: on the target model up to megatron-core 0.18, in a module-level cache keyed
    by the parallel sizes from 0.19 on (cleared after every layout by _destroy_subgroups, so it holds this one)."""
    from megatron.core.utils import unwrap_model

    plan = getattr(unwrap_model(dst_model), "_cached_reshard_plan", None)
    if plan is None:
        from megatron.core.resharding import refit

        cache = getattr(refit, "_plan_cache", {})
        if len(cache) != 1:
            raise RuntimeError(f"cannot find swap_model_weights' plan ({len(cache)} cached plans)")
        plan = next(iter(cache.values()))
    return plan


def swap_accounting(train_model, dst_model) -> dict[str, int]:
    """Bytes received from other ranks, messages, the second copy and the staging of one swap (from its plan)."""
    plan = _swap_plan(dst_model)
    me = dist.get_rank()
    dst = dict(dst_model.named_parameters())
    src = dict(train_model.named_parameters())
    recv_remote = recv_all = send_strided = messages = 0
    for op in plan.recv_ops:
        view = dst[op.param_name].data[op.my_slice]
        nbytes = view.numel() * view.element_size()
        recv_all += nbytes
        if op.peer_rank != me:
            recv_remote += nbytes
            messages += 1
    for op in plan.send_ops:
        view = src[op.param_name].data[op.my_slice]
        if not view.is_contiguous():
            send_strided += view.numel() * view.element_size()
        messages += op.peer_rank != me
    second = sum(p.numel() * p.element_size() for p in dst_model.parameters())
    # execute_reshard_plan stages every receive (local ones too) in a fresh buffer, and the gloo service stages it
    # again in a CPU buffer; strided send slices are made contiguous first.
    staging = 2 * recv_all + send_strided
    return {"bytes": recv_remote, "collectives": messages, "second_copy_bytes": second, "staging_bytes": staging,
            "accounted": second + staging}


# -------------------------------------------------------------------------------------------------------------
# One layout of one shape


def _max_over_ranks(values: list[float]) -> list[float]:
    # NCCL reduces CUDA tensors only.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _all_objects(obj) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _destroy_subgroups() -> None:
    """Free every process group but the world after a layout: each gloo group keeps its own threads, and a few
    hundred of them (megatron's, the engines', swap's) slow every later collective down."""
    from megatron.core.resharding import refit
    from torch.distributed import distributed_c10d as c10d

    refit.clear_service_cache()  # swap's copy service holds a world group of its own
    # megatron-core 0.19+ caches swap's plans by parallel sizes only: the next shape at the same sizes would reuse
    # this one's plan.
    getattr(refit, "clear_plan_cache", lambda: None)()
    world = c10d.GroupMember.WORLD
    for pg in list(c10d._world.pg_map):
        if pg is not world:
            dist.destroy_process_group(pg)
    gc.collect()


def build_training_model(arch: GPTArchitecture, config, device: torch.device) -> torch.nn.Module:
    """This rank's stage of the training model (after ``initialize_model_parallel``), with :func:`fill_weights`'
    values: the same on every call."""
    from megatron.core import parallel_state as ps

    model = arch.build(config, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    model.to(device)
    fill_weights(model, ps.get_tensor_model_parallel_rank())
    return model


def same_rollout_weights(a, b) -> bool:
    """Whether two engines' rollout models hold the same bytes on every rank (a collective: both switch to rollout
    and back)."""
    crcs = []
    for engine in (a, b):
        engine.switch_to_rollout()
        crcs.append(tensor_crcs(engine.rollout_model))
        engine.switch_to_training()
    bad = sorted(n for n in crcs[0].keys() | crcs[1].keys() if crcs[0].get(n) != crcs[1].get(n))
    return all(not b for b in _all_objects(bad))


def bench_layout(args, shape: str, layout: Layout, device: torch.device, backend: str, mem: Memory,
                 base: Optional[ModuleType] = None) -> list[dict]:
    """Every method of ``args.methods`` on one layout of one shape; the rows on rank 0 (``[]`` elsewhere). ``base``:
    the package of ``--baseline-commit`` (its engine serves a second copy of the training model)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.megatron import compat
    from megatron_hybrid.report import gather_trace, write_communication_report

    t, p, d, t_g, p_g = layout
    rank = dist.get_rank()
    arch = shape_arch(shape, args.params_dtype)
    ps.initialize_model_parallel(tensor_model_parallel_size=t, pipeline_model_parallel_size=p)
    model_parallel_cuda_manual_seed(0)
    try:
        # Megatron sets the tensor-parallel attributes of a weight only where it initialises it: keep the
        # initialisation, per shard (no host-side master weight) and as a no-op; fill_weights sets the values.
        config = arch.transformer_config(tensor_model_parallel_size=t, pipeline_model_parallel_size=p,
                                         use_cpu_initialization=False, init_method=_no_init,
                                         output_layer_init_method=_no_init, embedding_init_method=_no_init)
        model = build_training_model(arch, config, device)
        sizes = full_sizes(model, t)
        model_bytes = sum(n * torch.empty((), dtype=dt).element_size() for n, dt in sizes.values())
        shard_bytes = sum(q.numel() * q.element_size() for q in model.parameters())
        num_tensors = len(list(model.parameters()))
        step = args.step_seconds
        if step is None and not args.no_report:
            step = step_seconds(model, arch, seq=args.seq_length, runs=args.step_runs, device=device)
        methods = {m for m in args.methods}
        results: dict[str, Method] = {}
        base_matches: dict[str, Optional[bool]] = {}

        # ---- phase 1: ours-aliased, bound, swap, naive-gather, interleaved (one engine) ----
        engine = HybridEngine(model, RolloutLayout(t_g, p_g), weight_mode="aliased",
                              bucket_size_mb=args.reshard_bucket_size_mb)
        missing_max = int(max(_max_over_ranks([float(expected_missing_bytes(engine))])))
        bucket_mb = engine.bucket_size_mb  # the engine's default when --reshard-bucket-size-mb is not given
        exchange = _is_exchange(engine)
        d_g = None if exchange else engine.layout.d_g  # an exchange layout has no micro-DP groups
        base_methods = methods & set(BASE_METHODS)
        if base_methods and exchange:
            warnings.warn(f"{shape} {layout}: an exchange layout, which an engine before the exchange does not "
                          f"serve: {', '.join(sorted(base_methods))} skipped")
            base_methods = set()
        # The base commit's engine serves a copy of the model: two engines on one model would each move its
        # parameters into their own buffers (ours refuses a second engine; the base commit's engine does not), and
        # closing one engine to build the other between runs would time them minutes apart, not run by run.
        model_b = build_training_model(arch, config, device) if base_methods else None
        report_summary = None
        if not args.no_report:
            # One profiled switch (a collective at a time, timed each) for the communication report.
            engine.switch_to_rollout()  # warm-up: gloo pairs, first-touch of the peers' pages
            engine.switch_to_training()
            engine.set_profiling(True)
            dist.barrier()
            t0 = time.perf_counter()
            engine.switch_to_rollout()
            switch = max(_max_over_ranks([time.perf_counter() - t0]))
            records = gather_trace(engine)
            engine.switch_to_training()
            if rank == 0:
                stem = f"{args.name}_{shape}_" + "-".join(map(str, layout))
                report_dir = Path(args.report_dir or args.output_dir)
                lay = engine.layout
                report_summary = write_communication_report(
                    records, report_dir / f"{stem}_trace.jsonl", report_dir / f"{stem}_report.html",
                    step_seconds=step, switch_seconds=switch,
                    title=f"Switch to rollout: {shape}, (t,p,d)=({t},{p},{d}) -> (t_g,p_g)=({t_g},{p_g}), "
                          f"{'exchange' if exchange else f'd_g={lay.d_g}'}, aliased, {arch.params_dtype}, "
                          f"{backend}",
                    notes=[f"{dist.get_world_size()} ranks on {device.type} ({os.cpu_count()} cores), bucket "
                           f"{bucket_mb} MB, profiled switch (per-collective timing)",
                           f"step time: one training forward+backward of 1x{args.seq_length} tokens"
                           if args.step_seconds is None else "step time: given on the command line"])
        phase1: list[Method] = []
        if "ours-aliased" in methods:
            phase1.append(ours(engine, "ours-aliased", backend))
        base_engine = None
        if "base-aliased" in base_methods:
            base_engine = base.HybridEngine(model_b, base.RolloutLayout(t_g, p_g), weight_mode="aliased",
                                            bucket_size_mb=args.reshard_bucket_size_mb)
            phase1.append(ours(base_engine, "base-aliased", backend, expected=base.report.missing_bytes))
        if exchange:  # nothing to bound where nothing moves (p_g > p at t = t_g: every rank holds its stage)
            if "bound" in methods and missing_max:
                phase1.append(bound_exchange(engine, mem, fresh=False))
            if "bound-fresh" in methods and missing_max:
                phase1.append(bound_exchange(engine, mem, fresh=True))
        else:
            if "bound" in methods and engine.layout.d_g > 1:
                phase1.append(bound(engine, missing_max, mem, arch.dtype))
            if "bound-fresh" in methods and engine.layout.d_g > 1:
                phase1.append(bound_fresh(engine, missing_max, arch.dtype))
        if "swap" in methods:
            mem.trim()
            before = mem.current()
            swap_m = swap_method(model, build_rollout_model(arch, engine, config).to(device), backend)
            swap_m.op()  # builds and caches the plan (rank 0 plans for all, then scatters): not part of a switch
            swap_m.info.update(swap_accounting(model, swap_m.state["dst"]))
            mem.trim()
            swap_m.setup_extra = mem.current() - before  # the second model copy (and the cached plan)
            phase1.append(swap_m)
        if "naive-gather" in methods:
            phase1.append(naive_gather(sizes, device))
        run_interleaved(phase1, mem, device, warmup=args.warmup, runs=args.runs, keep_shim=args.keep_cpu_shim)
        swap_crcs = None
        swap_again = None
        for m in phase1:
            if m.name == "swap":
                swap_crcs = tensor_crcs(m.state["dst"])
                if "ours-canonical" in methods:  # the same swap (plan cached, second copy kept), fresh timings
                    swap_again = swap_method(m.state["src"], m.state["dst"], backend)
                    swap_again.name, swap_again.info = SWAP_BESIDE_CANONICAL, dict(m.info)
                    swap_again.setup_extra = m.setup_extra
            m.release()
            results[m.name] = m
        # The engine's buffers hold the training weights (the parameters are views of them): close() gives the
        # parameters ordinary memory again and releases the buffers, so that a second engine can take the model.
        engine.close()
        if base_engine is not None:
            base_engine.close()
        del engine, base_engine, phase1
        mem.trim()

        # ---- phase 2: ours-canonical (its own engine on the same training model) ----
        swap_matches = None
        if "ours-canonical" in methods or "base-canonical" in base_methods or swap_crcs is not None:
            engine = HybridEngine(model, RolloutLayout(t_g, p_g), weight_mode="canonical",
                                  bucket_size_mb=args.reshard_bucket_size_mb)
            base_engine = None
            if "base-canonical" in base_methods:
                base_engine = base.HybridEngine(model_b, base.RolloutLayout(t_g, p_g), weight_mode="canonical",
                                                bucket_size_mb=args.reshard_bucket_size_mb)
                # Both rollout models must hold the same bytes (ours' and the base commit's canonical layout).
                base_matches["canonical"] = same_rollout_weights(engine, base_engine)
            if swap_crcs is not None:
                # megatron-core's swap and our canonical rollout model must hold the same bytes.
                engine.switch_to_rollout()
                ours_crcs = tensor_crcs(engine.rollout_model)
                engine.switch_to_training()
                bad = sorted(n for n in swap_crcs if ours_crcs.get(n) != swap_crcs[n])
                swap_matches = all(not b for b in _all_objects(bad))
                if bad:
                    print(f"WARNING rank {rank}: swap_model_weights and ours-canonical differ on {bad[:5]}",
                          flush=True)
            phase2 = [ours(engine, "ours-canonical", backend)] if "ours-canonical" in methods else []
            if base_engine is not None:
                phase2.append(ours(base_engine, "base-canonical", backend, expected=base.report.missing_bytes))
            if swap_again is not None and "ours-canonical" in methods:
                phase2.append(swap_again)
            if phase2:
                run_interleaved(phase2, mem, device, warmup=args.warmup, runs=args.runs,
                                keep_shim=args.keep_cpu_shim)
            for m in phase2:
                m.release()
                results[m.name] = m
            engine.close()
            if base_engine is not None:
                base_engine.close()
            del engine, base_engine, phase2

        # ---- rows (rank 0) ----
        local = {name: {"times": m.times, "extras": [e + m.setup_extra for e in m.extras],
                        "extras_after": m.extras_after, "info": m.info, "phases": m.phases}
                 for name, m in results.items()}
        everyone = _all_objects(local)
        del results, model, model_b
    finally:
        ps.destroy_model_parallel()
        _destroy_subgroups()
    if rank != 0:
        return []
    rows = []
    for name in [n for n in ROW_METHODS if n in everyone[0]]:
        per_rank = [e[name] for e in everyone]
        runs = [max(r["times"][i] for r in per_rank) for i in range(len(per_rank[0]["times"]))]
        row = {
            "method": name, "shape": shape, "layout": list(layout), "exchange": exchange, "d_g": d_g,
            "num_tensors": num_tensors, "num_tensors_model": len(sizes), "backend": backend,
            "world_size": dist.get_world_size(), "device": device.type, "cpu_count": os.cpu_count(),
            "switch_s_median": statistics.median(runs), "switch_s_runs": runs,
            "bytes_per_rank": max(r["info"]["bytes"] for r in per_rank),
            "num_collectives": max(r["info"]["collectives"] for r in per_rank),
            "extra_mem_bytes": max(max(r["extras"]) for r in per_rank),
            "extra_mem_after_bytes": max(max(r["extras_after"]) for r in per_rank),
            "extra_mem_after_bytes_runs": [max(r["extras_after"][i] for r in per_rank) for i in range(len(runs))],
            "mem_measure": mem.kind, "ranks_per_device": mem.ranks_per_device, "params_dtype": arch.params_dtype,
            "extra_mem_accounted_bytes": max(r["info"]["accounted"] for r in per_rank),
            "training_shard_bytes": shard_bytes, "model_bytes": model_bytes,
            "bytes_formula": None if exchange else (d_g - 1) * model_bytes / (t * p),
            "bucket_size_mb": bucket_mb, "runs": args.runs, "warmup": args.warmup,
            "step_s": step, "cpu_shim_while_timing": bool(args.keep_cpu_shim), "torch": torch.__version__,
            "megatron_core": str(compat.MCORE_VERSION),
        }
        if name.startswith(("ours", "base")):
            row["bytes_expected_per_rank"] = max(r["info"]["expected_bytes"] for r in per_rank)
            row["bytes_equal_expected"] = all(r["info"]["bytes"] == r["info"]["expected_bytes"] for r in per_rank)
            row["peer_bytes"] = max(r["info"]["peer_bytes"] for r in per_rank)
            row["staging_bytes"] = max(r["info"]["staging_bytes"] for r in per_rank)
            row["canonical_bytes"] = max(r["info"]["canonical_bytes"] for r in per_rank)
            row["canonical_bytes_mapped"] = max(r["info"]["canonical_bytes_mapped"] for r in per_rank)
            # Per phase of the engine's own timing, the slowest rank's per switch, then the median over the runs.
            parts = list(dict.fromkeys(k for r in per_rank for ph in r["phases"] for k in ph))
            timed = range(args.warmup, len(per_rank[0]["phases"]))
            row["phases_median_s"] = {k: statistics.median(max(r["phases"][i].get(k, 0.0) for r in per_rank)
                                                           for i in timed) for k in parts}
        if name == "swap":
            row["second_copy_bytes"] = max(r["info"]["second_copy_bytes"] for r in per_rank)
            row["staging_bytes"] = max(r["info"]["staging_bytes"] for r in per_rank)
            row["matches_ours_canonical"] = swap_matches
        if name == "ours-aliased" and report_summary is not None:
            row["report_switch_share"] = report_summary["switch_share"]
        rows.append(row)
    by = {r["method"]: r for r in rows}
    for mode in (m.value for m in WeightMode):
        o, b = by.get(f"ours-{mode}"), by.get(f"base-{mode}")
        if o is None or b is None:
            continue
        # Per rank: the same bytes and the same number of collectives as the base commit's engine.
        o["base_bytes_equal"] = all(e[f"ours-{mode}"]["info"]["bytes"] == e[f"base-{mode}"]["info"]["bytes"]
                                    for e in everyone)
        o["base_collectives_equal"] = all(e[f"ours-{mode}"]["info"]["collectives"]
                                          == e[f"base-{mode}"]["info"]["collectives"] for e in everyone)
        o["over_base"] = o["switch_s_median"] / b["switch_s_median"]
        # Run i of both ran back to back: the median of the per-run ratios cancels slow drifts of the machine's load.
        o["over_base_paired_median"] = statistics.median(x / y for x, y in zip(o["switch_s_runs"], b["switch_s_runs"]))
        o["matches_base"] = base_matches.get(mode)
    for r in rows:
        if "bound" in by:
            r["vs_bound"] = r["switch_s_median"] / by["bound"]["switch_s_median"]
        if "bound-fresh" in by:
            r["vs_bound_fresh"] = r["switch_s_median"] / by["bound-fresh"]["switch_s_median"]
        swap = by.get(SWAP_BESIDE_CANONICAL) if r["method"] == "ours-canonical" else None
        swap = swap or by.get("swap")
        if swap is not None and r["method"].startswith("ours"):
            r["swap_over_this"] = swap["switch_s_median"] / r["switch_s_median"]
    return rows


# -------------------------------------------------------------------------------------------------------------
# Outputs


def _ms(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def _mb(b: Optional[float]) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def _phase_ms(r: Optional[dict], key: str) -> str:
    return _ms(r["phases_median_s"].get(key)) if r and "phases_median_s" in r else "-"


def _rows_of(rows: list[dict], shape: str, layout: tuple) -> dict[str, dict]:
    return {r["method"]: r for r in rows if r["shape"] == shape and tuple(r["layout"]) == layout}


def _pairs_section(rows: list[dict], keys: list[tuple]) -> list[str]:
    """Exchange layouts: ours against swap_model_weights, per weight mode."""
    pairs = [k for k in keys if any(r.get("exchange") for r in _rows_of(rows, *k).values())]
    if not pairs:
        return []
    lines = ["", "## New pairs (exchange layouts): ours against swap_model_weights", "",
             "Ours: one `all_to_all_single` per dtype over the world (`ExchangeExecutor`). swap: megatron-core's "
             "`swap_model_weights` into a second rollout model built on the engine's `pg_collection`; aliased is "
             "compared with the swap runs interleaved with it (phase 1), canonical with the swap runs interleaved "
             "with it (phase 2, `swap-beside-canonical`). `swap / ours` ≥ 1: ours is no slower. bound: one "
             "`all_to_all_single` with exactly ours' splits between resident buffers (none where nothing moves). "
             "`same bytes`: swap's rollout model and ours-canonical's hold the same bytes on every rank.", "",
             "| shape | pair t,p,d→t_g,p_g | mode | MB recv/rank (ours = expected) | collectives ours / swap | "
             "ours ms | swap ms | swap / ours | bound ms | same bytes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for shape, lay in pairs:
        by = _rows_of(rows, shape, lay)
        for mode, swap_name in (("aliased", "swap"), ("canonical", SWAP_BESIDE_CANONICAL)):
            o, w, b = by.get(f"ours-{mode}"), by.get(swap_name), by.get("bound")
            if o is None:
                continue
            lines.append("| " + " | ".join([
                shape, "{},{},{}→{},{}".format(*lay), mode,
                f"{_mb(o['bytes_per_rank'])} ({'yes' if o['bytes_equal_expected'] else 'NO'})",
                f"{o['num_collectives']} / {w['num_collectives'] if w else '-'}",
                _ms(o["switch_s_median"]), _ms(w["switch_s_median"]) if w else "-",
                f"{w['switch_s_median'] / o['switch_s_median']:.2f}" if w else "-",
                _ms(b["switch_s_median"]) if b else "-",
                {True: "yes", False: "NO", None: "-"}[by["swap"].get("matches_ours_canonical") if "swap" in by
                                                      else None]]) + " |")
    return lines


def _base_section(rows: list[dict], keys: list[tuple], meta: dict) -> list[str]:
    """Ours against the engine of --baseline-commit, interleaved run by run."""
    if not any(r["method"] in BASE_METHODS for r in rows):
        return []
    lines = ["", f"## Against the base commit {meta.get('baseline_commit')}", "",
             "The base commit's engine (its `megatron_hybrid/` imported as `megatron_hybrid_base`) serves a second "
             "copy of the same training model; its runs alternate with ours run by run (forward, then backward order). "
             "Bytes and collectives: what each rank received and the collectives it ran in one switch, compared rank "
             "by rank. `ours / base`: ratio of the medians; `paired`: median over runs of ours' run i / base's run i. "
             "`same bytes` (canonical): both rollout models hold the same bytes on every rank.", "",
             "| shape | layout t,p,d→t_g,p_g | mode | MB recv/rank ours / base | bytes equal | "
             "collectives ours / base | collectives equal | ours ms | base ms | ours / base | paired | same bytes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    yes = {True: "yes", False: "NO", None: "-"}
    for shape, lay in keys:
        by = _rows_of(rows, shape, lay)
        for mode in (m.value for m in WeightMode):
            o, b = by.get(f"ours-{mode}"), by.get(f"base-{mode}")
            if o is None or b is None:
                continue
            lines.append("| " + " | ".join([
                shape, "{},{},{}→{},{}".format(*lay), mode,
                f"{_mb(o['bytes_per_rank'])} / {_mb(b['bytes_per_rank'])}",
                yes[o["base_bytes_equal"]], f"{o['num_collectives']} / {b['num_collectives']}",
                yes[o["base_collectives_equal"]], _ms(o["switch_s_median"]), _ms(b["switch_s_median"]),
                f"{o['over_base']:.3f}", f"{o['over_base_paired_median']:.3f}", yes[o.get("matches_base")]]) + " |")
    return lines


def markdown(rows: list[dict], meta: dict) -> str:
    if meta["mem_measure"].startswith("cuda"):
        measured = ("device memory in use (`torch.cuda.mem_get_info`, sampled between barriers, the device's "
                    f"growth / {meta['ranks_per_device']} rank(s) per device) right after the switch minus just "
                    "before it, max over ranks")
    else:
        measured = "peak resident-set growth while switching (VmHWM, max over ranks)"
    lines = [f"# Switch to rollout: {meta['world_size']} {meta['backend']} ranks on {meta['device']} "
             f"({meta['cpu_count']} cores)", "",
             f"torch {meta['torch']}, megatron-core {meta['megatron_core']}; bucket {meta['bucket_size_mb']} MB; "
             f"median of {meta['runs']} runs after {meta['warmup']} warm-up; times: the slowest rank; "
             "MB = MiB. `x bound`: time / bound time. `swap / this`: swap_model_weights time / this time. Extra "
             f"memory: {measured} / bytes accounted by construction. map / coll / canon: the engine's own phase "
             "timings (`communication_report()['phases']`), slowest rank, median over runs"
             + (" (on a GPU, host times: launches; the device is synchronised once, in the sync phase)"
                if meta["device"] == "cuda" else "") + ".",
             "", f"Command (with `PYTHONPATH` at the repository root): `{meta['command']}`; wall time "
             f"{meta['wall_s']:.0f} s; load average (1, 5, 15 min) at the start "
             f"{', '.join(f'{x:.1f}' for x in meta['loadavg_start'])}, at the end "
             f"{', '.join(f'{x:.1f}' for x in meta['loadavg_end'])} on {meta['cpu_count']} cores.",
             "", "## Summary", "",
             "| shape | layout t,p,d→t_g,p_g | d_g | MB recv/rank (ours = expected) | bound ms | bound-fresh ms "
             "(aliased x bound-fresh) | ours-aliased ms (x bound) | aliased map / coll / canon ms | ours-canonical ms (x bound) | canonical map / coll / "
             "canon ms | swap ms (swap / aliased) | swap beside canonical ms (swap / canonical) | naive ms | aliased extra MB measured / accounted (missing + "
             "bucket) | swap extra MB (its 2nd copy) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order_shapes = list(SHAPES)
    keys = sorted({(r["shape"], tuple(r["layout"])) for r in rows}, key=lambda k: (order_shapes.index(k[0]), k[1]))
    for shape, lay in keys:
        by = {r["method"]: r for r in rows if r["shape"] == shape and tuple(r["layout"]) == lay}
        a, c, s, n, b = (by.get(k) for k in ("ours-aliased", "ours-canonical", "swap", "naive-gather", "bound"))
        first = next(iter(by.values()))
        cells = [shape, "{},{},{}→{},{}".format(*lay), "exchange" if first.get("exchange") else str(first["d_g"])]
        ref = a or c
        cells.append(f"{_mb(ref['bytes_per_rank'])} ({'yes' if ref['bytes_equal_expected'] else 'NO'})"
                     if ref else "-")
        cells.append(_ms(b["switch_s_median"]) if b else "-")
        f = by.get("bound-fresh")
        cells.append(_ms(f["switch_s_median"]) + (f" ({a['vs_bound_fresh']:.2f})" if a and "vs_bound_fresh" in a
                                                  else "") if f else "-")
        for r in (a, c):
            cells.append(f"{_ms(r['switch_s_median'])}" + (f" ({r['vs_bound']:.2f})" if "vs_bound" in r else "")
                         if r else "-")
            cells.append(" / ".join(_phase_ms(r, k) for k in ("map_seconds", "collectives_seconds",
                                                               "canonical_seconds")) if r else "-")
        cells.append(f"{_ms(s['switch_s_median'])}" + (f" ({s['switch_s_median'] / a['switch_s_median']:.1f})"
                                                         if a else "") if s else "-")
        s2 = by.get(SWAP_BESIDE_CANONICAL)
        cells.append(f"{_ms(s2['switch_s_median'])} ({c['swap_over_this']:.2f})" if s2 and c else "-")
        cells.append(_ms(n["switch_s_median"]) if n else "-")
        if a:
            limit = a["bytes_per_rank"] + a["bucket_size_mb"] * 2**20
            cells.append(f"{_mb(a['extra_mem_bytes'])} / {_mb(a['extra_mem_accounted_bytes'])} "
                         f"({_mb(limit)})")
        else:
            cells.append("-")
        cells.append(f"{_mb(s['extra_mem_bytes'])} ({_mb(s['second_copy_bytes'])})" if s else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += _pairs_section(rows, keys) + _base_section(rows, keys, meta)
    lines += ["", "## All rows", "",
              "Phases (ours): the engine's own per-switch timings, the slowest rank's, median over runs; in brackets "
              "the time inside the collective calls of the collectives phase (the rest: packing, slicing) (on an "
              "oversubscribed CPU a rank's collective also waits for peers that are still busy mapping). `after "
              "back`: memory growth still held after switching back to training.", "",
              "| shape | layout | method | ms | x bound | MB recv/rank | collectives/rank | extra MB measured | "
              "extra MB after back | extra MB accounted | map ms | collectives ms (in the calls) | canonical ms | "
              "offload ms | sync ms |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (order_shapes.index(r["shape"]), r["layout"], ROW_METHODS.index(r["method"]))):
        lines.append(f"| {r['shape']} | {','.join(map(str, r['layout']))} | {r['method']} | "
                     f"{_ms(r['switch_s_median'])} | {r.get('vs_bound', float('nan')):.2f} | "
                     f"{_mb(r['bytes_per_rank'])} | {r['num_collectives']} | {_mb(r['extra_mem_bytes'])} | "
                     f"{_mb(r.get('extra_mem_after_bytes'))} | {_mb(r['extra_mem_accounted_bytes'])} | "
                     + " | ".join([_phase_ms(r, "map_seconds"),
                                   f"{_phase_ms(r, 'collectives_seconds')} ({_phase_ms(r, 'calls_seconds')})"]
                                  + [_phase_ms(r, k) for k in ("canonical_seconds", "offload_seconds", "sync_seconds")])
                     + " |")
    dtypes = {r["shape"]: r.get("params_dtype", SHAPES[r["shape"]].params_dtype) for r in rows}
    lines += ["", "Shapes: " + "; ".join(
        f"`{k}`: {v.num_layers} layers, hidden {v.hidden_size}, ffn {v.ffn_hidden_size}, heads "
        f"{v.num_attention_heads}/{v.num_query_groups or v.num_attention_heads}, vocab {v.vocab_size}, {dtypes[k]}"
        for k, v in SHAPES.items() if k in dtypes), ""]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", flush=True)
        return False
    shapes = [s for s in SHAPES if any(r["shape"] == s for r in rows)]
    fig, axes = plt.subplots(1, len(shapes), figsize=(7 * len(shapes), 4.5), squeeze=False)
    colours = {"ours-aliased": "#3b7dd8", "ours-canonical": "#7fb0ee", "swap": "#d9534f",
               "naive-gather": "#8a8a8a", "bound": "#2e8b57", "bound-fresh": "#9acd32", "base-aliased": "#6a3d9a",
               "base-canonical": "#cab2d6"}
    for ax, shape in zip(axes[0], shapes):
        layouts = sorted({tuple(r["layout"]) for r in rows if r["shape"] == shape})
        present = [m for m in METHODS + BASE_METHODS if any(r["method"] == m and r["shape"] == shape for r in rows)]
        w = 0.8 / max(len(present), 1)
        for i, m in enumerate(present):
            xs, ys = [], []
            for j, lay in enumerate(layouts):
                for r in rows:
                    if r["shape"] == shape and tuple(r["layout"]) == lay and r["method"] == m:
                        xs.append(j + (i - (len(present) - 1) / 2) * w)
                        ys.append(r["switch_s_median"] * 1e3)
            ax.bar(xs, ys, width=w, label=m, color=colours[m])
        low = min(r["switch_s_median"] for r in rows if r["shape"] == shape and r["method"] in present) * 1e3
        ax.set_xticks(range(len(layouts)))
        ax.set_xticklabels([f"{t},{p},{d}\n→{tg},{pg}" for t, p, d, tg, pg in layouts], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylim(bottom=low / 3)
        ax.set_ylabel("switch to rollout, ms (median; log)")
        ax.set_xlabel("layout t,p,d → t_g,p_g")
        ax.set_title(f"{shape}: {rows[0]['world_size']} {rows[0]['backend']} ranks, {rows[0]['device']}")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, ncol=len(present), loc="lower center", bbox_to_anchor=(0.5, 1.08), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# -------------------------------------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-dir", type=Path, required=True, help="where NAME.json/.md/.png go")
    ap.add_argument("--name", default=None, help="file stem (default: reshard_cpu or reshard_gpu)")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["many-small", "few-large"])
    ap.add_argument("--layouts", nargs="+", type=parse_layout, default=None,
                    help="t,p,d,t_g,p_g ... (default: per shape, for the world size; see DEFAULT_LAYOUTS_8 and "
                         "DEFAULT_LAYOUTS)")
    ap.add_argument("--methods", nargs="+", choices=METHODS + BASE_METHODS, default=None,
                    help="default: all but the base-* ones, and those too with --baseline-commit")
    ap.add_argument("--baseline-commit", default=None,
                    help="also time this commit's engine (methods base-aliased, base-canonical), interleaved run by "
                         "run with ours on a second copy of the training model; see load_baseline")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per method (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs per method first")
    ap.add_argument("--reshard-bucket-size-mb", type=float, default=None,
                    help="HybridEngine bucket_size_mb (default: the engine's, 1024 on a GPU, 32 on a CPU)")
    ap.add_argument("--seq-length", type=int, default=128, help="tokens of the training forward+backward (step time)")
    ap.add_argument("--step-runs", type=int, default=2, help="timed training steps (median) after one warm-up")
    ap.add_argument("--step-seconds", type=float, default=None, help="use this step time instead of measuring")
    ap.add_argument("--report-dir", type=Path, default=None, help="communication reports (default: --output-dir)")
    ap.add_argument("--no-report", action="store_true", help="no communication report and no step time")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                    help="auto: nccl with CUDA, gloo without. gloo with CUDA: ranks may share a GPU (LOCAL_RANK "
                         "modulo the GPU count); tensors stay on the GPU, gloo moves them through host memory")
    ap.add_argument("--params-dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="parameter dtype of every shape (default: each shape's own: fp32 for many-small and "
                         "few-large, bf16 for gpu-1b and llama-7b)")
    ap.add_argument("--keep-cpu-shim", action="store_true",
                    help="time the switches inside cpu_gloo()'s TorchFunctionMode (default: suspended while timing)")
    args = ap.parse_args(argv)
    if args.runs < 5:
        warnings.warn(f"--runs {args.runs}: fewer than 5 runs make a noisy median")
    if args.runs < 1 or args.warmup < 0:
        raise ValueError(f"--runs ({args.runs}) must be >= 1 and --warmup ({args.warmup}) >= 0")
    if args.methods is None:
        args.methods = list(METHODS) + (list(BASE_METHODS) if args.baseline_commit else [])
    if set(args.methods) & set(BASE_METHODS) and not args.baseline_commit:
        raise ValueError(f"--methods {' '.join(sorted(set(args.methods) & set(BASE_METHODS)))} need "
                         "--baseline-commit")
    load_start = os.getloadavg()

    use_cuda = torch.cuda.is_available()
    backend = args.backend if args.backend != "auto" else ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise ValueError("--backend nccl needs CUDA; this machine has no GPU (use gloo)")
    if use_cuda:
        local_rank, gpus = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
        if backend == "nccl" and local_rank >= gpus:
            raise ValueError(f"--backend nccl: local rank {local_rank} but {gpus} GPU(s); NCCL refuses two ranks "
                             "on one GPU: use --backend gloo to share GPUs")
        torch.cuda.set_device(local_rank % gpus)
    dist.init_process_group(backend)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    args.name = args.name or ("reshard_gpu" if use_cuda else "reshard_cpu")
    mem = CudaMemory(device) if use_cuda else Memory()
    from megatron_hybrid.megatron.patches import cpu_gloo

    base, base_sha = None, None
    if args.baseline_commit:
        base, base_sha = load_baseline(args.baseline_commit, Path(__file__).resolve().parents[1])
    rows: list[dict] = []
    started = time.perf_counter()
    with contextlib.nullcontext() if use_cuda else cpu_gloo(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
        for shape in args.shapes:
            for layout in args.layouts or default_layouts(shape, world):
                t, p, d, t_g, p_g = layout
                if t * p * d != world:
                    raise ValueError(f"layout {layout}: t·p·d = {t * p * d} but the world has {world} ranks")
                t1 = time.perf_counter()
                new = bench_layout(args, shape, layout, device, backend, mem, base)
                rows += new
                if rank == 0:
                    by = {r["method"]: r for r in new}
                    print(f"[{time.perf_counter() - started:6.0f} s] {shape} {layout}: " + ", ".join(
                        f"{m} {r['switch_s_median'] * 1e3:.1f} ms" for m, r in by.items())
                          + f"  ({time.perf_counter() - t1:.0f} s)", flush=True)
    if rank == 0:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        meta = {k: rows[0][k] for k in ("world_size", "backend", "device", "cpu_count", "torch", "megatron_core",
                                         "bucket_size_mb", "runs", "warmup", "mem_measure", "ranks_per_device")}
        meta["host"] = platform.platform()
        meta["command"] = (f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} torchrun --standalone "
                           f"--nproc_per_node {world} bench/reshard.py " + " ".join(argv or sys.argv[1:]))
        meta["baseline_commit"] = base_sha
        meta["loadavg_start"], meta["loadavg_end"] = list(load_start), list(os.getloadavg())
        meta["wall_s"] = time.perf_counter() - started
        for r in rows:
            r.update({k: meta[k] for k in ("host", "command", "baseline_commit", "loadavg_start", "loadavg_end")})
        (args.output_dir / f"{args.name}.json").write_text(json.dumps(rows, indent=1) + "\n")
        (args.output_dir / f"{args.name}.md").write_text(markdown(rows, meta))
        plotted = not args.no_plot and plot(rows, args.output_dir / f"{args.name}.png")
        print(f"wrote {args.output_dir}/{args.name}.{{json,md{',png' if plotted else ''}}} in "
              f"{time.perf_counter() - started:.0f} s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
