#!/usr/bin/env bash
# Issue 43, step 3: the README's main command on a machine with GPUs, as the device tool runs it (repository root,
# megatron-core's wheel carried in .whl/, no install of this package). Logs go to $OUT:
#   four_ranks     torchrun --nproc_per_node 4 examples/ppo/train_ppo.py         (more ranks than GPUs: the clear error)
#   four_ranks_cpu the same with --device cpu                                    (4 gloo ranks; the reward's rise)
#   one_gpu        torchrun --nproc_per_node 1 ... --tensor-model-parallel-size 1 (one rank on the GPU)
#   probe          which import reads CUDA's device list (hiding the GPUs after it no longer takes)
# STEPS="probe four_ranks_cpu" runs a subset.
set -u
STEPS=${STEPS:-"four_ranks four_ranks_cpu one_gpu"}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. bench/device_env.sh  # the wheels, PYTHONPATH
export OMP_NUM_THREADS=2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.txt"
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__,
'visible GPUs', torch.cuda.device_count())" >> "$OUT/gpus.txt" 2>&1
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return ;; esac
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name: rc=$? $((SECONDS - t0)) s: $*" | tee -a "$OUT/steps.txt"
}
probe() {
  for m in torch megatron.core megatron_hybrid megatron_hybrid.rl; do
    python3 -c "import $m, os; os.environ['CUDA_VISIBLE_DEVICES'] = ''; import torch
print('after importing $m, hiding the GPUs leaves torch.cuda.is_available() =', torch.cuda.is_available())"
  done
}
export -f probe
step probe 120 bash -c probe
step four_ranks 120 torchrun --nproc_per_node 4 examples/ppo/train_ppo.py --no-progress
step four_ranks_cpu 300 torchrun --nproc_per_node 4 examples/ppo/train_ppo.py --device cpu --no-progress
step one_gpu 300 torchrun --nproc_per_node 1 examples/ppo/train_ppo.py --tensor-model-parallel-size 1 --no-progress
grep -h "error:\|mean reward\|after importing" "$OUT"/*.txt | sort -u
