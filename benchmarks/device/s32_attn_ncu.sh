#!/usr/bin/env bash
# Session 32: Nsight Compute stall sampling of the quantized prefill attention kernel (fp8 and int8, B=4 H=32 D=128
# S=4k, non-causal): per-SASS samples (CSV). Writes under $OUT.
set -u
export PYTHONPATH=$PWD
K="--clock-control none --kernel-name regex:_attn_fwd --launch-skip 2 --launch-count 1"
for scheme in fp8 int8; do
  { echo "# H200, session 32, commit ${S32_COMMIT:-unknown}: ncu $K --section SourceCounters --section WarpStateStats --page source --print-source sass --csv python3 benchmarks/device/attn_ncu.py $scheme 4096"
    timeout 200 ncu $K --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
      python3 benchmarks/device/attn_ncu.py $scheme 4096 2>&1; } > $OUT/s32_attn_ncu_src_$scheme.csv
  wc -l $OUT/s32_attn_ncu_src_$scheme.csv; grep -m2 "^ok\|Error" $OUT/s32_attn_ncu_src_$scheme.csv | cut -c1-200
done
