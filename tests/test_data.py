"""Prompt data and rewards (issue 15, Build 3): JSONL and verl's parquet read with the chat template applied, every
bad row a ValueError naming the file, line or row and field, the built-in rewards against hand-computed values,
``--reward-fn`` in each convention (ours, with answers, verl's ``compute_score``), the arithmetic task generator,
and the recipe with ``--prompt-data`` and ``--eval-interval``. Issue 22: non-finite ground truths, token ids outside
the vocabulary or not ids, bytes that are not UTF-8 and blank ``--prompt-file`` s refused at load (file and line);
reward modules that fail to import and reward values that are not numbers refused by name."""

from __future__ import annotations

import ast
import json
import operator
import os
import runpy
import sys

import pytest

from megatron_hybrid import rl
from megatron_hybrid.rl.data import data_file_error
from megatron_hybrid.rl.tokenizers import HuggingFaceTokenizer, NullTokenizer
from tests import data_cases
from tests.harness import run_distributed
from tests.rl_cases import recipe_args
from tests.text_fixtures import save_tiny_tokenizer

GENERATOR = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "tasks", "arithmetic.py")
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 12 plus 7?"}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("tokenizer"))
    save_tiny_tokenizer(directory)
    return directory


def _load(path, tokenizer_dir, *, max_new_tokens=8, max_positions=256):
    return rl.load_prompt_data(str(path), HuggingFaceTokenizer(tokenizer_dir), max_new_tokens=max_new_tokens,
                               max_positions=max_positions)


def _jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_jsonl_and_parquet_prompts(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    chat_ids = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert hf.decode(chat_ids).endswith("<|im_start|>assistant\n")
    rows = [{"prompt": CHAT, "answer": "19", "data_source": "sums", "extra_info": {"index": 4}, "id": "extra"},
            {"prompt": "Compute 45 minus 17.", "answer": 28},
            {"prompt": CHAT, "reward_model": {"style": "rule", "ground_truth": "19"}}]
    path = _jsonl(tmp_path / "data.jsonl", rows[:1] + [""] + rows[1:])  # a blank line is skipped
    examples = _load(path, tokenizer_dir)
    assert [e.tokens for e in examples] == [chat_ids, hf.encode("Compute 45 minus 17.", add_special_tokens=False),
                                            chat_ids]
    assert [(e.answer, e.data_source, e.extra_info) for e in examples] == [
        ("19", "sums", {"index": 4}), ("28", "", {}), ("19", "", {})]
    # verl's parquet layout, as its data preprocessing scripts write it.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([
        {"data_source": "sums", "prompt": CHAT, "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": "19"}, "extra_info": {"index": 4, "split": "test"}}]),
        tmp_path / "data.parquet")
    (example,) = _load(tmp_path / "data.parquet", tokenizer_dir)
    assert (example.tokens, example.answer, example.data_source) == (chat_ids, "19", "sums")
    assert example.extra_info == {"index": 4, "split": "test"}


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "hi"}', "line 2: no ground truth: the row has neither 'answer' nor 'reward_model.ground_truth' "
                         "(fields: 'prompt')"),
    ('{"prompt": "hi", "answer": "1"', "line 2: not JSON (Expecting ',' delimiter at column 31)"),
    ('["hi", "1"]', "line 2: a row must be an object with 'prompt' and 'answer', not list"),
    ('{"answer": "1"}', "line 2: no 'prompt' (fields: 'answer')"),
    ('{"prompt": 7, "answer": "1"}', "line 2: 'prompt' must be text or a non-empty list of chat messages, not int"),
    ('{"prompt": "", "answer": "1"}', "line 2: 'prompt' is empty"),
    ('{"prompt": [{"role": "user", "content": 3}], "answer": "1"}',
     "line 2: 'prompt'[0]['content'] must be a string, not int"),
    ('{"prompt": ["hi"], "answer": "1"}', "line 2: 'prompt'[0] must be a message object"),
    ('{"prompt": "hi", "answer": ["1"]}', "line 2: 'answer' must be a string or a number, not list (['1'])"),
    ('{"prompt": "hi", "answer": true}', "line 2: 'answer' must be a string or a number, not bool (True)"),
    ('{"prompt": "hi", "reward_model": {"ground_truth": null}}',
     "line 2: 'reward_model.ground_truth' must be a string or a number, not NoneType"),
    ('{"prompt": "hi", "answer": "1", "extra_info": [1]}', "line 2: 'extra_info' must be an object, not list"),
    ('{"prompt": "hi", "answer": "1", "data_source": 5}', "line 2: 'data_source' must be a string, not int"),
    # JSON's NaN and Infinity (and numbers past float's range) are numbers to Python's json, not ground truths.
    ('{"prompt": "hi", "answer": NaN}', "line 2: 'answer' must be a finite number, not nan"),
    ('{"prompt": "hi", "reward_model": {"ground_truth": -Infinity}}',
     "line 2: 'reward_model.ground_truth' must be a finite number, not -inf"),
    ('{"prompt": "hi", "answer": 1e400}', "line 2: 'answer' must be a finite number, not inf"),
], ids=["no-answer", "bad-json", "not-object", "no-prompt", "prompt-type", "empty-prompt", "content-type",
        "message-type", "answer-type", "answer-bool", "ground-truth-null", "extra-info", "data-source", "answer-nan",
        "ground-truth-infinity", "answer-overflow"])
def test_bad_jsonl_rows_name_file_line_and_field(line, message, tokenizer_dir, tmp_path):
    path = _jsonl(tmp_path / "bad.jsonl", ['{"prompt": "fine", "answer": "1"}', line])
    with pytest.raises(ValueError) as e:
        _load(path, tokenizer_dir)
    assert str(e.value).startswith(f"--prompt-data {path} {message}"), str(e.value)


def test_other_bad_inputs(tokenizer_dir, tmp_path, monkeypatch):
    tok = HuggingFaceTokenizer(tokenizer_dir)
    long_row = {"prompt": "x" * 60, "answer": "1"}
    n = len(tok.tokenize("x" * 60))
    path = _jsonl(tmp_path / "long.jsonl", [long_row])
    with pytest.raises(ValueError, match=rf"long.jsonl line 1: the prompt is {n} tokens; with --max-new-tokens "
                                         rf"\(8\) that is {n + 8} positions, more than the model's "
                                         rf"--max-position-embeddings \({n + 7}\)"):
        _load(path, tokenizer_dir, max_positions=n + 7)
    assert len(_load(path, tokenizer_dir, max_positions=n + 8)) == 1  # exactly full fits
    # Chat messages need a chat template.
    chat = _jsonl(tmp_path / "chat.jsonl", [{"prompt": CHAT, "answer": "19"}])
    with pytest.raises(ValueError, match="chat.jsonl line 1: 'prompt' is chat messages, which need a chat template: "
                                         "use --tokenizer-type HuggingFaceTokenizer .*NullTokenizer"):
        rl.load_prompt_data(chat, NullTokenizer(16), max_new_tokens=8, max_positions=256)
    plain = tmp_path / "no_template"
    save_tiny_tokenizer(str(plain))
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("chat_template.jinja", "chat_template.json"):
        if (plain / name).exists():
            (plain / name).unlink()
    with pytest.raises(ValueError, match="chat.jsonl line 1: 'prompt' is chat messages: the tokenizer .* has no "
                                         "chat template"):
        _load(chat, str(plain))
    # Empty files, parquet rows, files that are not parquet, and pyarrow missing.
    with pytest.raises(ValueError, match="empty.jsonl: the file holds no rows"):
        _load(_jsonl(tmp_path / "empty.jsonl", []), tokenizer_dir)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "reward_model": {"ground_truth": "1"}},
                                         {"prompt": "b", "reward_model": None}]), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"--prompt-data \S+bad.parquet row 1: no ground truth"):
        _load(tmp_path / "bad.parquet", tokenizer_dir)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"junk.parquet: not a readable parquet file \(ArrowInvalid"):
        _load(tmp_path / "junk.parquet", tokenizer_dir)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if it were not installed
    with pytest.raises(ValueError, match=r"bad.parquet: reading parquet needs pyarrow \(pip install pyarrow\)"):
        _load(tmp_path / "bad.parquet", tokenizer_dir)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    assert data_file_error("--prompt-data", str(tmp_path / "bad.parquet")).endswith(
        "is parquet, which needs pyarrow (pip install pyarrow)")
    assert data_file_error("--prompt-data", str(tmp_path / "x.csv")) == \
        f"--prompt-data ({str(tmp_path / 'x.csv')!r}) does not exist"


def _task(*argv):
    """:func:`rl.load_task` of the recipe's flags on a 96-token NullTokenizer (the start-up path: no process group)."""
    return rl.load_task(recipe_args("--tensor-model-parallel-size", "1", "--vocab-size", "96", *argv))


NOT_AN_ID = ("NullTokenizer takes token-id prompts (ids separated by spaces, as '5 17 3'): word {} ({!r}) is not a "
             "token id (text needs --tokenizer-type HuggingFaceTokenizer or SentencePieceTokenizer)")


@pytest.mark.parametrize("prompt, message", [
    ("4 99 5", "token 1 is 99, outside the vocabulary [0, 96) (--vocab-size 96)"),
    ("-1 4", "token 0 is -1, outside the vocabulary [0, 96) (--vocab-size 96)"),
    ("4 2.0", NOT_AN_ID.format(1, "2.0")),
    ("true 4", NOT_AN_ID.format(0, "true")),
    ("What is 2 plus 2?", NOT_AN_ID.format(0, "What")),
    ("1_0", NOT_AN_ID.format(0, "1_0")),  # int() takes it as 10
], ids=["past-vocab", "negative", "float", "bool", "text", "underscore"])
def test_token_ids_are_checked_at_load_naming_file_and_line(prompt, message, tmp_path):
    rows = [{"prompt": "1 2 3", "answer": "6"}, "", {"prompt": "7 8", "answer": "15"},
            {"prompt": prompt, "answer": "9"}]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ValueError) as e:
        _task("--prompt-data", path)
    assert str(e.value) == f"--prompt-data {path} line 4: 'prompt': {message}", str(e.value)


def test_null_tokenizer_files_and_text_lines_are_checked_at_load(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = _jsonl(tmp_path / "good.jsonl", [{"prompt": "1 2 3", "answer": 1e20}, {"prompt": "4", "answer": 2.5}])
    task = _task("--prompt-data", good)
    # A float ground truth is kept as its digits: "1e+20" would read as the number 20.
    assert [(e.tokens, e.answer) for e in task.prompts.examples] == [([1, 2, 3], "100000000000000000000"),
                                                                     ([4], "2.5")]
    # parquet: the row index (from 0); a NaN ground truth (pandas' missing value) is refused too.
    pq.write_table(pa.Table.from_pylist([{"prompt": "1 2", "answer": "3"}, {"prompt": "5", "answer": "5"},
                                         {"prompt": "95 96", "answer": "1"}]), tmp_path / "ids.parquet")
    with pytest.raises(ValueError, match=r"^--prompt-data \S+ids.parquet row 2: 'prompt': token 1 is 96, outside "
                                         r"the vocabulary \[0, 96\)"):
        _task("--prompt-data", str(tmp_path / "ids.parquet"))
    pq.write_table(pa.Table.from_pylist([{"prompt": "1 2", "answer": 3.0}, {"prompt": "5", "answer": float("nan")}]),
                   tmp_path / "nan.parquet")
    with pytest.raises(ValueError, match=r"nan.parquet row 1: 'answer' must be a finite number, not nan"):
        _task("--prompt-data", str(tmp_path / "nan.parquet"))
    # --eval-prompt-data: the same checks, naming its flag.
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "1 2", "answer": "3"}, {"prompt": "3 99", "answer": "3"}])
    with pytest.raises(ValueError) as e:
        _task("--prompt-data", good, "--eval-prompt-data", bad, "--eval-interval", "1")
    assert str(e.value) == f"--eval-prompt-data {bad} line 2: 'prompt': token 1 is 99, outside the vocabulary " \
                           f"[0, 96) (--vocab-size 96)"
    # A byte that is not UTF-8: the line and the byte's offset in the file (CRLF line ends count as one line end).
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "1", "answer": "1"}\r\n{"prompt": "2", "answer": "caf\xe9"}\n')
    with pytest.raises(ValueError) as e:
        _task("--prompt-data", str(tmp_path / "latin1.jsonl"))
    assert str(e.value).startswith(f"--prompt-data {tmp_path / 'latin1.jsonl'} line 2: not UTF-8 text (byte 0xe9 at "
                                   f"offset 62 of the file"), str(e.value)
    # --prompt-file: token ids, non-UTF-8 bytes, and a file without a prompt.
    for name, content, message in [
            ("ids.txt", b"1 2\n\n3 99\n", "line 3: token 1 is 99, outside the vocabulary [0, 96)"),
            ("words.txt", b"1 2\nhello\n", "line 2: NullTokenizer takes token-id prompts"),
            ("binary.txt", b"1 2\n\xff\xfe\n", "line 2: not UTF-8 text (byte 0xff at offset 4 of the file"),
            ("blank.txt", b"\n  \n", "holds no prompts (it is empty or blank)"),
            ("empty.txt", b"", "holds no prompts (it is empty or blank)")]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError) as e:
            _task("--prompt-file", str(tmp_path / name))
        assert str(e.value).startswith(f"--prompt-file {tmp_path / name} {message}"), str(e.value)


def test_reward_fn_module_that_fails_to_import(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "i22_syntax_error.py").write_text("def reward(prompts, responses):\n    return [0.0 for r in]\n")
    (tmp_path / "i22_raises.py").write_text("raise RuntimeError('needs a GPU')\n")
    (tmp_path / "i22_imports.py").write_text("import i22_no_such_package\n")
    for module, cause, message in [
            ("i22_syntax_error", SyntaxError, "SyntaxError: invalid syntax (i22_syntax_error.py, line 2)"),
            ("i22_raises", RuntimeError, "RuntimeError: needs a GPU"),
            ("i22_imports", ModuleNotFoundError, "ModuleNotFoundError: No module named 'i22_no_such_package'")]:
        with pytest.raises(ValueError) as e:
            recipe_args("--tensor-model-parallel-size", "1", "--reward-fn", f"{module}:reward")
        assert str(e.value) == f"--reward-fn ('{module}:reward'): cannot import module {module!r}: {message}"
        assert isinstance(e.value.__cause__, cause)


def test_reward_values_that_are_not_numbers_stop_every_rank():
    expected = [0.5, 1.0, 2.0, 0.25, 3.0]
    for r in run_distributed(data_cases.reward_values_case, 2):
        assert r["accepted"] == [expected] * 3, r["accepted"]
        for kind, shown in [("strings", "'0.5' (str)"), ("bools", "True (bool)"), ("nones", "None (NoneType)"),
                            ("complex", "(1+2j) (complex)"), ("numpy-bools", "np.True_ (numpy.bool)")]:
            assert r[kind] == (f"StepFailure: step 3: --reward-fn tests.data_cases:{kind} returned 4 of 4 values "
                               f"that are not numbers (int or float): the first, {shown}, for response 0; a reward "
                               f"is not converted from another type (rank 1); the run stops before anything of "
                               f"this step is saved"), r[kind]
        assert r["huge"].startswith("StepFailure: step 3: --reward-fn tests.data_cases:huge returned a value that "
                                    "is not finite as a float (int too large to convert to float) (rank 1)"), r["huge"]


@pytest.mark.parametrize("argv, message", [
    (["--prompt-data", "/no/such.jsonl"], "--prompt-data ('/no/such.jsonl') does not exist"),
    (["--prompt-data", "{csv}"], "must end in .jsonl, .json, .parquet"),
    (["--prompt-data", "{jsonl}", "--prompt-file", "{jsonl}"], "pass --prompt-data or --prompt-file, not both"),
    (["--reward-type", "exact-match"], "--reward-type exact-match needs ground truths: pass --prompt-data"),
    (["--reward-type", "format", "--reward-fn", "tests.data_cases:two_args"], "pass one of --reward-type (format)"),
    (["--reward-fn", "tests.data_cases:compute_score"], "is a verl compute_score(..., ground_truth, ...): it needs "
                                                        "--prompt-data"),
    (["--eval-interval", "2"], "--eval-interval (2) needs --eval-prompt-data"),
    (["--eval-interval", "0", "--eval-prompt-data", "{jsonl}"], "--eval-interval (0) must be ≥ 1"),
])
def test_bad_data_and_reward_flags(argv, message, tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "answer": "1"}\n')
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    argv = [a.format(jsonl=tmp_path / "d.jsonl", csv=tmp_path / "d.csv") for a in argv]
    with pytest.raises(ValueError) as e:
        recipe_args("--tensor-model-parallel-size", "1", *argv)
    assert message in str(e.value), str(e.value)


def test_eval_data_without_interval_warns(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "answer": "1"}\n')
    with pytest.warns(UserWarning, match="--eval-prompt-data .* is ignored without --eval-interval"):
        recipe_args("--tensor-model-parallel-size", "1", "--eval-prompt-data", str(tmp_path / "d.jsonl"))


def test_final_answers_and_built_in_rewards():
    cases = [  # response, ground truth, exact match, format
        ("12 + 30 = 42. #### 42", "42", 1.0, 1.0),
        ("so the total is \\boxed{1,234}.", "1234", 1.0, 1.0),
        ("\\boxed{\\frac{1}{2}} or 7", "2", 1.0, 1.0),  # the box wins over later text; its last number is 2
        ("first 7, then 8", "8", 1.0, 0.0),  # no marker: the last number of the whole response
        ("#### 42 apples, or 43", "42", 0.0, 1.0),  # after the marker, the last number counts
        ("The answer is 42.0", "42", 1.0, 0.0),
        ("-5", "5", 0.0, 0.0),
        ("72", "Natalia sold 48 + 24 = 72 clips.\n#### 72", 1.0, 0.0),  # a GSM8K ground truth
        ("#### Paris ", "Paris", 1.0, 0.0),  # no number in the ground truth: compared as text
        ("#### 12", "12.5", 0.0, 1.0),
        ("\\boxed{", "1", 0.0, 0.0),  # an unbalanced box is no final answer, and no number either
        ("####", "1", 0.0, 0.0),
    ]
    for response, truth, em, fmt in cases:
        assert (rl.exact_match(response, truth), rl.format_score(response)) == (em, fmt), (response, truth)
    tok = NullTokenizer(16)
    tok.eod = 9
    assert rl.decode_response(tok, [4, 2, 9, 5]) == "4 2"  # cut at the first end of sequence


def test_reward_functions_in_each_convention(tokenizer_dir, tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "3", "data_source": "arithmetic",
                                          "extra_info": {"index": 7}},
                                         {"prompt": "b", "answer": "#### 5", "data_source": "arithmetic",
                                          "extra_info": {"index": 2}}])
    tok = HuggingFaceTokenizer(tokenizer_dir)
    examples = _load(data, tokenizer_dir)
    responses = [tok.tokenize("it is 3") + [tok.eod] + tok.tokenize("junk"), tok.tokenize("#### 6")]
    prompts = [e.tokens for e in examples]

    def scores(*argv):
        reward = rl.build_reward(recipe_args("--tensor-model-parallel-size", "1", "--tokenizer-type",
                                             "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_dir,
                                             "--prompt-data", data, *argv), tok)
        return reward.name, list(reward.for_examples(examples)(prompts, responses))

    assert scores() == ("--reward-type exact-match", [1.0, 0.0])
    assert scores("--reward-type", "format") == ("--reward-type format", [0.0, 1.0])
    assert scores("--reward-type", "target-token", "--target-token", "5") == (
        "--target-token 5", [sum(t == 5 for t in r) / len(r) for r in responses])
    assert scores("--reward-fn", "tests.data_cases:two_args") == (
        "--reward-fn tests.data_cases:two_args", [float(len(r)) for r in responses])
    assert scores("--reward-fn", "tests.data_cases:with_answers")[1] == [len("3"), len("#### 5")]
    # verl's compute_score on the decoded text (up to the end of sequence), with data_source and extra_info.
    assert scores("--reward-fn", "tests.data_cases:compute_score")[1] == [1.0 + 0.07, 0.0 + 0.02]
    assert scores("--reward-fn", "tests.data_cases:compute_score_strings_only")[1] == [len("it is 3"),
                                                                                  len("#### 6")]
    assert rl.accuracy(tok, responses, examples) == 0.5


def _value(node):
    """An integer expression of + - * // (the generator's), evaluated without eval()."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    assert isinstance(node, ast.BinOp) and type(node.op) in ops, ast.dump(node)
    return ops[type(node.op)](_value(node.left), _value(node.right))


def test_arithmetic_task_generator(tokenizer_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "arith"

    def generate(*argv):
        monkeypatch.setattr(sys, "argv", [GENERATOR, "--output-dir", str(out), *argv])
        runpy.run_path(GENERATOR, run_name="__main__")

    generate("--num-train", "300", "--num-test", "40", "--max-operand", "20", "--parquet")
    assert "wrote 300 train and 40 test problems" in capsys.readouterr().out
    splits = {s: [json.loads(line) for line in (out / f"{s}.jsonl").open()] for s in ("train", "test")}
    assert [len(splits["train"]), len(splits["test"])] == [300, 40]
    questions = {s: {r["prompt"][0]["content"] for r in rows} for s, rows in splits.items()}
    assert len(questions["train"]) == 300 and not questions["train"] & questions["test"]
    for row in splits["train"] + splits["test"]:
        expression = row["extra_info"]["expression"]
        value = _value(ast.parse(expression, mode="eval").body)
        assert row["answer"] == str(value) and value >= 0, row
        # Every number of the expression is in the question; the problem's text reaches the answer exactly.
        assert all(n in row["prompt"][0]["content"] for n in expression.replace("//", " ").split() if n.isdigit())
        assert "####" in row["prompt"][0]["content"]
    # Both files load, the same prompts and answers; the same seed writes the same files.
    jsonl, parquet = (_load(out / f"test.{ext}", tokenizer_dir, max_positions=512) for ext in ("jsonl", "parquet"))
    assert jsonl == parquet
    before = (out / "train.jsonl").read_text()
    generate("--num-train", "300", "--num-test", "40", "--max-operand", "20", "--prompt-format", "text")
    text_rows = [json.loads(line) for line in (out / "train.jsonl").open()]
    assert [r["answer"] for r in text_rows] == [json.loads(line)["answer"] for line in before.splitlines()]
    assert text_rows[0]["prompt"].startswith("Question: ") and text_rows[0]["prompt"].endswith("\nAnswer:")
    # --instruction short: the same problems, only the prompts' last sentence differs.
    generate("--num-train", "300", "--num-test", "40", "--max-operand", "20", "--instruction", "short")
    short_rows = [json.loads(line) for line in (out / "train.jsonl").open()]
    assert [r["answer"] for r in short_rows] == [r["answer"] for r in text_rows]
    for short, long in zip(short_rows, splits["train"]):
        question = long["prompt"][0]["content"].removesuffix(" Think step by step, then give the final answer as "
                                                             "a number after '####'.")
        assert short["prompt"][0]["content"] == f"{question} Reply with only the answer, written as '#### <number>'."
    with pytest.raises(SystemExit):
        generate("--help")
    assert "examples/tasks/arithmetic.py --output-dir" in capsys.readouterr().out


@pytest.mark.slow
def test_recipe_with_prompt_data_and_held_out_accuracy(tokenizer_dir, tmp_path, monkeypatch):
    data = tmp_path / "data"
    monkeypatch.setattr(sys, "argv", [GENERATOR, "--output-dir", str(data), "--num-train", "16", "--num-test", "6",
                                      "--prompt-format", "text"])
    runpy.run_path(GENERATOR, run_name="__main__")
    # DP=2 (training TP=1 = rollout TP=1), GRPO, --lr 0: the weights of the eval are the untrained ones, which the
    # rank body generates with independently (greedy, training layout) to build answers half of which match.
    argv = ["--tensor-model-parallel-size", "1", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
            tokenizer_dir, "--prompt-data", str(data / "train.jsonl"), "--algorithm", "grpo",
            "--num-samples-per-prompt", "2", "--global-batch-size", "4", "--micro-batch-size", "2", "--train-iters",
            "2", "--max-new-tokens", "6", "--lr", "0"]
    r = run_distributed(data_cases.eval_accuracy_case, 2, argv, str(data / "test.jsonl"),
                        str(tmp_path / "eval.jsonl"), str(tmp_path / "logs"))[0]
    assert 0 < r["expected"] <= 0.5  # 3 of 6 answers can match; a response without a number matches as text
    for m in r["history"]:
        assert m["eval_accuracy"] == r["expected"], (m["eval_accuracy"], r["expected"])
        assert m["time/eval"] > 0  # the evaluation's own seconds, outside time/step
        assert m["accuracy"] == m["reward_mean"]  # the reward is exact-match: the accuracy itself
    # A bad row stops every rank with the same message, before any process group (so any collective) exists.
    bad = _jsonl(tmp_path / "bad.jsonl", ['{"prompt": "1 + 1 =", "answer": "2"}', '{"prompt": "2 + 2 ="}'])
    argv[argv.index("--prompt-data") + 1] = bad
    errors = run_distributed(data_cases.before_initialize_case, 2, argv)
    assert errors == [f"ValueError: --prompt-data {bad} line 2: no ground truth: the row has neither 'answer' nor "
                      "'reward_model.ground_truth' (fields: 'prompt')"] * 2, errors
    # So is a byte that is not UTF-8 (a UnicodeDecodeError naming neither file nor line, before).
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "1 + 1 =", "answer": "2"}\n'
                                            b'{"prompt": "caf\xe9", "answer": "2"}\n')
    argv[argv.index("--prompt-data") + 1] = str(tmp_path / "latin1.jsonl")
    errors = run_distributed(data_cases.before_initialize_case, 2, argv)
    assert errors == [f"ValueError: --prompt-data {tmp_path / 'latin1.jsonl'} line 2: not UTF-8 text (byte 0xe9 at "
                      "offset 52 of the file: invalid continuation byte); save the file as UTF-8"] * 2, errors


def test_rows_carry_their_own_stop_tokens(tmp_path):
    """A row's ``stop_token_ids`` (issue 46's per-request stop sets): kept on its example, in JSONL and parquet;
    a bad one names the file, the line and the entry."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "1 2", "answer": "3", "stop_token_ids": [7, 9]}, {"prompt": "4", "answer": "4"},
            {"prompt": "5", "answer": "5", "stop_token_ids": None}]
    task = _task("--prompt-data", _jsonl(tmp_path / "s.jsonl", rows))
    assert [e.stop_token_ids for e in task.prompts.examples] == [(7, 9), (), ()] and task.prompts.has_stop_tokens
    assert not _task("--prompt-data", _jsonl(tmp_path / "n.jsonl", rows[1:])).prompts.has_stop_tokens
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp_path / "s.parquet")
    assert [e.stop_token_ids for e in _task("--prompt-data", str(tmp_path / "s.parquet")).prompts.examples] == \
        [(7, 9), ()]
    for bad, message in [(5, "'stop_token_ids' must be a list of token ids, not int"),
                         ([3, 2.0], r"'stop_token_ids'\[1\] \(2.0\) must be an integer token id"),
                         ([True], r"'stop_token_ids'\[0\] \(True\) must be an integer token id"),
                         ([96], r"'stop_token_ids'\[0\] is 96, outside the vocabulary \[0, 96\)")]:
        path = _jsonl(tmp_path / "bad.jsonl", [rows[1], {"prompt": "1", "answer": "1", "stop_token_ids": bad}])
        with pytest.raises(ValueError, match=rf"^--prompt-data \S+bad.jsonl line 2: {message}"):
            _task("--prompt-data", path)
