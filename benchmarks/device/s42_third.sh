#!/usr/bin/env bash
# Session 42, GPTQ after the review fixes: GPTQ's GPU tests, and what GPTQ costs on Llama-3-8B-sized matrices.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
W=$OUT/s42c; mkdir -p $W
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gptq.py tests/test_recipes.py tests/test_moe.py 2>&1 | tail -3 | tee $W/gpu_tests_gptq.txt
timeout 300 python3 benchmarks/device/s42_gptq_cost.py --out $W/s42_gptq_cost.json 2>&1 | tail -14
cd $OUT && tar cf s42c.tar s42c && rm -rf s42c
