#!/usr/bin/env bash
# Parts of bench/layout_sweep.py's committed sweep (2000 examples, seed 34) on the device machine's CPU cores, in
# parallel (the GPU is hidden: this is the CPU sweep, gloo ranks). Run by the device tool in the repository root with
# megatron-core 0.19.2's and hypothesis 6.170.27's wheels carried in .whl/ (see bench/README.md):
#   PARTS=32 SHARDS="0 1 2 3 4 5 6 7 8 9" bash bench/run_layout_sweep_device.sh
# Each part writes $OUT/partK.json; `python bench/layout_sweep.py --merge part*.json --out ...` joins them.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
ln -sfn "$PWD/patches" megatron_hybrid/patches
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""
OUT=${OUT:-/tmp/sweep_out}
mkdir -p "$OUT"
nproc > "$OUT/cpus.txt"
for k in ${SHARDS:?name the parts}; do
  ( t0=$SECONDS
    timeout "${LIMIT:-520}" python3 -W ignore bench/layout_sweep.py --examples "${EXAMPLES:-2000}" --seed "${SEED:-34}" \
        --shard "$k/${PARTS:-32}" --out "$OUT/part$k.json" > "$OUT/part$k.log" 2>&1
    echo "part $k: rc=$? $((SECONDS - t0)) s" >> "$OUT/steps.txt" ) &
done
wait
cat "$OUT/steps.txt"
tail -n 3 "$OUT"/part*.log | grep -v "^$" | tail -n 40
