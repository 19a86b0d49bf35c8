#!/usr/bin/env bash
# What bench/results/*_h200x2* came from: run by the device tool on a 2×H200 machine, in the repository root, with
# megatron-core 0.19.2's wheel carried in .whl/ (see bench/README.md). Each step has its own time limit so that a
# slow one cannot take the later ones with it; logs and results go to $OUT.
set -u
FINAL=${OUT:-/tmp/out}
OUT=/tmp/h200_results  # the device tool returns at most 8 files: everything is packed into one at the end
mkdir -p "$OUT" "$FINAL"
. bench/device_env.sh  # the wheels, PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.txt"
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)" \
    >> "$OUT/gpus.txt" 2>/dev/null
start=$SECONDS
if [ ! -e megatron_hybrid/kernels/_C*.so ]; then
  TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=32 timeout 240 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1
  cp megatron_hybrid/kernels/_C*.so "$OUT/" 2>/dev/null
fi
echo "build: $((SECONDS - start)) s" | tee -a "$OUT/steps.txt"
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name: rc=$? $((SECONDS - t0)) s: $*" | tee -a "$OUT/steps.txt"
}
N=$(nvidia-smi -L | wc -l)
for s in ${STEPS:-nccl reshard generate reshard7b}; do  # STEPS="nccl reshard" runs a subset
  case $s in
    nccl) step nccl 150 torchrun --standalone --nproc_per_node "$N" tests/gpu_nccl.py --output "$OUT/nccl_h200x$N.jsonl" ;;
    reshard) step reshard 170 torchrun --standalone --nproc_per_node "$N" bench/reshard.py --shapes many-small gpu-1b \
        --layouts 2,1,1,1,1 1,2,1,1,1 --output-dir "$OUT" --name "reshard_h200x$N" --report-dir "$OUT/reports" ;;
    generate) step generate 90 torchrun --standalone --nproc_per_node "$N" bench/generate.py --shape gpu-1b \
        --layouts 2,1,1,1,1 1,2,1,1,1 --batch 32 --prompt-len 128 --new-tokens 32 --output-dir "$OUT" \
        --name "generate_h200x$N" ;;
    reshard7b) step reshard7b 200 torchrun --standalone --nproc_per_node "$N" bench/reshard.py --shapes llama-7b \
        --layouts 2,1,1,1,1 --output-dir "$OUT" --name "reshard_llama7b_h200x$N" --no-report ;;
    reshard7b_1g) step reshard7b_1g 200 torchrun --standalone --nproc_per_node "$N" bench/reshard.py --shapes llama-7b \
        --layouts 2,1,1,1,1 --methods ours-aliased ours-canonical bound --reshard-bucket-size-mb 1024 \
        --output-dir "$OUT" --name "reshard_llama7b_bucket1g_h200x$N" --no-report ;;
  esac
done
tar czf "$FINAL/h200_results.tgz" -C "$OUT" --exclude='*.so' .
cp "$OUT/steps.txt" "$FINAL/"
