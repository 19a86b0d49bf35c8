#!/usr/bin/env bash
# The one-H200 generation runs of issue 14, as the device tool runs them (repository root, megatron-core 0.19.2's
# wheel carried in .whl/, no install of this package there): the kernels' tests on the GPU, the CUDA-graph and
# memory checks (tests/gpu_inference.py, also over the distributed optimizer) and bench/generate.py. Each step has
# its own time limit; logs and results go to $OUT. STEPS="kernels generate" runs a subset.
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
for s in ${STEPS:-kernels graphs graphs_distopt generate}; do
  case $s in
    kernels) step kernels 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_topp_kernel.py ;;
    graphs) step graphs 150 python3 tests/gpu_inference.py --graph-pool reserved \
        --output "$OUT/gpu_inference_reserved_h200.json" ;;
    graphs_distopt) step graphs_distopt 150 python3 tests/gpu_inference.py --graph-pool reserved \
        --optimizer distributed --output "$OUT/gpu_inference_distopt_h200.json" ;;
    generate) step generate 330 python3 bench/generate.py --out "$OUT/generate_h200.json" ${GEN_ARGS:-} ;;
    topp_rounds) step topp_rounds 150 python3 bench/probe/topp_rounds.py --out "$OUT/topp_rounds_h200.json" ;;
    step_times) step step_times 200 python3 bench/probe/step_times.py --out "$OUT/step_times_h200.json" ;;
    topp) step topp 150 python3 bench/topp.py --out "$OUT/topp_h200.json" --vocab 32000 ;;
    profile) step profile 150 python3 bench/generate.py --out "$OUT/generate_profile.json" --methods ours \
        --batch 128 --new-tokens 128 --runs 1 --profile greedy top_p ;;
  esac
done
# The device tool returns at most 8 files: the logs travel as one archive.
tar czf "$OUT/logs.tgz" -C "$OUT" --remove-files $(cd "$OUT" && ls *.txt | grep -v steps.txt) 2>/dev/null
