"""MLA decode (DeepSeek-V3 absorbed shapes: latent 512 + RoPE 64, page 64): lowbit FP8 vs lowbit bf16
vs the bf16 bmm-softmax-bmm path of ANCHORS.

Counted work per call (the FlashMLA convention): FLOPs = 2*B*Sq*H*L*(Dc + Dr) + 2*B*Sq*H*L*Dc;
fewest bytes = the cache read once (1152 B/token bf16, 644 B/token FP8) + q and out.
Roofline: bf16 rows against the measured bf16 GEMM peak; FP8 rows against max(bytes/HBM,
FLOPs-in-bf16-equivalents/bf16 peak) where the bf16-equivalent cost of one token is
(Dc/2 + Dr + Dc/2)/(2 Dc + Dr) of bf16's (SnapMLA §4 roofline: 8 FP8 content tiles count half).
"""
from __future__ import annotations

import torch

from lowbit.bench.harness import l2_bytes, time_cuda

BASELINE = "lowbit-bf16"
DC, DR, PAGE = 512, 64, 64


def make_caches(B: int, L: int, *, fp8: bool, bf16: bool, seed: int = 0, device="cuda", rope_range: float = 4.0):
    """Random latents for B sequences of L tokens in a shuffled page pool: returns dict with the
    bf16 pool [P, 64, 576] (and its dense view for the bmm path), the fp8 cache tuple, page table,
    seq_lens. The RoPE part gets a wider range than the content part (as in real MLA caches)."""
    from lowbit.ops.mla import mla_append

    g = torch.Generator(device=device).manual_seed(seed)
    pages = B * (-(-L // PAGE))
    out = {}
    kv = torch.randn(pages, PAGE, DC + DR, device=device, dtype=torch.bfloat16, generator=g)
    kv[..., DC:] *= rope_range
    perm = torch.randperm(pages, device=device, generator=g).to(torch.int32)
    out["page_table"] = perm.view(B, -1)
    out["seq_lens"] = torch.full((B,), L, dtype=torch.int32, device=device)
    if fp8:
        cache = (torch.empty(pages, PAGE, DC, device=device, dtype=torch.float8_e4m3fn),
                 torch.empty(pages, PAGE, DR, device=device, dtype=torch.bfloat16),
                 torch.empty(pages, PAGE, device=device, dtype=torch.float32))
        slots = torch.arange(pages * PAGE, device=device)
        mla_append(kv.view(-1, DC + DR), cache, slots)
        out["fp8"] = cache
    if bf16:
        out["bf16"] = (kv[..., :DC], kv[..., DC:], None)
        out["dense"] = kv.view(B, -1, DC + DR)[:, :L]
    else:
        del kv
    return out


def _sets(B, L, Sq, H, fp8, bf16, n):
    return [dict(make_caches(B, L, fp8=fp8, bf16=bf16, seed=i), q=torch.randn(B, Sq, H, DC + DR, device="cuda",
                 dtype=torch.bfloat16)) for i in range(n)]


def cache_bytes(B, L, fp8):
    return B * L * ((DC + 4 + 2 * DR) if fp8 else 2 * (DC + DR))


def flops(B, H, Sq, L):
    return 2.0 * B * Sq * H * L * (2 * DC + DR)


def bmm_path(q, kv):
    """ANCHORS' bf16 bmm-softmax-bmm absorbed MLA decode (one query token): q [B, H, 576], kv [B, L, 576]."""
    s = torch.bmm(q, kv.transpose(1, 2)) * (DC + DR) ** -0.5
    p = torch.softmax(s.float(), dim=-1).to(torch.bfloat16)
    return torch.bmm(p, kv[:, :, :DC])


CASES_FULL = [  # (B, H, Sq, L)
    (32, 128, 1, 4096), (32, 128, 1, 16384), (32, 128, 1, 65536),
    (128, 128, 1, 4096), (128, 128, 1, 16384),
    (32, 128, 2, 4096), (32, 128, 2, 16384), (32, 128, 4, 16384),
    (128, 16, 1, 16384), (32, 16, 1, 65536),
]
CASES_QUICK = [(32, 128, 1, 4096), (32, 128, 1, 16384), (32, 128, 2, 16384), (128, 16, 1, 16384)]


def run(rec, quick: bool = False, cases=None, providers=("bmm-bf16", "lowbit-bf16", "lowbit-fp8", "lowbit-fp8-bf16pv"),
        reps=None,
        after_case=None, deadline=None):
    """Time every case; ``after_case()`` runs after each (e.g. to write partial results) and cases
    starting after ``deadline`` (a time.time() value) are skipped with a note."""
    import time

    from lowbit.ops.mla import mla_decode

    cases = cases or (CASES_QUICK if quick else CASES_FULL)
    bf16_peak = rec.ceilings.get("bf16_TFLOPs")
    hbm = rec.ceilings.get("hbm_TBps")
    equiv = (DC / 2 + DR + DC / 2) / (2 * DC + DR)
    for (B, H, Sq, L) in cases:
        case = {"B": B, "H": H, "Sq": Sq, "L": L}
        if deadline is not None and time.time() > deadline:
            rec.note(f"{case}: skipped (time budget)")
            continue
        fl = flops(B, H, Sq, L)
        n = max(1, min(3, -(-2 * l2_bytes() // cache_bytes(B, L, True))))
        try:
            sets = _sets(B, L, Sq, H, any(p.startswith("lowbit-fp8") for p in providers), True, n)
        except torch.OutOfMemoryError as exc:
            rec.note(f"{case}: out of memory building caches ({exc})"[:200])
            torch.cuda.empty_cache()
            continue
        r = reps or (20 if fl > 1e12 else 50)
        for prov in providers:
            try:
                if prov == "bmm-bf16":
                    if Sq != 1:
                        continue
                    args = [(s["q"].view(B, H, DC + DR), s["dense"]) for s in sets]
                    t = time_cuda(bmm_path, args, warmup=3, reps=r)
                    byts = cache_bytes(B, L, False)
                    rec.record(case, prov, t, flops=fl, bytes_moved=byts, peak="bf16")
                    continue
                fp8 = prov.startswith("lowbit-fp8")
                pv_fp8 = prov == "lowbit-fp8"
                key = "fp8" if fp8 else "bf16"
                args = [(s["q"], s[key], s["page_table"], s["seq_lens"]) for s in sets]

                def fn(q, cache, pt, sl):
                    return mla_decode(q, cache, pt, sl, max_seq_len=L, pv_fp8=pv_fp8)
                t = time_cuda(fn, args, warmup=5, reps=r)
                byts = cache_bytes(B, L, fp8) + B * Sq * H * (DC + DR + DC) * 2
                row = rec.record(case, prov, t, flops=fl, bytes_moved=byts, peak="bf16" if not fp8 else None)
                if fp8 and bf16_peak and hbm:
                    roof = max(fl * equiv / (bf16_peak * 1e12), byts / (hbm * 1e12))
                    row["roofline_ms"] = roof * 1e3
                    row["frac_roofline"] = roof / (t["median_ms"] * 1e-3)
            except Exception as exc:  # one failure must not stop the rest
                rec.record(case, prov, None, note=f"{type(exc).__name__}: {exc}"[:200])
        del sets
        torch.cuda.empty_cache()
        if after_case is not None:
            after_case()
