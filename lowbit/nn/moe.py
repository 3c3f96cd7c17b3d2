"""Quantized experts of a mixture-of-experts MLP (Mixtral, Qwen3-MoE).

transformers (5.x) keeps a sparse MoE block as a float router ``mlp.gate`` (weight ``[E, H]``, top-k routing) and an
experts module ``mlp.experts`` holding two 3-D parameters: ``gate_up_proj [E, 2I, H]`` (each expert's gate rows, then
its up rows) and ``down_proj [E, H, I]``. ``QuantExperts`` replaces the experts module: expert ``e``'s gate_up and
down become one lowbit ``QuantLinear`` each (any linear scheme and its options, as the dense layers get them), held in
two ``nn.ModuleList``s (``gate_up[e]``, ``down[e]``). The router stays float and is not replaced.

``forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` has transformers' signature and
arithmetic (an id equal to ``num_experts`` means "no expert", as transformers' sentinel of expert parallelism):
for each expert that received tokens, in increasing expert order, its tokens are gathered,
``h = silu(gate) * up`` (each rounded to the activation dtype), ``y = down(h) * weight``, and ``y`` (cast to
``hidden``'s dtype) is added into the output rows (so a token's experts are summed in expert order, as there).

Two schedules (session 38):

- **sparse** (eager calls, and calls of more than ``DENSE_MAX_TOKENS`` tokens, where the grouped schedule is not
  taken): each expert runs over the tokens
  routed to it, as transformers' eager experts do; finding them reads the routing back to the host (one
  ``bincount``), so such a call cannot be captured in a CUDA graph.
- **dense** (up to ``DENSE_MAX_TOKENS`` tokens while a CUDA graph is captured, ``torch.compile`` traces, or inside
  ``dense_schedule()``, which ``lowbit.models.generate.Generator`` holds around its warm-up and capture so both
  compile the same kernels): every expert runs over all tokens and a token's result is kept only where the router
  chose that expert (``torch.where``: an unrouted expert's value, even Inf or NaN, never enters), added in the same
  expert order. Rows are independent through the per-token activation quantization and adding an exact 0 changes
  nothing, so each output is the sparse schedule's up to the GEMMs' accumulation order, which may depend on the row
  count (GPU kernels pick tiles and split-K by it, CPU BLAS its blocking): bit for bit where GEMM rows are
  independent (the W4A8 float64 references), else in the last bits. No host read (expert ids are range-checked as
  other indices are, ``lowbit._utils.check_indices``), so the decode step is CUDA-graph capturable. It reads every
  expert's weights, which a decode batch of a few tokens mostly does anyway (8 experts, top-2: 5.3 hit on average
  at 4 tokens, 7.9 at 16). Eagerly it would launch 4x the GEMMs of the sparse schedule at one token, each paying
  the host's launch time (w4a8-fp8, one token: 7.1 ms per call eagerly dense, ``s38_moe_graph.json``, vs 1.4 ms
  sparse, ``s38_moe_after.json``, in ``benchmarks/results/h200/``), hence eager calls stay sparse.

- **grouped** (session 39; ``w4a8-fp8`` and ``w4a8-int8`` experts, and since session 40 ``lut`` experts in the
  fragment layout called in their dtype; up to ``GROUPED_MAX_TOKENS`` tokens, eager, captured or compiled alike;
  since session 41 also larger calls (prefill) where ``grouped_at`` finds it faster than the sparse schedule: every
  size from ``GROUPED_ALL_EXPERTS`` experts, else up to ``GROUPED_MAX_ROWS`` mean rows per expert):
  ops ``lowbit::moe_w4a8_fp8`` / ``lowbit::moe_w4a8_int8`` / ``lowbit::moe_lut``, one grouped GEMM launch
  per projection over the rows sorted by expert on the device (``lowbit.kernels.moe_grouped``): no host read, and
  only the routed experts' weights are read. The same arithmetic as the sparse schedule (the silu / weight / sum roundings and order), up to the GEMMs'
  accumulation order. Expert ids are range-checked as the dense schedule checks them (``check_indices``: on the
  CPU, or with ``LOWBIT_CHECK_INDEX=1``); unchecked, an id outside ``[0, num_experts)`` adds nothing (since session
  41 also in CUDA prefill calls, which the sparse schedule's host read used to check). Prefill calls run in chunks
  of tokens (``prefill_chunk``). It replaces both schedules above for such experts at these sizes.
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch import nn

from lowbit._utils import check_indices
from lowbit.formats.common import FP8_E4M3
from lowbit.nn.base import GPTQ_ATTR

ACTIVATIONS = ("silu",)
DENSE_MAX_TOKENS = 64  # captured / compiled calls of at most this many tokens take the dense schedule
# the Generator captures MoE decode steps by default only up to this many experts per layer: the dense schedule reads
# every expert, E / (top-k) times the chosen ones at one token (measured: 8 experts, top-2; a 128-expert top-8 model
# would read 16x and launch 256 GEMMs per layer; cuda_graphs=True still captures it)
DENSE_GRAPH_MAX_EXPERTS = 16
GROUPED_MAX_TOKENS = 64  # calls of at most this many tokens take the grouped schedule where it applies; larger ones
# (prefill) take it where ``grouped_at`` says it beats the sparse schedule (session 41)
# from this many experts the grouped schedule is taken at every size: the sparse one pays ~0.5 ms of host time per
# routed expert (two eager module calls); session 41, H200, Qwen3-30B-A3B-shaped block (128 experts, top-8), eager,
# us, grouped / sparse (``s41_moe_prefill_r1.json``): w4a8-fp8 276 / 130274 at 128 tokens, 3127 / 72151 at 16384;
# lut 10495 / 39790 at 16384
GROUPED_ALL_EXPERTS = 16
# below it, the mean routed rows per expert (tokens x k / experts) up to which the grouped schedule is taken; session
# 41, Mixtral-8x7B-shaped block (8 experts, top-2), eager, us, grouped / sparse (``s41_moe_prefill_r2.json``): w4a8-fp8
# 1580 / 10839 at 256 rows, 5724 / 12488 at 1024, 24811 / 15655 at 4096; w4a8-int8 6362 / 9447 at 1024, 25704 /
# 16661 at 4096; lut (the kernel at every size) 7030 / 8270 at 512, 13767 / 6947 at 1024; "lut-dequant": lut
# experts that can take the prefill form (``lowbit.ops.moe.prefill_form``: bf16), no bound
# (``s41_moe_prefill_r3_mixtral.json``: 3145 / 5205 at 256 rows, 5915 / 6824 at 1024, 20079 / 22302 at 4096)
# "w4a8-fp8-dequant": w4a8-fp8 experts that can take the FP8 prefill form (``lowbit.ops.moe.prefill_form``), no
# bound (``s41_scaled_grouped.json``)
GROUPED_MAX_ROWS = {"w4a8-fp8": 1024, "w4a8-int8": 1024, "lut": 512, "lut-dequant": None, "w4a8-fp8-dequant": None}
# prefill calls of the grouped schedule run in chunks of tokens whose activation transients stay within this many
# bytes (``prefill_chunk``; bf16: Mixtral-8x7B 8192 tokens, Qwen3-30B-A3B 16384, the sizes measured in one call in
# session 41); the prefill forms' dequantized weights (one projection of every routed expert: bf16 for ``lut``, FP8
# for ``w4a8-fp8``; Mixtral-8x7B's gate_up 1.9 / 0.9 GB) come on top, once per chunk
PREFILL_CHUNK_BYTES = 2 << 30
PREFILL_CHUNK_MIN = 1024
_GROUPED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # of the activations and routing weights
_INT8_DTYPES = (torch.uint8, torch.float32, torch.uint8, torch.uint8)
_STATE = threading.local()  # .dense: depth of this thread's dense_schedule() contexts


@contextlib.contextmanager
def dense_schedule():
    """Calls of at most ``DENSE_MAX_TOKENS`` tokens take the dense schedule inside this context, in this thread
    (module docstring): a CUDA-graph capture's warm-up calls then compile the kernels the capture launches."""
    _STATE.dense = getattr(_STATE, "dense", 0) + 1
    try:
        yield
    finally:
        _STATE.dense -= 1


def prefill_chunk(tokens: int, k: int, grouped: dict, hidden: int, itemsize: int) -> int:
    """Tokens per grouped call: all ``tokens`` up to ``GROUPED_MAX_TOKENS`` (and while ``torch.compile`` traces: a
    Python loop over a symbolic length would specialize it, recompiling for every prompt length); above, equal
    chunks of at most the largest power of two (at least ``PREFILL_CHUNK_MIN``) whose transients fit
    ``PREFILL_CHUNK_BYTES``: per routed row the gate_up output, ``silu(gate) * up`` and the down output (``2I + I +
    H`` values of ``itemsize`` bytes), alive together in ``lowbit.ops.moe._experts``. Tokens are independent in
    every schedule, so the chunks' outputs are the whole call's up to the GEMMs' row-count-dependent accumulation
    order (and the prefill forms' row thresholds, which a short chunk may not reach)."""
    if tokens <= GROUPED_MAX_TOKENS or torch.compiler.is_compiling():
        return tokens
    from lowbit.ops.moe import weight_rows

    n2 = weight_rows(grouped["scheme"], grouped["gate_up"])  # 2I
    per = max(1, k * (n2 + n2 // 2 + hidden) * itemsize)
    n = PREFILL_CHUNK_MIN
    while n * 2 * per <= PREFILL_CHUNK_BYTES:
        n *= 2
    if tokens <= n:
        return tokens
    chunks = -(-tokens // n)
    return -(-tokens // chunks)  # equal chunks (no short last one re-reading every expert's weights)


def grouped_at(tokens: int, k: int, num_experts: int, scheme: str) -> bool:
    """Does a call of ``tokens`` tokens (top-``k`` of ``num_experts``) take the grouped schedule, for experts that
    have one (``scheme``): up to ``GROUPED_MAX_TOKENS`` tokens always; above, with at least ``GROUPED_ALL_EXPERTS``
    experts, or while the mean routed rows per expert stay within ``GROUPED_MAX_ROWS[scheme]`` (measured rule)."""
    if tokens <= GROUPED_MAX_TOKENS or num_experts >= GROUPED_ALL_EXPERTS:
        return True
    rows = GROUPED_MAX_ROWS.get(scheme, 0)
    return rows is None or tokens * k <= rows * num_experts


def _dense_wanted(x: torch.Tensor) -> bool:
    if x.shape[0] > DENSE_MAX_TOKENS:
        return False
    return bool(getattr(_STATE, "dense", 0)) or torch.compiler.is_compiling() or (
        x.is_cuda and torch.cuda.is_current_stream_capturing())


class QuantExperts(nn.Module):
    """``num_experts`` experts, each a quantized gate_up ``[2I, H]`` (gate rows first) and down ``[H, I]`` (module
    docstring). Built by ``from_experts``; ``QuantExperts(num_experts)`` alone holds placeholders (checkpoint
    loading replaces them by name: ``gate_up.<e>``, ``down.<e>``)."""

    def __init__(self, num_experts: int, act: str = "silu"):
        super().__init__()
        if int(num_experts) < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if act not in ACTIVATIONS:
            raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}")
        self.num_experts = int(num_experts)
        self.act = act
        self.grouped = True  # take the grouped schedule where it applies (False: the per-expert modules; A/B runs)
        self.gate_up = nn.ModuleList([nn.Identity() for _ in range(self.num_experts)])
        self.down = nn.ModuleList([nn.Identity() for _ in range(self.num_experts)])

    def container_config(self) -> dict:
        """What ``lowbit.models.checkpoint`` needs to rebuild the container before loading its experts."""
        return {"num_experts": self.num_experts, "act": self.act}

    @classmethod
    def from_experts(cls, experts: nn.Module, scheme: str, **options) -> "QuantExperts":
        """Quantize transformers' experts module (3-D ``gate_up_proj`` / ``down_proj``) with linear ``scheme``."""
        from lowbit import quantize_linear

        gu, dn = experts_weights(experts)
        recs = getattr(experts, GPTQ_ATTR, None) or {}  # GPTQ's scales per (matrix, expert), lowbit.ptq.gptq
        out = cls(gu.shape[0])
        for e in range(gu.shape[0]):
            for key, w, mods in (("gate_up", gu[e], out.gate_up), ("down", dn[e], out.down)):
                lin = _as_linear(w)
                if (key, e) in recs:
                    setattr(lin, GPTQ_ATTR, recs[(key, e)])
                mods[e] = quantize_linear(lin, scheme, **options)
        return out

    @property
    def scheme(self) -> str:
        return getattr(self.gate_up[0], "scheme", "")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if hidden_states.dim() != 2:
            raise ValueError(f"hidden_states must be [tokens, hidden], got {list(hidden_states.shape)}")
        if top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != hidden_states.shape[0]:
            raise ValueError(f"top_k_index {list(top_k_index.shape)} and top_k_weights {list(top_k_weights.shape)} "
                             f"must both be [tokens, k] with tokens = {hidden_states.shape[0]}")
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        if flat.numel() == 0:
            return torch.zeros_like(hidden_states)
        grouped = (self.grouped_weights() if top_k_weights.dtype in _GROUPED_DTYPES
                   and hidden_states.dtype in _GROUPED_DTYPES else None)
        if grouped is not None:
            from lowbit.ops.moe import prefill_form, weight_rows

            key = grouped["scheme"]
            if prefill_form(key, hidden_states, self.num_experts, weight_rows(key, grouped["gate_up"]) // 2):
                key += "-dequant"  # (GROUPED_MAX_ROWS' keys)
            if not grouped_at(hidden_states.shape[0], k, self.num_experts, key):
                grouped = None
        if grouped is not None and grouped["scheme"] == "lut" and hidden_states.dtype != grouped["dtype"]:
            grouped = None  # (the LUT kernels run in the experts' activation dtype; the modules cast per call)
        if grouped is not None or _dense_wanted(hidden_states):  # the schedules without a host read
            if check_indices(top_k_index) and (int(flat.min()) < 0 or int(flat.max()) > self.num_experts):
                raise ValueError(self._bad_ids())
            if grouped is None:
                return self._dense(hidden_states, top_k_index, top_k_weights, torch.zeros_like(hidden_states))
            n = prefill_chunk(hidden_states.shape[0], k, grouped, hidden_states.shape[1], hidden_states.element_size())
            if n < hidden_states.shape[0]:  # prefill: bounded transients (the gate_up output of every routed row)
                return torch.cat([self._grouped(hidden_states[t:t + n], top_k_index[t:t + n],
                                                top_k_weights[t:t + n], grouped)
                                  for t in range(0, hidden_states.shape[0], n)])
            return self._grouped(hidden_states, top_k_index, top_k_weights, grouped)
        out = torch.zeros_like(hidden_states)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        # the one host read: counts of [negative ids, expert 0, ..., expert E-1, id E (transformers' "no expert" of
        # expert parallelism: skipped), larger ids]
        counts = torch.bincount(flat.clamp(-1, self.num_experts + 1) + 1, minlength=self.num_experts + 3).tolist()
        if counts[0] or counts[-1]:
            raise ValueError(self._bad_ids())
        counts = counts[1:self.num_experts + 1]
        w_flat = top_k_weights.reshape(-1)
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            sel = order[start:start + c]
            start += c
            tok = sel // k
            gate, up = self.gate_up[e](hidden_states[tok]).chunk(2, dim=-1)
            y = self.down[e](F.silu(gate) * up) * w_flat[sel, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    def _grouped(self, hidden_states, top_k_index, top_k_weights, grouped):
        """The grouped schedule's op for ``grouped = grouped_weights()`` (ids already checked where they can be)."""
        from lowbit.ops import moe as ops

        if grouped["scheme"] == "lut":
            return ops.moe_lut(hidden_states, top_k_index, top_k_weights, grouped["gate_up"], grouped["down"],
                               grouped["bits"], grouped["group_size"], weights_checked=True)
        if grouped["scheme"] == "w4a8-fp8":
            return ops.moe_w4a8_fp8(hidden_states, top_k_index, top_k_weights, grouped["gate_up"],
                                    grouped["down"], grouped["group_size"], weights_checked=True)
        return ops.moe_w4a8_int8(hidden_states, top_k_index, top_k_weights, grouped["gate_up"], grouped["down"],
                                 grouped["group_size"], tiled=grouped["tiled"], weights_checked=True)

    def _bad_ids(self) -> str:
        return (f"top_k_index holds an expert id outside [0, num_experts = {self.num_experts}] (num_experts: no "
                "expert)")

    def grouped_weights(self) -> dict | None:
        """``_grouped_spec()``, kept while the expert modules are the same objects (checking them all costs ~2 ms of
        host time per call at 128 experts, on every eager call). The cache holds the modules themselves, so a
        replaced expert (a checkpoint's placeholders, ``qe.gate_up[e] = ...``) is seen; ``.to()`` / ``.half()``
        clear it (``_apply``). After assigning an expert's buffers directly (``m.codes = t``), call
        ``clear_grouped_cache()``."""
        if not getattr(self, "grouped", True):  # (modules pickled before session 39 lack the attribute)
            return None
        if torch.compiler.is_compiling():
            return self._grouped_spec()
        mods = (*self.gate_up, *self.down)
        hit = self.__dict__.get("_grouped_cache")
        if hit is not None and hit[0] == mods:  # element-wise identity (modules compare by identity)
            return hit[1]
        spec = self._grouped_spec()
        self.__dict__["_grouped_cache"] = (mods, spec)
        return spec

    def clear_grouped_cache(self) -> None:
        self.__dict__.pop("_grouped_cache", None)

    def _apply(self, fn, *args, **kwargs):
        self.clear_grouped_cache()  # .to() / .cuda() / .half() replace the experts' buffers
        return super()._apply(fn, *args, **kwargs)

    def _grouped_spec(self) -> dict | None:
        """The grouped schedule's weights (module docstring), or None where it does not apply: every expert a plain
        linear pair of one scheme -- ``w4a8-fp8`` (per expert ``(codes, scales, pts_exp)``), ``w4a8-int8`` with
        groups a multiple of 128 or per-channel (``(qweight, wscale, gscale, gzs)``; one code layout per
        projection) or ``lut`` in the fragment layout (``_lut_spec``) -- with one group size, no bias, no fused
        activation, the format's buffer dtypes (a module cast by ``.to(dtype)`` converts its FP8 / fp32 scales too:
        the per-expert modules then raise, naming the buffer), one device (a review finding: the kernels read the
        buffers by address, unchecked), and one shape per field, contiguous and 16-byte aligned (``_uniform``).
        ``{"scheme", "gate_up", "down", "group_size", "tiled"}`` (``lut``: ``"bits"``, ``"dtype"``)."""
        spec = self._scheme_spec()
        return spec if spec is not None and _uniform(spec) else None

    def _scheme_spec(self) -> dict | None:
        """``_grouped_spec`` before the shape / alignment check."""
        from lowbit.nn.lut import LUTLinear
        from lowbit.nn.w4a8_fp8 import W4A8FP8Linear
        from lowbit.nn.w4a8_int8 import W4A8INT8Linear

        mods = (*self.gate_up, *self.down)
        m0 = mods[0]
        if type(m0) is LUTLinear:
            return self._lut_spec(mods, m0)
        if type(m0) is W4A8FP8Linear:
            if not all(type(m) is W4A8FP8Linear and m.bias is None and m.activation is None
                       and m.group_size == m0.group_size and m.codes.dtype == torch.uint8
                       and m.scales.dtype == FP8_E4M3 and m.codes.device == m0.codes.device
                       and m.scales.device == m0.codes.device for m in mods):
                return None
            fields = [lambda m: m.codes, lambda m: m.scales, lambda m: m.pts_exp]
            scheme = "w4a8-fp8"
        elif type(m0) is W4A8INT8Linear:
            g = m0.group_size
            if (g != -1 and g % 128) or not all(
                    type(m) is W4A8INT8Linear and m.bias is None and m.group_size == g
                    and (m.qweight.dtype, m.wscale.dtype, m.gscale.dtype, m.gzs.dtype) == _INT8_DTYPES
                    and all(t.device == m0.qweight.device for t in (m.qweight, m.wscale, m.gscale, m.gzs))
                    for m in mods):
                return None
            if any(m.tiled != ms[0].tiled for ms in (self.gate_up, self.down) for m in ms):
                return None
            fields = [lambda m: m.qweight, lambda m: m.wscale, lambda m: m.gscale, lambda m: m.gzs]
            scheme = "w4a8-int8"
        else:
            return None
        return {"scheme": scheme, "group_size": m0.group_size,
                "tiled": tuple(bool(getattr(ms[0], "tiled", False)) for ms in (self.gate_up, self.down)),
                "gate_up": tuple([f(m) for m in self.gate_up] for f in fields),
                "down": tuple([f(m) for m in self.down] for f in fields)}

    def _lut_spec(self, mods, m0) -> dict | None:
        """``_scheme_spec`` of ``lut`` experts: every module a plain ``LUTLinear`` in the fragment layout
        (``layout='mma'``: 3/4-bit; ``lowbit.ops.moe.moe_lut``) of one bits / group size / dtype, no bias, no fused
        activation, buffers in the module's dtype on one device; ``{"scheme", "gate_up", "down", "bits",
        "group_size", "dtype"}`` with ``(qweight, qweight_hi or qweight, scales, pairs, table)`` per projection."""
        from lowbit.nn.lut import LUTLinear

        dt = m0.dtype
        dev = m0.qweight.device
        if m0.layout != "mma" or m0.bits not in (3, 4) or not all(
                type(m) is LUTLinear and m.layout == "mma" and m.bits == m0.bits and m.group_size == m0.group_size
                and m.dtype == dt and m.bias is None and m.activation is None and m.qweight.dtype == torch.int32
                and m.scales.dtype == dt and m.pairs.dtype == dt and m.table.dtype == torch.float32
                and all(t.device == dev for t in (m.qweight, m.scales, m.pairs, m.table))
                and (m.bits == 4 or m.qweight_hi.device == dev) for m in mods):
            return None
        fields = [lambda m: m.qweight, lambda m: m.qweight_hi if m.bits == 3 else m.qweight, lambda m: m.scales,
                  lambda m: m.pairs, lambda m: m.table]
        return {"scheme": "lut", "bits": m0.bits, "group_size": m0.group_size, "dtype": dt,
                "gate_up": tuple([f(m) for m in self.gate_up] for f in fields),
                "down": tuple([f(m) for m in self.down] for f in fields)}

    def _dense(self, x, top_k_index, top_k_weights, out):
        """Every expert over all tokens, kept where routed (module docstring)."""
        for e in range(self.num_experts):
            hit = top_k_index == e  # [T, k]: at most one slot per token
            w = (top_k_weights * hit).sum(-1, keepdim=True).to(top_k_weights.dtype)  # the chosen weight (exact)
            gate, up = self.gate_up[e](x).chunk(2, dim=-1)
            y = self.down[e](F.silu(gate) * up) * w
            out += torch.where(hit.any(-1, keepdim=True), y.to(out.dtype), torch.zeros((), dtype=out.dtype,
                                                                                     device=out.device))
        return out

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, act={self.act!r}, scheme={self.scheme!r}"


def _uniform(spec: dict) -> bool:
    """Every field of each projection one shape and stride across the experts, contiguous and 16-byte aligned (the
    grouped kernels read expert ``e``'s tensors by address with expert 0's strides; a review of session 40: a module
    swapped in with other shapes would be read out of bounds, an unaligned view made ``address_table`` raise)."""
    addresses = not torch.compiler.is_compiling()  # (traced: the op's launcher checks them, ``address_table``)
    for proj in (spec["gate_up"], spec["down"]):
        for field in proj:
            ts = [t for t in field if isinstance(t, torch.Tensor)]
            if any(t.shape != ts[0].shape or not t.is_contiguous() or (addresses and t.data_ptr() % 16) for t in ts):
                return False
    return True


def experts_weights(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up ``[E, 2I, H]``, down ``[E, H, I]``) of transformers' experts module; ValueError for another layout
    (transposed or interleaved storage, biases, a missing gate)."""
    gu, dn = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(dn, torch.Tensor) or gu.dim() != 3 or dn.dim() != 3:
        raise ValueError(f"{type(experts).__name__}: lowbit quantizes experts stored as 3-D gate_up_proj "
                         "[E, 2I, H] and down_proj [E, H, I] (transformers 5.x)")
    for flag, fine in (("is_transposed", False), ("is_concatenated", True), ("has_bias", False),
                       ("has_gate", True), ("has_post_expert_norm", False)):
        if getattr(experts, flag, fine) != fine:
            raise ValueError(f"{type(experts).__name__}: {flag}={getattr(experts, flag)} is not the layout lowbit "
                             "quantizes (gate and up rows concatenated, [out, in] per expert, no bias)")
    E, two_i, H = gu.shape
    if two_i % 2 or dn.shape != (E, H, two_i // 2):
        raise ValueError(f"{type(experts).__name__}: gate_up_proj {list(gu.shape)} and down_proj "
                         f"{list(dn.shape)} do not fit [E, 2I, H] and [E, H, I]")
    return gu, dn


def _as_linear(w: torch.Tensor) -> nn.Linear:
    """An ``nn.Linear`` viewing ``w [out, in]`` (no copy), for ``quantize_linear``."""
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(w.detach(), requires_grad=False)
    return lin
