"""Quantized checkpoints: safetensors + versioned JSON metadata, no pickle anywhere.

A checkpoint is a directory::

    DIR/model.safetensors   every tensor of the model's state_dict (tied copies stored once),
                            plus the RoPE-KV calibration tensors under ``__lowbit__.rope_kv.*``;
                            its header ``__metadata__`` carries the SHA-256 of the JSON below
    DIR/lowbit.json         format name + version, lowbit version, recipe + options, the base
                            model's transformers config, float dtype, each tensor's name / shape /
                            dtype / format, each quantized module's class + ``config()``, tied
                            aliases, and the SHA-256 and byte size of ``model.safetensors``
    DIR/tokenizer*.json     optional (``save_quantized(..., tokenizer=tok)``), JSON only

Loading (``load_quantized``) never trusts the files: it checks the JSON's structure and version,
the weights file's size (truncation) and SHA-256 (tampering or corruption), the cross-hash of the
JSON in the safetensors header, then parses the safetensors header itself (offsets inside the
file, no overlap) before reading data. It rebuilds the model from the saved config
(``AutoConfig.for_model`` + ``AutoModelForCausalLM.from_config``: nothing is downloaded),
rebuilds lowbit's container modules (``FusedMLP``; ``QuantExperts`` from its ``container_config()``), replaces
each quantized module with ``cls.empty(in_features, out_features, bias, dtype, **config)`` (classes only from ``lowbit.*`` or registered with ``register_module_class``, and only
``QuantLinear`` subclasses), re-installs the recipe's quantized attention / KV cache, then checks
that the file holds exactly the rebuilt model's tensors with the same shapes and dtypes before
loading them. Every failure raises ``CheckpointError`` (a ``ValueError``) naming the tensor or
field at fault.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["save_quantized", "load_quantized", "load_tokenizer", "read_metadata", "CheckpointError",
           "register_module_class", "FORMAT", "FORMAT_VERSION"]

FORMAT = "lowbit-quantized-checkpoint"
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
META = "lowbit.json"
_RESERVED = "__lowbit__."
_MAX_HEADER = 256 << 20

_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}
_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I8": "int8", "U8": "uint8",
              "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
              "F8_E5M2": "float8_e5m2"}
_ST_SIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1,
            "F8_E4M3": 1, "F8_E5M2": 1}

_EXTRA_CLASSES: dict[str, type] = {}


class CheckpointError(ValueError):
    """A checkpoint is malformed, truncated, tampered with, or does not match its metadata."""


def register_module_class(cls: type) -> type:
    """Allow ``load_quantized`` to rebuild ``cls`` (a QuantLinear outside ``lowbit.*``)."""
    from lowbit.nn.base import QuantLinear

    if not (isinstance(cls, type) and issubclass(cls, QuantLinear)):
        raise TypeError("register_module_class expects a QuantLinear subclass")
    _EXTRA_CLASSES[_class_path(cls)] = cls
    return cls


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _canonical(meta: dict) -> bytes:
    body = {k: v for k, v in meta.items() if k not in ("weights_sha256", "weights_bytes")}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


# ----------------------------------------------------------------- RoPE-KV parameter encoding
def _encode(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]):
    """JSON structure for ``obj`` with tensors moved into ``tensors`` (names under ``prefix``)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        name = f"{_RESERVED}{prefix}"
        tensors[name] = obj.detach().contiguous().cpu()
        return {"__tensor__": name}
    if isinstance(obj, (list, tuple)):
        return {"__list__": [_encode(x, f"{prefix}.{i}", tensors) for i, x in enumerate(obj)],
                "tuple": isinstance(obj, tuple)}
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError(f"cannot save {prefix}: dict keys must be strings")
        return {"__dict__": {k: _encode(v, f"{prefix}.{k}", tensors) for k, v in obj.items()}}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        if not cls.__module__.startswith("lowbit."):
            raise TypeError(f"cannot save {prefix}: dataclass {cls.__qualname__} is not a lowbit class")
        return {"__dataclass__": _class_path(cls),
                "fields": {f.name: _encode(getattr(obj, f.name), f"{prefix}.{f.name}", tensors)
                           for f in dataclasses.fields(obj)}}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": _dtype_name(obj)}
    raise TypeError(f"cannot save {prefix}: unsupported type {type(obj).__name__}")


def _decode(obj: Any, tensors: dict[str, torch.Tensor], where: str):
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):  # plain JSON list (options)
        return [_decode(x, tensors, where) for x in obj]
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: unexpected value of type {type(obj).__name__}")
    if "__tensor__" in obj:
        name = obj["__tensor__"]
        if name not in tensors:
            raise CheckpointError(f"{where}: tensor {name!r} is missing from {WEIGHTS}")
        return tensors[name]
    if "__list__" in obj:
        items = [_decode(x, tensors, where) for x in obj["__list__"]]
        return tuple(items) if obj.get("tuple") else items
    if "__dict__" in obj:
        return {k: _decode(v, tensors, where) for k, v in obj["__dict__"].items()}
    if "__dtype__" in obj:
        if obj["__dtype__"] not in _DTYPES:
            raise CheckpointError(f"{where}: unknown dtype {obj['__dtype__']!r}")
        return _DTYPES[obj["__dtype__"]]
    if "__dataclass__" in obj:
        cls = _resolve_class(obj["__dataclass__"], where, quant=False)
        return cls(**{k: _decode(v, tensors, where) for k, v in obj["fields"].items()})
    return {k: _decode(v, tensors, where) for k, v in obj.items()}


def _resolve_class(path: str, where: str, *, quant: bool = True, kind: type | None = None) -> type:
    from lowbit.nn.base import QuantLinear

    if path in _EXTRA_CLASSES:
        return _EXTRA_CLASSES[path]
    if not isinstance(path, str) or ":" not in path:
        raise CheckpointError(f"{where}: bad class path {path!r}")
    mod, _, qual = path.partition(":")
    if not mod.startswith("lowbit."):
        raise CheckpointError(f"{where}: class {path!r} is outside lowbit and not registered "
                              "(lowbit.models.checkpoint.register_module_class)")
    try:
        obj: Any = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise CheckpointError(f"{where}: class {path!r} is not available in this lowbit ({exc})") from None
    if not isinstance(obj, type) or (quant and not issubclass(obj, QuantLinear)):
        raise CheckpointError(f"{where}: {path!r} is not a QuantLinear class")
    if kind is not None:
        if not issubclass(obj, kind):
            raise CheckpointError(f"{where}: {path!r} is not a {kind.__name__}")
    elif not quant and not dataclasses.is_dataclass(obj):
        raise CheckpointError(f"{where}: {path!r} is not a dataclass")
    return obj


# ----------------------------------------------------------------------------------- saving
def _quant_modules(model) -> dict[str, nn.Module]:
    from lowbit.nn.base import QuantLinear

    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def _float_dtype(model) -> torch.dtype:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None and hasattr(emb, "weight"):
        return emb.weight.dtype
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def save_quantized(model, path, *, tokenizer=None) -> Path:
    """Write ``model`` (quantized by a lowbit recipe, or float) to the directory ``path``.

    Returns the directory. ``tokenizer`` (optional) is saved beside it with ``save_pretrained``.
    """
    from safetensors.torch import save_file

    import lowbit

    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"path {str(out)!r} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError("save_quantized expects a transformers model (with .config)")

    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in state.items():
        if name.startswith(_RESERVED):
            raise ValueError(f"tensor name {name!r} uses the reserved prefix {_RESERVED!r}")
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype) \
            if t.numel() else None
        if key is not None and key in seen:
            tied[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        t = t.detach().cpu()
        if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.contiguous().clone()  # a view (e.g. of a fused runner projection): own storage
        tensors[name] = t

    modules = {}
    for name, m in _quant_modules(model).items():
        bias = getattr(m, "bias", None)
        modules[name] = {"class": _class_path(type(m)), "scheme": getattr(m, "scheme", ""),
                         "in_features": int(m.in_features), "out_features": int(m.out_features),
                         "bias": isinstance(bias, torch.Tensor), "dtype": _dtype_name(m.dtype),
                         "config": _jsonable(m.config(), f"{name}.config()")}

    containers = {n: ({"class": _class_path(type(m)), "config": _jsonable(m.container_config(), n)}
                      if hasattr(m, "container_config") else _class_path(type(m)))
                  for n, m in model.named_modules()
                  if n and type(m).__module__.startswith("lowbit.") and not hasattr(type(m), "config")
                  and not getattr(type(m), "_lowbit_swapped", False) and n not in modules}
    # non-persistent buffers (e.g. RoPE inv_freq, which a model cast with .to(bf16) holds in bf16)
    keys = set(state)
    for n, b in model.named_buffers():
        if n not in keys and b is not None and f"{_RESERVED}buffers.{n}" not in tensors:
            tensors[f"{_RESERVED}buffers.{n}"] = b.detach().cpu().contiguous().clone()
    info = dict(getattr(model, "lowbit_recipe", None) or {})
    rope_kv = info.pop("rope_kv", None)
    rope_struct = _encode(rope_kv, "rope_kv", tensors) if rope_kv is not None else None

    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "lowbit_version": lowbit.__version__,
        "torch_version": torch.__version__,
        "recipe": _jsonable(info, "recipe"),
        "rope_kv": rope_struct,
        "base_config": _jsonable(config.to_dict(), "config"),
        "generation_config": (_jsonable(model.generation_config.to_dict(), "generation_config")
                              if getattr(model, "generation_config", None) is not None else None),
        "float_dtype": _dtype_name(_float_dtype(model)),
        "modules": modules,
        "containers": containers,
        "tied": tied,
        "tensors": {n: {"shape": list(t.shape), "dtype": _dtype_name(t.dtype), "format": _tensor_format(n, modules)}
                    for n, t in tensors.items()},
        "weights_file": WEIGHTS,
    }
    meta_hash = hashlib.sha256(_canonical(meta)).hexdigest()
    wpath = out / WEIGHTS
    tmp = out / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": FORMAT, "lowbit_meta_sha256": meta_hash})
    os.replace(tmp, wpath)
    meta["weights_sha256"] = _sha256_file(wpath)
    meta["weights_bytes"] = wpath.stat().st_size
    (out / META).write_text(json.dumps(meta, indent=1, sort_keys=True))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


def _tensor_format(name: str, modules: dict) -> str:
    if name.startswith(_RESERVED + "buffers."):
        return "buffer"
    if name.startswith(_RESERVED):
        return "rope_kv"
    mod, _, buf = name.rpartition(".")
    if mod in modules:
        return f"{modules[mod]['scheme'] or modules[mod]['class']}:{buf}"
    return "float"


def _jsonable(obj, where: str):
    def conv(v):
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            return v if v == v and abs(v) != float("inf") else repr(v)
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {str(k): conv(x) for k, x in v.items()}
        if isinstance(v, torch.dtype):
            return _dtype_name(v)
        if isinstance(v, torch.Tensor) and v.numel() <= 4096:
            return v.tolist()
        raise TypeError(f"cannot save {where}: value of type {type(v).__name__} is not JSON-serialisable")

    return conv(obj)


# ---------------------------------------------------------------------------------- loading
def read_metadata(path) -> dict:
    """Parse and structurally validate ``DIR/lowbit.json``."""
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(d)!r} " + ("is a file, not a directory" if d.exists()
                                                                       else "does not exist"))
    mp = d / META
    if not mp.is_file():
        raise CheckpointError(f"{str(d)!r} is not a lowbit checkpoint: {META} is missing")
    try:
        meta = json.loads(mp.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{META} is not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{META}: not a {FORMAT} (format={meta.get('format') if isinstance(meta, dict) else None!r})")
    v = meta.get("format_version")
    if not isinstance(v, int) or v < 1:
        raise CheckpointError(f"{META}: bad format_version {v!r}")
    if v > FORMAT_VERSION:
        raise CheckpointError(f"{META}: format_version {v} is newer than this lowbit reads ({FORMAT_VERSION}); "
                              "upgrade lowbit")
    for key, typ in (("base_config", dict), ("modules", dict), ("tensors", dict), ("tied", dict),
                     ("weights_sha256", str), ("weights_bytes", int), ("float_dtype", str), ("recipe", dict)):
        if not isinstance(meta.get(key), typ):
            raise CheckpointError(f"{META}: field {key!r} is missing or not a {typ.__name__}")
    if meta["float_dtype"] not in _DTYPES:
        raise CheckpointError(f"{META}: unknown float_dtype {meta['float_dtype']!r}")
    for n, t in meta["tensors"].items():
        if (not isinstance(t, dict) or not isinstance(t.get("shape"), list) or t.get("dtype") not in _DTYPES
                or not all(isinstance(s, int) and s >= 0 for s in t["shape"])):
            raise CheckpointError(f"{META}: bad entry for tensor {n!r}: {t!r}")
    for n, m in meta["modules"].items():
        if not isinstance(m, dict) or not all(k in m for k in ("class", "in_features", "out_features", "bias",
                                                                "dtype", "config")):
            raise CheckpointError(f"{META}: bad entry for module {n!r}")
        if m["dtype"] not in _DTYPES or not isinstance(m["config"], dict):
            raise CheckpointError(f"{META}: bad dtype or config for module {n!r}")
    return meta


def _read_safetensors_header(path: Path, size: int) -> tuple[dict, dict]:
    """(tensor entries, __metadata__) of a safetensors file, with every offset checked."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{WEIGHTS} is truncated: {len(raw)} bytes")
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{WEIGHTS}: header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{WEIGHTS}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{WEIGHTS}: header is not a JSON object")
    st_meta = header.pop("__metadata__", {}) or {}
    data_len = size - 8 - n
    spans = []
    for name, e in header.items():
        if (not isinstance(e, dict) or e.get("dtype") not in _ST_SIZE or not isinstance(e.get("shape"), list)
                or not isinstance(e.get("data_offsets"), list) or len(e["data_offsets"]) != 2):
            raise CheckpointError(f"{WEIGHTS}: bad header entry for tensor {name!r}")
        a, b = e["data_offsets"]
        numel = 1
        for s in e["shape"]:
            numel *= s
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b <= data_len):
            raise CheckpointError(f"{WEIGHTS}: tensor {name!r} lies outside the file (offsets {a}..{b}, "
                                  f"data {data_len} bytes): the file is truncated or corrupted")
        if b - a != numel * _ST_SIZE[e["dtype"]]:
            raise CheckpointError(f"{WEIGHTS}: tensor {name!r} has {b - a} bytes for shape {e['shape']} "
                                  f"{e['dtype']}")
        spans.append((a, b, name))
    spans.sort()
    for (a0, b0, n0), (a1, b1, n1) in zip(spans, spans[1:]):
        if a1 < b0:
            raise CheckpointError(f"{WEIGHTS}: tensors {n0!r} and {n1!r} overlap")
    return header, st_meta


def _build_model(meta: dict):
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    cfg = dict(meta["base_config"])
    model_type = cfg.pop("model_type", None)
    if not isinstance(model_type, str):
        raise CheckpointError(f"{META}: base_config has no model_type")
    try:
        config = AutoConfig.for_model(model_type, **cfg)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{META}: cannot rebuild config of model_type {model_type!r} ({exc})") from None
    dtype = _DTYPES[meta["float_dtype"]]
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    return model.eval()


def _build_container(entry, where: str) -> nn.Module:
    """A lowbit module that only holds quantized children: ``entry`` a class path (e.g. ``FusedMLP``), built with
    ``nn.Identity`` placeholders for its constructor's module arguments, or ``{"class", "config"}`` for a class
    with ``container_config()`` (e.g. ``lowbit.nn.moe.QuantExperts``: its expert count), built as
    ``cls(**config)``; the QuantLinear replacement then fills the placeholders by name."""
    import inspect

    if isinstance(entry, dict):
        if set(entry) != {"class", "config"} or not isinstance(entry["config"], dict):
            raise CheckpointError(f"container {where!r}: bad entry {str(entry)[:200]}")
        cls = _resolve_class(entry["class"], f"container {where!r}", quant=False, kind=nn.Module)
        if not hasattr(cls, "container_config"):
            raise CheckpointError(f"container {where!r}: {entry['class']} takes no config")
        try:
            return cls(**entry["config"])
        except Exception as exc:
            raise CheckpointError(f"container {where!r}: cannot rebuild {entry['class']} ({exc})") from None
    path = entry
    cls = _resolve_class(path, f"container {where!r}", quant=False, kind=nn.Module)
    params = [p for p in inspect.signature(cls.__init__).parameters.values()
              if p.name != "self" and p.default is inspect.Parameter.empty
              and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    try:
        return cls(*[nn.Identity() for _ in params])
    except Exception as exc:
        raise CheckpointError(f"container {where!r}: cannot rebuild {path} ({exc})") from None


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if not hasattr(parent, child):
        raise CheckpointError(f"{META}: module {name!r} does not exist in the rebuilt model")
    setattr(parent, child, module)


def load_quantized(path, device: str | torch.device | None = None):
    """Rebuild and return the model saved by ``save_quantized`` (see module docstring)."""
    from safetensors import safe_open

    if device is not None:  # before reading (and hashing) the weights
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda', got {device!r}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: no CUDA GPU is visible on this machine")
    d = Path(path)
    meta = read_metadata(d)
    wpath = d / meta.get("weights_file", WEIGHTS)
    if meta.get("weights_file", WEIGHTS) != WEIGHTS:
        raise CheckpointError(f"{META}: unexpected weights_file {meta.get('weights_file')!r}")
    if not wpath.is_file():
        raise CheckpointError(f"{WEIGHTS} is missing from {str(d)!r}")
    size = wpath.stat().st_size
    if size != meta["weights_bytes"]:
        raise CheckpointError(f"{WEIGHTS} is truncated or was modified: {size} bytes, metadata says "
                              f"{meta['weights_bytes']}")
    digest = _sha256_file(wpath)
    if digest != meta["weights_sha256"]:
        raise CheckpointError(f"{WEIGHTS} does not match its SHA-256 in {META} (tampered or corrupted): "
                              f"{digest[:16]}... != {meta['weights_sha256'][:16]}...")
    header, st_meta = _read_safetensors_header(wpath, size)
    if st_meta.get("lowbit_meta_sha256") != hashlib.sha256(_canonical(meta)).hexdigest():
        raise CheckpointError(f"{META} does not match the hash stored in {WEIGHTS} (the metadata was edited)")
    want = meta["tensors"]
    if set(header) != set(want):
        extra, missing = sorted(set(header) - set(want)), sorted(set(want) - set(header))
        raise CheckpointError(f"{WEIGHTS} and {META} list different tensors: extra {extra[:5]}, missing {missing[:5]}")
    for name, e in header.items():
        if _ST_DTYPES[e["dtype"]] != want[name]["dtype"] or e["shape"] != want[name]["shape"]:
            raise CheckpointError(f"tensor {name!r}: file has {e['dtype']} {e['shape']}, metadata says "
                                  f"{want[name]['dtype']} {want[name]['shape']}")

    model = _build_model(meta)
    if device is not None:
        model.to(device)  # before the attention install, which keeps device tensors (CRS) of its own
    with safe_open(str(wpath), framework="pt", device="cpu") as f:
        tensors = {n: f.get_tensor(n) for n in header}
    recipe = dict(meta["recipe"])
    rope_kv = _decode(meta["rope_kv"], tensors, "rope_kv") if meta.get("rope_kv") is not None else None
    if device is not None and isinstance(rope_kv, list):
        rope_kv = [p.to(device) if hasattr(p, "to") else p for p in rope_kv]
    if recipe.get("recipe") == "fp8-mla":
        from lowbit.models import recipes

        install = recipes._need("fp8-mla", "lowbit.models.deepseek", "install_fp8_mla")
        opts = {k: v for k, v in (recipe.get("options") or {}).items() if k != "seed"}
        model = recipes._call(install, model, **opts) or model
    elif recipe.get("kv") is not None or recipe.get("attention") is not None:
        # installed on the float skeleton, as the recipes do (RPN is already folded in the saved
        # weights: rope_kv carries rpn_applied=True, so nothing is folded twice)
        from lowbit.models import recipes

        name = recipe.get("recipe", "checkpoint")
        model = recipes._install_attention(name, model, kv=recipe.get("kv"), attention=recipe.get("attention"),
                                           rope_kv=rope_kv) or model
    containers = meta.get("containers", {})
    if not isinstance(containers, dict):
        raise CheckpointError(f"{META}: field 'containers' is not a dict")
    for name in sorted(containers, key=lambda n: n.count(".")):
        _set_module(model, name, _build_container(containers[name], name))
    for name, m in meta["modules"].items():
        cls = _resolve_class(m["class"], f"module {name!r}")
        try:
            q = cls.empty(int(m["in_features"]), int(m["out_features"]), bool(m["bias"]), _DTYPES[m["dtype"]],
                          **m["config"])
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"module {name!r}: {cls.__name__}.empty rejected the saved config ({exc})") from None
        _set_module(model, name, q)
    if recipe:
        recipe["rope_kv"] = rope_kv
        model.lowbit_recipe = recipe
    if isinstance(meta.get("generation_config"), dict):
        from transformers import GenerationConfig

        try:
            model.generation_config = GenerationConfig.from_dict(meta["generation_config"])
        except Exception as exc:
            raise CheckpointError(f"{META}: bad generation_config ({exc})") from None

    expected = model.state_dict()
    tied = meta["tied"]
    file_names = {n for n in header if not n.startswith(_RESERVED)}
    missing = sorted(set(expected) - file_names - set(tied))
    extra = sorted(file_names - set(expected))
    if missing or extra:
        raise CheckpointError(f"checkpoint does not fit the rebuilt model: missing {missing[:5]}, unexpected "
                              f"{extra[:5]} (saved by lowbit {meta.get('lowbit_version')})")
    for alias, target in tied.items():
        if target not in file_names or alias not in expected:
            raise CheckpointError(f"{META}: bad tied alias {alias!r} -> {target!r}")
    for n in file_names:
        e, t = expected[n], tensors[n]
        if tuple(e.shape) != tuple(t.shape) or e.dtype != t.dtype:
            raise CheckpointError(f"tensor {n!r}: checkpoint has {_dtype_name(t.dtype)} {list(t.shape)}, the "
                                  f"rebuilt model expects {_dtype_name(e.dtype)} {list(e.shape)}")
    sd = {n: tensors[n] for n in file_names}
    for alias, target in tied.items():
        sd[alias] = tensors[target]
    model.load_state_dict(sd, strict=True)
    extra = {n[len(_RESERVED) + len("buffers."):]: t for n, t in tensors.items() if n.startswith(_RESERVED + "buffers.")}
    if extra:
        owned = dict(model.named_buffers())
        for n, t in extra.items():
            if n not in owned or owned[n] is None or tuple(owned[n].shape) != tuple(t.shape):
                raise CheckpointError(f"buffer {n!r} does not fit the rebuilt model")
            mod_name, _, bname = n.rpartition(".")
            mod = model.get_submodule(mod_name) if mod_name else model
            mod._buffers[bname] = t.to(owned[n].device)
    if device is not None:
        model.to(device)
    return model.eval()


def load_tokenizer(path):
    """The tokenizer saved beside a checkpoint (``save_quantized(..., tokenizer=tok)``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
