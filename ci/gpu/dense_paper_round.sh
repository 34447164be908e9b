#!/usr/bin/env bash
# One device call on a two-GPU host (~6 minutes): `dense_full_round.sh` in the ElasticKV paper's own regime, a
# closed-loop client at concurrency 38 (its Tab. 3 / App. C.6), 400 of the 600 requests (in the simulator the P90
# TTFT stops changing after ~400; below that the first wave's prefill queue dominates it), one T_base for both
# policies: static-fp16's own, measured at concurrency 64 in session 6's first call.
CONCURRENCY=38 REQUESTS=${REQUESTS:-400} MAX_DURATION=440 T_BASE=${T_BASE:-0.01177} exec bash ci/gpu/dense_full_round.sh
