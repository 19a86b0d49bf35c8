"""One :class:`~megatron_hybrid.testing.layout_space.LayoutExample` through the HybridEngine, against the unsharded
model: the property test (tests/test_layout_property.py) and the sweep (bench/layout_sweep.py) run it.

:func:`check` runs three jobs on the CPU rank pool (:mod:`megatron_hybrid.testing.ranks`):

1. one rank: the unsharded model, its weights seeded by name, and its logits;
2. ``world`` ranks (:func:`sharded_case`): the model at the training layout loads its shards of those weights, an
   engine switches it to the rollout layout and back, once before and once after an optimizer step (SGD on the plain
   model, or megatron-core's Adam with the distributed optimizer in Megatron DDP). At each switch every rank checks
   its rollout weights bit for bit against its rollout shard of the training weights gathered to full tensors (FP8:
   against its own quantization of that shard), counts the bytes it misses element by element, switches again
   (which must call no collective) and computes the rollout model's logits;
3. one rank: the logits of the unsharded model at the gathered post-step weights.

:func:`check` returns the failures as strings (empty: the example holds). Nothing here imports tests/ or bench/.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .layout_space import LayoutExample

BATCH, SEQ, LR = 2, 8, 0.05
FP32_ATOL = 1e-4
"""Logits of the fp32 rollout model against the unsharded one: the same products summed over another TP split or
in another order differ by ~1e-6 at these sizes (64-wide hidden, ≤ 8 layers); 1e-4 is Megatron-LM's own tolerance
in its resharding tests. An MoE router that changes its choice would move a logit by ~1e-1, far outside it."""
FP8_ATOL = 2e-3
"""Logits of the FP8 rollout model against the unsharded model with the same quantization in plain torch: both
dequantize the same FP8 values and scales, so they differ by fp32 summation order (~1e-6) times the dequantized
magnitudes, plus the one-ulp FP8 flips that order causes in activations (~1e-3 of a logit at most here)."""
_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
                "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list", "irecv",
                "isend", "recv", "reduce_scatter", "reduce_scatter_tensor", "send")


def seeded(name: str, shape, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + salt)
    return torch.randn(shape, generator=g)


def tokens(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=g), torch.arange(SEQ).expand(BATCH, -1)


def quantize(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 per output row: scale = row amax / 448 (1 for a zero row), the fp32 weight over it cast to FP8."""
    w = w_NK.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, 448.0))
    return (w / scale[:, None]).to(torch.float8_e4m3fn), scale


def _key(name: str, tensor: torch.Tensor) -> str:
    """The full-model name a rank's tensor is a shard of: a tied output layer is the embedding."""
    if getattr(tensor, "shared_embedding", False) and name.startswith("output_layer"):
        return "embedding.word_embeddings.weight"
    return name


# ---- the unsharded model (one rank) --------------------------------------------------------------------------

def _fake_fp8(model: torch.nn.Module, rollout_tp: int) -> None:
    """Make the unsharded model's FP8 targets compute as FP8 rollout linears at rollout TP ``rollout_tp`` do, in
    plain torch: weight rows and activation tokens quantized (:func:`quantize`) and dequantized, fp32 matmuls; a
    row-parallel linear's input features in ``rollout_tp`` slices, each quantized alone, partial products summed."""
    from megatron_hybrid.fp8 import is_target

    def fake(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        q, s = quantize(flat)
        return (q.float() * s[:, None]).view(x.shape)

    def column(input, weight, *args, bias=None, **kwargs):
        y = torch.nn.functional.linear(fake(input), fake(weight)).to(input.dtype)
        return y if bias is None else y + bias

    def row(input, weight, *args, bias=None, **kwargs):
        parts = [torch.nn.functional.linear(fake(x), fake(w)).to(input.dtype)
                 for x, w in zip(input.chunk(rollout_tp, dim=-1), weight.chunk(rollout_tp, dim=-1))]
        y = sum(parts[1:], parts[0])
        return y if bias is None else y + bias

    for name, module in model.named_modules():
        if is_target(f"{name}.weight"):  # megatron-core's linears call their _forward_impl: an instance attribute
            module._forward_impl = row if name.endswith(("linear_proj", "linear_fc2")) else column


def reference_case(ex: LayoutExample, state: Optional[dict] = None) -> dict:
    """World of one: the unsharded model's weights (seeded by name when ``state`` is None) and its logits (with
    the FP8 rollout linears' arithmetic in ``fp8`` mode)."""
    from megatron_hybrid.binding import named_weights

    model = ex.architecture(tensor_model_parallel_size=1).build()
    model.eval()
    if state is None:
        state = {}
        for name, _, p in named_weights([model]):
            w = seeded(name, p.shape, 0) * 0.05
            state[name] = (1.0 + w if p.dim() == 1 and "norm" in name else w).to(p.dtype)
    with torch.no_grad():
        for name, _, p in named_weights([model]):
            p.copy_(state[_key(name, p)])
        if ex.mode == "fp8":
            _fake_fp8(model, ex.t_g)
        logits = model(*tokens(ex.vocab_size), None).float()
    return {"state": state, "logits": logits}


# ---- the sharded run (world ranks) ---------------------------------------------------------------------------

def _build(ex: LayoutExample) -> list[torch.nn.Module]:
    from megatron.core import parallel_state as ps

    a = ex.architecture()
    moe = dict(expert_model_parallel_size=ex.e, expert_tensor_parallel_size=ex.et) if ex.num_experts else {}
    config = a.transformer_config(tensor_model_parallel_size=ex.t, pipeline_model_parallel_size=ex.p,
                                  virtual_pipeline_model_parallel_size=ex.vpp, **moe)
    if ex.optimizer == "adam":
        from megatron.core.distributed import finalize_model_grads

        config.finalize_model_grads_func = finalize_model_grads
    chunks = []
    for vp in range(ex.vpp or 1):
        first = ps.is_pipeline_first_stage(ignore_virtual=True) and vp == 0
        last = ps.is_pipeline_last_stage(ignore_virtual=True) and vp == (ex.vpp or 1) - 1
        chunks.append(a.build(config, pre_process=first, post_process=last,
                              vp_stage=vp if ex.vpp is not None else None))
    return chunks


def _coordinates(name: str) -> tuple[int, int]:
    """(rank, size) of this rank's training shard of ``name``: expert TP for a routed expert's, TP otherwise."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid.sharding import is_expert

    if is_expert(name):
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _load(modules: list[torch.nn.Module], state: dict) -> None:
    from megatron_hybrid.binding import named_weights
    from megatron_hybrid.sharding import TPSpec, shard

    with torch.no_grad():
        for name, _, p in named_weights(modules):
            p.copy_(shard(state[_key(name, p)], TPSpec.of(p), *_coordinates(name)))


def _gather_training(modules: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The training weights as full tensors (every rank's shards, object all-gather over the world)."""
    from megatron_hybrid.binding import named_weights
    from megatron_hybrid.sharding import TPSpec, unshard

    local = {}
    for name, _, p in named_weights(modules):
        if _key(name, p) == name:  # a tied output layer is the embedding's copy; the check compares both
            rank, size = _coordinates(name)
            local[name] = (rank, size, p.detach().clone(), TPSpec.of(p))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    shards: dict[str, dict[int, torch.Tensor]] = {}
    specs: dict[str, tuple[int, TPSpec]] = {}
    for part in everyone:
        for name, (rank, size, t, spec) in part.items():
            shards.setdefault(name, {})[rank] = t
            specs[name] = (size, spec)
    full = {}
    for name, by_rank in shards.items():
        size, spec = specs[name]
        assert sorted(by_rank) == list(range(size)), (name, sorted(by_rank))
        full[name] = unshard([by_rank[r] for r in range(size)], spec)
    return full


def _training_copies_agree(modules: list[torch.nn.Module], full: dict) -> list[str]:
    """Training tensors of this rank that differ from the gathered full ones (a tied output layer from the
    embedding, or data-parallel replicas from each other): the reference is only one model if this is empty."""
    from megatron_hybrid.binding import named_weights
    from megatron_hybrid.sharding import TPSpec, shard

    bad = []
    for name, _, p in named_weights(modules):
        want = shard(full[_key(name, p)], TPSpec.of(p), *_coordinates(name))
        if not _bits_equal(p.detach(), want):
            bad.append(f"training {name}")
    return bad


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _rollout_coordinates(engine, name: str) -> tuple[int, int]:
    from megatron_hybrid.sharding import is_expert

    if is_expert(name):
        return engine.group_ranks["expt_tp"].index(dist.get_rank()), engine.expert_layout.et_g
    return engine.rollout_tp_rank, engine.layout.t_g


def _rollout_mismatches(engine, full: dict, fp8: bool) -> tuple[list[str], int]:
    """Rollout weights of this rank that differ in any bit from its rollout shard of ``full`` (FP8 targets: from
    :func:`quantize` of that shard, scales included), and how many FP8 tensors were compared."""
    from megatron_hybrid.binding import named_weights
    from megatron_hybrid.fp8 import is_target
    from megatron_hybrid.sharding import TPSpec, shard

    bad, quantized = [], 0
    for name, _, p in named_weights(engine.rollout_chunks):
        want = shard(full[_key(name, p)], TPSpec.of(p), *_rollout_coordinates(engine, name))
        entry = engine.binding.fp8.get(p) if fp8 else None
        if fp8 and (entry is not None) != is_target(name, layers=engine.fp8_layers):
            bad.append(f"{name}: FP8 is {entry is not None}")
            continue
        if entry is not None:
            quantized += 1
            q, s = quantize(want)
            if not (_bits_equal(entry[0], q) and _bits_equal(entry[1], s)):
                bad.append(f"{name} (FP8)")
            continue
        blocks = engine.binding.table.get(p)
        got = p.detach() if blocks is None else blocks.materialize()
        if not _bits_equal(got, want):
            bad.append(name)
    return bad, quantized


def missing_bytes(engine, shapes: dict[str, tuple[int, ...]]) -> int:
    """Bytes of this rank's rollout shard that none of its training tensors holds, element by element: every full
    tensor (``shapes``: the unsharded model's) numbered, the numbers cut as the training and the rollout shards
    (dense by TP, routed experts by expert TP, a tied output layer as the embedding), and the rollout numbers no
    training tensor has counted."""
    from megatron_hybrid.binding import named_weights
    from megatron_hybrid.sharding import TPSpec, shard

    def ids(key: str) -> torch.Tensor:
        return torch.arange(int(torch.Size(shapes[key]).numel())).view(shapes[key])

    held: dict[str, list[torch.Tensor]] = {}
    for name, _, p in named_weights(engine.modules):
        key = _key(name, p)
        held.setdefault(key, []).append(shard(ids(key), TPSpec.of(p), *_coordinates(name)).flatten())
    total = 0
    for name, _, p in named_weights(engine.rollout_chunks):
        key = _key(name, p)
        need = shard(ids(key), TPSpec.of(p), *_rollout_coordinates(engine, name)).flatten()
        have = torch.isin(need, torch.cat(held[key])).sum().item() if key in held else 0
        total += (need.numel() - have) * p.element_size()
    return total


@contextlib.contextmanager
def _counting_collectives():
    """Count calls of torch.distributed's collectives and point-to-point functions while inside."""
    calls: list[str] = []
    saved = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapper

    for name, fn in saved.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _wrap_for_adam(ex: LayoutExample, chunks: list[torch.nn.Module]):
    """Megatron DDP around each chunk and megatron-core's Adam with the distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                               bucket_size=2000)
    wrapped = [DistributedDataParallel(c.config, ddp_config, c, disable_bucketing=i > 0)
               for i, c in enumerate(chunks)]
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.01, clip_grad=1.0,
                                                       use_distributed_optimizer=True,
                                                       params_dtype=torch.float32), wrapped)
    return wrapped, optimizer


def _step(chunks, modules, optimizer, shapes: dict[str, tuple[int, ...]]) -> None:
    """One optimizer step with seeded gradients: every parameter's gradient is its shard of a full gradient seeded
    by name (the same on every data-parallel replica; ``shapes``: the unsharded model's)."""
    from megatron_hybrid import compat
    from megatron_hybrid.binding import named_weights
    from megatron_hybrid.sharding import TPSpec, shard

    grads = {}
    for name, _, p in named_weights(modules):
        if isinstance(p, torch.nn.Parameter):
            key = _key(name, p)
            full = seeded(key, shapes[key], 1) * 0.01
            grads[p] = shard(full, TPSpec.of(p), *_coordinates(name)).to(p.dtype)
    if optimizer is None:
        for p, g in grads.items():
            p.grad = g
        torch.optim.SGD(list(grads), lr=LR).step()
        return
    for c in chunks:
        c.zero_grad_buffer()
    optimizer.zero_grad()
    for p, g in grads.items():
        p.main_grad.copy_(g)
    for c in chunks:
        c.finish_grad_sync()
    ok, _, _ = optimizer.step()
    assert ok, "the optimizer skipped its step"
    for c in chunks:
        compat.ddp_finish_param_sync(c)


def sharded_case(ex: LayoutExample, state: dict) -> dict:
    """A rank's observations of ``ex`` (see the module docstring): per phase its failures, the training weights
    gathered to full tensors (rank 0) and the rollout logits (one rank per rollout replica)."""
    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.forward import gather_vocab, pipeline_forward

    shapes = {n: tuple(w.shape) for n, w in state.items()}
    chunks = _build(ex)
    _load(chunks, state)
    modules, optimizer = chunks, None
    if ex.optimizer == "adam":
        chunks, optimizer = _wrap_for_adam(ex, chunks)
    engine = HybridEngine(chunks if len(chunks) > 1 else chunks[0], RolloutLayout(**ex.rollout_kwargs()),
                          weight_mode="aliased" if ex.mode == "aliased" else "canonical",
                          rollout_weights="fp8" if ex.mode == "fp8" else "model", bucket_size_mb=0.01,
                          optimizer=optimizer)
    out: dict[str, Any] = {"exchange": engine.layout.exchange, "phases": []}
    try:
        for phase in range(2):
            if phase:
                _step(chunks, modules, optimizer, shapes)
            full = _gather_training(engine.modules)
            failures = _training_copies_agree(engine.modules, full)
            engine.switch_to_rollout()
            moved = engine.communication_report()["total_bytes"]
            bad, _ = _rollout_mismatches(engine, full, ex.mode == "fp8")
            failures += [f"rollout weight {n}" for n in bad]
            expected = missing_bytes(engine, shapes)
            # Megatron DDP keeps a micro-DP gather's training tensors in one buffer, which travels whole.
            whole_buffers = ex.optimizer == "adam" and not engine.layout.exchange
            if moved != expected and not (whole_buffers and moved > expected):
                failures.append(f"bytes received {moved} != needed - held {expected}")
            with _counting_collectives() as calls:
                engine.switch_to_rollout()
            if calls:
                failures.append(f"a repeated switch called {sorted(set(calls))}")
            with torch.no_grad():
                logits = pipeline_forward(engine.rollout_chunks[0], engine.groups["pp"], *tokens(ex.vocab_size))
                if logits is not None:
                    logits = gather_vocab(logits, engine.groups["tp"]).float()
            engine.switch_to_training()
            out["phases"].append({"failures": failures, "full": full if dist.get_rank() == 0 else None,
                                  "logits": logits if engine.rollout_tp_rank == 0 else None})
    finally:
        engine.close(optimizer=optimizer)
    return out


def reference_batch(examples: list[LayoutExample], states: Optional[list[dict]] = None) -> list[dict]:
    """:func:`reference_case` of each example, in one job."""
    return [reference_case(ex, None if states is None else states[i]) for i, ex in enumerate(examples)]


def sharded_batch(examples: list[LayoutExample], states: list[dict]) -> list[dict]:
    """:func:`sharded_case` of each example (all of one world and training layout), in one job: the parallel state
    is set up once."""
    return [sharded_case(ex, state) for ex, state in zip(examples, states)]


def _compare(ex: LayoutExample, ref: dict, runs: list[dict], stepped: dict) -> list[str]:
    failures = []
    first = runs[0]["phases"][0]["full"]
    differ = sorted(n for n in ref["state"] if n not in first or not torch.equal(first[n], ref["state"][n]))
    if differ or first.keys() != ref["state"].keys():
        failures.append(f"the loaded training weights are not the reference's: {differ[:3]}")
    atol = FP8_ATOL if ex.mode == "fp8" else FP32_ATOL
    for phase, want in enumerate((ref["logits"], stepped["logits"])):
        for rank, r in enumerate(runs):
            obs = r["phases"][phase]
            failures += [f"rank {rank} phase {phase}: {f}" for f in obs["failures"]]
            if obs["logits"] is not None:
                err = (obs["logits"] - want).abs().max().item()
                if not err <= atol:
                    failures.append(f"rank {rank} phase {phase}: logits off by {err:.3g} (tolerance {atol})")
    return failures


BATCH_SIZE = 8
KEEP_POOLS = (1, 2, 4, 8)
"""World sizes whose rank pools stay up after their examples (the test suite's sizes); the others stop."""


def check_many(examples: list[LayoutExample], *, timeout_s: float = 300.0,
               progress: Optional[Callable[[int], None]] = None) -> list[list[str]]:
    """The failures of each example (empty: exact). Examples of one world size and training layout run as one
    job per step; when such a job fails, its examples run again one at a time to tell which failed and how.
    ``progress(k)``: called after every k examples done."""
    from .ranks import RankFailure, run_distributed, shutdown

    results: list[Optional[list[str]]] = [None] * len(examples)
    layouts: dict[tuple, list[int]] = {}
    for i, ex in enumerate(examples):
        layouts.setdefault((ex.world, tuple(sorted(ex.parallel_kwargs().items()))), []).append(i)
    # At most BATCH_SIZE examples a job: every engine's process groups live until the job's end.
    jobs = [(key, idx[k: k + BATCH_SIZE]) for key, idx in layouts.items() for k in range(0, len(idx), BATCH_SIZE)]
    for (world, sizes), idx in jobs:
        batch = [examples[i] for i in idx]
        try:
            refs = run_distributed(reference_batch, 1, batch, timeout_s=timeout_s)[0]
            runs = run_distributed(sharded_batch, world, batch, [r["state"] for r in refs], timeout_s=timeout_s,
                                   **dict(sizes))
            stepped = run_distributed(reference_batch, 1, batch, [r["phases"][1]["full"] for r in runs[0]],
                                      timeout_s=timeout_s)[0]
        except RankFailure as err:
            if len(idx) == 1:
                results[idx[0]] = [f"raised: {_last_error(str(err))}"]
                if progress is not None:
                    progress(1)
                continue
            for i in idx:
                results[i] = check_many([examples[i]], timeout_s=timeout_s, progress=progress)[0]
            continue
        for k, i in enumerate(idx):
            results[i] = _compare(examples[i], refs[k], [r[k] for r in runs], stepped[k])
        if progress is not None:
            progress(len(idx))
        if world not in KEEP_POOLS and not any(ex.world == world for ex in examples[max(idx) + 1:]):
            shutdown(world)
    return [r if r is not None else ["not run"] for r in results]


def _last_error(report: str) -> str:
    """The first rank's exception line of a :class:`RankFailure` report (its last traceback line)."""
    lines = [line for line in report.splitlines() if line.strip()]
    errors = [line for line in lines if not line.startswith((" ", "---", "Traceback"))]
    return errors[0] if errors else (lines[-1] if lines else report)


def check(ex: LayoutExample, *, timeout_s: float = 300.0) -> list[str]:
    """The failures of one example (see :func:`check_many`)."""
    return check_many([ex], timeout_s=timeout_s)[0]
