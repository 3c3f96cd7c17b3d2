"""Session 37: the headline rows of issues 8 and 9 again on the current code (the README's prefill rows were from
round R14, session 6; sessions 34 and 36 changed the quantization launch since). (a) ``lowbit.bench.suites.
attention_prefill`` with the default providers only (lowbit fp8 / fp8-kv4 / int8 / int8-qk, SDPA cuDNN and flash,
SageAttention 1.0.6), B=4, H=32, D=128, S = 1k / 4k / 16k, causal and not; (k) the INT4-cache decode rows at
B=16, L = 8k / 16k / 32k (``lowbit.bench.suites.kv4.decode_rows``).

    PYTHONPATH=$PWD:/tmp/site python3 benchmarks/device/s37_suites.py OUT   (env S37_PARTS=ak; SageAttention from
    the carried wheel: pip install --no-deps --target /tmp/site .whl/sageattention-1.0.6-*.whl)
"""
import os
import sys

sys.path.insert(0, os.getcwd())
from lowbit.bench import harness  # noqa: E402
from lowbit.bench.suites import attention_prefill as AP  # noqa: E402
from lowbit.bench.suites import kv4 as KV  # noqa: E402

out = sys.argv[1]
parts = os.environ.get("S37_PARTS", "ak")
cmd = "PYTHONPATH=$PWD:/tmp/site python3 benchmarks/device/s37_suites.py OUT" + (
    f" (env S37_PARTS={os.environ['S37_PARTS']})" if "S37_PARTS" in os.environ else "")
if "a" in parts:
    rec = harness.Recorder("s37_attention_prefill", ceilings={})
    AP.run(rec, providers=("sdpa-cudnn", "sdpa-flash", "lowbit-fp8", "lowbit-fp8-kv4", "lowbit-int8", "lowbit-int8-qk",
                           "sageattention-1.0.6"))
    p = rec.write(out, baseline=AP.BASELINE, command=cmd)
    print(open(p.with_suffix(".md")).read(), flush=True)
if "k" in parts:
    rec = harness.Recorder("s37_kv4_decode", ceilings={})
    KV.decode_rows(rec, False, lengths=[8192, 16384, 32768])
    p = rec.write(out, baseline=KV.BASELINE, command=cmd)
    print(open(p.with_suffix(".md")).read(), flush=True)
