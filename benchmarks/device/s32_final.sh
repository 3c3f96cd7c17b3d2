#!/usr/bin/env bash
# Session 32, last call: GPU tests of the committed kv4 decode (SRAW on by its "long" rule), a repeat of the SRAW A/B
# with the new default (variant "off" = SRAW forced off), and Nsight Compute's stall samples of the new default at
# B=16 L=8k. Writes under $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
{ echo "# H200, session 32, commit ${S32_COMMIT:-unknown}: python3 -m pytest -q -p no:cacheprovider tests/test_kv4_kernels.py tests/test_generate.py tests/test_models_fastpath.py"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kv4_kernels.py tests/test_generate.py tests/test_models_fastpath.py 2>&1 | tail -6; } > $OUT/gpu_tests_s32_b.txt
tail -1 $OUT/gpu_tests_s32_b.txt
S16_VARIANTS='{"off": {"sraw": false}, "again": {}}' S16_CASES=16:8192,16:32768,16:16384,4:8192,1:32768 \
  timeout 150 python3 benchmarks/device/s16_kv4.py --out $OUT --parts t 2>&1 | grep full | cut -c1-160
mv $OUT/s16_kv4.json $OUT/s32_kv4_final.json
TAG=_sraw timeout 120 bash benchmarks/device/s32_kv4_ncu.sh > /dev/null 2>&1
ls $OUT
