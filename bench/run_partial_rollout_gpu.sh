#!/usr/bin/env bash
# Issue 46, step 5 on one GPU, as the device tool runs it (repository root, megatron-core's wheel carried in .whl/):
# bench/partial_rollout.py (synchronous steps, then --partial-rollout --max-staleness 1, each run its own process)
# -> $OUT/partial_rollout_<gpu>.json, the log in $OUT/partial_rollout.txt. WARMUP and STEPS set the steps of each run
# (default 2 and 8), PROMPTS its prompts (default 64), ARGS more flags (e.g. --max-staleness 1 4); LIMIT the seconds
# of the whole (default 560).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. bench/device_env.sh  # the wheels, PYTHONPATH
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
timeout "${LIMIT:-560}" python3 bench/partial_rollout.py --prompts "${PROMPTS:-64}" --warmup "${WARMUP:-2}" --steps "${STEPS:-8}" \
  ${ARGS:-} --out "$OUT/partial_rollout_$gpu.json" > "$OUT/partial_rollout.txt" 2>&1
echo "partial_rollout: rc=$?"
grep -v -i "warn" "$OUT/partial_rollout.txt" | tail -24
