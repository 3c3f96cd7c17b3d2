"""Quantized checkpoints: save -> load gives the same greedy tokens; bad files raise clear errors."""
import json
import os
import shutil

import pytest
import torch

from lowbit.models import checkpoint as ck
from tests._tiny_models import ToyInt8Linear, greedy, tiny_llama, toy_quantize

ck.register_module_class(ToyInt8Linear)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = toy_quantize(tiny_llama(head_dim=16, tie=True))
    d = tmp_path_factory.mktemp("ckpt") / "q"
    ck.save_quantized(model, d)
    return model, d


def _copy(src, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def test_roundtrip_same_greedy_tokens(saved):
    model, d = saved
    loaded = ck.load_quantized(d)
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, ToyInt8Linear)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # ties rebuilt
    prompt = torch.tensor([[1, 5, 9, 17, 33]])
    assert torch.equal(greedy(model, prompt), greedy(loaded, prompt))
    for (n1, t1), (n2, t2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2)
    assert loaded.lowbit_recipe["recipe"] == "toy"


def test_metadata_contents(saved):
    _, d = saved
    meta = json.loads((d / "lowbit.json").read_text())
    assert meta["format_version"] == ck.FORMAT_VERSION and meta["lowbit_version"]
    assert meta["base_config"]["model_type"] == "llama"
    mod = meta["modules"]["model.layers.0.mlp.down_proj"]
    assert mod["class"].endswith(":ToyInt8Linear") and mod["config"] == {"scale_dtype": "float32"}
    t = meta["tensors"]["model.layers.1.self_attn.k_proj.qweight"]
    assert t["dtype"] == "int8" and t["format"] == "toy-int8:qweight"
    assert meta["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert not any(p.suffix in (".bin", ".pt", ".pkl") for p in d.iterdir())  # no pickle files


def test_truncated(saved, tmp_path):
    d = _copy(saved[1], tmp_path)
    w = d / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])
    with pytest.raises(ck.CheckpointError, match="truncated"):
        ck.load_quantized(d)


def test_tampered_weights(saved, tmp_path):
    d = _copy(saved[1], tmp_path)
    w = d / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-3] ^= 0x40
    w.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match="SHA-256"):
        ck.load_quantized(d)


def test_tampered_metadata(saved, tmp_path):
    d = _copy(saved[1], tmp_path)
    meta = json.loads((d / "lowbit.json").read_text())
    meta["modules"]["model.layers.0.mlp.down_proj"]["config"]["scale_dtype"] = "float16"
    (d / "lowbit.json").write_text(json.dumps(meta))
    with pytest.raises(ck.CheckpointError, match="metadata was edited"):
        ck.load_quantized(d)


def _resave_with(d, edit):
    """Rewrite a consistent checkpoint (valid hashes) whose content was changed by ``edit``."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    meta = json.loads((d / "lowbit.json").read_text())
    edit(tensors, meta)
    meta.pop("weights_sha256"), meta.pop("weights_bytes")
    import hashlib

    h = hashlib.sha256(ck._canonical(meta)).hexdigest()
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": ck.FORMAT, "lowbit_meta_sha256": h})
    meta["weights_sha256"] = ck._sha256_file(d / "model.safetensors")
    meta["weights_bytes"] = os.path.getsize(d / "model.safetensors")
    (d / "lowbit.json").write_text(json.dumps(meta))


def test_wrong_shape(saved, tmp_path):
    d = _copy(saved[1], tmp_path)
    name = "model.layers.0.mlp.up_proj.qweight"

    def edit(t, meta):
        t[name] = t[name][:, :-2].contiguous()
        meta["tensors"][name]["shape"] = list(t[name].shape)

    _resave_with(d, edit)
    with pytest.raises(ck.CheckpointError, match="up_proj.qweight"):
        ck.load_quantized(d)


def test_missing_tensor_and_metadata_mismatch(saved, tmp_path):
    d = _copy(saved[1], tmp_path)
    name = "model.layers.1.self_attn.o_proj.scale"

    def edit(t, meta):
        del t[name]

    _resave_with(d, edit)  # metadata still lists it
    with pytest.raises(ck.CheckpointError, match="different tensors"):
        ck.load_quantized(d)


def test_wrong_dtype_against_model(saved, tmp_path):
    d = _copy(saved[1], tmp_path)
    name = "model.layers.1.self_attn.o_proj.scale"

    def edit(t, meta):
        t[name] = t[name].half()
        meta["tensors"][name]["dtype"] = "float16"

    _resave_with(d, edit)
    with pytest.raises(ck.CheckpointError, match="o_proj.scale"):
        ck.load_quantized(d)


def test_foreign_class_refused(saved, tmp_path):
    d = _copy(saved[1], tmp_path)

    def edit(t, meta):
        meta["modules"]["model.layers.0.mlp.down_proj"]["class"] = "os:system"

    _resave_with(d, edit)
    with pytest.raises(ck.CheckpointError, match="outside lowbit"):
        ck.load_quantized(d)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError):
        ck.load_quantized(tmp_path / "nope")
    with pytest.raises(ck.CheckpointError, match="lowbit.json is missing"):
        ck.load_quantized(tmp_path)
    (tmp_path / "lowbit.json").write_text("{not json")
    with pytest.raises(ck.CheckpointError, match="not valid JSON"):
        ck.load_quantized(tmp_path)
    (tmp_path / "lowbit.json").write_text(json.dumps({"format": ck.FORMAT, "format_version": 99}))
    with pytest.raises(ck.CheckpointError, match="newer"):
        ck.load_quantized(tmp_path)


def test_no_pickle_in_module():
    import inspect

    src = inspect.getsource(ck)
    assert "torch.load" not in src.replace('"torch.load', "") and "import pickle" not in src


def test_float_model_roundtrip(tmp_path):
    model = tiny_llama(head_dim=32, layers=1)
    ck.save_quantized(model, tmp_path / "f")
    loaded = ck.load_quantized(tmp_path / "f")
    prompt = torch.tensor([[3, 4, 5]])
    assert torch.equal(greedy(model, prompt, 4), greedy(loaded, prompt, 4))


def test_bf16_cast_model_keeps_its_rope_buffers(tmp_path):
    # a model cast with .to(bf16) holds RoPE inv_freq (a non-persistent buffer) in bf16: saved too
    model = toy_quantize(tiny_llama(head_dim=16, dtype=torch.bfloat16))
    ck.save_quantized(model, tmp_path / "b")
    loaded = ck.load_quantized(tmp_path / "b")
    assert loaded.model.rotary_emb.inv_freq.dtype == model.model.rotary_emb.inv_freq.dtype
    prompt = torch.tensor([[2, 4, 6, 8]])
    assert torch.equal(greedy(model, prompt, 6), greedy(loaded, prompt, 6))
