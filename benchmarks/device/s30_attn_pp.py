"""Session-30 probe (issue 8 / 9): FlashAttention-3's ping-pong between the two consumer warpgroups of the session-20
warp-specialized FP8 prefill kernel (``s20_attn_ws.py``, flag ``PP``). Session 20 found that kernel (one CTA per SM,
two 64-row consumers + a 1-warp TMA loader) slower than the tl kernel and named the missing ping-pong as the cause:
the consumers ran in step and contended for the tensor cores and the MUFU pipe. ``PP``: two mbarriers hand a turn
back and forth; a consumer issues its two GEMMs (S_{j+1} = Q K_{j+1}^T and P_j V_j) only in its turn and passes the
turn right after issuing, so one consumer's softmax overlaps the other's GEMMs (the numerics are unchanged: the same
output bit for bit is expected).

    PYTHONPATH=$PWD python3 benchmarks/device/s30_attn_pp.py --out DIR [--parts t]   (env S30_S=4096,16384,1000)

Attention launch alone on the same pre-quantized codes (B=4, H=32, D=128, causal and not): ws (s20), ws + PP with 3 and
2 ring stages, the tl kernel (library default), SDPA cuDNN bf16; rel-L2 of each output against the tl kernel.
Writes ``s30_attn_pp.json``.
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lowbit.bench.harness import probe_args, probe_doc, probe_row, write_probe  # noqa: E402
from lowbit.kernels.attention_prefill import LOG2E, attention_prefill_triton  # noqa: E402
from lowbit.kernels.attention_quant import quantize_kv_triton  # noqa: E402
from s20_attn_ws import time_with_cudnn, ws_attention  # noqa: E402


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    args = probe_args("t")
    doc = probe_doc("benchmarks/device/s30_attn_pp.py", ("S30_S",))
    B, H, D = 4, 32, 128
    sm = D ** -0.5
    variants = {"ws": {}, "ws_pp": {"pp": True}, "ws_pp_ns2": {"pp": True, "ns": 2},
                "ws_pp_r240": {"pp": True, "c1_regs": 240}}
    for S in [int(s) for s in os.environ.get("S30_S", "4096,16384,1000").split(",")]:
        for causal in (False, True):
            key = f"t S={S} causal={causal}"
            row = {"S": S, "causal": causal}
            try:
                torch.manual_seed(0)
                q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                kc, ks, vt, vs, qc, qs = quantize_kv_triton(k, v, dtype=torch.float8_e4m3fn, k_block=128,
                                                            v_granularity="block", q=q, vperm=True)
                codes = (qc, qs)
                tl_out = attention_prefill_triton(q, kc, ks, vt, vs, mode="fp8", causal=causal, sm_scale=sm,
                                                  k_block=128, q_codes=codes, config={"vperm": True})
                fl = 4.0 * B * H * S * S * D / (2 if causal else 1)
                fns = {"tl": lambda: attention_prefill_triton(q, kc, ks, vt, vs, mode="fp8", causal=causal,
                                                              sm_scale=sm, k_block=128, q_codes=codes,
                                                              config={"vperm": True})}
                outs = {}
                for name, kw in variants.items():
                    outs[name] = torch.empty_like(q)
                    ws_attention(codes, kc, ks, vt, vs, causal=causal, qk_scale=sm * LOG2E, out=outs[name], **kw)
                    torch.cuda.synchronize()
                    row[f"{name}_vs_tl"] = rel(outs[name], tl_out)
                    row[f"{name}_vs_ws"] = rel(outs[name], outs["ws"])
                    fns[name] = (lambda kw=kw, o=outs[name]: ws_attention(codes, kc, ks, vt, vs, causal=causal,
                                                                          qk_scale=sm * LOG2E, out=o, **kw))
                time_with_cudnn(row, fns, q, k, v, causal, fl, S)
                probe_row(doc, key, row)
                del q, k, v, kc, ks, vt, vs, qc, qs, outs
                torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001
                row["error"] = repr(exc)[:800]
                probe_row(doc, key, row)
            write_probe(doc, args.out, "s30_attn_pp.json")


if __name__ == "__main__":
    main()
