#!/usr/bin/env bash
# Session 31 device calls.  bash benchmarks/device/s31.sh tests|kv4|w4a8   (writes under $OUT)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
C=${S31_COMMIT:-unknown}
t() {  # t NAME LIMIT pytest-args...: one pytest run, header line + output into $OUT/gpu_tests_s31_NAME.txt
  local n=$1 lim=$2; shift 2
  { echo "# H200, session 31, tree of commit $C: python3 -m pytest -q -p no:cacheprovider $*"
    timeout $lim python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tail -40; } > $OUT/gpu_tests_s31_$n.txt
  tail -2 $OUT/gpu_tests_s31_$n.txt
}
case $1 in
tests)
  t a 240 -m gpu tests/test_kv4_kernels.py
  t b 330 tests/test_lut_mma.py tests/test_lut_wgmma.py tests/test_lut_fuse.py tests/test_w4a8_int8_kernel.py tests/test_w4a8_int8_op.py
  ;;
kv4)
  S16_VARIANTS='{"mma": {"vsub": "mma"}, "mma136": {"vsub": "mma", "maxnreg": 136}, "mma136c": {"vsub": "mma", "maxnreg": 136, "cstore": true}, "cstore": {"cstore": true}}' \
  S16_CASES=16:8192,16:32768,4:8192,1:32768 timeout 280 python3 benchmarks/device/s16_kv4.py --out $OUT --parts ct 2>&1 | tail -30
  mv $OUT/s16_kv4.json $OUT/s31_kv4_opts.json
  S16_ZP=1 S16_VARIANTS='{"r136": {"maxnreg": 136}, "r144": {"maxnreg": 144}, "r144c": {"maxnreg": 144, "cstore": true}}' \
  S16_CASES=16:8192,16:32768,4:8192,1:32768 timeout 250 python3 benchmarks/device/s16_kv4.py --out $OUT --parts ct 2>&1 | tail -30
  mv $OUT/s16_kv4.json $OUT/s31_kv4zp_opts.json
  ;;
w4a8)
  S30_DECODE=1 timeout 500 python3 benchmarks/device/s30_w4a8_split.py --out $OUT 2>&1 | tail -40
  ;;
esac
ls -la $OUT
