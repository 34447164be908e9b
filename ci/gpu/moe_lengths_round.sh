#!/usr/bin/env bash
# One device call on a two-GPU host (~9.5 minutes): the MoE headline at the Azure trace's full lengths (session 5's
# first call clipped them to a quarter and no policy saw pressure: KV peaked at 31 % for static-fp16). Qwen3-30B-A3B
# shapes, 80 GB budget, Gamma CV 2, 400 requests, rates 4 / 8 / 12, each point cut at 60 s, a prefill
# chunk of ``CHUNK`` tokens, 1,024 unless set (an 8,192-token chunk took up to 191 ms, past the 5 x T_base TBT bound at
# every rate; in session 6 the admitting steps of 2,048-token chunks took a median 97-161 ms against the 123 ms bound).
# Beside static-fp16, GPU 0 runs the grouped kernel's prefill-size CUDA tests (the probed tiles). Two processes side by
# side, one per GPU: static-fp16 then combined on GPU 0, dps then elastickv on GPU 1, one T_base for all
# (``T_BASE``, measured on static-fp16 in the previous call of the same tree).
source ci/gpu/bootstrap.sh
set +e
install_packages
nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
(CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q --device=cuda -p no:cacheprovider \
  tests/kernels/test_nested_moe_cuda.py > $OUT/moe-kernel-tests.log 2>&1) &
moe_headline 0 560 --max-num-batched-tokens ${CHUNK:-1024} --policies static-fp16 combined &
sleep 5
moe_headline 1 560 --max-num-batched-tokens ${CHUNK:-1024} --policies dps elastickv
wait
moe_table
tar czf $OUT/moe.tgz -C $OUT moe moe-gpu0.log moe-gpu1.log moe-kernel-tests.log && rm -rf $OUT/moe
