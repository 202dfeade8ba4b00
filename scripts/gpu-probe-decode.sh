#!/usr/bin/env bash
# Builds and runs the decode MoE probes with nvcc on the GPU machine:
#   bench/probes/decode_consumer.cu  the decode expert GEMMs' consumer loop alone, on one stage in shared
#                                    memory (needs CONSTS: a directory holding the generated dsv4_consts.cuh;
#                                    on the build machine: DSV4_DUMP_CUBIN_DIR=dir cargo test --release
#                                    --test kernels_compile every_family)
#   bench/probes/tma_stream.cu       the TMA weight stream alone, in several box shapes and ring depths
# Writes $OUT/decode_consumer.jsonl, $OUT/tma_stream.jsonl and the build logs. Without CONSTS only the
# stream probe runs.
# usage: OUT=dir [CONSTS=dir] bash scripts/gpu-probe-decode.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
rc=0
if [ -n "${CONSTS:-}" ]; then
  if nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I kernels -I "$CONSTS" \
    bench/probes/decode_consumer.cu -o "$OUT/dc" >"$OUT/decode_consumer_build.log" 2>&1; then
    "$OUT/dc" | tee "$OUT/decode_consumer.jsonl" || rc=1
    rm -f "$OUT/dc"
  else
    echo "nvcc failed (decode_consumer_build.log)"
    rc=1
  fi
fi
if nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a bench/probes/tma_stream.cu -o "$OUT/ts" -lcuda \
  >"$OUT/tma_stream_build.log" 2>&1; then
  "$OUT/ts" | tee "$OUT/tma_stream.jsonl" || rc=1
  rm -f "$OUT/ts"
else
  echo "nvcc failed (tma_stream_build.log)"
  rc=1
fi
exit "$rc"
