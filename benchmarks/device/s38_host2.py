"""Device script (session 38): host time per eager call of the w4a8-fp8 linear at M = 1, layer by layer: the
module, the public op, the torch.library op, the op's Python body (the two launchers), each launcher alone, and
an empty torch.library op (the dispatch floor). Prints us per call (perf_counter over 200 calls, no sync)."""
import sys
import time

import torch

sys.path.insert(0, ".")
import lowbit  # noqa: E402
from lowbit.formats.common import FP8_E4M3  # noqa: E402
from lowbit.kernels.act_quant import per_token_quant_triton  # noqa: E402
from lowbit.kernels.w4a8_fp8_gemm import w4a8_fp8_gemm  # noqa: E402
from lowbit.ops import w4a8_fp8 as ops  # noqa: E402

torch.manual_seed(0)
lin = torch.nn.Linear(4096, 28672, bias=False, device="cuda", dtype=torch.bfloat16)
m = lowbit.quantize_linear(lin, "w4a8-fp8", group_size=128)
x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
xq, sx = per_token_quant_triton(x, FP8_E4M3, pdl=True)


@torch.library.custom_op("lowbit_probe::noop", mutates_args=())
def noop(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


noop.register_fake(lambda x: x.new_empty(x.shape))
args = (m.codes, m.scales, float(m.inv_delta), 4096, 128, None, None, False)
cases = {
    "module forward": lambda: m(x),
    "public op w4a8_fp8_linear": lambda: ops.w4a8_fp8_linear(x, m.codes, m.scales, m.inv_delta, 4096, 128),
    "torch.library op (pdl)": lambda: ops._w4a8_fp8_linear_pdl(x, *args),
    "op body (undecorated)": lambda: ops._w4a8_fp8_linear_pdl._init_fn(x, *args),
    "act-quant launcher": lambda: per_token_quant_triton(x, FP8_E4M3, pdl=True),
    "gemm launcher": lambda: w4a8_fp8_gemm(xq, sx, m.codes, m.scales, m.inv_delta, 4096, 128, out_dtype=x.dtype,
                                           pdl=True, pdl_trigger=False),
    "empty torch.library op": lambda: noop(x),
    "torch.empty": lambda: torch.empty(1, 28672, device="cuda", dtype=torch.bfloat16),
}
with torch.no_grad():
    for name, fn in cases.items():
        try:
            for _ in range(10):
                fn()
        except Exception as exc:
            print(f"{name:32s} error {exc!r}"[:200])
            continue
        torch.cuda.synchronize()
        best = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            best.append((time.perf_counter() - t0) / 200 * 1e6)
            torch.cuda.synchronize()
        print(f"{name:32s} {min(best):8.1f} us/call (host)", flush=True)
