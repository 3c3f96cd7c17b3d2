"""CPU-testable parts of the benchmark harness: rotated-input sizing (fake L2), FLOP helpers,
Recorder rows and rooflines, JSON/Markdown output."""
from __future__ import annotations

import json
import math

import pytest
import torch

from lowbit.bench import harness


def test_flop_helpers():
    assert harness.gemm_flops(16, 4096, 4096) == 2.0 * 16 * 4096 * 4096
    full = harness.attention_flops(2, 32, 1024, 1024, 128, causal=False)
    assert full == 4.0 * 2 * 32 * 1024 * 1024 * 128
    assert harness.attention_flops(2, 32, 1024, 1024, 128, causal=True) == full / 2


def test_geomean():
    assert harness.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert harness.geomean([4.0, None, 0.0, 4.0]) == pytest.approx(4.0)  # missing / zero ignored
    assert math.isnan(harness.geomean([]))


def test_nbytes_nested():
    t = torch.zeros(10, dtype=torch.float16)
    assert harness._nbytes((t, [t, {"a": t}], 3)) == 60


def test_rotating_inputs_exceed_twice_l2(monkeypatch):
    monkeypatch.setattr(harness, "l2_bytes", lambda: 1000)
    made = []

    def make():
        made.append(1)
        return (torch.zeros(100, dtype=torch.float32),)  # 400 B per set

    sets = harness.rotating_inputs(make)
    total = sum(harness._nbytes(s) for s in sets)
    assert total > 2000 and total - 400 <= 2000  # stops at the first set past 2x L2
    assert len(sets) == 6 and len(made) == 6


def test_rotating_inputs_min_and_max_sets(monkeypatch):
    monkeypatch.setattr(harness, "l2_bytes", lambda: 1)
    big = harness.rotating_inputs(lambda: (torch.zeros(1000),))
    assert len(big) == 3  # at least 3 sets even when one set exceeds L2
    monkeypatch.setattr(harness, "l2_bytes", lambda: 1 << 40)
    capped = harness.rotating_inputs(lambda: (torch.zeros(1),), max_sets=7)
    assert len(capped) == 7
    explicit = harness.rotating_inputs(lambda: (torch.zeros(10),), min_total_bytes=200)  # 40 B per set
    assert len(explicit) == 6


def test_sets_are_fresh_objects():
    sets = harness.rotating_inputs(lambda: (torch.randn(4),), min_total_bytes=0)
    assert len({id(s[0]) for s in sets}) == len(sets)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_time_cuda_needs_gpu():
    with pytest.raises(RuntimeError, match="CUDA"):
        harness.time_cuda(lambda: None, [()])


def _timing(ms):
    return {"median_ms": ms, "min_ms": ms * 0.9, "max_ms": ms * 1.2, "reps": 100, "input_sets": 3}


def test_recorder_rows_and_rooflines():
    rec = harness.Recorder("unit", ceilings={"bf16_TFLOPs": 800.0, "fp8_TFLOPs": 1600.0, "hbm_TBps": 4.0,
                                               "int8_TOPs": 1500.0})
    flops, nbytes = 2e12, 4e9
    row = rec.record({"M": 16}, "lowbit", _timing(2.0), flops=flops, bytes_moved=nbytes, peak="fp8")
    assert row["TFLOPs"] == pytest.approx(1000.0)
    assert row["TBps"] == pytest.approx(2.0)
    # roofline = max(2e12 / 1.6e15, 4e9 / 4e12) s = max(1.25, 1.0) ms
    assert row["roofline_ms"] == pytest.approx(1.25)
    assert row["frac_roofline"] == pytest.approx(1.25 / 2.0)
    mem = rec.record({"M": 1}, "lowbit", _timing(2.0), bytes_moved=nbytes)
    assert mem["roofline_ms"] == pytest.approx(1.0) and "TFLOPs" not in mem
    i8 = rec.record({"M": 2}, "int8", _timing(1.0), flops=3e12, peak="int8")
    assert i8["roofline_ms"] == pytest.approx(2.0)
    skipped = rec.record({"M": 16}, "bnb", None, note="bitsandbytes missing")
    assert skipped == {"case": {"M": 16}, "provider": "bnb", "skipped": "bitsandbytes missing"}
    plain = rec.record({"M": 4}, "x", _timing(1.0), error=0.01, note="n")
    assert "roofline_ms" not in plain and plain["error"] == 0.01 and plain["note"] == "n"


def test_recorder_writes_json_and_markdown(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "plot", lambda *a, **k: None)  # matplotlib is slow to import
    rec = harness.Recorder("unit", ceilings={"bf16_TFLOPs": 800.0})
    rec.record({"M": 16, "N": 4096}, "cublas", _timing(2.0), flops=2e12, peak="bf16")
    rec.record({"M": 16, "N": 4096}, "lowbit", _timing(1.0), flops=2e12, peak="bf16")
    rec.record({"M": 16, "N": 4096}, "bnb", None, note="missing")
    rec.note("a note")
    path = rec.write(tmp_path, baseline="cublas", command="lowbit bench kernels --suite unit")
    doc = json.loads(path.read_text())
    assert doc["suite"] == "unit" and len(doc["rows"]) == 3 and doc["notes"] == ["a note"]
    assert doc["env"]["command"] == "lowbit bench kernels --suite unit"
    assert {"torch", "python", "date", "triton"} <= set(doc["env"])
    assert "warm-up" in doc["method"] and "L2" in doc["method"]
    md = (tmp_path / "unit.md").read_text()
    assert "| case | cublas | lowbit | bnb |" in md
    assert "| M=16 N=4096 | 2.0000 (1000 TF/s) | 1.0000 (2000 TF/s) **2.00x** | skip |" in md
    assert "Ceilings measured in this run: bf16_TFLOPs 800.00" in md and "- a note" in md


def test_plot_failure_never_loses_numbers(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no display")

    monkeypatch.setattr(harness, "plot", broken)
    rec = harness.Recorder("p")
    rec.record({"M": 1}, "a", _timing(1.0))
    path = rec.write(tmp_path)
    assert path.exists() and (tmp_path / "p.md").exists()


def test_env_and_slug_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    assert harness.gpu_slug() == "cpu"
    assert harness.l2_bytes() == 50 << 20
    info = harness.env_info("cmd")
    assert info["command"] == "cmd" and "gpu" not in info


def test_model_bench_provider_tokens():
    """Provider names of the model benchmark: '+'-tokens map to quantization options, runner options
    and kernel flags; unknown tokens are refused by name."""
    from lowbit.bench.model import provider_spec

    assert provider_spec("qserve+rows") == ("qserve", {"linear_options": {"tiled": False}}, {}, [])
    assert provider_spec("qserve+head") == ("qserve", {"lm_head": True}, {}, [])
    assert provider_spec("flute-nf4+kv4") == ("flute-nf4", {"kv": "kv4"}, {}, [])
    r, q, g, f = provider_spec("fireq+noadd+dp4a0")
    assert (r, q, g) == ("fireq", {}, {"fused_add": False}) and f[0][1] == "DP4A_M1_MAX_N"
    with pytest.raises(ValueError, match="bogus"):
        provider_spec("fireq+bogus")


def test_model_bench_layers_auto():
    """``auto_layers``: all 32 layers where the bf16 model + the run's largest KV cache (+20 %) fit the free memory
    (an H200 for the default shapes), else 2 (scaled to 32); the ``+attn3`` token sets the runner's flag."""
    from lowbit.bench.model import auto_layers, provider_spec

    default = dict(decode_batches=[1, 16, 64], decode_ctx=[1024, 2048, 4096, 8192], prefill_seqs=[1024, 2048, 4096])
    assert auto_layers(**default, free_bytes=140 * 10 ** 9) == 32
    assert auto_layers(**default, free_bytes=79 * 10 ** 9) == 2
    assert auto_layers([1, 64], [1024], [1024], free_bytes=79 * 10 ** 9) == 32
    assert auto_layers(**default, free_bytes=140 * 10 ** 9, arch="qwen3-8b") == 36
    assert auto_layers(**default, free_bytes=79 * 10 ** 9, arch="qwen3-8b") == 2
    assert provider_spec("flute-nf4+attn3")[3] == [("lowbit.models.generate", "FUSED_FLOAT_DECODE", False)]


def test_model_bench_archs_count_bytes():
    """The two model shapes' bf16 weights and KV bytes per token, counted from their configs."""
    from lowbit.bench.model import ARCHS

    llama, qwen = ARCHS["llama3-8b"], ARCHS["qwen3-8b"]
    assert abs(llama.bf16_bytes() - 16.06e9) < 0.01e9 and llama.kv_bytes_per_token() == 131072
    assert abs(qwen.bf16_bytes() - 16.38e9) < 0.01e9 and qwen.kv_bytes_per_token() == 147456
    mixtral = ARCHS["mixtral-8x7b"]  # 46.7 B parameters
    assert abs(mixtral.bf16_bytes() - 93.4e9) < 0.1e9 and mixtral.kv_bytes_per_token() == 131072
    q30 = ARCHS["qwen3-30b-a3b"]  # 30.5 B parameters: 128 experts of 3 x 2048 x 768 in 48 layers
    assert abs(q30.bf16_bytes() - 61.0e9) < 0.3e9 and q30.kv_bytes_per_token() == 48 * 2 * 4 * 128 * 2
    assert qwen.model_type == "qwen3" and qwen.layers == 36


def test_sass_summary_counts_the_longest_loop():
    """``sass_summary`` reads triton.tools.disasm's text: loops are backward branches longer than ``min_loop``,
    their length is the instructions per iteration, and the longest one's opcodes are counted (predicates dropped)."""
    from lowbit.bench.harness import sass_summary

    body = ["--:-:-:-:1\tFFMA R1, R2, R3, R4;"] * 5 + ["--:-:-:-:1\t@P0 MUFU.EX2 R5, R6;"] * 2
    sass = "\n".join(["Function:k", "--:-:-:-:1\tMOV R0, RZ;", "LBB0:", *body, "--:-:-:-:5\t@P1 BRA LBB0;",
                      "--:-:-:-:1\tEXIT;"])
    r = sass_summary(sass, min_loop=3)
    assert r["sass_total"] == 10 and r["sass_loops"] == [8]
    assert r["loop_ops"] == {"FFMA": 5, "MUFU": 2, "BRA": 1}
    assert sass_summary(sass)["sass_loops"] == []  # shorter than the default 100
