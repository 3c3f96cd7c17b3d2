#!/usr/bin/env bash
# Session 41, last device call: (1) decode A/B of the MoE experts across commits, same process family: the
# Mixtral-8x7B block (1 and 16 tokens, CUDA graphs) with the lowbit package of 7116eb3 (session 40's measured
# lut kernels), fd8e006 (session 40's end) and this tree, alternated; each old tree is a `git archive` of lowbit/
# and benchmarks/device/ carried in _ab/t<commit>; (2) the Mixtral model decode at batch 1 (fireq, flute-nf4) with
# 7116eb3 and this tree; (3) the whole GPU suite on this tree. Ends in $OUT/s41d.tar.
set -u
ROOT=$PWD
W=$OUT/s41d; mkdir -p $W
t0=$(date +%s)
block() {  # $1: tree dir, $2: label
  (cd $1 && PYTHONPATH=$PWD timeout 120 python3 benchmarks/device/s39_moe.py --out $W --tokens 1,16 --reps 20 \
     --variants "lowbit w4a8-fp8 grouped,lowbit lut grouped" 2>&1 | grep "^{" | cut -c1-200 \
   && mv $W/s39_moe.json $W/s41_ab_block_$2.json)
}
block $ROOT/_ab/t7116eb3 7116eb3_a; block $ROOT head_a; block $ROOT/_ab/tfd8e006 fd8e006_a
echo "blocks $(( $(date +%s) - t0 )) s"
model() {  # $1: tree dir, $2: label
  (cd $1 && PYTHONPATH=$PWD timeout 150 python3 -c "
import os, sys; sys.path.insert(0, '.')
from lowbit.bench.model import run
os.makedirs('$W/m_$2', exist_ok=True)
run('$W/m_$2', layers=2, recipes=('fireq', 'flute-nf4'), prefill_seqs=[1024], decode_batches=[1, 16],
    decode_ctx=[1024], time_budget_s=120, arch='mixtral-8x7b', command='bash benchmarks/device/s41_ab.sh ($2)')" 2>&1 \
    | grep -E "^\| phase|Error" | head -5)
}
model $ROOT/_ab/t7116eb3 7116eb3; model $ROOT head
echo "models $(( $(date +%s) - t0 )) s"
left=$(( 470 - ($(date +%s) - t0) ))
[ $left -gt 100 ] && GPU_TESTS_WORKERS=4 GPU_TESTS_LIMIT=$left python3 benchmarks/device/gpu_tests.py --out $W > /dev/null 2>&1
tail -2 $W/gpu_tests.txt 2>/dev/null; grep -E "^FAILED|^ERROR" $W/gpu_tests.txt 2>/dev/null | head
rm -f $W/gpu_tests.xml; for d in $W/m_*; do rm -f $d/*.png $d/*_memory.json; done
echo "total $(( $(date +%s) - t0 )) s"
cd $OUT && tar cf s41d.tar s41d && rm -rf s41d
