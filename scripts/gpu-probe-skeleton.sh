#!/usr/bin/env bash
# Builds and runs bench/probes/wgmma_skeleton.cu (the prefill expert GEMMs' consumer loop alone) on the
# GPU machine with nvcc. CONSTS: a directory holding the generated dsv4_consts.cuh (on the build machine:
# DSV4_DUMP_CUBIN_DIR=dir cargo test --release --test kernels_compile every_family). Writes
# $OUT/skeleton.jsonl (one line per case) and $OUT/skeleton_build.log.
# usage: OUT=dir CONSTS=dir bash scripts/gpu-probe-skeleton.sh [FP8 peak TFLOP/s for the ratios]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
consts=${CONSTS:?CONSTS=dir holding dsv4_consts.cuh}
nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I kernels -I "$consts" bench/probes/wgmma_skeleton.cu -o "$OUT/skel" \
  >"$OUT/skeleton_build.log" 2>&1 || { echo "nvcc failed (skeleton_build.log)"; exit 1; }
"$OUT/skel" "$@" | tee "$OUT/skeleton.jsonl"
rc=${PIPESTATUS[0]}
rm -f "$OUT/skel"
exit "$rc"
