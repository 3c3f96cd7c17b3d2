"""Triton kernels, one file per algorithm, each with its launcher beside it.

Kernels import only ``lowbit.formats`` and ``lowbit._utils``; they run on CUDA tensors, or on
CPU tensors under TRITON_INTERPRET=1 (set before the first import of triton)."""
