#!/usr/bin/env bash
# GPU check: the ONE script the GPU machine runs. It builds nothing: it runs the PREBUILT GPU
# test binaries (tests/gpu_*.rs) with --nocapture; the prebuilt `dsv4 demo --device cuda:0`
# with LD_LIBRARY_PATH UNSET (the library must find libcuda and NVRTC by itself,
# src/cuda/libs.rs; its output names the backend and where each library came from); the
# Python binding's torch tests
# (bindings/python/tests/test_torch_cuda.py, and pytest over bindings/python/tests when the
# torch interpreter has pytest) against the staged libdsv4.so; then gpu_runtime and the
# capture / refit tests of gpu_host_contract and every case of gpu_bad_batch under
# `compute-sanitizer --tool memcheck`; and
# writes logs and a summary JSON to $OUT (default ./gpu-out). On the GPU machine
# "skipped: no CUDA device" counts as a FAILURE.
#
# 1. On the build machine (no GPU needed), from the repository root:
#      cargo test --release --no-run                 # builds every test binary
#      bash scripts/gpu-check.sh --stage             # copies the newest gpu_* binaries into
#                                                    # target/gpu-bin/ (ignored by git), debug
#                                                    # info stripped (~1.5 MB each), and
#                                                    # target/release/libdsv4.so and dsv4
#                                                    # (cargo build --release) for the Python
#                                                    # tests and the demo, then packs them
#                                                    # into target/gpu-pack/bin.tar.xz (~5 MB;
#                                                    # with target/gpu-prev if present)
#    --stage looks in $CARGO_TARGET_DIR/release/deps (default target/release/deps); pass
#    `--stage DIR` to copy elsewhere inside the repository.
# 2. Carry target/gpu-pack (or target/gpu-bin) to the GPU machine (with the repository) and run
#    there, from the root (a pack unpacks into target/gpu-bin first):
#      bash scripts/gpu-check.sh                     # OUT=/some/dir to choose where results go
#    Binaries are looked up in $DSV4_GPU_BIN_DIR, else target/gpu-bin, else
#    ${CARGO_TARGET_DIR:-target}/release/deps (newest per test name; *.d files excluded).
#
# NVRTC: the CUDA backend compiles kernels at run time, so libnvrtc.so.13 (and its builtins)
# must be loadable. The library searches for it itself ($DSV4_CUDA_LIB_DIR, $CUDA_HOME,
# /usr/local/cuda, ..., src/cuda/libs.rs); for the test binaries the script also prepends the
# first directory that holds it to LD_LIBRARY_PATH: $DSV4_NVRTC_LIB, python3's nvidia/cu13/lib
# (pip nvidia-cuda-nvrtc, e.g. PyTorch's), then /usr/local/cuda/lib64 and
# /usr/local/cuda/targets/x86_64-linux/lib.
#
# Results in $OUT: gpu-check.log (everything, in order), demo.log, python.log, pytest.log,
# memcheck.log, memcheck_contract.log, memcheck_bad_batch.log, summary.json
# ({"ok": bool, "tests": [{name, status: pass|fail|skipped|timeout, rc, seconds, result}],
#  "demo": {status, rc, libraries}, "memcheck": {...}}). Exit status 0 only if every test and
# the demo passed and memcheck found no error.
# DSV4_GPU_TEST_TIMEOUT (seconds, default 480) bounds each binary; DSV4_SKIP_MEMCHECK=1 skips it.
# DSV4_GPU_TESTS="gpu_fast_dense gpu_parity" runs those test binaries only (as above: one test at a
# time) and no demo, Python or memcheck: a branch's focused check, "partial" in summary.json.
set -uo pipefail
cd "$(dirname "$0")/.."

newest_gpu_bins() { # DIR -> newest executable per gpu_* test name, one path a line
  local dir=$1
  [ -d "$dir" ] || return 0
  find "$dir" -maxdepth 1 -type f -name 'gpu_*' ! -name '*.d' -perm -u+x -printf '%T@ %p\n' 2>/dev/null |
    sort -rn | awk '{ p=$2; n=p; sub(/.*\//, "", n); sub(/-[0-9a-f]+$/, "", n); if (!(n in seen)) { seen[n]=1; print p } }'
}

if [ "${1:-}" = "--stage" ]; then
  dest=${2:-target/gpu-bin}
  src="${CARGO_TARGET_DIR:-target}/release/deps"
  bins=$(newest_gpu_bins "$src")
  if [ -z "$bins" ]; then
    echo "no gpu_* test binaries in $src: run 'cargo test --release --no-run' first" >&2
    exit 1
  fi
  rm -rf "$dest" && mkdir -p "$dest"
  for b in $bins; do
    out="$dest/$(basename "$b")"
    # Debug info makes each binary ~18 MB; without it ~1.5 MB (symbols kept: backtraces still
    # name functions). DSV4_STAGE_KEEP_DEBUG=1 copies them unchanged.
    if [ "${DSV4_STAGE_KEEP_DEBUG:-}" != 1 ] && command -v strip >/dev/null; then
      strip --strip-debug -o "$out" "$b"
    else
      cp -p "$b" "$out"
    fi
    echo "staged $(basename "$b") ($(du -h "$out" | cut -f1))"
  done
  lib="${CARGO_TARGET_DIR:-target}/release/libdsv4.so"
  if [ -f "$lib" ]; then
    if command -v strip >/dev/null; then strip --strip-debug -o "$dest/libdsv4.so" "$lib"; else cp -p "$lib" "$dest/"; fi
    echo "staged libdsv4.so ($(du -h "$dest/libdsv4.so" | cut -f1))"
  else
    echo "note: $lib not built (cargo build --release): the Python GPU tests will not run" >&2
  fi
  cli="${CARGO_TARGET_DIR:-target}/release/dsv4"
  if [ -f "$cli" ]; then
    if command -v strip >/dev/null; then strip --strip-debug -o "$dest/dsv4" "$cli"; else cp -p "$cli" "$dest/"; fi
    echo "staged dsv4 ($(du -h "$dest/dsv4" | cut -f1))"
  else
    echo "note: $cli not built (cargo build --release): the demo will not run" >&2
  fi
  # The commit the binaries were built from ("-dirty" with uncommitted changes): the device's
  # copy of the tree may carry another git HEAD, so the benches read it from here.
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  git diff --quiet HEAD 2>/dev/null || commit="$commit-dirty"
  echo "$commit" >"$dest/COMMIT"
  echo "staged COMMIT ($commit)"
  # The staged binaries (~50 MB) are over what a device call carries with the tree (64 MiB);
  # xz packs them to ~5 MB. target/gpu-prev (other revisions' CLIs, for before/after benches:
  # scripts/build-prev.sh) goes in the pack when present.
  pack="${CARGO_TARGET_DIR:-target}/gpu-pack"
  rm -rf "$pack" && mkdir -p "$pack"
  extra=""
  [ -d "${CARGO_TARGET_DIR:-target}/gpu-prev" ] && extra="gpu-prev"
  if tar cJf "$pack/bin.tar.xz" -C "$(dirname "$dest")" "$(basename "$dest")" $extra; then
    echo "packed $pack/bin.tar.xz ($(du -h "$pack/bin.tar.xz" | cut -f1))"
    echo "carry: $pack   (then run: bash scripts/gpu-check.sh; it unpacks the binaries first)"
  else
    echo "carry: $dest   (then run: bash scripts/gpu-check.sh)"
  fi
  exit 0
fi

# A carried pack (--stage above) unpacks next to it: target/gpu-bin (and target/gpu-prev).
bash scripts/gpu-unpack.sh

OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
LOG="$OUT/gpu-check.log"
: >"$LOG"
say() { echo "$*" | tee -a "$LOG"; }

bindir=${DSV4_GPU_BIN_DIR:-}
if [ -z "$bindir" ]; then
  if [ -d target/gpu-bin ]; then bindir=target/gpu-bin; else bindir="${CARGO_TARGET_DIR:-target}/release/deps"; fi
fi
bins=$(newest_gpu_bins "$bindir")
only=${DSV4_GPU_TESTS:-}
if [ -n "$only" ]; then
  bins=$(for b in $bins; do n=$(basename "$b" | sed -E 's/-[0-9a-f]+$//'); case " ${only//,/ } " in *" $n "*) echo "$b" ;; esac; done)
fi

# --- NVRTC on the library path
nvrtc_dir=""
cands=("${DSV4_NVRTC_LIB:-}")
if command -v python3 >/dev/null; then
  cands+=("$(python3 -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null)")
fi
cands+=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib)
for d in "${cands[@]}"; do
  if [ -n "$d" ] && [ -e "$d/libnvrtc.so.13" ]; then nvrtc_dir=$d; break; fi
done
if [ -n "$nvrtc_dir" ]; then export LD_LIBRARY_PATH="$nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi

say "== dsv4 gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
say "binaries from: $bindir"
say "NVRTC lib dir: ${nvrtc_dir:-NOT FOUND (kernels cannot compile)}"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG"
else
  say "nvidia-smi: not found"
fi
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)

json_str() { printf '"%s"' "$(printf '%s' "$1" | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' | tr -d '\n\r\t')"; }

timeout_s=${DSV4_GPU_TEST_TIMEOUT:-480}
tests_json=""
ok=true
for want in ${only//,/ }; do  # a DSV4_GPU_TESTS name that matches no binary fails the check
  case " $(for b in $bins; do basename "$b" | sed -E 's/-[0-9a-f]+$//'; done | tr '\n' ' ') " in
    *" $want "*) ;;
    *) say "ERROR: DSV4_GPU_TESTS names $want: no such gpu_* test binary in $bindir"; ok=false ;;
  esac
done
if [ -z "$bins" ]; then
  say "ERROR: no gpu_* test binaries in $bindir (build: cargo test --release --no-run; bash scripts/gpu-check.sh --stage)"
  ok=false
fi
runtime_bin=""
for b in $bins; do
  name=$(basename "$b" | sed -E 's/-[0-9a-f]+$//')
  [ "$name" = gpu_runtime ] && runtime_bin=$b
  say ""
  say "== $name ($b)"
  tmp=$(mktemp)
  t0=$(date +%s.%N)
  timeout "$timeout_s" "$b" --nocapture --test-threads=1 >"$tmp" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  cat "$tmp" >>"$LOG"
  tail -n 5 "$tmp"
  result=$(grep -E '^test result:' "$tmp" | tail -1)
  if [ $rc -eq 124 ]; then status=timeout
  elif grep -q 'skipped: no CUDA device' "$tmp"; then status=skipped
  elif [ $rc -eq 0 ]; then status=pass
  else status=fail; fi
  rm -f "$tmp"
  [ "$status" = pass ] || ok=false
  say "-> $name: $status (rc $rc)"
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  tests_json+="${tests_json:+,}{\"name\":$(json_str "$name"),\"binary\":$(json_str "$b"),\"status\":\"$status\",\"rc\":$rc,\"seconds\":$secs,\"result\":$(json_str "$result")}"
done

# --- dsv4 demo on CUDA with LD_LIBRARY_PATH unset: the library finds libcuda and NVRTC itself
demo_json='{"status":"not run"}'
demo="$bindir/dsv4"
[ -x "$demo" ] || demo="${CARGO_TARGET_DIR:-target}/release/dsv4"
if [ -n "$only" ]; then
  demo_json='{"status":"not run (DSV4_GPU_TESTS)"}'
elif [ ! -x "$demo" ]; then
  say "demo: no dsv4 binary staged"
  demo_json='{"status":"not run: no dsv4 binary"}'
  ok=false
else
  say ""
  say "== env -u LD_LIBRARY_PATH $demo demo --device cuda:0"
  env -u LD_LIBRARY_PATH timeout "$timeout_s" "$demo" demo --device cuda:0 >"$OUT/demo.log" 2>&1
  rc=$?
  cat "$OUT/demo.log" >>"$LOG"
  head -n 3 "$OUT/demo.log"
  libs=$(grep -E '^CUDA libraries:' "$OUT/demo.log" | head -1)
  say "$libs"
  # Must have run on CUDA (the demo falls back to the CPU when CUDA is unavailable).
  if [ $rc -eq 124 ]; then dstatus=timeout
  elif [ $rc -eq 0 ] && grep -q 'backend: CUDA device 0' "$OUT/demo.log" && [ -n "$libs" ]; then dstatus=pass
  else dstatus=fail; fi
  [ "$dstatus" = pass ] || ok=false
  say "-> demo without LD_LIBRARY_PATH: $dstatus (rc $rc)"
  demo_json="{\"status\":\"$dstatus\",\"rc\":$rc,\"libraries\":$(json_str "$libs"),\"log\":\"demo.log\"}"
fi

# --- Python binding with torch (CUDA tensors, torch streams, torch.cuda.CUDAGraph)
py_json='{"status":"not run"}'
pylib="$bindir/libdsv4.so"
[ -f "$pylib" ] || pylib="${CARGO_TARGET_DIR:-target}/release/libdsv4.so"
torch_py=""
for c in "${DSV4_TORCH_PYTHON:-}" /opt/torch/.venv/bin/python python3; do
  if [ -n "$c" ] && command -v "$c" >/dev/null && "$c" -c 'import torch, numpy' 2>/dev/null; then torch_py=$c; break; fi
done
if [ -n "$only" ]; then
  py_json='{"status":"not run (DSV4_GPU_TESTS)"}'
elif [ ! -f "$pylib" ]; then
  say "python: no libdsv4.so staged"
  py_json='{"status":"not run: no libdsv4.so"}'
  ok=false
elif [ -z "$torch_py" ]; then
  say "python: no interpreter with torch + numpy"
  py_json='{"status":"not run: no torch"}'
  ok=false
else
  pylib=$(cd "$(dirname "$pylib")" && pwd)/$(basename "$pylib")
  say ""
  say "== $torch_py bindings/python/tests/test_torch_cuda.py (DSV4_LIBRARY=$pylib)"
  DSV4_LIBRARY="$pylib" timeout "$timeout_s" "$torch_py" bindings/python/tests/test_torch_cuda.py >"$OUT/python.log" 2>&1
  rc=$?
  tail -n 12 "$OUT/python.log" | tee -a "$LOG"
  if [ $rc -eq 124 ]; then pstatus=timeout
  elif grep -q 'skipped: no CUDA device' "$OUT/python.log"; then pstatus=skipped
  elif [ $rc -eq 0 ]; then pstatus=pass
  else pstatus=fail; fi
  [ "$pstatus" = pass ] || ok=false
  say "-> python torch CUDA: $pstatus (rc $rc)"
  pt_status="not run: no pytest"
  if "$torch_py" -c 'import pytest' 2>/dev/null; then
    say "== pytest bindings/python/tests"
    DSV4_LIBRARY="$pylib" timeout "$timeout_s" "$torch_py" -m pytest -q -rs bindings/python/tests >"$OUT/pytest.log" 2>&1
    prc=$?
    tail -n 6 "$OUT/pytest.log" | tee -a "$LOG"
    if [ $prc -eq 0 ]; then pt_status=pass; else pt_status=fail; ok=false; fi
    say "-> pytest: $pt_status (rc $prc)"
  fi
  py_json="{\"status\":\"$pstatus\",\"rc\":$rc,\"python\":$(json_str "$torch_py"),\"log\":\"python.log\",\"pytest\":$(json_str "$pt_status")}"
fi

# --- compute-sanitizer memcheck on the runtime tests
mc_json='{"status":"not run"}'
sanitizer=$(command -v compute-sanitizer || true)
for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  [ -z "$sanitizer" ] && [ -x "$c" ] && sanitizer=$c
done
if [ -n "$only" ]; then
  mc_json='{"status":"not run (DSV4_GPU_TESTS)"}'
elif [ "${DSV4_SKIP_MEMCHECK:-}" = 1 ]; then
  mc_json='{"status":"skipped (DSV4_SKIP_MEMCHECK=1)"}'
elif [ -z "$runtime_bin" ]; then
  mc_json='{"status":"not run: no gpu_runtime binary"}'
  ok=false
elif [ -z "$sanitizer" ]; then
  say "compute-sanitizer: not found"
  mc_json='{"status":"not run: compute-sanitizer not found"}'
  ok=false
else
  say ""
  say "== $sanitizer --tool memcheck $runtime_bin"
  DSV4_UNDER_SANITIZER=1 timeout "$timeout_s" "$sanitizer" --tool memcheck --leak-check full \
    --error-exitcode 99 "$runtime_bin" --nocapture --test-threads=1 >"$OUT/memcheck.log" 2>&1
  rc=$?
  summary=$(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)
  tail -n 5 "$OUT/memcheck.log" | tee -a "$LOG"
  if [ $rc -eq 0 ]; then mstatus=pass; elif [ $rc -eq 124 ]; then mstatus=timeout; else mstatus=fail; fi
  grep -q 'skipped: no CUDA device' "$OUT/memcheck.log" && mstatus=skipped
  # Graph capture/replay, refit after capture, and loads / refits from device memory (the soak
  # would take too long under memcheck).
  contract_bin=$(printf '%s\n' $bins | grep '/gpu_host_contract-' | head -1)
  if [ -n "$contract_bin" ]; then
    say "== memcheck $contract_bin captured old_graph dummy_then_sync load_tensors a_bad_device"
    DSV4_UNDER_SANITIZER=1 timeout "$timeout_s" "$sanitizer" --tool memcheck --leak-check full \
      --error-exitcode 99 "$contract_bin" --nocapture --test-threads=1 captured old_graph dummy_then_sync load_tensors a_bad_device \
      >"$OUT/memcheck_contract.log" 2>&1
    crc=$?
    csum=$(grep -E 'ERROR SUMMARY' "$OUT/memcheck_contract.log" | tail -1)
    tail -n 3 "$OUT/memcheck_contract.log" | tee -a "$LOG"
    if [ $crc -ne 0 ]; then mstatus=fail; rc=$crc; fi
    summary="$summary; host_contract: $csum"
  fi
  # Every bad-batch and padding case (eager and graph replays): no out-of-bounds access.
  bad_bin=$(printf '%s\n' $bins | grep '/gpu_bad_batch-' | head -1)
  if [ -n "$bad_bin" ]; then
    say "== memcheck $bad_bin"
    DSV4_UNDER_SANITIZER=1 timeout "$timeout_s" "$sanitizer" --tool memcheck --leak-check full \
      --error-exitcode 99 "$bad_bin" --nocapture --test-threads=1 >"$OUT/memcheck_bad_batch.log" 2>&1
    brc=$?
    bsum=$(grep -E 'ERROR SUMMARY' "$OUT/memcheck_bad_batch.log" | tail -1)
    tail -n 3 "$OUT/memcheck_bad_batch.log" | tee -a "$LOG"
    if [ $brc -ne 0 ]; then mstatus=fail; rc=$brc; fi
    summary="$summary; bad_batch: $bsum"
  else
    say "memcheck: no gpu_bad_batch binary"
    mstatus=fail
  fi
  [ "$mstatus" = pass ] || ok=false
  say "-> memcheck: $mstatus (rc $rc) $summary"
  mc_json="{\"status\":\"$mstatus\",\"rc\":$rc,\"summary\":$(json_str "$summary"),\"log\":\"memcheck.log\"}"
fi

cat >"$OUT/summary.json" <<EOF
{"ok":$ok,"partial":$([ -n "$only" ] && echo true || echo false),"date":"$(date -u +%Y-%m-%dT%H:%M:%SZ)","gpu":$(json_str "$gpu"),"nvrtc_dir":$(json_str "$nvrtc_dir"),"binaries":$(json_str "$bindir"),
 "tests":[${tests_json}],
 "demo":$demo_json,
 "python":$py_json,
 "memcheck":$mc_json}
EOF
say ""
say "summary: $OUT/summary.json (ok: $ok)"
$ok
