"""Real models end to end (issue 15, acceptance 1): tiny random-weight Llama (tied embeddings) and Qwen2 (q/k/v
biases, untied) saved with transformers → tools' converter → the recipe with ``--pretrained-checkpoint`` (GRPO on
Llama, PPO on Qwen2; training TP=2, rollout TP=1, 3 steps) → ``--export-hf`` → transformers loads the export, its
logits are the trained actor's and its weights moved; and the argument errors, before any collective. Issue 24,
acceptance 5: a tiny Qwen3-MoE through the same path with GRPO at EP=2 → rollout EP=1 (the reward rises), PPO with an
MoE critic, and the MoE flags against the checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megatron_hybrid.convert import hf_to_megatron
from tests import ppo_cases, real_model_cases
from tests.harness import run_distributed
from tests.real_model_cases import save_tiny_hf_model

TOKENS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
# fp32 on both sides; megatron-core at TP=2 adds row-parallel partial sums that transformers adds in one matmul,
# so logits (|z| < 2 here) differ by reordered fp32 sums, ~1e-6. A wrong mapping (a swapped head, a bias or norm
# dropped, the embedding of the wrong side) or the weights of another step move them by ≥ 1e-2 (the training moves
# them by more than 1e-2: asserted below), so 1e-5 separates the two.
LOGITS_TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """family → (Hugging Face directory, converted checkpoint): Llama stored at TP=1, Qwen2 at TP=2."""
    root = tmp_path_factory.mktemp("real")
    out = {}
    for family, stored_tp in (("llama", 1), ("qwen2", 2)):
        hf, mg = root / family, root / f"{family}-mcore"
        save_tiny_hf_model(str(hf), family)
        hf_to_megatron(hf, mg, tensor_model_parallel_size=stored_tp, progress=False)
        out[family] = (hf, mg)
    return out


def _recipe(mg: Path, export: Path, *extra: str) -> list[str]:
    return ["--pretrained-checkpoint", str(mg), "--export-hf", str(export), "--tensor-model-parallel-size", "2",
            "--rollout-tensor-model-parallel-size", "1", "--train-iters", "3", "--global-batch-size", "4",
            "--micro-batch-size", "2", "--prompt-length", "4", "--max-new-tokens", "4", "--ppo-epochs", "1",
            "--lr", "1e-2", "--reward-fn", "tests.real_model_cases:parity_reward", *extra]


def _hf_logits(directory: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def _check_export(export: Path, hf: Path, mg: Path, trained_logits: torch.Tensor) -> None:
    from transformers import AutoTokenizer

    torch.testing.assert_close(_hf_logits(export), trained_logits, **LOGITS_TOL)
    assert (_hf_logits(hf) - trained_logits).abs().max() > 1e-2  # the comparison above sees the training
    start, trained = _weights(hf), _weights(export)
    assert sorted(trained) == sorted(start)
    assert [k for k in start if torch.equal(start[k], trained[k])] == []  # every tensor trained
    assert json.loads((export / "config.json").read_text())["model_type"] == \
        json.loads((hf / "config.json").read_text())["model_type"]
    tokenizer = AutoTokenizer.from_pretrained(str(export))  # the tokenizer came along, chat template and all
    assert tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False) == \
        "<|im_start|>user\n2+2?<|im_end|>\n"
    text = "Tom has 3 apples.\nHow many?"  # tokenised as the recipe did (from hf_assets/)
    assert tokenizer(text).input_ids == AutoTokenizer.from_pretrained(str(mg / "hf_assets"))(text).input_ids
    assert not [p.name for p in export.parent.iterdir() if p.name.startswith(".")]  # no partial directory left


def _train(mg: Path, tmp_path: Path, *extra: str) -> dict:
    return run_distributed(real_model_cases.train_and_export, 2, _recipe(mg, tmp_path / "export", *extra),
                           str(tmp_path / "logs"), TOKENS, 128, tensor_model_parallel_size=2)[0]


@pytest.mark.slow
def test_grpo_llama_tied_pretrained_to_hf(models, tmp_path):
    hf, mg = models["llama"]
    r = _train(mg, tmp_path, "--algorithm", "grpo", "--num-samples-per-prompt", "2", "--export-hf-interval", "2")
    assert [m["step"] for m in r["metrics"]] == [1, 2, 3]
    assert r["metrics"][0]["kl"] == 0.0  # the reference policy starts from the actor's (pretrained) weights
    assert r["iterations"] == [2, None]
    _check_export(tmp_path / "export", hf, mg, r["logits"])
    assert (tmp_path / "export" / "iter_0000002" / "model.safetensors").is_file()  # kept by the final export
    assert _hf_logits(tmp_path / "export" / "iter_0000002").sub(r["logits"]).abs().max() > 1e-3  # step 2 ≠ 3


@pytest.mark.slow
def test_ppo_qwen2_untied_qkv_bias_pretrained_to_hf(models, tmp_path):
    hf, mg = models["qwen2"]
    r = _train(mg, tmp_path, "--algorithm", "ppo")
    assert r["metrics"][0]["kl"] == 0.0 and r["iterations"] == [None]
    _check_export(tmp_path / "export", hf, mg, r["logits"])


def test_actor_reference_and_critic_start_from_the_checkpoint(models):
    hf, mg = models["qwen2"]  # stored at TP=2 with the vocabulary padded for it, loaded at TP=2
    for r in run_distributed(real_model_cases.pretrained_models_case, 2, str(mg), TOKENS,
                             tensor_model_parallel_size=2):
        torch.testing.assert_close(r["logits"], _hf_logits(hf), **LOGITS_TOL)
        assert r["reference"] == []
        assert r["critic"] == ["output_layer.bias", "output_layer.weight"]  # only the value head is new


@pytest.mark.slow
def test_export_from_pipeline_stages_is_bit_exact_and_atomic(models, tmp_path):
    """TP=1 × PP=2 with tied embeddings (the last stage holds a copy): the untrained export is the original bit
    for bit; a rank whose write fails fails the export on every rank and leaves nothing behind."""
    hf, mg = models["llama"]
    out = tmp_path / "export"
    failed = run_distributed(real_model_cases.export_case, 2, str(mg), str(out), fail_on_rank=1,
                             pipeline_model_parallel_size=2)
    assert all("No space left on device" in r["error"] and "rank 1" in r["error"] for r in failed)
    assert list(tmp_path.iterdir()) == []
    results = run_distributed(real_model_cases.export_case, 2, str(mg), str(out), pipeline_model_parallel_size=2)
    assert [r["written"] for r in results] == [str(out)] * 2
    start, exported = _weights(hf), _weights(out)
    assert sorted(exported) == sorted(start)
    assert [k for k in start if not torch.equal(start[k], exported[k])] == []
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
    # Issue 22: the export marks its directory; an earlier export may be replaced, not what else it holds. At
    # start-up (argument validation) and again just before the rename onto it, on every rank.
    marker = json.loads((out / "megatron_hybrid_export.json").read_text())
    assert marker["format"] == "megatron_hybrid.export_hf" and "model.safetensors" in marker["files"]
    _validated("--pretrained-checkpoint", str(mg), "--export-hf", str(out))
    (out / "notes.txt").write_text("mine\n")
    with pytest.raises(ValueError, match=r"^--export-hf \('.*'\) holds notes.txt, which no export wrote"):
        _validated("--pretrained-checkpoint", str(mg), "--export-hf", str(out))
    refused = run_distributed(real_model_cases.export_case, 2, str(mg), str(out), pipeline_model_parallel_size=2)
    assert all(f"{out} holds notes.txt, which no export wrote" in r["error"] for r in refused), refused
    assert (out / "notes.txt").read_text() == "mine\n" and sorted(_weights(out)) == sorted(start)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_export_hf_refuses_to_replace_anything_but_an_earlier_export(models, tmp_path):
    """Issue 22: ``--export-hf DIR`` replaced whatever DIR was (other files, the --save directory, the directory
    holding --prompt-data: all gone, exit 0). Refused at argument validation, before any process group."""
    _, mg = models["llama"]
    save, data, other = tmp_path / "ckpt", tmp_path / "data", tmp_path / "other"
    for d in (save, data, other):
        d.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("2\n")
    (data / "train.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    (other / "notes.txt").write_text("mine\n")
    (tmp_path / "a_file").write_text("mine\n")
    (tmp_path / "link").symlink_to(save)
    pre = ["--pretrained-checkpoint", str(mg)]
    for argv, message in [
        (["--export-hf", str(other)], f"--export-hf ({str(other)!r}) holds notes.txt, which no export wrote "
                                      "(an export replaces its whole directory): pick a new or empty directory"),
        (["--export-hf", str(save), "--save", str(save)],
         f"--export-hf ({str(save)!r}) and --save ({str(save)!r}) must not contain one another"),
        (["--export-hf", str(tmp_path / "link" / "hf"), "--save", str(save)],  # the same, through a symlink
         f"--export-hf ({str(tmp_path / 'link' / 'hf')!r}) and --save ({str(save)!r}) must not contain one another"),
        (["--export-hf", str(data), "--prompt-data", str(data / "train.jsonl")],
         f"--export-hf ({str(data)!r}) and --prompt-data ({str(data / 'train.jsonl')!r}) must not contain one "
         "another"),
        (["--export-hf", str(save / "hf"), "--load", str(save)],
         f"--export-hf ({str(save / 'hf')!r}) and --load ({str(save)!r}) must not contain one another"),
        (["--export-hf", str(tmp_path), "--log-dir", str(tmp_path / "logs")],
         f"--export-hf ({str(tmp_path)!r}) and --log-dir ({str(tmp_path / 'logs')!r}) must not contain one another"),
        (["--export-hf", str(tmp_path / "a_file")], f"--export-hf ({str(tmp_path / 'a_file')!r}) is not a directory"),
        (["--export-hf", str(tmp_path / "a_file" / "hf")],
         f"--export-hf ({str(tmp_path / 'a_file' / 'hf')!r}) is inside {tmp_path / 'a_file'}, which is not a "
         "directory"),
    ]:
        with pytest.raises(ValueError) as e:
            _validated(*pre, *argv)
        assert str(e.value).startswith(message), (argv, str(e.value))
    (tmp_path / "empty").mkdir()
    for fine in (tmp_path / "empty", tmp_path / "new" / "hf"):  # an empty or a new directory
        _validated(*pre, "--export-hf", str(fine), "--save", str(save), "--log-dir", str(tmp_path / "logs"))
    assert (other / "notes.txt").read_text() == "mine\n"


# ---- a mixture of experts (issue 24, acceptance 5) -------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Qwen3-MoE (4 experts of 32, top-2; an MoE layer, then a dense one) and its conversion, stored at
    TP=1 × EP=2 × ETP=1 (the runs load it at other layouts)."""
    root = tmp_path_factory.mktemp("moe")
    hf, mg = root / "qwen3_moe", root / "qwen3_moe-mcore"
    save_tiny_hf_model(str(hf), "qwen3_moe")
    hf_to_megatron(hf, mg, expert_model_parallel_size=2, expert_tensor_parallel_size=1, progress=False)
    return hf, mg


@pytest.mark.slow
def test_grpo_qwen3_moe_at_ep2_rollout_ep1_learns_and_exports_to_hf(moe_model, tmp_path):
    """Qwen3-MoE saved by transformers → converter → GRPO on 4 ranks: training TP=2 (sequence parallel) × DP=2,
    the experts over EP=2 × expert TP=2 (an EP group spans both DP replicas), generating at TP=1 × EP=1 × expert
    TP=1 through the HybridEngine, on the built-in target-token task → --export-hf: transformers' logits of the
    export are the trained actor's, the reward rises, and the load-balancing loss (a training setting, on top of
    the checkpoint's none) is logged."""
    hf, mg = moe_model
    argv = ["--pretrained-checkpoint", str(mg), "--export-hf", str(tmp_path / "export"),
            "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
            "--rollout-tensor-model-parallel-size", "1", "--rollout-expert-model-parallel-size", "1",
            "--moe-aux-loss-coeff", "1e-3", "--moe-router-load-balancing-type", "aux_loss",
            "--algorithm", "grpo", "--num-samples-per-prompt", "4", "--reward-type", "target-token",
            "--train-iters", "12", "--global-batch-size", "16", "--micro-batch-size", "8", "--prompt-length", "4",
            "--max-new-tokens", "8", "--ppo-epochs", "1", "--lr", "2e-2"]
    r = run_distributed(real_model_cases.train_and_export, 4, argv, str(tmp_path / "logs"), TOKENS, 128,
                        tensor_model_parallel_size=2, expert_model_parallel_size=2)[0]
    metrics = r["metrics"]
    first, last = (sum(m["reward_mean"] for m in part) / 5 for part in (metrics[:5], metrics[-5:]))
    assert last - first >= 0.3, [m["reward_mean"] for m in metrics]
    assert all(0 < loss < 4 for m in metrics for loss in m["load_balancing_loss"])  # 1 when balanced
    assert max(m["rollout_mismatch/logp_abs_diff_max"] for m in metrics) < 1e-4  # rollout layout ≈ training's
    # LOGITS_TOL: both fp32; the expert and attention sums are split over TP/EP ranks in training and whole in
    # transformers, ~1e-6 apart; a swapped expert or a wrong router mapping moves them by ≥ 1e-2.
    _check_export(tmp_path / "export", hf, mg, r["logits"])


def test_ppo_on_an_moe_actor_and_critic_trunk(moe_model, tmp_path):
    """PPO with an MoE critic trunk (2 ranks: EP=2 over DP=2, rollout EP=1) on a reward that varies: finite
    losses, both models' load-balancing losses logged."""
    _, mg = moe_model
    argv = ["--pretrained-checkpoint", str(mg), "--tensor-model-parallel-size", "1",
            "--expert-model-parallel-size", "2", "--rollout-expert-model-parallel-size", "1",
            "--moe-aux-loss-coeff", "1e-2", "--moe-router-load-balancing-type", "aux_loss", "--algorithm", "ppo",
            "--reward-fn", "tests.real_model_cases:parity_reward",
            "--train-iters", "3", "--global-batch-size", "8", "--micro-batch-size", "4", "--prompt-length", "4",
            "--max-new-tokens", "4", "--ppo-epochs", "1", "--lr", "1e-2"]
    metrics = run_distributed(ppo_cases.run_main, 2, argv, str(tmp_path / "logs"), expert_model_parallel_size=2)[0]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for key in ("pg_loss", "vf_loss", "load_balancing_loss", "critic_load_balancing_loss", "actor_grad_norm",
                "critic_grad_norm"):
        assert all(math.isfinite(v) for m in metrics for v in m[key]), key
    assert max(abs(v) for m in metrics for v in m["vf_loss"]) > 0  # a reward that varies: the critic learns


def test_moe_flags_come_from_the_checkpoint(moe_model, models):
    _, mg = moe_model
    pre = ("--pretrained-checkpoint", str(mg), "--tensor-model-parallel-size", "1",
           "--expert-model-parallel-size", "2")
    args = _validated(*pre, "--moe-layer-freq", "[1,0]", "--moe-aux-loss-coeff", "0.01")  # agreeing; a setting
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size, args.moe_layer_freq,
            args.moe_router_pre_softmax, args.moe_aux_loss_coeff, args.moe_router_load_balancing_type) == \
        (4, 2, 32, [1, 0], False, 0.01, "none")  # Qwen3-MoE's HF config asks for no router logits: no balancing
    for flag, value, stored in (("--num-experts", "8", "4"), ("--moe-layer-freq", "1", "[1, 0]"),
                                ("--moe-router-pre-softmax", None, "False")):
        with pytest.raises(ValueError) as e:
            _validated(*pre, flag, *([value] if value else []))
        assert str(e.value) == (f"{flag} ({value or True}) contradicts --pretrained-checkpoint {str(mg)!r}, whose "
                                f"model has {stored}; leave the flag out to take the checkpoint's")
    _, dense = models["llama"]
    with pytest.raises(ValueError, match=r"^--num-experts \(4\) contradicts .*, whose model has None"):
        _validated("--pretrained-checkpoint", str(dense), "--num-experts", "4")
    with pytest.raises(ValueError) as e:
        _validated("--pretrained-checkpoint", str(dense), "--moe-router-topk", "2", "--expert-model-parallel-size",
                   "2")
    assert str(e.value) == (f"--moe-router-topk, --expert-model-parallel-size (2): for a mixture of experts, and "
                            f"the model is dense (--pretrained-checkpoint {str(dense)!r} has no experts)")


# ---- errors, before any collective ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--pretrained-checkpoint", "/no/such/dir"], "--pretrained-checkpoint ('/no/such/dir') is not a directory"),
    (["--pretrained-checkpoint", "{hf}"], "is not a converted checkpoint"),  # a Hugging Face directory
    (["--pretrained-checkpoint", "{mg}", "--num-layers", "4"],
     "--num-layers (4) contradicts --pretrained-checkpoint '{mg}', whose model has 2"),
    (["--pretrained-checkpoint", "{mg}", "--untie-embeddings-and-output-weights"],
     "--untie-embeddings-and-output-weights (True) contradicts --pretrained-checkpoint '{mg}', whose model has "
     "False"),
    (["--pretrained-checkpoint", "{mg}", "--hidden-size", "64", "--swiglu", "--tensor-model-parallel-size", "3"],
     "--tensor-model-parallel-size (3) must divide --num-attention-heads (4)"),
    (["--export-hf", "out"], "--export-hf ('out') needs --pretrained-checkpoint"),
    (["--pretrained-checkpoint", "{mg}", "--export-hf-interval", "2"], "--export-hf-interval (2) needs --export-hf"),
    (["--pretrained-checkpoint", "{mg}", "--export-hf", "{mg}/x"], "must not contain one another"),
    # The model the checkpoint was converted from is no export (issue 22: it would have been replaced).
    (["--pretrained-checkpoint", "{mg}", "--export-hf", "{hf}"], "holds chat_template.jinja, config.json, "
     "generation_config.json and 3 more, which no export wrote"),
])
def test_bad_pretrained_arguments_fail_at_start_up(models, argv, message, monkeypatch, capsys):
    import torch.distributed as dist

    hf, mg = models["llama"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        ppo_cases.run_recipe([a.format(hf=hf, mg=mg) for a in argv])
    assert e.value.code == 2
    assert message.format(hf=hf, mg=mg) in capsys.readouterr().err
    assert not dist.is_initialized()


def _validated(*argv: str):
    import argparse

    from megatron_hybrid.rl.arguments import add_hybrid_args, add_megatron_args, validate_args

    args = add_hybrid_args(add_megatron_args(argparse.ArgumentParser())).parse_args(argv)
    validate_args(args, 2)
    return args


def test_model_flags_come_from_the_checkpoint(models):
    _, mg = models["qwen2"]
    args = _validated("--pretrained-checkpoint", str(mg), "--hidden-size", "64")  # agreeing flags are fine
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_query_groups, args.swiglu,
            args.untie_embeddings_and_output_weights) == (2, 64, 128, 2, True, True)
    assert (args.tokenizer_type, args.tokenizer_model) == ("HuggingFaceTokenizer", str(mg / "hf_assets"))
    assert _validated().num_layers == 2  # without a checkpoint: the built-in tiny model
