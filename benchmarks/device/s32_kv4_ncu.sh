#!/usr/bin/env bash
# Session 32: Nsight Compute on the committed INT4-cache decode at B=16 L=8k (issue 8's 8k target): per-SASS stall
# samples (source page, CSV) and the warp-state / scheduler / memory summary. Writes under $OUT. KV4_OPTS (JSON
# launcher options) and TAG (file-name suffix) select a variant: KV4_OPTS='{"sraw": true}' TAG=_sraw.
set -u
export PYTHONPATH=$PWD
K="--clock-control none --kernel-name regex:_decode_kv4_gluon --launch-skip 2 --launch-count 1"
{ echo "# H200, session 32, commit ${S32_COMMIT:-unknown}, KV4_OPTS=${KV4_OPTS:-}: ncu $K --section SourceCounters --section WarpStateStats --page source --print-source sass --csv python3 benchmarks/device/kv4_ncu.py"
  timeout 250 ncu $K --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
    python3 benchmarks/device/kv4_ncu.py 2>&1; } > $OUT/s32_kv4_ncu_src_8k${TAG:-}.csv
{ echo "# H200, session 32, commit ${S32_COMMIT:-unknown}, KV4_OPTS=${KV4_OPTS:-}: ncu $K --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section Occupancy --section InstructionStats python3 benchmarks/device/kv4_ncu.py"
  timeout 250 ncu $K --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section Occupancy --section InstructionStats \
    python3 benchmarks/device/kv4_ncu.py 2>&1; } > $OUT/s32_kv4_ncu_8k${TAG:-}.txt
wc -l $OUT/*; tail -5 $OUT/s32_kv4_ncu_src_8k${TAG:-}.csv | cut -c1-200; grep -A12 "Warp State" $OUT/s32_kv4_ncu_8k${TAG:-}.txt
