#!/usr/bin/env bash
# Session 33: the INT4-cache decode with CLUSTER (the splits of one (b, h) as one thread-block cluster, combined
# through distributed shared memory; GLUON_CLUSTER in lowbit/kernels/decode_kv4.py): its GPU test, then correctness
# (float64 reference, CUDA graph) and timing beside the default in one process. Writes under $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
{ echo "# H200, session 33, commit ${S33_COMMIT:-unknown}: pytest -q -p no:cacheprovider tests/test_kv4_kernels.py -k 'cluster or gluon_options'"
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kv4_kernels.py -k "cluster or gluon_options" 2>&1 | tail -15; } > $OUT/gpu_tests_s33_cluster.txt
tail -4 $OUT/gpu_tests_s33_cluster.txt
S16_VARIANTS='{"cluster": {"cluster": true}, "again": {}}' S16_CASES=16:8192,16:16384,16:32768,32:8192,32:4096 \
  timeout 240 python3 benchmarks/device/s16_kv4.py --out $OUT --parts ct 2>&1 | grep -v '"pass": true' | grep -v 'mode": "probe\|mode": "main' | tail -40 | cut -c1-200
mv $OUT/s16_kv4.json $OUT/s33_kv4_cluster.json
