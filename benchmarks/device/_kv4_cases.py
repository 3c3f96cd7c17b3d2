"""Small ragged INT4-cache decode cases shared by the compute-sanitizer targets (``s31_sanitize.py``,
``s32_sanitize.py``): per case the positional arguments of ``decode_kv4_triton`` and its keywords."""
import torch

from lowbit.bench.suites.kv4 import random_cache

# D, query tokens, splits (None: the launcher's choice), zero points, lengths
CASES = ((128, 1, None, False, [700, 5, 513]), (128, 1, 1, False, [300, 1, 77]),
         (64, 2, None, True, [650, 33, 129]), (128, 2, 1, True, [97, 64, 2]))


def decode_cases(cases=CASES):
    """Yield ``(label, args, kw)`` for ``decode_kv4_triton(*args, **kw)`` (Gluon kernel, 3 sequences, 8 KV heads)."""
    for D, TQ, splits, zp, lens in cases:
        torch.manual_seed(D + TQ)
        c = random_cache(3, 8, D, max(lens), device="cuda", zero_point=zp)
        c["lengths"] = torch.tensor(lens, dtype=torch.int32, device="cuda")
        q = torch.randn(3, 32 if TQ == 1 else 16, TQ, D, device="cuda", dtype=torch.bfloat16)
        args = (q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"], c["page_table"], c["lengths"])
        kw = dict(gluon=True, num_splits=splits, k_zero=c.get("k_zero"), v_zero=c.get("v_zero"))
        yield f"kv4 D={D} TQ={TQ} splits={splits} zp={zp}", args, kw
