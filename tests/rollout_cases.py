"""Rank bodies for the rollout (generation) tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.engine_cases import arch

VOCAB = 250


def prompts_for(dp_rank: int, uneven: bool) -> list[list[int]]:
    g = torch.Generator().manual_seed(100 + dp_rank)
    count = 1 + (dp_rank * 2) % 5 if uneven else 3
    return [torch.randint(0, VOCAB, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def _model(state):
    from megatron.core import parallel_state as ps

    from megatron_hybrid.megatron.sharding import load_full_state_dict

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    model = arch().build(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    load_full_state_dict([model], state, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp)
    return model


def generation_case(rollout_tp: int, rollout_pp: int, state: dict, uneven: bool):
    from megatron.core import parallel_state as ps
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.forward import gather_vocab, pipeline_forward
    from megatron_hybrid.inference import generate_with_model

    model = _model(state)
    engine = HybridEngine(model, RolloutLayout(rollout_tp, rollout_pp))
    prompts = prompts_for(ps.get_data_parallel_rank(), uneven)
    greedy = SamplingParams(temperature=1.0, top_k=1, num_tokens_to_generate=6, return_log_probs=True)
    results = engine.generate(prompts, greedy, vocab_size=VOCAB)
    engine.switch_to_training()
    # The same greedy generation with the training-layout model on its own groups.
    reference = generate_with_model(model, prompts, greedy, tp_group=ps.get_tensor_model_parallel_group(),
                                    pp_group=ps.get_pipeline_model_parallel_group(), vocab_size=VOCAB)
    # Log-probs of the generated tokens under a training-layout forward over the full sequences.
    forward_logps = []
    for r in results:
        seq = torch.tensor([r.prompt_tokens + r.generated_tokens])
        pos = torch.arange(seq.shape[1]).unsqueeze(0)
        with torch.no_grad():
            logits = pipeline_forward(model, ps.get_pipeline_model_parallel_group(), seq, pos)
        if logits is not None:
            full = gather_vocab(logits, ps.get_tensor_model_parallel_group()).float()[0]
            full[:, VOCAB:] = float("-inf")
            n = len(r.prompt_tokens)
            lp = full[n - 1: -1].log_softmax(-1).gather(-1, torch.tensor(r.generated_tokens).unsqueeze(-1))
            forward_logps.append(lp.squeeze(-1).tolist())
    # Sampling with a seed: the same tokens whatever the rank inside a replica.
    sampled = engine.generate(prompts, SamplingParams(temperature=0.8, top_k=20, top_p=0.9,
                                                      num_tokens_to_generate=4), vocab_size=VOCAB, seed=3)
    engine.switch_to_training()
    return {"prompts": prompts, "results": [(r.prompt_tokens, r.generated_tokens, r.generated_log_probs)
                                            for r in results],
            "reference": [(r.prompt_tokens, r.generated_tokens) for r in reference],
            "forward_logps": forward_logps or None, "dp": ps.get_data_parallel_rank(),
            "sampled": [r.generated_tokens for r in sampled]}


def offload_case():
    """Optimizer states and gradient buffers leave the device while rolling out and come back bit-exact."""
    from megatron.core import parallel_state as ps

    from megatron_hybrid import HybridEngine, RolloutLayout

    tp = ps.get_tensor_model_parallel_world_size()
    model = arch().build(tensor_model_parallel_size=tp)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    before = {k: {n: v.clone() for n, v in s.items() if torch.is_tensor(v)} for k, s in opt.state.items()}
    grads_before = [p.grad.clone() for p in model.parameters()]
    engine = HybridEngine(model, RolloutLayout(1, 1))
    engine.switch_to_rollout(offload_optimizer=opt, offload_grads=True)
    resident = sum(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values()
                   if torch.is_tensor(v) and v.dim() > 0)
    grad_resident = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    engine.switch_to_training()
    same = all(torch.equal(opt.state[k][n], v) for k, s in before.items() for n, v in s.items())
    same_grads = all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads_before))
    ptrs_ok = all(p.grad is not None for p in model.parameters())
    dist.barrier()
    return {"resident": resident, "grad_resident": grad_resident, "same": same, "same_grads": same_grads,
            "ptrs_ok": ptrs_ok}



class _TokenIds:
    """A tokenizer for token-id prompts: Megatron's controller only detokenizes for display."""

    def __init__(self, vocab):
        self.vocab_size, self.eod, self.bos, self.pad = vocab, 0, None, 0

    def detokenize(self, ids, **kwargs):
        return " ".join(map(str, ids))

    def tokenize(self, text):
        return [int(x) for x in text.split()]

    def offsets(self, ids, text):
        return list(range(len(ids)))

def static_engine_case(state):
    """Megatron's static inference engine runs on the rollout model (p = p_g = 1: its PP helpers read globals)."""
    from megatron.core import parallel_state as ps
    from megatron.core.inference.inference_request import InferenceRequest
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_hybrid import HybridEngine, RolloutLayout
    from megatron_hybrid.megatron.compat import static_inference_engine
    from megatron_hybrid.megatron.sharding import load_full_state_dict

    tp = ps.get_tensor_model_parallel_world_size()
    model = arch().build(tensor_model_parallel_size=tp)
    load_full_state_dict([model], state, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp)
    engine = HybridEngine(model, RolloutLayout(1, 1))
    engine.switch_to_rollout()
    rm = engine.rollout_model
    eng = static_inference_engine(rm, pg_collection=engine.pg_collection, tokenizer=_TokenIds(250),
                                  max_batch_size=4, max_sequence_length=64)
    sp = SamplingParams(top_k=1, num_tokens_to_generate=5, return_log_probs=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    requests = [InferenceRequest(request_id=str(i), prompt=" ".join(map(str, p)), prompt_tokens=p, sampling_params=sp)
                for i, p in enumerate(prompts)]
    out = eng.generate(inference_requests=requests)
    mega = [list(map(int, r.generated_tokens)) for r in out]
    ours = [r.generated_tokens for r in engine.generate(prompts, sp)]
    return mega, ours
