"""Device script: the GPU-only tests (``@pytest.mark.gpu``), then compute-sanitizer (memcheck) over
them when the machine allows it. Output: pytest log + junit XML + sanitizer log in --out."""
import argparse
import os
import shutil
import subprocess
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--sanitize", action="store_true", default=os.environ.get("LOWBIT_SANITIZE") == "1",
                help="also run the kernel tests under compute-sanitizer memcheck (or LOWBIT_SANITIZE=1)")
a = ap.parse_args()
os.makedirs(a.out, exist_ok=True)
env = dict(os.environ, PYTHONUNBUFFERED="1")
env.pop("TRITON_INTERPRET", None)
cmd = [sys.executable, "-m", "pytest", "-v", "-m", "gpu", "-p", "no:cacheprovider", "--timeout", "60",
       f"--junitxml={a.out}/gpu_tests.xml", "tests"]
# GPU_TESTS_WORKERS=N: N pytest-xdist workers sharing the GPU (the device machine has xdist 3.8; the suite is mostly
# Triton compiles on the host: 474 s in one process in session 40). Not used in a run yet.
_workers = int(os.environ.get("GPU_TESTS_WORKERS", "1"))
_xdist = ["-n", str(_workers)] if _workers > 1 else []  # (the main run only; compute-sanitizer runs one process)
# pytest writes straight into the log file (line by line with -rA), so a run cut by the time limit
# still says which tests passed and which one hung.
log = f"{a.out}/gpu_tests.txt"
with open(log, "w") as f:
    try:
        rc = subprocess.run(cmd[:4] + ["-rA", "--durations=15"] + _xdist + cmd[4:], env=env, stdout=f,
                            stderr=subprocess.STDOUT,
                            timeout=float(os.environ.get("GPU_TESTS_LIMIT", 70))).returncode
    except subprocess.TimeoutExpired:
        rc = 124
        f.write("\n[gpu_tests] time limit reached\n")
print(open(log).read()[-6000:])
def _sanitizer():
    import glob
    found = shutil.which("compute-sanitizer") or sorted(glob.glob("/usr/local/cuda*/bin/compute-sanitizer"))
    return found if isinstance(found, str) else (found[-1] if found else None)


if a.sanitize:
    tool = _sanitizer()
    if tool is None:
        print("compute-sanitizer: not found on this machine")
    else:
        scmd = ([tool, "--tool", "memcheck", "--error-exitcode", "3"] + cmd[:-2]
                + ["--timeout", "140", "-x", "tests/test_gpu_kernels.py",
                   "tests/test_generate.py::test_float_append_rope_bit_equal_gpu",  # session 9's new launch mode
                   "tests/test_lut_mma.py::test_gpu_pdl_bit_equal",  # session 9: the PDL launch
                   "tests/test_generate.py::test_fused_add_gpu",  # session 10: residual adds in the norm kernels (dp4a: M = 1 rows above)
                   "-k", "not compiles"])
        slog = f"{a.out}/sanitizer.txt"
        with open(slog, "w") as f:
            try:
                src = subprocess.run(scmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                     timeout=float(os.environ.get("SANITIZE_LIMIT", 150))).returncode
            except subprocess.TimeoutExpired:
                src = 124
                f.write("\n[sanitizer] time limit reached\n")
        print("compute-sanitizer rc", src)
        print(open(slog).read()[-3000:])
sys.exit(rc)
