#!/usr/bin/env bash
# Session 32: the INT4-cache decode with SRAW (the next block's token scales loaded into 32-bit registers; see
# GLUON_SRAW in lowbit/kernels/decode_kv4.py): GPU tests with it forced on, then correctness (float64 reference,
# bit-equality with the default, CUDA graph) and timing beside the default in one process (signed codes, then zero
# points). Writes under $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
{ echo "# H200, session 32, commit ${S32_COMMIT:-unknown}: GLUON_SRAW forced True, pytest -q -p no:cacheprovider tests/test_kv4_kernels.py"
  timeout 200 python3 -c "
import sys, pytest
import lowbit.kernels.decode_kv4 as d
d.GLUON_SRAW = True
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_kv4_kernels.py']))" 2>&1 | tail -8; } > $OUT/gpu_tests_s32_sraw.txt
tail -2 $OUT/gpu_tests_s32_sraw.txt
S16_VARIANTS='{"sraw": {"sraw": true}, "again": {}}' S16_CASES=16:8192,16:32768,16:16384,4:8192,1:32768 \
  timeout 200 python3 benchmarks/device/s16_kv4.py --out $OUT --parts ct 2>&1 | grep -v '"pass": true' | tail -40 | cut -c1-260
mv $OUT/s16_kv4.json $OUT/s32_kv4_sraw.json
S16_ZP=1 S16_VARIANTS='{"sraw": {"sraw": true}, "again": {}}' S16_CASES=16:8192,4:8192,16:32768 \
  timeout 150 python3 benchmarks/device/s16_kv4.py --out $OUT --parts t 2>&1 | tail -14 | cut -c1-260
mv $OUT/s16_kv4.json $OUT/s32_kv4_sraw_zp.json
ls $OUT
