#!/usr/bin/env bash
# The first device call of the session after 31 (which had no device time left for them):
#   1. GPU tests of the trimmed kv4 Gluon launcher (session 31 removed lean / ilp / sring / pta / ahead / lazy / vsub
#      "mma"; offline SASS was identical) and of the paths that launch it (generation, the fast runner);
#   2. the w4a8-int8 decode buckets at 32 tokens with 4 programs per SM (benchmarks/device/s30_int8_split.py).
# Usage on the device: S32_COMMIT=<sha> bash benchmarks/device/s32_first.sh   (writes under $OUT)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
C=${S32_COMMIT:-unknown}
{ echo "# H200, session 32, tree of commit $C: python3 -m pytest -q -p no:cacheprovider tests/test_kv4_kernels.py tests/test_generate.py tests/test_models_fastpath.py"
  timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_kv4_kernels.py tests/test_generate.py tests/test_models_fastpath.py 2>&1 | tail -30; } > $OUT/gpu_tests_s32_a.txt
tail -2 $OUT/gpu_tests_s32_a.txt
S30_MS=32 timeout 200 python3 benchmarks/device/s30_int8_split.py --out $OUT 2>&1 | tail -10 | cut -c1-300
[ -f $OUT/s30_int8_split.json ] && mv $OUT/s30_int8_split.json $OUT/s32_int8_split_m32.json
ls -la $OUT
