"""Fast generation runner: greedy tokens equal transformers' ``generate`` (CPU, eager path)."""
import pytest
import torch

from lowbit.models.generate import Generator, generate
from tests._tiny_models import greedy, tiny_llama, toy_quantize


@pytest.mark.parametrize("head_dim", [16, 32])
def test_batched_different_lengths_match_hf(head_dim):
    model = tiny_llama(head_dim=head_dim)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 128, (n,), generator=g) for n in (3, 9, 6)]
    got = generate(model, prompts, max_new_tokens=6)
    for p, t in zip(prompts, got):
        assert torch.equal(t, greedy(model, p.unsqueeze(0), 6)[0])


def test_quantized_model_and_reuse():
    model = toy_quantize(tiny_llama(head_dim=16))
    prompts = [torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10])]
    gen = Generator(model, max_batch=4, max_seq=32)
    a = gen.generate(prompts, 5)
    b = gen.generate(prompts[::-1], 5)  # a second batch reuses (and overwrites) the cache
    assert torch.equal(a[0], b[1]) and torch.equal(a[1], b[0])
    assert torch.equal(a[0], greedy(model, prompts[0].unsqueeze(0), 5)[0])


def test_eos_and_errors():
    model = tiny_llama(head_dim=16)
    p = torch.tensor([1, 2, 3])
    first = generate(model, [p], 4)[0]
    cut = generate(model, [p], 4, eos_token_id=int(first[1]))[0]
    assert torch.equal(cut, first[: cut.numel()]) and int(cut[-1]) == int(first[1])
    gen = Generator(model, max_batch=1, max_seq=8)
    with pytest.raises(ValueError, match="max_seq"):
        gen.generate([torch.arange(1, 7)], 4)
    with pytest.raises(ValueError, match="kv must be"):
        Generator(model, max_batch=1, max_seq=8, kv="int2")


@pytest.mark.parametrize("recipe", ["fireq", "qserve"])
def test_runner_fuses_quantized_projections(recipe, monkeypatch):
    import lowbit

    from tests.test_models_fastpath import import_kernels

    import_kernels()  # before the env flips (see there)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = tiny_llama(head_dim=16)
    g = torch.Generator().manual_seed(0)
    calib = [torch.randint(0, 128, (1, 16), generator=g) for _ in range(2)]
    try:
        lowbit.quantize_model(model, recipe, calibration=calib, progress=False)
    except NotImplementedError as exc:
        pytest.skip(str(exc))
    prompts = [torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9, 2])]
    plain = Generator(model, max_batch=2, max_seq=16, fuse=False, prefill_from_cache=True).generate(prompts, 4)
    gen = Generator(model, max_batch=2, max_seq=16, prefill_from_cache=True)
    assert all(f.qkv is not None and f.gate_up is not None for f in gen.fused)
    fused = gen.generate(prompts, 4)
    assert all(torch.equal(a, b) for a, b in zip(plain, fused))
    assert torch.equal(fused[0], greedy(model, prompts[0].unsqueeze(0), 4)[0])  # HF path still intact


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decode_matches_eager_gpu():
    """The captured decode step (``lowbit._utils.capture_cuda_graph``) gives the eager step's greedy tokens."""
    import lowbit

    model = tiny_llama(head_dim=64, hidden=128, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    calib = [torch.randint(0, 128, (1, 16), generator=g) for _ in range(2)]
    lowbit.quantize_model(model, "fireq", calibration=calib, progress=False)
    model = model.cuda()
    prompts = [torch.tensor([3, 1, 4, 1, 5], device="cuda"), torch.tensor([9, 2], device="cuda")]
    eager = Generator(model, max_batch=2, max_seq=24, cuda_graphs=False).generate(prompts, 8)
    graphed_gen = Generator(model, max_batch=2, max_seq=24, cuda_graphs=True)
    graphed = graphed_gen.generate(prompts, 8)
    assert graphed_gen._graphs, "no CUDA graph was captured"
    for a, b in zip(eager, graphed):
        assert torch.equal(a.cpu(), b.cpu())
