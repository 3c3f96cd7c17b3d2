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


def poison_tail(page_table, lens, *row_tensors, page: int = PAGE):
    """Write NaN into the slots past each sequence's length inside its last page, in every ``[slots, ...]`` row
    tensor given (stale cache contents that a kernel must keep out of its output)."""
    for b, n in enumerate(int(x) for x in lens):
        idx = torch.arange(n, -(-n // page) * page, device=page_table.device)
        slots = page_table[b, idx // page].long() * page + idx % page
        for t in row_tensors:
            t[slots] = float("nan")


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
    (128, 128, 1, 4096), (128, 128, 1, 16384), (128, 128, 1, 65536),
    (32, 128, 2, 4096), (32, 128, 2, 16384), (32, 128, 4, 16384),
    (128, 16, 1, 16384), (32, 16, 1, 65536),
]
CASES_QUICK = [(32, 128, 1, 4096), (32, 128, 1, 16384), (32, 128, 2, 16384), (128, 16, 1, 16384)]


def run(rec, quick: bool = False, cases=None, providers=("bmm-bf16", "lowbit-bf16", "lowbit-fp8", "lowbit-fp8-bf16pv",
                                                         "lowbit-fp8-f16pv"),
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
                pv_fp8 = prov in ("lowbit-fp8", "lowbit-fp8-f16pv")
                pv16 = prov == "lowbit-fp8-f16pv"
                key = "fp8" if fp8 else "bf16"
                args = [(s["q"], s[key], s["page_table"], s["seq_lens"]) for s in sets]

                def fn(q, cache, pt, sl):
                    return mla_decode(q, cache, pt, sl, max_seq_len=L, pv_fp8=pv_fp8, pv16=pv16)
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


def report_markdown(run_dir, accuracy_json=None, round_name: str = "") -> str:
    """Markdown tables for docs/sections/mla.md from one device run's ``mla.json`` (suite),
    ``mla_results.json`` (sweep, generated code) and an accuracy JSON (``mla_accuracy.json``,
    possibly from an earlier round: pass its path)."""
    import json
    from pathlib import Path

    run_dir = Path(run_dir)
    suite = json.loads((run_dir / "mla.json").read_text())
    res = json.loads((run_dir / "mla_results.json").read_text()) if (run_dir / "mla_results.json").exists() else {}
    env, ceil = suite["env"], suite["ceilings"]
    out = [f"{env['gpu']} ({env['torch']}, triton {env['triton']}), {env['date']}{' (' + round_name + ')' if round_name else ''}; "
           "ceilings measured in the run: " + ", ".join(f"{k} {v:.2f}" for k, v in ceil.items()), "",
           "Median ms (TFLOP/s, TB/s of the fewest bytes). bf16/bmm = lowbit-bf16 vs the ANCHORS bmm path; "
           "fp8/bf16 = lowbit-fp8 vs lowbit-bf16 (same run). Roofline: bf16 rows vs the measured bf16 peak; "
           "FP8 rows vs max(bytes / HBM, bf16-equivalent FLOPs / bf16 peak) (module docstring).", "",
           ]
    cell = {}
    for r in suite["rows"]:
        if "median_ms" in r:
            cell[(tuple(r["case"].values()), r["provider"])] = r
    keys = list(dict.fromkeys(k for k, _ in cell))
    have = {p for _, p in cell}
    variants = [(p, t) for p, t in (("lowbit-fp8-f16pv", "fp8 fp16-PV"), ("lowbit-fp8-bf16pv", "fp8 bf16-PV"))
                if p in have]

    def fmt(r):
        return f"{r['median_ms']:.3f} ({r.get('TFLOPs', 0):.0f} TF/s, {r.get('TBps', 0):.2f} TB/s)" if r else ""

    def ratio(a, b):
        return f"{a['median_ms'] / b['median_ms']:.2f}x" if a and b else ""

    def pct(r):
        return f"{100 * r['frac_roofline']:.0f}%" if r and "frac_roofline" in r else ""

    head = ["B", "H", "Sq", "L", "bmm-bf16", "lowbit-bf16", "lowbit-fp8 (SnapMLA, FP8 PV)"] + [t for _, t in variants]
    head += ["bf16/bmm", "fp8/bf16"] + [f"{t}/bf16" for _, t in variants] + ["bf16 % roofline", "fp8 % roofline"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in keys:
        m, b, f = (cell.get((k, p)) for p in ("bmm-bf16", "lowbit-bf16", "lowbit-fp8"))
        vs = [cell.get((k, p)) for p, _ in variants]
        row = list(map(str, k)) + [fmt(m), fmt(b), fmt(f)] + [fmt(v) for v in vs]
        row += [ratio(m, b), ratio(b, f)] + [ratio(b, v) for v in vs] + [pct(b), pct(f)]
        out.append("| " + " | ".join(row) + " |")
    if res.get("sweep"):
        out += ["", "Kernel variants (B=32, H=128, L=16384, Sq=1; what Triton generated for each; SASS per thread per "
                "KV block = the length of each loop of the kernel, unmasked main loop first):", "",
                "| variant | ms | TFLOP/s | tile (rows x cols, tokens, warps) | SASS per block | regs | spills | smem B |",
                "|---|---|---|---|---|---|---|---|"]
        for r in res["sweep"]:
            if "ms" in r:
                tile = f"{r.get('block_m')} x {512 // (r.get('dv_splits') or 1)}, {r.get('block_n')}, {r.get('num_warps')}"
                out.append(f"| {r.get('name', '')} | {r['ms']:.3f} | {r['TFLOPs']:.0f} | {tile} | "
                           f"{', '.join(map(str, r.get('sass_loops') or []))} | {r.get('n_regs')} | {r.get('n_spills')} | "
                           f"{r.get('shared_bytes')} |")
            else:
                out.append(f"| {r.get('name', '')} | error: {r.get('error', '')[:80]} | | | | | | |")
    if res.get("sweep_few_heads"):
        out += ["", "Memory-bound variants (B=128, H=16, L=16384, Sq=1: 16 rows per sequence; TB/s of the cache bytes, "
                "1152 B/token bf16, 644 B/token FP8; 'tokens-as-M' = K·Q^T and V^T·P^T, the block's tokens / the value "
                "columns as the MMA M dimension; m16 = 16-row tile, mma.sync):", "",
                "| variant | ms | TB/s | tile (rows, tokens, warps, stages) | splits | regs | spills | smem B |",
                "|---|---|---|---|---|---|---|---|"]
        for r in res["sweep_few_heads"]:
            if "ms" in r:
                out.append(f"| {r.get('name', '')} | {r['ms']:.3f} | {r.get('TBps', 0):.2f} | {r.get('block_m')}, "
                           f"{r.get('block_n')}, {r.get('num_warps')}, {r.get('num_stages')} | {r.get('splits')} | "
                           f"{r.get('n_regs')} | {r.get('n_spills')} | {r.get('shared_bytes')} |")
            else:
                out.append(f"| {r.get('name', '')} | error: {r.get('error', '')[:80]} | | | | | | |")
    if accuracy_json is not None and Path(accuracy_json).exists():
        acc = json.loads(Path(accuracy_json).read_text())
        title = (f"Accuracy (SnapMLA Table 2 configurations; `lowbit.eval.mla_accuracy`, L={acc.get('L')}, "
                 f"H={acc.get('H')}, hidden={acc.get('hidden')}; attention output vs float64 with a bf16 query, so "
                 "the cache rows isolate the cache format; A: RoPE in FP8 too, B: per-tensor scale 1.0, C: per-tensor "
                 "dynamic, D: per-block; 'ours (kernel)' = the whole FP8 decode with the default kernel):")
        out += ["", title, "",
                "| RoPE outlier x | config | RMSE | 1 - cos | rel L2 |", "|---|---|---|---|---|"]
        for row in acc["rows"]:
            out.append(f"| {row.get('rope_outlier', '')} | {row['config']} | {row['rmse']:.2e} | {row['cos_diff']:.2e} | "
                       f"{row['rel_l2']:.2e} |")
    return "\n".join(out) + "\n"
