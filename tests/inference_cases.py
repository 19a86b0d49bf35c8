"""Rank bodies for the KV-cache generation tests (module-level, so the harness can send them to its ranks).

The reference is deliberately naive and independent of megatron_hybrid.inference: the training-layout model's
full forward over every whole sequence at every step (no cache), greedy argmax over the real vocabulary.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from tests.engine_cases import arch

VOCAB = 250  # tiny_llama's real vocabulary; its output layer has 256 rows at every TP size
NEW_TOKENS = 64
MAX_LEN = 128  # positions per sequence: the longest prompt (60) plus 64 new tokens fit


def prompts_for(dp_rank: int, count: int) -> list[list[int]]:
    """``count`` prompts of lengths drawn from 1..60 (seeded by the training DP rank)."""
    g = torch.Generator().manual_seed(500 + dp_rank)
    return [torch.randint(0, VOCAB, (int(torch.randint(1, 61, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def _training_model(state: dict, arch_kw: Optional[dict] = None):
    from megatron.core import parallel_state as ps

    from megatron_hybrid.megatron.sharding import load_full_state_dict

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    model = arch(**(arch_kw or {})).build(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                          pre_process=ps.is_pipeline_first_stage(),
                                          post_process=ps.is_pipeline_last_stage())
    load_full_state_dict([model], state, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp)
    return model


def _full_logits(model, seqs: list[list[int]]):
    """Training-layout logits ``[B, S, VOCAB]`` (fp32) of right-padded ``seqs`` on the last stage, else None."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid.forward import gather_vocab, pipeline_forward

    width = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, s in enumerate(seqs):
        tokens[row, : len(s)] = torch.tensor(s)
    positions = torch.arange(width).expand(len(seqs), -1)
    with torch.no_grad():
        logits = pipeline_forward(model, ps.get_pipeline_model_parallel_group(), tokens, positions)
    if logits is None:
        return None
    return gather_vocab(logits, ps.get_tensor_model_parallel_group()).float()[..., :VOCAB]


def recompute_greedy(model, prompts: list[list[int]], stops: set[int], new_tokens: int) -> list[list[int]]:
    """Greedy decoding by a full forward over every whole sequence at each step (right padding is harmless:
    attention is causal and each row's logits are read at its last real token)."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_group()
    last = dist.get_process_group_ranks(pp)[-1]
    out: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    for _ in range(new_tokens):
        if not active:
            break
        seqs = [prompts[i] + out[i] for i in active]
        logits = _full_logits(model, seqs)
        picked = torch.zeros(len(active), dtype=torch.long)
        if logits is not None:
            picked = logits[torch.arange(len(active)), torch.tensor([len(s) - 1 for s in seqs])].argmax(-1)
        if pp.size() > 1:
            dist.broadcast(picked, src=last, group=pp)
        for i, tok in zip(active, picked.tolist()):
            out[i].append(tok)
        active = [i for i in active if out[i][-1] not in stops and len(out[i]) < new_tokens]
    return out


def teacher_forced_log_probs(model, prompts: list[list[int]], generated: list[list[int]], temperature: float = 1.0):
    """log p(generated token) under one training-layout forward over each whole sequence, of
    softmax(logits / temperature) over the real vocabulary (last stage; else None)."""
    seqs = [p + g for p, g in zip(prompts, generated)]
    logits = _full_logits(model, seqs)
    if logits is None:
        return None
    out = []
    for row, (p, g) in enumerate(zip(prompts, generated)):
        logp = (logits[row, len(p) - 1: len(p) + len(g) - 1] / temperature).log_softmax(-1)
        out.append(logp.gather(-1, torch.tensor(g).unsqueeze(-1)).squeeze(-1).tolist())
    return out


def stop_probe(state: dict, dp_ranks: list[int], count: int, arch_kw: Optional[dict] = None) -> list[list[int]]:
    """World of one: greedy continuations (no stop tokens) of the prompts of ``dp_ranks``, to pick stop tokens."""
    model = _training_model(state, arch_kw)
    prompts = [p for dp in dp_ranks for p in prompts_for(dp, count)]
    return recompute_greedy(model, prompts, set(), NEW_TOKENS)


def layout_case(rollout_tp: int, rollout_pp: int, mode: str, state: dict, stops: list[int], count: int,
                slots: int, mixed: Optional[int] = None, arch_kw: Optional[dict] = None,
                config_kw: Optional[dict] = None) -> dict:
    """Greedy KV-cache generation on the rollout layout against the training layout's recompute (``mixed``: the
    config's ``mixed_prefill_tokens``, refills riding along decode steps, and then slots compacted in the tail too:
    what a GPU does by default; ``arch_kw``: the model's architecture, tiny_llama's by default)."""
    from megatron.core import parallel_state as ps
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.inference import GenerationConfig, RolloutGenerator

    model = _training_model(state, arch_kw)
    engine = HybridEngine(model, RolloutLayout(rollout_tp, rollout_pp), weight_mode=mode)
    generator = RolloutGenerator(engine, GenerationConfig(max_batch_size=slots, max_sequence_length=MAX_LEN,
                                                          mixed_prefill_tokens=mixed,
                                                          compact_slots=True if mixed else None,
                                                          **(config_kw or {})))
    prompts = prompts_for(ps.get_data_parallel_rank(), count)
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS, return_log_probs=True)
    results = generator.generate(prompts, greedy, vocab_size=VOCAB, stop_token_ids=stops)
    report = generator.report()
    engine.switch_to_training()
    generated = [r.generated_tokens for r in results]
    return {"prompts": prompts, "result_prompts": [r.prompt_tokens for r in results], "generated": generated,
            "log_probs": [r.generated_log_probs for r in results],
            "reference": recompute_greedy(model, prompts, set(stops), NEW_TOKENS),
            "teacher_forced": teacher_forced_log_probs(model, prompts, generated), "report": report,
            "dp": ps.get_data_parallel_rank()}


def sampling_case(rollout_tp: int, state: dict, num_samples: int) -> dict:
    """Seeded sampling: reproducible, identical on the ranks of a replica, distributed as the model's softmax."""
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.inference import GenerationConfig, RolloutGenerator

    model = _training_model(state)
    engine = HybridEngine(model, RolloutLayout(rollout_tp, 1))
    generator = RolloutGenerator(engine, GenerationConfig(max_batch_size=256, max_sequence_length=MAX_LEN))
    prompts = prompts_for(0, 6)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, num_tokens_to_generate=24)
    runs = [[r.generated_tokens for r in generator.generate(prompts, params, vocab_size=VOCAB, seed=seed)]
            for seed in (7, 7, 8)]
    # The next-token distribution over a vocabulary of 8: one prompt, many independent one-token samples.
    prompt, small = [1, 4, 2, 7, 3], 8  # ids below the small vocabulary
    settings = {"plain": SamplingParams(temperature=1.0, num_tokens_to_generate=1),
                "cut": SamplingParams(temperature=0.7, top_k=5, top_p=0.8, num_tokens_to_generate=1)}
    counts = {}
    for name, sp in settings.items():
        out = generator.generate([prompt] * num_samples, sp, vocab_size=small, seed=3)
        counts[name] = torch.bincount(torch.tensor([r.generated_tokens[0] for r in out]), minlength=small).tolist()
    engine.switch_to_training()
    logits = _full_logits(model, [prompt])
    return {"runs": runs, "counts": counts,
            "logits": logits[0, -1, :small].tolist() if logits is not None else None,
            "settings": {k: (v.temperature, v.top_k, v.top_p) for k, v in settings.items()}}


def tempered_case(state: dict, temperature: float) -> dict:
    """Sampled generation with ``tempered_log_probs`` on the rollout layout (TP=PP=1) and on the training layout
    itself (``generate_with_model``, as ``--no-hybrid-rollout`` generates): tokens, the log-probs at the sampling
    temperature and the untempered ones, with the teacher-forced training-layout references."""
    from megatron.core import parallel_state as ps
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.inference import GenerationConfig, RolloutGenerator, generate_with_model

    model = _training_model(state)
    engine = HybridEngine(model, RolloutLayout(1, 1))
    generator = RolloutGenerator(engine, GenerationConfig(max_batch_size=4, max_sequence_length=MAX_LEN))
    prompts = prompts_for(ps.get_data_parallel_rank(), 6)
    # top-k and top-p cut the sampling distribution; the log-probs stay those of the whole tempered softmax.
    params = SamplingParams(temperature=temperature, top_k=20, top_p=0.9, num_tokens_to_generate=24)
    runs = {"rollout": generator.generate(prompts, params, vocab_size=VOCAB, seed=5, tempered_log_probs=True),
            "untempered_only": generator.generate(prompts, params, vocab_size=VOCAB, seed=5)}
    engine.switch_to_training()
    runs["training_layout"] = generate_with_model(
        model, prompts, params, tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(), vocab_size=VOCAB, seed=5, tempered_log_probs=True)
    out = {}
    for name, results in runs.items():
        generated = [r.generated_tokens for r in results]
        out[name] = {"generated": generated, "tempered": [r.generated_tempered_log_probs for r in results],
                     "untempered": [r.generated_log_probs for r in results],
                     "teacher_tempered": teacher_forced_log_probs(model, prompts, generated, temperature),
                     "teacher_untempered": teacher_forced_log_probs(model, prompts, generated)}
    return out


def _bad_input_setup(state: dict) -> tuple:
    """The bad-input cases' engine (rollout TP 1), generator, whether this rank holds the bad value (the last
    rank), and a good batch of prompts."""
    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.inference import GenerationConfig, RolloutGenerator

    engine = HybridEngine(_training_model(state), RolloutLayout(1, 1))
    generator = RolloutGenerator(engine, GenerationConfig(max_batch_size=4, max_sequence_length=MAX_LEN))
    return engine, generator, dist.get_rank() == dist.get_world_size() - 1, [[1, 2, 3], [4, 5]]


def bad_input_case(state: dict) -> dict:
    """Each bad call raises a ValueError on every rank (one rank holds the bad prompt); a good call still works."""
    from megatron.core import parallel_state as ps
    from megatron.core.inference.sampling_params import SamplingParams

    engine, generator, culprit, good = _bad_input_setup(state)
    sp = SamplingParams(top_k=1, num_tokens_to_generate=8)
    calls = {
        "empty": (good + [[]] if culprit else good, {}),
        "too_large": ([[1, 2], [3, VOCAB]] if culprit else good, {"vocab_size": VOCAB}),
        "negative": ([[1, -1]] if culprit else good, {}),
        "vocab_zero": (good, {"vocab_size": 0}),
        "vocab_above_padded": (good, {"vocab_size": 300}),
        "too_long": ([[5] * (MAX_LEN - 4)] if culprit else good, {}),
    }
    messages = {}
    for name, (prompts, kwargs) in calls.items():
        try:
            generator.generate(prompts, sp, **kwargs)
            messages[name] = None
        except ValueError as exc:
            messages[name] = str(exc)
    results = generator.generate(good, sp, vocab_size=VOCAB)
    engine.switch_to_training()
    return {"messages": messages, "ok": [len(r.generated_tokens) for r in results], "dp": ps.get_data_parallel_rank()}


def bad_types_case(state: dict) -> dict:
    """Booleans, floats and other wrong types in a generate call: a ValueError on every rank naming the argument,
    the value and its type (where marked, only the last rank holds the bad value); numpy integers and integer
    tensors are taken as the ints they are."""
    import numpy as np
    from megatron.core.inference.sampling_params import SamplingParams

    engine, generator, culprit, good = _bad_input_setup(state)
    sp = SamplingParams(top_k=1, num_tokens_to_generate=4)
    calls = {
        "bool_token": ([[True, 2]] if culprit else good, sp, {}),
        "float_token": ([[1, 2.0]] if culprit else good, sp, {}),
        "bool_num_tokens": (good, SamplingParams(top_k=1, num_tokens_to_generate=True), {}),
        "bool_vocab": (good, sp, {"vocab_size": True}),
        "float_stop": (good, sp, {"stop_token_ids": [3.0]}),
        "params_dict": (good, {"top_k": 1}, {}),
        "stops_none": (good, sp, {"stop_token_ids": None}),
        "stops_int": (good, sp, {"stop_token_ids": 5}),
        "seed_huge": (good, sp, {"seed": 2**70}),
        "seed_str": (good, sp, {"seed": "abc"}),
        "params_none": (good, None if culprit else sp, {}),
    }
    messages = {}
    for name, (prompts, params, kwargs) in calls.items():
        try:
            generator.generate(prompts, params, **({"vocab_size": VOCAB} | kwargs))
            messages[name] = None
        except Exception as exc:  # the test wants ValueErrors only: report whatever came
            messages[name] = f"{type(exc).__name__}: {exc}"
    stops = [VOCAB - 1]
    base = generator.generate(good, sp, vocab_size=VOCAB, stop_token_ids=stops, seed=3)
    ints = [np.array(p, dtype=np.int64) if culprit else torch.tensor(p) for p in good]
    alt = generator.generate(ints, SamplingParams(top_k=np.int64(1), num_tokens_to_generate=torch.tensor(4)),
                             vocab_size=np.int32(VOCAB), stop_token_ids=(np.int64(VOCAB - 1),), seed=np.uint64(3))
    engine.switch_to_training()
    # rl.generate_on_engine switches to rollout before generate's checks run: a refused call must still leave the
    # engine in training mode (with the optimizer's states back, had they been offloaded).
    from megatron_hybrid import rl
    try:
        rl.generate_on_engine(engine, [[True, 2]] if culprit else good, sp, vocab_size=VOCAB, stop_token_ids=[],
                              seed=0)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return {"messages": messages, "base": [r.generated_tokens for r in base], "refused": refused,
            "mode_after_refusal": engine.mode,
            "alt": [r.generated_tokens for r in alt],
            "alt_types": sorted({type(t).__name__ for r in alt for t in r.prompt_tokens + r.generated_tokens})}


def memory_case(state: dict) -> dict:
    """The KV cache keeps its address across rollouts and holds no memory while training."""
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.inference import GenerationConfig, RolloutGenerator

    model = _training_model(state)
    engine = HybridEngine(model, RolloutLayout(1, 1))
    generator = RolloutGenerator(engine, GenerationConfig(max_batch_size=3, max_sequence_length=MAX_LEN))
    sp = SamplingParams(top_k=1, num_tokens_to_generate=12)
    prompts = prompts_for(0, 7)
    seen = []
    for _ in range(2):
        out = generator.generate(prompts, sp, vocab_size=VOCAB)
        during = generator.report()
        engine.switch_to_training()
        after = generator.report()
        seen.append({"tokens": [r.generated_tokens for r in out], "address": during["kv_cache_address"],
                     "bytes": during["kv_cache_bytes"], "mapped_after": after["kv_cache_mapped_bytes"]})
    return {"runs": seen, "buffer_api": hasattr(engine, "reserve_rollout_memory")}


def rotary_case() -> bool:
    """World of one: the cached path's rotary embedding equals megatron-core's, bit for bit, at positions up to
    4095 of a Llama-3-scaled rope (factor 32)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    from megatron_hybrid.inference import GenerationConfig, ReplicaGenerator

    model = arch(use_rope_scaling=True, rope_scaling_factor=32.0, max_position_embeddings=4096).build()
    replica = ReplicaGenerator(model, tp_group=ps.get_tensor_model_parallel_group(),
                               pp_group=ps.get_pipeline_model_parallel_group(),
                               config=GenerationConfig(max_batch_size=1, max_sequence_length=4096))
    replica._ensure_state()
    positions = torch.tensor([0, 1, 17, 2047, 2048, 3000, 4095])
    q = torch.randn(len(positions), 1, 8, 8, generator=torch.Generator().manual_seed(0))
    ours = replica.attention[0]._rotate(q, *replica.runner.forwards.rotary(positions))
    reference = apply_rotary_pos_emb(q, model.rotary_pos_emb(4096)[positions], config=model.config,
                                     cp_group=ps.get_context_parallel_group())
    replica.close()
    return bool(torch.equal(ours, reference))


def bucketed_case(state: dict, stops: list[int]) -> dict:
    """The CUDA-graph step path on the CPU: decode steps padded to batch buckets and to a length granule, prefills
    as right-padded rectangles whose padded rows write a spare slot (the graphs' bucketing), run eagerly by a
    stand-in for DecodeGraphs, with the host one step behind the launches (``overlap_host``), against the training
    layout's recompute."""
    import dataclasses

    from megatron.core import parallel_state as ps
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.inference import GenerationConfig, RolloutGenerator
    from megatron_hybrid.inference.graphs import DecodeGraphs

    class EagerBuckets(DecodeGraphs):
        def __init__(self):  # no CUDA pool
            self.reserved, self.seen, self.captures, self.replays = None, set(), 0, 0

        def run(self, key, step):
            self.seen.add(key)
            return step()

        def keys(self):
            return sorted(self.seen)

    model = _training_model(state)
    engine = HybridEngine(model, RolloutLayout(1, ps.get_pipeline_model_parallel_world_size()))
    # The graphs' buckets (the planner rounds steps to them): batches 2 and 5, lengths whole granules of 16.
    generator = RolloutGenerator(engine, GenerationConfig(max_batch_size=5, max_sequence_length=MAX_LEN,
                                                          prefill_graph_granule=16, overlap_host=True,
                                                          mixed_prefill_tokens=48, compact_slots=True,
                                                          graph_batch_sizes=(2, 5), graph_length_granule=16))
    replica = generator.replica
    engine.switch_to_rollout()
    runner = replica.runner
    runner.use_graphs = True
    runner.geometry = dataclasses.replace(runner.geometry, spare_slots=1)
    runner._new_graphs = EagerBuckets
    prompts = prompts_for(0, 13)
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=40)
    results = generator.generate(prompts, greedy, vocab_size=VOCAB, stop_token_ids=stops)
    seen = sorted(replica.graphs.seen)
    report = generator.report()
    runner.buffers.graphs = None
    engine.switch_to_training()
    generated = [r.generated_tokens for r in results]
    return {"generated": generated, "reference": recompute_greedy(model, prompts, set(stops), 40),
            "log_probs": [r.generated_log_probs for r in results], "report": report,
            "teacher_forced": teacher_forced_log_probs(model, prompts, generated), "buckets": seen}


def budget_case(state: dict, stops: list[int], budgets: list[dict], *, slots: int = 3, count: int = 7,
                mixed: Optional[int] = None) -> dict:
    """Issue 46, step 1 (world size 1): greedy generation of ``count`` prompts through ``slots`` slots with stop
    tokens, whole, then under each budget (``Budget(**kw)``) from the same generator; per run each result's tokens,
    log-probs, ``finished`` and ``weight_versions``; and the engine's switch count."""
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.inference import Budget, GenerationConfig, RolloutGenerator

    model = _training_model(state)
    engine = HybridEngine(model, RolloutLayout(1, 1))
    generator = RolloutGenerator(engine, GenerationConfig(max_batch_size=slots, max_sequence_length=MAX_LEN,
                                                          mixed_prefill_tokens=mixed,
                                                          compact_slots=True if mixed else None))
    prompts = prompts_for(0, count)
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS)

    def run(budget):
        results = generator.generate(prompts, greedy, vocab_size=VOCAB, stop_token_ids=stops, budget=budget)
        return [{"tokens": r.generated_tokens, "log_probs": r.generated_log_probs, "finished": r.finished,
                 "versions": r.weight_versions} for r in results]

    whole = run(None)
    longest = max(range(count), key=lambda i: len(whole[i]["tokens"]))  # required="longest": that sequence's index
    out = {"whole": whole, "longest": longest,
           "budgets": [run(Budget(**{**kw, "required": (longest,)} if kw.get("required") == "longest" else kw))
                       for kw in budgets],
           "switches": engine.num_switches, "decode_steps": generator.report()["decode_steps"]}
    engine.switch_to_training()
    return out


def resume_case(state: dict, stops: list[int], *, change_weights: bool, mixed: Optional[int] = None,
                rollout: tuple[int, int] = (1, 1)) -> dict:
    """Issue 46, step 2 (world size 1): 7 prompts through 3 slots, greedy, with stop tokens: whole; then under a
    budget of 5 decode steps, and its unfinished sequences resumed by another call (after an in-place change of the
    training weights and a switch, when ``change_weights``). Per prompt the whole run's and the joined run's tokens,
    log-probs and weight versions, how many tokens the first call had made, and the final weights' teacher-forced
    log-probs of the joined tokens."""
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.inference import Budget, GenerationConfig, RolloutGenerator

    from megatron.core import parallel_state as ps

    model = _training_model(state)
    engine = HybridEngine(model, RolloutLayout(*rollout))
    generator = RolloutGenerator(engine, GenerationConfig(max_batch_size=3, max_sequence_length=MAX_LEN,
                                                          mixed_prefill_tokens=mixed,
                                                          compact_slots=True if mixed else None))
    prompts = prompts_for(ps.get_data_parallel_rank(), 7)
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS)
    kw = dict(vocab_size=VOCAB, stop_token_ids=stops)
    whole = generator.generate(prompts, greedy, **kw)
    part = generator.generate(prompts, greedy, **kw, budget=Budget(decode_steps=5))
    unfinished = [i for i, r in enumerate(part) if not r.finished]
    first = [len(r.generated_tokens) for r in part]
    if change_weights:
        engine.switch_to_training()
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():  # an optimizer step's worth of change, in place (the engine's views stay)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.abs().mean())
    resumed = generator.generate([], greedy, **kw, resume=[part[i] for i in unfinished])
    joined = list(part)
    for i, r in zip(unfinished, resumed):
        joined[i] = r
    engine.switch_to_training()
    tokens = [r.generated_tokens for r in joined]
    return {"whole": [(r.generated_tokens, r.generated_log_probs) for r in whole],
            "joined": [(r.generated_tokens, r.generated_log_probs, r.weight_versions, r.finished) for r in joined],
            "first": first, "unfinished": unfinished, "versions": (part[0].weight_versions[:1], engine.num_switches),
            "teacher": teacher_forced_log_probs(model, prompts, tokens)}


def kept_prefix_case(state: dict, stops: list[int], *, keep: bool, rollout: tuple[int, int] = (1, 1),
                     slots: int = 3, count: int = 5) -> dict:
    """Issue 47, step 3: three turns of greedy generation (12 new tokens a turn, stop tokens) over ``count`` prompts
    through ``slots`` slots, the sequence growing by each turn's tokens and a two-token observation. ``keep``: each
    turn continues the last one's kept prefixes (only the new tokens run); else each turn's whole sequences are
    prefilled again. Per prompt each turn's tokens and log-probs, the final sequences' teacher-forced log-probs of
    the model's tokens, and the generator's counters."""
    from megatron.core import parallel_state as ps
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.inference import GenerationConfig, RolloutGenerator

    model = _training_model(state)
    engine = HybridEngine(model, RolloutLayout(*rollout))
    generator = RolloutGenerator(engine, GenerationConfig(max_batch_size=slots, max_sequence_length=MAX_LEN,
                                                          mixed_prefill_tokens=64, compact_slots=True))
    prompts = prompts_for(ps.get_data_parallel_rank(), count)
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=12)
    seqs, kept, turns = [list(p) for p in prompts], [None] * count, []
    model_at: list[list[int]] = [[] for _ in prompts]  # positions (after the first prompt) of the model's tokens
    for turn in range(3):
        results = generator.generate(seqs, greedy, vocab_size=VOCAB, stop_token_ids=stops, keep=keep,
                                     continued=kept if keep else ())
        turns.append([(r.generated_tokens, r.generated_log_probs) for r in results])
        for i, r in enumerate(results):
            start = len(seqs[i]) - len(prompts[i])
            model_at[i] += range(start, start + len(r.generated_tokens))
            observation = [(7 * i + turn) % VOCAB, 11] if turn < 2 else []
            seqs[i] = seqs[i] + r.generated_tokens + observation
            kept[i] = r.kept
    report = generator.report()
    generator.release(kept)
    engine.switch_to_training()
    teacher = teacher_forced_log_probs(model, prompts, [s[len(p):] for s, p in zip(seqs, prompts)])
    if teacher is not None:
        teacher = [[row[j] for j in at] for row, at in zip(teacher, model_at)]
    return {"turns": turns, "teacher": teacher, "kept_continued": report["kept_continued"],
            "kept_evicted": report["kept_evicted"], "held_after_release": len(generator.replica.kept)}


def uneven_stages_case(state: dict, fields: dict) -> Optional[str]:
    """Issue 48, step 1: a model whose config asks for uneven pipeline stages (``fields`` set on it after the
    build), given to a HybridEngine: the error's message (None if it was accepted)."""
    from megatron_hybrid import HybridEngine, RolloutLayout

    model = _training_model(state)
    for name, value in fields.items():
        setattr(model.config, name, value)
    try:
        HybridEngine(model, RolloutLayout(1, 1)).close()
    except ValueError as error:
        return str(error)
    return None


def request_stops_case(state: dict, rollout: tuple[int, int], count: int, slots: int, budget: bool = True) -> dict:
    """Issue 46's workload (stop-token sets drawn per request): greedy generation of ``count`` prompts per training
    DP rank, first with no stop token at all, then with each prompt's own stop set (``request_stop_token_ids``:
    tokens the stopless run makes at different depths, and none for some prompts), whole, and under a budget of 5
    decode steps with the unfinished sequences resumed by a later call that passes no stop sets (they keep their
    own; not with ``budget`` False: a widening layout takes no budget). Per rank: the prompts, their stop sets, each
    run's tokens and finished flags, and the messages of bad stop sets."""
    from megatron.core import parallel_state as ps
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.inference import Budget, GenerationConfig, RolloutGenerator

    model = _training_model(state)
    engine = HybridEngine(model, RolloutLayout(*rollout))
    generator = RolloutGenerator(engine, GenerationConfig(max_batch_size=slots, max_sequence_length=MAX_LEN))
    dp = ps.get_data_parallel_rank()
    prompts = prompts_for(dp, count)
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS)
    free = [r.generated_tokens for r in generator.generate(prompts, greedy, vocab_size=VOCAB)]
    # Prompt i stops on the token its stopless run makes at depth 3 + 5i (none for every third prompt), and on one
    # token it never makes.
    never = [next(t for t in range(VOCAB) if t not in seq) for seq in free]
    own = [[] if i % 3 == 2 else [seq[min(3 + 5 * i, len(seq) - 1)], never[i]] for i, seq in enumerate(free)]
    kw = dict(vocab_size=VOCAB, request_stop_token_ids=own)
    whole = generator.generate(prompts, greedy, **kw)
    part = generator.generate(prompts, greedy, **kw, budget=Budget(decode_steps=5)) if budget else whole
    unfinished = [i for i, r in enumerate(part) if not r.finished]
    resumed = generator.generate([], greedy, vocab_size=VOCAB, resume=[part[i] for i in unfinished]) \
        if unfinished else []
    joined = list(part)
    for i, r in zip(unfinished, resumed):
        joined[i] = r
    refusals = {}
    for name, bad in {"length": own[:-1], "not_a_list": 5, "float": [[1]] * (count - 1) + [[2.0]],
                      "outside": [[]] * (count - 1) + [[VOCAB + 3]]}.items():
        try:
            generator.generate(prompts, greedy, vocab_size=VOCAB, request_stop_token_ids=bad)
            refusals[name] = None
        except ValueError as e:
            refusals[name] = str(e)
    engine.switch_to_training()
    return {"dp": dp, "free": free, "own": own, "refusals": refusals,
            "whole": [(r.generated_tokens, r.finished) for r in whole],
            "kept": [r.stop_token_ids for r in whole], "unfinished": unfinished,
            "joined": [(r.generated_tokens, r.finished, r.stop_token_ids) for r in joined]}
