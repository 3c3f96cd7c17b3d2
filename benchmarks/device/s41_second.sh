#!/usr/bin/env bash
# Session 41, second device call (after the prefill rule, split rows and the lut prefill form): (1) the MoE / LUT GPU
# tests; (2) MoE blocks at prefill sizes, lut with and without its prefill form (Qwen3-30B-A3B and Mixtral-8x7B
# shapes; Mixtral with the sparse schedule beside); (3) the model benches of qwen3-30b-a3b and mixtral-8x7b (2
# layers scaled). Everything ends in $OUT/s41b.tar (the device returns at most 8 files).
set -u
export PYTHONPATH=$PWD
t0=$(date +%s)
W=$OUT/s41b; mkdir -p $W
timeout 200 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -rA tests/test_moe.py tests/test_moe_grouped.py \
  tests/test_moe_lut.py tests/test_lut_mma.py > $W/gpu_tests_s41_moe.txt 2>&1
tail -3 $W/gpu_tests_s41_moe.txt; grep -E "^FAILED|^ERROR" $W/gpu_tests_s41_moe.txt | head; echo "tests $(( $(date +%s) - t0 )) s"
timeout 120 python3 benchmarks/device/s41_moe_prefill.py --out $W --shapes "qwen3:1024,4096,16384" --schemes lut \
  --sparse 0 --knobs "LUT_DEQUANT_ROWS=1000000000" 2>&1 | grep "^{" | cut -c1-170
mv $W/s41_moe_prefill.json $W/s41_moe_prefill_r3_qwen3.json
timeout 150 python3 benchmarks/device/s41_moe_prefill.py --out $W --shapes "mixtral:1024,4096,16384" --schemes lut \
  --knobs "LUT_DEQUANT_ROWS=1000000000" 2>&1 | grep "^{" | cut -c1-170
mv $W/s41_moe_prefill.json $W/s41_moe_prefill_r3_mixtral.json
echo "blocks $(( $(date +%s) - t0 )) s"
for arch in qwen3-30b-a3b mixtral-8x7b; do
  left=$(( 540 - ($(date +%s) - t0) ))
  [ $left -gt 60 ] && timeout $left python3 -c "
import sys; sys.path.insert(0, '.')
from lowbit.bench.model import run
run('$W', layers=2, recipes=('fireq', 'qserve', 'flute-nf4'), prefill_seqs=[1024], decode_batches=[1, 16, 64],
    decode_ctx=[1024], time_budget_s=$left / 2 - 10, arch='$arch',
    command='bash benchmarks/device/s41_second.sh (part 3)')" 2>&1 | grep -E "^\| |Error|error" | head -12
done
echo "total $(( $(date +%s) - t0 )) s"
cd $OUT && tar cf s41b.tar s41b && rm -rf s41b
