#!/usr/bin/env bash
# Sourced at the start of every GPU-machine command: installs the carried wheels (nox and its needs) offline.
set -e
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  export PATH=/tmp/site/bin:$PATH
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p "${OUT:-/tmp/out}"
