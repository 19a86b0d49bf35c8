"""The figure of rl_fp8_smollm2_cpu.md: held-out exact match against step (step 0: the zero-shot runs), and the
rollout-training mismatch (mean |log π_old − log π_rollout| over the sampled tokens) against step, bf16 and FP8."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = sys.argv[1] if len(sys.argv) > 1 else "bench/results"
starts = {"bf16": float(sys.argv[2]), "fp8": float(sys.argv[3])} if len(sys.argv) > 3 else {}
fig, (acc, mis) = plt.subplots(1, 2, figsize=(11, 4))
for name, color in (("bf16", "tab:blue"), ("fp8", "tab:red")):
    rows = [json.loads(line) for line in open(f"{here}/rl_fp8_smollm2_cpu_{name}.jsonl")]
    evals = [(0, starts[name])] if name in starts else []
    evals += [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    label = {"bf16": "bf16 rollout", "fp8": "FP8 rollout"}[name]
    acc.plot([s for s, _ in evals], [100 * a for _, a in evals], "o-", color=color, label=label)
    mis.plot([r["step"] for r in rows], [r["rollout_mismatch/logp_abs_diff_mean"] for r in rows], "o-",
             color=color, label=label)
acc.set(xlabel="step", ylabel="held-out exact match, % (200 problems, greedy)", title="accuracy")
mis.set(xlabel="step", ylabel="mean |Δ log p| per sampled token", title="rollout vs training log-probs",
        ylim=(0, None))
for ax in (acc, mis):
    ax.grid(alpha=0.3)
    ax.legend()
fig.suptitle("GRPO on SmolLM2-135M-Instruct, hybrid rollout TP 1 → 1, TIS cap 2, 2 CPU cores")
fig.tight_layout()
fig.savefig(f"{here}/rl_fp8_smollm2_cpu.png", dpi=110)
