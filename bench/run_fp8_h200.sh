#!/usr/bin/env bash
# Issue 26 (FP8 rollout weights) on one H200, as the device tool runs it (repository root, megatron-core 0.19.2's wheel
# carried in .whl/, no install of this package there), in one call of at most ~9.5 minutes:
#   kernels     the kernels' tests on the GPU (tests/test_fp8_kernels.py where it exists)
#   exact       tests/gpu_fp8.py: FP8 weights = quantize_reference (GPU and CPU), before and after an optimizer step;
#               FP8 (and bf16) graphs replay eager runs bit for bit                      -> gpu_fp8_h200.json
#   switch      bench/fp8_switch.py on llama3-8b: copy bandwidth, quantization floor and bandwidth, bf16 and FP8
#               switch times and memory, the cost of mapping fresh memory (SWITCH_ARGS=--sweep: also the grouped
#               quantization kernel's launch parameters)                                   -> fp8_switch_h200.json
#   gemm        bench/fp8_gemm.py: a Llama-3-8B layer's linears in bf16 and FP8 (cuBLAS, the Triton kernels), and the
#               quantization against a copy                                             -> fp8_gemm_h200.json
#   gen1b       bench/generate.py on gpu-1b, ours and ours-fp8, B 32 128 256            -> generate_fp8_h200.json
#   gen8b_bf16, gen8b_fp8
#               bench/generate.py on llama3-8b (built on the GPU), one method per process, B 256 32 128 (the
#               targets' batches first: rows are saved as they are measured, so a step cut short keeps them), with
#               the decode kernel tables                    -> generate_fp8_h200.json, generate_fp8_kernels_h200.json
#   gen8b_unfused
#               the bf16 rows again with GenerationConfig(fused_decoder=False): the kernels per layer and decode
#               step before the fusion        -> generate_fp8_unfused_h200.json, generate_fp8_unfused_kernels_h200.json
#   gen8b_fp8_first_last
#               the FP8 rows again with the first and the last layer in bf16 (--fp8-layers-in-bf16 1 1)
#                                                                  -> generate_fp8_first_last_bf16_h200.json
# Each step has its own time limit (the *_LIMIT variables; their defaults sum to 560 s); logs and results go to $OUT.
# STEPS="gen8b_bf16 gen8b_fp8" GEN8B_LIMIT=270 runs a subset with more time (e.g. the 8B runs as a second call).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. bench/device_env.sh  # the wheels, PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.txt"
python3 -c "import torch, triton, megatron.core as m; print('torch', torch.__version__, 'triton', triton.__version__,
'megatron-core', m.__version__)" >> "$OUT/gpus.txt" 2>&1
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name: rc=$? $((SECONDS - t0)) s: $*" | tee -a "$OUT/steps.txt"
}
GEN=(python3 bench/generate.py --new-tokens 128 --variants greedy --runs 3 --append --out "$OUT/generate_fp8_h200.json")
GEN8B=("${GEN[@]}" --shape llama3-8b --batch 256 32 128 --profile-json "$OUT/generate_fp8_kernels_h200.json")
KERNEL_TESTS=(tests/test_kernels.py)
[ -f tests/test_fp8_kernels.py ] && KERNEL_TESTS+=(tests/test_fp8_kernels.py)
for s in ${STEPS:-kernels exact switch gen1b gen8b_bf16 gen8b_fp8}; do
  case $s in
    kernels) step kernels "${KERNELS_LIMIT:-80}" python3 -m pytest -q -p no:cacheprovider "${KERNEL_TESTS[@]}" ;;
    exact) step exact "${EXACT_LIMIT:-90}" python3 tests/gpu_fp8.py --output "$OUT/gpu_fp8_h200.json" ;;
    switch) step switch "${SWITCH_LIMIT:-80}" python3 bench/fp8_switch.py ${SWITCH_ARGS:-} --out "$OUT/fp8_switch_h200.json" ;;
    gemm) step gemm "${GEMM_LIMIT:-90}" python3 bench/fp8_gemm.py --out "$OUT/fp8_gemm_h200.json" ;;
    gen1b) step gen1b "${GEN1B_LIMIT:-100}" "${GEN[@]}" --shape gpu-1b --methods ours ours-fp8 --batch 32 128 256 ;;
    gen8b_bf16) step gen8b_bf16 "${GEN8B_LIMIT:-105}" "${GEN8B[@]}" --methods ours ;;
    gen8b_unfused) step gen8b_unfused "${GEN8B_LIMIT:-105}" python3 bench/generate.py --new-tokens 128 --variants greedy \
        --runs 3 --shape llama3-8b --batch 256 32 --methods ours --fused-decoder off \
        --out "$OUT/generate_fp8_unfused_h200.json" --profile-json "$OUT/generate_fp8_unfused_kernels_h200.json" ;;
    gen8b_fp8) step gen8b_fp8 "${GEN8B_LIMIT:-105}" "${GEN8B[@]}" --methods ours-fp8 ;;
    gen8b_fp8_first_last) step gen8b_fp8_first_last "${GEN8B_LIMIT:-105}" python3 bench/generate.py --new-tokens 128 \
        --variants greedy --runs 3 --shape llama3-8b --batch 256 32 --methods ours-fp8 --fp8-layers-in-bf16 1 1 \
        --out "$OUT/generate_fp8_first_last_bf16_h200.json" ;;
  esac
done
# The device tool returns at most 8 files: the logs travel as one archive.
tar czf "$OUT/logs.tgz" -C "$OUT" --remove-files $(cd "$OUT" && ls *.txt | grep -v steps.txt) 2>/dev/null
