"""Session-33 probe: why the CLUSTER variant of the INT4-cache decode runs slower. Queries the driver's occupancy
of the compiled variants (cuOccupancyMaxActiveClusters for the cluster launch, cuOccupancyMaxActiveBlocksPerMultiprocessor
for the plain one) and times the cluster launch with the shared-memory carveout preference at 100 %. Prints JSON lines."""
import ctypes
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import time_cuda  # noqa: E402
from lowbit.bench.suites.kv4 import random_cache  # noqa: E402
from lowbit.kernels import decode_kv4 as dk  # noqa: E402

cu = ctypes.CDLL("libcuda.so.1")


class Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("x", ctypes.c_uint), ("y", ctypes.c_uint),
                ("z", ctypes.c_uint), ("rest", ctypes.c_char * 52)]


class Cfg(ctypes.Structure):
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint), ("bx", ctypes.c_uint),
                ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(Attr)), ("n", ctypes.c_uint)]


def clusters(func, cl, programs, smem, policy=None):
    attrs = (Attr * 2)()
    attrs[0].id, attrs[0].x, attrs[0].y, attrs[0].z = 4, cl, 1, 1  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    n = 1
    if policy is not None:  # CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE: 1 spread, 2 load balancing
        attrs[1].id, attrs[1].x = 5, policy
        n = 2
    cfg = Cfg(cl, programs, 1, 32, 1, 1, smem, None, attrs, n)
    out = ctypes.c_int(-1)
    rc = cu.cuOccupancyMaxActiveClusters(ctypes.byref(out), ctypes.c_void_p(func), ctypes.byref(cfg))
    return out.value, rc


B, L = int(os.environ.get("B", 16)), int(os.environ.get("L", 8192))
c = random_cache(B, 8, 128, L, device="cuda")
q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
args = (q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"], c["page_table"], c["lengths"])
_, kp = dk.decode_kv4_triton(*args, gluon=True, max_len=L, return_kernel=True, cluster=False)
ns = dk.LAST_LAUNCH["num_splits"]
_, kc = dk.decode_kv4_triton(*args, gluon=True, max_len=L, return_kernel=True, cluster=True)
blocks = ctypes.c_int(-1)
cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(blocks), ctypes.c_void_p(kp.function), 32,
                                               kp.metadata.shared)
row = {"B": B, "L": L, "splits": ns, "plain_blocks_per_sm": blocks.value, "plain_smem": kp.metadata.shared,
       "cluster_packed": list(kc.packed_metadata)}
cu.cuFuncSetAttribute(ctypes.c_void_p(kc.function), 14, 1)  # NON_PORTABLE_CLUSTER_SIZE_ALLOWED
for pol in (None, 1, 2):
    row[f"max_active_clusters_policy{pol}"] = clusters(kc.function, ns, B * 8, kc.packed_metadata[2], pol)
print(json.dumps(row), flush=True)


def t(**kw):
    return time_cuda(lambda: dk.decode_kv4_triton(*args, gluon=True, max_len=L, **kw), [()], warmup=5, reps=50)


res = {"default_ms": t(cluster=False), "cluster_ms": t(cluster=True)}
cu.cuFuncSetAttribute(ctypes.c_void_p(kc.function), 9, 100)  # PREFERRED_SHARED_MEMORY_CARVEOUT = 100 %
row2 = {f"carveout100_max_active_clusters": clusters(kc.function, ns, B * 8, kc.packed_metadata[2], 1)}
res["cluster_carveout100_ms"] = t(cluster=True)
res["default_again_ms"] = t(cluster=False)
print(json.dumps({**row2, **res}), flush=True)
