"""Session-19 probe (issues 3, 4, 5): the time floor of reading one weight matrix once at decode (M = 1).

    PYTHONPATH=$PWD python3 benchmarks/device/s19_floor.py --out DIR [--parts t|k]

For the bytes a 4-bit g128 weight of each Llama-3-8B projection occupies (and its bf16 size), a read-only Triton
stream (16-byte loads, grids of 1-16 programs per SM, 4 or 8 warps, an XOR of every word so nothing is skipped)
is timed with the suites' harness (CUDA events, inputs rotated over > 2x L2, queue kept full), beside cuBLAS bf16
at M = 1 and lowbit's M = 1 kernels (lut NF4 g128, w4a8-fp8, w4a8-int8) on the same shapes in the same run. The
best stream time is the floor a weight-streaming kernel can reach on this GPU; the ratio of cuBLAS bf16 to it bounds
the speedup the issues' M = 1 targets ask for (part ``t``, ``s19_floor.json``). Part ``k``: the same stream over the
compressed K/V bytes of issue 8's decode shape (B=16, 32/8 heads, D=128, L = 4k-32k) beside SDPA flash bf16 and
lowbit's INT4-cache decode in the same run (``s19_floor_kv4.json``).
"""
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import env_info, probe_args, probe_row, rotating_inputs, time_cuda, write_probe  # noqa: E402


@triton.jit
def _stream_kernel(X, OUT, n_words, PER: tl.constexpr, BLOCK: tl.constexpr):
    """XOR of the int32 words ``[pid * PER, (pid + 1) * PER)`` of X (BLOCK words per step, 16-byte loads)."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for off in range(0, PER, BLOCK):
        idx = pid * PER + off + tl.arange(0, BLOCK)
        acc ^= tl.load(X + idx, mask=idx < n_words, other=0)
    tl.store(OUT + pid, tl.xor_sum(acc, axis=0))


def stream(x, out, programs, warps, block):
    n = x.numel()
    per = triton.cdiv(triton.cdiv(n, programs), block) * block
    _stream_kernel[(triton.cdiv(n, per),)](x, out, n, PER=per, BLOCK=block, num_warps=warps)


def stream_times(nbytes: int, sms: int, per_sm, warps_block) -> dict:
    """Median us of the read-only stream over ``nbytes`` of random words (rotated over > 2x L2) for every grid of
    ``per_sm`` programs per SM x (warps, words per step) of ``warps_block``: {"p<n> w<warps> b<block>": us}."""
    words = nbytes // 4
    sets = rotating_inputs(lambda: (torch.randint(-2 ** 31, 2 ** 31 - 1, (words,), dtype=torch.int32, device="cuda"),))
    out = torch.empty(16 * sms, dtype=torch.int32, device="cuda")
    return {f"p{p} w{w} b{b}": time_cuda(lambda x: stream(x, out, p * sms, w, b), sets)["median_ms"] * 1e3
            for p in per_sm for w, b in warps_block}


SHAPES = {"o": (4096, 4096), "qkv": (6144, 4096), "down": (4096, 14336), "8192sq": (8192, 8192), "gate_up": (28672, 4096)}


def main():
    args = probe_args("t")  # t: the projections (s19_floor.json); k: issue 8's K/V bytes (s19_floor_kv4.json)
    doc = {"env": env_info("PYTHONPATH=$PWD python3 benchmarks/device/s19_floor.py " + " ".join(sys.argv[1:]))}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    import lowbit
    from lowbit.bench import peers
    from lowbit.bench.suites.kv4 import kv4_bytes, random_cache
    from lowbit.ops.kv4 import decode_kv4
    for name, (N, K) in (SHAPES.items() if "t" in args.parts else ()):
        w4_bytes = N * K // 2 + (K // 128) * N * 2  # codes + bf16 group scales (g128)
        row = {"N": N, "K": K, "w4_bytes": w4_bytes}
        for label, nbytes in (("w4", w4_bytes), ("bf16", N * K * 2)):
            times = stream_times(nbytes, sms, (1, 2, 4, 8, 16), ((4, 2048), (8, 4096), (4, 4096)))
            row.update({f"stream_{label}_{cfg.replace(' ', '_')}_us": round(t, 2) for cfg, t in times.items()})
            cfg = min(times, key=times.get)
            row[f"floor_{label}_us"] = round(times[cfg], 2)
            row[f"floor_{label}_cfg"] = cfg
            row[f"floor_{label}_TBps"] = round(nbytes / times[cfg] / 1e6, 2)
        # the GEMVs in the same run
        wsets = rotating_inputs(lambda: (torch.randn(N, K, dtype=torch.bfloat16, device="cuda"),
                                         torch.randn(1, K, dtype=torch.bfloat16, device="cuda")))
        row["cublas_bf16_us"] = round(time_cuda(lambda w, x: x @ w.t(), wsets)["median_ms"] * 1e3, 2)
        for scheme, kw in (("lut", dict(bits=4, group_size=128, table="nf")), ("w4a8-fp8", {}), ("w4a8-int8", {})):
            mods = [lowbit.quantize_linear(torch.nn.Linear(K, N, bias=False, dtype=torch.bfloat16, device="cuda"),
                                           scheme, **kw) for _ in range(max(3, len(wsets)))]
            xs = [(m, torch.randn(1, K, dtype=torch.bfloat16, device="cuda")) for m in mods]
            with torch.no_grad():
                row[f"{scheme}_us"] = round(time_cuda(lambda m, x: m(x), xs)["median_ms"] * 1e3, 2)
        row["cublas_over_floor_w4"] = round(row["cublas_bf16_us"] / row["floor_w4_us"], 2)
        probe_row(doc, name, row)
    for L in ((4096, 8192, 16384, 32768) if "k" in args.parts else ()):
        # the compressed K/V bytes of issue 8's decode shape (B=16, 8 KV heads, D=128: 2 x 65 B per token and head)
        label, nbytes = f"kv4_B16_L{L}", kv4_bytes(16, 32, 8, 128, L, 0, False)
        times = stream_times(nbytes, sms, (4, 8, 16), ((8, 4096), (4, 4096)))
        cfg = min(times, key=times.get)
        row = {"bytes": nbytes, "floor_us": round(times[cfg], 2), "cfg": cfg, "TBps": round(nbytes / times[cfg] / 1e6, 2)}
        qs = rotating_inputs(lambda: (torch.randn(16, 32, 1, 128, device="cuda", dtype=torch.bfloat16),
                                      torch.randn(16, 8, L, 128, device="cuda", dtype=torch.bfloat16),
                                      torch.randn(16, 8, L, 128, device="cuda", dtype=torch.bfloat16)))
        row["sdpa_flash_bf16_us"] = round(time_cuda(peers.sdpa("flash"), qs)["median_ms"] * 1e3, 2)
        del qs
        cs = rotating_inputs(lambda: (torch.randn(16, 32, 1, 128, device="cuda", dtype=torch.bfloat16),
                                      random_cache(16, 8, 128, L)))
        row["lowbit_kv4_us"] = round(time_cuda(lambda q, c: decode_kv4(q, max_len=L, **c), cs)["median_ms"] * 1e3, 2)
        del cs
        row["lowbit_over_floor"] = round(row["lowbit_kv4_us"] / row["floor_us"], 2)
        row["sdpa_over_floor"] = round(row["sdpa_flash_bf16_us"] / row["floor_us"], 2)
        probe_row(doc, label, row)
        torch.cuda.empty_cache()
    print(write_probe(doc, args.out, "s19_floor.json" if "t" in args.parts else "s19_floor_kv4.json"))


if __name__ == "__main__":
    main()
