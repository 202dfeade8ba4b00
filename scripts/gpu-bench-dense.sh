#!/usr/bin/env bash
# `dsv4 bench dense` + the HBM / FP8 ceilings and PyTorch baselines in the same run
# (scripts/gpu-bench.sh). Extra arguments go to `dsv4 bench dense` (e.g. --tokens 1,8
# --projection wq_b; --projection groups for the grouped launches, --projection output_chain for wo_a
# then wo_b chained against the two calls).
exec "$(dirname "$0")/gpu-bench.sh" dense "$@"
