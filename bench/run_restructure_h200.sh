#!/usr/bin/env bash
# Issue 23's H200 acceptance in one device call (repository root, megatron-core's wheel carried in .whl/, the
# pre-restructuring commit's tree carried in .old/, made here by `bash bench/run_restructure_h200.sh --prepare COMMIT`):
#   - bench/generate.py --methods ours on both trees, interleaved before/after/after/before (the same bench script
#     for both: this tree's, with digests), then bench/compare_generate.py: tok/s ratios and digests row by row;
#   - tests/gpu_inference.py on this tree for both graph pools and both optimizers.
# Returns steps.txt, compare_h200.json and one archive of every JSON and log (the device tool returns 8 files),
# refreshed after every step. Order: a before/after pair, the GPU tests, then a second pair (after, before).
set -u
if [ "${1:-}" = "--prepare" ]; then  # on the development machine: the old commit's package (and patches/) in .old/
  rm -rf .old && mkdir -p .old/bench && git archive "$2" megatron_hybrid setup.py | tar -x -C .old
  # patches/ was a top-level folder, installed as megatron_hybrid.patches, before issue 49 moved it into the package
  if git cat-file -e "$2:patches" 2>/dev/null; then git archive "$2" patches | tar -x -C .old; fi
  exit
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/all"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
if [ -d .old/patches ]; then ln -sfn "$PWD/.old/patches" .old/megatron_hybrid/patches; fi
cp bench/generate.py bench/shapes.py .old/bench/
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/all/gpus.txt"
step() {  # step NAME LIMIT_S DIR COMMAND...
  local name=$1 limit=$2 dir=$3; shift 3
  local t0=$SECONDS
  (cd "$dir" && PYTHONPATH=/tmp/site:$PWD timeout "$limit" "$@") > "$OUT/all/$name.txt" 2>&1
  echo "$name: rc=$? $((SECONDS - t0)) s: (in $dir) $*" | tee -a "$OUT/steps.txt"
  tar czf "$OUT/restructure_h200.tgz" -C "$OUT" all  # after every step: a run cut short still returns its logs
}
GEN="python3 bench/generate.py --methods ours ${GEN_ARGS:-}"
compare() {
  python3 bench/compare_generate.py --before "$OUT"/all/before*.json --after "$OUT"/all/after*.json \
    --out "$OUT/compare_h200.json" | tee -a "$OUT/steps.txt"
}
step gen_before1 140 .old $GEN --out "$OUT/all/before1.json"
step gen_after1 140 . $GEN --out "$OUT/all/after1.json"
compare
for pool in reserved private; do
  for opt in sgd distributed; do
    step "gpu_inference_${pool}_${opt}" 60 . python3 tests/gpu_inference.py --graph-pool $pool --optimizer $opt \
      --output "$OUT/all/gpu_inference_${pool}_${opt}_h200.json"
  done
done
step gen_after2 140 . $GEN --out "$OUT/all/after2.json"
step gen_before2 140 .old $GEN --out "$OUT/all/before2.json"
compare
rm -rf "$OUT/all"
