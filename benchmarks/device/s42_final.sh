#!/usr/bin/env bash
# Session 42, final: GPTQ's GPU tests (and the recipes' / w4a8-fp8 module GPU tests) after the saturation fix.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
W=$OUT/s42e; mkdir -p $W
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gptq.py tests/test_recipes.py tests/test_w4a8_fp8.py 2>&1 | tail -3 | tee $W/gpu_tests_s42_final.txt
cd $OUT && tar cf s42e.tar s42e && rm -rf s42e
