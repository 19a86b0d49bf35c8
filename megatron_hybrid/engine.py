"""The HybridEngine: one copy of the actor's weights serves the training layout and the rollout layout.

A facade that sequences the pieces, each in a module of its own:

- layouts and the rank arithmetic: :mod:`megatron_hybrid.layout`; the rollout groups: :mod:`megatron_hybrid.groups`;
- the rollout model (built without weights): :mod:`megatron_hybrid.reshard.rollout_model`;
- the checks of the arguments and the model, before any collective: :mod:`megatron_hybrid.validation`;
- the reshard plan (which bytes move where): :mod:`megatron_hybrid.reshard.plan`, made and run by
  :mod:`megatron_hybrid.reshard.executor` (the gather of the members' parameter descriptions; one in-place collective
  per region at each switch); put together per plane with its placement: :mod:`megatron_hybrid.reshard.assembly`;
- where every tensor lives and which ranges are backed: :mod:`megatron_hybrid.reshard.placement`;
- binding the rollout parameters, one class per weight mode: :mod:`megatron_hybrid.reshard.binding` (FP8 rollout
  weights: :mod:`megatron_hybrid.quant.fp8`);
- host offload of optimizer states and gradients: :mod:`megatron_hybrid.memory`.

Where the bytes move: :class:`megatron_hybrid.reshard.executor.PlanExecutor`, which
:meth:`HybridEngine.switch_to_rollout` runs between mapping the peers' slots and binding the rollout model to them.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import time
import traceback
import weakref
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from .groups import RolloutGroups, create_rollout_groups
from .inference import RolloutGenerator
from .layout import ExpertLayout, Grid, ParallelLayout, RolloutLayout
from .megatron import compat
from .memory import HostOffload, ReservedBuffer, optimizer_tensors
from .modes import RolloutWeights, WeightMode, parse_mode
from .quant.fp8 import layers_in_bf16
from .reshard.assembly import place_exchange, place_planes
from .reshard.binding import BINDINGS, named_parameters
from .reshard.executor import CollectiveRecord
from .reshard.placement import EngineRolloutMemory
from .reshard.rollout_model import ModelProvider, build_rollout_chunks
from .validation import WEIGHT_MODES, as_timeout, check_arguments, check_experts, check_layout, check_model

__all__ = ["HybridEngine", "CollectiveRecord", "WEIGHT_MODES"]
DEFAULT_BUCKET_MB_GPU = 1024.0
DEFAULT_BUCKET_MB_CPU = 32.0  # see HybridEngine's bucket_size_mb
_TIED = ("output_layer.weight", "embedding.word_embeddings.weight")
# Which engine serves each training parameter. Two engines on one model would each move its parameters into their
# own buffers (the first then finds them moved at its next switch), so a second one is refused until the first is
# closed or gone. Keyed by parameter identity (a model may come plain, wrapped or as a list; weakref's own
# WeakKeyDictionary compares keys with ==, elementwise on tensors), values weak: a dropped engine frees its
# parameters. The mapping lives here, not on the parameters.
_SERVED_BY: WeakIdKeyDictionary = WeakIdKeyDictionary()
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _creation_site() -> str:
    """``file:line in function`` of the first caller outside this package (where the user made the engine)."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if not os.path.abspath(frame.filename).startswith(_PACKAGE_DIR + os.sep):
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "unknown"


def _serving_engine(params: list[torch.nn.Parameter]) -> Optional["HybridEngine"]:
    """The open engine that serves any of ``params``, or None."""
    def find() -> Optional[HybridEngine]:
        for prm in params:
            ref = _SERVED_BY.get(prm)
            engine = ref() if ref is not None else None
            if engine is not None and engine.mode != "closed":
                return engine
        return None

    if find() is None:
        return None
    # An engine dropped without close() lingers in reference cycles until the collector runs, which it does at
    # different times on different ranks: collect now, so that every rank decides on what is reachable.
    gc.collect()
    return find()


def _refuse_served(params: list[torch.nn.Parameter]) -> None:
    """``ValueError`` where an open engine serves any of ``params`` (local state, the same on every rank: decided
    before any collective)."""
    first = _serving_engine(params)
    if first is not None:
        raise ValueError(f"model is already served by a HybridEngine (id {id(first):#x}, created at "
                         f"{first.created_at}); a second engine would move its parameters away from the first's "
                         "buffers. close() the first engine, or keep using it")


def _serve(params: list[torch.nn.Parameter], engine: HybridEngine) -> None:
    for prm in params:
        _SERVED_BY[prm] = weakref.ref(engine)


def _stop_serving(params: Iterator[torch.nn.Parameter], engine: HybridEngine) -> None:
    """The parameters ``engine`` served are free for another engine."""
    for prm in params:
        ref = _SERVED_BY.get(prm)
        if ref is not None and ref() is engine:
            del _SERVED_BY[prm]


def _training_groups(tp_group: Any, pp_group: Any, dp_group: Any) -> tuple[Any, Any, Any, Optional[Any]]:
    """The training groups (tp, pp, dp) and the context-parallel group: those given, the rest Megatron's."""
    if tp_group is not None and pp_group is not None and dp_group is not None:
        return tp_group, pp_group, dp_group, None
    m_tp, m_pp, m_dp, cp_group = compat.megatron_groups()
    return tp_group or m_tp, pp_group or m_pp, dp_group or m_dp, cp_group


class HybridEngine:
    """Switch an actor between its Megatron training layout and a rollout layout without a second copy.

    Args:
        model: the training-layout model on this rank: a GPTModel, a list of model chunks, or Megatron DDP around
            one (also with ``use_distributed_optimizer=True``), after ``initialize_model_parallel(t, p)``. With the
            distributed optimizer, DDP's parameter buffer becomes this rank's own slot of the micro-DP gather,
            moved there once; the optimizer's all-gather after every step then writes into it directly. One engine
            per model: a second one on the same parameters is a ``ValueError`` until the first is closed (``close()``).
        rollout: the rollout layout (t_g, p_g).
        weight_mode: ``"aliased"`` (default; zero redundancy: the rollout model computes on the training shards
            as blocks) or ``"canonical"`` (the standard Megatron rollout layout, rebuilt from the gathered
            buffers into a range backed only while rolling out; the gathered peers' slots that nothing views are
            released once read, so generation runs with the own shard plus the rebuilt rollout shard).
        bucket_size_mb: the size of one gather bucket per dtype. Default: 1 GiB for a model on a GPU (on 2 H200s
            a 7B model switched in 1.23× the time of one raw all-gather with 1 GiB buckets, 1.38× with 256 MiB
            ones), 32 MiB on a CPU: gloo stages a CPU all-gather through a temporary of the whole output, and
            glibc serves a temporary above its mmap threshold (at most 32 MiB) with fresh pages that fault in at
            every switch, while smaller ones reuse the heap's pages (8 gloo ranks, few-large at (4,1,2)→(2,1):
            canonical 1.76 s with 24 MiB buckets, 2.04 s with 1 GiB ones, side by side).
        align_slots: pad every slot to the memory backend's granule (2 MiB with CUDA virtual memory). Then no
            page is shared between the own slot and a peer's, so nothing of the peers' stays resident while
            training; the padding travels with the gathers (at most one granule per slot). Without it, the
            switch moves exactly the missing bytes and up to two granules per bucket stay resident
            (``communication_report()["resident_peer_bytes"]``): use buckets much larger than a granule.
        tp_group, pp_group, dp_group: the training groups; default: Megatron's ``parallel_state``.
        timeout: the timeout of every collective the engine and its generator issue (a ``datetime.timedelta`` or
            seconds; all run on the engine's own groups, a world-sized one included); default: the training
            tensor-parallel group's, so that a stalled or dead rank fails the others within the same time in both
            layouts. A collective that times out raises :class:`~megatron_hybrid.groups.CollectiveError` naming
            the phase, the collective and this timeout.
        model_provider: ``model_provider(config, pg_collection, pre_process, post_process)`` building one
            rollout stage, for model classes other than GPTModel.
        optimizer: the megatron-core optimizer over ``model`` if it exists already (a ``DistributedOptimizer`` or a
            ``ChainedOptimizer`` of them): its shards view DDP's parameter buffer, and they move with it. Not needed
            when the optimizer is built after the engine, or without the distributed optimizer; a view left behind
            is a ``ValueError``.
        rollout_weights: ``"model"`` (default: the rollout model computes in the training dtype) or ``"fp8"``: every
            switch writes the dense layers' linear weights (QKV, attention output, fc1, fc2) as float8 e4m3 with one
            fp32 scale per output row, straight from the gathered shards into memory backed only while rolling out,
            and the rollout model multiplies in FP8 (activations quantized per token; :mod:`megatron_hybrid.quant.fp8`).
            The embedding, the output layer, norms, biases and MoE experts stay in the training dtype, and so do the
            first and last decoder layers that the model's ``TransformerConfig`` keeps in bf16 as Megatron's FP8
            training does (``first_last_layers_bf16``, ``num_layers_at_start_in_bf16``,
            ``num_layers_at_end_in_bf16``). Needs ``weight_mode="canonical"`` and, on a GPU, FP8 tensor cores
            (compute capability ≥ 8.9).
    """

    def __init__(self, model: Union[torch.nn.Module, Sequence[torch.nn.Module]], rollout: RolloutLayout, *,
                 weight_mode: Union[WeightMode, str] = WeightMode.ALIASED, bucket_size_mb: Optional[float] = None, align_slots: bool = False,
                 tp_group=None, pp_group=None, dp_group=None, timeout: Any = None,
                 model_provider: Optional[ModelProvider] = None, optimizer: Any = None,
                 rollout_weights: Union[RolloutWeights, str] = RolloutWeights.MODEL) -> None:
        # ---- validation: everything below this block may run collectives ----
        check_arguments(model, rollout, weight_mode=weight_mode, bucket_size_mb=bucket_size_mb,
                        align_slots=align_slots, timeout=timeout, rollout_weights=rollout_weights)
        weight_mode = parse_mode(WeightMode, weight_mode, "weight_mode")  # members from here on (str enums)
        rollout_weights = parse_mode(RolloutWeights, rollout_weights, "rollout_weights")
        self.chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self.modules = [compat.unwrap_model(c) for c in self.chunks]
        self.created_at = _creation_site()
        params = [p for m in self.modules for p in m.parameters()]
        _refuse_served(params)
        tp_group, pp_group, dp_group, cp_group = _training_groups(tp_group, pp_group, dp_group)
        self.tp_group, self.pp_group, self.dp_group = tp_group, pp_group, dp_group
        self.layout = lay = ParallelLayout.create(training=(tp_group.size(), pp_group.size(), dp_group.size()),
                                                  rollout=rollout)
        if len(self.chunks) > 1 and not lay.exchange:
            # Virtual pipeline chunks: the rollout model is one chunk per rank (a rollout stage's layers in one model,
            # which the generator runs), so its tensors come from several training chunks: an exchange layout.
            self.layout = lay = dataclasses.replace(lay, exchange=True)
        check_layout(lay, world_size=dist.get_world_size(), num_chunks=len(self.chunks))
        self.config = self.modules[0].config
        check_model(self.modules, lay, weight_mode=weight_mode, rollout_weights=rollout_weights)
        # An MoE model's routed experts: their own grid (expert tp, ep, expert dp) and rollout sizes.
        expert_groups = compat.megatron_expert_groups() if self.config.num_moe_experts is not None else None
        self.expert_layout: Optional[ExpertLayout] = check_experts(
            self.modules, lay, rollout, expert_groups=expert_groups, world_size=dist.get_world_size())
        if timeout is None:
            timeout = compat.group_timeout(tp_group) or dist.distributed_c10d.default_pg_timeout
        self.timeout = as_timeout(timeout)
        self.weight_mode = weight_mode
        self.rollout_weights = rollout_weights
        self.bucket_size_mb = bucket_size_mb if bucket_size_mb is not None else (
            DEFAULT_BUCKET_MB_GPU if next(self.modules[0].parameters()).is_cuda else DEFAULT_BUCKET_MB_CPU)
        self.align_slots = align_slots
        self.tp_rank, self.pp_rank = dist.get_rank(tp_group), dist.get_rank(pp_group)
        self.dp_rank = dist.get_rank(dp_group)
        tied = bool(getattr(self.modules[-1], "share_embeddings_and_output_weights", False))
        # p_g = 1 < p with tied embeddings: the last stage's output layer is the rollout embedding (no transfer).
        self._tied = _TIED if tied and lay.p_g == 1 < lay.p and not lay.widens else None

        # ---- collectives from here on ----
        self.rollout_groups: RolloutGroups = create_rollout_groups(
            lay, tp_group, pp_group, dp_group, timeout=self.timeout, cp_group=cp_group,
            tied_embedding=self._tied is not None,
            experts=(self.expert_layout, expert_groups) if self.expert_layout is not None else None,
            num_layers=self.config.num_layers, chunks=len(self.chunks))
        self.layout = lay = self.rollout_groups.layout  # exchanged where new_group could not keep the groups' order
        if lay.exchange:
            self._tied = None
        self.rollout_chunks = build_rollout_chunks(self.modules, lay, pg_collection=self.pg_collection,
                                                   rollout_pp_rank=self.rollout_pp_rank, weight_mode=weight_mode,
                                                   guard=self._check_rollout_mode, model_provider=model_provider,
                                                   experts=self.expert_layout, rollout_weights=rollout_weights)
        self._train_params = dict(named_parameters(self.modules))
        self.device = next(iter(self._train_params.values())).device
        self._optimizers = [optimizer] if optimizer is not None else []  # close() may add one: read at the move
        experts = dict(expert_layout=self.expert_layout, expert_groups=expert_groups)
        if lay.exchange:
            reshard = place_exchange(self.modules, self.rollout_chunks, self.rollout_groups, device=self.device,
                                     training_params=self._train_params, tp_rank=self.tp_rank, tied=tied, **experts)
            self.exchange_plan = reshard.exchange_plan
        else:
            reshard = place_planes(
                self.modules, self.rollout_chunks, self.rollout_groups, chunks=self.chunks, optimizers=self._optimizers,
                training_params=self._train_params, device=self.device, tp_rank=self.tp_rank, pp_rank=self.pp_rank,
                num_layers=self.config.num_layers, bucket_size_mb=self.bucket_size_mb, align_slots=self.align_slots,
                tied=self._tied, strided=weight_mode == WeightMode.CANONICAL, **experts)
        self.placement, self.plans = reshard.placement, reshard.plans
        self._executors: list[Any] = reshard.executors  # the switch's collectives, plane by plane
        self.plan, self.member_index = self.plans["dense"]
        self.fp8_layers_in_bf16 = layers_in_bf16(self.config) if rollout_weights == RolloutWeights.FP8 else (0, 0)
        self.binding = BINDINGS[weight_mode](self.rollout_chunks, self.placement, rollout_weights=rollout_weights,
                                             fp8_layers=self.fp8_layers)
        self.mode = "training"
        self._fingerprint: Optional[int] = None
        self._offload: Optional[HostOffload] = None
        self._generator: Any = None  # the RolloutGenerator, made at the first generate()
        self.num_switches = 0  # switches to rollout that ran (a call while rolling out is not one)
        self._train_ptrs = [p.data_ptr() for p in self._train_params.values()]
        self._last_report: dict[str, Any] = {"total_bytes": 0, "num_collectives": 0, "collectives": []}
        # Off by default: per-collective timing synchronises the device after every collective.
        self.profiling = False
        _serve(params, self)

    # ---- the rollout groups: where this rank sits in the rollout layout -------------------------------------
    # Read from ``self.rollout_groups`` (:class:`~megatron_hybrid.groups.RolloutGroups`), the one owner.
    @property
    def grid(self) -> Grid:
        """Where every training coordinate lives."""
        return self.rollout_groups.grid

    @property
    def groups(self) -> dict[str, Any]:
        """This rank's rollout group of each kind (``"tp"``, ``"pp"``, ``"dp"``, ``"micro_dp"``, ...)."""
        return self.rollout_groups.groups

    @property
    def group_ranks(self) -> dict[str, list[int]]:
        """The global ranks of each of :attr:`groups`, in group-rank order."""
        return self.rollout_groups.ranks

    @property
    def pg_collection(self) -> Any:
        """megatron-core's ``ProcessGroupCollection`` of the rollout model."""
        return self.rollout_groups.pg_collection

    @property
    def rollout_tp_rank(self) -> int:
        return self.rollout_groups.tp_rank

    @property
    def rollout_pp_rank(self) -> int:
        return self.rollout_groups.pp_rank

    @property
    def rollout_replica(self) -> int:
        """The rollout data-parallel replica of this rank."""
        return self.rollout_groups.replica

    def _check_rollout_mode(self) -> None:
        if self.mode == "closed":
            raise RuntimeError("the rollout model of a closed HybridEngine has no weights")
        if self.mode != "rollout":
            raise RuntimeError("the rollout model was used in training mode: call engine.switch_to_rollout() "
                               "first (its weights are not there while training)")

    # ---- switching -----------------------------------------------------------------------------------------
    @property
    def rollout_model(self) -> Union[torch.nn.Module, list[torch.nn.Module]]:
        """The megatron-core model of the rollout layout (a list when the training model was a list)."""
        return self.rollout_chunks if len(self.chunks) > 1 else self.rollout_chunks[0]

    @property
    def fp8_layers(self) -> range:
        """The decoder layers (numbered model-wide) whose rollout weights are FP8 under ``rollout_weights="fp8"``:
        all but the :func:`~megatron_hybrid.quant.fp8.layers_in_bf16` ones at either end."""
        first, last = self.fp8_layers_in_bf16
        return range(first, self.config.num_layers - last)

    def _fingerprint_now(self) -> int:
        return sum(p._version for p in self._train_params.values())

    @functools.cached_property
    def rollout_memory(self) -> EngineRolloutMemory:
        """This engine's rollout-memory provider (what its generator's KV cache, sampling noise and CUDA-graph pool
        reserve from): reservations backed from every :meth:`switch_to_rollout` to :meth:`switch_to_training`;
        entering its ``backed()`` for a generate call switches to rollout."""
        return EngineRolloutMemory(self.placement, self.switch_to_rollout)

    def reserve_rollout_memory(self, numel: int, dtype: torch.dtype) -> ReservedBuffer:
        """A range of ``numel`` elements at a fixed address, backed only while rolling out (a KV cache, say):
        mapped by every :meth:`switch_to_rollout`, given back by :meth:`switch_to_training`."""
        if isinstance(numel, bool) or not isinstance(numel, int) or numel <= 0:
            raise ValueError(f"numel ({numel!r}) must be a positive integer")
        if self.mode == "closed":
            raise RuntimeError("the engine was closed")
        return self.rollout_memory.reserve(numel, dtype).memory

    def switch_to_rollout(self, *, offload_optimizer: Any = None, offload_grads: bool = False) -> None:
        """Gather the missing shards and bind the rollout model to them. No-op when already rolling out.

        ``offload_optimizer`` (a torch or megatron-core optimizer, ``ChainedOptimizer`` included: states and fp32
        main parameters) and ``offload_grads`` move those tensors to host memory (pinned on GPU) until
        :meth:`switch_to_training` brings them back, bit for bit.
        """
        if self.mode == "rollout":
            if self._fingerprint_now() != self._fingerprint:
                raise RuntimeError("the training weights changed while in rollout mode; call "
                                   "switch_to_training() before training")
            return  # not a switch: the report keeps describing the last one
        if self.mode == "closed":
            raise RuntimeError("the engine was closed")
        for chunk in self.chunks:  # the distributed optimizer's last all-gather may still be pending (overlap)
            compat.ddp_finish_param_sync(chunk)
        _check_storage(self._train_params, self._train_ptrs)
        # Bad input fails before the collectives.
        to_offload = _offload_targets(self.chunks, offload_optimizer, offload_grads, keep=self._train_params)
        start = time.perf_counter()
        self.placement.map_rollout()  # every piece first: one access update per contiguous span
        t_map = time.perf_counter()
        records: list[CollectiveRecord] = []
        for executor in self._executors:
            placement = self.placement.planes[executor.plane]
            buffers = {dtype: buf.tensor for dtype, buf in placement.buffers.items()}
            records += executor.run(buffers, profile=self.profiling)
        t_coll = time.perf_counter()
        self.binding.refill()
        t_canon = time.perf_counter()
        self._offload = HostOffload(to_offload)
        self.last_offload_bytes = self._offload.device_bytes  # what left the device (0 on the CPU)
        t_off = time.perf_counter()
        self._synchronize()
        peak = self.placement.rollout_bytes_mapped()  # before the ranges only the rebuild read are given back
        self.placement.release_transient()
        end = time.perf_counter()
        self.mode = "rollout"
        self.num_switches += 1
        self._fingerprint = self._fingerprint_now()
        phases = {"map_seconds": t_map - start, "collectives_seconds": t_coll - t_map,
                  "canonical_seconds": t_canon - t_coll, "offload_seconds": t_off - t_canon,
                  "sync_seconds": end - t_off}
        self._last_report = _switch_report(self, records, end - start, phases) | {"switch_peak_bytes_mapped": peak}

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def switch_to_training(self) -> None:
        """Release the peers' slots and the rollout-only memory; the training shards never moved.

        The rollout model keeps its bindings (fixed addresses), but its weights are not there until the next
        :meth:`switch_to_rollout`: its forward and ``state_dict`` refuse to run while training.
        """
        if self.mode != "rollout":
            return
        self._synchronize()  # once: nothing queued may touch the ranges unmapped below
        self.binding.fp8.drop_operands()  # CPU FP8 linears' fp32 operands: rollout-only, like the ranges below
        self.placement.unmap_rollout()
        self.last_reload_seconds = 0.0
        if self._offload is not None:
            start = time.perf_counter()
            self._offload.reload()
            self._offload = None
            self._synchronize()
            self.last_reload_seconds = time.perf_counter() - start
        self.mode = "training"

    @contextmanager
    def rollout(self) -> Iterator[torch.nn.Module]:
        """``with engine.rollout() as model:`` switch to rollout, and back to training on exit."""
        self.switch_to_rollout()
        try:
            yield self.rollout_model
        finally:
            self.switch_to_training()

    def close(self, *, optimizer: Any = None) -> None:
        """Detach the engine from the model: training parameters get ordinary memory again (one copy), the
        rollout model loses its weights, and every buffer is released. The engine cannot switch afterwards.

        Needed only to drop the engine while keeping the model: otherwise the buffers live as long as the
        parameters that view them. ``optimizer``: a distributed optimizer built after the engine (its shards view
        DDP's parameter buffer, which moves back to ordinary memory).
        """
        if self.mode == "closed":
            return
        self.switch_to_training()
        if self._generator is not None:
            self._generator.close()
            self._generator = None
        if optimizer is not None:
            self._optimizers.append(optimizer)
        self.placement.detach_training_tensors()
        self.binding.unbind()
        self.placement.close()
        self.mode = "closed"
        _stop_serving((p for m in self.modules for p in m.parameters()), self)

    # ---- generation ----------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling_params, *, vocab_size: Optional[int] = None,
                 stop_token_ids: Sequence[int] = (), seed: int = 0, config: Any = None,
                 tempered_log_probs: bool = False, budget: Any = None, resume: Sequence[Any] = (),
                 keep: bool = False, continued: Sequence[Any] = (), turns: Any = None, request_stop_token_ids=None
                 ) -> list:
        """Generate for this training rank's prompts on the rollout layout; results in prompt order.

        Called on every rank of the training layout (the generator switches to rollout first if needed, through
        :attr:`rollout_memory`). A thin call into
        :class:`megatron_hybrid.inference.RolloutGenerator` (KV cache at fixed addresses backed only while rolling
        out, continuous batching, on-device sampling, CUDA graphs kept across switches), made at the first call
        and kept; ``config`` (a :class:`~megatron_hybrid.inference.GenerationConfig`) replaces it with one of
        those settings. The micro-DP data flow: a training DP replica's prompts are split across its d_g rollout
        replicas and the results all-gathered back. ``vocab_size``: the real vocabulary, whose padded rows are
        never sampled. Returns ``GenerationResult``s with ``.generated_tokens`` and ``.generated_log_probs``
        (untempered, over the real vocabulary), and with ``tempered_log_probs`` also
        ``.generated_tempered_log_probs`` (at the sampling temperature, before top-k/top-p). ``budget``
        (:class:`~megatron_hybrid.inference.Budget`): stop early, the unfinished sequences returned with their tokens
        so far (``finished`` False); every token carries :attr:`num_switches` (``weight_versions``). ``resume``:
        such unfinished results, generated on after a re-prefill with the current weights (returned first).
        ``keep``, ``continued``, ``turns``: multi-turn (the generator's); ``request_stop_token_ids``: per prompt.
        """
        if self.mode == "closed":
            raise RuntimeError("the engine was closed")
        if self._generator is None or (config is not None and config != self._generator.config):
            if self._generator is not None:
                self._generator.close()
            self._generator = RolloutGenerator(self, config)
        return self._generator.generate(prompts, sampling_params, vocab_size=vocab_size, stop_token_ids=stop_token_ids,
                                        seed=seed, tempered_log_probs=tempered_log_probs, budget=budget, resume=resume,
                                        keep=keep, continued=continued, turns=turns,
                                        request_stop_token_ids=request_stop_token_ids)

    def release_kept(self, kept: Sequence[Any]) -> None:
        """Free the KV-cache slots of kept prefixes (``generate(keep=True)``'s ``result.kept``) no later call will
        continue; nothing where no generator was made."""
        if self._generator is not None:
            self._generator.release(kept)

    def generation_report(self) -> dict[str, Any]:
        """The generator's counters since it was made (decode steps, busy ones, CUDA graphs, KV cache: see
        ``ReplicaGenerator.report``); empty before the first :meth:`generate`."""
        return {} if self._generator is None else self._generator.report()

    # ---- reporting (a switch's: _switch_report) -------------------------------------------------------------
    def communication_report(self) -> dict[str, Any]:
        """What the last switch to rollout moved: ``total_bytes`` is what this rank received; ``generation``:
        the generator's counters (CUDA graph captures and replays, decode steps, KV-cache bytes), once it exists.

        The memory keys describe now (all ``*_bytes_mapped`` are 0 while training): ``peer_bytes_mapped`` (peers'
        slots the rollout model views), ``canonical_bytes_mapped`` (rebuilt training-dtype tensors),
        ``fp8_bytes_mapped`` (FP8 rollout weights and their scales), ``rollout_memory_bytes_mapped`` (KV cache and
        other reservations of the generator); ``switch_peak_bytes_mapped``: the most of all those the last switch
        had backed at once (after the rebuild, before the peers' slots only it read were given back)."""
        report = dict(self._last_report)
        if self.mode != "closed":
            report.update(self.placement.report())
        if self._generator is not None:
            report["generation"] = self._generator.report()
        return report

    def set_profiling(self, enabled: bool) -> None:
        """Time each collective separately (synchronising after each) or only the whole switch (default).

        Without profiling, a GPU collective's ``seconds`` in the report is its launch time only; on CPU/gloo
        collectives are synchronous either way.
        """
        self.profiling = bool(enabled)


def _check_storage(params: dict[str, torch.nn.Parameter], pointers: list[int]) -> None:
    """The training parameters are where the rollout model was bound (``pointers``: in place updates only)."""
    if [p.data_ptr() for p in params.values()] != pointers:
        moved = [n for (n, p), ptr in zip(params.items(), pointers) if p.data_ptr() != ptr]
        raise RuntimeError(f"training parameters {moved[:3]} were given new storage (param.data = ...) after "
                           "the HybridEngine was built; the rollout model is bound to the old storage. Copy new "
                           "values in place (param.data.copy_(...)) instead")


def _offload_targets(chunks: list[torch.nn.Module], optimizer: Any, grads: bool, *,
                     keep: dict[str, torch.nn.Parameter]) -> list[torch.Tensor]:
    """What a switch to rollout moves to the host: ``optimizer``'s states and main parameters (not the training
    parameters, ``keep``), and with ``grads`` the gradients of ``chunks``."""
    out: list[torch.Tensor] = []
    if optimizer is not None:
        out.extend(optimizer_tensors(optimizer, keep=list(keep.values())))
    if grads:
        for c in chunks:
            buffers = compat.ddp_grad_buffers(c)  # Megatron DDP: one contiguous grad buffer per dtype
            out.extend(buffers if buffers is not None else (p.grad for p in c.parameters() if p.grad is not None))
    return out


def _switch_report(engine: HybridEngine, records: list[CollectiveRecord], seconds: float,
                   phases: dict[str, float]) -> dict[str, Any]:
    """What :meth:`HybridEngine.communication_report` tells of the switch that ran ``records`` in ``seconds``."""
    return {
        "total_bytes": sum(r.bytes_received for r in records),
        # An MoE model's routed experts: received over the micro-EP groups (part of total_bytes).
        "expert_bytes": sum(r.bytes_received for r in records if r.plane == "experts"),
        "num_collectives": len(records),
        "switch_seconds": seconds,
        # Where the switch's time went. Without profiling, GPU phases are launch times and the device is
        # synchronised once at the end: the wait for the queued collectives and copies is sync_seconds.
        "phases": dict(phases),
        "collectives": [dataclasses.asdict(r) | {"gbps": (r.bytes_received / r.seconds / 1e9) if r.seconds
                                                 else 0.0} for r in records],
        "groups": {k: v for k, v in engine.group_ranks.items() if k != "single"},
        **engine.placement.report(),
        "weight_mode": engine.weight_mode,
        "rollout_weights": engine.rollout_weights,
        "fp8_layers_in_bf16": list(engine.fp8_layers_in_bf16),
        "layout": dataclasses.asdict(engine.layout),
        **({"expert_layout": dataclasses.asdict(engine.expert_layout)} if engine.expert_layout is not None else {}),
    }
