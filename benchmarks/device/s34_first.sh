#!/usr/bin/env bash
# Session 34, first device call: the non-finite tests compiled on the GPU, the GPU tests of the files whose kernels
# changed (NaN-propagating quantizers and softmax maxima), w8's NaN test (session 33, not run on a GPU yet), then the
# A/B against the previous tree (s34_nan_ab.py). SUF: a suffix for the log names (the second call: _final). Writes
# under $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
C=${S34_COMMIT:-unknown}
t() {  # t NAME LIMIT ARGS...: one pytest run into $OUT/gpu_tests_s34_NAME.txt
  local name=$1 lim=$2; shift 2
  { echo "# H200, session 34, tree of commit $C: python3 -m pytest -q -p no:cacheprovider $*"
    timeout $lim python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tail -25; } > $OUT/gpu_tests_s34_$name.txt
  tail -3 $OUT/gpu_tests_s34_$name.txt
}
t nonfinite${SUF:-} 120 tests/test_nonfinite.py
t kernels${SUF:-} 300 -m gpu tests/test_w8.py tests/test_attention_prefill.py tests/test_kv4_kernels.py tests/test_mla.py tests/test_act_quant.py tests/test_decode_float.py
PYTHONPATH=$PWD:$PWD/.ab_old timeout ${AB_LIMIT:-200} python3 benchmarks/device/s34_nan_ab.py --out $OUT --parts ${AB_PARTS:-dma} 2>&1 | tail -30
