"""RL checkpoints in megatron-core's dist_checkpointing format (issue 15, Build 4 and Acceptance 4): a checkpoint
saved at TP=2 × DP=2 loads at TP=1 × DP=2 and at TP=1 × PP=2 with the parameters, fp32 main parameters and Adam
moments equal to the gathered originals bit for bit, also with the distributed optimizer (issue 16, Acceptance 4:
its DP slices gathered into each parameter's shape and shards); a rank SIGKILLed during a save leaves ``latest`` at
the previous iteration. (Resuming the recipe exactly: tests/test_ppo.py, tests/test_ppo_distopt.py; damaged
checkpoints: tests/test_rl_faults.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from tests import checkpoint_cases
from tests.harness import run_distributed

TIED = "embedding.word_embeddings.weight"
KILL_SCRIPT = os.path.join(os.path.dirname(__file__), "kill_during_save.py")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    return directory, run_distributed(checkpoint_cases.reshard_save_case, 4, str(directory),
                                      tensor_model_parallel_size=2)[0]


@pytest.mark.parametrize("pp", [1, 2], ids=["tp1xdp2", "tp1xpp2"])
def test_checkpoint_loads_at_another_layout_bit_for_bit(saved, pp):
    directory, originals = saved
    runs = run_distributed(checkpoint_cases.reshard_load_case, 2, str(directory), pipeline_model_parallel_size=pp)
    # The RNG states of 4 ranks mean nothing to 2: kept from the seed, said once.
    assert [len(r["warnings"]) for r in runs] == [len(checkpoint_cases.CONFIGS), 0]
    assert "written with (tensor, pipeline, data) sizes [2, 1, 2]" in runs[0]["warnings"][0]
    for (bf16, distopt), original in originals.items():
        loaded = runs[0][bf16, distopt]
        assert loaded["state"] == {"consumed_prompts": 4, "step": 1}
        dtype = torch.bfloat16 if bf16 else torch.float32
        for name in ("actor", "critic", "reference"):
            kinds = checkpoint_cases.KINDS if name != "reference" else ("param",)
            for kind in kinds:
                want, got = original[name][kind], loaded[name][kind]
                assert set(want) == set(got) - {"tied:output_layer.weight"}, (name, kind)
                for key, tensor in want.items():
                    # Parameters in the model's dtype; main parameters and moments fp32 (bf16: fp32 copies).
                    assert tensor.dtype == (dtype if kind == "param" else torch.float32), (name, kind, key)
                    assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), (bf16, distopt, name,
                                                                                              kind, key)
                if pp == 2 and name != "critic":  # the last stage's copy of the tied embedding, from its shards
                    assert torch.equal(got["tied:output_layer.weight"], want[TIED]), (name, kind)
            if name != "reference":
                assert loaded[name]["steps"] == original[name]["steps"] == [1.0]
                assert loaded[name]["scheduler"] == original[name]["scheduler"]
                assert ("DistributedOptimizer" in loaded[name]["optimizers"]) == distopt, loaded[name]["optimizers"]
        for r in runs[1:]:  # every rank gathered the same
            assert all(torch.equal(r[bf16, distopt]["actor"]["main"][k], v)
                       for k, v in loaded["actor"]["main"].items())


def test_sigkill_of_one_rank_during_a_save_leaves_latest_at_the_previous_iteration(tmp_path):
    from megatron_hybrid.rl.checkpoint import LATEST, check_checkpoint

    ckpt = tmp_path / "ckpt"
    argv = ["--train-iters", "2", "--save", str(ckpt), "--save-interval", "1", "--tensor-model-parallel-size", "2",
            "--rollout-tensor-model-parallel-size", "1", "--global-batch-size", "8", "--micro-batch-size", "4",
            "--no-progress", "--distributed-timeout-minutes", "1"]
    # Own session: whatever the run leaves behind is ended by its process group id below.
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             KILL_SCRIPT, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode != 0, out
    assert "Signal 9 (SIGKILL)" in out or "SIGKILL" in out, out[-3000:]
    # Rank 1 died with part of its first shard file of iteration 2 written: iteration 2 never became visible.
    assert (ckpt / ".iter_0000002.tmp" / "__1_0.distcp").read_bytes() == b"part of a shard"
    assert (ckpt / LATEST).read_text() == "1\n"
    assert sorted(p.name for p in ckpt.iterdir()) == [".iter_0000002.tmp", "iter_0000001", LATEST]
    assert check_checkpoint(str(ckpt), ["actor", "critic", "reference"])["step"] == 1
