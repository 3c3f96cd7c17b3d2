"""Test helpers for the decode PTX of the LUT kernels: a tiny PTX interpreter and the host model of the
lane-duplicated pair table in shared memory (imported by ``test_lut_wgmma.py`` and ``test_lut_mma.py``)."""
import torch


def run_ptx(asm: str, operands: dict, smem: dict | None = None, lane: int = 0) -> dict:
    """A tiny interpreter of the integer PTX the decodes use (and/or/shr/shl/add/prmt/lop3 .b32, mov.b32 {h, h},
    ``mov.u32`` of ``%laneid`` (``lane``) and ``global_smem`` (address 0), ``ld.shared.b32`` from ``smem``, a dict of
    byte address -> 32-bit word): ``prmt`` default mode (selector nibble bit 3 = replicate the selected byte's
    sign), ``lop3`` immLut over (a, b, c) = (0xF0, 0xCC, 0xAA)."""
    import re

    M32 = 0xFFFFFFFF
    reg = dict(operands)
    reg.update({"%laneid": lane, "global_smem": 0})

    def val(tok):
        tok = tok.strip()
        return int(tok, 0) & M32 if tok[0].isdigit() else reg[tok]

    for ins in asm.replace("{", " ").replace("}", " ").split(";"):
        ins = ins.strip()
        if not ins or ins.startswith(".reg"):
            continue
        op, rest = ins.split(None, 1)
        if op == "mov.b32":  # mov.b32 {$a, $b}, r  (the braces were stripped: "$a, $b, r")
            lo, hi, src = [t.strip() for t in rest.split(",")]
            reg[lo], reg[hi] = reg[src] & 0xFFFF, reg[src] >> 16
            continue
        if op == "mov.u32":
            d, src = [t.strip() for t in rest.split(",")]
            reg[d] = reg[src]
            continue
        if op == "ld.shared.b32":  # ld.shared.b32 d, [r]
            d, addr = [t.strip() for t in rest.split(",")]
            a = reg[addr.strip("[]")]
            assert a % 4 == 0 and a in smem, f"ld.shared at {a:#x}: unaligned or outside the table"
            reg[d] = smem[a]
            continue
        d, *args = [t.strip() for t in rest.split(",")]
        a = [val(t) for t in args]
        if op == "and.b32":
            r = a[0] & a[1]
        elif op == "or.b32":
            r = a[0] | a[1]
        elif op == "shr.u32":
            r = a[0] >> a[1]
        elif op == "shl.b32":
            r = (a[0] << a[1]) & M32
        elif op == "add.u32":
            r = (a[0] + a[1]) & M32
        elif op == "prmt.b32":
            src = [(a[0] >> 8 * i) & 0xFF for i in range(4)] + [(a[1] >> 8 * i) & 0xFF for i in range(4)]
            r = 0
            for i in range(4):
                sel = (a[2] >> 4 * i) & 0xF
                byte = src[sel & 7]
                if sel & 8:
                    byte = 0xFF if byte & 0x80 else 0
                r |= byte << 8 * i
        elif op == "lop3.b32":
            r = 0
            for bit in range(32):
                idx = (((a[0] >> bit) & 1) << 2) | (((a[1] >> bit) & 1) << 1) | ((a[2] >> bit) & 1)
                r |= ((a[3] >> idx) & 1) << bit
        elif op in ("mul.rn.bf16x2", "mul.rn.f16x2"):  # two 16-bit floats per register, round to nearest even
            dt = torch.bfloat16 if "bf16" in op else torch.float16
            halves = torch.tensor([[a[0] & 0xFFFF, a[0] >> 16], [a[1] & 0xFFFF, a[1] >> 16]], dtype=torch.int32)
            f = halves.to(torch.int16).view(dt).float()  # (int32 -> int16 wraps to the same bits)
            prod = (f[0] * f[1]).to(dt).view(torch.int16).to(torch.int32) & 0xFFFF
            r = int(prod[0]) | int(prod[1]) << 16
        else:
            raise AssertionError(f"unexpected PTX op {op!r}")
        reg[d] = r
        assert re.fullmatch(r"[a-z0-9$]+", d)
    return reg


def pair_smem(table: list[int], off: int, stride: int = 128) -> dict:
    """Host model of ``lut_gemm._store_pair_table`` at byte offset ``off``: 16-byte slot f holds 4 copies of pair row
    e = f // 8 (low half T[e & 15], high half T[e >> 4]), i.e. lane l's copy of row e at ``off + stride e + 4 l``."""
    return {off + stride * (f // 8) + 16 * (f % 8) + 4 * i: table[(f // 8) & 15] | table[(f // 8) >> 4] << 16
            for f in range(256 * 8) for i in range(4)}
