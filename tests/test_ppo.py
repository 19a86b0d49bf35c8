"""PPO/GRPO: the algorithm pieces against hand-computed values, and the recipe (examples/ppo/train_ppo.py, run as a
script) on 4 gloo ranks (training TP=2 × DP=2, rollout TP=1): the reward rises, resuming reproduces the
uninterrupted run, hybrid resharding changes no loss, and bad arguments fail at start-up."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from megatron_hybrid import rl
from megatron_hybrid.rl import ppo
from tests import ppo_cases
from tests.harness import run_distributed
from tests.rl_cases import recipe_args

T = torch.tensor


# ---- algorithm pieces ------------------------------------------------------------------------------------------
def test_gae_hand_computed():
    adv, ret = ppo.compute_gae(T([[0.0, 0.0, 1.0]]), T([[0.5, 0.6, 0.7]]), torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, T([[0.5, 0.4, 0.3]]))
    torch.testing.assert_close(ret, T([[1.0, 1.0, 1.0]]))
    # gamma 0.9, lambda 0.5: δ2 = 1 − 0.7 = 0.3; δ1 = 0.9·0.7 − 0.6 = 0.03, A1 = 0.03 + 0.45·0.3 = 0.165;
    # δ0 = 0.9·0.6 − 0.5 = 0.04, A0 = 0.04 + 0.45·0.165 = 0.11425.
    adv, _ = ppo.compute_gae(T([[0.0, 0.0, 1.0]]), T([[0.5, 0.6, 0.7]]), torch.ones(1, 3), gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, T([[0.11425, 0.165, 0.3]]))
    # Padding after the last real token: its reward and value are ignored, the episode ends at the last token.
    adv, ret = ppo.compute_gae(T([[0.0, 2.0, 9.0]]), T([[1.0, 1.0, 5.0]]), T([[1.0, 1.0, 0.0]]), gamma=1.0,
                               lam=1.0)
    torch.testing.assert_close(adv, T([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(ret, T([[2.0, 2.0, 0.0]]))


def test_clipped_policy_loss_hand_computed():
    # ratio 1.5, A=+1: max(−1.5, −1.2) = −1.2 (clipped); ratio 0.5, A=+1: max(−0.5, −0.8) = −0.5;
    # ratio 1.5, A=−1: max(1.5, 1.2) = 1.5. Mean (−1.2 − 0.5 + 1.5) / 3.
    logp = torch.log(T([[1.5, 0.5, 1.5]]))
    loss, stats = ppo.policy_loss(logp, torch.zeros(1, 3), T([[1.0, 1.0, -1.0]]), torch.ones(1, 3), clip_ratio=0.2)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.5) / 3)
    assert stats["clipfrac"].item() == pytest.approx(1 / 3)
    # An asymmetric upper clip (clip-higher): ratio 1.5 with A=+1 is clipped at 1.3.
    loss, _ = ppo.policy_loss(logp[:, :1], torch.zeros(1, 1), T([[1.0]]), torch.ones(1, 1), clip_ratio=0.2,
                              clip_ratio_high=0.3)
    assert loss.item() == pytest.approx(-1.3)
    # Masked tokens do not count.
    loss, _ = ppo.policy_loss(logp, torch.zeros(1, 3), T([[1.0, 1.0, -1.0]]), T([[1.0, 0.0, 0.0]]), clip_ratio=0.2)
    assert loss.item() == pytest.approx(-1.2)


def test_truncated_importance_sampling_hand_computed():
    # The clipped surrogate's per-token terms, as above: (−1.2, −0.5, +1.5). The rollout gave the tokens
    # probabilities 0.5, 1 and 0.25 of the old policy's (old log-probs 0): TIS weights π_old / π_rollout = 2, 1, 4,
    # capped at 3 → 2, 1, 3. Loss (−1.2·2 − 0.5·1 + 1.5·3) / 3; one token of three capped.
    logp = torch.log(T([[1.5, 0.5, 1.5]])).requires_grad_(True)
    rollout = torch.log(T([[0.5, 1.0, 0.25]])).requires_grad_(True)
    args = (torch.zeros(1, 3), T([[1.0, 1.0, -1.0]]), torch.ones(1, 3))
    loss, stats = ppo.policy_loss(logp, *args, clip_ratio=0.2, rollout_logp_BT=rollout, tis_imp_ratio_cap=3.0)
    assert loss.item() == pytest.approx((-1.2 * 2 - 0.5 * 1 + 1.5 * 3) / 3)
    assert stats["tis_capfrac"].item() == pytest.approx(1 / 3)
    assert stats["clipfrac"].item() == pytest.approx(1 / 3)  # the clip is the surrogate's, before the weights
    loss.backward()
    # d/d log π: 0 where clipped; −A·r·w / 3 elsewhere (r = 0.5, w = 1; r = 1.5, A = −1, w = 3). The weights
    # are detached: nothing flows into the rollout's log-probs.
    torch.testing.assert_close(logp.grad, T([[0.0, -0.5 / 3, 1.5]]))
    assert rollout.grad is None
    # Off (no cap): the rollout's log-probs are not read; a cap without them is an error.
    plain, _ = ppo.policy_loss(logp, *args, clip_ratio=0.2, rollout_logp_BT=rollout)
    assert plain.item() == pytest.approx((-1.2 - 0.5 + 1.5) / 3)
    with pytest.raises(ValueError, match=r"tis_imp_ratio_cap \(3.0\) needs the rollout's log-probs"):
        ppo.policy_loss(logp, *args, clip_ratio=0.2, tis_imp_ratio_cap=3.0)


def test_rollout_mismatch_hand_computed():
    old = T([[0.0, -1.0, -2.0], [-0.5, 0.0, 0.0]])
    rollout = T([[0.1, -1.0, -2.5], [-0.5, 9.0, 9.0]])  # the 9s are padding: masked out
    m = ppo.rollout_mismatch(old, rollout, T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]))
    # Δ = old − rollout over the real tokens: −0.1, 0, 0.5, 0.
    expected = {"logp_abs_diff_mean": 0.6 / 4, "logp_abs_diff_max": 0.5,
                "ratio_mean": (math.exp(-0.1) + 2 + math.exp(0.5)) / 4, "ratio_min": math.exp(-0.1),
                "ratio_max": math.exp(0.5)}
    assert {k: pytest.approx(v.item()) for k, v in m.items()} == {f"rollout_mismatch/{k}": v
                                                                  for k, v in expected.items()}


def test_value_clipping_hand_computed():
    # V = 2, V_old = 1, R = 3, clip 0.5: unclipped (2 − 3)² = 1, clipped (1.5 − 3)² = 2.25 → ½ · 2.25.
    loss, stats = ppo.value_loss(T([[2.0]]), T([[1.0]]), T([[3.0]]), torch.ones(1, 1), clip=0.5)
    assert loss.item() == pytest.approx(1.125)
    assert stats["vf_clipfrac"].item() == 1.0
    loss, _ = ppo.value_loss(T([[2.0]]), T([[1.0]]), T([[3.0]]), torch.ones(1, 1), clip=None)
    assert loss.item() == pytest.approx(0.5)


def test_kl_estimators_and_penalty_rewards():
    logp, ref = T([[0.0]]), T([[-0.5]])
    assert ppo.kl_per_token(logp, ref, "k1").item() == pytest.approx(0.5)
    assert ppo.kl_per_token(ref, logp, "abs").item() == pytest.approx(0.5)
    assert ppo.kl_per_token(logp, ref, "mse").item() == pytest.approx(0.125)
    assert ppo.kl_per_token(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    with pytest.raises(ValueError, match="'k2'"):
        ppo.kl_per_token(logp, ref, "k2")
    # −0.5 · KL on every real token, the score on the last real one.
    r = ppo.token_rewards(T([1.0]), T([[0.1, 0.2, 0.3]]), T([[1.0, 1.0, 0.0]]), kl_coef=0.5)
    torch.testing.assert_close(r, T([[-0.05, 0.9, 0.0]]))


def test_kl_controllers():
    fixed = ppo.make_kl_controller(ppo.KLConfig("fixed", 0.1))
    fixed.update(100.0, 10)
    assert fixed.value == 0.1
    adaptive = ppo.make_kl_controller(ppo.KLConfig("adaptive", 0.1, kl_target=1.0, kl_horizon=100.0))
    adaptive.update(2.0, 10)  # error clipped to +0.2: × (1 + 0.2 · 10 / 100)
    assert adaptive.value == pytest.approx(0.102)
    adaptive.update(0.9, 10)  # error −0.1: × (1 − 0.1 · 10 / 100)
    assert adaptive.value == pytest.approx(0.102 * 0.99)
    restored = ppo.make_kl_controller(ppo.KLConfig("adaptive", 0.5, kl_target=1.0, kl_horizon=100.0))
    restored.load_state_dict(adaptive.state_dict())
    assert restored.value == adaptive.value


def test_grpo_advantages_and_whitening():
    # Group 1: mean 0.5, unbiased std √(1/3): ±0.5·√3; group 2 all equal: 0.
    adv = ppo.grpo_advantages(T([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]), group_size=4)
    h = 0.5 * math.sqrt(3)
    torch.testing.assert_close(adv, T([h, -h, -h, h, 0.0, 0.0, 0.0, 0.0]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="group_size"):
        ppo.grpo_advantages(T([1.0, 2.0, 3.0]), group_size=2)
    # Mean 2 and unbiased variance 1 over the masked positions.
    white = ppo.masked_whiten(T([[1.0, 2.0, 3.0, 4.0]]), T([[1.0, 1.0, 1.0, 0.0]]), eps=0.0)
    torch.testing.assert_close(white, T([[-1.0, 0.0, 1.0, 0.0]]))
    # Nothing masked in (partial rollout's off-policy mask can leave a step none): zeros, not a division by zero.
    assert ppo.masked_whiten(T([[1.0, 2.0]]), T([[0.0, 0.0]])).tolist() == [[0.0, 0.0]]


def _reference_logp_entropy(full, labels, vocab_size, temperature):
    z = (full / temperature).masked_fill(torch.arange(full.shape[-1]) >= vocab_size, float("-inf"))
    logp_all = z.log_softmax(-1)
    p = logp_all.exp()
    ent = -(p * logp_all.masked_fill(p == 0, 0.0)).sum(-1)
    return logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1), ent


def test_vocab_parallel_logprobs_entropy_matches_full_softmax():
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 5, 16, generator=g)
    labels = torch.randint(0, 13, (2, 5), generator=g)
    ref_logp, ref_ent = _reference_logp_entropy(full, labels, 13, 0.7)
    logp, ent = ppo.vocab_parallel_logprobs_entropy(full, labels, vocab_size=13, temperature=0.7)
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(ent, ref_ent)


def test_vocab_parallel_logprobs_entropy_tp2():
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 5, 16, generator=g).requires_grad_(True)
    labels = torch.randint(0, 13, (2, 5), generator=g)
    ref_logp, ref_ent = _reference_logp_entropy(full, labels, 13, 0.7)
    (ref_logp.sum() + 0.5 * ref_ent.sum()).backward()
    for r in run_distributed(ppo_cases.vocab_parallel_case, 2, 13, tensor_model_parallel_size=2):
        # fp32, the softmax sums split in two and added: ~1e-7 relative; 1e-5 catches a wrong shard or reduction.
        torch.testing.assert_close(r["logp"], ref_logp.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["entropy"], ref_ent.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["grad"], full.grad[..., r["rank"] * 8: (r["rank"] + 1) * 8], rtol=1e-5,
                                   atol=1e-6)


# ---- arguments -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--tensor-model-parallel-size", "3"], "world size (4) must be a multiple of --tensor-model-parallel-size (3)"),
    (["--global-batch-size", "30"], "--global-batch-size (30) must be a multiple of --micro-batch-size (8)"),
    (["--rollout-tensor-model-parallel-size", "3"], "--rollout-tensor-model-parallel-size (3)"),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "1"],
     "--pipeline-model-parallel-size (2) must divide --num-layers (3)"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/no/such/dir"], "'/no/such/dir'"),
    (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "/no/such.model"], "'/no/such.model'"),
    (["--tokenizer-type", "SentencePieceTokenizer"], "needs --tokenizer-model"),
    (["--reward-fn", "no_such_module_xyz:score"], "cannot import module 'no_such_module_xyz'"),
    (["--reward-fn", "math:no_such_function"], "has no function 'no_such_function'"),
    (["--reward-fn", "math"], "must be 'module:function'"),
    (["--algorithm", "grpo"], "needs --num-samples-per-prompt ≥ 2"),
    (["--load", "/no/such/ckpt"], "latest_checkpointed_iteration.txt"),
])
def test_bad_arguments_fail_at_start_up(argv, message, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    import torch.distributed as dist

    # The recipe in this process: it must exit before initialising any process group.
    with pytest.raises(SystemExit) as e:
        ppo_cases.run_recipe(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not dist.is_initialized()


def test_help_lists_megatron_names(capsys):
    with pytest.raises(SystemExit):
        ppo_cases.run_recipe(["--help"])
    out = capsys.readouterr().out
    for flag in ("--tensor-model-parallel-size", "--rollout-tensor-model-parallel-size", "--hybrid-weight-mode",
                 "--kl-ctl-type", "--num-samples-per-prompt", "--bf16", "--lr-decay-style", "--adam-beta2",
                 "--use-distributed-optimizer", "--sequence-parallel", "--overlap-grad-reduce",
                 "--overlap-param-gather", "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
                 "torchrun --nproc_per_node 4"):
        assert flag in out


# ---- the recipe on 4 ranks -------------------------------------------------------------------------------------
def _run(argv, log_dir, *, tensor_model_parallel_size=2, pipeline_model_parallel_size=1):
    """The recipe on 4 ranks; its metrics (one dict per step) as rank 0 logged them to ``log_dir``."""
    return run_distributed(ppo_cases.run_main, 4, argv, str(log_dir),
                           tensor_model_parallel_size=tensor_model_parallel_size,
                           pipeline_model_parallel_size=pipeline_model_parallel_size)[0]


def _rise(history, k=3):
    first = sum(m["reward_mean"] for m in history[:k]) / k
    last = sum(m["reward_mean"] for m in history[-k:]) / k
    return first, last


@pytest.mark.slow
def test_ppo_reward_rises(tmp_path):
    history = _run(["--train-iters", "12"], tmp_path)
    first, last = _rise(history)
    # The untrained policy emits the target token at ~1/16; measured (this machine): 0.09 → 0.83 over 12 steps.
    assert last - first >= 0.4, (first, last)
    assert all(m["switch_bytes"] > 0 for m in history)  # a real layout change every step
    assert {"step", "reward_mean", "kl", "entropy", "switch_seconds", "switch_bytes"} <= history[0].keys()


@pytest.mark.slow
def test_grpo_reward_rises(tmp_path):
    history = _run(["--algorithm", "grpo", "--num-samples-per-prompt", "4", "--train-iters", "12"], tmp_path)
    first, last = _rise(history)
    assert last - first >= 0.4, (first, last)


def _timing(key):
    return key == "switch_seconds" or key.startswith(("time/", "throughput/", "switch/", "memory/"))


def _same(a, b):
    return {k: v for k, v in a.items() if not _timing(k)} == {k: v for k, v in b.items() if not _timing(k)}


@pytest.mark.slow
def test_resume_reproduces_uninterrupted_run(tmp_path):
    # bf16 with fp32 main parameters and a warmup + cosine schedule: the checkpoint must carry both exactly.
    common = ["--offload-reference", "--kl-ctl-type", "adaptive", "--kl-target", "0.01", "--kl-horizon", "100",
              "--bf16", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine"]
    ckpt = tmp_path / "ckpt"
    full = _run(common + ["--train-iters", "4"], tmp_path / "full")
    # Stopped after 2 of 4 iterations (the schedule of the whole run), resumed with the whole run's flags.
    first = _run(common + ["--train-iters", "2", "--lr-decay-iters", "4", "--save", str(ckpt)], tmp_path / "first")
    assert (ckpt / "iter_0000002").is_dir() and not list(ckpt.glob(".*tmp"))
    resumed = _run(common + ["--train-iters", "4", "--load", str(ckpt), "--save", str(ckpt)], tmp_path / "resumed")
    assert [m["step"] for m in resumed] == [3, 4]  # the resumed run's log holds its own steps only
    # Iteration k runs at the rate of sample (k − 1) · 32: warmup from 0 over the first, then cosine to 0 at 4.
    assert [m["lr"] for m in full] == pytest.approx([0.0, 3e-3, 2.25e-3, 0.75e-3])
    assert all(_same(a, b) for a, b in zip(first, full[:2]))
    for a, b in zip(resumed, full[2:]):
        assert _same(a, b), (a, b)


@pytest.mark.parametrize("pp", [1, 2], ids=["tp2xdp2", "tp2xpp2"])
@pytest.mark.slow
def test_hybrid_rollout_gives_the_losses_of_training_layout_generation(pp, tmp_path):
    # Rollout TP=1 (× PP=1): from TP=2 × DP=2 a micro-DP gather; from TP=2 × PP=2 also the cross-stage path.
    argv = ["--train-iters", "2", "--pipeline-model-parallel-size", str(pp), "--micro-batch-size", "4"]
    hybrid, plain = (_run(argv + extra, tmp_path / name, pipeline_model_parallel_size=pp)
                     for name, extra in (("hybrid", []), ("plain", ["--no-hybrid-rollout"])))
    # Same seeds, same samples: the losses are computed in the training layout either way, so they are identical
    # (exact comparison), and only the switch costs differ.
    for h, p in zip(hybrid, plain):
        assert p["switch_bytes"] == 0 and h["switch_bytes"] > 0
        for key in ("reward_mean", "kl", "entropy", "pg_loss", "vf_loss", "approx_kl", "clipfrac"):
            assert h[key] == p[key], (key, h[key], p[key])
        # Either generator's log-probs are the training passes' up to rounding (fp32; seen <= 5e-7).
        assert max(h["rollout_mismatch/logp_abs_diff_max"], p["rollout_mismatch/logp_abs_diff_max"]) < 1e-5


@pytest.mark.slow
def test_activation_recompute_trains_as_without_it(tmp_path):
    """Issue 44, step 5: the recipe with --recompute-granularity full --recompute-method uniform
    --recompute-num-layers 1 (actor and critic; their log-prob and value passes run the checkpointed forward under
    no_grad) logs every metric of the run without it, exactly: on the CPU the reruns are the same kernels on the same
    inputs. Generation is unchanged too, on the HybridEngine's rollout model (training TP=2, rollout TP=1) and on the
    training model itself (--no-hybrid-rollout, which generates in eval mode: no recompute). 2 steps on 2 ranks."""
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    plain, rerun, training_layout = (
        run_distributed(ppo_cases.run_main, 2, ["--train-iters", "2"] + extra, str(tmp_path / name),
                        tensor_model_parallel_size=2)[0]
        for name, extra in (("plain", []), ("recompute", recompute),
                            ("training-layout", recompute + ["--no-hybrid-rollout"])))
    assert len(plain) == len(rerun) == len(training_layout) == 2
    for p, r, t in zip(plain, rerun, training_layout):
        assert _same(p, r), (p, r)
        assert r["switch_bytes"] > 0 and t["switch_bytes"] == 0
        for key in ("reward_mean", "kl", "entropy", "pg_loss", "vf_loss", "actor_grad_norm", "critic_grad_norm"):
            assert t[key] == p[key], (key, t[key], p[key])


@pytest.mark.slow
def test_offload_policies_train_alike(tmp_path):
    """Issue 45, step 3: --offload-optimizer always (states, fp32 main parameters and gradients to the host at every
    switch, back after it, bit for bit), never, and auto (on the CPU: never) log the same metrics; so does
    --inference-memory-fraction, ignored on the CPU. 2 steps on 2 ranks (training TP=2, rollout TP=1)."""
    runs = {name: run_distributed(ppo_cases.run_main, 2, ["--train-iters", "2"] + extra, str(tmp_path / name),
                                  tensor_model_parallel_size=2)[0]
            for name, extra in (("auto", []), ("always", ["--offload-optimizer", "always"]),
                                ("never", ["--no-offload-optimizer", "--inference-memory-fraction", "0.5"]))}
    for name in ("always", "never"):
        assert len(runs[name]) == 2
        for a, b in zip(runs["auto"], runs[name]):
            assert _same(a, b), (name, a, b)


PHASES = ("generation", "switch", "reward", "actor_log_probs", "reference_log_probs", "critic_values", "update")


@pytest.mark.slow
def test_metrics_timing_mismatch_and_tensorboard(tmp_path):
    # 2 ranks: training TP=2, rollout TP=1 (a micro-DP gather); sampling at T = 0.7, so the rollout's log-probs
    # must be tempered to match; TIS on with a cap that ratios near 1 never reach (the same training). Learned
    # absolute positions (the other recipe tests use rope): the rollout model must build and match them too.
    tensorboard = importlib.util.find_spec("tensorboard") is not None  # a test extra; optional for the recipe
    tb = tmp_path / "tb"
    argv = ["--train-iters", "2", "--temperature", "0.7", "--tis-imp-ratio-cap", "2",
            "--position-embedding-type", "learned_absolute"]
    history = run_distributed(ppo_cases.run_main, 2, argv + ["--tensorboard-dir", str(tb)] * tensorboard,
                              str(tmp_path / "logs"), tensor_model_parallel_size=2)[0]
    defaults = recipe_args("--tensor-model-parallel-size", "1")
    B = defaults.global_batch_size
    for m in history:
        # (accuracy is logged with --prompt-data's ground truths; the built-in task has none)
        assert {"reward_mean", "response_length", "kl", "entropy", "clipfrac", "actor_grad_norm", "critic_grad_norm",
                "lr", "tis_capfrac"} <= m.keys()
        assert all(m[f"time/{p}"] > 0 for p in PHASES), m
        assert sum(m[f"time/{p}"] for p in PHASES) <= m["time/step"]
        # Issue 45, step 4: each way of the switch (on the CPU nothing is offloaded: --offload-optimizer auto).
        assert m["switch/to_rollout_seconds"] > 0 and m["switch/to_training_seconds"] > 0
        # (the reporting rank's; switch_seconds is the slowest rank's)
        assert m["switch/to_rollout_seconds"] + m["switch/to_training_seconds"] <= m["switch_seconds"] * 1.000001
        assert m["switch/offload_gib"] == 0
        # One DP replica: response_length is the mean over all B sequences, each with a prompt of --prompt-length.
        assert m["throughput/generation_tokens_per_second"] == pytest.approx(
            m["response_length"] * B / m["time/generation"])
        assert m["throughput/update_tokens_per_second"] == pytest.approx(
            defaults.ppo_epochs * (defaults.prompt_length + m["response_length"]) * B / m["time/update"])
        # The same fp32 weights in both layouts: only rounding differs (rollout TP=1 with the KV cache, training
        # TP=2): seen <= 5e-7; an untempered rollout would be off by far more at T = 0.7.
        assert m["rollout_mismatch/logp_abs_diff_mean"] <= m["rollout_mismatch/logp_abs_diff_max"] < 1e-5
        for key in ("ratio_min", "ratio_mean", "ratio_max"):
            assert m[f"rollout_mismatch/{key}"] == pytest.approx(1.0, abs=1e-5)
        assert m["tis_capfrac"] == [0.0] * defaults.ppo_epochs
    if tensorboard:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tb))
        events.Reload()
        for key in ("reward_mean", "kl", "lr", "actor_grad_norm", "time/update",
                    "throughput/generation_tokens_per_second", "rollout_mismatch/logp_abs_diff_max"):
            logged = [sum(m[key]) / len(m[key]) if isinstance(m[key], list) else m[key] for m in history]
            scalars = events.Scalars(key)
            assert [e.step for e in scalars] == [1, 2]
            assert [e.value for e in scalars] == pytest.approx(logged, rel=1e-6)  # float32 in the event file


@pytest.mark.slow
def test_reward_function_and_reward_model(tmp_path):
    history = _run(["--train-iters", "1", "--reward-fn", "tests.ppo_cases:constant_reward"], tmp_path / "fn")
    assert history[0]["reward_mean"] == 0.5
    model = tmp_path / "reward_model"
    run_distributed(ppo_cases.save_constant_reward_model, 4, str(model), 0.25, tensor_model_parallel_size=2)
    # Loaded at another layout than it was saved from (full tensors in the file).
    history = _run(["--train-iters", "1", "--reward-model-load", str(model), "--tensor-model-parallel-size", "1",
                    "--micro-batch-size", "4"], tmp_path / "rm", tensor_model_parallel_size=1)
    assert history[0]["reward_mean"] == 0.25


def test_tokenizers(tmp_path):
    model = ppo_cases.write_sentencepiece_model(str(tmp_path))
    (tmp_path / "prompts.txt").write_text("the cat sat\nthe dog ran to\n")
    argv = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model, "--prompt-file",
            str(tmp_path / "prompts.txt"), "--max-new-tokens", "4", "--train-iters", "1"]
    history = _run(argv, tmp_path / "logs")
    assert 0 < history[0]["response_length"] <= 4
    # Hugging Face: a word-level tokenizer directory, built here.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "</s>": 1, "the": 2, "cat": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="[UNK]").save_pretrained(
        tmp_path / "hf")
    hf = rl.build_tokenizer(recipe_args("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                        str(tmp_path / "hf"), "--tensor-model-parallel-size", "1"))
    assert (hf.vocab_size, hf.eod, hf.tokenize("the cat")) == (4, 1, [2, 3])
    null = rl.build_tokenizer(recipe_args("--tensor-model-parallel-size", "1"))
    assert null.tokenize(null.detokenize([3, 1, 4])) == [3, 1, 4]


@pytest.mark.slow
def test_packed_recipe_learns_as_the_padded_one(tmp_path):
    """Issue 44, step 4: the recipe with --max-tokens-per-micro-batch (sequences of 4 + 8 tokens packed 3 to a
    micro-batch of at most 40 tokens, sdpa attention) learns the built-in task as the padded path does, over the
    same 12 steps and seed, on 4 data-parallel ranks."""
    common = ["--train-iters", "12", "--tensor-model-parallel-size", "1"]
    padded = _run(common, tmp_path / "padded", tensor_model_parallel_size=1)
    packed = _run(common + ["--attention-backend", "sdpa", "--max-tokens-per-micro-batch", "40"],
                  tmp_path / "packed", tensor_model_parallel_size=1)

    def rise(history):
        first, last = _rise(history)
        return last - first

    assert rise(packed) >= 0.4, rise(packed)
    assert abs(rise(packed) - rise(padded)) <= 0.1, (rise(packed), rise(padded))
    # The packed passes balance the DP ranks' tokens (rl.balance_batch): never worse than generation left them
    # (here every response is --max-new-tokens long, so nothing moves; tests/test_packing.py moves sequences).
    assert all(h["dp_balance/max_over_mean_after"] <= h["dp_balance/max_over_mean_before"] for h in packed)
