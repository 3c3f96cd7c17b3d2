"""KV4 decode attention over the paged INT4 cache vs SDPA bf16 decode (FireQ §1.6, QServe KV4).

Shapes: B=16 sequences, GQA 32/8 heads, D=128, one (and four) query tokens, L = 4k..32k cached
tokens, and B=1 long contexts (split-KV). Bytes counted for lowbit are the compressed cache bytes
read: per token per head, K and V each D/2 code bytes + 1 FP8 scale byte (+ 1 zero-point byte for
kv4-zp), plus Q and O; SDPA moves the bf16 K and V. Also the fused append (RoPE + quantize +
paged write) for one decode step and for a 4k-token prefill.
"""
from __future__ import annotations

import torch

from lowbit.bench import peers
from lowbit.bench.harness import attention_flops, rotating_inputs, time_cuda

BASELINE = "sdpa-flash-bf16"


def random_cache(B, Hkv, D, L, *, page=64, zero_point=False, device="cuda", seed=0):
    """A filled paged cache (random codes, FP8 scales ~ U(0.01, 0.3)) of B sequences of length L,
    pages scattered in the pool. Returns dict of the decode_kv4 cache arguments."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    npg = -(-L // page)
    P = B * npg
    def codes():
        return torch.randint(0, 256, (P, Hkv, page, D // 2), dtype=torch.uint8, device=device)
    def scales():
        return (torch.rand(P, Hkv, page, device=device) * 0.29 + 0.01).to(torch.float8_e4m3fn)
    out = {"k_codes": codes(), "k_scale": scales(), "v_codes": codes(), "v_scale": scales()}
    if zero_point:
        out["k_zero"] = torch.randint(0, 16, (P, Hkv, page), dtype=torch.uint8, device=device)
        out["v_zero"] = torch.randint(0, 16, (P, Hkv, page), dtype=torch.uint8, device=device)
    perm = torch.randperm(P, generator=g).to(torch.int32)
    out["page_table"] = perm.view(B, npg).to(device)
    out["lengths"] = torch.full((B,), L, dtype=torch.int32, device=device)
    return out


def kv4_bytes(B, Hq, Hkv, D, L, tq, zero_point):
    per = D // 2 + 1 + (1 if zero_point else 0)
    return 2 * B * Hkv * L * per + 2 * 2 * B * Hq * tq * D


def decode_rows(rec, quick: bool, lengths=None, batches=(16,)):
    from lowbit.ops.kv4 import decode_kv4

    Hq, Hkv, D = 32, 8, 128
    lengths = lengths or ([4096, 8192, 16384, 32768] if not quick else [8192])
    for B in batches:
        for L in lengths:
            case = {"B": B, "L": L, "tq": 1}
            fl = attention_flops(B, Hq, 1, L, D, False)

            def make():
                return (torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16),
                        torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16),
                        torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16))
            sets = rotating_inputs(make)
            fn = peers.sdpa("flash")
            try:
                fn(*sets[0])
                t = time_cuda(fn, sets)
                rec.record(case, "sdpa-flash-bf16", t, flops=fl, peak="bf16",
                           bytes_moved=2 * B * Hkv * L * D * 2 + 4 * B * Hq * D)
            except Exception as exc:
                rec.record(case, "sdpa-flash-bf16", None, note=str(exc)[:200])
            f2 = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
            t = time_cuda(f2, sets)
            rec.record(case, "sdpa-default-bf16", t, flops=fl, peak="bf16",
                       bytes_moved=2 * B * Hkv * L * D * 2 + 4 * B * Hq * D)
            del sets
            torch.cuda.empty_cache()
            for zp in (False, True):
                name = "lowbit-kv4-zp" if zp else "lowbit-kv4"
                for tq in ((1, 4) if not zp else (1,)):
                    c = dict(case, tq=tq)
                    csets = rotating_inputs(lambda: (torch.randn(B, Hq, tq, D, device="cuda", dtype=torch.bfloat16),
                                                     random_cache(B, Hkv, D, L, zero_point=zp)))
                    run = lambda q, c_: decode_kv4(q, max_len=L, **c_)  # noqa: E731
                    t = time_cuda(run, csets)
                    rec.record(c, name, t, flops=attention_flops(B, Hq, tq, L, D, False), peak="bf16",
                               bytes_moved=kv4_bytes(B, Hq, Hkv, D, L, tq, zp))
                    del csets
                    torch.cuda.empty_cache()


def append_rows(rec, quick: bool):
    from lowbit.ops.kv4 import kv4_append

    Hkv, D, page = 8, 128, 64
    for B, T in ((16, 1), (1, 4096)):
        L0 = 4096
        case = {"append_B": B, "T": T}
        c = random_cache(B, Hkv, D, L0 + T, page=page)
        start = torch.full((B,), L0, dtype=torch.int32, device="cuda")
        sets = rotating_inputs(lambda: (torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16),
                                        torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16),
                                        torch.randn(B, T, D, device="cuda", dtype=torch.bfloat16),
                                        torch.randn(B, T, D, device="cuda", dtype=torch.bfloat16)), min_sets=3)
        run = lambda k, v, cs, sn: kv4_append(k, v, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"],  # noqa: E731
                                               c["page_table"], start, cos=cs, sin=sn)
        t = time_cuda(run, sets)
        byts = 2 * B * Hkv * T * D * 2 + 2 * B * T * D * 2 + 2 * B * Hkv * T * (D // 2 + 1)
        rec.record(case, "lowbit-kv4-append", t, bytes_moved=byts)


def run(rec, quick: bool):
    decode_rows(rec, quick)
    decode_rows(rec, quick, lengths=[32768] if quick else [32768, 131072], batches=(1,))
    append_rows(rec, quick)
