"""Evaluation and calibration text: the standard library's documentation topics.

``pydoc_data.topics.topics`` ships with every CPython, so the corpus needs no download. The eval
text is ``"\\n\\n".join(topics.values())`` in dict order; ``--text-file`` replaces it.
Calibration draws from the same text by default (deterministic under ``seed``); pass a user
file to calibrate on other data.
"""
from __future__ import annotations

import os

import torch

from lowbit._utils import check_int


def load_text(text_file: str | os.PathLike | None = None) -> str:
    if text_file is not None:
        if not os.path.isfile(text_file):
            raise FileNotFoundError(f"text file {str(text_file)!r} does not exist (pass a UTF-8 text file)")
        try:
            with open(text_file, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as exc:
            raise ValueError(f"text file {str(text_file)!r} is not UTF-8 text ({exc})") from exc
        if not text.strip():
            raise ValueError(f"text file {str(text_file)!r} is empty")
        return text
    from pydoc_data.topics import topics

    return "\n\n".join(topics.values())


def describe_source(text_file: str | os.PathLike | None = None) -> str:
    """Human-readable name of the eval text (for reports)."""
    if text_file is None:
        return "pydoc_data.topics (CPython documentation topics)"
    return str(text_file)


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """1-D LongTensor of token ids (no special tokens added)."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    return ids


def calibration_batches(tokenizer, *, n_samples: int = 16, seq_len: int = 512, seed: int = 0,
                        text_file: str | os.PathLike | None = None) -> list[torch.Tensor]:
    """``n_samples`` windows [1, seq_len] drawn at random offsets (seeded) from the corpus tail,
    i.e. after the first 8192 tokens that ``lowbit eval`` scores by default, so calibration and
    evaluation text do not overlap when the corpus is long enough."""
    check_int(n_samples, "n_samples (calibration windows, --calib-samples)", 1)
    check_int(seq_len, "seq_len (tokens per calibration window, --calib-seq-len)", 2)
    ids = tokenize(tokenizer, load_text(text_file))
    start = 8192 if ids.numel() > 8192 + 2 * seq_len else 0
    pool = ids[start:]
    if pool.numel() < seq_len + 1:
        raise ValueError(f"calibration text has {pool.numel()} tokens, fewer than seq_len={seq_len}")
    g = torch.Generator().manual_seed(seed)
    offs = torch.randint(0, pool.numel() - seq_len, (n_samples,), generator=g)
    return [pool[o:o + seq_len].unsqueeze(0).clone() for o in offs.tolist()]
