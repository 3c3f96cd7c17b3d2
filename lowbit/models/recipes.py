"""Model-level recipes: each joins a linear scheme, PTQ transforms and a KV/attention scheme.

A recipe is ``fn(model, calibration=None, **options) -> model`` (registered in
``lowbit.registry``, called through ``lowbit.quantize_model``). It works on any Llama-family
``*ForCausalLM`` of transformers through ``lowbit.models.arch.decoder_layers`` and quantizes
the seven linears of every decoder layer in place (on a mixture-of-experts layer: q/k/v/o and every expert's
gate_up and down, ``lowbit.nn.moe.QuantExperts``, and a Qwen2-MoE shared expert's gate/up/down; the router and the
shared expert's gate stay float; ``skip=`` of any MLP role keeps all routed experts float, an expert's gate and up
being one matrix, and skips that role of the shared expert); ``embed_tokens`` and ``lm_head`` stay float
(``lm_head=True`` in ``fireq`` / ``qserve`` / ``flute-nf4`` / ``flute-nf3`` quantizes the head too, with the
recipe's linear scheme; ``lm_head="w8"`` with INT8 per-channel weights, near-lossless).

Common options (every recipe):

- ``linear``: linear scheme name (``lowbit.schemes()``) or ``None`` to keep the linears float;
- ``kv``: ``'kv4'`` (symmetric INT4, FP8 scales), ``'kv4-zp'`` (INT4 with zero points) or ``None``;
- ``attention``: prefill attention scheme (``'fp8'``, ``'fp8-kv4'``, ``'int8'``, ``'sdpa'``...) or
  ``None`` (transformers' own attention);
- ``group_size``, ``linear_options`` (extra keywords for ``from_linear``), ``skip`` (roles such as
  ``('down_proj',)`` to keep float);
- ``seed`` (calibration windows and any randomness), ``n_samples``/``seq_len`` (calibration
  windows), ``tokenizer`` (needed when ``calibration`` is None or a text file), ``progress``.

``calibration`` is ``None`` (windows of the embedded corpus, ``lowbit.eval.corpus``), a path to a
UTF-8 text file, or a list of token-id tensors (``[S]`` or ``[B, S]``). Calibration only runs
when a selected transform needs activations (RPN/CRS, SmoothAttention, SmoothQuant, NF scale
learning); CAS and PTS are weight-only.

Recipes whose pieces are not installed raise ``NotImplementedError("recipe X needs <module>,
not available yet")``; everything else keeps working.

Order inside ``fireq`` (FireQ Fig. 1; notes/fireq.md 1.10): float transforms first (CAS folds
Lambda into the weights and Lambda^-1 into the preceding RMSNorm; RPN/CRS are calibrated on the
float model and RPN is folded into k_proj/q_proj), then each linear is quantized (PTS chooses
delta = 2^n inside ``W4A8FP8Linear.from_linear(pts=True)``), then the quantized attention and
KV cache are installed with the CRS parameters (applied after RoPE, the paper's "merged into
q_proj" cannot be exact: notes 7.6).
"""
from __future__ import annotations

import importlib
import inspect
import os
from typing import Any, Callable

import torch
from torch import nn

from lowbit._utils import check_choice
from lowbit.models.arch import INPUT_GROUPS
from lowbit.nn.base import GPTQ_ATTR

__all__ = ["fireq", "qserve", "flute_nf4", "flute_nf3", "int8_attention", "fp8_mla", "quantize_linears",
           "quantize_experts",
           "calibration_batches", "recipe_info", "is_quantized"]

KV_CHOICES = ("kv4", "kv4-zp", None)


# --------------------------------------------------------------------------------- plumbing
def _need(recipe: str, module: str, attr: str | None = None):
    """Import ``module`` (and return ``attr`` of it); NotImplementedError naming both if absent."""
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        # only a missing lowbit piece means "not available yet"; re-raise real import bugs
        missing = getattr(exc, "name", "") or ""
        if not (missing == module or module.startswith(missing + ".") or missing.startswith(module)):
            raise
        raise NotImplementedError(f"recipe {recipe} needs {module}, not available yet") from None
    if attr is None:
        return mod
    obj = getattr(mod, attr, None)
    if obj is None:
        raise NotImplementedError(f"recipe {recipe} needs {module}.{attr}, not available yet")
    return obj


def _call(fn: Callable, *args, **kwargs):
    """Call ``fn`` passing only the keywords its signature accepts (pieces grow their options)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(*args, **kwargs)
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return fn(*args, **kwargs)
    return fn(*args, **{k: v for k, v in kwargs.items() if k in params})


def _accepts(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def is_quantized(model) -> bool:
    """True when ``model`` already holds a lowbit quantized module or recipe."""
    from lowbit.nn.base import QuantLinear

    return getattr(model, "lowbit_recipe", None) is not None or any(
        isinstance(m, QuantLinear) for m in model.modules())


def recipe_info(model) -> dict | None:
    """The recipe record a recipe left on the model (name, options, kv, attention), or None."""
    return getattr(model, "lowbit_recipe", None)


def _json_safe(v: Any):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, (os.PathLike,)):
        return os.fspath(v)
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else f"tensor{list(v.shape)}"
    return repr(v)[:200]


def _auto_tokenizer(model):
    """Tokenizer of ``model`` from its ``name_or_path`` (a local dir, possibly holding a GGUF)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    src = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    if src:
        p = Path(src)
        try:
            if p.is_dir():
                ggufs = sorted(p.glob("*.gguf"))
                if ggufs and not (p / "tokenizer.json").exists() and not (p / "tokenizer_config.json").exists():
                    return AutoTokenizer.from_pretrained(p, gguf_file=ggufs[0].name)
                return AutoTokenizer.from_pretrained(p)
        except Exception:
            pass
    raise ValueError("calibration from text needs a tokenizer: pass tokenizer=..., or calibration= a list "
                     "of token-id tensors")


def calibration_batches(model, calibration=None, *, tokenizer=None, n_samples: int = 16, seq_len: int = 512,
                        seed: int = 0) -> list[torch.Tensor]:
    """Normalise ``calibration`` into a list of ``[1, S]`` LongTensors (see module docstring)."""
    if calibration is None or isinstance(calibration, (str, os.PathLike)):
        from lowbit.eval.corpus import calibration_batches as _windows

        tok = tokenizer if tokenizer is not None else _auto_tokenizer(model)
        return _windows(tok, n_samples=n_samples, seq_len=seq_len, seed=seed, text_file=calibration)
    if isinstance(calibration, torch.Tensor):
        calibration = [calibration]
    if not isinstance(calibration, (list, tuple)) or not calibration:
        raise TypeError("calibration must be None, a text file path, or a non-empty list of token-id tensors, "
                        f"got {type(calibration).__name__}")
    vocab = getattr(model.config, "vocab_size", None)
    out = []
    for i, t in enumerate(calibration):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"calibration[{i}] must be an int64/int32 tensor of token ids")
        if t.ndim == 1:
            t = t.unsqueeze(0)
        if t.ndim != 2 or t.shape[1] < 1:
            raise ValueError(f"calibration[{i}] must have shape [S] or [B, S], got {list(t.shape)}")
        if vocab is not None and t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
            raise ValueError(f"calibration[{i}] has token ids outside [0, {vocab})")
        out.extend(row.unsqueeze(0).long() for row in t)
    return out


def _progress(it, desc: str, enabled: bool, total: int | None = None):
    if not enabled:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, unit="layer", total=total)


def quantize_linears(model, scheme: str, *, skip=(), progress: bool = True, recipe: str = "custom",
                     **options) -> nn.Module:
    """Replace the seven linears of every decoder layer by ``lowbit.quantize_linear(lin, scheme,
    **options)`` (MoE layers: the experts, ``_quantize_experts``); embeddings and ``lm_head`` stay float. Returns
    ``model``."""
    from lowbit import quantize_linear, registry
    from lowbit.models.arch import decoder_layers

    entry = registry.get("linear", scheme)
    mod, _, _ = entry.target.partition(":")
    _need(recipe, mod)  # clear NotImplementedError while the scheme's module is not written
    views = decoder_layers(model)
    bad = set(skip) - {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    if bad:
        raise ValueError(f"skip has unknown linear roles {sorted(bad)}")
    for view in _progress(views, f"{recipe}: {scheme} linears", progress, len(views)):
        for role, lin in view.linears().items():
            if role in skip or not isinstance(lin, nn.Linear):
                continue
            view.set_linear(role, quantize_linear(lin, scheme, **options))
        _quantize_experts(view, scheme, skip, options)
    return model


MLP_ROLES = ("gate_proj", "up_proj", "down_proj")


def _quantize_experts(view, scheme: str, skip, options: dict) -> None:
    """A mixture-of-experts layer's float experts -> ``lowbit.nn.moe.QuantExperts`` (each expert's gate_up and down
    through ``scheme`` with the linears' options). Experts stay float when ``skip`` names any MLP role (an
    expert's gate and up are one matrix). A shared expert's gate / up / down (Qwen2-MoE) are quantized as a dense
    MLP's, role by role; its ``[1, H]`` gate stays float, as the router."""
    if view.experts is None:
        return
    from lowbit import quantize_linear

    for role, lin in view.shared_linears().items():
        if role.removeprefix("shared.") not in skip and isinstance(lin, nn.Linear):
            view.set_linear(role, quantize_linear(lin, scheme, **options))
    if set(MLP_ROLES) & set(skip) or not hasattr(view.experts, "gate_up_proj"):
        return
    from lowbit.nn.moe import QuantExperts

    view.set_experts(QuantExperts.from_experts(view.experts, scheme, **options))


def quantize_experts(model, scheme: str, *, skip=(), **options) -> nn.Module:
    """``_quantize_experts`` on every MoE layer of ``model`` whose experts are still float (after a pass that
    quantized the other linears itself, e.g. learned NF scales). Returns ``model``."""
    from lowbit.models.arch import decoder_layers

    for view in decoder_layers(model):
        _quantize_experts(view, scheme, skip, options)
    return model


def _check_common(recipe: str, model, linear, kv, attention):
    from lowbit import registry

    if is_quantized(model):
        raise ValueError(f"recipe {recipe}: model is already quantized ({recipe_info(model) or 'QuantLinear modules'}); "
                         "load the float model again")
    if linear is not None:
        registry.get("linear", linear)
    if kv not in KV_CHOICES:
        raise ValueError(f"kv must be one of 'kv4', 'kv4-zp' or None, got {kv!r}")
    if attention is not None:
        registry.get("attention", attention)


def _install_attention(recipe: str, model, *, kv, attention, rope_kv=None, **options):
    if kv is None and attention is None:
        return model
    install = _need(recipe, "lowbit.models.hf_attention", "install_quantized_attention")
    out = _call(install, model, kv=kv, prefill=attention or "sdpa", rope_kv=rope_kv, **options)
    return out if out is not None else model


def _record(model, recipe: str, options: dict, **extra) -> None:
    info = {"recipe": recipe, "options": _json_safe(options)}
    info.update(extra)
    model.lowbit_recipe = info


def _seeded(seed: int):
    torch.manual_seed(seed)


UNGROUPED_SCHEMES = ("w8",)  # linear schemes without weight groups: the recipes' group_size does not apply


def _linear_opts(group_size, linear_options, scheme=None, **more):
    """The linear scheme's options: ``linear_options``, then the recipe's ``group_size`` (for schemes with groups:
    ``linear="w8"`` with the recipes' default group size raised a TypeError before session 39, a review finding)
    and ``more``."""
    opts = dict(linear_options or {})
    if group_size is not None and scheme not in UNGROUPED_SCHEMES:
        opts.setdefault("group_size", group_size)
    for k, v in more.items():
        if v is not None:
            opts.setdefault(k, v)
    return opts


# ----------------------------------------------------------------------------------- recipes
@torch.no_grad()
def fireq(model, calibration=None, *, linear: str | None = "w4a8-fp8", kv: str | None = "kv4",
          attention: str | None = "fp8", group_size: int = 128, cas: bool = True, pts: bool = True,
          rpn: bool = True, crs: bool = True, alpha: float = 8.0, beta: float = 8.0, top_k: int | None = None,
          cas_options: dict | None = None, linear_options: dict | None = None, skip=(), fuse_mlp: bool = False,
          pts_scope: str = "fused", lm_head: bool | dict | str = False, gptq: bool | dict = False,
          seed: int = 0, n_samples: int = 16, seq_len: int = 512, tokenizer=None, progress: bool = True):
    """FireQ (seed 000): W4A8-FP linears (INT4 weights, FP8 E4M3 g128 scales, FP8 per-token
    activations) with CAS + PTS, a post-RoPE INT4 KV cache with RPN + CRS, FP8 prefill attention.

    Ablations are one call each: ``cas=False``, ``pts=False``, ``rpn=False``, ``crs=False``,
    ``kv=None`` (float KV), ``linear=None`` (float linears). ``alpha``/``beta`` are RPN/CRS's
    constants (8, App. E); ``top_k`` = CRS outlier pairs per KV head (None = the kv4 area's default:
    8 for head_dim 128). ``fuse_mlp=True`` replaces each MLP by ``lowbit.nn.w4a8_fp8.fuse_mlp``'s
    fused gate_up (SiLU*mul in the GEMM epilogue) + down. ``pts_scope='fused'`` (default) gives
    q/k/v one PTS exponent and gate/up one, as FireQ's code where QKV and gate_up are single
    matrices (Def. 3.2 is per weight matrix); ``'tensor'`` = one per projection. The shared
    exponent also lets ``lowbit.models.generate`` run q/k/v (and gate/up) as one GEMM.
    ``lm_head=True`` quantizes the output projection too (w4a8-fp8, its own PTS exponent; FireQ
    keeps it 16-bit, so the default is off; see docs/sections/model.md for its cost).
    ``gptq=True`` (or a dict of ``damp`` / ``act_order``) picks the linears' codes by GPTQ instead of round to
    nearest (``lowbit.ptq.gptq``; not in FireQ), under the same scale rule and PTS exponents.
    """
    _check_common("fireq", model, linear, kv, attention)
    _seeded(seed)
    options = dict(linear=linear, kv=kv, attention=attention, group_size=group_size, cas=cas, pts=pts, rpn=rpn,
                   crs=crs, alpha=alpha, beta=beta, top_k=top_k, cas_options=cas_options,
                   linear_options=linear_options, skip=list(skip), fuse_mlp=fuse_mlp, pts_scope=pts_scope,
                   lm_head=lm_head, gptq=gptq, seed=seed, n_samples=n_samples, seq_len=seq_len)
    if pts_scope not in ("fused", "tensor"):
        raise ValueError(f"pts_scope must be 'fused' or 'tensor', got {pts_scope!r}")
    if fuse_mlp and (linear != "w4a8-fp8" or skip):
        raise ValueError("fuse_mlp=True needs linear='w4a8-fp8' and no skipped linears")
    if fuse_mlp:
        _no_moe(model, "fireq: fuse_mlp=True")
    needs_rope_kv = kv is not None and (rpn or crs)
    # resolve every piece first, so a missing one fails before the model is touched
    apply_cas = _need("fireq", "lowbit.ptq.cas", "apply_cas") if (cas and linear is not None) else None
    calibrate = _need("fireq", "lowbit.ptq.rope_kv", "calibrate_rpn_crs") if needs_rope_kv else None
    if linear is not None:
        from lowbit import registry

        _need("fireq", registry.get("linear", linear).target.partition(":")[0])
    if kv is not None or attention is not None:
        _need("fireq", "lowbit.models.hf_attention", "install_quantized_attention")

    _check_gptq("fireq", gptq, linear, group_size=_linear_opts(group_size, linear_options, linear).get("group_size", 128),
                skip=skip)
    gptq_on = _gptq_on(gptq) and linear is not None
    batches = (calibration_batches(model, calibration, tokenizer=tokenizer, n_samples=n_samples, seq_len=seq_len,
                                   seed=seed) if (needs_rope_kv or gptq_on) else None)
    reports: dict = {}
    if apply_cas is not None:  # weight-only, folds Lambda^-1 into the preceding norms
        reports["cas"] = _call(apply_cas, model, **(cas_options or {}))
    rope_kv = _rope_kv(calibrate, model, batches, rpn=rpn, crs=crs, alpha=alpha, beta=beta, top_k=top_k,
                       progress=progress)
    # attention first: install_quantized_attention folds / reads the float q/k projections
    model = _install_attention("fireq", model, kv=kv, attention=attention, rope_kv=rope_kv)
    if linear is not None:
        opts = _linear_opts(group_size, linear_options, linear)
        if linear == "w4a8-fp8":
            opts.setdefault("pts", pts)
        if gptq_on:
            # the exponents the branches below will use: one per fused matrix (_quantize_shared_pts, whatever the
            # linears' own ``pts`` option), else from_linear's rule under the linears' options
            shared = pts and pts_scope == "fused" and "pts_exp" not in opts and linear == "w4a8-fp8"
            reports["gptq"] = _gptq("fireq", model, linear, batches, gptq, opts=opts, skip=skip, progress=progress,
                                    pts=True if shared else opts.get("pts", pts),
                                    pts_scope="fused" if shared else "tensor",
                                    fuse_mlp_pts=pts if fuse_mlp else None, lm_head=lm_head)
        if fuse_mlp:
            from lowbit.models.arch import decoder_layers

            fuse = _need("fireq", "lowbit.nn.w4a8_fp8", "fuse_mlp")
            views = decoder_layers(model)  # taken before the MLPs change shape
            mlp_roles = ("gate_proj", "up_proj", "down_proj")
            if pts and pts_scope == "fused" and "pts_exp" not in opts:
                _quantize_shared_pts(model, opts, skip=mlp_roles, progress=progress)
            else:
                quantize_linears(model, linear, skip=mlp_roles, progress=progress, recipe="fireq", **opts)
            for v in views:  # fused gate_up (SiLU*mul epilogue, one PTS exponent) + down
                _call(fuse, v, group_size=opts.get("group_size", group_size), pts=pts)
        elif linear == "w4a8-fp8" and pts and pts_scope == "fused" and "pts_exp" not in opts:
            _quantize_shared_pts(model, opts, skip=skip, progress=progress)
        else:
            quantize_linears(model, linear, skip=skip, progress=progress, recipe="fireq", **opts)
        if lm_head:
            _quantize_lm_head(model, linear, opts, "fireq", lm_head)
    _record(model, "fireq", options, kv=kv, attention=attention, rope_kv=rope_kv, reports=_json_safe(reports))
    return model


def _rope_kv(calibrate, model, batches, *, rpn, crs, progress, **constants):
    """RPN + CRS calibration of an INT4 KV cache (FireQ §3.2; ``calibrate`` = ``calibrate_rpn_crs`` or None)
    on the float model, RPN folded into its weights; returns the ``rope_kv`` parameters or None.
    ``constants``: alpha / beta / top_k where the recipe sets them (else ``calibrate``'s defaults)."""
    if calibrate is None:
        return None
    kw = dict(constants)
    if not crs:
        kw["top_k"] = 0  # no outlier pairs: RPN everywhere
    if _accepts(calibrate, "rpn"):
        kw["rpn"] = rpn
    if _accepts(calibrate, "crs"):
        kw["crs"] = crs
    if _accepts(calibrate, "progress"):
        kw["progress"] = progress
    rope_kv = _call(calibrate, model, batches, **kw)
    if not rpn and not _accepts(calibrate, "rpn"):
        rope_kv = _drop_rpn(rope_kv)
    fold = _optional("lowbit.ptq.rope_kv", ("fold_rpn", "fold_rope_kv", "apply_rpn"))
    if fold is not None and rope_kv is not None:
        _call(fold, model, rope_kv)
    return rope_kv


def _gptq_on(gptq) -> bool:
    return gptq is True or isinstance(gptq, dict)


def _check_gptq(name: str, gptq, linear: str | None, *, group_size, skip=()) -> None:
    """Every ``gptq=`` error before the model is touched: the value, the scheme, the group size, ``skip``."""
    if gptq is None or gptq is False:
        return
    if not (gptq is True or isinstance(gptq, dict)):
        raise ValueError(f"{name}: gptq must be a bool or a dict of 'damp' / 'act_order', got {gptq!r}")
    kw = gptq if isinstance(gptq, dict) else {}
    bad = set(kw) - {"damp", "act_order"}
    if bad:
        raise ValueError(f"{name}: gptq must be a bool or a dict of 'damp' / 'act_order', got keys {sorted(bad)}")
    damp = kw.get("damp", 0.01)
    if not isinstance(damp, (int, float)) or isinstance(damp, bool) or not 0.0 <= damp < 1.0:
        raise ValueError(f"{name}: gptq damp must be a number in [0, 1), got {damp!r}")
    if not isinstance(kw.get("act_order", True), bool):
        raise ValueError(f"{name}: gptq act_order must be a bool, got {kw['act_order']!r}")
    if linear is None:
        return
    if linear not in ("w4a8-fp8", "w4a8-int8", "lut"):
        raise ValueError(f"{name}: gptq needs linear 'w4a8-fp8', 'w4a8-int8' or 'lut', got {linear!r}")
    roles = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    if set(skip) - roles:
        raise ValueError(f"skip has unknown linear roles {sorted(set(skip) - roles)}")
    if linear == "w4a8-fp8":
        from lowbit.formats.w4a8_fp8 import GROUP_SIZES as ok
    elif linear == "lut":
        from lowbit.formats.lut import GROUP_SIZES as ok
    else:
        from lowbit.formats.w4a8_int8 import check_group_size

        check_group_size(group_size)
        return
    check_choice(group_size, f"group_size (for {linear})", ok)


def _gptq(name: str, model, scheme: str, batches, gptq, *, opts: dict, skip, progress: bool,
          pts: bool | None = None, pts_scope: str = "tensor", fuse_mlp_pts: bool | None = None,
          lm_head=False) -> dict | None:
    """GPTQ (``lowbit.ptq.gptq``) of the float decoder linears before they are quantized: ``gptq`` True or a dict
    of ``damp`` / ``act_order`` (checked by ``_check_gptq``); None when off. ``w4a8-fp8``: the PTS exponents are
    fixed first by the rule the linears will be quantized with (``_pts_plan``). Returns GPTQ's report."""
    if not _gptq_on(gptq):
        return None
    kw = dict(gptq) if isinstance(gptq, dict) else {}
    run = _need(name, "lowbit.ptq.gptq", "apply_gptq")
    if pts is None:  # quantize_linears -> from_linear: PTS unless the linears' options turn it off (default on)
        pts = opts.get("pts", True)
    fmt = {k: opts[k] for k in ("bits", "table", "dtype") if k in opts and scheme == "lut"}
    plan = (_pts_plan(model, opts, pts=pts, pts_scope=pts_scope, fuse_mlp_pts=fuse_mlp_pts, skip=skip)
            if scheme == "w4a8-fp8" else None)
    head = None
    if lm_head:  # the head by GPTQ too when its scheme is one GPTQ knows (not "w8")
        hs, ho = _lm_head_spec(scheme, opts, lm_head)
        w = model.get_output_embeddings().weight
        if hs in ("w4a8-fp8", "w4a8-int8", "lut") and isinstance(model.get_output_embeddings(), nn.Linear):
            from lowbit.ptq.pts import exponent_for

            head = {"scheme": hs, "group_size": ho.get("group_size", 128),
                    "options": {k: ho[k] for k in ("bits", "table", "dtype") if k in ho and hs == "lut"}}
            if hs == "w4a8-fp8":
                head["pts_exp"] = exponent_for(w.detach(), head["group_size"], pts=ho.get("pts", True),
                                               pts_exp=ho.get("pts_exp"))
    return _call(run, model, scheme, batches, group_size=opts.get("group_size", 128), options=fmt,
                 pts_exps=plan, skip=tuple(skip), progress=progress, head=head, **kw)


def _pts_plan(model, opts: dict, *, pts: bool, pts_scope: str, fuse_mlp_pts: bool | None = None, skip=()) -> dict:
    """``{(layer index, role): n}`` (experts: ``(layer index, "experts.gate_up" | "experts.down", expert)``): the
    PTS exponent each w4a8-fp8 matrix will be quantized with (the rules of ``_quantize_shared_pts`` and
    ``W4A8FP8Linear.from_weight``), for GPTQ to quantize under it. ``fuse_mlp_pts`` (not None under ``fuse_mlp``):
    the MLP follows ``lowbit.nn.w4a8_fp8.fuse_mlp``, which reads only the recipe's ``pts`` (gate / up one exponent,
    down its own; 0 without PTS), not the linears' options."""
    from lowbit.models.arch import decoder_layers
    from lowbit.ptq.pts import exponent_for, pts_exponent

    g = opts.get("group_size", 128)
    plan: dict = {}
    for v in decoder_layers(model):
        lins = {r: m for r, m in {**v.linears(), **v.shared_linears()}.items()
                if isinstance(m, nn.Linear) and r.removeprefix("shared.") not in skip}
        for group in INPUT_GROUPS:
            roles = [r for r in group if r in lins]
            if not roles:
                continue
            if fuse_mlp_pts is not None and group in (("gate_proj", "up_proj"), ("down_proj",)):
                es = ([pts_exponent(torch.cat([lins[r].weight.detach() for r in roles], 0), g)] * len(roles)
                      if fuse_mlp_pts else [0] * len(roles))
            elif pts_scope == "fused" and pts and "pts_exp" not in opts:
                es = [pts_exponent(torch.cat([lins[r].weight.detach() for r in roles], 0), g)] * len(roles)
            else:
                es = [exponent_for(lins[r].weight.detach(), g, pts=pts, pts_exp=opts.get("pts_exp")) for r in roles]
            plan.update({(v.index, r): e for r, e in zip(roles, es)})
        if v.experts is not None and hasattr(v.experts, "gate_up_proj"):  # each expert matrix its own exponent
            from lowbit.nn.moe import experts_weights

            for key, mats in zip(("gate_up", "down"), experts_weights(v.experts)):
                for e in range(mats.shape[0]):
                    plan[(v.index, f"experts.{key}", e)] = exponent_for(  # (from_linear under the linears' options)
                        mats[e].detach(), g, pts=opts.get("pts", True), pts_exp=opts.get("pts_exp"))
    return plan


def _no_moe(model, what: str) -> None:
    from lowbit.models.arch import decoder_layers

    moe = [v.index for v in decoder_layers(model) if v.experts is not None]
    if moe:
        raise ValueError(f"{what} fuses dense gate / up projections; layers {moe[:8]} are mixture-of-experts MLPs")


def _quantize_shared_pts(model, opts: dict, *, skip=(), progress: bool = True) -> None:
    """w4a8-fp8 linears with one PTS exponent per fused matrix (q/k/v; gate/up; a Qwen2-MoE shared expert's
    gate/up)."""
    from lowbit import quantize_linear
    from lowbit.models.arch import decoder_layers
    from lowbit.ptq.pts import pts_exponent

    views = decoder_layers(model)
    g = opts.get("group_size", 128)
    for v in _progress(views, "fireq: w4a8-fp8 linears", progress, len(views)):
        lins = {**v.linears(), **v.shared_linears()}
        for group in INPUT_GROUPS:
            roles = [r for r in group if r.removeprefix("shared.") not in skip and isinstance(lins.get(r), nn.Linear)]
            if not roles:
                continue
            rec = getattr(lins[roles[0]], GPTQ_ATTR, None)  # GPTQ fixed the exponent before moving the weights
            e = (int(rec.options.get("pts_exp", 0)) if rec is not None
                 else pts_exponent(torch.cat([lins[r].weight.detach() for r in roles], 0), g))
            for r in roles:
                v.set_linear(r, quantize_linear(lins[r], "w4a8-fp8", pts_exp=e, **opts))
        _quantize_experts(v, "w4a8-fp8", skip, opts)  # each expert matrix its own PTS exponent (gate_up is one)


def _lm_head_spec(scheme: str, opts: dict, lm_head) -> tuple[str, dict]:
    """The head's (scheme, options) for ``lm_head`` (see ``_quantize_lm_head``)."""
    from lowbit import registry

    if isinstance(lm_head, str):
        linear_names = [e.name for e in registry.entries("linear")]
        if lm_head not in linear_names:
            raise ValueError(f"lm_head must be False, True, a dict of linear options or one of {linear_names}, "
                             f"got {lm_head!r}")
        return lm_head, {}
    if isinstance(lm_head, dict):
        return scheme, {**opts, **lm_head}
    if lm_head is not True:
        raise TypeError(f"lm_head must be False, True, a dict of linear options or a linear scheme name, "
                        f"got {lm_head!r}")
    return scheme, opts


def _quantize_lm_head(model, scheme: str, opts: dict, recipe: str, lm_head=True) -> None:
    """``lm_head=True``: the output projection through ``scheme`` too (FireQ and QServe keep it
    16-bit: off by default); a dict (e.g. ``{"group_size": 32}``) overrides the linears' options
    for the head only; a linear scheme's name (``"w8"``: INT8 per-channel weight-only, half the
    bytes of bf16 at ~1% weight error, ``lowbit.formats.w8``) quantizes the head with that scheme's
    defaults instead. A head tied to ``embed_tokens`` is untied (the embedding stays float,
    ``config.tie_word_embeddings`` becomes False, so checkpoints rebuild it untied)."""
    from lowbit import quantize_linear

    scheme, opts = _lm_head_spec(scheme, opts, lm_head)
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"recipe {recipe}: lm_head=True needs an nn.Linear lm_head, got {type(head).__name__}")
    if getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False
    q = quantize_linear(head, scheme, **opts)
    model.set_output_embeddings(q)


def _optional(module: str, names) -> Callable | None:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    for n in names:
        f = getattr(mod, n, None)
        if callable(f):
            return f
    return None


def _drop_rpn(params):
    """Disable the RPN half of RoPE-KV parameters whose calibration has no ``rpn=`` switch: RPN
    scales become 1 (CRS scales kept)."""
    if params is None:
        return None
    out = []
    for p in params:
        if isinstance(p, dict):
            p = dict(p)
            for k in list(p):
                if "rpn" in k and isinstance(p[k], torch.Tensor):
                    p[k] = torch.ones_like(p[k])
        elif hasattr(p, "__dataclass_fields__"):
            import dataclasses

            p = dataclasses.replace(p, **{k: torch.ones_like(getattr(p, k)) for k in p.__dataclass_fields__
                                         if "rpn" in k and isinstance(getattr(p, k), torch.Tensor)})
        out.append(p)
    return out


@torch.no_grad()
def qserve(model, calibration=None, *, linear: str | None = "w4a8-int8", kv: str | None = "kv4-zp",
           attention: str | None = "sdpa", group_size: int = 128, smooth: bool = True, smooth_alpha: float = 0.5,
           smoothquant: bool = False, smoothquant_alpha: float = 0.5, linear_options: dict | None = None, skip=(),
           lm_head: bool | dict | str = False, gptq: bool | dict = False, seed: int = 0, n_samples: int = 16,
           seq_len: int = 512, tokenizer=None, progress: bool = True):
    """QServe / QoQ (W4A8KV4): progressive INT4->INT8 g128 weights with INT8 per-token activations,
    SmoothAttention on keys (``smooth``), optional SmoothQuant on linear inputs (``smoothquant``),
    INT4 KV cache with zero points. Prefill attention defaults to float SDPA (QServe's own).
    ``lm_head=True`` quantizes the output projection too (QServe keeps it 16-bit: off by default).
    ``gptq=True`` (or a dict of ``damp`` / ``act_order``): the codes by GPTQ (``lowbit.ptq.gptq``; QServe rounds to
    nearest), under the same progressive scale rule."""
    _check_common("qserve", model, linear, kv, attention)
    _seeded(seed)
    options = dict(linear=linear, kv=kv, attention=attention, group_size=group_size, smooth=smooth,
                   smooth_alpha=smooth_alpha, smoothquant=smoothquant, smoothquant_alpha=smoothquant_alpha,
                   linear_options=linear_options, skip=list(skip), lm_head=lm_head, gptq=gptq, seed=seed,
                   n_samples=n_samples, seq_len=seq_len)
    _check_gptq("qserve", gptq, linear, group_size=_linear_opts(group_size, linear_options, linear).get("group_size", 128),
                skip=skip)
    gptq_on = _gptq_on(gptq) and linear is not None
    sa = _need("qserve", "lowbit.ptq.smooth_attention", "apply_smooth_attention") if smooth else None
    sq = _need("qserve", "lowbit.ptq.smoothquant", "apply_smoothquant") if smoothquant else None
    if linear is not None:
        from lowbit import registry

        _need("qserve", registry.get("linear", linear).target.partition(":")[0])
    if kv is not None or attention is not None:
        _need("qserve", "lowbit.models.hf_attention", "install_quantized_attention")
    batches = (calibration_batches(model, calibration, tokenizer=tokenizer, n_samples=n_samples, seq_len=seq_len,
                                   seed=seed) if (sa or sq or gptq_on) else None)
    reports: dict = {}
    key_scales = None  # SmoothAttention's λ on q/k-norm layers (Qwen3): applied by the cache after RoPE
    if sa is not None:
        reports["smooth_attention"] = _call(sa, model, batches, alpha=smooth_alpha)
        if kv is not None:
            from lowbit.ptq.smooth_attention import online_params

            key_scales = online_params(model, reports["smooth_attention"])
    if sq is not None:
        reports["smoothquant"] = _call(sq, model, batches, alpha=smoothquant_alpha)
    model = _install_attention("qserve", model, kv=kv, attention=attention, rope_kv=key_scales)
    if linear is not None:
        if gptq_on:
            reports["gptq"] = _gptq("qserve", model, linear, batches, gptq, skip=skip, progress=progress,
                                    opts=_linear_opts(group_size, linear_options, linear), lm_head=lm_head)
        quantize_linears(model, linear, skip=skip, progress=progress, recipe="qserve",
                         **_linear_opts(group_size, linear_options, linear))
        if lm_head:
            _quantize_lm_head(model, linear, _linear_opts(group_size, linear_options, linear), "qserve", lm_head)
    _record(model, "qserve", options, kv=kv, attention=attention, rope_kv=key_scales, reports=_json_safe(reports))
    return model


def _flute(name: str, bits: int, model, calibration, *, linear, kv, attention, group_size, table, learn_scales,
           lr, epochs, linear_options, skip, seed, n_samples, seq_len, tokenizer, progress, lm_head=False,
           rpn=True, crs=True, fuse_mlp=None, gptq=False):
    _check_common(name, model, linear, kv, attention)
    _seeded(seed)
    options = dict(linear=linear, kv=kv, attention=attention, group_size=group_size, bits=bits, table=table,
                   learn_scales=learn_scales, lr=lr, epochs=epochs, linear_options=linear_options, skip=list(skip),
                   seed=seed, n_samples=n_samples, seq_len=seq_len, lm_head=lm_head, rpn=rpn, crs=crs)
    if fuse_mlp is not None:  # (recorded only when given)
        options["fuse_mlp"] = bool(fuse_mlp)
    _check_gptq(name, gptq, linear, group_size=_linear_opts(group_size, linear_options, linear).get("group_size", 128),
                skip=skip)
    gptq_on = _gptq_on(gptq) and linear is not None
    if _gptq_on(gptq):  # (recorded only when on)
        options["gptq"] = gptq
    if gptq_on and learn_scales:
        raise ValueError(f"{name}: gptq and learn_scales are two ways to pick the weights; choose one")
    if fuse_mlp and (linear != "lut" or {"gate_proj", "up_proj"} & set(skip)):
        raise ValueError(f"{name}: fuse_mlp=True needs linear='lut' with gate_proj / up_proj quantized")
    if fuse_mlp:
        _no_moe(model, f"{name}: fuse_mlp=True")
    fuse = _need(name, "lowbit.nn.lut", "fuse_mlp") if (fuse_mlp is not False and linear == "lut") else None
    learn = _need(name, "lowbit.ptq.nfl", "learn_nf_scales") if learn_scales else None
    needs_rope_kv = kv is not None and (rpn or crs)  # (kv is an INT4 cache here: _check_common)
    calibrate = _need(name, "lowbit.ptq.rope_kv", "calibrate_rpn_crs") if needs_rope_kv else None
    if linear is not None:
        from lowbit import registry

        _need(name, registry.get("linear", linear).target.partition(":")[0])
    if kv is not None or attention is not None:
        _need(name, "lowbit.models.hf_attention", "install_quantized_attention")
    if isinstance(table, torch.Tensor):
        options["table"] = table.tolist()
    reports: dict = {}
    batches = None
    if needs_rope_kv or learn is not None or gptq_on:
        batches = calibration_batches(model, calibration, tokenizer=tokenizer, n_samples=n_samples, seq_len=seq_len,
                                      seed=seed)
    # an INT4 cache gets FireQ's RPN + CRS (calibrated on the float model, as in the fireq recipe)
    rope_kv = _rope_kv(calibrate, model, batches, rpn=rpn, crs=crs, progress=progress)
    model = _install_attention(name, model, kv=kv, attention=attention, rope_kv=rope_kv)
    opts = _linear_opts(group_size, linear_options, linear)
    if linear == "lut":
        opts.setdefault("bits", bits)
        opts.setdefault("table", table)
    # learned NF on LUT weights = FLUTE §4.2's STE on the float weights: learn_nf_scales trains the
    # scales through the straight-through estimator and quantizes the linears itself (codes re-chosen
    # under the learned scales). Quantizing first would leave it only the frozen-codes mode.
    ste = learn is not None and linear == "lut"
    if gptq_on:
        reports["gptq"] = _gptq(name, model, linear, batches, gptq, opts=opts, skip=skip, progress=progress,
                                lm_head=lm_head)
    if linear is not None and not ste:
        quantize_linears(model, linear, skip=skip, progress=progress, recipe=name, **opts)
    if learn is not None:
        extra = dict(opts, skip=tuple(skip)) if ste else {}
        reports["nfl"] = _call(learn, model, batches, lr=lr, epochs=epochs, seed=seed, progress=progress, **extra)
        if ste:  # learned NF covers the layers' linears; MoE experts get round-to-nearest NF scales
            quantize_experts(model, linear, skip=skip, **opts)
    if lm_head and linear is not None:  # after learned NF: the head keeps its RTN NF scales
        _quantize_lm_head(model, linear, opts, name, lm_head)
    if fuse is not None:  # the quantized gate / up (learned scales included) restacked: same weights
        from lowbit.models.arch import decoder_layers

        fused = 0
        for v in decoder_layers(model):
            if v.experts is not None:  # an MoE MLP has no gate / up pair to fuse
                continue
            try:
                _call(fuse, v)
                fused += 1
            except (TypeError, ValueError):
                if fuse_mlp:  # asked for: every layer must fuse
                    raise
        reports["fused_mlp_layers"] = fused
    _record(model, name, options, kv=kv, attention=attention, rope_kv=rope_kv, reports=_json_safe(reports))
    return model


@torch.no_grad()
def flute_nf4(model, calibration=None, *, linear: str | None = "lut", kv: str | None = None,
              attention: str | None = None, group_size: int = 128, table="nf", learn_scales: bool = False,
              lr: float = 1e-4, epochs: int = 1, linear_options: dict | None = None, skip=(), seed: int = 0,
              n_samples: int = 16, seq_len: int = 512, tokenizer=None, progress: bool = True,
              lm_head: bool | dict | str = False, rpn: bool = True, crs: bool = True, fuse_mlp: bool | None = None,
              gptq: bool | dict = False):
    """FLUTE (seed 001): 4-bit NormalFloat lookup-table weights, g128, activations in the model's
    float dtype; ``learn_scales=True`` runs Learned NormalFloat (needs calibration). ``lm_head=True`` (or
    a dict of head-only linear options) quantizes the output projection too (RTN NF scales; FLUTE
    keeps it 16-bit: off by default). FLUTE is weight-only: the KV cache stays in the model's dtype unless
    ``kv=`` names one; an INT4 cache (``kv="kv4"`` / ``"kv4-zp"``) then gets FireQ's RPN + CRS calibration
    (``rpn`` / ``crs``, on by default; calibration windows as for ``fireq``). ``fuse_mlp``: each MLP's quantized
    gate / up restacked into one ``LUTLinear`` with SiLU*mul from the GEMM (``lowbit.nn.lut.fuse_mlp``; the same
    weights, a ``FusedMLP``), one launch in the fast runner; None (default) = wherever a layer fits (SiLU, LUT gate /
    up of one config, no bias, out_features a multiple of 8; the count is in the recipe report), True = every
    layer or an error, False = never. Decision (session 26, H200, Llama-3-8B shapes, decode ctx 1k, CUDA graphs,
    two decoder layers without the head, fused vs unfused in three runs, ``model_s26_final_{a,b,c}.json``, ms):
    batch 64 0.4042 / 0.4066 / 0.4061 vs 0.4130 / 0.4124 / 0.4128, batch 16 0.2252 / 0.2250 vs 0.2267 / 0.2290,
    batch 1 0.1470 / 0.1533 / 0.1468 vs 0.1489 / 0.1465 / 0.1474 (within the run-to-run spread).
    ``gptq=True`` (or a dict of ``damp`` / ``act_order``): the codes by GPTQ under the absmax NF scales
    (``lowbit.ptq.gptq``; not in FLUTE; exclusive with ``learn_scales``)."""
    with torch.enable_grad():
        return _flute("flute-nf4", 4, model, calibration, linear=linear, kv=kv, attention=attention,
                      group_size=group_size, table=table, learn_scales=learn_scales, lr=lr, epochs=epochs,
                      linear_options=linear_options, skip=skip, seed=seed, n_samples=n_samples, seq_len=seq_len,
                      tokenizer=tokenizer, progress=progress, lm_head=lm_head, rpn=rpn, crs=crs, fuse_mlp=fuse_mlp,
                      gptq=gptq)


@torch.no_grad()
def flute_nf3(model, calibration=None, *, linear: str | None = "lut", kv: str | None = None,
              attention: str | None = None, group_size: int = 128, table="nf", learn_scales: bool = False,
              lr: float = 1e-4, epochs: int = 1, linear_options: dict | None = None, skip=(), seed: int = 0,
              n_samples: int = 16, seq_len: int = 512, tokenizer=None, progress: bool = True,
              lm_head: bool | dict | str = False, rpn: bool = True, crs: bool = True, fuse_mlp: bool | None = None,
              gptq: bool | dict = False):
    """FLUTE 3-bit NormalFloat lookup-table weights, g128 (see ``flute_nf4``)."""
    with torch.enable_grad():
        return _flute("flute-nf3", 3, model, calibration, linear=linear, kv=kv, attention=attention,
                      group_size=group_size, table=table, learn_scales=learn_scales, lr=lr, epochs=epochs,
                      linear_options=linear_options, skip=skip, seed=seed, n_samples=n_samples, seq_len=seq_len,
                      tokenizer=tokenizer, progress=progress, lm_head=lm_head, rpn=rpn, crs=crs, fuse_mlp=fuse_mlp,
                      gptq=gptq)


@torch.no_grad()
def int8_attention(model, calibration=None, *, linear: str | None = None, kv: str | None = None,
                   attention: str | None = "int8", group_size: int = 128, linear_options: dict | None = None,
                   skip=(), seed: int = 0, progress: bool = True, **unused_calibration_options):
    """INT-FlashAttention (seed 002): INT8 prefill attention (per-token Q/K, per-block V scales),
    weights float unless ``linear=`` names a scheme. Calibration-free. Decode steps attend in float over the float
    cache, on transformers' path and in the fast runner alike (INT-FlashAttention is a prefill kernel)."""
    _check_common("int8-attention", model, linear, kv, attention)
    _seeded(seed)
    bad = set(unused_calibration_options) - {"n_samples", "seq_len", "tokenizer"}
    if bad:
        raise TypeError(f"int8_attention got unexpected options {sorted(bad)}")
    options = dict(linear=linear, kv=kv, attention=attention, group_size=group_size, linear_options=linear_options,
                   skip=list(skip), seed=seed)
    if linear is not None:
        from lowbit import registry

        _need("int8-attention", registry.get("linear", linear).target.partition(":")[0])
    if attention is not None:
        _need("int8-attention", "lowbit.ops.attention_prefill")
    _need("int8-attention", "lowbit.models.hf_attention", "install_quantized_attention")
    model = _install_attention("int8-attention", model, kv=kv, attention=attention)
    if linear is not None:
        quantize_linears(model, linear, skip=skip, progress=progress, recipe="int8-attention",
                         **_linear_opts(group_size, linear_options, linear))
    _record(model, "int8-attention", options, kv=kv, attention=attention, rope_kv=None)
    return model


@torch.no_grad()
def fp8_mla(model, calibration=None, *, seed: int = 0, progress: bool = True, **options):
    """SnapMLA (seed 003): DeepSeek MLA models get a per-token FP8 latent cache with a bf16 RoPE
    part (``lowbit.models.deepseek.install_fp8_mla``). Llama-family models are refused."""
    mt = getattr(model.config, "model_type", "")
    if "deepseek" not in str(mt) and not hasattr(model.config, "kv_lora_rank"):
        raise ValueError(f"recipe fp8-mla needs a DeepSeek MLA model (config.kv_lora_rank), got model_type {mt!r}")
    if is_quantized(model):
        raise ValueError("recipe fp8-mla: model is already quantized")
    _seeded(seed)
    install = _need("fp8-mla", "lowbit.models.deepseek", "install_fp8_mla")
    out = install(model, **options)
    model = out if out is not None else model
    _record(model, "fp8-mla", dict(options, seed=seed), kv="fp8-mla", attention=None, rope_kv=None)
    return model
