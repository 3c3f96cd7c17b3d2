"""Session 37: Qwen3 on the GPU. (t) the GPU tests of the model variants and the fused q/k-norm RoPE launch;
(m) ``lowbit.bench.model`` on the Qwen3-8B shapes (all 36 layers, random bf16 weights): bf16 beside the recipes,
and ``fireq+norope`` (the q / k norms and RoPE as eager torch ops) beside ``fireq`` (one launch per layer); run 2:
``+noropeq`` rows (the decode's norms + RoPE in the RoPE launch) beside the defaults (in the cache's append launch).

    PYTHONPATH=$PWD python3 benchmarks/device/s37_qwen3.py OUT   (env S37_PARTS=tm, S37_TESTS, S37_TEST_LOG,
    S37_RECIPES, S37_BATCHES, S37_CTX, S37_BUDGET, S37_PREFILL)
"""
import os
import subprocess
import sys

sys.path.insert(0, os.getcwd())
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
parts = os.environ.get("S37_PARTS", "tm")
if "t" in parts:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rA",
           *os.environ.get("S37_TESTS", "tests/test_arch_variants.py tests/test_generate.py "
                                        "tests/test_hf_attention.py").split()]
    log = os.environ.get("S37_TEST_LOG", "gpu_tests_s37_qwen3.txt")
    with open(os.path.join(out, log), "w") as f:
        f.write("# H200, session 37: " + " ".join(cmd[1:]) + "\n")
        f.flush()
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    print(open(os.path.join(out, log)).read()[-3000:], flush=True)
if "m" in parts:
    from lowbit.bench import model as BM

    recipes = tuple(os.environ.get("S37_RECIPES", "fireq,fireq+norope,qserve,flute-nf4").split(","))
    BM.run(out, arch="qwen3-8b", recipes=recipes,
           prefill_seqs=[int(x) for x in os.environ.get("S37_PREFILL", "1024").split(",")],
           decode_batches=[int(b) for b in os.environ.get("S37_BATCHES", "1,16,64").split(",")],
           decode_ctx=[int(c) for c in os.environ.get("S37_CTX", "1024").split(",")], layers=36,
           time_budget_s=float(os.environ.get("S37_BUDGET", "330")),
           command="PYTHONPATH=$PWD python3 benchmarks/device/s37_qwen3.py OUT (env "
                   + " ".join(f"{k}={os.environ[k]}" for k in ("S37_PARTS", "S37_RECIPES", "S37_BATCHES", "S37_CTX",
                                                                 "S37_BUDGET", "S37_PREFILL") if k in os.environ) + ")")
