#!/usr/bin/env bash
# Session 43, last call: GPTQ at model level after the TF32 Hessians and the sync-free fake-quant (same probe as
# before them), then the whole GPU suite on the final tree (GPTQ kernel, API audit).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
W=$OUT/s43; mkdir -p $W/g
timeout 200 python3 benchmarks/device/s43_gptq_model.py --out $W/g 2>&1 | grep -E "^(fireq|qserve|flute)" 
mv $W/g/s43_gptq_model.json $W/s43_gptq_model_after.json 2>/dev/null; rmdir $W/g
GPU_TESTS_WORKERS=4 GPU_TESTS_LIMIT=400 python3 benchmarks/device/gpu_tests.py --out $W > /dev/null 2>&1
tail -2 $W/gpu_tests.txt 2>/dev/null; grep -E "^FAILED|^ERROR" $W/gpu_tests.txt 2>/dev/null | head -20
rm -f $W/gpu_tests.xml
cd $OUT && tar cf s43.tar s43 && rm -rf s43
