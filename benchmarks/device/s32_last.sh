#!/usr/bin/env bash
# Session 32, last call on the final tree: the refactored sanitizer targets (memcheck on s32_sanitize.py; s31's kv4
# part run plainly) and the kv4 / generation / fast-runner GPU tests. Writes under $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
{ echo "# H200, session 32, commit ${S32_COMMIT:-unknown}: compute-sanitizer --tool memcheck python3 benchmarks/device/s32_sanitize.py; python3 benchmarks/device/s31_sanitize.py kv4"
  timeout 150 compute-sanitizer --tool memcheck python3 benchmarks/device/s32_sanitize.py 2>&1 | tail -10
  timeout 60 python3 benchmarks/device/s31_sanitize.py kv4 2>&1 | tail -6; } > $OUT/sanitize_s32_final.txt
cat $OUT/sanitize_s32_final.txt
{ echo "# H200, session 32, commit ${S32_COMMIT:-unknown}: python3 -m pytest -q -p no:cacheprovider tests/test_kv4_kernels.py tests/test_generate.py tests/test_models_fastpath.py"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kv4_kernels.py tests/test_generate.py tests/test_models_fastpath.py 2>&1 | tail -4; } > $OUT/gpu_tests_s32_c.txt
tail -1 $OUT/gpu_tests_s32_c.txt
