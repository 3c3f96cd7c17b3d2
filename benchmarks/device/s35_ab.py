"""Session-35 A/B against the previous tree (cd58b9a), in one process on the same inputs (the method of
``s34_nan_ab.py``: ``bash benchmarks/make_ab_tree.sh cd58b9a`` builds the renamed copy ``lowbit_old``).

    PYTHONPATH=$PWD:$PWD/.ab_old python3 benchmarks/device/s35_ab.py --out DIR [--parts akmi]

Parts: ``a`` ``api.attention(scheme="fp8-kv4")`` on float K/V (this session: r2 KV4 quantization by one Triton
launch, ``ops.kv4.kv4_quantize``; r3 inside the KV4 -> FP8 conversion launch; before, ``quantize_kv4`` in PyTorch) beside ``fp8`` and the pre-quantized ``kv4=`` call
(B=4, H=32, D=128, S 1024 / 4096, causal and not); ``k`` the ``kv4_quantize`` launch alone, its bit-equality with ``quantize_kv4`` on CUDA and on
the CPU, and the conversion launch from codes or from float; ``m`` MLA decode (NaN-propagating epilogues: ``l == 0`` tests, NaN-keeping clamps), FP8 and
bf16, 128 heads (warp-specialized kernels) and 16 heads (Gluon few-rows kernel), B=32, L=16384; ``i`` the ``int8``
prefill with ``LOWBIT_NAN_SAFE`` on (this session adds a non-finite key's K scale to l) and off (unchanged code).
Per case: max |old - new| (0 expected where the numerics did not change) and per-call us of each tree.
Committed runs (``benchmarks/results/h200/s35_ab_r*.json``): r1 parts k, m (the first, one-warp-per-row
``kv4_quantize``); r2 k, i, a (tiles of rows, IEEE quotients; rows x warps sweep); r3 k, a (Markstein quotients,
the fused float -> FP8 conversion); r4 k (warps of the conversion launch); r5 a (the committed form).
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


def timed(fns: dict, rounds=5, graphs=True) -> dict:
    if graphs:
        return alternate_us(fns, rounds=rounds)
    res = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            res[k].append(time_cuda(f, [()], warmup=3, reps=20)["median_ms"] * 1e3)
    return {k: {"median": round(sorted(v)[len(v) // 2], 3), "min": round(min(v), 3), "max": round(max(v), 3)}
            for k, v in res.items()}


def part_a(doc):
    from lowbit.ops.kv4 import kv4_quantize

    B, H, D = 4, 32, 128
    for S in (1024, 4096):
        torch.manual_seed(S)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        kv = kv4_quantize(k, v)
        for causal in (False, True):
            row = {"S": S, "causal": causal}
            try:
                new = lambda: lowbit.api.attention(q, k, v, scheme="fp8-kv4", causal=causal)  # noqa: E731
                old = lambda: lowbit_old.api.attention(q, k, v, scheme="fp8-kv4", causal=causal)  # noqa: E731
                pre = lambda: lowbit.ops.attention_prefill.fp8_kv4_attention(q, causal=causal, kv4=kv)  # noqa: E731
                fp8 = lambda: lowbit.api.attention(q, k, v, scheme="fp8", causal=causal)  # noqa: E731
                row["max_abs_diff_new_old"] = diff(new(), old())
                row["max_abs_diff_new_pre"] = diff(new(), pre())
                t = timed({"new": new, "old": old, "kv4_given": pre, "fp8": fp8}, rounds=3, graphs=False)
                row.update(us=t, new_over_fp8=round(t["new"]["median"] / t["fp8"]["median"], 4))
            except Exception as exc:  # noqa: BLE001
                row["error"] = repr(exc)[:600]
            probe_row(doc, f"a fp8-kv4 float S={S} causal={causal}", row)


def part_k(doc):
    from lowbit.formats.kv4 import quantize_kv4
    from lowbit.kernels.kv4_append import kv4_quantize_triton
    from lowbit.ops.kv4 import kv4_quantize

    B, H, D = 4, 32, 128
    for S in (1024, 4096):
        for dt in (torch.bfloat16, torch.float16):
            torch.manual_seed(S)
            k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dt) for _ in range(2))
            row = {"S": S, "dtype": str(dt)}
            try:
                out = kv4_quantize(k, v)
                want = (*quantize_kv4(k)[:2], *quantize_kv4(v)[:2])
                row["bit_equal_cuda_ref"] = all(torch.equal(a.view(torch.uint8), w.view(torch.uint8))
                                                for a, w in zip(out, want))
                want = (*quantize_kv4(k.cpu())[:2], *quantize_kv4(v.cpu())[:2])
                row["bit_equal_cpu_ref"] = all(torch.equal(a.cpu().view(torch.uint8), w.view(torch.uint8))
                                               for a, w in zip(out, want))
                nbytes = 2 * k.numel() * k.element_size() + 2 * (k.numel() // 2 + B * H * S)
                fns = {"default": lambda: kv4_quantize(k, v)}
                if dt == torch.bfloat16:  # r2 swept rows 8-64 x warps 2-8: 16 x 4 and 8 x 2 best (IEEE quotients)
                    for r, w in ((16, 4), (32, 4), (32, 8), (64, 8)):
                        for fast in (True,):
                            fns[f"rows{r}_w{w}_fast{int(fast)}"] = (
                                lambda r=r, w=w, fast=fast: kv4_quantize_triton(k, v, rows=r, num_warps=w, fast=fast))
                    from lowbit.kernels.attention_quant import kv4_to_fp8_triton
                    kv = kv4_quantize(k, v)
                    for w in (4, 8, 16):
                        fns[f"to_fp8_from_codes_w{w}"] = lambda w=w: kv4_to_fp8_triton(*kv, block=128, vperm=True,
                                                                                       num_warps=w)
                        fns[f"to_fp8_from_float_w{w}"] = lambda w=w: kv4_to_fp8_triton(
                            k, None, v, None, block=128, vperm=True, from_float=True, num_warps=w)
                    a = kv4_to_fp8_triton(*kv, block=128, vperm=True)
                    b = kv4_to_fp8_triton(k, None, v, None, block=128, vperm=True, from_float=True)
                    row["from_float_bit_equal"] = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                                                      for x, y in zip(a, b))
                t = timed(fns, rounds=3)
                row.update(us=t, bytes=nbytes, tb_s=round(nbytes / t["default"]["median"] / 1e6, 3))
            except Exception as exc:  # noqa: BLE001
                row["error"] = repr(exc)[:600]
            probe_row(doc, f"k kv4_quantize S={S} {dt}", row)


def part_m(doc):
    from lowbit.bench.suites.mla import make_caches
    from lowbit.ops.mla import mla_decode as new
    from lowbit_old.ops.mla import mla_decode as old

    for H in (128, 16):
        for fp8 in (True, False):
            row = {"B": 32, "H": H, "L": 16384, "fp8": fp8}
            try:
                c = make_caches(32, 16384, fp8=fp8, bf16=not fp8)
                cache = c["fp8"] if fp8 else c["bf16"]
                q = torch.randn(32, 1, H, 576, device="cuda", dtype=torch.bfloat16)
                fn_new = lambda: new(q, cache, c["page_table"], c["seq_lens"], max_seq_len=16384)  # noqa: E731
                fn_old = lambda: old(q, cache, c["page_table"], c["seq_lens"], max_seq_len=16384)  # noqa: E731
                row["max_abs_diff"] = diff(fn_new(), fn_old())
                t = timed({"new": fn_new, "old": fn_old})
                row.update(new_us=t["new"], old_us=t["old"], new_over_old=round(t["new"]["median"] / t["old"]["median"], 4))
            except Exception as exc:  # noqa: BLE001
                row["error"] = repr(exc)[:600]
            probe_row(doc, f"m mla H={H} fp8={fp8}", row)


def part_i(doc):
    import lowbit.kernels.attention_quant as AQN
    import lowbit_old.kernels.attention_quant as AQO

    B, H, D = 4, 32, 128
    for S in (1024, 4096):
        torch.manual_seed(S)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for safe in (False, True):
            AQN.NAN_SAFE = AQO.NAN_SAFE = safe
            row = {"S": S, "nan_safe": safe}
            try:
                fn_new = lambda: lowbit.api.attention(q, k, v, scheme="int8")  # noqa: E731
                fn_old = lambda: lowbit_old.api.attention(q, k, v, scheme="int8")  # noqa: E731
                row["max_abs_diff"] = diff(fn_new(), fn_old())
                t = timed({"new": fn_new, "old": fn_old}, graphs=False)
                row.update(new_us=t["new"], old_us=t["old"], new_over_old=round(t["new"]["median"] / t["old"]["median"], 4))
            except Exception as exc:  # noqa: BLE001
                row["error"] = repr(exc)[:600]
            probe_row(doc, f"i int8 S={S} nan_safe={safe}", row)
        AQN.NAN_SAFE = AQO.NAN_SAFE = False


def main():
    run_probe_parts("benchmarks/device/s35_ab.py", {"k": part_k, "m": part_m, "i": part_i, "a": part_a},
                    "akmi", "s35_ab.json")


if __name__ == "__main__":
    main()
