"""Rank bodies for test_moe_generation.py: the generator's MoE step (megatron_hybrid.inference.moe) against
megatron-core's MoELayer, and greedy generation of tiny MoE GPTs against a full-recompute greedy decoding.

The reference decoding is deliberately naive and independent of megatron_hybrid.inference: the model's own forward
over every whole sequence at every step (no cache), greedy argmax over the real vocabulary.
"""

from __future__ import annotations

import re

import torch

VOCAB = 250  # tiny_llama's real vocabulary (256 rows padded)
_LOCAL_EXPERT = re.compile(r"^(.*\.local_experts\.)(\d+)(\..*)$")


def moe_arch(**overrides):
    """2 layers, hidden 32, 4 experts of hidden 32, top-2, fp32, no aux loss."""
    from megatron_hybrid.megatron.models import tiny_llama

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, max_position_embeddings=128)
    base.update(overrides)
    return tiny_llama(**base)


def _moe_layers(model) -> list:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [layer.mlp for layer in model.decoder.layers if isinstance(layer.mlp, MoELayer)]


def _randomise_expert_bias(model) -> None:
    """A visible expert bias (built as zeros): it must change the choice and not the probabilities."""
    g = torch.Generator().manual_seed(7)
    for layer in _moe_layers(model):
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.copy_(torch.randn(layer.router.expert_bias.shape, generator=g) * 0.5)


def rehome_experts(model) -> None:
    """Put every MoE layer's expert weights into one storage, expert after expert (fc1 then fc2), so that the fc1
    (and fc2) weights lie at a uniform stride that is not their own size: what the grouped GEMMs view."""
    for layer in _moe_layers(model):
        experts = layer.experts.local_experts
        fc1, fc2 = experts[0].linear_fc1.weight, experts[0].linear_fc2.weight
        n1, n2 = fc1.numel(), fc2.numel()
        buffer = torch.empty(len(experts) * (n1 + n2), dtype=fc1.dtype, device=fc1.device)
        with torch.no_grad():
            for i, e in enumerate(experts):
                base = i * (n1 + n2)
                for p, lo, n in ((e.linear_fc1.weight, base, n1), (e.linear_fc2.weight, base + n1, n2)):
                    view = buffer[lo: lo + n].view(p.shape)
                    view.copy_(p)
                    p.data = view


def layer_case(arch_kw: dict, tokens: int) -> dict:
    """Each MoE layer of a model built from ``arch_kw`` (at the harness's tensor-parallel size: expert TP the same,
    its partial sums reduce-scattered over tp_ep) on random hidden states, by megatron-core's forward (before and
    after the swap), by the step (grouped and per-expert experts) and inside a step context."""
    from megatron_hybrid.inference.context import KVStep, StepContext
    from megatron_hybrid.inference.moe import StepMoELayer, grouped_experts, install_step_moe, sequential_experts

    from megatron.core import parallel_state as ps

    torch.manual_seed(3)
    model = moe_arch(**arch_kw).build(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size())
    model.eval()
    _randomise_expert_bias(model)
    layers = _moe_layers(model)
    g = torch.Generator().manual_seed(11)
    dtype = model.config.params_dtype
    hidden = [torch.randn(tokens, 1, model.config.hidden_size, generator=g).to(dtype) for _ in layers]
    out = {"kinds": [type(layer.mlp).__name__ for layer in model.decoder.layers]}
    with torch.no_grad():
        reference = [layer(h)[0] for layer, h in zip(layers, hidden)]
        context = StepContext()
        installed = install_step_moe(model, context)
        assert installed == layers and all(isinstance(m, StepMoELayer) for m in layers)
        after = [layer(h)[0] for layer, h in zip(layers, hidden)]  # outside a step: megatron's forward
        sequential = [layer.step_forward(h) for layer, h in zip(layers, hidden)]
        paths_before = [layer.experts_path().__name__ for layer in layers]
        rehome_experts(model)
        paths_after = [layer.experts_path().__name__ for layer in layers]
        grouped = [layer.step_forward(h) for layer, h in zip(layers, hidden)]
        padded = [layer.step_forward(h, rows=tokens + 5) for layer, h in zip(layers, hidden)]
        step = KVStep(keys=[], values=[], slots_T=torch.zeros(tokens, dtype=torch.long),
                      positions_T=torch.zeros(tokens, dtype=torch.long), rotary_T11D=None, decode=True)
        with context.step(step):
            in_step = [layer(h) for layer, h in zip(layers, hidden)]
        # The two expert paths on the same sorted pairs (their valid rows).
        stack = layers[0].expert_stack
        x = torch.randn(3 * tokens, model.config.hidden_size, generator=g).to(dtype)
        probs = torch.rand(3 * tokens, generator=g)
        # Random group sizes (some empty), the last rows past offs[-1] (another rank's pairs).
        cuts = torch.randint(0, 3 * tokens, (len(stack.experts.local_experts) - 1,), generator=g).sort().values
        offs = torch.cat([cuts, torch.tensor([3 * tokens - 1])]).to(torch.int32)
        pair_grouped = grouped_experts(x, probs, offs, stack)[: 3 * tokens - 1]
        pair_sequential = sequential_experts(x, probs, offs, stack)[: 3 * tokens - 1]

    def diff(a, b):
        return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))

    out.update(
        scale=max(float(r.float().abs().max()) for r in reference),
        after=diff(after, reference), sequential=diff(sequential, reference), grouped=diff(grouped, reference),
        padded=diff(padded, reference), in_step=diff([o for o, _ in in_step], reference),
        in_step_bias=[b is None for _, b in in_step], paths_before=paths_before, paths_after=paths_after,
        pairs=float((pair_grouped.float() - pair_sequential.float()).abs().max()),
        pairs_scale=float(pair_sequential.float().abs().max()),
        shared=[layer.shared_experts is not None for layer in layers])
    return out


NEW_TOKENS = 20
MAX_LEN = 48  # the longest prompt (24) plus 20 new tokens fit


def prompts_for(seed: int, count: int) -> list[list[int]]:
    """``count`` prompts of lengths 1..24."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(1, 25, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def recompute_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy decoding of a one-stage model by its full forward over every whole sequence at each step, without
    stop tokens (right padding is harmless: attention is causal, logits are read at each row's last token)."""
    out: list[list[int]] = [[] for _ in prompts]
    with torch.no_grad():
        for _ in range(new_tokens):
            seqs = [p + o for p, o in zip(prompts, out)]
            width = max(len(s) for s in seqs)
            tokens = torch.zeros(len(seqs), width, dtype=torch.long)
            for row, s in enumerate(seqs):
                tokens[row, : len(s)] = torch.tensor(s)
            logits = model(tokens, torch.arange(width).expand(len(seqs), -1), None)[..., :VOCAB]
            picked = logits[torch.arange(len(seqs)), torch.tensor([len(s) - 1 for s in seqs])].argmax(-1)
            for o, tok in zip(out, picked.tolist()):
                o.append(tok)
    return out


def stop_tokens(reference: list[list[int]]) -> list[int]:
    """Tokens greedy decoding first reaches mid-sequence (after 6 tokens, new to the sequence): up to three."""
    found = []
    for seq in reference:
        late = [tok for tok in seq[6:-2] if tok not in seq[:6]]
        if late and late[0] not in found:
            found.append(late[0])
    return found[:3]


def truncated(reference: list[list[int]], stops: list[int]) -> list[list[int]]:
    """Greedy decoding with ``stops``: each sequence up to and including its first stop token."""
    out = []
    for seq in reference:
        cut = next((i + 1 for i, tok in enumerate(seq) if tok in stops), len(seq))
        out.append(seq[:cut])
    return out


def _generator(model, slots: int, mixed: int = 0, *, bucketed: bool = False, record_routing: bool = False):
    """A ReplicaGenerator over ``model`` on the harness's groups. ``bucketed``: the CUDA-graph step path on the CPU
    (steps rounded to the graphs' buckets and keyed, run eagerly by a stand-in for the graphs, the host one step
    behind the launches), as tests/inference_cases.py's bucketed case runs it."""
    import dataclasses

    from megatron.core import parallel_state as ps

    from megatron_hybrid.inference import GenerationConfig, ReplicaGenerator
    from megatron_hybrid.inference.graphs import StepGraphs

    class EagerGraphs(StepGraphs):
        def __init__(self):  # no CUDA pool
            self.reserved, self.seen, self.captures, self.replays = None, set(), 0, 0

        def run(self, key, step):
            self.seen.add(key)
            return step()

        def keys(self):
            return sorted(self.seen, key=repr)

        def close(self):
            pass

    config = GenerationConfig(max_batch_size=slots, max_sequence_length=MAX_LEN, mixed_prefill_tokens=mixed,
                              compact_slots=bool(mixed) or bucketed, overlap_host=bucketed,
                              prefill_graph_granule=8, graph_length_granule=16, record_routing=record_routing)
    generator = ReplicaGenerator(model, tp_group=ps.get_tensor_model_parallel_group(),
                                 pp_group=ps.get_pipeline_model_parallel_group(), config=config)
    if bucketed:
        runner = generator.runner
        runner.use_graphs = True
        runner.geometry = dataclasses.replace(runner.geometry, spare_slots=1)
        runner._new_graphs = EagerGraphs
    return generator


def _greedy(generator, prompts: list[list[int]], stops: list[int]) -> list[list[int]]:
    from megatron.core.inference.sampling_params import SamplingParams

    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS)
    return [r.generated_tokens for r in generator.generate(prompts, params, vocab_size=VOCAB, stop_token_ids=stops)]


def generation_case(arch_kw: dict, *, grouped: bool, count: int, slots: int, mixed: int = 0) -> dict:
    """One rank: greedy KV-cache generation of a tiny MoE GPT (ReplicaGenerator, its own rollout memory) with more
    prompts than slots and stop tokens, against the model's full-recompute greedy decoding."""
    torch.manual_seed(3)
    model = moe_arch(**arch_kw).build()
    model.eval()
    _randomise_expert_bias(model)
    if grouped:
        rehome_experts(model)
    prompts = prompts_for(500, count)
    reference = recompute_greedy(model, prompts, NEW_TOKENS)
    stops = stop_tokens(reference)
    generator = _generator(model, slots, mixed)
    generated = _greedy(generator, prompts, stops)
    report = generator.report()
    paths = [layer.experts_path().__name__ for layer in generator.runner.moe]
    generator.close()
    return {"generated": generated, "reference": truncated(reference, stops), "stops": stops, "report": report,
            "paths": paths}


def _load_expert_parallel(model, full: dict, *, ep_rank: int) -> None:
    """Copy ``full`` (an unsharded model's parameters and buffers) into an expert-parallel model: its local expert
    i is global expert ``ep_rank x local + i``; everything else is replicated."""
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            match = _LOCAL_EXPERT.match(name)
            if match:
                local = len(model.decoder.layers[int(name.split(".")[2])].mlp.experts.local_experts)
                name = f"{match[1]}{ep_rank * local + int(match[2])}{match[3]}"
            if name in full:
                t.copy_(full[name])


def expert_parallel_case(arch_kw: dict, counts: list[list[int]], *, grouped: bool, slots: int,
                         bucketed: bool = False) -> dict:
    """Two ranks, expert parallelism 2 and tensor parallelism 1: each rank is a replica of its own and the expert-
    parallel group spans both. Per call, rank r generates ``counts[call][r]`` prompts greedily (with stop tokens);
    the reference is the unsharded model's full-recompute greedy decoding on each rank alone."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    rank = dist.get_rank()
    torch.manual_seed(3)
    reference_model = moe_arch(**arch_kw).build()
    reference_model.eval()
    _randomise_expert_bias(reference_model)
    full = {n: t.detach().clone() for n, t in [*reference_model.named_parameters(),
                                                 *reference_model.named_buffers()]}
    calls = []
    for i, per_rank in enumerate(counts):
        prompts = prompts_for(100 * i + rank, per_rank[rank])
        reference = recompute_greedy(reference_model, prompts, NEW_TOKENS) if prompts else []
        stops = stop_tokens(reference)
        calls.append((prompts, stops, truncated(reference, stops)))

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                 expert_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1234)
    model = moe_arch(**arch_kw).build(expert_model_parallel_size=2)
    model.eval()
    _load_expert_parallel(model, full, ep_rank=ps.get_expert_model_parallel_rank())
    if grouped:
        rehome_experts(model)
    generator = _generator(model, slots, bucketed=bucketed)
    out = {"generated": [], "reference": [], "reports": [],
           "spans": generator.runner.spans_replicas, "lockstep": generator.lockstep_group is not None,
           "num_local": [len(layer.experts.local_experts) for layer in generator.runner.moe],
           "paths": [layer.experts_path().__name__ for layer in generator.runner.moe]}
    before = dict(generator.stats)
    for prompts, stops, reference in calls:
        out["generated"].append(_greedy(generator, prompts, stops))
        out["reference"].append(reference)
        out["reports"].append({k: generator.stats[k] - before[k] for k in before if k.startswith("lockstep")
                               or k == "decode_steps"})
        before = dict(generator.stats)
    out["keys"] = generator.graphs.keys() if bucketed else []
    generator.close()
    return out


def refused_case(arch_kw: dict) -> str:
    """One rank: installing the MoE step on a model with a setting it does not support: the ValueError's text."""
    from megatron_hybrid.inference.context import StepContext
    from megatron_hybrid.inference.moe import install_step_moe

    model = moe_arch(**arch_kw).build()
    try:
        install_step_moe(model, StepContext())
    except ValueError as exc:
        return str(exc)
    return ""
