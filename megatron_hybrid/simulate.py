"""A simulated world: every rank of a layout pair in one process, the switch run by the engine's own plan,
placement and executor through the in-process transport, each rank's rollout tensors checked bit for bit.

Issue 48, step 3. A check of one layout pair on real gloo ranks takes minutes on 2 cores; here it takes
milliseconds, so the whole layout space can be swept (``tests/test_simulate.py``, ``bench/layout_sweep.py``). What
runs is the engine's code from the parameter descriptions on: :func:`~megatron_hybrid.reshard.plan.build_group_plan` (as
:func:`~megatron_hybrid.reshard.executor.make_group_plan` calls it),
:class:`~megatron_hybrid.reshard.placement.Placement` (the training tensors moved into their slots, the blocks a rollout
tensor reads) and :class:`~megatron_hybrid.reshard.executor.PlanExecutor` (the collectives, here copies between the
ranks' threads). What does not run: megatron-core's modules. The model is a table of its parameters
(:func:`gpt_parameters`: the names, order, shapes and tensor-parallel attributes megatron-core gives a
:class:`~megatron_hybrid.megatron.models.GPTArchitecture`, checked against the model it builds), every rank's training
shards are cut from one unsharded model with :func:`~megatron_hybrid.megatron.sharding.shard`, and a rank's rollout
tensor (its blocks, materialised as the canonical binding does) is compared with the unsharded tensor's rollout shard,
cut the same way.

Covered now: dense GPT models with every architecture option of ``GPTArchitecture``, tied embeddings included; every
layout pair, in place (micro-DP gathers: t_g | t, or t_g = m·t with m | d and p_g = p; p_g | p) or exchanged
(:mod:`megatron_hybrid.reshard.exchange`: one all-to-all); virtual pipeline chunks (an exchange layout, as the engine
serves a dense model with them); aliased and canonical weights. MoE models (routed experts, shared experts and
their gate, dense and MoE layers mixed, expert biases): in place, the routed experts as a second plane over the
micro-EP groups of megatron-core's expert grid (expert TP, EP, expert DP, PP); exchanged, the routed experts in the
all-to-all on their own axis (expert TP), each rollout stage's ranks cut into rollout expert TP × EP × expert DP;
both as :class:`~megatron_hybrid.engine.HybridEngine` places them. Refused with a ``ValueError`` naming what (not
simulated yet): FP8 rollout weights.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .constraints import Sizes, check
from .groups import InProcessGroups
from .layout import ExpertGrid, ExpertLayout, Grid, ParallelLayout, RolloutLayout
from .megatron.models import GPTArchitecture
from .megatron.sharding import TPSpec, shard
from .modes import RolloutWeights, WeightMode
from .quant.fp8 import FP8_DTYPE, is_target, quantize_rows
from .reshard.exchange import RankTensors, arrange, build_exchange_plan, keys_of
from .reshard.executor import ExchangeExecutor, PlanExecutor, PlaneSpec
from .reshard.placement import DTYPE_NAMES, DTYPES, ExchangePlacement, Placement
from .reshard.plan import MemberInfo, ParamInfo, build_group_plan
from .transport import InProcessWorld

_LAYER_PREFIX = "decoder.layers."
OUTPUT, EMBEDDING = "output_layer.weight", "embedding.word_embeddings.weight"
_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


#: The simulated worlds' weight modes: the engine's, and canonical with FP8 rollout weights (named as the latter).
SIMULATED_MODES = (*(m.value for m in WeightMode), RolloutWeights.FP8.value)

def gpt_parameters(arch: GPTArchitecture, *, vocab_size: Optional[int] = None
                   ) -> dict[str, tuple[tuple[int, ...], TPSpec]]:
    """Every parameter of the unsharded model: global name -> (full shape, tensor-parallel spec), in the order of
    megatron-core's ``named_parameters`` (local spec).

    Column-parallel weights (QKV, fc1, the vocabulary) split along dim 0, fc1 with ``partition_stride`` 2 when
    gated (its shard is ``[gate_r; up_r]``), row-parallel weights along dim 1; norms, row-parallel biases and
    learned position embeddings replicated. ``vocab_size``: the padded vocabulary (default: padded for TP 1).
    An MoE layer (``moe_layer_freq``) has megatron-core's local spec instead of the MLP: the router (replicated),
    every routed expert by its global index (``experts.local_experts.{j}``, SequentialMLP; split over expert TP
    as the MLP is over TP, and over EP by index), then the shared expert (TP like the MLP) and its gate.
    ``tests/test_simulate.py`` checks this table against the model megatron-core builds.
    """
    h, heads = arch.hidden_size, arch.num_attention_heads
    groups = arch.num_query_groups or heads
    kv = arch.kv_channels or h // heads
    ffn = arch.ffn_hidden_size or 4 * h
    vocab = vocab_size if vocab_size is not None else arch.padded_vocab_size(1)
    col, row, rep = TPSpec(True, 0, 1), TPSpec(True, 1, 1), TPSpec(False)
    fc1 = TPSpec(True, 0, 2) if arch.swiglu else col
    norm = ("weight", "bias") if arch.normalization == "LayerNorm" else ("weight",)
    bias = arch.add_bias_linear
    out: dict[str, tuple[tuple[int, ...], TPSpec]] = {"embedding.word_embeddings.weight": ((vocab, h), col)}
    if arch.position_embedding_type == "learned_absolute":
        out["embedding.position_embeddings.weight"] = ((arch.max_position_embeddings, h), rep)

    def mlp(prefix: str, width: int) -> list[tuple[str, tuple[int, ...], TPSpec]]:
        rows = 2 * width if arch.swiglu else width
        return [(f"{prefix}linear_fc1.weight", (rows, h), fc1),
                *(((f"{prefix}linear_fc1.bias", (rows,), fc1),) if bias else ()),
                (f"{prefix}linear_fc2.weight", (h, width), row),
                *(((f"{prefix}linear_fc2.bias", (h,), rep),) if bias else ())]

    moe = arch.moe_layer_pattern()
    for i in range(arch.num_layers):
        p = f"{_LAYER_PREFIX}{i}."
        if moe[i]:
            shared = arch.moe_shared_expert_intermediate_size
            ffn_part = [("mlp.router.weight", (arch.num_experts, h), rep),
                        *((("mlp.router.bias", (arch.num_experts,), rep),) if bias else ()),
                        *(item for j in range(arch.num_experts)
                          for item in mlp(f"mlp.experts.local_experts.{j}.", arch.moe_ffn_hidden_size or ffn)),
                        *((("mlp.shared_experts.gate_weight", (1, h), rep),) if arch.moe_shared_expert_gate else ()),
                        *(mlp("mlp.shared_experts.", shared) if shared is not None else ())]
        else:
            ffn_part = mlp("mlp.", ffn)
        layer = [*((f"input_layernorm.{w}", (h,), rep) for w in norm),
                 ("self_attention.linear_proj.weight", (h, heads * kv), row),
                 *((("self_attention.linear_proj.bias", (h,), rep),) if bias else ()),
                 ("self_attention.linear_qkv.weight", ((heads + 2 * groups) * kv, h), col),
                 *((("self_attention.linear_qkv.bias", ((heads + 2 * groups) * kv,), col),)
                   if bias or arch.add_qkv_bias else ()),
                 *((f"self_attention.{qk}_layernorm.{w}", (kv,), rep) for qk in ("q", "k") for w in norm
                   if arch.qk_layernorm),
                 *((f"pre_mlp_layernorm.{w}", (h,), rep) for w in norm), *ffn_part]
        for name, shape, spec in layer:
            out[p + name] = (shape, spec)
    for w in norm:
        out[f"decoder.final_layernorm.{w}"] = ((h,), rep)
    # Tied: the last stage's copy of the embedding (``shared_embedding``), which exists only in a model of more than
    # one stage (:func:`stage_names` drops it otherwise); megatron-core keeps the two equal.
    out[OUTPUT] = ((vocab, h), col)
    return out


def unsharded_model(specs: dict[str, tuple[tuple[int, ...], TPSpec]], *, seed: int = 0,
                    dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random full tensors for a :func:`gpt_parameters` table (distinct values everywhere: a misplaced block
    shows)."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g).to(dtype) for name, (shape, _) in specs.items()}


def layer_of(name: str) -> Optional[int]:
    """The global layer index of a transformer layer's parameter, else None."""
    if not name.startswith(_LAYER_PREFIX):
        return None
    return int(name[len(_LAYER_PREFIX):].split(".", 1)[0])


def stage_names(names: list[str], *, stage: int, stages: int, num_layers: int, tied: bool = False,
                chunks: int = 1) -> list[str]:
    """The parameters pipeline stage ``stage`` of ``stages`` holds, in its chunks' order: its layers, the embedding
    on the first, the final norm and the output layer on the last (megatron-core's even split: with ``chunks``
    virtual chunks a stage, model chunk c = v · stages + s holds layers [c · n, (c + 1) · n), n = num_layers /
    (stages · chunks)); with ``tied`` embeddings, the output layer only where there is more than one stage (else
    the embedding serves)."""
    per = num_layers // (stages * chunks)
    out = []
    for name in names:
        if tied and name == OUTPUT and stages == 1:
            continue
        layer = layer_of(name)
        if layer is not None:
            keep = (layer // per) % stages == stage
        elif name.startswith("embedding."):
            keep = stage == 0
        else:
            keep = stage == stages - 1
        if keep:
            out.append(name)
    return out


def expert_of(name: str) -> Optional[int]:
    """The global index of a routed expert's parameter, else None."""
    m = _EXPERT.search(name)
    return None if m is None else int(m.group(1))


def ep_names(names: list[str], *, ep_rank: int, ep_size: int, num_experts: Optional[int]) -> list[str]:
    """``names`` without the routed experts that expert-parallel rank ``ep_rank`` of ``ep_size`` does not hold
    (rank r holds experts [r · E/e, (r + 1) · E/e), megatron-core's split)."""
    if num_experts is None:
        return names
    per = num_experts // ep_size
    return [n for n in names if expert_of(n) is None or expert_of(n) // per == ep_rank]


def local_name(name: str, *, per_chunk: int, experts_per_rank: int = 1) -> str:
    """A global name as its model chunk names it (layer indices from the chunk's first layer, a routed expert's
    index from the rank's first expert)."""
    layer = layer_of(name)
    if layer is None:
        return name
    rest = name[len(_LAYER_PREFIX):].split(".", 1)[1]
    j = expert_of(name)
    if j is not None:
        rest = _EXPERT.sub(f".experts.local_experts.{j % experts_per_rank}.", "." + rest, count=1)[1:]
    return f"{_LAYER_PREFIX}{layer % per_chunk}.{rest}"


def _parameter(value: torch.Tensor, spec: TPSpec) -> torch.nn.Parameter:
    """A training parameter with megatron-core's tensor-parallel attributes (what the placement reads)."""
    prm = torch.nn.Parameter(value.clone(), requires_grad=False)
    if spec.sharded:
        prm.tensor_model_parallel, prm.partition_dim, prm.partition_stride = True, spec.dim, spec.stride
    return prm


@dataclass
class RankResult:
    """What one simulated rank ends with."""

    rank: int
    coord: tuple[int, int, int]
    rollout_coord: tuple[int, int, int]
    rollout: dict[str, torch.Tensor]
    """Every rollout tensor of the rank's rollout stage and TP rank, materialised from its blocks."""
    bytes_received: list[int]
    """Per switch."""
    placement: Any
    """The dense tensors' placement (an MoE model's experts have theirs in ``expert_placement``)."""
    expert_coord: Optional[tuple[int, int, int, int]] = None
    """An MoE model: the rank's (expert TP, EP, expert DP, stage) coordinate."""
    rollout_expert_coord: Optional[tuple[int, int]] = None
    """An MoE model: the rank's rollout (expert TP, EP) ranks."""
    expert_placement: Any = None
    fp8: dict[str, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict)
    """FP8 rollout weights: each quantized weight (``float8_e4m3fn``) and its fp32 row scales, as the engine's
    quantizer writes them from the rank's blocks."""


@dataclass
class SimulatedSwitch:
    """The outcome of :func:`simulate_switch`: every rank's result and what the unsharded model says."""

    layout: ParallelLayout
    arch: GPTArchitecture
    chunks: int
    """Virtual pipeline chunks a training stage."""
    specs: dict[str, tuple[tuple[int, ...], TPSpec]]
    """The unsharded model's table (:func:`gpt_parameters`, vocabulary padded for the training TP)."""
    full: dict[str, torch.Tensor]
    ranks: list[RankResult]

    experts: Optional[ExpertLayout] = None
    """An MoE model's expert layout (training and rollout expert sizes)."""

    @property
    def num_experts(self) -> Optional[int]:
        return self.arch.num_experts

    def training_names(self, rank: RankResult) -> list[str]:
        """What the rank holds in training: its stage's (chunks') tensors, its EP rank's routed experts."""
        lay = self.layout
        names = stage_names(list(self.specs), stage=rank.coord[1], stages=lay.p, num_layers=self.arch.num_layers,
                            tied=self.tied, chunks=self.chunks)
        if self.experts is None:
            return names
        return ep_names(names, ep_rank=rank.expert_coord[1], ep_size=self.experts.e, num_experts=self.num_experts)

    def rollout_names(self, rank: RankResult) -> list[str]:
        """What the rank holds rolling out: its rollout stage's tensors, its rollout EP rank's routed experts."""
        lay = self.layout  # (virtual chunks make an exchange layout: one rollout chunk a rank)
        names = stage_names(list(self.specs), stage=rank.rollout_coord[1], stages=lay.p_g,
                            num_layers=self.arch.num_layers, tied=self.tied,
                            chunks=1 if lay.exchange else self.chunks)
        if self.experts is None:
            return names
        return ep_names(names, ep_rank=rank.rollout_expert_coord[1], ep_size=self.experts.e_g,
                        num_experts=self.num_experts)

    def cut(self, name: str, rank: RankResult, *, rollout: bool) -> tuple[int, int]:
        """(shard index, shards) of ``name`` on ``rank``: TP for dense tensors, expert TP for routed experts."""
        if expert_of(name) is not None:
            return (rank.rollout_expert_coord[0], self.experts.et_g) if rollout else \
                (rank.expert_coord[0], self.experts.et)
        return (rank.rollout_coord[0], self.layout.t_g) if rollout else (rank.coord[0], self.layout.t)

    def expected(self, rank: RankResult) -> dict[str, torch.Tensor]:
        """The unsharded model's rollout shard for ``rank``: its rollout stage's tensors (and rollout EP rank's
        experts) cut for its rollout (expert) TP rank with the project's sharding function."""
        return {n: shard(self.full[n], self.specs[n][1], *self.cut(n, rank, rollout=True))
                for n in self.rollout_names(rank)}

    @property
    def tied(self) -> bool:
        return not self.arch.untie_embeddings_and_output_weights

    def key(self, name: str) -> str:
        """What a tensor is, as the bytes count: a tied output layer is the embedding."""
        return EMBEDDING if self.tied and name == OUTPUT else name

    def missing_bytes(self, rank: RankResult) -> int:
        """Bytes of the rank's rollout shard that its training shard does not hold: element index sets, cut by
        the sharding function from an index tensor of each full shape (independent of the plan)."""
        held = {self.key(n) for n in self.training_names(rank)}
        total = 0
        for name in self.rollout_names(rank):
            shape, spec = self.specs[name]
            index = torch.arange(torch.Size(shape).numel()).view(shape)
            need = set(shard(index, spec, *self.cut(name, rank, rollout=True)).reshape(-1).tolist())
            have = set(shard(index, spec, *self.cut(name, rank, rollout=False)).reshape(-1).tolist()) \
                if self.key(name) in held else set()
            total += len(need - have) * self.full[name].element_size()
        return total


class _ModelStandIn(torch.nn.Module):
    """What the engine's :func:`~megatron_hybrid.validation.check_model` reads of a built model chunk: its
    ``config`` and padded ``vocab_size`` (no parameters: every tensor of the table lives in a local-spec module
    that computes on blocks, so the aliased-mode check has nothing to refuse)."""

    def __init__(self, config: Any, vocab_size: int) -> None:
        super().__init__()
        self.config, self.vocab_size = config, vocab_size


class _GroupSize:
    """A training process group as :func:`~megatron_hybrid.validation.check_experts` reads it: its size."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def validate(arch: GPTArchitecture, training: tuple[int, int, int], rollout: RolloutLayout, *,
             weight_mode: str = "aliased", chunks: int = 1, expert_parallel: Optional[tuple[int, int]] = None
             ) -> ParallelLayout:
    """The layout pair through the engine's own validation, as :class:`~megatron_hybrid.engine.HybridEngine`
    runs it on a built model, and through what megatron-core needs to build the training model (Megatron-LM's
    argument checks: TP divides the heads, the query groups and the MLP, PP the layers; for an MoE model EP divides
    the experts, expert TP their MLP, and expert TP × EP × expert DP covers TP × DP). ``expert_parallel``: an MoE
    model's training (EP, expert TP) sizes (default (1, t)). ``ValueError`` when refused; else the layout (an
    exchange one with virtual ``chunks``, as the engine makes it)."""
    from .validation import check_experts, check_layout, check_model  # megatron-core's config types

    if not isinstance(training, tuple) or len(training) != 3:
        raise ValueError(f"training ({training!r}) must be a (t, p, d) tuple")
    t, p, d = training
    lay = ParallelLayout.create(training=training, rollout=rollout)
    e, et = expert_sizes(training, expert_parallel, moe=arch.num_experts is not None)
    arch.validate(tensor_model_parallel_size=t, pipeline_model_parallel_size=p, expert_model_parallel_size=e,
                  expert_tensor_parallel_size=et)
    check(Sizes(moe=arch.num_experts is not None, t=t, d=d, e=e, et=et,
                num_query_groups=arch.num_query_groups or arch.num_attention_heads),
          "t_divides_query_groups", "expert_grid_fits_stage")
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks ({chunks!r}) must be a positive integer")
    if chunks > 1 and (p < 2 or arch.num_layers % (p * chunks)):
        raise ValueError(f"virtual pipeline chunks ({chunks}) need pipeline_model_parallel_size ({p}) ≥ 2 and "
                         f"num_layers ({arch.num_layers}) divisible by pipeline size × chunks")
    moe = arch.num_experts is not None
    if chunks > 1:
        lay = dataclasses.replace(lay, exchange=True)
    check_layout(lay, world_size=t * p * d, num_chunks=chunks)
    config = arch.transformer_config(tensor_model_parallel_size=t, pipeline_model_parallel_size=p,
                                     expert_model_parallel_size=e, expert_tensor_parallel_size=et)
    stand_in = _ModelStandIn(config, arch.padded_vocab_size(t))
    fp8 = weight_mode == RolloutWeights.FP8  # FP8 rollout weights: canonical mode, quantized after each switch
    check_model([stand_in], lay, weight_mode=WeightMode.CANONICAL if fp8 else weight_mode,
                rollout_weights=RolloutWeights.FP8 if fp8 else RolloutWeights.MODEL)
    expert_groups = (_GroupSize(et), _GroupSize(e), _GroupSize(t * d // (e * et))) if moe else None
    check_experts([stand_in], lay, rollout, expert_groups=expert_groups, world_size=t * p * d)
    return lay


def expert_sizes(training: tuple[int, int, int], expert_parallel: Optional[tuple[int, int]], *,
                 moe: bool) -> tuple[int, int]:
    """(EP, expert TP) of the training layout: ``expert_parallel`` or (1, t); ``ValueError`` for sizes without
    experts to split."""
    t = training[0]
    if expert_parallel is None:
        return 1, t
    if not isinstance(expert_parallel, tuple) or len(expert_parallel) != 2 or \
            any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in expert_parallel):
        raise ValueError(f"expert_parallel ({expert_parallel!r}) must be an (EP, expert TP) tuple of positive "
                         "integers")
    if not moe and expert_parallel != (1, t):
        raise ValueError(f"expert_parallel ({expert_parallel}) needs a model with experts")
    return expert_parallel


def simulate_switch(arch: GPTArchitecture, training: tuple[int, int, int], rollout: RolloutLayout, *,
                    weight_mode: str = "aliased", switches: int = 1, seed: int = 0, chunks: int = 1,
                    update: Optional[Any] = None, bucket_size_mb: float = 0.001,
                    expert_parallel: Optional[tuple[int, int]] = None) -> SimulatedSwitch:
    """Run the switch of layout pair ``training`` (t, p, d) -> ``rollout`` for every rank in one process.

    ``switches``: how many switches to rollout, each after the previous one's return to training (which gives the
    peers' slots back, so each switch must deliver every missing byte again). ``update``: a function applied in place
    to every rank's training shards and to the unsharded model before the last switch (its name -> tensor, as
    ``update(name, tensor)``), an optimizer step's stand-in: it must act element-wise and identically on a shard
    and on the full tensor. A small ``bucket_size_mb`` gives many buckets (more regions to get wrong).
    ``expert_parallel``: an MoE model's training (EP, expert TP) sizes; its routed experts then form a second plane
    over the micro-EP groups (the rollout's EP and expert TP are ``rollout``'s), as the engine places them; an
    exchange layout moves them in its all-to-all, on their own axis (expert TP).
    """
    if weight_mode not in SIMULATED_MODES:
        raise ValueError(f"weight_mode ({weight_mode!r}) must be one of {SIMULATED_MODES} (the last: canonical with "
                         "FP8 rollout weights)")
    lay = validate(arch, training, rollout, weight_mode=weight_mode, chunks=chunks, expert_parallel=expert_parallel)
    world = _SimulatedWorld(arch, training, rollout, lay, weight_mode=weight_mode, seed=seed, chunks=chunks,
                            bucket_size_mb=bucket_size_mb, expert_parallel=expert_parallel)
    t, p, d = training
    ranks = InProcessWorld(t * p * d).run(lambda transport: world.rank_body(transport, switches, update))
    if update is not None:  # after the ranks cut their shards from it: the model the last switch must deliver
        with torch.no_grad():
            for name, tensor in world.full.items():
                update(name, tensor)
    return SimulatedSwitch(lay, arch, chunks, world.specs, world.full, ranks, world.experts)


class _SimulatedWorld:
    """Everything the ranks of one simulated switch share: the unsharded model, every rank's training and rollout
    coordinates (dense and expert), the micro groups; and what each rank runs (:meth:`rank_body`)."""

    def __init__(self, arch: GPTArchitecture, training: tuple[int, int, int], rollout: RolloutLayout,
                 lay: ParallelLayout, *, weight_mode: str, seed: int, chunks: int, bucket_size_mb: float,
                 expert_parallel: Optional[tuple[int, int]]) -> None:
        self.arch, self.lay, self.weight_mode, self.chunks = arch, lay, weight_mode, chunks
        t, p, d = self.training = training
        moe = arch.num_experts is not None
        e, et = expert_sizes(training, expert_parallel, moe=moe)
        self.experts = experts = None if not moe else ExpertLayout(
            et=et, e=e, edp=t * d // (e * et), p=p, et_g=rollout.expert_tp, e_g=rollout.expert_model_parallel_size,
            p_g=lay.p_g, exchange=lay.exchange)
        self.specs = specs = gpt_parameters(arch, vocab_size=arch.padded_vocab_size(t))  # the training padding
        for name, (shape, spec) in specs.items():
            sizes = (et, experts.et_g) if expert_of(name) is not None else (t, lay.t_g)
            for size in sizes:
                if spec.sharded and shape[spec.dim] % (spec.stride * size):
                    raise ValueError(f"{name} {shape}: dimension {spec.dim} does not split into {spec.stride} x "
                                     f"{size} pieces")
        self.full = full = unsharded_model(specs, seed=seed)
        self.tied = not arch.untie_embeddings_and_output_weights
        if self.tied:
            full[OUTPUT] = full[EMBEDDING].clone()
        # As HybridEngine: with p_g = 1 < p the last stage's tied output layer serves the rollout embedding in place.
        self.plan_tied = (OUTPUT, EMBEDDING) if self.tied and lay.p_g == 1 < p and not lay.widens \
            and not lay.exchange else None
        grid = Grid.megatron_default(t, p, d)
        self.coords = dict(grid.coords())
        self.per_chunk = arch.num_layers // (p * chunks)
        arrangement = None
        self.micro: dict[int, list[int]] = {}
        if lay.exchange:  # every rank's rollout coordinate, as create_rollout_groups takes it from the arrangement
            arrangement = arrange(lay, grid, num_layers=arch.num_layers, chunks=chunks)
            self.rollout_coord = arrangement.coords
        else:
            self.rollout_coord = {r: lay.rollout_coords(c) for r, c in self.coords.items()}
            self.micro = {r: g for g in lay.micro_dp_groups(grid) for r in g}
        self.expert_coord: dict[int, Any] = {}
        self.rollout_expert: dict[int, tuple[int, int]] = {}
        self.micro_ep: dict[int, list[int]] = {}
        if experts is not None:  # the expert grid in megatron-core's order, its micro-EP groups (the engine's)
            egrid = ExpertGrid.megatron_default(experts.et, experts.e, experts.edp, p)
            self.expert_coord = dict(egrid.items())
            if arrangement is not None:
                self.rollout_expert = {r: c[:2] for r, c in
                                       arrangement.expert_coords(experts.et_g, experts.e_g).items()}
            else:
                self.rollout_expert = {r: experts.rollout_coords(c)[:2] for r, c in self.expert_coord.items()}
                self.micro_ep = {r: g for g in experts.micro_ep_groups(egrid) for r in g}
        self.probe = SimulatedSwitch(lay, arch, chunks, specs, full, [], experts)
        self.bucket_numel = {name: max(1, int(bucket_size_mb * 2**20) // torch.empty((), dtype=dt).element_size())
                             for name, dt in DTYPES.items()}

    def stand_in(self, rank: int) -> RankResult:
        """The rank's coordinates, as the names and cuts read them."""
        return RankResult(rank, self.coords[rank], self.rollout_coord[rank], {}, [], None,
                          self.expert_coord.get(rank), self.rollout_expert.get(rank))

    def shards_of(self, rank: int) -> dict[str, torch.Tensor]:
        who = self.stand_in(rank)
        return {n: shard(self.full[n], self.specs[n][1], *self.probe.cut(n, who, rollout=False))
                for n in self.probe.training_names(who)}

    def member_info(self, rank: int, own: dict[str, Any], plane: Optional[PlaneSpec]) -> MemberInfo:
        arch, specs, p = self.arch, self.specs, self.training[1]
        per_rank = 1 if self.experts is None else arch.num_experts // self.experts.e
        params = tuple(ParamInfo(n, local_name(n, per_chunk=self.per_chunk, experts_per_rank=per_rank),
                                 tuple(v.shape), DTYPE_NAMES[v.dtype], specs[n][1].sharded, specs[n][1].dim,
                                 specs[n][1].stride)
                       for n, v in own.items() if plane is None or plane.holds(n))
        if plane is None:  # every tensor (an exchange layout's description)
            return MemberInfo(rank, self.coords[rank][0], self.coords[rank][1], params, arch.num_layers // p)
        return MemberInfo(rank, plane.tp_rank, plane.pp_rank, params, arch.num_layers // p, ep=plane.ep_rank)

    def planes(self, rank: int) -> list[PlaneSpec]:
        """As reshard.assembly.plane_specs: the dense plane over micro-DP, the routed experts over micro-EP."""
        lay, experts = self.lay, self.experts
        i, s, _ = self.coords[rank]
        out = [PlaneSpec("dense", "micro_dp", self.training[0], lay.t_g, lay.k, lay.q, 1, i, s)]
        if experts is not None and not lay.exchange:
            ei, ej, _, es = self.expert_coord[rank]
            out.append(PlaneSpec("experts", "micro_ep", experts.et, experts.et_g, experts.ke, experts.q, experts.ue,
                                 ei, es, ej))
        return out

    def place_exchange(self, transport: Any, params: dict[str, torch.nn.Parameter], needed: list[str],
                       groups: InProcessGroups, tp_g: int) -> list[tuple[Any, Any, PlaneSpec]]:
        """As make_exchange_plan and reshard.assembly.place_exchange (tied: the output layer is the embedding)."""
        rank, cpu, lay, experts = transport.rank, torch.device("cpu"), self.lay, self.experts
        keys = keys_of([*params, *needed], tied=self.tied)
        held: dict[str, ParamInfo] = {}
        for info in self.member_info(rank, params, None).params:
            held.setdefault(keys[info.name], dataclasses.replace(info, name=keys[info.name]))
        ei, ei_g = (self.expert_coord[rank][0], self.rollout_expert[rank][0]) if experts is not None else (0, 0)
        mine = RankTensors(rank, self.coords[rank][0], tp_g, tuple(held.values()), tuple(keys[n] for n in needed),
                           ei, ei_g)
        xplan = build_exchange_plan(transport.all_gather_object(mine, groups.world), t=self.training[0],
                                    t_g=lay.t_g, et=experts.et if experts else 1, et_g=experts.et_g if experts else 1,
                                    is_expert=lambda key: expert_of(key) is not None)
        return [(ExchangePlacement(xplan, rank, params, lay, keys=keys, rollout_tp_rank=tp_g, device=cpu),
                 ExchangeExecutor(xplan, rank, groups, training_params=params, keys={n: keys[n] for n in params},
                                  device=cpu), self.planes(rank)[0])]

    def place(self, transport: Any, params: dict[str, torch.nn.Parameter], needed: list[str],
              groups: InProcessGroups, tp_g: int) -> list[tuple[Any, Any, PlaneSpec]]:
        """The placement and executor of this rank for each plane, built as the engine builds them."""
        if self.lay.exchange:
            return self.place_exchange(transport, params, needed, groups, tp_g)
        rank, cpu, out = transport.rank, torch.device("cpu"), []
        for plane in self.planes(rank):
            plan, index = None, 0
            if plane.gathers:  # as make_group_plan: the members' descriptions gathered, the same plan on each
                members = transport.all_gather_object(self.member_info(rank, params, plane),
                                                      groups.groups[plane.group])
                members.sort(key=lambda m: m.rank)
                index = [m.rank for m in members].index(rank)
                plan = build_group_plan(members, [n for n in needed if plane.holds(n)], k=plane.k, q=plane.q,
                                        u=plane.u, bucket_numel=self.bucket_numel,
                                        tied=self.plan_tied if plane.name == "dense" else None,
                                        strided=self.weight_mode != WeightMode.ALIASED,
                                        bucket_per_layer=plane.name == "experts")
            placement = Placement(plan, index, params, self.lay, rollout_tp_rank=tp_g, device=cpu)
            out.append((placement, None if plan is None else PlanExecutor(plan, index, groups, plane=plane.name,
                                                                          training_params=params, device=cpu), plane))
        return out

    def rank_body(self, transport: Any, switches: int, update: Optional[Any]) -> RankResult:
        """One rank: its training shards placed, ``switches`` switches (``update`` before the last), its rollout
        tensors (and FP8 weights) read back."""
        rank = transport.rank
        who = self.stand_in(rank)
        tp_g = who.rollout_coord[0]
        params = {n: _parameter(v, self.specs[n][1]) for n, v in self.shards_of(rank).items()}
        needed = self.probe.rollout_names(who)
        placed = self.place(transport, params, needed, InProcessGroups(transport, self.micro.get(rank, [rank]),
                                                                       self.micro_ep.get(rank, ())), tp_g)
        received = []
        for n in range(switches):
            if n:
                for placement, _, _ in placed:  # back to training, as switch_to_training does: the peers' slots go
                    placement.unmap_rollout()
            if update is not None and n == switches - 1:
                with torch.no_grad():
                    for name, prm in params.items():
                        update(name, prm.data)
            total = 0
            for placement, executor, _ in placed:
                placement.map_rollout()
                records = [] if executor is None else executor.run(
                    {dtype: buf.tensor for dtype, buf in placement.buffers.items()})
                total += sum(r.bytes_received for r in records)
            received.append(total)
        by_plane = {plane.name: placement for placement, _, plane in placed}

        def blocks(n: str) -> Any:
            return by_plane["experts" if expert_of(n) is not None and "experts" in by_plane else "dense"].blocks(n)

        rollout_tensors = {n: blocks(n).materialize() for n in needed}
        quantized = {}
        if self.weight_mode == RolloutWeights.FP8:  # as the binding's WeightQuantizer: from the blocks
            for n in needed:
                if is_target(n):
                    shape = rollout_tensors[n].shape
                    out = torch.empty(shape, dtype=FP8_DTYPE)
                    scale = torch.empty(shape[0], dtype=torch.float32)
                    quantize_rows(blocks(n), out, scale)
                    quantized[n] = (out, scale)
        return dataclasses.replace(who, rollout=rollout_tensors, bytes_received=received, fp8=quantized,
                                   placement=by_plane["dense"], expert_placement=by_plane.get("experts"))


def _quantized(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 with an fp32 scale per row, amax / 448 (1 for a zero row), written here from the format (not the
    engine's): the values w / scale rounded to the nearest e4m3 (torch's cast saturates nothing here: |w / scale|
    ≤ 448)."""
    w = w_NK.float()
    amax = w.abs().max(dim=1).values
    scale = amax / torch.tensor(448.0)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (w / scale[:, None]).to(torch.float8_e4m3fn), scale


def check_switch(result: SimulatedSwitch) -> list[str]:
    """Every way the simulated switch differs from the unsharded model (empty: none): a rollout tensor not bit
    for bit its shard, an FP8 rollout weight not the shard's quantization bit for bit, a rank receiving other than
    the bytes it misses."""
    faults = []
    for rank in result.ranks:
        want = result.expected(rank)
        if set(want) != set(rank.rollout):
            faults.append(f"rank {rank.rank}: rollout tensors {sorted(set(rank.rollout) ^ set(want))} differ in name")
        for name, value in want.items():
            got = rank.rollout.get(name)
            if got is not None and (got.shape != value.shape or not torch.equal(got, value)):
                faults.append(f"rank {rank.rank} {rank.coord} -> {rank.rollout_coord}: {name} differs")
        for name, (got_q, got_scale) in rank.fp8.items():  # against an independent write-up of the format
            want_q, want_scale = _quantized(want[name])
            if not (torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
                    and torch.equal(got_scale, want_scale)):
                faults.append(f"rank {rank.rank} {rank.coord} -> {rank.rollout_coord}: FP8 {name} differs")
        missing = result.missing_bytes(rank)
        for n, got_bytes in enumerate(rank.bytes_received):
            if got_bytes != missing:
                faults.append(f"rank {rank.rank}: switch {n + 1} received {got_bytes} bytes, it misses {missing}")
    return faults


# ---- the layout space, drawn ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Example:
    """One point of the space a sweep draws from: a model, a layout pair, a weight mode, optimizer steps."""

    arch: GPTArchitecture
    training: tuple[int, int, int]
    rollout: tuple[int, int]
    weight_mode: str
    steps: int
    """0 or 1: whether an (element-wise) update lands between the two switches."""
    chunks: int = 1
    """Virtual pipeline chunks a training stage."""
    expert_parallel: Optional[tuple[int, int]] = None
    """An MoE model's training (EP, expert TP) sizes; its ``rollout`` is then (t_g, p_g, e_g, et_g)."""

    def describe(self) -> dict[str, Any]:
        """A JSON-able record (the architecture's fields that differ from its defaults)."""
        defaults = GPTArchitecture(num_layers=1, hidden_size=1, num_attention_heads=1, vocab_size=1).to_dict()
        arch = {k: v for k, v in self.arch.to_dict().items()
                if k in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size") or v != defaults.get(k)}
        out = {"arch": arch, "training": list(self.training), "rollout": list(self.rollout),
               "weight_mode": self.weight_mode, "steps": self.steps, "chunks": self.chunks}
        if self.expert_parallel is not None:
            out["expert_parallel"] = list(self.expert_parallel)
        return out


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def draw_example(choose: Callable[[str, Sequence[Any]], Any], *, moe: bool = False, fp8: bool = False) -> Example:
    """An example, each field picked by ``choose(label, options)`` (a seeded ``random.Random``'s choice in
    ``bench/layout_sweep.py``, a Hypothesis draw in the tests): a world of 2-16 ranks, t in {1, 2, 4, 8}, p and
    d up to 4, and any (t_g, p_g) whose product divides the world; SwiGLU or GELU, RMSNorm or LayerNorm, QKV and
    linear biases, QK norm, RoPE or learned positions, MHA / GQA / MQA, tied or untied embeddings, a vocabulary
    that is no multiple of 128, 2-6 layers, 1 or 2 virtual chunks; aliased or canonical; 0 or 1 optimizer steps.
    ``moe``: then (after the same draws, so a dense example's draws stay what they were) the model gets routed
    experts (2, 4 or 8, top-1 or top-2, softmax or sigmoid scores, a shared expert with or without its gate, all
    layers MoE or mixed with dense ones) and the layouts expert sizes: EP and expert TP whose product divides
    t · d, rollout EP and expert TP. ``fp8``: the weight mode is ``"fp8"`` (canonical, FP8 rollout weights)
    whatever was drawn. Much of it is refused by the engine's validation (:func:`validate`), as it should be."""
    t = choose("t", [1, 2, 4, 8])  # TP sizes models are built with; PP and DP any size up to 16 ranks in all
    p = choose("p", [k for k in (1, 2, 3, 4) if t * k <= 16])
    d = choose("d", [k for k in (1, 2, 3, 4) if 2 <= t * p * k <= 16])
    world = t * p * d
    t_g = choose("t_g", _divisors(world))
    p_g = choose("p_g", _divisors(world // t_g))
    # The training model is one Megatron-LM can build (TP divides the heads, query groups and MLP, PP the layers):
    # what the engine must refuse or serve is the rollout layout.
    heads = choose("heads", [h for h in (4, 6, 8, 12, 16) if h % t == 0])
    groups = choose("query_groups", [g for g in _divisors(heads) if g % t == 0])
    kv = choose("kv_channels", [4, 8])
    arch = GPTArchitecture(
        num_layers=choose("num_layers", [n for n in range(2, 7) if n % p == 0] or [p]),
        hidden_size=choose("hidden_size", [32, 48, 64]), num_attention_heads=heads,
        num_query_groups=None if groups == heads else groups, kv_channels=kv,
        ffn_hidden_size=choose("ffn_hidden_size", [f for f in (48, 64, 96) if f % t == 0]),
        vocab_size=choose("vocab_size", [50, 97, 250]),
        make_vocab_size_divisible_by=choose("make_vocab_size_divisible_by", [1, 2, 8]),
        swiglu=choose("swiglu", [True, False]), normalization=choose("normalization", ["RMSNorm", "LayerNorm"]),
        add_qkv_bias=choose("add_qkv_bias", [False, True]), add_bias_linear=choose("add_bias_linear", [False, True]),
        qk_layernorm=choose("qk_layernorm", [False, True]),
        position_embedding_type=choose("position_embedding_type", ["rope", "learned_absolute"]),
        untie_embeddings_and_output_weights=choose("untie_embeddings_and_output_weights", [True, False]),
        max_position_embeddings=32)
    chunks = choose("virtual_chunks", [1, 2] if p > 1 and arch.num_layers % (2 * p) == 0 else [1])
    example = Example(arch, (t, p, d), (t_g, p_g), choose("weight_mode", [m.value for m in WeightMode]),
                      choose("steps", [0, 1]), chunks)
    if fp8:
        example = dataclasses.replace(example, weight_mode=RolloutWeights.FP8.value)
    return _with_experts(choose, example) if moe else example


def _with_experts(choose: Callable[[str, Sequence[Any]], Any], example: Example) -> Example:
    """``example`` with routed experts and expert layouts drawn (:func:`draw_example`'s ``moe``)."""
    (t, p, d), arch = example.training, example.arch
    experts = choose("num_experts", [2, 4, 8])
    topk = choose("moe_router_topk", [1, 2])
    score = choose("moe_router_score_function", ["softmax", "sigmoid"])
    shared = None if arch.add_bias_linear else choose("moe_shared_expert_intermediate_size", [None, 32, 48])
    pattern = choose("moe_layer_freq", ["all", "every other", "odd layers"])
    freq = {"all": 1, "every other": 2, "odd layers": [i % 2 for i in range(arch.num_layers)]}[pattern]
    arch = dataclasses.replace(
        arch, num_experts=experts, moe_router_topk=topk, moe_router_score_function=score,
        moe_router_pre_softmax=topk == 1 and score == "softmax", moe_ffn_hidden_size=choose("moe_ffn_hidden_size",
                                                                                             [16, 32, 48]),
        moe_shared_expert_intermediate_size=shared, moe_layer_freq=freq,
        moe_shared_expert_gate=shared is not None and choose("moe_shared_expert_gate", [False, True]))
    e = choose("e", [k for k in _divisors(t * d) if experts % k == 0])
    et = 1 if arch.add_bias_linear else choose("et", _divisors(t * d // e))  # megatron-core: biases need et = 1
    e_g = choose("e_g", 3 * _divisors(e) + [2 * e])  # now and then one the engine must refuse
    et_g = choose("et_g", _divisors(et))
    # Half the draws keep the free rollout sizes (exchange layouts mostly, or refused), half draw in-place ones
    # (t_g | t, p_g | p: the micro-EP gather).
    t_g, p_g = example.rollout
    if choose("moe_rollout", ["free", "in place"]) == "in place":
        t_g, p_g = choose("moe_t_g", _divisors(t)), choose("moe_p_g", _divisors(p))
    return dataclasses.replace(example, arch=arch, rollout=(t_g, p_g, e_g, et_g), expert_parallel=(e, et))


def elementwise_step(name: str, tensor: torch.Tensor) -> None:
    """The optimizer step's stand-in (:func:`simulate_switch`'s ``update``): element-wise, so a shard and the full
    tensor get the same bits, and no value stays as it was."""
    tensor.mul_(0.5).add_(0.25)


def run_example(example: Example) -> dict[str, Any]:
    """One example: ``{"status": "refused", "reason": ...}`` (the engine's validation said no),
    ``{"status": "ok"}`` or ``{"status": "fault", "faults": [...]}``, with the bytes moved per rank."""
    rollout = RolloutLayout(*example.rollout)
    try:
        validate(example.arch, example.training, rollout, weight_mode=example.weight_mode, chunks=example.chunks,
                 expert_parallel=example.expert_parallel)
    except ValueError as exc:
        return {"status": "refused", "reason": str(exc)}
    result = simulate_switch(example.arch, example.training, rollout, weight_mode=example.weight_mode, switches=2,
                             update=elementwise_step if example.steps else None, chunks=example.chunks,
                             expert_parallel=example.expert_parallel)
    faults = check_switch(result)
    out: dict[str, Any] = {"status": "fault" if faults else "ok", "exchange": result.layout.exchange,
                           "bytes_received": [r.bytes_received[-1] for r in result.ranks]}
    if faults:
        out["faults"] = faults[:20]
    return out


__all__ = ["Example", "RankResult", "SimulatedSwitch", "check_switch", "draw_example", "elementwise_step",
           "gpt_parameters", "run_example", "simulate_switch", "unsharded_model", "validate"]
