"""Session-43 probe (issues 3, 4, 5): is session 19's M = 1 read floor (``s19_floor.py``: plain 16-byte loads) the
floor, or does a TMA-fed stream read a 4-bit weight faster?

    PYTHONPATH=$PWD python3 benchmarks/device/s43_tma_floor.py --out DIR

For the bytes of each Llama-3-8B projection's 4-bit g128 weight: (a) session 19's stream (its best of the same launch
grid), (b) a Gluon stream whose programs (1-2 per SM, persistent) pull contiguous ``[BR, 128]`` int32 tiles through
a ring of ``STAGES`` TMA copies (mbarrier completion) and XOR them in registers, (c) cuBLAS bf16 at M = 1 and
lowbit's three M = 1 kernels, all in one run with the suites' harness (CUDA events, inputs rotated, queue full).
``s43_tma_floor.json``.
"""
import importlib.util
import os
import sys

import torch
import triton

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import env_info, probe_args, probe_row, rotating_inputs, time_cuda, write_probe  # noqa: E402

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

_spec = importlib.util.spec_from_file_location("s19_floor", os.path.join(os.path.dirname(__file__), "s19_floor.py"))
s19 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(s19)


@gluon.jit
def _tma_stream(desc, OUT, n_tiles, STAGES: gl.constexpr, num_warps: gl.constexpr):
    BR: gl.constexpr = desc.block_type.shape[0]
    BC: gl.constexpr = desc.block_type.shape[1]
    pid = gl.program_id(0)
    npg = gl.num_programs(0)
    per = gl.cdiv(n_tiles, npg)
    t0 = pid * per
    n = gl.minimum(t0 + per, n_tiles) - t0
    smem = gl.allocate_shared_memory(desc.dtype, [STAGES, BR, BC], desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        if i < n:
            mbarrier.expect(bars.index(i), desc.block_type.nbytes)
            tma.async_copy_global_to_shared(desc, [(t0 + i) * BR, 0], bars.index(i), smem.index(i))
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
    acc = gl.zeros([BR, BC], gl.int32, layout)
    for j in range(n):
        s = j % STAGES
        mbarrier.wait(bars.index(s), (j // STAGES) & 1)
        acc = acc ^ smem.index(s).load(layout)
        gl.thread_barrier()
        if j + STAGES < n:
            mbarrier.expect(bars.index(s), desc.block_type.nbytes)
            tma.async_copy_global_to_shared(desc, [(t0 + j + STAGES) * BR, 0], bars.index(s), smem.index(s))
    tot = gl.sum(gl.sum(acc, axis=1), axis=0)
    gl.store(OUT + pid, tot)


def tma_times(nbytes: int, sms: int) -> dict:
    words = nbytes // 4
    rows = triton.cdiv(words, 128)
    sets = rotating_inputs(lambda: (torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, 128), dtype=torch.int32,
                                                  device="cuda"),))
    out = torch.empty(4 * sms, dtype=torch.int32, device="cuda")
    res = {}
    for br, stages, per_sm, warps in ((32, 4, 1, 4), (32, 6, 1, 4), (32, 8, 1, 4), (64, 3, 1, 4), (64, 4, 1, 4),
                                      (32, 4, 2, 4), (32, 6, 2, 4), (16, 8, 2, 4), (16, 6, 3, 4), (32, 3, 3, 4),
                                      (64, 3, 1, 8), (32, 6, 1, 8)):
        layout = gl.NVMMASharedLayout.get_default_for([br, 128], gl.int32)
        descs = [(TensorDescriptor(x, [rows, 128], [128, 1], [br, 128], layout),) for (x,) in sets]
        n_tiles = triton.cdiv(rows, br)
        grid = (min(per_sm * sms, n_tiles),)
        key = f"br{br} st{stages} p{per_sm} w{warps}"
        try:
            res[key] = time_cuda(lambda d: _tma_stream[grid](d, out, n_tiles, STAGES=stages, num_warps=warps),
                                 descs)["median_ms"] * 1e3
        except Exception as e:  # noqa: BLE001 - report and go on
            res[key] = f"error: {type(e).__name__}: {str(e)[:200]}"
    return res


def main():
    args = probe_args("t")
    doc = {"env": env_info("PYTHONPATH=$PWD python3 benchmarks/device/s43_tma_floor.py " + " ".join(sys.argv[1:]))}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    import lowbit
    for name, (N, K) in s19.SHAPES.items():
        w4_bytes = N * K // 2 + (K // 128) * N * 2
        row = {"N": N, "K": K, "w4_bytes": w4_bytes}
        st = s19.stream_times(w4_bytes, sms, (1, 2, 4, 8, 16), ((4, 2048), (8, 4096), (4, 4096)))
        cfg = min(st, key=st.get)
        row["s19_floor_us"], row["s19_floor_cfg"] = round(st[cfg], 2), cfg
        tt = tma_times(w4_bytes, sms)
        row["tma"] = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in tt.items()}
        ok = {k: v for k, v in tt.items() if isinstance(v, float)}
        if ok:
            cfg = min(ok, key=ok.get)
            row["tma_floor_us"], row["tma_floor_cfg"] = round(ok[cfg], 2), cfg
            row["tma_floor_TBps"] = round(w4_bytes / ok[cfg] / 1e6, 2)
        wsets = rotating_inputs(lambda: (torch.randn(N, K, dtype=torch.bfloat16, device="cuda"),
                                         torch.randn(1, K, dtype=torch.bfloat16, device="cuda")))
        row["cublas_bf16_us"] = round(time_cuda(lambda w, x: x @ w.t(), wsets)["median_ms"] * 1e3, 2)
        del wsets
        for scheme, kw in (("lut", dict(bits=4, group_size=128, table="nf")), ("w4a8-fp8", {}), ("w4a8-int8", {})):
            mods = [lowbit.quantize_linear(torch.nn.Linear(K, N, bias=False, dtype=torch.bfloat16, device="cuda"),
                                           scheme, **kw) for _ in range(4)]
            xs = [(m, torch.randn(1, K, dtype=torch.bfloat16, device="cuda")) for m in mods]
            with torch.no_grad():
                row[f"{scheme}_us"] = round(time_cuda(lambda m, x: m(x), xs)["median_ms"] * 1e3, 2)
            del mods, xs
        row["cublas_over_s19_floor"] = round(row["cublas_bf16_us"] / row["s19_floor_us"], 2)
        if "tma_floor_us" in row:
            row["cublas_over_tma_floor"] = round(row["cublas_bf16_us"] / row["tma_floor_us"], 2)
        probe_row(doc, name, row)
        torch.cuda.empty_cache()
    print(write_probe(doc, args.out, "s43_tma_floor.json"))


if __name__ == "__main__":
    main()
