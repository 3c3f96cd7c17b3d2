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


def _interpreter_e4m3_nan():
    """Triton's interpreter converts FP8 E4M3 (``float8e4nv``) as if it had no NaN: the code 0x7F / 0xFF reads as
    +-480 and a float NaN writes as 0x7C (384), where the GPU's ``cvt`` keeps NaN both ways (E4M3's only NaN is
    S.1111.111). lowbit stores a non-finite input's scale as NaN (FP8 KV4 scales among them), so under the
    interpreter its conversions are wrapped here to keep NaN as the GPU does. Every other value converts as before."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    orig = getattr(ti, "_convert_float", None)
    if orig is None or getattr(orig, "_lowbit_e4m3_nan", False):
        return

    def bits_of(a, width):
        return np.frombuffer(a.tobytes(), dtype=getattr(np, f"uint{width}")).reshape(a.shape).astype(np.uint32)

    def convert(input, input_dtype, output_dtype, rounding_mode):
        out = orig(input, input_dtype, output_dtype, rounding_mode)
        wi, wo = input_dtype.primitive_bitwidth, output_dtype.primitive_bitwidth
        if input_dtype == tl.float8e4nv:
            b = bits_of(input, 8)
            nan = (b & 0x7F) == 0x7F
        elif output_dtype == tl.float8e4nv and input_dtype.is_floating():
            b = bits_of(input, wi)
            mw = input_dtype.fp_mantissa_width
            exp_all = ((b >> mw) & ((1 << (wi - mw - 1)) - 1)) == (1 << (wi - mw - 1)) - 1
            nan = exp_all & ((b & ((1 << mw) - 1)) != 0)
        else:
            return out
        if not nan.any():
            return out
        sign = (b >> (wi - 1)) & 1
        mo = output_dtype.fp_mantissa_width
        qnan = ((1 << (wo - 1)) - 1) if output_dtype == tl.float8e4nv else (((1 << (wo - mo - 1)) - 1) << mo) | (1 << (mo - 1))
        out = out.copy()
        out[nan] = ((sign[nan] << (wo - 1)) | qnan).astype(out.dtype)
        return out

    convert._lowbit_e4m3_nan = True
    ti._convert_float = convert


if INTERPRET:
    _interpreter_e4m3_nan()


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
