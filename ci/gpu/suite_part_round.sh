#!/usr/bin/env bash
# One device call on a one-GPU host: part of `nox -s test-cuda`, for when the whole suite no longer fits one call
# (433 tests took 564 of the call's 600 s at 4a4eb33, session 21). PART=rest runs control, engine, memory and
# platforms (180 tests, 3 min at 76369d0); PART=kernels all of tests/kernels, which serially no longer fit one call on a
# fresh venv (301 tests: cut at 252 by 560 s in session 34), so it runs over xdist workers now; PART=kernels-a (its
# files before test_nested_gemm.py) and PART=kernels-b (test_nested_gemm.py and after) run it serially in two calls.
# Limit SUITE_LIMIT seconds (default 585).
# PART=all runs the whole suite in one call, as plain `nox -s test-cuda` (tests/kernels and, since session 40,
# tests/control over pytest-xdist workers, then the rest serially: noxfile.py's GPU_KERNEL_WORKERS_MAX says why; 6.8
# min on an H100 in session 39, 9.2 min on another H100 in session 40 with tests/control serial, near the call's
# limit). PART=kernels (over WORKERS xdist workers, default 6) and PART=rest are nearly the same two parts in two calls.
source ci/gpu/bootstrap.sh
set +e
start_round
kernel_files() {  # a | b: tests/kernels' files before / from test_nested_gemm.py, in name order
  for f in $(ls tests/kernels/test_*.py | sort); do
    if [[ "$(basename $f)" < "test_nested_gemm.py" ]]; then [ "$1" = a ] && echo $f; else [ "$1" = b ] && echo $f; fi
  done
}
if [ "${PART:-}" = all ]; then  # the plain command: the noxfile runs the kernel files over xdist workers itself
  (time timeout ${SUITE_LIMIT:-585} nox -s test-cuda) > $OUT/test-cuda-all.log 2>&1
  grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda-all.log | tail -8
  exit 0
fi
case "${PART:?set PART=all, kernels, kernels-a, kernels-b or rest}" in
  kernels) dirs="tests/kernels -n ${WORKERS:-6} --dist loadfile" ;;  # as the plain command runs them (5.3 min, s40)
  kernels-a) dirs=$(kernel_files a) ;;
  kernels-b) dirs=$(kernel_files b) ;;
  rest) dirs="tests/control tests/engine tests/memory tests/platforms" ;;
  *) echo "PART must be all, kernels, kernels-a, kernels-b or rest, not $PART"; exit 2 ;;
esac
(time timeout ${SUITE_LIMIT:-585} nox -s test-cuda -- $dirs) > $OUT/test-cuda-$PART.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda-$PART.log | tail -12
