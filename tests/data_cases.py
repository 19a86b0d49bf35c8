"""Reward functions and rank bodies for the data and reward tests (tests/test_data.py): ``--reward-fn`` functions
in each calling convention, and a recipe run with ``--prompt-data`` and ``--eval-interval`` whose held-out
accuracy is computed again beside it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.ppo_cases import run_main
from tests.rl_cases import recipe_args


def two_args(prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
    """The original convention: token lists only; the response length."""
    return [float(len(r)) for r in responses]


def with_answers(prompts: list[list[int]], responses: list[list[int]], *, answers: list) -> list[float]:
    """Token lists and the ground truths: the length of the answer."""
    return [float(len(a)) for a in answers]


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict = None) -> dict:
    """verl's convention, returning a dict as verl's reward managers accept: 1 when the text ends with the answer,
    plus the row's index / 100 (to show extra_info arrives)."""
    assert data_source == "arithmetic", data_source
    return {"score": float(solution_str.strip().endswith(ground_truth)) + extra_info["index"] / 100, "extra": 0}


def compute_score_strings_only(solution_str, ground_truth, method="strict"):
    """verl's convention as its gsm8k scorer spells it (no data_source, no extra_info): the text's length."""
    return len(solution_str)


def eval_accuracy_case(argv: list[str], eval_source: str, eval_path: str, log_dir: str) -> dict:
    """The held-out accuracy of the untrained actor, computed here (the recipe's seeds, greedy generation on the
    training layout, answers that the responses of every other prompt match), then the recipe with ``--lr 0``
    (weights stay put) and ``--eval-interval 1`` on those answers. Rank 0 returns both."""
    import json

    from megatron.core import parallel_state as ps
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_hybrid import rl
    from megatron_hybrid.inference import generate_with_model
    from megatron_hybrid.rl.rewards import final_answer_text, last_number

    args = recipe_args(*argv)
    tokenizer = rl.build_tokenizer(args)
    arch = rl.model_architecture(args, tokenizer.vocab_size)
    model_parallel_cuda_manual_seed(args.seed)  # as rl.initialize seeds, before the recipe builds its actor
    torch.manual_seed(args.seed)
    model = rl.build_stage(arch, device=torch.device("cpu"))
    examples = rl.load_prompt_data(eval_source, tokenizer, max_new_tokens=args.max_new_tokens,
                                   max_positions=arch.max_position_embeddings)
    results = generate_with_model(model, [e.tokens for e in examples],
                                  SamplingParams(top_k=1, top_p=0.0, num_tokens_to_generate=args.max_new_tokens),
                                  tp_group=ps.get_tensor_model_parallel_group(),
                                  pp_group=ps.get_pipeline_model_parallel_group(), vocab_size=tokenizer.vocab_size,
                                  stop_token_ids=[tokenizer.eod])
    texts = [rl.decode_response(tokenizer, r.generated_tokens) for r in results]
    answers = []
    for i, text in enumerate(texts):
        number = last_number(final_answer_text(text)[0])
        answers.append("987654321" if i % 2 else str(number) if number is not None else text.strip())
    expected = sum(rl.exact_match(t, a) for t, a in zip(texts, answers)) / len(texts)
    if dist.get_rank() == 0:
        with open(eval_source) as src, open(eval_path, "w") as dst:
            for line, answer in zip(src, answers):
                dst.write(json.dumps(dict(json.loads(line), answer=answer)) + "\n")
    dist.barrier()
    history = run_main(argv + ["--eval-prompt-data", eval_path, "--eval-interval", "1"], log_dir)
    return {"expected": expected, "history": history}


def before_initialize_case(argv: list[str]) -> str:
    """The recipe's error for ``argv`` when reaching :func:`megatron_hybrid.rl.initialize` (the first process group,
    hence the first collective) is itself an error: a data error raised first is raised before any collective."""
    from megatron_hybrid import rl
    from tests import fault_cases

    def initialize(args):
        raise RuntimeError("rl.initialize reached")

    saved, rl.initialize = rl.initialize, initialize
    try:
        return fault_cases.recipe_error_case(argv)
    finally:
        rl.initialize = saved


def reward_values_case() -> dict:
    """:func:`megatron_hybrid.rl.reward_scores` of reward functions whose values are numbers of several kinds (every
    rank), then of functions that return something else on rank 1 only: that rank's error, raised on every rank."""
    from decimal import Decimal
    from fractions import Fraction

    import numpy as np

    from megatron_hybrid import rl

    def on_rank_1(value):
        return lambda prompts, responses: [value if dist.get_rank() == 1 else 0.5] * len(responses)

    expected = [0.5, 1.0, 2.0, 0.25, 3.0]
    numbers = [lambda p, r: [0.5, 1, np.float32(2.0), Fraction(1, 4), Decimal(3)],
               lambda p, r: torch.tensor(expected), lambda p, r: np.array(expected)]
    prompts, responses = [[1]] * 5, [[2]] * 5
    out: dict = {"accepted": [rl.reward_scores(fn, prompts, responses, step=3, name="n").tolist() for fn in numbers]}
    for kind, value in [("strings", "0.5"), ("bools", True), ("nones", None), ("complex", 1 + 2j),
                        ("numpy-bools", np.True_), ("huge", 10 ** 400)]:
        try:
            rl.reward_scores(on_rank_1(value), prompts[:4], responses[:4], step=3,
                             name=f"--reward-fn tests.data_cases:{kind}")
            out[kind] = ""
        except rl.StepFailure as e:
            out[kind] = f"{type(e).__name__}: {e}"
    return out
