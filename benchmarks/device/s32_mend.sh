#!/usr/bin/env bash
# Session 32 review mend: the kv4 decode tests on the GPU after the _g_ld / _g_typed refactor, SRAW forced on and
# by the default rule. Writes under $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
{ echo "# H200, session 32, commit ${S32_COMMIT:-unknown}: tests/test_kv4_kernels.py -k 'decode or gluon', GLUON_SRAW forced True, then the default"
  timeout 70 python3 -c "
import sys, pytest
import lowbit.kernels.decode_kv4 as d
d.GLUON_SRAW = True
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_kv4_kernels.py', '-k', 'decode or gluon']))" 2>&1 | tail -2
  timeout 70 python3 -m pytest -q -p no:cacheprovider tests/test_kv4_kernels.py -k "decode or gluon" 2>&1 | tail -2; } > $OUT/gpu_tests_s32_mend.txt
cat $OUT/gpu_tests_s32_mend.txt
