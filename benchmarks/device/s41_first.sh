#!/usr/bin/env bash
# Session 41, first device call: (1) the GPU suite at the start commit with 4 xdist workers (session 40's last
# changes were never GPU-run); (2) one Qwen3-30B-A3B-shaped MoE block's experts (H = 2048, I = 768, 128 experts,
# top-8), grouped schedules against bf16 grouped_mm; (3) the qwen3-30b-a3b model bench (2 layers scaled to 48).
# Writes under $OUT: gpu_tests.txt, s41_moe_qwen3.json, model_qwen3_30b_a3b.*
set -u
export PYTHONPATH=$PWD
t0=$(date +%s)
GPU_TESTS_WORKERS=4 GPU_TESTS_LIMIT=${S41_SUITE_LIMIT:-300} python3 benchmarks/device/gpu_tests.py --out $OUT > /dev/null 2>&1
tail -5 $OUT/gpu_tests.txt; echo "suite $(( $(date +%s) - t0 )) s"; rm -f $OUT/gpu_tests.xml
timeout 150 python3 benchmarks/device/s39_moe.py --out $OUT --tokens 1,4,16,64 --reps 20 --experts 128 --top-k 8 \
  --hidden 2048 --intermediate 768 \
  --variants "bf16 grouped_mm,lowbit w4a8-fp8 grouped,lowbit w4a8-int8 grouped,lowbit lut grouped" 2>&1 | tail -20
[ -f $OUT/s39_moe.json ] && mv $OUT/s39_moe.json $OUT/s41_moe_qwen3.json
echo "block $(( $(date +%s) - t0 )) s"
left=$(( 560 - ($(date +%s) - t0) ))
[ $left -gt 60 ] && timeout $left python3 -c "
import sys; sys.path.insert(0, '.')
from lowbit.bench.model import run
run('$OUT', layers=2, recipes=('fireq', 'qserve', 'flute-nf4'), prefill_seqs=[1024], decode_batches=[1, 16, 64],
    decode_ctx=[1024], time_budget_s=$left - 30, arch='qwen3-30b-a3b',
    command='bash benchmarks/device/s41_first.sh (part 3)')" 2>&1 | tail -30
echo "total $(( $(date +%s) - t0 )) s"
