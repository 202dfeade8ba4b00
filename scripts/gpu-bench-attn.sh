#!/usr/bin/env bash
# `dsv4 bench attn` + the HBM ceiling and PyTorch baselines in the same run (scripts/gpu-bench.sh).
# Extra arguments go to `dsv4 bench attn` (e.g. --contexts 65536 --batches 1,64).
exec "$(dirname "$0")/gpu-bench.sh" attn "$@"
