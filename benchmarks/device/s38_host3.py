"""Device script (session 38): the floor under lowbit's launchers -- Triton's own JIT dispatch, replayed with the
exact arguments our launchers pass (recorded from one call), and the host cost of a few helpers. us per call."""
import sys
import time

import torch
import triton

sys.path.insert(0, ".")
import lowbit  # noqa: E402
from lowbit._utils import arrival_counters, tma_descriptor  # noqa: E402
from lowbit.formats.common import FP8_E4M3  # noqa: E402
from lowbit.kernels import w4a8_fp8_gemm as G  # noqa: E402
from lowbit.kernels.act_quant import per_token_quant_triton  # noqa: E402

rec = []
orig = triton.runtime.jit.JITFunction.run


def spy(self, *args, **kw):
    rec.append((self, args, kw))
    return orig(self, *args, **kw)


torch.manual_seed(0)
lin = torch.nn.Linear(4096, 28672, bias=False, device="cuda", dtype=torch.bfloat16)
m = lowbit.quantize_linear(lin, "w4a8-fp8", group_size=128)
x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
xq, sx = per_token_quant_triton(x, FP8_E4M3, pdl=True)
for _ in range(3):
    m(x)
torch.cuda.synchronize()
triton.runtime.jit.JITFunction.run = spy
m(x)
triton.runtime.jit.JITFunction.run = orig
torch.cuda.synchronize()


def t(fn, n=300):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return best


for fn_, args, kw in rec:
    print(f"JIT run replay {fn_.fn.__name__:32s} {t(lambda: orig(fn_, *args, **kw)):7.1f} us  "
          f"({len(args)} args, {len(kw)} kwargs)")
print(f"get_device_capability          {t(lambda: torch.cuda.get_device_capability(x.device)):7.1f} us")
print(f"pick_config                    {t(lambda: G.pick_config(1, 28672, 4096)):7.1f} us")
print(f"tma_descriptor                 {t(lambda: tma_descriptor(m.codes, [128, 64])):7.1f} us")
print(f"arrival_counters               {t(lambda: arrival_counters('w4a8_fp8', x.device, 100)):7.1f} us")
print(f"torch.empty                    {t(lambda: torch.empty((1, 28672), device='cuda', dtype=torch.bfloat16)):7.1f} us")
print(f"module forward                 {t(lambda: m(x)):7.1f} us")
