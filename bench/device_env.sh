# Sourced by the bench/run_*.sh scripts on the device machine (repository root, megatron-core's wheel carried in
# .whl/, no install of this package): the wheels into /tmp/site (once per machine) and the import path.
if [ ! -d /tmp/site/megatron ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
