"""``lowbit`` command line: demo, eval, quantize, generate, bench.

MODEL (every command) is 'smollm2' (the embedded SmolLM2-135M-Instruct, default), a local Hugging
Face model folder, a .gguf file, or (eval, generate) a folder written by ``lowbit quantize`` /
``lowbit.save_quantized``.

    lowbit demo                                   # FP32 + every recipe side by side (CPU is enough)
    lowbit eval --max-tokens 8192                 # FP32 perplexity of the embedded model: 13.44
    lowbit eval --recipe fireq                    # the same after quantizing with a recipe
    lowbit quantize --recipe fireq --out q/       # quantize once and save
    lowbit generate q/ --prompt "Why is the sky blue?"
    lowbit bench kernels --suite anchors          # GPU timing against the peers
"""
from __future__ import annotations

import argparse
import sys

EXIT_USAGE = 2


class CLIError(Exception):
    """An error whose message already says what to do; printed without a traceback."""


def _recipe_names() -> list[str]:
    from lowbit import registry

    return [e.name for e in registry.entries("recipe")]


def _parse_options(items: list[str] | None) -> dict:
    """``--option key=value`` pairs; values parsed as JSON when they can be (numbers, true/false)."""
    import json

    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CLIError(f"--option expects KEY=VALUE (e.g. --option group_size=64), got {item!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _console():
    from rich.console import Console

    return Console(stderr=True)


def _setup(args):
    """(device, dtype) from --device/--dtype; validates --recipe before anything slow."""
    from lowbit.eval import pipeline

    if getattr(args, "recipe", None):
        pipeline.check_recipe(args.recipe)
    args.options = _parse_options(getattr(args, "option", None))
    if args.options and not getattr(args, "recipe", None):  # (they were ignored)
        raise CLIError("--option sets a recipe option: it needs --recipe")
    device = pipeline.resolve_device(args.device)
    return device, pipeline.resolve_dtype(args.dtype, device)


def _load_and_quantize(args, device, dtype, console):
    """Load MODEL, then apply --recipe (with calibration) when given."""
    import time

    from lowbit.eval import pipeline

    t0 = time.perf_counter()
    with console.status(f"loading {args.model} ..."):
        loaded = pipeline.load(args.model, device=device, dtype=dtype)
    console.log(f"loaded {loaded.source} in {time.perf_counter() - t0:.1f} s"
                + (f" (quantized: {loaded.quantized})" if loaded.quantized else ""))
    recipe = getattr(args, "recipe", None)
    if recipe:
        if loaded.quantized:
            raise CLIError(f"{args.model} is already quantized ({loaded.quantized}); drop --recipe")
        why = pipeline.recipe_unavailable(recipe, device, loaded.model)
        if why:
            raise CLIError(f"recipe {recipe!r} is not available: {why}")
        t0 = time.perf_counter()
        calib = pipeline.calibration(loaded.tokenizer, n_samples=args.calib_samples, seq_len=args.calib_seq_len,
                                     seed=args.seed, text_file=args.calib_file)
        console.log(f"calibration: {len(calib)} x {args.calib_seq_len} tokens "
                    f"({args.calib_file or 'pydoc_data.topics, after the eval tokens'}, seed {args.seed})")
        loaded.model = pipeline.quantize(loaded.model, recipe, calibration=calib, **args.options)
        loaded.quantized = recipe
        console.log(f"quantized with {recipe} in {time.perf_counter() - t0:.1f} s")
    return loaded


# ---- commands ---------------------------------------------------------------------------------------

def _cmd_demo(args) -> int:
    from lowbit.eval import demo

    device, dtype = _setup(args)
    if args.max_tokens < 2:
        raise CLIError("--max-tokens must be >= 2")
    recipes = None
    if args.recipes is not None:
        recipes = [r for r in args.recipes.split(",") if r] if args.recipes != "none" else []
    console = _console()
    rows = demo.run(model=args.model, recipes=recipes, device=device, dtype=dtype, max_tokens=args.max_tokens,
                    window=args.window, prompt=args.prompt, new_tokens=args.new_tokens,
                    calib_samples=args.calib_samples, calib_seq_len=args.calib_seq_len, seed=args.seed,
                    budget_s=args.budget, gen_time=args.gen_seconds, text_file=args.text_file, console=console,
                    gptq=args.gptq)
    name = "SmolLM2-135M-Instruct" if args.model == "smollm2" else args.model
    demo.render(rows, max_tokens=args.max_tokens, window=args.window, prompt=args.prompt, model_name=name)
    if args.json:
        demo.to_json(rows, args.json, model=args.model, device=device, dtype=str(dtype), max_tokens=args.max_tokens,
                     window=args.window, prompt=args.prompt, new_tokens=args.new_tokens)
    return 0


def _cmd_eval(args) -> int:
    import json
    import time

    from lowbit.eval.corpus import describe_source, load_text, tokenize
    from lowbit.eval.perplexity import perplexity, windowing

    device, dtype = _setup(args)
    if args.max_tokens is not None and args.max_tokens < 2:
        raise CLIError("--max-tokens must be >= 2 (or 0 for the whole text)")
    max_tokens = args.max_tokens or None
    console = _console()
    text = load_text(args.text_file)  # fail on a bad --text-file before loading the model
    loaded = _load_and_quantize(args, device, dtype, console)
    ids = tokenize(loaded.tokenizer, text)
    console.log(f"text: {describe_source(args.text_file)}, {ids.numel()} tokens; scoring the "
                f"{windowing(max_tokens, args.window)}")
    t0 = time.perf_counter()
    r = perplexity(loaded.model, ids, max_tokens=max_tokens, window=args.window, progress=True)
    dt = time.perf_counter() - t0
    label = loaded.quantized or str(dtype).replace("torch.", "")
    print(f"{loaded.source} [{label}]: {r.describe()} in {dt:.1f} s")
    if args.json:
        doc = {"model": loaded.source, "recipe": loaded.quantized, "dtype": str(dtype), "device": device,
               "text": describe_source(args.text_file), "windowing": windowing(max_tokens, args.window),
               "seconds": dt, **r.as_dict()}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


def _cmd_quantize(args) -> int:
    import lowbit

    device, dtype = _setup(args)
    console = _console()
    loaded = _load_and_quantize(args, device, dtype, console)
    with console.status(f"saving to {args.out} ..."):
        try:
            lowbit.save_quantized(loaded.model, args.out)
        except ImportError as exc:
            raise CLIError(f"saving checkpoints is not available in this build yet ({exc})") from exc
        try:
            loaded.tokenizer.save_pretrained(args.out)
        except Exception as exc:  # the checkpoint is still usable with the source model's tokenizer
            console.log(f"note: could not save the tokenizer beside the checkpoint ({exc})")
    console.log(f"saved {args.recipe} checkpoint to {args.out}; try `lowbit eval {args.out}` or "
                f"`lowbit generate {args.out} --prompt ...`")
    return 0


def _cmd_generate(args) -> int:
    from lowbit.eval import pipeline

    device, dtype = _setup(args)
    if args.max_new_tokens < 1:
        raise CLIError("--max-new-tokens must be >= 1")
    console = _console()
    loaded = _load_and_quantize(args, device, dtype, console)
    streamer = None
    if not args.no_stream:
        from transformers import TextStreamer

        streamer = TextStreamer(loaded.tokenizer, skip_prompt=True, skip_special_tokens=True)
    text = pipeline.answer(loaded.model, loaded.tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
                           chat=not args.no_chat, streamer=streamer)
    if streamer is None:
        print(text)
    return 0


def _cmd_bench(args) -> int:
    if args.what == "kernels":
        from lowbit.bench import runner, suites

        names = args.suite or ["anchors"]
        if names == ["all"]:
            names = suites.available()
        return runner.run_suites(names, args.out, quick=args.quick)
    if args.what == "model":
        from lowbit.bench import model as bench_model

        return bench_model.main(args)
    return 2


# ---- parser -----------------------------------------------------------------------------------------

def _model_args(p, *, checkpoint: bool) -> None:
    extra = ", or a folder written by `lowbit quantize`" if checkpoint else ""
    p.add_argument("model", nargs="?", default="smollm2",
                   help=f"'smollm2' (embedded SmolLM2-135M-Instruct; default), a local HF model folder, a .gguf file{extra}")
    p.add_argument("--device", default="auto", help="auto (cuda if present, else cpu), cpu, cuda[:N]")
    p.add_argument("--dtype", default="auto", help="auto (float32 on cpu, bfloat16 on cuda), float32, bfloat16, float16")


def _recipe_args(p, *, required: bool) -> None:
    names = ", ".join(_recipe_names())
    p.add_argument("--recipe", required=required, default=None,
                   help=f"quantize the model with this recipe first: {names}")
    p.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="recipe option (repeatable), e.g. --option group_size=64")
    p.add_argument("--calib-samples", type=int, default=16, help="calibration windows (default 16)")
    p.add_argument("--calib-seq-len", type=int, default=512, help="tokens per calibration window (default 512)")
    p.add_argument("--calib-file", default=None, help="calibrate on this text file (default: the embedded corpus)")
    p.add_argument("--seed", type=int, default=0, help="calibration sampling seed (default 0)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowbit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    from lowbit import __version__

    p.add_argument("--version", action="version", version=f"lowbit {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", help="the embedded model and every recipe side by side (CPU is enough)",
                       description="Load the embedded SmolLM2-135M-Instruct, report its perplexity and a greedy "
                                   "answer to a fixed chat prompt, then the same for every recipe (weights and "
                                   "KV-cache bytes too). Recipes not built yet show as 'not available'.")
    _model_args(d, checkpoint=False)
    d.add_argument("--recipes", default=None,
                   help="comma-separated recipes to show (default: all; 'none' for the FP32 model only)")
    d.add_argument("--max-tokens", type=int, default=1024,
                   help="tokens of the corpus scored for perplexity (default 1024 = one window, to stay fast on "
                        "the CPU; eval uses 8192)")
    d.add_argument("--window", type=int, default=1024, help="perplexity window (default 1024)")
    d.add_argument("--prompt", default=None, help="chat prompt (default: a fixed question)")
    d.add_argument("--new-tokens", type=int, default=40, help="greedy tokens to generate (default 40)")
    d.add_argument("--text-file", default=None, help="score this text file instead of the embedded corpus")
    d.add_argument("--calib-samples", type=int, default=8, help="calibration windows per recipe (default 8)")
    d.add_argument("--calib-seq-len", type=int, default=256, help="tokens per calibration window (default 256)")
    d.add_argument("--seed", type=int, default=0, help="calibration seed (default 0)")
    d.add_argument("--budget", type=float, default=180.0,
                   help="time budget in seconds from the start: later recipes are skipped, a running one is "
                        "stopped between perplexity windows (default 180)")
    d.add_argument("--gen-seconds", type=float, default=30.0,
                   help="stop each answer after this many seconds (slow CPU reference paths; default 30)")
    d.add_argument("--gptq", action="store_true",
                   help="GPTQ codes for fireq / qserve / flute-nf4 / flute-nf3 (slower: raise --budget, e.g. 900)")
    d.add_argument("--json", default=None, help="also write the rows to this JSON file")
    d.set_defaults(func=_cmd_demo)

    e = sub.add_parser("eval", help="perplexity of a model (optionally quantized with --recipe)",
                       description="Perplexity on the embedded corpus (the CPython documentation topics of "
                                   "pydoc_data.topics) or --text-file: the first --max-tokens tokens in "
                                   "non-overlapping --window-token windows, each scored with HF labels=input_ids "
                                   "loss, averaged weighted by window length - 1. FP32 SmolLM2 with the defaults: 13.44.")
    _model_args(e, checkpoint=True)
    _recipe_args(e, required=False)
    e.add_argument("--text-file", default=None, help="score this UTF-8 text file instead of the embedded corpus")
    e.add_argument("--max-tokens", type=int, default=8192, help="tokens scored (default 8192; 0 = the whole text)")
    e.add_argument("--window", type=int, default=1024, help="window length in tokens (default 1024)")
    e.add_argument("--json", default=None, help="also write the result to this JSON file")
    e.set_defaults(func=_cmd_eval)

    q = sub.add_parser("quantize", help="quantize a model with a recipe and save it",
                       description="Quantize MODEL with --recipe (calibrating on the embedded corpus or "
                                   "--calib-file) and save safetensors + JSON metadata to --out.")
    _model_args(q, checkpoint=False)
    _recipe_args(q, required=True)
    q.add_argument("--out", required=True, help="output folder")
    q.set_defaults(func=_cmd_quantize)

    g = sub.add_parser("generate", help="answer a prompt greedily (optionally quantized with --recipe)",
                       description="Greedy generation through the tokenizer's chat template (--no-chat for raw text).")
    _model_args(g, checkpoint=True)
    _recipe_args(g, required=False)
    g.add_argument("--prompt", required=True, help="the user message")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--no-chat", action="store_true", help="feed the prompt as raw text, without the chat template")
    g.add_argument("--no-stream", action="store_true", help="print the answer at the end instead of streaming it")
    g.set_defaults(func=_cmd_generate)

    b = sub.add_parser("bench", help="time lowbit's kernels and the peers side by side (GPU)")
    b.add_argument("what", choices=["kernels", "model"], help="kernel suites or whole-model throughput")
    b.add_argument("--suite", action="append", help="suite name (repeatable; 'all' for every suite)")
    b.add_argument("--out", default=None, help="output folder (default benchmarks/results/<gpu>)")
    b.add_argument("--quick", action="store_true", help="fewer shapes")
    b.add_argument("--layers", type=int, default=None,
                   help="bench model: decoder layers of the Llama-3-8B-shaped model (default: all 32 where the bf16 "
                        "weights and the largest KV cache fit the GPU, else 2 scaled to 32 with a head-only step)")
    b.add_argument("--arch", default="llama3-8b", choices=["llama3-8b", "qwen3-8b", "mixtral-8x7b", "qwen3-30b-a3b"],
                   help="bench model: the shapes of the random model (default llama3-8b; qwen3-8b: 36 layers, "
                        "per-head q/k norms; mixtral-8x7b: 8 experts top-2; qwen3-30b-a3b: 128 experts top-8)")
    b.set_defaults(func=_cmd_bench)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "prompt", "x") is None and args.command == "demo":
        from lowbit.eval.demo import DEMO_PROMPT

        args.prompt = DEMO_PROMPT
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"lowbit {args.command}: interrupted", file=sys.stderr)
        return 130
    except (CLIError, ValueError, FileNotFoundError, TypeError, NotImplementedError) as exc:
        print(f"lowbit {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
