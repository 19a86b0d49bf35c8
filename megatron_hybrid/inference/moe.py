"""Mixture-of-experts layers during a generation step: dropless, on the device, without a host sync.

megatron-core's ``MoELayer`` asks the host how many tokens each local expert got (``tokens_per_expert.cpu()`` in its
token dispatcher, ``.tolist()`` in ``SequentialMLP``), so a step with an MoE layer cannot run in a CUDA graph.
:class:`StepMoELayer` keeps the module (router, experts, shared experts and their parameters, aliased or not) and,
while its stage's :class:`~.context.StepContext` holds a step, computes what megatron-core 0.16.1's ``MoELayer``
computes without token dropping, with every size fixed by the step's shape:

- routing (:func:`route`): the router's own gating GEMM (``TopKRouter.gating``: its ``moe_router_dtype``), then
  megatron's ``topk_routing_with_score_function`` as ``[T, k]`` tensors: softmax after top-k (renormalised) or
  before it (``moe_router_pre_softmax``), or sigmoid with the expert bias for the choice only, renormalised for
  k > 1; group-limited top-k; the top-k scaling factor;
- dispatch as the all-gather token dispatcher's (``MoEAllGatherTokenDispatcher``; with the all-to-all dispatcher the
  same sums in another order): over the layer's ``tp_ep`` group (expert tensor x expert parallel, read from its
  dispatcher) every rank gathers all tokens and their routing (one ``all_gather_into_tensor`` of rows packed as
  bytes), runs its local experts on the pairs routed to them, and a reduce-scatter (in the router's dtype, as
  megatron's) sums the experts' (and the expert-TP ranks' partial) outputs back onto the ranks that hold the
  tokens. With expert tensor parallelism the expert-TP ranks of a replica hold the same tokens (no sequence
  parallelism in generation), so, as in megatron's dispatcher, their copies are gathered and computed et times;
- the token-expert pairs sorted by local expert on the device (a stable ``argsort``: the order of megatron's
  ``permute``, expert-major and token-ascending), the group offsets by ``searchsorted`` on the sorted keys (int32,
  on the device; ``bincount`` would read its size from the device on a GPU); pairs for other ranks' experts sort
  last and add into a discarded row;
- the experts (:func:`grouped_experts`): ``torch._grouped_mm`` over 3-D views of the experts' weights where they lie
  in one storage at a uniform stride (:class:`ExpertStack`), activation and routing probabilities as megatron's
  ``MLP`` (probabilities after the activation, before ``linear_fc2``, or on the input with
  ``moe_apply_probs_on_input``); otherwise :func:`sequential_experts`, the same signature calling each expert's own
  ``MLP`` (its linear modules, aliased twins included), which reads the group sizes on the host;
- the shared experts (and their gate) through the module itself, added last.

With ``GenerationConfig.record_routing`` the step writes each token's top-k experts into the stage's record at the
token's slot and position (:attr:`~.context.KVStep.routed_experts`, one fixed-address plane per MoE layer, layer
``moe_index`` of the stage): the rollout's routing, which routing replay hands to the training routers. A router
built with ``moe_enable_routing_replay`` routes here by its own logits as without it (generation never replays).
MoE layers are named across pipeline stages by their ordinal among the model's MoE layers
(:func:`moe_layer_ordinals`).

Several rollout replicas in one expert-parallel group (an EP group wider than the replica's tensor-parallel group)
must gather the same number of rows in every forward: each step carries the rows the group agreed on
(:attr:`~.context.KVStep.moe_rows`, see :mod:`.replica`), to which a layer pads its tokens (padded rows route to
no expert), and a replica with nothing to run joins with :meth:`StepMoELayer.idle_step`.

Legend: T tokens of this rank, R rows gathered over the group (group size x padded T), k experts per token,
E experts, L local experts, H hidden, F an expert's fc1 outputs on this expert-TP rank, P = R x k pairs.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import group_limited_topk

from ..reshard import gather_rows, reduce_scatter_rows
from .context import KVStep, StepContext

__all__ = ["ExpertStack", "StepMoELayer", "grouped_experts", "grouped_mm_supported", "install_step_moe",
           "moe_layer_ordinals", "route", "sequential_experts", "stacked_view"]


def moe_layer_ordinals(num_layers: int, moe_layer_freq) -> list[Optional[int]]:
    """Per layer of the model (0-based), its ordinal among the MoE layers, or None for a dense layer, from
    megatron-core's ``moe_layer_freq`` as its layer specs read it (N: layers 0, N, 2N, ... are MoE; a list of 0/1
    per layer)."""
    if isinstance(moe_layer_freq, int):
        pattern = [int(i % moe_layer_freq == 0) for i in range(num_layers)]
    else:
        pattern = list(moe_layer_freq)
    assert len(pattern) == num_layers, (pattern, num_layers)
    out, n = [], 0
    for is_moe in pattern:
        out.append(n if is_moe else None)
        n += int(bool(is_moe))
    return out


def route(router, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``router`` (megatron-core's ``TopKRouter``) on tokens ``x_TH``: the top-k probabilities ``[T, k]`` (in the
    router's dtype) and experts ``[T, k]`` (int64), the values megatron's ``topk_routing_with_score_function``
    scatters into its dense ``[T, E]`` map (the same operations, so the same bits)."""
    cfg = router.config
    router._maintain_float32_expert_bias()  # as TopKRouter.forward: a bias cast to bf16 by Float16Module goes back
    logits = router.gating(x_TH)  # the router's dtype handling (moe_router_dtype), megatron's own GEMM
    k, num_groups, group_topk = router.topk, cfg.moe_router_num_groups, cfg.moe_router_group_topk

    def topk(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if group_topk:
            return group_limited_topk(scores, k, scores.shape[0], scores.shape[1], num_groups, group_topk)
        return torch.topk(scores, k=k, dim=1)

    if router.score_function == "softmax":
        if cfg.moe_router_pre_softmax:
            probs, experts = topk(torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits))
        else:
            top, experts = topk(logits)
            probs = torch.softmax(top, dim=-1, dtype=torch.float32).type_as(logits)
    else:  # sigmoid; the expert bias steers the choice only
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if router.expert_bias is not None:
            _, experts = topk(scores + router.expert_bias)
            top = torch.gather(scores, dim=1, index=experts).type_as(logits)
        else:
            top, experts = topk(scores)
        probs = top / (top.sum(dim=-1, keepdim=True) + 1e-20) if k > 1 else top
    if cfg.moe_router_topk_scaling_factor:
        probs = probs * cfg.moe_router_topk_scaling_factor
    return probs, experts


@functools.lru_cache(maxsize=None)
def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` takes ``[rows, K] x [groups, K, N]`` of ``dtype`` with int32 offsets on
    ``device`` and equals per-group matrix products there (probed once: torch 2.13 on a CPU takes float32 and
    bfloat16; torch 2.11 on an H200 bfloat16)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 16, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(3, 24, 16, generator=g).to(device=device, dtype=dtype)
    offs = torch.tensor([5, 5, 12], dtype=torch.int32, device=device)
    try:
        out = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    ref = torch.cat([x[:5] @ w[0].T, x[5:] @ w[2].T])
    return bool(torch.allclose(out[:12].float(), ref.float(), rtol=1e-2, atol=1e-2))


def stacked_view(tensors: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """``[L, ...]``: one view of ``tensors`` (same shape, dtype and strides, contiguous) when they lie in one storage
    at a uniform stride, without overlapping; None otherwise (separate allocations, an aliased placeholder). On a
    GPU the view's base and stride are 16-byte aligned too (what grouped GEMMs read)."""
    first = tensors[0]
    if not first.is_contiguous() or first.numel() == 0:
        return None
    if first.device.type == "cuda" and (first.data_ptr() % 16 or (len(tensors) > 1 and (
            (tensors[1].data_ptr() - first.data_ptr()) % 16))):
        return None
    if len(tensors) == 1:
        return first.unsqueeze(0)
    base = first.untyped_storage().data_ptr()
    step = tensors[1].storage_offset() - first.storage_offset()
    if step < first.numel():
        return None
    for i, t in enumerate(tensors):
        if (t.shape != first.shape or t.dtype != first.dtype or t.device != first.device or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != base or t.storage_offset() != first.storage_offset() + i * step):
            return None
    return first.as_strided((len(tensors), *first.shape), (step, *first.stride()), first.storage_offset())


class ExpertStack:
    """The local experts of one ``SequentialMLP`` as 3-D weight views for grouped GEMMs, when their per-expert
    tensors allow (:meth:`weights`), and the activation of megatron's ``MLP`` for them.

    The views are remade when a weight's address changes (the engine keeps them at fixed addresses across switches,
    so in practice once); a CUDA graph captured over them reads those addresses.
    """

    def __init__(self, experts: SequentialMLP) -> None:
        self.experts = experts
        self.config = experts.local_experts[0].config
        self._fc1 = [e.linear_fc1 for e in experts.local_experts]
        self._fc2 = [e.linear_fc2 for e in experts.local_experts]
        self._key: Optional[tuple] = None
        self._weights: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def weights(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """``(W1 [L, F, H], W2 [L, H, F'])`` as views of the experts' weights, or None (no such views, biases, or no
        grouped GEMM for their device and dtype): then :func:`sequential_experts` runs them."""
        fc1, fc2 = self._fc1, self._fc2
        tensors = [m.weight for m in fc1] + [m.weight for m in fc2]
        key = tuple(t.data_ptr() for t in tensors) + (tensors[0].dtype, tuple(tensors[0].stride()))
        if key != self._key:
            self._key, self._weights = key, None
            biased = any(getattr(m, "bias", None) is not None for m in fc1 + fc2)
            first = tensors[0]
            if not biased and grouped_mm_supported(first.device, first.dtype):
                w1, w2 = stacked_view([m.weight for m in fc1]), stacked_view([m.weight for m in fc2])
                if w1 is not None and w2 is not None:
                    self._weights = (w1, w2)
        return self._weights

    def activation(self, h_PF: torch.Tensor) -> torch.Tensor:
        """megatron-core ``MLP``'s unfused activation (gated: ``act(x_glu) * (x_linear + offset)``, clamped when
        configured)."""
        cfg = self.config
        if not cfg.gated_linear_unit:
            return cfg.activation_func(h_PF)
        x_glu, x_linear = torch.chunk(h_PF, 2, dim=-1)
        clamp = getattr(cfg, "activation_func_clamp_value", None)
        if clamp is not None:
            x_glu = x_glu.clamp(min=None, max=clamp)
            x_linear = x_linear.clamp(min=-clamp, max=clamp)
        return cfg.activation_func(x_glu) * (x_linear + getattr(cfg, "glu_linear_offset", 0.0))


def grouped_experts(x_PH: torch.Tensor, probs_P: torch.Tensor, offs_L: torch.Tensor,
                    stack: ExpertStack) -> torch.Tensor:
    """The local experts on pairs sorted by expert: rows ``offs[i-1] .. offs[i]`` of ``x_PH`` go through expert
    i, scaled by ``probs_P`` after the activation (megatron's ``per_token_scale``). Two grouped GEMMs over the
    stack's weights; rows past ``offs[-1]`` come out undefined. Capturable."""
    w1, w2 = stack.weights()
    h = torch._grouped_mm(x_PH, w1.transpose(1, 2), offs=offs_L)
    h = stack.activation(h)
    h = (h * probs_P.unsqueeze(-1)).to(h.dtype)
    return torch._grouped_mm(h, w2.transpose(1, 2), offs=offs_L)


def sequential_experts(x_PH: torch.Tensor, probs_P: torch.Tensor, offs_L: torch.Tensor,
                       stack: ExpertStack) -> torch.Tensor:
    """:func:`grouped_experts` by each expert's own ``MLP`` (its linear modules, aliased or not), as
    ``SequentialMLP`` runs them: the reference, and the path for weights that are not one storage. Reads the group
    offsets on the host (not capturable)."""
    bounds = [0, *offs_L.tolist()]
    out = x_PH.new_empty(x_PH.shape[0], stack.config.hidden_size)
    for i, expert in enumerate(stack.experts.local_experts):
        lo, hi = bounds[i], bounds[i + 1]
        if hi > lo:
            out[lo:hi], _ = expert(x_PH[lo:hi], probs_P[lo:hi])
    return out


def _pack(parts: list[torch.Tensor]) -> torch.Tensor:
    """Row-aligned tensors ``[N, ...]`` as one ``[N, bytes]`` uint8 tensor (one collective for all of them)."""
    return torch.cat([p.contiguous().view(p.shape[0], -1).view(torch.uint8) for p in parts], dim=1)


def _unpack(packed: torch.Tensor, likes: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    out, at = [], 0
    for dtype, shape in likes:
        width = dtype.itemsize * (torch.Size(shape).numel())
        out.append(packed[:, at: at + width].contiguous().view(dtype).view(packed.shape[0], *shape))
        at += width
    return out


class StepMoELayer(MoELayer):
    """megatron-core's ``MoELayer`` that runs a graph-capturable dropless step while its ``step_context`` holds a
    step (see the module docstring); megatron-core's own forward otherwise."""

    step_context: Optional[StepContext] = None  # the stage's, given once by install_step_moe
    expert_stack: Optional[ExpertStack] = None
    moe_index: int = 0  # index of this layer among the stage's MoE layers (its routing record)

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        step = self.step_context.kv if self.step_context is not None else None
        if step is None or intermediate_tensors is not None:
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        return self.step_forward(hidden_states, rows=step.moe_rows, step=step), None

    @property
    def group(self):
        """The expert tensor x expert parallel group (megatron's ``tp_ep``), over which tokens are gathered."""
        return self.token_dispatcher.tp_ep_group

    def experts_path(self) -> Callable[..., torch.Tensor]:
        """:func:`grouped_experts` where the experts' weights allow, else :func:`sequential_experts`."""
        return grouped_experts if self.expert_stack.weights() is not None else sequential_experts

    def step_forward(self, hidden_SBH: torch.Tensor, *, rows: int = 0,
                     step: Optional[KVStep] = None) -> torch.Tensor:
        """The layer on ``hidden_SBH`` (``[T, 1, H]`` packed tokens), its collectives over ``rows`` padded rows per
        rank when ``rows`` (the rows its expert-parallel group agreed on for this step, at least T); the tokens'
        experts recorded at their slots and positions when ``step`` carries a record."""
        x_TH = hidden_SBH.reshape(-1, hidden_SBH.shape[-1])
        shared = self.shared_experts(hidden_SBH) if self.shared_experts is not None else None
        probs_Tk, experts_Tk = route(self.router, x_TH)
        if step is not None and step.routed_experts is not None:  # an index_put_ at device indices: capturable
            record = step.routed_experts[self.moe_index]
            record.index_put_((step.slots_T, step.positions_T), experts_Tk.to(record.dtype))
        out = self._routed(x_TH, probs_Tk, experts_Tk, max(rows, x_TH.shape[0])).view(hidden_SBH.shape)
        return out + shared if shared is not None else out

    def idle_step(self, rows: int) -> None:
        """This rank has no tokens in a step of its expert-parallel group: join the group's collectives with
        ``rows`` padded rows (routed to no expert), running the local experts on the other ranks' tokens."""
        hidden, k = self.config.hidden_size, self.router.topk
        device, dtype = self.router.weight.device, self.config.params_dtype
        x_TH = torch.zeros(0, hidden, dtype=dtype, device=device)
        probs = torch.zeros(0, k, dtype=self._router_dtype(dtype), device=device)
        self._routed(x_TH, probs, torch.zeros(0, k, dtype=torch.long, device=device), rows)

    def _router_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, dtype)

    def _routed(self, x_TH: torch.Tensor, probs_Tk: torch.Tensor, experts_Tk: torch.Tensor,
                rows: int) -> torch.Tensor:
        """The routed experts' output ``[T, H]`` for this rank's tokens, gathering ``rows`` (>= T) per rank."""
        T, H = x_TH.shape
        k = probs_Tk.shape[1]
        assert rows >= T, (rows, T)
        if rows > T:  # padded rows: zero tokens routed to no expert (-1 is no rank's)
            x_TH = torch.cat([x_TH, x_TH.new_zeros(rows - T, H)])
            probs_Tk = torch.cat([probs_Tk, probs_Tk.new_zeros(rows - T, k)])
            experts_Tk = torch.cat([experts_Tk, experts_Tk.new_full((rows - T, k), -1)])
        group = self.group
        size = group.size()
        if size > 1:
            packed = gather_rows(_pack([x_TH, probs_Tk, experts_Tk.to(torch.int32)]), group)
            x_RH, probs_Rk, experts_Rk = _unpack(packed, [(x_TH.dtype, (H,)), (probs_Tk.dtype, (k,)),
                                                          (torch.int32, (k,))])
        else:
            x_RH, probs_Rk, experts_Rk = x_TH, probs_Tk, experts_Tk
        R, L = x_RH.shape[0], self.num_local_experts
        local = experts_Rk.long() - self.local_expert_indices[0]
        key_P = torch.where((local >= 0) & (local < L), local, L).view(-1)  # L: another rank's expert, or none
        order_P = torch.argsort(key_P, stable=True)  # expert-major, token-ascending: megatron's permute order
        key_P = key_P[order_P]
        offs_L = torch.searchsorted(key_P, torch.arange(1, L + 1, device=key_P.device), out_int32=True)
        token_P = torch.div(order_P, k, rounding_mode="floor")
        x_PH = x_RH.index_select(0, token_P)
        probs_P = probs_Rk.reshape(-1).index_select(0, order_P)
        if self.config.moe_apply_probs_on_input:  # SequentialMLP's: the probabilities scale the input instead
            x_PH = (probs_P.unsqueeze(-1) * x_PH).to(x_RH.dtype)
            probs_P = torch.ones_like(probs_P)
        y_PH = self.experts_path()(x_PH, probs_P, offs_L, self.expert_stack)
        # megatron's unpermute sums each token's pairs into it in pair order (by expert) with a scatter-add, which
        # adds atomically on a GPU: the order, hence the bits, would vary from run to run (top-k > 2). Instead each
        # token's k pairs are gathered, still by expert (a stable sort by token keeps the expert order), and added
        # one after another: megatron's order and roundings on a CPU, the same bits on every run. Other ranks'
        # pairs (and undefined rows past offs[-1]) add zeros.
        y_PH = torch.where((key_P < L).unsqueeze(-1), y_PH, 0)
        y_RkH = y_PH.index_select(0, torch.argsort(token_P, stable=True)).view(R, k, H)
        out_RH = y_RkH[:, 0]
        for j in range(1, k):
            out_RH = out_RH + y_RkH[:, j]
        if size > 1:  # in the probabilities' dtype, as the all-gather dispatcher's token_combine
            out_RH = reduce_scatter_rows(out_RH.to(probs_Rk.dtype), group).to(y_PH.dtype)
        return out_RH[:T]


def _unsupported(layer: MoELayer) -> Optional[str]:
    """Why :class:`StepMoELayer` cannot stand in for ``layer`` (None when it can)."""
    cfg = layer.config
    checks = [
        (not isinstance(layer.experts, SequentialMLP),
         f"experts of type {type(layer.experts).__name__} (SequentialMLP only: moe_grouped_gemm=False)"),
        (cfg.moe_expert_capacity_factor is not None,
         f"moe_expert_capacity_factor={cfg.moe_expert_capacity_factor} (token dropping)"),
        (cfg.moe_router_load_balancing_type == "sinkhorn", "moe_router_load_balancing_type='sinkhorn'"),
        (cfg.moe_input_jitter_eps is not None, f"moe_input_jitter_eps={cfg.moe_input_jitter_eps}"),
        (getattr(cfg, "moe_router_force_load_balancing", False), "moe_router_force_load_balancing=True"),
        (cfg.moe_shared_expert_overlap, "moe_shared_expert_overlap=True"),
        (getattr(cfg, "moe_latent_size", None), f"moe_latent_size={getattr(cfg, 'moe_latent_size', None)}"),
        (cfg.fp8 or getattr(cfg, "fp4", None), "fp8/fp4 experts"),
    ]
    for bad, what in checks:
        if bad:
            return what
    return None


def install_step_moe(chunk: torch.nn.Module, context: StepContext) -> list[StepMoELayer]:
    """Swap the class of every layer's ``MoELayer`` in ``chunk`` (a GPTModel stage) for :class:`StepMoELayer`,
    reading its steps from ``context``; returns them in layer order (none for a dense stage). Idempotent. Outside a
    step they compute exactly what megatron-core's ``MoELayer`` computes."""
    out = []
    for i, layer in enumerate(chunk.decoder.layers):
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, MoELayer):
            continue
        if type(mlp) is not MoELayer and not isinstance(mlp, StepMoELayer):
            raise ValueError(f"layer {i}'s mlp is a {type(mlp).__name__} (an MoELayer subclass): generation would "
                             "drop what it overrides")
        why = _unsupported(mlp)
        if why is not None:
            raise ValueError(f"generation's MoE step does not support {why} (layer {i})")
        if type(mlp) is MoELayer:
            mlp.__class__ = StepMoELayer
            mlp.expert_stack = ExpertStack(mlp.experts)
        mlp.step_context = context
        mlp.moe_index = len(out)
        out.append(mlp)
    return out
