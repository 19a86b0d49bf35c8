#!/usr/bin/env bash
# Issue 44's training-pass benchmark on one GPU, as the device tool runs it (repository root, megatron-core's wheel
# carried in .whl/, no install of this package): bench/train_pass.py on the Qwen2.5-7B layer shape (8 layers),
# packed + sdpa, padded + local, packed + flex, padded + sdpa, each with its longest single sequence
# -> $OUT/train_pass_<gpu>.json and $OUT/train_pass.txt. METHODS, METHOD_LIMIT (s per method, default 150) and
# BUDGET (the packed token budget, default 12288) as the environment says; rows are written as they are measured.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
ln -sfn "$PWD/patches" megatron_hybrid/patches
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
# One process per method: one model's weights and gradients on the card at a time.
for method in ${METHODS:-packed-sdpa padded-local packed-flex}; do
  timeout "${METHOD_LIMIT:-150}" python3 bench/train_pass.py --shape qwen2.5-7b-8l --methods "$method" \
    --max-tokens-per-micro-batch "${BUDGET:-12288}" --out "$OUT/train_pass_$gpu.json" >> "$OUT/train_pass.txt" 2>&1
  echo "train_pass $method: rc=$?" | tee -a "$OUT/train_pass.txt"
done
grep -v -i "warn" "$OUT/train_pass.txt" | tail -15
