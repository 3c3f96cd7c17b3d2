"""FireQ Table 3 on the embedded model: perplexity as each FireQ piece is added, plus the other
recipes for comparison.

Rows (FireQ Table 3's layout; each is one ``quantize_model`` call on a fresh copy of the float
model, calibration = the embedded corpus with seed 0, 16 windows of 512 tokens):

========================  =========================================================================
FP32                      the float model as loaded
BF16                      the float model cast to bf16 (the activation dtype of every row below)
W4A8 (linears only)       ``fireq(kv=None, attention=None, cas=False, pts=False)``
+ KV4 post-RoPE           ``+ kv='kv4', attention='fp8-kv4'``, no RPN / CRS
+ RPN                     ``rpn=True``
+ CRS                     ``crs=True`` (RPN off)
+ RPN + CRS
+ CAS                     ``+ cas=True``
+ PTS (full FireQ)        ``+ pts=True`` = ``fireq`` defaults
qserve / flute-nf4 / ...  the other recipes with their defaults
========================  =========================================================================

Perplexity: ``lowbit.eval.perplexity.perplexity`` on the first 8192 tokens of the embedded corpus
(window 1024), the setting of ``lowbit eval``. With KV4 the prefill attention itself reads the
INT4 K/V (scheme ``fp8-kv4``), which is how a KV-quantized model sees its cache; FireQ App. D
prefills with FP8 K/V instead, so the KV4 rows here are the stricter reading.
"""
from __future__ import annotations

import copy
import json
import time
import traceback
from pathlib import Path

import torch

_W4 = dict(kv=None, attention=None, cas=False, pts=False, rpn=False, crs=False)
_KV = dict(kv="kv4", attention="fp8-kv4", cas=False, pts=False)

ROWS = [
    ("FP32", None, {}),
    ("BF16", None, {}),
    ("W4A8 (linears only)", "fireq", _W4),
    ("+ KV4 post-RoPE", "fireq", dict(_KV, rpn=False, crs=False)),
    ("+ RPN", "fireq", dict(_KV, rpn=True, crs=False)),
    ("+ CRS", "fireq", dict(_KV, rpn=False, crs=True)),
    ("+ RPN + CRS", "fireq", dict(_KV, rpn=True, crs=True)),
    ("+ CAS", "fireq", dict(_KV, rpn=True, crs=True, cas=True)),
    ("+ PTS (full FireQ)", "fireq", {}),
    ("qserve", "qserve", {}),
    ("flute-nf4", "flute-nf4", {}),
    ("flute-nf3", "flute-nf3", {}),
    ("int8-attention", "int8-attention", {}),
]


def run_ablation(model, tokenizer, *, rows=ROWS, max_tokens: int = 8192, dtype=torch.bfloat16,
                 time_budget_s: float | None = None, progress: bool = False) -> list[dict]:
    """Perplexity of every row (see module docstring). ``model`` is the float model (not
    modified). Returns one dict per row: label, recipe, options, perplexity or the error."""
    import lowbit
    from lowbit.eval.corpus import load_text, tokenize
    from lowbit.eval.perplexity import perplexity

    ids = tokenize(tokenizer, load_text())
    t_end = None if time_budget_s is None else time.time() + time_budget_s
    out = []
    for label, recipe, opts in rows:
        row = {"label": label, "recipe": recipe, "options": {k: v for k, v in opts.items()}}
        if t_end is not None and time.time() > t_end:
            row["skipped"] = "time budget"
            out.append(row)
            continue
        t0 = time.time()
        try:
            m = copy.deepcopy(model)
            if label != "FP32":
                m = m.to(dtype)
            if recipe is not None:
                m = lowbit.quantize_model(m, recipe, tokenizer=tokenizer, progress=progress, **opts)
            r = perplexity(m, ids, max_tokens=max_tokens)
            row.update(perplexity=r.perplexity, tokens_scored=r.tokens_scored)
        except NotImplementedError as exc:
            row["skipped"] = str(exc)
        except Exception as exc:
            traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        row["seconds"] = round(time.time() - t0, 2)
        print(f"ablation {label}: {row.get('perplexity', row.get('skipped', row.get('error')))}", flush=True)
        out.append(row)
        m = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    base = next((r["perplexity"] for r in out if r["label"] == "FP32" and "perplexity" in r), None)
    for r in out:
        if base is not None and "perplexity" in r:
            r["gap_to_fp32"] = r["perplexity"] - base
    return out


def to_markdown(rows: list[dict]) -> str:
    lines = ["| configuration | perplexity | gap to FP32 |", "|---|---|---|"]
    for r in rows:
        if "perplexity" in r:
            lines.append(f"| {r['label']} | {r['perplexity']:.3f} | {r.get('gap_to_fp32', float('nan')):+.3f} |")
        else:
            lines.append(f"| {r['label']} | {'skipped' if 'skipped' in r else 'error'} | "
                         f"{(r.get('skipped') or r.get('error', ''))[:80]} |")
    return "\n".join(lines) + "\n"


def script(out_dir, *, device: str = "cuda", time_budget_s: float | None = None, model=None, tokenizer=None) -> list:
    """Script entry (no CLI): load the embedded model on ``device``, run every row, write
    ``ablation.json`` and ``ablation.md`` into ``out_dir``."""
    from lowbit.models.loading import load_model

    t0 = time.time()
    if model is None:
        model, tokenizer = load_model(None, device=device)
    load_s = time.time() - t0
    budget = None if time_budget_s is None else max(0.0, time_budget_s - load_s)
    rows = run_ablation(model, tokenizer, time_budget_s=budget)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"what": "FireQ Table 3 layout on the embedded SmolLM2-135M-Instruct, perplexity of the first 8192 "
                   "tokens of the embedded corpus (window 1024); quantized rows run with bf16 activations",
           "device": torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else device,
           "model_load_s": round(load_s, 1), "rows": rows}
    (out / "ablation.json").write_text(json.dumps(doc, indent=1))
    (out / "ablation.md").write_text(to_markdown(rows))
    print(to_markdown(rows), flush=True)
    return rows
