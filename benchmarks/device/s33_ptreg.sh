#!/usr/bin/env bash
# Session 33: the INT4-cache decode with PTREG (the split's page-table entries held one per lane, each step's page by
# shfl.sync.idx; see GLUON_PTREG in lowbit/kernels/decode_kv4.py): the kv4 decode GPU tests with it forced on, then
# correctness (float64 reference, bit-equality with the default, CUDA graph) and timing beside the default in one
# process. Writes under $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
{ echo "# H200, session 33, commit ${S33_COMMIT:-unknown}: GLUON_PTREG forced True, tests/test_kv4_kernels.py -k 'decode or gluon' (less the launcher-plumbing test, which asserts the default rule)"
  timeout 100 python3 -c "
import sys, pytest
import lowbit.kernels.decode_kv4 as d
d.GLUON_PTREG = True
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_kv4_kernels.py', '-k', '(decode or gluon) and not plumbing']))" 2>&1 | tail -3; } > $OUT/gpu_tests_s33_ptreg.txt
tail -2 $OUT/gpu_tests_s33_ptreg.txt
S16_VARIANTS='{"ptreg": {"ptreg": true}, "ptreg_nosraw": {"ptreg": true, "sraw": false}, "again": {}}' \
  S16_CASES=16:8192,16:16384,16:32768,4:8192,1:32768 \
  timeout 240 python3 benchmarks/device/s16_kv4.py --out $OUT --parts ct 2>&1 | grep -v '"pass": true' | tail -40 | cut -c1-260
mv $OUT/s16_kv4.json $OUT/s33_kv4_ptreg.json
ls $OUT
