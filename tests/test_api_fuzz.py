"""Shape fuzz of the public entry points (``lowbit.api``): any shape, dtype and option either works (output shaped
like its input, finite, close to the float reference) or raises ``ValueError`` / ``TypeError`` whose message names
the argument at fault; never an ``IndexError``, a ``RuntimeError`` from inside torch, or silent garbage. Small sizes:
the Triton kernels run under the interpreter on the CPU."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit
from lowbit import api
from tests.tolerances import rel_l2

NAMES = ("q", "k", "v", "x", "head", "batch", "shape", "dtype", "scheme", "group_size", "in_features", "bits",
         "sm_scale", "causal", "table", "linear", "dim")


def _clear(exc: Exception) -> bool:
    msg = str(exc)
    return isinstance(exc, (ValueError, TypeError, NotImplementedError)) and any(n in msg for n in NAMES)


@settings(max_examples=12, deadline=None)
@given(scheme=st.sampled_from(("sdpa", "fp8", "fp8-kv4", "int8", "int8-qk")), B=st.integers(1, 2),
       hkv=st.sampled_from((1, 2)), g=st.sampled_from((1, 2, 3)), sq=st.integers(1, 40), skv=st.integers(1, 40),
       D=st.sampled_from((8, 16, 24, 64, 72, 128, 200, 256)), causal=st.booleans(),
       dtype=st.sampled_from((torch.float16, torch.bfloat16, torch.float32)),
       bad=st.sampled_from((None, None, None, "kdim", "kv_batch", "heads", "vshape", "ndim", "kdtype", "int")))
def test_attention_any_shape_works_or_names_the_argument(scheme, B, hkv, g, sq, skv, D, causal, dtype, bad):
    torch.manual_seed(sq * 41 + skv)
    hq = hkv * g
    q = torch.randn(B, hq, sq, D, dtype=dtype)
    k = torch.randn(B, hkv, skv, D, dtype=dtype)
    v = torch.randn(B, hkv, skv, D, dtype=dtype)
    if bad == "kdim":
        k = torch.randn(B, hkv, skv, D + 8, dtype=dtype)
    elif bad == "kv_batch":
        k, v = k[:1].expand(B + 1, -1, -1, -1).contiguous(), v[:1].expand(B + 1, -1, -1, -1).contiguous()
    elif bad == "heads" and hkv == 2 and g == 1:
        q = torch.randn(B, 3, sq, D, dtype=dtype)
    elif bad == "vshape":
        v = torch.randn(B, hkv, skv + 1, D, dtype=dtype)
    elif bad == "ndim":
        q = q[0]
    elif bad == "kdtype":
        k = k.double()
    elif bad == "int":
        q = (q * 10).to(torch.int32)
    try:
        o = api.attention(q, k, v, scheme=scheme, causal=causal)
    except Exception as exc:  # noqa: BLE001
        assert _clear(exc), f"{type(exc).__name__}: {exc}"
        return
    assert bad in (None, "heads"), f"bad input {bad!r} was accepted"
    assert o.shape == q.shape and o.dtype == q.dtype and torch.isfinite(o.float()).all()
    ref = api.attention(q.float(), k.float(), v.float(), scheme="sdpa", causal=causal)
    # rows a causal mask leaves without keys (Sq > Skv) are zeros in every scheme's contract
    # fp8-kv4: INT4 K and V (rel-L2 ~0.1 each on N(0, 1) rows), with as few as one key to average over
    tol = {"sdpa": 1e-2, "fp8": 0.1, "fp8-kv4": 0.35, "int8": 0.1, "int8-qk": 0.1}[scheme]
    assert rel_l2(o.float(), ref) < tol


@settings(max_examples=10, deadline=None)
@given(scheme=st.sampled_from(("w4a8-fp8", "lut", "w4a8-int8", "w8")), N=st.integers(1, 80), K=st.integers(1, 300),
       M=st.integers(1, 5), lead=st.sampled_from(((), (2,), (1, 3))),
       dtype=st.sampled_from((torch.float16, torch.bfloat16, torch.float32)), bias=st.booleans(),
       bad=st.sampled_from((None, None, "xdim", "xdtype")))
def test_linear_any_shape_works_or_names_the_argument(scheme, N, K, M, lead, dtype, bias, bad):
    torch.manual_seed(N * 301 + K)
    lin = torch.nn.Linear(K, N, bias=bias).to(dtype)
    try:
        mod = lowbit.quantize_linear(lin, scheme)
    except Exception as exc:  # noqa: BLE001
        assert _clear(exc), f"{type(exc).__name__}: {exc}"
        return
    x = torch.randn(*lead, M, K, dtype=dtype)
    if bad == "xdim":
        x = torch.randn(*lead, M, K + 1, dtype=dtype)
    elif bad == "xdtype":
        x = x.double()
    try:
        y = mod(x)
    except Exception as exc:  # noqa: BLE001
        assert _clear(exc), f"{type(exc).__name__}: {exc}"
        return
    assert bad is None or bad == "xdtype", f"bad input {bad!r} was accepted"
    assert y.shape == (*lead, M, N) and torch.isfinite(y.float()).all()
    with torch.no_grad():
        ref = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float() if bias else None)
        # per output, against |x_m| |w_n| (Cauchy-Schwarz): a relative error of one output can be anything when its
        # K products cancel (one output of K = 91 read -0.0155 vs -0.0476: 0.03 against |x| |w| ~ 5)
        # plus the output dtype's rounding of y itself (bf16: 2^-8 relative; the bias can dominate y)
        bound = 0.2 * x.float().norm(dim=-1, keepdim=True) * lin.weight.float().norm(dim=-1) + 2 ** -7 * ref.abs() + 1e-3
    assert ((y.float() - ref).abs() <= bound).all()
