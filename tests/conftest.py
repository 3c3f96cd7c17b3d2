"""Test setup: Triton kernels run under the interpreter on the CPU (TRITON_INTERPRET=1 must be
set before triton is first imported, so it is set here when there is no GPU), GPU-only tests carry
``@pytest.mark.gpu``. Those are skipped without CUDA, and also under the interpreter on a GPU machine
(the README's test command sets TRITON_INTERPRET=1: the CPU suite then runs as in CI; run the GPU
tests with ``pytest -m gpu`` and no TRITON_INTERPRET). Tests written for the interpreter (CPU tensors
handed to the kernels, or tolerances only the interpreter's numerics meet) carry
``@pytest.mark.interpreter`` and are skipped when the kernels are compiled for CUDA."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
GPU = torch.cuda.is_available() and not INTERPRET  # compiled Triton kernels on CUDA tensors

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.register_profile("deep", max_examples=300, deadline=None)  # random seeds: a longer fuzz than CI's fixed 15
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    """Import every kernel module now, while TRITON_INTERPRET is as the session set it: ``@triton.jit``
    picks interpreter or compiler at import time, so a module first imported inside a test that sets
    ``TRITON_INTERPRET=0`` (to run the references) would fail every later interpreter test on that
    worker with "0 active drivers"."""
    import importlib
    import pkgutil

    import lowbit.kernels

    for mod in pkgutil.iter_modules(lowbit.kernels.__path__):
        try:
            importlib.import_module(f"lowbit.kernels.{mod.name}")
        except ImportError:
            pass


def pytest_report_header(config):
    if GPU:
        return ("lowbit: compiled Triton on CUDA. The GPU suite is `pytest -m gpu`; tests marked `interpreter` (CPU "
                "tensors or interpreter-exact tolerances) are skipped: run them with TRITON_INTERPRET=1, as the "
                "README's test command does")
    return f"lowbit: Triton interpreter ({'CUDA present, gpu tests skipped' if torch.cuda.is_available() else 'no CUDA'})"


def _scale_fuzz(items, factor: int):
    """``LOWBIT_FUZZ_SCALE=N``: every hypothesis test whose ``@settings`` pins ``max_examples`` (the kernel tests,
    kept short for CI) runs N times as many examples. With ``HYPOTHESIS_PROFILE=deep`` (random seeds), a longer fuzz
    of the kernels than CI's."""
    for item in items:
        fn = getattr(item, "obj", None)
        inner = getattr(getattr(fn, "hypothesis", None), "inner_test", None)
        st = getattr(fn, "_hypothesis_internal_use_settings", None)
        if inner is None or st is None:
            continue
        fn._hypothesis_internal_use_settings = settings(st, max_examples=st.max_examples * factor)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("LOWBIT_FUZZ_SCALE"):
        _scale_fuzz(items, int(os.environ["LOWBIT_FUZZ_SCALE"]))
    if GPU:  # compiled kernels: the interpreter's tests would hand them CPU tensors or miss their tolerances
        if os.environ.get("LOWBIT_AUDIT_INTERPRETER_TESTS") == "1":  # audit: run them compiled, to see which pass
            return
        skip = pytest.mark.skip(reason="interpreter test: run it with TRITON_INTERPRET=1 (the compiled kernels: "
                                       "`pytest -m gpu`)")
        for item in items:
            if "interpreter" in item.keywords:
                item.add_marker(skip)
        return
    why = ("needs compiled Triton kernels: run `pytest -m gpu` without TRITON_INTERPRET" if torch.cuda.is_available()
           else "needs a CUDA GPU")
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def dev():
    """'cuda' with compiled kernels, else 'cpu' (kernels then run under the interpreter)."""
    return "cuda" if GPU else "cpu"


@pytest.fixture(autouse=True)
def _fresh_warn_once():
    """Each test sees ``warn_once`` messages anew (the process-wide once-only memory would otherwise hide a
    warning from a test when an earlier test in the same worker emitted it)."""
    from lowbit._utils import _warned

    _warned.cache_clear()
    yield
