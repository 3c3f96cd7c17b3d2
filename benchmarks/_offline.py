"""Shared by the offline (no GPU) build scripts: assemble Triton's PTX for sm_90a with the ptxas bundled with Triton."""
import os
import re
import subprocess
import tempfile

import triton

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def assemble(ptx: str, row: dict) -> dict:
    """``row`` + registers / spills of ``ptx`` assembled for sm_90a by Triton's bundled ptxas (the PTX ``.version``
    line is lowered to one the bundled ptxas reads)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(re.sub(r"\.version \d+\.\d+", ".version 8.7", ptx))
        r = subprocess.run([PTXAS, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")], capture_output=True,
                           text=True)
    regs = re.findall(r"Used (\d+) registers", r.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
    row.update(regs=int(regs[0]) if regs else None, spill_B=int(spills[0]) if spills else None,
               ptxas_ok=r.returncode == 0)
    return row
