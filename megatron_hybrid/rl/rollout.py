"""The rollout phase of an RL iteration: the actor generates on the HybridEngine's rollout layout (switching there
and back, optimizer states off the device meanwhile), or, for comparisons, on its training layout."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from ..inference import GenerationConfig, generate_with_model, replica_seed, split_evenly
from ..inference.planner import MIXED_TOKENS
from ..layout import ParallelLayout
from ..megatron import ddp_finish_param_sync, megatron_groups, sequence_parallel_off, unwrap_model
from .phases import phase, recorded


@dataclass
class Rollout:
    """One rank's responses and what generating them cost."""

    responses: list[list[int]]
    """The response tokens of each prompt, in order."""
    log_probs: list[list[float]]
    """Each response token's log-prob at the sampling temperature (softmax(logits / temperature) over the real
    vocabulary, before top-k/top-p), as the rollout computed it: the training passes' old log-probs of the same
    tokens, up to the numerical mismatch between the two layouts."""
    generation_seconds: float
    """Wall-clock seconds of generation proper (without the switches)."""
    switch_bytes: float = 0.0
    """The bytes this rank received in the switch to rollout."""
    switch_seconds_each_way: tuple[float, float] = (0.0, 0.0)
    """The switch to rollout's seconds and the switch back's; 0 in the training layout."""
    offload_seconds_each_way: tuple[float, float] = (0.0, 0.0)
    """Of those, moving the optimizer's states and gradients to the host, and back (0 without offload)."""
    offload_bytes: int = 0
    """The device bytes the offload moved to the host (each way)."""
    routed_experts: Optional[list[torch.Tensor]] = None
    """With ``--moe-enable-routing-replay``: each sequence's routing record (``GenerationResult.routed_experts``,
    ``[len(prompt) + len(response) - 1, M, k]``), for :func:`~megatron_hybrid.rl.make_batch`."""
    results: Optional[list] = None
    """The generator's results (``GenerationResult``: finished or not, weight versions), on the HybridEngine."""
    episodes: Any = None
    """With a ``driver`` (``--env``): its :class:`~.envs.Episodes` (first prompts, loss masks, rewards)."""
    decode_steps: tuple[int, int] = (0, 0)
    """This rank's rollout replica's decode steps in the call, and of them those with at least half of the slots
    decoding (the generator busy); on the HybridEngine."""

    @property
    def switch_seconds(self) -> float:
        """Both switches' seconds (to rollout and back)."""
        return sum(self.switch_seconds_each_way)

    @property
    def num_tokens(self) -> int:
        """The response tokens generated for this rank."""
        return sum(len(r) for r in self.responses)


def generation_config(args: Any, *, max_prompt_length: int) -> GenerationConfig:
    """The rollout's KV-cache settings for a run: ``--inference-max-requests`` slots of
    ``--inference-max-seq-length`` positions (default: ``max_prompt_length`` + ``--max-new-tokens``). Sizing the
    slots to the model's whole context instead would cost, for a 135 M-parameter model with 8,192 positions and
    64 slots, 24 GiB of cache."""
    # With --env a turn's prompt is the first prompt and the sample's response so far (up to --max-sample-tokens).
    new = args.max_new_tokens + (args.max_sample_tokens if getattr(args, "env", None) else 0)
    what = "--max-new-tokens" + (" + --max-sample-tokens" if getattr(args, "env", None) else "")
    length = args.inference_max_seq_length or max_prompt_length + new
    if length < max_prompt_length + new:
        raise ValueError(f"--inference-max-seq-length ({length}) must hold the longest prompt ({max_prompt_length} "
                         f"tokens) plus {what} ({new})")
    # --env keeps each turn's KV cache for the next: a continuation's tokens ride in mixed steps, which a CPU
    # (whose decode attention reads no lengths) does not run by default.
    keep = getattr(args, "env", None) and not getattr(args, "no_keep_prefix", False)
    return GenerationConfig(max_batch_size=args.inference_max_requests, max_sequence_length=max(length, 2),
                            record_routing=args.moe_enable_routing_replay,
                            mixed_prefill_tokens=MIXED_TOKENS if keep else None)


class EngineCall:
    """A rollout phase's generate calls on ``engine`` (``generate_on_engine``'s driver gets one): ``call(prompts,
    seed, **kw)`` is ``engine.generate`` with the phase's sampling settings; :meth:`release` frees kept prefixes and
    :meth:`turn_share` names this rank's prompts of a call with ``turns`` (multi-turn)."""

    def __init__(self, engine: Any, settings: dict[str, Any]) -> None:
        self.engine, self.settings = engine, settings

    def __call__(self, inputs: list[list[int]], call_seed: int, **kw: Any) -> list:
        settings = dict(self.settings)
        params = settings.pop("sampling_params")
        return self.engine.generate(inputs, params, seed=call_seed, **settings, **kw)

    def release(self, kept: list) -> None:
        getattr(self.engine, "release_kept", lambda k: None)(kept)

    def turn_share(self, n: int) -> tuple[int, int]:
        """``[lo, hi)`` of ``n`` prompts (``ValueError`` where the layout serves no ``turns``)."""
        from ..inference import turn_share

        return turn_share(self.engine, n)


@recorded("generate")
def generate_on_engine(engine: Any, prompts: list[list[int]], sampling_params, *, vocab_size: int,
                       stop_token_ids: Sequence[int], seed: int, offload_optimizer: Optional[Any] = None,
                       offload_grads: bool = False, config: Any = None, budget: Any = None,
                       resume: Sequence[Any] = (), driver: Optional[Callable] = None,
                       request_stop_token_ids: Optional[Sequence[Sequence[int]]] = None) -> Rollout:
    """Switch to rollout (moving ``offload_optimizer``'s states and fp32 main parameters, and the gradient buffers
    with ``offload_grads``, to host memory), generate this rank's responses, switch back. ``config``: the
    :class:`~megatron_hybrid.inference.GenerationConfig` (see :func:`generation_config`), or a function that
    returns it, called after the switch (:meth:`~.memory_policy.RolloutMemoryPolicy.sized`: the cache sized to
    what the switch left free). ``budget`` and ``resume``: the engine's (partial rollout: stop early, go on with
    unfinished results of an earlier call); the responses are then the resumed ones, then the prompts', finished or
    not (see ``Rollout.results``). ``driver``: instead of one generate call, ``driver(call)`` inside the one rollout
    phase, where ``call(prompts, seed, **kw)`` generates (an :class:`EngineCall`); it returns
    :class:`~.envs.Episodes` (``--env``: a call per turn), whose responses and log-probs the Rollout holds.
    ``request_stop_token_ids``: per prompt, its own stop tokens (a data row's ``stop_token_ids``)."""
    with phase("switch to rollout"):
        engine.switch_to_rollout(offload_optimizer=offload_optimizer, offload_grads=offload_grads)
    report = engine.communication_report()
    counters = engine.generation_report()
    start = time.perf_counter()
    try:
        if callable(config):
            config = config()
        call = EngineCall(engine, dict(sampling_params=sampling_params, vocab_size=vocab_size,
                                       stop_token_ids=stop_token_ids, tempered_log_probs=True, config=config))

        if driver is None:
            results, episodes = call(prompts, seed, budget=budget, resume=resume,
                                     request_stop_token_ids=request_stop_token_ids), None
        else:
            results, episodes = None, driver(call)
    finally:  # also after an error (bad input is refused on every rank alike): the caller gets its training layout
        generated = time.perf_counter()
        with phase("switch to training"):
            engine.switch_to_training()
    back = time.perf_counter() - generated
    after = engine.generation_report()
    # (A generator made anew in the call, for another config, counted from 0.)
    steps = tuple(after.get(k, 0) - counters.get(k, 0) if after.get(k, 0) >= counters.get(k, 0) else after[k]
                  for k in ("decode_steps", "busy_steps"))
    responses, log_probs = (episodes.responses, episodes.log_probs) if episodes is not None else \
        ([r.generated_tokens for r in results], [r.generated_tempered_log_probs for r in results])
    return Rollout(responses, log_probs, generation_seconds=generated - start,
                   switch_bytes=float(report["total_bytes"]), routed_experts=_routed_experts(results or []),
                   switch_seconds_each_way=(report["switch_seconds"], back),
                   offload_seconds_each_way=(report.get("phases", {}).get("offload_seconds", 0.0),
                                             getattr(engine, "last_reload_seconds", 0.0)),
                   offload_bytes=getattr(engine, "last_offload_bytes", 0), results=results, decode_steps=steps,
                   episodes=episodes)


def _routed_experts(results: list) -> Optional[list[torch.Tensor]]:
    """The results' routing records, or None when they have none (no ``record_routing``, a dense model)."""
    records = [r.routed_experts for r in results]
    return records if records and all(r is not None for r in records) else None


@recorded("generate")
def generate_in_training_layout(model: torch.nn.Module, prompts: list[list[int]], sampling_params, *,
                                rollout_layout: Any, vocab_size: int, stop_token_ids: Sequence[int],
                                seed: int, record_routing: bool = False,
                                request_stop_token_ids: Optional[Sequence[Sequence[int]]] = None) -> Rollout:
    """The rollout :func:`generate_on_engine` samples, generated by the training-layout model without
    resharding: the prompts are cut and seeded as the rollout replicas would (for rollout layouts that do not
    widen TP). ``model``: this rank's stage, plain or wrapped; on Megatron's training groups. A sequence-parallel
    model generates without sequence parallelism, as the engine's rollout model does. ``record_routing``: also
    each sequence's routing record (``GenerationConfig.record_routing``). ``request_stop_token_ids``: per prompt,
    its own stop tokens."""
    start = time.perf_counter()
    ddp_finish_param_sync(model)  # the stage is called unwrapped: DDP's hooks would not gather the last step's
    tp, pp, dp, _ = megatron_groups()
    lay = ParallelLayout.create(training=(tp.size(), pp.size(), dp.size()), rollout=rollout_layout)
    # An exchange layout's replicas need not lie in training replicas: one part per training replica then.
    parts = 1 if lay.widens or lay.exchange else lay.d_g
    results = []
    with sequence_parallel_off(model):
        for j, (lo, hi) in enumerate(split_evenly(len(prompts), parts)):
            replica = dp.rank() * parts + j  # the engine's rollout replica index; its seed offset is the engine's
            part = prompts[lo:hi]
            # generate_with_model's own one-call sizing, with the record asked for.
            config = None if not record_routing or not part else GenerationConfig(
                max_batch_size=min(64, len(part)), cuda_graphs=False, record_routing=True,
                max_sequence_length=max(2, max(len(p) for p in part) + sampling_params.num_tokens_to_generate))
            results += generate_with_model(unwrap_model(model), part, sampling_params, tp_group=tp,
                                           pp_group=pp, vocab_size=vocab_size, stop_token_ids=stop_token_ids,
                                           seed=replica_seed(seed, replica), tempered_log_probs=True, config=config,
                                           request_stop_token_ids=None if request_stop_token_ids is None
                                           else list(request_stop_token_ids)[lo:hi])
    return Rollout([r.generated_tokens for r in results], [r.generated_tempered_log_probs for r in results],
                   generation_seconds=time.perf_counter() - start, routed_experts=_routed_experts(results))
