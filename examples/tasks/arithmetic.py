"""Arithmetic word problems with exact integer answers, for ``train_ppo.py --prompt-data`` (no data from a hub).

Each problem is one of a few templates (adding, taking away, multiplying, sharing equally, paying and getting
change), its numbers drawn from ``--seed``; the answer is the value of the problem's expression (kept in
``extra_info.expression``), always a non-negative integer. Train and test splits never share a question.

Writes DIR/train.jsonl and DIR/test.jsonl, one ``{"prompt", "answer", "data_source", "extra_info"}`` object a
line (the prompt as chat messages, or as plain text with ``--prompt-format text``), and with ``--parquet`` also
DIR/train.parquet and DIR/test.parquet in verl's layout (``prompt``, ``reward_model.ground_truth``,
``data_source``, ``ability``, ``extra_info``; needs pyarrow). The prompt asks for the final answer after
``####``, which ``--reward-type exact-match`` reads (and ``--reward-type format`` checks):

    python examples/tasks/arithmetic.py --output-dir data/arithmetic
    python examples/tasks/arithmetic.py --output-dir data/arithmetic --num-train 5000 --num-test 500 \\
        --max-operand 50 --parquet --seed 7
    python examples/tasks/arithmetic.py --output-dir data/arithmetic20 --max-operand 20 --instruction short
    torchrun --nproc_per_node 4 examples/ppo/train_ppo.py --pretrained-checkpoint qwen-mcore \\
        --prompt-data data/arithmetic/train.jsonl --eval-prompt-data data/arithmetic/test.jsonl --eval-interval 10 \\
        --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass
from typing import Optional, Sequence

DATA_SOURCE = "arithmetic"
INSTRUCTIONS = {
    "step-by-step": "Think step by step, then give the final answer as a number after '####'.",
    # For small models and short --max-new-tokens: a reasoning chain rarely ends (with its '####') within 32 tokens.
    "short": "Reply with only the answer, written as '#### <number>'.",
    # For examples/tasks/calculator.py (--env): the tool's call and its answer, then the final answer.
    "calculator": "You may use a calculator: write <calc>expression</calc> and stop; its result comes back. End with "
                  "'#### <number>'.",
}
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun", "Kemal", "Lena"]
THINGS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells"]


@dataclass(frozen=True)
class Problem:
    question: str
    expression: str
    """The arithmetic of the question (integers, ``+ - * //``), for checking: its value is ``answer``."""
    answer: int


def _problem(rng: random.Random, max_operand: int) -> Problem:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, max_operand), rng.randint(2, max_operand)
    kind = rng.randrange(5)
    if kind == 0:
        return Problem(f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?",
                       f"{a} + {b}", a + b)
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return Problem(f"{name} had {a} {thing} and gave {b} of them away. How many {thing} are left?",
                       f"{a} - {b}", a - b)
    b = rng.randint(2, 12)
    if kind == 2:
        return Problem(f"There are {b} boxes with {a} {thing} in each. How many {thing} are there in all?",
                       f"{b} * {a}", a * b)
    if kind == 3:
        return Problem(f"{name} shares {a * b} {thing} equally among {b} friends. How many {thing} does each "
                       f"friend get?", f"{a * b} // {b}", a)
    price, count = rng.randint(1, 9), rng.randint(2, 9)
    paid = price * count + rng.randint(0, max_operand)
    return Problem(f"{name} buys {count} {thing} at {price} dollars each and pays with {paid} dollars. How many "
                   f"dollars of change does {name} get?", f"{paid} - {count} * {price}", paid - count * price)


def generate_problems(num: int, *, seed: int, max_operand: int, exclude: frozenset = frozenset()) -> list[Problem]:
    """``num`` distinct problems (none of whose questions is in ``exclude``), reproducibly from ``seed``."""
    rng, seen, out = random.Random(seed), set(exclude), []
    for _ in range(100 * num + 1000):
        p = _problem(rng, max_operand)
        if p.question not in seen:
            seen.add(p.question)
            out.append(p)
            if len(out) == num:
                return out
    raise ValueError(f"--max-operand {max_operand} gives fewer than {num} distinct problems; raise it")


def row(problem: Problem, *, split: str, index: int, prompt_format: str, instruction: str = "step-by-step") -> dict:
    """One JSONL row: the prompt (chat messages or text) ending in ``INSTRUCTIONS[instruction]``, the answer as a
    string, verl's extra fields."""
    text = f"{problem.question} {INSTRUCTIONS[instruction]}"
    prompt = [{"role": "user", "content": text}] if prompt_format == "chat" else f"Question: {text}\nAnswer:"
    return {"prompt": prompt, "answer": str(problem.answer), "data_source": DATA_SOURCE,
            "extra_info": {"split": split, "index": index, "expression": problem.expression}}


def write_parquet(path: str, rows: list[dict]) -> None:
    """``rows`` in verl's parquet layout (chat prompts)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise SystemExit(f"--parquet needs pyarrow (pip install pyarrow): {e}")
    table = pa.Table.from_pylist([
        {"data_source": r["data_source"], "prompt": r["prompt"], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": r["answer"]}, "extra_info": r["extra_info"]}
        for r in rows])
    pq.write_table(table, path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arithmetic.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True, help="where train/test files go (created)")
    parser.add_argument("--num-train", type=int, default=2000)
    parser.add_argument("--num-test", type=int, default=200)
    parser.add_argument("--max-operand", type=int, default=100, help="largest number drawn (at least 2)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--prompt-format", choices=["chat", "text"], default="chat",
                        help="chat messages (for a tokenizer's chat template) or plain text")
    parser.add_argument("--instruction", choices=sorted(INSTRUCTIONS), default="step-by-step",
                        help="what the prompt asks for after the question: reasoning then '#### N' (step-by-step) or "
                        "'#### N' alone (short)")
    parser.add_argument("--parquet", action="store_true", help="also write verl-style parquet files (chat)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag, value, low in (("--num-train", args.num_train, 1), ("--num-test", args.num_test, 1),
                             ("--max-operand", args.max_operand, 2)):
        if value < low:
            parser.error(f"{flag} ({value}) must be at least {low}")
    if args.parquet and args.prompt_format != "chat":
        parser.error("--parquet writes verl's chat prompts: use --prompt-format chat")
    test = generate_problems(args.num_test, seed=args.seed + 1, max_operand=args.max_operand)
    train = generate_problems(args.num_train, seed=args.seed, max_operand=args.max_operand,
                              exclude=frozenset(p.question for p in test))
    os.makedirs(args.output_dir, exist_ok=True)
    for split, problems in (("train", train), ("test", test)):
        rows = [row(p, split=split, index=i, prompt_format=args.prompt_format, instruction=args.instruction)
                for i, p in enumerate(problems)]
        with open(os.path.join(args.output_dir, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        if args.parquet:
            write_parquet(os.path.join(args.output_dir, f"{split}.parquet"), rows)
    print(f"wrote {len(train)} train and {len(test)} test problems to {args.output_dir}")


if __name__ == "__main__":
    main()
