#!/usr/bin/env bash
# `dsv4 bench dense` and its same-run ceilings + PyTorch baselines (bench/dense_baseline.py), on
# the GPU machine. Builds nothing: uses the staged CLI (scripts/gpu-check.sh --stage puts it in
# target/gpu-bin). Writes $OUT/dense_cases.jsonl (the bench's lines), $OUT/dense.json (cases with
# ceilings, floors and ratios: the file to commit as bench/results/<date>-dense.json) and logs.
# Extra arguments go to `dsv4 bench dense` (e.g. --tokens 1,8 --projection wq_b).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cli=${DSV4_CLI:-target/gpu-bin/dsv4}
"$cli" bench dense "$@" >"$OUT/dense_cases.jsonl" 2>"$OUT/dense_bench.log"
rc=$?
echo "dsv4 bench dense: rc=$rc"
if [ $rc -eq 0 ]; then
  (cd bench && python3 dense_baseline.py --cases "$OUT/dense_cases.jsonl" --out "$OUT/dense.json" \
    --commit "${DSV4_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}") >"$OUT/dense_baseline.log" 2>&1
  rc=$?
  echo "dense_baseline.py: rc=$rc"
fi
exit $rc
