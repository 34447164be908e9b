#!/usr/bin/env bash
# Sourced at the start of every GPU-machine command: installs the carried wheels (nox and its needs) offline.
set -e
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  export PATH=/tmp/site/bin:$PATH
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# The device's copy of .git can be stale: write `git rev-parse HEAD > .carry/COMMIT` here before each call.
if [ -f .carry/COMMIT ]; then export ELASTISERVE_SOURCE_COMMIT=$(cat .carry/COMMIT); fi
mkdir -p "${OUT:-/tmp/out}"
export ELASTISERVE_TRACE_DIR=$PWD/.carry/traces

# The packages into the machine's Python (offline, editable) for scripts run outside nox.
install_packages() {
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e packages/platforms -e packages/memory \
    -e packages/kernels -e packages/control -e packages/engine >/dev/null 2>&1
}

# `nox -s test-cuda` on GPU 0 within LIMIT seconds, timed, into $OUT/test-cuda.log; for rounds that run a benchmark
# on GPU 1 beside it.
test_cuda_on_gpu0() {  # LIMIT
  (time CUDA_VISIBLE_DEVICES=0 timeout "$1" nox -s test-cuda) > $OUT/test-cuda.log 2>&1
  tail -3 $OUT/test-cuda.log
}
