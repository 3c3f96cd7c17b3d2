"""Session-23 model A/B: LUT decode options switched on or off for every launch of the op by patching the
launch-config functions, then the model bench as in session 22 (decode at ctx 1k, prefill 16 x 1024) for the LUT
recipes beside bf16.

    PYTHONPATH=$PWD python3 benchmarks/device/s23_model.py OUT     (env S23_LUT, S23_BATCHES, S23_RECIPES, S23_LAYERS,
    S23_CTX)

``S23_LAYERS`` (session 27): decoder layers built and measured (default 2, scaled to 32; 32 = the whole depth,
no scaling: the head-only step's noise is then not multiplied by 16).

``S23_LUT`` (comma-separated): ``smem`` = the register-table kernels' (Triton and Gluon) ``smem_table`` on
everywhere; ``no_gluon`` = the 8..16-token qkv / o launches go to the Triton
register-table kernel instead of the Gluon one; ``off`` = session 24's table defaults undone (no ``smem_table``, the
4-bit K >= 8192 weights at 9..16 tokens on the fragment kernel); ``s24`` = session 25's launch changes undone
(LUT dispatch and the float-cache decode's split rule); ``qkv_o4`` = the stacked dot on qkv-sized N at 33..64
tokens; empty = the committed dispatch. Options measured and since removed with what they switched (their runs
name the command; the script at those commits has them): ``wide`` / ``xperm`` / ``frag_wide`` (sessions 23-24: the
64 KB tables and ``x_perm``), ``trig0/1/2`` / ``fragpass`` (session 26: the fragment kernel's SiLU*mul epilogue
under PDL with each trigger point, and without the epilogue; ``model_s26_b1_*.json``).
"""
import os
import sys
import time

sys.path.insert(0, os.getcwd())
from lowbit.bench import model as BM  # noqa: E402
from lowbit.kernels import lut_wgmma as LW  # noqa: E402
from lowbit.kernels import lut_wgmma_gluon as LGL  # noqa: E402

opts = [o for o in os.environ.get("S23_LUT", "").split(",") if o]
_wgmma_config = LW.wgmma_config
_gluon_config = LGL.gluon_config
if "smem" in opts:  # both register-table kernels (Triton and Gluon)
    LGL.gluon_config = lambda M, N=0: dict(_gluon_config(M, N), smem_table=True)
    LW.wgmma_config = lambda *a, **k: dict(_wgmma_config(*a, **k), smem_table=True)
if "off" in opts:  # session 24's defaults undone: no smem_table anywhere, 4-bit K >= 8192 at 9..16 tokens on the
    # fragment kernel again (the A/B baseline once the table is the default)
    LW.wgmma_config = lambda *a, **k: dict(_wgmma_config(*a, **k), smem_table=False)
    LGL.gluon_config = lambda M, N=0: dict(_gluon_config(M, N), smem_table=False)
    _pref = LW.wgmma_preferred
    LW.wgmma_preferred = lambda M, N, K, bits=4: _pref(M, N, K, bits) and (bits == 3 or M >= 17 or (K < 8192 and M >= 9))
    _tok = LGL.gluon_tokens
    LGL.gluon_tokens = lambda N, K: _tok(N, K) if N * K <= 32_000_000 else None
if "s24" in opts:  # session 25's changes undone: the previous launches (benchmarks/device/s25_probe.py prev_dispatch)
    # and the float-cache decode's split rule without its no-split threshold
    from lowbit.kernels import decode_float as DF

    DF.NO_SPLIT_PER_SM = 10 ** 9
    _tok = LGL.gluon_tokens
    LGL.gluon_tokens = lambda N, K: None if (N * K > 32_000_000 and N >= 16384) else _tok(N, K)

    def _cfg24(M, N, K, G, bits=4):
        c = _wgmma_config(M, N, K, G, bits)
        if bits == 4 and M <= 16 and N <= 4096 and K >= 8192:
            return dict(c, rt=8, one_dot=False, maxnreg=128, ctas_per_sm=4)
        return c
    LW.wgmma_config = _cfg24
if "qkv_o4" in opts:  # session 25: the stacked dot on qkv-sized N at 33..64 tokens
    _cfg25 = LW.wgmma_config
    LW.wgmma_config = lambda M, N, K, G, bits=4: (
        dict(_cfg25(M, N, K, G, bits), rt=4, one_dot=True) if (bits == 4 and 32 < M <= 64 and 4096 < N < 16384
                                                               and K < 8192) else _cfg25(M, N, K, G, bits))
if "no_gluon" in opts:
    LGL.gluon_preferred = lambda *a, **k: False
t0 = time.time()
B = [int(b) for b in os.environ.get("S23_BATCHES", "1,64").split(",")]  # issue 7: >= 2.5x at 1, >= 1.5x at 64
tag = "_".join(opts) or "committed"
nl = int(os.environ.get("S23_LAYERS", "2"))
BM.run(os.path.join(sys.argv[1], f"model_{tag}"), recipes=tuple(os.environ.get("S23_RECIPES", "flute-nf4").split(",")),
       prefill_seqs=[1024], decode_batches=B, decode_ctx=[int(c) for c in os.environ.get("S23_CTX", "1024").split(",")], layers=nl, time_budget_s=float(os.environ.get("S23_BUDGET", "200")),
       command=" ".join([f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("S23_")]
                        + ["PYTHONPATH=$PWD python3"] + sys.argv))
print("model_s", time.time() - t0)
