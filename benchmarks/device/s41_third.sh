#!/usr/bin/env bash
# Session 41, third device call (after the FP8 prefill form): (1) the MoE GPU tests; (2) the Mixtral-8x7B-shaped block,
# w4a8-fp8 with and without its prefill form, sparse beside; (3) the mixtral-8x7b model bench, prefill (2 layers
# scaled to 32). Everything ends in $OUT/s41c.tar.
set -u
export PYTHONPATH=$PWD
t0=$(date +%s)
W=$OUT/s41c; mkdir -p $W
timeout 200 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -rA tests/test_moe.py tests/test_moe_grouped.py \
  tests/test_moe_lut.py > $W/gpu_tests_s41_moe_fp8.txt 2>&1
tail -2 $W/gpu_tests_s41_moe_fp8.txt; grep -E "^FAILED|^ERROR" $W/gpu_tests_s41_moe_fp8.txt | head; echo "tests $(( $(date +%s) - t0 )) s"
timeout 200 python3 benchmarks/device/s41_moe_prefill.py --out $W --shapes "mixtral:1024,2048,4096,16384" \
  --schemes w4a8-fp8 --knobs "FP8_DEQUANT_ROWS=1000000000" 2>&1 | grep "^{" | cut -c1-160
mv $W/s41_moe_prefill.json $W/s41_moe_prefill_r4_mixtral_fp8.json
echo "blocks $(( $(date +%s) - t0 )) s"
left=$(( 500 - ($(date +%s) - t0) ))
[ $left -gt 60 ] && timeout $left python3 -c "
import sys; sys.path.insert(0, '.')
from lowbit.bench.model import run
run('$W', layers=2, recipes=('fireq', 'flute-nf4'), prefill_seqs=[1024], decode_batches=[1],
    decode_ctx=[1024], time_budget_s=$left - 20, arch='mixtral-8x7b',
    command='bash benchmarks/device/s41_third.sh (part 3)')" 2>&1 | grep -E "^\| |Error|error" | head -12
echo "total $(( $(date +%s) - t0 )) s"
cd $OUT && tar cf s41c.tar s41c && rm -rf s41c
