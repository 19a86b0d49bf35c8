#!/usr/bin/env bash
# Issue 24's H200 acceptance (MoE generation) in one device call, repository root, megatron-core 0.19.2's wheel
# carried in .whl/ (no install of this package there; made here by
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 --dest .whl megatron-core==0.19.2
# ), each step under its own time limit:
#   gpu_moe       tests/gpu_moe_generation.py: the MoE step on the GPU (grouped bf16 GEMMs, a captured layer replayed on
#                 new routing, graphed generation without host syncs in the MoE layers)                  ~40 s, limit 90
#   ours          bench/generate.py --methods ours: qwen3-30b-a3b's shape at $LAYERS layers (default 8: 5.6 B
#                 parameters, initialised on the GPU), greedy, 128-token prompts, 128 new tokens, batch 32 and 128,
#                 3 timed calls after 1 warm-up (which captures the graphs); then megatron's forward over the finished
#                 sequences for the experts the batches routed to                                      ~100 s, limit 240
#   transformers  Qwen3MoeForCausalLM.generate, the same shape, 1 timed call after 1 warm-up per batch
#                                                                                                        ~60 s, limit 150
#   roofline      the device's copy bandwidth, bytes read per decode step (the distinct experts: ours' measurement);
#                 prints the three methods side by side and the targets                          ~15 s, limit 45
# At most 9 minutes in all. Returns steps.txt, generate_moe_h200.json (every row; each step appends its own),
# gpu_moe_generation_h200.json and logs.tgz (every step's output, refreshed after each step: a run cut short still
# returns its logs). STEPS="ours roofline" runs a subset, STEPS="kernels gpu_moe ..." adds the kernels' tests (~40 s);
# GEN_ARGS adds arguments to every bench/generate.py call; SHAPE=cpu-tiny-moe LAYERS=2 GEN_ARGS=--smoke
# STEPS="ours transformers roofline" runs the script's steps on a CPU in a minute or two.
set -u
OUT=${OUT:-/tmp/out}
LAYERS=${LAYERS:-8}
SHAPE=${SHAPE:-qwen3-30b-a3b}
mkdir -p "$OUT/logs"
. bench/device_env.sh  # the wheels, PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/logs/gpus.txt"
python3 -c "import torch, triton, transformers, megatron.core as m; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__, 'megatron-core', m.__version__)" \
  >> "$OUT/logs/gpus.txt" 2>&1
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/logs/$name.txt" 2>&1
  echo "$name: rc=$? $((SECONDS - t0)) s: $*" | tee -a "$OUT/steps.txt"
  tar czf "$OUT/logs.tgz" -C "$OUT" logs
}
RESULTS="$OUT/generate_moe_h200.json"
GEN="python3 bench/generate.py --shape $SHAPE --layers $LAYERS --batch 32 128 --prompt-len 128 --new-tokens 128"
for s in ${STEPS:-gpu_moe ours transformers roofline}; do
  case $s in
    kernels) step kernels 90 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py ;;  # not by default
    gpu_moe) step gpu_moe 90 python3 tests/gpu_moe_generation.py --output "$OUT/gpu_moe_generation_h200.json" ;;
    ours) step ours 240 $GEN --methods ours --variants greedy --graph-pool-gib 8 --append --out "$RESULTS" \
        ${GEN_ARGS:-} ;;
    transformers) step transformers 150 $GEN --methods transformers --transformers-runs 1 --append \
        --out "$RESULTS" ${GEN_ARGS:-} ;;
    roofline) step roofline 45 $GEN --methods roofline --append --out "$RESULTS" ${GEN_ARGS:-} ;;
  esac
done
# The side-by-side table and the targets, from the last step's output.
sed -n '/^greedy, /,$p' "$OUT/logs/roofline.txt" 2>/dev/null | tee -a "$OUT/steps.txt"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
