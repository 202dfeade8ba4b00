#!/usr/bin/env bash
# Does the consumers' math or the weights' stream set the fast MoE's time? On the GPU machine, one call: the
# fused decode launch and the prefill GEMMs each against their no-math probe (FMOE_PROBE_NO_MATH,
# FMW_PROBE_NO_MATH: consumers release every stage without computing; kernels/fast_moe_gemm.cu and
# fast_moe_wide.cu), alternating rounds (scripts/gpu-ab.sh), then the fused launch's trace at 512 tokens (its
# producers' waits for free slots: scripts/gpu-moe-trace.sh). Builds nothing (the staged CLI). Writes
# $OUT/fused/ and $OUT/prefill/ (ab_summary.txt each), $OUT/trace/ and $OUT/probes_summary.txt.
# FUSED_B / PREFILL_B override the token counts.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/gpu-unpack.sh  # the carried pack's binaries (scripts/gpu-unpack.sh)
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT/fused" "$OUT/prefill"
cli=${DSV4_CLI:-target/gpu-bin/dsv4}
fused=${FUSED_B:-1,64,256,512,576}
prefill=${PREFILL_B:-640,768,1024}
OUT="$OUT/fused" ARGS="--batches $fused --routing uniform --path decode-fused" \
  bash scripts/gpu-ab.sh moe "math=$cli" "nomath=$cli@FMOE_PROBE_NO_MATH=1" >/dev/null 2>&1
echo "fused: rc=$?"
OUT="$OUT/prefill" ARGS="--batches $prefill --routing uniform --path prefill" \
  bash scripts/gpu-ab.sh moe "math=$cli" "nomath=$cli@FMW_PROBE_NO_MATH=1" >/dev/null 2>&1
echo "prefill: rc=$?"
DEFINES=FMOE_TRACE_CAP=262144 bash scripts/gpu-moe-trace.sh --batches 512 --routing uniform --path decode-fused >/dev/null 2>&1
echo "trace: rc=$?"
{
  echo "== fused decode launch, µs: with the math / without"
  grep -v norm "$OUT/fused/ab_summary.txt"
  echo "== prefill GEMMs, µs: with the math / without"
  grep -v norm "$OUT/prefill/ab_summary.txt"
  echo "== trace at 512 tokens"
  cat "$OUT/trace_summary.txt" 2>/dev/null
} >"$OUT/probes_summary.txt"
cat "$OUT/probes_summary.txt"
