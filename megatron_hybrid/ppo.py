"""The PPO and GRPO algebra, at its former path (deprecated): it lives in :mod:`megatron_hybrid.rl.ppo`. Kept so
that ``from megatron_hybrid import ppo`` keeps working; importing it warns."""

import warnings

from .rl.ppo import (KL_ESTIMATORS, AdaptiveKLController, FixedKLController, KLConfig, compute_gae, grpo_advantages,
                     kl_per_token, make_kl_controller, masked_mean, masked_whiten, policy_loss, rollout_mismatch,
                     token_rewards, value_loss, vocab_parallel_logprobs_entropy)

warnings.warn("megatron_hybrid.ppo is deprecated: import from megatron_hybrid.rl.ppo (from megatron_hybrid.rl "
              "import ppo)", DeprecationWarning, stacklevel=2)

__all__ = ["KL_ESTIMATORS", "AdaptiveKLController", "FixedKLController", "KLConfig", "compute_gae", "grpo_advantages",
           "kl_per_token", "make_kl_controller", "masked_mean", "masked_whiten", "policy_loss", "rollout_mismatch",
           "token_rewards", "value_loss", "vocab_parallel_logprobs_entropy"]
