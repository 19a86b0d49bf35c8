#!/usr/bin/env bash
# Issue 44's training-pass benchmark on one GPU, as the device tool runs it (repository root, megatron-core's wheel
# carried in .whl/, no install of this package): bench/train_pass.py, one process per method (one model's weights
# and gradients on the card at a time), rows appended to $OUT/train_pass_<gpu>.json as they are measured, the log in
# $OUT/train_pass.txt. The environment chooses:
#   MIX      long: prompts 128-1,024, responses long-tailed up to 8,192, packs of BUDGET (default 12,288) tokens,
#                  then the longest single sequence each method trains (8k, 16k, 32k);
#            4k:   prompts 128-1,024, responses up to 3,072, packs of 4,096 tokens (the MFU row), no probes
#   SHAPE    bench/shapes.py's name (default qwen2.5-7b-8l)
#   METHODS  default: packed-sdpa padded-local packed-flex padded-sdpa
#   METHOD_LIMIT  seconds per method (default 150)
# Example: MIX=4k METHODS="packed-sdpa padded-local" bash bench/run_train_pass_gpu.sh
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. bench/device_env.sh  # the wheels, PYTHONPATH
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
case ${MIX:-long} in
  long) mix=(--max-tokens-per-micro-batch "${BUDGET:-12288}") ;;
  4k) mix=(--response-max 3072 --max-tokens-per-micro-batch 4096 --longest) ;;
  *) echo "MIX must be long or 4k, not ${MIX}" >&2; exit 2 ;;
esac
for method in ${METHODS:-packed-sdpa padded-local packed-flex padded-sdpa}; do
  timeout "${METHOD_LIMIT:-150}" python3 bench/train_pass.py --shape "${SHAPE:-qwen2.5-7b-8l}" --methods "$method" \
    "${mix[@]}" --out "$OUT/train_pass_$gpu.json" >> "$OUT/train_pass.txt" 2>&1
  echo "train_pass ${MIX:-long} ${SHAPE:-qwen2.5-7b-8l} $method: rc=$?" | tee -a "$OUT/train_pass.txt"
done
grep -v -i "warn" "$OUT/train_pass.txt" | tail -25
