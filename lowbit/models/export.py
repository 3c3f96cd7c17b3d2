"""Export to compressed-tensors checkpoints (the format vLLM loads) for users who outgrow one GPU.

    from lowbit.models.export import export_compressed_tensors, verify_export
    report = export_compressed_tensors(model, "out_dir", kv_cache="fp8", calibration=batches)
    verify_export("out_dir", model)   # dequantizes with the compressed-tensors package itself

Needs ``pip install lowbit[export]`` (the ``compressed-tensors`` package: its int32 packing,
quantization schemes and config classes are used, so the files follow the installed version).

What maps (decided per module, reported in ``lowbit_export.json``):

================  ========================================================  ==========================
lowbit format     compressed-tensors form                                   exact?
================  ========================================================  ==========================
``w4a8-fp8``      W4AFP8 preset: INT4 symmetric, group 128 (``weight_       codes exact; the value is
(FireQ)           packed`` int32, ``weight_scale`` bf16 = sigma_FP8 x       q x sigma: equal to lowbit's
                  delta^-1), FP8 E4M3 per-token dynamic activations         FP8(q x sigma) wherever that
                                                                            product is an E4M3 number
                                                                            (always for sigma = 2^e);
                                                                            elsewhere lowbit's LUT
                                                                            entry is the product
                                                                            rounded to FP8 (<= 2^-4
                                                                            relative): reported
``w4a8-int8``     W4A8 with asymmetric INT4 g128 weights (``weight_zero_    exact when every scaled
(QServe QoQ)      point``), ``weight_scale`` fp32 = s1 x s2, INT8           zero zs is a multiple of
                  per-token dynamic activations                             s2 (QoQ's own rule)
``w8`` (INT8      W8A16: INT8 symmetric channel-wise weights (``weight_    exact
weight-only)      packed`` int32, ``weight_scale`` fp32 [N, 1]), 16-bit
                  activations (lowbit's two INT8 activation planes are
                  its kernel's arithmetic, not part of the format)
``lut`` (FLUTE    not representable: compressed-tensors has uniform INT /   ``fallback='dense'`` writes
NF4 / NF3)        FP / MX grids only, no per-model codebooks                the dequantized weights
                                                                            in the model dtype
KV ``kv4``        not representable (no INT4 per-token KV cache); with      FP8 per-tensor K/V scales
(INT4 KV)         ``kv_cache='fp8'`` the export asks vLLM for an FP8 KV     from calibration absmax
                  cache instead (``kv_cache_scheme``, per-layer ``self_     / 448 (1.0 without
                  attn.k_scale`` / ``v_scale``)                             calibration)
================  ========================================================  ==========================

Folded transforms stay exact: CAS (in the RMSNorms and weights), RPN and SmoothAttention (in
q/k_proj), PTS (in ``weight_scale``). CRS is dropped: it scales keys by t and queries by 1/t
after RoPE, so ``q . k`` is unchanged in float attention; it only existed for the INT4 cache.
vLLM itself is not installed here, so loading by vLLM is not verified; the package's own
decompression is (``verify_export``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["export_compressed_tensors", "verify_export", "ExportError"]


class ExportError(ValueError):
    """A module or option cannot be expressed as compressed-tensors."""


def _ct():
    try:
        import compressed_tensors  # noqa: F401
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
        from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    except ImportError:
        raise ImportError("export needs the compressed-tensors package: pip install 'lowbit[export]'") from None
    return pack_to_int32, QuantizationArgs, QuantizationConfig, QuantizationScheme


def _w4a8_fp8_tensors(mod, pack):
    """(tensors, group_size, exact_fraction, max_rel) of a W4A8FP8Linear (rows [N, K])."""
    from lowbit.formats.w4a8_fp8 import dequantize_weight, unpack_codes

    k, g = mod.in_features, mod.group_size
    if k % g:
        raise ExportError(f"in_features {k} is not a multiple of group_size {g}")
    q = unpack_codes(mod.codes, k).to(torch.int8)  # [-7, 7]
    scale = mod.scales[:, : k // g].float() * mod.inv_delta  # exact: E4M3 value x 2^-n (drop padded groups)
    ours = dequantize_weight(mod.codes, mod.scales, k, g) * mod.inv_delta
    theirs = q.float() * scale.repeat_interleave(g, 1)
    same = ours == theirs
    rel = ((ours - theirs).norm() / ours.norm().clamp_min(1e-30)).item()
    t = {"weight_packed": pack(q, 4), "weight_scale": scale.to(torch.bfloat16),
         "weight_shape": torch.tensor([q.shape[0], k])}
    return t, g, same.float().mean().item(), rel


def _w4a8_int8_tensors(mod, pack):
    from lowbit.formats import w4a8_int8 as fmt

    k = mod.in_features
    g = mod.group_size if mod.group_size != -1 else None
    codes = fmt.untile_codes(mod.qweight) if getattr(mod, "tiled", False) else mod.qweight
    q4 = fmt.unpack_codes(codes).to(torch.int32)  # [N, Kp] in [0, 15], natural column order
    s2 = mod.gscale.to(torch.int32)
    zs = mod.gzs.to(torch.int32)
    if (zs % s2.clamp_min(1)).any():
        raise ExportError("QoQ scaled zeros are not multiples of the group scales: no integer zero point")
    z = zs // s2.clamp_min(1)
    if g is None or k % g:
        raise ExportError(f"w4a8-int8 export needs group quantization with in_features % group_size == 0 "
                          f"(group_size={mod.group_size}, in_features={k})")
    q4 = q4[:, :k]
    scale = mod.wscale.float()[:, None] * s2.float()  # [N, G]
    t = {"weight_packed": pack((q4 - 8).to(torch.int8), 4), "weight_scale": scale,
         "weight_zero_point": pack((z - 8).to(torch.int8), 4, packed_dim=0),
         "weight_shape": torch.tensor([q4.shape[0], k])}
    return t, g


def _w8_tensors(mod, pack):
    """W8A16: INT8 channel-wise symmetric codes packed 4 per int32, ``weight_scale`` fp32 [N, 1] (exact)."""
    t = {"weight_packed": pack(mod.codes, 8), "weight_scale": mod.scale.float()[:, None],
         "weight_shape": torch.tensor([mod.codes.shape[0], mod.in_features])}
    return t


class _DenseHalf:
    """One half of a fused gate_up whose scheme has no compressed-tensors form: its dequantized rows (written by
    ``fallback='dense'``, or refused naming the scheme)."""

    bias = None

    def __init__(self, scheme: str, w: torch.Tensor):
        self.scheme, self._w = scheme, w

    def dequantize(self) -> torch.Tensor:
        return self._w


def _split_fused(name, mod):
    """A fused gate_up (rows interleaved, SiLU*mul epilogue) -> its gate_proj / up_proj halves."""
    import copy

    from lowbit.formats.common import split_interleaved

    parent = name.rsplit(".", 1)[0]
    if mod.scheme != "w4a8-fp8":  # (lut: written dense, if at all)
        g, u = split_interleaved(mod.dequantize(), getattr(mod, "interleave", 1), dim=0)
        return [(f"{parent}.gate_proj", _DenseHalf(mod.scheme, g)), (f"{parent}.up_proj", _DenseHalf(mod.scheme, u))]
    halves = []
    for role, sl in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
        h = copy.copy(mod)
        h._buffers = dict(mod._buffers)
        h._buffers["codes"] = mod.codes[sl]
        h._buffers["scales"] = mod.scales[sl]
        if mod.bias is not None:
            h._buffers["bias"] = mod.bias[sl]
        h.activation = None
        halves.append((f"{parent}.{role}", h))
    return halves


@torch.no_grad()
def _kv_scales(model, calibration) -> dict[int, tuple[float, float]]:
    """Per-layer FP8 K/V scales = absmax / 448 over the calibration batches. Keys are measured
    before RoPE as the max pair norm (RoPE preserves pair norms, so it bounds |k| after RoPE)."""
    from lowbit.models.arch import decoder_layers
    from lowbit.ptq.calibration import hooks, run_batches

    views = decoder_layers(model)
    stats: dict[str, float] = {}

    def fn(name, mod, inp, out):
        y = out.detach().float()
        if name.endswith("k"):
            i = int(name[:-1])
            d = views[i].head_dim
            y = y.reshape(*y.shape[:-1], -1, d)
            a, b = y[..., : d // 2], y[..., d // 2:]
            m = (a * a + b * b).sqrt().amax().item()
        else:
            m = y.abs().amax().item()
        stats[name] = max(stats.get(name, 0.0), m)

    mods = {}
    for v in views:
        mods[f"{v.index}k"] = v.k_proj
        mods[f"{v.index}v"] = v.v_proj
    with hooks(mods, fn):
        run_batches(model, calibration)
    return {v.index: (max(stats[f"{v.index}k"], 1e-12) / 448.0, max(stats[f"{v.index}v"], 1e-12) / 448.0)
            for v in views}


def export_compressed_tensors(model, path, *, kv_cache: str | None = None, calibration=None,
                              fallback: str | None = None, tokenizer=None) -> dict:
    """Write ``model`` as a compressed-tensors checkpoint in ``path`` (config.json,
    model.safetensors, lowbit_export.json). ``kv_cache``: None or 'fp8'. ``fallback``: None
    (refuse formats that do not map) or 'dense' (write them dequantized). Returns the report."""
    from safetensors.torch import save_file

    from lowbit.nn.base import QuantLinear

    pack, QArgs, QConfig, QScheme = _ct()
    if kv_cache not in (None, "fp8"):
        raise ValueError(f"kv_cache must be None or 'fp8', got {kv_cache!r}")
    if fallback not in (None, "dense"):
        raise ValueError(f"fallback must be None or 'dense', got {fallback!r}")
    from lowbit.nn.moe import QuantExperts

    moe = [n for n, m in model.named_modules() if isinstance(m, QuantExperts)]
    if moe:
        raise NotImplementedError(f"export_compressed_tensors: quantized mixture-of-experts blocks ({moe[0]}, ...) "
                                  "have no compressed-tensors mapping in lowbit yet; use save_quantized")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    fdtype = model.get_input_embeddings().weight.dtype
    quant = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    state = {n: t for n, t in model.state_dict().items()
             if not any(n.startswith(q + ".") for q in quant)}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tensors = {n: t.detach().contiguous().cpu() for n, t in state.items()}
    groups: dict[tuple, list[str]] = {}
    report = {"modules": {}, "kv_cache": None, "dropped": []}
    for name, mod in quant.items():
        items = [(name, mod)]
        if getattr(mod, "activation", None) == "silu_mul":
            items = _split_fused(name, mod)
        for nm, m in items:
            entry = {"lowbit_scheme": m.scheme}
            if m.scheme == "w4a8-fp8":
                t, g, exact, rel = _w4a8_fp8_tensors(m, pack)
                key = ("w4afp8", g)
                entry.update(form=f"W4AFP8 g{g}", exact_fraction=exact, rel_l2_vs_lowbit=rel)
            elif m.scheme == "w4a8-int8":
                t, g = _w4a8_int8_tensors(m, pack)
                key = ("w4a8int-asym", g)
                entry.update(form=f"W4A8 int asym g{g}", exact_fraction=1.0, rel_l2_vs_lowbit=0.0)
            elif m.scheme == "w8":
                t = _w8_tensors(m, pack)
                key = ("w8a16", None)
                entry.update(form="W8A16 int channel-wise symmetric", exact_fraction=1.0, rel_l2_vs_lowbit=0.0)
            elif fallback == "dense":
                t = {"weight": m.dequantize().to(fdtype)}
                key = None
                entry.update(form=f"dense {str(fdtype).replace('torch.', '')} (fallback: {m.scheme} does not map)")
            else:
                why = ("lookup-table codebooks are not representable" if m.scheme == "lut"
                       else "this exporter writes only the W4A8 and W8A16 forms")
                raise ExportError(f"{nm}: lowbit format {m.scheme!r} has no compressed-tensors form "
                                  f"({why}); pass fallback='dense'")
            bias = getattr(m, "bias", None)
            if isinstance(bias, torch.Tensor):
                t["bias"] = bias.to(fdtype)
            for k, v in t.items():
                tensors[f"{nm}.{k}"] = v.detach().contiguous().cpu()
            if key is not None:
                groups.setdefault(key, []).append(nm)
            report["modules"][nm] = entry
    config_groups = {}
    for i, ((kind, g), names) in enumerate(sorted(groups.items())):
        if kind == "w4afp8":
            w = QArgs(num_bits=4, type="int", strategy="group", group_size=g, symmetric=True, dynamic=False)
            a = QArgs(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
        elif kind == "w8a16":  # weight-only: the activations stay 16-bit in vLLM (lowbit's two INT8 planes are
            w = QArgs(num_bits=8, type="int", strategy="channel", symmetric=True, dynamic=False)  # a kernel detail)
            a = None
        else:
            w = QArgs(num_bits=4, type="int", strategy="group", group_size=g, symmetric=False, dynamic=False)
            a = QArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
        config_groups[f"group_{i}"] = QScheme(targets=names, weights=w, input_activations=a)
    kv_scheme = None
    recipe = getattr(model, "lowbit_recipe", None) or {}
    if recipe.get("kv"):
        report["dropped"].append(f"KV cache {recipe['kv']!r}: no compressed-tensors form (INT4 per-token)")
    if recipe.get("rope_kv"):
        report["dropped"].append("post-RoPE key multipliers (CRS; RPN and SmoothAttention on q/k-norm models): "
                                 "identity for float attention (keys x t, queries x 1/t after RoPE)")
    if kv_cache == "fp8":
        kv_scheme = QArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
        scales = _kv_scales(model, calibration) if calibration is not None else None
        from lowbit.models.arch import decoder_layers

        for v in decoder_layers(model):
            ks, vs = scales[v.index] if scales else (1.0, 1.0)
            pre = f"model.layers.{v.index}.self_attn"
            tensors[f"{pre}.k_scale"] = torch.tensor(ks, dtype=torch.float32)
            tensors[f"{pre}.v_scale"] = torch.tensor(vs, dtype=torch.float32)
        report["kv_cache"] = "fp8 per-tensor, scales " + ("from calibration absmax/448" if scales else "1.0")
    qcfg = QConfig(config_groups=config_groups, kv_cache_scheme=kv_scheme, format="pack-quantized",
                   quantization_status="compressed",
                   ignore=[] if "lm_head" in quant else ["lm_head"])  # lm_head=True recipes export the head
    cfg = model.config.to_dict()
    cfg["quantization_config"] = qcfg.model_dump(exclude_none=True, mode="json")
    cfg["torch_dtype"] = str(fdtype).replace("torch.", "")
    (out / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "lowbit_export.json").write_text(json.dumps(report, indent=1))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return report


def verify_export(path, model) -> dict:
    """Dequantize every exported module with compressed-tensors' own decompressor and compare
    with lowbit's ``dequantize()``: ``{module: (exact fraction, rel L2)}``."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    from lowbit.nn.base import QuantLinear

    cfg = json.loads((Path(path) / "config.json").read_text())
    qcfg = QuantizationConfig.model_validate(cfg["quantization_config"])
    tensors = load_file(str(Path(path) / "model.safetensors"))
    ours = {}
    for n, m in model.named_modules():
        if isinstance(m, QuantLinear):
            w = m.dequantize()
            if getattr(m, "activation", None) == "silu_mul":
                from lowbit.formats.common import split_interleaved

                parent = n.rsplit(".", 1)[0]
                ours[f"{parent}.gate_proj"], ours[f"{parent}.up_proj"] = split_interleaved(
                    w, getattr(m, "interleave", 1), dim=0)
            else:
                ours[n] = w
    res = {}
    for scheme in qcfg.config_groups.values():
        for name in scheme.targets:
            sd = {k: tensors[f"{name}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape",
                                                      "weight_zero_point") if f"{name}.{k}" in tensors}
            w = PackedQuantizationCompressor.decompress(sd, scheme)["weight"].float()
            ref = ours[name]
            res[name] = ((w == ref).float().mean().item(),
                         ((w - ref).norm() / ref.norm().clamp_min(1e-30)).item())
    return res
