#!/usr/bin/env bash
# One device call on a one-GPU host: the whole `nox -s test-cuda` (393 tests; session 19's call stopped at 323 when
# its 480 s limit ran out, 0 failed) within SUITE_LIMIT seconds (default 585), PDL on as the sm90 default is since
# session 19 (ELASTISERVE_PDL=off runs it the old way).
source ci/gpu/bootstrap.sh
set +e
start_round
(time timeout ${SUITE_LIMIT:-585} nox -s test-cuda) > $OUT/test-cuda.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda.log | tail -12
