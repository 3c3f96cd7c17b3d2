"""compressed-tensors export: the package's own decompression gives lowbit's weights back."""
import json

import pytest
import torch

pytest.importorskip("compressed_tensors")

import lowbit  # noqa: E402
from lowbit.models.export import ExportError, export_compressed_tensors, verify_export  # noqa: E402
from tests._tiny_models import tiny_llama  # noqa: E402


@pytest.fixture(autouse=True)
def _references(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _calib():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (1, 16), generator=g) for _ in range(2)]


def _model(recipe, **opts):
    m = tiny_llama(hidden=128, heads=4, kv_heads=2, head_dim=32)
    try:
        return lowbit.quantize_model(m, recipe, calibration=_calib(), progress=False, **opts)
    except NotImplementedError as exc:
        pytest.skip(str(exc))


def test_w4a8_int8_exact(tmp_path):
    m = _model("qserve", kv=None, attention=None, smooth=False)
    rep = export_compressed_tensors(m, tmp_path / "q")
    res = verify_export(tmp_path / "q", m)
    assert len(res) == 14 and len(rep["modules"]) == 14
    for name, (exact, rel) in res.items():
        assert rel < 1e-6, name  # same value up to fp32 multiplication order


def test_w4a8_fp8_maps_where_products_are_fp8(tmp_path):
    m = _model("fireq", kv="kv4", attention="fp8")
    rep = export_compressed_tensors(m, tmp_path / "f", kv_cache="fp8", calibration=_calib())
    res = verify_export(tmp_path / "f", m)
    assert len(res) == 14
    for name, (exact, rel) in res.items():
        # q*sigma vs lowbit's FP8(q*sigma) LUT entries: equal where the product is an E4M3 number,
        # else the FP8 rounding (<= 2^-4 relative) of that entry
        assert rel < 2 ** -4 and exact > 0.3, (name, exact, rel)
        assert abs(exact - rep["modules"][name]["exact_fraction"]) < 1e-6
    cfg = json.loads((tmp_path / "f" / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["format"] == "pack-quantized" and q["kv_cache_scheme"]["type"] == "float"
    g = next(iter(q["config_groups"].values()))
    assert g["weights"]["num_bits"] == 4 and g["weights"]["group_size"] == 128
    assert g["input_activations"]["type"] == "float" and g["input_activations"]["dynamic"]
    from safetensors.torch import load_file

    t = load_file(str(tmp_path / "f" / "model.safetensors"))
    assert t["model.layers.0.self_attn.k_scale"].item() > 0
    assert any("KV cache" in d for d in rep["dropped"])


def test_power_of_two_scales_are_exact():
    from lowbit.nn.w4a8_fp8 import W4A8FP8Linear

    lin = torch.nn.Linear(128, 8, bias=False)
    with torch.no_grad():  # every group's amax = 7 * 2^e -> sigma = 2^e exactly
        lin.weight.uniform_(-0.8, 0.8)
        lin.weight[:, 0] = 7 * 2.0 ** -3
    mod = W4A8FP8Linear.from_linear(lin, pts=False)
    from lowbit.models.export import _w4a8_fp8_tensors
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    _, _, exact, rel = _w4a8_fp8_tensors(mod, pack_to_int32)
    assert exact == 1.0 and rel == 0.0


def test_lut_refused_or_dense(tmp_path):
    m = _model("flute-nf4", fuse_mlp=False)
    with pytest.raises(ExportError, match="not representable"):
        export_compressed_tensors(m, tmp_path / "n")
    rep = export_compressed_tensors(m, tmp_path / "n", fallback="dense")
    assert all(e["form"].startswith("dense") for e in rep["modules"].values())
    from safetensors.torch import load_file

    t = load_file(str(tmp_path / "n" / "model.safetensors"))
    w = m.model.layers[0].mlp.up_proj.dequantize()
    assert torch.equal(t["model.layers.0.mlp.up_proj.weight"].float(), w.to(t["model.layers.0.mlp.up_proj.weight"].dtype).float())


def test_fused_lut_mlp_dense_halves(tmp_path):
    """flute-nf4 with fuse_mlp: the fused gate_up is written as its dense gate_proj / up_proj halves, the values
    of the unfused model's modules."""
    plain = _model("flute-nf4", fuse_mlp=False)
    m = _model("flute-nf4")  # (fused by default)
    with pytest.raises(ExportError, match="not representable"):
        export_compressed_tensors(m, tmp_path / "f")
    export_compressed_tensors(m, tmp_path / "f", fallback="dense")
    from safetensors.torch import load_file

    t = load_file(str(tmp_path / "f" / "model.safetensors"))
    for role in ("gate_proj", "up_proj"):
        w = getattr(plain.model.layers[1].mlp, role).dequantize()
        got = t[f"model.layers.1.mlp.{role}.weight"]
        assert torch.equal(got.float(), w.to(got.dtype).float())
    assert not any("gate_up" in k for k in t)


def test_quantized_lm_head_exports(tmp_path):
    """lm_head=True: the head is one more W4A8 int module (not in `ignore`), verified like the rest."""
    m = _model("qserve", kv=None, attention=None, smooth=False, lm_head=True)
    export_compressed_tensors(m, tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())["quantization_config"]
    assert "lm_head" not in cfg.get("ignore", [])
    assert any("lm_head" in g["targets"] for g in cfg["config_groups"].values())
    res = verify_export(tmp_path / "h", m)
    assert len(res) == 15 and res["lm_head"][1] < 1e-6


def test_w8_lm_head_exports_exact(tmp_path):
    """lm_head="w8": a W8A16 channel-wise group beside the W4A8 one, decompressed exactly by the package."""
    m = _model("qserve", kv=None, attention=None, smooth=False, lm_head="w8")
    rep = export_compressed_tensors(m, tmp_path / "w8")
    assert rep["modules"]["lm_head"]["lowbit_scheme"] == "w8"
    cfg = json.loads((tmp_path / "w8" / "config.json").read_text())["quantization_config"]
    g8 = [g for g in cfg["config_groups"].values() if "lm_head" in g["targets"]]
    assert len(g8) == 1 and g8[0]["weights"]["num_bits"] == 8 and g8[0]["weights"]["strategy"] == "channel"
    assert g8[0].get("input_activations") is None
    res = verify_export(tmp_path / "w8", m)
    assert len(res) == 15 and res["lm_head"] == (1.0, 0.0)
