"""GPTQ (Frantar et al., 2023, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"): error-compensating rounding of a linear weight onto a format's grid, for every weight format
lowbit stores (``w4a8-fp8``, ``w4a8-int8``, ``lut``). None of the five seed papers uses it (FireQ, QServe
and FLUTE round to nearest); it is here because it is the PTQ a user of 4-bit weights expects, and it
composes with theirs: CAS / SmoothQuant / RPN are folded into the float weights first, then GPTQ picks the
codes under the format's own scale rule.

Per linear ``W [N, K]`` with inputs ``x`` (calibration tokens through the already-quantized earlier
layers: layer by layer, "sequential" in the paper's sense)::

    H     = 2/T * sum_t x_t x_t^T + lambda I        float64 on the CPU, float32 elsewhere;
                                                    lambda = damp * mean(diag H) (damp 0.01)
    U     = upper Cholesky factor of H^-1
    for each column j (in blocks of 128, the paper's lazy batch updates):
        q_j   = grid(w_j)                           the format's quantize-dequantize of the column
        e_j   = (w_j - q_j) / U[j, j]
        w_k  -= e_j * U[j, k]   for k > j           the columns not yet quantized absorb the error

Decisions (each tested in ``tests/test_gptq.py``):
- **Group scales.** Without ``act_order`` a group's scales come from the group's columns *as updated so
  far*, when its first column is reached (the paper's ``groupsize`` variant); the group lies inside one
  lazy block (blocks are a multiple of ``group_size``), so the updates of earlier columns of the block
  count too (the reference implementation reads the not-yet-updated block there). With ``act_order``
  (columns by decreasing ``diag H``) the scales are fixed from the original weight first ("static
  groups"), so the stored layout keeps contiguous groups.
- **What is stored.** The scales GPTQ chose and codes that dequantize to its ``q`` exactly: the result is
  a float weight on the grid plus the scales, which the modules' ``from_linear`` take as they are (a
  ``GPTQResult`` attached to the ``nn.Linear``, ``ATTR``); round to nearest under those scales gives the
  same codes back (``tests/test_gptq.py``: the module's ``dequantize()`` equals GPTQ's weight, fp32 and bf16).
- **The output projection** (``head``, the recipes' ``lm_head=True`` with a GPTQ scheme): its Hessian from the final
  norm's output after all quantized layers; a head tied to the input embedding is untied first (the embedding keeps
  the float weight, as ``lm_head=True`` always did).
- **The column loop on the GPU.** ``gptq_weight`` runs it by the Triton kernel ``lowbit.kernels.gptq_block`` on
  CUDA tensors (``kernel=None``; ``kernel=True`` on the CPU under TRITON_INTERPRET=1): one launch per lazy block (per
  group of it without act-order, whose parameters the host computes between launches) instead of ~10 torch ops per
  column, float32, bit for bit the PyTorch loop's float32 result (``tests/test_gptq_kernel.py``; H200, session 43:
  a Llama-3-8B layer's matrices ~0.4 s instead of ~10 s, ``benchmarks/device/s43_gptq_kernel.py``). Groups wider
  than a lazy block (``w4a8-int8`` per channel) are walked in blocks of 128 from each group's first column.
- **Failure.** An error inside the pass (e.g. a Hessian Cholesky that fails) leaves the layers already done with
  their weights on the grid; their records are removed and a RuntimeError says so (reload the model).
- **Per format**, the grid is the format reference's own arithmetic (``lowbit.formats``):
  ``w4a8-fp8``: sigma = FP8(amax(W * 2^n) / 7) per group, q = clamp(round(W 2^n / sigma)), dequantized as
  FP8(q sigma) 2^-n, with PTS's n fixed from the original weight before GPTQ (the rule reads the smallest
  non-zero weight, which rounding changes). ``w4a8-int8``: the per-channel s1 from the original row
  (static), the UINT4 group (s2, z) from the group's INT8 values. ``lut``: absmax scale in the scale
  dtype, nearest table entry.
- Activation quantization (FP8 / INT8 per token) is not modelled in ``H`` (the inputs are the previous
  layers' float-activation outputs): GPTQ compensates the weight error only, as in the paper.
- Mixture-of-experts layers: each routed expert's gate_up and down by GPTQ with Hessians from the calibration
  tokens routed to it (down's input ``silu(gate) * up`` from the float gate_up of those tokens); an expert fewer
  than ``EXPERT_MIN_TOKENS`` (128) calibration tokens reached keeps round to nearest (its Hessian would have a rank
  below 128 and GPTQ would fit those few tokens). The records travel on the experts module (``ATTR``: a dict
  ``{("gate_up" | "down", expert): GPTQResult}``) to ``QuantExperts.from_experts``.
"""
from __future__ import annotations

import torch
from torch import nn

from lowbit._utils import interpret_mode
from lowbit.formats.lut import group_scales, make_table, nearest_codes
from lowbit.formats.w4a8_fp8 import fp8_round, grid_codes, group_sigma
from lowbit.formats.w4a8_int8 import quantize_int8_per_channel, uint4_codes, uint4_params
from lowbit.models.arch import INPUT_GROUPS, decoder_layers
from lowbit.nn.base import GPTQ_ATTR as ATTR
from lowbit.nn.base import GPTQResult

SCHEMES = ("w4a8-fp8", "w4a8-int8", "lut")


# ------------------------------------------------------------------------------------------------ grids
class _Grid:
    """A format's quantize-dequantize of one column under one group's parameters."""

    def params(self, wg: torch.Tensor):  # wg [N, g] float -> per-row parameters of the group
        raise NotImplementedError

    def qdq(self, w: torch.Tensor, p) -> torch.Tensor:  # w [N, c], p per row -> dequantized [N, c]
        raise NotImplementedError

    def stack(self, ps: list) -> dict:  # per-group parameters -> the GPTQResult.scales fields
        raise NotImplementedError

    KERNEL_FIELDS: tuple = ()  # the ``stack`` fields the kernel reads per group, as its p0 (and p1)

    def kernel_args(self, device) -> dict:  # the grid's ``gptq_block_triton`` keywords (format, static parts)
        raise NotImplementedError

    def kernel_params(self, ps: list) -> tuple:
        """Per-group parameters -> the kernel's float32 ``[N, G]`` (p0, p1 or None): ``KERNEL_FIELDS`` of ``stack``."""
        f = self.stack(ps)
        p = [f[name].float() for name in self.KERNEL_FIELDS]
        return p[0], (p[1] if len(p) > 1 else None)


class _FP8Grid(_Grid):
    KERNEL_FIELDS = ("sigma",)

    def __init__(self, pts_exp: int):
        self.pts_exp = pts_exp
        self.d = 2.0 ** pts_exp
        self.inv_d = 2.0 ** -pts_exp

    def params(self, wg):
        return group_sigma((wg.float() * self.d).abs().amax(-1))

    def qdq(self, w, sigma):
        sigma = sigma[:, None]
        return fp8_round(grid_codes(w.float() * self.d, sigma) * sigma) * self.inv_d

    def stack(self, ps):
        return {"sigma": torch.stack(ps, 1)}

    def kernel_args(self, device):
        return {"fmt": "w4a8-fp8", "pts_exp": self.pts_exp}


class _QoQGrid(_Grid):
    KERNEL_FIELDS = ("s2", "z")

    def __init__(self, s1: torch.Tensor):
        self.s1 = s1

    def _q8(self, w):
        return quantize_int8_per_channel(w, self.s1)[0]

    def params(self, wg):
        return uint4_params(self._q8(wg))

    def qdq(self, w, p):
        s2, z = p[0][:, None], p[1][:, None]
        q4 = uint4_codes(self._q8(w), s2, z)
        return ((q4 - z) * s2).float() * self.s1[:, None]

    def stack(self, ps):
        return {"s1": self.s1, "s2": torch.stack([p[0] for p in ps], 1), "z": torch.stack([p[1] for p in ps], 1)}

    def kernel_args(self, device):
        return {"fmt": "w4a8-int8", "s1": self.s1.to(device, torch.float32).contiguous()}


class _LUTGrid(_Grid):
    KERNEL_FIELDS = ("scales",)

    def __init__(self, table: torch.Tensor, scale_dtype: torch.dtype):
        self.t = table.float()
        self.tmax = float(table.abs().max())
        self.dtype = scale_dtype

    def params(self, wg):
        return group_scales(wg.float().abs().amax(-1), self.tmax, self.dtype)

    def qdq(self, w, s):
        sf = s.float()[:, None]
        return self.t.to(w.device)[nearest_codes(w.float() / sf, self.t).long()] * sf

    def stack(self, ps):
        return {"scales": torch.stack(ps, 1)}

    def kernel_args(self, device):
        from lowbit.kernels.gptq_block import lut_tables

        return {"fmt": "lut", "tables": lut_tables(self.t, device)}


def make_grid(scheme: str, w: torch.Tensor, options: dict) -> _Grid:
    """The grid of ``scheme`` for weight ``w`` (static per-tensor / per-channel parts taken from ``w``)."""
    if scheme == "w4a8-fp8":
        return _FP8Grid(int(options.get("pts_exp", 0)))
    if scheme == "w4a8-int8":
        return _QoQGrid(quantize_int8_per_channel(w)[1])
    if scheme == "lut":
        return _LUTGrid(make_table(options.get("table", "nf"), int(options.get("bits", 4))),
                        options.get("scale_dtype", torch.bfloat16))
    raise ValueError(f"GPTQ supports the schemes {SCHEMES}, got {scheme!r}")


# ------------------------------------------------------------------------------------------------ core
def hessian_update(h: torch.Tensor | None, n: int, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Running mean of ``2 x x^T`` over tokens: ``x`` [..., K] -> (H [K, K], tokens so far).

    One batch's products by the float32 GEMM (CUDA cores: TF32 stays off), the running sum in float64 on the CPU and
    float32 elsewhere. Session 43 tried bf16 inputs on the TF32 tensor cores (their products are exact there, the
    accumulators round less carefully: 7.3e-6 of the largest entry against 1.2e-6): it made GPTQ ~2 s per
    Llama-3-8B layer faster and every GPTQ perplexity of the embedded model worse, by 0.06-0.33 (H200, same settings,
    A/B against this GEMM, which reproduced session 42's values: ``s43_gptq_ppl*.json``), so it was taken out."""
    x = x.detach().reshape(-1, x.shape[-1])
    dt = torch.float64 if x.device.type == "cpu" else torch.float32
    x = x.float()
    t = x.shape[0]
    if h is None:
        h = torch.zeros(x.shape[1], x.shape[1], dtype=dt, device=x.device)
    prev = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False  # (a user's global TF32 switch would cost accuracy here too)
        xtx = x.T @ x
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    h.mul_(n / (n + t)).add_(xtx.to(dt), alpha=2.0 / (n + t))
    return h, n + t


def _blocks(k: int, group_size: int, block: int) -> list[tuple[int, int]]:
    """GPTQ's lazy blocks ``[i1, i2)`` of K columns: whole groups in blocks of about ``block`` columns, or, for
    groups wider than ``block`` (``w4a8-int8`` per channel), each group in blocks of ``block`` (a group's first
    column then starts a block, so its parameters see every earlier column's update)."""
    if group_size <= block:
        bs = block // group_size * group_size
        return [(i, min(i + bs, k)) for i in range(0, k, bs)]
    return [(i, min(i + block, g + group_size, k)) for g in range(0, k, group_size)
            for i in range(g, min(g + group_size, k), block)]


def gptq_weight(w: torch.Tensor, h: torch.Tensor, grid: _Grid, group_size: int, *, damp: float = 0.01,
                act_order: bool = False, block: int = 128, kernel: bool | None = None) -> tuple[torch.Tensor, dict]:
    """GPTQ of ``w`` [N, K] with Hessian ``h`` [K, K] onto ``grid`` in groups of ``group_size`` columns.
    Returns (the dequantized weight Q [N, K] float32, the grid's stacked group parameters).

    ``kernel``: the column loop by the Triton kernel ``lowbit.kernels.gptq_block`` (one launch per lazy block, or
    per group of it without ``act_order``, instead of ~10 torch ops per column), in float32 (W and U are cast
    to it); None (default): on CUDA tensors, else the PyTorch loop (in ``h``'s dtype). On CPU tensors it needs
    TRITON_INTERPRET=1 (tests). In float32 the two give the same Q and scales bit for bit
    (``tests/test_gptq_kernel.py``); the kernel's lazy blocks are at most 128 columns (``block`` above that:
    the loop's blocks differ, the results only by rounding)."""
    if w.ndim != 2 or h.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"w must be [N, K] and h [K, K], got {list(w.shape)} and {list(h.shape)}")
    if not 0.0 <= damp < 1.0:
        raise ValueError(f"damp must lie in [0, 1), got {damp}")
    use_kernel = w.is_cuda if kernel is None else bool(kernel)
    if use_kernel and not w.is_cuda and not interpret_mode():
        raise ValueError("gptq_weight(kernel=True) needs CUDA tensors, or TRITON_INTERPRET=1 on the CPU")
    n, k = w.shape
    dt = h.dtype
    W = w.detach().to(dt).clone()
    H = h.clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    ng = -(-k // group_size)
    static = None
    if act_order:  # static groups: parameters from the original weight, contiguous in the stored layout
        wp = torch.nn.functional.pad(W, (0, ng * group_size - k))
        static = [grid.params(wp[:, g * group_size:(g + 1) * group_size]) for g in range(ng)]
        perm = torch.argsort(torch.diagonal(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    else:
        perm = None
    H.diagonal().add_(damp * torch.diagonal(H).mean())
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).contiguous()
    if use_kernel:
        from lowbit.kernels.gptq_block import MAX_BLOCK

        W, U = W.float(), U.float()
        block = min(block, MAX_BLOCK)
    Q = torch.zeros_like(W)
    params: list = [None] * ng
    if use_kernel:
        kw = grid.kernel_args(W.device)
        if static is not None:
            p0, p1 = grid.kernel_params(static)
            kw.update(p0=p0, p1=p1, gidx=(perm // group_size).to(device=W.device, dtype=torch.int32))
    for i1, i2 in _blocks(k, group_size, block):
        if use_kernel:
            E1 = _kernel_block(W, U, Q, grid, group_size, i1, i2, params, kw)
        else:
            E1 = _torch_block(W, U, Q, grid, group_size, i1, i2, params, static, perm)
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    if static is not None:
        params = static
        Q = Q[:, torch.argsort(perm)]
    return Q.float(), grid.stack(params)


def _torch_block(W, U, Q, grid, group_size, i1, i2, params, static, perm) -> torch.Tensor:
    """``gptq_weight``'s column loop over the block ``[i1, i2)`` in torch ops (the reference): writes Q's columns,
    updates the block of W in place, records the parameters of the groups it starts in ``params``; returns the
    errors E [N, i2 - i1]."""
    W1 = W[:, i1:i2]
    E1 = torch.zeros_like(W1)
    U1 = U[i1:i2, i1:i2]
    p = params[i1 // group_size]  # (a block inside a wide group: the group's parameters so far)
    for j in range(i2 - i1):
        col = i1 + j
        if static is not None:
            p = static[int(perm[col]) // group_size]
        elif col % group_size == 0:
            p = grid.params(W[:, col:col + group_size])
            params[col // group_size] = p
        wj = W1[:, j]
        qj = grid.qdq(wj[:, None], p)[:, 0].to(W.dtype)
        Q[:, col] = qj
        e = (wj - qj) / U1[j, j]
        W1[:, j:] -= e[:, None] * U1[j, j:][None, :]
        E1[:, j] = e
    return E1


def _kernel_block(W, U, Q, grid, group_size, i1, i2, params, kw) -> torch.Tensor:
    """``_torch_block`` by the Triton kernel: one launch for the block with act-order's static parameters (in
    ``kw``), else one per group segment, each group's parameters computed here from W at its first column."""
    from lowbit.kernels.gptq_block import gptq_block_triton

    E1 = torch.empty((W.shape[0], i2 - i1), dtype=W.dtype, device=W.device)
    if "gidx" in kw:
        gptq_block_triton(W, U, Q, E1, i1, 0, i2 - i1, **kw)
        return E1
    for c0 in range(i1, i2, group_size) if i1 % group_size == 0 else [i1]:
        if c0 % group_size == 0:
            params[c0 // group_size] = grid.params(W[:, c0:c0 + group_size])
        p0, p1 = grid.kernel_params([params[c0 // group_size]])
        gptq_block_triton(W, U, Q, E1, i1, c0 - i1, min(c0 + group_size, i2) - i1, p0=p0, p1=p1, **kw)
    return E1


def round_to_nearest(w: torch.Tensor, grid: _Grid, group_size: int) -> torch.Tensor:
    """The format's own round to nearest of ``w`` [N, K] through ``grid`` (GPTQ's baseline), dequantized."""
    out = torch.empty(w.shape, dtype=torch.float32, device=w.device)
    for c in range(0, w.shape[1], group_size):
        wg = w[:, c:c + group_size]
        out[:, c:c + group_size] = grid.qdq(wg, grid.params(wg))
    return out


def proxy_loss(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    """``tr((W - Q) H (W - Q)^T) / 2``: the mean over calibration tokens of ``|x (W - Q)^T|^2``."""
    d = (w.to(h.dtype) - q.to(h.dtype))
    return float(((d @ h) * d).sum() / 2)


# ------------------------------------------------------------------------------------------------ model
# linears that read one input: one Hessian each group (the first role present collects it)
EXPERT_MIN_TOKENS = 128  # an expert matrix GPTQ fits needs this many routed calibration tokens (else: RTN)
EXPERT_ROLES = ("gate_proj", "up_proj", "down_proj")  # a skip naming any of them leaves the routed experts alone

def _layer_calls(model, layers: list, batches: list[torch.Tensor]) -> list[list[tuple]]:
    """Per layer, per batch: (the layer's input hidden states for layer 0, else None; its other positional
    arguments; its keyword arguments without ``hidden_states``), from one forward of the model. Each layer keeps its
    own arguments (transformers builds one attention mask per layer type: full or sliding); the hidden states of
    later layers are not kept (GPTQ recomputes them through the layers it quantized)."""
    calls: list[list[tuple]] = [[] for _ in layers]

    def grab(i, mod, args, kwargs):
        h = args[0] if args else kwargs.get("hidden_states")
        kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        calls[i].append((h if i == 0 else None, tuple(args[1:]), kw, bool(args)))

    device = next(model.parameters()).device
    stack = getattr(model, "model", model)  # the decoder stack: no lm_head logits
    handles = [layer.register_forward_pre_hook(lambda m, a, k, _i=i: grab(_i, m, a, k), with_kwargs=True)
               for i, layer in enumerate(layers)]
    try:
        for ids in batches:
            stack(input_ids=ids.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return calls


def _call_layer(layer, hidden: torch.Tensor, call: tuple) -> torch.Tensor:
    """Run ``layer`` on ``hidden`` with the other arguments of ``call`` (``_layer_calls``)."""
    _, rest, kw, positional = call
    out = layer(hidden, *rest, **kw) if positional else layer(*rest, hidden_states=hidden, **kw)
    return out[0] if isinstance(out, tuple) else out


def _count(report: dict, rec: GPTQResult, kind: str) -> None:
    report[kind] += 1
    report["rtn_loss"] += rec.stats["rtn"]
    report["gptq_loss"] += rec.stats["gptq"]


def _quantize_matrix(w: torch.Tensor, h: torch.Tensor, scheme: str, opts: dict, group_size: int, *, damp: float,
                     act_order: bool) -> tuple[torch.Tensor, GPTQResult]:
    """GPTQ of one weight ``w`` [N, K] under ``opts`` (the grid's): (Q, its GPTQResult with RTN / GPTQ losses)."""
    gs = w.shape[1] if group_size == -1 else group_size  # w4a8-int8 per-channel groups
    wf = w.float()
    grid = make_grid(scheme, wf, opts)
    hd = h.to(w.device)
    q, scales = gptq_weight(wf, hd, grid, gs, damp=damp, act_order=act_order)
    stats = {"rtn": proxy_loss(wf, round_to_nearest(wf, grid, gs), hd), "gptq": proxy_loss(wf, q, hd)}
    return q, GPTQResult(scheme, group_size, scales, opts, stats)


def _scheme_opts(scheme: str, w: torch.Tensor, options: dict, lut_dtype, pts_exp: int) -> dict:
    opts = dict(options)
    if scheme == "w4a8-fp8":
        opts["pts_exp"] = int(pts_exp)
    if scheme == "lut":  # the scale dtype LUTLinear.from_linear picks
        opts["scale_dtype"] = lut_dtype or (w.dtype if w.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16)
    return opts


class _ExpertStats:
    """Hessians of a float experts module's routed inputs (``lowbit.nn.moe.experts_weights`` layout): per expert
    the tokens routed to it (gate_up's input) and ``silu(gate) * up`` of them (down's input)."""

    def __init__(self, experts):
        from lowbit.nn.moe import experts_weights

        self.gu, self.dn = experts_weights(experts)
        self.h_gu: dict[int, tuple] = {}
        self.h_dn: dict[int, tuple] = {}

    def __call__(self, mod, args, kwargs, out):
        names = ("hidden_states", "top_k_index", "top_k_weights")
        vals = list(args) + [kwargs[n] for n in names[len(args):]]
        x, idx = vals[0], vals[1]
        x = x.reshape(-1, x.shape[-1])
        for e in torch.unique(idx[(idx >= 0) & (idx < self.gu.shape[0])]).tolist():
            xe = x[(idx.reshape(x.shape[0], -1) == e).any(-1)]
            self.h_gu[e] = hessian_update(*self.h_gu.get(e, (None, 0)), xe)
            gate, up = (xe.float() @ self.gu[e].float().T).chunk(2, dim=-1)
            self.h_dn[e] = hessian_update(*self.h_dn.get(e, (None, 0)), torch.nn.functional.silu(gate) * up)


def _gptq_layer(view, scheme, layer_calls, options, lut_dtype, pts_exps, group_size, damp, act_order, skip,
                report, expert_min_tokens) -> None:
    """``apply_gptq`` on one decoder layer: Hessians from its inputs, then GPTQ of its linears and routed experts."""
    lins = {r: m for r, m in {**view.linears(), **view.shared_linears()}.items()
            if isinstance(m, nn.Linear) and r.removeprefix("shared.") not in skip}
    collect = {grp[0] if grp[0] in lins else next((r for r in grp if r in lins), None): grp
               for grp in INPUT_GROUPS}
    collect.pop(None, None)
    hs: dict[str, tuple] = {}

    def fn(mod, inp, out, _r=None):
        hs[_r] = hessian_update(*hs.get(_r, (None, 0)), inp[0])

    handles = [lins[r].register_forward_hook(lambda m, i, o, _r=r: fn(m, i, o, _r)) for r in collect]
    experts = None
    if view.experts is not None and not set(EXPERT_ROLES) & set(skip) and hasattr(view.experts, "gate_up_proj"):
        experts = _ExpertStats(view.experts)
        handles.append(view.experts.register_forward_hook(experts, with_kwargs=True))
    try:
        for x, call in zip(*layer_calls):
            _call_layer(view.layer, x, call)
    finally:
        for h in handles:
            h.remove()
    for first, grp in collect.items():
        if first not in hs:  # a linear the calibration never reached: round to nearest later
            continue
        for role in grp:
            if role not in lins:
                continue
            lin = lins[role]
            w = lin.weight.detach()
            opts = _scheme_opts(scheme, w, options, lut_dtype, (pts_exps or {}).get((view.index, role), 0))
            q, rec = _quantize_matrix(w, hs[first][0], scheme, opts, group_size, damp=damp, act_order=act_order)
            _count(report, rec, "linears")
            lin.weight.copy_(q.to(lin.weight.dtype))
            setattr(lin, ATTR, rec)
    if experts is not None:  # routed experts: GPTQ per expert matrix, records on the experts module
        recs = {}
        for key, mats, hmap in (("gate_up", experts.gu, experts.h_gu), ("down", experts.dn, experts.h_dn)):
            for e, (h, tokens) in sorted(hmap.items()):
                if tokens < expert_min_tokens:  # too few routed tokens: GPTQ would fit them; round to nearest
                    report["experts_rtn"] += 1
                    continue
                w = mats[e].detach()
                opts = _scheme_opts(scheme, w, options, lut_dtype,
                                    (pts_exps or {}).get((view.index, f"experts.{key}", e), 0))
                q, rec = _quantize_matrix(w, h, scheme, opts, group_size, damp=damp, act_order=act_order)
                _count(report, rec, "experts")
                mats[e].copy_(q.to(mats.dtype))
                recs[(key, e)] = rec
        setattr(view.experts, ATTR, recs)


def _gptq_head(model, hidden: list, head: dict, damp: float, act_order: bool, report: dict) -> None:
    """GPTQ of the output projection on ``norm(hidden)`` (the last layer's outputs through the final norm)."""
    out = model.get_output_embeddings()
    if not isinstance(out, nn.Linear):
        return
    stack = getattr(model, "model", model)
    norm = getattr(stack, "norm", None)
    h, n = None, 0
    for x in hidden:
        h, n = hessian_update(h, n, norm(x) if norm is not None else x)
    emb = model.get_input_embeddings()
    if emb is not None and out.weight is emb.weight:  # tied: the embedding keeps the float weight
        out.weight = nn.Parameter(out.weight.detach().clone(), requires_grad=False)
    w = out.weight.detach()
    opts = _scheme_opts(head["scheme"], w, dict(head.get("options", {})), head.get("options", {}).get("dtype"),
                        head.get("pts_exp", 0))
    opts.pop("dtype", None)
    q, rec = _quantize_matrix(w, h, head["scheme"], opts, head.get("group_size", 128), damp=damp,
                              act_order=act_order)
    _count(report, rec, "lm_head")
    out.weight.copy_(q.to(out.weight.dtype))
    setattr(out, ATTR, rec)


@torch.no_grad()
def apply_gptq(model, scheme: str, batches: list[torch.Tensor], *, group_size: int = 128,
               options: dict | None = None, pts_exps: dict | None = None, damp: float = 0.01,
               act_order: bool = True, skip=(), progress: bool = True,
               expert_min_tokens: int = EXPERT_MIN_TOKENS, head: dict | None = None) -> dict:
    """GPTQ on every decoder linear of ``model`` (float ``nn.Linear``s; roles in ``skip`` left alone), layer by
    layer on ``batches`` ([1, S] token ids): each layer's Hessians come from its inputs through the layers
    already done, its weights are replaced by GPTQ's (a float weight on the format's grid) and each linear gets
    a ``GPTQResult`` (``ATTR``) that the module's ``from_linear`` then uses. ``options``: the format's
    (``bits`` / ``table`` / ``dtype`` for ``lut``); ``pts_exps``: ``{(layer index, role): n}`` for
    ``w4a8-fp8`` (default 0; routed experts: ``(layer index, "experts.gate_up" | "experts.down", expert)``);
    ``expert_min_tokens``: routed tokens an expert needs for GPTQ (fewer: round to nearest, counted in the report).
    ``head``: also the output projection (``lm_head``), on the final norm's output after the quantized layers:
    ``{"scheme", "group_size", "options", "pts_exp"}`` (a head tied to the input embedding is untied first: the
    embedding keeps its float weight).
    Returns a report: the counts of linears and expert matrices done, their proxy losses under RTN and GPTQ,
    summed."""
    if scheme not in SCHEMES:
        raise ValueError(f"GPTQ supports the schemes {SCHEMES}, got {scheme!r}")
    if not batches:
        raise ValueError("GPTQ needs calibration batches")
    options = dict(options or {})
    lut_dtype = options.pop("dtype", None)
    views = decoder_layers(model)
    calls = _layer_calls(model, [v.layer for v in views], batches)
    hidden = [c[0] for c in calls[0]]
    calls[0] = [(None,) + c[1:] for c in calls[0]]  # (one copy of the layer inputs: ``hidden``)
    report = {"linears": 0, "experts": 0, "experts_rtn": 0, "lm_head": 0, "rtn_loss": 0.0, "gptq_loss": 0.0, "act_order": act_order, "damp": damp}
    it = views
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(views, desc=f"gptq: {scheme}", unit="layer")
    try:
        for view in it:
            layer_calls = (hidden, calls[view.index])
            _gptq_layer(view, scheme, layer_calls, options, lut_dtype, pts_exps, group_size, damp, act_order, skip,
                        report, expert_min_tokens)
            # the next layer's inputs through this layer with GPTQ's weights (the paper's sequential order)
            hidden = [_call_layer(view.layer, x, call) for x, call in zip(*layer_calls)]
        if head is not None:
            _gptq_head(model, hidden, head, damp, act_order, report)
    except BaseException as exc:  # (Ctrl-C too: no stale scales for a later quantization of the half-moved model)
        for v in views:
            for m in [*v.linears().values(), *v.shared_linears().values(), v.experts]:
                if m is not None and hasattr(m, ATTR):
                    delattr(m, ATTR)
        out = model.get_output_embeddings()
        if out is not None and hasattr(out, ATTR):
            delattr(out, ATTR)
        if not isinstance(exc, Exception):
            raise
        raise RuntimeError(f"GPTQ failed ({type(exc).__name__}: {exc}); the decoder layers up to and including the "
                           "failing one may have their float weights moved onto the grid: reload the model") from exc
    return report

