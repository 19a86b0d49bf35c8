"""The layout constraints, one table: every rule that relates the training and rollout parallel sizes to each other,
to the world and to the model's shape, with the error it raises.

Legend (as :mod:`megatron_hybrid.layout`'s): t, p, d the training tensor-, pipeline- and data-parallel sizes; e, et
the training expert-parallel and expert tensor-parallel sizes, edp the expert data-parallel size; t_g, p_g, e_g,
et_g the rollout ones; world the number of ranks. The model's quantities carry megatron-core's
``TransformerConfig`` names (``num_moe_experts``; ``moe_ffn_hidden_size``, which megatron-core defaults to
``ffn_hidden_size``); ``padded_vocab_size`` is the vocabulary as the model holds it.

A :class:`Rule` reads a :class:`Sizes`, in which a quantity a caller does not know is ``None``: a rule applies only
where every quantity it relates is known, the model is of its kind (``moe``) and the rollout layout of its kind
(``exchange``: in place or exchanged). The engine (:mod:`megatron_hybrid.layout`, :mod:`megatron_hybrid.validation`),
the model's own check (:meth:`~megatron_hybrid.megatron.models.GPTArchitecture.validate`), the simulation and the
recipe's argument checks (:mod:`megatron_hybrid.rl.arguments`, which tells the message with its flags' names) each
:func:`check` the rules they can evaluate. Pure functions of the sizes: every rule is decided before any collective.
docs/engine.md's table of the rules is this table (``tests/test_constraints.py`` compares them row for row).

Nothing here imports the rest of the package, torch or megatron-core.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

#: Where a rule applies: the training layout, the rollout layout.
TRAINING, ROLLOUT = "training", "rollout"
#: Which models and rollout layouts a rule applies to (``None``: every one).
MOE, DENSE = True, False
IN_PLACE, EXCHANGED = False, True


@dataclass(frozen=True)
class Sizes:
    """What the rules read; ``None`` where the caller does not know it (the rules that relate it are skipped)."""

    world: Optional[int] = None
    """Ranks in the world."""
    t: Optional[int] = None
    """Training tensor-parallel size."""
    p: Optional[int] = None
    """Training pipeline-parallel size."""
    d: Optional[int] = None
    """Training data-parallel size."""
    e: Optional[int] = None
    """Training expert-parallel size."""
    et: Optional[int] = None
    """Training expert tensor-parallel size."""
    edp: Optional[int] = None
    """Training expert data-parallel size."""
    t_g: Optional[int] = None
    """Rollout tensor-parallel size."""
    p_g: Optional[int] = None
    """Rollout pipeline-parallel size."""
    e_g: Optional[int] = None
    """Rollout expert-parallel size."""
    et_g: Optional[int] = None
    """Rollout expert tensor-parallel size."""
    exchange: Optional[bool] = None
    """Whether the rollout layout is an exchange layout (``ParallelLayout.exchange``) rather than served in place."""
    moe: Optional[bool] = None
    """Whether the model has routed experts."""
    num_attention_heads: Optional[int] = None
    num_query_groups: Optional[int] = None
    """The query groups (the heads without grouped-query attention)."""
    ffn_hidden_size: Optional[int] = None
    num_layers: Optional[int] = None
    padded_vocab_size: Optional[int] = None
    num_moe_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    """The routed experts' MLP size (megatron-core's default: ``ffn_hidden_size``)."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    add_bias_linear: Optional[bool] = None

    def facts(self) -> dict[str, Any]:
        """The fields and the products the messages show (``None`` where a factor is unknown)."""
        def product(*names: str) -> Optional[int]:
            values = [getattr(self, n) for n in names]
            return None if None in values else math.prod(values)
        out = dataclasses.asdict(self)
        out.update(model_ranks=product("t", "p"), rollout_ranks=product("t_g", "p_g"), expert_ranks=product("e", "et"),
                   stage_ranks=product("t", "d"),
                   rollout_stage_ranks=None if None in (self.world, self.p_g) else self.world // self.p_g)
        return out


@dataclass(frozen=True)
class Rule:
    """One layout constraint."""

    name: str
    """Its name (the first column of the docs' table)."""
    relation: str
    """What must hold, over :class:`Sizes`' names (``a | b``: a divides b); the quantities it relates are the names in
    it."""
    layout: str
    """The layout it constrains: :data:`TRAINING` or :data:`ROLLOUT`."""
    holds: Callable[[Sizes], bool]
    """The relation, evaluated (only where :meth:`applies`)."""
    message: str
    """The ``ValueError``'s message, a ``str.format`` template over :meth:`Sizes.facts`: the arguments by name and
    their values."""
    moe: Optional[bool] = None
    """:data:`MOE` for MoE models only, :data:`DENSE` for dense ones only, ``None`` for both."""
    exchange: Optional[bool] = None
    """:data:`IN_PLACE` or :data:`EXCHANGED` for rollout layouts of that kind only, ``None`` for both."""

    @property
    def reads(self) -> tuple[str, ...]:
        """The quantities the relation names."""
        names = {f.name for f in dataclasses.fields(Sizes)}
        return tuple(dict.fromkeys(w for w in re.findall(r"[A-Za-z_]\w*", self.relation) if w in names))

    @property
    def scope(self) -> str:
        """Where it applies, as the docs' table says it: ``"rollout, MoE, in place"``."""
        parts = [self.layout, {None: "", MOE: "MoE", DENSE: "dense"}[self.moe],
                 {None: "", IN_PLACE: "in place", EXCHANGED: "exchange"}[self.exchange]]
        return ", ".join(p for p in parts if p)

    def applies(self, sizes: Sizes) -> bool:
        """Whether ``sizes`` knows every quantity the rule relates and is of the rule's kind of model and layout."""
        return all(getattr(sizes, n) is not None for n in self.reads) and \
            (self.moe is None or sizes.moe is self.moe) and (self.exchange is None or sizes.exchange is self.exchange)

    def error(self, sizes: Sizes) -> ValueError:
        return ValueError(self.message.format(**sizes.facts()))


#: The rules, in the order :func:`check` tries them. Training layout first, then the rollout layout; a rule's
#: message says why where the relation alone does not.
RULES: tuple[Rule, ...] = (
    # ---- training ----
    Rule("training_layout_fits_world", "t · p | world", TRAINING, lambda s: s.world % (s.t * s.p) == 0,
         "the world size ({world}) must be a multiple of tensor_model_parallel_size ({t}) × "
         "pipeline_model_parallel_size ({p}) = {model_ranks}"),
    Rule("training_layout_covers_world", "t · p · d = world", TRAINING, lambda s: s.t * s.p * s.d == s.world,
         "tensor ({t}) × pipeline ({p}) × data ({d}) parallel sizes must cover the world ({world} ranks); "
         "context/expert parallelism is not supported yet"),
    Rule("t_divides_heads", "t | num_attention_heads", TRAINING, lambda s: s.num_attention_heads % s.t == 0,
         "tensor_model_parallel_size ({t}) must divide num_attention_heads ({num_attention_heads})"),
    Rule("t_divides_query_groups", "t | num_query_groups", TRAINING, lambda s: s.num_query_groups % s.t == 0,
         "tensor_model_parallel_size ({t}) must divide num_query_groups ({num_query_groups})"),
    Rule("t_divides_ffn", "t | ffn_hidden_size", TRAINING, lambda s: s.ffn_hidden_size % s.t == 0,
         "tensor_model_parallel_size ({t}) must divide ffn_hidden_size ({ffn_hidden_size})"),
    Rule("p_divides_layers", "p | num_layers", TRAINING, lambda s: s.num_layers % s.p == 0,
         "pipeline_model_parallel_size ({p}) must divide num_layers ({num_layers})"),
    Rule("e_divides_experts", "e | num_moe_experts", TRAINING, lambda s: s.num_moe_experts % s.e == 0,
         "expert_model_parallel_size ({e}) must divide num_moe_experts ({num_moe_experts})", moe=MOE),
    Rule("et_divides_expert_ffn", "et | moe_ffn_hidden_size", TRAINING, lambda s: s.moe_ffn_hidden_size % s.et == 0,
         "expert_tensor_parallel_size ({et}) must divide moe_ffn_hidden_size ({moe_ffn_hidden_size})", moe=MOE),
    # Routed experts are split over the expert-TP ranks, shared experts over the TP ranks.
    Rule("t_divides_shared_expert", "t | moe_shared_expert_intermediate_size", TRAINING,
         lambda s: s.moe_shared_expert_intermediate_size % s.t == 0,
         "tensor_model_parallel_size ({t}) must divide moe_shared_expert_intermediate_size "
         "({moe_shared_expert_intermediate_size})", moe=MOE),
    Rule("expert_bias_needs_et_1", "add_bias_linear ⇒ et = 1", TRAINING, lambda s: not s.add_bias_linear or s.et == 1,
         "add_bias_linear with experts needs expert_tensor_parallel_size 1 (got {et}): megatron-core supports expert "
         "biases only then", moe=MOE),
    # megatron-core splits a stage's t·d ranks both ways: t × d for the dense layers, et × e × edp for the experts.
    Rule("expert_grid_fits_stage", "e · et | t · d", TRAINING, lambda s: (s.t * s.d) % (s.e * s.et) == 0,
         "expert_model_parallel_size ({e}) × expert_tensor_parallel_size ({et}) = {expert_ranks} must divide "
         "tensor_model_parallel_size ({t}) × data_parallel_size ({d}) = {stage_ranks}: the ranks of a pipeline stage",
         moe=MOE),
    Rule("expert_grid_covers_world", "et · e · edp · p = world", TRAINING,
         lambda s: s.et * s.e * s.edp * s.p == s.world,
         "expert tensor ({et}) × expert ({e}) × expert data ({edp}) × pipeline ({p}) parallel sizes must cover the "
         "world ({world} ranks)", moe=MOE),
    # ---- rollout: the rollout model must be buildable ----
    Rule("rollout_layout_divides_world", "t_g · p_g | world", ROLLOUT, lambda s: s.world % (s.t_g * s.p_g) == 0,
         "rollout tensor_model_parallel_size ({t_g}) × rollout pipeline_model_parallel_size ({p_g}) = "
         "{rollout_ranks} must divide the world ({t} × {p} × {d} = {world} ranks)"),
    Rule("t_g_divides_heads", "t_g | num_attention_heads", ROLLOUT, lambda s: s.num_attention_heads % s.t_g == 0,
         "rollout tensor_model_parallel_size ({t_g}) must divide num_attention_heads ({num_attention_heads})"),
    Rule("t_g_divides_ffn", "t_g | ffn_hidden_size", ROLLOUT, lambda s: s.ffn_hidden_size % s.t_g == 0,
         "rollout tensor_model_parallel_size ({t_g}) must divide ffn_hidden_size ({ffn_hidden_size})"),
    # megatron-core's attention divides the groups over TP (an AssertionError in the rollout model's build).
    Rule("t_g_divides_query_groups", "t_g | num_query_groups", ROLLOUT, lambda s: s.num_query_groups % s.t_g == 0,
         "rollout tensor_model_parallel_size ({t_g}) must divide num_query_groups ({num_query_groups})"),
    Rule("p_g_divides_layers", "p_g | num_layers", ROLLOUT, lambda s: s.num_layers % s.p_g == 0,
         "rollout pipeline_model_parallel_size ({p_g}) must divide num_layers ({num_layers})"),
    Rule("t_g_divides_vocab", "t_g | padded_vocab_size", ROLLOUT, lambda s: s.padded_vocab_size % s.t_g == 0,
         "rollout tensor_model_parallel_size ({t_g}) must divide the padded vocabulary ({padded_vocab_size})"),
    # ---- rollout experts ----
    Rule("dense_has_no_rollout_ep", "e_g = 1", ROLLOUT, lambda s: s.e_g == 1,
         "rollout expert_model_parallel_size ({e_g}) needs a model with experts (its num_moe_experts is None)",
         moe=DENSE),
    Rule("moe_rollout_tp_not_wider", "t_g ≤ t", ROLLOUT, lambda s: s.t_g <= s.t,
         "rollout tensor_model_parallel_size ({t_g}) > tensor_model_parallel_size ({t}) is not supported for MoE "
         "models", moe=MOE),
    # In place the experts gather over micro-EP groups: a rollout expert shard is a union of training ones.
    Rule("e_g_divides_e", "e_g | e", ROLLOUT, lambda s: s.e % s.e_g == 0,
         "rollout expert_model_parallel_size ({e_g}) must divide expert_model_parallel_size ({e}): a rollout rank's "
         "experts are the union of its micro-EP group's", moe=MOE, exchange=IN_PLACE),
    Rule("et_g_divides_et", "et_g | et", ROLLOUT, lambda s: s.et % s.et_g == 0,
         "rollout expert_tensor_parallel_size ({et_g}) must divide expert_tensor_parallel_size ({et})",
         moe=MOE, exchange=IN_PLACE),
    Rule("experts_p_g_divides_p", "p_g | p", ROLLOUT, lambda s: s.p % s.p_g == 0,
         "rollout pipeline_model_parallel_size ({p_g}) must divide pipeline_model_parallel_size ({p})",
         moe=MOE, exchange=IN_PLACE),
    # On an exchange layout each rollout stage's ranks are cut into et_g × e_g × (rollout expert data parallel).
    Rule("rollout_expert_grid_fits_stage", "et_g · e_g | world / p_g", ROLLOUT,
         lambda s: (s.world // s.p_g) % (s.et_g * s.e_g) == 0,
         "rollout expert_tensor_parallel_size ({et_g}) × rollout expert_model_parallel_size ({e_g}) must divide a "
         "rollout stage's ranks ({rollout_stage_ranks})", moe=MOE, exchange=EXCHANGED),
    Rule("e_g_divides_experts", "e_g | num_moe_experts", ROLLOUT, lambda s: s.num_moe_experts % s.e_g == 0,
         "rollout expert_model_parallel_size ({e_g}) must divide num_moe_experts ({num_moe_experts})", moe=MOE),
    Rule("et_g_divides_expert_ffn", "et_g | moe_ffn_hidden_size", ROLLOUT,
         lambda s: s.moe_ffn_hidden_size % s.et_g == 0,
         "rollout expert_tensor_parallel_size ({et_g}) must divide moe_ffn_hidden_size ({moe_ffn_hidden_size})",
         moe=MOE),
    # In place et_g | et = 1 already; megatron-core asserts it when the rollout model is built.
    Rule("rollout_expert_bias_needs_et_g_1", "add_bias_linear ⇒ et_g = 1", ROLLOUT,
         lambda s: not s.add_bias_linear or s.et_g == 1,
         "rollout expert_tensor_parallel_size ({et_g}) must be 1 for a model with biases (add_bias_linear): "
         "megatron-core supports expert biases only without expert TP", moe=MOE, exchange=EXCHANGED),
)

RULES_BY_NAME: Mapping[str, Rule] = {r.name: r for r in RULES}


def violated(sizes: Sizes, names: Optional[Iterable[str]] = None) -> list[Rule]:
    """The rules of ``names`` (in their order; default: all, in the table's) that apply to ``sizes`` and do not hold."""
    chosen = RULES if names is None else [RULES_BY_NAME[n] for n in names]
    return [r for r in chosen if r.applies(sizes) and not r.holds(sizes)]


def check(sizes: Sizes, *names: str, rename: Optional[Mapping[str, str]] = None) -> None:
    """``ValueError`` with the message of the first rule of ``names`` (in their order; default: all, in the table's)
    that applies to ``sizes`` and does not hold. ``rename``: names the caller's arguments go by (``{"num_moe_experts":
    "num_experts"}``), put in the message in place of the table's."""
    bad = violated(sizes, names or None)
    if not bad:
        return
    message = str(bad[0].error(sizes))
    for old, new in (rename or {}).items():
        message = re.sub(rf"(?<![\w-]){re.escape(old)}(?!\w)", new, message)
    raise ValueError(message)


#: A pipe inside a table cell (Python-Markdown keeps the backslash of ``\\|`` inside a code span: plain text).
BAR = "\\|"


def markdown_rows() -> list[str]:
    """The docs' table of the rules (docs/engine.md), header included: name, relation and where it applies."""
    rows = ["| rule | must hold | applies to |", "|---|---|---|"]
    return rows + [f"| `{r.name}` | {r.relation.replace('|', BAR)} | {r.scope} |" for r in RULES]


__all__ = ["DENSE", "EXCHANGED", "IN_PLACE", "MOE", "ROLLOUT", "RULES", "RULES_BY_NAME", "TRAINING", "Rule", "Sizes",
           "check", "markdown_rows", "violated"]
