"""Session-36 probe (issue 3, M >= 1024): dequantize the NEXT linear's INT4 weight to FP8 on a low-priority side stream
while the current linear's ``torch._scaled_mm`` runs, the GEMM leaving ``c`` SMs to it (cuBLASLt's SM-count target,
``torch._C._set_sm_carveout_experimental``). The committed large-M path runs act-quant, the dequantization (~3 TB/s,
the copy ceiling: gate_up 59 us) and the GEMM one after the other: >= 1.32x ``_scaled_mm`` at gate_up M = 1024
(``s30_dequant.json``).

    PYTHONPATH=$PWD python3 benchmarks/device/s36_prefetch.py --out DIR   (env S36_MS=1024,4096, S36_C=0,8,16,24)

Per layer (Llama-3-8B shapes) and M, a chain of ``STEPS`` linears of that shape on rotating weight sets (> 2x L2),
per-step us (the chain as one CUDA graph, CUDA events around 5 replays, median; r1 timed eager chains, which were
host-bound for the multi-launch variants: ``serial`` 566 us at gate_up M = 1024 against 234 us in graphs):

- ``peer_mm``: ``_scaled_mm`` on pre-dequantized FP8 weights, x pre-quantized (the issue's reference: no act-quant);
- ``peer_mm_c<c>``: the same with carveout c (what the GEMM loses by leaving c SMs);
- ``serial``: the committed ``w4a8_fp8_linear`` (act-quant + dequantize + ``_scaled_mm``);
- ``pipe_c<c>``: act-quant + ``_scaled_mm`` on the main (high-priority) stream with carveout c, the next step's
  dequantization into the other of two FP8 buffers on the side (low-priority) stream;
- ``dequant``: the dequantization alone.
Outputs of ``pipe_c*`` vs ``serial`` on the last step: ``torch.equal`` expected. Writes ``s36_prefetch.json``.
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import probe_args, probe_doc, probe_row, write_probe  # noqa: E402
from lowbit.bench.suites.w4a8_fp8 import GROUP, probe_cases  # noqa: E402
from lowbit.formats.w4a8_fp8 import padded_k  # noqa: E402
from lowbit.kernels.w4a8_fp8_gemm import dequantize_to_fp8  # noqa: E402
from lowbit.ops.quant import per_token_quant  # noqa: E402
from lowbit.ops.w4a8_fp8 import w4a8_fp8_linear  # noqa: E402

LAYERS = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "o": (4096, 4096)}
INV_DELTA = 2.0 ** -8
STEPS = 12
CARVE = hasattr(torch._C, "_set_sm_carveout_experimental")


def carveout(c):
    if CARVE:
        torch._C._set_sm_carveout_experimental(c if c else None)


def chain_us(step, steps=STEPS, reps=5, stream=None):
    """Per-step us of ``step(i)`` for i in range(steps): the chain captured as one CUDA graph on ``stream`` (side
    streams forked and joined inside ``step``), replayed ``reps`` times between CUDA events; median."""
    stream = stream or torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        for i in range(steps):  # warm-up / compile outside the capture
            step(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for i in range(steps):
            step(i)
    torch.cuda.synchronize()
    out = []
    for r in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record(stream)
            g.replay()
            b.record(stream)
        torch.cuda.synchronize()
        if r:
            out.append(a.elapsed_time(b) * 1e3 / steps)
    del g
    return round(statistics.median(out), 2)


def main():
    args = probe_args("p")
    doc = probe_doc("benchmarks/device/s36_prefetch.py", ("S36_MS", "S36_C"))
    ms = [int(m) for m in os.environ.get("S36_MS", "1024,4096").split(",")]
    cs = [int(c) for c in os.environ.get("S36_C", "0,8,16,24").split(",")]
    doc["carveout_api"] = CARVE
    hi = torch.cuda.Stream(priority=-1)  # lower number = higher priority
    lo = torch.cuda.Stream(priority=0)
    for name, N, K, sets, M, x, xq, sx in probe_cases(LAYERS, ms):
        row = {"layer": name, "M": M, "N": N, "K": K, "sets": len(sets)}
        try:
            kp = padded_k(K)
            n = len(sets)
            wf = [dequantize_to_fp8(c, s, K, GROUP)[:, :K] for c, s in sets]
            sa = sx.reshape(M, 1)
            sb = torch.full((1, N), INV_DELTA, dtype=torch.float32, device="cuda")
            bufs = [torch.empty((N, kp), dtype=torch.float8_e4m3fn, device="cuda") for _ in range(2)]
            ready = [torch.cuda.Event() for _ in range(2)]
            done = [torch.cuda.Event() for _ in range(2)]
            outs = {}

            def mm(i):
                return torch._scaled_mm(xq, wf[i % n].t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

            def serial(i):
                outs["serial"] = w4a8_fp8_linear(x, sets[i % n][0], sets[i % n][1], INV_DELTA, K, GROUP)

            def deq(i):
                dequantize_to_fp8(sets[i % n][0], sets[i % n][1], K, GROUP, out=bufs[i % 2])

            def pipe(i, tag):
                if i == 0:  # prologue: step 0's weight (timed: one dequantization per chain)
                    lo.wait_stream(hi)
                    with torch.cuda.stream(lo):
                        deq(0)
                        ready[0].record(lo)
                if i + 1 < STEPS:
                    with torch.cuda.stream(lo):
                        if i >= 1:
                            lo.wait_event(done[(i + 1) % 2])  # step i-1's GEMM read that buffer
                        deq(i + 1)
                        ready[(i + 1) % 2].record(lo)
                q, s = per_token_quant(x, "fp8")
                hi.wait_event(ready[i % 2])
                outs[tag] = torch._scaled_mm(q, bufs[i % 2][:, :K].t(), scale_a=s.reshape(M, 1), scale_b=sb,
                                             out_dtype=torch.bfloat16)
                done[i % 2].record(hi)
                if i + 1 == STEPS:
                    hi.wait_stream(lo)

            row["peer_mm_us"] = chain_us(mm, stream=hi)
            row["dequant_us"] = chain_us(deq, stream=hi)
            row["serial_us"] = chain_us(serial, stream=hi)
            for c in cs:
                carveout(c)
                try:
                    if c:
                        row[f"peer_mm_c{c}_us"] = chain_us(mm, stream=hi)
                    row[f"pipe_c{c}_us"] = chain_us(lambda i, c=c: pipe(i, f"pipe_c{c}"), stream=hi)
                finally:
                    carveout(0)
                row[f"pipe_c{c}_equal_serial"] = bool(torch.equal(outs[f"pipe_c{c}"], outs["serial"]))
                row[f"pipe_c{c}_over_peer"] = round(row[f"pipe_c{c}_us"] / row["peer_mm_us"], 4)
            row["serial_over_peer"] = round(row["serial_us"] / row["peer_mm_us"], 4)
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:800]
        probe_row(doc, f"{name} M={M}", row)
        write_probe(doc, args.out, "s36_prefetch.json")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
