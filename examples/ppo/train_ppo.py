"""PPO and GRPO for a Megatron-core actor on the HybridEngine: generate in the rollout layout, train in the training
layout (Megatron's forward/backward schedule, DDP, optimizer and learning-rate schedule), with a critic, a frozen
reference policy and a reward.

Built-in default (no arguments): a tiny model (2 layers, hidden 64, a 16-token synthetic vocabulary) learns to
emit a target token; the reward is the fraction of the 8 generated tokens equal to it. 4 gloo ranks train with
TP=2 × DP=2 and generate with TP=1 (a real layout change every step):

    torchrun --nproc_per_node 4 examples/ppo/train_ppo.py
    torchrun --nproc_per_node 4 examples/ppo/train_ppo.py --algorithm grpo --num-samples-per-prompt 4
    torchrun --nproc_per_node 4 examples/ppo/train_ppo.py --train-iters 10 --save ckpt --save-interval 5
    torchrun --nproc_per_node 4 examples/ppo/train_ppo.py --train-iters 20 --load ckpt --save ckpt
    torchrun --nproc_per_node 8 examples/ppo/train_ppo.py --tensor-model-parallel-size 4 \\
        --rollout-tensor-model-parallel-size 2 --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR \\
        --prompt-file prompts.txt --reward-fn my_rewards:score --bf16 --lr-warmup-iters 5 --log-dir runs/ppo
    torchrun --nproc_per_node 4 examples/ppo/train_ppo.py --pretrained-checkpoint qwen-mcore --export-hf qwen-rl
    torchrun --nproc_per_node 4 examples/ppo/train_ppo.py --pretrained-checkpoint qwen3-moe-mcore \
        --sequence-parallel --expert-model-parallel-size 2 --moe-aux-loss-coeff 1e-3 --export-hf qwen3-moe-rl
    torchrun --nproc_per_node 4 examples/ppo/train_ppo.py --use-distributed-optimizer --sequence-parallel \\
        --overlap-grad-reduce --overlap-param-gather
    torchrun --nproc_per_node 4 examples/ppo/train_ppo.py --recompute-granularity full --recompute-method uniform \\
        --recompute-num-layers 1
    python examples/tasks/arithmetic.py --output-dir data && torchrun --nproc_per_node 4 examples/ppo/train_ppo.py \\
        --pretrained-checkpoint qwen-mcore --prompt-data data/train.jsonl --eval-prompt-data data/test.jsonl \\
        --eval-interval 5 --max-new-tokens 128

Prompts come from megatron_hybrid.rl.data (JSONL or verl parquet), rewards from megatron_hybrid.rl.rewards
(--reward-type, or --reward-fn: token lists, with answers=, or verl's compute_score on text).
The library pieces are in megatron_hybrid.rl; this file is the part to edit: prompts, rewards, losses, the step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
import warnings
from typing import Any, Iterator, Optional, Sequence

# --device cpu hides the GPUs before anything reads CUDA's device list: importing megatron-core does (the CUDA
# runtime reads CUDA_VISIBLE_DEVICES once). rl.initialize.select_device checks that it took.
if any(a == "--device=cpu" or a == "--device" and b == "cpu" for a, b in zip(sys.argv, sys.argv[1:] + [""])):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_hybrid import rl  # noqa: E402
from megatron_hybrid.reshard.communication import sum_over  # noqa: E402
from megatron_hybrid.rl import ppo  # noqa: E402
from megatron_hybrid.rl.arguments import add_hybrid_args, add_megatron_args, validate_args  # noqa: E402


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
    if args.partial_rollout and args.tis_imp_ratio_cap is None and not args.mask_offpolicy_in_partial_rollout:
        warnings.warn("--partial-rollout without --tis-imp-ratio-cap or --mask-offpolicy-in-partial-rollout: the "
                      "tokens of earlier weights train as if the current weights had made them", stacklevel=2)
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
class Trainer:
    """Everything one rank holds: actor (on the HybridEngine), critic, reference, the KL controller."""

    def __init__(self, args: argparse.Namespace, task: rl.Task) -> None:
        from megatron.core import parallel_state as ps

        from megatron_hybrid import HybridEngine, RolloutLayout, RolloutWeights

        self.args = a = args
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        # The task (rl.data, rl.rewards; loaded in main before any collective): replace it for a task of your own.
        self.tokenizer, self.arch, self.reward = task.tokenizer, task.arch, task.reward
        self.prompts, self.eval_prompts, self.generation_config = task.prompts, task.eval_prompts, task.generation
        self.dp_group, self.dp_rank, self.dp_size = ps.get_data_parallel_group(), ps.get_data_parallel_rank(), \
            ps.get_data_parallel_world_size()
        self.reports = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
        self.env = None  # --env: the multi-turn environments' runner (rl.envs)
        self.admitted = 0  # --filter-groups: prompts this rank admitted (the data position)
        if a.env is not None and self.prompts.has_stop_tokens:  # every rank reads the same rows: no collective
            raise ValueError("--env: the environments end each turn themselves; rows of --prompt-data with "
                             "'stop_token_ids' are for single-turn runs (drop the field, or --env)")
        self.reward_model = None if a.reward_model_load is None else \
            rl.load_value_model(a.reward_model_load, device=self.device)

        stage_kw = dict(device=self.device, sequence_parallel=a.sequence_parallel,  # every training-layout model
                        attention_backend=a.attention_backend)
        # --recompute-granularity: the models that train (the reference only runs forward, in no-grad passes).
        recompute = rl.recompute_config(a)
        actor = rl.build_stage(self.arch, **stage_kw, moe_enable_routing_replay=a.moe_enable_routing_replay,
                               **rl.rollout_fp8_config(a),  # --first-last-layers-bf16: read by the HybridEngine
                               **recompute)
        if a.pretrained_checkpoint is not None:  # the reference and the critic's trunk copy the actor's weights
            rl.load_pretrained(actor, a.pretrained_checkpoint)
        self.reference = rl.build_reference(actor, self.arch, **stage_kw)
        self.actor = rl.setup_model_and_optimizer(actor, a)  # DDP, Adam (--use-distributed-optimizer), schedule
        self.critic = None if a.algorithm != "ppo" else rl.setup_model_and_optimizer(
            rl.build_critic(actor, self.arch, **stage_kw, **recompute), a, lr=a.critic_lr)  # None: --lr
        self.kl_ctl = ppo.make_kl_controller(ppo.KLConfig(a.kl_ctl_type, a.kl_coef, a.kl_target, a.kl_horizon))
        self.rollout_layout = RolloutLayout(a.rollout_tensor_model_parallel_size,
                                            a.rollout_pipeline_model_parallel_size,
                                            expert_model_parallel_size=a.rollout_expert_model_parallel_size,
                                            expert_tensor_parallel_size=a.rollout_expert_tensor_parallel_size)
        if a.offload_reference:  # before the engine: its build copies the actor's weights once (a transient peak)
            self.reference.to("cpu")
        self.engine = None if a.no_hybrid_rollout else HybridEngine(
            self.actor.model, self.rollout_layout, weight_mode=a.hybrid_weight_mode,
            bucket_size_mb=a.reshard_bucket_size_mb, optimizer=self.actor.optimizer,  # its views of DDP's buffer
            rollout_weights=RolloutWeights.FP8 if a.rollout_fp8 else RolloutWeights.MODEL)
        rollout_tp, rollout_pp = self.rollout_layout.tensor_model_parallel_size, \
            self.rollout_layout.pipeline_model_parallel_size
        self.memory = rl.RolloutMemoryPolicy(  # --inference-memory-fraction, --offload-optimizer
            self.generation_config, fraction=a.inference_memory_fraction, offload=a.offload_optimizer,
            per_token=rl.kv_bytes_per_token(self.arch, rollout_tp=rollout_tp, rollout_pp=rollout_pp),
            reserve=rl.graph_reserve_bytes(self.arch, rollout_tp=rollout_tp,
                                           max_requests=self.generation_config.max_batch_size),
            device=self.device)
        self.step = 0
        # The flags that scale each quantity checked for NaN/inf, named when it is not finite (their values passed
        # the checks, the step overflowed). PPO's rewards, and so its advantages and returns, carry the KL penalty.
        kl = ("kl_coef",) if a.algorithm == "ppo" else ()
        self.scaled_by = {
            "the actor": rl.flag_values(a, "lr", "temperature", "clip_ratio", *kl),
            "the critic": rl.flag_values(a, "lr" if a.critic_lr is None else "critic_lr", "value_loss_coef", *kl),
            "the actor's log-probs": rl.flag_values(a, "temperature", "lr"),
            "the reference's log-probs": rl.flag_values(a, "temperature"),
            "the critic's values": rl.flag_values(a, "lr" if a.critic_lr is None else "critic_lr"),
            "the token rewards": rl.flag_values(a, *kl),
            "the advantages": rl.flag_values(a, *kl)}
        # --env: a sample's response is its turns and observations; its first prompt what the KV cache holds.
        self.response_tokens, longest = a.max_new_tokens, self.prompts.max_length
        if a.env is not None:
            self.response_tokens = a.max_sample_tokens
            longest = self.generation_config.max_sequence_length - a.max_new_tokens - a.max_sample_tokens
            self.env = rl.EnvRunner(rl.load_env(a.env), name=a.env, vocab_size=self.tokenizer.vocab_size,
                                    max_turns=a.max_turns, budget=a.max_sample_tokens, max_prompt_tokens=longest,
                                    group=ps.get_model_parallel_group(), keep_prefix=not a.no_keep_prefix,
                                    tokenizer=self.tokenizer)
        self.passes = rl.TrainingPasses(rl.PassConfig(  # with --sequence-parallel a multiple of TP
            rl.padded_seq_length(self.response_tokens + longest, sequence_parallel=a.sequence_parallel),
            a.micro_batch_size, self.tokenizer.vocab_size, a.temperature,
            max_tokens_per_micro_batch=a.max_tokens_per_micro_batch))
        # --partial-rollout: this DP rank's samples across steps; a unit trains whole (a GRPO group, a PPO sample).
        unit = a.num_samples_per_prompt if a.algorithm == "grpo" else 1
        self.partial = None if not a.partial_rollout else rl.PartialRollout(
            quota=a.global_batch_size // self.dp_size // unit, in_flight=a.partial_rollout_in_flight // self.dp_size,
            samples_per_prompt=a.num_samples_per_prompt, unit_size=unit, max_staleness=a.max_staleness,
            dp_rank=self.dp_rank, dp_size=self.dp_size, vocab_size=self.tokenizer.vocab_size)

    @contextlib.contextmanager
    def _reference_on_device(self) -> Iterator[torch.nn.Module]:
        self.reference.to(self.device)
        try:
            yield self.reference
        finally:
            if self.args.offload_reference:
                self.reference.to("cpu")

    def generate(self, prompts: list[list[int]], seed: int, *, greedy: bool = False,
                 stops: Optional[list[list[int]]] = None, **partial: Any) -> rl.Rollout:
        """``stops``: per prompt, its own stop tokens (the data rows' ``stop_token_ids``), besides the run's."""
        from megatron.core.inference.sampling_params import SamplingParams

        a = self.args
        params = SamplingParams(temperature=a.temperature, top_k=1 if greedy else a.top_k,
                                top_p=0.0 if greedy else a.top_p, num_tokens_to_generate=a.max_new_tokens)
        kwargs = dict(vocab_size=self.tokenizer.vocab_size, seed=seed,
                      stop_token_ids=([] if self.tokenizer.eod is None else [self.tokenizer.eod]) + a.stop_token_ids)
        if stops is not None and any(stops):
            kwargs["request_stop_token_ids"] = stops
        if self.engine is None:
            return rl.generate_in_training_layout(self.actor.model, prompts, params, **kwargs,
                                                  rollout_layout=self.rollout_layout,
                                                  record_routing=a.moe_enable_routing_replay)
        offload = self.memory.offload()  # --offload-optimizer: always, never, or when the rollout needs the room
        return rl.generate_on_engine(self.engine, prompts, params, **kwargs, offload_grads=offload,
                                     offload_optimizer=self.actor.optimizer if offload else None,
                                     config=self.memory.sized,  # --inference-memory-fraction: sized at the first
                                     **partial)  # budget=, resume=: --partial-rollout

    def evaluate(self) -> dict[str, float]:
        """Greedy exact-match accuracy on --eval-prompt-data, and its seconds (not in the step's ``time/step``)."""
        start = time.perf_counter()
        accuracy = rl.evaluate_accuracy(lambda p, s=None: self.generate(p, 0, greedy=True, stops=s).responses,
                                        self.eval_prompts,
                                        self.tokenizer, dp_rank=self.dp_rank, dp_size=self.dp_size,
                                        dp_group=self.dp_group)
        return {"eval_accuracy": accuracy, "time/eval": time.perf_counter() - start}

    def scores(self, prompts: list[list[int]], responses: list[list[int]], batch: rl.Batch,
               examples: list[rl.Example]) -> torch.Tensor:
        if self.reward_model is None:
            return rl.reward_scores(self.reward.for_examples(examples), prompts, responses, step=self.step + 1,
                                    name=self.reward.name)
        scores = self.passes.scores(self.reward_model, batch)
        rl.check_finite(self.step + 1, {f"the rewards of --reward-model-load {self.args.reward_model_load}": scores})
        return scores

    def filter_driver(self, step: int) -> Any:
        """--filter-groups: ``generate``'s driver, rounds of admitted prompts scored and filtered inside one rollout
        phase (rl.filtering); the rewards come with the samples."""
        a = self.args

        def admit() -> rl.Example:  # rank r's k-th prompt is the data set's k * DP + r
            self.admitted += 1
            return self.prompts.example((self.admitted - 1) * self.dp_size + self.dp_rank)

        def score(examples: list[rl.Example], prompts: list[list[int]], responses: list[list[int]]) -> torch.Tensor:
            return rl.reward_scores(self.reward.for_examples(examples), prompts, responses, step=step + 1,
                                    name=self.reward.name)

        def rounds(call: Any) -> rl.filtering.FilteredSamples:
            out = rl.filtering.filter_groups(
                admit, lambda prompts, r, **kw: call(prompts, a.seed * 7919 + step + 15_485_863 * r, **kw), score,
                quota=a.global_batch_size // self.dp_size // a.num_samples_per_prompt,
                group_size=a.num_samples_per_prompt, max_rounds=a.max_filter_rounds)
            return out
        return rounds

    def env_driver(self, examples: list[rl.Example], step: int) -> dict[str, Any]:
        """--env: ``generate``'s driver, the samples' turns inside one rollout phase (rl.envs); else nothing."""
        if self.env is None:
            return {}
        seed = self.args.seed * 7919 + step  # each turn its own sampling stream

        a = self.args
        keep = not a.no_keep_prefix

        def turn(call: rl.EngineCall) -> rl.Episodes:
            workers, share = 0 if a.no_keep_prefix else a.env_workers, None
            if workers != 0:
                try:  # threads where every rollout replica is one rank
                    share = call.turn_share(len(examples))
                except ValueError:
                    if workers is not None:  # asked for: the layout's refusal stands
                        raise
                workers = 0 if share is None else workers or 8
            if workers:
                return self.env.run_async(examples, lambda prompts, turns: call(prompts, seed, turns=turns),
                                          step=step + 1, share=share, max_new_tokens=a.max_new_tokens,
                                          workers=workers)

            def generate(prompts: list[list[int]], t: int, kept: list) -> list:
                return call(prompts, seed + 104_729 * t, keep=keep, continued=kept if keep else ())
            return self.env.run(examples, generate, step=step + 1, release=call.release)
        return {"driver": turn}

    def partial_rollout(self, timer: rl.StepTimer) -> tuple[list[rl.Example], rl.Rollout, rl.partial.Counts]:
        """--partial-rollout's rollout (rl.partial): drop the stale units, admit prompts, generate on under the
        budget of the units still needed; the step's finished units as examples and a Rollout of their samples
        (``weight_versions``: the update count that made each token), and the step's counts."""
        a, step, buffer = self.args, self.step, self.partial
        counts = rl.partial.Counts()
        buffer.drop_stale(step, counts)
        buffer.admit(self.prompts.example, counts)  # each sample keeps its prompt's own stop tokens
        resume, budget = buffer.requests(counts, version=step)  # the units due at this step must end in it
        with timer.peak("generation"):  # nothing to generate when finished units already make the quota
            rollout = self.generate([], seed=a.seed * 7919 + step, budget=budget, resume=resume)
        generated = buffer.absorb(rollout.results, version=step)
        units = buffer.take()
        samples = [s for u in units for s in u.samples]
        waiting, parked = buffer.held()
        counts.generated_tokens, counts.waiting, counts.parked = generated, waiting, parked
        counts.staleness = rl.staleness_histogram(units, step, a.max_staleness)
        trained = dataclasses.replace(rollout, responses=[s.generated_tokens for s in samples],
                                      log_probs=[s.generated_tempered_log_probs for s in samples], results=samples)
        return [self.prompts.example(u.index) for u in units for _ in u.samples], trained, counts

    # -- losses (Megatron's loss_func of one micro-batch) -----------------------------------------------------
    def actor_loss(self, output: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict]:
        a = self.args
        logp, ent = self.passes.token_stats(output, mb)
        mask = mb["mask"]
        loss, stats = ppo.policy_loss(logp, mb["old_logp"], mb["advantages"], mask, clip_ratio=a.clip_ratio,
                                      clip_ratio_high=a.clip_ratio_high, rollout_logp_BT=mb["rollout_logp"],
                                      tis_imp_ratio_cap=a.tis_imp_ratio_cap)
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

    def critic_loss(self, output: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict]:
        loss, stats = ppo.value_loss(rl.response_values(output, mb), mb["old_values"], mb["returns"], mb["mask"],
                                     clip=self.args.value_clip or None)
        stats["vf_loss"] = loss.detach()
        return self.args.value_loss_coef * loss, stats

    # -- one iteration: generate, score, the passes, the advantages, the updates -------------------------------
    def train_step(self) -> dict[str, Any]:
        a, step = self.args, self.step
        timer = rl.StepTimer()
        partial = episodes = filtered = None
        if a.filter_groups:  # --filter-groups: rounds of prompts until the step has its groups with spread
            with timer.peak("generation"):
                rollout = self.generate([], seed=a.seed * 7919 + step, driver=self.filter_driver(step))
            filtered = rollout.episodes
            examples, generated = filtered.examples, filtered.counts.pop("tokens")
        elif self.partial is None:
            base = self.prompts.for_step(step, dp_rank=self.dp_rank, dp_size=self.dp_size)
            examples = [e for e in base for _ in range(a.num_samples_per_prompt)]
            with timer.peak("generation"):  # the switch's and the rollout's seconds are measured inside
                rollout = self.generate([e.tokens for e in examples], seed=a.seed * 7919 + step,
                                        stops=[list(e.stop_token_ids) for e in examples],
                                        **self.env_driver(examples, step))
            generated, episodes = rollout.num_tokens, rollout.episodes
        else:  # finished samples of this step and earlier ones
            examples, rollout, partial = self.partial_rollout(timer)
            generated = partial.generated_tokens
        prompts, responses = [e.tokens for e in examples], rollout.responses
        if episodes is not None:  # --env: the environments' first prompts; observations are no model tokens
            prompts, generated = episodes.prompts, episodes.model_tokens
        timer.add("generation", rollout.generation_seconds, tokens=generated)
        timer.add("switch", rollout.switch_seconds)
        switch_metrics = {"switch/to_rollout_seconds": rollout.switch_seconds_each_way[0],
                          "switch/to_training_seconds": rollout.switch_seconds_each_way[1],
                          "switch/offload_seconds": rollout.offload_seconds_each_way[0],
                          "switch/reload_seconds": rollout.offload_seconds_each_way[1],
                          "switch/offload_gib": rollout.offload_bytes / 2**30}
        batch = rl.make_batch(prompts, responses, max_new_tokens=self.response_tokens,
                              rollout_log_probs=rollout.log_probs, seq_length=self.passes.config.seq_length,
                              device=self.device, routed_experts=rollout.routed_experts,  # replayed by the actor
                              loss_masks=None if episodes is None else episodes.loss_masks)
        with timer.phase("reward"):
            given = episodes.rewards if episodes is not None else filtered.scores if filtered is not None else None
            batch.scores_B = scores = self.scores(prompts, responses, batch, examples) if given is None else \
                torch.tensor(given)
        if self.engine is not None:  # the generator's decode steps, and those with half its slots busy
            decode, busy = rollout.decode_steps
            switch_metrics.update({"rollout/decode_steps": decode, "rollout/busy_fraction": busy / max(decode, 1)})
        local: dict[str, Any] = {**switch_metrics, "reward_mean": float(scores.mean()),
                                 "response_length": float(batch.mask_BN.sum(1).mean())}
        if self.prompts.has_answers and episodes is None:  # the exact-match accuracy, whatever the reward
            local["accuracy"] = rl.accuracy(self.tokenizer, responses, examples)
        if episodes is not None:
            local.update({"env/turns": sum(episodes.turns) / max(len(episodes.turns), 1),
                          "env/truncated_fraction": episodes.truncated / max(len(episodes.turns), 1),
                          "env/seconds": episodes.env_seconds})
        if a.algorithm == "grpo":  # groups whose rewards are all equal: no policy gradient (DAPO's count)
            counts = {"grpo/zero_variance_groups": rl.filtering.zero_variance_groups(scores, a.num_samples_per_prompt)}
            if filtered is not None:  # --filter-groups: the rounds (every rank's), the groups over DP
                local["filter/rounds"] = filtered.counts.pop("rounds")
                counts.update({f"filter/{k}_groups": v for k, v in filtered.counts.items()})
            local.update(zip(counts, sum_over(list(counts.values()), self.dp_group)))
        if partial is not None:
            local.update(self.partial_metrics(partial))
            if a.mask_offpolicy_in_partial_rollout:  # only the tokens of the weights that train take part
                batch.mask_BN = batch.mask_BN * rl.partial.onpolicy_mask(rollout.results, step, batch.mask_BN)
        if a.max_tokens_per_micro_batch is not None and self.dp_size > 1:  # packed passes: balance the DP ranks
            batch, balance = rl.balance_batch(batch, group=self.dp_group,  # whole GRPO groups
                                              unit_size=a.num_samples_per_prompt if a.algorithm == "grpo" else 1)
            local.update(balance.metrics())
            scores = batch.scores_B
        with timer.phase("actor_log_probs"), self.passes.routing_metrics(self.actor.model, batch) as routing:
            old = self.passes.log_probs(self.actor.model, batch)
        local.update(routing())  # moe/routing_mismatch_tokens, ... (a collective: every rank)
        with timer.phase("reference_log_probs"), self._reference_on_device() as reference:
            ref = self.passes.log_probs(reference, batch)
        with timer.phase("critic_values"):
            values = self.passes.values(self.critic.model, batch) if self.critic is not None else None
        mask = batch.mask_BN
        checked: dict[str, Any] = {}  # the last stage's, checked on every rank before the updates
        if self.passes.last_stage:
            (old_logp, entropy), ref_logp = old, ref[0]
            local["kl"] = float(ppo.masked_mean(ppo.kl_per_token(old_logp, ref_logp, "k1"), mask))
            local["entropy"] = float(ppo.masked_mean(entropy, mask))
            local.update({k: float(v) for k, v in ppo.rollout_mismatch(old_logp, batch.data["rollout_logp"],
                                                                        mask).items()})
            if a.algorithm == "ppo":
                penalty = ppo.kl_per_token(old_logp, ref_logp, a.kl_estimator)
                rewards = ppo.token_rewards(scores.to(self.device), penalty, mask, kl_coef=self.kl_ctl.value)
                checked.update({"the token rewards": rewards, "the critic's values": values})
                advantages, returns = ppo.compute_gae(rewards, values, mask, gamma=a.gamma, lam=a.lam)
                batch.data.update(old_values=values, returns=returns)
                local["value_mean"] = float(ppo.masked_mean(values, mask))
            else:
                advantages = ppo.grpo_advantages(scores, group_size=a.num_samples_per_prompt).to(self.device) \
                    .unsqueeze(1) * mask
            if not a.no_whiten_advantages:
                advantages = ppo.masked_whiten(advantages, mask, group=self.dp_group)
            batch.data.update(old_logp=old_logp, ref_logp=ref_logp, advantages=advantages)
            checked = {"the actor's log-probs": old_logp, "the reference's log-probs": ref_logp, **checked,
                       "the advantages": advantages}
        else:  # the earlier stages never read them, but every stage slices the same micro-batch keys
            zeros = torch.zeros_like(mask)
            batch.data.update(old_logp=zeros, ref_logp=zeros, advantages=zeros, old_values=zeros, returns=zeros)
        rl.check_finite(step + 1, {k: v[mask > 0] for k, v in checked.items()}, scaled_by=self.scaled_by)
        local["lr"] = self.actor.optimizer.param_groups[0]["lr"]
        epochs: dict[str, list[float]] = {}
        for _ in range(a.ppo_epochs):
            trained = [m.model for m in (self.actor, self.critic) if m is not None]
            with timer.phase("update", tokens=batch.num_tokens, flops=rl.training_flops(trained, batch.num_tokens)):
                actor = rl.update(self.actor, batch, self.actor_loss, passes=self.passes, step=step + 1,
                                  name="the actor", scaled_by=self.scaled_by["the actor"])
                critic = None if self.critic is None else rl.update(
                    self.critic, batch, self.critic_loss, passes=self.passes, step=step + 1, name="the critic",
                    scaled_by=self.scaled_by["the critic"])
            epochs.setdefault("actor_grad_norm", []).append(actor.grad_norm)
            for key, value in actor.aux_losses.items():  # an MoE actor's load_balancing_loss
                epochs.setdefault(key, []).append(value)
            out = actor.stats
            if critic is not None:
                epochs.setdefault("critic_grad_norm", []).append(critic.grad_norm)
                for key, value in critic.aux_losses.items():
                    epochs.setdefault(f"critic_{key}", []).append(value)
                out = [o | c for o, c in zip(out, critic.stats)]
            for key in out[0] if out else ():  # means over the response tokens, as the losses are
                epochs.setdefault(key, []).append(rl.token_mean(out, actor.tokens, key))
        for trained in (self.actor, self.critic):  # the schedule counts samples, as Megatron-LM's does
            if trained is not None:
                trained.scheduler.step(increment=a.global_batch_size)
        local.update(epochs)
        metrics = rl.aggregate_metrics(local if self.reports else None, timer, switch_bytes=rollout.switch_bytes)
        metrics.update(step=step + 1, kl_coef=self.kl_ctl.value)
        # The response tokens the step trained on (its samples' lengths), per second of the whole step.
        metrics["throughput/effective_tokens_per_second"] = \
            metrics["response_length"] * a.global_batch_size / metrics["time/step"]
        self.kl_ctl.update(metrics["kl"], a.global_batch_size)
        self.step += 1
        return metrics

    def partial_metrics(self, counts: Any) -> dict[str, Any]:
        """--partial-rollout's counts, summed over the DP replicas (a collective of the DP group), and the share
        of the trained tokens at each staleness (0 ... --max-staleness versions)."""
        buffer = self.partial
        keys = ("admitted", "resumed", "dropped", "waiting", "parked", "due")
        mine = [counts.admitted, counts.resumed, counts.dropped, counts.waiting, counts.parked, counts.due,
                buffer.dropped, buffer.admitted]
        total = sum_over(mine, self.dp_group)
        return {**{f"partial/{k}": v for k, v in zip(keys, total)}, "partial/dropped_total": total[6],
                "partial/admitted_total": total[7], "partial/staleness": counts.staleness}

    # -- checkpoints ------------------------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:  # checkpointed by name: parameters, optimizers, schedulers
        return {"actor": self.actor, "critic": self.critic, "reference": self.reference}

    def state_dict(self) -> dict[str, Any]:  # called on every rank (--partial-rollout, --filter-groups: over DP)
        state = {"consumed_prompts": self.step * self.prompts.per_step(), "kl_controller": self.kl_ctl.state_dict()}
        if self.args.filter_groups:  # each DP rank's admitted prompts
            admitted: list[Any] = [None] * self.dp_size
            dist.all_gather_object(admitted, self.admitted, group=self.dp_group)
            state.update(consumed_prompts=sum(admitted), admitted=admitted)
        if self.partial is not None:  # every DP replica's samples (the checkpoint's common part is rank 0's)
            ranks: list[Any] = [None] * self.dp_size
            dist.all_gather_object(ranks, self.partial.state_dict(), group=self.dp_group)
            state["consumed_prompts"] = sum(r["admitted"] for r in ranks)
            state["partial_rollout"] = {"dp_size": self.dp_size, "vocab_size": self.tokenizer.vocab_size,
                                        "ranks": ranks}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl_ctl.load_state_dict(state["kl_controller"])
        self.step = state["step"]
        if self.args.filter_groups:  # the data position: each rank's own at the same DP size, else past them all
            admitted = state.get("admitted", [state["consumed_prompts"] // self.dp_size] * self.dp_size)
            self.admitted = admitted[self.dp_rank] if len(admitted) == self.dp_size else max(admitted)
        saved = state.get("partial_rollout")
        if self.partial is not None and saved is not None:  # the same on every rank: a ValueError on all
            rl.check_resumable(saved, dp_size=self.dp_size, vocab_size=self.tokenizer.vocab_size)
            self.partial.load_state_dict(saved["ranks"][self.dp_rank])
        elif self.partial is not None:  # from a synchronous run: admission goes on from its data position
            self.partial.admitted = state["consumed_prompts"] // self.dp_size
        elif saved is not None and dist.get_rank() == 0:
            parked = sum(len(r["units"]) for r in saved["ranks"])
            warnings.warn(f"--load: the checkpoint's {parked} partial-rollout units are dropped (this run has no "
                          "--partial-rollout)", stacklevel=2)


def main(argv: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    """Train; return the metrics of the steps run (every rank gets them)."""
    args = parse_args(argv)
    history: list[dict[str, Any]] = []
    task = rl.load_task(args)  # tokenizer, architecture, prompts, reward: bad data fails here, on every rank alike
    with rl.initialize(args):  # also records each rank's phase (rl.phases): a timeout names the late ranks
        with rl.phase("setup"):
            trainer = Trainer(args, task)
        if args.load is not None:
            trainer.load_state_dict(rl.load_checkpoint(args.load, trainer.models()))
        loaded_step = trainer.step
        logger = rl.MetricsLogger(args, start=trainer.step)
        try:
            while trainer.step < args.train_iters:
                with rl.phase("train step", step=trainer.step + 1):  # rl's functions record the phases within
                    history.append(trainer.train_step())
                if args.eval_interval and trainer.step % args.eval_interval == 0:
                    history[-1].update(trainer.evaluate())
                logger.log(history[-1])
                if args.save is not None and args.save_interval and trainer.step % args.save_interval == 0:
                    rl.save_checkpoint(args.save, trainer.step, trainer.models(), trainer.state_dict())
                if args.export_hf_interval and trainer.step % args.export_hf_interval == 0:
                    rl.export_hf(trainer.actor.model, args.export_hf, args.pretrained_checkpoint,
                                 iteration=trainer.step)
            if args.save is not None and (not args.save_interval or trainer.step % args.save_interval):
                rl.save_checkpoint(args.save, trainer.step, trainer.models(), trainer.state_dict())
            if args.export_hf is not None:
                rl.export_hf(trainer.actor.model, args.export_hf, args.pretrained_checkpoint)
        finally:
            logger.close()
        if dist.get_rank() == 0:
            print(rl.summary(history, args=args, loaded_step=loaded_step), flush=True)
    return history


if __name__ == "__main__":
    main()
