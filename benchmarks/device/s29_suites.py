"""Session-29 rows of the two W4A8 linear suites after XTMA / the hybrid split / the dequantize-once threshold:
``lowbit.bench.suites.w4a8_fp8.linear_rows`` (Llama-3-8B, M = 128 / 256 / 1024; act-quant counted, the GEMM alone,
cuBLAS bf16, ``_scaled_mm`` FP8 with and without its quantization, tinygemm to M = 256) and
``lowbit.bench.suites.w4a8_int8.linear_rows`` (Llama-3-8B, M = 64 / 128 / 1024 / 4096), same process.

    PYTHONPATH=$PWD python3 benchmarks/device/s29_suites.py --out DIR   (env S29_FP8_MS, S29_INT8_MS)
"""
import os
import sys

sys.path.insert(0, os.getcwd())
from lowbit.bench import harness  # noqa: E402
from lowbit.bench.harness import probe_args  # noqa: E402
from lowbit.bench.suites import w4a8_fp8 as fp8  # noqa: E402
from lowbit.bench.suites import w4a8_int8 as int8  # noqa: E402

a = probe_args("fi")
cmd = "PYTHONPATH=$PWD python3 benchmarks/device/s29_suites.py " + " ".join(sys.argv[1:])
if "f" in a.parts:
    rec = harness.Recorder("s29_w4a8_fp8", ceilings={})
    fp8.linear_rows(rec, models=("llama3-8b",), ms=[int(m) for m in os.environ.get("S29_FP8_MS", "128,256,1024").split(",")])
    p = rec.write(a.out, baseline=fp8.BASELINE, command=cmd)
    print(open(p.with_suffix(".md")).read(), flush=True)
if "i" in a.parts:
    rec = harness.Recorder("s29_w4a8_int8", ceilings={})
    int8.linear_rows(rec, ms=[int(m) for m in os.environ.get("S29_INT8_MS", "64,128,1024,4096").split(",")])
    p = rec.write(a.out, baseline=int8.BASELINE, command=cmd)
    print(open(p.with_suffix(".md")).read(), flush=True)
