#!/usr/bin/env bash
# Session 49 on one GPU, as the device tool runs it (repository root, megatron-core's wheel carried in .whl/, the
# parent tree of issue 49's moves in .gpu_parent/ when PARENT is set):
#  1. bench/train_pass.py on the 1.5B shape at RL lengths (prompts 32-512, responses long-tailed up to 4,096, packs of
#     8,192 tokens), packed sdpa with our packed RoPE and with megatron-core's, side by side, each profiled
#     -> $OUT/train_pass_<gpu>.json, $OUT/train_pass.txt, $OUT/profile_*.txt
#  2. with PARENT: bench/generate.py on gpu-1b, this tree against the parent's, ROUNDS (2) times each, alternating
#     (SKIP_TRAIN set: step 2 alone)
#     -> $OUT/generate_parity_<gpu>.json, $OUT/generate_parity.txt
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. bench/device_env.sh  # the wheels, PYTHONPATH
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.txt"
t0=$SECONDS
[ -z "${SKIP_TRAIN:-}" ] && timeout "${TRAIN_LIMIT:-150}" python3 bench/train_pass.py --shape qwen2.5-1.5b --methods packed-sdpa --packed-rope both \
  --sequences 64 --prompt-range 32 512 --response-max 4096 --max-tokens-per-micro-batch 8192 --longest \
  --runs 3 --warmup 1 --profile "$OUT" --out "$OUT/train_pass_$gpu.json" > "$OUT/train_pass.txt" 2>&1
[ -z "${SKIP_TRAIN:-}" ] && echo "train_pass: rc=$? $((SECONDS - t0)) s" && \
  grep -v -i "warn" "$OUT/train_pass.txt" | grep -v "^ " | tail -6
if [ -n "${PARENT:-}" ]; then
  gen=(bench/generate.py --shape gpu-1b --methods ours --variants greedy top_p --batch 128 --new-tokens 512
       --runs 3 --warmup 1)
  for round in $(seq "${ROUNDS:-2}"); do
    for tree in parent head; do
      t0=$SECONDS
      if [ $tree = parent ]; then
        (cd .gpu_parent && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 "${gen[@]}" --out "$OUT/gen_$tree.json" \
          --append) >> "$OUT/generate_parity.txt" 2>&1
      else
        timeout 150 python3 "${gen[@]}" --out "$OUT/gen_$tree.json" --append >> "$OUT/generate_parity.txt" 2>&1
      fi
      echo "generate $tree round $round: rc=$? $((SECONDS - t0)) s" | tee -a "$OUT/generate_parity.txt"
    done
  done
  python3 - "$OUT" <<'PY'
import json, sys, os, statistics
out = sys.argv[1]
rows = {t: [r for r in json.load(open(os.path.join(out, f"gen_{t}.json"))) if "tok_s" in r or "tokens_per_s" in r]
        for t in ("parent", "head") if os.path.exists(os.path.join(out, f"gen_{t}.json"))}
for t, rs in rows.items():
    for r in rs:
        print(t, {k: r[k] for k in r if k in ("method", "variant", "batch", "new_tokens", "tok_s", "digest")})
PY
fi
