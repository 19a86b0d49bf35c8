"""The space of layout pairs, architectures, weight modes and optimizers that the engine claims, as data.

A :class:`LayoutExample` is one point: a world size, a training layout (t, p, d, virtual chunks; with experts
e, et), a rollout layout (t_g, p_g; e_g, et_g), a tiny architecture, a weight mode and an optimizer.
:func:`examples` is its ``hypothesis`` strategy (imported only when called): every example it draws is a model
Megatron can build at both layouts, so an engine refusal of one is a finding like a wrong weight.
:mod:`megatron_hybrid.testing.layout_check` runs one. Pure data and arithmetic, no ``torch.distributed``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

WEIGHT_MODES = ("aliased", "canonical", "fp8")
"""``fp8``: canonical mode with FP8 rollout weights (``rollout_weights="fp8"``)."""
OPTIMIZERS = ("sgd", "adam")
"""``sgd``: torch's SGD on the plain model; ``adam``: megatron-core's Adam in Megatron DDP with the distributed
optimizer."""
HIDDEN, HEADS, FFN, MOE_FFN = 64, 8, 128, 32
MAX_LAYERS = 8
"""2–6 layers, and 7 or 8 where a layout needs them (7 or 8 stages, 4 stages of 2 virtual chunks)."""


@dataclass(frozen=True)
class LayoutExample:
    """One point of the space (see the module docstring)."""

    world: int
    t: int
    p: int
    t_g: int
    p_g: int
    vpp: Optional[int] = None
    """Virtual pipeline chunks per training stage (None: one)."""
    num_layers: int = 2
    swiglu: bool = True
    normalization: str = "RMSNorm"
    qkv_bias: bool = False
    linear_bias: bool = False
    num_query_groups: int = HEADS
    """8: multi-head attention; 1: multi-query; between: grouped-query."""
    tied: bool = False
    vocab_size: int = 100
    num_experts: Optional[int] = None
    topk: int = 1
    shared_expert: bool = False
    moe_layers: Optional[tuple[int, ...]] = None
    """Per layer, 1 for an MoE layer (with experts)."""
    e: int = 1
    et: Optional[int] = None
    e_g: int = 1
    et_g: Optional[int] = None
    mode: str = "aliased"
    optimizer: str = "sgd"

    @property
    def d(self) -> int:
        return self.world // (self.t * self.p)

    @property
    def exchange(self) -> bool:
        """Whether the engine serves the pair with the exchange plan: outside the micro-DP gather contract
        (:meth:`ParallelLayout.gathers_in_place`), with virtual pipeline chunks, and for an MoE model also where the
        rollout TP widens or a rollout expert shard does not nest in training ones."""
        if self.p % self.p_g or self.vpp is not None:
            return True
        if self.num_experts is not None and (self.t_g > self.t or self.e % self.e_g
                                             or (self.et or self.t) % (self.et_g or self.t_g)):
            return True
        if self.t_g <= self.t:
            return self.t % self.t_g != 0
        return not (self.t_g % self.t == 0 and self.d % (self.t_g // self.t) == 0 and self.p_g == self.p)

    def architecture(self, *, tensor_model_parallel_size: Optional[int] = None):
        """The :class:`~megatron_hybrid.models.GPTArchitecture`. The vocabulary pads to a multiple of 16 × t at
        every TP size: ``tensor_model_parallel_size`` = 1 (the unsharded reference) pads as the training layout."""
        from megatron_hybrid.models import GPTArchitecture

        pad = 16 * self.t // (tensor_model_parallel_size or self.t)
        moe: dict[str, Any] = {}
        if self.num_experts is not None:
            moe = dict(num_experts=self.num_experts, moe_router_topk=self.topk, moe_ffn_hidden_size=MOE_FFN,
                       moe_layer_freq=list(self.moe_layers), moe_router_pre_softmax=self.topk == 1,
                       moe_shared_expert_intermediate_size=MOE_FFN if self.shared_expert else None)
        return GPTArchitecture(
            num_layers=self.num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
            num_query_groups=self.num_query_groups, ffn_hidden_size=FFN, vocab_size=self.vocab_size,
            make_vocab_size_divisible_by=pad, max_position_embeddings=64, swiglu=self.swiglu,
            normalization=self.normalization, add_qkv_bias=self.qkv_bias, add_bias_linear=self.linear_bias,
            untie_embeddings_and_output_weights=not self.tied, **moe)

    def rollout_kwargs(self) -> dict[str, Any]:
        """``RolloutLayout``'s arguments."""
        out: dict[str, Any] = dict(tensor_model_parallel_size=self.t_g, pipeline_model_parallel_size=self.p_g)
        if self.num_experts is not None:
            out.update(expert_model_parallel_size=self.e_g, expert_tensor_parallel_size=self.et_g)
        return out

    def parallel_kwargs(self) -> dict[str, Any]:
        """``initialize_model_parallel``'s sizes (the rank pool's keywords)."""
        return dict(tensor_model_parallel_size=self.t, pipeline_model_parallel_size=self.p,
                    virtual_pipeline_model_parallel_size=self.vpp, expert_model_parallel_size=self.e,
                    expert_tensor_parallel_size=self.et)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        """One line that rebuilds the example: ``LayoutExample(**{...})``."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if getattr(self, f.name) != f.default or f.name in ("world", "t", "p", "t_g", "p_g")}
        return f"LayoutExample(**{fields!r})"


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _layer_counts(train_stages: int, rollout_stages: int) -> list[int]:
    """Depths that both layouts split evenly: 2–6 layers, else 7 or 8 where the stages need them."""
    step = math.lcm(train_stages, rollout_stages)
    return [n for n in range(2, 7) if n % step == 0] or [n for n in (7, MAX_LAYERS) if n % step == 0]


def examples(*, experts: Optional[bool] = None, max_world: int = 8):
    """The ``hypothesis`` strategy of :class:`LayoutExample`. ``experts``: only MoE (True), only dense (False) or
    both (None); ``max_world``: the largest world size drawn (from 2)."""
    from hypothesis import strategies as st

    @st.composite
    def draw_example(draw) -> LayoutExample:
        world = draw(st.integers(2, max_world))
        tp_sizes = [k for k in _divisors(world) if HEADS % k == 0]  # TP splits the heads (8)
        t = draw(st.sampled_from(tp_sizes))
        p = draw(st.sampled_from([p for p in _divisors(world // t) if p <= MAX_LAYERS]))
        vpp = draw(st.sampled_from([None, 2])) if 2 <= p <= MAX_LAYERS // 2 else None
        t_g = draw(st.sampled_from(tp_sizes))
        p_g = draw(st.sampled_from([k for k in _divisors(world // t_g) if _layer_counts(p * (vpp or 1), k)]))
        num_layers = draw(st.sampled_from(_layer_counts(p * (vpp or 1), p_g)))
        groups = draw(st.sampled_from([g for g in _divisors(HEADS) if g % math.lcm(t, t_g) == 0]))
        vocab = draw(st.integers(60, 250).filter(lambda v: v % 128))
        arch = dict(num_layers=num_layers, swiglu=draw(st.booleans()),
                    normalization=draw(st.sampled_from(["RMSNorm", "LayerNorm"])), qkv_bias=draw(st.booleans()),
                    linear_bias=draw(st.booleans()), num_query_groups=groups, tied=draw(st.booleans()),
                    vocab_size=vocab)
        moe: dict[str, Any] = {}
        with_experts = draw(st.booleans()) if experts is None else experts
        if with_experts:
            num_experts = draw(st.sampled_from([2, 4, 8]))
            per_stage = world // p  # Megatron's expert grid: et × e × expert-DP ranks in every stage
            et = draw(st.sampled_from([k for k in _divisors(per_stage) if MOE_FFN % k == 0]))
            e = draw(st.sampled_from([k for k in _divisors(per_stage // et) if num_experts % k == 0]))
            # The rollout expert grid splits each rollout stage's ranks the same way, nested in training's or not
            # (then an exchange layout).
            per_rollout_stage = world // p_g
            et_g = draw(st.sampled_from([k for k in _divisors(per_rollout_stage) if MOE_FFN % k == 0]))
            e_g = draw(st.sampled_from([k for k in _divisors(per_rollout_stage // et_g) if num_experts % k == 0]))
            moe_layers = tuple(draw(st.lists(st.integers(0, 1), min_size=num_layers, max_size=num_layers)
                                    .filter(any)))
            shared_expert = draw(st.booleans())
            # megatron-core builds biased experts only without expert TP ("Bias in Moe is only supported when
            # ETP==1", in both layouts) and never a biased shared expert.
            arch["linear_bias"] = arch["linear_bias"] and et == et_g == 1 and not shared_expert
            moe = dict(num_experts=num_experts, topk=draw(st.integers(1, min(4, num_experts))),
                       shared_expert=shared_expert, moe_layers=moe_layers, e=e, et=et, e_g=e_g, et_g=et_g)
        mode = draw(st.sampled_from(WEIGHT_MODES))
        optimizer = draw(st.sampled_from(OPTIMIZERS))
        return LayoutExample(world=world, t=t, p=p, t_g=t_g, p_g=p_g, vpp=vpp, mode=mode, optimizer=optimizer,
                             **arch, **moe)

    return draw_example()


def draw(n: int, *, seed: int, experts: Optional[bool] = None, max_world: int = 8) -> list[LayoutExample]:
    """``n`` distinct examples of :func:`examples`, the same for the same ``seed``, ordered by world size and
    training layout (so that runs of one layout share their ranks' setup)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as with_seed

    found: dict[LayoutExample, None] = {}

    @with_seed(seed)
    @settings(max_examples=4 * n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(examples(experts=experts, max_world=max_world))
    def collect(ex: LayoutExample) -> None:
        if len(found) < n:
            found[ex] = None

    collect()
    return sorted(found, key=lambda ex: (ex.world, ex.t, ex.p, ex.vpp or 1, ex.e, ex.et or 0))


SIMPLER: dict[str, Any] = dict(vpp=None, swiglu=False, normalization="RMSNorm", qkv_bias=False, linear_bias=False,
                               num_query_groups=HEADS, tied=False, vocab_size=100, topk=1, shared_expert=False,
                               mode="aliased", optimizer="sgd")
"""What :func:`shrink` tries first for each field: the plainest value."""


def simpler(ex: LayoutExample) -> list[LayoutExample]:
    """Examples one step simpler than ``ex`` (one field plainer, fewer layers or experts), each still a model both
    layouts can build."""
    out = []
    for name, plain in SIMPLER.items():
        if getattr(ex, name) != plain:
            out.append(dataclasses.replace(ex, **{name: plain}))
    stages = math.lcm(ex.p * (ex.vpp or 1), ex.p_g)
    for layers in _layer_counts(ex.p * (ex.vpp or 1), ex.p_g):
        if layers < ex.num_layers and layers % stages == 0:
            moe = ex.moe_layers[:layers] if ex.moe_layers is not None else None
            if moe is None or any(moe):
                out.append(dataclasses.replace(ex, num_layers=layers, moe_layers=moe))
    if ex.moe_layers is not None and sum(ex.moe_layers) > 1:
        first = ex.moe_layers.index(1)
        out.append(dataclasses.replace(ex, moe_layers=tuple(int(i == first) for i in range(ex.num_layers))))
    if ex.num_experts is not None and ex.num_experts > max(ex.e, ex.e_g, ex.topk, 2):
        fewer = ex.num_experts // 2
        if fewer % ex.e == 0 and fewer % ex.e_g == 0 and fewer >= ex.topk:
            out.append(dataclasses.replace(ex, num_experts=fewer))
    return [o for o in out if o != ex]


def shrink(ex: LayoutExample, fails: Callable[[LayoutExample], bool], *, budget: int = 40) -> LayoutExample:
    """The simplest example reached from a failing ``ex`` by :func:`simpler` steps that still fail (greedy, at
    most ``budget`` calls of ``fails``): what a reader should debug first."""
    calls = 0
    improved = True
    while improved and calls < budget:
        improved = False
        for candidate in simpler(ex):
            if calls >= budget:
                break
            calls += 1
            if fails(candidate):
                ex, improved = candidate, True
                break
    return ex
