#!/usr/bin/env bash
# Unpacks a carried pack (`scripts/gpu-check.sh --stage` writes target/gpu-pack/bin.tar.xz) next to
# it, into target/gpu-bin (and target/gpu-prev), on the GPU machine. Every device script that reads
# the staged binaries runs this first, so a call may start with any of them, not only gpu-check.sh.
# Does nothing without a pack or once target/gpu-bin is there. Run from the repository root.
set -uo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-target}
pack="$target/gpu-pack/bin.tar.xz"
if [ -f "$pack" ] && [ ! -d "$target/gpu-bin" ]; then
  tar xJf "$pack" -C "$target" || { echo "could not unpack $pack" >&2; exit 1; }
fi
exit 0
