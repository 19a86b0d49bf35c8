"""Generation on the rollout layout, and the micro-DP data flow around it (HybridFlow §5.2, steps 2–3).

Each training DP rank holds its prompts. Its d_g rollout replicas (one per micro-DP group member) each generate a
contiguous chunk of them; the results are all-gathered over the micro-DP group, so every training rank gets
exactly its own prompts' results, in order.

Generation here is a plain autoregressive loop over the rollout model's pipeline (no KV cache: each step
recomputes the prefix): exact and layout-agnostic, which is what the tests and small recipes need. Sampling
follows megatron-core's ``SamplingParams`` (temperature, top_k, top_p, num_tokens_to_generate, termination_id).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .forward import gather_vocab, pipeline_forward


@dataclass
class GenerationResult:
    """One prompt's generation."""

    prompt_tokens: list[int]
    generated_tokens: list[int] = field(default_factory=list)
    generated_log_probs: list[float] = field(default_factory=list)
    """log p(token) under the model's (untempered) distribution over the real vocabulary."""


def _sample(logits_BV: torch.Tensor, params, generator: torch.Generator) -> torch.Tensor:
    top_k, top_p, temperature = int(params.top_k or 0), float(params.top_p or 0.0), float(params.temperature)
    if top_k == 1 or temperature == 0.0:
        return logits_BV.argmax(dim=-1)
    logits = logits_BV / temperature
    if top_k > 1:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits_BV.device)


def generate_tokens(chunk: torch.nn.Module, *, tp_group, pp_group, prompts: Sequence[Sequence[int]], params,
                    vocab_order: Optional[list[int]] = None, vocab_size: Optional[int] = None,
                    stop_token_ids: Sequence[int] = (), seed: int = 0) -> list[GenerationResult]:
    """Generate for ``prompts`` with one model replica (its TP and PP groups); every rank gets the results."""
    results = [GenerationResult(list(p)) for p in prompts]
    if not prompts:
        return results
    device = next(chunk.parameters()).device
    stops = set(stop_token_ids)
    if params.termination_id is not None:
        stops.add(int(params.termination_id))
    generator = torch.Generator().manual_seed(seed)
    seqs = [list(p) for p in prompts]
    done = [False] * len(seqs)
    last = dist.get_process_group_ranks(pp_group)[-1]
    for _ in range(int(params.num_tokens_to_generate)):
        active = [i for i, d in enumerate(done) if not d]
        if not active:
            break
        width = max(len(seqs[i]) for i in active)
        # Right-padded: with causal attention the logits at each sequence's last real position ignore the padding.
        tokens = torch.zeros(len(active), width, dtype=torch.long)
        for row, i in enumerate(active):
            tokens[row, : len(seqs[i])] = torch.tensor(seqs[i])
        tokens = tokens.to(device)
        positions = torch.arange(width, device=device).expand(len(active), -1)
        with torch.no_grad():
            logits = pipeline_forward(chunk, pp_group, tokens, positions)
        picked = torch.empty(len(active), dtype=torch.long, device=device)
        logp = torch.empty(len(active), dtype=torch.float32, device=device)
        if logits is not None:
            full = gather_vocab(logits, tp_group, vocab_order).float()
            ends = torch.tensor([len(seqs[i]) - 1 for i in active], device=device)
            step_logits = full[torch.arange(len(active), device=device), ends]
            if vocab_size is not None:
                step_logits[:, vocab_size:] = float("-inf")  # padded vocabulary rows are no tokens
            picked = _sample(step_logits, params, generator)
            logp = step_logits.log_softmax(dim=-1).gather(-1, picked.unsqueeze(-1)).squeeze(-1)
        if pp_group.size() > 1:
            dist.broadcast(picked, src=last, group=pp_group)
            dist.broadcast(logp, src=last, group=pp_group)
        for row, i in enumerate(active):
            tok = int(picked[row])
            seqs[i].append(tok)
            results[i].generated_tokens.append(tok)
            results[i].generated_log_probs.append(float(logp[row]))
            if tok in stops:
                done[i] = True
    return results


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) chunks of n items over ``parts`` takers, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for j in range(parts):
        end = start + base + (1 if j < extra else 0)
        out.append((start, end))
        start = end
    return out
