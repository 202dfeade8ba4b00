#!/usr/bin/env bash
# ncu profile of the fast MoE's kernels on the GPU machine: one `dsv4 bench moe` case, the first
# launch of each kernel named, with the full section set and per-SASS-instruction stall samples.
# Builds nothing (uses the staged CLI: scripts/gpu-check.sh --stage). For each kernel K writes
# $OUT/K.ncu-rep (open in Nsight Compute), $OUT/K_details.csv (every section's metrics) and
# $OUT/K_sass.csv.gz (the source page: each SASS instruction with its executions and stall
# reasons; where the consumers wait on a full barrier shows whether the producer keeps up).
# Usage: OUT=dir bash scripts/gpu-profile-moe.sh [--kernels fmw_up_kernel,fmw_down_kernel] -- <bench moe args>
#   e.g. -- --batches 4096 --routing uniform --path prefill
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
cli=${DSV4_CLI:-target/gpu-bin/dsv4}
kernels=fmw_up_kernel,fmw_down_kernel
if [ "${1:-}" = "--kernels" ]; then kernels=$2; shift 2; fi
[ "${1:-}" = "--" ] && shift
rc=0
for k in ${kernels//,/ }; do
  ncu --set full --import-source no -k "regex:^${k}\$" -c 1 -o "$OUT/$k" -f \
    "$cli" bench moe "$@" >"$OUT/${k}_ncu.log" 2>&1 || { echo "ncu $k failed (see ${k}_ncu.log)"; rc=1; continue; }
  ncu -i "$OUT/$k.ncu-rep" --page details --csv >"$OUT/${k}_details.csv" 2>&1 || rc=1
  ncu -i "$OUT/$k.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip >"$OUT/${k}_sass.csv.gz" || rc=1
  echo "profiled $k"
done
exit $rc
