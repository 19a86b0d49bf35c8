#!/usr/bin/env bash
# Issue 45's measurements on one GPU, as the device tool runs it (repository root, megatron-core's wheel carried in
# .whl/, no install of this package). Each step is one process with its own time limit; its log goes to
# $OUT/<step>.txt and its rows to $OUT (file names carry the GPU's name):
#   memory     tests/gpu_rollout_memory.py: the 7B ragged rollout at batch 256 (the default graph pool, then the
#              old fixed 4 GiB one, expected to fail)               -> rollout_memory_<gpu>.json
#   bf16       bench/rl_step.py, the 1.5B shape                    -> rl_step_<gpu>.json
#   fp8        the same with --rollout-fp8, same seeds             -> rl_step_<gpu>.json
#   7b         the 7B shape: distributed optimizer, its CPU offload (OFFLOAD_FRACTION, default 0.9: the host holds 16
#              bytes per offloaded parameter, 110 GiB at 1.0 of a 128 GiB host), full recompute -> rl_step_<gpu>.json
#   learn      the 1.5B shape, 1,024-token vocabulary, 16 prompts of 32-128 tokens, 256 new, LEARN_STEPS (20) steps
#              at each of LEARN_LR (default 1e-3: +0.54 on an H100, where 1e-4 gave -0.005; the bench's own 1e-6
#              keeps the policy still): the reward's rise, last 5 steps minus first 5  -> rl_step_learn_<gpu>.json
# bf16 also compares generation in the loop with bench/generate.py's way of calling the generator (--compare-generation
# COMPARE, default 2 calls each).
#   packed     tests/gpu_packed_attention.py first (60 s): the varlen pack and the cuDNN backward  -> packed_attention_<gpu>.json
# CARD_GIB=79.2 runs the 7b step as on an 80 GB H100 where the card is larger (an H200).
# STEPS="bf16 fp8" runs a subset; WARMUP and MEASURED set the rl_step steps (default 2 and 5); RL_ARGS adds flags to
# the bf16, fp8 and 7b runs (say "--prompts 32" for a short first check); LIMIT_<STEP> a limit.
set -u
STEPS=${STEPS:-"memory bf16 fp8 7b"}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. bench/device_env.sh  # the wheels, PYTHONPATH
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/gpus.txt"
steps=(--warmup "${WARMUP:-2}" --steps "${MEASURED:-5}" ${RL_ARGS:-})
step() {  # step NAME DEFAULT_LIMIT_S COMMAND...
  local name=$1 limit_var="LIMIT_${1^^}" limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return ;; esac
  local t0=$SECONDS
  timeout "${!limit_var:-$limit}" "$@" >> "$OUT/$name.txt" 2>&1
  echo "$name: rc=$? $((SECONDS - t0)) s: $*" | tee -a "$OUT/steps.txt"
}
step packed 120 python3 tests/gpu_packed_attention.py --output "$OUT/packed_attention_$gpu.json"
step bf16 300 python3 bench/rl_step.py "${steps[@]}" --compare-generation "${COMPARE:-2}" --out "$OUT/rl_step_$gpu.json"
step memory 300 python3 tests/gpu_rollout_memory.py --timeout 140 --output "$OUT/rollout_memory_$gpu.json"
step fp8 300 python3 bench/rl_step.py "${steps[@]}" --rollout-fp8 --out "$OUT/rl_step_$gpu.json"
step 7b 400 python3 bench/rl_step.py --shape qwen2.5-7b "${steps[@]}" ${CARD_GIB:+--card-gib $CARD_GIB} --out "$OUT/rl_step_$gpu.json" -- \
  --use-distributed-optimizer --optimizer-cpu-offload --use-precision-aware-optimizer \
  --optimizer-offload-fraction "${OFFLOAD_FRACTION:-0.9}" --recompute-granularity full --recompute-method uniform \
  --recompute-num-layers 1
for lr in ${LEARN_LR:-1e-3}; do  # the reward's rise: short samples, one run per learning rate
  step learn "${LIMIT_LEARN_EACH:-200}" python3 bench/rl_step.py --warmup 0 --steps "${LEARN_STEPS:-20}" --prompts 16 \
    --prompt-range 32 128 --max-new-tokens 256 --lr "$lr" --out "$OUT/rl_step_learn_$gpu.json"
done
for f in "$OUT"/rl_step_*.json; do [ -f "$f" ] && python3 bench/rl_step.py --table "$f"; done
grep -h -i "error" "$OUT"/*.txt | grep -v -i warn | sort | uniq -c | head -20
