"""CLI fast paths, in-process through ``lowbit.cli.main(argv)``: help, argument errors with messages
that say what to do, and eval / generate / demo end to end on a tiny HF folder (no download)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests._tiny_models import tiny_hf_folder, tiny_text
from lowbit import cli

COMMANDS = ["demo", "eval", "quantize", "generate", "bench"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_hf_folder(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def text_file(tmp_path):
    f = tmp_path / "text.txt"
    f.write_text(tiny_text(600))
    return f


def run(argv, capsys):
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_top_level_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for c in COMMANDS:
        assert c in out


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_for_each_command(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([cmd, "--help"])
    assert e.value.code == 0
    assert f"usage: lowbit {cmd}" in capsys.readouterr().out


def test_eval_help_documents_windowing_and_recipes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["eval", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "overlapping" in out and "13.44" in out and "fireq" in out and "--max-tokens" in out


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


def test_quantize_requires_recipe_and_out(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["quantize"])
    assert e.value.code == 2
    assert "--recipe" in capsys.readouterr().err


def test_bad_integer_argument(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "--max-tokens", "many"])
    assert e.value.code == 2
    assert "invalid int value" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", ["eval", "generate", "quantize"])
def test_unknown_recipe_names_the_known_ones(cmd, capsys):
    argv = [cmd, "--recipe", "fireq2"] + (["--prompt", "hi"] if cmd == "generate" else []) \
        + (["--out", "x"] if cmd == "quantize" else [])
    rc, out, err = run(argv, capsys)
    assert rc == 2
    assert "unknown recipe 'fireq2'" in err and "fireq" in err and "qserve" in err


def test_demo_unknown_recipe(capsys):
    rc, _, err = run(["demo", "--recipes", "fireq,nope"], capsys)
    assert rc == 2 and "unknown recipe 'nope'" in err


def test_missing_model_path_says_what_to_pass(tmp_path, capsys):
    rc, _, err = run(["eval", str(tmp_path / "nope")], capsys)
    assert rc == 2 and "neither a local HF model directory nor a .gguf file" in err and "smollm2" in err


def test_missing_text_file(tmp_path, capsys):
    rc, _, err = run(["eval", "--text-file", str(tmp_path / "none.txt")], capsys)
    assert rc == 2 and "does not exist" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu(capsys):
    rc, _, err = run(["eval", "--device", "cuda"], capsys)
    assert rc == 2 and "use --device cpu" in err


def test_bad_option_syntax(tiny_dir, capsys):
    rc, _, err = run(["eval", str(tiny_dir), "--recipe", "flute-nf4", "--option", "group_size"], capsys)
    assert rc == 2 and "KEY=VALUE" in err


def test_parse_options_types():
    assert cli._parse_options(["group_size=64", "pts=false", "table=nf", "alpha=0.5"]) == {
        "group_size": 64, "pts": False, "table": "nf", "alpha": 0.5}


def test_max_tokens_too_small(capsys):
    rc, _, err = run(["eval", "--max-tokens", "1"], capsys)
    assert rc == 2 and "--max-tokens" in err


# ---- end to end on the tiny folder ---------------------------------------------------------------------

def test_eval_tiny_folder(tiny_dir, text_file, tmp_path, capsys):
    js = tmp_path / "r.json"
    rc, out, err = run(["eval", str(tiny_dir), "--text-file", str(text_file), "--max-tokens", "300",
                        "--window", "128", "--json", str(js)], capsys)
    assert rc == 0, err
    assert "perplexity" in out and "scored tokens" in out
    doc = json.loads(js.read_text())
    assert doc["tokens_scored"] == 127 + 127 + 43 and doc["windows"] == 3 and doc["window"] == 128
    assert doc["perplexity"] > 1 and "non-overlapping" in doc["windowing"]


def test_generate_tiny_folder(tiny_dir, capsys):
    rc, out, err = run(["generate", str(tiny_dir), "--prompt", "the python class", "--max-new-tokens", "4",
                        "--no-stream"], capsys)
    assert rc == 0, err


def test_demo_tiny_folder_fp32_only(tiny_dir, text_file, tmp_path, capsys):
    js = tmp_path / "demo.json"
    rc, out, err = run(["demo", str(tiny_dir), "--device", "cpu", "--recipes", "none", "--text-file", str(text_file),
                        "--max-tokens", "200", "--new-tokens", "3", "--json", str(js)], capsys)
    assert rc == 0, err
    flat = " ".join(out.split())
    assert "float32 (unquantized)" in flat and "first 200 tokens" in flat
    rows = json.loads(js.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["status"] == "ok" and rows[0]["tokens_scored"] == 199


def test_demo_side_by_side(tiny_dir, text_file, tmp_path, capsys):
    """fp8-mla on a Llama model is 'not available' with its reason, without running anything; a
    recipe that runs (or fails: another area's bug) still gets its row, and the demo exits 0."""
    js = tmp_path / "demo.json"
    rc, out, err = run(["demo", str(tiny_dir), "--device", "cpu", "--recipes", "fp8-mla,flute-nf4",
                        "--text-file", str(text_file),
                        "--max-tokens", "64", "--new-tokens", "2", "--json", str(js)], capsys)
    assert rc == 0, err
    rows = {r["name"]: r for r in json.loads(js.read_text())["rows"]}
    assert rows["fp8-mla"]["status"].startswith("not available: needs a DeepSeek MLA model")
    nf4 = rows["flute-nf4"]
    assert nf4["status"] == "ok" or nf4["status"].startswith(("failed:", "not available:"))
    if nf4["status"] == "ok":
        assert nf4["weight_bytes"] < rows["float32 (unquantized)"]["weight_bytes"]
    flat = " ".join(out.split())
    assert "fp8-mla" in flat and "not available" in flat and "flute-nf4" in flat


def test_demo_gptq(tiny_dir, text_file, tmp_path, capsys):
    """``--gptq``: the recipes that take it quantize with GPTQ (the recorded options say so); others run as before."""
    js = tmp_path / "demo.json"
    rc, out, err = run(["demo", str(tiny_dir), "--device", "cpu", "--recipes", "flute-nf4,int8-attention", "--gptq",
                        "--text-file", str(text_file), "--max-tokens", "64", "--new-tokens", "2", "--json", str(js)],
                       capsys)
    assert rc == 0, err
    rows = {r["name"]: r for r in json.loads(js.read_text())["rows"]}
    assert rows["flute-nf4"]["status"] == "ok" and rows["int8-attention"]["status"] == "ok"


def test_import_lowbit_is_light():
    """``import lowbit`` (and building the CLI parser) must not import transformers."""
    code = ("import sys, lowbit, lowbit.cli; lowbit.cli.build_parser(); "
            "print(sorted(m for m in ('transformers', 'matplotlib', 'rich') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_quantize_then_eval_and_generate_the_checkpoint(tiny_dir, text_file, tmp_path, capsys):
    """`lowbit quantize` writes a checkpoint that `lowbit eval DIR` / `lowbit generate DIR` detect
    (lowbit.json) and load; the perplexity equals the in-memory quantized model's."""
    from lowbit.eval import pipeline

    why = pipeline.recipe_unavailable("flute-nf4", "cpu")
    if why:
        pytest.skip(f"flute-nf4 not available: {why}")
    out_dir = tmp_path / "q"
    common = ["--text-file", str(text_file), "--max-tokens", "200"]
    rc, _, err = run(["quantize", str(tiny_dir), "--recipe", "flute-nf4", "--out", str(out_dir),
                      "--calib-file", str(text_file), "--calib-samples", "2", "--calib-seq-len", "16"], capsys)
    assert rc == 0, err
    assert (out_dir / "lowbit.json").is_file()
    j1, j2 = tmp_path / "a.json", tmp_path / "b.json"
    rc, out, err = run(["eval", str(out_dir), "--json", str(j1)] + common, capsys)
    assert rc == 0, err
    rc, _, err = run(["eval", str(tiny_dir), "--recipe", "flute-nf4", "--calib-file", str(text_file),
                      "--json", str(j2)] + common, capsys)
    assert rc == 0, err
    a, b = json.loads(j1.read_text()), json.loads(j2.read_text())
    assert a["recipe"] == b["recipe"] == "flute-nf4"
    assert a["perplexity"] == pytest.approx(b["perplexity"], rel=1e-5)
    rc, _, err = run(["generate", str(out_dir), "--prompt", "the class", "--max-new-tokens", "3", "--no-stream"],
                     capsys)
    assert rc == 0, err
    rc, _, err = run(["eval", str(out_dir), "--recipe", "fireq"], capsys)
    assert rc == 2 and "already quantized" in err and "drop --recipe" in err


def test_demo_time_budget_skips_recipes(tiny_dir, text_file, tmp_path, capsys):
    js = tmp_path / "demo.json"
    rc, out, err = run(["demo", str(tiny_dir), "--recipes", "flute-nf4", "--text-file", str(text_file),
                        "--max-tokens", "32", "--new-tokens", "2", "--budget", "0", "--json", str(js)], capsys)
    assert rc == 0, err
    rows = json.loads(js.read_text())["rows"]
    assert rows[0]["status"] == "ok"  # the unquantized row is always measured
    assert rows[1]["status"].startswith(("skipped: demo time budget", "not available"))
    if rows[1]["status"].startswith("skipped"):
        assert "lowbit eval --recipe flute-nf4" in rows[1]["status"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
@pytest.mark.parametrize("what", ["kernels", "model"])
def test_bench_without_gpu_says_so(what, capsys):
    rc, _, err = run(["bench", what, "--quick"], capsys)
    assert rc == 2 and "needs a CUDA GPU" in err


def test_demo_table_prints_answers_verbatim(capsys):
    """Answers and errors may contain brackets: they must print as text, not as rich markup."""
    from lowbit.eval import demo

    rows = [demo.Row("float32 (unquantized)", perplexity=12.7, tokens_scored=1023, weight_bytes=1 << 20,
                     kv_bytes_per_token=46080, answer="Paris [stopped after 30 s]", seconds=3.0),
            demo.Row("fireq", status="failed: ValueError: bad [bold]x[/bold]")]
    demo.render(rows, max_tokens=1024, window=1024, prompt="Q?")
    flat = " ".join(capsys.readouterr().out.split())
    assert "[stopped after 30 s]" in flat and "[bold]x[/bold]" in flat and "45.0 KiB" in flat
