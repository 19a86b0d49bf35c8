"""A calculator tool for ``train_ppo.py --env`` (issue 47): the model may write ``<calc>12*7</calc>``; the environment
answers ``= 84`` (an observation: context, never trained); the reward is the final answer's correctness.

    python examples/tasks/arithmetic.py --output-dir data/calc --instruction calculator --max-operand 50
    torchrun --nproc_per_node 1 examples/ppo/train_ppo.py --pretrained-checkpoint smollm2-mcore \\
        --prompt-data data/calc/train.jsonl --env examples/tasks/calculator.py:Calculator --max-turns 3 \\
        --algorithm grpo --num-samples-per-prompt 8 --max-new-tokens 48

A turn of the model ends at its end-of-sequence token or after ``--max-new-tokens``. The environment reads the text
of the turn: where it holds a ``<calc>expression</calc>`` and no final answer yet, the expression (integers,
``+ - * / // % ( )``, at most 64 characters, no powers) is evaluated and its value given back as ``= value`` on a
line of its own (an expression it cannot evaluate gets ``= error``); otherwise the episode ends and the reward is
1 when the turn's answer equals the problem's (``example.answer``), else 0: the number after its last ``####``, or
without one its last number (as ``--reward-type exact-match`` reads answers: a small model that answers in prose
still gets a signal). The last turn (``--max-turns``) always ends it.

The environment needs the run's tokenizer to read and write text: the recipe passes it to any environment class
whose constructor takes ``tokenizer``.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any, Optional

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
MAX_EXPRESSION = 64
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def evaluate(expression: str) -> Optional[float]:
    """The value of an arithmetic ``expression`` (numbers, ``+ - * / // %``, unary minus, parentheses), or None
    when it is anything else, too long, or divides by zero. Parsed with ``ast``: nothing is executed."""
    if len(expression) > MAX_EXPRESSION:
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        return None

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value,
                                                                                                    bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    try:
        return value(tree)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def shown(v: float) -> str:
    """A value as the calculator shows it: an integer without a decimal point, else at most 6 decimals."""
    return str(int(v)) if float(v).is_integer() else f"{v:.6f}".rstrip("0")


NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def final_answer(text: str) -> Optional[str]:
    """The number after the text's last ``####`` (commas dropped), or None."""
    found = ANSWER.findall(text)
    return found[-1].replace(",", "") if found else None


def last_number(text: str) -> Optional[str]:
    """The text's last number (commas dropped), or None."""
    found = NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


class Calculator:
    """One sample's calculator (module docstring)."""

    def __init__(self, tokenizer: Any = None) -> None:
        if tokenizer is None:
            raise ValueError("Calculator needs the run's tokenizer (train_ppo.py passes it): Calculator(tokenizer=...)")
        self.tokenizer = tokenizer
        self.calls = 0

    def reset(self, example: Any) -> list[int]:
        self.answer = None if example.answer is None else str(example.answer).strip()
        return list(example.tokens)

    def step(self, tokens: list[int]) -> tuple[list[int], float, bool]:
        eod = getattr(self.tokenizer, "eod", None)
        text = self.tokenizer.detokenize([t for t in tokens if t != eod])
        calls = CALL.findall(text)
        if calls and final_answer(text) is None:
            self.calls += 1
            result = evaluate(calls[-1])
            return self.tokenizer.tokenize(f"\n= {'error' if result is None else shown(result)}\n"), 0.0, False
        given = final_answer(text) or last_number(CALL.sub("", text))
        correct = given is not None and self.answer is not None and _same_number(given, self.answer)
        return [], float(correct), True


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return False
