"""Test setup: Triton kernels run under the interpreter on the CPU (TRITON_INTERPRET=1 must be
set before triton is first imported, so it is set here), GPU-only tests carry ``@pytest.mark.gpu``
and are skipped without CUDA."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def dev():
    """'cuda' when present, else 'cpu' (kernels then run under the interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"
