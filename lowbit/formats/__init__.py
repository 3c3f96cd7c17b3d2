"""Formats: packing and the plain-PyTorch reference quantize/dequantize of every lowbit format.

This layer imports only torch. Kernels, tests and benchmarks import these references; nobody
keeps a private copy.
"""
