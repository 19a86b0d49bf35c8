"""Rank bodies for the engine over Megatron DDP's own parameter buffers: the distributed optimizer, bf16 parameters
with fp32 main parameters, sequence parallelism, overlapped gradient reduction and parameter gathers.

Module-level so the harness can send them to its ranks. A training run here is Megatron-LM's loop in small: DDP,
``get_megatron_optimizer``, the 1F1B schedule over two micro-batches and ``optimizer.step()``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch
import torch.distributed as dist

from tests.engine_cases import resident_bytes_in, rollout_full_weights

SEQ, MICRO, NUM_MICRO, LR = 8, 2, 2, 3e-3


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration of the matrix (the training sizes t, p come from the harness, d from the world)."""

    mode: str = "aliased"
    distopt: bool = True
    bf16: bool = False
    sp: bool = False
    overlap: bool = False
    """overlap_grad_reduce and overlap_param_gather (the switch then comes before the next forward's gather)."""
    rollout: tuple[int, int] = (1, 1)
    offload: bool = False
    """switch_to_rollout(offload_optimizer=..., offload_grads=True)."""
    optimizer_first: bool = True
    """Build the optimizer before the engine (its shards of DDP's buffer then move with it), else after."""
    steps: int = 5


def _arch(cfg: Config, **kw):
    from megatron_hybrid.megatron.models import tiny_llama

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=64,
                vocab_size=60, make_vocab_size_divisible_by=16, max_position_embeddings=64,
                params_dtype="bfloat16" if cfg.bf16 else "float32")
    base.update(kw)
    return tiny_llama(**base)


def build(cfg: Config, arch=None, *, bucket_size: Optional[int] = 1500):
    """This rank's stage in Megatron DDP and its megatron-core optimizer (seeded: the same weights every call)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    arch = arch or _arch(cfg)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    config = arch.transformer_config(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                                     pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                                     sequence_parallel=cfg.sp)
    config.finalize_model_grads_func = finalize_model_grads
    stage = arch.build(config, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    stage = stage.to(dtype=arch.dtype)  # the local spec's torch norms ignore params_dtype
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=cfg.distopt, overlap_grad_reduce=cfg.overlap,
        overlap_param_gather=cfg.overlap and cfg.distopt, bucket_size=bucket_size)
    model = DistributedDataParallel(config, ddp_config, stage)
    if cfg.overlap:
        config.no_sync_func = model.no_sync  # gradients of all micro-batches before the overlapped reduction

    def optimizer():
        return get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=LR, weight_decay=0.01, bf16=cfg.bf16, params_dtype=arch.dtype, clip_grad=1.0,
            use_distributed_optimizer=cfg.distopt, overlap_param_gather=cfg.overlap and cfg.distopt), [model])

    return model, optimizer


def _batch(step: int) -> list[torch.Tensor]:
    from megatron.core import parallel_state as ps

    g = torch.Generator().manual_seed(1000 * step + ps.get_data_parallel_rank())
    return [torch.randint(0, 60, (MICRO, SEQ + 1), generator=g) for _ in range(NUM_MICRO)]


def train_step(model, optimizer, step: int) -> list[float]:
    """One update: the micro-batch losses (last stage; empty elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    def forward_step(data_iterator, model):
        seq = next(data_iterator)
        tokens, labels = seq[:, :-1], seq[:, 1:]
        logits = model(tokens, torch.arange(SEQ).expand(MICRO, -1), None)

        def loss_fn(output):
            loss = vocab_parallel_cross_entropy(output.float().transpose(0, 1).contiguous(),
                                                labels.transpose(0, 1).contiguous()).mean()
            return loss, {"loss": loss.detach()}
        return logits, loss_fn

    model.zero_grad_buffer()
    optimizer.zero_grad()
    out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(_batch(step)),
                                      model=[model], num_microbatches=NUM_MICRO, seq_length=SEQ,
                                      micro_batch_size=MICRO, forward_only=False)
    ok, _, _ = optimizer.step()
    assert ok
    return [float(o["loss"]) for o in out]


def _full(model) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state as ps

    from megatron_hybrid.megatron.sharding import full_state_dict

    return full_state_dict([model], tp_group=ps.get_tensor_model_parallel_group(),
                           pp_group=ps.get_pipeline_model_parallel_group())


def _same(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ (bit for bit), or are missing on one side."""
    return sorted(n for n in a.keys() | b.keys() if n not in a or n not in b or not torch.equal(a[n], b[n]))


def matrix_case(cfg: Config) -> dict:
    """``cfg.steps`` updates without the engine, then the same updates through it (a switch to rollout and back
    after every ``step()``): losses and parameters, bit for bit, and the rollout weights after every step."""
    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.megatron import compat
    from megatron_hybrid.memory import optimizer_tensors

    t0 = time.perf_counter()
    model, make_optimizer = build(cfg)
    optimizer = make_optimizer()
    ref_losses, ref_steps = [], []
    for s in range(cfg.steps):
        ref_losses.append(train_step(model, optimizer, s))
        compat.ddp_finish_param_sync(model)  # when the gather runs, not what it gathers
        ref_steps.append(_full(model))
    ref_params = ref_steps[-1]
    del model, optimizer

    model, make_optimizer = build(cfg)
    optimizer = make_optimizer() if cfg.optimizer_first else None
    before = [b.param_data.data_ptr() for b in compat.ddp_param_buffers(model)]
    engine = HybridEngine(model, RolloutLayout(*cfg.rollout), weight_mode=cfg.mode, bucket_size_mb=0.01,
                          optimizer=optimizer)
    optimizer = optimizer or make_optimizer()
    buffers = compat.ddp_param_buffers(model)
    unmoved = [b.param_data.data_ptr() for b in buffers] == before
    spans = engine.placement.spans()
    inside = all(any(lo <= b.param_data.data_ptr() and b.param_data.data_ptr() + b.param_data.numel()
                     * b.param_data.element_size() <= hi for lo, hi in spans) for b in buffers)
    losses, rollout_mismatch, device_bytes, bytes_moved = [], [], [], []
    for s in range(cfg.steps):
        losses.append(train_step(model, optimizer, s))
        # Directly after step(): with overlap_param_gather the all-gather of the new weights is still pending.
        offloaded = optimizer_tensors(optimizer, keep=list(model.parameters())) if cfg.offload else []
        grads = compat.ddp_grad_buffers(model) if cfg.offload else []
        engine.switch_to_rollout(offload_optimizer=optimizer if cfg.offload else None, offload_grads=cfg.offload)
        device_bytes.append(sum(t.untyped_storage().nbytes() for t in offloaded + grads))
        bytes_moved.append(engine.communication_report()["total_bytes"])
        rollout = rollout_full_weights(engine)
        # The weights of this step, also where the switch had to finish the optimizer's all-gather first.
        rollout_mismatch.append(_same(rollout, _full(model)) + _same(rollout, ref_steps[s]))
        engine.switch_to_training()
    compat.ddp_finish_param_sync(model)
    params = _full(model)
    engine.close(optimizer=None if cfg.optimizer_first else optimizer)
    after_close = _same(params, _full(model))
    return {"losses_equal": losses == ref_losses, "losses": losses, "ref_losses": ref_losses,
            "params_differ": _same(params, ref_params), "rollout_mismatch": rollout_mismatch,
            "inside": inside, "unmoved": unmoved, "num_buffers": len(buffers), "device_bytes": device_bytes,
            "offloaded": len(offloaded), "bytes": bytes_moved, "after_close": after_close,
            "seconds": time.perf_counter() - t0}


def logits_case() -> dict:
    """TP=2 with sequence parallelism (distributed optimizer, one step taken) → rollout TP=1: rollout logits
    against the training model's, gathered over TP, for the same tokens."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.forward import gather_vocab

    import pytest

    from megatron_hybrid.megatron import compat

    cfg = Config(sp=True)
    model, make_optimizer = build(cfg)
    optimizer = make_optimizer()
    # Built before the engine and not passed to it: its shards would go on viewing DDP's old buffer. Refused, and
    # DDP is left as it was.
    ptr = compat.ddp_param_buffers(model)[0].param_data.data_ptr()
    with pytest.raises(ValueError, match=r"optimizer=\.\.\."):
        HybridEngine(model, RolloutLayout(1, 1))
    assert compat.ddp_param_buffers(model)[0].param_data.data_ptr() == ptr
    assert all(p.data_ptr() != 0 for p in model.parameters())
    engine = HybridEngine(model, RolloutLayout(1, 1), optimizer=optimizer)
    train_step(model, optimizer, 0)
    tokens = torch.randint(0, 60, (2, SEQ), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(SEQ).expand(2, -1)
    engine.switch_to_rollout()  # also completes the step's parameter all-gather
    with torch.no_grad():
        model.eval()
        train = gather_vocab(model(tokens, positions, None), ps.get_tensor_model_parallel_group()).float()
        rollout = engine.rollout_model(tokens, positions, None).float()
    sp = {"training": model.module.config.sequence_parallel, "rollout": engine.rollout_model.config.sequence_parallel}
    engine.switch_to_training()
    return {"train": train, "rollout": rollout, "sp": sp}


def memory_case(offload: bool) -> dict:
    """What is resident, by kind, with the distributed optimizer (bf16 parameters, fp32 main parameters): DDP's
    parameter buffer is the engine's own slot; the peers' slots only while rolling out; the optimizer's tensors
    and DDP's gradient buffer released while rolling out with ``offload``."""
    import ctypes
    import gc

    import psutil

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.megatron import compat
    from megatron_hybrid.memory import optimizer_tensors

    from tests.engine_cases import arch as engine_arch

    cfg = Config(bf16=True, sp=True)
    arch = engine_arch(hidden_size=512, ffn_hidden_size=1024, num_attention_heads=8, num_query_groups=4,
                       params_dtype="bfloat16")
    proc, libc = psutil.Process(), ctypes.CDLL("libc.so.6")

    def rss() -> int:
        gc.collect()
        libc.malloc_trim(0)
        return proc.memory_info().rss

    model, make_optimizer = build(cfg, arch, bucket_size=None)
    optimizer = make_optimizer()
    train_step(model, optimizer, 0)  # the optimizer's states exist from the first step on
    buffers = compat.ddp_param_buffers(model)
    param_bytes = sum(b.param_data.numel() * b.param_data.element_size() for b in buffers)
    old_ptrs = [b.param_data.data_ptr() for b in buffers]
    old = [b.param_data.untyped_storage() for b in buffers]
    before = rss()
    engine = HybridEngine(model, RolloutLayout(1, 1), bucket_size_mb=1, optimizer=optimizer)
    # DDP's own allocation is held by nothing but ``old`` here: it goes once we let go of it.
    old_users = [compat.storage_use_count(st) for st in old]
    del old
    growth = rss() - before
    engine.switch_to_rollout()  # warm-up: gloo's pairs and buffers are set up on first use
    engine.switch_to_training()
    train_step(model, optimizer, 1)
    spans = engine.placement.spans()

    def engine_rss() -> int:
        return resident_bytes_in(spans)

    def storages(tensors) -> int:
        return sum(t.untyped_storage().nbytes() for t in tensors)

    opt_tensors = optimizer_tensors(optimizer, keep=list(model.parameters()))
    grads = compat.ddp_grad_buffers(model)
    out = {"param_bytes": param_bytes, "optimizer_bytes": storages(opt_tensors), "grad_bytes": storages(grads),
           "moved_off_old": all(b.param_data.data_ptr() != p for b, p in zip(buffers, old_ptrs)),
           "inside": all(any(lo <= b.param_data.data_ptr() < hi for lo, hi in spans) for b in buffers),
           "old_users": old_users}
    out["training"] = {"engine_rss": engine_rss(), "process_growth": growth}
    engine.switch_to_rollout(offload_optimizer=optimizer if offload else None, offload_grads=offload)
    report = engine.communication_report()
    out["rollout"] = {"engine_rss": engine_rss(), "optimizer_device_bytes": storages(opt_tensors),
                      "grad_device_bytes": storages(grads), "peer_bytes": report["peer_bytes_mapped"],
                      "moved": report["total_bytes"]}
    engine.switch_to_training()
    out["back"] = {"engine_rss": engine_rss(), "optimizer_bytes": storages(opt_tensors),
                   "grad_bytes": storages(grads)}
    out["losses"] = train_step(model, optimizer, 2)
    return out


def world_rank() -> int:
    return dist.get_rank()
