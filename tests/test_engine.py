"""The HybridEngine on CPU/gloo: exact resharding, logits, bytes and errors for every claimed layout."""

from __future__ import annotations

import functools

import pytest
import torch

from tests import engine_cases as cases
from tests.harness import run_distributed

# (t, p, d) -> (t_g, p_g)
LAYOUTS = [
    ((2, 1, 4), (1, 1)), ((4, 1, 2), (2, 1)), ((4, 1, 2), (1, 1)), ((8, 1, 1), (2, 1)), ((4, 2, 1), (2, 1)),
    ((4, 2, 1), (2, 2)), ((2, 2, 2), (1, 1)), ((2, 4, 1), (1, 2)), ((2, 1, 4), (4, 1)),
]


@functools.lru_cache(maxsize=None)
def _reference(arch_items: tuple):
    arch_kw = dict(arch_items)
    state, logits = run_distributed(cases.reference, 1, arch_kw)[0]
    new_state = cases.stepped(state)
    _, new_logits = run_distributed(cases.reference, 1, arch_kw, new_state)[0]
    return state, logits, new_state, new_logits


def _check(arch_kw: dict, layout, mode: str, *, logits_tol: dict, exact_bytes: bool = True, **kwargs):
    (t, p, d), (t_g, p_g) = layout
    state, logits, new_state, new_logits = _reference(tuple(sorted(arch_kw.items())))
    runs = run_distributed(cases.engine_case, t * p * d, arch_kw, t_g, p_g, mode, state,
                           tensor_model_parallel_size=t, pipeline_model_parallel_size=p, **kwargs)
    seen_logits = 0
    for rank, r in enumerate(runs):
        for phase, ref_state, ref_logits in (("first", state, logits), ("second", new_state, new_logits)):
            obs = r[phase]
            # Resharding is exact: the rollout weights are the training weights, bit for bit.
            assert obs["weights"].keys() == ref_state.keys()
            for name, w in ref_state.items():
                assert torch.equal(obs["weights"][name], w), (rank, phase, name)
            if exact_bytes:
                assert obs["bytes"] == r["first"]["expected_bytes"], (rank, phase, obs["bytes"])
            else:  # slots padded to a 4 KiB page: at most one page per slot of each collective
                pad = obs["regions"] * (t * p // (t_g * p_g)) * 4096
                assert r["first"]["expected_bytes"] <= obs["bytes"] <= r["first"]["expected_bytes"] + pad
                assert obs["resident"] == 0
            assert obs["again"] == {"switches": 0, "same_report": True}
            phases = obs["report"]["phases"]
            assert set(phases) == {"map_seconds", "collectives_seconds", "canonical_seconds", "offload_seconds",
                                   "sync_seconds"}
            assert 0 <= sum(phases.values()) <= obs["report"]["switch_seconds"] * 1.001 + 1e-6
            if obs["logits"] is not None:
                seen_logits += 1
                torch.testing.assert_close(obs["logits"], ref_logits, **logits_tol)
                # Gathered inside the model (parallel_output=False), the standard megatron-core way.
                torch.testing.assert_close(obs["in_model"], ref_logits, **logits_tol)
        for name, w in state.items():
            assert torch.equal(r["train_full"][name], w), (rank, name)
        # Bound once: every rollout parameter (and every block of an aliased one) sits at the same address
        # before and after the optimizer step, across switches.
        assert r["first"]["addresses"] == r["second"]["addresses"], rank
    assert seen_logits >= 2 * t_g
    assert all(r["first"]["library_missing_bytes"] == r["first"]["expected_bytes"] for r in runs)
    return runs
    if t_g > t:
        assert all(r["first"]["expected_bytes"] == 0 for r in runs)
    else:
        assert any(r["first"]["expected_bytes"] > 0 for r in runs)


# fp32: the rollout model sums the same products in a different order than the unsharded reference (TP splits
# the inner dimension of row-parallel matmuls and the all-reduce adds the partial sums): relative error ~1e-6.
FP32 = dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["aliased", "canonical"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"t{l[0][0]}p{l[0][1]}d{l[0][2]}-tg{l[1][0]}pg{l[1][1]}")
@pytest.mark.slow
def test_layouts(layout, mode):
    _check({}, layout, mode, logits_tol=FP32)


# Two layers (positions enter before the first) keep these cheap.
LEARNED_POSITIONS = {"position_embedding_type": "learned_absolute", "num_layers": 2}


@pytest.mark.parametrize("mode", ["aliased", "canonical"])
@pytest.mark.parametrize("layout", [((2, 1, 1), (1, 1)), ((2, 2, 1), (1, 1)), ((1, 1, 2), (2, 1))],
                         ids=["t2-tg1", "t2p2-tg1pg1", "t1d2-tg2"])
def test_learned_absolute_positions(layout, mode):
    # megatron-core's position table is a torch.nn.Embedding (it initialises itself in its constructor, unlike
    # megatron-core's own modules), replicated over TP and on the first stage only: narrowing TP, merging stages
    # (the table comes from training stage 0) and widening TP (a sub-block rank keeps the whole table).
    _check(LEARNED_POSITIONS, layout, mode, logits_tol=FP32)


def test_weightless_parameters_own_no_memory_even_where_constructors_initialise():
    """torch.nn's modules initialise the parameters they have just registered (torch.nn.Embedding: normal_, which
    a one-element expanded placeholder refuses); megatron-core's own modules skip that without
    perform_initialization. Either way every parameter ends up a placeholder of its shape, owning one element."""
    from megatron_hybrid.reshard.rollout_model import weightless_parameters

    class Own(torch.nn.Module):  # stands for a megatron-core module: registers, does not initialise
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(5, 3))

    with weightless_parameters():
        modules = [torch.nn.Embedding(7, 4), torch.nn.Linear(4, 6), torch.nn.LayerNorm(4), Own()]
    shapes = {(i, name): tuple(p.shape) for i, m in enumerate(modules) for name, p in m.named_parameters()}
    assert shapes == {(0, "weight"): (7, 4), (1, "weight"): (6, 4), (1, "bias"): (6,), (2, "weight"): (4,),
                      (2, "bias"): (4,), (3, "weight"): (5, 3)}
    for module in modules:
        for name, p in module.named_parameters():
            assert p.untyped_storage().nbytes() == p.element_size() and not p.requires_grad, (module, name)


@pytest.mark.parametrize("layout", [((2, 1, 4), (1, 1)), ((4, 1, 2), (2, 1)), ((4, 2, 1), (2, 2))],
                         ids=["t2p1d4-tg1", "t4p1d2-tg2", "t4p2d1-tg2pg2"])
@pytest.mark.slow
def test_canonical_own_regions(layout):
    # With the size threshold lowered, every dim-0 tensor gets a region of its own: QKV and the embeddings stacked,
    # SwiGLU's fc1 strided (gathered part by part straight into its rollout layout). Weights bit for bit, bytes
    # exactly the missing ones, logits as the unsharded model's.
    for aligned in (False, True):
        runs = _check({}, layout, "canonical", logits_tol=FP32, exact_bytes=not aligned, align_slots=aligned,
                      own_region_min_numel=0)
        layers = 4 // layout[1][1]  # the rollout stage's layers (tiny_llama has 4)
        assert all(len([n for n in r["first"]["strided"] if "linear_fc1" in n]) == layers for r in runs)


@pytest.mark.parametrize("layout", [((2, 2, 2), (1, 1)), ((4, 2, 1), (2, 2)), ((1, 2, 4), (1, 1)), ((1, 4, 2), (1, 1))],
                         ids=["t2p2d2-tg1", "t4p2-tg2pg2", "t1p2d4-pg1", "t1p4d2-pg1"])
@pytest.mark.slow
def test_tied_embeddings_qkv_bias(layout):
    # p_g < p with tied embeddings: the last stage's ranks hold the rollout embedding as their tied output layer,
    # so expected_missing_bytes counts it as held and the switch must not send it to them.
    _check({"untie_embeddings_and_output_weights": False, "add_qkv_bias": True}, layout, "aliased",
           logits_tol=FP32)


@pytest.mark.slow
def test_bf16_ddp():
    # bf16 weights, Megatron DDP wrapper. Weights: exact. Logits: bf16 matmuls round each partial sum to
    # 8 mantissa bits, so a different TP split differs by a few bf16 ulps of values ~0.5: 3e-2 absolute.
    _check({"params_dtype": "bfloat16"}, ((4, 1, 2), (2, 1)), "aliased", logits_tol=dict(rtol=0, atol=3e-2),
           ddp=True)


def test_bad_inputs_fail_before_any_collective():
    """Each a ValueError naming the sizes or the argument, before any collective (bad_inputs_case replaces them by
    a failure): layouts that do not divide the world, a bad weight mode, bucket size or layout object, what the
    rollout TP size cannot split (heads, FFN, query groups), and aliased mode on a linear without a block twin."""
    messages = run_distributed(cases.bad_inputs_case, 4, tensor_model_parallel_size=2)
    assert all(m == messages[0] for m in messages)  # the same on every rank
    assert len(messages[0]) == 9 and "OtherLinear" in messages[0][-1], messages[0]


def test_context_parallelism_is_refused_before_any_collective():
    """The reshard plan knows tensor, pipeline and data parallelism only: with a context-parallel group the
    training groups do not cover the world, a ValueError naming the sizes (tp 1 × cp 2: dp 1 on 2 ranks)."""
    for message in run_distributed(cases.context_parallel_case, 2):
        assert message == ("tensor (1) × pipeline (1) × data (1) parallel sizes must cover the world (2 ranks); "
                           "context/expert parallelism is not supported yet"), message


@pytest.mark.parametrize("mode", ["aliased", "canonical"])
@pytest.mark.slow
def test_extra_memory_is_the_peers_slots_only(mode):
    # ~10 MB of weights per rank at TP=2; rollout TP=1 receives the other half (19 MB). Canonical mode also holds
    # the rebuilt rollout shard while rolling out. Both must be given back at the switch to training.
    mib = 2**20
    for r in run_distributed(cases.memory_case, 2, mode, tensor_model_parallel_size=2):
        assert r["moved"] > 8 * mib
        if mode == "aliased":
            assert r["canonical"] < 2**16, r  # 1-D sharded tensors only (biases; none in this model)
            assert r["released"] == 0 and r["mapped"] >= r["moved"], r  # the rollout model views every peer slot
        else:
            # At 1 MiB buckets each layer's QKV shard (512 x 512 fp32, 1 MiB) fills a gather region alone, so the two
            # shards lie back to back in canonical order and the gathered region is the rollout QKV tensor: no
            # canonical copy, and its peer half stays mapped. Likewise any other dim-0 shard alone in its bucket.
            # SwiGLU's fc1 ([gate_j; up_j] per shard) is gathered part by part straight into its rollout layout: a
            # canonical tensor inside the gather buffer, with no peers' slot.
            inside = {n: b for n, (b, inside) in r["in_gather"].items() if inside and "layernorm" not in n}
            strided = {n: b for n, b in inside.items() if "linear_fc1.weight" in n}
            stacked = {n: b for n, b in inside.items() if n not in strided}
            assert len(strided) == 4 and sum("linear_qkv.weight" in n for n in stacked) == 4, sorted(inside)
            peer_half = sum(stacked.values()) // 2  # t = 2 → t_g = 1: half of each is the peer's
            assert r["mapped"] == peer_half, r
            assert r["canonical"] >= 2 * (r["moved"] - peer_half), r  # the rest of the model, whole (t_g = 1)
            # The other gathered shards were read once into the canonical tensors and given back before the
            # switch returned.
            assert r["released"] >= r["moved"] - peer_half - sum(strided.values()) // 2, r
        med = {k: sorted(v)[1] for k, v in r.items() if isinstance(v, list)}
        # The engine's own ranges, read from /proc/self/smaps: exactly what stays mapped (4 MiB of slack: pages at
        # range ends, and huge pages should a kernel run with transparent huge pages "always"); after the switch
        # back, the own slots.
        grown = med["buf_during"] - med["buf_base"]
        assert r["mapped"] + r["canonical"] - 4 * mib <= grown <= r["mapped"] + r["canonical"] + 4 * mib, r
        assert med["buf_after"] - med["buf_base"] <= 4 * mib, r
        # The whole process (medians of three cycles; glibc and gloo threads move RSS by a few MB): at most the
        # peers' slots (+ canonical) plus one 1 MB bucket of gloo staging plus 4 MB, and back down afterwards.
        # No lower bound on the whole process: its other pages move by a few MB either way (a CI run saw 17.3 MB of
        # growth for 19.4 MB mapped), and residency is already measured exactly by the smaps check above.
        assert med["during"] - med["base"] <= r["mapped"] + r["canonical"] + mib + 4 * mib, r
        assert med["after"] - med["base"] <= 0.25 * r["moved"], r


@pytest.mark.parametrize("mode", ["aliased", "canonical"])
@pytest.mark.slow
def test_memory_exchange_layout(mode):
    """An exchange layout (t = 2 → t_g = 1 with p_g = 2: TP down, PP up): the training tensors never move, the
    received pieces are the only rollout memory in aliased mode (views of them and of the own shards, no second copy
    of an own byte), and everything is given back after the switch back (smaps of the engine's ranges)."""
    mib = 2**20
    for r in run_distributed(cases.memory_case, 2, mode, (1, 2), tensor_model_parallel_size=2):
        assert r["moved"] > 4 * mib
        if mode == "aliased":
            assert r["canonical"] < 2**16 and r["released"] == 0, r  # 1-D sharded tensors only (none here)
            assert r["moved"] <= r["mapped"] <= r["moved"] + 4096, r  # the receive buffer, to a page
            # Every rollout weight is a view of an own training tensor or of the receive buffer.
        else:
            assert r["released"] >= r["moved"] - 4096 * 64, r  # pieces read once into canonical tensors
        med = {k: sorted(v)[1] for k, v in r.items() if isinstance(v, list)}
        grown = med["buf_during"] - med["buf_base"]
        assert r["mapped"] + r["canonical"] - 4 * mib <= grown <= r["mapped"] + r["canonical"] + 4 * mib, r
        assert med["buf_base"] == 0 and med["buf_after"] <= 4 * mib, r
        assert med["during"] - med["base"] <= r["mapped"] + r["canonical"] + 4 * mib, r
        assert med["after"] - med["base"] <= 0.25 * r["moved"], r


@pytest.mark.parametrize("mode", ["aliased", "canonical"])
@pytest.mark.slow
def test_virtual_pipeline_chunks(mode):
    state = _reference(())[0]
    runs = run_distributed(cases.chunks_case, 4, state, mode, tensor_model_parallel_size=2,
                           pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    for r in runs:
        assert r["is_list"] and r["bytes"] == r["expected"] > 0
        for name, w in state.items():
            assert torch.equal(r["weights"][name], w), name
            assert torch.equal(r["train"][name], w), name


@pytest.mark.slow
def test_aligned_slots():
    _check({}, ((2, 2, 2), (1, 1)), "aliased", logits_tol=FP32, exact_bytes=False, align_slots=True)


def test_bound_once_lifecycle():
    runs = run_distributed(cases.lifecycle_case, 2, tensor_model_parallel_size=2)
    for r in runs:
        assert r["close_mode"] == "closed"
    # The model that outlived its engine computes what the engine's rollout model computed (same weights; TP=2
    # vs TP=1 sums in another order: fp32 tolerance as in the layout tests). Training logits are a vocabulary
    # shard of the rollout model's (t_g = 1: whole vocabulary).
    for r in runs:
        n = r["train_logits"].shape[-1]
        full = r["rollout_logits"].float()[..., r["tp_rank"] * n: (r["tp_rank"] + 1) * n]
        torch.testing.assert_close(r["train_logits"].float(), full, **FP32)


@pytest.mark.parametrize("inherit", [False, True], ids=["timeout-argument", "training-groups-timeout"])
@pytest.mark.slow
def test_stalled_rank_fails_the_others_within_the_timeout(inherit):
    stall, timeout = 20.0, 3.0
    first, _ = run_distributed(cases.stall_case, 2, stall, timeout, inherit, tensor_model_parallel_size=2)
    assert first["timeout"] == timeout
    # Rank 0 gives up after about the timeout (gloo's own bookkeeping adds a little), long before rank 1 wakes.
    assert first["error"] is not None and first["seconds"] < stall / 2, first
    # Naming the phase, the collective and the timeout (gloo's message names none of them).
    assert "switch_to_rollout: the all_gather_into_tensor over ranks [0, 1] timed out after 3 s (HybridEngine " \
        "timeout)" in first["error"], first


def test_constructor_errors_name_the_argument():
    """Raised before anything distributed happens (no process group is needed to see them)."""
    from megatron_hybrid import HybridEngine, RolloutLayout

    with pytest.raises(ValueError, match=r"rollout tensor_model_parallel_size \(True\) must be a positive integer"):
        RolloutLayout(True, 1)
    with pytest.raises(ValueError, match=r"rollout pipeline_model_parallel_size \(1.0\) must be a positive integer"):
        RolloutLayout(1, 1.0)
    model = None  # these are checked before the model
    with pytest.raises(ValueError, match=r"bucket_size_mb \('64'\) must be a positive number of MiB"):
        HybridEngine(model, RolloutLayout(1, 1), bucket_size_mb="64")
    with pytest.raises(ValueError, match=r"bucket_size_mb \(nan\)"):
        HybridEngine(model, RolloutLayout(1, 1), bucket_size_mb=float("nan"))
    with pytest.raises(ValueError, match=r"model \(Linear\) must be a megatron-core model"):
        HybridEngine(torch.nn.Linear(2, 2), RolloutLayout(1, 1))
    with pytest.raises(ValueError, match=r"align_slots \('yes'\) must be True or False"):
        HybridEngine(model, RolloutLayout(1, 1), align_slots="yes")
    with pytest.raises(ValueError, match=r"timeout \(-1\) must be a positive"):
        HybridEngine(model, RolloutLayout(1, 1), timeout=-1)


@pytest.mark.parametrize("mode", ["aliased", "canonical"])
@pytest.mark.slow
def test_rollout_model_keeps_every_gpt_argument(mode):
    for r in run_distributed(cases.fidelity_case, 2, mode, tensor_model_parallel_size=2):
        # fp32 over 2,100 positions, TP=2 vs TP=1 summation orders: ~1e-6 relative; the bug (rotary frequencies
        # rebuilt with rope_scaling_factor 8 instead of 32) moves logits by a sizeable fraction of their scale.
        assert r["diff"] <= 1e-4 * max(1.0, r["scale"]), r
        assert r["rebuilt_diff"] > 100 * max(r["diff"], 1e-6), r


def test_rollout_memory_is_backed_only_while_rolling_out():
    for r in run_distributed(cases.rollout_memory_case, 2, tensor_model_parallel_size=2):
        for entry in r["seen"]:
            if entry[0] == "training":
                assert entry[1] == 0 and entry[2], r
            else:
                assert entry[1] >= r["nbytes"] and entry[2] and entry[3] >= r["nbytes"], r
        assert r["late_mapped"]


def test_engine_rollout_memory_provider_backs_between_switches():
    r = run_distributed(cases.rollout_memory_provider_case, 1)[0]
    assert r["training"] == ("training", 0, 0), r
    assert r["in_call"] == ("rollout", r["nbytes"]) and r["grown_in_call"] == r["grown"], r
    assert r["after_call"] == ("rollout", r["nbytes"], r["grown"]), r  # the engine stays rolling out
    assert r["training_again"] == (0, 0, 0), r
    assert r["next_rollout"] == (r["nbytes"], r["grown"], True, r["nbytes"] + r["grown"]), r
    assert r["after_close"] == r["nbytes"], r


@pytest.mark.slow
def test_generate_fails_within_the_engine_timeout():
    # The agreement on generate()'s inputs is the call's first collective: on the engine's world-sized group, with
    # the engine's timeout (3 s), not on the world group (300 s in the test harness).
    stall, timeout = 6.0, 3.0
    first, second = run_distributed(cases.generate_stall_case, 2, stall, timeout, tensor_model_parallel_size=2)
    assert first["error"] is not None and first["seconds"] < timeout + 2, first
    assert "generate: the ranks' agreement on the inputs timed out after 3 s (HybridEngine timeout)" \
        in first["error"], first
    assert "Timed out" in first["cause"], first  # gloo's own error, chained
    # The stalled rank, once awake, finds its peer gone: an error too, not a hang.
    assert second["error"] is not None and "generate: the ranks' agreement on the inputs" in second["error"], second


def test_second_engine_on_a_model_is_refused_until_the_first_is_closed():
    r = run_distributed(cases.second_engine_case, 1)[0]
    for message in r["messages"]:
        assert "already served by a HybridEngine" in message and r["site"] in message, message
        assert "close()" in message, message
    assert r["first_again"]
    # The same weights through each later engine (aliased and canonical at TP=1: the same sums, bit for bit).
    assert torch.equal(r["after_close"], r["reference"]) and torch.equal(r["after_drop"], r["reference"])
