"""Device script: decode attention over the float (bf16) KV cache, ``lowbit.ops.kv4.decode_float``.

1. correctness on the GPU vs the float64 reference: ragged paged batches, GQA, TQ 1-4, D 64/128,
   one split and several;
2. timings (Llama-3-8B attention: 32 query / 8 KV heads, D = 128; one new token per request) at
   B in {1, 16, 64} x L in {1k, 8k}: lowbit's kernel over the runner's dense cache (one page of
   S_max per request) and over 64-token pages, against SDPA with the length mask the runner's
   bf16 baseline uses (``DenseKV``, S_max = L + 64) and SDPA without a mask on exactly L keys (the
   flash kernel; what a cache with equal lengths could use). Bytes = K + V of the L keys read;
   the roofline is bytes / the measured HBM bandwidth.

    PYTHONPATH=. python3 benchmarks/device/decode_float.py --out DIR
"""
import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from lowbit.bench import harness
from lowbit.bench.suites.kv4 import random_float_pages
from lowbit.kernels.decode_float import LAST_LAUNCH, decode_float_triton
from lowbit.ops import kv4 as ops

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
args = ap.parse_args()
os.makedirs(args.out, exist_ok=True)
T0 = time.time()
checks = []


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def paged(lens, hkv, page, d, seed=0):
    return random_float_pages(lens, hkv, page, d, torch.bfloat16, seed=seed)


for lens, hq, hkv, tq, d, page, splits in [([1000, 37, 513], 32, 8, 1, 128, 64, None), ([4097, 70], 32, 8, 4, 128, 64, 7),
                                           ([300, 1], 8, 1, 2, 64, 16, None), ([8192], 32, 8, 1, 128, 8192, None)]:
    k, v, pt, lengths = paged(lens, hkv, page, d)
    q = torch.randn(len(lens), hq, tq, d).bfloat16().cuda()
    err = rel(ops.decode_float(q, k, v, pt, lengths, num_splits=splits or 0), ops.decode_float_ref(q, k, v, pt, lengths))
    ok = err < 1e-2
    checks.append(dict(lens=lens, hq=hq, hkv=hkv, tq=tq, d=d, page=page, splits=splits, rel_l2=err, ok=ok))
    print(f"{'PASS' if ok else 'FAIL'} lens={lens} hq={hq} hkv={hkv} tq={tq} d={d} page={page}: rel-L2 {err:.2e}", flush=True)

ceil = harness.measure_ceilings()
rec = harness.Recorder("decode_float", ceilings=ceil)
H, HKV, D = 32, 8, 128
for B in (1, 16, 64):
    for L in (1024, 8192):
        smax = L + 64
        sets = []
        for s in range(3):
            kd = torch.randn(B, HKV, smax, D, device="cuda", dtype=torch.bfloat16)
            vd = torch.randn_like(kd)
            q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16)
            sets.append((q, kd, vd))
        lengths = torch.full((B,), L, dtype=torch.int32, device="cuda")
        pt_dense = torch.arange(B, dtype=torch.int32, device="cuda")[:, None]
        mask = (torch.arange(smax, device="cuda").view(1, 1, 1, -1) <= (L - 1))
        mask = mask.expand(B, 1, 1, smax)
        # paged copy of set 0..2 with 64-token pages (request b owns pages [b * n, (b + 1) * n))
        npg = smax // 64
        paged_sets = [(q, kd.view(B, HKV, npg, 64, D).transpose(1, 2).reshape(B * npg, HKV, 64, D).contiguous(),
                       vd.view(B, HKV, npg, 64, D).transpose(1, 2).reshape(B * npg, HKV, 64, D).contiguous())
                      for q, kd, vd in sets]
        pt_paged = torch.arange(B * npg, dtype=torch.int32, device="cuda").view(B, npg)
        case = {"B": B, "L": L, "Hq": H, "Hkv": HKV, "D": D}
        byts = 2 * B * HKV * L * D * 2
        fl = harness.attention_flops(B, H, 1, L, D, False)

        def lowbit_dense(q, kd, vd):
            return ops.decode_float(q, kd, vd, pt_dense, lengths, max_len=smax)

        def lowbit_paged(q, kp, vp):
            return ops.decode_float(q, kp, vp, pt_paged, lengths, max_len=smax)

        def sdpa_mask(q, kd, vd):
            qg = q.view(B, HKV, H // HKV, D)
            return F.scaled_dot_product_attention(qg, kd, vd, attn_mask=mask)

        def sdpa_exact(q, kd, vd):
            return F.scaled_dot_product_attention(q, kd[:, :, :L], vd[:, :, :L], enable_gqa=True)

        ref = sdpa_exact(*sets[0]).float()
        for name, fn, xs in (("lowbit-dense", lowbit_dense, sets), ("lowbit-paged64", lowbit_paged, paged_sets),
                             ("sdpa-mask (runner bf16)", sdpa_mask, sets), ("sdpa-exact-L", sdpa_exact, sets)):
            try:
                out = fn(*xs[0]).reshape(ref.shape).float()
                t = harness.time_cuda(fn, xs, reps=100)
                rec.record(case, name, t, flops=fl, bytes_moved=byts, peak="bf16", note=f"rel-L2 vs sdpa-exact {rel(out, ref):.1e}")
                print(f"B={B:3d} L={L:5d} {name:24s} {t['median_ms'] * 1e3:8.1f} us  {byts / t['median_ms'] / 1e9:6.2f} TB/s",
                      flush=True)
            except Exception as exc:
                rec.record(case, name, None, note=f"{type(exc).__name__}: {exc}"[:200])
                print(f"B={B} L={L} {name} FAIL {type(exc).__name__}: {exc}", flush=True)
# 3. split-count / block sweep at small batch (the runner's dense cache: one page of L + 64 per request)
sweep = harness.Recorder("decode_float_sweep", ceilings=ceil)
for B in (1, 4, 16):
    for L in (1024, 8192):
        smax = L + 64
        kd = torch.randn(B, HKV, smax, D, device="cuda", dtype=torch.bfloat16)
        vd = torch.randn_like(kd)
        xs = [(torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16),) for _ in range(3)]
        lengths = torch.full((B,), L, dtype=torch.int32, device="cuda")
        pt_dense = torch.arange(B, dtype=torch.int32, device="cuda")[:, None]
        case = {"B": B, "L": L}
        ref = ops.decode_float(xs[0][0], kd, vd, pt_dense, lengths, max_len=smax).float()
        for bn in (32, 64):
            for ns in (None, 4, 8, 16, 32, 64, 128):
                def fn(q, bn=bn, ns=ns):
                    return decode_float_triton(q, kd, vd, pt_dense, lengths, max_len=smax, num_splits=ns, block_n=bn)
                try:
                    err = rel(fn(*xs[0]), ref)
                    used = LAST_LAUNCH["num_splits"]
                    t = harness.time_cuda(fn, xs, reps=100)
                    sweep.record(case, f"bn{bn} splits={ns or 'auto'}", t, bytes_moved=2 * B * HKV * L * D * 2,
                                 note=f"splits used {used}; rel-L2 vs default {err:.1e}")
                    print(f"sweep B={B} L={L} bn={bn} splits={ns} (used {used}): {t['median_ms'] * 1e3:.1f} us", flush=True)
                except Exception as exc:
                    print(f"sweep B={B} L={L} bn={bn} splits={ns} FAIL {exc}", flush=True)
        del kd, vd
sweep.write(args.out)
rec.note(f"checks: {sum(c['ok'] for c in checks)}/{len(checks)} pass; " + json.dumps(checks))
rec.write(args.out, baseline="sdpa-mask (runner bf16)")
print(f"checks {sum(c['ok'] for c in checks)}/{len(checks)}; total {time.time() - T0:.1f}s")
