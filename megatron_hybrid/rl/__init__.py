"""Reinforcement learning on the HybridEngine: the library half of ``examples/ppo/train_ppo.py``.

One module per piece, over megatron-core:

- :mod:`.arguments`: the recipe's command line (Megatron-LM's flags and ours) and its validation, no collective;
- :mod:`.ppo`: the PPO and GRPO algebra as pure tensor functions (advantages, KL, losses, KL controllers);
- :mod:`.models`: actor, frozen reference, critic (the GPTModel trunk with a scalar :class:`ValueHead`) and
  reward-model I/O on Megatron's training layout;
- :mod:`.passes`: rollout batches and the log-prob/entropy, value and score passes through Megatron's 1F1B
  schedule; :mod:`.routing`: MoE routing replay in those passes (``--moe-enable-routing-replay``) and the count of
  tokens routed differently from the rollout; :mod:`.packing`: packed micro-batches (``--max-tokens-per-micro-batch``);
  :mod:`.balance`: the step's sequences moved between DP ranks so that each trains about the same tokens;
  :mod:`.memory_policy`: the rollout's KV cache sized to the card and the optimizer offloaded when needed;
  :mod:`.partial`: partial rollout across steps (``--partial-rollout``: quotas, parked samples, staleness);
  :mod:`.envs`: multi-turn environments (``--env``: reset/step, loss masks over observations);
  :mod:`.filtering`: DAPO's dynamic sampling (``--filter-groups``: uniform GRPO groups dropped and refilled);
- :mod:`.optimizer`: Megatron DDP + ``get_megatron_optimizer`` + ``OptimizerParamScheduler``, and one update;
- :mod:`.rollout`: generation on the HybridEngine (or, for comparisons, the training layout), with the
  rollout's log-probs at the sampling temperature and its costs;
- :mod:`.pretrained`: ``--pretrained-checkpoint`` (a converted Hugging Face model) in, ``--export-hf`` out;
- :mod:`.checkpoint`: resumable checkpoints in megatron-core's ``dist_checkpointing`` format (any TP/PP);
  :mod:`.metrics`: timing, gathering and logging metrics;
- :mod:`.faults`: stopping on every rank at once on a failing reward function or a non-finite value;
- :mod:`.initialize`: process groups and seeds; :mod:`.tokenizers`: ``--tokenizer-type``;
- :mod:`.phases`: each rank records the phase it is in, so that a collective that times out names the phase, the
  timeout and the ranks that did not arrive;
- :mod:`.data`: prompt files (JSONL, verl's parquet) and each step's prompts; :mod:`.rewards`: built-in
  verifiable rewards, ``--reward-fn`` in either convention (ours, verl's ``compute_score``), held-out accuracy;
- :mod:`.task`: what a run trains on (tokenizer, architecture, prompts, reward), loaded before any process group.
"""

from .arguments import recompute_config, rollout_fp8_config
from .balance import Balance, balance_batch, balanced_partition
from .memory_policy import RolloutMemoryPolicy, graph_reserve_bytes, kv_bytes_per_token
from .partial import PartialRollout, check_resumable, staleness_histogram
from . import filtering
from .envs import Environment, EnvRunner, Episodes, load_env, max_response_tokens
from .checkpoint import load_checkpoint, save_checkpoint
from .data import Example, Prompts, eval_prompts, load_prompt_data
from .faults import StepFailure, check_finite, flag_values, reward_scores
from .initialize import initialize
from .metrics import MetricsLogger, StepTimer, aggregate_metrics, peak_flops, summary, training_flops
from .models import (ValueHead, architecture_from_args, build_critic, build_reference, build_stage, copy_weights,
                     load_parameters, load_value_model, parameters_state, save_value_model, wrap_ddp)
from .optimizer import (TrainedModel, UpdateResult, build_scheduler, optimizer_config, setup_model_and_optimizer,
                        update)
from .passes import (Batch, LossFn, PassConfig, TrainingPasses, make_batch, padded_seq_length, response_values,
                     token_mean)
from .phases import PhaseRecorder, PhaseTimeout, phase, recorded, recording
from .rewards import (Reward, accuracy, build_reward, decode_response, evaluate_accuracy, exact_match,
                      format_score)
from .pretrained import export_hf, load_pretrained, model_architecture, model_args_from_checkpoint
from .rollout import EngineCall, generation_config, Rollout, generate_in_training_layout, generate_on_engine
from .task import Task, load_task
from .tokenizers import build_tokenizer

__all__ = ["Batch", "EngineCall", "LossFn", "MetricsLogger", "PassConfig", "StepFailure", "TrainedModel",
           "TrainingPasses", "UpdateResult", "ValueHead", "aggregate_metrics", "architecture_from_args", "build_critic",
           "build_reference", "build_scheduler", "build_stage", "build_tokenizer", "check_finite", "copy_weights",
           "generate_in_training_layout", "generate_on_engine", "initialize", "load_checkpoint", "load_parameters",
           "load_value_model", "make_batch", "optimizer_config", "parameters_state", "response_values",
           "reward_scores", "save_checkpoint", "save_value_model", "setup_model_and_optimizer", "summary", "update",
           "wrap_ddp"]
__all__ += ["export_hf", "load_pretrained", "model_architecture", "model_args_from_checkpoint"]
__all__ += ["generation_config", "Example", "Prompts", "Reward", "Task", "load_task", "accuracy", "build_reward", "decode_response", "eval_prompts",
            "evaluate_accuracy", "exact_match", "format_score", "load_prompt_data"]
__all__ += ["Rollout", "StepTimer", "padded_seq_length"]
__all__ += ["flag_values", "recompute_config", "rollout_fp8_config", "token_mean"]
__all__ += ["Balance", "balance_batch", "balanced_partition"]
__all__ += ["RolloutMemoryPolicy", "graph_reserve_bytes", "kv_bytes_per_token"]
__all__ += ["peak_flops", "training_flops"]
__all__ += ["PartialRollout", "check_resumable", "staleness_histogram"]
__all__ += ["Environment", "EnvRunner", "Episodes", "load_env", "max_response_tokens"]
__all__ += ["PhaseRecorder", "PhaseTimeout", "phase", "recorded", "recording"]
