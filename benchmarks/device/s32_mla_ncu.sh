#!/usr/bin/env bash
# Session 32: Nsight Compute stall sampling of the warp-specialized MLA decode (FP8 and bf16 latent caches, B=32
# L=16k, 128 heads): per-SASS samples (CSV) and the warp-state summary. Writes under $OUT.
set -u
export PYTHONPATH=$PWD
K="--clock-control none --kernel-name regex:_mla_ws --launch-skip 2 --launch-count 1"
for kind in fp8 bf16; do
  { echo "# H200, session 32, commit ${S32_COMMIT:-unknown}: ncu $K --section SourceCounters --section WarpStateStats --section SpeedOfLight --page source --print-source sass --csv python3 benchmarks/device/mla_ncu.py $kind"
    timeout 200 ncu $K --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
      python3 benchmarks/device/mla_ncu.py $kind 2>&1; } > $OUT/s32_mla_ncu_src_$kind.csv
  wc -l $OUT/s32_mla_ncu_src_$kind.csv; grep -m3 "ok\|Error\|error" $OUT/s32_mla_ncu_src_$kind.csv | cut -c1-200
done
