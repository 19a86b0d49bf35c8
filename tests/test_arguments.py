"""Command-line checks (megatron_hybrid.rl.arguments) and --distributed-timeout-minutes on every process group.

Every numeric flag is checked before any collective, with a message naming the flag and the value. A rank that
stalls makes the others fail within the timeout instead of hanging them (the recipe end to end under torchrun).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_hybrid.checks import check_number
from megatron_hybrid.rl.arguments import add_hybrid_args, add_megatron_args, validate_args
from megatron_hybrid.rl.models import architecture_from_args

ROOT = Path(__file__).resolve().parents[1]


def _validate(*argv: str, world_size: int = 4) -> None:
    parser = add_hybrid_args(add_megatron_args(argparse.ArgumentParser()))
    validate_args(parser.parse_args(argv), world_size)


# ---------------------------------------------------------------- 1. every numeric flag is checked


@pytest.mark.parametrize("argv, message", [
    # The faults found (issue 15): each went through to training.
    (["--temperature", "nan"], "--temperature (nan) must be a finite number > 0 (use --top-k 1 for greedy)"),
    (["--lr", "nan"], "--lr (nan) must be a finite number ≥ 0"),
    (["--gamma", "nan"], "--gamma (nan) must be in [0, 1]"),
    (["--top-p", "1.5"], "--top-p (1.5) must be in [0, 1] (0 or 1: off)"),
    (["--top-k", "-3"], "--top-k (-3) must be ≥ 0 (0: off)"),
    (["--clip-ratio", "-1"], "--clip-ratio (-1.0) must be a finite number > 0"),
    (["--vocab-size", "0"], "--vocab-size (0) must be ≥ 1"),
    (["--target-token", "99"], "--target-token (99) must be a token of the vocabulary, in [0, 15] (--vocab-size 16)"),
    (["--max-position-embeddings", "4"],
     "--max-position-embeddings (4) must be at least --prompt-length (4) + --max-new-tokens (8) = 12"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes (0.0) must be a finite number > 0"),
    (["--distributed-timeout-minutes", "-5"], "--distributed-timeout-minutes (-5.0) must be a finite number > 0"),
    # Their neighbours.
    (["--lam", "1.5"], "--lam (1.5) must be in [0, 1]"),
    (["--kl-coef", "-0.1"], "--kl-coef (-0.1) must be a finite number ≥ 0"),
    (["--kl-horizon", "inf"], "--kl-horizon (inf) must be a finite number > 0"),
    (["--critic-lr", "nan"], "--critic-lr (nan) must be a finite number ≥ 0"),
    (["--clip-ratio-high", "0"], "--clip-ratio-high (0.0) must be a finite number > 0"),
    (["--reshard-bucket-size-mb", "nan"], "--reshard-bucket-size-mb (nan) must be a finite number > 0"),
    (["--num-query-groups", "0"], "--num-query-groups (0) must be ≥ 1"),  # was a ZeroDivisionError
    (["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by (0) must be ≥ 1"),
    (["--ppo-epochs", "0"], "--ppo-epochs (0) must be ≥ 1"),
    (["--save-interval", "0"], "--save-interval (0) must be ≥ 1"),
    (["--top-k", "17"], "--top-k (17) must be at most --vocab-size (16)"),
    (["--ffn-hidden-size", "99"], "--tensor-model-parallel-size (2) must divide --ffn-hidden-size (99)"),
    # Megatron's optimizer and schedule: asserts in megatron-core, usage errors here.
    (["--adam-beta2", "1"], "--adam-beta2 (1.0) must be in [0, 1)"),
    (["--adam-beta1", "nan"], "--adam-beta1 (nan) must be in [0, 1)"),
    (["--adam-eps", "0"], "--adam-eps (0.0) must be a finite number > 0"),
    (["--min-lr", "-1"], "--min-lr (-1.0) must be a finite number ≥ 0"),
    (["--lr-decay-iters", "0"], "--lr-decay-iters (0) must be ≥ 1"),
    (["--min-lr", "0.01"], "--min-lr (0.01) must be at most --lr (0.003)"),
    (["--min-lr", "1e-3", "--critic-lr", "1e-4"], "--min-lr (0.001) must be at most --critic-lr (0.0001)"),
    (["--lr-warmup-iters", "30"], "--lr-warmup-iters (30) must be less than --lr-decay-iters (30, from --train-iters)"),
    (["--lr-warmup-iters", "5", "--lr-decay-iters", "5"],
     "--lr-warmup-iters (5) must be less than --lr-decay-iters (5)"),
    (["--tis-imp-ratio-cap", "0"], "--tis-imp-ratio-cap (0.0) must be a finite number > 0"),
    # Issue 22: an overflow inside megatron-core's seeding, after the process group was up.
    (["--seed", str(2**63)], f"--seed ({2**63}) must be in [0, {2**32 - 1}] (Megatron-LM's range: it seeds numpy "
                             "with it)"),
    (["--seed", "-1"], f"--seed (-1) must be in [0, {2**32 - 1}] (Megatron-LM's range: it seeds numpy with it)"),
])
def test_bad_numbers_are_named(argv, message):
    with pytest.raises(ValueError) as e:
        _validate(*argv)
    assert str(e.value) == message


def test_distributed_optimizer_and_overlap_flags_as_megatron_lm_checks_them():
    _validate("--use-distributed-optimizer", "--sequence-parallel", "--overlap-grad-reduce", "--overlap-param-gather")
    for argv, missing in ((["--overlap-grad-reduce"], "--use-distributed-optimizer"),
                          (["--use-distributed-optimizer"], "--overlap-grad-reduce"),
                          ([], "--use-distributed-optimizer and --overlap-grad-reduce")):
        with pytest.raises(ValueError) as e:
            _validate("--overlap-param-gather", *argv)
        assert str(e.value) == f"--overlap-param-gather needs {missing} (as in Megatron-LM)"
    # Sequence parallelism without tensor parallelism: warned and turned off, as Megatron-LM does.
    args = add_hybrid_args(add_megatron_args(argparse.ArgumentParser())).parse_args(
        ["--sequence-parallel", "--tensor-model-parallel-size", "1"])
    with pytest.warns(UserWarning, match="--sequence-parallel is turned off: it needs --tensor-model-parallel-size"):
        validate_args(args, 4)
    assert args.sequence_parallel is False


MOE = ("--num-experts", "4", "--sequence-parallel")


@pytest.mark.parametrize("argv, message", [
    # Expert flags on a dense model.
    (["--moe-router-topk", "2", "--expert-model-parallel-size", "2"],
     "--moe-router-topk, --expert-model-parallel-size (2): for a mixture of experts, and the model is dense (no "
     "--num-experts)"),
    (["--rollout-expert-model-parallel-size", "2"], "--rollout-expert-model-parallel-size (2): for a mixture of "
     "experts, and the model is dense (no --num-experts)"),
    # GPTArchitecture's checks, named by flag.
    ([*MOE, "--expert-model-parallel-size", "3"], "--expert-model-parallel-size (3) must divide --num-experts (4)"),
    ([*MOE, "--moe-router-topk", "5"], "--moe-router-topk (5) must be between 1 and --num-experts (4)"),
    ([*MOE, "--moe-layer-freq", "[1,0,1]"], "--moe-layer-freq ([1, 0, 1]) must list 0 or 1 for each of the 2 layers"),
    ([*MOE, "--moe-ffn-hidden-size", "33"],
     "--expert-tensor-parallel-size (2) must divide --moe-ffn-hidden-size (33)"),
    ([*MOE, "--moe-shared-expert-gate"],
     "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size (None: no shared expert to gate)"),
    ([*MOE, "--num-experts", "0"], "--num-experts (0) must be ≥ 1"),
    # The layouts: training, rollout.
    ([*MOE, "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "2"],
     "--expert-model-parallel-size (4) × --expert-tensor-parallel-size (2) = 8 must divide "
     "--tensor-model-parallel-size (2) × data_parallel_size (2) = 4: the ranks of a pipeline stage"),
    ([*MOE, "--expert-model-parallel-size", "2", "--rollout-expert-model-parallel-size", "4"],
     "--rollout-expert-model-parallel-size (4) must divide --expert-model-parallel-size (2): a rollout rank's "
     "experts are the union of its micro-EP group's"),
    ([*MOE, "--expert-tensor-parallel-size", "1", "--rollout-expert-tensor-parallel-size", "2"],
     "--rollout-expert-tensor-parallel-size (2) must divide --expert-tensor-parallel-size (1)"),
    # The engine's rules (validation.check_expert_layout, their one home), told with the flags' names: TP wider in
    # the rollout; an exchange layout (more rollout stages) whose rollout stage of 2 ranks cannot hold 4 EP ranks.
    ([*MOE, "--rollout-tensor-model-parallel-size", "4"],
     "--rollout-tensor-model-parallel-size (4) > --tensor-model-parallel-size (2) is not supported for MoE models"),
    ([*MOE, "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1",
      "--rollout-tensor-model-parallel-size", "1", "--rollout-pipeline-model-parallel-size", "2",
      "--rollout-expert-model-parallel-size", "4"],
     "--rollout-expert-tensor-parallel-size (1) × --rollout-expert-model-parallel-size (4) must divide a rollout "
     "stage's ranks (2)"),
    (["--num-experts", "4"], "a mixture of experts (--num-experts 4) at --tensor-model-parallel-size (2) > 1 needs "
     "--sequence-parallel (as in Megatron-LM)"),
])
def test_bad_expert_flags_are_named_before_any_process_group(argv, message):
    with pytest.raises(ValueError) as e:
        _validate(*argv)
    assert str(e.value) == message


@pytest.mark.parametrize("argv", [
    ("--rollout-tensor-model-parallel-size", "1", "--rollout-pipeline-model-parallel-size", "2"),  # TP down, PP up
    ("--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
     "--rollout-tensor-model-parallel-size", "2", "--rollout-pipeline-model-parallel-size", "1"),  # TP up, PP down
    ("--rollout-tensor-model-parallel-size", "4", "--rollout-pipeline-model-parallel-size", "1"),  # TP up, d = 2
])
def test_any_rollout_layout_pair_is_accepted(argv):
    """The engine serves any pair (exchange layouts); only a rollout model that cannot be built is refused."""
    _validate(*argv)


@pytest.mark.parametrize("argv, message", [
    (["--rollout-tensor-model-parallel-size", "4", "--ffn-hidden-size", "130"],
     "--rollout-tensor-model-parallel-size (4) must divide --ffn-hidden-size (130)"),
    (["--tensor-model-parallel-size", "1", "--rollout-tensor-model-parallel-size", "4", "--group-query-attention",
      "--num-query-groups", "2"], "--rollout-tensor-model-parallel-size (4) must divide --num-query-groups (2)"),
])
def test_a_rollout_model_that_cannot_be_built_is_refused_at_start_up(argv, message):
    """The constraints table's rollout rules the flags decide (t_g | ffn, t_g | query groups), before any process
    group: the engine would refuse them only once the model is built."""
    with pytest.raises(ValueError) as e:
        _validate(*argv)
    assert str(e.value) == message


@pytest.mark.parametrize("argv", [
    ("--rollout-tensor-model-parallel-size", "1", "--rollout-pipeline-model-parallel-size", "2"),  # TP down, PP up
    ("--expert-model-parallel-size", "2", "--rollout-tensor-model-parallel-size", "1",
     "--rollout-pipeline-model-parallel-size", "2", "--rollout-expert-model-parallel-size", "2"),  # EP kept
    ("--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1",
     "--rollout-expert-model-parallel-size", "2"),  # in place, micro-EP 2
])
def test_moe_exchange_and_in_place_layouts_the_engine_serves_are_accepted(argv):
    """MoE layouts served by the engine's exchange (its MoE exchange tests: test_moe_engine, test_layout_space) are
    no longer refused by the recipe: the recipe asks the engine's own rules."""
    _validate(*MOE, *argv)


def test_rollout_layout_that_does_not_fit_the_world_is_refused():
    with pytest.raises(ValueError, match=r"--rollout-tensor-model-parallel-size \(4\) × "
                                         r"--rollout-pipeline-model-parallel-size \(2\) = 8 must divide the world "
                                         r"\(2 × 1 × 2 = 4 ranks\)"):
        _validate("--rollout-tensor-model-parallel-size", "4", "--rollout-pipeline-model-parallel-size", "2")


def test_expert_flags_take_megatron_lm_defaults_and_spellings():
    args = add_hybrid_args(add_megatron_args(argparse.ArgumentParser())).parse_args(
        [*MOE, "--expert-model-parallel-size", "2", "--moe-layer-freq", "[1, 0]"])
    validate_args(args, 4)
    assert (args.moe_layer_freq, args.moe_router_topk, args.moe_router_score_function, args.moe_aux_loss_coeff,
            args.moe_router_load_balancing_type, args.moe_token_dispatcher_type) == \
        ([1, 0], 2, "softmax", 0.0, "aux_loss", "allgather")
    arch = architecture_from_args(args, 16)
    assert (arch.num_experts, arch.moe_layer_pattern()) == (4, [1, 0])
    parser = add_megatron_args(argparse.ArgumentParser())
    assert parser.parse_args(["--moe-layer-freq", "2"]).moe_layer_freq == 2
    for bad in ("0", "([1]*3+[0])*2", "[2,1]"):  # Megatron-LM evaluates expressions; we read literals only
        with pytest.raises(SystemExit):
            parser.parse_args(["--moe-layer-freq", bad])


def test_good_values_pass():
    _validate()  # the defaults
    _validate("--distributed-timeout-minutes", "0.05", "--top-p", "1", "--top-k", "16", "--gamma", "0",
              "--target-token", "15", "--max-position-embeddings", "12")
    # The vocabulary bound applies to the built-in reward only; a --prompt-file's prompts need one position each.
    _validate("--target-token", "99", "--reward-fn", "tests.test_arguments:stall_rank_1")
    with pytest.raises(ValueError, match=r"must exceed --max-new-tokens \(8\): the prompt takes positions too"):
        _validate("--prompt-file", __file__, "--max-position-embeddings", "8")
    _validate("--prompt-file", __file__, "--max-position-embeddings", "9")


def test_log_dirs_must_be_directories(tmp_path):
    """Issue 22: a --log-dir that is a file was a FileExistsError on rank 0 (and "Connection closed by peer" on
    the others) after the process groups were up."""
    _validate("--seed", str(2**32 - 1), "--log-dir", str(tmp_path / "new" / "logs"))  # made when the run starts
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    for flag in ("--log-dir", "--tensorboard-dir"):
        with pytest.raises(ValueError) as e:
            _validate(flag, str(a_file))
        assert str(e.value) == f"{flag} ({str(a_file)!r}) is not a directory"
        with pytest.raises(ValueError) as e:
            _validate(flag, str(a_file / "logs"))
        assert str(e.value) == f"{flag} ({str(a_file / 'logs')!r}) is inside {a_file}, which is not a directory"


def test_tensorboard_dir_needs_tensorboard(monkeypatch, tmp_path):
    pytest.importorskip("tensorboard")  # a test extra
    _validate("--tensorboard-dir", str(tmp_path))
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not: its import fails
    with pytest.raises(ValueError, match=r"^--tensorboard-dir \('.*'\) needs the tensorboard package"):
        _validate("--tensorboard-dir", str(tmp_path))


def test_check_number_bounds():
    check_number("--x", 0.5, gt=0, le=1)
    with pytest.raises(ValueError, match=r"^--x \(0\.0\) must be in \(0, 1\]$"):
        check_number("--x", 0.0, gt=0, le=1)
    with pytest.raises(ValueError, match=r"^--x \(2\) must be ≤ 1$"):
        check_number("--x", 2, le=1)
    with pytest.raises(ValueError, match=r"^--x \(nan\) must be a finite number$"):
        check_number("--x", float("nan"))
    check_number("--x", 0.999, ge=0, lt=1)
    with pytest.raises(ValueError, match=r"^--x \(1\.0\) must be a finite number < 1$"):
        check_number("--x", 1.0, lt=1)


@pytest.mark.slow
def test_recipe_exits_with_the_message():
    """The recipe turns the ValueError into argparse's usage error (exit 2), before any process group."""
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "ppo" / "train_ppo.py"), "--top-p", "1.5"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "WORLD_SIZE": "4"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == "train_ppo.py: error: --top-p (1.5) must be in [0, 1] (0 or 1: off)"


def _fake_gpus(monkeypatch, count: int) -> None:
    """This process sees ``count`` GPUs (the CPU wheel's CUDA functions, faked), until ``CUDA_VISIBLE_DEVICES`` is
    set empty, as the CUDA runtime would read it before its first call."""
    import torch

    def visible() -> int:
        return 0 if os.environ.get("CUDA_VISIBLE_DEVICES") == "" else count

    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible() > 0)
    monkeypatch.setattr(torch.cuda, "device_count", visible)


def test_more_ranks_than_gpus_is_named_with_the_launches_that_work(monkeypatch, capsys):
    """Issue 43: the README's 4-rank command on a machine with one GPU died in torch.cuda.set_device on three ranks
    ('invalid device ordinal'). Now the recipe exits with the usage error before any process group."""
    _fake_gpus(monkeypatch, 1)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # recorded, so that the test's end restores the environment
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(sys, "argv", ["examples/ppo/train_ppo.py"])
    import runpy

    recipe = runpy.run_path(str(ROOT / "examples" / "ppo" / "train_ppo.py"), run_name="train_ppo")
    with pytest.raises(SystemExit) as exit_:
        recipe["parse_args"]([])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error == (
        "train_ppo.py: error: 4 ranks run on this node (torchrun --nproc_per_node 4) but 1 GPU is visible "
        "(torch.cuda.device_count() = 1): every rank needs a GPU of its own. Either run one rank per GPU, with "
        "parallel sizes whose product fits 1 rank: `torchrun --nproc_per_node 1 examples/ppo/train_ppo.py "
        "--tensor-model-parallel-size 1 --rollout-tensor-model-parallel-size 1 ...`; or keep 4 ranks on the CPU "
        "(gloo): `torchrun --nproc_per_node 4 examples/ppo/train_ppo.py ... --device cpu`"), error
    import torch.distributed as dist

    assert not dist.is_initialized()
    # The suggested one-GPU launch passes the same check; --device cpu hides the GPUs and takes the CPU.
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert recipe["parse_args"](["--tensor-model-parallel-size", "1"]).device is None
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    recipe["parse_args"](["--device", "cpu"])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    import torch

    assert not torch.cuda.is_available()


def test_device_flag_errors(monkeypatch):
    from megatron_hybrid.rl.initialize import select_device

    _fake_gpus(monkeypatch, 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    args = argparse.Namespace(device="cuda", tensor_model_parallel_size=2, rollout_tensor_model_parallel_size=1)
    with pytest.raises(ValueError, match=r"--device cuda: no GPU is visible"):
        select_device(args)
    assert select_device(argparse.Namespace(device=None), local_world_size=8) == "cpu"  # no GPU: the CPU, any count
    _fake_gpus(monkeypatch, 8)
    assert select_device(args, local_world_size=8) == "cuda"
    with pytest.raises(ValueError, match=r"^16 ranks run on this node .* but 8 GPUs are visible .*"
                                         r"--nproc_per_node 8 \S+ --tensor-model-parallel-size 2 "):
        select_device(args, local_world_size=16)
    # CUDA read its device list before the flag: hiding the GPUs would not take; say what to do instead.
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    with pytest.raises(ValueError, match=r"set CUDA_VISIBLE_DEVICES= in the launch's environment"):
        select_device(argparse.Namespace(device="cpu"))


@pytest.mark.parametrize("argv, message", [
    (["--max-tokens-per-micro-batch", "64"], "--max-tokens-per-micro-batch (64) packs sequences, which "
     "--attention-backend local (megatron-core's DotProductAttention) refuses: pass --attention-backend sdpa, flex or "
     "auto"),
    (["--max-tokens-per-micro-batch", "0"], "--max-tokens-per-micro-batch (0) must be ≥ 1"),
])
def test_packing_flags_are_checked(argv, message):
    with pytest.raises(ValueError) as e:
        _validate(*argv)
    assert str(e.value) == message


FULL = ("--recompute-granularity", "full")


@pytest.mark.parametrize("argv, message", [
    # A method or a layer count without full (Megatron-LM ignores them: the run would train without recompute).
    (["--recompute-method", "uniform"],
     "--recompute-method (uniform): for --recompute-granularity full, which is not given (no recompute without it)"),
    (["--recompute-num-layers", "1"],
     "--recompute-num-layers (1): for --recompute-granularity full, which is not given (no recompute without it)"),
    (["--recompute-method", "block", "--recompute-num-layers", "2"], "--recompute-method (block) and "
     "--recompute-num-layers (2): for --recompute-granularity full, which is not given (no recompute without it)"),
    # megatron-core's TransformerConfig: full needs a method and a layer count, 1 to the layers per stage.
    ([*FULL], "--recompute-granularity full needs --recompute-method (uniform or block), as in Megatron-LM"),
    ([*FULL, "--recompute-method", "uniform"], "--recompute-granularity full needs --recompute-num-layers (1 to the "
     "layers per pipeline stage, 2: --num-layers (2) / --pipeline-model-parallel-size (1)), as in Megatron-LM"),
    ([*FULL, "--recompute-method", "uniform", "--recompute-num-layers", "0"],
     "--recompute-num-layers (0) must be ≥ 1"),
    (["--recompute-num-layers", "-1"], "--recompute-num-layers (-1) must be ≥ 1"),
    ([*FULL, "--recompute-method", "block", "--recompute-num-layers", "3"],
     "--recompute-num-layers (3) must be at most the layers per pipeline stage, 2 (--num-layers (2) / "
     "--pipeline-model-parallel-size (1))"),
    ([*FULL, "--recompute-method", "uniform", "--recompute-num-layers", "3", "--num-layers", "4",
      "--pipeline-model-parallel-size", "2"], "--recompute-num-layers (3) must be at most the layers per pipeline "
     "stage, 2 (--num-layers (4) / --pipeline-model-parallel-size (2))"),
    # Megatron-LM: selective recomputes the core attention of every layer; no method (its assert), no layer count
    # (megatron-core's).
    (["--recompute-granularity", "selective", "--recompute-method", "uniform"], "--recompute-method (uniform): for "
     "--recompute-granularity full; selective recomputes the core attention of every layer and takes neither (as in "
     "Megatron-LM)"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"], "--recompute-num-layers (1): for "
     "--recompute-granularity full; selective recomputes the core attention of every layer and takes neither (as in "
     "Megatron-LM)"),
    # The backward's rerun of a router would not replay the rollout's experts.
    ([*FULL, "--recompute-method", "uniform", "--recompute-num-layers", "1", "--num-experts", "4",
      "--tensor-model-parallel-size", "1", "--moe-enable-routing-replay"], "--recompute-granularity full reruns the "
     "MoE routers in the backward pass, where --moe-enable-routing-replay does not replay the rollout's experts yet: "
     "use --recompute-granularity selective, or leave out one of the two"),
])
def test_bad_recompute_flags_are_named(argv, message):
    with pytest.raises(ValueError) as e:
        _validate(*argv)
    assert str(e.value) == message


@pytest.mark.parametrize("argv, fields", [
    ([], {}),  # the default: no recompute, the TransformerConfig as before
    ([*FULL, "--recompute-method", "uniform", "--recompute-num-layers", "1"],
     dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
    ([*FULL, "--recompute-method", "block", "--recompute-num-layers", "2"],
     dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)),
    (["--recompute-granularity", "selective"], dict(recompute_granularity="selective", recompute_method=None,
                                                    recompute_num_layers=None)),
])
def test_recompute_flags_become_transformer_config_fields(argv, fields):
    """Flags that pass are TransformerConfig fields megatron-core accepts (its __post_init__ checks them)."""
    from megatron_hybrid.rl.arguments import recompute_config

    args = add_hybrid_args(add_megatron_args(argparse.ArgumentParser())).parse_args(argv)
    validate_args(args, 4)
    assert recompute_config(args) == fields
    config = architecture_from_args(args, args.vocab_size).transformer_config(tensor_model_parallel_size=2,
                                                                              **recompute_config(args))
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == \
        tuple(fields.get(k) for k in ("recompute_granularity", "recompute_method", "recompute_num_layers"))
    with pytest.raises(SystemExit):  # argparse: Megatron-LM's choices only
        add_hybrid_args(add_megatron_args(argparse.ArgumentParser())).parse_args(["--recompute-method", "all"])


def test_a_token_budget_below_the_longest_sequence_is_named_before_any_process_group():
    """The built-in task's prompts are 4 tokens, --max-new-tokens 8: a budget of 11 cannot hold a sequence."""
    from megatron_hybrid.rl import load_task

    parser = add_hybrid_args(add_megatron_args(argparse.ArgumentParser()))
    args = parser.parse_args(["--tensor-model-parallel-size", "1", "--attention-backend", "sdpa",
                              "--max-tokens-per-micro-batch", "11"])
    validate_args(args, 1)
    with pytest.raises(ValueError, match=r"^--max-tokens-per-micro-batch \(11\) must be at least the longest sequence: "
                                         r"the longest prompt \(4 tokens\) \+ --max-new-tokens \(8\) = 12$"):
        load_task(args)
    args.max_tokens_per_micro_batch = 12
    assert load_task(args).prompts.max_length == 4
    import torch.distributed as dist

    assert not dist.is_initialized()


# ---------------------------------------------------------------- 2. a stalled rank ends the job in time

TIMEOUT_S = 6.0  # --distributed-timeout-minutes 0.1 (gloo's connect takes it too: 3 s timed out on a busy machine)
# torchrun notices a failed worker within a second and stops the others with SIGTERM; the survivors' teardown takes
# a few seconds more on 2 cores. A group left at megatron-core's default would wait 30 minutes.
GRACE_S = 30.0


def stall_rank_1(prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
    """A ``--reward-fn`` that stalls rank 1 (as ``kill -STOP`` would) and notes when, in $MH_STALL_FILE."""
    if os.environ.get("RANK") == "1" and "MH_STALL_FILE" in os.environ:
        Path(os.environ["MH_STALL_FILE"]).write_text(repr(time.time()))
        time.sleep(240)  # ends by itself even if the test could not stop it
    return [0.0] * len(responses)


@pytest.mark.slow
def test_stalled_rank_ends_the_recipe_within_the_timeout(tmp_path):
    """Rank 1 stalls in its reward function; rank 0 goes on into the log-prob pass and waits in Megatron's
    tensor-parallel group, which must give up after --distributed-timeout-minutes (a fraction of a minute)."""
    stall_file = tmp_path / "stalled_at"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MH_STALL_FILE": str(stall_file)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "ppo" / "train_ppo.py"), "--tensor-model-parallel-size", "2",
           "--distributed-timeout-minutes", str(TIMEOUT_S / 60), "--reward-fn", "tests.test_arguments:stall_rank_1",
           "--global-batch-size", "4", "--micro-batch-size", "4", "--train-iters", "2", "--no-progress"]
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=tmp_path)
        try:
            proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            # torchrun stops its workers on SIGTERM (they run in sessions of their own: killing torchrun's
            # process group would leave them running).
            proc.terminate()
            proc.wait(timeout=60)
            pytest.fail(f"the job was still running 180 s after it started:\n{log.read_text()[-3000:]}")
    stderr = log.read_text()
    ended = time.time()
    assert proc.returncode != 0, stderr[-3000:]
    assert stall_file.exists(), stderr[-3000:]  # the stall happened (the failure is not something else)
    waited = ended - float(stall_file.read_text())
    assert waited < TIMEOUT_S + GRACE_S, (waited, stderr[-3000:])
    assert "timed out" in stderr.lower(), stderr[-3000:]
    # Rank 0 says where it waited, for how long, and where the rank it waited for is (gloo alone names neither).
    assert ("PhaseTimeout: phase 'train step > reward > agree on errors' (step 1) failed on rank 0 (RuntimeError: "
            in stderr), stderr[-3000:]
    assert (f"; the timeout is {TIMEOUT_S:g} s (--distributed-timeout-minutes {TIMEOUT_S / 60:g}); did not arrive: "
            f"rank 1 is in 'train step > reward' (step 1)" in stderr), stderr[-3000:]


def test_rollout_kv_cache_is_sized_to_the_prompts(tmp_path):
    # The cache's slots hold the longest prompt (training or held-out) plus --max-new-tokens, not the model's whole
    # context: at SmolLM2-135M's 8,192 positions the default 64 slots were 24 GiB and a CPU run was OOM-killed.
    from megatron_hybrid import rl
    from tests.rl_cases import recipe_args

    prompts = tmp_path / "p.txt"
    prompts.write_text("0 1 2\n0 1 2 3 4 5 6\n")  # the default NullTokenizer: ids separated by spaces
    args = recipe_args("--tensor-model-parallel-size", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", "16",
                       "--prompt-file", str(prompts), "--max-new-tokens", "5", "--inference-max-requests", "8")
    task = rl.load_task(args)
    assert task.prompts.max_length == 7
    assert (task.generation.max_sequence_length, task.generation.max_batch_size) == (7 + 5, 8)
    args.inference_max_seq_length = 20
    assert rl.load_task(args).generation.max_sequence_length == 20
    args.inference_max_seq_length = 11
    with pytest.raises(ValueError, match=r"--inference-max-seq-length \(11\) must hold the longest prompt \(7 "
                                         r"tokens\) plus --max-new-tokens \(5\)"):
        rl.load_task(args)
    with pytest.raises(ValueError, match=r"--inference-max-requests \(0\)"):
        _validate("--inference-max-requests", "0")
