"""KV-cache generation (megatron_hybrid.inference) on CPU/gloo, against the training-layout model.

Greedy tokens must equal a full-recompute greedy decoding of the training-layout model (independent code in
tests/inference_cases.py); log-probs must equal a teacher-forced training-layout forward over the generated
sequences. Sampling is checked for reproducibility, for agreement between the ranks of a replica and, with a
chi-square goodness-of-fit test, for following the model's softmax.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests import engine_cases, inference_cases as cases
from tests.harness import run_distributed

# fp32 log-probs: the cached path (SDPA, per-token rotary) and the training forward (megatron-core's core attention,
# other TP splits) sum in different orders; differences seen are <= 1e-6, so 1e-5 still catches any real error.
LOGP_ATOL = 1e-5


@pytest.fixture(scope="module")
def state() -> dict:
    return run_distributed(engine_cases.reference, 1, {})[0][0]


def _stop_tokens(state: dict, arch_kw: dict) -> list[int]:
    """Stop tokens that greedy decoding reaches mid-sequence: in each probe continuation, the first token at step
    16 or later that it had not produced before (first three such)."""
    probe = run_distributed(cases.stop_probe, 1, state, [0, 1], 6, arch_kw)[0]
    found = []
    for seq in probe:
        late = [tok for tok in seq[16:] if tok not in seq[:16]]
        if late and late[0] not in found:
            found.append(late[0])
    assert len(found) >= 2, probe
    return found[:3]


@pytest.fixture(scope="module")
def stops(state) -> list[int]:
    return _stop_tokens(state, {})


# (t, p, d) -> (t_g, p_g), weight mode, prompts per training rank, decode slots, mixed_prefill_tokens: every rollout
# replica gets 3x as many prompts as it has slots. With 64, a refill of one prompt (1-60 tokens) rides along a decode
# step and the first fill, or a refill of two long prompts, is a prefill of its own: both paths run.
LAYOUTS = [
    ((2, 1, 2), (1, 1), "aliased", 12, 2, None),     # t_g < t, micro-DP of 2
    ((2, 2, 1), (1, 2), "canonical", 12, 2, 64),     # p_g > 1, t_g < t
    ((2, 2, 1), (1, 1), "aliased", 24, 2, None),     # p_g < p, micro-DP of 4
    ((2, 1, 2), (4, 1), "aliased", 6, 4, 64),        # t_g > t: one rollout replica serves both training replicas
    ((2, 1, 2), (4, 1), "canonical", 6, 4, None),
]


def _layout_id(v) -> str:
    return f"t{v[0][0]}p{v[0][1]}d{v[0][2]}-tg{v[1][0]}pg{v[1][1]}-{v[2]}{'-mixed' if v[5] else ''}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
@pytest.mark.slow
def test_greedy_matches_training_layout(layout, state, stops):
    _check_greedy(layout, state, stops, {})


# Two layers (positions enter before the first) keep the full-recompute reference cheap.
LEARNED_POSITIONS = {"position_embedding_type": "learned_absolute", "num_layers": 2}


@pytest.fixture(scope="module")
def learned_state_and_stops() -> tuple[dict, list[int]]:
    state = run_distributed(engine_cases.reference, 1, LEARNED_POSITIONS)[0][0]
    return state, _stop_tokens(state, LEARNED_POSITIONS)


# Learned absolute positions: each token's embedding reads the position table (first stage only) at its own
# position, so a prefill, a decode step or a prompt riding along one (mixed) at a wrong position changes the
# greedy tokens. t_g < t and t_g > t (with mixed steps), one of each weight mode, on 2 ranks.
@pytest.mark.parametrize("layout", [((2, 1, 1), (1, 1), "canonical", 12, 2, None),
                                    ((1, 1, 2), (2, 1), "aliased", 6, 4, 64)], ids=_layout_id)
@pytest.mark.slow
def test_greedy_matches_training_layout_with_learned_positions(layout, learned_state_and_stops):
    _check_greedy(layout, *learned_state_and_stops, LEARNED_POSITIONS)


# The fused decoder step (SwiGLU in one kernel, residual add + RMSNorm in one; off by default on the CPU, where its
# kernels' PyTorch formulas run): the same greedy tokens, and log-probs within LOGP_ATOL, on a pipeline of two
# rollout stages (the first hands on the residual stream, the last ends with the final norm) and at t_g > t
# (row-parallel linears all-reduce inside the fused layer).
@pytest.mark.parametrize("layout", [LAYOUTS[1], LAYOUTS[3]], ids=_layout_id)
@pytest.mark.slow
def test_fused_decoder_matches_training_layout(layout, state, stops):
    runs = _check_greedy(layout, state, stops, {}, {"fused_decoder": True})
    assert all(r["report"]["fused_decoder"] for r in runs)


# linear_qkv with a bias (Qwen2's): in a mixed step the rotary kernel adds the bias, which the linear then skips
# (its PyTorch reference on the CPU, the kernel on a GPU); two layers keep the reference cheap.
QKV_BIAS = {"add_qkv_bias": True, "num_layers": 2}


@pytest.mark.slow
def test_greedy_matches_training_layout_with_qkv_bias():
    state = run_distributed(engine_cases.reference, 1, QKV_BIAS)[0][0]
    _check_greedy(LAYOUTS[1], state, _stop_tokens(state, QKV_BIAS), QKV_BIAS)


def _check_greedy(layout, state: dict, stops: list[int], arch_kw: dict, config_kw: dict | None = None) -> list:
    (t, p, d), (t_g, p_g), mode, count, slots, mixed = layout
    runs = run_distributed(cases.layout_case, t * p * d, t_g, p_g, mode, state, stops, count, slots, mixed,
                           arch_kw, config_kw, tensor_model_parallel_size=t, pipeline_model_parallel_size=p)
    lengths = []
    for r in runs:
        # Every training rank gets its own prompts' results, in order, with the training layout's tokens.
        assert r["result_prompts"] == r["prompts"] == cases.prompts_for(r["dp"], count)
        assert r["generated"] == r["reference"]
        for gen, logp in zip(r["generated"], r["log_probs"]):
            assert len(logp) == len(gen)
            assert all(tok not in stops for tok in gen[:-1])
            assert len(gen) == cases.NEW_TOKENS or gen[-1] in stops
        if r["teacher_forced"] is not None:
            for logp, ref in zip(r["log_probs"], r["teacher_forced"]):
                torch.testing.assert_close(torch.tensor(logp), torch.tensor(ref), rtol=0, atol=LOGP_ATOL)
        # Continuous batching: more prompts than slots, and no decode step ran with a free slot while one waited.
        rep = r["report"]
        assert rep["idle_slot_steps"] == 0 and rep["max_active_slots"] == slots == rep["kv_cache_slots"]
        assert rep["prefill_forwards"] > 0 and (mixed or rep["mixed_steps"] == 0)  # mixed steps: off on the CPU
        lengths += [len(g) for g in r["generated"]]
    # Where asked for, refills rode along decode steps (on the replicas where a sequence ended before another), and
    # the last sequences moved to low slots.
    assert (sum(r["report"]["mixed_steps"] for r in runs) > 0) == bool(mixed)
    assert (sum(r["report"]["slot_moves"] for r in runs) > 0) == bool(mixed)
    # Stop tokens ended some sequences mid-batch while others ran to num_tokens_to_generate.
    assert min(lengths) < cases.NEW_TOKENS == max(lengths)
    assert max(len(x) for r in runs for x in r["prompts"]) - min(len(x) for r in runs for x in r["prompts"]) >= 40
    assert all(r["report"]["fused_decoder"] == bool((config_kw or {}).get("fused_decoder")) for r in runs)
    return runs


def _chi_square_p_value(counts: list[int], probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit over the tokens of positive probability; the p-value is the
    regularised upper incomplete gamma function Q(df / 2, X² / 2)."""
    counts_t = torch.tensor(counts, dtype=torch.float64)
    support = probs > 0
    expected = probs[support] * counts_t.sum()
    assert expected.min() >= 5, expected  # the chi-square approximation needs >= 5 expected per cell
    stat = ((counts_t[support] - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _expected(logits: list[float], temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The sampling distribution, written out independently: temperature, top-k, then the smallest set of the
    most likely tokens whose mass reaches top_p."""
    x = torch.tensor(logits, dtype=torch.float64) / temperature
    order = sorted(range(len(logits)), key=lambda i: -x[i])
    keep = order[:top_k] if top_k > 0 else order
    if 0 < top_p < 1:
        p = torch.softmax(x[keep], 0)
        mass, cut = 0.0, []
        for i, pi in zip(keep, p.tolist()):
            if mass >= top_p:
                break
            cut.append(i)
            mass += pi
        keep = cut
    out = torch.zeros(len(logits), dtype=torch.float64)
    out[keep] = torch.softmax(x[keep], 0)
    return out


@pytest.mark.slow
def test_sampling_is_seeded_shared_and_follows_the_softmax(state):
    num_samples = 4000
    runs = run_distributed(cases.sampling_case, 2, 2, state, num_samples, tensor_model_parallel_size=2)
    a, b = runs
    # Fixed seed: the same samples on every run; another seed: others. Both TP ranks of the replica agree.
    assert a["runs"][0] == a["runs"][1] != a["runs"][2]
    assert a["runs"] == b["runs"] and a["counts"] == b["counts"]
    logits = a["logits"] if a["logits"] is not None else b["logits"]
    for name, (temperature, top_k, top_p) in a["settings"].items():
        probs = _expected(logits, temperature, top_k, top_p)
        counts = a["counts"][name]
        assert sum(counts) == num_samples
        assert all(c == 0 for c, q in zip(counts, probs) if q == 0), (name, counts, probs)  # cut tokens never drawn
        # Threshold: p-value 1e-6, so a correct sampler fails each check with probability 1e-6 (both: 2e-6),
        # while a sampler off by 0.05 in one token's probability gives X² in the hundreds (p ~ 0) at 4000 draws.
        p_value = _chi_square_p_value(counts, probs)
        assert p_value > 1e-6, (name, counts, (probs * num_samples).tolist(), p_value)


def test_tempered_log_probs_match_training_layout_at_the_temperature(state):
    temperature = 0.7
    # Training PP=2, rollout PP=1 (the cross-stage gather); the training-layout generation shares the last stage's
    # log-probs, both columns, with the first.
    runs = run_distributed(cases.tempered_case, 2, state, temperature, pipeline_model_parallel_size=2)
    for r in runs:
        rollout, plain = r["rollout"], r["untempered_only"]
        # Asking for them changes no token, and the untempered log-probs stay as they were.
        assert rollout["generated"] == plain["generated"] and rollout["untempered"] == plain["untempered"]
        assert all(t == [] for t in plain["tempered"])
        for name in ("rollout", "training_layout"):
            run = r[name]
            assert [len(t) for t in run["tempered"]] == [len(g) for g in run["generated"]]
            if run["teacher_tempered"] is None:
                continue
            # LOGP_ATOL: dividing by T = 0.7 scales the logits' rounding differences by 1.4 only; seen: <= 1e-6
            # (tempered and untempered alike, both layouts).
            for key in ("tempered", "untempered"):
                for logp, ref in zip(run[key], run["teacher_" + key]):
                    torch.testing.assert_close(torch.tensor(logp), torch.tensor(ref), rtol=0, atol=LOGP_ATOL)
            # And they are really tempered: at T = 0.7 they differ from the untempered ones by far more.
            gap = max(abs(a - b) for t, u in zip(run["tempered"], run["untempered"]) for a, b in zip(t, u))
            assert gap > 100 * LOGP_ATOL, gap


def test_bad_input_raises_on_every_rank(state):
    runs = run_distributed(cases.bad_input_case, 4, state, tensor_model_parallel_size=2)
    expected = {
        "empty": "prompt 2 (rank 3) is empty",
        "too_large": f"prompt 1 (rank 3): token 1 is {cases.VOCAB}, outside the vocabulary [0, {cases.VOCAB})",
        "negative": "prompt 0 (rank 3): token 1 is -1, outside the vocabulary [0, 256)",
        "vocab_zero": "vocab_size (0) must be between 1 and the output layer's padded vocabulary (256)",
        "vocab_above_padded": "vocab_size (300) must be between 1 and the output layer's padded vocabulary (256)",
        "too_long": (f"prompt 0 (rank 3) has {cases.MAX_LEN - 4} tokens; with num_tokens_to_generate=8 it needs "
                     f"{cases.MAX_LEN + 4} positions, more than a sequence may take in the KV cache "
                     f"(max_sequence_length={cases.MAX_LEN})"),
    }
    for r in runs:
        for name, text in expected.items():
            assert r["messages"][name] is not None and text in r["messages"][name], (name, r["messages"][name])
        assert r["ok"] == [8, 8]  # the engine still generates after the refused calls


def test_kv_cache_keeps_its_address_and_leaves_no_memory_while_training(state):
    r = run_distributed(cases.memory_case, 1, state)[0]
    first, second = r["runs"]
    assert first["address"] == second["address"] != 0
    assert first["mapped_after"] == second["mapped_after"] == 0 < first["bytes"]
    assert first["tokens"] == second["tokens"]


def test_scheduler_fills_free_slots_before_each_step():
    from megatron_hybrid.inference.scheduler import SlotScheduler

    sched = SlotScheduler(5, 2)
    assert sched.admit() == [(0, 0), (1, 1)] and sched.decode_batch() == 2
    sched.finish(0)
    assert sched.admit() == [(2, 0)]
    sched.finish(1)
    sched.finish(2)
    assert sched.admit() == [(3, 0), (4, 1)]
    sched.finish(3)
    assert sched.admit() == [] and sched.decode_batch() == 2 and sched.active() == [(1, 4)]
    sched.finish(4)
    assert sched.done and sched.idle_slot_steps == 0 and sched.decode_steps == 2


def test_scheduler_compacts_into_the_lowest_free_slots():
    from megatron_hybrid.inference.scheduler import SlotScheduler

    sched = SlotScheduler(6, 6)
    sched.admit()
    for seq in (0, 2, 3):
        sched.finish(seq)
    assert sched.extent() == 6 and sched.active() == [(1, 1), (4, 4), (5, 5)]
    # Into slots 0 and 2, lowest first; the sequence below the extent stays where it is.
    assert sched.compact(4) == [(4, 0), (5, 2)]
    assert sched.active() == [(0, 4), (1, 1), (2, 5)] and sched.extent() == 3
    assert sched.slot_of == {4: 0, 1: 1, 5: 2} and sched.compact(3) == []
    sched.finish(5)
    assert sched.extent() == 2


def test_kv_cache_moves_slots_in_every_layer():
    from megatron_hybrid.inference.kv_cache import CacheGeometry, KVCache

    g = CacheGeometry(num_layers=3, num_slots=4, slot_tokens=8, kv_heads=2, head_dim=4, dtype=torch.float32,
                      spare_slots=1)
    cache = KVCache(g, torch.device("cpu"))
    with cache.backed():
        for t in (*cache.keys, *cache.values):
            t.copy_(torch.randn(t.shape))
        before = [t.clone() for t in (*cache.keys, *cache.values)]
        cache.move_slots(torch.tensor([3, 2]), torch.tensor([0, 1]), 5)
        for old, new in zip(before, (*cache.keys, *cache.values)):
            expected = old.clone()
            expected[0, :, :5], expected[1, :, :5] = old[3, :, :5], old[2, :, :5]  # the rest stays as it was
            assert torch.equal(new, expected)
    cache.close()


def test_prefill_groups_fit_a_graph_once_padded():
    # With graphs, a prefill group is a rectangle: rows (exact up to 8, then whole eights) x the longest prompt
    # rounded up to the granule (16), at most 2 x prefill_tokens padded tokens and prefill_rows rows; the cut, by
    # length, minimises the padded tokens plus _PREFILL_FORWARD_TOKENS (384) per forward.
    import dataclasses

    from megatron_hybrid.inference.planner import PlannerSettings, StepPlanner
    from megatron_hybrid.inference.replica import _PREFILL_FORWARD_TOKENS

    assert _PREFILL_FORWARD_TOKENS == 384  # the hand-computed costs below
    # The grouping alone: no model, no cache. prefill_graph_tokens: 2 x the staging's prefill_tokens.
    settings = PlannerSettings(num_slots=8, slot_tokens=128, prefill_tokens=40, batch_sizes=(8,), prefill_granule=16,
                               prefill_rows=8, prefill_graph_tokens=80)

    def groups(prompts):
        cut = StepPlanner(settings).prefill_groups([(seq, seq) for seq in range(len(prompts))], prompts)
        return [[seq for seq, _ in g] for g in cut]

    # Seven 1-token prompts and one of 33 hold 40 real tokens, one forward by tokens alone (as without graphs),
    # but 8 x 48 padded: that group was an eager prefill. Graph groups: at most 80 padded tokens, so five 1s
    # (5 x 16), two 1s (with the 33: 3 x 48 = 144), then the 33.
    prompts = [[5] * 33] + [[1]] * 7
    assert groups(prompts) == [list(range(8))]
    settings = dataclasses.replace(settings, graphs=True)
    assert groups(prompts) == [[1, 2, 3, 4, 5], [6, 7], [0]]
    # Eight prompts of 16 tokens and eight of 96 (odd and even sequences): one forward of 16 x 96 = 1536 padded
    # tokens costs 1920, two forwards of 8 x 16 and 8 x 96 cost 128 + 768 + 2 x 384 = 1664.
    settings = dataclasses.replace(settings, prefill_tokens=1000, prefill_rows=16, prefill_graph_tokens=2000)
    prompts = [[2] * 96, [3] * 16] * 8
    assert groups(prompts) == [list(range(1, 16, 2)), list(range(0, 16, 2))]
    # A prompt longer than any graph goes alone (an eager prefill); the others still fit graphs.
    settings = dataclasses.replace(settings, prefill_graph_tokens=80)
    prompts = [[4] * 100, [1], [1]]
    cut = groups(prompts)
    planner = StepPlanner(settings)
    assert cut == [[1, 2], [0]] and not planner.prefill_graph_fits(*planner.prefill_shape(1, 100))


def test_synchronizing_calls_counted_by_line():
    # torch's sync debug mode warns "called a synchronizing CUDA operation" at each one (no CUDA here, so the
    # warnings are made by hand): counted by the line that made them, other warnings left out, fn's result kept.
    import inspect
    import warnings

    from megatron_hybrid.inference.host_syncs import synchronizing_calls

    def fn():
        for _ in range(2):
            warnings.warn("called a synchronizing CUDA operation (Triggered internally at Copy.cu)", UserWarning)
        warnings.warn("an unrelated warning", UserWarning)
        return 7

    line = inspect.getsourcelines(fn)[1] + 2
    result, where = synchronizing_calls(fn)
    assert result == 7 and dict(where) == {f"test_inference.py:{line}": 2}


def test_rotary_embedding_is_megatrons_bit_for_bit():
    assert run_distributed(cases.rotary_case, 1)[0]


@pytest.mark.slow
def test_graph_bucketing_pads_batch_and_length(state, stops):
    """Decode steps as the CUDA graphs run them (batch and attended length rounded up to buckets), on two
    pipeline stages; here eager, on the CPU."""
    runs = run_distributed(cases.bucketed_case, 2, state, stops, pipeline_model_parallel_size=2)
    for r in runs:
        assert r["generated"] == r["reference"]
        # Decode steps ran padded up to a bucket (the last, single-slot ones as 2), lengths whole granules of 16;
        # prefills as rows (exact up to 8, then whole eights), each padded to a whole granule of 16 tokens.
        decode = [k for k in r["buckets"] if k[0] == "decode"]
        prefill = [k for k in r["buckets"] if k[0] == "prefill"]
        assert {k[1] for k in decode} == {2, 5} and all(k[2] % 16 == 0 for k in decode)
        assert prefill and all((k[1] <= 8 or k[1] % 8 == 0) and k[2] % 16 == 0 for k in prefill)
        assert any(k[1] > 1 for k in prefill) and r["report"]["prefill_graph_forwards"] > 0
        # Refills of at most 48 tokens rode along decode steps: their tokens padded to 32 or 48 rows.
        mixed = [k for k in r["buckets"] if k[0] == "mixed"]
        assert mixed and {k[2] for k in mixed} <= {32, 48} and {k[1] for k in mixed} <= {2, 5}
        assert r["report"]["mixed_steps"] > 0
        # With no prompt left, the sequences of high slots moved down: the last steps ran at batch 2.
        assert r["report"]["slot_moves"] > 0
        # One step behind on the host: a stop token is seen a step late, and that step's row of it is dropped.
        stopped = sum(1 for g in r["generated"] if g[-1] in stops and len(g) < 40)  # ended by a stop, not length
        assert stopped > 0 and 0 < r["report"]["dropped_rows"] <= stopped
        if r["teacher_forced"] is not None:
            for logp, ref in zip(r["log_probs"], r["teacher_forced"]):
                torch.testing.assert_close(torch.tensor(logp), torch.tensor(ref), rtol=0, atol=LOGP_ATOL)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_tempered_log_probs_against_a_log_softmax(temperature):
    # Both columns against torch's own log_softmax of the (tempered) real-vocabulary logits; the draws do not
    # depend on asking for the tempered column.
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid.inference.sampling import sample

    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=temperature, top_k=5, top_p=0.9)
    plain_tokens, plain = sample(logits, params, vocab_size=33, generator=torch.Generator().manual_seed(1))
    tokens, both = sample(logits, params, vocab_size=33, generator=torch.Generator().manual_seed(1),
                          tempered_log_probs=True)
    assert torch.equal(tokens, plain_tokens) and torch.equal(both[:, 0], plain)
    real = logits[:, :33]
    tempered = torch.log_softmax(real / temperature if temperature > 0 else real, dim=-1)
    torch.testing.assert_close(both[:, 1], tempered.gather(-1, tokens[:, None]).squeeze(-1), rtol=0, atol=0)


def test_noise_drawn_ahead_gives_the_same_tokens():
    # A CUDA graph of a sampling step reads the race's draws from a buffer filled before the replay (draw_noise):
    # the same generator state must give the same draws, hence the same tokens, as sample() drawing them itself.
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid.inference.sampling import draw_noise, sample

    logits = torch.randn(7, 48, generator=torch.Generator().manual_seed(2))
    for params in (SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0, top_k=6),
                   SamplingParams(top_k=1)):
        own, own_logp = sample(logits, params, vocab_size=40, generator=torch.Generator().manual_seed(9))
        buffer = torch.full((7 * 40 + 5,), float("nan"))
        draw_noise(buffer[: 7 * 40], params, torch.Generator().manual_seed(9))
        ahead, ahead_logp = sample(logits, params, vocab_size=40, noise_nV=buffer[: 7 * 40].view(7, 40))
        assert torch.equal(own, ahead) and torch.equal(own_logp, ahead_logp)


@pytest.mark.parametrize("bad", [dict(prefill_graph_granule=0), dict(prefill_graph_granule=2.5),
                                 dict(overlap_host="yes"), dict(mixed_prefill_tokens=-1),
                                 dict(mixed_prefill_tokens=1.5), dict(compact_slots="on"),
                                 dict(graph_pool_gib=-1.0)])
def test_generation_config_rejects_bad_values(bad):
    from megatron_hybrid.inference import GenerationConfig

    name, value = next(iter(bad.items()))
    with pytest.raises(ValueError, match=re.escape(f"GenerationConfig.{name} ({value!r})")):
        GenerationConfig(**bad)


def test_bad_types_raise_on_every_rank(state):
    runs = run_distributed(cases.bad_types_case, 2, state, tensor_model_parallel_size=2)
    expected = {
        "bool_token": "prompt 0 (rank 1): token 0 (True, of type bool) is not an integer token id",
        "float_token": "prompt 0 (rank 1): token 1 (2.0, of type float) is not an integer token id",
        "bool_num_tokens": "SamplingParams.num_tokens_to_generate (True, of type bool) must be a positive integer",
        "bool_vocab": "vocab_size (True, of type bool) must be an integer",
        "float_stop": "stop_token_ids[0] (3.0, of type float) must be an integer token id",
        "params_dict": "sampling_params ({'top_k': 1}, of type dict) must be a megatron-core SamplingParams",
        "stops_none": "stop_token_ids (None, of type NoneType) must be a sequence of token ids",
        "stops_int": "stop_token_ids (5, of type int) must be a sequence of token ids",
        "seed_huge": f"seed ({2**70}, of type int) must be in [0, 2**64)",
        "seed_str": "seed ('abc', of type str) must be an integer",
        "params_none": "sampling_params (None, of type NoneType) must be a megatron-core SamplingParams",
    }
    for r in runs:
        for name, text in expected.items():
            got = r["messages"][name]
            assert got is not None and got.startswith("ValueError: generate: ") and text in got, (name, got)
        # numpy and torch integers are ints: the same tokens as the plain call, handed back as ints.
        assert r["alt"] == r["base"] and r["alt_types"] == ["int"], r
        assert "is not an integer token id" in r["refused"] and r["mode_after_refusal"] == "training", r


@pytest.mark.parametrize("mixed", [None, pytest.param(64, marks=pytest.mark.slow)], ids=["prefills", "mixed-steps"])
def test_a_budget_returns_finished_and_unfinished_sequences(state, stops, mixed):
    """Issue 46, step 1: a generate call under a budget stops once that many sequences have ended (or after that
    many decode steps); the finished ones equal the unbudgeted call's token for token (greedy, same weights), the
    unfinished ones are their prefixes (and their log-probs the same prefix), a prompt never admitted comes back
    empty and unfinished; every token carries the engine's switch count."""
    from megatron_hybrid.inference import Budget

    budgets = [dict(finished=2), dict(decode_steps=5), dict(finished=1, decode_steps=40), dict(finished=7),
               dict(finished=2, groups=(0, 0, 1, 1, 1, 2, 2)), dict(finished=1, required="longest")]
    out = run_distributed(cases.budget_case, 1, state, stops, budgets, mixed=mixed)[0]
    whole = out["whole"]
    assert all(r["finished"] for r in whole) and len({len(r["tokens"]) for r in whole}) > 1
    for kw, run in zip(budgets, out["budgets"]):
        finished = [r for r in run if r["finished"]]
        if "groups" in kw:  # groups all of whose sequences ended
            ended = {g: all(r["finished"] for r, h in zip(run, kw["groups"]) if h == g) for g in kw["groups"]}
            assert sum(ended.values()) >= kw["finished"]
        elif "finished" in kw and kw.get("decode_steps") is None:
            assert len(finished) >= kw["finished"]
        if kw == dict(finished=7):  # all of them: the same as no budget
            assert run == whole
        if kw.get("required"):  # the quota alone would have stopped earlier: the required sequence ends whole
            assert run[out["longest"]] == whole[out["longest"]]
        # 3 slots, 7 prompts: a budget met early leaves prompts unadmitted (no tokens) and slots mid-sequence.
        if kw == dict(decode_steps=5):
            assert any(not r["finished"] and r["tokens"] for r in run)
            assert any(not r["finished"] and not r["tokens"] for r in run)
        for r, w in zip(run, whole):
            n = len(r["tokens"])
            assert r["tokens"] == w["tokens"][:n] and r["log_probs"] == w["log_probs"][:n]
            assert r["finished"] == (n == len(w["tokens"]))
            assert r["versions"] == [out["switches"]] * n
    with pytest.raises(ValueError, match=r"Budget.finished \(0\) must be a positive integer"):
        Budget(finished=0)
    with pytest.raises(ValueError, match="Budget needs finished"):
        Budget()


def test_a_group_budget_splits_and_shares_whole_groups():
    """Issue 46, step 4: a budget counting groups (GRPO's) cuts micro-DP shares only between groups, about evenly,
    shares the quota by groups (rounded up, never more than a share's groups) and counts a group once all of its
    sequences ended."""
    from megatron_hybrid.inference import Budget

    b = Budget(finished=3, groups=(0, 0, 0, 1, 1, 2, 2, 2, 3, 3))  # groups start at 0, 3, 5, 8
    assert b.split(10, 2) == [(0, 5), (5, 10)]
    assert b.split(10, 3) == [(0, 3), (3, 8), (8, 10)]  # 3.3 -> 3; 6.7 -> 8 (nearer than 5)
    assert b.split(10, 1) == [(0, 10)]
    assert b.share(0, 5, 10) == Budget(2, None, (0, 0, 0, 1, 1))  # 2 of 4 groups: 3 * 2 / 4 rounded up
    assert b.share(8, 10, 10) == Budget(1, None, (3, 3)) and b.share(4, 4, 10) is None
    assert Budget(finished=4, groups=(7, 7, 8)).share(0, 2, 3).finished == 1  # at most the share's groups
    assert Budget(finished=3).share(0, 4, 10) == Budget(2) and Budget(finished=3).split(10, 3) == [(0, 4), (4, 7),
                                                                                                (7, 10)]
    ended = [True, True, True, True, False, True, True, True, False, False]
    assert b.complete(ended) == 2 and not b.met(ended, 0) and b.met(ended[:8] + [True, True], 0)
    assert Budget(finished=3).complete(ended) == 7
    with pytest.raises(ValueError, match="group 0 must be consecutive"):
        Budget(finished=1, groups=(0, 1, 0))
    # Required sequences (partial rollout's due units): re-indexed into each share; the quota waits for them.
    r = Budget(finished=1, groups=b.groups, required=(1, 6, 9))
    assert r.share(0, 5, 10).required == (1,) and r.share(5, 10, 10).required == (1, 4)
    assert r.share(5, 8, 10) == Budget(1, None, (2, 2, 2), (1,))
    assert not r.met(ended, 0) and r.met(ended[:9] + [True], 0) and r.met(ended, 0) is False
    assert Budget(finished=1, decode_steps=3, required=(9,)).met(ended, 3)  # decode steps still stop the call
    with pytest.raises(ValueError, match=r"Budget.required holds -1"):
        Budget(finished=1, required=(-1,))


# (t, p) -> (t_g, p_g), mixed_prefill_tokens: one rank; TP 2 -> TP 1 (two micro-DP replicas per training replica,
# the budget shared out between them); PP 2 -> PP 2 (the last stage's tokens, every stage's decision).
RESUME_LAYOUTS = [((1, 1), (1, 1), None), pytest.param((1, 1), (1, 1), 64, marks=pytest.mark.slow),
                  pytest.param((2, 1), (1, 1), None, marks=pytest.mark.slow),
                  pytest.param((1, 2), (1, 2), None, marks=pytest.mark.slow)]


@pytest.mark.parametrize("training, rollout, mixed", RESUME_LAYOUTS,
                         ids=["one-rank", "one-rank-mixed-steps", "micro-dp", "pp2"])
def test_resumed_generation_equals_the_uninterrupted_one(state, stops, training, rollout, mixed):
    """Issue 46, steps 2 and 3: sequences a budget left unfinished, resumed by a later call (their prompt and tokens
    so far prefilled again), end exactly as an uninterrupted call's when the weights did not change (greedy): the
    same tokens, the first call's log-probs kept and the new ones those of the uninterrupted run; on every rank."""
    runs = run_distributed(cases.resume_case, training[0] * training[1], state, stops, change_weights=False,
                           mixed=mixed, rollout=rollout, tensor_model_parallel_size=training[0],
                           pipeline_model_parallel_size=training[1])
    out = runs[0]
    assert all(r["joined"] == out["joined"] for r in runs)
    assert len(out["unfinished"]) >= 2 and any(out["first"][i] == 0 for i in out["unfinished"])
    for i, ((tokens, logp), (joined, joined_logp, versions, finished)) in enumerate(zip(out["whole"], out["joined"])):
        assert joined == tokens and finished
        n = out["first"][i]
        assert joined_logp[:n] == logp[:n]
        # A re-prefilled prefix attends over the same keys in another order of sums: fp32 rounding, ~1e-7.
        torch.testing.assert_close(torch.tensor(joined_logp[n:]), torch.tensor(logp[n:]), rtol=0, atol=1e-5)
        assert len(set(versions)) == 1  # no switch in between


def test_resumed_tokens_follow_the_new_weights(state, stops):
    """Issue 46, step 2: after the weights changed (an in-place step, a switch), the resumed tokens' log-probs are the
    new model's (a full forward over prompt + tokens) and carry the new weight version; the earlier ones keep
    theirs."""
    out = run_distributed(cases.resume_case, 1, state, stops, change_weights=True)[0]
    old_version, switches = out["versions"]
    for i in out["unfinished"]:
        joined, logp, versions, _ = out["joined"][i]
        n = out["first"][i]
        assert versions == old_version * n + [switches] * (len(joined) - n) and switches > old_version[0]
        # fp32, the same model: the KV-cache path against a full forward, ~1e-6.
        torch.testing.assert_close(torch.tensor(logp[n:]), torch.tensor(out["teacher"][i][n:]), rtol=0, atol=1e-4)
        assert n == 0 or logp[:n] != out["teacher"][i][:n]  # the earlier tokens' log-probs are the old model's


@pytest.mark.parametrize("training, rollout, count", [((1, 1), (1, 1), 5),
                                                      pytest.param((2, 1), (1, 1), 9, marks=pytest.mark.slow),
                                                      pytest.param((1, 2), (1, 2), 5, marks=pytest.mark.slow)],
                         ids=["one-rank", "micro-dp", "pp2"])
def test_kept_prefixes_give_the_tokens_of_prefilling_again(state, stops, training, rollout, count):
    """Issue 47, step 3: multi-turn sequences continued from their kept KV caches (only each turn's new tokens run)
    generate the same greedy tokens as prefilling every turn's whole sequence again, with the same log-probs (to
    rounding), which are also the final sequences' teacher-forced ones; some prefixes were kept and some evicted
    (more sequences than slots: micro-DP's two replicas take 5 and 4 of 9), and release frees what is left."""
    world = training[0] * training[1]
    kw = dict(rollout=rollout, count=count, tensor_model_parallel_size=training[0],
              pipeline_model_parallel_size=training[1])
    kept = run_distributed(cases.kept_prefix_case, world, state, stops, keep=True, **kw)
    again = run_distributed(cases.kept_prefix_case, world, state, stops, keep=False, **kw)
    out, ref = kept[0], again[0]
    assert all(r["turns"] == out["turns"] for r in kept)
    assert out["kept_continued"] >= 2 and out["kept_evicted"] >= 1 and ref["kept_continued"] == 0
    assert all(r["held_after_release"] == 0 for r in kept)
    for turn, turn_ref in zip(out["turns"], ref["turns"]):
        for (tokens, logp), (tokens_ref, logp_ref) in zip(turn, turn_ref):
            assert tokens == tokens_ref and len(tokens) > 0
            # fp32: a cached prefix against one prefilled again sums the same products in another order, ~1e-7.
            torch.testing.assert_close(torch.tensor(logp), torch.tensor(logp_ref), rtol=0, atol=1e-5)
    teacher = next(r["teacher"] for r in kept if r["teacher"] is not None)
    for i in range(len(teacher)):
        logp = [lp for turn in out["turns"] for lp in turn[i][1]]
        # The KV-cache path against one full forward over the final sequence (fp32), ~1e-6.
        torch.testing.assert_close(torch.tensor(logp), torch.tensor(teacher[i]), rtol=0, atol=1e-4)


@pytest.mark.parametrize("fields, named", [
    (dict(num_layers_in_first_pipeline_stage=1), "num_layers_in_first_pipeline_stage (1)"),
    (dict(num_layers_in_last_pipeline_stage=1, account_for_loss_in_pipeline_split=True),
     "num_layers_in_last_pipeline_stage (1), account_for_loss_in_pipeline_split (True)"),
])
def test_uneven_pipeline_stages_are_refused(state, fields, named):
    """Issue 48, step 1: the plan splits layers evenly over stages (exchange.stage_layers), so a model built for
    uneven stages would be resharded wrong without a word; the engine refuses it, naming the fields, before any
    collective."""
    message = run_distributed(cases.uneven_stages_case, 1, state, fields)[0]
    assert message is not None and message.startswith(f"the model's config sets {named}: pipeline stages of "
                                                       "uneven depth are not resharded")
    assert run_distributed(cases.uneven_stages_case, 1, state, {})[0] is None  # the even split is served


def test_multi_token_prediction_is_refused_before_any_collective(state):
    """Issue 50, step 1: the refusal of multi-token prediction comes with the engine's other checks, before the
    rollout groups are made (it came from the rollout model's build, after them)."""
    message = run_distributed(cases.uneven_stages_case, 1, state, {"mtp_num_layers": 1})[0]
    assert message is not None and message.startswith("the model's config sets mtp_num_layers (1): multi-token "
                                                       "prediction layers are not resharded")


def _cut_at(tokens: list[int], stops: set[int]) -> list[int]:
    """``tokens`` up to and including the first stop token (all of them where there is none)."""
    for i, tok in enumerate(tokens):
        if tok in stops:
            return tokens[: i + 1]
    return tokens


# (t, p, d) -> (t_g, p_g), prompts per training DP rank, slots: one rank; TP 2 -> TP 1 (the stop sets cut with the
# prompts between two micro-DP replicas); PP 2 -> PP 2 (the last stage's tokens, every stage's stops); DP 2 -> TP 2
# (one rollout replica gathers both training replicas' prompts and stop sets; a widening layout takes no budget).
REQUEST_STOP_LAYOUTS = [((1, 1, 1), (1, 1), 7, 3), pytest.param((2, 1, 1), (1, 1), 8, 3, marks=pytest.mark.slow),
                        pytest.param((1, 2, 1), (1, 2), 7, 3, marks=pytest.mark.slow),
                        pytest.param((1, 1, 2), (2, 1), 4, 3, marks=pytest.mark.slow)]


@pytest.mark.parametrize("training, rollout, count, slots", REQUEST_STOP_LAYOUTS,
                         ids=["one-rank", "micro-dp", "pp2", "widening"])
def test_each_request_stops_on_its_own_stop_tokens(state, training, rollout, count, slots):
    """Issue 46's ragged workload: a prompt's own stop tokens (``request_stop_token_ids``) end its sequence exactly
    where the stopless greedy run first makes one of them, and no other prompt's; a sequence a budget left
    unfinished keeps its stop set when resumed (the resuming call passes none) and ends at the same place."""
    t, p, d = training
    runs = run_distributed(cases.request_stops_case, t * p * d, state, rollout, count, slots,
                           rollout[0] <= t, tensor_model_parallel_size=t, pipeline_model_parallel_size=p)
    for out in runs:
        assert any(out["own"]) and not all(out["own"])
        cut_somewhere = 0
        for i, (free, own) in enumerate(zip(out["free"], out["own"])):
            expected = _cut_at(free, set(own))
            tokens, finished = out["whole"][i]
            assert tokens == expected and finished and out["kept"][i] == own
            cut_somewhere += len(expected) < len(free)
            assert out["joined"][i] == (expected, True, own)
        assert cut_somewhere >= 2 and (out["unfinished"] or rollout[0] > t)  # the stop sets and the budget acted
        # A bad stop set is a ValueError naming the argument, the entry and the value, before generating.
        n = len(out["own"])
        rank = "request_stop_token_ids (rank 0)"  # every rank's call is bad: the first one's message, everywhere
        for name, text in {"length": f"{rank} has {n - 1} entries for {n} prompts",
                           "not_a_list": f"{rank} (5, of type int) must hold one sequence of stop token ids",
                           "float": f"{rank}[{n - 1}][0] (2.0, of type float) must be an integer token id",
                           "outside": f"{rank}[{n - 1}] holds stop token {cases.VOCAB + 3}, outside"}.items():
            assert out["refusals"][name] is not None and text in out["refusals"][name], (name, out["refusals"])
