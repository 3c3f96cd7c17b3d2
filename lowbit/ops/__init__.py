"""Ops: public functions over kernels. Each op validates inputs, dispatches between the Triton
kernel (CUDA, or CPU under TRITON_INTERPRET=1) and the plain-PyTorch reference, and is registered
as a ``torch.library`` op (namespace ``lowbit``) with a fake implementation so
``torch.compile(fullgraph=True)`` and CUDA graphs work through it."""
