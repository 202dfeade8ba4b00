#!/usr/bin/env bash
# `dsv4 bench attn` and its same-run ceilings + PyTorch baselines (bench/attn_baseline.py), on
# the GPU machine. Builds nothing: uses the staged CLI (scripts/gpu-check.sh --stage puts it in
# target/gpu-bin). Writes $OUT/attn_cases.jsonl (the bench's lines), $OUT/attn.json (cases with
# ceilings, floors and ratios: the file to commit as bench/results/<date>-attn.json) and logs.
# Extra arguments go to `dsv4 bench attn` (e.g. --contexts 65536 --batches 1,64).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cli=${DSV4_CLI:-target/gpu-bin/dsv4}
"$cli" bench attn "$@" >"$OUT/attn_cases.jsonl" 2>"$OUT/attn_bench.log"
rc=$?
echo "dsv4 bench attn: rc=$rc"
if [ $rc -eq 0 ]; then
  (cd bench && python3 attn_baseline.py --cases "$OUT/attn_cases.jsonl" --out "$OUT/attn.json" \
    --commit "${DSV4_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}") >"$OUT/attn_baseline.log" 2>&1
  rc=$?
  echo "attn_baseline.py: rc=$rc"
fi
exit $rc
