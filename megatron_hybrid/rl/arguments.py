"""Command-line arguments: the Megatron-LM subset our recipes use, under Megatron-LM's names, and ours.

:func:`add_hybrid_args` follows Megatron-LM's ``extra_args_provider`` convention (it takes the parser and returns
it), so a Megatron-LM launch script can add the rollout layout and the RL settings to its own arguments:
``initialize_megatron(extra_args_provider=add_hybrid_args)``. :func:`add_megatron_args` adds the Megatron-LM
flags themselves, for standalone recipes. :func:`validate_args` checks everything that can be checked without a
collective and raises ``ValueError`` naming the values; its range check, :func:`~megatron_hybrid.checks.check_number`,
is shared with the tools.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import os
import re
import warnings

from ..checks import check_number, flag_name, output_dir_error, with_flag_names
from ..constraints import Sizes, check
from ..core_attention import ATTENTION_BACKENDS, TRANSFORMER_ENGINE_BACKENDS, check_attention_backend
from ..layout import ParallelLayout, RolloutLayout
from ..megatron import GPTArchitecture
from ..modes import WeightMode
from ..validation import check_expert_layout
from .data import data_file_error
from .initialize import select_device
from .memory_policy import check_fraction
from .models import MOE_FLAGS, architecture_from_args
from .pretrained import model_args_from_checkpoint
from .rewards import load_callable, resolved_reward_type, reward_fn_style

TOKENIZER_TYPES = ("NullTokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer")
#: The built-in tiny model: the model flags' values when neither the command line nor --pretrained-checkpoint
#: gives them.
TINY_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=False, swiglu=False,
                  normalization="RMSNorm", position_embedding_type="rope", untie_embeddings_and_output_weights=False,
                  max_position_embeddings=256, make_vocab_size_divisible_by=8)


#: The MoE flags' values when neither the command line nor --pretrained-checkpoint gives them (with --num-experts):
#: GPTArchitecture's defaults, which are Megatron-LM's.
MOE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GPTArchitecture) if f.name in MOE_FLAGS[1:]}


def moe_layer_freq(text: str) -> int | list[int]:
    """``--moe-layer-freq``'s type, as Megatron-LM reads it: an integer N ≥ 1 (every N-th layer from layer 0 is an
    MoE layer) or a list of 0/1, one per layer (``"[1,0,1,0]"``; read as a literal: Megatron-LM also evaluates
    expressions such as ``"([1]*3+[0])*2"``, which we do not run)."""
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        value = None
    if type(value) is int and value >= 1:
        return value
    if isinstance(value, list) and value and all(type(v) is int and v in (0, 1) for v in value):
        return value
    raise argparse.ArgumentTypeError(f"{text!r} is neither an integer ≥ 1 nor a list of 0/1 per layer such as "
                                     "'[1,0,1,0]' (an expression like '([1]*3+[0])*2' is not evaluated: write the "
                                     "list out)")


def add_megatron_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's model, parallelism, training, checkpoint and tokenizer flags (the subset we use)."""
    _add_model_args(parser)
    _add_moe_args(parser)
    _add_parallel_args(parser)
    _add_training_args(parser)
    _add_optimizer_args(parser)
    _add_checkpoint_args(parser)
    _add_tokenizer_args(parser)
    return parser


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model's shape. Unset (None) unless given: :func:`validate_args` fills them from
    ``--pretrained-checkpoint``, else from :data:`TINY_MODEL`."""
    g = parser.add_argument_group("model (Megatron-LM names; default: --pretrained-checkpoint's, else the built-in "
                                  "tiny model's)")
    g.add_argument("--num-layers", type=int, default=None, help="tiny model: 2")
    g.add_argument("--hidden-size", type=int, default=None, help="tiny model: 64")
    g.add_argument("--num-attention-heads", type=int, default=None, help="tiny model: 4")
    g.add_argument("--group-query-attention", action="store_true", default=None)
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="tiny model: 4 × hidden size")
    g.add_argument("--swiglu", action="store_true", default=None)
    g.add_argument("--normalization", choices=["RMSNorm", "LayerNorm"], default=None, help="tiny model: RMSNorm")
    g.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"], default=None,
                   help="tiny model: rope")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="tiny model: 256")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=None, help="tiny model: 8")


def _add_moe_args(parser: argparse.ArgumentParser) -> None:
    """The mixture-of-experts flags; unset unless given, like the model's: :func:`validate_args` fills them from
    ``--pretrained-checkpoint``, else (with ``--num-experts``) from :data:`MOE_DEFAULTS`."""
    g = parser.add_argument_group("mixture of experts (Megatron-LM names; default: --pretrained-checkpoint's, else "
                                  "a dense model; the values in brackets are Megatron-LM's defaults)")
    g.add_argument("--num-experts", type=int, default=None, help="routed experts per MoE layer (unset: dense)")
    g.add_argument("--moe-router-topk", type=int, default=None, help="experts per token [2]")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="each expert's hidden size "
                   "[--ffn-hidden-size]")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="the shared experts' total hidden size [none]")
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default=None, help="[softmax]")
    g.add_argument("--moe-router-pre-softmax", action="store_true", default=None,
                   help="top-k weights from the softmax over all experts (not renormalised over the top k)")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true", default=None,
                   help="aux-loss-free balancing by a per-expert routing bias (sigmoid scores)")
    g.add_argument("--moe-shared-expert-gate", action="store_true", default=None,
                   help="a learnt sigmoid gate on the shared experts' output (Qwen2-MoE)")
    g.add_argument("--moe-layer-freq", type=moe_layer_freq, default=None,
                   help="N: every N-th layer from layer 0 is an MoE layer; or a list of 0/1 per layer, "
                   "\"[1,0,1,0]\" [1]")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=None, help="weight of the load-balancing loss in "
                   "the training loss [0]; a training setting: it may differ from --pretrained-checkpoint's")
    g.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "none"], default=None,
                   help="[aux_loss]; a training setting, like --moe-aux-loss-coeff")
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"], default=None,
                   help="[allgather]; alltoall needs NCCL on megatron-core 0.16.1; a training setting")


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """The training layout, the device, the process groups' timeout, sequence parallelism, the core attention, and
    the distributed optimizer with its overlaps and CPU offload."""
    g = parser.add_argument_group("parallelism (Megatron-LM names)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=2)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1, help="ranks the routed experts of a layer "
                   "are split over (MoE models)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="tensor-parallel size of each "
                   "routed expert (MoE models; default: --tensor-model-parallel-size)")
    g.add_argument("--device", choices=["cuda", "cpu"], default=None, help="where the ranks run (default: one GPU "
                   "per rank where GPUs are visible, else the CPU). cpu hides the GPUs from this process before "
                   "torch initialises CUDA (as CUDA_VISIBLE_DEVICES= does): gloo on the CPU, e.g. 4 ranks of the "
                   "built-in demo on a machine with one GPU")
    # A float, unlike Megatron-LM's int: short timeouts (tests, quick failure on a small job) are fractions.
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="timeout of every collective, on every process group (fractions allowed); raise it above "
                   "the longest generation phase and checkpoint write, not only the switch")
    g.add_argument("--sequence-parallel", action="store_true", help="split the norms' and dropouts' activations "
                   "along the sequence over the tensor-parallel group in training (needs TP > 1; the rollout model "
                   "runs without it); actor, reference and critic")
    # Megatron-LM's Transformer Engine values parse too, so that validate_args can say why they are refused.
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS + TRANSFORMER_ENGINE_BACKENDS, default=None,
                   help="the training models' core attention (actor, reference, critic; the rollout keeps its own): "
                   "local (megatron-core's DotProductAttention), sdpa (torch's scaled_dot_product_attention: flash, "
                   "cuDNN and memory-efficient kernels on a GPU; packs in one varlen flash call), flex (torch's "
                   "flex_attention, compiled; GPU only for training) or auto (sdpa for now). Default: sdpa on a GPU "
                   "(packed sdpa trains 6.25x padded local's tokens/s on an H100, bench/results/train_pass_h100.json), "
                   "local on the CPU. Megatron-LM's flash, fused and unfused need Transformer Engine and are refused")
    g.add_argument("--use-distributed-optimizer", action="store_true", help="shard the optimizer's states and "
                   "fp32 main parameters over data-parallel ranks (megatron-core's DistributedOptimizer); actor "
                   "and critic")
    g.add_argument("--overlap-grad-reduce", action="store_true", help="overlap DDP's gradient reduction with the "
                   "backward pass")
    g.add_argument("--overlap-param-gather", action="store_true", help="overlap the distributed optimizer's "
                   "parameter all-gather with the next forward (needs --use-distributed-optimizer and "
                   "--overlap-grad-reduce)")
    g.add_argument("--optimizer-cpu-offload", action="store_true", help="megatron-core's optimizer CPU offload "
                   "(HybridDeviceOptimizer): the fp32 main parameters and Adam states of --optimizer-offload-fraction "
                   "of the parameters live and step on the host (needs --use-distributed-optimizer and "
                   "--use-precision-aware-optimizer, as in Megatron-LM: without it the distributed optimizer keeps a "
                   "second fp32 copy of the parameters on the GPU)")
    g.add_argument("--optimizer-offload-fraction", type=float, default=1.0,
                   help="with --optimizer-cpu-offload: the share of the parameters whose optimizer steps on the host")
    g.add_argument("--use-precision-aware-optimizer", action="store_true", help="keep main parameters and states "
                   "in the optimizer's own precision (megatron-core; needs --use-distributed-optimizer, and "
                   "Transformer Engine's FusedAdam unless --optimizer-cpu-offload)")
    g.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true", help="with --optimizer-cpu-offload: "
                   "overlap the host optimizer's copies with its step")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    """The batch sizes, the iterations, the seed, bf16 and activation recompute."""
    g = parser.add_argument_group("training (Megatron-LM names)")
    g.add_argument("--micro-batch-size", type=int, default=8, help="sequences per micro-batch")
    g.add_argument("--max-tokens-per-micro-batch", type=int, default=None, help="pack the training passes' "
                   "sequences without padding into micro-batches of at most this many tokens (first-fit decreasing; "
                   "verl's ppo_max_token_len_per_gpu, slime's --max-tokens-per-gpu) instead of --micro-batch-size "
                   "sequences padded to the longest; at least the longest prompt + --max-new-tokens. Needs "
                   "--attention-backend sdpa, flex or auto; with pipeline parallelism every pack is padded to it")
    g.add_argument("--global-batch-size", type=int, default=32, help="sequences per step, over all DP replicas")
    g.add_argument("--train-iters", type=int, default=30)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 main parameters in the optimizer")
    add_recompute_args(g)


def _add_optimizer_args(parser: argparse.ArgumentParser) -> None:
    """Adam's settings, gradient clipping and the learning-rate schedule."""
    g = parser.add_argument_group("optimizer and learning-rate schedule (Megatron-LM names: megatron-core's Adam "
                                  "and OptimizerParamScheduler)")
    g.add_argument("--lr", type=float, default=3e-3, help="the peak learning rate (the actor's)")
    g.add_argument("--min-lr", type=float, default=0.0, help="the rate the decay ends at")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="iterations of linear warmup from 0")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="constant",
                   help="after warmup (Megatron-LM's default is linear; RL keeps the rate constant as a rule)")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="iterations from 0 to the end of the decay "
                   "(default: --train-iters)")
    g.add_argument("--weight-decay", type=float, default=0.01, help="decoupled (AdamW); none on biases and norms")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="gradient-norm clipping (0: off)")


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    """The pretrained model to start from, the Hugging Face export, and the checkpoints to load and save."""
    g = parser.add_argument_group("checkpoints (Megatron-LM names)")
    g.add_argument("--pretrained-checkpoint", default=None, help="start from this converted Hugging Face model "
                   "(tools/convert_checkpoint.py hf-to-megatron): architecture, vocabulary, tokenizer and weights of "
                   "actor, reference and critic trunk; a fresh run (step 0, fresh optimizer)")
    g.add_argument("--export-hf", default=None, help="write the trained actor here at the end as a Hugging Face "
                   "model (needs --pretrained-checkpoint: its family, config and tokenizer)")
    g.add_argument("--export-hf-interval", type=int, default=None, help="also export every N steps, into "
                   "--export-hf DIR/iter_NNNNNNN")
    g.add_argument("--load", default=None, help="resume from this directory (its latest iteration)")
    g.add_argument("--save", default=None, help="write checkpoints here")
    g.add_argument("--save-interval", type=int, default=None, help="steps between checkpoints (default: at the "
                   "end only)")


def _add_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    """The tokenizer and, for the synthetic one, the vocabulary size."""
    g = parser.add_argument_group("tokenizer (Megatron-LM names)")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="NullTokenizer")
    g.add_argument("--tokenizer-model", default=None, help="HuggingFaceTokenizer: a directory; "
                   "SentencePieceTokenizer: a .model file")
    g.add_argument("--vocab-size", type=int, default=16, help="NullTokenizer: the synthetic vocabulary size")


RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


def add_recompute_args(group) -> None:
    """Megatron-LM's activation-recompute flags (names, choices and meaning) on ``group`` (a parser or an argument
    group); :func:`check_recompute` checks them, :func:`recompute_config` turns them into ``TransformerConfig``
    fields. Unset: no recompute."""
    group.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, default=None,
                       help="activation recompute in the training passes of the actor and the critic (default: "
                       "none): full keeps only each recomputed chunk's input and reruns its layers in the backward "
                       "pass (needs --recompute-method and --recompute-num-layers); selective reruns the core "
                       "attention of every layer (megatron-core's default module, core_attn), which saves the "
                       "local backend's [b, heads, s, s] attention scores, little with sdpa or flex")
    group.add_argument("--recompute-method", choices=RECOMPUTE_METHODS, default=None,
                       help="with --recompute-granularity full: uniform splits each pipeline stage's layers into "
                       "chunks of --recompute-num-layers and recomputes every chunk; block recomputes the first "
                       "--recompute-num-layers layers of each stage and keeps the others' activations")
    group.add_argument("--recompute-num-layers", type=int, default=None,
                       help="with --recompute-granularity full: layers per chunk (uniform) or layers recomputed per "
                       "pipeline stage (block), 1 to the layers per stage")


def check_recompute(granularity: str | None, method: str | None, num_layers: int | None, *,
                    layers_per_stage: int, layers_from: str) -> None:
    """``ValueError`` naming the flag and its value unless the recompute flags are a combination Megatron-LM runs:
    megatron-core's ``TransformerConfig`` checks (full needs a method and a layer count; selective takes no layer
    count) and Megatron-LM's own (selective takes no method), before any process group; a method or a layer count
    without ``--recompute-granularity`` (which Megatron-LM ignores) is refused too, so that a run never trains
    without the recompute it asked for. ``layers_per_stage`` bounds the layer count (``layers_from``: where that
    number comes from, for the message)."""
    if num_layers is not None:
        check_number("--recompute-num-layers", num_layers, ge=1)
    given = [f"{flag} ({value})" for flag, value in (("--recompute-method", method),
                                                     ("--recompute-num-layers", num_layers)) if value is not None]
    if granularity is None:
        if given:
            raise ValueError(f"{' and '.join(given)}: for --recompute-granularity full, which is not given (no "
                             "recompute without it)")
        return
    if granularity not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"--recompute-granularity ({granularity}) must be one of {', '.join(RECOMPUTE_GRANULARITIES)}")
    if granularity == "selective":
        if given:
            raise ValueError(f"{' and '.join(given)}: for --recompute-granularity full; selective recomputes the "
                             "core attention of every layer and takes neither (as in Megatron-LM)")
        return
    if method is None:
        raise ValueError(f"--recompute-granularity full needs --recompute-method ({' or '.join(RECOMPUTE_METHODS)}), "
                         "as in Megatron-LM")
    if method not in RECOMPUTE_METHODS:
        raise ValueError(f"--recompute-method ({method}) must be one of {', '.join(RECOMPUTE_METHODS)}")
    if num_layers is None:
        raise ValueError(f"--recompute-granularity full needs --recompute-num-layers (1 to the layers per pipeline "
                         f"stage, {layers_per_stage}: {layers_from}), as in Megatron-LM")
    if num_layers > layers_per_stage:
        raise ValueError(f"--recompute-num-layers ({num_layers}) must be at most the layers per pipeline stage, "
                         f"{layers_per_stage} ({layers_from})")


def recompute_config(args: argparse.Namespace) -> dict:
    """The ``TransformerConfig`` fields of the recompute flags (:func:`add_recompute_args`), for the models that
    train (actor and critic); empty without ``--recompute-granularity``, so the default config is unchanged."""
    if getattr(args, "recompute_granularity", None) is None:
        return {}
    return dict(recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
                recompute_num_layers=args.recompute_num_layers)


def add_hybrid_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The rollout layout and the RL settings (Megatron-LM's ``extra_args_provider`` convention). The data group
    is made between the reinforcement-learning group's task and sampling flags, where ``--help``'s usage line lists
    its flags."""
    _add_engine_args(parser)
    g = parser.add_argument_group("reinforcement learning")
    _add_task_args(g)
    _add_data_args(parser)
    _add_sampling_args(g)
    _add_loss_args(g)
    _add_logging_args(g)
    add_partial_rollout_args(parser)
    add_filter_and_env_args(parser)
    return parser


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The rollout layout and weights (FP8 among them), the rollout's KV cache and memory, and the optimizer's
    offload while generating."""
    g = parser.add_argument_group("hybrid engine")
    g.add_argument("--rollout-tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--rollout-pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--rollout-expert-model-parallel-size", type=int, default=1, help="the rollout's expert "
                   "parallelism: a divisor of --expert-model-parallel-size (MoE models)")
    g.add_argument("--rollout-expert-tensor-parallel-size", type=int, default=None, help="the rollout's expert "
                   "tensor parallelism: a divisor of --expert-tensor-parallel-size (MoE models; default: "
                   "--rollout-tensor-model-parallel-size)")
    g.add_argument("--hybrid-weight-mode", choices=[m.value for m in WeightMode], default=WeightMode.ALIASED.value)
    g.add_argument("--rollout-fp8", action="store_true",
                   help="generate with FP8 rollout weights (HybridEngine(rollout_weights='fp8')): the dense layers' "
                   "linear weights quantized to float8 e4m3 at every switch, FP8 matmuls; needs --hybrid-weight-mode "
                   "canonical. The rollout log-probs then come from the FP8 model: rollout_mismatch/* measures the "
                   "gap, --tis-imp-ratio-cap corrects for it")
    g.add_argument("--first-last-layers-bf16", action="store_true",
                   help="with --rollout-fp8: the first and last decoder layers keep bf16 rollout weights "
                   "(Megatron-LM's FP8 flag of the same name: TransformerConfig.first_last_layers_bf16)")
    g.add_argument("--num-layers-at-start-in-bf16", type=int, default=1,
                   help="with --first-last-layers-bf16: how many layers at the start keep bf16 (Megatron-LM's flag)")
    g.add_argument("--num-layers-at-end-in-bf16", type=int, default=1,
                   help="with --first-last-layers-bf16: how many layers at the end keep bf16 (Megatron-LM's flag)")
    g.add_argument("--reshard-bucket-size-mb", type=float, default=None,
                   help="HybridEngine gather bucket, MiB per dtype (default: the engine's, 1024 on a GPU, 32 on a "
                        "CPU)")
    g.add_argument("--inference-max-requests", type=int, default=64,
                   help="decode slots of the rollout's KV cache: sequences generated at once per rollout replica")
    g.add_argument("--inference-max-seq-length", type=int, default=None,
                   help="positions per KV-cache slot (default: the longest prompt plus --max-new-tokens, not the "
                   "model's whole context: the cache is slots x this x layers x KV bytes)")
    g.add_argument("--no-hybrid-rollout", action="store_true",
                   help="generate with the training-layout model on Megatron's groups (no resharding); for "
                   "comparisons")
    g.add_argument("--inference-memory-fraction", type=float, default=None,
                   help="vLLM's gpu_memory_utilization: the share of the card's total memory, in (0, 1], the process "
                   "may hold while rolling out; the KV cache takes what is left after the rollout weights, the "
                   "training state on the card and the step graphs' reserve, its slots (capped by "
                   "--inference-max-requests) are logged (default: --inference-max-requests full sequences; ignored "
                   "on the CPU)")
    g.add_argument("--offload-optimizer", choices=["auto", "always", "never"], default="auto",
                   help="move optimizer states, fp32 main parameters and gradients to the host while generating: "
                   "auto when the rollout's cache (--inference-max-requests x --inference-max-seq-length) and the "
                   "step graphs do not fit beside them on the card (never on the CPU), always, or never (an error "
                   "where the rollout does not fit)")
    g.add_argument("--no-offload-optimizer", dest="offload_optimizer", action="store_const", const="never",
                   help="the same as --offload-optimizer never (kept for older command lines)")


def _add_task_args(g) -> None:
    """The algorithm, the reward function or model, and the built-in task and prompts, on the reinforcement-learning
    group ``g``."""
    g.add_argument("--algorithm", choices=["ppo", "grpo"], default="ppo")
    g.add_argument("--reward-fn", default=None, help="module:function(prompts, responses) -> list[float] on token "
                   "lists (with an 'answers' parameter: also given the ground truths), or verl's "
                   "compute_score(data_source, solution_str, ground_truth, extra_info) on text, told apart by the "
                   "signature (default: --reward-type)")
    g.add_argument("--reward-model-load", default=None, help="a directory written by save_value_model(): a "
                   "Megatron model with a scalar head that scores prompt + response")
    g.add_argument("--target-token", type=int, default=3, help="built-in task: the token to be rewarded")
    g.add_argument("--prompt-length", type=int, default=4, help="built-in prompts: tokens per prompt")
    g.add_argument("--prompt-file", default=None, help="one prompt per line (tokenised), instead of the "
                   "built-in random prompts")


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    """The prompt data sets with ground truths, the built-in rewards and the evaluation."""
    d = parser.add_argument_group("data and rewards (file formats and answer rules: megatron_hybrid/rl/data.py, "
                                  "rewards.py)")
    d.add_argument("--prompt-data", default=None, help="prompts with ground truths: JSONL ({\"prompt\": text or "
                   "chat messages, \"answer\": ...} a line) or verl's parquet (prompt, reward_model.ground_truth)")
    d.add_argument("--reward-type", choices=["exact-match", "format", "target-token"], default=None,
                   help="a built-in reward: the final numeric answer equals the ground truth (1/0), the response "
                   "marks a final answer ('#### N' or \\boxed{N}), or the synthetic task's --target-token "
                   "fraction (default: exact-match with --prompt-data, else target-token)")
    d.add_argument("--eval-prompt-data", default=None, help="held-out prompts with ground truths (same formats "
                   "as --prompt-data), generated greedily every --eval-interval steps: eval_accuracy")
    d.add_argument("--eval-interval", type=int, default=None, help="steps between evaluations on "
                   "--eval-prompt-data")


def _add_sampling_args(g) -> None:
    """The responses per prompt, their length and how they are sampled, on the reinforcement-learning group
    ``g``."""
    g.add_argument("--num-samples-per-prompt", type=int, default=1, help="responses per prompt (GRPO's group)")
    g.add_argument("--max-new-tokens", type=int, default=8)
    g.add_argument("--stop-token-ids", type=int, nargs="+", default=[], help="tokens that also end a response "
                   "(kept in it), besides the tokenizer's end-of-document token (vLLM's stop_token_ids)")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=0.0)


def _add_loss_args(g) -> None:
    """The update's epochs, clipping, discounting, KL terms and loss weights, the critic's rate, the reference's
    offload, and the corrections for the rollout's log-probs and experts, on the reinforcement-learning group
    ``g``."""
    g.add_argument("--ppo-epochs", type=int, default=2, help="optimizer steps over each rollout batch")
    g.add_argument("--clip-ratio", type=float, default=0.2)
    g.add_argument("--clip-ratio-high", type=float, default=None, help="upper clip (default: --clip-ratio)")
    g.add_argument("--value-clip", type=float, default=0.2, help="value clipping range (0: off)")
    g.add_argument("--gamma", type=float, default=1.0)
    g.add_argument("--lam", type=float, default=0.95)
    g.add_argument("--kl-coef", type=float, default=0.02, help="KL penalty in the reward (PPO)")
    g.add_argument("--kl-ctl-type", choices=["fixed", "adaptive"], default="fixed")
    g.add_argument("--kl-target", type=float, default=6.0)
    g.add_argument("--kl-horizon", type=float, default=10000.0)
    g.add_argument("--kl-estimator", choices=["k1", "abs", "mse", "k3"], default="k1")
    g.add_argument("--kl-loss-coef", type=float, default=None, help="KL loss (k3) in the policy loss "
                   "(default: 0.01 for GRPO, 0 for PPO)")
    g.add_argument("--entropy-coef", type=float, default=0.0)
    g.add_argument("--value-loss-coef", type=float, default=1.0)
    g.add_argument("--critic-lr", type=float, default=None, help="default: --lr")
    g.add_argument("--no-whiten-advantages", action="store_true")
    g.add_argument("--offload-reference", action="store_true", help="keep the reference policy in host memory "
                   "between uses")
    g.add_argument("--tis-imp-ratio-cap", type=float, default=None, help="truncated importance sampling "
                   "(verl's name): weight each token's policy loss by min(π_old / π_rollout, C), for the mismatch "
                   "between the generator's and the training layout's log-probs (default: off)")
    g.add_argument("--moe-enable-routing-replay", action="store_true", help="MoE actors (Megatron-LM's flag): the "
                   "rollout records every token's top-k experts per MoE layer and the actor's log-prob and update "
                   "passes route each token to them (megatron-core's RouterReplay); logs moe/routing_mismatch_tokens")


def _add_logging_args(g) -> None:
    """Where the metrics go, and the progress bar, on the reinforcement-learning group ``g``."""
    g.add_argument("--log-dir", default=None, help="metrics.jsonl goes here")
    g.add_argument("--tensorboard-dir", default=None, help="TensorBoard events go here (needs the tensorboard "
                   "package)")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


def add_filter_and_env_args(parser: argparse.ArgumentParser) -> None:
    """Dynamic sampling (:mod:`.filtering`) and multi-turn environments (:mod:`.envs`)."""
    g = parser.add_argument_group("dynamic sampling (megatron_hybrid/rl/filtering.py)")
    g.add_argument("--filter-groups", action="store_true", help="GRPO (DAPO's dynamic sampling): drop the groups "
                   "whose rewards are all equal (no gradient) and generate more prompts until the step has its "
                   "groups, over at most --max-filter-rounds rounds")
    g.add_argument("--max-filter-rounds", type=int, default=None, help="with --filter-groups: generate rounds per "
                   "step at most; still short after them, a step fills in dropped groups (counted; default 4)")
    g = parser.add_argument_group("multi-turn environments (megatron_hybrid/rl/envs.py)")
    g.add_argument("--env", default=None, help="module:Class, made once per sample: reset(example) -> first prompt "
                   "tokens, step(model tokens) -> (observation tokens, reward, done); the sample's reward is the sum "
                   "of its steps', observation tokens never train")
    g.add_argument("--max-turns", type=int, default=None, help="with --env: generate calls per sample at most "
                   "(default 4)")
    g.add_argument("--max-sample-tokens", type=int, default=None, help="with --env: a sample's response tokens "
                   "(its turns and the observations between them) at most; a sample reaching it ends there, counted "
                   "(default: --max-new-tokens x --max-turns)")
    g.add_argument("--no-keep-prefix", action="store_true", help="with --env: prefill each turn's whole sequence "
                   "again (default: a turn continues the last one's KV cache, kept in the rollout: only the "
                   "observation and the model's last token run)")
    g.add_argument("--env-workers", type=int, default=None, help="with --env: threads the environments' steps run "
                   "on, every turn inside one generate call (a step starts as soon as its sample's turn ends, "
                   "while the others decode; rollout TP 1 and PP 1); 0: a generate call per turn, the steps between "
                   "them (default: 8 where the rollout layout allows, else 0)")


def add_partial_rollout_args(parser: argparse.ArgumentParser) -> None:
    """Partial rollout across steps (:mod:`.partial`; the names of Megatron-RL's and slime's flags)."""
    g = parser.add_argument_group("partial rollout (megatron_hybrid/rl/partial.py)")
    g.add_argument("--partial-rollout", action="store_true", help="stop generating once the step's quota of "
                   "finished samples (whole GRPO groups) is met, train on them, and resume the others first in "
                   "the next step with the new weights (their tokens so far prefilled again)")
    g.add_argument("--max-staleness", type=int, default=None, help="with --partial-rollout: a sample holding a "
                   "token generated more than this many weight versions ago is dropped with its group, and "
                   "counted (default: 1)")
    g.add_argument("--mask-offpolicy-in-partial-rollout", action="store_true", help="with --partial-rollout: the "
                   "tokens generated by earlier weights take no part in the losses (else --tis-imp-ratio-cap "
                   "corrects them with the recorded behaviour log-probs)")
    g.add_argument("--partial-rollout-in-flight", type=int, default=None, help="with --partial-rollout: prompts "
                   "held in flight over all DP replicas, parked ones included, so the generator stays busy while "
                   "the step's quota finishes (default: twice the step's prompts, --global-batch-size / "
                   "--num-samples-per-prompt)")


def _validate_filter(args: argparse.Namespace) -> None:
    if not args.filter_groups:
        if args.max_filter_rounds is not None:
            raise ValueError("--max-filter-rounds needs --filter-groups")
        return
    args.max_filter_rounds = 4 if args.max_filter_rounds is None else args.max_filter_rounds
    refused = [why for why, on in (
        (f"--algorithm {args.algorithm} (it filters GRPO groups: use --algorithm grpo)", args.algorithm != "grpo"),
        ("--partial-rollout", args.partial_rollout), ("--env", args.env is not None),
        ("--no-hybrid-rollout", args.no_hybrid_rollout),
        ("--moe-enable-routing-replay", args.moe_enable_routing_replay),
        ("--reward-model-load (its scores are a training pass)", args.reward_model_load is not None)) if on]
    if refused:
        raise ValueError(f"--filter-groups does not work with {refused[0]} for now")


def _validate_env(args: argparse.Namespace) -> None:
    given = [f for f, on in (("--max-turns", args.max_turns is not None),
                             ("--max-sample-tokens", args.max_sample_tokens is not None),
                             ("--no-keep-prefix", getattr(args, "no_keep_prefix", False)),
                             ("--env-workers", getattr(args, "env_workers", None) is not None)) if on]
    if args.env is None:
        if given:
            raise ValueError(f"{', '.join(given)} needs --env")
        return
    from .envs import load_env

    load_env(args.env)
    args.max_turns = 4 if args.max_turns is None else args.max_turns
    args.max_sample_tokens = args.max_sample_tokens or args.max_new_tokens * args.max_turns
    if args.env_workers is not None and args.env_workers < 0:
        raise ValueError(f"--env-workers ({args.env_workers}) must be >= 0")
    if args.env_workers and args.no_keep_prefix:
        raise ValueError(f"--env-workers ({args.env_workers}) runs every turn inside one generate call, from kept "
                         "caches: it cannot be combined with --no-keep-prefix (use --env-workers 0)")
    refused = [flag for flag, on in (("--partial-rollout", args.partial_rollout),
                                     ("--no-hybrid-rollout", args.no_hybrid_rollout),
                                     ("--moe-enable-routing-replay", args.moe_enable_routing_replay),
                                     ("--reward-fn", args.reward_fn is not None),
                                     ("--reward-type", args.reward_type is not None),
                                     ("--reward-model-load", args.reward_model_load is not None)) if on]
    if refused:
        raise ValueError(f"--env ({args.env}) does not work with {refused[0]} (the environment gives the rewards; "
                         "multi-turn rollouts run on the HybridEngine, without partial rollout or routing replay "
                         "for now)")


def _validate_partial_rollout(args: argparse.Namespace, *, t: int, p: int, d: int) -> None:
    given = [flag for flag, on in (("--max-staleness", args.max_staleness is not None),
                                   ("--mask-offpolicy-in-partial-rollout", args.mask_offpolicy_in_partial_rollout),
                                   ("--partial-rollout-in-flight", args.partial_rollout_in_flight is not None)) if on]
    if not args.partial_rollout:
        if given:
            raise ValueError(f"{', '.join(given)} needs --partial-rollout")
        return
    if args.max_staleness is None:
        args.max_staleness = 1
    if args.max_staleness < 0:
        raise ValueError(f"--max-staleness ({args.max_staleness}) must be ≥ 0 (0: only tokens of the weights that "
                         "train on them)")
    prompts = args.global_batch_size // args.num_samples_per_prompt
    if args.partial_rollout_in_flight is None:
        args.partial_rollout_in_flight = 2 * prompts
    if args.partial_rollout_in_flight < prompts or args.partial_rollout_in_flight % d:
        raise ValueError(f"--partial-rollout-in-flight ({args.partial_rollout_in_flight}) must be at least the "
                         f"step's prompts (--global-batch-size / --num-samples-per-prompt = {prompts}) and a "
                         f"multiple of the data-parallel size ({d})")
    t_g, p_g = args.rollout_tensor_model_parallel_size, args.rollout_pipeline_model_parallel_size
    refused = [why for why, on in (
        ("--no-hybrid-rollout (it needs the HybridEngine's generator)", args.no_hybrid_rollout),
        ("--moe-enable-routing-replay (parked samples carry no routing record yet)", args.moe_enable_routing_replay),
        (f"a rollout layout that is not inside the training replicas (--rollout-tensor-model-parallel-size {t_g} "
         f"and --rollout-pipeline-model-parallel-size {p_g} must divide --tensor-model-parallel-size {t} and "
         f"--pipeline-model-parallel-size {p})", t % t_g or p % p_g)) if on]
    if refused:
        raise ValueError(f"--partial-rollout does not work with {refused[0]}")


#: The range of every numeric flag, as :func:`~megatron_hybrid.checks.check_number`'s bounds (and a hint where
#: one helps).
_RANGES: dict[str, dict] = {
    **dict.fromkeys(("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "rollout_tensor_model_parallel_size", "rollout_pipeline_model_parallel_size", "micro_batch_size",
                     "global_batch_size", "train_iters", "save_interval", "num_layers", "hidden_size",
                     "num_attention_heads", "num_query_groups", "ffn_hidden_size", "max_position_embeddings",
                     "make_vocab_size_divisible_by", "vocab_size", "prompt_length", "num_samples_per_prompt",
                     "max_new_tokens", "ppo_epochs", "lr_decay_iters", "eval_interval", "inference_max_requests",
                     "inference_max_seq_length", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                     "moe_shared_expert_intermediate_size", "expert_model_parallel_size",
                     "expert_tensor_parallel_size", "rollout_expert_model_parallel_size",
                     "rollout_expert_tensor_parallel_size", "max_tokens_per_micro_batch", "max_turns",
                     "max_sample_tokens", "max_filter_rounds"), {"ge": 1}),
    **dict.fromkeys(("lr", "critic_lr", "min_lr", "clip_grad", "weight_decay", "value_clip", "kl_coef",
                     "kl_loss_coef", "entropy_coef", "value_loss_coef", "target_token", "lr_warmup_iters",
                     "moe_aux_loss_coeff"),
                    {"ge": 0}),
    **dict.fromkeys(("clip_ratio", "clip_ratio_high", "kl_target", "kl_horizon", "reshard_bucket_size_mb",
                     "tis_imp_ratio_cap",
                     "distributed_timeout_minutes", "adam_eps"), {"gt": 0}),
    **dict.fromkeys(("gamma", "lam"), {"ge": 0, "le": 1}),
    **dict.fromkeys(("adam_beta1", "adam_beta2"), {"ge": 0, "lt": 1}),
    "temperature": {"gt": 0, "hint": "use --top-k 1 for greedy"},
    "top_k": {"ge": 0, "hint": "0: off"},
    "top_p": {"ge": 0, "le": 1, "hint": "0 or 1: off"},
}


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Every check that needs no collective; ``ValueError`` with the values and the arithmetic. Fills the model
    flags left unset from ``--pretrained-checkpoint`` (a contradicting one is an error) or :data:`TINY_MODEL`."""
    _fill_model_args(args)
    # Ranges first: the arithmetic below divides by several of these.
    _validate_ranges(args)
    _validate_seed_and_schedule(args)
    _validate_distributed_training(args)
    _validate_vocabulary(args)
    _validate_sequence_length(args)
    d = _validate_batches(args, world_size)
    _validate_partial_rollout(args, t=args.tensor_model_parallel_size, p=args.pipeline_model_parallel_size, d=d)
    _validate_env(args)
    _validate_filter(args)
    _validate_training_layout(args)
    _validate_rollout_fp8(args)
    _validate_rollout_layout(args, data_parallel_size=d)
    _validate_experts(args, data_parallel_size=d)
    _validate_routing_replay(args)
    _validate_tokenizer(args)
    _validate_reward_source(args)
    _validate_paths(args)
    _validate_data_and_rewards(args)
    _validate_device_and_attention(args)
    _validate_packing(args)
    check_fraction(args.inference_memory_fraction)


def _fill_model_args(args: argparse.Namespace) -> None:
    """The model flags left unset: ``--pretrained-checkpoint``'s (a contradicting one is an error), else
    :data:`TINY_MODEL`'s."""
    model_args_from_checkpoint(args)
    for name, value in TINY_MODEL.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _validate_ranges(args: argparse.Namespace) -> None:
    """Every numeric flag in its range (:data:`_RANGES`); None is an optional flag left unset."""
    for name, bounds in _RANGES.items():
        if getattr(args, name) is not None:
            check_number(flag_name(name), getattr(args, name), **bounds)


def _validate_seed_and_schedule(args: argparse.Namespace) -> None:
    """``--seed`` in Megatron-LM's range, and the learning-rate schedule as megatron-core's
    ``OptimizerParamScheduler`` asserts it."""
    # Megatron-LM seeds numpy with --seed (+ 100 × the pipeline rank), which takes [0, 2**32). Within it every seed
    # derived from it fits the int64 that torch's generators and megatron-core's RNG tracker take, with room to
    # spare: the prompts' seed × 1,000,003 + step, generation's seed × 7919 + step + 1,000,003 × replica, the
    # tracker's seed + 2718 + TP rank (2**63 itself overflowed in megatron-core after the process groups were up).
    if not 0 <= args.seed < 2**32:
        raise ValueError(f"--seed ({args.seed}) must be in [0, {2**32 - 1}] (Megatron-LM's range: it seeds numpy "
                         "with it)")
    # Megatron's OptimizerParamScheduler asserts these; a usage error names them instead.
    for flag, peak in (("--lr", args.lr), ("--critic-lr", args.critic_lr)):
        if peak is not None and args.min_lr > peak:
            raise ValueError(f"--min-lr ({args.min_lr:g}) must be at most {flag} ({peak:g})")
    decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
    if args.lr_warmup_iters >= decay_iters:
        raise ValueError(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be less than --lr-decay-iters "
                         f"({decay_iters}{', from --train-iters' if args.lr_decay_iters is None else ''})")


def _validate_distributed_training(args: argparse.Namespace) -> None:
    """``--sequence-parallel`` (turned off, with a warning, at TP 1), the overlap of the distributed optimizer's
    parameter gather, and the optimizer's CPU offload (:func:`_validate_optimizer_offload`)."""
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:  # as Megatron-LM does: warned and turned off
        warnings.warn("--sequence-parallel is turned off: it needs --tensor-model-parallel-size > 1 (it is 1)",
                      stacklevel=3)
        args.sequence_parallel = False
    if args.overlap_param_gather and not (args.use_distributed_optimizer and args.overlap_grad_reduce):
        missing = [f for f, on in (("--use-distributed-optimizer", args.use_distributed_optimizer),
                                   ("--overlap-grad-reduce", args.overlap_grad_reduce)) if not on]
        raise ValueError(f"--overlap-param-gather needs {' and '.join(missing)} (as in Megatron-LM)")
    _validate_optimizer_offload(args)


def _validate_vocabulary(args: argparse.Namespace) -> None:
    """The tokens the flags name (``--top-k``, ``--stop-token-ids``, the built-in task's ``--target-token``) inside
    the vocabulary, where its size is known before loading: NullTokenizer's ``--vocab-size``."""
    if args.tokenizer_type != "NullTokenizer":
        return
    V = args.vocab_size
    if args.top_k > V:
        raise ValueError(f"--top-k ({args.top_k}) must be at most --vocab-size ({V})")
    bad = [t for t in args.stop_token_ids if not 0 <= t < V]
    if bad:
        raise ValueError(f"--stop-token-ids ({bad[0]}) must be tokens of the vocabulary, in [0, {V - 1}] "
                         f"(--vocab-size {V})")
    if args.reward_fn is None and args.reward_model_load is None and args.target_token >= V:
        raise ValueError(f"--target-token ({args.target_token}) must be a token of the vocabulary, in "
                         f"[0, {V - 1}] (--vocab-size {V})")


def _validate_sequence_length(args: argparse.Namespace) -> None:
    """The prompt and the response within ``--max-position-embeddings`` (a file's prompts are measured once
    tokenised: here they only need a position besides the response)."""
    n_pos, n_new = args.max_position_embeddings, args.max_new_tokens
    from_file = args.prompt_file is not None or args.prompt_data is not None
    if not from_file and n_pos < args.prompt_length + n_new:
        raise ValueError(f"--max-position-embeddings ({n_pos}) must be at least --prompt-length "
                         f"({args.prompt_length}) + --max-new-tokens ({n_new}) = {args.prompt_length + n_new}")
    if from_file and n_pos <= n_new:
        raise ValueError(f"--max-position-embeddings ({n_pos}) must exceed --max-new-tokens ({n_new}): the prompt "
                         "takes positions too")


def _validate_batches(args: argparse.Namespace, world_size: int) -> int:
    """The world size against the training layout, and the global batch against the micro-batches and the GRPO
    groups of every data-parallel replica; returns the data-parallel size."""
    t, p = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _check_layout(args, Sizes(world=world_size, t=t, p=p), "training_layout_fits_world")
    d = world_size // (t * p)
    if args.global_batch_size % (args.micro_batch_size * d):
        raise ValueError(f"--global-batch-size ({args.global_batch_size}) must be a multiple of "
                         f"--micro-batch-size ({args.micro_batch_size}) × data-parallel size ({d}) = "
                         f"{args.micro_batch_size * d}")
    if args.global_batch_size % (args.num_samples_per_prompt * d):
        raise ValueError(f"--global-batch-size ({args.global_batch_size}) must be a multiple of "
                         f"--num-samples-per-prompt ({args.num_samples_per_prompt}) × data-parallel size ({d})")
    if args.algorithm == "grpo" and args.num_samples_per_prompt < 2:
        raise ValueError(f"--algorithm grpo needs --num-samples-per-prompt ≥ 2 (got {args.num_samples_per_prompt})")
    return d


def _validate_training_layout(args: argparse.Namespace) -> None:
    """The model's shape against the training layout (the attention heads and the feed-forward split over TP, the
    layers over PP) and the recompute flags against the layers per pipeline stage."""
    t, p = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.hidden_size % args.num_attention_heads:
        raise ValueError(f"--num-attention-heads ({args.num_attention_heads}) must divide --hidden-size "
                         f"({args.hidden_size})")
    # An unset --ffn-hidden-size is skipped: the default, 4 × hidden, divides.
    _check_layout(args, Sizes(t=t, p=p, num_attention_heads=args.num_attention_heads,
                              ffn_hidden_size=args.ffn_hidden_size), "t_divides_heads", "t_divides_ffn")
    if args.group_query_attention and args.num_query_groups is None:
        raise ValueError("--group-query-attention needs --num-query-groups")
    if args.num_query_groups is not None and args.num_attention_heads % args.num_query_groups:
        raise ValueError(f"--num-query-groups ({args.num_query_groups}) must divide --num-attention-heads "
                         f"({args.num_attention_heads})")
    _check_layout(args, Sizes(p=p, num_layers=args.num_layers), "p_divides_layers")
    check_recompute(args.recompute_granularity, args.recompute_method, args.recompute_num_layers,
                    layers_per_stage=args.num_layers // p,
                    layers_from=f"--num-layers ({args.num_layers}) / --pipeline-model-parallel-size ({p})")


def _validate_rollout_fp8(args: argparse.Namespace) -> None:
    """``--rollout-fp8`` with what it needs (the HybridEngine's rollout, canonical weights), and the bf16 layers
    at its ends."""
    if args.rollout_fp8 and args.no_hybrid_rollout:
        raise ValueError("--rollout-fp8 needs the HybridEngine's rollout (it is off with --no-hybrid-rollout)")
    if args.rollout_fp8 and args.hybrid_weight_mode != WeightMode.CANONICAL:
        raise ValueError(f"--rollout-fp8 needs --hybrid-weight-mode canonical (got --hybrid-weight-mode "
                         f"{args.hybrid_weight_mode}): FP8 rollout weights are tensors rebuilt at every switch")
    if args.first_last_layers_bf16 and not args.rollout_fp8:
        raise ValueError("--first-last-layers-bf16 needs --rollout-fp8 (it says which rollout layers stay bf16; "
                         "training is in the model's dtype)")
    if args.first_last_layers_bf16:
        start, end = args.num_layers_at_start_in_bf16, args.num_layers_at_end_in_bf16
        if start < 0 or end < 0 or start + end > args.num_layers:
            raise ValueError(f"--num-layers-at-start-in-bf16 ({start}) and --num-layers-at-end-in-bf16 ({end}) must "
                             f"be ≥ 0 and sum to at most --num-layers ({args.num_layers})")


def _validate_rollout_layout(args: argparse.Namespace, *, data_parallel_size: int) -> None:
    """The rollout layout: any pair whose rollout model can be built (the HybridEngine exchanges what its micro-DP
    gathers cannot serve)."""
    t, p, d = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, data_parallel_size
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    _check_layout(args, Sizes(world=t * p * d, t=t, p=p, d=d, t_g=args.rollout_tensor_model_parallel_size,
                              p_g=args.rollout_pipeline_model_parallel_size, num_layers=args.num_layers,
                              num_attention_heads=args.num_attention_heads, num_query_groups=groups,
                              ffn_hidden_size=args.ffn_hidden_size),
                  "rollout_layout_divides_world", "p_g_divides_layers", "t_g_divides_heads", "t_g_divides_query_groups",
                  "t_g_divides_ffn")


def _check_layout(args: argparse.Namespace, sizes: Sizes, *rules: str) -> None:
    """:func:`megatron_hybrid.constraints.check` of ``rules``, its message told with the flags' names."""
    try:
        check(sizes, *rules)
    except ValueError as error:
        raise ValueError(engine_message_with_flags(str(error), args)) from None


def _validate_routing_replay(args: argparse.Namespace) -> None:
    """``--moe-enable-routing-replay`` on an MoE model, without full recompute."""
    if args.moe_enable_routing_replay and not getattr(args, "num_experts", None):
        raise ValueError(f"--moe-enable-routing-replay needs an MoE model (--num-experts: "
                         f"{getattr(args, 'num_experts', None)})")
    if args.recompute_granularity == "full" and args.moe_enable_routing_replay:
        # TrainingRouting hands the routers the rollout's experts in the forward only: the backward's rerun of a
        # checkpointed layer would route by the router's own top-k, and the gradient would be of other experts.
        raise ValueError("--recompute-granularity full reruns the MoE routers in the backward pass, where "
                         "--moe-enable-routing-replay does not replay the rollout's experts yet: use "
                         "--recompute-granularity selective, or leave out one of the two")


def _validate_tokenizer(args: argparse.Namespace) -> None:
    """``--tokenizer-model`` as ``--tokenizer-type`` needs it: none for NullTokenizer, else a directory
    (HuggingFaceTokenizer) or a file (SentencePieceTokenizer) that exists."""
    if args.tokenizer_type == "NullTokenizer":
        if args.tokenizer_model is not None:
            raise ValueError("--tokenizer-model is given but --tokenizer-type is NullTokenizer (the synthetic "
                             "vocabulary needs no files); pass --tokenizer-type too")
    elif args.tokenizer_model is None:
        raise ValueError(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model")
    elif args.tokenizer_type == "HuggingFaceTokenizer" and not os.path.isdir(args.tokenizer_model):
        raise ValueError(f"--tokenizer-model ({args.tokenizer_model!r}) is not a directory (HuggingFaceTokenizer "
                         "loads a tokenizer directory)")
    elif args.tokenizer_type == "SentencePieceTokenizer" and not os.path.isfile(args.tokenizer_model):
        raise ValueError(f"--tokenizer-model ({args.tokenizer_model!r}) is not a file (SentencePieceTokenizer "
                         "loads a .model file)")


def _validate_reward_source(args: argparse.Namespace) -> None:
    """At most one of ``--reward-fn`` (which must load) and ``--reward-model-load`` (a saved value model)."""
    if args.reward_fn is not None and args.reward_model_load is not None:
        raise ValueError("pass --reward-fn or --reward-model-load, not both")
    if args.reward_fn is not None:
        load_callable(args.reward_fn)
    if args.reward_model_load is not None and not os.path.isfile(os.path.join(args.reward_model_load,
                                                                              "value_model.json")):
        raise ValueError(f"--reward-model-load ({args.reward_model_load!r}) has no value_model.json")


def _validate_paths(args: argparse.Namespace) -> None:
    """The checkpoint to resume and the prompt file exist; the log and TensorBoard directories can be made, and
    the tensorboard package is there for the latter."""
    if args.load is not None and not os.path.isfile(os.path.join(args.load, "latest_checkpointed_iteration.txt")):
        raise ValueError(f"--load ({args.load!r}) has no latest_checkpointed_iteration.txt")
    if args.prompt_file is not None and not os.path.isfile(args.prompt_file):
        raise ValueError(f"--prompt-file ({args.prompt_file!r}) does not exist")
    # MetricsLogger makes them on rank 0 only, after the process groups exist: a file there failed that rank alone.
    for flag, path in (("--log-dir", args.log_dir), ("--tensorboard-dir", args.tensorboard_dir)):
        error = path is not None and output_dir_error(path)
        if error:
            raise ValueError(f"{flag} ({path!r}) {error}")
    if args.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
        # torch.utils.tensorboard needs it; without it the SummaryWriter would fail on rank 0 only, mid-run.
        raise ValueError(f"--tensorboard-dir ({args.tensorboard_dir!r}) needs the tensorboard package "
                         "(pip install tensorboard)")


def _validate_device_and_attention(args: argparse.Namespace) -> None:
    """The device the ranks train on (:func:`~.initialize.select_device`), and ``--attention-backend`` on it
    (its default: sdpa on a GPU, local on the CPU)."""
    device_type = select_device(args)
    if args.attention_backend is None:  # the GPU's fast path; the CPU keeps megatron-core's (the goldens' numerics)
        args.attention_backend = "sdpa" if device_type == "cuda" else "local"
    try:  # on the device the ranks train on: flex has no CPU backward
        check_attention_backend(args.attention_backend, device_type=device_type)
    except ValueError as error:
        raise ValueError(with_flag_names(str(error), vars(args))) from None


def _validate_optimizer_offload(args: argparse.Namespace) -> None:
    """megatron-core's optimizer CPU offload and precision-aware optimizer flags, checked as its
    ``OptimizerConfig`` asserts them, before any process group."""
    for flag, on in (("--optimizer-cpu-offload", args.optimizer_cpu_offload),
                     ("--use-precision-aware-optimizer", args.use_precision_aware_optimizer)):
        if on and not args.use_distributed_optimizer:
            raise ValueError(f"{flag} needs --use-distributed-optimizer (as in Megatron-LM)")
    if args.optimizer_cpu_offload and not args.use_precision_aware_optimizer:
        # Megatron-LM refuses it too: HybridDeviceOptimizer steps the host's fp32 copies, while the distributed
        # optimizer without the flag keeps fp32 main parameters of its own on the GPU (4 bytes a parameter).
        raise ValueError("--optimizer-cpu-offload needs --use-precision-aware-optimizer (as in Megatron-LM: the "
                         "host optimizer reuses its code path; without it the fp32 main parameters stay on the GPU)")
    if args.optimizer_cpu_offload and (getattr(args, "device", None) == "cpu" or not _cuda_available()):
        raise ValueError("--optimizer-cpu-offload moves the optimizer's states from the GPU to the host and steps "
                         "them there: it needs a GPU (this run trains on the CPU)")
    if not 0 <= args.optimizer_offload_fraction <= 1:
        raise ValueError(f"--optimizer-offload-fraction ({args.optimizer_offload_fraction}) must be in [0, 1]")
    if args.overlap_cpu_optimizer_d2h_h2d and not args.optimizer_cpu_offload:
        raise ValueError("--overlap-cpu-optimizer-d2h-h2d needs --optimizer-cpu-offload")
    if args.use_precision_aware_optimizer and not args.optimizer_cpu_offload and \
            importlib.util.find_spec("transformer_engine") is None:
        raise ValueError("--use-precision-aware-optimizer without --optimizer-cpu-offload needs Transformer Engine's "
                         "FusedAdam, and transformer_engine is not installed")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _validate_packing(args: argparse.Namespace) -> None:
    """``--max-tokens-per-micro-batch`` with what packed passes take today (:mod:`.packing`); the budget against
    the longest sequence is checked where the prompts are known (:func:`~.task.check_token_budget`)."""
    budget = args.max_tokens_per_micro_batch
    if budget is None:
        return
    if args.attention_backend == "local":
        raise ValueError(f"--max-tokens-per-micro-batch ({budget}) packs sequences, which --attention-backend local "
                         "(megatron-core's DotProductAttention) refuses: pass --attention-backend sdpa, flex or auto")


#: The expert-parallel flags and their defaults (anything else on a dense model is an error).
_EXPERT_PARALLEL_DEFAULTS = {"expert_model_parallel_size": 1, "expert_tensor_parallel_size": None,
                             "rollout_expert_model_parallel_size": 1, "rollout_expert_tensor_parallel_size": None}


def _validate_experts(args: argparse.Namespace, *, data_parallel_size: int) -> None:
    """The MoE flags: refused on a dense model; else filled with :data:`MOE_DEFAULTS` and checked against the
    training and rollout layouts (GPTArchitecture's own checks, told with the flags' names)."""
    expert_parallel = [n for n, default in _EXPERT_PARALLEL_DEFAULTS.items() if getattr(args, n) != default]
    if args.num_experts is None:
        given = [flag_name(n) for n in MOE_FLAGS if getattr(args, n) is not None] + \
            [f"{flag_name(n)} ({getattr(args, n)})" for n in expert_parallel]
        if given:
            whose = f"--pretrained-checkpoint {args.pretrained_checkpoint!r} has no experts" \
                if args.pretrained_checkpoint is not None else "no --num-experts"
            raise ValueError(f"{', '.join(given)}: for a mixture of experts, and the model is dense ({whose})")
        return
    for name, value in MOE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    t, t_g, d = args.tensor_model_parallel_size, args.rollout_tensor_model_parallel_size, data_parallel_size
    e, et = args.expert_model_parallel_size, args.expert_tensor_parallel_size or t
    e_g, et_g = args.rollout_expert_model_parallel_size, args.rollout_expert_tensor_parallel_size or t_g
    try:
        architecture_from_args(args, args.vocab_size).validate(
            tensor_model_parallel_size=t, pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            expert_model_parallel_size=e, expert_tensor_parallel_size=et)
    except ValueError as error:
        raise ValueError(with_flag_names(str(error), vars(args))) from None
    try:
        check(Sizes(moe=True, t=t, d=d, e=e, et=et), "expert_grid_fits_stage")
    except ValueError as error:
        message = engine_message_with_flags(str(error), args)
        if args.expert_tensor_parallel_size is None:
            message = message.replace(f"--expert-tensor-parallel-size ({et})",
                                      f"--expert-tensor-parallel-size ({et}, from --tensor-model-parallel-size)")
        raise ValueError(message) from None
    # The engine's rules for the rollout's expert layout (in place or exchanged), in their one home, told with the
    # flags' names.
    p, p_g = args.pipeline_model_parallel_size, args.rollout_pipeline_model_parallel_size
    config = architecture_from_args(args, args.vocab_size).transformer_config(
        tensor_model_parallel_size=t, pipeline_model_parallel_size=p, expert_model_parallel_size=e,
        expert_tensor_parallel_size=et, sequence_parallel=args.sequence_parallel)
    rollout = RolloutLayout(t_g, p_g, expert_model_parallel_size=e_g, expert_tensor_parallel_size=et_g)
    try:
        check_expert_layout(config, ParallelLayout.create(training=(t, p, d), rollout=rollout), rollout,
                            training=(et, e, t * d // (e * et)), world_size=t * p * d)
    except ValueError as error:
        raise ValueError(engine_message_with_flags(str(error), args)) from None
    if t > 1 and not args.sequence_parallel:
        # megatron-core's MoELayer refuses to train at TP > 1 without it, and Megatron-LM asks for the flag.
        raise ValueError(f"a mixture of experts (--num-experts {args.num_experts}) at --tensor-model-parallel-size "
                         f"({t}) > 1 needs --sequence-parallel (as in Megatron-LM)")


def engine_message_with_flags(message: str, args: argparse.Namespace) -> str:
    """An engine's ``ValueError`` about its arguments told with the recipe's flags: ``rollout X`` is
    ``--rollout-X``, ``num_moe_experts`` is ``--num-experts``, any other of the recipe's dests its flag."""
    dests = vars(args)
    message = re.sub(r"\brollout (\w+)", lambda m: flag_name(f"rollout_{m.group(1)}") if f"rollout_{m.group(1)}"
                     in dests else m.group(0), message)
    message = re.sub(r"(?<![\w-])num_moe_experts(?!\w)", "--num-experts", message)
    return with_flag_names(message, dests)


def _validate_data_and_rewards(args: argparse.Namespace) -> None:
    if args.prompt_data is not None and args.prompt_file is not None:
        raise ValueError("pass --prompt-data or --prompt-file, not both")
    for flag, path in (("--prompt-data", args.prompt_data), ("--eval-prompt-data", args.eval_prompt_data)):
        error = path is not None and data_file_error(flag, path)
        if error:
            raise ValueError(error)
    if args.reward_type is not None and (args.reward_fn is not None or args.reward_model_load is not None):
        raise ValueError(f"pass one of --reward-type ({args.reward_type}), --reward-fn and --reward-model-load")
    if resolved_reward_type(args) == "exact-match" and args.prompt_data is None:
        raise ValueError("--reward-type exact-match needs ground truths: pass --prompt-data")
    if args.reward_fn is not None and args.prompt_data is None and reward_fn_style(load_callable(args.reward_fn)) \
            == "verl":
        raise ValueError(f"--reward-fn {args.reward_fn} is a verl compute_score(..., ground_truth, ...): it needs "
                         "--prompt-data")
    if args.eval_interval is not None and args.eval_prompt_data is None:
        raise ValueError(f"--eval-interval ({args.eval_interval}) needs --eval-prompt-data")
    if args.eval_prompt_data is not None and args.eval_interval is None:
        warnings.warn(f"--eval-prompt-data ({args.eval_prompt_data}) is ignored without --eval-interval",
                      stacklevel=3)


def rollout_fp8_config(args: argparse.Namespace) -> dict:
    """The actor's ``TransformerConfig`` fields that ``--first-last-layers-bf16`` sets (Megatron's FP8 convention,
    which ``HybridEngine(rollout_weights="fp8")`` reads: :func:`megatron_hybrid.quant.fp8.layers_in_bf16`); empty
    without it."""
    if not args.first_last_layers_bf16:
        return {}
    return dict(first_last_layers_bf16=True, num_layers_at_start_in_bf16=args.num_layers_at_start_in_bf16,
                num_layers_at_end_in_bf16=args.num_layers_at_end_in_bf16)
