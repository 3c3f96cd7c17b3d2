#!/usr/bin/env bash
# Session 32: compute-sanitizer memcheck on the SRAW scale loads (benchmarks/device/s32_sanitize.py). Writes under $OUT.
set -u
export PYTHONPATH=$PWD
{ echo "# H200, session 32, commit ${S32_COMMIT:-unknown}: compute-sanitizer --tool memcheck python3 benchmarks/device/s32_sanitize.py"
  timeout 400 compute-sanitizer --tool memcheck python3 benchmarks/device/s32_sanitize.py 2>&1 | tail -15; } > $OUT/sanitize_s32.txt
cat $OUT/sanitize_s32.txt
