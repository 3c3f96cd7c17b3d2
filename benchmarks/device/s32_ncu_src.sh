#!/usr/bin/env bash
# Session 32: Nsight Compute per-SASS stall samples (source page, CSV) of one kernel, launched by a helper script:
#   bash benchmarks/device/s32_ncu_src.sh mla     the warp-specialized MLA decode, FP8 and bf16 caches, B=32 L=16k,
#                                                 128 heads (benchmarks/device/mla_ncu.py) -> s32_mla_ncu_src_{fp8,bf16}.csv
#   bash benchmarks/device/s32_ncu_src.sh attn    the quantized prefill attention, fp8 and int8, B=4 H=32 D=128 S=4k
#                                                 (benchmarks/device/attn_ncu.py) -> s32_attn_ncu_src_{fp8,int8}.csv
# Writes under $OUT.
set -u
export PYTHONPATH=$PWD
case ${1:-mla} in
  mla) regex=_mla_ws; helper=benchmarks/device/mla_ncu.py; kinds="fp8 bf16"; extra="" ;;
  attn) regex=_attn_fwd; helper=benchmarks/device/attn_ncu.py; kinds="fp8 int8"; extra=4096 ;;
esac
K="--clock-control none --kernel-name regex:$regex --launch-skip 2 --launch-count 1"
for kind in $kinds; do
  f=$OUT/s32_${1:-mla}_ncu_src_$kind.csv
  { echo "# H200, session 32, commit ${S32_COMMIT:-unknown}: ncu $K --section SourceCounters --section WarpStateStats --page source --print-source sass --csv python3 $helper $kind $extra"
    timeout 200 ncu $K --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
      python3 $helper $kind $extra 2>&1; } > $f
  wc -l $f; grep -m2 "^ok\|Error" $f | cut -c1-200
done
