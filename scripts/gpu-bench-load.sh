#!/usr/bin/env bash
# Issue 14's load measurements on the GPU machine, with the PREBUILT `dsv4` CLI (builds
# nothing). Each step appends JSON lines to $OUT/load.jsonl and its log to $OUT/<step>.log.
#
#   bash scripts/gpu-bench-load.sh [STEP ...]     # default: dummy24 checkpoint maxlayers
#
# Steps:
#   dummy24     create + dummy load + finalize of configs/flash-shaped-24-layers.json on CUDA:
#               host peak RSS (VmHWM) and load GB/s (`dsv4 bench load`).
#   checkpoint  writes configs/flash-shaped-4-layers.json's dummy weights as a safetensors
#               checkpoint ($CKPT_DIR, default /tmp/dsv4-flash4-ckpt; ~21 GB) with
#               scripts/write-dummy-checkpoint.sh, loads it (page cache warm), drops the page cache when
#               allowed (root) and loads it again (cold), then a dummy load of the same config;
#               all with --checksum 1: the checkpoint loads must hash like the dummy load.
#   maxlayers   the most Flash-shaped layers (scripts/flash-shaped-config.py) that one device
#               holds at the step bench's capacities (8192 tokens, 8 sequences): tries N from
#               $MAX_LAYERS_FROM (default 34) down until create succeeds, and runs the step bench
#               (`dsv4 bench --tokens 8192 --decode-batch 1,8 --decode-steps 16`) on it.
# DSV4_CLI: the dsv4 binary (default target/gpu-bin/dsv4).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/gpu-unpack.sh  # the carried pack's binaries (scripts/gpu-unpack.sh)
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
CLI=${DSV4_CLI:-target/gpu-bin/dsv4}
CKPT_DIR=${CKPT_DIR:-/tmp/dsv4-flash4-ckpt}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(dummy24 checkpoint maxlayers)

json() { grep '^{' "$1" | tail -n +1 >> "$OUT/load.jsonl"; }

for step in "${steps[@]}"; do
  log="$OUT/$step.log"
  echo "== $step" | tee -a "$log"
  case $step in
    dummy24)
      "$CLI" bench load --device cuda --config configs/flash-shaped-24-layers.json >"$log.json" 2>>"$log"
      echo "rc=$?" >>"$log"; cat "$log.json" >>"$log"; json "$log.json" ;;
    checkpoint)
      rm -rf "$CKPT_DIR"
      DSV4_CLI="$CLI" /usr/bin/time -v bash scripts/write-dummy-checkpoint.sh configs/flash-shaped-4-layers.json "$CKPT_DIR" >>"$log" 2>&1
      echo "rc=$? (dummy-checkpoint)" >>"$log"
      du -sb "$CKPT_DIR" >>"$log"
      for pass in warm cold; do
        if [ $pass = cold ]; then
          sync; if echo 3 2>/dev/null >/proc/sys/vm/drop_caches; then echo "page cache dropped" >>"$log"; else echo "cannot drop the page cache (not root): second pass is warm too" >>"$log"; fi
        fi
        "$CLI" bench load --device cuda --model "$CKPT_DIR" --checksum 1 >"$log.$pass.json" 2>>"$log"
        echo "rc=$? ($pass)" >>"$log"; cat "$log.$pass.json" >>"$log"; json "$log.$pass.json"
      done
      "$CLI" bench load --device cuda --config configs/flash-shaped-4-layers.json --checksum 1 >"$log.dummy.json" 2>>"$log"
      echo "rc=$? (dummy)" >>"$log"; cat "$log.dummy.json" >>"$log"; json "$log.dummy.json"
      rm -rf "$CKPT_DIR" ;;
    maxlayers)
      for n in $(seq "${MAX_LAYERS_FROM:-34}" -1 1); do
        python3 scripts/flash-shaped-config.py "$n" >"$OUT/flash-$n.json"
        "$CLI" bench --device cuda --config "$OUT/flash-$n.json" --tokens 8192 --decode-batch 1,8 --decode-steps 16 >"$log.$n.json" 2>"$log.$n.err"
        rc=$?
        echo "layers=$n rc=$rc" >>"$log"; cat "$log.$n.err" >>"$log"
        if [ $rc -eq 0 ]; then cat "$log.$n.json" >>"$log"; json "$log.$n.json"; break; fi
        grep -q "of device memory" "$log.$n.err" || break   # stop on anything but "does not fit"
      done ;;
    *) echo "unknown step $step" | tee -a "$log"; exit 2 ;;
  esac
done
