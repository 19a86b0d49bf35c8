"""Next-token sampling on the device, with megatron-core's ``SamplingParams`` semantics.

Greedy when ``top_k == 1`` or ``temperature == 0``; otherwise the logits are divided by the temperature, cut to the
``top_k`` largest (``top_k > 1``) and to the smallest prefix of mass ``top_p`` (``0 < top_p < 1``), and a token is
drawn from the renormalised distribution by the exponential-race trick: ``argmax(p / E)`` with ``E ~ Exp(1)``
i.i.d. picks index i with probability ``p_i``, with one random draw per entry from a ``torch.Generator`` on the
logits' device and no host round trip. Ranks that give the same logits to generators in the same state draw the same
tokens (tensor-parallel ranks of one rollout replica do).

Log-probabilities are those of the untempered, uncut distribution over the real vocabulary: what the policy
assigns to the token. On request, also those at the sampling temperature (still uncut by top-k/top-p): what an RL
recipe's training passes at that temperature compute for the same token, so the two can be compared.

Legend: n rows (sequences), V the output layer's (padded) vocabulary.
"""

from __future__ import annotations

import torch


def is_greedy(params) -> bool:
    """Whether ``params`` (a ``SamplingParams``) select the most likely token."""
    return int(params.top_k or 0) == 1 or float(params.temperature) == 0.0


def sample(logits_nV: torch.Tensor, params, *, vocab_size: int, generator: torch.Generator,
           tempered_log_probs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits_nV`` from its first ``vocab_size`` entries (the padded rows of the
    vocabulary are never candidates).

    Returns ``(tokens [n] int64, log_probs [n] float32)``; with ``tempered_log_probs`` the log-probs are ``[n, 2]``:
    untempered, and of softmax(logits / temperature) (the untempered ones again at temperature 0). Either way the
    tokens, and the generator's draws, are the same.
    """
    logits = logits_nV[:, :vocab_size].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    temperature = float(params.temperature)
    x = logits / temperature if temperature > 0 else logits
    tempered = None
    if tempered_log_probs:  # at temperature 1 (or 0: greedy on the logits) x is the logits: the same log-probs
        tempered = log_probs if temperature in (0.0, 1.0) else torch.log_softmax(x, dim=-1)
    if is_greedy(params):
        tokens = logits.argmax(dim=-1)
    else:
        top_k, top_p = int(params.top_k or 0), float(params.top_p or 0.0)
        if top_k > 1:
            kth = x.topk(top_k, dim=-1).values[:, -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if 0.0 < top_p < 1.0:
            sorted_x, order = x.sort(dim=-1, descending=True)
            probs = sorted_x.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does.
            sorted_x = sorted_x.masked_fill(probs.cumsum(dim=-1) - probs > top_p, float("-inf"))
            x = torch.empty_like(x).scatter_(-1, order, sorted_x)
        probs = x.softmax(dim=-1)
        race = torch.empty_like(probs).exponential_(generator=generator)
        # A zero draw would make p / E infinite (or NaN where p = 0): floor it at the smallest normal float.
        tokens = (probs / race.clamp_(min=torch.finfo(torch.float32).tiny)).argmax(dim=-1)
    picked = tokens.unsqueeze(-1)
    if tempered is None:
        return tokens, log_probs.gather(-1, picked).squeeze(-1)
    return tokens, torch.cat([log_probs.gather(-1, picked), tempered.gather(-1, picked)], dim=-1)
