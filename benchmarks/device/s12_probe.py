"""Session-12 probe (device): the W4A8-FP8 fused GEMM between decode and the dequantize + _scaled_mm path.

    python3 benchmarks/device/s12_probe.py --out DIR [--parts f]

(f) M = 128 / 256 on the Llama-3-8B projections, x pre-quantized (the GEMM alone), CUDA graphs of back-to-back
    launches with the weights rotated over > 2x L2, variants alternated over 3 rounds (median, min, max):
    the committed default (``pick_config``: swap-AB, 128 x-rows x 64 weight rows, 4 warps, 4 stages) against
    wider weight tiles (128 rows, 8 warps), 256 x-rows per tile (the weight dequantized once per 256 tokens),
    3 stages, twice the split-K, Triton's own FP8 promotion (``max_num_imprecise_acc`` = 128, no ``ACC_TILE``),
    the decode path's TMA + scale-word + 2 K tiles per step, and the dequantize + ``torch._scaled_mm`` mode;
    peers cuBLAS bf16 and ``_scaled_mm`` row-wise on a pre-dequantized FP8 weight in the same alternation.
    Every variant's output is compared with the default's (max |diff| / max |y|).
(g) the register-table LUT kernel (``lowbit.kernels.lut_wgmma``, 4-bit NF g128, bf16) at M = 16 / 32 / 64 / 128
    against the fragment kernel's default (M <= 64) and cuBLAS bf16, launch variants (stages, row tiles per
    program, prefetch, programs per SM, warps), rel-L2 to the float64 reference, registers / spills / wgmma count.
(h) as (g) with the second variant set: one dot per decoded half vs the halves stacked into one dot (``one_dot``),
    64 or 128 rows per program, 1 / 2 / 4 programs per SM; above M = 64 also the op's dequantize + cuBLAS path.
(i) as (g): the stacked 128-row dot over 8 warps (two warpgroups of 64 rows) against the committed configs.
(j) as (g): ``scale_w`` (scales folded into the decoded tile, a flat chunk loop with the accumulator carried, which
    lets Triton pipeline the loads and keep wgmma groups in flight) in several configs against the committed default;
    rel-L2 shows the extra rounding of T[c] * s to bf16; M = 1 too (the fragment kernel's range). Session-13 candidate.
(k) as (g) with 3-bit codes (NF3 g128): the register-table kernel (default, ``scale_w``) against the fragment kernel.
(l) session 13, after (j) / (k): ``scale_w`` on top of the committed per-shape configs (4-bit), with programs per SM,
    stages, the stacked dot and the 'asm' decode varied around them.
(m) as (l) with 3-bit codes (NF3 g128).
(o) session 13: ``reg_a`` on 3-bit codes (NF3 g128) against the same configs without it.
(p) session 13, run in session 14 (``results/h200/s14_probe_prmt.json``): the fragment kernel's ``prmt`` option
    against its default at M = 1 / 4 / 16; the option was removed after it (slower), and this part with it.
(n) session 13: ``reg_a`` (the decoded tile relabelled into the wgmma A-register fragment: no shared-memory round
    trip, x gathered in 4-byte pairs) against the committed configs, with and without ``scale_w``, 4-bit.
(q) session 14: the register-table kernel's split-K count (4-bit NF g128; ``r``: 3-bit NF3) at M = 16 / 32 / 64 / 128:
    the committed rule (enough programs for ``ctas_per_sm`` per SM) against ``balance`` (the split that evens out the
    SMs for the programs that really fit, from the compiled kernel's registers / shared memory) and fixed splits.
Output: ``s12_probe.json``.
"""
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from lowbit.bench.harness import alternate_us as rounds, env_info, probe_args, rotation_copies as copies  # noqa: E402

a = probe_args("f")
LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336), "gate_up": (28672, 4096)}
doc = {"suite": "s12_probe", "env": env_info("benchmarks/device/s12_probe.py --parts " + a.parts)}


def dump():
    with open(os.path.join(a.out, "s12_probe.json"), "w") as f:
        json.dump(doc, f, indent=1)


def finish(section, key, res, fns, x, wbs):
    """Add the cuBLAS bf16 peer, time every variant (3 alternated rounds), record and print the row, write."""
    fns["peer_cublas_bf16"] = [lambda b=b: torch.nn.functional.linear(x, b) for b in wbs]
    try:
        res["us"] = rounds(fns, rounds=3)
    except Exception as exc:
        traceback.print_exc()
        res["error"] = str(exc)[:300]
    doc[section][key] = res
    print(key, json.dumps(res.get("us")), json.dumps(res["check"]), json.dumps(res.get("compiled", {})), flush=True)
    dump()


def packed_sets(N, K, bits):
    """Random NF codes of an [N, K] weight packed for the 'mma' layout on the GPU, and enough copies of (codes,
    scales, high plane) to rotate through > 2x L2: (qm, qh, scales, pairs, table, wsets)."""
    from lowbit.formats.lut import pack_codes_mma, pair_table, quantize_lut

    q = quantize_lut(torch.randn(N, K, device="cuda"), bits=bits, group_size=128, scale_dtype=torch.bfloat16)
    qm, qh = pack_codes_mma(q.codes, bits, 128, K)
    qm, qh = qm.cuda(), (qh.cuda() if qh is not None else None)
    sc = q.scales.t().contiguous()
    pairs = pair_table(q.table, bits, torch.bfloat16).cuda()
    wsets = [(qm, sc, qh)] + [(qm.clone(), sc.clone(), None if qh is None else qh.clone())
                              for _ in range(copies(qm.numel() * 4 * bits // 4) - 1)]
    return qm, qh, sc, pairs, q.table.cuda(), wsets


if "f" in a.parts:
    from lowbit.formats.common import FP8_E4M3
    from lowbit.formats.w4a8_fp8 import quantize_weight
    from lowbit.kernels import w4a8_fp8_gemm as fk
    from lowbit.kernels.act_quant import per_token_quant_triton

    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    doc["fp8_mid_m"] = {}
    for name, (N, K) in LAYERS.items():
        w = torch.randn(N, K, device="cuda") * 0.02
        codes, sc, invd = quantize_weight(w, 128, 6)
        invd = float(invd)
        del w
        ws = [(codes, sc)] + [(codes.clone(), sc.clone()) for _ in range(copies(codes.numel()) - 1)]
        wb = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        wbs = [wb] + [wb.clone() for _ in range(copies(wb.numel() * 2) - 1)]
        wf = fk.dequantize_to_fp8(codes, sc, K, 128)
        wfs = [wf] + [wf.clone() for _ in range(copies(wf.numel()) - 1)]
        kt = K // 128
        for M in (128, 256):
            key = f"{name} N={N} K={K} M={M}"
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            xq, sx = per_token_quant_triton(x, FP8_E4M3)
            base = fk.pick_config(M, N, K, nsm)
            mid = dict(SWAP_AB=True, GROUP_M=1, ACC_TILE=True, SWORD=False, **fk.MID_FLAGS)
            var = {"default": base}
            var["bn128_w8"] = dict(mid, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4,
                                   SPLIT_K=fk._split_k(-(-N // 128) * -(-M // 128), kt, nsm))
            var["st3"] = dict(base, num_stages=3)
            var["split2x"] = dict(base, SPLIT_K=min(kt // 4, 2 * base["SPLIT_K"]))
            var["imprecise128"] = dict(base, ACC_TILE=False, IMPRECISE=128)
            var["tma_sword_k2"] = dict(mid, BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3, SWORD=True, TMA=True,
                                       KSTEP=2, SPLIT_K=1)
            var["bm64_w4"] = dict(mid, BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4,
                                  SPLIT_K=fk._split_k(-(-N // 128) * -(-M // 64), kt, nsm))
            if M == 256:
                var["bm256_w4"] = dict(mid, BLOCK_M=256, BLOCK_N=64, num_warps=4, num_stages=3,
                                       SPLIT_K=fk._split_k(-(-N // 64), kt, nsm))
                var["bm256_bn128_w8"] = dict(mid, BLOCK_M=256, BLOCK_N=128, num_warps=8, num_stages=3,
                                             SPLIT_K=fk._split_k(-(-N // 128), kt, nsm))
            var["scaled_mm_mode"] = dict(base, MODE="scaled_mm")
            res = {"configs": {k: {kk: vv for kk, vv in v.items()} for k, v in var.items()}, "check": {}}
            ref = fk.w4a8_fp8_gemm(xq, sx, codes, sc, invd, K, 128).float()
            fns = {}
            for vn, cfg in var.items():
                try:
                    y = fk.w4a8_fp8_gemm(xq, sx, codes, sc, invd, K, 128, config=cfg).float()
                    torch.cuda.synchronize()
                    err = ((y - ref).abs().max() / ref.abs().max()).item()
                    res["check"][vn] = err
                    fns[vn] = [lambda c=c, s=s, cfg=cfg: fk.w4a8_fp8_gemm(xq, sx, c, s, invd, K, 128, config=cfg)
                               for c, s in ws]
                except Exception as exc:  # a config that does not compile or fit: recorded, not timed
                    traceback.print_exc()
                    res["check"][vn] = f"{type(exc).__name__}: {exc}"[:300]
            sa = sx.reshape(M, 1)
            sb = torch.full((1, N), invd, device="cuda", dtype=torch.float32)
            fns["peer_scaled_mm_fp8"] = [lambda f=f: torch._scaled_mm(xq, f.t(), scale_a=sa, scale_b=sb,
                                                                      out_dtype=torch.bfloat16) for f in wfs]
            finish("fp8_mid_m", key, res, fns, x, wbs)
        del ws, wbs, wfs, wf, wb
        torch.cuda.empty_cache()
dump()  # (f)

if set("ghijklmno") & set(a.parts):
    # (g) the register-table LUT kernel (lowbit.kernels.lut_wgmma) against the fragment kernel's default and
    # cuBLAS bf16 at M = 16 / 32 / 64 / 128 (4-bit NF g128, bf16), launch configs alternated over 3 rounds
    from lowbit.formats.lut import dequantize_lut, pack_codes_mma, pair_table, quantize_lut
    from lowbit.kernels import lut_gemm as LG
    from lowbit.kernels import lut_wgmma as LW

    PART_G2 = "h" in a.parts  # (h): the second variant set of (g)
    PART_G3 = "i" in a.parts  # (i): the third
    PART_SW = "j" in a.parts  # (j): scales folded into the decoded tile (scale_w) against the committed configs
    PART_B3 = "k" in a.parts  # (k): 3-bit codes, the kernel (default, scale_w) against the fragment kernel
    PART_SD = bool(set("lm") & set(a.parts))  # (l) / (m): scale_w around the committed configs, 4 / 3 bits
    BITS = 3 if (PART_B3 or "m" in a.parts or "o" in a.parts) else 4
    PART_RA = "n" in a.parts
    PART_RA3 = "o" in a.parts
    TAG = {"o": "_rega3", "n": "_rega", "m": "_sw3", "l": "_sw4", "k": "_3bit", "j": "_sw", "i": "_3", "h": "_2"}.get(
        next((c for c in "onmlkjih" if c in a.parts), ""), "")
    doc["lut_wgmma" + TAG] = {}
    for name, (N, K) in LAYERS.items():
        q = quantize_lut(torch.randn(N, K, device="cuda"), bits=BITS, group_size=128, scale_dtype=torch.bfloat16)
        qm, qh = pack_codes_mma(q.codes, BITS, 128, K)
        qm = qm.cuda()
        qh = qh.cuda() if qh is not None else None
        sc = q.scales.t().contiguous()
        pairs = pair_table(q.table, BITS, torch.bfloat16).cuda()
        tab = q.table.cuda()
        wsets = [(qm, sc, qh)] + [(qm.clone(), sc.clone(), None if qh is None else qh.clone())
                                  for _ in range(copies(qm.numel() * 4 * BITS // 4) - 1)]
        wb = dequantize_lut(q).to(torch.bfloat16)
        wbs = [wb] + [wb.clone() for _ in range(copies(wb.numel() * 2) - 1)]
        del q
        for M in ((1, 16, 32, 64, 128) if (PART_SW or PART_RA) else (16, 32, 64, 128)):
            key = f"{name} N={N} K={K} M={M}"
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = (x.double() @ wb.double().t())
            if PART_RA3:  # 3-bit: the committed configs (reg_a 'auto' = on) against reg_a off, and the stacked dot
                var = {"w_default": {}, "w_noreg": {"reg_a": False},
                       "ra_o4": {"reg_a": True, "rt": 4, "one_dot": True, "ctas_per_sm": 2},
                       "ra_o4_c4": {"reg_a": True, "rt": 4, "one_dot": True, "ctas_per_sm": 4},
                       "ra_d8_c1": {"reg_a": True, "rt": 8, "one_dot": False, "ctas_per_sm": 1},
                       "ra_o4_nosw": {"reg_a": True, "rt": 4, "one_dot": True, "ctas_per_sm": 2, "scale_w": False}}
            elif PART_RA:  # the A tile in registers (reg_a) on the committed configs and their scale_w variants
                var = {"w_default": {}, "ra_default": {"reg_a": True},
                       "ra_d8": {"reg_a": True, "rt": 8, "one_dot": False, "scale_w": False},
                       "ra_d8_sw": {"reg_a": True, "rt": 8, "one_dot": False, "scale_w": True},
                       "ra_o4_sw": {"reg_a": True, "rt": 4, "one_dot": True, "scale_w": True, "ctas_per_sm": 2},
                       "ra_o4": {"reg_a": True, "rt": 4, "one_dot": True, "scale_w": False, "ctas_per_sm": 2},
                       "ra_d8_c4": {"reg_a": True, "rt": 8, "one_dot": False, "scale_w": False, "ctas_per_sm": 4},
                       "ra_d8_s4": {"reg_a": True, "rt": 8, "one_dot": False, "scale_w": False, "num_stages": 4}}
            elif PART_SD:  # scale_w on the committed configs, varied around them
                var = {"w_default": {}, "sw_default": {"scale_w": True}, "sw_c1": {"scale_w": True, "ctas_per_sm": 1},
                       "sw_c4": {"scale_w": True, "ctas_per_sm": 4}, "sw_s4": {"scale_w": True, "num_stages": 4},
                       "sw_o4_c2": {"scale_w": True, "one_dot": True, "rt": 4, "ctas_per_sm": 2},
                       "sw_d8_c2": {"scale_w": True, "one_dot": False, "rt": 8, "ctas_per_sm": 2},
                       "swasm_default": {"scale_w": "asm"}}
            elif PART_SW:  # scale_w: flat chunk loop, accumulator carried (async wgmma in the sm_90 PTX)
                var = {"w_default": {}}
                for od, rt, c, st in ((False, 8, 1, 3), (False, 8, 2, 3), (False, 8, 4, 3), (True, 4, 2, 3),
                                      (False, 8, 2, 2), (False, 8, 2, 4), (True, 4, 4, 4)):
                    var[f"sw_{'o' if od else 'd'}{rt}_c{c}_s{st}"] = {"scale_w": True, "one_dot": od, "rt": rt,
                                                                       "ctas_per_sm": c, "num_stages": st}
                var["swasm_d8_c2_s3"] = {"scale_w": "asm", "one_dot": False, "rt": 8, "ctas_per_sm": 2}
                var["swasm_d8_c4_s4"] = {"scale_w": "asm", "one_dot": False, "rt": 8, "ctas_per_sm": 4, "num_stages": 4}
            elif PART_B3:
                var = {"w_default": {}, "sw_default": {"scale_w": True}, "sw_d8_c2_s4": {"scale_w": True, "rt": 8,
                                                                                         "one_dot": False,
                                                                                         "ctas_per_sm": 2,
                                                                                         "num_stages": 4}}
            elif PART_G3:  # third round: the stacked dot over two warpgroups (8 warps, 64 rows each)
                var = {f"w_{'o' if od else 'd'}{rt}w{nw}_c{c}": {"one_dot": od, "rt": rt, "ctas_per_sm": c,
                                                                 "num_warps": nw}
                       for od, rt, nw, c in ((False, 8, 4, 2), (False, 8, 4, 4), (True, 8, 8, 1), (True, 8, 8, 2),
                                             (True, 8, 8, 4), (True, 4, 4, 2))}
            elif PART_G2:  # second round: two dots vs one stacked dot (one_dot), 128 or 64 rows per program
                var = {f"w_{'o' if od else 'd'}{rt}_c{c}": {"one_dot": od, "rt": rt, "ctas_per_sm": c}
                       for od, rt, c in ((False, 8, 1), (False, 8, 2), (False, 8, 4), (True, 8, 1), (True, 8, 2),
                                         (True, 8, 4), (True, 4, 2), (True, 4, 4))}
                var["w_o4_c4_s4"] = {"one_dot": True, "rt": 4, "ctas_per_sm": 4, "num_stages": 4}
            else:
                var = {"w_default": {}, "w_s2": {"num_stages": 2}, "w_s4": {"num_stages": 4}, "w_rt4": {"rt": 4},
                       "w_nopf": {"prefetch": False}, "w_c1": {"ctas_per_sm": 1}, "w_c4": {"ctas_per_sm": 4},
                       "w_w8": {"num_warps": 8}}
                if M == 128:
                    var["w_bm128"] = {"block_m": 128}
            res = {"check": {}, "compiled": {}}
            fns = {}
            if M <= 64:
                y = LG.lut_mma_triton(x, qm, qh, sc, pairs, tab, bits=BITS, group_size=128, out_features=N)
                res["check"]["mma_default"] = ((y.double() - ref).norm() / ref.norm()).item()
                fns["mma_default"] = [lambda c=c, s=s, h=h: LG.lut_mma_triton(x, c, h, s, pairs, tab, bits=BITS,
                                                                              group_size=128, out_features=N)
                                      for c, s, h in wsets]
            for vn, ov in var.items():
                try:
                    y = LW.lut_wgmma_triton(x, qm, sc, pairs, group_size=128, out_features=N, bits=BITS, qweight_hi=qh,
                                            **ov)
                    torch.cuda.synchronize()
                    res["check"][vn] = ((y.double() - ref).norm() / ref.norm()).item()
                    k = LW.LAST_COMPILED["wgmma"]
                    ptx = k.asm.get("ptx", "")
                    res["compiled"][vn] = {"regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None),
                                           "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
                                           "prmt": ptx.count("prmt.b32"), "shared": k.metadata.shared}
                    fns[vn] = [lambda c=c, s=s, h=h, ov=ov: LW.lut_wgmma_triton(x, c, s, pairs, group_size=128,
                                                                                out_features=N, bits=BITS,
                                                                                qweight_hi=h, **ov)
                               for c, s, h in wsets]
                except Exception as exc:
                    traceback.print_exc()
                    res["check"][vn] = f"{type(exc).__name__}: {exc}"[:300]
            if M > 64:  # the op's path above MAX_KERNEL_M: dequantize (fragment layout) + cuBLAS
                fns["dequant_cublas"] = [lambda c=c, s=s, h=h: torch.nn.functional.linear(x, LG.lut_dequant_mma_triton(
                    c, h, s, tab, bits=BITS, group_size=128, out_features=N, in_features=K, dtype=torch.bfloat16))
                    for c, s, h in wsets]
            finish("lut_wgmma" + TAG, key, res, fns, x, wbs)
        del wsets, wbs, wb
        torch.cuda.empty_cache()
    dump()


if set("qr") & set(a.parts):  # (q) / (r) split-K of the register-table kernel: committed rule vs balance vs fixed
    from lowbit._utils import cdiv, resident_ctas
    from lowbit.kernels import lut_wgmma as LW
    from lowbit.kernels.lut_gemm import _sm_count

    for bits in [b for b, c in ((4, "q"), (3, "r")) if c in a.parts]:
        sec = f"lut_wgmma_split_bits{bits}"
        doc[sec] = {}
        for name, (N, K) in LAYERS.items():
            qm, qh, sc, pairs, _, wsets = packed_sets(N, K, bits)
            wb = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
            wbs = [wb] + [wb.clone() for _ in range(copies(wb.numel() * 2) - 1)]
            ng = cdiv(K, 128)
            for M in (16, 32, 64, 128):
                key = f"{name} N={N} K={K} M={M}"
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                kw = dict(group_size=128, out_features=N, bits=bits, qweight_hi=qh)
                cfg = LW.wgmma_config(M, N, K, 128, bits)
                y0 = LW.lut_wgmma_triton(x, qm, sc, pairs, **kw)
                torch.cuda.synchronize()
                k = LW.LAST_COMPILED["wgmma"]
                occ = resident_ctas(k, cfg["num_warps"])
                split0 = LW.LAST_COMPILED["wgmma_split"]
                tiles = cdiv(cdiv(N, 16), cfg["rt"]) * cdiv(M, cfg["block_m"])
                LW.lut_wgmma_triton(x, qm, sc, pairs, balance=True, **kw)
                sbal = LW.LAST_COMPILED["wgmma_split"]
                res = {"config": {kk: str(v) for kk, v in cfg.items()}, "tiles": tiles, "groups": ng,
                       "regs": getattr(k, "n_regs", None), "resident": occ, "split_default": split0,
                       "split_balance": sbal, "sms": _sm_count(x.device), "check": {
                           "_plan": f"tiles {tiles} groups {ng} regs {getattr(k, 'n_regs', None)} resident {occ} "
                                    f"split default {split0} balance {sbal}"}}
                var = {"default": {}, "balance": {"balance": True}}
                for sk in (1, 2, 4, 8, 16):
                    if sk not in (split0, sbal) and sk <= ng:
                        var[f"split{sk}"] = {"split_k": sk}
                fns = {}
                for vn, ov in var.items():
                    try:
                        y = LW.lut_wgmma_triton(x, qm, sc, pairs, **kw, **ov)
                        torch.cuda.synchronize()
                        res["check"][vn] = (f"split {LW.LAST_COMPILED['wgmma_split']}, max|diff| vs default "
                                            f"{(y.float() - y0.float()).abs().max().item():.3g}")
                        fns[vn] = [lambda c=c, s_=s_, h=h, ov=ov: LW.lut_wgmma_triton(
                            x, c, s_, pairs, group_size=128, out_features=N, bits=bits, qweight_hi=h, **ov)
                            for c, s_, h in wsets]
                    except Exception as exc:
                        traceback.print_exc()
                        res["check"][vn] = f"{type(exc).__name__}: {exc}"[:300]
                finish(sec, key, res, fns, x, wbs)
            del wsets, wbs, wb
            torch.cuda.empty_cache()
    dump()
