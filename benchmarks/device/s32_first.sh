#!/usr/bin/env bash
# The first device calls of the session after 31 (which had no device time left for them), two calls (each under
# the 10-minute limit):
#   S32_COMMIT=<sha> bash benchmarks/device/s32_first.sh tests    GPU tests of the trimmed kv4 Gluon launcher (session
#       31 removed lean / ilp / sring / pta / ahead / lazy / vsub "mma"; its offline SASS was identical) and of the
#       paths that launch it (generation, the fast runner)
#   bash benchmarks/device/s32_first.sh probes    the w4a8-int8 decode buckets at 32 tokens with 4 programs per SM
#       (benchmarks/device/s30_int8_split.py), then the multi-warp INT4-cache decode prototype
#       (benchmarks/device/s32_kv4_cta.py: correctness, then timing beside the committed kernel and SDPA flash)
# Writes under $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
case ${1:-tests} in
tests)
  { echo "# H200, session 32, tree of commit ${S32_COMMIT:-unknown}: python3 -m pytest -q -p no:cacheprovider tests/test_kv4_kernels.py tests/test_generate.py tests/test_models_fastpath.py"
    timeout 500 python3 -m pytest -q -p no:cacheprovider tests/test_kv4_kernels.py tests/test_generate.py tests/test_models_fastpath.py 2>&1 | tail -30; } > $OUT/gpu_tests_s32_a.txt
  tail -2 $OUT/gpu_tests_s32_a.txt
  ;;
probes)
  S30_MS=32 timeout 200 python3 benchmarks/device/s30_int8_split.py --out $OUT 2>&1 | tail -10 | cut -c1-300
  [ -f $OUT/s30_int8_split.json ] && mv $OUT/s30_int8_split.json $OUT/s32_int8_split_m32.json
  timeout 330 python3 benchmarks/device/s32_kv4_cta.py --out $OUT --parts ct 2>&1 | grep -v "pass\": true" | tail -30 | cut -c1-300
  ;;
esac
ls -la $OUT
