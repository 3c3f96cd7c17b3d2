#!/usr/bin/env bash
# Session 42, last call: the whole GPU suite on the final tree (GPTQ after both reviews).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
W=$OUT/s42d; mkdir -p $W
GPU_TESTS_WORKERS=4 GPU_TESTS_LIMIT=400 python3 benchmarks/device/gpu_tests.py --out $W > /dev/null 2>&1
tail -2 $W/gpu_tests.txt 2>/dev/null; grep -E "^FAILED|^ERROR" $W/gpu_tests.txt 2>/dev/null | head
rm -f $W/gpu_tests.xml
cd $OUT && tar cf s42d.tar s42d && rm -rf s42d
