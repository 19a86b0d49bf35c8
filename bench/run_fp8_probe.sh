#!/usr/bin/env bash
# A first look on one H200 (issue 26): the FP8 and fused kernels' tests on the GPU, then bench/fp8_gemm.py with the
# plan sweeps of the small-M kernels and of the quantization kernel; tests/gpu_fp8.py (exactness). As the device tool runs it: megatron-core 0.19.2's wheel carried in .whl/.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. bench/device_env.sh  # the wheels, PYTHONPATH
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS; timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; echo "$name: rc=$? $((SECONDS - t0)) s" | tee -a "$OUT/steps.txt"; }
for s in ${STEPS:-kernels gemm}; do
  case $s in
    kernels) step kernels 200 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kernels.py tests/test_kernels.py ;;
    gemm) step gemm 300 python3 bench/fp8_gemm.py --out "$OUT/fp8_gemm_h200.json" --sweep ${GEMM_ARGS:-} ;;
    exact) step exact 120 python3 tests/gpu_fp8.py --output "$OUT/gpu_fp8_h200.json" ;;
  esac
done
tail -3 "$OUT/kernels.txt" 2>/dev/null; grep -v "^{" "$OUT/gemm.txt" | tail -5
