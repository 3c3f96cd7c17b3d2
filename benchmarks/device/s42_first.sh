#!/usr/bin/env bash
# Session 42, first device call: session 41's last fix (`_program_rows`, decode PTX equal to fd8e006 offline) was
# never GPU-run. (1) Mixtral-8x7B block decode A/B, 1 and 16 tokens, fd8e006 vs this tree, alternated (expect
# ~89 us fp8 / ~95 us lut at 1 token); (2) Mixtral model decode at batch 1/16 on this tree; (3) the whole GPU suite.
# Ends in $OUT/s42a.tar.
set -u
ROOT=$PWD
W=$OUT/s42a; mkdir -p $W
t0=$(date +%s)
block() {  # $1: tree dir, $2: label
  (cd $1 && PYTHONPATH=$PWD timeout 120 python3 benchmarks/device/s39_moe.py --out $W --tokens 1,16 --reps 20 \
     --variants "lowbit w4a8-fp8 grouped,lowbit lut grouped" 2>&1 | grep "^{" | cut -c1-200 \
   && mv $W/s39_moe.json $W/s42_ab_block_$2.json)
}
block $ROOT/_ab/tfd8e006 fd8e006_a; block $ROOT head_a; block $ROOT/_ab/tfd8e006 fd8e006_b; block $ROOT head_b
echo "blocks $(( $(date +%s) - t0 )) s"
(PYTHONPATH=$PWD timeout 150 python3 -c "
import os
from lowbit.bench.model import run
os.makedirs('$W/m_head', exist_ok=True)
run('$W/m_head', layers=2, recipes=('fireq', 'flute-nf4'), prefill_seqs=[1024], decode_batches=[1, 16],
    decode_ctx=[1024], time_budget_s=120, arch='mixtral-8x7b', command='bash benchmarks/device/s42_first.sh')" 2>&1 \
    | grep -E "^\| |Error" | head -12)
echo "model $(( $(date +%s) - t0 )) s"
left=$(( 560 - ($(date +%s) - t0) ))
[ $left -gt 100 ] && GPU_TESTS_WORKERS=4 GPU_TESTS_LIMIT=$left python3 benchmarks/device/gpu_tests.py --out $W > /dev/null 2>&1
tail -2 $W/gpu_tests.txt 2>/dev/null; grep -E "^FAILED|^ERROR" $W/gpu_tests.txt 2>/dev/null | head
rm -f $W/gpu_tests.xml; for d in $W/m_*; do rm -f $d/*.png $d/*_memory.json; done
echo "total $(( $(date +%s) - t0 )) s"
cd $OUT && tar cf s42a.tar s42a && rm -rf s42a
