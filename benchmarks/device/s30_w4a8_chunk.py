"""Session-30 probe (issue 3): the ``w4a8-fp8`` large-M path (M >= DEQUANT_MIN_M: dequantize the INT4 weight once to
FP8, then ``torch._scaled_mm`` row-wise) in N-chunks through a reused FP8 buffer small enough to stay in L2, so the
dequantized weight is never written to, nor read back from, HBM (the whole-weight path moves 1.5 bytes per weight
element through HBM before the GEMM starts: gate_up 176 MB, ~50 us of the 245 us at M = 1024 in s29).

    PYTHONPATH=$PWD python3 benchmarks/device/s30_w4a8_chunk.py --out DIR   (env S30_MS=1024,2048,4096, S30_MB=8,16,24)

Per layer (Llama-3-8B shapes) and M, GEMM alone on pre-quantized x, CUDA graph over rotating weight copies (> 2x L2):
``base`` (the committed path), ``chunk<MB>_s<streams>`` (chunks of about MB megabytes of FP8 weight; 1 stream:
dequantize chunk i, GEMM chunk i, ...; 2 streams: chunk i+1 dequantized on a side stream while chunk i multiplies, two
buffers), ``dequant`` (the whole-weight dequantization alone) and the peers ``scaled_mm_fp8`` / ``cublas_bf16``;
rel-L2 of each chunked output against ``base``. Writes ``s30_w4a8_chunk.json``.
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import graph_us, probe_args, probe_doc, probe_row, write_probe  # noqa: E402
from lowbit.bench.suites.w4a8_fp8 import GROUP, peer_gemm_fns, probe_cases  # noqa: E402
from lowbit.formats.w4a8_fp8 import padded_k  # noqa: E402
from lowbit.kernels.w4a8_fp8_gemm import dequantize_to_fp8, w4a8_fp8_gemm  # noqa: E402

LAYERS = {"gate_up": (28672, 4096), "qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336)}
INV_DELTA = 2.0 ** -8
OUT_SLICE = [True]  # _scaled_mm(out=<column slice>) accepted (else: a chunk output, copied into the slice)
_SB: dict = {}


def chunked(xq, sx, codes, scales, K, cn, bufs, side=None, evs=None):
    """y = x W^T by N-chunks of ``cn`` rows: dequantize a chunk into ``bufs[i % len(bufs)]``, multiply it into the
    output's column slice (``_scaled_mm(out=)``). ``side``: the dequantization on this stream, one chunk ahead."""
    M, N = xq.shape[0], codes.shape[0]
    out = torch.empty((M, N), dtype=torch.bfloat16, device=xq.device)
    sa = sx.reshape(M, 1)
    sb = _SB.get(N)
    if sb is None:
        sb = _SB[N] = torch.full((1, N), INV_DELTA, dtype=torch.float32, device=xq.device)
    starts = list(range(0, N, cn))
    main = torch.cuda.current_stream()
    if side is not None:
        side.wait_stream(main)
    for i, n0 in enumerate(starts):
        n1 = min(N, n0 + cn)
        buf = bufs[i % len(bufs)][: n1 - n0]
        if side is None:
            dequantize_to_fp8(codes[n0:n1], scales[n0:n1], K, GROUP, out=buf)
        else:
            with torch.cuda.stream(side):
                if i >= len(bufs):  # the buffer's previous GEMM must be done
                    side.wait_event(evs[1][(i - len(bufs)) % len(evs[1])])
                dequantize_to_fp8(codes[n0:n1], scales[n0:n1], K, GROUP, out=buf)
                evs[0][i % len(evs[0])].record(side)
            main.wait_event(evs[0][i % len(evs[0])])
        if OUT_SLICE[0]:
            torch._scaled_mm(xq, buf[:, :K].t(), scale_a=sa, scale_b=sb[:, n0:n1], out_dtype=torch.bfloat16,
                             out=out[:, n0:n1])
        else:
            out[:, n0:n1] = torch._scaled_mm(xq, buf[:, :K].t(), scale_a=sa, scale_b=sb[:, n0:n1],
                                             out_dtype=torch.bfloat16)
        if side is not None:
            evs[1][i % len(evs[1])].record(main)
    if side is not None:
        main.wait_stream(side)
    return out


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    args = probe_args("t")
    doc = probe_doc("benchmarks/device/s30_w4a8_chunk.py", ("S30_MS", "S30_MB"))
    ms = [int(m) for m in os.environ.get("S30_MS", "1024,2048,4096").split(",")]
    mbs = [int(m) for m in os.environ.get("S30_MB", "8,16,24").split(",")]
    side = torch.cuda.Stream()
    try:  # does _scaled_mm write a column slice of a wider output in place?
        a = torch.randn(64, 128, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(256, 128, device="cuda").to(torch.float8_e4m3fn)
        one = torch.ones(1, device="cuda")
        o = torch.zeros(64, 512, device="cuda", dtype=torch.bfloat16)
        torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, out=o[:, 128:384])
        want = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        OUT_SLICE[0] = bool(torch.equal(o[:, 128:384], want)) and not o[:, :128].any() and not o[:, 384:].any()
    except Exception as exc:  # noqa: BLE001
        OUT_SLICE[0] = False
        doc["out_slice_error"] = repr(exc)[:400]
    doc["out_slice"] = OUT_SLICE[0]
    for name, N, K, sets, M, x, xq, sx in probe_cases(LAYERS, ms):
        key = f"{name} M={M}"
        row = {"layer": name, "M": M, "N": N, "K": K}
        try:
            kp = padded_k(K)
            fns = {"base": [lambda c=c, s=s: w4a8_fp8_gemm(xq, sx, c, s, INV_DELTA, K, GROUP) for c, s in sets],
                   "dequant": [lambda c=c, s=s: dequantize_to_fp8(c, s, K, GROUP) for c, s in sets]}
            ref = fns["base"][0]()
            for mb in mbs:
                cn = max(256, (mb * 2 ** 20 // kp) // 256 * 256)
                if cn >= N:
                    continue
                for ns in (1, 2):
                    bufs = [torch.empty((cn, kp), dtype=torch.float8_e4m3fn, device="cuda") for _ in range(2)]
                    evs = ([torch.cuda.Event() for _ in range(2)], [torch.cuda.Event() for _ in range(2)])
                    kw = {"side": side, "evs": evs} if ns == 2 else {}
                    vname = f"chunk{mb}_s{ns}"
                    got = chunked(xq, sx, sets[0][0], sets[0][1], K, cn, bufs, **kw)
                    torch.cuda.synchronize()
                    row[f"{vname}_rows"] = cn
                    row[f"{vname}_rel"] = rel(got, ref)
                    row[f"{vname}_equal"] = bool(torch.equal(got, ref))
                    fns[vname] = [lambda c=c, s=s, b=bufs, kw=kw, cn=cn: chunked(xq, sx, c, s, K, cn, b, **kw)
                                  for c, s in sets]
            fns.update(peer_gemm_fns(x, N, K))
            for vname, fl in fns.items():
                row[f"{vname}_us"] = graph_us(fl, n=max(6, len(fl)), reps=10)
            probe_row(doc, key, row)
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:800]
            probe_row(doc, key, row)
        write_probe(doc, args.out, "s30_w4a8_chunk.json")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
