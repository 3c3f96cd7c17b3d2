"""Triton kernels, one file per algorithm, each with its launcher beside it.

Kernels import only ``lowbit.formats`` and ``lowbit._utils``; they run on CUDA tensors, or on
CPU tensors under TRITON_INTERPRET=1 (set before the first import of triton)."""


def _interpreter_bool_masks() -> None:
    """Work around two Triton interpreter bugs seen on triton 3.9.0 (3.6.0, the device's, is fine):
    ``mask & (loop_var < n)`` can reach the interpreter's C ``load``/``store`` as an int32 array,
    which it refuses ("mask has unsupported dtype"), and ``tl.dot`` of bf16 blocks multiplies their
    bit patterns. Compiled kernels are unaffected. Under TRITON_INTERPRET=1 only, cast such masks to
    bool and widen bf16 dot operands to fp32 (exact) before the call."""
    from lowbit._utils import interpret_mode

    if not interpret_mode():
        return
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as itp
    except ImportError:
        return
    builder = getattr(itp, "InterpreterBuilder", None)
    if builder is None or getattr(builder, "_lowbit_bool_masks", False):
        return
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask):
        data = getattr(mask, "data", None)
        if isinstance(data, np.ndarray) and data.dtype != np.bool_:
            return itp.TensorHandle(data.astype(np.bool_), mask.dtype)
        return mask

    def create_masked_load(self, ptrs, mask, other, *args, **kwargs):
        return load(self, ptrs, as_bool(mask), other, *args, **kwargs)

    def create_masked_store(self, ptrs, value, mask, *args, **kwargs):
        return store(self, ptrs, value, as_bool(mask), *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = create_masked_load, create_masked_store
    # bf16 blocks are stored as their uint16 bit patterns there, and ``create_dot`` multiplies those
    # integers (only FP8 operands are converted first): widen bf16 operands to fp32 (exact) before it
    if getattr(itp, "_get_np_dtype", lambda t: None)(tl.bfloat16) == np.uint16:
        dot = builder.create_dot

        def widen(x):
            if x.dtype.scalar == tl.bfloat16:
                return itp.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
            return x

        def create_dot(self, a, b, d, *args, **kwargs):
            return dot(self, widen(a), widen(b), d, *args, **kwargs)

        builder.create_dot = create_dot
    builder._lowbit_bool_masks = True


_interpreter_bool_masks()
