"""Device script: the peers of ../shared/ANCHORS.md through lowbit's harness (foundation check)."""
import argparse
import sys

from lowbit.bench import runner

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--quick", action="store_true")
a = ap.parse_args()
sys.exit(runner.run_suites(["anchors"], a.out, quick=a.quick))
