#!/usr/bin/env bash
# `dsv4 bench KIND` and its same-run ceilings + PyTorch baselines (bench/KIND_baseline.py), on the
# GPU machine, for the benches whose baseline script takes only the cases (attn, dense; moe has
# its own script: its bench writes routing files the baseline reads). Builds nothing: uses the
# staged CLI (scripts/gpu-check.sh --stage puts it in target/gpu-bin; DSV4_CLI picks another).
# Writes $OUT/KIND_cases.jsonl (the bench's lines), $OUT/KIND.json (cases with ceilings, floors
# and ratios: the file to commit as bench/results/<date>-KIND.json) and logs.
# usage: scripts/gpu-bench.sh KIND [arguments for `dsv4 bench KIND`]
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/gpu-unpack.sh  # the carried pack's binaries (scripts/gpu-unpack.sh)
kind=${1:?usage: $0 KIND [bench arguments]}
shift
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cli=${DSV4_CLI:-target/gpu-bin/dsv4}
# The build's commit: DSV4_COMMIT, else the one --stage recorded beside the CLI (the device's copy
# of the tree may carry another git HEAD than the one the binaries were built from), else HEAD.
commit=${DSV4_COMMIT:-$(cat "$(dirname "$cli")/COMMIT" 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)}
"$cli" bench "$kind" "$@" >"$OUT/${kind}_cases.jsonl" 2>"$OUT/${kind}_bench.log"
rc=$?
echo "dsv4 bench $kind: rc=$rc"
if [ $rc -eq 0 ]; then
  (cd bench && python3 "${kind}_baseline.py" --cases "$OUT/${kind}_cases.jsonl" --out "$OUT/${kind}.json" \
    --commit "$commit") >"$OUT/${kind}_baseline.log" 2>&1
  rc=$?
  echo "${kind}_baseline.py: rc=$rc"
fi
exit $rc
