"""Rank bodies for the engine tests (module-level so the harness can send them to its ranks)."""

from __future__ import annotations

import zlib
from typing import Optional

import torch
import torch.distributed as dist

SEQ, BATCH, LR = 12, 2, 0.1


def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 250, (BATCH, SEQ), generator=g)


def arch(**kw):
    from megatron_hybrid.megatron.models import tiny_llama

    return tiny_llama(**kw)


def seeded(name: str, shape, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + salt)
    return torch.randn(shape, generator=g)


def reference(arch_kw: dict, state=None):
    """World of one: the unsharded model. Makes the initial weights when ``state`` is None."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid.megatron.sharding import load_full_state_dict

    a = arch(**arch_kw)
    model = a.build()
    if state is None:
        state = {}
        for name, p in model.named_parameters():
            w = seeded(name, p.shape, 0) * 0.05
            if p.dim() == 1 and "bias" not in name:
                w = 1.0 + w  # norm weights near one
            state[name] = w.to(p.dtype)
    load_full_state_dict([model], state, tp_rank=0, tp_size=1)
    with torch.no_grad():
        logits = model(tokens(), torch.arange(SEQ).expand(BATCH, -1), None)
    del ps
    return state, logits.float()


def full_grads(state: dict) -> dict:
    return {n: (seeded(n, w.shape, 1) * 0.01).to(w.dtype) for n, w in state.items()}


def stepped(state: dict) -> dict:
    g = full_grads(state)
    return {n: torch.add(w, g[n], alpha=-LR) for n, w in state.items()}


def sgd_step(chunks, grads: dict) -> None:
    """One SGD step (``LR``) of a rank's training chunks, each parameter's gradient its shard of the full gradient
    ``grads`` (a tied output layer's: the embedding's)."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid.megatron.sharding import TPSpec, global_name, layer_offset, shard

    params = []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            key = global_name(name, layer_offset(chunk))
            if getattr(p, "shared_embedding", False) and name.startswith("output_layer"):
                key = "embedding.word_embeddings.weight"
            p.grad = shard(grads[key], TPSpec.of(p), ps.get_tensor_model_parallel_rank(),
                           ps.get_tensor_model_parallel_world_size()).to(p.dtype)
            params.append(p)
    torch.optim.SGD(params, lr=LR).step()


def _objects(obj, group) -> list:
    out = [None] * group.size()
    dist.all_gather_object(out, obj, group=group)
    return out


def rollout_full_weights(engine) -> dict:
    """Every rollout parameter as a full tensor, rebuilt here from what the rollout model computes with.

    Aliased parameters carry their blocks (views of the gather buffers); the canonical shard is the blocks
    stacked along partition_dim, re-interleaved by partition_stride (Megatron's [gate_r; up_r]).
    """
    from megatron_hybrid.megatron.sharding import TPSpec, global_name, layer_offset, unshard

    local = {}
    for chunk in engine.rollout_chunks:
        off = layer_offset(chunk)
        for name, p in chunk.named_parameters():
            if getattr(p, "shared_embedding", False) and name.startswith("output_layer"):
                continue
            blocks = engine.binding.table.get(p)
            if blocks is None:
                t = p.detach().cpu().clone()
            else:
                s = blocks.stride
                chunks = [v.chunk(s, dim=blocks.dim) for v in blocks.views]
                t = torch.cat([c[j] for j in range(s) for c in chunks], dim=blocks.dim).cpu()
            assert tuple(t.shape) == tuple(p.shape), (name, t.shape, p.shape)
            local[global_name(name, off)] = (t, TPSpec.of(p))
    parts = _objects(local, engine.groups["tp"])  # group rank j holds rollout TP shard j
    merged = {n: unshard([part[n][0] for part in parts], spec) for n, (_, spec) in local.items()}
    full = {}
    for stage in _objects(merged, engine.groups["pp"]):
        full.update(stage)
    return full


def rollout_addresses(engine) -> dict:
    """Where every rollout parameter's memory is: its storage address, or its blocks' addresses (aliased)."""
    return engine.binding.addresses()


def expected_missing_bytes(engine) -> int:
    """Rollout shard bytes minus the bytes of this rank's own training tensors that are part of it."""
    from megatron_hybrid.megatron.sharding import global_name, layer_offset

    rollout = {}
    for chunk in engine.rollout_chunks:
        off = layer_offset(chunk)
        for name, p in chunk.named_parameters():
            rollout[global_name(name, off)] = p.numel() * p.element_size()
    own = 0
    held = set()
    for chunk in engine.modules:
        off = layer_offset(chunk)
        for name, p in chunk.named_parameters():
            key = global_name(name, off)
            if key == "output_layer.weight" and getattr(p, "shared_embedding", False) \
                    and key not in rollout:
                # A tied output layer is a copy of the embedding (Megatron keeps them equal): a rank holding it
                # holds its share of the rollout embedding.
                key = "embedding.word_embeddings.weight"
            if key in rollout and key not in held:
                held.add(key)
                own += p.numel() * p.element_size()
    if engine.layout.widens:
        return 0
    return sum(rollout.values()) - own


def engine_case(arch_kw: dict, rollout_tp: int, rollout_pp: int, mode: str, state: dict, *, ddp: bool = False,
                bucket_size_mb: float = 0.01, align_slots: bool = False, own_region_min_numel: Optional[int] = None):
    """``own_region_min_numel``: the plan's size threshold for stacked and strided regions, lowered so that the
    tiny model's tensors get them."""
    if own_region_min_numel is not None:
        from megatron_hybrid.reshard import plan

        saved, plan.STACKED_MIN_NUMEL = plan.STACKED_MIN_NUMEL, own_region_min_numel
        try:
            return engine_case(arch_kw, rollout_tp, rollout_pp, mode, state, ddp=ddp, bucket_size_mb=bucket_size_mb,
                               align_slots=align_slots)
        finally:
            plan.STACKED_MIN_NUMEL = saved
    from megatron.core import parallel_state as ps

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.forward import gather_vocab, pipeline_forward
    from megatron_hybrid.megatron.sharding import full_state_dict

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    a = arch(**arch_kw)
    config = a.transformer_config(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model = a.build(config, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    from megatron_hybrid.megatron.sharding import load_full_state_dict

    load_full_state_dict([model], state, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp)
    if ddp:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    engine = HybridEngine(model, RolloutLayout(rollout_tp, rollout_pp), weight_mode=mode,
                          bucket_size_mb=bucket_size_mb, align_slots=align_slots)
    tok = tokens()
    pos = torch.arange(SEQ).expand(BATCH, -1)

    def observe():
        engine.switch_to_rollout()
        report = engine.communication_report()
        with torch.no_grad():
            logits = pipeline_forward(engine.rollout_model, engine.groups["pp"], tok, pos)
        if logits is not None:
            logits = gather_vocab(logits, engine.groups["tp"]).float()
        # The standard megatron-core way (parallel_output=False): the output layer all-gathers over its TP group in
        # group-rank order, so this is right only if group rank j holds vocabulary shard j. Every stage takes part.
        out = getattr(engine.rollout_model, "output_layer", None)
        if out is not None:
            out.gather_output = True
        try:
            with torch.no_grad():
                in_model = pipeline_forward(engine.rollout_model, engine.groups["pp"], tok, pos)
        finally:
            if out is not None:
                out.gather_output = False
        in_model = in_model.float() if in_model is not None else None
        weights = rollout_full_weights(engine)
        switches = engine.num_switches
        engine.switch_to_rollout()  # already rolling out: not a switch, moves nothing, keeps the report
        again = {"switches": engine.num_switches - switches,
                 "same_report": engine.communication_report() == report}
        engine.switch_to_training()
        return {"logits": logits, "in_model": in_model, "weights": weights, "bytes": report["total_bytes"],
                "resident": report["resident_peer_bytes"], "regions": report["num_collectives"],
                "again": again, "report": report, "addresses": rollout_addresses(engine)}

    first = observe()
    first["expected_bytes"] = expected_missing_bytes(engine)
    from megatron_hybrid.report import missing_bytes

    first["library_missing_bytes"] = missing_bytes(engine)  # what bench/reshard.py checks against
    first["strided"] = sorted(engine.plan.strided) if engine.plan is not None else []
    train_full = full_state_dict(engine.chunks, tp_group=ps.get_tensor_model_parallel_group(),
                                 pp_group=ps.get_pipeline_model_parallel_group())
    # An optimizer step on the training layout (gradients: this rank's shard of a known full gradient).
    sgd_step(engine.modules, full_grads(state))
    second = observe()
    return {"first": first, "second": second, "train_full": train_full}


def bad_inputs_case():
    """Each bad input must raise ValueError before the engine runs any collective."""
    import pytest
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_hybrid import HybridEngine, RolloutLayout

    def no_collective(*a, **k):
        raise AssertionError("a collective ran before the input was validated")

    tp = ps.get_tensor_model_parallel_world_size()
    model = arch().build(tensor_model_parallel_size=tp)
    saved = {n: getattr(dist, n) for n in ("all_gather_object", "new_group", "all_gather_into_tensor", "broadcast")}
    messages = []
    try:
        for n in saved:
            setattr(dist, n, no_collective)
        cases = [
            (dict(rollout=RolloutLayout(3, 1)), "rollout tensor_model_parallel_size (3) × rollout "
                                                "pipeline_model_parallel_size (1) = 3 must divide the world"),
            (dict(rollout=RolloutLayout(4, 2)), "= 8 must divide the world (2 × 1 × 2 = 4 ranks)"),
            (dict(rollout=RolloutLayout(1, 1), weight_mode="fast"), "weight_mode ('fast')"),
            (dict(rollout=RolloutLayout(1, 1), bucket_size_mb=0), "bucket_size_mb (0)"),
            (dict(rollout=(1, 1)), "must be a RolloutLayout"),
        ]
        for kwargs, expected in cases:
            with pytest.raises(ValueError) as err:
                HybridEngine(model, **kwargs)
            assert expected in str(err.value), (expected, str(err.value))
            messages.append(str(err.value))
        # A model built for another TP size than the groups describe.
        wrong = arch().transformer_config(tensor_model_parallel_size=1)
        with pytest.raises(ValueError, match="built for tensor/pipeline sizes"):
            HybridEngine(arch().build(wrong), rollout=RolloutLayout(1, 1))
        # Layers that the rollout stages cannot split (3 layers over p_g = 2: an exchange layout otherwise).
        with pytest.raises(ValueError, match=r"rollout pipeline_model_parallel_size \(2\) must divide num_layers "
                                             r"\(3\)"):
            HybridEngine(arch(num_layers=3).build(tensor_model_parallel_size=tp), rollout=RolloutLayout(1, 2))
        # What the rollout TP size cannot split (t=2 -> t_g=4 over DP, a widening layout): 6 heads, an FFN of 98,
        # 2 query groups; each a ValueError naming the size and the value.
        for arch_kw, expected in [
                (dict(num_attention_heads=6, num_query_groups=2),
                 "rollout tensor_model_parallel_size (4) must divide num_attention_heads (6)"),
                (dict(ffn_hidden_size=98), "rollout tensor_model_parallel_size (4) must divide ffn_hidden_size (98)"),
                (dict(num_query_groups=2), "rollout tensor_model_parallel_size (4) must divide num_query_groups (2)")]:
            with pytest.raises(ValueError) as err:
                HybridEngine(arch(**arch_kw).build(tensor_model_parallel_size=tp), rollout=RolloutLayout(4, 1))
            assert str(err.value) == expected, (expected, str(err.value))
            messages.append(str(err.value))
        # Aliased mode on a linear without a block-wise twin (standing for the Transformer Engine spec's linears):
        # refused, naming the parameter and its module.
        class OtherLinear(ColumnParallelLinear):
            pass

        other = arch().build(tensor_model_parallel_size=tp)
        other.decoder.layers[1].mlp.linear_fc1.__class__ = OtherLinear
        with pytest.raises(ValueError) as err:
            HybridEngine(other, rollout=RolloutLayout(1, 1))
        expected = ("weight_mode='aliased' cannot run decoder.layers.1.mlp.linear_fc1.weight (OtherLinear) on "
                    "blocks; use weight_mode='canonical' for this model")
        assert str(err.value) == expected, (expected, str(err.value))
        messages.append(str(err.value))
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    return messages


def context_parallel_case() -> str:
    """The engine on Megatron's groups with context parallelism (tp 1 × cp 2 on 2 ranks, so dp 1): refused by
    the layout check before any collective; returns the message."""
    import pytest
    from megatron.core import parallel_state as ps

    from megatron_hybrid import HybridEngine, RolloutLayout

    def no_collective(*a, **k):
        raise AssertionError("a collective ran before the input was validated")

    model = arch().build(tensor_model_parallel_size=1)  # before the groups change: the build reads the TP rank
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=2)
    saved = {n: getattr(dist, n) for n in ("all_gather_object", "new_group", "all_gather_into_tensor", "broadcast")}
    try:
        for n in saved:
            setattr(dist, n, no_collective)
        with pytest.raises(ValueError) as err:
            HybridEngine(model, rollout=RolloutLayout(1, 1))
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    return str(err.value)

def resident_bytes_in(spans: list[tuple[int, int]]) -> int:
    """Resident bytes (``/proc/self/smaps``) of the mappings that overlap the address ranges ``spans``."""
    total, current = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                current = any(lo < b_hi and b_lo < hi for b_lo, b_hi in spans)
            elif head == "Rss:" and current:
                total += int(line.split()[1]) * 1024
    return total


def memory_case(mode: str, rollout: tuple[int, int] = (1, 1)):
    """Resident memory while rolling out and after switching back, against the bytes the switch moved. ``rollout``:
    (t_g, p_g)."""
    import ctypes
    import gc

    import psutil
    from megatron.core import parallel_state as ps

    from megatron_hybrid import HybridEngine, RolloutLayout

    a = arch(hidden_size=512, ffn_hidden_size=1024, num_attention_heads=8, num_query_groups=4)
    model = a.build(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size())
    engine = HybridEngine(model, RolloutLayout(*rollout), weight_mode=mode, bucket_size_mb=1)
    proc = psutil.Process()
    libc = ctypes.CDLL("libc.so.6")

    def rss() -> int:
        # gloo stages collectives through temporaries that glibc keeps cached after free: hand them back first,
        # so that what is measured is what the engine holds.
        gc.collect()
        libc.malloc_trim(0)
        return proc.memory_info().rss

    def buffers_rss() -> int:
        """Resident bytes of the engine's reserved ranges alone (gather buffers and canonical tensors)."""
        return resident_bytes_in(engine.placement.spans())

    engine.switch_to_rollout()  # warm-up: gloo's own buffers and pairs are set up on first use
    engine.switch_to_training()
    # Three cycles; the test takes medians: glibc and gloo's threads move the process RSS by a few MB either way.
    out = {"base": [], "during": [], "after": [], "buf_base": [], "buf_during": [], "buf_after": []}
    for _ in range(3):
        out["base"].append(rss())
        out["buf_base"].append(buffers_rss())
        engine.switch_to_rollout()
        out["during"].append(rss())
        out["buf_during"].append(buffers_rss())
        report = engine.communication_report()
        engine.switch_to_training()
        out["after"].append(rss())
        out["buf_after"].append(buffers_rss())
    out.update(moved=report["total_bytes"], mapped=report["peer_bytes_mapped"],
               released=report["transient_bytes_released"], canonical=report["canonical_bytes_mapped"])
    # Which rollout weights are the gathered (own + peers') memory itself, with their byte counts.
    gather = [b.span() for b in engine.placement.buffers.values()]
    out["in_gather"] = {name: (p.numel() * p.element_size(), any(lo <= p.data_ptr() < hi for lo, hi in gather))
                        for name, p in engine.rollout_model.named_parameters() if p.numel() > 0}
    return out


def misuse_case():
    import pytest
    from megatron.core import parallel_state as ps

    from megatron_hybrid import HybridEngine, RolloutLayout

    model = arch().build(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size())
    engine = HybridEngine(model, RolloutLayout(1, 1))
    tok = tokens()
    pos = torch.arange(SEQ).expand(BATCH, -1)
    with pytest.raises(RuntimeError, match="used in training mode"):
        engine.rollout_model(tok, pos, None)
    with engine.rollout() as rollout_model:
        rollout_model(tok, pos, None)
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # training in rollout mode
        with pytest.raises(RuntimeError, match="changed while in rollout mode"):
            engine.switch_to_rollout()
    assert engine.mode == "training"


def chunks_case(state: dict, mode: str):
    """Virtual pipeline: a list of two model chunks per stage, t=2 × p=2 → t_g=1, p_g=2."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.megatron.sharding import full_state_dict, load_full_state_dict

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    a = arch()
    config = a.transformer_config(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  virtual_pipeline_model_parallel_size=2)
    chunks = []
    for vp in range(2):
        pre = ps.is_pipeline_first_stage(ignore_virtual=True) and vp == 0
        post = ps.is_pipeline_last_stage(ignore_virtual=True) and vp == 1
        chunks.append(a.build(config, pre_process=pre, post_process=post, vp_stage=vp))
    load_full_state_dict(chunks, state, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp)
    engine = HybridEngine(chunks, RolloutLayout(1, 2), weight_mode=mode)
    engine.switch_to_rollout()
    weights = rollout_full_weights(engine)
    out = {"weights": weights, "bytes": engine.communication_report()["total_bytes"],
           "expected": expected_missing_bytes(engine), "is_list": isinstance(engine.rollout_model, list)}
    engine.switch_to_training()
    out["train"] = full_state_dict(chunks, tp_group=ps.get_tensor_model_parallel_group(),
                                   pp_group=ps.get_pipeline_model_parallel_group())
    return out


def lifecycle_case():
    """Bind-once guards and detaching: what a user can do wrong with a rollout model bound for good."""
    import gc

    import pytest
    from megatron.core import parallel_state as ps

    from megatron_hybrid import HybridEngine, RolloutLayout

    tp = ps.get_tensor_model_parallel_world_size()
    out = {}
    tok, pos = tokens(), torch.arange(SEQ).expand(BATCH, -1)

    def build():
        torch.manual_seed(1234)  # the same weights on every build
        return arch().build(tensor_model_parallel_size=tp)

    def snapshot(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    # 1. While training, the rollout model's weights are not there: forward and state_dict refuse.
    model = build()
    before = snapshot(model)
    engine = HybridEngine(model, RolloutLayout(1, 1))
    with pytest.raises(RuntimeError, match="used in training mode"):
        engine.rollout_model.state_dict()
    with engine.rollout() as rollout_model:
        with torch.no_grad():
            out["rollout_logits"] = rollout_model(tok, pos, None)
        assert len(rollout_model.state_dict()) > 0
    # 2. Giving a training parameter new storage would leave the rollout model on the old one: refused.
    prm = next(model.parameters())
    old = prm.data
    prm.data = prm.data.clone()
    with pytest.raises(RuntimeError, match="new storage"):
        engine.switch_to_rollout()
    prm.data = old
    # 3. close(): the training model keeps its values in ordinary memory and still trains; the engine is done.
    engine.switch_to_rollout()
    engine.close()
    out["close_mode"] = engine.mode
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
        assert not hasattr(p, "_mh_keepalive"), n
    with pytest.raises(RuntimeError, match="closed"):
        engine.switch_to_rollout()
    with pytest.raises(RuntimeError, match="closed"):
        engine.rollout_model(tok, pos, None)
    model(tok, pos, None).float().sum().backward()
    # 4. Dropping the engine without close() while the model lives: the buffers stay with the parameters.
    model2 = build()
    engine2 = HybridEngine(model2, RolloutLayout(1, 1))
    engine2.switch_to_rollout()
    engine2.switch_to_training()
    del engine2
    gc.collect()
    for n, p in model2.named_parameters():
        assert torch.equal(p, before[n]), n
    with torch.no_grad():
        out["train_logits"] = model2(tok, pos, None)  # this rank's vocabulary shard
    out["tp_rank"] = ps.get_tensor_model_parallel_rank()
    return out


def stall_case(stall_s: float, timeout_s: float, inherit: bool):
    """Rank 1 stalls before a switch. The rollout groups' timeout (``timeout=`` or, with ``inherit``, the
    training groups' own) must make rank 0 fail within it instead of waiting for the stalled rank."""
    import datetime
    import time

    from megatron.core import parallel_state as ps

    from megatron_hybrid import HybridEngine, RolloutLayout

    model = arch().build(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size())
    if inherit:
        short = datetime.timedelta(seconds=timeout_s)
        world = list(range(dist.get_world_size()))
        tp = dist.new_group(world, timeout=short)
        singles = [dist.new_group([r], timeout=short) for r in world]
        one = singles[dist.get_rank()]
        engine = HybridEngine(model, RolloutLayout(1, 1), tp_group=tp, pp_group=one, dp_group=one)
    else:
        engine = HybridEngine(model, RolloutLayout(1, 1), timeout=timeout_s)
    if dist.get_rank() == 1:
        time.sleep(stall_s)
    start = time.monotonic()
    try:
        engine.switch_to_rollout()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return {"seconds": time.monotonic() - start, "error": error, "timeout": engine.timeout.total_seconds()}


FIDELITY_SEQ = 2100  # past 2,048 positions, where a rope-scaling mismatch shows


def fidelity_case(mode: str):
    """Every non-default GPTModel argument the rollout model must keep: rope scaling (factor 32, not GPTModel's
    default 8), rotary base and percent, a non-default head size, QK layernorm, QKV bias, tied embeddings.
    Returns the largest logit difference rollout vs training at positions ≥ 2,048, and the same difference for a
    rollout model whose rotary module was rebuilt from GPTModel's arguments (the bug this guards against)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.forward import gather_vocab

    a = arch(num_layers=2, max_position_embeddings=4096, use_rope_scaling=True, rope_scaling_factor=32.0,
             rotary_base=500000, rotary_percent=0.5, kv_channels=16, qk_layernorm=True, add_qkv_bias=True,
             untie_embeddings_and_output_weights=False, init_method_std=0.2)
    model = a.build(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size())
    g = torch.Generator().manual_seed(3)
    tok = torch.randint(0, 250, (1, FIDELITY_SEQ), generator=g)
    pos = torch.arange(FIDELITY_SEQ).unsqueeze(0)
    with torch.no_grad():
        train = gather_vocab(model(tok, pos, None), ps.get_tensor_model_parallel_group()).float()[:, 2048:]
    engine = HybridEngine(model, RolloutLayout(1, 1), weight_mode=mode)
    with engine.rollout() as rollout_model, torch.no_grad():
        ours = rollout_model(tok, pos, None).float()[:, 2048:]
        good = rollout_model.rotary_pos_emb
        rollout_model.rotary_pos_emb = RotaryEmbedding(kv_channels=16, rotary_percent=0.5, rotary_base=500000,
                                                       rope_scaling=True)  # factor: GPTModel's default 8
        rebuilt = rollout_model(tok, pos, None).float()[:, 2048:]
        rollout_model.rotary_pos_emb = good
    return {"diff": float((ours - train).abs().max()), "rebuilt_diff": float((rebuilt - train).abs().max()),
            "scale": float(train.abs().max())}


def rollout_memory_case():
    """``reserve_rollout_memory``: one fixed address range, backed exactly while rolling out."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid import HybridEngine, RolloutLayout

    model = arch().build(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size())
    engine = HybridEngine(model, RolloutLayout(1, 1))
    buf = engine.reserve_rollout_memory(3 * 2**16, torch.float32)
    ptr, seen = buf.data_ptr(), []
    for _ in range(2):
        seen.append(("training", buf.mapped_bytes, buf.data_ptr() == ptr))
        engine.switch_to_rollout()
        buf.tensor().fill_(1.5)
        seen.append(("rollout", buf.mapped_bytes, buf.data_ptr() == ptr,
                     engine.communication_report()["rollout_memory_bytes_mapped"]))
        engine.switch_to_training()
    late = engine.reserve_rollout_memory(10, torch.bfloat16)  # reserved while training: backed from the next switch
    engine.switch_to_rollout()
    late_mapped = late.is_mapped(0, late.numel)
    engine.switch_to_training()
    return {"seen": seen, "late_mapped": late_mapped, "nbytes": buf.numel * 4}


def rollout_memory_provider_case() -> dict:
    """The engine's rollout-memory provider: entering ``backed()`` switches to rollout (as a generate call does), and
    its reservations, one that grows while rolling out included, are backed until ``switch_to_training()``, then
    again from the next switch at the same addresses; a closed one is forgotten."""
    from megatron_hybrid import HybridEngine, RolloutLayout

    engine = HybridEngine(arch().build(), RolloutLayout(1, 1))
    memory = engine.rollout_memory
    fixed = memory.reserve(3 * 2**16, torch.float32)
    grows = memory.reserve(2**20, torch.uint8, grows=True)
    g = grows.memory.granularity_numel
    ptr = grows.tensor.data_ptr()
    out = {"nbytes": fixed.numel * 4, "grown": 2 * g, "training": (engine.mode, fixed.mapped_bytes, grows.mapped_bytes)}
    with memory.backed():
        out["in_call"] = (engine.mode, fixed.mapped_bytes)
        grows.extend(0, g)
        grows.extend(g, 2 * g)
        out["grown_in_call"] = grows.mapped_bytes
    out["after_call"] = (engine.mode, fixed.mapped_bytes, grows.mapped_bytes)
    engine.switch_to_training()
    out["training_again"] = (fixed.mapped_bytes, grows.mapped_bytes,
                             engine.placement.report()["rollout_memory_bytes_mapped"])
    engine.switch_to_rollout()
    out["next_rollout"] = (fixed.mapped_bytes, grows.mapped_bytes, grows.tensor.data_ptr() == ptr,
                           engine.communication_report()["rollout_memory_bytes_mapped"])
    grows.close()
    out["after_close"] = engine.placement.report()["rollout_memory_bytes_mapped"]
    engine.switch_to_training()
    engine.close()
    return out


def generate_stall_case(stall_s: float, timeout_s: float) -> dict:
    """Rank 1 stalls before ``generate``. Its agreement on the inputs (the first collective of a call) runs on the
    engine's groups, so rank 0 fails within the engine's timeout, naming it and the phase, instead of waiting
    for the stalled rank (or for the world group's timeout)."""
    import time

    from megatron.core import parallel_state as ps
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid import HybridEngine, RolloutLayout

    model = arch().build(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size())
    engine = HybridEngine(model, RolloutLayout(1, 1), timeout=timeout_s)
    if dist.get_rank() == 1:
        time.sleep(stall_s)
    start = time.monotonic()
    error = cause = None
    try:
        engine.generate([[1, 2, 3]], SamplingParams(top_k=1, num_tokens_to_generate=2), vocab_size=250)
    except RuntimeError as exc:
        error, cause = str(exc), repr(exc.__cause__)
    return {"seconds": time.monotonic() - start, "error": error, "cause": cause}


def second_engine_case() -> dict:
    """A second HybridEngine on a model that one serves is refused at construction, before any collective, naming
    the first; after ``close()`` (or once the first is gone) the second takes the model and computes with it."""
    import inspect

    import pytest
    from megatron.core import parallel_state as ps

    from megatron_hybrid import HybridEngine, RolloutLayout

    torch.manual_seed(1234)
    model = arch().build(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size())
    tok, pos = tokens(), torch.arange(SEQ).expand(BATCH, -1)
    first = HybridEngine(model, RolloutLayout(1, 1))
    line = inspect.currentframe().f_lineno - 1  # where the first engine was made
    with first.rollout() as rollout_model, torch.no_grad():
        reference = rollout_model(tok, pos, None)

    def no_collective(*a, **k):
        raise AssertionError("a collective ran before the second engine was refused")

    names = ("all_gather_object", "new_group", "all_gather_into_tensor", "broadcast", "all_reduce")
    saved = {n: getattr(dist, n) for n in names}
    messages = []
    try:
        for n in names:
            setattr(dist, n, no_collective)
        for again in (model, [model]):  # the same parameters, however the model is passed
            with pytest.raises(ValueError) as err:
                HybridEngine(again, RolloutLayout(1, 1), weight_mode="canonical")
            messages.append(str(err.value))
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    # The refusal left the first engine as it was.
    with first.rollout() as rollout_model, torch.no_grad():
        first_again = torch.equal(rollout_model(tok, pos, None), reference)
    first.close()
    second = HybridEngine(model, RolloutLayout(1, 1), weight_mode="canonical")
    with second.rollout() as rollout_model, torch.no_grad():
        after_close = rollout_model(tok, pos, None)
    # Dropped without close(): nothing refers to it any more (reference cycles aside; its rollout model would).
    del second, rollout_model
    third = HybridEngine(model, RolloutLayout(1, 1))
    with third.rollout() as rollout_model, torch.no_grad():
        after_drop = rollout_model(tok, pos, None)
    third.close()
    return {"messages": messages, "site": f"engine_cases.py:{line}", "first_again": first_again,
            "reference": reference, "after_close": after_close, "after_drop": after_drop}
