"""Benchmark suites. Each module defines ``BASELINE`` (the provider speedups are relative to) and
``run(rec: lowbit.bench.harness.Recorder, quick: bool) -> None`` which times lowbit and the
peers side by side and calls ``rec.record`` per (case, provider)."""
import importlib
import pkgutil


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def load(name: str):
    names = available()
    if name not in names:
        raise ValueError(f"unknown suite {name!r}; known: {', '.join(names)}")
    return importlib.import_module(f"{__name__}.{name}")
