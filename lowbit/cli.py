"""``lowbit`` command line: demo, eval, quantize, generate, bench."""
from __future__ import annotations

import argparse
import sys


def _cmd_bench(args) -> int:
    if args.what == "kernels":
        from lowbit.bench import runner, suites

        names = args.suite or ["anchors"]
        if names == ["all"]:
            names = suites.available()
        return runner.run_suites(names, args.out, quick=args.quick)
    if args.what == "model":
        from lowbit.bench import model as bench_model

        return bench_model.main(args)
    return 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowbit", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench", help="time lowbit's kernels and the peers side by side (GPU)")
    b.add_argument("what", choices=["kernels", "model"], help="kernel suites or whole-model throughput")
    b.add_argument("--suite", action="append", help="suite name (repeatable; 'all' for every suite)")
    b.add_argument("--out", default=None, help="output folder (default benchmarks/results/<gpu>)")
    b.add_argument("--quick", action="store_true", help="fewer shapes")
    b.set_defaults(func=_cmd_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"lowbit {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
