#!/usr/bin/env bash
# Session 43, three calls as s42_second.sh's (carry .gguf_a with argument "suite": the whole GPU suite; .gguf_b; then
# .gguf_c + .whl_small): the GPTQ rows of session 42's perplexity table after the GPTQ kernel and the TF32 Hessians.
TAG=s43f TIMEOUT=330 RUN="python3 benchmarks/device/s42_gptq.py --budget 200 --gptq-only --name s43_gptq_ppl" \
    exec bash benchmarks/device/s42_second.sh "$@"
