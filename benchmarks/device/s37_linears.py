"""Session 37: the small-M rows of the three weight-quantized linears again on the current code (the README's M = 1 /
16 rows of ``w4a8-fp8`` were from round R14, session 6, of ``lut`` from session 24, of ``w4a8-int8`` from session 19):
(f) ``lowbit.bench.suites.w4a8_fp8.linear_rows`` Llama-3-8B at M = 1 / 16 (act-quant counted, the GEMM alone, cuBLAS
bf16, ``_scaled_mm`` with and without its quantization, tinygemm); (i) ``w4a8_int8.linear_rows`` at M = 1 / 16;
(l) ``lut.target_rows`` at M = 1 / 16 / 32, 4-bit and 3-bit, with tinygemm and bitsandbytes NF4; the larger M
(F) ``w4a8_fp8`` at M = 128 / 1024 / 4096 (env S37_FP8_BIG), (I) ``w4a8_int8`` at M = 1024 / 4096 (S37_INT8_BIG).

    PYTHONPATH=$PWD:/tmp/site python3 benchmarks/device/s37_linears.py OUT   (env S37_PARTS=fil; bitsandbytes from
    the carried wheel: pip install --no-deps --target /tmp/site .whl/bitsandbytes-*.whl)
"""
import os
import sys

sys.path.insert(0, os.getcwd())
from lowbit.bench import harness  # noqa: E402
from lowbit.bench.suites import lut as LUT  # noqa: E402
from lowbit.bench.suites import w4a8_fp8 as F8  # noqa: E402
from lowbit.bench.suites import w4a8_int8 as I8  # noqa: E402

out = sys.argv[1]
parts = os.environ.get("S37_PARTS", "fil")  # F and I on request
cmd = "PYTHONPATH=$PWD:/tmp/site python3 benchmarks/device/s37_linears.py OUT" + (
    f" (env S37_PARTS={os.environ['S37_PARTS']})" if "S37_PARTS" in os.environ else "")
big_fp8 = [int(m) for m in os.environ.get("S37_FP8_BIG", "128,1024,4096").split(",")]
big_int8 = [int(m) for m in os.environ.get("S37_INT8_BIG", "1024,4096").split(",")]
for key, name, fn, base in (("f", "s37_w4a8_fp8", lambda r: F8.linear_rows(r, models=("llama3-8b",), ms=[1, 16]), F8.BASELINE),
                            ("i", "s37_w4a8_int8", lambda r: I8.linear_rows(r, ms=[1, 16]), I8.BASELINE),
                            ("l", "s37_lut", lambda r: LUT.target_rows(r, False, ms=(1, 16, 32)), LUT.BASELINE),
                            ("F", "s37_w4a8_fp8_bigm", lambda r: F8.linear_rows(r, models=("llama3-8b",), ms=big_fp8),
                             F8.BASELINE),
                            ("I", "s37_w4a8_int8_bigm", lambda r: I8.linear_rows(r, ms=big_int8), I8.BASELINE)):
    if key in parts:
        rec = harness.Recorder(name, ceilings={})
        fn(rec)
        p = rec.write(out, baseline=base, command=cmd)
        print(open(p.with_suffix(".md")).read(), flush=True)
