#!/usr/bin/env bash
# Session 32: ONEPG (one page-table load per loop step) in the INT4-cache decode: memcheck + bit-equality
# (benchmarks/device/s32_sanitize.py), then correctness and timing beside the default in one process. Writes under $OUT.
# Measured slower (s32_kv4_onepg*.json) and removed: this script runs only on commit f9912f7, which had the option.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
{ echo "# H200, session 32, commit ${S32_COMMIT:-unknown}: compute-sanitizer --tool memcheck python3 benchmarks/device/s32_sanitize.py"
  timeout 150 compute-sanitizer --tool memcheck python3 benchmarks/device/s32_sanitize.py 2>&1 | tail -22; } > $OUT/sanitize_s32_onepg.txt
tail -3 $OUT/sanitize_s32_onepg.txt
S16_VARIANTS='{"onepg": {"onepg": true}, "again": {}}' S16_CASES=16:8192,16:32768,16:16384,4:8192,1:32768 \
  timeout 200 python3 benchmarks/device/s16_kv4.py --out $OUT --parts ct 2>&1 | grep -v '"pass": true' | grep "full\|error" | cut -c1-130
mv $OUT/s16_kv4.json $OUT/s32_kv4_onepg.json
S16_ZP=1 S16_VARIANTS='{"onepg": {"onepg": true}, "again": {}}' S16_CASES=16:8192,4:8192 \
  timeout 100 python3 benchmarks/device/s16_kv4.py --out $OUT --parts t 2>&1 | grep full | cut -c1-130
mv $OUT/s16_kv4.json $OUT/s32_kv4_onepg_zp.json
ls $OUT
