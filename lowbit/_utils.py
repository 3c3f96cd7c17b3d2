"""Small shared helpers: argument checks with clear errors, one-time warnings, Triton dispatch.

Every public op validates its inputs here so a bad call raises a Python error that names the
argument instead of faulting on the GPU.
"""
from __future__ import annotations

import functools
import math
import numbers
import os
import warnings
import weakref
from typing import Callable, Iterable, Sequence

import torch

__all__ = [
    "check_tensor", "check_rows", "check_same_device", "check_int", "check_index", "check_choice", "check_sm_scale",
    "warn_once", "interpret_mode", "triton_available", "use_triton", "cdiv", "by_batch", "MAX_GRID_Y", "FLOAT_DTYPES",
    "derived", "cached_dense",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# CUDA's limit on grid axes 1 and 2. Ops whose launches put (batch x heads) there run them in batch slices above it
# (``by_batch``); read as ``_utils.MAX_GRID_Y`` at call time, so a test can lower it.
MAX_GRID_Y = 65535


def by_batch(fn, per_batch: int, *tensors):
    """``fn(*tensors)``; or, where ``B * per_batch`` programs (B = the batch, every tensor's dim 0) would exceed grid
    axis 1 or 2 (``MAX_GRID_Y``), ``fn`` over batch slices of every tensor, each output (a tensor or a tuple of them)
    concatenated along dim 0. The ops call it around their launches; every kernel that uses it computes each
    sequence on its own, so the bits are those of one launch."""
    B = tensors[0].shape[0]
    step = max(1, MAX_GRID_Y // max(1, per_batch))
    if B <= step:
        return fn(*tensors)
    outs = [fn(*(t[b:b + step] for t in tensors)) for b in range(0, B, step)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs))
    return torch.cat(outs)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_tensor(
    t,
    name: str,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | Iterable[int] | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | str | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Validate ``t`` and raise TypeError/ValueError naming ``name`` if it does not fit.

    ``shape`` entries may be None (any size). Returns ``t`` so calls can be chained.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            names = ", ".join(str(d).replace("torch.", "") for d in allowed)
            raise TypeError(f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None:
        allowed_nd = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.ndim not in allowed_nd:
            raise ValueError(f"{name} must have {' or '.join(map(str, allowed_nd))} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.ndim != len(shape) or any(s is not None and s != ts for s, ts in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if device is not None and t.device.type != torch.device(device).type:
        raise ValueError(f"{name} must be on {torch.device(device).type}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t


def check_rows(x, name: str = "x", *, empty_features: bool = False) -> torch.Tensor:
    """``x [..., K]``, rows of activations: a float16 / bfloat16 / float32 tensor with at least 1 dim and K >= 1 (an
    empty last dim has no per-row scale: the reshape to rows failed as ambiguous; ``empty_features=True`` allows
    K = 0 where the op defines it, e.g. ``w8_linear``'s bias-only output); TypeError / ValueError naming ``name``.
    Zero rows are fine."""
    check_tensor(x, name, dtype=FLOAT_DTYPES)
    if x.ndim == 0 or (x.shape[-1] == 0 and not empty_features):
        raise ValueError(f"{name} must have at least 1 dim{'' if empty_features else ' and a nonzero last dim'}, "
                         f"got shape {list(x.shape)}")
    return x


def _is_int(v) -> bool:  # (a SymInt too: a size torch.compile traces symbolically)
    return isinstance(v, (numbers.Integral, torch.SymInt)) and not isinstance(v, bool)


def check_int(v, name: str, minimum: int = 0) -> int:
    """``v`` as an int >= ``minimum`` (a bool, float or string is refused); TypeError / ValueError naming ``name``."""
    if not _is_int(v):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return int(v)


def check_index(i, n: int, name: str) -> int:
    """``i`` as an index in ``[0, n)`` (negative indices are refused: a cache's layer -1 is a caller's bug, not the
    last layer); TypeError / ValueError naming ``name``."""
    if not _is_int(i):
        raise TypeError(f"{name} must be an int, got {type(i).__name__} {i!r}")
    if not 0 <= i < n:
        raise ValueError(f"{name} must lie in [0, {n}), got {i}")
    return int(i)


def check_choice(value, name: str, choices: Sequence):
    """``value`` if it is one of ``choices``, else ValueError naming ``name``. Where the choices are ints, ``value``
    must be an int too (TypeError): ``128.0 in (32, 64, 128)`` holds, and the float then failed deep inside as a
    tensor size."""
    if all(_is_int(c) for c in choices):
        if not _is_int(value):
            raise TypeError(f"{name} must be an int, one of {tuple(choices)}, got {type(value).__name__} {value!r}")
        value = int(value)
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_sm_scale(sm_scale, head_dim: int) -> float:
    """The softmax scale of an attention call: ``head_dim ** -0.5`` for None, else ``sm_scale`` (a number or a
    one-element tensor) as a float, which must be positive and finite (a NaN or an infinite scale gave NaN or
    all-zero rows); TypeError / ValueError naming the argument."""
    if sm_scale is None:
        if head_dim < 1:
            raise ValueError(f"head_dim must be >= 1, got {head_dim}")
        return head_dim ** -0.5
    if isinstance(sm_scale, torch.Tensor) and sm_scale.numel() == 1:
        sm_scale = sm_scale.item()
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale must be a number, got {type(sm_scale).__name__} {sm_scale!r}")
    s = float(sm_scale)
    if not (s > 0 and math.isfinite(s)):
        raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale}")
    return s


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, else ValueError naming them (None entries are skipped)."""
    first = None
    for t in tensors.values():  # (the common case without building the message: a decode step calls this per layer)
        if isinstance(t, torch.Tensor):
            if first is None:
                first = t.device
            elif t.device != first:
                desc = ", ".join(f"{n} on {t.device}" for n, t in tensors.items() if isinstance(t, torch.Tensor))
                raise ValueError(f"tensors must be on one device: {desc}")
    return first


_CAPTURE_STREAMS: dict = {}  # device index -> the side stream every capture runs on


def capture_cuda_graph(fn, warmup: int = 1):
    """Run ``fn`` ``warmup`` times on a side stream (Triton compiles and autotunes outside the capture),
    then capture one call into a CUDA graph. Returns ``(graph, out)``: ``graph.replay()`` rewrites ``out``.
    The warm-up calls of every capture on a device run on one side stream, so their per-stream scratch buffers
    (``stream_scratch``, ``arrival_counters``) are one set, not one per stream of torch's pool (the captures
    themselves all run on ``torch.cuda.graph``'s one capture stream). Nothing else is kept
    here: the graph, its memory pool and whatever ``fn`` closes over live as long as the caller holds them (until
    session 38 a stray ``lru_cache`` kept every captured graph, and with it each graphed ``Generator``'s model and
    cache, for the life of the process)."""
    dev = torch.cuda.current_device()
    s = _CAPTURE_STREAMS.get(dev)
    if s is None:
        s = _CAPTURE_STREAMS[dev] = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def resident_ctas(kernel, num_warps: int) -> int | None:
    """Resident programs per SM of a compiled Triton kernel on Hopper (64K registers allocated per warp in units
    of 8 per thread, 227 KB shared memory + 1 KB per program, 64 warps, 32 programs per SM); None when the kernel
    carries no metadata (interpreter)."""
    try:
        regs = int(kernel.n_regs)
        smem = int(kernel.metadata.shared)
    except Exception:
        return None
    if regs <= 0:
        return None
    regs = -(-regs // 8) * 8
    by_regs = 65536 // (regs * 32 * num_warps)
    by_smem = (227 * 1024) // (smem + 1024)
    return max(1, min(by_regs, by_smem, 64 // num_warps, 32))


def arg_specialization(args: Iterable) -> tuple:
    """Triton's specialization of launch arguments, part of a compiled variant's identity: ints by == 1 and
    divisibility by 16, tensors by device, dtype and 16-byte alignment. The caches of per-variant facts
    (``lut_wgmma.launch_key``, ``decode_kv4._occupancy_key``) key by it: a fact of one compiled variant (its
    registers, its residency) does not hold for another."""
    return tuple((a == 1, a % 16 == 0) if isinstance(a, int) else (a.device.index, a.dtype, a.data_ptr() % 16 == 0)
                 for a in args)


ARRIVAL_COUNTERS: dict = {}  # (owner, device, stream) -> int32 counters of the single-launch split reductions


def stream_key(device) -> int:
    """The current CUDA stream's handle on ``device`` (0 off CUDA): per-stream scratch buffers key by it."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


STREAM_SCRATCH: dict = {}  # (owner, device, stream) -> the split reductions' partial-tile buffers
CAPTURED_OUTGROWN: list = []  # buffers a CUDA graph captured, kept alive after a larger request replaced them


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _grown(table: dict, key, n: int, make: Callable[[int], torch.Tensor], minimum: int) -> torch.Tensor:
    """``table[key]`` if it holds ``n`` elements, else a new buffer of ``max(n, minimum, 2 x the old size)`` (growth
    is geometric, so the kept-alive history below stays within twice the last size). A buffer handed out while a
    CUDA graph was being captured is referenced by that graph's kernels by address: when a later request outgrows
    it, it moves to ``CAPTURED_OUTGROWN`` instead of being freed, so replaying the graph never writes freed memory
    (session 38; before, it was freed: ``torch.cuda.graph`` captures every graph on one stream, so a capture that
    needed a larger buffer than an earlier graph, e.g. the runner's batch-16 step after its batch-1 step, freed the
    buffer the first graph still wrote on replay)."""
    t = table.get(key)
    if t is None or t.numel() < n:
        if t is not None and getattr(t, "_lowbit_captured", False):
            CAPTURED_OUTGROWN.append(t)
        t = table[key] = make(max(n, minimum, 2 * t.numel() if t is not None else 0))
    if _capturing(t.device):
        t._lowbit_captured = True
    return t


def stream_scratch(owner: str, device, n: int, dtype: torch.dtype, *, minimum: int = 1 << 16) -> torch.Tensor:
    """At least ``n`` elements of ``dtype`` of ``owner``'s scratch (uninitialised) on ``device`` and the current
    stream, grown on demand (``_grown``): the split-K partial tiles, which, like ``arrival_counters``, two streams
    running one kernel family at once must not share."""
    key = (owner, device.type, device.index, stream_key(device))
    return _grown(STREAM_SCRATCH, key, n, lambda m: torch.empty(m, device=device, dtype=dtype), minimum)


def arrival_counters(owner: str, device, n: int) -> torch.Tensor:
    """At least ``n`` zeroed int32 arrival counters of ``owner`` (a kernel family) on ``device`` and the current
    stream: the single-launch split reductions (the program that arrives last combines the partials and resets its
    counter, so every launch leaves them at zero: no memset per call). One buffer per owner and stream: launches of
    different families, or of one family on two streams at once, never share a counter (session 29; before, the
    buffer was per owner only, and two streams running the same kernel family concurrently could miscount). A CUDA
    graph captured on a stream that has no buffer yet allocates it (and its zeroing) inside the capture, as
    ``w4a8_int8_gemm``'s workspace always did. Grown as ``_grown`` says."""
    key = (owner, device.type, device.index, stream_key(device))
    return _grown(ARRIVAL_COUNTERS, key, n, lambda m: torch.zeros(m, device=device, dtype=torch.int32), 4096)


@functools.lru_cache(maxsize=None)
def _warned(msg: str) -> bool:
    warnings.warn(msg, stacklevel=3)
    return True


def warn_once(msg: str) -> None:
    """Emit ``msg`` as a UserWarning the first time it is seen in this process."""
    _warned(msg)


def interpret_mode() -> bool:
    """True when Triton kernels run on the CPU through the interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _cuda_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device, cpu: int) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (cached per device index), ``cpu`` elsewhere: the stand-in
    each launcher sizes its grid with under the interpreter (so its tests keep the splits they exercise)."""
    if device.type != "cuda":
        return cpu
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def tma_capable(t: torch.Tensor) -> bool:
    """Whether a kernel may read ``t`` through a tensor-memory-accelerator descriptor: on a CUDA device of compute
    capability >= 9 (Hopper; Ada and Ampere have no TMA), or on the CPU under the interpreter (which emulates
    descriptors, so the tests run those paths)."""
    if t.is_cuda:
        return _cuda_major(t.device.index if t.device.index is not None else torch.cuda.current_device()) >= 9
    return interpret_mode()


def tma_descriptor(t: torch.Tensor, block: Sequence[int]):
    """A host TMA descriptor of the 2-D ``t`` with boxes ``block`` (out-of-bounds elements read as 0), or None
    where TMA cannot read it (``tma_capable``; a unit last stride, a 16-byte-aligned base and row stride are
    needed): the caller then keeps its pointer loads."""
    if t.dim() != 2 or t.stride(1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
        return None
    if not tma_capable(t):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], list(block))


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - triton missing on some platforms
        return False
    return True


def run_op(op, *args, **kwargs):
    """``op(*args)`` for a ``torch.library.custom_op`` ``op``; in plain eager execution its Python implementation
    is called directly instead, the same code without the dispatcher (about 25 us of host time per call on the
    H200 machine, ``benchmarks/results/h200/s38_host_before.json``). The registered op still runs whenever anything
    could observe or transform the call: ``torch.compile``, ``make_fx`` or ``torch.jit`` tracing, a
    ``TorchDispatchMode`` (FlopCounter, fake / functional modes), functorch transforms (``vmap``: batched tensors look
    like plain ones), a ``TorchFunctionMode`` (e.g. ``with torch.device(...)``), the autograd profiler (its ``lowbit::``
    events), a tensor subclass argument (fake, DTensor...), an input that needs a gradient (the autograd error of an
    op without a backward), and ops that write their arguments (``_mutates``). A review of the change found
    the first version of this test missing tracing, vmap, modes and the profiler (session 38)."""
    if _plain_eager() and not _mutates(op) and all(type(a) is torch.Tensor and not a.requires_grad
                                                   for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)):
        fn = getattr(op, "_init_fn", None)
        if fn is not None:
            return fn(*args, **kwargs)
    return op(*args, **kwargs)


def _plain_eager() -> bool:
    """No compiler, tracer, dispatch or function mode, functorch transform or profiler is watching (``run_op``)."""
    C = torch._C
    return not (torch.compiler.is_compiling() or torch.jit.is_tracing()
                or getattr(C, "_len_torch_dispatch_stack", lambda: 1)()
                or getattr(C, "_is_torch_function_mode_enabled", lambda: True)()
                or getattr(C, "_are_functorch_transforms_active", lambda: True)()
                or getattr(torch.autograd.profiler, "_is_profiler_enabled", True))


@functools.lru_cache(maxsize=None)
def _mutates(op) -> bool:
    """Does the custom op write any argument (``mutates_args``)? Those keep the registered op in ``run_op``: the
    dispatcher bumps the written tensors' version counters, which a direct call would not (a review finding)."""
    schema = getattr(getattr(op, "_opoverload", None), "_schema", None)
    if schema is None:
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def cuda_major(device: torch.device) -> int:
    """Compute capability major of a CUDA ``device`` (cached per device index)."""
    return _cuda_major(device.index if device.index is not None else torch.cuda.current_device())


def use_triton(*tensors: torch.Tensor) -> bool:
    """Dispatch rule shared by every op: Triton kernel on CUDA, or on the CPU under the
    interpreter; otherwise the plain-PyTorch reference with the same numerics."""
    if not triton_available():
        return False
    if all(t.is_cuda for t in tensors):
        return True
    return interpret_mode() and all(t.device.type == "cpu" for t in tensors)


_DERIVED: dict = {}  # (id(anchor), tag) -> (weakref to anchor, versions, weakrefs to the deps, value)


def _drop_derived(i: int, ref) -> None:
    for key in [k for k, e in _DERIVED.items() if k[0] == i and e[0] is ref]:
        del _DERIVED[key]


def derived(build: Callable[[], object], anchor: torch.Tensor, *deps: torch.Tensor, tag: tuple = ()):
    """``build()``, a value computed from ``anchor`` and ``deps`` (a pair table, a dense weight, a flag read
    back from the device), kept per ``(anchor, tag)`` while the tensor ``anchor`` lives and neither it nor
    any of ``deps`` was replaced or changed in place (``_version``, ``data_ptr``). The entries are tied to
    the tensors themselves (weak references), not to their addresses, so memory reused by a later tensor
    never returns a stale value. Inference-mode tensors have no version counter: for them only their
    address is compared. Rebuilt every time for tensors that need gradients, fake tensors and while
    ``torch.compile`` traces. Writes through ``.data`` do not bump ``_version``: ``clear_derived_cache``."""
    ts = (anchor, *deps)
    if (any(t.requires_grad for t in ts) or torch.compiler.is_compiling()
            or any(isinstance(t, torch._subclasses.FakeTensor) for t in ts)):
        return build()
    i = id(anchor)
    versions = tuple((-1 if t.is_inference() else t._version, t.data_ptr()) for t in ts)
    hit = _DERIVED.get((i, tag))
    if (hit is not None and hit[0]() is anchor and hit[1] == versions and len(hit[2]) == len(deps)
            and all(r() is t for r, t in zip(hit[2], deps))):
        return hit[3]
    value = build()
    ref = weakref.ref(anchor, lambda r, i=i: _drop_derived(i, r))
    _DERIVED[(i, tag)] = (ref, versions, tuple(weakref.ref(t) for t in deps), value)
    return value


_TABLES: dict = {}  # (values, dtype, device) -> device_table's tensor
TABLES_MAX = 256


def device_table(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small 1-D tensor on ``device`` holding ``values`` (host numbers: tensors' addresses, per-expert scales),
    one per distinct content: cached by value (at most ``TABLES_MAX``), so a table of addresses is right for
    whatever tensors live at them, and a lookup costs a tuple hash, not a check of every tensor (session 39: the
    first version kept tables per tensor through ``derived``, ~70 us of host time per table at 128 experts). On
    CUDA a new table is built by one ``fill_`` per element (a launch taking the number as its argument, no
    host-to-device copy), so a call inside a CUDA-graph capture can build one too: that table is filled only when
    the graph replays (before the kernels that read it, in stream order), so it is kept for that graph alone, never
    cached (a review of session 39 found a first version copying each element from the host, which a capture
    refuses, and caching a capture's unfilled table). Every table a capture reads is kept alive for the process
    (``CAPTURED_OUTGROWN``): leaving the bounded cache must not free what a graph reads."""
    key = (values, dtype, device)
    capturing = _capturing(device)
    t = _TABLES.get(key)
    if t is None:
        if device.type != "cuda":
            t = torch.tensor(values, dtype=dtype, device=device)
        else:
            t = torch.empty(len(values), dtype=dtype, device=device)
            for i, v in enumerate(values):
                t[i:i + 1].fill_(v)
        if not capturing:
            while _TABLES and len(_TABLES) >= TABLES_MAX:  # oldest first
                _TABLES.pop(next(iter(_TABLES)))
            _TABLES[key] = t
    if capturing and not getattr(t, "_lowbit_captured", False):
        t._lowbit_captured = True
        CAPTURED_OUTGROWN.append(t)
    return t


def clear_derived_cache() -> None:
    """Drop every ``derived`` entry (needed only after writing tensors in place through ``.data``, which
    PyTorch does not count in ``_version``)."""
    _DERIVED.clear()


def cached_dense(build: Callable[[], torch.Tensor], anchor: torch.Tensor, *deps: torch.Tensor,
                 tag: tuple = ()) -> torch.Tensor:
    """``derived`` for the dense float copy of a packed weight that a CPU reference path multiplies by:
    decoding on the CPU then pays the dequantization once per weight instead of once per token (session
    16, embedded SmolLM2 on 2 cores: ``flute-nf4`` 1170 -> 113 ms per generated token). The result is the
    tensor ``build()`` returns, so the numerics are unchanged. Costs the dense copy's memory: CPU tensors
    only, and off with ``LOWBIT_CPU_WEIGHT_CACHE=0``."""
    if os.environ.get("LOWBIT_CPU_WEIGHT_CACHE", "1") == "0" or anchor.device.type != "cpu":
        return build()
    return derived(build, anchor, *deps, tag=("dense", *tag))


def check_indices(*tensors: torch.Tensor) -> bool:
    """Whether an op reads the index tensors (positions, slots, lengths, page tables) back to range-check them: when
    all are on the CPU, always; with a CUDA one only under ``LOWBIT_CHECK_INDEX=1`` (the read syncs the device, so
    it is a debugging switch); never while torch.compile traces (a value read would break the graph) or a CUDA
    graph is captured. Unchecked, the kernels drop the writes that would land outside the cache (no fault, no
    error)."""
    if torch.compiler.is_compiling():
        return False
    if all(t.device.type == "cpu" for t in tensors):
        return True
    if os.environ.get("LOWBIT_CHECK_INDEX", "0") != "1":
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _check_span_pages(begin: torch.Tensor, end: torch.Tensor, page_table: torch.Tensor, page_size: int,
                      num_pages: int, verb: str) -> None:
    """The page-table entries of the pages that hold positions ``[begin[b], end[b])`` of each sequence (the
    columns ``begin // page_size`` up to ``ceil(end / page_size)``) must lie inside the cache's ``num_pages``."""
    dev = page_table.device
    first = begin.to(dev).long() // page_size
    stop = (end.to(dev).long() + page_size - 1) // page_size
    cols = torch.arange(page_table.shape[1], device=dev)
    pages = page_table[(cols >= first[:, None]) & (cols < stop[:, None])]
    if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
        raise ValueError(f"page_table entries of the pages {verb} must lie in [0, {num_pages}) (the cache's "
                         f"pages), got [{int(pages.min())}, {int(pages.max())}]")


def check_page_writes(start: torch.Tensor, page_table: torch.Tensor, T: int, page_size: int, num_pages: int) -> None:
    """Range checks of a paged append of ``T`` tokens per sequence at positions ``start[b] + t`` (when
    ``check_indices`` says so): the positions inside the page table's columns, and the page-table entries of the
    pages written inside the cache's ``num_pages``; ValueError naming the argument otherwise."""
    B = page_table.shape[0]
    if not (B and T and check_indices(start, page_table)):
        return
    cap = page_table.shape[1] * page_size
    if int(start.min()) < 0 or int(start.max()) + T > cap:
        raise ValueError(f"start + T must lie in [0, {cap}] (page_table columns x page size), "
                         f"got start in [{int(start.min())}, {int(start.max())}] with T={T}")
    _check_span_pages(start, start + T, page_table, page_size, num_pages, "written")


def check_page_reads(lengths: torch.Tensor, page_table: torch.Tensor, page_size: int, num_pages: int,
                     name: str = "lengths") -> None:
    """Range checks of a paged read of ``lengths[b]`` tokens per sequence (when ``check_indices`` says so): the
    lengths in [0, page_table columns x page size], and the page-table entries of every page read inside the cache's
    ``num_pages``; ValueError naming the argument otherwise. Unchecked (CUDA index tensors), a page id outside the
    pool makes the kernel read outside it (session 33: the interpreter segfaulted on one; on the GPU it is an illegal
    address), so callers on the GPU can set ``LOWBIT_CHECK_INDEX=1`` while debugging."""
    B = page_table.shape[0]
    if not (B and check_indices(lengths, page_table)):
        return
    cap = page_table.shape[1] * page_size
    lo, hi = int(lengths.min()), int(lengths.max())
    if lo < 0 or hi > cap:
        raise ValueError(f"{name} must lie in [0, {cap}] (page_table columns x page size), got [{lo}, {hi}]")
    _check_span_pages(torch.zeros_like(lengths), lengths, page_table, page_size, num_pages, "read")


def _patch_triton_interpreter() -> None:
    """Triton 3.6's interpreter converts loop bounds with ``int(ndarray)``, which NumPy >= 2.4
    refuses for 1-element arrays ("only 0-dimensional arrays can be converted"): every
    ``for k in range(0, K, BLOCK)`` with a runtime ``K`` then fails on the CPU. Wrap its tensor
    patch so ``__index__`` reads the single element. Idempotent; a no-op if triton is absent or
    its internals differ. (Added by the w4a8_int8 area.)"""
    try:
        import numpy as np
        from triton.runtime import interpreter as _interp
    except Exception:  # pragma: no cover
        return
    orig = getattr(_interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_lowbit_patched", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._lowbit_patched = True
    _interp._patch_lang_tensor = patched


def _patch_triton_interpreter_39() -> None:
    """Work around two Triton interpreter bugs seen on triton 3.9.0 (3.6.0, the device's, is fine):
    ``mask & (loop_var < n)`` can reach the interpreter's C ``load``/``store`` as an int32 array,
    which it refuses ("mask has unsupported dtype"), and ``tl.dot`` of bf16 blocks multiplies their
    bit patterns. Compiled kernels are unaffected. Under TRITON_INTERPRET=1 only, cast such masks to
    bool and widen bf16 dot operands to fp32 (exact) before the call."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as itp
    except ImportError:
        return
    builder = getattr(itp, "InterpreterBuilder", None)
    if builder is None or getattr(builder, "_lowbit_patched_39", False):
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
    builder._lowbit_patched_39 = True


def _patch_triton_interpreter_e4m3_nan() -> None:
    """Triton's interpreter converts FP8 E4M3 (``float8e4nv``) as if it had no NaN: the code 0x7F / 0xFF reads as
    +-480 and a float NaN writes as 0x7C (384), where the GPU's ``cvt`` keeps NaN both ways (E4M3's only NaN is
    S.1111.111). lowbit stores a non-finite input's scale as NaN (FP8 KV4 scales among them), so under the
    interpreter its conversions are wrapped to keep NaN as the GPU does (session 34; ``tests/test_nonfinite.py``).
    Every other value converts as before. Idempotent; a no-op if triton's internals differ."""
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
        if output_dtype == tl.float8e4nv:
            qnan = (1 << (wo - 1)) - 1
        else:  # all-ones exponent, quiet bit
            qnan = (((1 << (wo - mo - 1)) - 1) << mo) | (1 << (mo - 1))
        out = out.copy()
        out[nan] = ((sign[nan] << (wo - 1)) | qnan).astype(out.dtype)
        return out

    convert._lowbit_e4m3_nan = True
    ti._convert_float = convert


if interpret_mode():
    _patch_triton_interpreter()
    _patch_triton_interpreter_39()
    _patch_triton_interpreter_e4m3_nan()
