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

import warnings
from typing import Optional

import torch

from ..kernels import use_triton
from .topp_kernel import top_p_race


_TOP_P_KERNEL_OK = True


def _disable_top_p_kernel(exc: Exception) -> None:
    global _TOP_P_KERNEL_OK
    _TOP_P_KERNEL_OK = False
    warnings.warn(f"megatron_hybrid: the top-p kernel failed ({exc!r}); top-p sampling sorts the vocabulary instead",
                  RuntimeWarning, stacklevel=3)


def is_greedy(params) -> bool:
    """Whether ``params`` (a ``SamplingParams``) select the most likely token."""
    return int(params.top_k or 0) == 1 or float(params.temperature) == 0.0


def sample(logits_nV: torch.Tensor, params, *, vocab_size: int, generator: Optional[torch.Generator] = None,
           noise_nV: Optional[torch.Tensor] = None,
           tempered_log_probs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits_nV`` from its first ``vocab_size`` entries (the padded rows of the
    vocabulary are never candidates).

    The race's ``Exp(1)`` draws come from ``generator``, or are ``noise_nV`` (``[n, vocab_size]``, drawn by the
    caller: a CUDA graph of this function reads them at a fixed address, see :func:`draw_noise`).

    Returns ``(tokens [n] int64, log_probs [n] float32)``; with ``tempered_log_probs`` the log-probs are ``[n, 2]``:
    untempered, and of softmax(logits / temperature) (the untempered ones again at temperature 0). Either way the
    tokens, and the generator's draws, are the same.
    """
    logits = logits_nV[:, :vocab_size].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    temperature = float(params.temperature)
    # The tempered logits, made where a path reads them (at temperature 1, or 0: greedy, they are the logits).
    x = logits if temperature in (0.0, 1.0) else None
    tempered = None
    if tempered_log_probs:  # at temperature 1 (or 0) x is the logits: the same log-probs
        if x is None:
            x = logits / temperature
        tempered = log_probs if temperature in (0.0, 1.0) else torch.log_softmax(x, dim=-1)
    top_k, top_p = int(params.top_k or 0), float(params.top_p or 0.0)
    tokens = None
    if is_greedy(params):
        tokens = logits.argmax(dim=-1)
    elif _TOP_P_KERNEL_OK and (top_k == 0 or top_k >= vocab_size) and 0.0 < top_p < 1.0 and use_triton(logits_nV):
        # Top-p alone on a GPU: the race restricted to the nucleus by rejection in one kernel, no sort (see
        # topp_kernel; exact ties at the boundary are all kept, where the sort below keeps them in its order).
        race = noise_nV if noise_nV is not None else torch.empty_like(logits).exponential_(generator=generator)
        try:
            tokens = top_p_race(logits_nV, race, vocab_size=vocab_size, temperature=temperature, top_p=top_p)
        except Exception as exc:  # a Triton that cannot build the kernel: the sort below, for the process's life
            _disable_top_p_kernel(exc)
    if tokens is None and not is_greedy(params):
        if x is None:
            x = logits / temperature
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
        race = noise_nV if noise_nV is not None else torch.empty_like(probs).exponential_(generator=generator)
        # A zero draw would make p / E infinite (or NaN where p = 0): floor it at the smallest normal float.
        tokens = (probs / race.clamp(min=torch.finfo(torch.float32).tiny)).argmax(dim=-1)
    picked = tokens.unsqueeze(-1)
    if tempered is None:
        return tokens, log_probs.gather(-1, picked).squeeze(-1)
    return tokens, torch.cat([log_probs.gather(-1, picked), tempered.gather(-1, picked)], dim=-1)


def draw_noise(out_nV: torch.Tensor, params, generator: torch.Generator) -> None:
    """Fill ``out_nV`` with the ``Exp(1)`` draws :func:`sample` takes for one step (nothing when greedy): the same
    draws, in the same order, that it would make itself for logits of that shape."""
    if not is_greedy(params):
        out_nV.exponential_(generator=generator)
