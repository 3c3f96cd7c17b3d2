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
               ptxas_ok=r.returncode == 0, serialized=re.findall(r"\((C751\d)\)", r.stderr))  # wgmma serialized
    return row


def signature(fn, types: dict, consts: dict, default_type: str = "i32"):
    """``(signature, constexprs, attrs)`` for ``triton.compile`` of the JIT / Gluon kernel ``fn``, read from its
    parameter list: runtime arguments typed by ``types`` (name -> "*bf16", "fp32", ...; others ``default_type``),
    constexprs from ``consts`` or their defaults, pointers and ``stride_*`` arguments marked divisible by 16 (as the
    launchers' aligned, contiguous tensors specialize them)."""
    sig, cexpr, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            cexpr[p.name] = consts[p.name] if p.name in consts else p.default
            continue
        sig[p.name] = types.get(p.name, default_type)
        if sig[p.name].startswith("*") or p.name.startswith("stride_"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, cexpr, attrs


# runtime argument types of the Gluon INT4-cache decode kernel (``decode_kv4._decode_kv4_gluon_kernel``), signed codes
# (zero-point caches: KZ / VZ "*u8")
KV4_GLUON_TYPES = {"Q": "*bf16", "KC": "*u8", "KS": "*fp8e4nv", "KZ": "*fp8e4nv", "VC": "*u8", "VS": "*fp8e4nv",
                   "VZ": "*fp8e4nv", "PT": "*i32", "LENS": "*i32", "CRSQ": "*fp32", "O": "*bf16", "OP": "*fp32",
                   "MP": "*fp32", "LP": "*fp32", "TS": "*i64", "qk_scale": "fp32"}


def kv4_gluon_types(zero_point: bool) -> dict:
    """``KV4_GLUON_TYPES`` for signed (``zero_point`` False) or zero-point codes."""
    return {**KV4_GLUON_TYPES, **({"KZ": "*u8", "VZ": "*u8"} if zero_point else {})}


def report(kernel, patterns: dict, label: str, ptx_path: str | None = None, top: int = 40) -> dict:
    """Print one offline build of a compiled Gluon/Triton ``kernel``: the count of each PTX substring of
    ``patterns`` (name -> text), shared memory, registers / spills (``assemble``), then the SASS per loop and its
    opcodes through the bundled cuobjdump; the PTX goes to ``ptx_path`` when given. Returns the row."""
    ptx = kernel.asm["ptx"]
    row = {name: ptx.count(pat) for name, pat in patterns.items()}
    row["shared_B"] = kernel.metadata.shared
    assemble(ptx, row)
    print(f"triton {triton.__version__}, {label}: {row}")
    if ptx_path:
        with open(ptx_path, "w") as f:
            f.write(ptx)
    try:  # SASS per block (the loops' lengths)
        from triton.tools.disasm import get_sass

        from lowbit.bench.harness import sass_summary

        summ = sass_summary(get_sass(kernel.asm["cubin"]), top=top)
        row.update(sass_loops=summ["sass_loops"], loop_ops=summ.get("loop_ops"))
        print({"sass_loops": summ["sass_loops"], "BAR": summ.get("loop_ops", {}).get("BAR"),
               "loop_ops": summ.get("loop_ops")})
    except Exception as exc:  # pragma: no cover - no cuobjdump
        print(f"no SASS: {type(exc).__name__}: {exc}")
    return row


def write_json(path: str, rows, script: str, argv: list, **extra) -> None:
    """Raw offline rows to ``path`` with the build's environment: target, Triton and bundled ptxas versions, Python,
    and the command (``script`` and its ``argv``); ``extra`` fields beside them."""
    import json
    import platform
    import sys

    ver = subprocess.run([PTXAS, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    env = {"kind": "offline build, no GPU (target sm_90a)", "triton": triton.__version__, "ptxas": ver,
           "python": platform.python_version(), "command": " ".join(["python3", script] + list(argv))}
    with open(path, "w") as f:
        json.dump({"env": env, **extra, "rows": rows}, f, indent=1)
    print(f"wrote {path}", file=sys.stderr)
