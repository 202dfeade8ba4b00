#!/usr/bin/env bash
# Runs every test of dsv4 on this machine: Rust unit + integration tests (CPU reference
# vs the transformers fixtures, the C ABI bad-input matrix, header drift, C/C++ programs),
# then the Python binding tests. GPU-only tests print "skipped: no CUDA device" here.
#
# Python: uses $DSV4_PYTHON if set, else a venv at target/pyenv with numpy + pytest
# (created on first use; needs network access to PyPI once).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo build --release (cdylib + CLI)"
cargo build --release --locked

echo "== dsv4 demo (smoke)"
target/release/dsv4 demo

echo "== cargo test --release"
cargo test --release --locked --all-targets

py=${DSV4_PYTHON:-}
if [ -z "$py" ]; then
  if [ ! -x target/pyenv/bin/python ]; then
    python3 -m venv target/pyenv
    target/pyenv/bin/pip install --quiet --disable-pip-version-check numpy pytest
  fi
  py=target/pyenv/bin/python
fi
echo "== pytest bindings/python"
DSV4_LIBRARY="$PWD/target/release/libdsv4.so" "$py" -m pytest -q bindings/python/tests
