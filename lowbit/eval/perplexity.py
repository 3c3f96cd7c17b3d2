"""Perplexity with a documented windowing.

The first ``max_tokens`` tokens of the text are cut into non-overlapping windows of ``window``
tokens (the last one may be shorter). Each window is scored on its own with HF's
``labels=input_ids`` loss (mean over its len-1 predicted tokens); the windows' losses are
averaged weighted by len-1, and perplexity = exp(that mean). ``tokens_scored`` counts the
predicted tokens. FP32 SmolLM2-135M-Instruct, first 8192 tokens, window 1024: 13.44.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float
    tokens_scored: int
    windows: int
    window: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def describe(self) -> str:
        return (f"perplexity {self.perplexity:.3f} (mean NLL {self.nll:.4f}) over {self.tokens_scored} scored tokens, "
                f"{self.windows} non-overlapping window(s) of {self.window} tokens")


def windowing(max_tokens: int | None, window: int) -> str:
    """One line that states the windowing (for reports)."""
    first = "all tokens" if max_tokens is None else f"first {max_tokens} tokens"
    return (f"{first} of the text, non-overlapping {window}-token windows, each scored alone with HF "
            f"labels=input_ids loss, averaged weighted by window length - 1")


@torch.no_grad()
def perplexity(model, input_ids: torch.Tensor, *, max_tokens: int | None = 8192, window: int = 1024,
               progress: bool = False, deadline: float | None = None) -> PerplexityResult:
    """``input_ids``: 1-D LongTensor of the whole text (see ``corpus.tokenize``).

    ``deadline`` (a ``time.perf_counter()`` value): raise ``TimeoutError`` instead of starting a
    window after it (the demo's time budget); a partial perplexity is never returned."""
    if input_ids.ndim != 1:
        raise ValueError(f"input_ids must be 1-D, got shape {list(input_ids.shape)}")
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    ids = input_ids if max_tokens is None else input_ids[:max_tokens]
    if ids.numel() < 2:
        raise ValueError("need at least 2 tokens to score")
    device = next(model.parameters()).device
    starts = list(range(0, ids.numel(), window))
    it = starts
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(starts, desc="perplexity", unit="window")
    total_nll, total_n = 0.0, 0
    for i, s in enumerate(it):
        if deadline is not None and time.perf_counter() > deadline:
            raise TimeoutError(f"time budget spent after {i} of {len(starts)} perplexity windows")
        chunk = ids[s:s + window]
        n = chunk.numel() - 1
        if n < 1:
            continue
        x = chunk.unsqueeze(0).to(device)
        out = model(input_ids=x, labels=x, use_cache=False)
        total_nll += out.loss.float().item() * n
        total_n += n
    nll = total_nll / total_n
    return PerplexityResult(math.exp(nll), nll, total_n, len(starts), window)
