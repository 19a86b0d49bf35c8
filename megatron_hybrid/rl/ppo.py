"""The algorithm pieces of PPO and GRPO, as pure tensor functions (plus two tiny stateful KL controllers).

Legend: B sequences, T response tokens (right-padded; ``mask_BT`` is 1 on real tokens), V_t a tensor-parallel
shard of the vocabulary. Log-probabilities are of the sampled tokens. Every function works on one rank's data;
the two that need statistics over the whole batch (:func:`masked_whiten`) or over the vocabulary
(:func:`vocab_parallel_logprobs_entropy`) take the process group to reduce over.

References: Schulman et al. 2017 (clipped objective), Schulman et al. 2016 (GAE), Ziegler et al. 2019 (KL
penalty and its adaptive controller), Shao et al. 2024 (GRPO: group-relative advantages, KL loss with the k3
estimator).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

KL_ESTIMATORS = ("k1", "abs", "mse", "k3")


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1 (over ``dim``, or everything)."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, group=None, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """``(x − mean) / std`` with mean and (unbiased) variance over the masked positions of the whole batch.

    ``group``: the data-parallel group holding the other parts of the batch (statistics are all-reduced over
    it, so every replica whitens with the same numbers); None for one rank's data alone.
    """
    stats = torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()]).double()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    total, total_sq, count = stats.tolist()
    if count == 0:  # nothing to whiten (every token masked: e.g. all off-policy under partial rollout's mask)
        return x * mask
    mean = total / count
    var = (total_sq - count * mean * mean) / max(count - 1, 1)
    out = (x - mean) / math.sqrt(max(var, 0.0) + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def compute_gae(rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, *, gamma: float,
                lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over right-padded responses; returns ``(advantages, returns)``.

    The value after the last real token is 0 (the episode ends with the response).
    """
    rewards, values = rewards_BT * mask_BT, values_BT * mask_BT
    T = rewards.shape[1]
    last = torch.zeros_like(rewards[:, 0])
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last) * mask_BT[:, t]
        advantages[:, t] = last
    return advantages, (advantages + values) * mask_BT


def kl_per_token(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """A per-token estimate of KL(π ‖ π_ref) from the sampled tokens' log-probabilities.

    ``k1``: log π − log π_ref; ``abs``: its absolute value; ``mse``: ½ (log π − log π_ref)²; ``k3``:
    exp(log π_ref − log π) − (log π_ref − log π) − 1 (non-negative, low variance; GRPO's KL loss).
    """
    diff = logp_BT - ref_logp_BT
    if estimator == "k1":
        return diff
    if estimator == "abs":
        return diff.abs()
    if estimator == "mse":
        return 0.5 * diff.square()
    if estimator == "k3":
        # Clamp as verl does: exp of a large ratio early in training would dominate the loss.
        neg = (-diff).clamp(-20.0, 20.0)
        return (neg.exp() - neg - 1).clamp(-10.0, 10.0)
    raise ValueError(f"KL estimator ({estimator!r}) must be one of {KL_ESTIMATORS}")


def token_rewards(scores_B: torch.Tensor, kl_BT: torch.Tensor, mask_BT: torch.Tensor, *,
                  kl_coef: float) -> torch.Tensor:
    """PPO's per-token reward: −kl_coef · KL on every token, plus the sequence's score on its last token."""
    rewards = -kl_coef * kl_BT * mask_BT
    last = (mask_BT.sum(1).long() - 1).clamp_min(0)
    rewards[torch.arange(rewards.shape[0], device=rewards.device), last] += scores_B.to(rewards.dtype)
    return rewards


def grpo_advantages(scores_B: torch.Tensor, *, group_size: int, normalize_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO's group-relative advantage per sequence: consecutive groups of ``group_size`` answers to one prompt,
    ``(score − group mean) / (group std + eps)`` (unbiased std, as in the paper's implementation)."""
    if scores_B.numel() % group_size:
        raise ValueError(f"the number of sequences ({scores_B.numel()}) is not a multiple of group_size "
                         f"({group_size})")
    groups = scores_B.view(-1, group_size).double()
    adv = groups - groups.mean(1, keepdim=True)
    if normalize_std:
        std = groups.std(1, keepdim=True) if group_size > 1 else torch.zeros_like(groups[:, :1])
        adv = adv / (std + eps)
    return adv.view(-1).to(scores_B.dtype)


def policy_loss(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages_BT: torch.Tensor,
                mask_BT: torch.Tensor, *, clip_ratio: float, clip_ratio_high: Optional[float] = None,
                rollout_logp_BT: Optional[torch.Tensor] = None,
                tis_imp_ratio_cap: Optional[float] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate: mean over tokens of max(−A·r, −A·clip(r, 1−ε, 1+ε_high)), r = π / π_old.

    ``tis_imp_ratio_cap`` C (with ``rollout_logp_BT``, the generator's log-probs of the tokens): truncated
    importance sampling for the mismatch between the generator and the training layout (Yao et al. 2025, verl's
    ``tis_imp_ratio_cap``): each token's term is multiplied by min(π_old / π_rollout, C), detached; the tokens
    were drawn from π_rollout, the surrogate is of π_old.

    Returns the loss and detached statistics (clip fraction, approximate KL to the old policy; with TIS, the
    fraction of tokens whose weight was capped, ``tis_capfrac``).
    """
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    log_ratio = logp_BT - old_logp_BT
    ratio = log_ratio.exp()
    unclipped = -advantages_BT * ratio
    clipped = -advantages_BT * ratio.clamp(1.0 - clip_ratio, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    stats = {}
    if tis_imp_ratio_cap is not None:
        if rollout_logp_BT is None:
            raise ValueError(f"tis_imp_ratio_cap ({tis_imp_ratio_cap}) needs the rollout's log-probs "
                             "(rollout_logp_BT)")
        tis = (old_logp_BT - rollout_logp_BT).detach().exp()
        per_token = per_token * tis.clamp(max=tis_imp_ratio_cap)
        stats["tis_capfrac"] = masked_mean((tis > tis_imp_ratio_cap).float(), mask_BT)
    loss = masked_mean(per_token, mask_BT)
    with torch.no_grad():
        stats.update(clipfrac=masked_mean((clipped > unclipped).float(), mask_BT),
                     approx_kl=masked_mean(0.5 * log_ratio.square(), mask_BT))
    return loss, stats


def rollout_mismatch(old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor,
                     mask_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the generator's log-probs of the sampled tokens are from the training layout's (verl's
    rollout-training mismatch, ``rollout_probs_diff``), over the real tokens: the mean and max of
    |log π_old − log π_rollout|, and the mean, min and max of the importance ratio π_old / π_rollout.

    Keys are ``rollout_mismatch/...``; the ``_max`` and ``_min`` ones are extrema (reduce them as such).
    """
    with torch.no_grad():
        real = mask_BT > 0
        diff = old_logp_BT.float() - rollout_logp_BT.float()
        ratio = diff.exp()
        # Neutral fillers: an empty batch reports no mismatch rather than ±inf.
        return {"rollout_mismatch/logp_abs_diff_mean": masked_mean(diff.abs(), mask_BT),
                "rollout_mismatch/logp_abs_diff_max": torch.where(real, diff.abs(), 0.0).max(),
                "rollout_mismatch/ratio_mean": masked_mean(ratio, mask_BT),
                "rollout_mismatch/ratio_min": torch.where(real, ratio, 1.0).min(),
                "rollout_mismatch/ratio_max": torch.where(real, ratio, 1.0).max()}


def value_loss(values_BT: torch.Tensor, old_values_BT: torch.Tensor, returns_BT: torch.Tensor,
               mask_BT: torch.Tensor, *, clip: Optional[float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """½ · mean over tokens of max((V − R)², (V_clipped − R)²), V_clipped = V_old + clip(V − V_old, ±clip).

    ``clip=None`` turns value clipping off.
    """
    unclipped = (values_BT - returns_BT).square()
    if clip is None:
        loss = 0.5 * masked_mean(unclipped, mask_BT)
        return loss, {"vf_clipfrac": torch.zeros(())}
    v_clipped = old_values_BT + (values_BT - old_values_BT).clamp(-clip, clip)
    clipped = (v_clipped - returns_BT).square()
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask_BT)
    with torch.no_grad():
        stats = {"vf_clipfrac": masked_mean((clipped > unclipped).float(), mask_BT)}
    return loss, stats


def vocab_parallel_logprobs_entropy(logits_BSVt: torch.Tensor, labels_BS: torch.Tensor, *, tp_group=None,
                                    vocab_start: int = 0, vocab_size: Optional[int] = None,
                                    temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(label) and the entropy of p = softmax(logits / temperature) when the vocabulary is split over
    ``tp_group`` (this rank holds rows ``[vocab_start, vocab_start + V_t)``). Differentiable.

    ``vocab_size``: the real vocabulary; padded rows at or above it get no probability.
    """
    logits = logits_BSVt.float() / temperature
    V_t = logits.shape[-1]
    if vocab_size is not None and vocab_start + V_t > vocab_size:
        rows = torch.arange(vocab_start, vocab_start + V_t, device=logits.device)
        # A finite floor, not -inf: p·log p must stay 0·finite for the entropy.
        logits = logits.masked_fill(rows >= vocab_size, -1e9)
    parallel = tp_group is not None and dist.get_world_size(tp_group) > 1
    if parallel:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce
    else:
        def reduce(x, group=None):
            return x
    top = logits.detach().max(-1).values
    if parallel:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_group)
    z = logits - top.unsqueeze(-1)  # a constant shift: no gradient through the max
    e = z.exp()
    sum_e = reduce(e.sum(-1), group=tp_group)
    sum_ez = reduce((e * z).sum(-1), group=tp_group)
    local = labels_BS - vocab_start
    mine = (local >= 0) & (local < V_t)
    picked = z.gather(-1, local.clamp(0, V_t - 1).unsqueeze(-1)).squeeze(-1) * mine
    z_label = reduce(picked, group=tp_group)
    log_sum = sum_e.log()
    return z_label - log_sum, log_sum - sum_ez / sum_e


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, num_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. 2019: nudge the coefficient so the KL tracks ``target`` over a ``horizon`` of samples.

    ``value ← value · (1 + clip(KL / target − 1, −0.2, 0.2) · num_steps / horizon)``.
    """

    def __init__(self, kl_coef: float, *, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL target ({target}) and horizon ({horizon}) must be positive")
        self.value, self.target, self.horizon = float(kl_coef), float(target), float(horizon)

    def update(self, current_kl: float, num_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * num_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


@dataclass
class KLConfig:
    """How the KL to the reference enters: a reward penalty (PPO) and/or a loss term (GRPO)."""

    kl_ctl_type: str = "fixed"
    """fixed or adaptive (the penalty's coefficient)."""
    kl_coef: float = 0.05
    """The penalty's (initial) coefficient; 0 turns the penalty off."""
    kl_target: float = 6.0
    """Adaptive controller: the KL to track."""
    kl_horizon: float = 10000.0
    """Adaptive controller: the horizon, in sequences."""


def make_kl_controller(cfg: KLConfig):
    """The controller of ``cfg.kl_ctl_type``."""
    if cfg.kl_ctl_type == "fixed":
        return FixedKLController(cfg.kl_coef)
    if cfg.kl_ctl_type == "adaptive":
        return AdaptiveKLController(cfg.kl_coef, target=cfg.kl_target, horizon=cfg.kl_horizon)
    raise ValueError(f"kl_ctl_type ({cfg.kl_ctl_type!r}) must be 'fixed' or 'adaptive'")
