"""Calibration plumbing shared by the PTQ algorithms: run the model on calibration batches and
capture what named modules see (inputs or outputs), through forward hooks removed afterwards."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn


@contextmanager
def hooks(modules: dict[str, nn.Module], fn: Callable[[str, nn.Module, tuple, object], None]):
    """Register ``fn(name, module, inputs, output)`` as a forward hook on each module."""
    handles = [m.register_forward_hook(lambda mod, inp, out, _n=n: fn(_n, mod, inp, out))
               for n, m in modules.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def run_batches(model, batches: list[torch.Tensor], *, progress: str | None = None) -> None:
    """Forward every [1, S] batch through ``model`` (no KV cache); ``progress`` = bar label."""
    device = next(model.parameters()).device
    it = batches
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(batches, desc=progress, unit="batch")
    for ids in it:
        model(input_ids=ids.to(device), use_cache=False)


@torch.no_grad()
def reduce_stats(model, batches, modules: dict[str, nn.Module], stat: Callable[[torch.Tensor], torch.Tensor],
                 *, on: str = "input", reduce: str = "max", progress: str | None = None) -> dict[str, torch.Tensor]:
    """For each module, ``stat(x)`` of its first input (``on='input'``) or its output, reduced
    across batches with elementwise ``max`` or ``sum``. Example: per-channel absmax of inputs
    with ``stat=lambda x: x.abs().flatten(0, -2).amax(0)``."""
    acc: dict[str, torch.Tensor] = {}

    def fn(name, mod, inp, out):
        x = inp[0] if on == "input" else (out[0] if isinstance(out, tuple) else out)
        s = stat(x.detach().float())
        if name not in acc:
            acc[name] = s
        elif reduce == "max":
            acc[name] = torch.maximum(acc[name], s)
        else:
            acc[name] = acc[name] + s

    with hooks(modules, fn):
        run_batches(model, batches, progress=progress)
    return acc
