"""Quantized prefill attention (issues 8 and 9): lowbit fp8 / int8 / int8-qk / fp8-kv4 against
SDPA (cuDNN, FlashAttention-2), SageAttention 1.0.6 and INT-FlashAttention's Triton kernels.

Shapes: B=4, H=32, D=128, S in {1k, 4k, 16k}, causal and not (ANCHORS' attention rows).
lowbit rows take bf16 Q/K/V and **include** quantization (one quantization launch, then the
attention; fp8 quantizes Q in that launch too (``q_pre``, session 3), int8 / int8-qk in each
attention program's prologue; ``lowbit-fp8-qreg`` is fp8 with Q in the prologue, for comparison;
``lowbit-fp8-tl`` / ``lowbit-fp8-gluon`` force the tl / the Gluon fp8 attention kernel, ``*-plain`` /
``*-vperm`` the plain / the VPERM V^T key order (session 5, config ``vperm``);
``*-kvquant-only`` / ``*-qkvquant-only`` rows time the quantization launch alone,
``*-2launch`` rows call the same two launches through the kernel API (``*-fused`` would be the
one-launch option ``fuse_kv=True``, measured slower in session 2); ``fp8-kv4`` reads K/V already in the KV4 cache format
(as in prefill with a KV4 cache) and quantizes Q. ``*-attn-only`` rows time the attention launch
alone on pre-quantized K/V (and Q for fp8). INT-FlashAttention runs from its public code (commit 7f7bfb0) when
its files are importable (``.refcode/int_fa`` on sys.path; never part of lowbit), on
pre-quantized random INT8 inputs as in its own benchmark (quantization excluded; full-INT8 only
non-causal: its causal path drops the off-diagonal blocks, see the digest §7.1).
FLOPs: 4 B H Sq Skv D, halved for causal.
"""
from __future__ import annotations

import torch

from lowbit.bench import peers
from lowbit.bench.harness import attention_flops, rotating_inputs, time_cuda

BASELINE = "sdpa-cudnn"
GLUON = {"gluon": True, "vperm": True}  # row ``lowbit-fp8-gluon``: the Gluon kernel (FlashAttention-3 order), VPERM
SHAPE = dict(B=4, H=32, D=128)


def _reps(S: int) -> tuple[int, int]:
    """(warmup, reps) per length: big shapes are timed fewer times (device budget)."""
    return {1024: (5, 50), 2048: (5, 40), 4096: (3, 30), 8192: (2, 15)}.get(S, (2, 10))


def int_fa_peers():
    """INT-FlashAttention's Triton kernels, or PeerUnavailable."""
    try:
        from flash_atten_full_int8 import attention_full_int8  # type: ignore
        from flash_atten_int8 import attention_int8  # type: ignore
    except Exception as exc:
        raise peers.PeerUnavailable(f"INT-FlashAttention code not importable: {exc}")
    return attention_full_int8, attention_int8


def lowbit_fns():
    from lowbit.ops import attention_prefill as ap

    return {
        "lowbit-fp8": lambda q, k, v, causal: ap.fp8_attention(q, k, v, causal=causal),
        "lowbit-int8": lambda q, k, v, causal: ap.int8_attention(q, k, v, causal=causal),
        "lowbit-int8-qk": lambda q, k, v, causal: ap.int8_qk_attention(q, k, v, causal=causal),
    }


def run(rec, quick: bool = False, *, seq_lens=None, causals=(False, True), providers=None):
    from lowbit.formats.kv4 import quantize_kv4
    from lowbit.kernels.attention_prefill import attention_prefill_triton, default_config, quant_attention_triton
    from lowbit.kernels.attention_quant import quantize_kv_triton
    from lowbit.ops.attention_prefill import fp8_kv4_attention

    B, H, D = SHAPE["B"], SHAPE["H"], SHAPE["D"]
    seq_lens = seq_lens or ([1024, 4096] if quick else [1024, 4096, 16384])
    want = (lambda name: True) if providers is None else (lambda name: name in providers)
    try:
        fa_full, fa_half = int_fa_peers()
    except peers.PeerUnavailable as exc:
        fa_full = fa_half = None
        rec.note(str(exc))
    for S in seq_lens:
        warm, reps = _reps(S)
        sets = rotating_inputs(lambda: tuple(torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
                                             for _ in range(3)))
        for causal in causals:
            case = {"S": S, "causal": causal}
            fl = attention_flops(B, H, S, S, D, causal)

            def timed(name, fn, arg_sets, peak="bf16"):
                if not want(name):
                    return
                try:
                    fn(*arg_sets[0])
                    t = time_cuda(fn, arg_sets, warmup=warm, reps=reps)
                    rec.record(case, name, t, flops=fl, peak=peak)
                except Exception as exc:
                    rec.record(case, name, None, note=f"{type(exc).__name__}: {exc}"[:300])

            for be in ("cudnn", "flash"):
                if not want(f"sdpa-{be}"):
                    continue
                fn = peers.sdpa(be)
                timed(f"sdpa-{be}", lambda q, k, v: fn(q, k, v, causal=causal), sets)
            for name, fn in lowbit_fns().items():
                timed(name, lambda q, k, v, fn=fn: fn(q, k, v, causal), sets,
                      peak="fp8" if "fp8" in name else "int8")
            if want("lowbit-fp8-kv4") or want("lowbit-fp8-kv4-fused"):
                kv = [tuple(t for t in (*quantize_kv4(k)[:2], *quantize_kv4(v)[:2])) for _, k, v in sets]
                qs = [(s[0], kv[i]) for i, s in enumerate(sets)]
                timed("lowbit-fp8-kv4", lambda q, kv4: fp8_kv4_attention(q, causal=causal, kv4=kv4), qs, peak="fp8")
                timed("lowbit-fp8-kv4-fused", lambda q, kv4: fp8_kv4_attention(q, causal=causal, kv4=kv4, fused=True),
                      qs, peak="fp8")
                del kv, qs
            # fp8 on the tl kernel (the default up to session 3) and on the Gluon kernel (session 4), same run
            for gname, gcfg in (("lowbit-fp8-tl", {"gluon": False}), ("lowbit-fp8-gluon", GLUON),
                                ("lowbit-fp8-plain", {"gluon": False, "vperm": False}),
                                ("lowbit-fp8-vperm", {"gluon": False, "vperm": True})):
                timed(gname, lambda q, k, v, gcfg=gcfg: quant_attention_triton(
                    q, k, v, mode="fp8", causal=causal, sm_scale=D ** -0.5, v_granularity="block", k_per_block=True,
                    fuse_kv=False, config=gcfg), sets, peak="fp8")
            for iname, icfg in (("lowbit-int8-plain", {"vperm": False}), ("lowbit-int8-vperm", {"vperm": True})):
                timed(iname, lambda q, k, v, icfg=icfg: quant_attention_triton(
                    q, k, v, mode="int8", causal=causal, sm_scale=D ** -0.5, v_granularity="channel",
                    fuse_kv=False, config=icfg), sets, peak="int8")
            # fp8 with Q quantized in the attention prologue (the default up to session 2), same run
            timed("lowbit-fp8-qreg", lambda q, k, v: quant_attention_triton(
                q, k, v, mode="fp8", causal=causal, sm_scale=D ** -0.5, v_granularity="block", k_per_block=True,
                fuse_kv=False, config={"q_pre": False}), sets, peak="fp8")
            for mode, dt, kb, vg in (("fp8", torch.float8_e4m3fn, 128, "block"), ("int8", torch.int8, None, "channel")):
                # the split: two launches (quantization pass, then attention) and the quantization
                # pass alone, beside the default and the attention alone. fp8 quantizes Q in the
                # same pass (``q_pre``, the default): its rows are named ``qkvquant``; int8
                # quantizes Q in the attention prologue
                qp = bool(default_config(mode, D, causal, S).get("q_pre", False))
                vp = bool(default_config(mode, D, causal, S).get("vperm", False))  # the default V^T key order
                timed(f"lowbit-{mode}-2launch", lambda q, k, v, mode=mode, kb=kb, vg=vg: quant_attention_triton(
                    q, k, v, mode=mode, causal=causal, sm_scale=D ** -0.5, v_granularity=vg, k_per_block=kb is not None,
                    fuse_kv=False), sets, peak="fp8" if mode == "fp8" else "int8")
                timed(f"lowbit-{mode}-{'qkv' if qp else 'kv'}quant-only", lambda q, k, v, dt=dt, kb=kb, vg=vg, qp=qp, vp=vp:
                      quantize_kv_triton(k, v, dtype=dt, k_block=kb, v_granularity=vg, q=q if qp else None, vperm=vp),
                      sets)
                name = f"lowbit-{mode}-attn-only"
                if not want(name):
                    continue
                pre = []
                for q, k, v in sets:
                    r = quantize_kv_triton(k, v, dtype=dt, k_block=kb, v_granularity=vg, q=q if qp else None, vperm=vp)
                    pre.append((q, *r[:4], r[4:] if qp else None))
                timed(name, lambda q, kc, ks, vt, vs, qc, mode=mode, kb=kb, vp=vp: attention_prefill_triton(
                    q, kc, ks, vt, vs, mode=mode, causal=causal, sm_scale=D ** -0.5, k_block=kb, q_codes=qc,
                    config={"vperm": vp}), pre, peak="fp8" if mode == "fp8" else "int8")
                del pre
            if want("sageattention-1.0.6"):
                try:
                    sg = peers.sageattention()
                    hs = [tuple(x.half() for x in s) for s in sets]
                    timed("sageattention-1.0.6", lambda q, k, v: sg(q, k, v, causal=causal), hs)
                    del hs
                except peers.PeerUnavailable as exc:
                    rec.record(case, "sageattention-1.0.6", None, note=str(exc))
            if fa_full is not None:
                i8 = [tuple(torch.randint(-127, 128, (B, H, S, D), device="cuda", dtype=torch.int8) for _ in range(3))
                      for _ in range(3)]
                sc = [(torch.rand(B, H, S, device="cuda") * 0.02, torch.rand(B, H, S, device="cuda") * 0.02,
                       torch.rand(B, H, device="cuda") * 0.02) for _ in range(3)]
                if not causal:
                    timed("int-fa-full-int8", lambda q, k, v, qs_, ks_, vs_: fa_full(
                        q, k, v, qs_, ks_, vs_, causal, D ** -0.5), [(*a, *b) for a, b in zip(i8, sc)], peak="int8")
                hv = [torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3)]
                timed("int-fa-half-int8", lambda q, k, v, qs_, ks_: fa_half(q, k, v, qs_, ks_, causal, D ** -0.5),
                      [(a[0], a[1], h, b[0], b[1]) for a, b, h in zip(i8, sc, hv)], peak="int8")
                del i8, sc, hv
        del sets
        torch.cuda.empty_cache()
