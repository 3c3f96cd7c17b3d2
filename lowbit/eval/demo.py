"""``lowbit demo``: the embedded model and every recipe side by side on one machine (CPU is enough).

For the FP32 model and then each recipe (on a fresh copy of the FP32 model): perplexity on the
first ``max_tokens`` tokens of the corpus (1024 by default, one window, so the demo stays near
3 minutes on 2 CPU cores where the recipes run their plain-PyTorch reference paths; ``lowbit eval``
scores 8192), weight bytes, KV-cache bytes per token, and a greedy answer (chat template, at most
``new_tokens`` tokens) to one fixed prompt. A recipe whose module has not landed, or that cannot
run on this device or model, shows as "not available: <reason>"; one that fails shows "failed:
<error>". The whole demo has a time budget (``budget_s``, counted from the start): a recipe that
would start after it is skipped, and one still scoring when it runs out is stopped between
perplexity windows; both rows name the command that runs the recipe alone.
"""
from __future__ import annotations

import copy
import gc
import json
import time
from dataclasses import asdict, dataclass, field

import torch

from lowbit.eval import pipeline

DEMO_PROMPT = "What is the capital of France? Answer in one sentence."
DEMO_MAX_TOKENS = 1024  # one 1024-token window: recipes' CPU reference paths are slow


@dataclass
class Row:
    name: str
    status: str = "ok"  # ok | not available: ... | failed: ... | skipped: ...
    perplexity: float | None = None
    tokens_scored: int | None = None
    weight_bytes: int | None = None
    kv_bytes_per_token: int | None = None
    answer: str | None = None
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def _measure(row: Row, model, tok, ids, *, max_tokens: int, window: int, prompt: str, new_tokens: int,
             gen_time: float, deadline: float | None = None) -> None:
    """Perplexity, memory and the answer of one model into ``row``. Past ``deadline`` no new
    perplexity window starts (TimeoutError) and generation stops early."""
    from lowbit.eval.perplexity import perplexity

    r = perplexity(model, ids, max_tokens=max_tokens, window=window, progress=True, deadline=deadline)
    row.perplexity, row.tokens_scored = r.perplexity, r.tokens_scored
    row.weight_bytes = pipeline.weight_bytes(model)
    row.kv_bytes_per_token = pipeline.kv_bytes_per_token(model)
    limit = gen_time if deadline is None else max(5.0, min(gen_time, deadline - time.perf_counter()))
    t0 = time.perf_counter()
    row.answer = pipeline.answer(model, tok, prompt, max_new_tokens=new_tokens, max_time=limit)
    if time.perf_counter() - t0 >= limit:
        row.answer += f" [stopped after {limit:.0f} s]"


def _takes_gptq(recipe: str) -> bool:
    """Whether the recipe has a ``gptq`` option (``fireq``, ``qserve``, the flute recipes)."""
    import inspect

    from lowbit import registry

    return "gptq" in inspect.signature(registry.get("recipe", recipe).load()).parameters


def run(*, model=None, recipes: list[str] | None = None, device: str = "cpu", dtype=torch.float32,
        max_tokens: int = DEMO_MAX_TOKENS, window: int = 1024, prompt: str = DEMO_PROMPT, new_tokens: int = 40,
        calib_samples: int = 8, calib_seq_len: int = 256, seed: int = 0, budget_s: float = 180.0,
        gen_time: float = 30.0, text_file=None, console=None, gptq: bool = False) -> list[Row]:
    """Run the demo and return its rows (the first is the unquantized model). ``gptq``: the recipes that take it
    (``fireq``, ``qserve``, the flute recipes) pick their codes by GPTQ (``lowbit.ptq.gptq``; ~1-2 minutes per recipe
    on a 2-core CPU: raise ``budget_s``)."""
    from lowbit import registry
    from lowbit.eval.corpus import load_text, tokenize

    t_start = time.perf_counter()
    say = console.log if console is not None else print
    recipes = [e.name for e in registry.entries("recipe")] if recipes is None else recipes
    for r in recipes:
        pipeline.check_recipe(r)

    t0 = time.perf_counter()
    say(f"loading {model or 'the embedded SmolLM2-135M-Instruct'} ({str(dtype).replace('torch.', '')}, {device})")
    loaded = pipeline.load(model, device=device, dtype=dtype)
    if loaded.quantized:
        raise ValueError("lowbit demo starts from an unquantized model (it applies each recipe itself); "
                         "use `lowbit eval DIR` / `lowbit generate DIR` for a saved quantized checkpoint")
    base, tok = loaded.model, loaded.tokenizer
    say(f"loaded in {time.perf_counter() - t0:.1f} s")
    ids = tokenize(tok, load_text(text_file))

    rows = []
    row = Row(str(dtype).replace("torch.", "") + " (unquantized)")
    t0 = time.perf_counter()
    _measure(row, base, tok, ids, max_tokens=max_tokens, window=window, prompt=prompt, new_tokens=new_tokens,
             gen_time=gen_time)
    row.seconds = time.perf_counter() - t0
    rows.append(row)
    say(f"{row.name}: perplexity {row.perplexity:.3f} ({row.seconds:.1f} s)")

    calib = None
    for name in recipes:
        row = Row(name)
        rows.append(row)
        why = pipeline.recipe_unavailable(name, device, base)
        if why:
            row.status = f"not available: {why}"
            say(f"{name}: {row.status}")
            continue
        deadline = t_start + budget_s
        if time.perf_counter() > deadline:
            row.status = f"skipped: demo time budget ({budget_s:.0f} s) spent; run `lowbit eval --recipe {name}`"
            say(f"{name}: {row.status}")
            continue
        t0 = time.perf_counter()
        say(f"{name}: quantizing" + (" (GPTQ codes)" if gptq and _takes_gptq(name) else ""))
        try:
            if calib is None:
                calib = pipeline.calibration(tok, n_samples=calib_samples, seq_len=calib_seq_len, seed=seed,
                                             text_file=text_file)
            extra = {"gptq": True} if gptq and _takes_gptq(name) else {}
            qmodel = pipeline.quantize(copy.deepcopy(base), name, calibration=calib, **extra)
            _measure(row, qmodel, tok, ids, max_tokens=max_tokens, window=window, prompt=prompt,
                     new_tokens=new_tokens, gen_time=gen_time, deadline=deadline)
        except NotImplementedError as exc:
            row.status = f"not available: {exc}"
        except TimeoutError as exc:
            row.status = (f"stopped: demo time budget ({budget_s:.0f} s) spent ({exc}); run "
                          f"`lowbit eval --recipe {name} --max-tokens {max_tokens}`")
        except Exception as exc:  # one recipe's failure must not stop the demo
            row.status = f"failed: {type(exc).__name__}: {exc}"
        finally:
            qmodel = None
            gc.collect()
        row.seconds = time.perf_counter() - t0
        say(f"{name}: {row.status if row.status != 'ok' else f'perplexity {row.perplexity:.3f}'} "
            f"({row.seconds:.1f} s)")
    return rows


def render(rows: list[Row], *, max_tokens: int, window: int, prompt: str, console=None,
           model_name: str = "SmolLM2-135M-Instruct") -> None:
    """The side-by-side table (rich; 120 columns when the output is not a terminal)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from lowbit.eval.perplexity import windowing

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=120)
    t = Table(title=f"lowbit demo: {model_name}, unquantized and each recipe", show_lines=True,
              caption=f"prompt: {prompt!r}")
    t.add_column("recipe", style="bold")
    t.add_column("perplexity", justify="right")
    t.add_column("weights", justify="right")
    t.add_column("KV cache / token", justify="right")
    t.add_column("time", justify="right")
    t.add_column("greedy answer", ratio=1)
    for r in rows:
        if r.status == "ok":
            t.add_row(r.name, f"{r.perplexity:.3f}", pipeline.human_bytes(r.weight_bytes),
                      pipeline.human_bytes(r.kv_bytes_per_token), f"{r.seconds:.0f} s", escape(r.answer or ""))
        else:  # answers and errors are text, never rich markup ("[stopped after 30 s]")
            t.add_row(r.name, "-", "-", "-", f"{r.seconds:.0f} s" if r.seconds else "-",
                      f"[dim]{escape(r.status)}[/dim]")
    console.print(t)
    scored = rows[0].tokens_scored if rows else None
    console.print(f"Perplexity: {windowing(max_tokens, window)}; {scored} tokens scored. The demo uses "
                  f"{max_tokens} tokens to stay fast; `lowbit eval` scores 8192 (FP32: 13.44). Answers: greedy, "
                  "chat template.")


def to_json(rows: list[Row], path, **settings) -> None:
    with open(path, "w") as f:
        json.dump({"settings": settings, "rows": [asdict(r) for r in rows]}, f, indent=1, default=str)
