"""``lowbit bench model``: whole-model throughput of a Llama-3-8B-shaped model (FireQ Table 1).

The model is ``LlamaConfig`` with Llama-3-8B's shapes (hidden 4096, MLP 14336, 32 query / 8 KV
heads of 128, vocab 128256, RoPE theta 500000) and random bf16 weights (no download); ``arch='qwen3-8b'``
(``--arch``, session 37) builds ``Qwen3Config`` with Qwen3-8B's shapes instead (36 layers, MLP 12288,
vocab 151936, per-head q/k norms; ``ARCHS``). Where the bf16 model and the run's largest KV cache fit
the GPU (``auto_layers``: an H200 for both) all decoder layers (32 / 36) are built and timed as they
are (session 27). Otherwise it is built with ``layers`` decoder layers (2) and every number is scaled
to the real N layers with a second measurement of the same step with no decoder layer (embedding +
final norm + ``lm_head``)::

    t_N = t_head + (N / layers) * (t_layers - t_head)

(decoder layers are identical in cost, so this is exact up to timing noise, but the head-only step's
noise is multiplied by 16: session 26's batch-1 estimates spread 2.46-2.55x from raw steps within 1 %;
the JSON keeps both raw times). Each row says how it was measured.

Providers, side by side in one process and on one GPU:

- ``bf16``: the transformers modules in bf16 with SDPA attention, run by
  ``lowbit.models.generate.Generator`` (prefill eager, decode under CUDA graphs over a static bf16
  cache): the same runner as the recipes, so the ratio isolates the quantized pieces;
- ``bf16-hf``: plain ``model(input_ids, logits_to_keep=1)`` of transformers (prefill only), a
  check that the runner adds nothing;
- one provider per recipe (``fireq``, ``qserve``, ``flute-nf4``, ``flute-nf3``,
  ``int8-attention``) whose pieces are installed; when a recipe's KV or attention piece is
  missing its linears are measured alone as ``<recipe>[linear]``, and the row says so;
- options beside a default, in the same run: ``+head`` (``lm_head=True``), ``+fused``
  (``fuse_mlp=True``), runner options (``+rope``: ``rope_kernel=True``; ``+ropeq``: q rotated in the
  KV4 append too; ``+dk`` / ``+dsdpa``: decode attention over the float cache by lowbit's kernel or
  SDPA; ``+fk`` / ``+nofk``: RMSNorm and SiLU*mul of float projections as Triton launches or eager;
  ``+noadd``: residual adds as torch ops instead of fused into the next norm launch)
  and kernel flags (``+pdl``: programmatic dependent launch of the act-quant / GEMM /
  RoPE kernels), e.g. ``fireq+ropeq+pdl`` or ``bf16+rope`` (``provider_spec``).

Prefill: batch 16 x seq {1024, 2048, 4096}, tokens/s = 16 * seq / t (only the last token of each
request goes through ``lm_head``). Decode: one new token per request at batch {1, 16, 64} with the
cache holding ``ctx`` tokens; tokens/s = batch / t. Memory: weights (every parameter and buffer,
scaled to the N layers) and KV cache bytes per token.
"""
from __future__ import annotations

import gc
import json
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=16384,
                 rms_norm_eps=1e-5, tie_word_embeddings=False)
MIXTRAL_8X7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, max_position_embeddings=32768,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2,
                    sliding_window=None)
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, rope_theta=1000000.0,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, max_position_embeddings=40960,
                rms_norm_eps=1e-6, tie_word_embeddings=False)


@dataclass(frozen=True)
class Arch:
    """A model shape to benchmark: transformers ``model_type``, config values, its real decoder layers."""

    title: str
    model_type: str
    config: dict
    layers: int

    def bf16_bytes(self) -> int:
        """Weights of the whole bf16 model (embedding, N layers, norms, untied ``lm_head``)."""
        c = self.config
        h, hd = c["hidden_size"], c["head_dim"]
        attn = h * hd * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
        e = c.get("num_local_experts", c.get("num_experts", 0))  # MoE: every expert's MLP and the router
        inter = c.get("moe_intermediate_size", c["intermediate_size"]) if e else c["intermediate_size"]
        mlp = 3 * h * inter * max(e, 1) + h * e
        return 2 * (self.layers * (attn + mlp) + 2 * c["vocab_size"] * h)

    def kv_bytes_per_token(self) -> int:
        """bf16 K and V of one token over the N layers."""
        return self.layers * 2 * self.config["num_key_value_heads"] * self.config["head_dim"] * 2


ARCHS = {"llama3-8b": Arch("Llama-3-8B", "llama", LLAMA3_8B, 32),
         "qwen3-8b": Arch("Qwen3-8B", "qwen3", QWEN3_8B, 36),
         "mixtral-8x7b": Arch("Mixtral-8x7B", "mixtral", MIXTRAL_8X7B, 32),  # session 38; first run on the H200 in session 39
         "qwen3-30b-a3b": Arch("Qwen3-30B-A3B", "qwen3_moe", QWEN3_30B_A3B, 48)}  # session 39; first run session 41
DEFAULT_ARCH = "llama3-8b"
FULL_LAYERS = ARCHS[DEFAULT_ARCH].layers
RECIPES = ("fireq", "fireq+head", "qserve", "flute-nf4", "int8-attention", "fireq+fused", "qserve+head", "flute-nf3",
           "flute-nf4+head")
# provider -> (recipe, options): "+head" = lm_head quantized too (recipe option lm_head=True)
VARIANTS = {"fireq+fused": ("fireq", {"fuse_mlp": True}), "fireq+head": ("fireq", {"lm_head": True}),
            "qserve+head": ("qserve", {"lm_head": True})}
BASELINE = "bf16"
# provider-name tokens after the recipe ("fireq+rope+pdl"): runner options and kernel flags, so an
# option is measured beside the default in the same run before it becomes the default
GEN_TOKENS = {"rope": {"rope_kernel": True}, "norope": {"rope_kernel": False},
              "ropeq": {"rope_kernel": True, "rope_q_append": True}, "noropeq": {"rope_q_append": False},
              "s16": {"decode_splits": 16}, "s32": {"decode_splits": 32}, "nopdl": {"pdl_max_m": 0},
              "dk": {"dense_decode": "kernel"}, "dsdpa": {"dense_decode": "sdpa"},
              "fk": {"float_kernels": True}, "nofk": {"float_kernels": False},
              "noadd": {"fused_add": False}}  # session 10: residual adds as torch ops (the pre-S10 path)
FLAG_TOKENS = {"pdl": ("lowbit.kernels.act_quant", "PDL_DEFAULT", True),
               "qw4": ("lowbit.kernels.kv4_append", "ROPE_Q_WARPS", 4),
               "sp0": ("lowbit.kernels.decode_kv4", "SHORT_MIN_PROGRAMS", 0),  # session 9: the old split cap
               "dp4a0": ("lowbit.kernels.w4a8_int8_gemm", "DP4A_M1_MAX_N", {"rows": 0, "tiled": 0}),  # no DP4A at M=1
               # session 27: the dense cache's decode as the append, decode and combine launches (not fused)
               "attn3": ("lowbit.models.generate", "FUSED_FLOAT_DECODE", False)}


def provider_spec(name: str) -> tuple[str, dict, dict, list]:
    """``name`` -> (recipe or 'bf16', quantization options, Generator options, kernel flags).
    ``VARIANTS`` names first; then '+'-separated tokens: ``head`` (lm_head=True), ``head8`` (lm_head="w8"), ``fused``
    (fuse_mlp=True), ``unfused`` (fuse_mlp=False), ``kv4`` (kv="kv4"), ``rows`` (w4a8-int8 codes row-major:
    linear_options tiled=False), ``GEN_TOKENS`` and ``FLAG_TOKENS``."""
    base, *toks = name.split("+")
    recipe, qopts = VARIANTS.get(name, (base, {}))
    qopts, gopts, flags = dict(qopts), {}, []
    if name not in VARIANTS:
        for t in toks:
            if t == "head":
                qopts["lm_head"] = True
            elif t == "head8":  # session 21: lm_head="w8" (INT8 per-channel weight-only head)
                qopts["lm_head"] = "w8"
            elif t == "fused":
                qopts["fuse_mlp"] = True
            elif t == "unfused":  # session 26: the flute recipes' MLP without the gate / up fusion (their default)
                qopts["fuse_mlp"] = False
            elif t == "kv4":  # session 15: the recipe with the paged INT4 KV cache (kv="kv4")
                qopts["kv"] = "kv4"
            elif t == "rows":  # session 11: w4a8-int8 codes row-major (the pre-S11 layout)
                qopts["linear_options"] = {"tiled": False}
            elif t in GEN_TOKENS:
                gopts.update(GEN_TOKENS[t])
            elif t in FLAG_TOKENS:
                flags.append(FLAG_TOKENS[t])
            else:
                raise ValueError(f"unknown provider token {t!r} in {name!r}")
    return recipe, qopts, gopts, flags


class _Flags:
    """Set module-level kernel flags for one provider's measurements, restore them after."""

    def __init__(self, flags):
        import importlib

        self.items = [(importlib.import_module(m), a, v) for m, a, v in flags]
        self.saved = []

    def __enter__(self):
        self.saved = [(m, a, getattr(m, a)) for m, a, _ in self.items]
        for m, a, v in self.items:
            setattr(m, a, v)

    def __exit__(self, *exc):
        for m, a, v in self.saved:
            setattr(m, a, v)


def build_model(layers: int = 2, *, seed: int = 0, device="cuda", dtype=torch.bfloat16, arch: str = DEFAULT_ARCH):
    """Random model of ``ARCHS[arch]``'s shapes with ``layers`` decoder layers (weights ~ N(0, 0.02))."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    a = ARCHS[arch]
    cfg = AutoConfig.for_model(a.model_type, num_hidden_layers=layers, attn_implementation="sdpa", **a.config)
    torch.manual_seed(seed)
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(cfg).to(dtype)
    for mod in m.modules():  # float MoE experts (the bf16 baseline): transformers' graph-capturable grouped_mm
        if getattr(getattr(mod, "config", None), "_experts_implementation", None) is not None:
            mod.config._experts_implementation = "grouped_mm"
    return m.eval()


def _module_bytes(mod) -> int:
    return sum(t.numel() * t.element_size() for t in list(mod.parameters()) + list(mod.buffers()))


def weight_bytes(model, layers: int, full: int = FULL_LAYERS) -> dict:
    """Bytes of the decoder layers (scaled to the model's ``full`` layers) and of everything else."""
    inner = model.model
    per_layer = _module_bytes(inner.layers) / max(1, len(inner.layers))
    rest = _module_bytes(model) - _module_bytes(inner.layers)
    return {"per_layer_bytes": per_layer, "other_bytes": rest, "full_layers": full,
            "total_bytes_full": rest + full * per_layer}


def _scaled(t_layers: dict, t_head: dict, layers: int, full: int = FULL_LAYERS) -> dict:
    f = full / layers
    out = {}
    for k in ("median_ms", "min_ms", "max_ms"):
        out[k] = t_head["median_ms"] + f * (t_layers[k] - t_head["median_ms"])
    out.update(reps=t_layers["reps"], input_sets=t_layers["input_sets"], raw_ms=t_layers["median_ms"],
               head_ms=t_head["median_ms"], layers_measured=layers)
    return out


class _Deadline:
    def __init__(self, seconds: float | None):
        self.t_end = None if seconds is None else time.time() + seconds

    def out(self) -> bool:
        return self.t_end is not None and time.time() > self.t_end


def _quantize(model, recipe: str, *, linear_only: bool = False):
    import lowbit

    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    calib = [torch.randint(0, vocab, (1, 128), generator=g) for _ in range(2)]
    recipe, extra, _, _ = provider_spec(recipe)
    opts = dict(progress=False, **extra)
    if linear_only:
        opts.update(kv=None, attention=None)
        if recipe == "fireq":
            opts.update(rpn=False, crs=False, cas=False)  # CAS/RPN/CRS change no kernel: speed is the same
    return lowbit.quantize_model(model, recipe, calibration=calib, **opts)


def _prefill_fn(gen, B, S, vocab, dev):
    ids = torch.randint(0, vocab, (B, S), device=dev)
    lengths = torch.full((B,), S, device=dev)
    return lambda: gen.prefill(ids, lengths)


def measure_provider(rec, name: str, model, *, layers: int, prefill_seqs, decode_batches, decode_ctx,
                     deadline: _Deadline, memory: dict, note: str | None = None, hf: bool = False,
                     profile_dir=None, profiles: dict | None = None, gen_opts: dict | None = None,
                     full: int = FULL_LAYERS) -> None:
    from lowbit.bench.harness import time_cuda
    from lowbit.models.generate import Generator

    dev = next(model.parameters()).device
    vocab = model.config.vocab_size
    gopts = dict(gen_opts or {})
    wb = weight_bytes(model, layers, full)
    memory.setdefault(name, {}).update(weights=wb)
    if profile_dir is not None and profiles is not None and not deadline.out():
        try:  # first: the profile is what the next round's work is chosen from
            profiles[name] = profile_provider(name, model, profile_dir, layers=layers, gen_opts=gen_opts)
        except Exception as exc:
            traceback.print_exc()
            print(f"profile of {name} failed: {type(exc).__name__}: {exc}")
    scale_note = (f"measured with all {layers} layers" if layers == full else
                  f"measured with {layers} of {full} layers + head-only step, scaled to {full} layers")
    full_note = scale_note + (f"; {note}" if note else "")
    B = 16
    for S in prefill_seqs:
        case = {"phase": "prefill", "batch": B, "seq": S}
        if deadline.out():
            rec.record(case, name, None, note="skipped: time budget of this run")
            continue
        try:
            times = {}
            for nl in (layers, 0):
                gen = Generator(model, max_batch=B, max_seq=S, layers=nl, cuda_graphs=False, **gopts)
                fn = _prefill_fn(gen, B, S, vocab, dev)
                reps = 5 if S * B >= 32768 else 10
                times[nl] = time_cuda(fn, [()], warmup=2, reps=reps, chunk=reps)
                if nl == layers:
                    kv_bytes = gen.cache.bytes()
                    memory[name]["kv_bytes_per_token_full"] = kv_bytes / (B * gen.cache.smax) * full / max(1, nl)
                    memory[name]["kv_format"] = gen.cache.name
                del gen, fn
            t = _scaled(times[layers], times[0], layers, full)
            row = rec.record(case, name, t, note=full_note)
            row["tokens_per_s"] = B * S / (t["median_ms"] * 1e-3)
            if hf and S == prefill_seqs[0]:
                _hf_prefill_row(rec, model, B, S, layers, deadline, full)
        except Exception as exc:  # one failure must not stop the rest
            rec.record(case, name, None, note=f"error: {type(exc).__name__}: {str(exc)[:300]}")
            traceback.print_exc()
        torch.cuda.empty_cache()
    for Bd in decode_batches:
        for L in decode_ctx:
            case = {"phase": "decode", "batch": Bd, "ctx": L}
            if deadline.out():
                rec.record(case, name, None, note="skipped: time budget of this run")
                continue
            try:
                times = {}
                graphs = True
                for nl in (layers, 0):
                    gen = Generator(model, max_batch=Bd, max_seq=L + 1, layers=nl, **gopts)
                    tok = torch.randint(0, vocab, (Bd,), device=dev)
                    pos = torch.full((Bd,), L, device=dev)  # the cache holds L tokens, this one is L+1
                    try:
                        gen.decode(tok, pos)
                    except Exception as exc:  # graph capture refused: measure eagerly and say so
                        graphs = False
                        print(f"[{name}] CUDA graph capture failed ({type(exc).__name__}: {exc}); eager decode")
                        gen = Generator(model, max_batch=Bd, max_seq=L + 1, layers=nl, cuda_graphs=False,
                                        **gopts)
                    times[nl] = time_cuda(lambda: gen.decode(tok, pos), [()], warmup=3, reps=50)
                    del gen
                t = _scaled(times[layers], times[0], layers, full)
                nt = full_note + ("" if graphs else "; EAGER decode (CUDA graph capture failed)")
                row = rec.record(case, name, t, note=nt)
                row["tokens_per_s"] = Bd / (t["median_ms"] * 1e-3)
                row["cuda_graphs"] = graphs
            except Exception as exc:
                rec.record(case, name, None, note=f"error: {type(exc).__name__}: {str(exc)[:300]}")
                traceback.print_exc()
            torch.cuda.empty_cache()


SECTIONS = ("embed+rope tables", "norm+qkv", "rope", "kv write", "attention", "kv write+attention", "o_proj+mlp",
            "norm+lm_head")


def _kernel_class(name: str) -> str:
    """Coarse class of a CUDA kernel name (for the per-kernel half of the profile)."""
    n = name.lower()
    for key, cls in (("w4a8_fp8_gemm", "w4a8-fp8 GEMM"), ("w4a8_int8", "w4a8-int8 GEMM"), ("lut", "LUT GEMM"),
                     ("splitk", "split-K reduce"), ("per_token_quant", "act quant"), ("kv4_append", "kv4 append"),
                     ("decode_kv4", "kv4 decode attn"), ("combine", "kv4 decode attn"), ("attn", "attention"),
                     ("sdpa", "attention"), ("flash", "attention"), ("fmha", "attention"), ("kv_quant", "attention"),
                     ("nvjet", "cuBLAS GEMM"), ("gemm", "cuBLAS GEMM"), ("cutlass", "cuBLAS GEMM"),
                     ("reduce_kernel", "torch reduce (norm)"), ("cat", "torch cat/copy"), ("copy", "torch cat/copy"),
                     ("index", "torch index/gather"), ("gather", "torch index/gather"),
                     ("elementwise", "torch elementwise")):
        if key in n:
            return cls
    return "other"


def profile_step(gen, fn, *, graph_fn=None) -> dict:
    """Profile one call of ``fn`` (eager) with the runner's section labels: GPU time per section,
    per kernel class, kernel count; ``graph_fn`` (the CUDA-graph version) is timed beside it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from lowbit.bench.harness import time_cuda

    gen.profile_sections = True
    try:
        with torch.no_grad():
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
    finally:
        gen.profile_sections = False
    sections, spans, classes, n_kernels, total = {}, {}, {}, 0, 0.0
    for e in prof.events():  # raw events: CPU labels (kernels of their children) and CUDA kernels
        if e.name in SECTIONS:
            if e.device_type == DeviceType.CPU:
                sections[e.name] = sections.get(e.name, 0.0) + e.device_time_total
            else:  # the GPU-side copy of a label: its span on the GPU
                spans[e.name] = spans.get(e.name, 0.0) + e.device_time_total
        elif e.device_type == DeviceType.CUDA:
            c = _kernel_class(e.name)
            classes[c] = classes.get(c, 0.0) + e.device_time_total
            n_kernels += 1
            total += e.device_time_total
    out = {"sections_us": sections, "section_spans_us": spans, "kernel_classes_us": classes, "kernels": n_kernels,
           "gpu_sum_us": total,
           "top_kernels": prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14)}
    t_eager = time_cuda(fn, [()], warmup=2, reps=10, chunk=10)
    out["eager_us"] = t_eager["median_ms"] * 1e3
    if graph_fn is not None:
        t = time_cuda(graph_fn, [()], warmup=3, reps=30)
        out["graph_us"] = t["median_ms"] * 1e3
    return out


def graph_timeline(graph_fn, reps: int = 3) -> dict:
    """Every kernel of CUDA-graph replays of one step, in GPU order: name, duration and the idle gap
    before it (us; per-kernel medians over ``reps`` replays). The gaps are what a launch costs inside
    a graph beyond its kernel time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graph_fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(reps):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph_fn()
            torch.cuda.synchronize()
        ks = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start),
                    key=lambda t: t[0])
        ks = [k for k in ks if "memcpy" not in k[2].lower() and "memset" not in k[2].lower()]
        if ks:
            runs.append(ks)
    if not runs:
        return {}
    n = min(len(r) for r in runs)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    rows = []
    for i in range(n):
        dur = med([r[i][1] - r[i][0] for r in runs])
        gap = med([r[i][0] - r[i - 1][1] for r in runs]) if i else 0.0
        rows.append({"kernel": runs[0][i][2][:90], "us": round(dur, 2), "gap_before_us": round(gap, 2)})
    span = med([r[n - 1][1] - r[0][0] for r in runs])
    return {"kernels": rows, "n": n, "span_us": round(span, 1), "sum_kernel_us": round(sum(r["us"] for r in rows), 1),
            "sum_gap_us": round(sum(r["gap_before_us"] for r in rows), 1)}


def timeline_text(tl: dict, title: str) -> str:
    lines = [f"== {title}: {tl['n']} kernels, span {tl['span_us']} us = kernels {tl['sum_kernel_us']} + gaps "
             f"{tl['sum_gap_us']} us", f"{'#':>3} {'gap':>6} {'us':>7}  kernel"]
    for i, r in enumerate(tl["kernels"]):
        lines.append(f"{i:3d} {r['gap_before_us']:6.2f} {r['us']:7.2f}  {r['kernel']}")
    return "\n".join(lines) + "\n\n"


def profile_provider(name: str, model, out_dir, *, layers: int, decode_batch: int = 1, ctx: int = 1024,
                     prefill: bool = True, extra_decode_batches=(64,), gen_opts: dict | None = None) -> dict:
    """Per-section and per-kernel-class GPU time of one decode step (batch ``decode_batch``, ``ctx``
    cached; eager with labels, plus the CUDA-graph step time) and of one prefill (16 x 1024) of the
    ``layers``-layer model. Writes ``profile_<name>.txt``; returns the numbers."""
    from lowbit.models.generate import Generator

    dev = next(model.parameters()).device
    vocab = model.config.vocab_size
    res = {}
    for bd in (decode_batch, *extra_decode_batches):
        gen = Generator(model, max_batch=bd, max_seq=ctx + 1, layers=layers, **(gen_opts or {}))
        tok = torch.randint(0, vocab, (bd,), device=dev)
        pos = torch.full((bd,), ctx, device=dev)
        gen.decode(tok, pos)  # capture
        key = "decode" if bd == decode_batch else f"decode B={bd}"
        res[key] = profile_step(gen, lambda: gen._step(tok, pos), graph_fn=lambda: gen.decode(tok, pos))
        if bd == decode_batch:
            try:
                res[key]["graph_timeline"] = graph_timeline(lambda: gen.decode(tok, pos))
            except Exception as exc:
                print(f"graph timeline of {name} failed: {type(exc).__name__}: {exc}")
        del gen
    if prefill:
        gp = Generator(model, max_batch=16, max_seq=1024, layers=layers, cuda_graphs=False, **(gen_opts or {}))
        res["prefill"] = profile_step(gp, _prefill_fn(gp, 16, 1024, vocab, dev))
        del gp
    with open(Path(out_dir) / f"profile_{name}.txt", "w") as f:
        for k, r in res.items():
            f.write(f"== {name}: {k} ({layers} layers)\n{r['top_kernels']}\n")
            if r.get("graph_timeline"):
                f.write(timeline_text(r["graph_timeline"], f"{name}: {k}, CUDA-graph replay ({layers} layers + head)"))
    for r in res.values():
        r.pop("top_kernels")
    torch.cuda.empty_cache()
    return res


def profile_table(profiles: dict, layers: int) -> str:
    """Markdown table: providers side by side, per section and kernel class, us per step (raw,
    ``layers`` layers + head; not scaled)."""
    lines = []
    phases = list(dict.fromkeys(k for p in profiles for k in profiles[p]))
    for phase in phases:
        provs = [p for p in profiles if phase in profiles[p]]
        if not provs:
            continue
        lines += [f"### {phase} ({layers} layers + head, us, eager with labels)", "",
                  "| section / kernel class | " + " | ".join(provs) + " |", "|---|" + "---|" * len(provs)]
        keys = list(dict.fromkeys(k for p in provs for k in profiles[p][phase]["sections_us"]))
        for k in keys:
            lines.append(f"| section: {k} | " + " | ".join(
                f"{profiles[p][phase]['sections_us'].get(k, 0):.1f} "
                f"(span {profiles[p][phase]['section_spans_us'].get(k, 0):.1f})" for p in provs) + " |")
        keys = sorted(dict.fromkeys(k for p in provs for k in profiles[p][phase]["kernel_classes_us"]))
        for k in keys:
            lines.append(f"| kernels: {k} | " + " | ".join(
                f"{profiles[p][phase]['kernel_classes_us'].get(k, 0):.1f}" for p in provs) + " |")
        for k, lab in (("kernels", "kernel launches"), ("gpu_sum_us", "sum of kernel times"),
                       ("eager_us", "eager wall per call"), ("graph_us", "CUDA-graph wall per call")):
            lines.append(f"| {lab} | " + " | ".join(
                (f"{profiles[p][phase][k]:.1f}" if isinstance(profiles[p][phase].get(k), float)
                 else str(profiles[p][phase].get(k, "-"))) for p in provs) + " |")
        lines.append("")
    return "\n".join(lines)


def _hf_prefill_row(rec, model, B, S, layers, deadline, full: int = FULL_LAYERS):
    from lowbit.bench.harness import time_cuda

    ids = torch.randint(0, model.config.vocab_size, (B, S), device=next(model.parameters()).device)
    t = time_cuda(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), [()], warmup=2, reps=5, chunk=5)
    # no head-only variant for HF: scale the whole step linearly (upper bound on the true time)
    f = full / layers
    ts = {k: t[k] * f for k in ("median_ms", "min_ms", "max_ms")}
    ts.update(reps=t["reps"], input_sets=1, raw_ms=t["median_ms"], layers_measured=layers)
    row = rec.record({"phase": "prefill", "batch": B, "seq": S}, "bf16-hf", ts,
                     note=f"transformers forward, {layers} layers, whole step x {f:g} (includes the head {f:g} times)")
    row["tokens_per_s"] = B * S / (ts["median_ms"] * 1e-3)


def auto_layers(decode_batches, decode_ctx, prefill_seqs, free_bytes: int | None = None,
                arch: str = DEFAULT_ARCH) -> int:
    """Decoder layers to build (session 27): all N where the bf16 model (Llama-3-8B 16.1 GB, Qwen3-8B 16.4 GB) plus
    the largest bf16 KV cache of the run (131072 / 147456 bytes per token) and 20 % headroom fit the free GPU memory
    (an H200 for the default shapes), else 2 (scaled to N: an 80 GB H100 at batch 64 x 8k)."""
    a = ARCHS[arch]
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
    tokens = max([b * (c + 1) for b in decode_batches for c in decode_ctx] + [16 * s for s in prefill_seqs])
    need = a.bf16_bytes() + a.kv_bytes_per_token() * tokens
    return a.layers if free_bytes >= 1.2 * need else 2


def run(out_dir, *, quick: bool = False, layers: int | None = None, recipes=RECIPES, prefill_seqs=None,
        decode_batches=None, decode_ctx=None, time_budget_s: float | None = None, command: str | None = None,
        profile=False, arch: str = DEFAULT_ARCH) -> Path:
    """Measure every provider and write ``model.json`` / ``.md`` / ``.png`` + ``model_memory.json`` (``model_<arch>.*``
    for an ``arch`` other than the default). ``layers``: decoder layers built (None: ``auto_layers``; the arch's N = no
    scaling). ``profile``: False, True (bf16 and fireq) or a tuple of provider names to profile first
    (``profile_<name>.txt`` + ``model_profile.{md,json}``; for another arch ``<arch>/profile_<name>.txt`` and
    ``model_<arch>_profile.{md,json}``)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    a = ARCHS[arch]
    full = a.layers
    from lowbit.bench.harness import Recorder, env_info

    prefill_seqs = prefill_seqs or ([1024, 4096] if quick else [1024, 2048, 4096])
    decode_batches = decode_batches or [1, 16, 64]
    decode_ctx = decode_ctx or ([1024, 8192] if quick else [1024, 2048, 4096, 8192])
    if layers is None:
        layers = auto_layers(decode_batches, decode_ctx, prefill_seqs, arch=arch)
    stem = "model" if arch == DEFAULT_ARCH else f"model_{arch.replace('-', '_')}"
    prof_dir = Path(out_dir) if arch == DEFAULT_ARCH else Path(out_dir) / arch  # per-provider profile texts
    if profile:
        prof_dir.mkdir(parents=True, exist_ok=True)
    rec = Recorder(stem)
    deadline = _Deadline(time_budget_s)
    memory: dict = {}
    profiles: dict = {}
    prof_set = set(("bf16", "fireq") if profile is True else (profile or ()))
    depth = (f"all {full} decoder layers measured (no scaling)" if layers == full else
             f"{layers} decoder layers measured and scaled to {full} "
             f"(t_{full} = t_head + {full}/layers * (t_layers - t_head))")
    rec.note(f"{a.title} shapes, random bf16 weights, {depth}; prefill = 16 x seq tokens, lm_head on the last "
             "token only; decode = one token per request with ctx tokens cached, CUDA graphs")
    model = build_model(layers, arch=arch)
    print("== bf16", flush=True)
    measure_provider(rec, "bf16", model, layers=layers, prefill_seqs=prefill_seqs, decode_batches=decode_batches,
                     decode_ctx=decode_ctx, deadline=deadline, memory=memory, hf=True,
                     profile_dir=prof_dir if "bf16" in prof_set else None, profiles=profiles, full=full)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    for r in recipes:
        if deadline.out():
            rec.note(f"{r}: skipped (time budget)")
            continue
        print(f"== {r}", flush=True)
        model = build_model(layers, arch=arch)
        t0 = time.time()
        name, note = r, None
        base, _, gopts, flags = provider_spec(r)
        try:
            if base != BASELINE:
                _quantize(model, r)
        except NotImplementedError as exc:
            try:
                del model
                gc.collect()
                model = build_model(layers, arch=arch)
                _quantize(model, r, linear_only=True)
                name, note = f"{r}[linear]", f"linears only ({exc})"
            except Exception as exc2:
                rec.note(f"{r}: not measured: {exc}; linear-only: {type(exc2).__name__}: {exc2}")
                del model
                gc.collect()
                torch.cuda.empty_cache()
                continue
        except Exception as exc:
            traceback.print_exc()
            rec.note(f"{r}: quantization failed: {type(exc).__name__}: {str(exc)[:300]}")
            del model
            gc.collect()
            torch.cuda.empty_cache()
            continue
        if base != BASELINE:
            rec.note(f"{name}: quantized {layers} layers in {time.time() - t0:.1f} s")
        if gopts or flags:
            rec.note(f"{name}: runner options {gopts}, kernel flags {[f'{m}.{a}={v}' for m, a, v in flags]}")
        with _Flags(flags):
            measure_provider(rec, name, model, layers=layers, prefill_seqs=prefill_seqs,
                             decode_batches=decode_batches, decode_ctx=decode_ctx, deadline=deadline, memory=memory,
                             note=note, profile_dir=prof_dir if name in prof_set else None, profiles=profiles,
                             gen_opts=gopts, full=full)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    path = rec.write(out_dir, baseline=BASELINE, command=command)
    out = Path(out_dir)
    (out / f"{stem}_memory.json").write_text(json.dumps(memory, indent=1))
    if profiles:
        (out / f"{stem}_profile.json").write_text(json.dumps({"env": env_info(command), **profiles}, indent=1))
        (out / f"{stem}_profile.md").write_text(profile_table(profiles, layers))
        print(profile_table(profiles, layers), flush=True)
    summary = summarize(json.loads(path.read_text()), memory)
    (out / f"{stem}_summary.md").write_text(summary)
    try:
        plot_throughput(json.loads(path.read_text()), memory, out / f"{stem}_throughput.png", a.title)
    except Exception as exc:
        print(f"plot failed: {exc}")
    print(summary, flush=True)
    return path


def summarize(doc: dict, memory: dict) -> str:
    """Markdown: tokens/s per provider and case, ratio to bf16, and memory."""
    rows = [r for r in doc["rows"] if "tokens_per_s" in r]
    provs = list(dict.fromkeys(r["provider"] for r in doc["rows"]))
    cases = list(dict.fromkeys(tuple(r["case"].items()) for r in doc["rows"]))
    cell = {(tuple(r["case"].items()), r["provider"]): r for r in rows}
    lines = ["| case | " + " | ".join(provs) + " |", "|---|" + "---|" * len(provs)]
    for c in cases:
        base = cell.get((c, BASELINE))
        vals = []
        for p in provs:
            r = cell.get((c, p))
            if r is None:
                vals.append("-")
                continue
            t = r["tokens_per_s"]
            s = f"{t / 1e3:.1f}k" if t >= 1e4 else f"{t:.0f}"
            if base is not None and p != BASELINE:
                s += f" ({r['tokens_per_s'] / base['tokens_per_s']:.2f}x)"
            vals.append(s)
        lines.append("| " + " ".join(f"{k}={v}" for k, v in c) + " | " + " | ".join(vals) + " |")
    n = next((m["weights"]["full_layers"] for m in memory.values()), FULL_LAYERS)
    lines += ["", f"| provider | weights (GB, {n} layers) | KV bytes / token ({n} layers) |", "|---|---|---|"]
    for p, m in memory.items():
        kv = m.get("kv_bytes_per_token_full")
        lines.append(f"| {p} | {m['weights']['total_bytes_full'] / 1e9:.2f} | {kv:.0f} ({m.get('kv_format')}) |"
                     if kv else f"| {p} | {m['weights']['total_bytes_full'] / 1e9:.2f} | - |")
    return "tokens/s (ratio to bf16, same run)\n\n" + "\n".join(lines) + "\n"


def plot_throughput(doc: dict, memory: dict, path, title: str = "Llama-3-8B") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if "tokens_per_s" in r]
    provs = list(dict.fromkeys(r["provider"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for ax, phase in zip(axes[:2], ("prefill", "decode")):
        cases = list(dict.fromkeys(tuple(r["case"].items()) for r in rows if r["case"]["phase"] == phase))
        w = 0.8 / max(1, len(provs))
        for j, p in enumerate(provs):
            ys = []
            for c in cases:
                r = next((r for r in rows if tuple(r["case"].items()) == c and r["provider"] == p), None)
                ys.append(r["tokens_per_s"] if r else 0)
            ax.bar([i + j * w for i in range(len(cases))], ys, w, label=p)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(cases))])
        ax.set_xticklabels([" ".join(f"{k}={v}" for k, v in c if k != "phase") for c in cases], rotation=60, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("tokens/s (whole-model equivalent)")
        ax.set_title(f"{phase}, {title} shapes")
        ax.legend(fontsize=6)
    ax = axes[2]
    names = list(memory)
    ax.bar(range(len(names)), [memory[n]["weights"]["total_bytes_full"] / 1e9 for n in names])
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=60, fontsize=7)
    ax.set_ylabel("weights GB (whole model)")
    ax.set_title("memory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    """Entry of ``lowbit bench model`` (argparse namespace with ``out``, ``quick``)."""
    import sys

    from lowbit.bench import harness

    if not torch.cuda.is_available():
        print("lowbit bench model needs a CUDA GPU (none found).", file=sys.stderr)
        return 2
    out = getattr(args, "out", None) or f"benchmarks/results/{harness.gpu_slug()}"
    run(out, quick=bool(getattr(args, "quick", False)), layers=getattr(args, "layers", None) or None,
        command=" ".join(sys.argv), arch=getattr(args, "arch", None) or DEFAULT_ARCH)
    return 0
