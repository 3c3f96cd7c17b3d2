"""Session-34 A/B: NaN-propagating quantizers and softmax maxima (this session) against the previous tree, in one
process on the same inputs. The previous tree's package is a copy of commit 541818b's ``lowbit`` renamed
``lowbit_old`` (made by ``benchmarks/make_ab_tree.sh``, never committed); both are imported side by side.

    bash benchmarks/make_ab_tree.sh 541818b
    PYTHONPATH=$PWD:$PWD/.ab_old python3 benchmarks/device/s34_nan_ab.py --out DIR [--parts adm]

Parts: ``a`` prefill attention through ``api.attention`` (quantization included; B=4, H=32, D=128, S 1024 / 4096,
causal and not; ``fp8``, ``fp8-kv4``, ``int8``, ``int8-qk``), ``d`` INT4-cache decode (``decode_kv4_triton``,
B=16, 32/8 heads, D=128, L 8192 / 32768), ``q`` the prefill's two launches apart (``part_q``), ``m`` FP8 MLA
decode (``mla_decode``, B=32, H=128, Sq=1, L=16384). Per case: max |old - new| on finite inputs (0 expected) and
per-call us of each tree inside CUDA graphs, alternated 5 rounds (``alternate_us``; prefill: CUDA events, ``ab``).
Writes ``s34_nan_ab.json``; the session's runs are committed as ``benchmarks/results/h200/s34_nan_ab_r*.json``:
r2 a NaN-propagating row max in the attention loop, r3 NaN-safe quantizer maxima everywhere, r4 the two prefill
launches apart (r3's tree), r5 the maxima behind ``LOWBIT_NAN_SAFE`` (off), r7 no clamp for FP8 and INT8 with
NaN-safe INT8 maxima, r8 the committed form (FP8 without the clamp, INT8 unchanged unless ``LOWBIT_NAN_SAFE=1``).
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), ".ab_old"))
import lowbit  # noqa: E402
import lowbit_old  # noqa: E402
from lowbit.bench.harness import alternate_us, probe_row, run_probe_parts, time_cuda  # noqa: E402


def diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def ab(row, fn_new, fn_old, rounds=5, graphs=True):
    """Outputs compared, then the two trees timed alternately: in CUDA graphs (``alternate_us``), or for the
    millisecond-long prefill calls by CUDA events (``time_cuda``, 30 calls a round)."""
    row["max_abs_diff"] = diff(fn_new(), fn_old())
    if graphs:
        t = alternate_us({"new": fn_new, "old": fn_old}, rounds=rounds)
    else:
        res = {"new": [], "old": []}
        for _ in range(rounds):
            for k, f in (("new", fn_new), ("old", fn_old)):
                res[k].append(time_cuda(f, [()], warmup=3, reps=30)["median_ms"] * 1e3)
        t = {k: {"median": round(sorted(v)[len(v) // 2], 3), "min": round(min(v), 3), "max": round(max(v), 3)}
             for k, v in res.items()}
    row.update(new_us=t["new"], old_us=t["old"], new_over_old=round(t["new"]["median"] / t["old"]["median"], 4))


def part_a(doc):
    B, H, D = 4, 32, 128
    for S in (1024, 4096):
        torch.manual_seed(S)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for scheme in ("fp8", "fp8-kv4", "int8", "int8-qk"):
            for causal in (False, True):
                row = {"S": S, "scheme": scheme, "causal": causal}
                try:
                    ab(row, lambda: lowbit.api.attention(q, k, v, scheme=scheme, causal=causal),
                       lambda: lowbit_old.api.attention(q, k, v, scheme=scheme, causal=causal), graphs=False)
                except Exception as exc:  # noqa: BLE001
                    row["error"] = repr(exc)[:600]
                probe_row(doc, f"a {scheme} S={S} causal={causal}", row)


def part_q(doc):
    """The two launches of the prefill path apart: ``quantize_kv_triton`` (K, V and Q for fp8) and
    ``attention_prefill_triton`` on the same pre-quantized codes, each tree's own."""
    import lowbit.kernels.attention_prefill as AN
    import lowbit.kernels.attention_quant as QN
    import lowbit_old.kernels.attention_prefill as AO
    import lowbit_old.kernels.attention_quant as QO

    B, H, D = 4, 32, 128
    for S in (1024, 4096):
        torch.manual_seed(S)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for mode in ("fp8", "int8"):
            if mode == "fp8":
                kw = dict(dtype=torch.float8_e4m3fn, k_block=128, v_granularity="block", q=q, vperm=True)
            else:
                kw = dict(dtype=torch.int8, v_granularity="channel", vperm=True)
            row = {"S": S, "mode": mode}
            try:
                ab(row, lambda: QN.quantize_kv_triton(k, v, **kw)[0], lambda: QO.quantize_kv_triton(k, v, **kw)[0],
                   graphs=False)
                probe_row(doc, f"q quant {mode} S={S}", row)
                codes = QN.quantize_kv_triton(k, v, **kw)
                akw = dict(mode=mode, causal=False, sm_scale=D ** -0.5, config={"vperm": True})
                if mode == "fp8":
                    akw.update(k_block=128, q_codes=(codes[4], codes[5]))
                row = {"S": S, "mode": mode}
                ab(row, lambda: AN.attention_prefill_triton(q, *codes[:4], **akw),
                   lambda: AO.attention_prefill_triton(q, *codes[:4], **akw), graphs=False)
                probe_row(doc, f"t attention {mode} S={S}", row)
            except Exception as exc:  # noqa: BLE001
                row["error"] = repr(exc)[:600]
                probe_row(doc, f"q/t {mode} S={S}", row)


def part_d(doc):
    from lowbit.bench.suites.kv4 import random_cache
    from lowbit.kernels.decode_kv4 import decode_kv4_triton as new
    from lowbit_old.kernels.decode_kv4 import decode_kv4_triton as old

    for L in (8192, 32768):
        row = {"B": 16, "L": L}
        try:
            c = random_cache(16, 8, 128, L, device="cuda")
            q = torch.randn(16, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
            args = (q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"], c["page_table"], c["lengths"])
            ab(row, lambda: new(*args, max_len=L), lambda: old(*args, max_len=L))  # max_len: no host sync
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:600]
        probe_row(doc, f"d kv4 B=16 L={L}", row)


def part_m(doc):
    from lowbit.bench.suites.mla import make_caches
    from lowbit.ops.mla import mla_decode as new
    from lowbit_old.ops.mla import mla_decode as old

    for fp8 in (True, False):
        row = {"B": 32, "H": 128, "L": 16384, "fp8": fp8}
        try:
            c = make_caches(32, 16384, fp8=fp8, bf16=not fp8)
            cache = c["fp8"] if fp8 else c["bf16"]
            q = torch.randn(32, 1, 128, 576, device="cuda", dtype=torch.bfloat16)
            ab(row, lambda: new(q, cache, c["page_table"], c["seq_lens"], max_seq_len=16384),
               lambda: old(q, cache, c["page_table"], c["seq_lens"], max_seq_len=16384))
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:600]
        probe_row(doc, f"m mla fp8={fp8}", row)


def main():
    run_probe_parts("benchmarks/device/s34_nan_ab.py", {"q": part_q, "d": part_d, "m": part_m, "a": part_a},
                    "adm", "s34_nan_ab.json")


if __name__ == "__main__":
    main()
