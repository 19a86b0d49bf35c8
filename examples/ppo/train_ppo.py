"""PPO and GRPO for a Megatron-core actor on the HybridEngine: generate in the rollout layout, train in the training
layout (Megatron's forward/backward schedule and DDP), with a critic, a frozen reference policy and a reward.

Built-in default (no arguments): a tiny model (2 layers, hidden 64, a 16-token synthetic vocabulary) learns to
emit a target token; the reward is the fraction of the 8 generated tokens equal to it. 4 gloo ranks train with
TP=2 × DP=2 and generate with TP=1 (a real layout change every step):

    torchrun --nproc_per_node 4 examples/ppo/train_ppo.py
    torchrun --nproc_per_node 4 examples/ppo/train_ppo.py --algorithm grpo --num-samples-per-prompt 4
    torchrun --nproc_per_node 4 examples/ppo/train_ppo.py --train-iters 10 --save ckpt --save-interval 5
    torchrun --nproc_per_node 4 examples/ppo/train_ppo.py --train-iters 20 --load ckpt --save ckpt
    torchrun --nproc_per_node 8 examples/ppo/train_ppo.py --tensor-model-parallel-size 4 \\
        --rollout-tensor-model-parallel-size 2 --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR \\
        --prompt-file prompts.txt --reward-fn my_rewards:score --log-dir runs/ppo

A reward function gets the prompts and responses as lists of token ids and returns one float per response.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_hybrid import ppo
from megatron_hybrid.arguments import add_hybrid_args, add_megatron_args, load_callable, validate_args

CHECKPOINT_VERSION = 1


# ---------------------------------------------------------------------------------------------------------------
# Arguments
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="train_ppo.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_megatron_args(parser)
    return add_hybrid_args(parser)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and validate; bad values exit here (``parser.error``), before any collective."""
    parser = build_parser()
    args = parser.parse_args(argv)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    try:
        validate_args(args, world)
    except ValueError as e:
        parser.error(str(e))
    if args.kl_loss_coef is None:
        args.kl_loss_coef = 0.01 if args.algorithm == "grpo" else 0.0
    if args.save_interval is not None and args.save is None:
        warnings.warn(f"--save-interval ({args.save_interval}) is ignored without --save", stacklevel=2)
    if args.algorithm == "grpo":
        ignored = [f"--{name.replace('_', '-')}" for name in ("kl_coef", "kl_ctl_type", "critic_lr", "value_clip",
                                                            "value_loss_coef", "gamma", "lam")
                   if getattr(args, name) != parser.get_default(name)]
        if ignored:
            warnings.warn(f"--algorithm grpo has no critic and no KL penalty in the reward (it uses --kl-loss-coef): "
                          f"{', '.join(ignored)} ignored", stacklevel=2)
    return args


# ---------------------------------------------------------------------------------------------------------------
# Tokenizers
class NullTokenizer:
    """A synthetic vocabulary of ``vocab_size`` ids; text is the ids separated by spaces. No end token."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size, self.eod = vocab_size, None

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(map(str, ids))


class HuggingFaceTokenizer:
    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)
        self.vocab_size, self.eod = len(self._tok), self._tok.eos_token_id

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


class SentencePieceTokenizer:
    def __init__(self, path: str) -> None:
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id() if self._sp.eos_id() >= 0 else None

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))


def build_tokenizer(args: argparse.Namespace):
    if args.tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(args.tokenizer_model)
    if args.tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(args.tokenizer_model)
    return NullTokenizer(args.vocab_size)


# ---------------------------------------------------------------------------------------------------------------
# Prompts and rewards
class Prompts:
    """The prompts of a step, the same whatever the layout: the step's global list, cut into DP slices."""

    def __init__(self, args: argparse.Namespace, tokenizer) -> None:
        self.args, self.vocab = args, tokenizer.vocab_size
        self.lines = None
        if args.prompt_file is not None:
            with open(args.prompt_file) as f:
                self.lines = [tokenizer.tokenize(s.rstrip("\n")) for s in f if s.strip()]

    def per_step(self) -> int:
        return self.args.global_batch_size // self.args.num_samples_per_prompt

    def for_step(self, step: int, *, dp_rank: int, dp_size: int) -> list[list[int]]:
        n = self.per_step()
        if self.lines is not None:
            everything = [self.lines[(step * n + i) % len(self.lines)] for i in range(n)]
        else:
            g = torch.Generator().manual_seed(self.args.seed * 1_000_003 + step)
            everything = torch.randint(0, self.vocab, (n, self.args.prompt_length), generator=g).tolist()
        per = n // dp_size
        return everything[dp_rank * per: (dp_rank + 1) * per]


def target_token_reward(target: int) -> Callable[[list[list[int]], list[list[int]]], list[float]]:
    """The built-in task: the fraction of response tokens equal to ``target``."""
    def reward(prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
        return [sum(t == target for t in r) / max(len(r), 1) for r in responses]
    return reward


# ---------------------------------------------------------------------------------------------------------------
# Models
class ValueHead(torch.nn.Module):
    """A scalar head on the final hidden state, in place of GPTModel's output layer (same call signature).

    Replicated over tensor-parallel ranks: the hidden state it reads is replicated there, so its gradient is too.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, hidden_SBH: torch.Tensor, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden_SBH, self.weight, self.bias), None


def architecture(args: argparse.Namespace, vocab_size: int):
    from megatron_hybrid.models import GPTArchitecture

    return GPTArchitecture(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        vocab_size=vocab_size, ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        max_position_embeddings=args.max_position_embeddings,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, swiglu=args.swiglu,
        normalization=args.normalization, position_embedding_type=args.position_embedding_type,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights)


def build_stage(arch, *, value_head: bool, device: torch.device):
    """This rank's stage of a GPTModel (training layout, Megatron's groups); with a value head if asked."""
    import dataclasses

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    if value_head:  # the value head replaces the output layer, so nothing may be tied to it
        arch = dataclasses.replace(arch, untie_embeddings_and_output_weights=True)
    config = arch.transformer_config(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                                     pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size())
    config.finalize_model_grads_func = finalize_model_grads
    model = arch.build(config, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    if value_head and ps.is_pipeline_last_stage():
        model.output_layer = ValueHead(arch.hidden_size, arch.dtype)
    return model.to(device)


def wrap_ddp(model):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)


def copy_weights(dst: torch.nn.Module, src: torch.nn.Module, *, skip_missing: bool = False) -> None:
    src_params = dict(src.named_parameters())
    with torch.no_grad():
        for name, p in dst.named_parameters():
            if name in src_params and src_params[name].shape == p.shape:
                p.copy_(src_params[name])
            elif not skip_missing:
                raise ValueError(f"no parameter {name} of shape {tuple(p.shape)} to copy")


def save_value_model(model: torch.nn.Module, directory: str, arch) -> None:
    """Write a value model (critic or reward model) for ``--reward-model-load``: full tensors, any layout."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    from megatron_hybrid.sharding import full_state_dict

    full = full_state_dict([model], tp_group=ps.get_tensor_model_parallel_group(),
                           pp_group=ps.get_pipeline_model_parallel_group())
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        save_file({k: v.contiguous() for k, v in full.items()}, os.path.join(directory, "model.safetensors"))
        with open(os.path.join(directory, "value_model.json"), "w") as f:
            json.dump({"architecture": arch.to_dict()}, f, indent=2)
    dist.barrier()


def load_value_model(directory: str, device: torch.device):
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from megatron_hybrid.models import GPTArchitecture
    from megatron_hybrid.sharding import load_full_state_dict

    with open(os.path.join(directory, "value_model.json")) as f:
        arch = GPTArchitecture.from_dict(json.load(f)["architecture"])
    model = build_stage(arch, value_head=True, device=device)
    load_full_state_dict([model], load_file(os.path.join(directory, "model.safetensors")),
                         tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size())
    return model.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------------------------
# Batches
@dataclass
class Batch:
    """One rank's rollout batch. Response-aligned tensors are [B, N]; ``index_BN`` is where the logits that
    predict response token j of sequence b sit in the sequence (position len(prompt_b) − 1 + j)."""

    tokens_BS: torch.Tensor
    index_BN: torch.Tensor
    mask_BN: torch.Tensor
    scores_B: torch.Tensor
    data: dict[str, torch.Tensor]

    def micro_batches(self, size: int) -> list[dict[str, torch.Tensor]]:
        out = []
        for lo in range(0, self.tokens_BS.shape[0], size):
            mb = {"tokens": self.tokens_BS[lo: lo + size], "index": self.index_BN[lo: lo + size],
                  "mask": self.mask_BN[lo: lo + size]}
            mb.update({k: v[lo: lo + size] for k, v in self.data.items()})
            out.append(mb)
        return out


def make_batch(prompts: list[list[int]], responses: list[list[int]], *, max_new_tokens: int,
               seq_length: int, device: torch.device) -> Batch:
    B, N = len(prompts), max_new_tokens
    tokens = torch.zeros(B, seq_length, dtype=torch.long)
    index = torch.zeros(B, N, dtype=torch.long)
    mask = torch.zeros(B, N)
    end = torch.zeros(B, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        seq = list(p) + list(r)
        tokens[b, : len(seq)] = torch.tensor(seq)
        index[b] = (len(p) - 1 + torch.arange(N)).clamp(max=seq_length - 2)
        mask[b, : len(r)] = 1.0
        end[b] = len(seq) - 1
    return Batch(tokens.to(device), index.to(device), mask.to(device), torch.zeros(B), {"end": end.to(device)})


def positions_like(tokens_BS: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens_BS.shape[1], device=tokens_BS.device).unsqueeze(0).expand_as(tokens_BS)


# ---------------------------------------------------------------------------------------------------------------
# The trainer
class Trainer:
    """Everything one rank holds: actor (on the HybridEngine), critic, reference, optimizers, the KL controller."""

    def __init__(self, args: argparse.Namespace) -> None:
        from megatron.core import parallel_state as ps

        from megatron_hybrid import HybridEngine, RolloutLayout

        self.args = args
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.tokenizer = build_tokenizer(args)
        self.vocab_size = self.tokenizer.vocab_size
        self.arch = architecture(args, self.vocab_size)
        self.tp_group, self.pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.last_stage = ps.is_pipeline_last_stage()
        self.prompts = Prompts(args, self.tokenizer)
        self.reward_model = None
        if args.reward_model_load is not None:
            self.reward_model = load_value_model(args.reward_model_load, self.device)
            self.reward_fn = None
        elif args.reward_fn is not None:
            self.reward_fn = load_callable(args.reward_fn)
        else:
            self.reward_fn = target_token_reward(args.target_token)

        actor = build_stage(self.arch, value_head=False, device=self.device)
        self.reference = build_stage(self.arch, value_head=False, device=self.device).requires_grad_(False).eval()
        copy_weights(self.reference, actor)
        self.actor = wrap_ddp(actor)
        self.actor_opt = torch.optim.Adam(list(self.actor.parameters()), lr=args.lr, weight_decay=args.weight_decay)
        self.critic = self.critic_opt = None
        if args.algorithm == "ppo":
            critic = build_stage(self.arch, value_head=True, device=self.device)
            copy_weights(critic, actor, skip_missing=True)  # the critic starts from the actor's trunk
            self.critic = wrap_ddp(critic)
            self.critic_opt = torch.optim.Adam(list(self.critic.parameters()), lr=args.critic_lr or args.lr,
                                               weight_decay=args.weight_decay)
        self.kl_ctl = ppo.make_kl_controller(ppo.KLConfig(args.kl_ctl_type, args.kl_coef, args.kl_target,
                                                          args.kl_horizon))
        self.rollout_layout = RolloutLayout(args.rollout_tensor_model_parallel_size,
                                            args.rollout_pipeline_model_parallel_size)
        self.engine = None
        if not args.no_hybrid_rollout:
            self.engine = HybridEngine(self.actor, self.rollout_layout, weight_mode=args.hybrid_weight_mode,
                                       bucket_size_mb=args.reshard_bucket_size_mb)
        if args.offload_reference:
            self._offload_reference()
        self.step = 0
        self.seq_length = args.max_new_tokens + max(
            [len(p) for p in self.prompts.lines] if self.prompts.lines else [args.prompt_length])

    # -- reference offload ------------------------------------------------------------------------------------
    def _offload_reference(self) -> None:
        self.reference.to("cpu")

    @contextlib.contextmanager
    def _reference_on_device(self) -> Iterator[torch.nn.Module]:
        self.reference.to(self.device)
        try:
            yield self.reference
        finally:
            if self.args.offload_reference:
                self._offload_reference()

    # -- generation -------------------------------------------------------------------------------------------
    def sampling_params(self):
        from megatron.core.inference.sampling_params import SamplingParams

        a = self.args
        return SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                              num_tokens_to_generate=a.max_new_tokens)

    def generate(self, prompts: list[list[int]], seed: int) -> tuple[list[list[int]], dict[str, float]]:
        stops = [] if self.tokenizer.eod is None else [self.tokenizer.eod]
        if self.engine is not None:
            offload = None if self.args.no_offload_optimizer else self.actor_opt
            self.engine.switch_to_rollout(offload_optimizer=offload, offload_grads=not self.args.no_offload_optimizer)
            report = self.engine.communication_report()
            results = self.engine.generate(prompts, self.sampling_params(), vocab_size=self.vocab_size,
                                           stop_token_ids=stops, seed=seed)
            start = time.perf_counter()
            self.engine.switch_to_training()
            switch = {"switch_seconds": report["switch_seconds"] + time.perf_counter() - start,
                      "switch_bytes": float(report["total_bytes"])}
        else:
            results = self._generate_in_training_layout(prompts, seed, stops)
            switch = {"switch_seconds": 0.0, "switch_bytes": 0.0}
        return [r.generated_tokens for r in results], switch

    def _generate_in_training_layout(self, prompts, seed, stops):
        """The same samples as the engine's, without resharding: the prompts are cut and seeded as the rollout
        replicas would (for rollout layouts that do not widen TP), and generated by the training model."""
        from megatron.core import parallel_state as ps

        from megatron_hybrid.layout import ParallelLayout
        from megatron_hybrid.rollout import generate_tokens, split_evenly

        lay = ParallelLayout.create(training=(self.tp_size, ps.get_pipeline_model_parallel_world_size(),
                                              self.dp_size), rollout=self.rollout_layout)
        parts = lay.d_g if not lay.widens else 1
        results = []
        for j, (lo, hi) in enumerate(split_evenly(len(prompts), parts)):
            replica = self.dp_rank * parts + j
            results += generate_tokens(self.actor.module, tp_group=self.tp_group, pp_group=self.pp_group,
                                       prompts=prompts[lo:hi], params=self.sampling_params(),
                                       vocab_size=self.vocab_size, stop_token_ids=stops,
                                       seed=seed + 1_000_003 * replica)
        return results

    # -- rewards ----------------------------------------------------------------------------------------------
    def scores(self, prompts, responses, batch: Batch) -> torch.Tensor:
        if self.reward_model is None:
            values = self.reward_fn(prompts, responses)
            if len(values) != len(responses):
                raise ValueError(f"the reward function returned {len(values)} values for {len(responses)} "
                                 "responses")
            return torch.tensor([float(v) for v in values])
        # The reward model's value at the last real token of each sequence; the last stage broadcasts it.
        out = self.forward_only(self.reward_model, batch, "score")
        scores = torch.zeros(len(prompts), device=self.device) if out is None else out.float()
        if self.pp_group.size() > 1:
            dist.broadcast(scores, src=dist.get_process_group_ranks(self.pp_group)[-1], group=self.pp_group)
        return scores.cpu()

    # -- forward passes ---------------------------------------------------------------------------------------
    def _token_stats(self, output: torch.Tensor, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies of the response tokens, [b, N], from vocabulary-parallel logits."""
        labels = torch.roll(mb["tokens"], -1, dims=1)
        V_t = output.shape[-1]
        logp, ent = ppo.vocab_parallel_logprobs_entropy(output, labels, tp_group=self.tp_group,
                                                       vocab_start=self.tp_rank * V_t, vocab_size=self.vocab_size,
                                                       temperature=self.args.temperature)
        return logp.gather(1, mb["index"]), ent.gather(1, mb["index"])

    def _run(self, model, batch_list: list[dict], forward_only: bool, loss_fn) -> list[dict]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            out = model(mb["tokens"], positions_like(mb["tokens"]), None)
            return out, lambda output: loss_fn(output, mb)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batch_list), model=[model],
            num_microbatches=len(batch_list), seq_length=self.seq_length, micro_batch_size=self.args.micro_batch_size,
            forward_only=forward_only)

    def forward_only(self, model, batch: Batch, what: str) -> Optional[torch.Tensor]:
        """``logp``/``entropy`` (policy) or ``values`` (value model) of the response tokens, or ``score`` (value
        model, at each sequence's last token); None off the last stage."""
        def loss_fn(output, mb):
            if what == "values":
                stats = {"values": output[..., 0].float().gather(1, mb["index"])}
            elif what == "score":
                stats = {"score": output[..., 0].float().gather(1, mb["end"].unsqueeze(1)).squeeze(1)}
            else:
                logp, ent = self._token_stats(output, mb)
                stats = {"logp": logp, "entropy": ent}
            return torch.zeros((), device=self.device), {k: v.detach() for k, v in stats.items()}

        with torch.no_grad():
            out = self._run(model, batch.micro_batches(self.args.micro_batch_size), True, loss_fn)
        if not self.last_stage:
            return None
        if what == "logp":
            return torch.cat([o["logp"] for o in out]), torch.cat([o["entropy"] for o in out])
        return torch.cat([o[what] for o in out])

    # -- optimisation -----------------------------------------------------------------------------------------
    def _optimizer_step(self, ddp, opt) -> float:
        """Gradients are in DDP's main_grad (all-reduced over DP by finalize_model_grads); clip by the global
        norm over the model-parallel ranks (tensor-parallel duplicates counted once) and step."""
        from megatron.core import parallel_state as ps

        params = [p for p in ddp.parameters() if p.requires_grad]
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in params:
            p.grad = p.main_grad.to(p.dtype)
            if getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0:
                sq += p.grad.double().square().sum()
        dist.all_reduce(sq, group=ps.get_model_parallel_group())
        norm = float(sq.sqrt())
        if self.args.clip_grad > 0 and norm > self.args.clip_grad:
            for p in params:
                p.grad.mul_(self.args.clip_grad / (norm + 1e-6))
        opt.step()
        return norm

    def _train_model(self, ddp, opt, batch: Batch, loss_fn) -> tuple[list[dict], float]:
        ddp.zero_grad_buffer()
        opt.zero_grad(set_to_none=True)  # DDP's hooks add param.grad into main_grad: it must start empty
        out = self._run(ddp, batch.micro_batches(self.args.micro_batch_size), False, loss_fn)
        return out, self._optimizer_step(ddp, opt)

    def actor_loss(self, output, mb):
        a = self.args
        logp, ent = self._token_stats(output, mb)
        mask = mb["mask"]
        loss, stats = ppo.policy_loss(logp, mb["old_logp"], mb["advantages"], mask, clip_ratio=a.clip_ratio,
                                      clip_ratio_high=a.clip_ratio_high)
        stats["pg_loss"] = loss.detach()
        entropy = ppo.masked_mean(ent, mask)
        if a.entropy_coef:
            loss = loss - a.entropy_coef * entropy
        if a.kl_loss_coef:
            kl_loss = ppo.masked_mean(ppo.kl_per_token(logp, mb["ref_logp"], "k3"), mask)
            loss = loss + a.kl_loss_coef * kl_loss
            stats["kl_loss"] = kl_loss.detach()
        stats["train_entropy"] = entropy.detach()
        return loss, stats

    def critic_loss(self, output, mb):
        values = output[..., 0].float().gather(1, mb["index"])
        loss, stats = ppo.value_loss(values, mb["old_values"], mb["returns"], mb["mask"],
                                     clip=self.args.value_clip or None)
        stats["vf_loss"] = loss.detach()
        return self.args.value_loss_coef * loss, stats

    # -- one step ---------------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        a, step = self.args, self.step
        t0 = time.perf_counter()
        base = self.prompts.for_step(step, dp_rank=self.dp_rank, dp_size=self.dp_size)
        prompts = [p for p in base for _ in range(a.num_samples_per_prompt)]
        responses, switch = self.generate(prompts, seed=a.seed * 7919 + step)
        t_gen = time.perf_counter() - t0
        batch = make_batch(prompts, responses, max_new_tokens=a.max_new_tokens, seq_length=self.seq_length,
                           device=self.device)
        scores = self.scores(prompts, responses, batch)
        batch.scores_B = scores
        local: dict[str, Any] = {"reward_mean": float(scores.mean()),
                                 "response_length": float(batch.mask_BN.sum(1).mean())}
        old = self.forward_only(self.actor, batch, "logp")
        with self._reference_on_device() as reference:
            ref = self.forward_only(reference, batch, "logp")
        values = self.forward_only(self.critic, batch, "values") if self.critic is not None else None
        mask = batch.mask_BN
        if self.last_stage:
            old_logp, entropy = old
            ref_logp = ref[0]
            kl = ppo.kl_per_token(old_logp, ref_logp, "k1")
            local["kl"] = float(ppo.masked_mean(kl, mask))
            local["entropy"] = float(ppo.masked_mean(entropy, mask))
            if a.algorithm == "ppo":
                penalty = ppo.kl_per_token(old_logp, ref_logp, a.kl_estimator)
                rewards = ppo.token_rewards(scores.to(self.device), penalty, mask, kl_coef=self.kl_ctl.value)
                advantages, returns = ppo.compute_gae(rewards, values, mask, gamma=a.gamma, lam=a.lam)
                batch.data.update(old_values=values, returns=returns)
                local["value_mean"] = float(ppo.masked_mean(values, mask))
            else:
                seq_adv = ppo.grpo_advantages(scores, group_size=a.num_samples_per_prompt).to(self.device)
                advantages = seq_adv.unsqueeze(1) * mask
            if not a.no_whiten_advantages:
                advantages = ppo.masked_whiten(advantages, mask, group=self.dp_group)
            batch.data.update(old_logp=old_logp, ref_logp=ref_logp, advantages=advantages)
        else:
            zeros = torch.zeros_like(mask)
            batch.data.update(old_logp=zeros, ref_logp=zeros, advantages=zeros, old_values=zeros, returns=zeros)
        epochs: dict[str, list[float]] = {}
        for _ in range(a.ppo_epochs):
            out, norm = self._train_model(self.actor, self.actor_opt, batch, self.actor_loss)
            epochs.setdefault("actor_grad_norm", []).append(norm)
            if self.critic is not None:
                cout, cnorm = self._train_model(self.critic, self.critic_opt, batch, self.critic_loss)
                epochs.setdefault("critic_grad_norm", []).append(cnorm)
                out = [o | c for o, c in zip(out, cout)]
            if self.last_stage:
                for key in out[0]:
                    epochs.setdefault(key, []).append(float(torch.stack([o[key] for o in out]).mean()))
        if self.last_stage:
            local.update(epochs)
        metrics = self._aggregate(local, switch)
        metrics.update(step=step + 1, kl_coef=self.kl_ctl.value, generate_seconds=t_gen,
                       step_seconds=time.perf_counter() - t0)
        self.kl_ctl.update(metrics["kl"], a.global_batch_size)
        self.step += 1
        return metrics

    def _aggregate(self, local: dict[str, Any], switch: dict[str, float]) -> dict[str, Any]:
        """Means over the DP replicas (read on their last stage, TP rank 0); switch bytes summed over all ranks,
        switch seconds the slowest rank's."""
        mine = {"metrics": local if self.last_stage and self.tp_rank == 0 else None, "switch": switch}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        parts = [e["metrics"] for e in everyone if e["metrics"] is not None]
        out: dict[str, Any] = {}
        for key in parts[0]:
            vals = [p[key] for p in parts]
            if isinstance(vals[0], list):
                out[key] = [sum(v[i] for v in vals) / len(vals) for i in range(len(vals[0]))]
            else:
                out[key] = sum(vals) / len(vals)
        out["switch_bytes"] = sum(e["switch"]["switch_bytes"] for e in everyone)
        out["switch_seconds"] = max(e["switch"]["switch_seconds"] for e in everyone)
        return out

    # -- checkpoints ------------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        def params(m):
            return {n: p.detach().cpu().clone() for n, p in m.named_parameters()} if m is not None else None

        return {
            "version": CHECKPOINT_VERSION,
            "step": self.step,
            "consumed_prompts": self.step * self.prompts.per_step(),
            "layout": [self.tp_size, self.pp_group.size(), self.dp_size],
            "actor": params(self.actor.module), "reference": params(self.reference),
            "critic": params(self.critic.module if self.critic is not None else None),
            "actor_optimizer": self.actor_opt.state_dict(),
            "critic_optimizer": self.critic_opt.state_dict() if self.critic_opt is not None else None,
            "kl_controller": self.kl_ctl.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "tracker": get_cuda_rng_tracker().get_states(),
                    "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
        }

    def save(self, directory: str) -> None:
        """``directory/iter_{step:07d}/rank_{rank:05d}.pt`` written into a temporary directory that is renamed
        once every rank has written, then ``latest_checkpointed_iteration.txt`` replaced atomically."""
        final = os.path.join(directory, f"iter_{self.step:07d}")
        tmp = os.path.join(directory, f".iter_{self.step:07d}.tmp")
        if dist.get_rank() == 0:
            os.makedirs(directory, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        torch.save(self._state(), os.path.join(tmp, f"rank_{dist.get_rank():05d}.pt"))
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            latest = os.path.join(directory, "latest_checkpointed_iteration.txt")
            with open(latest + ".tmp", "w") as f:
                f.write(f"{self.step}\n")
            os.replace(latest + ".tmp", latest)
        dist.barrier()

    def load(self, directory: str) -> None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        with open(os.path.join(directory, "latest_checkpointed_iteration.txt")) as f:
            it = int(f.read().strip())
        path = os.path.join(directory, f"iter_{it:07d}", f"rank_{dist.get_rank():05d}.pt")
        if not os.path.isfile(path):
            raise ValueError(f"--load: {path} is missing (was the checkpoint written with another world size?)")
        state = torch.load(path, weights_only=True)
        layout = [self.tp_size, self.pp_group.size(), self.dp_size]
        if state["layout"] != layout:
            raise ValueError(f"--load: the checkpoint's (tensor, pipeline, data) sizes {state['layout']} differ from "
                             f"this run's {layout}")
        for model, key in ((self.actor.module, "actor"), (self.reference, "reference"),
                           (self.critic.module if self.critic is not None else None, "critic")):
            if model is None:
                continue
            with torch.no_grad():  # in place: the engine's views of the actor's tensors stay valid
                for n, p in model.named_parameters():
                    p.copy_(state[key][n])
        _load_optimizer(self.actor_opt, state["actor_optimizer"])
        if self.critic_opt is not None:
            _load_optimizer(self.critic_opt, state["critic_optimizer"])
        self.kl_ctl.load_state_dict(state["kl_controller"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(_as_python_state(state["rng"]["python"]))
        get_cuda_rng_tracker().set_states(state["rng"]["tracker"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng"]["cuda"])
        self.step = state["step"]


def _load_optimizer(opt: torch.optim.Optimizer, state: dict) -> None:
    """``load_state_dict`` keeps the loaded tensors when dtype and device match; their storage belongs to the
    checkpoint reader and cannot be resized, which the engine's offload of optimizer states needs: own copies."""
    opt.load_state_dict(state)
    for s in opt.state.values():
        for k, v in s.items():
            if torch.is_tensor(v):
                s[k] = v.clone()


def _as_python_state(s):
    """random.setstate wants tuples; a weights-only load may give lists."""
    return tuple(tuple(x) if isinstance(x, list) else x for x in s)


# ---------------------------------------------------------------------------------------------------------------
# Logging
class Logger:
    """JSONL (one line per step), TensorBoard when installed, a tqdm bar; rank 0 only."""

    def __init__(self, args: argparse.Namespace, start: int) -> None:
        self.active = dist.get_rank() == 0
        self.jsonl = self.tb = self.bar = None
        if not self.active:
            return
        if args.log_dir is not None:
            os.makedirs(args.log_dir, exist_ok=True)
            self.jsonl = open(os.path.join(args.log_dir, "metrics.jsonl"), "a")
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                SummaryWriter = None
            if SummaryWriter is not None:
                self.tb = SummaryWriter(args.log_dir)
        if not args.no_progress:
            from tqdm import tqdm

            self.bar = tqdm(total=args.train_iters, initial=start, desc=args.algorithm, file=sys.stderr)

    def log(self, m: dict[str, Any]) -> None:
        if not self.active:
            return
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(m) + "\n")
            self.jsonl.flush()
        if self.tb is not None:
            for k, v in m.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, m["step"])
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{m['reward_mean']:.3f}", kl=f"{m['kl']:.4f}")

    def close(self) -> None:
        for h in (self.bar, self.jsonl, self.tb):
            if h is not None:
                h.close()


def summary(history: list[dict[str, Any]], window: int = 5) -> str:
    if not history:
        return "no steps run"
    k = min(window, len(history))
    first = sum(m["reward_mean"] for m in history[:k]) / k
    last = sum(m["reward_mean"] for m in history[-k:]) / k
    mb = sum(m["switch_bytes"] for m in history) / len(history) / 2**20
    sec = sum(m["switch_seconds"] for m in history) / len(history)
    return (f"steps {history[0]['step']}..{history[-1]['step']}: mean reward of the first {k} steps {first:.3f}, "
            f"of the last {k} {last:.3f} (rise {last - first:+.3f}); per switch {mb:.2f} MiB over all ranks, "
            f"{sec * 1e3:.1f} ms")


# ---------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def distributed(args: argparse.Namespace) -> Iterator[None]:
    """The process group (from torchrun's environment unless one exists), the CPU patches when there is no GPU,
    and Megatron's training groups (unless set up already, with the same sizes)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_hybrid.patches import cpu_gloo

    use_cuda = torch.cuda.is_available()
    own_pg = not dist.is_initialized()
    if own_pg:
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if use_cuda else "gloo",
                                timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    try:
        with contextlib.nullcontext() if use_cuda else cpu_gloo():
            own_mp = not ps.model_parallel_is_initialized()
            t, p = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
            if own_mp:
                # megatron-core (0.16.1) annotates the minutes as int but only computes timedelta(minutes=...)
                # from them, so fractional minutes reach its groups unchanged.
                ps.initialize_model_parallel(tensor_model_parallel_size=t, pipeline_model_parallel_size=p,
                                             distributed_timeout_minutes=args.distributed_timeout_minutes)
            elif (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) != (t, p):
                raise ValueError(f"Megatron's parallel state is set up for (tensor, pipeline) = "
                                 f"({ps.get_tensor_model_parallel_world_size()}, "
                                 f"{ps.get_pipeline_model_parallel_world_size()}), the arguments ask for ({t}, {p})")
            model_parallel_cuda_manual_seed(args.seed)
            torch.manual_seed(args.seed)
            random.seed(args.seed)
            try:
                yield
            finally:
                if own_mp:
                    ps.destroy_model_parallel()
    finally:
        if own_pg:
            dist.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    """Train; return the metrics of the steps run (every rank gets them)."""
    args = parse_args(argv)
    history: list[dict[str, Any]] = []
    with distributed(args):
        trainer = Trainer(args)
        if args.load is not None:
            trainer.load(args.load)
        logger = Logger(args, trainer.step)
        try:
            while trainer.step < args.train_iters:
                m = trainer.train_step()
                history.append(m)
                logger.log(m)
                if args.save is not None and args.save_interval and trainer.step % args.save_interval == 0:
                    trainer.save(args.save)
            if args.save is not None and (not args.save_interval or trainer.step % args.save_interval):
                trainer.save(args.save)
        finally:
            logger.close()
        if dist.get_rank() == 0:
            print(summary(history), flush=True)
    return history


if __name__ == "__main__":
    main()
