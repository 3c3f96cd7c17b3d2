"""The steps that ``lowbit demo``, ``eval``, ``quantize`` and ``generate`` share: pick a device,
load a model (embedded, HF folder, GGUF file, or a ``lowbit.save_quantized`` folder), quantize it
with a recipe, measure its memory, and answer a chat prompt greedily.

Everything here raises ``ValueError``/``FileNotFoundError`` with a message that says what to do;
the CLI prints those without a traceback.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | None) -> str:
    """'auto' (or None) -> 'cuda' when a GPU is present, else 'cpu'; 'cuda' without a GPU is an error."""
    device = (device or "auto").lower()
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible on this machine; use --device cpu")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda[:N], got {device!r}")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """'auto' -> float32 on the CPU (the reference), bfloat16 on the GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def check_recipe(name: str) -> None:
    """ValueError naming the known recipes when ``name`` is not one of them."""
    from lowbit import registry

    registry.get("recipe", name)


def recipe_unavailable(name: str, device: str, model=None) -> str | None:
    """Why recipe ``name`` cannot run here (its module is missing, not on this device, or not for
    ``model``'s architecture), or None."""
    from lowbit import registry

    entry = registry.get("recipe", name)
    dev = "cuda" if device.startswith("cuda") else device
    if dev not in entry.devices:
        return f"needs {' or '.join(entry.devices)}"
    if name == "fp8-mla" and model is not None and not hasattr(model.config, "kv_lora_rank"):
        return f"needs a DeepSeek MLA model (this one is {getattr(model.config, 'model_type', '?')})"
    try:
        entry.load()
    except (ImportError, AttributeError, NotImplementedError) as exc:
        return f"not implemented yet ({type(exc).__name__}: {exc})"
    return None


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    source: str  # what was loaded, for messages
    quantized: str | None = None  # recipe name when already quantized


def load(model_arg: str | os.PathLike | None, *, device: str, dtype: torch.dtype) -> Loaded:
    """Load the embedded model (None/'smollm2'), a HF folder, a GGUF file, or a lowbit checkpoint."""
    from lowbit.models.loading import EMBEDDED, is_quantized_checkpoint, load_model

    name = EMBEDDED if model_arg is None else str(model_arg)
    if is_quantized_checkpoint(model_arg):
        model, tok, recipe = load_checkpoint(model_arg, device=device)
        return Loaded(model, tok, name, recipe or "checkpoint")
    model, tok = load_model(model_arg, dtype=dtype, device=device)
    return Loaded(model, tok, name)


def load_checkpoint(path, *, device: str):
    """(model, tokenizer, recipe) from a folder written by ``lowbit.save_quantized``."""
    import lowbit

    try:
        out = lowbit.load_quantized(path, device=device)
    except (ImportError, NotImplementedError) as exc:
        raise ValueError(f"{path} is a lowbit checkpoint but this lowbit cannot read checkpoints yet ({exc})") from exc
    tok = None
    if isinstance(out, tuple):
        model, tok = out[0], (out[1] if len(out) > 1 else None)
    else:
        model = out
    if tok is None:
        tok = getattr(model, "tokenizer", None)
    if tok is None:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(path)
        except Exception as exc:
            raise ValueError(f"checkpoint {path} has no tokenizer files; re-save it with `lowbit quantize` "
                             f"(which saves the tokenizer beside the weights)") from exc
    info = getattr(model, "lowbit_recipe", None) or {}
    recipe = info.get("recipe") if isinstance(info, dict) else None
    model.eval()
    return model, tok, recipe


def calibration(tokenizer, *, n_samples: int, seq_len: int, seed: int, text_file=None) -> list[torch.Tensor]:
    from lowbit.eval.corpus import calibration_batches

    return calibration_batches(tokenizer, n_samples=n_samples, seq_len=seq_len, seed=seed, text_file=text_file)


def quantize(model, recipe: str, *, calibration=None, **options):
    """``lowbit.quantize_model`` with the recipe's 'not there yet' errors made explicit."""
    import lowbit

    try:
        out = lowbit.quantize_model(model, recipe, calibration=calibration, **options)
    except (ImportError, AttributeError) as exc:
        # AttributeError only from the registry's module:attr lookup (recipe not written yet)
        raise NotImplementedError(f"recipe {recipe!r} is not available in this build ({exc})") from exc
    return out if out is not None else model


# ---- memory ---------------------------------------------------------------------------------------

def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer (quantized codes and scales included), each storage
    counted once (tied embeddings), RoPE tables (``inv_freq``) excluded."""
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t is None or name.endswith("inv_freq") or t.device.type == "meta":
            continue
        key = (t.device, t.untyped_storage().data_ptr()) if t.numel() else (name,)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes that one token adds to the KV cache over all layers.

    A quantized attention installed by a recipe may declare it (``model.lowbit_kv_bytes_per_token``
    as an int or a method); else it is read from ``model.lowbit_kv`` ('kv4' / 'kv4-zp': packed
    INT4 codes + one FP8 scale [+ one zero] per token per head, ``lowbit.formats.kv4``); else the
    cache holds K and V in the model's dtype."""
    from lowbit.formats.kv4 import kv4_bytes_per_row

    declared = getattr(model, "lowbit_kv_bytes_per_token", None)
    if callable(declared):
        declared = declared()
    if declared:
        return int(declared)
    cfg = model.config
    layers = cfg.num_hidden_layers
    nh = cfg.num_attention_heads
    nkv = getattr(cfg, "num_key_value_heads", None) or nh
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
    info = getattr(model, "lowbit_recipe", None)  # left by lowbit.models.recipes
    kv = info.get("kv") if isinstance(info, dict) else None
    if kv in ("kv4", "kv4-zp"):
        row = kv4_bytes_per_row(hd, zero_point=(kv == "kv4-zp"))
    else:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        row = hd * torch.empty((), dtype=dtype).element_size()
    return 2 * layers * nkv * row


def human_bytes(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


# ---- chat ------------------------------------------------------------------------------------------

def chat_ids(tokenizer, prompt: str, *, chat: bool = True) -> torch.Tensor:
    """[1, S] prompt ids: through the tokenizer's chat template when it has one (and ``chat``)."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    return ids


@torch.no_grad()
def answer(model, tokenizer, prompt: str, *, max_new_tokens: int = 40, chat: bool = True, streamer=None,
           max_time: float | None = None) -> str:
    """Greedy answer (``do_sample=False``) of at most ``max_new_tokens`` tokens, special tokens removed.
    ``max_time`` (seconds) stops generation early (transformers' ``MaxTimeCriteria``)."""
    device = next(model.parameters()).device
    ids = chat_ids(tokenizer, prompt, chat=chat).to(device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=pad, streamer=streamer, max_time=max_time)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
