#!/usr/bin/env bash
# Build .ab_old/lowbit_old: commit REV's `lowbit` package renamed `lowbit_old` (imports and torch.library namespaces
# too), so a device probe can import both trees in one process and time them side by side on the same inputs
# (session 34, benchmarks/device/s34_nan_ab.py). .ab_old is git-ignored locally (.git/info/exclude); carry it to the
# device with the run tool's `carry: [".ab_old"]` and put it on the path: PYTHONPATH=$PWD:$PWD/.ab_old. Never commit it.
#
#   bash benchmarks/make_ab_tree.sh 541818b
#   bash benchmarks/make_ab_tree.sh $(git stash create) lowbit_wip   # a second copy under another name (session 36)
set -euo pipefail
rev=${1:?usage: make_ab_tree.sh REV [NAME]}
name=${2:-lowbit_old}
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
git archive "$rev" lowbit | tar -x -C "$tmp"
rm -rf ".ab_old/$name" && mkdir -p .ab_old && mv "$tmp/lowbit" ".ab_old/$name" && rm -rf "$tmp"
grep -rl lowbit ".ab_old/$name" | xargs sed -i "s/\blowbit\b/$name/g"
grep -qx ".ab_old" .git/info/exclude 2>/dev/null || echo ".ab_old" >> .git/info/exclude
echo "built .ab_old/$name from $rev ($(du -sh .ab_old | cut -f1))"
