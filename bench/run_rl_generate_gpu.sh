#!/usr/bin/env bash
# Issue 46 on one GPU, as the device tool runs it (repository root, megatron-core's wheel carried in .whl/):
# bench/rl_generate.py (the generator alone on the RL workload, the quota and resume calls profiled, decode attention
# per split count) -> $OUT/rl_generate_<gpu>.json, the log in $OUT/rl_generate.txt. ARGS: more flags for the bench;
# LIMIT the seconds of the whole (default 400).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. bench/device_env.sh  # the wheels, PYTHONPATH
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
timeout "${LIMIT:-400}" python3 bench/rl_generate.py --profile quota resume --attention ${ARGS:-} \
  --out "$OUT/rl_generate_$gpu.json" > "$OUT/rl_generate.txt" 2>&1
echo "rl_generate: rc=$?"
grep -v -i "warn\|deprecat\|^  \"\"\"\|class MimoModelConfig" "$OUT/rl_generate.txt" | cut -c1-400 | tail -120
