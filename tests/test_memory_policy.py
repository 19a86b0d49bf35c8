"""Rollout memory on the card (issue 45, steps 2 and 3): the KV cache sized to --inference-memory-fraction of the
card, and --offload-optimizer auto|always|never, against the byte arithmetic done by hand on a simulated card."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from megatron_hybrid.inference import GenerationConfig
from megatron_hybrid.megatron.models import GPTArchitecture
from megatron_hybrid.rl.memory_policy import (MemoryInfo, RolloutMemoryPolicy, cache_tokens, graph_reserve_bytes,
                                              kv_bytes_per_token)

GiB = 2**30
# Qwen2.5-7B's attention: 28 layers, 28 heads / 4 KV groups of head dim 128, bf16.
QWEN7B = GPTArchitecture(num_layers=28, hidden_size=3584, num_attention_heads=28, num_query_groups=4,
                         ffn_hidden_size=18944, vocab_size=152064, make_vocab_size_divisible_by=128,
                         params_dtype="bfloat16")


def test_kv_bytes_per_token_by_hand():
    # Keys and values (2) x 28 layers x 4 KV heads x 128 x 2 bytes = 57,344 bytes a position at rollout TP 1.
    assert kv_bytes_per_token(QWEN7B, rollout_tp=1, rollout_pp=1) == 2 * 28 * 4 * 128 * 2 == 57344
    # TP 2 holds 2 of the 4 KV heads, PP 2 14 of the layers; TP 8 still one head (the groups are replicated).
    assert kv_bytes_per_token(QWEN7B, rollout_tp=2, rollout_pp=2) == 57344 // 4
    assert kv_bytes_per_token(QWEN7B, rollout_tp=8, rollout_pp=1) == 2 * 28 * 1 * 128 * 2
    # The generator's own count agrees (the cache it lays out).
    from megatron_hybrid.inference.kv_cache import CacheGeometry
    assert CacheGeometry.bytes_per_token(28, 4, 128, torch.bfloat16) == 57344


def test_graph_reserve_by_hand():
    # 8 fp32 copies of 256 slots' logits over the padded vocabulary (152,064, a multiple of 128) + 1 GiB.
    assert graph_reserve_bytes(QWEN7B, rollout_tp=1, max_requests=256) == 8 * 256 * 152064 * 4 + GiB


def _policy(total_gib, used_gib, *, fraction=None, offload="auto", slots=256, length=1536, reserve_gib=2.0):
    config = GenerationConfig(max_batch_size=slots, max_sequence_length=length)
    info = MemoryInfo(free=int((total_gib - used_gib) * GiB), total=int(total_gib * GiB))
    return RolloutMemoryPolicy(config, fraction=fraction, offload=offload, per_token=57344,
                               reserve=int(reserve_gib * GiB), device=torch.device("cpu"),
                               memory_info=lambda device: info)


def test_the_cache_takes_what_the_fraction_leaves():
    # 80 GiB card at 0.9: 72 GiB, of which 20 are held after the switch and 2 reserved for the graphs: 50 GiB of
    # cache = 50 · 2^30 / 57,344 positions = 936,228, i.e. 609 sequences of 1,536: capped at 256 slots.
    policy = _policy(80, 20, fraction=0.9)
    config = policy.sized()
    assert config.cache_tokens == cache_tokens(fraction=0.9, total=80 * GiB, used=20 * GiB, reserve=2 * GiB,
                                               per_token=57344) == (int(0.9 * 80 * GiB) - 22 * GiB) // 57344
    assert policy.slots == 256 and policy.sized() is config  # sized once
    # 60 GiB held: 10 GiB of cache, 121 sequences.
    small = _policy(80, 60, fraction=0.9)
    assert small.sized().cache_tokens // 1536 == small.slots == (int(0.9 * 80 * GiB) - 62 * GiB) // 57344 // 1536
    assert small.slots == 121


def test_a_cache_below_one_sequence_names_both_lengths():
    policy = _policy(80, 71, fraction=0.9)  # 72 - 71 - 2 < 0: no cache at all
    with pytest.raises(ValueError, match=r"the KV cache gets 0 positions .* fewer than one sequence of "
                                         r"--inference-max-seq-length \(1536\) positions"):
        policy.sized()


def test_offload_when_the_rollout_does_not_fit_beside_the_training_state():
    # The full cache: 256 x 1,536 x 57,344 B = 21 GiB, + 2 GiB reserve = 23 GiB.
    assert _policy(80, 40).full_cache_bytes == 256 * 1536 * 57344 == 21 * GiB
    assert _policy(80, 40).offload() is False  # 0.9 x 80 - 40 = 32 GiB of room
    assert _policy(80, 50).offload() is True  # 22 GiB of room
    assert _policy(80, 50, fraction=1.0).offload() is False  # 30 GiB
    assert _policy(80, 10, offload="always").offload() is True
    with pytest.raises(ValueError, match=re.escape("--offload-optimizer never: the rollout needs 23.00 GiB (a KV "
                                                   "cache of 256 x 1536 positions, 21.00 GiB, and 2.00 GiB for the "
                                                   "step graphs) but 22.00 GiB of 0.9 x 80.00 GiB are free")):
        _policy(80, 50, offload="never").offload()


def test_on_the_cpu_the_fraction_is_ignored_and_auto_never_offloads():
    config = GenerationConfig(max_batch_size=8, max_sequence_length=64)
    with pytest.warns(RuntimeWarning, match=r"--inference-memory-fraction \(0.5\) is ignored on the CPU"):
        policy = RolloutMemoryPolicy(config, fraction=0.5, offload="auto", per_token=64, reserve=0,
                                     device=torch.device("cpu"))
    assert policy.offload() is False and policy.sized() is config and policy.slots == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fraction: no warning
        assert RolloutMemoryPolicy(config, fraction=None, offload="always", per_token=64, reserve=0,
                                   device=torch.device("cpu")).offload() is True


@pytest.mark.parametrize("argv, message", [
    (["--inference-memory-fraction", "1.5"], "--inference-memory-fraction (1.5) must be in (0, 1]"),
    (["--inference-memory-fraction", "0"], "--inference-memory-fraction (0.0) must be in (0, 1]"),
])
def test_bad_fractions_are_named_before_any_process_group(argv, message):
    from tests.rl_cases import recipe_args

    with pytest.raises(ValueError, match=re.escape(message)):
        recipe_args("--tensor-model-parallel-size", "1", *argv)


def test_no_offload_optimizer_is_never():
    from tests.rl_cases import recipe_args

    one = ("--tensor-model-parallel-size", "1")
    assert recipe_args(*one, "--no-offload-optimizer").offload_optimizer == "never"
    assert recipe_args(*one).offload_optimizer == "auto"
    assert recipe_args(*one, "--offload-optimizer", "always").offload_optimizer == "always"


@pytest.mark.parametrize("argv, message", [
    (["--optimizer-cpu-offload"], "--optimizer-cpu-offload needs --use-distributed-optimizer (as in Megatron-LM)"),
    (["--use-precision-aware-optimizer"], "--use-precision-aware-optimizer needs --use-distributed-optimizer"),
    (["--use-distributed-optimizer", "--optimizer-cpu-offload"],
     "--optimizer-cpu-offload needs --use-precision-aware-optimizer (as in Megatron-LM"),
    (["--use-distributed-optimizer", "--optimizer-cpu-offload", "--use-precision-aware-optimizer"],
     "--optimizer-cpu-offload moves the optimizer's "
     "states from the GPU to the host and steps them there: it needs a GPU (this run trains on the CPU)"),
    (["--use-distributed-optimizer", "--optimizer-offload-fraction", "1.5"],
     "--optimizer-offload-fraction (1.5) must be in [0, 1]"),
    (["--overlap-cpu-optimizer-d2h-h2d"], "--overlap-cpu-optimizer-d2h-h2d needs --optimizer-cpu-offload"),
])
def test_optimizer_cpu_offload_flags_are_checked(argv, message):
    # Issue 45, step 3: megatron-core's optimizer CPU offload, reachable with Megatron-LM's flags (a GPU feature:
    # HybridDeviceOptimizer copies between CUDA streams), checked as megatron-core's OptimizerConfig asserts them.
    from tests.rl_cases import recipe_args

    with pytest.raises(ValueError, match=re.escape(message)):
        recipe_args("--tensor-model-parallel-size", "1", *argv)


def test_optimizer_cpu_offload_flags_reach_the_optimizer_config(monkeypatch):
    from megatron_hybrid.rl import arguments
    from megatron_hybrid.rl.optimizer import optimizer_config
    from tests.rl_cases import recipe_args

    assert not optimizer_config(recipe_args("--tensor-model-parallel-size", "1"), lr=1e-3).optimizer_cpu_offload
    monkeypatch.setattr(arguments, "_cuda_available", lambda: True)  # as on a GPU machine
    args = recipe_args("--tensor-model-parallel-size", "1", "--use-distributed-optimizer", "--optimizer-cpu-offload",
                       "--use-precision-aware-optimizer", "--optimizer-offload-fraction", "0.5",
                       "--overlap-cpu-optimizer-d2h-h2d")
    config = optimizer_config(args, lr=1e-3)
    assert (config.optimizer_cpu_offload, config.optimizer_offload_fraction, config.overlap_cpu_optimizer_d2h_h2d,
            config.use_distributed_optimizer, config.use_precision_aware_optimizer) == (True, 0.5, True, True, True)


def test_phase_mfu_and_peak_memory_aggregate(monkeypatch):
    """Issue 45, step 4: a phase's model FLOPs become its MFU (the mean over the ranks of FLOPs / (seconds · peak))
    and, on a GPU, its peak memory (the largest on any rank); simulated here on one gloo rank."""
    from megatron_hybrid.rl import metrics
    from tests.harness import run_distributed

    out = run_distributed(_aggregate_case, 1)[0]
    assert out["throughput/update_mfu"] == pytest.approx(6e12 / 2.0 / 989e12)
    assert out["memory/update_peak_gib"] == 3.0
    assert metrics.training_flops([torch.nn.Linear(3, 4)], 10) == 6 * 10 * (3 * 4 + 4)


def _aggregate_case():
    from megatron_hybrid.rl import metrics

    metrics.peak_flops = lambda: 989e12  # as on an H100
    timer = metrics.StepTimer()
    timer.add("update", 2.0, tokens=100, flops=6e12)
    timer.peak_bytes["update"] = 3 * 2**30
    return metrics.aggregate_metrics({"x": 1.0}, timer)


@pytest.mark.slow
def test_rl_step_bench_smoke(tmp_path):
    """bench/rl_step.py (issue 45, step 5) on the CPU: measured steps after the warm-up, each with its phases (which
    sum to at most the step) and a summary of their medians; responses end at the bench's end token, so they vary."""
    import json
    import subprocess
    import sys

    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, "bench/rl_step.py", "--smoke", "--out", str(out)], check=True, timeout=600,
                   capture_output=True)
    rows = json.loads(out.read_text())
    steps, summary = [r for r in rows if r["kind"] == "step"], rows[-1]
    assert len(steps) == 2 and summary["kind"] == "summary" and [r["step"] for r in steps] == [2, 3]
    for r in steps:
        phases = ("generation", "switch", "reward", "actor_log_probs", "reference_log_probs", "update")
        assert sum(r[f"time/{p}"] for p in phases) <= r["time/step"]
        assert 0 < r["response_length"] <= 24
    assert summary["time/step"] == sorted(r["time/step"] for r in steps)[0] + (
        sorted(r["time/step"] for r in steps)[1] - sorted(r["time/step"] for r in steps)[0]) / 2
