#!/usr/bin/env bash
# Runs the commands given (a bash command line) with OUT set to $OUT/r, then packs $OUT/r into
# $OUT/r.tar.xz, so that everything they wrote comes back from a device call in one file (the
# device tool returns at most 8 files of $OUT: the tar first, then the summary below). Packs again
# after the command is killed by its own `timeout` or fails, and prints the newest 40 lines of
# every *summary*.txt / summary.json the commands wrote, so the call's output shows the results.
# usage: OUT=... bash scripts/gpu-bundle.sh 'bash scripts/gpu-check.sh; bash scripts/gpu-bench-attn.sh'
#   here: tar xJf /work/.device/N/r.tar.xz -C some/dir
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: OUT=dir $0 'command line'" >&2; exit 2; }
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT/r"
top=$(cd "$OUT" && pwd)
pack() { tar cJf "$top/r.tar.xz" -C "$top" r 2>/dev/null; }
trap pack EXIT
OUT="$top/r" bash -c "$1"
rc=$?
pack
find "$top/r" \( -name '*summary*.txt' -o -name 'summary.json' \) -print0 2>/dev/null |
  while IFS= read -r -d '' f; do echo "== ${f#"$top"/}"; tail -n 40 "$f"; done
echo "gpu-bundle: rc=$rc, packed $top/r.tar.xz ($(du -h "$top/r.tar.xz" | cut -f1))"
exit $rc
