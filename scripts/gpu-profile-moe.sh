#!/usr/bin/env bash
# ncu profile of the fast MoE's kernels (scripts/gpu-profile.sh for `dsv4 bench moe`; default
# kernels: the prefill GEMMs).
# Usage: OUT=dir bash scripts/gpu-profile-moe.sh [--kernels fmw_up_kernel,fmw_down_kernel] -- <bench moe args>
#   e.g. -- --batches 4096 --routing uniform --path prefill
kernels=fmw_up_kernel,fmw_down_kernel
if [ "${1:-}" = "--kernels" ]; then kernels=$2; shift 2; fi
[ "${1:-}" = "--" ] && shift
exec "$(dirname "$0")/gpu-profile.sh" moe --kernels "$kernels" -- "$@"
