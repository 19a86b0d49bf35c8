"""The figure of rl_fp8_smollm2_cpu.md: held-out exact match against step (step 0: the zero-shot runs of
rl_fp8_smollm2_cpu_evals.jsonl), and the rollout-training mismatch (mean |log π_old − log π_rollout| over the
sampled tokens) against step: bf16 rollout, FP8 rollout, and FP8 with the first and last layer in bf16, each with
seeds 1234 (solid) and 4321 (dashed).

    python rl_fp8_smollm2_cpu_plot.py bench/results
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = sys.argv[1] if len(sys.argv) > 1 else "bench/results"
zero_shot = {}
for line in open(f"{here}/rl_fp8_smollm2_cpu_evals.jsonl"):
    r = json.loads(line)
    zero_shot[r["run"]] = r["eval_accuracy"]
RUNS = [  # (file stem, label, color, zero-shot run)
    ("bf16", "bf16 rollout", "tab:blue", "zs_bf16"),
    ("fp8", "FP8 rollout", "tab:red", "zs_fp8"),
    ("fp8_first_last_bf16", "FP8, first + last layer bf16", "tab:orange", "zs_fp8_first_last_bf16"),
]
fig, (acc, mis) = plt.subplots(1, 2, figsize=(12, 4.5))
for stem, label, color, zs in RUNS:
    for suffix, style, seed in (("", "o-", 1234), ("_seed4321", "s--", 4321)):
        rows = [json.loads(line) for line in open(f"{here}/rl_fp8_smollm2_cpu_{stem}{suffix}.jsonl")]
        evals = [(0, zero_shot[zs])] + [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
        name = f"{label}, seed {seed}"
        acc.plot([s for s, _ in evals], [100 * a for _, a in evals], style, color=color, label=name)
        mis.plot([r["step"] for r in rows], [r["rollout_mismatch/logp_abs_diff_mean"] for r in rows], style,
                 color=color, label=name)
acc.set(xlabel="step", ylabel="held-out exact match, % (200 problems, greedy)", title="accuracy")
mis.set(xlabel="step", ylabel="mean |Δ log p| per sampled token", title="rollout vs training log-probs",
        ylim=(0, None))
acc.grid(alpha=0.3)
mis.grid(alpha=0.3)
acc.legend(fontsize=7)
fig.suptitle("GRPO on SmolLM2-135M-Instruct, hybrid rollout TP 1 → 1, TIS cap 2, 2 CPU cores")
fig.tight_layout()
fig.savefig(f"{here}/rl_fp8_smollm2_cpu.png", dpi=110)
