"""KV4 decode attention over the paged INT4 cache vs SDPA bf16 decode (FireQ §1.6, QServe KV4).

Shapes: B=16 sequences, GQA 32/8 heads, D=128, one (and four) query tokens, L = 4k..32k cached
tokens, and B=1 long contexts (split-KV). Bytes counted for lowbit are the compressed cache bytes
read: per token per head, K and V each D/2 code bytes + 1 FP8 scale byte (+ 1 zero-point byte for
kv4-zp), plus Q and O; SDPA moves the bf16 K and V. Also the fused append (RoPE + quantize +
paged write) for one decode step and for a 4k-token prefill. ``lowbit-kv4`` / ``-zp`` run the
defaults (``Q_INT8_DEFAULT`` = Q as two INT8 planes, the Gluon kernel on Hopper);
``lowbit-kv4-fp16q`` is the Triton kernel with fp16 Q (the default until session 3);
``lowbit-kv4-q8`` one INT8 plane (``q_int8=1``, FireQ's 8-bit Q). Same bytes for all but -zp.
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


def random_float_pages(lens, Hkv, page, D, dtype=torch.bfloat16, *, seed=0, device="cuda"):
    """Float pages ``k, v [P, Hkv, page, D]`` (random everywhere, so stale slots exercise the masks) for
    sequences of lengths ``lens``, scattered in the pool by a shuffled page table; returns
    (k, v, page_table int32 [B, max_pages + 1], lengths int32 [B]) -- ``lowbit.ops.kv4.decode_float``'s
    cache arguments."""
    g = torch.Generator().manual_seed(seed)
    npg = [-(-L // page) for L in lens]
    P = sum(npg) + 2
    k = torch.randn(P, Hkv, page, D, generator=g).to(dtype)
    v = torch.randn(P, Hkv, page, D, generator=g).to(dtype)
    perm = torch.randperm(P, generator=g)
    pt = torch.zeros(len(lens), max(npg) + 1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(npg):
        pt[b, :n] = perm[i:i + n]
        i += n
    return k.to(device), v.to(device), pt.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


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
            import lowbit.kernels.decode_kv4 as dk

            gl0 = dk.DEFAULT_GLUON
            # (name, zero point, q_int8, gluon): the defaults, the R6 default (Triton kernel, fp16 Q), one INT8 plane
            for name, zp, q8, gl_ in (("lowbit-kv4", False, None, gl0), ("lowbit-kv4-fp16q", False, 0, False),
                                      ("lowbit-kv4-q8", False, 1, gl0), ("lowbit-kv4-zp", True, None, gl0)):
                dk.DEFAULT_GLUON = gl_
                for tq in ((1, 4) if name == "lowbit-kv4" else (1,)):
                    c = dict(case, tq=tq)
                    csets = rotating_inputs(lambda: (torch.randn(B, Hq, tq, D, device="cuda", dtype=torch.bfloat16),
                                                     random_cache(B, Hkv, D, L, zero_point=zp)))
                    run = lambda q, c_: decode_kv4(q, max_len=L, q_int8=q8, **c_)  # noqa: E731
                    t = time_cuda(run, csets)
                    rec.record(c, name, t, flops=attention_flops(B, Hq, tq, L, D, False), peak="bf16",
                               bytes_moved=kv4_bytes(B, Hq, Hkv, D, L, tq, zp))
                    del csets
                    torch.cuda.empty_cache()
            dk.DEFAULT_GLUON = gl0


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
    import lowbit.kernels.decode_kv4 as dk

    rec.note(f"decode defaults: q_int8={dk.DEFAULT_QK8}, gluon={dk.DEFAULT_GLUON and dk.HAS_GLUON} (BLOCK_N "
             f"{dk.GLUON_BLOCK_N}, {dk.GLUON_STAGES} cp.async stages, maxnreg {dk.GLUON_MAXNREG}, "
             f"splits: first wave fill >= {dk.GLUON_GOOD_WAVE}, pdl {dk.GLUON_PDL}, vsub {dk.GLUON_VSUB}, "
             f"cstore {dk.GLUON_CSTORE} below {dk.GLUON_CSTORE_MAX_SPLIT} keys per split); "
             f"Triton kernel: trans={dk.DEFAULT_TRANS} warps={dk.DEFAULT_WARPS} stages={dk.DEFAULT_STAGES} "
             f"BLOCK_N {dk.DEFAULT_BLOCK_N}; page 64")
    decode_rows(rec, quick)
    decode_rows(rec, quick, lengths=[32768] if quick else [32768, 131072], batches=(1,))
    append_rows(rec, quick)


# ---- accuracy on the embedded model (FireQ Table 3 layout, KV4 only; no linear quantization) -------

KV_CONFIGS = [  # name, kv numerics, rpn, crs, convention
    ("kv4", "kv4", False, False, "code"),
    ("kv4 +RPN", "kv4", True, False, "code"),
    ("kv4 +CRS", "kv4", False, True, "code"),
    ("kv4 +RPN+CRS", "kv4", True, True, "code"),
    ("kv4 +RPN+CRS (paper 1/alpha scale)", "kv4", True, True, "paper"),
    ("kv4-zp (QServe)", "kv4-zp", False, False, "code"),
]


@torch.no_grad()
def _capture_qkv(model, ids):
    """Post-RoPE q [Hq, S, D], k, v [Hkv, S, D] (fp32) of every layer for one batch ``ids [1, S]``."""
    from lowbit.models.arch import decoder_layers
    from lowbit.ops.kv4 import rope_ref
    from lowbit.ptq.calibration import hooks

    views = decoder_layers(model)
    got = {}
    mods = {}
    for v in views:
        for role in ("q_proj", "k_proj", "v_proj"):
            mods[f"{v.index}.{role}"] = getattr(v, role)
    with hooks(mods, lambda n, m, i, o: got.__setitem__(n, o.detach().float())):
        model(input_ids=ids, use_cache=False)
    S = ids.shape[1]
    pos = torch.arange(S, device=ids.device)[None]
    cos, sin = model.model.rotary_emb(torch.empty(1, device=ids.device), pos)
    out = []
    for v in views:
        D = v.head_dim
        q = got[f"{v.index}.q_proj"].view(1, S, -1, D).transpose(1, 2)
        k = got[f"{v.index}.k_proj"].view(1, S, -1, D).transpose(1, 2)
        val = got[f"{v.index}.v_proj"].view(1, S, -1, D).transpose(1, 2)
        inter = v.rope_pairing == "interleaved"
        out.append((rope_ref(q, cos, sin, interleaved=inter)[0], rope_ref(k, cos, sin, interleaved=inter)[0], val[0]))
    return out


def attention_error_rows(qkv, params_by_cfg):
    """Relative L2 of the attention output (causal, float64) with KV4 K/V vs unquantized, per layer."""
    from lowbit.formats.kv4 import dequantize_kv4, quantize_kv4
    from lowbit.ops.attention import attention_ref

    rows = {}
    for name, (numerics, params) in params_by_cfg.items():
        errs = []
        for i, (q, k, v) in enumerate(qkv):
            ref = attention_ref(q[None], k[None], v[None], causal=True)
            qs, ks = q, k
            p = params[i] if params is not None else None
            G = q.shape[0] // k.shape[0]
            if p is not None and p.rpn is not None:
                r = p.rpn.to(k.device)[:, None, :]
                ks, qs = ks * r, qs / r.repeat_interleave(G, 0)
            if p is not None and p.crs_k is not None:
                c = p.crs_k.to(k.device)[:, None, :]
                ks, qs = ks * c, qs / c.repeat_interleave(G, 0)
            zp = numerics == "kv4-zp"
            kq = dequantize_kv4(*quantize_kv4(ks, zero_point=zp))
            vq = dequantize_kv4(*quantize_kv4(v, zero_point=zp))
            o = attention_ref(qs[None], kq[None], vq[None], causal=True)
            errs.append(((o - ref).norm() / ref.norm()).item())
        rows[name] = errs
    return rows


def accuracy_tables(device="cuda", quick=False, log=print, deadline=None, max_tokens=None, n_calib=None):
    """Perplexity of the embedded model with each KV configuration (no linear quantization) and
    the per-layer attention-output error on its real Q/K/V. Returns a dict with a markdown table."""
    from lowbit.eval.corpus import calibration_batches, load_text, tokenize
    from lowbit.eval.perplexity import perplexity
    from lowbit.models.hf_attention import install_quantized_attention, uninstall_quantized_attention
    from lowbit.models.loading import load_model
    from lowbit.ptq.rope_kv import calibrate_rpn_crs

    model, tok = load_model(None, device=device)
    log("model loaded")
    ids = tokenize(tok, load_text())
    calib = calibration_batches(tok, n_samples=n_calib or (4 if quick else 16), seq_len=512)
    max_tokens = max_tokens or (2048 if quick else 8192)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    doc = {"model": "SmolLM2-135M-Instruct (embedded, FP32)", "max_tokens": max_tokens,
           "calibration": f"{len(calib)} x 512 tokens", "ppl": {}, "attn_err": {}}
    base = perplexity(model, ids, max_tokens=max_tokens).perplexity
    doc["ppl"]["fp32 (no KV quantization)"] = base
    log(f"ppl fp32 {base:.4f}")
    params = {}
    import time

    for name, kv, rpn, crs, conv in KV_CONFIGS:
        if deadline is not None and time.time() > deadline:
            log(f"time budget reached: {name} and later rows skipped")
            break
        p = calibrate_rpn_crs(model, calib, rpn=rpn, crs=crs, convention=conv) if (rpn or crs) else None
        params[name] = (kv, [x.to("cpu") for x in p] if p is not None else None)
        install_quantized_attention(model, kv=kv, rope_kv=p)
        doc["ppl"][name] = perplexity(model, ids, max_tokens=max_tokens).perplexity
        log(f"ppl {name} {doc['ppl'][name]:.4f}")
        uninstall_quantized_attention(model)
        model.load_state_dict(state)
    qkv = _capture_qkv(model, calib[0].to(device))
    doc["attn_err"] = attention_error_rows(qkv, params) if params else {}
    names = list(doc["attn_err"])
    md = [f"### KV4 perplexity, {doc['model']}, first {max_tokens} tokens of the eval text "
          f"(calibration {doc['calibration']}; linears unquantized)", "",
          "| KV cache | PPL | delta vs fp32 |", "|---|---|---|"]
    for n, v in doc["ppl"].items():
        md.append(f"| {n} | {v:.4f} | {v - base:+.4f} |")
    md += ["", "### Attention-output rel-L2 vs unquantized K/V, per layer (real Q/K/V, 512 tokens, causal)", "",
           "| layer | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    L = len(doc["attn_err"][names[0]]) if names else 0
    for i in range(L):
        md.append(f"| {i} | " + " | ".join(f"{doc['attn_err'][n][i]:.4f}" for n in names) + " |")
    if L:
        md.append("| mean | " + " | ".join(f"{sum(doc['attn_err'][n]) / L:.4f}" for n in names) + " |")
    doc["markdown"] = "\n".join(md) + "\n"
    return doc
