#!/usr/bin/env bash
# Installs libdsv4 for C and C++ hosts under a prefix:
#
#   bash scripts/install.sh [--lib PATH] PREFIX
#
#   PREFIX/lib/libdsv4.so.<ABI major>.<ABI minor>.0    the library (SONAME libdsv4.so.<major>)
#   PREFIX/lib/libdsv4.so.<major> -> the file above    what linked programs load
#   PREFIX/lib/libdsv4.so -> libdsv4.so.<major>        what -ldsv4 finds at link time
#   PREFIX/include/dsv4.h, PREFIX/include/dsv4.hpp     C header, header-only C++ wrapper
#   PREFIX/lib/pkgconfig/dsv4.pc                       pkg-config --cflags --libs dsv4
#   PREFIX/lib/cmake/dsv4/dsv4Config.cmake             find_package(dsv4) -> dsv4::dsv4
#   PREFIX/lib/cmake/dsv4/dsv4ConfigVersion.cmake
#
# The files are made from the templates in packaging/. The ABI version is read from
# include/dsv4.h (DSV4_ABI_VERSION_MAJOR/_MINOR), the package version from Cargo.toml.
# Without --lib, it runs `cargo build --release --locked --lib` (nothing to do when up to
# date) and installs ${CARGO_TARGET_DIR:-target}/release/libdsv4.so; with --lib it builds
# nothing and installs PATH. $DESTDIR, if set, is prepended to every installed path (for
# staging a package); the paths written into dsv4.pc stay PREFIX. The library must carry
# the SONAME libdsv4.so.<major> (build.rs sets it): checked with readelf when present.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

usage() { echo "usage: $0 [--lib PATH] PREFIX" >&2; exit 2; }
lib=
while [ $# -gt 0 ]; do
  case "$1" in
    --lib) [ $# -ge 2 ] || usage; lib=$2; shift 2 ;;
    --lib=*) lib=${1#--lib=}; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) usage ;;
    *) break ;;
  esac
done
[ $# -eq 1 ] || usage
prefix=$1
case "$prefix" in
  /*) ;;
  *) mkdir -p "$prefix"; prefix=$(cd "$prefix" && pwd) ;;
esac
prefix=${prefix%/}
[ -n "$prefix" ] || { echo "install.sh: refusing to install into /" >&2; exit 2; }

if [ -z "$lib" ]; then
  (cd "$root" && cargo build --release --locked --lib)
  lib=${CARGO_TARGET_DIR:-$root/target}/release/libdsv4.so
fi
[ -f "$lib" ] || { echo "install.sh: no library at $lib" >&2; exit 1; }

header=$root/include/dsv4.h
define() {
  local v
  v=$(sed -n "s/^#define $1 \([0-9][0-9]*\)\$/\1/p" "$header")
  [ -n "$v" ] || { echo "install.sh: no '#define $1 N' in $header" >&2; exit 1; }
  echo "$v"
}
abi_major=$(define DSV4_ABI_VERSION_MAJOR)
abi_minor=$(define DSV4_ABI_VERSION_MINOR)
version=$(sed -n '/^\[package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' "$root/Cargo.toml" | head -n1)
description=$(sed -n '/^\[package\]/,/^\[/s/^description *= *"\(.*\)"/\1/p' "$root/Cargo.toml" | head -n1)
[ -n "$version" ] || { echo "install.sh: no package version in Cargo.toml" >&2; exit 1; }
soname=libdsv4.so.$abi_major
case $(od -An -tu1 -j4 -N1 "$lib" | tr -d ' ') in # ELF class: 1 = 32-bit, 2 = 64-bit
  1) sizeof_void_p=4 ;;
  2) sizeof_void_p=8 ;;
  *) echo "install.sh: $lib is not an ELF file" >&2; exit 1 ;;
esac
realname=libdsv4.so.$abi_major.$abi_minor.0

if command -v readelf >/dev/null 2>&1; then
  have=$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\].*/\1/p')
  if [ "$have" != "$soname" ]; then
    echo "install.sh: $lib has SONAME '${have:-none}', expected $soname (rebuild: cargo build --release)" >&2
    exit 1
  fi
else
  echo "install.sh: readelf not found; SONAME of $lib not checked" >&2
fi

dest=${DESTDIR:-}$prefix
libdir=$dest/lib
mkdir -p "$libdir/pkgconfig" "$libdir/cmake/dsv4" "$dest/include"

# Library: a new file then rename, so a running program that maps the old one is unharmed.
cp "$lib" "$libdir/.$realname.tmp"
chmod 0755 "$libdir/.$realname.tmp"
mv -f "$libdir/.$realname.tmp" "$libdir/$realname"
ln -sfn "$realname" "$libdir/$soname"
ln -sfn "$soname" "$libdir/libdsv4.so"

install -m 0644 "$header" "$dest/include/dsv4.h"
install -m 0644 "$root/bindings/cpp/dsv4.hpp" "$dest/include/dsv4.hpp"

subst() { # template output
  local esc_prefix esc_desc
  esc_prefix=$(printf '%s' "$prefix" | sed 's/[&|\\]/\\&/g')
  esc_desc=$(printf '%s' "$description" | sed 's/[&|\\]/\\&/g')
  sed -e "s|@PREFIX@|$esc_prefix|g" -e "s|@VERSION@|$version|g" -e "s|@DESCRIPTION@|$esc_desc|g" \
      -e "s|@ABI_MAJOR@|$abi_major|g" -e "s|@ABI_MINOR@|$abi_minor|g" -e "s|@SONAME@|$soname|g" \
      -e "s|@LIB_REALNAME@|$realname|g" -e "s|@SIZEOF_VOID_P@|$sizeof_void_p|g" \
      "$1" >"$2.tmp"
  if grep -n '@[A-Z_]*@' "$2.tmp" >&2; then
    echo "install.sh: unsubstituted placeholder in $2 (from $1)" >&2
    rm -f "$2.tmp"
    exit 1
  fi
  chmod 0644 "$2.tmp"
  mv -f "$2.tmp" "$2"
}
subst "$root/packaging/dsv4.pc.in" "$libdir/pkgconfig/dsv4.pc"
subst "$root/packaging/dsv4Config.cmake.in" "$libdir/cmake/dsv4/dsv4Config.cmake"
subst "$root/packaging/dsv4ConfigVersion.cmake.in" "$libdir/cmake/dsv4/dsv4ConfigVersion.cmake"

echo "installed dsv4 $version (ABI $abi_major.$abi_minor, SONAME $soname) into $dest:"
echo "  lib/$realname, lib/$soname, lib/libdsv4.so, include/dsv4.h, include/dsv4.hpp,"
echo "  lib/pkgconfig/dsv4.pc, lib/cmake/dsv4/dsv4Config.cmake, lib/cmake/dsv4/dsv4ConfigVersion.cmake"
