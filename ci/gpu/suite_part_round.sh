#!/usr/bin/env bash
# One device call on a one-GPU host: half of `nox -s test-cuda`, for when the whole suite no longer fits one call
# (433 tests took 564 of the call's 600 s at 4a4eb33, session 21). PART=kernels runs tests/kernels (264 of those 433
# tests); PART=rest the other directories. Limit SUITE_LIMIT seconds (default 585).
source ci/gpu/bootstrap.sh
set +e
start_round
case "${PART:?set PART=kernels or PART=rest}" in
  kernels) dirs="tests/kernels" ;;
  rest) dirs="tests/control tests/engine tests/memory tests/platforms" ;;
  *) echo "PART must be kernels or rest, not $PART"; exit 2 ;;
esac
(time timeout ${SUITE_LIMIT:-585} nox -s test-cuda -- $dirs) > $OUT/test-cuda-$PART.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda-$PART.log | tail -12
