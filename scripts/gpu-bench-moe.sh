#!/usr/bin/env bash
# `dsv4 bench moe` and its same-run ceilings + PyTorch baseline (bench/moe_baseline.py), on the
# GPU machine. Builds nothing: uses the staged CLI (scripts/gpu-check.sh --stage puts it in
# target/gpu-bin). Writes $OUT/moe_cases.jsonl (the bench's lines), $OUT/moe.json (cases with
# ceilings, floors and ratios: the file to commit as bench/results/<date>-moe.json) and logs.
# Extra arguments go to `dsv4 bench moe` (e.g. --batches 1,8 --routing uniform).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/gpu-unpack.sh  # the carried pack's binaries (scripts/gpu-unpack.sh)
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
cli=${DSV4_CLI:-target/gpu-bin/dsv4}
# The build's commit (scripts/gpu-bench.sh says why it is read beside the CLI).
commit=${DSV4_COMMIT:-$(cat "$(dirname "$cli")/COMMIT" 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)}
ids=$(mktemp -d)
"$cli" bench moe --ids-dir "$ids" "$@" >"$OUT/moe_cases.jsonl" 2>"$OUT/moe_bench.log"
rc=$?
echo "dsv4 bench moe: rc=$rc"
if [ $rc -eq 0 ]; then
  python3 bench/moe_baseline.py --cases "$OUT/moe_cases.jsonl" --ids-dir "$ids" --out "$OUT/moe.json" \
    --commit "$commit" >"$OUT/moe_baseline.log" 2>&1
  rc=$?
  echo "moe_baseline.py: rc=$rc"
fi
rm -rf "$ids"
exit $rc
