#!/usr/bin/env bash
# Runs every test of dsv4 on this machine: Rust unit + integration tests (CPU reference
# vs the transformers fixtures, the C ABI bad-input matrix, header drift, C/C++ programs),
# then the Python binding tests and `pip install ./bindings/python` into a fresh venv.
# GPU-only tests print "skipped: no CUDA device" here.
#
# Python: uses $DSV4_PYTHON if set, else a venv at target/pyenv with numpy + pytest
# (created on first use; needs network access to PyPI once). target/pyenv also holds NVRTC
# (nvidia-cuda-nvrtc==13.0.88) for the kernel compile test, unless DSV4_CUDA_LIB_DIR is set,
# nvdisasm (nvidia-cuda-nvdisasm==13.2.86) for its SASS checks, unless DSV4_NVDISASM is set,
# and cmake, ninja and pkgconf for the packaging test (its bin/ is on PATH for cargo test).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo build --release (cdylib + CLI)"
cargo build --release --locked

echo "== dsv4 demo (smoke)"
target/release/dsv4 demo

ensure_pyenv() {
  if [ ! -x target/pyenv/bin/python ]; then
    python3 -m venv target/pyenv
    target/pyenv/bin/pip install --quiet --disable-pip-version-check numpy pytest
  fi
}

# NVRTC for tests/kernels_compile.rs, which compiles every kernel to sm_90a CUBIN with no GPU:
# pip's nvidia-cuda-nvrtc in target/pyenv, its lib directory (nvidia/cu13/lib) given to the
# library as DSV4_CUDA_LIB_DIR, NOT on LD_LIBRARY_PATH: the library finds it by itself
# (src/cuda/libs.rs), and kernels_compile checks that it came from there. DSV4_CUDA_LIB_DIR
# (or DSV4_NVRTC_LIB) = <dir holding libnvrtc.so.13> uses an existing install.
nvrtc_lib=${DSV4_CUDA_LIB_DIR:-${DSV4_NVRTC_LIB:-}}
if [ -z "$nvrtc_lib" ]; then
  ensure_pyenv
  if ! target/pyenv/bin/python -c 'import importlib.metadata as m, sys; sys.exit(m.version("nvidia-cuda-nvrtc") != "13.0.88")' 2>/dev/null; then
    target/pyenv/bin/pip install --quiet --disable-pip-version-check nvidia-cuda-nvrtc==13.0.88
  fi
  nvrtc_lib=$(target/pyenv/bin/python -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))')
fi
export DSV4_CUDA_LIB_DIR="$nvrtc_lib"
echo "== NVRTC: DSV4_CUDA_LIB_DIR=$nvrtc_lib"
# nvdisasm for kernels_compile's SASS checks (do the fast GEMMs keep their wgmmas in flight):
# pip's nvidia-cuda-nvdisasm (PyPI has no 13.0 build; 13.2 reads NVRTC 13.0's sm_90a CUBINs),
# given as DSV4_NVDISASM, unless that is set.
if [ -z "${DSV4_NVDISASM:-}" ]; then
  ensure_pyenv
  if ! target/pyenv/bin/python -c 'import importlib.metadata as m, sys; sys.exit(m.version("nvidia-cuda-nvdisasm") != "13.2.86")' 2>/dev/null; then
    target/pyenv/bin/pip install --quiet --disable-pip-version-check nvidia-cuda-nvdisasm==13.2.86
  fi
  DSV4_NVDISASM=$(target/pyenv/bin/python -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13", "bin", "nvdisasm"))')
fi
export DSV4_NVDISASM
echo "== nvdisasm: DSV4_NVDISASM=$DSV4_NVDISASM"

# Build tools for tests/packaging.rs (scripts/install.sh, then the examples/ built with
# pkg-config and with CMake against the installed package): pip's cmake, ninja and pkgconf
# (its `pkg-config` command) in target/pyenv, whose bin/ goes on PATH for cargo test. With
# CI set, that test fails if any tool is missing (ninja may be missing where make is
# installed). If pip has no pkgconf, a system
# pkg-config is used, or installed with apt-get when running as root.
ensure_pyenv
for pkg in cmake ninja pkgconf; do
  if ! target/pyenv/bin/python -c "import importlib.metadata as m; m.version('$pkg')" 2>/dev/null; then
    target/pyenv/bin/pip install --quiet --disable-pip-version-check "$pkg" ||
      echo "warning: pip install $pkg failed"
  fi
done
if [ ! -x target/pyenv/bin/pkg-config ] && ! command -v pkg-config >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pkgconf
  else
    echo "error: no pkg-config: pip install pkgconf failed, and apt-get needs root" >&2
    exit 1
  fi
fi
[ -x target/pyenv/bin/cmake ] || command -v cmake >/dev/null ||
  echo "warning: no cmake (pip install cmake failed); tests/packaging.rs needs it"
tools_path="$PWD/target/pyenv/bin:$PATH"
echo "== build tools: $(PATH=$tools_path command -v cmake pkg-config ninja | tr '\n' ' ')"

echo "== cargo test --release"
PATH="$tools_path" cargo test --release --locked --all-targets

py=${DSV4_PYTHON:-}
if [ -z "$py" ]; then
  ensure_pyenv
  py=target/pyenv/bin/python
fi
echo "== pytest bindings/python"
DSV4_LIBRARY="$PWD/target/release/libdsv4.so" "$py" -m pytest -q bindings/python/tests

# bench/musts.py (where the issues' performance musts stand, from the committed bench results).
echo "== pytest bench/tests"
"$py" -m pytest -q bench/tests

# The binding as a package, on a fresh venv (target/pkgenv, recreated each run; numpy from
# PyPI or pip's cache): `pip install ./bindings/python`, then import it from outside the
# checkout and check it loads the library DSV4_LIBRARY names.
echo "== pip install ./bindings/python (fresh venv target/pkgenv)"
python3 -m venv --clear target/pkgenv
rm -rf bindings/python/build bindings/python/*.egg-info # setuptools' in-tree leftovers
target/pkgenv/bin/pip install --quiet --disable-pip-version-check ./bindings/python
rm -rf bindings/python/build bindings/python/*.egg-info
root=$PWD
(cd / && DSV4_LIBRARY="$root/target/release/libdsv4.so" "$root/target/pkgenv/bin/python" -c '
import dsv4, os
print(dsv4.library_path(), "|", dsv4.version())
assert dsv4.library_path() == (os.environ["DSV4_LIBRARY"], "DSV4_LIBRARY")
assert "site-packages" in dsv4.__file__, dsv4.__file__
')
