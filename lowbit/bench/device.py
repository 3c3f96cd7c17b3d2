"""Scaffolding for the device scripts (``benchmarks/device/<area>.py``): each runs named sections
under one wall-clock budget, so a failure or a slow section never loses the others' output."""
from __future__ import annotations

import time
import traceback
from typing import Callable


class Sections:
    """``run(name, fn, need=s)`` calls ``fn`` unless skipped (``skip`` = comma list) or fewer than
    ``need`` seconds of ``budget`` are left; exceptions go to ``summary`` instead of stopping the
    script; ``after()`` (e.g. a JSON dump) runs after every section."""

    def __init__(self, skip: str = "", budget: float | None = None, after: Callable[[], None] | None = None):
        self.t0 = time.time()
        self.skip = set(filter(None, skip.split(",")))
        self.budget = budget
        self.after = after
        self.summary: list[str] = []

    def left(self) -> float:
        return float("inf") if self.budget is None else self.budget - (time.time() - self.t0)

    def stamp(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:6.1f}s] {msg}", flush=True)

    def run(self, name: str, fn: Callable[[], None], need: float = 0.0) -> None:
        if name in self.skip:
            return
        if self.left() < need:
            self.summary.append(f"{name}: skipped ({self.left():.0f}s left < {need:.0f}s)")
            return
        self.stamp(f"== {name}")
        try:
            fn()
        except Exception:
            traceback.print_exc()
            self.summary.append(f"{name}: EXCEPTION {traceback.format_exc().strip().splitlines()[-1]}")
        if self.after is not None:
            self.after()
