"""Offline feasibility check (sm_90a, Triton 3.6 Gluon, no GPU) for a multi-warp INT4-cache decode CTA, one split per
warp: a rank-3 ``mma_v2`` with the warps along the batch dimension (``warps_per_cta=[W, 1, 1]``,
``instr_shape=[1, 16, 8]``), int8 [W, 32, 64] x [W, 64, 8], then a max over the token axis. Prints the PTX counts:
each warp issues its own mma.sync and reduces its own tokens, with no shared memory and no barrier.

    PYTHONPATH=/tmp/t36 python3 benchmarks/offline_gluon_batched_mma.py
"""
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

W = 4

@gluon.jit
def k(A, B, C, W: gl.constexpr):
    L: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L, k_width=4)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=L, k_width=4)
    w = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, a_l)))
    m = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, a_l)))
    kk = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, a_l)))
    a = gl.load(A + w[:, None, None] * 2048 + m[None, :, None] * 64 + kk[None, None, :])
    wb = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, b_l)))
    kb = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, b_l)))
    nb = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, b_l)))
    b = gl.load(B + wb[:, None, None] * 0 + kb[None, :, None] * 8 + nb[None, None, :])
    acc = gl.zeros([W, 32, 8], gl.int32, layout=L)
    acc = mma_v2(a, b, acc)
    mx = gl.max(acc, axis=1)  # per warp (batch) reduction over tokens
    wo = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(1, L)))
    no = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
    gl.store(C + wo[:, None] * 8 + no[None, :], mx)

sig = {"A": "*i8", "B": "*i8", "C": "*i32", "W": "constexpr"}
kern = triton.compile(GluonASTSource(fn=k, signature=sig, constexprs={"W": W}), target=GPUTarget("cuda", 90, 32),
                    options={"num_warps": W})
ptx = kern.asm["ptx"]
print("mma:", ptx.count("mma.sync"), "bar:", ptx.count("bar.sync"), "st.shared:", ptx.count("st.shared"), "shared B:", kern.metadata.shared)
