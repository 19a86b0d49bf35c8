"""The HybridEngine: one copy of the actor's weights serves the training layout and the rollout layout.

Where the bytes move: :meth:`HybridEngine.switch_to_rollout` (one in-place collective per region of the plan).
Where the rollout groups come from: :meth:`HybridEngine._create_groups` (all ranks, once, next to Megatron's).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from . import compat
from .aliased import Blocks, make_aliased, placeholder, supports_blocks
from .buffers import RolloutBuffer
from .layout import Grid, ParallelLayout, RolloutLayout
from .plan import MemberInfo, ParamInfo, build_group_plan
from .sharding import TPSpec, global_name, layer_offset

WEIGHT_MODES = ("aliased", "canonical")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}

ModelProvider = Callable[..., torch.nn.Module]


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside Megatron's DDP / Float16Module wrappers."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def _owner_modules(module: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """id(parameter) -> the module that registered it."""
    out = {}
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                out[id(p)] = m
    return out


@contextmanager
def _weightless_parameters() -> Iterator[None]:
    """Build modules whose parameters own no memory: every registered parameter becomes a placeholder.

    Keeps the rollout model's construction from allocating a second copy of the weights (each parameter's
    temporary allocation is dropped as soon as it is registered).
    """
    def hook(module, name, param):
        if param is None or getattr(param, "_mh_blocks", 0) != 0:
            return None
        return placeholder(param, None)

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@dataclasses.dataclass
class CollectiveRecord:
    """One collective of a switch, as the communication report and the trace show it."""

    op: str
    group_ranks: list[int]
    bytes_received: int
    seconds: float
    start: float  # time.time() at the start
    end: float
    rank: int


def _offload(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Copy each tensor to host memory and release its storage in place (views and pointers held elsewhere
    stay valid objects; their memory comes back in :func:`_reload`)."""
    out = []
    for t in tensors:
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
        host.copy_(t, non_blocking=t.is_cuda)
        out.append((t, host, t.untyped_storage().nbytes()))
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()
    for t, _, _ in out:
        if t.untyped_storage().resizable():
            t.untyped_storage().resize_(0)  # keeps the storage object: views of it (DDP's main_grad) stay views
        else:  # e.g. tensors from torch.load(weights_only=True): swap the data behind the same tensor object
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return out


def _reload(offloaded: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    for t, host, nbytes in offloaded:
        if t.numel() == 0 and host.numel() > 0:
            t.data = host.to(t.device, non_blocking=t.is_cuda)
            continue
        t.untyped_storage().resize_(nbytes)
        t.copy_(host, non_blocking=t.is_cuda)


class HybridEngine:
    """Switch an actor between its Megatron training layout and a rollout layout without a second copy.

    Args:
        model: the training-layout model on this rank: a GPTModel, a list of model chunks, or a Megatron-DDP
            wrapped model (without the distributed optimizer), after ``initialize_model_parallel(t, p)``.
        rollout: the rollout layout (t_g, p_g).
        weight_mode: ``"aliased"`` (default; zero redundancy: the rollout model computes on the training shards
            as blocks) or ``"canonical"`` (the standard Megatron rollout layout, rebuilt from the gathered
            buffers into a range backed only while rolling out; the gathered peers' slots that nothing views are
            released once read, so generation runs with the own shard plus the rebuilt rollout shard).
        bucket_size_mb: the size of one gather bucket (default 1 GiB: on 2 H200s a 7B model switched in 1.23× the
            time of one raw all-gather with 1 GiB buckets, 1.38× with 256 MiB ones).
        align_slots: pad every slot to the memory backend's granule (2 MiB with CUDA virtual memory). Then no
            page is shared between the own slot and a peer's, so nothing of the peers' stays resident while
            training; the padding travels with the gathers (at most one granule per slot). Without it, the
            switch moves exactly the missing bytes and up to two granules per bucket stay resident
            (``communication_report()["resident_peer_bytes"]``): use buckets much larger than a granule.
        tp_group, pp_group, dp_group: the training groups; default: Megatron's ``parallel_state``.
        model_provider: ``model_provider(config, pg_collection, pre_process, post_process)`` building one
            rollout stage, for model classes other than GPTModel.
    """

    def __init__(self, model: Union[torch.nn.Module, Sequence[torch.nn.Module]], rollout: RolloutLayout, *,
                 weight_mode: str = "aliased", bucket_size_mb: float = 1024.0, align_slots: bool = False,
                 tp_group=None, pp_group=None,
                 dp_group=None, model_provider: Optional[ModelProvider] = None) -> None:
        # ---- validation: everything below this block may run collectives ----
        if weight_mode not in WEIGHT_MODES:
            raise ValueError(f"weight_mode ({weight_mode!r}) must be one of {WEIGHT_MODES}")
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb ({bucket_size_mb}) must be positive")
        if not isinstance(rollout, RolloutLayout):
            raise ValueError(f"rollout ({rollout!r}) must be a RolloutLayout")
        self.chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if not self.chunks:
            raise ValueError("model is an empty list of model chunks")
        for c in self.chunks:
            ddp_buffers = getattr(c, "buffers", None)  # Megatron DDP's param-and-grad buffers (a list)
            for buf in ddp_buffers if isinstance(ddp_buffers, list) else []:
                if getattr(buf, "param_data", None) is not None:
                    raise ValueError("Megatron DDP with use_distributed_optimizer=True keeps parameters in its "
                                     "own buckets; the HybridEngine supports DDP without the distributed "
                                     "optimizer for now")
        self.modules = [_unwrap(c) for c in self.chunks]
        if tp_group is None or pp_group is None or dp_group is None:
            m_tp, m_pp, m_dp, self._cp_group = compat.megatron_groups()
            tp_group, pp_group, dp_group = tp_group or m_tp, pp_group or m_pp, dp_group or m_dp
        else:
            self._cp_group = None
        self.tp_group, self.pp_group, self.dp_group = tp_group, pp_group, dp_group
        t, p, d = tp_group.size(), pp_group.size(), dp_group.size()
        self.layout = ParallelLayout.create(training=(t, p, d), rollout=rollout)
        if t * p * d != dist.get_world_size():
            raise ValueError(f"tensor ({t}) × pipeline ({p}) × data ({d}) parallel sizes must cover the world "
                             f"({dist.get_world_size()} ranks); context/expert parallelism is not supported yet")
        if self.layout.q > 1 and len(self.chunks) > 1:
            raise ValueError(f"rollout pipeline_model_parallel_size ({rollout.pipeline_model_parallel_size}) < "
                             f"pipeline_model_parallel_size ({p}) is not supported with virtual pipeline chunks")
        self.config = self.modules[0].config
        self._check_model(self.config)
        self.weight_mode = weight_mode
        self.bucket_size_mb = bucket_size_mb
        self.align_slots = align_slots
        self.model_provider = model_provider
        self.tp_rank, self.pp_rank = dist.get_rank(tp_group), dist.get_rank(pp_group)
        self.dp_rank = dist.get_rank(dp_group)
        needs_blocks = self.layout.k > 1 or self.layout.widens
        if weight_mode == "aliased" and needs_blocks:
            for mod in self.modules:
                owners = _owner_modules(mod)
                for name, prm in mod.named_parameters():
                    if TPSpec.of(prm).sharded and prm.dim() > 1 and not supports_blocks(owners[id(prm)]):
                        raise ValueError(f"weight_mode='aliased' cannot run {name} ({type(owners[id(prm)]).__name__}"
                                         ") on blocks; use weight_mode='canonical' for this model")

        # ---- collectives from here on ----
        self._create_groups()
        self.rollout_chunks = self._build_rollout_model()
        self._plan_and_place()
        self.mode = "training"
        self._fingerprint: Optional[int] = None
        self._offloaded: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self.num_switches = 0  # switches to rollout that ran (a call while rolling out is not one)
        self._bind_once()
        self._train_ptrs = [p.data_ptr() for p in self._train_params.values()]
        self._last_report: dict[str, Any] = {"total_bytes": 0, "num_collectives": 0, "collectives": []}
        # Off by default: per-collective timing synchronises the device after every collective.
        self.profiling = False

    # ------------------------------------------------------------------------------------------------------
    def _check_model(self, config) -> None:
        lay = self.layout
        heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
        if heads % lay.t_g:
            raise ValueError(f"rollout tensor_model_parallel_size ({lay.t_g}) must divide num_attention_heads "
                             f"({heads})")
        if config.ffn_hidden_size % lay.t_g:
            raise ValueError(f"rollout tensor_model_parallel_size ({lay.t_g}) must divide ffn_hidden_size "
                             f"({config.ffn_hidden_size})")
        if lay.widens and groups % lay.t_g:
            raise ValueError(f"rollout tensor_model_parallel_size ({lay.t_g}) must divide num_query_groups "
                             f"({groups}) when it is larger than tensor_model_parallel_size ({lay.t})")
        if config.num_layers % lay.p_g:
            raise ValueError(f"rollout pipeline_model_parallel_size ({lay.p_g}) must divide num_layers "
                             f"({config.num_layers})")
        if config.tensor_model_parallel_size != lay.t or config.pipeline_model_parallel_size != lay.p:
            raise ValueError(f"the model was built for tensor/pipeline sizes ({config.tensor_model_parallel_size}, "
                             f"{config.pipeline_model_parallel_size}) but the groups are ({lay.t}, {lay.p})")
        if getattr(config, "sequence_parallel", False):
            raise ValueError("sequence_parallel=True is not supported by the rollout layout yet")
        vocab = getattr(self.modules[0], "vocab_size", None)
        if vocab is not None and vocab % lay.t_g:
            raise ValueError(f"rollout tensor_model_parallel_size ({lay.t_g}) must divide the padded vocabulary "
                             f"({vocab})")

    def _create_groups(self) -> None:
        """Create every rollout group on every rank (torch needs all ranks in every new_group call)."""
        coords = [None] * dist.get_world_size()
        dist.all_gather_object(coords, (self.tp_rank, self.pp_rank, self.dp_rank))
        self.grid = Grid.from_coords({r: tuple(c) for r, c in enumerate(coords)})
        me = dist.get_rank()
        lay = self.layout
        self.group_ranks: dict[str, list[int]] = {}
        self.groups: dict[str, Any] = {}
        for name, lists in (("tp", lay.rollout_tp_groups(self.grid)), ("pp", lay.rollout_pp_groups(self.grid)),
                            ("dp", lay.rollout_dp_groups(self.grid)), ("micro_dp", lay.micro_dp_groups(self.grid)),
                            ("cross_stage", lay.cross_stage_groups(self.grid)),
                            ("single", [[r] for r in range(dist.get_world_size())] if self._cp_group is None else [])):
            for ranks in lists:
                g = dist.new_group(ranks)
                if me in ranks:
                    self.groups[name], self.group_ranks[name] = g, ranks
        from megatron.core.process_groups_config import ProcessGroupCollection

        pgc = ProcessGroupCollection()
        pgc.tp, pgc.pp, pgc.dp = self.groups["tp"], self.groups["pp"], self.groups["dp"]
        pgc.cp = self._cp_group if self._cp_group is not None else self.groups["single"]
        pgc.tp_cp = pgc.tp
        pgc.dp_cp = pgc.dp
        pgc.embd = None
        pgc.pos_embd = None
        self.pg_collection = pgc
        i, s, dp = self.tp_rank, self.pp_rank, self.dp_rank
        self.rollout_tp_rank, self.rollout_pp_rank, self.rollout_replica = lay.rollout_coords((i, s, dp))
        # Which rollout TP shard each member of this rank's rollout TP group serves, in group-rank order. torch
        # orders group ranks by global rank; with t_g > t the shard a rank can serve without communication is
        # fixed by its training shard, so the two orders differ and vocabulary-parallel outputs must be gathered
        # with this order (forward.gather_vocab(order=...)). For t_g <= t it is the identity.
        coord_of = dict(self.grid.coords())
        self.rollout_tp_order = [lay.rollout_coords(coord_of[r])[0] for r in self.group_ranks["tp"]]

    def _build_rollout_model(self) -> list[torch.nn.Module]:
        lay = self.layout
        config = copy.copy(self.config)
        config.tensor_model_parallel_size = lay.t_g
        config.pipeline_model_parallel_size = lay.p_g
        config.perform_initialization = False
        chunks = []
        for vp, train in enumerate(self.modules):
            vp_stage = vp if len(self.modules) > 1 else None
            # With virtual pipeline chunks, only the first chunk of the first stage embeds and only the last
            # chunk of the last stage has the output layer.
            pre = self.rollout_pp_rank == 0 and vp == 0
            post = self.rollout_pp_rank == lay.p_g - 1 and vp == len(self.modules) - 1
            with _weightless_parameters():
                if self.model_provider is not None:
                    chunk = self.model_provider(config=config, pg_collection=self.pg_collection, pre_process=pre,
                                                post_process=post)
                else:
                    chunk = self._rebuild_gpt(train, config, pre, post, vp_stage)
            chunk.eval()
            if self.weight_mode == "aliased":
                for mod in chunk.modules():
                    if supports_blocks(mod):
                        make_aliased(mod)
            # Non-parameter state (rotary frequencies) is replicated: take it from the training model.
            train_buffers = dict(train.named_buffers())
            for name, buf in chunk.named_buffers():
                src = train_buffers.get(name)
                if src is not None and src.shape == buf.shape:
                    buf.copy_(src)
            chunk.register_forward_pre_hook(self._check_rollout_mode)
            chunk.register_state_dict_pre_hook(lambda module, prefix, keep_vars: self._check_rollout_mode(module, ()))
            for mod in chunk.modules():
                if hasattr(mod, "vocab_start_index") and hasattr(mod, "num_embeddings_per_partition"):
                    n = mod.num_embeddings_per_partition
                    mod.vocab_start_index = self.rollout_tp_rank * n
                    mod.vocab_end_index = mod.vocab_start_index + n
            chunks.append(chunk)
        return chunks

    def _rebuild_gpt(self, train: torch.nn.Module, config, pre: bool, post: bool, vp_stage):
        from megatron.core.models.gpt import GPTModel

        if not isinstance(train, GPTModel):
            raise ValueError(f"model is a {type(train).__name__}; pass model_provider= to build its rollout stage")
        kwargs = dict(config=config, transformer_layer_spec=train.transformer_layer_spec,
                      vocab_size=train.vocab_size, max_sequence_length=train.max_sequence_length,
                      pre_process=pre, post_process=post, fp16_lm_cross_entropy=train.fp16_lm_cross_entropy,
                      parallel_output=train.parallel_output,
                      share_embeddings_and_output_weights=train.share_embeddings_and_output_weights,
                      position_embedding_type=train.position_embedding_type, rotary_percent=train.rotary_percent,
                      rotary_base=train.rotary_base, rope_scaling=train.rotary_scaling,
                      pg_collection=self.pg_collection)
        if vp_stage is not None:
            kwargs["vp_stage"] = vp_stage
        return compat.build_gpt_model(**kwargs)

    def _check_rollout_mode(self, module, args) -> None:
        if self.mode == "closed":
            raise RuntimeError("the rollout model of a closed HybridEngine has no weights")
        if self.mode != "rollout":
            raise RuntimeError("the rollout model was used in training mode: call engine.switch_to_rollout() "
                               "first (its weights are not there while training)")

    # ------------------------------------------------------------------------------------------------------
    def _param_infos(self, chunks: list[torch.nn.Module]) -> list[tuple[ParamInfo, torch.Tensor]]:
        out = []
        for chunk in chunks:
            offset = layer_offset(chunk)
            for name, prm in chunk.named_parameters():
                spec = TPSpec.of(prm)
                out.append((ParamInfo(global_name(name, offset), name, tuple(prm.shape), _DTYPE_NAMES[prm.dtype],
                                      spec.sharded, spec.dim, spec.stride), prm))
        return out

    def _plan_and_place(self) -> None:
        lay = self.layout
        mine = self._param_infos(self.modules)
        names = [info.name for info, _ in mine]
        if len(set(names)) != len(names):
            raise ValueError("duplicate parameter names across model chunks")
        self._train_params = {info.name: prm for info, prm in mine}
        rollout_infos = self._param_infos(self.rollout_chunks)
        self._rollout_params = {info.name: prm for info, prm in rollout_infos}
        layers_per_stage = self.config.num_layers // lay.p
        member = MemberInfo(dist.get_rank(), self.tp_rank, self.pp_rank, tuple(i for i, _ in mine), layers_per_stage)
        group = self.groups["micro_dp"]
        members: list[Any] = [None] * group.size()
        if lay.widens:
            members = [member]
        else:
            dist.all_gather_object(members, member, group=group)
        members.sort(key=lambda m: m.rank)
        # The rollout model was built without initialisation, so Megatron never set its tensor-parallel
        # attributes: they are layout-invariant, so take them from the training tensor of the same name.
        info_by_name = {p.name: p for m in members for p in m.params}
        for name, prm in self._rollout_params.items():
            if name not in info_by_name:
                raise ValueError(f"no training rank of this micro-DP group holds {name}: the rollout model does "
                                 "not correspond to the training model")
            info = info_by_name[name]
            shape = list(info.shape)
            if info.sharded:
                prm.tensor_model_parallel, prm.partition_dim, prm.partition_stride = True, info.dim, info.stride
                shape[info.dim] = shape[info.dim] * lay.t // lay.t_g
            if tuple(shape) != tuple(prm.shape):
                raise ValueError(f"rollout parameter {name} has shape {tuple(prm.shape)}, expected {tuple(shape)} "
                                 "from the training model")
        self.member_index = [m.rank for m in members].index(dist.get_rank())
        device = next(iter(self._train_params.values())).device
        bucket_numel = {name: max(1, int(self.bucket_size_mb * 2**20) // torch.empty((), dtype=dt).element_size())
                        for name, dt in _DTYPES.items()}
        if lay.widens:
            self.plan = None
            self.buffers = {}
            return
        alignment = None
        if self.align_slots:
            from .memory import allocation_granularity

            granule = allocation_granularity(device)
            alignment = {name: max(1, granule // torch.empty((), dtype=dt).element_size())
                         for name, dt in _DTYPES.items()}
        self.plan = build_group_plan(members, [i.name for i, _ in rollout_infos], k=lay.k, q=lay.q,
                                     bucket_numel=bucket_numel, alignment=alignment)
        # Place the training tensors in their own slots (a one-time copy at construction).
        self.buffers: dict[str, RolloutBuffer] = {}
        j = self.member_index
        for dtype, regions in self.plan.regions.items():
            own, used = [], []
            for reg in regions:
                if j not in reg.members:
                    continue
                used.append((reg.offset, reg.offset + reg.numel))
                if reg.kind != "broadcast" or reg.owner == j:
                    lo = reg.slot_offset(j)
                    own.append((lo, lo + reg.slot_numel))
            buf = RolloutBuffer(self.plan.buffer_numel(dtype), _DTYPES[dtype], device, own=own, used=used)
            self.buffers[dtype] = buf
            flat = buf.tensor
            for reg in regions:
                for sl in reg.slices:
                    if sl.member != j:
                        continue
                    prm = self._train_params[sl.name]
                    view = flat[sl.offset: sl.offset + sl.numel].view(sl.shape)
                    with torch.no_grad():
                        view.copy_(prm.data)
                    prm.data = view
                    prm._mh_keepalive = buf  # the buffer lives as long as a parameter views it
        self._sources = self.plan.sources(j)

    # ------------------------------------------------------------------------------------------------------
    def _fingerprint_now(self) -> int:
        return sum(p._version for p in self._train_params.values())

    @property
    def rollout_model(self) -> Union[torch.nn.Module, list[torch.nn.Module]]:
        """The megatron-core model of the rollout layout (a list when the training model was a list)."""
        return self.rollout_chunks if len(self.chunks) > 1 else self.rollout_chunks[0]

    def switch_to_rollout(self, *, offload_optimizer: Optional[torch.optim.Optimizer] = None,
                          offload_grads: bool = False) -> None:
        """Gather the missing shards and bind the rollout model to them. No-op when already rolling out.

        ``offload_optimizer`` (a torch or Megatron optimizer) and ``offload_grads`` move optimizer states and
        gradient buffers to host memory (pinned on GPU) until :meth:`switch_to_training` brings them back.
        """
        if self.mode == "rollout":
            if self._fingerprint_now() != self._fingerprint:
                raise RuntimeError("the training weights changed while in rollout mode; call "
                                   "switch_to_training() before training")
            return  # not a switch: the report keeps describing the last one
        if self.mode == "closed":
            raise RuntimeError("the engine was closed")
        if [p.data_ptr() for p in self._train_params.values()] != self._train_ptrs:
            moved = [n for (n, p), ptr in zip(self._train_params.items(), self._train_ptrs) if p.data_ptr() != ptr]
            raise RuntimeError(f"training parameters {moved[:3]} were given new storage (param.data = ...) after "
                               "the HybridEngine was built; the rollout model is bound to the old storage. Copy new "
                               "values in place (param.data.copy_(...)) instead")
        start = time.perf_counter()
        records: list[CollectiveRecord] = []
        map_seconds = 0.0
        if self.plan is not None:
            j = self.member_index
            for dtype, regions in self.plan.regions.items():
                buf = self.buffers[dtype]
                for reg in regions:
                    if j in reg.members:
                        # Map just this region's peers' slots: on a GPU the previous collective runs meanwhile.
                        t0 = time.perf_counter()
                        buf.map_peers(reg.offset, reg.offset + reg.numel)
                        map_seconds += time.perf_counter() - t0
                        records.append(self._run_region(buf.tensor, reg, j))
        t0 = time.perf_counter()
        for buf in self.buffers.values():
            buf.map_peers()  # the rest, if any range lies outside this rank's regions
        for buf, _ in self._canonical:
            buf.map_peers()  # while the device still gathers
        t_coll = time.perf_counter()
        map_seconds += t_coll - t0
        for _, refill in self._canonical:
            refill()
        t_canon = time.perf_counter()
        self._offloaded = _offload(self._offload_targets(offload_optimizer, offload_grads))
        t_off = time.perf_counter()
        self._synchronize()
        for buf in self.buffers.values():
            buf.release_transient(synchronize=False)
        end = time.perf_counter()
        self.mode = "rollout"
        self.num_switches += 1
        self._fingerprint = self._fingerprint_now()
        phases = {"map_seconds": map_seconds, "collectives_seconds": t_coll - start - map_seconds,
                  "canonical_seconds": t_canon - t_coll, "offload_seconds": t_off - t_canon,
                  "sync_seconds": end - t_off}
        self._last_report = self._report(records, end - start, phases)

    def _group_for(self, reg) -> tuple[Any, list[int]]:
        if reg.members == list(range(len(self.plan.members))):
            return self.groups["micro_dp"], self.group_ranks["micro_dp"]
        return self.groups["cross_stage"], self.group_ranks["cross_stage"]

    def _run_region(self, flat: torch.Tensor, reg, j: int) -> CollectiveRecord:
        group, ranks = self._group_for(reg)
        region = flat[reg.offset: reg.offset + reg.numel]
        elem = flat.element_size()
        t0, wall0 = time.perf_counter(), time.time()
        if reg.kind == "broadcast":
            src = self.plan.members[reg.owner].rank
            dist.broadcast(region, src=src, group=group)
            received = 0 if reg.owner == j else reg.slot_numel * elem
            op = "broadcast"
        else:
            lo = reg.slot_offset(j) - reg.offset
            compat.all_gather_into_tensor(region, region[lo: lo + reg.slot_numel], group=group)
            received = reg.slot_numel * (len(reg.members) - 1) * elem
            op = "all_gather_into_tensor"
        if self.profiling:
            self._synchronize()
        seconds = time.perf_counter() - t0
        return CollectiveRecord(op, ranks, received, seconds, wall0, wall0 + seconds, dist.get_rank())

    def _synchronize(self) -> None:
        if torch.cuda.is_available() and next(iter(self._train_params.values())).is_cuda:
            torch.cuda.synchronize()

    def _make_blocks(self, name: str) -> Blocks:
        """The rollout parameter ``name`` as views of training tensors (own, or in peers' slots)."""
        lay = self.layout
        if lay.widens:
            prm = self._train_params[name]
            spec = TPSpec.of(prm)
            if not spec.sharded:
                return Blocks([prm.data], 0, 1)
            j = self.rollout_tp_rank % lay.m
            pieces = prm.data.chunk(spec.stride * lay.m, dim=spec.dim)
            return Blocks([pieces[s * lay.m + j] for s in range(spec.stride)], spec.dim, 1)
        src = self._sources[name]
        views = []
        for blk in src.blocks:
            if blk.member == self.member_index:
                views.append(self._train_params[name].data)
            else:
                dtype, off = self.plan.where(blk.member, name)
                info = self.plan.by_name[blk.member][name]
                views.append(self.buffers[dtype].tensor[off: off + info.numel].view(info.shape))
        return Blocks(views, src.dim, src.stride if len(views) > 1 else 1)

    def _bind_once(self) -> None:
        """Point every rollout parameter at its storage, once for the engine's lifetime.

        The buffers keep their addresses, so the bindings stay valid across switches; a switch only maps the
        peers' slots and fills them. Three kinds of binding:

        - a view: the rollout tensor is one training tensor (own, or a peer's slot): zero copies;
        - blocks (aliased mode, weights): a placeholder carrying the views, computed on by :mod:`aliased`;
        - a canonical tensor (canonical mode, and 1-D sharded tensors such as biases in either mode): storage in a
          per-dtype reserved range that is mapped only while rolling out, refilled at every switch by one fused
          ``scatter_blocks`` per dtype (or, with t_g > t, by concatenating the own shard's pieces).
        """
        from . import ops

        pending: dict[torch.dtype, list[tuple[str, torch.nn.Parameter, Blocks]]] = {}
        viewed: dict[str, list[tuple[int, int]]] = {}  # buffer ranges that rollout parameters view directly
        for chunk in self.rollout_chunks:
            owners = _owner_modules(chunk)
            for name, prm in list(self._rollout_iter(chunk)):
                blocks = self._make_blocks(name)
                owner = owners[id(prm)]
                attr = next(a for a, v in owner._parameters.items() if v is prm)
                if len(blocks.views) == 1 and blocks.views[0].shape == prm.shape:
                    new = placeholder(prm, None)
                    new.data = blocks.views[0]
                    new._mh_keepalive = list(self.buffers.values())
                    src = self._sources[name].blocks[0] if self.plan is not None else None
                    if src is not None and src.member != self.member_index:  # a view of a peer's slot
                        dtype, off = self.plan.where(src.member, name)
                        viewed.setdefault(dtype, []).append((off, off + prm.numel()))
                elif self.weight_mode == "aliased" and prm.dim() > 1:
                    new = placeholder(prm, blocks)
                    new._mh_keepalive = list(self.buffers.values())
                else:
                    new = placeholder(prm, None)
                    pending.setdefault(prm.dtype, []).append((name, new, blocks))
                new._mh_rollout_name = name
                owner._parameters[attr] = new
        # Canonical mode reads the gathered shards once, into its own tensors: the peers' slots that no rollout
        # parameter views are given back at the end of the switch (aliased mode views all of them).
        if self.weight_mode == "canonical":
            for dtype, buf in self.buffers.items():
                buf.set_kept(viewed.get(dtype, []))
        self._canonical: list[tuple[RolloutBuffer, Callable[[], None]]] = []
        device = next(iter(self._train_params.values())).device
        for dtype, items in pending.items():
            # 16-element alignment keeps every canonical tensor's start vector-friendly for the copy kernels.
            offsets, total = [], 0
            for _, new, _ in items:
                offsets.append(total)
                total += -(-new.numel() // 16) * 16
            buf = RolloutBuffer(total, dtype, device, own=[], used=[(0, total)])
            flat = buf.tensor
            dsts = []
            for (_, new, _), off in zip(items, offsets):
                new.data = flat[off: off + new.numel()].view(new.shape)
                new._mh_keepalive = buf
                dsts.append(new.data)
            if self.plan is None:  # t_g > t: pieces of the own shard, no gather buffer involved
                pairs = [(blocks, dst) for (_, _, blocks), dst in zip(items, dsts)]

                def refill(pairs=pairs) -> None:
                    with torch.no_grad():
                        for blocks, dst in pairs:
                            blocks.materialize(out=dst)
            else:
                tables = []
                for i, (name, _, blocks) in enumerate(items):
                    src = self._sources[name]
                    offs = [self.plan.where(b.member, name)[1] for b in src.blocks]
                    tables.append(ops.plan_stack(blocks.views[0].shape, offs, partition_dim=src.dim,
                                                 partition_stride=src.stride, dst_index=i))
                source = self.buffers[_DTYPE_NAMES[dtype]].tensor
                table = torch.cat(tables)

                def refill(source=source, dsts=dsts, table=table) -> None:
                    ops.scatter_blocks(source, dsts, table)
            self._canonical.append((buf, refill))

    def _rollout_iter(self, chunk):
        offset = layer_offset(chunk)
        for name, prm in chunk.named_parameters():
            yield global_name(name, offset), prm

    def switch_to_training(self) -> None:
        """Release the peers' slots (and the canonical tensors); the training shards never moved.

        The rollout model keeps its bindings (fixed addresses), but its weights are not there until the next
        :meth:`switch_to_rollout`: its forward and ``state_dict`` refuse to run while training.
        """
        if self.mode == "training":
            return
        self._synchronize()  # once: nothing queued may touch the ranges unmapped below
        for buf in self.buffers.values():
            buf.unmap_peers(synchronize=False)
        for buf, _ in self._canonical:
            buf.unmap_peers(synchronize=False)
        _reload(self._offloaded)
        self._offloaded = []
        self.mode = "training"

    def close(self) -> None:
        """Detach the engine from the model: training parameters get ordinary memory again (one copy), the
        rollout model loses its weights, and every buffer is released. The engine cannot switch afterwards.

        Needed only to drop the engine while keeping the model: otherwise the buffers live as long as the
        parameters that view them.
        """
        if self.mode == "closed":
            return
        self.switch_to_training()
        with torch.no_grad():
            for prm in self._train_params.values():
                if hasattr(prm, "_mh_keepalive"):
                    prm.data = prm.data.clone()
                    del prm._mh_keepalive
        for chunk in self.rollout_chunks:
            owners = _owner_modules(chunk)
            for _, prm in list(chunk.named_parameters()):
                owner = owners[id(prm)]
                attr = next(a for a, v in owner._parameters.items() if v is prm)
                owner._parameters[attr] = placeholder(prm, None)
        for buf in list(self.buffers.values()) + [b for b, _ in self._canonical]:
            buf.close()
        self.buffers, self._canonical = {}, []
        self.mode = "closed"

    def _offload_targets(self, optimizer, grads: bool) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        if optimizer is not None:
            inner = getattr(optimizer, "optimizer", optimizer)  # Megatron wraps a torch optimizer
            for state in inner.state.values():
                out.extend(v for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        if grads:
            for c in self.chunks:
                ddp_buffers = getattr(c, "buffers", None)
                if isinstance(ddp_buffers, list):  # Megatron DDP: one contiguous grad buffer per dtype
                    out.extend(b.grad_data for b in ddp_buffers)
                else:
                    out.extend(p.grad for p in c.parameters() if p.grad is not None)
        return out

    @contextmanager
    def rollout(self) -> Iterator[torch.nn.Module]:
        """``with engine.rollout() as model:`` switch to rollout, and back to training on exit."""
        self.switch_to_rollout()
        try:
            yield self.rollout_model
        finally:
            self.switch_to_training()

    # ------------------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling_params, *, vocab_size: Optional[int] = None,
                 stop_token_ids: Sequence[int] = (), seed: int = 0) -> list:
        """Generate for this training rank's prompts on the rollout layout; results in prompt order.

        Called on every rank of the training layout (switches to rollout first if needed). The prompts of a
        training DP replica are split across its d_g rollout replicas and the results all-gathered back (micro-DP
        data flow); with t_g > t a rollout replica serves several training replicas whole. ``vocab_size``: the
        real vocabulary, whose padded rows are never sampled. Returns ``GenerationResult``s with
        ``.generated_tokens`` and ``.generated_log_probs``.
        """
        from .rollout import generate_tokens, split_evenly

        self.switch_to_rollout()
        lay = self.layout
        chunk = self.rollout_chunks[0]
        kwargs = dict(tp_group=self.groups["tp"], pp_group=self.groups["pp"], params=sampling_params,
                      vocab_order=self.rollout_tp_order, vocab_size=vocab_size, stop_token_ids=stop_token_ids,
                      seed=seed + 1_000_003 * self.rollout_replica)
        prompts = [list(map(int, p)) for p in prompts]
        if lay.widens:
            # This rollout replica spans m training replicas: generate for all of their prompts at once.
            mine = [None] * self.groups["tp"].size()
            dist.all_gather_object(mine, (self.dp_rank, prompts), group=self.groups["tp"])
            by_dp = dict(sorted(mine))
            batch = [p for dp in by_dp for p in by_dp[dp]]
            results = generate_tokens(chunk, prompts=batch, **kwargs)
            start = sum(len(by_dp[dp]) for dp in by_dp if dp < self.dp_rank)
            return results[start: start + len(prompts)]
        replica = self.rollout_replica - self.dp_rank * lay.d_g  # index among this training replica's d_g
        lo, hi = split_evenly(len(prompts), lay.d_g)[replica]
        results = generate_tokens(chunk, prompts=prompts[lo:hi], **kwargs)
        if lay.d_g == 1:
            return results
        gathered = [None] * lay.d_g
        dist.all_gather_object(gathered, (replica, results), group=self.groups["micro_dp"])
        return [r for _, part in sorted(gathered, key=lambda x: x[0]) for r in part]

    # ------------------------------------------------------------------------------------------------------
    def _report(self, records: list[CollectiveRecord], seconds: float, phases: dict[str, float]) -> dict[str, Any]:
        return {
            "total_bytes": sum(r.bytes_received for r in records),
            "num_collectives": len(records),
            "switch_seconds": seconds,
            # Where the switch's time went. Without profiling, GPU phases are launch times and the device is
            # synchronised once at the end: the wait for the queued collectives and copies is sync_seconds.
            "phases": dict(phases),
            "collectives": [dataclasses.asdict(r) | {"gbps": (r.bytes_received / r.seconds / 1e9) if r.seconds
                                                     else 0.0} for r in records],
            "groups": {k: v for k, v in self.group_ranks.items() if k != "single"},
            "peer_bytes_mapped": sum(b.mapped_peer_bytes for b in self.buffers.values()),
            "transient_bytes_released": sum(b.transient_bytes for b in self.buffers.values()),
            "canonical_bytes_mapped": sum(b.peer_bytes for b, _ in self._canonical if b.peers_mapped),
            "resident_peer_bytes": sum(b.resident_peer_bytes for b in self.buffers.values()),
            "weight_mode": self.weight_mode,
            "layout": dataclasses.asdict(self.layout),
        }

    def communication_report(self) -> dict[str, Any]:
        """What the last switch to rollout moved: ``total_bytes`` is what this rank received."""
        return dict(self._last_report)

    def set_profiling(self, enabled: bool) -> None:
        """Time each collective separately (synchronising after each) or only the whole switch (default).

        Without profiling, a GPU collective's ``seconds`` in the report is its launch time only; on CPU/gloo
        collectives are synchronous either way.
        """
        self.profiling = bool(enabled)
