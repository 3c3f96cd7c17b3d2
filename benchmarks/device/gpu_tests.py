"""Device script: the GPU-only tests (``@pytest.mark.gpu``), then compute-sanitizer (memcheck) over
them when the machine allows it. Output: pytest log + junit XML + sanitizer log in --out."""
import argparse
import os
import shutil
import subprocess
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--sanitize", action="store_true", help="also run the gpu tests under compute-sanitizer")
a = ap.parse_args()
os.makedirs(a.out, exist_ok=True)
env = dict(os.environ, PYTHONUNBUFFERED="1")
env.pop("TRITON_INTERPRET", None)
cmd = [sys.executable, "-m", "pytest", "-v", "-m", "gpu", "-p", "no:cacheprovider", "--timeout", "60",
       f"--junitxml={a.out}/gpu_tests.xml", "tests"]
# pytest writes straight into the log file (line by line with -rA), so a run cut by the time limit
# still says which tests passed and which one hung.
log = f"{a.out}/gpu_tests.txt"
with open(log, "w") as f:
    try:
        rc = subprocess.run(cmd[:4] + ["-rA", "--durations=15"] + cmd[4:], env=env, stdout=f, stderr=subprocess.STDOUT,
                            timeout=float(os.environ.get("GPU_TESTS_LIMIT", 70))).returncode
    except subprocess.TimeoutExpired:
        rc = 124
        f.write("\n[gpu_tests] time limit reached\n")
print(open(log).read()[-6000:])
if a.sanitize and shutil.which("compute-sanitizer"):
    scmd = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3"] + cmd[:-1] + ["-x", "tests"]
    try:
        s = subprocess.run(scmd, env=env, capture_output=True, text=True, timeout=float(os.environ.get("SANITIZE_LIMIT", 150)))
        open(f"{a.out}/sanitizer.txt", "w").write(s.stdout[-200000:] + s.stderr[-50000:])
        print("compute-sanitizer rc", s.returncode, s.stdout[-1500:])
    except subprocess.TimeoutExpired:
        print("compute-sanitizer: timed out")
sys.exit(rc)
