#!/usr/bin/env bash
# ncu profile of chosen kernels of one `dsv4 bench KIND` case on the GPU machine: the first launch
# of each kernel named, with the full section set and per-SASS-instruction stall samples. Builds
# nothing (uses the staged CLI: scripts/gpu-check.sh --stage; DSV4_CLI picks another). For each
# kernel K writes $OUT/K.ncu-rep (open in Nsight Compute), $OUT/K_details.csv (every section's
# metrics) and $OUT/K_sass.csv.gz (the source page: each SASS instruction with its executions and
# stall reasons: where warps wait, on memory, a barrier or a dependency).
# Usage: OUT=dir bash scripts/gpu-profile.sh KIND --kernels K1[,K2...] -- <bench KIND args>
#   e.g. scripts/gpu-profile.sh dense --kernels fd_gemv_t8_kernel -- --projection wq_b --tokens 1
#        scripts/gpu-profile.sh attn --kernels fi_score_kernel -- --contexts 65536 --batches 64
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/gpu-unpack.sh  # the carried pack's binaries (scripts/gpu-unpack.sh)
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
cli=${DSV4_CLI:-target/gpu-bin/dsv4}
kind=${1:?usage: $0 KIND --kernels K1[,K2...] -- <bench args>}
shift
[ "${1:-}" = "--kernels" ] || { echo "usage: $0 KIND --kernels K1[,K2...] -- <bench args>" >&2; exit 2; }
kernels=$2
shift 2
[ "${1:-}" = "--" ] && shift
rc=0
for k in ${kernels//,/ }; do
  ncu --set full --import-source no -k "regex:^${k}\$" -c 1 -o "$OUT/$k" -f \
    "$cli" bench "$kind" "$@" >"$OUT/${k}_ncu.log" 2>&1 || { echo "ncu $k failed (see ${k}_ncu.log)"; rc=1; continue; }
  ncu -i "$OUT/$k.ncu-rep" --page details --csv >"$OUT/${k}_details.csv" 2>&1 || rc=1
  ncu -i "$OUT/$k.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip >"$OUT/${k}_sass.csv.gz" || rc=1
  echo "profiled $k"
done
exit $rc
