"""The public API's argument errors: unknown schemes/recipes (ValueError naming the known ones),
wrong dtypes, devices and shapes, and the sdpa scheme against the float64 reference."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit
from lowbit import registry
from lowbit.ops.attention import attention_ref


def qkv(B=1, Hq=4, Hkv=2, Sq=5, Skv=7, D=16, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, Sq, D, generator=g).to(dtype=dtype, device=device)
    k = torch.randn(B, Hkv, Skv, D, generator=g).to(dtype=dtype, device=device)
    v = torch.randn(B, Hkv, Skv, D, generator=g).to(dtype=dtype, device=device)
    return q, k, v


# ---- listing and unknown names ---------------------------------------------------------------------

def test_schemes_and_recipes_list_the_registry():
    names = {s["name"] for s in lowbit.schemes()}
    assert {"w4a8-fp8", "lut", "w4a8-int8", "sdpa", "fp8", "fp8-kv4", "int8", "int8-qk"} <= names
    assert all({"kind", "devices", "description", "paper", "defaults"} <= set(s) for s in lowbit.schemes())
    assert [r["name"] for r in lowbit.recipes()] == [e.name for e in registry.entries("recipe")]
    assert "fireq" in [r["name"] for r in lowbit.recipes()]


def test_unknown_linear_scheme():
    with pytest.raises(ValueError, match=r"unknown linear scheme 'w3a3'; known: .*lut.*w4a8-fp8"):
        lowbit.quantize_linear(nn.Linear(8, 8), "w3a3")


def test_unknown_attention_scheme():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"unknown attention scheme 'fp4'; known: .*fp8.*sdpa"):
        lowbit.attention(q, k, v, scheme="fp4")


def test_unknown_recipe():
    with pytest.raises(ValueError, match=r"unknown recipe 'gptq'; known: .*fireq.*qserve"):
        lowbit.quantize_model(nn.Linear(2, 2), "gptq")


def test_scheme_name_must_be_a_string():
    with pytest.raises(ValueError, match="known"):
        lowbit.quantize_linear(nn.Linear(8, 8), None)


def test_linear_scheme_is_not_an_attention_scheme():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="unknown attention scheme 'lut'"):
        lowbit.attention(q, k, v, scheme="lut")


# ---- quantize_linear / quantize_model arguments ---------------------------------------------------------

def test_quantize_linear_wrong_type():
    with pytest.raises(TypeError, match="linear must be a torch.nn.Linear, got Conv1d"):
        lowbit.quantize_linear(nn.Conv1d(4, 4, 1), "w4a8-fp8")


def test_quantize_linear_wrong_dtype():
    with pytest.raises(TypeError, match="float16, bfloat16 or float32, got torch.float64"):
        lowbit.quantize_linear(nn.Linear(8, 8, dtype=torch.float64), "lut")


def test_quantize_linear_wrong_device():
    with pytest.raises(ValueError, match="linear is on meta; scheme 'w4a8-int8' runs on cpu, cuda"):
        lowbit.quantize_linear(nn.Linear(8, 8, device="meta"), "w4a8-int8")


def test_quantize_model_wrong_type():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        lowbit.quantize_model("SmolLM2", "fireq")


# ---- attention arguments -----------------------------------------------------------------------------------

def test_attention_wrong_dtype():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"q must have dtype in \(float16, bfloat16, float32\), got int64"):
        lowbit.attention(q.long(), k, v, scheme="sdpa")
    with pytest.raises(TypeError, match=r"k must have dtype in \(float32\), got float16"):
        lowbit.attention(q, k.half(), v, scheme="sdpa")
    with pytest.raises(TypeError, match="v must be a torch.Tensor"):
        lowbit.attention(q, k, v.numpy(), scheme="sdpa")


@pytest.mark.parametrize("case,match", [
    ("q3d", "q must have 4 dims"),
    ("batch", "share batch size"),
    ("kv", "k and v must have the same shape"),
    ("headdim", "same head_dim"),
    ("gqa", r"q heads \(4\) must be a multiple of k/v heads \(3\)"),
    ("causal", "causal attention needs Sq <= Skv"),
])
def test_attention_wrong_shapes(case, match):
    q, k, v = qkv()
    if case == "q3d":
        q = q[0]
    elif case == "batch":
        k, v = torch.cat([k, k]), torch.cat([v, v])
    elif case == "kv":
        v = v[:, :, :-1]
    elif case == "headdim":
        k, v = k[..., :8], v[..., :8]
    elif case == "gqa":
        k, v = k.repeat(1, 2, 1, 1)[:, :3], v.repeat(1, 2, 1, 1)[:, :3]
    elif case == "causal":
        q, k, v = qkv(Sq=9, Skv=7)
    with pytest.raises(ValueError, match=match):
        lowbit.attention(q, k, v, scheme="sdpa", causal=(case == "causal"))


def test_attention_wrong_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="one device"):
        lowbit.attention(q, k.to("meta"), v.to("meta"), scheme="sdpa")
    qm, km, vm = (t.to("meta") for t in (q, k, v))
    with pytest.raises(ValueError, match="runs on cpu, cuda"):
        lowbit.attention(qm, km, vm, scheme="sdpa")


@pytest.mark.parametrize("causal,Sq,Skv", [(False, 5, 7), (True, 5, 7), (True, 6, 6), (True, 1, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_scheme_matches_reference(causal, Sq, Skv, dtype):
    """GQA and the bottom-right causal mask (decode: Sq=1 sees every key)."""
    q, k, v = qkv(Sq=Sq, Skv=Skv, dtype=dtype)
    out = lowbit.attention(q, k, v, scheme="sdpa", causal=causal)
    assert out.shape == q.shape and out.dtype == dtype
    ref = attention_ref(q, k, v, causal=causal)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (out.double() - ref).abs().max().item() < tol


def test_sdpa_sm_scale():
    q, k, v = qkv()
    out = lowbit.attention(q, k, v, scheme="sdpa", sm_scale=0.5)
    assert torch.allclose(out.double(), attention_ref(q, k, v, sm_scale=0.5), atol=1e-5)
