"""Corpus loader, calibration windows, perplexity windowing (on a tiny random Llama), memory helpers."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests._tiny_models import foundation_llama
from lowbit.eval import corpus, pipeline
from lowbit.eval.perplexity import perplexity, windowing


# ---- corpus ----------------------------------------------------------------------------------------

def test_default_corpus_is_pydoc_topics_joined():
    from pydoc_data.topics import topics

    text = corpus.load_text()
    assert text == "\n\n".join(topics.values())
    assert len(text) > 100_000  # enough for 8192 eval tokens + calibration tail
    assert corpus.describe_source(None).startswith("pydoc_data.topics")


def test_text_file(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello world\n", encoding="utf-8")
    assert corpus.load_text(f) == "hello world\n"
    assert corpus.describe_source(f) == str(f)


def test_text_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        corpus.load_text(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        corpus.load_text(empty)
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81abc")
    with pytest.raises(ValueError, match="UTF-8"):
        corpus.load_text(binary)


class CharTokenizer:
    """One id per character (enough to test the corpus plumbing without a real tokenizer)."""

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        ids = torch.tensor([[ord(c) % 256 for c in text]])
        return {"input_ids": ids}


def test_tokenize_is_1d_without_specials():
    ids = corpus.tokenize(CharTokenizer(), "abc")
    assert ids.tolist() == [97, 98, 99]


def test_calibration_batches_deterministic_and_after_eval_tokens(tmp_path):
    tok = CharTokenizer()
    text = "".join(chr(97 + (i * 7) % 26) for i in range(20_000))
    f = tmp_path / "c.txt"
    f.write_text(text)
    a = corpus.calibration_batches(tok, n_samples=4, seq_len=64, seed=1, text_file=f)
    b = corpus.calibration_batches(tok, n_samples=4, seq_len=64, seed=1, text_file=f)
    c = corpus.calibration_batches(tok, n_samples=4, seq_len=64, seed=2, text_file=f)
    assert len(a) == 4 and all(x.shape == (1, 64) and x.dtype == torch.long for x in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    # windows come from the tail after the 8192 tokens that eval scores
    full = corpus.tokenize(tok, text)
    tail = full[8192:].tolist()
    s = "," + ",".join(map(str, tail)) + ","
    assert all(("," + ",".join(map(str, x[0].tolist())) + ",") in s for x in a)


def test_calibration_batches_short_text(tmp_path):
    f = tmp_path / "s.txt"
    f.write_text("short")
    with pytest.raises(ValueError, match="fewer than seq_len"):
        corpus.calibration_batches(CharTokenizer(), n_samples=2, seq_len=64, text_file=f)


# ---- perplexity --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return foundation_llama(vocab=64)


def _reference_ppl(model, ids, window):
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, ids.numel(), window):
            chunk = ids[s:s + window]
            if chunk.numel() < 2:
                continue
            logits = model(input_ids=chunk[None]).logits[0, :-1].double()
            nll += F.cross_entropy(logits, chunk[1:], reduction="sum").item()
            n += chunk.numel() - 1
    return math.exp(nll / n), n


@pytest.mark.parametrize("max_tokens,window", [(200, 64), (130, 50), (None, 1024), (97, 97)])
def test_perplexity_matches_reference_windowing(model, max_tokens, window):
    ids = torch.randint(0, 64, (300,), generator=torch.Generator().manual_seed(0))
    r = perplexity(model, ids, max_tokens=max_tokens, window=window)
    used = ids if max_tokens is None else ids[:max_tokens]
    ref, n = _reference_ppl(model, used, window)
    assert r.tokens_scored == n
    # each window scores len-1 tokens; a trailing 1-token window scores none
    assert n == sum(max(0, min(window, used.numel() - s) - 1) for s in range(0, used.numel(), window))
    assert r.windows == math.ceil(used.numel() / window)
    assert r.perplexity == pytest.approx(ref, rel=1e-5)
    assert r.nll == pytest.approx(math.log(ref), rel=1e-5)
    assert "scored tokens" in r.describe()


def test_perplexity_of_uniform_model_is_vocab_size():
    m = foundation_llama(vocab=64)
    with torch.no_grad():
        m.lm_head.weight.zero_()  # tied: the embedding is zero too, logits all 0 -> uniform
    ids = torch.randint(0, 64, (100,), generator=torch.Generator().manual_seed(1))
    assert perplexity(m, ids, window=32).perplexity == pytest.approx(64.0, rel=1e-5)


def test_perplexity_argument_errors(model):
    with pytest.raises(ValueError, match="1-D"):
        perplexity(model, torch.zeros(1, 10, dtype=torch.long))
    with pytest.raises(ValueError, match="window"):
        perplexity(model, torch.zeros(10, dtype=torch.long), window=1)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(model, torch.zeros(1, dtype=torch.long))


def test_windowing_text_documents_the_method():
    s = windowing(8192, 1024)
    assert "first 8192 tokens" in s and "1024-token windows" in s and "labels=input_ids" in s
    assert "all tokens" in windowing(None, 512)


# ---- memory / devices ----------------------------------------------------------------------------------

def test_weight_bytes_counts_tied_storage_once():
    tied, untied = foundation_llama(vocab=64, tie=True), foundation_llama(vocab=64, tie=False)
    n_params = sum(p.numel() for p in tied.parameters())  # parameters() already dedups tied
    assert pipeline.weight_bytes(tied) == 4 * n_params
    assert pipeline.weight_bytes(untied) == pipeline.weight_bytes(tied) + 4 * 64 * 32


def test_kv_bytes_per_token_float_and_kv4():
    m = foundation_llama(vocab=64)  # 2 layers, 2 kv heads, head_dim 8
    assert pipeline.kv_bytes_per_token(m) == 2 * 2 * 2 * 8 * 4
    m.lowbit_recipe = {"recipe": "fireq", "kv": "kv4"}
    assert pipeline.kv_bytes_per_token(m) == 2 * 2 * 2 * (8 // 2 + 1)  # INT4 codes + one FP8 scale
    m.lowbit_recipe = {"recipe": "qserve", "kv": "kv4-zp"}
    assert pipeline.kv_bytes_per_token(m) == 2 * 2 * 2 * (8 // 2 + 2)  # + zero point
    m.lowbit_kv_bytes_per_token = 123
    assert pipeline.kv_bytes_per_token(m) == 123


def test_human_bytes():
    assert pipeline.human_bytes(512) == "512 B"
    assert pipeline.human_bytes(1536) == "1.5 KiB"
    assert pipeline.human_bytes(5 << 30) == "5.0 GiB"


def test_resolve_device_and_dtype():
    assert pipeline.resolve_device("cpu") == "cpu"
    assert pipeline.resolve_device("auto") in ("cpu", "cuda")
    with pytest.raises(ValueError, match="--device"):
        pipeline.resolve_device("tpu")
    if not torch.cuda.is_available():  # the real absence of CUDA, not the interpreter
        with pytest.raises(ValueError, match="no CUDA GPU"):
            pipeline.resolve_device("cuda")
    assert pipeline.resolve_dtype("auto", "cpu") == torch.float32
    assert pipeline.resolve_dtype("auto", "cuda") == torch.bfloat16
    assert pipeline.resolve_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="--dtype"):
        pipeline.resolve_dtype("int3", "cpu")


def test_unknown_recipe_names_the_known_ones():
    with pytest.raises(ValueError, match="known: .*fireq"):
        pipeline.check_recipe("nope")


def test_recipe_unavailable_on_device():
    from lowbit import registry

    for e in registry.entries("recipe"):
        if "cpu" not in e.devices:
            assert "needs" in pipeline.recipe_unavailable(e.name, "cpu")


def test_perplexity_deadline_never_returns_a_partial_result(model):
    import time

    ids = torch.randint(0, 64, (100,), generator=torch.Generator().manual_seed(2))
    with pytest.raises(TimeoutError, match="after 0 of 4 perplexity windows"):
        perplexity(model, ids, window=25, deadline=time.perf_counter() - 1)
    assert perplexity(model, ids, window=25, deadline=time.perf_counter() + 60).windows == 4
