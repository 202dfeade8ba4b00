#!/usr/bin/env bash
# Writes the dummy weights of a config as a safetensors checkpoint in the release's format
# (FP8 codes + UE8M0 scales, packed FP4 experts + UE8M0 scales, BF16, I32), to measure real
# checkpoint loads without a download (issue 14; BENCHMARKS.md "loading without a host copy").
# A load of it holds exactly the bytes of `dsv4_load` DUMMY (`dsv4 bench load --checksum 1`).
#
#   bash scripts/write-dummy-checkpoint.sh CONFIG OUT_DIR     # e.g. configs/flash-shaped-4-layers.json
#
# Uses $DSV4_CLI (default target/gpu-bin/dsv4, else target/release/dsv4). A Flash-shaped layer
# takes ~4.1 GB on disk; the tool holds one layer in memory at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { echo "usage: $0 CONFIG OUT_DIR" >&2; exit 2; }
cli=${DSV4_CLI:-target/gpu-bin/dsv4}
[ -x "$cli" ] || cli=target/release/dsv4
exec "$cli" dummy-checkpoint --config "$1" --out "$2"
