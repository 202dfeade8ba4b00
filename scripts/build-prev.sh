#!/usr/bin/env bash
# Builds the `dsv4` CLI of another revision for same-call before/after benchmarks, on the build
# machine, without touching the working tree or its build: a detached git worktree of REV under
# target/prev-src/, built in its own target directory (target/prev-target: the first build
# compiles the dependencies once, ~2 min on 2 cores; later ones only the crate). It must not share
# this tree's target directory: cargo gives both trees' crate the same artifact names, so the
# other build would replace this tree's binaries while cargo still counts them as fresh. The
# binary goes to target/gpu-prev/NAME (and REV's commit to NAME.COMMIT);
# `scripts/gpu-check.sh --stage` packs target/gpu-prev with the test binaries, and the device
# scripts take it as `prev=target/gpu-prev/NAME` (gpu-step-compare.sh, a bench loop).
# usage: scripts/build-prev.sh [REV] [NAME]      (defaults: main, dsv4)
#   e.g. scripts/build-prev.sh main && scripts/build-prev.sh HEAD~2 dsv4-mid
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:-main}
name=${2:-dsv4}
hash=$(git rev-parse --short "$rev^{commit}")
target=$(realpath -m "${CARGO_TARGET_DIR:-target}")
src="$target/prev-src/$hash"
if [ ! -d "$src" ]; then
  git worktree prune
  git worktree add --detach "$src" "$hash" >/dev/null
fi
# Touch the crate root so cargo rebuilds (and copies out) this revision's binary: the revisions share
# prev-target, and a worktree built once before counts as fresh even after another revision's build
# has replaced prev-target/release/dsv4 (that copied the wrong binary).
touch "$src/src/lib.rs"
(cd "$src" && CARGO_TARGET_DIR="$target/prev-target" cargo build --release --bin dsv4)
mkdir -p "$target/gpu-prev"
cp "$target/prev-target/release/dsv4" "$target/gpu-prev/$name"
echo "$hash" >"$target/gpu-prev/$name.COMMIT"
echo "built $rev ($hash) -> $target/gpu-prev/$name"
