#!/usr/bin/env bash
# The one-token MoE launches' per-block event trace on the GPU machine: `dsv4 bench moe` with the
# kernels' FMOE_TRACE build (kernels/fast_moe_gemm.cu) and `--trace`, then scripts/fmoe-trace.py on
# each case. Builds nothing: uses the staged CLI (scripts/gpu-check.sh --stage). Writes $OUT/trace/
# (one JSON log and its .txt summary a case, the bench's lines) and $OUT/trace_summary.txt (each
# case's headline lines). Arguments go to `dsv4 bench moe`; the default is B = 1 and 2, uniform
# routing, the fused and routed launches. Extra defines: DEFINES=NAME=V,... (FMOE_TRACE=1 is added).
# The prefill GEMMs' trace (kernels/fast_moe_wide.cu FMW_TRACE, scripts/fmw-trace.py) the same way:
#   e.g. DEFINES=FMW_TRACE=1 OUT=... bash scripts/gpu-moe-trace.sh --batches 1024 --routing uniform --path prefill
#   e.g. OUT=... bash scripts/gpu-moe-trace.sh --batches 1 --routing uniform --path decode-routed
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/gpu-unpack.sh  # the carried pack's binaries (scripts/gpu-unpack.sh)
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT/trace"
cli=${DSV4_CLI:-target/gpu-bin/dsv4}
defines="FMOE_TRACE=1${DEFINES:+,$DEFINES}"
[ $# -gt 0 ] || set -- --batches 1,2 --routing uniform --path decode-fused,decode-routed
"$cli" bench moe --defines "$defines" --trace "$OUT/trace" "$@" >"$OUT/trace/bench.jsonl" 2>"$OUT/trace/bench.log"
rc=$?
echo "dsv4 bench moe --trace: rc=$rc"
for f in "$OUT"/trace/fmoe_trace_*.json; do
  [ -e "$f" ] || continue
  python3 scripts/fmoe-trace.py "$f" >"${f%.json}.txt" 2>&1
  grep -E "^==|span|router:|plan|blocks computing|last stored|SM clock|waited for stages|free slots|^  (up|down) " "${f%.json}.txt" | cut -c1-300 >>"$OUT/trace_summary.txt"
done
# The prefill GEMMs' logs (DEFINES=FMW_TRACE=1 and prefill batches): scripts/fmw-trace.py, whole.
for f in "$OUT"/trace/fmw_trace_*.json; do
  [ -e "$f" ] || continue
  python3 scripts/fmw-trace.py "$f" >"${f%.json}.txt" 2>&1
  cat "${f%.json}.txt" >>"$OUT/trace_summary.txt"
done
exit $rc
