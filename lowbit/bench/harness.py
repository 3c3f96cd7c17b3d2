"""Benchmark harness: timing with CUDA events, rotated inputs, rooflines, JSON/Markdown/PNG output.

Method (one place, every suite uses it):
- warm-up calls first (compilation, autotuning and handle creation stay out of the numbers);
- ``reps`` (>= 50) timed calls, each between two CUDA events, cycling through >= 3 input sets
  whose total size exceeds twice the L2 cache, so no call reads its inputs from L2;
- the stream is kept full (a ``torch.cuda._sleep`` ahead of each chunk of calls), so the events
  measure GPU time per call without host launch gaps, as under CUDA graphs (``mode="gpu"``, the
  default); ``mode="wall"`` records the events around back-to-back calls without that padding, so
  host launch overhead shows where it exceeds the GPU time; ``mode="sync"`` synchronizes before
  each call, so every call also pays the launch latency (~12-16 us for a cuBLAS call here): the
  method ANCHORS.md's numbers match;
- median, min and max in milliseconds; throughput from counted FLOPs and the fewest bytes moved;
  ``roofline`` = max(FLOPs / peak, bytes / bandwidth) with the ceilings measured in the same run
  (``measure_ceilings``), and ``frac_roofline`` = roofline / median.
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch


def env_info(command: str | None = None) -> dict:
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "command": command or " ".join(sys.argv),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sm_count=p.multi_processor_count,
                    l2_bytes=getattr(p, "L2_cache_size", None), gpu_mem_bytes=p.total_memory,
                    capability=f"{p.major}.{p.minor}")
    return info


def gpu_slug() -> str:
    """Folder name for results, e.g. 'h200' or 'h100'."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    for key in ("h200", "h100", "h800", "h20", "a100", "l40s", "4090"):
        if key in name:
            return key
    return name.replace("nvidia", "").strip().replace(" ", "-")


def l2_bytes() -> int:
    if torch.cuda.is_available():
        return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))
    return 50 << 20


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(o) for o in obj.values())
    return 0


def rotating_inputs(make: Callable[[], tuple], *, min_sets: int = 3, min_total_bytes: int | None = None,
                    max_sets: int = 64) -> list[tuple]:
    """Call ``make()`` until there are >= ``min_sets`` input sets totalling > 2x L2 (or
    ``min_total_bytes``); each set is an argument tuple of fresh random data."""
    target = 2 * l2_bytes() if min_total_bytes is None else min_total_bytes
    sets, total = [], 0
    while len(sets) < min_sets or (total <= target and len(sets) < max_sets):
        s = make()
        sets.append(s)
        total += _nbytes(s)
    return sets


def time_rotated(row: dict, fns: dict, xs: Sequence, reps: int = 100) -> dict:
    """Probe helper: for each ``name -> [callable per weight set]`` of ``fns``, the median of ``time_cuda`` with
    call i on weight set i and input ``xs[i]`` (sets rotated), into ``row[name + "_us"]`` (us, 2 decimals); an
    exception is kept as ``row[name + "_err"]`` and the other entries still run. Returns ``row``."""
    for name, fl in fns.items():
        try:
            t = time_cuda(lambda i, x: fl[i](x), [(i, xs[i]) for i in range(len(xs))], reps=reps)
            row[name + "_us"] = round(t["median_ms"] * 1000, 2)
        except Exception as exc:  # keep the row
            row[name + "_err"] = f"{type(exc).__name__}: {exc}"[:200]
    return row


def time_cuda(fn: Callable, arg_sets: Sequence[tuple], *, warmup: int = 10, reps: int = 100,
              chunk: int = 25, mode: str = "gpu") -> dict:
    """Median/min/max ms per call of ``fn(*args)``, cycling through ``arg_sets`` (see module doc)."""
    if mode not in ("gpu", "wall", "sync"):
        raise ValueError(f"mode must be 'gpu', 'wall' or 'sync', got {mode!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("time_cuda needs a CUDA device")
    n = len(arg_sets)
    for i in range(max(warmup, n)):
        fn(*arg_sets[i % n])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        fn(*arg_sets[i % n])
    host_s = (time.perf_counter() - t0) / n  # host time per call (launch cost, upper bound)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    clock_hz = 2.0e9
    for c0 in range(0, reps, chunk):
        c1 = min(reps, c0 + chunk)
        if mode == "gpu":
            # keep the queue ahead of the GPU: sleep for ~1.5x the host time to enqueue this chunk
            torch.cuda._sleep(int(min(1.5 * host_s * (c1 - c0), 0.2) * clock_hz))
        for i in range(c0, c1):
            if mode == "sync":
                torch.cuda.synchronize()
            starts[i].record()
            fn(*arg_sets[i % n])
            ends[i].record()
        torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "reps": reps,
            "input_sets": n, "host_ms_per_call": host_s * 1e3, "mode": mode}


def graph_us(fn, n: int = 20, reps: int = 15) -> float:
    """Per-call GPU microseconds of ``fn`` inside a CUDA graph of ``n`` back-to-back calls (what a decode
    step pays per launch: kernel time + the graph's launch gap), median of ``reps`` replays. ``fn`` may be
    a list of callables, cycled one per call (e.g. each on its own copy of the weights, so a replay
    streams them from HBM rather than L2); the graph then holds at least one call of each."""
    from lowbit._utils import capture_cuda_graph

    fns = fn if isinstance(fn, list) else [fn]
    n = max(n, len(fns))
    for f in fns:
        f()
    torch.cuda.synchronize()
    g, _ = capture_cuda_graph(lambda: [fns[i % len(fns)]() for i in range(n)])
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / n)
    return statistics.median(ts)


def graph_alternations(row: dict, fns: dict, reps: int = 3) -> dict:
    """Probe helper: ``reps`` rounds, each timing every ``name -> [callable per weight set]`` of ``fns`` once with
    ``graph_us`` (so slow drift of the machine hits every variant alike); the list of per-round us goes to
    ``row[name + "_us"]`` (2 decimals). Returns ``row``."""
    for _ in range(reps):
        for name, fl in fns.items():
            row.setdefault(name + "_us", []).append(round(graph_us(fl), 2))
    return row


def probe_args(default_parts: str):
    """Command line of a device probe script: ``--out DIR`` (created) and ``--parts`` (letters of the parts
    to run, default ``default_parts``)."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default=default_parts)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    return args


def probe_doc(script: str, env_keys=()) -> dict:
    """A device probe's result document: ``env`` (``env_info``) with the command that ran it (the set variables of
    ``env_keys``, then ``PYTHONPATH=$PWD python3 <script> <argv>``) and empty ``rows``."""
    import sys

    env = " ".join(f"{k}={os.environ[k]}" for k in env_keys if k in os.environ)
    return {"env": env_info(f"{env} PYTHONPATH=$PWD python3 {script} " + " ".join(sys.argv[1:])), "rows": {}}


def probe_row(doc: dict, key: str, row: dict) -> None:
    """Store one row of a device probe under ``doc['rows'][key]`` and print it (the device log keeps it even if a
    later row faults)."""
    doc.setdefault("rows", {})[key] = row
    print(key, json.dumps(row), flush=True)


def write_probe(doc: dict, out: str, name: str) -> str:
    """Write a probe's ``doc`` to ``out/name`` (JSON); returns the path."""
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path


def run_probe_parts(script: str, parts: dict, default_parts: str, out_name: str) -> dict:
    """The ``main`` of a device probe made of parts: ``parts`` maps a letter to ``fn(doc)``; the letters of
    ``--parts`` (default ``default_parts``) run in ``parts``' order, the document written to ``--out``/``out_name``
    after each. Returns the document."""
    args = probe_args(default_parts)
    doc = probe_doc(script)
    for letter, fn in parts.items():
        if letter in args.parts:
            fn(doc)
            write_probe(doc, args.out, out_name)
    return doc


def sass_summary(sass: str, *, min_loop: int = 100, top: int = 24) -> dict:
    """Instruction counts of ``triton.tools.disasm.get_sass`` text ("LBBn:" labels, "ctrl\tINSTR;" lines): the total,
    the lengths of the loops (backward branches spanning more than ``min_loop`` instructions; a loop's length is the
    SASS per thread per iteration) and the opcode counts of the longest one."""
    import re
    from collections import Counter

    seq, lab, loops = [], {}, []
    for ln in sass.splitlines():
        m = re.match(r"(LBB\d+):", ln)
        if m:
            lab[m.group(1)] = len(seq)
            continue
        m = re.match(r"[0-9a-f-]{2}:\S+\s+(.*?);", ln)
        if m:
            seq.append(m.group(1))
    for i, ins in enumerate(seq):
        m = re.search(r"BRA (LBB\d+)", ins)
        if m and m.group(1) in lab and i - lab[m.group(1)] > min_loop:
            loops.append((i - lab[m.group(1)] + 1, lab[m.group(1)], i))
    out = {"sass_total": len(seq), "sass_loops": [n for n, _, _ in loops],
           "sass_top": dict(Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in seq).most_common(10))}
    if loops:
        _, s0, s1 = max(loops)
        out["loop_ops"] = dict(Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0]
                                       for x in seq[s0:s1 + 1]).most_common(top))
    return out


def rotation_copies(nbytes: int) -> int:
    """How many copies of an ``nbytes`` weight to rotate over so that one pass streams > 2x L2 (the weights
    then come from HBM, as in a real model, not from L2)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, -(-2 * l2 // max(nbytes, 1)) + 1)


def alternate_us(fns_by_name: dict, rounds: int = 5) -> dict:
    """Launch-level A/B: ``graph_us`` of each entry (a callable or a list of callables, see there), the
    entries alternating ``rounds`` times; ``{name: {median, min, max}}`` over the rounds (us)."""
    res = {k: [] for k in fns_by_name}
    for _ in range(rounds):
        for k, f in fns_by_name.items():
            res[k].append(graph_us(f))
    return {k: {"median": round(statistics.median(v), 3), "min": round(min(v), 3), "max": round(max(v), 3)}
            for k, v in res.items()}


def measure_ceilings() -> dict:
    """Measured peaks for rooflines: HBM copy bandwidth (read+write) and dense GEMM rates."""
    dev = "cuda"
    out = {}
    n = 1 << 28  # 512 MiB of bf16 per buffer
    a = torch.randn(n, device=dev, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    t = time_cuda(lambda x, y: y.copy_(x), [(a, b)], warmup=3, reps=20)
    out["hbm_TBps"] = 2 * n * 2 / (t["median_ms"] * 1e-3) / 1e12
    del a, b
    N = 8192
    x = torch.randn(N, N, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, N, device=dev, dtype=torch.bfloat16)
    t = time_cuda(lambda x, w: x @ w.t(), [(x, w)], warmup=3, reps=20)
    out["bf16_TFLOPs"] = 2 * N**3 / (t["median_ms"] * 1e-3) / 1e12
    xf, wf = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    t = time_cuda(lambda x, w: torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                  [(xf, wf)], warmup=3, reps=20)
    out["fp8_TFLOPs"] = 2 * N**3 / (t["median_ms"] * 1e-3) / 1e12
    xi, wi = torch.randint(-127, 128, (N, N), device=dev, dtype=torch.int8), torch.randint(-127, 128, (N, N), device=dev, dtype=torch.int8)
    t = time_cuda(lambda x, w: torch._int_mm(x, w.t()), [(xi, wi)], warmup=3, reps=20)
    out["int8_TOPs"] = 2 * N**3 / (t["median_ms"] * 1e-3) / 1e12
    return out


@dataclass
class Recorder:
    """Collects the rows of one suite and writes ``<suite>.json``, ``.md`` and ``.png``."""

    suite: str
    ceilings: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def record(self, case: dict, provider: str, timing: dict | None, *, flops: float | None = None,
               bytes_moved: float | None = None, peak: str | None = None, error: float | None = None,
               note: str | None = None) -> dict:
        """One measurement. ``case`` names the shape (e.g. {"layer": "qkv", "M": 16}); ``peak`` names
        the compute ceiling ('bf16', 'fp8', 'int8') for the roofline; ``timing`` None = skipped."""
        row = {"case": dict(case), "provider": provider}
        if timing is None:
            row["skipped"] = note or "unavailable"
            self.rows.append(row)
            return row
        row.update(timing)
        sec = timing["median_ms"] * 1e-3
        if flops:
            row["flops"] = flops
            row["TFLOPs"] = flops / sec / 1e12
        if bytes_moved:
            row["bytes"] = bytes_moved
            row["TBps"] = bytes_moved / sec / 1e12
        roof = 0.0
        if flops and peak and f"{peak}_TFLOPs" in self.ceilings:
            roof = max(roof, flops / (self.ceilings[f"{peak}_TFLOPs"] * 1e12))
        if flops and peak == "int8" and "int8_TOPs" in self.ceilings:
            roof = max(roof, flops / (self.ceilings["int8_TOPs"] * 1e12))
        if bytes_moved and "hbm_TBps" in self.ceilings:
            roof = max(roof, bytes_moved / (self.ceilings["hbm_TBps"] * 1e12))
        if roof:
            row["roofline_ms"] = roof * 1e3
            row["frac_roofline"] = roof / sec
        if error is not None:
            row["error"] = error
        if note:
            row["note"] = note
        self.rows.append(row)
        return row

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"note: {text}", flush=True)

    def write(self, out_dir: str | os.PathLike, *, baseline: str | None = None, command: str | None = None) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        doc = {"suite": self.suite, "env": env_info(command), "ceilings": self.ceilings,
               "method": __doc__.split("Method", 1)[1].strip(), "notes": self.notes, "rows": self.rows}
        (out / f"{self.suite}.json").write_text(json.dumps(doc, indent=1, default=float))
        (out / f"{self.suite}.md").write_text(markdown_table(doc, baseline=baseline))
        try:
            plot(doc, out / f"{self.suite}.png", baseline=baseline)
        except Exception as exc:  # plotting must never lose the numbers
            print(f"plot failed: {exc}")
        return out / f"{self.suite}.json"


def _case_key(case: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in case.items())


def markdown_table(doc: dict, *, baseline: str | None = None) -> str:
    """Cases as rows, providers as columns (median ms); with ``baseline``, speedups too."""
    rows = doc["rows"]
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    cases = list(dict.fromkeys(_case_key(r["case"]) for r in rows))
    cell = {(_case_key(r["case"]), r["provider"]): r for r in rows}
    env = doc["env"]
    lines = [f"# {doc['suite']}", "",
             f"{env.get('gpu', 'cpu')} ({env.get('sm_count')} SMs), torch {env['torch']}, triton {env.get('triton')}, "
             f"CUDA {env.get('cuda')}, {env['date']}", "", f"Command: `{env['command']}`", "",
             "Median ms (TFLOP/s or TB/s; speedup vs " + (baseline or "-") + ")", ""]
    lines.append("| case | " + " | ".join(providers) + " |")
    lines.append("|---|" + "---|" * len(providers))
    for c in cases:
        base = cell.get((c, baseline))
        vals = []
        for p in providers:
            r = cell.get((c, p))
            if r is None:
                vals.append("")
            elif "skipped" in r:
                vals.append("skip")
            else:
                s = f"{r['median_ms']:.4f}"
                if "TFLOPs" in r:
                    s += f" ({r['TFLOPs']:.0f} TF/s)"
                elif "TBps" in r:
                    s += f" ({r['TBps']:.2f} TB/s)"
                if base is not None and "median_ms" in base and p != baseline:
                    s += f" **{base['median_ms'] / r['median_ms']:.2f}x**"
                vals.append(s)
        lines.append(f"| {c} | " + " | ".join(vals) + " |")
    if doc.get("ceilings"):
        lines += ["", "Ceilings measured in this run: " + ", ".join(f"{k} {v:.2f}" for k, v in doc["ceilings"].items())]
    for n in doc.get("notes", []):
        lines.append(f"- {n}")
    return "\n".join(lines) + "\n"


def plot(doc: dict, path, *, baseline: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if "median_ms" in r]
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    cases = list(dict.fromkeys(_case_key(r["case"]) for r in rows))
    cell = {(_case_key(r["case"]), r["provider"]): r["median_ms"] for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(cases) * max(1, len(providers)) ** 0.5), 5))
    width = 0.8 / max(1, len(providers))
    for j, p in enumerate(providers):
        ys = []
        for c in cases:
            v = cell.get((c, p))
            b = cell.get((c, baseline)) if baseline else None
            ys.append((b / v if (b and v) else 0.0) if baseline else (v or 0.0))
        ax.bar([i + j * width for i in range(len(cases))], ys, width, label=p)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    ax.set_xticklabels(cases, rotation=75, fontsize=6)
    ax.set_ylabel(f"speedup vs {baseline}" if baseline else "median ms")
    if not baseline:
        ax.set_yscale("log")
    else:
        ax.axhline(1.0, color="k", lw=0.5)
    ax.set_title(f"{doc['suite']} on {doc['env'].get('gpu', 'cpu')}")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def gemm_flops(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k


def attention_flops(b: int, h: int, sq: int, skv: int, d: int, causal: bool) -> float:
    """4*B*H*Sq*Skv*D, halved for causal (square case), the convention of ANCHORS and FlashAttention."""
    f = 4.0 * b * h * sq * skv * d
    return f / 2 if causal else f


def geomean(xs) -> float:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")
