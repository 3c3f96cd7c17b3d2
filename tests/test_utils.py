"""``lowbit._utils.derived`` / ``cached_dense`` (values kept per tensor; the CPU reference paths' dense weights), ``formats.w4a8_int8.exact_int_dot`` and the per-stream arrival counters of the split reductions."""
import pytest
import torch


def test_cached_dense_reuses_and_invalidates(monkeypatch):
    from lowbit._utils import cached_dense, clear_derived_cache

    calls = []
    codes = torch.randint(0, 255, (8, 4), dtype=torch.uint8)
    scales = torch.rand(8, 2)

    def build():
        calls.append(1)
        return codes.float() * scales[:, :1]

    w1 = cached_dense(build, codes, scales, tag=("t",))
    assert cached_dense(build, codes, scales, tag=("t",)) is w1 and len(calls) == 1
    scales.mul_(2)  # in place: _version moves, the next call rebuilds with the new values
    w2 = cached_dense(build, codes, scales, tag=("t",))
    assert len(calls) == 2 and torch.equal(w2, codes.float() * scales[:, :1])
    other = scales.clone()  # a different dep object: rebuild
    cached_dense(build, codes, other, tag=("t",))
    assert len(calls) == 3
    cached_dense(build, codes, other, tag=("u",))  # a different tag: rebuild
    assert len(calls) == 4
    clear_derived_cache()
    cached_dense(build, codes, other, tag=("u",))
    assert len(calls) == 5
    monkeypatch.setenv("LOWBIT_CPU_WEIGHT_CACHE", "0")
    cached_dense(build, codes, other, tag=("u",))
    cached_dense(build, codes, other, tag=("u",))
    assert len(calls) == 7
    monkeypatch.delenv("LOWBIT_CPU_WEIGHT_CACHE")
    grad = torch.rand(8, 2, requires_grad=True)  # learned scales: never cached (autograd must see build())
    cached_dense(build, codes, grad)
    cached_dense(build, codes, grad)
    assert len(calls) == 9


def test_cached_dense_entry_dies_with_its_tensor():
    import gc

    from lowbit._utils import _DERIVED, cached_dense

    codes = torch.zeros(4, 4, dtype=torch.uint8)
    cached_dense(lambda: codes.float(), codes)
    i = id(codes)
    assert any(k[0] == i for k in _DERIVED)
    del codes
    gc.collect()
    assert not any(k[0] == i for k in _DERIVED)


@pytest.mark.parametrize("K", [7, 1024, 1025, 3000])
def test_exact_int_dot_matches_float64(K):
    from lowbit.formats.w4a8_int8 import exact_int_dot

    g = torch.Generator().manual_seed(K)
    x = torch.randint(-127, 128, (5, K), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (6, K), generator=g, dtype=torch.int8)
    x[0] = 127  # the extreme row: every partial sum at its largest
    w[0] = -128
    ref = (x.double() @ w.double().t()).float()
    assert torch.equal(exact_int_dot(x, w.float()), ref)


@pytest.mark.parametrize("scheme", ["lut", "w4a8-fp8", "w4a8-int8"])
def test_cpu_modules_follow_new_weights(scheme, monkeypatch):
    """A quantized linear's CPU forward (dense weight cached after the first call) follows its packed
    tensors: after ``load_state_dict`` of another layer's weights (in-place copies) it computes that layer,
    and it equals the forward with the cache turned off."""
    import lowbit

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the plain-PyTorch references (CPU path)
    torch.manual_seed(0)
    a, b = torch.nn.Linear(256, 96), torch.nn.Linear(256, 96)
    qa, qb = lowbit.quantize_linear(a, scheme), lowbit.quantize_linear(b, scheme)
    x = torch.randn(3, 256)
    ya1, ya2 = qa(x), qa(x)  # second call: from the cache
    assert torch.equal(ya1, ya2)
    yb = qb(x)
    qa.load_state_dict(qb.state_dict())
    assert torch.equal(qa(x), yb) and not torch.equal(ya1, yb)
    monkeypatch.setenv("LOWBIT_CPU_WEIGHT_CACHE", "0")
    assert torch.equal(qa(x), yb)


def test_lut_table_values_are_kept_per_table_tensor():
    """The LUT op's pair table and uniform-table flag (``ops.lut._pairs_for`` / ``_uniform``) are built once per
    table tensor and dtype, and rebuilt after the table changes in place."""
    from lowbit.formats.lut import pair_table
    from lowbit.ops.lut import _pairs_for, _uniform

    table = torch.linspace(-1, 1, 16)
    p16 = _pairs_for(table, 4, torch.float16)
    assert _pairs_for(table, 4, torch.float16) is p16
    pbf = _pairs_for(table, 4, torch.bfloat16)  # another dtype: its own entry, the first one kept
    assert pbf.dtype != p16.dtype or not torch.equal(pbf, p16)
    assert _pairs_for(table, 4, torch.float16) is p16
    assert _uniform(table)
    table[3] += 0.05  # in place: both values follow
    assert not _uniform(table)
    assert torch.equal(_pairs_for(table, 4, torch.float16), pair_table(table, 4, torch.float16))


def test_arrival_counters_per_owner_and_stream(monkeypatch):
    """One zeroed counter buffer per (owner, device, stream), reused while large enough, grown on demand: two streams
    running one kernel family at once never share a counter (session 29)."""
    import lowbit._utils as U

    dev = torch.device("cpu")
    monkeypatch.setattr(U, "ARRIVAL_COUNTERS", {})
    monkeypatch.setattr(U, "stream_key", lambda d: 7)
    a = U.arrival_counters("fam", dev, 10)
    assert a.numel() >= 10 and a.dtype == torch.int32 and int(a.abs().sum()) == 0
    assert U.arrival_counters("fam", dev, 100) is a  # large enough: the same buffer
    assert U.arrival_counters("other", dev, 10) is not a  # another family
    big = U.arrival_counters("fam", dev, 10000)
    assert big.numel() >= 10000 and big is not a
    monkeypatch.setattr(U, "stream_key", lambda d: 8)  # another stream
    assert U.arrival_counters("fam", dev, 10) is not big


def test_stream_scratch_per_owner_and_stream(monkeypatch):
    """The split-K partial buffers: one per (owner, device, stream) like the counters, reused while large enough,
    grown on demand, of the dtype asked for."""
    import lowbit._utils as U

    dev = torch.device("cpu")
    monkeypatch.setattr(U, "STREAM_SCRATCH", {})
    monkeypatch.setattr(U, "stream_key", lambda d: 7)
    a = U.stream_scratch("fam", dev, 10, torch.float32, minimum=16)
    assert a.numel() == 16 and a.dtype == torch.float32
    assert U.stream_scratch("fam", dev, 16, torch.float32) is a
    assert U.stream_scratch("other", dev, 10, torch.int32).dtype == torch.int32
    assert U.stream_scratch("fam", dev, 100, torch.float32).numel() >= 100
    monkeypatch.setattr(U, "stream_key", lambda d: 8)  # another stream
    assert U.stream_scratch("fam", dev, 10, torch.float32) is not a


def test_stream_key_off_cuda():
    from lowbit._utils import stream_key

    assert stream_key(torch.device("cpu")) == 0


def test_tma_descriptor_only_where_tma_can_read(monkeypatch):
    """``tma_descriptor``: a descriptor for a 2-D tensor with a unit last stride and 16-byte base / rows on a
    TMA-capable device (the CPU only under the interpreter); None otherwise, so launchers keep their pointer loads."""
    import lowbit._utils as U

    pytest.importorskip("triton")
    t = torch.zeros(8, 64, dtype=torch.uint8)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert U.tma_descriptor(t, [8, 64]) is not None
    assert U.tma_descriptor(t[:, 1:], [8, 32]) is None  # base not 16-byte aligned
    assert U.tma_descriptor(torch.zeros(8, 40, dtype=torch.uint8), [8, 32]) is None  # 40-byte rows
    assert U.tma_descriptor(t.t(), [8, 8]) is None  # last stride not 1
    assert U.tma_descriptor(torch.zeros(2, 8, 64, dtype=torch.uint8), [8, 64]) is None  # not 2-D
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not U.tma_capable(t) and U.tma_descriptor(t, [8, 64]) is None  # CPU without the interpreter


def test_warn_once_warns_once():
    import warnings

    from lowbit._utils import warn_once

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            warn_once("lowbit test: said once")
    assert [str(w.message) for w in seen] == ["lowbit test: said once"]


def test_capture_cuda_graph_keeps_no_reference():
    """The capture helper holds nothing itself (a cache there kept every runner's model and cache alive)."""
    import inspect

    from lowbit import _utils

    assert not hasattr(_utils.capture_cuda_graph, "cache_info")
    assert inspect.isfunction(_utils.capture_cuda_graph)


def test_scratch_captured_by_a_graph_outlives_a_larger_request(monkeypatch):
    """A buffer handed out during a CUDA-graph capture is kept alive when a later request outgrows it (the graph
    writes it by address on every replay); buffers never captured are simply replaced; growth is geometric."""
    import lowbit._utils as U

    dev = torch.device("cpu")
    monkeypatch.setattr(U, "STREAM_SCRATCH", {})
    monkeypatch.setattr(U, "ARRIVAL_COUNTERS", {})
    monkeypatch.setattr(U, "CAPTURED_OUTGROWN", [])
    monkeypatch.setattr(U, "stream_key", lambda d: 7)
    plain = U.stream_scratch("fam", dev, 10, torch.float32, minimum=16)
    assert U.stream_scratch("fam", dev, 20, torch.float32, minimum=16).numel() == 32  # 2 x 16
    assert U.CAPTURED_OUTGROWN == []  # never captured: freed normally
    monkeypatch.setattr(U, "_capturing", lambda d: True)
    cap = U.stream_scratch("fam", dev, 30, torch.float32)
    cnt = U.arrival_counters("fam", dev, 10)
    monkeypatch.setattr(U, "_capturing", lambda d: False)
    bigger = U.stream_scratch("fam", dev, 1000, torch.float32)
    big_cnt = U.arrival_counters("fam", dev, 100000)
    assert bigger is not cap and big_cnt is not cnt and int(big_cnt.abs().sum()) == 0
    assert any(t is cap for t in U.CAPTURED_OUTGROWN) and any(t is cnt for t in U.CAPTURED_OUTGROWN)
    assert not any(t is plain for t in U.CAPTURED_OUTGROWN)


def test_run_op_calls_the_implementation_only_in_plain_eager(monkeypatch):
    """``run_op`` skips the dispatcher for plain eager tensors only: gradients, tensor subclasses (fake tensors) and
    torch.compile tracing keep the registered op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import lowbit._utils as U

    class Op:
        _init_fn = staticmethod(lambda *a: "direct")

        def __call__(self, *a):
            return "dispatched"

    op = Op()
    x = torch.ones(2)
    assert U.run_op(op, x, None, 3) == "direct"
    assert U.run_op(op, torch.ones(2, requires_grad=True)) == "dispatched"
    with FakeTensorMode():
        assert U.run_op(op, torch.empty(2)) == "dispatched"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert U.run_op(op, x) == "dispatched"


def test_lowbit_ops_expose_their_implementation():
    """The direct eager path needs torch's ``CustomOpDef._init_fn`` (present in the torch versions lowbit runs on:
    2.11 on the H200 machine, the CPU CI's); without it ``run_op`` falls back to the op, correct but slower."""
    from lowbit.ops import lut, w4a8_fp8, w4a8_int8

    for op in (w4a8_fp8._w4a8_fp8_linear_pdl, w4a8_fp8._w4a8_fp8_linear_fused, w4a8_int8._w4a8_int8_linear,
               lut._lut_gemm):
        assert callable(getattr(op, "_init_fn", None))


@pytest.mark.parametrize("scheme", ["w4a8-fp8", "w4a8-int8", "lut"])
def test_modules_still_check_x(scheme):
    """The modules skip the checks of their own buffers, not of the input."""
    import lowbit

    m = lowbit.quantize_linear(torch.nn.Linear(256, 64, bias=False), scheme, group_size=128)
    with pytest.raises(TypeError, match="x must have dtype"):
        m(torch.ones(2, 256, dtype=torch.int32))
    with pytest.raises(ValueError, match="features|x has"):
        m(torch.ones(2, 255))


@pytest.mark.parametrize("scheme", ["w4a8-int8", "lut", "w4a8-fp8"])
def test_run_op_keeps_the_op_for_tracers_modes_vmap_and_the_profiler(scheme):
    """What the review of session 38 found: make_fx, torch.jit.trace, dispatch modes, vmap and the profiler saw no
    ``lowbit::`` op (or failed) once eager calls skipped the dispatcher; they see it again."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._python_dispatch import TorchDispatchMode

    import lowbit

    q = lowbit.quantize_linear(torch.nn.Linear(64, 32, bias=False), scheme, group_size=32)
    x = torch.randn(3, 64)
    with torch.no_grad():
        g = make_fx(lambda x: q(x))(x)
        assert any("lowbit" in str(n.target) for n in g.graph.nodes if n.op == "call_function")
        assert torch.equal(g(x * 2), q(x * 2))
        seen = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, f, types, args=(), kwargs=None):
                seen.append(str(f))
                return f(*args, **(kwargs or {}))

        with Mode():
            q(x)
        assert any("lowbit" in s for s in seen)
        assert torch.vmap(q)(torch.randn(2, 3, 64)).shape == (2, 3, 32)
        with torch.autograd.profiler.profile() as prof:
            q(x)
        assert any("lowbit" in e.name for e in prof.function_events)


@pytest.mark.parametrize("scheme,dtype", [("w4a8-int8", torch.bfloat16), ("lut", torch.float16),
                                          ("w4a8-fp8", torch.bfloat16)])
def test_modules_keep_their_buffers_under_dtype_casts(scheme, dtype):
    """``module.to(dtype)`` / ``.half()`` leave the stored buffers (codes, scales, tables, bias) as they are (session
    43; they were converted and the forward raised), device moves still apply, and the cast module answers x of that
    dtype exactly as before the cast."""
    import lowbit

    q = lowbit.quantize_linear(torch.nn.Linear(64, 32), scheme, group_size=32)
    x = torch.randn(3, 64, dtype=dtype)
    want, dtypes = q(x), [b.dtype for b in q.buffers()]
    for cast in (lambda m: m.to(dtype), lambda m: m.half(), lambda m: m.float(), lambda m: m.to(torch.float64)):
        q = cast(q)
        assert [b.dtype for b in q.buffers()] == dtypes
        assert torch.equal(q(x), want)
    assert {b.device.type for b in q.to("meta").buffers()} == {"meta"}


def test_run_op_keeps_mutating_ops_and_function_modes():
    """Ops that write their arguments keep the dispatcher (it bumps the written tensors' versions), as do calls under
    a TorchFunctionMode such as ``with torch.device(...)`` (review findings, session 38)."""
    from lowbit.ops import kv4, w4a8_fp8
    import lowbit._utils as U

    assert U._mutates(kv4._kv4_append) and not U._mutates(w4a8_fp8._w4a8_fp8_linear_pdl)

    class Op:
        _init_fn = staticmethod(lambda *a: "direct")

        def __call__(self, *a):
            return "dispatched"

    with torch.device("cpu"):
        assert U.run_op(Op(), torch.ones(2)) == "dispatched"



def test_sm_count_stand_in_off_cuda():
    """``sm_count``: the launcher's stand-in off CUDA (the interpreter sizes grids with it)."""
    from lowbit._utils import sm_count

    assert sm_count(torch.device("cpu"), 4) == 4 and sm_count(torch.device("cpu"), 132) == 132
