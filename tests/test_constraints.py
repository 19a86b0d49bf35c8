"""The table of layout constraints (megatron_hybrid/constraints.py, issue 49): docs/engine.md shows it row for row,
every rule fires alone with its message, and valid layouts pass.

Each rule has a case here: a valid layout (dense, MoE in place, MoE exchanged) changed so that this rule, and no
other rule of the table, is broken; a rule without a case fails ``test_every_rule_has_a_case``. A quantity set to
``None`` is one the caller does not know (the recipe knows no expert data-parallel size, for one): the rules that
relate it are skipped.
"""

from __future__ import annotations

import dataclasses
import re
import string
from pathlib import Path

import pytest

from megatron_hybrid.constraints import RULES, RULES_BY_NAME, Sizes, check, markdown_rows, violated

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "engine.md"
HEADING = "### The layout rules"

#: Valid layouts: 8 ranks, t = p = d = 2; a model of 8 heads in 4 groups, an MLP of 64, 4 layers, 256 tokens.
DENSE = Sizes(world=8, t=2, p=2, d=2, t_g=1, p_g=1, e_g=1, moe=False, exchange=False, num_attention_heads=8,
              num_query_groups=4, ffn_hidden_size=64, num_layers=4, padded_vocab_size=256)
#: With 4 experts (MLP 32, a shared expert of 16) over e = et = 2, served in place at e_g = et_g = 1.
MOE = dataclasses.replace(DENSE, moe=True, e=2, et=2, edp=1, et_g=1, num_moe_experts=4, moe_ffn_hidden_size=32,
                          moe_shared_expert_intermediate_size=16, add_bias_linear=False)
MOE_EXCHANGED = dataclasses.replace(MOE, exchange=True)

#: rule → (valid layout, the change that breaks that rule alone).
CASES = {
    "training_layout_fits_world": (DENSE, dict(world=6, d=None)),  # t·p·d = world would fail too with d known
    "training_layout_covers_world": (DENSE, dict(world=16)),
    "t_divides_heads": (DENSE, dict(num_attention_heads=5)),
    "t_divides_query_groups": (DENSE, dict(num_query_groups=3)),
    "t_divides_ffn": (DENSE, dict(ffn_hidden_size=63)),
    "p_divides_layers": (DENSE, dict(num_layers=5)),
    "e_divides_experts": (MOE, dict(num_moe_experts=3)),
    "et_divides_expert_ffn": (MOE, dict(moe_ffn_hidden_size=31)),
    "t_divides_shared_expert": (MOE, dict(moe_shared_expert_intermediate_size=15)),
    "expert_bias_needs_et_1": (MOE, dict(add_bias_linear=True)),
    "expert_grid_fits_stage": (MOE, dict(e=4, edp=None)),
    "expert_grid_covers_world": (MOE, dict(edp=2)),
    "rollout_layout_divides_world": (DENSE, dict(t_g=4, p_g=4)),
    "t_g_divides_heads": (DENSE, dict(t_g=4, num_attention_heads=6)),
    "t_g_divides_ffn": (DENSE, dict(t_g=4, ffn_hidden_size=66)),
    "t_g_divides_query_groups": (DENSE, dict(t_g=4, num_query_groups=2)),
    "p_g_divides_layers": (DENSE, dict(p_g=4, num_layers=6)),
    "t_g_divides_vocab": (DENSE, dict(t_g=4, padded_vocab_size=258)),
    "dense_has_no_rollout_ep": (DENSE, dict(e_g=2)),
    "moe_rollout_tp_not_wider": (MOE, dict(t_g=4)),
    "e_g_divides_e": (MOE, dict(e_g=4)),
    "et_g_divides_et": (MOE, dict(et_g=4)),
    "experts_p_g_divides_p": (MOE, dict(p_g=4)),
    "rollout_expert_grid_fits_stage": (MOE_EXCHANGED, dict(p_g=4, e_g=4)),
    "e_g_divides_experts": (MOE_EXCHANGED, dict(e_g=4, num_moe_experts=6)),
    "et_g_divides_expert_ffn": (MOE_EXCHANGED, dict(et_g=4, moe_ffn_hidden_size=34)),
    "rollout_expert_bias_needs_et_g_1": (MOE_EXCHANGED, dict(add_bias_linear=True, et=1, edp=2, et_g=2)),
}


def test_every_rule_has_a_case():
    assert len(RULES_BY_NAME) == len(RULES), "two rules share a name"
    assert set(CASES) == set(RULES_BY_NAME), (sorted(set(RULES_BY_NAME) - set(CASES)),
                                              sorted(set(CASES) - set(RULES_BY_NAME)))


@pytest.mark.parametrize("sizes", [DENSE, MOE, MOE_EXCHANGED,
                                   dataclasses.replace(DENSE, t_g=4, p_g=2),  # a wider rollout TP, fewer stages
                                   Sizes(t=3, t_g=2)],  # nothing the rules relate is known: nothing to refuse
                         ids=["dense", "moe", "moe-exchanged", "dense-t_g-4", "unknown"])
def test_valid_layouts_pass(sizes):
    assert violated(sizes) == []
    check(sizes)


@pytest.mark.parametrize("name", list(CASES))
def test_each_rule_fires_alone_with_its_message(name):
    base, change = CASES[name]
    sizes = dataclasses.replace(base, **change)
    rule = RULES_BY_NAME[name]
    assert [r.name for r in violated(sizes)] == [name]
    with pytest.raises(ValueError) as error:
        check(sizes)
    message = str(error.value)
    assert message == rule.message.format(**sizes.facts())
    # The message shows the values it is about (a quantity the template names, or a product of them), no unknown one.
    fields = {field for _, field, _, _ in string.Formatter().parse(rule.message) if field}
    assert fields and "(None" not in message, message
    for quantity in fields & set(rule.reads):
        value = getattr(sizes, quantity)
        if not isinstance(value, bool):
            assert str(value) in re.findall(r"\d+", message), (quantity, value, message)
    # Checked by name, the rule fires too; the other rules do not.
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        check(sizes, name)
    check(sizes, *(n for n in RULES_BY_NAME if n != name))


def test_check_tells_the_callers_names():
    sizes = dataclasses.replace(MOE, num_moe_experts=3)
    with pytest.raises(ValueError, match=r"^expert_model_parallel_size \(2\) must divide num_experts \(3\)$"):
        check(sizes, "e_divides_experts", rename={"num_moe_experts": "num_experts"})


def _docs_rows() -> list[str]:
    """The lines of the first table after :data:`HEADING` in docs/engine.md, header included."""
    lines = PAGE.read_text().splitlines()
    assert HEADING in lines, f"docs/engine.md has no {HEADING!r} section"
    rows = []
    for line in lines[lines.index(HEADING) + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append(line.rstrip())
        elif rows:
            break
    return rows


def test_the_docs_table_is_the_code_table():
    """Every rule of the code is a row of docs/engine.md's table and every row a rule, in the table's order, with
    the relation and where it applies; on a difference, the rows to paste are in the message."""
    docs, code = _docs_rows(), markdown_rows()
    names = [row.split("|")[1].strip().strip("`") for row in docs[2:]]
    assert set(names) == set(RULES_BY_NAME), (f"rules missing from the docs: {sorted(set(RULES_BY_NAME) - set(names))}"
                                              f"; rows that are no rule: {sorted(set(names) - set(RULES_BY_NAME))}")
    assert docs == code, "docs/engine.md's table of layout rules differs from the code's; its rows:\n" + \
        "\n".join(code)
